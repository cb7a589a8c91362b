//! Pods created through the CNI plugin on the agent's BPF datapath, tested with real TCP, UDP
//! and ICMP between network namespaces: policy verdicts, replies under default deny both ways,
//! a live policy edit, `kill -9` of the agent, a restart that restores every endpoint with the
//! same address and identity without breaking an allowed flow, and CNI DEL cleaning up.
//! Privileged: with CI=true these tests must run.

mod common;

use common::eventually;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::agent::Agent;
use common::cni::{cni, unique_pod_cidr, CniPods};
use common::netns::{icmp_ok, privileged, tcp_ok, tcp_server, udp_ok, udp_server};

const CLUSTER: &str = "apiVersion: v1
kind: Namespace
metadata: {name: x}
---
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x, labels: {app: a}}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: x, labels: {app: b}}
---
apiVersion: v1
kind: Pod
metadata: {name: c, namespace: x, labels: {app: c}}
";

/// a: ingress isolated, egress only to b. b: egress isolated, ingress from a on TCP `PORT`
/// and UDP 5353, and ICMP echo from a. So every allowed connection's replies cross a
/// default-deny direction on both ends.
const POLICIES: &str = "apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a, namespace: x}
spec:
  podSelector: {matchLabels: {app: a}}
  policyTypes: [Ingress, Egress]
  egress:
    - to: [{podSelector: {matchLabels: {app: b}}}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: b, namespace: x}
spec:
  podSelector: {matchLabels: {app: b}}
  policyTypes: [Ingress, Egress]
  ingress:
    - from: [{podSelector: {matchLabels: {app: a}}}]
      ports: [{port: PORT, protocol: TCP}, {port: 5353, protocol: UDP}]
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: b-echo, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: b}}
  ingress:
    - fromEndpoints: [{matchLabels: {app: a}}]
      icmps: [{fields: [{type: 8, family: IPv4}]}]
";

fn ipam_allocated(agent: &Agent) -> u64 {
    agent.cli_json(&["status"])["ipam"]["allocated"]
        .as_u64()
        .expect("status shows IPAM")
}

#[test]
fn pods_created_through_cni_are_enforced_survive_kill_9_and_restart_and_are_deleted_cleanly() {
    if !privileged() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    std::fs::write(m.join("cluster.yaml"), CLUSTER).unwrap();
    std::fs::write(m.join("policy.yaml"), POLICIES.replace("PORT", "8080")).unwrap();
    let cidr = unique_pod_cidr();
    let pins = format!("/sys/fs/bpf/ciliate-cni-{}", std::process::id());
    let args = [
        "--datapath",
        "bpf",
        "--bpf-root",
        pins.as_str(),
        "--pod-cidr",
        cidr.as_str(),
    ];
    let mut agent = Agent::start_with(tmp.path(), &args);
    // Declared after the agent: dropped (CNI DEL, namespaces removed) while it still runs.
    let mut pods = CniPods::new(&agent.socket(), std::path::Path::new(&pins));

    // A failed ADD leaves nothing behind.
    let (code, err) = cni(
        &agent.socket(),
        "ADD",
        "ctr-no-netns",
        Some("no-such-netns-ciliate"),
        Some(("x", "a")),
    );
    assert_eq!(code, 1, "{err}");
    assert_eq!(err["code"], 100, "{err}");
    assert!(
        err["details"]
            .as_str()
            .unwrap_or("")
            .contains("no-such-netns-ciliate"),
        "the error names the namespace: {err}"
    );
    assert_eq!(
        ipam_allocated(&agent),
        0,
        "the failed ADD's address is released"
    );
    let (code, err) = cni(&agent.socket(), "ADD", "ctr-anon", Some("x"), None);
    assert_eq!((code, err["code"].as_u64()), (1, Some(4)), "{err}");

    let a = pods.add("x", "a");
    let b = pods.add("x", "b");
    let c = pods.add("x", "c");
    let net: ipnet::Ipv4Net = cidr.parse().unwrap();
    for p in [&a, &b, &c] {
        assert!(
            net.contains(&p.addr),
            "{} is from the pod CIDR {cidr}",
            p.addr
        );
    }
    assert_eq!(ipam_allocated(&agent), 3);
    // CHECK agrees with what ADD made.
    let (code, v) = cni(
        &agent.socket(),
        "CHECK",
        &a.container_id,
        Some(&a.netns),
        Some(("x", "a")),
    );
    assert_eq!(code, 0, "CHECK: {v}");

    for port in [8080, 9090] {
        tcp_server(&b.netns, b.addr.into(), port);
        tcp_server(&a.netns, a.addr.into(), port);
        tcp_server(&c.netns, c.addr.into(), port);
    }
    udp_server(&b.netns, b.addr.into(), 5353);
    udp_server(&b.netns, b.addr.into(), 5354);
    udp_server(&a.netns, a.addr.into(), 5353);

    // ADD returned after the first policy was realized: enforcement is immediate.
    let verdicts = |port: u16| {
        assert!(
            tcp_ok(&a.netns, b.addr.into(), port),
            "a -> b TCP {port}, replies through two default denies"
        );
        assert!(
            udp_ok(&a.netns, b.addr.into(), 5353),
            "a -> b UDP 5353 and its reply"
        );
        assert!(icmp_ok(&a.netns, b.addr), "a -> b ICMP echo and its reply");
        assert!(
            !udp_ok(&a.netns, b.addr.into(), 5354),
            "a -> b UDP 5354 is not allowed"
        );
        assert!(
            !tcp_ok(&c.netns, b.addr.into(), port),
            "c -> b is not allowed"
        );
        assert!(!icmp_ok(&c.netns, b.addr), "c -> b ICMP is not allowed");
        assert!(
            !tcp_ok(&b.netns, a.addr.into(), port),
            "b's egress is isolated"
        );
        assert!(
            !udp_ok(&b.netns, a.addr.into(), 5353),
            "b's egress is isolated (UDP)"
        );
        assert!(
            !tcp_ok(&a.netns, c.addr.into(), port),
            "a's egress reaches only b"
        );
        assert!(
            !tcp_ok(&c.netns, a.addr.into(), port),
            "a's ingress is isolated"
        );
        assert!(
            !tcp_ok(&b.netns, c.addr.into(), port),
            "b's egress is isolated"
        );
    };
    verdicts(8080);
    assert!(!tcp_ok(&a.netns, b.addr.into(), 9090), "only 8080 into b");

    // A live edit.
    std::fs::write(m.join("policy.yaml"), POLICIES.replace("PORT", "9090")).unwrap();
    eventually("9090 is allowed into b", || {
        tcp_ok(&a.netns, b.addr.into(), 9090)
    });
    assert!(!tcp_ok(&a.netns, b.addr.into(), 8080), "8080 no longer");
    verdicts(9090);
    let before = agent.json("/debug/endpoints");

    // kill -9: the kernel keeps enforcing.
    let mut child = agent.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        tcp_ok(&a.netns, b.addr.into(), 9090),
        "allowed while the agent is dead"
    );
    assert!(
        !tcp_ok(&a.netns, b.addr.into(), 8080),
        "denied while the agent is dead"
    );
    assert!(
        !tcp_ok(&c.netns, b.addr.into(), 9090),
        "denied while the agent is dead"
    );

    // Restart with a prober on the allowed flow.
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(AtomicU32::new(0));
    let prober = {
        let (stop, failures, ns, to) = (stop.clone(), failures.clone(), a.netns.clone(), b.addr);
        std::thread::spawn(move || {
            let mut probes = 0;
            while !stop.load(Ordering::SeqCst) {
                if !tcp_ok(&ns, to.into(), 9090) {
                    failures.fetch_add(1, Ordering::SeqCst);
                }
                probes += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            probes
        })
    };
    let restarted = Agent::start_with(tmp.path(), &args);
    restarted.wait_realized(restarted.revision());
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    let probes = prober.join().unwrap();
    assert!(probes > 3, "the prober ran ({probes} probes)");
    assert_eq!(
        failures.load(Ordering::SeqCst),
        0,
        "an allowed flow broke during the restart"
    );
    let after = restarted.json("/debug/endpoints");
    assert_eq!(after.as_array().map(Vec::len), Some(3), "{after}");
    for (x, y) in before
        .as_array()
        .unwrap()
        .iter()
        .zip(after.as_array().unwrap())
    {
        assert_eq!(
            (
                &x["id"],
                &x["identity"],
                &x["ips"],
                &x["interface"],
                &x["container_id"]
            ),
            (
                &y["id"],
                &y["identity"],
                &y["ips"],
                &y["interface"],
                &y["container_id"]
            ),
        );
    }
    assert_eq!(
        ipam_allocated(&restarted),
        3,
        "restored addresses are reserved"
    );
    verdicts(9090);
    // A new pod after the restart never gets a restored address.
    let d = pods.add("x", "c2");
    assert!(
        ![a.addr, b.addr, c.addr].contains(&d.addr),
        "{} reused",
        d.addr
    );

    // CNI DEL: veth, address and policy map go; a second DEL is fine.
    let b_id = after
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "x/b")
        .unwrap()["id"]
        .as_u64()
        .unwrap();
    let (code, v) = pods.del(&b);
    assert_eq!(code, 0, "DEL: {v}");
    assert!(
        !std::path::Path::new(&format!("/sys/class/net/{}", b.host_if)).exists(),
        "b's veth is gone"
    );
    assert!(
        !std::path::Path::new(&format!("{pins}/ciliate/policy_{b_id}")).exists(),
        "b's policy map is unpinned"
    );
    assert_eq!(
        ipam_allocated(&restarted),
        3,
        "b's address is released (a, c, c2 left)"
    );
    let (code, v) = pods.del(&b);
    assert_eq!(code, 0, "a second DEL succeeds: {v}");
    let (code, v) = cni(
        &restarted.socket(),
        "CHECK",
        &b.container_id,
        Some(&b.netns),
        None,
    );
    assert_eq!(
        (code, v["code"].as_u64()),
        (1, Some(3)),
        "CHECK of a deleted pod: {v}"
    );
    assert!(
        !tcp_ok(&a.netns, c.addr.into(), 9090),
        "the others are still enforced"
    );
    drop(pods);
    drop(restarted);
    drop(agent);
}
