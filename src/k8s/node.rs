//! This node's annotations (the second seed's `AnnotateNode`): the agent writes the pod CIDR its
//! IPAM serves and the node's host IP back to its Node object, so tools (and the next start, if
//! the Node's spec gives no range) read the same values the agent uses.
//!
//! [`desired_annotations`] says what the Node should carry; [`run_node_annotator`] merge-patches
//! them whenever they differ from what was last written, retrying failures with backoff for as
//! long as the agent runs (the seed's "retry forever" goroutine).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::ipam::{HOST_IP_ANNOTATION, POD_CIDR_ANNOTATION};
use crate::objects::NodeInfo;

/// The annotations this node should carry: the pod CIDR IPAM serves (if any) and the node's
/// first IPv4 address (if any).
pub fn desired_annotations(
    node: &NodeInfo,
    pod_cidr: Option<ipnet::Ipv4Net>,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(cidr) = pod_cidr {
        out.insert(POD_CIDR_ANNOTATION.to_string(), cidr.to_string());
    }
    if let Some(ip) = node.ips.iter().find(|ip| matches!(ip, IpAddr::V4(_))) {
        out.insert(HOST_IP_ANNOTATION.to_string(), ip.to_string());
    }
    out
}

/// True when `current` lacks one of `desired` or holds another value for it.
pub fn needs_update(
    current: &BTreeMap<String, String>,
    desired: &BTreeMap<String, String>,
) -> bool {
    desired.iter().any(|(k, v)| current.get(k) != Some(v))
}

/// Writes the annotations sent on `desired` to the Node `node_name` each time they are sent
/// (the watcher sends them whenever the Node lacks one), until the sender is dropped.
pub async fn run_node_annotator(
    client: kube::Client,
    node_name: String,
    mut desired: tokio::sync::watch::Receiver<BTreeMap<String, String>>,
) {
    let nodes: Api<Node> = Api::all(client);
    let mut failures: u32 = 0;
    loop {
        let want = desired.borrow_and_update().clone();
        if !want.is_empty() {
            let patch = json!({"metadata": {"annotations": want}});
            match nodes
                .patch(&node_name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    tracing::info!(node = %node_name, annotations = ?want, "node annotated");
                    failures = 0;
                }
                Err(e) => {
                    failures += 1;
                    let backoff = (Duration::from_millis(250) * 2u32.pow(failures.min(7)))
                        .min(Duration::from_secs(30));
                    tracing::warn!(node = %node_name, error = %e, retry_in = ?backoff, "cannot annotate the node; retrying");
                    // A newer wish cuts the wait short.
                    let _ = tokio::time::timeout(backoff, desired.changed()).await;
                    continue;
                }
            }
        }
        if desired.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn desired_annotations_carry_the_cidr_and_the_first_ipv4() {
        let node = NodeInfo {
            name: "n1".into(),
            labels: Default::default(),
            annotations: Default::default(),
            ips: vec!["fd00::2".parse().unwrap(), "172.18.0.2".parse().unwrap()],
            pod_cidrs: vec![],
            kubelet_port: None,
        };
        let want = desired_annotations(&node, Some("10.244.1.0/24".parse().unwrap()));
        assert_eq!(want[POD_CIDR_ANNOTATION], "10.244.1.0/24");
        assert_eq!(want[HOST_IP_ANNOTATION], "172.18.0.2");
        assert!(needs_update(&node.annotations, &want));
        assert!(!needs_update(&want, &want));
        assert!(desired_annotations(
            &NodeInfo {
                ips: vec![],
                ..node
            },
            None
        )
        .is_empty());
    }
}
