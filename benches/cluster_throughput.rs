//! Cross-node pod-to-pod TCP throughput with policy against node-to-node throughput on the same
//! path (cluster networking issue: >= 0.90 in native routing; tunnel mode reported too), a bench
//! binary: `sudo cargo bench --bench cluster_throughput`.
//!
//! The multi-node harness of the tests (`tests/common/cluster.rs`): two node namespaces on a
//! bridge, an agent per node (eBPF datapath, Kubernetes mode against the in-repo API server),
//! pod a on node 1 and pod b on node 2 made through CNI, a CiliumNetworkPolicy that isolates b
//! and admits a. One TCP stream, 128 KiB writes, `SECONDS` per round; rounds alternate
//! node 1 -> node 2 (the nodes' own addresses, no program on the path) and a -> b (veths, both
//! endpoints' programs, a route via node 2, the same bridge), interleaved so both see the same
//! machine state. Reported per mode: each round's Gbit/s, the medians and pod/node.
//!
//! Host firewall mode (issue #29: node-to-node and cross-node pod-to-pod throughput with the
//! host firewall on >= 0.95 of the same with it off, in one run): two such clusters at once,
//! the same but for `--enable-host-firewall`; on the first, a host policy on every node admits
//! TCP 5201 from `remote-node` only (checked: another port is refused). Each round times, on
//! each cluster in turn (which goes first alternates), node 1 -> node 2 and a -> b; reported:
//! every figure, the medians, and on/off per path (of the medians and the median per-round
//! ratio).
//!
//! IPv6 mode (issue #31: cross-node pod-to-pod IPv6 TCP >= 0.90 of node-to-node IPv6, native
//! routing, in one run): a dual-stack cluster (`Cluster::start_dual_stack`), the same policy;
//! each round times node 1 -> node 2 and a -> b over IPv4, then over IPv6 (the nodes' and the
//! pods' IPv6 addresses).

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::IpAddr;

use common::cluster::Cluster;
use common::netns::{stream_gbits, tcp_ok, tcp_server};
use serde_json::json;

const SECONDS: f64 = 2.0;
const ROUNDS: usize = 7;
const PORT: u16 = 5201;

/// One stream a -> b (see `stream_gbits`).
fn stream(from: &str, at: &str, to: impl Into<IpAddr>) -> f64 {
    stream_gbits(from, at, to, PORT, SECONDS)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// A two-node cluster with pod a on node 1, pod b on node 2, and a policy that isolates b and
/// admits a on `PORT`, enforced.
struct Setup {
    c: Cluster,
    a: common::cni::CniPod,
    b: common::cni::CniPod,
}

impl Setup {
    fn start(args: &[&str]) -> Setup {
        Setup::start_in(Cluster::start_with(2, args))
    }

    fn start_in(mut c: Cluster) -> Setup {
        let a = c.add_pod(1, "a", "a");
        let b = c.add_pod(2, "b", "b");
        c.api()
            .apply_json(json!({
                "apiVersion": "cilium.io/v2", "kind": "CiliumNetworkPolicy",
                "metadata": {"name": "b-from-a", "namespace": "x"},
                "spec": {
                    "endpointSelector": {"matchLabels": {"app": "b"}},
                    "ingress": [{"fromEndpoints": [{"matchLabels": {"app": "a"}}],
                                 "toPorts": [{"ports": [{"port": PORT.to_string(), "protocol": "TCP"}]}]}]
                }
            }))
            .expect("policy");
        let node2 = c.nodes[1].agent();
        node2.wait_until("b enforces its ingress", || {
            node2
                .cli_json(&["endpoint", "list"])
                .as_array()
                .is_some_and(|e| {
                    e.iter()
                        .any(|e| e["name"] == "x/b" && e["ingress_enforced"] == true)
                })
        });
        Setup { c, a, b }
    }

    /// node 1 -> node 2 (Gbit/s).
    fn node(&self) -> f64 {
        let (n1, n2) = (&self.c.nodes[0], &self.c.nodes[1]);
        stream(&n1.netns, &n2.netns, n2.ip)
    }

    /// a -> b (Gbit/s).
    fn pod(&self) -> f64 {
        stream(&self.a.netns, &self.b.netns, self.b.addr)
    }

    /// node 1 -> node 2 over IPv6 (a dual-stack cluster).
    fn node6(&self) -> f64 {
        let (n1, n2) = (&self.c.nodes[0], &self.c.nodes[1]);
        stream(&n1.netns, &n2.netns, common::cluster::node_ip6(2))
    }

    /// a -> b over IPv6.
    fn pod6(&self) -> f64 {
        let b6 = self.b.addr6.expect("b has an IPv6 address");
        stream(&self.a.netns, &self.b.netns, b6)
    }
}

fn fmt(v: &[f64]) -> String {
    v.iter()
        .map(|g| format!("{g:.2}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn measure(mode: &str, args: &[&str]) {
    let s = Setup::start(args);
    // A first stream of each warms the path (routes, ARP, conntrack).
    s.pod();
    s.node();
    let (mut node, mut pod) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        node.push(s.node());
        pod.push(s.pod());
    }
    report(&format!("{mode}:"), node, pod);
}

/// The rounds' figures of node -> node and pod -> pod, their medians and the ratio.
fn report(title: &str, node: Vec<f64>, pod: Vec<f64>) {
    let ratios: Vec<f64> = pod.iter().zip(&node).map(|(p, n)| p / n).collect();
    println!("{title}");
    println!("  node 1 -> node 2 (Gbit/s): {}", fmt(&node));
    println!("  pod a -> pod b, policy enforced (Gbit/s): {}", fmt(&pod));
    println!(
        "  medians: node {:.2}, pod {:.2}; pod/node {:.1}% (per-round ratios: median {:.1}%)",
        median(node.clone()),
        median(pod.clone()),
        100.0 * median(pod) / median(node),
        100.0 * median(ratios)
    );
}

/// IPv6 only (`Cluster::start_ipv6_only`): node 1 -> node 2 and a -> b over IPv6, rounds
/// interleaved.
fn measure_ipv6_only(mode: &str, args: &[&str]) {
    let s = Setup::start_in(Cluster::start_ipv6_only(2, args));
    let n1 = &s.c.nodes[0];
    let cidr6 = common::cluster::pod_cidr6(2);
    n1.agent()
        .wait_until("node 1 routes node 2's IPv6 pod CIDR", || {
            n1.kernel_routes().iter().any(|(dst, _)| *dst == cidr6)
        });
    s.pod6();
    s.node6();
    let (mut node, mut pod) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        node.push(s.node6());
        pod.push(s.pod6());
    }
    report(&format!("{mode}, IPv6 only:"), node, pod);
}

/// IPv6 against IPv4 on one dual-stack cluster, rounds interleaved.
fn measure_ipv6(mode: &str, args: &[&str]) {
    let s = Setup::start_in(Cluster::start_dual_stack(2, args));
    let n1 = &s.c.nodes[0];
    let cidr6 = common::cluster::pod_cidr6(2);
    n1.agent()
        .wait_until("node 1 routes node 2's IPv6 pod CIDR", || {
            n1.kernel_routes().iter().any(|(dst, _)| *dst == cidr6)
        });
    // A first stream of each warms the path (routes, neighbours, conntrack).
    s.pod6();
    s.node6();
    let mut figures: [Vec<f64>; 4] = Default::default();
    for _ in 0..ROUNDS {
        for (i, f) in [Setup::node, Setup::pod, Setup::node6, Setup::pod6]
            .into_iter()
            .enumerate()
        {
            figures[i].push(f(&s));
        }
    }
    let [node, pod, node6, pod6] = figures;
    println!("{mode}, dual stack:");
    for (family, node, pod) in [("IPv4", node, pod), ("IPv6", node6, pod6)] {
        let ratios: Vec<f64> = pod.iter().zip(&node).map(|(p, n)| p / n).collect();
        println!("  {family} node 1 -> node 2 (Gbit/s): {}", fmt(&node));
        println!(
            "  {family} pod a -> pod b, policy enforced (Gbit/s): {}",
            fmt(&pod)
        );
        println!(
            "  {family} medians: node {:.2}, pod {:.2}; pod/node {:.1}% (per-round ratios: median {:.1}%)",
            median(node.clone()),
            median(pod.clone()),
            100.0 * median(pod) / median(node),
            100.0 * median(ratios)
        );
    }
}

/// A host policy on every node: TCP `PORT` from the other nodes, nothing else in.
fn host_policy() -> serde_json::Value {
    json!({
        "apiVersion": "cilium.io/v2", "kind": "CiliumClusterwideNetworkPolicy",
        "metadata": {"name": "bench-host"},
        "spec": {
            "nodeSelector": {},
            "ingress": [{"fromEntities": ["remote-node"],
                         "toPorts": [{"ports": [{"port": PORT.to_string(), "protocol": "TCP"}]}]}]
        }
    })
}

/// The host firewall on against off, interleaved (see the module's documentation).
fn measure_host_firewall(mode: &str, args: &[&str]) {
    let off = Setup::start(args);
    let on_args: Vec<&str> = args
        .iter()
        .copied()
        .chain(["--enable-host-firewall", "true"])
        .collect();
    let on = Setup::start(&on_args);
    on.c.api().apply_json(host_policy()).expect("host policy");
    for n in &on.c.nodes {
        let agent = n.agent();
        agent.wait_until("the host endpoint enforces the host policy", || {
            let e = agent.endpoint(65535);
            e["state"] == "ready" && e["ingress_enforced"] == true
        });
    }
    let (n1, n2) = (&on.c.nodes[0], &on.c.nodes[1]);
    tcp_server(&n2.netns, IpAddr::V4(n2.ip), PORT + 1);
    assert!(
        !tcp_ok(&n1.netns, IpAddr::V4(n2.ip), PORT + 1),
        "the host firewall refuses a port its policy does not open"
    );
    let warm = |s: &Setup| {
        s.pod();
        s.node();
    };
    warm(&off);
    warm(&on);
    // [off, on] x [node, pod]
    let mut g: [[Vec<f64>; 2]; 2] = Default::default();
    for round in 0..ROUNDS {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let s = if i == 0 { &off } else { &on };
            g[i][0].push(s.node());
            g[i][1].push(s.pod());
        }
    }
    println!("{mode}, host firewall on against off:");
    for (k, what) in ["node 1 -> node 2", "pod a -> pod b, policy enforced"]
        .iter()
        .enumerate()
    {
        let (off, on) = (&g[0][k], &g[1][k]);
        let ratios: Vec<f64> = on.iter().zip(off).map(|(a, b)| a / b).collect();
        println!("  {what}, off (Gbit/s): {}", fmt(off));
        println!("  {what}, on (Gbit/s): {}", fmt(on));
        println!(
            "  {what}: medians off {:.2}, on {:.2}; on/off {:.3} (per-round ratios: median {:.3})",
            median(off.clone()),
            median(on.clone()),
            median(on.clone()) / median(off.clone()),
            median(ratios)
        );
    }
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "cluster throughput bench: run with `cargo bench --bench cluster_throughput` (as root)"
        );
        return;
    }
    assert!(
        nix::unistd::geteuid().is_root(),
        "the cluster throughput bench needs root"
    );
    // `CILIATE_BENCH_CLUSTER_MODE=native|native-nomasq|tunnel|ipv6|ipv6-tunnel|ipv6-only|
    // ipv6-only-tunnel6|host-firewall|host-firewall-tunnel`:
    // that mode alone.
    let only = std::env::var("CILIATE_BENCH_CLUSTER_MODE").ok();
    let run = |m: &str| only.as_deref().is_none_or(|o| o == m);
    if run("native") {
        measure("native routing", &[]);
    }
    if run("native-nomasq") {
        // The masquerade table turns on the kernel's connection tracking in the node's
        // namespace.
        measure(
            "native routing, masquerading off",
            &["--enable-ipv4-masquerade=false"],
        );
    }
    if run("tunnel") {
        measure("tunnel (vxlan)", &["--routing-mode", "tunnel"]);
    }
    if run("ipv6") {
        measure_ipv6("native routing", &[]);
    }
    if run("ipv6-tunnel") {
        measure_ipv6("tunnel (vxlan)", &["--routing-mode", "tunnel"]);
    }
    if run("ipv6-only") {
        measure_ipv6_only("native routing", &[]);
    }
    if run("ipv6-only-tunnel6") {
        measure_ipv6_only(
            "tunnel (vxlan) over an IPv6 underlay",
            &["--routing-mode", "tunnel", "--underlay-protocol", "ipv6"],
        );
    }
    if run("host-firewall") {
        measure_host_firewall("native routing", &[]);
    }
    if run("host-firewall-tunnel") {
        measure_host_firewall("tunnel (vxlan)", &["--routing-mode", "tunnel"]);
    }
}
