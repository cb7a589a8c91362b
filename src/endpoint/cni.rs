//! The CNI ADD sequence's rollback guard, pure: an ADD records each thing it made, in order
//! (the address, the intent record, the veth pair, the endpoint); when a later step fails, the
//! guard says what to undo, newest first. The intent record goes last, so a crash in the
//! middle of the undo is still rolled back by the next agent (`cni::recover`). `api::cni`
//! carries the steps out.

use std::net::IpAddr;

use crate::datapath::EndpointId;

/// One thing to undo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Undo {
    /// Delete the endpoint (its programs, maps and record).
    Endpoint(EndpointId),
    /// Delete the host-side veth (its pod side goes with it). If this fails the address may
    /// still be on the pod's side: the undo stops there, keeping the address and the intent
    /// record for the next agent or a DEL.
    Interface(String),
    /// Give the address back to IPAM.
    Address(IpAddr),
    /// Remove the intent record of the ADD.
    Intent(String),
}

/// What an ADD has made so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddProgress {
    container_id: String,
    ips: Vec<IpAddr>,
    interface: Option<String>,
    endpoint: Option<EndpointId>,
}

impl AddProgress {
    /// The addresses (one per family) are allocated and the intent record written.
    pub fn new(container_id: &str, ips: &[IpAddr]) -> AddProgress {
        AddProgress {
            container_id: container_id.to_string(),
            ips: ips.to_vec(),
            interface: None,
            endpoint: None,
        }
    }

    /// The veth pair exists.
    pub fn made_interface(&mut self, name: &str) {
        self.interface = Some(name.to_string());
    }

    /// The endpoint exists.
    pub fn made_endpoint(&mut self, id: EndpointId) {
        self.endpoint = Some(id);
    }

    /// What to undo, newest first.
    pub fn undo(&self) -> Vec<Undo> {
        let mut out = Vec::new();
        if let Some(id) = self.endpoint {
            out.push(Undo::Endpoint(id));
        }
        if let Some(name) = &self.interface {
            out.push(Undo::Interface(name.clone()));
        }
        out.extend(self.ips.iter().map(|ip| Undo::Address(*ip)));
        out.push(Undo::Intent(self.container_id.clone()));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_add_is_undone_newest_first_with_the_intent_record_last() {
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        let mut p = AddProgress::new("c1", &[ip]);
        assert_eq!(
            p.undo(),
            vec![Undo::Address(ip), Undo::Intent("c1".into())],
            "failed before the interface: the address and the record"
        );
        let ip6: IpAddr = "fd00::5".parse().unwrap();
        assert_eq!(
            AddProgress::new("c2", &[ip, ip6]).undo(),
            vec![
                Undo::Address(ip),
                Undo::Address(ip6),
                Undo::Intent("c2".into())
            ],
            "dual stack: both addresses go back"
        );
        p.made_interface("lxc0123");
        p.made_endpoint(7);
        assert_eq!(
            p.undo(),
            vec![
                Undo::Endpoint(7),
                Undo::Interface("lxc0123".into()),
                Undo::Address(ip),
                Undo::Intent("c1".into()),
            ]
        );
    }
}
