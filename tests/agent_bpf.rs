//! The agent binary with `--datapath bpf` on real veths: a policy written on disk is enforced on
//! real traffic between network-namespace pods, edited live, survives `kill -9` of the agent,
//! and a restarted agent restores every endpoint (same id, identity, address) without breaking
//! an allowed flow. Privileged: with CI=true these tests must run.

mod common;

use common::eventually;

use std::time::Duration;

use common::agent::Agent;
use common::netns::{privileged_two_pods, tcp_ok};

fn manifests(a: &str, b: &str, port: u16) -> (String, String) {
    let cluster = common::namespace_x_with_pods(&[("a", a), ("b", b)]);
    let policy = format!(
        "apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {{name: b-from-a, namespace: x}}
spec:
  endpointSelector: {{matchLabels: {{app: b}}}}
  ingress:
    - fromEndpoints: [{{matchLabels: {{app: a}}}}]
      toPorts: [{{ports: [{{port: '{port}', protocol: TCP}}]}}]
"
    );
    (cluster, policy)
}

use common::wait_output;

#[test]
fn the_agent_enforces_on_real_veths_and_survives_kill_9() {
    let Some(w) = privileged_two_pods(&[8080, 9090]) else {
        return;
    };
    let (a, b) = (&w.pods[0], &w.pods[1]);

    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    let (cluster, policy) = manifests(&a.addr.to_string(), &b.addr.to_string(), 8080);
    std::fs::write(m.join("cluster.yaml"), cluster).unwrap();
    std::fs::write(m.join("policy.yaml"), &policy).unwrap();
    let pins = w.pins.to_string_lossy().to_string();
    let args = ["--datapath", "bpf", "--bpf-root", pins.as_str()];

    let mut agent = Agent::start_with(tmp.path(), &args);
    for (name, pod) in [("x/a", a), ("x/b", b)] {
        agent.add_endpoint(name, pod.addr, &pod.host_if);
    }
    agent.wait_realized(agent.revision());
    assert!(
        tcp_ok(&a.netns, b.addr, 8080),
        "the policy allows a -> b:8080"
    );
    assert!(!tcp_ok(&a.netns, b.addr, 9090), "and nothing else into b");
    // `ciliate monitor` shows the drop of a denied connection.
    let mon = std::process::Command::new(common::agent::BIN)
        .args([
            "monitor",
            "--count",
            "1",
            "--verdict",
            "dropped",
            "-o",
            "json",
            "--socket",
        ])
        .arg(agent.socket())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(!tcp_ok(&a.netns, b.addr, 9090));
    let out = wait_output(mon, Duration::from_secs(10));
    let ev: serde_json::Value = serde_json::from_str(out.lines().next().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {out:?}"));
    assert_eq!(
        (ev["verdict"].as_str(), ev["reason"].as_str()),
        (Some("dropped"), Some("default-deny")),
        "{ev}"
    );
    assert_eq!(
        ev["policies"][0]["name"], "b-from-a",
        "the drop names the policy: {ev}"
    );
    assert_eq!(
        (
            ev["port"].as_u64(),
            ev["direction"].as_str(),
            ev["endpoint"].as_u64()
        ),
        (Some(9090), Some("ingress"), Some(2)),
        "{ev}"
    );
    assert_eq!(ev["destination"], b.addr.to_string());
    let status = agent.cli_json(&["status"]);
    assert_eq!(status["datapath"], "bpf");
    // The realized entries and their counters come from the kernel map.
    let dump = agent.cli_json(&["bpf", "policy", "get", "2"]);
    assert!(
        dump["entries"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["port"] == 8080 && e["packets"].as_u64() >= Some(1)),
        "{dump}"
    );

    // A live edit on disk.
    std::fs::write(m.join("policy.yaml"), policy.replace("8080", "9090")).unwrap();
    let rev = agent.revision();
    agent.wait_until("the edit is applied", || agent.revision() > rev);
    agent.wait_realized(agent.revision());
    eventually("9090 is allowed", || tcp_ok(&a.netns, b.addr, 9090));
    assert!(!tcp_ok(&a.netns, b.addr, 8080));
    let before = agent.json("/debug/endpoints");

    // kill -9: the kernel keeps enforcing.
    let mut child = agent.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        tcp_ok(&a.netns, b.addr, 9090),
        "allowed flows keep working while the agent is dead"
    );
    assert!(
        !tcp_ok(&a.netns, b.addr, 8080),
        "denied flows stay denied while the agent is dead"
    );

    // Restart: every endpoint comes back the same, and the allowed flow is never broken.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failures = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let prober = {
        let (stop, failures, ns, to) = (stop.clone(), failures.clone(), a.netns.clone(), b.addr);
        std::thread::spawn(move || {
            let mut probes = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if !tcp_ok(&ns, to, 9090) {
                    failures.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                probes += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            probes
        })
    };
    let agent = Agent::start_with(tmp.path(), &args);
    agent.wait_realized(agent.revision());
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let probes = prober.join().unwrap();
    assert!(probes > 3, "the prober ran ({probes} probes)");
    assert_eq!(
        failures.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "an allowed flow broke during the restart"
    );
    let after = agent.json("/debug/endpoints");
    common::assert_same_endpoints(&before, &after);
    assert!(tcp_ok(&a.netns, b.addr, 9090));
    assert!(!tcp_ok(&a.netns, b.addr, 8080));

    // Deleting the endpoints detaches the programs and unpins their maps.
    for id in ["1", "2"] {
        let (code, _, err) = agent.cli(&["endpoint", "delete", id]);
        assert_eq!(code, 0, "{err}");
    }
    eventually("b is reachable again without policy", || {
        tcp_ok(&a.netns, b.addr, 8080)
    });
    eventually("b's policy map is unpinned", || {
        !w.pins.join("ciliate/policy_2").exists()
    });
}
