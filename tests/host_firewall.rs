//! The host firewall (`--enable-host-firewall`, issue #29) on the cluster harness: a
//! CiliumClusterwideNetworkPolicy with a `nodeSelector` judges real traffic to and from node 1
//! (from outside, from the other node, from pods of both nodes, and what node 1 itself sends),
//! in enforcing and in audit mode, across `kill -9` of the agent; masqueraded pod traffic keeps
//! working under it. Privileged: with CI=true, not running as root is a failure.

mod common;

use std::net::IpAddr;

use common::cluster::{node_ip, node_object, Cluster};
use common::eventually;
use common::netns::{
    icmp_ok, nft, privileged, seen_over_tcp, tcp_ok, tcp_server, who_am_i_servers,
};
use serde_json::{json, Value};

/// Node 1 takes SSH on 2222 from the outside's network only, 8000 from the other nodes and
/// from pods labelled app=a, nothing else from anywhere; it may send to the cluster's network
/// and to the cluster's endpoints only.
fn lock_down() -> Value {
    json!({
        "apiVersion": "cilium.io/v2", "kind": "CiliumClusterwideNetworkPolicy",
        "metadata": {"name": "lock-down"},
        "spec": {
            "nodeSelector": {"matchLabels": {"node-access": "ssh"}},
            "ingress": [
                {"fromCIDR": ["198.51.100.0/24"],
                 "toPorts": [{"ports": [{"port": "2222", "protocol": "TCP"}]}]},
                {"fromEntities": ["remote-node"],
                 "toPorts": [{"ports": [{"port": "8000", "protocol": "TCP"}]}]},
                {"fromEntities": ["remote-node"],
                 "icmps": [{"fields": [{"type": 8, "family": "IPv4"}]}]},
                {"fromEndpoints": [{"matchLabels": {"app": "a"}}],
                 "toPorts": [{"ports": [{"port": "8000", "protocol": "TCP"}]}]}
            ],
            "egress": [
                {"toCIDR": ["172.20.0.0/24"]},
                {"toEntities": ["cluster"]}
            ]
        }
    })
}

/// Two nodes with the host firewall on and masquerading to the outside (`extra`: more agent
/// flags); none when not privileged.
fn firewall_cluster(extra: &[&str]) -> Option<Cluster> {
    let mut args = vec![
        "--enable-host-firewall",
        "true",
        "--ipv4-native-routing-cidr",
        "10.200.0.0/16",
    ];
    args.extend_from_slice(extra);
    privileged().then(|| Cluster::start_with(2, &args))
}

fn status(c: &Cluster, i: usize) -> Value {
    c.nodes[i - 1].agent().cli_json(&["status"])
}

#[test]
fn host_policies_judge_traffic_to_and_from_the_node_in_enforcing_and_audit_mode() {
    let Some(mut c) = firewall_cluster(&[]) else {
        return;
    };
    let (outside, outside_ip) = c.add_outside();
    let a = c.add_pod(1, "a", "a");
    let b = c.add_pod(2, "b", "b");
    let n1 = c.nodes[0].netns.clone();
    let n2 = c.nodes[1].netns.clone();
    let host1 = IpAddr::V4(node_ip(1));
    for port in [2222, 8000, 10250] {
        tcp_server(&n1, host1, port);
    }
    tcp_server(&outside, IpAddr::V4(outside_ip), 8080);
    who_am_i_servers(&outside, outside_ip);

    // The host endpoint: listed with the Node's labels as Cilium keeps them.
    let mut node = node_object(1);
    node["metadata"]["labels"] = json!({"node-access": "ssh", "kubernetes.io/hostname": "node-1"});
    node["status"]["daemonEndpoints"] = json!({"kubeletEndpoint": {"Port": 10250}});
    c.api().apply_json(node).expect("node labels");
    let agent1 = c.nodes[0].agent();
    agent1.wait_until("the host endpoint has node 1's labels", || {
        let list = agent1.cli_json(&["endpoint", "list"]);
        list.as_array().into_iter().flatten().any(|e| {
            e["name"] == "host"
                && e["id"] == 65535
                && e["identity"] == 1
                && e["labels"] == json!(["reserved:host", "k8s:node-access=ssh"])
                && e["ips"] == json!([node_ip(1).to_string()])
        })
    });
    agent1.wait_until("the host firewall is attached to eth0", || {
        let s = agent1.cli_json(&["status"]);
        s["host_firewall"] == "enforcing" && s["host_firewall_device"] == "eth0"
    });
    assert_eq!(status(&c, 2)["host_firewall"], "enforcing");

    // No host policy yet: everything reaches node 1, and node 1 reaches everything.
    eventually("no host policy: everything reaches node 1", || {
        tcp_ok(&outside, host1, 2222)
            && tcp_ok(&n2, host1, 2222)
            && tcp_ok(&a.netns, host1, 10250)
            && tcp_ok(&b.netns, host1, 10250)
            && tcp_ok(&n1, IpAddr::V4(outside_ip), 8080)
            && icmp_ok(&outside, node_ip(1))
    });

    c.api().apply_json(lock_down()).expect("host policy");
    let enforced = || {
        tcp_ok(&outside, host1, 2222)
            && !tcp_ok(&n2, host1, 2222)
            && tcp_ok(&n2, host1, 8000)
            && !tcp_ok(&outside, host1, 8000)
            && tcp_ok(&a.netns, host1, 8000)
            && !tcp_ok(&a.netns, host1, 10250)
            && !tcp_ok(&b.netns, host1, 8000)
            && !tcp_ok(&b.netns, host1, 10250)
            && !tcp_ok(&n1, IpAddr::V4(outside_ip), 8080)
            && icmp_ok(&n2, node_ip(1))
            && !icmp_ok(&outside, node_ip(1))
    };
    eventually("node 1 is locked down as its host policy says", || {
        enforced()
    });
    // The policy lets the API server no longer reach the kubelet's port: named.
    let agent1 = c.nodes[0].agent();
    agent1.wait_until("the kubelet lifeline warning names lock-down", || {
        let w = agent1.cli_json(&["status"])["host_firewall_warnings"].to_string();
        w.contains("kubelet's port 10250") && w.contains("lock-down") && !w.contains(":6443")
    });
    // The node's own processes still reach its kubelet-like port (its loopback path), and the
    // cluster's network (the API server among it).
    assert!(tcp_ok(&n1, host1, 10250), "node 1 reaches its own port");
    // Masqueraded pod traffic still leaves and its replies come back through node 1.
    assert_eq!(
        seen_over_tcp(&a.netns, outside_ip),
        Some(node_ip(1).to_string()),
        "a pod reaches the outside, masqueraded, under the host policy"
    );

    // The drops are the host endpoint's, attributed to the host policy.
    // The drops are the host endpoint's, attributed to the host policy (`monitor --to host`).
    let flow = |args: &[&str]| -> Value { c.nodes[0].agent().last_flow(args) };
    let d = flow(&["--to", "host", "--port", "2222", "--verdict", "dropped"]);
    assert_eq!(d["endpoint"], 65535, "{d}");
    assert_eq!(d["direction"], "ingress", "{d}");
    assert_eq!(d["match"], "default-deny", "{d}");
    assert!(d["policies"].to_string().contains("lock-down"), "{d}");
    let d = flow(&["--from", "host", "--port", "8080", "--verdict", "dropped"]);
    assert_eq!(
        (&d["endpoint"], &d["direction"]),
        (&json!(65535), &json!("egress")),
        "{d}"
    );
    // A local pod's connection to the node: dropped by the host endpoint, not the pod's.
    let d = flow(&[
        "--from",
        "x/a",
        "--to",
        "host",
        "--port",
        "10250",
        "--verdict",
        "dropped",
    ]);
    assert_eq!(d["endpoint"], 65535, "{d}");

    // Audit mode: the would-be drops pass and are reported as audit; enforcing again drops.
    let (code, _, err) =
        c.nodes[0]
            .agent()
            .cli(&["endpoint", "config", "65535", "PolicyAuditMode=Enabled"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(status(&c, 1)["host_firewall"], "audit");
    eventually("audit mode lets node 2 in on 2222", || {
        tcp_ok(&n2, host1, 2222) && tcp_ok(&b.netns, host1, 10250)
    });
    let d = flow(&["--to", "host", "--port", "2222", "--verdict", "audit"]);
    assert_eq!(
        d["endpoint"], 65535,
        "the would-be drop is reported as audit: {d}"
    );
    // A host policy that would cut the agent from its API server is named before it bites
    // (tried in audit mode, where nothing is dropped).
    assert!(!status(&c, 1)["host_firewall_warnings"]
        .to_string()
        .contains(":6443"));
    let cut = json!({
        "apiVersion": "cilium.io/v2", "kind": "CiliumClusterwideNetworkPolicy",
        "metadata": {"name": "cut-api"},
        "spec": {"nodeSelector": {}, "egressDeny": [{"toCIDR": ["172.20.0.2/32"],
                 "toPorts": [{"ports": [{"port": "6443", "protocol": "TCP"}]}]}]}
    });
    c.api().apply_json(cut).expect("cut-api");
    let agent1 = c.nodes[0].agent();
    agent1.wait_until("the warning names cut-api and the API server", || {
        let w = agent1.cli_json(&["status"])["host_firewall_warnings"].to_string();
        w.contains("cut-api") && w.contains("172.20.0.2:6443")
    });
    c.api()
        .delete_object(
            "cilium.io/v2",
            "CiliumClusterwideNetworkPolicy",
            "",
            "cut-api",
        )
        .expect("delete cut-api");
    agent1.wait_until("the warning is gone with the policy", || {
        !agent1.cli_json(&["status"])["host_firewall_warnings"]
            .to_string()
            .contains("cut-api")
    });
    assert!(agent1
        .log()
        .contains("would cut the node from its API server"));
    let (code, _, err) =
        c.nodes[0]
            .agent()
            .cli(&["endpoint", "config", "65535", "PolicyAuditMode=Disabled"]);
    assert_eq!(code, 0, "{err}");
    eventually("enforcing again", enforced);

    // kill -9: the pinned programs and maps keep enforcing; a restarted agent takes over.
    let kubeconfig = c.kubeconfig.clone();
    c.node(1).kill9_agent();
    assert!(enforced(), "enforced while the agent is down");
    c.node(1).start_agent(&kubeconfig);
    assert!(enforced(), "enforced after the restart");
    let agent1 = c.nodes[0].agent();
    agent1.wait_until("the restarted agent has the host firewall on eth0", || {
        agent1.cli_json(&["status"])["host_firewall_device"] == "eth0"
    });
    assert!(enforced());

    // The policy goes: node 1 is open again.
    c.api()
        .delete_object(
            "cilium.io/v2",
            "CiliumClusterwideNetworkPolicy",
            "",
            "lock-down",
        )
        .expect("delete the host policy");
    eventually("no host policy: node 2 reaches 2222 again", || {
        tcp_ok(&n2, host1, 2222) && tcp_ok(&n1, IpAddr::V4(outside_ip), 8080)
    });
    c.api().apply_json(lock_down()).expect("host policy again");
    eventually("the host policy is back in force", enforced);

    // Restarted with the host firewall off: the host endpoint and the programs go, and the
    // host policy, still in the cluster, no longer applies to node 1.
    {
        let node = c.node(1);
        node.kill9_agent();
        let at = node
            .agent_args
            .iter()
            .position(|a| a == "--enable-host-firewall")
            .expect("the flag");
        node.agent_args[at + 1] = "false".into();
        node.start_agent(&kubeconfig);
    }
    let agent1 = c.nodes[0].agent();
    agent1.wait_until("the host firewall is off", || {
        let s = agent1.cli_json(&["status"]);
        s["host_firewall"] == "off" && s["host_firewall_device"] == "off"
    });
    let list = agent1.cli_json(&["endpoint", "list"]);
    assert!(
        list.as_array()
            .into_iter()
            .flatten()
            .all(|e| e["name"] != "host"),
        "{list}"
    );
    eventually(
        "node 2 reaches 2222 with the policy still in force elsewhere",
        || tcp_ok(&n2, host1, 2222) && tcp_ok(&n1, IpAddr::V4(outside_ip), 8080),
    );
}

/// The host firewall over IPv6 (#31), dual-stack nodes: the same kind of host policy in IPv6
/// terms judges IPv6 traffic to and from node 1's IPv6 address (from the outside's IPv6
/// network, from node 2's IPv6 address as `remote-node`, from pods' IPv6 addresses by their
/// labels, ICMPv6 by type), and what node 1 sends; IPv4 keeps its own verdicts; `kill -9`
/// keeps enforcing.
#[test]
fn host_policies_judge_ipv6_traffic_to_and_from_the_node() {
    use common::cluster::node_ip6;
    let Some(mut c) = privileged().then(|| {
        Cluster::start_dual_stack(
            2,
            &[
                "--enable-host-firewall",
                "true",
                "--ipv4-native-routing-cidr",
                "10.200.0.0/16",
                "--ipv6-native-routing-cidr",
                "fd00:200::/32",
            ],
        )
    }) else {
        return;
    };
    let (outside, _) = c.add_outside();
    let outside6 = c.add_outside6(&outside);
    let a = c.add_pod(1, "a", "a");
    let b = c.add_pod(2, "b", "b");
    let (n1, n2) = (c.nodes[0].netns.clone(), c.nodes[1].netns.clone());
    let host1 = IpAddr::V6(node_ip6(1));
    for port in [2222, 8000, 10250] {
        tcp_server(&n1, host1, port);
    }
    tcp_server(&n1, IpAddr::V4(node_ip(1)), 8000);
    tcp_server(&outside, IpAddr::V6(outside6), 8080);
    let mut node = node_object(1);
    node["metadata"]["labels"] = json!({"node-access": "ssh"});
    node["spec"]["podCIDRs"] = json!([common::cluster::pod_cidr(1), common::cluster::pod_cidr6(1)]);
    node["status"]["addresses"] = json!([
        {"type": "InternalIP", "address": node_ip(1).to_string()},
        {"type": "InternalIP", "address": node_ip6(1).to_string()},
    ]);
    c.api().apply_json(node).expect("node labels");
    let agent1 = c.nodes[0].agent();
    agent1.wait_until("the host endpoint holds both of node 1's addresses", || {
        let list = agent1.cli_json(&["endpoint", "list"]);
        list.as_array().into_iter().flatten().any(|e| {
            e["name"] == "host"
                && e["labels"] == json!(["reserved:host", "k8s:node-access=ssh"])
                && e["ips"]
                    .as_array()
                    .is_some_and(|ips| ips.iter().any(|i| i == host1.to_string().as_str()))
        })
    });
    eventually(
        "no host policy: everything reaches node 1 over IPv6",
        || {
            tcp_ok(&outside, host1, 2222)
                && tcp_ok(&n2, host1, 2222)
                && tcp_ok(&b.netns, host1, 10250)
                && tcp_ok(&n1, IpAddr::V6(outside6), 8080)
        },
    );
    c.api()
        .apply_json(json!({
            "apiVersion": "cilium.io/v2", "kind": "CiliumClusterwideNetworkPolicy",
            "metadata": {"name": "lock-down6"},
            "spec": {
                "nodeSelector": {"matchLabels": {"node-access": "ssh"}},
                "ingress": [
                    {"fromCIDR": ["2001:db8:100::/64"],
                     "toPorts": [{"ports": [{"port": "2222", "protocol": "TCP"}]}]},
                    {"fromEntities": ["remote-node"],
                     "toPorts": [{"ports": [{"port": "8000", "protocol": "TCP"}]}]},
                    {"fromEntities": ["remote-node"],
                     "icmps": [{"fields": [{"type": 128, "family": "IPv6"}]}]},
                    {"fromEndpoints": [{"matchLabels": {"app": "a"}}],
                     "toPorts": [{"ports": [{"port": "8000", "protocol": "TCP"}]}]}
                ],
                "egress": [{"toCIDR": ["fd00:20::/64", "172.20.0.0/24"]}, {"toEntities": ["cluster"]}]
            }
        }))
        .expect("host policy");
    let enforced = || {
        tcp_ok(&outside, host1, 2222)
            && !tcp_ok(&outside, host1, 8000)
            && !tcp_ok(&n2, host1, 2222)
            && tcp_ok(&n2, host1, 8000)
            && tcp_ok(&a.netns, host1, 8000)
            && !tcp_ok(&a.netns, host1, 10250)
            && !tcp_ok(&b.netns, host1, 8000)
            && !tcp_ok(&n1, IpAddr::V6(outside6), 8080)
            && icmp_ok(&n2, host1)
            && !icmp_ok(&outside, host1)
    };
    eventually(
        "node 1 is locked down over IPv6 as its host policy says",
        enforced,
    );
    // IPv4 to the same node under the same policy: node 2 on 8000 (remote-node), b not.
    assert!(tcp_ok(&n2, IpAddr::V4(node_ip(1)), 8000));
    assert!(!tcp_ok(&b.netns, IpAddr::V4(node_ip(1)), 8000));
    let kubeconfig = c.kubeconfig.clone();
    c.node(1).kill9_agent();
    assert!(enforced(), "enforced while the agent is down");
    c.node(1).start_agent(&kubeconfig);
    eventually("enforced after the restart", enforced);
}

/// A node with a second native device (a management network its Node object does not list):
/// the host firewall sits on that device too, and the device's address is the node's
/// (`host`), so the host policy judges what comes in through it, what the node sends through
/// it, and what local pods send to its address; across `kill -9`; and a device that goes
/// loses its programs.
#[test]
fn a_second_native_device_is_guarded_and_its_address_is_the_nodes() {
    let Some(mut c) = firewall_cluster(&[]) else {
        return;
    };
    let (mgmt, at_node, at_mgmt) = c.add_second_device(1);
    let a = c.add_pod(1, "a", "a");
    let n1 = c.nodes[0].netns.clone();
    let (second, mgmt_ip) = (IpAddr::V4(at_node), IpAddr::V4(at_mgmt));
    for port in [2222, 8000, 10250] {
        tcp_server(&n1, second, port);
    }
    tcp_server(&mgmt, mgmt_ip, 8080);
    let mut node = node_object(1);
    node["metadata"]["labels"] = json!({"node-access": "ssh"});
    c.api().apply_json(node).expect("node labels");
    let agent1 = c.nodes[0].agent();
    agent1.wait_until("the host firewall is on both devices", || {
        agent1.cli_json(&["status"])["host_firewall_device"] == "eth0,eth1"
    });
    eventually(
        "no host policy: the second device is open both ways",
        || {
            tcp_ok(&mgmt, second, 8000)
                && tcp_ok(&n1, mgmt_ip, 8080)
                && tcp_ok(&a.netns, second, 10250)
        },
    );
    // The second device's address is host in the kernel's ipcache, though no Node lists it.
    assert_eq!(kernel_identity(&c, "10.99.0.1/32"), Some(1));

    c.api().apply_json(lock_down()).expect("host policy");
    let enforced = || {
        !tcp_ok(&mgmt, second, 8000)
            && !tcp_ok(&mgmt, second, 2222)
            && !tcp_ok(&n1, mgmt_ip, 8080)
            && tcp_ok(&a.netns, second, 8000)
            && !tcp_ok(&a.netns, second, 10250)
    };
    eventually("the host policy judges the second device", enforced);
    let d =
        c.nodes[0]
            .agent()
            .last_flow(&["--to", "host", "--port", "2222", "--verdict", "dropped"]);
    assert_eq!(d["endpoint"], 65535, "{d}");

    // kill -9: the second device's pinned links keep enforcing.
    let kubeconfig = c.kubeconfig.clone();
    c.node(1).kill9_agent();
    assert!(enforced(), "enforced while the agent is down");
    c.node(1).start_agent(&kubeconfig);
    assert!(enforced(), "enforced after the restart");

    // `--devices eth0`: the operator leaves eth1 out; its programs and its address's
    // identity go (so the policy no longer judges it), eth0's stay.
    let restart_with = |c: &mut Cluster, devices: &[&str]| {
        let node = c.node(1);
        node.kill9_agent();
        node.agent_args
            .retain(|a| a != "--devices" && !a.starts_with("eth"));
        for d in devices {
            node.agent_args
                .extend(["--devices".to_string(), d.to_string()]);
        }
        node.start_agent(&kubeconfig);
    };
    restart_with(&mut c, &["eth0"]);
    let left_out = |c: &Cluster| {
        let agent1 = c.nodes[0].agent();
        agent1.wait_until("the host firewall is on eth0 only", || {
            agent1.cli_json(&["status"])["host_firewall_device"] == "eth0"
        });
        let pins: Vec<String> = walk(&c.nodes[0].bpffs)
            .into_iter()
            .filter(|n| n.starts_with("link_hostfw_"))
            .collect();
        assert!(pins.iter().all(|n| !n.ends_with("eth1")), "{pins:?}");
        assert!(
            pins.iter().any(|n| n == "link_hostfw_egress_eth0"),
            "{pins:?}"
        );
        agent1.wait_until("eth1's address is no longer host", || {
            kernel_identity(c, "10.99.0.1/32").is_none()
        });
    };
    left_out(&c);
    eventually("eth1 is not judged", || {
        tcp_ok(&mgmt, second, 8000) && tcp_ok(&n1, mgmt_ip, 8080)
    });
    // A prefix takes it back.
    restart_with(&mut c, &["eth+"]);
    let agent1 = c.nodes[0].agent();
    agent1.wait_until("the host firewall is on both devices again", || {
        agent1.cli_json(&["status"])["host_firewall_device"] == "eth0,eth1"
    });
    eventually("judged again", enforced);

    // The device goes: its programs go with it, pins included; the first device stays.
    common::netns::ip(&["-n", &n1, "link", "del", "eth1"]);
    left_out(&c);
}

/// The identity node 1's kernel ipcache gives `prefix`.
fn kernel_identity(c: &Cluster, prefix: &str) -> Option<u64> {
    let all = c.nodes[0].agent().cli_json(&["bpf", "ipcache", "list"]);
    all.as_array()?
        .iter()
        .find(|e| e["prefix"] == prefix)
        .and_then(|e| e["identity"].as_u64())
}

/// The file names under `dir`, at any depth.
fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    out
}

/// One of the connectivity suite's host policies, read where it lies (never copied).
fn connectivity_manifest(name: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/examples/real-policies/cilium-connectivity")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the corpus must be beside the repo)",
            path.display()
        )
    });
    serde_yaml::from_str(&text).expect("manifest YAML")
}

/// Pod `x/name` on node `i`, labelled `name: <label>` as the connectivity suite's pods are.
fn suite_pod(c: &mut Cluster, i: usize, name: &str, label: &str) -> common::cni::CniPod {
    let api = c.api.take().expect("API server");
    let pod = c.nodes[i - 1].add_pod_labelled(&api, name, json!({ "name": label }));
    c.api = Some(api);
    pod
}

/// Cilium's connectivity test `host-firewall-ingress` and `host-firewall-egress`, the two
/// manifests unchanged, on every node: `client` pods (of either node) no longer reach a node,
/// `client2` still does, and so do the other node and the world; a node no longer reaches
/// `echo-other-node`, and still reaches `echo-same-node`, the other node and the world.
#[test]
fn the_connectivity_suites_host_policies_judge_as_cilium_expects() {
    connectivity_suite(&[]);
}

/// The same in tunnel mode: the node's traffic with the other node's pods goes through the
/// tunnel device, where the host firewall sits too.
#[test]
fn the_connectivity_suites_host_policies_judge_as_cilium_expects_in_tunnel_mode() {
    connectivity_suite(&["--routing-mode", "tunnel"]);
}

fn connectivity_suite(extra: &[&str]) {
    let Some(mut c) = firewall_cluster(extra) else {
        return;
    };
    let (outside, outside_ip) = c.add_outside();
    let client = suite_pod(&mut c, 1, "client", "client");
    let client2 = suite_pod(&mut c, 1, "client2", "client2");
    let remote_client = suite_pod(&mut c, 2, "client-r", "client");
    let echo_same = suite_pod(&mut c, 1, "echo-same", "echo-same-node");
    let echo_other = suite_pod(&mut c, 2, "echo-other", "echo-other-node");
    let n1 = c.nodes[0].netns.clone();
    let n2 = c.nodes[1].netns.clone();
    let host1 = IpAddr::V4(node_ip(1));
    tcp_server(&n1, host1, 8080);
    tcp_server(&n2, IpAddr::V4(node_ip(2)), 8080);
    for e in [&echo_same, &echo_other] {
        tcp_server(&e.netns, IpAddr::V4(e.addr), 8080);
    }
    tcp_server(&outside, IpAddr::V4(outside_ip), 8080);
    let to = |ns: &str, ip: std::net::Ipv4Addr| tcp_ok(ns, IpAddr::V4(ip), 8080);
    for i in 1..=2 {
        let a = c.nodes[i - 1].agent();
        a.wait_until("the host firewall is attached", || {
            a.cli_json(&["status"])["host_firewall_device"] == "eth0"
        });
    }
    // The tunnel's exemption knows the other node as a tunnel peer (tunnel mode only), so its
    // tunnel packets pass whatever identity its address has.
    let tunnel = extra.contains(&"tunnel");
    for i in 1..=2 {
        let pins = c.node(i).bpffs.join("ciliate");
        let want: std::collections::BTreeSet<std::net::Ipv4Addr> = if tunnel {
            [node_ip(3 - i)].into_iter().collect()
        } else {
            Default::default()
        };
        eventually(
            "the host firewall's tunnel peers are the other node",
            || ciliate::datapath::bpf::host_firewall::tunnel_peers(&pins) == want,
        );
    }
    eventually("no host policy: all of it flows", || {
        to(&client.netns, node_ip(1))
            && to(&remote_client.netns, node_ip(1))
            && to(&n1, echo_other.addr)
            && to(&n1, echo_same.addr)
    });

    c.api()
        .apply_json(connectivity_manifest("host-firewall-ingress.yaml"))
        .expect("host-firewall-ingress");
    eventually("client pods no longer reach node 1", || {
        !to(&client.netns, node_ip(1)) && !to(&remote_client.netns, node_ip(1))
    });
    assert!(to(&client2.netns, node_ip(1)), "client2 still does");
    assert!(to(&n2, node_ip(1)), "the other node (remote-node) does");
    assert!(to(&outside, node_ip(1)), "the world does");

    c.api()
        .apply_json(connectivity_manifest("host-firewall-egress.yaml"))
        .expect("host-firewall-egress");
    eventually("node 1 no longer reaches echo-other-node", || {
        !to(&n1, echo_other.addr)
    });
    assert!(to(&n1, echo_same.addr), "it reaches echo-same-node");
    assert!(to(&n1, node_ip(2)), "it reaches the other node");
    assert!(to(&n2, node_ip(1)), "the other node still reaches node 1");
    assert!(to(&n1, outside_ip), "node 1 reaches the world");
    // Node 2 judges the same policies for itself: echo-other-node is its own pod there, and
    // the node's connection to it (the host-to-local-pod path) is dropped.
    assert!(
        !to(&n2, echo_other.addr),
        "node 2 no longer reaches its echo-other-node"
    );
    assert!(
        to(&n2, echo_same.addr),
        "node 2 reaches echo-same-node on node 1"
    );
}

/// Kube-proxy's NAT under a host policy: a NodePort-style DNAT of node 1 to a pod of node 1,
/// reached from the outside on the port the host policy opens (judged before the DNAT, as
/// Cilium's host firewall judges it), and not on another; a ClusterIP-style DNAT of the node's
/// own connections to a pod of node 2, under the node's egress rules.
#[test]
fn kube_proxy_style_dnat_keeps_working_under_a_host_policy() {
    let Some(mut c) = firewall_cluster(&[]) else {
        return;
    };
    let (outside, _) = c.add_outside();
    let a = c.add_pod(1, "a", "a");
    let b = c.add_pod(2, "b", "b");
    for p in [&a, &b] {
        tcp_server(&p.netns, IpAddr::V4(p.addr), 8080);
    }
    let n1 = c.nodes[0].netns.clone();
    nft(
        &n1,
        &format!(
            "table ip kp {{
  chain pre {{ type nat hook prerouting priority -100; tcp dport {{ 30080, 30081 }} dnat to {a}:8080; }}
  chain out {{ type nat hook output priority -100; ip daddr 10.96.0.10 tcp dport 80 dnat to {b}:8080; }}
}}
",
            a = a.addr,
            b = b.addr
        ),
    );
    let host1 = IpAddr::V4(node_ip(1));
    let service = IpAddr::V4("10.96.0.10".parse().unwrap());
    let agent1 = c.nodes[0].agent();
    agent1.wait_until("the host firewall is attached", || {
        agent1.cli_json(&["status"])["host_firewall_device"] == "eth0"
    });
    eventually("no host policy: both NATs work", || {
        tcp_ok(&outside, host1, 30080) && tcp_ok(&outside, host1, 30081) && tcp_ok(&n1, service, 80)
    });
    let mut node = node_object(1);
    node["metadata"]["labels"] = json!({"node-access": "ssh"});
    c.api().apply_json(node).expect("node labels");
    c.api()
        .apply_json(json!({
            "apiVersion": "cilium.io/v2", "kind": "CiliumClusterwideNetworkPolicy",
            "metadata": {"name": "nodeport"},
            "spec": {
                "nodeSelector": {"matchLabels": {"node-access": "ssh"}},
                "ingress": [{"fromEntities": ["world"],
                             "toPorts": [{"ports": [{"port": "30080", "protocol": "TCP"}]}]}],
                "egress": [{"toCIDR": ["172.20.0.0/24"]}, {"toEntities": ["cluster"]}]
            }
        }))
        .expect("host policy");
    eventually("the NodePort the policy opens works, the other not", || {
        tcp_ok(&outside, host1, 30080) && !tcp_ok(&outside, host1, 30081)
    });
    assert!(
        tcp_ok(&n1, service, 80),
        "the node's ClusterIP connection to a pod of node 2 works under its egress rules"
    );
}

/// Every host policy of the third-party corpus (each file with a `nodeSelector`), loaded
/// unchanged by an agent with the host firewall on (manifest directory, memory datapath): the
/// ones Cilium 1.16 accepts are accepted and realized on the host endpoint of a node they
/// select; the two it refuses are refused with the field, the others unharmed.
#[test]
fn the_corpus_host_policies_load_unchanged_onto_the_host_endpoint() {
    let corpus =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/examples/real-policies");
    let mut files = Vec::new();
    let mut stack = vec![corpus.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir)
            .expect("the corpus beside the repo")
            .flatten()
        {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml")
                && std::fs::read_to_string(&p).is_ok_and(|t| t.contains("nodeSelector"))
            {
                files.push(p);
            }
        }
    }
    files.sort();
    assert!(files.len() >= 10, "{files:?}");
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    // A node every nodeSelector of the corpus but one (type: ingress-worker) selects.
    std::fs::write(
        m.join("node.yaml"),
        "apiVersion: v1\nkind: Node\nmetadata: {name: node-1, labels: {type: worker, node-access: ssh}}\n\
         status: {addresses: [{type: InternalIP, address: 172.31.0.1}]}\n",
    )
    .unwrap();
    for (i, f) in files.iter().enumerate() {
        std::fs::copy(
            f,
            m.join(format!(
                "{i:02}-{}",
                f.file_name().unwrap().to_string_lossy()
            )),
        )
        .unwrap();
    }
    let agent = common::agent::Agent::start_with(
        tmp.path(),
        &["--datapath", "memory", "--enable-host-firewall", "true"],
    );
    agent.wait_until("ready", || agent.http_get("/readyz").0 == 200);
    let pol = agent.json("/debug/policy");
    let policies = pol["policies"].as_array().expect("policies").clone();
    let status_of = |name: &str| -> String {
        policies
            .iter()
            .find(|p| p["name"] == name)
            .and_then(|p| p["status"].as_str())
            .unwrap_or("missing")
            .to_string()
    };
    let rejected: Vec<&Value> = policies
        .iter()
        .filter(|p| p["status"] != "accepted")
        .collect();
    let mut names: Vec<&str> = rejected.iter().filter_map(|p| p["name"].as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "allow-extended-egress-worker-node",
            "lock-down-ingress-worker-node"
        ],
        "{rejected:?}"
    );
    assert!(
        status_of("lock-down-ingress-worker-node").contains("ports[5].port: unable to parse port"),
        "{pol}"
    );
    assert!(
        status_of("allow-extended-egress-worker-node").contains("port must be specified"),
        "{pol}"
    );
    // Three variants of lock-down-dev-vms share the name: one policy of that name.
    let mut all: Vec<&str> = policies.iter().filter_map(|p| p["name"].as_str()).collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), policies.len(), "{pol}");
    assert!(
        all.len() >= 8 && all.contains(&"lock-down-dev-vms"),
        "{all:?}"
    );
    // The host endpoint carries what the accepted ones allow.
    agent.wait_until("the host endpoint realized the host policies", || {
        let e = agent.endpoint(65535);
        e["state"] == "ready" && e["policy_entries"].as_u64().unwrap_or(0) > 10
    });
    let e = agent.endpoint(65535);
    assert_eq!(
        e["labels"],
        json!(["reserved:host", "k8s:node-access=ssh", "k8s:type=worker"]),
        "{e}"
    );
    assert_eq!(agent.cli_json(&["status"])["host_firewall"], "enforcing");
}
