//! Kubernetes plumbing: the client (`client`), the in-memory test API server (`apiserver`), the
//! CRD types of Cilium's policy kinds (`crd`), the policy status writer (`status`) and this
//! node's annotations (`node`). The watchers themselves are `actors::kube_watcher`.

pub mod apiserver;
pub mod client;
pub mod crd;
pub mod node;
pub mod status;
