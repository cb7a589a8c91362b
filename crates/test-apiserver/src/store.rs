//! The object store: objects as JSON by resource, a global resourceVersion counter (as etcd's
//! revision), a bounded per-resource event history for resumed watches, and a broadcast of
//! every change to open watches. Plain structs behind one mutex; no HTTP here.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{json, Map, Value};
use tokio::sync::{broadcast, watch};

use super::patch::{merge_patch, strategic_merge_patch};
use super::resources::{self, ResourceType, StorageKey, CRD_GROUP, CRD_PLURAL};
use super::selector::{FieldSelector, LabelSelector};
use super::ApiError;

/// Events kept per resource for watches that resume from a resourceVersion; older ones are
/// answered with 410 Expired, as a compacted etcd would.
pub const HISTORY_LIMIT: usize = 1000;
/// Events in flight to slow watches before they lag; a lagging watch ends with 410 Expired so
/// its client relists instead of silently missing events.
const BROADCAST_CAPACITY: usize = 4096;

/// The type of a watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// The object was created (or started matching the watch's selectors).
    Added,
    /// The object changed.
    Modified,
    /// The object was deleted (or stopped matching the watch's selectors).
    Deleted,
}

impl EventType {
    /// The wire name: `ADDED`, `MODIFIED`, `DELETED`.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change to one object, as the history and the open watches hold it.
#[derive(Debug)]
pub struct StoredEvent {
    /// The resource the object belongs to.
    pub key: StorageKey,
    /// What happened.
    pub kind: EventType,
    /// The resourceVersion of the change.
    pub rv: u64,
    /// The object after the change (for a deletion: the last state, at the deletion's version).
    pub object: Value,
    /// The object before a modification, so a selector that stops (or starts) matching turns
    /// the change into DELETED (or ADDED), as the real API server does.
    pub old: Option<Value>,
}

/// What a list or watch selects: a namespace (None: all) and label/field selectors.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only objects in this namespace.
    pub namespace: Option<String>,
    /// `labelSelector`.
    pub labels: LabelSelector,
    /// `fieldSelector`.
    pub fields: FieldSelector,
}

impl Filter {
    /// Whether the object is selected.
    pub fn matches(&self, object: &Value) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| namespace_of(object) == ns)
            && self.labels.matches(object)
            && self.fields.matches(object)
    }

    /// How a watch with this filter sees the event, or None when it does not see it.
    pub fn view(&self, event: &StoredEvent) -> Option<EventType> {
        let now = self.matches(&event.object);
        match event.kind {
            EventType::Modified => {
                let before = event.old.as_ref().is_some_and(|o| self.matches(o));
                match (before, now) {
                    (true, true) => Some(EventType::Modified),
                    (false, true) => Some(EventType::Added),
                    (true, false) => Some(EventType::Deleted),
                    (false, false) => None,
                }
            }
            kind => now.then_some(kind),
        }
    }
}

/// A started watch: the events to send first, then the live feed.
pub struct WatchStart {
    /// Events before the live feed: history after the requested version, or a synthetic
    /// ADDED per existing object when no version was given.
    pub backlog: Vec<Arc<StoredEvent>>,
    /// Every change from now on (all resources; the watch filters).
    pub live: broadcast::Receiver<Arc<StoredEvent>>,
    /// The resourceVersion the backlog brings the watch to.
    pub rv: u64,
}

/// Which part of an object a write may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteScope {
    /// The main endpoint: everything but `.status` when the type has a status subresource.
    Main,
    /// The `/status` subresource: only `.status`.
    Status,
    /// In-process test writes: the whole object, status included.
    Whole,
}

/// Patch formats the server accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    /// `application/merge-patch+json` (RFC 7386).
    Merge,
    /// `application/strategic-merge-patch+json` (approximated, see `patch.rs`).
    Strategic,
    /// `application/apply-patch+yaml`, approximated as a merge patch that creates the object
    /// when it is missing (no field ownership).
    Apply,
}

#[derive(Debug, Default)]
struct History {
    /// Every event after this version is in `events`.
    floor: u64,
    events: VecDeque<Arc<StoredEvent>>,
}

#[derive(Debug)]
struct State {
    rv: u64,
    /// Watches from a version below this get 410 (set by `compact`).
    compacted: u64,
    /// Counter for uids and generated names.
    serial: u64,
    types: Vec<ResourceType>,
    objects: HashMap<StorageKey, BTreeMap<(String, String), Value>>,
    history: HashMap<StorageKey, History>,
}

/// The in-memory object store.
#[derive(Debug)]
pub struct Store {
    state: Mutex<State>,
    events: broadcast::Sender<Arc<StoredEvent>>,
    breaker: watch::Sender<u64>,
    /// Bytes sent on watch streams, by resource (`plural.group`).
    watch_bytes: Mutex<std::collections::BTreeMap<String, u64>>,
}

/// `metadata.namespace`, or "".
pub fn namespace_of(object: &Value) -> &str {
    object
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// `metadata.name`, or "".
pub fn name_of(object: &Value) -> &str {
    object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// The object's metadata map, created when missing; None when the body is not an object or its
/// metadata is not an object.
fn metadata_mut(object: &mut Value) -> Option<&mut Map<String, Value>> {
    let obj = object.as_object_mut()?;
    obj.entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()))
        .as_object_mut()
}

fn require_metadata(object: &mut Value) -> Result<&mut Map<String, Value>, ApiError> {
    metadata_mut(object).ok_or_else(|| {
        ApiError::BadRequest("the body is not an object with an object metadata".into())
    })
}

/// The object with apiVersion and kind of the version it is served as.
pub fn present(rt: &ResourceType, object: &Value) -> Value {
    let mut out = object.clone();
    if let Some(o) = out.as_object_mut() {
        o.insert("apiVersion".into(), json!(rt.api_version()));
        o.insert("kind".into(), json!(rt.kind));
    }
    out
}

/// The object without metadata and status: what `metadata.generation` tracks.
fn spec_part(object: &Value) -> Value {
    let mut v = object.clone();
    if let Some(o) = v.as_object_mut() {
        for k in ["metadata", "status", "apiVersion", "kind"] {
            o.remove(k);
        }
    }
    v
}

fn not_found(rt: &ResourceType, name: &str) -> ApiError {
    ApiError::NotFound(format!("{} {name:?} not found", rt.qualified_name()))
}

impl Default for Store {
    fn default() -> Self {
        Self::new()
    }
}

impl Store {
    /// A store with the built-in types and the namespaces every cluster has.
    /// Counts bytes a watch stream of `resource` sent.
    pub fn note_watch_bytes(&self, resource: &str, n: usize) {
        if let Ok(mut m) = self.watch_bytes.lock() {
            *m.entry(resource.to_string()).or_default() += n as u64;
        }
    }

    /// Bytes sent on watch streams so far, by resource (`plural.group`; core: `plural`).
    pub fn watch_bytes(&self) -> std::collections::BTreeMap<String, u64> {
        self.watch_bytes
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default()
    }

    pub fn new() -> Self {
        let (events, _) = broadcast::channel(BROADCAST_CAPACITY);
        let (breaker, _) = watch::channel(0);
        let store = Store {
            state: Mutex::new(State {
                rv: 0,
                compacted: 0,
                serial: 0,
                types: resources::builtin_types(),
                objects: HashMap::new(),
                history: HashMap::new(),
            }),
            events,
            breaker,
            watch_bytes: Default::default(),
        };
        for ns in ["default", "kube-system", "kube-public"] {
            let body = json!({"metadata": {"name": ns}});
            if let Ok(rt) = store.resolve("", "v1", "namespaces") {
                // Cannot fail on an empty store: the names are fresh and valid.
                let _ = store.create(&rt, "", body);
            }
        }
        store
    }

    /// The state; a panic elsewhere while holding the lock leaves consistent data (every
    /// write commits in one step), so a poisoned lock is still usable.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every served type, built-in ones first.
    pub fn types(&self) -> Vec<ResourceType> {
        self.lock().types.clone()
    }

    /// The current resourceVersion.
    pub fn current_rv(&self) -> u64 {
        self.lock().rv
    }

    /// The type served at `group/version/plural`.
    pub fn resolve(
        &self,
        group: &str,
        version: &str,
        plural: &str,
    ) -> Result<ResourceType, ApiError> {
        self.resolve_locked(&self.lock(), group, version, plural)
    }

    fn resolve_locked(
        &self,
        st: &State,
        group: &str,
        version: &str,
        plural: &str,
    ) -> Result<ResourceType, ApiError> {
        st.types
            .iter()
            .find(|t| t.group == group && t.version == version && t.plural == plural)
            .cloned()
            .ok_or_else(|| {
                ApiError::NotFound(format!(
                    "the server could not find the requested resource ({plural} in {group}/{version})"
                ))
            })
    }

    /// The type of objects with this apiVersion and kind.
    pub fn resolve_kind(&self, api_version: &str, kind: &str) -> Result<ResourceType, ApiError> {
        self.lock()
            .types
            .iter()
            .find(|t| t.api_version() == api_version && t.kind == kind)
            .cloned()
            .ok_or_else(|| {
                ApiError::NotFound(format!(
                    "no resource serves kind {kind:?} in {api_version:?}"
                ))
            })
    }

    /// The selected objects and the list's resourceVersion.
    pub fn list(&self, rt: &ResourceType, filter: &Filter) -> (Vec<Value>, u64) {
        let (items, rv, _) = self.list_page(rt, filter, None, None);
        (items, rv)
    }

    /// One page of a list (`limit`/`continue`): the selected objects after the key `after`, in
    /// key order, at most `limit` of them, the current resourceVersion, and the key of the last
    /// one when more remain.
    pub fn list_page(
        &self,
        rt: &ResourceType,
        filter: &Filter,
        after: Option<&(String, String)>,
        limit: Option<usize>,
    ) -> (Vec<Value>, u64, Option<(String, String)>) {
        let st = self.lock();
        let Some(objects) = st.objects.get(&rt.storage_key()) else {
            return (Vec::new(), st.rv, None);
        };
        let range = match after {
            Some(k) => objects.range::<(String, String), _>((
                std::ops::Bound::Excluded(k),
                std::ops::Bound::Unbounded,
            )),
            None => objects.range::<(String, String), _>(..),
        };
        let limit = limit.filter(|l| *l > 0).unwrap_or(usize::MAX);
        let mut items = Vec::new();
        let mut last = None;
        let mut selected = range.filter(|(_, o)| filter.matches(o));
        for (k, o) in selected.by_ref() {
            items.push(present(rt, o));
            last = Some(k.clone());
            if items.len() == limit {
                break;
            }
        }
        let more = items.len() == limit && selected.next().is_some();
        (items, st.rv, if more { last } else { None })
    }

    /// One object (`ns` is "" for cluster-scoped types).
    pub fn get(&self, rt: &ResourceType, ns: &str, name: &str) -> Result<Value, ApiError> {
        let st = self.lock();
        Self::find_locked(&st, rt, ns, name)
            .map(|o| present(rt, o))
            .ok_or_else(|| not_found(rt, name))
    }

    fn find_locked<'a>(
        st: &'a State,
        rt: &ResourceType,
        ns: &str,
        name: &str,
    ) -> Option<&'a Value> {
        st.objects
            .get(&rt.storage_key())
            .and_then(|m| m.get(&(ns.to_string(), name.to_string())))
    }

    /// Creates an object (POST); the body's `.status` is dropped when the type has a status
    /// subresource, as the real API server does.
    pub fn create(&self, rt: &ResourceType, ns: &str, body: Value) -> Result<Value, ApiError> {
        let mut st = self.lock();
        self.create_locked(&mut st, rt, ns, body, WriteScope::Main)
            .map(|o| present(rt, &o))
    }

    fn create_locked(
        &self,
        st: &mut State,
        rt: &ResourceType,
        ns: &str,
        mut body: Value,
        scope: WriteScope,
    ) -> Result<Value, ApiError> {
        st.serial += 1;
        let serial = st.serial;
        let meta = require_metadata(&mut body)?;
        let mut name = meta
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if name.is_empty() {
            let prefix = meta
                .get("generateName")
                .and_then(Value::as_str)
                .unwrap_or("");
            if prefix.is_empty() {
                return Err(ApiError::Invalid(format!(
                    "{} is invalid: metadata.name: Required value: name or generateName is required",
                    rt.kind
                )));
            }
            name = format!("{prefix}{:05x}", serial % 0x10_0000);
        }
        let body_ns = meta
            .get("namespace")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if rt.namespaced {
            if !body_ns.is_empty() && body_ns != ns {
                return Err(ApiError::BadRequest(format!(
                    "the namespace of the provided object ({body_ns}) does not match the namespace sent on the request ({ns})"
                )));
            }
            meta.insert("namespace".into(), json!(ns));
        } else {
            meta.remove("namespace");
        }
        meta.insert("name".into(), json!(name));
        meta.insert("uid".into(), json!(make_uid(serial)));
        meta.insert("creationTimestamp".into(), json!(now()));
        meta.insert("generation".into(), json!(1));
        for server_owned in ["resourceVersion", "deletionTimestamp", "selfLink"] {
            meta.remove(server_owned);
        }
        if rt.plural == "namespaces" && rt.group.is_empty() {
            // The real API server labels every namespace with its name; policies select on it.
            let labels = meta
                .entry("labels")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Some(l) = labels.as_object_mut() {
                l.insert("kubernetes.io/metadata.name".into(), json!(name));
            }
        }
        if rt.namespaced {
            let namespaces: StorageKey = (String::new(), "namespaces".into());
            let exists = st
                .objects
                .get(&namespaces)
                .is_some_and(|m| m.contains_key(&(String::new(), ns.to_string())));
            if !exists {
                return Err(ApiError::NotFound(format!("namespaces {ns:?} not found")));
            }
        }
        if Self::find_locked(st, rt, ns, &name).is_some() {
            return Err(ApiError::AlreadyExists(format!(
                "{} {name:?} already exists",
                rt.qualified_name()
            )));
        }
        if let Some(o) = body.as_object_mut() {
            o.insert("apiVersion".into(), json!(rt.api_version()));
            o.insert("kind".into(), json!(rt.kind));
            if rt.status && scope != WriteScope::Whole {
                o.remove("status");
                match rt.kind.as_str() {
                    "Pod" if rt.group.is_empty() => {
                        o.insert("status".into(), json!({"phase": "Pending"}));
                    }
                    "Namespace" if rt.group.is_empty() => {
                        o.insert("status".into(), json!({"phase": "Active"}));
                    }
                    _ => {}
                }
            }
        }
        let crd_types = if is_crd(rt) {
            let types = resources::types_from_crd(&body)?;
            body["status"] = crd_status(&body);
            Some(types)
        } else {
            None
        };
        let stored = self.commit_locked(st, rt, EventType::Added, body, None);
        if let Some(types) = crd_types {
            register_locked(st, None, types);
        }
        Ok(stored)
    }

    /// Replaces an object (PUT) within `scope`; 409 Conflict when the body carries a stale
    /// `metadata.resourceVersion`.
    pub fn update(
        &self,
        rt: &ResourceType,
        ns: &str,
        name: &str,
        body: Value,
        scope: WriteScope,
    ) -> Result<Value, ApiError> {
        let mut st = self.lock();
        self.update_locked(&mut st, rt, ns, name, body, scope)
            .map(|o| present(rt, &o))
    }

    fn update_locked(
        &self,
        st: &mut State,
        rt: &ResourceType,
        ns: &str,
        name: &str,
        mut body: Value,
        scope: WriteScope,
    ) -> Result<Value, ApiError> {
        let old = Self::find_locked(st, rt, ns, name)
            .cloned()
            .ok_or_else(|| not_found(rt, name))?;
        let meta = require_metadata(&mut body)?;
        match meta.get("name").and_then(Value::as_str) {
            Some(n) if !n.is_empty() && n != name => {
                return Err(ApiError::BadRequest(format!(
                    "the name of the object ({n}) does not match the name on the URL ({name})"
                )))
            }
            _ => {}
        }
        match meta.get("namespace").and_then(Value::as_str) {
            Some(n) if !n.is_empty() && n != ns => {
                return Err(ApiError::BadRequest(format!(
                "the namespace of the object ({n}) does not match the namespace on the URL ({ns})"
            )))
            }
            _ => {}
        }
        let current_rv = old
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .unwrap_or("");
        match meta.get("resourceVersion").and_then(Value::as_str) {
            Some(rv) if !rv.is_empty() && rv != current_rv => {
                return Err(ApiError::Conflict(format!(
                    "Operation cannot be fulfilled on {} {name:?}: the object has been modified; please apply your changes to the latest version and try again",
                    rt.qualified_name()
                )))
            }
            _ => {}
        }
        let mut new = match scope {
            WriteScope::Status => {
                let mut kept = old.clone();
                if let Some(o) = kept.as_object_mut() {
                    match body.get("status") {
                        Some(s) => o.insert("status".into(), s.clone()),
                        None => o.remove("status"),
                    };
                }
                kept
            }
            WriteScope::Main | WriteScope::Whole => {
                if let Some(o) = body.as_object_mut() {
                    if rt.status && scope == WriteScope::Main {
                        match old.get("status") {
                            Some(s) => o.insert("status".into(), s.clone()),
                            None => o.remove("status"),
                        };
                    }
                    o.insert("apiVersion".into(), json!(rt.api_version()));
                    o.insert("kind".into(), json!(rt.kind));
                }
                if let (Some(m), Some(old_meta)) = (metadata_mut(&mut body), old.get("metadata")) {
                    // Identity and server-owned fields survive a replace.
                    for k in [
                        "name",
                        "namespace",
                        "uid",
                        "creationTimestamp",
                        "generation",
                    ] {
                        match old_meta.get(k) {
                            Some(v) => m.insert(k.into(), v.clone()),
                            None => m.remove(k),
                        };
                    }
                }
                body
            }
        };
        if spec_part(&new) != spec_part(&old) {
            let generation = old
                .pointer("/metadata/generation")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            if let Some(m) = metadata_mut(&mut new) {
                m.insert("generation".into(), json!(generation + 1));
            }
        }
        if let Some(m) = metadata_mut(&mut new) {
            m.insert("resourceVersion".into(), json!(current_rv));
        }
        if new == old {
            // A write that changes nothing keeps the version and sends no event, as in Kubernetes.
            return Ok(old);
        }
        let crd_types = if is_crd(rt) {
            Some(resources::types_from_crd(&new)?)
        } else {
            None
        };
        let stored = self.commit_locked(st, rt, EventType::Modified, new, Some(old.clone()));
        if let Some(types) = crd_types {
            register_locked(st, Some(&old), types);
        }
        Ok(stored)
    }

    /// Patches an object within `scope`.
    pub fn patch(
        &self,
        rt: &ResourceType,
        ns: &str,
        name: &str,
        kind: PatchKind,
        patch: &Value,
        scope: WriteScope,
    ) -> Result<Value, ApiError> {
        if !patch.is_object() {
            return Err(ApiError::BadRequest(format!(
                "the patch of {} {name:?} is not a JSON object",
                rt.qualified_name()
            )));
        }
        let mut st = self.lock();
        let Some(current) = Self::find_locked(&st, rt, ns, name).cloned() else {
            if kind == PatchKind::Apply && scope == WriteScope::Main {
                let mut body = patch.clone();
                if let Some(m) = metadata_mut(&mut body) {
                    m.insert("name".into(), json!(name));
                }
                return self
                    .create_locked(&mut st, rt, ns, body, scope)
                    .map(|o| present(rt, &o));
            }
            return Err(not_found(rt, name));
        };
        let mut new = current;
        match kind {
            PatchKind::Merge | PatchKind::Apply => merge_patch(&mut new, patch),
            PatchKind::Strategic => strategic_merge_patch(&mut new, patch),
        }
        self.update_locked(&mut st, rt, ns, name, new, scope)
            .map(|o| present(rt, &o))
    }

    /// Deletes an object and returns its last state. Deleting a namespace deletes what is in
    /// it; deleting a CRD deletes its objects and stops serving its types.
    pub fn delete(&self, rt: &ResourceType, ns: &str, name: &str) -> Result<Value, ApiError> {
        let mut st = self.lock();
        let old = Self::find_locked(&st, rt, ns, name)
            .cloned()
            .ok_or_else(|| not_found(rt, name))?;
        if rt.group.is_empty()
            && rt.plural == "namespaces"
            && !Self::namespace_empty_locked(&st, name)
        {
            // As in Kubernetes, a namespace with content only starts terminating; its content
            // goes when `finalize_namespace` runs (the namespace controller's job), so that
            // `kubectl delete -f` can still delete the namespace's objects one by one.
            let mut terminating = old.clone();
            if let Some(m) = metadata_mut(&mut terminating) {
                m.entry("deletionTimestamp").or_insert_with(|| json!(now()));
            }
            if let Some(o) = terminating.as_object_mut() {
                o.insert("status".into(), json!({"phase": "Terminating"}));
            }
            if terminating == old {
                return Ok(present(rt, &old));
            }
            let stored =
                self.commit_locked(&mut st, rt, EventType::Modified, terminating, Some(old));
            return Ok(present(rt, &stored));
        }
        if is_crd(rt) {
            if let Ok(types) = resources::types_from_crd(&old) {
                if let Some(t) = types.first() {
                    let doomed: Vec<Value> = st
                        .objects
                        .get(&t.storage_key())
                        .map(|m| m.values().cloned().collect())
                        .unwrap_or_default();
                    for o in doomed {
                        self.commit_locked(&mut st, t, EventType::Deleted, o, None);
                    }
                }
            }
            register_locked(&mut st, Some(&old), Vec::new());
        }
        let gone = self.commit_locked(&mut st, rt, EventType::Deleted, old, None);
        Ok(present(rt, &gone))
    }

    fn namespace_empty_locked(st: &State, ns: &str) -> bool {
        st.types.iter().filter(|t| t.namespaced).all(|t| {
            st.objects
                .get(&t.storage_key())
                .is_none_or(|m| m.values().all(|o| namespace_of(o) != ns))
        })
    }

    /// Deletes what is left in a terminating namespace, then the namespace itself (what the
    /// namespace controller does). Does nothing to a namespace that is not terminating.
    pub fn finalize_namespace(&self, name: &str) {
        let mut st = self.lock();
        let Ok(ns_type) = self.resolve_locked(&st, "", "v1", "namespaces") else {
            return;
        };
        let terminating = Self::find_locked(&st, &ns_type, "", name)
            .is_some_and(|o| o.pointer("/metadata/deletionTimestamp").is_some());
        if !terminating {
            return;
        }
        let namespaced: Vec<ResourceType> =
            st.types.iter().filter(|t| t.namespaced).cloned().collect();
        for t in namespaced {
            let doomed: Vec<Value> = st
                .objects
                .get(&t.storage_key())
                .map(|m| {
                    m.values()
                        .filter(|o| namespace_of(o) == name)
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            for o in doomed {
                self.commit_locked(&mut st, &t, EventType::Deleted, o, None);
            }
        }
        if let Some(old) = Self::find_locked(&st, &ns_type, "", name).cloned() {
            self.commit_locked(&mut st, &ns_type, EventType::Deleted, old, None);
        }
    }

    /// Creates the object, or replaces it whole (status included): the in-process helper for
    /// tests that need objects in a state only controllers would produce (pod IPs, phases).
    pub fn apply_whole(&self, body: Value) -> Result<Value, ApiError> {
        let api_version = body.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        let kind = body.get("kind").and_then(Value::as_str).unwrap_or("");
        let rt = self.resolve_kind(api_version, kind)?;
        let ns = if rt.namespaced {
            match namespace_of(&body) {
                "" => "default",
                ns => ns,
            }
        } else {
            ""
        }
        .to_string();
        let name = name_of(&body).to_string();
        let mut st = self.lock();
        let result = if Self::find_locked(&st, &rt, &ns, &name).is_some() {
            let mut body = body;
            if let Some(m) = metadata_mut(&mut body) {
                // A test helper overwrites; it does not race anyone.
                m.remove("resourceVersion");
            }
            self.update_locked(&mut st, &rt, &ns, &name, body, WriteScope::Whole)
        } else {
            self.create_locked(&mut st, &rt, &ns, body, WriteScope::Whole)
        };
        result.map(|o| present(&rt, &o))
    }

    /// Stores a change under a new resourceVersion, records it in the history and sends it to
    /// the open watches (under the lock, so every watch sees changes in version order).
    fn commit_locked(
        &self,
        st: &mut State,
        rt: &ResourceType,
        kind: EventType,
        mut object: Value,
        old: Option<Value>,
    ) -> Value {
        st.rv += 1;
        let rv = st.rv;
        if let Some(m) = metadata_mut(&mut object) {
            m.insert("resourceVersion".into(), json!(rv.to_string()));
        }
        let key = rt.storage_key();
        let id = (
            namespace_of(&object).to_string(),
            name_of(&object).to_string(),
        );
        let objects = st.objects.entry(key.clone()).or_default();
        if kind == EventType::Deleted {
            objects.remove(&id);
        } else {
            objects.insert(id, object.clone());
        }
        let event = Arc::new(StoredEvent {
            key: key.clone(),
            kind,
            rv,
            object: object.clone(),
            old,
        });
        let history = st.history.entry(key).or_default();
        history.events.push_back(event.clone());
        while history.events.len() > HISTORY_LIMIT {
            if let Some(e) = history.events.pop_front() {
                history.floor = e.rv;
            }
        }
        // An error only means no watch is open.
        let _ = self.events.send(event);
        object
    }

    /// Starts a watch: `from` None (no or "0" resourceVersion) begins with a synthetic ADDED
    /// per selected object; a version begins after it, or fails with 410 Expired when the
    /// history no longer reaches back to it.
    pub fn watch(
        &self,
        rt: &ResourceType,
        filter: &Filter,
        from: Option<u64>,
    ) -> Result<WatchStart, ApiError> {
        let st = self.lock();
        let key = rt.storage_key();
        let backlog = match from {
            None => st
                .objects
                .get(&key)
                .map(|m| {
                    m.values()
                        .filter(|o| filter.matches(o))
                        .map(|o| {
                            Arc::new(StoredEvent {
                                key: key.clone(),
                                kind: EventType::Added,
                                rv: st.rv,
                                object: o.clone(),
                                old: None,
                            })
                        })
                        .collect()
                })
                .unwrap_or_default(),
            Some(rv) => {
                let history = st.history.get(&key);
                let floor = history.map_or(0, |h| h.floor).max(st.compacted);
                if rv < floor {
                    return Err(ApiError::Expired(format!(
                        "too old resource version: {rv} ({floor})"
                    )));
                }
                history
                    .map(|h| h.events.iter().filter(|e| e.rv > rv).cloned().collect())
                    .unwrap_or_default()
            }
        };
        Ok(WatchStart {
            backlog,
            live: self.events.subscribe(),
            rv: st.rv,
        })
    }

    /// A receiver that changes whenever `break_watches` is called.
    pub fn watch_breaker(&self) -> watch::Receiver<u64> {
        self.breaker.subscribe()
    }

    /// Ends every open watch stream (clients see the connection end and re-watch).
    pub fn break_watches(&self) {
        self.breaker.send_modify(|n| *n += 1);
    }

    /// Forgets all history and advances the resourceVersion, so every watch resumed from a
    /// version issued before is answered with 410 Expired (clients must relist).
    pub fn compact(&self) {
        let mut st = self.lock();
        st.rv += 1;
        st.compacted = st.rv;
        for h in st.history.values_mut() {
            h.events.clear();
        }
    }
}

fn is_crd(rt: &ResourceType) -> bool {
    rt.group == CRD_GROUP && rt.plural == CRD_PLURAL
}

/// Replaces the types registered by `old` (a CRD's previous state) with `types`.
fn register_locked(st: &mut State, old: Option<&Value>, types: Vec<ResourceType>) {
    let mut gone: Vec<StorageKey> = types.iter().map(ResourceType::storage_key).collect();
    if let Some(old_types) = old.and_then(|o| resources::types_from_crd(o).ok()) {
        gone.extend(old_types.iter().map(ResourceType::storage_key));
    }
    st.types
        .retain(|t| !gone.contains(&t.storage_key()) || is_crd(t));
    st.types.extend(types);
}

/// The status a CRD gets at once (the real API server's controllers set it shortly after).
fn crd_status(crd: &Value) -> Value {
    let time = now();
    let stored: Vec<Value> = crd
        .pointer("/spec/versions")
        .and_then(Value::as_array)
        .map(|vs| {
            vs.iter()
                .filter(|v| v.get("storage").and_then(Value::as_bool) == Some(true))
                .filter_map(|v| v.get("name").cloned())
                .collect()
        })
        .unwrap_or_default();
    json!({
        "acceptedNames": crd.pointer("/spec/names").cloned().unwrap_or(Value::Null),
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
             "message": "no conflicts found", "lastTransitionTime": time},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
             "message": "the initial names have been accepted", "lastTransitionTime": time},
        ],
        "storedVersions": stored,
    })
}

fn now() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// A version-4-shaped uid, unique within the process (serial) and across runs (clock).
fn make_uid(serial: u64) -> String {
    let nanos = chrono::Utc::now()
        .timestamp_nanos_opt()
        .unwrap_or_default()
        .unsigned_abs();
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        (nanos >> 32) as u32,
        (nanos >> 16) as u16,
        (nanos & 0xfff) as u16,
        (serial >> 48) as u16 & 0xfff,
        serial & 0xffff_ffff_ffff
    )
}

#[cfg(test)]
mod tests;
