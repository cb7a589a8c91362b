//! Applies the desired routes to the kernel over rtnetlink, in the agent's own network
//! namespace. Ownership: every route the agent installs carries `rtm_protocol` =
//! `RTPROT_CILIATE`, and the destinations it owns are recorded in `STATE_DIR/routes.json`
//! *before* it adds them. Only a route with that protocol whose destination is in this agent's
//! record is ever changed or removed, so a restart removes what it left behind (no leak), finds
//! what it installed (no duplicate), and another agent's routes (same protocol, not in this
//! record) or anyone else's (other protocol) are never touched.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use futures_util::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteVia,
};
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::{Handle, RouteMessageBuilder};

use super::routes::NodeRoute;
use crate::datapath::netdev::{nl_err, with_netlink, NetdevError};

/// The `rtm_protocol` of every route a ciliate agent installs (unassigned in rt_protocols).
pub const RTPROT_CILIATE: u8 = 193;
/// The record of owned destinations, in the state directory.
pub const RECORD_FILE: &str = "routes.json";

#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Record {
    /// Destinations as CIDR text (ipnet has no serde here).
    routes: BTreeSet<String>,
}

/// The outcome per desired route: installed, or why not.
pub type Outcome = BTreeMap<NodeRoute, Result<(), String>>;

/// The routes this agent owns, and the record that proves it across restarts.
#[derive(Debug)]
pub struct RouteApplier {
    record: PathBuf,
    owned: BTreeSet<IpNet>,
    /// Forwarding turned on: IPv4's, and IPv6's too (once a wanted route is IPv6).
    forwarding_checked: (bool, bool),
    /// Tunnel mode: the mark (alias) of this agent's vxlan device, and its MTU.
    tunnel: Option<(String, u32)>,
    /// Tunnel mode: the index of this agent's vxlan device as the last pass set it up.
    tunnel_ifindex: Option<u32>,
}

impl RouteApplier {
    /// Reads the record in `state_root` (none yet: nothing owned). An unreadable record is an
    /// error: guessing would either leak routes or take another agent's.
    pub fn open(state_root: &Path) -> Result<RouteApplier, String> {
        Self::open_with(state_root, None)
    }

    /// Tunnel mode: this agent's own vxlan device, as the last `apply` found or made it.
    pub fn tunnel_ifindex(&self) -> Option<u32> {
        self.tunnel_ifindex
    }

    /// Like `open`, for tunnel mode when `tunnel` is `(device mark, device MTU)`.
    pub fn open_with(
        state_root: &Path,
        tunnel: Option<(String, u32)>,
    ) -> Result<RouteApplier, String> {
        let record = state_root.join(RECORD_FILE);
        let owned = match std::fs::read(&record) {
            Ok(bytes) => serde_json::from_slice::<Record>(&bytes)
                .map_err(|e| format!("{}: {e}", record.display()))?
                .routes
                .iter()
                .map(|c| {
                    c.parse::<IpNet>()
                        .map_err(|_| format!("{}: routes: {c:?} is not a CIDR", record.display()))
                })
                .collect::<Result<_, _>>()?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeSet::new(),
            Err(e) => return Err(format!("{}: {e}", record.display())),
        };
        Ok(RouteApplier {
            record,
            owned,
            forwarding_checked: (false, false),
            tunnel,
            tunnel_ifindex: None,
        })
    }

    /// Destinations this agent owns (installed, or about to be).
    pub fn owned(&self) -> &BTreeSet<IpNet> {
        &self.owned
    }

    fn save(&mut self, owned: BTreeSet<IpNet>) -> Result<(), String> {
        if owned == self.owned && self.record.exists() {
            return Ok(());
        }
        let text = serde_json::to_vec_pretty(&Record {
            routes: owned.iter().map(|n| n.to_string()).collect(),
        })
        .map_err(|e| e.to_string())?;
        let tmp = self.record.with_extension("json.tmp");
        std::fs::write(&tmp, text)
            .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
            .and_then(|_| std::fs::rename(&tmp, &self.record))
            .map_err(|e| format!("{}: {e}", self.record.display()))?;
        self.owned = owned;
        Ok(())
    }

    /// Makes the kernel's main table hold exactly `want` among this agent's routes (in tunnel
    /// mode through the vxlan device, whose source address is `local`, this node's). Blocks.
    pub fn apply(&mut self, want: &BTreeSet<NodeRoute>, local: Option<IpAddr>) -> Outcome {
        let fail_all =
            |e: String| -> Outcome { want.iter().map(|r| (*r, Err(e.clone()))).collect() };
        let ipv6 = want.iter().any(|r| r.dst.addr().is_ipv6());
        if !want.is_empty() && self.forwarding_checked != (true, ipv6 || self.forwarding_checked.1)
        {
            // Pods' packets to other nodes are forwarded by this node.
            match enable_forwarding(ipv6) {
                Ok(()) => self.forwarding_checked = (true, ipv6 || self.forwarding_checked.1),
                Err(e) => return fail_all(e),
            }
        }
        let tunnel =
            match (&self.tunnel, local) {
                (None, _) => None,
                (Some(_), _) if want.is_empty() => None,
                (Some(_), None) => return fail_all(
                    "tunnel: this node's Node object has no address of the underlay's family yet"
                        .into(),
                ),
                (Some((mark, mtu)), Some(local)) => match setup_tunnel(local, *mtu, mark.clone()) {
                    Ok(i) => Some(i),
                    Err(e) => {
                        self.tunnel_ifindex = None;
                        return fail_all(format!("tunnel: {e}"));
                    }
                },
            };
        let previous = std::mem::replace(&mut self.tunnel_ifindex, tunnel);
        if let (true, None, Some(ifindex)) = (want.is_empty(), tunnel, previous) {
            // The last other node left: its FDB and neighbour entries go too.
            let pruned = with_netlink(None, move |h| async move {
                super::tunnel::prune_peers(&h, ifindex, &[]).await
            });
            if let Err(e) = pruned {
                tracing::warn!(error = %e, "the tunnel's entries of the last node were not removed");
            }
        }
        let kernel = match list_own_protocol_oif() {
            Ok(k) => k,
            Err(e) => return fail_all(format!("list routes: {e}")),
        };
        let mut outcome = Outcome::new();
        let mut to_set = Vec::new();
        for r in want {
            match kernel.get(&r.dst) {
                Some((gw, _)) if !self.owned.contains(&r.dst) => {
                    let gw = gw.map(|g| g.to_string()).unwrap_or_else(|| "-".into());
                    outcome.insert(
                        *r,
                        Err(format!(
                            "route {} via {gw} belongs to another ciliate agent",
                            r.dst
                        )),
                    );
                }
                // Up to date: same gateway, and through the tunnel exactly in tunnel mode.
                Some((Some(gw), oif))
                    if *gw == next_hop(r, tunnel.is_some()) && tunnel.is_none_or(|t| t == *oif) =>
                {
                    outcome.insert(*r, Ok(()));
                }
                Some(_) => to_set.push((*r, true)),
                None => to_set.push((*r, false)),
            }
        }
        let stale: Vec<IpNet> = self
            .owned
            .iter()
            .filter(|d| !want.iter().any(|r| r.dst == **d))
            .copied()
            .collect();
        // The intent first: a crash after the add still finds the route recorded.
        let before = self.owned.clone();
        let mut intent = self.owned.clone();
        intent.extend(to_set.iter().map(|(r, _)| r.dst));
        if let Err(e) = self.save(intent) {
            for (r, _) in &to_set {
                outcome.insert(*r, Err(format!("record: {e}")));
            }
            return outcome;
        }
        let stale_present: Vec<IpNet> = stale
            .iter()
            .filter(|d| kernel.contains_key(d))
            .copied()
            .collect();
        // Tunnel mode: the peers are the routes' underlay addresses, each with whether an IPv6
        // pod CIDR goes through it.
        let mut peers: BTreeMap<IpAddr, bool> = BTreeMap::new();
        if tunnel.is_some() {
            for r in want {
                *peers.entry(r.via).or_default() |= r.dst.addr().is_ipv6();
            }
        }
        // An IPv6 underlay's VTEP MACs are hashes: a peer sharing one gets no entries.
        let clashes = match (tunnel, local) {
            (Some(_), Some(l)) => super::tunnel::mac_clashes(l, peers.keys().copied()),
            _ => BTreeMap::new(),
        };
        peers.retain(|p, _| !clashes.contains_key(p));
        let changes = run_changes(
            to_set.clone(),
            stale_present.clone(),
            tunnel,
            peers,
            clashes,
        );
        let (results, removed) = match changes {
            Ok(v) => v,
            Err(e) => {
                for (r, _) in &to_set {
                    outcome.insert(*r, Err(e.to_string()));
                }
                return outcome;
            }
        };
        outcome.extend(results);
        for d in &removed {
            tracing::info!(dst = %d, "route to a removed node's pod CIDR deleted");
        }
        // Owned now: what is wanted and in place, what was ours before (a failed replace leaves
        // it in the kernel), and what could not be removed; a failed add is not ours (the
        // destination may be someone else's).
        let owned: BTreeSet<IpNet> = want
            .iter()
            .filter(|r| outcome.get(r).is_some_and(|o| o.is_ok()) || before.contains(&r.dst))
            .map(|r| r.dst)
            .chain(
                stale_present
                    .iter()
                    .filter(|d| !removed.contains(d))
                    .copied(),
            )
            .collect();
        if let Err(e) = self.save(owned) {
            tracing::error!(error = %e, "route record not updated");
        }
        outcome
    }
}

/// Turns on IPv4 forwarding (and IPv6's, with `ipv6`) in this network namespace, saying so
/// when it was off.
fn enable_forwarding(ipv6: bool) -> Result<(), String> {
    let mut keys = vec!["/proc/sys/net/ipv4/ip_forward"];
    if ipv6 {
        keys.push("/proc/sys/net/ipv6/conf/all/forwarding");
    }
    for key in keys {
        let cur = std::fs::read_to_string(key).map_err(|e| format!("{key}: {e}"))?;
        if cur.trim() != "1" {
            std::fs::write(key, "1").map_err(|e| format!("{key}: {e}"))?;
            tracing::info!(%key, "forwarding enabled in the agent's network namespace: the node forwards pod traffic to other nodes");
        }
    }
    Ok(())
}

fn is_own(h: &RouteHeader) -> bool {
    h.protocol == RouteProtocol::Other(RTPROT_CILIATE) && h.table == RouteHeader::RT_TABLE_MAIN
}

fn dst_and_gateway(m: &RouteMessage) -> Option<(IpNet, Option<IpAddr>)> {
    dst_gateway_oif(m).map(|(d, g, _)| (d, g))
}

/// A route's destination (of its family: the default route when it has none), gateway and
/// output interface.
fn dst_gateway_oif(m: &RouteMessage) -> Option<(IpNet, Option<IpAddr>, u32)> {
    let mut dst = match m.header.address_family {
        AddressFamily::Inet => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        AddressFamily::Inet6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => return None,
    };
    let mut gw = None;
    let mut oif = 0;
    for a in &m.attributes {
        match a {
            RouteAttribute::Destination(RouteAddress::Inet(d)) => dst = IpAddr::V4(*d),
            RouteAttribute::Destination(RouteAddress::Inet6(d)) => dst = IpAddr::V6(*d),
            RouteAttribute::Gateway(RouteAddress::Inet(g)) => gw = Some(IpAddr::V4(*g)),
            RouteAttribute::Gateway(RouteAddress::Inet6(g)) => gw = Some(IpAddr::V6(*g)),
            RouteAttribute::Via(RouteVia::Inet(g)) => gw = Some(IpAddr::V4(*g)),
            RouteAttribute::Via(RouteVia::Inet6(g)) => gw = Some(IpAddr::V6(*g)),
            RouteAttribute::Oif(i) => oif = *i,
            _ => {}
        }
    }
    IpNet::new(dst, m.header.destination_prefix_length)
        .ok()
        .map(|n| (n, gw, oif))
}

/// Like `list_own_protocol`, with each route's output interface.
fn list_own_protocol_oif() -> Result<BTreeMap<IpNet, (Option<IpAddr>, u32)>, NetdevError> {
    with_netlink(None, |h| async move {
        Ok(dump_own(&h)
            .await?
            .iter()
            .filter_map(dst_gateway_oif)
            .map(|(d, g, o)| (d, (g, o)))
            .collect())
    })
}

/// The tunnel device, up, with reverse-path filtering off (decapsulated packets come from
/// remote pods). Returns its index.
fn setup_tunnel(local: IpAddr, mtu: u32, mark: String) -> Result<u32, NetdevError> {
    let index = with_netlink(None, move |h| async move {
        super::tunnel::ensure_device(&h, local, mtu, &mark).await
    })?;
    crate::datapath::netdev::sysctl(
        &format!("net.ipv4.conf.{}.rp_filter", super::tunnel::VXLAN_DEVICE),
        "0",
    )?;
    Ok(index)
}

/// The routes of both families with ciliate's protocol in the main table (IPv4's alone on a
/// kernel booted without IPv6, which has no IPv6 table to dump).
async fn dump_own(h: &Handle) -> Result<Vec<RouteMessage>, NetdevError> {
    let mut out = Vec::new();
    let mut dumps = vec![(
        "dump IPv4 routes",
        RouteMessageBuilder::<Ipv4Addr>::new().build(),
    )];
    if Path::new("/proc/sys/net/ipv6").exists() {
        dumps.push((
            "dump IPv6 routes",
            RouteMessageBuilder::<Ipv6Addr>::new().build(),
        ));
    }
    for (what, filter) in dumps {
        let mut s = h.route().get(filter).execute();
        while let Some(m) = s.try_next().await.map_err(nl_err(what))? {
            if is_own(&m.header) {
                out.push(m);
            }
        }
    }
    Ok(out)
}

/// The routes (both families) of the main table with ciliate's protocol: destination ->
/// gateway.
pub fn list_own_protocol() -> Result<BTreeMap<IpNet, Option<IpAddr>>, NetdevError> {
    Ok(list_own_protocol_all()?.into_iter().collect())
}

/// Every route (both families) of the main table with ciliate's protocol, duplicates included
/// (for tests and diagnostics): (destination, gateway).
pub fn list_own_protocol_all() -> Result<Vec<(IpNet, Option<IpAddr>)>, NetdevError> {
    with_netlink(None, |h| async move {
        Ok(dump_own(&h)
            .await?
            .iter()
            .filter_map(dst_and_gateway)
            .collect())
    })
}

type Changes = (Vec<(NodeRoute, Result<(), String>)>, Vec<IpNet>);

/// Adds (or, for an owned route whose gateway changed, replaces) routes and deletes stale ones.
/// In tunnel mode (`tunnel` is the device's index) the FDB and neighbour entries of every
/// wanted node (`peers`) are written first and those of other nodes removed; routes via a
/// node of `clashes` fail with its reason.
fn run_changes(
    set: Vec<(NodeRoute, bool)>,
    delete: Vec<IpNet>,
    tunnel: Option<u32>,
    peers: BTreeMap<IpAddr, bool>,
    clashes: BTreeMap<IpAddr, String>,
) -> Result<Changes, NetdevError> {
    with_netlink(None, move |h| async move {
        let mut results = Vec::new();
        let mut peer_errors = clashes;
        if let Some(ifindex) = tunnel {
            for (p, ipv6) in &peers {
                if let Err(e) = super::tunnel::set_peer(&h, ifindex, *p, *ipv6).await {
                    peer_errors.insert(*p, e.to_string());
                }
            }
            let keep: Vec<IpAddr> = peers.keys().copied().collect();
            super::tunnel::prune_peers(&h, ifindex, &keep).await?;
        }
        for (r, replace) in set {
            if let Some(e) = peer_errors.get(&r.via) {
                results.push((r, Err(e.clone())));
                continue;
            }
            if tunnel.is_some() && r.dst.addr().is_ipv4() && r.via.is_ipv6() {
                let e = format!(
                    "route {} via {}: an IPv4 pod CIDR cannot go through the IPv6 underlay",
                    r.dst, r.via
                );
                results.push((r, Err(e)));
                continue;
            }
            let b = match route_to(r.dst, Some(next_hop(&r, tunnel.is_some()))) {
                Ok(b) => b,
                Err(e) => {
                    results.push((r, Err(format!("route {} via {}: {e}", r.dst, r.via))));
                    continue;
                }
            };
            let msg = match tunnel {
                Some(ifindex) => b.output_interface(ifindex).onlink().build(),
                None => b.build(),
            };
            let req = h.route().add(msg);
            // Never `replace` a destination ciliate does not own: another route there (a static
            // one, say) makes the add fail with EEXIST, and that is reported.
            let req = if replace { req.replace() } else { req };
            let res = req
                .execute()
                .await
                .map_err(|e| format!("route {} via {}: {e}", r.dst, r.via));
            if res.is_ok() {
                tracing::info!(dst = %r.dst, via = %r.via, replaced = replace, "route to a node's pod CIDR installed");
            }
            results.push((r, res));
        }
        let mut removed = Vec::new();
        for d in delete {
            let msg = match route_to(d, None) {
                Ok(b) => b.build(),
                Err(e) => {
                    tracing::error!(dst = %d, error = %e, "stale route not deleted");
                    continue;
                }
            };
            match h.route().del(msg).execute().await {
                Ok(()) => removed.push(d),
                Err(e) => tracing::error!(dst = %d, error = %e, "stale route not deleted"),
            }
        }
        Ok((results, removed))
    })
}

/// The next hop a route is installed with: its `via`, except an IPv6 route through the
/// tunnel, whose `via` (the node's underlay address, either family) stands behind an IPv6 next
/// hop (`tunnel::gateway6`).
fn next_hop(r: &NodeRoute, tunnel: bool) -> IpAddr {
    match (tunnel, r.dst) {
        (true, IpNet::V6(_)) => IpAddr::V6(super::tunnel::gateway6(r.via)),
        _ => r.via,
    }
}

/// A route of ciliate's protocol to `dst` (either family), through `via` when given. The
/// kernel takes no IPv4 next hop for an IPv6 route (RTA_VIA is IPv4's alone): IPv6 pod
/// traffic through the IPv4 tunnel will need a next hop of its own family on the device.
fn route_to(dst: IpNet, via: Option<IpAddr>) -> Result<RouteMessageBuilder<IpAddr>, String> {
    let b = RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(dst.network(), dst.prefix_len())
        .map_err(|e| e.to_string())?
        .protocol(RouteProtocol::Other(RTPROT_CILIATE));
    match (dst, via) {
        (_, None) => Ok(b),
        (IpNet::V6(_), Some(IpAddr::V4(_))) => {
            Err("an IPv6 route cannot go through an IPv4 next hop".into())
        }
        (_, Some(via)) => b.gateway(via).map_err(|e| e.to_string()),
    }
}

/// The device (name, ifindex) that holds `ip` in this network namespace; loopback never counts.
pub fn device_with_address(ip: IpAddr) -> Option<(String, u32)> {
    super::devices::read()
        .ok()?
        .into_iter()
        .find(|d| !d.loopback && d.addrs.contains(&ip))
        .map(|d| (d.name, d.ifindex))
}
