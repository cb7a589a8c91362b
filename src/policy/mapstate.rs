//! The policy map state of one endpoint: what the datapath's per-endpoint policy map must hold.
//!
//! Keys are {peer identity (0 = any), direction, protocol (0 = any), port range}. This is the
//! engine's own key type (as Cilium's `policy.Key`); the datapath layer turns it into BPF bytes.
//! Port ranges stay ranges here; the BPF layer splits them into prefix-masked entries.
//!
//! Lookup semantics (the contract the BPF program implements too): among the entries matching
//! {identity or 0, protocol or 0, port in range}, any deny wins; otherwise any allow allows;
//! otherwise the direction's default applies (deny when isolated, allow when not).

use rustc_hash::FxHashMap as HashMap;
use smallvec::SmallVec;
use std::sync::Arc;

use super::attribution::{entry_cookie, Cookie, MatchKind, PolicyRef};
use super::identity::{NumericIdentity, IDENTITY_ANY};
use super::l7::http::L7PortRules;
use super::rule::{Direction, RuleOrigin};

/// Key of one policy map entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MapKey {
    pub direction: Direction,
    pub identity: NumericIdentity,
    /// IP protocol number; 0 matches every protocol.
    pub protocol: u8,
    /// Inclusive destination port range (ICMP: the type). `0..=65535` is every port.
    pub port_lo: u16,
    pub port_hi: u16,
}

/// Value of one policy map entry, with the rules it was derived from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapEntry {
    pub deny: bool,
    /// Nearly always one or two rules: kept inline.
    pub derived_from: Origins,
    /// Allows only, once a contribution carries L7 rules: every contribution with its L7 part
    /// (`None`: an L3/L4 allow, every request). Absent: no contribution has L7 rules.
    pub l7: Option<Box<Vec<L7Grant>>>,
}

/// The rules an entry was derived from.
pub type Origins = SmallVec<[Arc<RuleOrigin>; 2]>;

/// The room an entry's origins get when they first leave their inline place: a port that many
/// rules allow to one peer gathers three to eight of them, in one allocation (growing by
/// doubling took two and a copy).
const ORIGINS_SPILLED: usize = 8;

/// Adds `origin` to `origins` (not there yet).
#[inline]
fn push_origin(origins: &mut Origins, origin: &Arc<RuleOrigin>) {
    if origins.len() == origins.inline_size() {
        origins.reserve_exact(ORIGINS_SPILLED - origins.len());
    }
    origins.push(origin.clone());
}

/// One allowing contribution to an entry and the L7 rules it comes with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct L7Grant {
    pub origin: Arc<RuleOrigin>,
    pub rules: Option<Arc<L7PortRules>>,
}

impl MapEntry {
    /// The datapath hands this entry's traffic to the HTTP proxy: an allow some contribution
    /// of which carries L7 rules.
    pub fn redirect(&self) -> bool {
        !self.deny
            && self
                .l7
                .as_ref()
                .is_some_and(|g| g.iter().any(|g| g.rules.is_some()))
    }

    /// Records one allowing contribution (deny entries keep none). Called before `origin` is
    /// added to `derived_from`, whose contributions so far were L3/L4 unless recorded here.
    /// Each contribution the entry was built from (its origin, with its L7 rules): inserted
    /// one by one, they build the entry again.
    fn contributions(&self, mut f: impl FnMut(&Arc<RuleOrigin>, Option<&Arc<L7PortRules>>)) {
        match &self.l7 {
            Some(grants) => grants.iter().for_each(|g| f(&g.origin, g.rules.as_ref())),
            None => self.derived_from.iter().for_each(|o| f(o, None)),
        }
    }

    /// The entry of one contribution (always inlined: built in place, not returned by copy,
    /// in the resolution's hottest loop).
    #[inline(always)]
    fn new(deny: bool, origin: &Arc<RuleOrigin>, rules: Option<&Arc<L7PortRules>>) -> MapEntry {
        let mut entry = MapEntry {
            deny,
            derived_from: Origins::new(),
            l7: None,
        };
        entry.grant(origin, rules);
        entry.derived_from.push(origin.clone());
        entry
    }

    /// Adds a contribution to the same key: deny replaces allow, and the entry remembers
    /// every rule of the winning kind.
    #[inline]
    fn merge(&mut self, deny: bool, origin: &Arc<RuleOrigin>, rules: Option<&Arc<L7PortRules>>) {
        match (self.deny, deny) {
            (false, true) => {
                self.deny = true;
                self.derived_from.clear();
                self.derived_from.push(origin.clone());
                self.l7 = None;
            }
            (true, false) => {}
            _ => {
                self.grant(origin, rules);
                if !self.derived_from.iter().any(|o| Arc::ptr_eq(o, origin)) {
                    push_origin(&mut self.derived_from, origin);
                }
            }
        }
    }

    /// Records an allowing contribution's L7 part, once the entry has one (inline: most
    /// entries have none, and the check is all they pay).
    #[inline]
    fn grant(&mut self, origin: &Arc<RuleOrigin>, rules: Option<&Arc<L7PortRules>>) {
        if self.deny || (self.l7.is_none() && rules.is_none()) {
            return;
        }
        self.grant_l7(origin, rules)
    }

    /// Derived from `origin` (that very rule: the same pointer).
    #[cfg(test)]
    fn derived_from_ptr(&self, origin: &Arc<RuleOrigin>) -> bool {
        self.derived_from.iter().any(|o| Arc::ptr_eq(o, origin))
            || self
                .l7
                .as_ref()
                .is_some_and(|g| g.iter().any(|g| Arc::ptr_eq(&g.origin, origin)))
    }

    /// Puts `to` wherever `from` (the same pointer) is among its origins, in its place.
    fn replace_origin(&mut self, from: &Arc<RuleOrigin>, to: &Arc<RuleOrigin>) {
        for o in self
            .derived_from
            .iter_mut()
            .filter(|o| Arc::ptr_eq(o, from))
        {
            *o = to.clone();
        }
        for g in self.l7.iter_mut().flat_map(|g| g.iter_mut()) {
            if Arc::ptr_eq(&g.origin, from) {
                g.origin = to.clone();
            }
        }
    }

    fn grant_l7(&mut self, origin: &Arc<RuleOrigin>, rules: Option<&Arc<L7PortRules>>) {
        let grants = self.l7.get_or_insert_with(|| {
            // The contributions before the first L7 one were all L3/L4.
            Box::new(
                self.derived_from
                    .iter()
                    .map(|o| L7Grant {
                        origin: o.clone(),
                        rules: None,
                    })
                    .collect(),
            )
        });
        let same = |g: &L7Grant| {
            Arc::ptr_eq(&g.origin, origin)
                && match (&g.rules, rules) {
                    (None, None) => true,
                    (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                    _ => false,
                }
        };
        if !grants.iter().any(same) {
            grants.push(L7Grant {
                origin: origin.clone(),
                rules: rules.cloned(),
            });
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Slot {
    protocol: u8,
    port_lo: u16,
    port_hi: u16,
    entry: MapEntry,
}

/// One entry as a lookup reads it: its key's protocol (0: any), first and last port, and the
/// entry.
pub type EntryRef<'a> = (u8, u16, u16, &'a MapEntry);

/// Decides a packet on `protocol`/`port` by `entries` (most specific identity first, as
/// `MapState::entries_for` gives them): any matching deny wins, else the first matching allow
/// (the most specific, for the explanation), else no match.
pub fn decide<'a>(
    entries: impl IntoIterator<Item = EntryRef<'a>>,
    protocol: u8,
    port: u16,
) -> MapVerdict<'a> {
    let mut allowed: Option<&MapEntry> = None;
    for (p, lo, hi, entry) in entries {
        if (p == 0 || p == protocol) && lo <= port && port <= hi {
            if entry.deny {
                return MapVerdict::Denied(entry);
            }
            if allowed.is_none() {
                allowed = Some(entry);
            }
        }
    }
    allowed
        .map(MapVerdict::Allowed)
        .unwrap_or(MapVerdict::NoMatch)
}

/// One entry's protocol, first and last port, and the L7 rules it allows (`insert_ports`).
pub type PortCell<'a> = (u8, u16, u16, Option<&'a Arc<L7PortRules>>);

/// The entries of one peer identity, written in a row and added to a map at once
/// (`MapState::insert_group`): no lookup of the identity's group per entry.
#[derive(Debug)]
pub struct Group {
    identity: NumericIdentity,
    slots: Slots,
}

impl Group {
    pub fn new(identity: NumericIdentity) -> Group {
        Group {
            identity,
            slots: Slots::new(),
        }
    }

    /// Empties it (keeping its room) for the entries of `identity`.
    pub fn reset(&mut self, identity: NumericIdentity) {
        self.identity = identity;
        self.slots.clear();
    }

    /// The same entries for another identity.
    pub fn clone_for(&self, identity: NumericIdentity) -> Group {
        Group {
            identity,
            slots: self.slots.clone(),
        }
    }

    /// Its entries, moved into a group of their exact size (this one keeps its room: a scratch
    /// group written again and again).
    pub fn take_exact(&mut self) -> Group {
        let mut slots = Slots::with_capacity(self.slots.len());
        slots.extend(self.slots.drain(..));
        Group {
            identity: self.identity,
            slots,
        }
    }

    /// `MapState::insert_l7` of (protocol, ports) for this identity. The key is new to the
    /// group, or the one written last (every contribution to one key in a row): earlier keys
    /// are not searched.
    pub fn insert_l7(
        &mut self,
        ports: (u8, u16, u16),
        deny: bool,
        origin: &Arc<RuleOrigin>,
        rules: Option<&Arc<L7PortRules>>,
    ) {
        match self.slots.last_mut() {
            Some(s) if s.at(ports) => s.entry.merge(deny, origin, rules),
            _ => {
                debug_assert!(
                    !self.slots.iter().any(|s| s.at(ports)),
                    "Group::insert_l7: an earlier key again"
                );
                self.slots
                    .push(Slot::new(ports, MapEntry::new(deny, origin, rules)));
            }
        }
    }

    /// `insert_l7` of every contribution of `entry` (an entry of another map, the same deny
    /// flag): a copy of it when the key is new to the group.
    pub fn insert_entry(&mut self, ports: (u8, u16, u16), entry: &MapEntry) {
        if self.slots.last().is_some_and(|s| s.at(ports)) {
            entry.contributions(|o, rules| self.insert_l7(ports, entry.deny, o, rules));
            return;
        }
        debug_assert!(
            !self.slots.iter().any(|s| s.at(ports)),
            "Group::insert_entry: an earlier key again"
        );
        self.slots.push(Slot::new(ports, entry.clone()));
    }
}

/// The entries of one (direction, identity): most peers have one or two (a port over TCP and UDP),
/// kept inline (a heap allocation per such peer was a third of a resolve's instructions).
type Slots = SmallVec<[Slot; 2]>;

/// One direction's entries, grouped by peer identity so a lookup probes two groups. Whether
/// any entry redirects to the HTTP proxy is found once per groups (a scan of every entry, asked
/// on every regeneration): any change through `DerefMut` forgets it.
#[derive(Debug, Clone, Default)]
struct Groups {
    by_identity: HashMap<NumericIdentity, Slots>,
    redirect: std::sync::OnceLock<bool>,
}

impl std::ops::Deref for Groups {
    type Target = HashMap<NumericIdentity, Slots>;
    fn deref(&self) -> &Self::Target {
        &self.by_identity
    }
}

impl std::ops::DerefMut for Groups {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.redirect = std::sync::OnceLock::new();
        &mut self.by_identity
    }
}

impl Groups {
    fn any_redirect(&self) -> bool {
        *self.redirect.get_or_init(|| {
            self.by_identity
                .values()
                .any(|slots| slots.iter().any(|s| s.entry.redirect()))
        })
    }
}

/// All entries of one endpoint: each direction's groups shared copy-on-write, so a direction
/// compiled once for many endpoints (cluster tiers, `replace_direction_from`) or a map kept as
/// realized is held, not copied, and two maps sharing a direction compare it at once.
#[derive(Debug, Clone, Default)]
pub struct MapState {
    /// Ingress, egress (`slot`); `None` until the first entry (an empty map allocates
    /// nothing: most resolves select no rule).
    dirs: [Option<Arc<Groups>>; 2],
    /// Entries per direction.
    lens: [usize; 2],
}

/// The index of direction `d` in `MapState::dirs`.
fn slot(d: Direction) -> usize {
    match d {
        Direction::Ingress => 0,
        Direction::Egress => 1,
    }
}

const DIRECTIONS: [Direction; 2] = [Direction::Ingress, Direction::Egress];

/// The groups of a direction without entries.
static EMPTY: Groups = Groups {
    by_identity: HashMap::with_hasher(rustc_hash::FxBuildHasher),
    redirect: std::sync::OnceLock::new(),
};

/// Both hold the same groups (or none).
fn shared(a: &Option<Arc<Groups>>, b: &Option<Arc<Groups>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    }
}

impl PartialEq for MapState {
    fn eq(&self, other: &MapState) -> bool {
        DIRECTIONS.iter().all(|d| self.same_direction(other, *d))
    }
}

impl Eq for MapState {}

/// The entries that decided a lookup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MapVerdict<'a> {
    Denied(&'a MapEntry),
    Allowed(&'a MapEntry),
    NoMatch,
}

/// What must change in the datapath to go from one map state to another.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapDelta {
    /// Entries to add or overwrite, with their deny flag.
    pub upserts: Vec<(MapKey, bool)>,
    pub deletes: Vec<MapKey>,
    /// The attribution cookie of upserted entries (absent: 0, not attributed).
    pub cookies: HashMap<MapKey, Cookie>,
    /// What each cookie of `cookies` stands for, once per cookie.
    /// Shared: a delta kept for the endpoints of one kind is copied once per endpoint.
    pub attributions: Vec<(Cookie, MatchKind, Arc<[PolicyRef]>)>,
    /// The upserted allows whose traffic goes to the HTTP proxy (`MapEntry::redirect`).
    pub redirects: rustc_hash::FxHashSet<MapKey>,
}

impl MapDelta {
    /// Appends the delta of a later direction (its keys sort after this one's).
    fn append(&mut self, mut part: MapDelta) {
        if self.is_empty() && self.attributions.is_empty() {
            *self = part;
            return;
        }
        self.upserts.append(&mut part.upserts);
        self.deletes.append(&mut part.deletes);
        self.cookies.extend(part.cookies);
        self.redirects.extend(part.redirects);
        let known: rustc_hash::FxHashSet<Cookie> = self.attributions.iter().map(|a| a.0).collect();
        self.attributions.extend(
            part.attributions
                .into_iter()
                .filter(|a| !known.contains(&a.0)),
        );
    }

    pub fn is_empty(&self) -> bool {
        self.upserts.is_empty() && self.deletes.is_empty()
    }
    pub fn len(&self) -> usize {
        self.upserts.len() + self.deletes.len()
    }
}

impl MapState {
    pub fn new() -> Self {
        Self::default()
    }

    fn dir(&self, d: Direction) -> &Groups {
        self.dirs[slot(d)].as_deref().unwrap_or(&EMPTY)
    }

    /// Direction `d`'s groups to change (copied first if another map shares them).
    fn dir_mut(&mut self, d: Direction) -> &mut Groups {
        Arc::make_mut(self.dirs[slot(d)].get_or_insert_with(Default::default))
    }

    /// Room for `n` more peer identities in direction `d`: a resolve that knows about how many
    /// it will add sizes the table once (growing it was an eighth of a large resolve).
    pub fn reserve(&mut self, d: Direction, n: usize) {
        if n > 0 {
            self.dir_mut(d).reserve(n);
        }
    }

    /// Gives back what a [`reserve`](Self::reserve) overestimated: a direction filled to less
    /// than a quarter of its table is shrunk, one left empty goes.
    pub fn shrink_sparse(&mut self) {
        for d in &mut self.dirs {
            let Some(g) = d else { continue };
            if g.is_empty() {
                *d = None;
            } else if g.len() * 4 < g.capacity() {
                Arc::make_mut(g).shrink_to_fit();
            }
        }
    }

    fn group(&self, d: Direction, identity: NumericIdentity) -> Option<&Slots> {
        self.dir(d).get(&identity)
    }

    /// Adds an entry. The same key from several rules merges: deny replaces allow, and the
    /// entry remembers every rule of the winning kind.
    pub fn insert(&mut self, key: MapKey, deny: bool, origin: &Arc<RuleOrigin>) {
        self.insert_l7(key, deny, origin, None)
    }

    /// [`insert`](Self::insert), an allow with the L7 rules of the `toPorts` entry it comes
    /// from (`None`: L3/L4 only).
    pub fn insert_l7(
        &mut self,
        key: MapKey,
        deny: bool,
        origin: &Arc<RuleOrigin>,
        rules: Option<&Arc<L7PortRules>>,
    ) {
        let cell = (key.protocol, key.port_lo, key.port_hi, rules);
        self.insert_ports(key.direction, &[key.identity], &[cell], deny, origin);
    }

    /// `insert_l7` of `(protocol, first port, last port, L7 rules)` for each of `ports`, in
    /// order, for each of `identities` in turn: each identity's group is looked up once, not
    /// once per entry, and the direction's table is made writable once.
    pub fn insert_ports(
        &mut self,
        direction: Direction,
        identities: &[NumericIdentity],
        ports: &[PortCell<'_>],
        deny: bool,
        origin: &Arc<RuleOrigin>,
    ) {
        let groups = self.dir_mut(direction);
        let mut added = 0;
        for &identity in identities {
            let slots = groups.entry(identity).or_default();
            for &(protocol, port_lo, port_hi, rules) in ports {
                let ports = (protocol, port_lo, port_hi);
                match slots.iter_mut().find(|s| s.at(ports)) {
                    Some(s) => s.entry.merge(deny, origin, rules),
                    None => {
                        slots.push(Slot::new(ports, MapEntry::new(deny, origin, rules)));
                        added += 1;
                    }
                }
            }
        }
        self.lens[slot(direction)] += added;
    }

    /// Adds the entries of `group` (as many `insert_l7`s would): at once when its identity has
    /// none in `direction` yet.
    pub fn insert_group(&mut self, direction: Direction, group: Group) {
        if group.slots.is_empty() {
            return;
        }
        let n = group.slots.len();
        let slots = match self.dir_mut(direction).entry(group.identity) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(group.slots);
                self.lens[slot(direction)] += n;
                return;
            }
            std::collections::hash_map::Entry::Occupied(_) => group.slots,
        };
        for s in slots {
            let key = s.key(direction, group.identity);
            s.entry
                .contributions(|o, rules| self.insert_l7(key, s.entry.deny, o, rules));
        }
    }

    /// Decides a packet to/from `identity` on `protocol`/`port` by the entries alone.
    pub fn lookup(
        &self,
        direction: Direction,
        identity: NumericIdentity,
        protocol: u8,
        port: u16,
    ) -> MapVerdict<'_> {
        decide(self.entries_for(direction, identity), protocol, port)
    }

    /// The entries a lookup of `identity` in direction `d` reads, in its order: the
    /// identity's own, then those of any peer (each with its key's protocol and ports).
    pub fn entries_for(
        &self,
        d: Direction,
        identity: NumericIdentity,
    ) -> impl Iterator<Item = EntryRef<'_>> + '_ {
        let own = self.group(d, identity);
        let any = (identity != IDENTITY_ANY)
            .then(|| self.group(d, IDENTITY_ANY))
            .flatten();
        own.into_iter()
            .chain(any)
            .flatten()
            .map(|s| (s.protocol, s.port_lo, s.port_hi, &s.entry))
    }

    /// Every allow entry matching a packet to/from `identity` on `protocol`/`port` (most
    /// specific identity first), or `None` when a deny matches: what the HTTP proxy and
    /// `policy simulate` judge a request of an allowed connection by.
    pub fn allows(
        &self,
        direction: Direction,
        identity: NumericIdentity,
        protocol: u8,
        port: u16,
    ) -> Option<Vec<&MapEntry>> {
        let mut out = Vec::new();
        let ids: &[NumericIdentity] = if identity == IDENTITY_ANY {
            &[IDENTITY_ANY]
        } else {
            &[identity, IDENTITY_ANY]
        };
        for id in ids {
            for s in self.group(direction, *id).into_iter().flatten() {
                if (s.protocol == 0 || s.protocol == protocol)
                    && s.port_lo <= port
                    && port <= s.port_hi
                {
                    if s.entry.deny {
                        return None;
                    }
                    out.push(&s.entry);
                }
            }
        }
        Some(out)
    }

    pub fn get(&self, key: &MapKey) -> Option<&MapEntry> {
        self.group(key.direction, key.identity)?
            .iter()
            .find(|s| s.at((key.protocol, key.port_lo, key.port_hi)))
            .map(|s| &s.entry)
    }

    /// Every entry, sorted by key.
    pub fn entries(&self) -> Vec<(MapKey, &MapEntry)> {
        let mut out: Vec<(MapKey, &MapEntry)> = DIRECTIONS
            .iter()
            .flat_map(|d| self.dir(*d).iter().map(move |g| (*d, g)))
            .flat_map(|(direction, (identity, slots))| {
                slots.iter().map(move |s| {
                    (
                        MapKey {
                            direction,
                            identity: *identity,
                            protocol: s.protocol,
                            port_lo: s.port_lo,
                            port_hi: s.port_hi,
                        },
                        &s.entry,
                    )
                })
            })
            .collect();
        out.sort_by_key(|(k, _)| *k);
        out
    }

    pub fn len(&self) -> usize {
        self.lens[0] + self.lens[1]
    }

    /// Whether any entry sends its traffic to the HTTP proxy.
    pub fn any_redirect(&self) -> bool {
        DIRECTIONS.iter().any(|d| self.dir(*d).any_redirect())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entries of the peer identities `peers` alone (both directions).
    pub fn of_peers(&self, peers: &std::collections::BTreeSet<NumericIdentity>) -> MapState {
        let mut out = MapState::new();
        for d in DIRECTIONS {
            for id in peers {
                if let Some(slots) = self.group(d, *id) {
                    out.lens[slot(d)] += slots.len();
                    out.dir_mut(d).insert(*id, slots.clone());
                }
            }
        }
        out
    }

    /// The changes that turn `realized`'s entries of `peers` into `self`'s, when `self` holds
    /// the entries of those peers only (an incremental resolution).
    pub fn diff_peers_from(
        &self,
        realized: &MapState,
        peers: &std::collections::BTreeSet<NumericIdentity>,
    ) -> MapDelta {
        self.diff_from(&realized.of_peers(peers))
    }

    /// The (protocol, first port, last port) of the entries of `identity` in direction `d`.
    pub fn slots(
        &self,
        d: Direction,
        identity: NumericIdentity,
    ) -> impl Iterator<Item = (u8, u16, u16)> + '_ {
        self.group(d, identity)
            .into_iter()
            .flatten()
            .map(|s| (s.protocol, s.port_lo, s.port_hi))
    }

    /// Every identity with entries in direction `d`, with theirs (`slots`).
    pub fn slots_of(
        &self,
        d: Direction,
    ) -> impl Iterator<Item = (NumericIdentity, Vec<(u8, u16, u16)>)> + '_ {
        self.dir(d).iter().map(|(id, slots)| {
            (
                *id,
                slots
                    .iter()
                    .map(|s| (s.protocol, s.port_lo, s.port_hi))
                    .collect(),
            )
        })
    }

    /// The entries of direction `d` alone (shared, not copied).
    pub fn direction_part(&self, d: Direction) -> MapState {
        let mut out = MapState::new();
        out.dirs[slot(d)] = self.dirs[slot(d)].clone();
        out.lens[slot(d)] = self.lens[slot(d)];
        out
    }

    /// Whether the entries of direction `d` are the same in both, each identity's in the same
    /// order (what a lookup finds first, hence what it explains, is the same too).
    pub fn same_direction(&self, other: &MapState, d: Direction) -> bool {
        shared(&self.dirs[slot(d)], &other.dirs[slot(d)]) || **self.dir(d) == **other.dir(d)
    }

    /// A hash of the keys and kinds of direction `d`'s entries, whatever the groups' order
    /// (`same_direction` decides; this only narrows the candidates).
    pub fn direction_fingerprint(&self, d: Direction) -> u64 {
        use std::hash::{Hash, Hasher};
        self.dir(d)
            .iter()
            .map(|(id, slots)| {
                let mut h = rustc_hash::FxHasher::default();
                id.hash(&mut h);
                for s in slots {
                    (s.protocol, s.port_lo, s.port_hi, s.entry.deny).hash(&mut h);
                }
                h.finish()
            })
            .fold(0u64, u64::wrapping_add)
    }

    /// Replaces every entry of direction `d` by those of `part` of that direction, shared
    /// (`part` is a compilation of the tiers other endpoints use too).
    pub fn replace_direction_from(&mut self, d: Direction, part: &MapState) {
        self.dirs[slot(d)] = part.dirs[slot(d)].clone();
        self.lens[slot(d)] = part.lens[slot(d)];
    }

    /// The identities of direction `d` with an entry derived from one of `origins` (those very
    /// rules: the same pointers), in no particular order (tests: `tiers::Compiled::defaulted`
    /// lists them as it writes).
    #[cfg(test)]
    pub(crate) fn identities_derived_from(
        &self,
        d: Direction,
        origins: &[&Arc<RuleOrigin>],
    ) -> Vec<NumericIdentity> {
        self.dir(d)
            .iter()
            .filter(|(_, slots)| {
                slots
                    .iter()
                    .any(|s| origins.iter().any(|o| s.entry.derived_from_ptr(o)))
            })
            .map(|(id, _)| *id)
            .collect()
    }

    /// In the entries of `identities` in direction `d`, each origin that is the first of a pair
    /// of `replace` (the same pointer) becomes the second, in its place: the entries the rules
    /// `to` would have given, had they been written instead (the direction's table is copied
    /// first when another map shares it).
    pub fn replace_origins(
        &mut self,
        d: Direction,
        identities: &[NumericIdentity],
        replace: &[(&Arc<RuleOrigin>, &Arc<RuleOrigin>)],
    ) {
        if identities.is_empty() {
            return;
        }
        let groups = self.dir_mut(d);
        for id in identities {
            for s in groups.get_mut(id).into_iter().flatten() {
                for (from, to) in replace {
                    s.entry.replace_origin(from, to);
                }
            }
        }
    }

    /// Replaces the entries of `peers` by those of `part` (which holds no others).
    pub fn replace_peers(
        &mut self,
        peers: &std::collections::BTreeSet<NumericIdentity>,
        part: MapState,
    ) {
        let MapState { dirs, lens } = part;
        for (d, added) in DIRECTIONS.into_iter().zip(dirs) {
            // A direction neither part nor peers touch stays shared (not copied).
            if added.is_none() && !peers.iter().any(|id| self.group(d, *id).is_some()) {
                continue;
            }
            let groups = self.dir_mut(d);
            let mut removed = 0;
            for id in peers {
                if let Some(old) = groups.remove(id) {
                    removed += old.len();
                }
            }
            match added.map(Arc::try_unwrap) {
                None => {}
                Some(Ok(g)) => groups.extend(g.by_identity),
                Some(Err(shared)) => groups.extend(shared.iter().map(|(k, v)| (*k, v.clone()))),
            }
            self.lens[slot(d)] = self.lens[slot(d)] - removed + lens[slot(d)];
        }
    }

    /// The changes that turn `realized` into `self`, upserts and deletes sorted by key (only
    /// the changed entries are sorted, not every entry).
    pub fn diff_from(&self, realized: &MapState) -> MapDelta {
        self.diff_with(realized, None)
    }

    /// [`diff_from`](Self::diff_from), where a direction `self` shares with other maps (a tier
    /// compilation the endpoints of one kind hold: `tier_memo`) is diffed once per pair of
    /// groups in `memo`, not once per endpoint.
    pub fn diff_from_shared(&self, realized: &MapState, memo: &DiffMemo) -> MapDelta {
        self.diff_with(realized, Some(memo))
    }

    fn diff_with(&self, realized: &MapState, memo: Option<&DiffMemo>) -> MapDelta {
        let mut delta = MapDelta::default();
        // Ingress keys sort before egress keys: the directions' parts append in order.
        for d in DIRECTIONS {
            let (new, old) = (&self.dirs[slot(d)], &realized.dirs[slot(d)]);
            // A direction both share is the same: nothing of it changed.
            if shared(new, old) {
                continue;
            }
            let held_elsewhere = new.as_ref().is_some_and(|n| Arc::strong_count(n) > 1);
            match (memo, new) {
                (Some(m), Some(n)) if held_elsewhere => {
                    let part = m.get(old, n, || self.diff_direction(realized, d));
                    delta.append((*part).clone());
                }
                _ => delta.append(self.diff_direction(realized, d)),
            }
        }
        delta
    }

    /// The changes of direction `d` alone.
    fn diff_direction(&self, realized: &MapState, direction: Direction) -> MapDelta {
        let mut delta = MapDelta::default();
        let mut changed: Vec<(MapKey, &MapEntry)> = Vec::new();
        for (&identity, slots) in self.dir(direction).iter() {
            let old = realized.group(direction, identity);
            for s in slots {
                let same = old
                    .and_then(|o| o.iter().find(|o| o.same_ports(s)))
                    .is_some_and(|o| {
                        o.entry.deny == s.entry.deny
                            && o.entry.derived_from == s.entry.derived_from
                            && o.entry.redirect() == s.entry.redirect()
                    });
                if !same {
                    changed.push((s.key(direction, identity), &s.entry));
                }
            }
        }
        changed.sort_unstable_by_key(|(k, _)| *k);
        // Entries mostly share their origin lists: hash each distinct one once.
        let mut known: HashMap<(SmallVec<[usize; 2]>, MatchKind), Cookie> = HashMap::default();
        delta.upserts.reserve(changed.len());
        for (k, e) in changed {
            delta.upserts.push((k, e.deny));
            if e.redirect() {
                delta.redirects.insert(k);
            }
            let kind = MatchKind::of_entry(&k, e.deny);
            let ptrs = e
                .derived_from
                .iter()
                .map(|o| Arc::as_ptr(o) as usize)
                .collect();
            let cookie = *known.entry((ptrs, kind)).or_insert_with(|| {
                let (cookie, refs) = entry_cookie(&e.derived_from, kind);
                delta.attributions.push((cookie, kind, refs.into()));
                cookie
            });
            delta.cookies.insert(k, cookie);
        }
        for (&identity, slots) in realized.dir(direction).iter() {
            let now = self.group(direction, identity);
            for s in slots {
                if !now.is_some_and(|n| n.iter().any(|n| n.same_ports(s))) {
                    delta.deletes.push(s.key(direction, identity));
                }
            }
        }
        delta.deletes.sort_unstable();
        delta
    }
}

/// The per-direction deltas between groups that maps share (`MapState::diff_from_shared`).
/// Keyed by the groups' addresses; each entry holds a `Weak` of both, so no other groups can
/// take either address while the entry lives (and shared groups are never changed in place:
/// `Arc::make_mut` copies them, or moves them away from their `Weak`s). A cache: bounded;
/// when full, the pairs whose groups are gone (no map holds them: never asked again) leave
/// first, and only when none has gone is it emptied. (Emptied every time, it was emptied in
/// the middle of a change every few changes under 100 kinds of endpoint, and the endpoints
/// after that point diffed again what their kind had diffed already.)
#[derive(Default)]
pub struct DiffMemo {
    inner: std::sync::Mutex<MemoInner>,
}

#[derive(Default)]
struct MemoInner {
    by_pair: rustc_hash::FxHashMap<(usize, usize), Memoized>,
    /// Changes held, over every delta.
    held: usize,
    hits: u64,
    misses: u64,
}

struct Memoized {
    before: Option<std::sync::Weak<Groups>>,
    after: std::sync::Weak<Groups>,
    delta: Arc<MapDelta>,
}

impl Memoized {
    /// Some map still holds both groups, so the pair may be asked for again.
    fn live(&self) -> bool {
        self.after.strong_count() > 0 && self.before.as_ref().is_none_or(|b| b.strong_count() > 0)
    }
}

impl MemoInner {
    fn full(&self, adding: usize) -> bool {
        self.by_pair.len() >= MEMO_PAIRS || self.held + adding > MEMO_CHANGES
    }

    /// Room for a delta of `adding` changes: the dead pairs go, then everything if need be.
    fn make_room(&mut self, adding: usize) {
        if !self.full(adding) {
            return;
        }
        self.by_pair.retain(|_, m| m.live());
        self.held = self.by_pair.values().map(|m| m.delta.len()).sum();
        if self.full(adding) {
            self.by_pair.clear();
            self.held = 0;
        }
    }
}

/// At most this many pairs, and this many changes over all their deltas.
const MEMO_PAIRS: usize = 1024;
const MEMO_CHANGES: usize = 1 << 20;

impl std::fmt::Debug for DiffMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (hits, misses, pairs) = self.stats();
        write!(
            f,
            "DiffMemo {{ pairs: {pairs}, hits: {hits}, misses: {misses} }}"
        )
    }
}

impl DiffMemo {
    fn lock(&self) -> std::sync::MutexGuard<'_, MemoInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The delta from `before` to `after`, computed by `diff` unless held.
    fn get(
        &self,
        before: &Option<Arc<Groups>>,
        after: &Arc<Groups>,
        diff: impl FnOnce() -> MapDelta,
    ) -> Arc<MapDelta> {
        let key = (
            before.as_ref().map_or(0, |b| Arc::as_ptr(b) as usize),
            Arc::as_ptr(after) as usize,
        );
        {
            let mut inner = self.lock();
            if let Some(m) = inner.by_pair.get(&key) {
                let delta = m.delta.clone();
                inner.hits += 1;
                return delta;
            }
            inner.misses += 1;
        }
        // Computed outside the lock: other endpoints look up meanwhile.
        let delta = Arc::new(diff());
        let mut inner = self.lock();
        if delta.len() <= MEMO_CHANGES {
            inner.make_room(delta.len());
            inner.held += delta.len();
            let held = Memoized {
                before: before.as_ref().map(Arc::downgrade),
                after: Arc::downgrade(after),
                delta: delta.clone(),
            };
            inner.by_pair.insert(key, held);
        }
        delta
    }

    /// (hits, misses, pairs held).
    pub fn stats(&self) -> (u64, u64, usize) {
        let inner = self.lock();
        (inner.hits, inner.misses, inner.by_pair.len())
    }
}

impl Slot {
    fn new((protocol, port_lo, port_hi): (u8, u16, u16), entry: MapEntry) -> Slot {
        Slot {
            protocol,
            port_lo,
            port_hi,
            entry,
        }
    }

    /// Its protocol and ports are these.
    fn at(&self, (protocol, port_lo, port_hi): (u8, u16, u16)) -> bool {
        self.protocol == protocol && self.port_lo == port_lo && self.port_hi == port_hi
    }

    fn same_ports(&self, other: &Slot) -> bool {
        self.at((other.protocol, other.port_lo, other.port_hi))
    }

    fn key(&self, direction: Direction, identity: NumericIdentity) -> MapKey {
        MapKey {
            direction,
            identity,
            protocol: self.protocol,
            port_lo: self.port_lo,
            port_hi: self.port_hi,
        }
    }
}

/// An ingress key (tests and benches).
pub fn ingress_key(identity: NumericIdentity, protocol: u8, lo: u16, hi: u16) -> MapKey {
    MapKey {
        direction: Direction::Ingress,
        identity,
        protocol,
        port_lo: lo,
        port_hi: hi,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_incremental_update_of_some_peers_equals_the_full_diff() {
        let o = origin("p", Section::Ingress);
        let mut realized = MapState::new();
        realized.insert(ingress_key(5, 6, 80, 80), false, &o);
        realized.insert(ingress_key(7, 6, 80, 80), false, &o);
        realized.insert(ingress_key(8, 6, 443, 443), false, &o);
        let mut full = MapState::new();
        full.insert(ingress_key(5, 6, 80, 80), false, &o);
        full.insert(ingress_key(7, 6, 443, 443), false, &o);
        full.insert(ingress_key(9, 6, 443, 443), true, &o);
        // Peers 7, 8 and 9 changed; 5 did not.
        let peers: std::collections::BTreeSet<NumericIdentity> = [7, 8, 9].into();
        let part = full.of_peers(&peers);
        let d = part.diff_peers_from(&realized, &peers);
        assert_eq!(d, full.diff_from(&realized));
        realized.replace_peers(&peers, part);
        assert_eq!(realized, full);
        assert_eq!(realized.len(), 3);
    }
    use crate::policy::rule::{PolicyKey, PolicyKind, Section};

    fn origin(name: &str, section: Section) -> Arc<RuleOrigin> {
        Arc::new(RuleOrigin {
            policy: Arc::new(PolicyKey::new(
                PolicyKind::CiliumNetworkPolicy,
                Some("x"),
                name,
            )),
            section,
            path: format!("spec.{}[0]", section.as_str()),
            l7: false,
            tier: None,
        })
    }

    use super::ingress_key as key;

    #[test]
    fn a_shared_direction_is_diffed_once_per_pair_and_changes_miss() {
        let (a, b, e) = (
            origin("a", Section::Ingress),
            origin("b", Section::Ingress),
            origin("e", Section::Egress),
        );
        let egress = |id| MapKey {
            direction: Direction::Egress,
            ..key(id, 6, 53, 53)
        };
        let mut before = MapState::new();
        before.insert(key(5, 6, 80, 80), false, &a);
        before.insert(key(6, 6, 81, 81), true, &a);
        // After: one entry changed origin, one gone, one new; egress added.
        let mut after = MapState::new();
        after.insert(key(5, 6, 80, 80), false, &b);
        after.insert(key(7, 0, 0, 65535), false, &b);
        after.insert(egress(9), false, &e);
        let memo = DiffMemo::default();
        // Two endpoints hold `after` (a tier compilation's shared groups) over `before`.
        let (ep1, ep2) = (after.clone(), after.clone());
        let want = after.diff_from(&before);
        assert!(!want.is_empty() && !want.deletes.is_empty());
        assert_eq!(ep1.diff_from_shared(&before, &memo), want);
        assert_eq!(ep2.diff_from_shared(&before.clone(), &memo), want);
        assert_eq!(
            memo.stats(),
            (2, 2, 2),
            "each direction: one miss, then one hit"
        );
        // A change to one endpoint's copy gives it ingress groups of its own, held by no other
        // map: diffed directly, nothing kept; its egress is still the shared one (a hit).
        let mut ep3 = after.clone();
        ep3.insert(key(8, 17, 53, 53), true, &b);
        assert_eq!(ep3.diff_from_shared(&before, &memo), ep3.diff_from(&before));
        assert_eq!(memo.stats(), (3, 2, 2));
        // Shared again (another endpoint got the same copy): a new pair, a miss.
        let ep4 = ep3.clone();
        assert_eq!(ep4.diff_from_shared(&before, &memo), ep3.diff_from(&before));
        assert_eq!(memo.stats(), (4, 3, 3));
    }

    #[test]
    fn a_full_diff_memo_lets_go_of_the_pairs_no_map_holds_first() {
        let memo = DiffMemo::default();
        let held = Arc::new(Groups::default());
        memo.get(&None, &held, MapDelta::default);
        // Pairs whose groups no map holds any more (each dropped right after its diff).
        for _ in 1..MEMO_PAIRS {
            memo.get(&None, &Arc::new(Groups::default()), MapDelta::default);
        }
        assert_eq!(memo.stats(), (0, MEMO_PAIRS as u64, MEMO_PAIRS));
        // Full: a new pair makes room by dropping the dead ones, not the held one.
        let another = Arc::new(Groups::default());
        memo.get(&None, &another, MapDelta::default);
        assert_eq!(memo.stats().2, 2);
        memo.get(&None, &held, || panic!("held: not diffed again"));
        memo.get(&None, &another, || panic!("held: not diffed again"));
        assert_eq!(memo.stats().0, 2);
    }

    #[test]
    fn a_group_adds_what_its_inserts_one_by_one_add() {
        let (a, b, d) = (
            origin("a", Section::Ingress),
            origin("b", Section::Ingress),
            origin("d", Section::IngressDeny),
        );
        // Several contributions to one key in a row, an allow then a deny of another key.
        let write = |g: &mut Group| {
            g.insert_l7((6, 80, 80), false, &a, None);
            g.insert_l7((6, 80, 80), false, &b, None);
            g.insert_l7((17, 53, 53), false, &a, None);
            g.insert_l7((17, 53, 53), true, &d, None);
        };
        let one_by_one = |m: &mut MapState| {
            m.insert(key(300, 6, 80, 80), false, &a);
            m.insert(key(300, 6, 80, 80), false, &b);
            m.insert(key(300, 17, 53, 53), false, &a);
            m.insert(key(300, 17, 53, 53), true, &d);
        };
        // Into a map without entries for the identity (at once), and into one with some
        // (merged entry by entry).
        for before in [None, Some(key(300, 6, 80, 80)), Some(key(300, 1, 0, 0))] {
            let mut want = MapState::new();
            let mut got = MapState::new();
            for m in [&mut want, &mut got] {
                m.insert(key(301, 6, 80, 80), false, &a);
                if let Some(k) = before {
                    m.insert(k, true, &d);
                }
            }
            one_by_one(&mut want);
            let mut g = Group::new(300);
            write(&mut g);
            got.insert_group(Direction::Ingress, g);
            assert_eq!(got, want, "{before:?}");
            assert_eq!(got.len(), want.len(), "{before:?}");
        }
        // A group with no entries adds nothing (not an empty group).
        let mut m = MapState::new();
        m.insert_group(Direction::Ingress, Group::new(300));
        assert!(m.is_empty() && m.group(Direction::Ingress, 300).is_none());
    }

    #[test]
    fn a_group_copies_another_map_s_entry_or_merges_its_contributions() {
        let (a, b, c) = (
            origin("a", Section::Ingress),
            origin("b", Section::Ingress),
            origin("c", Section::Ingress),
        );
        let mut other = MapState::new();
        other.insert(key(7, 6, 80, 80), false, &a);
        other.insert(key(7, 6, 80, 80), false, &b);
        let MapVerdict::Allowed(e) = other.lookup(Direction::Ingress, 7, 6, 80) else {
            panic!("allowed")
        };
        // A new key: the entry as it is; the last key again: its contributions merged.
        let mut g = Group::new(300);
        g.insert_entry((6, 80, 80), e);
        g.insert_l7((6, 443, 443), false, &c, None);
        g.insert_entry((6, 443, 443), e);
        let mut got = MapState::new();
        got.insert_group(Direction::Ingress, g);
        let mut want = MapState::new();
        for (port, origins) in [(80, vec![&a, &b]), (443, vec![&c, &a, &b])] {
            for o in origins {
                want.insert(key(300, 6, port, port), false, o);
            }
        }
        assert_eq!(got, want);
    }

    #[test]
    fn deny_wins_over_more_specific_allow() {
        let mut m = MapState::new();
        m.insert(
            key(300, 6, 80, 80),
            false,
            &origin("allow", Section::Ingress),
        );
        m.insert(
            key(0, 0, 0, 65535),
            true,
            &origin("deny", Section::IngressDeny),
        );
        assert!(matches!(
            m.lookup(Direction::Ingress, 300, 6, 80),
            MapVerdict::Denied(_)
        ));
    }

    #[test]
    fn wildcards_and_ranges_match() {
        let mut m = MapState::new();
        m.insert(key(0, 6, 8000, 8080), false, &origin("a", Section::Ingress));
        assert!(matches!(
            m.lookup(Direction::Ingress, 300, 6, 8050),
            MapVerdict::Allowed(_)
        ));
        assert!(matches!(
            m.lookup(Direction::Ingress, 300, 6, 8081),
            MapVerdict::NoMatch
        ));
        assert!(matches!(
            m.lookup(Direction::Ingress, 300, 17, 8050),
            MapVerdict::NoMatch
        ));
        assert!(matches!(
            m.lookup(Direction::Egress, 300, 6, 8050),
            MapVerdict::NoMatch
        ));
    }

    #[test]
    fn same_key_merges_and_deny_replaces_allow() {
        let mut m = MapState::new();
        let a = origin("a", Section::Ingress);
        let b = origin("b", Section::Ingress);
        m.insert(key(300, 6, 80, 80), false, &a);
        m.insert(key(300, 6, 80, 80), false, &b);
        assert_eq!(m.len(), 1);
        assert_eq!(m.get(&key(300, 6, 80, 80)).unwrap().derived_from.len(), 2);
        m.insert(
            key(300, 6, 80, 80),
            true,
            &origin("d", Section::IngressDeny),
        );
        let e = m.get(&key(300, 6, 80, 80)).unwrap();
        assert!(e.deny);
        assert_eq!(e.derived_from.len(), 1);
    }

    #[test]
    fn many_rules_on_one_key_are_kept_in_order_in_one_spill() {
        let mut m = MapState::new();
        let o: Vec<_> = (0..9)
            .map(|i| origin(&format!("r{i}"), Section::Ingress))
            .collect();
        for x in o.iter().chain(&o[..3]) {
            m.insert(key(300, 6, 80, 80), false, x);
        }
        let e = m.get(&key(300, 6, 80, 80)).unwrap();
        assert!(e
            .derived_from
            .iter()
            .zip(&o)
            .all(|(a, b)| Arc::ptr_eq(a, b)));
        assert_eq!(e.derived_from.len(), 9, "each rule once");
        // The third origin made room for eight; the ninth grew it (by doubling).
        assert_eq!(e.derived_from.capacity(), 16);
        let mut three = MapState::new();
        for x in &o[..3] {
            three.insert(key(300, 6, 80, 80), false, x);
        }
        let spilled = three.get(&key(300, 6, 80, 80)).unwrap();
        assert_eq!(spilled.derived_from.capacity(), ORIGINS_SPILLED);
    }

    #[test]
    fn diff_lists_upserts_and_deletes() {
        let a = origin("a", Section::Ingress);
        let mut old = MapState::new();
        old.insert(key(300, 6, 80, 80), false, &a);
        old.insert(key(301, 6, 80, 80), false, &a);
        let mut new = MapState::new();
        new.insert(key(300, 6, 80, 80), false, &a);
        new.insert(key(302, 6, 80, 80), true, &a);
        let d = new.diff_from(&old);
        assert_eq!(d.upserts, vec![(key(302, 6, 80, 80), true)]);
        assert_eq!(d.deletes, vec![key(301, 6, 80, 80)]);
    }
}
