//! `ciliate demo`: the out-of-the-box demonstration on one Linux host (root).
//!
//! A cluster of two nodes: node 1 is this host, node 2 a network namespace joined to it by a
//! veth pair. Each node runs a real agent (BPF datapath, standalone mode, native routing to
//! the other node's pod CIDR, socket-level Service translation under a cgroup of its own), on
//! one shared manifest directory that holds the Nodes, Pods, Services and EndpointSlices as a
//! cluster would. Four pods are created as network namespaces through the real CNI path
//! (`ciliate-cni ADD`, which is this binary under another name), two per node. The demo
//! measures the connectivity matrix and two Services with real TCP connections, applies one
//! policy of each kind (NetworkPolicy, CiliumNetworkPolicy with an egress rule,
//! CiliumClusterwideNetworkPolicy), measures again, shows why the drops happened from the
//! datapath's verdict events, and leaves the agents and node 1's `/debug/` page running until
//! Ctrl-C. Everything it created (pods, nodes, devices, cgroups, pins, files) is removed on
//! the way out, also after an error. It never touches the host's firewall: masquerading is
//! off (the pods talk only to each other).

mod net;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::datapath::netdev;

/// `ciliate demo` settings.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// Print the matrices and clean up, without waiting for Ctrl-C.
    pub once: bool,
    /// Apply no policy: the cluster as it was before any (for `policy recommend` and `policy
    /// diff` on its traffic); the demo's policies are written beside, as a proposal.
    pub no_policies: bool,
    pub debug_addr: SocketAddr,
    /// The demo's address space: both nodes' pod CIDRs and the link between the nodes.
    pub pod_cidr: ipnet::Ipv4Net,
}

/// One demo pod.
struct DemoPod {
    namespace: &'static str,
    name: &'static str,
    app: &'static str,
    /// The port its server listens on.
    port: u16,
    /// 0: node 1 (this host), 1: node 2.
    node: usize,
}

const PODS: [DemoPod; 4] = [
    DemoPod {
        namespace: "shop",
        name: "frontend",
        app: "frontend",
        port: 80,
        node: 0,
    },
    DemoPod {
        namespace: "shop",
        name: "backend",
        app: "backend",
        port: 8080,
        node: 0,
    },
    DemoPod {
        namespace: "shop",
        name: "db",
        app: "db",
        port: 5432,
        node: 1,
    },
    DemoPod {
        namespace: "tools",
        name: "debug",
        app: "debug",
        port: 22,
        node: 1,
    },
];

const NODES: [&str; 2] = ["demo-node-1", "demo-node-2"];

/// The Services: (name, ClusterIP, port, the pod behind it). ClusterIPs are blackholed inside
/// every pod, so only the agents' translation gets a connection anywhere.
const SERVICES: [(&str, Ipv4Addr, u16, &str); 2] = [
    ("db", Ipv4Addr::new(10, 96, 200, 10), 5432, "db"),
    ("frontend", Ipv4Addr::new(10, 96, 200, 11), 80, "frontend"),
];
const SERVICE_RANGE: &str = "10.96.200.0/24";

/// The demo's cluster: namespaces, both Nodes, the pods (with their addresses once CNI gave
/// them) and the Services (with their EndpointSlices once the backends have addresses).
fn cluster_yaml(plan: &net::Plan, ips: &[(&DemoPod, Ipv4Addr)]) -> String {
    let mut y = String::from(
        "# The demo's cluster, as the API server would hold it (written by ciliate demo).
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: shop}}
---
apiVersion: v1
kind: Namespace
metadata: {name: tools}
",
    );
    for (i, node) in NODES.iter().enumerate() {
        y.push_str(&format!(
            "---
apiVersion: v1
kind: Node
metadata: {{name: {node}}}
spec: {{podCIDRs: ['{}']}}
status: {{addresses: [{{type: InternalIP, address: '{}'}}]}}
",
            plan.pod_cidrs[i], plan.node_ips[i]
        ));
    }
    for p in &PODS {
        let status = ips
            .iter()
            .find(|(q, _)| q.name == p.name)
            .map(|(_, ip)| format!("\nstatus: {{podIPs: [{{ip: '{ip}'}}]}}"))
            .unwrap_or_default();
        y.push_str(&format!(
            "---
apiVersion: v1
kind: Pod
metadata: {{name: {}, namespace: {}, labels: {{app: {}}}}}
spec: {{nodeName: {}}}{status}
",
            p.name, p.namespace, p.app, NODES[p.node]
        ));
    }
    for (name, ip, port, pod) in SERVICES {
        y.push_str(&format!(
            "---
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: shop}}
spec: {{clusterIP: '{ip}', ports: [{{name: tcp, port: {port}, targetPort: {port}}}]}}
"
        ));
        if let Some((_, backend)) = ips.iter().find(|(q, _)| q.name == pod) {
            y.push_str(&format!(
                "---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: shop, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
endpoints: [{{addresses: ['{backend}'], nodeName: {}}}]
ports: [{{name: tcp, port: {port}}}]
",
                NODES[PODS.iter().find(|p| p.name == pod).map_or(0, |p| p.node)]
            ));
        }
    }
    y
}

const POLICIES: &str = "# Kubernetes NetworkPolicy: the shop namespace denies ingress by default,
# except the frontend's port 80 from anywhere in the cluster.
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: default-deny, namespace: shop}
spec:
  podSelector: {}
  policyTypes: [Ingress]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: frontend-public, namespace: shop}
spec:
  podSelector: {matchLabels: {app: frontend}}
  ingress:
    - from: [{namespaceSelector: {}}]
      ports: [{port: 80, protocol: TCP}]
---
# CiliumNetworkPolicy: frontend -> backend:8080 and backend -> db:5432 (db is on the other
# node: its identity comes from its Pod object), and the backend may talk to nothing else
# (egress: Services are translated before this rule judges the backend pod).
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: tiers, namespace: shop}
specs:
  - endpointSelector: {matchLabels: {app: backend}}
    ingress:
      - fromEndpoints: [{matchLabels: {app: frontend}}]
        toPorts: [{ports: [{port: '8080', protocol: TCP}]}]
    egress:
      - toEndpoints: [{matchLabels: {app: db}}]
        toPorts: [{ports: [{port: '5432', protocol: TCP}]}]
  - endpointSelector: {matchLabels: {app: db}}
    ingress:
      - fromEndpoints: [{matchLabels: {app: backend}}]
        toPorts: [{ports: [{port: '5432', protocol: TCP}]}]
---
# CiliumClusterwideNetworkPolicy: nothing in the tools namespace may ever reach a database,
# whatever other policies allow (deny wins).
apiVersion: cilium.io/v2
kind: CiliumClusterwideNetworkPolicy
metadata: {name: no-tools-to-db}
spec:
  endpointSelector: {matchLabels: {app: db}}
  ingressDeny:
    - fromEndpoints: [{matchLabels: {k8s:io.kubernetes.pod.namespace: tools}}]
";

/// The verdict the policies above owe: may `from` reach `to`?
fn expected_after(from: &str, to: &str) -> bool {
    match from {
        // The backend's egress allows only db:5432.
        "backend" => to == "db",
        // tools/debug has no policy of its own: only the others' ingress rules bind it.
        _ => matches!(
            (from, to),
            (_, "frontend") | (_, "debug") | ("frontend", "backend")
        ),
    }
}

/// What one node of the demo owns: its agent, socket, pins and (node 2) network namespace.
struct Node {
    name: &'static str,
    dir: PathBuf,
    pins: PathBuf,
    /// Node 2's namespace; node 1 is this host's.
    netns: Option<String>,
    cgroup: PathBuf,
    agent: Option<Child>,
}

impl Node {
    fn socket(&self) -> PathBuf {
        self.dir.join("ciliate.sock")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    /// SIGTERM to the agent; true when it exited by itself within 10 s (else it is killed).
    fn stop_agent(&mut self) -> bool {
        let Some(mut agent) = self.agent.take() else {
            return true;
        };
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(agent.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = agent.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = agent.kill();
        let _ = agent.wait();
        false
    }
}

/// What the demo made, removed on drop.
struct Scratch {
    dir: PathBuf,
    nodes: Vec<Node>,
    /// The veth between this host and node 2.
    link: String,
    /// The demo's cgroup (the nodes' are inside), and the one this process came from.
    cgroup: PathBuf,
    home_cgroup: Option<PathBuf>,
    netns: Vec<String>,
    /// (node, container id, netns) of pods added through CNI.
    added: Vec<(usize, String, String)>,
    exe: PathBuf,
}

impl Scratch {
    fn cni(
        &self,
        node: usize,
        command: &str,
        container: &str,
        netns: &str,
        pod: Option<(&str, &str)>,
    ) -> Result<serde_json::Value, String> {
        let conf = serde_json::json!({
            "cniVersion": "1.0.0", "name": "ciliate", "type": "ciliate-cni",
            "agentSocket": self.nodes[node].socket(),
        });
        let mut cmd = Command::new(&self.exe);
        cmd.arg0("ciliate-cni")
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", container)
            .env("CNI_NETNS", Path::new(netdev::NETNS_DIR).join(netns))
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", self.exe.parent().unwrap_or(Path::new("/")))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some((ns, name)) = pod {
            cmd.env(
                "CNI_ARGS",
                format!("K8S_POD_NAMESPACE={ns};K8S_POD_NAME={name}"),
            );
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot run the CNI plugin: {e}"))?;
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(conf.to_string().as_bytes());
        }
        let out = child
            .wait_with_output()
            .map_err(|e| format!("CNI plugin: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if !out.status.success() {
            return Err(format!("CNI {command} {container}: {}", text.trim()));
        }
        if text.trim().is_empty() {
            return Ok(serde_json::Value::Null);
        }
        serde_json::from_str(&text).map_err(|e| format!("CNI {command}: {e}: {text}"))
    }

    /// Pods first (CNI DEL needs the agents), then the agents, which must stop by themselves.
    /// False when an agent had to be killed.
    fn remove_pods_and_stop_agents(&mut self) -> bool {
        for (node, container, netns) in std::mem::take(&mut self.added) {
            if let Err(e) = self.cni(node, "DEL", &container, &netns, None) {
                eprintln!("cleanup: {e}");
                if node == 0 {
                    let _ = netdev::delete_host_interface(&netdev::host_interface_name(&container));
                }
            }
        }
        let mut clean = true;
        for n in &mut self.nodes {
            if !n.stop_agent() {
                eprintln!(
                    "cleanup: the agent of {} did not stop on SIGTERM within 10 s and was killed",
                    n.name
                );
                clean = false;
            }
        }
        clean
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        self.remove_pods_and_stop_agents();
        if let Some(home) = &self.home_cgroup {
            if let Err(e) = crate::datapath::cgroup::join_cgroup(home) {
                eprintln!("cleanup: {e}");
            }
        }
        if let Err(e) = net::delete_node_link(&self.link) {
            eprintln!("cleanup: {e}");
        }
        for ns in &self.netns {
            if let Err(e) = netdev::delete_netns(ns) {
                eprintln!("cleanup: {e}");
            }
        }
        for n in &self.nodes {
            let _ = std::fs::remove_dir_all(&n.pins);
            let _ = std::fs::remove_dir(&n.cgroup);
        }
        let _ = std::fs::remove_dir(&self.cgroup);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `f` in a new thread that entered the network namespace `netns`.
fn in_netns<T: Send + 'static>(
    netns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<std::thread::JoinHandle<T>, String> {
    let path = Path::new(netdev::NETNS_DIR).join(netns);
    let file = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(std::thread::spawn(move || {
        if let Err(e) = nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET) {
            panic!("setns: {e}");
        }
        f()
    }))
}

/// A TCP server in the pod that answers every connection with the pod's name.
fn serve(netns: &str, addr: Ipv4Addr, port: u16, name: &'static str) -> Result<(), String> {
    let (tx, rx) = std::sync::mpsc::channel();
    in_netns(netns, move || {
        let l = match TcpListener::bind((addr, port)) {
            Ok(l) => l,
            Err(e) => {
                let _ = tx.send(Err(format!("listen on {addr}:{port}: {e}")));
                return;
            }
        };
        let _ = tx.send(Ok(()));
        for mut s in l.incoming().flatten() {
            let _ = s.write_all(name.as_bytes());
        }
    })?;
    rx.recv_timeout(Duration::from_secs(5))
        .map_err(|_| format!("the server of {name} did not start"))?
}

/// Does a TCP connection from `netns` to `to:port` complete, and which pod answered?
fn connects(netns: &str, to: Ipv4Addr, port: u16) -> Option<String> {
    let t = in_netns(netns, move || {
        let mut s = TcpStream::connect_timeout(
            &SocketAddr::new(IpAddr::V4(to), port),
            Duration::from_millis(400),
        )
        .ok()?;
        let _ = s.set_read_timeout(Some(Duration::from_millis(400)));
        let mut buf = [0u8; 16];
        match s.read(&mut buf) {
            Ok(n) if n > 0 => Some(String::from_utf8_lossy(&buf[..n]).to_string()),
            _ => None,
        }
    })
    .ok()?;
    t.join().ok().flatten()
}

/// A pod as the demo runs it: its netns and address.
type Running<'a> = (&'a DemoPod, String, Ipv4Addr);

/// Measures and prints a matrix of probes (`columns`: header, address, port, the pod that
/// must answer); returns the number of cells that differ from `expected`.
fn matrix(
    title: &str,
    rows: &[&Running],
    columns: &[(String, Ipv4Addr, u16, &str)],
    expected: impl Fn(&str, &str) -> bool,
) -> usize {
    println!("\n{title}");
    let width = columns
        .iter()
        .map(|c| c.0.len() + 2)
        .max()
        .unwrap_or(0)
        .max(18);
    let mut header = format!("  {:<16}", "from \\ to");
    for (h, _, _, _) in columns {
        header.push_str(&format!("{h:<width$}"));
    }
    println!("{header}");
    // Every probe in parallel: a denied one waits for its timeout.
    let mut probes = Vec::new();
    for (r, (src, ns, _)) in rows.iter().enumerate() {
        for (c, (_, ip, port, pod)) in columns.iter().enumerate() {
            if src.name == *pod {
                continue;
            }
            let (ns, ip, port) = (ns.clone(), *ip, *port);
            probes.push(((r, c), std::thread::spawn(move || connects(&ns, ip, port))));
        }
    }
    let results: Vec<((usize, usize), Option<String>)> = probes
        .into_iter()
        .map(|(at, t)| (at, t.join().ok().flatten()))
        .collect();
    let mut wrong = 0;
    for (r, (src, _, _)) in rows.iter().enumerate() {
        let mut line = format!("  {:<16}", format!("{}/{}", src.namespace, src.name));
        for (c, (_, _, _, pod)) in columns.iter().enumerate() {
            let cell = if src.name == *pod {
                "-".to_string()
            } else {
                let answer = results
                    .iter()
                    .find(|(at, _)| *at == (r, c))
                    .and_then(|(_, a)| a.clone());
                // Only the pod behind the address counts as reached.
                let ok = answer.as_deref() == Some(*pod);
                let mark = if ok { "allow" } else { "DENY" };
                if ok != expected(src.name, pod) {
                    wrong += 1;
                    format!("{mark} (unexpected!)")
                } else {
                    mark.to_string()
                }
            };
            line.push_str(&format!("{cell:<width$}"));
        }
        println!("{line}");
    }
    wrong
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("timed out waiting until {what}"))
}

fn get_json(socket: &Path, path: &str) -> Option<serde_json::Value> {
    serde_json::from_str(&crate::client::request(socket, "GET", path, None).ok()?).ok()
}

fn policy_revision(socket: &Path) -> Option<(u64, bool)> {
    let v = get_json(socket, "/v1/endpoints")?;
    let want = get_json(socket, "/v1/policy")?["revision"].as_u64()?;
    let all = v
        .as_array()?
        .iter()
        .all(|e| e["policy_revision"].as_u64().unwrap_or(0) >= want && e["state"] == "ready");
    Some((want, all))
}

/// Has this agent taken in every Service with its backend, and a route to the other node?
fn cluster_known(socket: &Path) -> bool {
    let services = get_json(socket, "/v1/services").unwrap_or_default();
    let with_backends = services
        .as_array()
        .map(|l| {
            l.iter()
                .filter(|f| f["backends"].as_array().is_some_and(|b| !b.is_empty()))
                .count()
        })
        .unwrap_or(0);
    let nodes = get_json(socket, "/v1/nodes").unwrap_or_default();
    let routed = nodes
        .as_array()
        .map(|l| l.iter().any(|n| n["route"] == "installed"))
        .unwrap_or(false);
    with_backends == SERVICES.len() && routed
}

/// Runs the demo. Returns the exit status: 0, or 1 when a verdict differed from the expected
/// one or something failed.
pub fn run(config: DemoConfig) -> i32 {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("error: ciliate demo needs root (it creates network namespaces, veths and BPF programs); try: sudo ciliate demo");
        return 1;
    }
    match run_inner(&config) {
        Ok(0) => 0,
        Ok(wrong) => {
            eprintln!("error: {wrong} verdict(s) differ from what the policies say");
            1
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// Starts the agent of `node` (in node 2's namespace for node 1) and waits until it is ready.
fn start_agent(
    scratch: &mut Scratch,
    i: usize,
    manifests: &Path,
    plan: &net::Plan,
    debug_addr: SocketAddr,
) -> Result<(), String> {
    let node = &scratch.nodes[i];
    std::fs::create_dir_all(&node.dir).map_err(|e| format!("{}: {e}", node.dir.display()))?;
    let log = std::fs::File::create(node.dir.join("agent.log")).map_err(|e| e.to_string())?;
    let mut agent = Command::new(&scratch.exe);
    agent
        .args(["agent", "--mode", "standalone", "--datapath", "bpf"])
        .args(["--node-name", node.name])
        .arg("--manifests")
        .arg(manifests)
        .arg("--state-dir")
        .arg(node.dir.join("state"))
        .arg("--api-socket")
        .arg(node.socket())
        .arg("--bpf-root")
        .arg(&node.pins)
        .arg("--debug-addr")
        .arg(debug_addr.to_string())
        .arg("--pod-cidr")
        .arg(plan.pod_cidrs[i].to_string())
        .args([
            "--routing-mode",
            "native",
            "--auto-direct-node-routes",
            "true",
        ])
        .arg("--ipv4-native-routing-cidr")
        .arg(plan.cluster.to_string())
        .arg("--enable-ipv4-masquerade=false")
        .arg("--cgroup-root")
        .arg(&node.cgroup)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdout(Stdio::null())
        .stderr(log)
        // Its own process group: Ctrl-C reaches the demo, which then cleans up through it.
        .process_group(0);
    let netns = match &node.netns {
        Some(ns) => Some(
            std::fs::File::open(Path::new(netdev::NETNS_DIR).join(ns))
                .map_err(|e| format!("node namespace {ns}: {e}"))?,
        ),
        None => None,
    };
    let netns_fd = netns.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
    // The demo blocks SIGINT/SIGTERM to take them with sigwait, and a child inherits the
    // mask: unblock them in the agent, or it could never shut down cleanly. Node 2's agent
    // enters its node's namespace (setns: the mount namespace, and so bpffs, stays).
    unsafe {
        agent.pre_exec(move || {
            if let Some(fd) = netns_fd {
                if nix::libc::setns(fd, nix::libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            demo_signals()
                .thread_unblock()
                .map_err(std::io::Error::from)
        });
    }
    let child = agent
        .spawn()
        .map_err(|e| format!("cannot start the agent of {}: {e}", node.name))?;
    drop(netns);
    let socket = node.socket();
    let name = node.name;
    scratch.nodes[i].agent = Some(child);
    let node = &mut scratch.nodes[i];
    wait_for(
        &format!("the agent of {name} is ready"),
        Duration::from_secs(30),
        || {
            if let Some(Ok(Some(_))) = node.agent.as_mut().map(|a| a.try_wait()) {
                return true;
            }
            crate::client::request(&socket, "GET", "/readyz", None).is_ok()
        },
    )
    .and_then(|_| {
        crate::client::request(&socket, "GET", "/readyz", None)
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .map_err(|e| {
        format!(
            "the agent of {name} did not start ({e}); its log:\n{}",
            node.log()
        )
    })
}

fn run_inner(config: &DemoConfig) -> Result<usize, String> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let plan = net::Plan::new(config.pod_cidr)?;
    // Ctrl-C and SIGTERM are taken with sigwait, so they must be blocked before any thread
    // exists (threads inherit the mask; spawned programs get a clean one).
    let signals = demo_signals();
    let _ = signals.thread_block();
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let tag = std::process::id();
    let dir = std::env::temp_dir().join(format!("ciliate-demo-{tag}"));
    let cgroup_mount = crate::datapath::cgroup::cgroup2_mount()?;
    let cgroup = cgroup_mount.join(format!("ciliate-demo-{tag}"));
    let mut scratch = Scratch {
        dir: dir.clone(),
        nodes: NODES
            .iter()
            .enumerate()
            .map(|(i, name)| Node {
                name,
                dir: dir.join(name),
                pins: PathBuf::from(format!("/sys/fs/bpf/ciliate-demo-{tag}-{}", i + 1)),
                netns: (i == 1).then(|| format!("ciliate-demo-{tag}-node-2")),
                cgroup: cgroup.join(name),
                agent: None,
            })
            .collect(),
        link: format!("cdm{tag}"),
        cgroup: cgroup.clone(),
        home_cgroup: None,
        netns: vec![],
        added: vec![],
        exe: exe.clone(),
    };
    let manifests = dir.join("manifests");
    // The scratch directory holds the agents' sockets: private whatever the caller's umask.
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .and_then(|()| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)))
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    std::fs::create_dir_all(&manifests).map_err(|e| format!("{}: {e}", manifests.display()))?;
    for n in &scratch.nodes {
        std::fs::create_dir_all(&n.cgroup).map_err(|e| format!("{}: {e}", n.cgroup.display()))?;
    }
    write_atomically(&manifests.join("cluster.yaml"), &cluster_yaml(&plan, &[]))?;

    println!("ciliate demo: two nodes, an agent with the eBPF datapath on each, four pods created through CNI, real TCP connections.");
    println!("  scratch directory {}", dir.display());
    // Node 2: a namespace of its own, joined to this host by a veth pair.
    let node2_ns = scratch.nodes[1].netns.clone().unwrap_or_default();
    let node2_path = netdev::create_netns(&node2_ns).map_err(|e| e.to_string())?;
    scratch.netns.push(node2_ns);
    net::create_node_link(
        &scratch.link,
        &node2_path,
        &plan,
        &format!("ciliate-demo:{tag}"),
    )
    .map_err(|e| format!("the link between the nodes: {e}"))?;
    // Node 2's debug server listens on its own namespace's loopback.
    let debug_addrs = [
        config.debug_addr,
        "127.0.0.1:9962".parse().expect("literal"),
    ];
    for i in 0..NODES.len() {
        start_agent(&mut scratch, i, &manifests, &plan, debug_addrs[i])?;
        println!(
            "  {} ({}): agent ready, pod CIDR {}, node IP {}{}",
            NODES[i],
            if i == 0 {
                "this host".to_string()
            } else {
                format!("namespace {}", scratch.netns[0])
            },
            plan.pod_cidrs[i],
            plan.node_ips[i],
            if i == 0 {
                format!(", debug page http://{}/debug/", config.debug_addr)
            } else {
                String::new()
            }
        );
    }
    // The demo's own connections (made from inside node 1's pods) are translated by node 1's
    // agent: this process joins node 1's cgroup (after the agents started, so they stay out).
    scratch.home_cgroup = Some(crate::datapath::cgroup::own_cgroup(&cgroup_mount)?);
    crate::datapath::cgroup::join_cgroup(&scratch.nodes[0].cgroup)?;

    // Pods through CNI, on their nodes.
    let mut pods: Vec<Running> = Vec::new();
    for p in &PODS {
        let ns = format!("ciliate-demo-{}-{}", tag, p.name);
        let path = netdev::create_netns(&ns).map_err(|e| e.to_string())?;
        scratch.netns.push(ns.clone());
        let container = format!("demo-{tag}-{}", p.name);
        let result = scratch.cni(p.node, "ADD", &container, &ns, Some((p.namespace, p.name)))?;
        scratch.added.push((p.node, container, ns.clone()));
        let ip: Ipv4Addr = result["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("CNI result without an address: {result}"))?;
        net::blackhole(&path, SERVICE_RANGE.parse().expect("a literal network"))
            .map_err(|e| format!("pod {}: {e}", p.name))?;
        println!(
            "  pod {}/{} ({}): {ip} on {} of {} (CNI ADD)",
            p.namespace,
            p.name,
            p.app,
            result["interfaces"][0]["name"].as_str().unwrap_or("?"),
            NODES[p.node]
        );
        serve(&ns, ip, p.port, p.name)?;
        pods.push((p, ns, ip));
    }
    // The pods' addresses and the Services' backends, as the API server would publish them.
    let ips: Vec<(&DemoPod, Ipv4Addr)> = pods.iter().map(|(p, _, ip)| (*p, *ip)).collect();
    write_atomically(&manifests.join("cluster.yaml"), &cluster_yaml(&plan, &ips))?;
    for n in &scratch.nodes {
        let socket = n.socket();
        wait_for(
            &format!(
                "{} knows both Services' backends and routes to the other node",
                n.name
            ),
            Duration::from_secs(30),
            || cluster_known(&socket),
        )?;
    }
    println!(
        "  routes: {} -> {} via {}, {} -> {} via {} (native routing)",
        NODES[0],
        plan.pod_cidrs[1],
        plan.node_ips[1],
        NODES[1],
        plan.pod_cidrs[0],
        plan.node_ips[0]
    );
    for (name, ip, port, pod) in SERVICES {
        println!("  Service shop/{name}: {ip}:{port}/TCP -> {pod}:{port}");
    }

    let all: Vec<&Running> = pods.iter().collect();
    let pod_columns: Vec<(String, Ipv4Addr, u16, &str)> = pods
        .iter()
        .map(|(p, _, ip)| (format!("{}:{}", p.name, p.port), *ip, p.port, p.name))
        .collect();
    let on_node_1: Vec<&Running> = pods.iter().filter(|(p, _, _)| p.node == 0).collect();
    let service_columns: Vec<(String, Ipv4Addr, u16, &str)> = SERVICES
        .iter()
        .map(|(name, ip, port, pod)| (format!("svc/{name} {ip}:{port}"), *ip, *port, *pod))
        .collect();
    let mut wrong = matrix(
        "Before any policy: every pod reaches every other, across nodes too.",
        &all,
        &pod_columns,
        |_, _| true,
    );
    wrong += matrix(
        "Through Services (ClusterIP translated at connect() by the node's agent):",
        &on_node_1,
        &service_columns,
        |_, _| true,
    );

    if config.no_policies {
        // The demo's policies, as a proposal for `policy diff`.
        std::fs::write(dir.join("proposed.yaml"), POLICIES).map_err(|e| e.to_string())?;
    } else {
        // Drops are explained by the datapath's verdict events, of both nodes.
        let events = Arc::new(Mutex::new(Vec::<(
            &'static str,
            crate::datapath::events::VerdictEvent,
        )>::new()));
        for n in &scratch.nodes {
            let (events, socket, node) = (events.clone(), n.socket(), n.name);
            std::thread::spawn(move || {
                let _ = crate::client::stream_lines(&socket, "/v1/monitor", |line| {
                    if let Ok(ev) = serde_json::from_str(line) {
                        if let Ok(mut v) = events.lock() {
                            v.push((node, ev));
                        }
                    }
                    true
                });
            });
        }
        std::fs::write(manifests.join("policies.yaml"), POLICIES).map_err(|e| e.to_string())?;
        println!(
            "\nApplying policies ({}):",
            manifests.join("policies.yaml").display()
        );
        println!(
            "  NetworkPolicy shop/default-deny        the shop namespace denies ingress by default"
        );
        println!(
            "  NetworkPolicy shop/frontend-public     frontend:80 from any pod of the cluster"
        );
        println!(
            "  CiliumNetworkPolicy shop/tiers         frontend -> backend:8080, backend -> db:5432, backend egress only to db:5432"
        );
        println!(
            "  CiliumClusterwideNetworkPolicy no-tools-to-db   ingressDeny: tools/* never reaches a db"
        );
        let applied = Instant::now();
        for n in &scratch.nodes {
            let socket = n.socket();
            wait_for(
                &format!("the policies are realized on {}", n.name),
                Duration::from_secs(30),
                || matches!(policy_revision(&socket), Some((rev, true)) if rev >= 4),
            )?;
        }
        println!(
            "  realized on every endpoint's BPF policy map of both nodes in {:.0} ms (file write to datapath)",
            applied.elapsed().as_secs_f64() * 1000.0
        );
        wrong += matrix("After:", &all, &pod_columns, expected_after);
        wrong += matrix(
            "Through Services, after: egress policy judges the backend pod, not the ClusterIP:",
            &on_node_1,
            &service_columns,
            expected_after,
        );

        std::thread::sleep(Duration::from_millis(300));
        let seen = events.lock().map(|v| v.clone()).unwrap_or_default();
        let mut shown = std::collections::BTreeSet::new();
        println!("\nWhy? The datapath's drop events (`ciliate monitor`):");
        for (node, ev) in seen {
            if ev.verdict == "dropped" && shown.insert((ev.source.clone(), ev.destination.clone()))
            {
                let who = |ip: &str| {
                    pods.iter()
                        .find(|(_, _, a)| a.to_string() == ip)
                        .map(|(p, _, _)| format!("{}/{}", p.namespace, p.name))
                        .unwrap_or_else(|| ip.to_string())
                };
                // The deciding policies, named as `ciliate monitor` and `policy simulate` name them.
                let why = ev.why().unwrap_or_else(|| ev.reason.clone());
                println!(
                    "  {:<14} -> {:<22} dropped at {node} endpoint {} {}: {why}",
                    who(&ev.source),
                    format!("{}:{}/{}", who(&ev.destination), ev.protocol, ev.port),
                    ev.endpoint,
                    ev.direction,
                );
            }
        }
    }

    let sockets: Vec<String> = scratch
        .nodes
        .iter()
        .map(|n| n.socket().display().to_string())
        .collect();
    println!("\nThe agents keep running. Try, in another terminal:");
    println!("  ciliate endpoint list --socket {}", sockets[0]);
    println!("  ciliate node list --socket {}", sockets[0]);
    println!("  ciliate service list --socket {}", sockets[0]);
    println!(
        "  ciliate monitor --socket {}      (node 2: {})",
        sockets[0], sockets[1]
    );
    println!(
        "  open http://{}/debug/   (node 1: actors, endpoints, policies, nodes, services)",
        config.debug_addr
    );
    println!(
        "  edit {} and watch it apply live on both nodes",
        manifests.join("policies.yaml").display()
    );
    let observers: Vec<String> = scratch
        .nodes
        .iter()
        .map(|n| {
            format!(
                "--server unix://{}",
                n.dir.join("state/hubble.sock").display()
            )
        })
        .collect();
    println!(
        "  ciliate policy recommend --namespace shop {} --socket {}",
        observers.join(" "),
        sockets[0]
    );
    if config.no_policies {
        println!(
            "  ciliate policy diff --policies {} {} --socket {}",
            dir.join("proposed.yaml").display(),
            observers.join(" "),
            sockets[0]
        );
    }
    if config.once {
        println!("\n--once: cleaning up.");
    } else {
        println!("\nCtrl-C to stop and clean up everything.");
        let _ = signals.wait();
        println!("\ncleaning up.");
    }
    let clean = scratch.remove_pods_and_stop_agents();
    drop(scratch);
    if !clean {
        return Err("an agent did not stop on SIGTERM within 10 s and was killed".into());
    }
    Ok(wrong)
}

/// Replaces `path` in one step, so an agent never reads half a file.
fn write_atomically(path: &Path, text: &str) -> Result<(), String> {
    let tmp = path.with_extension("yaml.tmp");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn demo_signals() -> nix::sys::signal::SigSet {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set
}
