//! `CiliateEndpointSlice` (`ciliate.io/v1alpha1`, cluster-scoped): what the agents of a
//! cluster tell each other about their pods, so that no agent has to watch every Pod
//! (Cilium's CiliumEndpointSlice, written here by the agent that owns the pods rather than by
//! an operator).
//!
//! A slice holds at most [`MAX_ENDPOINTS`] endpoints of one node: for each its pod name and
//! addresses, and the index of a *profile* — namespace, labels, service account and named
//! ports — that the pods of one deployment share, so the labels are written once per slice
//! and not once per pod. An agent writes the slices of its own node ([`SliceBook`], written by
//! `k8s::slice_writer`), named `<node>.<n>` and labelled `ciliate.io/node=<node>`, and watches
//! every other node's ([`slice_pods`] turns one into the pods it lists). A change to one pod
//! rewrites one slice of its node; a kubelet status write that moves nothing an agent uses
//! (a condition, a container status) writes none.
//!
//! Pure: the book says what to write, the writer task talks to the API server.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::slice_read::SpecRead;
use crate::objects::PodInfo;
use crate::policy::engine::NamedPort;

/// The label naming the node whose agent wrote a slice.
pub const NODE_LABEL: &str = "ciliate.io/node";

/// Endpoints per slice at most: small enough that one pod change sends little to every agent,
/// large enough that a node's pods fit in a few objects.
pub const MAX_ENDPOINTS: usize = 8;

/// The endpoints of one node, or some of them. See the module documentation.
#[derive(
    CustomResource, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema,
)]
#[kube(
    group = "ciliate.io",
    version = "v1alpha1",
    kind = "CiliateEndpointSlice",
    plural = "ciliateendpointslices",
    shortname = "cies",
    category = "ciliate",
    derive = "PartialEq",
    doc = "Endpoints of one node, written by that node's ciliate agent and read by the others.",
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.node"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
pub struct CiliateEndpointSliceSpec {
    /// The node the endpoints run on (whose agent writes this slice).
    pub node: String,
    /// What several endpoints share; endpoints refer to them by index.
    #[serde(default)]
    pub profiles: Vec<SliceProfile>,
    #[serde(default)]
    pub endpoints: Vec<SliceEndpoint>,
}

/// What the pods of one deployment share.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub struct SliceProfile {
    pub namespace: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Left out when it is `default` (as in a Pod).
    #[serde(
        rename = "serviceAccount",
        default = "default_service_account",
        skip_serializing_if = "is_default_service_account"
    )]
    pub service_account: String,
    #[serde(rename = "namedPorts", default, skip_serializing_if = "Vec::is_empty")]
    pub named_ports: Vec<SliceNamedPort>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub struct SliceNamedPort {
    pub name: String,
    pub port: u16,
    /// `TCP` (left out), `UDP` or `SCTP`.
    #[serde(default = "tcp", skip_serializing_if = "is_tcp")]
    pub protocol: String,
}

fn default_service_account() -> String {
    "default".into()
}

fn is_default_service_account(sa: &str) -> bool {
    sa == "default"
}

fn tcp() -> String {
    "TCP".into()
}

fn is_tcp(p: &str) -> bool {
    p == "TCP"
}

/// One pod.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub struct SliceEndpoint {
    /// The pod's name (its namespace is its profile's).
    pub name: String,
    pub ips: Vec<String>,
    /// Index into `profiles`.
    pub profile: u32,
}

/// Where this agent learns of other nodes' pods, for `status` (Kubernetes mode).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodSourceView {
    /// `CiliateEndpointSlice` (the default) or `Pod` (`--watch-pods`).
    pub remote_pods_from: String,
    /// Other nodes' slices known (endpoint-slice mode).
    pub slices_watched: usize,
    /// This node's slices on the API server, and the local pods they list.
    pub slices_written: usize,
    pub local_pods: usize,
    /// The last failure to list or write this node's slices, until a write succeeds.
    pub last_error: Option<String>,
}

/// A `CiliateEndpointSlice` as an agent reads others': its metadata and its spec read
/// leniently (`k8s::slice_read`), so that one malformed slice is reported by itself
/// (`SliceObject::spec_of`) instead of failing the list it came in. (Not `DynamicObject`: its
/// flattened fields make serde buffer every object twice, and slices are most of what an
/// agent lists.)
#[derive(Clone, Debug, Deserialize)]
pub struct SliceObject {
    pub metadata: kube::core::ObjectMeta,
    #[serde(default)]
    pub spec: Option<SpecRead>,
}

impl SliceObject {
    /// The typed spec, or what is wrong with it (by field).
    pub fn spec_of(&self) -> Result<&CiliateEndpointSliceSpec, String> {
        match &self.spec {
            Some(SpecRead(read)) => read.as_ref().map_err(Clone::clone),
            None => Err("spec: required".into()),
        }
    }

    /// The typed spec, taken out, or what is wrong with it.
    pub fn into_spec(self) -> Result<CiliateEndpointSliceSpec, String> {
        match self.spec {
            Some(SpecRead(read)) => read,
            None => Err("spec: required".into()),
        }
    }
}

impl kube::Resource for SliceObject {
    type DynamicType = ();
    type Scope = kube::core::ClusterResourceScope;

    fn kind(_: &()) -> std::borrow::Cow<'_, str> {
        <CiliateEndpointSlice as kube::Resource>::kind(&())
    }
    fn group(_: &()) -> std::borrow::Cow<'_, str> {
        <CiliateEndpointSlice as kube::Resource>::group(&())
    }
    fn version(_: &()) -> std::borrow::Cow<'_, str> {
        <CiliateEndpointSlice as kube::Resource>::version(&())
    }
    fn plural(_: &()) -> std::borrow::Cow<'_, str> {
        <CiliateEndpointSlice as kube::Resource>::plural(&())
    }
    fn meta(&self) -> &kube::core::ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut kube::core::ObjectMeta {
        &mut self.metadata
    }
}

/// The CRD, for `manifests/crds/` and the test API server.
pub fn crd() -> CustomResourceDefinition {
    CiliateEndpointSlice::crd()
}

fn protocol_name(p: u8) -> &'static str {
    match p {
        crate::policy::rule::PROTO_UDP => "UDP",
        crate::policy::rule::PROTO_SCTP => "SCTP",
        _ => "TCP",
    }
}

fn profile_of(pod: &PodInfo) -> SliceProfile {
    SliceProfile {
        namespace: pod.namespace.clone(),
        labels: (*pod.labels).clone(),
        service_account: pod.service_account.clone(),
        named_ports: pod
            .named_ports
            .iter()
            .map(|p| SliceNamedPort {
                name: p.name.clone(),
                port: p.port,
                protocol: protocol_name(p.protocol).into(),
            })
            .collect(),
    }
}

/// A slice's name: `<node>.<n>` (a node name is a DNS subdomain, so this is one too).
pub fn slice_name(node: &str, index: u32) -> String {
    format!("{node}.{index}")
}

/// The spec of a slice holding `pods` (sorted by key, so equal contents are equal specs).
pub fn slice_spec<'a>(
    node: &str,
    pods: impl IntoIterator<Item = &'a PodInfo>,
) -> CiliateEndpointSliceSpec {
    let mut spec = CiliateEndpointSliceSpec {
        node: node.to_string(),
        ..Default::default()
    };
    let mut index: HashMap<SliceProfile, u32> = HashMap::new();
    for pod in pods {
        let profile = profile_of(pod);
        let n = match index.get(&profile) {
            Some(n) => *n,
            None => {
                let n = spec.profiles.len() as u32;
                spec.profiles.push(profile.clone());
                index.insert(profile, n);
                n
            }
        };
        spec.endpoints.push(SliceEndpoint {
            name: pod.name.clone(),
            ips: pod.ips.iter().map(IpAddr::to_string).collect(),
            profile: n,
        });
    }
    spec
}

/// Whether a slice speaks only for the node it names: its `ciliate.io/node` label and its
/// name (`<node>.<n>`, as `slice_name` makes them) must agree with `spec.node`. The label is
/// what RBAC and the admission policy (`manifests/slice-admission.yaml`) check against the
/// writer's node; a slice whose parts disagree is refused whole (by field).
pub fn check_slice_node(
    name: &str,
    labels: Option<&BTreeMap<String, String>>,
    spec: &CiliateEndpointSliceSpec,
) -> Result<(), String> {
    let label = labels.and_then(|l| l.get(NODE_LABEL));
    match label {
        None => return Err(format!("metadata.labels[{NODE_LABEL}]: required")),
        Some(l) if *l != spec.node => {
            return Err(format!(
                "metadata.labels[{NODE_LABEL}]: {l:?} does not match spec.node {:?}",
                spec.node
            ))
        }
        Some(_) => {}
    }
    let index = name
        .strip_prefix(spec.node.as_str())
        .and_then(|rest| rest.strip_prefix('.'));
    match index {
        Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => Ok(()),
        _ => Err(format!(
            "metadata.name: {name:?} is not <spec.node>.<n> for spec.node {:?}",
            spec.node
        )),
    }
}

/// The pods a slice lists, or what is wrong with it (by field). `shared_labels` lets the
/// caller keep one copy of each label map (`objects::LabelInterner`).
pub fn slice_pods(
    spec: &CiliateEndpointSliceSpec,
    shared_labels: impl FnMut(Arc<BTreeMap<String, String>>) -> Arc<BTreeMap<String, String>>,
) -> Result<Vec<PodInfo>, String> {
    let pods = slice_pods_where(spec, shared_labels, |_, _| true)?;
    Ok(pods.into_iter().map(|(_, p)| p).collect())
}

/// A hash of what one endpoint of a slice says (its profile included), to skip the endpoints
/// a new version of the slice did not change.
pub fn endpoint_hash(
    spec: &CiliateEndpointSliceSpec,
    index: usize,
    hasher: &impl std::hash::BuildHasher,
) -> u64 {
    let e = &spec.endpoints[index];
    hasher.hash_one((spec.profiles.get(e.profile as usize), e))
}

/// Validates the whole slice, then builds the pods of the endpoints `want` selects (called
/// with each endpoint's index and `namespace/name`), each with its `namespace/name` (the key
/// the caller files it under, made once).
pub fn slice_pods_where(
    spec: &CiliateEndpointSliceSpec,
    mut shared_labels: impl FnMut(Arc<BTreeMap<String, String>>) -> Arc<BTreeMap<String, String>>,
    mut want: impl FnMut(usize, &str) -> bool,
) -> Result<Vec<(String, PodInfo)>, String> {
    if spec.node.is_empty() {
        return Err("spec.node: required".into());
    }
    struct Profile {
        /// Made on first use (shared through `shared_labels`).
        labels: Option<Arc<BTreeMap<String, String>>>,
        named_ports: Vec<NamedPort>,
    }
    let mut profiles = Vec::with_capacity(spec.profiles.len());
    for (i, p) in spec.profiles.iter().enumerate() {
        if p.namespace.is_empty() {
            return Err(format!("spec.profiles[{i}].namespace: required"));
        }
        crate::policy::labels::check_labels(&p.labels)
            .map_err(|m| format!("spec.profiles[{i}].labels: {m}"))?;
        let mut named_ports = Vec::with_capacity(p.named_ports.len());
        for (j, np) in p.named_ports.iter().enumerate() {
            let protocol = match np.protocol.to_ascii_uppercase().as_str() {
                "TCP" | "" => crate::policy::rule::PROTO_TCP,
                "UDP" => crate::policy::rule::PROTO_UDP,
                "SCTP" => crate::policy::rule::PROTO_SCTP,
                other => {
                    return Err(format!(
                        "spec.profiles[{i}].namedPorts[{j}].protocol: {other:?} is not TCP, UDP or SCTP"
                    ))
                }
            };
            named_ports.push(NamedPort {
                name: np.name.to_ascii_lowercase(),
                protocol,
                port: np.port,
            });
        }
        profiles.push(Profile {
            labels: None,
            named_ports,
        });
    }
    let mut ips_of = Vec::with_capacity(spec.endpoints.len());
    for (i, e) in spec.endpoints.iter().enumerate() {
        if e.profile as usize >= profiles.len() {
            return Err(format!(
                "spec.endpoints[{i}].profile: {} but the slice has {} profiles",
                e.profile,
                profiles.len()
            ));
        }
        if e.name.is_empty() {
            return Err(format!("spec.endpoints[{i}].name: required"));
        }
        let mut ips = Vec::with_capacity(e.ips.len());
        for (j, ip) in e.ips.iter().enumerate() {
            let a: IpAddr = ip.parse().map_err(|_| {
                format!("spec.endpoints[{i}].ips[{j}]: {ip:?} is not an IP address")
            })?;
            if let Some(why) = crate::objects::addresses::not_a_pod_address(a) {
                return Err(format!(
                    "spec.endpoints[{i}].ips[{j}]: {ip:?} is {why}, never a pod address"
                ));
            }
            if !ips.contains(&a) {
                ips.push(a);
            }
        }
        ips_of.push(ips);
    }
    let mut pods = Vec::new();
    for (i, (e, ips)) in spec.endpoints.iter().zip(ips_of).enumerate() {
        let source = &spec.profiles[e.profile as usize];
        let key = format!("{}/{}", source.namespace, e.name);
        if !want(i, &key) {
            continue;
        }
        let p = &mut profiles[e.profile as usize];
        let labels = p
            .labels
            .get_or_insert_with(|| shared_labels(Arc::new(source.labels.clone())))
            .clone();
        pods.push((
            key,
            PodInfo {
                namespace: source.namespace.clone(),
                name: e.name.clone(),
                labels,
                ips,
                node: Some(spec.node.clone()),
                service_account: source.service_account.clone(),
                named_ports: p.named_ports.clone(),
                // Slices carry no owners: Hubble names workloads of local pods only, as
                // Cilium does.
                workload: None,
            },
        ));
    }
    Ok(pods)
}

/// A write the book asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SliceWrite {
    /// Create or replace the slice.
    Apply(String, CiliateEndpointSliceSpec),
    Delete(String),
}

impl SliceWrite {
    pub fn name(&self) -> &str {
        match self {
            SliceWrite::Apply(n, _) | SliceWrite::Delete(n) => n,
        }
    }
}

/// This node's slices: which slice each local pod is in (a pod stays in its slice while it
/// lives, so one pod change rewrites one slice), what the API server holds, and what changed.
#[derive(Debug)]
pub struct SliceBook {
    node: String,
    max: usize,
    /// Slice index -> its pods, by key.
    slices: BTreeMap<u32, BTreeMap<String, PodInfo>>,
    /// Pod key -> slice index.
    placement: HashMap<String, u32>,
    /// What the API server holds (as last written or listed), by index.
    written: BTreeMap<u32, CiliateEndpointSliceSpec>,
    dirty: BTreeSet<u32>,
}

impl SliceBook {
    pub fn new(node: &str) -> SliceBook {
        SliceBook::with_max(node, MAX_ENDPOINTS)
    }

    pub fn with_max(node: &str, max: usize) -> SliceBook {
        SliceBook {
            node: node.to_string(),
            max: max.max(1),
            slices: BTreeMap::new(),
            placement: HashMap::new(),
            written: BTreeMap::new(),
            dirty: BTreeSet::new(),
        }
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// The slices of this node the API server holds (listed at start): their pods keep their
    /// places, and what no longer holds is rewritten or deleted by the next `writes`. Names that
    /// are not `<node>.<n>` are deleted.
    pub fn adopt(&mut self, existing: Vec<(String, CiliateEndpointSliceSpec)>) -> Vec<SliceWrite> {
        let mut strays = Vec::new();
        for (name, spec) in existing {
            let index = name
                .strip_prefix(&self.node)
                .and_then(|rest| rest.strip_prefix('.'))
                .and_then(|n| n.parse::<u32>().ok());
            let Some(index) = index else {
                strays.push(SliceWrite::Delete(name));
                continue;
            };
            if let Ok(pods) = slice_pods(&spec, |l| l) {
                for pod in pods {
                    let key = pod.key();
                    if !self.placement.contains_key(&key) {
                        self.placement.insert(key.clone(), index);
                        self.slices.entry(index).or_default().insert(key, pod);
                    }
                }
            }
            self.slices.entry(index).or_default();
            self.written.insert(index, spec);
            self.dirty.insert(index);
        }
        strays
    }

    /// A local pod appeared or changed.
    pub fn upsert(&mut self, pod: PodInfo) {
        let key = pod.key();
        let index = match self.placement.get(&key) {
            Some(i) => *i,
            None => {
                let i = self.free_slot();
                self.placement.insert(key.clone(), i);
                i
            }
        };
        let pods = self.slices.entry(index).or_default();
        if pods.get(&key) != Some(&pod) {
            pods.insert(key, pod);
            self.dirty.insert(index);
        }
    }

    /// A local pod went away (or has no address any more).
    pub fn remove(&mut self, key: &str) {
        if let Some(index) = self.placement.remove(key) {
            if let Some(pods) = self.slices.get_mut(&index) {
                pods.remove(key);
            }
            self.dirty.insert(index);
        }
    }

    /// How many local pods the book holds.
    pub fn len(&self) -> usize {
        self.placement.len()
    }

    pub fn is_empty(&self) -> bool {
        self.placement.is_empty()
    }

    /// The keys of the local pods the book holds.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.placement.keys().cloned().collect();
        keys.sort();
        keys
    }

    /// The first slice with room (filling gaps first), else a new one.
    fn free_slot(&self) -> u32 {
        for (i, pods) in &self.slices {
            if pods.len() < self.max {
                return *i;
            }
        }
        (0..).find(|i| !self.slices.contains_key(i)).unwrap_or(0)
    }

    /// What to write now: every changed slice whose contents differ from what the server
    /// holds (an emptied slice is deleted). Call `written` for each write that succeeded and
    /// `failed` for the others.
    pub fn writes(&mut self) -> Vec<SliceWrite> {
        let mut out = Vec::new();
        for index in std::mem::take(&mut self.dirty) {
            let name = slice_name(&self.node, index);
            let pods = self.slices.get(&index);
            if pods.is_none_or(|p| p.is_empty()) {
                self.slices.remove(&index);
                if self.written.contains_key(&index) {
                    out.push(SliceWrite::Delete(name));
                }
                continue;
            }
            let spec = slice_spec(&self.node, pods.into_iter().flat_map(|p| p.values()));
            if self.written.get(&index) != Some(&spec) {
                out.push(SliceWrite::Apply(name, spec));
            }
        }
        out
    }

    /// A write reached the API server.
    pub fn written(&mut self, write: &SliceWrite) {
        let Some(index) = self.index_of(write.name()) else {
            return;
        };
        match write {
            SliceWrite::Apply(_, spec) => {
                self.written.insert(index, spec.clone());
            }
            SliceWrite::Delete(_) => {
                self.written.remove(&index);
            }
        }
    }

    /// A write failed: the slice is written again by the next `writes`.
    pub fn failed(&mut self, write: &SliceWrite) {
        if let Some(index) = self.index_of(write.name()) {
            self.dirty.insert(index);
        }
    }

    pub fn has_pending(&self) -> bool {
        !self.dirty.is_empty()
    }

    fn index_of(&self, name: &str) -> Option<u32> {
        name.strip_prefix(&self.node)?
            .strip_prefix('.')?
            .parse()
            .ok()
    }

    /// Slices written (or listed) and not deleted.
    pub fn slice_count(&self) -> usize {
        self.written.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_speaks_only_for_the_node_its_label_and_name_give() {
        let spec = CiliateEndpointSliceSpec {
            node: "node-2".into(),
            ..Default::default()
        };
        let labels = |n: &str| BTreeMap::from([(NODE_LABEL.to_string(), n.to_string())]);
        assert_eq!(
            check_slice_node("node-2.0", Some(&labels("node-2")), &spec),
            Ok(())
        );
        assert_eq!(
            check_slice_node("node-2.17", Some(&labels("node-2")), &spec),
            Ok(())
        );
        let err = |name: &str, l: Option<&BTreeMap<String, String>>| {
            check_slice_node(name, l, &spec).unwrap_err()
        };
        assert_eq!(
            err("node-2.0", None),
            "metadata.labels[ciliate.io/node]: required"
        );
        assert_eq!(
            err("node-2.0", Some(&labels("node-1"))),
            "metadata.labels[ciliate.io/node]: \"node-1\" does not match spec.node \"node-2\""
        );
        for name in [
            "node-1.0",
            "node-2",
            "node-2.",
            "node-2.x",
            "node-20.0",
            "node-2.0.1",
        ] {
            assert!(
                err(name, Some(&labels("node-2"))).starts_with("metadata.name: "),
                "{name}"
            );
        }
    }

    #[test]
    fn special_addresses_refuse_a_slice_by_field() {
        for (ip, why) in [
            ("0.0.0.0", "unspecified"),
            ("255.255.255.255", "broadcast"),
            ("::", "unspecified"),
            ("127.0.0.1", "loopback"),
            ("ff02::1", "multicast"),
        ] {
            let spec = CiliateEndpointSliceSpec {
                node: "node-2".into(),
                profiles: vec![SliceProfile {
                    namespace: "x".into(),
                    ..Default::default()
                }],
                endpoints: vec![
                    SliceEndpoint {
                        name: "ok".into(),
                        ips: vec!["10.0.0.1".into()],
                        profile: 0,
                    },
                    SliceEndpoint {
                        name: "bad".into(),
                        ips: vec![ip.into()],
                        profile: 0,
                    },
                ],
            };
            assert_eq!(
                slice_pods(&spec, |l| l).unwrap_err(),
                format!("spec.endpoints[1].ips[0]: {ip:?} is {why}, never a pod address")
            );
        }
    }

    fn pod(ns: &str, name: &str, app: &str, ip: &str) -> PodInfo {
        PodInfo {
            namespace: ns.into(),
            name: name.into(),
            labels: Arc::new([("app".to_string(), app.to_string())].into()),
            ips: vec![ip.parse().unwrap()],
            node: Some("n1".into()),
            service_account: "default".into(),
            named_ports: vec![NamedPort {
                name: "http".into(),
                protocol: crate::policy::rule::PROTO_TCP,
                port: 8080,
            }],
            workload: None,
        }
    }

    #[test]
    fn a_slice_lists_its_pods_back_with_shared_profiles() {
        let pods = [
            pod("x", "a", "web", "10.0.0.1"),
            pod("x", "b", "web", "10.0.0.2"),
            pod("y", "c", "db", "10.0.0.3"),
        ];
        let spec = slice_spec("n1", pods.iter());
        assert_eq!(spec.profiles.len(), 2, "pods a and b share a profile");
        assert_eq!(spec.endpoints[1].profile, spec.endpoints[0].profile);
        let back = slice_pods(&spec, |l| l).unwrap();
        assert_eq!(back, pods.to_vec());
        // The JSON is what other agents receive: it round-trips.
        let json = serde_json::to_value(&spec).unwrap();
        let parsed: CiliateEndpointSliceSpec = serde_json::from_value(json).unwrap();
        assert_eq!(parsed, spec);
    }

    #[test]
    fn bad_slices_are_named_by_field() {
        let mut spec = slice_spec("n1", [pod("x", "a", "web", "10.0.0.1")].iter());
        spec.endpoints[0].profile = 3;
        let e = slice_pods(&spec, |l| l).unwrap_err();
        assert!(e.contains("spec.endpoints[0].profile"), "{e}");
        let mut spec = slice_spec("n1", [pod("x", "a", "web", "10.0.0.1")].iter());
        spec.endpoints[0].ips[0] = "ten".into();
        let e = slice_pods(&spec, |l| l).unwrap_err();
        assert!(e.contains("spec.endpoints[0].ips[0]"), "{e}");
        let mut spec = slice_spec("n1", [pod("x", "a", "web", "10.0.0.1")].iter());
        spec.profiles[0].named_ports[0].protocol = "ICMP".into();
        let e = slice_pods(&spec, |l| l).unwrap_err();
        assert!(e.contains("spec.profiles[0].namedPorts[0].protocol"), "{e}");
        spec.node.clear();
        assert!(slice_pods(&spec, |l| l).unwrap_err().contains("spec.node"));
    }

    #[test]
    fn pods_keep_their_slice_and_one_change_rewrites_one_slice() {
        let mut book = SliceBook::with_max("n1", 2);
        for i in 0..5 {
            book.upsert(pod(
                "x",
                &format!("p{i}"),
                "web",
                &format!("10.0.0.{}", i + 1),
            ));
        }
        let writes = book.writes();
        let names: Vec<&str> = writes.iter().map(SliceWrite::name).collect();
        assert_eq!(names, ["n1.0", "n1.1", "n1.2"]);
        for w in &writes {
            book.written(w);
        }
        assert!(book.writes().is_empty(), "nothing changed");
        // A new address for p3: only its slice (n1.1) is written.
        book.upsert(pod("x", "p3", "web", "10.0.1.4"));
        let writes = book.writes();
        assert_eq!(writes.len(), 1);
        assert_eq!(writes[0].name(), "n1.1");
        book.written(&writes[0]);
        // The same pod again: nothing.
        book.upsert(pod("x", "p3", "web", "10.0.1.4"));
        assert!(book.writes().is_empty());
        // p4 goes: its slice is emptied and deleted; a new pod fills the gap in n1.0 first.
        book.remove("x/p4");
        book.remove("x/p0");
        let writes = book.writes();
        assert_eq!(
            writes,
            vec![
                SliceWrite::Apply(
                    "n1.0".into(),
                    slice_spec("n1", [pod("x", "p1", "web", "10.0.0.2")].iter())
                ),
                SliceWrite::Delete("n1.2".into())
            ]
        );
        for w in &writes {
            book.written(w);
        }
        book.upsert(pod("x", "p9", "web", "10.0.0.9"));
        assert_eq!(book.writes()[0].name(), "n1.0");
    }

    #[test]
    fn adopted_slices_are_kept_rewritten_or_deleted_as_the_pods_say() {
        let mut book = SliceBook::with_max("n1", 2);
        let old = vec![
            (
                "n1.0".to_string(),
                slice_spec(
                    "n1",
                    [
                        pod("x", "a", "web", "10.0.0.1"),
                        pod("x", "b", "web", "10.0.0.2"),
                    ]
                    .iter(),
                ),
            ),
            (
                "n1.1".to_string(),
                slice_spec("n1", [pod("x", "gone", "web", "10.0.0.3")].iter()),
            ),
            ("other".to_string(), CiliateEndpointSliceSpec::default()),
        ];
        let strays = book.adopt(old);
        assert_eq!(strays, vec![SliceWrite::Delete("other".into())]);
        // After the local pods listed: a and b are still there, `gone` is not.
        book.remove("x/gone");
        let writes = book.writes();
        assert_eq!(writes, vec![SliceWrite::Delete("n1.1".into())]);
        // A failed write is retried.
        book.failed(&writes[0]);
        assert_eq!(book.writes(), writes);
    }
}
