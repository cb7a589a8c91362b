//! Traffic analysis (issue #32's performance goals), one process:
//! - the flow history of 1,000,000 distinct connections: its size (goal <= 64 MiB), as the
//!   process's resident memory grew while building it and as the table counts its capacity;
//! - `policy diff` of them against 1,000 policies with a proposed change (goal <= 2 s), both
//!   replays included (engines built, every workload resolved twice);
//! - `policy recommend` for a namespace with 10,000 distinct connections (goal <= 1 s).
//!
//! `cargo bench --bench traffic`; each figure is the median of 5 runs (min and max shown).

use std::time::Instant;

use ciliate::policy::translate::{parse_policy, ParsedPolicy};
use ciliate::traffic::diff::{diff, Proposal};
use ciliate::traffic::history::{FlowHistory, Observation};
use ciliate::traffic::recommend::{recommend, Kind};
use ciliate::traffic::Peer;

const NAMESPACES: usize = 100;
const WORKLOADS: usize = 20; // per namespace
const OUTSIDE: usize = 20_000;
const CONNECTIONS: usize = 1_000_000;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn pod(ns: usize, w: usize) -> Peer {
    Peer {
        pod: Some(format!("ns-{ns}/w-{w}-5d9f8c7b6-x2x4z")),
        ..Peer::new(
            vec![
                format!("k8s:app=w-{w}"),
                "k8s:pod-template-hash=5d9f8c7b6".into(),
                format!("k8s:io.kubernetes.pod.namespace=ns-{ns}"),
                format!("k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name=ns-{ns}"),
                "k8s:io.cilium.k8s.policy.serviceaccount=default".into(),
                "k8s:io.cilium.k8s.policy.cluster=default".into(),
            ],
            None,
            vec![],
        )
    }
}

fn outside(i: usize) -> Peer {
    let ip = std::net::Ipv4Addr::from(0xC633_0000u32 + i as u32); // 198.51.0.0/16 and on
    let names = match i % 2 {
        0 => vec![format!("api-{}.example.com", i / 2)],
        _ => vec![],
    };
    Peer::new(vec!["reserved:world".into()], Some(ip.into()), names)
}

/// 1,000,000 distinct connections: every workload to 450 others (TCP 8000-8049) and to 50
/// outside addresses (TCP 443 and on).
fn history() -> FlowHistory {
    let mut h = FlowHistory::new(86_400, CONNECTIONS);
    let workloads = NAMESPACES * WORKLOADS;
    let pods: Vec<u32> = (0..workloads)
        .map(|i| h.peer(pod(i / WORKLOADS, i % WORKLOADS)))
        .collect();
    let out: Vec<u32> = (0..OUTSIDE).map(|i| h.peer(outside(i))).collect();
    for i in 0..CONNECTIONS {
        let (src, j) = (i % workloads, i / workloads);
        let (dst, port) = match j % 10 {
            9 => (out[(src * 50 + j / 10) % OUTSIDE], 443 + j as u16),
            _ => (pods[(src + j + 1) % workloads], 8000 + (j % 50) as u16),
        };
        h.record(Observation {
            src: pods[src],
            dst,
            proto: 6,
            port,
            egress: true,
            dropped: false,
            policies: &[],
            now: 1_795_939_200 + (i % 3600) as u64,
        });
    }
    h
}

fn cnp(yaml: &str) -> ParsedPolicy {
    let v: serde_yaml::Value = serde_yaml::from_str(yaml).expect("yaml");
    parse_policy(&v, "default", "bench").expect("policy")
}

/// 1,000 policies: each isolates one workload's ingress and admits three others of its
/// namespace on a few ports; every tenth also limits the workload's egress by FQDN and CIDR.
fn policies() -> Vec<ParsedPolicy> {
    (0..1000)
        .map(|k| {
            let (ns, w) = (k % NAMESPACES, (k / NAMESPACES) % WORKLOADS);
            let mut y = format!(
                "apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {{name: p-{k}, namespace: ns-{ns}}}\n\
                 spec:\n  endpointSelector: {{matchLabels: {{app: w-{w}}}}}\n  ingress:\n"
            );
            for o in 1..4 {
                y.push_str(&format!(
                    "  - fromEndpoints: [{{matchLabels: {{app: w-{}}}}}]\n    toPorts: [{{ports: [{{port: '{}', protocol: TCP}}, {{port: '{}', protocol: TCP}}]}}]\n",
                    (w + o) % WORKLOADS,
                    8000 + (k + o) % 50,
                    8000 + (k + 2 * o) % 50
                ));
            }
            if k % 10 == 0 {
                y.push_str(&format!(
                    "  egress:\n  - toFQDNs: [{{matchPattern: '*.example.com'}}]\n  - toCIDR: [198.51.{}.0/24]\n  - toEndpoints: [{{}}]\n",
                    k % 78
                ));
            }
            cnp(&y)
        })
        .collect()
}

/// The change: namespace ns-7 admits only itself (a namespace-wide default deny).
fn proposal() -> Proposal {
    Proposal {
        upserts: vec![cnp(
            "apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {name: ns-7-only, namespace: ns-7}\n\
             spec:\n  endpointSelector: {}\n  ingress:\n  - fromEndpoints: [{}]\n",
        )],
        deletes: vec![],
    }
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("traffic: bench");
        return;
    }
    let before = rss_kib();
    let h = history();
    let grown = rss_kib().saturating_sub(before);
    println!(
        "flow history: {} distinct connections, {} peers: resident memory grew {:.1} MiB; table {:.1} MiB (goal <= 64 MiB); saved {:.1} MiB",
        h.len(),
        h.peers().len(),
        grown as f64 / 1024.0,
        h.heap_bytes() as f64 / (1024.0 * 1024.0),
        h.encode().len() as f64 / (1024.0 * 1024.0),
    );

    let (in_force, change) = (policies(), proposal());
    let mut times = Vec::new();
    let mut flips = 0;
    for _ in 0..5 {
        let t = Instant::now();
        let r = diff(&h, 0, in_force.clone(), &change).expect("diff");
        times.push(t.elapsed().as_secs_f64());
        flips = r.flips.len();
        assert_eq!(r.connections, h.len());
    }
    let (m, lo, hi) = median(times);
    println!(
        "policy diff: {} connections x {} policies (+1 proposed): {m:.3} s median ({lo:.3}-{hi:.3}), {flips} flips (goal <= 2 s)",
        h.len(),
        in_force.len()
    );

    // A namespace with 10,000 distinct connections: 100 workloads, each to 80 pods elsewhere
    // and 20 outside addresses.
    let mut small = FlowHistory::new(86_400, 100_000);
    let big: Vec<u32> = (0..100).map(|w| small.peer(pod(1000, w))).collect();
    let others: Vec<u32> = (0..2000).map(|i| small.peer(pod(i / 20, i % 20))).collect();
    let outs: Vec<u32> = (0..2000).map(|i| small.peer(outside(i))).collect();
    for (w, src) in big.iter().enumerate() {
        for j in 0..100 {
            let dst = match j % 5 {
                4 => outs[(w * 20 + j / 5) % 2000],
                _ => others[(w * 80 + j) % 2000],
            };
            small.record(Observation {
                src: *src,
                dst,
                proto: 6,
                port: 8000 + j as u16,
                egress: true,
                dropped: false,
                policies: &[],
                now: 1_795_939_200,
            });
        }
    }
    let mut times = Vec::new();
    let mut bytes = 0;
    for _ in 0..5 {
        let t = Instant::now();
        let y = recommend(&small, 0, "ns-1000", Kind::CiliumNetworkPolicy);
        times.push(t.elapsed().as_secs_f64());
        bytes = y.len();
    }
    let (m, lo, hi) = median(times);
    println!(
        "policy recommend: a namespace with {} connections: {m:.3} s median ({lo:.3}-{hi:.3}), {bytes} bytes of YAML (goal <= 1 s)",
        small.len()
    );
}
