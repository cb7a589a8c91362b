//! The agent's side of the tables it sends a proxy (the HTTP proxy's L7 table, the DNS proxy's
//! rules): each change counted (a generation), and what the connected proxy said it applied.
//!
//! A proxy is a process of its own: the agent sends it the whole table over its link whenever
//! the table changes, asynchronously. An endpoint's regeneration that changed the endpoint's
//! part waits until the proxy answered `Applied` with that generation (or a later one), so
//! that a realized revision is the one the proxy judges by (as Cilium waits for Envoy's ACK).
//! It does not wait when no proxy that answers is connected (the datapath drops the flows
//! meant for a proxy that is not there, and a new connection starts with the whole table),
//! and at most [`APPLY_WAIT`].

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;

/// How long an endpoint's regeneration waits for a proxy to take its table before it is
/// reported realized anyway (with a warning; the link resends the whole table on reconnect).
pub const APPLY_WAIT: Duration = Duration::from_secs(2);

/// One proxy's tables: their generation, and the proxy's answers.
#[derive(Debug)]
pub struct TableSync {
    /// Bumped on every change of the table (the link sends the whole table again).
    pub changed: watch::Sender<u64>,
    answers: watch::Sender<Answers>,
}

/// The agent's generation of a proxy's table and what the connected proxy said it applied.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct SyncView {
    pub generation: u64,
    /// On this connection (0: nothing yet, or no proxy).
    pub applied: u64,
    /// A proxy is connected that answers every table.
    pub answering: bool,
}

/// What the connected proxy said.
#[derive(Debug, Clone, Copy, Default)]
struct Answers {
    /// A proxy is connected that answers every table (its Hello said so).
    answering: bool,
    /// The highest generation it said it applied on this connection.
    applied: u64,
}

impl Default for TableSync {
    fn default() -> Self {
        TableSync {
            changed: watch::channel(0).0,
            answers: watch::channel(Answers::default()).0,
        }
    }
}

impl TableSync {
    /// The table changed: the new generation. Called under the lock of the table, so that a
    /// table read after it holds the change.
    pub fn bump(&self) -> u64 {
        self.changed.send_modify(|n| *n += 1);
        *self.changed.borrow()
    }

    /// Sets (`Some`) or removes (`None`) one endpoint's part of the table this sync counts the
    /// changes of (the caller holds the table's lock): the new generation if that changed it.
    pub fn set<V: PartialEq>(
        &self,
        table: &mut BTreeMap<u64, V>,
        endpoint: u64,
        part: Option<V>,
    ) -> Option<u64> {
        let changed = match part {
            Some(new) if table.get(&endpoint) == Some(&new) => false,
            Some(new) => {
                table.insert(endpoint, new);
                true
            }
            None => table.remove(&endpoint).is_some(),
        };
        changed.then(|| self.bump())
    }

    /// The current generation (read under the table's lock, with the table it goes with).
    pub fn generation(&self) -> u64 {
        *self.changed.borrow()
    }

    /// A proxy connected: whether it answers tables; nothing applied on this connection yet.
    pub fn connected(&self, answering: bool) {
        self.answers.send_replace(Answers {
            answering,
            applied: 0,
        });
    }

    /// The link is down: nothing to wait for.
    pub fn disconnected(&self) {
        self.answers.send_replace(Answers::default());
    }

    /// The proxy said it judges by the table of `generation` (or a later one).
    pub fn applied(&self, generation: u64) {
        self.answers.send_if_modified(|a| {
            let newer = generation > a.applied;
            a.applied = a.applied.max(generation);
            newer
        });
    }

    /// What `/debug/http` and `/debug/dns` show (`rules_sync`).
    pub fn view(&self) -> SyncView {
        let a = *self.answers.borrow();
        SyncView {
            generation: self.generation(),
            applied: a.applied,
            answering: a.answering,
        }
    }

    /// Resolves once the proxy judges by a table of `generation` or later, or no proxy that
    /// answers is connected (`true`), or after `limit` (`false`).
    pub fn wait(&self, generation: u64, limit: Duration) -> impl Future<Output = bool> + 'static {
        let mut rx = self.answers.subscribe();
        async move {
            let done = rx.wait_for(|a| !a.answering || a.applied >= generation);
            matches!(tokio::time::timeout(limit, done).await, Ok(Ok(_)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setting_a_part_counts_a_change_only_when_it_is_one() {
        let s = TableSync::default();
        let mut table = BTreeMap::new();
        let g1 = s.set(&mut table, 7, Some("a")).expect("a new part");
        assert_eq!(s.set(&mut table, 7, Some("a")), None, "the same part");
        let g2 = s.set(&mut table, 7, Some("b")).expect("another part");
        assert!(g2 > g1 && s.generation() == g2);
        assert_eq!(table.get(&7), Some(&"b"));
        assert_eq!(s.set(&mut table, 8, None), None, "nothing to remove");
        assert!(s.set(&mut table, 7, None).is_some_and(|g| g > g2));
        assert!(table.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_generation_is_applied_once_the_answering_proxy_says_so() {
        let s = TableSync::default();
        let limit = Duration::from_secs(2);
        let g1 = s.bump();
        assert_eq!(s.generation(), g1);
        // No proxy connected: nothing to wait for.
        assert!(s.wait(g1, limit).await);
        // A proxy that answers: waited for until it applied that generation or a later one.
        s.connected(true);
        let g2 = s.bump();
        assert!(g2 > g1);
        let waiting = tokio::spawn(s.wait(g2, limit));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "not applied yet");
        s.applied(g1);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "an older generation does not do");
        s.applied(g2 + 1);
        assert!(waiting.await.unwrap());
        let v = s.view();
        assert!(v.answering && v.applied == g2 + 1 && v.generation == g2);
        // Never answered: false after the limit.
        let g3 = s.bump();
        s.connected(true); // a new connection: nothing applied on it yet
        assert!(!s.wait(g3, limit).await);
        // The link goes down while one waits: nothing to wait for.
        let waiting = tokio::spawn(s.wait(g3, limit));
        tokio::time::sleep(Duration::from_millis(100)).await;
        s.disconnected();
        assert!(waiting.await.unwrap());
        // A proxy that does not answer tables (older): not waited for.
        s.connected(false);
        assert!(s.wait(g3 + 10, limit).await);
    }
}
