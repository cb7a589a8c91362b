//! The datapath against a baseline, interleaved (issue #33), a bench binary:
//! `sudo cargo bench --bench datapath_ab`.
//!
//! Benches of two trees run minutes apart on this machine disagree by more than the changes
//! they are meant to show (one pair said +39 %, another -15 %). Here both BPF objects live in one
//! process on the same maps and take turns: each round times every packet kind on the
//! baseline and on today's object back to back (which goes first alternates), and the rounds
//! go on until the 95 % confidence interval of every ratio (today / baseline, the geometric
//! mean over rounds) is within +-3 %, or `CILIATE_AB_MAX_ROUNDS` (default 60) is reached.
//! For a profiler: `CILIATE_AB_ONLY=<part of a case's name>` runs only those cases, and
//! `CILIATE_AB_MIN_ROUNDS` keeps them going past the interval.
//!
//! - Both objects are compiled here, the same way (`build.rs`'s clang arguments and libbpf's
//!   linker, as libbpf-cargo does): the baseline from `git archive $CILIATE_AB_BASELINE bpf`
//!   (default `91a4aeb`), today's from this tree's `bpf/` (or `$CILIATE_AB_CANDIDATE`, a commit).
//! - The state is today's agent code's (`BpfDatapath`): 100,000 ipcache entries, endpoint 7 with
//!   16,384 ingress entries (as `cargo bench --bench datapath`). Each object reuses the pinned
//!   maps whose definition it shares; a map whose definition differs (a record that grew, a
//!   counter array with more reasons) gets a copy of its own, with each value cut to, or
//!   zero-extended to, the object's size: the maps' records only ever grow at their end.
//! - Packets, kernel-timed (`BPF_PROG_TEST_RUN`): an established flow's ACK (conntrack hit),
//!   a new connection's SYN run again and again (warm), a denied SYN (default deny, its event;
//!   the ring buffer is emptied between timed runs, so every event is written, none lost to a
//!   full buffer), the endpoint's reply through
//!   `from_container`, and new connections from 20,000 distinct peers, one run each (cold; the
//!   median of a round). Beside the cold figure, the warm SYN timed the same way (one run each,
//!   20,000 of them, the median): its floor, what a single run costs with every map entry in
//!   cache (the kernel's timer and the caches a syscall leaves), so the cold figure's own part
//!   is the difference.
//! - The settings map is each object's own: allow events (a verdict event for every new allowed
//!   connection) as each tree's agent sets them: on for today's, off for 91a4aeb's (which never
//!   turned them on; `CILIATE_AB_BASELINE_ALLOW_EVENTS=1` turns them on;
//!   `CILIATE_AB_CANDIDATE_ALLOW_EVENTS=0` turns today's off, to see what they cost).
//! - Each object's programs: the verifier's processed instructions (`verified_insns`) and the
//!   translated size, deterministic figures beside the timed ones.
//! - The node device's programs, when both objects have them (`from_netdev`, `to_netdev`):
//!   a packet of an established flow and a new connection delivered into a local pod (BPF
//!   host routing; TTL 255 and 200 runs a round, since each run forwards the same packet
//!   again), and, with a host endpoint whose policy allows TCP 22 in and TCP 443 out, the
//!   host firewall's new connections and established packets both ways and a packet for
//!   neither the node nor a pod.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use libbpf_rs::libbpf_sys;
use libbpf_rs::{AsRawLibbpf, MapCore, MapFlags, MapHandle, MapType, Object, ObjectBuilder};

use ciliate::datapath::bpf::datapath::BpfDatapath;
use ciliate::datapath::bpf::ensure_bpffs;
use ciliate::datapath::EndpointFlags;

#[path = "shared/packets.rs"]
mod packets;
use packets::{addr, allow_16k, fill_ipcache, packet, ACK, NODE, SYN};

const EP: u32 = 7;
/// Repeats of one packet per timed run (their events fit in the 1 MiB ring buffer).
const RUNS: u32 = 10_000;
/// Single runs between two drains of the ring buffer.
const DRAIN_EVERY: usize = 5_000;
/// Distinct peers of the cold new-connection figure.
const COLD: u32 = 20_000;
const MIN_ROUNDS: usize = 6;
/// The confidence interval every ratio must reach (half width, relative).
const TARGET: f64 = 0.03;

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("datapath A/B bench: run with `cargo bench --bench datapath_ab` (as root)");
        return;
    }
    assert!(
        nix::unistd::geteuid().is_root(),
        "the datapath A/B bench needs root"
    );
    let baseline = std::env::var("CILIATE_AB_BASELINE").unwrap_or_else(|_| "91a4aeb".into());
    let candidate = std::env::var("CILIATE_AB_CANDIDATE").ok();
    let max_rounds: usize = std::env::var("CILIATE_AB_MAX_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    // For a profiler: more rounds than the interval needs, of the cases whose name contains
    // `CILIATE_AB_ONLY`.
    let min_rounds: usize = std::env::var("CILIATE_AB_MIN_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(MIN_ROUNDS)
        .min(max_rounds);
    let only = std::env::var("CILIATE_AB_ONLY").ok();
    let work = tempfile::tempdir().unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let base_obj = build_object(
        &tree_of(repo, Some(&baseline), work.path(), "a"),
        work.path(),
        "a",
    );
    let cand_obj = build_object(
        &tree_of(repo, candidate.as_deref(), work.path(), "b"),
        work.path(),
        "b",
    );

    let root = PathBuf::from(format!("/sys/fs/bpf/ciliate-ab-{}", std::process::id()));
    ensure_bpffs(&root).unwrap();
    let shared = root.join("ciliate");
    let mut dp = BpfDatapath::open(&root).unwrap();
    fill(&mut dp);

    // 91a4aeb's agent never turned allow events on; today's does (BpfDatapath::open).
    let base_events = std::env::var("CILIATE_AB_BASELINE_ALLOW_EVENTS").is_ok_and(|v| v == "1");
    // `CILIATE_AB_CANDIDATE_ALLOW_EVENTS=0`: today's without them, to see what they cost.
    let cand_events = std::env::var("CILIATE_AB_CANDIDATE_ALLOW_EVENTS")
        .ok()
        .map(|v| v != "0");
    fill_node_device(&mut dp, &shared);
    let a = load(&base_obj, &shared, &root.join("a"), Some(base_events));
    let b = load(&cand_obj, &shared, &root.join("b"), cand_events);
    let events = MapHandle::from_pinned_path(shared.join("events")).unwrap();
    let mut rb = libbpf_rs::RingBufferBuilder::new();
    rb.add(&events, |_| 0).unwrap();
    let drain = rb.build().unwrap();
    let today = candidate.as_deref().unwrap_or("this tree");
    println!("baseline {baseline} (A) against {today} (B); ratios are B / A");
    println!(
        "allow events: A {}, B {} (CILIATE_AB_BASELINE_ALLOW_EVENTS=1 turns them on for A, \
         CILIATE_AB_CANDIDATE_ALLOW_EVENTS=0 off for B)\n",
        if base_events { "on" } else { "off" },
        if cand_events == Some(false) {
            "off"
        } else {
            "on"
        }
    );
    println!("program         A verified insns  B verified insns   A xlated bytes  B xlated bytes");
    let node_device = [&a, &b].iter().all(|o| has_prog(&o.obj, "to_netdev"));
    let names: &[&str] = if node_device {
        &["to_container", "from_container", "from_netdev", "to_netdev"]
    } else {
        &["to_container", "from_container"]
    };
    for name in names {
        let (ia, xa) = prog_figures(&a.obj, name);
        let (ib, xb) = prog_figures(&b.obj, name);
        println!("{name:<15} {ia:>16}  {ib:>16}   {xa:>14}  {xb:>14}");
    }
    for note in a.notes.iter().chain(&b.notes) {
        println!("{note}");
    }

    let dst = [10, 99, 0, 1];
    let opening = packet(addr(1), dst, 1025, 80, SYN);
    for o in [&a, &b] {
        assert_eq!(run(&o.obj, "to_container", &opening, 1).0, 0, "open");
        if node_device {
            open_node_device_flows(&o.obj);
        }
    }
    let mut cases: Vec<Case> = vec![
        Case::repeated(
            "established flow through conntrack",
            "to_container",
            packet(addr(1), dst, 1025, 80, ACK),
            0,
        ),
        Case::repeated(
            "new TCP connection, warm (one SYN again and again)",
            "to_container",
            packet(addr(6), dst, 4444, 80, SYN),
            0,
        ),
        Case::repeated(
            "denied packet (default deny, with its event)",
            "to_container",
            packet(addr(5), dst, 999, 81, SYN),
            2,
        ),
        Case::repeated(
            "reply of an established flow, egress",
            "from_container",
            packet(dst, addr(1), 80, 1025, ACK),
            0,
        ),
        Case {
            what: "new TCP connection, one SYN again, one run each (the cold figure's floor)",
            prog: "to_container",
            packets: vec![packet(addr(6), dst, 4444, 80, SYN); COLD as usize],
            verdict: 0,
            repeat: 1,
        },
        Case {
            what: "new TCP connection, distinct peers (cold, one run each, median)",
            prog: "to_container",
            packets: (0..COLD)
                .map(|i| packet(addr(i % 16_384), dst, 1024 + (i % 60_000) as u16, 80, SYN))
                .collect(),
            verdict: 0,
            repeat: 1,
        },
    ];
    if node_device {
        cases.extend(node_device_cases(dst));
    }
    if let Some(only) = &only {
        cases.retain(|c| c.what.contains(only.as_str()));
        assert!(!cases.is_empty(), "no case's name contains {only:?}");
    }
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    let mut ns: Vec<[Vec<f64>; 2]> = vec![Default::default(); cases.len()];
    let mut rounds = 0;
    while rounds < max_rounds {
        for (k, c) in cases.iter().enumerate() {
            let order: [usize; 2] = if rounds % 2 == 0 { [0, 1] } else { [1, 0] };
            let mut t = [0.0; 2];
            for side in order {
                t[side] = c.time(if side == 0 { &a.obj } else { &b.obj }, &drain);
            }
            ratios[k].push((t[1] / t[0]).ln());
            ns[k][0].push(t[0]);
            ns[k][1].push(t[1]);
        }
        rounds += 1;
        if rounds >= min_rounds && ratios.iter().all(|r| interval(r).1 <= TARGET) {
            break;
        }
    }
    println!("\n{rounds} interleaved rounds ({RUNS} runs a packet a round; 95 % CI of the geometric mean ratio)");
    let mut wide = false;
    for (k, c) in cases.iter().enumerate() {
        let (ratio, half) = interval(&ratios[k]);
        wide |= half > TARGET;
        println!(
            "{}: B/A {ratio:.3} ({:.3}-{:.3}); median ns A {:.0}, B {:.0}",
            c.what,
            ratio * (1.0 - half),
            ratio * (1.0 + half),
            median(&mut ns[k][0]),
            median(&mut ns[k][1])
        );
    }
    if wide {
        println!("(a ratio's interval is still wider than +-{:.0} % after {rounds} rounds: the machine is noisy; raise CILIATE_AB_MAX_ROUNDS)", TARGET * 100.0);
    }
    drop(a);
    drop(b);
    drop(dp);
    let _ = std::fs::remove_dir_all(&root);
}

/// One packet kind: repeated runs of one packet, or one run each of many (the median).
struct Case {
    what: &'static str,
    prog: &'static str,
    packets: Vec<Vec<u8>>,
    verdict: i32,
    /// Runs of the one packet per timed run.
    repeat: u32,
}

impl Case {
    fn repeated(what: &'static str, prog: &'static str, pkt: Vec<u8>, verdict: i32) -> Case {
        Case {
            what,
            prog,
            packets: vec![pkt],
            verdict,
            repeat: RUNS,
        }
    }

    /// Nanoseconds per packet on `obj`. The ring buffer is emptied between timed runs (as the
    /// agent reads it), so that every event is reserved and submitted, none lost to a full
    /// buffer: `RUNS` and `DRAIN_EVERY` events fit in it.
    fn time(&self, obj: &Object, drain: &libbpf_rs::RingBuffer) -> f64 {
        if let [pkt] = self.packets.as_slice() {
            let (rc, ns) = run(obj, self.prog, pkt, self.repeat);
            assert_eq!(rc, self.verdict, "{}", self.what);
            drain.consume().unwrap();
            return ns;
        }
        let mut v = Vec::with_capacity(self.packets.len());
        for chunk in self.packets.chunks(DRAIN_EVERY) {
            for p in chunk {
                let (rc, ns) = run(obj, self.prog, p, 1);
                assert_eq!(rc, self.verdict, "{}", self.what);
                v.push(ns);
            }
            drain.consume().unwrap();
        }
        median(&mut v)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The geometric mean of the ratios whose logarithms are `logs`, and the relative half width of
/// its 95 % confidence interval (Student's t).
fn interval(logs: &[f64]) -> (f64, f64) {
    let n = logs.len() as f64;
    let mean = logs.iter().sum::<f64>() / n;
    if logs.len() < 2 {
        return (mean.exp(), f64::INFINITY);
    }
    let var = logs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    let half = t95(logs.len() - 1) * (var / n).sqrt();
    (mean.exp(), half.exp() - 1.0)
}

/// Student's t, two-sided 95 %, for `df` degrees of freedom.
fn t95(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::INFINITY,
        1..=30 => T[df - 1],
        31..=60 => 2.000,
        _ => 1.984,
    }
}

fn run(obj: &Object, prog: &str, pkt: &[u8], repeat: u32) -> (i32, f64) {
    let p = obj
        .progs_mut()
        .find(|p| p.name() == prog)
        .unwrap_or_else(|| panic!("the object has no program {prog}"));
    let (verdict, ns) = packets::timed_run(&p, pkt, repeat);
    (verdict as i32, ns)
}

/// The verifier's processed instructions and the translated size of one program.
fn prog_figures(obj: &Object, prog: &str) -> (u32, u32) {
    let p = obj.progs().find(|p| p.name() == prog).unwrap();
    let mut info = libbpf_sys::bpf_prog_info::default();
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&p.as_fd());
    let rc = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd, &mut info, &mut len) };
    assert_eq!(rc, 0, "bpf_prog_get_info_by_fd {prog}");
    (info.verified_insns, info.xlated_prog_len)
}

/// The `bpf/` directory of `commit` (extracted under `work/name`), or this tree's.
fn tree_of(repo: &Path, commit: Option<&str>, work: &Path, name: &str) -> PathBuf {
    let Some(commit) = commit else {
        return repo.join("bpf");
    };
    let dir = work.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let archive = Command::new("git")
        .args(["-C"])
        .arg(repo)
        .args(["archive", "--format=tar", commit, "bpf"])
        .output()
        .expect("git");
    assert!(
        archive.status.success(),
        "git archive {commit} bpf: {} (the baseline needs this repository's history)",
        String::from_utf8_lossy(&archive.stderr)
    );
    let tar = work.join(format!("{name}.tar"));
    std::fs::write(&tar, &archive.stdout).unwrap();
    let ok = Command::new("tar")
        .arg("-xf")
        .arg(&tar)
        .arg("-C")
        .arg(&dir)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "unpack {commit}'s bpf/");
    dir.join("bpf")
}

/// Compiles `bpf/ciliate.bpf.c` of a tree as `build.rs` does through libbpf-cargo (its clang
/// arguments, libbpf's headers, then libbpf's linker), into `work/name.o`.
fn build_object(bpf: &Path, work: &Path, name: &str) -> PathBuf {
    let include = work.join("libbpf-include");
    std::fs::create_dir_all(include.join("bpf")).unwrap();
    for (file, text) in libbpf_sys::API_HEADERS {
        std::fs::write(include.join("bpf").join(file), text).unwrap();
    }
    let multiarch = match std::env::consts::ARCH {
        "aarch64" => "aarch64-linux-gnu",
        _ => "x86_64-linux-gnu",
    };
    let target_arch = match std::env::consts::ARCH {
        "aarch64" => "arm64",
        _ => "x86",
    };
    let compiled = work.join(format!("{name}.compiled.o"));
    let out = Command::new("clang")
        .arg("-I")
        .arg(bpf)
        .arg("-I")
        .arg(format!("/usr/include/{multiarch}"))
        .arg("-I")
        .arg(&include)
        .arg("-fno-stack-protector")
        .arg(format!("-D__TARGET_ARCH_{target_arch}"))
        .args(["-g", "-O2", "-target", "bpf", "-c"])
        .arg(bpf.join("ciliate.bpf.c"))
        .arg("-o")
        .arg(&compiled)
        .output()
        .expect("clang");
    assert!(
        out.status.success(),
        "compile {}: {}",
        bpf.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let linked = work.join(format!("{name}.o"));
    let mut linker = libbpf_rs::Linker::new(&linked).unwrap();
    linker.add_file(&compiled).unwrap();
    linker.link().unwrap();
    linked
}

/// One object, loaded on the shared pinned maps where it can.
struct Loaded {
    obj: Object,
    /// The maps it got copies of, and why.
    notes: Vec<String>,
}

/// Loads an endpoint instance (`ENDPOINT_ID` = `EP`) of `path`: each pinned map of the same
/// definition as the one under `shared` is reused; any other is created under `private` and
/// filled from the shared one (values cut or zero-extended).
fn load(path: &Path, shared: &Path, private: &Path, allow_events: Option<bool>) -> Loaded {
    std::fs::create_dir_all(private).unwrap();
    let mut open = ObjectBuilder::default()
        .pin_root_path(private)
        .unwrap()
        .open_file(path)
        .unwrap();
    let mut copies = Vec::new();
    let mut notes = Vec::new();
    for mut m in open.maps_mut() {
        let name = m.name().to_string_lossy().into_owned();
        if name.ends_with(".rodata") {
            let v = m.initial_value_mut().expect("rodata");
            assert_eq!(
                v.len(),
                4,
                "{}: .rodata holds only ENDPOINT_ID",
                path.display()
            );
            v.copy_from_slice(&EP.to_ne_bytes());
            continue;
        }
        let pinned =
            unsafe { !libbpf_sys::bpf_map__pin_path(m.as_libbpf_object().as_ptr()).is_null() };
        if !pinned {
            continue;
        }
        let at = shared.join(&name);
        let Ok(h) = MapHandle::from_pinned_path(&at) else {
            notes.push(format!("{}: {name} is new (empty)", path.display()));
            continue;
        };
        let info = libbpf_rs::MapInfo::new(h.as_fd()).unwrap().info;
        let same = h.map_type() == m.map_type()
            && h.key_size() == m.key_size()
            && h.value_size() == m.value_size()
            && info.max_entries == m.max_entries()
            && info.map_flags == m.map_flags();
        if same && name != "settings" {
            m.reuse_pinned_map(&at).unwrap();
        } else {
            if name == "settings" {
                copies.push((name, h));
                continue;
            }
            notes.push(format!(
                "{}: {name} differs (value {} bytes against {}, {} entries against {}): a copy",
                path.file_name().unwrap().to_string_lossy(),
                m.value_size(),
                h.value_size(),
                m.max_entries(),
                info.max_entries
            ));
            copies.push((name, h));
        }
    }
    let obj = open.load().unwrap();
    for (name, from) in copies {
        let to = obj
            .maps()
            .find(|m| m.name().to_string_lossy() == name)
            .unwrap();
        if !matches!(from.map_type(), MapType::Array | MapType::Hash) {
            continue;
        }
        let size = to.value_size() as usize;
        for key in from.keys() {
            let Some(mut v) = from.lookup(&key, MapFlags::ANY).unwrap() else {
                continue;
            };
            v.resize(size, 0);
            if key.len() == to.key_size() as usize {
                to.update(&key, &v, MapFlags::ANY).unwrap();
            }
        }
    }
    // The settings are each object's own: what its tree's agent writes.
    if let Some(on) = allow_events {
        let settings = obj.maps().find(|m| m.name() == "settings").unwrap();
        let mut v = vec![0u8; settings.value_size() as usize];
        v[..4].copy_from_slice(&(on as u32).to_ne_bytes());
        settings
            .update(&0u32.to_ne_bytes(), &v, MapFlags::ANY)
            .unwrap();
    }
    Loaded { obj, notes }
}

/// The datapath bench's state: 100,000 ipcache entries, endpoint `EP` allowing identities
/// 1000..17383 on TCP/80 at ingress, default deny.
fn fill(dp: &mut BpfDatapath) {
    fill_ipcache(dp);
    let flags = EndpointFlags {
        ingress_default_deny: true,
        ..Default::default()
    };
    packets::endpoint_with(dp, EP as u16, flags, allow_16k());
}

/// The TC verdicts of the node device's programs.
const TC_ACT_UNSPEC: i32 = -1;
const TC_ACT_REDIRECT: i32 = 7;
/// Runs a round of a packet BPF host routing forwards (one TTL each, from 255).
const FORWARDED_RUNS: u32 = 200;

fn has_prog(obj: &Object, name: &str) -> bool {
    obj.progs().any(|p| p.name() == name)
}

/// The node device's state: endpoint `EP` (10.99.0.1) delivered to by `from_netdev`, and the
/// host endpoint (10.98.0.1, identity host) allowing TCP 22 in from `addr(2)` and TCP 443 out
/// to `addr(3)`, default deny both ways.
fn fill_node_device(dp: &mut BpfDatapath, shared: &Path) {
    use ciliate::datapath::bpf::{types, Pod};
    let local = MapHandle::from_pinned_path(shared.join("local_endpoints")).unwrap();
    let le = types::local_endpoint {
        endpoint_id: EP,
        ifindex: 1,
        mac: [2, 0, 0, 0, 0, 7],
        node_mac: [2, 0, 0, 0, 0, 1],
    };
    local
        .update(&[10, 99, 0, 1], le.as_bytes(), MapFlags::ANY)
        .unwrap();
    packets::host_endpoint(dp);
}

/// A packet with TTL 255 (forwarded again on every run).
fn ttl255(mut p: Vec<u8>) -> Vec<u8> {
    p[22] = 255;
    p
}

/// The node device's cases (their flows opened by `open_node_device_flows`).
fn node_device_cases(dst: [u8; 4]) -> Vec<Case> {
    let forwarded = |what, pkt| Case {
        what,
        prog: "from_netdev",
        packets: vec![ttl255(pkt)],
        verdict: TC_ACT_REDIRECT,
        repeat: FORWARDED_RUNS,
    };
    vec![
        forwarded(
            "node device: established packet into a local pod",
            packet(addr(1), dst, 1025, 80, ACK),
        ),
        forwarded(
            "node device: new connection into a local pod (SYN), warm",
            packet(addr(6), dst, 4445, 80, SYN),
        ),
        Case::repeated(
            "host firewall: new connection to the node (SYN), warm",
            "from_netdev",
            packet(addr(2), NODE, 5555, 22, SYN),
            TC_ACT_UNSPEC,
        ),
        Case::repeated(
            "host firewall: established packet to the node",
            "from_netdev",
            packet(addr(2), NODE, 5556, 22, ACK),
            TC_ACT_UNSPEC,
        ),
        Case::repeated(
            "host firewall: new connection from the node (SYN), warm",
            "to_netdev",
            packet(NODE, addr(3), 6666, 443, SYN),
            TC_ACT_UNSPEC,
        ),
        Case::repeated(
            "host firewall: established packet from the node",
            "to_netdev",
            packet(NODE, addr(3), 6667, 443, ACK),
            TC_ACT_UNSPEC,
        ),
        Case::repeated(
            "host firewall: a packet for neither the node nor a pod",
            "from_netdev",
            packet(addr(4), addr(5), 5558, 80, ACK),
            TC_ACT_UNSPEC,
        ),
    ]
}

/// Opens the host firewall's established flows on `obj` (their SYNs, once).
fn open_node_device_flows(obj: &Object) {
    for (prog, pkt) in [
        ("from_netdev", packet(addr(2), NODE, 5556, 22, SYN)),
        ("to_netdev", packet(NODE, addr(3), 6667, 443, SYN)),
    ] {
        assert_eq!(run(obj, prog, &pkt, 1).0, TC_ACT_UNSPEC, "open {prog}");
    }
}
