//! The BPF datapath with real packets: two "pods" in their own network namespaces, wired to the
//! host through veth pairs (host routes and proxy ARP, as Cilium does), the real programs
//! attached to the host-side veths, TCP and UDP sent between them from threads that enter the
//! namespaces with setns. Privileged: root is needed; with CI=true these tests must run. Every
//! namespace, link and pin is removed even when a test fails (guards).

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use ciliate::datapath::bpf::datapath::BpfDatapath;
use ciliate::datapath::{Datapath, EndpointAttachment, EndpointFlags};
use ciliate::policy::mapstate::{MapDelta, MapKey};
use ciliate::policy::rule::{Direction, PROTO_TCP, PROTO_UDP};

fn privileged() -> bool {
    let root = nix::unistd::geteuid().is_root();
    if !root {
        assert!(
            std::env::var("CI").is_err(),
            "CI=true: the privileged datapath tests must run as root"
        );
        eprintln!("skipped: needs root");
    }
    root
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("iproute2 is installed");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn sysctl(key: &str, value: &str) {
    std::fs::write(format!("/proc/sys/{}", key.replace('.', "/")), value)
        .unwrap_or_else(|e| panic!("sysctl {key}: {e}"));
}

/// One pod: a namespace, a veth pair, an address.
struct Pod {
    netns: String,
    host_if: String,
    addr: IpAddr,
}

/// Removes everything a test created, whatever happens.
struct World {
    pods: Vec<Pod>,
    pins: std::path::PathBuf,
}

impl Drop for World {
    fn drop(&mut self) {
        for p in &self.pods {
            let _ = Command::new("ip")
                .args(["link", "del", &p.host_if])
                .output();
            let _ = Command::new("ip").args(["netns", "del", &p.netns]).output();
        }
        let _ = std::fs::remove_dir_all(&self.pins);
    }
}

static N: AtomicU32 = AtomicU32::new(0);

fn world(pods: usize) -> World {
    let n = N.fetch_add(1, Ordering::SeqCst);
    let tag = format!("{}{}", std::process::id() % 100_000, n);
    let net = 10 + (std::process::id() % 200) as u8;
    let mut w = World {
        pods: vec![],
        pins: format!("/sys/fs/bpf/ciliate-it-{tag}").into(),
    };
    sysctl("net.ipv4.ip_forward", "1");
    for i in 0..pods {
        let p = Pod {
            netns: format!("cil-{tag}-{i}"),
            host_if: format!("lxc{tag}{i}"),
            addr: format!("10.{net}.{n}.{}", i + 1).parse().unwrap(),
        };
        ip(&["netns", "add", &p.netns]);
        w.pods.push(p);
        let p = w.pods.last().unwrap();
        ip(&[
            "link", "add", &p.host_if, "type", "veth", "peer", "name", "eth0", "netns", &p.netns,
        ]);
        ip(&["-n", &p.netns, "link", "set", "lo", "up"]);
        ip(&["-n", &p.netns, "link", "set", "eth0", "up"]);
        ip(&[
            "-n",
            &p.netns,
            "addr",
            "add",
            &format!("{}/32", p.addr),
            "dev",
            "eth0",
        ]);
        ip(&[
            "-n",
            &p.netns,
            "route",
            "add",
            "169.254.1.1",
            "dev",
            "eth0",
            "scope",
            "link",
        ]);
        ip(&[
            "-n",
            &p.netns,
            "route",
            "add",
            "default",
            "via",
            "169.254.1.1",
            "dev",
            "eth0",
        ]);
        ip(&["link", "set", &p.host_if, "up"]);
        // The pod's gateway is the host veth itself (as Cilium wires it).
        let mac = std::fs::read_to_string(format!("/sys/class/net/{}/address", p.host_if)).unwrap();
        ip(&[
            "-n",
            &p.netns,
            "neigh",
            "replace",
            "169.254.1.1",
            "lladdr",
            mac.trim(),
            "dev",
            "eth0",
            "nud",
            "permanent",
        ]);
        sysctl(&format!("net.ipv4.conf.{}.proxy_arp", p.host_if), "1");
        sysctl(&format!("net.ipv4.conf.{}.rp_filter", p.host_if), "0");
        ip(&["route", "add", &format!("{}/32", p.addr), "dev", &p.host_if]);
    }
    w
}

/// Runs `f` in a thread that entered the namespace `netns`.
fn in_netns<T: Send + 'static>(
    netns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let path = format!("/run/netns/{netns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).expect("netns file");
        nix::sched::setns(fd.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        f()
    })
}

/// A TCP server in `netns` answering "pong" to every connection, for the rest of the process.
fn tcp_server(netns: &str, addr: IpAddr, port: u16) {
    let (tx, rx) = std::sync::mpsc::channel();
    in_netns(netns, move || {
        let l = TcpListener::bind(SocketAddr::new(addr, port)).expect("bind");
        tx.send(()).unwrap();
        for s in l.incoming().flatten() {
            let mut s = s;
            let _ = s.write_all(b"pong");
        }
    });
    rx.recv().unwrap();
}

/// A UDP echo server in `netns`.
fn udp_server(netns: &str, addr: IpAddr, port: u16) {
    let (tx, rx) = std::sync::mpsc::channel();
    in_netns(netns, move || {
        let s = UdpSocket::bind(SocketAddr::new(addr, port)).expect("bind");
        tx.send(()).unwrap();
        let mut buf = [0u8; 64];
        while let Ok((n, from)) = s.recv_from(&mut buf) {
            let _ = s.send_to(&buf[..n], from);
        }
    });
    rx.recv().unwrap();
}

/// Does a TCP connection from `netns` to `to:port` complete and carry the answer?
fn tcp_ok(netns: &str, to: IpAddr, port: u16) -> bool {
    in_netns(netns, move || {
        let Ok(mut s) =
            TcpStream::connect_timeout(&SocketAddr::new(to, port), Duration::from_millis(700))
        else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(700)));
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).is_ok() && &buf == b"pong"
    })
    .join()
    .unwrap()
}

/// Does a UDP datagram from `netns` to `to:port` come back?
fn udp_ok(netns: &str, to: IpAddr, port: u16) -> bool {
    in_netns(netns, move || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.set_read_timeout(Some(Duration::from_millis(700)))
            .unwrap();
        let _ = s.send_to(b"ping", SocketAddr::new(to, port));
        let mut buf = [0u8; 8];
        matches!(s.recv_from(&mut buf), Ok((4, _)))
    })
    .join()
    .unwrap()
}

fn key(direction: Direction, identity: u32, protocol: u8, lo: u16, hi: u16) -> MapKey {
    MapKey {
        direction,
        identity,
        protocol,
        port_lo: lo,
        port_hi: hi,
    }
}

fn allow(keys: &[MapKey]) -> MapDelta {
    MapDelta {
        upserts: keys.iter().map(|k| (*k, false)).collect(),
        deletes: vec![],
    }
}

const ISOLATED_IN: EndpointFlags = EndpointFlags {
    ingress_default_deny: true,
    egress_default_deny: false,
    drop_all: false,
};
const ISOLATED_BOTH: EndpointFlags = EndpointFlags {
    ingress_default_deny: true,
    egress_default_deny: true,
    drop_all: false,
};
const OPEN: EndpointFlags = EndpointFlags {
    ingress_default_deny: false,
    egress_default_deny: false,
    drop_all: false,
};

#[test]
fn policy_on_real_veths_with_live_edits_replies_and_a_restart_without_a_gap() {
    if !privileged() {
        return;
    }
    let w = world(2);
    let (a, b) = (&w.pods[0], &w.pods[1]);
    let (id_a, id_b) = (1001u32, 1002u32);
    tcp_server(&b.netns, b.addr, 8080);
    tcp_server(&b.netns, b.addr, 9090);
    udp_server(&b.netns, b.addr, 5353);

    // Before anything is attached the pods talk freely.
    assert!(
        tcp_ok(&a.netns, b.addr, 8080),
        "plain routing works without the datapath"
    );

    let mut dp = BpfDatapath::open(&w.pins).expect("open the datapath");
    for (p, ep, ident) in [(a, 1u16, id_a), (b, 2u16, id_b)] {
        dp.upsert_ipcache(format!("{}/32", p.addr).parse().unwrap(), ident)
            .unwrap();
        dp.attach_endpoint(&EndpointAttachment {
            id: ep,
            interface: Some(p.host_if.clone()),
            ips: vec![p.addr],
            identity: ident,
        })
        .unwrap();
    }
    // Attached but not yet realized: fail closed.
    assert!(
        !tcp_ok(&a.netns, b.addr, 8080),
        "an endpoint drops until its policy is realized"
    );

    // b admits a on TCP 8080 and UDP 5353 only; a is not isolated.
    dp.sync_policy(1, OPEN, &MapDelta::default(), true).unwrap();
    let b_rules = [
        key(Direction::Ingress, id_a, PROTO_TCP, 8080, 8080),
        key(Direction::Ingress, id_a, PROTO_UDP, 5353, 5353),
    ];
    dp.sync_policy(2, ISOLATED_IN, &allow(&b_rules), true)
        .unwrap();
    assert!(tcp_ok(&a.netns, b.addr, 8080));
    assert!(!tcp_ok(&a.netns, b.addr, 9090));
    assert!(
        udp_ok(&a.netns, b.addr, 5353),
        "the UDP reply comes back through conntrack"
    );
    let dump = dp.dump_policy(2).unwrap();
    let counted = dump.entries.iter().find(|e| e.port == 8080).unwrap();
    assert!(counted.packets >= 1 && counted.bytes > 0, "{counted:?}");

    // A live edit: 9090 instead of 8080.
    let edit = MapDelta {
        upserts: vec![(key(Direction::Ingress, id_a, PROTO_TCP, 9090, 9090), false)],
        deletes: vec![key(Direction::Ingress, id_a, PROTO_TCP, 8080, 8080)],
    };
    dp.sync_policy(2, ISOLATED_IN, &edit, false).unwrap();
    assert!(tcp_ok(&a.netns, b.addr, 9090));
    assert!(!tcp_ok(&a.netns, b.addr, 8080));

    // Default deny in both directions on a: only its egress rule opens the way, and the replies
    // pass under its ingress default deny.
    dp.sync_policy(
        1,
        ISOLATED_BOTH,
        &allow(&[key(Direction::Egress, id_b, PROTO_TCP, 9090, 9090)]),
        true,
    )
    .unwrap();
    assert!(tcp_ok(&a.netns, b.addr, 9090));
    assert!(
        !udp_ok(&a.netns, b.addr, 5353),
        "a's egress does not allow UDP"
    );
    // b cannot open a connection to a (a's ingress is isolated).
    tcp_server(&a.netns, a.addr, 7070);
    assert!(!tcp_ok(&b.netns, a.addr, 7070));

    // A deny beats the allow.
    dp.sync_policy(
        2,
        ISOLATED_IN,
        &MapDelta {
            upserts: vec![(key(Direction::Ingress, 0, 0, 0, 65535), true)],
            deletes: vec![],
        },
        false,
    )
    .unwrap();
    assert!(!tcp_ok(&a.netns, b.addr, 9090));
    dp.sync_policy(
        2,
        ISOLATED_IN,
        &MapDelta {
            upserts: vec![],
            deletes: vec![key(Direction::Ingress, 0, 0, 0, 65535)],
        },
        false,
    )
    .unwrap();
    assert!(tcp_ok(&a.netns, b.addr, 9090));

    // The agent goes away: enforcement stays (pinned maps, tc filters hold the programs).
    drop(dp);
    assert!(
        tcp_ok(&a.netns, b.addr, 9090),
        "allowed flows keep working while the agent is gone"
    );
    assert!(
        !tcp_ok(&a.netns, b.addr, 8080),
        "denied flows stay denied while the agent is gone"
    );

    // It comes back: reopens the pins, re-attaches, replaces the policy without a gap.
    let mut dp = BpfDatapath::open(&w.pins).expect("reopen the datapath");
    for (p, ep, ident) in [(a, 1u16, id_a), (b, 2u16, id_b)] {
        dp.attach_endpoint(&EndpointAttachment {
            id: ep,
            interface: Some(p.host_if.clone()),
            ips: vec![p.addr],
            identity: ident,
        })
        .unwrap();
    }
    assert!(
        tcp_ok(&a.netns, b.addr, 9090),
        "re-attaching keeps the realized policy"
    );
    dp.sync_policy(
        1,
        ISOLATED_BOTH,
        &allow(&[key(Direction::Egress, id_b, PROTO_TCP, 9090, 9090)]),
        true,
    )
    .unwrap();
    dp.sync_policy(
        2,
        ISOLATED_IN,
        &allow(&[key(Direction::Ingress, id_a, PROTO_TCP, 9090, 9090)]),
        true,
    )
    .unwrap();
    assert!(tcp_ok(&a.netns, b.addr, 9090));
    assert!(!tcp_ok(&a.netns, b.addr, 8080));
    assert_eq!(
        dp.dump_policy(2).unwrap().entries.len(),
        1,
        "the replace removed what is no longer wanted"
    );

    // Detach removes the programs: the path is open again.
    dp.detach_endpoint(1).unwrap();
    dp.detach_endpoint(2).unwrap();
    assert!(tcp_ok(&a.netns, b.addr, 8080));
    assert!(!w.pins.join("policy_1").exists());
}
