//! The endpoint registry: which endpoints exist on this node, their records and what their
//! identity was derived from, and the rules for admitting a new one (a well-formed pod name, one
//! endpoint per pod, per container and per address) and for handing out ids.
//!
//! Pure: `H` is whatever the owner reaches an endpoint through (`PolicyRepoActor` keeps the
//! endpoint actor's address; the tests keep a number).

use std::collections::BTreeMap;
use std::net::IpAddr;

use crate::datapath::EndpointId;
use crate::policy::engine::NamedPort;
use crate::policy::labels::Labels;

use super::state::EndpointRecord;

/// One registered endpoint.
#[derive(Debug, Clone)]
pub struct Entry<H> {
    pub record: EndpointRecord,
    pub handle: H,
    /// The pod labels and named ports the identity was derived from.
    pub labels: Labels,
    pub named_ports: Vec<NamedPort>,
}

/// Why an endpoint is not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("endpoint name {0:?} must be namespace/pod")]
    BadName(String),
    #[error("{0}")]
    Conflict(String),
    #[error("no free endpoint id")]
    NoFreeId,
}

/// What a new endpoint asks for.
#[derive(Debug, Clone, Copy)]
pub struct Admission<'a> {
    pub name: &'a str,
    pub container_id: Option<&'a str>,
    pub ips: &'a [IpAddr],
    /// Restoring this id from the state directory: the pod and its addresses are its own
    /// already, only the id and the container must be free.
    pub restore: Option<EndpointId>,
}

#[derive(Debug)]
pub struct Registry<H> {
    entries: BTreeMap<EndpointId, Entry<H>>,
    /// The last id handed out: ids go round, so a deleted endpoint's id is not given to a new
    /// one while messages for the old one may still be in flight.
    last_id: EndpointId,
}

impl<H> Default for Registry<H> {
    fn default() -> Self {
        Registry {
            entries: BTreeMap::new(),
            last_id: 0,
        }
    }
}

impl<H> Registry<H> {
    /// Checks a new endpoint against the registered ones; returns its `namespace/pod` key and
    /// the id it gets (the restored one, or the next free one, which is then taken).
    pub fn admit(&mut self, a: Admission<'_>) -> Result<(String, EndpointId), Refusal> {
        let key = match a.name.split_once('/') {
            Some((n, p)) if !n.is_empty() && !p.is_empty() && !p.contains('/') => a.name,
            _ => return Err(Refusal::BadName(a.name.to_string())),
        };
        let conflict = |what: String| Err(Refusal::Conflict(what));
        if let Some(cid) = a.container_id {
            if let Some(e) = self.find(|e| e.record.container_id.as_deref() == Some(cid)) {
                return conflict(format!(
                    "container {cid} already has endpoint {}",
                    e.record.id
                ));
            }
        }
        if let Some(id) = a.restore {
            if self.entries.contains_key(&id) {
                return conflict(format!("endpoint {id} exists already"));
            }
            return Ok((key.to_string(), id));
        }
        if let Some(e) = self.find(|e| e.record.name == key) {
            return conflict(format!("pod {key} already has endpoint {}", e.record.id));
        }
        for ip in a.ips {
            if let Some(e) = self.find(|e| e.record.ips.contains(ip)) {
                return conflict(format!("address {ip} is used by endpoint {}", e.record.id));
            }
        }
        let id = self.next_id().ok_or(Refusal::NoFreeId)?;
        Ok((key.to_string(), id))
    }

    fn next_id(&mut self) -> Option<EndpointId> {
        let after = self
            .last_id
            .max(self.entries.keys().next_back().copied().unwrap_or(0));
        let id = next_free_id(after, |id| self.entries.contains_key(&id))?;
        self.last_id = id;
        Some(id)
    }

    fn find(&self, f: impl Fn(&Entry<H>) -> bool) -> Option<&Entry<H>> {
        self.entries.values().find(|e| f(e))
    }

    pub fn insert(&mut self, entry: Entry<H>) {
        self.entries.insert(entry.record.id, entry);
    }

    pub fn remove(&mut self, id: EndpointId) -> Option<Entry<H>> {
        self.entries.remove(&id)
    }

    pub fn get(&self, id: EndpointId) -> Option<&Entry<H>> {
        self.entries.get(&id)
    }

    pub fn get_mut(&mut self, id: EndpointId) -> Option<&mut Entry<H>> {
        self.entries.get_mut(&id)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn ids(&self) -> Vec<EndpointId> {
        self.entries.keys().copied().collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = (EndpointId, &Entry<H>)> {
        self.entries.iter().map(|(id, e)| (*id, e))
    }

    /// The endpoint a CNI container was given.
    pub fn by_container(&self, container_id: &str) -> Option<EndpointId> {
        self.find(|e| e.record.container_id.as_deref() == Some(container_id))
            .map(|e| e.record.id)
    }

    /// The endpoints of these pods (`namespace/pod`).
    pub fn of_pods(&self, pods: &[String]) -> Vec<EndpointId> {
        self.iter()
            .filter(|(_, e)| pods.contains(&e.record.name))
            .map(|(id, _)| id)
            .collect()
    }

    /// Every address an endpoint holds, with its owner as IPAM names it (the container id, or
    /// `endpoint:ID` for endpoints made through the API).
    pub fn held_addresses(&self) -> Vec<(IpAddr, String)> {
        self.iter()
            .flat_map(|(id, e)| {
                let owner = e
                    .record
                    .container_id
                    .clone()
                    .unwrap_or_else(|| format!("endpoint:{id}"));
                e.record.ips.iter().map(move |ip| (*ip, owner.clone()))
            })
            .collect()
    }
}

/// The first id after `after` (going round past the largest) that `taken` does not hold. The
/// host endpoint's id is never handed out.
fn next_free_id(after: EndpointId, taken: impl Fn(EndpointId) -> bool) -> Option<EndpointId> {
    let max = u32::from(super::host::HOST_ENDPOINT_ID) - 1;
    let after = u32::from(after).min(max);
    (after + 1..=max)
        .chain(1..=after)
        .filter_map(|id| EndpointId::try_from(id).ok())
        .find(|id| *id != 0 && !taken(*id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: EndpointId, name: &str, ip: &str, cid: Option<&str>) -> EndpointRecord {
        EndpointRecord {
            id,
            name: name.into(),
            ips: vec![ip.parse().unwrap()],
            interface: None,
            identity: None,
            labels: vec![],
            policy_revision: 0,
            container_id: cid.map(String::from),
            netns: None,
            mac: None,
            audit: false,
            host: false,
        }
    }

    fn registry_with(records: Vec<EndpointRecord>) -> Registry<u8> {
        let mut r = Registry::default();
        for record in records {
            r.insert(Entry {
                record,
                handle: 0,
                labels: Labels::new(),
                named_ports: vec![],
            });
        }
        r
    }

    fn ask<'a>(name: &'a str, ips: &'a [IpAddr], cid: Option<&'a str>) -> Admission<'a> {
        Admission {
            name,
            container_id: cid,
            ips,
            restore: None,
        }
    }

    #[test]
    fn ids_go_round_so_a_freed_id_is_not_reused_at_once() {
        let taken = [1u16, 2, 4];
        let free = |after| next_free_id(after, |id| taken.contains(&id));
        assert_eq!(free(0), Some(3));
        assert_eq!(
            free(3),
            Some(5),
            "3 was just handed out and freed: not again"
        );
        assert_eq!(free(u16::MAX), Some(3), "wraps to the lowest free");
        assert_eq!(next_free_id(7, |_| true), None);
        // The host endpoint's id is never handed out, even when it is the only one free.
        let host = super::super::host::HOST_ENDPOINT_ID;
        assert_eq!(next_free_id(host - 2, |id| id != host), None);
        assert_eq!(next_free_id(host - 2, |id| id < host - 1), Some(host - 1));
    }

    #[test]
    fn admission_refuses_bad_names_and_anything_taken() {
        let mut r = registry_with(vec![record(1, "x/a", "10.0.0.1", Some("c1"))]);
        let ip2: Vec<IpAddr> = vec!["10.0.0.2".parse().unwrap()];
        let ip1: Vec<IpAddr> = vec!["10.0.0.1".parse().unwrap()];
        for bad in ["a", "/a", "x/", "x/a/b"] {
            assert_eq!(
                r.admit(ask(bad, &ip2, None)),
                Err(Refusal::BadName(bad.into()))
            );
        }
        let refused = |r: &mut Registry<u8>, a| match r.admit(a) {
            Err(Refusal::Conflict(m)) => m,
            other => panic!("expected a conflict, got {other:?}"),
        };
        assert_eq!(
            refused(&mut r, ask("x/a", &ip2, None)),
            "pod x/a already has endpoint 1"
        );
        assert_eq!(
            refused(&mut r, ask("x/b", &ip1, None)),
            "address 10.0.0.1 is used by endpoint 1"
        );
        assert_eq!(
            refused(&mut r, ask("x/b", &ip2, Some("c1"))),
            "container c1 already has endpoint 1"
        );
        assert_eq!(r.admit(ask("x/b", &ip2, Some("c2"))), Ok(("x/b".into(), 2)));
    }

    #[test]
    fn a_restore_keeps_its_id_and_needs_only_the_id_and_container_free() {
        let mut r = registry_with(vec![record(4, "x/a", "10.0.0.1", Some("c1"))]);
        let ip1: Vec<IpAddr> = vec!["10.0.0.1".parse().unwrap()];
        let restore = |id, cid| Admission {
            name: "x/a",
            container_id: cid,
            ips: &ip1,
            restore: Some(id),
        };
        assert_eq!(r.admit(restore(9, None)), Ok(("x/a".into(), 9)));
        assert!(matches!(
            r.admit(restore(4, None)),
            Err(Refusal::Conflict(_))
        ));
        assert!(matches!(
            r.admit(restore(9, Some("c1"))),
            Err(Refusal::Conflict(_))
        ));
        assert_eq!(
            r.admit(ask("x/b", &[], None)),
            Ok(("x/b".into(), 5)),
            "new ids follow the largest registered one"
        );
    }

    #[test]
    fn lookups_by_container_and_pod_and_the_addresses_ipam_must_keep() {
        let r = registry_with(vec![
            record(1, "x/a", "10.0.0.1", Some("c1")),
            record(2, "x/b", "10.0.0.2", None),
        ]);
        assert_eq!(r.by_container("c1"), Some(1));
        assert_eq!(r.by_container("c9"), None);
        assert_eq!(r.of_pods(&["x/b".to_string()]), vec![2]);
        assert_eq!(
            r.held_addresses(),
            vec![
                ("10.0.0.1".parse().unwrap(), "c1".to_string()),
                ("10.0.0.2".parse().unwrap(), "endpoint:2".to_string())
            ]
        );
    }
}
