//! An endpoint's regeneration bookkeeping as a pure state machine (kube-runtime's `watcher`
//! `State`/`step` style): which policy revision is wanted and which is realized, whether a
//! regeneration is queued, and what a failure does. `EndpointActor` feeds it every message as an
//! [`Event`] and carries out the [`Action`]s it returns (queue a regeneration, compute and sync
//! the policy, report to the reaction tracker); the rules themselves are tested here, without
//! actors or a datapath.

use std::time::Duration;

/// The first retry after a failed regeneration; each further failure doubles it.
pub const FIRST_RETRY: Duration = Duration::from_millis(500);
/// The longest wait between retries.
pub const MAX_RETRY: Duration = Duration::from_secs(30);

/// Where an endpoint is in its life (`ciliate endpoint list`'s STATE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointState {
    /// No identity yet (no Pod object): nothing to enforce beyond the drop-all start.
    WaitingForIdentity,
    Ready,
    Regenerating,
    /// The last regeneration failed: the endpoint fails closed until one succeeds.
    NotReady,
    /// Being deleted: nothing more is scheduled.
    Disconnecting,
}

impl EndpointState {
    pub fn as_str(&self) -> &'static str {
        match self {
            EndpointState::WaitingForIdentity => "waiting-for-identity",
            EndpointState::Ready => "ready",
            EndpointState::Regenerating => "regenerating",
            EndpointState::NotReady => "not-ready",
            EndpointState::Disconnecting => "disconnecting",
        }
    }
}

/// What happened to the endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The reaction tracker asks for `revision` (`force`: even if it is realized already).
    Requested { revision: u64, force: bool },
    /// A policy change that does not affect the endpoint reached `revision`.
    Bumped { revision: u64 },
    /// The identity or the named ports changed; `has_identity` is the state after the change.
    IdentityChanged { has_identity: bool },
    /// The queued regeneration is due.
    Due,
    /// The datapath realized the policy of `revision`.
    Realized { revision: u64 },
    /// The datapath refused the policy of `revision`.
    Failed { revision: u64, error: String },
    /// The endpoint is being deleted (or the agent stops).
    Disconnect,
}

/// What the actor must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Queue a regeneration now.
    Queue,
    /// Queue one after this delay (a retry after a failure).
    QueueAfter(Duration),
    /// Compute the policy and sync it to the datapath; `replace`: rewrite the whole map.
    Compute { replace: bool },
    /// Tell the reaction tracker the endpoint is done with `revision` (`ok`: realized).
    Report { revision: u64, ok: bool },
}

/// See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Regeneration {
    pub state: EndpointState,
    pub has_identity: bool,
    /// The newest revision asked for.
    pub wanted: u64,
    /// The newest revision the datapath holds (or that did not concern the endpoint).
    pub realized: u64,
    /// Regenerate even at a realized revision: the identity changed, or a failure is pending.
    pub dirty: bool,
    /// A regeneration is queued or running.
    pub queued: bool,
    /// The datapath's map is not known to match what was realized (the first sync, after a
    /// failure): the next sync replaces it whole.
    pub needs_replace: bool,
    pub retry_delay: Duration,
    /// Regenerations finished, either way.
    pub regenerations: u64,
    pub error: Option<String>,
}

impl Regeneration {
    pub fn new(has_identity: bool) -> Regeneration {
        Regeneration {
            state: if has_identity {
                EndpointState::Ready
            } else {
                EndpointState::WaitingForIdentity
            },
            has_identity,
            wanted: 0,
            realized: 0,
            dirty: true,
            queued: false,
            needs_replace: true,
            retry_delay: FIRST_RETRY,
            regenerations: 0,
            error: None,
        }
    }

    /// Whether nothing is queued or owed: the realized revision is the wanted one.
    fn idle(&self) -> bool {
        !self.queued && !self.dirty && self.wanted <= self.realized
    }

    /// Queues a regeneration when one is owed and none is queued.
    fn queue(&mut self) -> Vec<Action> {
        if self.queued || !self.has_identity || self.state == EndpointState::Disconnecting {
            return vec![];
        }
        if self.dirty || self.wanted > self.realized {
            self.queued = true;
            return vec![Action::Queue];
        }
        vec![]
    }

    /// Applies one event; returns what to do, in order.
    pub fn step(&mut self, event: Event) -> Vec<Action> {
        match event {
            Event::Requested { revision, force } => {
                self.wanted = self.wanted.max(revision);
                self.dirty |= force;
                if self.idle() {
                    // Coalesced into an earlier regeneration that already saw this revision.
                    return vec![Action::Report {
                        revision: self.realized,
                        ok: true,
                    }];
                }
                let mut out = self.queue();
                if !self.has_identity {
                    // Nothing to enforce yet; do not hold up the change.
                    out.push(Action::Report { revision, ok: true });
                }
                out
            }
            Event::Bumped { revision } => {
                // With a regeneration owed, that regeneration reads a revision >= this one.
                if self.idle() && self.state == EndpointState::Ready {
                    self.realized = self.realized.max(revision);
                    self.wanted = self.realized;
                }
                vec![]
            }
            Event::IdentityChanged { has_identity } => {
                self.has_identity = has_identity;
                self.dirty = true;
                if !has_identity {
                    self.state = EndpointState::WaitingForIdentity;
                } else if self.state == EndpointState::WaitingForIdentity {
                    self.state = EndpointState::Ready;
                }
                vec![]
            }
            Event::Due => {
                if self.state == EndpointState::Disconnecting {
                    return vec![];
                }
                if !self.has_identity {
                    self.queued = false;
                    self.state = EndpointState::WaitingForIdentity;
                    return vec![];
                }
                self.state = EndpointState::Regenerating;
                self.dirty = false;
                vec![Action::Compute {
                    replace: self.needs_replace,
                }]
            }
            Event::Realized { revision } => {
                self.queued = false;
                self.regenerations += 1;
                self.realized = self.realized.max(revision);
                self.needs_replace = false;
                self.error = None;
                if self.state != EndpointState::Disconnecting {
                    self.state = EndpointState::Ready;
                }
                self.retry_delay = FIRST_RETRY;
                let mut out = vec![Action::Report {
                    revision: self.realized,
                    ok: true,
                }];
                out.extend(self.queue());
                out
            }
            Event::Failed { revision, error } => {
                self.regenerations += 1;
                self.error = Some(error);
                if self.state != EndpointState::Disconnecting {
                    self.state = EndpointState::NotReady;
                }
                self.needs_replace = true;
                self.dirty = true;
                let report = Action::Report {
                    revision,
                    ok: false,
                };
                // Retry with backoff: a later policy may fit.
                let delay = self.retry_delay;
                self.retry_delay = (self.retry_delay * 2).min(MAX_RETRY);
                self.queued = true;
                vec![report, Action::QueueAfter(delay)]
            }
            Event::Disconnect => {
                self.state = EndpointState::Disconnecting;
                vec![]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn requested(revision: u64, force: bool) -> Event {
        Event::Requested { revision, force }
    }

    fn report(revision: u64, ok: bool) -> Action {
        Action::Report { revision, ok }
    }

    fn ready_at(revision: u64) -> Regeneration {
        let mut r = Regeneration::new(true);
        r.step(Event::Requested {
            revision,
            force: true,
        });
        r.step(Event::Due);
        r.step(Event::Realized { revision });
        r
    }

    #[test]
    fn a_new_endpoint_queues_one_full_sync_and_reports_it() {
        let mut r = Regeneration::new(true);
        assert_eq!(r.step(requested(3, true)), vec![Action::Queue]);
        // A second request while queued joins the same regeneration.
        assert_eq!(r.step(requested(4, false)), vec![]);
        assert_eq!(r.step(Event::Due), vec![Action::Compute { replace: true }]);
        assert_eq!(r.state, EndpointState::Regenerating);
        // It computed with the engine at revision 4: nothing more is owed.
        assert_eq!(
            r.step(Event::Realized { revision: 4 }),
            vec![report(4, true)]
        );
        assert_eq!(
            (r.state, r.realized, r.queued),
            (EndpointState::Ready, 4, false)
        );
        assert!(!r.needs_replace, "later syncs send deltas");
    }

    #[test]
    fn a_request_for_a_realized_revision_is_answered_at_once() {
        let mut r = ready_at(5);
        assert_eq!(r.step(requested(5, false)), vec![report(5, true)]);
        // Forced (an identity change), the same revision regenerates.
        assert_eq!(r.step(requested(5, true)), vec![Action::Queue]);
    }

    #[test]
    fn a_newer_request_during_a_regeneration_queues_another_after_it() {
        let mut r = ready_at(1);
        r.step(requested(2, false));
        r.step(Event::Due);
        // Revision 3 arrives while revision 2 is computed: the queue flag holds it.
        assert_eq!(r.step(requested(3, false)), vec![]);
        assert_eq!(
            r.step(Event::Realized { revision: 2 }),
            vec![report(2, true), Action::Queue]
        );
    }

    #[test]
    fn failures_fail_closed_retry_with_doubling_backoff_and_replace_the_map() {
        let mut r = ready_at(1);
        r.step(requested(2, false));
        r.step(Event::Due);
        let mut delays = Vec::new();
        for _ in 0..8 {
            let out = r.step(Event::Failed {
                revision: 2,
                error: "map full".into(),
            });
            assert_eq!(out[0], report(2, false));
            let Action::QueueAfter(d) = out[1] else {
                panic!("a retry is queued: {out:?}")
            };
            delays.push(d.as_millis());
            assert_eq!(r.state, EndpointState::NotReady);
            assert_eq!(r.step(Event::Due), vec![Action::Compute { replace: true }]);
        }
        assert_eq!(delays, [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000]);
        r.step(Event::Realized { revision: 2 });
        assert_eq!(
            (r.state, r.error.clone(), r.retry_delay),
            (EndpointState::Ready, None, FIRST_RETRY)
        );
    }

    #[test]
    fn bumps_move_only_an_idle_ready_endpoint() {
        let mut r = ready_at(1);
        r.step(Event::Bumped { revision: 7 });
        assert_eq!((r.realized, r.wanted), (7, 7));
        // Owed a regeneration: the bump waits for it.
        r.step(requested(8, false));
        r.step(Event::Bumped { revision: 9 });
        assert_eq!(r.realized, 7);
    }

    #[test]
    fn without_an_identity_nothing_is_computed_and_changes_are_not_held_up() {
        let mut r = Regeneration::new(false);
        assert_eq!(r.state, EndpointState::WaitingForIdentity);
        assert_eq!(r.step(requested(2, true)), vec![report(2, true)]);
        r.step(Event::IdentityChanged { has_identity: true });
        assert_eq!(r.state, EndpointState::Ready);
        assert_eq!(r.step(requested(2, true)), vec![Action::Queue]);
        // The identity goes before the regeneration runs: it does not run.
        r.step(Event::IdentityChanged {
            has_identity: false,
        });
        assert_eq!(r.step(Event::Due), vec![]);
        assert_eq!(
            (r.state, r.queued),
            (EndpointState::WaitingForIdentity, false)
        );
    }

    #[test]
    fn a_disconnecting_endpoint_schedules_nothing() {
        let mut r = ready_at(1);
        r.step(Event::Disconnect);
        assert_eq!(r.step(requested(2, true)), vec![]);
        assert_eq!(r.step(Event::Due), vec![]);
        assert_eq!(r.state, EndpointState::Disconnecting);
    }
}
