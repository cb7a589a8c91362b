//! The agent's side of the HTTP proxy, shared by its actors and its proxy link: each
//! endpoint's part of the table (what the proxy is sent) and what the agent knows of the
//! proxy.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::Serialize;

use super::{EndpointTable, ProxyTable};
use crate::proxy::applied::TableSync;
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
    /// The tables' generation (the link sends the table again on every change) and what the
    /// proxy said it applied.
    pub sync: TableSync,
    pub proxy: Mutex<ProxyView>,
}

impl Default for HttpState {
    fn default() -> Self {
        HttpState {
            tables: Mutex::new(BTreeMap::new()),
            sync: TableSync::default(),
            proxy: Mutex::new(ProxyView::default()),
        }
    }
}

impl HttpState {
    /// Sets (or, with `None`, removes) an endpoint's table; the link is told when it changed.
    /// Returns the generation that includes the change (`None`: nothing changed).
    pub fn set_table(&self, endpoint: u64, table: Option<EndpointTable>) -> Option<u64> {
        self.sync.set(&mut lock(&self.tables), endpoint, table)
    }

    /// The whole table, with the generation it includes (sent to the proxy).
    pub fn table_to_send(&self) -> ProxyTable {
        let t = lock(&self.tables);
        ProxyTable {
            endpoints: t.values().cloned().collect(),
            generation: self.sync.generation(),
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
        let mut rx = s.sync.changed.subscribe();
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

    #[test]
    fn a_change_has_a_generation_and_the_table_sent_says_which() {
        let s = HttpState::default();
        let g1 = s.set_table(1, Some(t(1, "y/a"))).expect("a change");
        assert_eq!(
            s.set_table(1, Some(t(1, "y/a"))),
            None,
            "no change, no generation"
        );
        let g2 = s.set_table(2, Some(t(2, "y/b"))).expect("a change");
        assert!(g2 > g1);
        assert_eq!(s.table_to_send().generation, g2);
        assert_eq!(s.set_table(2, None), Some(g2 + 1));
    }
}
