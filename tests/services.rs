//! Services resolved before egress policy, on one node with the eBPF datapath: pods through
//! CNI, the agent's socket-level translation attached to a cgroup of this test, and client
//! processes that live in that cgroup and in the pod's network namespace. The test's ClusterIP
//! range is blackholed inside the pods' namespaces, so an untranslated packet goes nowhere.
//! Privileged: with CI=true these tests must run.

mod common;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::agent::Agent;
use common::cluster::Cluster;
use common::cni::{unique_pod_cidr, CniPod, CniPods};
use common::eventually;
use common::netns::{in_netns, ip, nft, privileged};
use serde_json::Value;

/// Set in a child process of this test binary: what the client should do (see `client_main`).
const CLIENT_ENV: &str = "CILIATE_TEST_SERVICE_CLIENT";

/// The client side, run as a child process (so it can sit in the test's cgroup and the pod's
/// namespace): prints one `RESULT: ...` line.
#[test]
fn service_client_helper() {
    let Ok(spec) = std::env::var(CLIENT_ENV) else {
        return; // An ordinary run: nothing to do.
    };
    let (kind, to) = spec.split_once(' ').expect("KIND ADDR:PORT");
    let to: SocketAddr = to.parse().expect("ADDR:PORT");
    let started = Instant::now();
    let result = match kind {
        "tcp" => match TcpStream::connect_timeout(&to, Duration::from_millis(1500)) {
            Ok(mut s) => {
                let _ = s.set_read_timeout(Some(Duration::from_millis(1500)));
                let mut buf = String::new();
                let _ = s.read_to_string(&mut buf);
                format!("ok {buf}")
            }
            Err(e) => format!("err {:?} {}ms", e.kind(), started.elapsed().as_millis()),
        },
        // Unconnected: sendmsg4 translates, recvmsg4 shows the reply from the ClusterIP.
        "udp" => {
            let s = UdpSocket::bind(any(&to)).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(1500)))
                .unwrap();
            match s.send_to(b"ping", to) {
                Err(e) => format!("err {:?} {}ms", e.kind(), started.elapsed().as_millis()),
                Ok(_) => {
                    let mut buf = [0u8; 64];
                    match s.recv_from(&mut buf) {
                        Ok((n, from)) => {
                            format!("ok {} from={from}", String::from_utf8_lossy(&buf[..n]))
                        }
                        Err(e) => format!("err {:?}", e.kind()),
                    }
                }
            }
        }
        // Connected: connect4 translates, getpeername4 shows the ClusterIP.
        "udp-connected" => {
            let s = UdpSocket::bind(any(&to)).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(1500)))
                .unwrap();
            match s.connect(to).and_then(|_| s.send(b"ping")) {
                Err(e) => format!("err {:?}", e.kind()),
                Ok(_) => {
                    let mut buf = [0u8; 64];
                    match s.recv(&mut buf) {
                        Ok(n) => format!(
                            "ok {} peer={}",
                            String::from_utf8_lossy(&buf[..n]),
                            s.peer_addr().map(|a| a.to_string()).unwrap_or_default()
                        ),
                        Err(e) => format!("err {:?}", e.kind()),
                    }
                }
            }
        }
        // A DNS query (type A) for NAME: prints the first answer's address.
        dns if dns.starts_with("dns:") => {
            let s = UdpSocket::bind(any(&to)).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(1500)))
                .unwrap();
            let query = dns_query(0x5eed, &dns[4..]);
            match s.send_to(&query, to) {
                Err(e) => format!("err {:?}", e.kind()),
                Ok(_) => {
                    let mut buf = [0u8; 512];
                    match s.recv_from(&mut buf) {
                        Ok((n, from)) => match dns_answer(&buf[..n], 0x5eed) {
                            Some(ip) => format!("ok {ip} from={from}"),
                            None => format!("err bad answer {:?}", &buf[..n]),
                        },
                        Err(e) => format!("err {:?}", e.kind()),
                    }
                }
            }
        }
        other => panic!("unknown client kind {other}"),
    };
    println!("\nRESULT: {result}");
}

/// The unspecified address of `to`'s family, port 0 (an IPv6 socket also reaches IPv4-mapped
/// addresses).
fn any(to: &SocketAddr) -> &'static str {
    if to.is_ipv6() {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    }
}

/// Runs the client in `netns` and `cgroup` (joined before exec); returns its result line.
fn client(netns: &str, cgroup: &Path, kind: &str, to: SocketAddr) -> String {
    let ns = std::fs::File::open(format!("/run/netns/{netns}")).expect("netns file");
    let procs = std::fs::OpenOptions::new()
        .write(true)
        .open(cgroup.join("cgroup.procs"))
        .expect("cgroup.procs");
    let (ns_fd, procs_fd) = (ns.as_raw_fd(), procs.as_raw_fd());
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "service_client_helper",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CLIENT_ENV, format!("{kind} {to}"))
    .stdout(Stdio::piped())
    .stderr(Stdio::null());
    // SAFETY: only async-signal-safe calls between fork and exec (write, setns).
    unsafe {
        cmd.pre_exec(move || {
            // "0" moves the writing process itself.
            if nix::libc::write(procs_fd, b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
            if nix::libc::setns(ns_fd, nix::libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().expect("the client runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.split_once("RESULT: ").map(|(_, r)| r))
        .unwrap_or_else(|| panic!("client printed no result: {text}"))
        .to_string()
}

/// TCP and UDP servers in a pod's namespace that answer with the pod's name, on each of its
/// addresses.
fn named_servers(pod: &CniPod) {
    let (tx, rx) = std::sync::mpsc::channel();
    let addrs: Vec<IpAddr> = std::iter::once(IpAddr::V4(pod.addr))
        .filter(|a| !a.is_unspecified()) // an IPv6-only pod
        .chain(pod.addr6.map(IpAddr::V6))
        .collect();
    for addr in &addrs {
        let (addr, name, tx1) = (*addr, pod.name.clone(), tx.clone());
        in_netns(&pod.netns, move || {
            let l = TcpListener::bind((addr, 8080)).expect("bind");
            tx1.send(()).unwrap();
            for mut s in l.incoming().flatten() {
                let _ = s.write_all(name.as_bytes());
            }
        });
        let (name, tx2) = (pod.name.clone(), tx.clone());
        in_netns(&pod.netns, move || {
            let s = UdpSocket::bind((addr, 5353)).expect("bind");
            tx2.send(()).unwrap();
            let mut buf = [0u8; 64];
            while let Ok((_, from)) = s.recv_from(&mut buf) {
                let _ = s.send_to(name.as_bytes(), from);
            }
        });
    }
    for _ in 0..2 * addrs.len() {
        rx.recv().unwrap();
    }
}

/// The test's cgroup, removed at the end whatever happens.
struct Cgroup(PathBuf);

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() || !self.0.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Namespace x with pods a, b1 and b2 (app b) and c, and a's egress policy.
fn cluster() -> String {
    let pods = common::namespace_x(&[
        ("a", "a", None),
        ("b1", "b", None),
        ("b2", "b", None),
        ("c", "c", None),
    ]);
    format!("{pods}---\n{A_EGRESS}")
}

const A_EGRESS: &str = "apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: a-egress, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: a}}
  egress:
    - toEndpoints: [{matchLabels: {app: b}}]
      toPorts: [{ports: [{port: '8080', protocol: TCP}, {port: '5353', protocol: UDP}]}]
";

/// The ClusterIP range `NET.0/24` goes nowhere from the pod's namespace: a connection the agent
/// did not translate fails there instead of leaving the test's namespaces.
fn blackhole(netns: &str, net: &str) {
    ip(&[
        "-n",
        netns,
        "route",
        "add",
        "blackhole",
        &format!("{net}.0/24"),
    ]);
}

/// Services on `NET.50` .. `NET.53`, and their EndpointSlices. `b2` ready or not.
fn services(net: &str, b1: Ipv4Addr, b2: Ipv4Addr, c: Ipv4Addr, b2_in_slice: bool) -> String {
    let b2_entry = if b2_in_slice {
        format!("  - {{addresses: ['{b2}']}}\n")
    } else {
        String::new()
    };
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: b, namespace: x}}
spec:
  clusterIP: {net}.50
  ports:
    - {{name: http, port: 80, targetPort: http}}
    - {{name: dns, port: 53, protocol: UDP, targetPort: 5353}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: b-1, namespace: x, labels: {{kubernetes.io/service-name: b}}}}
addressType: IPv4
endpoints:
  - {{addresses: ['{b1}']}}
{b2_entry}ports:
  - {{name: http, port: 8080}}
  - {{name: dns, port: 5353, protocol: UDP}}
---
apiVersion: v1
kind: Service
metadata: {{name: b-numbered, namespace: x}}
spec:
  clusterIP: {net}.51
  ports: [{{port: 80, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: b-numbered-1, namespace: x, labels: {{kubernetes.io/service-name: b-numbered}}}}
addressType: IPv4
endpoints: [{{addresses: ['{b1}']}}]
---
apiVersion: v1
kind: Service
metadata: {{name: c, namespace: x}}
spec:
  clusterIP: {net}.52
  ports: [{{name: http, port: 80, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: c-1, namespace: x, labels: {{kubernetes.io/service-name: c}}}}
addressType: IPv4
endpoints: [{{addresses: ['{c}']}}]
ports: [{{name: http, port: 8080}}]
---
apiVersion: v1
kind: Service
metadata: {{name: empty, namespace: x}}
spec:
  clusterIP: {net}.53
  ports: [{{port: 80, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: empty-1, namespace: x, labels: {{kubernetes.io/service-name: empty}}}}
addressType: IPv4
endpoints: [{{addresses: ['{b1}'], conditions: {{ready: false}}}}]
"
    )
}

fn frontend<'a>(list: &'a Value, fe: &str) -> &'a Value {
    list.as_array()
        .into_iter()
        .flatten()
        .find(|f| f["frontend"] == fe)
        .unwrap_or_else(|| panic!("no frontend {fe} in {list}"))
}

/// (frontend, service id, backend ids) of every frontend.
fn ids(list: &Value) -> Vec<(String, Value, Value)> {
    list.as_array()
        .into_iter()
        .flatten()
        .map(|f| {
            (
                f["frontend"].as_str().unwrap_or("").to_string(),
                f["service_id"].clone(),
                f["backend_ids"].clone(),
            )
        })
        .collect()
}

/// One node translating Services: its directory (the manifests hold `cluster()`), the test's
/// cgroup, the agent's pins and arguments (to restart it), and the agent.
struct Node {
    tmp: tempfile::TempDir,
    cgroup: Cgroup,
    pins: String,
    args: Vec<String>,
    agent: Agent,
}

/// Starts [`Node`] `name` (pins and cgroup `ciliate-NAME-PID`), with a pod CIDR of its own and
/// `extra` flags.
fn translating_node(name: &str, extra: &[&str]) -> Node {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    std::fs::write(m.join("cluster.yaml"), cluster()).unwrap();
    let tag = std::process::id();
    let cgroup = Cgroup(PathBuf::from(format!(
        "/sys/fs/cgroup/unified/ciliate-{name}-{tag}"
    )));
    std::fs::create_dir_all(&cgroup.0).expect("a cgroup v2 directory");
    let pins = format!("/sys/fs/bpf/ciliate-{name}-{tag}");
    let cgroup_root = cgroup.0.to_string_lossy().into_owned();
    let args: Vec<String> = [
        "--datapath",
        "bpf",
        "--bpf-root",
        pins.as_str(),
        "--pod-cidr",
        unique_pod_cidr().as_str(),
        "--cgroup-root",
        cgroup_root.as_str(),
    ]
    .iter()
    .chain(extra)
    .map(|a| a.to_string())
    .collect();
    let agent = Agent::start_with(
        tmp.path(),
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    Node {
        tmp,
        cgroup,
        pins,
        args,
        agent,
    }
}

#[test]
fn services_are_translated_before_egress_policy_and_survive_kill_9() {
    if !privileged() {
        return;
    }
    let Node {
        tmp,
        cgroup,
        pins,
        args,
        mut agent,
    } = translating_node("svc", &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let m = tmp.path().join("manifests");
    let tag = std::process::id();
    let net = format!("10.96.{}", 100 + tag % 150);
    let mut pods = CniPods::new(&agent.socket(), Path::new(&pins));
    let a = pods.add("x", "a");
    let b1 = pods.add("x", "b1");
    let b2 = pods.add("x", "b2");
    let c = pods.add("x", "c");
    for p in [&a, &b1, &b2, &c] {
        blackhole(&p.netns, &net);
    }
    for p in [&b1, &b2, &c] {
        named_servers(p);
    }
    let to =
        |last: u8, port: u16| -> SocketAddr { format!("{net}.{last}:{port}").parse().unwrap() };

    // Before any Service: the ClusterIP is blackholed, so nothing reaches anything.
    let r = client(&a.netns, &cgroup.0, "tcp", to(50, 80));
    assert!(r.starts_with("err"), "untranslated ClusterIP: {r}");

    std::fs::write(
        m.join("services.yaml"),
        services(&net, b1.addr, b2.addr, c.addr, true),
    )
    .unwrap();
    eventually("the services are listed", || {
        let l = agent.cli_json(&["service", "list"]);
        l.as_array().is_some_and(|a| a.len() == 5)
            && frontend(&l, &format!("{net}.50:80/TCP"))["backends"]
                .as_array()
                .is_some_and(|b| b.len() == 2)
    });
    let list = agent.cli_json(&["service", "list"]);
    let b = frontend(&list, &format!("{net}.50:80/TCP"));
    assert_eq!(b["namespace"], "x");
    assert_eq!(b["name"], "b");
    assert_eq!(b["backends"][0]["port"], 8080, "named targetPort: {b}");
    assert_eq!(b["backends"][0]["ready"], true);
    let empty = frontend(&list, &format!("{net}.53:80/TCP"));
    assert_eq!(empty["backends"][0]["ready"], false, "{empty}");
    let status = agent.cli_json(&["status"]);
    assert_eq!(status["services"]["services"], 4, "{status}");
    assert_eq!(status["services"]["translation"], "bpf", "{status}");
    // The debug server (and its page) shows the same counts and frontends.
    let debug = agent.json("/debug/services");
    assert_eq!(debug["counts"], status["services"], "{debug}");
    assert_eq!(debug["frontends"], list, "{debug}");
    let (_, page) = agent.http_get("/debug/");
    assert!(
        page.contains("/debug/services"),
        "the page shows the Services"
    );
    let table = agent.cli(&["service", "list"]).1;
    assert!(
        table.contains(&format!("{net}.50:80/TCP")) && table.contains("x/b"),
        "{table}"
    );

    // Allowed: a reaches b through its Service, named and numbered targetPorts, TCP and UDP.
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..16 {
        let r = client(&a.netns, &cgroup.0, "tcp", to(50, 80));
        assert!(r == "ok b1" || r == "ok b2", "a -> b's Service: {r}");
        seen.insert(r);
    }
    assert_eq!(
        seen.len(),
        2,
        "both ready backends get connections: {seen:?}"
    );
    let r = client(&a.netns, &cgroup.0, "tcp", to(51, 80));
    assert_eq!(r, "ok b1", "numbered targetPort");
    let r = client(&a.netns, &cgroup.0, "udp", to(50, 53));
    assert!(
        r.starts_with("ok b") && r.ends_with(&format!("from={net}.50:53")),
        "UDP through the Service, the reply seen from the ClusterIP: {r}"
    );
    let r = client(&a.netns, &cgroup.0, "udp-connected", to(50, 53));
    assert!(
        r.starts_with("ok b") && r.ends_with(&format!("peer={net}.50:53")),
        "connected UDP: getpeername shows the ClusterIP: {r}"
    );

    // Denied: c's Service leads to a backend the policy does not allow (judged as c, not as
    // `world`): the connection is dropped, so it times out.
    let r = client(&a.netns, &cgroup.0, "tcp", to(52, 80));
    assert!(
        r.starts_with("err TimedOut"),
        "a -> c's Service is denied: {r}"
    );
    let r = client(&c.netns, &cgroup.0, "tcp", to(50, 80));
    assert!(r.starts_with("ok b"), "c has no egress policy: {r}");

    // No ready backend: the connect fails at once, never sent anywhere.
    let r = client(&a.netns, &cgroup.0, "tcp", to(53, 80));
    let ms: u64 = r
        .rsplit(' ')
        .next()
        .and_then(|t| t.strip_suffix("ms"))
        .and_then(|t| t.parse().ok())
        .unwrap_or(u64::MAX);
    assert!(
        r.starts_with("err PermissionDenied") && ms < 1000,
        "a Service with no ready backend fails the connect at once: {r}"
    );

    // A backend removed from the EndpointSlice gets no new connections.
    std::fs::write(
        m.join("services.yaml"),
        services(&net, b1.addr, b2.addr, c.addr, false),
    )
    .unwrap();
    eventually("b2 leaves b's Service", || {
        let l = agent.cli_json(&["service", "list"]);
        frontend(&l, &format!("{net}.50:80/TCP"))["backends"]
            .as_array()
            .is_some_and(|b| b.len() == 1)
    });
    for _ in 0..12 {
        let r = client(&a.netns, &cgroup.0, "tcp", to(50, 80));
        assert_eq!(r, "ok b1", "only the remaining backend: {r}");
    }

    // kill -9: translation goes on; the restart keeps every id.
    let before = ids(&agent.cli_json(&["service", "list"]));
    assert!(before.iter().all(|(_, s, _)| s.is_u64()), "{before:?}");
    if let Some(mut child) = agent.child.take() {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let r = client(&a.netns, &cgroup.0, "tcp", to(50, 80));
    assert_eq!(r, "ok b1", "translation while the agent is down: {r}");
    let r = client(&a.netns, &cgroup.0, "tcp", to(53, 80));
    assert!(
        r.starts_with("err PermissionDenied"),
        "still fails closed: {r}"
    );
    let mut agent = Agent::start_with(tmp.path(), &args);
    pods.socket = agent.socket();
    let after = ids(&agent.cli_json(&["service", "list"]));
    assert_eq!(after, before, "service and backend ids survive the restart");
    let r = client(&a.netns, &cgroup.0, "tcp", to(50, 80));
    assert_eq!(r, "ok b1", "after the restart: {r}");
    drop(pods);
    agent.stop();
}

/// A dual-stack Service `b` (NET4.60 and NET6::60, one slice per family), an IPv6-only Service
/// `c6` and an IPv6 Service `empty6` whose only endpoint is not ready.
fn services_dual(net4: &str, net6: &str, b1: &CniPod, c: &CniPod) -> String {
    let (b1_4, b1_6, c6) = (b1.addr, b1.addr6.unwrap(), c.addr6.unwrap());
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: b, namespace: x}}
spec:
  ipFamilyPolicy: RequireDualStack
  clusterIPs: ['{net4}.60', '{net6}::60']
  ports:
    - {{name: http, port: 80, targetPort: http}}
    - {{name: dns, port: 53, protocol: UDP, targetPort: 5353}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: b-4, namespace: x, labels: {{kubernetes.io/service-name: b}}}}
addressType: IPv4
endpoints: [{{addresses: ['{b1_4}']}}]
ports: [{{name: http, port: 8080}}, {{name: dns, port: 5353, protocol: UDP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: b-6, namespace: x, labels: {{kubernetes.io/service-name: b}}}}
addressType: IPv6
endpoints: [{{addresses: ['{b1_6}']}}]
ports: [{{name: http, port: 8080}}, {{name: dns, port: 5353, protocol: UDP}}]
---
apiVersion: v1
kind: Service
metadata: {{name: c6, namespace: x}}
spec:
  clusterIPs: ['{net6}::62']
  ports: [{{port: 80, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: c6-1, namespace: x, labels: {{kubernetes.io/service-name: c6}}}}
addressType: IPv6
endpoints: [{{addresses: ['{c6}']}}]
---
apiVersion: v1
kind: Service
metadata: {{name: empty6, namespace: x}}
spec:
  clusterIPs: ['{net6}::63']
  ports: [{{port: 80, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: empty6-1, namespace: x, labels: {{kubernetes.io/service-name: empty6}}}}
addressType: IPv6
endpoints: [{{addresses: ['{b1_6}'], conditions: {{ready: false}}}}]
"
    )
}

/// IPv6 and dual-stack Services (connect6, sendmsg6, recvmsg6, getpeername6), on a dual-stack
/// node: the IPv6 ClusterIP goes to the IPv6 backend and the egress policy judges the backend
/// (allowed b, denied c), UDP replies and a connected socket's peer show the ClusterIP, a
/// frontend without a ready backend fails the connect at once, an IPv6 socket's IPv4-mapped
/// ClusterIP goes through the IPv4 tables, and translation goes on through a `kill -9` with
/// every id kept. Both ClusterIP ranges are blackholed in the pods' namespaces.
#[test]
fn ipv6_and_dual_stack_services_are_translated_before_egress_policy_and_survive_kill_9() {
    if !privileged() {
        return;
    }
    let tag = std::process::id();
    let cidr6 = format!("fd00:{:x}:7::/112", tag % 0xffff);
    let Node {
        tmp,
        cgroup,
        pins,
        args,
        mut agent,
    } = translating_node("svc6", &["--pod-cidr", &cidr6, "--enable-ipv6=true"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let m = tmp.path().join("manifests");
    let net4 = format!("10.97.{}", 100 + tag % 150);
    let net6 = format!("fd00:97:{:x}", tag % 0xffff);
    let mut pods = CniPods::new(&agent.socket(), Path::new(&pins));
    let (a, b1, c) = (pods.add("x", "a"), pods.add("x", "b1"), pods.add("x", "c"));
    for p in [&a, &b1, &c] {
        blackhole(&p.netns, &net4);
        ip(&[
            "-n",
            &p.netns,
            "-6",
            "route",
            "add",
            "blackhole",
            &format!("{net6}::/64"),
        ]);
    }
    for p in [&b1, &c] {
        named_servers(p);
    }
    let v6 = |last: u16, port: u16| -> SocketAddr {
        format!("[{net6}::{last:x}]:{port}").parse().unwrap()
    };
    let mapped = |last: u8, port: u16| -> SocketAddr {
        let v4: Ipv4Addr = format!("{net4}.{last}").parse().unwrap();
        SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), port)
    };
    let r = client(&a.netns, &cgroup.0, "tcp", v6(0x60, 80));
    assert!(r.starts_with("err"), "untranslated IPv6 ClusterIP: {r}");

    std::fs::write(
        m.join("services.yaml"),
        services_dual(&net4, &net6, &b1, &c),
    )
    .unwrap();
    let fe6 = format!("[{net6}::60]:80/TCP");
    eventually("the IPv6 frontends are written", || {
        let l = agent.cli_json(&["service", "list"]);
        l.as_array().is_some_and(|a| a.len() == 6) && frontend(&l, &fe6)["service_id"].is_u64()
    });
    let list = agent.cli_json(&["service", "list"]);
    let b6 = frontend(&list, &fe6);
    assert_eq!(b6["backends"].as_array().map(Vec::len), Some(1), "{b6}");
    assert_eq!(
        b6["backends"][0]["ip"],
        b1.addr6.unwrap().to_string(),
        "{b6}"
    );
    assert_eq!(
        frontend(&list, &format!("{net4}.60:80/TCP"))["backends"][0]["ip"],
        b1.addr.to_string(),
        "each family's frontend has its own family's backend"
    );

    // Allowed: a reaches b over IPv6, TCP and UDP (the reply and the peer show the ClusterIP).
    assert_eq!(client(&a.netns, &cgroup.0, "tcp", v6(0x60, 80)), "ok b1");
    let r = client(&a.netns, &cgroup.0, "udp", v6(0x60, 53));
    assert_eq!(
        r,
        format!("ok b1 from={}", v6(0x60, 53)),
        "sendmsg6/recvmsg6"
    );
    let r = client(&a.netns, &cgroup.0, "udp-connected", v6(0x60, 53));
    assert_eq!(
        r,
        format!("ok b1 peer={}", v6(0x60, 53)),
        "connect6/getpeername6"
    );
    // An IPv6 socket to the IPv4 ClusterIP, IPv4-mapped: the IPv4 tables translate it.
    assert_eq!(client(&a.netns, &cgroup.0, "tcp", mapped(60, 80)), "ok b1");
    let r = client(&a.netns, &cgroup.0, "udp", mapped(60, 53));
    assert_eq!(
        r,
        format!("ok b1 from={}", mapped(60, 53)),
        "IPv4-mapped UDP"
    );

    // Denied: c6 leads to c, which a's egress policy does not allow (judged as c).
    let r = client(&a.netns, &cgroup.0, "tcp", v6(0x62, 80));
    assert!(r.starts_with("err TimedOut"), "a -> c6 is denied: {r}");
    let r = client(&c.netns, &cgroup.0, "tcp", v6(0x60, 80));
    assert_eq!(r, "ok b1", "c has no egress policy");
    // No ready backend: the connect fails at once.
    let fails_at_once = |r: &str| {
        let ms: u64 = r
            .rsplit(' ')
            .next()
            .and_then(|t| t.strip_suffix("ms"))
            .and_then(|t| t.parse().ok())
            .unwrap_or(u64::MAX);
        r.starts_with("err PermissionDenied") && ms < 1000
    };
    let r = client(&a.netns, &cgroup.0, "tcp", v6(0x63, 80));
    assert!(
        fails_at_once(&r),
        "an IPv6 Service with no ready backend: {r}"
    );

    // kill -9: IPv6 translation goes on and still fails closed; the restart keeps every id.
    let before = ids(&agent.cli_json(&["service", "list"]));
    assert!(before.iter().all(|(_, s, _)| s.is_u64()), "{before:?}");
    if let Some(mut child) = agent.child.take() {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    assert_eq!(client(&a.netns, &cgroup.0, "tcp", v6(0x60, 80)), "ok b1");
    let r = client(&a.netns, &cgroup.0, "tcp", v6(0x63, 80));
    assert!(fails_at_once(&r), "still fails closed: {r}");
    let mut agent = Agent::start_with(tmp.path(), &args);
    pods.socket = agent.socket();
    let after = ids(&agent.cli_json(&["service", "list"]));
    assert_eq!(
        after, before,
        "IPv6 service and backend ids survive the restart"
    );
    assert_eq!(client(&a.netns, &cgroup.0, "tcp", v6(0x60, 80)), "ok b1");
    drop(pods);
    agent.stop();
}

// ---------------------------------------------------------------- a tiny DNS, for the test only

/// A DNS query for `name`, type A, class IN (RFC 1035 section 4).
fn dns_query(id: u16, name: &str) -> Vec<u8> {
    let mut q = id.to_be_bytes().to_vec();
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// The answer to `query`: the same id and question, one A record (TTL 60) with `addr`.
fn dns_reply(query: &[u8], addr: Ipv4Addr) -> Option<Vec<u8>> {
    // Header (12 bytes), then the question: labels up to the root, type and class.
    let mut end = 12;
    while *query.get(end)? != 0 {
        end += 1 + *query.get(end)? as usize;
    }
    let question = query.get(12..end + 5)?;
    let mut r = query.get(..2)?.to_vec();
    r.extend_from_slice(&[0x81, 0x80, 0, 1, 0, 1, 0, 0, 0, 0]);
    r.extend_from_slice(question);
    r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
    r.extend_from_slice(&addr.octets());
    Some(r)
}

/// The address of the first A record of a reply with id `id`.
fn dns_answer(reply: &[u8], id: u16) -> Option<Ipv4Addr> {
    if reply.get(..2)? != id.to_be_bytes() || reply.get(7)? == &0 {
        return None;
    }
    let rdata = reply.len().checked_sub(4)?;
    let b = reply.get(rdata..)?;
    Some(Ipv4Addr::new(b[0], b[1], b[2], b[3]))
}

/// A DNS server in a pod's namespace (UDP 53 on its IPv4 address) that answers every name
/// with `addr`.
fn dns_server(pod: &CniPod, addr: Ipv4Addr) {
    dns_server_on(pod, IpAddr::V4(pod.addr), addr);
}

/// `dns_server` on the pod's address `own`.
fn dns_server_on(pod: &CniPod, own: IpAddr, addr: Ipv4Addr) {
    let (tx, rx) = std::sync::mpsc::channel();
    in_netns(&pod.netns, move || {
        let s = UdpSocket::bind((own, 53)).expect("bind 53");
        tx.send(()).unwrap();
        let mut buf = [0u8; 512];
        while let Ok((n, from)) = s.recv_from(&mut buf) {
            if let Some(r) = dns_reply(&buf[..n], addr) {
                let _ = s.send_to(&r, from);
            }
        }
    });
    rx.recv().unwrap();
}

#[test]
fn the_tiny_dns_round_trips() {
    let q = dns_query(7, "www.example.test.");
    let r = dns_reply(&q, Ipv4Addr::new(192, 0, 2, 7)).expect("a reply");
    assert_eq!(dns_answer(&r, 7), Some(Ipv4Addr::new(192, 0, 2, 7)));
    assert_eq!(dns_answer(&r, 8), None, "another id");
}

/// The cluster Services tests' policy: a may send only to kube-dns on UDP 53 and to app=b on
/// TCP 8080.
fn a_to_dns_and_b() -> Value {
    serde_json::json!({
        "apiVersion": "cilium.io/v2", "kind": "CiliumNetworkPolicy",
        "metadata": {"name": "a-egress", "namespace": "x"},
        "spec": {"endpointSelector": {"matchLabels": {"app": "a"}}, "egress": [
            {"toEndpoints": [{"matchLabels": {"k8s-app": "kube-dns"}}],
             "toPorts": [{"ports": [{"port": "53", "protocol": "UDP"}]}]},
            {"toEndpoints": [{"matchLabels": {"app": "b"}}],
             "toPorts": [{"ports": [{"port": "8080", "protocol": "TCP"}]}]}]}
    })
}

/// Services and EndpointSlice objects of namespace x in the cluster's API server.
fn apply_service(c: &Cluster, name: &str, ip: &str, port: u16, proto: &str, target: Value) {
    c.api()
        .apply_json(serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "x"},
            "spec": {"clusterIP": ip, "ports": [
                {"name": "p", "port": port, "protocol": proto, "targetPort": target}]}
        }))
        .expect("service");
}

fn apply_slice(c: &Cluster, service: &str, backends: &[Ipv4Addr], port: u16, proto: &str) {
    let backends: Vec<IpAddr> = backends.iter().copied().map(IpAddr::V4).collect();
    apply_slice_of(c, service, &backends, port, proto);
}

/// An EndpointSlice of `backends`' family (all of one family).
fn apply_slice_of(c: &Cluster, service: &str, backends: &[IpAddr], port: u16, proto: &str) {
    let family = if backends.iter().all(IpAddr::is_ipv6) {
        "IPv6"
    } else {
        "IPv4"
    };
    let endpoints: Vec<Value> = backends
        .iter()
        .map(|b| serde_json::json!({"addresses": [b.to_string()], "conditions": {"ready": true}}))
        .collect();
    c.api()
        .apply_json(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{service}-1"), "namespace": "x",
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": family,
            "endpoints": endpoints,
            "ports": [{"name": "p", "port": port, "protocol": proto}]
        }))
        .expect("endpointslice");
}

/// Three nodes in Kubernetes mode, each agent translating Services for its own cgroup. Pod a
/// on node 1 may talk only to kube-dns on 53 and app=b on 8080. Through ClusterIPs (blackholed
/// in every pod, so only translation reaches anything): it resolves a name through the kube-dns
/// Service (the DNS pod on node 3), reaches b on node 2 (also with a kube-proxy-style DNAT rule
/// for the ClusterIP present on the node), is denied through c's Service, a
/// backend taken out of the slice gets no new connection, and with node 1's agent killed (-9)
/// new connections are still translated, the restart keeping every id.
#[test]
fn services_across_nodes_in_kubernetes_mode_are_translated_before_egress_policy() {
    if privileged() {
        services_across_nodes(Cluster::start_with_services(3));
    }
}

/// The same in tunnel mode.
#[test]
fn services_across_nodes_in_tunnel_mode_are_translated_before_egress_policy() {
    if privileged() {
        services_across_nodes(Cluster::start_with_services_and(
            3,
            &["--routing-mode", "tunnel"],
        ));
    }
}

fn services_across_nodes(mut c: Cluster) {
    // Not the single-node test's range (same process id): each test's ClusterIPs are its own.
    let net = format!("10.97.{}", 100 + std::process::id() % 150);
    let a = c.add_pod(1, "a", "a");
    let free = c.add_pod(1, "free", "free");
    let b1 = c.add_pod(2, "b1", "b");
    let b2 = c.add_pod(3, "b2", "b");
    let cc = c.add_pod(3, "c", "c");
    let api = c.api.take().expect("API server");
    let dns = c.nodes[2].add_pod_labelled(&api, "dns", serde_json::json!({"k8s-app": "kube-dns"}));
    c.api = Some(api);
    for p in [&a, &free, &b1, &b2, &cc, &dns] {
        blackhole(&p.netns, &net);
    }
    for p in [&b1, &b2, &cc] {
        named_servers(p);
    }
    let answer = Ipv4Addr::new(192, 0, 2, 80);
    dns_server(&dns, answer);
    c.api().apply_json(a_to_dns_and_b()).expect("policy");
    apply_service(
        &c,
        "kube-dns",
        &format!("{net}.10"),
        53,
        "UDP",
        serde_json::json!(53),
    );
    apply_slice(&c, "kube-dns", &[dns.addr], 53, "UDP");
    // b's Service names its targetPort; the slice says which port that is.
    apply_service(
        &c,
        "b",
        &format!("{net}.20"),
        80,
        "TCP",
        serde_json::json!("p"),
    );
    apply_slice(&c, "b", &[b1.addr], 8080, "TCP");
    apply_service(
        &c,
        "c",
        &format!("{net}.30"),
        80,
        "TCP",
        serde_json::json!(8080),
    );
    apply_slice(&c, "c", &[cc.addr], 8080, "TCP");
    let cgroup = c.nodes[0].cgroup.clone().expect("node 1's cgroup");
    let to =
        |last: u8, port: u16| -> SocketAddr { format!("{net}.{last}:{port}").parse().unwrap() };
    let list = |c: &Cluster| c.nodes[0].agent().cli_json(&["service", "list"]);
    eventually("node 1 has every Service with its backend", || {
        let l = list(&c);
        l.as_array().is_some_and(|l| {
            l.len() == 3
                && l.iter()
                    .all(|f| f["backends"].as_array().is_some_and(|b| b.len() == 1))
        })
    });
    eventually("a's policy is realized on node 1", || {
        let (code, out, _) = c.nodes[0].agent().cli(&["endpoint", "list", "-o", "json"]);
        let v: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
        code == 0
            && v.as_array()
                .is_some_and(|e| e.iter().all(|e| e["state"] == "ready"))
    });
    // Node 1 knows the other nodes' pods once their agents' endpoint slices reached it.
    eventually("node 1 knows the backends on nodes 2 and 3", || {
        let body = ciliate::client::request(&c.nodes[0].socket(), "GET", "/v1/ipcache", None)
            .unwrap_or_default();
        [dns.addr, b1.addr, cc.addr]
            .iter()
            .all(|ip| body.contains(&format!("\"{ip}/32\"")))
    });

    // DNS through the kube-dns ClusterIP: the reply appears to come from the ClusterIP.
    let r = client(&a.netns, &cgroup, "dns:www.example.test", to(10, 53));
    assert_eq!(
        r,
        format!("ok {answer} from={}", to(10, 53)),
        "DNS via kube-dns"
    );
    // b through its Service, b on node 2.
    let r = client(&a.netns, &cgroup, "tcp", to(20, 80));
    assert_eq!(r, "ok b1", "b through its ClusterIP");
    // With kube-proxy's rules present too (here a DNAT of b's ClusterIP to c in node 1's nat
    // table, as kube-proxy's nftables mode writes it), the agent's translation comes first:
    // the packets already carry b's address, the rule never matches, b's identity is judged.
    let node1_ns = c.nodes[0].netns.clone();
    let rules = format!(
        "table ip kube-proxy-test {{\n  chain pre {{\n    type nat hook prerouting priority dstnat;\n    ip daddr {net}.20 tcp dport 80 dnat to {}:8080\n  }}\n}}\n",
        cc.addr
    );
    nft(&node1_ns, &rules);
    assert_eq!(client(&a.netns, &cgroup, "tcp", to(20, 80)), "ok b1");
    let _ = Command::new("ip")
        .args([
            "netns",
            "exec",
            &node1_ns,
            "nft",
            "delete table ip kube-proxy-test",
        ])
        .output();
    // c's Service: translated to c, which a's egress policy does not allow.
    let r = client(&a.netns, &cgroup, "tcp", to(30, 80));
    assert!(r.starts_with("err"), "c through its Service is denied: {r}");
    // ... by a's policy: a pod without one reaches c through the same Service.
    assert_eq!(client(&free.netns, &cgroup, "tcp", to(30, 80)), "ok c");

    // b2 joins, then b1 leaves the slice: every new connection goes to b2.
    apply_slice(&c, "b", &[b1.addr, b2.addr], 8080, "TCP");
    eventually("b has two backends on node 1", || {
        let l = list(&c);
        frontend(&l, &format!("{net}.20:80/TCP"))["backends"]
            .as_array()
            .map(Vec::len)
            == Some(2)
    });
    apply_slice(&c, "b", &[b2.addr], 8080, "TCP");
    eventually("b1 is out of b's backends on node 1", || {
        let l = list(&c);
        frontend(&l, &format!("{net}.20:80/TCP"))["backends"]
            .as_array()
            .map(Vec::len)
            == Some(1)
    });
    for _ in 0..6 {
        assert_eq!(client(&a.netns, &cgroup, "tcp", to(20, 80)), "ok b2");
    }

    // kill -9: translation goes on from the pinned maps, and the restart keeps every id.
    let before = ids(&list(&c));
    c.nodes[0].kill9_agent();
    assert_eq!(client(&a.netns, &cgroup, "tcp", to(20, 80)), "ok b2");
    let r = client(&a.netns, &cgroup, "dns:www.example.test", to(10, 53));
    assert!(
        r.starts_with(&format!("ok {answer}")),
        "DNS with the agent down: {r}"
    );
    let kubeconfig = c.kubeconfig.clone();
    c.nodes[0].start_agent(&kubeconfig);
    eventually("node 1 is back with every Service", || {
        ids(&list(&c))
            .iter()
            .filter(|(_, _, b)| b.as_array().is_some_and(|b| !b.is_empty()))
            .count()
            == 3
    });
    assert_eq!(
        ids(&list(&c)),
        before,
        "service and backend ids survive the restart"
    );
    assert_eq!(client(&a.netns, &cgroup, "tcp", to(20, 80)), "ok b2");
    assert!(client(&a.netns, &cgroup, "tcp", to(30, 80)).starts_with("err"));
}

/// The Kubernetes-mode Services test over IPv6 (#31), on three IPv6-only nodes (native
/// routing, and tunnel over an IPv6 underlay) and on three dual-stack ones: IPv6 ClusterIPs (blackholed in every pod), IPv6 EndpointSlices. Pod a on
/// node 1 resolves a name through the kube-dns Service (the DNS pod on node 3; the reply
/// comes from the ClusterIP), reaches b on node 2 through b's Service, is denied through c's
/// (by its own egress policy: a pod without one gets through), and with node 1's agent
/// killed (-9) new connections are still translated; the restart keeps every id.
#[test]
fn ipv6_services_across_ipv6_only_nodes_are_translated_before_egress_policy() {
    if privileged() {
        ipv6_services_across_nodes(Cluster::start_with_services_and(
            3,
            &["--enable-ipv4=false", "--enable-ipv6=true"],
        ));
    }
}

#[test]
fn ipv6_services_across_ipv6_only_nodes_in_tunnel_mode_are_translated_before_egress_policy() {
    if privileged() {
        ipv6_services_across_nodes(Cluster::start_with_services_and(
            3,
            &[
                "--enable-ipv4=false",
                "--enable-ipv6=true",
                "--routing-mode",
                "tunnel",
                "--underlay-protocol",
                "ipv6",
            ],
        ));
    }
}

#[test]
fn ipv6_services_across_dual_stack_nodes_are_translated_before_egress_policy() {
    if privileged() {
        ipv6_services_across_nodes(Cluster::start_with_services_and(3, &["--enable-ipv6=true"]));
    }
}

#[test]
fn ipv6_services_across_dual_stack_nodes_in_tunnel_mode_are_translated_before_egress_policy() {
    if privileged() {
        ipv6_services_across_nodes(Cluster::start_with_services_and(
            3,
            &["--enable-ipv6=true", "--routing-mode", "tunnel"],
        ));
    }
}

fn ipv6_services_across_nodes(mut c: Cluster) {
    // This test's own IPv6 ClusterIP range.
    let net = format!("fd00:97:{:x}:", std::process::id() % 0xffff);
    let a = c.add_pod(1, "a", "a");
    let free = c.add_pod(1, "free", "free");
    let b1 = c.add_pod(2, "b1", "b");
    let cc = c.add_pod(3, "c", "c");
    let api = c.api.take().expect("API server");
    let dns = c.nodes[2].add_pod_labelled(&api, "dns", serde_json::json!({"k8s-app": "kube-dns"}));
    c.api = Some(api);
    let six = |p: &CniPod| IpAddr::V6(p.addr6.expect("an IPv6 address"));
    for p in [&a, &free, &b1, &cc, &dns] {
        ip(&[
            "-n",
            &p.netns,
            "-6",
            "route",
            "add",
            "blackhole",
            &format!("{net}:/112"),
        ]);
    }
    for p in [&b1, &cc] {
        named_servers(p);
    }
    let answer = Ipv4Addr::new(192, 0, 2, 80);
    dns_server_on(&dns, six(&dns), answer);
    c.api().apply_json(a_to_dns_and_b()).expect("policy");
    apply_service(
        &c,
        "kube-dns",
        &format!("{net}:10"),
        53,
        "UDP",
        serde_json::json!(53),
    );
    apply_slice_of(&c, "kube-dns", &[six(&dns)], 53, "UDP");
    apply_service(
        &c,
        "b",
        &format!("{net}:20"),
        80,
        "TCP",
        serde_json::json!("p"),
    );
    apply_slice_of(&c, "b", &[six(&b1)], 8080, "TCP");
    apply_service(
        &c,
        "c",
        &format!("{net}:30"),
        80,
        "TCP",
        serde_json::json!(8080),
    );
    apply_slice_of(&c, "c", &[six(&cc)], 8080, "TCP");
    let cgroup = c.nodes[0].cgroup.clone().expect("node 1's cgroup");
    let to = |last: u8, port: u16| SocketAddr::new(format!("{net}:{last}").parse().unwrap(), port);
    let list = |c: &Cluster| c.nodes[0].agent().cli_json(&["service", "list"]);
    eventually("node 1 has every IPv6 Service with its backend", || {
        let l = list(&c);
        l.as_array().is_some_and(|l| {
            l.len() == 3
                && l.iter().all(|f| {
                    f["frontend"].as_str().is_some_and(|s| s.starts_with('['))
                        && f["backends"].as_array().is_some_and(|b| b.len() == 1)
                })
        })
    });
    eventually("node 1 knows the backends on nodes 2 and 3", || {
        let body = ciliate::client::request(&c.nodes[0].socket(), "GET", "/v1/ipcache", None)
            .unwrap_or_default();
        [six(&dns), six(&b1), six(&cc)]
            .iter()
            .all(|ip| body.contains(&format!("\"{ip}/128\"")))
    });
    eventually("a's policy is realized on node 1", || {
        client(&a.netns, &cgroup, "tcp", to(20, 80)) == "ok b1"
    });
    let r = client(&a.netns, &cgroup, "dns:www.example.test", to(10, 53));
    assert_eq!(
        r,
        format!("ok {answer} from={}", to(10, 53)),
        "DNS via kube-dns"
    );
    let r = client(&a.netns, &cgroup, "tcp", to(30, 80));
    assert!(r.starts_with("err"), "c through its Service is denied: {r}");
    assert_eq!(client(&free.netns, &cgroup, "tcp", to(30, 80)), "ok c");
    let r = client(&a.netns, &cgroup, "udp", to(20, 53));
    assert!(
        r.starts_with("err"),
        "b's Service has no UDP 53 frontend: {r}"
    );

    let before = ids(&list(&c));
    c.nodes[0].kill9_agent();
    assert_eq!(
        client(&a.netns, &cgroup, "tcp", to(20, 80)),
        "ok b1",
        "agent down"
    );
    let r = client(&a.netns, &cgroup, "dns:www.example.test", to(10, 53));
    assert!(
        r.starts_with(&format!("ok {answer}")),
        "DNS with the agent down: {r}"
    );
    let kubeconfig = c.kubeconfig.clone();
    c.nodes[0].start_agent(&kubeconfig);
    eventually("node 1 is back with every Service", || {
        ids(&list(&c))
            .iter()
            .filter(|(_, _, b)| b.as_array().is_some_and(|b| !b.is_empty()))
            .count()
            == 3
    });
    assert_eq!(ids(&list(&c)), before, "ids survive the restart");
    assert_eq!(client(&a.netns, &cgroup, "tcp", to(20, 80)), "ok b1");
    assert!(client(&a.netns, &cgroup, "tcp", to(30, 80)).starts_with("err"));
}
