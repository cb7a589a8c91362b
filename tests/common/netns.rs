//! Network-namespace "pods" for the privileged datapath tests: a namespace, a veth pair, an
//! address, host routes and proxy ARP as Cilium wires them; traffic from threads that enter the
//! namespace with setns. Everything is removed when the `World` is dropped, even on failure.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// True when running as root; with CI=true anything else is a failure, never a skip.
pub fn privileged() -> bool {
    available(nix::unistd::geteuid().is_root(), "root")
}

/// Whether a test can run: `present` says what it needs is here. Without it the test is skipped,
/// except with `CI=true`, where every test must run (`needed` names what is missing).
pub fn available(present: bool, needed: &str) -> bool {
    if !present {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI=true: {needed} is needed and missing"
        );
        eprintln!("skipped: needs {needed}");
    }
    present
}

pub fn ip(args: &[&str]) {
    ip_out(args);
}

/// Runs `ip ARGS`, which must succeed; returns its output.
pub fn ip_out(args: &[&str]) -> String {
    let mut cmd = Command::new("ip");
    cmd.args(args);
    succeeded(&mut cmd, &format!("ip {}", args.join(" ")))
}

/// Runs a command that must succeed (`what` names it in the failure); returns its stdout.
pub fn succeeded(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

pub fn sysctl(key: &str, value: &str) {
    std::fs::write(format!("/proc/sys/{}", key.replace('.', "/")), value)
        .unwrap_or_else(|e| panic!("sysctl {key}: {e}"));
}

/// One pod: a namespace, a veth pair, an address.
pub struct Pod {
    pub netns: String,
    pub host_if: String,
    pub addr: IpAddr,
}

/// Removes everything a test created, whatever happens.
pub struct World {
    pub pods: Vec<Pod>,
    pub pins: std::path::PathBuf,
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

/// Two pods, `a` and `b`, with TCP servers on `b`'s `ports`; `None` (the test skips) without
/// root, outside CI.
pub fn privileged_two_pods(ports: &[u16]) -> Option<World> {
    privileged().then(|| two_pods_b_serving(ports))
}

/// Two pods, `a` and `b`, with TCP servers on `b`'s `ports`.
pub fn two_pods_b_serving(ports: &[u16]) -> World {
    let w = world(2);
    for port in ports {
        tcp_server(&w.pods[1].netns, w.pods[1].addr, *port);
    }
    w
}

pub fn world(pods: usize) -> World {
    world_of(pods, false)
}

/// [`world`] with IPv6 pods: each pod's address is `fd00:NET:N::I` (a /128 without duplicate
/// address detection), its default route goes through `fe80::1`, resolved to the host veth by
/// a permanent neighbour entry (as the CNI plugin wires IPv6), and the host routes the /128
/// to the veth.
pub fn world_v6(pods: usize) -> World {
    world_of(pods, true)
}

fn world_of(pods: usize, ipv6: bool) -> World {
    let n = N.fetch_add(1, Ordering::SeqCst);
    let tag = format!("{}{}", std::process::id() % 100_000, n);
    let net = 10 + (std::process::id() % 200) as u8;
    let mut w = World {
        pods: vec![],
        pins: format!("/sys/fs/bpf/ciliate-it-{tag}").into(),
    };
    sysctl("net.ipv4.ip_forward", "1");
    if ipv6 {
        sysctl("net.ipv6.conf.all.forwarding", "1");
    }
    for i in 0..pods {
        let addr = if ipv6 {
            format!("fd00:{net:x}:{n:x}::{:x}", i + 1)
        } else {
            format!("10.{net}.{n}.{}", i + 1)
        };
        let p = Pod {
            netns: format!("cil-{tag}-{i}"),
            host_if: format!("lxc{tag}{i}"),
            addr: addr.parse().unwrap(),
        };
        ip(&["netns", "add", &p.netns]);
        w.pods.push(p);
        let p = w.pods.last().unwrap();
        ip(&[
            "link", "add", &p.host_if, "type", "veth", "peer", "name", "eth0", "netns", &p.netns,
        ]);
        ip(&["-n", &p.netns, "link", "set", "lo", "up"]);
        ip(&["-n", &p.netns, "link", "set", "eth0", "up"]);
        if ipv6 {
            ipv6_pod(p);
            continue;
        }
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

/// The IPv6 half of [`world_v6`]: the pod's address, gateway and the host's route to it.
fn ipv6_pod(p: &Pod) {
    let addr = format!("{}/128", p.addr);
    ip(&[
        "-n", &p.netns, "-6", "addr", "add", &addr, "dev", "eth0", "nodad",
    ]);
    ip(&["link", "set", &p.host_if, "up"]);
    let mac = std::fs::read_to_string(format!("/sys/class/net/{}/address", p.host_if)).unwrap();
    ip(&[
        "-n",
        &p.netns,
        "-6",
        "neigh",
        "replace",
        "fe80::1",
        "lladdr",
        mac.trim(),
        "dev",
        "eth0",
        "nud",
        "permanent",
    ]);
    ip(&[
        "-n", &p.netns, "-6", "route", "add", "default", "via", "fe80::1", "dev", "eth0",
    ]);
    ip(&["-6", "route", "add", &addr, "dev", &p.host_if]);
    // The host's permanent neighbour entry of the pod, as the CNI plugin writes it: no
    // neighbour discovery from a host veth whose link-local address may still be tentative.
    let out = Command::new("ip")
        .args(["-n", &p.netns, "link", "show", "eth0"])
        .output()
        .expect("ip link show");
    let text = String::from_utf8_lossy(&out.stdout);
    let pod_mac = text
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .unwrap_or_else(|| panic!("the pod's MAC: {text}"))
        .to_string();
    let pod = p.addr.to_string();
    ip(&[
        "-6",
        "neigh",
        "replace",
        &pod,
        "lladdr",
        &pod_mac,
        "dev",
        &p.host_if,
        "nud",
        "permanent",
    ]);
}

/// Runs `f` in a thread that entered the namespace `netns`.
pub fn in_netns<T: Send + 'static>(
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
pub fn tcp_server(netns: &str, addr: IpAddr, port: u16) {
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
pub fn udp_server(netns: &str, addr: IpAddr, port: u16) {
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

/// SCTP by hand: this kernel may have no SCTP stack (no module), so packets are built and read
/// on raw sockets of protocol 132. A packet: the common header (source and destination port,
/// verification tag, checksum) and one INIT chunk carrying `tag` as its initiate tag. Nothing
/// on the way checks the CRC32c checksum (left 0): the datapath judges ports, the stack of a
/// kernel without SCTP hands the packet to raw sockets only.
const IPPROTO_SCTP: i32 = 132;

fn sctp_packet(sport: u16, dport: u16, tag: u32) -> Vec<u8> {
    let mut p = Vec::with_capacity(32);
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    p.extend_from_slice(&0u32.to_be_bytes()); // verification tag: 0 on an INIT
    p.extend_from_slice(&0u32.to_be_bytes()); // checksum
    p.extend_from_slice(&[1, 0]); // INIT, no flags
    p.extend_from_slice(&20u16.to_be_bytes()); // chunk length
    p.extend_from_slice(&tag.to_be_bytes()); // initiate tag
    p.extend_from_slice(&65535u32.to_be_bytes()); // receiver window
    p.extend_from_slice(&1u16.to_be_bytes()); // outbound streams
    p.extend_from_slice(&1u16.to_be_bytes()); // inbound streams
    p.extend_from_slice(&tag.to_be_bytes()); // initial TSN
    p
}

/// (source address, source port, destination port, initiate tag) of an IPv4 packet read from a
/// raw SCTP socket (which hands over the IP header too).
fn sctp_parse(b: &[u8]) -> Option<(std::net::Ipv4Addr, u16, u16, u32)> {
    let ihl = ((*b.first()? & 0x0f) as usize) * 4;
    let s = b.get(ihl..ihl + 24)?;
    let src = std::net::Ipv4Addr::new(b[12], b[13], b[14], b[15]);
    let port = |i: usize| u16::from_be_bytes([s[i], s[i + 1]]);
    let tag = u32::from_be_bytes([s[16], s[17], s[18], s[19]]);
    (s[12] == 1).then_some((src, port(0), port(2), tag))
}

fn raw_sctp_socket() -> socket2::Socket {
    socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::RAW,
        Some(socket2::Protocol::from(IPPROTO_SCTP)),
    )
    .expect("a raw SCTP socket")
}

/// An SCTP "echo" in `netns` for the rest of the process: every INIT to `port` is answered with
/// an INIT back to its sender (ports swapped, the same tag).
pub fn sctp_echo_server(netns: &str, port: u16) {
    let (tx, rx) = std::sync::mpsc::channel();
    in_netns(netns, move || {
        let s = raw_sctp_socket();
        tx.send(()).unwrap();
        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 1500];
        while let Ok(n) = s.recv(&mut buf) {
            // SAFETY: recv initialised the first n bytes.
            let got: Vec<u8> = buf[..n]
                .iter()
                .map(|b| unsafe { b.assume_init() })
                .collect();
            let Some((from, sport, dport, tag)) = sctp_parse(&got) else {
                continue;
            };
            if dport == port {
                let to = SocketAddr::new(IpAddr::V4(from), 0);
                let _ = s.send_to(&sctp_packet(port, sport, tag), &to.into());
            }
        }
    });
    rx.recv().unwrap();
}

/// Does an SCTP INIT from `netns` to `to:port` come back from `sctp_echo_server`? Each probe
/// uses a source port of its own, so it is a new association to the datapath.
pub fn sctp_ok(netns: &str, to: std::net::Ipv4Addr, port: u16) -> bool {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    let sport = 20_000 + (std::process::id() + n * 7) as u16 % 30_000;
    let tag = 0x5c70_0000u32.wrapping_add(n);
    in_netns(netns, move || {
        let s = raw_sctp_socket();
        s.set_read_timeout(Some(Duration::from_millis(700)))
            .unwrap();
        let dest = SocketAddr::new(IpAddr::V4(to), 0);
        if s.send_to(&sctp_packet(sport, port, tag), &dest.into())
            .is_err()
        {
            return false;
        }
        let deadline = std::time::Instant::now() + Duration::from_millis(700);
        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 1500];
        while std::time::Instant::now() < deadline {
            let n = match s.recv(&mut buf) {
                Ok(n) => n,
                // The read timeout.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return false
                }
                // An ICMP error some earlier probe drew: not this probe's answer.
                Err(_) => continue,
            };
            // SAFETY: recv initialised the first n bytes.
            let got: Vec<u8> = buf[..n]
                .iter()
                .map(|b| unsafe { b.assume_init() })
                .collect();
            if sctp_parse(&got) == Some((to, port, sport, tag)) {
                return true;
            }
        }
        false
    })
    .join()
    .unwrap()
}

/// Does a TCP connection from `netns` to `to:port` complete and carry the answer?
pub fn tcp_ok(netns: &str, to: IpAddr, port: u16) -> bool {
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
pub fn udp_ok(netns: &str, to: IpAddr, port: u16) -> bool {
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

fn icmp_checksum(b: &[u8]) -> u16 {
    let mut sum: u32 = b
        .chunks(2)
        .map(|c| u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32)
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Does an ICMP echo request from `netns` to `to` get its echo reply? ICMP for IPv4, ICMPv6
/// (type 128, reply 129) for IPv6. A raw socket (root), so no `ping` binary is needed.
pub fn icmp_ok(netns: &str, to: impl Into<IpAddr>) -> bool {
    use nix::libc;
    let to: IpAddr = to.into();
    in_netns(netns, move || unsafe {
        let (family, proto, request, reply) = match to {
            IpAddr::V4(_) => (libc::AF_INET, libc::IPPROTO_ICMP, 8u8, 0u8),
            IpAddr::V6(_) => (libc::AF_INET6, libc::IPPROTO_ICMPV6, 128, 129),
        };
        let fd = libc::socket(family, libc::SOCK_RAW, proto);
        assert!(
            fd >= 0,
            "raw ICMP socket: {}",
            std::io::Error::last_os_error()
        );
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 200_000,
        };
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        );
        let id = (std::process::id() as u16) ^ (N.fetch_add(1, Ordering::SeqCst) as u16);
        let mut pkt = [
            request,
            0,
            0,
            0,
            (id >> 8) as u8,
            id as u8,
            0,
            1,
            b'c',
            b'i',
            b'l',
            b'i',
        ];
        let sent = match to {
            IpAddr::V4(to) => {
                let ck = icmp_checksum(&pkt);
                pkt[2..4].copy_from_slice(&ck.to_be_bytes());
                let addr = libc::sockaddr_in {
                    sin_family: libc::AF_INET as u16,
                    sin_port: 0,
                    sin_addr: libc::in_addr {
                        s_addr: u32::from(to).to_be(),
                    },
                    sin_zero: [0; 8],
                };
                libc::sendto(
                    fd,
                    pkt.as_ptr() as *const libc::c_void,
                    pkt.len(),
                    0,
                    &addr as *const _ as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_in>() as u32,
                )
            }
            // The kernel computes an ICMPv6 raw socket's checksum (RFC 3542).
            IpAddr::V6(to) => {
                let addr = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as u16,
                    sin6_port: 0,
                    sin6_flowinfo: 0,
                    sin6_addr: libc::in6_addr {
                        s6_addr: to.octets(),
                    },
                    sin6_scope_id: 0,
                };
                libc::sendto(
                    fd,
                    pkt.as_ptr() as *const libc::c_void,
                    pkt.len(),
                    0,
                    &addr as *const _ as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_in6>() as u32,
                )
            }
        };
        let mut ok = false;
        if sent == pkt.len() as isize {
            // Up to ~1 s: other ICMP (our own request on loopback, neighbour discovery) is
            // skipped.
            for _ in 0..6 {
                let mut buf = [0u8; 1500];
                let n = libc::recv(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0);
                if n < 0 {
                    continue;
                }
                let n = n as usize;
                // An IPv4 raw socket hands over the IP header, an IPv6 one does not.
                let at = match to {
                    IpAddr::V4(_) => ((buf[0] & 0x0f) as usize) * 4,
                    IpAddr::V6(_) => 0,
                };
                if n >= at + 8
                    && buf[at] == reply
                    && u16::from_be_bytes([buf[at + 4], buf[at + 5]]) == id
                {
                    ok = true;
                    break;
                }
            }
        }
        libc::close(fd);
        ok
    })
    .join()
    .unwrap()
}

/// One TCP stream from namespace `from` to `to:port` (a server in namespace `at`), 128 KiB
/// writes for `seconds`: Gbit/s as the receiver counted it (the throughput benches).
pub fn stream_gbits(from: &str, at: &str, to: impl Into<IpAddr>, port: u16, seconds: f64) -> f64 {
    let to: IpAddr = to.into();
    let (tx, rx) = std::sync::mpsc::channel();
    let server = in_netns(at, move || {
        let l = TcpListener::bind((to, port)).expect("listen");
        tx.send(()).unwrap();
        let (mut s, _) = l.accept().expect("accept");
        let mut buf = vec![0u8; 1 << 17];
        let (mut n, start) = (0u64, std::time::Instant::now());
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(k) => n += k as u64,
            }
        }
        n as f64 * 8.0 / start.elapsed().as_secs_f64() / 1e9
    });
    rx.recv().unwrap();
    in_netns(from, move || {
        let mut s = TcpStream::connect_timeout(&SocketAddr::new(to, port), Duration::from_secs(2))
            .expect("connect");
        let buf = vec![7u8; 1 << 17];
        let end = std::time::Instant::now() + Duration::from_secs_f64(seconds);
        while std::time::Instant::now() < end {
            if s.write_all(&buf).is_err() {
                break;
            }
        }
    })
    .join()
    .unwrap();
    server.join().unwrap()
}

/// A TCP server that answers each connection with the source address it saw, and a UDP one
/// that answers each datagram the same way.
pub fn who_am_i_servers(netns: &str, addr: impl Into<IpAddr>) {
    let addr: IpAddr = addr.into();
    let (tx, rx) = std::sync::mpsc::channel();
    let tx2 = tx.clone();
    in_netns(netns, move || {
        let l = TcpListener::bind(SocketAddr::new(addr, 7000)).expect("bind");
        tx.send(()).unwrap();
        for mut s in l.incoming().flatten() {
            let seen = s
                .peer_addr()
                .map(|a| a.ip().to_string())
                .unwrap_or_default();
            let _ = s.write_all(seen.as_bytes());
        }
    });
    in_netns(netns, move || {
        let s = UdpSocket::bind(SocketAddr::new(addr, 7000)).expect("bind");
        tx2.send(()).unwrap();
        let mut buf = [0u8; 16];
        while let Ok((_, from)) = s.recv_from(&mut buf) {
            let _ = s.send_to(from.ip().to_string().as_bytes(), from);
        }
    });
    rx.recv().unwrap();
    rx.recv().unwrap();
}

/// The source address `to` saw for a TCP connection from `netns`, if it got through.
pub fn seen_over_tcp(netns: &str, to: impl Into<IpAddr>) -> Option<String> {
    let to: IpAddr = to.into();
    in_netns(netns, move || {
        let mut s =
            TcpStream::connect_timeout(&SocketAddr::new(to, 7000), Duration::from_millis(700))
                .ok()?;
        s.set_read_timeout(Some(Duration::from_millis(700))).ok()?;
        let mut seen = String::new();
        s.read_to_string(&mut seen).ok()?;
        Some(seen)
    })
    .join()
    .unwrap()
}

pub fn seen_over_udp(netns: &str, to: impl Into<IpAddr>) -> Option<String> {
    let to: IpAddr = to.into();
    in_netns(netns, move || {
        let any = if to.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" };
        let s = UdpSocket::bind(any).ok()?;
        s.set_read_timeout(Some(Duration::from_millis(700))).ok()?;
        s.send_to(b"?", SocketAddr::new(to, 7000)).ok()?;
        let mut buf = [0u8; 48];
        let (n, _) = s.recv_from(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    })
    .join()
    .unwrap()
}

/// Loads nftables rules into a node's namespace (kube-proxy's nftables mode, in miniature).
pub fn nft(netns: &str, rules: &str) {
    let file = tempfile::NamedTempFile::new().expect("a rules file");
    std::fs::write(file.path(), rules).expect("write the rules");
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", netns, "nft", "-f"])
        .arg(file.path());
    succeeded(&mut cmd, "nft -f (nftables is installed by .ci/setup)");
}
