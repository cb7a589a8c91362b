//! A cluster on one machine: three nodes, each a network namespace with an `eth0` on a bridge
//! that lives in a namespace of its own (as kind's Docker network), the in-repo API server in
//! another namespace on that bridge, and one agent process per node inside its namespace
//! (entered with setns before exec, so bpffs and /proc stay as they are) with its own state
//! directory, bpffs mount, API socket and debug port. Pods are created through the CNI plugin
//! on each node. Names carry a per-run tag; everything is removed on drop, even on failure.
//!
//! Addresses are fixed (172.20.0.0/24 for nodes, 10.200.N.0/24 for node N's pods): every
//! address lives only in this cluster's namespaces, so clusters of parallel tests never meet.

use std::ffi::OsStr;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use ciliate_test_apiserver::{ServerOptions, TestApiServer};
use serde_json::{json, Value};

use super::agent::{Agent, BIN};
use super::cni::{CniPod, CniPods};
use super::netns::{in_netns, ip};

static N: AtomicU32 = AtomicU32::new(0);

/// The API server's address on the cluster bridge.
pub const API_IP: Ipv4Addr = Ipv4Addr::new(172, 20, 0, 2);
const API_PORT: u16 = 6443;

/// The router between the cluster bridge and the outside, and the outside host.
pub const ROUTER_IP: Ipv4Addr = Ipv4Addr::new(172, 20, 0, 254);
pub const OUTSIDE_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
/// The router's and the outside host's IPv6 addresses (`add_outside6`).
pub const ROUTER_IP6: std::net::Ipv6Addr =
    std::net::Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, 0xfe);
pub const OUTSIDE_IP6: std::net::Ipv6Addr =
    std::net::Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 2);

/// Node `i` (1-based): its address and pod CIDR.
pub fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(172, 20, 0, 10 + i as u8)
}
pub fn pod_cidr(i: usize) -> String {
    pod_cidr_sized(i, 24)
}
/// Node `i`'s pod CIDR with another prefix length (a small one forces address reuse).
pub fn pod_cidr_sized(i: usize, prefix: u8) -> String {
    format!("10.200.{i}.0/{prefix}")
}
/// A dual-stack cluster's node `i`: its IPv6 address and IPv6 pod CIDR.
pub fn node_ip6(i: usize) -> std::net::Ipv6Addr {
    format!("fd00:20::{:x}", 10 + i).parse().unwrap()
}
pub fn pod_cidr6(i: usize) -> String {
    format!("fd00:200:{i:x}::/112")
}

/// One node: its namespace, agent and pods.
pub struct ClusterNode {
    pub name: String,
    pub netns: String,
    pub ip: Ipv4Addr,
    pub pod_cidr: String,
    pub dir: PathBuf,
    pub bpffs: PathBuf,
    pub agent: Option<Agent>,
    pub pods: Option<CniPods>,
    /// Extra agent flags (e.g. `--routing-mode tunnel`).
    pub agent_args: Vec<String>,
    /// This node's cgroup (`--cgroup-root`), when the cluster translates Services: processes
    /// that stand for this node's pods run in it.
    pub cgroup: Option<PathBuf>,
}

impl ClusterNode {
    pub fn socket(&self) -> PathBuf {
        self.dir.join("ciliate.sock")
    }

    pub fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("the node's agent runs")
    }

    /// Creates `x/name` with `labels` as a kubelet would: the Pod object, then CNI ADD on this
    /// node, then the Pod's status with the address.
    pub fn add_pod(&mut self, api: &TestApiServer, name: &str, app: &str) -> CniPod {
        self.add_pod_labelled(api, name, json!({ "app": app }))
    }

    /// Like `add_pod`, with any labels.
    pub fn add_pod_labelled(&mut self, api: &TestApiServer, name: &str, labels: Value) -> CniPod {
        let mut object = pod_object(name, "", &self.name, None);
        object["metadata"]["labels"] = labels;
        self.add_pod_from(api, name, object)
    }

    /// Like `add_pod`, from a Pod object of namespace `x` (labels, container ports) bound here.
    pub fn add_pod_from(&mut self, api: &TestApiServer, name: &str, mut object: Value) -> CniPod {
        object["spec"]["nodeName"] = json!(self.name);
        api.apply_json(object.clone()).expect("pod object");
        let pod = self.pods.as_mut().expect("pods").add("x", name);
        let v4 = (!pod.addr.is_unspecified()).then(|| pod.addr.to_string());
        let ips: Vec<Value> = v4
            .into_iter()
            .chain(pod.addr6.map(|a| a.to_string()))
            .map(|ip| json!({ "ip": ip }))
            .collect();
        let ip = ips[0]["ip"].clone();
        object["status"] = json!({"phase": "Running", "podIP": ip, "podIPs": ips});
        api.apply_json(object).expect("pod status");
        pod
    }

    /// `ciliate node list -o json` on this node.
    pub fn node_list(&self) -> Value {
        self.agent().cli_json(&["node", "list"])
    }

    /// The routes with ciliate's protocol in this node's namespace: (destination, gateway).
    pub fn kernel_routes(&self) -> Vec<(String, String)> {
        in_netns(&self.netns, || {
            ciliate::network::netlink::list_own_protocol_all().expect("list routes")
        })
        .join()
        .expect("netlink thread")
        .into_iter()
        .map(|(d, g)| (d.to_string(), g.map(|g| g.to_string()).unwrap_or_default()))
        .collect()
    }

    /// Starts (or restarts) this node's agent in its namespace and waits until it is ready.
    pub fn start_agent(&mut self, kubeconfig: &Path) {
        let ns = std::fs::File::open(format!("/run/netns/{}", self.netns)).expect("node netns");
        let ns: OwnedFd = ns.into();
        let mut cmd = Command::new(BIN);
        cmd.args(["agent", "--node-name", &self.name, "--mode", "kubernetes"])
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["--datapath", "bpf", "--bpf-root"])
            .arg(&self.bpffs)
            .arg("--state-dir")
            .arg(self.dir.join("state"))
            .arg("--api-socket")
            .arg(self.socket())
            // The node's own loopback: every node may use the same port.
            .args(["--debug-addr", "127.0.0.1:9962"])
            .args(&self.agent_args)
            .args(
                self.cgroup
                    .iter()
                    .flat_map(|c| [OsStr::new("--cgroup-root"), c.as_os_str()]),
            )
            .env("RUST_LOG", "info");
        let fd = ns.as_raw_fd();
        // SAFETY: setns is async-signal-safe; the descriptor outlives the spawn.
        unsafe {
            cmd.pre_exec(move || {
                if nix::libc::setns(fd, nix::libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let agent =
            Agent::spawn_command(&self.dir, self.socket(), "127.0.0.1:9962".into(), &mut cmd);
        drop(ns);
        agent.wait_until("the node's agent is ready with its pod CIDR", || {
            let (code, out, _) = agent.cli(&["status", "-o", "json"]);
            let v: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
            let ipv6 = self.agent_args.iter().any(|a| a == "--enable-ipv6=true");
            let ipv4 = !self.agent_args.iter().any(|a| a == "--enable-ipv4=false");
            code == 0
                && v["ready"] == true
                && (!ipv4 || !v["ipam"].is_null())
                && (!ipv6 || !v["ipam_ipv6"].is_null())
        });
        self.agent = Some(agent);
    }

    /// `kill -9` of the agent (its datapath stays in place).
    pub fn kill9_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            if let Some(c) = a.child.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            a.child = None;
        }
    }
}

/// The cluster; dropping it removes everything it created.
pub struct Cluster {
    pub tag: String,
    pub bridge_ns: String,
    pub api_ns: String,
    pub nodes: Vec<ClusterNode>,
    pub api: Option<TestApiServer>,
    pub kubeconfig: PathBuf,
    pub dir: tempfile::TempDir,
    made_netns: Vec<String>,
    /// The cluster's cgroup (the nodes' are inside), when it translates Services.
    cgroup: Option<PathBuf>,
}

/// Where cgroup v2 is mounted (`/sys/fs/cgroup/unified` on hybrid hosts, such as this one).
pub fn cgroup2_mount() -> PathBuf {
    ciliate::datapath::cgroup::cgroup2_mount().expect("a cgroup v2 mount")
}

pub fn pod_object(name: &str, app: &str, node: &str, ip: Option<Ipv4Addr>) -> Value {
    let mut v = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "x", "labels": {"app": app}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Pending"}
    });
    if let Some(ip) = ip {
        v["status"] = json!({"phase": "Running", "podIP": ip.to_string(), "podIPs": [{"ip": ip.to_string()}]});
    }
    v
}

pub fn node_object(i: usize) -> Value {
    node_object_sized(i, 24)
}

pub fn node_object_sized(i: usize, prefix: u8) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": format!("node-{i}")},
        "spec": {"podCIDRs": [pod_cidr_sized(i, prefix)]},
        "status": {"addresses": [
            {"type": "InternalIP", "address": node_ip(i).to_string()},
            {"type": "Hostname", "address": format!("node-{i}")}
        ]}
    })
}

impl Cluster {
    /// `nodes` nodes (1-based names `node-1`...), the API server with namespace `x`, the CRDs
    /// and the Node objects, and an agent running on every node.
    pub fn start(nodes: usize) -> Cluster {
        Cluster::start_with(nodes, &[])
    }

    /// Like `start`, every agent with the extra flags `agent_args`.
    pub fn start_with(nodes: usize, agent_args: &[&str]) -> Cluster {
        Cluster::start_inner(nodes, agent_args, false, 24)
    }

    /// Like `start`, dual stack: every node also has an IPv6 address (`node_ip6`) and IPv6 pod
    /// CIDR (`pod_cidr6`) in its Node object, and its agent runs with `--enable-ipv6=true`
    /// (and `agent_args`), so pods get an address of each family.
    pub fn start_dual_stack(nodes: usize, agent_args: &[&str]) -> Cluster {
        let mut args = vec!["--enable-ipv6=true"];
        args.extend(agent_args);
        Cluster::start_inner(nodes, &args, false, 24)
    }

    /// Like `start`, IPv6 only: every node's pods get an IPv6 address only (`--enable-ipv4=false
    /// --enable-ipv6=true`, and `agent_args`); its Node object names its IPv6 pod CIDR only
    /// and its IPv6 address. In tunnel mode over an IPv4 underlay (Cilium's default,
    /// `--underlay-protocol ipv4`) the Node also names its IPv4 address; with
    /// `--underlay-protocol ipv6` it does not.
    pub fn start_ipv6_only(nodes: usize, agent_args: &[&str]) -> Cluster {
        let mut args = vec!["--enable-ipv4=false", "--enable-ipv6=true"];
        args.extend(agent_args);
        Cluster::start_inner(nodes, &args, false, 24)
    }

    /// Like `start`, with pod CIDRs of `prefix` bits (a /29 holds 6 pods: addresses come back).
    pub fn start_with_pod_prefix(nodes: usize, prefix: u8) -> Cluster {
        Cluster::start_inner(nodes, &[], false, prefix)
    }

    /// Like `start`, and every node's agent translates Services for the processes in its own
    /// cgroup (`ClusterNode::cgroup`, under a cgroup of this cluster's).
    pub fn start_with_services(nodes: usize) -> Cluster {
        Cluster::start_inner(nodes, &[], true, 24)
    }

    /// `start_with_services`, every agent with the extra flags `agent_args` (e.g.
    /// `--enable-ipv6=true`, and `--enable-ipv4=false` for IPv6-only nodes: see
    /// `start_ipv6_only`).
    pub fn start_with_services_and(nodes: usize, agent_args: &[&str]) -> Cluster {
        Cluster::start_inner(nodes, agent_args, true, 24)
    }

    /// `start_with_services` with pod CIDRs of `prefix` bits (the soak bench: Services, and a
    /// full node whose freed address is the only one left).
    pub fn start_with_services_and_pod_prefix(nodes: usize, prefix: u8) -> Cluster {
        Cluster::start_inner(nodes, &[], true, prefix)
    }

    fn start_inner(nodes: usize, agent_args: &[&str], services: bool, prefix: u8) -> Cluster {
        let n = N.fetch_add(1, Ordering::SeqCst);
        let tag = format!("{}{}", std::process::id() % 100_000, n);
        let dir = tempfile::tempdir().expect("tempdir");
        let mut c = Cluster {
            bridge_ns: format!("cb-{tag}"),
            api_ns: format!("ca-{tag}"),
            tag: tag.clone(),
            nodes: vec![],
            api: None,
            kubeconfig: dir.path().join("kubeconfig"),
            dir,
            made_netns: vec![],
            cgroup: None,
        };
        if services {
            let root = cgroup2_mount().join(format!("ciliate-cluster-{tag}"));
            std::fs::create_dir_all(&root).expect("the cluster's cgroup");
            c.cgroup = Some(root);
        }
        let br = c.bridge_ns.clone();
        c.netns_add(&br);
        ip(&["-n", &br, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &br, "link", "set", "br0", "up"]);
        let api_ns = c.api_ns.clone();
        c.attach(&api_ns, "vapi", API_IP);
        for i in 1..=nodes {
            let netns = format!("cn-{tag}-{i}");
            c.attach(&netns, &format!("vn{i}"), node_ip(i));
            let node_dir = c.dir.path().join(format!("node-{i}"));
            let bpffs = node_dir.join("bpf");
            std::fs::create_dir_all(&bpffs).expect("node dir");
            nix::mount::mount(
                Some("bpf"),
                &bpffs,
                Some("bpf"),
                nix::mount::MsFlags::empty(),
                None::<&str>,
            )
            .expect("mount a bpf filesystem");
            let pods = CniPods::new(&node_dir.join("ciliate.sock"), &node_dir.join("no-pins"));
            c.nodes.push(ClusterNode {
                name: format!("node-{i}"),
                netns,
                ip: node_ip(i),
                pod_cidr: pod_cidr_sized(i, prefix),
                dir: node_dir,
                bpffs,
                agent: None,
                pods: Some(pods),
                agent_args: agent_args.iter().map(|a| a.to_string()).collect(),
                cgroup: c.cgroup.as_ref().map(|root| {
                    let dir = root.join(format!("node-{i}"));
                    std::fs::create_dir_all(&dir).expect("a node's cgroup");
                    dir
                }),
            });
        }
        c.start_api_server();
        let api = c.api.as_ref().expect("API server");
        for crd in [
            "ciliumnetworkpolicies",
            "ciliumclusterwidenetworkpolicies",
            "ciliateendpointslices",
            "policy.networking.k8s.io_adminnetworkpolicies",
            "policy.networking.k8s.io_baselineadminnetworkpolicies",
            "policy.networking.k8s.io_clusternetworkpolicies",
        ] {
            let path = format!("{}/manifests/crds/{crd}.yaml", env!("CARGO_MANIFEST_DIR"));
            let text = std::fs::read_to_string(&path).expect("CRD manifest");
            let v: Value = serde_yaml::from_str(&text).expect("CRD YAML");
            api.apply_json(v).expect("CRD");
        }
        api.apply_json(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}}))
            .expect("namespace");
        let ipv6 = agent_args.contains(&"--enable-ipv6=true");
        let ipv4 = !agent_args.contains(&"--enable-ipv4=false");
        // An IPv4 underlay needs the nodes' IPv4 addresses in their Node objects.
        let v4_underlay = agent_args.contains(&"tunnel") && !agent_args.contains(&"ipv6");
        for i in 1..=nodes {
            let mut node = node_object_sized(i, prefix);
            if ipv6 {
                let netns = c.nodes[i - 1].netns.clone();
                let addr = format!("{}/64", node_ip6(i));
                ip(&["-n", &netns, "addr", "add", &addr, "dev", "eth0", "nodad"]);
                let v4_cidr = ipv4.then(|| pod_cidr_sized(i, prefix));
                node["spec"]["podCIDRs"] = json!(v4_cidr
                    .into_iter()
                    .chain([pod_cidr6(i)])
                    .collect::<Vec<_>>());
                let v4_addr = (ipv4 || v4_underlay)
                    .then(|| json!({"type": "InternalIP", "address": node_ip(i).to_string()}));
                node["status"]["addresses"] = json!(v4_addr
                    .into_iter()
                    .chain([
                        json!({"type": "InternalIP", "address": node_ip6(i).to_string()}),
                        json!({"type": "Hostname", "address": format!("node-{i}")})
                    ])
                    .collect::<Vec<_>>());
            }
            api.apply_json(node).expect("node");
        }
        let kubeconfig = c.kubeconfig.clone();
        for node in &mut c.nodes {
            node.start_agent(&kubeconfig);
        }
        c
    }

    pub fn api(&self) -> &TestApiServer {
        self.api.as_ref().expect("API server")
    }

    /// Node `i` (1-based).
    pub fn node(&mut self, i: usize) -> &mut ClusterNode {
        &mut self.nodes[i - 1]
    }

    /// Creates pod `x/name` labelled `app` on node `i`.
    pub fn add_pod(&mut self, i: usize, name: &str, app: &str) -> CniPod {
        let api = self.api.take().expect("API server");
        let pod = self.nodes[i - 1].add_pod(&api, name, app);
        self.api = Some(api);
        pod
    }

    /// Pods `x/a` and `x/c` (labelled `app: a`, `app: c`) on node 1 and `x/b` on node 2
    /// serving TCP on `ports`, once a and c reach b on the first of them: (a, c, b).
    pub fn a_and_c_to_b(&mut self, ports: &[u16]) -> (CniPod, CniPod, CniPod) {
        let a = self.add_pod(1, "a", "a");
        let c = self.add_pod(1, "c", "c");
        let b = self.add_pod(2, "b", "b");
        let b_addr = std::net::IpAddr::V4(b.addr);
        for port in ports {
            super::netns::tcp_server(&b.netns, b_addr, *port);
        }
        super::eventually("a and c reach b", || {
            super::netns::tcp_ok(&a.netns, b_addr, ports[0])
                && super::netns::tcp_ok(&c.netns, b_addr, ports[0])
        });
        (a, c, b)
    }

    /// Creates pod `x/name` on node `i` from a Pod object (labels, container ports).
    pub fn add_pod_from(&mut self, i: usize, name: &str, object: Value) -> CniPod {
        let api = self.api.take().expect("API server");
        let pod = self.nodes[i - 1].add_pod_from(&api, name, object);
        self.api = Some(api);
        pod
    }

    /// A router on the bridge (`ROUTER_IP`) with the "outside" behind it (a host at
    /// `OUTSIDE_IP`, standing in for the internet), and every node's default route through the
    /// router. The outside knows no pod addresses: it can only answer masqueraded traffic.
    pub fn add_outside(&mut self) -> (String, Ipv4Addr) {
        let (router, outside) = (format!("cr-{}", self.tag), format!("co-{}", self.tag));
        self.attach(&router, "vrt", ROUTER_IP);
        self.netns_add(&outside);
        ip(&[
            "-n", &router, "link", "add", "eth1", "type", "veth", "peer", "name", "eth0", "netns",
            &outside,
        ]);
        ip(&[
            "-n",
            &router,
            "addr",
            "add",
            "198.51.100.1/24",
            "dev",
            "eth1",
        ]);
        ip(&["-n", &router, "link", "set", "eth1", "up"]);
        ip(&[
            "-n",
            &outside,
            "addr",
            "add",
            &format!("{OUTSIDE_IP}/24"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &outside, "link", "set", "eth0", "up"]);
        ip(&[
            "-n",
            &outside,
            "route",
            "add",
            "default",
            "via",
            "198.51.100.1",
        ]);
        in_netns(&router, || {
            std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").expect("ip_forward")
        })
        .join()
        .expect("router forwarding");
        for node in &self.nodes {
            ip(&[
                "-n",
                &node.netns,
                "route",
                "add",
                "default",
                "via",
                &ROUTER_IP.to_string(),
            ]);
        }
        (outside, OUTSIDE_IP)
    }

    /// A host on the cluster's bridge that is no node (`cu-<tag>`, address `addr`): on the
    /// nodes' link, in no Node object.
    pub fn add_underlay_host(&mut self, addr: Ipv4Addr) -> String {
        let netns = format!("cu-{}", self.tag);
        self.attach(&netns, "vun", addr);
        netns
    }

    /// After `add_outside`, in a dual-stack cluster: IPv6 for the router (`ROUTER_IP6` on the
    /// nodes' link, 2001:db8:100::1 toward the outside), the outside host (`OUTSIDE_IP6`,
    /// returned) and every node's IPv6 default route through the router.
    pub fn add_outside6(&mut self, outside: &str) -> std::net::Ipv6Addr {
        let router = format!("cr-{}", self.tag);
        for (ns, addr, dev) in [
            (router.as_str(), format!("{ROUTER_IP6}/64"), "eth0"),
            (router.as_str(), "2001:db8:100::1/64".to_string(), "eth1"),
            (outside, format!("{OUTSIDE_IP6}/64"), "eth0"),
        ] {
            ip(&["-n", ns, "-6", "addr", "add", &addr, "dev", dev, "nodad"]);
        }
        ip(&[
            "-n",
            outside,
            "-6",
            "route",
            "add",
            "default",
            "via",
            "2001:db8:100::1",
        ]);
        in_netns(&router, || {
            std::fs::write("/proc/sys/net/ipv6/conf/all/forwarding", "1").expect("forwarding")
        })
        .join()
        .expect("router forwarding");
        for node in &self.nodes {
            let via = ROUTER_IP6.to_string();
            ip(&[
                "-n",
                &node.netns,
                "-6",
                "route",
                "add",
                "default",
                "via",
                &via,
            ]);
        }
        OUTSIDE_IP6
    }

    /// A second native device on node `i`: `eth1` with `10.99.0.1/24`, whose peer (`eth0`,
    /// `10.99.0.2/24`) is in a namespace of its own (returned), as a management network the
    /// Node object does not know of.
    pub fn add_second_device(&mut self, i: usize) -> (String, Ipv4Addr, Ipv4Addr) {
        let (node, peer) = (self.nodes[i - 1].netns.clone(), format!("cm-{}", self.tag));
        let (at_node, at_peer) = (Ipv4Addr::new(10, 99, 0, 1), Ipv4Addr::new(10, 99, 0, 2));
        self.netns_add(&peer);
        ip(&[
            "-n", &node, "link", "add", "eth1", "type", "veth", "peer", "name", "eth0", "netns",
            &peer,
        ]);
        for (ns, addr) in [(&node, at_node), (&peer, at_peer)] {
            let dev = if ns == &node { "eth1" } else { "eth0" };
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
        }
        (peer, at_node, at_peer)
    }

    fn netns_add(&mut self, name: &str) {
        ip(&["netns", "add", name]);
        self.made_netns.push(name.to_string());
        ip(&["-n", name, "link", "set", "lo", "up"]);
    }

    /// A namespace with an `eth0` (address `addr/24`) whose peer `port` is on the bridge.
    fn attach(&mut self, netns: &str, port: &str, addr: Ipv4Addr) {
        self.netns_add(netns);
        let br = self.bridge_ns.clone();
        ip(&[
            "-n", netns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", &br,
        ]);
        ip(&["-n", &br, "link", "set", port, "master", "br0", "up"]);
        ip(&[
            "-n",
            netns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", netns, "link", "set", "eth0", "up"]);
    }

    /// The API server, bound in its namespace by a thread that entered it (the server's
    /// threads are spawned from there and inherit it).
    fn start_api_server(&mut self) {
        let addr = SocketAddr::from((API_IP, API_PORT));
        let server = in_netns(&self.api_ns, move || {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                // The address may still be tentative for a moment after it was added.
                match TestApiServer::start_with(addr, ServerOptions::default()) {
                    Ok(s) => return s,
                    Err(e) if Instant::now() > deadline => panic!("API server: {e}"),
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        })
        .join()
        .expect("API server thread");
        server.kubeconfig(&self.kubeconfig).expect("kubeconfig");
        self.api = Some(server);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Pods first (CNI DEL needs the agents), then the agents, their bpffs, the namespaces.
        for node in &mut self.nodes {
            drop(node.pods.take());
        }
        for node in &mut self.nodes {
            drop(node.agent.take());
            let _ = nix::mount::umount2(&node.bpffs, nix::mount::MntFlags::MNT_DETACH);
        }
        drop(self.api.take());
        for ns in self.made_netns.iter().rev() {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        // The cgroups empty once the clients have exited (they are waited for).
        let dirs = self.nodes.iter().filter_map(|n| n.cgroup.clone());
        for dir in dirs.chain(self.cgroup.clone()) {
            for _ in 0..50 {
                if std::fs::remove_dir(&dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}
