//! The agent's actors (actix). Each file holds one actor and the messages it receives; the
//! handlers are thin and call the pure libraries (`policy`, `datapath`, `endpoint::state`).
//! Every message travels in a `Traced` envelope (see `introspect`).
//!
//! ```text
//! WatcherActor --PolicyUpsert/PodUpsert/...--> PolicyRepoActor --PolicyReaction--> RuleReactionActor
//!      RuleReactionActor --Regenerate/BumpRevision--> EndpointActor (one per endpoint)
//!      EndpointActor --SyncPolicyMap--> LoaderActor (owns the Datapath)
//!      EndpointActor --EndpointRealized--> RuleReactionActor --UpdateIpcache--> LoaderActor
//! ```

pub mod endpoint;
pub mod feed;
pub mod kube_watcher;
pub mod loader;
pub mod policy_repo;
pub mod rule_reaction;
pub mod watcher;
pub mod workers;
