//! Traffic analysis (issue #32, interfaces section 16) on real packets in the cluster harness:
//! pods a and c (node 1) connect to pod b (node 2). Node 2's agent keeps the connections it
//! saw; `ciliate policy diff` names the ones a proposed policy would newly drop and the policy
//! that drops them, and enforcing the policy then drops exactly those. The same flows read
//! from a file (`ciliate monitor -o json`, and the same flows written as Hubble's `hubble
//! observe -o jsonpb` prints them) give the same report. `ciliate policy recommend`'s policies,
//! applied, let the observed connections through and drop one the workloads never made.
//! Privileged: with CI=true it must run.

mod common;

use std::io::Read;
use std::net::IpAddr;
use std::path::Path;
use std::process::{Command, Stdio};

use common::agent::BIN;
use common::cluster::Cluster;
use common::eventually;
use common::netns::{privileged, tcp_ok};
use serde_json::{json, Value};

/// b admits a on TCP 8080 (and so isolates b's ingress).
const B_FROM_A: &str = "apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: b-from-a, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: b}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: a}}]
    toPorts: [{ports: [{port: '8080', protocol: TCP}]}]
";

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN).args(args).output().expect("ciliate runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn ok_json(args: &[&str]) -> Value {
    let (code, out, err) = run(args);
    assert_eq!(code, 0, "ciliate {args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("ciliate {args:?}: {e}: {out}"))
}

/// What `ciliate monitor -o json --since 1h` prints of node 2's kept flows.
fn monitor_lines(socket: &Path) -> Vec<String> {
    let mut child = Command::new(BIN)
        .args(["monitor", "-o", "json", "--since", "1h", "--socket"])
        .arg(socket)
        .stdout(Stdio::piped())
        .spawn()
        .expect("monitor runs");
    std::thread::sleep(std::time::Duration::from_secs(3));
    let _ = child.kill();
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut out)
        .expect("monitor output");
    let _ = child.wait();
    out.lines().map(str::to_string).collect()
}

/// A monitor flow as `hubble observe -o jsonpb` prints a flow (Hubble's field names).
fn as_hubble(line: &str) -> Option<Value> {
    let f: Value = serde_json::from_str(line).ok()?;
    if f["type"] != "flow" || f.get("match").is_none() {
        return None;
    }
    let end = |pod: &Value, labels: &Value| {
        let (ns, name) = pod
            .as_str()
            .and_then(|p| p.split_once('/'))
            .unwrap_or(("", ""));
        json!({"namespace": ns, "pod_name": name, "labels": labels})
    };
    let egress = f["direction"] == "egress";
    let policies: Vec<Value> = f["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| json!({"name": p["name"], "namespace": p["namespace"], "kind": p["kind"]}))
        .collect();
    let by = match (egress, f["verdict"] == "dropped") {
        (true, false) => "egress_allowed_by",
        (false, false) => "ingress_allowed_by",
        (true, true) => "egress_denied_by",
        (false, true) => "ingress_denied_by",
    };
    let mut flow = json!({
        "time": f["time"],
        "verdict": f["verdict"].as_str()?.to_uppercase(),
        "IP": {"source": f["source"], "destination": f["destination"], "ipVersion": "IPv4"},
        "l4": {"TCP": {"source_port": f["source_port"], "destination_port": f["port"],
                        "flags": {"SYN": true}}},
        "source": end(&f["source_pod"], &f["labels"]["source"]),
        "destination": end(&f["destination_pod"], &f["labels"]["destination"]),
        "Type": "L3_L4",
        "event_type": {"type": 5},
        "traffic_direction": if egress { "EGRESS" } else { "INGRESS" },
        "is_reply": false,
    });
    flow[by] = Value::from(policies);
    Some(json!({"flow": flow, "node_name": "node-2", "time": f["time"]}))
}

/// The policies in a YAML stream, as JSON objects.
fn documents(yaml: &str) -> Vec<Value> {
    use serde::Deserialize;
    serde_yaml::Deserializer::from_str(yaml)
        .map(|d| serde_json::to_value(serde_yaml::Value::deserialize(d).unwrap()).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

#[test]
fn diff_names_what_a_policy_would_drop_and_recommend_allows_exactly_what_was_seen() {
    let Some(mut c) = privileged().then(|| Cluster::start(2)) else {
        return;
    };
    let (a, other, b) = c.a_and_c_to_b(&[8080, 8081]);
    let b_addr = IpAddr::V4(b.addr);
    assert!(tcp_ok(&a.netns, b_addr, 8081));
    assert!(tcp_ok(&other.netns, b_addr, 8080));
    let socket = c.nodes[1].socket();
    let sock = socket.to_str().unwrap();
    eventually("node 2 keeps the three connections", || {
        let h =
            ciliate::client::request(&socket, "GET", "/v1/flows/history", None).unwrap_or_default();
        let h: Value = serde_json::from_str(&h).unwrap_or(Value::Null);
        h.as_array().is_some_and(|a| a.len() == 3)
    });

    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("b-from-a.yaml");
    std::fs::write(&policy, B_FROM_A).unwrap();
    let policy = policy.to_str().unwrap();
    let recommended = {
        let (code, out, err) = run(&["policy", "recommend", "--namespace", "x", "--socket", sock]);
        assert_eq!(code, 0, "{err}");
        out
    };
    // The same policies as JSON: a List of them, the comments on stderr.
    let (code, out, err) = run(&[
        "policy",
        "recommend",
        "--namespace",
        "x",
        "-o",
        "json",
        "--socket",
        sock,
    ]);
    assert_eq!(code, 0, "{err}");
    let list: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(list["kind"], "List", "{list}");
    let docs: Vec<Value> = recommended
        .split("\n---")
        .filter_map(|d| serde_yaml::from_str::<Option<Value>>(d).ok().flatten())
        .collect();
    assert!(!docs.is_empty(), "{recommended}");
    assert_eq!(list["items"], Value::Array(docs), "{list:#}");
    assert!(
        err.contains("# Recommended by `ciliate policy recommend`"),
        "{err}"
    );

    // The live diff: c -> b:8080 and a -> b:8081 would be newly dropped, by b-from-a.
    let diff_json = || {
        ok_json(&[
            "policy",
            "diff",
            "--policies",
            policy,
            "-o",
            "json",
            "--socket",
            sock,
        ])
    };
    let live = diff_json();
    assert_eq!(live["connections"], 3, "{live:#}");
    assert_eq!(live["newly_dropped"], 2, "{live:#}");
    assert_eq!(live["newly_forwarded"], 0, "{live:#}");
    assert_eq!(live["replay_differs_from_observed"], 0, "{live:#}");
    let flips: Vec<(String, u64, String)> = live["flips"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            assert_eq!(f["after"], "dropped", "{f}");
            assert_eq!(
                f["by"],
                json!([{"kind": "CiliumNetworkPolicy", "namespace": "x", "name": "b-from-a", "tier": "network-policy"}]),
                "{f}"
            );
            assert_eq!(f["destination"]["pod"], "x/b", "{f}");
            (
                f["source"]["pod"].as_str().unwrap().to_string(),
                f["port"].as_u64().unwrap(),
                f["protocol"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let expected = vec![
        ("x/c".to_string(), 8080, "TCP".to_string()),
        ("x/a".to_string(), 8081, "TCP".to_string()),
    ];
    // Newly dropped, the busier first: c reached b:8080 at least twice, a b:8081 once.
    assert_eq!(flips, expected, "{live:#}");
    let (code, text, err) = run(&["policy", "diff", "--policies", policy, "--socket", sock]);
    assert_eq!(code, 0, "{err}");
    eprintln!("{text}\n{recommended}");
    assert!(
        text.contains("2 connection(s) would be newly dropped")
            && text.contains("by CiliumNetworkPolicy x/b-from-a"),
        "{text}"
    );

    // Offline: the same flows from `ciliate monitor -o json`, and as Hubble prints them.
    let lines = monitor_lines(&socket);
    let monitor_file = dir.path().join("monitor.json");
    std::fs::write(&monitor_file, lines.join("\n")).unwrap();
    let hubble: Vec<String> = lines
        .iter()
        .filter_map(|l| as_hubble(l))
        .map(|v| v.to_string())
        .collect();
    assert!(!hubble.is_empty(), "monitor printed flows: {lines:?}");
    let hubble_file = dir.path().join("hubble.jsonpb");
    std::fs::write(&hubble_file, hubble.join("\n")).unwrap();
    for file in [&monitor_file, &hubble_file] {
        let offline = ok_json(&[
            "policy",
            "diff",
            "--policies",
            policy,
            "--flows",
            file.to_str().unwrap(),
            "-o",
            "json",
        ]);
        assert_eq!(offline, live, "{}: the same answer offline", file.display());
        let (code, yaml, err) = run(&[
            "policy",
            "recommend",
            "--namespace",
            "x",
            "--flows",
            file.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(
            yaml,
            recommended,
            "{}: the same recommendation",
            file.display()
        );
    }

    // The cluster's flows from a Hubble Observer (node 2's own here; a relay serves the same
    // API for every node), replayed by the agent: the same connections flip.
    let observer = format!(
        "unix://{}",
        c.nodes[1].dir.join("state/hubble.sock").display()
    );
    let from_observer = ok_json(&[
        "policy",
        "diff",
        "--policies",
        policy,
        "--server",
        &observer,
        "-o",
        "json",
        "--socket",
        sock,
    ]);
    let essentials = |r: &Value| -> Vec<Value> {
        r["flips"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                json!([
                    f["source"]["pod"],
                    f["source"]["labels"],
                    f["destination"]["pod"],
                    f["protocol"],
                    f["port"],
                    f["count"],
                    f["after"],
                    f["by"]
                ])
            })
            .collect()
    };
    assert_eq!(
        essentials(&from_observer),
        essentials(&live),
        "{from_observer:#}"
    );
    let (code, yaml, err) = run(&[
        "policy",
        "recommend",
        "--namespace",
        "x",
        "--server",
        &observer,
        "--socket",
        sock,
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        yaml, recommended,
        "the same recommendation from the Observer's flows"
    );

    // Kept across a restart of the agent: the same diff after it.
    c.node(2).agent.as_mut().expect("agent").stop();
    let kubeconfig = c.kubeconfig.clone();
    c.node(2).start_agent(&kubeconfig);
    let again = diff_json();
    assert_eq!(again, live, "the history survived the restart");

    // Enforced, the policy drops exactly what the diff said.
    for d in documents(B_FROM_A) {
        c.api().apply_json(d).expect("b-from-a");
    }
    eventually("c no longer reaches b:8080", || {
        !tcp_ok(&other.netns, b_addr, 8080)
    });
    assert!(!tcp_ok(&a.netns, b_addr, 8081), "a -> b:8081 dropped");
    assert!(tcp_ok(&a.netns, b_addr, 8080), "a -> b:8080 still allowed");
    c.api()
        .delete_object("cilium.io/v2", "CiliumNetworkPolicy", "x", "b-from-a")
        .expect("b-from-a deleted");

    // The recommendation, applied: the connections seen pass; others do not.
    assert!(
        recommended.contains("name: allow-observed-b") && !recommended.contains("pod-template"),
        "{recommended}"
    );
    let docs = documents(&recommended);
    assert_eq!(
        docs.len(),
        3,
        "one policy per workload (a, b, c): {recommended}"
    );
    for d in docs {
        c.api().apply_json(d).expect("a recommended policy");
    }
    let d = c.add_pod(1, "d", "d");
    eventually("a pod that never reached b is dropped", || {
        !tcp_ok(&d.netns, b_addr, 8080)
    });
    for (from, port) in [(&a, 8080), (&a, 8081), (&other, 8080)] {
        assert!(tcp_ok(&from.netns, b_addr, port), "observed: {port} passes");
    }
    assert!(
        !tcp_ok(&other.netns, b_addr, 8081),
        "c never reached b:8081"
    );
}
