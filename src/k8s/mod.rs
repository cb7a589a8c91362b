//! Kubernetes plumbing: the client (`client`), the CRD types of Cilium's policy kinds (`crd`)
//! and of the network-policy-api's cluster tiers (`npa_crd`),
//! the policy status writer (`status`), this node's annotations (`node`) and the endpoint
//! slices agents write for each other (`slices`, `slice_writer`, `slice_read`). The in-memory API
//! server the tests use is a crate of its own (`crates/test-apiserver`). The watchers themselves are `actors::kube_watcher`.

pub mod client;
pub mod crd;
pub mod node;
pub mod npa_crd;
pub mod slice_read;
pub mod slice_writer;
pub mod slices;
pub mod status;

/// The API resource of a kind of the registry (`kinds::KINDS`), for untyped clients.
pub fn api_resource(info: &crate::kinds::KindInfo) -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: info.group.into(),
        version: info.version.into(),
        api_version: info.api_version(),
        kind: info.name.into(),
        plural: info.plural.into(),
    }
}
