//! Datapath performance (issue #4), a bench binary: `sudo cargo bench --bench datapath`.
//!
//! With 100,000 ipcache entries and 16,384 policy entries in the endpoint's map:
//! - a new TCP connection allowed by an L3/L4 rule: one SYN run 100,000 times (a SYN never
//!   matches conntrack, so every run is a whole new-connection decision, warm like the
//!   established figure), and 20,000 distinct SYNs timed one run each (cold: every run a new
//!   conntrack slot, and for the first figure a different peer),
//! - a packet of an established flow (conntrack hit),
//! - a packet on an unmanaged interface,
//!
//! timed by the kernel itself (`BPF_PROG_TEST_RUN` duration, ns per run); and the wall time of
//! applying a 10,000-entry policy delta through `BpfDatapath::sync_policy`.
//!
//! The host firewall (issue #29: on the node's device, a new connection <= 250 ns warm, an
//! established packet <= 100 ns): the host endpoint's policy judging a SYN for the node and one
//! the node sends, their established packets and replies, and a packet for neither (forwarded
//! traffic).
//!
//! Cluster tiers (issue #28: a packet still costs one policy lookup, within 10 ns): two
//! endpoints resolved by the engine over 200 peer identities, one selected by 1,000
//! CiliumNetworkPolicies, the other by the same plus 100 ClusterNetworkPolicies of 25 rules
//! (`benches/shared/engine.rs`; fewer if their map would not fit the datapath's 16,384
//! entries); a warm new connection and an established packet from allowed peers of each,
//! interleaved round by round.
//!
//! IPv6 against IPv4 (issue #31: a new IPv6 connection and an established IPv6 flow <= 1.2x
//! the IPv4 figures): the same endpoint, peers and rules, the IPv4 and IPv6 packets
//! interleaved round by round, reported as the median of the per-round ratios.

use std::mem::MaybeUninit;
use std::time::Instant;

use libbpf_rs::{MapCore, MapFlags};

use ciliate::datapath::bpf::datapath::BpfDatapath;
use ciliate::datapath::bpf::{ensure_bpffs, load_program, types, Pod, EP_INGRESS_DEFAULT_DENY};
use ciliate::datapath::{Datapath, EndpointAttachment, EndpointFlags};
use ciliate::policy::mapstate::MapDelta;

#[path = "shared/packets.rs"]
mod packets;
use packets::{
    addr, addr6, allow_16k, fill_ipcache, packet, packet6, tcp_in, timed_run as run, ACK, SYN,
};

#[path = "shared/engine.rs"]
mod engine;

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("datapath bench: run with `cargo bench --bench datapath` (as root)");
        return;
    }
    assert!(
        nix::unistd::geteuid().is_root(),
        "the datapath bench needs root"
    );
    let root =
        std::path::PathBuf::from(format!("/sys/fs/bpf/ciliate-bench-{}", std::process::id()));
    ensure_bpffs(&root).unwrap();
    let pins = root.join("ciliate");

    // 100,000 ipcache entries, 16,384 policy entries (one per peer identity, TCP 80).
    // As an agent with --enable-ipv6 opens it (the IPv6 conntrack table preallocated).
    let mut dp = BpfDatapath::open_for(
        &root,
        ciliate::datapath::bpf::datapath::AttachMode::Auto,
        Some(true),
    )
    .unwrap();
    let t = Instant::now();
    fill_ipcache(&mut dp);
    println!(
        "ipcache: 100000 entries written in {:.2}s",
        t.elapsed().as_secs_f64()
    );
    dp.attach_endpoint(&EndpointAttachment {
        id: 7,
        interface: None,
        ips: vec![],
        identity: 1,
        mac: None,
    })
    .unwrap();
    let flags = EndpointFlags {
        ingress_default_deny: true,
        egress_default_deny: false,
        drop_all: false,
        ..Default::default()
    };
    let keys = allow_16k();
    dp.sync_policy(
        7,
        flags,
        &MapDelta {
            upserts: keys,
            deletes: vec![],
            ..Default::default()
        },
        true,
    )
    .unwrap();
    assert_eq!(dp.dump_policy(7).unwrap().entries.len(), 16_384);

    // A 10,000-entry delta (another port for 10,000 of the identities).
    let mut times = Vec::new();
    for round in 0..5u16 {
        let delta = MapDelta {
            upserts: (0..10_000u32)
                .map(|i| (tcp_in(1000 + i, 443 + round), false))
                .collect(),
            deletes: if round == 0 {
                vec![]
            } else {
                (0..10_000u32)
                    .map(|i| tcp_in(1000 + i, 442 + round))
                    .collect()
            },
            ..Default::default()
        };
        // Keep the map within its capacity: drop 10,000 of the port-80 entries first.
        if round == 0 {
            let shrink = MapDelta {
                upserts: vec![],
                deletes: (6_384..16_384u32).map(|i| tcp_in(1000 + i, 80)).collect(),
                ..Default::default()
            };
            dp.sync_policy(7, flags, &shrink, false).unwrap();
        }
        let t = Instant::now();
        let stats = dp.sync_policy(7, flags, &delta, false).unwrap();
        times.push(t.elapsed().as_secs_f64() * 1e3);
        assert!(stats.upserted >= 10_000);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "applying a 10,000-entry policy delta (and removing the previous 10,000 after the first round): median {:.1} ms, max {:.1} ms ({} rounds)",
        times[times.len() / 2],
        times[times.len() - 1],
        times.len()
    );
    // Back to 16,384 entries for the packet measurements.
    let refill = MapDelta {
        upserts: allow_16k(),
        deletes: (0..10_000u32).map(|i| tcp_in(1000 + i, 447)).collect(),
        ..Default::default()
    };
    dp.sync_policy(7, flags, &refill, false).unwrap();
    assert_eq!(dp.dump_policy(7).unwrap().entries.len(), 16_384);

    let mut s1 = MaybeUninit::uninit();
    let ep = load_program(&mut s1, &pins, 7).unwrap();
    let mut s0 = MaybeUninit::uninit();
    let unmanaged = load_program(&mut s0, &pins, 0).unwrap();
    let dst = [10, 99, 0, 1];
    let info = ep
        .maps
        .endpoints
        .lookup(&7u32.to_ne_bytes(), MapFlags::ANY)
        .unwrap()
        .unwrap();
    let info = types::endpoint_info::from_bytes(&info).unwrap();
    assert_eq!(
        info.flags & EP_INGRESS_DEFAULT_DENY,
        EP_INGRESS_DEFAULT_DENY
    );

    // New connections: 20,000 distinct packets (source ports), one run each, kernel-timed;
    // sorted nanoseconds per packet.
    let new_connections = |src: &dyn Fn(u32) -> [u8; 4]| {
        let mut ns: Vec<f64> = (0..20_000u32)
            .map(|i| {
                let pkt = packet(src(i), dst, 1024 + (i % 60_000) as u16, 80, SYN);
                let (verdict, ns) = run(&ep.progs.to_container, &pkt, 1);
                assert_eq!(verdict, 0, "allowed");
                ns
            })
            .collect();
        ns.sort_by(|a, b| a.total_cmp(b));
        ns
    };
    let ns = new_connections(&|i| addr(i % 16_384));
    println!(
        "new TCP connection allowed by an L3/L4 rule: median {:.0} ns, p90 {:.0} ns per packet (kernel-timed, {} packets)",
        ns[ns.len() / 2],
        ns[ns.len() * 9 / 10],
        ns.len()
    );
    // The same from one peer: its ipcache and policy entries stay in cache, so this is the
    // conntrack part (two misses and an insert) plus the fixed cost of a single run.
    let warm = new_connections(&|_| addr(3));
    println!(
        "  of which, from one peer only (ipcache and policy warm): median {:.0} ns",
        warm[warm.len() / 2]
    );
    // The repeated measurements, interleaved over 7 rounds so that a noisy moment on the
    // machine (this VM varies by 10-40% from minute to minute) touches all of them alike; each
    // is reported as the median round, with the range.
    //
    // - SYN: one SYN run again and again. A SYN never matches conntrack, so every run is a
    //   whole new-connection decision (ipcache, policy, its conntrack entry written), with
    //   warm caches as in the established figure.
    // - denied: a SYN to port 81, which no rule allows (default deny; a verdict event).
    // - established: the connection's SYN once, then its ACK again and again (a conntrack hit).
    // - unmanaged: the program of an interface that is no endpoint.
    // - reply, egress: the endpoint's answer to the established connection through
    //   from_container (a conntrack reply hit, then the BPF host routing lookup, which finds
    //   no prefix here and leaves the packet to the stack).
    let syn = packet(addr(6), dst, 4444, 80, SYN);
    let denied = packet(addr(5), dst, 999, 81, SYN);
    let opening = packet(addr(1), dst, 1025, 80, SYN);
    let est = packet(addr(1), dst, 1025, 80, ACK);
    let reply = packet(dst, addr(1), 80, 1025, ACK);
    assert_eq!(run(&ep.progs.to_container, &opening, 1).0, 0);
    const ROUNDS: usize = 7;
    const RUNS: u32 = 100_000;
    let mut rounds: [Vec<f64>; 5] = Default::default();
    for _ in 0..ROUNDS {
        for (i, (prog, pkt, verdict)) in [
            (&ep.progs.to_container, &syn, 0),
            (&ep.progs.to_container, &denied, 2),
            (&ep.progs.to_container, &est, 0),
            (&unmanaged.progs.to_container, &est, 0),
            (&ep.progs.from_container, &reply, 0),
        ]
        .into_iter()
        .enumerate()
        {
            let (rc, ns) = run(prog, pkt, RUNS);
            assert_eq!(rc, verdict);
            rounds[i].push(ns);
        }
    }
    let report = |what: &str, v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        println!(
            "{what}: {:.0} ns per packet (median of {ROUNDS} rounds of {RUNS} runs; range {:.0}-{:.0})",
            v[v.len() / 2],
            v[0],
            v[v.len() - 1]
        );
    };
    let [syn_ns, denied_ns, est_ns, unmanaged_ns, reply_ns] = &mut rounds;
    report(
        "new TCP connection (SYN) allowed by an L3/L4 rule, warm",
        syn_ns,
    );
    report("denied packet (default deny, with its event)", denied_ns);
    report("established flow through conntrack", est_ns);
    report("unmanaged interface", unmanaged_ns);
    report(
        "reply of an established flow, egress (conntrack, host routing lookup)",
        reply_ns,
    );

    ipv6_against_ipv4(&mut dp, &ep.progs.to_container, dst);
    tiered_map_ab(&mut dp, &pins);
    host_firewall(&mut dp, &pins);

    // The same established packet timed one run per call, as the new connections are: what a
    // single-run measurement adds by itself.
    let mut one: Vec<f64> = (0..20_000)
        .map(|_| run(&ep.progs.to_container, &est, 1).1)
        .collect();
    one.sort_by(|a, b| a.total_cmp(b));
    println!("established flow timed one run per call (control for the new-connection figure): median {:.0} ns", one[one.len() / 2]);

    // Attaching an endpoint to an interface: load and verify its program instance, attach both
    // directions. This is also what a restarted agent does for every endpoint.
    let mut attach_ms = Vec::new();
    let mut reattach_ms = Vec::new();
    let mut upgrade_ms = Vec::new();
    for i in 0..20u16 {
        let ifname = format!("cilbench{i}");
        let peer = format!("cilbenchp{i}");
        let ok = std::process::Command::new("ip")
            .args([
                "link", "add", &ifname, "type", "veth", "peer", "name", &peer,
            ])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "create veth {ifname}");
        let t = Instant::now();
        dp.attach_endpoint(&EndpointAttachment {
            id: 100 + i,
            interface: Some(ifname.clone()),
            ips: vec![],
            identity: 2000 + i as u32,
            mac: None,
        })
        .unwrap();
        attach_ms.push(t.elapsed().as_secs_f64() * 1e3);
        // What a restarted agent of the same build does: attach the same endpoint again (the
        // running instance is recognised and kept).
        let again = EndpointAttachment {
            id: 100 + i,
            interface: Some(ifname.clone()),
            ips: vec![],
            identity: 2000 + i as u32,
            mac: None,
        };
        let t = Instant::now();
        dp.attach_endpoint(&again).unwrap();
        reattach_ms.push(t.elapsed().as_secs_f64() * 1e3);
        // What an upgraded agent does: a new instance swapped into the pinned links.
        dp.set_reuse_running_programs(false);
        let t = Instant::now();
        dp.attach_endpoint(&again).unwrap();
        upgrade_ms.push(t.elapsed().as_secs_f64() * 1e3);
        dp.set_reuse_running_programs(true);
        dp.detach_endpoint(100 + i).unwrap();
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &ifname])
            .status();
    }
    attach_ms.sort_by(|a, b| a.total_cmp(b));
    println!(
        "attaching an endpoint to an interface (program load + verify + TCX link): median {:.1} ms, max {:.1} ms ({} endpoints)",
        attach_ms[attach_ms.len() / 2],
        attach_ms[attach_ms.len() - 1],
        attach_ms.len()
    );
    reattach_ms.sort_by(|a, b| a.total_cmp(b));
    println!(
        "re-attaching it, as a restarted agent of the same build does (running instance kept): median {:.2} ms, max {:.2} ms",
        reattach_ms[reattach_ms.len() / 2],
        reattach_ms[reattach_ms.len() - 1]
    );
    upgrade_ms.sort_by(|a, b| a.total_cmp(b));
    println!(
        "re-attaching it after an upgrade (new instance swapped into the pinned links): median {:.1} ms, max {:.1} ms",
        upgrade_ms[upgrade_ms.len() / 2],
        upgrade_ms[upgrade_ms.len() - 1]
    );

    drop(ep);
    drop(unmanaged);
    drop(dp);
    let _ = std::fs::remove_dir_all(&root);
}

/// The endpoint's warm new connection and established packet over IPv6 against IPv4: the same
/// peer identities (the IPv6 peers get ipcache entries of their own), the same rule, each
/// round timing the four in turn; ratios per round, reported as the median with the range.
fn ipv6_against_ipv4(dp: &mut BpfDatapath, prog: &libbpf_rs::ProgramMut<'_>, dst: [u8; 4]) {
    for i in [1u32, 6] {
        let a = std::net::Ipv6Addr::from(addr6(i));
        dp.upsert_ipcache(format!("{a}/128").parse().unwrap(), 1000 + i)
            .unwrap();
    }
    let dst6 = addr6(0xff_ff01);
    let (syn4, syn6) = (
        packet(addr(6), dst, 4444, 80, SYN),
        packet6(addr6(6), dst6, 4444, 80, SYN),
    );
    let (est4, est6) = (
        packet(addr(1), dst, 1026, 80, ACK),
        packet6(addr6(1), dst6, 1026, 80, ACK),
    );
    for opening in [
        packet(addr(1), dst, 1026, 80, SYN),
        packet6(addr6(1), dst6, 1026, 80, SYN),
    ] {
        assert_eq!(run(prog, &opening, 1).0, 0, "allowed");
    }
    const ROUNDS: usize = 9;
    const RUNS: u32 = 100_000;
    let (mut syn_ratio, mut est_ratio) = (Vec::new(), Vec::new());
    let (mut syn_ns, mut est_ns) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let t: Vec<f64> = [&syn4, &syn6, &est4, &est6]
            .into_iter()
            .map(|pkt| {
                let (rc, ns) = run(prog, pkt, RUNS);
                assert_eq!(rc, 0, "allowed");
                ns
            })
            .collect();
        syn_ratio.push(t[1] / t[0]);
        est_ratio.push(t[3] / t[2]);
        syn_ns.push((t[0], t[1]));
        est_ns.push((t[2], t[3]));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    let pair_median = |v: &[(f64, f64)]| {
        let (mut a, mut b): (Vec<f64>, Vec<f64>) = v.iter().copied().unzip();
        (median(&mut a).0, median(&mut b).0)
    };
    for (what, ratios, ns) in [
        ("new TCP connection (SYN), warm", &mut syn_ratio, &syn_ns),
        (
            "established flow through conntrack",
            &mut est_ratio,
            &est_ns,
        ),
    ] {
        let (m, lo, hi) = median(ratios);
        let (v4, v6) = pair_median(ns);
        println!(
            "IPv6 / IPv4, {what}: {m:.2} (range {lo:.2}-{hi:.2} over {ROUNDS} interleaved rounds of {RUNS} runs; medians {v4:.0} ns IPv4, {v6:.0} ns IPv6)"
        );
    }
}

/// The engine of `resolve/selected_by_1000_rules` (`benches/policy.rs`) over `n` identities
/// `x/app-N` (there 1,000): 1,000 CiliumNetworkPolicies selecting every pod of `x`, each
/// allowing 5 of them on a TCP and a UDP port; and `tiers` ClusterNetworkPolicies on top, whose
/// namespace rules name all `n` (a namespace of N identities on P ports is up to N x P
/// entries: with 1,000 the tiered map would not fit the datapath).
fn tier_bench_map(n: usize, tiers: usize) -> (ciliate::policy::mapstate::MapState, Vec<u32>) {
    use ciliate::policy::engine::{EndpointView, PolicyEngine};
    let mut e = PolicyEngine::new();
    let ids: Vec<u32> = (0..n)
        .map(|i| {
            e.allocate_identity(&engine::pod_labels("x", &format!("app-{i}")))
                .id()
        })
        .collect();
    for r in 0..1000 {
        let vals: Vec<String> = (0..5)
            .map(|k| format!("app-{}", (r + k * 37) % n))
            .collect();
        engine::add_policy(
            &mut e,
            &format!(
                "{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: r{r}, namespace: x}}, spec: {{endpointSelector: {{}}, ingress: [{{fromEndpoints: [{{matchExpressions: [{{key: app, operator: In, values: [{}]}}]}}], toPorts: [{{ports: [{{port: \"{}\", protocol: TCP}}, {{port: \"{}\", protocol: UDP}}]}}]}}]}}}}",
                vals.join(", "),
                1000 + r % 50,
                2000 + r % 50
            ),
        );
    }
    engine::add_tier_policies(&mut e, tiers);
    let labels = engine::pod_labels("x", "me");
    let id = e.allocate_identity(&labels).id();
    let view = EndpointView {
        identity: id,
        labels: &labels,
        named_ports: &[],
        host: false,
    };
    (e.resolve(&view).map, ids)
}

/// The kinds of a map's datapath entries: (any identity, protocol, port prefix length) -> count.
fn entry_kinds(map: &ciliate::policy::mapstate::MapState) -> String {
    let mut kinds = std::collections::BTreeMap::new();
    for (k, v) in map.entries() {
        for e in ciliate::datapath::abi::expand_key(&k) {
            *kinds
                .entry((e.identity == 0, e.protocol, e.port_prefix_len, v.deny))
                .or_insert(0) += 1;
        }
    }
    kinds
        .iter()
        .map(|((any, p, len, deny), n)| {
            format!(
                "{} {}/{p}/{len}: {n}",
                if *deny { "deny" } else { "allow" },
                if *any { "any" } else { "id" }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Datapath entries of a map (port ranges split into prefixes).
fn datapath_entries(map: &ciliate::policy::mapstate::MapState) -> usize {
    map.entries()
        .iter()
        .map(|(k, _)| ciliate::datapath::abi::expand_key(k).len())
        .sum()
}

/// Issue #28's A/B: a new connection and an established packet against a plain endpoint's map
/// and a tiered one, in one process, interleaved.
fn tiered_map_ab(dp: &mut BpfDatapath, pins: &std::path::Path) {
    use ciliate::policy::mapstate::{MapState, MapVerdict};
    use ciliate::policy::rule::{Direction, PROTO_TCP};
    const IDENTITIES: usize = 200;
    let (plain, ids) = tier_bench_map(IDENTITIES, 0);
    let (tiers, tiered) = [100, 50, 20, 10]
        .into_iter()
        .map(|t| (t, tier_bench_map(IDENTITIES, t).0))
        .find(|(t, m)| {
            let fits = datapath_entries(m) <= 16_384;
            if !fits {
                println!("cluster tiers: {t} ClusterNetworkPolicies: {} datapath entries, more than the map holds", datapath_entries(m));
            }
            fits
        })
        .expect("some number of tier policies fits the map");
    println!(
        "cluster tiers: over {IDENTITIES} identities, the map of 1,000 CNPs {} entries ({} datapath); with {tiers} ClusterNetworkPolicies of 25 rules too {} entries ({} datapath)",
        plain.len(),
        datapath_entries(&plain),
        tiered.len(),
        datapath_entries(&tiered)
    );
    println!(
        "cluster tiers: entry kinds (allow|deny identity|any/protocol/port prefix length): plain {}; tiered {}",
        entry_kinds(&plain),
        entry_kinds(&tiered)
    );
    let flags = EndpointFlags {
        ingress_default_deny: true,
        ..Default::default()
    };
    // Peers at 10.97.N.M with the engine's identities (ids[i] at 10.97.i/256.i%256).
    let peer = |i: usize| [10, 97, (i / 256) as u8, (i % 256) as u8];
    for (i, id) in ids.iter().enumerate() {
        let a = peer(i);
        dp.upsert_ipcache(
            format!("{}.{}.{}.{}/32", a[0], a[1], a[2], a[3])
                .parse()
                .unwrap(),
            *id,
        )
        .unwrap();
    }
    let dst = [10, 99, 0, 2];
    let mut samples: Vec<Vec<(Vec<u8>, Vec<u8>)>> = Vec::new();
    for (ep, map) in [(21u16, &plain), (22u16, &tiered)] {
        dp.attach_endpoint(&EndpointAttachment {
            id: ep,
            interface: None,
            ips: vec![],
            identity: 2,
            mac: None,
        })
        .unwrap();
        dp.sync_policy(ep, flags, &map.diff_from(&MapState::new()), true)
            .unwrap();
        // Up to 32 allowed (peer, TCP port) pairs of the map, spread over the peers.
        let mut pairs = Vec::new();
        for (i, id) in ids.iter().enumerate().step_by(7) {
            for port in 1000..1050u16 {
                if matches!(
                    map.lookup(Direction::Ingress, *id, PROTO_TCP, port),
                    MapVerdict::Allowed(_)
                ) {
                    let sport = 3000 + pairs.len() as u16;
                    pairs.push((
                        packet(peer(i), dst, sport, port, SYN),
                        packet(peer(i), dst, sport, port, ACK),
                    ));
                    break;
                }
            }
            if pairs.len() == 32 {
                break;
            }
        }
        assert!(
            pairs.len() >= 8,
            "endpoint {ep}: allowed pairs {}",
            pairs.len()
        );
        samples.push(pairs);
    }
    let (mut s21, mut s22) = (MaybeUninit::uninit(), MaybeUninit::uninit());
    let progs = [
        load_program(&mut s21, pins, 21).unwrap(),
        load_program(&mut s22, pins, 22).unwrap(),
    ];
    const ROUNDS: usize = 7;
    const RUNS: u32 = 20_000;
    // Per endpoint: per round, the median over its pairs; new connection and established.
    let mut syn: [Vec<f64>; 2] = Default::default();
    let mut est: [Vec<f64>; 2] = Default::default();
    for _ in 0..ROUNDS {
        for k in 0..2 {
            let prog = &progs[k].progs.to_container;
            let mut s: Vec<f64> = Vec::new();
            let mut e: Vec<f64> = Vec::new();
            for (open, ack) in &samples[k] {
                let (rc, ns) = run(prog, open, RUNS);
                assert_eq!(rc, 0, "endpoint {}: allowed", 21 + k);
                s.push(ns);
                let (rc, ns) = run(prog, ack, RUNS);
                assert_eq!(rc, 0);
                e.push(ns);
            }
            for (v, out) in [(s, &mut syn[k]), (e, &mut est[k])] {
                let mut v = v;
                v.sort_by(|a, b| a.total_cmp(b));
                out.push(v[v.len() / 2]);
            }
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    // The per-round difference, so both sides of a round share the machine's moment.
    let diff = |v: &[Vec<f64>; 2]| {
        let d: Vec<f64> = v[1].iter().zip(&v[0]).map(|(b, a)| b - a).collect();
        let mut s = d.clone();
        s.sort_by(|a, b| a.total_cmp(b));
        (median(&d), s[0], s[s.len() - 1])
    };
    for (what, v) in [
        ("new TCP connection, warm", &syn),
        ("established flow", &est),
    ] {
        let (d, lo, hi) = diff(v);
        println!(
            "cluster tiers, {what}: plain {:.0} ns, tiered {:.0} ns per packet; tiered - plain {d:+.0} ns (median of {ROUNDS} rounds, range {lo:+.0} to {hi:+.0}; {} and {} peers)",
            median(&v[0]),
            median(&v[1]),
            samples[0].len(),
            samples[1].len()
        );
    }
    drop(progs);
    for ep in [21u16, 22] {
        dp.detach_endpoint(ep).unwrap();
    }
}

/// The host firewall's paths on the node's device (`from_netdev`, `to_netdev`), with the host
/// endpoint's policy allowing TCP 22 in from one peer and TCP 443 out to another, everything
/// else isolated both ways; interleaved over 7 rounds like the endpoint's figures.
fn host_firewall(dp: &mut BpfDatapath, pins: &std::path::Path) {
    packets::host_endpoint(dp);
    let (host, id) = (packets::NODE, ciliate::datapath::HOST_ENDPOINT_ID);
    let mut storage = MaybeUninit::uninit();
    let nd = ciliate::datapath::bpf::load_netdev_program(&mut storage, pins, false).unwrap();
    const UNSPEC: u32 = u32::MAX; // TC_ACT_UNSPEC (-1): allowed, on to the stack
    let in_syn = packet(addr(2), host, 5555, 22, SYN);
    let in_est = packet(addr(2), host, 5556, 22, ACK);
    let out_syn = packet(host, addr(3), 6666, 443, SYN);
    let out_est = packet(host, addr(3), 6667, 443, ACK);
    let in_denied = packet(addr(4), host, 5557, 23, SYN);
    let neither = packet(addr(4), addr(5), 5558, 80, SYN);
    let in_reply = packet(addr(3), host, 443, 6667, ACK);
    let out_reply = packet(host, addr(2), 22, 5556, ACK);
    // The established ones' connections, opened once.
    assert_eq!(
        run(
            &nd.progs.from_netdev,
            &packet(addr(2), host, 5556, 22, SYN),
            1
        )
        .0,
        UNSPEC
    );
    assert_eq!(
        run(
            &nd.progs.to_netdev,
            &packet(host, addr(3), 6667, 443, SYN),
            1
        )
        .0,
        UNSPEC
    );
    const ROUNDS: usize = 7;
    const RUNS: u32 = 100_000;
    let cases = [
        (
            "node's device, ingress: new connection to the node (SYN), warm",
            &nd.progs.from_netdev,
            &in_syn,
            UNSPEC,
        ),
        (
            "node's device, ingress: established packet to the node",
            &nd.progs.from_netdev,
            &in_est,
            UNSPEC,
        ),
        (
            "node's device, ingress: denied (default deny, with its event)",
            &nd.progs.from_netdev,
            &in_denied,
            2,
        ),
        (
            "node's device, ingress: a packet for neither the node nor a pod",
            &nd.progs.from_netdev,
            &neither,
            UNSPEC,
        ),
        (
            "node's device, egress: new connection from the node (SYN), warm",
            &nd.progs.to_netdev,
            &out_syn,
            UNSPEC,
        ),
        (
            "node's device, egress: established packet from the node",
            &nd.progs.to_netdev,
            &out_est,
            UNSPEC,
        ),
        (
            "node's device, ingress: reply to a connection the node opened",
            &nd.progs.from_netdev,
            &in_reply,
            UNSPEC,
        ),
        (
            "node's device, egress: reply of a connection to the node",
            &nd.progs.to_netdev,
            &out_reply,
            UNSPEC,
        ),
    ];
    let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..ROUNDS {
        for (i, (_, prog, pkt, verdict)) in cases.iter().enumerate() {
            let (rc, ns) = run(prog, pkt, RUNS);
            assert_eq!(rc, *verdict, "{}", cases[i].0);
            rounds[i].push(ns);
        }
    }
    for ((what, ..), v) in cases.iter().zip(rounds.iter_mut()) {
        v.sort_by(|a, b| a.total_cmp(b));
        println!(
            "host firewall, {what}: {:.0} ns per packet (median of {ROUNDS} rounds of {RUNS} runs; range {:.0}-{:.0})",
            v[v.len() / 2],
            v[0],
            v[v.len() - 1]
        );
    }
    dp.detach_endpoint(id).unwrap();
}
