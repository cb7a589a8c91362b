//! The internal rule model every policy kind is translated into.
//!
//! A `Rule` is one subject selector with its peer rules, already namespace-scoped and with
//! entities, CIDRs and KNP peers turned into selectors. Resolution never looks at the wire types.

use std::fmt;
use std::sync::Arc;

use super::selector::{LabelSelector, SelectorRef};

pub use crate::kinds::PolicyKind;

/// The resource a policy came from: rules are stored, replaced and deleted by this key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKey {
    pub kind: PolicyKind,
    /// `None` for clusterwide policies.
    pub namespace: Option<String>,
    pub name: String,
}

impl PolicyKey {
    pub fn new(kind: PolicyKind, namespace: Option<&str>, name: &str) -> Self {
        PolicyKey {
            kind,
            namespace: namespace.map(str::to_string),
            name: name.to_string(),
        }
    }

    /// The key of an object of `kind` (`CiliumNetworkPolicy`, ...), as both watchers name it:
    /// the namespace counts only for namespaced kinds. `None` for other kinds or no name.
    pub fn for_object(kind: &str, namespace: &str, name: &str) -> Option<Self> {
        let kind = PolicyKind::from_kind(kind)?;
        (!name.is_empty())
            .then(|| PolicyKey::new(kind, kind.is_namespaced().then_some(namespace), name))
    }

    /// `namespace/name`, or `name` for clusterwide policies.
    pub fn short(&self) -> String {
        match (&self.namespace, self.kind) {
            (_, PolicyKind::Builtin) => format!("built-in {}", self.name),
            (Some(ns), _) => format!("{ns}/{}", self.name),
            (None, _) => self.name.clone(),
        }
    }
}

impl fmt::Display for PolicyKey {
    /// `Kind namespace/name`, the form every error message uses.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.kind.as_str(), self.short())
    }
}

/// Traffic direction, from the point of view of the endpoint the policy applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    pub fn as_str(&self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// The section of a policy a peer rule comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Section {
    Ingress,
    IngressDeny,
    Egress,
    EgressDeny,
}

impl Section {
    pub fn direction(&self) -> Direction {
        match self {
            Section::Ingress | Section::IngressDeny => Direction::Ingress,
            Section::Egress | Section::EgressDeny => Direction::Egress,
        }
    }

    pub fn is_deny(&self) -> bool {
        matches!(self, Section::IngressDeny | Section::EgressDeny)
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Section::Ingress => "ingress",
            Section::IngressDeny => "ingressDeny",
            Section::Egress => "egress",
            Section::EgressDeny => "egressDeny",
        }
    }
}

/// A tier around the NetworkPolicy tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Admin,
    Baseline,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Admin => "Admin",
            Tier::Baseline => "Baseline",
        }
    }
}

/// What a tier rule does with the traffic it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    Allow,
    Deny,
    /// Skips the rest of the tier: the next tier decides.
    Pass,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Allow => "Allow",
            Action::Deny => "Deny",
            Action::Pass => "Pass",
        }
    }
}

/// Where a rule of a cluster tier stands: its tier and priority (lower first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TierPlace {
    pub tier: Tier,
    pub priority: u32,
}

/// Where a map entry came from: enough to explain a verdict.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RuleOrigin {
    pub policy: Arc<PolicyKey>,
    pub section: Section,
    /// Field path of the peer rule inside the policy, e.g. `spec.ingress[1]`, `specs[0].egressDeny[0]`.
    pub path: String,
    /// The rule carries L7 rules that ciliate enforces at L3/L4 only (Kafka, generic L7,
    /// TLS interception, listeners; HTTP and server names are enforced, see `PeerRule::l7`).
    pub l7: bool,
    /// A cluster tier's rule (`None`: the NetworkPolicy tier's).
    pub tier: Option<Tier>,
}

impl RuleOrigin {
    /// The rule as verdicts name it everywhere (`policy simulate`, `ciliate monitor`, the
    /// demo): `CiliumNetworkPolicy x/deny-c[0]`, the index counting in its section.
    pub fn describe(&self) -> String {
        if self.policy.kind == PolicyKind::Builtin {
            return format!(
                "{} (the node may always reach its own pods)",
                self.policy.short()
            );
        }
        let name = rule_name(
            self.policy.kind.as_str(),
            self.policy.namespace.as_deref(),
            &self.policy.name,
            self.index(),
        );
        // What a cluster tier's default stands on (`policy::tiers::Defaults`).
        if self.path.starts_with('(') {
            return format!("{name} {}", self.path);
        }
        name
    }

    /// The rule's index in its section (`specs[0].egressDeny[2]` -> 2).
    pub fn index(&self) -> Option<usize> {
        rule_index(&self.path)
    }
}

/// The last `[N]` of a rule path (`specs[0].egressDeny[2]` -> 2).
pub fn rule_index(path: &str) -> Option<usize> {
    let open = path.rfind('[')?;
    path[open + 1..].strip_suffix(']')?.parse().ok()
}

/// `Kind namespace/name` (or `Kind name`), with `[rule]` when a rule is named: how verdicts
/// name policies and rules everywhere.
pub fn rule_name(kind: &str, namespace: Option<&str>, name: &str, rule: Option<usize>) -> String {
    let mut out = match namespace {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    };
    if let Some(r) = rule {
        out.push_str(&format!("[{r}]"));
    }
    out
}

/// Which peers a rule talks about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peers {
    /// Every peer, inside or outside the cluster (identity 0 in the map).
    Any,
    /// The identities these selectors select. An empty list selects nothing.
    Selectors(Vec<SelectorRef>),
}

/// A transport protocol as written in a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
    Icmp,
    Icmpv6,
    /// CNP `ANY` or omitted: TCP, UDP and SCTP.
    Any,
}

pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;
pub const PROTO_SCTP: u8 = 132;

impl Protocol {
    /// The IP protocol numbers this stands for.
    pub fn numbers(&self) -> &'static [u8] {
        match self {
            Protocol::Tcp => &[PROTO_TCP],
            Protocol::Udp => &[PROTO_UDP],
            Protocol::Sctp => &[PROTO_SCTP],
            Protocol::Icmp => &[PROTO_ICMP],
            Protocol::Icmpv6 => &[PROTO_ICMPV6],
            Protocol::Any => &[PROTO_TCP, PROTO_UDP, PROTO_SCTP],
        }
    }

    pub fn from_number(n: u8) -> Option<Protocol> {
        match n {
            PROTO_TCP => Some(Protocol::Tcp),
            PROTO_UDP => Some(Protocol::Udp),
            PROTO_SCTP => Some(Protocol::Sctp),
            PROTO_ICMP => Some(Protocol::Icmp),
            PROTO_ICMPV6 => Some(Protocol::Icmpv6),
            _ => None,
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
            Protocol::Icmp => "ICMP",
            Protocol::Icmpv6 => "ICMPv6",
            Protocol::Any => "ANY",
        }
    }
}

/// Name of an IP protocol number for display (`TCP`, `ICMP`, `ANY` for 0).
pub fn protocol_name(n: u8) -> String {
    match n {
        0 => "ANY".to_string(),
        n => Protocol::from_number(n)
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| n.to_string()),
    }
}

/// The protocol number `protocol_name` named (`None` for `ANY`, which names no packet's).
pub fn protocol_number(name: &str) -> Option<u8> {
    [PROTO_TCP, PROTO_UDP, PROTO_SCTP, PROTO_ICMP, PROTO_ICMPV6]
        .into_iter()
        .find(|n| Protocol::from_number(*n).is_some_and(|p| p.as_str() == name))
        .or_else(|| name.parse().ok().filter(|n| *n != 0))
}

/// A destination port, numeric range or container-port name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PortSpec {
    /// Inclusive; `(0, 65535)` is every port.
    Range(u16, u16),
    /// Resolved against the destination pod's container ports (lower case).
    Named(String),
}

/// One protocol/port pair of a rule. For ICMP the "port" is the ICMP type.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PortMatch {
    pub protocol: Protocol,
    pub port: PortSpec,
}

/// Which traffic a rule talks about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ports {
    /// Every protocol and port (an L3-only rule).
    Any,
    /// Only these; an empty list matches nothing.
    List(Vec<PortMatch>),
}

/// Peers plus ports: one element of `ingress`, `egressDeny`, ... (or one KNP rule).
#[derive(Debug, Clone)]
pub struct PeerRule {
    pub origin: Arc<RuleOrigin>,
    pub peers: Peers,
    pub ports: Ports,
    /// How many of the first selectors of `peers` are endpoint selectors (`fromEndpoints`,
    /// `toEndpoints`, KNP pod/namespace peers). Requirements are ANDed into those only: Cilium
    /// folds `fromRequires`/`toRequires` into `FromEndpoints`, never into entities or CIDRs.
    pub endpoint_selectors: usize,
    /// `toPorts[].rules.dns`: the names queries on those ports may ask (egress only).
    pub dns: Vec<DnsRules>,
    /// `toPorts[].rules.http` and `serverNames`: what the HTTP proxy lets through on those
    /// ports (allow rules only).
    pub l7: Vec<L7Ports>,
    /// A cluster tier's rule (`Rule::tier`): what it does with what it matches.
    pub action: Option<Action>,
}

/// The L7 part of one `toPorts` entry the HTTP proxy enforces, and the ports it is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct L7Ports {
    pub ports: Vec<PortMatch>,
    pub rules: Arc<crate::policy::l7::http::L7PortRules>,
}

/// The DNS rules of one `toPorts` entry: queries to its ports must ask a name that matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsRules {
    pub ports: Vec<PortMatch>,
    pub names: Vec<crate::policy::fqdn::FqdnPattern>,
}

/// What a peer rule says about a DNS query on `protocol`/`port` (the peer already selected).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsVerdict<'a> {
    /// The rule does not allow the port at all.
    NotCovered,
    /// The port is allowed without DNS rules: any name.
    AnyName,
    /// Only names matching these.
    Names(Vec<&'a crate::policy::fqdn::FqdnPattern>),
}

impl PeerRule {
    /// Some peer is a DNS name (`toFQDNs`, `domainNames`).
    pub fn has_fqdn_peers(&self) -> bool {
        matches!(&self.peers, Peers::Selectors(s) if s.iter().any(|s| matches!(s.kind(), super::selector::SelectorKind::Fqdn(_))))
    }

    /// How this rule treats a DNS query on `protocol`/`port`. An L3-only rule (`Ports::Any`)
    /// does not cover it: as in Cilium, a port-less allow never lifts another rule's DNS rules
    /// on the port (the DNS proxy still sees the query).
    /// `named` resolves a named port of the destination (`None`: it has no such port).
    pub fn dns_verdict(
        &self,
        protocol: u8,
        port: u16,
        named: &dyn Fn(&str, u8) -> Option<u16>,
    ) -> DnsVerdict<'_> {
        let covers = |m: &PortMatch| {
            m.protocol.numbers().contains(&protocol)
                && match &m.port {
                    PortSpec::Range(lo, hi) => (*lo..=*hi).contains(&port),
                    PortSpec::Named(n) => named(n, protocol) == Some(port),
                }
        };
        let Ports::List(list) = &self.ports else {
            return DnsVerdict::NotCovered;
        };
        let with_rules: Vec<&DnsRules> = self
            .dns
            .iter()
            .filter(|d| d.ports.iter().any(covers))
            .collect();
        let without_rules = list
            .iter()
            .filter(|m| covers(m))
            .any(|m| !self.dns.iter().any(|d| d.ports.contains(m)));
        match (without_rules, with_rules.is_empty()) {
            (true, _) => DnsVerdict::AnyName,
            (false, true) => DnsVerdict::NotCovered,
            (false, false) => {
                DnsVerdict::Names(with_rules.iter().flat_map(|d| d.names.iter()).collect())
            }
        }
    }
}

impl PeerRule {
    /// The endpoint selectors (requirements apply) and the other selectors (they do not).
    pub fn split_selectors(&self) -> (&[SelectorRef], &[SelectorRef]) {
        match &self.peers {
            Peers::Any => (&[], &[]),
            Peers::Selectors(s) => s.split_at(self.endpoint_selectors.min(s.len())),
        }
    }
}

/// One `fromRequires` / `toRequires` selector. Cilium gathers the requirements of every rule
/// that selects an endpoint (`resolveL4IngressPolicy`) and ANDs them into each endpoint peer
/// selector of that direction, whichever policy it comes from: requirements of allow sections
/// into allows, those of deny sections into denies. They grant nothing by themselves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerRequirement {
    /// The requiring policy, its section, and the field path (`spec.ingress[0].fromRequires[1]`).
    pub origin: Arc<RuleOrigin>,
    /// Already namespace-scoped like any peer selector of its policy.
    pub selector: LabelSelector,
    /// The selector as written (`group=A`), for explanations.
    pub text: String,
}

impl PeerRequirement {
    /// `CiliumNetworkPolicy x/needs-group-a requires group=A`.
    pub fn describe(&self) -> String {
        format!("{} requires {}", self.origin.policy, self.text)
    }
}

/// What a rule applies to.
#[derive(Debug, Clone)]
pub enum Subject {
    /// Endpoints (pods) whose identity the selector selects.
    Endpoints(SelectorRef),
    /// Host endpoints of nodes whose labels the selector matches (CCNP `nodeSelector`).
    Nodes(SelectorRef),
}

impl Subject {
    pub fn selector(&self) -> &SelectorRef {
        match self {
            Subject::Endpoints(s) | Subject::Nodes(s) => s,
        }
    }
}

/// One rule: a subject and what it allows or denies, per direction.
#[derive(Debug, Clone)]
pub struct Rule {
    pub policy: Arc<PolicyKey>,
    /// Field path of this rule: `spec` or `specs[i]`.
    pub path: String,
    pub subject: Subject,
    /// Whether selecting an endpoint turns on default deny for its ingress / egress.
    pub isolates_ingress: bool,
    pub isolates_egress: bool,
    /// Peer rules of both directions, allow and deny.
    pub peer_rules: Vec<PeerRule>,
    /// `fromRequires` / `toRequires` of every section; they constrain the peer rules of every
    /// rule that selects the same endpoint (see `PeerRequirement`).
    pub requires: Vec<Arc<PeerRequirement>>,
    /// A rule of a cluster tier (AdminNetworkPolicy, ...): its peer rules are evaluated in
    /// order around the NetworkPolicy tier (`policy::tiers`), never merged into it.
    pub tier: Option<TierPlace>,
    /// The policy is staged (`policy.ciliate.io/mode: audit`): resolved, never enforced; only
    /// the staged verdict of a flow (`PolicyEngine::resolve_staged`) counts it.
    pub staged: bool,
}

impl Rule {
    /// Replaces every selector by `f(selector)` (used to intern them in the selector cache).
    pub fn map_selectors(&mut self, mut f: impl FnMut(&SelectorRef) -> SelectorRef) {
        match &mut self.subject {
            Subject::Endpoints(s) | Subject::Nodes(s) => *s = f(s),
        }
        for pr in &mut self.peer_rules {
            if let Peers::Selectors(sels) = &mut pr.peers {
                for s in sels.iter_mut() {
                    *s = f(s);
                }
            }
        }
    }

    /// Every selector this rule references (subject first), for the selector cache.
    pub fn selectors(&self) -> impl Iterator<Item = &SelectorRef> {
        std::iter::once(self.subject.selector()).chain(self.peer_rules.iter().flat_map(|pr| {
            match &pr.peers {
                Peers::Any => [].iter(),
                Peers::Selectors(s) => s.iter(),
            }
        }))
    }
}
