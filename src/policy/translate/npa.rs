//! The network-policy-api's cluster tiers -> rules: AdminNetworkPolicy and
//! BaselineAdminNetworkPolicy (`v1alpha1`), ClusterNetworkPolicy (`v1alpha2`), with the CRDs'
//! validation (the API server's, for objects that never met one: the manifest directory).
//!
//! Each policy becomes one `Rule` with its `TierPlace` and one peer rule per rule of
//! `ingress`/`egress`, in order, each with its action (`policy::tiers` evaluates them in order).
//! Subjects and pod peers are pods (label selectors over the pod's and its namespace's labels,
//! as NetworkPolicy's); `networks` are CIDR selectors (covering the cluster's own addresses too:
//! `policy::tier_networks`); `domainNames` (Allow/Accept only) are DNS-name selectors with the
//! API's wildcard (`fqdn::FqdnPattern::domain_name`): the addresses the subject's answers
//! resolve, learned through the DNS proxy, which every subject's DNS then goes through
//! (`EndpointPolicy::dns_observed`); `nodes` are node label selectors, resolved by the engine
//! into the node identities they cover (`PolicyEngine::nodes_inside`).

use super::common::{
    cidr_selector, is_kubernetes_port_name, knp_protocol, label_selector, pods_in_namespaces,
};
use super::{Ctx, PolicyError};
use crate::policy::api;
use crate::policy::fqdn::FqdnPattern;
use crate::policy::rule::{
    Action, PeerRule, Peers, PolicyKind, PortMatch, PortSpec, Ports, Protocol, Rule, Section,
    Subject, Tier, TierPlace,
};
use crate::policy::selector::{LabelSelector, Selector, SelectorRef};

/// The highest priority the API allows.
const MAX_PRIORITY: i64 = 1000;

/// An AdminNetworkPolicy or BaselineAdminNetworkPolicy.
pub fn translate_v1alpha1(
    ctx: &mut Ctx,
    p: &api::AdminNetworkPolicy,
) -> Result<Vec<Rule>, PolicyError> {
    let Some(spec) = &p.spec else {
        return Err(ctx.err("spec", "missing spec"));
    };
    let baseline = ctx.key.kind == PolicyKind::BaselineAdminNetworkPolicy;
    let place = if baseline {
        if ctx.key.name != "default" {
            return Err(ctx.err(
                "metadata.name",
                "a BaselineAdminNetworkPolicy must be named \"default\" (there is one per cluster)",
            ));
        }
        if spec.priority.is_some() {
            return Err(ctx.err(
                "spec.priority",
                "a BaselineAdminNetworkPolicy has no priority",
            ));
        }
        TierPlace {
            tier: Tier::Baseline,
            priority: 0,
        }
    } else {
        TierPlace {
            tier: Tier::Admin,
            priority: priority(ctx, spec.priority)?,
        }
    };
    let actions: &[(&str, Action)] = if baseline {
        &[("Allow", Action::Allow), ("Deny", Action::Deny)]
    } else {
        &[
            ("Allow", Action::Allow),
            ("Deny", Action::Deny),
            ("Pass", Action::Pass),
        ]
    };
    translate(ctx, spec, place, actions, &|ctx, ports, _, path| {
        anp_ports(ctx, ports, path)
    })
}

/// A ClusterNetworkPolicy.
pub fn translate_v1alpha2(
    ctx: &mut Ctx,
    p: &api::ClusterNetworkPolicy,
) -> Result<Vec<Rule>, PolicyError> {
    let Some(spec) = &p.spec else {
        return Err(ctx.err("spec", "missing spec"));
    };
    let tier = match spec.tier.as_deref() {
        Some("Admin") => Tier::Admin,
        Some("Baseline") => Tier::Baseline,
        Some(t) => {
            return Err(ctx.err(
                "spec.tier",
                format!("unknown tier {t:?} (Admin or Baseline)"),
            ))
        }
        None => return Err(ctx.err("spec.tier", "missing tier (Admin or Baseline)")),
    };
    let place = TierPlace {
        tier,
        priority: priority(ctx, spec.priority)?,
    };
    let actions: &[(&str, Action)] = &[
        ("Accept", Action::Allow),
        ("Deny", Action::Deny),
        ("Pass", Action::Pass),
    ];
    translate(ctx, spec, place, actions, &|ctx, _, protocols, path| {
        cnp_protocols(ctx, protocols, path)
    })
}

fn priority(ctx: &Ctx, p: Option<i64>) -> Result<u32, PolicyError> {
    match p {
        Some(p) if (0..=MAX_PRIORITY).contains(&p) => Ok(p as u32),
        Some(p) => Err(ctx.err(
            "spec.priority",
            format!("priority {p} is out of range (0 to {MAX_PRIORITY})"),
        )),
        None => Err(ctx.err("spec.priority", "missing priority")),
    }
}

/// One rule of `ingress` or `egress`, its ports already read (the versions name them apart).
struct PeerRuleIn<'a> {
    action: Option<&'a str>,
    peers: Option<&'a Vec<api::TierPeer>>,
    ports: Ports,
    ingress: bool,
    path: String,
    tier: Tier,
}

/// Reads a rule's ports, whichever field its version has them in (`ports`, `protocols`).
type PortsOf<'a, V> = dyn Fn(
        &Ctx,
        Option<&<V as api::Version>::Ports>,
        Option<&<V as api::Version>::Protocols>,
        &str,
    ) -> Result<Ports, PolicyError>
    + 'a;

fn translate<V: api::Version>(
    ctx: &mut Ctx,
    spec: &api::TierPolicySpec<V>,
    place: TierPlace,
    actions: &[(&str, Action)],
    ports_of: &PortsOf<'_, V>,
) -> Result<Vec<Rule>, PolicyError> {
    let subject = subject(ctx, spec.subject.as_ref())?;
    for (field, n) in [
        ("spec.ingress", spec.ingress.as_ref().map_or(0, Vec::len)),
        ("spec.egress", spec.egress.as_ref().map_or(0, Vec::len)),
    ] {
        at_most::<V>(ctx, field, n, "rules")?;
    }
    let mut rules = Vec::new();
    for (i, r) in spec.ingress.iter().flatten().enumerate() {
        let path = format!("spec.ingress[{i}]");
        rule_shape::<V>(ctx, &path, r.name.as_deref(), r.from.as_ref(), "from")?;
        rules.push(PeerRuleIn {
            action: r.action.as_deref(),
            peers: r.from.as_ref(),
            ports: port_count::<V>(
                ctx,
                ports_of(ctx, r.ports.as_ref(), r.protocols.as_ref(), &path)?,
                &path,
            )?,
            ingress: true,
            path,
            tier: place.tier,
        });
    }
    for (i, r) in spec.egress.iter().flatten().enumerate() {
        let path = format!("spec.egress[{i}]");
        rule_shape::<V>(ctx, &path, r.name.as_deref(), r.to.as_ref(), "to")?;
        rules.push(PeerRuleIn {
            action: r.action.as_deref(),
            peers: r.to.as_ref(),
            ports: port_count::<V>(
                ctx,
                ports_of(ctx, r.ports.as_ref(), r.protocols.as_ref(), &path)?,
                &path,
            )?,
            ingress: false,
            path,
            tier: place.tier,
        });
    }
    let peer_rules = rules
        .into_iter()
        .map(|r| peer_rule(ctx, r, actions))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(vec![Rule {
        policy: ctx.key.clone(),
        path: "spec".into(),
        subject: Subject::Endpoints(Selector::labels(subject)),
        isolates_ingress: false,
        isolates_egress: false,
        peer_rules,
        requires: vec![],
        tier: Some(place),
        staged: false,
    }])
}

/// The CRD's limit on a list's length (`V::MAX_ITEMS`).
fn at_most<V: api::Version>(
    ctx: &Ctx,
    field: &str,
    n: usize,
    what: &str,
) -> Result<(), PolicyError> {
    if n > V::MAX_ITEMS {
        return Err(ctx.err(
            field,
            format!("{n} {what}: at most {} are allowed", V::MAX_ITEMS),
        ));
    }
    Ok(())
}

/// The most characters a rule's `name` may have, as the CRD says.
const MAX_RULE_NAME: usize = 100;

/// A rule's name and number of peers as the CRD bounds them (an empty peer list is refused
/// with the rule's action, `peer_rule`).
fn rule_shape<V: api::Version>(
    ctx: &Ctx,
    path: &str,
    name: Option<&str>,
    peers: Option<&Vec<api::TierPeer>>,
    peers_field: &str,
) -> Result<(), PolicyError> {
    if let Some(n) = name.filter(|n| n.chars().count() > MAX_RULE_NAME) {
        return Err(ctx.err(
            format!("{path}.name"),
            format!(
                "{} characters: at most {MAX_RULE_NAME} are allowed",
                n.chars().count()
            ),
        ));
    }
    let n = peers.map_or(0, Vec::len);
    at_most::<V>(ctx, &format!("{path}.{peers_field}"), n, "peers")
}

/// A rule's ports as the CRD bounds them: absent (every port), or 1 to `V::MAX_ITEMS` entries.
fn port_count<V: api::Version>(ctx: &Ctx, ports: Ports, path: &str) -> Result<Ports, PolicyError> {
    if let Ports::List(list) = &ports {
        let field = format!("{path}.{}", V::PORTS_FIELD);
        if list.is_empty() {
            return Err(ctx.err(
                field,
                "an empty list: leave the field out for every port, or name one at least",
            ));
        }
        at_most::<V>(ctx, &field, list.len(), "entries")?;
    }
    Ok(ports)
}

fn peer_rule(
    ctx: &mut Ctx,
    r: PeerRuleIn<'_>,
    actions: &[(&str, Action)],
) -> Result<PeerRule, PolicyError> {
    let path = r.path.as_str();
    let peers_field = if r.ingress { "from" } else { "to" };
    let names = || {
        actions
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let action = match r.action {
        Some(a) => actions
            .iter()
            .find(|(n, _)| *n == a)
            .map(|(_, a)| *a)
            .ok_or_else(|| {
                ctx.err(
                    format!("{path}.action"),
                    format!("unknown action {a:?} ({})", names()),
                )
            })?,
        None => {
            return Err(ctx.err(
                format!("{path}.action"),
                format!("missing action ({})", names()),
            ))
        }
    };
    let list = r.peers.filter(|l| !l.is_empty()).ok_or_else(|| {
        ctx.err(
            format!("{path}.{peers_field}"),
            "at least one peer is required",
        )
    })?;
    let mut sels: Vec<SelectorRef> = Vec::new();
    let mut deny_all = false;
    for (j, p) in list.iter().enumerate() {
        let pp = format!("{path}.{peers_field}[{j}]");
        match peer(ctx, p, &pp, r.ingress, action)? {
            Some(mut s) => sels.append(&mut s),
            // A peer with no field this version knows (a newer CRD's): fail closed, as the
            // API prescribes: an Allow matches nothing of it, a Deny or Pass denies all.
            None => {
                let what = if action == Action::Allow {
                    "it matches nothing (fail closed)"
                } else {
                    "the rule denies all traffic (fail closed)"
                };
                let w = format!("{}: {pp} has no peer field ciliate knows: {what}", ctx.key);
                ctx.warnings.push(w);
                deny_all |= action != Action::Allow;
            }
        }
    }
    named_ports_need_pods(ctx, &r, list)?;
    let endpoint_selectors = sels
        .iter()
        .filter(|s| matches!(s.kind(), crate::policy::selector::SelectorKind::Labels(_)))
        .count();
    let (peers, ports, action) = if deny_all {
        (Peers::Any, Ports::Any, Action::Deny)
    } else {
        (Peers::Selectors(sels), r.ports, action)
    };
    let section = match (r.ingress, action) {
        (true, Action::Deny) => Section::IngressDeny,
        (true, _) => Section::Ingress,
        (false, Action::Deny) => Section::EgressDeny,
        (false, _) => Section::Egress,
    };
    Ok(PeerRule {
        origin: ctx.origin(section, path, false, Some(r.tier)),
        peers,
        ports,
        endpoint_selectors,
        dns: Vec::new(),
        l7: Vec::new(),
        action: Some(action),
    })
}

/// `subject`: exactly one of `namespaces` and `pods`.
fn subject(ctx: &Ctx, s: Option<&api::TierSubject>) -> Result<LabelSelector, PolicyError> {
    let Some(s) = s else {
        return Err(ctx.err("spec.subject", "missing subject"));
    };
    match (&s.namespaces, &s.pods) {
        (Some(ns), None) => pods_in_namespaces(ctx, Some(ns), None, "spec.subject.namespaces", ""),
        (None, Some(p)) => namespaced_pod(ctx, p, "spec.subject.pods"),
        _ => Err(ctx.err(
            "spec.subject",
            "exactly one of namespaces and pods must be set",
        )),
    }
}

/// The most CIDRs one `networks` peer may list, as the CRD says.
const MAX_NETWORKS: usize = 25;

/// A `pods` subject or peer: both selectors are required by the CRD (`{}` selects all).
fn namespaced_pod(
    ctx: &Ctx,
    p: &api::NamespacedPod,
    path: &str,
) -> Result<LabelSelector, PolicyError> {
    for (field, set) in [
        ("namespaceSelector", p.namespace_selector.is_some()),
        ("podSelector", p.pod_selector.is_some()),
    ] {
        if !set {
            return Err(ctx.err(
                format!("{path}.{field}"),
                format!("missing {field} (required; {{}} selects all)"),
            ));
        }
    }
    pods_in_namespaces(
        ctx,
        p.namespace_selector.as_ref(),
        p.pod_selector.as_ref(),
        &format!("{path}.namespaceSelector"),
        &format!("{path}.podSelector"),
    )
}

/// One peer's selectors; `None` when it has no field this version knows.
fn peer(
    ctx: &mut Ctx,
    p: &api::TierPeer,
    path: &str,
    ingress: bool,
    action: Action,
) -> Result<Option<Vec<SelectorRef>>, PolicyError> {
    let set = [
        ("namespaces", p.namespaces.is_some()),
        ("pods", p.pods.is_some()),
        ("nodes", p.nodes.is_some()),
        ("networks", p.networks.is_some()),
        ("domainNames", p.domain_names.is_some()),
    ];
    let present: Vec<&str> = set.iter().filter(|(_, s)| *s).map(|(n, _)| *n).collect();
    match present.as_slice() {
        [] => return Ok(None),
        [_] => {}
        many => {
            return Err(ctx.err(
                path,
                format!(
                    "exactly one peer field may be set, not {}",
                    many.join(" and ")
                ),
            ))
        }
    }
    if ingress && !matches!(present[0], "namespaces" | "pods") {
        return Err(ctx.err(
            format!("{path}.{}", present[0]),
            "an ingress peer is namespaces or pods",
        ));
    }
    if let Some(ns) = &p.namespaces {
        return Ok(Some(vec![Selector::labels(pods_in_namespaces(
            ctx,
            Some(ns),
            None,
            &format!("{path}.namespaces"),
            "",
        )?)]));
    }
    if let Some(pp) = &p.pods {
        return Ok(Some(vec![Selector::labels(namespaced_pod(
            ctx,
            pp,
            &format!("{path}.pods"),
        )?)]));
    }
    if let Some(nets) = &p.networks {
        if nets.is_empty() || nets.len() > MAX_NETWORKS {
            return Err(ctx.err(
                format!("{path}.networks"),
                format!(
                    "{} CIDRs: between 1 and {MAX_NETWORKS} are allowed",
                    nets.len()
                ),
            ));
        }
        let mut out = Vec::new();
        for (k, n) in nets.iter().enumerate() {
            let np = format!("{path}.networks[{k}]");
            // The CRD's `isCIDR`: an address alone is not one.
            if !n.contains('/') {
                return Err(ctx.err(
                    np,
                    format!(
                        "{n:?} is not a CIDR: give the prefix length (e.g. {n}/{})",
                        if n.contains(':') { 128 } else { 32 }
                    ),
                ));
            }
            let sel = cidr_selector(ctx, Some(n), None, &np, true)
                .map_err(|e| PolicyError { field: np, ..e })?;
            out.push(Selector::cidr(sel));
        }
        return Ok(Some(out));
    }
    if let Some(sel) = &p.nodes {
        let sel = label_selector(ctx, sel, &format!("{path}.nodes"))?;
        return Ok(Some(vec![Selector::nodes(sel)]));
    }
    if let Some(names) = &p.domain_names {
        return domain_names(ctx, names, &format!("{path}.domainNames"), action).map(Some);
    }
    // Every field of `set` is handled above; a new one must be too (rejected until it is).
    Err(ctx.err(
        format!("{path}.{}", present[0]),
        "this peer field is not enforced; the policy is rejected rather than enforced in part",
    ))
}

/// The most names one `domainNames` peer may list, as the CRD says.
const MAX_DOMAIN_NAMES: usize = 25;

/// `domainNames`: only in an Allow (Accept) rule, 1 to 25 names, each a DNS name of two labels
/// or more, optionally after `*.`.
fn domain_names(
    ctx: &Ctx,
    names: &[String],
    path: &str,
    action: Action,
) -> Result<Vec<SelectorRef>, PolicyError> {
    if ctx.key.kind == PolicyKind::BaselineAdminNetworkPolicy {
        return Err(ctx.err(
            path,
            "a BaselineAdminNetworkPolicy (v1alpha1) has no domainNames peers; a ClusterNetworkPolicy of the Baseline tier has",
        ));
    }
    if action != Action::Allow {
        return Err(ctx.err(
            path,
            "domainNames peers are only supported in an Accept (v1alpha2) or Allow (v1alpha1) rule",
        ));
    }
    if names.is_empty() || names.len() > MAX_DOMAIN_NAMES {
        return Err(ctx.err(
            path,
            format!(
                "{} names: between 1 and {MAX_DOMAIN_NAMES} are allowed",
                names.len()
            ),
        ));
    }
    names
        .iter()
        .enumerate()
        .map(|(k, n)| {
            if is_domain_name(n) {
                Ok(Selector::fqdn(FqdnPattern::domain_name(n)))
            } else {
                Err(ctx.err(
                    format!("{path}[{k}]"),
                    format!("{n:?} is not a domain name (labels of letters, digits, '-' and '_', two at least, optionally after \"*.\"; '*' only as that prefix)"),
                ))
            }
        })
        .collect()
}

/// The CRD's `DomainName` pattern: an optional `*.`, two labels or more (each starting and
/// ending with a letter or digit, `-` and `_` inside), an optional trailing dot.
fn is_domain_name(n: &str) -> bool {
    let rest = n.strip_prefix("*.").unwrap_or(n);
    let rest = rest.strip_suffix('.').unwrap_or(rest);
    let label = |l: &str| {
        let b = l.as_bytes();
        !b.is_empty()
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || *c == b'-' || *c == b'_')
    };
    rest.split('.').count() >= 2 && rest.split('.').all(label)
}

/// The CRD's rule: a named port is the destination pod's, so a rule whose peers include
/// `networks`, `nodes` or `domainNames` names none.
fn named_ports_need_pods(
    ctx: &Ctx,
    r: &PeerRuleIn<'_>,
    peers: &[api::TierPeer],
) -> Result<(), PolicyError> {
    let Ports::List(list) = &r.ports else {
        return Ok(());
    };
    if !list.iter().any(|p| matches!(p.port, PortSpec::Named(_))) {
        return Ok(());
    }
    let kinds = [
        ("networks", peers.iter().any(|p| p.networks.is_some())),
        ("nodes", peers.iter().any(|p| p.nodes.is_some())),
        (
            "domainNames",
            peers.iter().any(|p| p.domain_names.is_some()),
        ),
    ];
    match kinds.iter().find(|(_, set)| *set) {
        Some((kind, _)) => Err(ctx.err(
            r.path.as_str(),
            format!("a {kind} peer cannot be set with named ports: only pods have named ports"),
        )),
        None => Ok(()),
    }
}

/// `v1alpha1` `ports`: `portNumber`, `portRange` or `namedPort`, each exactly one.
fn anp_ports(
    ctx: &Ctx,
    ports: Option<&Vec<api::AnpPort>>,
    path: &str,
) -> Result<Ports, PolicyError> {
    let Some(list) = ports else {
        return Ok(Ports::Any);
    };
    let mut out = Vec::new();
    for (j, p) in list.iter().enumerate() {
        let pp = format!("{path}.ports[{j}]");
        match (&p.port_number, &p.port_range, &p.named_port) {
            (Some(n), None, None) => {
                let protocol = knp_protocol(
                    ctx,
                    n.protocol.as_deref(),
                    &format!("{pp}.portNumber.protocol"),
                )?;
                let port = port_number(ctx, n.port, &format!("{pp}.portNumber.port"))?;
                out.push(PortMatch {
                    protocol,
                    port: PortSpec::Range(port, port),
                });
            }
            (None, Some(r), None) => {
                let protocol = knp_protocol(
                    ctx,
                    r.protocol.as_deref(),
                    &format!("{pp}.portRange.protocol"),
                )?;
                let (lo, hi) = range(ctx, r.start, r.end, &format!("{pp}.portRange"))?;
                out.push(PortMatch {
                    protocol,
                    port: PortSpec::Range(lo, hi),
                });
            }
            (None, None, Some(name)) => out.push(named(ctx, name, &format!("{pp}.namedPort"))?),
            _ => {
                return Err(ctx.err(
                    pp,
                    "exactly one of portNumber, portRange and namedPort must be set",
                ))
            }
        }
    }
    Ok(Ports::List(out))
}

/// `v1alpha2` `protocols`: `tcp`, `udp`, `sctp` (each with an optional `destinationPort`) or
/// `destinationNamedPort`, each exactly one.
fn cnp_protocols(
    ctx: &Ctx,
    protocols: Option<&Vec<api::CnpProtocol>>,
    path: &str,
) -> Result<Ports, PolicyError> {
    let Some(list) = protocols else {
        return Ok(Ports::Any);
    };
    let mut out = Vec::new();
    for (j, p) in list.iter().enumerate() {
        let pp = format!("{path}.protocols[{j}]");
        let set = [
            ("tcp", Protocol::Tcp, &p.tcp),
            ("udp", Protocol::Udp, &p.udp),
            ("sctp", Protocol::Sctp, &p.sctp),
        ];
        let transports: Vec<_> = set.iter().filter(|(_, _, t)| t.is_some()).collect();
        match (transports.as_slice(), &p.destination_named_port) {
            ([(name, protocol, Some(t))], None) => {
                let tp = format!("{pp}.{name}.destinationPort");
                let port = match &t.destination_port {
                    None => PortSpec::Range(0, 65535),
                    Some(d) => match (d.number, &d.range) {
                        (Some(n), None) => {
                            let n = port_number(ctx, Some(n), &format!("{tp}.number"))?;
                            PortSpec::Range(n, n)
                        }
                        (None, Some(r)) => {
                            let (lo, hi) = range(ctx, r.start, r.end, &format!("{tp}.range"))?;
                            PortSpec::Range(lo, hi)
                        }
                        _ => return Err(ctx.err(tp, "exactly one of number and range must be set")),
                    },
                };
                out.push(PortMatch {
                    protocol: *protocol,
                    port,
                });
            }
            ([], Some(name)) => out.push(named(ctx, name, &format!("{pp}.destinationNamedPort"))?),
            _ => {
                return Err(ctx.err(
                    pp,
                    "exactly one of tcp, udp, sctp and destinationNamedPort must be set",
                ))
            }
        }
    }
    Ok(Ports::List(out))
}

fn port_number(ctx: &Ctx, n: Option<i64>, path: &str) -> Result<u16, PolicyError> {
    match n {
        Some(n) if (1..=65535).contains(&n) => Ok(n as u16),
        Some(n) => Err(ctx.err(path, format!("port {n} is out of range (1 to 65535)"))),
        None => Err(ctx.err(path, "missing port")),
    }
}

fn range(
    ctx: &Ctx,
    start: Option<i64>,
    end: Option<i64>,
    path: &str,
) -> Result<(u16, u16), PolicyError> {
    let lo = port_number(ctx, start, &format!("{path}.start"))?;
    let hi = port_number(ctx, end, &format!("{path}.end"))?;
    if lo >= hi {
        return Err(ctx.err(
            format!("{path}.end"),
            format!("the end ({hi}) must be greater than the start ({lo})"),
        ));
    }
    Ok((lo, hi))
}

/// A named port: the destination pod's container port of that name (any of its protocols).
fn named(ctx: &Ctx, name: &str, path: &str) -> Result<PortMatch, PolicyError> {
    if !is_kubernetes_port_name(name) {
        return Err(ctx.err(
            path,
            format!("{name:?} is not a valid port name (lower case, 1-15 characters of a-z, 0-9 and '-')"),
        ));
    }
    Ok(PortMatch {
        protocol: Protocol::Any,
        port: PortSpec::Named(name.to_string()),
    })
}
