//! ciliate: a Kubernetes network-policy agent with Cilium-compatible semantics.
//!
//! See `ARCHITECTURE.md` for the code map. The library holds the pure parts (the policy engine
//! in [`policy`], the simulator in [`simulate`]); `src/main.rs` is the command line.

pub mod actors;
pub mod agent;
pub mod api;
pub mod cli;
pub mod client;
pub mod cni;
pub mod config;
pub mod datapath;
pub mod demo;
pub mod endpoint;
pub mod hashing;
pub mod hubble;
pub mod introspect;
pub mod ipam;
pub mod k8s;
pub mod kinds;
pub mod limits;
pub mod manifests;
pub mod memory;
pub mod metrics;
pub mod network;
pub mod objects;
pub mod policy;
pub mod proxy;
pub mod runtime;
pub mod services;
pub mod simulate;
pub mod traffic;
