//! The manifest directory under hostile and careless use (hardening issue, items 1–4), through
//! the agent binary (`--datapath memory`): duplicates across files, FIFOs, link loops, devices,
//! oversized files and large files of many documents.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::agent::Agent;
use serde_json::Value;

const SHOP: &str = "\
apiVersion: v1
kind: Namespace
metadata: {name: shop}
---
apiVersion: v1
kind: Pod
metadata: {name: cache, namespace: shop, labels: {app: cache}}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: default-deny, namespace: shop}
spec:
  podSelector: {}
  policyTypes: [Ingress]
";

const WEAK_DUPLICATE: &str = "\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: default-deny, namespace: shop}
spec:
  podSelector: {matchLabels: {app: nothing-has-this}}
  policyTypes: [Ingress]
";

fn start(files: &[(&str, &str)]) -> (tempfile::TempDir, Agent) {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = dir.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    for (name, text) in files {
        std::fs::write(m.join(name), text).unwrap();
    }
    let agent = Agent::start_in(dir.path());
    (dir, agent)
}

fn add_cache_endpoint(agent: &Agent) {
    let (code, _, err) = agent.cli(&[
        "endpoint",
        "add",
        "--name",
        "shop/cache",
        "--ip",
        "10.9.0.5",
    ]);
    assert_eq!(code, 0, "{err}");
}

fn ingress_enforced(agent: &Agent) -> bool {
    agent.endpoint(1)["ingress_enforced"] == true
}

fn policy_source(agent: &Agent, name: &str) -> String {
    let v = agent.json("/debug/policy");
    v["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == name)
        .map(|p| p["source"].as_str().unwrap_or("").to_string())
        .unwrap_or_default()
}

fn manifest_errors(agent: &Agent) -> serde_json::Map<String, Value> {
    agent.json("/debug/policy")["manifest_errors"]
        .as_object()
        .cloned()
        .unwrap_or_default()
}

/// `ciliate endpoint list` over the unix socket: how long it takes to answer.
fn api_latency(agent: &Agent) -> Duration {
    let t = Instant::now();
    let (code, _, err) = agent.cli(&["endpoint", "list", "-o", "json"]);
    assert_eq!(code, 0, "{err}");
    t.elapsed()
}

fn rss_kib(agent: &Agent) -> u64 {
    let pid = agent.child.as_ref().expect("running").id();
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Waits until the watcher has reported a scan after `since` (messages are journaled).
fn wait_scanned(agent: &Agent, after_seq: u64) -> u64 {
    let mut last = after_seq;
    agent.wait_until("the manifest scanner reports a scan", || {
        let msgs = agent.json("/debug/actors/WatcherActor/messages");
        last = msgs
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| m["message"] == "ScanDone")
            .filter_map(|m| m["seq"].as_u64())
            .max()
            .unwrap_or(0);
        last > after_seq
    });
    last
}

#[test]
fn a_duplicate_in_an_earlier_file_never_weakens_the_enforced_policy_and_its_removal_changes_nothing(
) {
    let (_dir, agent) = start(&[("policies.yaml", SHOP)]);
    add_cache_endpoint(&agent);
    agent.wait_until("shop/cache enforces ingress", || ingress_enforced(&agent));
    assert_eq!(policy_source(&agent, "default-deny"), "policies.yaml#2");
    let rev = agent.revision();

    // 00-dup.yaml sorts before policies.yaml: policies.yaml's version stays in force.
    std::fs::write(agent.manifests().join("00-dup.yaml"), WEAK_DUPLICATE).unwrap();
    agent.wait_until("the duplicate is noticed", || {
        agent.log().contains("object defined more than once")
    });
    assert!(ingress_enforced(&agent), "the weaker duplicate was applied");
    assert_eq!(policy_source(&agent, "default-deny"), "policies.yaml#2");
    assert_eq!(
        agent.revision(),
        rev,
        "a shadowed duplicate changed the policy"
    );

    let seq = wait_scanned(&agent, 0);
    std::fs::remove_file(agent.manifests().join("00-dup.yaml")).unwrap();
    wait_scanned(&agent, seq);
    assert!(ingress_enforced(&agent));
    assert_eq!(
        agent.revision(),
        rev,
        "removing a shadowed duplicate changed the policy"
    );
    assert_eq!(policy_source(&agent, "default-deny"), "policies.yaml#2");

    // The other way round: a later file wins, and removing it restores the earlier one.
    std::fs::write(agent.manifests().join("zz-override.yaml"), WEAK_DUPLICATE).unwrap();
    agent.wait_until("the later file's version is applied", || {
        !ingress_enforced(&agent)
    });
    assert_eq!(policy_source(&agent, "default-deny"), "zz-override.yaml#0");
    std::fs::remove_file(agent.manifests().join("zz-override.yaml")).unwrap();
    agent.wait_until("removing it restores policies.yaml's version", || {
        ingress_enforced(&agent)
    });
    assert_eq!(policy_source(&agent, "default-deny"), "policies.yaml#2");
}

#[test]
fn a_fifo_is_refused_and_never_blocks_the_api() {
    let (_dir, agent) = start(&[("policies.yaml", SHOP)]);
    add_cache_endpoint(&agent);
    let fifo = agent.manifests().join("pipe.yaml");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    agent.wait_until("the FIFO is reported", || {
        manifest_errors(&agent)
            .get("pipe.yaml")
            .and_then(Value::as_str)
            .is_some_and(|e| e.contains("FIFO"))
    });
    for _ in 0..5 {
        assert!(api_latency(&agent) < Duration::from_secs(2));
        assert_eq!(agent.http_get("/debug/policy").0, 200);
    }
    // Everything else is still applied: an edit to the real file takes effect.
    let rev = agent.revision();
    std::fs::write(
        agent.manifests().join("policies.yaml"),
        SHOP.replace("policyTypes: [Ingress]", "policyTypes: [Ingress, Egress]"),
    )
    .unwrap();
    agent.wait_until("the edit next to the FIFO is applied", || {
        agent.revision() > rev && agent.endpoint(1)["egress_enforced"] == true
    });
    std::fs::remove_file(&fifo).unwrap();
    agent.wait_until("the FIFO's error goes with it", || {
        !manifest_errors(&agent).contains_key("pipe.yaml")
    });
}

#[test]
fn link_loops_devices_and_oversized_files_are_refused_with_bounded_memory() {
    let (_dir, agent) = start(&[("policies.yaml", SHOP)]);
    add_cache_endpoint(&agent);
    let m = agent.manifests();
    let rss_before = rss_kib(&agent);
    std::os::unix::fs::symlink(".", m.join("loop")).unwrap();
    std::os::unix::fs::symlink(".", m.join("loop2")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", m.join("zero.yaml")).unwrap();
    // 20 MB of real YAML: over the default cap of 16 MiB.
    let big: String = (0..200_000)
        .map(|i| format!("# padding line {i:>90}\n"))
        .collect();
    std::fs::write(m.join("big.yaml"), &big).unwrap();
    agent.wait_until("every refusal is reported", || {
        let e = manifest_errors(&agent);
        ["loop", "loop2", "zero.yaml", "big.yaml"]
            .iter()
            .all(|f| e.contains_key(*f))
    });
    let e = manifest_errors(&agent);
    assert!(e["loop"].as_str().unwrap().contains("loop"), "{e:?}");
    assert!(
        e["zero.yaml"]
            .as_str()
            .unwrap()
            .contains("character device"),
        "{e:?}"
    );
    assert!(
        e["big.yaml"]
            .as_str()
            .unwrap()
            .contains("--manifest-max-file-bytes"),
        "{e:?}"
    );
    // Several more scans with the loops in place: memory stays put, the API answers.
    let seq = wait_scanned(&agent, 0);
    for i in 0..3 {
        std::fs::write(m.join(format!("touch-{i}.yaml")), "").unwrap();
    }
    wait_scanned(&agent, seq);
    assert!(api_latency(&agent) < Duration::from_secs(2));
    let rss_after = rss_kib(&agent);
    assert!(
        rss_after < rss_before + 64 * 1024,
        "RSS grew from {rss_before} to {rss_after} KiB"
    );
    assert!(ingress_enforced(&agent));
}

#[test]
fn a_loop_beside_five_thousand_files_settles_with_a_short_log() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    std::fs::write(m.join("policies.yaml"), SHOP).unwrap();
    std::os::unix::fs::symlink(".", m.join("loop")).unwrap();
    for i in 0..5000 {
        std::fs::write(
            m.join(format!("pod-{i:04}.yaml")),
            format!(
                "kind: Pod\napiVersion: v1\nmetadata: {{name: p{i}, namespace: shop}}\n\
                 status: {{podIPs: [{{ip: 10.9.{}.{}}}]}}\n",
                i / 250 + 1,
                i % 250 + 1
            ),
        )
        .unwrap();
    }
    let agent = Agent::start_in(dir.path());
    agent.wait_until("the 5,000 pods are in the ipcache", || {
        agent.json("/debug/ipcache").as_array().map_or(0, Vec::len) >= 5000
    });
    // Let several periodic and event scans pass; the agent is idle and its log stays short.
    std::fs::write(m.join("pod-0000.yaml"), "").unwrap();
    let seq = wait_scanned(&agent, 0);
    wait_scanned(&agent, seq);
    let log = agent.log();
    assert!(log.len() < 256 * 1024, "log is {} bytes", log.len());
    assert_eq!(
        log.matches("a link back to a directory being read").count(),
        1,
        "a loop is reported once, not on every scan"
    );
}

/// Writes one file of `n` Pod documents.
fn write_pods(path: &Path, n: usize) {
    let mut text = String::with_capacity(n * 120);
    for i in 0..n {
        text.push_str(&format!(
            "---\nkind: Pod\napiVersion: v1\nmetadata: {{name: p{i}, namespace: shop, labels: {{app: a{}}}}}\n\
             status: {{podIPs: [{{ip: 10.{}.{}.{}}}]}}\n",
            i % 50,
            100 + i / 62500,
            (i / 250) % 250,
            i % 250 + 1
        ));
    }
    std::fs::write(path, text).unwrap();
}

#[test]
fn a_file_of_forty_thousand_pods_loads_while_the_api_answers_and_sigterm_is_prompt() {
    let (_dir, mut agent) = start(&[("policies.yaml", SHOP)]);
    write_pods(&agent.manifests().join("pods.yaml"), 40_000);
    let started = Instant::now();
    let mut worst = Duration::ZERO;
    loop {
        worst = worst.max(api_latency(&agent));
        let loaded = agent.json("/debug/ipcache").as_array().map_or(0, Vec::len);
        if loaded >= 40_000 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "only {loaded} of 40,000 pods after 120 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(worst < Duration::from_secs(2), "the API took {worst:?}");

    // A second large load is under way when SIGTERM comes: the agent stops promptly.
    write_pods(&agent.manifests().join("more.yaml"), 40_000);
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    agent.stop();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "SIGTERM took {:?}",
        t.elapsed()
    );
}

const WEB_SERVICE: &str = "\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.80
  ports: [{name: http, port: 443, targetPort: 8443, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8443, protocol: TCP}]
endpoints:
- {addresses: [10.9.0.7]}
- {addresses: [127.0.0.1]}
";

/// `ciliate service list -o json`: the backends of `frontend`.
fn backends(agent: &Agent, frontend: &str) -> Vec<String> {
    let list = agent.cli_json(&["service", "list"]);
    list.as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["frontend"] == frontend)
        .flat_map(|f| f["backends"].as_array().cloned().unwrap_or_default())
        .map(|b| format!("{}:{}", b["ip"].as_str().unwrap_or(""), b["port"]))
        .collect()
}

#[test]
fn a_loopback_backend_in_an_endpoint_slice_is_refused_by_name_and_the_rest_is_used() {
    let (_dir, agent) = start(&[("policies.yaml", SHOP), ("web.yaml", WEB_SERVICE)]);
    agent.wait_until("the service has its backend", || {
        !backends(&agent, "10.96.0.80:443/TCP").is_empty()
    });
    assert_eq!(
        backends(&agent, "10.96.0.80:443/TCP"),
        ["10.9.0.7:8443"],
        "the pod's own loopback is no backend"
    );
    let said = r#"EndpointSlice shop/web-1: endpoints[1].addresses[0]: "127.0.0.1" is loopback (127.0.0.0/8); not a backend"#;
    agent.wait_until("the refusal is in the manifest status", || {
        manifest_errors(&agent)
            .values()
            .any(|e| e.as_str() == Some(said))
    });
    assert!(agent.log().contains(said), "and in the log");

    // Fixed: the status clears.
    std::fs::write(
        agent.manifests().join("web.yaml"),
        WEB_SERVICE.replace(
            "- {addresses: [127.0.0.1]}\n",
            "- {addresses: [10.9.0.8]}\n",
        ),
    )
    .unwrap();
    agent.wait_until("the fixed slice is used and its error goes", || {
        backends(&agent, "10.96.0.80:443/TCP").len() == 2 && manifest_errors(&agent).is_empty()
    });
}
