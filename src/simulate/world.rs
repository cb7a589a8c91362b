//! The entries of a world file of `ciliate policy simulate` (interfaces.md section 1). The
//! top level (`namespaces`, `nodes`, `pods`, `policies`, `probes`) is walked by `yaml.rs`, and
//! each entry is deserialised into one of these on its own.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::policy::api::IntOrString;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorldNode {
    pub name: String,
    #[serde(default)]
    pub ips: Vec<String>,
    pub labels: Option<BTreeMap<String, String>>,
    /// The node being simulated (pods without `node` run here).
    pub local: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct WorldPod {
    pub namespace: String,
    pub name: String,
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub ips: Vec<String>,
    pub node: Option<String>,
    pub ports: Option<Vec<ContainerPort>>,
    /// Defaults to `default`, as Kubernetes does.
    pub service_account: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ContainerPort {
    pub name: Option<String>,
    #[serde(alias = "containerPort")]
    pub port: i64,
    pub protocol: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Probe {
    pub from: ProbeEnd,
    /// Optional for a DNS probe: the first pod labelled `k8s-app=kube-dns`.
    pub to: Option<ProbeEnd>,
    /// A DNS query for this name (UDP 53 to `to`), instead of a connection.
    pub dns: Option<String>,
    pub port: Option<i64>,
    pub protocol: Option<String>,
    pub icmp_type: Option<i64>,
    /// An HTTP request on the connection, judged by the HTTP rules of both sides.
    pub http: Option<HttpProbe>,
}

/// The HTTP request of a probe (`method` defaults to `GET`, `path` to `/`, `host` to the
/// destination's address and port).
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HttpProbe {
    #[serde(default)]
    pub method: Option<String>,
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<BTreeMap<String, String>>,
}

/// A probe end as written: a pod reference or an address. YAML may hand us a number-like
/// scalar, so accept any scalar and keep its text.
#[derive(Debug, Clone, Deserialize)]
#[serde(transparent)]
pub struct ProbeEnd(pub IntOrString);

impl ProbeEnd {
    pub fn text(&self) -> String {
        match &self.0 {
            IntOrString::Int(i) => i.to_string(),
            IntOrString::Str(s) => s.clone(),
        }
    }
}
