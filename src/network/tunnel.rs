//! Tunnel mode: a kernel vxlan device (`ciliate_vxlan`, VNI 2, UDP 8472 as Cilium's) over
//! rtnetlink, its outer packets IPv4 or IPv6 (`--underlay-protocol`). Each node's VTEP MAC is
//! derived from its underlay address (`vtep_mac`), so nothing has to be exchanged: for every
//! remote node the agent writes an FDB entry (MAC -> node address), a permanent neighbour
//! (next hop -> MAC) on the device, and routes its pod CIDRs `via NEXT_HOP dev ciliate_vxlan
//! onlink` (IPv4 pod CIDRs via the node's IPv4 address, IPv6 ones via `gateway6`). The device
//! carries this agent's mark (its alias), so another agent's device is never used or changed.
//! Runs inside a `with_netlink` closure (blocking thread).

use std::net::{IpAddr, Ipv6Addr};

use futures_util::TryStreamExt;
use rtnetlink::packet_route::link::LinkMessage;
use rtnetlink::packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourState,
};
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::{Handle, LinkUnspec, LinkVxlan};

use crate::datapath::netdev::{
    alias, link_by_name, nl_err, owned, permanent_neighbour, set_link, NetdevError,
};

/// The tunnel device of an agent.
pub const VXLAN_DEVICE: &str = "ciliate_vxlan";
/// The VXLAN network identifier of the cluster.
pub const VXLAN_VNI: u32 = 2;
/// The VXLAN UDP port (Cilium's default).
pub const VXLAN_PORT: u16 = 8472;
/// The MTU of the node's link (and of pod interfaces in native mode).
pub const LINK_MTU: u32 = 1500;
/// VXLAN's overhead over IPv4: outer IP 20 + UDP 8 + VXLAN 8 + inner Ethernet 14.
pub const VXLAN_OVERHEAD: u32 = 50;
/// Over IPv6: the outer header is 40 bytes.
pub const VXLAN_OVERHEAD6: u32 = 70;

/// The tunnel's overhead with the underlay `u`.
pub fn overhead(u: crate::network::UnderlayProtocol) -> u32 {
    match u {
        crate::network::UnderlayProtocol::Ipv4 => VXLAN_OVERHEAD,
        crate::network::UnderlayProtocol::Ipv6 => VXLAN_OVERHEAD6,
    }
}

/// Four bytes that name a node's underlay address, and the byte that says its family: an
/// IPv4 address's own bytes (`c1`), or the FNV-1a hash of an IPv6 address (`c6`).
fn node_tag(ip: IpAddr) -> (u8, [u8; 4]) {
    match ip {
        IpAddr::V4(v4) => (0xc1, v4.octets()),
        IpAddr::V6(v6) => {
            let h = v6.octets().iter().fold(0x811c_9dc5u32, |h, b| {
                (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
            });
            (0xc6, h.to_be_bytes())
        }
    }
}

/// The VTEP MAC of the node with underlay address `ip`: locally administered unicast `02`, the
/// family byte and the four bytes of `node_tag`, the same on every node.
pub fn vtep_mac(ip: impl Into<IpAddr>) -> [u8; 6] {
    let (f, t) = node_tag(ip.into());
    [0x02, f, t[0], t[1], t[2], t[3]]
}

/// The IPv6 next hop that stands for the node at `ip` on the device: the kernel takes no IPv4
/// next hop for an IPv6 route, so IPv6 pod CIDRs go via this link-local address, whose
/// permanent neighbour entry is the node's VTEP MAC (and the FDB sends that MAC to `ip`).
/// `fe80::`, the family byte, `0:` and the four bytes of `node_tag`, the same on every node.
pub fn gateway6(ip: impl Into<IpAddr>) -> Ipv6Addr {
    let (f, t) = node_tag(ip.into());
    Ipv6Addr::new(
        0xfe80,
        0,
        0,
        0,
        u16::from(f),
        0,
        u16::from_be_bytes([t[0], t[1]]),
        u16::from_be_bytes([t[2], t[3]]),
    )
}

/// The peers whose VTEP MAC is this node's (`local`) or an earlier peer's (in address order),
/// each with why: an IPv6 underlay's MACs are hashes, so two nodes may share one (a chance of
/// about n^2 / 2^33 for n nodes). Such a peer gets no FDB entry: its traffic would go to the
/// other node.
pub fn mac_clashes(
    local: IpAddr,
    peers: impl IntoIterator<Item = IpAddr>,
) -> std::collections::BTreeMap<IpAddr, String> {
    let mut seen = std::collections::BTreeMap::from([(vtep_mac(local), local)]);
    let mut sorted: Vec<IpAddr> = peers.into_iter().collect();
    sorted.sort();
    let mut clashes = std::collections::BTreeMap::new();
    for p in sorted {
        let mac = vtep_mac(p);
        match seen.get(&mac) {
            Some(other) if *other != p => {
                clashes.insert(
                    p,
                    format!("tunnel: node {p}'s VTEP MAC is node {other}'s too (its address's hash); not tunnelled"),
                );
            }
            _ => {
                seen.insert(mac, p);
            }
        }
    }
    clashes
}

/// Whether `ip` is of the form `gateway6` gives.
fn is_gateway6(ip: &Ipv6Addr) -> bool {
    let s = ip.segments();
    s[..4] == [0xfe80, 0, 0, 0] && (s[4] == 0xc1 || s[4] == 0xc6) && s[5] == 0
}

type Result<T> = std::result::Result<T, NetdevError>;

fn local_of(link: &LinkMessage) -> Option<IpAddr> {
    use rtnetlink::packet_route::link::{InfoData, InfoVxlan, LinkAttribute, LinkInfo};
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
            LinkInfo::Data(InfoData::Vxlan(v)) => v.iter().find_map(|x| match x {
                InfoVxlan::Local(ip) => Some(IpAddr::V4(*ip)),
                InfoVxlan::Local6(ip) => Some(IpAddr::V6(*ip)),
                _ => None,
            }),
            _ => None,
        }),
        _ => None,
    })
}

/// The agent's vxlan device with `local` as its source address and MTU `mtu`, created (or
/// re-created when its local address changed). Returns its index. A device of that name
/// marked by another agent is an error.
pub async fn ensure_device(h: &Handle, local: IpAddr, mtu: u32, mark: &str) -> Result<u32> {
    if let Some(link) = link_by_name(h, VXLAN_DEVICE).await? {
        // Unmarked: this agent crashed between creating and marking it (as for veths).
        if !owned(alias(&link), mark) {
            return Err(NetdevError::Invalid(format!(
                "device {VXLAN_DEVICE} exists and is another agent's (alias {:?})",
                alias(&link)
            )));
        }
        if local_of(&link) == Some(local) {
            set_link(
                h,
                LinkUnspec::new_with_index(link.header.index)
                    .mtu(mtu)
                    .alias(mark.to_string())
                    .up()
                    .build(),
                format!("set {VXLAN_DEVICE} up"),
            )
            .await?;
            return Ok(link.header.index);
        }
        h.link()
            .del(link.header.index)
            .execute()
            .await
            .map_err(nl_err(format!(
                "delete {VXLAN_DEVICE} (its local address changed)"
            )))?;
    }
    let device = LinkVxlan::new(VXLAN_DEVICE, VXLAN_VNI).port(VXLAN_PORT);
    let device = match local {
        IpAddr::V4(v4) => device.local(v4),
        IpAddr::V6(v6) => device.local6(v6),
    };
    h.link()
        .add(
            device
                .learning(false)
                .address(vtep_mac(local).to_vec())
                .mtu(mtu)
                .up()
                .build(),
        )
        .execute()
        .await
        .map_err(nl_err(format!(
            "create {VXLAN_DEVICE} (vxlan {VXLAN_VNI}, local {local})"
        )))?;
    let link = link_by_name(h, VXLAN_DEVICE)
        .await?
        .ok_or_else(|| NetdevError::Invalid(format!("{VXLAN_DEVICE} vanished")))?;
    // Marked at once: the kernel ignores an alias in the creating request.
    set_link(
        h,
        LinkUnspec::new_with_index(link.header.index)
            .alias(mark.to_string())
            .build(),
        format!("mark {VXLAN_DEVICE}"),
    )
    .await?;
    Ok(link.header.index)
}

/// The FDB entry (the peer's MAC is reached at its underlay address) and the neighbours of
/// one remote node on the device: its IPv4 address (an IPv4 underlay: the next hop of its IPv4
/// pod CIDRs) and, with `ipv6` (it has IPv6 pod CIDRs), its IPv6 next hop (`gateway6`).
pub async fn set_peer(h: &Handle, ifindex: u32, peer: IpAddr, ipv6: bool) -> Result<()> {
    let mac = vtep_mac(peer);
    h.neighbours()
        .add_bridge(ifindex, &mac)
        .flags(NeighbourFlags::Own)
        .state(NeighbourState::Permanent)
        .destination(peer)
        .replace()
        .execute()
        .await
        .map_err(nl_err(format!("fdb {VXLAN_DEVICE} -> {peer}")))?;
    let mut next_hops: Vec<IpAddr> = Vec::new();
    if peer.is_ipv4() {
        next_hops.push(peer);
    }
    if ipv6 {
        next_hops.push(IpAddr::V6(gateway6(peer)));
    }
    for hop in next_hops {
        let step = format!("neighbour {hop} on {VXLAN_DEVICE}");
        permanent_neighbour(h, ifindex, hop, &mac, step).await?;
    }
    Ok(())
}

/// Removes the device's neighbours and FDB entries of nodes no longer wanted (the device is
/// this agent's, so all of its entries are).
pub async fn prune_peers(h: &Handle, ifindex: u32, keep: &[IpAddr]) -> Result<()> {
    let mut stale = Vec::new();
    let keep6: Vec<Ipv6Addr> = keep.iter().map(|k| gateway6(*k)).collect();
    for family in [
        AddressFamily::Inet,
        AddressFamily::Inet6,
        AddressFamily::Bridge,
    ] {
        let mut s = h.neighbours().get().set_address_family(family).execute();
        while let Some(m) = s.try_next().await.map_err(nl_err("dump neighbours"))? {
            if m.header.ifindex != ifindex {
                continue;
            }
            let stale_entry = m.attributes.iter().any(|a| match a {
                NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)) => {
                    !keep.contains(&IpAddr::V4(*ip))
                }
                // An FDB entry: its destination (a node's underlay address) comes as bytes.
                NeighbourAttribute::Destination(NeighbourAddress::Other(b)) => {
                    fdb_destination(b).is_some_and(|ip| !keep.contains(&ip))
                }
                // Only next hops of ours (`gateway6`): the kernel's own IPv6 entries stay.
                NeighbourAttribute::Destination(NeighbourAddress::Inet6(ip)) => {
                    is_gateway6(ip) && !keep6.contains(ip)
                }
                _ => false,
            });
            // Bridge entries without a destination are the device's own.
            if stale_entry {
                stale.push(m);
            }
        }
    }
    for m in stale {
        if let Err(e) = h.neighbours().del(m).execute().await {
            tracing::warn!(error = %e, "stale tunnel neighbour not removed");
        }
    }
    Ok(())
}

/// The address of an FDB entry's destination, which the bridge family dumps as bytes.
fn fdb_destination(b: &[u8]) -> Option<IpAddr> {
    match b.len() {
        4 => <[u8; 4]>::try_from(b).ok().map(IpAddr::from),
        16 => <[u8; 16]>::try_from(b).ok().map(IpAddr::from),
        _ => None,
    }
}

/// Native mode after tunnel mode: this agent's tunnel device (marked by it) is deleted, and its
/// routes with it, so the reconciler installs native routes in their place. Returns whether
/// there was one.
pub fn retire_device(mark: &str) -> Result<bool> {
    use crate::datapath::netdev::{delete_owned_interface, marked_interfaces, Reclaimed};
    if !marked_interfaces(mark)?.iter().any(|n| n == VXLAN_DEVICE) {
        return Ok(false);
    }
    Ok(delete_owned_interface(VXLAN_DEVICE, mark)? == Reclaimed::Deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn vtep_macs_are_local_unicast_and_follow_the_node_address() {
        let m = vtep_mac(Ipv4Addr::new(172, 20, 0, 12));
        assert_eq!(m, [0x02, 0xc1, 172, 20, 0, 12]);
        assert_eq!(m[0] & 0x01, 0, "unicast");
        assert_eq!(m[0] & 0x02, 0x02, "locally administered");
        assert_ne!(m, vtep_mac(Ipv4Addr::new(172, 20, 0, 13)));
    }

    #[test]
    fn a_nodes_ipv6_next_hop_is_link_local_and_recognised_as_ours() {
        let g = gateway6(Ipv4Addr::new(172, 20, 0, 12));
        assert_eq!(g.to_string(), "fe80::c1:0:ac14:c");
        assert!(g.is_unicast_link_local());
        assert!(is_gateway6(&g));
        assert_ne!(g, gateway6(Ipv4Addr::new(172, 20, 0, 13)));
        // The kernel's own entries on the device (a router's, a multicast group's) are not.
        for other in ["fe80::1", "fe80::c1:1:ac14:c", "ff02::1"] {
            assert!(!is_gateway6(&other.parse().unwrap()), "{other}");
        }
    }

    /// An IPv6 underlay: a node's MAC and IPv6 next hop follow a hash of its IPv6 address,
    /// marked `c6`, distinct per node and recognised as ours.
    #[test]
    fn ipv6_underlay_nodes_get_their_own_mac_and_next_hop() {
        let (a, b): (Ipv6Addr, Ipv6Addr) =
            ("fd00:20::b".parse().unwrap(), "fd00:21::b".parse().unwrap());
        let (ma, mb) = (vtep_mac(a), vtep_mac(b));
        assert_eq!(ma[..2], [0x02, 0xc6]);
        assert_ne!(ma, mb, "nodes whose addresses share their last bytes");
        assert_eq!(ma, vtep_mac(a), "the same on every node");
        let (ga, gb) = (gateway6(a), gateway6(b));
        assert!(ga.is_unicast_link_local() && is_gateway6(&ga) && is_gateway6(&gb));
        assert_eq!(ga.segments()[4], 0xc6);
        assert_ne!(ga, gb);
        assert_ne!(ga, gateway6(Ipv4Addr::new(172, 20, 0, 12)));
        assert_eq!(overhead(crate::network::UnderlayProtocol::Ipv6), 70);
    }

    #[test]
    fn peers_whose_mac_clashes_are_named_and_left_out() {
        let local: IpAddr = "fd00:20::b".parse().unwrap();
        let peers: Vec<IpAddr> = ["fd00:20::c", "fd00:20::d"]
            .iter()
            .map(|p| p.parse().unwrap())
            .collect();
        assert!(mac_clashes(local, peers.clone()).is_empty());
        // Two addresses whose hashes collide (found by a birthday search over fd00::/64), as
        // any cluster of enough IPv6 nodes will have.
        let a: IpAddr = "fd00::a1bf:b3a3:ec1a:8b5".parse().unwrap();
        let b: IpAddr = "fd00::6be3:6a30:ec59:3aae".parse().unwrap();
        assert_eq!(vtep_mac(a), vtep_mac(b), "the pair collides");
        let clashes = mac_clashes(local, [a, b]);
        assert_eq!(clashes.keys().copied().collect::<Vec<_>>(), [a.max(b)]);
        assert!(clashes[&a.max(b)].contains(&a.min(b).to_string()));
        // With this node's own MAC.
        let clashes = mac_clashes(a, [b]);
        assert!(clashes.contains_key(&b), "{clashes:?}");
    }

    #[test]
    fn fdb_destinations_are_read_from_their_bytes() {
        assert_eq!(
            fdb_destination(&[172, 20, 0, 12]),
            Some(IpAddr::V4(Ipv4Addr::new(172, 20, 0, 12)))
        );
        let v6: Ipv6Addr = "fd00:20::c".parse().unwrap();
        assert_eq!(fdb_destination(&v6.octets()), Some(IpAddr::V6(v6)));
        assert_eq!(fdb_destination(&[1, 2, 3]), None);
    }
}
