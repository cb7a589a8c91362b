//! Cluster networking: routes between nodes and masquerading. `routes.rs` is the pure desired
//! state (nodes -> routes, and the rows of `ciliate node list`; nodes -> what to masquerade),
//! `netlink.rs` the thin route applier (`datapath::masquerade` writes the NAT table), and
//! `run_route_reconciler` the task that ties them to the Node objects the agent sees, and to
//! the kernel's link and route events (`events.rs`).

pub mod devices;
pub mod events;
pub mod netlink;
pub mod routes;
pub mod tunnel;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::objects::NodeInfo;
pub use routes::{RoutingConfig, RoutingMode, RoutingView, TunnelProtocol, UnderlayProtocol};

/// How often the kernel's routes are compared with the desired state even without a Node
/// change (a route deleted by hand comes back).
const RESYNC: Duration = Duration::from_secs(10);
/// After a kernel event (`events`), how long to let the events that follow it arrive (a link
/// coming up is followed by its connected routes) before one pass handles them all.
const EVENT_SETTLE: Duration = Duration::from_millis(50);

/// The Node objects the agent knows, published by `PolicyRepoActor` on every change.
pub type NodeSet = BTreeMap<String, NodeInfo>;

/// What the route reconciler reads and publishes.
pub struct ReconcilerIo {
    /// The Node objects (`PolicyRepoActor` publishes them).
    pub nodes: tokio::sync::watch::Receiver<NodeSet>,
    /// Set once the initial sync is done.
    pub ready: Arc<AtomicBool>,
    /// Routing as realized (`node list`, `status`).
    pub view: Arc<Mutex<RoutingView>>,
    /// The addresses of the node's native devices (eBPF datapath), for the ipcache (`host`).
    pub device_addresses: tokio::sync::watch::Sender<BTreeSet<std::net::IpAddr>>,
}

/// Recomputes and applies the routes whenever the node set changes. Nothing is applied before
/// `ready` (the initial sync): an empty node set at start must not remove the routes a
/// previous run installed.
pub async fn run_route_reconciler(
    local: String,
    cfg: RoutingConfig,
    mut applier: Option<netlink::RouteApplier>,
    mut masquerade: Masquerader,
    io: ReconcilerIo,
) {
    let ReconcilerIo {
        mut nodes,
        ready,
        view,
        device_addresses,
    } = io;
    while !ready.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut netdev = NetdevProgram::default();
    let kick = Arc::new(tokio::sync::Notify::new());
    if applier.is_some() || cfg.bpf_pins.is_some() {
        if let Err(e) = events::watch(kick.clone()) {
            tracing::warn!(error = %e, "no route events; routes resync every 10 s");
        }
    }
    loop {
        let snapshot = nodes.borrow_and_update().clone();
        let plans = routes::desired_routes(&local, &snapshot, &cfg);
        let want = routes::all_routes(&plans);
        let local_ip = snapshot
            .get(&local)
            .and_then(|n| routes::underlay_address(n, cfg.underlay));
        let local_addr = snapshot.get(&local).and_then(routes::node_address);
        let outcome = match applier.take() {
            Some(mut a) => match actix_web::web::block(move || {
                let o = a.apply(&want, local_ip);
                (a, o)
            })
            .await
            {
                Ok((a, o)) => {
                    applier = Some(a);
                    o
                }
                Err(e) => {
                    tracing::error!(error = %e, "route reconciler stopped");
                    return;
                }
            },
            None => Default::default(),
        };
        let mut rows: Vec<_> = plans
            .iter()
            .map(|p| routes::node_row(p, &cfg, &outcome))
            .collect();
        if let Some(r) = rows.iter_mut().find(|r| r.local) {
            masquerade.add_pools(&mut r.pod_cidrs);
        }
        for r in rows.iter().filter(|r| r.route.starts_with("error")) {
            tracing::warn!(node = %r.name, state = %r.route, "node not routed");
        }
        if let Some(pins) = &cfg.bpf_host_routing {
            // Only prefixes whose kernel route is in place: the program's FIB lookup must find
            // the route this agent installed.
            let routed: std::collections::BTreeSet<ipnet::IpNet> = outcome
                .iter()
                .filter(|(_, o)| o.is_ok())
                .map(|(r, _)| r.dst)
                .collect();
            if let Err(e) = crate::datapath::bpf::host_routes::sync(pins, &routed) {
                tracing::warn!(error = %e, "BPF host routing map not updated; pod traffic to other nodes takes the host stack");
            }
        }
        let tunnel = applier.as_ref().and_then(|a| a.tunnel_ifindex());
        let host_routing = netdev.reconcile(&cfg, local_addr, tunnel).await;
        let native = native_devices(&cfg);
        if let Some(devs) = &native {
            let addrs = devices::host_addresses(devs);
            device_addresses.send_if_modified(|old| {
                let changed = *old != addrs;
                *old = addrs;
                changed
            });
        }
        let host_firewall = netdev.host_firewall(&cfg, native.as_deref(), tunnel).await;
        if cfg.host_firewall || cfg.bpf_host_routing.is_some() {
            sync_tunnel_peers(&cfg, &outcome);
        }
        let masq = masquerade.reconcile(&local, &snapshot, &cfg, false).await;
        // Without --enable-ipv6 an earlier run's IPv6 table still goes; nothing is shown.
        let masq6 = masquerade.reconcile(&local, &snapshot, &cfg, true).await;
        let masq6 = if cfg.ipv6 { masq6 } else { String::new() };
        if let Ok(mut v) = view.lock() {
            v.host_routing = host_routing;
            v.tunnel = match cfg.mode {
                RoutingMode::Tunnel => netdev.tunnel_shown.clone(),
                RoutingMode::Native => String::new(),
            };
            v.host_firewall_device = host_firewall;
            v.routes_installed = outcome.values().filter(|o| o.is_ok()).count();
            v.nodes = rows;
            v.masquerade = masq;
            v.masquerade_ipv6 = masq6;
        }
        tokio::select! {
            changed = nodes.changed() => if changed.is_err() { return },
            _ = kick.notified() => tokio::time::sleep(EVENT_SETTLE).await,
            _ = tokio::time::sleep(RESYNC) => {},
        }
    }
}

/// BPF host routing's receive side: the node device's program, on the device pods' packets from
/// other nodes arrive on: the one that holds the node's InternalIP (native mode), or the
/// agent's vxlan device (tunnel mode: the packets as decapsulated). Attached once per run (a
/// restarted agent swaps in its own build) and again whenever that device changes; taken off
/// once when BPF host routing is off.
#[derive(Default)]
struct NetdevProgram {
    /// The device this run attached the program to.
    attached: Option<u32>,
    /// This run took a left-over program off (host routing off).
    cleared: bool,
    /// What was shown last (a failure is logged once, not every pass).
    shown: String,
    /// The native devices this run attached the host firewall to.
    firewall: FirewallDevices,
    /// What the last attach pass could not do (shown in `status`).
    firewall_errors: Vec<String>,
    /// The devices last logged as attached.
    firewall_logged: FirewallDevices,
    /// Set once a pass attached everything and swept what an earlier run left.
    firewall_swept: bool,
    /// Tunnel mode's work in BPF (`bpf/lib/tunnel.h`) as last set up (`Some(None)`: the
    /// kernel's device does it all); `None` until a pass set it.
    #[allow(clippy::option_option)]
    bpf_tunnel: Option<Option<BpfTunnel>>,
    /// Who does tunnel mode's encapsulation, as `status` shows it (`tunnel`; `none` with the
    /// in-memory datapath).
    tunnel_shown: String,
    /// This run took a left-over host firewall off (`--enable-host-firewall=false`).
    firewall_cleared: bool,
    /// Tunnel mode: the tunnel device the host firewall is on, and whether with its own
    /// ingress program.
    firewall_tunnel: Option<(u32, bool)>,
}

impl NetdevProgram {
    async fn reconcile(
        &mut self,
        cfg: &RoutingConfig,
        local_ip: Option<std::net::IpAddr>,
        tunnel: Option<u32>,
    ) -> String {
        let shown = match (&cfg.bpf_host_routing, &cfg.bpf_pins) {
            (None, None) => {
                self.tunnel_shown = "none".into();
                "none".to_string()
            }
            (None, Some(pins)) => {
                if !self.cleared {
                    let pins = pins.clone();
                    let _ = actix_web::web::block(move || {
                        crate::datapath::bpf::host_delivery::detach(&pins)
                    })
                    .await;
                    self.cleared = true;
                }
                self.tunnel_shown = "kernel (legacy host routing)".into();
                "legacy".to_string()
            }
            (Some(pins), _) => {
                let shown = self.attach(pins, cfg.mode, local_ip, tunnel).await;
                self.bpf_tunnel(pins, cfg, local_ip, tunnel).await;
                shown
            }
        };
        if shown != self.shown && shown.contains("send side only") && local_ip.is_some() {
            tracing::warn!(state = %shown, "BPF host routing: packets for this node's pods take the host stack");
        }
        self.shown = shown.clone();
        shown
    }

    async fn attach(
        &mut self,
        pins: &std::path::Path,
        mode: RoutingMode,
        local_ip: Option<std::net::IpAddr>,
        tunnel: Option<u32>,
    ) -> String {
        let Some(ip) = local_ip else {
            return "bpf, send side only: this node has no InternalIP yet".into();
        };
        let (name, ifindex) = match receiving_device(mode, ip, tunnel) {
            Ok(d) => d,
            Err(why) => return format!("bpf, send side only: {why}"),
        };
        if self.attached == Some(ifindex) {
            return format!("bpf ({name})");
        }
        let p = pins.to_path_buf();
        match actix_web::web::block(move || {
            crate::datapath::bpf::host_delivery::attach(&p, ifindex)
        })
        .await
        {
            Ok(Ok(())) => {
                tracing::info!(device = %name, "BPF host routing: the node device's program is attached");
                self.attached = Some(ifindex);
                format!("bpf ({name})")
            }
            Ok(Err(e)) => format!("bpf, send side only: {e}"),
            Err(e) => format!("bpf, send side only: {e}"),
        }
    }
}

impl NetdevProgram {
    /// Tunnel mode over an IPv4 underlay: pods' IPv4 packets are encapsulated by `host_route`,
    /// and the tunnel's packets for local pods decapsulated by `from_netdev` on the device
    /// holding the node's address (its own link, unless the host firewall's links run the same
    /// program on every native device). Anywhere else, or when that fails, the kernel's tunnel
    /// device does it, as before.
    async fn bpf_tunnel(
        &mut self,
        pins: &std::path::Path,
        cfg: &RoutingConfig,
        local_ip: Option<std::net::IpAddr>,
        tunnel: Option<u32>,
    ) {
        let (want, why_not) = bpf_tunnel_wanted(cfg, local_ip, tunnel);
        if self.bpf_tunnel == Some(want) {
            if want.is_none() {
                // The kernel's device still, perhaps for another reason now.
                self.tunnel_shown = format!("kernel ({why_not})");
            }
            return;
        }
        let p = pins.to_path_buf();
        let error = match actix_web::web::block(move || set_bpf_tunnel(&p, want)).await {
            Ok(Ok(true)) => {
                self.bpf_tunnel = Some(want);
                self.tunnel_shown = match want {
                    Some(d) => format!("bpf ({})", d.local),
                    None => format!("kernel ({why_not})"),
                };
                return;
            }
            Ok(Ok(false)) => return,
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        self.tunnel_shown = format!("kernel: {error}");
        tracing::warn!(%error, "the tunnel's packets are encapsulated and decapsulated by the kernel's device");
    }
}

/// What [`NetdevProgram::bpf_tunnel`] sets up, or why the kernel's device does it all.
fn bpf_tunnel_wanted(
    cfg: &RoutingConfig,
    local_ip: Option<std::net::IpAddr>,
    tunnel: Option<u32>,
) -> (Option<BpfTunnel>, &'static str) {
    match (cfg.mode, tunnel, local_ip) {
        (RoutingMode::Native, _, _) => (None, "native routing"),
        (_, None, _) => (None, "no tunnel device yet"),
        (_, _, None) => (None, "this node has no InternalIP yet"),
        (_, _, Some(std::net::IpAddr::V6(_))) => (None, "IPv6 underlay"),
        (_, Some(t), Some(std::net::IpAddr::V4(ip))) => {
            match netlink::device_with_address(ip.into()) {
                Some((_, u)) => (
                    Some(BpfTunnel {
                        tunnel: t,
                        local: ip,
                        underlay: (!cfg.host_firewall).then_some(u),
                    }),
                    "",
                ),
                None => (None, "no device holds the node's address"),
            }
        }
    }
}

/// Tunnel mode in BPF: the tunnel device, the node's IPv4 underlay address, and the underlay
/// device this agent's own link decapsulates on (`None`: the host firewall's links do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BpfTunnel {
    tunnel: u32,
    local: std::net::Ipv4Addr,
    underlay: Option<u32>,
}

/// Makes the programs do the tunnel's work as `want` says (see [`NetdevProgram::bpf_tunnel`]);
/// `None`: the kernel's device does it all. `Ok(false)` when it is to be done again: no program
/// has pinned the map yet (the host firewall's links, which run the program on the underlay
/// device, come later in the pass).
fn set_bpf_tunnel(
    pins: &std::path::Path,
    want: Option<BpfTunnel>,
) -> Result<bool, crate::datapath::DatapathError> {
    use crate::datapath::bpf::host_delivery as hd;
    let Some(d) = want else {
        hd::detach_underlay(pins);
        hd::set_tunnel(pins, 0, std::net::Ipv4Addr::UNSPECIFIED)?;
        return Ok(true);
    };
    match d.underlay {
        Some(underlay) => hd::attach_underlay(pins, underlay, (d.tunnel, d.local)).map(|_| true),
        None => {
            hd::detach_underlay(pins);
            hd::set_tunnel(pins, d.tunnel, d.local)
        }
    }
}

/// The node's native devices as `--devices` selects them, read from the kernel; `None` with
/// the in-memory datapath (no kernel state is the agent's) or when they cannot be read.
pub fn native_devices(cfg: &RoutingConfig) -> Option<Vec<devices::Device>> {
    cfg.bpf_pins.as_ref()?;
    match devices::read() {
        Ok(all) => Some(devices::select(&all, &cfg.devices)),
        Err(e) => {
            tracing::warn!(error = %e, "the node's devices not read: the addresses last read stay host (none at start)");
            None
        }
    }
}

impl NetdevProgram {
    /// The host firewall's programs on every native device (its ingress program only where
    /// host routing has not attached the same one) and, in tunnel mode, on the tunnel device;
    /// taken off once when the host firewall is off. Returns the devices (comma-separated),
    /// `off`, or why not attached.
    async fn host_firewall(
        &mut self,
        cfg: &RoutingConfig,
        native: Option<&[devices::Device]>,
        tunnel: Option<u32>,
    ) -> String {
        let Some(pins) = cfg.bpf_pins.clone() else {
            return "off".into();
        };
        if !cfg.host_firewall {
            if !self.firewall_cleared {
                let _ = actix_web::web::block(move || {
                    crate::datapath::bpf::host_firewall::detach(&pins)
                })
                .await;
                self.firewall_cleared = true;
            }
            return "off".into();
        }
        let want: FirewallDevices = match native {
            Some(devs) => devs
                .iter()
                .map(|d| {
                    (
                        d.name.clone(),
                        (d.ifindex, self.attached != Some(d.ifindex)),
                    )
                })
                .collect(),
            None => self.firewall.clone(),
        };
        let tunnel = tunnel
            .filter(|_| cfg.mode == RoutingMode::Tunnel)
            .map(|t| (t, self.attached != Some(t)));
        let missing = native.map_or_else(Vec::new, |d| cfg.devices.missing(d));
        if self.firewall != want || self.firewall_tunnel != tunnel || !self.firewall_swept {
            self.apply_firewall(pins, want, tunnel).await;
        }
        self.firewall_shown(&missing)
    }

    /// Attaches to the devices of `want` that differ from what this run attached, then takes
    /// the programs off the devices that are no longer native (and, once, an earlier run's).
    async fn apply_firewall(
        &mut self,
        pins: std::path::PathBuf,
        want: FirewallDevices,
        tunnel: Option<(u32, bool)>,
    ) {
        let before = std::mem::take(&mut self.firewall);
        let (was, tunnel_changed) = (before.clone(), self.firewall_tunnel != tunnel);
        let r = actix_web::web::block(move || {
            attach_firewall(&pins, &want, &was, tunnel, tunnel_changed)
        })
        .await;
        let (attached, tunnel_ok, errors) = match r {
            Ok(r) => r,
            Err(e) => (before, false, vec![format!("{e}")]),
        };
        for e in &errors {
            tracing::error!(error = %e, "host firewall not attached");
        }
        if attached != self.firewall_logged {
            tracing::info!(devices = ?attached.keys().collect::<Vec<_>>(), tunnel = ?tunnel, "host firewall attached");
            self.firewall_logged = attached.clone();
        }
        self.firewall_errors = errors;
        self.firewall_swept = self.firewall_errors.is_empty();
        self.firewall = attached;
        // A tunnel device that failed is tried again on the next pass.
        self.firewall_tunnel = if tunnel_ok { tunnel } else { None };
    }

    /// `status`'s `host_firewall_device`: the devices, and what is wrong.
    fn firewall_shown(&self, missing: &[String]) -> String {
        let mut shown: Vec<String> = self.firewall.keys().cloned().collect();
        if shown.is_empty() && self.firewall_errors.is_empty() {
            shown.push("not attached: no native device (--devices)".into());
        }
        for m in missing {
            shown.push(format!("{m}: no such device (--devices)"));
        }
        shown.extend(
            self.firewall_errors
                .iter()
                .map(|e| format!("not attached: {e}")),
        );
        shown.join(",")
    }
}

/// The host firewall's native devices: name -> (ifindex, whether its ingress program is the
/// host firewall's own link, not host routing's).
type FirewallDevices = BTreeMap<String, (u32, bool)>;

/// Blocking: attaches to the devices of `want` that are not as `before` (and to the tunnel
/// device when `tunnel_changed`), then sweeps the links of devices not in `want`. Returns the
/// devices attached now, whether the tunnel device is as wanted, and the failures.
fn attach_firewall(
    pins: &std::path::Path,
    want: &FirewallDevices,
    before: &FirewallDevices,
    tunnel: Option<(u32, bool)>,
    tunnel_changed: bool,
) -> (FirewallDevices, bool, Vec<String>) {
    use crate::datapath::bpf::host_firewall as fw;
    let (mut attached, mut errors) = (FirewallDevices::new(), Vec::new());
    let mut tunnel_ok = true;
    for (name, &(ifindex, ingress)) in want {
        let same = before.get(name) == Some(&(ifindex, ingress));
        let r = if same {
            Ok(())
        } else {
            fw::attach(pins, name, ifindex, ingress)
        };
        match r {
            Ok(()) => {
                attached.insert(name.clone(), (ifindex, ingress));
            }
            Err(e) => errors.push(format!("{name}: {e}")),
        }
    }
    if let (Some((t, ingress)), true) = (tunnel, tunnel_changed) {
        if let Err(e) = fw::attach_tunnel(pins, t, ingress) {
            errors.push(format!("{}: {e}", tunnel::VXLAN_DEVICE));
            tunnel_ok = false;
        }
    }
    // A device that failed keeps an earlier run's links: better its old program than none.
    let keep: BTreeSet<String> = want.keys().cloned().collect();
    for name in fw::sweep_devices(pins, &keep) {
        tracing::info!(device = %name, "host firewall taken off a device that is no native device now");
    }
    (attached, tunnel_ok, errors)
}

/// The host firewall's tunnel exemption: in tunnel mode, the nodes this node's routes go
/// through (their FDB entries are written with the routes); none in native mode.
fn sync_tunnel_peers(cfg: &RoutingConfig, outcome: &netlink::Outcome) {
    let Some(pins) = &cfg.bpf_pins else {
        return;
    };
    let peers: std::collections::BTreeSet<std::net::Ipv4Addr> = match cfg.mode {
        RoutingMode::Tunnel => outcome
            .keys()
            .filter_map(|r| match r.via {
                std::net::IpAddr::V4(v4) => Some(v4),
                std::net::IpAddr::V6(_) => None,
            })
            .collect(),
        RoutingMode::Native => Default::default(),
    };
    if let Err(e) = crate::datapath::bpf::host_firewall::sync_tunnel_peers(pins, &peers) {
        tracing::warn!(error = %e, "the tunnel peers not updated: tunnel packets of nodes that are no remote-node meet the host policy, and a new peer's are dropped at this node's device");
    }
}

/// The device pods' packets from other nodes arrive on (see `NetdevProgram`).
/// In tunnel mode, only this agent's own device as its route pass set it up (`tunnel`): a
/// device of that name may belong to another agent.
fn receiving_device(
    mode: RoutingMode,
    ip: std::net::IpAddr,
    tunnel: Option<u32>,
) -> Result<(String, u32), String> {
    match mode {
        RoutingMode::Native => netlink::device_with_address(ip)
            .ok_or_else(|| format!("no device of this node holds {ip}")),
        RoutingMode::Tunnel => tunnel
            .map(|i| (tunnel::VXLAN_DEVICE.to_string(), i))
            .ok_or_else(|| {
                format!(
                    "no tunnel device {} of this agent (no other node yet, or its setup failed)",
                    tunnel::VXLAN_DEVICE
                )
            }),
    }
}

/// Keeps this agent's masquerade tables in line with the nodes (`--enable-ipv4-masquerade`,
/// `--enable-ipv6-masquerade`): one per family.
pub struct Masquerader {
    /// Names the agent's tables (a hash of its state directory).
    tag: String,
    /// This node's pod CIDRs when its Node object gives none (`--pod-cidr`).
    ipam: Arc<Mutex<crate::ipam::NodeIpam>>,
    /// What is in the kernel now, IPv4's and IPv6's (`None`: not written by this run yet).
    applied: [Option<Option<crate::datapath::masquerade::MasqueradeSpec>>; 2],
}

impl Masquerader {
    pub fn new(state_dir: &std::path::Path, ipam: Arc<Mutex<crate::ipam::NodeIpam>>) -> Self {
        Masquerader {
            tag: crate::datapath::masquerade::tag_for(state_dir),
            ipam,
            applied: [None, None],
        }
    }

    /// Adds to the local node's row the pod CIDRs IPAM serves of a family its Node object
    /// gives none of (`--pod-cidr`, once per family).
    fn add_pools(&self, cidrs: &mut Vec<String>) {
        let Ok(g) = self.ipam.lock() else { return };
        for pool in [&g.ipam, &g.ipam6].into_iter().flatten() {
            let net = pool.cidr();
            let family = |c: &String| {
                c.parse::<ipnet::IpNet>()
                    .is_ok_and(|c| c.addr().is_ipv6() == net.addr().is_ipv6())
            };
            if !cidrs.iter().any(family) {
                cidrs.push(net.to_string());
            }
        }
    }

    /// What the table of one family should hold (`None`: no table).
    fn wanted(
        &self,
        local: &str,
        nodes: &NodeSet,
        cfg: &RoutingConfig,
        ipv6: bool,
    ) -> Option<crate::datapath::masquerade::MasqueradeSpec> {
        let fallback = self.ipam.lock().ok().and_then(|g| {
            let pool = if ipv6 { &g.ipam6 } else { &g.ipam };
            pool.as_ref().map(|i| i.cidr())
        });
        let on = if ipv6 {
            cfg.masquerade6
        } else {
            cfg.masquerade
        };
        on.then(|| routes::masquerade_spec(local, nodes, cfg, fallback, ipv6))
            .filter(|s| !s.sources().is_empty())
    }

    /// Writes one family's table when what it should hold changed (or removes it when
    /// masquerading is off or this node has no pod CIDR of the family); returns the state to
    /// show.
    async fn reconcile(
        &mut self,
        local: &str,
        nodes: &NodeSet,
        cfg: &RoutingConfig,
        ipv6: bool,
    ) -> String {
        if !cfg.install {
            return "none".into();
        }
        let want = self.wanted(local, nodes, cfg, ipv6);
        let on = if ipv6 {
            cfg.masquerade6
        } else {
            cfg.masquerade
        };
        let shown = match (&want, on) {
            (Some(_), _) => "enabled",
            (None, true) => "enabled (no pod CIDR yet)",
            (None, false) => "disabled",
        };
        if self.applied[ipv6 as usize].as_ref() == Some(&want) {
            return shown.into();
        }
        let (tag, spec) = (self.tag.clone(), want.clone());
        let result = actix_web::web::block(move || match &spec {
            Some(spec) => crate::datapath::masquerade::apply(&tag, spec),
            None => crate::datapath::masquerade::remove(&tag, ipv6),
        })
        .await;
        match result {
            Ok(Ok(())) => {
                tracing::info!(table = %crate::datapath::masquerade::table_name(&self.tag), ipv6, state = shown, spec = ?want, "masquerading");
                self.applied[ipv6 as usize] = Some(want);
                shown.into()
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "masquerading not applied");
                format!("error: {e}")
            }
            Err(e) => format!("error: {e}"),
        }
    }
}
