//! `ciliate demo`: the out-of-the-box demonstration on one Linux host (root).
//!
//! It starts a real agent (BPF datapath, standalone mode) on a scratch directory, creates four
//! pods as network namespaces through the real CNI path (`ciliate-cni ADD`, which is this
//! binary under another name), measures the connectivity matrix with real TCP connections,
//! applies one policy of each kind (NetworkPolicy, CiliumNetworkPolicy,
//! CiliumClusterwideNetworkPolicy), measures again, shows why the drops happened from the
//! datapath's verdict events, and leaves the agent and its `/debug/` page running until Ctrl-C.
//! Everything it created (pods, devices, pins, files) is removed on the way out, also after
//! an error.

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
    pub debug_addr: SocketAddr,
    pub pod_cidr: ipnet::Ipv4Net,
}

/// One demo pod.
struct DemoPod {
    namespace: &'static str,
    name: &'static str,
    app: &'static str,
    /// The port its server listens on.
    port: u16,
}

const PODS: [DemoPod; 4] = [
    DemoPod {
        namespace: "shop",
        name: "frontend",
        app: "frontend",
        port: 80,
    },
    DemoPod {
        namespace: "shop",
        name: "backend",
        app: "backend",
        port: 8080,
    },
    DemoPod {
        namespace: "shop",
        name: "db",
        app: "db",
        port: 5432,
    },
    DemoPod {
        namespace: "tools",
        name: "debug",
        app: "debug",
        port: 22,
    },
];

const CLUSTER: &str =
    "# The demo's cluster: two namespaces and four pods (their addresses come from CNI).
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: shop}}
---
apiVersion: v1
kind: Namespace
metadata: {name: tools}
---
apiVersion: v1
kind: Pod
metadata: {name: frontend, namespace: shop, labels: {app: frontend}}
---
apiVersion: v1
kind: Pod
metadata: {name: backend, namespace: shop, labels: {app: backend}}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: shop, labels: {app: db}}
---
apiVersion: v1
kind: Pod
metadata: {name: debug, namespace: tools, labels: {app: debug}}
";

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
# CiliumNetworkPolicy: frontend -> backend:8080 and backend -> db:5432.
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: tiers, namespace: shop}
specs:
  - endpointSelector: {matchLabels: {app: backend}}
    ingress:
      - fromEndpoints: [{matchLabels: {app: frontend}}]
        toPorts: [{ports: [{port: '8080', protocol: TCP}]}]
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
    matches!(
        (from, to),
        // tools/debug has no policy: it stays open.
        (_, "frontend") | (_, "debug") | ("frontend", "backend") | ("backend", "db")
    )
}

/// What the demo made, removed on drop.
struct Scratch {
    dir: PathBuf,
    pins: PathBuf,
    agent: Option<Child>,
    netns: Vec<String>,
    /// (container id, netns, namespace/name) of pods added through CNI.
    added: Vec<(String, String)>,
    exe: PathBuf,
}

impl Scratch {
    fn socket(&self) -> PathBuf {
        self.dir.join("ciliate.sock")
    }

    fn cni(
        &self,
        command: &str,
        container: &str,
        netns: &str,
        pod: Option<(&str, &str)>,
    ) -> Result<serde_json::Value, String> {
        let conf = serde_json::json!({
            "cniVersion": "1.0.0", "name": "ciliate", "type": "ciliate-cni",
            "agentSocket": self.socket(),
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

    fn agent_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }
}

impl Scratch {
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

impl Drop for Scratch {
    fn drop(&mut self) {
        for (container, netns) in std::mem::take(&mut self.added) {
            if let Err(e) = self.cni("DEL", &container, &netns, None) {
                eprintln!("cleanup: {e}");
                let _ = netdev::delete_host_interface(&netdev::host_interface_name(&container));
            }
        }
        for ns in &self.netns {
            if let Err(e) = netdev::delete_netns(ns) {
                eprintln!("cleanup: {e}");
            }
        }
        if !self.stop_agent() {
            eprintln!("cleanup: the agent did not stop on SIGTERM within 10 s and was killed");
        }
        let _ = std::fs::remove_dir_all(&self.pins);
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

/// Does a TCP connection from `netns` to `to:port` complete and get the server's answer?
fn connects(netns: &str, to: Ipv4Addr, port: u16) -> bool {
    let Ok(t) = in_netns(netns, move || {
        let Ok(mut s) = TcpStream::connect_timeout(
            &SocketAddr::new(IpAddr::V4(to), port),
            Duration::from_millis(400),
        ) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(400)));
        let mut buf = [0u8; 16];
        matches!(s.read(&mut buf), Ok(n) if n > 0)
    }) else {
        return false;
    };
    t.join().unwrap_or(false)
}

/// Measures and prints the matrix; returns the number of cells that differ from `expected`.
fn matrix(
    title: &str,
    pods: &[(&DemoPod, String, Ipv4Addr)],
    expected: impl Fn(&str, &str) -> bool,
) -> usize {
    println!("\n{title}");
    let mut header = format!("  {:<16}", "from \\ to");
    for (p, _, _) in pods {
        header.push_str(&format!("{:<18}", format!("{}:{}", p.name, p.port)));
    }
    println!("{header}");
    // Every probe in parallel: a denied one waits for its timeout.
    let mut probes = Vec::new();
    for (src, ns, _) in pods {
        for (dst, _, ip) in pods {
            if src.name == dst.name {
                continue;
            }
            let (ns, ip, port) = (ns.clone(), *ip, dst.port);
            probes.push((
                src.name,
                dst.name,
                std::thread::spawn(move || connects(&ns, ip, port)),
            ));
        }
    }
    let results: Vec<(&str, &str, bool)> = probes
        .into_iter()
        .map(|(a, b, t)| (a, b, t.join().unwrap_or(false)))
        .collect();
    let mut wrong = 0;
    for (src, _, _) in pods {
        let mut line = format!("  {:<16}", format!("{}/{}", src.namespace, src.name));
        for (dst, _, _) in pods {
            let cell = if src.name == dst.name {
                "-".to_string()
            } else {
                let ok = results
                    .iter()
                    .find(|(a, b, _)| *a == src.name && *b == dst.name)
                    .map(|r| r.2)
                    .unwrap_or(false);
                let mark = if ok { "allow" } else { "DENY" };
                if ok != expected(src.name, dst.name) {
                    wrong += 1;
                    format!("{mark} (unexpected!)")
                } else {
                    mark.to_string()
                }
            };
            line.push_str(&format!("{cell:<18}"));
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

fn policy_revision(socket: &Path) -> Option<(u64, bool)> {
    let v: serde_json::Value =
        serde_json::from_str(&crate::client::request(socket, "GET", "/v1/endpoints", None).ok()?)
            .ok()?;
    let rev: serde_json::Value =
        serde_json::from_str(&crate::client::request(socket, "GET", "/v1/policy", None).ok()?)
            .ok()?;
    let want = rev["revision"].as_u64()?;
    let all = v
        .as_array()?
        .iter()
        .all(|e| e["policy_revision"].as_u64().unwrap_or(0) >= want && e["state"] == "ready");
    Some((want, all))
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

fn run_inner(config: &DemoConfig) -> Result<usize, String> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    // Ctrl-C and SIGTERM are taken with sigwait, so they must be blocked before any thread
    // exists (threads inherit the mask; spawned programs get a clean one).
    let signals = demo_signals();
    let _ = signals.thread_block();
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let tag = std::process::id();
    let dir = std::env::temp_dir().join(format!("ciliate-demo-{tag}"));
    let mut scratch = Scratch {
        dir: dir.clone(),
        pins: PathBuf::from(format!("/sys/fs/bpf/ciliate-demo-{tag}")),
        agent: None,
        netns: vec![],
        added: vec![],
        exe: exe.clone(),
    };
    let manifests = dir.join("manifests");
    // The scratch directory holds the agent's socket: private whatever the caller's umask.
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .and_then(|()| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)))
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    std::fs::create_dir_all(&manifests).map_err(|e| format!("{}: {e}", manifests.display()))?;
    std::fs::write(manifests.join("cluster.yaml"), CLUSTER).map_err(|e| e.to_string())?;

    println!("ciliate demo: an agent with the eBPF datapath, four pods created through CNI, real TCP connections.");
    println!("  scratch directory {}", dir.display());
    let log = std::fs::File::create(dir.join("agent.log")).map_err(|e| e.to_string())?;
    let mut agent = Command::new(&exe);
    agent
        .args([
            "agent",
            "--mode",
            "standalone",
            "--datapath",
            "bpf",
            "--node-name",
            "demo-node",
        ])
        .arg("--manifests")
        .arg(&manifests)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--api-socket")
        .arg(scratch.socket())
        .arg("--bpf-root")
        .arg(&scratch.pins)
        .arg("--debug-addr")
        .arg(config.debug_addr.to_string())
        .arg("--pod-cidr")
        .arg(config.pod_cidr.to_string())
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdout(Stdio::null())
        .stderr(log)
        // Its own process group: Ctrl-C reaches the demo, which then cleans up through it.
        .process_group(0);
    // The demo blocks SIGINT/SIGTERM to take them with sigwait, and a child inherits the
    // mask: unblock them in the agent, or it could never shut down cleanly.
    unsafe {
        agent.pre_exec(|| {
            demo_signals()
                .thread_unblock()
                .map_err(std::io::Error::from)
        });
    }
    let agent = agent
        .spawn()
        .map_err(|e| format!("cannot start the agent: {e}"))?;
    scratch.agent = Some(agent);
    let socket = scratch.socket();
    wait_for("the agent is ready", Duration::from_secs(30), || {
        if let Some(a) = scratch.agent.as_mut() {
            if let Ok(Some(_)) = a.try_wait() {
                return true;
            }
        }
        crate::client::request(&socket, "GET", "/readyz", None).is_ok()
    })
    .and_then(|_| {
        crate::client::request(&socket, "GET", "/readyz", None)
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .map_err(|e| {
        format!(
            "the agent did not start ({e}); its log:\n{}",
            scratch.agent_log()
        )
    })?;
    println!(
        "  agent ready: pod CIDR {}, debug page http://{}/debug/",
        config.pod_cidr, config.debug_addr
    );

    // Pods through CNI.
    let mut pods: Vec<(&DemoPod, String, Ipv4Addr)> = Vec::new();
    for p in &PODS {
        let ns = format!("ciliate-demo-{}-{}", tag, p.name);
        netdev::create_netns(&ns).map_err(|e| e.to_string())?;
        scratch.netns.push(ns.clone());
        let container = format!("demo-{tag}-{}", p.name);
        let result = scratch.cni("ADD", &container, &ns, Some((p.namespace, p.name)))?;
        scratch.added.push((container, ns.clone()));
        let ip: Ipv4Addr = result["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("CNI result without an address: {result}"))?;
        println!(
            "  pod {}/{} ({}): {ip} on {} (CNI ADD)",
            p.namespace,
            p.name,
            p.app,
            result["interfaces"][0]["name"].as_str().unwrap_or("?")
        );
        serve(&ns, ip, p.port, p.name)?;
        pods.push((p, ns, ip));
    }

    let mut wrong = matrix(
        "Before any policy: every pod reaches every other.",
        &pods,
        |_, _| true,
    );

    // Drops are explained by the datapath's verdict events.
    let events = Arc::new(Mutex::new(
        Vec::<crate::datapath::events::VerdictEvent>::new(),
    ));
    {
        let (events, socket) = (events.clone(), socket.clone());
        std::thread::spawn(move || {
            let _ = crate::client::stream_lines(&socket, "/v1/monitor", |line| {
                if let Ok(ev) = serde_json::from_str(line) {
                    if let Ok(mut v) = events.lock() {
                        v.push(ev);
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
    println!("  NetworkPolicy shop/frontend-public     frontend:80 from any pod of the cluster");
    println!(
        "  CiliumNetworkPolicy shop/tiers         frontend -> backend:8080, backend -> db:5432"
    );
    println!(
        "  CiliumClusterwideNetworkPolicy no-tools-to-db   ingressDeny: tools/* never reaches a db"
    );
    let applied = Instant::now();
    wait_for(
        "the policies are realized",
        Duration::from_secs(30),
        || matches!(policy_revision(&socket), Some((rev, true)) if rev >= 4),
    )?;
    println!(
        "  realized on every endpoint's BPF policy map in {:.0} ms (file write to datapath)",
        applied.elapsed().as_secs_f64() * 1000.0
    );
    wrong += matrix("After:", &pods, expected_after);

    std::thread::sleep(Duration::from_millis(300));
    let seen = events.lock().map(|v| v.clone()).unwrap_or_default();
    let mut shown = std::collections::BTreeSet::new();
    println!("\nWhy? The datapath's drop events (`ciliate monitor`):");
    for ev in seen {
        if ev.verdict == "drop" && shown.insert((ev.source.clone(), ev.destination.clone())) {
            let who = |ip: &str| {
                pods.iter()
                    .find(|(_, _, a)| a.to_string() == ip)
                    .map(|(p, _, _)| format!("{}/{}", p.namespace, p.name))
                    .unwrap_or_else(|| ip.to_string())
            };
            println!(
                "  {:<14} -> {:<22} dropped at endpoint {} {}: {} (peer identity {})",
                who(&ev.source),
                format!("{}:{}/{}", who(&ev.destination), ev.protocol, ev.port),
                ev.endpoint,
                ev.direction,
                ev.reason,
                ev.peer_identity
            );
        }
    }

    let sock = socket.display();
    println!("\nThe agent keeps running. Try, in another terminal:");
    println!("  ciliate endpoint list --socket {sock}");
    println!("  ciliate bpf policy get 3 --socket {sock}");
    println!("  ciliate monitor --socket {sock}");
    println!(
        "  open http://{}/debug/   (actors, mailboxes, endpoints, policies)",
        config.debug_addr
    );
    println!(
        "  edit {} and watch it apply live",
        manifests.join("policies.yaml").display()
    );
    if config.once {
        println!("\n--once: cleaning up.");
    } else {
        println!("\nCtrl-C to stop and clean up everything.");
        let _ = signals.wait();
        println!("\ncleaning up.");
    }
    // Pods first (CNI DEL needs the agent), then the agent, which must stop by itself.
    let clean = {
        for (container, netns) in std::mem::take(&mut scratch.added) {
            if let Err(e) = scratch.cni("DEL", &container, &netns, None) {
                eprintln!("cleanup: {e}");
            }
        }
        scratch.stop_agent()
    };
    drop(scratch);
    if !clean {
        return Err("the agent did not stop on SIGTERM within 10 s and was killed".into());
    }
    Ok(wrong)
}

fn demo_signals() -> nix::sys::signal::SigSet {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set
}
