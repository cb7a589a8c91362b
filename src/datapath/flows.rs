//! The agent's recent flows: every verdict event the datapath reported, attributed, in a bounded
//! ring (the oldest go first, as Hubble's ring does), and the live broadcast `ciliate monitor`
//! follows. `ciliate monitor --since 5m` reads the ring, then follows the broadcast, with no
//! event shown twice and none missed between the two: publishing and subscribing take the same
//! lock. Each event is kept once, behind an `Arc`: the ring, the broadcast and every reader
//! share it, so a reader copies pointers under the lock, never events.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;

use super::events::{FlowFilter, VerdictEvent};

/// A kept event, shared by the ring, the broadcast and the readers.
pub type Flow = Arc<VerdictEvent>;

/// Flows kept when `--flow-buffer-capacity` is not given.
pub const DEFAULT_CAPACITY: usize = 16_384;

pub struct FlowRing {
    ring: Mutex<Ring>,
    live: broadcast::Sender<Flow>,
    /// Events published since the ring was made (Hubble's `seen_flows`).
    seen: std::sync::atomic::AtomicU64,
}

struct Ring {
    capacity: usize,
    /// (received at, unix milliseconds; the event), oldest first: times never go down.
    flows: VecDeque<(u64, Flow)>,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl FlowRing {
    /// A ring of `capacity` flows (0: none kept; `--since` then finds nothing) and a live
    /// broadcast that buffers `live_buffer` events per slow subscriber.
    pub fn new(capacity: usize, live_buffer: usize) -> FlowRing {
        FlowRing {
            ring: Mutex::new(Ring {
                capacity,
                flows: VecDeque::with_capacity(capacity.min(4096)),
            }),
            live: broadcast::channel(live_buffer.max(1)).0,
            seen: Default::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps an event (stamped with the time it was received) and sends it to the live
    /// subscribers.
    pub fn publish(&self, ev: VerdictEvent) {
        self.publish_at(now_ms(), ev);
    }

    fn publish_at(&self, at_ms: u64, mut ev: VerdictEvent) {
        ev.time = chrono::DateTime::from_timestamp_millis(at_ms as i64)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
        let ev = Arc::new(ev);
        let mut ring = self.lock();
        self.seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if ring.capacity > 0 {
            if ring.flows.len() == ring.capacity {
                ring.flows.pop_front();
            }
            ring.flows.push_back((at_ms, ev.clone()));
        }
        // No subscriber is not an error: the event is kept in the ring only.
        let _ = self.live.send(ev);
    }

    /// The kept flows received at or after `since_ms` (unix milliseconds) that `filter`
    /// accepts, oldest first.
    pub fn query(&self, since_ms: u64, filter: &FlowFilter) -> Vec<Flow> {
        let ring = self.lock();
        Self::select(&ring, since_ms, filter)
    }

    fn select(ring: &Ring, since_ms: u64, filter: &FlowFilter) -> Vec<Flow> {
        let first = ring.flows.partition_point(|(t, _)| *t < since_ms);
        ring.flows
            .range(first..)
            .filter(|(_, e)| filter.accepts(e))
            .map(|(_, e)| e.clone())
            .collect()
    }

    /// What `query` returns, and a subscription to every event published after it.
    pub fn follow(
        &self,
        since_ms: u64,
        filter: &FlowFilter,
    ) -> (Vec<Flow>, broadcast::Receiver<Flow>) {
        let ring = self.lock();
        let rx = self.live.subscribe();
        (Self::select(&ring, since_ms, filter), rx)
    }

    /// Every kept event received at or after `since_ms`, oldest first, and a subscription to
    /// every event published after them (Hubble's `GetFlows`, which filters on its own terms).
    pub fn follow_all(&self, since_ms: u64) -> (Vec<Flow>, broadcast::Receiver<Flow>) {
        let ring = self.lock();
        let rx = self.live.subscribe();
        let first = ring.flows.partition_point(|(t, _)| *t < since_ms);
        (
            ring.flows.range(first..).map(|(_, e)| e.clone()).collect(),
            rx,
        )
    }

    /// How many events the ring keeps at most.
    pub fn capacity(&self) -> usize {
        self.lock().capacity
    }

    /// Events published since the ring was made, kept or not.
    pub fn seen(&self) -> u64 {
        self.seen.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The namespaces of the pods the kept flows name.
    pub fn namespaces(&self) -> std::collections::BTreeSet<String> {
        let ring = self.lock();
        let pods = ring
            .flows
            .iter()
            .flat_map(|(_, e)| [&e.source_pod, &e.destination_pod]);
        pods.filter_map(|p| Some(p.as_deref()?.split_once('/')?.0.to_string()))
            .collect()
    }

    /// A subscription to the live events only.
    pub fn subscribe(&self) -> broadcast::Receiver<Flow> {
        self.live.subscribe()
    }

    pub fn len(&self) -> usize {
        self.lock().flows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `--since` as a point in time: `30s`, `5m`, `2h`, `1d` (or a bare number of seconds) before
/// now, in unix milliseconds.
pub fn since_to_ms(since: &str, now_ms: u64) -> Result<u64, String> {
    let s = since.trim();
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("--since {since:?}: expected a duration such as 30s, 5m, 2h, 1d"))?;
    let unit_ms = match unit {
        "" | "s" => 1_000,
        "ms" => 1,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "--since {since:?}: unknown unit {unit:?} (use ms, s, m, h or d)"
            ))
        }
    };
    Ok(now_ms.saturating_sub(n.saturating_mul(unit_ms)))
}

/// Now, in unix milliseconds.
pub fn unix_now_ms() -> u64 {
    now_ms()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(port: u16, verdict: &str) -> VerdictEvent {
        let mut e = super::super::events::lost_event(0);
        e.kind = "flow".into();
        e.lost = None;
        e.port = port;
        e.verdict = verdict.into();
        e
    }

    #[test]
    fn the_ring_keeps_the_newest_and_answers_by_time_and_filter() {
        let ring = FlowRing::new(3, 16);
        for (t, port) in [(1_000, 1), (2_000, 2), (3_000, 3), (4_000, 4)] {
            ring.publish_at(t, flow(port, "dropped"));
        }
        assert_eq!(ring.len(), 3, "the oldest went");
        let ports = |v: Vec<Flow>| v.iter().map(|e| e.port).collect::<Vec<_>>();
        assert_eq!(ports(ring.query(0, &FlowFilter::default())), [2, 3, 4]);
        assert_eq!(ports(ring.query(3_000, &FlowFilter::default())), [3, 4]);
        let port4 = FlowFilter {
            port: Some(4),
            ..Default::default()
        };
        assert_eq!(ports(ring.query(0, &port4)), [4]);
        let first = ring.query(0, &FlowFilter::default()).remove(0);
        assert_eq!(first.time.as_deref(), Some("1970-01-01T00:00:02.000Z"));
    }

    #[test]
    fn following_shows_every_event_once() {
        let ring = FlowRing::new(10, 16);
        ring.publish_at(1, flow(1, "forwarded"));
        let (history, mut rx) = ring.follow(0, &FlowFilter::default());
        ring.publish_at(2, flow(2, "forwarded"));
        assert_eq!(history.len(), 1);
        assert_eq!(history[0].port, 1);
        assert_eq!(rx.try_recv().unwrap().port, 2);
        assert!(rx.try_recv().is_err(), "nothing twice");
    }

    #[test]
    fn a_ring_of_nothing_still_broadcasts() {
        let ring = FlowRing::new(0, 16);
        let mut rx = ring.subscribe();
        ring.publish(flow(9, "dropped"));
        assert!(ring.is_empty());
        assert_eq!(rx.try_recv().unwrap().port, 9);
    }

    #[test]
    fn since_reads_durations() {
        assert_eq!(since_to_ms("5m", 1_000_000), Ok(700_000));
        assert_eq!(since_to_ms("30s", 100_000), Ok(70_000));
        assert_eq!(since_to_ms("30", 100_000), Ok(70_000));
        assert_eq!(since_to_ms("2h", 10), Ok(0), "before the epoch: everything");
        assert!(since_to_ms("5 parsecs", 0)
            .unwrap_err()
            .contains("unknown unit"));
        assert!(since_to_ms("m", 0).is_err());
    }
}
