//! Restore validates before it trusts (Cilium's `restoreOldEndpoints` drops the endpoints it
//! cannot use). An endpoint the CNI plugin made whose host interface or network namespace
//! vanished while the agent was down is not restored: its record goes, its address is free
//! again, and its pinned programs and policy map are swept with the other strays. In Kubernetes
//! mode an endpoint whose pod no longer exists after the initial sync is removed as a CNI DEL
//! would remove it (`run.rs`). Every outcome is logged, one line per endpoint, and counted in
//! `ciliate_endpoint_restore_total{outcome}`.
//!
//! Endpoints registered through the API (`ciliate endpoint add`, no container id) belong to
//! whoever registered them: they are never removed for a missing interface.

use std::path::Path;

use crate::endpoint::state::EndpointRecord;

/// What start-up decided for one saved endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    Restored,
    /// Its host interface is gone.
    InterfaceGone,
    /// Its network namespace is gone.
    NetnsGone,
    /// Another record claims its address (kept aside for a human).
    DuplicateAddress,
    /// Its pod no longer exists (Kubernetes mode, after the initial sync).
    PodGone,
    /// Pinned programs or a policy map of an endpoint id no record names.
    StrayPins,
}

impl Outcome {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Restored => "restored",
            Outcome::InterfaceGone => "interface_gone",
            Outcome::NetnsGone => "netns_gone",
            Outcome::DuplicateAddress => "duplicate_address",
            Outcome::PodGone => "pod_gone",
            Outcome::StrayPins => "stray_pins",
        }
    }
}

/// What exists on the node for a record's interface and namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Presence {
    pub interface: bool,
    pub netns: bool,
}

/// The decision for one record, given what exists (pure).
pub fn judge(rec: &EndpointRecord, present: Presence) -> Outcome {
    if rec.container_id.is_none() {
        return Outcome::Restored;
    }
    if rec.interface.is_some() && !present.interface {
        Outcome::InterfaceGone
    } else if rec.netns.is_some() && !present.netns {
        Outcome::NetnsGone
    } else {
        Outcome::Restored
    }
}

/// Looks up what exists for a record (blocking: netlink and `stat`).
pub fn presence(rec: &EndpointRecord) -> Presence {
    let interface = rec.interface.as_deref().is_none_or(|name| {
        // An error reading the links is no proof of absence: keep the endpoint.
        crate::datapath::netdev::host_link_exists(name).unwrap_or(true)
    });
    let netns = rec
        .netns
        .as_deref()
        .is_none_or(|p| !Path::new(p).is_absolute() || Path::new(p).exists());
    Presence { interface, netns }
}

/// Splits the records into those to restore and those whose pod is gone from this node, with
/// the reason.
pub fn partition_stale(
    records: Vec<EndpointRecord>,
    presence: impl Fn(&EndpointRecord) -> Presence,
) -> (Vec<EndpointRecord>, Vec<(EndpointRecord, Outcome)>) {
    let mut keep = Vec::with_capacity(records.len());
    let mut stale = Vec::new();
    for rec in records {
        match judge(&rec, presence(&rec)) {
            Outcome::Restored => keep.push(rec),
            other => stale.push((rec, other)),
        }
    }
    (keep, stale)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: u16, container: Option<&str>) -> EndpointRecord {
        EndpointRecord {
            id,
            name: format!("x/p{id}"),
            ips: vec![format!("10.0.0.{id}").parse().unwrap()],
            interface: Some(format!("lxc{id}")),
            identity: None,
            labels: vec![],
            policy_revision: 0,
            container_id: container.map(String::from),
            netns: container.map(|_| format!("/run/netns/p{id}")),
            mac: None,
            audit: false,
            host: false,
        }
    }

    const ALL: Presence = Presence {
        interface: true,
        netns: true,
    };

    #[test]
    fn a_cni_endpoint_without_its_interface_or_namespace_is_not_restored() {
        let records = vec![rec(1, Some("a")), rec(2, Some("b")), rec(3, Some("c"))];
        let (keep, stale) = partition_stale(records, |r| match r.id {
            1 => ALL,
            2 => Presence {
                interface: false,
                netns: false,
            },
            _ => Presence {
                interface: true,
                netns: false,
            },
        });
        assert_eq!(keep.iter().map(|r| r.id).collect::<Vec<_>>(), vec![1]);
        let stale: Vec<(u16, Outcome)> = stale.iter().map(|(r, o)| (r.id, *o)).collect();
        assert_eq!(
            stale,
            vec![(2, Outcome::InterfaceGone), (3, Outcome::NetnsGone)]
        );
    }

    #[test]
    fn an_endpoint_registered_through_the_api_is_always_restored() {
        let gone = Presence {
            interface: false,
            netns: false,
        };
        assert_eq!(judge(&rec(4, None), gone), Outcome::Restored);
    }
}
