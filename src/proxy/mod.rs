//! The proxies: what DNS-aware policy ([`dns`]) and L7 HTTP policy have in common.
//!
//! One idea: the datapath redirects an allowed flow of an endpoint to a local transparent
//! socket without changing its addresses (`bpf/lib/proxy.h`: `bpf_sk_assign` and a mark that
//! policy routing delivers locally), a proxy process judges each message against the
//! endpoint's rules (pushed by the agent, kept on disk so it judges while the agent is away),
//! and forwards what is allowed as the pod. The peer's identity comes from the pinned ipcache,
//! as the datapath sees it. Each proxy is a process of its own that outlives agent restarts.

pub mod applied;
pub mod dns;
pub mod http;
pub mod kept;

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

use libbpf_rs::{MapCore, MapFlags, MapHandle};
use socket2::{Domain, Protocol, Socket, Type};

/// Priority of the proxies' routing rules (Cilium's proxy rules use 9 too: before `main`).
const RULE_PRIORITY: u32 = 9;

/// The pinned ipcache, read for the identity of a peer (a DNS server, an HTTP client or
/// server) as the datapath sees it.
pub struct Ipcache {
    hosts: MapHandle,
    prefixes: MapHandle,
}

impl Ipcache {
    pub fn open(pins: &Path) -> Result<Ipcache, String> {
        let open = |name: &str| {
            MapHandle::from_pinned_path(pins.join(name))
                .map_err(|e| format!("open pinned map {}: {e}", pins.join(name).display()))
        };
        Ok(Ipcache {
            hosts: open("ipcache_hosts")?,
            prefixes: open("ipcache")?,
        })
    }

    /// The identity of `ip` as the datapath sees it (world when unknown).
    pub fn identity(&self, ip: IpAddr) -> u32 {
        let (family, addr, bits, world) = match ip {
            IpAddr::V4(a) => {
                let mut b = [0u8; 16];
                b[..4].copy_from_slice(&a.octets());
                (4u32, b, 32u32, 9)
            }
            IpAddr::V6(a) => (6u32, a.octets(), 128u32, 10),
        };
        let mut host = family.to_ne_bytes().to_vec();
        host.extend_from_slice(&addr);
        let read = |v: Vec<u8>| u32::from_ne_bytes([v[0], v[1], v[2], v[3]]);
        if let Ok(Some(v)) = self.hosts.lookup(&host, MapFlags::ANY) {
            return read(v);
        }
        let mut lpm = (32 + bits).to_ne_bytes().to_vec();
        lpm.extend_from_slice(&host);
        match self.prefixes.lookup(&lpm, MapFlags::ANY) {
            Ok(Some(v)) => read(v),
            _ => world,
        }
    }
}

/// A mutex's guard, also after a panic elsewhere poisoned it: the proxies' state stays usable
/// (each critical section leaves it consistent).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Adds (or removes) the rule and local routes that deliver packets marked `mark` to this
/// host (the proxy's transparent sockets): `fwmark M lookup M`, with `local default dev lo`
/// in table M, for both families.
pub fn local_delivery(mark: u32, add: bool) -> Result<(), String> {
    use rtnetlink::packet_route::route::{RouteScope, RouteType};
    use rtnetlink::packet_route::rule::RuleAction;
    use rtnetlink::RouteMessageBuilder;
    let lo = nix::net::if_::if_nametoindex("lo").map_err(|e| format!("find lo: {e}"))?;
    crate::datapath::netdev::with_netlink(None, move |h| async move {
        let nl = |what: &'static str| {
            move |e: rtnetlink::Error| crate::datapath::netdev::NetdevError::Netlink {
                step: what.into(),
                message: e.to_string(),
            }
        };
        let v4 = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(Ipv4Addr::UNSPECIFIED, 0)
            .output_interface(lo)
            .table_id(mark)
            .kind(RouteType::Local)
            .scope(RouteScope::Host)
            .build();
        let v6 = RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(Ipv6Addr::UNSPECIFIED, 0)
            .output_interface(lo)
            .table_id(mark)
            .kind(RouteType::Local)
            .scope(RouteScope::Host)
            .build();
        let mut r4 = h
            .rule()
            .add()
            .v4()
            .fw_mark(mark)
            .table_id(mark)
            .priority(RULE_PRIORITY);
        r4 = r4.action(RuleAction::ToTable);
        let mut r6 = h
            .rule()
            .add()
            .v6()
            .fw_mark(mark)
            .table_id(mark)
            .priority(RULE_PRIORITY);
        r6 = r6.action(RuleAction::ToTable);
        if add {
            r4.replace()
                .execute()
                .await
                .map_err(nl("add the proxy rule (IPv4)"))?;
            h.route()
                .add(v4)
                .replace()
                .execute()
                .await
                .map_err(nl("add the proxy route (IPv4)"))?;
            // A host without IPv6 has no IPv6 traffic to intercept.
            if r6.replace().execute().await.is_ok() {
                let _ = h.route().add(v6).replace().execute().await;
            }
        } else {
            let _ = h.rule().del(r4.message_mut().clone()).execute().await;
            let _ = h.rule().del(r6.message_mut().clone()).execute().await;
            let _ = h.route().del(v4).execute().await;
            let _ = h.route().del(v6).execute().await;
        }
        Ok(())
    })
    .map_err(|e| e.to_string())
}

/// `IPV6_TRANSPARENT`: neither nix nor socket2 wraps it.
pub fn ipv6_transparent(s: &Socket) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let on: nix::libc::c_int = 1;
    // SAFETY: a valid socket descriptor and a c_int option value of the size passed.
    let rc = unsafe {
        nix::libc::setsockopt(
            s.as_raw_fd(),
            nix::libc::SOL_IPV6,
            nix::libc::IPV6_TRANSPARENT,
            (&on as *const nix::libc::c_int).cast(),
            std::mem::size_of::<nix::libc::c_int>() as nix::libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A non-blocking socket bound to `addr` with `IP_TRANSPARENT` (and `IPV6_TRANSPARENT`): it
/// receives what the datapath assigns to it whatever the destination address, and may bind
/// addresses that are not this host's.
pub fn transparent_socket(addr: SocketAddr, ty: Type, protocol: Protocol) -> io::Result<Socket> {
    let domain = Domain::for_address(addr);
    let s = Socket::new(domain, ty, Some(protocol))?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
    }
    s.set_reuse_address(true)?;
    s.set_ip_transparent(true)?;
    if addr.is_ipv6() {
        ipv6_transparent(&s)?;
    }
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    Ok(s)
}

/// Transparent sockets on one port for both families (`port` 0: an ephemeral port free in
/// both); IPv4 alone on a host without IPv6.
pub fn bind_both(port: u16, ty: Type, protocol: Protocol) -> io::Result<(Vec<Socket>, u16)> {
    for _ in 0..20 {
        let v4 = transparent_socket((Ipv4Addr::UNSPECIFIED, port).into(), ty, protocol)?;
        let got = v4
            .local_addr()?
            .as_socket()
            .map(|a| a.port())
            .unwrap_or(port);
        match transparent_socket((Ipv6Addr::UNSPECIFIED, got).into(), ty, protocol) {
            Ok(v6) => return Ok((vec![v4, v6], got)),
            // No IPv6 on this host: IPv4 alone.
            Err(e) if e.raw_os_error() == Some(nix::libc::EAFNOSUPPORT) => {
                return Ok((vec![v4], got))
            }
            Err(e) if port != 0 => return Err(e),
            Err(_) => continue, // the ephemeral port is taken for IPv6: another one
        }
    }
    Err(io::Error::other("no port free for both families"))
}
