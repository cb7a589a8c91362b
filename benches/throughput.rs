//! TCP throughput between two pods with policy enforced, against the same path with no program
//! attached (issue #4: enforced >= 90% of plain), a bench binary: `sudo cargo bench --bench
//! throughput`.
//!
//! Two pods are made the way CNI makes them (named network namespaces, veth pairs configured
//! by `datapath::netdev`, the same code the agent runs for `ciliate-cni ADD`). One TCP stream
//! from a to b, 128 KiB writes, for `SECONDS` per round; rounds alternate plain / enforced
//! (programs attached, b isolated for ingress with one rule allowing a on the port, a isolated
//! for egress with one rule allowing b), so both see the same machine state. Reported: each
//! round's Gbit/s, the medians, and enforced/plain.

use std::net::Ipv4Addr;

#[path = "../tests/common/netns.rs"]
#[allow(dead_code)]
mod netns;

use ciliate::datapath::bpf::datapath::BpfDatapath;
use ciliate::datapath::netdev::{self, PodInterfaceSpec};
use ciliate::datapath::{Datapath, EndpointAttachment, EndpointFlags};
use ciliate::policy::mapstate::{MapDelta, MapKey};
use ciliate::policy::rule::{Direction, PROTO_TCP};

const SECONDS: f64 = 2.0;
const ROUNDS: usize = 7;
const PORT: u16 = 5201;

struct Pods {
    netns: Vec<String>,
    host_ifs: Vec<String>,
    pins: std::path::PathBuf,
}

impl Drop for Pods {
    fn drop(&mut self) {
        for i in &self.host_ifs {
            let _ = netdev::delete_host_interface(i);
        }
        for n in &self.netns {
            let _ = netdev::delete_netns(n);
        }
        let _ = std::fs::remove_dir_all(&self.pins);
    }
}

/// One stream a -> b for `SECONDS` (the tests' helper, shared with the cluster bench).
fn stream(a: &str, b: &str, to: Ipv4Addr) -> f64 {
    netns::stream_gbits(a, b, to, PORT, SECONDS)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("throughput bench: run with `cargo bench --bench throughput` (as root)");
        return;
    }
    assert!(
        nix::unistd::geteuid().is_root(),
        "the throughput bench needs root"
    );
    let tag = std::process::id();
    let mut pods = Pods {
        netns: vec![],
        host_ifs: vec![],
        pins: format!("/sys/fs/bpf/ciliate-tput-{tag}").into(),
    };
    let addrs = [Ipv4Addr::new(10, 247, 0, 1), Ipv4Addr::new(10, 247, 0, 2)];
    for (i, ip) in addrs.iter().enumerate() {
        let ns = format!("ciliate-tput-{tag}-{i}");
        let path = netdev::create_netns(&ns).expect("netns");
        pods.netns.push(ns);
        let host_if = netdev::host_interface_name(&format!("tput-{tag}-{i}"));
        netdev::create_pod_interface(&PodInterfaceSpec {
            host_if: host_if.clone(),
            netns: path,
            pod_if: "eth0".into(),
            ips: vec![(*ip).into()],
            mtu: 1500,
            mark: format!("{}bench-throughput-{tag}", netdev::MARK_PREFIX),
        })
        .expect("pod interface");
        pods.host_ifs.push(host_if);
    }
    let (a, b) = (pods.netns[0].clone(), pods.netns[1].clone());
    let (ids, eps) = ([3001u32, 3002u32], [1u16, 2u16]);
    let mut dp = BpfDatapath::open(&pods.pins).expect("open the datapath");
    for i in 0..2 {
        dp.upsert_ipcache(format!("{}/32", addrs[i]).parse().unwrap(), ids[i])
            .unwrap();
    }
    let key = |direction, identity| MapKey {
        direction,
        identity,
        protocol: PROTO_TCP,
        port_lo: PORT,
        port_hi: PORT,
    };
    let egress_only = EndpointFlags {
        ingress_default_deny: false,
        egress_default_deny: true,
        drop_all: false,
        ..Default::default()
    };
    let ingress_only = EndpointFlags {
        ingress_default_deny: true,
        egress_default_deny: false,
        drop_all: false,
        ..Default::default()
    };
    let enforce = |dp: &mut BpfDatapath| {
        for i in 0..2 {
            dp.attach_endpoint(&EndpointAttachment {
                id: eps[i],
                interface: Some(pods.host_ifs[i].clone()),
                ips: vec![addrs[i].into()],
                identity: ids[i],
                mac: None,
            })
            .unwrap();
        }
        let one = |k| MapDelta {
            upserts: vec![(k, false)],
            deletes: vec![],
            ..Default::default()
        };
        dp.sync_policy(1, egress_only, &one(key(Direction::Egress, ids[1])), true)
            .unwrap();
        dp.sync_policy(2, ingress_only, &one(key(Direction::Ingress, ids[0])), true)
            .unwrap();
    };
    // Warm-up, then interleaved rounds.
    stream(&a, &b, addrs[1]);
    let (mut plain, mut enforced) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let p = stream(&a, &b, addrs[1]);
        enforce(&mut dp);
        let e = stream(&a, &b, addrs[1]);
        // The programs decided: b's allow entry counted the connection.
        let dump = dp.dump_policy(2).unwrap();
        assert!(
            dump.entries
                .iter()
                .any(|x| x.port == PORT && x.packets >= 1),
            "the enforced round went through the policy: {dump:?}"
        );
        for ep in eps {
            dp.detach_endpoint(ep).unwrap();
        }
        println!("round {round}: plain {p:.2} Gbit/s, enforced {e:.2} Gbit/s");
        plain.push(p);
        enforced.push(e);
    }
    let paired = median(plain.iter().zip(&enforced).map(|(p, e)| e / p).collect());
    let (p, e) = (median(plain), median(enforced));
    println!(
        "TCP throughput a -> b (one stream, {SECONDS} s rounds, {ROUNDS} interleaved): plain median {p:.2} Gbit/s, enforced median {e:.2} Gbit/s, enforced/plain {:.1}% (median of per-round ratios {:.1}%)",
        e / p * 100.0,
        paired * 100.0
    );
}
