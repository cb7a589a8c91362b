//! The cost of socket-level Service translation, a bench binary (root):
//! `cargo bench --bench service_lb`.
//!
//! 10,000 Services of 10 backends each are loaded into the BPF service maps through the
//! product's own path (`ServiceLb` over `datapath::bpf::services::attach`), attached to a cgroup
//! of this bench's that the bench process joins. Then, in a network namespace of the bench's
//! with only a loopback, TCP connections alternate between a ClusterIP:80 whose 10 backends are
//! `127.0.0.1..10:8080` and `127.0.0.1:8080` straight; the time of each `connect()` (handshake
//! done) is taken. The difference is what translation costs a connection (target <= 5 us).
//! Untranslated traffic to the ClusterIPs has no route in that namespace: nothing leaves it.
//!
//! Sizes: `CILIATE_BENCH_SERVICES` (default 10,000), `CILIATE_BENCH_CONNECTIONS` (per kind,
//! default 10,000).

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ciliate::services::{
    ServiceLb, ServicePort, ServiceSpec, SliceEndpoint, SlicePort, SliceSpec, TargetPort,
};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name}={v:?}")))
        .unwrap_or(default)
}

/// Removes what the bench made, whatever happens.
struct Cleanup {
    cgroup: PathBuf,
    home: PathBuf,
    pins: PathBuf,
    netns: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::write(
            self.home.join("cgroup.procs"),
            std::process::id().to_string(),
        );
        let _ = std::fs::remove_dir_all(&self.pins);
        for _ in 0..50 {
            if std::fs::remove_dir(&self.cgroup).is_ok() || !self.cgroup.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = ciliate::datapath::netdev::delete_netns(&self.netns);
    }
}

fn cluster_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 96, (i / 250) as u8, (i % 250 + 1) as u8)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("service_lb: needs root (BPF, cgroups, network namespaces); skipped");
        return;
    }
    let services = env("CILIATE_BENCH_SERVICES", 10_000).clamp(1, 60_000);
    let connections = env("CILIATE_BENCH_CONNECTIONS", 10_000);
    let tag = std::process::id();
    use ciliate::datapath::cgroup;
    let mount = cgroup::cgroup2_mount().expect("a cgroup v2 mount");
    let home = cgroup::own_cgroup(&mount).expect("this process's cgroup");
    let cleanup = Cleanup {
        cgroup: mount.join(format!("ciliate-lbbench-{tag}")),
        home,
        pins: PathBuf::from(format!("/sys/fs/bpf/ciliate-lbbench-{tag}")),
        netns: format!("ciliate-lbbench-{tag}"),
    };
    std::fs::create_dir_all(&cleanup.cgroup).expect("the bench's cgroup");
    std::fs::create_dir_all(&cleanup.pins).expect("pin directory");

    let maps = ciliate::datapath::bpf::services::attach(&cleanup.pins, &cleanup.cgroup)
        .expect("attach the service translation programs");
    let restored = maps.restore();
    let lb = ServiceLb::new(Box::new(maps), restored, None);
    lb.initial_sync_done();
    let http = |port| ServicePort {
        name: "http".into(),
        protocol: 6,
        port,
        target_port: Some(TargetPort::Number(8080)),
    };
    let load = Instant::now();
    let mut slice_writes = Vec::with_capacity(services);
    for i in 0..services {
        let name = format!("svc-{i}");
        lb.set_service(
            "bench",
            &name,
            Some(ServiceSpec {
                cluster_ips: vec![IpAddr::V4(cluster_ip(i))],
                ports: vec![http(80)],
            }),
        );
        // Service 0's backends listen on this bench's loopback; the others are only loaded.
        let backend = |k: usize| -> IpAddr {
            if i == 0 {
                IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1 + k as u8))
            } else {
                IpAddr::V4(Ipv4Addr::new(
                    10,
                    250,
                    (i / 250) as u8,
                    (i % 250) as u8 + k as u8,
                ))
            }
        };
        let t = Instant::now();
        lb.set_slice(
            &format!("bench/{name}-1"),
            Some(SliceSpec {
                namespace: "bench".into(),
                service: name,
                endpoints: (0..10)
                    .map(|k| SliceEndpoint {
                        address: backend(k),
                        ready: true,
                    })
                    .collect(),
                ports: vec![SlicePort {
                    name: "http".into(),
                    protocol: 6,
                    port: Some(8080),
                }],
            }),
        );
        slice_writes.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let counts = lb.counts();
    assert_eq!(counts.frontends, services, "{counts:?}");
    slice_writes.sort_by(f64::total_cmp);
    println!(
        "loaded {services} services x 10 backends into the BPF maps in {:.2} s; an EndpointSlice \
         write (table + maps): p50 {:.1} us, p99 {:.1} us",
        load.elapsed().as_secs_f64(),
        percentile(&slice_writes, 0.5),
        percentile(&slice_writes, 0.99)
    );

    // This process joins the cgroup; the measuring threads run in a namespace with only lo.
    cgroup::join_cgroup(&cleanup.cgroup).expect("join the bench's cgroup");
    let ns_path = ciliate::datapath::netdev::create_netns(&cleanup.netns).expect("netns");
    let enter = move || {
        let ns = std::fs::File::open(&ns_path).expect("netns file");
        nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
    };
    let enter2 = enter.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        enter2();
        std::process::Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("ip");
        // Own thread in the namespace, so `ip` above ran there too (fork inherits it).
        let listeners: Vec<TcpListener> = (0..10)
            .map(|k| TcpListener::bind((Ipv4Addr::new(127, 0, 0, 1 + k), 8080)).expect("bind"))
            .collect();
        tx.send(()).unwrap();
        let mut threads = Vec::new();
        for l in listeners {
            threads.push(std::thread::spawn(move || {
                for s in l.incoming() {
                    drop(s);
                }
            }));
        }
        for t in threads {
            let _ = t.join();
        }
    });
    rx.recv().expect("listeners");
    let result = std::thread::spawn(move || {
        enter();
        let svc = SocketAddr::from((cluster_ip(0), 80));
        let direct = SocketAddr::from((Ipv4Addr::LOCALHOST, 8080));
        // Warm-up, and a check that translation is in place (no route to the ClusterIP here).
        let s = TcpStream::connect_timeout(&svc, Duration::from_secs(1))
            .expect("the ClusterIP is translated");
        // TCP keeps the backend as its peer (only UDP replies are reverse-translated).
        let peer = s.peer_addr().expect("peer");
        assert!(
            peer.port() == 8080 && peer.ip().is_loopback(),
            "translated to a backend: {peer}"
        );
        let (mut via, mut straight) = (Vec::new(), Vec::new());
        for n in 0..connections * 2 {
            let to = if n % 2 == 0 { svc } else { direct };
            let t = Instant::now();
            let s = TcpStream::connect(to).expect("connect");
            let us = t.elapsed().as_secs_f64() * 1e6;
            drop(s);
            if n % 2 == 0 {
                via.push(us)
            } else {
                straight.push(us)
            }
        }
        (via, straight)
    })
    .join()
    .expect("measuring thread");
    let (mut via, mut straight) = result;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (mv, ms) = (mean(&via), mean(&straight));
    via.sort_by(f64::total_cmp);
    straight.sort_by(f64::total_cmp);
    println!(
        "connect() through a ClusterIP ({services} services loaded): p50 {:.1} us, mean {:.1} us; \
         straight to the backend: p50 {:.1} us, mean {:.1} us; translation costs p50 {:+.1} us, \
         mean {:+.1} us per connection (target <= 5 us; {connections} each, interleaved)",
        percentile(&via, 0.5),
        mv,
        percentile(&straight, 0.5),
        ms,
        percentile(&via, 0.5) - percentile(&straight, 0.5),
        mv - ms
    );
    drop(cleanup);
}
