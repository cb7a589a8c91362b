//! `ciliate policy recommend`: for each workload of a namespace seen in the observed
//! connections, one policy that allows exactly what it was seen doing, ingress and egress.
//!
//! - Workloads are selected by the labels their controllers set (`app=web`), never by pod
//!   names or the hashes controllers add (`pod-template-hash`, ...).
//! - Pod peers by their workload labels (and namespace by name); outside peers by the DNS
//!   names the DNS proxy saw them under (`toFQDNs`, CiliumNetworkPolicy egress only), else by
//!   their address (`/32`, `/128`); the node and the API server by entity.
//! - Ports and protocols as observed. Every workload keeps DNS to kube-dns (UDP and TCP 53;
//!   in a CiliumNetworkPolicy through the DNS proxy, which `toFQDNs` needs).
//! - Only forwarded connections are allowed: what policy dropped stays dropped.
//! - Stable: the same connections give the same YAML (everything sorted; no clock).

use std::collections::{BTreeMap, BTreeSet};

use serde_yaml::{Mapping, Value};

use super::history::FlowHistory;
use super::Peer;
use crate::policy::rule::{protocol_name, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP};

/// What to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    #[value(name = "CiliumNetworkPolicy")]
    CiliumNetworkPolicy,
    #[value(name = "NetworkPolicy")]
    NetworkPolicy,
}

/// Labels controllers add per pod or per revision: never in a recommended selector.
const NOT_WORKLOAD: &[&str] = &[
    "pod-template-hash",
    "controller-revision-hash",
    "pod-template-generation",
    "statefulset.kubernetes.io/pod-name",
    "apps.kubernetes.io/pod-index",
    "controller-uid",
    "batch.kubernetes.io/controller-uid",
    "job-name",
    "batch.kubernetes.io/job-name",
    "batch.kubernetes.io/job-completion-index",
];

type Selector = BTreeMap<String, String>;

/// A peer as a rule names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Target {
    Pod { namespace: String, labels: Selector },
    Entity(&'static str),
    Fqdn(String),
    Cidr(String),
}

/// A protocol and port (ICMP: the type).
type Port = (u8, u16);

#[derive(Default)]
struct Workload {
    example: String,
    ingress: BTreeMap<Target, BTreeSet<Port>>,
    egress: BTreeMap<Target, BTreeSet<Port>>,
}

fn workload_labels(p: &Peer) -> Selector {
    p.pod_labels()
        .filter(|(k, _)| !NOT_WORKLOAD.contains(k))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// How a rule names `p`, seen from the other end (`egress`: `p` is the destination).
fn targets(p: &Peer, egress: bool, kind: Kind) -> Vec<Target> {
    if let Some(ns) = &p.namespace {
        return vec![Target::Pod {
            namespace: ns.clone(),
            labels: workload_labels(p),
        }];
    }
    for (label, entity) in [
        ("reserved:host", "host"),
        ("reserved:remote-node", "remote-node"),
        ("reserved:kube-apiserver", "kube-apiserver"),
    ] {
        if p.has_label(label) {
            return vec![Target::Entity(entity)];
        }
    }
    if egress && kind == Kind::CiliumNetworkPolicy && !p.names.is_empty() {
        return p.names.iter().map(|n| Target::Fqdn(n.clone())).collect();
    }
    match p.ip {
        Some(ip) => vec![Target::Cidr(ipnet::IpNet::from(ip).to_string())],
        None => vec![],
    }
}

fn kube_dns() -> Target {
    Target::Pod {
        namespace: "kube-system".into(),
        labels: [("k8s-app".to_string(), "kube-dns".to_string())].into(),
    }
}

/// The recommendation for namespace `ns` from the connections last seen at or after `since`.
pub fn recommend(history: &FlowHistory, since: u64, ns: &str, kind: Kind) -> String {
    let mut workloads: BTreeMap<Selector, Workload> = BTreeMap::new();
    let (mut used, mut dropped) = (0usize, 0usize);
    let (mut first, mut last) = (u64::MAX, 0u64);
    for v in history.iter_since(since) {
        let (src_in, dst_in) = (
            v.source.namespace.as_deref() == Some(ns),
            v.destination.namespace.as_deref() == Some(ns),
        );
        if !src_in && !dst_in {
            continue;
        }
        if v.dropped {
            dropped += 1;
            continue;
        }
        used += 1;
        first = first.min(v.first);
        last = last.max(v.last);
        let port = (v.proto, v.port);
        for (me, other, egress) in [
            (v.source, v.destination, true),
            (v.destination, v.source, false),
        ] {
            if me.namespace.as_deref() != Some(ns) {
                continue;
            }
            let w = workloads.entry(workload_labels(me)).or_default();
            if w.example.is_empty() || me.pod.as_ref().is_some_and(|p| *p < w.example) {
                w.example = me.pod.clone().unwrap_or_default();
            }
            let side = if egress {
                &mut w.egress
            } else {
                &mut w.ingress
            };
            for t in targets(other, egress, kind) {
                side.entry(t).or_default().insert(port);
            }
        }
    }
    let mut out = String::new();
    if workloads.is_empty() {
        out.push_str(&format!(
            "# ciliate policy recommend: no forwarded connection of namespace {ns} was observed \
             ({dropped} dropped); nothing to recommend.\n"
        ));
        return out;
    }
    let mut names = BTreeSet::new();
    for (labels, w) in &mut workloads {
        let dns = w.egress.entry(kube_dns()).or_default();
        dns.insert((PROTO_UDP, 53));
        dns.insert((PROTO_TCP, 53));
        let name = unique_name(labels, &mut names);
        out.push_str(&format!(
            "# Recommended by `ciliate policy recommend` for namespace {ns}: allows exactly the \
             connections observed, review before applying.\n\
             # Based on {used} forwarded connection(s) of the namespace, observed {} to {} \
             ({dropped} dropped, left out).\n\
             # Workload {} (e.g. {}): ingress from {} peer(s), egress to {} (DNS to kube-dns \
             kept).\n",
            super::rfc3339(first),
            super::rfc3339(last),
            shown(labels),
            w.example,
            w.ingress.len(),
            w.egress.len(),
        ));
        let doc = match kind {
            Kind::CiliumNetworkPolicy => cnp(ns, &name, labels, w),
            Kind::NetworkPolicy => knp(ns, &name, labels, w, &mut out),
        };
        out.push_str(&serde_yaml::to_string(&doc).unwrap_or_default());
        out.push_str("---\n");
    }
    out.truncate(out.len() - "---\n".len());
    out
}

fn shown(labels: &Selector) -> String {
    match labels.is_empty() {
        true => "(every pod of the namespace: no workload labels)".into(),
        false => labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(","),
    }
}

/// `allow-observed-<app>`: the workload's name label, DNS-1123, unique in the output.
fn unique_name(labels: &Selector, taken: &mut BTreeSet<String>) -> String {
    let base = [
        "app.kubernetes.io/name",
        "app",
        "k8s-app",
        "name",
        "component",
    ]
    .iter()
    .find_map(|k| labels.get(*k).cloned())
    .or_else(|| labels.iter().next().map(|(k, v)| format!("{k}-{v}")))
    .unwrap_or_else(|| "all-pods".into());
    let mut s: String = base
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    s = s.trim_matches('-').to_string();
    s.truncate(40);
    let base = format!("allow-observed-{s}");
    let mut name = base.clone();
    let mut n = 2;
    while !taken.insert(name.clone()) {
        name = format!("{base}-{n}");
        n += 1;
    }
    name
}

fn map<const N: usize>(pairs: [(&str, Value); N]) -> Value {
    let mut m = Mapping::new();
    for (k, v) in pairs {
        m.insert(Value::from(k), v);
    }
    Value::Mapping(m)
}

fn labels_value(labels: &Selector) -> Value {
    Value::Mapping(
        labels
            .iter()
            .map(|(k, v)| (Value::from(k.as_str()), Value::from(v.as_str())))
            .collect(),
    )
}

fn metadata(ns: &str, name: &str) -> Value {
    map([("name", Value::from(name)), ("namespace", Value::from(ns))])
}

fn is_icmp(proto: u8) -> bool {
    proto == PROTO_ICMP || proto == PROTO_ICMPV6
}

fn cnp_peer(t: &Target, ns: &str, egress: bool) -> (&'static str, Value) {
    let (ep, ent, cidr) = match egress {
        true => ("toEndpoints", "toEntities", "toCIDR"),
        false => ("fromEndpoints", "fromEntities", "fromCIDR"),
    };
    match t {
        Target::Pod { namespace, labels } => {
            let mut l = labels.clone();
            if namespace != ns {
                l.insert("k8s:io.kubernetes.pod.namespace".into(), namespace.clone());
            }
            (ep, vec![map([("matchLabels", labels_value(&l))])].into())
        }
        Target::Entity(e) => (ent, vec![Value::from(*e)].into()),
        Target::Fqdn(n) => (
            "toFQDNs",
            vec![map([("matchName", Value::from(n.as_str()))])].into(),
        ),
        Target::Cidr(c) => (cidr, vec![Value::from(c.as_str())].into()),
    }
}

fn cnp_rules(ns: &str, peers: &BTreeMap<Target, BTreeSet<Port>>, egress: bool) -> Value {
    let mut rules = Vec::new();
    for (t, ports) in peers {
        let (field, peer) = cnp_peer(t, ns, egress);
        let l4: Vec<Value> = ports
            .iter()
            .filter(|(p, _)| !is_icmp(*p))
            .map(|(p, n)| {
                map([
                    ("port", Value::from(n.to_string())),
                    ("protocol", Value::from(protocol_name(*p))),
                ])
            })
            .collect();
        if !l4.is_empty() {
            let mut to_ports = map([("ports", l4.into())]);
            if egress && *t == kube_dns() {
                let dns = vec![map([("matchPattern", Value::from("*"))])];
                if let Value::Mapping(m) = &mut to_ports {
                    m.insert("rules".into(), map([("dns", dns.into())]));
                }
            }
            rules.push(map([
                (field, peer.clone()),
                ("toPorts", vec![to_ports].into()),
            ]));
        }
        let icmp: Vec<Value> = ports
            .iter()
            .filter(|(p, _)| is_icmp(*p))
            .map(|(p, n)| {
                let family = if *p == PROTO_ICMP { "IPv4" } else { "IPv6" };
                map([("family", Value::from(family)), ("type", Value::from(*n))])
            })
            .collect();
        if !icmp.is_empty() {
            rules.push(map([
                (field, peer),
                ("icmps", vec![map([("fields", icmp.into())])].into()),
            ]));
        }
    }
    if rules.is_empty() {
        // An empty rule: isolated, nothing allowed (Cilium's default deny).
        rules.push(Value::Mapping(Mapping::new()));
    }
    rules.into()
}

fn cnp(ns: &str, name: &str, labels: &Selector, w: &Workload) -> Value {
    map([
        ("apiVersion", Value::from("cilium.io/v2")),
        ("kind", Value::from("CiliumNetworkPolicy")),
        ("metadata", metadata(ns, name)),
        (
            "spec",
            map([
                (
                    "endpointSelector",
                    map([("matchLabels", labels_value(labels))]),
                ),
                ("ingress", cnp_rules(ns, &w.ingress, false)),
                ("egress", cnp_rules(ns, &w.egress, true)),
            ]),
        ),
    ])
}

fn knp_rules(
    ns: &str,
    peers: &BTreeMap<Target, BTreeSet<Port>>,
    egress: bool,
    notes: &mut String,
) -> Value {
    let mut rules = Vec::new();
    for (t, ports) in peers {
        let peer = match t {
            Target::Pod { namespace, labels } => {
                let pod = map([("matchLabels", labels_value(labels))]);
                match namespace == ns {
                    true => map([("podSelector", pod)]),
                    false => {
                        let n: Selector =
                            [("kubernetes.io/metadata.name".into(), namespace.clone())].into();
                        map([
                            (
                                "namespaceSelector",
                                map([("matchLabels", labels_value(&n))]),
                            ),
                            ("podSelector", pod),
                        ])
                    }
                }
            }
            Target::Cidr(c) => map([("ipBlock", map([("cidr", Value::from(c.as_str()))]))]),
            Target::Entity(_) | Target::Fqdn(_) => {
                notes.push_str(&format!(
                    "# Not expressible in a NetworkPolicy, left out: {} {}.\n",
                    if egress { "egress to" } else { "ingress from" },
                    match t {
                        Target::Entity(e) => format!("the entity {e}"),
                        Target::Fqdn(n) => format!("the name {n}"),
                        _ => String::new(),
                    }
                ));
                continue;
            }
        };
        let mut l4 = Vec::new();
        for (p, n) in ports {
            if is_icmp(*p) {
                notes.push_str(&format!(
                    "# Not expressible in a NetworkPolicy, left out: {} type {n}.\n",
                    protocol_name(*p)
                ));
                continue;
            }
            l4.push(map([
                ("port", Value::from(*n)),
                ("protocol", Value::from(protocol_name(*p))),
            ]));
        }
        if l4.is_empty() {
            continue;
        }
        let field = if egress { "to" } else { "from" };
        rules.push(map([(field, vec![peer].into()), ("ports", l4.into())]));
    }
    rules.into()
}

fn knp(ns: &str, name: &str, labels: &Selector, w: &Workload, out: &mut String) -> Value {
    let mut notes = String::new();
    let ingress = knp_rules(ns, &w.ingress, false, &mut notes);
    let egress = knp_rules(ns, &w.egress, true, &mut notes);
    out.push_str(&notes);
    map([
        ("apiVersion", Value::from("networking.k8s.io/v1")),
        ("kind", Value::from("NetworkPolicy")),
        ("metadata", metadata(ns, name)),
        (
            "spec",
            map([
                ("podSelector", map([("matchLabels", labels_value(labels))])),
                (
                    "policyTypes",
                    vec![Value::from("Ingress"), Value::from("Egress")].into(),
                ),
                ("ingress", ingress),
                ("egress", egress),
            ]),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::translate::parse_policy;
    use crate::traffic::history::Observation;
    use crate::traffic::replay::Replay;
    use serde::Deserialize;

    fn pod(ns: &str, labels: &[(&str, &str)], name: &str) -> Peer {
        let mut l: Vec<String> = labels.iter().map(|(k, v)| format!("k8s:{k}={v}")).collect();
        l.push(format!("k8s:io.kubernetes.pod.namespace={ns}"));
        Peer {
            pod: Some(format!("{ns}/{name}")),
            ..Peer::new(l, None, vec![])
        }
    }

    fn history() -> FlowHistory {
        let mut h = FlowHistory::new(86_400, 1000);
        let a = h.peer(pod(
            "x",
            &[("app", "a"), ("pod-template-hash", "5d9f")],
            "a-5d9f-1",
        ));
        let b = h.peer(pod("x", &[("app", "b")], "b-1"));
        let c = h.peer(pod("y", &[("app", "c")], "c-1"));
        let w = h.peer(Peer::new(
            vec!["reserved:world".into()],
            Some("203.0.113.9".parse().unwrap()),
            vec!["api.example".into()],
        ));
        let o = |src, dst, proto, port, dropped| Observation {
            src,
            dst,
            proto,
            port,
            egress: true,
            dropped,
            policies: &[],
            now: 1_795_939_200,
        };
        h.record(o(a, b, PROTO_TCP, 8080, false));
        h.record(o(c, a, PROTO_TCP, 80, false));
        h.record(o(a, w, PROTO_TCP, 443, false));
        h.record(o(b, a, PROTO_ICMP, 8, false));
        h.record(o(c, b, PROTO_TCP, 22, true));
        h
    }

    #[test]
    fn recommends_exactly_what_was_seen_by_workload_labels() {
        let h = history();
        let yaml = recommend(&h, 0, "x", Kind::CiliumNetworkPolicy);
        assert_eq!(
            yaml,
            recommend(&h, 0, "x", Kind::CiliumNetworkPolicy),
            "stable"
        );
        assert!(!yaml.contains("pod-template-hash"), "{yaml}");
        assert!(yaml.contains("matchName: api.example"), "{yaml}");
        assert!(yaml.contains("matchPattern: '*'"), "{yaml}");
        assert!(yaml.contains("1 dropped, left out"), "{yaml}");
        // Round trip: the recommendation allows every forwarded connection seen, and
        // nothing else: not another port, not another peer, not what was dropped.
        let policies: Vec<_> = serde_yaml::Deserializer::from_str(&yaml)
            .map(|d| {
                let v = serde_yaml::Value::deserialize(d).unwrap();
                parse_policy(&v, "x", "recommended").unwrap()
            })
            .collect();
        assert_eq!(policies.len(), 2, "{yaml}");
        let mut r = Replay::new(h.peers(), policies);
        for v in h.iter_since(0) {
            let dropped = r.judge(v.src, v.dst, v.proto, v.port).dropped();
            assert_eq!(dropped, v.dropped, "{}:{}\n{yaml}", v.proto, v.port);
        }
        let (a, b, c) = (0, 1, 2);
        assert!(r.judge(a, b, PROTO_TCP, 8081).dropped(), "another port");
        assert!(r.judge(c, b, PROTO_TCP, 8080).dropped(), "another peer");
        assert!(
            r.judge(b, a, PROTO_TCP, 8080).dropped(),
            "the other way round"
        );
    }

    #[test]
    fn network_policy_form_says_what_it_cannot_express() {
        let h = history();
        let yaml = recommend(&h, 0, "x", Kind::NetworkPolicy);
        assert!(yaml.contains("kind: NetworkPolicy"), "{yaml}");
        assert!(yaml.contains("cidr: 203.0.113.9/32"), "{yaml}");
        assert!(yaml.contains("kubernetes.io/metadata.name: y"), "{yaml}");
        assert!(yaml.contains("left out: ICMP type 8"), "{yaml}");
        let none = recommend(&h, 0, "z", Kind::NetworkPolicy);
        assert!(none.contains("nothing to recommend"), "{none}");
    }
}
