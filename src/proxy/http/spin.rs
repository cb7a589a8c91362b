//! Waiting for an upstream answer without sleeping, while that pays.
//!
//! A proxied request costs its serving thread two wake-ups: the request's arrival and its
//! answer's. On a small virtual node a wake-up from idle (a context switch in, the vCPU's halt
//! and its interrupt) took as long as the proxy's own work: at 5,000 requests/s the proxy
//! spent 41-53 us of CPU per request, most of it switching (`perf`, `benches/http_proxy.rs`
//! part 1). A server on the same node answers a small request within a few tens of
//! microseconds, so a thread with a request upstream and nothing else to do polls its sockets
//! for up to `BUDGET` instead of sleeping (the runtime's scheduler polls the sockets without
//! blocking while a task yields), and the answer is read the moment it arrives.
//!
//! It pays only when answers come within the budget: `Gate` keeps how often the last ones did
//! (a moving average), and the thread spins only while at least half did. Behind slow
//! servers (milliseconds) it stops at once, and the proxy sleeps as before: no CPU burnt on
//! waits it cannot shorten. The spinner starts when a thread's first request goes upstream;
//! while a slow one waits (a long poll), later requests of that thread wait asleep, as without
//! spinning.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest a thread polls for an answer before it sleeps.
pub const BUDGET: Duration = Duration::from_micros(40);

/// The moving average's scale (all answers within the budget) and weight of the newest (1/16).
const FULL: u32 = 1024;
const WEIGHT: u32 = 16;

/// How often answers arrive within the budget, as a moving average over the last few.
#[derive(Debug)]
pub struct Gate(AtomicU32);

impl Default for Gate {
    /// Until answers say otherwise, spinning is worth it.
    fn default() -> Gate {
        Gate(AtomicU32::new(FULL))
    }
}

impl Gate {
    /// An answer's head came `after` the request was sent.
    pub fn observe(&self, after: Duration) {
        let hit = if after <= BUDGET { FULL } else { 0 };
        let old = self.0.load(Ordering::Relaxed);
        // old + (hit - old) / WEIGHT, in unsigned steps.
        let new = if hit >= old {
            old + (hit - old) / WEIGHT
        } else {
            old - (old - hit).div_ceil(WEIGHT)
        };
        self.0.store(new, Ordering::Relaxed);
    }

    /// At least half of the recent answers came within the budget.
    pub fn worth_it(&self) -> bool {
        self.0.load(Ordering::Relaxed) >= FULL / 2
    }
}

/// One serving thread's requests upstream, and its spinner's signal.
#[derive(Debug, Default)]
pub struct Spin {
    gate: Gate,
    waiting: AtomicUsize,
    start: tokio::sync::Notify,
    /// The spinner's polls so far (each a yield to the runtime, which then polls the sockets).
    polls: AtomicU64,
}

impl Spin {
    /// A request is sent upstream: counted until the guard is dropped (its answer's head came,
    /// or it failed); the spinner starts if nothing else waited and spinning pays.
    pub fn wait(&self) -> Waiting<'_> {
        if self.waiting.fetch_add(1, Ordering::Relaxed) == 0 && self.gate.worth_it() {
            self.start.notify_one();
        }
        Waiting {
            spin: self,
            sent: Instant::now(),
        }
    }

    /// Sends a request upstream (`send`: its answer's head, or its failure) counted as
    /// waiting (`wait`); an answer counts toward the gate.
    pub async fn answer<T, E>(
        &self,
        send: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let waiting = self.wait();
        let r = send.await;
        if r.is_ok() {
            waiting.answered();
        }
        r
    }

    /// The spinner, a task of the serving thread's runtime: told to start, it yields (keeping
    /// the thread polling its sockets) while a request waits, for at most `BUDGET`.
    pub async fn run(self: Arc<Self>) {
        loop {
            self.start.notified().await;
            let until = Instant::now() + BUDGET;
            while self.waiting.load(Ordering::Relaxed) > 0 && Instant::now() < until {
                tokio::task::yield_now().await;
                self.polls.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The spinner's polls so far.
    pub fn polls(&self) -> u64 {
        self.polls.load(Ordering::Relaxed)
    }
}

/// A request waiting for its answer's head (`Spin::wait`).
pub struct Waiting<'a> {
    spin: &'a Spin,
    sent: Instant,
}

impl Waiting<'_> {
    /// The answer's head came: its time counts toward the gate.
    pub fn answered(self) {
        self.spin.gate.observe(self.sent.elapsed());
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.spin.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAST: Duration = Duration::from_micros(15);
    const SLOW: Duration = Duration::from_millis(2);

    #[test]
    fn fast_answers_keep_spinning_worth_it_slow_ones_stop_it_and_fast_ones_bring_it_back() {
        let g = Gate::default();
        assert!(g.worth_it(), "worth it until answers say otherwise");
        for _ in 0..100 {
            g.observe(FAST);
        }
        assert!(g.worth_it());
        // A slow server: within a dozen answers, no more spinning.
        let mut slow = 0;
        while g.worth_it() {
            g.observe(SLOW);
            slow += 1;
        }
        assert!(
            (8..=16).contains(&slow),
            "stopped after {slow} slow answers"
        );
        for _ in 0..100 {
            g.observe(SLOW);
        }
        assert!(!g.worth_it());
        // Fast again: it comes back.
        let mut fast = 0;
        while !g.worth_it() {
            g.observe(FAST);
            fast += 1;
        }
        assert!((8..=16).contains(&fast), "back after {fast} fast answers");
    }

    #[test]
    fn one_slow_answer_in_ten_keeps_it_one_in_two_stops_it() {
        let g = Gate::default();
        for i in 0..500 {
            g.observe(if i % 10 == 0 { SLOW } else { FAST });
        }
        assert!(g.worth_it());
        for i in 0..500 {
            g.observe(if i % 3 == 0 { FAST } else { SLOW });
        }
        assert!(!g.worth_it());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_spinner_polls_while_a_request_waits_for_at_most_the_budget_and_not_when_it_does_not_pay(
    ) {
        let spin = Arc::new(Spin::default());
        let spinner = tokio::spawn(spin.clone().run());
        let idle = || tokio::time::sleep(Duration::from_millis(3));
        idle().await;
        assert_eq!(spin.polls(), 0, "nothing waits: no polling");
        // A request waits: the thread polls, then sleeps once the budget is spent.
        let w = spin.wait();
        idle().await;
        let spun = spin.polls();
        assert!(spun > 0, "polled while the request waited");
        idle().await;
        assert_eq!(
            spin.polls(),
            spun,
            "stopped after the budget, still waiting"
        );
        drop(w);
        // The next request starts it again; answered, it stops.
        let w = spin.wait();
        idle().await;
        let again = spin.polls();
        assert!(again > spun);
        w.answered();
        assert_eq!(spin.waiting.load(Ordering::Relaxed), 0);
        idle().await;
        assert_eq!(spin.polls(), again);
        // Slow answers: the next requests wait asleep.
        for _ in 0..100 {
            spin.gate.observe(SLOW);
        }
        let w = spin.wait();
        idle().await;
        assert_eq!(spin.polls(), again, "not worth it: no polling");
        drop(w);
        assert!(!spinner.is_finished());
        spinner.abort();
    }
}
