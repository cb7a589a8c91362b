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

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

/// The groups (indexes) of one tier that name an identity.
type GroupList = SmallVec<[u32; 6]>;

use super::identity::{NumericIdentity, IDENTITY_ANY};
use super::mapstate::{decide, EntryRef, Group, MapEntry, MapState, MapVerdict};
use super::rule::{
    Action, Direction, RuleOrigin, Tier, PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP,
};

/// One rule of a tier, its peers resolved to identities.
#[derive(Debug, Clone)]
pub struct TierRule {
    pub origin: Arc<RuleOrigin>,
    pub action: Action,
    /// Sorted; `IDENTITY_ANY` stands for every peer. Shared: endpoints and rules that name the
    /// same selections hold one list (`tier_memo::PeerLists`).
    pub peers: Arc<[NumericIdentity]>,
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
    /// The identities (`IDENTITY_ANY` among them) with an entry derived from a default's
    /// origin (`Defaults`): all that another endpoint's defaults would change.
    pub defaulted: Vec<NumericIdentity>,
}

/// What entries decided by a default are derived from: allowed because no tier decided, and
/// denied by the NetworkPolicy tier's isolation.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub allow: Arc<RuleOrigin>,
    pub deny: Arc<RuleOrigin>,
}

/// Who decided a cell, cheaply (compilation only; `DecidedBy` is for explanations).
#[derive(Debug, Clone, Copy)]
enum By<'a> {
    Rule(Tier, usize),
    Np(&'a MapEntry),
    NpDefault,
    Default,
}

impl PartialEq for By<'_> {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (By::Rule(a, i), By::Rule(b, j)) => a == b && i == j,
            (By::Np(a), By::Np(b)) => std::ptr::eq(*a, *b),
            (By::NpDefault, By::NpDefault) | (By::Default, By::Default) => true,
            _ => false,
        }
    }
}

/// A cell's verdict and who decided it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Verdict<'a> {
    allow: bool,
    by: By<'a>,
}

/// A port range's state while the tiers are painted over it, in order.
#[derive(Debug, Clone, Copy, PartialEq)]
enum State<'a> {
    Open,
    /// An Admin `Pass`: the NetworkPolicy tier decides.
    Passed,
    /// The NetworkPolicy tier did not decide and does not isolate: the Baseline tier decides.
    ToBaseline,
    Done(Verdict<'a>),
}

/// Makes rule `v` the first match over `lo..=hi` in the ranges `segs[window]` (sorted, covering
/// 0..=65535) wherever their first match is a later rule or none: a first match is the lowest
/// rule index that matches, whatever order rules are painted in. Only the ranges overlapping
/// `lo..=hi` are looked at. Returns the window's new end.
fn lower(
    segs: &mut Vec<(u16, u16, u32)>,
    window: std::ops::Range<usize>,
    lo: u16,
    hi: u16,
    v: u32,
) -> usize {
    let start = window.start + segs[window.clone()].partition_point(|&(_, b, _)| b < lo);
    let mut end = start;
    let mut any = false;
    while end < window.end && segs[end].0 <= hi {
        any |= segs[end].2 > v;
        end += 1;
    }
    if !any {
        return window.end;
    }
    let mut repl: SmallVec<[(u16, u16, u32); 8]> = SmallVec::new();
    let mut push = |r: (u16, u16, u32)| match repl.last_mut() {
        Some(last) if last.2 == r.2 => last.1 = r.1,
        _ => repl.push(r),
    };
    for &(a, b, x) in &segs[start..end] {
        if x <= v {
            push((a, b, x));
            continue;
        }
        if a < lo {
            push((a, lo - 1, x));
        }
        push((a.max(lo), b.min(hi), v));
        if hi < b {
            push((hi + 1, b, x));
        }
    }
    let (removed, added) = (end - start, repl.len());
    segs.splice(start..end, repl);
    window.end + added - removed
}

/// One identity's verdicts: per protocol of the cells (`Cells::protocols`), and for every other
/// protocol. Flat: one allocation per painting (one per identity with NetworkPolicy-tier entries
/// of its own, one per class for the rest).
struct Painted<'a> {
    /// The protocols' verdict ranges, one protocol after the other.
    ranges: Vec<(u16, u16, Verdict<'a>)>,
    /// Where each protocol's ranges start in `ranges`, and their end.
    starts: SmallVec<[u32; 8]>,
    other: Verdict<'a>,
}

impl<'a> Painted<'a> {
    /// The ranges of protocol `k` (the index in `Cells::protocols`).
    fn protocol(&self, k: usize) -> &[(u16, u16, Verdict<'a>)] {
        &self.ranges[self.starts[k] as usize..self.starts[k + 1] as usize]
    }
}

/// Appends a verdict range, joined to the last one of the same protocol (from `first` on) when
/// it continues it with the same verdict.
fn emit<'a>(
    ranges: &mut Vec<(u16, u16, Verdict<'a>)>,
    first: usize,
    lo: u16,
    hi: u16,
    v: Verdict<'a>,
) {
    if ranges.len() > first {
        let last = ranges.last_mut().expect("not empty");
        if last.2 == v && last.1 as u32 + 1 == lo as u32 {
            last.1 = hi;
            return;
        }
    }
    ranges.push((lo, hi, v));
}

/// No rule (in a first-match painting).
const NONE: u32 = u32::MAX;

/// Ranges of one protocol with the first matching rule of a tier (`NONE`: none), in order,
/// covering 0..=65535.
type FirstMatch = Vec<(u16, u16, u32)>;

/// The first-match painting of one group of a tier's rules: per protocol of the cells, and the
/// first rule that matches every protocol. Flat, as `Painted`.
#[derive(Clone)]
struct GroupPaint {
    /// The protocols' ranges, one protocol after the other.
    ranges: Vec<(u16, u16, u32)>,
    /// Where each protocol's ranges start in `ranges`, and their end.
    starts: SmallVec<[u32; 8]>,
    other: u32,
}

impl GroupPaint {
    fn new(rules: &[TierRule], members: &[usize], protocols: &[u8]) -> GroupPaint {
        // Each painted range adds two ranges at most: room for all at once.
        let most = protocols.len()
            + members
                .iter()
                .map(|&i| 2 * rules[i].ports.as_ref().map_or(protocols.len(), Vec::len))
                .sum::<usize>();
        let mut g = GroupPaint {
            ranges: Vec::with_capacity(most),
            starts: SmallVec::with_capacity(protocols.len() + 1),
            other: members
                .iter()
                .find(|&&i| rules[i].ports.is_none())
                .map_or(NONE, |&i| i as u32),
        };
        // Protocol by protocol, painted in one scratch buffer and appended.
        let mut s: FirstMatch = Vec::new();
        for &proto in protocols {
            s.clear();
            s.push((0, 65535, NONE));
            // A rule of every port and protocol paints the whole of each.
            let whole = [(proto, 0, 65535)];
            for &i in members {
                let ports = rules[i].ports.as_deref().unwrap_or(&whole);
                for &(_, lo, hi) in ports.iter().filter(|x| x.0 == proto) {
                    let n = s.len();
                    lower(&mut s, 0..n, lo, hi, i as u32);
                }
            }
            g.starts.push(g.ranges.len() as u32);
            g.ranges.extend_from_slice(&s);
        }
        g.starts.push(g.ranges.len() as u32);
        g
    }

    /// The ranges of protocol `k` (the index in `Cells::protocols`).
    fn protocol(&self, k: usize) -> &[(u16, u16, u32)] {
        &self.ranges[self.starts[k] as usize..self.starts[k + 1] as usize]
    }

    /// Its ranges, over every protocol.
    fn size(&self) -> usize {
        self.ranges.len()
    }

    /// Makes `v` the first match of protocol `k` over `lo..=hi` where the first match is a
    /// later rule or none (`merge_into` of a painting with that one range).
    fn lower(&mut self, k: usize, lo: u16, hi: u16, v: u32) {
        let (s0, s1) = (self.starts[k] as usize, self.starts[k + 1] as usize);
        let end = lower(&mut self.ranges, s0..s1, lo, hi, v);
        for s in &mut self.starts[k + 1..] {
            *s = (*s as usize + end - s1) as u32;
        }
    }

    /// The first match of this painting and `o`, cell by cell (a protocol `o` has no rule for
    /// stays as it is), written into `out` (cleared first: a buffer reused across merges).
    fn merge_into(&self, o: &GroupPaint, out: &mut GroupPaint) {
        out.ranges.clear();
        out.ranges.reserve(self.size() + o.size());
        out.starts.clear();
        for k in 0..self.starts.len() - 1 {
            out.starts.push(out.ranges.len() as u32);
            let (a, b) = (self.protocol(k), o.protocol(k));
            if matches!(b, [(_, _, NONE)]) {
                out.ranges.extend_from_slice(a);
                continue;
            }
            let first = out.ranges.len();
            for (lo, hi, x, j) in pieces(a, b) {
                let v = (*x).min(b[j].2);
                let joins = out.ranges.len() > first;
                match out.ranges.last_mut() {
                    Some(last) if joins && last.2 == v => last.1 = hi,
                    _ => out.ranges.push((lo, hi, v)),
                }
            }
        }
        out.starts.push(out.ranges.len() as u32);
        out.other = self.other.min(o.other);
    }
}

/// What the cells are made of for one direction that depends on the tier rules alone (and the
/// protocols): the same for every endpoint the same tier policies select, whatever its
/// NetworkPolicy tier, so built once for them all (`CellsCache`). A tier's rules are grouped by
/// their peers (rules of many policies name the same namespace, hence the same identities):
/// each group is painted once, and an identity's verdicts are the first match over its groups.
pub struct CellsBase {
    protocols: Vec<u8>,
    /// The class of each identity a rule names (the index in `classes`), sorted by identity:
    /// the identities of one class are named by the same groups.
    named: Vec<(NumericIdentity, u32)>,
    /// Per class (0: named by no group), the first match of its groups, per tier: painted
    /// once for every identity of the class (a namespace's identities share theirs).
    classes: Vec<[GroupPaint; 2]>,
}

/// The `CellsBase` of one set of tier rules, per protocol list (almost always one): a cache the
/// shared tier rules of a direction hold (`tier_memo::SharedTiers`).
#[derive(Default)]
pub struct CellsCache(std::sync::Mutex<Vec<Arc<CellsBase>>>);

/// The protocol lists an endpoint's NetworkPolicy tier can add: a few.
const CELLS_CACHED: usize = 4;

impl std::fmt::Debug for CellsCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |v| v.len());
        write!(f, "CellsCache({n})")
    }
}

impl CellsCache {
    fn get(&self, tiers: &Tiers, protocols: Vec<u8>) -> Arc<CellsBase> {
        let lock = || self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = lock().iter().find(|b| b.protocols == protocols) {
            return b.clone();
        }
        // Built outside the lock: another endpoint may build the same meanwhile (one is kept).
        let base = Arc::new(CellsBase::new(tiers, protocols));
        let mut held = lock();
        if !held.iter().any(|b| b.protocols == base.protocols) {
            if held.len() >= CELLS_CACHED {
                held.remove(0);
            }
            held.push(base.clone());
        }
        base
    }
}

impl CellsBase {
    fn new(tiers: &Tiers, protocols: Vec<u8>) -> CellsBase {
        // Per identity, per tier: the groups naming it (few: kept inline, no allocation).
        let mut named: std::collections::BTreeMap<NumericIdentity, [GroupList; 2]> =
            Default::default();
        // Per tier (Admin, Baseline): the groups' paintings; group 0 holds the rules with
        // every peer (`IDENTITY_ANY`).
        let mut groups: [Vec<GroupPaint>; 2] = [Vec::new(), Vec::new()];
        for (t, rules) in [&tiers.admin, &tiers.baseline].into_iter().enumerate() {
            // Group 0: every peer; then one group per distinct peer list, in first appearance.
            let mut members: Vec<Vec<usize>> = vec![Vec::new()];
            let mut heads: Vec<&[NumericIdentity]> = vec![&[]];
            let mut by_shape: FxHashMap<(usize, u32, u32), Vec<usize>> = Default::default();
            for (i, r) in rules.iter().enumerate() {
                if r.peers.first() == Some(&IDENTITY_ANY) {
                    members[0].push(i);
                    continue;
                }
                let shape = (
                    r.peers.len(),
                    r.peers.first().copied().unwrap_or(0),
                    r.peers.last().copied().unwrap_or(0),
                );
                let same = by_shape.entry(shape).or_default();
                match same.iter().find(|&&g| same_list(heads[g], &r.peers)) {
                    Some(&g) => members[g].push(i),
                    None => {
                        same.push(heads.len());
                        heads.push(&r.peers);
                        members.push(vec![i]);
                    }
                }
            }
            for (g, peers) in heads.iter().enumerate().skip(1) {
                for &id in peers.iter() {
                    named.entry(id).or_default()[t].push(g as u32);
                }
            }
            groups[t] = members
                .iter()
                .map(|m| GroupPaint::new(rules, m, &protocols))
                .collect();
        }
        // Classes: identities named by the same groups share their first matches.
        // Hashed once per named identity: Fx, not SipHash.
        let mut class_of: FxHashMap<[GroupList; 2], u32> = Default::default();
        let mut classes = vec![[groups[0][0].clone(), groups[1][0].clone()]];
        class_of.insert(Default::default(), 0);
        let named = named
            .into_iter()
            .map(|(id, own)| {
                let next = classes.len() as u32;
                let class = *class_of.entry(own).or_insert_with_key(|own| {
                    classes.push([0, 1].map(|t| first_match(&groups[t], &own[t])));
                    next
                });
                (id, class)
            })
            .collect();
        CellsBase {
            protocols,
            named,
            classes,
        }
    }
}

/// What the cells are made of for one direction of one endpoint: the tier rules' (`base`) and
/// the identities its NetworkPolicy tier names besides (of class 0 unless a rule names them).
struct Cells {
    base: Arc<CellsBase>,
    /// Every identity a rule or an entry of the NetworkPolicy tier names, with its class,
    /// sorted by identity.
    named: Vec<(NumericIdentity, u32)>,
    /// An identity no rule or entry names (a stand-in for all of them).
    other: NumericIdentity,
}

impl Cells {
    fn new(
        tiers: &Tiers,
        cache: Option<&CellsCache>,
        np: &MapState,
        direction: Direction,
    ) -> Cells {
        let mut protocols: BTreeSet<u8> = COMMON_PROTOCOLS.into_iter().collect();
        for r in tiers.admin.iter().chain(&tiers.baseline) {
            protocols.extend(r.ports.iter().flatten().map(|&(p, _, _)| p));
        }
        let slots: Vec<_> = np.slots_of(direction).collect();
        for (_, s) in &slots {
            protocols.extend(s.iter().map(|&(p, _, _)| p).filter(|&p| p != 0));
        }
        let protocols: Vec<u8> = protocols.into_iter().collect();
        let base = match cache {
            Some(c) => c.get(tiers, protocols),
            None => Arc::new(CellsBase::new(tiers, protocols)),
        };
        let by_rules = |id: &NumericIdentity| base.named.binary_search_by_key(id, |x| x.0).is_ok();
        let mut np_only: Vec<(NumericIdentity, u32)> = slots
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| *id != IDENTITY_ANY && !by_rules(id))
            .map(|id| (id, 0))
            .collect();
        let named = if np_only.is_empty() {
            base.named.clone()
        } else {
            np_only.sort_unstable();
            np_only.dedup();
            let mut all = Vec::with_capacity(base.named.len() + np_only.len());
            let (mut a, mut b) = (base.named.iter().peekable(), np_only.iter().peekable());
            while let (Some(x), Some(y)) = (a.peek(), b.peek()) {
                if x.0 < y.0 {
                    all.push(*a.next().expect("peeked"));
                } else {
                    all.push(*b.next().expect("peeked"));
                }
            }
            all.extend(a);
            all.extend(b);
            all
        };
        let other = (1..)
            .map(|i| u32::MAX - i)
            .find(|i| named.binary_search_by_key(i, |x| x.0).is_err())
            .unwrap_or(u32::MAX);
        Cells { base, named, other }
    }

    /// The first matching rule of tier `t` (0: Admin, 1: Baseline) for every cell of `id`.
    fn first_match(&self, id: NumericIdentity, t: usize) -> &GroupPaint {
        let class = match self.named.binary_search_by_key(&id, |x| x.0) {
            Ok(i) => self.named[i].1,
            Err(_) => 0,
        };
        &self.base.classes[class as usize][t]
    }
}

/// Two peer lists are the same: one shared list (a pointer), or equal identities.
fn same_list(a: &[NumericIdentity], b: &[NumericIdentity]) -> bool {
    std::ptr::eq(a, b) || a == b
}

/// The first match of a tier's group 0 and the groups `own` (indexes in `groups`).
fn first_match(groups: &[GroupPaint], own: &[u32]) -> GroupPaint {
    let mut order: SmallVec<[&GroupPaint; 8]> = own.iter().map(|&g| &groups[g as usize]).collect();
    order.push(&groups[0]);
    // The largest (often a namespace's rules) is copied; the rest, mostly a rule or two each,
    // lower its first matches where they match first (a merge of two paintings when one is
    // large as well: each of its ranges would cost a splice).
    order.sort_by_key(|g| g.size());
    let (largest, rest) = order.split_last().expect("group 0 at least");
    let mut out = (*largest).clone();
    let mut tmp = GroupPaint {
        ranges: Vec::new(),
        starts: SmallVec::new(),
        other: NONE,
    };
    for g in rest {
        if g.size() > LOWER_AT_MOST {
            out.merge_into(g, &mut tmp);
            std::mem::swap(&mut out, &mut tmp);
            continue;
        }
        for k in 0..g.starts.len() - 1 {
            for &(lo, hi, v) in g.protocol(k) {
                if v != NONE {
                    out.lower(k, lo, hi, v);
                }
            }
        }
        out.other = out.other.min(g.other);
    }
    out
}

/// The most ranges a painting lowers another's by (`GroupPaint::lower`) rather than merging.
const LOWER_AT_MOST: usize = 24;

/// Paints the tiers over every protocol and port of `id` (the evaluation of `evaluate`, by
/// ranges instead of by packet).
#[allow(clippy::too_many_arguments)]
fn paint_identity<'a>(
    tiers: &Tiers,
    np: &'a MapState,
    np_isolated: bool,
    direction: Direction,
    cells: &Cells,
    id: NumericIdentity,
) -> Painted<'a> {
    let state = |t: Tier, i: u32, from: State<'a>| {
        if i == NONE {
            return from;
        }
        let i = i as usize;
        let action = match t {
            Tier::Admin => tiers.admin[i].action,
            Tier::Baseline => tiers.baseline[i].action,
        };
        match action {
            Action::Allow => State::Done(Verdict {
                allow: true,
                by: By::Rule(t, i),
            }),
            Action::Deny => State::Done(Verdict {
                allow: false,
                by: By::Rule(t, i),
            }),
            // A Pass in the Admin tier hands over to the NetworkPolicy tier; in the Baseline
            // tier (ClusterNetworkPolicy) it ends the tiers: allowed.
            Action::Pass if t == Tier::Admin => State::Passed,
            Action::Pass => State::Done(Verdict {
                allow: true,
                by: By::Default,
            }),
        }
    };
    // The NetworkPolicy tier, over what the Admin tier left or passed on.
    let entries: SmallVec<[EntryRef<'a>; 16]> = np.entries_for(direction, id).collect();
    let np_state = |p: u8, port: u16| match decide(entries.iter().copied(), p, port) {
        MapVerdict::Denied(e) => State::Done(Verdict {
            allow: false,
            by: By::Np(e),
        }),
        MapVerdict::Allowed(e) => State::Done(Verdict {
            allow: true,
            by: By::Np(e),
        }),
        MapVerdict::NoMatch if np_isolated => State::Done(Verdict {
            allow: false,
            by: By::NpDefault,
        }),
        MapVerdict::NoMatch => State::ToBaseline,
    };
    let done = |st: State<'a>| match st {
        State::Done(v) => v,
        _ => Verdict {
            allow: true,
            by: By::Default,
        },
    };
    let (admin, baseline) = (cells.first_match(id, 0), cells.first_match(id, 1));
    let mut out = Painted {
        ranges: Vec::with_capacity(admin.size() + 2 * entries.len() + 4),
        starts: SmallVec::with_capacity(cells.base.protocols.len() + 1),
        other: done(State::Open),
    };
    // One pass per protocol: each range of the Admin tier's first matches, cut at the bounds of
    // the NetworkPolicy tier's entries where the Admin tier did not decide, and cut again at
    // the Baseline tier's ranges where the NetworkPolicy tier did not decide either.
    let mut cuts: SmallVec<[u32; 16]> = SmallVec::new();
    for (k, &p) in cells.base.protocols.iter().enumerate() {
        let first = out.ranges.len();
        out.starts.push(first as u32);
        let b = baseline.protocol(k);
        for &(a, z, i) in admin.protocol(k) {
            let st = state(Tier::Admin, i, State::Open);
            if !matches!(st, State::Open | State::Passed) {
                emit(&mut out.ranges, first, a, z, done(st));
                continue;
            }
            // Cut at the bounds of the entries of this protocol (or all protocols).
            cuts.clear();
            cuts.extend([a as u32, z as u32 + 1]);
            for &(q, lo, hi, _) in &entries {
                if q == p || q == 0 {
                    for c in [lo as u32, hi as u32 + 1] {
                        if c > a as u32 && c <= z as u32 {
                            cuts.push(c);
                        }
                    }
                }
            }
            cuts.sort_unstable();
            cuts.dedup();
            for w in cuts.windows(2) {
                let (lo, hi) = (w[0] as u16, (w[1] - 1) as u16);
                let st = np_state(p, lo);
                if st != State::ToBaseline {
                    emit(&mut out.ranges, first, lo, hi, done(st));
                    continue;
                }
                // The Baseline tier, over what nothing decided so far.
                let mut j = b.partition_point(|&(_, e, _)| e < lo);
                while j < b.len() && b[j].0 <= hi {
                    let v = done(state(Tier::Baseline, b[j].2, st));
                    emit(&mut out.ranges, first, b[j].0.max(lo), b[j].1.min(hi), v);
                    j += 1;
                }
            }
        }
    }
    out.starts.push(out.ranges.len() as u32);
    let mut other = state(Tier::Admin, admin.other, State::Open);
    if matches!(other, State::Open | State::Passed) {
        other = np_state(OTHER_PROTOCOL, 0);
    }
    if other == State::ToBaseline {
        other = state(Tier::Baseline, baseline.other, other);
    }
    out.other = done(other);
    out
}

/// The pieces two identities' ranges cut one protocol into: (first, last, theirs, others').
fn pieces<'b, X, O>(x: &'b [(u16, u16, X)], o: &'b [(u16, u16, O)]) -> Pieces<'b, X, O> {
    Pieces { x, o, i: 0, j: 0 }
}

/// The iterator of [`pieces`] (no allocation: it runs for every range of every identity).
struct Pieces<'b, X, O> {
    x: &'b [(u16, u16, X)],
    o: &'b [(u16, u16, O)],
    i: usize,
    j: usize,
}

impl<'b, X, O> Iterator for Pieces<'b, X, O> {
    type Item = (u16, u16, &'b X, usize);

    fn next(&mut self) -> Option<Self::Item> {
        let (x, o) = (self.x.get(self.i)?, self.o.get(self.j)?);
        let lo = x.0.max(o.0);
        let hi = x.1.min(o.1);
        let out = (lo, hi, &x.2, self.j);
        if x.1 == hi {
            self.i += 1;
        }
        if o.1 == hi {
            self.j += 1;
        }
        Some(out)
    }
}

/// Writes the entry of a verdict for `ports` of `group`'s identity, derived from its origins
/// (with their L7 rules). True: derived from a default's origin (`d`).
#[must_use]
fn put(
    group: &mut Group,
    ports: (u8, u16, u16),
    deny: bool,
    tiers: &Tiers,
    v: &Verdict<'_>,
    d: &Defaults,
) -> bool {
    debug_assert_eq!(deny, !v.allow);
    let mut one = |o: &Arc<RuleOrigin>| group.insert_l7(ports, deny, o, None);
    match v.by {
        By::Rule(Tier::Admin, i) => one(&tiers.admin[i].origin),
        By::Rule(Tier::Baseline, i) => one(&tiers.baseline[i].origin),
        // The NetworkPolicy tier's entry decided (its own deny flag): the same entry.
        By::Np(e) => group.insert_entry(ports, e),
        By::NpDefault => {
            one(&d.deny);
            return true;
        }
        By::Default => {
            one(&d.allow);
            return true;
        }
    }
    false
}

/// A rule (of a tier, or a NetworkPolicy-tier entry) decided it, not a default.
fn by_rule(v: &Verdict<'_>) -> bool {
    matches!(v.by, By::Rule(..) | By::Np(_))
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
    compile_cached(tiers, None, np, np_isolated, direction, fallback)
}

/// [`compile`], with what depends on the tier rules alone kept in `cache` (the tier rules'
/// own: `tier_memo::SharedTiers`) for the next endpoint they select.
pub fn compile_cached(
    tiers: &Tiers,
    cache: Option<&CellsCache>,
    np: &MapState,
    np_isolated: bool,
    direction: Direction,
    fallback: &Defaults,
) -> Compiled {
    let cells = Cells::new(tiers, cache, np, direction);
    let paint = |id| paint_identity(tiers, np, np_isolated, direction, &cells, id);
    let o = paint(cells.other);
    // An identity without entries of its own in the NetworkPolicy tier is painted as every
    // other of its class: once per class.
    let mut paintings: Vec<Painted<'_>> = Vec::new();
    let mut of_class: FxHashMap<u32, usize> = Default::default();
    let named: Vec<(NumericIdentity, usize)> = cells
        .named
        .iter()
        .map(|&(id, class)| {
            let shared = np.slots(direction, id).next().is_none();
            let at = match shared.then(|| of_class.get(&class)).flatten() {
                Some(&at) => at,
                None => {
                    paintings.push(paint(id));
                    if shared {
                        of_class.insert(class, paintings.len() - 1);
                    }
                    paintings.len() - 1
                }
            };
            (id, at)
        })
        .collect();
    let mut out = Compiled {
        isolated: paintings
            .iter()
            .chain([&o])
            .any(|p| !p.other.allow || p.ranges.iter().any(|c| !c.2.allow)),
        ..Default::default()
    };
    // Per protocol, the other identities' ranges some named identity is allowed in while they
    // are denied.
    let mut named_allowed: Vec<Vec<bool>> = (0..cells.base.protocols.len())
        .map(|k| vec![false; o.protocol(k).len()])
        .collect();
    let mut denied_all_else_allowed_some = false;
    // Each painting once (identities of one class without entries of their own share one).
    for x in &paintings {
        let mut any_allowed = false;
        for (k, allowed) in named_allowed.iter_mut().enumerate() {
            let os = o.protocol(k);
            for (_, _, c, j) in pieces(x.protocol(k), os) {
                if c.allow {
                    any_allowed = true;
                    if !os[j].2.allow {
                        allowed[j] = true;
                    }
                }
            }
        }
        denied_all_else_allowed_some |= !x.other.allow && any_allowed;
    }
    // The wildcard allow for every other protocol of every other identity, unless it would
    // need a deny it cannot have (module documentation).
    let mut wild = o.other.allow;
    if wild && (named_allowed.iter().flatten().any(|&b| b) || denied_all_else_allowed_some) {
        wild = false;
        out.notes.push(format!(
            "{}: protocols other than those the rules name (and TCP, UDP, SCTP, ICMP, ICMPv6) are denied for peers no rule names: the tiers' verdicts for them have no exact form in the policy map (fail closed)",
            direction.as_str()
        ));
    }
    let mut any = Group::new(IDENTITY_ANY);
    let mut any_defaulted = false;
    if wild {
        any_defaulted |= put(&mut any, (0, 0, 65535), false, tiers, &o.other, fallback);
    }
    for (k, &proto) in cells.base.protocols.iter().enumerate() {
        for (j, (lo, hi, c)) in o.protocol(k).iter().enumerate() {
            let ports = (proto, *lo, *hi);
            if c.allow {
                any_defaulted |= put(&mut any, ports, false, tiers, c, fallback);
            } else if wild || (by_rule(c) && !named_allowed[k][j]) {
                // Needed under the wildcard allow; otherwise it names the deciding rule (the
                // default would say only "isolated"), where no named identity is allowed.
                any_defaulted |= put(&mut any, ports, true, tiers, c, fallback);
            }
        }
    }
    if any_defaulted {
        out.defaulted.push(IDENTITY_ANY);
    }
    out.map.insert_group(direction, any);
    // Each painting's entries are written into one scratch group, then moved into a group of
    // their exact size (no regrowth while writing, no spare room kept in the map); the other
    // identities of that painting (of one class, without entries of their own) get a copy.
    let mut scratch = Group::new(IDENTITY_ANY);
    let mut written: Vec<Option<(Group, bool)>> = (0..paintings.len()).map(|_| None).collect();
    let mut users = vec![0u32; paintings.len()];
    for &(_, at) in &named {
        users[at] += 1;
    }
    for &(id, at) in &named {
        let (group, defaulted) = match &written[at] {
            Some((g, defaulted)) => (g.clone_for(id), *defaulted),
            None => {
                scratch.reset(id);
                let x = &paintings[at];
                let defaulted = write_named(
                    &mut scratch,
                    x,
                    &o,
                    wild,
                    &cells.base.protocols,
                    tiers,
                    fallback,
                );
                let g = scratch.take_exact();
                if users[at] > 1 {
                    written[at] = Some((g.clone_for(id), defaulted));
                }
                (g, defaulted)
            }
        };
        if defaulted {
            out.defaulted.push(id);
        }
        out.map.insert_group(direction, group);
    }
    out
}

/// The entries of a named identity painted `x`, where every other identity is painted `o`
/// and `wild` says whether the wildcard allow is in place (`compile`). True: some entry is
/// derived from a default's origin.
fn write_named(
    g: &mut Group,
    x: &Painted<'_>,
    o: &Painted<'_>,
    wild: bool,
    protocols: &[u8],
    tiers: &Tiers,
    fallback: &Defaults,
) -> bool {
    let mut defaulted = false;
    let own = &x.other;
    let mut own_wild = false;
    if own.allow && (!wild || own.by != o.other.by) {
        defaulted |= put(g, (0, 0, 65535), false, tiers, own, fallback);
        own_wild = true;
    } else if !own.allow && wild {
        // No concrete cell of `id` is allowed (or `wild` would be off).
        return put(g, (0, 0, 65535), true, tiers, own, fallback);
    }
    for (k, &proto) in protocols.iter().enumerate() {
        let os = o.protocol(k);
        for (lo, hi, c, j) in pieces(x.protocol(k), os) {
            let wider = &os[j].2;
            let covered = wider.allow || wild || own_wild;
            if c.allow {
                // The wider allow's own deciding rule covers it already, or the identity's
                // own allow of every protocol does (the same rule: no entry of a new kind,
                // which would cost every new connection of the endpoint one more probe).
                let own_covers = own_wild && own.by == c.by;
                let wider_covers = wider.allow && wider.by == c.by;
                if !(own_covers || wider_covers) {
                    defaulted |= put(g, (proto, lo, hi), false, tiers, c, fallback);
                }
            } else if covered || (by_rule(c) && wider.by != c.by) {
                defaulted |= put(g, (proto, lo, hi), true, tiers, c, fallback);
            }
        }
    }
    defaulted
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::policy::rule::{PolicyKey, PolicyKind, Section};
    use proptest::prelude::*;

    /// An ingress rule of CiliumNetworkPolicy `x/name` (tests of this module and `tier_memo`).
    pub(crate) fn origin(name: &str) -> Arc<RuleOrigin> {
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
        // `defaulted` lists exactly the identities with an entry derived from a default.
        let mut defaulted = c.defaulted.clone();
        let mut derived = c
            .map
            .identities_derived_from(Direction::Ingress, &[&fallback.allow, &fallback.deny]);
        defaulted.sort_unstable();
        derived.sort_unstable();
        assert_eq!(defaulted, derived, "map: {:?}", c.map.entries());
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
            peers: peers.into(),
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
        #![proptest_config(ProptestConfig::with_cases(1000))]
        /// A class's first matches, whether its groups lower the largest one range by range
        /// or are merged with it (groups of more than `LOWER_AT_MOST` ranges): every port of
        /// every protocol gets the first rule of all its groups (group 0 included) that
        /// matches it, and the ranges cover each protocol in order.
        #[test]
        fn a_first_match_is_the_first_rule_of_all_its_groups(
            ports in prop::collection::vec(arb_ports(), 1..60),
            groups in prop::collection::vec(prop::collection::vec(0usize..60, 0..30), 1..6),
        ) {
            let rules: Vec<TierRule> = ports
                .into_iter()
                .map(|p| rule("r", Action::Deny, vec![1], p))
                .collect();
            let protocols = [PROTO_ICMP, PROTO_TCP, PROTO_UDP, 99]; // sorted, as the cells'
            let members: Vec<Vec<usize>> = groups
                .iter()
                .map(|g| {
                    let set: BTreeSet<usize> = g.iter().map(|&i| i % rules.len()).collect();
                    set.into_iter().collect()
                })
                .collect();
            let paints: Vec<GroupPaint> = members
                .iter()
                .map(|m| GroupPaint::new(&rules, m, &protocols))
                .collect();
            let own: Vec<u32> = (1..paints.len() as u32).collect();
            let got = first_match(&paints, &own);
            let all = || members.iter().flatten().copied();
            for (k, &p) in protocols.iter().enumerate() {
                let r = got.protocol(k);
                prop_assert_eq!(r.first().map(|x| x.0), Some(0));
                prop_assert_eq!(r.last().map(|x| x.1), Some(65535));
                prop_assert!(r.windows(2).all(|w| w[0].1 as u32 + 1 == w[1].0 as u32));
                for port in (0u16..14).chain([65535]) {
                    let want = all()
                        .filter(|&i| rules[i].matches(1, p, port))
                        .min()
                        .map_or(NONE, |i| i as u32);
                    let at = r.iter().find(|x| x.0 <= port && port <= x.1).map(|x| x.2);
                    prop_assert_eq!(at, Some(want), "protocol {} port {}", p, port);
                }
            }
            let other = all().filter(|&i| rules[i].ports.is_none()).min();
            prop_assert_eq!(got.other, other.map_or(NONE, |i| i as u32));
        }
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

        /// Through the compile memo, endpoints of the same inputs with different defaults (the
        /// first compilation held for any defaults, the others' put in place of its, by
        /// pointer) each get exactly what compiling with their own defaults gives, and no other
        /// endpoint's default origin.
        #[test]
        fn the_memo_gives_each_endpoint_its_own_defaults(
            admin in prop::collection::vec(arb_rule(), 0..4),
            baseline in prop::collection::vec(arb_rule(), 0..3),
            np in arb_np(),
            np_isolated in any::<bool>(),
        ) {
            let tiers = Tiers { admin, baseline };
            let memo = crate::policy::tier_memo::CompileMemo::default();
            let shared = crate::policy::tier_memo::SharedTiers::new(tiers.clone());
            let defaults: Vec<Defaults> = (0..3)
                .map(|i| Defaults {
                    allow: origin(&format!("allowed{i}")),
                    deny: origin(&format!("isolated{}", i % 2)),
                })
                .collect();
            for d in defaults.iter().chain(&defaults[..1]) {
                let want = compile(&tiers, &np, np_isolated, Direction::Ingress, d);
                let got = memo.compile(&shared, &np, np_isolated, Direction::Ingress, d);
                prop_assert_eq!(&got.map, &want.map);
                prop_assert_eq!((got.isolated, &got.notes), (want.isolated, &want.notes));
                for (_, e) in got.map.entries() {
                    for o in &e.derived_from {
                        let a_default = ["allowed", "isolated"]
                            .iter()
                            .any(|p| o.policy.name.starts_with(p));
                        prop_assert!(
                            !a_default || Arc::ptr_eq(o, &d.allow) || Arc::ptr_eq(o, &d.deny),
                            "{:?} in the entries of {:?}",
                            o,
                            d.allow
                        );
                    }
                }
            }
        }

        /// The tier rules' part of the cells, built for one endpoint and kept (`CellsCache`),
        /// compiles every other endpoint's NetworkPolicy tier as a fresh build does.
        #[test]
        fn cells_kept_for_the_rules_compile_any_network_policy_tier_alike(
            admin in prop::collection::vec(arb_rule(), 0..4),
            baseline in prop::collection::vec(arb_rule(), 0..3),
            nps in prop::collection::vec((arb_np(), any::<bool>()), 1..4),
        ) {
            let tiers = Tiers { admin, baseline };
            let cache = CellsCache::default();
            let d = Defaults { allow: origin("allowed"), deny: origin("isolated") };
            for (np, iso) in &nps {
                let fresh = compile(&tiers, np, *iso, Direction::Ingress, &d);
                let kept = compile_cached(&tiers, Some(&cache), np, *iso, Direction::Ingress, &d);
                prop_assert_eq!(&kept.map, &fresh.map);
                prop_assert_eq!(kept.isolated, fresh.isolated);
                prop_assert_eq!(&kept.notes, &fresh.notes);
            }
        }
    }
}
