//! `policy.networking.k8s.io` (sig-network's network-policy-api): AdminNetworkPolicy and
//! BaselineAdminNetworkPolicy (`v1alpha1`, v0.1.7) and ClusterNetworkPolicy (`v1alpha2`,
//! v0.2.0). The versions differ in what selects ports (`ports` against `protocols`) and in the
//! peers' and actions' names; what one version does not have is `Unknown` in it (reported as
//! an unknown field).

use serde::{Deserialize, Serialize};
use serde_yaml::Value;

use super::{LabelSelector, ObjectMeta, Unknown};

/// What a version of the API has.
pub trait Version: std::fmt::Debug + Clone + Default {
    /// `ports` (v1alpha1).
    type Ports: std::fmt::Debug + Clone + Serialize + serde::de::DeserializeOwned;
    /// `protocols` (v1alpha2).
    type Protocols: std::fmt::Debug + Clone + Serialize + serde::de::DeserializeOwned;
    /// `tier` (v1alpha2).
    type Tier: std::fmt::Debug + Clone + Serialize + serde::de::DeserializeOwned;
    /// The CRD's `maxItems` of `ingress`, `egress`, a rule's peers and its ports (`ports` or
    /// `protocols`): 100 in v1alpha1, 25 in v1alpha2.
    const MAX_ITEMS: usize;
    /// Where a rule's ports are: `ports` (v1alpha1) or `protocols` (v1alpha2).
    const PORTS_FIELD: &'static str;
}

#[derive(Debug, Clone, Copy, Default)]
pub struct V1alpha1;

#[derive(Debug, Clone, Copy, Default)]
pub struct V1alpha2;

impl Version for V1alpha1 {
    type Ports = Vec<AnpPort>;
    type Protocols = Unknown;
    type Tier = Unknown;
    const MAX_ITEMS: usize = 100;
    const PORTS_FIELD: &'static str = "ports";
}

impl Version for V1alpha2 {
    type Ports = Unknown;
    type Protocols = Vec<CnpProtocol>;
    type Tier = String;
    const MAX_ITEMS: usize = 25;
    const PORTS_FIELD: &'static str = "protocols";
}

/// An AdminNetworkPolicy, BaselineAdminNetworkPolicy or ClusterNetworkPolicy.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", bound = "")]
pub struct TierPolicy<V: Version> {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: Option<TierPolicySpec<V>>,
    pub status: Option<Value>,
}

pub type AdminNetworkPolicy = TierPolicy<V1alpha1>;
pub type ClusterNetworkPolicy = TierPolicy<V1alpha2>;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", bound = "")]
pub struct TierPolicySpec<V: Version> {
    pub tier: Option<V::Tier>,
    pub priority: Option<i64>,
    pub subject: Option<TierSubject>,
    pub ingress: Option<Vec<TierIngressRule<V>>>,
    pub egress: Option<Vec<TierEgressRule<V>>>,
}

/// Exactly one of the two.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TierSubject {
    pub namespaces: Option<LabelSelector>,
    pub pods: Option<NamespacedPod>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedPod {
    pub namespace_selector: Option<LabelSelector>,
    pub pod_selector: Option<LabelSelector>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", bound = "")]
pub struct TierIngressRule<V: Version> {
    pub name: Option<String>,
    pub action: Option<String>,
    pub from: Option<Vec<TierPeer>>,
    pub ports: Option<V::Ports>,
    pub protocols: Option<V::Protocols>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", bound = "")]
pub struct TierEgressRule<V: Version> {
    pub name: Option<String>,
    pub action: Option<String>,
    pub to: Option<Vec<TierPeer>>,
    pub ports: Option<V::Ports>,
    pub protocols: Option<V::Protocols>,
}

/// Exactly one field. Ingress peers have only `namespaces` and `pods` (translation says so).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TierPeer {
    pub namespaces: Option<LabelSelector>,
    pub pods: Option<NamespacedPod>,
    pub nodes: Option<LabelSelector>,
    pub networks: Option<Vec<String>>,
    pub domain_names: Option<Vec<String>>,
}

/// `v1alpha1` `ports[]`: exactly one field.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AnpPort {
    pub port_number: Option<AnpPortNumber>,
    pub named_port: Option<String>,
    pub port_range: Option<AnpPortRange>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AnpPortNumber {
    pub protocol: Option<String>,
    pub port: Option<i64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AnpPortRange {
    pub protocol: Option<String>,
    pub start: Option<i64>,
    pub end: Option<i64>,
}

/// `v1alpha2` `protocols[]`: exactly one field.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CnpProtocol {
    pub tcp: Option<CnpTransport>,
    pub udp: Option<CnpTransport>,
    pub sctp: Option<CnpTransport>,
    pub destination_named_port: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CnpTransport {
    pub destination_port: Option<CnpPort>,
}

/// `number` or `range`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CnpPort {
    pub number: Option<i64>,
    pub range: Option<CnpPortRange>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CnpPortRange {
    pub start: Option<i64>,
    pub end: Option<i64>,
}
