//! `ciliate policy simulate`: load a world, answer probes, explain each verdict.
//!
//! The simulator drives the same [`PolicyEngine`] the agent uses: pods get identities from their
//! labels, policies go through the same validation, and each endpoint's policy is resolved into
//! the same map state the datapath enforces. A probe is then two map lookups: the source's egress
//! and the destination's ingress.

pub mod generate;
pub mod world;

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use serde::Serialize;

use crate::policy::engine::{Decision, EndpointPolicy, EndpointView, NamedPort, PolicyEngine};
use crate::policy::identity::{
    NumericIdentity, IDENTITY_HOST, IDENTITY_REMOTE_NODE, IDENTITY_WORLD_IPV4, IDENTITY_WORLD_IPV6,
};
use crate::policy::labels::{Label, Labels};
use crate::policy::rule::{Direction, PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP};
use crate::policy::translate::{parse_policy, PolicyError};
use world::World;

/// The world file is unusable (exit status 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{entry}: {message}")]
pub struct WorldError {
    /// Which entry of the world file, e.g. `probes[3].from` or `pods[1].ips[0]`.
    pub entry: String,
    pub message: String,
}

fn werr(entry: impl Into<String>, message: impl Into<String>) -> WorldError {
    WorldError {
        entry: entry.into(),
        message: message.into(),
    }
}

/// One output line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProbeResult {
    pub from: String,
    pub to: String,
    pub protocol: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    #[serde(rename = "icmpType", skip_serializing_if = "Option::is_none")]
    pub icmp_type: Option<u8>,
    pub verdict: &'static str,
    pub reason: String,
}

/// Everything a simulation produced.
#[derive(Debug, Clone, Default)]
pub struct Simulation {
    pub results: Vec<ProbeResult>,
    pub rejections: Vec<PolicyError>,
    pub warnings: Vec<String>,
}

struct Pod {
    key: String,
    node: usize,
    ips: Vec<IpAddr>,
    identity: NumericIdentity,
    labels: Labels,
    named_ports: Vec<NamedPort>,
}

struct Node {
    name: String,
    labels: Labels,
}

/// A probe end after resolution.
#[derive(Clone, Copy)]
enum Party {
    Pod(usize),
    Node(usize, IpAddr),
    External(IpAddr),
}

fn parse_ip(s: &str, entry: &str) -> Result<IpAddr, WorldError> {
    s.trim()
        .parse()
        .map_err(|_| werr(entry, format!("{s:?} is not an IP address")))
}

fn parse_protocol(p: Option<&str>, entry: &str) -> Result<(u8, String), WorldError> {
    let upper = p.unwrap_or("TCP").trim().to_ascii_uppercase();
    let n = match upper.as_str() {
        "TCP" => PROTO_TCP,
        "UDP" => PROTO_UDP,
        "SCTP" => PROTO_SCTP,
        "ICMP" => PROTO_ICMP,
        "ICMPV6" => PROTO_ICMPV6,
        _ => {
            return Err(werr(
                entry,
                format!(
                    "unknown protocol {:?} (TCP, UDP, SCTP, ICMP or ICMPv6)",
                    p.unwrap_or_default()
                ),
            ))
        }
    };
    Ok((n, upper))
}

struct Sim {
    engine: PolicyEngine,
    pods: Vec<Pod>,
    nodes: Vec<Node>,
    pod_by_key: HashMap<String, usize>,
    party_by_ip: HashMap<IpAddr, Party>,
    pod_policy: HashMap<usize, EndpointPolicy>,
    node_policy: HashMap<usize, EndpointPolicy>,
}

/// Runs a world given as text. `Err` means the world itself is unusable (exit 2).
pub fn simulate(text: &str) -> Result<Simulation, WorldError> {
    let de = serde_yaml::Deserializer::from_str(text);
    let world: World = match serde_path_to_error::deserialize(de) {
        Ok(w) => w,
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let entry = match (path.as_str(), inner.location()) {
                ("." | "?", Some(loc)) => {
                    format!("(document) line {} column {}", loc.line(), loc.column())
                }
                ("." | "?", None) => "(document)".to_string(),
                _ => path,
            };
            return Err(werr(entry, inner.to_string()));
        }
    };
    let mut out = Simulation::default();
    let mut sim = build(&world, &mut out)?;
    for (i, probe) in world.probes.iter().flatten().enumerate() {
        let r = sim.probe(probe, i)?;
        out.results.push(r);
    }
    Ok(out)
}

fn build(world: &World, out: &mut Simulation) -> Result<Sim, WorldError> {
    let mut engine = PolicyEngine::new();
    let namespaces: BTreeMap<String, BTreeMap<String, String>> = world
        .namespaces
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.clone().unwrap_or_default()))
        .collect();

    // Nodes. Without any, one implicit local node holds every pod.
    let mut nodes = Vec::new();
    let mut local = 0usize;
    let mut party_by_ip: HashMap<IpAddr, Party> = HashMap::new();
    for (i, n) in world.nodes.iter().flatten().enumerate() {
        let mut labels: Labels = n
            .labels
            .iter()
            .flatten()
            .map(|(k, v)| Label::k8s(k, v))
            .collect();
        labels.insert(Label::reserved("host"));
        for (j, ip) in n.ips.iter().enumerate() {
            let a = parse_ip(ip, &format!("nodes[{i}].ips[{j}]"))?;
            if party_by_ip.insert(a, Party::Node(i, a)).is_some() {
                return Err(werr(
                    format!("nodes[{i}].ips[{j}]"),
                    format!("address {a} is used twice"),
                ));
            }
        }
        if n.local == Some(true) {
            local = i;
        }
        if nodes.iter().any(|x: &Node| x.name == n.name) {
            return Err(werr(
                format!("nodes[{i}].name"),
                format!("node {:?} is declared twice", n.name),
            ));
        }
        nodes.push(Node {
            name: n.name.clone(),
            labels,
        });
    }
    if nodes.is_empty() {
        let labels: Labels = [Label::reserved("host")].into_iter().collect();
        nodes.push(Node {
            name: "local".into(),
            labels,
        });
    }

    let mut pods = Vec::new();
    let mut pod_by_key = HashMap::new();
    for (i, p) in world.pods.iter().flatten().enumerate() {
        let entry = format!("pods[{i}]");
        if p.namespace.is_empty() || p.name.is_empty() {
            return Err(werr(entry, "a pod needs a namespace and a name"));
        }
        let key = format!("{}/{}", p.namespace, p.name);
        if pod_by_key.contains_key(&key) {
            return Err(werr(entry, format!("pod {key} is declared twice")));
        }
        let node = match &p.node {
            None => local,
            Some(name) => nodes
                .iter()
                .position(|n| n.name == *name)
                .ok_or_else(|| werr(format!("{entry}.node"), format!("unknown node {name:?}")))?,
        };
        let empty = BTreeMap::new();
        let ns_labels = namespaces.get(&p.namespace).unwrap_or(&empty);
        let pod_labels = p.labels.clone().unwrap_or_default();
        let labels = Labels::for_pod(
            &p.namespace,
            &pod_labels,
            ns_labels,
            Some(p.service_account.as_deref().unwrap_or("default")),
        );
        let identity = engine.allocate_identity(&labels).id();
        let mut named_ports = Vec::new();
        for (j, cp) in p.ports.iter().flatten().enumerate() {
            let pe = format!("{entry}.ports[{j}]");
            let port = u16::try_from(cp.port)
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| {
                    werr(
                        format!("{pe}.port"),
                        format!("port {} is outside 1..65535", cp.port),
                    )
                })?;
            let (proto, _) = parse_protocol(cp.protocol.as_deref(), &format!("{pe}.protocol"))?;
            if let Some(name) = &cp.name {
                named_ports.push(NamedPort {
                    name: name.to_ascii_lowercase(),
                    protocol: proto,
                    port,
                });
            }
        }
        engine.add_named_ports(identity, &named_ports);
        let mut ips = Vec::new();
        for (j, ip) in p.ips.iter().enumerate() {
            let a = parse_ip(ip, &format!("{entry}.ips[{j}]"))?;
            if party_by_ip.insert(a, Party::Pod(pods.len())).is_some() {
                return Err(werr(
                    format!("{entry}.ips[{j}]"),
                    format!("address {a} is used twice"),
                ));
            }
            engine.upsert_endpoint_ip(a, identity);
            ips.push(a);
        }
        pod_by_key.insert(key.clone(), pods.len());
        pods.push(Pod {
            key,
            node,
            ips,
            identity,
            labels,
            named_ports,
        });
    }

    for (i, doc) in world.policies.iter().flatten().enumerate() {
        match parse_policy(doc, "default", &format!("policies[{i}]")) {
            Ok(p) => {
                out.warnings.extend(p.warnings.iter().cloned());
                if engine.policy(&p.key).is_some() {
                    out.warnings.push(format!(
                        "{}: declared more than once; the later document replaces the earlier",
                        p.key
                    ));
                }
                engine.upsert_policy(p);
            }
            Err(e) => out.rejections.push(e),
        }
    }

    Ok(Sim {
        engine,
        pods,
        nodes,
        pod_by_key,
        party_by_ip,
        pod_policy: HashMap::new(),
        node_policy: HashMap::new(),
    })
}

/// How one side of a probe decided.
enum Side {
    /// The party has no policy of its own (outside the cluster).
    Outside,
    Decided(Decision),
}

impl Sim {
    fn party(&self, text: &str, entry: &str) -> Result<Party, WorldError> {
        if let Ok(ip) = text.trim().parse::<IpAddr>() {
            return Ok(self
                .party_by_ip
                .get(&ip)
                .copied()
                .unwrap_or(Party::External(ip)));
        }
        if text.contains('/') {
            return self
                .pod_by_key
                .get(text.trim())
                .map(|i| Party::Pod(*i))
                .ok_or_else(|| werr(entry, format!("unknown pod {text:?}")));
        }
        Err(werr(
            entry,
            format!("{text:?} is neither a pod (namespace/name) nor an IP address"),
        ))
    }

    fn describe(&self, p: Party) -> String {
        match p {
            Party::Pod(i) => self.pods[i].key.clone(),
            Party::Node(i, ip) => format!("node {} ({ip})", self.nodes[i].name),
            Party::External(ip) => {
                let id = self.engine.identity_of_ip(ip);
                match id {
                    IDENTITY_WORLD_IPV4 | IDENTITY_WORLD_IPV6 => format!("{ip} (world)"),
                    _ => match self.engine.identity(id).and_then(|i| i.cidr) {
                        Some(c) => format!("{ip} (cidr {c})"),
                        None => ip.to_string(),
                    },
                }
            }
        }
    }

    /// The node a party sits on, for host / remote-node perspective.
    fn node_of(&self, p: Party) -> Option<usize> {
        match p {
            Party::Pod(i) => Some(self.pods[i].node),
            Party::Node(i, _) => Some(i),
            Party::External(_) => None,
        }
    }

    /// The identity `peer` has as seen from `viewer`'s node.
    fn identity_seen_by(&self, viewer: Party, peer: Party) -> NumericIdentity {
        match peer {
            Party::Pod(i) => self.pods[i].identity,
            Party::Node(n, _) => {
                if self.node_of(viewer) == Some(n) {
                    IDENTITY_HOST
                } else {
                    IDENTITY_REMOTE_NODE
                }
            }
            Party::External(ip) => self.engine.identity_of_ip(ip),
        }
    }

    fn policy_of(&mut self, p: Party) -> Option<&EndpointPolicy> {
        match p {
            Party::Pod(i) => {
                if !self.pod_policy.contains_key(&i) {
                    let pod = &self.pods[i];
                    let view = EndpointView {
                        identity: pod.identity,
                        labels: &pod.labels,
                        named_ports: &pod.named_ports,
                        host: false,
                    };
                    let pol = self.engine.resolve(&view);
                    self.pod_policy.insert(i, pol);
                }
                self.pod_policy.get(&i)
            }
            Party::Node(n, _) => {
                if !self.node_policy.contains_key(&n) {
                    let node = &self.nodes[n];
                    let view = EndpointView {
                        identity: IDENTITY_HOST,
                        labels: &node.labels,
                        named_ports: &[],
                        host: true,
                    };
                    let pol = self.engine.resolve(&view);
                    self.node_policy.insert(n, pol);
                }
                self.node_policy.get(&n)
            }
            Party::External(_) => None,
        }
    }

    fn side(&mut self, who: Party, other: Party, d: Direction, proto: u8, port: u16) -> Side {
        let peer = self.identity_seen_by(who, other);
        match self.policy_of(who) {
            None => Side::Outside,
            Some(pol) => Side::Decided(pol.decide(d, peer, proto, port)),
        }
    }

    fn probe(&mut self, probe: &world::Probe, i: usize) -> Result<ProbeResult, WorldError> {
        let entry = format!("probes[{i}]");
        let (from_text, to_text) = (probe.from.text(), probe.to.text());
        let src = self.party(&from_text, &format!("{entry}.from"))?;
        let dst = self.party(&to_text, &format!("{entry}.to"))?;
        let (proto, proto_name) =
            parse_protocol(probe.protocol.as_deref(), &format!("{entry}.protocol"))?;
        let icmp = proto == PROTO_ICMP || proto == PROTO_ICMPV6;
        let (port, icmp_type) = if icmp {
            let default = if proto == PROTO_ICMP { 8 } else { 128 };
            let t = probe.icmp_type.unwrap_or(default);
            let t = u8::try_from(t).map_err(|_| {
                werr(
                    format!("{entry}.icmpType"),
                    format!("ICMP type {t} is outside 0..255"),
                )
            })?;
            (None, Some(t))
        } else {
            let p = probe.port.ok_or_else(|| {
                werr(
                    format!("{entry}.port"),
                    format!("a {proto_name} probe needs a port"),
                )
            })?;
            let p = u16::try_from(p).map_err(|_| {
                werr(
                    format!("{entry}.port"),
                    format!("port {p} is outside 0..65535"),
                )
            })?;
            (Some(p), None)
        };
        self.check_family(src, dst, proto, &entry)?;
        let lookup_port = port.unwrap_or(icmp_type.unwrap_or(0) as u16);

        let same_pod = matches!((src, dst), (Party::Pod(a), Party::Pod(b)) if a == b);
        let (verdict, reason) = if same_pod {
            (
                "allow",
                "a pod may always reach itself (traffic never leaves it)".to_string(),
            )
        } else {
            let egress = self.side(src, dst, Direction::Egress, proto, lookup_port);
            let ingress = self.side(dst, src, Direction::Ingress, proto, lookup_port);
            self.explain(src, dst, egress, ingress)
        };
        Ok(ProbeResult {
            from: from_text,
            to: to_text,
            protocol: proto_name,
            port,
            icmp_type,
            verdict,
            reason,
        })
    }

    /// Pods only talk over a family both ends have; an ICMP probe fixes the family.
    fn check_family(
        &self,
        src: Party,
        dst: Party,
        proto: u8,
        entry: &str,
    ) -> Result<(), WorldError> {
        let fams = |p: Party| -> (bool, bool) {
            match p {
                Party::Pod(i) => (
                    self.pods[i].ips.iter().any(|a| a.is_ipv4()),
                    self.pods[i].ips.iter().any(|a| a.is_ipv6()),
                ),
                Party::Node(_, ip) | Party::External(ip) => (ip.is_ipv4(), ip.is_ipv6()),
            }
        };
        let (s4, s6) = fams(src);
        let (d4, d6) = fams(dst);
        let ok = match proto {
            PROTO_ICMP => s4 && d4,
            PROTO_ICMPV6 => s6 && d6,
            _ => (s4 && d4) || (s6 && d6),
        };
        // A pod without any address can still be probed by name: its policy decides.
        let no_addr = |p: Party| matches!(p, Party::Pod(i) if self.pods[i].ips.is_empty());
        if ok || no_addr(src) || no_addr(dst) {
            Ok(())
        } else {
            Err(werr(
                entry,
                format!(
                    "{} and {} share no address family for this protocol",
                    self.describe(src),
                    self.describe(dst)
                ),
            ))
        }
    }

    fn explain(
        &self,
        src: Party,
        dst: Party,
        egress: Side,
        ingress: Side,
    ) -> (&'static str, String) {
        let s = self.describe(src);
        let d = self.describe(dst);
        let join = |v: &[std::sync::Arc<crate::policy::PolicyKey>]| {
            v.iter().map(|k| k.short()).collect::<Vec<_>>().join(", ")
        };
        if let Side::Decided(Decision::Denied(o)) = &egress {
            return ("deny", format!("denied by {}", o.describe()));
        }
        // A requirement that took an allow away is named after the default deny.
        let withheld = |w: &[std::sync::Arc<crate::policy::rule::PeerRequirement>]| {
            if w.is_empty() {
                return String::new();
            }
            let by: Vec<String> = w.iter().map(|r| r.describe()).collect();
            format!(" ({})", by.join("; "))
        };
        if let Side::Decided(Decision::DefaultDenied {
            isolated_by,
            withheld_by,
        }) = &egress
        {
            return (
                "deny",
                format!(
                    "default deny: {s} is selected by {} for egress and no rule allows {d}{}",
                    join(isolated_by),
                    withheld(withheld_by)
                ),
            );
        }
        if let Side::Decided(Decision::Denied(o)) = &ingress {
            return ("deny", format!("denied by {}", o.describe()));
        }
        if let Side::Decided(Decision::DefaultDenied {
            isolated_by,
            withheld_by,
        }) = &ingress
        {
            return (
                "deny",
                format!(
                    "default deny: {d} is selected by {} and no rule allows {s}{}",
                    join(isolated_by),
                    withheld(withheld_by)
                ),
            );
        }
        let mut l7 = false;
        let mut part = |side: &Side, dir: &str, who: &str| -> String {
            match side {
                Side::Outside => format!("{who} is outside the cluster (no {dir} policy)"),
                Side::Decided(Decision::NotIsolated) => format!("{who} {dir} is not isolated"),
                Side::Decided(Decision::Allowed(o)) => {
                    l7 |= o.iter().any(|x| x.l7);
                    let by: Vec<String> = o.iter().map(|x| x.describe()).collect();
                    format!("{dir} allowed by {}", by.join(", "))
                }
                Side::Decided(_) => String::new(),
            }
        };
        let e = part(&egress, "egress", &s);
        let i = part(&ingress, "ingress", &d);
        let mut reason = format!("allowed: {e}; {i}");
        if l7 {
            reason.push_str(" (L7 rules not enforced)");
        }
        ("allow", reason)
    }
}

#[cfg(test)]
mod tests;
