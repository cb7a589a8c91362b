//! The HTTP proxy's connections to servers, made as the pod.
//!
//! A connection judged at a pod's egress goes on from that pod's address (a transparent
//! socket bound to it), so the destination's ingress policy, flows and logs see the pod, never
//! the node; one judged at a pod's ingress goes on from the client's address. Each carries the
//! proxy's mark (`bpf/ciliate.h`, `l7_proxy_config`): the destination's datapath knows an
//! ingress-judged one is not to be redirected again, and that replies go to this socket.
//! Replies that do not pass the destination's datapath (a server on another node) find the
//! socket through the conntrack entry recorded here for the client endpoint before the SYN
//! leaves.
//!
//! A client's own connections to the same server share its address: the local port is the
//! kernel's choice, redrawn when it is one a redirected client connection to the same server
//! uses (`busy`), so the two never share a tuple.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use libbpf_rs::{MapCore, MapFlags, MapHandle};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpStream;

use crate::datapath::bpf::{conntrack::monotonic_ns, types, Pod};

/// The pinned conntrack tables, where connections to servers that reply around this node's
/// datapath are recorded.
pub struct Conntrack {
    v4: MapHandle,
    v6: MapHandle,
}

impl Conntrack {
    pub fn open(pins: &Path) -> Result<Conntrack, String> {
        let open = |name: &str| {
            MapHandle::from_pinned_path(pins.join(name))
                .map_err(|e| format!("open pinned map {}: {e}", pins.join(name).display()))
        };
        Ok(Conntrack {
            v4: open("conntrack4")?,
            v6: open("conntrack6")?,
        })
    }

    /// Records the connection `from` -> `to` of endpoint `ep` as opened by the pod and made by
    /// the proxy: its replies go to the proxy's socket.
    pub fn record(&self, ep: u32, from: SocketAddr, to: SocketAddr) -> io::Result<()> {
        let value = types::ct_value {
            last_seen_ns: monotonic_ns(),
            egress: 1,
            proxy_upstream: 1,
            ..Default::default()
        };
        let (map, key) = match (from.ip(), to.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => (
                &self.v4,
                types::ct4_key {
                    saddr: s.octets(),
                    daddr: d.octets(),
                    sport: from.port(),
                    dport: to.port(),
                    protocol: 6,
                    endpoint_id: ep,
                    ..Default::default()
                }
                .as_bytes()
                .to_vec(),
            ),
            (IpAddr::V6(s), IpAddr::V6(d)) => (
                &self.v6,
                types::ct6_key {
                    saddr: s.octets(),
                    daddr: d.octets(),
                    sport: from.port(),
                    dport: to.port(),
                    protocol: 6,
                    family: 6,
                    endpoint_id: ep,
                    ..Default::default()
                }
                .as_bytes()
                .to_vec(),
            ),
            _ => return Err(io::Error::other("mixed address families")),
        };
        map.update(&key, value.as_bytes(), MapFlags::ANY)
            .map_err(|e| io::Error::other(format!("record the connection: {e}")))
    }
}

/// How to make one upstream connection.
pub struct Upstream<'a> {
    /// The address to connect from (`None`: the node's own, for peers outside the cluster).
    pub from: Option<IpAddr>,
    pub to: SocketAddr,
    pub mark: u32,
    /// Record it in the conntrack of this endpoint (a connection judged at its egress).
    pub record: Option<(&'a Conntrack, u32)>,
    /// Local ports a redirected client connection to the same server uses.
    pub busy: &'a (dyn Fn(u16) -> bool + Sync),
}

/// Connects as [`Upstream`] says.
pub async fn connect(u: Upstream<'_>) -> io::Result<TcpStream> {
    for _ in 0..8 {
        let s = Socket::new(Domain::for_address(u.to), Type::STREAM, Some(Protocol::TCP))?;
        s.set_mark(u.mark)?;
        s.set_nodelay(true)?;
        let local = match u.from {
            Some(ip) => {
                s.set_ip_transparent(true)?;
                if ip.is_ipv6() {
                    crate::proxy::ipv6_transparent(&s)?;
                }
                s.bind(&SocketAddr::new(ip, 0).into())?;
                let local = s
                    .local_addr()?
                    .as_socket()
                    .ok_or_else(|| io::Error::other("no local address"))?;
                if (u.busy)(local.port()) {
                    continue; // a client connection's tuple: draw another port
                }
                Some(local)
            }
            None => None,
        };
        if let (Some((ct, ep)), Some(local)) = (u.record, local) {
            ct.record(ep, local, u.to)?;
        }
        s.set_nonblocking(true)?;
        let socket = tokio::net::TcpSocket::from_std_stream(s.into());
        return socket.connect(u.to).await;
    }
    Err(io::Error::other(
        "no free local port for the client's address",
    ))
}
