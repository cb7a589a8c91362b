//! `ClusterIndex`: the cluster objects that carry identities (pods, namespaces, nodes), turned
//! into identity and ipcache changes on the policy engine, pure and unit-tested with small
//! structs (linkerd's policy-controller `Index::apply` in spirit). `PolicyRepoActor` owns one,
//! feeds it watch events and sends on what each change returns.
//!
//! - A pod's identity comes from its labels, its namespace's labels and its service account
//!   (`Labels::for_pod`); its addresses map to that identity in the ipcache.
//! - A namespace change re-labels every pod in it.
//! - A node's addresses are `host` (this node) or `remote-node`.
//! - Who holds an address is the `AddressBook`'s decision (`objects::addresses`): this node's
//!   pods and endpoints and every node's addresses outrank what another node says of its pods;
//!   an address that is never a pod's, or that lies in this node's pod CIDRs (or outside the
//!   claiming pod's node's), is refused. Refusals and outranked claims are reported
//!   (`IndexChange::conflicts`) and change nothing.
//! - Identities are reference-counted by the engine: every allocation here is released when
//!   the pod goes or moves to another identity.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::addresses::{not_a_pod_address, AddressBook, Claim, Effect, Holder, Rank};
use super::{NamespaceInfo, NodeInfo, PodInfo};
use crate::hashing::{HashMap, HashSet};
use crate::policy::engine::{NamedPort, PolicyEngine};
use crate::policy::identity::{Allocation, NumericIdentity, IDENTITY_HOST};
use crate::policy::ipcache::IpcacheChange;
use crate::policy::labels::Labels;

/// A pod as the index holds it, compactly: its name is its key's; namespace, node, service
/// account, label map and named ports are shared with the other pods that have the same
/// (`ClusterIndex` interns them); its addresses are a boxed slice. Its identity label set is
/// not kept per pod either: pods of one deployment share it through their identity
/// (`PolicyEngine::identity`), and `record_labels` derives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRecord {
    pub namespace: Arc<str>,
    pub labels: Arc<BTreeMap<String, String>>,
    pub ips: Box<[IpAddr]>,
    pub node: Option<Arc<str>>,
    pub service_account: Arc<str>,
    pub named_ports: Arc<[NamedPort]>,
    pub identity: NumericIdentity,
}

impl PodRecord {
    /// The pod as a `PodInfo` again (`key`: its `namespace/name`), without its workload (which
    /// the index does not keep; `runtime::Shared::workloads` does).
    pub fn info(&self, key: &str) -> PodInfo {
        let name = key.split_once('/').map_or(key, |(_, n)| n);
        PodInfo {
            namespace: self.namespace.to_string(),
            name: name.to_string(),
            labels: self.labels.clone(),
            ips: self.ips.to_vec(),
            node: self.node.as_deref().map(str::to_string),
            service_account: self.service_account.to_string(),
            named_ports: self.named_ports.to_vec(),
            workload: None,
        }
    }

    /// Whether `info` says what this record holds.
    fn holds(&self, info: &PodInfo) -> bool {
        *self.namespace == *info.namespace
            && self.labels == info.labels
            && *self.ips == info.ips[..]
            && self.node.as_deref() == info.node.as_deref()
            && *self.service_account == *info.service_account
            && *self.named_ports == info.named_ports[..]
    }
}

/// One shared copy of each distinct value (namespace, node and service-account names; named
/// port lists), dropped when the last pod holding it goes.
#[derive(Debug, Default)]
struct Interned {
    strings: HashSet<Arc<str>>,
    ports: HashSet<Arc<[NamedPort]>>,
}

impl Interned {
    fn string(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.strings.get(s) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(s);
        self.strings.insert(a.clone());
        a
    }

    fn ports(&mut self, p: &[NamedPort]) -> Arc<[NamedPort]> {
        if let Some(a) = self.ports.get(p) {
            return a.clone();
        }
        let a: Arc<[NamedPort]> = Arc::from(p);
        self.ports.insert(a.clone());
        a
    }

    /// A removed record's values (still held by it): the shared copies no other pod holds go.
    fn forget(&mut self, r: &PodRecord) {
        for s in [
            Some(&r.namespace),
            r.node.as_ref(),
            Some(&r.service_account),
        ]
        .into_iter()
        .flatten()
        {
            if Arc::strong_count(s) <= 2 {
                self.strings.remove(s);
            }
        }
        if Arc::strong_count(&r.named_ports) <= 2 {
            self.ports.remove(&r.named_ports);
        }
    }
}

/// What one change did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct IndexChange {
    /// Identities whose selecting endpoints must regenerate (the old and the new identity of
    /// a pod that changed).
    pub affected: BTreeSet<NumericIdentity>,
    /// Ipcache changes, in order.
    pub ipcache: Vec<IpcacheChange>,
    /// Pods (`namespace/name`) whose labels or named ports changed or that went away: local
    /// endpoints of these pods follow them.
    pub pods: Vec<String>,
    /// Addresses refused or outranked, each said by the pod and the field (logged and counted
    /// by the caller; they changed nothing).
    pub conflicts: Vec<String>,
}

impl IndexChange {
    pub fn is_empty(&self) -> bool {
        self.affected.is_empty()
            && self.ipcache.is_empty()
            && self.pods.is_empty()
            && self.conflicts.is_empty()
    }

    pub fn extend(&mut self, other: IndexChange) {
        self.affected.extend(other.affected);
        self.ipcache.extend(other.ipcache);
        self.pods.extend(other.pods);
        self.conflicts.extend(other.conflicts);
    }
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct ClusterIndex {
    namespaces: HashMap<String, NamespaceInfo>,
    /// Boxed: the table then holds a key and a pointer per pod (its free slots cost 32
    /// bytes, not a whole record's), and a resize moves no records. The key is shared with
    /// the pod's claims in `addresses`.
    pods: HashMap<Arc<str>, Box<PodRecord>>,
    /// One copy of each distinct pod label map, shared by the pods that have it.
    label_maps: HashSet<Arc<BTreeMap<String, String>>>,
    interned: Interned,
    nodes: BTreeMap<String, NodeInfo>,
    /// Who holds each pod, endpoint and node address.
    addresses: AddressBook,
    /// This node's name: its pods outrank other nodes' (`None`: every pod with a node is
    /// another node's; pods without one are local, as in standalone mode).
    local_node: Option<String>,
    /// The addresses of this node's native devices (`set_device_addresses`).
    device_addresses: BTreeSet<IpAddr>,
}

impl ClusterIndex {
    /// The index of the agent of node `name`.
    pub fn for_node(name: &str) -> ClusterIndex {
        ClusterIndex {
            local_node: Some(name.to_string()),
            ..Default::default()
        }
    }

    /// Who holds `ip` now (the claim in force).
    pub fn holder(&self, ip: IpAddr) -> Option<&Claim> {
        self.addresses.holder(ip)
    }

    /// How much a pod on `node` is trusted about its addresses.
    fn rank_of(&self, node: Option<&str>) -> Rank {
        match (node, &self.local_node) {
            (None, _) => Rank::LocalPod,
            (Some(n), Some(l)) if n == l => Rank::LocalPod,
            _ => Rank::RemotePod,
        }
    }

    fn pod_cidrs(&self, node: &str) -> Vec<IpNet> {
        self.nodes
            .get(node)
            .map(|n| n.pod_cidrs.iter().filter_map(|c| c.parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Why the pod `key` on `node` (ranked `rank`) may not claim `ip` at all, if it may not.
    fn refusal(&self, rank: Rank, node: Option<&str>, ip: IpAddr) -> Option<String> {
        if let Some(why) = not_a_pod_address(ip) {
            return Some(format!("{ip} is {why}, never a pod address"));
        }
        if rank != Rank::RemotePod {
            return None;
        }
        if let Some(local) = &self.local_node {
            if let Some(c) = self.pod_cidrs(local).iter().find(|c| c.contains(&ip)) {
                return Some(format!(
                    "{ip} is in this node's ({local}) pod CIDR {c}: only this node's pods have it"
                ));
            }
        }
        let node = node.unwrap_or_default();
        let cidrs = self.pod_cidrs(node);
        if !cidrs.is_empty() && !cidrs.iter().any(|c| c.contains(&ip)) {
            let list: Vec<String> = cidrs.iter().map(ToString::to_string).collect();
            return Some(format!(
                "{ip} is outside node {node}'s pod CIDRs ({})",
                list.join(", ")
            ));
        }
        None
    }

    /// Applies what a claim or release did to the engine's ipcache.
    fn effect(engine: &mut PolicyEngine, ip: IpAddr, e: &Effect, out: &mut Vec<IpcacheChange>) {
        if !e.changed() {
            return;
        }
        match &e.after {
            Some(c) => {
                engine.upsert_endpoint_ip(ip, c.identity);
                out.push(IpcacheChange::Upsert(IpNet::from(ip), c.identity));
            }
            None => {
                engine.remove_endpoint_ip(ip);
                out.push(IpcacheChange::Remove(IpNet::from(ip)));
            }
        }
    }

    /// A local endpoint (of pod `key`) holds `ips` with `identity` (again, after an identity
    /// change). Returns the ipcache changes.
    pub fn claim_endpoint(
        &mut self,
        engine: &mut PolicyEngine,
        key: &str,
        ips: &[IpAddr],
        identity: NumericIdentity,
    ) -> Vec<IpcacheChange> {
        let mut out = Vec::new();
        let holder = Holder::Endpoint(Arc::from(key));
        for ip in ips {
            let claim = Claim {
                rank: Rank::LocalPod,
                holder: holder.clone(),
                identity,
            };
            let e = self.addresses.claim(*ip, claim);
            Self::effect(engine, *ip, &e, &mut out);
        }
        out
    }

    /// A local endpoint went away: it lets go of its addresses.
    pub fn release_endpoint(
        &mut self,
        engine: &mut PolicyEngine,
        key: &str,
        ips: &[IpAddr],
    ) -> Vec<IpcacheChange> {
        let mut out = Vec::new();
        let holder = Holder::Endpoint(Arc::from(key));
        for ip in ips {
            let e = self.addresses.release(*ip, &holder);
            Self::effect(engine, *ip, &e, &mut out);
        }
        out
    }
    pub fn pod(&self, key: &str) -> Option<&PodRecord> {
        self.pods.get(key).map(|b| &**b)
    }

    pub fn has_pod(&self, key: &str) -> bool {
        self.pods.contains_key(key)
    }

    pub fn nodes(&self) -> &BTreeMap<String, NodeInfo> {
        &self.nodes
    }

    /// The shared copy of a pod label map equal to `labels`.
    fn shared_labels(
        &mut self,
        labels: Arc<BTreeMap<String, String>>,
    ) -> Arc<BTreeMap<String, String>> {
        if let Some(shared) = self.label_maps.get(&labels) {
            return shared.clone();
        }
        self.label_maps.insert(labels.clone());
        labels
    }

    /// A removed pod's label map (`labels`, still held by the removed record): the shared copy
    /// goes when no other pod holds it (held by the set and the removed record only).
    fn forget_labels(&mut self, labels: &Arc<BTreeMap<String, String>>) {
        if Arc::strong_count(labels) <= 2 {
            self.label_maps.remove(labels);
        }
    }

    /// The identity labels of a pod: its own, its namespace's, its service account.
    pub fn pod_labels(&self, info: &PodInfo) -> Labels {
        self.labels_for(&info.namespace, &info.labels, &info.service_account)
    }

    /// `pod_labels` of a pod the index holds.
    pub fn record_labels(&self, r: &PodRecord) -> Labels {
        self.labels_for(&r.namespace, &r.labels, &r.service_account)
    }

    fn labels_for(
        &self,
        namespace: &str,
        labels: &BTreeMap<String, String>,
        service_account: &str,
    ) -> Labels {
        let empty = BTreeMap::new();
        let ns_labels = self
            .namespaces
            .get(namespace)
            .map(|n| &n.labels)
            .unwrap_or(&empty);
        Labels::for_pod(namespace, labels, ns_labels, Some(service_account))
    }

    /// A pod's new state (`None`: it was deleted).
    pub fn apply_pod(
        &mut self,
        engine: &mut PolicyEngine,
        key: &str,
        info: Option<PodInfo>,
    ) -> IndexChange {
        let mut change = IndexChange::default();
        let new = info.map(|mut i| {
            i.labels = self.shared_labels(i.labels);
            let labels = self.pod_labels(&i);
            (i, labels)
        });
        let old = self.pods.get(key);
        if let (Some(o), Some((ni, nl))) = (old, &new) {
            // Unchanged when the labels it has now still name the identity it holds (a
            // namespace's label change re-applies its pods with the same info).
            if o.holds(ni) && engine.identities().lookup_labels(nl) == Some(o.identity) {
                return change;
            }
        }
        if old.is_none() && new.is_none() {
            return change;
        }
        let holder_key: Arc<str> = match self.pods.get_key_value(key) {
            Some((k, _)) => k.clone(),
            None => Arc::from(key),
        };
        let old = self.pods.remove(key);
        let new_rec = new.map(|(info, labels)| {
            let allocation = engine.allocate_identity(&labels);
            let identity = allocation.id();
            let ports_changed = engine.add_named_ports(identity, &info.named_ports);
            // Policy is by identity: another pod of an identity that exists (with named ports
            // it already had) changes only the ipcache, not what any endpoint's policy says.
            if matches!(allocation, Allocation::New(_)) || ports_changed {
                change
                    .affected
                    .extend(engine.endpoints_affected_by_identity(identity));
            }
            let interned = &mut self.interned;
            PodRecord {
                namespace: interned.string(&info.namespace),
                labels: info.labels,
                ips: info.ips.into_boxed_slice(),
                node: info.node.as_deref().map(|n| interned.string(n)),
                service_account: interned.string(&info.service_account),
                named_ports: interned.ports(&info.named_ports),
                identity,
            }
        });
        let holder = Holder::Pod(holder_key.clone());
        if let Some(r) = &new_rec {
            self.claim_pod_addresses(engine, &holder, r, &mut change);
        }
        if let Some(o) = &old {
            // Likewise the old identity matters only when it goes away or loses named ports.
            let ports_changed = engine.remove_named_ports(o.identity, &o.named_ports);
            if ports_changed || engine.identities().is_last_reference(o.identity) {
                change
                    .affected
                    .extend(engine.endpoints_affected_by_identity(o.identity));
            }
            for ip in o.ips.iter() {
                if !new_rec.as_ref().is_some_and(|n| n.ips.contains(ip)) {
                    let e = self.addresses.release(*ip, &holder);
                    Self::effect(engine, *ip, &e, &mut change.ipcache);
                }
            }
            engine.release_identity(o.identity);
            self.forget_labels(&o.labels);
            self.interned.forget(o);
        }
        if let Some(r) = new_rec {
            self.pods.insert(holder_key, Box::new(r));
        }
        change.pods.push(key.to_string());
        change
    }

    /// The pod `holder` claims the addresses of its record `r`: each one it may have, at its
    /// rank; the others are reported and, if it held them before, let go.
    fn claim_pod_addresses(
        &mut self,
        engine: &mut PolicyEngine,
        holder: &Holder,
        r: &PodRecord,
        change: &mut IndexChange,
    ) {
        let key = holder.pod().unwrap_or_default();
        let node = r.node.as_deref();
        let rank = self.rank_of(node);
        let on = node.map(|n| format!(" on node {n}")).unwrap_or_default();
        for ip in r.ips.iter() {
            if let Some(why) = self.refusal(rank, node, *ip) {
                change
                    .conflicts
                    .push(format!("pod {key}{on}: address {why}; refused"));
                let e = self.addresses.release(*ip, holder);
                Self::effect(engine, *ip, &e, &mut change.ipcache);
                continue;
            }
            let claim = Claim {
                rank,
                holder: holder.clone(),
                identity: r.identity,
            };
            let e = self.addresses.claim(*ip, claim);
            Self::effect(engine, *ip, &e, &mut change.ipcache);
            if let Some(h) = e.after.as_ref().filter(|h| h.holder.pod() != Some(key)) {
                change.conflicts.push(format!(
                    "pod {key}{on}: address {ip} is held by {}, which outranks it; not taken",
                    h.holder
                ));
            }
        }
    }

    /// A namespace appeared or changed: its pods are re-labelled.
    pub fn upsert_namespace(
        &mut self,
        engine: &mut PolicyEngine,
        ns: NamespaceInfo,
    ) -> IndexChange {
        if self.namespaces.get(&ns.name) == Some(&ns) {
            return IndexChange::default();
        }
        let name = ns.name.clone();
        self.namespaces.insert(name.clone(), ns);
        self.relabel_namespace(engine, &name)
    }

    /// A namespace went away: its pods lose its labels.
    pub fn delete_namespace(&mut self, engine: &mut PolicyEngine, name: &str) -> IndexChange {
        if self.namespaces.remove(name).is_none() {
            return IndexChange::default();
        }
        self.relabel_namespace(engine, name)
    }

    fn relabel_namespace(&mut self, engine: &mut PolicyEngine, name: &str) -> IndexChange {
        let mut pods: Vec<(String, PodInfo)> = self
            .pods
            .iter()
            .filter(|(_, p)| &*p.namespace == name)
            .map(|(k, p)| (k.to_string(), p.info(k)))
            .collect();
        pods.sort_by(|a, b| a.0.cmp(&b.0));
        let mut change = IndexChange::default();
        for (k, info) in pods {
            change.extend(self.apply_pod(engine, &k, Some(info)));
        }
        change
    }

    /// A node appeared or changed: its addresses map to `host` (`local`) or, elsewhere, to
    /// `remote-node` or the identity of its class (`policy::node_classes`). Other nodes whose
    /// identity the change moved follow.
    pub fn upsert_node(
        &mut self,
        engine: &mut PolicyEngine,
        node: NodeInfo,
        local: bool,
    ) -> IndexChange {
        let mut change = IndexChange::default();
        let labels: Labels = node
            .labels
            .iter()
            .map(|(k, v)| crate::policy::labels::Label::k8s(k, v))
            .collect();
        if local {
            change.affected.extend(engine.set_local_node(&node.name));
        }
        change
            .affected
            .extend(engine.upsert_node_labels(&node.name, labels));
        let holder = Holder::Node(Arc::from(node.name.as_str()));
        if let Some(old) = self.nodes.get(&node.name) {
            for ip in old.ips.iter().filter(|ip| !node.ips.contains(ip)) {
                let e = self.addresses.release(*ip, &holder);
                Self::effect(engine, *ip, &e, &mut change.ipcache);
            }
        }
        let identity = if local {
            IDENTITY_HOST
        } else {
            engine.node_identity(&node.name)
        };
        self.claim_node(engine, &node.ips, holder, identity, &mut change.ipcache);
        self.nodes.insert(node.name.clone(), node);
        change.extend(self.follow_moved_nodes(engine));
        change
    }

    fn claim_node(
        &mut self,
        engine: &mut PolicyEngine,
        ips: &[IpAddr],
        holder: Holder,
        identity: NumericIdentity,
        out: &mut Vec<IpcacheChange>,
    ) {
        for ip in ips {
            let claim = Claim {
                rank: Rank::Node,
                holder: holder.clone(),
                identity,
            };
            let e = self.addresses.claim(*ip, claim);
            Self::effect(engine, *ip, &e, out);
        }
    }

    /// The addresses of nodes whose identity the engine moved (their class changed, or the
    /// keys `nodes` peers name did) take their new identity. This node's stay `host`.
    pub fn follow_moved_nodes(&mut self, engine: &mut PolicyEngine) -> IndexChange {
        let mut change = IndexChange::default();
        for name in engine.take_moved_nodes() {
            if engine.local_node() == Some(name.as_str()) {
                continue;
            }
            let Some(ips) = self.nodes.get(&name).map(|n| n.ips.clone()) else {
                continue;
            };
            let identity = engine.node_identity(&name);
            let holder = Holder::Node(Arc::from(name.as_str()));
            self.claim_node(engine, &ips, holder, identity, &mut change.ipcache);
        }
        change
    }

    /// The addresses of this node's native devices are now `addrs`: each is `host`, as the
    /// Node's own (Cilium gives every local address identity host), whether or not the Node
    /// object lists it. Only the kernel of this node says so; no object can.
    pub fn set_device_addresses(
        &mut self,
        engine: &mut PolicyEngine,
        addrs: BTreeSet<IpAddr>,
    ) -> IndexChange {
        let mut change = IndexChange::default();
        for ip in self.device_addresses.difference(&addrs) {
            let e = self.addresses.release(*ip, &Holder::Devices);
            Self::effect(engine, *ip, &e, &mut change.ipcache);
        }
        let new: Vec<IpAddr> = addrs.difference(&self.device_addresses).copied().collect();
        self.claim_node(
            engine,
            &new,
            Holder::Devices,
            IDENTITY_HOST,
            &mut change.ipcache,
        );
        self.device_addresses = addrs;
        change
    }

    /// A node went away: its addresses leave the ipcache. `None` when it was not known.
    pub fn delete_node(&mut self, engine: &mut PolicyEngine, name: &str) -> Option<IndexChange> {
        let old = self.nodes.remove(name)?;
        let mut change = IndexChange::default();
        let holder = Holder::Node(Arc::from(name));
        for ip in &old.ips {
            let e = self.addresses.release(*ip, &holder);
            Self::effect(engine, *ip, &e, &mut change.ipcache);
        }
        change.affected.extend(engine.delete_node_labels(name));
        change.extend(self.follow_moved_nodes(engine));
        Some(change)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::identity::IDENTITY_REMOTE_NODE;
    use std::net::IpAddr;

    fn mk_pod(ns: &str, name: &str, app: &str, ip: &str) -> PodInfo {
        PodInfo {
            namespace: ns.into(),
            name: name.into(),
            labels: Arc::new([("app".to_string(), app.to_string())].into()),
            ips: vec![ip.parse().unwrap()],
            node: None,
            service_account: "default".into(),
            named_ports: vec![],
            workload: None,
        }
    }

    fn mk_ns(name: &str, team: &str) -> NamespaceInfo {
        NamespaceInfo {
            name: name.into(),
            labels: [("team".to_string(), team.to_string())].into(),
        }
    }

    fn mk_node(name: &str, ip: &str) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            labels: Default::default(),
            annotations: Default::default(),
            ips: vec![ip.parse().unwrap()],
            pod_cidrs: vec![],
            kubelet_port: None,
        }
    }

    fn identity_of(engine: &PolicyEngine, ip: &str) -> NumericIdentity {
        engine.ipcache().lookup(ip.parse::<IpAddr>().unwrap())
    }

    fn upserts(c: &IndexChange) -> Vec<(String, NumericIdentity)> {
        c.ipcache
            .iter()
            .filter_map(|x| match x {
                IpcacheChange::Upsert(n, id) => Some((n.to_string(), *id)),
                IpcacheChange::Remove(_) => None,
            })
            .collect()
    }

    #[test]
    fn a_pod_gets_an_identity_from_its_labels_and_its_address_maps_to_it() {
        let (mut ix, mut engine) = (ClusterIndex::default(), PolicyEngine::new());
        let c = ix.apply_pod(&mut engine, "x/a", Some(mk_pod("x", "a", "a", "10.0.0.1")));
        let id = ix.pod("x/a").unwrap().identity;
        assert_eq!(upserts(&c), vec![("10.0.0.1/32".to_string(), id)]);
        assert_eq!(c.pods, vec!["x/a".to_string()]);
        assert_eq!(identity_of(&engine, "10.0.0.1"), id);
        // Two pods with the same labels share it; the same state again changes nothing.
        ix.apply_pod(
            &mut engine,
            "x/a2",
            Some(mk_pod("x", "a2", "a", "10.0.0.2")),
        );
        assert_eq!(ix.pod("x/a2").unwrap().identity, id);
        let again = ix.apply_pod(&mut engine, "x/a", Some(mk_pod("x", "a", "a", "10.0.0.1")));
        assert!(again.is_empty());
        // ... and one copy of their label map, dropped with the last pod that has it.
        let (a, a2) = (ix.pod("x/a").unwrap(), ix.pod("x/a2").unwrap());
        assert!(Arc::ptr_eq(&a.labels, &a2.labels));
        assert_eq!(ix.label_maps.len(), 1);
        ix.apply_pod(&mut engine, "x/a", None);
        assert_eq!(ix.label_maps.len(), 1, "x/a2 still has it");
        ix.apply_pod(&mut engine, "x/a2", None);
        assert!(ix.label_maps.is_empty());
    }

    #[test]
    fn only_an_identity_that_appears_or_goes_away_affects_policy() {
        let (mut ix, mut engine) = (ClusterIndex::default(), PolicyEngine::new());
        let doc: serde_yaml::Value = serde_yaml::from_str(
            "apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {name: p, namespace: x}\nspec:\n  endpointSelector: {matchLabels: {app: db}}\n  egress: [{toEndpoints: [{matchLabels: {app: web}}]}]\n",
        )
        .unwrap();
        engine.upsert_policy(crate::policy::translate::parse_policy(&doc, "default", "t").unwrap());
        ix.apply_pod(
            &mut engine,
            "x/db",
            Some(mk_pod("x", "db", "db", "10.0.0.9")),
        );
        let db = ix.pod("x/db").unwrap().identity;
        let web = |n: &str, ip: &str| Some(mk_pod("x", n, "web", ip));
        // The first web pod brings its identity: db's policy must include it.
        let c = ix.apply_pod(&mut engine, "x/w1", web("w1", "10.0.0.1"));
        assert_eq!(c.affected, BTreeSet::from([db]));
        // Another pod of that identity, an address change, a pod that goes while another
        // holds the identity: the ipcache changes, no endpoint's policy does.
        let c = ix.apply_pod(&mut engine, "x/w2", web("w2", "10.0.0.2"));
        assert!(c.affected.is_empty() && !c.ipcache.is_empty(), "{c:?}");
        let c = ix.apply_pod(&mut engine, "x/w2", web("w2", "10.0.0.3"));
        assert!(c.affected.is_empty() && !c.ipcache.is_empty(), "{c:?}");
        let c = ix.apply_pod(&mut engine, "x/w1", None);
        assert!(c.affected.is_empty() && !c.ipcache.is_empty(), "{c:?}");
        // New named ports on the identity do change what policy may say.
        let mut named = mk_pod("x", "w3", "web", "10.0.0.4");
        named.named_ports = vec![NamedPort {
            name: "http".into(),
            protocol: crate::policy::rule::PROTO_TCP,
            port: 8080,
        }];
        let c = ix.apply_pod(&mut engine, "x/w3", Some(named));
        assert_eq!(c.affected, BTreeSet::from([db]));
        let c = ix.apply_pod(&mut engine, "x/w3", None);
        assert_eq!(c.affected, BTreeSet::from([db]), "the named port went");
        // The last pod of the identity goes: db's policy must drop it.
        let c = ix.apply_pod(&mut engine, "x/w2", None);
        assert_eq!(c.affected, BTreeSet::from([db]));
    }

    #[test]
    fn a_label_change_moves_the_pod_and_a_delete_clears_its_address() {
        let (mut ix, mut engine) = (ClusterIndex::default(), PolicyEngine::new());
        ix.apply_pod(&mut engine, "x/a", Some(mk_pod("x", "a", "a", "10.0.0.1")));
        let old = ix.pod("x/a").unwrap().identity;
        let c = ix.apply_pod(&mut engine, "x/a", Some(mk_pod("x", "a", "b", "10.0.0.1")));
        let new = ix.pod("x/a").unwrap().identity;
        assert_ne!(old, new);
        assert_eq!(upserts(&c), vec![("10.0.0.1/32".to_string(), new)]);
        assert!(
            !c.ipcache
                .iter()
                .any(|x| matches!(x, IpcacheChange::Remove(_))),
            "the address stays, under the new identity"
        );
        assert_eq!(identity_of(&engine, "10.0.0.1"), new);
        // A new address: the old one goes.
        let c = ix.apply_pod(&mut engine, "x/a", Some(mk_pod("x", "a", "b", "10.0.0.9")));
        assert!(c
            .ipcache
            .contains(&IpcacheChange::Remove("10.0.0.1/32".parse().unwrap())));
        let c = ix.apply_pod(&mut engine, "x/a", None);
        assert_eq!(
            c.ipcache,
            vec![IpcacheChange::Remove("10.0.0.9/32".parse().unwrap())]
        );
        assert!(!ix.has_pod("x/a"));
        assert!(
            ix.apply_pod(&mut engine, "x/a", None).is_empty(),
            "deleting twice is nothing"
        );
    }

    #[test]
    fn a_namespace_label_change_relabels_its_pods_only() {
        let (mut ix, mut engine) = (ClusterIndex::default(), PolicyEngine::new());
        ix.upsert_namespace(&mut engine, mk_ns("x", "red"));
        ix.apply_pod(&mut engine, "x/a", Some(mk_pod("x", "a", "a", "10.0.0.1")));
        ix.apply_pod(&mut engine, "y/a", Some(mk_pod("y", "a", "a", "10.0.1.1")));
        let (xa, ya) = (
            ix.pod("x/a").unwrap().identity,
            ix.pod("y/a").unwrap().identity,
        );
        assert!(ix
            .record_labels(ix.pod("x/a").unwrap())
            .to_strings()
            .iter()
            .any(|l| l.contains("team=red")));
        let c = ix.upsert_namespace(&mut engine, mk_ns("x", "blue"));
        assert_eq!(c.pods, vec!["x/a".to_string()]);
        assert_ne!(ix.pod("x/a").unwrap().identity, xa);
        assert_eq!(ix.pod("y/a").unwrap().identity, ya);
        assert!(ix
            .upsert_namespace(&mut engine, mk_ns("x", "blue"))
            .is_empty());
        let c = ix.delete_namespace(&mut engine, "x");
        assert_eq!(c.pods, vec!["x/a".to_string()]);
        assert!(ix.delete_namespace(&mut engine, "x").is_empty());
    }

    #[test]
    fn node_addresses_are_host_or_remote_node_and_leave_with_the_node() {
        let (mut ix, mut engine) = (ClusterIndex::default(), PolicyEngine::new());
        ix.upsert_node(&mut engine, mk_node("n1", "172.20.0.11"), true);
        ix.upsert_node(&mut engine, mk_node("n2", "172.20.0.12"), false);
        assert_eq!(identity_of(&engine, "172.20.0.11"), IDENTITY_HOST);
        assert_eq!(identity_of(&engine, "172.20.0.12"), IDENTITY_REMOTE_NODE);
        let c = ix.upsert_node(&mut engine, mk_node("n2", "172.20.0.22"), false);
        assert_eq!(
            c.ipcache[0],
            IpcacheChange::Remove("172.20.0.12/32".parse().unwrap())
        );
        assert_eq!(ix.nodes().len(), 2);
        let c = ix.delete_node(&mut engine, "n2").expect("known");
        assert_eq!(
            c.ipcache,
            vec![IpcacheChange::Remove("172.20.0.22/32".parse().unwrap())]
        );
        assert!(ix.delete_node(&mut engine, "n2").is_none());
    }
    /// A cluster tier's `nodes` peer naming `role` splits the other nodes into classes: their
    /// addresses move to their class's identity (the own node's stay `host`), and follow a
    /// relabelling; without the peer they are `remote-node` again.
    #[test]
    fn node_addresses_follow_their_class_when_nodes_peers_tell_nodes_apart() {
        let (mut ix, mut engine) = (ClusterIndex::default(), PolicyEngine::new());
        let node = |name: &str, ip: &str, role: &str| {
            let mut n = mk_node(name, ip);
            n.labels.insert("role".into(), role.into());
            n
        };
        ix.upsert_node(&mut engine, node("n1", "172.20.0.11", "worker"), true);
        ix.upsert_node(&mut engine, node("n2", "172.20.0.12", "worker"), false);
        ix.upsert_node(&mut engine, node("n3", "172.20.0.13", "cp"), false);
        let doc: serde_yaml::Value = serde_yaml::from_str("{apiVersion: policy.networking.k8s.io/v1alpha1, kind: AdminNetworkPolicy, metadata: {name: n}, spec: {priority: 1, subject: {namespaces: {}}, egress: [{action: Deny, to: [{nodes: {matchLabels: {role: cp}}}]}]}}").unwrap();
        let key = engine
            .upsert_policy(crate::policy::parse_policy(&doc, "default", "t").unwrap())
            .revision;
        assert!(key > 0);
        let c = ix.follow_moved_nodes(&mut engine);
        let (worker, cp) = (engine.node_identity("n2"), engine.node_identity("n3"));
        assert!(worker != cp && ![IDENTITY_REMOTE_NODE, IDENTITY_HOST].contains(&worker));
        let mut got = c.ipcache.clone();
        got.sort_by_key(|c| format!("{c:?}"));
        assert_eq!(
            got,
            vec![
                IpcacheChange::Upsert("172.20.0.12/32".parse().unwrap(), worker),
                IpcacheChange::Upsert("172.20.0.13/32".parse().unwrap(), cp),
            ]
        );
        assert_eq!(identity_of(&engine, "172.20.0.11"), IDENTITY_HOST);
        assert_eq!(identity_of(&engine, "172.20.0.13"), cp);
        // n3 relabelled a worker: its address moves with the upsert itself.
        let c = ix.upsert_node(&mut engine, node("n3", "172.20.0.13", "worker"), false);
        assert!(c.ipcache.contains(&IpcacheChange::Upsert(
            "172.20.0.13/32".parse().unwrap(),
            worker
        )));
        assert_eq!(identity_of(&engine, "172.20.0.13"), worker);
        // The policy goes: remote-node again.
        engine.delete_policy(&crate::policy::PolicyKey::new(
            crate::policy::PolicyKind::AdminNetworkPolicy,
            None,
            "n",
        ));
        let c = ix.follow_moved_nodes(&mut engine);
        assert_eq!(c.ipcache.len(), 2, "{:?}", c.ipcache);
        assert_eq!(identity_of(&engine, "172.20.0.12"), IDENTITY_REMOTE_NODE);
        assert_eq!(identity_of(&engine, "172.20.0.11"), IDENTITY_HOST);
    }

    /// The addresses of this node's devices are `host` whether the Node lists them or not, and
    /// no pod another node publishes takes one; they leave with the device's address, and one
    /// the Node also lists stays `host` while the Node holds it.
    #[test]
    fn device_addresses_are_host_and_no_other_node_takes_them() {
        let (mut ix, mut engine) = (ClusterIndex::for_node("n1"), PolicyEngine::new());
        ix.upsert_node(&mut engine, mk_node("n1", "172.20.0.11"), true);
        let addrs = |v: &[&str]| v.iter().map(|a| a.parse().unwrap()).collect();
        let c = ix.set_device_addresses(&mut engine, addrs(&["172.20.0.11", "10.99.0.1"]));
        assert!(c.ipcache.contains(&IpcacheChange::Upsert(
            "10.99.0.1/32".parse().unwrap(),
            IDENTITY_HOST
        )));
        assert_eq!(identity_of(&engine, "172.20.0.11"), IDENTITY_HOST);
        let c = ix.apply_pod(
            &mut engine,
            "x/evil",
            Some(on(mk_pod("x", "evil", "admin", "10.99.0.1"), "n2")),
        );
        assert!(c.ipcache.is_empty(), "{c:?}");
        assert_eq!(identity_of(&engine, "10.99.0.1"), IDENTITY_HOST);
        // The second address goes from the device; the Node's stays host without the device.
        let c = ix.set_device_addresses(&mut engine, addrs(&["172.20.0.11"]));
        assert_eq!(
            identity_of(&engine, "10.99.0.1"),
            ix.pod("x/evil").unwrap().identity
        );
        assert_eq!(c.ipcache.len(), 1, "{c:?}");
        let c = ix.set_device_addresses(&mut engine, addrs(&[]));
        assert!(
            c.ipcache
                .iter()
                .all(|c| matches!(c, IpcacheChange::Upsert(_, IDENTITY_HOST))),
            "{c:?}"
        );
        assert_eq!(identity_of(&engine, "172.20.0.11"), IDENTITY_HOST);
    }

    fn on(mut p: PodInfo, node: &str) -> PodInfo {
        p.node = Some(node.into());
        p
    }

    fn with_cidr(mut n: NodeInfo, cidr: &str) -> NodeInfo {
        n.pod_cidrs = vec![cidr.into()];
        n
    }

    #[test]
    fn another_nodes_pod_never_takes_an_address_of_this_nodes_pod() {
        let (mut ix, mut engine) = (ClusterIndex::for_node("n1"), PolicyEngine::new());
        ix.apply_pod(
            &mut engine,
            "x/a",
            Some(on(mk_pod("x", "a", "a", "10.9.0.1"), "n1")),
        );
        let id_a = identity_of(&engine, "10.9.0.1");
        // n2 says it runs x/evil (app=admin) at a's address: refused, reported, nothing moves.
        let c = ix.apply_pod(
            &mut engine,
            "x/evil",
            Some(on(mk_pod("x", "evil", "admin", "10.9.0.1"), "n2")),
        );
        assert!(c.ipcache.is_empty(), "{c:?}");
        assert_eq!(identity_of(&engine, "10.9.0.1"), id_a);
        assert_eq!(
            c.conflicts,
            vec!["pod x/evil on node n2: address 10.9.0.1 is held by pod x/a, which outranks it; not taken"]
        );
        // Its deletion takes nothing away either.
        let c = ix.apply_pod(&mut engine, "x/evil", None);
        assert!(c.ipcache.is_empty());
        assert_eq!(identity_of(&engine, "10.9.0.1"), id_a);
        // The other order: the remote claim first, then this node's pod takes the address.
        let (mut ix, mut engine) = (ClusterIndex::for_node("n1"), PolicyEngine::new());
        ix.apply_pod(
            &mut engine,
            "x/evil",
            Some(on(mk_pod("x", "evil", "admin", "10.9.0.1"), "n2")),
        );
        ix.apply_pod(
            &mut engine,
            "x/a",
            Some(on(mk_pod("x", "a", "a", "10.9.0.1"), "n1")),
        );
        assert_eq!(
            identity_of(&engine, "10.9.0.1"),
            ix.pod("x/a").unwrap().identity
        );
        assert_eq!(
            ix.holder("10.9.0.1".parse().unwrap()).unwrap().holder.pod(),
            Some("x/a")
        );
    }

    #[test]
    fn a_local_endpoint_outranks_another_nodes_pod_before_its_pod_is_listed() {
        let (mut ix, mut engine) = (ClusterIndex::for_node("n1"), PolicyEngine::new());
        let ip: IpAddr = "10.9.0.2".parse().unwrap();
        ix.claim_endpoint(&mut engine, "x/a", &[ip], 4242);
        let c = ix.apply_pod(
            &mut engine,
            "x/evil",
            Some(on(mk_pod("x", "evil", "admin", "10.9.0.2"), "n2")),
        );
        assert!(c.ipcache.is_empty() && c.conflicts.len() == 1, "{c:?}");
        assert_eq!(identity_of(&engine, "10.9.0.2"), 4242);
        // The endpoint goes: now the remaining claim holds (no local pod says otherwise).
        let out = ix.release_endpoint(&mut engine, "x/a", &[ip]);
        assert_eq!(out.len(), 1);
        assert_eq!(
            identity_of(&engine, "10.9.0.2"),
            ix.pod("x/evil").unwrap().identity
        );
    }

    #[test]
    fn address_reuse_the_new_pod_keeps_the_address_when_the_old_ones_delete_arrives() {
        let (mut ix, mut engine) = (ClusterIndex::for_node("n1"), PolicyEngine::new());
        ix.apply_pod(
            &mut engine,
            "x/old",
            Some(on(mk_pod("x", "old", "old", "10.9.0.3"), "n1")),
        );
        ix.apply_pod(
            &mut engine,
            "x/new",
            Some(on(mk_pod("x", "new", "new", "10.9.0.3"), "n1")),
        );
        let id_new = ix.pod("x/new").unwrap().identity;
        assert_eq!(identity_of(&engine, "10.9.0.3"), id_new);
        let c = ix.apply_pod(&mut engine, "x/old", None);
        assert!(c.ipcache.is_empty(), "{c:?}");
        assert_eq!(identity_of(&engine, "10.9.0.3"), id_new);
    }

    #[test]
    fn node_special_and_foreign_cidr_addresses_are_not_pod_addresses() {
        let (mut ix, mut engine) = (ClusterIndex::for_node("n1"), PolicyEngine::new());
        ix.upsert_node(
            &mut engine,
            with_cidr(mk_node("n1", "172.20.0.11"), "10.1.0.0/24"),
            true,
        );
        ix.upsert_node(
            &mut engine,
            with_cidr(mk_node("n2", "172.20.0.12"), "10.2.0.0/24"),
            false,
        );
        ix.upsert_node(&mut engine, mk_node("n3", "172.20.0.13"), false);
        for (ip, node, why) in [
            ("172.20.0.11", "n3", "held by node n1"),
            ("172.20.0.12", "n3", "held by node n2"),
            ("0.0.0.0", "n3", "is unspecified"),
            ("255.255.255.255", "n3", "is broadcast"),
            ("::", "n3", "is unspecified"),
            ("127.0.0.1", "n1", "is loopback"),
            ("10.1.0.9", "n2", "in this node's (n1) pod CIDR 10.1.0.0/24"),
            (
                "10.3.0.9",
                "n2",
                "outside node n2's pod CIDRs (10.2.0.0/24)",
            ),
        ] {
            let before = identity_of(&engine, ip);
            let c = ix.apply_pod(
                &mut engine,
                "x/p",
                Some(on(mk_pod("x", "p", "p", ip), node)),
            );
            assert!(c.ipcache.is_empty(), "{ip}: {c:?}");
            assert_eq!(identity_of(&engine, ip), before, "{ip}");
            assert!(
                c.conflicts.len() == 1 && c.conflicts[0].contains(why),
                "{ip}: {:?}",
                c.conflicts
            );
            ix.apply_pod(&mut engine, "x/p", None);
        }
        assert_eq!(identity_of(&engine, "172.20.0.11"), IDENTITY_HOST);
        // A pod of n2 in n2's CIDR, and one of n3 (no CIDR known) anywhere else, are fine.
        let c = ix.apply_pod(
            &mut engine,
            "x/q",
            Some(on(mk_pod("x", "q", "q", "10.2.0.5"), "n2")),
        );
        assert!(c.conflicts.is_empty() && c.ipcache.len() == 1, "{c:?}");
        let c = ix.apply_pod(
            &mut engine,
            "x/r",
            Some(on(mk_pod("x", "r", "r", "10.7.0.5"), "n3")),
        );
        assert!(c.conflicts.is_empty() && c.ipcache.len() == 1, "{c:?}");
    }
}
