//! `RuleReactionActor`: Cilium's `RuleReactionQueue` / `reactToRuleUpdates`. Fans a policy
//! change out to the endpoints (`Regenerate` to the affected ones, `BumpRevision` to the rest)
//! in the order changes were accepted, tracks until every affected endpoint realized it (the
//! implementation delay), and only then releases the change's ipcache updates to the datapath, so
//! that traffic from a new identity is never classified before the policy that admits it exists.
//!
//! Coalescing. Endpoints always compute from the engine's newest revision, so one regeneration
//! covers every change accepted before it starts. This actor exploits that twice:
//! - a change that finds the endpoints idle (nothing held, no regeneration in flight, or none
//!   sent for `QUIET`) goes out at once; the changes that follow while its fan-out runs are
//!   held until none came for `QUIET` (at most `MAX_HOLD` after the first held one) and go out
//!   as one fan-out. A lone change waits for nothing; a burst costs one round more than it
//!   would with a window only (its first change goes out alone);
//! - at most one `Regenerate` is in flight per endpoint; a change that arrives while one is
//!   running is re-sent when it reports back.
//!
//! Messages and regenerations are thereby bounded by rounds, not by edits x endpoints. The
//! bookkeeping of what each endpoint is sent is pure (`endpoint::fanout`, tested against the
//! endpoints' own state machine); this actor adds the window, the pending changes and their
//! ipcache updates.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use actix::{Actor, AsyncContext, Context, Handler, Message, SpawnHandle};

use super::endpoint::{BumpRevision, EndpointActor, EndpointGone, EndpointRealized, Regenerate};
use super::loader::{Barrier, IpcacheChange, LoaderActor, UpdateIpcache};
use crate::datapath::EndpointId;
use crate::endpoint::fanout::{self, Fanout, Send};
use crate::introspect::{current_change, with_change, ChangeId, TracedAddr};
use crate::runtime::Shared;
use crate::traced_actor;

const NAME: &str = "RuleReactionActor";

/// Fan out once no change arrived for this long...
pub const QUIET: Duration = Duration::from_millis(10);
/// ...or at the latest this long after the first change being held.
pub const MAX_HOLD: Duration = Duration::from_millis(1000);

/// An endpoint as the reaction sees it.
pub type EndpointHandle = (EndpointId, TracedAddr<EndpointActor>);

struct Pending {
    revision: u64,
    reason: String,
    endpoints: usize,
    accepted_at: Instant,
    waiting: HashSet<EndpointId>,
    /// Endpoints that reported a failed regeneration for this change.
    failed: usize,
    ipcache: Vec<IpcacheChange>,
    observe_delay: bool,
    set_ready: bool,
    release_memory: bool,
}

pub struct RuleReactionActor {
    shared: Shared,
    loader: TracedAddr<LoaderActor>,
    pending: BTreeMap<u64, Pending>,
    next_seq: u64,
    /// Regenerations and bumps gathered, in flight, and owed (`endpoint::fanout`).
    fanout: Fanout<TracedAddr<EndpointActor>, ChangeId>,
    window: Option<(SpawnHandle, Instant)>,
    /// When the last fan-out went out (the leading edge's quiet spell is measured from it).
    last_flush: Option<Instant>,
    /// Waiters (a DNS answer held by the proxy) told once every change up to theirs is in the
    /// datapath, ipcache included: (sequence, sender).
    waiters: Vec<(u64, tokio::sync::oneshot::Sender<()>)>,
}

impl RuleReactionActor {
    pub fn new(shared: Shared, loader: TracedAddr<LoaderActor>) -> Self {
        RuleReactionActor {
            shared,
            loader,
            pending: BTreeMap::new(),
            next_seq: 0,
            fanout: Fanout::default(),
            window: None,
            last_flush: None,
            waiters: Vec::new(),
        }
    }

    /// Tells the waiters whose changes, and every earlier one, completed. The loader applies
    /// messages in order, so its `Barrier` fires after the ipcache updates sent before it.
    fn release_waiters(&mut self) {
        let floor = self.pending.keys().next().copied().unwrap_or(u64::MAX);
        let (ready, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiters)
            .into_iter()
            .partition(|(seq, _)| *seq < floor);
        self.waiters = keep;
        for (_, done) in ready {
            self.loader.do_send(Barrier { done }, NAME);
        }
    }

    fn complete(&mut self, seq: u64) {
        let Some(p) = self.pending.remove(&seq) else {
            return;
        };
        if p.observe_delay {
            self.shared
                .record_implementation(crate::runtime::Implementation {
                    revision: p.revision,
                    reason: p.reason,
                    endpoints: p.endpoints,
                    seconds: p.accepted_at.elapsed().as_secs_f64(),
                });
        }
        self.shared
            .report_policy(crate::k8s::status::PolicyStatusEvent::Realized {
                revision: p.revision,
                all_ok: p.failed == 0,
                initial: p.set_ready,
            });
        if !p.ipcache.is_empty() {
            self.loader
                .do_send(UpdateIpcache { changes: p.ipcache }, NAME);
        }
        if p.release_memory && !p.set_ready {
            crate::memory::release_free_memory();
        }
        if p.set_ready {
            // The initial sync's transient objects (watch pages, converted copies) are freed:
            // hand the memory back to the system rather than keep it as the agent's RSS.
            crate::memory::release_free_memory();
            self.shared.bootstrap.ready(&self.shared.metrics);
            self.shared.ready.store(true, Ordering::SeqCst);
            tracing::info!(
                revision = p.revision,
                "initial policy realized on every endpoint; ready"
            );
        }
    }

    /// Carries out one of the fan-out's messages.
    fn send(&self, s: Send<TracedAddr<EndpointActor>, ChangeId>) {
        match s {
            Send::Regenerate(_, w) => {
                let msg = Regenerate {
                    revision: w.revision,
                    reason: w.reason,
                    force: w.force,
                    peers: w.peers,
                };
                with_change(w.change, || w.addr.do_send(msg, NAME));
            }
            Send::Bump(_, b) => {
                let msg = BumpRevision {
                    revision: b.revision,
                };
                with_change(b.change, || b.addr.do_send(msg, NAME));
            }
        }
    }

    /// Ends the window: one message per endpoint.
    fn flush(&mut self) {
        self.window = None;
        self.last_flush = Some(Instant::now());
        for s in self.fanout.flush() {
            self.send(s);
        }
    }

    fn endpoints_idle(&self) -> bool {
        goes_out_at_once(
            self.window.is_some(),
            self.fanout.in_flight(),
            self.last_flush,
            Instant::now(),
        )
    }

    fn arm(&mut self, ctx: &mut Context<Self>) {
        let now = Instant::now();
        let first = match self.window.take() {
            Some((handle, first)) => {
                ctx.cancel_future(handle);
                first
            }
            None => now,
        };
        let fire = (now + QUIET).min(first + MAX_HOLD);
        let handle = ctx.run_later(fire.saturating_duration_since(now), |act, _| act.flush());
        self.window = Some((handle, first));
    }
}

/// The leading edge: whether a change that arrives `now` goes out at once. It does when
/// nothing is held and the endpoints are idle: no regeneration in flight, or none sent for
/// `QUIET` (a long regeneration in flight does not hold later changes back).
fn goes_out_at_once(
    held: bool,
    in_flight: usize,
    last_flush: Option<Instant>,
    now: Instant,
) -> bool {
    !held && (in_flight == 0 || last_flush.is_none_or(|t| now.duration_since(t) >= QUIET))
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
    /// A large policy went or was replaced: once the endpoints dropped their old policies,
    /// hand the freed heap back to the system (`memory::release_free_memory`).
    pub release_memory: bool,
    /// Only these peer identities' selections changed: endpoints may update incrementally.
    pub peers: Option<std::collections::BTreeSet<crate::policy::identity::NumericIdentity>>,
    /// Fan out at once, without the quiet window (a DNS answer waits for it).
    pub immediate: bool,
    /// Told when this change and every earlier one are in the datapath.
    pub done: Option<tokio::sync::oneshot::Sender<()>>,
}

crate::traceable!(PolicyReaction, "PolicyReaction", |m| {
    format!(
        "rev {}, {}: regenerate {}, bump {}, ipcache {}",
        m.revision,
        m.reason,
        m.to_regenerate.len(),
        m.to_bump.len(),
        m.ipcache.len()
    )
});

impl Handler<PolicyReaction> for RuleReactionActor {
    type Result = ();
    fn handle(&mut self, msg: PolicyReaction, ctx: &mut Context<Self>) {
        let immediate = msg.immediate;
        self.gather(&msg);
        self.track(msg);
        self.release_waiters();
        if immediate || self.endpoints_idle() {
            if let Some((handle, _)) = self.window.take() {
                ctx.cancel_future(handle);
            }
            self.flush();
        } else if self.fanout.holds() {
            self.arm(ctx);
        }
    }
}

impl RuleReactionActor {
    /// Adds a reaction's endpoints to what the next fan-out sends.
    fn gather(&mut self, msg: &PolicyReaction) {
        self.fanout.gather(&fanout::Reaction {
            revision: msg.revision,
            force: msg.force,
            reason: &msg.reason,
            change: current_change(),
            peers: &msg.peers,
            to_regenerate: &msg.to_regenerate,
            to_bump: &msg.to_bump,
        });
    }

    /// Records a reaction as pending until its endpoints realized it (at once when none must).
    fn track(&mut self, msg: PolicyReaction) {
        self.next_seq += 1;
        let seq = self.next_seq;
        self.pending.insert(
            seq,
            Pending {
                revision: msg.revision,
                reason: msg.reason,
                endpoints: msg.to_regenerate.len(),
                accepted_at: msg.accepted_at,
                waiting: msg.to_regenerate.iter().map(|(id, _)| *id).collect(),
                failed: 0,
                ipcache: msg.ipcache,
                observe_delay: msg.observe_delay,
                set_ready: msg.set_ready,
                release_memory: msg.release_memory,
            },
        );
        if let Some(done) = msg.done {
            self.waiters.push((seq, done));
        }
        if self.pending.get(&seq).is_some_and(|p| p.waiting.is_empty()) {
            self.complete(seq);
        }
    }
}

impl Handler<EndpointRealized> for RuleReactionActor {
    type Result = ();
    fn handle(&mut self, msg: EndpointRealized, _: &mut Context<Self>) {
        if let Some(s) = self.fanout.realized(msg.id, msg.revision) {
            self.send(s);
        }
        let done: Vec<u64> = self
            .pending
            .iter_mut()
            .filter(|(_, p)| p.revision <= msg.revision || !msg.ok)
            .filter_map(|(seq, p)| {
                let was_waiting = p.waiting.remove(&msg.id);
                if was_waiting && !msg.ok {
                    p.failed += 1;
                }
                (was_waiting && p.waiting.is_empty()).then_some(*seq)
            })
            .collect();
        for seq in done {
            self.complete(seq);
        }
        self.release_waiters();
    }
}

impl Handler<EndpointGone> for RuleReactionActor {
    type Result = ();
    fn handle(&mut self, msg: EndpointGone, ctx: &mut Context<Self>) {
        self.fanout.gone(msg.id);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_to_idle_endpoints_goes_out_at_once_and_a_burst_is_held() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        // The first change: nothing held, nothing in flight.
        assert!(goes_out_at_once(false, 0, None, t0));
        // Back to back after the last one was realized (nothing in flight): at once too.
        assert!(goes_out_at_once(false, 0, Some(t0), ms(1)));
        // While its fan-out runs: held, and once held, later ones join the held window.
        assert!(!goes_out_at_once(false, 1000, Some(t0), ms(1)));
        assert!(!goes_out_at_once(true, 1000, Some(t0), ms(5)));
        assert!(!goes_out_at_once(true, 0, Some(t0), ms(50)));
        // A regeneration in flight for longer than QUIET does not hold a lone change back.
        assert!(goes_out_at_once(false, 1000, Some(t0), t0 + QUIET));
    }
}
