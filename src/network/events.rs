//! Kernel events that can take this agent's routes away. A link going down flushes every
//! route through it, and coming back up restores none of them; a route of ours can be deleted
//! by hand. The reconciler used to notice only at its next periodic pass (10 s), so a 5 s link
//! flap cut cross-node traffic for up to 15 s. With these events it resyncs at once.
//!
//! A thread reads rtnetlink's multicast groups (links, addresses, IPv4 routes) in the
//! agent's own network namespace and wakes the reconciler for what matters: a link other than
//! a pod's veth changing, an address coming or going (the native devices' addresses are the
//! node's), a route of ciliate's protocol
//! deleted, a connected (kernel) route appearing (the link's subnet is back, so routes via a
//! gateway on it can be added again). Pod veths come and go with every pod: they wake nothing.

use std::sync::Arc;

use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::address::AddressScope;
use rtnetlink::packet_route::link::LinkAttribute;
use rtnetlink::packet_route::route::RouteProtocol;
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use super::netlink::RTPROT_CILIATE;

/// rtnetlink multicast groups (`RTMGRP_*` of linux/rtnetlink.h).
const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;

/// The host side of a pod's veth (`datapath::netdev`): its events are no route's business.
const POD_VETH_PREFIX: &str = "lxc";

/// Whether a kernel event can have changed what the reconciler must write.
pub fn matters(m: &RouteNetlinkMessage) -> bool {
    match m {
        RouteNetlinkMessage::NewLink(l) | RouteNetlinkMessage::DelLink(l) => !l
            .attributes
            .iter()
            .any(|a| matches!(a, LinkAttribute::IfName(n) if n.starts_with(POD_VETH_PREFIX))),
        // Both families: a native device's addresses are the node's (`devices`). Not IPv6
        // link-local ones: every pod's veth gets one as it comes up.
        RouteNetlinkMessage::NewAddress(a) | RouteNetlinkMessage::DelAddress(a) => {
            a.header.family == AddressFamily::Inet || a.header.scope != AddressScope::Link
        }
        RouteNetlinkMessage::DelRoute(r) => {
            r.header.protocol == RouteProtocol::Other(RTPROT_CILIATE)
        }
        RouteNetlinkMessage::NewRoute(r) => {
            r.header.protocol == RouteProtocol::Kernel
                && r.header.address_family == AddressFamily::Inet
        }
        _ => false,
    }
}

/// Whether any message in one datagram of the groups matters.
fn any_matters(datagram: &[u8]) -> bool {
    let mut rest = datagram;
    while !rest.is_empty() {
        let Ok(msg) = NetlinkMessage::<RouteNetlinkMessage>::deserialize(rest) else {
            return true; // unreadable: resync rather than miss something
        };
        if let NetlinkPayload::InnerMessage(m) = &msg.payload {
            if matters(m) {
                return true;
            }
        }
        let len = (msg.header.length as usize + 3) & !3;
        if len == 0 || len >= rest.len() {
            break;
        }
        rest = &rest[len..];
    }
    false
}

/// Wakes `kick` for every event that matters, from a thread of its own, for the life of the
/// process. The socket is opened here, in the caller's network namespace.
pub fn watch(kick: Arc<tokio::sync::Notify>) -> std::io::Result<()> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind(&SocketAddr::new(
        0,
        RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR | RTMGRP_IPV4_ROUTE,
    ))?;
    std::thread::Builder::new()
        .name("route-events".into())
        .spawn(move || {
            let mut buf = vec![0u8; 1 << 16];
            loop {
                match socket.recv(&mut &mut buf[..], 0) {
                    Ok(n) if any_matters(&buf[..n]) => kick.notify_one(),
                    Ok(_) => {}
                    // ENOBUFS: events were lost; resync.
                    Err(e) if e.raw_os_error() == Some(nix::libc::ENOBUFS) => kick.notify_one(),
                    Err(e) => {
                        tracing::warn!(error = %e, "route events stopped; routes resync every 10 s");
                        return;
                    }
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtnetlink::packet_route::address::AddressMessage;
    use rtnetlink::packet_route::link::LinkMessage;
    use rtnetlink::packet_route::route::RouteMessage;

    fn link(name: &str) -> RouteNetlinkMessage {
        let mut l = LinkMessage::default();
        l.attributes.push(LinkAttribute::IfName(name.into()));
        RouteNetlinkMessage::NewLink(l)
    }

    fn route(protocol: RouteProtocol, new: bool) -> RouteNetlinkMessage {
        let mut r = RouteMessage::default();
        r.header.protocol = protocol;
        r.header.address_family = AddressFamily::Inet;
        if new {
            RouteNetlinkMessage::NewRoute(r)
        } else {
            RouteNetlinkMessage::DelRoute(r)
        }
    }

    #[test]
    fn node_links_addresses_our_routes_and_connected_routes_wake_the_reconciler_pod_veths_do_not() {
        assert!(matters(&link("eth0")));
        assert!(!matters(&link("lxc1a2b3c")));
        let mut a = AddressMessage::default();
        a.header.family = AddressFamily::Inet;
        assert!(matters(&RouteNetlinkMessage::NewAddress(a.clone())));
        a.header.family = AddressFamily::Inet6;
        assert!(matters(&RouteNetlinkMessage::DelAddress(a.clone())));
        a.header.scope = AddressScope::Link;
        assert!(!matters(&RouteNetlinkMessage::NewAddress(a)));
        assert!(matters(&route(RouteProtocol::Other(RTPROT_CILIATE), false)));
        assert!(!matters(&route(RouteProtocol::Static, false)));
        assert!(matters(&route(RouteProtocol::Kernel, true)));
        assert!(!matters(&route(RouteProtocol::Other(RTPROT_CILIATE), true)));
    }
}
