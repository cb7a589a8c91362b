//! Hubble's flow filters (`GetFlowsRequest.whitelist` / `blacklist`) with Hubble's matching
//! rules, compiled once per request:
//! - within one `FlowFilter`, every field given must match; a field with several values matches
//!   when any value does;
//! - a flow is returned when it matches any whitelist filter (or there is none) and no
//!   blacklist filter.
//!
//! Per field: IPs exact or CIDR; pods `namespace/name-prefix`, `name-prefix` or `namespace/`;
//! labels as Kubernetes label selectors over `source:key=value` labels (a key without source
//! matches any source); FQDNs and node names with `*` wildcards; ports and identities exact;
//! HTTP status codes exact or as prefixes (`4+`); HTTP paths and DNS queries as regular
//! expressions; workloads by kind and name (either empty: any). A field ciliate's flows never
//! carry (services, trace ids) matches
//! no flow when given. A filter that cannot be parsed is refused with the field named.

use std::net::IpAddr;

use ipnet::IpNet;
use regex::Regex;

use super::convert::EVENT_DROP;
use super::proto::flow as pb;

/// Filters one request may carry in all, and values per field: a request is bounded.
pub const MAX_FILTERS: usize = 64;
pub const MAX_VALUES: usize = 256;
/// Compiled size limit of one regular expression.
const REGEX_SIZE: usize = 1 << 20;

/// A request's filters, ready to match.
#[derive(Debug)]
pub struct Filters {
    allow: Vec<Compiled>,
    deny: Vec<Compiled>,
    /// Every filter asks for verdicts alone (or there is none): a flow's verdict decides.
    verdicts_alone: bool,
}

impl Default for Filters {
    /// No filter: every flow passes.
    fn default() -> Self {
        Filters {
            allow: Vec::new(),
            deny: Vec::new(),
            verdicts_alone: true,
        }
    }
}

impl Filters {
    /// Compiles the whitelist and the blacklist; the error names the list, the filter and the
    /// field.
    pub fn new(whitelist: &[pb::FlowFilter], blacklist: &[pb::FlowFilter]) -> Result<Self, String> {
        if whitelist.len() + blacklist.len() > MAX_FILTERS {
            return Err(format!("at most {MAX_FILTERS} filters per request"));
        }
        let compile = |list: &[pb::FlowFilter], name: &str| -> Result<Vec<Compiled>, String> {
            list.iter()
                .enumerate()
                .map(|(i, f)| Compiled::new(f).map_err(|e| format!("{name}[{i}].{e}")))
                .collect()
        };
        let verdicts_alone = whitelist.iter().chain(blacklist).all(|f| {
            let rest = pb::FlowFilter {
                verdict: Vec::new(),
                ..f.clone()
            };
            rest == pb::FlowFilter::default()
        });
        Ok(Filters {
            allow: compile(whitelist, "whitelist")?,
            deny: compile(blacklist, "blacklist")?,
            verdicts_alone,
        })
    }

    /// Whether a flow of this verdict passes, when the verdict alone decides (`None`: the
    /// filters ask for more than verdicts, so only the whole flow can tell).
    pub fn accepts_verdict(&self, verdict: i32) -> Option<bool> {
        let matches = |c: &Compiled| c.verdicts.is_empty() || c.verdicts.contains(&verdict);
        self.verdicts_alone.then(|| {
            (self.allow.is_empty() || self.allow.iter().any(matches))
                && !self.deny.iter().any(matches)
        })
    }

    /// Whether a flow of this verdict can pass at all (false: every whitelist filter asks
    /// for other verdicts), known before the flow is converted: what `hubble observe
    /// --verdict DROPPED` skips without converting the rest.
    pub fn may_accept_verdict(&self, verdict: i32) -> bool {
        self.allow.is_empty()
            || self
                .allow
                .iter()
                .any(|c| !c.never && (c.verdicts.is_empty() || c.verdicts.contains(&verdict)))
    }

    pub fn accepts(&self, f: &pb::Flow) -> bool {
        (self.allow.is_empty() || self.allow.iter().any(|c| c.matches(f)))
            && !self.deny.iter().any(|c| c.matches(f))
    }
}

/// One side's criteria (source or destination).
#[derive(Debug, Default)]
struct SideFilter {
    ips: Vec<IpNet>,
    pods: Vec<(String, String)>,
    fqdns: Vec<String>,
    labels: Vec<Selector>,
    identities: Vec<u32>,
    ports: Vec<u16>,
    /// Workloads, by kind and name (either empty: any).
    workloads: Vec<pb::Workload>,
    /// Services asked for: ciliate's flows name none, so nothing matches.
    never: bool,
}

#[derive(Debug, Default)]
struct Compiled {
    source: SideFilter,
    destination: SideFilter,
    uuids: Vec<String>,
    directions: Vec<i32>,
    verdicts: Vec<i32>,
    event_types: Vec<pb::EventTypeFilter>,
    http_codes: Vec<String>,
    protocols: Vec<String>,
    replies: Vec<bool>,
    dns_queries: Vec<Regex>,
    http_methods: Vec<String>,
    http_paths: Vec<Regex>,
    tcp_flags: Vec<pb::TcpFlags>,
    node_names: Vec<String>,
    ip_versions: Vec<i32>,
    never: bool,
}

fn bounded<T>(field: &str, v: &[T]) -> Result<(), String> {
    if v.len() > MAX_VALUES {
        return Err(format!("{field}: at most {MAX_VALUES} values"));
    }
    Ok(())
}

fn each<T, U>(field: &str, v: &[T], f: impl Fn(&T) -> Result<U, String>) -> Result<Vec<U>, String> {
    bounded(field, v)?;
    v.iter()
        .map(|x| f(x).map_err(|e| format!("{field}: {e}")))
        .collect()
}

fn ip_or_cidr(s: &str) -> Result<IpNet, String> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(IpNet::from(ip));
    }
    s.parse::<IpNet>()
        .map_err(|_| format!("{s:?} is neither an address nor a CIDR"))
}

fn pod(s: &str) -> Result<(String, String), String> {
    Ok(match s.split_once('/') {
        Some((ns, name)) => (ns.to_string(), name.to_string()),
        None => (String::new(), s.to_string()),
    })
}

fn port(s: &str) -> Result<u16, String> {
    s.parse().map_err(|_| format!("{s:?} is not a port"))
}

fn regex(s: &str) -> Result<Regex, String> {
    regex::RegexBuilder::new(s)
        .size_limit(REGEX_SIZE)
        .build()
        .map_err(|e| format!("{s:?}: {e}"))
}

fn status_code(s: &str) -> Result<String, String> {
    let digits = s.strip_suffix('+').unwrap_or(s);
    if digits.is_empty() || digits.len() > 3 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{s:?} is not a status code (404) or prefix (4+)"));
    }
    Ok(s.to_string())
}

fn side(
    which: &str,
    [ips, pods, fqdns, labels, services]: [&[String]; 5],
    identities: &[u32],
    ports: &[String],
    workloads: &[pb::Workload],
) -> Result<SideFilter, String> {
    bounded(&format!("{which}_identity"), identities)?;
    bounded(&format!("{which}_workload"), workloads)?;
    Ok(SideFilter {
        ips: each(&format!("{which}_ip"), ips, |s| ip_or_cidr(s))?,
        pods: each(&format!("{which}_pod"), pods, |s| pod(s))?,
        fqdns: each(&format!("{which}_fqdn"), fqdns, |s| Ok(s.to_lowercase()))?,
        labels: each(&format!("{which}_label"), labels, |s| Selector::parse(s))?,
        identities: identities.to_vec(),
        ports: each(&format!("{which}_port"), ports, |s| port(s))?,
        workloads: workloads.to_vec(),
        never: !services.is_empty(),
    })
}

impl Compiled {
    fn new(f: &pb::FlowFilter) -> Result<Self, String> {
        let source = side(
            "source",
            [
                &f.source_ip,
                &f.source_pod,
                &f.source_fqdn,
                &f.source_label,
                &f.source_service,
            ],
            &f.source_identity,
            &f.source_port,
            &f.source_workload,
        )?;
        let destination = side(
            "destination",
            [
                &f.destination_ip,
                &f.destination_pod,
                &f.destination_fqdn,
                &f.destination_label,
                &f.destination_service,
            ],
            &f.destination_identity,
            &f.destination_port,
            &f.destination_workload,
        )?;
        for (name, n) in [
            ("uuid", f.uuid.len()),
            ("traffic_direction", f.traffic_direction.len()),
            ("verdict", f.verdict.len()),
            ("event_type", f.event_type.len()),
            ("reply", f.reply.len()),
            ("tcp_flags", f.tcp_flags.len()),
            ("ip_version", f.ip_version.len()),
        ] {
            if n > MAX_VALUES {
                return Err(format!("{name}: at most {MAX_VALUES} values"));
            }
        }
        Ok(Compiled {
            source,
            destination,
            uuids: f.uuid.clone(),
            directions: f.traffic_direction.clone(),
            verdicts: f.verdict.clone(),
            event_types: f.event_type.clone(),
            http_codes: each("http_status_code", &f.http_status_code, |s| status_code(s))?,
            protocols: each("protocol", &f.protocol, |s| Ok(s.to_lowercase()))?,
            replies: f.reply.clone(),
            dns_queries: each("dns_query", &f.dns_query, |s| regex(s))?,
            http_methods: each("http_method", &f.http_method, |s| Ok(s.to_uppercase()))?,
            http_paths: each("http_path", &f.http_path, |s| regex(s))?,
            tcp_flags: f.tcp_flags.clone(),
            node_names: each("node_name", &f.node_name, |s| Ok(s.clone()))?,
            ip_versions: f.ip_version.clone(),
            never: !f.trace_id.is_empty(),
        })
    }

    fn matches(&self, f: &pb::Flow) -> bool {
        !self.never
            && self.source.matches(
                f.ip.as_ref().map(|i| &i.source),
                f.source.as_ref(),
                &f.source_names,
                ports(f).0,
            )
            && self.destination.matches(
                f.ip.as_ref().map(|i| &i.destination),
                f.destination.as_ref(),
                &f.destination_names,
                ports(f).1,
            )
            && any(&self.uuids, |u| *u == f.uuid)
            && any(&self.directions, |d| *d == f.traffic_direction)
            && any(&self.verdicts, |v| *v == f.verdict)
            && any(&self.event_types, |e| event_matches(e, f))
            && any(&self.http_codes, |c| http_code_matches(c, f))
            && any(&self.protocols, |p| protocol_matches(p, f))
            && any(&self.replies, |r| f.is_reply == Some(*r))
            && any(&self.dns_queries, |re| {
                dns(f).is_some_and(|d| re.is_match(&d.query))
            })
            && any(&self.http_methods, |m| {
                http(f).is_some_and(|h| h.method.eq_ignore_ascii_case(m))
            })
            && any(&self.http_paths, |re| {
                http(f).is_some_and(|h| re.is_match(url_path(&h.url)))
            })
            && any(&self.tcp_flags, |want| tcp_flags_match(want, f))
            && any(&self.node_names, |p| node_matches(p, &f.node_name))
            && any(&self.ip_versions, |v| {
                f.ip.as_ref().is_some_and(|i| i.ip_version == *v)
            })
    }
}

/// Empty: no criterion; else any value matching.
fn any<T>(v: &[T], f: impl Fn(&T) -> bool) -> bool {
    v.is_empty() || v.iter().any(f)
}

impl SideFilter {
    fn matches(
        &self,
        ip: Option<&String>,
        ep: Option<&pb::Endpoint>,
        names: &[String],
        port: Option<u16>,
    ) -> bool {
        let ip: Option<IpAddr> = ip.and_then(|s| s.parse().ok());
        !self.never
            && any(&self.ips, |net| ip.is_some_and(|ip| net.contains(&ip)))
            && any(&self.pods, |(ns, prefix)| {
                ep.is_some_and(|e| {
                    !e.pod_name.is_empty()
                        && (ns.is_empty() || *ns == e.namespace)
                        && e.pod_name.starts_with(prefix.as_str())
                })
            })
            && any(&self.fqdns, |p| {
                names.iter().any(|n| glob(p, n.trim_end_matches('.')))
            })
            && any(&self.labels, |s| ep.is_some_and(|e| s.matches(&e.labels)))
            && any(&self.identities, |id| ep.is_some_and(|e| e.identity == *id))
            && any(&self.ports, |p| port == Some(*p))
            && any(&self.workloads, |w| {
                // Hubble's rule: a kind or name left empty matches any.
                ep.is_some_and(|e| {
                    e.workloads.iter().any(|have| {
                        (w.name.is_empty() || w.name == have.name)
                            && (w.kind.is_empty() || w.kind == have.kind)
                    })
                })
            })
    }
}

/// The flow's (source, destination) ports, where it has them.
fn ports(f: &pb::Flow) -> (Option<u16>, Option<u16>) {
    use pb::layer4::Protocol;
    let p = |s: u32, d: u32| {
        let nz = |x: u32| (x != 0).then_some(x as u16);
        (nz(s), nz(d))
    };
    match f.l4.as_ref().and_then(|l| l.protocol.as_ref()) {
        Some(Protocol::Tcp(t)) => p(t.source_port, t.destination_port),
        Some(Protocol::Udp(u)) => p(u.source_port, u.destination_port),
        Some(Protocol::Sctp(s)) => p(s.source_port, s.destination_port),
        _ => (None, None),
    }
}

fn http(f: &pb::Flow) -> Option<&pb::Http> {
    match f.l7.as_ref()?.record.as_ref()? {
        pb::layer7::Record::Http(h) => Some(h),
        _ => None,
    }
}

fn dns(f: &pb::Flow) -> Option<&pb::Dns> {
    match f.l7.as_ref()?.record.as_ref()? {
        pb::layer7::Record::Dns(d) => Some(d),
        _ => None,
    }
}

/// The path of a URL (`http://host/a/b?q` -> `/a/b`; a bare path stays as it is).
fn url_path(url: &str) -> &str {
    let rest = url
        .split_once("://")
        .map_or(url, |(_, r)| r.find('/').map_or("/", |i| &r[i..]));
    rest.split(['?', '#']).next().unwrap_or(rest)
}

fn event_matches(e: &pb::EventTypeFilter, f: &pb::Flow) -> bool {
    let Some(t) = &f.event_type else {
        return false;
    };
    // A flow a policy dropped is also a drop in Cilium (it reports both events).
    let is_drop = e.r#type == EVENT_DROP && f.verdict == pb::Verdict::Dropped as i32;
    if t.r#type != e.r#type && !is_drop {
        return false;
    }
    !e.match_sub_type || (t.r#type == e.r#type && t.sub_type == e.sub_type)
}

fn http_code_matches(pattern: &str, f: &pb::Flow) -> bool {
    let Some(h) = http(f) else {
        return false;
    };
    if h.code == 0 {
        return false;
    }
    let code = h.code.to_string();
    match pattern.strip_suffix('+') {
        Some(prefix) => code.starts_with(prefix),
        None => code == pattern,
    }
}

fn protocol_matches(p: &str, f: &pb::Flow) -> bool {
    use pb::layer4::Protocol;
    let l4 = match f.l4.as_ref().and_then(|l| l.protocol.as_ref()) {
        Some(Protocol::Tcp(_)) => "tcp",
        Some(Protocol::Udp(_)) => "udp",
        Some(Protocol::Sctp(_)) => "sctp",
        Some(Protocol::IcmPv4(_)) => "icmpv4",
        Some(Protocol::IcmPv6(_)) => "icmpv6",
        None => "",
    };
    let l7 = match f.l7.as_ref().and_then(|l| l.record.as_ref()) {
        Some(pb::layer7::Record::Http(_)) => "http",
        Some(pb::layer7::Record::Dns(_)) => "dns",
        None => "",
    };
    p == l4 || p == l7 || (p == "icmp" && l4.starts_with("icmp"))
}

fn tcp_flags_match(want: &pb::TcpFlags, f: &pb::Flow) -> bool {
    let have = match f.l4.as_ref().and_then(|l| l.protocol.as_ref()) {
        Some(pb::layer4::Protocol::Tcp(t)) => t.flags.unwrap_or_default(),
        _ => return false,
    };
    let bits = |t: &pb::TcpFlags| [t.fin, t.syn, t.rst, t.psh, t.ack, t.urg, t.ece, t.cwr, t.ns];
    bits(want).iter().zip(bits(&have)).all(|(w, h)| !w || h)
}

/// Node names: `name`, `pattern*`, or `cluster/name` (ciliate's one cluster is `default`).
fn node_matches(pattern: &str, node: &str) -> bool {
    match pattern.split_once('/') {
        Some((cluster, name)) => glob(cluster, "default") && (name.is_empty() || glob(name, node)),
        None => glob(pattern, node),
    }
}

/// `*` matches any run of characters; everything else itself (case-insensitively).
fn glob(pattern: &str, s: &str) -> bool {
    let (p, s) = (pattern.to_lowercase(), s.to_lowercase());
    let parts: Vec<&str> = p.split('*').collect();
    if parts.len() == 1 {
        return p == s;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !s.starts_with(first) || s.len() < first.len() + last.len() || !s.ends_with(last) {
        return false;
    }
    let mut rest = &s[first.len()..s.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// A Kubernetes label selector over Cilium's `source:key=value` labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Selector(Vec<Requirement>);

#[derive(Debug, Clone, PartialEq)]
struct Requirement {
    /// None: any source.
    source: Option<String>,
    key: String,
    op: Op,
}

#[derive(Debug, Clone, PartialEq)]
enum Op {
    In(Vec<String>),
    NotIn(Vec<String>),
    Exists,
    NotExists,
}

impl Selector {
    /// `k8s:app=web,tier in (a, b),!legacy,env!=prod`.
    pub fn parse(s: &str) -> Result<Selector, String> {
        let mut reqs = Vec::new();
        for part in split_top(s) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            reqs.push(Requirement::parse(part).map_err(|e| format!("{s:?}: {e}"))?);
        }
        if reqs.is_empty() {
            return Err(format!("{s:?}: an empty selector"));
        }
        Ok(Selector(reqs))
    }

    /// Whether labels (`source:key=value`) satisfy every requirement.
    pub fn matches(&self, labels: &[String]) -> bool {
        let parsed: Vec<(&str, &str, &str)> = labels.iter().map(|l| split_label(l)).collect();
        self.0.iter().all(|r| {
            let values = parsed.iter().filter(|(src, key, _)| {
                *key == r.key && r.source.as_deref().is_none_or(|s| s == "any" || s == *src)
            });
            let mut values = values.map(|(_, _, v)| *v);
            match &r.op {
                Op::Exists => values.next().is_some(),
                Op::NotExists => values.next().is_none(),
                Op::In(set) => values.any(|v| set.iter().any(|s| s == v)),
                Op::NotIn(set) => values.all(|v| !set.iter().any(|s| s == v)),
            }
        })
    }
}

/// `source:key=value` -> (source, key, value); a label without source is `unspec`.
fn split_label(l: &str) -> (&str, &str, &str) {
    let (src, rest) = match l.split_once(':') {
        Some((s, r)) if !s.contains('=') => (s, r),
        _ => ("unspec", l),
    };
    let (k, v) = rest.split_once('=').unwrap_or((rest, ""));
    (src, k, v)
}

/// Splits on commas outside parentheses.
fn split_top(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn key_of(k: &str) -> Result<(Option<String>, String), String> {
    let k = k.trim();
    if k.is_empty() || k.contains(char::is_whitespace) {
        return Err(format!("{k:?} is no label key"));
    }
    Ok(match k.split_once(':') {
        Some((src, key)) if !key.is_empty() => (Some(src.to_string()), key.to_string()),
        _ => (None, k.to_string()),
    })
}

fn set_of(s: &str) -> Result<Vec<String>, String> {
    let inner = s
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| format!("{s:?}: a set is written (a, b)"))?;
    Ok(inner.split(',').map(|v| v.trim().to_string()).collect())
}

impl Requirement {
    fn parse(part: &str) -> Result<Requirement, String> {
        let req = |k: &str, op| key_of(k).map(|(source, key)| Requirement { source, key, op });
        if let Some(k) = part.strip_prefix('!') {
            return req(k, Op::NotExists);
        }
        if let Some((k, v)) = part.split_once("!=") {
            return req(k, Op::NotIn(vec![v.trim().to_string()]));
        }
        if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
            return req(k, Op::In(vec![v.trim().to_string()]));
        }
        if let Some((k, v)) = part.split_once(" notin ") {
            return req(k, Op::NotIn(set_of(v)?));
        }
        if let Some((k, v)) = part.split_once(" in ") {
            return req(k, Op::In(set_of(v)?));
        }
        req(part, Op::Exists)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow() -> pb::Flow {
        pb::Flow {
            verdict: pb::Verdict::Dropped as i32,
            ip: Some(pb::Ip {
                source: "10.0.1.5".into(),
                destination: "10.0.2.9".into(),
                ip_version: pb::IpVersion::IPv4 as i32,
                encrypted: false,
            }),
            l4: Some(pb::Layer4 {
                protocol: Some(pb::layer4::Protocol::Tcp(pb::Tcp {
                    source_port: 0,
                    destination_port: 8080,
                    flags: None,
                })),
            }),
            source: Some(pb::Endpoint {
                namespace: "x".into(),
                pod_name: "client-7d9f".into(),
                labels: vec!["k8s:app=client".into(), "k8s:tier=front".into()],
                identity: 4001,
                workloads: vec![pb::Workload {
                    name: "client".into(),
                    kind: "Deployment".into(),
                }],
                ..Default::default()
            }),
            destination: Some(pb::Endpoint {
                namespace: "y".into(),
                pod_name: "server-0".into(),
                labels: vec!["k8s:app=server".into()],
                identity: 4002,
                ..Default::default()
            }),
            destination_names: vec!["api.example.com.".into()],
            event_type: Some(pb::CiliumEventType {
                r#type: 5,
                sub_type: 0,
            }),
            traffic_direction: pb::TrafficDirection::Ingress as i32,
            is_reply: Some(false),
            node_name: "node-1".into(),
            ..Default::default()
        }
    }

    fn accepts(w: pb::FlowFilter) -> bool {
        Filters::new(&[w], &[]).unwrap().accepts(&flow())
    }

    /// A filter asking for these verdicts alone.
    fn by(verdicts: Vec<i32>) -> pb::FlowFilter {
        pb::FlowFilter {
            verdict: verdicts,
            ..Default::default()
        }
    }

    #[test]
    fn verdict_filters_alone_decide_without_the_flow_as_they_do_with_it() {
        let (dropped, forwarded) = (pb::Verdict::Dropped as i32, pb::Verdict::Forwarded as i32);
        let lists = [
            (vec![], vec![]),
            (vec![by(vec![dropped])], vec![]),
            (vec![by(vec![forwarded])], vec![]),
            (vec![by(vec![forwarded]), by(vec![])], vec![]),
            (vec![], vec![by(vec![dropped])]),
            (vec![by(vec![])], vec![by(vec![forwarded, dropped])]),
        ];
        for (white, black) in lists {
            let filters = Filters::new(&white, &black).unwrap();
            for verdict in [dropped, forwarded] {
                let f = pb::Flow { verdict, ..flow() };
                assert_eq!(
                    filters.accepts_verdict(verdict),
                    Some(filters.accepts(&f)),
                    "{white:?} {black:?} {verdict}"
                );
            }
        }
        assert_eq!(Filters::default().accepts_verdict(dropped), Some(true));
        // Any other field: only the whole flow can tell.
        let pod = pb::FlowFilter {
            source_pod: vec!["x/".into()],
            verdict: vec![dropped],
            ..Default::default()
        };
        for (white, black) in [(vec![pod.clone()], vec![]), (vec![], vec![pod])] {
            let filters = Filters::new(&white, &black).unwrap();
            assert_eq!(filters.accepts_verdict(dropped), None);
        }
    }

    #[test]
    fn the_verdict_precheck_refuses_only_what_the_filters_refuse() {
        let (dropped, forwarded) = (pb::Verdict::Dropped as i32, pb::Verdict::Forwarded as i32);
        let cases = [
            (vec![], vec![], true),
            (vec![by(vec![dropped])], vec![], true),
            (vec![by(vec![forwarded])], vec![], false),
            (vec![by(vec![forwarded]), by(vec![])], vec![], true),
            (vec![by(vec![forwarded, dropped])], vec![], true),
            // A blacklist is checked on the converted flow; it never skips conversion.
            (vec![], vec![by(vec![dropped])], true),
        ];
        for (white, black, may) in cases {
            let filters = Filters::new(&white, &black).unwrap();
            assert_eq!(
                filters.may_accept_verdict(dropped),
                may,
                "{white:?} {black:?}"
            );
            if !may {
                assert!(
                    !filters.accepts(&flow()),
                    "refused before and after conversion"
                );
            }
        }
    }

    #[test]
    fn workloads_match_by_kind_and_name_either_left_empty() {
        let w = |name: &str, kind: &str| pb::Workload {
            name: name.into(),
            kind: kind.into(),
        };
        let source = |ws: Vec<pb::Workload>| pb::FlowFilter {
            source_workload: ws,
            ..Default::default()
        };
        for yes in [
            w("client", "Deployment"),
            w("client", ""),
            w("", "Deployment"),
            w("", ""),
        ] {
            assert!(accepts(source(vec![yes.clone()])), "{yes:?}");
        }
        for no in [w("client", "StatefulSet"), w("server", "")] {
            assert!(!accepts(source(vec![no.clone()])), "{no:?}");
        }
        assert!(
            accepts(source(vec![w("server", ""), w("client", "")])),
            "any value"
        );
        // The destination names no workload: nothing matches it.
        assert!(!accepts(pb::FlowFilter {
            destination_workload: vec![w("", "")],
            ..Default::default()
        }));
        let many = source(vec![w("a", ""); MAX_VALUES + 1]);
        let err = Filters::new(&[many], &[]).unwrap_err();
        assert!(err.contains("source_workload"), "{err}");
    }

    #[test]
    fn every_field_given_must_match() {
        let f = pb::FlowFilter {
            source_pod: vec!["x/client-".into()],
            destination_port: vec!["8080".into()],
            verdict: vec![pb::Verdict::Dropped as i32],
            ..Default::default()
        };
        assert!(accepts(f.clone()));
        assert!(!accepts(pb::FlowFilter {
            destination_port: vec!["80".into()],
            ..f
        }));
    }

    #[test]
    fn addresses_pods_names_and_identities() {
        let yes = [
            pb::FlowFilter {
                source_ip: vec!["10.0.1.0/24".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                destination_ip: vec!["10.0.2.9".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                source_pod: vec!["client".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                destination_pod: vec!["y/".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                destination_fqdn: vec!["*.example.com".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                source_identity: vec![1, 4001],
                ..Default::default()
            },
            pb::FlowFilter {
                node_name: vec!["node-*".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                node_name: vec!["default/node-1".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                protocol: vec!["TCP".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                reply: vec![false],
                ..Default::default()
            },
        ];
        for f in yes {
            assert!(accepts(f.clone()), "{f:?}");
        }
        let no = [
            pb::FlowFilter {
                source_ip: vec!["10.0.2.0/24".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                source_pod: vec!["y/client".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                destination_fqdn: vec!["example.com".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                destination_identity: vec![4001],
                ..Default::default()
            },
            pb::FlowFilter {
                protocol: vec!["udp".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                reply: vec![true],
                ..Default::default()
            },
            pb::FlowFilter {
                http_status_code: vec!["4+".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                source_service: vec!["x/svc".into()],
                ..Default::default()
            },
            pb::FlowFilter {
                trace_id: vec!["abc".into()],
                ..Default::default()
            },
        ];
        for f in no {
            assert!(!accepts(f.clone()), "{f:?}");
        }
    }

    #[test]
    fn labels_are_selectors() {
        let sel = |s: &str| Selector::parse(s).unwrap();
        let labels = ["k8s:app=client".to_string(), "k8s:tier=front".to_string()];
        assert!(sel("app=client").matches(&labels));
        assert!(sel("k8s:app=client,tier in (front, back)").matches(&labels));
        assert!(sel("any:app").matches(&labels));
        assert!(sel("!legacy").matches(&labels));
        assert!(sel("app!=server").matches(&labels));
        assert!(!sel("app notin (client)").matches(&labels));
        assert!(!sel("reserved:app=client").matches(&labels));
        assert!(!sel("app=client,!tier").matches(&labels));
        assert!(accepts(pb::FlowFilter {
            destination_label: vec!["k8s:app=server".into()],
            ..Default::default()
        }));
    }

    #[test]
    fn event_types_count_a_policy_drop_as_a_drop_too() {
        let t = |ty, sub: Option<i32>| pb::FlowFilter {
            event_type: vec![pb::EventTypeFilter {
                r#type: ty,
                match_sub_type: sub.is_some(),
                sub_type: sub.unwrap_or(0),
            }],
            ..Default::default()
        };
        assert!(accepts(t(5, None)));
        assert!(accepts(t(1, None)));
        assert!(!accepts(t(4, None)));
        assert!(!accepts(t(129, None)));
        assert!(!accepts(t(5, Some(3))));
    }

    #[test]
    fn the_blacklist_takes_away_from_the_whitelist() {
        let w = pb::FlowFilter {
            source_pod: vec!["x/".into()],
            ..Default::default()
        };
        let b = pb::FlowFilter {
            destination_port: vec!["8080".into()],
            ..Default::default()
        };
        assert!(!Filters::new(std::slice::from_ref(&w), &[b])
            .unwrap()
            .accepts(&flow()));
        assert!(Filters::new(&[w], &[]).unwrap().accepts(&flow()));
        assert!(Filters::new(&[], &[]).unwrap().accepts(&flow()));
    }

    #[test]
    fn bad_filters_name_their_field() {
        let err = |f: pb::FlowFilter| Filters::new(&[], &[f]).unwrap_err();
        let e = err(pb::FlowFilter {
            source_ip: vec!["10.0.0.300".into()],
            ..Default::default()
        });
        assert!(e.starts_with("blacklist[0].source_ip"), "{e}");
        let e = err(pb::FlowFilter {
            http_path: vec!["(".into()],
            ..Default::default()
        });
        assert!(e.contains("http_path"), "{e}");
        let e = err(pb::FlowFilter {
            destination_port: vec!["http".into()],
            ..Default::default()
        });
        assert!(e.contains("destination_port"), "{e}");
        let e = err(pb::FlowFilter {
            http_status_code: vec!["4x".into()],
            ..Default::default()
        });
        assert!(e.contains("http_status_code"), "{e}");
        let e = err(pb::FlowFilter {
            source_label: vec!["a in b".into()],
            ..Default::default()
        });
        assert!(e.contains("source_label"), "{e}");
        let many = vec![pb::FlowFilter::default(); MAX_FILTERS + 1];
        assert!(Filters::new(&many, &[]).is_err());
    }

    #[test]
    fn http_paths_methods_and_codes() {
        let mut f = flow();
        f.l7 = Some(pb::Layer7 {
            r#type: pb::L7FlowType::Response as i32,
            latency_ns: 1,
            record: Some(pb::layer7::Record::Http(pb::Http {
                code: 403,
                method: "GET".into(),
                url: "http://b.y:8080/private/x?y=1".into(),
                protocol: "HTTP/1.1".into(),
                headers: vec![],
            })),
        });
        let ok = |w: pb::FlowFilter| Filters::new(&[w], &[]).unwrap().accepts(&f);
        assert!(ok(pb::FlowFilter {
            http_status_code: vec!["4+".into()],
            ..Default::default()
        }));
        assert!(ok(pb::FlowFilter {
            http_status_code: vec!["403".into()],
            ..Default::default()
        }));
        assert!(!ok(pb::FlowFilter {
            http_status_code: vec!["5+".into()],
            ..Default::default()
        }));
        assert!(ok(pb::FlowFilter {
            http_method: vec!["get".into()],
            ..Default::default()
        }));
        assert!(ok(pb::FlowFilter {
            http_path: vec!["^/private/".into()],
            ..Default::default()
        }));
        assert!(!ok(pb::FlowFilter {
            http_path: vec!["^/public".into()],
            ..Default::default()
        }));
        assert!(ok(pb::FlowFilter {
            protocol: vec!["http".into()],
            ..Default::default()
        }));
    }
}
