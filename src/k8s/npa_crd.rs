//! The CustomResourceDefinitions of sig-network's network-policy-api (`policy.networking.k8s.io`):
//! `AdminNetworkPolicy` (`anp`) and `BaselineAdminNetworkPolicy` (`banp`) at `v1alpha1`
//! (v0.1.7), `ClusterNetworkPolicy` at `v1alpha2` (v0.2.0), all cluster-scoped with a status
//! subresource.
//!
//! What matches the upstream CRDs: names, group, version, scope, printer columns, the
//! `api-approved.kubernetes.io` annotation (the API server refuses CRDs of a `*.k8s.io` group
//! without it), the spec's required fields and the types and ranges of `priority` and `tier`,
//! BaselineAdminNetworkPolicy's one-name rule, and the status (`conditions`, a map list of
//! `metav1.Condition`s keyed by `type`). What differs: the rest of the spec is open
//! (`x-kubernetes-preserve-unknown-fields`) and validated by ciliate, field by field, into the
//! status (`policy::translate::npa`); ClusterNetworkPolicy has no short name, since `cnp` is
//! CiliumNetworkPolicy's for the users ciliate serves. A cluster that already has the upstream
//! CRDs keeps them: the agent reads the same resources either way.

use std::borrow::Cow;

use kube::CustomResource;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The status of a policy of the network-policy-api: conditions only (`metav1.Condition`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TierPolicyStatus {
    #[serde(default)]
    pub conditions: Vec<Value>,
}

/// The `spec`, kept as the user wrote it (ciliate validates it).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1alpha1",
    kind = "AdminNetworkPolicy",
    plural = "adminnetworkpolicies",
    shortname = "anp",
    status = "TierPolicyStatus",
    schema = "manual",
    derive = "PartialEq",
    doc = "An AdminNetworkPolicy (network-policy-api v0.1.7), enforced by ciliate.",
    annotation(
        "api-approved.kubernetes.io",
        "https://github.com/kubernetes-sigs/network-policy-api/pull/300"
    ),
    annotation("policy.networking.k8s.io/bundle-version", "v0.1.7"),
    annotation("policy.networking.k8s.io/channel", "standard"),
    printcolumn(name = "Priority", type_ = "string", json_path = ".spec.priority"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(transparent)]
pub struct AdminNetworkPolicySpec(pub Map<String, Value>);

/// The `spec`, kept as the user wrote it (ciliate validates it).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1alpha1",
    kind = "BaselineAdminNetworkPolicy",
    plural = "baselineadminnetworkpolicies",
    shortname = "banp",
    status = "TierPolicyStatus",
    schema = "manual",
    derive = "PartialEq",
    doc = "The BaselineAdminNetworkPolicy (network-policy-api v0.1.7), enforced by ciliate.",
    annotation(
        "api-approved.kubernetes.io",
        "https://github.com/kubernetes-sigs/network-policy-api/pull/300"
    ),
    annotation("policy.networking.k8s.io/bundle-version", "v0.1.7"),
    annotation("policy.networking.k8s.io/channel", "standard"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(transparent)]
pub struct BaselineAdminNetworkPolicySpec(pub Map<String, Value>);

/// The `spec`, kept as the user wrote it (ciliate validates it).
// Two string columns read as a duplicated attribute to clippy.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1alpha2",
    kind = "ClusterNetworkPolicy",
    plural = "clusternetworkpolicies",
    status = "TierPolicyStatus",
    schema = "manual",
    derive = "PartialEq",
    doc = "A ClusterNetworkPolicy (network-policy-api v0.2.0), enforced by ciliate.",
    annotation(
        "api-approved.kubernetes.io",
        "https://github.com/kubernetes-sigs/network-policy-api/pull/347"
    ),
    annotation("policy.networking.k8s.io/bundle-version", "v0.2.0"),
    annotation("policy.networking.k8s.io/channel", "standard"),
    printcolumn(name = "Tier", type_ = "string", json_path = ".spec.tier"),
    printcolumn(name = "Priority", type_ = "string", json_path = ".spec.priority"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(transparent)]
pub struct ClusterNetworkPolicySpec(pub Map<String, Value>);

/// `metav1.Condition`, as the upstream status lists it.
fn condition() -> Value {
    serde_json::json!({
        "description": "Condition contains details for one aspect of the current state of this API Resource.",
        "type": "object",
        "properties": {
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "message": {"type": "string", "maxLength": 32768},
            "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
            "reason": {
                "type": "string", "maxLength": 1024, "minLength": 1,
                "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
            },
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "type": {
                "type": "string", "maxLength": 316,
                "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
            },
        },
        "required": ["lastTransitionTime", "message", "reason", "status", "type"],
    })
}

/// The schema of one kind: `spec` open but for the upstream's required fields and the types
/// of `priority` and `tier`; `status` as upstream's.
fn tier_policy_schema(description: &str, required: &[&str], root_rule: Option<Value>) -> Schema {
    let mut spec = serde_json::json!({
        "description": "Validated by ciliate field by field; errors go to status.conditions.",
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
        "properties": {
            "subject": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
        },
        "required": required,
    });
    if required.contains(&"priority") {
        spec["properties"]["priority"] = serde_json::json!({"type": "integer", "format": "int32", "minimum": 0, "maximum": 1000});
    }
    if required.contains(&"tier") {
        spec["properties"]["tier"] =
            serde_json::json!({"type": "string", "enum": ["Admin", "Baseline"]});
    }
    let mut root = serde_json::json!({
        "description": description,
        "type": "object",
        "properties": {
            "spec": spec,
            "status": {
                "type": "object",
                "properties": {
                    "conditions": {
                        "type": "array",
                        "items": condition(),
                        "x-kubernetes-list-map-keys": ["type"],
                        "x-kubernetes-list-type": "map",
                    },
                },
                "required": ["conditions"],
            },
        },
        "required": ["metadata", "spec"],
    });
    if let Some(rule) = root_rule {
        root["x-kubernetes-validations"] = serde_json::json!([rule]);
    }
    Schema::try_from(root).expect("an object schema")
}

impl JsonSchema for AdminNetworkPolicy {
    fn schema_name() -> Cow<'static, str> {
        "AdminNetworkPolicy".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        tier_policy_schema(
            "AdminNetworkPolicy: cluster-wide rules evaluated before any NetworkPolicy, enforced by ciliate.",
            &["priority", "subject"],
            None,
        )
    }
}

impl JsonSchema for BaselineAdminNetworkPolicy {
    fn schema_name() -> Cow<'static, str> {
        "BaselineAdminNetworkPolicy".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        tier_policy_schema(
            "BaselineAdminNetworkPolicy: cluster-wide defaults evaluated after every NetworkPolicy, enforced by ciliate.",
            &["subject"],
            Some(serde_json::json!({
                "message": "Only one baseline admin network policy with metadata.name=\"default\" can be created in the cluster",
                "rule": "self.metadata.name == 'default'",
            })),
        )
    }
}

impl JsonSchema for ClusterNetworkPolicy {
    fn schema_name() -> Cow<'static, str> {
        "ClusterNetworkPolicy".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        tier_policy_schema(
            "ClusterNetworkPolicy: a cluster-wide network policy of the Admin or Baseline tier, enforced by ciliate.",
            &["priority", "subject", "tier"],
            None,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;
    use serde_json::json;

    fn schema_of(
        crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    ) -> Value {
        let version = &crd.spec.versions[0];
        serde_json::to_value(&version.schema.as_ref().expect("schema").open_api_v3_schema)
            .expect("schema as JSON")
    }

    /// The facts of the upstream CRDs (v0.1.7 and v0.2.0, `config/crd/standard/`) the agent and
    /// kubectl users depend on.
    #[test]
    fn names_versions_columns_and_status_match_the_upstream_crds() {
        let upstream = [
            (
                AdminNetworkPolicy::crd(),
                "adminnetworkpolicies.policy.networking.k8s.io",
                "v1alpha1",
                vec!["anp"],
                vec!["Priority", "Age"],
                vec!["priority", "subject"],
            ),
            (
                BaselineAdminNetworkPolicy::crd(),
                "baselineadminnetworkpolicies.policy.networking.k8s.io",
                "v1alpha1",
                vec!["banp"],
                vec!["Age"],
                vec!["subject"],
            ),
            (
                ClusterNetworkPolicy::crd(),
                "clusternetworkpolicies.policy.networking.k8s.io",
                "v1alpha2",
                vec![],
                vec!["Tier", "Priority", "Age"],
                vec!["priority", "subject", "tier"],
            ),
        ];
        for (crd, name, version, short, columns, required) in upstream {
            assert_eq!(crd.metadata.name.as_deref(), Some(name));
            let ann = crd.metadata.annotations.clone().unwrap_or_default();
            assert!(
                ann.get("api-approved.kubernetes.io").is_some_and(|u| u
                    .starts_with("https://github.com/kubernetes-sigs/network-policy-api/pull/")),
                "{name}: a *.k8s.io CRD needs api-approved.kubernetes.io"
            );
            assert_eq!(crd.spec.scope, "Cluster");
            let short_names = crd.spec.names.short_names.clone().unwrap_or_default();
            assert_eq!(short_names, short, "{name}");
            let v = &crd.spec.versions[0];
            assert_eq!(
                (v.name.as_str(), v.served, v.storage),
                (version, true, true)
            );
            assert!(v
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some());
            let cols: Vec<&str> = v
                .additional_printer_columns
                .as_deref()
                .unwrap_or_default()
                .iter()
                .map(|c| c.name.as_str())
                .collect();
            assert_eq!(cols, columns, "{name}");
            let schema = schema_of(&crd);
            assert_eq!(schema["required"], json!(["metadata", "spec"]));
            assert_eq!(schema["properties"]["spec"]["required"], json!(required));
            let status = &schema["properties"]["status"];
            assert_eq!(status["required"], json!(["conditions"]));
            let conditions = &status["properties"]["conditions"];
            assert_eq!(conditions["x-kubernetes-list-type"], "map");
            assert_eq!(conditions["x-kubernetes-list-map-keys"], json!(["type"]));
            assert_eq!(
                conditions["items"]["required"],
                json!(["lastTransitionTime", "message", "reason", "status", "type"])
            );
        }
        let cnp = schema_of(&ClusterNetworkPolicy::crd());
        assert_eq!(
            cnp["properties"]["spec"]["properties"]["tier"]["enum"],
            json!(["Admin", "Baseline"])
        );
        let anp = schema_of(&AdminNetworkPolicy::crd());
        let priority = &anp["properties"]["spec"]["properties"]["priority"];
        assert_eq!(
            (priority["minimum"].as_f64(), priority["maximum"].as_f64()),
            (Some(0.0), Some(1000.0))
        );
        let banp = schema_of(&BaselineAdminNetworkPolicy::crd());
        assert_eq!(
            banp["x-kubernetes-validations"][0]["rule"],
            "self.metadata.name == 'default'"
        );
    }
}
