//! The running agent: configuration, start-up, and the shared services the actors use
//! (introspection, metrics, endpoint state). The actors themselves live in `src/actors/`.

pub mod introspect;
pub mod metrics;
pub mod objects;
pub mod run;
pub mod state;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};

use crate::policy::engine::PolicyEngine;

/// Services every actor can reach.
#[derive(Clone)]
pub struct Shared {
    pub registry: Arc<introspect::Registry>,
    pub metrics: Arc<metrics::Metrics>,
    /// The policy engine. `PolicyRepoActor` is its only writer; endpoints read it to resolve
    /// their policy at the revision they observe.
    pub engine: Arc<RwLock<PolicyEngine>>,
    pub state_dir: state::StateDir,
    pub node_name: String,
    /// Initial sync done and every restored endpoint regenerated.
    pub ready: Arc<AtomicBool>,
}
