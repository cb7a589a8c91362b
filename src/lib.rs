//! ciliate: a Kubernetes network-policy agent with Cilium-compatible semantics.
//!
//! See `ARCHITECTURE.md` for the code map. The library holds the pure parts (the policy engine
//! in [`policy`], the simulator in [`simulate`]); `src/main.rs` is the command line.

pub mod actors;
pub mod agent;
pub mod api;
pub mod cli;
pub mod client;
pub mod datapath;
pub mod k8s;
pub mod policy;
pub mod simulate;
