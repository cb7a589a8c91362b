//! Masquerading (cluster networking issue, item 2), privileged: a node namespace with two pods,
//! an "outside" host and a peer node, all namespaces this test creates. Pod traffic that leaves
//! the native routing CIDR is SNATed to the node's address and replies come back; traffic to a
//! pod (any node) or to a node keeps the pod's address. TCP, UDP and ICMP; IPv6 (the `ip6`
//! table) with TCP and UDP.

mod common;

use std::net::{Ipv4Addr, Ipv6Addr};
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
        // One topology per test: the tests of this file run in parallel.
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let tag = format!("{}{n}", std::process::id() % 100_000);
        let t = Topology { tag };
        for role in ["node", "pod", "pod2", "out", "peer"] {
            ip(&["netns", "add", &t.ns(role)]);
            ip(&["-n", &t.ns(role), "link", "set", "lo", "up"]);
            // No duplicate address detection on the links to come: a tentative link-local
            // address would delay the first IPv6 neighbour exchange past the probes' timeout.
            sysctl(&t.ns(role), "net.ipv6.conf.default.accept_dad=0");
        }
        let node = t.ns("node");
        // (node side, other side, other namespace, node address, other address; and IPv6's)
        let links = [
            (
                "p0",
                "pod",
                "10.201.1.1/24",
                "10.201.1.2/24",
                "fd00:201:1::1",
                "fd00:201:1::2",
            ),
            (
                "p1",
                "pod2",
                "10.201.2.1/24",
                "10.201.2.2/24",
                "fd00:201:2::1",
                "fd00:201:2::2",
            ),
            (
                "eth0",
                "out",
                "198.51.100.1/24",
                "198.51.100.2/24",
                "2001:db8:100::1",
                "2001:db8:100::2",
            ),
            (
                "eth1",
                "peer",
                "203.0.113.1/24",
                "203.0.113.2/24",
                "2001:db8:113::1",
                "2001:db8:113::2",
            ),
        ];
        for (node_if, role, node_addr, other_addr, node6, other6) in links {
            let other = t.ns(role);
            ip(&[
                "-n", &node, "link", "add", node_if, "type", "veth", "peer", "name", "eth0",
                "netns", &other,
            ]);
            ip(&["-n", &node, "addr", "add", node_addr, "dev", node_if]);
            ip(&["-n", &node, "link", "set", node_if, "up"]);
            ip(&["-n", &other, "addr", "add", other_addr, "dev", "eth0"]);
            ip(&["-n", &other, "link", "set", "eth0", "up"]);
            for (ns, dev, addr) in [(&node, node_if, node6), (&other, "eth0", other6)] {
                let addr = format!("{addr}/64");
                ip(&["-n", ns, "-6", "addr", "add", &addr, "dev", dev, "nodad"]);
            }
        }
        for (role, gw, gw6) in [
            ("pod", "10.201.1.1", "fd00:201:1::1"),
            ("pod2", "10.201.2.1", "fd00:201:2::1"),
        ] {
            ip(&["-n", &t.ns(role), "route", "add", "default", "via", gw]);
            ip(&[
                "-n",
                &t.ns(role),
                "-6",
                "route",
                "add",
                "default",
                "via",
                gw6,
            ]);
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
        ip(&[
            "-n",
            &t.ns("peer"),
            "-6",
            "route",
            "add",
            "fd00:201::/32",
            "via",
            "2001:db8:113::1",
        ]);
        sysctl(&node, "net.ipv4.ip_forward=1");
        sysctl(&node, "net.ipv6.conf.all.forwarding=1");
        t
    }

    /// Applies `spec`, or removes the table of the family `ipv6` when `None`.
    fn masquerade(&self, spec: Option<MasqueradeSpec>, ipv6: bool) {
        let tag = self.tag.clone();
        in_netns(&self.ns("node"), move || match spec {
            Some(spec) => masquerade::apply(&tag, &spec),
            None => masquerade::remove(&tag, ipv6),
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

fn sysctl(netns: &str, setting: &str) {
    let out = Command::new("ip")
        .args(["netns", "exec", netns, "sysctl", "-qw", setting])
        .output()
        .expect("sysctl");
    assert!(out.status.success(), "{netns}: sysctl {setting}");
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
        ipv6: false,
        pod_cidrs: vec!["10.201.1.0/24".parse().unwrap()],
        native_routing_cidr: Some("10.201.0.0/16".parse().unwrap()),
        cluster_pod_cidrs: vec![],
        node_ips: vec![peer.into()],
    };
    t.masquerade(Some(spec.clone()), false);
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
    t.masquerade(Some(spec.clone()), false);
    t.masquerade(Some(spec), false);
    let rules = t.nft_list();
    assert_eq!(rules.matches("table ip ciliate_").count(), 1, "{rules}");
    assert_eq!(rules.matches("masquerade").count(), 1, "{rules}");
    assert_eq!(seen_over_tcp(&pod, out).as_deref(), Some("198.51.100.1"));

    // Turned off: the table goes, and the outside host can no longer answer.
    t.masquerade(None, false);
    assert!(!t.nft_list().contains("ciliate_"));
    assert_eq!(seen_over_tcp(&pod, out), None);
    // Removing what is not there is fine.
    t.masquerade(None, false);
}

/// `--enable-ipv6-masquerade`: the `ip6` table does for IPv6 what the `ip` table does for IPv4,
/// beside it; each family's table goes on its own.
#[test]
fn ipv6_pod_traffic_leaving_the_cluster_is_masqueraded_in_a_table_of_its_own() {
    if !privileged() {
        return;
    }
    let t = Topology::new();
    let v6 = |s: &str| s.parse::<Ipv6Addr>().unwrap();
    let (out, peer, pod2) = (
        v6("2001:db8:100::2"),
        v6("2001:db8:113::2"),
        v6("fd00:201:2::2"),
    );
    for (role, addr) in [("out", out), ("peer", peer), ("pod2", pod2)] {
        who_am_i_servers(&t.ns(role), addr);
    }
    who_am_i_servers(&t.ns("out"), Ipv4Addr::new(198, 51, 100, 2));
    let pod = t.ns("pod");
    assert_eq!(seen_over_tcp(&pod, out), None, "no NAT, no answer");

    let spec6 = MasqueradeSpec {
        ipv6: true,
        pod_cidrs: vec!["fd00:201:1::/64".parse().unwrap()],
        native_routing_cidr: Some("fd00:201::/32".parse().unwrap()),
        cluster_pod_cidrs: vec![],
        node_ips: vec![peer.into()],
    };
    let spec4 = MasqueradeSpec {
        ipv6: false,
        pod_cidrs: vec!["10.201.1.0/24".parse().unwrap()],
        native_routing_cidr: Some("10.201.0.0/16".parse().unwrap()),
        cluster_pod_cidrs: vec![],
        node_ips: vec![],
    };
    t.masquerade(Some(spec6.clone()), true);
    t.masquerade(Some(spec4), false);
    assert_eq!(seen_over_tcp(&pod, out).as_deref(), Some("2001:db8:100::1"));
    assert_eq!(seen_over_udp(&pod, out).as_deref(), Some("2001:db8:100::1"));
    assert_eq!(
        seen_over_tcp(&pod, Ipv4Addr::new(198, 51, 100, 2)).as_deref(),
        Some("198.51.100.1"),
        "the IPv4 table beside it"
    );
    // Pod to pod and pod to node keep the pod's address.
    assert_eq!(seen_over_tcp(&pod, pod2).as_deref(), Some("fd00:201:1::2"));
    assert_eq!(seen_over_tcp(&pod, peer).as_deref(), Some("fd00:201:1::2"));
    assert_eq!(seen_over_udp(&pod, peer).as_deref(), Some("fd00:201:1::2"));
    t.masquerade(Some(spec6), true);
    let rules = t.nft_list();
    assert_eq!(rules.matches("table ip6 ciliate_").count(), 1, "{rules}");
    assert_eq!(rules.matches("table ip ciliate_").count(), 1, "{rules}");
    assert_eq!(rules.matches("masquerade").count(), 2, "{rules}");

    // The IPv6 table goes alone: IPv4 stays masqueraded.
    t.masquerade(None, true);
    let rules = t.nft_list();
    assert!(!rules.contains("table ip6 ciliate_"), "{rules}");
    assert_eq!(seen_over_tcp(&pod, out), None);
    assert_eq!(
        seen_over_tcp(&pod, Ipv4Addr::new(198, 51, 100, 2)).as_deref(),
        Some("198.51.100.1")
    );
    t.masquerade(None, false);
}
