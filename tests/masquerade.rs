//! Masquerading (cluster networking issue, item 2), privileged: a node namespace with two pods,
//! an "outside" host and a peer node, all namespaces this test creates. Pod traffic that leaves
//! the native routing CIDR is SNATed to the node's address and replies come back; traffic to a
//! pod (any node) or to a node keeps the pod's address. TCP, UDP and ICMP.

mod common;

use std::net::Ipv4Addr;
use std::process::Command;

use ciliate::datapath::masquerade::{self, MasqueradeSpec};
use common::netns::{
    icmp_ok, in_netns, ip, privileged, seen_over_tcp, seen_over_udp, who_am_i_servers,
};

/// Everything this test made, removed on drop (failures included).
struct Topology {
    tag: String,
}

impl Topology {
    fn ns(&self, role: &str) -> String {
        format!("mq{}-{role}", self.tag)
    }

    fn new() -> Topology {
        let tag = format!("{}", std::process::id() % 100_000);
        let t = Topology { tag };
        for role in ["node", "pod", "pod2", "out", "peer"] {
            ip(&["netns", "add", &t.ns(role)]);
            ip(&["-n", &t.ns(role), "link", "set", "lo", "up"]);
        }
        let node = t.ns("node");
        // (node side, other side, other namespace, node address, other address)
        let links = [
            ("p0", "pod", "10.201.1.1/24", "10.201.1.2/24"),
            ("p1", "pod2", "10.201.2.1/24", "10.201.2.2/24"),
            ("eth0", "out", "198.51.100.1/24", "198.51.100.2/24"),
            ("eth1", "peer", "203.0.113.1/24", "203.0.113.2/24"),
        ];
        for (node_if, role, node_addr, other_addr) in links {
            let other = t.ns(role);
            ip(&[
                "-n", &node, "link", "add", node_if, "type", "veth", "peer", "name", "eth0",
                "netns", &other,
            ]);
            ip(&["-n", &node, "addr", "add", node_addr, "dev", node_if]);
            ip(&["-n", &node, "link", "set", node_if, "up"]);
            ip(&["-n", &other, "addr", "add", other_addr, "dev", "eth0"]);
            ip(&["-n", &other, "link", "set", "eth0", "up"]);
        }
        for (role, gw) in [("pod", "10.201.1.1"), ("pod2", "10.201.2.1")] {
            ip(&["-n", &t.ns(role), "route", "add", "default", "via", gw]);
        }
        // The peer node routes the pod space back through the node (as another node would);
        // the outside host knows nothing of it, so it can only answer a masqueraded packet.
        ip(&[
            "-n",
            &t.ns("peer"),
            "route",
            "add",
            "10.201.0.0/16",
            "via",
            "203.0.113.1",
        ]);
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &node,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
            ])
            .output()
            .expect("sysctl");
        assert!(out.status.success());
        t
    }

    fn masquerade(&self, spec: Option<MasqueradeSpec>) {
        let tag = self.tag.clone();
        in_netns(&self.ns("node"), move || match spec {
            Some(spec) => masquerade::apply(&tag, &spec),
            None => masquerade::remove(&tag),
        })
        .join()
        .unwrap()
        .expect("nftables");
    }

    fn nft_list(&self) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns("node"), "nft", "list", "ruleset"])
            .output()
            .expect("nft");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for role in ["node", "pod", "pod2", "out", "peer"] {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(role)])
                .output();
        }
    }
}

#[test]
fn pod_traffic_leaving_the_cluster_is_masqueraded_and_pod_and_node_traffic_is_not() {
    if !privileged() {
        return;
    }
    let t = Topology::new();
    let (out, peer, pod2) = (
        Ipv4Addr::new(198, 51, 100, 2),
        Ipv4Addr::new(203, 0, 113, 2),
        Ipv4Addr::new(10, 201, 2, 2),
    );
    for (role, addr) in [("out", out), ("peer", peer), ("pod2", pod2)] {
        who_am_i_servers(&t.ns(role), addr);
    }
    // Before: the outside host cannot answer a pod.
    assert_eq!(seen_over_tcp(&t.ns("pod"), out), None);

    let spec = MasqueradeSpec {
        pod_cidrs: vec!["10.201.1.0/24".parse().unwrap()],
        native_routing_cidr: Some("10.201.0.0/16".parse().unwrap()),
        cluster_pod_cidrs: vec![],
        node_ips: vec![peer],
    };
    t.masquerade(Some(spec.clone()));
    let pod = t.ns("pod");
    assert_eq!(seen_over_tcp(&pod, out).as_deref(), Some("198.51.100.1"));
    assert_eq!(seen_over_udp(&pod, out).as_deref(), Some("198.51.100.1"));
    assert!(
        icmp_ok(&pod, out),
        "an echo reply comes back through the NAT"
    );
    // Pod to pod and pod to node keep the pod's address.
    assert_eq!(seen_over_tcp(&pod, pod2).as_deref(), Some("10.201.1.2"));
    assert_eq!(seen_over_tcp(&pod, peer).as_deref(), Some("10.201.1.2"));
    assert_eq!(seen_over_udp(&pod, peer).as_deref(), Some("10.201.1.2"));
    // Another node's pod (pod2 is outside this node's pod CIDR) is not this node's to translate.
    assert_eq!(
        seen_over_tcp(&t.ns("pod2"), peer).as_deref(),
        Some("10.201.2.2")
    );

    // Applying again replaces the table: still one table, one masquerade rule.
    t.masquerade(Some(spec.clone()));
    t.masquerade(Some(spec));
    let rules = t.nft_list();
    assert_eq!(rules.matches("table ip ciliate_").count(), 1, "{rules}");
    assert_eq!(rules.matches("masquerade").count(), 1, "{rules}");
    assert_eq!(seen_over_tcp(&pod, out).as_deref(), Some("198.51.100.1"));

    // Turned off: the table goes, and the outside host can no longer answer.
    t.masquerade(None);
    assert!(!t.nft_list().contains("ciliate_"));
    assert_eq!(seen_over_tcp(&pod, out), None);
    // Removing what is not there is fine.
    t.masquerade(None);
}
