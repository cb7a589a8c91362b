//! `cilium.io/v2` CiliumNetworkPolicy and CiliumClusterwideNetworkPolicy.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_yaml::Value;

use super::{IntOrString, LabelSelector, ObjectMeta, Unknown};

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

/// What an allow section (`ingress`, `egress`) and a deny section (`ingressDeny`,
/// `egressDeny`) of a Cilium rule differ in: the deny sections have no L7 part in `toPorts`, no
/// `authentication` and no `toFQDNs` (`Unknown`: reported as unknown fields).
pub trait Section: std::fmt::Debug + Clone + Default {
    type Ports: std::fmt::Debug + Clone + Serialize + serde::de::DeserializeOwned;
    type Authentication: std::fmt::Debug + Clone + Serialize + serde::de::DeserializeOwned;
    type Fqdns: std::fmt::Debug + Clone + Serialize + serde::de::DeserializeOwned;
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Allow;

#[derive(Debug, Clone, Copy, Default)]
pub struct Deny;

impl Section for Allow {
    type Ports = PortRule;
    type Authentication = Authentication;
    type Fqdns = Vec<FqdnSelector>;
}

impl Section for Deny {
    type Ports = PortDenyRule;
    type Authentication = Unknown;
    type Fqdns = Unknown;
}

/// One entry of `ingress` or `ingressDeny`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", bound = "")]
pub struct IngressRuleOf<S: Section> {
    pub from_endpoints: Option<Vec<LabelSelector>>,
    pub from_requires: Option<Vec<LabelSelector>>,
    #[serde(rename = "fromCIDR")]
    pub from_cidr: Option<Vec<String>>,
    #[serde(rename = "fromCIDRSet")]
    pub from_cidr_set: Option<Vec<CidrRule>>,
    pub from_entities: Option<Vec<String>>,
    pub from_groups: Option<Vec<Value>>,
    pub from_nodes: Option<Vec<LabelSelector>>,
    pub to_ports: Option<Vec<S::Ports>>,
    pub icmps: Option<Vec<IcmpRule>>,
    pub authentication: Option<S::Authentication>,
}

pub type IngressRule = IngressRuleOf<Allow>;
pub type IngressDenyRule = IngressRuleOf<Deny>;

/// One entry of `egress` or `egressDeny`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", bound = "")]
pub struct EgressRuleOf<S: Section> {
    pub to_endpoints: Option<Vec<LabelSelector>>,
    pub to_requires: Option<Vec<LabelSelector>>,
    #[serde(rename = "toCIDR")]
    pub to_cidr: Option<Vec<String>>,
    #[serde(rename = "toCIDRSet")]
    pub to_cidr_set: Option<Vec<CidrRule>>,
    pub to_entities: Option<Vec<String>>,
    pub to_services: Option<Vec<Value>>,
    #[serde(rename = "toFQDNs")]
    pub to_fqdns: Option<S::Fqdns>,
    pub to_groups: Option<Vec<Value>>,
    pub to_nodes: Option<Vec<LabelSelector>>,
    pub to_ports: Option<Vec<S::Ports>>,
    pub icmps: Option<Vec<IcmpRule>>,
    pub authentication: Option<S::Authentication>,
}

pub type EgressRule = EgressRuleOf<Allow>;
pub type EgressDenyRule = EgressRuleOf<Deny>;

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
