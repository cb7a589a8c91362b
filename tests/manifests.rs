//! The cluster manifests in `manifests/`: every document is a valid object of its Kubernetes
//! type (nothing dropped on the way), the CRDs are the ones `src/k8s/crd.rs` generates
//! (`UPDATE_MANIFESTS=1` rewrites them), the DaemonSet and RBAC say what the agent needs and
//! no more, and the CRDs work end to end with kube-rs against the in-repo test API server.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use ciliate::k8s::crd::{
    self, CiliumClusterwideNetworkPolicy, CiliumNetworkPolicy, ConditionStatus, PolicyCondition,
    PolicyNodeStatus, CONDITION_VALID,
};
use ciliate_test_apiserver::TestApiServer;
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{CustomResourceExt, Resource};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

const MANIFESTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/manifests");
/// Not a Kubernetes object (kind's own config); checked on its own.
const KIND_CONFIG: &str = "kind-config.yaml";
const GENERATED_HEADER: &str = "# Generated from src/k8s/crd.rs; do not edit. Regenerate with \
                                `make manifests` (UPDATE_MANIFESTS=1 cargo test --test manifests).\n";

/// One document of `manifests/`, typed by its kind.
#[derive(Debug)]
enum Object {
    Crd(Box<CustomResourceDefinition>),
    ServiceAccount(Box<ServiceAccount>),
    ClusterRole(Box<ClusterRole>),
    ClusterRoleBinding(Box<ClusterRoleBinding>),
    ConfigMap(Box<ConfigMap>),
    DaemonSet(Box<DaemonSet>),
    Deployment(Box<k8s_openapi::api::apps::v1::Deployment>),
    Service(Box<k8s_openapi::api::core::v1::Service>),
    AdmissionPolicy(Box<ValidatingAdmissionPolicy>),
    AdmissionPolicyBinding(Box<ValidatingAdmissionPolicyBinding>),
}

/// Every `.yaml` file under `dir`, recursively, in a stable order.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    common::yaml_files(dir, &mut files);
    assert!(!files.is_empty(), "no manifests under {}", dir.display());
    files.sort();
    files
}

/// The one object of `$variant` among `$objects` (`(file, Object)` pairs).
macro_rules! only {
    ($objects:expr, $variant:ident) => {
        $objects
            .iter()
            .find_map(|(_, o)| match o {
                Object::$variant(v) => Some(v),
                _ => None,
            })
            .expect(stringify!($variant))
    };
}

/// The non-empty YAML documents of a file, as JSON (the form the API server stores).
fn documents(path: &Path) -> Vec<Value> {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .enumerate()
        .map(|(i, doc)| {
            serde_path_to_error::deserialize::<_, Value>(doc).unwrap_or_else(|e| {
                panic!(
                    "{} document {}: {}: {}",
                    path.display(),
                    i + 1,
                    e.path(),
                    e.inner()
                )
            })
        })
        .filter(|doc| !doc.is_null())
        .collect()
}

/// Paths of `original` that `round_trip` lost or changed: k8s-openapi ignores fields it does
/// not know, so a misspelt field would otherwise pass silently.
fn lost_fields(original: &Value, round_trip: &Value, path: &str, out: &mut Vec<String>) {
    match (original, round_trip) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                match b.get(key) {
                    Some(other) => lost_fields(value, other, &format!("{path}.{key}"), out),
                    None => out.push(format!("{path}.{key}")),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                lost_fields(x, y, &format!("{path}[{i}]"), out);
            }
        }
        (a, b) if a != b => out.push(format!("{path} ({a} became {b})")),
        _ => {}
    }
}

/// Deserialises `doc` as `T` with the failing field's path, and checks nothing was dropped.
fn typed<T: DeserializeOwned + Serialize>(doc: &Value, at: &str) -> Result<T, String> {
    let object: T = serde_path_to_error::deserialize(doc)
        .map_err(|e| format!("{at}: {}: {}", e.path(), e.inner()))?;
    let round_trip = serde_json::to_value(&object).map_err(|e| format!("{at}: {e}"))?;
    let mut lost = Vec::new();
    lost_fields(doc, &round_trip, "", &mut lost);
    if lost.is_empty() {
        Ok(object)
    } else {
        Err(format!(
            "{at}: fields unknown to the type: {}",
            lost.join(", ")
        ))
    }
}

/// Every Kubernetes object under `dir` (all but the kind config), typed by its kind, or every
/// problem found, each naming the file, document and field path.
fn load_dir(dir: &Path) -> Result<Vec<(String, Object)>, Vec<String>> {
    let mut objects = Vec::new();
    let mut errors = Vec::new();
    for path in yaml_files(dir) {
        let file = path
            .strip_prefix(dir)
            .expect("under dir")
            .display()
            .to_string();
        if file == KIND_CONFIG {
            continue;
        }
        for (i, doc) in documents(&path).iter().enumerate() {
            let at = format!("{file} document {}", i + 1);
            let kind = doc["kind"].as_str().unwrap_or("");
            let object = match kind {
                "CustomResourceDefinition" => typed(doc, &at).map(Object::Crd),
                "ServiceAccount" => typed(doc, &at).map(Object::ServiceAccount),
                "ClusterRole" => typed(doc, &at).map(Object::ClusterRole),
                "ClusterRoleBinding" => typed(doc, &at).map(Object::ClusterRoleBinding),
                "ConfigMap" => typed(doc, &at).map(Object::ConfigMap),
                "DaemonSet" => typed(doc, &at).map(Object::DaemonSet),
                "Deployment" => typed(doc, &at).map(Object::Deployment),
                "Service" => typed(doc, &at).map(Object::Service),
                "ValidatingAdmissionPolicy" => typed(doc, &at).map(Object::AdmissionPolicy),
                "ValidatingAdmissionPolicyBinding" => {
                    typed(doc, &at).map(Object::AdmissionPolicyBinding)
                }
                other => Err(format!("{at}: unexpected kind {other:?}")),
            };
            match object {
                Ok(object) => objects.push((file.clone(), object)),
                Err(error) => errors.push(error),
            }
        }
    }
    if errors.is_empty() {
        Ok(objects)
    } else {
        Err(errors)
    }
}

/// Every Kubernetes object in `manifests/`; panics with every problem found.
fn load_all() -> Vec<(String, Object)> {
    load_dir(Path::new(MANIFESTS))
        .unwrap_or_else(|errors| panic!("invalid manifests:\n{}", errors.join("\n")))
}

/// The container's environment variable `name`.
fn env<'a>(c: &'a Container, name: &str) -> Option<&'a k8s_openapi::api::core::v1::EnvVar> {
    c.env.iter().flatten().find(|e| e.name == name)
}

/// The DaemonSet's pod template.
fn pod_spec() -> PodSpec {
    let ds = daemonset();
    ds.spec.and_then(|s| s.template.spec).expect("pod spec")
}

/// The DaemonSet's agent container.
fn agent_container() -> Container {
    container(&pod_spec().containers, "agent").clone()
}

fn daemonset() -> DaemonSet {
    let objects = load_all();
    (**only!(objects, DaemonSet)).clone()
}

fn container<'a>(containers: &'a [Container], name: &str) -> &'a Container {
    containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("container {name}"))
}

/// The host path behind a container's mount at `mount_path`, with the mount's propagation.
fn host_mount(ds: &DaemonSet, c: &Container, mount_path: &str) -> (String, Option<String>) {
    let pod = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec");
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == mount_path)
        .unwrap_or_else(|| panic!("{} mounts {mount_path}", c.name));
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap_or_else(|| panic!("volume {}", mount.name));
    let host = volume.host_path.as_ref().expect("a hostPath volume");
    (host.path.clone(), mount.mount_propagation.clone())
}

#[test]
fn every_document_is_a_valid_object_of_its_kind() {
    let objects = load_all();
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, object) in &objects {
        let kind = match object {
            Object::Crd(_) => "CustomResourceDefinition",
            Object::ServiceAccount(_) => "ServiceAccount",
            Object::ClusterRole(_) => "ClusterRole",
            Object::ClusterRoleBinding(_) => "ClusterRoleBinding",
            Object::ConfigMap(_) => "ConfigMap",
            Object::DaemonSet(_) => "DaemonSet",
            Object::Deployment(_) => "Deployment",
            Object::Service(_) => "Service",
            Object::AdmissionPolicy(_) => "ValidatingAdmissionPolicy",
            Object::AdmissionPolicyBinding(_) => "ValidatingAdmissionPolicyBinding",
        };
        *kinds.entry(kind).or_default() += 1;
    }
    assert_eq!(
        kinds,
        BTreeMap::from([
            ("ClusterRole", 1),
            ("ClusterRoleBinding", 1),
            ("ConfigMap", 1),
            ("CustomResourceDefinition", 6),
            ("DaemonSet", 1),
            ("Deployment", 1),
            ("Service", 2),
            ("ServiceAccount", 1),
            ("ValidatingAdmissionPolicy", 1),
            ("ValidatingAdmissionPolicyBinding", 1),
        ])
    );
    let crd_names: BTreeSet<_> = objects
        .iter()
        .filter_map(|(_, o)| match o {
            Object::Crd(crd) => crd.metadata.name.as_deref(),
            _ => None,
        })
        .collect();
    assert_eq!(
        crd_names,
        BTreeSet::from([
            CiliumNetworkPolicy::crd_name(),
            CiliumClusterwideNetworkPolicy::crd_name(),
            ciliate::k8s::slices::CiliateEndpointSlice::crd_name(),
            ciliate::k8s::npa_crd::AdminNetworkPolicy::crd_name(),
            ciliate::k8s::npa_crd::BaselineAdminNetworkPolicy::crd_name(),
            ciliate::k8s::npa_crd::ClusterNetworkPolicy::crd_name(),
        ])
    );
}

#[test]
fn a_misspelt_or_mistyped_field_is_reported_with_its_path() {
    let doc = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"},
                     "data": {"a": "b"}, "dta": {}});
    let err = typed::<ConfigMap>(&doc, "here").expect_err("dta is no field");
    assert!(err.contains(".dta"), "{err}");
    let doc = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": 3}});
    let err = typed::<ConfigMap>(&doc, "here").expect_err("a number is no name");
    assert!(err.starts_with("here: metadata.name:"), "{err}");
}

#[test]
fn an_unknown_kind_fails_the_load() {
    let dir = tempfile::tempdir().expect("tempdir");
    let docs = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: ok}\n---\n\
                apiVersion: v1\nkind: Secret\nmetadata: {name: s}\n";
    fs::write(dir.path().join("x.yaml"), docs).expect("write");
    let errors = load_dir(dir.path()).expect_err("Secret is not expected");
    assert_eq!(errors, ["x.yaml document 2: unexpected kind \"Secret\""]);
}

#[test]
fn kind_config_has_no_default_cni_and_three_nodes() {
    let docs = documents(&Path::new(MANIFESTS).join(KIND_CONFIG));
    assert_eq!(docs.len(), 1);
    let config = &docs[0];
    assert_eq!(config["kind"], "Cluster");
    assert_eq!(config["apiVersion"], "kind.x-k8s.io/v1alpha4");
    assert_eq!(config["networking"]["disableDefaultCNI"], true);
    let subnet: ipnet::Ipv4Net = config["networking"]["podSubnet"]
        .as_str()
        .expect("podSubnet")
        .parse()
        .expect("podSubnet is a CIDR");
    assert!(subnet.prefix_len() <= 16, "room for a /24 per node");
    let roles: Vec<&str> = config["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| n["role"].as_str().expect("role"))
        .collect();
    assert_eq!(roles, ["control-plane", "worker", "worker"]);
}

#[test]
fn crds_are_generated_from_the_rust_types() {
    let update = std::env::var_os("UPDATE_MANIFESTS").is_some_and(|v| v == "1");
    for (file, crd) in crd::crds() {
        let path = Path::new(MANIFESTS).join("crds").join(file);
        let yaml = serde_yaml::to_string(&crd).expect("CRD as YAML");
        let wanted = format!("{GENERATED_HEADER}{yaml}");
        if update {
            fs::create_dir_all(path.parent().expect("parent")).expect("mkdir manifests/crds");
            fs::write(&path, &wanted).expect("write CRD");
            continue;
        }
        let committed = fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == wanted,
            "{} is stale: run `UPDATE_MANIFESTS=1 cargo test --test manifests` (make manifests)",
            path.display()
        );
    }
}

#[test]
fn daemonset_runs_the_agent_privileged_on_the_host_network() {
    let ds = daemonset();
    assert_eq!(ds.metadata.namespace.as_deref(), Some("kube-system"));
    let pod = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec");
    assert_eq!(pod.host_network, Some(true));
    assert_ne!(pod.host_pid, Some(true));
    assert_eq!(pod.service_account_name.as_deref(), Some("ciliate"));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerates_all =
        pod.tolerations.iter().flatten().any(|t| {
            t.operator.as_deref() == Some("Exists") && t.key.is_none() && t.effect.is_none()
        });
    assert!(tolerates_all, "tolerates every taint");

    let agent = container(&pod.containers, "agent");
    let security = agent.security_context.as_ref().expect("securityContext");
    assert_eq!(security.privileged, Some(true));
    let argv: Vec<&str> = agent
        .command
        .iter()
        .chain(agent.args.iter())
        .flatten()
        .map(String::as_str)
        .collect();
    let line = argv.join(" ");
    assert!(line.starts_with("ciliate agent "), "{line}");
    for flags in [
        "--mode kubernetes",
        "--node-name $(NODE_NAME)",
        "--datapath bpf",
        "--api-socket /var/run/ciliate/ciliate.sock",
        "--routing-mode $(ROUTING_MODE)",
        "--auto-direct-node-routes $(AUTO_DIRECT_NODE_ROUTES)",
        "--ipv4-native-routing-cidr $(IPV4_NATIVE_ROUTING_CIDR)",
    ] {
        assert!(line.contains(flags), "{line} has {flags}");
    }
    let node_name = env(agent, "NODE_NAME")
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .expect("NODE_NAME from the downward API");
    assert_eq!(node_name.field_path, "spec.nodeName");

    let readiness = agent
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("readiness httpGet");
    assert_eq!(readiness.path.as_deref(), Some("/readyz"));
    assert_eq!(readiness.host.as_deref(), Some("127.0.0.1"));
    let liveness = agent
        .liveness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("liveness httpGet");
    assert_eq!(liveness.path.as_deref(), Some("/healthz"));

    assert_eq!(
        host_mount(&ds, agent, "/sys/fs/bpf"),
        ("/sys/fs/bpf".into(), Some("Bidirectional".into()))
    );
    assert_eq!(
        host_mount(&ds, agent, "/var/run/netns"),
        ("/var/run/netns".into(), Some("HostToContainer".into()))
    );
    assert_eq!(
        host_mount(&ds, agent, "/var/run/ciliate").0,
        "/var/run/ciliate"
    );
    // Socket-level Service translation attaches to the host's cgroup v2 root.
    assert!(
        line.contains("--cgroup-root /run/ciliate/cgroupv2"),
        "{line}"
    );
    assert_eq!(
        host_mount(&ds, agent, "/run/ciliate/cgroupv2").0,
        "/sys/fs/cgroup"
    );
}

/// The ConfigMap's values, as the kubelet substitutes them for `$(VAR)` in the agent's args.
fn agent_command_line() -> Vec<String> {
    let objects = load_all();
    let config = only!(objects, ConfigMap);
    let data = config.data.clone().unwrap_or_default();
    let agent = agent_container();
    let mut env = BTreeMap::new();
    for e in agent.env.iter().flatten() {
        let from = e.value_from.as_ref();
        let value = match (
            from.and_then(|v| v.config_map_key_ref.as_ref()),
            from.and_then(|v| v.field_ref.as_ref()),
        ) {
            (Some(key), _) => data[&key.key].clone(),
            (None, Some(f)) if f.field_path == "spec.nodeName" => "kind-worker".to_string(),
            _ => e.value.clone().expect("a value"),
        };
        env.insert(e.name.clone(), value);
    }
    agent
        .command
        .iter()
        .chain(agent.args.iter())
        .flatten()
        .map(|a| {
            let mut a = a.clone();
            for (k, v) in &env {
                a = a.replace(&format!("$({k})"), v);
            }
            assert!(
                !a.contains("$("),
                "{a}: a variable the container does not define"
            );
            a
        })
        .collect()
}

#[test]
fn the_agent_accepts_the_daemonsets_command_line_with_the_configmaps_values() {
    use clap::Parser;
    let line = agent_command_line();
    let cli = ciliate::cli::Cli::try_parse_from(&line)
        .unwrap_or_else(|e| panic!("the agent refuses {line:?}: {e}"));
    let ciliate::cli::Command::Agent(args) = cli.command else {
        panic!("not the agent: {line:?}");
    };
    assert_eq!(args.node_name.as_deref(), Some("kind-worker"));
    assert!(args.enable_ipv4_masquerade && args.auto_direct_node_routes);
    assert!(args.cgroup_root.is_some());
    // The cluster's pod space is kind's podSubnet.
    let cidr = args
        .ipv4_native_routing_cidr
        .expect("--ipv4-native-routing-cidr");
    let kind = fs::read_to_string(Path::new(MANIFESTS).join(KIND_CONFIG)).unwrap();
    assert!(
        kind.lines()
            .any(|l| l.trim().trim_matches('"') == format!("podSubnet: {cidr}")),
        "kind-config.yaml's podSubnet is not {cidr}:\n{kind}"
    );
}

#[test]
fn init_container_installs_the_plugin_and_the_readme_conflist() {
    let ds = daemonset();
    let pod = pod_spec();
    let init = container(
        pod.init_containers.as_deref().unwrap_or_default(),
        "install-cni",
    );
    assert_eq!(host_mount(&ds, init, "/host/opt/cni/bin").0, "/opt/cni/bin");
    assert_eq!(
        host_mount(&ds, init, "/host/etc/cni/net.d").0,
        "/etc/cni/net.d"
    );
    let script = init.command.as_deref().unwrap_or_default().join(" ");
    assert!(script.contains("/host/opt/cni/bin/ciliate-cni"), "{script}");
    assert!(
        script.contains("/host/etc/cni/net.d/05-ciliate.conflist"),
        "{script}"
    );

    let conflist = env(init, "CNI_CONFLIST")
        .and_then(|e| e.value.as_deref())
        .expect("CNI_CONFLIST");
    let conflist: Value = serde_json::from_str(conflist).expect("conflist is JSON");
    assert_eq!(conflist["plugins"][0]["type"], "ciliate-cni");
    assert_eq!(conflist["cniVersion"], "1.0.0");

    // The README's CNI section is the documented configuration; the cluster installs that one.
    let readme =
        fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README.md");
    let section = &readme[readme
        .find("05-ciliate.conflist")
        .expect("README's CNI section")..];
    let block = section
        .split("```json\n")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .expect("README's conflist block");
    let documented: Value = serde_json::from_str(block).expect("README's conflist is JSON");
    assert_eq!(conflist, documented);
}

#[test]
fn agent_settings_come_from_the_configmap_and_match_the_probes() {
    let objects = load_all();
    let config = only!(objects, ConfigMap);
    let data = config.data.as_ref().expect("data");
    let agent = agent_container();
    for env in agent.env.iter().flatten() {
        if let Some(key) = env
            .value_from
            .as_ref()
            .and_then(|v| v.config_map_key_ref.as_ref())
        {
            assert_eq!(key.name, config.metadata.name.clone().expect("name"));
            assert!(data.contains_key(&key.key), "ConfigMap has {}", key.key);
        }
    }
    let probe = agent
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("readiness httpGet");
    let port = match &probe.port {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p) => p.to_string(),
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(p) => p.clone(),
    };
    let probed = format!("{}:{port}", probe.host.as_deref().unwrap_or_default());
    assert_eq!(
        data["debug-addr"], probed,
        "the probes reach the debug server"
    );
    assert!(matches!(data["log-format"].as_str(), "text" | "json"));
    assert!(data["conntrack-gc-interval"]
        .parse::<u64>()
        .is_ok_and(|s| s >= 1));
}

#[test]
fn cluster_role_grants_exactly_what_the_agent_needs() {
    let objects = load_all();
    let role = only!(objects, ClusterRole);
    let mut granted = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        assert!(
            rule.resource_names.is_none() && rule.non_resource_urls.is_none(),
            "{rule:?}"
        );
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    granted.insert(format!("{group}/{resource}:{verb}"));
                }
            }
        }
    }
    let mut wanted = BTreeSet::new();
    for resource in [
        "/pods",
        "/namespaces",
        "/nodes",
        "/services",
        "discovery.k8s.io/endpointslices",
        "networking.k8s.io/networkpolicies",
        "cilium.io/ciliumnetworkpolicies",
        "cilium.io/ciliumclusterwidenetworkpolicies",
        "policy.networking.k8s.io/adminnetworkpolicies",
        "policy.networking.k8s.io/baselineadminnetworkpolicies",
        "policy.networking.k8s.io/clusternetworkpolicies",
    ] {
        for verb in ["get", "list", "watch"] {
            wanted.insert(format!("{resource}:{verb}"));
        }
    }
    wanted.insert("/nodes:patch".to_string());
    for verb in ["get", "list", "watch", "create", "update", "delete"] {
        wanted.insert(format!("ciliate.io/ciliateendpointslices:{verb}"));
    }
    for resource in [
        "cilium.io/ciliumnetworkpolicies/status",
        "cilium.io/ciliumclusterwidenetworkpolicies/status",
        "policy.networking.k8s.io/adminnetworkpolicies/status",
        "policy.networking.k8s.io/baselineadminnetworkpolicies/status",
        "policy.networking.k8s.io/clusternetworkpolicies/status",
    ] {
        for verb in ["get", "update", "patch"] {
            wanted.insert(format!("{resource}:{verb}"));
        }
    }
    assert_eq!(granted, wanted);

    let binding = only!(objects, ClusterRoleBinding);
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let subjects = binding.subjects.as_deref().unwrap_or_default();
    assert_eq!(subjects.len(), 1);
    assert_eq!(
        (
            subjects[0].kind.as_str(),
            subjects[0].name.as_str(),
            subjects[0].namespace.as_deref()
        ),
        ("ServiceAccount", "ciliate", Some("kube-system"))
    );
    let account = only!(objects, ServiceAccount);
    assert_eq!(account.metadata.name.as_deref(), Some("ciliate"));
    assert_eq!(account.metadata.namespace.as_deref(), Some("kube-system"));
}

use common::kube_client as client;

/// A typical Cilium manifest, as users have it.
const CNP: &str = r#"
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata:
  name: l4-rule
  namespace: shop
spec:
  description: "L4 policy to restrict access to the backend"
  endpointSelector:
    matchLabels:
      app: backend
  ingress:
  - fromEndpoints:
    - matchLabels:
        app: frontend
    toPorts:
    - ports:
      - port: "8080"
        protocol: TCP
"#;

fn node_status(revision: i64) -> PolicyNodeStatus {
    PolicyNodeStatus {
        ok: true,
        error: None,
        enforcing: true,
        local_policy_revision: revision,
        last_updated: "2025-06-01T12:00:00Z".into(),
        annotations: BTreeMap::new(),
    }
}

#[tokio::test]
async fn crds_serve_typed_policies_and_status_through_kube() {
    let server = TestApiServer::start().expect("server");
    let dir = tempfile::tempdir().expect("tempdir");
    let client = client(&server, dir.path()).await;

    // The committed CRD files, as `kubectl apply -f manifests/crds` would send them.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for path in yaml_files(&Path::new(MANIFESTS).join("crds")) {
        for doc in documents(&path) {
            let crd: CustomResourceDefinition = serde_json::from_value(doc).expect("CRD");
            crds.create(&PostParams::default(), &crd)
                .await
                .unwrap_or_else(|e| panic!("register {}: {e}", path.display()));
        }
    }
    assert!(crds.get(CiliumNetworkPolicy::crd_name()).await.is_ok());
    assert!(crds
        .get(CiliumClusterwideNetworkPolicy::crd_name())
        .await
        .is_ok());

    // The endpoint slices agents write for each other: typed, cluster-scoped, by node label.
    {
        use ciliate::k8s::slices::{slice_pods, CiliateEndpointSlice, CiliateEndpointSliceSpec};
        let slices: Api<CiliateEndpointSlice> = Api::all(client.clone());
        let spec: CiliateEndpointSliceSpec = serde_json::from_value(json!({"node": "node-2",
            "profiles": [{"namespace": "shop", "labels": {"app": "web"}, "serviceAccount": "web",
                          "namedPorts": [{"name": "http", "port": 8080, "protocol": "TCP"}]}],
            "endpoints": [{"name": "web-0", "ips": ["10.0.2.7"], "profile": 0}]}))
        .expect("slice spec");
        let mut slice = CiliateEndpointSlice::new("node-2.0", spec.clone());
        slice.metadata.labels =
            Some([("ciliate.io/node".to_string(), "node-2".to_string())].into());
        slices
            .create(&PostParams::default(), &slice)
            .await
            .expect("create a slice");
        let listed = slices
            .list(&kube::api::ListParams::default().labels("ciliate.io/node=node-2"))
            .await
            .expect("list slices by node");
        assert_eq!(listed.items.len(), 1);
        assert_eq!(listed.items[0].spec, spec);
        let pods = slice_pods(&listed.items[0].spec, |l| l).expect("the slice's pods");
        assert_eq!(pods[0].key(), "shop/web-0");
        assert_eq!(pods[0].service_account, "web");
        assert!(slices
            .list(&kube::api::ListParams::default().labels("ciliate.io/node=node-3"))
            .await
            .expect("list")
            .items
            .is_empty());
    }

    server
        .apply_json(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}}))
        .expect("namespace");

    // A Cilium manifest, unchanged, through the typed API.
    let cnps: Api<CiliumNetworkPolicy> = Api::namespaced(client.clone(), "shop");
    let policy: CiliumNetworkPolicy = serde_yaml::from_str(CNP).expect("typed CNP");
    let created = cnps
        .create(&PostParams::default(), &policy)
        .await
        .expect("create CNP");
    assert_eq!(created.spec, policy.spec);
    assert_eq!(created.status, None);

    // Two agents write their own node's entry; the Valid condition is the policy's.
    let params = PatchParams::default();
    for (node, revision) in [("node-1", 3), ("node-2", 5)] {
        cnps.patch_status(
            "l4-rule",
            &params,
            &Patch::Merge(node_status(revision).merge_patch(node)),
        )
        .await
        .unwrap_or_else(|e| panic!("status of {node}: {e}"));
    }
    let condition = PolicyCondition {
        type_: CONDITION_VALID.into(),
        status: ConditionStatus::True,
        reason: "Accepted".into(),
        message: "policy accepted".into(),
        last_transition_time: "2025-06-01T12:00:00Z".into(),
    };
    cnps.patch_status(
        "l4-rule",
        &params,
        &Patch::Merge(json!({"status": {"conditions": [condition]}})),
    )
    .await
    .expect("condition");

    let read = cnps.get("l4-rule").await.expect("get CNP");
    let status = read.status.expect("status");
    assert_eq!(status.nodes.len(), 2);
    assert_eq!(status.nodes["node-1"], node_status(3));
    assert_eq!(status.nodes["node-2"], node_status(5));
    assert_eq!(status.conditions, vec![condition]);
    assert_eq!(read.spec, policy.spec, "status writes leave the spec");

    // The stored object is still what the agent's policy parser accepts.
    let raw = serde_yaml::to_value(&read.spec).expect("yaml");
    let stored = serde_yaml::to_value(json!({
        "apiVersion": "cilium.io/v2", "kind": "CiliumNetworkPolicy",
        "metadata": {"name": "l4-rule", "namespace": "shop"}, "spec": raw
    }))
    .expect("yaml");
    ciliate::policy::translate::parse_policy(&stored, "shop", "the API server")
        .expect("the stored policy parses");

    // A policy with only `specs` reads back typed, and a status patch leaves its rules.
    let ar = ApiResource::erase::<CiliumNetworkPolicy>(&());
    let raw_cnps: Api<DynamicObject> = Api::namespaced_with(client.clone(), "shop", &ar);
    let specs = json!([{"endpointSelector": {}, "egress": [{"toEntities": ["world"]}]}]);
    raw_cnps
        .create(
            &PostParams::default(),
            &DynamicObject::new("many", &ar)
                .within("shop")
                .data(json!({"specs": specs})),
        )
        .await
        .expect("create specs-only CNP");
    cnps.patch_status(
        "many",
        &params,
        &Patch::Merge(node_status(1).merge_patch("node-1")),
    )
    .await
    .expect("status of a specs-only policy");
    let typed = cnps.get("many").await.expect("typed get");
    assert_eq!(typed.spec.0, None);
    assert_eq!(
        typed.status.expect("status").nodes["node-1"],
        node_status(1)
    );
    let raw = raw_cnps.get("many").await.expect("raw get");
    assert_eq!(raw.data["specs"], specs);

    // The cluster-wide kind is served without a namespace.
    let ccnps: Api<CiliumClusterwideNetworkPolicy> = Api::all(client);
    let ccnp: CiliumClusterwideNetworkPolicy = serde_json::from_value(json!({
        "apiVersion": "cilium.io/v2", "kind": "CiliumClusterwideNetworkPolicy",
        "metadata": {"name": "deny-db"},
        "spec": {"endpointSelector": {"matchLabels": {"app": "db"}},
                 "ingressDeny": [{"fromEntities": ["world"]}]}
    }))
    .expect("typed CCNP");
    ccnps
        .create(&PostParams::default(), &ccnp)
        .await
        .expect("create CCNP");
    let patched = ccnps
        .patch_status(
            "deny-db",
            &params,
            &Patch::Merge(node_status(9).merge_patch("node-1")),
        )
        .await
        .expect("CCNP status");
    assert_eq!(patched.metadata.namespace, None);
    assert_eq!(
        patched.status.expect("status").nodes["node-1"],
        node_status(9)
    );
}

/// What the API server decides for one write under `manifests/slice-admission.yaml`: `Ok` when
/// it is admitted (the policy does not match it, or every validation holds), else the message
/// of the first validation that fails. The CEL is evaluated as the API server evaluates it:
/// match conditions, then the variables in order, then the validations.
fn admit_slice_write(
    vap: &ValidatingAdmissionPolicy,
    user: &str,
    node: Option<&str>,
    operation: &str,
    object: Value,
    old_object: Value,
) -> Result<(), String> {
    use cel_interpreter::{Context, Program};
    let spec = vap.spec.as_ref().expect("spec");
    let mut extra = serde_json::Map::new();
    if let Some(n) = node {
        extra.insert("authentication.kubernetes.io/node-name".into(), json!([n]));
    }
    let request = json!({"operation": operation, "userInfo": {"username": user, "extra": extra}});
    let mut ctx = Context::default();
    let value = |v: &Value| cel_interpreter::to_value(v).expect("JSON to CEL");
    ctx.add_variable_from_value("request", value(&request));
    ctx.add_variable_from_value("object", value(&object));
    ctx.add_variable_from_value("oldObject", value(&old_object));
    let eval = |ctx: &Context, expr: &str| {
        Program::compile(expr)
            .unwrap_or_else(|e| panic!("CEL {expr:?} does not compile: {e:?}"))
            .execute(ctx)
            .unwrap_or_else(|e| panic!("CEL {expr:?} fails: {e:?}"))
    };
    for c in spec.match_conditions.iter().flatten() {
        if eval(&ctx, &c.expression) != cel_interpreter::Value::Bool(true) {
            return Ok(());
        }
    }
    let mut variables = serde_json::Map::new();
    for v in spec.variables.iter().flatten() {
        let mut with = ctx.new_inner_scope();
        with.add_variable_from_value("variables", value(&Value::Object(variables.clone())));
        let got = eval(&with, &v.expression);
        let json = got.json().expect("variable to JSON");
        variables.insert(v.name.clone(), json);
    }
    ctx.add_variable_from_value("variables", value(&Value::Object(variables)));
    for v in spec.validations.iter().flatten() {
        if eval(&ctx, &v.expression) != cel_interpreter::Value::Bool(true) {
            return Err(v.message.clone().unwrap_or_default());
        }
    }
    Ok(())
}

/// Each agent may write only its own node's CiliateEndpointSlices (#26): the admission policy
/// in `manifests/` matches every write of the agents' service account to the kind, is bound
/// to deny, and admits exactly the writes of a slice of the token's own node.
#[test]
fn the_admission_policy_lets_an_agent_write_only_its_own_nodes_slices() {
    let objects = load_all();
    let vap = only!(objects, AdmissionPolicy);
    let binding = only!(objects, AdmissionPolicyBinding)
        .spec
        .clone()
        .expect("spec");
    assert_eq!(binding.policy_name.as_deref(), vap.metadata.name.as_deref());
    assert_eq!(binding.validation_actions, Some(vec!["Deny".to_string()]));
    let spec = vap.spec.as_ref().expect("spec");
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    let rules = spec.match_constraints.as_ref().expect("matchConstraints");
    let rule = &rules.resource_rules.as_ref().expect("resourceRules")[0];
    assert_eq!(rule.api_groups, Some(vec!["ciliate.io".to_string()]));
    assert_eq!(
        rule.resources,
        Some(vec![
            ciliate::k8s::slices::CiliateEndpointSlice::plural(&()).to_string()
        ])
    );
    assert_eq!(
        rule.operations,
        Some(vec!["CREATE".into(), "UPDATE".into(), "DELETE".into()])
    );
    // The user it checks is the DaemonSet's service account.
    let sa = only!(objects, ServiceAccount);
    let ds = daemonset();
    let pod = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec");
    assert_eq!(pod.service_account_name, sa.metadata.name);
    let agent = format!(
        "system:serviceaccount:{}:{}",
        sa.metadata.namespace.as_deref().unwrap_or_default(),
        sa.metadata.name.as_deref().unwrap_or_default()
    );

    let slice = |name: &str, label: Option<&str>, node: &str| {
        let mut s = json!({"apiVersion": "ciliate.io/v1alpha1", "kind": "CiliateEndpointSlice",
            "metadata": {"name": name}, "spec": {"node": node, "endpoints": []}});
        if let Some(l) = label {
            s["metadata"]["labels"] = json!({"ciliate.io/node": l});
        }
        s
    };
    let own = slice("node-1.0", Some("node-1"), "node-1");
    let other = slice("node-2.0", Some("node-2"), "node-2");
    let admit = |op: &str, node: Option<&str>, object: &Value, old: &Value| {
        admit_slice_write(vap, &agent, node, op, object.clone(), old.clone())
    };
    let n1 = Some("node-1");
    // Its own node's slices: created, updated, deleted.
    assert_eq!(admit("CREATE", n1, &own, &Value::Null), Ok(()));
    assert_eq!(admit("UPDATE", n1, &own, &own), Ok(()));
    assert_eq!(admit("DELETE", n1, &Value::Null, &own), Ok(()));
    // Another node's, or one whose parts lie.
    let denied = |r: Result<(), String>, field: &str| {
        let e = r.expect_err("admitted");
        assert!(e.starts_with(field), "{e}");
    };
    denied(admit("CREATE", n1, &other, &Value::Null), "spec.node");
    denied(admit("DELETE", n1, &Value::Null, &other), "spec.node");
    denied(admit("UPDATE", n1, &own, &other), "spec.node");
    denied(
        admit(
            "CREATE",
            n1,
            &slice("node-1.0", Some("node-2"), "node-1"),
            &Value::Null,
        ),
        "metadata.labels",
    );
    denied(
        admit(
            "CREATE",
            n1,
            &slice("node-1.0", None, "node-1"),
            &Value::Null,
        ),
        "metadata.labels",
    );
    denied(
        admit(
            "CREATE",
            n1,
            &slice("node-2.0", Some("node-1"), "node-1"),
            &Value::Null,
        ),
        "metadata.name",
    );
    // A token that names no node writes nothing (fail closed).
    denied(
        admit("CREATE", None, &own, &Value::Null),
        "the agent's service-account token",
    );
    // Anyone else (a cluster administrator) is not this policy's business.
    assert_eq!(
        admit_slice_write(
            vap,
            "kubernetes-admin",
            None,
            "CREATE",
            other.clone(),
            Value::Null
        ),
        Ok(())
    );
}

/// The ClusterRole grants `verbs` on `resource` of `group`.
fn grants(role: &ClusterRole, group: &str, resource: &str, verbs: &[&str]) -> bool {
    verbs.iter().all(|verb| {
        role.rules.iter().flatten().any(|r| {
            r.api_groups.iter().flatten().any(|g| g == group)
                && r.resources.iter().flatten().any(|x| x == resource)
                && r.verbs.iter().any(|v| v == verb)
        })
    })
}

/// The RBAC follows the kind registry: the agent may read every kind it watches and write the
/// status of every kind whose status it reports.
#[test]
fn rbac_covers_every_kind_of_the_registry() {
    let role = load_all()
        .into_iter()
        .find_map(|(_, o)| match o {
            Object::ClusterRole(r) => Some(r),
            _ => None,
        })
        .expect("a ClusterRole");
    for info in ciliate::kinds::KINDS.iter().filter(|r| r.watched) {
        assert!(
            grants(&role, info.group, info.plural, &["get", "list", "watch"]),
            "the ClusterRole does not let the agent watch {} ({}/{})",
            info.name,
            info.group,
            info.plural
        );
        let status = format!("{}/status", info.plural);
        assert_eq!(
            grants(&role, info.group, &status, &["patch"]),
            info.status,
            "{}: the ClusterRole's status grant does not match the registry",
            info.name
        );
    }
}

/// The path a container mounts the Secret `secret` at.
fn secret_mount(pod: &PodSpec, c: &Container, secret: &str) -> String {
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some(secret))
        .unwrap_or_else(|| panic!("a volume of the Secret {secret}"));
    c.volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == volume.name)
        .unwrap_or_else(|| panic!("{} mounts {secret}", c.name))
        .mount_path
        .clone()
}

/// Hubble in a cluster: every agent serves Hubble on its node's port 4244 with TLS from the
/// Secret hubble-server-certs, requiring client certificates; the hubble-peer Service reaches
/// the agents' named port; the relay dials it and the agents with the CA and client certificate
/// of the Secret hubble-relay-client-certs, and its command line is one `ciliate relay`
/// accepts.
#[test]
fn hubble_and_its_relay_are_wired_with_tls() {
    use clap::Parser;
    let line = agent_command_line();
    let Ok(ciliate::cli::Cli {
        command: ciliate::cli::Command::Agent(args),
        ..
    }) = ciliate::cli::Cli::try_parse_from(&line)
    else {
        panic!("the agent refuses {line:?}");
    };
    let listen = args.hubble_listen_address.expect("--hubble-listen-address");
    let agent = agent_container();
    let port = agent
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("hubble-grpc"))
        .expect("the agent's hubble-grpc port");
    assert_eq!(i32::from(listen.port()), port.container_port);
    let dir = secret_mount(&pod_spec(), &agent, "hubble-server-certs");
    let under = |p: &Option<std::path::PathBuf>| p.as_ref().is_some_and(|p| p.starts_with(&dir));
    assert!(
        under(&args.hubble_tls_cert_file) && under(&args.hubble_tls_key_file),
        "{line:?}"
    );
    assert!(
        !args.hubble_tls_client_ca_files.is_empty()
            && args
                .hubble_tls_client_ca_files
                .iter()
                .all(|p| p.starts_with(&dir)),
        "client certificates are required: {line:?}"
    );

    let objects = load_all();
    let services: Vec<_> = objects
        .iter()
        .filter_map(|(_, o)| match o {
            Object::Service(s) => Some(s),
            _ => None,
        })
        .collect();
    let peer = services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("hubble-peer"))
        .expect("the hubble-peer Service");
    let spec = peer.spec.as_ref().unwrap();
    let labels = daemonset()
        .spec
        .unwrap()
        .template
        .metadata
        .unwrap()
        .labels
        .unwrap();
    for (k, v) in spec.selector.as_ref().expect("a selector") {
        assert_eq!(labels.get(k), Some(v), "hubble-peer selects the agents");
    }
    let sp = &spec.ports.as_ref().unwrap()[0];
    assert_eq!(
        sp.target_port,
        Some(
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("hubble-grpc".into())
        )
    );

    let relay = only!(objects, Deployment);
    let pod = relay.spec.clone().unwrap().template.spec.unwrap();
    let c = container(&pod.containers, "relay");
    let line: Vec<String> = c
        .command
        .iter()
        .chain(c.args.iter())
        .flatten()
        .cloned()
        .collect();
    let Ok(ciliate::cli::Cli {
        command: ciliate::cli::Command::Relay(r),
        ..
    }) = ciliate::cli::Cli::try_parse_from(&line)
    else {
        panic!("ciliate relay refuses {line:?}");
    };
    let ns = peer.metadata.namespace.as_deref().unwrap();
    assert_eq!(r.peer_service, format!("hubble-peer.{ns}.svc:{}", sp.port));
    let dir = secret_mount(&pod, c, "hubble-relay-client-certs");
    assert!(!r.tls_hubble_server_ca_files.is_empty());
    for p in r
        .tls_hubble_server_ca_files
        .iter()
        .chain(&r.tls_client_cert_file)
        .chain(&r.tls_client_key_file)
    {
        assert!(p.starts_with(&dir), "{} under {dir}", p.display());
    }
    assert!(r.tls_client_cert_file.is_some() && r.tls_client_key_file.is_some());
    let relay_service = services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("hubble-relay"))
        .expect("the hubble-relay Service");
    let port = &relay_service.spec.as_ref().unwrap().ports.as_ref().unwrap()[0];
    let served = c
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("grpc"))
        .unwrap();
    assert_eq!(i32::from(r.listen_address.port()), served.container_port);
    assert_eq!(
        port.target_port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("grpc".into()))
    );
}
