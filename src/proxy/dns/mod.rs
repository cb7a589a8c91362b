//! The transparent DNS proxy (`ciliate dns-proxy`): DNS-aware policy for endpoints whose
//! egress rules carry DNS rules.
//!
//! It is a process of its own so that pods' DNS keeps working while the agent restarts or is
//! killed: the datapath hands it the endpoints' DNS packets (`bpf/lib/proxy.h`), it checks
//! each query against the endpoint's DNS rules (the table the agent pushed last, also kept on
//! disk), forwards the allowed ones to the server the pod asked, and tells the agent the
//! addresses of allowed answers, holding the answer until the agent says every affected
//! policy map holds them. While no agent is connected it keeps answering by the last rules and
//! queues what it learned for the agent's return.
//!
//! - this module: the wire protocol between agent and proxy (JSON lines on a Unix socket in
//!   the state directory) and the proxy's pure state: which endpoint a source address is, and
//!   what its DNS rules say (`policy::l7::dns::dns_ruling`);
//! - [`server`]: the process (sockets, policy routing, the pinned maps);
//! - [`state`]: the agent's side (FQDN cache, endpoints' rules, the proxy as last seen);
//! - [`upstream`]: queries to the servers, on shared sockets;
//! - [`wire`]: DNS messages through hickory-proto (questions, REFUSED answers, addresses).

pub mod limit;
pub mod server;
pub mod state;
pub mod upstream;
pub mod wire;

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::policy::l7::dns::{dns_ruling, DnsRuleEntry, DnsRuling};

/// The proxy's socket for its agent, in the agent's state directory.
pub fn socket_path(state_dir: &Path) -> PathBuf {
    state_dir.join("dns-proxy.sock")
}

/// The last rules the proxy received, kept for a restart of the proxy itself.
pub fn rules_path(state_dir: &Path) -> PathBuf {
    state_dir.join("dns-proxy-rules.json")
}

/// One endpoint's DNS rules as the proxy needs them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointRules {
    pub id: u64,
    /// `namespace/name`.
    pub pod: String,
    pub ips: Vec<IpAddr>,
    pub entries: Vec<DnsRuleEntry>,
}

/// Every endpoint with DNS rules.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyRules {
    pub endpoints: Vec<EndpointRules>,
    /// The agent's count of rule changes this table includes: the proxy answers
    /// `FromProxy::Applied` with it once it decides by the table (0: not counted).
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
    /// The whole table (sent on connect and on every change).
    Rules(ProxyRules),
    /// The learning `seq` is in every affected policy map: release the answer. Its addresses
    /// stay selected for its name until `expires_at` (seconds since the epoch), so the proxy
    /// need not wait for the same answer again before then.
    Ack {
        seq: u64,
        #[serde(default)]
        expires_at: u64,
    },
}

/// An allowed answer's addresses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Learned {
    pub seq: u64,
    pub endpoint: u64,
    pub name: String,
    pub ips: Vec<IpAddr>,
    pub ttl: u32,
}

/// One DNS verdict (`ciliate monitor` type `dns`): what the monitor shows, and the time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DnsVerdict {
    pub endpoint: u64,
    #[serde(flatten)]
    pub fields: crate::datapath::events::DnsFields,
    /// Time spent in the proxy, without the upstream server's.
    pub processing_seconds: f64,
    /// The query's connection: the pod's address, the server's, and the protocol (17, 6).
    /// Absent from a proxy older than the agent: the verdict is then a `dns` event only, not
    /// a flow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conn: Option<DnsConn>,
}

/// The pod's and the server's sockets of one query, and its protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DnsConn {
    pub client: std::net::SocketAddr,
    pub server: std::net::SocketAddr,
    pub protocol: u8,
}

/// Proxy -> agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FromProxy {
    /// Sent first on every connection.
    Hello {
        pid: u32,
        udp_port: u16,
        tcp_port: u16,
        /// It answers every rules table with `Applied` (older proxies do not: not waited for).
        #[serde(default)]
        acks_rules: bool,
    },
    /// The rules table of that generation is the one queries are decided by now.
    Applied {
        generation: u64,
    },
    Learn(Learned),
    Verdict(DnsVerdict),
}

/// What the proxy decides for one query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Forward {
        endpoint: u64,
        pod: String,
        policies: Vec<String>,
    },
    Refuse {
        endpoint: u64,
        pod: String,
        policies: Vec<String>,
    },
}

/// The proxy's rules, indexed by source address.
#[derive(Debug, Clone, Default)]
pub struct RuleIndex {
    by_ip: HashMap<IpAddr, usize>,
    rules: ProxyRules,
}

impl RuleIndex {
    pub fn new(rules: ProxyRules) -> RuleIndex {
        let mut by_ip = HashMap::new();
        for (i, e) in rules.endpoints.iter().enumerate() {
            for ip in &e.ips {
                by_ip.insert(*ip, i);
            }
        }
        RuleIndex { by_ip, rules }
    }

    pub fn rules(&self) -> &ProxyRules {
        &self.rules
    }

    /// A query of `name` from `source` to a server of identity `server` on `protocol` port
    /// `port`. A source the table does not know is refused: the datapath only sends DNS of
    /// endpoints with DNS rules, so an unknown one means rules not received yet (fail closed).
    pub fn decide(
        &self,
        source: IpAddr,
        server: u32,
        protocol: u8,
        port: u16,
        name: &str,
    ) -> Decision {
        let Some(e) = self.by_ip.get(&source).map(|i| &self.rules.endpoints[*i]) else {
            return Decision::Refuse {
                endpoint: 0,
                pod: String::new(),
                policies: vec![],
            };
        };
        let (endpoint, pod) = (e.id, e.pod.clone());
        match dns_ruling(&e.entries, server, protocol, port, name) {
            DnsRuling::Forward(policies) => Decision::Forward {
                endpoint,
                pod,
                policies,
            },
            DnsRuling::Refuse(policies) => Decision::Refuse {
                endpoint,
                pod,
                policies,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::fqdn::FqdnPattern;

    #[test]
    fn queries_are_decided_by_the_sources_endpoint_and_unknown_sources_are_refused() {
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        let idx = RuleIndex::new(ProxyRules {
            endpoints: vec![EndpointRules {
                id: 7,
                pod: "x/a".into(),
                ips: vec![ip],
                entries: vec![DnsRuleEntry {
                    servers: vec![300],
                    protocol: 17,
                    port_lo: 53,
                    port_hi: 53,
                    names: Some(vec![FqdnPattern::pattern("*.example.com")]),
                    policy: "CiliumNetworkPolicy x/dns[0]".into(),
                }],
            }],
            generation: 0,
        });
        let forward = idx.decide(ip, 300, 17, 53, "API.example.com.");
        assert!(
            matches!(forward, Decision::Forward { endpoint: 7, ref policies, .. } if policies.len() == 1)
        );
        assert!(matches!(
            idx.decide(ip, 300, 17, 53, "evil.test"),
            Decision::Refuse { endpoint: 7, .. }
        ));
        let stranger = idx.decide("10.0.0.6".parse().unwrap(), 300, 17, 53, "a.example.com");
        assert!(matches!(stranger, Decision::Refuse { endpoint: 0, .. }));
    }

    /// A query for a name of raw labels, as a pod may send it.
    fn raw_query(labels: &[&[u8]]) -> Vec<u8> {
        use hickory_proto::op::{Message, MessageType, Query};
        use hickory_proto::rr::{domain::Label, Name, RecordType};
        let name =
            Name::from_labels(labels.iter().map(|l| Label::from_raw_bytes(l).unwrap())).unwrap();
        let mut m = Message::new();
        m.set_id(1)
            .set_message_type(MessageType::Query)
            .add_query(Query::query(name, RecordType::A));
        m.to_vec().unwrap()
    }

    #[test]
    fn a_wildcard_never_lets_odd_bytes_through_the_proxy() {
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        let idx = RuleIndex::new(ProxyRules {
            endpoints: vec![EndpointRules {
                id: 7,
                pod: "x/a".into(),
                ips: vec![ip],
                entries: vec![DnsRuleEntry {
                    servers: vec![],
                    protocol: 17,
                    port_lo: 53,
                    port_hi: 53,
                    names: Some(vec![FqdnPattern::pattern("*.example.com")]),
                    policy: "CiliumNetworkPolicy x/dns[0]".into(),
                }],
            }],
            generation: 0,
        });
        let decide = |first: &[u8]| {
            let q = wire::question(&raw_query(&[first, b"example", b"com"])).unwrap();
            (idx.decide(ip, 300, 17, 53, &q.name), q.name)
        };
        for odd in [
            &b"\0"[..],
            b"a\0b",
            b"*",
            b"a*",
            b"\xff",
            b"\xfe",
            b"\x80",
            b"x\xff\xfe\x80",
            b"a.b",
            b"a\\b",
            b"a b",
            b"\\000",
        ] {
            let (d, name) = decide(odd);
            assert!(
                matches!(d, Decision::Refuse { .. }),
                "{odd:?} as {name:?}: {d:?}"
            );
        }
        for ok in [&b"api"[..], b"API", b"-lead", b"a_b-c9"] {
            let (d, name) = decide(ok);
            assert!(
                matches!(d, Decision::Forward { .. }),
                "{ok:?} as {name:?}: {d:?}"
            );
        }
    }
}
