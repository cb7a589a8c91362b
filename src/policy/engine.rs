//! The policy engine: repository + identities + selector cache + ipcache, and the resolution of
//! one endpoint's policy into a map state with explanations.
//!
//! Everything here is a plain struct updated by method calls (no I/O, no threads), so the agent's
//! `PolicyRepoActor` owns one and the simulator builds one from a world file.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use smallvec::SmallVec;

use super::identity::{
    Allocation, IdentityAllocator, IdentityInfo, NumericIdentity, IDENTITY_ANY, IDENTITY_HOST,
};
use super::ipcache::IpCache;
use super::l7::http::L7PortRules;
use super::labels::Labels;
use super::mapstate::{MapKey, MapState, MapVerdict};
use super::repository::{Repository, StoredPolicy};
use super::rule::{
    Direction, PeerRequirement, PeerRule, Peers, PolicyKey, PolicyKind, PortSpec, Ports, Rule,
    RuleOrigin, Section, Subject,
};
use super::selector::{SelectorKind, SelectorRef};
use super::selector_cache::SelectorCache;
use super::translate::ParsedPolicy;

/// A container port an endpoint exposes by name (for named-port rules).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NamedPort {
    /// Lower case, as rules are normalised.
    pub name: String,
    pub protocol: u8,
    pub port: u16,
}

/// What the engine needs to know about an endpoint to resolve its policy.
#[derive(Debug, Clone, Copy)]
pub struct EndpointView<'a> {
    pub identity: NumericIdentity,
    /// For pods: the identity's labels. For host endpoints: `reserved:host` plus node labels.
    pub labels: &'a Labels,
    pub named_ports: &'a [NamedPort],
    /// A node's host endpoint (selected by `nodeSelector` rules only).
    pub host: bool,
}

/// Result of a policy change, for deciding which endpoints to regenerate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyChange {
    pub revision: u64,
    /// Identities of the endpoints whose policy may have changed.
    pub affected: BTreeSet<NumericIdentity>,
    /// Host endpoints may be affected (a nodeSelector rule was added or removed).
    pub affects_hosts: bool,
    /// CIDR identities created by the change (to be released to the ipcache after regeneration).
    pub new_identities: Vec<NumericIdentity>,
    /// Prefixes that now map to a new CIDR identity in the ipcache.
    pub new_prefixes: Vec<(IpNet, NumericIdentity)>,
    /// Prefixes whose CIDR identity went away (no longer in the ipcache unless an endpoint owns them).
    pub removed_prefixes: Vec<IpNet>,
    /// The peer identities whose selections changed, when those are the only entries the
    /// change touches (learned and expired DNS names): the affected endpoints may update
    /// incrementally (`resolve_peers`).
    pub peers: BTreeSet<NumericIdentity>,
}

impl PolicyChange {
    /// Adds what `other` did (its `peers` are dropped: the sum is no longer peers-only).
    pub fn absorb(&mut self, other: PolicyChange) {
        self.revision = self.revision.max(other.revision);
        self.affected.extend(other.affected);
        self.affects_hosts |= other.affects_hosts;
        self.new_identities.extend(other.new_identities);
        self.new_prefixes.extend(other.new_prefixes);
        self.removed_prefixes.extend(other.removed_prefixes);
        self.peers.clear();
    }

    /// Adds what another peers-only change did (learned, expired or evicted DNS names): the
    /// sum still touches only the peers of both.
    pub fn absorb_peers(&mut self, other: PolicyChange) {
        let mut peers = std::mem::take(&mut self.peers);
        peers.extend(other.peers.iter().copied());
        self.absorb(other);
        self.peers = peers;
    }
}

/// One direction of a resolved policy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DirectionPolicy {
    /// Policies that turned default deny on for this direction (empty: everything allowed).
    pub isolated_by: Vec<Arc<PolicyKey>>,
}

/// One endpoint's resolved policy.
#[derive(Debug, Clone, Default)]
pub struct EndpointPolicy {
    pub revision: u64,
    pub map: MapState,
    pub ingress: DirectionPolicy,
    pub egress: DirectionPolicy,
    /// Policies that select the endpoint at all.
    pub selected_by: Vec<Arc<PolicyKey>>,
    /// Allow entries a requirement took away, each derived from the requirement's origin; for
    /// explanations only (never realized in the datapath).
    pub withheld: MapState,
    /// The allow requirements in force (origins of `withheld` entries point into these).
    pub requirements: Vec<Arc<PeerRequirement>>,
    /// The DNS proxy's table for this endpoint (`l7::dns::DnsRuleEntry`); empty when no egress
    /// allow rule carries DNS rules (then its DNS does not go through the proxy).
    pub dns: Vec<super::l7::dns::DnsRuleEntry>,
    /// The endpoint's DNS goes through the DNS proxy even with no DNS rules (`dns` empty: every
    /// name forwarded): a cluster tier's `domainNames` peer selects the addresses its answers
    /// resolve, so they must be learned.
    pub dns_observed: bool,
    /// Cluster tiers (AdminNetworkPolicy, ...) select the endpoint: `map` is their compilation
    /// with the NetworkPolicy tier (`policy::tiers`), always resolved whole (a change of one
    /// peer may change the entries of every other). Boxed: most endpoints have none, and the
    /// resolution of an endpoint nothing selects stays small.
    pub tiers: Option<Box<TierState>>,
}

/// An endpoint's policy with the staged policies enforced (`PolicyEngine::resolve_staged`).
#[derive(Debug)]
pub struct StagedPolicy {
    pub policy: EndpointPolicy,
    /// The staged policies that select the endpoint.
    pub staged: Vec<Arc<PolicyKey>>,
    /// What `judge` reports, made once: for a default deny per direction, and per deciding
    /// entry of `policy.map` (by its address: the map is never changed, so no address is
    /// reused while this lives).
    pub(super) default_deny: [std::sync::OnceLock<super::staged::Deciders>; 2],
    pub(super) by_entry: std::sync::Mutex<rustc_hash::FxHashMap<usize, super::staged::Deciders>>,
}

/// What the cluster tiers left on a tiered endpoint's policy.
#[derive(Debug, Clone, Default)]
pub struct TierState {
    /// What the tiers' compilation could not express exactly (denied instead).
    pub notes: Vec<String>,
    /// The tiers of each tiered direction as evaluated, for explanations (`tier_outcome`).
    pub views: Vec<Arc<TierView>>,
}

/// One tiered direction before its compilation: what `policy::tiers::evaluate` walks.
#[derive(Debug, Clone)]
pub struct TierView {
    pub direction: Direction,
    /// Shared by the endpoints the same tier policies select (derefs to `tiers::Tiers`).
    pub tiers: Arc<super::tier_memo::SharedTiers>,
    /// The NetworkPolicy tier's entries and the policies that isolate the endpoint there.
    pub np: MapState,
    pub np_isolated_by: Vec<Arc<PolicyKey>>,
}

/// Why a packet was allowed or dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// An allow entry matched (no deny did).
    Allowed(Vec<Arc<RuleOrigin>>),
    /// Nothing isolates the endpoint in this direction.
    NotIsolated,
    /// A deny entry matched.
    Denied(Arc<RuleOrigin>),
    /// Isolated and nothing allows it.
    DefaultDenied {
        isolated_by: Vec<Arc<PolicyKey>>,
        /// Requirements (`fromRequires`/`toRequires`) the peer fails that took away an allow
        /// it would otherwise have had.
        withheld_by: Vec<Arc<PeerRequirement>>,
    },
}

impl Decision {
    pub fn is_allowed(&self) -> bool {
        matches!(self, Decision::Allowed(_) | Decision::NotIsolated)
    }
}

impl EndpointPolicy {
    pub fn direction(&self, d: Direction) -> &DirectionPolicy {
        match d {
            Direction::Ingress => &self.ingress,
            Direction::Egress => &self.egress,
        }
    }

    /// Decides traffic with `peer` in direction `d`, as the datapath would.
    pub fn decide(&self, d: Direction, peer: NumericIdentity, protocol: u8, port: u16) -> Decision {
        match self.map.lookup(d, peer, protocol, port) {
            MapVerdict::Denied(e) => Decision::Denied(e.derived_from[0].clone()),
            MapVerdict::Allowed(e) => {
                if self.direction(d).isolated_by.is_empty() {
                    Decision::NotIsolated
                } else {
                    Decision::Allowed(e.derived_from.to_vec())
                }
            }
            MapVerdict::NoMatch => {
                let iso = &self.direction(d).isolated_by;
                if iso.is_empty() {
                    Decision::NotIsolated
                } else {
                    Decision::DefaultDenied {
                        isolated_by: iso.clone(),
                        withheld_by: self.withheld_by(d, peer, protocol, port),
                    }
                }
            }
        }
    }

    /// Whether `decide` allows it, without saying why (nothing allocated: what a replay of
    /// many connections asks first).
    pub fn permits(&self, d: Direction, peer: NumericIdentity, protocol: u8, port: u16) -> bool {
        match self.map.lookup(d, peer, protocol, port) {
            MapVerdict::Denied(_) => false,
            MapVerdict::Allowed(_) => true,
            MapVerdict::NoMatch => self.direction(d).isolated_by.is_empty(),
        }
    }

    /// The endpoint's DNS goes through the DNS proxy: DNS rules, or names to learn.
    pub fn dns_redirected(&self) -> bool {
        !self.dns.is_empty() || self.dns_observed
    }

    /// Cluster tiers select the endpoint (`tiers`).
    pub fn tiered(&self) -> bool {
        self.tiers.is_some()
    }

    /// How the tiers decide this traffic, when cluster tiers apply in direction `d` (the
    /// verdict is `decide`'s; this is the walk through the tiers that explains it).
    pub fn tier_outcome(
        &self,
        d: Direction,
        peer: NumericIdentity,
        protocol: u8,
        port: u16,
    ) -> Option<(&TierView, super::tiers::Outcome)> {
        let v = self
            .tiers
            .as_ref()?
            .views
            .iter()
            .find(|v| v.direction == d)?;
        let o = super::tiers::evaluate(
            &v.tiers,
            &v.np,
            !v.np_isolated_by.is_empty(),
            d,
            peer,
            protocol,
            port,
        );
        Some((v, o))
    }

    /// The requirements that took away an allow for this traffic.
    fn withheld_by(
        &self,
        d: Direction,
        peer: NumericIdentity,
        protocol: u8,
        port: u16,
    ) -> Vec<Arc<PeerRequirement>> {
        let MapVerdict::Allowed(e) = self.withheld.lookup(d, peer, protocol, port) else {
            return vec![];
        };
        self.requirements
            .iter()
            .filter(|r| e.derived_from.iter().any(|o| Arc::ptr_eq(o, &r.origin)))
            .cloned()
            .collect()
    }
}

/// The requirements in force for one endpoint, by the section of the peer rules they constrain.
#[derive(Debug, Default)]
struct Requirements {
    by_section: [Vec<Arc<PeerRequirement>>; 4],
}

impl Requirements {
    fn index(section: Section) -> usize {
        match section {
            Section::Ingress => 0,
            Section::IngressDeny => 1,
            Section::Egress => 2,
            Section::EgressDeny => 3,
        }
    }

    /// Every requirement of every rule that selects the endpoint (Cilium's
    /// `resolveL4IngressPolicy` / `resolveL4EgressPolicy` gather them before resolving).
    fn gather(rules: &[&Arc<Rule>]) -> Self {
        let mut out = Requirements::default();
        for req in rules.iter().flat_map(|r| r.requires.iter()) {
            out.by_section[Self::index(req.origin.section)].push(req.clone());
        }
        out
    }

    fn of(&self, section: Section) -> &[Arc<PeerRequirement>] {
        &self.by_section[Self::index(section)]
    }
}

/// Identities a requirement took away from a peer rule, by requirement.
type Withheld = Vec<(Arc<PeerRequirement>, Vec<NumericIdentity>)>;

/// Port name -> (protocol, port) -> number of endpoints declaring it.
type NamedPortCounts = HashMap<String, BTreeMap<(u8, u16), u32>>;

/// The policy engine. See the module documentation.
#[derive(Debug, Clone)]
pub struct PolicyEngine {
    identities: IdentityAllocator,
    selectors: SelectorCache,
    ipcache: IpCache,
    repo: Repository,
    /// Addresses of endpoints and nodes; they win over CIDR identities of the same prefix.
    endpoint_ips: HashMap<IpNet, NumericIdentity>,
    /// identity -> port name -> (protocol, port) -> reference count.
    named_ports: HashMap<NumericIdentity, NamedPortCounts>,
    /// Origin of the built-in allow-localhost entry.
    allow_localhost: Arc<RuleOrigin>,
    /// Names each address was learned for from DNS (normalized); each address with names
    /// holds one reference on its /32 (/128) CIDR identity, which carries them as labels.
    fqdn_names: HashMap<IpAddr, BTreeSet<String>>,
    /// Rules of the cluster tiers with `networks` peers: their subjects' policy depends on
    /// which identities hold the cluster's addresses (`tier_networks`).
    networks_rules: Vec<Arc<Rule>>,
    /// The nodes, their labels and their identities elsewhere: what cluster tiers' `nodes`
    /// peers select (`node_classes`).
    nodes: super::node_classes::NodeClasses,
    /// Rules of the cluster tiers with `nodes` peers: their subjects' policy depends on the
    /// nodes and their labels.
    nodes_rules: Vec<Arc<Rule>>,
    /// Tier compilations shared between endpoints of the same inputs (`tier_memo`): a cache,
    /// keyed by the inputs themselves, so no change to the engine has to invalidate it.
    tier_memo: super::tier_memo::CompileMemo,
    /// Tier rules' peer identities shared between endpoints (`tier_memo::PeerLists`): a
    /// cache, keyed by selection stamps, so no change to the engine has to invalidate it.
    peer_lists: super::tier_memo::PeerLists,
    /// Endpoints' resolved tier rules, shared (`TiersKey`): a cache.
    resolved_tiers: super::tier_memo::SharedMemo<TiersKey, ResolvedTiers>,
    /// Deltas between directions endpoints share (`MapState::diff_from_shared`): a cache,
    /// keyed by the groups themselves. A copy of the engine shares it (keys stay valid).
    diff_memo: Arc<super::mapstate::DiffMemo>,
    /// Changes with everything resolving tier rules reads besides selections and the rules:
    /// endpoint addresses (`networks`), named ports, node labels (`nodes`).
    tier_inputs_generation: u64,
    /// Stored policies that are staged (`Rule::staged`): none, and no resolution looks for them.
    staged_policies: usize,
}

impl Default for PolicyEngine {
    fn default() -> Self {
        Self::new()
    }
}

impl PolicyEngine {
    pub fn new() -> Self {
        let mut e = PolicyEngine {
            identities: IdentityAllocator::new(),
            selectors: SelectorCache::new(),
            ipcache: IpCache::new(),
            repo: Repository::new(),
            endpoint_ips: HashMap::new(),
            named_ports: HashMap::new(),
            networks_rules: Vec::new(),
            nodes: Default::default(),
            nodes_rules: Vec::new(),
            tier_memo: Default::default(),
            peer_lists: Default::default(),
            resolved_tiers: Default::default(),
            diff_memo: Default::default(),
            tier_inputs_generation: 0,
            staged_policies: 0,
            allow_localhost: Arc::new(RuleOrigin {
                policy: Arc::new(PolicyKey::new(PolicyKind::Builtin, None, "allow-localhost")),
                section: Section::Ingress,
                path: "allow-localhost".into(),
                l7: false,
                tier: None,
            }),
            fqdn_names: HashMap::new(),
        };
        let reserved: Vec<IdentityInfo> = e.identities.iter().cloned().collect();
        for info in reserved {
            e.selectors.add_identity(&info);
        }
        e
    }

    pub fn revision(&self) -> u64 {
        self.repo.revision()
    }

    /// The tier compilations shared between endpoints (`tier_memo`): (hits, misses, held).
    pub fn tier_memo_stats(&self) -> (u64, u64, usize) {
        self.tier_memo.stats()
    }

    /// Where endpoints diff the directions they share with others (`MapState::diff_from_shared`).
    pub fn diff_memo(&self) -> Arc<super::mapstate::DiffMemo> {
        self.diff_memo.clone()
    }

    /// Forgets the shared tier compilations and peer lists (benchmarks of a cold resolution).
    pub fn clear_tier_memo(&self) {
        self.resolved_tiers.clear();
        self.peer_lists.clear();
        self.tier_memo.clear()
    }

    pub fn repository(&self) -> &Repository {
        &self.repo
    }

    pub fn identities(&self) -> &IdentityAllocator {
        &self.identities
    }

    pub fn selector_cache(&self) -> &SelectorCache {
        &self.selectors
    }

    pub fn ipcache(&self) -> &IpCache {
        &self.ipcache
    }

    // ------------------------------------------------------------------ identities

    /// Allocates (or references) the identity of a label set.
    pub fn allocate_identity(&mut self, labels: &Labels) -> Allocation {
        let a = self.identities.allocate(labels);
        if let Allocation::New(id) = a {
            if let Some(info) = self.identities.get(id).cloned() {
                self.selectors.add_identity(&info);
            }
        }
        a
    }

    /// Re-creates an identity with a known number (endpoint restore).
    pub fn restore_identity(
        &mut self,
        id: NumericIdentity,
        labels: &Labels,
    ) -> Result<Allocation, String> {
        let a = self.identities.restore(id, labels)?;
        if let Allocation::New(id) = a {
            if let Some(info) = self.identities.get(id).cloned() {
                self.selectors.add_identity(&info);
            }
        }
        Ok(a)
    }

    /// Identity numbers across restarts (`policy::numbering`): the allocator journals every
    /// number it hands out from now on.
    pub fn keep_number_journal(&mut self) {
        self.identities.keep_journal();
    }

    /// The numbers handed out since the last call, to be written before anything reaches the
    /// kernel.
    pub fn take_number_journal(&mut self) -> Vec<super::numbering::NumberRecord> {
        self.identities.take_journal()
    }

    /// Every number in use, as a compacted journal.
    pub fn numbering(&self) -> Vec<super::numbering::NumberRecord> {
        self.identities.numbering()
    }

    /// A previous run's numbers, until [`Self::end_numbering_restore`].
    pub fn restore_numbering(&mut self, restored: super::numbering::Restored) {
        self.identities.restore_numbering(restored);
    }

    pub fn end_numbering_restore(&mut self) {
        self.identities.end_restore();
    }

    /// Drops a reference to an identity; returns true when it is gone.
    pub fn release_identity(&mut self, id: NumericIdentity) -> bool {
        if self.identities.release(id).is_some() {
            self.selectors.remove_identity(id);
            self.named_ports.remove(&id);
            self.tier_inputs_generation += 1;
            true
        } else {
            false
        }
    }

    /// Endpoint identities whose policy uses a selector that selects `id` (they need
    /// regenerating when `id` appears or disappears).
    pub fn endpoints_affected_by_identity(&self, id: NumericIdentity) -> BTreeSet<NumericIdentity> {
        let mut out = BTreeSet::new();
        for sid in self.selectors.selecting(id) {
            if let Some(sel) = self.selectors.selector(sid) {
                for rule in self.repo.rules_with_peer(sel) {
                    self.add_subjects(rule, &mut out);
                }
            }
        }
        out
    }

    /// Registers named container ports of an endpoint with identity `id`. Returns true when
    /// the identity's named ports changed (a name now maps to a port it did not).
    pub fn add_named_ports(&mut self, id: NumericIdentity, ports: &[NamedPort]) -> bool {
        if ports.is_empty() {
            return false;
        }
        self.tier_inputs_generation += 1;
        let m = self.named_ports.entry(id).or_default();
        let mut changed = false;
        for p in ports {
            let c = m
                .entry(p.name.clone())
                .or_default()
                .entry((p.protocol, p.port))
                .or_default();
            changed |= *c == 0;
            *c += 1;
        }
        changed
    }

    /// Takes back `add_named_ports`. Returns true when the identity's named ports changed (a
    /// name no longer maps to a port).
    pub fn remove_named_ports(&mut self, id: NumericIdentity, ports: &[NamedPort]) -> bool {
        let Some(m) = self.named_ports.get_mut(&id) else {
            return false;
        };
        self.tier_inputs_generation += 1;
        let mut changed = false;
        for p in ports {
            if let Some(byport) = m.get_mut(&p.name) {
                if let Some(c) = byport.get_mut(&(p.protocol, p.port)) {
                    *c -= 1;
                    if *c == 0 {
                        byport.remove(&(p.protocol, p.port));
                        changed = true;
                    }
                }
                if byport.is_empty() {
                    m.remove(&p.name);
                }
            }
        }
        if m.is_empty() {
            self.named_ports.remove(&id);
        }
        changed
    }

    // ------------------------------------------------------------------ ipcache

    /// Maps an endpoint or node address to its identity.
    pub fn upsert_endpoint_ip(&mut self, ip: IpAddr, id: NumericIdentity) {
        let p = IpNet::from(ip);
        self.tier_inputs_generation += 1;
        self.endpoint_ips.insert(p, id);
        self.ipcache.upsert(p, id);
    }

    pub fn remove_endpoint_ip(&mut self, ip: IpAddr) {
        let p = IpNet::from(ip);
        self.tier_inputs_generation += 1;
        self.endpoint_ips.remove(&p);
        match self.identities.lookup_cidr(&p) {
            Some(cid) => {
                self.ipcache.upsert(p, cid);
            }
            None => {
                self.ipcache.remove(p);
            }
        }
    }

    /// The endpoint identities whose policy depends on whether these addresses are the
    /// cluster's, and whose: the subjects of cluster tier rules whose `networks` contain one
    /// (`tier_networks`). Their endpoints regenerate when such an address comes, goes or
    /// changes identity.
    pub fn networks_subjects(&self, addresses: &[IpNet]) -> BTreeSet<NumericIdentity> {
        let mut out = BTreeSet::new();
        for rule in &self.networks_rules {
            let hit = Self::cidr_prefixes(rule)
                .iter()
                .any(|p| addresses.iter().any(|a| p.contains(a)));
            if hit {
                self.add_subjects(rule, &mut out);
            }
        }
        out
    }

    /// A node appeared or its labels changed (`labels`: its Kubernetes labels). Returns the
    /// endpoint identities to regenerate: the subjects of cluster tier rules with `nodes` peers,
    /// whose cover of the node identities may have changed, and the endpoints selecting a node
    /// identity that came or went. Nodes whose identity changed wait for
    /// [`Self::take_moved_nodes`].
    pub fn upsert_node_labels(&mut self, name: &str, labels: Labels) -> BTreeSet<NumericIdentity> {
        if !self.nodes.set_node(name, labels) {
            return BTreeSet::new();
        }
        self.nodes_changed()
    }

    /// A node went away: as [`Self::upsert_node_labels`].
    pub fn delete_node_labels(&mut self, name: &str) -> BTreeSet<NumericIdentity> {
        if !self.nodes.remove_node(name) {
            return BTreeSet::new();
        }
        self.nodes_changed()
    }

    /// This agent's own node (its addresses are `host`): as [`Self::upsert_node_labels`].
    pub fn set_local_node(&mut self, name: &str) -> BTreeSet<NumericIdentity> {
        if !self.nodes.set_local(name) {
            return BTreeSet::new();
        }
        self.nodes_changed()
    }

    /// The identity node `name`'s addresses have on other nodes (`remote-node`, or its class's
    /// when cluster tiers' `nodes` peers tell it apart: `node_classes`).
    pub fn node_identity(&self, name: &str) -> NumericIdentity {
        self.nodes.identity(name)
    }

    /// Whether any rule selects host endpoints (`nodeSelector`).
    pub fn has_host_rules(&self) -> bool {
        !self.repo.host_rules().is_empty()
    }

    /// This agent's own node, when known.
    pub fn local_node(&self) -> Option<&str> {
        self.nodes.local()
    }

    /// The nodes whose identity changed since the last call: their addresses move to it.
    pub fn take_moved_nodes(&mut self) -> Vec<String> {
        self.nodes.take_moved()
    }

    fn nodes_changed(&mut self) -> BTreeSet<NumericIdentity> {
        self.tier_inputs_generation += 1;
        let mut out = self.regroup_nodes();
        out.extend(self.nodes_subjects());
        out
    }

    /// Regroups the nodes into classes (after a change of the nodes or of the keys `nodes`
    /// peers name). Returns the endpoints selecting a class identity that came or went.
    fn regroup_nodes(&mut self) -> BTreeSet<NumericIdentity> {
        let (identities, selectors) = (&mut self.identities, &mut self.selectors);
        let mut gone = Vec::new();
        let r = self.nodes.regroup(
            |labels| {
                let a = identities.allocate(labels);
                if let Allocation::New(id) = a {
                    if let Some(info) = identities.get(id).cloned() {
                        selectors.add_identity(&info);
                    }
                }
                a.id()
            },
            |id| gone.push(id),
        );
        let mut out = BTreeSet::new();
        for id in r.new.iter().chain(&gone) {
            out.extend(self.endpoints_affected_by_identity(*id));
        }
        for id in gone {
            if self.identities.release(id).is_some() {
                self.selectors.remove_identity(id);
            }
        }
        if !r.new.is_empty() || !r.gone.is_empty() {
            self.tier_inputs_generation += 1;
        }
        out
    }

    /// The keys cluster tiers' `nodes` peers name, after a policy change: when they changed,
    /// the nodes regroup.
    fn refresh_node_keys(&mut self, affected: &mut BTreeSet<NumericIdentity>) {
        let sels = self
            .nodes_rules
            .iter()
            .flat_map(|r| r.selectors())
            .filter_map(|s| match s.kind() {
                SelectorKind::Nodes(l) => Some(l),
                _ => None,
            });
        if self.nodes.set_keys(sels) {
            self.tier_inputs_generation += 1;
            affected.extend(self.regroup_nodes());
        }
    }

    fn nodes_subjects(&self) -> BTreeSet<NumericIdentity> {
        let mut out = BTreeSet::new();
        for rule in &self.nodes_rules {
            self.add_subjects(rule, &mut out);
        }
        out
    }

    fn has_nodes_peers(rule: &Rule) -> bool {
        rule.selectors()
            .any(|s| matches!(s.kind(), SelectorKind::Nodes(_)))
    }

    /// The identity behind an address (longest prefix match; world when nothing matches).
    pub fn identity_of_ip(&self, ip: IpAddr) -> NumericIdentity {
        self.ipcache.lookup(ip)
    }

    // ------------------------------------------------------------------ DNS names

    /// `name` resolved to `ips` (an allowed DNS answer, or a world's `dns:`): every `toFQDNs`
    /// selector matching the name selects those addresses from now on.
    pub fn learn_fqdn(&mut self, name: &str, ips: &[IpAddr]) -> PolicyChange {
        let name = super::fqdn::normalize(name);
        let mut change = PolicyChange {
            revision: self.revision(),
            ..Default::default()
        };
        for ip in ips {
            let names = self.fqdn_names.entry(*ip).or_default();
            if !names.insert(name.clone()) {
                continue;
            }
            let prefix = IpNet::from(*ip);
            let fresh = names.len() == 1;
            let id = if fresh {
                match self.identities.allocate_cidr(prefix) {
                    Allocation::New(id) => {
                        if !self.endpoint_ips.contains_key(&prefix) {
                            self.ipcache.upsert(prefix, id);
                            change.new_prefixes.push((prefix, id));
                        }
                        change.new_identities.push(id);
                        id
                    }
                    Allocation::Existing(id) => id,
                }
            } else {
                match self.identities.lookup_cidr(&prefix) {
                    Some(id) => id,
                    None => continue,
                }
            };
            self.relabel_fqdn(id, *ip, &mut change);
        }
        change
    }

    /// Whether some policy's `toFQDNs` selector matches `name`.
    pub fn fqdn_selected(&self, name: &str) -> bool {
        self.selectors.fqdn_selects(name)
    }

    /// Changes whenever a `toFQDNs` selector appears or goes (then `resync_fqdn` is due).
    pub fn fqdn_generation(&self) -> u64 {
        self.selectors.fqdn_generation()
    }

    /// `learn_fqdn` for a name some `toFQDNs` selector matches; nothing for any other name.
    /// As in Cilium, only selected names get identities and ipcache entries, so what a pod
    /// resolves costs the agent nothing unless a policy asks for it.
    pub fn learn_selected_fqdn(&mut self, name: &str, ips: &[IpAddr]) -> PolicyChange {
        if !self.fqdn_selected(name) {
            return PolicyChange {
                revision: self.revision(),
                ..Default::default()
            };
        }
        self.learn_fqdn(name, ips)
    }

    /// The `toFQDNs` selectors changed: the names no selector matches any more are forgotten,
    /// and the `cached` names (name, addresses) a selector matches now are learned.
    pub fn resync_fqdn(&mut self, cached: &[(String, Vec<IpAddr>)]) -> PolicyChange {
        let mut change = PolicyChange {
            revision: self.revision(),
            ..Default::default()
        };
        let stale: Vec<(String, IpAddr)> = self
            .fqdn_names
            .iter()
            .flat_map(|(ip, names)| {
                names
                    .iter()
                    .filter(|n| !self.selectors.fqdn_selects(n))
                    .map(move |n| (n.clone(), *ip))
            })
            .collect();
        for (name, ip) in stale {
            let c = self.forget_fqdn(&name, ip);
            change.absorb(c);
        }
        for (name, ips) in cached {
            if self.fqdn_selected(name) {
                let c = self.learn_fqdn(name, ips);
                change.absorb(c);
            }
        }
        change
    }

    /// `name` no longer resolves to `ip` (its TTL ran out): selectors of that name let go.
    pub fn forget_fqdn(&mut self, name: &str, ip: IpAddr) -> PolicyChange {
        let name = super::fqdn::normalize(name);
        let mut change = PolicyChange {
            revision: self.revision(),
            ..Default::default()
        };
        let prefix = IpNet::from(ip);
        let Some(names) = self.fqdn_names.get_mut(&ip) else {
            return change;
        };
        if !names.remove(&name) {
            return change;
        }
        let last = names.is_empty();
        if last {
            self.fqdn_names.remove(&ip);
        }
        let Some(id) = self.identities.lookup_cidr(&prefix) else {
            return change;
        };
        if last && self.identities.release(id).is_some() {
            change.peers.insert(id);
            change
                .affected
                .extend(self.endpoints_affected_by_identity(id));
            self.selectors.remove_identity(id);
            if !self.endpoint_ips.contains_key(&prefix) {
                self.ipcache.remove(prefix);
                change.removed_prefixes.push(prefix);
            }
            return change;
        }
        self.relabel_fqdn(id, ip, &mut change);
        change
    }

    /// Gives `id` the labels of the names of `ip`, re-evaluating every selector on it.
    fn relabel_fqdn(&mut self, id: NumericIdentity, ip: IpAddr, change: &mut PolicyChange) {
        change.peers.insert(id);
        change
            .affected
            .extend(self.endpoints_affected_by_identity(id));
        self.selectors.remove_identity(id);
        let names = self.fqdn_names.get(&ip).cloned().unwrap_or_default();
        if let Some(info) = self.identities.set_fqdn_names(id, &names).cloned() {
            self.selectors.add_identity(&info);
        }
        change
            .affected
            .extend(self.endpoints_affected_by_identity(id));
    }

    /// Names `ip` was learned for.
    pub fn fqdn_names_of(&self, ip: IpAddr) -> Option<&BTreeSet<String>> {
        self.fqdn_names.get(&ip)
    }

    // ------------------------------------------------------------------ policies

    fn add_subjects(&self, rule: &Rule, out: &mut BTreeSet<NumericIdentity>) {
        if let Subject::Endpoints(s) = &rule.subject {
            if let Some(sel) = self.selectors.selections(s) {
                out.extend(sel.iter().copied());
            }
        }
    }

    fn cidr_prefixes(rule: &Rule) -> Vec<IpNet> {
        rule.selectors()
            .filter_map(|s| match s.kind() {
                SelectorKind::Cidr(c) => Some(c.prefixes().collect::<Vec<_>>()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    /// Adds or replaces a policy (by its resource key).
    pub fn upsert_policy(&mut self, policy: ParsedPolicy) -> PolicyChange {
        let mut change = PolicyChange::default();
        // Reference the new selectors (interned: rules keep the cache's copy) and CIDR
        // identities before dropping the old ones, so shared entries survive a replace untouched.
        let mut rules = policy.rules;
        for rule in &mut rules {
            rule.map_selectors(|s| self.selectors.add_selector(s));
        }
        let rules: Vec<Arc<Rule>> = rules.into_iter().map(Arc::new).collect();
        for rule in &rules {
            for prefix in Self::cidr_prefixes(rule) {
                if let Allocation::New(id) = self.identities.allocate_cidr(prefix) {
                    if let Some(info) = self.identities.get(id).cloned() {
                        self.selectors.add_identity(&info);
                    }
                    if !self.endpoint_ips.contains_key(&prefix) {
                        self.ipcache.upsert(prefix, id);
                        change.new_prefixes.push((prefix, id));
                    }
                    change.new_identities.push(id);
                }
            }
        }
        for rule in &rules {
            self.add_subjects(rule, &mut change.affected);
            change.affects_hosts |= matches!(rule.subject, Subject::Nodes(_));
            if rule.tier.is_some() && !Self::cidr_prefixes(rule).is_empty() {
                self.networks_rules.push(rule.clone());
            }
            if rule.tier.is_some() && Self::has_nodes_peers(rule) {
                self.nodes_rules.push(rule.clone());
            }
        }
        // Endpoints whose existing rules select the new CIDR identities change too.
        for id in &change.new_identities {
            let more = self.endpoints_affected_by_identity(*id);
            change.affected.extend(more);
        }
        let staged = rules.iter().any(|r| r.staged);
        let stored = StoredPolicy {
            key: policy.key,
            rules,
            notes: policy.notes,
        };
        let (rev, old) = self.repo.upsert(stored);
        change.revision = rev;
        self.staged_policies += staged as usize;
        if let Some(old) = old {
            self.staged_policies -= old.rules.iter().any(|r| r.staged) as usize;
            self.drop_rules(&old.rules, &mut change);
        }
        self.refresh_node_keys(&mut change.affected);
        change
    }

    /// Deletes a policy. `None` when no such policy is stored.
    pub fn delete_policy(&mut self, key: &PolicyKey) -> Option<PolicyChange> {
        let (rev, old) = self.repo.delete(key)?;
        let mut change = PolicyChange {
            revision: rev,
            ..Default::default()
        };
        self.staged_policies -= old.rules.iter().any(|r| r.staged) as usize;
        self.drop_rules(&old.rules, &mut change);
        self.refresh_node_keys(&mut change.affected);
        Some(change)
    }

    fn drop_rules(&mut self, rules: &[Arc<Rule>], change: &mut PolicyChange) {
        self.networks_rules
            .retain(|r| !rules.iter().any(|d| Arc::ptr_eq(r, d)));
        self.nodes_rules
            .retain(|r| !rules.iter().any(|d| Arc::ptr_eq(r, d)));
        for rule in rules {
            self.add_subjects(rule, &mut change.affected);
            change.affects_hosts |= matches!(rule.subject, Subject::Nodes(_));
        }
        for rule in rules {
            for prefix in Self::cidr_prefixes(rule) {
                if let Some(id) = self.identities.lookup_cidr(&prefix) {
                    if self.identities.release(id).is_some() {
                        let more = self.endpoints_affected_by_identity(id);
                        change.affected.extend(more);
                        self.selectors.remove_identity(id);
                        if !self.endpoint_ips.contains_key(&prefix) {
                            self.ipcache.remove(prefix);
                            change.removed_prefixes.push(prefix);
                        }
                    }
                }
            }
            for sel in rule.selectors() {
                self.selectors.remove_selector(sel);
            }
        }
    }

    /// The stored policy of a resource.
    pub fn policy(&self, key: &PolicyKey) -> Option<&StoredPolicy> {
        self.repo.get(key)
    }

    // ------------------------------------------------------------------ resolution

    /// The rules that apply to an endpoint, in a stable order (policy, then rule path); staged
    /// rules never apply.
    pub fn rules_for(&self, ep: &EndpointView) -> Vec<&Arc<Rule>> {
        let mut rules = self.rules_selecting(ep);
        if self.staged_policies > 0 {
            rules.retain(|r| !r.staged);
        }
        rules
    }

    /// Whether any stored policy is staged.
    pub fn has_staged(&self) -> bool {
        self.staged_policies > 0
    }

    /// The rules whose subject selects the endpoint, staged ones included, in a stable order.
    /// Borrowed from the repository (the engine is read-locked while it resolves): no
    /// reference count is touched, where the threads that regenerate endpoints took turns on
    /// the same rules' counts.
    fn rules_selecting(&self, ep: &EndpointView) -> Vec<&Arc<Rule>> {
        let mut rules: Vec<&Arc<Rule>> = if ep.host {
            self.repo
                .host_rules()
                .iter()
                .filter(|r| match r.subject.selector().kind() {
                    SelectorKind::Labels(ls) => ls.matches(ep.labels),
                    SelectorKind::Cidr(_) | SelectorKind::Fqdn(_) | SelectorKind::Nodes(_) => false,
                })
                .collect()
        } else {
            self.selectors
                .selecting(ep.identity)
                .filter_map(|sid| self.selectors.selector(sid))
                .flat_map(|sel| self.repo.rules_with_subject(sel).iter())
                .collect()
        };
        // Each selector's rules come sorted (`Repository::rules_with_subject`): a stable sort
        // merges the runs (one run: n - 1 comparisons) where an unstable one sorted them anew.
        rules.sort_by(|a, b| super::repository::rule_order(a, b));
        rules
    }

    /// Resolves an endpoint's policy into its map state.
    pub fn resolve(&self, ep: &EndpointView) -> EndpointPolicy {
        self.resolve_peers(ep, None)
    }

    /// [`resolve`](Self::resolve) with the map state limited to the entries of `peers` (all
    /// else, DNS rules and isolation included, in full): the incremental update of an endpoint
    /// after a change that only re-selected those peer identities (a DNS name learned or
    /// expired). `withheld` is left empty then (it only explains).
    pub fn resolve_peers(
        &self,
        ep: &EndpointView,
        peers: Option<&BTreeSet<NumericIdentity>>,
    ) -> EndpointPolicy {
        let out = EndpointPolicy {
            revision: self.repo.revision(),
            ..Default::default()
        };
        // Most endpoints of a large cluster are selected by no rule at all: nothing to build.
        if !ep.host && self.selectors.selecting(ep.identity).next().is_none() {
            return out;
        }
        self.resolve_rules(ep, peers, self.rules_for(ep), out)
    }

    /// The endpoint's policy as it would be with the staged policies enforced, and those of
    /// them that select it; `None` when no staged policy selects it (its policy is the one in
    /// force). Always resolved whole.
    pub fn resolve_staged(&self, ep: &EndpointView) -> Option<StagedPolicy> {
        if self.staged_policies == 0
            || (!ep.host && self.selectors.selecting(ep.identity).next().is_none())
        {
            return None;
        }
        let rules = self.rules_selecting(ep);
        let mut staged: Vec<Arc<PolicyKey>> = Vec::new();
        for r in rules.iter().filter(|r| r.staged) {
            if staged.last().is_none_or(|l| !Arc::ptr_eq(l, &r.policy)) {
                staged.push(r.policy.clone());
            }
        }
        if staged.is_empty() {
            return None;
        }
        let out = EndpointPolicy {
            revision: self.repo.revision(),
            ..Default::default()
        };
        Some(StagedPolicy {
            policy: self.resolve_rules(ep, None, rules, out),
            staged,
            default_deny: Default::default(),
            by_entry: Default::default(),
        })
    }

    /// Resolves `rules` (those selecting the endpoint, in order) into `out`.
    fn resolve_rules(
        &self,
        ep: &EndpointView,
        peers: Option<&BTreeSet<NumericIdentity>>,
        rules: Vec<&Arc<Rule>>,
        mut out: EndpointPolicy,
    ) -> EndpointPolicy {
        let (tiered, rules): (Vec<&Arc<Rule>>, Vec<&Arc<Rule>>) =
            rules.into_iter().partition(|r| r.tier.is_some());
        // Tiers need the whole picture: an incremental resolution becomes a full one.
        let peers = peers.filter(|_| tiered.is_empty());
        // Rules arrive grouped by policy, and all rules of one policy share one key `Arc`, so
        // "already listed" is a pointer comparison with the last element.
        fn push_once(v: &mut Vec<Arc<PolicyKey>>, k: &Arc<PolicyKey>) {
            if v.last().is_none_or(|l| !Arc::ptr_eq(l, k)) {
                v.push(k.clone());
            }
        }
        let requires = Requirements::gather(&rules);
        if peers.is_none() {
            for (d, n) in self.peer_bound(&rules) {
                out.map.reserve(d, n);
            }
        }
        let mut ids = Vec::new();
        for rule in &rules {
            push_once(&mut out.selected_by, &rule.policy);
            if rule.isolates_ingress {
                push_once(&mut out.ingress.isolated_by, &rule.policy);
            }
            if rule.isolates_egress {
                push_once(&mut out.egress.isolated_by, &rule.policy);
            }
            for pr in &rule.peer_rules {
                let section = pr.origin.section;
                let withheld = self.peer_rule_identities_into(pr, requires.of(section), &mut ids);
                match peers {
                    None => self.add_peer_rule(&mut out.map, pr, ep, &ids, &pr.origin),
                    Some(p) => {
                        let only: Vec<NumericIdentity> =
                            ids.iter().copied().filter(|i| p.contains(i)).collect();
                        self.add_peer_rule(&mut out.map, pr, ep, &only, &pr.origin)
                    }
                }
                if section == Section::Egress {
                    super::l7::dns::dns_entries(&mut out.dns, pr, &ids);
                }
                // Only allows need explaining: a requirement narrowing a deny never drops.
                if !section.is_deny() && peers.is_none() {
                    for (req, ids) in withheld {
                        self.add_peer_rule(&mut out.withheld, pr, ep, &ids, &req.origin);
                    }
                }
            }
        }
        out.map.shrink_sparse();
        if out.dns.iter().all(|e| e.names.is_none()) {
            out.dns.clear();
        }
        out.requirements = [Section::Ingress, Section::Egress]
            .iter()
            .flat_map(|s| requires.of(*s).iter().cloned())
            .collect();
        // Cilium's default `allow-localhost`: the node may always reach its own pods (kubelet
        // probes), even under ingress default deny. Deny rules still win over it.
        if !ep.host
            && !out.ingress.isolated_by.is_empty()
            && peers.is_none_or(|p| p.contains(&IDENTITY_HOST))
        {
            out.map.insert(
                MapKey {
                    direction: Direction::Ingress,
                    identity: IDENTITY_HOST,
                    protocol: 0,
                    port_lo: 0,
                    port_hi: 65535,
                },
                false,
                &self.allow_localhost,
            );
        }
        if !tiered.is_empty() {
            self.apply_tiers(&mut out, &tiered, ep);
        }
        out
    }

    /// Compiles the cluster tiers that select the endpoint with its NetworkPolicy tier (`out`
    /// so far) into `out` (`policy::tiers`).
    fn apply_tiers(&self, out: &mut EndpointPolicy, tiered: &[&Arc<Rule>], ep: &EndpointView) {
        let mut tiered: Vec<Arc<Rule>> = tiered.iter().map(|r| Arc::clone(r)).collect();
        // Tier, then priority; the same priority: by kind, then name (documented in README).
        tiered.sort_by(|a, b| (a.tier, &a.policy).cmp(&(b.tier, &b.policy)));
        // No tier policy is among the NetworkPolicy tier's; the rules of one are in a row.
        let np_tier = out.selected_by.len();
        for r in &tiered {
            if out.selected_by[np_tier..].last() != Some(&r.policy) {
                out.selected_by.push(r.policy.clone());
            }
        }
        // The endpoints these tier policies select share their resolved rules.
        let key = TiersKey {
            rules: tiered,
            selections: self.selectors.selections_version(),
            inputs: self.tier_inputs_generation,
            named_ports: ep.named_ports.to_vec(),
        };
        let resolved = self
            .resolved_tiers
            .get(&key, || self.resolve_tier_rules(&key.rules, ep));
        let tiered = key.rules;
        let mut state = TierState {
            notes: resolved.notes.clone(),
            ..Default::default()
        };
        out.dns_observed = resolved.dns_observed;
        for d in [Direction::Ingress, Direction::Egress] {
            let Some(t) = &resolved.dirs[d as usize] else {
                continue;
            };
            // What the Admin tier accepts never meets the NetworkPolicy tier's DNS rules.
            if d == Direction::Egress && !out.dns.is_empty() {
                let accepted = super::l7::dns::tier_accepted(&out.dns, &t.admin);
                out.dns.splice(0..0, accepted);
            }
            let np_isolated = !out.direction(d).isolated_by.is_empty();
            let defaults = tier_defaults(out.direction(d), &tiered, d);
            let c = self
                .tier_memo
                .compile(t, &out.map, np_isolated, d, &defaults);
            state.views.push(Arc::new(TierView {
                direction: d,
                tiers: t.clone(),
                np: out.map.clone(),
                np_isolated_by: out.direction(d).isolated_by.clone(),
            }));
            out.map.replace_direction_from(d, &c.map);
            state.notes.extend(c.notes.iter().cloned());
            let dir = match d {
                Direction::Ingress => &mut out.ingress,
                Direction::Egress => &mut out.egress,
            };
            if c.isolated && dir.isolated_by.is_empty() {
                dir.isolated_by
                    .extend(tiered.iter().map(|r| r.policy.clone()));
                dir.isolated_by.dedup();
            }
        }
        out.tiers = Some(Box::new(state));
    }

    /// The tier rules of `tiered` (in evaluation order) for an endpoint with `ep`'s named
    /// ports, per direction, with what could not be resolved exactly.
    fn resolve_tier_rules(&self, tiered: &[Arc<Rule>], ep: &EndpointView) -> ResolvedTiers {
        let mut notes = Vec::new();
        let dns_observed = tiered.iter().any(|r| {
            r.peer_rules
                .iter()
                .any(|pr| pr.origin.section == Section::Egress && pr.has_fqdn_peers())
        });
        let mut memo = TierMemo::default();
        let dirs = [Direction::Ingress, Direction::Egress].map(|d| {
            let mut t = super::tiers::Tiers::default();
            for r in tiered {
                let Some(place) = r.tier else { continue };
                let list = match place.tier {
                    super::rule::Tier::Admin => &mut t.admin,
                    super::rule::Tier::Baseline => &mut t.baseline,
                };
                for pr in r
                    .peer_rules
                    .iter()
                    .filter(|pr| pr.origin.section.direction() == d)
                {
                    list.extend(self.tier_rules(pr, ep, &mut memo, &mut notes));
                }
            }
            (!t.is_empty()).then(|| super::tier_memo::SharedTiers::new(t))
        });
        ResolvedTiers {
            dirs,
            notes,
            dns_observed,
        }
    }

    /// One tier peer rule with its peers and ports resolved: one `TierRule`, or several in a
    /// row when an egress named port stands for different ports on different peers (each
    /// with its own peers: still first-match in the same place).
    fn tier_rules(
        &self,
        pr: &PeerRule,
        ep: &EndpointView,
        memo: &mut TierMemo,
        notes: &mut Vec<String>,
    ) -> Vec<super::tiers::TierRule> {
        // Rules of many policies name the same selectors (a namespace): resolved once.
        // `None`: every peer, never the same as no selector at all (no peer).
        let key: Option<SelectorPtrs> = match &pr.peers {
            Peers::Any => None,
            Peers::Selectors(s) => Some(s.iter().map(Arc::as_ptr).collect()),
        };
        let shared = match memo.peers.get(&key) {
            Some(ids) => ids.clone(),
            None => {
                let ids = self.shared_peer_ids(pr);
                memo.peers.insert(key, ids.clone());
                ids
            }
        };
        let action = pr.action.unwrap_or(super::rule::Action::Deny);
        let (ids, partly_denied) = if names_cluster_parts(pr) {
            let mut ids = shared.to_vec();
            let mut partly = self.networks_inside(pr, action, &mut ids, &mut memo.covers, notes);
            partly.extend(self.nodes_inside(pr, action, &mut ids, notes));
            (Arc::from(ids), partly)
        } else {
            (shared, Vec::new())
        };
        let rule = |peers: Arc<[NumericIdentity]>, ports| super::tiers::TierRule {
            origin: pr.origin.clone(),
            action,
            peers,
            ports,
        };
        // Identities a Pass covers only partly are denied in its place (their own rule first:
        // its peers are disjoint from the Pass's).
        let partly = |out: &mut Vec<super::tiers::TierRule>| {
            if !partly_denied.is_empty() {
                let mut deny = rule(partly_denied.clone().into(), None);
                deny.action = super::rule::Action::Deny;
                out.insert(0, deny);
            }
        };
        let Ports::List(list) = &pr.ports else {
            let mut out = vec![rule(ids, None)];
            partly(&mut out);
            return out;
        };
        let egress = pr.origin.section.direction() == Direction::Egress;
        // The ports of the rule for peer `owner` (an egress named port: that peer's).
        let ports_of = |owner: NumericIdentity| {
            let mut ports = Vec::new();
            for m in list {
                let protos = m.protocol.numbers();
                match &m.port {
                    PortSpec::Range(lo, hi) => {
                        ports.extend(protos.iter().map(|&p| (p, *lo, *hi)));
                    }
                    PortSpec::Named(name) if !egress => ports.extend(
                        ep.named_ports
                            .iter()
                            .filter(|np| np.name == *name && protos.contains(&np.protocol))
                            .map(|np| (np.protocol, np.port, np.port)),
                    ),
                    PortSpec::Named(name) => ports.extend(
                        self.named_ports_of(owner, name)
                            .into_iter()
                            .filter(|(p, _)| protos.contains(p))
                            .map(|(p, port)| (p, port, port)),
                    ),
                }
            }
            ports
        };
        // Ports by peer: the same for all unless an egress rule names a port.
        let named = list.iter().any(|m| matches!(m.port, PortSpec::Named(_)));
        let mut out: Vec<super::tiers::TierRule> = Vec::new();
        if egress && named {
            // Peers (in order) that end up with the same ports: one rule, not one per peer.
            let mut runs: Vec<(Vec<NumericIdentity>, TierPorts)> = Vec::new();
            for &id in ids.iter() {
                let ports = ports_of(id);
                match runs.last_mut() {
                    Some((peers, p)) if *p == ports => peers.push(id),
                    _ => runs.push((vec![id], ports)),
                }
            }
            out.extend(
                runs.into_iter()
                    .map(|(peers, ports)| rule(peers.into(), Some(ports))),
            );
        } else {
            out.push(rule(ids, Some(ports_of(IDENTITY_ANY))));
        }
        partly(&mut out);
        out
    }

    /// A tier peer rule's identities (sorted), shared with every endpoint and rule that name
    /// selectors of the same selections (`tier_memo::PeerLists`).
    fn shared_peer_ids(&self, pr: &PeerRule) -> Arc<[NumericIdentity]> {
        // Every peer: not from the lists, whose empty key is a rule with no selector (no peer).
        let Peers::Selectors(all) = &pr.peers else {
            return Arc::from([IDENTITY_ANY]);
        };
        // 0 (no stamp is 0): a selector the cache does not hold, which selects nothing.
        let stamps = all
            .iter()
            .map(|s| self.selectors.selection_stamp(s).unwrap_or(0))
            .collect();
        self.peer_lists.get(stamps, || self.selected_by_any(all))
    }

    /// A tier rule's `networks` inside the cluster (`tier_networks`): adds the identities its
    /// CIDRs cover to `ids` as the rule's action allows; returns those a `Pass` must deny.
    fn networks_inside(
        &self,
        pr: &PeerRule,
        action: super::rule::Action,
        ids: &mut Vec<NumericIdentity>,
        covers: &mut super::tier_networks::CoverMemo,
        notes: &mut Vec<String>,
    ) -> Vec<NumericIdentity> {
        use super::rule::Action;
        let Peers::Selectors(all) = &pr.peers else {
            return Vec::new();
        };
        let cidrs: Vec<&super::selector::CidrSelector> = all
            .iter()
            .filter_map(|s| match s.kind() {
                SelectorKind::Cidr(c) => Some(c),
                _ => None,
            })
            .collect();
        if cidrs.is_empty() {
            return Vec::new();
        }
        let cover = covers.get(&self.endpoint_ips, &cidrs);
        let pass_denies = add_cover(action, ids, &cover);
        if !cover.partial.is_empty() {
            let what = match action {
                Action::Deny => "denied, also their addresses outside",
                Action::Allow => "not allowed by it, also their addresses inside",
                Action::Pass => "denied instead of passed",
            };
            notes.push(format!(
                "{} {}.networks: identities {:?} have addresses both inside and outside the CIDRs: {what} (fail closed)",
                pr.origin.policy, pr.origin.path, cover.partial
            ));
        }
        pass_denies
    }

    /// A tier rule's `nodes` peers: every node's addresses are `host` (this node's) or
    /// `remote-node` (the others'), so a rule selecting every node has both identities as
    /// peers, one selecting none neither, and one selecting some of the nodes covers both
    /// partly: it is a Deny's peer (the other nodes are denied too), not an Allow's, and denied
    /// where the rule is a Pass, as `networks_inside` does (fail closed, with a note). The same
    /// for every endpoint, whichever node it is on. Returns the identities a `Pass` must deny.
    fn nodes_inside(
        &self,
        pr: &PeerRule,
        action: super::rule::Action,
        ids: &mut Vec<NumericIdentity>,
        notes: &mut Vec<String>,
    ) -> Vec<NumericIdentity> {
        use super::rule::Action;
        let Peers::Selectors(all) = &pr.peers else {
            return Vec::new();
        };
        let sels: Vec<&super::selector::LabelSelector> = all
            .iter()
            .filter_map(|s| match s.kind() {
                SelectorKind::Nodes(l) => Some(l),
                _ => None,
            })
            .collect();
        if sels.is_empty() {
            return Vec::new();
        }
        let Some(n) = self.nodes.cover(&sels) else {
            return Vec::new();
        };
        let pass_denies = add_cover(action, ids, &n.cover);
        if !n.cover.partial.is_empty() {
            let what = match action {
                Action::Deny => "denied",
                Action::Allow => "not allowed by it",
                Action::Pass => "denied instead of passed",
            };
            let shared: Vec<String> = n.cover.partial.iter().map(|i| i.to_string()).collect();
            notes.push(format!(
                "{} {}.nodes: selects {} of the {} nodes, but {}: identities {} are {what} (fail closed)",
                pr.origin.policy,
                pr.origin.path,
                n.selected,
                n.of,
                self.nodes.mixed_reason(),
                shared.join(", ")
            ));
        }
        pass_denies
    }

    /// An upper bound of the peer identities `rules` give entries, per direction: the sizes of
    /// their selections, at most every identity there is.
    fn peer_bound(&self, rules: &[&Arc<Rule>]) -> [(Direction, usize); 2] {
        let mut n = [0usize; 2];
        for pr in rules.iter().flat_map(|r| &r.peer_rules) {
            n[pr.origin.section.direction() as usize] += match &pr.peers {
                Peers::Selectors(all) => all
                    .iter()
                    .filter_map(|s| self.selectors.selections(s))
                    .map(|s| s.len())
                    .sum(),
                _ => 1,
            };
        }
        let all = self.identities.len();
        [
            (Direction::Ingress, n[Direction::Ingress as usize].min(all)),
            (Direction::Egress, n[Direction::Egress as usize].min(all)),
        ]
    }

    /// The identities a set of selectors selects, sorted and deduplicated.
    fn selected_by_any(&self, sels: &[SelectorRef]) -> Vec<NumericIdentity> {
        let mut ids = Vec::new();
        self.selected_by_any_into(sels, &mut ids);
        ids
    }

    /// [`Self::selected_by_any`] into `ids` (cleared first: a buffer reused rule after rule).
    fn selected_by_any_into(&self, sels: &[SelectorRef], ids: &mut Vec<NumericIdentity>) {
        ids.clear();
        ids.extend(
            sels.iter()
                .filter_map(|s| self.selectors.selections(s))
                .flatten()
                .copied(),
        );
        if sels.len() > 1 {
            ids.sort_unstable();
            ids.dedup();
        }
    }

    /// The peer identities of a peer rule once `requires` are ANDed into its endpoint
    /// selectors, into `ids` (sorted; a buffer reused rule after rule), and the identities each
    /// failing requirement took away (for explanations).
    fn peer_rule_identities_into(
        &self,
        pr: &PeerRule,
        requires: &[Arc<PeerRequirement>],
        ids: &mut Vec<NumericIdentity>,
    ) -> Withheld {
        let Peers::Selectors(all) = &pr.peers else {
            ids.clear();
            ids.push(IDENTITY_ANY);
            return vec![];
        };
        let (endpoints, others) = pr.split_selectors();
        if requires.is_empty() || endpoints.is_empty() {
            self.selected_by_any_into(all, ids);
            return vec![];
        }
        self.selected_by_any_into(others, ids);
        let mut withheld: Withheld = Vec::new();
        for id in self.selected_by_any(endpoints) {
            // An identity the allocator no longer knows matches nothing (fail closed).
            let labels = self.identities.get(id).map(|i| &i.labels);
            let failed: Vec<&Arc<PeerRequirement>> = requires
                .iter()
                .filter(|r| labels.is_none_or(|l| !r.selector.matches(l)))
                .collect();
            if failed.is_empty() {
                ids.push(id);
            }
            for r in failed {
                match withheld.iter_mut().find(|(w, _)| Arc::ptr_eq(w, r)) {
                    Some((_, v)) => v.push(id),
                    None => withheld.push((r.clone(), vec![id])),
                }
            }
        }
        ids.sort_unstable();
        ids.dedup();
        // Another selector of the rule (an entity, a CIDR) may still select a withheld identity.
        for (_, v) in &mut withheld {
            v.retain(|id| ids.binary_search(id).is_err());
        }
        withheld.retain(|(_, v)| !v.is_empty());
        withheld
    }

    /// The (protocol, port) pairs a name stands for among the endpoints of `peer` (any
    /// endpoint for the wildcard identity).
    fn named_ports_of(&self, peer: NumericIdentity, name: &str) -> Vec<(u8, u16)> {
        if peer == IDENTITY_ANY {
            let mut v: Vec<(u8, u16)> = self
                .named_ports
                .values()
                .filter_map(|m| m.get(name))
                .flat_map(|b| b.keys().copied())
                .collect();
            v.sort_unstable();
            v.dedup();
            return v;
        }
        self.named_ports
            .get(&peer)
            .and_then(|m| m.get(name))
            .map(|b| b.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Inserts the entries of `pr`'s ports for the peer identities `ids`, derived from `origin`.
    fn add_peer_rule(
        &self,
        map: &mut MapState,
        pr: &PeerRule,
        ep: &EndpointView,
        ids: &[NumericIdentity],
        origin: &Arc<RuleOrigin>,
    ) {
        let direction = pr.origin.section.direction();
        let deny = pr.origin.section.is_deny();
        if ids.is_empty() {
            return;
        }
        let mut insert =
            |id: NumericIdentity, protocol: u8, lo: u16, hi: u16, l7: Option<&Arc<L7PortRules>>| {
                map.insert_l7(
                    MapKey {
                        direction,
                        identity: id,
                        protocol,
                        port_lo: lo,
                        port_hi: hi,
                    },
                    deny,
                    origin,
                    l7,
                );
            };
        let list = match &pr.ports {
            Ports::Any => {
                for &id in ids {
                    insert(id, 0, 0, 65535, None);
                }
                return;
            }
            Ports::List(l) => l,
        };
        // Port numbers and ranges only (most rules): each peer's entries in one go, in the
        // order of the loop below (the same entries, in the same order).
        if list.iter().all(|pm| matches!(pm.port, PortSpec::Range(..))) {
            let mut cells: SmallVec<[super::mapstate::PortCell<'_>; 4]> = SmallVec::new();
            for pm in list {
                let PortSpec::Range(lo, hi) = pm.port else {
                    continue;
                };
                let l7 = pr
                    .l7
                    .iter()
                    .find(|e| e.ports.contains(pm))
                    .map(|e| &e.rules);
                cells.extend(pm.protocol.numbers().iter().map(|&p| (p, lo, hi, l7)));
            }
            map.insert_ports(direction, ids, &cells, deny, origin);
            return;
        }
        for pm in list {
            let protos = pm.protocol.numbers();
            let l7 = pr
                .l7
                .iter()
                .find(|e| e.ports.contains(pm))
                .map(|e| &e.rules);
            match &pm.port {
                PortSpec::Range(lo, hi) => {
                    for &id in ids {
                        for &p in protos {
                            insert(id, p, *lo, *hi, l7);
                        }
                    }
                }
                PortSpec::Named(name) => match direction {
                    // Ingress: the destination is the endpoint itself.
                    Direction::Ingress => {
                        for np in ep
                            .named_ports
                            .iter()
                            .filter(|np| np.name == *name && protos.contains(&np.protocol))
                        {
                            for &id in ids {
                                insert(id, np.protocol, np.port, np.port, l7);
                            }
                        }
                    }
                    // Egress: the destination is the peer; each peer identity's own ports.
                    Direction::Egress => {
                        for &id in ids {
                            for (proto, port) in self.named_ports_of(id, name) {
                                if protos.contains(&proto) {
                                    insert(id, proto, port, port, l7);
                                }
                            }
                        }
                    }
                },
            }
        }
    }

    /// The identity info of `id`, if it exists.
    pub fn identity(&self, id: NumericIdentity) -> Option<&IdentityInfo> {
        self.identities.get(id)
    }
}

/// Adds the identities a tier rule's peers cover to `ids` as its action allows: fully covered
/// ones always; partly covered ones as a Deny's peers (fail closed), never an Allow's. Returns
/// the partly covered ones a `Pass` must deny instead of passing.
fn add_cover(
    action: super::rule::Action,
    ids: &mut Vec<NumericIdentity>,
    cover: &super::tier_networks::Cover,
) -> Vec<NumericIdentity> {
    use super::rule::Action;
    ids.extend(&cover.full);
    let mut pass_denies = Vec::new();
    match action {
        Action::Deny => ids.extend(&cover.partial),
        Action::Allow => {}
        Action::Pass => pass_denies = cover.partial.clone(),
    }
    ids.sort_unstable();
    ids.dedup();
    pass_denies
}

/// A tier rule's ports: (protocol, first port, last port).
type TierPorts = Vec<(u8, u16, u16)>;

/// What an endpoint's tier rules are resolved from, besides the engine's selections and
/// state (`PolicyEngine::tier_inputs_generation`): the tier policies' rules selecting it (in
/// evaluation order) and its named ports. Rules compare by pointer: a changed policy has new
/// ones, and the key holds them, so an address is never reused while it is held.
#[derive(Clone)]
struct TiersKey {
    rules: Vec<Arc<Rule>>,
    selections: u64,
    inputs: u64,
    named_ports: Vec<NamedPort>,
}

impl PartialEq for TiersKey {
    fn eq(&self, other: &TiersKey) -> bool {
        self.selections == other.selections
            && self.inputs == other.inputs
            && self.named_ports == other.named_ports
            && self.rules.len() == other.rules.len()
            && self
                .rules
                .iter()
                .zip(&other.rules)
                .all(|(a, b)| Arc::ptr_eq(a, b))
    }
}

/// An endpoint's tier rules resolved (`PolicyEngine::resolve_tier_rules`), shared by the
/// endpoints of the same `TiersKey`.
struct ResolvedTiers {
    /// Ingress, egress (`Direction as usize`); `None`: no tier rule of the direction.
    dirs: [Option<Arc<super::tier_memo::SharedTiers>>; 2],
    notes: Vec<String>,
    /// Some tier rule has egress FQDN peers (`EndpointPolicy::dns_observed`).
    dns_observed: bool,
}

/// The rule names `networks` or `nodes`: its identities depend on what holds the cluster's
/// addresses and on the nodes (`PolicyEngine::networks_inside`, `nodes_inside`).
fn names_cluster_parts(pr: &PeerRule) -> bool {
    matches!(&pr.peers, Peers::Selectors(s) if s.iter().any(|s| matches!(s.kind(), SelectorKind::Cidr(_) | SelectorKind::Nodes(_))))
}

/// A peer rule's selectors by address (interned: the same selector, the same address); most
/// rules name one or two.
type SelectorPtrs = SmallVec<[*const super::selector::Selector; 2]>;

/// What the resolution of one endpoint's tier rules computes once and reuses.
#[derive(Default)]
struct TierMemo {
    /// Peer identities by the peer selectors (pointers: selectors are interned; `None`: every
    /// peer). Fx: keyed by what only the agent makes (interned selectors' addresses).
    peers: rustc_hash::FxHashMap<Option<SelectorPtrs>, Arc<[NumericIdentity]>>,
    covers: super::tier_networks::CoverMemo,
}

/// What a tiered direction's default-decided entries are derived from: the NetworkPolicy
/// tier's isolation (the first isolating policy) for denials, the first tier policy for
/// allowing by default.
fn tier_defaults(
    dir: &DirectionPolicy,
    tiered: &[Arc<Rule>],
    d: Direction,
) -> super::tiers::Defaults {
    let tier_key = tiered[0].policy.clone();
    let tier = tiered[0].tier.map(|p| p.tier);
    let (allow_section, deny_section) = match d {
        Direction::Ingress => (Section::Ingress, Section::IngressDeny),
        Direction::Egress => (Section::Egress, Section::EgressDeny),
    };
    super::tiers::Defaults {
        allow: Arc::new(RuleOrigin {
            policy: tier_key.clone(),
            section: allow_section,
            path: "(none of its rules, nor any of another tier, matched: allowed by default)"
                .into(),
            l7: false,
            tier,
        }),
        deny: Arc::new(RuleOrigin {
            policy: dir.isolated_by.first().cloned().unwrap_or(tier_key),
            section: deny_section,
            path: "(default deny)".into(),
            l7: false,
            tier: if dir.isolated_by.is_empty() {
                tier
            } else {
                None
            },
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::identity::{IDENTITY_REMOTE_NODE, IDENTITY_WORLD_IPV4};
    use crate::policy::labels::Label;
    use crate::policy::rule::{PROTO_TCP, PROTO_UDP};
    use crate::policy::translate::parse_policy;

    fn pod(ns: &str, app: &str) -> Labels {
        let l: std::collections::BTreeMap<String, String> =
            [("app".to_string(), app.to_string())].into();
        Labels::for_pod(ns, &l, &std::collections::BTreeMap::new(), None)
    }

    fn policy(yaml: &str) -> ParsedPolicy {
        let doc: serde_yaml::Value = serde_yaml::from_str(yaml).unwrap();
        parse_policy(&doc, "default", "test").unwrap()
    }

    fn view<'a>(
        id: NumericIdentity,
        labels: &'a Labels,
        ports: &'a [NamedPort],
    ) -> EndpointView<'a> {
        EndpointView {
            identity: id,
            labels,
            named_ports: ports,
            host: false,
        }
    }

    /// A cluster tier's `networks` cover pods whose addresses are inside (fully: peers; partly:
    /// a Deny's peers, never an Allow's), and address changes name the endpoints to redo.
    #[test]
    fn tier_networks_cover_the_cluster_s_addresses_as_they_come_and_go() {
        let mut e = PolicyEngine::new();
        let (la, lb, lc) = (pod("x", "a"), pod("x", "b"), pod("x", "c"));
        let a = e.allocate_identity(&la).id();
        let b = e.allocate_identity(&lb).id();
        let c = e.allocate_identity(&lc).id();
        e.upsert_policy(policy("{apiVersion: policy.networking.k8s.io/v1alpha1, kind: AdminNetworkPolicy, metadata: {name: nets}, spec: {priority: 1, subject: {pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: a}}}}, egress: [{action: Allow, to: [{networks: [10.0.1.0/24]}], ports: [{portNumber: {protocol: TCP, port: 80}}]}, {action: Deny, to: [{networks: [10.0.1.0/24]}]}]}}"));
        let egress = |e: &PolicyEngine, peer, port| match e.resolve(&view(a, &la, &[])).map.lookup(
            Direction::Egress,
            peer,
            PROTO_TCP,
            port,
        ) {
            MapVerdict::Allowed(_) => "allowed",
            MapVerdict::Denied(_) => "denied",
            MapVerdict::NoMatch => "no match",
        };
        // b's address is not the cluster's yet: b is one of the peers no rule names (allowed).
        assert_eq!(egress(&e, b, 81), "allowed");
        assert!(e
            .networks_subjects(&["10.9.9.9/32".parse().unwrap()])
            .is_empty());
        assert_eq!(
            e.networks_subjects(&["10.0.1.7/32".parse().unwrap()]),
            [a].into(),
            "a's policy depends on 10.0.1.7"
        );
        e.upsert_endpoint_ip("10.0.1.7".parse().unwrap(), b);
        assert_eq!(egress(&e, b, 80), "allowed");
        assert_eq!(egress(&e, b, 81), "denied");
        // c has one address inside and one outside: denied by the Deny, not allowed by the Allow.
        e.upsert_endpoint_ip("10.0.1.8".parse().unwrap(), c);
        e.upsert_endpoint_ip("10.0.2.8".parse().unwrap(), c);
        assert_eq!(egress(&e, c, 80), "denied");
        let notes = e.resolve(&view(a, &la, &[])).tiers.unwrap().notes;
        assert!(
            notes.iter().any(|n| n.contains("both inside and outside")),
            "{notes:?}"
        );
        // b's address goes: b is no longer covered.
        e.remove_endpoint_ip("10.0.1.7".parse().unwrap());
        assert_eq!(egress(&e, b, 81), "allowed");
        // Without the policy, no address matters.
        e.delete_policy(&PolicyKey::new(
            PolicyKind::AdminNetworkPolicy,
            None,
            "nets",
        ));
        assert!(e
            .networks_subjects(&["10.0.1.7/32".parse().unwrap()])
            .is_empty());
    }

    /// A cluster tier's `nodes` peer covers the node identities exactly as the nodes and their
    /// labels come and go: remote nodes fall into classes by the labels `nodes` peers name, each
    /// with an identity of its own (`node_classes`), this node is `host`; node changes name the
    /// endpoints to redo and the nodes whose addresses move.
    #[test]
    fn tier_nodes_cover_the_node_identities_as_nodes_come_and_go() {
        let mut e = PolicyEngine::new();
        let la = pod("x", "a");
        let a = e.allocate_identity(&la).id();
        let node = |role: &str| -> Labels { [Label::k8s("role", role)].into_iter().collect() };
        e.set_local_node("w1");
        assert!(
            e.upsert_node_labels("w1", node("worker")).is_empty(),
            "no rule yet"
        );
        assert_eq!(e.node_identity("w1"), IDENTITY_REMOTE_NODE);
        e.upsert_policy(policy("{apiVersion: policy.networking.k8s.io/v1alpha1, kind: AdminNetworkPolicy, metadata: {name: n}, spec: {priority: 1, subject: {pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: a}}}}, egress: [{action: Allow, to: [{nodes: {matchLabels: {role: worker}}}], ports: [{portNumber: {protocol: TCP, port: 80}}]}, {action: Deny, to: [{nodes: {matchLabels: {role: worker}}}]}]}}"));
        // The policy names `role`: the workers are a class of their own.
        let worker = e.node_identity("w1");
        assert_ne!(worker, IDENTITY_REMOTE_NODE);
        assert_eq!(e.take_moved_nodes(), vec!["w1".to_string()]);
        let egress = |e: &PolicyEngine, peer, port| match e.resolve(&view(a, &la, &[])).map.lookup(
            Direction::Egress,
            peer,
            PROTO_TCP,
            port,
        ) {
            MapVerdict::Allowed(_) => "allowed",
            MapVerdict::Denied(_) => "denied",
            MapVerdict::NoMatch => "no match",
        };
        // This node is a worker: host and the workers' class are exact peers; nodes without
        // a role (remote-node) are not.
        for id in [IDENTITY_HOST, worker] {
            assert_eq!(egress(&e, id, 80), "allowed");
            assert_eq!(egress(&e, id, 81), "denied");
        }
        assert_eq!(egress(&e, IDENTITY_REMOTE_NODE, 81), "allowed");
        // A control-plane node and a second worker join: still exact, each by its class.
        let affected = e.upsert_node_labels("cp", node("control-plane"));
        assert!(affected.contains(&a), "a's policy depends on the nodes");
        assert!(
            e.upsert_node_labels("cp", node("control-plane")).is_empty(),
            "no change"
        );
        e.upsert_node_labels("w2", node("worker"));
        let cp = e.node_identity("cp");
        assert_eq!(e.node_identity("w2"), worker);
        assert!(![IDENTITY_REMOTE_NODE, worker].contains(&cp));
        assert!(
            e.take_moved_nodes().is_empty(),
            "new nodes are claimed by whoever adds them"
        );
        assert_eq!(egress(&e, worker, 80), "allowed");
        assert_eq!(egress(&e, worker, 81), "denied");
        assert_eq!(
            egress(&e, cp, 81),
            "allowed",
            "the control plane is no peer"
        );
        let notes = e.resolve(&view(a, &la, &[])).tiers.unwrap().notes;
        assert!(!notes.iter().any(|n| n.contains(".nodes:")), "{notes:?}");
        // The remote-node entity selects the class identities as it selects remote-node.
        let lb = pod("x", "b");
        let b = e.allocate_identity(&lb).id();
        e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: rn, namespace: x}, spec: {endpointSelector: {matchLabels: {app: b}}, egress: [{toEntities: [remote-node]}]}}"));
        let pb = e.resolve(&view(b, &lb, &[]));
        for id in [IDENTITY_REMOTE_NODE, worker, cp] {
            assert!(matches!(
                pb.map.lookup(Direction::Egress, id, PROTO_TCP, 1),
                MapVerdict::Allowed(_)
            ));
        }
        assert!(matches!(
            pb.map
                .lookup(Direction::Egress, IDENTITY_HOST, PROTO_TCP, 1),
            MapVerdict::NoMatch | MapVerdict::Denied(_)
        ));
        // cp relabelled a worker: its class goes, and b's policy (remote-node) is redone.
        let affected = e.upsert_node_labels("cp", node("worker"));
        assert!(
            affected.contains(&b) && affected.contains(&a),
            "{affected:?}"
        );
        assert_eq!(e.node_identity("cp"), worker);
        assert!(
            e.identities().get(cp).is_none(),
            "the class identity is released"
        );
        // The policy goes: no key left, every node is remote-node again.
        let change = e
            .delete_policy(&PolicyKey::new(PolicyKind::AdminNetworkPolicy, None, "n"))
            .unwrap();
        assert!(change.affected.contains(&b), "{:?}", change.affected);
        assert_eq!(e.node_identity("w2"), IDENTITY_REMOTE_NODE);
        assert!(e.identities().get(worker).is_none());
        assert!(e.upsert_node_labels("w1", node("gpu")).is_empty());
    }

    /// Without its own node the agent cannot tell whether `host` is selected: a Deny takes it,
    /// an Allow does not, and the endpoint says so.
    #[test]
    fn tier_nodes_fail_closed_on_host_while_the_own_node_is_unknown() {
        let mut e = PolicyEngine::new();
        let la = pod("x", "a");
        let a = e.allocate_identity(&la).id();
        let node = |role: &str| -> Labels { [Label::k8s("role", role)].into_iter().collect() };
        e.upsert_node_labels("w1", node("worker"));
        e.upsert_node_labels("cp", node("control-plane"));
        e.upsert_policy(policy("{apiVersion: policy.networking.k8s.io/v1alpha1, kind: AdminNetworkPolicy, metadata: {name: n}, spec: {priority: 1, subject: {pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: a}}}}, egress: [{action: Deny, to: [{nodes: {matchLabels: {role: worker}}}]}]}}"));
        let p = e.resolve(&view(a, &la, &[]));
        let denied = |id| {
            matches!(
                p.map.lookup(Direction::Egress, id, PROTO_TCP, 80),
                MapVerdict::Denied(_)
            )
        };
        assert!(denied(IDENTITY_HOST) && denied(e.node_identity("w1")));
        assert!(!denied(e.node_identity("cp")));
        let notes = p.tiers.unwrap().notes;
        assert!(
            notes.iter().any(|n| n.contains("selects 1 of the 2 nodes")
                && n.contains("own node")
                && n.contains("fail closed")),
            "{notes:?}"
        );
    }

    #[test]
    fn endpoints_of_the_same_tier_inputs_share_one_compilation_and_changes_still_show() {
        let mut e = PolicyEngine::new();
        let (la, lb) = (pod("x", "a"), pod("x", "b"));
        let (a, b) = (e.allocate_identity(&la).id(), e.allocate_identity(&lb).id());
        e.upsert_policy(policy("{apiVersion: policy.networking.k8s.io/v1alpha2, kind: ClusterNetworkPolicy, metadata: {name: c}, spec: {tier: Admin, priority: 1, subject: {namespaces: {}}, ingress: [{name: r, action: Deny, from: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: z}}}}], protocols: [{tcp: {destinationPort: {number: 80}}}]}]}}"));
        let pa = e.resolve(&view(a, &la, &[]));
        let pb = e.resolve(&view(b, &lb, &[]));
        assert_eq!(pa.map, pb.map, "the same inputs, the same entries");
        let (hits, misses, _) = e.tier_memo_stats();
        assert_eq!(
            (hits, misses),
            (1, 1),
            "ingress compiled once (no egress tier rules)"
        );
        // A peer appears: both see it (different inputs, compiled anew).
        let lz = pod("y", "z");
        let z = e.allocate_identity(&lz).id();
        for (id, l) in [(a, &la), (b, &lb)] {
            let p = e.resolve(&view(id, l, &[]));
            assert!(matches!(
                p.map.lookup(Direction::Ingress, z, PROTO_TCP, 80),
                MapVerdict::Denied(_)
            ));
            assert_eq!(
                p.map,
                e.clone().resolve(&view(id, l, &[])).map,
                "as without the memo"
            );
        }
    }

    /// A tier rule whose peers are all unknown fields matches nothing when it allows and
    /// everyone when it denies (fail closed both ways); the two never take each other's peers.
    #[test]
    fn a_rule_matching_no_peer_and_one_matching_every_peer_stay_apart() {
        let mut e = PolicyEngine::new();
        let (la, lz) = (pod("x", "a"), pod("y", "z"));
        let a = e.allocate_identity(&la).id();
        let z = e.allocate_identity(&lz).id();
        // Allow from a peer of no known field (no peer), then Deny from one (every peer).
        e.upsert_policy(policy("{apiVersion: policy.networking.k8s.io/v1alpha2, kind: ClusterNetworkPolicy, metadata: {name: c1}, spec: {tier: Admin, priority: 1, subject: {namespaces: {}}, ingress: [{name: r, action: Accept, from: [{futurePeer: {}}]}]}}"));
        e.upsert_policy(policy("{apiVersion: policy.networking.k8s.io/v1alpha2, kind: ClusterNetworkPolicy, metadata: {name: c2}, spec: {tier: Admin, priority: 2, subject: {namespaces: {}}, ingress: [{name: r, action: Deny, from: [{futurePeer: {}}]}]}}"));
        let p = e.resolve(&view(a, &la, &[]));
        let v = p.map.lookup(Direction::Ingress, z, PROTO_TCP, 80);
        let denied = matches!(v, MapVerdict::Denied(_))
            || (matches!(v, MapVerdict::NoMatch) && !p.ingress.isolated_by.is_empty());
        assert!(denied, "c2 denies every peer: {v:?}");
    }

    /// Endpoints selected by the same tier policies share their resolved rules only when
    /// their named ports are the same too.
    #[test]
    fn a_tier_rule_s_named_port_is_each_endpoint_s_own() {
        let mut e = PolicyEngine::new();
        let (la, lb, lz) = (pod("x", "a"), pod("x", "b"), pod("y", "z"));
        let a = e.allocate_identity(&la).id();
        let b = e.allocate_identity(&lb).id();
        let z = e.allocate_identity(&lz).id();
        e.upsert_policy(policy("{apiVersion: policy.networking.k8s.io/v1alpha2, kind: ClusterNetworkPolicy, metadata: {name: c}, spec: {tier: Admin, priority: 1, subject: {namespaces: {}}, ingress: [{name: r, action: Deny, from: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: z}}}}], protocols: [{destinationNamedPort: web}]}]}}"));
        let port = |p: u16| NamedPort {
            name: "web".into(),
            protocol: PROTO_TCP,
            port: p,
        };
        let (pa, pb) = ([port(8080)], [port(9090)]);
        for _ in 0..2 {
            let ra = e.resolve(&view(a, &la, &pa));
            let rb = e.resolve(&view(b, &lb, &pb));
            for (r, denied, open) in [(&ra, 8080, 9090), (&rb, 9090, 8080)] {
                assert!(matches!(
                    r.map.lookup(Direction::Ingress, z, PROTO_TCP, denied),
                    MapVerdict::Denied(_)
                ));
                assert!(!matches!(
                    r.map.lookup(Direction::Ingress, z, PROTO_TCP, open),
                    MapVerdict::Denied(_)
                ));
            }
        }
    }

    #[test]
    fn a_query_the_admin_tier_accepts_is_not_judged_by_network_policy_dns_rules() {
        use super::super::l7::dns::{dns_ruling, DnsRuling};
        let mut e = PolicyEngine::new();
        let (la, ld) = (pod("x", "a"), pod("kube-system", "kube-dns"));
        let (a, dns) = (e.allocate_identity(&la).id(), e.allocate_identity(&ld).id());
        e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x}, spec: {endpointSelector: {matchLabels: {app: a}}, egress: [{toEndpoints: [{matchLabels: {k8s:io.kubernetes.pod.namespace: kube-system, app: kube-dns}}], toPorts: [{ports: [{port: '53', protocol: UDP}], rules: {dns: [{matchPattern: '*.example.com'}]}}]}]}}"));
        let ruling = |e: &PolicyEngine, name: &str| {
            dns_ruling(&e.resolve(&view(a, &la, &[])).dns, dns, 17, 53, name)
        };
        assert!(matches!(ruling(&e, "evil.test."), DnsRuling::Refuse(_)));
        let anp = |action: &str| {
            policy(&format!("{{apiVersion: policy.networking.k8s.io/v1alpha1, kind: AdminNetworkPolicy, metadata: {{name: dns}}, spec: {{priority: 1, subject: {{pods: {{namespaceSelector: {{}}, podSelector: {{matchLabels: {{app: a}}}}}}}}, egress: [{{name: dns, action: {action}, to: [{{pods: {{namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: kube-system}}}}, podSelector: {{matchLabels: {{app: kube-dns}}}}}}}}], ports: [{{portNumber: {{protocol: UDP, port: 53}}}}]}}]}}}}"))
        };
        // Accepted by the Admin tier: any name, and the Admin rule decided it.
        e.upsert_policy(anp("Allow"));
        match ruling(&e, "evil.test.") {
            DnsRuling::Forward(by) => assert!(by[0].contains("AdminNetworkPolicy"), "{by:?}"),
            r => panic!("{r:?}"),
        }
        // Passed on: the NetworkPolicy tier decides, with its DNS rules.
        e.upsert_policy(anp("Pass"));
        assert!(matches!(ruling(&e, "evil.test."), DnsRuling::Refuse(_)));
        assert!(matches!(
            ruling(&e, "api.example.com."),
            DnsRuling::Forward(_)
        ));
    }

    /// A staged policy (`policy.ciliate.io/mode: audit`) is resolved only for the staged
    /// verdict: the policy in force ignores it, `resolve_staged` enforces it with the rest, and
    /// `judge` reports the verdicts it would change with the policies that would decide them.
    /// Staged again as enforced, and deleted, it leaves nothing staged behind.
    #[test]
    fn a_staged_policy_is_resolved_for_the_staged_verdict_only() {
        let mut e = PolicyEngine::new();
        let (la, lb, lc) = (pod("x", "a"), pod("x", "b"), pod("x", "c"));
        let a = e.allocate_identity(&la).id();
        let b = e.allocate_identity(&lb).id();
        let c = e.allocate_identity(&lc).id();
        let cnp = |mode: &str| {
            policy(&format!("{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: b-from-a, namespace: x{mode}}}, spec: {{endpointSelector: {{matchLabels: {{app: b}}}}, ingress: [{{fromEndpoints: [{{matchLabels: {{app: a}}}}], toPorts: [{{ports: [{{port: '80', protocol: TCP}}]}}]}}]}}}}"))
        };
        // An enforced deny that isolates nothing: b's staged view keeps what is in force too.
        e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: deny-c, namespace: x}, spec: {endpointSelector: {matchLabels: {app: b}}, enableDefaultDeny: {ingress: false}, ingressDeny: [{fromEndpoints: [{matchLabels: {app: c}}], toPorts: [{ports: [{port: '443', protocol: TCP}]}]}]}}"));
        assert!(!e.has_staged());
        assert!(e.resolve_staged(&view(b, &lb, &[])).is_none());
        let change = e.upsert_policy(cnp(", annotations: {policy.ciliate.io/mode: audit}"));
        assert_eq!(change.affected, [b].into(), "b's staged view changes");
        assert!(e.has_staged());
        let in_force = e.resolve(&view(b, &lb, &[]));
        assert!(
            in_force.ingress.isolated_by.is_empty()
                && in_force
                    .decide(Direction::Ingress, c, PROTO_TCP, 80)
                    .is_allowed(),
            "the staged policy isolates nothing"
        );
        assert!(!in_force
            .decide(Direction::Ingress, c, PROTO_TCP, 443)
            .is_allowed());
        // a is selected by no staged policy: no staged view.
        assert!(e.resolve_staged(&view(a, &la, &[])).is_none());
        let staged = e
            .resolve_staged(&view(b, &lb, &[]))
            .expect("b's staged view");
        let key = PolicyKey::new(PolicyKind::CiliumNetworkPolicy, Some("x"), "b-from-a");
        assert_eq!(staged.staged.len(), 1);
        assert_eq!(*staged.staged[0], key);
        // c on 80: allowed now, dropped staged (default deny by the staged policy).
        let ch = staged
            .judge(Direction::Ingress, c, PROTO_TCP, 80, true)
            .expect("the staged drop");
        assert_eq!(ch.verdict.verdict, "dropped");
        assert_eq!(ch.verdict.policies.len(), 1);
        assert!(ch.verdict.policies[0].names(&key));
        assert_eq!(ch.responsible.len(), 1);
        // a on 80: allowed both ways; c on 443: denied both ways (by the enforced deny).
        assert!(staged
            .judge(Direction::Ingress, a, PROTO_TCP, 80, true)
            .is_none());
        assert!(staged
            .judge(Direction::Ingress, c, PROTO_TCP, 443, false)
            .is_none());
        // A flow dropped now that the staged policies would let through is reported too.
        let ch = staged
            .judge(Direction::Ingress, a, PROTO_TCP, 80, false)
            .expect("the staged allow");
        assert_eq!(ch.verdict.verdict, "forwarded");
        assert_eq!(ch.verdict.policies[0].rule, Some(0));
        // Enforced as staged: the same verdicts, now in force, and nothing staged.
        e.upsert_policy(cnp(", annotations: {policy.ciliate.io/mode: enforce}"));
        assert!(!e.has_staged());
        assert!(e.resolve_staged(&view(b, &lb, &[])).is_none());
        let enforced = e.resolve(&view(b, &lb, &[]));
        assert!(!enforced
            .decide(Direction::Ingress, c, PROTO_TCP, 80)
            .is_allowed());
        assert!(enforced
            .decide(Direction::Ingress, a, PROTO_TCP, 80)
            .is_allowed());
        // Staged again, then deleted: nothing staged.
        e.upsert_policy(cnp(", annotations: {policy.ciliate.io/mode: audit}"));
        assert!(e.has_staged());
        e.delete_policy(&key).unwrap();
        assert!(!e.has_staged());
    }

    #[test]
    fn change_reports_old_and_new_subjects() {
        let mut e = PolicyEngine::new();
        let (la, lb) = (pod("x", "a"), pod("x", "b"));
        let a = e.allocate_identity(&la).id();
        let b = e.allocate_identity(&lb).id();
        let c1 = e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x}, spec: {endpointSelector: {matchLabels: {app: a}}, ingress: [{}]}}"));
        assert_eq!(c1.revision, 1);
        assert_eq!(c1.affected, [a].into());
        // Moving the policy from a to b affects both.
        let c2 = e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x}, spec: {endpointSelector: {matchLabels: {app: b}}, ingress: [{}]}}"));
        assert_eq!((c2.revision, c2.affected.clone()), (2, [a, b].into()));
        assert!(e.resolve(&view(a, &la, &[])).ingress.isolated_by.is_empty());
        assert_eq!(e.resolve(&view(b, &lb, &[])).ingress.isolated_by.len(), 1);
        let c3 = e
            .delete_policy(&PolicyKey::new(
                PolicyKind::CiliumNetworkPolicy,
                Some("x"),
                "p",
            ))
            .unwrap();
        assert_eq!((c3.revision, c3.affected), (3, [b].into()));
        assert!(e
            .delete_policy(&PolicyKey::new(
                PolicyKind::CiliumNetworkPolicy,
                Some("x"),
                "p"
            ))
            .is_none());
        // Nothing leaks: every selector released.
        assert!(e.selector_cache().is_empty());
    }

    #[test]
    fn to_fqdns_selects_the_addresses_learned_for_matching_names_until_they_are_forgotten() {
        let mut e = PolicyEngine::new();
        let la = pod("x", "a");
        let a = e.allocate_identity(&la).id();
        e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x}, spec: {endpointSelector: {matchLabels: {app: a}}, egress: [{toFQDNs: [{matchName: api.example.com}, {matchPattern: '*.cdn.example.com'}], toPorts: [{ports: [{port: '443', protocol: TCP}]}]}]}}"));
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let allowed = |e: &PolicyEngine, addr: &str, port: u16| {
            let pol = e.resolve(&view(a, &la, &[]));
            pol.decide(
                Direction::Egress,
                e.identity_of_ip(ip(addr)),
                PROTO_TCP,
                port,
            )
            .is_allowed()
        };
        // Nothing learned yet: the rule selects nothing (fail closed).
        assert!(!allowed(&e, "203.0.113.10", 443));
        // Case and the trailing dot do not matter; the endpoint a is affected.
        let c = e.learn_fqdn("API.example.com.", &[ip("203.0.113.10")]);
        assert!(c.affected.contains(&a), "{c:?}");
        // The incremental resolution of the re-selected peers is the full one's part.
        assert_eq!(c.peers.len(), 1, "{c:?}");
        let v = view(a, &la, &[]);
        let part = e.resolve_peers(&v, Some(&c.peers));
        assert_eq!(part.map, e.resolve(&v).map.of_peers(&c.peers));
        assert_eq!(part.map.len(), 1);
        assert_eq!(part.dns, e.resolve(&v).dns);
        assert!(allowed(&e, "203.0.113.10", 443));
        assert!(!allowed(&e, "203.0.113.10", 80), "only the rule's port");
        assert!(
            !allowed(&e, "203.0.113.11", 443),
            "an address no name resolved to"
        );
        // A pattern: one label only.
        e.learn_fqdn("img.cdn.example.com", &[ip("203.0.113.20")]);
        e.learn_fqdn("a.b.cdn.example.com", &[ip("203.0.113.21")]);
        e.learn_fqdn("evil.test", &[ip("203.0.113.22")]);
        assert!(allowed(&e, "203.0.113.20", 443));
        assert!(!allowed(&e, "203.0.113.21", 443) && !allowed(&e, "203.0.113.22", 443));
        // Two names on one address: forgetting one keeps what the other selects.
        e.learn_fqdn("evil.test", &[ip("203.0.113.10")]);
        e.forget_fqdn("evil.test", ip("203.0.113.10"));
        assert!(allowed(&e, "203.0.113.10", 443));
        let c = e.forget_fqdn("api.example.com", ip("203.0.113.10"));
        assert!(
            c.affected.contains(&a) && c.removed_prefixes.len() == 1,
            "{c:?}"
        );
        assert!(!allowed(&e, "203.0.113.10", 443));
        assert_eq!(e.identity_of_ip(ip("203.0.113.10")), IDENTITY_WORLD_IPV4);
    }

    #[test]
    fn only_names_a_to_fqdns_selector_matches_get_identities_and_follow_the_selectors() {
        let mut e = PolicyEngine::new();
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let (ids, ipcache) = (e.identities().len(), e.ipcache().len());
        // No policy names it: a flood of names costs no identity and no ipcache entry.
        for i in 0..100 {
            let c = e.learn_selected_fqdn(&format!("n{i}.flood.test"), &[ip("198.51.100.1")]);
            assert!(c.affected.is_empty() && c.new_prefixes.is_empty());
        }
        assert_eq!((e.identities().len(), e.ipcache().len()), (ids, ipcache));
        assert!(e.fqdn_names_of(ip("198.51.100.1")).is_none());
        let g = e.fqdn_generation();
        let la = pod("x", "a");
        let a = e.allocate_identity(&la).id();
        e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x}, spec: {endpointSelector: {matchLabels: {app: a}}, egress: [{toFQDNs: [{matchPattern: '*.example.com'}]}]}}"));
        assert_ne!(e.fqdn_generation(), g, "a toFQDNs selector arrived");
        // The cache's names a selector now matches are learned; the others are not.
        let cached = vec![
            ("api.example.com".to_string(), vec![ip("203.0.113.10")]),
            ("n1.flood.test".to_string(), vec![ip("198.51.100.1")]),
        ];
        let c = e.resync_fqdn(&cached);
        assert!(
            c.affected.contains(&a) && c.new_prefixes.len() == 1,
            "{c:?}"
        );
        assert!(e.fqdn_names_of(ip("203.0.113.10")).is_some());
        assert!(e.fqdn_names_of(ip("198.51.100.1")).is_none());
        assert!(e.fqdn_selected("API.example.com.") && !e.fqdn_selected("n1.flood.test"));
        let c = e.learn_selected_fqdn("www.example.com", &[ip("203.0.113.11")]);
        assert_eq!(c.new_prefixes.len(), 1);
        // The policy goes: its names are forgotten, their identities and entries with them.
        let g = e.fqdn_generation();
        e.delete_policy(&PolicyKey::new(
            PolicyKind::CiliumNetworkPolicy,
            Some("x"),
            "p",
        ));
        assert_ne!(e.fqdn_generation(), g);
        let c = e.resync_fqdn(&cached);
        assert_eq!(c.removed_prefixes.len(), 2, "{c:?}");
        assert_eq!(e.identity_of_ip(ip("203.0.113.10")), IDENTITY_WORLD_IPV4);
        assert_eq!(
            (e.identities().len(), e.ipcache().len()),
            (ids + 1, ipcache)
        );
    }

    #[test]
    fn cidr_identities_live_as_long_as_a_policy_uses_them() {
        let mut e = PolicyEngine::new();
        let la = pod("x", "a");
        let a = e.allocate_identity(&la).id();
        let c = e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x}, spec: {endpointSelector: {}, egress: [{toCIDRSet: [{cidr: 192.0.2.0/24, except: [192.0.2.128/25]}]}]}}"));
        assert_eq!(c.new_identities.len(), 2);
        let inside = e.identity_of_ip("192.0.2.1".parse().unwrap());
        let carved = e.identity_of_ip("192.0.2.200".parse().unwrap());
        assert!(inside != carved && inside != IDENTITY_WORLD_IPV4);
        let pol = e.resolve(&view(a, &la, &[]));
        assert!(pol
            .decide(Direction::Egress, inside, PROTO_TCP, 443)
            .is_allowed());
        assert!(!pol
            .decide(Direction::Egress, carved, PROTO_TCP, 443)
            .is_allowed());
        assert!(!pol
            .decide(Direction::Egress, IDENTITY_WORLD_IPV4, PROTO_TCP, 443)
            .is_allowed());
        e.delete_policy(&PolicyKey::new(
            PolicyKind::CiliumNetworkPolicy,
            Some("x"),
            "p",
        ));
        assert_eq!(
            e.identity_of_ip("192.0.2.1".parse().unwrap()),
            IDENTITY_WORLD_IPV4
        );
        assert!(e
            .identities()
            .lookup_cidr(&"192.0.2.0/24".parse().unwrap())
            .is_none());
    }

    #[test]
    fn egress_named_ports_resolve_against_each_peer() {
        let mut e = PolicyEngine::new();
        let (la, lb, lc) = (pod("x", "a"), pod("x", "b"), pod("x", "c"));
        let a = e.allocate_identity(&la).id();
        let b = e.allocate_identity(&lb).id();
        let c = e.allocate_identity(&lc).id();
        e.add_named_ports(
            b,
            &[NamedPort {
                name: "dns".into(),
                protocol: PROTO_UDP,
                port: 53,
            }],
        );
        e.add_named_ports(
            c,
            &[NamedPort {
                name: "dns".into(),
                protocol: PROTO_UDP,
                port: 5353,
            }],
        );
        e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x}, spec: {endpointSelector: {matchLabels: {app: a}}, egress: [{toEndpoints: [{}], toPorts: [{ports: [{port: dns, protocol: UDP}]}]}]}}"));
        let pol = e.resolve(&view(a, &la, &[]));
        assert!(pol.decide(Direction::Egress, b, PROTO_UDP, 53).is_allowed());
        assert!(!pol
            .decide(Direction::Egress, b, PROTO_UDP, 5353)
            .is_allowed());
        assert!(pol
            .decide(Direction::Egress, c, PROTO_UDP, 5353)
            .is_allowed());
        assert!(!pol
            .decide(Direction::Egress, c, PROTO_TCP, 5353)
            .is_allowed());
    }

    #[test]
    fn a_new_peer_identity_affects_the_endpoints_whose_rules_select_it() {
        let mut e = PolicyEngine::new();
        let la = pod("x", "a");
        let a = e.allocate_identity(&la).id();
        e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x}, spec: {endpointSelector: {matchLabels: {app: a}}, ingress: [{fromEndpoints: [{matchLabels: {role: client}}]}]}}"));
        let mut lc = pod("x", "c");
        lc.insert(Label::k8s("role", "client"));
        let c = e.allocate_identity(&lc).id();
        assert_eq!(e.endpoints_affected_by_identity(c), [a].into());
        assert!(e
            .resolve(&view(a, &la, &[]))
            .decide(Direction::Ingress, c, PROTO_TCP, 1)
            .is_allowed());
        assert!(e.release_identity(c));
        assert!(!e
            .resolve(&view(a, &la, &[]))
            .decide(Direction::Ingress, c, PROTO_TCP, 1)
            .is_allowed());
    }

    #[test]
    fn requirements_narrow_their_own_kind_of_rule_across_policies_and_kinds() {
        let mut e = PolicyEngine::new();
        let la = pod("x", "a");
        let a = e.allocate_identity(&la).id();
        let mut lb = pod("x", "b");
        lb.insert(Label::k8s("group", "A"));
        let b = e.allocate_identity(&lb).id();
        let c = e.allocate_identity(&pod("x", "c")).id();
        // A KNP allow from every pod of x and from a CIDR; a CNP deny of app=c.
        e.upsert_policy(policy("{apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, metadata: {name: k, namespace: x}, spec: {podSelector: {matchLabels: {app: a}}, ingress: [{from: [{ipBlock: {cidr: 192.0.2.0/24}}, {podSelector: {}}]}]}}"));
        e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: d, namespace: x}, spec: {endpointSelector: {matchLabels: {app: a}}, ingressDeny: [{fromEndpoints: [{matchLabels: {app: c}}]}]}}"));
        let change = e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: r, namespace: x}, spec: {endpointSelector: {matchLabels: {app: a}}, ingress: [{fromRequires: [{matchLabels: {group: A}}]}]}}"));
        assert!(change.affected.contains(&a));
        let cidr = e.identity_of_ip("192.0.2.1".parse().unwrap());
        let pol = e.resolve(&view(a, &la, &[]));
        let ing = |id| pol.decide(Direction::Ingress, id, PROTO_TCP, 80);
        // The KNP's pod peer is narrowed to group=A, its ipBlock peer is not.
        assert!(ing(b).is_allowed());
        assert!(ing(cidr).is_allowed());
        // The allow requirement does not narrow the deny: c is still denied by it.
        assert!(matches!(ing(c), Decision::Denied(_)));
        // A peer that only the requirement keeps out is explained by it.
        let d = e.allocate_identity(&pod("x", "d")).id();
        let pol = e.resolve(&view(a, &la, &[]));
        match pol.decide(Direction::Ingress, d, PROTO_TCP, 80) {
            Decision::DefaultDenied { withheld_by, .. } => {
                let names: Vec<String> = withheld_by.iter().map(|r| r.describe()).collect();
                assert_eq!(
                    names,
                    vec!["CiliumNetworkPolicy x/r requires group=A".to_string()]
                );
            }
            other => panic!("want a default deny, got {other:?}"),
        }
        // A deny requirement narrows the denies only: c is denied only when it is group=A.
        e.upsert_policy(policy("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: d, namespace: x}, spec: {endpointSelector: {matchLabels: {app: a}}, ingressDeny: [{fromEndpoints: [{}]}, {fromRequires: [{matchLabels: {group: A}}]}]}}"));
        let pol = e.resolve(&view(a, &la, &[]));
        assert!(matches!(
            pol.decide(Direction::Ingress, b, PROTO_TCP, 80),
            Decision::Denied(_)
        ));
        assert!(!matches!(
            pol.decide(Direction::Ingress, c, PROTO_TCP, 80),
            Decision::Denied(_)
        ));
    }
}
