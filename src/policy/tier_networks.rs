//! `networks` peers of the cluster tiers inside the cluster. The network-policy-api says of
//! them: "cluster-internal traffic will be checked against the rule as well. So if you Allow or
//! Deny traffic to `0.0.0.0/0`, that will allow or deny all IPv4 pod-to-pod traffic as well."
//! (CiliumNetworkPolicy's CIDR rules, by contrast, never select pods.)
//!
//! The policy map is keyed by identity, and the pods of one identity may have addresses both
//! inside and outside a CIDR. So a rule's CIDRs cover an identity of the cluster fully (every
//! address of it that the agent knows, pods, endpoints and nodes, is inside) or partly. Fully
//! covered identities are peers of the rule. A partly covered one is a peer of a `Deny` (its
//! outside pods are denied too), not of an `Allow` (its inside pods fall through to the next
//! rules), and is denied where the rule is a `Pass`: each choice is never more permissive than
//! the API (fail closed), and the agent says so for the endpoint.

use std::collections::{BTreeMap, HashMap};

use ipnet::IpNet;

use super::identity::NumericIdentity;
use super::selector::CidrSelector;

/// The cluster identities a set of CIDRs covers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cover {
    /// Every known address of the identity is inside.
    pub full: Vec<NumericIdentity>,
    /// Some are inside, some outside.
    pub partial: Vec<NumericIdentity>,
}

/// What the CIDRs cover among the cluster's addresses (`addresses`: pods, endpoints, nodes).
pub fn cover(addresses: &HashMap<IpNet, NumericIdentity>, cidrs: &[&CidrSelector]) -> Cover {
    let inside = |a: &IpNet| {
        cidrs.iter().any(|c| {
            c.prefix.contains(a) && !c.except.iter().any(|e| e.contains(a) || a.contains(e))
        })
    };
    // Per identity: (addresses inside, addresses outside).
    let mut count: BTreeMap<NumericIdentity, (usize, usize)> = BTreeMap::new();
    for (a, id) in addresses {
        let c = count.entry(*id).or_default();
        if inside(a) {
            c.0 += 1;
        } else {
            c.1 += 1;
        }
    }
    let mut out = Cover::default();
    for (id, (i, o)) in count {
        match (i, o) {
            (0, _) => {}
            (_, 0) => out.full.push(id),
            _ => out.partial.push(id),
        }
    }
    out
}

/// Covers computed during one resolution, by the CIDRs asked about (rules of many policies
/// name the same networks, e.g. `0.0.0.0/0`).
#[derive(Debug, Default)]
pub struct CoverMemo {
    memo: HashMap<Vec<CidrSelector>, std::rc::Rc<Cover>>,
}

impl CoverMemo {
    pub fn get(
        &mut self,
        addresses: &HashMap<IpNet, NumericIdentity>,
        cidrs: &[&CidrSelector],
    ) -> std::rc::Rc<Cover> {
        let key: Vec<CidrSelector> = cidrs.iter().map(|c| (*c).clone()).collect();
        self.memo
            .entry(key)
            .or_insert_with(|| std::rc::Rc::new(cover(addresses, cidrs)))
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn identities_are_covered_fully_partly_or_not() {
        let addresses: HashMap<IpNet, NumericIdentity> = [
            ("10.0.1.1/32", 300), // both pods of 300 inside 10.0.1.0/24
            ("10.0.1.2/32", 300),
            ("10.0.1.3/32", 301), // 301: one inside, one outside
            ("10.0.2.3/32", 301),
            ("10.0.2.4/32", 302), // 302: outside
            ("172.18.0.2/32", 6), // a remote node
        ]
        .into_iter()
        .map(|(a, id)| (net(a), id))
        .collect();
        let c24 = CidrSelector::new(net("10.0.1.0/24"), vec![]);
        assert_eq!(
            cover(&addresses, &[&c24]),
            Cover {
                full: vec![300],
                partial: vec![301]
            }
        );
        // 0.0.0.0/0 covers every pod and node.
        let all = CidrSelector::new(net("0.0.0.0/0"), vec![]);
        assert_eq!(cover(&addresses, &[&all]).full, vec![6, 300, 301, 302]);
        // An except carves addresses out: 300 becomes partial.
        let carved = CidrSelector::new(net("10.0.0.0/8"), vec![net("10.0.1.2/32")]);
        assert_eq!(
            cover(&addresses, &[&carved]),
            Cover {
                full: vec![301, 302],
                partial: vec![300]
            }
        );
        // Two CIDRs together cover 301.
        let c2 = CidrSelector::new(net("10.0.2.0/24"), vec![]);
        assert_eq!(cover(&addresses, &[&c24, &c2]).full, vec![300, 301, 302]);
        assert_eq!(cover(&addresses, &[]), Cover::default());
        let mut memo = CoverMemo::default();
        assert!(std::rc::Rc::ptr_eq(
            &memo.get(&addresses, &[&c24]),
            &memo.get(&addresses, &[&c24])
        ));
    }
}
