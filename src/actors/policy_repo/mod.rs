//! `PolicyRepoActor`: Cilium's `policy.Repository` + `Daemon.policyAdd` + the identity allocator.
//! The only writer of the policy engine. It turns watch events (policies, pods, namespaces,
//! nodes) into engine changes, works out which endpoints each change affects, and hands one
//! `PolicyReaction` per change to `RuleReactionActor`. It also owns the endpoint registry:
//! endpoints are created and deleted here, so identities and IPs have one owner.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Instant;

use actix::{Actor, Context, Handler, Message};
use serde::Serialize;

use super::endpoint::{Delete, EndpointActor, EndpointModel, Regenerate, SetAudit, SetIdentity};
use super::loader::{IpcacheChange, LoaderActor};
use super::rule_reaction::{EndpointHandle, PolicyReaction, RuleReactionActor};
use crate::datapath::events::Notification;
use crate::datapath::EndpointId;
use crate::endpoint::registry::{Admission, Entry, Refusal, Registry};
use crate::endpoint::state::EndpointRecord;
use crate::introspect::TracedAddr;
use crate::objects::index::{ClusterIndex, IndexChange};
use crate::objects::{NamespaceInfo, NodeInfo, PodInfo};
use crate::policy::engine::{NamedPort, PolicyEngine};
use crate::policy::identity::{reserved_name, Allocation, NumericIdentity};
use crate::policy::labels::{Label, Labels};
use crate::policy::rule::PolicyKey;
use crate::policy::status::PolicyRecords;
use crate::policy::translate::ParsedPolicy;
use crate::runtime::Shared;
use crate::traced_actor;

mod endpoints;
mod fqdn;
mod host;
mod numbering;
mod objects;
mod policies;
mod views;

pub use endpoints::{
    AddEndpoint, ConfigureEndpoint, DeleteEndpoint, FindEndpoint, ListEndpoints,
    ListPodlessEndpoints, Shutdown,
};
pub use fqdn::{ExpireFqdn, LearnFqdn, RestoreFqdn};
pub use host::AddHostEndpoint;
pub use numbering::RestoreNumbering;
pub use objects::{
    DeviceAddresses, InitialSyncDone, NamespaceDelete, NamespaceUpsert, NodeDelete, NodeUpsert,
    PodDelete, PodUpsert, PodsUpsert,
};
pub use policies::{ManifestStatus, PolicyDelete, PolicyRejected, PolicyUpsert};
pub use views::{GetIdentities, GetIpcacheView, GetPolicies, RegenerateAll};

const NAME: &str = "PolicyRepoActor";

/// API-level failures, mapped to HTTP status codes by the API server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize)]
pub enum ApiError {
    #[error("not found: {0}")]
    NotFound(String),
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// A request to create an endpoint (from the CLI or the CNI plugin).
#[derive(Debug, Clone, Default, serde::Deserialize, Serialize)]
pub struct EndpointRequest {
    /// `namespace/pod`.
    pub name: String,
    pub ips: Vec<IpAddr>,
    pub interface: Option<String>,
    pub container_id: Option<String>,
    pub netns: Option<String>,
    /// The pod interface's MAC (`aa:bb:..`), when the CNI plugin made it: BPF host routing
    /// delivers packets into the pod with it.
    #[serde(default)]
    pub mac: Option<String>,
}

pub use crate::policy::status::PolicyStatus;

/// The ipcache entries a policy change adds (its new CIDR identities) and removes.
/// A policy as monitor notifications name it.
fn policy_ref(key: &PolicyKey) -> crate::policy::attribution::PolicyRef {
    crate::policy::attribution::PolicyRef {
        kind: key.kind.as_str().to_string(),
        namespace: key.namespace.clone(),
        name: key.name.clone(),
        rule: None,
        http: None,
        tier: crate::policy::attribution::PolicyTier::of_kind(key.kind),
    }
}

fn ipcache_of(change: &crate::policy::engine::PolicyChange) -> Vec<IpcacheChange> {
    change
        .new_prefixes
        .iter()
        .map(|(p, id)| IpcacheChange::Upsert(*p, *id))
        .chain(
            change
                .removed_prefixes
                .iter()
                .map(|p| IpcacheChange::Remove(*p)),
        )
        .collect()
}

/// `/debug/policy`.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyOverview {
    pub revision: u64,
    pub policies: Vec<PolicyStatus>,
    /// Manifest files that could not be read, with the error (their last good objects stay).
    pub manifest_errors: BTreeMap<String, String>,
    /// Recent policy changes and how long each took to be enforced everywhere it applies.
    pub recent_implementations: Vec<crate::runtime::Implementation>,
}

/// `/debug/identities`.
#[derive(Debug, Clone, Serialize)]
pub struct IdentityModel {
    pub id: NumericIdentity,
    pub labels: Vec<String>,
    pub kind: &'static str,
}

/// `/debug/ipcache`.
#[derive(Debug, Clone, Serialize)]
pub struct IpcacheModel {
    pub prefix: String,
    pub identity: NumericIdentity,
}

/// What one change asks of the endpoints, sent as one `PolicyReaction` by `react`.
#[derive(Debug)]
struct Reaction {
    reason: String,
    accepted_at: Instant,
    /// Endpoint identities whose policy changed: their endpoints regenerate.
    affected: BTreeSet<NumericIdentity>,
    /// Endpoints that regenerate whatever their identity.
    extra: Vec<EndpointId>,
    /// Regenerate even when the computed policy did not change.
    force: bool,
    ipcache: Vec<IpcacheChange>,
    /// A policy change: the other endpoints bump their revision, and the implementation delay
    /// is observed.
    policy_change: bool,
    /// The monitor notification of a policy change (`added`, `updated`, `deleted`), sent with
    /// the number of endpoints it regenerates.
    notice: Option<(&'static str, PolicyKey)>,
    /// Only these peer identities' selections changed: endpoints may update incrementally.
    peers: Option<BTreeSet<NumericIdentity>>,
    /// A DNS answer waits: no quiet window, and tell it when realized.
    immediate: bool,
    done: Option<tokio::sync::oneshot::Sender<()>>,
    /// Many rules went: the freed heap goes back to the system once realized.
    release_memory: bool,
}

/// Rules a policy change must drop for its reaction to hand the freed heap back to the system
/// (glibc keeps it otherwise: a 50,000-rule policy added and removed left 400 MB of RSS).
const RELEASE_MEMORY_RULES: usize = 1_000;

impl Reaction {
    fn new(reason: impl Into<String>) -> Reaction {
        Reaction {
            reason: reason.into(),
            accepted_at: Instant::now(),
            affected: BTreeSet::new(),
            extra: Vec::new(),
            force: false,
            ipcache: Vec::new(),
            policy_change: false,
            notice: None,
            peers: None,
            immediate: false,
            done: None,
            release_memory: false,
        }
    }
    /// `rules` rules were dropped: past `RELEASE_MEMORY_RULES`, release the freed memory.
    fn dropping(mut self, rules: usize) -> Self {
        self.release_memory = rules >= RELEASE_MEMORY_RULES;
        self
    }
    /// The change only re-selected `peers` (see `PolicyChange::peers`).
    fn only_peers(mut self, peers: BTreeSet<NumericIdentity>) -> Self {
        self.peers = Some(peers);
        self
    }
    /// At once (no quiet window), telling `done` when realized in the datapath.
    fn waited_for(mut self, done: tokio::sync::oneshot::Sender<()>) -> Self {
        self.immediate = true;
        self.done = Some(done);
        self
    }
    fn at(mut self, t: Instant) -> Self {
        self.accepted_at = t;
        self
    }
    fn affecting(mut self, ids: impl IntoIterator<Item = NumericIdentity>) -> Self {
        self.affected.extend(ids);
        self
    }
    fn regenerating(mut self, ids: impl IntoIterator<Item = EndpointId>) -> Self {
        self.extra.extend(ids);
        self
    }
    fn forced(self) -> Self {
        self.force(true)
    }
    fn force(mut self, force: bool) -> Self {
        self.force = force;
        self
    }
    fn ipcache(mut self, changes: Vec<IpcacheChange>) -> Self {
        self.ipcache = changes;
        self
    }
    fn notify(mut self, action: &'static str, key: &PolicyKey) -> Self {
        self.notice = Some((action, key.clone()));
        self
    }
    fn policy_change(self) -> Self {
        self.policy_change_if(true)
    }
    fn policy_change_if(mut self, yes: bool) -> Self {
        self.policy_change = yes;
        self
    }
}

pub struct PolicyRepoActor {
    shared: Shared,
    loader: TracedAddr<LoaderActor>,
    reaction: TracedAddr<RuleReactionActor>,
    /// Pods, namespaces and nodes -> identities and ipcache (`objects::index`).
    index: ClusterIndex,
    /// This node's endpoints (`endpoint::registry`): admission, ids, records.
    endpoints: Registry<TracedAddr<EndpointActor>>,
    /// What became of each policy, and unreadable manifest files (`policy::status`).
    statuses: PolicyRecords,
    initial_sync_done: bool,
    /// The FQDN cache changed since it was last saved.
    fqdn_dirty: bool,
    /// Until the initial sync is done: the ipcache changes of every object, in order (sent
    /// with the initial regeneration).
    sync_ipcache: std::cell::RefCell<Vec<IpcacheChange>>,
    /// The identity-number journal (`endpoint::numbering`), once start-up handed it over.
    numbers: std::cell::RefCell<Option<crate::endpoint::numbering::NumberJournal>>,
    /// The kernel's ipcache as a previous run left it, until the initial sync is done.
    kernel_ipcache: Vec<(ipnet::IpNet, NumericIdentity)>,
    /// The arbiters the endpoint actors run on (`actors::workers`): they regenerate in parallel.
    workers: crate::actors::workers::Workers,
}

impl PolicyRepoActor {
    pub fn new(
        shared: Shared,
        loader: TracedAddr<LoaderActor>,
        reaction: TracedAddr<RuleReactionActor>,
    ) -> Self {
        PolicyRepoActor {
            index: ClusterIndex::for_node(&shared.node_name),
            shared,
            loader,
            reaction,
            endpoints: Registry::default(),
            statuses: PolicyRecords::default(),
            initial_sync_done: false,
            fqdn_dirty: false,
            sync_ipcache: Default::default(),
            numbers: Default::default(),
            kernel_ipcache: Vec::new(),
            workers: Default::default(),
        }
    }

    fn engine_mut(&self) -> std::sync::RwLockWriteGuard<'_, PolicyEngine> {
        match self.shared.engine.write() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Applies a change to the cluster index, on the engine.
    fn indexed<R>(&mut self, f: impl FnOnce(&mut ClusterIndex, &mut PolicyEngine) -> R) -> R {
        let engine = self.shared.engine.clone();
        let mut guard = match engine.write() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut self.index, &mut guard)
    }

    fn engine(&self) -> std::sync::RwLockReadGuard<'_, PolicyEngine> {
        match self.shared.engine.read() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn update_gauges(&self) {
        let e = self.engine();
        self.shared.metrics.policy_revision.set(e.revision() as i64);
        self.shared
            .metrics
            .identities
            .set(e.identities().len() as i64);
        self.shared
            .metrics
            .endpoints
            .set(self.endpoints.len() as i64);
        let rejected = self.statuses.rejected_count();
        self.shared.metrics.policies_rejected.set(rejected as i64);
    }

    /// Sends one reaction: its endpoints regenerate, the others bump (policy changes only).
    fn react(&self, mut r: Reaction) {
        self.journal_numbers();
        // Cluster tiers' `networks` follow the cluster's addresses.
        if !r.ipcache.is_empty() {
            let nets: Vec<ipnet::IpNet> = r
                .ipcache
                .iter()
                .map(|c| match c {
                    IpcacheChange::Upsert(n, _) | IpcacheChange::Remove(n) => *n,
                })
                .collect();
            r.affected.extend(self.engine().networks_subjects(&nets));
        }
        let revision = self.engine().revision();
        if !self.initial_sync_done && r.done.is_none() {
            // The initial sync regenerates nothing yet: its ipcache changes go to the datapath
            // in one batch with the initial regeneration, not one reaction per object.
            if let Some((action, key)) = &r.notice {
                let _ = self.shared.notifications.send(Notification::policy(
                    action,
                    policy_ref(key),
                    Some(revision),
                    Some(0),
                    None,
                ));
            }
            let mut held = self.sync_ipcache.borrow_mut();
            held.extend(r.ipcache);
            if held.len() >= objects::SYNC_IPCACHE_CHUNK {
                // Released as it fills, so the datapath writes overlap the sync.
                let ipcache = std::mem::take(&mut *held);
                drop(held);
                self.send_reaction(revision, "initial sync (ipcache)".into(), ipcache);
            }
            return;
        }
        let (mut to_regenerate, mut to_bump): (Vec<EndpointHandle>, Vec<EndpointHandle>) =
            (vec![], vec![]);
        if self.initial_sync_done {
            let host_hit = self.host_hit(
                r.policy_change,
                !r.affected.is_empty() || !r.ipcache.is_empty() || !r.extra.is_empty(),
            );
            for (id, e) in self.endpoints.iter() {
                let hit = e.record.identity.is_some_and(|i| r.affected.contains(&i))
                    || r.extra.contains(&id)
                    || (e.record.host && host_hit);
                if hit {
                    to_regenerate.push((id, e.handle.clone()));
                } else if r.policy_change && e.record.identity.is_some() {
                    to_bump.push((id, e.handle.clone()));
                }
            }
        }
        if let Some((action, key)) = &r.notice {
            let _ = self.shared.notifications.send(Notification::policy(
                action,
                policy_ref(key),
                Some(revision),
                Some(to_regenerate.len()),
                None,
            ));
        }
        self.reaction.do_send(
            PolicyReaction {
                revision,
                accepted_at: r.accepted_at,
                reason: r.reason,
                to_regenerate,
                to_bump,
                force: r.force,
                ipcache: r.ipcache,
                observe_delay: r.policy_change,
                set_ready: false,
                release_memory: r.release_memory,
                peers: r.peers,
                immediate: r.immediate,
                done: r.done,
            },
            NAME,
        );
        self.update_gauges();
    }

    /// Sends on what a change of the cluster index did: local endpoints of changed pods follow
    /// their pod's identity, and the selecting endpoints regenerate.
    fn index_changed(&mut self, reason: String, change: IndexChange) {
        if change.is_empty() {
            return;
        }
        let IndexChange {
            mut affected,
            mut ipcache,
            pods,
            conflicts,
        } = change;
        self.report_conflicts(&reason, conflicts);
        self.name_addresses(&ipcache);
        let changed: Vec<EndpointId> = self
            .endpoints
            .of_pods(&pods)
            .into_iter()
            .filter(|id| self.refresh_endpoint_identity(*id, &mut ipcache, &mut affected))
            .collect();
        self.react(
            Reaction::new(reason)
                .affecting(affected.iter().copied())
                .regenerating(changed)
                .forced()
                .ipcache(ipcache),
        );
    }

    /// Addresses the index refused or that a higher-ranked source holds: logged and counted,
    /// never applied.
    fn report_conflicts(&self, reason: &str, conflicts: Vec<String>) {
        for c in conflicts {
            tracing::warn!(change = %reason, conflict = %c, "address claim not applied");
            self.shared.metrics.address_conflicts.inc();
        }
    }

    /// The monitor's pod names follow who holds each changed address.
    pub(super) fn name_addresses(&self, ipcache: &[IpcacheChange]) {
        for c in ipcache {
            let ip = match c {
                IpcacheChange::Upsert(net, _) | IpcacheChange::Remove(net) => net.addr(),
            };
            match self.index.holder(ip).and_then(|h| h.holder.pod()) {
                Some(key) => {
                    self.shared.pod_names.insert(ip, key.to_string());
                }
                None => {
                    self.shared.pod_names.remove(&ip);
                }
            }
        }
    }
}

impl Actor for PolicyRepoActor {
    type Context = Context<Self>;
}
traced_actor!(PolicyRepoActor:
    PolicyUpsert, PolicyRejected, PolicyDelete, ManifestStatus, PodUpsert, PodsUpsert, PodDelete, NamespaceUpsert,
    NamespaceDelete, NodeUpsert, NodeDelete, InitialSyncDone, AddEndpoint, DeleteEndpoint,
    FindEndpoint, ConfigureEndpoint, AddHostEndpoint, ListEndpoints, ListPodlessEndpoints, Shutdown, GetPolicies, GetIdentities, GetIpcacheView, RegenerateAll,
    LearnFqdn, ExpireFqdn, RestoreFqdn, RestoreNumbering, DeviceAddresses);
