//! Pod network devices over netlink (rtnetlink): the veth pair of a pod, its end moved into the
//! pod's network namespace and configured there, the host route, and their removal. This is
//! what Cilium's CNI plugin does in `cmdAdd` (`connector.SetupVeth`, `configureIface`), done
//! here by the agent so the plugin stays a thin client.
//!
//! Wiring, as Cilium's: the pod gets its address as a /32, a link-scope route to the gateway
//! `169.254.1.1` and a default route through it, and a permanent neighbour entry that resolves
//! the gateway to the host-side veth's MAC. Every packet of the pod therefore leaves through the
//! host-side veth, where the datapath program sits; the host reaches the pod by a /32 route on
//! that veth.
//!
//! A dual-stack pod's IPv6 address the same way: a /128 (no duplicate address detection: IPAM
//! hands it out once), a default route through the link-local gateway `fe80::1`, resolved by a
//! permanent neighbour entry to the host-side veth's MAC; the host reaches it by a /128 route
//! on the veth and a permanent neighbour entry of the pod's MAC (no neighbour discovery
//! waiting on the veths' own link-local addresses).
//!
//! Every function here blocks: it runs its netlink requests on a private single-threaded
//! runtime in a thread of its own. The pod-side half runs in a thread that entered the pod's
//! namespace with `setns`, so the process's own namespace never changes.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

use futures_util::TryStreamExt;
use rtnetlink::packet_route::link::{LinkAttribute, LinkMessage};
use rtnetlink::packet_route::neighbour::NeighbourState;
use rtnetlink::packet_route::route::RouteScope;
use rtnetlink::{Handle, LinkUnspec, LinkVeth, RouteMessageBuilder};

/// The pod's gateway address (link-local, as Cilium's).
pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// The pod's IPv6 gateway address (link-local).
pub const POD_GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);

/// Failures of a network-device operation, naming the device or namespace and the step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetdevError {
    /// A netlink request failed.
    #[error("{step}: {message}")]
    Netlink { step: String, message: String },
    /// The pod's network namespace could not be entered.
    #[error("network namespace {path}: {message}")]
    Netns { path: PathBuf, message: String },
    /// A kernel setting could not be written.
    #[error("sysctl {key}: {message}")]
    Sysctl { key: String, message: String },
    /// The request itself is unusable.
    #[error("{0}")]
    Invalid(String),
}

type Result<T> = std::result::Result<T, NetdevError>;

/// The prefix of the interface alias that marks a host veth as made by a ciliate agent.
pub const MARK_PREFIX: &str = "ciliate:";
/// The longest alias the kernel keeps (`IFALIASZ` less the terminating NUL).
const MAX_ALIAS: usize = 255;

/// The alias this agent gives every host veth it creates: `ciliate:` and its (canonical) state
/// directory, or a hash of it when the path is too long. Agents on one machine have distinct
/// state directories (each holds its lock), so each finds its own devices and never another's.
pub fn agent_mark(state_dir: &Path) -> String {
    let path = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    let path = path.to_string_lossy();
    let mark = format!("{MARK_PREFIX}{path}");
    if mark.len() <= MAX_ALIAS {
        mark
    } else {
        format!("{MARK_PREFIX}#{:016x}", fnv1a(path.as_bytes()))
    }
}

/// Whether a device the agent knows by name (from its own state: an endpoint record or an ADD
/// intent) is its own: marked by it, or not marked at all (a crash between the creation and the
/// marking). A device marked by another agent is never touched.
pub fn owned(alias: Option<&str>, mark: &str) -> bool {
    match alias {
        None | Some("") => true,
        Some(a) => a == mark,
    }
}

/// Why `CNI_IFNAME` cannot name an interface, if it cannot (the CNI reference's
/// `ValidateInterfaceName`: the kernel's `dev_valid_name`, and no ':').
pub fn ifname_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("is empty")
    } else if name.len() > 15 {
        Some("is longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("is . or ..")
    } else if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        Some("contains '/', ':' or whitespace")
    } else {
        None
    }
}

/// What became of a device the agent reclaims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reclaimed {
    /// It did not exist.
    Absent,
    /// It was the agent's own and is deleted (its veth peer, routes and filters with it).
    Deleted,
    /// It carries another agent's mark (the alias): left alone.
    Foreign(String),
}

/// What a pod's interface should look like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInterfaceSpec {
    /// Host-side name (`lxc` + 12 hex digits, at most 15 characters).
    pub host_if: String,
    /// The pod's network namespace (a path such as `/var/run/netns/X` or `/proc/PID/ns/net`).
    pub netns: PathBuf,
    /// The interface name inside the pod (`CNI_IFNAME`, usually `eth0`).
    pub pod_if: String,
    /// The pod's addresses, at most one per family.
    pub ips: Vec<IpAddr>,
    pub mtu: u32,
    /// The alias that marks the host side as this agent's (`agent_mark`).
    pub mark: String,
}

/// What was created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInterfaces {
    pub host_if: String,
    pub host_ifindex: u32,
    pub host_mac: String,
    pub pod_mac: String,
}

/// The host-side interface name for a container: `lxc` and 12 hex digits of a hash of its id
/// (stable, so a CNI DEL after an agent restart finds the same device).
pub fn host_interface_name(container_id: &str) -> String {
    format!(
        "lxc{:012x}",
        fnv1a(container_id.as_bytes()) & 0xffff_ffff_ffff
    )
}

/// FNV-1a: stable across builds and platforms, unlike std's DefaultHasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

pub(crate) fn alias(link: &LinkMessage) -> Option<&str> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfAlias(s) => Some(s.as_str()),
        _ => None,
    })
}

pub(crate) fn nl_err(step: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NetdevError {
    let step = step.into();
    move |e| NetdevError::Netlink {
        step,
        message: e.to_string(),
    }
}

fn mac_string(link: &LinkMessage) -> String {
    link.attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::Address(b) => Some(
                b.iter()
                    .map(|x| format!("{x:02x}"))
                    .collect::<Vec<_>>()
                    .join(":"),
            ),
            _ => None,
        })
        .unwrap_or_default()
}

fn mac_bytes(mac: &str) -> Result<Vec<u8>> {
    mac.split(':')
        .map(|p| u8::from_str_radix(p, 16))
        .collect::<std::result::Result<Vec<u8>, _>>()
        .map_err(|_| NetdevError::Invalid(format!("bad MAC address {mac:?}")))
}

/// Runs `f` with a netlink handle on a private runtime, in a new thread that first entered
/// `netns` (or stays in the process's namespace when `None`).
pub(crate) fn with_netlink<T, F, Fut>(netns: Option<&Path>, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(Handle) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T>>,
{
    let netns = netns.map(Path::to_path_buf);
    let thread = std::thread::Builder::new()
        .name("netlink".into())
        .spawn(move || -> Result<T> {
            if let Some(path) = &netns {
                let file = std::fs::File::open(path).map_err(|e| NetdevError::Netns {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
                nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).map_err(
                    |e| NetdevError::Netns {
                        path: path.clone(),
                        message: format!("setns: {e}"),
                    },
                )?;
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .enable_time()
                .build()
                .map_err(|e| NetdevError::Invalid(format!("netlink runtime: {e}")))?;
            rt.block_on(async move {
                // The socket is opened here, after setns: it talks to the pod's namespace.
                let (conn, handle, _) =
                    rtnetlink::new_connection().map_err(|e| NetdevError::Netlink {
                        step: "open netlink socket".into(),
                        message: e.to_string(),
                    })?;
                tokio::spawn(conn);
                f(handle).await
            })
        })
        .map_err(|e| NetdevError::Invalid(format!("cannot start a netlink thread: {e}")))?;
    thread
        .join()
        .map_err(|_| NetdevError::Invalid("netlink thread panicked".into()))?
}

/// Replaces the route to `dst` (a /32, scope link; or a /128) out of `ifindex`; `step` names
/// it in errors.
async fn link_route(handle: &Handle, dst: IpAddr, ifindex: u32, step: String) -> Result<()> {
    let route = match dst {
        IpAddr::V4(dst) => RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(dst, 32)
            .output_interface(ifindex)
            .scope(RouteScope::Link)
            .build(),
        IpAddr::V6(dst) => RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(dst, 128)
            .output_interface(ifindex)
            .build(),
    };
    handle
        .route()
        .add(route)
        .replace()
        .execute()
        .await
        .map_err(nl_err(step))
}

/// Sets (or replaces) the permanent neighbour entry `ip` -> `mac` on `ifindex`; `step` names it
/// in errors.
pub(crate) async fn permanent_neighbour(
    h: &Handle,
    ifindex: u32,
    ip: IpAddr,
    mac: &[u8],
    step: String,
) -> Result<()> {
    h.neighbours()
        .add(ifindex, ip)
        .link_layer_address(mac)
        .state(NeighbourState::Permanent)
        .replace()
        .execute()
        .await
        .map_err(nl_err(step))
}

/// Sets the namespace's loopback up (a new network namespace has it down).
pub(crate) async fn set_lo_up(handle: &Handle) -> Result<()> {
    match link_by_name(handle, "lo").await? {
        Some(lo) => {
            let up = LinkUnspec::new_with_index(lo.header.index).up().build();
            set_link(handle, up, "set lo up").await
        }
        None => Ok(()),
    }
}

/// Moves the link `name` into the network namespace open as `ns_fd` (`whose` names it).
pub(crate) async fn move_to_netns(
    handle: &Handle,
    name: &str,
    ns_fd: std::os::fd::RawFd,
    whose: &str,
) -> Result<()> {
    let link = existing_link(handle, name).await?;
    let change = LinkUnspec::new_with_index(link.header.index)
        .setns_by_fd(ns_fd)
        .build();
    set_link(
        handle,
        change,
        format!("move {name} into {whose} namespace"),
    )
    .await
}

/// The link `name`, which must exist (`vanished` otherwise).
pub(crate) async fn existing_link(handle: &Handle, name: &str) -> Result<LinkMessage> {
    link_by_name(handle, name)
        .await?
        .ok_or_else(|| NetdevError::Invalid(format!("link {name} vanished")))
}

/// Applies a link change (`LinkUnspec::new_with_index(..)...build()`); `step` names it in errors.
pub(crate) async fn set_link(
    handle: &Handle,
    change: LinkMessage,
    step: impl Into<String>,
) -> Result<()> {
    handle
        .link()
        .set(change)
        .execute()
        .await
        .map_err(nl_err(step))
}

pub(crate) async fn link_by_name(handle: &Handle, name: &str) -> Result<Option<LinkMessage>> {
    let mut links = handle.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(l) => Ok(l),
        // ENODEV: no such device.
        Err(rtnetlink::Error::NetlinkError(m))
            if m.code.map(|c| c.get()) == Some(-nix::libc::ENODEV) =>
        {
            Ok(None)
        }
        Err(e) => Err(nl_err(format!("look up {name}"))(e)),
    }
}

/// Writes a sysctl under `/proc/sys` (of the calling thread's network namespace).
pub fn sysctl(key: &str, value: &str) -> Result<()> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    std::fs::write(&path, value).map_err(|e| NetdevError::Sysctl {
        key: key.to_string(),
        message: e.to_string(),
    })
}

/// Whether a host interface exists (in the process's namespace).
pub fn host_link_exists(name: &str) -> Result<bool> {
    let name = name.to_string();
    with_netlink(None, move |h| async move {
        Ok(link_by_name(&h, &name).await?.is_some())
    })
}

/// Creates the pod's veth pair and configures both ends. On failure nothing is left behind.
pub fn create_pod_interface(spec: &PodInterfaceSpec) -> Result<PodInterfaces> {
    if spec.host_if.is_empty() || spec.host_if.len() > 15 {
        return Err(NetdevError::Invalid(format!(
            "host interface name {:?} must be 1 to 15 characters",
            spec.host_if
        )));
    }
    if let Some(why) = ifname_problem(&spec.pod_if) {
        return Err(NetdevError::Invalid(format!(
            "CNI_IFNAME {:?} {why}",
            spec.pod_if
        )));
    }
    // A device of this name is the half-made interface of an ADD that never finished (the
    // caller knows no endpoint of this container): replaced, unless another agent marked it.
    match delete_owned_interface(&spec.host_if, &spec.mark)? {
        Reclaimed::Absent => {}
        Reclaimed::Deleted => {
            tracing::warn!(interface = %spec.host_if, "a stale interface of an unfinished ADD was replaced")
        }
        Reclaimed::Foreign(mark) => {
            return Err(NetdevError::Invalid(format!(
                "{} exists and belongs to another agent ({mark})",
                spec.host_if
            )))
        }
    }
    let netns_file = std::fs::File::open(&spec.netns).map_err(|e| NetdevError::Netns {
        path: spec.netns.clone(),
        message: e.to_string(),
    })?;
    // The peer is created in the host namespace under a temporary name that cannot collide
    // with another pod's, then moved and renamed.
    let tmp_peer = format!("tmp{}", &spec.host_if[3..]);
    let host = {
        let (host_if, tmp_peer, mtu) = (spec.host_if.clone(), tmp_peer.clone(), spec.mtu);
        let mark = spec.mark.clone();
        let ns_fd = netns_file.as_raw_fd();
        with_netlink(None, move |h| async move {
            h.link()
                .add(LinkVeth::new(&host_if, &tmp_peer).mtu(mtu).build())
                .execute()
                .await
                .map_err(nl_err(format!("create veth {host_if}")))?;
            // Marked at once (the kernel ignores an alias in the creating request), before
            // the peer leaves: from here on a sweep after a crash recognizes it.
            let created = existing_link(&h, &host_if).await?;
            set_link(
                &h,
                LinkUnspec::new_with_index(created.header.index)
                    .alias(mark)
                    .build(),
                format!("mark {host_if}"),
            )
            .await?;
            move_to_netns(&h, &tmp_peer, ns_fd, "the pod's").await?;
            let link = existing_link(&h, &host_if).await?;
            set_link(
                &h,
                LinkUnspec::new_with_index(link.header.index).up().build(),
                format!("set {host_if} up"),
            )
            .await?;
            Ok((link.header.index, mac_string(&link)))
        })
    };
    let (host_ifindex, host_mac) = match host {
        Ok(v) => v,
        Err(e) => {
            let _ = delete_host_interface(&spec.host_if);
            return Err(e);
        }
    };
    drop(netns_file);
    let finish = || -> Result<String> {
        // Kernel settings of the host side: forward between pods; no reverse-path drop
        // (the pod's source is routed by /32); answer ARP for the pod's peers.
        if spec.ips.iter().any(IpAddr::is_ipv4) {
            sysctl("net.ipv4.ip_forward", "1")?;
            sysctl(&format!("net.ipv4.conf.{}.rp_filter", spec.host_if), "0")?;
            sysctl(&format!("net.ipv4.conf.{}.proxy_arp", spec.host_if), "1")?;
        }
        if spec.ips.iter().any(IpAddr::is_ipv6) {
            sysctl("net.ipv6.conf.all.forwarding", "1")?;
        }
        let pod_mac = configure_pod_side(spec, &tmp_peer, &host_mac)?;
        let pod_mac_bytes = mac_bytes(&pod_mac)?;
        let (ips, ifindex, host_if) = (spec.ips.clone(), host_ifindex, spec.host_if.clone());
        with_netlink(None, move |h| async move {
            for ip in ips {
                link_route(&h, ip, ifindex, format!("host route {ip} dev {host_if}")).await?;
                if ip.is_ipv6() {
                    let step = format!("neighbour {ip} on {host_if}");
                    permanent_neighbour(&h, ifindex, ip, &pod_mac_bytes, step).await?;
                }
            }
            Ok(())
        })?;
        Ok(pod_mac)
    };
    match finish() {
        Ok(pod_mac) => Ok(PodInterfaces {
            host_if: spec.host_if.clone(),
            host_ifindex,
            host_mac,
            pod_mac,
        }),
        Err(e) => {
            let _ = delete_host_interface(&spec.host_if);
            Err(e)
        }
    }
}

/// Inside the pod: rename the peer, bring it and `lo` up, set the address, the gateway
/// neighbour and the routes. Returns the pod interface's MAC.
fn configure_pod_side(spec: &PodInterfaceSpec, tmp_peer: &str, host_mac: &str) -> Result<String> {
    let host_mac = mac_bytes(host_mac)?;
    let (tmp_peer, pod_if, ips, mtu) = (
        tmp_peer.to_string(),
        spec.pod_if.clone(),
        spec.ips.clone(),
        spec.mtu,
    );
    with_netlink(Some(&spec.netns), move |h| async move {
        let peer = link_by_name(&h, &tmp_peer).await?.ok_or_else(|| {
            NetdevError::Invalid(format!("{tmp_peer} did not arrive in the pod's namespace"))
        })?;
        let index = peer.header.index;
        if link_by_name(&h, &pod_if).await?.is_some() {
            return Err(NetdevError::Invalid(format!(
                "the pod's namespace already has an interface {pod_if}"
            )));
        }
        set_link(
            &h,
            LinkUnspec::new_with_index(index)
                .name(pod_if.clone())
                .build(),
            format!("rename {tmp_peer} to {pod_if}"),
        )
        .await?;
        // The pod's side gets the MTU too (a veth's peer keeps the default otherwise): in
        // tunnel mode it is the link's less the encapsulation.
        set_link(
            &h,
            LinkUnspec::new_with_index(index).mtu(mtu).up().build(),
            format!("set {pod_if} up, mtu {mtu}"),
        )
        .await?;
        set_lo_up(&h).await?;
        for ip in ips {
            pod_side(&h, index, ip, &host_mac, &pod_if).await?;
        }
        let link = existing_link(&h, &pod_if).await?;
        Ok(mac_string(&link))
    })
}

/// The pod's address of one family (an IPv4 /32; an IPv6 /128 without duplicate address
/// detection: IPAM hands it out once), its gateway's permanent neighbour entry (the host
/// veth's MAC), IPv4's link route to the gateway (IPv6's is link-local), the default route.
async fn pod_side(h: &Handle, index: u32, ip: IpAddr, host_mac: &[u8], pod_if: &str) -> Result<()> {
    use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags};
    let (prefix, gateway) = match ip {
        IpAddr::V4(_) => (32, IpAddr::V4(POD_GATEWAY)),
        IpAddr::V6(_) => (128, IpAddr::V6(POD_GATEWAY6)),
    };
    let mut add = h.address().add(index, ip, prefix);
    if ip.is_ipv6() {
        add.message_mut()
            .attributes
            .push(AddressAttribute::Flags(AddressFlags::Nodad));
    }
    add.execute()
        .await
        .map_err(nl_err(format!("address {ip}/{prefix} on {pod_if}")))?;
    let step = format!("gateway neighbour {gateway}");
    permanent_neighbour(h, index, gateway, host_mac, step).await?;
    if gateway.is_ipv4() {
        link_route(h, gateway, index, format!("gateway route {gateway}")).await?;
    }
    let unspecified = match gateway {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let default = RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(unspecified, 0)
        .and_then(|b| b.gateway(gateway))
        .map_err(|e| NetdevError::Invalid(format!("default route via {gateway}: {e}")))?
        .output_interface(index)
        .build();
    h.route()
        .add(default)
        .replace()
        .execute()
        .await
        .map_err(nl_err(format!("default route via {gateway}")))
}

/// Deletes a host interface (the veth's other end goes with it, and so do its routes and tc
/// filters). Returns whether it existed: deleting what is gone is not an error (CNI DEL is
/// idempotent).
pub fn delete_host_interface(name: &str) -> Result<bool> {
    let name = name.to_string();
    with_netlink(None, move |h| async move {
        let Some(link) = link_by_name(&h, &name).await? else {
            return Ok(false);
        };
        match h.link().del(link.header.index).execute().await {
            Ok(()) => Ok(true),
            Err(rtnetlink::Error::NetlinkError(m))
                if m.code.map(|c| c.get()) == Some(-nix::libc::ENODEV) =>
            {
                Ok(false)
            }
            Err(e) => Err(nl_err(format!("delete {name}"))(e)),
        }
    })
}

/// Deletes a host interface the agent knows by name if it is its own (see `owned`).
pub fn delete_owned_interface(name: &str, mark: &str) -> Result<Reclaimed> {
    let (name, mark) = (name.to_string(), mark.to_string());
    with_netlink(None, move |h| async move {
        let Some(link) = link_by_name(&h, &name).await? else {
            return Ok(Reclaimed::Absent);
        };
        if let Some(other) = alias(&link).filter(|a| !owned(Some(a), &mark)) {
            return Ok(Reclaimed::Foreign(other.to_string()));
        }
        match h.link().del(link.header.index).execute().await {
            Ok(()) => Ok(Reclaimed::Deleted),
            Err(rtnetlink::Error::NetlinkError(m))
                if m.code.map(|c| c.get()) == Some(-nix::libc::ENODEV) =>
            {
                Ok(Reclaimed::Absent)
            }
            Err(e) => Err(nl_err(format!("delete {name}"))(e)),
        }
    })
}

/// The names of the host interfaces that carry exactly `mark`.
pub fn marked_interfaces(mark: &str) -> Result<Vec<String>> {
    let mark = mark.to_string();
    with_netlink(None, move |h| async move {
        let mut links = h.link().get().execute();
        let mut out = Vec::new();
        while let Some(l) = links.try_next().await.map_err(nl_err("list interfaces"))? {
            if alias(&l) == Some(mark.as_str()) {
                if let Some(name) = l.attributes.iter().find_map(|a| match a {
                    LinkAttribute::IfName(n) => Some(n.clone()),
                    _ => None,
                }) {
                    out.push(name);
                }
            }
        }
        Ok(out)
    })
}

/// The pod side as it is now: the interface's MAC, if it holds every one of `ips` (CNI CHECK).
pub fn inspect_pod_interface(netns: &Path, pod_if: &str, ips: Vec<IpAddr>) -> Result<String> {
    let pod_if = pod_if.to_string();
    with_netlink(Some(netns), move |h| async move {
        let link = link_by_name(&h, &pod_if)
            .await?
            .ok_or_else(|| NetdevError::Invalid(format!("no interface {pod_if} in the pod")))?;
        let mut addrs = h
            .address()
            .get()
            .set_link_index_filter(link.header.index)
            .execute();
        let mut missing = ips;
        while let Some(a) = addrs
            .try_next()
            .await
            .map_err(nl_err(format!("addresses of {pod_if}")))?
        {
            use rtnetlink::packet_route::address::AddressAttribute;
            for x in &a.attributes {
                if let AddressAttribute::Address(held) = x {
                    missing.retain(|ip| ip != held);
                }
            }
        }
        if let Some(ip) = missing.first() {
            return Err(NetdevError::Invalid(format!(
                "{pod_if} in the pod does not hold {ip}"
            )));
        }
        Ok(mac_string(&link))
    })
}

/// Where named network namespaces live (as iproute2 keeps them).
pub const NETNS_DIR: &str = "/var/run/netns";

/// Creates a named network namespace, `NETNS_DIR/<name>`, as `ip netns add` does: a thread
/// unshares its network namespace and the namespace is bind-mounted onto a file, so it lives
/// on after the thread. Returns its path.
pub fn create_netns(name: &str) -> Result<PathBuf> {
    if name.is_empty() || name.contains('/') {
        return Err(NetdevError::Invalid(format!(
            "{name:?} is not a namespace name"
        )));
    }
    let dir = Path::new(NETNS_DIR);
    let path = dir.join(name);
    let ns_err = |message: String| NetdevError::Netns {
        path: path.clone(),
        message,
    };
    std::fs::create_dir_all(dir).map_err(|e| ns_err(format!("create {NETNS_DIR}: {e}")))?;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| ns_err(e.to_string()))?;
    let target = path.clone();
    let made = std::thread::spawn(move || -> std::result::Result<(), String> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("unshare: {e}"))?;
        nix::mount::mount(
            Some("/proc/thread-self/ns/net"),
            &target,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(|e| format!("bind mount: {e}"))
    })
    .join()
    .map_err(|_| ns_err("namespace thread panicked".into()))?;
    if let Err(e) = made {
        let _ = std::fs::remove_file(&path);
        return Err(ns_err(e));
    }
    Ok(path)
}

/// Removes a named network namespace (its processes, if any, keep it alive until they exit).
/// Removing one that does not exist is not an error.
pub fn delete_netns(name: &str) -> Result<()> {
    let path = Path::new(NETNS_DIR).join(name);
    if !path.exists() {
        return Ok(());
    }
    let _ = nix::mount::umount2(&path, nix::mount::MntFlags::MNT_DETACH);
    std::fs::remove_file(&path).map_err(|e| NetdevError::Netns {
        path: path.clone(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_are_stable_short_and_distinct() {
        let a = host_interface_name("0123456789abcdef");
        assert_eq!(a, host_interface_name("0123456789abcdef"));
        assert_eq!(a.len(), 15);
        assert!(a.starts_with("lxc"));
        assert_ne!(a, host_interface_name("0123456789abcdeg"));
    }

    #[test]
    fn interface_names_follow_the_cni_rules() {
        for ok in ["eth0", "net1", "a", "123456789012345", "e.th-0_x"] {
            assert_eq!(ifname_problem(ok), None, "{ok:?}");
        }
        for (bad, why) in [
            ("", "is empty"),
            ("1234567890123456", "is longer than 15 bytes"),
            (".", "is . or .."),
            ("..", "is . or .."),
            ("eth/0", "contains '/', ':' or whitespace"),
            ("eth:0", "contains '/', ':' or whitespace"),
            ("eth 0", "contains '/', ':' or whitespace"),
            ("eth\t0", "contains '/', ':' or whitespace"),
        ] {
            assert_eq!(ifname_problem(bad), Some(why), "{bad:?}");
        }
        // Bytes, not characters: 8 two-byte characters are 16 bytes.
        assert!(ifname_problem("éééééééé").is_some());
    }

    #[test]
    fn marks_name_the_state_directory_and_only_the_own_devices_are_owned() {
        let dir = tempfile::tempdir().unwrap();
        let mark = agent_mark(dir.path());
        let canonical = std::fs::canonicalize(dir.path()).unwrap();
        assert_eq!(mark, format!("ciliate:{}", canonical.display()));
        let long = dir.path().join("x".repeat(200)).join("y".repeat(200));
        let hashed = agent_mark(&long);
        assert!(
            hashed.starts_with("ciliate:#") && hashed.len() <= MAX_ALIAS,
            "{hashed}"
        );
        assert_ne!(hashed, agent_mark(&dir.path().join("x".repeat(200))));
        assert!(owned(Some(&mark), &mark));
        assert!(
            owned(None, &mark),
            "not marked yet: a crash before the marking"
        );
        assert!(owned(Some(""), &mark));
        assert!(!owned(Some("ciliate:/other/state"), &mark));
        assert!(!owned(Some("uplink"), &mark), "someone else's alias");
    }

    #[test]
    fn macs_round_trip() {
        assert_eq!(
            mac_bytes("02:00:0a:ff:00:01").unwrap(),
            vec![2, 0, 10, 255, 0, 1]
        );
        assert!(mac_bytes("zz").is_err());
    }
}
