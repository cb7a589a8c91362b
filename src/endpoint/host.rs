//! The host endpoint (`--enable-host-firewall`): the node itself as an endpoint, so that
//! CiliumClusterwideNetworkPolicies with a `nodeSelector` are enforced on traffic to and from the
//! node (Cilium's host firewall).
//!
//! It has a fixed endpoint id ([`HOST_ENDPOINT_ID`], never handed to a pod), so the datapath finds
//! it without a lookup of its own; identity `reserved:host`; and labels from this node's Node
//! object, filtered as Cilium filters identity-relevant labels ([`host_labels`]). Pure.

use crate::policy::labels::{Label, Labels};

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

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
    fn the_mode_names_what_status_shows() {
        assert_eq!(firewall_mode(false, true), "off");
        assert_eq!(firewall_mode(true, true), "audit");
        assert_eq!(firewall_mode(true, false), "enforcing");
    }
}
