//! The agent's recovery of CNI ADDs that a crash (`kill -9`) interrupted, run at start-up
//! before the API is served. ADD writes an intent record before it creates anything and marks
//! the host veth with an alias naming the state directory (`src/api/cni.rs`); here every intent
//! that outlived its agent is rolled back, and marked veths that no endpoint owns are swept.

use std::net::IpAddr;

use crate::datapath::netdev;
use crate::endpoint::state::{AddIntent, EndpointRecord, StateDir};

/// What a leftover intent record asks for at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Leftover {
    /// The endpoint record was written before the crash: the ADD is complete, only the intent
    /// record remains to be removed.
    Completed,
    /// Nothing of it is kept: its interface (if this agent's) goes, its address is freed.
    RollBack,
}

fn leftover(intent: &AddIntent, restored: &[EndpointRecord]) -> Leftover {
    if restored
        .iter()
        .any(|r| r.container_id.as_deref() == Some(intent.container_id.as_str()))
    {
        Leftover::Completed
    } else {
        Leftover::RollBack
    }
}

/// The marked interfaces the sweep deletes: this agent's, named by no kept endpoint.
fn orphans(marked: Vec<String>, restored: &[EndpointRecord]) -> Vec<String> {
    marked
        .into_iter()
        .filter(|name| {
            !restored
                .iter()
                .any(|r| r.interface.as_deref() == Some(name))
        })
        .collect()
}

/// Start-up recovery after a crash, before the API is served (blocking: netlink). `restored`
/// are the endpoint records being restored, `refused` those refused for a duplicate address
/// (their interface is reclaimed); `sweep` is false when some endpoint record could not be read
/// (its interface is unknown, so no marked veth is deleted on suspicion). Returns the addresses
/// that must stay reserved, with their container: those of interrupted ADDs whose interface
/// could not be removed (the pod may still hold them; a DEL or the next start retries).
pub fn recover(
    state_dir: &StateDir,
    restored: &[EndpointRecord],
    refused: &[EndpointRecord],
    sweep: bool,
) -> Vec<(IpAddr, String)> {
    let mark = netdev::agent_mark(state_dir.root());
    for r in refused {
        // Only interfaces CNI made (a container id) are the agent's to remove.
        let (Some(name), Some(_)) = (&r.interface, &r.container_id) else {
            continue;
        };
        if restored.iter().any(|k| k.interface.as_ref() == Some(name)) {
            continue;
        }
        match netdev::delete_owned_interface(name, &mark) {
            Ok(outcome) => {
                tracing::warn!(endpoint = r.id, interface = %name, ?outcome, "the interface of a refused endpoint is reclaimed")
            }
            Err(e) => {
                tracing::error!(endpoint = r.id, interface = %name, error = %e, "cannot reclaim the interface of a refused endpoint")
            }
        }
    }
    let (intents, errors) = state_dir.load_intents();
    for e in errors {
        tracing::error!(error = %e, "an ADD record cannot be read (left on disk)");
    }
    let mut reserve = Vec::new();
    for intent in intents {
        if leftover(&intent, restored) == Leftover::RollBack {
            match netdev::delete_owned_interface(&intent.host_if, &mark) {
                Ok(outcome) => {
                    tracing::warn!(container = %intent.container_id, interface = %intent.host_if, ip = %intent.ip, ?outcome, "an ADD interrupted by the agent's end is rolled back")
                }
                Err(e) => {
                    tracing::error!(container = %intent.container_id, interface = %intent.host_if, ip = %intent.ip, error = %e, "cannot roll back an interrupted ADD; its addresses stay reserved");
                    for ip in intent.ips() {
                        reserve.push((ip, intent.container_id.clone()));
                    }
                    continue;
                }
            }
        }
        if let Err(e) = state_dir.end_add(&intent.container_id) {
            tracing::error!(container = %intent.container_id, error = %e, "cannot remove an ADD record");
        }
    }
    if !sweep {
        tracing::warn!("some endpoint state is unreadable: orphaned interfaces are not swept");
        return reserve;
    }
    match netdev::marked_interfaces(&mark) {
        Ok(marked) => {
            for name in orphans(marked, restored) {
                match netdev::delete_owned_interface(&name, &mark) {
                    Ok(_) => {
                        tracing::warn!(interface = %name, "an orphaned interface of this agent is removed")
                    }
                    Err(e) => {
                        tracing::error!(interface = %name, error = %e, "cannot remove an orphaned interface")
                    }
                }
            }
        }
        Err(e) => tracing::error!(error = %e, "cannot list this agent's interfaces"),
    }
    reserve
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::datapath::EndpointId;

    fn rec(id: EndpointId, container: Option<&str>, interface: &str) -> EndpointRecord {
        EndpointRecord {
            id,
            name: "x/a".into(),
            ips: vec![],
            interface: Some(interface.into()),
            identity: None,
            labels: vec![],
            policy_revision: 0,
            container_id: container.map(str::to_string),
            netns: None,
            mac: None,
            audit: false,
            host: false,
        }
    }

    fn intent(container: &str) -> AddIntent {
        AddIntent {
            container_id: container.into(),
            host_if: netdev::host_interface_name(container),
            ip: "10.0.0.7".parse().unwrap(),
            more_ips: Vec::new(),
            netns: "/var/run/netns/p".into(),
            ifname: "eth0".into(),
            run: "1-1".into(),
        }
    }

    #[test]
    fn a_leftover_intent_is_rolled_back_unless_its_endpoint_was_recorded() {
        let restored = [rec(1, Some("c1"), "lxc1"), rec(2, None, "veth-manual")];
        assert_eq!(leftover(&intent("c1"), &restored), Leftover::Completed);
        assert_eq!(leftover(&intent("c2"), &restored), Leftover::RollBack);
        assert_eq!(leftover(&intent("c2"), &[]), Leftover::RollBack);
    }

    #[test]
    fn the_sweep_keeps_the_interfaces_of_restored_endpoints() {
        let restored = [rec(1, Some("c1"), "lxc1"), rec(2, Some("c2"), "lxc2")];
        assert_eq!(
            orphans(
                vec!["lxc1".into(), "lxc3".into(), "lxc2".into(), "lxc4".into()],
                &restored
            ),
            vec!["lxc3".to_string(), "lxc4".to_string()]
        );
    }
}
