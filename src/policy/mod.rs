//! The pure policy engine: Cilium-compatible network policy semantics with no I/O.
//!
//! Invariant: nothing in this module tree imports actix, kube, libbpf or does I/O. The agent's
//! actors, the simulator and the datapath all call into it.
//!
//! Flow: a manifest document goes through [`translate::parse_policy`] (validation, namespace
//! scoping, entities/CIDRs/KNP peers turned into selectors) into a [`translate::ParsedPolicy`];
//! [`engine::PolicyEngine::upsert_policy`] stores it in the [`repository::Repository`], registers its
//! selectors in the [`selector_cache::SelectorCache`] and its CIDRs as identities; and
//! [`engine::PolicyEngine::resolve`] turns the rules selecting one endpoint into a
//! [`mapstate::MapState`] whose lookups decide traffic and explain the decision.

pub mod api;
pub mod attribution;
pub mod engine;
pub mod fqdn;
pub mod fqdn_bounds;
pub mod identity;
pub mod ipcache;
pub mod l7;
pub mod labels;
pub mod mapstate;
pub mod node_classes;
pub mod numbering;
pub mod repository;
pub mod rule;
pub mod selector;
pub mod selector_cache;
pub mod services;
pub mod staged;
pub mod status;
pub mod tier_memo;
pub mod tier_networks;
pub mod tiers;
pub mod translate;

pub use engine::{Decision, EndpointPolicy, EndpointView, NamedPort, PolicyChange, PolicyEngine};
pub use identity::NumericIdentity;
pub use labels::{Label, Labels};
pub use rule::{Direction, PolicyKey, PolicyKind};
pub use translate::{parse_policy, ParsedPolicy, PolicyError};
