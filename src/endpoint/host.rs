//! The host endpoint (`--enable-host-firewall`): the node itself as an endpoint, so that
//! CiliumClusterwideNetworkPolicies with a `nodeSelector` are enforced on traffic to and from the
//! node (Cilium's host firewall).
//!
//! It has a fixed endpoint id ([`HOST_ENDPOINT_ID`], never handed to a pod), so the datapath finds
//! it without a lookup of its own; identity `reserved:host`; and labels from this node's Node
//! object, filtered as Cilium filters identity-relevant labels ([`host_labels`]). Pure.

use crate::policy::engine::{Decision, EndpointPolicy};
use crate::policy::identity::NumericIdentity;
use crate::policy::labels::{Label, Labels};
use crate::policy::rule::Direction;

/// The host endpoint's id: the last one, which the registry never gives to a pod. The BPF
/// programs know it as `CILIATE_HOST_ENDPOINT_ID` (`bpf/ciliate.h`).
pub use crate::datapath::HOST_ENDPOINT_ID;

/// Its name in `endpoint list` and `/debug/endpoints`.
pub const HOST_ENDPOINT_NAME: &str = "host";

/// Label keys Cilium leaves out of identities by default (`pkg/labelsfilter`, the default
/// configuration): a key is left out when one of these patterns matches at its start. The
/// leading `.*` of Cilium's `!.*beta\.kubernetes\.io` lets that one match anywhere.
const IGNORED_PREFIXES: &[&str] = &[
    "io.kubernetes",
    "kubernetes.io",
    "statefulset.kubernetes.io/pod-name",
    "apps.kubernetes.io/pod-index",
    "batch.kubernetes.io/job-completion-index",
    "batch.kubernetes.io/controller-uid",
    "k8s.io",
    "pod-template-generation",
    "pod-template-hash",
    "controller-revision-hash",
    "annotation",
    "etcd_node",
];

/// Whether Cilium's default label filter keeps a node label's key.
pub fn label_kept(key: &str) -> bool {
    !key.contains("beta.kubernetes.io") && !IGNORED_PREFIXES.iter().any(|p| key.starts_with(p))
}

/// The host endpoint's labels: `reserved:host` and the node's labels Cilium keeps, as `k8s:`
/// labels (what `nodeSelector` matches).
pub fn host_labels<'a>(node_labels: impl IntoIterator<Item = (&'a String, &'a String)>) -> Labels {
    let mut labels: Labels = node_labels
        .into_iter()
        .filter(|(k, _)| label_kept(k))
        .map(|(k, v)| Label::k8s(k, v))
        .collect();
    labels.insert(Label::reserved("host"));
    labels
}

/// `status`'s `host_firewall`: `off`, `audit` (the host endpoint's or the agent's audit mode)
/// or `enforcing`.
pub fn firewall_mode(enabled: bool, audit: bool) -> &'static str {
    match (enabled, audit) {
        (false, _) => "off",
        (true, true) => "audit",
        (true, false) => "enforcing",
    }
}

/// A connection the node itself depends on: before a host policy is enforced, the agent warns
/// when it would cut one (Cilium lets an operator lock a node out without a word).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lifeline {
    /// What it is, for the warning: `its API server 172.20.0.2:6443`.
    pub what: String,
    /// From the node's point of view.
    pub direction: Direction,
    /// The peer's identity as the node sees it now.
    pub peer: NumericIdentity,
    pub protocol: u8,
    pub port: u16,
}

/// One warning per lifeline the host endpoint's resolved policy drops, naming what drops it.
pub fn cut_lifelines(policy: &EndpointPolicy, lifelines: &[Lifeline]) -> Vec<String> {
    lifelines
        .iter()
        .filter_map(|l| {
            let why = match policy.decide(l.direction, l.peer, l.protocol, l.port) {
                Decision::Denied(origin) => format!("denied by {}", origin.describe()),
                Decision::DefaultDenied { isolated_by, .. } => {
                    let by: Vec<String> = isolated_by.iter().map(|k| k.to_string()).collect();
                    format!(
                        "no rule allows it, and {} isolates the node's {}",
                        by.join(", "),
                        direction_name(l.direction)
                    )
                }
                Decision::Allowed(_) | Decision::NotIsolated => return None,
            };
            Some(format!(
                "the host policies would cut the node from {} ({}): {why}",
                l.what,
                direction_name(l.direction)
            ))
        })
        .collect()
}

fn direction_name(d: Direction) -> &'static str {
    match d {
        Direction::Ingress => "ingress",
        Direction::Egress => "egress",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::engine::{EndpointView, PolicyEngine};
    use std::collections::BTreeMap;

    #[test]
    fn a_host_policy_that_cuts_the_api_server_is_named_and_one_that_allows_it_is_not() {
        let mut e = PolicyEngine::new();
        let doc = |y: &str| {
            let v: serde_yaml::Value = serde_yaml::from_str(y).unwrap();
            crate::policy::translate::parse_policy(&v, "default", "test").unwrap()
        };
        let labels = host_labels(std::iter::empty());
        let resolve = |e: &PolicyEngine| {
            e.resolve(&EndpointView {
                identity: crate::policy::identity::IDENTITY_HOST,
                labels: &labels,
                named_ports: &[],
                host: true,
            })
        };
        let api = "172.20.0.2".parse().unwrap();
        let life = |e: &PolicyEngine| Lifeline {
            what: "its API server 172.20.0.2:6443".into(),
            direction: Direction::Egress,
            peer: e.identity_of_ip(api),
            protocol: 6,
            port: 6443,
        };
        assert!(
            cut_lifelines(&resolve(&e), &[life(&e)]).is_empty(),
            "no policy"
        );
        e.upsert_policy(doc("{apiVersion: cilium.io/v2, kind: CiliumClusterwideNetworkPolicy, metadata: {name: lock}, spec: {nodeSelector: {}, egress: [{toCIDR: [10.0.0.0/8]}]}}"));
        let w = cut_lifelines(&resolve(&e), &[life(&e)]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("172.20.0.2:6443")
                && w[0].contains("CiliumClusterwideNetworkPolicy lock")
                && w[0].contains("egress"),
            "{w:?}"
        );
        e.upsert_policy(doc("{apiVersion: cilium.io/v2, kind: CiliumClusterwideNetworkPolicy, metadata: {name: deny}, spec: {nodeSelector: {}, egressDeny: [{toCIDR: [172.20.0.0/24]}]}}"));
        let w = cut_lifelines(&resolve(&e), &[life(&e)]);
        assert!(
            w.len() == 1 && w[0].contains("denied by CiliumClusterwideNetworkPolicy deny"),
            "{w:?}"
        );
        e.upsert_policy(doc("{apiVersion: cilium.io/v2, kind: CiliumClusterwideNetworkPolicy, metadata: {name: deny}, spec: {nodeSelector: {}, egress: [{toCIDR: [172.20.0.0/24], toPorts: [{ports: [{port: '6443', protocol: TCP}]}]}]}}"));
        assert!(
            cut_lifelines(&resolve(&e), &[life(&e)]).is_empty(),
            "allowed now"
        );
    }

    #[test]
    fn node_labels_are_filtered_as_cilium_filters_identity_labels() {
        let node: BTreeMap<String, String> = [
            ("kubernetes.io/hostname", "node-1"),
            ("kubernetes.io/os", "linux"),
            ("beta.kubernetes.io/arch", "amd64"),
            ("failure-domain.beta.kubernetes.io/zone", "a"),
            ("node-role.kubernetes.io/control-plane", ""),
            ("node-access", "ssh"),
            ("type", "worker"),
            ("k8s.io/cloud", "x"),
            ("topology.kubernetes.io/zone", "a"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let l = host_labels(&node);
        let mut keys: Vec<String> = l.to_strings();
        keys.sort();
        assert_eq!(
            keys,
            vec![
                "k8s:node-access=ssh",
                "k8s:node-role.kubernetes.io/control-plane",
                "k8s:topology.kubernetes.io/zone=a",
                "k8s:type=worker",
                "reserved:host",
            ]
        );
    }

    #[test]
    fn the_datapath_knows_the_host_endpoint_by_the_same_numbers() {
        let header = include_str!("../../bpf/ciliate.h");
        for (define, value) in [
            ("CILIATE_HOST_ENDPOINT_ID", u32::from(HOST_ENDPOINT_ID)),
            ("CILIATE_ID_HOST", crate::policy::identity::IDENTITY_HOST),
            (
                "CILIATE_ID_REMOTE_NODE",
                crate::policy::identity::IDENTITY_REMOTE_NODE,
            ),
            (
                "CILIATE_TUNNEL_PORT",
                u32::from(crate::network::tunnel::VXLAN_PORT),
            ),
        ] {
            let line = format!("#define {define} {value}\n");
            assert!(header.contains(&line), "bpf/ciliate.h lacks {line:?}");
        }
    }

    #[test]
    fn the_mode_names_what_status_shows() {
        assert_eq!(firewall_mode(false, true), "off");
        assert_eq!(firewall_mode(true, true), "audit");
        assert_eq!(firewall_mode(true, false), "enforcing");
    }
}
