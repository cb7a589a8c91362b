//! Kubernetes plumbing: the in-memory test API server (`apiserver`) and the CRD types of
//! Cilium's policy kinds (`crd`).

pub mod apiserver;
pub mod crd;
