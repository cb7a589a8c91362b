//! The resource types the server serves (built-ins and those registered by CRDs) and the
//! discovery documents that describe them.

use serde_json::{json, Value};

use super::ApiError;

/// The group of CustomResourceDefinitions; creating one registers new resource types.
pub const CRD_GROUP: &str = "apiextensions.k8s.io";
/// The plural of CustomResourceDefinitions.
pub const CRD_PLURAL: &str = "customresourcedefinitions";

/// Verbs every served resource supports (what discovery advertises; kubectl checks them).
const VERBS: [&str; 7] = [
    "create", "delete", "get", "list", "patch", "update", "watch",
];

/// One served resource in one group version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceType {
    /// API group; "" for the core group.
    pub group: String,
    /// Version within the group.
    pub version: String,
    /// Plural resource name as used in URLs (`pods`).
    pub plural: String,
    /// Singular name (`pod`).
    pub singular: String,
    /// Kind of the objects (`Pod`).
    pub kind: String,
    /// Namespaced, or cluster-scoped.
    pub namespaced: bool,
    /// Short names kubectl accepts (`po`).
    pub short_names: Vec<String>,
    /// Whether the type has a status subresource: then the main endpoint ignores `.status` and
    /// `/status` changes nothing else.
    pub status: bool,
}

/// Where objects of a type are stored: group and plural, shared by all versions of the type.
pub type StorageKey = (String, String);

impl ResourceType {
    /// `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// The key under which the objects of every version of this type are stored.
    pub fn storage_key(&self) -> StorageKey {
        (self.group.clone(), self.plural.clone())
    }

    /// `pods` or `ciliumnetworkpolicies.cilium.io`, as the API server names a resource in
    /// error messages.
    pub fn qualified_name(&self) -> String {
        if self.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// The APIResource entries for discovery: the resource and its status subresource.
    fn discovery_entries(&self) -> Vec<Value> {
        let mut main = json!({
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": VERBS,
        });
        if !self.short_names.is_empty() {
            main["shortNames"] = json!(self.short_names);
        }
        let mut entries = vec![main];
        if self.status {
            entries.push(json!({
                "name": format!("{}/status", self.plural),
                "singularName": "",
                "namespaced": self.namespaced,
                "kind": self.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
        entries
    }
}

fn builtin(
    group: &str,
    plural: &str,
    kind: &str,
    namespaced: bool,
    short: &[&str],
    status: bool,
) -> ResourceType {
    ResourceType {
        group: group.into(),
        version: "v1".into(),
        plural: plural.into(),
        singular: kind.to_lowercase(),
        kind: kind.into(),
        namespaced,
        short_names: short.iter().map(|s| s.to_string()).collect(),
        status,
    }
}

/// The built-in types: what the agent watches, plus what kubectl manifests commonly carry.
pub fn builtin_types() -> Vec<ResourceType> {
    vec![
        builtin("", "namespaces", "Namespace", false, &["ns"], true),
        builtin("", "nodes", "Node", false, &["no"], true),
        builtin("", "pods", "Pod", true, &["po"], true),
        builtin("", "services", "Service", true, &["svc"], true),
        builtin("", "configmaps", "ConfigMap", true, &["cm"], false),
        builtin(
            "",
            "serviceaccounts",
            "ServiceAccount",
            true,
            &["sa"],
            false,
        ),
        builtin(
            "networking.k8s.io",
            "networkpolicies",
            "NetworkPolicy",
            true,
            &["netpol"],
            false,
        ),
        builtin(
            "discovery.k8s.io",
            "endpointslices",
            "EndpointSlice",
            true,
            &[],
            false,
        ),
        builtin(
            CRD_GROUP,
            CRD_PLURAL,
            "CustomResourceDefinition",
            false,
            &["crd", "crds"],
            true,
        ),
    ]
}

fn invalid_crd(name: &str, why: &str) -> ApiError {
    ApiError::Invalid(format!(
        "CustomResourceDefinition.apiextensions.k8s.io {name:?} is invalid: {why}"
    ))
}

/// The types a CustomResourceDefinition serves: one per served version.
pub fn types_from_crd(crd: &Value) -> Result<Vec<ResourceType>, ApiError> {
    let name = crd
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    let text = |p: &str| crd.pointer(p).and_then(Value::as_str).unwrap_or("");
    let group = text("/spec/group");
    let plural = text("/spec/names/plural");
    let kind = text("/spec/names/kind");
    if group.is_empty() || plural.is_empty() || kind.is_empty() {
        return Err(invalid_crd(
            name,
            "spec.group, spec.names.plural and spec.names.kind are required",
        ));
    }
    if name != format!("{plural}.{group}") {
        return Err(invalid_crd(
            name,
            &format!(
                "metadata.name: must be spec.names.plural+\".\"+spec.group ({plural}.{group})"
            ),
        ));
    }
    let namespaced = match text("/spec/scope") {
        "Namespaced" => true,
        "Cluster" => false,
        other => {
            return Err(invalid_crd(
                name,
                &format!("spec.scope: must be Namespaced or Cluster, not {other:?}"),
            ))
        }
    };
    let singular = match text("/spec/names/singular") {
        "" => kind.to_lowercase(),
        s => s.to_string(),
    };
    let short_names: Vec<String> = crd
        .pointer("/spec/names/shortNames")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    let versions = crd
        .pointer("/spec/versions")
        .and_then(Value::as_array)
        .filter(|v| !v.is_empty())
        .ok_or_else(|| invalid_crd(name, "spec.versions: at least one version is required"))?;
    let mut types = Vec::new();
    for (i, v) in versions.iter().enumerate() {
        let version = v.get("name").and_then(Value::as_str).unwrap_or("");
        if version.is_empty() {
            return Err(invalid_crd(
                name,
                &format!("spec.versions[{i}].name: required"),
            ));
        }
        if v.get("served").and_then(Value::as_bool) != Some(true) {
            continue;
        }
        types.push(ResourceType {
            group: group.into(),
            version: version.into(),
            plural: plural.into(),
            singular: singular.clone(),
            kind: kind.into(),
            namespaced,
            short_names: short_names.clone(),
            status: v.pointer("/subresources/status").is_some(),
        });
    }
    Ok(types)
}

/// `/api`: the core group's versions.
pub fn core_versions(server_address: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    })
}

/// The named groups and their versions, in registration order.
fn groups(types: &[ResourceType]) -> Vec<(String, Vec<String>)> {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for t in types.iter().filter(|t| !t.group.is_empty()) {
        match groups.iter_mut().find(|(g, _)| *g == t.group) {
            Some((_, versions)) => {
                if !versions.contains(&t.version) {
                    versions.push(t.version.clone());
                }
            }
            None => groups.push((t.group.clone(), vec![t.version.clone()])),
        }
    }
    groups
}

fn api_group(group: &str, versions: &[String]) -> Value {
    let entries: Vec<Value> = versions
        .iter()
        .map(|v| json!({"groupVersion": format!("{group}/{v}"), "version": v}))
        .collect();
    json!({
        "name": group,
        "versions": entries,
        // The first served version is preferred, as a CRD's first listed version usually is.
        "preferredVersion": entries.first().cloned().unwrap_or(Value::Null),
    })
}

/// `/apis`: every named group (built-in and from CRDs).
pub fn group_list(types: &[ResourceType]) -> Value {
    let groups: Vec<Value> = groups(types)
        .iter()
        .map(|(g, vs)| api_group(g, vs))
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `/apis/{group}`, or None when no type serves the group.
pub fn group(types: &[ResourceType], group: &str) -> Option<Value> {
    groups(types)
        .iter()
        .find(|(g, _)| g == group)
        .map(|(g, vs)| {
            let mut v = api_group(g, vs);
            v["kind"] = json!("APIGroup");
            v["apiVersion"] = json!("v1");
            v
        })
}

/// `/api/v1` or `/apis/{group}/{version}`, or None when nothing is served there.
pub fn resource_list(types: &[ResourceType], group: &str, version: &str) -> Option<Value> {
    let served: Vec<&ResourceType> = types
        .iter()
        .filter(|t| t.group == group && t.version == version)
        .collect();
    let first = served.first()?;
    let resources: Vec<Value> = served.iter().flat_map(|t| t.discovery_entries()).collect();
    Some(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": first.api_version(),
        "resources": resources,
    }))
}

/// The path of a group version in OpenAPI v3 discovery: `api/v1` or `apis/{group}/{version}`.
fn openapi_gv_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

/// `/openapi/v3`: one entry per served group version. kubectl reads it to learn that the
/// server validates fields itself (then it needs no schemas for `apply`).
pub fn openapi_root(types: &[ResourceType]) -> Value {
    let mut paths = serde_json::Map::new();
    for t in types {
        let path = openapi_gv_path(&t.group, &t.version);
        let url = format!("/openapi/v3/{path}");
        paths.insert(path, json!({"serverRelativeURL": url}));
    }
    json!({"paths": paths})
}

/// `/openapi/v3/{api/v1 | apis/group/version}`: no schemas, just a PATCH operation per kind that
/// declares the `fieldValidation` parameter, which is what kubectl checks before it leaves
/// validation to the server instead of downloading schemas (that we do not have).
pub fn openapi_group_version(types: &[ResourceType], gv_path: &str) -> Option<Value> {
    let mut paths = serde_json::Map::new();
    for t in types
        .iter()
        .filter(|t| openapi_gv_path(&t.group, &t.version) == gv_path)
    {
        let scope = if t.namespaced {
            "namespaces/{namespace}/"
        } else {
            ""
        };
        paths.insert(
            format!("/{gv_path}/{scope}{}/{{name}}", t.plural),
            json!({"patch": {
                "operationId": format!("patch{}", t.kind),
                "x-kubernetes-group-version-kind":
                    {"group": t.group, "version": t.version, "kind": t.kind},
                "parameters": [
                    {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}
                ],
                "responses": {"200": {"description": "OK"}},
            }}),
        );
    }
    if paths.is_empty() {
        return None;
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.32.0"},
        "paths": paths,
        "components": {"schemas": {}},
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cnp_crd() -> Value {
        json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "ciliumnetworkpolicies.cilium.io"},
            "spec": {
                "group": "cilium.io",
                "scope": "Namespaced",
                "names": {"plural": "ciliumnetworkpolicies", "singular": "ciliumnetworkpolicy",
                          "kind": "CiliumNetworkPolicy", "shortNames": ["cnp", "ciliumnp"]},
                "versions": [
                    {"name": "v2", "served": true, "storage": true, "subresources": {"status": {}}},
                    {"name": "v2alpha1", "served": false, "storage": false}
                ]
            }
        })
    }

    #[test]
    fn crd_registers_served_versions() {
        let types = types_from_crd(&cnp_crd()).unwrap();
        assert_eq!(types.len(), 1);
        let t = &types[0];
        assert_eq!(t.api_version(), "cilium.io/v2");
        assert!(t.namespaced && t.status);
        assert_eq!(t.short_names, ["cnp", "ciliumnp"]);
        let list = resource_list(&types, "cilium.io", "v2").unwrap();
        assert_eq!(list["resources"][1]["name"], "ciliumnetworkpolicies/status");
        assert!(group(&types, "cilium.io").is_some());
    }

    #[test]
    fn crd_name_must_match_its_names() {
        let mut crd = cnp_crd();
        crd["metadata"]["name"] = json!("wrong.cilium.io");
        let err = types_from_crd(&crd).unwrap_err();
        assert!(
            err.to_string().contains("ciliumnetworkpolicies.cilium.io"),
            "{err}"
        );
    }

    #[test]
    fn discovery_lists_builtins() {
        let types = builtin_types();
        let core = resource_list(&types, "", "v1").unwrap();
        assert_eq!(core["groupVersion"], "v1");
        let names: Vec<&str> = core["resources"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|r| r["name"].as_str())
            .collect();
        assert!(names.contains(&"pods") && names.contains(&"pods/status"));
        let groups = group_list(&types);
        assert_eq!(groups["groups"].as_array().unwrap().len(), 3);
        assert!(resource_list(&types, "nope", "v1").is_none());
    }
}
