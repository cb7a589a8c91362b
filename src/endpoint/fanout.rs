//! What the reaction tracker (`RuleReactionActor`) sends each endpoint, as pure bookkeeping:
//! regenerations and revision bumps gathered in a window, at most one regeneration in flight
//! per endpoint, and what arrived for an endpoint while it regenerated sent when it reports.
//! The actor feeds it reactions and reports and carries out the [`Send`]s it returns; the rules
//! are tested here against the endpoints' own state machine (`regeneration`), without actors.
//!
//! Invariant (the test below drives random interleavings to check it): an endpoint is never
//! told a revision it has not computed when a change of that revision or an earlier one
//! affected it, and once the changes stop, every endpoint reaches the last revision.
//! Endpoints compute from the engine's newest revision, so one regeneration covers every
//! change accepted before it starts; a bump only moves an idle endpoint's realized revision
//! (`Event::Bumped`).
//!
//! Generic over the endpoint's address `A` and the change id `C` that messages carry.

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::datapath::EndpointId;
use crate::policy::identity::NumericIdentity;

/// A regeneration an endpoint was asked for and not yet sent.
#[derive(Debug, Clone)]
pub struct Want<A, C> {
    pub addr: A,
    pub revision: u64,
    pub force: bool,
    pub reason: String,
    /// The (latest) change that asked: the regeneration sent belongs to it.
    pub change: Option<C>,
    /// Only these peer identities' selections changed (`None`: anything may have).
    pub peers: Option<BTreeSet<NumericIdentity>>,
}

/// A bump an endpoint was owed and not yet sent.
#[derive(Debug, Clone)]
pub struct Bump<A, C> {
    pub addr: A,
    pub revision: u64,
    pub change: Option<C>,
}

/// One message for one endpoint.
#[derive(Debug, Clone)]
pub enum Send<A, C> {
    Regenerate(EndpointId, Want<A, C>),
    Bump(EndpointId, Bump<A, C>),
}

/// One reaction, as far as the endpoints are concerned.
pub struct Reaction<'a, A, C> {
    pub revision: u64,
    pub force: bool,
    pub reason: &'a str,
    pub change: Option<C>,
    pub peers: &'a Option<BTreeSet<NumericIdentity>>,
    pub to_regenerate: &'a [(EndpointId, A)],
    pub to_bump: &'a [(EndpointId, A)],
}

/// See the module documentation.
#[derive(Debug)]
pub struct Fanout<A, C> {
    /// Regenerations gathered in the current window.
    want: HashMap<EndpointId, Want<A, C>>,
    /// Bumps gathered in the current window (latest revision).
    bumps: HashMap<EndpointId, Bump<A, C>>,
    /// Endpoints with a regeneration sent and no report yet.
    in_flight: HashSet<EndpointId>,
    /// Requests that arrived while that endpoint's regeneration was in flight.
    again: HashMap<EndpointId, Want<A, C>>,
    /// Bumps that went out while that endpoint's regeneration was in flight (latest revision):
    /// sent when it reports, unless a regeneration from `again` covers them. Sent at once, a
    /// bump could land between that report and an `again` of an earlier revision and mark the
    /// endpoint realized past a change it never computed.
    again_bumps: HashMap<EndpointId, Bump<A, C>>,
}

impl<A, C> Default for Fanout<A, C> {
    fn default() -> Self {
        Fanout {
            want: HashMap::new(),
            bumps: HashMap::new(),
            in_flight: HashSet::new(),
            again: HashMap::new(),
            again_bumps: HashMap::new(),
        }
    }
}

impl<A: Clone, C: Copy> Fanout<A, C> {
    /// Adds a reaction's endpoints to what the next [`Self::flush`] sends.
    pub fn gather(&mut self, r: &Reaction<'_, A, C>) {
        for (id, addr) in r.to_regenerate {
            self.bumps.remove(id);
            let w = Want {
                addr: addr.clone(),
                revision: r.revision,
                force: r.force,
                reason: r.reason.to_string(),
                change: r.change,
                peers: r.peers.clone(),
            };
            merge(&mut self.want, *id, w);
        }
        // A bump is kept beside a held regeneration of an earlier revision: the endpoint may
        // have realized that revision already and answer the regeneration without computing,
        // and only the bump then brings it to this revision. (Sent after the regeneration, it
        // is ignored if the regeneration computes, which reads a newer revision anyway.)
        for (id, addr) in r.to_bump {
            let b = Bump {
                addr: addr.clone(),
                revision: r.revision,
                change: r.change,
            };
            self.bumps.insert(*id, b);
        }
    }

    /// Whether anything waits for the next flush.
    pub fn holds(&self) -> bool {
        !self.want.is_empty() || !self.bumps.is_empty()
    }

    /// How many endpoints have a regeneration in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Ends the window: at most one message per endpoint, regenerations first.
    pub fn flush(&mut self) -> Vec<Send<A, C>> {
        let mut out = Vec::with_capacity(self.want.len() + self.bumps.len());
        for (id, w) in std::mem::take(&mut self.want) {
            if self.in_flight.contains(&id) {
                merge(&mut self.again, id, w);
            } else {
                self.in_flight.insert(id);
                out.push(Send::Regenerate(id, w));
            }
        }
        for (id, b) in std::mem::take(&mut self.bumps) {
            if self.in_flight.contains(&id) {
                if self
                    .again_bumps
                    .get(&id)
                    .is_none_or(|old| old.revision < b.revision)
                {
                    self.again_bumps.insert(id, b);
                }
            } else {
                out.push(Send::Bump(id, b));
            }
        }
        out
    }

    /// An endpoint reported `revision`: what arrived for it while it regenerated goes out now,
    /// a regeneration (which reads the newest revision, so covers any bump) or else the bump.
    pub fn realized(&mut self, id: EndpointId, revision: u64) -> Option<Send<A, C>> {
        self.in_flight.remove(&id);
        let bump = self.again_bumps.remove(&id);
        if let Some(w) = self.again.remove(&id) {
            if w.force || w.revision > revision {
                self.in_flight.insert(id);
                return Some(Send::Regenerate(id, w));
            }
        }
        bump.filter(|b| b.revision > revision)
            .map(|b| Send::Bump(id, b))
    }

    /// The endpoint went away: nothing more is sent to it.
    pub fn gone(&mut self, id: EndpointId) {
        self.want.remove(&id);
        self.bumps.remove(&id);
        self.again.remove(&id);
        self.again_bumps.remove(&id);
        self.in_flight.remove(&id);
    }
}

fn merge<A, C: Copy>(map: &mut HashMap<EndpointId, Want<A, C>>, id: EndpointId, w: Want<A, C>) {
    match map.get_mut(&id) {
        Some(e) => {
            e.revision = e.revision.max(w.revision);
            e.force |= w.force;
            e.reason = w.reason;
            e.change = w.change.or(e.change);
            e.peers = match (e.peers.take(), w.peers) {
                (Some(mut a), Some(b)) => {
                    a.extend(b);
                    Some(a)
                }
                _ => None,
            };
        }
        None => {
            map.insert(id, w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::regeneration::{Action, Event, Regeneration};
    use std::collections::VecDeque;

    /// A small deterministic generator (xorshift), so that a failure names its seed.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Messages to an endpoint (its mailbox is FIFO) and from it (reports).
    #[derive(Debug, Clone)]
    enum ToEndpoint {
        Regenerate(u64, bool),
        Bump(u64),
        /// Its own queued regeneration is due (`DoRegenerate`).
        Due,
        /// Its computation finished; it read revision `.0` when it started.
        Computed(u64),
    }

    struct Endpoint {
        regen: Regeneration,
        mailbox: VecDeque<ToEndpoint>,
        /// What it does for itself (`Due`, `Computed`), interleaved with the mailbox at random.
        own: VecDeque<ToEndpoint>,
        /// The revisions whose changes affected it.
        affected: BTreeSet<u64>,
        /// The revision its last computation read.
        computed: u64,
    }

    struct World {
        rng: Rng,
        revision: u64,
        fanout: Fanout<(), u64>,
        endpoints: Vec<Endpoint>,
        reports: VecDeque<(EndpointId, u64)>,
        seed: u64,
    }

    impl World {
        fn new(seed: u64, n: usize) -> World {
            let endpoints = (0..n)
                .map(|_| {
                    let mut regen = Regeneration::new(true);
                    // Realized at revision 0, as after the initial sync.
                    regen.step(Event::Requested {
                        revision: 0,
                        force: false,
                    });
                    regen.step(Event::Due);
                    regen.step(Event::Realized { revision: 0 });
                    Endpoint {
                        regen,
                        mailbox: VecDeque::new(),
                        own: VecDeque::new(),
                        affected: BTreeSet::new(),
                        computed: 0,
                    }
                })
                .collect();
            World {
                rng: Rng(seed | 1),
                revision: 0,
                fanout: Fanout::default(),
                endpoints,
                reports: VecDeque::new(),
                seed,
            }
        }

        fn send(&mut self, s: Send<(), u64>) {
            match s {
                Send::Regenerate(id, w) => self.endpoints[id as usize]
                    .mailbox
                    .push_back(ToEndpoint::Regenerate(w.revision, w.force)),
                Send::Bump(id, b) => self.endpoints[id as usize]
                    .mailbox
                    .push_back(ToEndpoint::Bump(b.revision)),
            }
        }

        /// A policy change: a new revision, some endpoints affected, the others bumped.
        fn change(&mut self) {
            self.revision += 1;
            let (mut regen, mut bump) = (Vec::new(), Vec::new());
            for id in 0..self.endpoints.len() {
                if self.rng.below(3) == 0 {
                    self.endpoints[id].affected.insert(self.revision);
                    regen.push((id as EndpointId, ()));
                } else {
                    bump.push((id as EndpointId, ()));
                }
            }
            let peers = None;
            self.fanout.gather(&Reaction {
                revision: self.revision,
                force: false,
                reason: "change",
                change: Some(self.revision),
                peers: &peers,
                to_regenerate: &regen,
                to_bump: &bump,
            });
        }

        fn flush(&mut self) {
            for s in self.fanout.flush() {
                self.send(s);
            }
        }

        /// One endpoint handles the first message of its mailbox or of its own queue.
        fn deliver(&mut self, id: usize) {
            let own_first = self.rng.below(2) == 0;
            let ep = &mut self.endpoints[id];
            let m = if own_first {
                ep.own.pop_front().or_else(|| ep.mailbox.pop_front())
            } else {
                ep.mailbox.pop_front().or_else(|| ep.own.pop_front())
            };
            let Some(m) = m else {
                return;
            };
            let actions = match m {
                ToEndpoint::Regenerate(revision, force) => {
                    ep.regen.step(Event::Requested { revision, force })
                }
                ToEndpoint::Bump(revision) => ep.regen.step(Event::Bumped { revision }),
                ToEndpoint::Due => ep.regen.step(Event::Due),
                ToEndpoint::Computed(revision) => {
                    ep.computed = ep.computed.max(revision);
                    ep.regen.step(Event::Realized { revision })
                }
            };
            for a in actions {
                match a {
                    Action::Queue | Action::QueueAfter(_) => {
                        self.endpoints[id].own.push_back(ToEndpoint::Due)
                    }
                    // It reads the engine's newest revision now; the result comes later.
                    Action::Compute { .. } => self.endpoints[id]
                        .own
                        .push_back(ToEndpoint::Computed(self.revision)),
                    Action::Report { revision, .. } => {
                        self.reports.push_back((id as EndpointId, revision))
                    }
                }
            }
            self.check(id);
        }

        fn report(&mut self) {
            if let Some((id, revision)) = self.reports.pop_front() {
                if let Some(s) = self.fanout.realized(id, revision) {
                    self.send(s);
                }
            }
        }

        /// Never realized past a change it has not computed: the newest change at or below
        /// its realized revision that affected it was read by a computation.
        fn check(&self, id: usize) {
            let ep = &self.endpoints[id];
            let last = ep.affected.range(..=ep.regen.realized).next_back();
            assert!(
                last.is_none_or(|l| ep.computed >= *l),
                "seed {}: endpoint {id} realized {} but computed only {} (affected at {last:?})",
                self.seed,
                ep.regen.realized,
                ep.computed,
            );
        }

        fn quiet(&self) -> bool {
            self.reports.is_empty()
                && self
                    .endpoints
                    .iter()
                    .all(|e| e.mailbox.is_empty() && e.own.is_empty())
        }
    }

    /// Random interleavings of changes, window flushes, endpoint messages and reports (each
    /// endpoint's mailbox in order): no endpoint is ever realized past a change it did not
    /// compute, and once the changes stop every endpoint reaches the last revision.
    #[test]
    fn no_endpoint_is_told_a_revision_it_did_not_compute_and_all_reach_the_last() {
        for seed in 1..=300u64 {
            let mut w = World::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), 4);
            for _ in 0..200 {
                match w.rng.below(10) {
                    0 | 1 => w.change(),
                    2 | 3 => w.flush(),
                    4..=6 => {
                        let id = w.rng.below(4) as usize;
                        w.deliver(id);
                    }
                    _ => w.report(),
                }
            }
            // The changes stop; the last window goes out, and everything is delivered.
            w.flush();
            let mut rounds = 0;
            while !w.quiet() || w.fanout.holds() {
                w.flush();
                for id in 0..4 {
                    w.deliver(id);
                }
                w.report();
                rounds += 1;
                assert!(rounds < 10_000, "seed {seed}: no quiet");
            }
            for (id, ep) in w.endpoints.iter().enumerate() {
                assert_eq!(
                    ep.regen.realized, w.revision,
                    "seed {seed}: endpoint {id} stuck at {} of {}",
                    ep.regen.realized, w.revision
                );
                let last = ep.affected.last().copied().unwrap_or(0);
                assert!(ep.computed >= last, "seed {seed}: endpoint {id}");
            }
            assert_eq!(w.fanout.in_flight(), 0, "seed {seed}");
        }
    }

    /// The cases of 68c8ede, by hand: a bump beside a held regeneration the endpoint answers
    /// without computing, and a bump sent while a regeneration is in flight.
    #[test]
    fn a_bump_is_not_lost_beside_a_held_or_running_regeneration() {
        let mut f: Fanout<(), u64> = Fanout::default();
        let none = None;
        let r =
            |revision, regen: &'static [(EndpointId, ())], bump: &'static [(EndpointId, ())]| {
                Reaction {
                    revision,
                    force: false,
                    reason: "t",
                    change: None,
                    peers: &none,
                    to_regenerate: regen,
                    to_bump: bump,
                }
            };
        // Revision 3 affects endpoint 1, revision 4 does not: the regeneration goes out, the
        // bump waits for its report (it may answer 3 without computing).
        f.gather(&r(3, &[(1, ())], &[]));
        f.gather(&r(4, &[], &[(1, ())]));
        let out = f.flush();
        assert_eq!(out.len(), 1);
        assert!(matches!(out[0], Send::Regenerate(1, ref w) if w.revision == 3));
        assert!(matches!(f.realized(1, 3), Some(Send::Bump(1, ref b)) if b.revision == 4));
        // Bumps while a regeneration runs: the latest is kept, sent when it reports.
        f.gather(&r(5, &[(1, ())], &[]));
        assert_eq!(f.flush().len(), 1);
        f.gather(&r(6, &[], &[(1, ())]));
        assert!(f.flush().is_empty());
        f.gather(&r(7, &[], &[(1, ())]));
        assert!(f.flush().is_empty());
        assert!(matches!(f.realized(1, 5), Some(Send::Bump(1, ref b)) if b.revision == 7));
        // A report at or past the bump's revision needs none.
        f.gather(&r(8, &[(1, ())], &[]));
        f.flush();
        f.gather(&r(9, &[], &[(1, ())]));
        f.flush();
        assert!(f.realized(1, 9).is_none());
        // A regeneration asked for while one runs goes out on the report, and covers a bump.
        f.gather(&r(10, &[(1, ())], &[]));
        f.flush();
        f.gather(&r(11, &[(1, ())], &[]));
        f.gather(&r(12, &[], &[(1, ())]));
        assert!(f.flush().is_empty());
        assert!(matches!(f.realized(1, 10), Some(Send::Regenerate(1, ref w)) if w.revision == 11));
        assert_eq!(f.in_flight(), 1);
        assert!(f.realized(1, 12).is_none());
        assert_eq!(f.in_flight(), 0);
    }
}
