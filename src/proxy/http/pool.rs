//! The HTTP proxy's idle upstream connections, shared by the client connections that lead to
//! the same place.
//!
//! A key names everything that makes an upstream connection what it is: the address it is
//! made from (the pod's, or the node's for peers outside the cluster), the server, the mark
//! the datapath reads (which side judged it) and the protocol. Two client connections with
//! the same key would make the same connection, so one made for the first may serve the
//! second: the server, its policy and its logs see the same pod either way. A client
//! connection that sits idle between requests holds no upstream connection.
//!
//! - HTTP/1.1: a connection carries one request at a time. It is checked in once the answer's
//!   head has arrived and checked out only when it is ready for the next request (its answer
//!   read whole), newest first, so the ones beyond what the load needs grow idle and expire.
//! - HTTP/2: one connection per key carries every stream.
//! - Bounds: at most `max_idle` connections per key are kept, none idle for longer than
//!   `idle_timeout`; closed ones are dropped whenever their key is visited, and by `sweep`.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// What the pool needs to know of a connection.
pub trait Pooled {
    /// The connection is gone (the server closed it, or it failed).
    fn is_closed(&self) -> bool;
    /// It can take a request now.
    fn is_ready(&self) -> bool;
    /// Several requests share it at once (HTTP/2): checked out by cloning, never taken.
    fn shared(&self) -> Option<Self>
    where
        Self: Sized;
}

pub struct Pool<K, S> {
    idle: HashMap<K, Vec<(S, Instant)>>,
    max_idle: usize,
    idle_timeout: Duration,
}

impl<K: Hash + Eq + Clone, S: Pooled> Pool<K, S> {
    pub fn new(max_idle: usize, idle_timeout: Duration) -> Pool<K, S> {
        Pool {
            idle: HashMap::new(),
            max_idle,
            idle_timeout,
        }
    }

    /// A connection for `key` that can take a request now, if one is kept.
    pub fn checkout(&mut self, key: &K, now: Instant) -> Option<S> {
        let timeout = self.idle_timeout;
        let list = self.idle.get_mut(key)?;
        list.retain(|(s, since)| !s.is_closed() && now.duration_since(*since) < timeout);
        let found = match list.iter().rposition(|(s, _)| s.is_ready()) {
            Some(i) => match list[i].0.shared() {
                Some(clone) => {
                    list[i].1 = now;
                    Some(clone)
                }
                None => Some(list.remove(i).0),
            },
            None => None,
        };
        if list.is_empty() {
            self.idle.remove(key);
        }
        found
    }

    /// Keeps `s` for the next request to `key` (dropped when the key has `max_idle` already;
    /// a shared connection is kept once).
    pub fn checkin(&mut self, key: K, s: S, now: Instant) {
        let list = self.idle.entry(key).or_default();
        if s.shared().is_some() {
            list.retain(|(o, _)| o.shared().is_none() || o.is_closed());
        }
        if list.len() < self.max_idle {
            list.push((s, now));
        }
    }

    /// Drops the closed connections and those idle too long.
    pub fn sweep(&mut self, now: Instant) {
        let timeout = self.idle_timeout;
        self.idle.retain(|_, list| {
            list.retain(|(s, since)| !s.is_closed() && now.duration_since(*since) < timeout);
            !list.is_empty()
        });
    }

    /// Connections kept now.
    pub fn len(&self) -> usize {
        self.idle.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.idle.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// A connection whose state the test sets.
    #[derive(Clone)]
    struct Fake {
        id: u32,
        closed: Rc<Cell<bool>>,
        ready: Rc<Cell<bool>>,
        h2: bool,
    }

    impl Fake {
        fn new(id: u32, h2: bool) -> Fake {
            Fake {
                id,
                closed: Rc::new(Cell::new(false)),
                ready: Rc::new(Cell::new(true)),
                h2,
            }
        }
    }

    impl Pooled for Fake {
        fn is_closed(&self) -> bool {
            self.closed.get()
        }
        fn is_ready(&self) -> bool {
            self.ready.get()
        }
        fn shared(&self) -> Option<Fake> {
            self.h2.then(|| self.clone())
        }
    }

    #[test]
    fn http1_connections_serve_one_request_at_a_time_newest_first() {
        let t = Instant::now();
        let mut p: Pool<&str, Fake> = Pool::new(4, Duration::from_secs(60));
        assert!(p.checkout(&"a", t).is_none());
        let (one, two) = (Fake::new(1, false), Fake::new(2, false));
        p.checkin("a", one.clone(), t);
        p.checkin("a", two.clone(), t);
        // Another key never gets them.
        assert!(p.checkout(&"b", t).is_none());
        // Newest first; a connection still reading its answer is passed over.
        two.ready.set(false);
        assert_eq!(p.checkout(&"a", t).unwrap().id, 1);
        assert!(p.checkout(&"a", t).is_none(), "2 is busy, 1 is out");
        two.ready.set(true);
        assert_eq!(p.checkout(&"a", t).unwrap().id, 2);
        assert!(p.checkout(&"a", t).is_none() && p.is_empty());
    }

    #[test]
    fn closed_and_expired_connections_are_dropped_and_the_count_is_bounded() {
        let t = Instant::now();
        let mut p: Pool<u8, Fake> = Pool::new(2, Duration::from_secs(60));
        let conns: Vec<Fake> = (0..3).map(|i| Fake::new(i, false)).collect();
        for c in &conns {
            p.checkin(1, c.clone(), t);
        }
        assert_eq!(p.len(), 2, "the third is beyond max_idle");
        conns[1].closed.set(true);
        assert_eq!(p.checkout(&1, t).unwrap().id, 0, "1 is closed");
        p.checkin(1, conns[0].clone(), t);
        p.checkin(2, Fake::new(9, false), t + Duration::from_secs(30));
        p.sweep(t + Duration::from_secs(61));
        assert_eq!(p.len(), 1, "key 1's connection expired; key 2's did not");
        assert_eq!(p.checkout(&2, t + Duration::from_secs(61)).unwrap().id, 9);
    }

    #[test]
    fn an_http2_connection_is_shared_and_replaced_when_closed() {
        let t = Instant::now();
        let mut p: Pool<u8, Fake> = Pool::new(8, Duration::from_secs(60));
        let first = Fake::new(1, true);
        p.checkin(1, first.clone(), t);
        assert_eq!(p.checkout(&1, t).unwrap().id, 1);
        assert_eq!(
            p.checkout(&1, t).unwrap().id,
            1,
            "still there for the next stream"
        );
        // Checked in again (by a request that made it): kept once.
        p.checkin(1, first.clone(), t);
        assert_eq!(p.len(), 1);
        first.closed.set(true);
        assert!(p.checkout(&1, t).is_none());
        p.checkin(1, Fake::new(2, true), t);
        assert_eq!(p.checkout(&1, t).unwrap().id, 2);
        // Use keeps it from expiring.
        assert!(p.checkout(&1, t + Duration::from_secs(50)).is_some());
        assert!(p.checkout(&1, t + Duration::from_secs(100)).is_some());
    }
}
