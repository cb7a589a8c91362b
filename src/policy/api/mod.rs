//! Wire types of the policy kinds, as users write them (YAML or JSON), one module per family
//! (`kinds::Family`): `kubernetes` (`networking.k8s.io/v1` NetworkPolicy), `cilium`
//! (`cilium.io/v2` CiliumNetworkPolicy / CiliumClusterwideNetworkPolicy), `npa`
//! (`policy.networking.k8s.io`: the cluster tiers); here what they share.
//!
//! They mirror the upstream types field for field, with every field optional so that
//! *validation* (in `translate`), not deserialisation, decides what is missing and says where.
//! Unknown fields are not errors: the loader reports them as warnings, as the API server would
//! prune them.

mod cilium;
mod kubernetes;
mod npa;

pub use cilium::*;
pub use kubernetes::*;
pub use npa::*;

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

/// A field one variant of a shared rule type does not have (e.g. `authentication` in a Cilium
/// deny rule): never set, and reported like any unknown field when a document has it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unknown;

impl<'de> Deserialize<'de> for Unknown {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(d).map(|_| Unknown)
    }
}

impl Serialize for Unknown {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_none()
    }
}
