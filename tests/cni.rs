//! Pods created through the CNI plugin on the agent's BPF datapath, tested with real TCP, UDP
//! and ICMP between network namespaces: policy verdicts, replies under default deny both ways,
//! a live policy edit, `kill -9` of the agent, a restart that restores every endpoint with the
//! same address and identity without breaking an allowed flow, and CNI DEL cleaning up.
//! Privileged: with CI=true these tests must run.

mod common;

use common::eventually;

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::agent::Agent;
use common::cni::{cni, unique_pod_cidr, CniPods};
use common::netns::{icmp_ok, ip, privileged, tcp_ok, tcp_server, udp_ok, udp_server};

/// Namespace x with pods a, b and c (addresses from the CNI plugin).
fn cluster() -> String {
    common::namespace_x(&[("a", "a", None), ("b", "b", None), ("c", "c", None)])
}

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
      icmps: [{fields: [{type: 8, family: IPv4}, {type: 128, family: IPv6}]}]
";

fn ipam_allocated(agent: &Agent) -> u64 {
    agent.cli_json(&["status"])["ipam"]["allocated"]
        .as_u64()
        .expect("status shows IPAM")
}

/// An agent with the BPF datapath (pins under `/sys/fs/bpf/ciliate-TAG-PID`) and a pod CIDR of
/// its own, on `cluster()` and POLICIES with b open to a on 8080: the directory, the pins, the
/// arguments (to restart it) and the agent.
fn bpf_agent(tag: &str) -> (tempfile::TempDir, String, Vec<String>, Agent) {
    bpf_agent_with(tag, &[])
}

/// `bpf_agent` with `extra` agent flags.
fn bpf_agent_with(tag: &str, extra: &[&str]) -> (tempfile::TempDir, String, Vec<String>, Agent) {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    std::fs::write(m.join("cluster.yaml"), cluster()).unwrap();
    std::fs::write(m.join("policy.yaml"), POLICIES.replace("PORT", "8080")).unwrap();
    let pins = format!("/sys/fs/bpf/ciliate-{tag}-{}", std::process::id());
    let args: Vec<String> = [
        "--datapath",
        "bpf",
        "--bpf-root",
        &pins,
        "--pod-cidr",
        &unique_pod_cidr(),
    ]
    .map(String::from)
    .into_iter()
    .chain(extra.iter().map(|a| a.to_string()))
    .collect();
    let agent = Agent::start_with(
        tmp.path(),
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    (tmp, pins, args, agent)
}

/// `--enable-ipv6`: each pod gets an address of each family from the pods' two `--pod-cidr`s;
/// the CNI result lists both (with their gateways and default routes), the pod's interface
/// holds both, and the same policies judge IPv6 connections as IPv4 ones (real TCP between
/// namespaces through the BPF programs), and ICMPv6 rules admit exactly their types. DEL gives
/// both addresses back; a `kill -9` and a restart keep the IPv6 reservations and the IPv6
/// flows' verdicts.
#[test]
fn dual_stack_pods_get_one_address_per_family_and_ipv6_is_judged_as_ipv4_is() {
    if !privileged() {
        return;
    }
    let cidr6 = format!("fd00:{:x}:6::/112", std::process::id() % 0xffff);
    let (tmp, pins, args, mut agent) =
        bpf_agent_with("dual", &["--pod-cidr", &cidr6, "--enable-ipv6=true"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut pods = CniPods::new(&agent.socket(), std::path::Path::new(&pins));
    let (a, b, c) = (pods.add("x", "a"), pods.add("x", "b"), pods.add("x", "c"));
    let net6: ipnet::Ipv6Net = cidr6.parse().unwrap();
    for p in [&a, &b, &c] {
        let v6 = p
            .addr6
            .unwrap_or_else(|| panic!("{}: no IPv6 address", p.name));
        assert!(net6.contains(&v6), "{v6} is from {cidr6}");
        let held = std::process::Command::new("ip")
            .args(["-n", &p.netns, "-6", "addr", "show", "dev", "eth0"])
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&held.stdout).contains(&format!("{v6}/128")),
            "{} holds {v6}: {}",
            p.name,
            String::from_utf8_lossy(&held.stdout)
        );
    }
    // The result's shape: one address per family, each with its gateway and default route.
    let (code, again) = cni(
        &agent.socket(),
        "ADD",
        &a.container_id,
        Some(&a.netns),
        Some(("x", "a")),
    );
    assert_eq!(code, 0, "a repeated ADD answers with what exists: {again}");
    assert_eq!(again["ips"][1]["gateway"], "fe80::1", "{again}");
    assert_eq!(again["ips"][0]["gateway"], "169.254.1.1", "{again}");
    let dsts: Vec<&str> = again["routes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["dst"].as_str())
        .collect();
    assert_eq!(dsts, ["0.0.0.0/0", "::/0"], "{again}");
    let (code, v) = cni(
        &agent.socket(),
        "CHECK",
        &b.container_id,
        Some(&b.netns),
        Some(("x", "b")),
    );
    assert_eq!(code, 0, "CHECK sees both addresses: {v}");
    let status = agent.cli_json(&["status"]);
    assert_eq!(status["ipam_ipv6"]["pod_cidr"], cidr6, "{status}");
    assert_eq!(status["ipam_ipv6"]["allocated"], 3, "{status}");
    assert_eq!(status["ipam"]["allocated"], 3, "{status}");
    // `endpoint list` shows both of a pod's addresses.
    let endpoints = agent.cli_json(&["endpoint", "list"]);
    let a_ips = endpoints
        .as_array()
        .and_then(|l| l.iter().find(|e| e["name"] == "x/a"))
        .map(|e| e["ips"].clone())
        .unwrap_or_else(|| panic!("a is listed: {endpoints}"));
    let (a4s, a6s) = (a.addr.to_string(), a.addr6.unwrap().to_string());
    assert!(
        a_ips.as_array().is_some_and(|l| l.len() == 2
            && l.iter().any(|i| i == a4s.as_str())
            && l.iter().any(|i| i == a6s.as_str())),
        "{a_ips}"
    );

    let (a6, b6) = (a.addr6.unwrap(), b.addr6.unwrap());
    for port in [8080, 9090] {
        tcp_server(&b.netns, b6.into(), port);
        tcp_server(&b.netns, b.addr.into(), port);
    }
    tcp_server(&a.netns, a6.into(), 8080);
    let verdicts = |label: &str| {
        assert!(
            tcp_ok(&a.netns, b6.into(), 8080),
            "{label}: a -> b over IPv6 on 8080 is allowed"
        );
        assert!(
            !tcp_ok(&a.netns, b6.into(), 9090),
            "{label}: a -> b over IPv6 on 9090 is not"
        );
        assert!(
            !tcp_ok(&c.netns, b6.into(), 8080),
            "{label}: c -> b over IPv6 is not (b admits a only)"
        );
        assert!(
            !tcp_ok(&b.netns, a6.into(), 8080),
            "{label}: b -> a over IPv6 is not (a is isolated, and b may send only replies)"
        );
        assert!(
            tcp_ok(&a.netns, b.addr.into(), 8080) && !tcp_ok(&a.netns, b.addr.into(), 9090),
            "{label}: IPv4 as before"
        );
        // ICMPv6: the echo request type b admits from a (its reply is a reply), nothing else.
        assert!(
            icmp_ok(&a.netns, b6),
            "{label}: a -> b ICMPv6 echo (type 128) and its reply"
        );
        assert!(
            !icmp_ok(&c.netns, b6),
            "{label}: c -> b ICMPv6 echo is not allowed"
        );
        assert!(
            !icmp_ok(&b.netns, a6),
            "{label}: b -> a ICMPv6 echo is not (a is isolated)"
        );
        assert!(icmp_ok(&a.netns, b.addr), "{label}: ICMP echo over IPv4");
    };
    verdicts("enforced");
    // The datapath reports c's IPv6 connections to b as drops of b's policy.
    // The flows name the pods of both families' addresses.
    let flows = agent.json("/debug/flows?from=x/c&to=x/b&port=8080&limit=1000");
    let dropped6 = flows.as_array().is_some_and(|f| {
        f.iter().any(|e| {
            e["verdict"] == "dropped"
                && e["match"] == "default-deny"
                && e["destination"] == b6.to_string()
                && e["source_pod"] == "x/c"
                && e["destination_pod"] == "x/b"
        })
    });
    assert!(dropped6, "c's IPv6 drop into b is reported: {flows}");

    // DEL gives both addresses back.
    let (code, v) = pods.del(&c);
    assert_eq!(code, 0, "DEL: {v}");
    let status = agent.cli_json(&["status"]);
    assert_eq!(status["ipam_ipv6"]["allocated"], 2, "{status}");
    assert_eq!(status["ipam"]["allocated"], 2, "{status}");

    // kill -9 and a restart: the IPv6 addresses stay reserved and the verdicts hold.
    let mut child = agent.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        tcp_ok(&a.netns, b6.into(), 8080) && !tcp_ok(&a.netns, b6.into(), 9090),
        "the kernel judges IPv6 while the agent is dead"
    );
    agent = Agent::start_with(tmp.path(), &args);
    agent.wait_realized(agent.revision());
    let status = agent.cli_json(&["status"]);
    assert_eq!(status["ipam_ipv6"]["allocated"], 2, "restored: {status}");
    eventually("IPv6 verdicts after the restart", || {
        tcp_ok(&a.netns, b6.into(), 8080)
    });
    verdicts("restarted");
    drop(pods);
}

/// `--enable-ipv4=false --enable-ipv6=true` (an IPv6-only node): each pod gets one IPv6
/// address and the IPv6 default route only, the agent serves no IPv4 pool, and the policies
/// judge TCP and ICMPv6 as on any node; `kill -9` and a restart keep the addresses and the
/// verdicts.
#[test]
fn ipv6_only_pods_get_one_ipv6_address_and_are_judged_as_ipv4_pods_are() {
    if !privileged() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    std::fs::write(m.join("cluster.yaml"), cluster()).unwrap();
    std::fs::write(m.join("policy.yaml"), POLICIES.replace("PORT", "8080")).unwrap();
    let pins = format!("/sys/fs/bpf/ciliate-v6only-{}", std::process::id());
    let cidr6 = format!("fd00:{:x}:7::/112", std::process::id() % 0xffff);
    let args = [
        "--datapath",
        "bpf",
        "--bpf-root",
        &pins,
        "--pod-cidr",
        &cidr6,
        "--enable-ipv4=false",
        "--enable-ipv6=true",
    ];
    let mut agent = Agent::start_with(tmp.path(), &args);
    let mut pods = CniPods::new(&agent.socket(), std::path::Path::new(&pins));
    let (a, b, c) = (pods.add("x", "a"), pods.add("x", "b"), pods.add("x", "c"));
    let (code, result) = cni(
        &agent.socket(),
        "ADD",
        &a.container_id,
        Some(&a.netns),
        Some(("x", "a")),
    );
    assert_eq!(code, 0, "{result}");
    assert_eq!(result["ips"].as_array().map(Vec::len), Some(1), "{result}");
    assert_eq!(result["ips"][0]["gateway"], "fe80::1", "{result}");
    let dsts: Vec<&str> = result["routes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["dst"].as_str())
        .collect();
    assert_eq!(dsts, ["::/0"], "{result}");
    let held = std::process::Command::new("ip")
        .args(["-n", &a.netns, "-4", "addr", "show", "dev", "eth0"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&held.stdout).contains("inet "),
        "a holds no IPv4 address: {}",
        String::from_utf8_lossy(&held.stdout)
    );
    let status = agent.cli_json(&["status"]);
    assert!(status["ipam"].is_null(), "no IPv4 pool: {status}");
    assert_eq!(status["ipam_ipv6"]["allocated"], 3, "{status}");

    let (a6, b6, c6) = (a.addr6.unwrap(), b.addr6.unwrap(), c.addr6.unwrap());
    for port in [8080, 9090] {
        tcp_server(&b.netns, b6.into(), port);
    }
    tcp_server(&a.netns, a6.into(), 8080);
    tcp_server(&c.netns, c6.into(), 8080);
    let verdicts = |label: &str| {
        assert!(tcp_ok(&a.netns, b6.into(), 8080), "{label}: a -> b 8080");
        assert!(!tcp_ok(&a.netns, b6.into(), 9090), "{label}: a -> b 9090");
        assert!(!tcp_ok(&c.netns, b6.into(), 8080), "{label}: c -> b");
        assert!(!tcp_ok(&b.netns, a6.into(), 8080), "{label}: b -> a");
        assert!(
            !tcp_ok(&a.netns, c6.into(), 8080),
            "{label}: a may reach only b"
        );
        assert!(!tcp_ok(&c.netns, a6.into(), 8080), "{label}: a is isolated");
        assert!(icmp_ok(&a.netns, b6), "{label}: a -> b ICMPv6 echo");
        assert!(!icmp_ok(&c.netns, b6), "{label}: c -> b ICMPv6 echo");
    };
    verdicts("enforced");
    let mut child = agent.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    verdicts("agent killed");
    agent = Agent::start_with(tmp.path(), &args);
    agent.wait_realized(agent.revision());
    let status = agent.cli_json(&["status"]);
    assert_eq!(status["ipam_ipv6"]["allocated"], 3, "restored: {status}");
    verdicts("restarted");
    let (code, v) = pods.del(&c);
    assert_eq!(code, 0, "DEL: {v}");
    assert_eq!(agent.cli_json(&["status"])["ipam_ipv6"]["allocated"], 2);
    drop(pods);
}

/// TCP connections from `netns` to `to:port` every 20 ms until stopped: how many were made and
/// how many failed (an allowed flow must never break while an agent restarts).
struct Prober {
    stop: Arc<AtomicBool>,
    failures: Arc<AtomicU32>,
    thread: std::thread::JoinHandle<u32>,
}

impl Prober {
    fn start(netns: &str, to: Ipv4Addr, port: u16) -> Prober {
        let stop = Arc::new(AtomicBool::new(false));
        let failures = Arc::new(AtomicU32::new(0));
        let (s, f, ns) = (stop.clone(), failures.clone(), netns.to_string());
        let thread = std::thread::spawn(move || {
            let mut probes = 0;
            while !s.load(Ordering::SeqCst) {
                if !tcp_ok(&ns, to.into(), port) {
                    f.fetch_add(1, Ordering::SeqCst);
                }
                probes += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            probes
        });
        Prober {
            stop,
            failures,
            thread,
        }
    }

    /// (probes, failures).
    fn stop(self) -> (u32, u32) {
        self.stop.store(true, Ordering::SeqCst);
        let probes = self.thread.join().unwrap();
        (probes, self.failures.load(Ordering::SeqCst))
    }
}

#[test]
fn pods_created_through_cni_are_enforced_survive_kill_9_and_restart_and_are_deleted_cleanly() {
    let Some((tmp, pins, args, mut agent)) = privileged().then(|| bpf_agent("cni")) else {
        return;
    };
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let m = tmp.path().join("manifests");
    let cidr = args[5].to_string();
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
    let prober = Prober::start(&a.netns, b.addr, 9090);
    let restarted = Agent::start_with(tmp.path(), &args);
    restarted.wait_realized(restarted.revision());
    std::thread::sleep(Duration::from_millis(300));
    let (probes, failures) = prober.stop();
    assert!(probes > 3, "the prober ran ({probes} probes)");
    assert_eq!(failures, 0, "an allowed flow broke during the restart");
    let after = restarted.json("/debug/endpoints");
    assert_eq!(after.as_array().map(Vec::len), Some(3), "{after}");
    common::assert_same_endpoints(&before, &after);
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

/// The interfaces of the host namespace whose alias is `mark`: the devices an agent made.
fn marked(mark: &str) -> BTreeSet<String> {
    std::fs::read_dir("/sys/class/net")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("ifalias")).is_ok_and(|a| a.trim_end() == mark)
        })
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect()
}

/// An agent with the memory datapath and a pod CIDR of its own on a fresh directory holding
/// `cluster`: the directory, the agent, its arguments (to restart it), its veth mark, and a
/// guard that deletes whatever still carries the mark when the test ends, even on failure.
fn memory_agent(cluster: &str) -> (tempfile::TempDir, Agent, Vec<String>, String, SweepMarked) {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    std::fs::write(m.join("cluster.yaml"), cluster).unwrap();
    let args: Vec<String> = ["--datapath", "memory", "--pod-cidr", &unique_pod_cidr()]
        .map(String::from)
        .into();
    let agent = Agent::start_with(
        tmp.path(),
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let mark = ciliate::datapath::netdev::agent_mark(&tmp.path().join("state"));
    let sweep = SweepMarked(mark.clone());
    (tmp, agent, args, mark, sweep)
}

/// Deletes whatever still carries the agent's mark when the test ends, even on failure.
struct SweepMarked(String);

impl Drop for SweepMarked {
    fn drop(&mut self) {
        for name in marked(&self.0) {
            let _ = std::process::Command::new("ip")
                .args(["link", "del", &name])
                .output();
        }
    }
}

/// The global IPv4 addresses inside a network namespace.
fn addresses_in(netns: &str) -> Vec<Ipv4Addr> {
    let out = std::process::Command::new("ip")
        .args(["-n", netns, "-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .expect("iproute2");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            w.position(|x| x == "inet")?;
            w.next()?.split('/').next()?.parse().ok()
        })
        .collect()
}

fn result_addr(v: &serde_json::Value) -> Option<Ipv4Addr> {
    v["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.strip_suffix("/32"))
        .and_then(|a| a.parse().ok())
}

/// Runs CNI ADD for every (container, netns, pod) at once: one plugin process each.
fn concurrent_adds(
    socket: &std::path::Path,
    pods: &[(String, String, String)],
    done: &Arc<AtomicU32>,
) -> Vec<std::thread::JoinHandle<(i32, serde_json::Value)>> {
    pods.iter()
        .cloned()
        .map(|(cid, ns, name)| {
            let (socket, done) = (socket.to_path_buf(), done.clone());
            std::thread::spawn(move || {
                let r = cni(&socket, "ADD", &cid, Some(&ns), Some(("x", &name)));
                done.fetch_add(1, Ordering::SeqCst);
                r
            })
        })
        .collect()
}

fn many_pods(n: usize) -> String {
    let mut s = String::from(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: same-namespace, namespace: x}
spec:
  podSelector: {}
  ingress: [{from: [{podSelector: {}}]}]
",
    );
    for i in 0..n {
        s.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: p{i}, namespace: x, labels: {{app: p{i}}}}}\n"
        ));
    }
    s
}

/// Issue #16, item 6: `kill -9` of the agent during 50 concurrent CNI ADDs. The restarted agent
/// leaves no veth of its own that no endpoint owns, no address is held by two pods, the
/// interrupted plugins said "try again later" (11), and every retried ADD succeeds.
#[test]
fn kill_9_during_fifty_concurrent_adds_leaves_nothing_unreclaimed() {
    if !privileged() {
        return;
    }
    const N: usize = 50;
    let (tmp, mut agent, args, mark, _sweep) = memory_agent(&many_pods(N));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let state = tmp.path().join("state");
    let mut pods = CniPods::new(&agent.socket(), &tmp.path().join("no-pins"));
    let specs: Vec<(String, String, String)> = (0..N)
        .map(|i| {
            let name = format!("p{i}");
            let ns = pods.netns(&name);
            (format!("ctr-{}-{name}", pods.tag), ns, name)
        })
        .collect();

    // 50 ADDs at once; the agent is killed while some are done and others in flight.
    let done = Arc::new(AtomicU32::new(0));
    let adds = concurrent_adds(&agent.socket(), &specs, &done);
    let intents = state.join("cni-adds");
    let in_flight = || {
        std::fs::read_dir(&intents)
            .map(|d| d.flatten().count())
            .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !(done.load(Ordering::SeqCst) >= 5 && in_flight() > 0) {
        assert!(
            std::time::Instant::now() < deadline,
            "never 5 ADDs done with others in flight"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut child = agent.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let outcomes: Vec<(i32, serde_json::Value)> =
        adds.into_iter().map(|h| h.join().unwrap()).collect();
    let succeeded: BTreeMap<usize, Ipv4Addr> = outcomes
        .iter()
        .enumerate()
        .filter(|(_, (code, _))| *code == 0)
        .map(|(i, (_, v))| (i, result_addr(v).expect("a result has an address")))
        .collect();
    for (i, (code, v)) in outcomes.iter().enumerate() {
        if *code != 0 {
            assert_eq!(
                (*code, v["code"].as_u64()),
                (1, Some(11)),
                "ADD of p{i} interrupted by the crash: try again later, not {v}"
            );
        }
    }
    let interrupted = N - succeeded.len();
    assert!(
        interrupted > 0,
        "the kill came after every ADD had finished"
    );
    eprintln!(
        "crash: {} ADDs done, {interrupted} interrupted; left behind: {} marked veths, {} ADD records",
        succeeded.len(),
        marked(&mark).len(),
        in_flight()
    );

    // The restart reclaims what the interrupted ADDs made.
    let restarted = Agent::start_with(tmp.path(), &args);
    assert_eq!(in_flight(), 0, "every ADD record is rolled back or settled");
    let endpoints = restarted.json("/debug/endpoints");
    let owned: BTreeSet<String> = endpoints
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["interface"].as_str().map(str::to_string))
        .collect();
    assert_eq!(
        marked(&mark),
        owned,
        "the agent's veths are exactly its endpoints' (no orphans)"
    );
    assert!(
        endpoints.as_array().unwrap().len() >= succeeded.len(),
        "every finished ADD is restored: {endpoints}"
    );
    let mut holders: BTreeMap<Ipv4Addr, Vec<&str>> = BTreeMap::new();
    for (cid, ns, _) in &specs {
        for ip in addresses_in(ns) {
            holders.entry(ip).or_default().push(ns);
        }
        let host_if = ciliate::datapath::netdev::host_interface_name(cid);
        let has_endpoint = endpoints
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["container_id"] == cid.as_str());
        assert_eq!(
            std::path::Path::new(&format!("/sys/class/net/{host_if}")).exists(),
            has_endpoint,
            "{cid}: a host veth exists exactly when the container has an endpoint"
        );
    }
    for (ip, nss) in &holders {
        assert_eq!(nss.len(), 1, "{ip} is held by {nss:?}");
    }
    for (i, ip) in &succeeded {
        assert_eq!(
            addresses_in(&specs[*i].1),
            vec![*ip],
            "p{i} keeps the address its ADD returned"
        );
    }

    // The runtime retries every ADD: all succeed, with 50 distinct addresses, and a finished
    // one answers with what it has.
    let done = Arc::new(AtomicU32::new(0));
    let retries: Vec<(i32, serde_json::Value)> =
        concurrent_adds(&restarted.socket(), &specs, &done)
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
    let mut addrs = BTreeSet::new();
    for (i, (code, v)) in retries.iter().enumerate() {
        assert_eq!(*code, 0, "retried ADD of p{i}: {v}");
        let ip = result_addr(v).unwrap();
        if let Some(before) = succeeded.get(&i) {
            assert_eq!(ip, *before, "p{i} finished before the crash: same address");
        }
        assert_eq!(
            addresses_in(&specs[i].1),
            vec![ip],
            "p{i}'s namespace holds its address"
        );
        addrs.insert(ip);
        let (cid, netns, name) = &specs[i];
        pods.pods.push(common::cni::CniPod {
            namespace: "x".into(),
            name: name.clone(),
            netns: netns.clone(),
            container_id: cid.clone(),
            addr: ip,
            addr6: None,
            host_if: v["interfaces"][0]["name"].as_str().unwrap().to_string(),
        });
    }
    assert_eq!(addrs.len(), N, "50 distinct addresses");
    assert_eq!(ipam_allocated(&restarted), N as u64);
    assert_eq!(marked(&mark).len(), N);
    drop(pods);
    assert!(marked(&mark).is_empty(), "DEL removes every veth");
    drop(restarted);
}

/// A retried ADD finds the half-made host veth of an ADD that never finished (here: created but
/// not yet marked, as a crash between the two steps leaves it) and replaces it, where it used to
/// fail with "File exists". A device of that name marked by another agent is never touched.
#[test]
fn a_retried_add_replaces_a_stale_half_made_interface_but_not_another_agents() {
    let Some((tmp, agent, _, mark, _sweep)) = privileged().then(|| memory_agent(&cluster())) else {
        return;
    };
    let mut pods = CniPods::new(&agent.socket(), &tmp.path().join("no-pins"));
    let stale_ctr = format!("ctr-{}-a", pods.tag);
    let stale_if = ciliate::datapath::netdev::host_interface_name(&stale_ctr);
    let foreign_ctr = format!("ctr-{}-b", pods.tag);
    let foreign_if = ciliate::datapath::netdev::host_interface_name(&foreign_ctr);
    let other_agent = "ciliate:/var/lib/another-agent/state";
    let _cleanup = SweepMarked(other_agent.into());
    ip(&[
        "link",
        "add",
        &stale_if,
        "type",
        "veth",
        "peer",
        "name",
        &format!("t{}", pods.tag),
    ]);
    ip(&[
        "link",
        "add",
        &foreign_if,
        "type",
        "veth",
        "peer",
        "name",
        &format!("u{}", pods.tag),
    ]);
    ip(&["link", "set", &foreign_if, "alias", other_agent]);

    let a = pods.add("x", "a");
    assert_eq!(a.host_if, stale_if);
    assert_eq!(
        std::fs::read_to_string(format!("/sys/class/net/{stale_if}/ifalias"))
            .unwrap()
            .trim_end(),
        mark,
        "the replacement is this agent's"
    );
    assert_eq!(addresses_in(&a.netns), vec![a.addr]);

    let b_ns = pods.netns("b");
    let (code, v) = cni(
        &agent.socket(),
        "ADD",
        &foreign_ctr,
        Some(&b_ns),
        Some(("x", "b")),
    );
    assert_eq!((code, v["code"].as_u64()), (1, Some(100)), "{v}");
    assert!(
        v["details"].as_str().unwrap_or("").contains(other_agent),
        "the error names the other agent: {v}"
    );
    assert_eq!(
        std::fs::read_to_string(format!("/sys/class/net/{foreign_if}/ifalias"))
            .unwrap()
            .trim_end(),
        other_agent,
        "another agent's device is left alone"
    );
    assert_eq!(
        ipam_allocated(&agent),
        1,
        "the failed ADD released its address"
    );
    assert!(
        !tmp.path()
            .join("state/cni-adds")
            .read_dir()
            .unwrap()
            .any(|_| true),
        "no ADD record is left"
    );
    drop(pods);
    drop(agent);
}

/// Two endpoint records on disk claiming one address (state written by a faulty version, or by
/// hand): the first (lowest id) is restored, the second is not, is set aside with its reason and
/// reported, and its interface, which held the same address in another pod, is reclaimed. A new
/// ADD of the refused container gets an address of its own.
#[test]
fn a_restored_duplicate_address_is_refused_reported_and_its_interface_reclaimed() {
    let Some((tmp, mut agent, args, _, _sweep)) = privileged().then(|| memory_agent(&cluster()))
    else {
        return;
    };
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut pods = CniPods::new(&agent.socket(), &tmp.path().join("no-pins"));
    let a = pods.add("x", "a");
    let b = pods.add("x", "b");
    let eps = agent.json("/debug/endpoints");
    let id_of = |name: &str| {
        eps.as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .unwrap()["id"]
            .as_u64()
            .unwrap()
    };
    let (a_id, b_id) = (id_of("x/a"), id_of("x/b"));
    assert!(a_id < b_id);
    assert_eq!(agent.stop(), 0);
    let file = tmp.path().join(format!("state/{b_id}/endpoint.json"));
    let mut rec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    rec["ips"] = serde_json::json!([a.addr.to_string()]);
    std::fs::write(&file, rec.to_string()).unwrap();

    let restarted = Agent::start_with(tmp.path(), &args);
    let eps = restarted.json("/debug/endpoints");
    let names: Vec<&str> = eps
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert_eq!(names, vec!["x/a"], "only the first claimant is restored");
    assert!(
        restarted.log().contains(&format!(
            "endpoint {b_id} (x/b) claims {}, which endpoint {a_id} already holds",
            a.addr
        )),
        "the refusal is reported with both endpoints and the address"
    );
    let aside: Vec<_> = std::fs::read_dir(tmp.path().join("state"))
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("rejected-{b_id}-"))
        })
        .collect();
    assert_eq!(aside.len(), 1, "the refused record is set aside, not lost");
    assert!(std::fs::read_to_string(aside[0].path().join("reason.txt"))
        .unwrap()
        .contains("claims"));
    assert!(
        !std::path::Path::new(&format!("/sys/class/net/{}", b.host_if)).exists(),
        "the refused endpoint's interface is reclaimed"
    );
    assert!(
        addresses_in(&b.netns).is_empty(),
        "no second pod holds {}",
        a.addr
    );
    assert_eq!(addresses_in(&a.netns), vec![a.addr]);
    assert_eq!(ipam_allocated(&restarted), 1);

    let (code, v) = cni(
        &restarted.socket(),
        "ADD",
        &b.container_id,
        Some(&b.netns),
        Some(("x", "b")),
    );
    assert_eq!(code, 0, "a new ADD of b: {v}");
    let again = result_addr(&v).unwrap();
    assert_ne!(again, a.addr);
    assert_eq!(addresses_in(&b.netns), vec![again]);
    drop(pods);
    drop(restarted);
}

/// Restore validates and sweeps: a pod whose namespace (and so its veth) was deleted while the
/// agent was down is not restored (record, address and pins go), a stray pinned policy map and a
/// stray marked `lxc` veth are removed, and the live endpoints keep enforcing throughout.
#[test]
fn a_restart_sweeps_vanished_pods_and_stray_pins_while_live_endpoints_keep_enforcing() {
    let Some((tmp, pins, args, mut agent)) = privileged().then(|| bpf_agent("sweep")) else {
        return;
    };
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mark = ciliate::datapath::netdev::agent_mark(&tmp.path().join("state"));
    let _sweep = SweepMarked(mark.clone());
    let mut pods = CniPods::new(&agent.socket(), std::path::Path::new(&pins));
    let a = pods.add("x", "a");
    let b = pods.add("x", "b");
    let c = pods.add("x", "c");
    tcp_server(&b.netns, b.addr.into(), 8080);
    assert!(tcp_ok(&a.netns, b.addr.into(), 8080));
    assert!(!tcp_ok(&c.netns, b.addr.into(), 8080));
    let c_id = agent
        .json("/debug/endpoints")
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "x/c")
        .and_then(|e| e["id"].as_u64())
        .unwrap();

    let mut child = agent.child.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    // While the agent is down: c's pod goes (its veth with it), and strays appear.
    ip(&["netns", "del", &c.netns]);
    let stray_map = std::path::Path::new(&pins).join("ciliate/policy_4000");
    let mut map = libbpf_rs::MapHandle::create(
        libbpf_rs::MapType::Hash,
        Some("ciliate_stray"),
        4,
        4,
        16,
        &libbpf_rs::libbpf_sys::bpf_map_create_opts {
            sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_map_create_opts>() as _,
            ..Default::default()
        },
    )
    .expect("a map");
    map.pin(&stray_map).expect("pin the stray map");
    let stray_if = format!("lxcstray{}", std::process::id() % 10_000);
    ip(&[
        "link",
        "add",
        &stray_if,
        "type",
        "veth",
        "peer",
        "name",
        &format!("{stray_if}p"),
    ]);
    ip(&["link", "set", &stray_if, "alias", &mark]);

    // A prober on the allowed flow across the restart.
    let prober = Prober::start(&a.netns, b.addr, 8080);
    let restarted = Agent::start_with(tmp.path(), &args);
    restarted.wait_realized(restarted.revision());
    let names: Vec<String> = restarted
        .json("/debug/endpoints")
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(names, vec!["x/a", "x/b"], "c is not restored");
    assert_eq!(ipam_allocated(&restarted), 2, "c's address is free again");
    assert!(!tmp.path().join(format!("state/{c_id}")).exists());
    let pin_dir = std::path::Path::new(&pins).join("ciliate");
    assert!(!stray_map.exists(), "the stray policy map is unpinned");
    assert!(
        !pin_dir.join(format!("policy_{c_id}")).exists(),
        "c's policy map is unpinned"
    );
    assert!(!pin_dir.join(format!("link_{c_id}_ingress")).exists());
    assert!(
        !marked(&mark).contains(&stray_if),
        "the stray veth is removed"
    );
    let metrics = restarted.http_get("/metrics").1;
    for line in [
        "ciliate_endpoint_restore_total{outcome=\"restored\"} 2",
        "ciliate_endpoint_restore_total{outcome=\"interface_gone\"} 1",
        "ciliate_endpoint_restore_total{outcome=\"stray_pins\"} 2",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    std::thread::sleep(Duration::from_millis(200));
    let (probes, failures) = prober.stop();
    assert!(probes > 3, "the prober ran ({probes} probes)");
    assert_eq!(failures, 0, "a live flow broke");
    assert!(!tcp_ok(&a.netns, b.addr.into(), 9090), "still enforcing");
    drop(pods);
    drop(restarted);
}
