//! `ciliate policy simulate`: load a world, answer probes, explain each verdict.
//!
//! The simulator drives the same [`PolicyEngine`] the agent uses: pods get identities from their
//! labels, policies go through the same validation, and each endpoint's policy is resolved into
//! the same map state the datapath enforces. A probe is then two map lookups: the source's egress
//! and the destination's ingress.

pub mod generate;
mod http;
pub mod world;
mod yaml;

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::policy::engine::{Decision, EndpointPolicy, EndpointView, NamedPort, PolicyEngine};
use crate::policy::identity::{
    NumericIdentity, IDENTITY_HOST, IDENTITY_REMOTE_NODE, IDENTITY_WORLD_IPV4, IDENTITY_WORLD_IPV6,
};
use crate::policy::l7::http::HttpVerdict;
use crate::policy::labels::{check_labels, Label, Labels};
use crate::policy::rule::{Direction, PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP};
use crate::policy::translate::{parse_policy, Document, PolicyError};

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
    /// A DNS probe's name (then no protocol, port or ICMP type is printed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dns: Option<String>,
    pub to: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub protocol: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    #[serde(rename = "icmpType", skip_serializing_if = "Option::is_none")]
    pub icmp_type: Option<u8>,
    /// The probe's HTTP request, echoed with its defaults.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http: Option<world::HttpProbe>,
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

/// A pod, kept small: a world may hold millions. Its labels live once in its identity.
struct Pod {
    key: Arc<str>,
    node: usize,
    ips: Box<[IpAddr]>,
    identity: NumericIdentity,
    /// Index into `Sim::label_sets` (one per identity).
    label_set: usize,
    /// Shared by every pod with the same list.
    named_ports: Arc<[NamedPort]>,
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
    label_sets: Vec<Labels>,
    nodes: Vec<Node>,
    pod_by_key: HashMap<Arc<str>, usize>,
    party_by_ip: HashMap<IpAddr, Party>,
    /// Resolved pod policies by identity and port list: pods that share both share a policy.
    policies: HashMap<(NumericIdentity, usize), EndpointPolicy>,
    node_policy: HashMap<usize, EndpointPolicy>,
    /// HTTP rules compiled for HTTP probes.
    http: http::Compiled,
}

/// The largest world file `simulate` reads. The loaded world takes a few times the file's size
/// (the text itself, plus pods, addresses and the engine's indexes), so this bounds memory.
pub const MAX_WORLD_BYTES: u64 = 512 << 20;

/// Reads a world file as text, refusing files over [`MAX_WORLD_BYTES`] without reading them
/// whole. The error says what is wrong with the file (the caller names it).
pub fn read_world(path: &Path) -> Result<String, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    let mut bytes = Vec::new();
    file.take(MAX_WORLD_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > MAX_WORLD_BYTES {
        return Err(too_large());
    }
    String::from_utf8(bytes).map_err(|_| "not UTF-8 text".to_string())
}

fn too_large() -> String {
    format!(
        "the world file is larger than {} MiB; split it into smaller worlds",
        MAX_WORLD_BYTES >> 20
    )
}

/// Runs a world given as text. `Err` means the world itself is unusable (exit 2).
///
/// The text is walked once to find every entry (see `yaml.rs`), then the sections are loaded
/// entry by entry in dependency order (namespaces, nodes, pods, policies, probes), whatever
/// their order in the file, so only one entry is ever held as a YAML tree.
pub fn simulate(text: &str) -> Result<Simulation, WorldError> {
    if text.len() as u64 > MAX_WORLD_BYTES {
        return Err(werr("(document)", too_large()));
    }
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let Some(sections) = yaml::scan(text)? else {
        return Err(werr(
            "(document)",
            "the world file is empty: it declares no namespaces, nodes, pods, policies or probes",
        ));
    };
    if let Some(alias) = sections.alias {
        return simulate_aliased(text, alias);
    }
    let mut out = Simulation::default();
    let mut sim = build(text, &sections, &mut out)?;
    for_each(text, &sections, "probes", |i, probe: world::Probe| {
        out.results.push(sim.probe(&probe, i)?);
        Ok(())
    })?;
    Ok(out)
}

/// A world with YAML aliases is read whole (its entries may share anchors), so at most this.
pub const MAX_ALIASED_WORLD_BYTES: usize = 16 << 20;

/// [`simulate`] of a world with an alias (the first at `alias`): of the same world with its
/// aliases replaced by what they name. Positions in its errors count in that text.
fn simulate_aliased(text: &str, alias: yaml::Mark) -> Result<Simulation, WorldError> {
    if text.len() > MAX_ALIASED_WORLD_BYTES {
        return Err(werr(
            format!("(document) {}", alias.describe()),
            format!(
                "a world with YAML aliases is read whole, so it may hold at most {} MiB; \
                 write the aliased parts out or split the world",
                MAX_ALIASED_WORLD_BYTES >> 20
            ),
        ));
    }
    let expanded = yaml::expand_aliases(text)?;
    simulate(&expanded).map_err(|mut e| {
        if e.message.contains(" at line ") {
            e.message
                .push_str(" (lines of the world with its aliases written out)");
        }
        e
    })
}

/// Calls `f` with each entry of the sequence section `name`, deserialised one at a time.
fn for_each<T: DeserializeOwned>(
    text: &str,
    sections: &yaml::Sections,
    name: &str,
    mut f: impl FnMut(usize, T) -> Result<(), WorldError>,
) -> Result<(), WorldError> {
    let Some(section) = sections.get(name) else {
        return Ok(());
    };
    match &section.entries {
        Some(spans) => {
            for (i, span) in spans.iter().enumerate() {
                f(i, yaml::parse_entry(text, span, &format!("{name}[{i}]"))?)?;
            }
        }
        // Not a sequence (null, or the wrong type): parse it whole for the right error.
        None => {
            let all: Option<Vec<T>> = yaml::parse_entry(text, &section.value, name)?;
            for (i, v) in all.into_iter().flatten().enumerate() {
                f(i, v)?;
            }
        }
    }
    Ok(())
}

type LabelMap = BTreeMap<String, String>;

/// A mapping section (`name: value` entries), read entry by entry when the scanner split it
/// (so an error names its entry), whole otherwise; absent: nothing.
fn map_section<E: DeserializeOwned>(
    text: &str,
    sections: &yaml::Sections,
    name: &str,
) -> Result<Vec<E>, WorldError> {
    let Some(section) = sections.get(name) else {
        return Ok(Vec::new());
    };
    match &section.entries {
        Some(spans) => spans
            .iter()
            .map(|s| yaml::parse_entry(text, s, name))
            .collect(),
        None => Ok(yaml::parse_entry::<Option<E>>(text, &section.value, name)?
            .into_iter()
            .collect()),
    }
}

/// The `namespaces` section: name -> labels, each label checked as the API server would.
fn namespaces(
    text: &str,
    sections: &yaml::Sections,
) -> Result<BTreeMap<String, LabelMap>, WorldError> {
    let mut out = BTreeMap::new();
    let parts: Vec<BTreeMap<String, Option<LabelMap>>> = map_section(text, sections, "namespaces")?;
    for (name, labels) in parts.into_iter().flatten() {
        let entry = format!("namespaces.{name}");
        let labels = labels.unwrap_or_default();
        check_labels(&labels).map_err(|m| werr(&entry, m))?;
        if out.insert(name.clone(), labels).is_some() {
            return Err(werr(entry, format!("namespace {name:?} is declared twice")));
        }
    }
    Ok(out)
}

/// The `dns` section: name -> addresses (each name checked as a DNS name).
fn dns_names(
    text: &str,
    sections: &yaml::Sections,
) -> Result<BTreeMap<String, Vec<String>>, WorldError> {
    let parts: Vec<BTreeMap<String, Vec<String>>> = map_section(text, sections, "dns")?;
    let mut out = BTreeMap::new();
    for (name, ips) in parts.into_iter().flatten() {
        let valid = !name.is_empty()
            && name.len() <= 255
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !valid {
            return Err(werr(format!("dns.{name}"), "not a DNS name"));
        }
        out.insert(name, ips);
    }
    Ok(out)
}

fn build(text: &str, sections: &yaml::Sections, out: &mut Simulation) -> Result<Sim, WorldError> {
    let mut engine = PolicyEngine::new();
    let namespaces = namespaces(text, sections)?;

    // Nodes. Without any, one implicit local node holds every pod.
    let mut nodes: Vec<Node> = Vec::new();
    let mut local = 0usize;
    let mut party_by_ip: HashMap<IpAddr, Party> = HashMap::new();
    for_each(text, sections, "nodes", |i, n: world::WorldNode| {
        let raw = n.labels.unwrap_or_default();
        check_labels(&raw).map_err(|m| werr(format!("nodes[{i}].labels"), m))?;
        let mut labels: Labels = raw.iter().map(|(k, v)| Label::k8s(k, v)).collect();
        // What cluster tiers' `nodes` peers select: the node's own labels.
        engine.upsert_node_labels(&n.name, labels.clone());
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
        if nodes.iter().any(|x| x.name == n.name) {
            return Err(werr(
                format!("nodes[{i}].name"),
                format!("node {:?} is declared twice", n.name),
            ));
        }
        nodes.push(Node {
            name: n.name,
            labels,
        });
        Ok(())
    })?;
    // Node addresses are the cluster's, as in the agent's ipcache (host: the local node's,
    // remote-node: the others'): cluster tiers' `networks` cover them (seen from the local
    // node), and CIDR rules do not select them.
    for p in party_by_ip.values() {
        if let Party::Node(i, ip) = *p {
            let id = if i == local {
                IDENTITY_HOST
            } else {
                IDENTITY_REMOTE_NODE
            };
            engine.upsert_endpoint_ip(ip, id);
        }
    }
    if let Some(n) = nodes.get(local) {
        engine.set_local_node(&n.name);
    }
    if nodes.is_empty() {
        engine.set_local_node("local");
        engine.upsert_node_labels("local", Labels::default());
        let labels: Labels = [Label::reserved("host")].into_iter().collect();
        nodes.push(Node {
            name: "local".into(),
            labels,
        });
    }

    let mut pods = Vec::new();
    let mut pod_by_key: HashMap<Arc<str>, usize> = HashMap::new();
    // Pods share few distinct port lists: keep one copy of each.
    let mut port_lists: HashMap<Vec<NamedPort>, Arc<[NamedPort]>> = HashMap::new();
    let mut label_sets: Vec<Labels> = Vec::new();
    let mut set_of_identity: HashMap<NumericIdentity, usize> = HashMap::new();
    let empty = BTreeMap::new();
    for_each(text, sections, "pods", |i, p: world::WorldPod| {
        let entry = format!("pods[{i}]");
        if p.namespace.is_empty() || p.name.is_empty() {
            return Err(werr(entry, "a pod needs a namespace and a name"));
        }
        let key: Arc<str> = format!("{}/{}", p.namespace, p.name).into();
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
        let pod_labels = p.labels.clone().unwrap_or_default();
        check_labels(&pod_labels).map_err(|m| werr(format!("{entry}.labels"), m))?;
        let labels = Labels::for_pod(
            &p.namespace,
            &pod_labels,
            namespaces.get(&p.namespace).unwrap_or(&empty),
            Some(p.service_account.as_deref().unwrap_or("default")),
        );
        // One label set per identity; a pod only keeps its index.
        let identity = engine.allocate_identity(&labels).id();
        let label_set = *set_of_identity.entry(identity).or_insert_with(|| {
            label_sets.push(labels);
            label_sets.len() - 1
        });
        let named_ports = named_ports(&p, &entry)?;
        engine.add_named_ports(identity, &named_ports);
        let named_ports = port_lists
            .entry(named_ports)
            .or_insert_with_key(|k| k.as_slice().into())
            .clone();
        let mut ips = Vec::with_capacity(p.ips.len());
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
            ips: ips.into_boxed_slice(),
            identity,
            label_set,
            named_ports,
        });
        Ok(())
    })?;

    // Names every pod has already resolved: the addresses `toFQDNs` selectors select.
    for (name, ips) in dns_names(text, sections)? {
        let entry = format!("dns.{name}");
        let ips = ips
            .iter()
            .enumerate()
            .map(|(j, ip)| parse_ip(ip, &format!("{entry}[{j}]")))
            .collect::<Result<Vec<_>, _>>()?;
        engine.learn_fqdn(&name, &ips);
    }

    // Read as `Document`: an integer beyond 64 bits rejects its policy, not the world.
    for_each(text, sections, "policies", |i, Document(doc)| {
        match parse_policy(&doc, "default", &format!("policies[{i}]")) {
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
        Ok(())
    })?;

    // Cluster tiers' `nodes` peers may tell nodes apart: the other nodes' addresses take
    // their class's identity (`policy::node_classes`).
    let moved: HashMap<usize, NumericIdentity> = engine
        .take_moved_nodes()
        .iter()
        .filter_map(|name| nodes.iter().position(|n| &n.name == name))
        .filter(|i| *i != local)
        .map(|i| (i, engine.node_identity(&nodes[i].name)))
        .collect();
    if !moved.is_empty() {
        for p in party_by_ip.values() {
            if let Party::Node(i, ip) = *p {
                if let Some(id) = moved.get(&i) {
                    engine.upsert_endpoint_ip(ip, *id);
                }
            }
        }
    }

    Ok(Sim {
        engine,
        pods,
        label_sets,
        nodes,
        pod_by_key,
        party_by_ip,
        policies: HashMap::new(),
        node_policy: HashMap::new(),
        http: http::Compiled::default(),
    })
}

/// A pod's named container ports (lower case, as rules are normalised).
fn named_ports(p: &world::WorldPod, entry: &str) -> Result<Vec<NamedPort>, WorldError> {
    let mut out = Vec::new();
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
            out.push(NamedPort {
                name: name.to_ascii_lowercase(),
                protocol: proto,
                port,
            });
        }
    }
    Ok(out)
}

/// What DNS rules say about a query that L3/L4 policy lets through.
enum DnsRuling {
    Refused(String),
    AllowedBy(String),
    NoRules,
}

/// How one side of a probe decided.
enum Side {
    /// The party has no policy of its own (outside the cluster).
    Outside,
    Decided(Decision),
    /// Cluster tiers apply: the verdict, and the walk through the tiers that explains it.
    Tiered(Decision, String),
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
            Party::Pod(i) => self.pods[i].key.to_string(),
            Party::Node(i, ip) => format!("node {} ({ip})", self.nodes[i].name),
            Party::External(ip) => {
                if let Some(names) = self.engine.fqdn_names_of(ip) {
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    return format!("{ip} ({})", names.join(", "));
                }
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
            // Seen from another node: `remote-node`, or its class's identity when `nodes`
            // peers tell it apart. (Every node's `host` is judged by the policy the engine
            // resolves for the world's local node: one engine holds one node's view.)
            Party::Node(n, _) => {
                if self.node_of(viewer) == Some(n) {
                    IDENTITY_HOST
                } else {
                    self.engine.node_identity(&self.nodes[n].name)
                }
            }
            Party::External(ip) => self.engine.identity_of_ip(ip),
        }
    }

    fn policy_of(&mut self, p: Party) -> Option<&EndpointPolicy> {
        match p {
            Party::Pod(i) => {
                let pod = &self.pods[i];
                let key = (
                    pod.identity,
                    Arc::as_ptr(&pod.named_ports) as *const NamedPort as usize,
                );
                if !self.policies.contains_key(&key) {
                    let view = EndpointView {
                        identity: pod.identity,
                        labels: &self.label_sets[pod.label_set],
                        named_ports: &pod.named_ports,
                        host: false,
                    };
                    let pol = self.engine.resolve(&view);
                    self.policies.insert(key, pol);
                }
                self.policies.get(&key)
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
        let selected = self.describe(who);
        match self.policy_of(who) {
            None => Side::Outside,
            Some(pol) => {
                let decision = pol.decide(d, peer, proto, port);
                match pol.tier_outcome(d, peer, proto, port) {
                    Some((view, o)) => Side::Tiered(decision, tier_walk(view, &o, &selected)),
                    None => Side::Decided(decision),
                }
            }
        }
    }

    fn probe(&mut self, probe: &world::Probe, i: usize) -> Result<ProbeResult, WorldError> {
        let entry = format!("probes[{i}]");
        if let Some(name) = &probe.dns {
            return self.dns_probe(probe, name, &entry);
        }
        let from_text = probe.from.text();
        let to_text = probe
            .to
            .as_ref()
            .map(|t| t.text())
            .ok_or_else(|| werr(format!("{entry}.to"), "a probe needs `to` (or `dns`)"))?;
        let src = self.party(&from_text, &format!("{entry}.from"))?;
        let dst = self.party(&to_text, &format!("{entry}.to"))?;
        let (proto, proto_name) =
            parse_protocol(probe.protocol.as_deref(), &format!("{entry}.protocol"))?;
        let icmp = proto == PROTO_ICMP || proto == PROTO_ICMPV6;
        // A field of the other kind of probe is a mistake, not something to ignore.
        let (stray, field, article) = match icmp {
            true => (probe.port.is_some(), "port", "an"),
            false => (probe.icmp_type.is_some(), "icmpType", "a"),
        };
        if stray {
            return Err(werr(
                format!("{entry}.{field}"),
                format!("{article} {proto_name} probe takes no {field}"),
            ));
        }
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
        let http = probe.http.as_ref().map(|h| world::HttpProbe {
            method: Some(h.method.clone().unwrap_or_else(|| "GET".into())),
            path: Some(h.path.clone().unwrap_or_else(|| "/".into())),
            ..h.clone()
        });
        let (verdict, reason) = match (verdict, same_pod, proto) {
            ("allow", false, PROTO_TCP) => {
                self.http_sides(src, dst, lookup_port, http.as_ref(), reason)
            }
            other => (other.0, reason),
        };
        Ok(ProbeResult {
            from: from_text,
            dns: None,
            to: to_text,
            protocol: proto_name,
            port,
            icmp_type,
            http,
            verdict,
            reason,
        })
    }

    /// An allowed TCP connection's HTTP part: each side whose entries for the peer and port
    /// carry HTTP rules judges the request (egress first); without a request, the reason says
    /// which rules would judge them.
    fn http_sides(
        &mut self,
        src: Party,
        dst: Party,
        port: u16,
        probe: Option<&world::HttpProbe>,
        mut reason: String,
    ) -> (&'static str, String) {
        let host = match dst {
            Party::Pod(i) => self.pods[i].ips.first().map(|ip| ip.to_string()),
            Party::Node(_, ip) | Party::External(ip) => Some(ip.to_string()),
        }
        .map(|a| format!("{a}:{port}"))
        .unwrap_or_default();
        let req = match probe.map(|p| http::Request::of(p, host)).transpose() {
            Ok(r) => r,
            Err(why) => return ("deny", format!("HTTP request refused: {why}")),
        };
        for (side, other, d) in [
            (src, dst, Direction::Egress),
            (dst, src, Direction::Ingress),
        ] {
            let peer = self.identity_seen_by(side, other);
            let Some(grants) = self
                .policy_of(side)
                .and_then(|pol| http::side_grants(pol, d, peer, PROTO_TCP, port))
            else {
                continue;
            };
            let dir = d.as_str();
            let Some(r) = &req else {
                reason.push_str(&format!(
                    "; {dir} requests are then judged by HTTP rules ({})",
                    http::rules_named(&grants)
                ));
                continue;
            };
            match self.http.judge(&grants, r) {
                HttpVerdict::Denied { considered, .. } => {
                    return (
                        "deny",
                        format!(
                            "{dir} HTTP: no HTTP rule of {} matches {} {} (403)",
                            considered.join(", "),
                            r.method,
                            r.path
                        ),
                    )
                }
                HttpVerdict::Allowed { by, .. } => {
                    reason.push_str(&format!("; {dir} HTTP allowed by {by}"))
                }
                HttpVerdict::AllowedL4 { by, .. } => reason.push_str(&format!(
                    "; {dir} HTTP: every request allowed by {by} (no HTTP rules)"
                )),
            }
        }
        ("allow", reason)
    }

    /// A DNS query for `name` from a pod to a DNS server pod (UDP 53): `deny` when L3/L4
    /// policy does not let it through, `refuse` when it does but DNS rules apply to that server
    /// and port and none matches the name, `allow` otherwise.
    fn dns_probe(
        &mut self,
        probe: &world::Probe,
        name: &str,
        entry: &str,
    ) -> Result<ProbeResult, WorldError> {
        if probe.port.is_some() || probe.protocol.is_some() || probe.icmp_type.is_some() {
            return Err(werr(
                entry,
                "a dns probe asks UDP 53; it takes no port, protocol or icmpType",
            ));
        }
        let from_text = probe.from.text();
        let src = self.party(&from_text, &format!("{entry}.from"))?;
        if !matches!(src, Party::Pod(_)) {
            return Err(werr(format!("{entry}.from"), "a dns probe starts at a pod"));
        }
        let (dst, to_text) = match &probe.to {
            Some(t) => (self.party(&t.text(), &format!("{entry}.to"))?, t.text()),
            None => {
                let i = (0..self.pods.len())
                    .find(|i| {
                        self.label_sets[self.pods[*i].label_set]
                            .get("k8s-app")
                            .is_some_and(|l| l.value == "kube-dns")
                    })
                    .ok_or_else(|| {
                        werr(
                            format!("{entry}.to"),
                            "no pod is labelled k8s-app=kube-dns: name the DNS server with `to`",
                        )
                    })?;
                (Party::Pod(i), self.pods[i].key.to_string())
            }
        };
        self.check_family(src, dst, PROTO_UDP, entry)?;
        let egress = self.side(src, dst, Direction::Egress, PROTO_UDP, 53);
        let ingress = self.side(dst, src, Direction::Ingress, PROTO_UDP, 53);
        let (mut verdict, mut reason) = self.explain(src, dst, egress, ingress);
        if verdict == "allow" {
            // The L3/L4 reason flags L7 rules as not enforced: here the DNS ones are.
            let l3l4 = reason.replace(" (L7 rules not enforced)", "");
            (verdict, reason) = match self.dns_rules(src, dst, name) {
                DnsRuling::Refused(why) => ("refuse", why),
                DnsRuling::AllowedBy(by) => ("allow", format!("{l3l4}; {by}")),
                DnsRuling::NoRules => ("allow", format!("{l3l4}; no DNS rule applies")),
            };
        }
        Ok(ProbeResult {
            from: from_text,
            dns: Some(name.to_string()),
            to: to_text,
            protocol: String::new(),
            port: None,
            icmp_type: None,
            http: None,
            verdict,
            reason,
        })
    }

    /// Why DNS rules refuse `name` from `src` to the server `dst` on UDP 53, if they do: every
    /// egress allow rule of `src` that selects the server and names port 53 carries DNS rules,
    /// and none matches. (A rule naming the port without DNS rules lets any name through.)
    fn dns_rules(&mut self, src: Party, dst: Party, name: &str) -> DnsRuling {
        use crate::policy::rule::{DnsVerdict, Peers, Section};
        let Party::Pod(i) = src else {
            return DnsRuling::NoRules;
        };
        let peer = self.identity_seen_by(src, dst);
        let named: Vec<NamedPort> = match dst {
            Party::Pod(j) => self.pods[j].named_ports.to_vec(),
            _ => Vec::new(),
        };
        let resolve = |n: &str, proto: u8| {
            named
                .iter()
                .find(|p| p.name == n && p.protocol == proto)
                .map(|p| p.port)
        };
        let pod = &self.pods[i];
        let view = EndpointView {
            identity: pod.identity,
            labels: &self.label_sets[pod.label_set],
            named_ports: &pod.named_ports,
            host: false,
        };
        let cache = self.engine.selector_cache();
        let mut patterns = Vec::new();
        let mut rules_with_dns = Vec::new();
        for rule in self.engine.rules_for(&view) {
            for pr in rule
                .peer_rules
                .iter()
                .filter(|pr| pr.origin.section == Section::Egress)
            {
                let selects = match &pr.peers {
                    Peers::Any => true,
                    Peers::Selectors(s) => s
                        .iter()
                        .any(|s| cache.selections(s).is_some_and(|ids| ids.contains(&peer))),
                };
                if !selects {
                    continue;
                }
                match pr.dns_verdict(PROTO_UDP, 53, &resolve) {
                    DnsVerdict::NotCovered => {}
                    DnsVerdict::AnyName => {
                        return DnsRuling::AllowedBy(format!(
                            "{} allows UDP 53 without DNS rules: any name",
                            pr.origin.describe()
                        ))
                    }
                    DnsVerdict::Names(n) => {
                        if let Some(p) = n.iter().find(|p| p.allows_query(name)) {
                            return DnsRuling::AllowedBy(format!(
                                "DNS rule {p} of {} allows {name:?}",
                                pr.origin.describe()
                            ));
                        }
                        patterns.extend(n.iter().map(|p| p.to_string()));
                        rules_with_dns.push(pr.origin.describe());
                    }
                }
            }
        }
        if rules_with_dns.is_empty() {
            return DnsRuling::NoRules;
        }
        patterns.sort();
        patterns.dedup();
        rules_with_dns.dedup();
        DnsRuling::Refused(format!(
            "refused: DNS rules of {} allow only {} on UDP 53 to {}; {name:?} matches none",
            rules_with_dns.join(", "),
            patterns.join(", "),
            self.describe(dst)
        ))
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
            v.iter()
                .map(|k| k.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        // A requirement that took an allow away is named after the default deny.
        let withheld = |w: &[std::sync::Arc<crate::policy::rule::PeerRequirement>]| {
            if w.is_empty() {
                return String::new();
            }
            let by: Vec<String> = w.iter().map(|r| r.describe()).collect();
            format!(" ({})", by.join("; "))
        };
        // Egress is judged first (the packet leaves before it arrives).
        let denial = |side: &Side, selected: &str, dir: &str, peer: &str| match side {
            Side::Tiered(decision, walk) if !decision.is_allowed() => Some(walk.clone()),
            Side::Decided(Decision::Denied(o)) => Some(format!("denied by {}", o.describe())),
            Side::Decided(Decision::DefaultDenied {
                isolated_by,
                withheld_by,
            }) => Some(format!(
                "default deny: {selected} is selected by {}{dir} and no rule allows {peer}{}",
                join(isolated_by),
                withheld(withheld_by)
            )),
            _ => None,
        };
        if let Some(why) =
            denial(&egress, &s, " for egress", &d).or_else(|| denial(&ingress, &d, "", &s))
        {
            return ("deny", why);
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
                Side::Tiered(_, walk) => format!("{dir}: {walk}"),
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

/// The walk through the tiers: `[Admin] AdminNetworkPolicy a[0] Pass -> [NetworkPolicy]
/// default deny: x/b is selected by NetworkPolicy x/deny-all -> denied`.
fn tier_walk(
    view: &crate::policy::engine::TierView,
    o: &crate::policy::tiers::Outcome,
    selected: &str,
) -> String {
    use crate::policy::rule::{Action, PolicyKind, Tier};
    use crate::policy::tiers::DecidedBy;
    let rule = |t: Tier, i: usize| match t {
        Tier::Admin => &view.tiers.admin[i],
        Tier::Baseline => &view.tiers.baseline[i],
    };
    let step = |t: Tier, i: usize| {
        let r = rule(t, i);
        let word = match r.action {
            Action::Allow if r.origin.policy.kind == PolicyKind::ClusterNetworkPolicy => "Accept",
            a => a.as_str(),
        };
        format!("[{}] {} {word}", t.as_str(), r.origin.describe())
    };
    let passes = |t: Tier| -> Vec<String> {
        o.passed
            .iter()
            .filter(|(pt, _)| *pt == t)
            .map(|(pt, i)| step(*pt, *i))
            .collect()
    };
    let mut parts = passes(Tier::Admin);
    match &o.by {
        DecidedBy::Rule(Tier::Admin, i) => parts.push(step(Tier::Admin, *i)),
        DecidedBy::NetworkPolicy(e) => {
            let by: Vec<String> = e.derived_from.iter().map(|x| x.describe()).collect();
            let what = if e.deny { "denied" } else { "allowed" };
            parts.push(format!("[NetworkPolicy] {what} by {}", by.join(", ")));
        }
        DecidedBy::NetworkPolicyDefault => {
            let by: Vec<String> = view.np_isolated_by.iter().map(|k| k.to_string()).collect();
            parts.push(format!(
                "[NetworkPolicy] default deny: {selected} is selected by {}",
                by.join(", ")
            ));
        }
        DecidedBy::Rule(Tier::Baseline, i) => {
            parts.push(format!("[NetworkPolicy] nothing isolates {selected}"));
            parts.extend(passes(Tier::Baseline));
            parts.push(step(Tier::Baseline, *i));
        }
        DecidedBy::Default => {
            parts.push(format!("[NetworkPolicy] nothing isolates {selected}"));
            parts.extend(passes(Tier::Baseline));
            parts.push("[Baseline] no rule matches".into());
        }
    }
    parts.push(if o.allow { "allowed" } else { "denied" }.into());
    parts.join(" -> ")
}
