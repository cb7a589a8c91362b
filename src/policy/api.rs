//! Wire types of the three policy kinds, as users write them (YAML or JSON).
//!
//! These mirror `networking.k8s.io/v1` NetworkPolicy and `cilium.io/v2` CiliumNetworkPolicy /
//! CiliumClusterwideNetworkPolicy field for field, with every field optional so that *validation*
//! (in `translate`), not deserialisation, decides what is missing and says where. Unknown fields
//! are not errors: the loader reports them as warnings, as the API server would prune them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_yaml::Value;

/// A Kubernetes `IntOrString` (ports, ICMP types).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum IntOrString {
    Int(i64),
    Str(String),
}

impl std::fmt::Display for IntOrString {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IntOrString::Int(i) => write!(f, "{i}"),
            IntOrString::Str(s) => write!(f, "{s:?}"),
        }
    }
}

/// Object metadata. Only name and namespace matter; the rest (labels, annotations, uid, ...) is
/// kept opaque and is not reported as unknown.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ObjectMeta {
    pub name: Option<String>,
    pub namespace: Option<String>,
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// A Kubernetes label selector. `matchLabels: null` is the same as absent (selects everything).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    pub match_labels: Option<BTreeMap<String, String>>,
    pub match_expressions: Option<Vec<LabelSelectorRequirement>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LabelSelectorRequirement {
    pub key: Option<String>,
    pub operator: Option<String>,
    pub values: Option<Vec<String>>,
}

// ---------------------------------------------------------------- NetworkPolicy

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicy {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: Option<NetworkPolicySpec>,
    pub status: Option<Value>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicySpec {
    pub pod_selector: Option<LabelSelector>,
    pub policy_types: Option<Vec<String>>,
    pub ingress: Option<Vec<NetworkPolicyIngressRule>>,
    pub egress: Option<Vec<NetworkPolicyEgressRule>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NetworkPolicyIngressRule {
    pub from: Option<Vec<NetworkPolicyPeer>>,
    pub ports: Option<Vec<NetworkPolicyPort>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NetworkPolicyEgressRule {
    pub to: Option<Vec<NetworkPolicyPeer>>,
    pub ports: Option<Vec<NetworkPolicyPort>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicyPeer {
    pub pod_selector: Option<LabelSelector>,
    pub namespace_selector: Option<LabelSelector>,
    pub ip_block: Option<IpBlock>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct IpBlock {
    pub cidr: Option<String>,
    pub except: Option<Vec<String>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicyPort {
    pub protocol: Option<String>,
    pub port: Option<IntOrString>,
    pub end_port: Option<i64>,
}

// ---------------------------------------------------------------- Cilium

/// CiliumNetworkPolicy and CiliumClusterwideNetworkPolicy share this shape.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CiliumPolicy {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: Option<Rule>,
    pub specs: Option<Vec<Rule>>,
    pub status: Option<Value>,
}

/// One Cilium policy rule (`spec`, or an element of `specs`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rule {
    pub endpoint_selector: Option<LabelSelector>,
    pub node_selector: Option<LabelSelector>,
    pub ingress: Option<Vec<IngressRule>>,
    pub ingress_deny: Option<Vec<IngressDenyRule>>,
    pub egress: Option<Vec<EgressRule>>,
    pub egress_deny: Option<Vec<EgressDenyRule>>,
    pub enable_default_deny: Option<DefaultDenyConfig>,
    pub labels: Option<Value>,
    pub description: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DefaultDenyConfig {
    pub ingress: Option<bool>,
    pub egress: Option<bool>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IngressRule {
    pub from_endpoints: Option<Vec<LabelSelector>>,
    pub from_requires: Option<Vec<LabelSelector>>,
    #[serde(rename = "fromCIDR")]
    pub from_cidr: Option<Vec<String>>,
    #[serde(rename = "fromCIDRSet")]
    pub from_cidr_set: Option<Vec<CidrRule>>,
    pub from_entities: Option<Vec<String>>,
    pub from_groups: Option<Vec<Value>>,
    pub from_nodes: Option<Vec<LabelSelector>>,
    pub to_ports: Option<Vec<PortRule>>,
    pub icmps: Option<Vec<IcmpRule>>,
    pub authentication: Option<Authentication>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IngressDenyRule {
    pub from_endpoints: Option<Vec<LabelSelector>>,
    pub from_requires: Option<Vec<LabelSelector>>,
    #[serde(rename = "fromCIDR")]
    pub from_cidr: Option<Vec<String>>,
    #[serde(rename = "fromCIDRSet")]
    pub from_cidr_set: Option<Vec<CidrRule>>,
    pub from_entities: Option<Vec<String>>,
    pub from_groups: Option<Vec<Value>>,
    pub from_nodes: Option<Vec<LabelSelector>>,
    pub to_ports: Option<Vec<PortDenyRule>>,
    pub icmps: Option<Vec<IcmpRule>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EgressRule {
    pub to_endpoints: Option<Vec<LabelSelector>>,
    pub to_requires: Option<Vec<LabelSelector>>,
    #[serde(rename = "toCIDR")]
    pub to_cidr: Option<Vec<String>>,
    #[serde(rename = "toCIDRSet")]
    pub to_cidr_set: Option<Vec<CidrRule>>,
    pub to_entities: Option<Vec<String>>,
    pub to_services: Option<Vec<Value>>,
    #[serde(rename = "toFQDNs")]
    pub to_fqdns: Option<Vec<FqdnSelector>>,
    pub to_groups: Option<Vec<Value>>,
    pub to_nodes: Option<Vec<LabelSelector>>,
    pub to_ports: Option<Vec<PortRule>>,
    pub icmps: Option<Vec<IcmpRule>>,
    pub authentication: Option<Authentication>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EgressDenyRule {
    pub to_endpoints: Option<Vec<LabelSelector>>,
    pub to_requires: Option<Vec<LabelSelector>>,
    #[serde(rename = "toCIDR")]
    pub to_cidr: Option<Vec<String>>,
    #[serde(rename = "toCIDRSet")]
    pub to_cidr_set: Option<Vec<CidrRule>>,
    pub to_entities: Option<Vec<String>>,
    pub to_services: Option<Vec<Value>>,
    pub to_groups: Option<Vec<Value>>,
    pub to_nodes: Option<Vec<LabelSelector>>,
    pub to_ports: Option<Vec<PortDenyRule>>,
    pub icmps: Option<Vec<IcmpRule>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CidrRule {
    pub cidr: Option<String>,
    pub except: Option<Vec<String>>,
    pub cidr_group_ref: Option<String>,
    pub cidr_group_selector: Option<Value>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FqdnSelector {
    pub match_name: Option<String>,
    pub match_pattern: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Authentication {
    pub mode: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortRule {
    pub ports: Option<Vec<PortProtocol>>,
    pub rules: Option<L7Rules>,
    #[serde(rename = "terminatingTLS")]
    pub terminating_tls: Option<Value>,
    #[serde(rename = "originatingTLS")]
    pub originating_tls: Option<Value>,
    pub server_names: Option<Vec<String>>,
    pub listener: Option<Value>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PortDenyRule {
    pub ports: Option<Vec<PortProtocol>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortProtocol {
    pub port: Option<IntOrString>,
    pub end_port: Option<i64>,
    pub protocol: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct L7Rules {
    pub http: Option<Vec<HttpRule>>,
    pub kafka: Option<Vec<KafkaRule>>,
    pub dns: Option<Vec<DnsRule>>,
    pub l7proto: Option<String>,
    pub l7: Option<Vec<BTreeMap<String, String>>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRule {
    pub method: Option<String>,
    pub path: Option<String>,
    pub host: Option<String>,
    pub headers: Option<Vec<String>>,
    pub header_matches: Option<Vec<Value>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KafkaRule {
    pub role: Option<String>,
    pub api_key: Option<String>,
    pub api_version: Option<String>,
    #[serde(rename = "clientID")]
    pub client_id: Option<String>,
    pub topic: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DnsRule {
    pub match_name: Option<String>,
    pub match_pattern: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct IcmpRule {
    pub fields: Option<Vec<IcmpField>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct IcmpField {
    #[serde(rename = "type")]
    pub icmp_type: Option<IntOrString>,
    pub family: Option<String>,
}
