//! CiliumNetworkPolicy and CiliumClusterwideNetworkPolicy -> rules, with Cilium 1.16's
//! validation (`pkg/policy/api/rule_validation.go`) and translation (`pkg/k8s/apis/cilium.io/utils`).

use std::sync::Arc;

use ipnet::IpNet;
use serde_yaml::Value;

use super::common::{
    cidr_selector, cilium_protocol, entity, icmp_type_from_name, label_selector, parse_cidr,
    port_spec, scope_peer_selector, scope_subject_selector, selects_init, EntitySelection,
};
use super::{Ctx, PolicyError};
use crate::policy::api;
use crate::policy::fqdn::FqdnPattern;
use crate::policy::l7::http::{HeaderMatch, HeaderRequirement, HttpRule, L7PortRules, Mismatch};
use crate::policy::rule::{
    DnsRules, L7Ports, PeerRequirement, PeerRule, Peers, PortMatch, PortSpec, Ports, Protocol,
    Rule, Section, Subject,
};
use crate::policy::selector::{CidrSelector, Selector, SelectorRef};
use crate::policy::services::ServiceRef;

/// Cilium refuses more than this many ports in one `toPorts` entry.
const MAX_PORTS: usize = 40;
/// ... and more than this many fields in one `icmps` entry.
const MAX_ICMP_FIELDS: usize = 40;

/// A uniform view of the four peer-rule types (ingress, ingressDeny, egress, egressDeny).
#[derive(Default)]
struct PeerView<'a> {
    endpoints: Option<&'a Vec<api::LabelSelector>>,
    requires: Option<&'a Vec<api::LabelSelector>>,
    cidr: Option<&'a Vec<String>>,
    cidr_set: Option<&'a Vec<api::CidrRule>>,
    entities: Option<&'a Vec<String>>,
    groups: Option<&'a Vec<Value>>,
    nodes: Option<&'a Vec<api::LabelSelector>>,
    services: Option<&'a Vec<Value>>,
    fqdns: Option<&'a Vec<api::FqdnSelector>>,
    /// (ports, the allow rule's L7 part when there is one)
    to_ports: PortsView<'a>,
    icmps: Option<&'a Vec<api::IcmpRule>>,
    auth: Option<&'a api::Authentication>,
}

fn len<T>(v: Option<&Vec<T>>) -> usize {
    v.map_or(0, |v| v.len())
}

/// The peers every rule type has, by field name (`from_*` or `to_*`).
macro_rules! peers {
    ($r:expr, $e:ident, $rq:ident, $c:ident, $cs:ident, $en:ident, $g:ident, $n:ident) => {
        PeerView {
            endpoints: $r.$e.as_ref(),
            requires: $r.$rq.as_ref(),
            cidr: $r.$c.as_ref(),
            cidr_set: $r.$cs.as_ref(),
            entities: $r.$en.as_ref(),
            groups: $r.$g.as_ref(),
            nodes: $r.$n.as_ref(),
            ..Default::default()
        }
    };
}

macro_rules! from_peers {
    ($r:expr) => {
        peers!(
            $r,
            from_endpoints,
            from_requires,
            from_cidr,
            from_cidr_set,
            from_entities,
            from_groups,
            from_nodes
        )
    };
}

macro_rules! to_peers {
    ($r:expr) => {
        peers!(
            $r,
            to_endpoints,
            to_requires,
            to_cidr,
            to_cidr_set,
            to_entities,
            to_groups,
            to_nodes
        )
    };
}

/// A rule's `toPorts`: each entry's ports, and its L7 part (allow rules only).
type PortsView<'a> = Vec<(
    Option<&'a Vec<api::PortProtocol>>,
    Option<&'a api::PortRule>,
)>;

fn ports_of<'a, P>(
    rules: &'a Option<Vec<P>>,
    each: impl Fn(
        &'a P,
    ) -> (
        Option<&'a Vec<api::PortProtocol>>,
        Option<&'a api::PortRule>,
    ),
) -> PortsView<'a> {
    rules.iter().flatten().map(each).collect()
}

impl<'a> PeerView<'a> {
    fn ingress(r: &'a api::IngressRule) -> Self {
        PeerView {
            to_ports: ports_of(&r.to_ports, |p| (p.ports.as_ref(), Some(p))),
            icmps: r.icmps.as_ref(),
            auth: r.authentication.as_ref(),
            ..from_peers!(r)
        }
    }
    fn ingress_deny(r: &'a api::IngressDenyRule) -> Self {
        PeerView {
            to_ports: ports_of(&r.to_ports, |p| (p.ports.as_ref(), None)),
            icmps: r.icmps.as_ref(),
            ..from_peers!(r)
        }
    }
    fn egress(r: &'a api::EgressRule) -> Self {
        PeerView {
            services: r.to_services.as_ref(),
            fqdns: r.to_fqdns.as_ref(),
            to_ports: ports_of(&r.to_ports, |p| (p.ports.as_ref(), Some(p))),
            icmps: r.icmps.as_ref(),
            auth: r.authentication.as_ref(),
            ..to_peers!(r)
        }
    }
    fn egress_deny(r: &'a api::EgressDenyRule) -> Self {
        PeerView {
            services: r.to_services.as_ref(),
            to_ports: ports_of(&r.to_ports, |p| (p.ports.as_ref(), None)),
            icmps: r.icmps.as_ref(),
            ..to_peers!(r)
        }
    }

    /// The L3 peer kinds present, by field name (Cilium forbids combining two in one rule).
    fn l3_kinds(&self, dir: &str) -> Vec<String> {
        let kinds: [(&str, usize); 9] = [
            ("Endpoints", len(self.endpoints)),
            ("CIDR", len(self.cidr)),
            ("CIDRSet", len(self.cidr_set)),
            ("Entities", len(self.entities)),
            ("Nodes", len(self.nodes)),
            ("Groups", len(self.groups)),
            ("Services", len(self.services)),
            ("FQDNs", len(self.fqdns)),
            ("", 0),
        ];
        kinds
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(k, _)| format!("{dir}{k}"))
            .collect()
    }
}

pub fn translate(ctx: &mut Ctx, cp: &api::CiliumPolicy) -> Result<Vec<Rule>, PolicyError> {
    let mut rules = Vec::new();
    if cp.spec.is_none() && cp.specs.as_ref().is_none_or(|s| s.is_empty()) {
        return Err(ctx.err("spec", "the policy has neither spec nor specs"));
    }
    if let Some(spec) = &cp.spec {
        rules.push(translate_rule(ctx, spec, "spec")?);
    }
    for (i, spec) in cp.specs.iter().flatten().enumerate() {
        rules.push(translate_rule(ctx, spec, &format!("specs[{i}]"))?);
    }
    Ok(rules)
}

fn translate_rule(ctx: &mut Ctx, r: &api::Rule, path: &str) -> Result<Rule, PolicyError> {
    let namespace = ctx.namespace().map(str::to_string);
    let (subject, subject_sel) = match (&r.endpoint_selector, &r.node_selector) {
        (Some(_), Some(_)) => {
            return Err(ctx.err(
                path,
                "endpointSelector and nodeSelector are mutually exclusive: set exactly one",
            ))
        }
        (None, None) => {
            return Err(ctx.err(path, "one of endpointSelector or nodeSelector is required"))
        }
        (None, Some(_)) if namespace.is_some() => {
            return Err(ctx.err(
                format!("{path}.nodeSelector"),
                "nodeSelector is only allowed in a CiliumClusterwideNetworkPolicy",
            ))
        }
        (None, Some(ns)) => {
            let sel = label_selector(ctx, ns, &format!("{path}.nodeSelector"))?;
            (Subject::Nodes(Selector::labels(sel.clone())), sel)
        }
        (Some(es), None) => {
            let sel = label_selector(ctx, es, &format!("{path}.endpointSelector"))?;
            let scoped = match &namespace {
                Some(ns) if !selects_init(&sel) => scope_subject_selector(sel.clone(), ns),
                _ => sel.clone(),
            };
            (Subject::Endpoints(Selector::labels(scoped)), sel)
        }
    };
    let init = selects_init(&subject_sel);
    let default_deny = r.enable_default_deny.clone().unwrap_or_default();

    let mut peer_rules = Vec::new();
    let sections: [(Section, Vec<PeerView>); 4] = [
        (
            Section::Ingress,
            r.ingress.iter().flatten().map(PeerView::ingress).collect(),
        ),
        (
            Section::IngressDeny,
            r.ingress_deny
                .iter()
                .flatten()
                .map(PeerView::ingress_deny)
                .collect(),
        ),
        (
            Section::Egress,
            r.egress.iter().flatten().map(PeerView::egress).collect(),
        ),
        (
            Section::EgressDeny,
            r.egress_deny
                .iter()
                .flatten()
                .map(PeerView::egress_deny)
                .collect(),
        ),
    ];
    if matches!(subject, Subject::Nodes(_)) {
        reject_host_l7(ctx, &sections, path)?;
    }
    let mut has = [false; 4];
    let mut requires = Vec::new();
    for (si, (section, views)) in sections.iter().enumerate() {
        has[si] = !views.is_empty();
        // fromRequires / toRequires are kept apart: the engine ANDs them into the endpoint
        // selectors of every rule selecting the same endpoint, from any policy.
        requires.extend(collect_requires(
            ctx,
            views,
            *section,
            path,
            namespace.as_deref(),
            init,
        )?);
        for (i, v) in views.iter().enumerate() {
            let p = format!("{path}.{}[{i}]", section.as_str());
            peer_rules.push(translate_peer_rule(
                ctx,
                v,
                *section,
                &p,
                namespace.as_deref(),
                init,
            )?);
        }
    }
    let ingress_present = has[0] || has[1];
    let egress_present = has[2] || has[3];
    Ok(Rule {
        policy: ctx.key.clone(),
        path: path.to_string(),
        subject,
        isolates_ingress: ingress_present && default_deny.ingress != Some(false),
        isolates_egress: egress_present && default_deny.egress != Some(false),
        peer_rules,
        requires,
        tier: None,
        staged: false,
    })
}

/// Host policies (`nodeSelector`) cannot carry L7 rules, ingress or egress (Cilium's
/// `Rule.Sanitize`: "host policies do not support L7 rules yet").
fn reject_host_l7(
    ctx: &Ctx,
    sections: &[(Section, Vec<PeerView>)],
    path: &str,
) -> Result<(), PolicyError> {
    for (section, views) in sections {
        for (i, v) in views.iter().enumerate() {
            for (j, (_, rule)) in v.to_ports.iter().enumerate() {
                if l7_rule_count(rule.and_then(|r| r.rules.as_ref())) > 0 {
                    return Err(ctx.err(
                        format!("{path}.{}[{i}].toPorts[{j}].rules", section.as_str()),
                        "host policies (nodeSelector) do not support L7 rules",
                    ));
                }
            }
        }
    }
    Ok(())
}

fn collect_requires(
    ctx: &Ctx,
    views: &[PeerView],
    section: Section,
    path: &str,
    namespace: Option<&str>,
    init: bool,
) -> Result<Vec<Arc<PeerRequirement>>, PolicyError> {
    let field = if section.direction() == crate::policy::rule::Direction::Ingress {
        "fromRequires"
    } else {
        "toRequires"
    };
    let mut out = Vec::new();
    for (i, v) in views.iter().enumerate() {
        for (j, s) in v.requires.iter().copied().flatten().enumerate() {
            let p = format!("{path}.{}[{i}].{field}[{j}]", section.as_str());
            let sel = label_selector(ctx, s, &p)?;
            out.push(Arc::new(PeerRequirement {
                origin: ctx.origin(section, p, false, None),
                selector: scope_peer_selector(sel, namespace, false, init),
                text: selector_text(s),
            }));
        }
    }
    Ok(out)
}

/// A label selector as written, for explanations: `group=A, tier In (a, b)`.
fn selector_text(s: &api::LabelSelector) -> String {
    let mut parts: Vec<String> = s
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in s.match_expressions.iter().flatten() {
        let key = e.key.as_deref().unwrap_or_default();
        let op = e.operator.as_deref().unwrap_or_default();
        match e.values.as_deref() {
            Some(vals) if !vals.is_empty() => {
                parts.push(format!("{key} {op} ({})", vals.join(", ")))
            }
            _ => parts.push(format!("{key} {op}")),
        }
    }
    if parts.is_empty() {
        "{}".to_string()
    } else {
        parts.join(", ")
    }
}

fn translate_peer_rule(
    ctx: &mut Ctx,
    v: &PeerView,
    section: Section,
    path: &str,
    namespace: Option<&str>,
    init: bool,
) -> Result<PeerRule, PolicyError> {
    let dir = if section.direction() == crate::policy::rule::Direction::Ingress {
        "from"
    } else {
        "to"
    };
    let kinds = v.l3_kinds(dir);
    if kinds.len() > 1 {
        return Err(ctx.err(
            path,
            format!(
                "combining {} and {} in one rule is not supported",
                kinds[0], kinds[1]
            ),
        ));
    }
    if len(v.nodes) > 0 {
        return Err(ctx.err(
            format!("{path}.{dir}Nodes"),
            format!("{dir}Nodes requires --enable-node-selector-labels, which is off (as in Cilium 1.16 by default)"),
        ));
    }
    if len(v.icmps) > 0 && !v.to_ports.is_empty() {
        return Err(ctx.err(path, "icmps and toPorts cannot be combined in one rule"));
    }
    if len(v.services) > 0 && !v.to_ports.is_empty() {
        return Err(ctx.err(
            format!("{path}.toServices"),
            "toServices cannot be combined with toPorts in one rule (as in Cilium 1.16)",
        ));
    }

    // ----- peers
    let mut selectors: Vec<SelectorRef> = Vec::new();
    let mut any = false;
    for (j, s) in v.endpoints.iter().copied().flatten().enumerate() {
        let p = format!("{path}.{dir}Endpoints[{j}]");
        let sel = scope_peer_selector(label_selector(ctx, s, &p)?, namespace, true, init);
        selectors.push(Selector::labels(sel));
    }
    // Endpoint selectors come first; requirements apply to them only.
    let endpoint_selectors = selectors.len();
    for (j, c) in v.cidr.iter().copied().flatten().enumerate() {
        let p = format!("{path}.{dir}CIDR[{j}]");
        let prefix = parse_cidr(c).map_err(|m| ctx.err(&p, m))?;
        selectors.push(Selector::cidr(CidrSelector::new(prefix, vec![])));
    }
    for (j, c) in v.cidr_set.iter().copied().flatten().enumerate() {
        let p = format!("{path}.{dir}CIDRSet[{j}]");
        if c.cidr.is_none() && (c.cidr_group_ref.is_some() || c.cidr_group_selector.is_some()) {
            ctx.note(format!(
                "{p}: CIDR groups are not supported yet; the entry selects nothing (fail closed)"
            ));
            continue;
        }
        let sel = cidr_selector(ctx, c.cidr.as_deref(), c.except.as_ref(), &p, false)?;
        selectors.push(Selector::cidr(sel));
    }
    for (j, e) in v.entities.iter().copied().flatten().enumerate() {
        let p = format!("{path}.{dir}Entities[{j}]");
        match entity(e) {
            None => return Err(ctx.err(p, format!("unknown entity {e:?}"))),
            Some(EntitySelection::All) => any = true,
            Some(EntitySelection::Selectors(sels)) => {
                selectors.extend(sels.into_iter().map(Selector::labels))
            }
        }
    }
    if len(v.groups) > 0 {
        ctx.note(format!("{path}.{dir}Groups: toGroups/fromGroups are not supported yet; they select nothing (fail closed)"));
    }
    if let Some(services) = v.services.filter(|s| !s.is_empty()) {
        ctx.uses_services = true;
        for (j, s) in services.iter().enumerate() {
            let p = format!("{path}.toServices[{j}]");
            let r = ServiceRef::parse(s).map_err(|m| ctx.err(&p, m))?;
            let mut backends = 0;
            let mut with_selector = Vec::new();
            for ((ns, name), entry) in ctx.services.matching(&r) {
                if entry.has_selector {
                    with_selector.push(format!("{ns}/{name}"));
                    continue;
                }
                for ip in &entry.backends {
                    selectors.push(Selector::cidr(CidrSelector::new(IpNet::from(*ip), vec![])));
                    backends += 1;
                }
            }
            if !with_selector.is_empty() {
                ctx.note(format!(
                    "{p}: {} has a pod selector; as in Cilium 1.16, toServices applies only to services without one (select its pods with toEndpoints)",
                    with_selector.join(", ")
                ));
            }
            if backends == 0 {
                ctx.note(format!(
                    "{p}: no matching service without a selector has endpoints yet; selects nothing (fail closed) until one does"
                ));
            }
        }
    }
    if let Some(fqdns) = v.fqdns.filter(|f| !f.is_empty()) {
        for (j, f) in fqdns.iter().enumerate() {
            selectors.push(Selector::fqdn(fqdn_pattern(
                ctx,
                f,
                &format!("{path}.toFQDNs[{j}]"),
            )?));
        }
    }
    let has_l3 = !kinds.is_empty();

    // ----- ports
    let mut l7 = false;
    let mut dns = Vec::new();
    let mut l7_ports = Vec::new();
    let ports = if let Some(icmps) = v.icmps.filter(|i| !i.is_empty()) {
        Ports::List(icmp_ports(ctx, icmps, path)?)
    } else if !v.to_ports.is_empty() {
        let mut list = Vec::new();
        for (j, (pp, rule)) in v.to_ports.iter().enumerate() {
            let p = format!("{path}.toPorts[{j}]");
            let ports = pp.map(|v| v.as_slice()).unwrap_or(&[]);
            if ports.len() > MAX_PORTS {
                return Err(ctx.err(
                    format!("{p}.ports"),
                    format!(
                        "too many ports ({}), at most {MAX_PORTS} per toPorts entry",
                        ports.len()
                    ),
                ));
            }
            let mut parsed = Vec::new();
            for (k, port) in ports.iter().enumerate() {
                let pk = format!("{p}.ports[{k}]");
                let spec = port_spec(ctx, port.port.as_ref(), port.end_port, &pk, false)?;
                let proto =
                    cilium_protocol(ctx, port.protocol.as_deref(), &format!("{pk}.protocol"))?;
                parsed.push(PortMatch {
                    protocol: proto,
                    port: spec,
                });
            }
            if let Some(rule) = rule {
                let names = rule.rules.as_ref().and_then(|r| r.dns.as_ref());
                let dns_rules = names.is_some_and(|n| !n.is_empty());
                // DNS rules are enforced (the DNS proxy), HTTP rules and server names too (the
                // HTTP proxy); other L7 rules are not.
                if validate_l7(ctx, rule, &parsed, section, &p)? && !dns_rules {
                    match enforced_l7(ctx, rule, &p)? {
                        Some(rules) => l7_ports.push(L7Ports {
                            ports: parsed.clone(),
                            rules: Arc::new(rules),
                        }),
                        None => l7 = true,
                    }
                }
                if dns_rules && parsed.iter().any(|pm| pm.port != PortSpec::Range(53, 53)) {
                    ctx.note(format!(
                        "{p}.rules.dns: enforced on port 53 only (the DNS proxy sees DNS to port 53); on other ports only their L3/L4 part is"
                    ));
                }
                if let Some(names) = names.filter(|n| !n.is_empty()) {
                    dns.push(DnsRules {
                        ports: parsed.clone(),
                        names: names
                            .iter()
                            .map(|d| match (&d.match_name, &d.match_pattern) {
                                (Some(n), _) => FqdnPattern::name(n),
                                (None, p) => FqdnPattern::pattern(p.as_deref().unwrap_or("")),
                            })
                            .collect(),
                    });
                }
            }
            list.extend(parsed);
        }
        Ports::List(list)
    } else {
        Ports::Any
    };

    // ----- authentication
    let mut peers = if any {
        Peers::Any
    } else if has_l3 {
        Peers::Selectors(selectors)
    } else if matches!(ports, Ports::List(_)) {
        // A rule with only toPorts / icmps applies to every peer.
        Peers::Any
    } else {
        // `{}`: isolates, allows nothing.
        Peers::Selectors(vec![])
    };
    if let Some(auth) = v.auth {
        match auth.mode.as_deref() {
            Some("disabled") | None => {}
            Some(m @ ("required" | "test-always-fail")) => {
                ctx.note(format!(
                    "{path}.authentication: mode {m:?} is not supported; the rule allows nothing (fail closed, as Cilium without mutual auth)"
                ));
                peers = Peers::Selectors(vec![]);
            }
            Some(m) => {
                return Err(ctx.err(
                    format!("{path}.authentication.mode"),
                    format!(
                        "unknown authentication mode {m:?} (disabled, required, test-always-fail)"
                    ),
                ))
            }
        }
    }
    if l7 {
        ctx.note(format!(
            "{path}: L7 rules not enforced; their L3/L4 part is"
        ));
    }
    Ok(PeerRule {
        origin: ctx.origin(section, path, l7, None),
        peers,
        ports,
        endpoint_selectors,
        dns,
        l7: l7_ports,
        action: None,
    })
}

fn icmp_ports(
    ctx: &Ctx,
    icmps: &[api::IcmpRule],
    path: &str,
) -> Result<Vec<PortMatch>, PolicyError> {
    let mut out = Vec::new();
    for (k, rule) in icmps.iter().enumerate() {
        let n = len(rule.fields.as_ref());
        if n > MAX_ICMP_FIELDS {
            return Err(ctx.err(
                format!("{path}.icmps[{k}].fields"),
                format!("too many ICMP fields ({n}), at most {MAX_ICMP_FIELDS} per icmps entry"),
            ));
        }
        for (m, f) in rule.fields.iter().flatten().enumerate() {
            let p = format!("{path}.icmps[{k}].fields[{m}]");
            let v6 = match f.family.as_deref() {
                None | Some("") | Some("IPv4") => false,
                Some("IPv6") => true,
                Some(other) => {
                    return Err(ctx.err(
                        format!("{p}.family"),
                        format!("unknown ICMP family {other:?} (IPv4 or IPv6)"),
                    ))
                }
            };
            let t = match &f.icmp_type {
                None => return Err(ctx.err(format!("{p}.type"), "missing ICMP type")),
                Some(api::IntOrString::Int(n)) => u8::try_from(*n).map_err(|_| {
                    ctx.err(
                        format!("{p}.type"),
                        format!("ICMP type {n} is outside 0..255"),
                    )
                })?,
                Some(api::IntOrString::Str(s)) => match s.parse::<u8>() {
                    Ok(n) => n,
                    Err(_) => icmp_type_from_name(s, v6).ok_or_else(|| {
                        ctx.err(format!("{p}.type"), format!("unknown ICMP type {s:?}"))
                    })?,
                },
            };
            out.push(PortMatch {
                protocol: if v6 { Protocol::Icmpv6 } else { Protocol::Icmp },
                port: PortSpec::Range(t as u16, t as u16),
            });
        }
    }
    Ok(out)
}

/// A `toFQDNs` entry or a DNS rule, checked and compiled.
fn fqdn_pattern(ctx: &Ctx, f: &api::FqdnSelector, path: &str) -> Result<FqdnPattern, PolicyError> {
    match (&f.match_name, &f.match_pattern) {
        (Some(n), None) => check_dns_chars(ctx, n, false, &format!("{path}.matchName"))
            .map(|()| FqdnPattern::name(n)),
        (None, Some(p)) => check_dns_chars(ctx, p, true, &format!("{path}.matchPattern"))
            .map(|()| FqdnPattern::pattern(p)),
        (Some(_), Some(_)) => {
            Err(ctx.err(path, "matchName and matchPattern are mutually exclusive"))
        }
        (None, None) => Err(ctx.err(path, "needs matchName or matchPattern")),
    }
}

fn check_dns_chars(ctx: &Ctx, s: &str, pattern: bool, path: &str) -> Result<(), PolicyError> {
    let ok = !s.is_empty()
        && s.len() <= 255
        && s.chars().all(|c| {
            c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') || (pattern && c == '*')
        });
    if ok {
        Ok(())
    } else {
        Err(ctx.err(
            path,
            format!(
                "invalid DNS {} {s:?}",
                if pattern { "pattern" } else { "name" }
            ),
        ))
    }
}

/// Kafka request types a rule may name in `apiKey` (Cilium's `kafka.APIKeyMap`).
const KAFKA_API_KEYS: &[&str] = &[
    "produce",
    "fetch",
    "offsets",
    "metadata",
    "leaderandisr",
    "stopreplica",
    "updatemetadata",
    "controlledshutdown",
    "offsetcommit",
    "offsetfetch",
    "findcoordinator",
    "joingroup",
    "heartbeat",
    "leavegroup",
    "syncgroup",
    "describegroups",
    "listgroups",
    "saslhandshake",
    "apiversions",
    "createtopics",
    "deletetopics",
    "deleterecords",
    "initproducerid",
    "offsetforleaderepoch",
    "addpartitionstotxn",
    "addoffsetstotxn",
    "endtxn",
    "writetxnmarkers",
    "txnoffsetcommit",
    "describeacls",
    "createacls",
    "deleteacls",
    "describeconfigs",
    "alterconfigs",
];

/// An HTTP `headerMatches` entry (Cilium's `PortRuleHTTP.Sanitize`): a name, a known mismatch
/// action, and a named secret when a secret is given.
fn validate_header_match(ctx: &Ctx, m: &Value, path: &str) -> Result<(), PolicyError> {
    let field = |k: &str| m.get(k).and_then(Value::as_str).unwrap_or_default();
    if field("name").is_empty() {
        return Err(ctx.err(format!("{path}.name"), "header name missing"));
    }
    let mismatch = field("mismatch");
    if !matches!(mismatch, "" | "LOG" | "ADD" | "DELETE" | "REPLACE") {
        return Err(ctx.err(
            format!("{path}.mismatch"),
            format!("invalid header action {mismatch:?} (LOG, ADD, DELETE or REPLACE)"),
        ));
    }
    if let Some(secret) = m.get("secret").filter(|s| !s.is_null()) {
        if secret
            .get("name")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            return Err(ctx.err(format!("{path}.secret.name"), "secret name missing"));
        }
    }
    Ok(())
}

/// The number of L7 rules of a port rule, as Cilium's `L7Rules.Len` counts them: `l7proto`
/// alone is no rule (Cilium's `IsEmpty` is `Len() == 0`).
fn l7_rule_count(rules: Option<&api::L7Rules>) -> usize {
    rules.map_or(0, |r| {
        len(r.http.as_ref()) + len(r.kafka.as_ref()) + len(r.dns.as_ref()) + len(r.l7.as_ref())
    })
}

/// Port `0` (any port) as Cilium's `PortProtocol.sanitize` sees it: a number, never a name.
fn is_zero_port(port: Option<&api::IntOrString>) -> bool {
    match port {
        Some(api::IntOrString::Int(n)) => *n == 0,
        Some(api::IntOrString::Str(s)) => {
            let t = s.trim();
            !t.is_empty() && t.chars().all(|c| c.is_ascii_digit()) && t.parse::<u64>() == Ok(0)
        }
        None => false,
    }
}

/// The L7 part of a port rule the HTTP proxy enforces: its HTTP rules, or TLS server names
/// alone (judged by the ClientHello's SNI). `None`: L7 that stays L3/L4 only, said in the
/// status (Kafka, generic L7, TLS termination or origination, listeners).
fn enforced_l7(
    ctx: &Ctx,
    rule: &api::PortRule,
    path: &str,
) -> Result<Option<L7PortRules>, PolicyError> {
    if rule.listener.is_some() || rule.terminating_tls.is_some() || rule.originating_tls.is_some() {
        return Ok(None);
    }
    let rules = rule.rules.as_ref();
    let other = rules.is_some_and(|r| {
        len(r.kafka.as_ref()) + len(r.l7.as_ref()) > 0
            || r.l7proto.as_ref().is_some_and(|p| !p.is_empty())
    });
    if other {
        return Ok(None);
    }
    let server_names = rule.server_names.clone().unwrap_or_default();
    match rules
        .and_then(|r| r.http.as_ref())
        .filter(|h| !h.is_empty())
    {
        Some(http) => Ok(Some(L7PortRules {
            http: http_rules(ctx, http, &format!("{path}.rules.http"))?,
            server_names: vec![],
        })),
        None if !server_names.is_empty() => Ok(Some(L7PortRules {
            http: vec![],
            server_names,
        })),
        None => Ok(None),
    }
}

/// The `http` rules of a port rule (their regexes already validated by `validate_l7`).
fn http_rules(ctx: &Ctx, http: &[api::HttpRule], path: &str) -> Result<Vec<HttpRule>, PolicyError> {
    let mut out = Vec::with_capacity(http.len());
    for (i, h) in http.iter().enumerate() {
        let mut header_matches = Vec::new();
        for (j, m) in h.header_matches.iter().flatten().enumerate() {
            let mp = format!("{path}[{i}].headerMatches[{j}]");
            if m.get("secret").is_some_and(|s| !s.is_null()) {
                return Err(ctx.err(
                    format!("{mp}.secret"),
                    "header values from secrets are not supported yet (the rule would be enforced without its value)",
                ));
            }
            let field = |k: &str| m.get(k).and_then(Value::as_str).unwrap_or_default();
            header_matches.push(HeaderMatch {
                name: field("name").to_ascii_lowercase(),
                value: field("value").to_string(),
                mismatch: Mismatch::parse(field("mismatch")).unwrap_or(Mismatch::Fail),
            });
        }
        out.push(HttpRule {
            method: h.method.clone().filter(|m| !m.is_empty()),
            path: h.path.clone().filter(|p| !p.is_empty()),
            host: h.host.clone().filter(|h| !h.is_empty()),
            headers: h
                .headers
                .iter()
                .flatten()
                .map(|e| HeaderRequirement::parse(e))
                .collect(),
            header_matches,
        });
    }
    Ok(out)
}

/// Validates a port rule's L7 part, listener and server names (Cilium's `PortRule.sanitize`).
/// Returns whether it has L7 rules at all.
fn validate_l7(
    ctx: &Ctx,
    rule: &api::PortRule,
    ports: &[PortMatch],
    section: Section,
    path: &str,
) -> Result<bool, PolicyError> {
    let ingress = section.direction() == crate::policy::rule::Direction::Ingress;
    let has_rules = l7_rule_count(rule.rules.as_ref()) > 0;
    let mut is_l7 =
        rule.listener.is_some() || rule.server_names.as_ref().is_some_and(|s| !s.is_empty());
    if has_rules
        && rule.server_names.as_ref().is_some_and(|s| !s.is_empty())
        && rule.terminating_tls.is_none()
    {
        return Err(ctx.err(
            format!("{path}.serverNames"),
            "serverNames are not allowed together with L7 rules without terminatingTLS",
        ));
    }
    for (i, sn) in rule.server_names.iter().flatten().enumerate() {
        if sn.is_empty() {
            return Err(ctx.err(format!("{path}.serverNames[{i}]"), "empty server name"));
        }
    }
    if rule.listener.is_some() {
        if ingress {
            return Err(ctx.err(
                format!("{path}.listener"),
                "a listener is not allowed on ingress",
            ));
        }
        if has_rules {
            return Err(ctx.err(
                format!("{path}.listener"),
                "a listener is not allowed together with L7 rules",
            ));
        }
    }
    let Some(l7) = rule.rules.as_ref().filter(|_| has_rules) else {
        return Ok(is_l7);
    };
    let rp = format!("{path}.rules");
    if let Some(k) = rule
        .ports
        .iter()
        .flatten()
        .position(|pp| is_zero_port(pp.port.as_ref()))
    {
        return Err(ctx.err(
            format!("{path}.ports[{k}].port"),
            "L7 rules cannot be used on port 0 (any port)",
        ));
    }
    let http = l7.http.as_ref().is_some_and(|v| !v.is_empty());
    let kafka = l7.kafka.as_ref().is_some_and(|v| !v.is_empty());
    let dns = l7.dns.as_ref().is_some_and(|v| !v.is_empty());
    let generic = l7.l7proto.as_ref().is_some_and(|s| !s.is_empty());
    if l7.l7.is_some() && !generic {
        return Err(ctx.err(
            format!("{rp}.l7"),
            "'l7' may only be specified together with 'l7proto'",
        ));
    }
    if [http, kafka, dns, generic].iter().filter(|b| **b).count() > 1 {
        return Err(ctx.err(rp, "multiple L7 protocol rule types in one port rule"));
    }
    is_l7 = true;
    if dns {
        if ingress {
            return Err(ctx.err(format!("{rp}.dns"), "DNS rules are not allowed on ingress"));
        }
        if ports.is_empty() {
            return Err(ctx.err(format!("{path}.ports"), "DNS rules need an explicit port"));
        }
        for (k, pm) in ports.iter().enumerate() {
            if let PortSpec::Range(lo, hi) = pm.port {
                if hi > lo {
                    return Err(ctx.err(
                        format!("{path}.ports[{k}].endPort"),
                        "DNS rules do not support port ranges",
                    ));
                }
            }
        }
        for (i, d) in l7.dns.iter().flatten().enumerate() {
            let fq = api::FqdnSelector {
                match_name: d.match_name.clone(),
                match_pattern: d.match_pattern.clone(),
            };
            fqdn_pattern(ctx, &fq, &format!("{rp}.dns[{i}]"))?;
        }
    } else {
        for (k, pm) in ports.iter().enumerate() {
            if pm.protocol != Protocol::Tcp {
                return Err(ctx.err(
                    format!("{path}.ports[{k}].protocol"),
                    format!(
                        "L7 rules can only apply to TCP (not {}), except DNS rules",
                        pm.protocol.as_str()
                    ),
                ));
            }
        }
    }
    for (i, kv) in l7.l7.iter().flatten().enumerate() {
        if kv.contains_key("") {
            return Err(ctx.err(format!("{rp}.l7[{i}]"), "empty key in a generic L7 rule"));
        }
    }
    for (i, h) in l7.http.iter().flatten().enumerate() {
        let hp = format!("{rp}.http[{i}]");
        // Cilium compiles method and path; the host is compiled too, since the proxy
        // matches it: a rule it could not compile is a field error, never a dropped rule.
        for (field, val) in [("method", &h.method), ("path", &h.path), ("host", &h.host)] {
            if let Some(v) = val {
                if let Err(e) = crate::policy::l7::http::compile_anchored(v) {
                    return Err(ctx.err(format!("{hp}.{field}"), e));
                }
            }
        }
        for (j, m) in h.header_matches.iter().flatten().enumerate() {
            validate_header_match(ctx, m, &format!("{hp}.headerMatches[{j}]"))?;
        }
    }
    for (i, k) in l7.kafka.iter().flatten().enumerate() {
        let kp = format!("{rp}.kafka[{i}]");
        if let Some(role) = k.role.as_ref().filter(|r| !r.is_empty()) {
            if !matches!(role.to_ascii_lowercase().as_str(), "produce" | "consume") {
                return Err(ctx.err(
                    format!("{kp}.role"),
                    format!("invalid Kafka role {role:?} (produce or consume)"),
                ));
            }
            if k.api_key.as_ref().is_some_and(|a| !a.is_empty()) {
                return Err(ctx.err(kp, "role and apiKey are mutually exclusive"));
            }
        }
        if let Some(key) = k.api_key.as_ref().filter(|a| !a.is_empty()) {
            if !KAFKA_API_KEYS.contains(&key.to_ascii_lowercase().as_str()) {
                return Err(ctx.err(
                    format!("{kp}.apiKey"),
                    format!("invalid Kafka apiKey {key:?}"),
                ));
            }
        }
        if let Some(v) = k.api_version.as_ref().filter(|v| !v.is_empty()) {
            if v.parse::<i16>().map_or(true, |n| n < 0) {
                return Err(ctx.err(
                    format!("{kp}.apiVersion"),
                    format!("invalid Kafka apiVersion {v:?} (a number in 0..32767)"),
                ));
            }
        }
        if let Some(t) = &k.topic {
            if t.len() > 255
                || !t
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
            {
                return Err(ctx.err(format!("{kp}.topic"), format!("invalid Kafka topic {t:?}")));
            }
        }
    }
    Ok(is_l7)
}
