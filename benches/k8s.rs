//! Kubernetes mode (issue #5), a bench binary: `cargo bench --bench k8s`.
//!
//! The in-repo test API server holds 1,000 namespaces, 10,000 pods (10 of them on this node) and
//! 1,000 CiliumNetworkPolicies. The real `ciliate agent` binary (release build, in-memory
//! datapath, so the figures are the control plane's) starts against it:
//! - initial sync: from spawning the agent to `/readyz` answering 200, and its RSS then;
//! - CNP change to `Regenerate`: a policy selecting the 10 local endpoints is edited on the
//!   server (the watch event goes out at once); the time from the edit until the last of the
//!   endpoints' `Regenerate` started, from the agent's own message journal.

use std::time::{Duration, Instant};

use ciliate_test_apiserver::TestApiServer;
use serde_json::{json, Value};

// The integration tests' harness for the agent binary (spawn, debug HTTP, CLI).
#[allow(dead_code)]
#[path = "../tests/common/agent.rs"]
mod agent;
use agent::Agent;
const NAMESPACES: usize = 1000;
const PODS: usize = 10_000;
const POLICIES: usize = 1000;
const NODE: &str = "node-1";
const EDITS: usize = 30;

fn pod_ip(i: usize) -> String {
    format!("10.{}.{}.{}", 64 + i / 62_500, (i / 250) % 250, i % 250 + 1)
}

fn pod(i: usize) -> Value {
    // Pods 0, 1000, 2000, ... are in ns-0 with app=a0 and run on this node.
    let node = if i.is_multiple_of(NAMESPACES) {
        NODE.to_string()
    } else {
        format!("node-{}", 2 + i % 100)
    };
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("p-{i}"), "namespace": format!("ns-{}", i % NAMESPACES),
                     "labels": {"app": format!("a{}", i % 20), "tier": format!("t{}", i % 3)}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox",
                 "ports": [{"name": "http", "containerPort": 8080}]}]},
        "status": {"phase": "Running", "podIP": pod_ip(i), "podIPs": [{"ip": pod_ip(i)}]}
    })
}

fn policy(k: usize, port: u32) -> Value {
    json!({
        "apiVersion": "cilium.io/v2", "kind": "CiliumNetworkPolicy",
        "metadata": {"name": format!("cnp-{k}"), "namespace": format!("ns-{k}")},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": format!("a{}", k % 20)}},
            "ingress": [{"fromEndpoints": [{"matchLabels": {"app": format!("a{}", (k + 1) % 20)}}],
                         "toPorts": [{"ports": [{"port": port.to_string(), "protocol": "TCP"}]}]}],
            "egress": [{"toEndpoints": [{"matchLabels": {
                "k8s:io.kubernetes.pod.namespace": format!("ns-{}", (k + 1) % NAMESPACES)}}]}]
        }
    })
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn ts(v: &Value) -> Option<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::parse_from_rfc3339(v.as_str()?)
        .ok()
        .map(|t| t.with_timezone(&chrono::Utc))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let server = TestApiServer::start().expect("test API server");
    let tmp = tempfile::tempdir().expect("tempdir");
    let kubeconfig = tmp.path().join("kubeconfig");
    server.kubeconfig(&kubeconfig).expect("kubeconfig");
    let t = Instant::now();
    for (_, crd) in ciliate::k8s::crd::crds() {
        server
            .apply_json(serde_json::to_value(crd).expect("CRD as JSON"))
            .expect("CRD");
    }
    server
        .apply_json(
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
            "spec": {"podCIDRs": ["10.200.0.0/24"]},
            "status": {"addresses": [{"type": "InternalIP", "address": "172.30.0.2"}]}}),
        )
        .expect("node");
    for n in 0..NAMESPACES {
        server
            .apply_json(json!({"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": format!("ns-{n}"), "labels": {"team": format!("t{}", n % 10)}}}))
            .expect("namespace");
    }
    for i in 0..PODS {
        server.apply_json(pod(i)).expect("pod");
    }
    for k in 0..POLICIES {
        server.apply_json(policy(k, 80)).expect("policy");
    }
    println!(
        "API server seeded: {NAMESPACES} namespaces, {PODS} pods, {POLICIES} CNPs in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    // The harness starts the agent (node-1) and returns once /readyz answers (polled every 50 ms).
    let started = Instant::now();
    let agent = Agent::start_kubernetes(tmp.path(), &kubeconfig, &["--datapath", "memory"]);
    let sync = started.elapsed();
    let pid = agent.child.as_ref().map_or(0, |c| c.id());
    let (rss, hwm) = (rss_kib(pid, "VmRSS:"), rss_kib(pid, "VmHWM:"));
    println!(
        "initial sync to /readyz: {:.2} s (target <= 10 s); RSS after sync {:.1} MiB, peak {:.1} MiB (target <= 150 MB)",
        sync.as_secs_f64(),
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0
    );

    let policies = agent.json("/debug/policy");
    let accepted = policies["policies"].as_array().map_or(0, |p| {
        p.iter().filter(|p| p["status"] == "accepted").count()
    });
    assert_eq!(accepted, POLICIES, "every CNP accepted at /readyz");

    // The 10 pods of ns-0 on this node become endpoints.
    let mut ids = Vec::new();
    for i in (0..PODS).step_by(NAMESPACES) {
        let ep = agent.cli_json(&[
            "endpoint",
            "add",
            "--name",
            &format!("ns-0/p-{i}"),
            "--ip",
            &pod_ip(i),
        ]);
        ids.push(ep["id"].as_u64().expect("endpoint id"));
    }
    let (rss, hwm) = (rss_kib(pid, "VmRSS:"), rss_kib(pid, "VmHWM:"));
    println!(
        "with {} local endpoints: RSS {:.1} MiB, peak {:.1} MiB",
        ids.len(),
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0
    );

    // Edit cnp-0 (selects app=a0 in ns-0: the local endpoints) and time its Regenerate.
    let mut to_start = Vec::new();
    for round in 0..EDITS {
        std::thread::sleep(Duration::from_millis(100));
        let edited_at = chrono::Utc::now();
        server
            .apply_json(policy(0, 81 + round as u32))
            .expect("edit cnp-0");
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut latest: Option<f64> = None;
        for id in &ids {
            let name = format!("EndpointActor%2F{id}");
            let found = loop {
                let (_, body) = agent.http_get(&format!("/debug/actors/{name}/messages"));
                let msgs: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                let hit = msgs.as_array().into_iter().flatten().find(|m| {
                    m["message"] == "Regenerate"
                        && ts(&m["enqueued_at"]).is_some_and(|t| t >= edited_at)
                        && ts(&m["started_at"]).is_some()
                });
                if let Some(m) = hit {
                    break Some(m.clone());
                }
                if Instant::now() > deadline {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(5));
            };
            let m =
                found.unwrap_or_else(|| panic!("endpoint {id}: no Regenerate after edit {round}"));
            let ms = |field: &str| {
                ts(&m[field]).map_or(f64::NAN, |t| {
                    (t - edited_at).num_microseconds().unwrap_or(0) as f64 / 1000.0
                })
            };
            let s = ms("started_at");
            latest = Some(latest.map_or(s, |l| l.max(s)));
        }
        if let Some(s) = latest {
            to_start.push(s);
        }
    }
    to_start.sort_by(f64::total_cmp);
    println!(
        "CNP edit -> Regenerate started on every affected endpoint ({EDITS} edits, {} endpoints): p50 {:.1} ms, p95 {:.1} ms, max {:.1} ms (target <= 100 ms)",
        ids.len(),
        percentile(&to_start, 0.5),
        percentile(&to_start, 0.95),
        to_start[to_start.len() - 1]
    );
    drop(agent);
}
