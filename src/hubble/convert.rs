//! A flow record as Hubble's `flow.Flow`. The record is the agent's one flow type
//! (`VerdictEvent`, what `ciliate monitor` prints), so the Observer and `monitor` always agree;
//! what the record does not carry (the identities' labels, the DNS names of an address) is asked
//! of the agent at conversion time through `Lookup`.
//!
//! How ciliate's records map onto Cilium's event types:
//! - a verdict a policy decided (a new connection, allowed, denied or audited; `match` set) is a
//!   policy verdict (type 5), as Cilium reports it;
//! - any other drop (not realized, malformed) is a drop (type 1) with its drop reason as subtype;
//! - any other forwarded packet (established, reply, unmanaged) is a trace (type 4) from or to
//!   the endpoint;
//! - an HTTP request or DNS query a proxy judged is an access log (type 129, L7): a forwarded
//!   query as its answer (`DNS Answer ...`), a refused one as the request the proxy refused.
//!
//! `l4` carries both ports and, for TCP, the flags of the packet the datapath judged (a new
//! connection's SYN, a dropped packet's flags); records of an older program lack them (0).

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;

use crate::datapath::events::VerdictEvent;
use crate::objects::Workload;
use crate::policy::attribution::PolicyRef;

use super::proto::flow as pb;

/// Cilium's monitor message types (`pkg/monitor/api`).
pub const EVENT_DROP: i32 = 1;
pub const EVENT_TRACE: i32 = 4;
pub const EVENT_POLICY_VERDICT: i32 = 5;
pub const EVENT_ACCESS_LOG: i32 = 129;

/// Cilium's trace subtypes (observation points) for a packet to and from an endpoint.
const TRACE_TO_LXC: i32 = 0;
const TRACE_FROM_LXC: i32 = 5;

/// What the agent knows now of an address and an identity.
pub trait Lookup {
    /// The security identity of an address (the ipcache's answer; 0 when unknown).
    fn identity_of(&self, ip: IpAddr) -> u32;
    /// An identity's labels, `source:key=value` (`k8s:app=web`).
    fn labels_of(&self, identity: u32) -> Vec<String>;
    /// The DNS names the agent learned the address under.
    fn names_of(&self, ip: IpAddr) -> Vec<String>;
    /// The workload of a pod (`namespace/name`) whose Pod object the agent reads.
    fn workload_of(&self, pod: &str) -> Option<Workload>;
}

/// A lookup that knows nothing (tests, and flows converted without an agent).
pub struct NoLookup;

impl Lookup for NoLookup {
    fn identity_of(&self, _: IpAddr) -> u32 {
        0
    }
    fn labels_of(&self, _: u32) -> Vec<String> {
        Vec::new()
    }
    fn names_of(&self, _: IpAddr) -> Vec<String> {
        Vec::new()
    }
    fn workload_of(&self, _: &str) -> Option<Workload> {
        None
    }
}

impl<T: Lookup + ?Sized> Lookup for std::sync::Arc<T> {
    fn identity_of(&self, ip: IpAddr) -> u32 {
        (**self).identity_of(ip)
    }
    fn labels_of(&self, identity: u32) -> Vec<String> {
        (**self).labels_of(identity)
    }
    fn names_of(&self, ip: IpAddr) -> Vec<String> {
        (**self).names_of(ip)
    }
    fn workload_of(&self, pod: &str) -> Option<Workload> {
        (**self).workload_of(pod)
    }
}

/// A lookup that asks `inner` once per identity and address and remembers the answers: for
/// one call's worth of flows (a `GetFlows` history), where the same few peers recur thousands of
/// times and the agent's state is read once.
pub struct Memo<L> {
    inner: L,
    identities: RefCell<HashMap<IpAddr, u32>>,
    labels: RefCell<HashMap<u32, Vec<String>>>,
    names: RefCell<HashMap<IpAddr, Vec<String>>>,
}

impl<L: Lookup> Memo<L> {
    pub fn new(inner: L) -> Memo<L> {
        Memo {
            inner,
            identities: Default::default(),
            labels: Default::default(),
            names: Default::default(),
        }
    }
}

/// The answer remembered for `key`, asked with `ask` the first time.
fn remember<K: Hash + Eq, V: Clone>(
    answers: &RefCell<HashMap<K, V>>,
    key: K,
    ask: impl FnOnce() -> V,
) -> V {
    answers.borrow_mut().entry(key).or_insert_with(ask).clone()
}

impl<L: Lookup> Lookup for Memo<L> {
    fn identity_of(&self, ip: IpAddr) -> u32 {
        remember(&self.identities, ip, || self.inner.identity_of(ip))
    }
    fn labels_of(&self, identity: u32) -> Vec<String> {
        remember(&self.labels, identity, || self.inner.labels_of(identity))
    }
    fn names_of(&self, ip: IpAddr) -> Vec<String> {
        remember(&self.names, ip, || self.inner.names_of(ip))
    }
    fn workload_of(&self, pod: &str) -> Option<Workload> {
        // Asked once per side a writer encodes (`wire` keeps the endpoint), so not kept here.
        self.inner.workload_of(pod)
    }
}

/// The record's verdict in Hubble's enum.
pub fn verdict(ev: &VerdictEvent) -> pb::Verdict {
    match ev.verdict.as_str() {
        "forwarded" => pb::Verdict::Forwarded,
        "dropped" => pb::Verdict::Dropped,
        "audit" => pb::Verdict::Audit,
        _ => pb::Verdict::Unknown,
    }
}

/// Why a dropped record was dropped, in Cilium's numbers (unknown for anything not dropped).
pub fn drop_reason(ev: &VerdictEvent) -> pb::DropReason {
    if ev.verdict != "dropped" {
        return pb::DropReason::Unknown;
    }
    match ev.reason.as_str() {
        "policy-deny" => pb::DropReason::PolicyDeny,
        "default-deny" | "l7-deny" => pb::DropReason::PolicyDenied,
        "not-realized" => pb::DropReason::NoConfigurationAvailableToPerformPolicyDecision,
        "malformed" => pb::DropReason::InvalidPacketDropped,
        "not-ip" => pb::DropReason::UnsupportedL3Protocol,
        "not-a-tunnel-peer" => pb::DropReason::InvalidSourceIp,
        _ => pb::DropReason::Unknown,
    }
}

/// Cilium's event type and subtype of the record (see the module's words).
pub fn event_type(ev: &VerdictEvent) -> (i32, i32) {
    if ev.kind == "l7" {
        (EVENT_ACCESS_LOG, 0)
    } else if ev.match_kind.is_some() {
        (EVENT_POLICY_VERDICT, 0)
    } else if ev.verdict == "dropped" {
        (EVENT_DROP, drop_reason(ev) as i32)
    } else if ev.direction == "egress" {
        (EVENT_TRACE, TRACE_FROM_LXC)
    } else {
        (EVENT_TRACE, TRACE_TO_LXC)
    }
}

/// The labels `hubble_flows_processed_total` counts the record under: Cilium's message type
/// name and subtype (`Trace` / `to-endpoint`, `L7` / `HTTP`, `PolicyVerdict`, `Drop`), and the
/// verdict (`FORWARDED`).
pub fn processed_labels(ev: &VerdictEvent) -> (&'static str, &'static str, &'static str) {
    let (ty, sub) = event_type(ev);
    let (ty, sub) = match ty {
        EVENT_ACCESS_LOG if ev.dns.is_some() => ("L7", "DNS"),
        EVENT_ACCESS_LOG => ("L7", "HTTP"),
        EVENT_POLICY_VERDICT => ("PolicyVerdict", ""),
        EVENT_DROP => ("Drop", ""),
        _ if sub == TRACE_FROM_LXC => ("Trace", "from-endpoint"),
        _ => ("Trace", "to-endpoint"),
    };
    (ty, sub, verdict(ev).as_str_name())
}

/// Whether the record is of a reply (`None`: not known).
fn is_reply(ev: &VerdictEvent) -> Option<bool> {
    match ev.reason.as_str() {
        "reply" => Some(true),
        "unmanaged" | "not-ip" | "ring-buffer-full" => None,
        _ => Some(false),
    }
}

/// Cilium's policy match types.
fn match_type(m: Option<&str>) -> u32 {
    match m {
        Some("l3-only") => 1,
        Some("l3-l4") => 2,
        Some("l4-only") => 3,
        Some("all") => 4,
        _ => 0,
    }
}

/// A deciding policy as Hubble's `Policy`, with the labels Cilium gives a policy's rules.
pub fn policy(p: &PolicyRef, revision: Option<u64>) -> pb::Policy {
    let label = |key: &str, value: &str| {
        let mut l = String::with_capacity(key.len() + value.len());
        l.push_str(key);
        l.push_str(value);
        l
    };
    let mut labels = Vec::with_capacity(3);
    labels.push(label("k8s:io.cilium.k8s.policy.derived-from=", &p.kind));
    labels.push(label("k8s:io.cilium.k8s.policy.name=", &p.name));
    if let Some(ns) = &p.namespace {
        labels.push(label("k8s:io.cilium.k8s.policy.namespace=", ns));
    }
    pb::Policy {
        name: p.name.clone(),
        namespace: p.namespace.clone().unwrap_or_default(),
        labels,
        revision: revision.unwrap_or(0),
        kind: p.kind.clone(),
    }
}

/// One side of a flow as the record names it: its address, its pod (`namespace/name`), the
/// endpoint id (0 for a peer the node does not host) and, for the peer, the identity the
/// datapath judged (`None`: the agent's answer for the address).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Side<'a> {
    pub ip: Option<IpAddr>,
    pub pod: Option<&'a str>,
    pub id: u32,
    pub identity: Option<u32>,
}

/// The record's source and destination: the endpoint the record is about is the source of its
/// egress and the destination of its ingress; the peer's identity is the one the datapath judged.
pub fn sides(ev: &VerdictEvent) -> (Side<'_>, Side<'_>) {
    let egress = ev.direction == "egress";
    let source = Side {
        ip: ev.source.parse().ok(),
        pod: ev.source_pod.as_deref(),
        id: if egress { ev.endpoint } else { 0 },
        identity: (!egress).then_some(ev.peer_identity),
    };
    let destination = Side {
        ip: ev.destination.parse().ok(),
        pod: ev.destination_pod.as_deref(),
        id: if egress { 0 } else { ev.endpoint },
        identity: egress.then_some(ev.peer_identity),
    };
    (source, destination)
}

/// One side as Hubble's endpoint: its identity, pod and labels.
pub fn endpoint(side: &Side<'_>, lookup: &dyn Lookup) -> pb::Endpoint {
    let identity = side
        .identity
        .unwrap_or_else(|| side.ip.map_or(0, |ip| lookup.identity_of(ip)));
    let (namespace, pod_name) = match side.pod.and_then(|p| p.split_once('/')) {
        Some((ns, name)) => (ns.to_string(), name.to_string()),
        None => (String::new(), String::new()),
    };
    let workloads = side.pod.and_then(|p| lookup.workload_of(p));
    pb::Endpoint {
        id: side.id,
        identity,
        namespace,
        labels: lookup.labels_of(identity),
        pod_name,
        workloads: workloads
            .map(|w| pb::Workload {
                name: w.name,
                kind: w.kind,
            })
            .into_iter()
            .collect(),
    }
}

/// The DNS names of one side's address.
pub fn names(side: &Side<'_>, lookup: &dyn Lookup) -> Vec<String> {
    side.ip.map(|ip| lookup.names_of(ip)).unwrap_or_default()
}

/// The flow's lists of deciding policies (`Flow`'s field numbers).
pub const EGRESS_ALLOWED_BY: u32 = 21001;
pub const INGRESS_ALLOWED_BY: u32 = 21002;
pub const EGRESS_DENIED_BY: u32 = 21004;
pub const INGRESS_DENIED_BY: u32 = 21005;

/// Which list the record's deciding policies go in: allowed or denied by, in its direction.
pub fn policy_list(ev: &VerdictEvent) -> u32 {
    match (ev.verdict == "forwarded", ev.direction == "egress") {
        (true, true) => EGRESS_ALLOWED_BY,
        (true, false) => INGRESS_ALLOWED_BY,
        (false, true) => EGRESS_DENIED_BY,
        (false, false) => INGRESS_DENIED_BY,
    }
}

/// A stable id of the record (the same flow has the same id in every call), as a UUID (version
/// 8: derived by the agent, not random).
fn uuid(ev: &VerdictEvent, node: &str) -> String {
    let half = |salt: u8| {
        // A fixed seed: the same flow has the same id in every process and every call.
        let mut h = std::hash::BuildHasher::build_hasher(&foldhash::fast::FixedState::with_seed(
            0x0c11_1a7e,
        ));
        (
            salt,
            node,
            ev.timestamp_ns,
            ev.endpoint,
            &ev.kind,
            &ev.direction,
        )
            .hash(&mut h);
        (&ev.source, &ev.destination, ev.port, &ev.reason, ev.cookie).hash(&mut h);
        (ev.source_port, ev.tcp_flags).hash(&mut h);
        h.finish()
    };
    let (a, b) = (half(0), half(1));
    let a = (a & !0xf000) | 0x8000;
    let b = (b & !(0xc000 << 48)) | (0x8000 << 48);
    uuid_text(a, b)
}

/// The UUID of the 128 bits `a`, `b` (8-4-4-4-12 hex digits: what `format!` with `{:08x}-...`
/// writes, at a fraction of its cost).
fn uuid_text(a: u64, b: u64) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(36);
    for i in 0..32 {
        let (word, shift) = if i < 16 {
            (a, 60 - 4 * i)
        } else {
            (b, 124 - 4 * i)
        };
        if matches!(i, 8 | 12 | 16 | 20) {
            out.push('-');
        }
        out.push(HEX[(word >> shift) as usize & 0xf] as char);
    }
    out
}

/// When the agent received the record (its `time`), as a protobuf timestamp.
pub fn received(ev: &VerdictEvent) -> Option<prost_types::Timestamp> {
    let t = chrono::DateTime::parse_from_rfc3339(ev.time.as_deref()?).ok()?;
    Some(prost_types::Timestamp {
        seconds: t.timestamp(),
        nanos: t.timestamp_subsec_nanos() as i32,
    })
}

/// The TCP flags byte as Hubble's `TCPFlags`.
fn tcp_flags(b: u8) -> pb::TcpFlags {
    let bit = |m: u8| b & m != 0;
    pb::TcpFlags {
        fin: bit(0x01),
        syn: bit(0x02),
        rst: bit(0x04),
        psh: bit(0x08),
        ack: bit(0x10),
        urg: bit(0x20),
        ece: bit(0x40),
        cwr: bit(0x80),
        ns: false,
    }
}

fn layer4(ev: &VerdictEvent) -> Option<pb::Layer4> {
    use pb::layer4::Protocol;
    let port = u32::from(ev.port);
    let source_port = u32::from(ev.source_port);
    let p = match ev.protocol.as_str() {
        "TCP" => Protocol::Tcp(pb::Tcp {
            source_port,
            destination_port: port,
            flags: (ev.tcp_flags != 0).then(|| tcp_flags(ev.tcp_flags)),
        }),
        "UDP" => Protocol::Udp(pb::Udp {
            source_port,
            destination_port: port,
        }),
        "SCTP" => Protocol::Sctp(pb::Sctp {
            source_port,
            destination_port: port,
        }),
        "ICMP" => Protocol::IcmPv4(pb::IcmPv4 {
            r#type: port,
            code: 0,
        }),
        "ICMPv6" => Protocol::IcmPv6(pb::IcmPv6 {
            r#type: port,
            code: 0,
        }),
        _ => return None,
    };
    Some(pb::Layer4 { protocol: Some(p) })
}

/// DNS's response code for REFUSED.
const RCODE_REFUSED: u32 = 5;

fn dns_layer7(ev: &VerdictEvent, d: &crate::datapath::events::DnsFields) -> pb::Layer7 {
    let refused = d.verdict == "refused";
    let rrtype = |ip: &String| match ip.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => "AAAA".to_string(),
        _ => "A".to_string(),
    };
    pb::Layer7 {
        r#type: if refused {
            pb::L7FlowType::Request
        } else {
            pb::L7FlowType::Response
        } as i32,
        latency_ns: ev.latency_ns.unwrap_or(0),
        record: Some(pb::layer7::Record::Dns(pb::Dns {
            query: d.query.clone(),
            ips: d.answers.clone(),
            ttl: 0,
            cnames: Vec::new(),
            observation_source: "proxy".into(),
            rcode: if refused { RCODE_REFUSED } else { 0 },
            qtypes: vec![d.qtype.clone()],
            rrtypes: d.answers.iter().map(rrtype).collect(),
        })),
    }
}

fn layer7(ev: &VerdictEvent) -> Option<pb::Layer7> {
    if let Some(d) = &ev.dns {
        return Some(dns_layer7(ev, d));
    }
    let http = ev.http.as_ref()?;
    Some(pb::Layer7 {
        r#type: if http.code != 0 {
            pb::L7FlowType::Response
        } else {
            pb::L7FlowType::Request
        } as i32,
        latency_ns: ev.latency_ns.unwrap_or(0),
        record: Some(pb::layer7::Record::Http(pb::Http {
            code: u32::from(http.code),
            method: http.method.clone(),
            url: http.url.clone(),
            protocol: http.protocol.clone(),
            headers: Vec::new(),
        })),
    })
}

fn ip(ev: &VerdictEvent) -> Option<pb::Ip> {
    let version = match ev.source.parse::<IpAddr>().ok()? {
        IpAddr::V4(_) => pb::IpVersion::IPv4,
        IpAddr::V6(_) => pb::IpVersion::IPv6,
    };
    Some(pb::Ip {
        source: ev.source.clone(),
        destination: ev.destination.clone(),
        ip_version: version as i32,
        encrypted: false,
    })
}

/// The record as Hubble's flow, observed on `node`.
pub fn to_flow(ev: &VerdictEvent, node: &str, lookup: &dyn Lookup) -> pb::Flow {
    let mut flow = bare_flow(ev, node, received(ev));
    let (source, destination) = sides(ev);
    flow.source = Some(endpoint(&source, lookup));
    flow.destination = Some(endpoint(&destination, lookup));
    flow.source_names = names(&source, lookup);
    flow.destination_names = names(&destination, lookup);
    let policies = ev.policies.iter().map(|p| policy(p, ev.revision)).collect();
    *match policy_list(ev) {
        EGRESS_ALLOWED_BY => &mut flow.egress_allowed_by,
        INGRESS_ALLOWED_BY => &mut flow.ingress_allowed_by,
        EGRESS_DENIED_BY => &mut flow.egress_denied_by,
        _ => &mut flow.ingress_denied_by,
    } = policies;
    flow
}

/// The flow received at `time` without what recurs across flows: both endpoints, their names
/// and the deciding policies (`to_flow` adds them; `wire` writes them once per call and copies
/// them).
pub fn bare_flow(ev: &VerdictEvent, node: &str, time: Option<prost_types::Timestamp>) -> pb::Flow {
    let egress = ev.direction == "egress";
    let (ty, sub) = event_type(ev);
    let reason = drop_reason(ev);
    let reply = is_reply(ev);
    pb::Flow {
        time,
        uuid: uuid(ev, node),
        verdict: verdict(ev) as i32,
        drop_reason: reason as u32,
        ip: ip(ev),
        l4: layer4(ev),
        r#type: if ev.kind == "l7" {
            pb::FlowType::L7
        } else {
            pb::FlowType::L3L4
        } as i32,
        node_name: node.to_string(),
        l7: layer7(ev),
        reply: reply == Some(true),
        event_type: Some(pb::CiliumEventType {
            r#type: ty,
            sub_type: sub,
        }),
        traffic_direction: if egress {
            pb::TrafficDirection::Egress
        } else {
            pb::TrafficDirection::Ingress
        } as i32,
        policy_match_type: match_type(ev.match_kind.as_deref()),
        trace_observation_point: match (ty, egress) {
            (EVENT_TRACE, true) => pb::TraceObservationPoint::FromEndpoint,
            (EVENT_TRACE, false) => pb::TraceObservationPoint::ToEndpoint,
            _ => pb::TraceObservationPoint::UnknownPoint,
        } as i32,
        drop_reason_desc: reason as i32,
        is_reply: reply,
        summary: summary(ev),
        ..Default::default()
    }
}

/// Hubble's one-line summary: the protocol and, where a policy decided, which one and how
/// (`TCP allowed by CiliumNetworkPolicy x/b[0] (l3-l4)`).
fn summary(ev: &VerdictEvent) -> String {
    if let Some(h) = &ev.http {
        return format!("{} {} {} {}", h.protocol, h.method, h.url, h.code);
    }
    if let Some(d) = &ev.dns {
        // Hubble's words for a DNS record.
        return match d.verdict.as_str() {
            "refused" => format!("DNS Query {} {}", d.query, d.qtype),
            _ => format!(
                "DNS Answer \"{}\" TTL: 0 (Proxy {} {})",
                d.answers.join(","),
                d.query,
                d.qtype
            ),
        };
    }
    let mut out = String::with_capacity(96);
    out.push_str(&ev.protocol);
    out.push(' ');
    if !ev.write_why(&mut out) {
        out.push_str(&ev.reason);
    }
    out
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::datapath::events::verdict_event;

    /// Two identities with labels, and a DNS name of the server's address.
    pub struct Known;
    impl Lookup for Known {
        fn identity_of(&self, ip: IpAddr) -> u32 {
            if ip.to_string() == "10.0.0.1" {
                4001
            } else {
                0
            }
        }
        fn labels_of(&self, id: u32) -> Vec<String> {
            match id {
                4001 => vec!["k8s:app=client".into()],
                4002 => vec!["k8s:app=server".into()],
                _ => vec![],
            }
        }
        fn names_of(&self, ip: IpAddr) -> Vec<String> {
            if ip.to_string() == "10.0.0.2" {
                vec!["server.example.com".into()]
            } else {
                vec![]
            }
        }
        fn workload_of(&self, pod: &str) -> Option<Workload> {
            (pod == "y/server").then(|| Workload {
                name: "server".into(),
                kind: "Deployment".into(),
            })
        }
    }

    fn addr(a: [u8; 4]) -> [u8; 16] {
        let mut x = [0; 16];
        x[..4].copy_from_slice(&a);
        x
    }

    /// x/client (10.0.0.1) to y/server (10.0.0.2):8080, allowed by a policy.
    pub fn allowed_egress() -> VerdictEvent {
        let mut ev = verdict_event(
            5,
            7,
            4002,
            true,
            6,
            8080,
            "allow-policy",
            4,
            addr([10, 0, 0, 1]),
            addr([10, 0, 0, 2]),
            0,
        );
        ev.time = Some("2026-11-28T16:00:00.250Z".into());
        ev.source_pod = Some("x/client".into());
        ev.destination_pod = Some("y/server".into());
        ev.match_kind = Some("l3-l4".into());
        ev.revision = Some(9);
        ev.policies = vec![PolicyRef {
            kind: "CiliumNetworkPolicy".into(),
            namespace: Some("x".into()),
            name: "client-out".into(),
            rule: Some(0),
            http: None,
            tier: Default::default(),
        }];
        ev
    }

    #[test]
    fn an_allowed_egress_is_a_policy_verdict_naming_its_policy_and_both_sides() {
        let f = to_flow(&allowed_egress(), "node-1", &Known);
        assert_eq!(f.verdict, pb::Verdict::Forwarded as i32);
        assert_eq!(f.event_type.as_ref().map(|e| e.r#type), Some(5));
        assert_eq!(f.traffic_direction, pb::TrafficDirection::Egress as i32);
        assert_eq!(f.policy_match_type, 2);
        assert_eq!(f.is_reply, Some(false));
        let t = f.time.unwrap();
        assert_eq!((t.seconds % 60, t.nanos), (0, 250_000_000));
        let src = f.source.unwrap();
        assert_eq!((src.id, src.identity), (7, 4001), "the local endpoint");
        assert_eq!(
            (src.namespace.as_str(), src.pod_name.as_str()),
            ("x", "client")
        );
        assert_eq!(src.labels, ["k8s:app=client"]);
        assert!(src.workloads.is_empty(), "no controller known");
        let dst = f.destination.unwrap();
        assert_eq!((dst.id, dst.identity), (0, 4002), "the peer as judged");
        assert_eq!(dst.labels, ["k8s:app=server"]);
        assert_eq!(
            dst.workloads,
            [pb::Workload {
                name: "server".into(),
                kind: "Deployment".into()
            }]
        );
        assert_eq!(f.destination_names, ["server.example.com"]);
        assert_eq!(f.egress_allowed_by.len(), 1);
        let p = &f.egress_allowed_by[0];
        assert_eq!(
            (p.kind.as_str(), p.namespace.as_str(), p.name.as_str()),
            ("CiliumNetworkPolicy", "x", "client-out")
        );
        assert_eq!(p.revision, 9);
        assert!(f.ingress_allowed_by.is_empty() && f.egress_denied_by.is_empty());
        match f.l4.unwrap().protocol.unwrap() {
            pb::layer4::Protocol::Tcp(t) => assert_eq!(t.destination_port, 8080),
            other => panic!("{other:?}"),
        }
        assert_eq!(f.ip.unwrap().ip_version, pb::IpVersion::IPv4 as i32);
        assert!(
            f.summary
                .contains("allowed by CiliumNetworkPolicy x/client-out[0]"),
            "{}",
            f.summary
        );
    }

    #[test]
    fn drops_name_their_reason_and_their_deniers() {
        let mut ev = allowed_egress();
        ev.direction = "ingress".into();
        ev.verdict = "dropped".into();
        ev.reason = "policy-deny".into();
        ev.match_kind = Some("deny-rule".into());
        let f = to_flow(&ev, "n", &Known);
        assert_eq!(f.drop_reason_desc, pb::DropReason::PolicyDeny as i32);
        assert_eq!(f.ingress_denied_by.len(), 1);
        assert!(f.ingress_allowed_by.is_empty());
        // Ingress: the peer is the source, the endpoint the destination.
        assert_eq!(f.source.unwrap().identity, 4002);
        assert_eq!(f.destination.unwrap().id, 7);

        // A drop no policy decided is a drop event with its reason as subtype.
        ev.match_kind = None;
        ev.policies.clear();
        ev.reason = "not-realized".into();
        let f = to_flow(&ev, "n", &Known);
        assert_eq!(f.event_type.unwrap().r#type, EVENT_DROP);
        assert_eq!(f.drop_reason_desc, 165);
        // A tunnel packet from a sender that is no tunnel peer: Cilium's "invalid source ip".
        ev.reason = "not-a-tunnel-peer".into();
        assert_eq!(to_flow(&ev, "n", &Known).drop_reason_desc, 132);
    }

    #[test]
    fn replies_and_established_packets_are_traces() {
        let mut ev = allowed_egress();
        ev.match_kind = None;
        ev.policies.clear();
        ev.reason = "reply".into();
        let f = to_flow(&ev, "n", &NoLookup);
        assert_eq!(f.is_reply, Some(true));
        assert!(f.reply);
        assert_eq!(
            (f.event_type.unwrap().r#type, f.trace_observation_point),
            (EVENT_TRACE, pb::TraceObservationPoint::FromEndpoint as i32)
        );
        assert_eq!(
            processed_labels(&ev),
            ("Trace", "from-endpoint", "FORWARDED")
        );
    }

    #[test]
    fn l4_carries_both_ports_and_the_tcp_flags() {
        let mut ev = allowed_egress();
        (ev.source_port, ev.tcp_flags) = (41_000, 0x12);
        let f = to_flow(&ev, "node-1", &Known);
        let Some(pb::layer4::Protocol::Tcp(t)) = f.l4.and_then(|l| l.protocol) else {
            panic!("{f:?}")
        };
        assert_eq!((t.source_port, t.destination_port), (41_000, 8080));
        let flags = t.flags.expect("flags");
        assert!(
            flags.syn && flags.ack && !flags.fin && !flags.rst,
            "{flags:?}"
        );
        // An older program's record: no flags rather than all false.
        ev.tcp_flags = 0;
        let f = to_flow(&ev, "node-1", &Known);
        let Some(pb::layer4::Protocol::Tcp(t)) = f.l4.and_then(|l| l.protocol) else {
            panic!("{f:?}")
        };
        assert_eq!(t.flags, None);
    }

    #[test]
    fn a_dns_verdict_is_an_l7_dns_record() {
        let mut ev = allowed_egress();
        ev.kind = "l7".into();
        ev.match_kind = None;
        ev.policies.clear();
        ev.dns = Some(crate::datapath::events::DnsFields {
            pod: "x/client".into(),
            query: "api.example.com.".into(),
            qtype: "AAAA".into(),
            answers: vec!["fd00::1".into(), "fd00::2".into()],
            verdict: "forwarded".into(),
            policies: vec![],
        });
        let f = to_flow(&ev, "node-1", &Known);
        assert_eq!(f.r#type, pb::FlowType::L7 as i32);
        assert_eq!(f.event_type.as_ref().unwrap().r#type, EVENT_ACCESS_LOG);
        let Some(pb::layer7::Record::Dns(d)) = f.l7.as_ref().unwrap().record.clone() else {
            panic!("{f:?}")
        };
        assert_eq!(
            (d.rcode, d.rrtypes),
            (0, vec!["AAAA".into(), "AAAA".into()])
        );
        assert_eq!(
            f.summary,
            "DNS Answer \"fd00::1,fd00::2\" TTL: 0 (Proxy api.example.com. AAAA)"
        );
        assert_eq!(processed_labels(&ev), ("L7", "DNS", "FORWARDED"));
        ev.dns.as_mut().unwrap().verdict = "refused".into();
        ev.verdict = "dropped".into();
        let f = to_flow(&ev, "node-1", &Known);
        assert_eq!(f.summary, "DNS Query api.example.com. AAAA");
        assert_eq!(f.l7.unwrap().r#type, pb::L7FlowType::Request as i32);
    }

    #[test]
    fn the_id_is_stable_and_tells_flows_apart() {
        let a = allowed_egress();
        let mut b = allowed_egress();
        b.timestamp_ns += 1;
        for (x, y) in [
            (0, 0),
            (u64::MAX, 1),
            (0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210),
        ] {
            let by_format = format!(
                "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
                x >> 32,
                (x >> 16) & 0xffff,
                x & 0xffff,
                y >> 48,
                y & 0xffff_ffff_ffff
            );
            assert_eq!(uuid_text(x, y), by_format);
        }
        let (ua, ub) = (uuid(&a, "n"), uuid(&b, "n"));
        assert_eq!(ua, uuid(&a, "n"));
        assert_ne!(ua, ub);
        assert_eq!(ua.len(), 36);
        assert_eq!(&ua[14..15], "8", "version 8: {ua}");
    }
}
