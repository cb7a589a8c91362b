//! Cluster policy tiers on real packets: the agent with `--datapath bpf` and a manifest
//! directory holding AdminNetworkPolicies, a BaselineAdminNetworkPolicy and a
//! CiliumNetworkPolicy, between network-namespace pods. An Admin Deny beats the CNP's allow, a
//! priority change and a Pass apply live, the Baseline tier denies only where nothing of the
//! NetworkPolicy tier selects the pod, and the drop names the deciding rule and its tier.
//! Then across two nodes of the cluster harness (Kubernetes mode, CNI pods): TCP, UDP and SCTP
//! under an Admin Deny and Allow whose order a priority change flips, live.
//! Privileged: with CI=true it must run.

mod common;

use std::time::Duration;

use std::net::IpAddr;

use common::agent::Agent;
use common::cluster::Cluster;
use common::netns::{
    privileged, privileged_two_pods, sctp_echo_server, sctp_ok, tcp_ok, tcp_server, udp_ok,
    udp_server,
};
use common::{anp_b_from_a as anp, eventually, wait_output};
use serde_json::json;

fn cnp_b_from_a() -> &'static str {
    "apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: b-from-a, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: b}}
  ingress:
    - fromEndpoints: [{matchLabels: {app: a}}]
      toPorts: [{ports: [{port: '8080', protocol: TCP}, {port: '9090', protocol: TCP}]}]
"
}

const BANP_DENY_A: &str = "apiVersion: policy.networking.k8s.io/v1alpha1
kind: BaselineAdminNetworkPolicy
metadata: {name: default}
spec:
  subject: {namespaces: {}}
  ingress:
    - {name: deny-from-a, action: Deny, from: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: a}}}}]}
";

#[test]
fn tiers_decide_real_connections_and_change_live() {
    let Some(w) = privileged_two_pods(&[8080, 9090]) else {
        return;
    };
    let (a, b) = (&w.pods[0], &w.pods[1]);
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    let cluster =
        common::namespace_x_with_pods(&[("a", &a.addr.to_string()), ("b", &b.addr.to_string())]);
    std::fs::write(m.join("cluster.yaml"), cluster).unwrap();
    std::fs::write(m.join("cnp.yaml"), cnp_b_from_a()).unwrap();
    std::fs::write(m.join("deny.yaml"), anp("deny-9090", 10, "Deny", 9090)).unwrap();
    std::fs::write(m.join("allow.yaml"), anp("allow-9090", 20, "Allow", 9090)).unwrap();
    let pins = w.pins.to_string_lossy().to_string();
    let agent = Agent::start_with(tmp.path(), &["--datapath", "bpf", "--bpf-root", &pins]);
    for (name, pod) in [("x/a", a), ("x/b", b)] {
        agent.add_endpoint(name, pod.addr, &pod.host_if);
    }
    agent.wait_realized(agent.revision());
    let applied = |what: &str, file: &str, text: &str| {
        let rev = agent.revision();
        std::fs::write(m.join(file), text).unwrap();
        agent.wait_until(what, || agent.revision() > rev);
        agent.wait_realized(agent.revision());
    };

    // The Admin Deny (priority 10) beats both the CNP's allow and the Admin Allow (20).
    assert!(tcp_ok(&a.netns, b.addr, 8080), "the CNP allows 8080");
    let mon = std::process::Command::new(common::agent::BIN)
        .args([
            "monitor",
            "--count",
            "1",
            "--verdict",
            "dropped",
            "-o",
            "json",
        ])
        .arg("--socket")
        .arg(agent.socket())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(!tcp_ok(&a.netns, b.addr, 9090), "the Admin Deny drops 9090");
    let out = wait_output(mon, Duration::from_secs(10));
    let ev: serde_json::Value = serde_json::from_str(out.lines().next().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {out:?}"));
    assert_eq!(ev["port"], 9090, "{ev}");
    assert_eq!(
        (
            &ev["policies"][0]["kind"],
            &ev["policies"][0]["name"],
            &ev["policies"][0]["rule"],
            &ev["policies"][0]["tier"]
        ),
        (
            &serde_json::json!("AdminNetworkPolicy"),
            &serde_json::json!("deny-9090"),
            &serde_json::json!(0),
            &serde_json::json!("admin")
        ),
        "the drop names the deciding rule and its tier: {ev}"
    );

    // A priority change, live: the Allow now comes first.
    applied(
        "the priority change",
        "allow.yaml",
        &anp("allow-9090", 5, "Allow", 9090),
    );
    eventually("9090 allowed by the Admin Allow", || {
        tcp_ok(&a.netns, b.addr, 9090)
    });
    // The Allow goes; the Deny becomes a Pass: the CNP decides (allows).
    std::fs::remove_file(m.join("allow.yaml")).unwrap();
    applied("the Pass", "deny.yaml", &anp("deny-9090", 10, "Pass", 9090));
    eventually("9090 passed to the CNP, which allows", || {
        tcp_ok(&a.netns, b.addr, 9090)
    });

    // The Baseline tier: denies a only where nothing of the NetworkPolicy tier selects b.
    applied("the baseline", "banp.yaml", BANP_DENY_A);
    assert!(
        tcp_ok(&a.netns, b.addr, 8080),
        "the CNP selects b: the baseline does not apply"
    );
    std::fs::remove_file(m.join("cnp.yaml")).unwrap();
    let rev = agent.revision();
    agent.wait_until("the CNP is gone", || agent.revision() > rev);
    agent.wait_realized(agent.revision());
    eventually("the baseline denies a -> b:8080", || {
        !tcp_ok(&a.netns, b.addr, 8080)
    });
    assert!(
        !tcp_ok(&a.netns, b.addr, 9090),
        "9090: the Admin Pass, no NetworkPolicy, the Baseline Deny"
    );

    // `networks` cover pods' addresses too: an Admin Deny to b's address stops a's egress.
    std::fs::remove_file(m.join("banp.yaml")).unwrap();
    let rev = agent.revision();
    agent.wait_until("the baseline is gone", || agent.revision() > rev);
    agent.wait_realized(agent.revision());
    eventually("a reaches b:8080 again", || tcp_ok(&a.netns, b.addr, 8080));
    let nets = format!(
        "apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {{name: no-b-address}}
spec:
  priority: 1
  subject: {{pods: {{namespaceSelector: {{}}, podSelector: {{matchLabels: {{app: a}}}}}}}}
  egress:
    - {{name: deny-b, action: Deny, to: [{{networks: ['{}/32']}}]}}
",
        b.addr
    );
    applied("the networks Deny", "nets.yaml", &nets);
    eventually("a's egress to b's address is denied", || {
        !tcp_ok(&a.netns, b.addr, 8080)
    });
    std::fs::remove_file(m.join("nets.yaml")).unwrap();

    // `monitor` finds the drops by tier, kind and rule among the flows kept.
    let first = |args: &[&str]| -> serde_json::Value {
        let mon = std::process::Command::new(common::agent::BIN)
            .args(["monitor", "--since", "5m", "--count", "1", "-o", "json"])
            .args(args)
            .arg("--socket")
            .arg(agent.socket())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_output(mon, Duration::from_secs(10));
        serde_json::from_str(out.lines().next().unwrap_or(""))
            .unwrap_or_else(|e| panic!("monitor {args:?}: {e}: {out:?}"))
    };
    let ev = first(&[
        "--tier",
        "baseline",
        "--policy",
        "BaselineAdminNetworkPolicy/default[0]",
    ]);
    assert_eq!(
        (
            &ev["verdict"],
            &ev["policies"][0]["tier"],
            &ev["policies"][0]["name"]
        ),
        (
            &serde_json::json!("dropped"),
            &serde_json::json!("baseline"),
            &serde_json::json!("default")
        ),
        "{ev}"
    );
    let ev = first(&["--tier", "admin", "--verdict", "dropped"]);
    assert_eq!(
        (&ev["port"], &ev["policies"][0]["name"]),
        (&serde_json::json!(9090), &serde_json::json!("deny-9090")),
        "the first Admin drop kept: {ev}"
    );
    drop(agent);
    drop(w);
}

/// An AdminNetworkPolicy on b's ingress from a, on TCP 8080, UDP 5353 and SCTP 9999.
fn anp_three_protocols(name: &str, priority: u32, action: &str) -> serde_json::Value {
    let pods = |app: &str| json!({"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": app}}}});
    let port =
        |protocol: &str, port: u16| json!({"portNumber": {"protocol": protocol, "port": port}});
    json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha1",
        "kind": "AdminNetworkPolicy",
        "metadata": {"name": name},
        "spec": {
            "priority": priority,
            "subject": pods("b"),
            "ingress": [{
                "name": format!("{name}-rule"),
                "action": action,
                "from": [pods("a")],
                "ports": [port("TCP", 8080), port("UDP", 5353), port("SCTP", 9999)],
            }],
        },
    })
}

#[test]
fn tiers_decide_across_nodes_over_tcp_udp_and_sctp_and_a_priority_change_applies_live() {
    let Some(mut c) = privileged().then(|| Cluster::start(2)) else {
        return;
    };
    let a = c.add_pod(1, "a", "a");
    let b = c.add_pod(2, "b", "b");
    let b_addr = IpAddr::V4(b.addr);
    tcp_server(&b.netns, b_addr, 8080);
    udp_server(&b.netns, b_addr, 5353);
    sctp_echo_server(&b.netns, 9999);
    let tcp = || tcp_ok(&a.netns, b_addr, 8080);
    let udp = || udp_ok(&a.netns, b_addr, 5353);
    let sctp = || sctp_ok(&a.netns, b.addr, 9999);
    eventually(
        "a (node 1) reaches b (node 2) over TCP, UDP and SCTP",
        || tcp() && udp() && sctp(),
    );
    // An Admin Deny (priority 20) ahead of an Admin Allow (30) of the same traffic.
    let api = c.api();
    api.apply_json(anp_three_protocols("deny-a", 20, "Deny"))
        .expect("the Deny");
    api.apply_json(anp_three_protocols("allow-a", 30, "Allow"))
        .expect("the Allow");
    eventually(
        "the Admin Deny stops TCP, UDP and SCTP across nodes",
        || !tcp() && !udp() && !sctp(),
    );
    // The Allow's priority changes to 10: it comes first, live, for new connections of all three.
    api.apply_json(anp_three_protocols("allow-a", 10, "Allow"))
        .expect("the priority change");
    eventually("the Admin Allow, now first, lets all three through", || {
        tcp() && udp() && sctp()
    });
    // And back behind the Deny.
    api.apply_json(anp_three_protocols("allow-a", 40, "Allow"))
        .expect("the priority change");
    eventually("the Deny is first again", || !tcp() && !udp() && !sctp());
    // The drop names the deciding rule and its tier on the node that enforces it.
    let (code, flows, err) = c.node(2).agent().cli(&[
        "monitor",
        "--since",
        "5m",
        "--count",
        "1",
        "-o",
        "json",
        "--tier",
        "admin",
        "--verdict",
        "dropped",
        "--port",
        "9999",
    ]);
    assert_eq!(code, 0, "{err}");
    let ev: serde_json::Value = serde_json::from_str(flows.lines().next().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {flows:?}"));
    assert_eq!(
        (
            &ev["protocol"],
            &ev["policies"][0]["name"],
            &ev["policies"][0]["tier"]
        ),
        (&json!("SCTP"), &json!("deny-a"), &json!("admin")),
        "{ev}"
    );
}

/// An AdminNetworkPolicy of one pod's egress to `nodes` selected by `labels` on TCP 7070.
fn anp_to_nodes(
    name: &str,
    priority: u32,
    action: &str,
    labels: serde_json::Value,
) -> serde_json::Value {
    json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha1",
        "kind": "AdminNetworkPolicy",
        "metadata": {"name": name},
        "spec": {
            "priority": priority,
            "subject": {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "a"}}}},
            "egress": [{
                "name": format!("{name}-rule"),
                "action": action,
                "to": [{"nodes": {"matchLabels": labels}}],
                "ports": [{"portNumber": {"protocol": "TCP", "port": 7070}}],
            }],
        },
    })
}

/// `nodes` peers (issue #28) on real packets: a pod on node 1 reaches its own node (the host
/// identity) and node 2 (remote-node, or its class's identity). A Deny of every node stops
/// both; an Allow ahead of it follows the nodes' labels live: no node labelled, both denied;
/// both labelled, both allowed; node 2 relabelled away, only node 1 is allowed, and node 1
/// relabelled away instead, only node 2 (each node exactly, by its labels: node 2's addresses
/// move to the identity of its class on node 1's agent, `policy::node_classes`). Last,
/// `networks: [0.0.0.0/0]` covers both node addresses.
#[test]
fn nodes_peers_follow_the_nodes_labels_live() {
    let Some(mut c) = privileged().then(|| Cluster::start(2)) else {
        return;
    };
    let a = c.add_pod(1, "a", "a");
    let (n1, n2) = (common::cluster::node_ip(1), common::cluster::node_ip(2));
    let n1_ns = c.node(1).netns.clone();
    let n2_ns = c.node(2).netns.clone();
    tcp_server(&n1_ns, IpAddr::V4(n1), 7070);
    tcp_server(&n2_ns, IpAddr::V4(n2), 7070);
    let own = || tcp_ok(&a.netns, IpAddr::V4(n1), 7070);
    let remote = || tcp_ok(&a.netns, IpAddr::V4(n2), 7070);
    eventually("a reaches both nodes", || own() && remote());
    let api = c.api();
    api.apply_json(anp_to_nodes("deny-nodes", 20, "Deny", json!({})))
        .expect("the Deny");
    eventually("the Deny of every node stops both", || !own() && !remote());
    api.apply_json(anp_to_nodes(
        "allow-blue",
        10,
        "Allow",
        json!({"pool": "blue"}),
    ))
    .expect("the Allow");
    let label = |i: usize, pool: &str| {
        let mut node = common::cluster::node_object(i);
        node["metadata"]["labels"] = json!({"pool": pool});
        api.apply_json(node).expect("node labels");
    };
    label(1, "blue");
    label(2, "blue");
    eventually("both nodes blue: the Allow lets both through", || {
        own() && remote()
    });
    label(2, "green");
    eventually(
        "node 2 green: the Allow lets node 1 (host) through, the Deny stops node 2",
        || own() && !remote(),
    );
    label(2, "blue");
    label(1, "green");
    eventually(
        "node 1 green: node 2 (its class) allowed, the own node denied",
        || !own() && remote(),
    );
    label(1, "blue");
    eventually("blue again: both allowed", || own() && remote());
    // `networks` cover node addresses too (the API: cluster-internal traffic is checked
    // against them): a Deny of 0.0.0.0/0 ahead of the Allow stops both (as `policy simulate`
    // says, tests/worlds/npa-networks-cover-nodes.yaml).
    let mut deny_all = anp_to_nodes("deny-networks", 5, "Deny", json!({}));
    deny_all["spec"]["egress"][0]["to"] = json!([{"networks": ["0.0.0.0/0"]}]);
    api.apply_json(deny_all).expect("the networks Deny");
    eventually("a Deny of 0.0.0.0/0 stops both nodes", || {
        !own() && !remote()
    });
}
