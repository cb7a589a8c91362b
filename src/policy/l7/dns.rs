//! DNS rules (`toPorts[].rules.dns`) as the DNS proxy applies them: an endpoint's table of
//! (server identities, protocol, port range) -> the names allowed, and Cilium's ruling on one
//! query. The names themselves (matchName, matchPattern) are `policy::fqdn`'s.

use serde::{Deserialize, Serialize};

use crate::policy::fqdn::FqdnPattern;
use crate::policy::identity::{NumericIdentity, IDENTITY_ANY};
use crate::policy::rule::{PeerRule, PortSpec, Ports};

/// One class of an endpoint's egress DNS traffic and what its rules allow: the DNS proxy's
/// table. An endpoint gets a table only when one of its egress allow rules carries DNS rules
/// (`toPorts[].rules.dns`); then its DNS (UDP and TCP 53) goes through the proxy, and every
/// allow rule naming a port (with or without DNS rules) has an entry here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DnsRuleEntry {
    /// Server identities the rule selects (sorted); empty: any server.
    pub servers: Vec<u32>,
    /// IP protocol number (6 or 17).
    pub protocol: u8,
    pub port_lo: u16,
    pub port_hi: u16,
    /// The names allowed; `None`: any name (the port is allowed without DNS rules).
    pub names: Option<Vec<FqdnPattern>>,
    /// The rule, in `policy::rule::rule_name`'s words.
    pub policy: String,
}

/// What the DNS rules say about one query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsRuling {
    /// Forward it; the policies that allow it (empty: no DNS rule covers this server and port,
    /// so L3/L4 policy alone, which already let the packet through, decides).
    Forward(Vec<String>),
    /// Answer REFUSED; the policies whose DNS rules cover the server and port.
    Refuse(Vec<String>),
}

/// Cilium's rule for a query of `name` to a server of identity `server` on `protocol`/`port`:
/// a rule that covers the port without DNS rules lets any name through; otherwise the name must
/// match a pattern of a covering rule; with no covering rule, nothing restricts the name.
pub fn dns_ruling(
    table: &[DnsRuleEntry],
    server: u32,
    protocol: u8,
    port: u16,
    name: &str,
) -> DnsRuling {
    let mut covering = Vec::new();
    for e in table.iter().filter(|e| {
        (e.servers.is_empty() || e.servers.binary_search(&server).is_ok())
            && (e.protocol == protocol || e.protocol == 0)
            && (e.port_lo..=e.port_hi).contains(&port)
    }) {
        match &e.names {
            None => return DnsRuling::Forward(vec![e.policy.clone()]),
            Some(n) if n.iter().any(|p| p.allows_query(name)) => {
                return DnsRuling::Forward(vec![e.policy.clone()])
            }
            Some(_) => covering.push(e.policy.clone()),
        }
    }
    covering.dedup();
    if covering.is_empty() {
        DnsRuling::Forward(vec![])
    } else {
        DnsRuling::Refuse(covering)
    }
}

/// The DNS proxy's entries of one egress allow rule selecting `ids`: one per TCP/UDP port
/// range it names, with the names its DNS rules allow there (`None`: any name). Named ports
/// are not resolved for DNS (a DNS server's port is 53 by number in every known manifest).
pub fn dns_entries(out: &mut Vec<DnsRuleEntry>, pr: &PeerRule, ids: &[NumericIdentity]) {
    let Ports::List(list) = &pr.ports else {
        return;
    };
    if ids.is_empty() {
        return;
    }
    let servers: Vec<u32> = if ids.contains(&IDENTITY_ANY) {
        vec![]
    } else {
        ids.to_vec()
    };
    for pm in list {
        let PortSpec::Range(lo, hi) = pm.port else {
            continue;
        };
        let names = pr
            .dns
            .iter()
            .find(|d| d.ports.contains(pm))
            .map(|d| d.names.clone());
        for &protocol in pm.protocol.numbers() {
            if protocol == 6 || protocol == 17 {
                out.push(DnsRuleEntry {
                    servers: servers.clone(),
                    protocol,
                    port_lo: lo,
                    port_hi: hi,
                    names: names.clone(),
                    policy: pr.origin.describe(),
                });
            }
        }
    }
}

/// A one-port UDP entry (tests of this module and of `fqdn`).
#[cfg(test)]
pub(crate) fn entry(
    servers: &[u32],
    port: u16,
    names: Option<&[&str]>,
    policy: &str,
) -> DnsRuleEntry {
    DnsRuleEntry {
        servers: servers.to_vec(),
        protocol: 17,
        port_lo: port,
        port_hi: port,
        names: names.map(|n| n.iter().map(|p| FqdnPattern::pattern(p)).collect()),
        policy: policy.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_rulings_follow_cilium_any_name_wins_and_uncovered_servers_are_not_restricted() {
        let t = vec![entry(&[100], 53, Some(&["*.example.com"]), "p[0]")];
        assert_eq!(
            dns_ruling(&t, 100, 17, 53, "API.example.com."),
            DnsRuling::Forward(vec!["p[0]".into()])
        );
        assert_eq!(
            dns_ruling(&t, 100, 17, 53, "evil.test"),
            DnsRuling::Refuse(vec!["p[0]".into()])
        );
        assert_eq!(
            dns_ruling(&t, 100, 6, 53, "evil.test"),
            DnsRuling::Forward(vec![])
        );
        assert_eq!(
            dns_ruling(&t, 200, 17, 53, "evil.test"),
            DnsRuling::Forward(vec![])
        );
        let mut any = t.clone();
        any.push(entry(&[], 53, None, "q[0]"));
        assert_eq!(
            dns_ruling(&any, 100, 17, 53, "evil.test"),
            DnsRuling::Forward(vec!["q[0]".into()])
        );
    }
}
