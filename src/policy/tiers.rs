//! Cluster policy tiers (AdminNetworkPolicy, BaselineAdminNetworkPolicy, ClusterNetworkPolicy)
//! around the NetworkPolicy tier, and how they become one deny-wins map.
//!
//! Evaluation, per direction (the network-policy-api's): the Admin tier's rules in order (lowest
//! priority first, then by name, then rule index; the first rule that matches decides: `Allow`
//! and `Deny` end it, `Pass` skips the rest of the tier), then the NetworkPolicy tier
//! (NetworkPolicy, CNP, CCNP: deny wins, then allow, then the default deny of an isolated
//! endpoint), then the Baseline tier's rules in order, then allow. `evaluate` is that, literally.
//!
//! The datapath keeps one lookup: the entries of an endpoint's map, where any matching deny
//! wins, else any allow, else the direction's default. `compile` turns the tiers into such
//! entries. It cuts the key space into cells: each identity any rule names, and one class for
//! every other identity (the wildcard identity 0); the protocols rules name plus TCP, UDP, SCTP,
//! ICMP and ICMPv6, and one class for every other protocol (protocol 0); the port ranges the
//! rules' bounds cut. It evaluates each cell and writes entries so that the deny-wins lookup
//! gives every cell its verdict, the default set to deny whenever a cell is denied:
//! - an allowed cell gets an allow entry (unless an allow of a wider class with the same
//!   deciding rule already covers it);
//! - a denied cell that an allow of a wider class covers gets a deny entry of its own; one that
//!   nothing covers falls to the default.
//!
//! One combination has no exact form in such a map: traffic of protocols no rule names (GRE,
//! ESP, ...) allowed for identities no rule names, while some named identity is denied all of
//! it but allowed something on a named protocol (or an identity is allowed a cell every other
//! identity is denied, for a named protocol, with the wildcard allow in place). Then the other
//! protocols of the identities no rule names are denied (fail closed) and `compile` says so.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::identity::{NumericIdentity, IDENTITY_ANY};
use super::mapstate::{MapEntry, MapKey, MapState, MapVerdict};
use super::rule::{
    Action, Direction, RuleOrigin, Tier, PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP,
};

/// One rule of a tier, its peers resolved to identities.
#[derive(Debug, Clone)]
pub struct TierRule {
    pub origin: Arc<RuleOrigin>,
    pub action: Action,
    /// Sorted; `IDENTITY_ANY` stands for every peer.
    pub peers: Vec<NumericIdentity>,
    /// `None`: every protocol and port; else (protocol, first port, last port), protocol never 0.
    pub ports: Option<Vec<(u8, u16, u16)>>,
}

impl TierRule {
    fn matches(&self, id: NumericIdentity, protocol: u8, port: u16) -> bool {
        let peer =
            self.peers.first() == Some(&IDENTITY_ANY) || self.peers.binary_search(&id).is_ok();
        peer && self.ports.as_ref().is_none_or(|l| {
            l.iter()
                .any(|&(p, lo, hi)| p == protocol && lo <= port && port <= hi)
        })
    }
}

/// The tiers of one direction of one endpoint: the Admin tier's rules and the Baseline tier's,
/// each in evaluation order, and the NetworkPolicy tier (its map and whether it isolates).
#[derive(Debug, Clone, Default)]
pub struct Tiers {
    pub admin: Vec<TierRule>,
    pub baseline: Vec<TierRule>,
}

impl Tiers {
    pub fn is_empty(&self) -> bool {
        self.admin.is_empty() && self.baseline.is_empty()
    }
}

/// Who decided a packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecidedBy {
    /// A tier rule that allowed or denied it (its tier, its index in the tier's order).
    Rule(Tier, usize),
    /// A NetworkPolicy-tier entry (deny or allow).
    NetworkPolicy(MapEntry),
    /// The NetworkPolicy tier isolates the endpoint and nothing there allows it.
    NetworkPolicyDefault,
    /// No tier decided: allowed.
    Default,
}

/// A packet's verdict through the tiers, with the `Pass` rules it went through (explanations).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub allow: bool,
    pub by: DecidedBy,
    /// The Admin rule that passed it on, and the Baseline one.
    pub passed: Vec<(Tier, usize)>,
}

/// Decides traffic with `id` on `protocol`/`port` in `direction` through the tiers: the
/// network-policy-api's evaluation, literally.
pub fn evaluate(
    tiers: &Tiers,
    np: &MapState,
    np_isolated: bool,
    direction: Direction,
    id: NumericIdentity,
    protocol: u8,
    port: u16,
) -> Outcome {
    let mut passed = Vec::new();
    let first = |tier: Tier, rules: &[TierRule], passed: &mut Vec<(Tier, usize)>| {
        for (i, r) in rules.iter().enumerate() {
            if r.matches(id, protocol, port) {
                return match r.action {
                    Action::Allow => Some((true, i)),
                    Action::Deny => Some((false, i)),
                    Action::Pass => {
                        passed.push((tier, i));
                        None
                    }
                };
            }
        }
        None
    };
    if let Some((allow, i)) = first(Tier::Admin, &tiers.admin, &mut passed) {
        return Outcome {
            allow,
            by: DecidedBy::Rule(Tier::Admin, i),
            passed,
        };
    }
    match np.lookup(direction, id, protocol, port) {
        MapVerdict::Denied(e) => {
            return Outcome {
                allow: false,
                by: DecidedBy::NetworkPolicy(e.clone()),
                passed,
            }
        }
        MapVerdict::Allowed(e) => {
            return Outcome {
                allow: true,
                by: DecidedBy::NetworkPolicy(e.clone()),
                passed,
            }
        }
        MapVerdict::NoMatch if np_isolated => {
            return Outcome {
                allow: false,
                by: DecidedBy::NetworkPolicyDefault,
                passed,
            }
        }
        MapVerdict::NoMatch => {}
    }
    if let Some((allow, i)) = first(Tier::Baseline, &tiers.baseline, &mut passed) {
        return Outcome {
            allow,
            by: DecidedBy::Rule(Tier::Baseline, i),
            passed,
        };
    }
    Outcome {
        allow: true,
        by: DecidedBy::Default,
        passed,
    }
}

/// A protocol no rule names (reserved: never on the wire as a rule's protocol).
const OTHER_PROTOCOL: u8 = 255;

/// The protocols that always get cells of their own.
const COMMON_PROTOCOLS: [u8; 5] = [PROTO_TCP, PROTO_UDP, PROTO_SCTP, PROTO_ICMP, PROTO_ICMPV6];

/// One direction's entries through the tiers.
#[derive(Debug, Clone, Default)]
pub struct Compiled {
    /// The entries (of this direction only).
    pub map: MapState,
    /// The direction's default is deny (some cell is denied).
    pub isolated: bool,
    /// What could not be expressed exactly (and was denied instead).
    pub notes: Vec<String>,
}

/// The cells of one direction: identity classes, protocol classes, port ranges per protocol.
struct Cells {
    /// Every identity a rule or a NetworkPolicy-tier entry names.
    named: Vec<NumericIdentity>,
    /// An identity no rule names (a stand-in for all of them).
    other: NumericIdentity,
    protocols: Vec<u8>,
    /// Per protocol of `protocols`: the port ranges that cover 0..=65535.
    ranges: Vec<Vec<(u16, u16)>>,
}

impl Cells {
    fn new(tiers: &Tiers, np: &MapState, direction: Direction) -> Cells {
        let mut named = BTreeSet::new();
        let mut protocols: BTreeSet<u8> = COMMON_PROTOCOLS.into_iter().collect();
        let mut bounds: Vec<(u8, u16, u16)> = Vec::new();
        for r in tiers.admin.iter().chain(tiers.baseline.iter()) {
            named.extend(r.peers.iter().copied().filter(|&i| i != IDENTITY_ANY));
            for &(p, lo, hi) in r.ports.iter().flatten() {
                protocols.insert(p);
                bounds.push((p, lo, hi));
            }
        }
        for (k, _) in np.entries() {
            if k.direction != direction {
                continue;
            }
            if k.identity != IDENTITY_ANY {
                named.insert(k.identity);
            }
            if k.protocol != 0 {
                protocols.insert(k.protocol);
            }
            bounds.push((k.protocol, k.port_lo, k.port_hi));
        }
        let protocols: Vec<u8> = protocols.into_iter().collect();
        let ranges = protocols
            .iter()
            .map(|&p| {
                // Every range of this protocol (or of all protocols) starts a cell at its
                // first port and after its last.
                let mut cuts: BTreeSet<u32> = [0u32, 65536].into_iter().collect();
                for &(q, lo, hi) in &bounds {
                    if q == p || q == 0 {
                        cuts.insert(lo as u32);
                        cuts.insert(hi as u32 + 1);
                    }
                }
                let cuts: Vec<u32> = cuts.into_iter().collect();
                cuts.windows(2)
                    .map(|w| (w[0] as u16, (w[1] - 1) as u16))
                    .collect()
            })
            .collect();
        let named: Vec<NumericIdentity> = named.into_iter().collect();
        // Any number no rule names stands for the identities no rule names.
        let other = (1..)
            .map(|i| u32::MAX - i)
            .find(|i| named.binary_search(i).is_err())
            .unwrap_or(u32::MAX);
        Cells {
            named,
            other,
            protocols,
            ranges,
        }
    }
}

/// What entries decided by a default are derived from: allowed because no tier decided, and
/// denied by the NetworkPolicy tier's isolation.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub allow: Arc<RuleOrigin>,
    pub deny: Arc<RuleOrigin>,
}

/// The origins an outcome's entry is derived from, and their L7 rules.
fn origins_of<'a>(
    tiers: &'a Tiers,
    o: &'a Outcome,
    defaults: &'a Defaults,
) -> Vec<(
    &'a Arc<RuleOrigin>,
    Option<&'a Arc<super::l7::http::L7PortRules>>,
)> {
    match &o.by {
        DecidedBy::Rule(Tier::Admin, i) => vec![(&tiers.admin[*i].origin, None)],
        DecidedBy::Rule(Tier::Baseline, i) => vec![(&tiers.baseline[*i].origin, None)],
        DecidedBy::NetworkPolicy(e) => match &e.l7 {
            Some(grants) => grants
                .iter()
                .map(|g| (&g.origin, g.rules.as_ref()))
                .collect(),
            None => e.derived_from.iter().map(|o| (o, None)).collect(),
        },
        DecidedBy::NetworkPolicyDefault => vec![(&defaults.deny, None)],
        DecidedBy::Default => vec![(&defaults.allow, None)],
    }
}

/// A rule (of a tier, or a NetworkPolicy-tier entry) decided it, not a default.
fn by_rule(o: &Outcome) -> bool {
    matches!(o.by, DecidedBy::Rule(..) | DecidedBy::NetworkPolicy(_))
}

/// Writes one cell's entry.
fn put(
    map: &mut MapState,
    key: MapKey,
    deny: bool,
    tiers: &Tiers,
    o: &Outcome,
    fallback: &Defaults,
) {
    for (origin, l7) in origins_of(tiers, o, fallback) {
        map.insert_l7(key, deny, origin, if deny { None } else { l7 });
    }
}

/// The entries that give every cell of `direction` its verdict through the tiers (module
/// documentation). `fallback`: what entries decided by a default are derived from.
pub fn compile(
    tiers: &Tiers,
    np: &MapState,
    np_isolated: bool,
    direction: Direction,
    fallback: &Defaults,
) -> Compiled {
    let cells = Cells::new(tiers, np, direction);
    let eval = |id: NumericIdentity, p: u8, port: u16| {
        evaluate(tiers, np, np_isolated, direction, id, p, port)
    };
    // Outcomes: [identity class][protocol][range], identity classes `named` then `other`.
    let classes: Vec<NumericIdentity> = cells.named.iter().copied().chain([cells.other]).collect();
    let grid: Vec<Vec<Vec<Outcome>>> = classes
        .iter()
        .map(|&id| {
            cells
                .protocols
                .iter()
                .zip(&cells.ranges)
                .map(|(&p, rs)| rs.iter().map(|&(lo, _)| eval(id, p, lo)).collect())
                .collect()
        })
        .collect();
    let other_protocol: Vec<Outcome> = classes
        .iter()
        .map(|&id| eval(id, OTHER_PROTOCOL, 0))
        .collect();
    let o = classes.len() - 1; // the `other` class
    let mut out = Compiled {
        isolated: grid
            .iter()
            .flatten()
            .flatten()
            .chain(other_protocol.iter())
            .any(|c| !c.allow),
        ..Default::default()
    };
    // The wildcard allow for every other protocol of every other identity, unless it would
    // need a deny it cannot have (module documentation).
    let mut wild = other_protocol[o].allow;
    if wild {
        let named_allowed_where_other_denied = (0..cells.protocols.len()).any(|p| {
            (0..cells.ranges[p].len())
                .any(|r| !grid[o][p][r].allow && (0..o).any(|x| grid[x][p][r].allow))
        });
        let denied_all_else_allowed_some =
            (0..o).any(|x| !other_protocol[x].allow && grid[x].iter().flatten().any(|c| c.allow));
        if named_allowed_where_other_denied || denied_all_else_allowed_some {
            wild = false;
            out.notes.push(format!(
                "{}: protocols other than those the rules name (and TCP, UDP, SCTP, ICMP, ICMPv6) are denied for peers no rule names: the tiers' verdicts for them have no exact form in the policy map (fail closed)",
                direction.as_str()
            ));
        }
    }
    let key = |identity: NumericIdentity, protocol: u8, (lo, hi): (u16, u16)| MapKey {
        direction,
        identity,
        protocol,
        port_lo: lo,
        port_hi: hi,
    };
    let all = (0u16, 65535u16);
    if wild {
        put(
            &mut out.map,
            key(IDENTITY_ANY, 0, all),
            false,
            tiers,
            &other_protocol[o],
            fallback,
        );
    }
    for (p, &proto) in cells.protocols.iter().enumerate() {
        for (r, &range) in cells.ranges[p].iter().enumerate() {
            let c = &grid[o][p][r];
            if c.allow {
                put(
                    &mut out.map,
                    key(IDENTITY_ANY, proto, range),
                    false,
                    tiers,
                    c,
                    fallback,
                );
            } else if wild || (by_rule(c) && (0..o).all(|x| !grid[x][p][r].allow)) {
                // Needed under the wildcard allow; otherwise it names the deciding rule (the
                // default would say only "isolated"), where no named identity is allowed.
                put(
                    &mut out.map,
                    key(IDENTITY_ANY, proto, range),
                    true,
                    tiers,
                    c,
                    fallback,
                );
            }
        }
    }
    for (x, &id) in cells.named.iter().enumerate() {
        let own = &other_protocol[x];
        let mut own_wild = false;
        if own.allow && (!wild || own.by != other_protocol[o].by) {
            put(&mut out.map, key(id, 0, all), false, tiers, own, fallback);
            own_wild = true;
        } else if !own.allow && wild {
            // No concrete cell of `id` is allowed (or `wild` would be off).
            put(&mut out.map, key(id, 0, all), true, tiers, own, fallback);
            continue;
        }
        for (p, &proto) in cells.protocols.iter().enumerate() {
            for (r, &range) in cells.ranges[p].iter().enumerate() {
                let c = &grid[x][p][r];
                let wider = &grid[o][p][r];
                let covered = wider.allow || wild || own_wild;
                if c.allow {
                    // The wider allows' own deciding rule covers it already.
                    let same = wider.allow && wider.by == c.by;
                    if !same {
                        put(
                            &mut out.map,
                            key(id, proto, range),
                            false,
                            tiers,
                            c,
                            fallback,
                        );
                    }
                } else if covered || (by_rule(c) && wider.by != c.by) {
                    put(
                        &mut out.map,
                        key(id, proto, range),
                        true,
                        tiers,
                        c,
                        fallback,
                    );
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::rule::{PolicyKey, PolicyKind, Section};
    use proptest::prelude::*;

    fn origin(name: &str) -> Arc<RuleOrigin> {
        Arc::new(RuleOrigin {
            policy: Arc::new(PolicyKey::new(
                PolicyKind::CiliumNetworkPolicy,
                Some("x"),
                name,
            )),
            section: Section::Ingress,
            path: "spec.ingress[0]".into(),
            l7: false,
            tier: None,
        })
    }

    /// Every cell, looked up in the compiled map as the datapath does, against `evaluate`.
    fn check(tiers: &Tiers, np: &MapState, np_isolated: bool, ids: &[NumericIdentity]) {
        let fallback = Defaults {
            allow: origin("allowed"),
            deny: origin("isolated"),
        };
        let c = compile(tiers, np, np_isolated, Direction::Ingress, &fallback);
        let exact = c.notes.is_empty();
        for &id in ids {
            for proto in [PROTO_TCP, PROTO_UDP, PROTO_ICMP, 47] {
                for port in [0u16, 1, 2, 3, 4, 5, 6, 79, 80, 81, 443, 65535] {
                    let port = if proto == 47 { 0 } else { port };
                    let want =
                        evaluate(tiers, np, np_isolated, Direction::Ingress, id, proto, port).allow;
                    let got = match c.map.lookup(Direction::Ingress, id, proto, port) {
                        MapVerdict::Denied(_) => false,
                        MapVerdict::Allowed(_) => true,
                        MapVerdict::NoMatch => !c.isolated,
                    };
                    let named = tiers
                        .admin
                        .iter()
                        .chain(&tiers.baseline)
                        .any(|r| r.peers.contains(&id))
                        || np.entries().iter().any(|(k, _)| k.identity == id);
                    if !exact && proto == 47 && !named {
                        // Fail closed: denied where the tiers allow.
                        assert!(!got, "id {id} proto {proto}: the fallback must deny");
                        continue;
                    }
                    assert_eq!(
                        got,
                        want,
                        "id {id} proto {proto} port {port}\nmap: {:?}\ntiers: {tiers:?}",
                        c.map.entries()
                    );
                }
            }
        }
    }

    fn rule(
        name: &str,
        action: Action,
        peers: Vec<NumericIdentity>,
        ports: Option<Vec<(u8, u16, u16)>>,
    ) -> TierRule {
        TierRule {
            origin: origin(name),
            action,
            peers,
            ports,
        }
    }

    #[test]
    fn admin_deny_beats_a_network_policy_allow_and_pass_hands_over() {
        let mut np = MapState::new();
        let allow = origin("np-allow");
        np.insert(
            crate::policy::mapstate::ingress_key(10, PROTO_TCP, 80, 80),
            false,
            &allow,
        );
        let tiers = Tiers {
            admin: vec![
                rule("pass-11", Action::Pass, vec![11], None),
                rule(
                    "deny-all-80",
                    Action::Deny,
                    vec![IDENTITY_ANY],
                    Some(vec![(PROTO_TCP, 80, 80)]),
                ),
            ],
            baseline: vec![rule(
                "baseline-deny",
                Action::Deny,
                vec![IDENTITY_ANY],
                None,
            )],
        };
        let ev = |id, port| evaluate(&tiers, &np, true, Direction::Ingress, id, PROTO_TCP, port);
        assert_eq!(ev(10, 80).by, DecidedBy::Rule(Tier::Admin, 1));
        assert!(!ev(10, 80).allow);
        // 11 passes to the NetworkPolicy tier, which isolates: default deny.
        assert_eq!(ev(11, 80).by, DecidedBy::NetworkPolicyDefault);
        assert_eq!(ev(11, 80).passed, vec![(Tier::Admin, 0)]);
        // Not isolated: the baseline decides.
        let o = evaluate(&tiers, &np, false, Direction::Ingress, 12, PROTO_TCP, 81);
        assert_eq!((o.allow, o.by), (false, DecidedBy::Rule(Tier::Baseline, 0)));
        check(&tiers, &np, true, &[10, 11, 12, 99]);
        check(&tiers, &np, false, &[10, 11, 12, 99]);
    }

    #[test]
    fn an_allowed_identity_inside_a_denied_wildcard() {
        let np = MapState::new();
        let tiers = Tiers {
            admin: vec![
                rule(
                    "allow-5",
                    Action::Allow,
                    vec![5],
                    Some(vec![(PROTO_TCP, 80, 80)]),
                ),
                rule(
                    "deny-80",
                    Action::Deny,
                    vec![IDENTITY_ANY],
                    Some(vec![(PROTO_TCP, 80, 80)]),
                ),
            ],
            baseline: vec![],
        };
        check(&tiers, &np, false, &[5, 6, 99]);
    }

    #[test]
    fn a_passed_identity_default_denied_under_a_wildcard_allow() {
        let np = MapState::new();
        let tiers = Tiers {
            admin: vec![
                rule("pass-3", Action::Pass, vec![3], None),
                rule("allow-all", Action::Allow, vec![IDENTITY_ANY], None),
            ],
            baseline: vec![rule(
                "deny-3",
                Action::Deny,
                vec![3],
                Some(vec![(PROTO_TCP, 80, 80)]),
            )],
        };
        // 3 reaches the baseline (nothing isolates): denied on TCP 80, allowed elsewhere.
        check(&tiers, &np, false, &[3, 4]);
        // Isolated by the NetworkPolicy tier: 3 is denied everything, all others allowed.
        check(&tiers, &np, true, &[3, 4]);
        let o = evaluate(&tiers, &np, true, Direction::Ingress, 3, PROTO_UDP, 53);
        assert_eq!((o.allow, o.by), (false, DecidedBy::NetworkPolicyDefault));
        // Passed on one port only: default-denied there, under the wildcard allow.
        let tiers = Tiers {
            admin: vec![
                rule(
                    "pass-3-80",
                    Action::Pass,
                    vec![3],
                    Some(vec![(PROTO_TCP, 80, 80)]),
                ),
                rule("allow-all", Action::Allow, vec![IDENTITY_ANY], None),
            ],
            baseline: vec![],
        };
        check(&tiers, &np, true, &[3, 4]);
    }

    fn arb_ports() -> impl Strategy<Value = Option<Vec<(u8, u16, u16)>>> {
        prop_oneof![
            Just(None),
            prop::collection::vec(
                (
                    prop_oneof![Just(PROTO_TCP), Just(PROTO_UDP), Just(PROTO_ICMP)],
                    0u16..6,
                    0u16..4
                )
                    .prop_map(|(p, lo, n)| (p, lo, lo + n)),
                1..3
            )
            .prop_map(Some),
        ]
    }

    fn arb_rule() -> impl Strategy<Value = TierRule> {
        (
            prop_oneof![Just(Action::Allow), Just(Action::Deny), Just(Action::Pass)],
            prop_oneof![
                Just(vec![IDENTITY_ANY]),
                prop::collection::btree_set(1u32..5, 1..3).prop_map(|s| s.into_iter().collect())
            ],
            arb_ports(),
        )
            .prop_map(|(a, peers, ports)| rule("r", a, peers, ports))
    }

    fn arb_np() -> impl Strategy<Value = MapState> {
        prop::collection::vec((0u32..5, any::<bool>(), arb_ports()), 0..4).prop_map(|v| {
            let mut m = MapState::new();
            let o = origin("np");
            for (id, deny, ports) in v {
                match ports {
                    None => m.insert(
                        crate::policy::mapstate::ingress_key(id, 0, 0, 65535),
                        deny,
                        &o,
                    ),
                    Some(l) => {
                        for (p, lo, hi) in l {
                            m.insert(
                                crate::policy::mapstate::ingress_key(id, p, lo, hi),
                                deny,
                                &o,
                            )
                        }
                    }
                }
            }
            m
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn the_compiled_map_decides_every_packet_as_the_tiers_do(
            admin in prop::collection::vec(arb_rule(), 0..4),
            baseline in prop::collection::vec(arb_rule(), 0..3),
            np in arb_np(),
            np_isolated in any::<bool>(),
        ) {
            let tiers = Tiers { admin, baseline };
            check(&tiers, &np, np_isolated, &[1, 2, 3, 4, 7]);
        }
    }
}
