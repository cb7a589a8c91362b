//! What the demo builds around its two nodes: the link between this host (node 1) and the
//! second node's network namespace, blackhole routes for the Service range inside pods, and a
//! cgroup v2 subtree per node for socket-level Service translation. Everything here is made
//! under names that carry the demo's process id and is undone by the demo's cleanup.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::path::Path;

use ipnet::Ipv4Net;
use rtnetlink::packet_route::route::RouteType;
use rtnetlink::{LinkUnspec, LinkVeth, RouteMessageBuilder};

use crate::datapath::netdev::{
    self, existing_link, link_by_name, nl_err, set_link, with_netlink, NetdevError,
};

/// The addresses of the demo's two nodes and their pods, all carved out of `--pod-cidr` so
/// that two demos with different pod CIDRs never share an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The cluster's pod space (`--ipv4-native-routing-cidr`): both nodes' pod CIDRs.
    pub cluster: Ipv4Net,
    pub pod_cidrs: [Ipv4Net; 2],
    /// The link between the nodes: node 1's and node 2's addresses (their InternalIPs).
    pub node_ips: [Ipv4Addr; 2],
    pub link_prefix: u8,
}

impl Plan {
    /// Quarters of `pod_cidr`: the first two are the nodes' pod CIDRs (together the cluster's
    /// pod space), the node link is the last /30 of the last quarter.
    pub fn new(pod_cidr: Ipv4Net) -> Result<Plan, String> {
        if pod_cidr.prefix_len() > 26 {
            return Err(format!(
                "--pod-cidr {pod_cidr}: the demo needs at least a /26 (two nodes' pod CIDRs and their link)"
            ));
        }
        let quarters: Vec<Ipv4Net> = pod_cidr
            .subnets(pod_cidr.prefix_len() + 2)
            .map_err(|e| format!("--pod-cidr {pod_cidr}: {e}"))?
            .collect();
        let cluster = Ipv4Net::new(pod_cidr.network(), pod_cidr.prefix_len() + 1)
            .map_err(|e| format!("--pod-cidr {pod_cidr}: {e}"))?;
        let last = u32::from(quarters[3].broadcast());
        Ok(Plan {
            cluster,
            pod_cidrs: [quarters[0], quarters[1]],
            node_ips: [Ipv4Addr::from(last - 2), Ipv4Addr::from(last - 1)],
            link_prefix: 30,
        })
    }
}

/// A veth pair between this host's namespace (`host_if`, address `node_ips[0]`) and `netns`
/// (`eth0`, address `node_ips[1]`), both up; the host side carries the agent mark `mark` so
/// that nothing else mistakes it for its own.
pub fn create_node_link(
    host_if: &str,
    netns: &Path,
    plan: &Plan,
    mark: &str,
) -> Result<(), NetdevError> {
    let ns = std::fs::File::open(netns).map_err(|e| NetdevError::Netns {
        path: netns.to_path_buf(),
        message: e.to_string(),
    })?;
    let ns_fd = ns.as_raw_fd();
    // Created under a temporary name (unique: it carries the host side's), moved, renamed.
    let tmp = format!("t{}", &host_if[1..]);
    let peer_name = tmp.clone();
    let (host_if, mark, prefix) = (host_if.to_string(), mark.to_string(), plan.link_prefix);
    let [host_ip, node_ip] = plan.node_ips;
    with_netlink(None, move |h| async move {
        h.link()
            .add(LinkVeth::new(&host_if, &tmp).build())
            .execute()
            .await
            .map_err(nl_err(format!("create veth {host_if}")))?;
        let link = existing_link(&h, &host_if).await?;
        netdev::move_to_netns(&h, &tmp, ns_fd, "the node's").await?;
        set_link(
            &h,
            LinkUnspec::new_with_index(link.header.index)
                .alias(mark)
                .up()
                .build(),
            format!("set {host_if} up"),
        )
        .await?;
        h.address()
            .add(link.header.index, IpAddr::V4(host_ip), prefix)
            .execute()
            .await
            .map_err(nl_err(format!("address {host_ip}/{prefix} on {host_if}")))
    })?;
    drop(ns);
    with_netlink(Some(netns), move |h| async move {
        let peer = link_by_name(&h, &peer_name)
            .await?
            .ok_or_else(|| NetdevError::Invalid("the node link's peer vanished".into()))?;
        let index = peer.header.index;
        set_link(
            &h,
            LinkUnspec::new_with_index(index)
                .name("eth0".to_string())
                .up()
                .build(),
            "name the node's eth0 and set it up",
        )
        .await?;
        netdev::set_lo_up(&h).await?;
        h.address()
            .add(index, IpAddr::V4(node_ip), prefix)
            .execute()
            .await
            .map_err(nl_err(format!("address {node_ip}/{prefix} on eth0")))
    })
}

/// A blackhole route for `cidr` inside `netns`: a packet to it that was not translated goes
/// nowhere instead of leaving through the pod's default route.
pub fn blackhole(netns: &Path, cidr: Ipv4Net) -> Result<(), NetdevError> {
    with_netlink(Some(netns), move |h| async move {
        let route = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(cidr.network(), cidr.prefix_len())
            .kind(RouteType::BlackHole)
            .build();
        h.route()
            .add(route)
            .replace()
            .execute()
            .await
            .map_err(nl_err(format!("blackhole route {cidr}")))
    })
}

/// Removes the host side of the node link (the peer and the routes through it go too).
pub fn delete_node_link(host_if: &str) -> Result<bool, NetdevError> {
    netdev::delete_host_interface(host_if)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_splits_the_pod_cidr_into_two_nodes_and_their_link() {
        let p = Plan::new("10.248.0.0/24".parse().unwrap()).unwrap();
        assert_eq!(p.cluster, "10.248.0.0/25".parse::<Ipv4Net>().unwrap());
        assert_eq!(
            p.pod_cidrs,
            [
                "10.248.0.0/26".parse::<Ipv4Net>().unwrap(),
                "10.248.0.64/26".parse().unwrap()
            ]
        );
        assert_eq!(
            p.node_ips,
            [
                Ipv4Addr::new(10, 248, 0, 253),
                Ipv4Addr::new(10, 248, 0, 254)
            ]
        );
        // Neither node address is in the cluster's pod space, so no pod is ever given one.
        assert!(p.node_ips.iter().all(|ip| !p.cluster.contains(ip)));
    }

    #[test]
    fn a_pod_cidr_too_small_for_two_nodes_is_refused() {
        let e = Plan::new("10.248.0.0/27".parse().unwrap()).unwrap_err();
        assert!(e.contains("--pod-cidr 10.248.0.0/27"), "{e}");
    }
}
