//! Where endpoint actors run: a few arbiters (threads, each with its own event loop) beside the
//! system arbiter, so that endpoints regenerate in parallel, as Cilium's regeneration workers
//! do. One policy change that selects every endpoint computes each endpoint's policy on one of
//! them; the engine is shared behind a read lock, so they do not wait for each other.
//!
//! The other actors (watchers, `PolicyRepoActor`, `RuleReactionActor`, `LoaderActor`) stay on the
//! system arbiter: the engine's writer and the datapath's single owner are never parallel.

use actix::{Actor, Addr, Arbiter, ArbiterHandle, Context};

/// The regeneration arbiters, started on first use, stopped when dropped.
#[derive(Default)]
pub struct Workers {
    arbiters: Vec<Arbiter>,
    next: usize,
}

impl Workers {
    /// One per core (at least one, at most 16).
    fn count() -> usize {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .clamp(1, 16)
    }

    fn next_handle(&mut self) -> ArbiterHandle {
        if self.arbiters.is_empty() {
            self.arbiters = (0..Self::count()).map(|_| Arbiter::new()).collect();
        }
        let at = self.next % self.arbiters.len();
        self.next = self.next.wrapping_add(1);
        self.arbiters[at].handle()
    }

    /// Starts `actor` on the next arbiter, round robin.
    pub fn start<A>(&mut self, actor: A) -> Addr<A>
    where
        A: Actor<Context = Context<A>> + Send,
    {
        A::start_in_arbiter(&self.next_handle(), move |_| actor)
    }

    /// How many arbiters run (0 before the first actor).
    pub fn len(&self) -> usize {
        self.arbiters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.arbiters.is_empty()
    }
}

impl Drop for Workers {
    /// Each arbiter's thread holds a handle to itself: it ends only when told to.
    fn drop(&mut self) {
        for a in &self.arbiters {
            a.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix::{Handler, Message};

    struct WhereAmI;
    impl Actor for WhereAmI {
        type Context = Context<Self>;
    }
    #[derive(Message)]
    #[rtype(result = "std::thread::ThreadId")]
    struct Ask;
    impl Handler<Ask> for WhereAmI {
        type Result = actix::MessageResult<Ask>;
        fn handle(&mut self, _: Ask, _: &mut Context<Self>) -> Self::Result {
            actix::MessageResult(std::thread::current().id())
        }
    }

    #[test]
    fn actors_run_beside_the_system_arbiter_round_robin() {
        actix::System::new().block_on(round_robin());
    }

    async fn round_robin() {
        let mut w = Workers::default();
        assert!(w.is_empty());
        let n = Workers::count();
        let addrs: Vec<_> = (0..2 * n).map(|_| w.start(WhereAmI)).collect();
        assert_eq!(w.len(), n);
        let mut threads = Vec::new();
        for a in &addrs {
            threads.push(a.send(Ask).await.unwrap());
        }
        let here = std::thread::current().id();
        assert!(
            threads.iter().all(|t| *t != here),
            "no actor on the system arbiter"
        );
        // Round robin: actor i and actor i + n share a thread, the first n are on n threads.
        for i in 0..n {
            assert_eq!(threads[i], threads[i + n]);
        }
        let distinct: std::collections::HashSet<_> = threads.iter().collect();
        assert_eq!(distinct.len(), n);
        drop(w);
        // Stopped: the actors' mailboxes close.
        actix_rt::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(addrs.iter().all(|a| !a.connected()));
    }
}
