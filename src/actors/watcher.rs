//! `WatcherActor` in standalone mode: the manifest directory plays the API server.
//!
//! It reads every `*.yaml`/`*.yml`/`*.json` file (several documents per file, `kind: List`
//! too), then watches the directory (inotify through `notify`, debounced) and, on every change,
//! re-reads it and sends only what changed: upserts of new or modified objects, deletes of
//! objects that disappeared (a removed file deletes its objects). A file that does not parse is
//! reported (log and `/debug/policy`) and the objects it held before stay in force.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use actix::{Actor, AsyncContext, Context, Handler, Message};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use serde_yaml::Value;

use super::policy_repo::{
    InitialSyncDone, ManifestStatus, NamespaceDelete, NamespaceUpsert, NodeDelete, NodeUpsert,
    PodDelete, PodUpsert, PolicyDelete, PolicyRejected, PolicyRepoActor, PolicyUpsert,
    ServiceUpsert,
};
use crate::agent::introspect::{Traceable, TracedAddr};
use crate::agent::objects::{
    endpoint_slice_info, namespace_info, node_info, pod_info, service_info, ServiceInfo,
};
use crate::policy::rule::{PolicyKey, PolicyKind};
use crate::policy::services::ServiceTracker;
use crate::policy::translate::parse_policy_with_services;
use crate::traced_actor;

const NAME: &str = "WatcherActor";
const DEFAULT_NAMESPACE: &str = "default";

/// Objects are keyed by (apply order, kind, namespace, name): namespaces before pods, pods
/// before policies, so identities exist before the rules that select them.
type ObjKey = (u8, String, String, String);

/// What the watcher remembers of an object: a hash of its content (to tell changes) and where
/// it came from. The documents themselves are not kept.
#[derive(Debug, Clone, PartialEq)]
struct Obj {
    hash: u64,
    location: String,
}

fn content_hash(v: &Value) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.hash(&mut h);
    h.finish()
}

fn kind_order(kind: &str) -> Option<u8> {
    Some(match kind {
        "Namespace" => 0,
        "Node" => 1,
        "Service" | "EndpointSlice" => 2,
        "Pod" => 3,
        "NetworkPolicy" | "CiliumNetworkPolicy" | "CiliumClusterwideNetworkPolicy" => 4,
        _ => return None,
    })
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    let mut v = v;
    for p in path {
        v = v.get(p)?;
    }
    v.as_str()
}

fn object_key(doc: &Value) -> Option<ObjKey> {
    let kind = str_at(doc, &["kind"])?;
    let order = kind_order(kind)?;
    let name = str_at(doc, &["metadata", "name"]).unwrap_or("").to_string();
    let cluster_scoped = matches!(
        kind,
        "Namespace" | "Node" | "CiliumClusterwideNetworkPolicy"
    );
    let ns = if cluster_scoped {
        String::new()
    } else {
        str_at(doc, &["metadata", "namespace"])
            .filter(|s| !s.is_empty())
            .unwrap_or(DEFAULT_NAMESPACE)
            .to_string()
    };
    Some((order, kind.to_string(), ns, name))
}

/// Reads the documents of one file (a `kind: List` contributes its items).
fn read_documents(path: &Path) -> Result<Vec<Value>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read: {e}"))?;
    let mut docs = Vec::new();
    for de in serde_yaml::Deserializer::from_str(&text) {
        let v: Value =
            serde::Deserialize::deserialize(de).map_err(|e| format!("not valid YAML: {e}"))?;
        match v {
            Value::Null => {}
            v if str_at(&v, &["kind"]) == Some("List") => {
                if let Some(items) = v.get("items").and_then(Value::as_sequence) {
                    docs.extend(items.iter().cloned());
                }
            }
            v => docs.push(v),
        }
    }
    Ok(docs)
}

fn manifest_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with('.') || name.ends_with('~') {
            continue;
        }
        if p.is_dir() {
            manifest_files(&p, out);
        } else if matches!(
            p.extension().and_then(|x| x.to_str()),
            Some("yaml" | "yml" | "json")
        ) {
            out.push(p);
        }
    }
}

pub struct WatcherActor {
    dir: PathBuf,
    repo: TracedAddr<PolicyRepoActor>,
    objects: BTreeMap<ObjKey, Obj>,
    /// The objects each file held when it last parsed.
    by_file: BTreeMap<PathBuf, Vec<ObjKey>>,
    file_errors: BTreeMap<PathBuf, String>,
    watcher: Option<RecommendedWatcher>,
    me: Option<TracedAddr<WatcherActor>>,
    /// A rescan is scheduled (changes within `DEBOUNCE` share it).
    rescan_scheduled: bool,
    /// Services and their EndpointSlice backends, for `toServices`.
    services: ServiceTracker,
    /// Policies with `toServices` (document and location): translated again when a service or
    /// its backends change.
    service_policies: BTreeMap<ObjKey, (Value, String)>,
}

/// Edits within this window share one rescan (editors write files in several steps).
const DEBOUNCE: Duration = Duration::from_millis(150);

impl WatcherActor {
    pub fn new(dir: PathBuf, repo: TracedAddr<PolicyRepoActor>) -> Self {
        WatcherActor {
            dir,
            repo,
            objects: BTreeMap::new(),
            by_file: BTreeMap::new(),
            file_errors: BTreeMap::new(),
            watcher: None,
            me: None,
            rescan_scheduled: false,
            services: ServiceTracker::default(),
            service_policies: BTreeMap::new(),
        }
    }

    /// Gives the actor its own traced address (for the file-watch thread).
    pub fn with_self(mut self, me: TracedAddr<WatcherActor>) -> Self {
        self.me = Some(me);
        self
    }

    fn rel(&self, p: &Path) -> String {
        p.strip_prefix(&self.dir).unwrap_or(p).display().to_string()
    }

    /// Re-reads the directory and sends the differences.
    fn rescan(&mut self) -> Result<usize, String> {
        let mut files = Vec::new();
        manifest_files(&self.dir, &mut files);
        files.sort();
        let mut objects: BTreeMap<ObjKey, Obj> = BTreeMap::new();
        let mut by_file: BTreeMap<PathBuf, Vec<ObjKey>> = BTreeMap::new();
        // Documents that are new or changed, to send once the new state is complete.
        let mut changed: Vec<(ObjKey, Value, String)> = Vec::new();
        for f in &files {
            let rel = self.rel(f);
            match read_documents(f) {
                Ok(docs) => {
                    let mut keys = Vec::new();
                    for (i, doc) in docs.into_iter().enumerate() {
                        let location = format!("{rel}#{i}");
                        let Some(k) = object_key(&doc) else {
                            tracing::debug!(%location, "ignoring a document of a kind the agent does not use");
                            continue;
                        };
                        let hash = content_hash(&doc);
                        if let Some(prev) = objects.get(&k) {
                            tracing::warn!(object = ?k, first = %prev.location, second = %location, "object defined twice; the later one wins");
                        }
                        if self.objects.get(&k).map(|o| o.hash) != Some(hash) {
                            changed.retain(|(ck, _, _)| ck != &k);
                            changed.push((k.clone(), doc, location.clone()));
                        }
                        objects.insert(k.clone(), Obj { hash, location });
                        keys.push(k);
                    }
                    if self.file_errors.remove(f).is_some() {
                        self.repo.do_send(
                            ManifestStatus {
                                file: rel.clone(),
                                error: None,
                            },
                            NAME,
                        );
                    }
                    by_file.insert(f.clone(), keys);
                }
                Err(e) => {
                    tracing::warn!(file = %rel, error = %e, "manifest not loaded; its previous objects stay in force");
                    if self.file_errors.get(f) != Some(&e) {
                        self.repo.do_send(
                            ManifestStatus {
                                file: rel.clone(),
                                error: Some(e.clone()),
                            },
                            NAME,
                        );
                    }
                    self.file_errors.insert(f.clone(), e);
                    // Keep what this file held before, unchanged.
                    let keys = self.by_file.get(f).cloned().unwrap_or_default();
                    for k in &keys {
                        if let Some(o) = self.objects.get(k) {
                            objects.insert(k.clone(), o.clone());
                        }
                    }
                    by_file.insert(f.clone(), keys);
                }
            }
        }
        // Files that vanished take their objects with them (and their errors).
        for f in self
            .file_errors
            .keys()
            .filter(|f| !by_file.contains_key(*f))
            .cloned()
            .collect::<Vec<_>>()
        {
            self.file_errors.remove(&f);
            self.repo.do_send(
                ManifestStatus {
                    file: self.rel(&f),
                    error: None,
                },
                NAME,
            );
        }
        let mut sent = 0;
        // Deletes in reverse apply order (policies before pods before namespaces).
        let gone: Vec<ObjKey> = self
            .objects
            .keys()
            .rev()
            .filter(|k| !objects.contains_key(*k))
            .cloned()
            .collect();
        for k in gone {
            self.send_delete(&k);
            sent += 1;
        }
        changed.sort_by(|a, b| a.0.cmp(&b.0));
        for (k, doc, location) in &changed {
            self.send_upsert(k, doc, location);
            sent += 1;
        }
        self.objects = objects;
        self.by_file = by_file;
        Ok(sent)
    }

    /// Translates every `toServices` policy again against the current services.
    fn resend_service_policies(&mut self) {
        let docs: Vec<(ObjKey, (Value, String))> = self
            .service_policies
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (k, (doc, location)) in docs {
            self.send_upsert(&k, &doc, &location);
        }
    }

    fn send_upsert(&mut self, k: &ObjKey, value: &Value, location: &str) {
        let (_, kind, ns, name) = k;
        let report = |e: String| {
            tracing::warn!(%location, error = %e, "object not usable");
            self.repo.do_send(
                ManifestStatus {
                    file: location.to_string(),
                    error: Some(e),
                },
                NAME,
            );
        };
        match kind.as_str() {
            "Namespace" => match serde_yaml::from_value::<Namespace>(value.clone())
                .map_err(|e| e.to_string())
                .and_then(|n| namespace_info(&n))
            {
                Ok(namespace) => self.repo.do_send(NamespaceUpsert { namespace }, NAME),
                Err(e) => report(e),
            },
            "Node" => match serde_yaml::from_value::<Node>(value.clone())
                .map_err(|e| e.to_string())
                .and_then(|n| node_info(&n))
            {
                Ok(node) => self.repo.do_send(NodeUpsert { node }, NAME),
                Err(e) => report(e),
            },
            "Service" => match serde_yaml::from_value::<Service>(value.clone())
                .map_err(|e| e.to_string())
                .and_then(|s| service_info(&s, ns))
            {
                Ok(service) => {
                    let changed = self.services.set_service(
                        &service.namespace,
                        &service.name,
                        Some((service.labels.clone(), !service.selector.is_empty())),
                    );
                    self.repo.do_send(
                        ServiceUpsert {
                            service,
                            deleted: false,
                        },
                        NAME,
                    );
                    if changed {
                        self.resend_service_policies();
                    }
                }
                Err(e) => report(e),
            },
            "EndpointSlice" => match serde_yaml::from_value::<EndpointSlice>(value.clone())
                .map_err(|e| e.to_string())
                .and_then(|s| endpoint_slice_info(&s))
            {
                Ok(slice) => {
                    let key = format!("{ns}/{name}");
                    let namespace = if slice.namespace.is_empty() {
                        ns.clone()
                    } else {
                        slice.namespace
                    };
                    if self
                        .services
                        .set_slice(&key, Some((namespace, slice.service, slice.addresses)))
                    {
                        self.resend_service_policies();
                    }
                }
                Err(e) => report(e),
            },
            "Pod" => match serde_yaml::from_value::<Pod>(value.clone())
                .map_err(|e| e.to_string())
                .and_then(|p| pod_info(&p, ns))
            {
                Ok(pod) => self.repo.do_send(PodUpsert { pod }, NAME),
                Err(e) => report(e),
            },
            _ => match parse_policy_with_services(
                value,
                DEFAULT_NAMESPACE,
                location,
                self.services.table(),
            ) {
                Ok(policy) => {
                    if policy.uses_services {
                        self.service_policies
                            .insert(k.clone(), (value.clone(), location.to_string()));
                    } else {
                        self.service_policies.remove(k);
                    }
                    for w in &policy.warnings {
                        tracing::warn!(%location, "{w}");
                    }
                    self.repo.do_send(
                        PolicyUpsert {
                            policy,
                            source: location.to_string(),
                        },
                        NAME,
                    )
                }
                Err(e) => self.repo.do_send(
                    PolicyRejected {
                        key: policy_key(k),
                        error: e.to_string(),
                        source: location.to_string(),
                    },
                    NAME,
                ),
            },
        }
    }

    fn send_delete(&mut self, k: &ObjKey) {
        let (_, kind, ns, name) = k;
        match kind.as_str() {
            "EndpointSlice" => {
                if self.services.set_slice(&format!("{ns}/{name}"), None) {
                    self.resend_service_policies();
                }
            }
            "Namespace" => self
                .repo
                .do_send(NamespaceDelete { name: name.clone() }, NAME),
            "Node" => self.repo.do_send(NodeDelete { name: name.clone() }, NAME),
            "Service" => {
                if self.services.set_service(ns, name, None) {
                    self.resend_service_policies();
                }
                self.repo.do_send(
                    ServiceUpsert {
                        service: ServiceInfo {
                            namespace: ns.clone(),
                            name: name.clone(),
                            labels: Default::default(),
                            selector: Default::default(),
                            cluster_ips: vec![],
                        },
                        deleted: true,
                    },
                    NAME,
                );
            }
            "Pod" => self.repo.do_send(
                PodDelete {
                    key: format!("{ns}/{name}"),
                },
                NAME,
            ),
            _ => {
                self.service_policies.remove(k);
                if let Some(key) = policy_key(k) {
                    self.repo.do_send(PolicyDelete { key }, NAME);
                }
            }
        }
    }
}

fn policy_key(k: &ObjKey) -> Option<PolicyKey> {
    let (_, kind, ns, name) = k;
    let kind = PolicyKind::from_kind(kind)?;
    (!name.is_empty())
        .then(|| PolicyKey::new(kind, kind.is_namespaced().then_some(ns.as_str()), name))
}

impl Actor for WatcherActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Watch first, then read: a change in between is seen by the watch. Reads (ours
        // included) are not changes: only events that modify the tree count.
        if let Some(me) = self.me.clone() {
            let handler = move |res: notify::Result<Event>| match res {
                Ok(ev) if matches!(ev.kind, EventKind::Access(_)) => {}
                Ok(_) => me.do_send(FilesChanged, "inotify"),
                Err(e) => {
                    tracing::warn!(error = %e, "file watch error; rescanning");
                    me.do_send(FilesChanged, "inotify");
                }
            };
            match notify::recommended_watcher(handler) {
                Ok(mut w) => match w.watch(&self.dir, RecursiveMode::Recursive) {
                    Ok(()) => self.watcher = Some(w),
                    Err(e) => {
                        tracing::error!(dir = %self.dir.display(), error = %e, "cannot watch the manifest directory; edits need a restart")
                    }
                },
                Err(e) => tracing::error!(error = %e, "cannot start the file watcher"),
            }
        }
        match self.rescan() {
            Ok(n) => {
                tracing::info!(dir = %self.dir.display(), objects = self.objects.len(), events = n, "manifests loaded")
            }
            Err(e) => tracing::error!(error = %e, "initial manifest scan failed"),
        }
        self.repo.do_send(InitialSyncDone, NAME);
        // A periodic rescan backs the watch up (missed events, replaced directories).
        if let Some(me) = self.me.clone() {
            ctx.run_interval(Duration::from_secs(30), move |_, _| {
                me.do_send(Rescan { reason: "periodic" }, NAME)
            });
        }
    }
}
traced_actor!(WatcherActor: Rescan, FilesChanged);

/// Re-read the manifest directory.
#[derive(Debug, Message)]
#[rtype(result = "Result<usize, String>")]
pub struct Rescan {
    pub reason: &'static str,
}

impl Traceable for Rescan {
    const KIND: &'static str = "Rescan";
    fn summary(&self) -> String {
        self.reason.to_string()
    }
}

impl Handler<Rescan> for WatcherActor {
    type Result = Result<usize, String>;
    fn handle(&mut self, _: Rescan, _: &mut Context<Self>) -> Self::Result {
        self.rescan()
    }
}

/// Something in the manifest directory changed: rescan after `DEBOUNCE`.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct FilesChanged;

impl Traceable for FilesChanged {
    const KIND: &'static str = "FilesChanged";
    fn summary(&self) -> String {
        String::new()
    }
}

impl Handler<FilesChanged> for WatcherActor {
    type Result = ();
    fn handle(&mut self, _: FilesChanged, ctx: &mut Context<Self>) {
        if self.rescan_scheduled {
            return;
        }
        self.rescan_scheduled = true;
        ctx.run_later(DEBOUNCE, |act, _| {
            act.rescan_scheduled = false;
            if let Some(me) = &act.me {
                me.do_send(
                    Rescan {
                        reason: "file change",
                    },
                    NAME,
                );
            }
        });
    }
}
