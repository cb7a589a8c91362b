//! The watch feed, written once for both watchers (the manifest directory and the API server).
//! A watcher only reads objects and converts them ([`crate::objects`]); the feed decides what
//! reaches `PolicyRepoActor`, in which order:
//!
//! - **dedupe**: an object sent again unchanged (a relist, a status write, a touched file) sends
//!   nothing; a delete of an object never sent sends nothing;
//! - **dependency order**: until the initial sync is complete the latest state of each object is
//!   held, then sent in apply order ([`Kind`]), so that identities exist before the rules that
//!   select them (after it, a watcher's batch comes in that order already: the manifest merge
//!   sorts its deltas by `Kind`);
//! - **Services**: socket-level translation (`ServiceLb`) and the `toServices` tracker follow
//!   Services and EndpointSlices, and the policies that use `toServices` are translated again
//!   when what they resolve against changes;
//! - **policies** are translated here and sent as `PolicyUpsert`, or `PolicyRejected` with the
//!   error (the previous version stays enforced).
//!
//! Pure apart from `ServiceLb` (a shared service, not an actor): every call returns the messages
//! to send, and [`ToRepo::send`] sends them.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use serde_yaml::Value;

use super::policy_repo::{
    InitialSyncDone, NamespaceDelete, NamespaceUpsert, NodeDelete, NodeUpsert, PodDelete,
    PodUpsert, PodsUpsert, PolicyDelete, PolicyRejected, PolicyRepoActor, PolicyUpsert,
};
use crate::hashing::HashMap as FastMap;
use crate::introspect::TracedAddr;
use crate::objects::{EndpointSliceInfo, Kind, NamespaceInfo, NodeInfo, PodInfo, ServiceInfo};
use crate::policy::rule::{PolicyKey, PolicyKind};
use crate::policy::services::{ServiceTable, ServiceTracker};
use crate::policy::translate::parse_policy_with_services;
use crate::services::ServiceLb;

/// The namespace of a namespaced policy that names none.
const DEFAULT_NAMESPACE: &str = "default";

/// An object converted to what the agent uses.
#[derive(Debug, Clone)]
pub enum Item {
    Namespace(NamespaceInfo),
    Node(NodeInfo),
    Service(ServiceInfo),
    EndpointSlice(EndpointSliceInfo),
    Pod(PodInfo),
    /// A policy document as `parse_policy` reads it (status and bookkeeping left out), with its
    /// kind.
    Policy(Kind, Value),
}

impl Item {
    pub fn kind(&self) -> Kind {
        match self {
            Item::Namespace(_) => Kind::Namespace,
            Item::Node(_) => Kind::Node,
            Item::Service(_) => Kind::Service,
            Item::EndpointSlice(_) => Kind::EndpointSlice,
            Item::Pod(_) => Kind::Pod,
            Item::Policy(k, _) => *k,
        }
    }

    /// What the object says, hashed to tell a change from a repeat. std's SipHash with a key
    /// drawn once per process (`DefaultHasher::new()`'s fixed key would let a user craft two
    /// versions of an object that hash alike, so that the second is taken for a repeat).
    fn content_hash(&self) -> u64 {
        use std::hash::BuildHasher;
        static KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> =
            std::sync::OnceLock::new();
        let mut h = KEY.get_or_init(Default::default).build_hasher();
        match self {
            Item::Policy(k, doc) => (k, doc).hash(&mut h),
            // The most frequent item: hashed field by field, not through its Debug text.
            Item::Pod(p) => (Kind::Pod, p).hash(&mut h),
            other => format!("{other:?}").hash(&mut h),
        }
        h.finish()
    }
}

/// What an upsert leaves out of its object, if anything, in words naming the object and the
/// fields (an EndpointSlice's addresses that no backend may have; the rest of it is used).
pub fn refused_part(key: &str, item: &Item) -> Option<String> {
    let Item::EndpointSlice(slice) = item else {
        return None;
    };
    let (first, rest) = slice.refused.split_first()?;
    let mut out = format!("EndpointSlice {key}: {first}");
    for r in rest {
        out.push_str(", ");
        out.push_str(r);
    }
    out.push_str(if rest.is_empty() {
        "; not a backend"
    } else {
        "; not backends"
    });
    Some(out)
}

/// Where an object came from: `location` names it in errors and warnings (a file and document,
/// or `Kind ns/name`), `source` is what policy status shows (the file, or `kubernetes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub location: String,
    pub source: String,
}

impl Origin {
    /// An object read from a manifest file.
    pub fn file(location: &str) -> Origin {
        Origin {
            location: location.into(),
            source: location.into(),
        }
    }

    /// An object from the API server.
    pub fn api(kind: Kind, key: &str) -> Origin {
        if kind == Kind::Pod {
            // A pod's origin is never shown (only policies report theirs): no allocation for
            // each of a cluster's pods.
            return Origin {
                location: String::new(),
                source: String::new(),
            };
        }
        Origin {
            location: format!("{kind} {key}"),
            source: "kubernetes".into(),
        }
    }
}

/// A message for `PolicyRepoActor`.
#[derive(Debug)]
pub enum ToRepo {
    Namespace(NamespaceUpsert),
    NamespaceDelete(NamespaceDelete),
    Node(NodeUpsert),
    NodeDelete(NodeDelete),
    Pod(PodUpsert),
    /// Pods of the initial sync, batched.
    Pods(PodsUpsert),
    PodDelete(PodDelete),
    Policy(PolicyUpsert),
    Rejected(PolicyRejected),
    PolicyDelete(PolicyDelete),
    /// The initial state is delivered.
    Synced,
}

impl ToRepo {
    /// How many objects `msgs` carry (a batch counts its pods; `Synced` none).
    pub fn objects(msgs: &[ToRepo]) -> usize {
        msgs.iter()
            .map(|m| match m {
                ToRepo::Pods(b) => b.pods.len(),
                ToRepo::Synced => 0,
                _ => 1,
            })
            .sum()
    }

    pub fn send(self, repo: &TracedAddr<PolicyRepoActor>, from: &'static str) {
        match self {
            ToRepo::Namespace(m) => repo.do_send(m, from),
            ToRepo::NamespaceDelete(m) => repo.do_send(m, from),
            ToRepo::Node(m) => repo.do_send(m, from),
            ToRepo::NodeDelete(m) => repo.do_send(m, from),
            ToRepo::Pod(m) => repo.do_send(m, from),
            ToRepo::Pods(m) => repo.do_send(m, from),
            ToRepo::PodDelete(m) => repo.do_send(m, from),
            ToRepo::Policy(m) => repo.do_send(m, from),
            ToRepo::Rejected(m) => repo.do_send(m, from),
            ToRepo::PolicyDelete(m) => repo.do_send(m, from),
            ToRepo::Synced => repo.do_send(InitialSyncDone, from),
        }
    }
}

/// Pods per message in the initial sync.
const SYNC_BATCH: usize = 4096;

/// An object: its kind and `namespace/name` (`name` when cluster-scoped).
type Key = (Kind, String);

pub struct WatchFeed {
    /// Hash of what was last sent, per object.
    known: FastMap<Key, u64>,
    /// With `hashed_pod_keys`: pods' entries of `known`, by a 64-bit hash of the pod's key
    /// (randomly keyed per process) instead of the key itself: 16 bytes and no allocation per
    /// pod, for agents that track pod relists themselves (endpoint-slice mode).
    pod_hashes: Option<(std::collections::hash_map::RandomState, FastMap<u64, u64>)>,
    /// Until the initial sync is complete: the latest state of each object.
    held: Option<BTreeMap<Key, (Item, Origin)>>,
    /// Services and their EndpointSlice backends, for `toServices`.
    tracker: ServiceTracker,
    /// Policies that use `toServices`, translated again when a service or its backends change.
    service_policies: BTreeMap<Key, (Value, Origin)>,
    /// Service translation (`None`: not wired, e.g. some tests).
    lb: Option<Arc<ServiceLb>>,
}

impl WatchFeed {
    pub fn new(lb: Option<Arc<ServiceLb>>) -> Self {
        WatchFeed {
            known: FastMap::default(),
            pod_hashes: None,
            held: Some(BTreeMap::new()),
            tracker: ServiceTracker::default(),
            service_policies: BTreeMap::new(),
            lb,
        }
    }

    /// Pods are known by a hash of their key (see `pod_hashes`); `keys(Kind::Pod)` then
    /// returns nothing: the caller tracks which pods a relist must delete.
    pub fn with_hashed_pod_keys(mut self) -> Self {
        self.pod_hashes = Some(Default::default());
        self
    }

    /// Records `hash` as what was last sent of `(kind, key)` (`None`: gone). Returns the hash
    /// it replaces.
    fn remember(&mut self, kind: Kind, key: &str, hash: Option<u64>) -> Option<u64> {
        if kind == Kind::Pod {
            if let Some((state, pods)) = &mut self.pod_hashes {
                use std::hash::BuildHasher;
                let h = state.hash_one(key);
                return match hash {
                    Some(v) => pods.insert(h, v),
                    None => pods.remove(&h),
                };
            }
        }
        let k = (kind, key.to_string());
        match hash {
            Some(v) => self.known.insert(k, v),
            None => self.known.remove(&k),
        }
    }

    /// An object appeared or changed.
    pub fn upsert(&mut self, key: &str, item: Item, origin: Origin) -> Vec<ToRepo> {
        let kind = item.kind();
        let hash = item.content_hash();
        if self.remember(kind, key, Some(hash)) == Some(hash) {
            return Vec::new();
        }
        if let Some(refused) = refused_part(key, &item) {
            tracing::warn!(location = %origin.location, "{refused}");
        }
        self.emit((kind, key.to_string()), Some((item, origin)))
    }

    /// An object went away.
    pub fn delete(&mut self, kind: Kind, key: &str) -> Vec<ToRepo> {
        if self.remember(kind, key, None).is_none() {
            return Vec::new();
        }
        self.emit((kind, key.to_string()), None)
    }

    /// The objects of a kind sent so far (a relist deletes those it no longer holds; pods
    /// with `with_hashed_pod_keys`: none).
    pub fn keys(&self, kind: Kind) -> Vec<String> {
        let mut keys: Vec<String> = self
            .known
            .keys()
            .filter(|(k, _)| *k == kind)
            .map(|(_, key)| key.clone())
            .collect();
        keys.sort();
        keys
    }

    pub fn is_synced(&self) -> bool {
        self.held.is_none()
    }

    /// The initial state is complete: what was held, in apply order, then `Synced`. Later
    /// calls return nothing.
    pub fn synced(&mut self) -> Vec<ToRepo> {
        let Some(held) = self.held.take() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (k, state) in held {
            for m in self.deliver(k, Some(state)) {
                // The pods (most of a cluster) go in batches, not a message each.
                match (m, out.last_mut()) {
                    (ToRepo::Pod(p), Some(ToRepo::Pods(b))) if b.pods.len() < SYNC_BATCH => {
                        b.pods.push(p.pod)
                    }
                    (ToRepo::Pod(p), _) => out.push(ToRepo::Pods(PodsUpsert { pods: vec![p.pod] })),
                    (m, _) => out.push(m),
                }
            }
        }
        if let Some(lb) = &self.lb {
            lb.initial_sync_done();
        }
        out.push(ToRepo::Synced);
        out
    }

    /// What `toServices` resolves against.
    pub fn services(&self) -> &ServiceTable {
        self.tracker.table()
    }

    fn emit(&mut self, k: Key, state: Option<(Item, Origin)>) -> Vec<ToRepo> {
        if let Some(held) = &mut self.held {
            // Nothing was delivered yet: a delete only takes back what is held.
            match state {
                Some(state) => held.insert(k, state),
                None => held.remove(&k),
            };
            return Vec::new();
        }
        self.deliver(k, state)
    }

    fn deliver(&mut self, (kind, key): Key, state: Option<(Item, Origin)>) -> Vec<ToRepo> {
        let (namespace, name) = key.split_once('/').unwrap_or(("", &key));
        let (item, origin) = match state {
            Some(s) => s,
            None => return self.deleted(kind, namespace, name, &key),
        };
        match item {
            Item::Namespace(namespace) => vec![ToRepo::Namespace(NamespaceUpsert { namespace })],
            Item::Node(node) => vec![ToRepo::Node(NodeUpsert { node })],
            Item::Pod(pod) => vec![ToRepo::Pod(PodUpsert { pod })],
            Item::Service(s) => {
                if let Some(lb) = &self.lb {
                    lb.set_service(&s.namespace, &s.name, Some(s.spec()));
                }
                let seen = Some((s.labels.clone(), !s.selector.is_empty()));
                let changed = self.tracker.set_service(&s.namespace, &s.name, seen);
                self.translate_again(changed)
            }
            Item::EndpointSlice(slice) => self.set_slice(namespace, name, Some(slice)),
            Item::Policy(_, doc) => self.translate((kind, key.clone()), doc, origin),
        }
    }

    fn deleted(&mut self, kind: Kind, namespace: &str, name: &str, key: &str) -> Vec<ToRepo> {
        match kind {
            Kind::Namespace => vec![ToRepo::NamespaceDelete(NamespaceDelete {
                name: key.into(),
            })],
            Kind::Node => vec![ToRepo::NodeDelete(NodeDelete { name: key.into() })],
            Kind::Pod => vec![ToRepo::PodDelete(PodDelete { key: key.into() })],
            Kind::Service => {
                if let Some(lb) = &self.lb {
                    lb.set_service(namespace, name, None);
                }
                let changed = self.tracker.set_service(namespace, name, None);
                self.translate_again(changed)
            }
            Kind::EndpointSlice => self.set_slice(namespace, name, None),
            policy => {
                self.service_policies.remove(&(policy, key.to_string()));
                vec![ToRepo::PolicyDelete(PolicyDelete {
                    key: policy_key(policy, namespace, name),
                })]
            }
        }
    }

    fn set_slice(
        &mut self,
        namespace: &str,
        name: &str,
        slice: Option<EndpointSliceInfo>,
    ) -> Vec<ToRepo> {
        let key = format!("{namespace}/{name}");
        if let Some(lb) = &self.lb {
            lb.set_slice(&key, slice.as_ref().map(|s| s.spec(namespace)));
        }
        let tracked = slice.map(|s| {
            let ns = if s.namespace.is_empty() {
                namespace.to_string()
            } else {
                s.namespace
            };
            (ns, s.service, s.addresses)
        });
        let changed = self.tracker.set_slice(&key, tracked);
        self.translate_again(changed)
    }

    /// Translates a policy against the current services.
    fn translate(&mut self, k: Key, doc: Value, origin: Origin) -> Vec<ToRepo> {
        let parsed = parse_policy_with_services(
            &doc,
            DEFAULT_NAMESPACE,
            &origin.location,
            self.tracker.table(),
        );
        let (namespace, name) = k.1.split_once('/').unwrap_or(("", &k.1));
        let key = policy_key(k.0, namespace, name);
        if parsed.as_ref().is_ok_and(|p| p.uses_services) {
            self.service_policies.insert(k, (doc, origin.clone()));
        } else {
            self.service_policies.remove(&k);
        }
        match parsed {
            Ok(policy) => {
                for w in &policy.warnings {
                    tracing::warn!(policy = %origin.location, "{w}");
                }
                vec![ToRepo::Policy(PolicyUpsert {
                    policy,
                    source: origin.source,
                })]
            }
            Err(e) => vec![ToRepo::Rejected(PolicyRejected {
                key: Some(key),
                error: e.to_string(),
                source: origin.source,
            })],
        }
    }

    /// The `toServices` policies translated again, when what they resolve against changed.
    fn translate_again(&mut self, changed: bool) -> Vec<ToRepo> {
        if !changed {
            return Vec::new();
        }
        let again: Vec<(Key, (Value, Origin))> = self
            .service_policies
            .iter()
            .map(|(k, d)| (k.clone(), d.clone()))
            .collect();
        again
            .into_iter()
            .flat_map(|(k, (doc, origin))| self.translate(k, doc, origin))
            .collect()
    }
}

fn policy_key(kind: Kind, namespace: &str, name: &str) -> PolicyKey {
    PolicyKey::for_object(kind.name(), namespace, name).unwrap_or_else(|| {
        // Only policy kinds reach here; anything else is a programming error, kept visible.
        PolicyKey::new(PolicyKind::NetworkPolicy, None, name)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn namespace(name: &str) -> Item {
        Item::Namespace(NamespaceInfo {
            name: name.into(),
            labels: Default::default(),
        })
    }

    fn service(name: &str, app: &str) -> Item {
        Item::Service(ServiceInfo {
            namespace: "x".into(),
            name: name.into(),
            labels: [("app".to_string(), app.to_string())].into(),
            selector: Default::default(),
            cluster_ips: vec![],
            ports: vec![],
        })
    }

    fn cnp(name: &str, body: &str) -> Item {
        let doc = format!(
            "apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {{name: {name}, namespace: x}}\nspec:\n{body}"
        );
        Item::Policy(
            Kind::CiliumNetworkPolicy,
            serde_yaml::from_str(&doc).unwrap(),
        )
    }

    fn names(out: &[ToRepo]) -> Vec<String> {
        out.iter()
            .map(|m| match m {
                ToRepo::Namespace(m) => format!("ns+ {}", m.namespace.name),
                ToRepo::NamespaceDelete(m) => format!("ns- {}", m.name),
                ToRepo::Policy(m) => format!("policy+ {}", m.policy.key.short()),
                ToRepo::Rejected(m) => format!("rejected {}", m.key.as_ref().unwrap().short()),
                ToRepo::PolicyDelete(m) => format!("policy- {}", m.key.short()),
                ToRepo::Synced => "synced".into(),
                other => format!("{other:?}"),
            })
            .collect()
    }

    const ALLOW_ALL: &str = "  endpointSelector: {}\n  egress: [{toEndpoints: [{}]}]\n";
    const TO_SERVICES: &str = "  endpointSelector: {}\n  egress: [{toServices: [{k8sServiceSelector: {selector: {matchLabels: {app: db}}}}]}]\n";

    #[test]
    fn the_initial_state_is_held_and_sent_in_apply_order() {
        let mut f = WatchFeed::new(None);
        let o = || Origin::api(Kind::Namespace, "a");
        assert!(f.upsert("x/p", cnp("p", ALLOW_ALL), o()).is_empty());
        assert!(f.upsert("x", namespace("x"), o()).is_empty());
        assert!(f.upsert("gone", namespace("gone"), o()).is_empty());
        assert!(f.delete(Kind::Namespace, "gone").is_empty());
        assert!(!f.is_synced());
        assert_eq!(
            names(&f.synced()),
            ["ns+ x", "policy+ x/p", "synced"],
            "namespaces before the policies that select them; a deleted object is not sent"
        );
        assert!(f.is_synced() && f.synced().is_empty());
        assert_eq!(
            names(&f.upsert("y", namespace("y"), o())),
            ["ns+ y"],
            "after the sync, changes go at once"
        );
    }

    #[test]
    fn pods_known_by_key_hash_are_deduped_and_deleted_the_same() {
        let pod = |ip: &str| {
            Item::Pod(PodInfo {
                namespace: "x".into(),
                name: "a".into(),
                labels: Default::default(),
                ips: vec![ip.parse().unwrap()],
                node: Some("n2".into()),
                service_account: "default".into(),
                named_ports: vec![],
                workload: None,
            })
        };
        for hashed in [false, true] {
            let mut f = WatchFeed::new(None);
            if hashed {
                f = f.with_hashed_pod_keys();
            }
            f.synced();
            let o = || Origin::api(Kind::Pod, "x/a");
            assert_eq!(f.upsert("x/a", pod("10.0.0.1"), o()).len(), 1);
            assert!(
                f.upsert("x/a", pod("10.0.0.1"), o()).is_empty(),
                "unchanged"
            );
            assert_eq!(f.upsert("x/a", pod("10.0.0.2"), o()).len(), 1, "moved");
            assert!(f.delete(Kind::Pod, "x/b").is_empty(), "never sent");
            assert_eq!(f.keys(Kind::Pod).len(), usize::from(!hashed));
            assert!(matches!(
                f.delete(Kind::Pod, "x/a").as_slice(),
                [ToRepo::PodDelete(d)] if d.key == "x/a"
            ));
            assert!(f.delete(Kind::Pod, "x/a").is_empty(), "already gone");
        }
    }

    #[test]
    fn unchanged_objects_and_unknown_deletes_send_nothing() {
        let mut f = WatchFeed::new(None);
        f.synced();
        let o = || Origin::file("a.yaml");
        assert_eq!(names(&f.upsert("x/p", cnp("p", ALLOW_ALL), o())).len(), 1);
        assert!(f.upsert("x/p", cnp("p", ALLOW_ALL), o()).is_empty());
        assert!(f.delete(Kind::CiliumNetworkPolicy, "x/q").is_empty());
        assert_eq!(f.keys(Kind::CiliumNetworkPolicy), ["x/p"]);
        assert_eq!(
            names(&f.delete(Kind::CiliumNetworkPolicy, "x/p")),
            ["policy- x/p"]
        );
        assert!(f.keys(Kind::CiliumNetworkPolicy).is_empty());
    }

    #[test]
    fn to_services_policies_are_translated_again_when_a_service_changes() {
        let mut f = WatchFeed::new(None);
        f.synced();
        let o = || Origin::api(Kind::CiliumNetworkPolicy, "x/p");
        assert_eq!(
            names(&f.upsert("x/p", cnp("p", TO_SERVICES), o())),
            ["policy+ x/p"]
        );
        assert_eq!(names(&f.upsert("x/q", cnp("q", ALLOW_ALL), o())).len(), 1);
        assert_eq!(
            names(&f.upsert("x/db", service("db", "db"), o())),
            ["policy+ x/p"],
            "only the policy that uses toServices"
        );
        assert!(
            f.upsert("x/db", service("db", "db"), o()).is_empty(),
            "the same service again changes nothing"
        );
        assert_eq!(names(&f.delete(Kind::Service, "x/db")), ["policy+ x/p"]);
        f.delete(Kind::CiliumNetworkPolicy, "x/p");
        assert!(f.upsert("x/db", service("db", "db"), o()).is_empty());
    }

    /// An EndpointSlice of service `x/b` whose endpoints hold the given addresses.
    fn slice_of_b(addresses: &[&str]) -> Item {
        let endpoints: Vec<String> = addresses
            .iter()
            .map(|a| format!("- {{addresses: [{a:?}]}}"))
            .collect();
        let slice: k8s_openapi::api::discovery::v1::EndpointSlice = serde_yaml::from_str(&format!(
            "metadata: {{name: b-1, namespace: x, labels: {{kubernetes.io/service-name: b}}}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints:
{}",
            endpoints.join("\n")
        ))
        .unwrap();
        Item::EndpointSlice(crate::objects::endpoint_slice_info(&slice).unwrap())
    }

    #[test]
    fn slice_addresses_no_backend_may_have_are_refused_by_field_and_the_rest_is_used() {
        let lb = Arc::new(ServiceLb::memory(None));
        let mut f = WatchFeed::new(Some(lb.clone()));
        f.synced();
        let o = || Origin::file("b.yaml");
        let svc = Item::Service(ServiceInfo {
            namespace: "x".into(),
            name: "b".into(),
            labels: Default::default(),
            selector: Default::default(),
            cluster_ips: vec!["10.96.0.50".into()],
            ports: vec![crate::services::ServicePort {
                name: "http".into(),
                protocol: crate::policy::rule::PROTO_TCP,
                port: 80,
                target_port: None,
            }],
        });
        f.upsert("x/b", svc, o());
        let slice = slice_of_b(&[
            "10.1.0.2",
            "127.0.0.1",
            "0.0.0.0",
            "169.254.169.254",
            "224.0.0.251",
            "255.255.255.255",
            "::ffff:127.0.0.2",
            "10.1.0.3",
            "::1",
        ]);
        f.upsert("x/b-1", slice.clone(), o());
        let good: Vec<std::net::IpAddr> =
            vec!["10.1.0.2".parse().unwrap(), "10.1.0.3".parse().unwrap()];
        let list = lb.list();
        let backends: Vec<_> = list[0].backends.iter().map(|b| b.ip).collect();
        assert_eq!(backends, good, "only the usable addresses are backends");
        let Item::EndpointSlice(info) = &slice else {
            unreachable!()
        };
        assert_eq!(info.addresses, good, "and all toServices sees");
        assert_eq!(
            info.refused,
            [
                r#"endpoints[1].addresses[0]: "127.0.0.1" is loopback (127.0.0.0/8)"#,
                r#"endpoints[2].addresses[0]: "0.0.0.0" is unspecified"#,
                r#"endpoints[3].addresses[0]: "169.254.169.254" is link-local (169.254.0.0/16)"#,
                r#"endpoints[4].addresses[0]: "224.0.0.251" is multicast (224.0.0.0/4)"#,
                r#"endpoints[5].addresses[0]: "255.255.255.255" is broadcast"#,
                r#"endpoints[6].addresses[0]: "::ffff:127.0.0.2" is loopback (127.0.0.0/8)"#,
                r#"endpoints[8].addresses[0]: "::1" is loopback (::1)"#,
            ]
        );
        // What the log and the manifest status say: the slice, the field, the address.
        assert_eq!(
            refused_part("x/b-1", &slice_of_b(&["10.1.0.2", "127.0.0.1"])).as_deref(),
            Some(
                r#"EndpointSlice x/b-1: endpoints[1].addresses[0]: "127.0.0.1" is loopback (127.0.0.0/8); not a backend"#
            )
        );
        assert_eq!(refused_part("x/b-1", &slice_of_b(&["10.1.0.2"])), None);
        assert_eq!(refused_part("x/db", &service("db", "db")), None);
    }

    #[test]
    fn a_policy_that_does_not_translate_is_rejected_by_name() {
        let mut f = WatchFeed::new(None);
        f.synced();
        let out = f.upsert(
            "x/bad",
            cnp("bad", "  endpointSelector: {matchLabels: 5}\n"),
            Origin::file("bad.yaml"),
        );
        assert_eq!(names(&out), ["rejected x/bad"]);
        match &out[0] {
            ToRepo::Rejected(r) => assert_eq!(r.source, "bad.yaml"),
            _ => unreachable!(),
        }
    }
}
