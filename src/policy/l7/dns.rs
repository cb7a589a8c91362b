//! DNS rules (`toPorts[].rules.dns`) as the DNS proxy applies them: an endpoint's table of
//! (server identities, protocol, port range) -> the names allowed, and Cilium's ruling on one
//! query. The names themselves (matchName, matchPattern) are `policy::fqdn`'s.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::policy::fqdn::FqdnPattern;
use crate::policy::identity::{NumericIdentity, IDENTITY_ANY};
use crate::policy::rule::{Action, PeerRule, PortSpec, Ports};
use crate::policy::tiers::TierRule;

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

/// The entries that let any name through where the Admin tier accepts the query itself.
///
/// A query the Admin tier's first matching rule allows never reaches the NetworkPolicy tier
/// (network-policy-api: `Accept` ends the evaluation), so that tier's DNS rules must not judge
/// it. For each server and port a restricting entry of `table` covers, the Admin tier is
/// evaluated; where it accepts, an entry for that server and port with any name is returned,
/// named after the accepting rule (put first: the ruling names the rule that decided). Where
/// it passes or does not match, the NetworkPolicy tier decides and its DNS rules stand; where it
/// denies, the datapath drops the query before the proxy. An entry for any server is widened
/// only when the Admin tier accepts every server it names there too (or denies them); else its
/// names stay restricted for all servers (never looser than the API).
pub fn tier_accepted(table: &[DnsRuleEntry], admin: &[TierRule]) -> Vec<DnsRuleEntry> {
    // (rule, protocol, first port, last port) -> servers (empty: any).
    let mut accepted: BTreeMap<(usize, u8, u16, u16), BTreeSet<u32>> = BTreeMap::new();
    let mut any: BTreeSet<(usize, u8, u16, u16)> = BTreeSet::new();
    let named: BTreeSet<u32> = admin
        .iter()
        .flat_map(|r| r.peers.iter().copied())
        .filter(|&i| i != IDENTITY_ANY)
        .collect();
    // Identities no Admin rule names all fare alike: one that no table or rule can hold.
    let unnamed = (1..)
        .map(|i| u32::MAX - i)
        .find(|i| !named.contains(i))
        .unwrap_or(u32::MAX);
    for e in table.iter().filter(|e| e.names.is_some()) {
        for (lo, hi) in port_pieces(admin, e.protocol, e.port_lo, e.port_hi) {
            let first = |id: u32| first_admin(admin, id, e.protocol, lo);
            if e.servers.is_empty() {
                let Some(i) = first(unnamed).filter(|&i| admin[i].action == Action::Allow) else {
                    continue;
                };
                let all = named
                    .iter()
                    .all(|&id| first(id).is_some_and(|j| admin[j].action != Action::Pass));
                if all {
                    any.insert((i, e.protocol, lo, hi));
                    continue;
                }
            }
            let servers = if e.servers.is_empty() {
                named.iter().copied().collect::<Vec<_>>()
            } else {
                e.servers.clone()
            };
            for s in servers {
                if let Some(i) = first(s).filter(|&i| admin[i].action == Action::Allow) {
                    accepted
                        .entry((i, e.protocol, lo, hi))
                        .or_default()
                        .insert(s);
                }
            }
        }
    }
    let entry = |(i, protocol, lo, hi): (usize, u8, u16, u16), servers: Vec<u32>| DnsRuleEntry {
        servers,
        protocol,
        port_lo: lo,
        port_hi: hi,
        names: None,
        policy: admin[i].origin.describe(),
    };
    any.iter()
        .map(|&k| entry(k, vec![]))
        .chain(
            accepted
                .into_iter()
                .filter(|(k, _)| !any.contains(k))
                .map(|(k, s)| entry(k, s.into_iter().collect())),
        )
        .collect()
}

/// The Admin tier's first rule matching `id` on `protocol`/`port` (its index).
fn first_admin(admin: &[TierRule], id: u32, protocol: u8, port: u16) -> Option<usize> {
    admin.iter().position(|r| {
        (r.peers.first() == Some(&IDENTITY_ANY) || r.peers.binary_search(&id).is_ok())
            && r.ports.as_ref().is_none_or(|l| {
                l.iter()
                    .any(|&(p, lo, hi)| p == protocol && lo <= port && port <= hi)
            })
    })
}

/// `lo..=hi` cut at the Admin rules' port bounds of `protocol`: within a piece, every port
/// meets the same first rule.
fn port_pieces(admin: &[TierRule], protocol: u8, lo: u16, hi: u16) -> Vec<(u16, u16)> {
    let mut cuts: BTreeSet<u32> = [lo as u32, hi as u32 + 1].into();
    for &(p, a, b) in admin.iter().flat_map(|r| r.ports.iter().flatten()) {
        for c in [a as u32, b as u32 + 1] {
            if p == protocol && c > lo as u32 && c <= hi as u32 {
                cuts.insert(c);
            }
        }
    }
    let cuts: Vec<u32> = cuts.into_iter().collect();
    cuts.windows(2)
        .map(|w| (w[0] as u16, (w[1] - 1) as u16))
        .collect()
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

    fn admin(action: Action, peers: &[u32], protocol: u8, lo: u16, hi: u16) -> TierRule {
        use crate::policy::rule::{PolicyKey, PolicyKind, RuleOrigin, Section, Tier};
        TierRule {
            origin: std::sync::Arc::new(RuleOrigin {
                policy: std::sync::Arc::new(PolicyKey::new(
                    PolicyKind::AdminNetworkPolicy,
                    None,
                    &format!("{action:?}-{peers:?}"),
                )),
                section: Section::Egress,
                path: "spec.egress[0]".into(),
                l7: false,
                tier: Some(Tier::Admin),
            }),
            action,
            peers: peers.into(),
            ports: Some(vec![(protocol, lo, hi)]),
        }
    }

    #[test]
    fn the_admin_tier_s_accepted_servers_and_ports_get_any_name_and_nothing_else_does() {
        let any_server = vec![entry(&[], 53, Some(&["*.example.com"]), "p[0]")];
        let shape = |t: Vec<DnsRuleEntry>| -> Vec<(Vec<u32>, u16, u16, bool)> {
            t.into_iter()
                .map(|e| (e.servers, e.port_lo, e.port_hi, e.names.is_none()))
                .collect()
        };
        // Every server accepted: one entry for any server, any name.
        let t = vec![admin(Action::Allow, &[IDENTITY_ANY], 17, 53, 53)];
        let out = tier_accepted(&any_server, &t);
        assert_eq!(shape(out.clone()), vec![(vec![], 53, 53, true)]);
        assert!(
            out[0].policy.contains("AdminNetworkPolicy"),
            "{:?}",
            out[0].policy
        );
        assert!(matches!(
            dns_ruling(&[out, any_server.clone()].concat(), 9, 17, 53, "evil.test."),
            DnsRuling::Forward(_)
        ));
        // One server passed on first: no entry can say "all but that one", so the names stay
        // restricted for every server (never looser than the API).
        let t = vec![
            admin(Action::Pass, &[7], 17, 53, 53),
            admin(Action::Allow, &[IDENTITY_ANY], 17, 53, 53),
        ];
        assert!(tier_accepted(&any_server, &t).is_empty());
        // Denied first instead: dropped before the proxy, so widening is harmless.
        let t = vec![
            admin(Action::Deny, &[7], 17, 53, 53),
            admin(Action::Allow, &[IDENTITY_ANY], 17, 53, 53),
        ];
        assert_eq!(
            shape(tier_accepted(&any_server, &t)),
            vec![(vec![], 53, 53, true)]
        );
        // Named servers and a port range: only the accepted server, on the accepted port.
        let mut ranged = entry(&[5, 6], 50, Some(&["*.example.com"]), "q[0]");
        ranged.port_hi = 60;
        let t = vec![admin(Action::Allow, &[5], 17, 53, 53)];
        assert_eq!(
            shape(tier_accepted(&[ranged.clone()], &t)),
            vec![(vec![5], 53, 53, true)]
        );
        // Another protocol accepted: nothing for this one; entries with any name: nothing.
        let t = vec![admin(Action::Allow, &[5, 6], 6, 53, 53)];
        assert!(tier_accepted(&[ranged], &t).is_empty());
        let open = vec![entry(&[5], 53, None, "r[0]")];
        let t = vec![admin(Action::Allow, &[5], 17, 53, 53)];
        assert!(tier_accepted(&open, &t).is_empty());
    }

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
