//! HTTP rules (`toPorts[].rules.http`) and TLS server names (`toPorts[].serverNames`) as
//! Cilium 1.16 applies them through Envoy, for the HTTP proxy and `policy simulate` alike.
//!
//! - `method`, `path` and `host` are RE2-style regexes that must match the whole value
//!   (Envoy's `safe_regex` full match on `:method`, `:path` and `:authority`; `:path` holds
//!   the query too, as in Envoy);
//! - `headers` entries are `Name` (present) or `Name value` / `Name: value` (equal), split at
//!   the first space as Cilium's `getHTTPRule` does; names are matched without regard to case;
//! - `headerMatches`: without `mismatch` the header must be present (no value) or equal; with
//!   `LOG` a mismatch is logged, `ADD` adds the header, `DELETE` removes it, `REPLACE` sets it,
//!   and the request goes on (cilium-envoy's `HeaderMatch`);
//! - a request is allowed when any rule of any allowing grant for its peer and port matches,
//!   and a grant without HTTP rules (an L3/L4 allow of the same peer and port) allows every
//!   request; `http: [{}]` allows every request too, and makes them visible.
//!
//! Targets are normalised before matching and forwarded normalised ([`normalize_target`]):
//! what a rule matched is what the server acts on.

use std::sync::Arc;

use std::collections::HashMap;

use regex::{Regex, RegexBuilder, RegexSet, RegexSetBuilder};
use serde::{Deserialize, Serialize};

/// One `http` rule, validated (regex sources as written).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HttpRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<HeaderRequirement>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub header_matches: Vec<HeaderMatch>,
}

/// A `headers` entry: the header must be present, or have this value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeaderRequirement {
    /// Lower case.
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

impl HeaderRequirement {
    /// Cilium's reading of a `headers` entry: split at the first space; the name loses a
    /// trailing `:`; no space: presence only.
    pub fn parse(entry: &str) -> HeaderRequirement {
        match entry.split_once(' ') {
            Some((name, value)) => HeaderRequirement {
                name: name.trim_end_matches(':').to_ascii_lowercase(),
                value: Some(value.to_string()),
            },
            None => HeaderRequirement {
                name: entry.to_ascii_lowercase(),
                value: None,
            },
        }
    }
}

/// What a `headerMatches` entry does when the request's header does not match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Mismatch {
    /// No `mismatch`: the rule does not match.
    Fail,
    Log,
    Add,
    Delete,
    Replace,
}

impl Mismatch {
    pub fn parse(s: &str) -> Option<Mismatch> {
        Some(match s {
            "" => Mismatch::Fail,
            "LOG" => Mismatch::Log,
            "ADD" => Mismatch::Add,
            "DELETE" => Mismatch::Delete,
            "REPLACE" => Mismatch::Replace,
            _ => return None,
        })
    }
}

/// A `headerMatches` entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeaderMatch {
    /// Lower case.
    pub name: String,
    /// Empty: presence.
    #[serde(default)]
    pub value: String,
    pub mismatch: Mismatch,
}

/// The L7 part of one `toPorts` entry the HTTP proxy enforces.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct L7PortRules {
    /// `rules.http`; empty with `server_names`: TLS passthrough judged by its SNI.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub http: Vec<HttpRule>,
    /// `serverNames`: the TLS server names allowed (`*.` prefix: one label or more).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub server_names: Vec<String>,
}

impl L7PortRules {
    /// TLS judged by its server name, not HTTP.
    pub fn is_tls(&self) -> bool {
        self.http.is_empty() && !self.server_names.is_empty()
    }
}

/// The size limit of one compiled rule regex. The policy is rejected (with the field) when a
/// regex exceeds it, so the proxy never meets a rule it cannot compile.
pub const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// A rule regex as Envoy's `safe_regex` applies it: the whole value must match.
pub fn compile_anchored(pattern: &str) -> Result<Regex, String> {
    RegexBuilder::new(&format!("^(?:{pattern})$"))
        .size_limit(REGEX_SIZE_LIMIT)
        .build()
        .map_err(|e| match e {
            regex::Error::CompiledTooBig(limit) => {
                format!("the regular expression is too large (over {limit} bytes compiled)")
            }
            // The parser's message spans lines (the pattern, a caret, the error): one line.
            e => {
                let text = e.to_string();
                let why = text
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("");
                let why = why.trim().trim_start_matches("error: ");
                format!("invalid regular expression {pattern:?}: {why}")
            }
        })
}

/// A regex that is plain text matches by comparison (most methods and many paths).
#[derive(Debug, Clone)]
enum Matcher {
    Literal(String),
    Regex(Regex),
}

impl Matcher {
    fn new(pattern: &str) -> Result<Matcher, String> {
        if !pattern.is_empty() && pattern.chars().all(|c| !is_regex_meta(c)) {
            return Ok(Matcher::Literal(pattern.to_string()));
        }
        compile_anchored(pattern).map(Matcher::Regex)
    }

    fn matches(&self, v: &str) -> bool {
        match self {
            Matcher::Literal(l) => l == v,
            Matcher::Regex(r) => r.is_match(v),
        }
    }
}

fn is_regex_meta(c: char) -> bool {
    matches!(
        c,
        '\\' | '.'
            | '+'
            | '*'
            | '?'
            | '('
            | ')'
            | '|'
            | '['
            | ']'
            | '{'
            | '}'
            | '^'
            | '$'
            | '#'
            | '&'
            | '-'
            | '~'
            | ' '
    )
}

/// The headers of a request, by lower-case name.
pub trait RequestHeaders {
    /// Every value of `name` (lower case), in order.
    fn values(&self, name: &str) -> Vec<&str>;
}

impl RequestHeaders for Vec<(String, String)> {
    fn values(&self, name: &str) -> Vec<&str> {
        self.iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// A request as rules see it.
pub struct RequestView<'a> {
    pub method: &'a str,
    /// Normalised path with its query (`/a/b?x=1`).
    pub path: &'a str,
    /// The authority (`:authority`, or `Host`).
    pub host: &'a str,
    pub headers: &'a dyn RequestHeaders,
}

/// A header change a matching rule asks for (`headerMatches` with ADD, DELETE, REPLACE).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderAction {
    Add(String, String),
    Delete(String),
    Replace(String, String),
}

/// Which rule matched, and what it does to the request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RuleMatch {
    /// Index in the entry's `http` list.
    pub index: usize,
    pub actions: Vec<HeaderAction>,
    /// `LOG` mismatches (`name`), for the flow record.
    pub logged: Vec<String>,
}

#[derive(Debug, Clone)]
struct CompiledRule {
    method: Option<Matcher>,
    path: Option<Matcher>,
    host: Option<Matcher>,
    headers: Vec<HeaderRequirement>,
    header_matches: Vec<HeaderMatch>,
}

/// One `toPorts` entry's HTTP rules, compiled. With many rules, only those whose path can
/// match are tried: each path regex's literal prefixes (`regex-syntax`'s extractor) index it,
/// and a request looks up the prefixes of its own path, one hash lookup per prefix length in
/// use (a thousand rules on distinct paths cost a few lookups and one regex); path regexes
/// without a literal prefix are matched together as one regex set.
#[derive(Debug, Clone)]
pub struct CompiledRules {
    source: Arc<L7PortRules>,
    rules: Vec<CompiledRule>,
    index: Option<PrefixIndex>,
}

/// With this many rules or more, they are indexed by path prefix.
const INDEX_MIN: usize = 8;

/// Rules by the literal prefixes any path they match starts with.
#[derive(Debug, Clone, Default)]
struct PrefixIndex {
    /// Prefix lengths in use, ascending.
    lens: Vec<usize>,
    by_prefix: HashMap<Box<[u8]>, Vec<u32>>,
    /// Rules with no path: always tried.
    always: Vec<u32>,
    /// Rules whose path regex has no usable prefix (`.*/items/[0-9]+`).
    unprefixed: Vec<u32>,
    /// With many of those, one regex set says which of them match (`unprefixed[k]` is the
    /// set's pattern `k`), one pass over the path instead of one regex per rule.
    unprefixed_set: Option<RegexSet>,
}

/// With this many prefix-less path regexes or more, they are matched as one set.
const SET_MIN: usize = 8;
/// The compiled size one such set may reach.
const SET_SIZE_LIMIT: usize = 64 << 20;

impl PrefixIndex {
    fn new(source: &L7PortRules) -> PrefixIndex {
        let mut idx = PrefixIndex::default();
        let mut unprefixed_patterns = Vec::new();
        for (i, r) in source.http.iter().enumerate() {
            let Some(path) = r.path.as_deref() else {
                idx.always.push(i as u32);
                continue;
            };
            match path_prefixes(path) {
                Some(prefixes) => {
                    for p in prefixes {
                        idx.by_prefix
                            .entry(p.into_boxed_slice())
                            .or_default()
                            .push(i as u32);
                    }
                }
                None => {
                    idx.unprefixed.push(i as u32);
                    unprefixed_patterns.push(format!("^(?:{path})$"));
                }
            }
        }
        let mut lens: Vec<usize> = idx.by_prefix.keys().map(|k| k.len()).collect();
        lens.sort_unstable();
        lens.dedup();
        idx.lens = lens;
        // A set too large to build leaves the rules tried one by one: slower, same verdicts.
        if unprefixed_patterns.len() >= SET_MIN {
            idx.unprefixed_set = RegexSetBuilder::new(&unprefixed_patterns)
                .size_limit(
                    REGEX_SIZE_LIMIT
                        .saturating_mul(unprefixed_patterns.len())
                        .min(SET_SIZE_LIMIT),
                )
                .build()
                .ok();
        }
        idx
    }

    /// The rules that may match `path`, in rule order.
    fn candidates(&self, path: &str) -> Vec<u32> {
        let b = path.as_bytes();
        let mut out = self.always.clone();
        match &self.unprefixed_set {
            Some(set) => out.extend(set.matches(path).iter().map(|k| self.unprefixed[k])),
            None => out.extend_from_slice(&self.unprefixed),
        }
        for &len in self.lens.iter().take_while(|l| **l <= b.len()) {
            if let Some(rules) = self.by_prefix.get(&b[..len]) {
                out.extend_from_slice(rules);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// Every literal a match of `pattern` (matched from the start) begins with, when there are
/// few and none is empty; `None`: no usable prefix (the rule is always tried).
fn path_prefixes(pattern: &str) -> Option<Vec<Vec<u8>>> {
    use regex_syntax::hir::literal::{ExtractKind, Extractor};
    let hir = regex_syntax::Parser::new().parse(pattern).ok()?;
    let seq = Extractor::new()
        .kind(ExtractKind::Prefix)
        .limit_total(64)
        .extract(&hir);
    let lits = seq.literals()?;
    if lits.is_empty() || lits.iter().any(|l| l.as_bytes().is_empty()) {
        return None;
    }
    Some(lits.iter().map(|l| l.as_bytes().to_vec()).collect())
}

impl CompiledRules {
    /// Compiles every regex; an error names the rule (`http[i].path`) and why.
    pub fn compile(source: Arc<L7PortRules>) -> Result<CompiledRules, String> {
        let field = |i: usize, f: &str, p: &Option<String>| -> Result<Option<Matcher>, String> {
            p.as_deref()
                .map(Matcher::new)
                .transpose()
                .map_err(|e| format!("http[{i}].{f}: {e}"))
        };
        let mut rules = Vec::with_capacity(source.http.len());
        for (i, r) in source.http.iter().enumerate() {
            rules.push(CompiledRule {
                method: field(i, "method", &r.method)?,
                path: field(i, "path", &r.path)?,
                host: field(i, "host", &r.host)?,
                headers: r.headers.clone(),
                header_matches: r.header_matches.clone(),
            });
        }
        let index = (rules.len() >= INDEX_MIN).then(|| PrefixIndex::new(&source));
        Ok(CompiledRules {
            source,
            rules,
            index,
        })
    }

    pub fn source(&self) -> &Arc<L7PortRules> {
        &self.source
    }

    /// The first rule (in order) the request matches, with its header actions.
    pub fn first_match(&self, req: &RequestView) -> Option<RuleMatch> {
        match &self.index {
            Some(idx) => idx
                .candidates(req.path)
                .into_iter()
                .find_map(|i| self.try_rule(i as usize, req)),
            None => (0..self.rules.len()).find_map(|i| self.try_rule(i, req)),
        }
    }

    fn try_rule(&self, i: usize, req: &RequestView) -> Option<RuleMatch> {
        let r = &self.rules[i];
        if !r.path.as_ref().is_none_or(|m| m.matches(req.path))
            || !r.method.as_ref().is_none_or(|m| m.matches(req.method))
            || !r.host.as_ref().is_none_or(|m| m.matches(req.host))
            || !r.headers.iter().all(|h| header_ok(h, req.headers))
        {
            return None;
        }
        header_matches(i, &r.header_matches, req.headers)
    }
}

fn header_ok(h: &HeaderRequirement, headers: &dyn RequestHeaders) -> bool {
    let values = headers.values(&h.name);
    match &h.value {
        None => !values.is_empty(),
        Some(v) => values.iter().any(|x| x == v),
    }
}

/// cilium-envoy's `HeaderMatch`: a match (presence, or the first value equal) passes; a
/// mismatch fails the rule, or is logged, or changes the header, and the rule goes on.
fn header_matches(
    index: usize,
    matches: &[HeaderMatch],
    headers: &dyn RequestHeaders,
) -> Option<RuleMatch> {
    let mut out = RuleMatch {
        index,
        ..Default::default()
    };
    for m in matches {
        let values = headers.values(&m.name);
        let ok = if m.value.is_empty() {
            !values.is_empty()
        } else {
            values.first().is_some_and(|v| *v == m.value)
        };
        if ok {
            continue;
        }
        match m.mismatch {
            Mismatch::Fail => return None,
            Mismatch::Log => out.logged.push(m.name.clone()),
            Mismatch::Add => out
                .actions
                .push(HeaderAction::Add(m.name.clone(), m.value.clone())),
            Mismatch::Delete => out.actions.push(HeaderAction::Delete(m.name.clone())),
            Mismatch::Replace => out
                .actions
                .push(HeaderAction::Replace(m.name.clone(), m.value.clone())),
        }
    }
    Some(out)
}

/// Whether a TLS server name is one of `names` (exact, case-insensitive; `*.example.com`
/// matches any name ending in `.example.com`).
pub fn server_name_allowed(names: &[String], sni: &str) -> bool {
    let sni = sni.trim_end_matches('.').to_ascii_lowercase();
    names.iter().any(|n| {
        let n = n.trim_end_matches('.').to_ascii_lowercase();
        match n.strip_prefix("*.") {
            Some(suffix) => sni.len() > suffix.len() + 1 && sni.ends_with(&format!(".{suffix}")),
            None => n == sni,
        }
    })
}

/// One allowing contribution for a request's peer and port: the rule, and its L7 part (`None`:
/// an L3/L4 allow, every request passes).
pub struct Grant<'a> {
    /// The rule in `rule_name`'s words (`CiliumNetworkPolicy y/echo[0]`).
    pub rule: &'a str,
    pub rules: Option<&'a CompiledRules>,
}

/// What the HTTP rules say about one request. `grant`: the index of the deciding grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HttpVerdict {
    /// A rule matched: `by` names it (`CiliumNetworkPolicy y/echo[0] http[1]`).
    Allowed {
        by: String,
        grant: usize,
        matched: RuleMatch,
    },
    /// An L3/L4 allow of the same peer and port lets every request through.
    AllowedL4 { by: String, grant: usize },
    /// No rule matched; `considered` lists the rules whose HTTP rules were tried (`grants`
    /// their indexes).
    Denied {
        considered: Vec<String>,
        grants: Vec<usize>,
    },
}

impl HttpVerdict {
    pub fn is_allowed(&self) -> bool {
        !matches!(self, HttpVerdict::Denied { .. })
    }

    /// The rules that decided, for flows and metrics.
    pub fn policies(&self) -> Vec<String> {
        match self {
            HttpVerdict::Allowed { by, .. } | HttpVerdict::AllowedL4 { by, .. } => {
                vec![by.clone()]
            }
            HttpVerdict::Denied { considered, .. } => considered.clone(),
        }
    }
}

/// Judges a request by every grant for its peer and port.
pub fn judge(grants: &[Grant], req: &RequestView) -> HttpVerdict {
    if let Some((i, g)) = grants.iter().enumerate().find(|(_, g)| g.rules.is_none()) {
        return HttpVerdict::AllowedL4 {
            by: g.rule.to_string(),
            grant: i,
        };
    }
    let (mut considered, mut tried) = (Vec::new(), Vec::new());
    for (i, g) in grants.iter().enumerate() {
        let Some(rules) = g.rules else { continue };
        if let Some(m) = rules.first_match(req) {
            return HttpVerdict::Allowed {
                by: format!("{} http[{}]", g.rule, m.index),
                grant: i,
                matched: m,
            };
        }
        if !considered.iter().any(|c| c == g.rule) {
            considered.push(g.rule.to_string());
            tried.push(i);
        }
    }
    HttpVerdict::Denied {
        considered,
        grants: tried,
    }
}

/// A request target, normalised as the proxy matches and forwards it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Path and query (`/a/b?x`); `*` for `OPTIONS *`.
    pub path_and_query: String,
    /// The authority of an absolute-form target (it replaces `Host`).
    pub authority: Option<String>,
}

/// Normalises a request target (Envoy's `normalize_path` and `merge_slashes`, and the
/// absolute form turned into the origin form): percent-encoded unreserved characters are
/// decoded and other escapes upper-cased, dot-segments are removed, repeated slashes merged.
/// The query is kept as it is. Encoded slashes (`%2F`) stay encoded (Envoy's default).
pub fn normalize_target(target: &str) -> Result<Target, &'static str> {
    if target == "*" {
        return Ok(Target {
            path_and_query: "*".into(),
            authority: None,
        });
    }
    let (authority, rest) = match split_absolute(target) {
        Some((a, r)) => (Some(a), r),
        None => (None, target),
    };
    if !rest.starts_with('/') {
        return Err("the request target is neither a path nor an absolute URL");
    }
    let (path, query) = match rest.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (rest, None),
    };
    let path = path.split('#').next().unwrap_or(path);
    let decoded = decode_unreserved(path)?;
    let mut out = merge_slashes(&remove_dot_segments(&decoded));
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok(Target {
        path_and_query: out,
        authority,
    })
}

/// `http://host:port/path` -> (`host:port`, `/path`).
fn split_absolute(target: &str) -> Option<(String, &str)> {
    let lower = target.get(..8)?.to_ascii_lowercase();
    let rest = if lower.starts_with("http://") {
        &target[7..]
    } else if lower.starts_with("https://") {
        &target[8..]
    } else {
        return None;
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let authority = authority.rsplit('@').next().unwrap_or(authority);
    // `http://h` has the path `/` (and `http://h?x` is turned away as no path).
    Some((
        authority.to_string(),
        if tail.is_empty() { "/" } else { tail },
    ))
}

fn decode_unreserved(path: &str) -> Result<String, &'static str> {
    let b = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'%' {
            out.push(b[i] as char);
            i += 1;
            continue;
        }
        let hex = |c: u8| (c as char).to_digit(16);
        let (Some(hi), Some(lo)) = (
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) else {
            return Err("a malformed percent-encoding in the path");
        };
        let c = (hi * 16 + lo) as u8;
        if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~') {
            out.push(c as char);
        } else {
            out.push('%');
            out.push_str(&format!("{c:02X}"));
        }
        i += 3;
    }
    if out.bytes().any(|c| c < 0x21 || c == 0x7f) {
        return Err("a control character or space in the path");
    }
    Ok(out)
}

/// RFC 3986 section 5.2.4.
fn remove_dot_segments(path: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    // A path ending in `.` or `..` names a directory: it keeps a trailing slash.
    let mut trailing = false;
    for s in path.split('/').skip(1) {
        trailing = matches!(s, "." | "..");
        match s {
            "." => {}
            ".." => {
                out.pop();
            }
            s => out.push(s),
        }
    }
    let mut p = String::with_capacity(path.len());
    for s in &out {
        p.push('/');
        p.push_str(s);
    }
    if trailing || p.is_empty() {
        p.push('/');
    }
    p
}

fn merge_slashes(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut prev = false;
    for c in path.chars() {
        if c == '/' && prev {
            continue;
        }
        prev = c == '/';
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(http: Vec<HttpRule>) -> CompiledRules {
        CompiledRules::compile(Arc::new(L7PortRules {
            http,
            server_names: vec![],
        }))
        .unwrap()
    }

    fn rule(method: &str, path: &str) -> HttpRule {
        HttpRule {
            method: Some(method.into()),
            path: Some(path.into()),
            ..Default::default()
        }
    }

    fn req<'a>(
        method: &'a str,
        path: &'a str,
        headers: &'a Vec<(String, String)>,
    ) -> RequestView<'a> {
        RequestView {
            method,
            path,
            host: "echo:8080",
            headers,
        }
    }

    fn h(n: &str, v: &str) -> (String, String) {
        (n.to_string(), v.to_string())
    }

    #[test]
    fn method_path_and_host_must_match_the_whole_value() {
        let r = rules(vec![
            rule("GET", "/$"),
            rule("GET", "/public$"),
            rule("POST", "/p.*"),
        ]);
        let none: Vec<(String, String)> = vec![];
        let m = |method, path| r.first_match(&req(method, path, &none)).map(|m| m.index);
        assert_eq!(m("GET", "/"), Some(0));
        assert_eq!(m("GET", "/public"), Some(1));
        assert_eq!(m("GET", "/public/x"), None, "full match, not a prefix");
        assert_eq!(
            m("GET", "/public?x=1"),
            None,
            ":path holds the query (Envoy)"
        );
        assert_eq!(m("GETX", "/"), None);
        assert_eq!(m("get", "/"), None, "methods are case-sensitive");
        assert_eq!(m("POST", "/private"), Some(2));
        let host = rules(vec![HttpRule {
            host: Some("api\\.example\\.com(:8080)?".into()),
            ..Default::default()
        }]);
        let ok = RequestView {
            method: "GET",
            path: "/",
            host: "api.example.com:8080",
            headers: &none,
        };
        assert!(host.first_match(&ok).is_some());
        let bad = RequestView {
            host: "evil.com/api.example.com",
            ..ok
        };
        assert!(host.first_match(&bad).is_none());
    }

    #[test]
    fn headers_follow_ciliums_split_and_match_names_in_any_case() {
        assert_eq!(
            HeaderRequirement::parse("X-Very-Secret-Token: 42"),
            HeaderRequirement {
                name: "x-very-secret-token".into(),
                value: Some("42".into())
            }
        );
        assert_eq!(HeaderRequirement::parse("X-Present").value, None);
        let r = rules(vec![HttpRule {
            headers: vec![HeaderRequirement::parse("X-Very-Secret-Token: 42")],
            ..rule("GET", "/private$")
        }]);
        let yes = vec![h("x-VERY-secret-token", "42")];
        let no = vec![h("X-Very-Secret-Token", "43")];
        assert!(r.first_match(&req("GET", "/private", &yes)).is_some());
        assert!(r.first_match(&req("GET", "/private", &no)).is_none());
        assert!(r.first_match(&req("GET", "/private", &vec![])).is_none());
    }

    #[test]
    fn header_matches_fail_or_log_or_change_the_request() {
        let hm = |name: &str, value: &str, mismatch| HeaderMatch {
            name: name.into(),
            value: value.into(),
            mismatch,
        };
        let r = rules(vec![HttpRule {
            header_matches: vec![
                hm("x-must", "1", Mismatch::Fail),
                hm("x-log", "a", Mismatch::Log),
                hm("x-add", "b", Mismatch::Add),
                hm("x-del", "c", Mismatch::Delete),
                hm("x-rep", "d", Mismatch::Replace),
            ],
            ..Default::default()
        }]);
        assert!(r
            .first_match(&req("GET", "/", &vec![h("x-must", "2")]))
            .is_none());
        let m = r
            .first_match(&req(
                "GET",
                "/",
                &vec![h("x-must", "1"), h("x-del", "z"), h("x-rep", "d")],
            ))
            .unwrap();
        assert_eq!(m.logged, ["x-log"]);
        assert_eq!(
            m.actions,
            [
                HeaderAction::Add("x-add".into(), "b".into()),
                HeaderAction::Delete("x-del".into()),
            ]
        );
    }

    #[test]
    fn any_grant_without_http_rules_allows_every_request_and_names_the_rule() {
        let r = rules(vec![rule("GET", "/")]);
        let none: Vec<(String, String)> = vec![];
        let with = [Grant {
            rule: "CiliumNetworkPolicy y/echo[0]",
            rules: Some(&r),
        }];
        assert_eq!(
            judge(&with, &req("GET", "/", &none)),
            HttpVerdict::Allowed {
                by: "CiliumNetworkPolicy y/echo[0] http[0]".into(),
                grant: 0,
                matched: RuleMatch::default()
            }
        );
        assert_eq!(
            judge(&with, &req("POST", "/", &none)),
            HttpVerdict::Denied {
                considered: vec!["CiliumNetworkPolicy y/echo[0]".into()],
                grants: vec![0],
            }
        );
        let l4 = [
            with[0].clone_ref(),
            Grant {
                rule: "CiliumNetworkPolicy y/l3[0]",
                rules: None,
            },
        ];
        assert!(judge(&l4, &req("POST", "/admin", &none)).is_allowed());
        let all = rules(vec![HttpRule::default()]);
        let empty = [Grant {
            rule: "p[0]",
            rules: Some(&all),
        }];
        assert!(judge(&empty, &req("DELETE", "/x", &none)).is_allowed());
    }

    impl<'a> Grant<'a> {
        fn clone_ref(&self) -> Grant<'a> {
            Grant {
                rule: self.rule,
                rules: self.rules,
            }
        }
    }

    #[test]
    fn a_thousand_path_regexes_are_indexed_by_prefix_and_agree_with_one_by_one() {
        let mut many: Vec<HttpRule> = (0..1000)
            .map(|i| rule("GET", &format!("/api/v{i}/items/[0-9]+")))
            .collect();
        many.push(rule("GET", "(?i)/ADMIN/.*"));
        many.push(rule("GET", ".*/debug"));
        many.push(rule("GET", "/(a|b)x"));
        let r = rules(many.clone());
        let idx = r.index.as_ref().unwrap();
        assert_eq!(
            idx.unprefixed,
            [1001],
            "only the pattern without a literal start"
        );
        assert!(idx.always.is_empty() && idx.unprefixed_set.is_none());
        let plain = CompiledRules {
            index: None,
            ..r.clone()
        };
        let none: Vec<(String, String)> = vec![];
        for path in [
            "/api/v733/items/42",
            "/api/v7/items/1",
            "/api/v73/items/",
            "/Admin/x",
            "/aDmIn/",
            "/x/debug",
            "/ax",
            "/bx",
            "/cx",
            "/",
        ] {
            assert_eq!(
                r.first_match(&req("GET", path, &none)).map(|m| m.index),
                plain.first_match(&req("GET", path, &none)).map(|m| m.index),
                "{path}"
            );
        }
        let none: Vec<(String, String)> = vec![];
        assert_eq!(
            r.first_match(&req("GET", "/api/v733/items/42", &none))
                .map(|m| m.index),
            Some(733)
        );
        assert!(r
            .first_match(&req("GET", "/api/v733/items/x", &none))
            .is_none());
    }

    #[test]
    fn many_path_regexes_without_a_prefix_are_matched_as_one_set_and_agree_with_one_by_one() {
        let mut many: Vec<HttpRule> = (0..300)
            .map(|i| rule("GET", &format!(".*/item{i}/[0-9]+(/details)?")))
            .collect();
        many.push(rule("GET", "/fixed/[a-z]+"));
        many.push(HttpRule {
            path: None,
            ..rule("POST", "/")
        });
        many.push(rule("GET", "(?i).*/ITEM7/.*"));
        let r = rules(many);
        let idx = r.index.as_ref().unwrap();
        assert_eq!(idx.always, [301], "the rule without a path");
        assert_eq!(idx.unprefixed.len(), 301);
        assert!(idx.unprefixed_set.is_some());
        let plain = CompiledRules {
            index: None,
            ..r.clone()
        };
        let none: Vec<(String, String)> = vec![];
        for (method, path) in [
            ("GET", "/a/item299/5"),
            ("GET", "/x/y/item12/77/details"),
            ("GET", "/item12/77/detail"),
            ("GET", "/Item7/x"),
            ("GET", "/a/item7/1"),
            ("GET", "/fixed/abc"),
            ("GET", "/fixed/ABC"),
            ("POST", "/anything"),
            ("GET", "/"),
            ("GET", "/a/item300/1"),
        ] {
            assert_eq!(
                r.first_match(&req(method, path, &none)).map(|m| m.index),
                plain
                    .first_match(&req(method, path, &none))
                    .map(|m| m.index),
                "{method} {path}"
            );
        }
        let at = |m: &str, p: &str| r.first_match(&req(m, p, &none)).map(|m| m.index);
        assert_eq!(at("GET", "/a/item299/5"), Some(299));
        assert_eq!(at("GET", "/a/item7/1"), Some(7), "first in rule order");
        assert_eq!(at("GET", "/Item7/x"), Some(302));
        assert_eq!(at("POST", "/anything"), Some(301));
        assert_eq!(at("GET", "/a/item300/1"), None);
    }

    #[test]
    fn a_regex_too_large_is_an_error_naming_the_rule() {
        let huge = format!("({})", vec!["[a-z]{50}"; 400].join("|"));
        let e = CompiledRules::compile(Arc::new(L7PortRules {
            http: vec![rule("GET", "/"), rule("GET", &huge)],
            server_names: vec![],
        }))
        .unwrap_err();
        assert!(
            e.starts_with("http[1].path: the regular expression is too large"),
            "{e}"
        );
    }

    #[test]
    fn targets_are_normalised_before_matching() {
        let n = |t: &str| normalize_target(t).map(|t| t.path_and_query);
        assert_eq!(n("/public/../admin"), Ok("/admin".into()));
        assert_eq!(n("/./public/./x/."), Ok("/public/x/".into()));
        assert_eq!(n("/%70ublic"), Ok("/public".into()));
        assert_eq!(
            n("/a%2fb"),
            Ok("/a%2Fb".into()),
            "slashes stay encoded, upper case"
        );
        assert_eq!(n("//public///x"), Ok("/public/x".into()));
        assert_eq!(n("/../../etc"), Ok("/etc".into()));
        assert_eq!(
            n("/a/b?x=/../y"),
            Ok("/a/b?x=/../y".into()),
            "the query is kept"
        );
        assert_eq!(n("/%2e%2e/admin"), Ok("/admin".into()));
        assert!(n("/bad%zz").is_err());
        assert_eq!(
            n("/a%00b"),
            Ok("/a%00b".into()),
            "escapes of other bytes stay escaped"
        );
        assert!(n("/a\u{1}b").is_err());
        let abs = normalize_target("http://Echo:8080//public?q").unwrap();
        assert_eq!(
            (abs.path_and_query.as_str(), abs.authority.as_deref()),
            ("/public?q", Some("Echo:8080"))
        );
        assert_eq!(normalize_target("http://echo").unwrap().path_and_query, "/");
        assert!(n("public").is_err());
    }

    #[test]
    fn server_names_match_exactly_or_below_a_wildcard() {
        let names = vec!["api.example.com".to_string(), "*.svc.example".to_string()];
        assert!(server_name_allowed(&names, "API.example.com."));
        assert!(server_name_allowed(&names, "a.b.svc.example"));
        assert!(!server_name_allowed(&names, "svc.example"));
        assert!(!server_name_allowed(&names, "evil.com"));
    }
}
