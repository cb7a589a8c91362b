//! The agent's side of the HTTP proxy, shared by its actors and its proxy link: each
//! endpoint's part of the table (what the proxy is sent) and what the agent knows of the
//! proxy.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::Serialize;

use super::{EndpointTable, ProxyTable};
use crate::proxy::lock;

/// The proxy as the agent last heard from it.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct ProxyView {
    /// `auto`, `external` or `disabled`.
    pub mode: String,
    pub connected: bool,
    pub pid: Option<u32>,
    pub egress_port: Option<u16>,
    pub ingress_port: Option<u16>,
    /// Why it is not connected, when known (flows to it are dropped meanwhile).
    pub error: Option<String>,
    /// What it holds, as it last said.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub holds: Option<super::ProxyStats>,
}

#[derive(Debug)]
pub struct HttpState {
    tables: Mutex<BTreeMap<u64, EndpointTable>>,
    /// Bumped on every change of the tables (the link sends the table again).
    pub changed: tokio::sync::watch::Sender<u64>,
    pub proxy: Mutex<ProxyView>,
    /// What the connected proxy said it judges by.
    acked: tokio::sync::watch::Sender<Acked>,
}

/// The proxy's answers to the tables it is sent.
#[derive(Debug, Clone, Copy, Default)]
struct Acked {
    /// A proxy is connected that answers every table (`FromProxy::Hello::acks_tables`).
    acking: bool,
    /// The highest generation it said it applied on this connection.
    generation: u64,
}

/// How long an endpoint's regeneration waits for the proxy to take its table before it is
/// reported realized anyway (with a warning; the link resends the whole table on reconnect).
pub const APPLY_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl Default for HttpState {
    fn default() -> Self {
        HttpState {
            tables: Mutex::new(BTreeMap::new()),
            changed: tokio::sync::watch::channel(0).0,
            proxy: Mutex::new(ProxyView::default()),
            acked: tokio::sync::watch::channel(Acked::default()).0,
        }
    }
}

impl HttpState {
    /// Sets (or, with `None`, removes) an endpoint's table; the link is told when it changed.
    /// Returns the generation that includes the change (`None`: nothing changed).
    pub fn set_table(&self, endpoint: u64, table: Option<EndpointTable>) -> Option<u64> {
        let mut t = lock(&self.tables);
        let changed = match table {
            Some(new) => t.insert(endpoint, new.clone()).as_ref() != Some(&new),
            None => t.remove(&endpoint).is_some(),
        };
        // Bumped under the lock: a table read after this generation holds the change.
        let generation = changed.then(|| {
            self.changed.send_modify(|n| *n += 1);
            *self.changed.borrow()
        });
        drop(t);
        generation
    }

    /// The whole table, with the generation it includes (sent to the proxy).
    pub fn table_to_send(&self) -> ProxyTable {
        let t = lock(&self.tables);
        ProxyTable {
            endpoints: t.values().cloned().collect(),
            generation: *self.changed.borrow(),
        }
    }

    /// A proxy connected: whether it answers tables; nothing applied on this connection yet.
    pub fn proxy_connected(&self, acks_tables: bool) {
        self.acked.send_replace(Acked {
            acking: acks_tables,
            generation: 0,
        });
    }

    /// The link to the proxy is down: nothing to wait for (its flows are dropped meanwhile,
    /// and a new connection starts with the whole table).
    pub fn proxy_disconnected(&self) {
        self.acked.send_replace(Acked::default());
    }

    /// The proxy said it judges by the table of `generation` (or a later one).
    pub fn proxy_applied(&self, generation: u64) {
        self.acked.send_if_modified(|a| {
            let newer = generation > a.generation;
            a.generation = a.generation.max(generation);
            newer
        });
    }

    /// Resolves once the proxy judges by a table of `generation` or later, or no proxy that
    /// answers is connected (`true`), or after `limit` (`false`).
    pub fn applied(
        &self,
        generation: u64,
        limit: std::time::Duration,
    ) -> impl std::future::Future<Output = bool> + 'static {
        let mut rx = self.acked.subscribe();
        async move {
            let done = rx.wait_for(|a| !a.acking || a.generation >= generation);
            matches!(tokio::time::timeout(limit, done).await, Ok(Ok(_)))
        }
    }

    /// Whether the endpoint has L7 rules (entries in its table).
    pub fn has(&self, endpoint: u64) -> bool {
        lock(&self.tables)
            .get(&endpoint)
            .is_some_and(|t| !t.entries.is_empty())
    }

    /// Endpoints with L7 rules.
    pub fn endpoints(&self) -> usize {
        lock(&self.tables)
            .values()
            .filter(|t| !t.entries.is_empty())
            .count()
    }

    pub fn proxy(&self) -> ProxyView {
        lock(&self.proxy).clone()
    }

    pub fn update_proxy(&self, f: impl FnOnce(&mut ProxyView)) {
        f(&mut lock(&self.proxy));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(id: u64, pod: &str) -> EndpointTable {
        EndpointTable {
            id,
            pod: pod.into(),
            ips: vec![],
            audit: false,
            entries: vec![],
            rule_sets: vec![],
        }
    }

    #[test]
    fn only_a_change_wakes_the_link() {
        let s = HttpState::default();
        let mut rx = s.changed.subscribe();
        s.set_table(1, Some(t(1, "y/a")));
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        s.set_table(1, Some(t(1, "y/a")));
        assert!(!rx.has_changed().unwrap(), "the same table again");
        s.set_table(2, None);
        assert!(!rx.has_changed().unwrap(), "nothing to remove");
        s.set_table(1, None);
        assert!(rx.has_changed().unwrap());
        assert_eq!(s.table_to_send().endpoints.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_is_applied_once_the_answering_proxy_says_so() {
        let s = HttpState::default();
        let limit = std::time::Duration::from_secs(2);
        // No proxy connected: nothing to wait for.
        let g1 = s.set_table(1, Some(t(1, "y/a"))).expect("a change");
        assert!(s.applied(g1, limit).await);
        assert_eq!(
            s.set_table(1, Some(t(1, "y/a"))),
            None,
            "no change, no generation"
        );
        // A proxy that answers: waited for until it applied that generation or a later one.
        s.proxy_connected(true);
        let g2 = s.set_table(2, Some(t(2, "y/b"))).expect("a change");
        assert!(g2 > g1);
        assert_eq!(s.table_to_send().generation, g2);
        let waiting = tokio::spawn(s.applied(g2, limit));
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "not applied yet");
        s.proxy_applied(g1);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "an older generation does not do");
        s.proxy_applied(g2 + 1);
        assert!(waiting.await.unwrap());
        // Never answered: false after the limit.
        let g3 = s.set_table(3, Some(t(3, "y/c"))).expect("a change");
        s.proxy_connected(true); // a new connection: nothing applied on it yet
        assert!(!s.applied(g3, limit).await);
        // The link goes down while one waits: nothing to wait for.
        let waiting = tokio::spawn(s.applied(g3, limit));
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        s.proxy_disconnected();
        assert!(waiting.await.unwrap());
        // A proxy that does not answer tables (older): not waited for.
        s.proxy_connected(false);
        assert!(s.applied(g3 + 10, limit).await);
    }
}
