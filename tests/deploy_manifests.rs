//! The deployment in `manifests/` is what a cluster runs: the DaemonSet's agent command line,
//! with every `$(VAR)` filled from the ConfigMap as the kubelet does, must be one the agent
//! accepts, and must carry what cluster networking needs (routing, masquerading, Service
//! translation under the host's cgroup v2, whose mount it must have). The RBAC must allow every
//! kind the agent watches.

use std::collections::BTreeMap;

use clap::Parser;
use serde_json::Value;

fn load(name: &str) -> Vec<Value> {
    let path = format!("{}/manifests/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| {
            let v: serde_yaml::Value = serde::Deserialize::deserialize(d).expect("YAML");
            serde_json::to_value(v).expect("JSON-compatible YAML")
        })
        .collect()
}

/// The agent container's command line, `$(VAR)`s expanded from its env (ConfigMap keys, and
/// the node name a kubelet would give).
fn agent_command_line() -> (Vec<String>, Value) {
    let config = load("configmap.yaml").remove(0);
    let data = &config["data"];
    let ds = load("daemonset.yaml").remove(0);
    let agent = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == "agent")
        .expect("the agent container")
        .clone();
    let mut env = BTreeMap::new();
    for e in agent["env"].as_array().expect("env") {
        let name = e["name"].as_str().expect("env name").to_string();
        let value = if let Some(key) = e["valueFrom"]["configMapKeyRef"]["key"].as_str() {
            assert_eq!(e["valueFrom"]["configMapKeyRef"]["name"], "ciliate-config");
            data[key]
                .as_str()
                .unwrap_or_else(|| panic!("env {name}: the ConfigMap has no key {key}"))
                .to_string()
        } else if e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName" {
            "kind-worker".to_string()
        } else {
            e["value"].as_str().expect("a value").to_string()
        };
        env.insert(name, value);
    }
    let mut line: Vec<String> = agent["command"]
        .as_array()
        .expect("command")
        .iter()
        .map(|a| a.as_str().expect("a string").to_string())
        .collect();
    for a in agent["args"].as_array().expect("args") {
        let mut a = a.as_str().expect("a string").to_string();
        for (k, v) in &env {
            a = a.replace(&format!("$({k})"), v);
        }
        assert!(
            !a.contains("$("),
            "{a}: a variable the container does not define"
        );
        line.push(a);
    }
    (line, ds)
}

#[test]
fn the_daemonsets_agent_command_line_is_accepted_and_carries_cluster_networking() {
    let (line, ds) = agent_command_line();
    let cli = ciliate::cli::Cli::try_parse_from(&line)
        .unwrap_or_else(|e| panic!("the agent refuses {line:?}: {e}"));
    let ciliate::cli::Command::Agent(args) = cli.command else {
        panic!("not the agent: {line:?}");
    };
    assert_eq!(args.node_name.as_deref(), Some("kind-worker"));
    assert_eq!(
        args.ipv4_native_routing_cidr,
        Some("10.244.0.0/16".parse().unwrap()),
        "the kind cluster's podSubnet"
    );
    assert!(args.enable_ipv4_masquerade && args.auto_direct_node_routes);
    // Service translation is attached to a cgroup v2 directory that the pod mounts from the
    // host.
    let root = args.cgroup_root.expect("--cgroup-root");
    let pod = &ds["spec"]["template"]["spec"];
    let mount = pod["containers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| c["volumeMounts"].as_array().cloned().unwrap_or_default())
        .find(|m| m["mountPath"] == root.to_str().unwrap())
        .unwrap_or_else(|| panic!("nothing is mounted at --cgroup-root {}", root.display()));
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the cgroup volume");
    assert_eq!(volume["hostPath"]["path"], "/sys/fs/cgroup", "{volume}");
}

#[test]
fn the_kind_configs_pod_subnet_is_the_native_routing_cidr() {
    let kind = std::fs::read_to_string(format!(
        "{}/manifests/kind-config.yaml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let config = load("configmap.yaml").remove(0);
    let cidr = config["data"]["ipv4-native-routing-cidr"].as_str().unwrap();
    assert!(
        kind.contains(&format!("podSubnet: \"{cidr}\""))
            || kind.contains(&format!("podSubnet: {cidr}")),
        "kind-config.yaml's podSubnet is not {cidr}:\n{kind}"
    );
}

#[test]
fn rbac_lets_the_agent_watch_everything_it_watches() {
    let docs = load("rbac.yaml");
    let role = docs
        .iter()
        .find(|d| d["kind"] == "ClusterRole")
        .expect("a ClusterRole");
    let allows = |group: &str, resource: &str, verb: &str| {
        role["rules"].as_array().unwrap().iter().any(|r| {
            r["apiGroups"]
                .as_array()
                .unwrap()
                .iter()
                .any(|g| g == group)
                && r["resources"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|x| x == resource)
                && r["verbs"].as_array().unwrap().iter().any(|v| v == verb)
        })
    };
    for (group, resource) in [
        ("", "pods"),
        ("", "namespaces"),
        ("", "nodes"),
        ("", "services"),
        ("discovery.k8s.io", "endpointslices"),
        ("networking.k8s.io", "networkpolicies"),
        ("cilium.io", "ciliumnetworkpolicies"),
        ("cilium.io", "ciliumclusterwidenetworkpolicies"),
    ] {
        for verb in ["list", "watch"] {
            assert!(
                allows(group, resource, verb),
                "the ClusterRole does not allow {verb} {group}/{resource}"
            );
        }
    }
    // Read-only beyond its own Node's annotations and the policies' status.
    assert!(!allows("", "pods", "update") && !allows("", "services", "update"));
}
