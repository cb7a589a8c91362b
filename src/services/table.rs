//! The pure service table: Services (ClusterIPs and ports) joined with their EndpointSlices
//! (addresses, readiness, ports by name) into frontends with backends, and the ids those get.
//! No I/O: [`super::ServiceLb`] writes what this computes into the datapath.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use serde::Serialize;

use crate::policy::rule::{PROTO_SCTP, PROTO_UDP};

/// A Service port's `targetPort`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum TargetPort {
    Number(u16),
    /// A container port name: resolved per pod by the EndpointSlice controller, so it is only
    /// ever found in the slices' ports.
    Name(String),
}

/// One entry of a Service's `spec.ports`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServicePort {
    pub name: String,
    pub protocol: u8,
    pub port: u16,
    /// `None` when absent: the same number as `port`.
    pub target_port: Option<TargetPort>,
}

/// One entry of an EndpointSlice's `ports`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlicePort {
    pub name: String,
    pub protocol: u8,
    pub port: Option<u16>,
}

/// One address of an EndpointSlice endpoint, with its `conditions.ready` (absent = ready).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SliceEndpoint {
    pub address: IpAddr,
    pub ready: bool,
}

/// What the table needs of a Service.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceSpec {
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
}

/// What the table needs of an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceSpec {
    pub namespace: String,
    /// The `kubernetes.io/service-name` label.
    pub service: String,
    pub endpoints: Vec<SliceEndpoint>,
    pub ports: Vec<SlicePort>,
}

/// Where clients connect: a ClusterIP, a port and a protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Frontend {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: u8,
}

/// Where a connection to a frontend goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Backend {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: u8,
}

/// Why `ip` can be no Service backend, if it cannot. The API server refuses these in an
/// EndpointSlice (`ValidateEndpointIP`: unspecified, loopback, link-local unicast and multicast);
/// we also refuse every multicast address and the IPv4 broadcast. A connection translated to
/// one would not leave the client (loopback: the client pod itself, outside any policy) or
/// would reach a node-local service (link-local: e.g. a cloud metadata endpoint). IPv4-mapped
/// IPv6 addresses are judged as the IPv4 address they carry (as Go's `net.IP` does).
pub fn refused_backend(ip: IpAddr) -> Option<&'static str> {
    match ip.to_canonical() {
        IpAddr::V4(a) if a.is_unspecified() => Some("unspecified"),
        IpAddr::V4(a) if a.is_loopback() => Some("loopback (127.0.0.0/8)"),
        IpAddr::V4(a) if a.is_link_local() => Some("link-local (169.254.0.0/16)"),
        IpAddr::V4(a) if a.is_multicast() => Some("multicast (224.0.0.0/4)"),
        IpAddr::V4(a) if a.is_broadcast() => Some("broadcast"),
        IpAddr::V6(a) if a.is_unspecified() => Some("unspecified"),
        IpAddr::V6(a) if a.is_loopback() => Some("loopback (::1)"),
        IpAddr::V6(a) if a.is_unicast_link_local() => Some("link-local (fe80::/10)"),
        IpAddr::V6(a) if a.is_multicast() => Some("multicast (ff00::/8)"),
        _ => None,
    }
}

pub fn protocol_name(p: u8) -> &'static str {
    match p {
        PROTO_UDP => "UDP",
        PROTO_SCTP => "SCTP",
        _ => "TCP",
    }
}

impl std::fmt::Display for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let proto = protocol_name(self.protocol);
        match self.ip {
            IpAddr::V4(a) => write!(f, "{a}:{}/{proto}", self.port),
            IpAddr::V6(a) => write!(f, "[{a}]:{}/{proto}", self.port),
        }
    }
}

/// (namespace, name) of a Service.
pub type ServiceName = (String, String);

/// A frontend with the service it belongs to and every backend (ready or not), in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrontendState {
    pub service: ServiceName,
    pub backends: Vec<(Backend, bool)>,
}

impl FrontendState {
    /// The backends new connections may go to.
    pub fn ready(&self) -> Vec<Backend> {
        self.backends
            .iter()
            .filter(|(_, ready)| *ready)
            .map(|(b, _)| *b)
            .collect()
    }
}

/// Services and slices as the API server has them.
#[derive(Debug, Clone, Default)]
pub struct ServiceTable {
    services: BTreeMap<ServiceName, ServiceSpec>,
    /// By `namespace/name` of the slice.
    slices: BTreeMap<String, SliceSpec>,
}

/// The backend port of `port` in `slice`: the slice port of the same name and protocol (the
/// EndpointSlice controller resolved named and numbered targetPorts into it); for a slice that
/// lists no such port (hand-written), a numbered (or absent) targetPort. A named targetPort the
/// slice does not resolve gives no backend: never a guess.
fn backend_port(port: &ServicePort, slice: &SliceSpec) -> Option<u16> {
    if let Some(p) = slice
        .ports
        .iter()
        .find(|p| p.name == port.name && p.protocol == port.protocol)
    {
        if let Some(n) = p.port {
            return Some(n);
        }
    }
    match &port.target_port {
        None => Some(port.port),
        Some(TargetPort::Number(n)) => Some(*n),
        Some(TargetPort::Name(_)) => None,
    }
}

impl ServiceTable {
    /// A Service appeared or changed (`Some`) or went away (`None`). Returns it as affected.
    pub fn set_service(&mut self, id: ServiceName, spec: Option<ServiceSpec>) -> Vec<ServiceName> {
        match spec {
            Some(s) => self.services.insert(id.clone(), s),
            None => self.services.remove(&id),
        };
        vec![id]
    }

    /// An EndpointSlice appeared or changed (`Some`) or went away (`None`). Returns the services
    /// it named before and after.
    pub fn set_slice(&mut self, key: &str, slice: Option<SliceSpec>) -> Vec<ServiceName> {
        let old = match slice {
            Some(s) => self.slices.insert(key.to_string(), s),
            None => self.slices.remove(key),
        };
        let affected: BTreeSet<ServiceName> = old
            .iter()
            .chain(self.slices.get(key))
            .map(|s| (s.namespace.clone(), s.service.clone()))
            .collect();
        affected.into_iter().collect()
    }

    pub fn services(&self) -> impl Iterator<Item = &ServiceName> {
        self.services.keys()
    }

    /// The frontends of one service with their backends (none when the service is unknown).
    /// Backends are deduplicated (an address listed twice counts as ready if either is).
    pub fn frontends_of(&self, id: &ServiceName) -> BTreeMap<Frontend, FrontendState> {
        let mut out = BTreeMap::new();
        let Some(spec) = self.services.get(id) else {
            return out;
        };
        let slices: Vec<&SliceSpec> = self
            .slices
            .values()
            .filter(|s| s.namespace == id.0 && s.service == id.1)
            .collect();
        for port in &spec.ports {
            let mut backends: BTreeMap<Backend, bool> = BTreeMap::new();
            for slice in &slices {
                let Some(target) = backend_port(port, slice) else {
                    continue;
                };
                for e in &slice.endpoints {
                    let b = Backend {
                        ip: e.address,
                        port: target,
                        protocol: port.protocol,
                    };
                    *backends.entry(b).or_insert(false) |= e.ready;
                }
            }
            for ip in &spec.cluster_ips {
                let fe = Frontend {
                    ip: *ip,
                    port: port.port,
                    protocol: port.protocol,
                };
                // A frontend only reaches backends of its own family.
                let backends = backends
                    .iter()
                    .filter(|(b, _)| b.ip.is_ipv4() == ip.is_ipv4())
                    .map(|(b, r)| (*b, *r))
                    .collect();
                out.insert(
                    fe,
                    FrontendState {
                        service: id.clone(),
                        backends,
                    },
                );
            }
        }
        out
    }

    /// Every frontend, in order. A frontend claimed by two services goes to the first by
    /// (namespace, name); the other is reported in the second list.
    pub fn frontends(
        &self,
    ) -> (
        BTreeMap<Frontend, FrontendState>,
        Vec<(Frontend, ServiceName)>,
    ) {
        let mut all = BTreeMap::new();
        let mut conflicts = Vec::new();
        for id in self.services.keys() {
            for (fe, st) in self.frontends_of(id) {
                match all.entry(fe) {
                    std::collections::btree_map::Entry::Occupied(_) => {
                        conflicts.push((fe, id.clone()))
                    }
                    std::collections::btree_map::Entry::Vacant(v) => {
                        v.insert(st);
                    }
                }
            }
        }
        (all, conflicts)
    }
}

/// Service ids per frontend and backend ids per backend, as Cilium's service and backend ids:
/// an id stays with its frontend (backend) while it exists, is read back from the pinned maps
/// at start, and is never handed out again once released (the counters only grow and are kept
/// in the datapath too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ids {
    services: BTreeMap<Frontend, u32>,
    backends: BTreeMap<Backend, u32>,
    pub next_service: u32,
    pub next_backend: u32,
}

impl Default for Ids {
    fn default() -> Self {
        Ids {
            services: BTreeMap::new(),
            backends: BTreeMap::new(),
            next_service: 1,
            next_backend: 1,
        }
    }
}

impl Ids {
    /// Ids read back from the datapath; the counters start past every id seen.
    pub fn restore(
        services: impl IntoIterator<Item = (Frontend, u32)>,
        backends: impl IntoIterator<Item = (Backend, u32)>,
        next_service: u32,
        next_backend: u32,
    ) -> Ids {
        let services: BTreeMap<Frontend, u32> = services.into_iter().collect();
        let backends: BTreeMap<Backend, u32> = backends.into_iter().collect();
        let past = |ids: &mut dyn Iterator<Item = u32>, next: u32| {
            ids.max()
                .map_or(next, |m| next.max(m.saturating_add(1)))
                .max(1)
        };
        Ids {
            next_service: past(&mut services.values().copied(), next_service),
            next_backend: past(&mut backends.values().copied(), next_backend),
            services,
            backends,
        }
    }

    pub fn service(&mut self, fe: Frontend) -> u32 {
        let next = &mut self.next_service;
        *self.services.entry(fe).or_insert_with(|| {
            let id = *next;
            *next = next.saturating_add(1);
            id
        })
    }

    pub fn backend(&mut self, b: Backend) -> u32 {
        let next = &mut self.next_backend;
        *self.backends.entry(b).or_insert_with(|| {
            let id = *next;
            *next = next.saturating_add(1);
            id
        })
    }

    pub fn service_id(&self, fe: &Frontend) -> Option<u32> {
        self.services.get(fe).copied()
    }

    pub fn release_service(&mut self, fe: &Frontend) {
        self.services.remove(fe);
    }

    pub fn release_backend(&mut self, b: &Backend) -> Option<u32> {
        self.backends.remove(b)
    }

    pub fn services(&self) -> &BTreeMap<Frontend, u32> {
        &self.services
    }

    pub fn backends(&self) -> &BTreeMap<Backend, u32> {
        &self.backends
    }
}

/// An EndpointSlice of `service` in namespace `ns` (for tests): (address, ready) endpoints
/// and (name, port) TCP ports.
#[cfg(test)]
pub(crate) fn test_slice(service: &str, eps: &[(&str, bool)], ports: &[(&str, u16)]) -> SliceSpec {
    let ip = |a: &str| a.parse().expect("an address");
    SliceSpec {
        namespace: "ns".into(),
        service: service.into(),
        endpoints: eps
            .iter()
            .map(|(a, r)| SliceEndpoint {
                address: ip(a),
                ready: *r,
            })
            .collect(),
        ports: ports
            .iter()
            .map(|(n, p)| SlicePort {
                name: n.to_string(),
                protocol: crate::policy::rule::PROTO_TCP,
                port: Some(*p),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::rule::PROTO_TCP;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn svc(ports: Vec<ServicePort>) -> ServiceSpec {
        ServiceSpec {
            cluster_ips: vec![ip("10.96.0.50")],
            ports,
        }
    }

    fn port(name: &str, port: u16, target: Option<TargetPort>) -> ServicePort {
        ServicePort {
            name: name.into(),
            protocol: PROTO_TCP,
            port,
            target_port: target,
        }
    }

    pub(crate) use super::test_slice as slice;

    fn id(name: &str) -> ServiceName {
        ("ns".into(), name.into())
    }

    fn fe(port: u16) -> Frontend {
        Frontend {
            ip: ip("10.96.0.50"),
            port,
            protocol: PROTO_TCP,
        }
    }

    #[test]
    fn named_target_ports_come_from_the_slice_by_port_name() {
        let mut t = ServiceTable::default();
        t.set_service(
            id("b"),
            Some(svc(vec![port(
                "http",
                80,
                Some(TargetPort::Name("web".into())),
            )])),
        );
        // No slice yet: the frontend exists, without backends (connections fail closed).
        assert!(t.frontends_of(&id("b"))[&fe(80)].backends.is_empty());
        let affected = t.set_slice(
            "ns/b-1",
            Some(slice(
                "b",
                &[("10.1.0.2", true), ("10.1.0.3", false)],
                &[("http", 8080)],
            )),
        );
        assert_eq!(affected, vec![id("b")]);
        let st = &t.frontends_of(&id("b"))[&fe(80)];
        assert_eq!(st.backends.len(), 2);
        assert_eq!(
            st.ready(),
            vec![Backend {
                ip: ip("10.1.0.2"),
                port: 8080,
                protocol: PROTO_TCP
            }]
        );
        // A slice without the port cannot resolve a named targetPort: no backend, no guess.
        t.set_slice("ns/b-1", Some(slice("b", &[("10.1.0.2", true)], &[])));
        assert!(t.frontends_of(&id("b"))[&fe(80)].backends.is_empty());
    }

    #[test]
    fn numbered_and_absent_target_ports() {
        let mut t = ServiceTable::default();
        t.set_service(
            id("n"),
            Some(svc(vec![
                port("", 80, Some(TargetPort::Number(8080))),
                port("x", 81, None),
            ])),
        );
        t.set_slice("ns/n-1", Some(slice("n", &[("10.1.0.2", true)], &[])));
        let f = t.frontends_of(&id("n"));
        assert_eq!(f[&fe(80)].ready()[0].port, 8080);
        assert_eq!(f[&fe(81)].ready()[0].port, 81);
        // The slice's resolved port wins over the Service's number.
        t.set_slice(
            "ns/n-1",
            Some(slice("n", &[("10.1.0.2", true)], &[("", 9090)])),
        );
        assert_eq!(t.frontends_of(&id("n"))[&fe(80)].ready()[0].port, 9090);
    }

    #[test]
    fn slices_join_in_any_order_and_leave() {
        let mut t = ServiceTable::default();
        t.set_slice(
            "ns/b-1",
            Some(slice("b", &[("10.1.0.2", true)], &[("", 8080)])),
        );
        t.set_slice(
            "ns/b-2",
            Some(slice("b", &[("10.1.0.3", true)], &[("", 8080)])),
        );
        assert!(t.frontends_of(&id("b")).is_empty(), "no service yet");
        t.set_service(id("b"), Some(svc(vec![port("", 80, None)])));
        assert_eq!(t.frontends_of(&id("b"))[&fe(80)].ready().len(), 2);
        t.set_slice("ns/b-1", None);
        assert_eq!(t.frontends_of(&id("b"))[&fe(80)].ready().len(), 1);
        // A slice moving to another service affects both.
        let affected = t.set_slice(
            "ns/b-2",
            Some(slice("c", &[("10.1.0.3", true)], &[("", 8080)])),
        );
        assert_eq!(affected, vec![id("b"), id("c")]);
        t.set_service(id("b"), None);
        assert!(t.frontends().0.is_empty());
    }

    #[test]
    fn a_frontend_claimed_twice_goes_to_the_first_service() {
        let mut t = ServiceTable::default();
        t.set_service(id("a"), Some(svc(vec![port("", 80, None)])));
        t.set_service(id("z"), Some(svc(vec![port("", 80, None)])));
        let (all, conflicts) = t.frontends();
        assert_eq!(all[&fe(80)].service, id("a"));
        assert_eq!(conflicts, vec![(fe(80), id("z"))]);
    }

    #[test]
    fn ids_are_stable_restored_and_never_reused() {
        let mut ids = Ids::default();
        let a = ids.service(fe(80));
        let b = ids.service(fe(81));
        assert_eq!(ids.service(fe(80)), a);
        assert_ne!(a, b);
        ids.release_service(&fe(81));
        let c = ids.service(fe(82));
        assert!(c > b, "a released id is not handed out again");
        // Restored: the same ids; new ones start past the counter kept in the datapath, even
        // when the highest id was released before the restart.
        let mut r = Ids::restore([(fe(80), a)], [], ids.next_service, ids.next_backend);
        assert_eq!(r.service(fe(80)), a);
        assert!(r.service(fe(83)) > c);
        // A lost counter never goes below what the restored ids imply.
        let mut r = Ids::restore([(fe(80), 7)], [], 0, 0);
        assert_eq!(r.service(fe(84)), 8);
        let be = Backend {
            ip: ip("10.1.0.2"),
            port: 8080,
            protocol: PROTO_TCP,
        };
        assert_eq!(r.backend(be), 1);
    }

    #[test]
    fn backends_the_api_server_would_refuse_are_named() {
        for (addr, why) in [
            ("0.0.0.0", "unspecified"),
            ("127.0.0.1", "loopback"),
            ("127.255.0.9", "loopback"),
            ("169.254.169.254", "link-local"),
            ("224.0.0.251", "multicast"),
            ("239.1.2.3", "multicast"),
            ("255.255.255.255", "broadcast"),
            ("::", "unspecified"),
            ("::1", "loopback"),
            ("fe80::1", "link-local"),
            ("ff02::fb", "multicast"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:169.254.1.1", "link-local"),
        ] {
            let got = refused_backend(ip(addr));
            assert!(got.is_some_and(|g| g.starts_with(why)), "{addr}: {got:?}");
        }
        for addr in [
            "10.1.0.2",
            "172.18.0.2",
            "192.168.1.1",
            "100.64.0.1",
            "8.8.8.8",
            "10.255.255.255",
            "fd00::10",
            "2001:db8::1",
            "::ffff:10.1.0.2",
        ] {
            assert_eq!(refused_backend(ip(addr)), None, "{addr}");
        }
    }

    #[test]
    fn frontends_print_as_ip_port_proto() {
        assert_eq!(fe(80).to_string(), "10.96.0.50:80/TCP");
        let v6 = Frontend {
            ip: ip("fd00::1"),
            port: 53,
            protocol: PROTO_UDP,
        };
        assert_eq!(v6.to_string(), "[fd00::1]:53/UDP");
    }
}
