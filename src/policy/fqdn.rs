//! DNS names in policy, with Cilium 1.16's semantics (`pkg/fqdn/matchpattern`):
//! - names are case-insensitive and a trailing dot is optional (`API.example.com.` is
//!   `api.example.com`);
//! - `matchName` is one exact name;
//! - `matchPattern`: `*` matches any run (empty included) of the characters of a label
//!   (`[-a-zA-Z0-9_]`, `allowedDNSCharsREGroup`) and nothing else: never a dot, so
//!   `*.example.com` matches `a.example.com` but neither `example.com` nor `a.b.example.com`,
//!   and never another byte (NUL, `*`, a space, 0x80-0xff, or the `\` of an escaped one). A
//!   lone `*` is special: in a DNS rule it lets every query through (the proxy's
//!   `GeneratePattern`: match-all), in `toFQDNs` it selects the names made of label characters
//!   only (`ToAnchoredRegexp`). (`**.` is 1.19's multi-level prefix: in 1.16 it is two `*` and
//!   matches one label, as here.)
//!
//! The network-policy-api's `domainNames` (`FqdnPattern::domain_name`) are a third form: an exact
//! name, or `*.` followed by a name, where the `*` matches one or more whole labels
//! (`*.example.com` matches `a.example.com` and `a.b.example.com`, not `example.com`).
//!
//! Addresses learned from DNS answers carry one `fqdn:<name>` label per name that resolved to
//! them, on top of their CIDR labels, so that `toFQDNs` selectors select them through the
//! selector cache like any other peer (see `PolicyEngine::learn_fqdn`).

use std::fmt;
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// The label source of names an address was learned for.
pub const SOURCE_FQDN: &str = "fqdn";

/// `name` lower-cased, without its trailing dot.
pub fn normalize(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// A compiled `matchName` or `matchPattern`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FqdnPattern {
    /// Normalized text; for a pattern, with its `*`s.
    text: String,
    pattern: bool,
    /// A network-policy-api domain name with its `*.` prefix: the text after it, with one or
    /// more labels before (never set with `pattern`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    subdomains: bool,
}

impl FqdnPattern {
    pub fn name(name: &str) -> FqdnPattern {
        FqdnPattern {
            text: normalize(name),
            pattern: false,
            subdomains: false,
        }
    }

    pub fn pattern(pattern: &str) -> FqdnPattern {
        FqdnPattern {
            text: normalize(pattern),
            pattern: true,
            subdomains: false,
        }
    }

    /// A network-policy-api `domainNames` entry (validated by the caller): `*.example.com`
    /// matches every name below `example.com`, at any depth; any other is one exact name.
    pub fn domain_name(name: &str) -> FqdnPattern {
        match name.strip_prefix("*.") {
            Some(parent) => FqdnPattern {
                text: normalize(parent),
                pattern: false,
                subdomains: true,
            },
            None => FqdnPattern::name(name),
        }
    }

    /// Does `name` (any case, trailing dot or not) match, as a `toFQDNs` selector? Names
    /// come as the DNS proxy writes them: other bytes than label characters are escaped, so
    /// `.` only ever separates labels.
    pub fn matches(&self, name: &str) -> bool {
        let name = normalize(name);
        if self.subdomains {
            return name
                .strip_suffix(self.text.as_str())
                .and_then(|below| below.strip_suffix('.'))
                .is_some_and(|below| !below.is_empty() && below.split('.').all(|l| !l.is_empty()));
        }
        if !self.pattern {
            return name == self.text;
        }
        if self.text == "*" {
            // `(^([-a-zA-Z0-9_]+[.])+$)|(^[.]$)`: the root, or labels of label characters.
            return name.is_empty()
                || name
                    .split('.')
                    .all(|l| !l.is_empty() && l.bytes().all(label_char));
        }
        let (want, have): (Vec<&str>, Vec<&str>) =
            (self.text.split('.').collect(), name.split('.').collect());
        want.len() == have.len() && want.iter().zip(&have).all(|(w, h)| label_matches(w, h))
    }

    /// Does a DNS rule with this pattern let a query for `name` through? As [`Self::matches`],
    /// except that a lone `*` lets every query through (Cilium's proxy: match-all).
    pub fn allows_query(&self, name: &str) -> bool {
        (self.pattern && self.text == "*") || self.matches(name)
    }
}

/// A character a `*` matches: Cilium's `allowedDNSCharsREGroup`, `[-a-zA-Z0-9_]`.
fn label_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-' || b == b'_'
}

/// One label against one label pattern: `*` matches any run of label characters. Each part
/// between stars is taken at its leftmost place: as patterns hold label characters only
/// (checked where policies are translated), a later place would only leave less to match.
fn label_matches(pattern: &str, label: &str) -> bool {
    let Some((first, rest)) = pattern.split_once('*') else {
        return pattern == label;
    };
    let Some(mut tail) = label.strip_prefix(first) else {
        return false;
    };
    let starred = |run: &str| run.bytes().all(label_char);
    let parts: Vec<&str> = rest.split('*').collect();
    let (last, middle) = parts.split_last().expect("split yields one part at least");
    for part in middle {
        match tail.find(part) {
            Some(i) if starred(&tail[..i]) => tail = &tail[i + part.len()..],
            _ => return false,
        }
    }
    tail.len() >= last.len() && tail.ends_with(last) && starred(&tail[..tail.len() - last.len()])
}

impl fmt::Display for FqdnPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.subdomains {
            write!(f, "domainName:*.{}", self.text)
        } else if self.pattern {
            write!(f, "matchPattern:{}", self.text)
        } else {
            write!(f, "matchName:{}", self.text)
        }
    }
}

/// One name's addresses as learned from allowed answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedIp {
    pub ip: IpAddr,
    /// Seconds since the Unix epoch.
    pub expires_at: u64,
}

/// The FQDN cache: names, their addresses with expiry, and which endpoints asked. Pure; the
/// agent persists it and feeds its learnings and expiries to the policy engine.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FqdnCache {
    /// Normalized name -> addresses and askers.
    pub names: std::collections::BTreeMap<String, CacheEntry>,
    /// The last `used` handed out (`fqdn_bounds`).
    #[serde(skip)]
    pub(super) clock: u64,
    /// Names each endpoint asked for, counted (`fqdn_bounds`; rebuilt after a load).
    #[serde(skip)]
    pub(super) per_endpoint: Option<std::collections::HashMap<u64, usize>>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEntry {
    pub ips: Vec<CachedIp>,
    pub endpoints: std::collections::BTreeSet<u64>,
    /// When the name was last learned (the cache's clock; 0 for a restored name): the least
    /// recently used names are evicted first.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub used: u64,
}

/// Two caches are equal when they hold the same names (the clock and counts are bookkeeping).
impl PartialEq for FqdnCache {
    fn eq(&self, other: &Self) -> bool {
        self.names == other.names
    }
}

impl Eq for FqdnCache {}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl FqdnCache {
    /// `name` resolved to `ips` for `endpoint`, valid `ttl` (at least `min_ttl`) from `now`.
    /// Returns true when an address is new for the name (the policy must learn it).
    pub fn learn(
        &mut self,
        name: &str,
        ips: &[IpAddr],
        ttl: Duration,
        min_ttl: Duration,
        endpoint: Option<u64>,
        now: u64,
    ) -> bool {
        let expires_at = now + ttl.max(min_ttl).as_secs();
        self.count_endpoints();
        self.clock += 1;
        let e = self.names.entry(normalize(name)).or_default();
        e.used = self.clock;
        if let Some(ep) = endpoint {
            if e.endpoints.insert(ep) {
                if let Some(counts) = self.per_endpoint.as_mut() {
                    *counts.entry(ep).or_default() += 1;
                }
            }
        }
        let mut new = false;
        for ip in ips {
            match e.ips.iter_mut().find(|c| c.ip == *ip) {
                Some(c) => c.expires_at = c.expires_at.max(expires_at),
                None => {
                    e.ips.push(CachedIp {
                        ip: *ip,
                        expires_at,
                    });
                    new = true;
                }
            }
        }
        e.ips.sort_by_key(|c| c.ip);
        new
    }

    /// Removes the addresses expired at `now`, except those `alive(address, expired_at)` keeps
    /// (a tracked connection may still use them: Cilium's zombies). Returns the (name, address)
    /// pairs removed.
    pub fn expire(
        &mut self,
        now: u64,
        alive: &dyn Fn(IpAddr, u64) -> bool,
    ) -> Vec<(String, IpAddr)> {
        let mut gone = Vec::new();
        for (name, e) in self.names.iter_mut() {
            e.ips.retain(|c| {
                let keep = c.expires_at > now || alive(c.ip, c.expires_at);
                if !keep {
                    gone.push((name.clone(), c.ip));
                }
                keep
            });
        }
        self.count_endpoints();
        let counts = &mut self.per_endpoint;
        self.names.retain(|_, e| {
            if e.ips.is_empty() {
                super::fqdn_bounds::uncount(counts, &e.endpoints);
            }
            !e.ips.is_empty()
        });
        gone
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::l7::dns::{dns_ruling, entry, DnsRuling};

    #[test]
    fn cached_addresses_live_for_their_ttl_at_least_the_minimum_and_while_connected() {
        let mut c = FqdnCache::default();
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let s = Duration::from_secs;
        assert!(c.learn("API.example.com.", &[a], s(5), s(60), Some(7), 1000));
        assert!(!c.learn("api.example.com", &[a], s(5), s(0), Some(8), 1000));
        assert!(c.learn("api.example.com", &[b], s(5), s(0), None, 1000));
        let e = &c.names["api.example.com"];
        assert_eq!(e.endpoints.iter().copied().collect::<Vec<_>>(), vec![7, 8]);
        assert_eq!(e.ips[0].expires_at, 1060);
        assert!(c.expire(1004, &|_, _| false).is_empty());
        assert!(
            c.expire(1059, &|ip, _| ip == b).is_empty(),
            "a lives 60 s, b is in use"
        );
        assert_eq!(
            c.expire(1061, &|ip, _| ip == b),
            vec![("api.example.com".to_string(), a)],
            "b outlived its TTL but a connection still uses it"
        );
        assert_eq!(c.len(), 1);
        assert_eq!(
            c.expire(1061, &|_, _| false),
            vec![("api.example.com".to_string(), b)]
        );
        assert!(c.is_empty());
    }

    #[test]
    fn names_are_case_insensitive_and_the_trailing_dot_is_optional() {
        let n = FqdnPattern::name("API.Example.com.");
        for yes in ["api.example.com", "api.example.com.", "API.EXAMPLE.COM"] {
            assert!(n.matches(yes), "{yes}");
        }
        for no in ["example.com", "x.api.example.com", "api.example.co"] {
            assert!(!n.matches(no), "{no}");
        }
    }

    #[test]
    fn a_star_stays_within_one_label() {
        let p = FqdnPattern::pattern("*.example.com");
        assert!(p.matches("a.example.com") && p.matches("A-b_1.Example.COM."));
        assert!(!p.matches("example.com"), "the star needs its own label");
        assert!(!p.matches("a.b.example.com"), "never across a dot");
        assert!(!p.matches("a.example.org"));
        let q = FqdnPattern::pattern("api-*.svc.*.io");
        assert!(q.matches("api-eu.svc.prod.io") && q.matches("api-.svc.x.io"));
        assert!(!q.matches("web-eu.svc.prod.io") && !q.matches("api-eu.svc.io"));
        let inner = FqdnPattern::pattern("a*b*c.test");
        assert!(inner.matches("abc.test") && inner.matches("axxbyyc.test"));
        assert!(!inner.matches("acb.test") && !inner.matches("ab.test"));
    }

    /// Labels the wildcard must not match, raw and as hickory-proto writes them (`\ooo` octal
    /// escapes, `\*`, `\.`).
    const ODD_LABELS: [&str; 16] = [
        "\0",
        "a\0b",
        "*",
        "a*",
        "\u{ff}",
        "\u{fe}",
        "\u{80}",
        "\u{ff}\u{fe}\u{80}",
        "é",
        "a b",
        "a/b",
        "\\000",
        "a\\377b",
        "\\*",
        "a\\.b",
        "\\200",
    ];

    #[test]
    fn a_star_matches_label_characters_only_as_cilium_does() {
        // Cilium 1.16 (`matchpattern.ToAnchoredRegexp`): `*` is `[-a-zA-Z0-9_]*`.
        let p = FqdnPattern::pattern("*.example.com");
        let prefix = FqdnPattern::pattern("api-*.example.com");
        let inner = FqdnPattern::pattern("a*b.example.com");
        let t = vec![entry(&[], 53, Some(&["*.example.com"]), "p[0]")];
        for odd in ODD_LABELS {
            let name = format!("{odd}.example.com");
            assert!(!p.matches(&name), "*.example.com matched {name:?}");
            assert!(!prefix.matches(&format!("api-{name}")), "api-{name:?}");
            assert!(!inner.matches(&format!("a{odd}b.example.com")), "a{odd:?}b");
            assert_eq!(
                dns_ruling(&t, 1, 17, 53, &name),
                DnsRuling::Refuse(vec!["p[0]".into()]),
                "the proxy forwarded {name:?}"
            );
        }
        for ok in [
            "a.example.com",
            "A-b_9.example.com.",
            "_srv.example.com",
            "--.example.com",
        ] {
            assert!(p.matches(ok), "{ok}");
        }
        assert!(prefix.matches("api-Eu_1.example.com") && inner.matches("a-x_b.example.com"));
    }

    #[test]
    fn a_lone_star_selects_names_of_label_characters_and_lets_every_query_through() {
        // toFQDNs (`ToAnchoredRegexp("*")`): `(^([-a-zA-Z0-9_]+[.])+$)|(^[.]$)`.
        let all = FqdnPattern::pattern("*");
        for odd in ODD_LABELS {
            assert!(!all.matches(&format!("{odd}.example.com")), "{odd:?}");
        }
        assert!(!all.matches("a..example.com"), "an empty label");
        assert!(all.matches("x.y.example.com") && all.matches("."));
        // DNS rules (the proxy's `GeneratePattern`): a lone `*` is match-all, any name at all.
        let t = vec![entry(&[], 53, Some(&["*"]), "p[0]")];
        for odd in ODD_LABELS {
            let name = format!("{odd}.example.com");
            assert_eq!(
                dns_ruling(&t, 1, 17, 53, &name),
                DnsRuling::Forward(vec!["p[0]".into()]),
                "{name:?}"
            );
        }
    }

    #[test]
    fn a_lone_star_matches_every_name_and_double_star_is_one_label_in_1_16() {
        let all = FqdnPattern::pattern("*");
        assert!(all.matches("a.b.c.example.com") && all.matches("localhost"));
        let two = FqdnPattern::pattern("**.example.com");
        assert!(two.matches("a.example.com"));
        assert!(!two.matches("a.b.example.com"));
    }

    #[test]
    fn a_domain_names_star_matches_one_or_more_whole_labels() {
        // The network-policy-api's own examples (v0.2.0, `DomainName`).
        let exact = FqdnPattern::domain_name("kubernetes.io");
        assert!(exact.matches("kubernetes.io") && exact.matches("Kubernetes.IO."));
        for other in ["www.kubernetes.io", "my-kubernetes.io", "wikipedia.org"] {
            assert!(!exact.matches(other), "{other}");
        }
        let below = FqdnPattern::domain_name("*.kubernetes.io");
        for name in [
            "www.kubernetes.io",
            "blog.kubernetes.io",
            "latest.blog.kubernetes.io",
            "WWW.Kubernetes.io.",
        ] {
            assert!(below.matches(name), "{name}");
        }
        for other in [
            "kubernetes.io",
            "wikipedia.org",
            "my-kubernetes.io",
            ".kubernetes.io",
            "a..kubernetes.io",
        ] {
            assert!(!below.matches(other), "{other}");
        }
        // Never the same selector as a CNP's one-label pattern of the same text.
        assert_ne!(below, FqdnPattern::pattern("*.kubernetes.io"));
        assert_eq!(below.to_string(), "domainName:*.kubernetes.io");
        // Serialized as before for the other forms (kept DNS rules stay readable).
        let json = serde_json::to_string(&FqdnPattern::pattern("*.a.b")).unwrap();
        assert!(!json.contains("subdomains"), "{json}");
    }
}
