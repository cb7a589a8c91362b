//! Native routing between nodes (Cilium's auto-direct-node-routes): the pure desired state
//! (nodes -> one route per remote pod CIDR via that node's InternalIP) and what each node's
//! row of `ciliate node list` says about it. No I/O here; `netlink.rs` applies the result.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

use crate::objects::NodeInfo;

/// `--routing-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RoutingMode {
    Native,
    Tunnel,
}

impl RoutingMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RoutingMode::Native => "native",
            RoutingMode::Tunnel => "tunnel",
        }
    }
}

/// `--tunnel-protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TunnelProtocol {
    Vxlan,
}

/// `--underlay-protocol` (Cilium's): the address family the tunnel's outer packets use, and so
/// which of a node's addresses its tunnel peers send to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UnderlayProtocol {
    Ipv4,
    Ipv6,
}

/// The routing settings of one agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingConfig {
    pub mode: RoutingMode,
    pub tunnel_protocol: TunnelProtocol,
    /// Tunnel mode: the outer packets' family (an IPv6-only cluster's nodes may have no IPv4
    /// address to tunnel to).
    pub underlay: UnderlayProtocol,
    /// Native mode: install routes to other nodes' pod CIDRs via their InternalIP.
    pub auto_direct_node_routes: bool,
    /// The cluster's pod address space: a remote pod CIDR outside it is not routed.
    pub native_routing_cidr: Option<Ipv4Net>,
    /// `--enable-ipv4`: other nodes' IPv4 pod CIDRs are routed (an IPv6-only node routes
    /// none: its pods have no IPv4 address to reach them from).
    pub ipv4: bool,
    /// `--enable-ipv6`: other nodes' IPv6 pod CIDRs are routed too: in native mode via their
    /// IPv6 address, in tunnel mode through the tunnel (over either underlay).
    pub ipv6: bool,
    /// `--ipv6-native-routing-cidr`: the IPv6 pod address space.
    pub ipv6_native_routing_cidr: Option<Ipv6Net>,
    /// Whether routes go into the kernel (false with `--datapath memory`, which touches no
    /// kernel state).
    pub install: bool,
    /// `--enable-ipv4-masquerade`: pod traffic leaving the native routing CIDR is SNATed.
    pub masquerade: bool,
    /// `--enable-ipv6-masquerade` (with `--enable-ipv6`): the same for IPv6 pod traffic
    /// leaving `--ipv6-native-routing-cidr`.
    pub masquerade6: bool,
    /// BPF host routing (eBPF datapath, unless `--enable-host-legacy-routing`): where the
    /// pinned maps are, whose `host_routes` gets the installed routes' prefixes and whose node
    /// device program is attached to the device holding the node's InternalIP (native mode)
    /// or to the agent's vxlan device (tunnel mode).
    pub bpf_host_routing: Option<std::path::PathBuf>,
    /// The eBPF datapath's pin root (`None` with the in-memory datapath): with BPF host routing
    /// off, a node device program an earlier run attached is taken off.
    pub bpf_pins: Option<std::path::PathBuf>,
    /// `--enable-host-firewall` (eBPF datapath): the host firewall's programs go on the native
    /// devices (`devices`, `datapath::bpf::host_firewall`); off, an earlier run's are taken
    /// off.
    pub host_firewall: bool,
    /// `--devices`: the node's native devices (`devices`).
    pub devices: super::devices::DeviceSelector,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            mode: RoutingMode::Native,
            tunnel_protocol: TunnelProtocol::Vxlan,
            underlay: UnderlayProtocol::Ipv4,
            auto_direct_node_routes: true,
            native_routing_cidr: None,
            ipv4: true,
            ipv6: false,
            ipv6_native_routing_cidr: None,
            install: false,
            masquerade: true,
            masquerade6: false,
            bpf_host_routing: None,
            bpf_pins: None,
            host_firewall: false,
            devices: Default::default(),
        }
    }
}

/// One route the agent owns: the main table, `dst via gateway`, protocol `RTPROT_CILIATE`.
/// Either family (the seam of #31); today's desired state holds IPv4 routes only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeRoute {
    pub dst: IpNet,
    pub via: IpAddr,
}

/// What the desired state says about one node, before the kernel had its say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlan {
    pub name: String,
    pub ips: Vec<IpAddr>,
    pub pod_cidrs: Vec<String>,
    pub local: bool,
    pub routes: Vec<NodeRoute>,
    /// Why the node gets no route although it should (names the node and field).
    pub problem: Option<String>,
}

/// The node's IPv4 pod CIDRs: `spec.podCIDRs`, else the pod-CIDR annotations (as IPAM reads
/// them). A value that is not a CIDR is an error naming its field.
pub fn pod_cidrs_v4(node: &NodeInfo) -> Result<Vec<Ipv4Net>, String> {
    let mut out = Vec::new();
    for (i, c) in node.pod_cidrs.iter().enumerate() {
        let net: ipnet::IpNet = c
            .parse()
            .map_err(|_| format!("spec.podCIDRs[{i}]: {c:?} is not a CIDR"))?;
        if let ipnet::IpNet::V4(n) = net {
            out.push(n.trunc());
        }
    }
    if out.is_empty() {
        if let Some((ipnet::IpNet::V4(n), _)) = crate::ipam::node_pod_cidr(&[], &node.annotations)?
        {
            out.push(n.trunc());
        }
    }
    Ok(out)
}

/// The address other nodes route through: the first IPv4 address (InternalIP first).
pub fn node_ipv4(node: &NodeInfo) -> Option<Ipv4Addr> {
    node.ips.iter().find_map(|ip| match ip {
        IpAddr::V4(v4) => Some(*v4),
        IpAddr::V6(_) => None,
    })
}

/// The node's address its tunnel peers send to: of the underlay's family.
pub fn underlay_address(node: &NodeInfo, underlay: UnderlayProtocol) -> Option<IpAddr> {
    match underlay {
        UnderlayProtocol::Ipv4 => node_ipv4(node).map(IpAddr::V4),
        UnderlayProtocol::Ipv6 => node.ips.iter().find(|ip| ip.is_ipv6()).copied(),
    }
}

/// The address that names the node's own device: its first IPv4 address, else (an IPv6-only
/// node) its first IPv6 one.
pub fn node_address(node: &NodeInfo) -> Option<IpAddr> {
    node_ipv4(node)
        .map(IpAddr::V4)
        .or_else(|| node.ips.iter().find(|ip| ip.is_ipv6()).copied())
}

/// The node's IPv6 pod CIDRs (`spec.podCIDRs`, else Cilium's IPv6 annotations).
pub fn pod_cidrs_v6(node: &NodeInfo) -> Result<Vec<Ipv6Net>, String> {
    let found = crate::ipam::node_pod_cidr_of(&node.pod_cidrs, &node.annotations, true)?;
    Ok(match found {
        Some((IpNet::V6(n), _)) => vec![n.trunc()],
        Some((IpNet::V4(n), _)) => return Err(format!("{n} is no IPv6 pod CIDR")),
        None => Vec::new(),
    })
}

/// The pod CIDRs a node's routes go to: IPv4's, and IPv6's where `cfg` routes them.
fn routed_cidrs(node: &NodeInfo, cfg: &RoutingConfig) -> Result<Vec<IpNet>, String> {
    let mut out: Vec<IpNet> = Vec::new();
    if cfg.ipv4 {
        out.extend(pod_cidrs_v4(node)?.into_iter().map(IpNet::V4));
    }
    if cfg.ipv6 {
        out.extend(pod_cidrs_v6(node)?.into_iter().map(IpNet::V6));
    }
    Ok(out)
}

/// The desired state: for every other node, one route per IPv4 pod CIDR via its address.
/// A node that cannot be routed (no IPv4 address, a bad CIDR, a CIDR outside the native
/// routing CIDR, or one claimed by another node or by this node) gets no route and a problem.
pub fn desired_routes(
    local: &str,
    nodes: &BTreeMap<String, NodeInfo>,
    cfg: &RoutingConfig,
) -> Vec<NodePlan> {
    let cidrs: BTreeMap<&str, Result<Vec<IpNet>, String>> = nodes
        .iter()
        .map(|(name, n)| (name.as_str(), routed_cidrs(n, cfg)))
        .collect();
    // Who claims each prefix: a prefix claimed twice is routed to neither.
    let mut claims: HashMap<IpNet, Vec<&str>> = HashMap::new();
    for (name, c) in &cidrs {
        for net in c.iter().flatten() {
            claims.entry(*net).or_default().push(name);
        }
    }
    nodes
        .iter()
        .map(|(name, node)| {
            let local_node = name == local;
            let mut plan = NodePlan {
                name: name.clone(),
                ips: node.ips.clone(),
                pod_cidrs: node.pod_cidrs.clone(),
                local: local_node,
                routes: Vec::new(),
                problem: None,
            };
            // Tunnel mode routes every remote pod CIDR through the tunnel; native mode only
            // with auto-direct-node-routes (else the network's router does).
            if local_node || (cfg.mode == RoutingMode::Native && !cfg.auto_direct_node_routes) {
                return plan;
            }
            plan.problem = node_routes(name, node, &cidrs[name.as_str()], &claims, cfg)
                .map(|r| plan.routes = r)
                .err();
            plan
        })
        .collect()
}

fn node_routes(
    name: &str,
    node: &NodeInfo,
    cidrs: &Result<Vec<IpNet>, String>,
    claims: &HashMap<IpNet, Vec<&str>>,
    cfg: &RoutingConfig,
) -> Result<Vec<NodeRoute>, String> {
    let cidrs = cidrs.as_ref().map_err(|e| format!("Node {name}: {e}"))?;
    let mut routes = Vec::new();
    for net in cidrs {
        let via = route_via(name, node, net, cfg)?;
        if let (Some(space), IpNet::V4(v4)) = (cfg.native_routing_cidr, net) {
            if !space.contains(v4) {
                return Err(format!(
                    "Node {name}: pod CIDR {net} is outside --ipv4-native-routing-cidr {space}"
                ));
            }
        }
        if let (Some(space), IpNet::V6(v6)) = (cfg.ipv6_native_routing_cidr, net) {
            if !space.contains(v6) {
                return Err(format!(
                    "Node {name}: pod CIDR {net} is outside --ipv6-native-routing-cidr {space}"
                ));
            }
        }
        if net.contains(&via) {
            return Err(format!(
                "Node {name}: pod CIDR {net} holds the node's own address {via}"
            ));
        }
        if let Some(others) = claims.get(net).filter(|c| c.len() > 1) {
            return Err(format!(
                "Node {name}: pod CIDR {net} is also claimed by {}",
                others
                    .iter()
                    .filter(|o| **o != name)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        routes.push(NodeRoute { dst: *net, via });
    }
    Ok(routes)
}

/// The node address a pod CIDR of `net`'s family is routed through.
/// In tunnel mode every route goes via the node's address of the underlay's family (the
/// applier gives an IPv6 route a next hop of its own family standing for it, `tunnel::gateway6`;
/// an IPv4 pod CIDR cannot go over an IPv6 underlay).
fn route_via(
    name: &str,
    node: &NodeInfo,
    net: &IpNet,
    cfg: &RoutingConfig,
) -> Result<IpAddr, String> {
    match net {
        IpNet::V4(_) if cfg.mode == RoutingMode::Tunnel && cfg.underlay == UnderlayProtocol::Ipv6 => {
            Err(format!("pod CIDR {net}: an IPv4 pod CIDR cannot go through the IPv6 underlay (--underlay-protocol ipv6)"))
        }
        IpNet::V4(_) | IpNet::V6(_) if cfg.mode == RoutingMode::Tunnel => {
            underlay_address(node, cfg.underlay).ok_or_else(|| {
                let family = match cfg.underlay {
                    UnderlayProtocol::Ipv4 => "IPv4",
                    UnderlayProtocol::Ipv6 => "IPv6",
                };
                format!("Node {name}: status.addresses: no {family} InternalIP (the tunnel's underlay)")
            })
        }
        IpNet::V4(_) => node_ipv4(node)
            .map(IpAddr::V4)
            .ok_or_else(|| format!("Node {name}: status.addresses: no IPv4 InternalIP")),
        IpNet::V6(_) => node
            .ips
            .iter()
            .find(|ip| ip.is_ipv6())
            .copied()
            .ok_or_else(|| format!("Node {name}: status.addresses: no IPv6 InternalIP")),
    }
}

/// Every route of a plan, once.
pub fn all_routes(plans: &[NodePlan]) -> BTreeSet<NodeRoute> {
    plans
        .iter()
        .flat_map(|p| p.routes.iter().copied())
        .collect()
}

/// One row of `ciliate node list` (interfaces.md section 8).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRow {
    pub name: String,
    pub ips: Vec<String>,
    pub pod_cidrs: Vec<String>,
    pub local: bool,
    /// `installed`, `tunnel`, `none` or `error: ...`.
    pub route: String,
}

/// A node's row from its plan and what became of its routes in the kernel (`None` when
/// nothing is installed: the memory datapath, or no routes).
pub fn node_row(
    plan: &NodePlan,
    cfg: &RoutingConfig,
    outcome: &BTreeMap<NodeRoute, Result<(), String>>,
) -> NodeRow {
    let route = if let Some(p) = &plan.problem {
        format!("error: {p}")
    } else if plan.local || plan.routes.is_empty() || !cfg.install {
        "none".into()
    } else {
        let errors: Vec<&str> = plan
            .routes
            .iter()
            .filter_map(|r| match outcome.get(r) {
                Some(Ok(())) => None,
                Some(Err(e)) => Some(e.as_str()),
                None => Some("not applied yet"),
            })
            .collect();
        if errors.is_empty() && cfg.mode == RoutingMode::Tunnel {
            "tunnel".into()
        } else if errors.is_empty() {
            "installed".into()
        } else {
            format!("error: {}", errors.join("; "))
        }
    };
    NodeRow {
        name: plan.name.clone(),
        ips: plan.ips.iter().map(|i| i.to_string()).collect(),
        pod_cidrs: plan.pod_cidrs.clone(),
        local: plan.local,
        route,
    }
}

/// A node's pod CIDRs of one family (none when they do not parse: the node's problem is
/// reported by the routes).
fn pod_cidrs_of(node: &NodeInfo, ipv6: bool) -> Vec<IpNet> {
    if ipv6 {
        let v6 = pod_cidrs_v6(node).unwrap_or_default();
        v6.into_iter().map(IpNet::V6).collect()
    } else {
        let v4 = pod_cidrs_v4(node).unwrap_or_default();
        v4.into_iter().map(IpNet::V4).collect()
    }
}

/// What to masquerade in one family: this node's pod CIDRs (from its Node object, else
/// `fallback`, the IPAM range of `--pod-cidr`), never toward the native routing CIDR, any
/// node's pod CIDR or any node's address.
pub fn masquerade_spec(
    local: &str,
    nodes: &BTreeMap<String, NodeInfo>,
    cfg: &RoutingConfig,
    fallback: Option<IpNet>,
    ipv6: bool,
) -> crate::datapath::masquerade::MasqueradeSpec {
    let mut pod_cidrs = nodes
        .get(local)
        .map(|n| pod_cidrs_of(n, ipv6))
        .unwrap_or_default();
    if pod_cidrs.is_empty() {
        pod_cidrs.extend(fallback);
    }
    let native_routing_cidr = match ipv6 {
        false => cfg.native_routing_cidr.map(IpNet::V4),
        true => cfg.ipv6_native_routing_cidr.map(IpNet::V6),
    };
    crate::datapath::masquerade::MasqueradeSpec {
        ipv6,
        pod_cidrs,
        native_routing_cidr,
        cluster_pod_cidrs: nodes.values().flat_map(|n| pod_cidrs_of(n, ipv6)).collect(),
        node_ips: nodes
            .values()
            .flat_map(|n| n.ips.iter().copied())
            .filter(|ip| ip.is_ipv6() == ipv6)
            .collect(),
    }
}

/// What the agent shows about routing (`node list`, `status`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RoutingView {
    pub mode: String,
    pub routes_installed: usize,
    /// `enabled` (the table is in the kernel), `disabled`, `none` (memory datapath: nothing in
    /// the kernel) or `error: ...`.
    pub masquerade: String,
    /// The same for IPv6 (`--enable-ipv6-masquerade`); empty without `--enable-ipv6`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub masquerade_ipv6: String,
    /// `bpf (<device>)`: BPF host routing both ways; `bpf, send side only: <why>`; `legacy`
    /// (`--enable-host-legacy-routing`): the host stack forwards; `none`
    /// (in-memory datapath).
    pub host_routing: String,
    /// Tunnel mode: who encapsulates and decapsulates, `bpf (<node address>)` (the programs,
    /// IPv4 over an IPv4 underlay; IPv6 pods still through the kernel's device), `kernel
    /// (<why>)`, `kernel: <error>` or `none` (in-memory datapath); empty in native routing.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub tunnel: String,
    /// The host firewall's devices, comma-separated (`eth0,eth1`), `off`, or what is wrong.
    pub host_firewall_device: String,
    pub nodes: Vec<NodeRow>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, ips: &[&str], cidrs: &[&str]) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            labels: Default::default(),
            annotations: Default::default(),
            ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
            pod_cidrs: cidrs.iter().map(|c| c.to_string()).collect(),
            kubelet_port: None,
        }
    }

    fn nodes(list: Vec<NodeInfo>) -> BTreeMap<String, NodeInfo> {
        list.into_iter().map(|n| (n.name.clone(), n)).collect()
    }

    fn native() -> RoutingConfig {
        RoutingConfig {
            install: true,
            ..Default::default()
        }
    }

    fn route(dst: &str, via: &str) -> NodeRoute {
        NodeRoute {
            dst: dst.parse().unwrap(),
            via: via.parse().unwrap(),
        }
    }

    #[test]
    fn every_other_node_gets_a_route_per_ipv4_pod_cidr_via_its_first_ipv4_address() {
        let n = nodes(vec![
            node("a", &["172.18.0.2"], &["10.1.1.0/24"]),
            node(
                "b",
                &["fd00::3", "172.18.0.3", "1.2.3.4"],
                &["10.1.2.0/24", "fd01::/64", "10.1.12.0/24"],
            ),
            node("c", &["172.18.0.4"], &[]),
        ]);
        let plans = desired_routes("a", &n, &native());
        assert_eq!(
            all_routes(&plans),
            BTreeSet::from([
                route("10.1.2.0/24", "172.18.0.3"),
                route("10.1.12.0/24", "172.18.0.3")
            ])
        );
        assert!(plans[0].local && plans[0].routes.is_empty());
        assert!(plans.iter().all(|p| p.problem.is_none()), "{plans:?}");
    }

    #[test]
    fn with_ipv6_native_mode_routes_ipv6_pod_cidrs_via_the_nodes_ipv6_address() {
        let n = nodes(vec![
            node(
                "a",
                &["172.18.0.2", "fd00:18::2"],
                &["10.1.1.0/24", "fd01:1::/112"],
            ),
            node(
                "b",
                &["172.18.0.3", "fd00:18::3"],
                &["10.1.2.0/24", "fd01:2::/112"],
            ),
        ]);
        let dual = RoutingConfig {
            ipv6: true,
            ..native()
        };
        assert_eq!(
            all_routes(&desired_routes("a", &n, &dual)),
            BTreeSet::from([
                route("10.1.2.0/24", "172.18.0.3"),
                route("fd01:2::/112", "fd00:18::3")
            ])
        );
        // Off: IPv4's routes only.
        assert_eq!(
            all_routes(&desired_routes("a", &n, &native())),
            BTreeSet::from([route("10.1.2.0/24", "172.18.0.3")])
        );
        // IPv6 only (`--enable-ipv4=false`): no IPv4 pod CIDR is routed, even one a Node names.
        let v6_only = RoutingConfig {
            ipv4: false,
            ..dual.clone()
        };
        assert_eq!(
            all_routes(&desired_routes("a", &n, &v6_only)),
            BTreeSet::from([route("fd01:2::/112", "fd00:18::3")])
        );
        assert_eq!(
            node_address(&n["b"]),
            Some("172.18.0.3".parse().unwrap()),
            "the device is found by IPv4 first"
        );
        let b6 = node("b", &["fd00:18::3"], &["fd01:2::/112"]);
        assert_eq!(node_address(&b6), Some("fd00:18::3".parse().unwrap()));
        // Tunnel mode over an IPv6 underlay: IPv6 pod CIDRs via the node's IPv6 address; an
        // IPv4 pod CIDR is a problem, named.
        let over6 = RoutingConfig {
            mode: RoutingMode::Tunnel,
            underlay: UnderlayProtocol::Ipv6,
            ..v6_only.clone()
        };
        assert_eq!(
            all_routes(&desired_routes("a", &n, &over6)),
            BTreeSet::from([route("fd01:2::/112", "fd00:18::3")])
        );
        let plans = desired_routes(
            "a",
            &n,
            &RoutingConfig {
                ipv4: true,
                ..over6
            },
        );
        let b = plans.iter().find(|p| p.name == "b").unwrap();
        assert!(
            b.problem
                .as_deref()
                .is_some_and(|p| p.contains("IPv6 underlay")),
            "{b:?}"
        );
        // Tunnel mode: both families via the node's IPv4 address, the tunnel's underlay.
        let tunnel = RoutingConfig {
            mode: RoutingMode::Tunnel,
            ..dual.clone()
        };
        assert_eq!(
            all_routes(&desired_routes("a", &n, &tunnel)),
            BTreeSet::from([
                route("10.1.2.0/24", "172.18.0.3"),
                route("fd01:2::/112", "172.18.0.3")
            ])
        );
        // Outside --ipv6-native-routing-cidr, or without an IPv6 address: a problem, named.
        let fenced = RoutingConfig {
            ipv6_native_routing_cidr: Some("fd02::/48".parse().unwrap()),
            ..dual.clone()
        };
        let plans = desired_routes("a", &n, &fenced);
        let b = plans.iter().find(|p| p.name == "b").unwrap();
        assert!(
            b.problem
                .as_deref()
                .is_some_and(|p| p.contains("--ipv6-native-routing-cidr fd02::/48")),
            "{b:?}"
        );
        let v4_only = nodes(vec![node(
            "c",
            &["172.18.0.4"],
            &["10.1.3.0/24", "fd01:3::/112"],
        )]);
        let plans = desired_routes("a", &v4_only, &dual);
        assert!(
            plans[0]
                .problem
                .as_deref()
                .is_some_and(|p| p.contains("no IPv6 InternalIP")),
            "{plans:?}"
        );
    }

    #[test]
    fn annotations_stand_in_for_the_spec_and_host_bits_are_dropped() {
        let mut b = node("b", &["172.18.0.3"], &[]);
        b.annotations.insert(
            crate::ipam::POD_CIDR_ANNOTATION.into(),
            "10.1.2.7/24".into(),
        );
        let plans = desired_routes("a", &nodes(vec![b]), &native());
        assert_eq!(plans[0].routes, vec![route("10.1.2.0/24", "172.18.0.3")]);
    }

    #[test]
    fn unroutable_nodes_get_no_route_and_a_problem_naming_node_and_field() {
        let cfg = RoutingConfig {
            native_routing_cidr: Some("10.1.0.0/16".parse().unwrap()),
            ..native()
        };
        let n = nodes(vec![
            node("a", &["172.18.0.2"], &["10.1.1.0/24"]),
            node("bad", &["172.18.0.3"], &["ten/24"]),
            node("noip", &["fd00::1"], &["10.1.4.0/24"]),
            node("outside", &["172.18.0.5"], &["10.9.0.0/24"]),
            node("dup1", &["172.18.0.6"], &["10.1.6.0/24"]),
            node("dup2", &["172.18.0.7"], &["10.1.6.0/24"]),
            node("mine", &["172.18.0.8"], &["10.1.1.0/24"]),
        ]);
        let plans = desired_routes("a", &n, &cfg);
        assert!(all_routes(&plans).is_empty(), "{plans:?}");
        let problem = |name: &str| {
            plans
                .iter()
                .find(|p| p.name == name)
                .and_then(|p| p.problem.clone())
                .unwrap_or_default()
        };
        assert!(problem("bad").contains("Node bad: spec.podCIDRs[0]"));
        assert!(problem("noip").contains("status.addresses"));
        assert!(problem("outside").contains("--ipv4-native-routing-cidr"));
        assert!(problem("dup1").contains("also claimed by dup2"));
        assert!(problem("dup2").contains("also claimed by dup1"));
        // A remote node claiming this node's CIDR never steals its pods' traffic.
        assert!(problem("mine").contains("also claimed by a"));
    }

    #[test]
    fn disabled_direct_routes_install_nothing_and_tunnel_mode_routes_through_the_tunnel() {
        let n = nodes(vec![node("b", &["172.18.0.3"], &["10.1.2.0/24"])]);
        let cfg = RoutingConfig {
            auto_direct_node_routes: false,
            ..native()
        };
        assert!(all_routes(&desired_routes("a", &n, &cfg)).is_empty());
        let tunnel = RoutingConfig {
            mode: RoutingMode::Tunnel,
            auto_direct_node_routes: false,
            ..native()
        };
        let plans = desired_routes("a", &n, &tunnel);
        let r = route("10.1.2.0/24", "172.18.0.3");
        assert_eq!(all_routes(&plans), BTreeSet::from([r]));
        let ok = BTreeMap::from([(r, Ok(()))]);
        assert_eq!(node_row(&plans[0], &tunnel, &ok).route, "tunnel");
        let memory = RoutingConfig {
            install: false,
            ..tunnel
        };
        assert_eq!(node_row(&plans[0], &memory, &ok).route, "none");
    }

    #[test]
    fn rows_say_installed_none_or_the_error() {
        let n = nodes(vec![
            node("a", &["172.18.0.2"], &["10.1.1.0/24"]),
            node("b", &["172.18.0.3"], &["10.1.2.0/24"]),
            node("c", &["172.18.0.4"], &["10.1.3.0/24"]),
        ]);
        let cfg = native();
        let plans = desired_routes("a", &n, &cfg);
        let outcome = BTreeMap::from([
            (route("10.1.2.0/24", "172.18.0.3"), Ok(())),
            (
                route("10.1.3.0/24", "172.18.0.4"),
                Err("route 10.1.3.0/24: File exists".to_string()),
            ),
        ]);
        let rows: Vec<String> = plans
            .iter()
            .map(|p| node_row(p, &cfg, &outcome).route)
            .collect();
        assert_eq!(
            rows,
            ["none", "installed", "error: route 10.1.3.0/24: File exists"]
        );
        let memory = RoutingConfig {
            install: false,
            ..cfg.clone()
        };
        assert_eq!(node_row(&plans[1], &memory, &outcome).route, "none");
        let row = node_row(&plans[1], &cfg, &outcome);
        assert_eq!(row.ips, ["172.18.0.3"]);
        assert_eq!(row.pod_cidrs, ["10.1.2.0/24"]);
        assert!(!row.local);
    }
}
