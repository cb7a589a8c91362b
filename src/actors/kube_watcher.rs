//! `WatcherActor` in Kubernetes mode: Cilium's `K8sWatcher` (`EnableK8sWatcher`,
//! `ciliumNetworkPoliciesInit`, `addCiliumNetworkPolicyV2`) on kube-rs watchers.
//!
//! One kube-runtime watcher per resource (Namespaces, Nodes, Services, Pods of every node,
//! NetworkPolicies, CiliumNetworkPolicies, CiliumClusterwideNetworkPolicies) runs as a task that
//! hands each event to this actor as a [`WatchEvent`]. The actor converts the object
//! (`objects`) and hands it to the [`WatchFeed`] the standalone watcher uses too, which drops
//! events that change nothing the agent uses (a status write, a pod's condition), translates
//! policies and sends the messages.
//!
//! Initial sync. Until every resource has listed once, the feed holds changes; then they go to
//! `PolicyRepoActor` in dependency order (namespaces, nodes, services, pods, policies) followed
//! by `InitialSyncDone`, after which `/readyz` turns ready once every endpoint has regenerated.
//!
//! Outages. A broken watch resumes from its last resourceVersion; a 410 Gone makes the watcher
//! relist. Objects are deleted only by a delete event or by a completed relist that no longer
//! holds them: while the API server is unreachable, every cached object (and so every policy)
//! stays in force.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Debug;
use std::time::{Duration, Instant};

use actix::{Actor, Context, Handler, Message};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DynamicObject};
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::Resource;
use serde::de::DeserializeOwned;

use super::feed::{Item, Origin, ToRepo, WatchFeed};
use super::policy_repo::{NodeUpsert, PolicyRepoActor};
use crate::hashing::{HashMap as FastMap, HashSet as FastSet};
use crate::introspect::{with_change, TracedAddr};
use crate::k8s::node::{desired_annotations, needs_update};
use crate::k8s::slice_writer::LocalPod;
use crate::k8s::slices::{check_slice_node, endpoint_hash, slice_pods_where, SliceObject};
use crate::objects::{
    endpoint_slice_info, namespace_info, node_info, pod_info, service_info, NodeInfo,
};
use crate::runtime::Shared;
use crate::traced_actor;

const NAME: &str = "WatcherActor";
const DEFAULT_NAMESPACE: &str = "default";

/// The watched resources (`objects::Kind`, in apply order).
pub use crate::objects::Kind as Watched;

fn api_version(kind: Watched) -> String {
    kind.info().api_version()
}

/// An object as a watcher delivers it. Policies stay untyped: the agent validates them itself
/// and reports errors by field, and one malformed policy must not fail the whole list.
#[derive(Debug, Clone)]
pub enum Object {
    Namespace(Box<Namespace>),
    Node(Box<Node>),
    Service(Box<Service>),
    EndpointSlice(Box<EndpointSlice>),
    Pod(Box<Pod>),
    Policy(Box<DynamicObject>),
    /// A `CiliateEndpointSlice`, its spec untyped (a malformed one is reported, not a failed
    /// list).
    Slice(Box<SliceObject>),
}

/// One watcher event for one resource.
#[derive(Debug, Clone)]
pub enum Change {
    Apply(Object),
    Delete(Object),
    /// A (re)list starts.
    Init,
    InitApply(Object),
    /// The (re)list is complete.
    InitDone,
    /// The watch failed; the watcher retries with backoff.
    Error(String),
    /// The API server does not serve the resource (404 on the list: its CRD is not
    /// installed). The watcher retries with backoff, so the resource is picked up once served.
    NotServed(String),
}

/// What a watcher task hands to the actor.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct WatchEvent {
    pub resource: Watched,
    pub change: Change,
}

/// What a watcher task hands to the actor: a `CiliateEndpointSlice` event.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct SliceEvent {
    pub change: Change,
}

crate::traceable!(SliceEvent, "SliceEvent", |m| {
    match &m.change {
        Change::Apply(_) => "CiliateEndpointSlice apply".into(),
        Change::Delete(_) => "CiliateEndpointSlice delete".into(),
        Change::Init => "CiliateEndpointSlice relist".into(),
        Change::InitApply(_) => "CiliateEndpointSlice list".into(),
        Change::InitDone => "CiliateEndpointSlice listed".into(),
        Change::Error(e) | Change::NotServed(e) => {
            format!("CiliateEndpointSlice watch error: {e}")
        }
    }
});

/// Where the agent learns of pods: its own node's from Pods always, other nodes' from
/// `CiliateEndpointSlice`s (the default) or from every Pod (`--watch-pods`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemotePods {
    EndpointSlices,
    Pods,
}

impl RemotePods {
    /// As `status` shows it: the kind watched.
    pub fn as_str(self) -> &'static str {
        match self {
            RemotePods::EndpointSlices => "CiliateEndpointSlice",
            RemotePods::Pods => "Pod",
        }
    }
}

/// Other nodes' slices as last seen: which pods each listed, and which slice a pod's entry
/// came from (a pod in two slices, e.g. a StatefulSet pod that moved while its old node's
/// agent was gone, is removed only by the slice it came from last).
#[derive(Default)]
struct SliceReader {
    /// Slice name -> id.
    ids: FastMap<String, u32>,
    /// By id: the pods' keys the slice listed, `\n`-joined (one allocation per slice), and a
    /// hash of each one's entry (`slices::endpoint_hash`), in the same order.
    listed: FastMap<u32, (Box<str>, Box<[u64]>)>,
    next_id: u32,
    /// Pod key (hashed with a per-process random key) -> the id of the slice it came from.
    owner: FastMap<u64, u32>,
    /// For the hashes that stand for a value (a pod's key, an endpoint's entry): std's keyed
    /// SipHash, whose collisions nobody can aim for (`crate::hashing`).
    hasher: std::collections::hash_map::RandomState,
    /// Whether the slices have listed once, and the names a (re)list delivered so far.
    synced: bool,
    relisting: Option<FastSet<String>>,
    last_error: Option<String>,
}

impl SliceReader {
    fn key_hash(&self, key: &str) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(key)
    }
}

crate::traceable!(WatchEvent, "WatchEvent", |m| {
    let what = match &m.change {
        Change::Apply(_) => "apply",
        Change::Delete(_) => "delete",
        Change::Init => "relist",
        Change::InitApply(_) => "list",
        Change::InitDone => "listed",
        Change::Error(e) | Change::NotServed(e) => {
            return format!("{} watch error: {e}", m.resource.name())
        }
    };
    format!("{} {what}", m.resource.name())
});

pub struct KubeWatcherActor {
    client: kube::Client,
    shared: Shared,
    repo: TracedAddr<PolicyRepoActor>,
    me: Option<TracedAddr<KubeWatcherActor>>,
    /// Resources that have not listed once yet.
    unsynced: BTreeSet<Watched>,
    /// Resources in a (re)list: the keys it delivered so far.
    relisting: HashMap<Watched, HashSet<String>>,
    /// When each resource's last watch error was logged (errors repeat while the API is down).
    error_logged: HashMap<Watched, Instant>,
    /// The last watch error of each resource that has not listed yet (for `/readyz`).
    last_error: HashMap<Watched, String>,
    /// This node's annotations, for the annotator task.
    annotations: tokio::sync::watch::Sender<BTreeMap<String, String>>,
    /// Dedupe, dependency order, Services and policy translation (shared with the manifest
    /// watcher): holds everything until every resource listed once.
    feed: WatchFeed,
    started: Instant,
    /// Pods' label maps, shared from conversion on (the initial sync holds every pod).
    labels: crate::objects::LabelInterner,
    remote_pods: RemotePods,
    slices: SliceReader,
    /// Endpoint-slice mode: the pods of this node (the Pod watch lists only them).
    local_pods: HashSet<String>,
    /// This node's pods, to the slice writer.
    writer: Option<tokio::sync::mpsc::UnboundedSender<LocalPod>>,
}

impl KubeWatcherActor {
    pub fn new(
        client: kube::Client,
        shared: Shared,
        repo: TracedAddr<PolicyRepoActor>,
        annotations: tokio::sync::watch::Sender<BTreeMap<String, String>>,
    ) -> Self {
        let lb = shared.services.clone();
        KubeWatcherActor {
            client,
            shared,
            repo,
            me: None,
            unsynced: Watched::ALL
                .into_iter()
                .filter(|k| k.info().watched)
                .collect(),
            relisting: HashMap::new(),
            error_logged: HashMap::new(),
            last_error: HashMap::new(),
            annotations,
            feed: WatchFeed::new(Some(lb)),
            started: Instant::now(),
            labels: Default::default(),
            remote_pods: RemotePods::Pods,
            slices: SliceReader::default(),
            local_pods: HashSet::new(),
            writer: None,
        }
    }

    /// Where other nodes' pods come from, and the writer of this node's slices.
    pub fn with_remote_pods(
        mut self,
        remote_pods: RemotePods,
        writer: Option<tokio::sync::mpsc::UnboundedSender<LocalPod>>,
    ) -> Self {
        self.remote_pods = remote_pods;
        self.writer = writer;
        if remote_pods == RemotePods::EndpointSlices {
            // Pod relists concern this node's pods only, which `local_pods` tracks.
            let feed = std::mem::replace(&mut self.feed, WatchFeed::new(None));
            self.feed = feed.with_hashed_pod_keys();
        }
        if let Ok(mut v) = self.shared.pod_source.lock() {
            v.remote_pods_from = remote_pods.as_str().into();
        }
        self
    }

    fn slice_mode(&self) -> bool {
        self.remote_pods == RemotePods::EndpointSlices
    }

    /// Gives the actor its own traced address (for the watcher tasks).
    pub fn with_self(mut self, me: TracedAddr<KubeWatcherActor>) -> Self {
        self.me = Some(me);
        self
    }

    fn start_watchers(&self) {
        let Some(me) = self.me.clone() else {
            return;
        };
        let c = &self.client;
        // The typed resources: kind, API type and `Object` variant share one name.
        macro_rules! watch_typed {
            ($($kind:ident),+) => {$(
                spawn_watch(
                    Watched::$kind,
                    Api::<$kind>::all(c.clone()),
                    |o| Object::$kind(Box::new(o)),
                    me.clone(),
                );
            )+};
        }
        watch_typed!(Namespace, Node, Service, EndpointSlice);
        // Pods: every one, or (endpoint-slice mode) this node's only.
        let pods = if self.slice_mode() {
            watcher::Config::default().fields(&format!("spec.nodeName={}", self.shared.node_name))
        } else {
            watcher::Config::default()
        };
        spawn_watch_with(
            Watched::Pod,
            Api::<Pod>::all(c.clone()),
            pods,
            |o| Object::Pod(Box::new(o)),
            me.clone(),
        );
        if self.slice_mode() {
            spawn_slice_watch(Api::<SliceObject>::all(c.clone()), me.clone());
        }
        // The policy kinds (the kind registry's), untyped (validated by the agent itself, field
        // by field).
        let policies = Watched::policies()
            .filter(|r| r.watched)
            .map(|r| (r.kind, crate::k8s::api_resource(r)));
        for (kind, resource) in policies {
            spawn_watch(
                kind,
                Api::<DynamicObject>::all_with(c.clone(), &resource),
                |o| Object::Policy(Box::new(o)),
                me.clone(),
            );
        }
    }

    /// Counts a watch event (or error) of `resource` in the metrics.
    fn count_event(&self, resource: &str, change: &Change) {
        let labels = crate::metrics::ResourceLabels {
            resource: resource.to_string(),
        };
        let family = if matches!(change, Change::Error(_) | Change::NotServed(_)) {
            &self.shared.metrics.k8s_watch_errors
        } else {
            &self.shared.metrics.k8s_watch_events
        };
        family.get_or_create(&labels).inc();
    }

    fn on_change(&mut self, resource: Watched, change: Change) {
        self.count_event(resource.name(), &change);
        match change {
            Change::Init => {
                self.relisting.insert(resource, HashSet::new());
                self.served(resource, true);
            }
            Change::NotServed(e) if resource.info().optional => self.not_served(resource, &e),
            Change::InitApply(obj) => {
                if let Some(key) = self.update(resource, &obj, false) {
                    self.relisting.entry(resource).or_default().insert(key);
                }
            }
            Change::Apply(obj) => {
                self.update(resource, &obj, false);
            }
            Change::Delete(obj) => {
                self.update(resource, &obj, true);
            }
            Change::InitDone => self.listed(resource),
            Change::Error(e) | Change::NotServed(e) => self.watch_failed(resource, e),
        }
    }

    /// An optional kind is not served (its CRD is not installed): no object of it can exist.
    /// Counts as an empty list (what was cached is gone with the CRD), once per outage.
    fn not_served(&mut self, resource: Watched, error: &str) {
        if !self.served(resource, false) {
            return;
        }
        tracing::info!(resource = resource.name(), error, "not served by the API server (CRD not installed): none exist; watching for it to appear");
        self.relisting.insert(resource, HashSet::new());
        self.listed(resource);
    }

    /// Records whether `resource` is served; returns whether that changed.
    fn served(&self, resource: Watched, served: bool) -> bool {
        let Ok(mut set) = self.shared.kinds_not_served.lock() else {
            return false;
        };
        if served {
            set.remove(resource.name())
        } else {
            set.insert(resource.name())
        }
    }

    /// A (re)list of `resource` is complete.
    fn listed(&mut self, resource: Watched) {
        // What the relist no longer holds was deleted while the watch was down.
        let seen = self.relisting.remove(&resource).unwrap_or_default();
        self.forget_unseen(resource, &seen);
        let first = self.unsynced.remove(&resource);
        self.last_error.remove(&resource);
        self.publish_waiting();
        if first && resource == Watched::Pod {
            self.tell_writer(LocalPod::Listed);
        }
        if first {
            tracing::info!(resource = resource.name(), objects = seen.len(), "listed");
            if self.all_listed() {
                self.finish_initial_sync();
            }
        } else {
            tracing::info!(resource = resource.name(), objects = seen.len(), "relisted");
        }
    }

    /// Deletes the objects of `resource` a relist no longer holds.
    fn forget_unseen(&mut self, resource: Watched, seen: &HashSet<String>) {
        // In endpoint-slice mode the Pod watch lists this node's pods only: the others come
        // and go with their slices.
        let known = if resource == Watched::Pod && self.slice_mode() {
            let mut k: Vec<String> = self.local_pods.iter().cloned().collect();
            k.sort();
            k
        } else {
            self.feed.keys(resource)
        };
        for key in known {
            if !seen.contains(&key) {
                if resource == Watched::Pod && self.local_pods.remove(&key) {
                    self.tell_writer(LocalPod::Delete(key.clone()));
                }
                let out = self.feed.delete(resource, &key);
                self.send_as(|| format!("{resource} {key} gone at relist"), out);
            }
        }
    }

    /// A watch of `resource` failed; the watcher retries with backoff.
    fn watch_failed(&mut self, resource: Watched, e: String) {
        if self.unsynced.contains(&resource) {
            self.last_error.insert(resource, e.clone());
            self.publish_waiting();
        }
        let now = Instant::now();
        let quiet = self
            .error_logged
            .get(&resource)
            .is_some_and(|t| now.duration_since(*t) < Duration::from_secs(30));
        if !quiet {
            let hint = if e.contains("404") && resource >= Watched::CiliumNetworkPolicy {
                " (are the CRDs installed? kubectl apply -f manifests/crds/)"
            } else {
                ""
            };
            tracing::warn!(resource = resource.name(), error = %e, "watch failed; retrying with backoff, cached objects stay in force{hint}");
            self.error_logged.insert(resource, now);
        }
    }

    /// Whether every watched resource has listed once.
    fn all_listed(&self) -> bool {
        self.unsynced.is_empty() && (!self.slice_mode() || self.slices.synced)
    }

    /// Tells `/readyz` which resources the initial sync still waits for, and why.
    fn publish_waiting(&self) {
        let mut waiting: Vec<String> = self
            .unsynced
            .iter()
            .map(|r| match self.last_error.get(r) {
                Some(e) => format!("{} to be listed (last error: {e})", r.name()),
                None => format!("{} to be listed", r.name()),
            })
            .collect();
        if self.slice_mode() && !self.slices.synced {
            waiting.push(match &self.slices.last_error {
                Some(e) => format!("CiliateEndpointSlice to be listed (last error: {e})"),
                None => "CiliateEndpointSlice to be listed".into(),
            });
        }
        if let Ok(mut w) = self.shared.sync_waiting.lock() {
            *w = waiting;
        }
    }

    /// Converts an object and hands it to the feed. Returns its key.
    fn update(&mut self, resource: Watched, obj: &Object, deleted: bool) -> Option<String> {
        let (key, item) = match convert(resource, obj) {
            Ok((key, Some(Item::Pod(mut p)))) => {
                p.labels = self.labels.intern(p.labels);
                (key, Some(Item::Pod(p)))
            }
            Ok(c) => c,
            Err((key, e)) => {
                tracing::warn!(resource = resource.name(), object = %key, error = %e, "object not usable; ignored");
                return Some(key);
            }
        };
        if let Object::Pod(pod) = obj {
            self.track_local(&key, pod, item.as_ref(), deleted);
        }
        let (out, what) = match item {
            Some(item) if !deleted => (
                self.feed.upsert(&key, item, Origin::api(resource, &key)),
                "applied",
            ),
            _ => (self.feed.delete(resource, &key), "deleted"),
        };
        self.send_as(|| format!("{resource} {key} {what}"), out);
        Some(key)
    }

    /// A pod of this node goes to the slice writer (and local pods win over slice entries).
    fn track_local(&mut self, key: &str, pod: &Pod, item: Option<&Item>, deleted: bool) {
        let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        let local = node == Some(self.shared.node_name.as_str());
        if !local && !self.local_pods.contains(key) {
            return;
        }
        match item {
            Some(Item::Pod(p)) if local && !deleted => {
                if self.local_pods.insert(key.to_string()) {
                    let h = self.slices.key_hash(key);
                    self.slices.owner.remove(&h);
                }
                self.tell_writer(LocalPod::Upsert(p.clone()));
            }
            _ => {
                self.local_pods.remove(key);
                self.tell_writer(LocalPod::Delete(key.to_string()));
            }
        }
    }

    fn tell_writer(&self, change: LocalPod) {
        if let Some(w) = &self.writer {
            let _ = w.send(change);
        }
    }

    fn on_slice_change(&mut self, change: Change) {
        self.count_event("CiliateEndpointSlice", &change);
        match change {
            Change::Init => self.slices.relisting = Some(FastSet::default()),
            Change::InitApply(obj) => {
                if let Some(name) = self.apply_slice(&obj) {
                    self.slices.relisting.get_or_insert_default().insert(name);
                }
            }
            Change::Apply(obj) => {
                self.apply_slice(&obj);
            }
            Change::Delete(obj) => {
                if let Object::Slice(o) = &obj {
                    if let Some(name) = &o.metadata.name {
                        self.drop_slice(name);
                    }
                }
            }
            Change::InitDone => {
                let seen = self.slices.relisting.take().unwrap_or_default();
                let gone: Vec<String> = (self.slices.ids.keys())
                    .filter(|n| !seen.contains(*n))
                    .cloned()
                    .collect();
                for name in gone {
                    self.drop_slice(&name);
                }
                let first = !self.slices.synced;
                self.slices.synced = true;
                self.slices.last_error = None;
                self.publish_waiting();
                tracing::info!(
                    slices = seen.len(),
                    "CiliateEndpointSlice {}",
                    if first { "listed" } else { "relisted" }
                );
                if first && self.all_listed() {
                    self.finish_initial_sync();
                }
            }
            Change::Error(e) | Change::NotServed(e) => {
                if !self.slices.synced {
                    self.slices.last_error = Some(e.clone());
                    self.publish_waiting();
                }
                tracing::warn!(resource = "CiliateEndpointSlice", error = %e, "watch failed; retrying with backoff, cached objects stay in force (are the CRDs installed? kubectl apply -f manifests/crds/)");
            }
        }
        if let Ok(mut v) = self.shared.pod_source.lock() {
            v.slices_watched = self.slices.ids.len();
        }
    }

    /// Another node's slice appeared or changed: its pods go to the feed, the pods it no longer
    /// lists go away. A slice that cannot be read keeps its last good version. Returns its name.
    fn apply_slice(&mut self, obj: &Object) -> Option<String> {
        let Object::Slice(o) = obj else {
            return None;
        };
        let name = o.metadata.name.clone()?;
        let spec = match o.spec_of() {
            Ok(spec) => spec,
            Err(e) => return self.bad_slice(name, e),
        };
        if spec.node == self.shared.node_name {
            // This node's own: its pods come from the Pod watch.
            return Some(name);
        }
        if let Err(e) = check_slice_node(&name, o.metadata.labels.as_ref(), spec) {
            return self.bad_slice(name, e);
        }
        let next = self.slices.next_id;
        let id = *self.slices.ids.entry(name.clone()).or_insert(next);
        if id == next {
            self.slices.next_id += 1;
        }
        // What this version says of each endpoint, against what the last one said: only the
        // endpoints that changed are converted and sent on.
        let hashes: Vec<u64> = (0..spec.endpoints.len())
            .map(|i| endpoint_hash(spec, i, &self.slices.hasher))
            .collect();
        let before: FastMap<&str, u64> = match self.slices.listed.get(&id) {
            Some((keys, h)) => keys
                .split('\n')
                .filter(|k| !k.is_empty())
                .zip(h.iter().copied())
                .collect(),
            None => FastMap::default(),
        };
        let mut listed = String::new();
        let mut listed_hashes = Vec::with_capacity(hashes.len());
        let local = &self.local_pods;
        let labels = &mut self.labels;
        let changed = slice_pods_where(
            spec,
            |l| labels.intern(l),
            |i, key| {
                if local.contains(key) {
                    return false;
                }
                if !listed.is_empty() {
                    listed.push('\n');
                }
                listed.push_str(key);
                listed_hashes.push(hashes[i]);
                before.get(key) != Some(&hashes[i])
            },
        );
        let pods = match changed {
            Ok(pods) => pods,
            Err(e) => return self.bad_slice(name, e),
        };
        let now: FastSet<&str> = listed.split('\n').collect();
        let gone: Vec<String> = before
            .keys()
            .filter(|k| !now.contains(*k))
            .map(|k| k.to_string())
            .collect();
        let mut out = Vec::new();
        for (key, pod) in pods {
            let h = self.slices.key_hash(&key);
            self.slices.owner.insert(h, id);
            out.extend(
                self.feed
                    .upsert(&key, Item::Pod(pod), Origin::api(Watched::Pod, &key)),
            );
        }
        self.slices.listed.insert(
            id,
            (listed.into_boxed_str(), listed_hashes.into_boxed_slice()),
        );
        for key in gone {
            out.extend(self.forget_slice_pod(id, &key));
        }
        self.send_as(|| format!("CiliateEndpointSlice {name} applied"), out);
        Some(name)
    }

    fn bad_slice(&self, name: String, error: String) -> Option<String> {
        tracing::warn!(resource = "CiliateEndpointSlice", object = %name, error = %error, "object not usable; its last good version stays in force");
        Some(name)
    }

    /// A slice went away: the pods it listed (and was the last to list) go too.
    fn drop_slice(&mut self, name: &str) {
        let Some(id) = self.slices.ids.remove(name) else {
            return;
        };
        let (listed, _) = self.slices.listed.remove(&id).unwrap_or_default();
        let mut out = Vec::new();
        for key in listed.split('\n').filter(|k| !k.is_empty()) {
            out.extend(self.forget_slice_pod(id, key));
        }
        self.send_as(|| format!("CiliateEndpointSlice {name} deleted"), out);
    }

    fn forget_slice_pod(&mut self, id: u32, key: &str) -> Vec<ToRepo> {
        let h = self.slices.key_hash(key);
        if self.slices.owner.get(&h) != Some(&id) {
            return Vec::new();
        }
        self.slices.owner.remove(&h);
        self.feed.delete(Watched::Pod, key)
    }

    fn finish_initial_sync(&mut self) {
        let out = self.feed.synced();
        let n = ToRepo::objects(&out);
        self.send_as(
            || format!("initial sync: {n} objects from the API server"),
            out,
        );
        tracing::info!(
            objects = n,
            elapsed_ms = self.started.elapsed().as_millis() as u64,
            "initial sync from the API server done"
        );
    }

    /// Sends the feed's messages as one change, caused by `cause` (`/debug/changes`).
    fn send_as(&self, cause: impl FnOnce() -> String, out: Vec<ToRepo>) {
        if out.is_empty() {
            return;
        }
        let (cause, at) = (cause(), chrono::Utc::now());
        let change = self.shared.registry.begin_change(cause.clone());
        with_change(Some(change), || {
            self.send(out);
            // The change's first step: the watcher's part, in its journal.
            if let Some(me) = &self.me {
                me.journal.note("Feed", cause, "api-server", at, Ok(()));
            }
        });
    }

    fn send(&self, out: Vec<ToRepo>) {
        for m in out {
            match m {
                ToRepo::Node(NodeUpsert { node }) => self.send_node(node),
                m => m.send(&self.repo, NAME),
            }
        }
    }

    /// Sends a node; for this node, annotates it once IPAM has seen it (`AnnotateNode`).
    fn send_node(&self, node: NodeInfo) {
        if node.name != self.shared.node_name {
            self.repo.do_send(NodeUpsert { node }, NAME);
            return;
        }
        let done = self.repo.send(NodeUpsert { node: node.clone() }, NAME);
        let ipam = self.shared.ipam.clone();
        let annotations = self.annotations.clone();
        actix_rt::spawn(async move {
            // IPAM adopts the Node's pod CIDR while handling the upsert.
            let _ = done.await;
            let cidr = ipam
                .lock()
                .ok()
                .and_then(|g| g.ipam.as_ref().and_then(|i| i.cidr_v4()));
            let want = desired_annotations(&node, cidr);
            // Also when someone removed them: the node must carry them again.
            if needs_update(&node.annotations, &want) {
                annotations.send_replace(want);
            }
        });
    }
}

/// `namespace/name`, or `name` for cluster-scoped objects.
fn object_key(meta: &kube::api::ObjectMeta) -> String {
    let name = meta.name.as_deref().unwrap_or("");
    match meta.namespace.as_deref() {
        Some(ns) if !ns.is_empty() => format!("{ns}/{name}"),
        _ => name.to_string(),
    }
}

/// A pod the agent gives no identity: it shares the node's address, or it has finished and its
/// address may already belong to another pod.
fn pod_is_ignored(pod: &Pod) -> bool {
    let host_network = pod
        .spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false);
    let finished = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed");
    host_network || finished
}

/// The policy document `parse_policy` reads: what the user wrote, without status and server
/// bookkeeping, so that a status write is not a policy change.
fn policy_document(resource: Watched, obj: &DynamicObject) -> serde_yaml::Value {
    let mut meta = serde_json::Map::new();
    meta.insert(
        "name".into(),
        obj.metadata.name.clone().unwrap_or_default().into(),
    );
    if let Some(ns) = &obj.metadata.namespace {
        meta.insert("namespace".into(), ns.clone().into());
    }
    if let Some(labels) = &obj.metadata.labels {
        meta.insert(
            "labels".into(),
            serde_json::to_value(labels).unwrap_or_default(),
        );
    }
    // ciliate's own annotations (the policy's mode) and no other: kubectl's last-applied copy
    // changes with every apply.
    let ours: serde_json::Map<String, serde_json::Value> = obj
        .metadata
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| k.starts_with("policy.ciliate.io/"))
        .map(|(k, v)| (k.clone(), v.clone().into()))
        .collect();
    if !ours.is_empty() {
        meta.insert("annotations".into(), ours.into());
    }
    let mut doc = serde_json::Map::new();
    doc.insert("apiVersion".into(), api_version(resource).into());
    doc.insert("kind".into(), resource.name().into());
    doc.insert("metadata".into(), meta.into());
    if let Some(fields) = obj.data.as_object() {
        for (k, v) in fields {
            if k != "status" {
                doc.insert(k.clone(), v.clone());
            }
        }
    }
    serde_yaml::to_value(serde_json::Value::Object(doc)).unwrap_or(serde_yaml::Value::Null)
}

/// The object's key and what the agent uses of it (`None`: nothing, treated as absent).
fn convert(resource: Watched, obj: &Object) -> Result<(String, Option<Item>), (String, String)> {
    let meta = match obj {
        Object::Namespace(o) => &o.metadata,
        Object::Node(o) => &o.metadata,
        Object::Service(o) => &o.metadata,
        Object::EndpointSlice(o) => &o.metadata,
        Object::Pod(o) => &o.metadata,
        Object::Policy(o) => &o.metadata,
        Object::Slice(o) => &o.metadata,
    };
    let key = object_key(meta);
    let named = |e: String| (key.clone(), e);
    let item = match obj {
        Object::Namespace(o) => Item::Namespace(namespace_info(o).map_err(named)?),
        Object::Node(o) => Item::Node(node_info(o).map_err(named)?),
        Object::Service(o) => Item::Service(service_info(o, DEFAULT_NAMESPACE).map_err(named)?),
        Object::EndpointSlice(o) => Item::EndpointSlice(endpoint_slice_info(o).map_err(named)?),
        // A host-network or finished pod: no identity.
        Object::Pod(o) if pod_is_ignored(o) => return Ok((key, None)),
        Object::Pod(o) => Item::Pod(pod_info(o, DEFAULT_NAMESPACE).map_err(named)?),
        Object::Policy(o) => Item::Policy(resource, policy_document(resource, o)),
        Object::Slice(_) => return Err((key, "a CiliateEndpointSlice is not a Pod".into())),
    };
    Ok((key, Some(item)))
}

/// How long a failing watch waits before it retries: 200 ms doubling up to 5 s, each wait
/// stretched by up to a quarter at random so that the agents of a cluster do not all return to
/// a restarted API server at once. Reset by any successful event. (kube's default goes up to
/// 30 s, too long for an agent whose view of the cluster is frozen meanwhile.)
#[derive(Debug, Clone)]
pub struct WatchBackoff {
    next: Duration,
}

impl WatchBackoff {
    const FIRST: Duration = Duration::from_millis(200);
    const MAX: Duration = Duration::from_secs(5);
}

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff { next: Self::FIRST }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let wait = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        Some(wait + wait.mul_f64(f64::from(nanos % 1000) / 4000.0))
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

/// Runs one resource's watcher in a task, handing its events to the actor.
fn spawn_watch<K>(
    resource: Watched,
    api: Api<K>,
    wrap: fn(K) -> Object,
    me: TracedAddr<KubeWatcherActor>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    spawn_watch_with(resource, api, watcher::Config::default(), wrap, me);
}

/// `spawn_watch` with a watcher configuration (e.g. a field selector).
fn spawn_watch_with<K>(
    resource: Watched,
    api: Api<K>,
    config: watcher::Config,
    wrap: fn(K) -> Object,
    me: TracedAddr<KubeWatcherActor>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    run_watch(api, config, wrap, move |change| {
        me.do_send(WatchEvent { resource, change }, "kube-watch")
    });
}

/// Runs the `CiliateEndpointSlice` watcher in a task.
fn spawn_slice_watch(api: Api<SliceObject>, me: TracedAddr<KubeWatcherActor>) {
    run_watch(
        api,
        watcher::Config::default(),
        |o| Object::Slice(Box::new(o)),
        move |change| me.do_send(SliceEvent { change }, "kube-watch"),
    );
}

/// The list (or watch) was answered 404: the resource is not served.
fn not_served(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s)) => s.code == 404,
        _ => false,
    }
}

fn run_watch<K>(
    api: Api<K>,
    config: watcher::Config,
    wrap: fn(K) -> Object,
    deliver: impl Fn(Change) + 'static,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    actix_rt::spawn(async move {
        let mut stream = watcher(api, config)
            .backoff(WatchBackoff::default())
            .boxed();
        while let Some(item) = stream.next().await {
            let change = match item {
                Ok(watcher::Event::Apply(o)) => Change::Apply(wrap(o)),
                Ok(watcher::Event::Delete(o)) => Change::Delete(wrap(o)),
                Ok(watcher::Event::Init) => Change::Init,
                Ok(watcher::Event::InitApply(o)) => Change::InitApply(wrap(o)),
                Ok(watcher::Event::InitDone) => Change::InitDone,
                Err(e) if not_served(&e) => Change::NotServed(e.to_string()),
                Err(e) => Change::Error(e.to_string()),
            };
            deliver(change);
        }
    });
}

impl Actor for KubeWatcherActor {
    type Context = Context<Self>;

    fn started(&mut self, _: &mut Context<Self>) {
        tracing::info!("watching the API server");
        self.publish_waiting();
        self.start_watchers();
    }
}
traced_actor!(KubeWatcherActor: WatchEvent, SliceEvent);

impl Handler<WatchEvent> for KubeWatcherActor {
    type Result = ();
    fn handle(&mut self, msg: WatchEvent, _: &mut Context<Self>) {
        self.on_change(msg.resource, msg.change);
    }
}

impl Handler<SliceEvent> for KubeWatcherActor {
    type Result = ();
    fn handle(&mut self, msg: SliceEvent, _: &mut Context<Self>) {
        self.on_slice_change(msg.change);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_write_is_not_a_policy_change() {
        let obj: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "cilium.io/v2", "kind": "CiliumNetworkPolicy",
            "metadata": {"name": "p", "namespace": "x", "resourceVersion": "5", "labels": {"a": "b"}},
            "spec": {"endpointSelector": {}},
        }))
        .unwrap();
        let mut later = obj.clone();
        later.metadata.resource_version = Some("6".into());
        later.data["status"] = serde_json::json!({"nodes": {"n1": {"ok": true}}});
        let a = policy_document(Watched::CiliumNetworkPolicy, &obj);
        let b = policy_document(Watched::CiliumNetworkPolicy, &later);
        assert_eq!(a, b);
        later.data["spec"] = serde_json::json!({"endpointSelector": {"matchLabels": {"a": "b"}}});
        let c = policy_document(Watched::CiliumNetworkPolicy, &later);
        assert_ne!(a, c);
        let doc = policy_document(Watched::CiliumNetworkPolicy, &obj);
        let parsed =
            crate::policy::translate::parse_policy(&doc, "default", "test").expect("parses");
        assert_eq!(
            *parsed.key,
            crate::policy::rule::PolicyKey::new(
                crate::policy::rule::PolicyKind::CiliumNetworkPolicy,
                Some("x"),
                "p"
            )
        );
    }

    #[test]
    fn host_network_and_finished_pods_get_no_identity() {
        let pod = |extra: serde_json::Value| -> Pod {
            let mut v = serde_json::json!({"metadata": {"name": "a", "namespace": "x"}});
            for (k, val) in extra.as_object().unwrap() {
                v[k] = val.clone();
            }
            serde_json::from_value(v).unwrap()
        };
        assert!(pod_is_ignored(&pod(
            serde_json::json!({"spec": {"hostNetwork": true, "containers": []}})
        )));
        assert!(pod_is_ignored(&pod(
            serde_json::json!({"status": {"phase": "Succeeded"}})
        )));
        assert!(!pod_is_ignored(&pod(
            serde_json::json!({"status": {"phase": "Running"}})
        )));
    }

    #[test]
    fn watch_backoff_doubles_to_five_seconds_and_resets() {
        use kube::runtime::utils::Backoff;
        let mut b = WatchBackoff::default();
        let waits: Vec<Duration> = (0..8).map(|_| b.next().unwrap()).collect();
        assert!(waits[0] >= Duration::from_millis(200) && waits[0] <= Duration::from_millis(250));
        assert!(waits[1] >= Duration::from_millis(400));
        assert!(waits[7] >= Duration::from_secs(5) && waits[7] <= Duration::from_millis(6250));
        b.reset();
        assert!(b.next().unwrap() <= Duration::from_millis(250));
    }
}
