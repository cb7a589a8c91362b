//! The HTTP proxy (`ciliate http-proxy`): L7 HTTP policy and TLS server names, for the
//! connections an allow entry with an L7 rule lets through (`bpf/lib/proxy.h`).
//!
//! - this module: the agent <-> proxy protocol (JSON lines on `STATE_DIR/http-proxy.sock`)
//!   and the proxy's table, pure: each endpoint's allow entries for the ports the proxy sees,
//!   every allowing rule with its L7 part, looked up as the datapath looks up the policy map;
//! - [`table`]: the table built from an endpoint's resolved policy (the agent's side);
//! - [`request`]: what the proxy refuses before any rule (duplicate Host, malformed targets)
//!   and its answers (403, gRPC `PERMISSION_DENIED`); [`framing`]: the ambiguous framing
//!   hyper would accept (Content-Length with Transfer-Encoding, or twice), refused `400`;
//! - [`sni`]: the server name of a TLS ClientHello;
//! - [`server`]: the process (listeners, HTTP/1.1 and HTTP/2 through hyper, upstream
//!   connections as the pod, hand-over of the listeners to a successor);
//! - [`state`]: the agent's side (each endpoint's table, the proxy as last seen).

pub mod framing;
pub mod park;
pub mod pool;
pub mod request;
pub mod server;
pub mod sni;
pub mod spin;
pub mod state;
pub mod table;
pub mod upstream;

use std::borrow::Cow;
use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::datapath::events::HttpFields;
use crate::policy::attribution::PolicyRef;
use crate::policy::l7::http::{CompiledRules, L7PortRules};

/// The proxy's socket for its agent, in the agent's state directory.
pub fn socket_path(state_dir: &Path) -> PathBuf {
    state_dir.join("http-proxy.sock")
}

/// Where a successor asks for the listening sockets (hand-over).
pub fn handover_path(state_dir: &Path) -> PathBuf {
    state_dir.join("http-proxy-handover.sock")
}

/// The last table the proxy received, kept for its own restart.
pub fn rules_path(state_dir: &Path) -> PathBuf {
    state_dir.join("http-proxy-rules.json")
}

/// One allowing rule of an entry: its name, and its L7 part (an index into the endpoint's
/// `rule_sets`; `None`: an L3/L4 allow, every request).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireGrant {
    pub rule: String,
    /// The same rule, for flows.
    pub policy: PolicyRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<usize>,
}

/// One allow entry of an endpoint's policy map the proxy may need.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableEntry {
    pub egress: bool,
    /// 0: any peer.
    pub identity: u32,
    /// 0: any protocol.
    pub protocol: u8,
    pub port_lo: u16,
    pub port_hi: u16,
    pub grants: Vec<WireGrant>,
}

/// One endpoint's entries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointTable {
    pub id: u64,
    /// `namespace/name`.
    pub pod: String,
    pub ips: Vec<IpAddr>,
    /// Audit mode: a request its rules deny passes, reported as `audit`.
    #[serde(default)]
    pub audit: bool,
    pub entries: Vec<TableEntry>,
    /// The L7 parts its entries refer to.
    pub rule_sets: Vec<L7PortRules>,
}

/// Every endpoint with L7 rules: the whole table (sent on connect and on every change).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyTable {
    pub endpoints: Vec<EndpointTable>,
    /// The agent's count of table changes this table includes: the proxy answers
    /// `FromProxy::Applied` with it once it judges by the table (0: not counted).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Agent -> proxy.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToProxy {
    Table(ProxyTable),
}

/// One request the proxy judged: a flow record (`ciliate monitor --type l7`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct L7Record {
    pub endpoint: u64,
    /// `ingress` or `egress`, of the endpoint.
    pub direction: Cow<'static, str>,
    /// `forwarded`, `dropped` or `audit`.
    pub verdict: Cow<'static, str>,
    /// `address:port` of the client and the server (shared by a connection's records).
    pub source: Arc<str>,
    pub destination: Arc<str>,
    pub port: u16,
    pub peer_identity: u32,
    pub http: HttpFields,
    /// Time the proxy added, without the server's.
    pub latency_ns: u64,
    /// The deciding rules (with the HTTP rule that matched), or those considered.
    pub policies: Vec<PolicyRef>,
    /// Nanoseconds since the epoch.
    pub time_ns: u64,
}

/// Proxy -> agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FromProxy {
    /// Sent first on every connection.
    Hello {
        pid: u32,
        egress_port: u16,
        ingress_port: u16,
        /// It answers every table with `Applied` (older proxies do not: not waited for).
        #[serde(default)]
        acks_tables: bool,
    },
    /// The table of that generation is the one requests are judged by now.
    Applied {
        generation: u64,
    },
    Record(Box<L7Record>),
    /// Every second: what the proxy holds.
    Stats(ProxyStats),
}

/// What the HTTP proxy holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyStats {
    /// Client connections open (parked ones included).
    pub connections: u64,
    /// Client connections idle long enough to be parked (no HTTP state held).
    pub parked: u64,
    /// Idle upstream connections kept for the next request.
    pub upstream_idle: u64,
    /// Records of requests the agent never got (it was not reading, or too slow), since start.
    #[serde(default)]
    pub records_dropped: u64,
    /// The generation of the table it judges by (repeats a lost `Applied`).
    #[serde(default)]
    pub table_generation: u64,
}

/// One grant for a request, ready to judge by (`policy::l7::http::judge`).
#[derive(Clone)]
pub struct IndexedGrant {
    pub rule: Arc<str>,
    pub policy: Arc<PolicyRef>,
    pub rules: Option<Arc<CompiledRules>>,
}

/// The grants for one request.
pub type Grants = Vec<IndexedGrant>;

struct IndexedEndpoint {
    id: u64,
    pod: Arc<str>,
    audit: bool,
    /// (egress, identity) -> entries.
    groups: HashMap<(bool, u32), Vec<IndexedEntry>>,
}

struct IndexedEntry {
    protocol: u8,
    port_lo: u16,
    port_hi: u16,
    grants: Grants,
}

/// Which endpoint a connection belongs to, and what its rules say.
pub struct Lookup {
    pub endpoint: u64,
    pub pod: Arc<str>,
    pub audit: bool,
    /// `None`: no allow entry for this peer and port has L7 rules now (the policy changed
    /// since the connection was redirected): its requests pass, as the datapath lets an
    /// established connection's packets pass.
    pub grants: Option<Grants>,
}

/// The proxy's table, indexed by endpoint address, with compiled rules.
#[derive(Default)]
pub struct Index {
    by_ip: HashMap<IpAddr, usize>,
    endpoints: Vec<IndexedEndpoint>,
}

/// Compiled rule sets by content: a table update recompiles only what is new.
#[derive(Default)]
pub struct RuleCache(HashMap<L7PortRules, Arc<CompiledRules>>);

impl RuleCache {
    fn get(&mut self, r: &L7PortRules) -> Option<Arc<CompiledRules>> {
        if let Some(c) = self.0.get(r) {
            return Some(c.clone());
        }
        // The agent sends only rules translation compiled; a rule that fails here matches
        // nothing (its requests are denied), never everything.
        match CompiledRules::compile(Arc::new(r.clone())) {
            Ok(c) => {
                let c = Arc::new(c);
                self.0.insert(r.clone(), c.clone());
                Some(c)
            }
            Err(e) => {
                tracing::error!(error = %e, "HTTP proxy: a rule set did not compile; it matches nothing");
                None
            }
        }
    }

    /// Keeps only the rule sets `table` uses.
    fn retain(&mut self, table: &ProxyTable) {
        let used: std::collections::HashSet<&L7PortRules> = table
            .endpoints
            .iter()
            .flat_map(|e| e.rule_sets.iter())
            .collect();
        self.0.retain(|k, _| used.contains(k));
    }
}

/// A rule set that could not be compiled: nothing matches it.
fn nothing() -> Arc<CompiledRules> {
    Arc::new(
        CompiledRules::compile(Arc::new(L7PortRules {
            http: vec![crate::policy::l7::http::HttpRule {
                method: Some("[^\\s\\S]".into()),
                ..Default::default()
            }],
            server_names: vec![],
        }))
        .expect("a constant rule compiles"),
    )
}

impl Index {
    /// Indexes `table`, compiling its rule sets through `cache`.
    pub fn new(table: &ProxyTable, cache: &mut RuleCache) -> Index {
        let mut idx = Index::default();
        let mut names: HashMap<&str, (Arc<str>, Arc<PolicyRef>)> = HashMap::new();
        for e in &table.endpoints {
            let compiled: Vec<Arc<CompiledRules>> = e
                .rule_sets
                .iter()
                .map(|r| cache.get(r).unwrap_or_else(nothing))
                .collect();
            let mut groups: HashMap<(bool, u32), Vec<IndexedEntry>> = HashMap::new();
            for t in &e.entries {
                let grants = t
                    .grants
                    .iter()
                    .map(|g| {
                        let (rule, policy) = names
                            .entry(g.rule.as_str())
                            .or_insert_with(|| {
                                (Arc::from(g.rule.as_str()), Arc::new(g.policy.clone()))
                            })
                            .clone();
                        // An index out of range (a broken table) matches nothing.
                        let rules = g
                            .rules
                            .map(|i| compiled.get(i).cloned().unwrap_or_else(nothing));
                        IndexedGrant {
                            rule,
                            policy,
                            rules,
                        }
                    })
                    .collect();
                groups
                    .entry((t.egress, t.identity))
                    .or_default()
                    .push(IndexedEntry {
                        protocol: t.protocol,
                        port_lo: t.port_lo,
                        port_hi: t.port_hi,
                        grants,
                    });
            }
            let i = idx.endpoints.len();
            idx.endpoints.push(IndexedEndpoint {
                id: e.id,
                pod: Arc::from(e.pod.as_str()),
                audit: e.audit,
                groups,
            });
            for ip in &e.ips {
                idx.by_ip.insert(*ip, i);
            }
        }
        cache.retain(table);
        idx
    }

    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    /// The endpoint at `ip`, and every allowing grant of its `egress`/ingress entries for
    /// `peer` on TCP `port` (entries of the peer first, then of any peer). `None` when no
    /// endpoint has that address.
    pub fn lookup(&self, ip: IpAddr, egress: bool, peer: u32, port: u16) -> Option<Lookup> {
        let ep = &self.endpoints[*self.by_ip.get(&ip)?];
        let mut grants: Grants = Vec::new();
        let mut any = false;
        for id in [peer, 0] {
            for e in ep.groups.get(&(egress, id)).into_iter().flatten() {
                if (e.protocol == 0 || e.protocol == 6) && e.port_lo <= port && port <= e.port_hi {
                    any = true;
                    grants.extend(e.grants.iter().cloned());
                }
            }
            if peer == 0 {
                break;
            }
        }
        let l7 = grants.iter().any(|g| g.rules.is_some());
        Some(Lookup {
            endpoint: ep.id,
            pod: ep.pod.clone(),
            audit: ep.audit,
            grants: (any && l7).then_some(grants),
        })
    }

    /// The endpoint id of an address, for the proxy's connections made as the pod.
    pub fn endpoint_of(&self, ip: IpAddr) -> Option<u64> {
        self.by_ip.get(&ip).map(|i| self.endpoints[*i].id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::l7::http::{judge, Grant, HttpRule, RequestView};

    fn grant(name: &str, rule: usize, rules: Option<usize>) -> WireGrant {
        let policy = PolicyRef {
            kind: "CiliumNetworkPolicy".into(),
            namespace: Some("y".into()),
            name: name.into(),
            rule: Some(rule),
            http: None,
            tier: Default::default(),
        };
        WireGrant {
            rule: policy.named(),
            policy,
            rules,
        }
    }

    fn table() -> ProxyTable {
        let get = L7PortRules {
            http: vec![HttpRule {
                method: Some("GET".into()),
                ..Default::default()
            }],
            server_names: vec![],
        };
        ProxyTable {
            endpoints: vec![EndpointTable {
                id: 7,
                pod: "y/echo".into(),
                ips: vec!["10.0.0.7".parse().unwrap()],
                audit: false,
                entries: vec![
                    TableEntry {
                        egress: false,
                        identity: 300,
                        protocol: 6,
                        port_lo: 8080,
                        port_hi: 8080,
                        grants: vec![grant("echo", 0, Some(0))],
                    },
                    TableEntry {
                        egress: false,
                        identity: 0,
                        protocol: 0,
                        port_lo: 0,
                        port_hi: 65535,
                        grants: vec![grant("ops", 0, None)],
                    },
                    TableEntry {
                        egress: false,
                        identity: 301,
                        protocol: 6,
                        port_lo: 8080,
                        port_hi: 8080,
                        grants: vec![grant("echo", 1, Some(0))],
                    },
                ],
                rule_sets: vec![get],
            }],
            generation: 0,
        }
    }

    fn verdict(l: &Lookup, method: &str) -> bool {
        let g: Vec<Grant> = l
            .grants
            .iter()
            .flatten()
            .map(|g| Grant {
                rule: &g.rule,
                rules: g.rules.as_deref(),
            })
            .collect();
        let none: Vec<(String, String)> = vec![];
        judge(
            &g,
            &RequestView {
                method,
                path: "/",
                host: "",
                headers: &none,
            },
        )
        .is_allowed()
    }

    #[test]
    fn a_lookup_gathers_the_peers_entries_and_any_peers_like_the_policy_map() {
        let mut cache = RuleCache::default();
        let idx = Index::new(&table(), &mut cache);
        let ip: IpAddr = "10.0.0.7".parse().unwrap();
        let l = idx.lookup(ip, false, 300, 8080).unwrap();
        assert_eq!((l.endpoint, &*l.pod), (7, "y/echo"));
        assert_eq!(
            l.grants.as_ref().unwrap().len(),
            2,
            "its entry and the L3-only one"
        );
        assert!(
            verdict(&l, "POST"),
            "the L3-only allow lets every request through"
        );
        // Only the wildcard entry on another port or for another peer.
        assert!(
            idx.lookup(ip, false, 999, 9090).unwrap().grants.is_none(),
            "only the L3-only allow: no L7 rule applies"
        );
        assert!(idx.lookup(ip, true, 300, 8080).unwrap().grants.is_none());
        assert!(idx
            .lookup("10.0.0.8".parse().unwrap(), false, 300, 8080)
            .is_none());
        assert_eq!(cache.0.len(), 1, "the rule set is compiled once");
    }

    #[test]
    fn an_entry_without_the_l3_only_allow_judges_by_its_http_rules() {
        let mut t = table();
        t.endpoints[0].entries.remove(1);
        let idx = Index::new(&t, &mut RuleCache::default());
        let l = idx
            .lookup("10.0.0.7".parse().unwrap(), false, 301, 8080)
            .unwrap();
        assert!(verdict(&l, "GET"));
        assert!(!verdict(&l, "POST"));
    }
}
