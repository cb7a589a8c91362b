//! Traffic analysis (interfaces section 16): the connections an agent has observed, kept
//! compactly (`history`), read from a file of flows instead (`flowfile`: `ciliate monitor -o
//! json`, Hubble's `hubble observe -o jsonpb`), replayed against policies (`replay`): what a
//! change would flip (`diff`), and least-privilege policies for what was seen (`recommend`).
//!
//! Pure: no I/O but the parsing of text handed in, no actix, kube or libbpf. The agent feeds
//! the history from its flows (`agent::history`); the CLI reads files.

pub mod diff;
pub mod flowfile;
pub mod history;
pub mod observe;
pub mod recommend;
pub mod replay;

use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::policy::attribution::PolicyRef;
use crate::policy::labels::{NAMESPACE_LABELS_PREFIX, POD_NAMESPACE_LABEL};

/// One side of an observed connection: a workload (its identity's labels, `k8s:app=a`, with
/// the namespace and one of its pods as an example), or an address outside the pods (its
/// labels, `reserved:world` or `reserved:host`, and the DNS names the agent learned it under).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Peer {
    /// The pod's namespace; `None` for anything but a pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// One pod of the workload (the first seen): an example, not part of what the peer is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The identity's labels, `source:key=value`, sorted (shared by the peers of one
    /// identity in a history).
    #[serde(default, skip_serializing_if = "is_empty")]
    pub labels: Arc<[String]>,
    /// The address: what an outside peer is; a pod's first seen (an example).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<IpAddr>,
    /// DNS names the address was learned under (the DNS proxy's), sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<String>,
}

impl Peer {
    /// A peer from an identity's labels: a pod when they name its namespace.
    pub fn new(mut labels: Vec<String>, ip: Option<IpAddr>, mut names: Vec<String>) -> Peer {
        labels.sort();
        labels.dedup();
        names.sort();
        names.dedup();
        let ns_label = format!("k8s:{POD_NAMESPACE_LABEL}=");
        let namespace = labels
            .iter()
            .find_map(|l| l.strip_prefix(&ns_label))
            .map(str::to_string);
        Peer {
            namespace,
            pod: None,
            labels: labels.into(),
            ip,
            names,
        }
    }

    /// Hashes what the peer is (`key`'s fields), without making the key.
    pub fn hash_key<H: Hasher>(&self, h: &mut H) {
        self.namespace.hash(h);
        self.labels.hash(h);
        if !self.is_pod() {
            self.ip.hash(h);
            self.names.hash(h);
        }
    }

    /// Whether two peers are the same (`key`s equal), without making the keys.
    pub fn same(&self, o: &Peer) -> bool {
        self.namespace == o.namespace
            && self.labels == o.labels
            && (self.is_pod() || (self.ip == o.ip && self.names == o.names))
    }

    pub fn is_pod(&self) -> bool {
        self.namespace.is_some()
    }

    pub fn has_label(&self, label: &str) -> bool {
        self.labels.iter().any(|l| l == label)
    }

    /// What the peer is, without its examples: a pod is its labels (its workload), anything
    /// else its labels, address and names.
    pub fn key(&self) -> Peer {
        if self.is_pod() {
            Peer {
                namespace: self.namespace.clone(),
                labels: self.labels.clone(),
                ..Peer::default()
            }
        } else {
            Peer {
                pod: None,
                ..self.clone()
            }
        }
    }

    /// The pod's own labels (`key=value`), without those Cilium derives from its namespace,
    /// service account and cluster.
    pub fn pod_labels(&self) -> impl Iterator<Item = (&str, &str)> {
        self.labels.iter().filter_map(|l| {
            let kv = l.strip_prefix("k8s:")?;
            let (k, v) = kv.split_once('=')?;
            let derived = k == POD_NAMESPACE_LABEL
                || k.starts_with(NAMESPACE_LABELS_PREFIX)
                || k.starts_with("io.cilium.k8s.policy.");
            (!derived).then_some((k, v))
        })
    }

    /// How the peer is shown: `x/a-1 (app=a)`, `203.0.113.9 (example.com)`, `10.0.0.1 (host)`.
    pub fn describe(&self) -> String {
        if self.is_pod() {
            let labels: Vec<String> = self.pod_labels().map(|(k, v)| format!("{k}={v}")).collect();
            let who = match (&self.pod, &self.namespace) {
                (Some(p), _) => p.clone(),
                (None, Some(ns)) => format!("{ns}/*"),
                (None, None) => String::new(),
            };
            return format!("{who} ({})", labels.join(","));
        }
        let ip = self.ip.map(|i| i.to_string()).unwrap_or_else(|| "?".into());
        if !self.names.is_empty() {
            return format!("{ip} ({})", self.names.join(", "));
        }
        let reserved: Vec<&str> = self
            .labels
            .iter()
            .filter_map(|l| l.strip_prefix("reserved:"))
            .collect();
        match reserved.is_empty() {
            true => ip,
            false => format!("{ip} ({})", reserved.join(",")),
        }
    }
}

fn is_empty(l: &Arc<[String]>) -> bool {
    l.is_empty()
}

/// One observed connection, as the agent's API and `policy diff -o json` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Connection {
    pub source: Peer,
    pub destination: Peer,
    pub protocol: String,
    /// Destination port, or the ICMP type.
    pub port: u16,
    /// The last verdict observed: `forwarded` or `dropped`.
    pub verdict: String,
    /// New connections observed (at whichever end saw more of them).
    pub count: u64,
    /// Unix seconds.
    pub first_seen: u64,
    pub last_seen: u64,
    /// The policies that decided the last one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<PolicyRef>,
}

/// Unix seconds as RFC 3339 (`2026-11-29T08:00:00Z`).
pub fn rfc3339(secs: u64) -> String {
    chrono::DateTime::from_timestamp(secs as i64, 0)
        .map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_else(|| secs.to_string())
}

/// `--flow-history` and `--since`: `30s`, `15m`, `24h`, `7d` in seconds.
pub fn parse_duration(flag: &str, s: &str) -> Result<u64, String> {
    let ms =
        crate::datapath::flows::since_to_ms(s, u64::MAX).map_err(|e| e.replace("--since", flag))?;
    Ok((u64::MAX - ms) / 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_its_labels_and_an_outside_peer_its_address_too() {
        let a1 = Peer {
            pod: Some("x/a-1".into()),
            ip: Some("10.0.0.1".parse().unwrap()),
            ..Peer::new(
                vec![
                    "k8s:app=a".into(),
                    "k8s:io.kubernetes.pod.namespace=x".into(),
                ],
                None,
                vec![],
            )
        };
        assert_eq!(a1.namespace.as_deref(), Some("x"));
        assert_eq!(a1.key().pod, None);
        assert_eq!(a1.key().ip, None);
        assert_eq!(a1.pod_labels().collect::<Vec<_>>(), vec![("app", "a")]);
        assert_eq!(a1.describe(), "x/a-1 (app=a)");
        let w = Peer::new(
            vec!["reserved:world".into()],
            Some("203.0.113.9".parse().unwrap()),
            vec!["b.example".into(), "a.example".into()],
        );
        assert!(!w.is_pod());
        assert_eq!(w.key(), w);
        assert_eq!(w.describe(), "203.0.113.9 (a.example, b.example)");
    }

    #[test]
    fn durations_read_as_the_flags_say() {
        assert_eq!(parse_duration("--flow-history", "24h"), Ok(86_400));
        assert_eq!(parse_duration("--since", "90s"), Ok(90));
        let e = parse_duration("--flow-history", "a day").unwrap_err();
        assert!(e.contains("--flow-history"), "{e}");
    }
}
