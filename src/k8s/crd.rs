//! The CustomResourceDefinitions ciliate serves for Cilium's policy kinds: `CiliumNetworkPolicy`
//! (`cnp`, namespaced) and `CiliumClusterwideNetworkPolicy` (`ccnp`, cluster-scoped), both
//! `cilium.io/v2` with a status subresource.
//!
//! Users bring Cilium's YAML unchanged, and the agent validates each policy itself with field
//! paths (`policy::translate`), so the schema keeps `spec` and `specs` open
//! (`x-kubernetes-preserve-unknown-fields`): the API server neither prunes nor rejects a field
//! ciliate reports on better. The status is ciliate's own, typed, and modelled on Cilium's:
//! one entry per node (`status.nodes.<node>`) plus `Valid` conditions.
//!
//! The manifests in `manifests/crds/` are generated from these types (`tests/manifests.rs`
//! fails when they are stale; `UPDATE_MANIFESTS=1` rewrites them).

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{CustomResource, CustomResourceExt};
use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// The condition type that says whether ciliate accepted the policy.
pub const CONDITION_VALID: &str = "Valid";

/// The `spec` of a `CiliumNetworkPolicy`: one Cilium rule, kept as the user wrote it.
///
/// `None` when the policy only has `specs`. The typed object carries `spec` and `status` only
/// (kube's derive knows one spec field), so read policy bodies from the raw object with
/// `policy::translate::parse_policy`, and write status with `patch_status` (a merge patch, which
/// leaves `specs` alone) rather than replacing the whole object.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "cilium.io",
    version = "v2",
    kind = "CiliumNetworkPolicy",
    namespaced,
    plural = "ciliumnetworkpolicies",
    shortname = "cnp",
    shortname = "ciliumnp",
    category = "cilium",
    category = "ciliumpolicy",
    status = "PolicyStatus",
    schema = "manual",
    derive = "PartialEq",
    doc = "A Cilium network policy scoped to its namespace (cilium.io/v2), enforced by ciliate.",
    printcolumn(
        name = "Valid",
        type_ = "string",
        json_path = ".status.conditions[?(@.type=='Valid')].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
// Transparent over an `Option` so a policy without `spec` (only `specs`) still deserialises:
// serde hands a missing field to `Option`'s deserialiser as `None`.
#[serde(transparent)]
pub struct CiliumNetworkPolicySpec(pub Option<Map<String, Value>>);

/// The `spec` of a `CiliumClusterwideNetworkPolicy`: one Cilium rule, kept as the user wrote it.
///
/// `None` when the policy only has `specs`; see [`CiliumNetworkPolicySpec`] for what the typed
/// object leaves out.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "cilium.io",
    version = "v2",
    kind = "CiliumClusterwideNetworkPolicy",
    plural = "ciliumclusterwidenetworkpolicies",
    shortname = "ccnp",
    category = "cilium",
    category = "ciliumpolicy",
    status = "PolicyStatus",
    schema = "manual",
    derive = "PartialEq",
    doc = "A cluster-wide Cilium network policy (cilium.io/v2), enforced by ciliate.",
    printcolumn(
        name = "Valid",
        type_ = "string",
        json_path = ".status.conditions[?(@.type=='Valid')].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(transparent)]
pub struct CiliumClusterwideNetworkPolicySpec(pub Option<Map<String, Value>>);

/// The status of a Cilium policy as ciliate reports it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyStatus {
    /// Per node: how the agent on that node enforces the policy. Each agent merge-patches only
    /// its own entry, so agents never conflict.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub nodes: BTreeMap<String, PolicyNodeStatus>,
    /// Conditions of the policy as a whole; `Valid` says whether it passed validation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<PolicyCondition>,
}

/// How one node's agent enforces a policy (Cilium's `CiliumNetworkPolicyNodeStatus`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyNodeStatus {
    /// The policy was accepted and imported on this node.
    pub ok: bool,
    /// Why the policy was not accepted, when `ok` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The node enforces the policy: every endpoint it selects has realized it.
    pub enforcing: bool,
    /// The agent's policy revision that holds this version of the policy.
    // i64 rather than u64: Kubernetes' API conventions have no unsigned integers.
    pub local_policy_revision: i64,
    /// When this entry was written (RFC 3339).
    #[schemars(schema_with = "rfc3339")]
    pub last_updated: String,
    /// Free-form notes, e.g. parts of the policy that select nothing (fail closed).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl PolicyNodeStatus {
    /// A JSON merge patch for the status subresource that sets this node's entry and leaves every
    /// other node's entry and the conditions as they are.
    pub fn merge_patch(&self, node_name: &str) -> Value {
        json!({"status": {"nodes": {node_name: self}}})
    }
}

/// A condition of a policy, in Kubernetes' usual shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyCondition {
    /// The condition's type; ciliate writes Valid.
    #[serde(rename = "type")]
    pub type_: String,
    /// Whether the condition holds.
    pub status: ConditionStatus,
    /// A CamelCase reason for the last transition.
    #[serde(default)]
    pub reason: String,
    /// A human-readable explanation, e.g. the validation error with its field path.
    #[serde(default)]
    pub message: String,
    /// When `status` last changed (RFC 3339).
    #[schemars(schema_with = "rfc3339")]
    pub last_transition_time: String,
}

/// The value of a condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ConditionStatus {
    /// The condition holds.
    True,
    /// The condition does not hold.
    False,
}

/// Timestamps stay strings in Rust (the agent formats them with chrono), but the schema says
/// what they hold, so `kubectl explain` and the API server see a date-time.
fn rfc3339(_: &mut SchemaGenerator) -> Schema {
    json_schema!({"type": "string", "format": "date-time"})
}

/// The schema of a policy object: open `spec` and `specs`, typed `status`. Hand-written (the
/// derive's `schema = "manual"`) because the derived root knows only `spec`, and a structural
/// schema without `specs` would make the API server prune users' rule lists.
fn policy_schema(generator: &mut SchemaGenerator, description: &str) -> Schema {
    json_schema!({
        "description": description,
        "type": "object",
        "properties": {
            "spec": {
                "description": "One Cilium rule, validated by ciliate (not by the API server).",
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": true,
            },
            "specs": {
                "description": "A list of Cilium rules, validated by ciliate (not by the API server).",
                "type": "array",
                "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
            },
            "status": generator.subschema_for::<PolicyStatus>(),
        },
    })
}

impl JsonSchema for CiliumNetworkPolicy {
    fn schema_name() -> Cow<'static, str> {
        "CiliumNetworkPolicy".into()
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        policy_schema(
            generator,
            "CiliumNetworkPolicy: a Cilium network policy scoped to its namespace, enforced by ciliate.",
        )
    }
}

impl JsonSchema for CiliumClusterwideNetworkPolicy {
    fn schema_name() -> Cow<'static, str> {
        "CiliumClusterwideNetworkPolicy".into()
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        policy_schema(
            generator,
            "CiliumClusterwideNetworkPolicy: a cluster-wide Cilium network policy, enforced by ciliate.",
        )
    }
}

/// The CRDs with the file name each has under `manifests/crds/`: ciliate's endpoint slices and
/// every kind the registry (`kinds::KINDS`) marks `crd`.
pub fn crds() -> [(&'static str, CustomResourceDefinition); 6] {
    use super::npa_crd::{AdminNetworkPolicy, BaselineAdminNetworkPolicy, ClusterNetworkPolicy};
    [
        ("ciliateendpointslices.yaml", super::slices::crd()),
        ("ciliumnetworkpolicies.yaml", CiliumNetworkPolicy::crd()),
        (
            "ciliumclusterwidenetworkpolicies.yaml",
            CiliumClusterwideNetworkPolicy::crd(),
        ),
        (
            "policy.networking.k8s.io_adminnetworkpolicies.yaml",
            AdminNetworkPolicy::crd(),
        ),
        (
            "policy.networking.k8s.io_baselineadminnetworkpolicies.yaml",
            BaselineAdminNetworkPolicy::crd(),
        ),
        (
            "policy.networking.k8s.io_clusternetworkpolicies.yaml",
            ClusterNetworkPolicy::crd(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema_of(crd: &CustomResourceDefinition) -> Value {
        let version = &crd.spec.versions[0];
        serde_json::to_value(&version.schema.as_ref().expect("schema").open_api_v3_schema)
            .expect("schema as JSON")
    }

    #[test]
    fn every_kind_the_registry_gives_a_crd_has_one() {
        let crds = crds();
        for info in crate::kinds::KINDS.iter().filter(|r| r.crd) {
            let Some((_, crd)) = crds.iter().find(|(_, c)| c.spec.names.kind == info.name) else {
                panic!(
                    "{}: the registry says it has a CRD; crds() has none",
                    info.name
                );
            };
            assert_eq!(crd.spec.group, info.group, "{}", info.name);
            assert_eq!(crd.spec.names.plural, info.plural, "{}", info.name);
            let scope = if info.cluster_scoped {
                "Cluster"
            } else {
                "Namespaced"
            };
            assert_eq!(crd.spec.scope, scope, "{}", info.name);
            assert!(
                crd.spec.versions.iter().any(|v| v.name == info.version),
                "{}",
                info.name
            );
        }
        // And every policy CRD is a kind the registry knows.
        for (_, crd) in &crds {
            if crd.spec.names.kind.ends_with("Policy") {
                assert!(
                    crate::kinds::Kind::parse(&crd.spec.names.kind).is_some_and(|k| k.info().crd),
                    "{}",
                    crd.spec.names.kind
                );
            }
        }
    }

    #[test]
    fn names_scope_and_subresources_match_cilium() {
        let cnp = CiliumNetworkPolicy::crd();
        assert_eq!(
            cnp.metadata.name.as_deref(),
            Some("ciliumnetworkpolicies.cilium.io")
        );
        assert_eq!(cnp.spec.scope, "Namespaced");
        assert_eq!(cnp.spec.names.kind, "CiliumNetworkPolicy");
        assert_eq!(
            cnp.spec.names.short_names.as_deref(),
            Some(&["cnp".to_string(), "ciliumnp".to_string()][..])
        );
        let ccnp = CiliumClusterwideNetworkPolicy::crd();
        assert_eq!(ccnp.spec.scope, "Cluster");
        assert_eq!(ccnp.spec.names.plural, "ciliumclusterwidenetworkpolicies");
        assert_eq!(
            ccnp.spec.names.short_names.as_deref(),
            Some(&["ccnp".to_string()][..])
        );
        for crd in [&cnp, &ccnp] {
            let version = &crd.spec.versions[0];
            assert_eq!(version.name, "v2");
            assert!(version.served && version.storage);
            assert!(version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some());
            let columns = version
                .additional_printer_columns
                .as_deref()
                .unwrap_or_default();
            assert_eq!(columns[0].name, "Valid");
        }
    }

    #[test]
    fn spec_and_specs_are_open_and_optional_status_is_typed() {
        let schema = schema_of(&CiliumNetworkPolicy::crd());
        assert_eq!(schema["type"], "object");
        assert_eq!(
            schema["required"],
            Value::Null,
            "neither spec nor specs is required"
        );
        let props = &schema["properties"];
        assert_eq!(props["spec"]["x-kubernetes-preserve-unknown-fields"], true);
        assert_eq!(
            props["specs"]["items"]["x-kubernetes-preserve-unknown-fields"],
            true
        );
        let node = &props["status"]["properties"]["nodes"]["additionalProperties"];
        assert_eq!(node["properties"]["lastUpdated"]["format"], "date-time");
        assert_eq!(node["properties"]["localPolicyRevision"]["type"], "integer");
        let mut required: Vec<_> = node["required"].as_array().expect("required").clone();
        required.sort_by_key(|v| v.to_string());
        assert_eq!(
            required,
            vec![
                json!("enforcing"),
                json!("lastUpdated"),
                json!("localPolicyRevision"),
                json!("ok")
            ]
        );
        let condition = &props["status"]["properties"]["conditions"]["items"];
        assert_eq!(
            condition["properties"]["status"]["enum"],
            json!(["True", "False"])
        );
    }

    #[test]
    fn a_policy_with_only_specs_deserialises_and_keeps_no_spec() {
        let cnp: CiliumNetworkPolicy = serde_json::from_value(json!({
            "apiVersion": "cilium.io/v2", "kind": "CiliumNetworkPolicy",
            "metadata": {"name": "p", "namespace": "x"},
            "specs": [{"endpointSelector": {}}]
        }))
        .expect("specs-only policy");
        assert_eq!(cnp.spec, CiliumNetworkPolicySpec(None));
        assert_eq!(cnp.status, None);
    }

    #[test]
    fn node_status_patch_touches_only_that_node() {
        let status = PolicyNodeStatus {
            ok: true,
            enforcing: true,
            local_policy_revision: 7,
            last_updated: "2025-01-02T03:04:05Z".into(),
            ..PolicyNodeStatus::default()
        };
        assert_eq!(
            status.merge_patch("node-1"),
            json!({"status": {"nodes": {"node-1": {
                "ok": true, "enforcing": true, "localPolicyRevision": 7,
                "lastUpdated": "2025-01-02T03:04:05Z"
            }}}})
        );
    }
}
