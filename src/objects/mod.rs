//! The cluster objects the agent needs, independent of where they come from (a manifest
//! directory now, kube-rs watchers in Kubernetes mode): converted from k8s-openapi types.

pub mod addresses;
pub mod index;
pub use crate::kinds::Kind;

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::policy::engine::NamedPort;
use crate::policy::labels::check_labels;
use crate::policy::rule::{PROTO_SCTP, PROTO_TCP, PROTO_UDP};
use crate::services::{ServicePort, ServiceSpec, SliceEndpoint, SlicePort, SliceSpec, TargetPort};

/// `namespace/name` of a namespaced object.
pub type ObjectName = String;

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    /// Shared: the cluster index keeps one copy per distinct label map (the pods of a
    /// deployment have the same), not one per pod.
    pub labels: std::sync::Arc<BTreeMap<String, String>>,
    pub ips: Vec<IpAddr>,
    pub node: Option<String>,
    pub service_account: String,
    #[serde(skip)]
    pub named_ports: Vec<NamedPort>,
    /// The workload that controls the pod (`workload_of`); none for a pod no controller owns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<Workload>,
}

/// The workload a pod belongs to, as Hubble names it: `Deployment`/`web`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Workload {
    pub name: String,
    pub kind: String,
}

/// The workload of a pod, from its controller's owner reference, as Cilium derives it: a
/// ReplicaSet named `<name>-<the pod's pod-template-hash>` is Deployment `<name>`; a
/// ReplicationController of a pod labelled `deploymentconfig` is that DeploymentConfig; a Job
/// named `<name>-<8 to 10 digits>` is CronJob `<name>`; any other controller is itself. A pod
/// no controller owns has none.
pub fn workload_of(meta: &ObjectMeta) -> Option<Workload> {
    let owner = meta
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))?;
    let label = |k: &str| {
        meta.labels
            .as_ref()
            .and_then(|l| l.get(k))
            .filter(|v| !v.is_empty())
    };
    let named = |name: &str, kind: &str| {
        Some(Workload {
            name: name.to_string(),
            kind: kind.to_string(),
        })
    };
    match owner.kind.as_str() {
        "ReplicaSet" => {
            if let Some(name) = label("pod-template-hash")
                .and_then(|h| owner.name.strip_suffix(h.as_str()))
                .and_then(|n| n.strip_suffix('-'))
            {
                return named(name, "Deployment");
            }
        }
        "ReplicationController" => {
            if let Some(dc) = label("deploymentconfig") {
                return named(dc, "DeploymentConfig");
            }
        }
        "Job" => {
            if let Some((name, stamp)) = owner.name.rsplit_once('-') {
                let digits =
                    (8..=10).contains(&stamp.len()) && stamp.bytes().all(|b| b.is_ascii_digit());
                if digits && !name.is_empty() {
                    return named(name, "CronJob");
                }
            }
        }
        _ => {}
    }
    named(&owner.name, &owner.kind)
}

impl PodInfo {
    pub fn key(&self) -> ObjectName {
        format!("{}/{}", self.namespace, self.name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NamespaceInfo {
    pub name: String,
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeInfo {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub ips: Vec<IpAddr>,
    pub pod_cidrs: Vec<String>,
    /// `status.daemonEndpoints.kubeletEndpoint.Port`, when the kubelet reports it.
    pub kubelet_port: Option<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServiceInfo {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub selector: BTreeMap<String, String>,
    pub cluster_ips: Vec<String>,
    /// `spec.ports`, for service translation.
    pub ports: Vec<ServicePort>,
}

impl ServiceInfo {
    /// What service translation needs: the ClusterIPs (none for a headless service) and ports.
    pub fn spec(&self) -> ServiceSpec {
        ServiceSpec {
            cluster_ips: self
                .cluster_ips
                .iter()
                .filter_map(|ip| ip.parse().ok())
                .collect(),
            ports: self.ports.clone(),
        }
    }
}

/// What one EndpointSlice gives its service: the ready addresses (for `toServices`), and every
/// address with its readiness and the slice's ports (for service translation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EndpointSliceInfo {
    pub namespace: String,
    /// The `kubernetes.io/service-name` label.
    pub service: String,
    pub addresses: Vec<IpAddr>,
    pub endpoints: Vec<SliceEndpoint>,
    pub ports: Vec<SlicePort>,
    /// Addresses left out because no backend may have them (`services::refused_backend`), as
    /// `endpoints[i].addresses[j]: "ip" is why`; the rest of the slice is used.
    pub refused: Vec<String>,
}

impl EndpointSliceInfo {
    /// What service translation needs; `namespace` when the slice names none.
    pub fn spec(&self, namespace: &str) -> SliceSpec {
        SliceSpec {
            namespace: if self.namespace.is_empty() {
                namespace.to_string()
            } else {
                self.namespace.clone()
            },
            service: self.service.clone(),
            endpoints: self.endpoints.clone(),
            ports: self.ports.clone(),
        }
    }
}

/// Converts an EndpointSlice; endpoints whose `conditions.ready` is false are left out.
pub fn endpoint_slice_info(
    slice: &k8s_openapi::api::discovery::v1::EndpointSlice,
) -> Result<EndpointSliceInfo, String> {
    let labels = slice.metadata.labels.clone().unwrap_or_default();
    let service = labels
        .get("kubernetes.io/service-name")
        .cloned()
        .unwrap_or_default();
    let mut addresses = Vec::new();
    let mut endpoints = Vec::new();
    let mut refused = Vec::new();
    for (i, e) in slice.endpoints.iter().enumerate() {
        // An absent condition means ready (the EndpointSlice API's reading).
        let ready = e.conditions.as_ref().and_then(|c| c.ready) != Some(false);
        for (j, a) in e.addresses.iter().enumerate() {
            let ip: IpAddr = a.parse().map_err(|_| {
                format!("endpoints[{i}].addresses[{j}]: {a:?} is not an IP address")
            })?;
            if let Some(why) = crate::services::refused_backend(ip) {
                refused.push(format!("endpoints[{i}].addresses[{j}]: {a:?} is {why}"));
                continue;
            }
            if ready {
                addresses.push(ip);
            }
            endpoints.push(SliceEndpoint { address: ip, ready });
        }
    }
    let mut ports = Vec::new();
    for (i, p) in slice.ports.iter().flatten().enumerate() {
        let port = p
            .port
            .map(|n| {
                u16::try_from(n)
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| format!("ports[{i}].port: {n} is not a port number"))
            })
            .transpose()?;
        ports.push(SlicePort {
            name: p.name.clone().unwrap_or_default(),
            protocol: protocol_number(p.protocol.as_deref()),
            port,
        });
    }
    Ok(EndpointSliceInfo {
        namespace: slice.metadata.namespace.clone().unwrap_or_default(),
        service,
        addresses,
        endpoints,
        ports,
        refused,
    })
}

fn protocol_number(p: Option<&str>) -> u8 {
    match p.unwrap_or("TCP").to_ascii_uppercase().as_str() {
        "UDP" => PROTO_UDP,
        "SCTP" => PROTO_SCTP,
        _ => PROTO_TCP,
    }
}

/// `metadata.name`, which every object must have.
fn required_name(meta: &ObjectMeta) -> Result<String, String> {
    meta.name
        .clone()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| "metadata.name: missing".to_string())
}

/// `metadata.namespace`, or `default` when the object names none.
fn namespace_or(meta: &ObjectMeta, default: &str) -> String {
    meta.namespace
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| default.to_string())
}

/// Converts a Pod; `default_namespace` applies when the manifest has none.
/// One shared copy of each distinct pod label map, for converters that hold many pods (the
/// pods of a deployment have equal maps): a converted pod's own map is dropped at once.
/// Maps no pod uses any more are let go when the set has doubled since the last sweep.
#[derive(Debug, Default)]
pub struct LabelInterner {
    maps: crate::hashing::HashSet<std::sync::Arc<BTreeMap<String, String>>>,
    sweep_at: usize,
}

impl LabelInterner {
    pub fn intern(
        &mut self,
        labels: std::sync::Arc<BTreeMap<String, String>>,
    ) -> std::sync::Arc<BTreeMap<String, String>> {
        if let Some(shared) = self.maps.get(&labels) {
            return shared.clone();
        }
        if self.maps.len() >= self.sweep_at {
            self.maps.retain(|m| std::sync::Arc::strong_count(m) > 1);
            self.sweep_at = (self.maps.len() * 2).max(1024);
        }
        self.maps.insert(labels.clone());
        labels
    }

    pub fn len(&self) -> usize {
        self.maps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }
}

pub fn pod_info(pod: &Pod, default_namespace: &str) -> Result<PodInfo, String> {
    let name = required_name(&pod.metadata)?;
    let namespace = namespace_or(&pod.metadata, default_namespace);
    let mut ips = Vec::new();
    if let Some(status) = &pod.status {
        let listed: Vec<String> = status
            .pod_ips
            .iter()
            .flatten()
            .map(|p| p.ip.clone())
            .collect();
        let all = if listed.is_empty() {
            status.pod_ip.clone().into_iter().collect()
        } else {
            listed
        };
        for (i, ip) in all.iter().enumerate() {
            let a: IpAddr = ip
                .parse()
                .map_err(|_| format!("status.podIPs[{i}].ip: {ip:?} is not an IP address"))?;
            if !ips.contains(&a) {
                ips.push(a);
            }
        }
    }
    let spec = pod.spec.as_ref();
    let mut named_ports = Vec::new();
    for c in spec.map(|s| s.containers.as_slice()).unwrap_or(&[]) {
        for p in c.ports.iter().flatten() {
            if let (Some(n), Ok(port)) = (&p.name, u16::try_from(p.container_port)) {
                named_ports.push(NamedPort {
                    name: n.to_ascii_lowercase(),
                    protocol: protocol_number(p.protocol.as_deref()),
                    port,
                });
            }
        }
    }
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    check_labels(&labels).map_err(|m| format!("metadata.labels: {m}"))?;
    Ok(PodInfo {
        namespace,
        name,
        labels: std::sync::Arc::new(labels),
        ips,
        node: spec.and_then(|s| s.node_name.clone()),
        service_account: spec
            .and_then(|s| {
                s.service_account_name
                    .clone()
                    .or_else(|| s.service_account.clone())
            })
            .unwrap_or_else(|| "default".into()),
        named_ports,
        workload: workload_of(&pod.metadata),
    })
}

pub fn namespace_info(ns: &Namespace) -> Result<NamespaceInfo, String> {
    let name = required_name(&ns.metadata)?;
    let labels = ns.metadata.labels.clone().unwrap_or_default();
    check_labels(&labels).map_err(|m| format!("metadata.labels: {m}"))?;
    Ok(NamespaceInfo { name, labels })
}

pub fn node_info(node: &Node) -> Result<NodeInfo, String> {
    let name = required_name(&node.metadata)?;
    let mut ips = Vec::new();
    // InternalIP first: other nodes route this node's pod CIDRs through its first address.
    for kind in ["InternalIP", "ExternalIP"] {
        for a in node
            .status
            .iter()
            .flat_map(|s| s.addresses.iter().flatten())
            .filter(|a| a.type_ == kind)
        {
            if let Ok(ip) = a.address.parse::<IpAddr>() {
                if !ips.contains(&ip) {
                    ips.push(ip);
                }
            }
        }
    }
    let spec = node.spec.as_ref();
    let mut pod_cidrs: Vec<String> = spec.and_then(|s| s.pod_cidrs.clone()).unwrap_or_default();
    if pod_cidrs.is_empty() {
        pod_cidrs.extend(spec.and_then(|s| s.pod_cidr.clone()));
    }
    let labels = node.metadata.labels.clone().unwrap_or_default();
    check_labels(&labels).map_err(|m| format!("metadata.labels: {m}"))?;
    Ok(NodeInfo {
        name,
        labels,
        annotations: node.metadata.annotations.clone().unwrap_or_default(),
        ips,
        pod_cidrs,
        kubelet_port: node
            .status
            .as_ref()
            .and_then(|s| s.daemon_endpoints.as_ref())
            .and_then(|d| d.kubelet_endpoint.as_ref())
            .and_then(|k| u16::try_from(k.port).ok())
            .filter(|p| *p != 0),
    })
}

pub fn service_info(svc: &Service, default_namespace: &str) -> Result<ServiceInfo, String> {
    let name = required_name(&svc.metadata)?;
    let spec = svc.spec.as_ref();
    let mut cluster_ips: Vec<String> = spec.and_then(|s| s.cluster_ips.clone()).unwrap_or_default();
    if cluster_ips.is_empty() {
        cluster_ips.extend(spec.and_then(|s| s.cluster_ip.clone()));
    }
    for (i, ip) in cluster_ips.iter().enumerate() {
        // "None" (and "") is a headless service: no frontend.
        if !ip.is_empty() && ip != "None" && ip.parse::<IpAddr>().is_err() {
            return Err(format!("spec.clusterIPs[{i}]: {ip:?} is not an IP address"));
        }
    }
    let mut ports = Vec::new();
    for (i, p) in spec
        .and_then(|s| s.ports.as_ref())
        .into_iter()
        .flatten()
        .enumerate()
    {
        let port = u16::try_from(p.port)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("spec.ports[{i}].port: {} is not a port number", p.port))?;
        let target_port = match &p.target_port {
            None => None,
            Some(IntOrString::Int(n)) => Some(TargetPort::Number(
                u16::try_from(*n).ok().filter(|n| *n > 0).ok_or_else(|| {
                    format!("spec.ports[{i}].targetPort: {n} is not a port number")
                })?,
            )),
            Some(IntOrString::String(name)) if name.is_empty() => {
                return Err(format!("spec.ports[{i}].targetPort: empty name"))
            }
            Some(IntOrString::String(name)) => Some(TargetPort::Name(name.clone())),
        };
        ports.push(ServicePort {
            name: p.name.clone().unwrap_or_default(),
            protocol: protocol_number(p.protocol.as_deref()),
            port,
            target_port,
        });
    }
    Ok(ServiceInfo {
        namespace: namespace_or(&svc.metadata, default_namespace),
        name,
        labels: svc.metadata.labels.clone().unwrap_or_default(),
        selector: spec.and_then(|s| s.selector.clone()).unwrap_or_default(),
        cluster_ips,
        ports,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pods_workload_is_its_controller_as_cilium_names_it() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let meta = |kind: &str, name: &str, controller: bool, labels: &[(&str, &str)]| ObjectMeta {
            owner_references: Some(vec![OwnerReference {
                api_version: "apps/v1".into(),
                kind: kind.into(),
                name: name.into(),
                uid: "u".into(),
                controller: Some(controller),
                block_owner_deletion: None,
            }]),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        };
        let named = |name: &str, kind: &str| {
            Some(Workload {
                name: name.into(),
                kind: kind.into(),
            })
        };
        let hash = [("pod-template-hash", "5d9c8b7f4")];
        let cases = [
            (
                meta("ReplicaSet", "web-5d9c8b7f4", true, &hash),
                named("web", "Deployment"),
            ),
            // A ReplicaSet not named after the pod's template hash is itself.
            (
                meta("ReplicaSet", "web-abc", true, &hash),
                named("web-abc", "ReplicaSet"),
            ),
            (
                meta("ReplicaSet", "web-5d9c8b7f4", true, &[]),
                named("web-5d9c8b7f4", "ReplicaSet"),
            ),
            (
                meta("StatefulSet", "db", true, &[]),
                named("db", "StatefulSet"),
            ),
            (
                meta("DaemonSet", "agent", true, &[]),
                named("agent", "DaemonSet"),
            ),
            (
                meta("Job", "backup-28375920", true, &[]),
                named("backup", "CronJob"),
            ),
            (
                meta("Job", "backup-1234567", true, &[]),
                named("backup-1234567", "Job"),
            ),
            (meta("Job", "migrate", true, &[]), named("migrate", "Job")),
            (
                meta(
                    "ReplicationController",
                    "app-1",
                    true,
                    &[("deploymentconfig", "app")],
                ),
                named("app", "DeploymentConfig"),
            ),
            // An owner that is not the controller, or none: no workload.
            (meta("ReplicaSet", "web-5d9c8b7f4", false, &hash), None),
            (ObjectMeta::default(), None),
        ];
        for (m, want) in cases {
            assert_eq!(workload_of(&m), want, "{:?}", m.owner_references);
        }
    }

    #[test]
    fn interned_label_maps_are_shared_and_let_go_when_unused() {
        let mut i = LabelInterner::default();
        let map =
            |v: &str| std::sync::Arc::new(BTreeMap::from([("app".to_string(), v.to_string())]));
        let a = i.intern(map("a"));
        let a2 = i.intern(map("a"));
        assert!(std::sync::Arc::ptr_eq(&a, &a2));
        drop((a, a2));
        for k in 0..3000 {
            let _ = i.intern(map(&format!("x{k}")));
        }
        assert!(i.len() < 2100, "unused maps are swept: {}", i.len());
    }

    #[test]
    fn pods_convert_with_ips_ports_and_defaults() {
        let pod: Pod = serde_yaml::from_str(
            "metadata: {name: a, labels: {app: a}}
spec:
  containers: [{name: c, ports: [{name: HTTP, containerPort: 8080}, {name: dns, containerPort: 53, protocol: UDP}]}]
status: {podIPs: [{ip: 10.0.0.1}, {ip: 'fd00::1'}]}",
        )
        .unwrap();
        let p = pod_info(&pod, "default").unwrap();
        assert_eq!(p.key(), "default/a");
        assert_eq!(p.ips.len(), 2);
        assert_eq!(p.service_account, "default");
        assert_eq!(
            p.named_ports[0],
            NamedPort {
                name: "http".into(),
                protocol: PROTO_TCP,
                port: 8080
            }
        );
        assert_eq!(p.named_ports[1].protocol, PROTO_UDP);
    }

    #[test]
    fn bad_pod_ip_is_named() {
        let pod: Pod =
            serde_yaml::from_str("metadata: {name: a}\nstatus: {podIPs: [{ip: nope}]}").unwrap();
        assert!(pod_info(&pod, "x")
            .unwrap_err()
            .contains("status.podIPs[0].ip"));
    }

    #[test]
    fn services_and_slices_convert_with_ports_and_readiness() {
        let svc: Service = serde_yaml::from_str(
            "metadata: {name: b, namespace: ns}
spec:
  clusterIP: 10.96.0.50
  ports: [{name: http, port: 80, targetPort: web}, {name: dns, port: 53, protocol: UDP, targetPort: 5353}]",
        )
        .unwrap();
        let s = service_info(&svc, "default").unwrap();
        let spec = s.spec();
        assert_eq!(
            spec.cluster_ips,
            vec!["10.96.0.50".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(
            spec.ports[0].target_port,
            Some(TargetPort::Name("web".into()))
        );
        assert_eq!(spec.ports[1].protocol, PROTO_UDP);
        assert_eq!(spec.ports[1].target_port, Some(TargetPort::Number(5353)));
        let bad: Service =
            serde_yaml::from_str("metadata: {name: b}\nspec: {ports: [{port: 70000}]}").unwrap();
        assert!(service_info(&bad, "x")
            .unwrap_err()
            .contains("spec.ports[0].port"));
        let bad: Service =
            serde_yaml::from_str("metadata: {name: b}\nspec: {clusterIPs: [nope]}").unwrap();
        assert!(service_info(&bad, "x")
            .unwrap_err()
            .contains("spec.clusterIPs[0]"));
        let headless: Service =
            serde_yaml::from_str("metadata: {name: h}\nspec: {clusterIP: None}").unwrap();
        assert!(service_info(&headless, "x")
            .unwrap()
            .spec()
            .cluster_ips
            .is_empty());

        let slice: k8s_openapi::api::discovery::v1::EndpointSlice = serde_yaml::from_str(
            "metadata: {name: b-1, labels: {kubernetes.io/service-name: b}}
addressType: IPv4
endpoints:
- {addresses: [10.1.0.2]}
- {addresses: [10.1.0.3], conditions: {ready: false}}
ports: [{name: http, port: 8080}]",
        )
        .unwrap();
        let e = endpoint_slice_info(&slice).unwrap();
        assert_eq!(e.addresses.len(), 1, "toServices sees ready addresses only");
        let spec = e.spec("ns");
        assert_eq!(spec.namespace, "ns");
        assert_eq!(spec.endpoints.len(), 2);
        assert!(spec.endpoints[0].ready && !spec.endpoints[1].ready);
        assert_eq!(spec.ports[0].port, Some(8080));
        assert_eq!(spec.ports[0].protocol, PROTO_TCP);
    }

    #[test]
    fn node_pod_cidrs_and_addresses() {
        let node: Node = serde_yaml::from_str(
            "metadata: {name: n1}
spec: {podCIDRs: [10.244.1.0/24]}
status: {addresses: [{type: InternalIP, address: 172.18.0.2}, {type: Hostname, address: n1}]}",
        )
        .unwrap();
        let n = node_info(&node).unwrap();
        assert_eq!(n.pod_cidrs, vec!["10.244.1.0/24".to_string()]);
        assert_eq!(n.ips, vec!["172.18.0.2".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn invalid_labels_are_rejected_where_objects_enter() {
        let long = "v".repeat(64);
        let pod: Pod =
            serde_yaml::from_str(&format!("metadata: {{name: a, labels: {{app: {long}}}}}"))
                .unwrap();
        let e = pod_info(&pod, "x").unwrap_err();
        assert!(
            e.starts_with("metadata.labels: ") && e.contains("\"app\""),
            "{e}"
        );
        let ns: Namespace =
            serde_yaml::from_str(&format!("metadata: {{name: x, labels: {{{long}: v}}}}")).unwrap();
        assert!(namespace_info(&ns).unwrap_err().contains("63"));
        let node: Node =
            serde_yaml::from_str("metadata: {name: n, labels: {'Bad/zone': a}}").unwrap();
        assert!(node_info(&node).unwrap_err().contains("RFC 1123"));
        let ok: Pod =
            serde_yaml::from_str("metadata: {name: a, labels: {app.kubernetes.io/name: web}}")
                .unwrap();
        assert!(pod_info(&ok, "x").is_ok());
    }

    #[test]
    fn the_internal_ip_comes_first_whatever_the_order_of_addresses() {
        let node: Node = serde_yaml::from_str(
            "metadata: {name: n1}
status: {addresses: [{type: ExternalIP, address: 1.2.3.4}, {type: InternalIP, address: 172.18.0.2}]}",
        )
        .unwrap();
        let ips: Vec<String> = node_info(&node)
            .unwrap()
            .ips
            .iter()
            .map(|i| i.to_string())
            .collect();
        assert_eq!(ips, ["172.18.0.2", "1.2.3.4"]);
    }
}
