//! Each pod's fair share of the DNS proxy: at most `rate` UDP queries per second from one
//! source address (a token bucket holding `2 * rate`, so a burst of two seconds passes) and at
//! most `max_in_flight` of them waiting for servers at once. Past either, the source's queries
//! are dropped (its resolver retries, as it would for a lost datagram), so one pod's flood of
//! lookups leaves the proxy's time to the other pods. Pure but for the clock it is given.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Sources tracked before the idle ones are pruned.
const PRUNE_AT: usize = 4_096;
/// A source idle this long is forgotten at the next prune.
const IDLE: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SourceLimits {
    /// Queries per second per source (0: unlimited).
    pub rate: u32,
    /// Queries per source waiting for their servers at once.
    pub max_in_flight: usize,
}

impl Default for SourceLimits {
    fn default() -> Self {
        SourceLimits {
            rate: 1_000,
            max_in_flight: 1_024,
        }
    }
}

#[derive(Debug)]
struct Source {
    tokens: f64,
    last: Instant,
    in_flight: usize,
    dropped: u64,
}

/// Why a query was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The source is over its rate; `dropped` so far.
    Rate { dropped: u64 },
    /// The source has `max_in_flight` queries waiting.
    InFlight { dropped: u64 },
}

/// See the module documentation.
#[derive(Debug)]
pub struct SourceLimiter {
    limits: SourceLimits,
    sources: Mutex<HashMap<IpAddr, Source>>,
}

/// A query admitted: its source's in-flight count goes down when this is dropped.
#[derive(Debug)]
pub struct Admitted {
    limiter: Arc<SourceLimiter>,
    src: IpAddr,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut sources = self.limiter.lock();
        if let Some(s) = sources.get_mut(&self.src) {
            s.in_flight = s.in_flight.saturating_sub(1);
        }
    }
}

impl SourceLimiter {
    pub fn new(limits: SourceLimits) -> Arc<SourceLimiter> {
        Arc::new(SourceLimiter {
            limits,
            sources: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Source>> {
        self.sources.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits one query from `src` at `now`, or says why not.
    pub fn admit(self: &Arc<Self>, src: IpAddr, now: Instant) -> Result<Admitted, Refusal> {
        let l = self.limits;
        let burst = 2.0 * l.rate as f64;
        let mut sources = self.lock();
        if sources.len() >= PRUNE_AT && !sources.contains_key(&src) {
            sources.retain(|_, s| s.in_flight > 0 || now.duration_since(s.last) < IDLE);
        }
        let s = sources.entry(src).or_insert(Source {
            tokens: burst,
            last: now,
            in_flight: 0,
            dropped: 0,
        });
        if l.rate > 0 {
            let elapsed = now.saturating_duration_since(s.last).as_secs_f64();
            s.tokens = (s.tokens + elapsed * l.rate as f64).min(burst);
        }
        s.last = now;
        if s.in_flight >= l.max_in_flight {
            s.dropped += 1;
            return Err(Refusal::InFlight { dropped: s.dropped });
        }
        if l.rate > 0 {
            if s.tokens < 1.0 {
                s.dropped += 1;
                return Err(Refusal::Rate { dropped: s.dropped });
            }
            s.tokens -= 1.0;
        }
        s.in_flight += 1;
        Ok(Admitted {
            limiter: self.clone(),
            src,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flooding_source_gets_its_rate_and_the_others_theirs() {
        let lim = SourceLimiter::new(SourceLimits {
            rate: 100,
            max_in_flight: 1_000,
        });
        let (flood, quiet): (IpAddr, IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        // One second of a 5,000 q/s flood: the burst (200) and one second's rate (100) pass.
        let mut passed = 0;
        for i in 0..5_000u64 {
            let at = t0 + Duration::from_micros(i * 200);
            if lim.admit(flood, at).is_ok() {
                passed += 1;
            }
            // The quiet pod's one query every 10 ms always passes.
            if i % 50 == 0 {
                assert!(lim.admit(quiet, at).is_ok(), "quiet refused at {i}");
            }
        }
        assert!((290..=301).contains(&passed), "{passed}");
        assert_eq!(
            lim.admit(flood, t0 + Duration::from_micros(4_999 * 200))
                .unwrap_err(),
            Refusal::Rate {
                dropped: 5_000 - passed + 1
            }
        );
    }

    #[test]
    fn in_flight_is_bounded_per_source_and_freed_with_the_query() {
        let lim = SourceLimiter::new(SourceLimits {
            rate: 0,
            max_in_flight: 2,
        });
        let src: IpAddr = "10.0.0.1".parse().unwrap();
        let now = Instant::now();
        let a = lim.admit(src, now).unwrap();
        let _b = lim.admit(src, now).unwrap();
        assert_eq!(
            lim.admit(src, now).unwrap_err(),
            Refusal::InFlight { dropped: 1 }
        );
        assert!(lim.admit("10.0.0.2".parse().unwrap(), now).is_ok());
        drop(a);
        assert!(lim.admit(src, now).is_ok());
    }
}
