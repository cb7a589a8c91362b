//! Kubernetes plumbing: the in-memory test API server (`apiserver`).

pub mod apiserver;
