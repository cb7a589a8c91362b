//! `networking.k8s.io/v1` NetworkPolicy.

use serde::{Deserialize, Serialize};
use serde_yaml::Value;

use super::{IntOrString, LabelSelector, ObjectMeta};

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
