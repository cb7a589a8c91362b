//! An endpoint's part of the HTTP proxy's table, from its resolved policy (pure).
//!
//! The proxy only ever sees connections an entry with an L7 rule redirected; to judge their
//! requests as Cilium does it needs every allow entry that also matches them (an L3/L4 allow
//! of the same peer and port lets every request through). So the table holds, per direction
//! with a redirecting entry, every TCP (or any-protocol) allow entry whose ports overlap a
//! redirecting entry's, with each contribution's L7 part.

use std::collections::HashMap;
use std::sync::Arc;

use super::{EndpointTable, TableEntry, WireGrant};
use crate::policy::attribution::PolicyRef;
use crate::policy::l7::http::L7PortRules;
use crate::policy::mapstate::{MapEntry, MapKey, MapState};
use crate::policy::rule::Direction;

/// The entries of `map` the proxy needs (empty: the endpoint has no L7 rule), with the L7
/// parts they refer to.
pub fn proxy_entries(map: &MapState) -> (Vec<TableEntry>, Vec<L7PortRules>) {
    // Most endpoints have no L7 rule: no entry redirects, none goes to the proxy (a scan, not
    // the sorted copy of every entry below).
    if !map.any_redirect() {
        return (Vec::new(), Vec::new());
    }
    let all = map.entries();
    // Port ranges of redirecting entries, per direction.
    let mut redirected: [Vec<(u16, u16)>; 2] = [vec![], vec![]];
    for (k, e) in &all {
        if e.redirect() {
            redirected[dir(k)].push((k.port_lo, k.port_hi));
        }
    }
    let mut sets: Vec<L7PortRules> = Vec::new();
    let mut by_ptr: HashMap<usize, usize> = HashMap::new();
    let mut out = Vec::new();
    for (k, e) in &all {
        let ranges = &redirected[dir(k)];
        if e.deny
            || !(k.protocol == 0 || k.protocol == 6)
            || !ranges
                .iter()
                .any(|(lo, hi)| k.port_lo <= *hi && *lo <= k.port_hi)
        {
            continue;
        }
        out.push(TableEntry {
            egress: k.direction == Direction::Egress,
            identity: k.identity,
            protocol: k.protocol,
            port_lo: k.port_lo,
            port_hi: k.port_hi,
            grants: grants(e, &mut sets, &mut by_ptr),
        });
    }
    (out, sets)
}

fn dir(k: &MapKey) -> usize {
    (k.direction == Direction::Egress) as usize
}

fn grants(
    e: &MapEntry,
    sets: &mut Vec<L7PortRules>,
    by_ptr: &mut HashMap<usize, usize>,
) -> Vec<WireGrant> {
    let Some(l7) = &e.l7 else {
        return e
            .derived_from
            .iter()
            .map(|o| WireGrant {
                rule: o.describe(),
                policy: PolicyRef::of_rule(o),
                rules: None,
            })
            .collect();
    };
    l7.iter()
        .map(|g| WireGrant {
            rule: g.origin.describe(),
            policy: PolicyRef::of_rule(&g.origin),
            rules: g.rules.as_ref().map(|r| {
                *by_ptr.entry(Arc::as_ptr(r) as usize).or_insert_with(|| {
                    sets.push((**r).clone());
                    sets.len() - 1
                })
            }),
        })
        .collect()
}

/// An endpoint's table (no entries: it has no L7 rule; the proxy still knows the endpoint,
/// so a connection it proxied under an earlier policy goes on, judged at L3/L4 as the
/// datapath judges established connections).
pub fn endpoint_table(
    id: u64,
    pod: &str,
    ips: &[std::net::IpAddr],
    audit: bool,
    map: &MapState,
) -> EndpointTable {
    let (entries, rule_sets) = proxy_entries(map);
    EndpointTable {
        id,
        pod: pod.to_string(),
        ips: ips.to_vec(),
        audit,
        entries,
        rule_sets,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::engine::{EndpointView, PolicyEngine};
    use crate::policy::labels::Labels;
    use crate::policy::translate::parse_policy;

    fn labels(app: &str) -> Labels {
        let l: std::collections::BTreeMap<String, String> =
            [("app".to_string(), app.to_string())].into();
        Labels::for_pod("y", &l, &std::collections::BTreeMap::new(), None)
    }

    #[test]
    fn the_table_holds_the_l7_entries_and_the_allows_overlapping_their_ports() {
        let mut e = PolicyEngine::new();
        let web = labels("web");
        let web_id = e.allocate_identity(&web).id();
        let client = e.allocate_identity(&labels("client")).id();
        let ops = e.allocate_identity(&labels("ops")).id();
        let doc: serde_yaml::Value = serde_yaml::from_str(
            "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: web, namespace: y},
              spec: {endpointSelector: {matchLabels: {app: web}}, ingress: [
                {fromEndpoints: [{matchLabels: {app: client}}], toPorts: [{ports: [{port: '8080', protocol: TCP}], rules: {http: [{method: GET}]}}]},
                {fromEndpoints: [{matchLabels: {app: ops}}]},
                {fromEndpoints: [{matchLabels: {app: ops}}], toPorts: [{ports: [{port: '22', protocol: TCP}]}]}]}}",
        )
        .unwrap();
        e.upsert_policy(parse_policy(&doc, "y", "t").unwrap());
        let pol = e.resolve(&EndpointView {
            identity: web_id,
            labels: &web,
            named_ports: &[],
            host: false,
        });
        let t = endpoint_table(3, "y/web", &[], false, &pol.map);
        assert_eq!(t.rule_sets.len(), 1);
        let ids: Vec<(u32, u8, u16)> = t
            .entries
            .iter()
            .map(|e| (e.identity, e.protocol, e.port_lo))
            .collect();
        assert!(ids.contains(&(client, 6, 8080)));
        assert!(
            ids.contains(&(ops, 0, 0)),
            "the L3-only allow overlaps 8080"
        );
        assert!(
            !ids.contains(&(ops, 6, 22)),
            "port 22 never reaches the proxy"
        );
        let client_entry = t.entries.iter().find(|e| e.identity == client).unwrap();
        assert_eq!(client_entry.grants[0].rules, Some(0));
        assert!(client_entry.grants[0]
            .rule
            .starts_with("CiliumNetworkPolicy y/web[0]"));
        // No L7 rule: an empty table.
        let other = e.resolve(&EndpointView {
            identity: ops,
            labels: &labels("ops"),
            named_ports: &[],
            host: false,
        });
        let t = endpoint_table(4, "y/ops", &[], false, &other.map);
        assert!(t.entries.is_empty() && t.rule_sets.is_empty());
    }
}
