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

mod numbering;
pub use numbering::RestoreNumbering;

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
    fn react(&self, r: Reaction) {
        self.journal_numbers();
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
            if held.len() >= SYNC_IPCACHE_CHUNK {
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
            for (id, e) in self.endpoints.iter() {
                let hit = e.record.identity.is_some_and(|i| r.affected.contains(&i))
                    || r.extra.contains(&id);
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
    fn name_addresses(&self, ipcache: &[IpcacheChange]) {
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

    /// Re-derives an endpoint's identity and named ports from its pod. Returns true when
    /// either changed. An identity this creates or frees adds the endpoints selecting it to
    /// `affected`.
    fn refresh_endpoint_identity(
        &mut self,
        id: EndpointId,
        ipcache: &mut Vec<IpcacheChange>,
        affected: &mut BTreeSet<NumericIdentity>,
    ) -> bool {
        let Some(entry) = self.endpoints.get(id) else {
            return false;
        };
        let (labels, ports) = match self.index.pod(&entry.record.name) {
            Some(p) => (self.index.record_labels(p), p.named_ports.to_vec()),
            None => return false, // keep what it has (restored, or pod deleted: stays until the endpoint is)
        };
        if entry.labels == labels && entry.named_ports == ports && entry.record.identity.is_some() {
            return false;
        }
        let old = entry.record.identity;
        let (key, ips) = (entry.record.name.clone(), entry.record.ips.clone());
        let engine = self.shared.engine.clone();
        let mut engine = match engine.write() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let allocation = engine.allocate_identity(&labels);
        let new_id = allocation.id();
        if matches!(allocation, Allocation::New(_)) {
            affected.extend(engine.endpoints_affected_by_identity(new_id));
        }
        ipcache.extend(self.index.claim_endpoint(&mut engine, &key, &ips, new_id));
        if let Some(o) = old {
            if engine.identities().is_last_reference(o) {
                affected.extend(engine.endpoints_affected_by_identity(o));
            }
            engine.release_identity(o);
        }
        drop(engine);
        if let Some(e) = self.endpoints.get_mut(id) {
            e.record.identity = Some(new_id);
            e.labels = labels.clone();
            e.named_ports = ports.clone();
            e.handle.do_send(
                SetIdentity {
                    identity: Some(new_id),
                    labels,
                    named_ports: ports,
                },
                NAME,
            );
        }
        true
    }

    fn spawn_endpoint(
        &mut self,
        record: EndpointRecord,
        labels: Labels,
        ports: Vec<NamedPort>,
    ) -> EndpointModel {
        let name = format!("EndpointActor/{}", record.id);
        let journal = self.shared.registry.register(name, "EndpointActor");
        let ports_copy = ports.clone();
        let actor = EndpointActor::new(
            record.clone(),
            labels.clone(),
            ports,
            self.shared.clone(),
            self.loader.clone(),
            super::endpoint::Reports::to(&self.reaction),
            journal.clone(),
        );
        let addr = TracedAddr::new(actor.start(), journal);
        let model = EndpointModel {
            id: record.id,
            name: record.name.clone(),
            identity: record.identity,
            labels: labels.to_strings(),
            ips: record.ips.iter().map(|i| i.to_string()).collect(),
            interface: record.interface.clone(),
            state: if record.identity.is_some() {
                "ready"
            } else {
                "waiting-for-identity"
            }
            .into(),
            policy_revision: 0,
            policy_entries: 0,
            ingress_enforced: false,
            egress_enforced: false,
            regenerations: 0,
            error: None,
            audit: record.audit,
            container_id: record.container_id.clone(),
        };
        self.endpoints.insert(Entry {
            record,
            handle: addr,
            labels,
            named_ports: ports_copy,
        });
        model
    }

    fn add_endpoint(
        &mut self,
        req: EndpointRequest,
        restore: Option<EndpointRecord>,
    ) -> Result<EndpointModel, ApiError> {
        let (key, id) = self
            .endpoints
            .admit(Admission {
                name: &req.name,
                container_id: req.container_id.as_deref(),
                ips: &req.ips,
                restore: restore.as_ref().map(|r| r.id),
            })
            .map_err(|e| match e {
                Refusal::BadName(_) => ApiError::Invalid(e.to_string()),
                Refusal::Conflict(_) => ApiError::Conflict(e.to_string()),
                Refusal::NoFreeId => ApiError::Internal(e.to_string()),
            })?;
        let mut ipcache = Vec::new();
        let (identity, labels, ports) = {
            let pod_state = self
                .index
                .pod(&key)
                .map(|p| (self.index.record_labels(p), p.named_ports.to_vec()));
            let mut engine = self.engine_mut();
            match (pod_state, &restore) {
                (Some((labels, ports)), _) => {
                    (Some(engine.allocate_identity(&labels).id()), labels, ports)
                }
                (None, Some(r)) if r.identity.is_some() => {
                    let labels: Labels = r.labels.iter().filter_map(|s| Label::parse(s)).collect();
                    let want = r.identity.unwrap_or_default();
                    match engine.restore_identity(want, &labels) {
                        Ok(a) => (Some(a.id()), labels, vec![]),
                        Err(e) => {
                            tracing::warn!(endpoint = id, error = %e, "cannot restore identity; waiting for the pod");
                            (None, Labels::new(), vec![])
                        }
                    }
                }
                _ => (None, Labels::new(), vec![]),
            }
        };
        if let Some(ident) = identity {
            ipcache = self.indexed(|ix, e| ix.claim_endpoint(e, &key, &req.ips, ident));
        }
        let record = EndpointRecord {
            id,
            name: key.clone(),
            ips: req.ips.clone(),
            interface: req.interface.clone(),
            identity,
            labels: labels.to_strings(),
            policy_revision: restore.as_ref().map(|r| r.policy_revision).unwrap_or(0),
            container_id: req.container_id.clone(),
            netns: req.netns.clone(),
            mac: req.mac.clone(),
            audit: restore.as_ref().is_some_and(|r| r.audit),
        };
        let model = self.spawn_endpoint(record, labels, ports);
        let affected: BTreeSet<NumericIdentity> = identity
            .map(|i| self.engine().endpoints_affected_by_identity(i))
            .unwrap_or_default();
        self.react(
            Reaction::new(format!("endpoint {id} added"))
                .affecting(affected.iter().copied())
                .regenerating([id])
                .forced()
                .ipcache(ipcache),
        );
        Ok(model)
    }

    fn delete_endpoint(&mut self, id: EndpointId, keep_datapath: bool) -> Result<(), ApiError> {
        let entry = self
            .endpoints
            .remove(id)
            .ok_or_else(|| ApiError::NotFound(format!("endpoint {id}")))?;
        entry.handle.do_send(Delete { keep_datapath }, NAME);
        if keep_datapath {
            return Ok(());
        }
        let mut affected = BTreeSet::new();
        // The pod's own claim (if it is still listed) keeps the addresses.
        let ipcache =
            self.indexed(|ix, e| ix.release_endpoint(e, &entry.record.name, &entry.record.ips));
        {
            let mut engine = self.engine_mut();
            if let Some(i) = entry.record.identity {
                if engine.identities().is_last_reference(i) {
                    affected.extend(engine.endpoints_affected_by_identity(i));
                }
                engine.release_identity(i);
            }
        }
        self.react(
            Reaction::new(format!("endpoint {id} deleted"))
                .affecting(affected)
                .ipcache(ipcache),
        );
        Ok(())
    }
}

impl Actor for PolicyRepoActor {
    type Context = Context<Self>;
}
traced_actor!(PolicyRepoActor:
    PolicyUpsert, PolicyRejected, PolicyDelete, ManifestStatus, PodUpsert, PodsUpsert, PodDelete, NamespaceUpsert,
    NamespaceDelete, NodeUpsert, NodeDelete, InitialSyncDone, AddEndpoint, DeleteEndpoint,
    FindEndpoint, ConfigureEndpoint, ListEndpoints, ListPodlessEndpoints, Shutdown, GetPolicies, GetIdentities, GetIpcacheView, RegenerateAll,
    LearnFqdn, ExpireFqdn, RestoreFqdn, RestoreNumbering);

use crate::traceable;

// ------------------------------------------------------------------ policies

/// A policy was added or changed and passed validation.
#[derive(Debug, Message)]
#[rtype(result = "Result<u64, String>")]
pub struct PolicyUpsert {
    pub policy: ParsedPolicy,
    /// Where it came from (`file.yaml#0`, `k8s`).
    pub source: String,
}
traceable!(PolicyUpsert, "PolicyUpsert", |m| format!(
    "policy {}",
    m.policy.key
));

impl Handler<PolicyUpsert> for PolicyRepoActor {
    type Result = Result<u64, String>;
    fn handle(&mut self, msg: PolicyUpsert, _: &mut Context<Self>) -> Self::Result {
        let accepted_at = Instant::now();
        let key = (*msg.policy.key).clone();
        let notes = msg.policy.notes.clone();
        let known = self.statuses.accepted(&msg.policy, msg.source);
        let (generation, dropped) = self.fqdn_generation_and_rules(&key);
        let mut change = self.engine_mut().upsert_policy(msg.policy);
        self.follow_fqdn_selectors(generation, &mut change);
        self.shared
            .report_policy(crate::k8s::status::PolicyStatusEvent::Accepted {
                key: key.clone(),
                revision: change.revision,
                notes,
            });
        self.statuses.enforced_from(&key, change.revision);
        self.react(
            Reaction::new(format!("policy {}", key.short()))
                .at(accepted_at)
                .affecting(change.affected.iter().copied())
                .ipcache(ipcache_of(&change))
                .policy_change()
                .dropping(dropped)
                .notify(if known { "updated" } else { "added" }, &key),
        );
        Ok(change.revision)
    }
}

/// A policy failed validation. An earlier accepted version (if any) stays in force.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct PolicyRejected {
    /// The policy, when its kind and name could be read.
    pub key: Option<PolicyKey>,
    pub error: String,
    pub source: String,
}
traceable!(PolicyRejected, "PolicyRejected", |m| m.error.clone());

impl Handler<PolicyRejected> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: PolicyRejected, _: &mut Context<Self>) {
        tracing::warn!(source = %msg.source, error = %msg.error, "policy rejected");
        let key = msg.key.unwrap_or_else(|| {
            PolicyKey::new(crate::policy::rule::PolicyKind::Builtin, None, &msg.source)
        });
        let enforced = self.engine().policy(&key).is_some();
        self.shared
            .report_policy(crate::k8s::status::PolicyStatusEvent::Rejected {
                key: key.clone(),
                error: msg.error.clone(),
                previous_enforced: enforced,
            });
        let notice = Notification::policy(
            "rejected",
            policy_ref(&key),
            None,
            None,
            Some(msg.error.clone()),
        );
        let _ = self.shared.notifications.send(notice);
        self.statuses
            .rejected(&key, &msg.error, msg.source, enforced);
        self.update_gauges();
    }
}

/// A policy was deleted.
#[derive(Debug, Message)]
#[rtype(result = "Result<u64, String>")]
pub struct PolicyDelete {
    pub key: PolicyKey,
}
traceable!(PolicyDelete, "PolicyDelete", |m| format!(
    "policy {}",
    m.key
));

impl Handler<PolicyDelete> for PolicyRepoActor {
    type Result = Result<u64, String>;
    fn handle(&mut self, msg: PolicyDelete, _: &mut Context<Self>) -> Self::Result {
        let accepted_at = Instant::now();
        self.statuses.deleted(&msg.key);
        self.shared
            .report_policy(crate::k8s::status::PolicyStatusEvent::Deleted {
                key: msg.key.clone(),
            });
        let (generation, dropped) = self.fqdn_generation_and_rules(&msg.key);
        let change = self.engine_mut().delete_policy(&msg.key);
        match change {
            Some(mut change) => {
                self.follow_fqdn_selectors(generation, &mut change);
                self.react(
                    Reaction::new(format!("policy {} deleted", msg.key.short()))
                        .at(accepted_at)
                        .affecting(change.affected.iter().copied())
                        .ipcache(ipcache_of(&change))
                        .policy_change()
                        .dropping(dropped)
                        .notify("deleted", &msg.key),
                );
                Ok(change.revision)
            }
            None => {
                self.update_gauges();
                Ok(self.engine().revision())
            }
        }
    }
}

/// A manifest file was read (error: `None`) or could not be (its objects stay as they were).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct ManifestStatus {
    pub file: String,
    pub error: Option<String>,
}
traceable!(ManifestStatus, "ManifestStatus", |m| format!(
    "{}: {}",
    m.file,
    m.error.as_deref().unwrap_or("ok")
));

impl Handler<ManifestStatus> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: ManifestStatus, _: &mut Context<Self>) {
        self.statuses.manifest(msg.file, msg.error);
    }
}

// ------------------------------------------------------------------ cluster objects

/// A pod appeared or changed.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct PodUpsert {
    pub pod: PodInfo,
}
traceable!(PodUpsert, "PodUpsert", |m| format!("pod {}", m.pod.key()));

impl Handler<PodUpsert> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: PodUpsert, _: &mut Context<Self>) {
        let key = msg.pod.key();
        let change = self.indexed(|ix, e| ix.apply_pod(e, &key, Some(msg.pod)));
        self.index_changed(format!("pod {key}"), change);
    }
}

/// Pods of the initial sync, in one message (no per-pod message, reason or reaction).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct PodsUpsert {
    pub pods: Vec<PodInfo>,
}
traceable!(PodsUpsert, "PodsUpsert", |m| format!(
    "{} pods",
    m.pods.len()
));

impl Handler<PodsUpsert> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: PodsUpsert, _: &mut Context<Self>) {
        let n = msg.pods.len();
        let change = self.indexed(|ix, e| {
            let mut all = IndexChange::default();
            for pod in msg.pods {
                let key = pod.key();
                all.extend(ix.apply_pod(e, &key, Some(pod)));
            }
            all
        });
        self.index_changed(format!("{n} pods"), change);
    }
}

/// A pod went away.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct PodDelete {
    /// `namespace/name`.
    pub key: String,
}
traceable!(PodDelete, "PodDelete", |m| format!("pod {}", m.key));

impl Handler<PodDelete> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: PodDelete, _: &mut Context<Self>) {
        let change = self.indexed(|ix, e| ix.apply_pod(e, &msg.key, None));
        self.index_changed(format!("pod {} deleted", msg.key), change);
    }
}

/// A namespace appeared or its labels changed: its pods' identities follow.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct NamespaceUpsert {
    pub namespace: NamespaceInfo,
}
traceable!(NamespaceUpsert, "NamespaceUpsert", |m| format!(
    "namespace {}",
    m.namespace.name
));

impl Handler<NamespaceUpsert> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: NamespaceUpsert, _: &mut Context<Self>) {
        let name = msg.namespace.name.clone();
        let change = self.indexed(|ix, e| ix.upsert_namespace(e, msg.namespace));
        self.index_changed(format!("namespace {name}"), change);
    }
}

/// A namespace went away.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct NamespaceDelete {
    pub name: String,
}
traceable!(NamespaceDelete, "NamespaceDelete", |m| format!(
    "namespace {}",
    m.name
));

impl Handler<NamespaceDelete> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: NamespaceDelete, _: &mut Context<Self>) {
        let change = self.indexed(|ix, e| ix.delete_namespace(e, &msg.name));
        self.index_changed(format!("namespace {} deleted", msg.name), change);
    }
}

/// A node appeared or changed: its addresses are `host` (this node) or `remote-node`.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct NodeUpsert {
    pub node: NodeInfo,
}
traceable!(NodeUpsert, "NodeUpsert", |m| format!(
    "node {}",
    m.node.name
));

impl PolicyRepoActor {
    /// This node's Node object names its pod CIDR (`ParseNode`: `spec.podCIDRs`, else the
    /// annotation): IPAM serves that range from now on, with every endpoint's address
    /// reserved. A range already handing out addresses is never swapped under its pods.
    fn adopt_node_pod_cidr(&self, node: &crate::objects::NodeInfo) {
        let (cidr, source) = match crate::ipam::node_pod_cidr(&node.pod_cidrs, &node.annotations) {
            Ok(Some(c)) => c,
            Ok(None) => return,
            Err(e) => {
                tracing::error!(node = %node.name, error = %e, "this node's pod CIDR is unusable; IPAM keeps what it had");
                return;
            }
        };
        let held = self.endpoints.held_addresses();
        let Ok(mut g) = self.shared.ipam.lock() else {
            return;
        };
        match g.adopt(cidr, source, held) {
            Ok(true) => {
                tracing::info!(node = %node.name, pod_cidr = %cidr, ?source, "IPAM serves this node's pod CIDR")
            }
            Ok(false) => {}
            Err(e) => tracing::error!(node = %node.name, error = %e, "IPAM keeps what it had"),
        }
    }
}

impl PolicyRepoActor {
    /// Hands the node set to the route reconciler (it keeps only the newest, and applies
    /// nothing before the initial sync): during the initial sync the set is sent once, at its
    /// end, not once per node (a 5,000-node cluster would copy 25 million nodes).
    fn publish_nodes(&self) {
        if !self.initial_sync_done {
            return;
        }
        self.shared.nodes.send_replace(
            self.index
                .nodes()
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        );
    }
}

impl Handler<NodeUpsert> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: NodeUpsert, _: &mut Context<Self>) {
        if msg.node.name == self.shared.node_name {
            self.adopt_node_pod_cidr(&msg.node);
        }
        let local = msg.node.name == self.shared.node_name;
        let change = self.indexed(|ix, e| ix.upsert_node(e, msg.node, local));
        self.publish_nodes();
        self.react(Reaction::new("node").ipcache(change.ipcache));
    }
}

/// A node went away.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct NodeDelete {
    pub name: String,
}
traceable!(NodeDelete, "NodeDelete", |m| format!("node {}", m.name));

impl Handler<NodeDelete> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: NodeDelete, _: &mut Context<Self>) {
        let Some(change) = self.indexed(|ix, e| ix.delete_node(e, &msg.name)) else {
            return;
        };
        self.publish_nodes();
        self.react(Reaction::new("node deleted").ipcache(change.ipcache));
    }
}

/// The watcher delivered the initial state: regenerate every endpoint, then report ready.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct InitialSyncDone;
traceable!(InitialSyncDone, "InitialSyncDone", |_m| String::new());

impl Handler<InitialSyncDone> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, _: InitialSyncDone, _: &mut Context<Self>) {
        if self.initial_sync_done {
            return;
        }
        self.after_initial_sync();
    }
}

/// During the initial sync, ipcache changes go to the datapath in chunks of this many.
const SYNC_IPCACHE_CHUNK: usize = 8192;

impl PolicyRepoActor {
    /// A reaction that regenerates nothing and releases `ipcache` (the initial sync's chunks).
    fn send_reaction(&self, revision: u64, reason: String, ipcache: Vec<IpcacheChange>) {
        self.journal_numbers();
        self.reaction.do_send(
            PolicyReaction {
                revision,
                accepted_at: Instant::now(),
                reason,
                to_regenerate: vec![],
                to_bump: vec![],
                force: false,
                ipcache,
                observe_delay: false,
                set_ready: false,
                release_memory: false,
                peers: None,
                immediate: false,
                done: None,
            },
            NAME,
        );
    }

    /// The initial state is in: publish the nodes, give restored endpoints their pods'
    /// identities, and regenerate every endpoint (the reaction reports ready when done).
    fn after_initial_sync(&mut self) {
        self.initial_sync_done = true;
        self.publish_nodes();
        self.shared.bootstrap.synced(&self.shared.metrics);
        let mut ipcache = self.sync_ipcache.take();
        ipcache.extend(self.refresh_all_identities());
        ipcache.extend(self.end_numbering_restore());
        let (revision, endpoints) = (self.engine().revision(), self.endpoints.len());
        let to_regenerate = self.endpoints_with_identity();
        tracing::info!(
            revision,
            endpoints,
            "initial sync done; regenerating endpoints"
        );
        self.reaction.do_send(
            PolicyReaction {
                revision,
                accepted_at: Instant::now(),
                reason: "initial sync".into(),
                to_regenerate,
                to_bump: vec![],
                force: true,
                ipcache,
                observe_delay: false,
                set_ready: true,
                release_memory: true,
                peers: None,
                immediate: false,
                done: None,
            },
            NAME,
        );
        self.update_gauges();
    }
}

impl PolicyRepoActor {
    /// Restored endpoints whose pods are now known take their identity from the pod; returns
    /// the ipcache changes that makes.
    fn refresh_all_identities(&mut self) -> Vec<IpcacheChange> {
        let ids = self.endpoints.ids();
        let mut ipcache = Vec::new();
        // Every endpoint regenerates after this: who else is affected does not matter.
        let mut affected = BTreeSet::new();
        for id in ids {
            self.refresh_endpoint_identity(id, &mut ipcache, &mut affected);
        }
        ipcache
    }

    /// Every endpoint that has an identity (the others cannot be regenerated yet).
    fn endpoints_with_identity(&self) -> Vec<EndpointHandle> {
        self.endpoints
            .iter()
            .filter(|(_, e)| e.record.identity.is_some())
            .map(|(id, e)| (id, e.handle.clone()))
            .collect()
    }
}

// ------------------------------------------------------------------ endpoints

/// Creates an endpoint (API or CNI), or restores one from the state directory.
#[derive(Debug, Message)]
#[rtype(result = "Result<EndpointModel, ApiError>")]
pub struct AddEndpoint {
    pub request: EndpointRequest,
    pub restore: Option<EndpointRecord>,
}
traceable!(AddEndpoint, "AddEndpoint", |m| format!(
    "{} {}{}",
    m.request.name,
    m.request
        .ips
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(","),
    if m.restore.is_some() {
        " (restore)"
    } else {
        ""
    }
));

impl Handler<AddEndpoint> for PolicyRepoActor {
    type Result = Result<EndpointModel, ApiError>;
    fn handle(&mut self, msg: AddEndpoint, _: &mut Context<Self>) -> Self::Result {
        self.add_endpoint(msg.request, msg.restore)
    }
}

/// Deletes an endpoint.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), ApiError>")]
pub struct DeleteEndpoint {
    pub id: EndpointId,
}
traceable!(DeleteEndpoint, "DeleteEndpoint", |m| format!(
    "endpoint {}",
    m.id
));

impl Handler<DeleteEndpoint> for PolicyRepoActor {
    type Result = Result<(), ApiError>;
    fn handle(&mut self, msg: DeleteEndpoint, _: &mut Context<Self>) -> Self::Result {
        self.delete_endpoint(msg.id, false)
    }
}

/// Changes an endpoint's configuration (`ciliate endpoint config ID PolicyAuditMode=...`).
#[derive(Debug, Message)]
#[rtype(result = "Result<(), ApiError>")]
pub struct ConfigureEndpoint {
    pub id: EndpointId,
    pub audit: bool,
}
traceable!(ConfigureEndpoint, "ConfigureEndpoint", |m| format!(
    "endpoint {} audit {}",
    m.id, m.audit
));

impl Handler<ConfigureEndpoint> for PolicyRepoActor {
    type Result = Result<(), ApiError>;
    fn handle(&mut self, msg: ConfigureEndpoint, _: &mut Context<Self>) -> Self::Result {
        let entry = self
            .endpoints
            .get_mut(msg.id)
            .ok_or_else(|| ApiError::NotFound(format!("endpoint {}", msg.id)))?;
        entry.record.audit = msg.audit;
        entry.handle.do_send(SetAudit { audit: msg.audit }, NAME);
        Ok(())
    }
}

/// Finds an endpoint by its container id (CNI DEL).
#[derive(Debug, Message)]
#[rtype(result = "Result<Option<EndpointId>, ApiError>")]
pub struct FindEndpoint {
    pub container_id: String,
}
traceable!(FindEndpoint, "FindEndpoint", |m| format!(
    "container {}",
    m.container_id
));

impl Handler<FindEndpoint> for PolicyRepoActor {
    type Result = Result<Option<EndpointId>, ApiError>;
    fn handle(&mut self, msg: FindEndpoint, _: &mut Context<Self>) -> Self::Result {
        Ok(self.endpoints.by_container(&msg.container_id))
    }
}

/// Endpoints whose pod the agent does not know (after the initial sync: pods deleted while the
/// agent was down), with their container id when CNI made them. Empty before the initial sync.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<(EndpointId, String, Option<String>)>, ApiError>")]
pub struct ListPodlessEndpoints;
traceable!(ListPodlessEndpoints, "ListPodlessEndpoints", |_m| {
    String::new()
});

impl Handler<ListPodlessEndpoints> for PolicyRepoActor {
    type Result = Result<Vec<(EndpointId, String, Option<String>)>, ApiError>;
    fn handle(&mut self, _: ListPodlessEndpoints, _: &mut Context<Self>) -> Self::Result {
        if !self.initial_sync_done {
            return Ok(Vec::new());
        }
        Ok(self
            .endpoints
            .iter()
            .filter(|(_, e)| !self.index.has_pod(&e.record.name))
            .map(|(id, e)| (id, e.record.name.clone(), e.record.container_id.clone()))
            .collect())
    }
}

/// The endpoint actors, for the API to query.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<EndpointHandle>, ApiError>")]
pub struct ListEndpoints;
traceable!(ListEndpoints, "ListEndpoints", |_m| String::new());

impl Handler<ListEndpoints> for PolicyRepoActor {
    type Result = Result<Vec<EndpointHandle>, ApiError>;
    fn handle(&mut self, _: ListEndpoints, _: &mut Context<Self>) -> Self::Result {
        Ok(self
            .endpoints
            .iter()
            .map(|(id, e)| (id, e.handle.clone()))
            .collect())
    }
}

/// Stops every endpoint actor, leaving the datapath and state in place (agent shutdown).
#[derive(Debug, Message)]
#[rtype(result = "Result<(), ApiError>")]
pub struct Shutdown;
traceable!(Shutdown, "Shutdown", |_m| String::new());

impl Handler<Shutdown> for PolicyRepoActor {
    type Result = Result<(), ApiError>;
    fn handle(&mut self, _: Shutdown, _: &mut Context<Self>) -> Self::Result {
        for id in self.endpoints.ids() {
            self.delete_endpoint(id, true)?;
        }
        Ok(())
    }
}

/// `/debug/policy`.
#[derive(Debug, Message)]
#[rtype(result = "Result<PolicyOverview, ApiError>")]
pub struct GetPolicies;
traceable!(GetPolicies, "GetPolicies", |_m| String::new());

impl Handler<GetPolicies> for PolicyRepoActor {
    type Result = Result<PolicyOverview, ApiError>;
    fn handle(&mut self, _: GetPolicies, _: &mut Context<Self>) -> Self::Result {
        Ok(PolicyOverview {
            revision: self.engine().revision(),
            policies: self
                .statuses
                .policies()
                .map(|p| PolicyStatus {
                    hits: self
                        .shared
                        .policy_hits
                        .get(&p.kind, p.namespace.as_deref(), &p.name),
                    ..p.clone()
                })
                .collect(),
            manifest_errors: self.statuses.manifest_errors().clone(),
            recent_implementations: self.shared.implementations(),
        })
    }
}

/// `/debug/identities`.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<IdentityModel>, ApiError>")]
pub struct GetIdentities;
traceable!(GetIdentities, "GetIdentities", |_m| String::new());

impl Handler<GetIdentities> for PolicyRepoActor {
    type Result = Result<Vec<IdentityModel>, ApiError>;
    fn handle(&mut self, _: GetIdentities, _: &mut Context<Self>) -> Self::Result {
        let e = self.engine();
        let mut v: Vec<IdentityModel> = e
            .identities()
            .iter()
            .map(|i| IdentityModel {
                id: i.id,
                labels: i.labels.to_strings(),
                kind: if reserved_name(i.id).is_some() {
                    "reserved"
                } else if i.cidr.is_some() {
                    "cidr"
                } else {
                    "cluster"
                },
            })
            .collect();
        v.sort_by_key(|i| i.id);
        Ok(v)
    }
}

/// `/debug/ipcache`: the engine's view (the datapath's may lag until regenerations finish).
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<IpcacheModel>, ApiError>")]
pub struct GetIpcacheView;
traceable!(GetIpcacheView, "GetIpcacheView", |_m| String::new());

impl Handler<GetIpcacheView> for PolicyRepoActor {
    type Result = Result<Vec<IpcacheModel>, ApiError>;
    fn handle(&mut self, _: GetIpcacheView, _: &mut Context<Self>) -> Self::Result {
        Ok(self
            .engine()
            .ipcache()
            .entries()
            .into_iter()
            .map(|(p, id)| IpcacheModel {
                prefix: p.to_string(),
                identity: id,
            })
            .collect())
    }
}

/// Asks every endpoint to regenerate (used after restore and by tests).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct RegenerateAll {
    pub reason: String,
}
traceable!(RegenerateAll, "RegenerateAll", |m| m.reason.clone());

impl Handler<RegenerateAll> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: RegenerateAll, _: &mut Context<Self>) {
        let revision = self.engine().revision();
        for (_, e) in self.endpoints.iter() {
            e.handle.do_send(
                Regenerate {
                    revision,
                    reason: msg.reason.clone(),
                    force: true,
                    peers: None,
                },
                NAME,
            );
        }
    }
}

// ------------------------------------------------------------------ DNS names

/// The DNS proxy forwarded an allowed answer: `name` resolved to `ips` for `endpoint`. `done`
/// is told once every selecting endpoint's policy map and the ipcache hold the addresses.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct LearnFqdn {
    pub name: String,
    pub ips: Vec<IpAddr>,
    pub ttl: std::time::Duration,
    pub endpoint: Option<EndpointId>,
    pub done: tokio::sync::oneshot::Sender<()>,
}
traceable!(LearnFqdn, "LearnFqdn", |m| format!(
    "{} -> {:?}",
    m.name, m.ips
));

impl Handler<LearnFqdn> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: LearnFqdn, _: &mut Context<Self>) {
        let evicted = self.cache_learning(&msg);
        let mut change = self.engine_mut().learn_selected_fqdn(&msg.name, &msg.ips);
        for c in evicted {
            change.absorb_peers(c);
        }
        if change.affected.is_empty() && ipcache_of(&change).is_empty() {
            // A name no selector matches (or nothing new): nothing to wait for.
            let _ = msg.done.send(());
            return;
        }
        self.react(
            Reaction::new(format!(
                "fqdn {}",
                crate::policy::fqdn::normalize(&msg.name)
            ))
            .affecting(change.affected.iter().copied())
            .forced() // selections changed, not the revision
            .only_peers(change.peers.clone())
            .ipcache(ipcache_of(&change))
            .waited_for(msg.done),
        );
    }
}

/// Addresses past their TTL (and no longer used by a tracked connection) leave the cache, and
/// the selectors of their names let go.
#[derive(Debug, Message)]
#[rtype(result = "usize")]
pub struct ExpireFqdn {
    pub now: u64,
}
traceable!(ExpireFqdn, "ExpireFqdn", |m| format!("at {}", m.now));

impl Handler<ExpireFqdn> for PolicyRepoActor {
    type Result = usize;
    fn handle(&mut self, msg: ExpireFqdn, _: &mut Context<Self>) -> usize {
        let dns = self.shared.dns.clone();
        let (mut gone, zombies) = {
            let mut cache = dns.cache();
            let gone = cache.expire(msg.now, &|ip| dns.is_live(ip));
            (gone, cache.bound_zombies(&dns.limits, msg.now))
        };
        if !zombies.is_empty() {
            self.forget_evicted(crate::policy::fqdn_bounds::Evicted {
                gone: Vec::new(),
                counts: zombies.counts,
            });
            gone.extend(zombies.gone);
        }
        if gone.is_empty() {
            if std::mem::take(&mut self.fqdn_dirty) {
                self.fqdn_changed();
            }
            return 0;
        }
        self.fqdn_changed();
        let changes: Vec<_> = {
            let mut e = self.engine_mut();
            gone.iter().map(|(n, ip)| e.forget_fqdn(n, *ip)).collect()
        };
        self.react_to_all(format!("{} DNS addresses expired", gone.len()), &changes);
        gone.len()
    }
}

/// Start-up, before endpoints are restored: the cache a previous run saved selects again.
#[derive(Debug, Message)]
#[rtype(result = "usize")]
pub struct RestoreFqdn {
    pub cache: crate::policy::fqdn::FqdnCache,
}
traceable!(RestoreFqdn, "RestoreFqdn", |m| format!(
    "{} names",
    m.cache.len()
));

impl Handler<RestoreFqdn> for PolicyRepoActor {
    type Result = usize;
    fn handle(&mut self, msg: RestoreFqdn, _: &mut Context<Self>) -> usize {
        let changes: Vec<_> = {
            let mut e = self.engine_mut();
            let learn = |(n, c): (&String, &crate::policy::fqdn::CacheEntry)| {
                e.learn_selected_fqdn(n, &c.ips.iter().map(|i| i.ip).collect::<Vec<_>>())
            };
            msg.cache.names.iter().map(learn).collect()
        };
        let n = msg.cache.len();
        *self.shared.dns.cache() = msg.cache;
        self.fqdn_changed();
        self.react_to_all(format!("{n} DNS names restored"), &changes);
        n
    }
}

impl PolicyRepoActor {
    /// The engine's FQDN generation and the rules (peer rules) the policy `key` has now (before
    /// a change).
    fn fqdn_generation_and_rules(&self, key: &PolicyKey) -> (u64, usize) {
        let engine = self.engine();
        let rules = engine.policy(key).map_or(0, |p| {
            p.rules.iter().map(|r| r.peer_rules.len().max(1)).sum()
        });
        (engine.fqdn_generation(), rules)
    }

    /// Puts a learning into the FQDN cache and keeps the cache within its bounds; returns
    /// what forgetting the evicted names did to the engine.
    fn cache_learning(&mut self, msg: &LearnFqdn) -> Vec<crate::policy::engine::PolicyChange> {
        let dns = self.shared.dns.clone();
        let now = crate::policy::fqdn::unix_now();
        let ep = msg.endpoint.map(|e| e as u64);
        let (selected, new, evicted) = {
            let engine = self.engine();
            let referenced = |name: &str, e: &crate::policy::fqdn::CacheEntry| {
                engine.fqdn_selected(name) || e.ips.iter().any(|c| dns.is_live(c.ip))
            };
            let mut cache = dns.cache();
            let new = cache.learn(&msg.name, &msg.ips, msg.ttl, dns.min_ttl, ep, now);
            let evicted = cache.bound(&dns.limits, &msg.name, ep, &referenced);
            (engine.fqdn_selected(&msg.name), new, evicted)
        };
        if new && selected {
            // In policy now: saved at once, so that a restart restores it.
            self.fqdn_changed();
        } else {
            // Nothing in policy changed (or only askers and expiries): saved by the next tick,
            // at most once a second, so a flood of names does not rewrite the file per name.
            self.fqdn_dirty = true;
        }
        if evicted.is_empty() {
            return Vec::new();
        }
        self.forget_evicted(evicted)
    }

    /// The engine forgets what the cache evicted; the evictions are counted.
    fn forget_evicted(
        &mut self,
        evicted: crate::policy::fqdn_bounds::Evicted,
    ) -> Vec<crate::policy::engine::PolicyChange> {
        for (why, n) in &evicted.counts {
            let labels = crate::metrics::ReasonLabels {
                reason: why.as_str().into(),
            };
            let family = &self.shared.metrics.fqdn_cache_evictions;
            family.get_or_create(&labels).inc_by(*n as u64);
        }
        let mut engine = self.engine_mut();
        let gone = evicted.gone.iter();
        gone.map(|(n, ip)| engine.forget_fqdn(n, *ip)).collect()
    }

    /// After a policy change: when `toFQDNs` selectors came or went (the engine's FQDN
    /// generation moved from `generation`), the cached names follow them
    /// (`PolicyEngine::resync_fqdn`), in the policy's own reaction.
    fn follow_fqdn_selectors(
        &self,
        generation: u64,
        change: &mut crate::policy::engine::PolicyChange,
    ) {
        if self.engine().fqdn_generation() == generation {
            return;
        }
        let cached: Vec<(String, Vec<IpAddr>)> = {
            let cache = self.shared.dns.cache();
            let names = cache.names.iter();
            names
                .map(|(n, e)| (n.clone(), e.ips.iter().map(|c| c.ip).collect()))
                .collect()
        };
        let resync = self.engine_mut().resync_fqdn(&cached);
        change.absorb(resync);
    }

    /// One reaction for several engine changes.
    fn react_to_all(&self, reason: String, changes: &[crate::policy::engine::PolicyChange]) {
        let affected = changes.iter().flat_map(|c| c.affected.iter().copied());
        let peers = changes
            .iter()
            .flat_map(|c| c.peers.iter().copied())
            .collect();
        let ipcache = changes.iter().flat_map(ipcache_of).collect();
        self.react(
            Reaction::new(reason)
                .affecting(affected)
                .forced() // selections changed, not the revision
                .only_peers(peers)
                .ipcache(ipcache),
        );
    }

    /// The cache changed: its gauge, and its file (written off this thread; a failed write is
    /// logged and the next change writes it again).
    fn fqdn_changed(&mut self) {
        self.fqdn_dirty = false;
        let dns = &self.shared.dns;
        let n = dns.cache().len();
        self.shared.metrics.fqdn_cache_entries.set(n as i64);
        dns.request_save(self.shared.state_dir.root());
    }
}
