//! Compiled tiers shared between endpoints.
//!
//! `tiers::compile` is a pure function of its inputs: the tier rules with their resolved peers,
//! the NetworkPolicy tier's entries of the direction, whether that tier isolates, and the
//! defaults' origins. Endpoints selected by the same cluster policies and the same namespace
//! policies (the pods of one Deployment, or every pod under a cluster-wide guardrail with the
//! same namespace policy) compile the same inputs; a change of one ClusterNetworkPolicy that
//! selects them all compiled them once per endpoint.
//!
//! The memo keys each result by those inputs themselves, compared whole (rule origins by
//! pointer, everything else by value, the entries of each identity in order): a hit is the
//! result the compilation would give, whatever changed in the engine since, so nothing has to
//! invalidate it. It is bounded by the entries it holds ([`MAX_HELD`]) and the results
//! ([`MAX_RESULTS`]); the least recently used go first. A result too large to be worth holding
//! ([`MAX_ONE`]) is not kept.
//!
//! The defaults' origins name only the entries a default decides (allowed because no tier
//! decided, denied by the NetworkPolicy tier's isolation), and they differ between endpoints
//! that share everything else: each namespace's own default deny. So the first compilation of
//! some inputs is also held for any defaults, with the identities whose entries derive from its
//! defaults (`Compiled::defaulted`); other defaults then cost a copy of it with those entries'
//! origins replaced by pointer (or nothing, when no entry derives from a default), never a
//! compilation.
//!
//! [`PeerLists`] shares the tier rules' peer identities the same way: a rule naming a
//! namespace stands for every identity of it (thousands), in every endpoint the rule selects.
//! Endpoints take one shared list per distinct selection instead of a copy each, so the memo's
//! comparisons above find the same list (a pointer) instead of comparing the identities.

use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use rustc_hash::{FxHashMap, FxHasher};
use smallvec::SmallVec;

use super::identity::NumericIdentity;

use super::mapstate::MapState;
use super::rule::{Direction, RuleOrigin};
use super::tiers::{compile_cached, CellsCache, Compiled, Defaults, TierRule, Tiers};

/// Map entries held by the memo, inputs and results (about 100 bytes each).
pub const MAX_HELD: usize = 200_000;
/// Results held.
pub const MAX_RESULTS: usize = 512;
/// A result (with its inputs) above this many entries is not kept.
pub const MAX_ONE: usize = MAX_HELD / 4;

/// One direction's tier rules shared by the endpoints they select, with their fingerprint
/// (hashed once, not per endpoint). Derefs to the rules.
#[derive(Debug)]
pub struct SharedTiers {
    tiers: Tiers,
    fingerprint: u64,
    /// What their compilation for any endpoint starts from (`tiers::CellsBase`).
    cells: CellsCache,
}

impl SharedTiers {
    pub fn new(tiers: Tiers) -> Arc<SharedTiers> {
        let mut h = FxHasher::default();
        hash_rules(&mut h, &tiers.admin);
        hash_rules(&mut h, &tiers.baseline);
        Arc::new(SharedTiers {
            tiers,
            fingerprint: h.finish(),
            cells: CellsCache::default(),
        })
    }
}

impl std::ops::Deref for SharedTiers {
    type Target = Tiers;
    fn deref(&self) -> &Tiers {
        &self.tiers
    }
}

/// Results shared between endpoints whose inputs compare equal (`K`'s `PartialEq`), the most
/// recently used kept, at most `MAX_SHARED` of them: the engine's resolved tier rules by the
/// tier policies that select an endpoint and the engine state they were resolved from.
pub struct SharedMemo<K, V> {
    inner: Mutex<Vec<(K, Arc<V>)>>,
}

/// Results a [`SharedMemo`] keeps.
pub const MAX_SHARED: usize = 16;

impl<K, V> Default for SharedMemo<K, V> {
    fn default() -> Self {
        SharedMemo {
            inner: Mutex::new(Vec::new()),
        }
    }
}

/// A copy starts empty (a cache, never state).
impl<K, V> Clone for SharedMemo<K, V> {
    fn clone(&self) -> Self {
        SharedMemo::default()
    }
}

impl<K, V> std::fmt::Debug for SharedMemo<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.inner.lock().unwrap_or_else(|p| p.into_inner()).len();
        write!(f, "SharedMemo {{ held: {held} }}")
    }
}

impl<K: PartialEq + Clone, V> SharedMemo<K, V> {
    /// The result for `key`, built by `build` (outside the lock) when no equal key is held
    /// (then a copy of the key is kept: a hit copies nothing).
    pub fn get(&self, key: &K, build: impl FnOnce() -> V) -> Arc<V> {
        let lock = || self.inner.lock().unwrap_or_else(|p| p.into_inner());
        {
            let mut held = lock();
            if let Some(i) = held.iter().position(|(k, _)| k == key) {
                // Most recently used last.
                let hit = held.remove(i);
                let out = hit.1.clone();
                held.push(hit);
                return out;
            }
        }
        let out = Arc::new(build());
        let mut held = lock();
        // Another endpoint built the same meanwhile: one copy.
        if let Some((_, first)) = held.iter().find(|(k, _)| k == key) {
            return first.clone();
        }
        if held.len() >= MAX_SHARED {
            held.remove(0);
        }
        held.push((key.clone(), out.clone()));
        out
    }

    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&self) {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// Identities held by [`PeerLists`] (4 bytes each), stale lists included; past it, all go.
pub const MAX_PEER_IDS: usize = 1 << 20;

/// Selection stamps -> the identities they select; with the identities held.
type PeerListMap = FxHashMap<SmallVec<[u64; 2]>, Arc<[NumericIdentity]>>;

/// The peer identities of tier rules, shared between endpoints, by the selection stamps of
/// the rules' selectors (`SelectorCache::selection_stamp`): a stamp changes with the
/// selections, so a list found is the list a resolution would compute now.
#[derive(Default)]
pub struct PeerLists {
    inner: Mutex<(PeerListMap, usize)>,
}

impl std::fmt::Debug for PeerLists {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        write!(
            f,
            "PeerLists {{ lists: {}, ids: {} }}",
            inner.0.len(),
            inner.1
        )
    }
}

/// A copy starts empty (a cache, never state).
impl Clone for PeerLists {
    fn clone(&self) -> Self {
        PeerLists::default()
    }
}

impl PeerLists {
    /// The list stamped `stamps`, computed by `compute` (outside the lock) when not held.
    pub fn get(
        &self,
        stamps: SmallVec<[u64; 2]>,
        compute: impl FnOnce() -> Vec<NumericIdentity>,
    ) -> Arc<[NumericIdentity]> {
        let lock = || self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(found) = lock().0.get(&stamps) {
            return found.clone();
        }
        let list: Arc<[NumericIdentity]> = compute().into();
        let mut inner = lock();
        if inner.1 + list.len() > MAX_PEER_IDS {
            inner.0.clear();
            inner.1 = 0;
        }
        inner.1 += list.len();
        inner.0.entry(stamps).or_insert(list).clone()
    }

    /// Lists held.
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every list.
    pub fn clear(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.0.clear();
        inner.1 = 0;
    }
}

/// The inputs of one compilation.
struct Key {
    tiers: Arc<SharedTiers>,
    /// The NetworkPolicy tier's entries of `direction` only.
    np: MapState,
    np_isolated: bool,
    direction: Direction,
    /// The defaults' origins (allow, deny); `None`: a result for any defaults.
    defaults: Option<(RuleOrigin, RuleOrigin)>,
}

struct Held {
    key: Key,
    out: Arc<Compiled>,
    /// A result for any defaults: the defaults it was compiled with (their origins, by
    /// pointer, are in the entries of `out.defaulted`).
    made_with: Option<Defaults>,
    /// Entries held (inputs and result).
    size: usize,
    /// When it was last used (the memo's clock).
    used: u64,
}

#[derive(Default)]
struct Inner {
    by_hash: FxHashMap<u64, Vec<Held>>,
    held: usize,
    results: usize,
    clock: u64,
    hits: u64,
    misses: u64,
}

/// See the module documentation.
#[derive(Default)]
pub struct CompileMemo {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for CompileMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (hits, misses, results) = self.stats();
        write!(
            f,
            "CompileMemo {{ results: {results}, hits: {hits}, misses: {misses} }}"
        )
    }
}

/// A copy of an engine starts with an empty memo (a memo is a cache, never state).
impl Clone for CompileMemo {
    fn clone(&self) -> Self {
        CompileMemo::default()
    }
}

fn same_rules(a: &[TierRule], b: &[TierRule]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            Arc::ptr_eq(&x.origin, &y.origin)
                && x.action == y.action
                && (Arc::ptr_eq(&x.peers, &y.peers) || x.peers == y.peers)
                && x.ports == y.ports
        })
}

fn hash_rules(h: &mut FxHasher, rules: &[TierRule]) {
    rules.len().hash(h);
    for r in rules {
        (Arc::as_ptr(&r.origin) as usize).hash(h);
        r.action.hash(h);
        // The length and the ends: hashing thousands of identities per rule cost more than the
        // compilation the memo saves; equality compares them (a pointer, mostly: `PeerLists`).
        (r.peers.len(), r.peers.first(), r.peers.last()).hash(h);
        r.ports.hash(h);
    }
}

impl Key {
    fn matches(
        &self,
        tiers: &Arc<SharedTiers>,
        np: &MapState,
        np_isolated: bool,
        direction: Direction,
        defaults: Option<(&RuleOrigin, &RuleOrigin)>,
    ) -> bool {
        self.direction == direction
            && self.np_isolated == np_isolated
            && (Arc::ptr_eq(&self.tiers, tiers)
                || (self.tiers.fingerprint == tiers.fingerprint
                    && same_rules(&self.tiers.admin, &tiers.admin)
                    && same_rules(&self.tiers.baseline, &tiers.baseline)))
            && self.defaults.as_ref().map(|(a, d)| (a, d)) == defaults
            && np.same_direction(&self.np, direction)
    }
}

/// The inputs of one compilation, borrowed.
struct Input<'a> {
    tiers: &'a Arc<SharedTiers>,
    np: &'a MapState,
    np_isolated: bool,
    direction: Direction,
    /// `np.direction_fingerprint(direction)`: hashed once (it reads every entry).
    np_fingerprint: u64,
}

impl Input<'_> {
    /// The hash of the inputs and `defaults` (`None`: for any defaults).
    fn hash(&self, defaults: Option<&Defaults>) -> u64 {
        let mut h = FxHasher::default();
        (
            self.direction as u8,
            self.np_isolated,
            self.tiers.fingerprint,
        )
            .hash(&mut h);
        self.np_fingerprint.hash(&mut h);
        // The defaults name the policies isolating the endpoint: endpoints of one tier
        // differ by them more often than by anything else.
        match defaults {
            Some(d) => (1u8, &d.allow, &d.deny).hash(&mut h),
            None => 0u8.hash(&mut h),
        }
        h.finish()
    }

    fn key(&self, defaults: Option<(&RuleOrigin, &RuleOrigin)>) -> Key {
        Key {
            tiers: self.tiers.clone(),
            np: self.np.direction_part(self.direction),
            np_isolated: self.np_isolated,
            direction: self.direction,
            defaults: defaults.map(|(a, d)| (a.clone(), d.clone())),
        }
    }
}

fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `general` (compiled with the defaults `made_with`) as compiling with `fallback` gives it:
/// the origins of `made_with` replaced by `fallback`'s, by pointer, in the entries derived from
/// them (`Compiled::defaulted`). Shared as it is when there are none.
fn with_defaults(
    general: &Arc<Compiled>,
    direction: Direction,
    made_with: &Defaults,
    fallback: &Defaults,
) -> Arc<Compiled> {
    if general.defaulted.is_empty() {
        return general.clone();
    }
    let mut out = (**general).clone();
    out.map.replace_origins(
        direction,
        &general.defaulted,
        &[
            (&made_with.allow, &fallback.allow),
            (&made_with.deny, &fallback.deny),
        ],
    );
    Arc::new(out)
}

impl CompileMemo {
    /// `tiers::compile(tiers, np, np_isolated, direction, fallback)`, from the memo when the
    /// same inputs were compiled before (shared: the caller copies what it keeps), or when
    /// they were compiled with other defaults (see the module documentation).
    pub fn compile(
        &self,
        tiers: &Arc<SharedTiers>,
        np: &MapState,
        np_isolated: bool,
        direction: Direction,
        fallback: &Defaults,
    ) -> Arc<Compiled> {
        let defaults = (&*fallback.allow, &*fallback.deny);
        let input = Input {
            tiers,
            np,
            np_isolated,
            direction,
            np_fingerprint: np.direction_fingerprint(direction),
        };
        let hash = input.hash(Some(fallback));
        if let Some((out, _)) = self.find(hash, &input, Some(defaults), true) {
            return out;
        }
        let any = input.hash(None);
        let out = match self.find(any, &input, None, false) {
            Some((general, Some(made_with))) => {
                with_defaults(&general, direction, &made_with, fallback)
            }
            _ => self.compile_first(&input, any, fallback),
        };
        self.keep(hash, input.key(Some(defaults)), &out, None);
        out
    }

    /// Compiles `input` with `fallback`, and holds the result for any defaults too (`any`:
    /// the inputs' hash for any defaults).
    fn compile_first(&self, input: &Input<'_>, any: u64, fallback: &Defaults) -> Arc<Compiled> {
        // Compiled outside the lock: other endpoints look up meanwhile.
        let out = Arc::new(compile_cached(
            input.tiers,
            Some(&input.tiers.cells),
            input.np,
            input.np_isolated,
            input.direction,
            fallback,
        ));
        // Told apart by pointer: two defaults of one pointer could not be.
        if !Arc::ptr_eq(&fallback.allow, &fallback.deny) {
            let key = input.key(None);
            self.keep(any, key, &out, Some(fallback.clone()));
        }
        out
    }

    /// The result held for `input` with `defaults` (counted as a hit or a miss if `count`),
    /// with the defaults it was made with when it is for any.
    fn find(
        &self,
        hash: u64,
        input: &Input<'_>,
        defaults: Option<(&RuleOrigin, &RuleOrigin)>,
        count: bool,
    ) -> Option<(Arc<Compiled>, Option<Defaults>)> {
        let mut inner = lock(&self.inner);
        inner.clock += 1;
        let now = inner.clock;
        let found = inner.by_hash.get_mut(&hash).and_then(|list| {
            list.iter_mut().find(|x| {
                x.key.matches(
                    input.tiers,
                    input.np,
                    input.np_isolated,
                    input.direction,
                    defaults,
                )
            })
        });
        let found = found.map(|x| {
            x.used = now;
            (x.out.clone(), x.made_with.clone())
        });
        if count {
            match found {
                Some(_) => inner.hits += 1,
                None => inner.misses += 1,
            }
        }
        found
    }

    /// Holds `out` for `key`, unless it is too large to be worth it.
    fn keep(&self, hash: u64, key: Key, out: &Arc<Compiled>, made_with: Option<Defaults>) {
        let size = out.map.len() + key.np.len() + 1;
        if size <= MAX_ONE {
            let held = Held {
                key,
                out: out.clone(),
                made_with,
                size,
                used: 0,
            };
            lock(&self.inner).keep(hash, held);
        }
    }

    /// (hits, misses, results held).
    pub fn stats(&self) -> (u64, u64, usize) {
        let inner = lock(&self.inner);
        (inner.hits, inner.misses, inner.results)
    }

    /// Forgets every result.
    pub fn clear(&self) {
        let mut inner = lock(&self.inner);
        inner.by_hash.clear();
        inner.held = 0;
        inner.results = 0;
    }
}

impl Inner {
    fn keep(&mut self, hash: u64, mut held: Held) {
        self.clock += 1;
        held.used = self.clock;
        let list = self.by_hash.entry(hash).or_default();
        // Two endpoints compiled the same inputs at once: one copy.
        let k = &held.key;
        if list.iter().any(|x| {
            x.key.matches(
                &k.tiers,
                &k.np,
                k.np_isolated,
                k.direction,
                k.defaults.as_ref().map(|(a, d)| (a, d)),
            )
        }) {
            return;
        }
        self.held += held.size;
        self.results += 1;
        list.push(held);
        while self.held > MAX_HELD || self.results > MAX_RESULTS {
            self.evict_oldest();
        }
    }

    /// Drops the least recently used result.
    fn evict_oldest(&mut self) {
        let Some((&hash, i)) = self
            .by_hash
            .iter()
            .flat_map(|(h, list)| list.iter().enumerate().map(move |(i, x)| (h, i, x.used)))
            .min_by_key(|&(_, _, used)| used)
            .map(|(h, i, _)| (h, i))
        else {
            return;
        };
        let list = self.by_hash.get_mut(&hash).expect("just found");
        let gone = list.swap_remove(i);
        if list.is_empty() {
            self.by_hash.remove(&hash);
        }
        self.held -= gone.size;
        self.results -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::identity::IDENTITY_ANY;
    use crate::policy::mapstate::MapKey;
    use crate::policy::rule::Action;
    use crate::policy::tiers::compile;
    use crate::policy::tiers::tests::origin;
    use crate::policy::tiers::TierRule;

    fn rule(o: &Arc<RuleOrigin>, action: Action, peer: u32, port: u16) -> TierRule {
        TierRule {
            origin: o.clone(),
            action,
            peers: vec![peer].into(),
            ports: Some(vec![(6, port, port)]),
        }
    }

    fn np(peer: u32, port: u16, o: &Arc<RuleOrigin>) -> MapState {
        let mut m = MapState::new();
        m.insert(
            MapKey {
                direction: Direction::Ingress,
                identity: peer,
                protocol: 6,
                port_lo: port,
                port_hi: port,
            },
            false,
            o,
        );
        m
    }

    /// New shared rules (another endpoint's copy: equal, not the same pointer).
    fn shared(t: &Tiers) -> Arc<SharedTiers> {
        SharedTiers::new(t.clone())
    }

    fn same(a: &Compiled, b: &Compiled) -> bool {
        a.map == b.map && a.isolated == b.isolated && a.notes == b.notes
    }

    #[test]
    fn a_hit_is_what_compiling_gives_and_any_difference_misses() {
        let memo = CompileMemo::default();
        let (r1, r2, n1) = (origin("r1"), origin("r2"), origin("n1"));
        let d = Defaults {
            allow: origin("allow"),
            deny: origin("deny"),
        };
        let tiers = Tiers {
            admin: vec![
                rule(&r1, Action::Deny, 300, 80),
                rule(&r2, Action::Pass, 301, 81),
            ],
            baseline: vec![],
        };
        let base = np(301, 81, &n1);
        let direct = compile(&tiers, &base, true, Direction::Ingress, &d);
        let first = memo.compile(&shared(&tiers), &base, true, Direction::Ingress, &d);
        assert!(same(&first, &direct));
        // The same inputs in other values (another endpoint's): a hit, the same result.
        let again = memo.compile(
            &shared(&tiers),
            &np(301, 81, &n1),
            true,
            Direction::Ingress,
            &d,
        );
        assert!(same(&again, &direct));
        // One result for any defaults, one for these.
        assert_eq!(memo.stats(), (1, 1, 2));
        // Each input differing misses, and gives what compiling gives.
        let other_tiers = Tiers {
            admin: vec![
                rule(&r1, Action::Allow, 300, 80),
                rule(&r2, Action::Pass, 301, 81),
            ],
            baseline: vec![],
        };
        let same_text_other_rule = Tiers {
            admin: vec![
                rule(&origin("r1"), Action::Deny, 300, 80),
                rule(&r2, Action::Pass, 301, 81),
            ],
            baseline: vec![],
        };
        let cases: Vec<(Tiers, MapState, bool, Direction)> = vec![
            (other_tiers, base.clone(), true, Direction::Ingress),
            (same_text_other_rule, base.clone(), true, Direction::Ingress),
            (tiers.clone(), np(301, 82, &n1), true, Direction::Ingress),
            (
                tiers.clone(),
                np(301, 81, &origin("n2")),
                true,
                Direction::Ingress,
            ),
            (tiers.clone(), base.clone(), false, Direction::Ingress),
            (tiers.clone(), base.clone(), true, Direction::Egress),
        ];
        for (i, (t, m, iso, dir)) in cases.iter().enumerate() {
            let want = compile(t, m, *iso, *dir, &d);
            let got = memo.compile(&shared(t), m, *iso, *dir, &d);
            assert!(same(&got, &want), "case {i}");
            assert_eq!(memo.stats().0, 1, "case {i} missed");
        }
        // Other defaults: a miss too.
        let d2 = Defaults {
            allow: origin("allow2"),
            deny: origin("deny"),
        };
        let got = memo.compile(&shared(&tiers), &base, true, Direction::Ingress, &d2);
        assert!(same(
            &got,
            &compile(&tiers, &base, true, Direction::Ingress, &d2)
        ));
        assert_eq!(memo.stats().0, 1);
        // The egress entries of the NetworkPolicy tier do not matter to the ingress result.
        let mut with_egress = base.clone();
        with_egress.insert(
            MapKey {
                direction: Direction::Egress,
                identity: IDENTITY_ANY,
                protocol: 0,
                port_lo: 0,
                port_hi: 65535,
            },
            false,
            &n1,
        );
        let got = memo.compile(&shared(&tiers), &with_egress, true, Direction::Ingress, &d);
        assert!(same(&got, &direct));
        assert_eq!(memo.stats().0, 2);
    }

    #[test]
    fn other_defaults_on_the_same_inputs_take_the_place_of_the_first_ones() {
        let memo = CompileMemo::default();
        let (r1, r2, b1, n1) = (origin("r1"), origin("r2"), origin("b1"), origin("n1"));
        let tiers = Tiers {
            admin: vec![
                rule(&r1, Action::Deny, 300, 80),
                rule(&r2, Action::Pass, 301, 81),
            ],
            baseline: vec![rule(&b1, Action::Deny, 302, 82)],
        };
        let defaults: Vec<Defaults> = (0..3)
            .map(|i| Defaults {
                allow: origin(&format!("allow{i}")),
                deny: origin(&format!("deny{}", i % 2)),
            })
            .collect();
        // Every result's defaults are its own: none of another endpoint's is left.
        let foreign = |c: &Compiled, d: &Defaults| {
            let mine = |o: &Arc<RuleOrigin>| Arc::ptr_eq(o, &d.allow) || Arc::ptr_eq(o, &d.deny);
            c.map.entries().iter().any(|(_, e)| {
                e.derived_from.iter().any(|o| {
                    let a_default = ["allow", "deny"]
                        .iter()
                        .any(|p| o.policy.name.starts_with(p));
                    a_default && !mine(o)
                })
            })
        };
        let mut by_default = 0;
        for isolated in [false, true] {
            let base = np(301, 81, &n1);
            for d in defaults.iter().chain(&defaults[..1]) {
                let want = compile(&tiers, &base, isolated, Direction::Ingress, d);
                let got = memo.compile(&shared(&tiers), &base, isolated, Direction::Ingress, d);
                assert!(same(&got, &want), "isolated {isolated}, {:?}", d.allow);
                assert!(!foreign(&got, d), "only its own defaults");
                let named = |o: &Arc<RuleOrigin>| {
                    got.map
                        .entries()
                        .iter()
                        .any(|(_, e)| e.derived_from.iter().any(|x| Arc::ptr_eq(x, o)))
                };
                by_default += named(&d.allow) as usize + named(&d.deny) as usize;
            }
        }
        assert!(by_default >= 4, "the defaults decide entries: {by_default}");
        // Per isolation: compiled once (held for these defaults and for any), two other
        // defaults given; the first again a hit.
        assert_eq!(memo.stats(), (2, 6, 8));
    }

    #[test]
    fn bounded_least_recently_used_first() {
        let memo = CompileMemo::default();
        let d = Defaults {
            allow: origin("allow"),
            deny: origin("deny"),
        };
        let r = origin("r");
        let tiers = |peer: u32| Tiers {
            admin: vec![rule(&r, Action::Deny, peer, 80)],
            baseline: vec![],
        };
        let empty = MapState::new();
        for peer in 0..(MAX_RESULTS as u32 + 10) {
            memo.compile(
                &shared(&tiers(1000 + peer)),
                &empty,
                false,
                Direction::Ingress,
                &d,
            );
            // The first stays in use: never the oldest.
            memo.compile(&shared(&tiers(1000)), &empty, false, Direction::Ingress, &d);
        }
        let (_, _, results) = memo.stats();
        assert_eq!(results, MAX_RESULTS);
        let (hits, _, _) = memo.stats();
        memo.compile(&shared(&tiers(1000)), &empty, false, Direction::Ingress, &d);
        assert_eq!(memo.stats().0, hits + 1, "the one in use was kept");
        memo.compile(&shared(&tiers(1001)), &empty, false, Direction::Ingress, &d);
        assert_eq!(memo.stats().0, hits + 1, "the oldest went");
        memo.clear();
        assert_eq!(memo.stats().2, 0);
    }

    #[test]
    fn a_shared_memo_builds_once_per_key_and_keeps_the_most_recently_used() {
        let memo: SharedMemo<u32, String> = SharedMemo::default();
        let builds = std::cell::Cell::new(0);
        let get = |k: u32| {
            memo.get(&k, || {
                builds.set(builds.get() + 1);
                format!("v{k}")
            })
        };
        let first = get(1);
        assert!(Arc::ptr_eq(&first, &get(1)), "a hit is the same result");
        assert_eq!((builds.get(), first.as_str()), (1, "v1"));
        // More keys than it keeps, key 1 used all along: 1 stays, 2 (the oldest) goes.
        for k in 2..(MAX_SHARED as u32 + 2) {
            get(k);
            get(1);
        }
        assert_eq!(memo.len(), MAX_SHARED);
        let before = builds.get();
        get(1);
        assert_eq!(builds.get(), before, "the one in use was kept");
        get(2);
        assert_eq!(builds.get(), before + 1, "the least recently used went");
        memo.clear();
        assert!(memo.is_empty());
    }
}
