//! Kubernetes plumbing: the client (`client`), the CRD types of Cilium's policy kinds (`crd`),
//! the policy status writer (`status`) and this node's annotations (`node`). The in-memory API
//! server the tests use is a crate of its own (`crates/test-apiserver`). The watchers themselves are `actors::kube_watcher`.

pub mod client;
pub mod crd;
pub mod node;
pub mod status;
