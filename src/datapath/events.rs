//! Policy verdict events from the datapath (the ring buffer), as `ciliate monitor` shows them.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::policy::attribution::{CookieJar, MatchKind, PolicyRef};
use crate::policy::rule::protocol_name;

/// One verdict (a flow, as `ciliate monitor` shows it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerdictEvent {
    /// `flow`.
    #[serde(rename = "type", default = "flow")]
    pub kind: String,
    /// Kernel monotonic time of the decision, in nanoseconds, to within a scheduler tick and the
    /// datapath's event batching (a millisecond).
    pub timestamp_ns: u64,
    /// When the agent received it (RFC 3339, milliseconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<String>,
    pub endpoint: u32,
    pub peer_identity: u32,
    pub direction: String,
    pub protocol: String,
    /// Destination port, or the ICMP type.
    pub port: u16,
    /// Source port (TCP, UDP, SCTP; absent when 0: other protocols, older programs).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub source_port: u16,
    /// The TCP flags byte of the packet judged (FIN 0x01, SYN 0x02, RST 0x04, PSH 0x08, ACK
    /// 0x10, URG 0x20, ECE 0x40, CWR 0x80; absent when 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tcp_flags: u8,
    /// Hubble's words: `forwarded`, `dropped` (or `audit`).
    pub verdict: String,
    /// Why: `policy-deny`, `default-deny`, `not-realized`, `malformed`, `policy`, ...
    pub reason: String,
    pub source: String,
    pub destination: String,
    /// `namespace/name` of the source, when it is a pod the agent knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_pod: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_pod: Option<String>,
    /// How it matched: `l3-only`, `l3-l4`, `l4-only`, `all`, `deny-rule`, `default-deny`,
    /// `no-policy`; absent when nothing decided by policy (established flows, not realized).
    #[serde(rename = "match", default, skip_serializing_if = "Option::is_none")]
    pub match_kind: Option<String>,
    /// The deciding policies: the rules that allowed or denied it, or for a default deny the
    /// policies that selected the endpoint in that direction.
    #[serde(default)]
    pub policies: Vec<PolicyRef>,
    /// The policy revision the deciding entry was written at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
    /// The datapath's attribution cookie (resolved into the fields above).
    #[serde(skip)]
    pub cookie: u32,
    /// `type: lost`: this many events did not fit in the datapath's ring buffer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<u64>,
    /// `type: l7`: the HTTP request the proxy judged (Hubble's fields).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpFields>,
    /// `type: l7`: the time the proxy added, without the server's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ns: Option<u64>,
    /// `type: l7` from the DNS proxy: the query and its answer (Hubble's DNS record). These
    /// flows reach `ciliate monitor` as its `dns` events (interfaces.md section 9), never as
    /// flows: `FlowFilter` skips them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<DnsFields>,
    /// The verdict with the staged policies enforced, when it differs from `verdict`
    /// (interfaces section 16; new connections only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staged: Option<crate::policy::staged::StagedVerdict>,
    /// Both ends' identity labels and learned DNS names: added as `ciliate monitor` serves a
    /// flow (never kept in the ring), read back by `policy diff|recommend --flows FILE`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<Box<FlowLabels>>,
}

/// A flow's ends as the agent knows them when it serves the flow.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FlowLabels {
    #[serde(default)]
    pub source: Vec<String>,
    #[serde(default)]
    pub destination: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_names: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub destination_names: Vec<String>,
}

/// Hubble's HTTP fields of an `l7` flow.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HttpFields {
    pub method: String,
    pub url: String,
    /// `HTTP/1.1`, `HTTP/2.0`, or `TLS` for a connection judged by its server name.
    pub protocol: String,
    /// The response's status (0: none, a TLS connection).
    pub code: u16,
}

/// The report of `n` events the datapath could not deliver (its ring buffer was full).
pub fn lost_event(n: u64) -> VerdictEvent {
    VerdictEvent {
        kind: "lost".into(),
        timestamp_ns: 0,
        time: None,
        endpoint: 0,
        peer_identity: 0,
        direction: String::new(),
        protocol: String::new(),
        port: 0,
        source_port: 0,
        tcp_flags: 0,
        verdict: "lost".into(),
        reason: "ring-buffer-full".into(),
        source: String::new(),
        destination: String::new(),
        source_pod: None,
        destination_pod: None,
        match_kind: None,
        policies: vec![],
        revision: None,
        cookie: 0,
        lost: Some(n),
        http: None,
        latency_ns: None,
        dns: None,
        staged: None,
        labels: None,
    }
}

/// `ns/pod (address)` when the pod is known, else the address.
fn shown(addr: &str, pod: &Option<String>) -> String {
    match pod {
        Some(p) => format!("{p} ({addr})"),
        None => addr.to_string(),
    }
}

fn flow() -> String {
    "flow".into()
}

impl VerdictEvent {
    /// The direction and protocol number a policy decided this flow on (`None` for records
    /// that name neither: losses, L7 records).
    pub fn decision_inputs(&self) -> Option<(crate::policy::rule::Direction, u8)> {
        use crate::policy::rule::Direction;
        let d = match self.direction.as_str() {
            "ingress" => Direction::Ingress,
            "egress" => Direction::Egress,
            _ => return None,
        };
        Some((d, crate::policy::rule::protocol_number(&self.protocol)?))
    }

    /// Whether the flow's destination (`dst`) or source is this node (`monitor --to host`,
    /// `--from host`): the host endpoint's own flows, or a pod's flows with the node as peer.
    pub fn host_side(&self, dst: bool) -> bool {
        let ingress = self.direction == "ingress";
        if u32::from(super::HOST_ENDPOINT_ID) == self.endpoint {
            ingress == dst
        } else {
            self.peer_identity == crate::policy::identity::IDENTITY_HOST && ingress != dst
        }
    }

    /// One readable line, as `ciliate monitor` prints it.
    pub fn line(&self) -> String {
        if let Some(n) = self.lost {
            return format!("LOST      {n} events (the datapath's ring buffer was full)");
        }
        let mut line = format!(
            "{} {:<9} endpoint {} {} {} -> {} {}/{} peer identity {} ({})",
            self.timestamp_ns,
            self.verdict.to_uppercase(),
            self.endpoint,
            self.direction,
            shown(&self.source, &self.source_pod),
            shown(&self.destination, &self.destination_pod),
            self.protocol,
            self.port,
            self.peer_identity,
            self.reason
        );
        if let Some(why) = self.why() {
            line.push_str(": ");
            line.push_str(&why);
        }
        if let Some(s) = &self.staged {
            line.push_str("; staged: would be ");
            line.push_str(&s.verdict.to_uppercase());
            for (i, p) in s.policies.iter().enumerate() {
                line.push_str(if i == 0 { " by " } else { ", " });
                p.write_named(&mut line);
            }
        }
        line
    }

    /// Which policies decided, in words: `allowed by CiliumNetworkPolicy x/a[0]`, `denied by
    /// ...`, `default deny: selected by ... (none allows the peer)`, `no policy selects the
    /// endpoint`.
    pub fn why(&self) -> Option<String> {
        let mut out = String::new();
        self.write_why(&mut out).then_some(out)
    }

    /// `why` appended to `out` (false, and nothing appended, when there is nothing to say).
    pub fn write_why(&self, out: &mut String) -> bool {
        let names = |out: &mut String| {
            for (i, p) in self.policies.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                p.write_named(out);
            }
        };
        let Some(m) = self.match_kind.as_deref() else {
            return false;
        };
        match m {
            "no-policy" => out.push_str("no policy selects the endpoint"),
            "default-deny" if self.policies.is_empty() => out.push_str("default deny"),
            "default-deny" => {
                out.push_str("default deny: selected by ");
                names(out);
                out.push_str(" (none allows the peer)");
            }
            "deny-rule" => {
                out.push_str("denied by ");
                names(out);
            }
            _ if self.policies.is_empty() => return false,
            m => {
                out.push_str("allowed by ");
                names(out);
                out.push_str(" (");
                out.push_str(m);
                out.push(')');
            }
        }
        true
    }

    /// Names the pods behind the source and destination addresses (a name the record came
    /// with, as the DNS proxy's, stays when the address is not a pod's the agent knows).
    pub fn name_pods(&mut self, pod_of: impl Fn(IpAddr) -> Option<String>) {
        let name = |a: &str| a.parse().ok().and_then(&pod_of);
        self.source_pod = name(&self.source).or(self.source_pod.take());
        self.destination_pod = name(&self.destination).or(self.destination_pod.take());
    }

    /// Fills in the deciding policies from the agent's cookie jar.
    pub fn attribute(&mut self, jar: &CookieJar) {
        if let Some(a) = jar.resolve(self.cookie) {
            self.match_kind = Some(a.match_kind.as_str().to_string());
            self.policies = a.policies.clone();
            self.revision = Some(a.revision);
        } else if self.reason == "not-isolated" {
            self.match_kind = Some(MatchKind::NoPolicy.as_str().to_string());
        } else if self.reason == "default-deny" {
            self.match_kind = Some(MatchKind::DefaultDeny.as_str().to_string());
        }
    }
}

/// A policy or endpoint notification of `ciliate monitor` (Cilium's `PolicyUpdateMessage` and
/// endpoint-regenerate notifications): `type` `policy` (`added`, `updated`, `deleted`,
/// `rejected`) or `endpoint` (`regenerated`, `regeneration-failed`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Notification {
    #[serde(rename = "type")]
    pub kind: String,
    pub action: String,
    /// The policy (`type: policy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyRef>,
    /// The endpoint and its pod (`type: endpoint`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
    /// Endpoints the policy change regenerates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// A DNS verdict (`type: dns`).
    #[serde(default, flatten, skip_serializing_if = "Option::is_none")]
    pub dns: Option<DnsFields>,
}

/// The fields of a `dns` notification (interfaces.md section 9).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DnsFields {
    /// `namespace/name`.
    pub pod: String,
    pub query: String,
    pub qtype: String,
    pub answers: Vec<String>,
    /// `forwarded` or `refused`.
    pub verdict: String,
    pub policies: Vec<String>,
}

impl Notification {
    /// The DNS proxy's verdict on one query.
    pub fn dns(endpoint: u32, fields: DnsFields) -> Self {
        Notification {
            kind: "dns".into(),
            action: fields.verdict.clone(),
            policy: None,
            endpoint: Some(endpoint),
            name: None,
            revision: None,
            endpoints: None,
            error: None,
            dns: Some(fields),
        }
    }

    pub fn policy(
        action: &str,
        policy: PolicyRef,
        revision: Option<u64>,
        endpoints: Option<usize>,
        error: Option<String>,
    ) -> Self {
        Notification {
            kind: "policy".into(),
            action: action.into(),
            policy: Some(policy),
            endpoint: None,
            name: None,
            revision,
            endpoints,
            error,
            dns: None,
        }
    }

    pub fn endpoint(
        action: &str,
        id: u32,
        name: &str,
        revision: u64,
        error: Option<String>,
    ) -> Self {
        Notification {
            kind: "endpoint".into(),
            action: action.into(),
            policy: None,
            endpoint: Some(id),
            name: Some(name.into()),
            revision: Some(revision),
            endpoints: None,
            error,
            dns: None,
        }
    }

    /// One readable line, as `ciliate monitor` prints it.
    pub fn line(&self) -> String {
        let mut out = format!("{:<9} {}", self.kind.to_uppercase(), self.action);
        if let Some(p) = &self.policy {
            out.push_str(&format!(" {} {}", p.kind, p.short()));
        }
        if let (Some(id), Some(name)) = (self.endpoint, &self.name) {
            out.push_str(&format!(" endpoint {id} ({name})"));
        }
        if let Some(r) = self.revision {
            out.push_str(&format!(" revision {r}"));
        }
        if let Some(n) = self.endpoints {
            out.push_str(&format!(", {n} endpoints to regenerate"));
        }
        if let Some(e) = &self.error {
            out.push_str(&format!(": {e}"));
        }
        if let (Some(id), Some(d)) = (self.endpoint, &self.dns) {
            out.push_str(&format!(
                " endpoint {id} ({}) {} {}",
                d.pod, d.qtype, d.query
            ));
            if !d.answers.is_empty() {
                out.push_str(&format!(" -> {}", d.answers.join(", ")));
            }
            if !d.policies.is_empty() {
                let by = if d.verdict == "refused" {
                    "refused by DNS rules of"
                } else {
                    "allowed by"
                };
                out.push_str(&format!(": {by} {}", d.policies.join(", ")));
            }
        }
        out
    }
}

/// `ciliate monitor`'s filters (all given ones must hold); also the query of `/v1/monitor`.
#[derive(Debug, Clone, Default, clap::Args, serde::Serialize, serde::Deserialize)]
pub struct FlowFilter {
    /// Only flows from this address (or `NS/POD`, when the event names pods).
    #[arg(long)]
    pub from: Option<String>,
    /// Only flows to this address (or `NS/POD`).
    #[arg(long)]
    pub to: Option<String>,
    /// Only flows to this port (or ICMP type).
    #[arg(long)]
    pub port: Option<u16>,
    /// Only `forwarded`, `dropped` or `audit` flows.
    #[arg(long, value_parser = ["forwarded", "dropped", "audit"])]
    pub verdict: Option<String>,
    /// Only flows a policy decided: `NS/NAME`, or `NAME` for cluster-scoped ones; a kind may
    /// lead (`AdminNetworkPolicy/NAME`, `CiliumNetworkPolicy/NS/NAME`) and a rule follow
    /// (`NAME[0]`).
    #[arg(long, value_parser = policy_pattern)]
    pub policy: Option<String>,
    /// Only flows a policy of this tier decided (with `--policy`: that policy, in that tier).
    #[arg(long, value_parser = ["admin", "network-policy", "baseline"])]
    pub tier: Option<String>,
    /// Only events of this type (`dns` is reserved for DNS-aware policy).
    #[arg(long = "type", value_parser = ["flow", "l7", "dns", "policy", "endpoint"])]
    #[serde(rename = "type")]
    pub kind: Option<String>,
}

impl FlowFilter {
    /// Whether an event of `kind` other than a flow is shown: when asked for by `--type`, or
    /// when no filter is given at all.
    pub fn accepts_other(&self, kind: &str) -> bool {
        match &self.kind {
            Some(k) => k == kind,
            None => {
                self.from.is_none()
                    && self.to.is_none()
                    && self.port.is_none()
                    && self.verdict.is_none()
                    && self.policy.is_none()
                    && self.tier.is_none()
            }
        }
    }

    pub fn accepts(&self, e: &VerdictEvent) -> bool {
        // The DNS proxy's records are the monitor's `dns` events, shown as such.
        if e.dns.is_some() || self.kind.as_deref().is_some_and(|k| k != e.kind) {
            return false;
        }
        if e.lost.is_some() {
            return true; // a loss is always shown: it may hide what the filter wants
        }
        let peer = |want: &Option<String>, addr: &str, pod: &Option<String>, dst: bool| {
            want.as_deref().is_none_or(|w| {
                w == addr || pod.as_deref() == Some(w) || (w == "host" && e.host_side(dst))
            })
        };
        peer(&self.from, &e.source, &e.source_pod, false)
            && peer(&self.to, &e.destination, &e.destination_pod, true)
            && self.port.is_none_or(|p| p == e.port)
            && self.verdict.as_deref().is_none_or(|v| v == e.verdict)
            && self.decided_by(&e.policies)
    }

    /// `--policy` and `--tier`: one of the flow's policies is both.
    fn decided_by(&self, policies: &[PolicyRef]) -> bool {
        if self.policy.is_none() && self.tier.is_none() {
            return true;
        }
        // An unusable pattern (from a hand-written query) matches nothing.
        let pattern = match self.policy.as_deref().map(PolicyPattern::parse) {
            Some(Ok(p)) => Some(p),
            Some(Err(_)) => return false,
            None => None,
        };
        policies.iter().any(|p| {
            pattern.as_ref().is_none_or(|pat| pat.matches(p))
                && self.tier.as_deref().is_none_or(|t| p.tier.as_str() == t)
        })
    }
}

/// What `--policy` names: `[KIND/]NS/NAME` or `[KIND/]NAME`, then optionally `[RULE]`.
#[derive(Debug, PartialEq)]
struct PolicyPattern<'a> {
    kind: Option<&'a str>,
    namespace: Option<&'a str>,
    name: &'a str,
    rule: Option<usize>,
}

impl<'a> PolicyPattern<'a> {
    fn parse(s: &'a str) -> Result<PolicyPattern<'a>, String> {
        let (body, rule) = match s.strip_suffix(']').and_then(|t| t.rsplit_once('[')) {
            Some((body, n)) => {
                let n = n
                    .parse::<usize>()
                    .map_err(|_| format!("{s:?}: the rule in [...] is its index, e.g. [0]"))?;
                (body, Some(n))
            }
            None => (s, None),
        };
        // Namespaces are lower case: a leading segment that is a policy kind is the kind.
        let (kind, rest) = match body.split_once('/') {
            Some((k, rest)) if crate::kinds::PolicyKind::from_kind(k).is_some() => (Some(k), rest),
            Some((k, _)) if k.starts_with(|c: char| c.is_ascii_uppercase()) => {
                return Err(format!(
                    "{s:?}: {k:?} is no policy kind (expected {})",
                    crate::kinds::PolicyKind::expected()
                ))
            }
            _ => (None, body),
        };
        let (namespace, name) = match rest.split_once('/') {
            Some((ns, name)) => (Some(ns), name),
            None => (None, rest),
        };
        if name.is_empty() || name.contains('/') || namespace == Some("") {
            return Err(format!(
                "{s:?}: expected [KIND/]NAMESPACE/NAME or [KIND/]NAME, optionally with [RULE]"
            ));
        }
        Ok(PolicyPattern {
            kind,
            namespace,
            name,
            rule,
        })
    }

    fn matches(&self, p: &PolicyRef) -> bool {
        self.name == p.name
            && self.namespace == p.namespace.as_deref()
            && self.kind.is_none_or(|k| k == p.kind)
            && self.rule.is_none_or(|r| p.rule == Some(r))
    }
}

/// `--policy`'s parser: the pattern as given, once it parses.
fn policy_pattern(s: &str) -> Result<String, String> {
    PolicyPattern::parse(s).map(|_| s.to_string())
}

fn is_zero<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// Builds an event from the datapath's raw fields.
#[allow(clippy::too_many_arguments)]
pub fn verdict_event(
    timestamp_ns: u64,
    endpoint: u32,
    peer_identity: u32,
    egress: bool,
    protocol: u8,
    port: u16,
    reason: &str,
    family: u8,
    saddr: [u8; 16],
    daddr: [u8; 16],
    cookie: u32,
) -> VerdictEvent {
    let addr = |a: [u8; 16]| -> String {
        if family == 4 {
            IpAddr::from([a[0], a[1], a[2], a[3]]).to_string()
        } else {
            IpAddr::from(a).to_string()
        }
    };
    let (verdict, reason) = match reason.split_once('-') {
        Some(("allow" | "pass", r)) => ("forwarded", r.to_string()),
        Some(("drop", r)) => ("dropped", r.to_string()),
        Some(("audit", r)) => ("audit", r.to_string()),
        _ => ("dropped", reason.to_string()),
    };
    VerdictEvent {
        kind: flow(),
        timestamp_ns,
        time: None,
        endpoint,
        peer_identity,
        direction: if egress { "egress" } else { "ingress" }.into(),
        protocol: protocol_name(protocol),
        port,
        source_port: 0,
        tcp_flags: 0,
        verdict: verdict.into(),
        reason,
        source: addr(saddr),
        destination: addr(daddr),
        source_pod: None,
        destination_pod: None,
        match_kind: None,
        policies: vec![],
        revision: None,
        cookie,
        lost: None,
        http: None,
        latency_ns: None,
        dns: None,
        staged: None,
        labels: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `PolicyRef`s of a NetworkPolicy `x/name` isolating an endpoint.
    fn refs_of(name: &str) -> Vec<crate::policy::attribution::PolicyRef> {
        let p = std::sync::Arc::new(crate::policy::rule::PolicyKey::new(
            crate::policy::rule::PolicyKind::NetworkPolicy,
            Some("x"),
            name,
        ));
        crate::policy::attribution::isolation_cookie(&[p]).1
    }

    #[test]
    fn events_render_as_one_line() {
        let mut s = [0u8; 16];
        s[..4].copy_from_slice(&[10, 0, 0, 1]);
        let mut d = [0u8; 16];
        d[..4].copy_from_slice(&[10, 0, 0, 2]);
        let mut e = verdict_event(7, 2, 300, false, 6, 8080, "drop-default-deny", 4, s, d, 0);
        assert_eq!(e.verdict, "dropped");
        assert_eq!(e.reason, "default-deny");
        assert_eq!(e.line(), "7 DROPPED   endpoint 2 ingress 10.0.0.1 -> 10.0.0.2 TCP/8080 peer identity 300 (default-deny)");
        // Attributed through the cookie jar.
        let jar = CookieJar::default();
        let p = std::sync::Arc::new(crate::policy::rule::PolicyKey::new(
            crate::policy::rule::PolicyKind::NetworkPolicy,
            Some("x"),
            "deny-all",
        ));
        let (c, refs) = crate::policy::attribution::isolation_cookie(&[p]);
        jar.register(c, MatchKind::DefaultDeny, refs, 4);
        e.cookie = c;
        e.attribute(&jar);
        assert_eq!(e.match_kind.as_deref(), Some("default-deny"));
        assert_eq!(e.revision, Some(4));
        assert!(
            e.line().ends_with(
                "(default-deny): default deny: selected by NetworkPolicy x/deny-all (none allows the peer)"
            ),
            "{}",
            e.line()
        );
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["type"], "flow");
        assert_eq!(json["policies"][0]["name"], "deny-all");
        assert_eq!(json["match"], "default-deny");
        assert!(json.get("staged").is_none());
        // A staged policy would let it through: the line and the JSON say so.
        let staged = crate::policy::staged::StagedVerdict {
            verdict: "forwarded".into(),
            policies: refs_of("allow-b").into(),
        };
        e.staged = Some(staged);
        assert!(
            e.line().ends_with(
                "(none allows the peer); staged: would be FORWARDED by NetworkPolicy x/allow-b"
            ),
            "{}",
            e.line()
        );
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["staged"]["verdict"], "forwarded");
        assert_eq!(json["staged"]["policies"][0]["name"], "allow-b");
        e.staged = None;
        // The monitor's filters.
        let f = |args: &[&str]| {
            use clap::Parser;
            #[derive(clap::Parser)]
            struct P {
                #[command(flatten)]
                f: FlowFilter,
            }
            let mut v = vec!["x"];
            v.extend(args);
            P::parse_from(v).f.accepts(&e)
        };
        assert!(f(&[]));
        assert!(f(&[
            "--verdict",
            "dropped",
            "--to",
            "10.0.0.2",
            "--port",
            "8080"
        ]));
        assert!(f(&["--policy", "x/deny-all", "--from", "10.0.0.1"]));
        assert!(!f(&["--verdict", "forwarded"]));
        assert!(!f(&["--policy", "x/other"]));
        assert!(!f(&["--from", "10.0.0.2"]));
        assert!(!f(&["--port", "80"]));
        e.name_pods(|ip| (ip.to_string() == "10.0.0.2").then(|| "x/b".to_string()));
        assert_eq!(e.destination_pod.as_deref(), Some("x/b"));
        assert!(
            e.line().contains("10.0.0.1 -> x/b (10.0.0.2) TCP/8080"),
            "{}",
            e.line()
        );
        let to_b = FlowFilter {
            to: Some("x/b".into()),
            ..Default::default()
        };
        assert!(to_b.accepts(&e), "pods by name");
        // Notifications show only when asked for, or when no flow filter is given.
        assert!(!to_b.accepts_other("policy"));
        assert!(FlowFilter::default().accepts_other("policy"));
        let policy_only = FlowFilter {
            kind: Some("policy".into()),
            ..Default::default()
        };
        assert!(policy_only.accepts_other("policy") && !policy_only.accepts_other("endpoint"));
        assert!(
            !policy_only.accepts(&e),
            "flows are not policy notifications"
        );
        let n = Notification::policy(
            "updated",
            PolicyRef {
                kind: "CiliumNetworkPolicy".into(),
                namespace: Some("x".into()),
                name: "a".into(),
                rule: None,
                http: None,
                tier: Default::default(),
            },
            Some(7),
            Some(2),
            None,
        );
        assert_eq!(
            n.line(),
            "POLICY    updated CiliumNetworkPolicy x/a revision 7, 2 endpoints to regenerate"
        );
        let lost = lost_event(3);
        assert!(to_b.accepts(&lost), "losses are never filtered away");
        assert!(lost.line().starts_with("LOST      3 events"));
        assert_eq!(serde_json::to_value(&lost).unwrap()["type"], "lost");
    }

    #[test]
    fn monitor_filters_by_kind_rule_and_tier() {
        use crate::policy::attribution::PolicyTier;
        use clap::Parser;
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            f: FlowFilter,
        }
        let parse = |args: &[&str]| {
            let mut v = vec!["x"];
            v.extend(args);
            P::try_parse_from(v).map(|p| p.f)
        };
        let reference = |kind: &str, ns: Option<&str>, name: &str, rule, tier| PolicyRef {
            kind: kind.into(),
            namespace: ns.map(str::to_string),
            name: name.into(),
            rule: Some(rule),
            http: None,
            tier,
        };
        let mut e = verdict_event(1, 1, 2, false, 6, 80, "drop-policy", 4, [0; 16], [0; 16], 0);
        e.policies = vec![
            reference("AdminNetworkPolicy", None, "deny-a", 0, PolicyTier::Admin),
            reference(
                "CiliumNetworkPolicy",
                Some("x"),
                "allow",
                1,
                PolicyTier::NetworkPolicy,
            ),
        ];
        let shown = |args: &[&str]| parse(args).expect("parses").accepts(&e);
        assert!(shown(&["--tier", "admin"]));
        assert!(shown(&["--tier", "network-policy"]));
        assert!(!shown(&["--tier", "baseline"]));
        assert!(shown(&["--policy", "deny-a"]));
        assert!(shown(&["--policy", "AdminNetworkPolicy/deny-a"]));
        assert!(shown(&["--policy", "AdminNetworkPolicy/deny-a[0]"]));
        assert!(!shown(&["--policy", "AdminNetworkPolicy/deny-a[1]"]));
        assert!(!shown(&["--policy", "ClusterNetworkPolicy/deny-a"]));
        assert!(shown(&["--policy", "CiliumNetworkPolicy/x/allow[1]"]));
        assert!(!shown(&["--policy", "NetworkPolicy/x/allow"]));
        assert!(!shown(&["--policy", "y/allow"]));
        // Both of one entry: deny-a is no NetworkPolicy-tier rule.
        assert!(!shown(&["--policy", "deny-a", "--tier", "network-policy"]));
        assert!(shown(&["--policy", "x/allow", "--tier", "network-policy"]));
        // With --tier, other events stay out as with every flow filter.
        assert!(!parse(&["--tier", "admin"]).unwrap().accepts_other("policy"));
        for (bad, says) in [
            ("Adminnetworkpolicy/deny-a", "is no policy kind"),
            ("a/b/c", "expected [KIND/]NAMESPACE/NAME"),
            ("deny-a[first]", "the rule in [...] is its index"),
            ("x/", "expected [KIND/]NAMESPACE/NAME"),
        ] {
            let err = parse(&["--policy", bad]).expect_err(bad).to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
        assert!(parse(&["--tier", "Admin"]).is_err());
    }
}
