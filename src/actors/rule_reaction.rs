//! `RuleReactionActor`: Cilium's `RuleReactionQueue` / `reactToRuleUpdates`. Fans a policy
//! change out to the endpoints (`Regenerate` to the affected ones, `BumpRevision` to the rest)
//! in the order changes were accepted, tracks until every affected endpoint realized it (the
//! implementation delay), and only then releases the change's ipcache updates to the datapath, so
//! that traffic from a new identity is never classified before the policy that admits it exists.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::Instant;

use actix::{Actor, Context, Handler, Message};

use super::endpoint::{BumpRevision, EndpointActor, Regenerate};
use super::loader::{IpcacheChange, LoaderActor, UpdateIpcache};
use crate::agent::introspect::{Traceable, TracedAddr};
use crate::agent::Shared;
use crate::datapath::EndpointId;
use crate::traced_actor;

const NAME: &str = "RuleReactionActor";

/// An endpoint as the reaction sees it.
pub type EndpointHandle = (EndpointId, TracedAddr<EndpointActor>);

struct Pending {
    revision: u64,
    accepted_at: Instant,
    waiting: HashSet<EndpointId>,
    ipcache: Vec<IpcacheChange>,
    observe_delay: bool,
    set_ready: bool,
}

pub struct RuleReactionActor {
    shared: Shared,
    loader: TracedAddr<LoaderActor>,
    pending: BTreeMap<u64, Pending>,
    next_seq: u64,
}

impl RuleReactionActor {
    pub fn new(shared: Shared, loader: TracedAddr<LoaderActor>) -> Self {
        RuleReactionActor {
            shared,
            loader,
            pending: BTreeMap::new(),
            next_seq: 0,
        }
    }

    fn complete(&mut self, seq: u64) {
        let Some(p) = self.pending.remove(&seq) else {
            return;
        };
        if p.observe_delay {
            self.shared
                .metrics
                .policy_implementation_delay
                .observe(p.accepted_at.elapsed().as_secs_f64());
        }
        if !p.ipcache.is_empty() {
            self.loader
                .do_send(UpdateIpcache { changes: p.ipcache }, NAME);
        }
        if p.set_ready {
            self.shared.ready.store(true, Ordering::SeqCst);
            tracing::info!(
                revision = p.revision,
                "initial policy realized on every endpoint; ready"
            );
        }
    }
}

impl Actor for RuleReactionActor {
    type Context = Context<Self>;
}
traced_actor!(RuleReactionActor: PolicyReaction, EndpointRealized, EndpointGone);

/// What a change means for the endpoints (sent by `PolicyRepoActor`).
#[derive(Message)]
#[rtype(result = "()")]
pub struct PolicyReaction {
    pub revision: u64,
    pub accepted_at: Instant,
    /// Why, for the endpoints' journals: `policy x/allow`, `pod x/a labels`, ...
    pub reason: String,
    pub to_regenerate: Vec<EndpointHandle>,
    pub to_bump: Vec<EndpointHandle>,
    /// Regenerate even if the endpoint realized `revision` already (identity changes do not bump
    /// the revision).
    pub force: bool,
    /// Released to the datapath once every endpoint in `to_regenerate` realized the change.
    pub ipcache: Vec<IpcacheChange>,
    /// A policy change: observe `policy_implementation_delay` when done.
    pub observe_delay: bool,
    /// The initial sync: report ready when done.
    pub set_ready: bool,
}

impl Traceable for PolicyReaction {
    const KIND: &'static str = "PolicyReaction";
    fn summary(&self) -> String {
        format!(
            "rev {}, {}: regenerate {}, bump {}, ipcache {}",
            self.revision,
            self.reason,
            self.to_regenerate.len(),
            self.to_bump.len(),
            self.ipcache.len()
        )
    }
}

impl Handler<PolicyReaction> for RuleReactionActor {
    type Result = ();
    fn handle(&mut self, msg: PolicyReaction, _: &mut Context<Self>) {
        self.next_seq += 1;
        let seq = self.next_seq;
        for (_, addr) in &msg.to_regenerate {
            addr.do_send(
                Regenerate {
                    revision: msg.revision,
                    reason: msg.reason.clone(),
                    force: msg.force,
                },
                NAME,
            );
        }
        for (_, addr) in &msg.to_bump {
            addr.do_send(
                BumpRevision {
                    revision: msg.revision,
                },
                NAME,
            );
        }
        self.pending.insert(
            seq,
            Pending {
                revision: msg.revision,
                accepted_at: msg.accepted_at,
                waiting: msg.to_regenerate.iter().map(|(id, _)| *id).collect(),
                ipcache: msg.ipcache,
                observe_delay: msg.observe_delay,
                set_ready: msg.set_ready,
            },
        );
        if self.pending.get(&seq).is_some_and(|p| p.waiting.is_empty()) {
            self.complete(seq);
        }
    }
}

/// An endpoint finished a regeneration (or a revision bump) at `revision`.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct EndpointRealized {
    pub id: EndpointId,
    pub revision: u64,
    /// False when the regeneration failed: the endpoint stops counting as pending, without a
    /// delay observation.
    pub ok: bool,
}

impl Traceable for EndpointRealized {
    const KIND: &'static str = "EndpointRealized";
    fn summary(&self) -> String {
        format!(
            "endpoint {}, rev {}{}",
            self.id,
            self.revision,
            if self.ok { "" } else { ", failed" }
        )
    }
}

impl Handler<EndpointRealized> for RuleReactionActor {
    type Result = ();
    fn handle(&mut self, msg: EndpointRealized, _: &mut Context<Self>) {
        let done: Vec<u64> = self
            .pending
            .iter_mut()
            .filter(|(_, p)| p.revision <= msg.revision || !msg.ok)
            .filter_map(|(seq, p)| {
                (p.waiting.remove(&msg.id) && p.waiting.is_empty()).then_some(*seq)
            })
            .collect();
        for seq in done {
            self.complete(seq);
        }
    }
}

/// An endpoint went away: nothing waits for it any more.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct EndpointGone {
    pub id: EndpointId,
}

impl Traceable for EndpointGone {
    const KIND: &'static str = "EndpointGone";
    fn summary(&self) -> String {
        format!("endpoint {}", self.id)
    }
}

impl Handler<EndpointGone> for RuleReactionActor {
    type Result = ();
    fn handle(&mut self, msg: EndpointGone, ctx: &mut Context<Self>) {
        self.handle(
            EndpointRealized {
                id: msg.id,
                revision: u64::MAX,
                ok: false,
            },
            ctx,
        );
    }
}
