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

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::Ipv4Addr;

use common::cluster::Cluster;
use common::netns::stream_gbits;
use serde_json::json;

const SECONDS: f64 = 2.0;
const ROUNDS: usize = 7;
const PORT: u16 = 5201;

/// One stream a -> b (see `stream_gbits`).
fn stream(from: &str, at: &str, to: Ipv4Addr) -> f64 {
    stream_gbits(from, at, to, PORT, SECONDS)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn measure(mode: &str, args: &[&str]) {
    let mut c = Cluster::start_with(2, args);
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
    let (n1, n2, n2_ip) = (
        c.nodes[0].netns.clone(),
        c.nodes[1].netns.clone(),
        c.nodes[1].ip,
    );
    // A first stream of each warms the path (routes, ARP, conntrack).
    stream(&a.netns, &b.netns, b.addr);
    stream(&n1, &n2, n2_ip);
    let (mut node, mut pod) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        node.push(stream(&n1, &n2, n2_ip));
        pod.push(stream(&a.netns, &b.netns, b.addr));
    }
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|g| format!("{g:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let ratios: Vec<f64> = pod.iter().zip(&node).map(|(p, n)| p / n).collect();
    println!("{mode}:");
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
    // `CILIATE_BENCH_CLUSTER_MODE=native|native-nomasq|tunnel`: that mode alone.
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
}
