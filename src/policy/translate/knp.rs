//! Kubernetes NetworkPolicy -> rules, with the API server's validation and Cilium's translation
//! (`pkg/k8s/network_policy.go`).

use super::common::{cidr_selector, knp_protocol, label_selector, pods_in_namespaces, port_spec};
use super::{Ctx, PolicyError};
use crate::policy::api;
use crate::policy::labels::{POD_NAMESPACE_LABEL, SOURCE_K8S};
use crate::policy::rule::{PeerRule, Peers, PortMatch, Ports, Rule, Section, Subject};
use crate::policy::selector::{LabelSelector, Requirement, Selector, SelectorKind, SelectorRef};

pub fn translate(ctx: &mut Ctx, np: &api::NetworkPolicy) -> Result<Vec<Rule>, PolicyError> {
    let Some(spec) = &np.spec else {
        return Err(ctx.err("spec", "missing spec"));
    };
    let ns = ctx.namespace().unwrap_or("default").to_string();
    let pod_sel = label_selector(
        ctx,
        &spec.pod_selector.clone().unwrap_or_default(),
        "spec.podSelector",
    )?;
    let mut subject = pod_sel;
    subject.add(Requirement::equals(
        Some(SOURCE_K8S),
        POD_NAMESPACE_LABEL,
        &ns,
    ));

    let has_egress_rules = spec.egress.as_ref().is_some_and(|e| !e.is_empty());
    let (mut ingress, mut egress) = (false, false);
    match &spec.policy_types {
        None => {
            ingress = true;
            egress = has_egress_rules;
        }
        Some(types) => {
            for (i, t) in types.iter().enumerate() {
                match t.as_str() {
                    "Ingress" => ingress = true,
                    "Egress" => egress = true,
                    other => {
                        return Err(ctx.err(
                            format!("spec.policyTypes[{i}]"),
                            format!("unknown policy type {other:?} (Ingress or Egress)"),
                        ))
                    }
                }
            }
        }
    }

    let mut peer_rules = Vec::new();
    // Rules of a direction the policy does not declare are ignored, as Kubernetes specifies;
    // they are still validated so a typo does not go unnoticed.
    let ingress_rules = spec.ingress.iter().flatten();
    let egress_rules = spec.egress.iter().flatten();
    let sections = [
        (
            Section::Ingress,
            "from",
            ingress,
            ingress_rules
                .map(|r| (r.from.as_ref(), r.ports.as_ref()))
                .collect::<Vec<_>>(),
        ),
        (
            Section::Egress,
            "to",
            egress,
            egress_rules
                .map(|r| (r.to.as_ref(), r.ports.as_ref()))
                .collect(),
        ),
    ];
    for (section, peers_field, declared, rules) in sections {
        for (i, (peers, ports)) in rules.into_iter().enumerate() {
            let path = format!("spec.{}[{i}]", section.as_str());
            let pr = peer_rule(ctx, peers, ports, section, &path, &ns, peers_field)?;
            if declared {
                peer_rules.push(pr);
            }
        }
    }
    Ok(vec![Rule {
        policy: ctx.key.clone(),
        path: "spec".into(),
        subject: Subject::Endpoints(Selector::labels(subject)),
        isolates_ingress: ingress,
        isolates_egress: egress,
        peer_rules,
        requires: vec![],
        tier: None,
        staged: false,
    }])
}

fn peer_rule(
    ctx: &Ctx,
    peers: Option<&Vec<api::NetworkPolicyPeer>>,
    ports: Option<&Vec<api::NetworkPolicyPort>>,
    section: Section,
    path: &str,
    ns: &str,
    field: &str,
) -> Result<PeerRule, PolicyError> {
    let mut endpoint_selectors = 0;
    let peers = match peers.filter(|p| !p.is_empty()) {
        // No `from`/`to`: every peer, in or out of the cluster.
        None => Peers::Any,
        Some(list) => {
            let mut sels: Vec<SelectorRef> = Vec::new();
            for (j, p) in list.iter().enumerate() {
                let pp = format!("{path}.{field}[{j}]");
                sels.push(peer(ctx, p, &pp, ns)?);
            }
            // Pod/namespace peers first: Cilium makes them `FromEndpoints`, which CNP
            // requirements constrain; `ipBlock` peers become CIDR sets, which they do not.
            sels.sort_by_key(|s| matches!(s.kind(), SelectorKind::Cidr(_)));
            endpoint_selectors = sels
                .iter()
                .filter(|s| matches!(s.kind(), SelectorKind::Labels(_)))
                .count();
            Peers::Selectors(sels)
        }
    };
    let ports = match ports.filter(|p| !p.is_empty()) {
        None => Ports::Any,
        Some(list) => {
            let mut out = Vec::new();
            for (j, p) in list.iter().enumerate() {
                let pp = format!("{path}.ports[{j}]");
                let protocol = knp_protocol(ctx, p.protocol.as_deref(), &format!("{pp}.protocol"))?;
                let port = port_spec(ctx, p.port.as_ref(), p.end_port, &pp, true)?;
                out.push(PortMatch { protocol, port });
            }
            Ports::List(out)
        }
    };
    Ok(PeerRule {
        origin: ctx.origin(section, path, false, None),
        peers,
        ports,
        endpoint_selectors,
        dns: Vec::new(),
        l7: Vec::new(),
        action: None,
    })
}

fn peer(
    ctx: &Ctx,
    p: &api::NetworkPolicyPeer,
    path: &str,
    ns: &str,
) -> Result<SelectorRef, PolicyError> {
    if let Some(ip) = &p.ip_block {
        if p.pod_selector.is_some() || p.namespace_selector.is_some() {
            return Err(ctx.err(
                path,
                "ipBlock cannot be combined with podSelector or namespaceSelector in one peer",
            ));
        }
        let sel = cidr_selector(
            ctx,
            ip.cidr.as_deref(),
            ip.except.as_ref(),
            &format!("{path}.ipBlock"),
            true,
        )?;
        return Ok(Selector::cidr(sel));
    }
    let mut reqs: Vec<Requirement> = Vec::new();
    match (&p.pod_selector, &p.namespace_selector) {
        (None, None) => {
            return Err(ctx.err(
                path,
                "a peer needs podSelector, namespaceSelector or ipBlock",
            ));
        }
        (Some(ps), None) => {
            let s = label_selector(ctx, ps, &format!("{path}.podSelector"))?;
            reqs.extend(s.requirements().iter().cloned());
            reqs.push(Requirement::equals(
                Some(SOURCE_K8S),
                POD_NAMESPACE_LABEL,
                ns,
            ));
        }
        (pod, Some(nss)) => {
            return Ok(Selector::labels(pods_in_namespaces(
                ctx,
                Some(nss),
                pod.as_ref(),
                &format!("{path}.namespaceSelector"),
                &format!("{path}.podSelector"),
            )?));
        }
    }
    Ok(Selector::labels(LabelSelector::new(reqs)))
}
