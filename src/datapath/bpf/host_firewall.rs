//! The host firewall at the node's device (`bpf/lib/hostfw.h`): `to_netdev` on the device's
//! TCX egress, and `from_netdev` on its ingress unless BPF host routing put it there already
//! (`host_delivery`: the same program judges both); in tunnel mode the same on the agent's
//! tunnel device, for the node's traffic with other nodes' pods (inside the tunnel).
//!
//! Invariants:
//! - the links are pinned under the agent's own pin root, like the endpoints' links: the
//!   firewall keeps enforcing while the agent is down, and a restarted agent swaps its
//!   programs in atomically;
//! - the programs only ever judge packets to or from the node's own addresses while the host
//!   endpoint is in the endpoint map (`CILIATE_HOST_ENDPOINT_ID`); everything else goes on to
//!   the next program or the stack, so another agent's programs on the device still see it.

use std::collections::BTreeSet;
use std::mem::MaybeUninit;
use std::net::Ipv4Addr;
use std::path::Path;

use libbpf_rs::{MapCore, MapHandle};

use super::load_netdev_program;
use super::tcx::{self, Hook};
use crate::datapath::DatapathError;

/// The pinned map of the nodes this node tunnels to (tunnel mode; `tunnel_peers` in
/// `bpf/lib/hostfw.h`): their tunnel packets are exempt whatever the identity of their
/// address, as those of `remote-node` addresses are.
pub const TUNNEL_PEERS: &str = "tunnel_peers";

/// Makes the tunnel peers exactly `want` (new ones first). `false` when the map does not
/// exist yet (no host firewall program loaded under `pins`).
pub fn sync_tunnel_peers(pins: &Path, want: &BTreeSet<Ipv4Addr>) -> Result<bool, DatapathError> {
    let keys = want.iter().map(|a| a.octets().to_vec()).collect();
    super::map_io::sync_keys(&pins.join(TUNNEL_PEERS), &keys, &[1], |k| {
        let a = <[u8; 4]>::try_from(k).map(Ipv4Addr::from);
        format!(
            "tunnel peer {}",
            a.map_or_else(|_| format!("{k:?}"), |a| a.to_string())
        )
    })
}

/// The tunnel peers the programs know under `pins`.
pub fn tunnel_peers(pins: &Path) -> BTreeSet<Ipv4Addr> {
    MapHandle::from_pinned_path(pins.join(TUNNEL_PEERS))
        .map(|m| tunnel_peers_of(&m))
        .unwrap_or_default()
}

fn tunnel_peers_of(map: &MapHandle) -> BTreeSet<Ipv4Addr> {
    map.keys()
        .filter_map(|k| <[u8; 4]>::try_from(k.as_slice()).ok())
        .map(Ipv4Addr::from)
        .collect()
}

/// The pinned TCX link of `from_netdev` when the host firewall attached it.
pub const LINK_INGRESS: &str = "link_hostfw_ingress";
/// The pinned TCX link of `to_netdev`.
pub const LINK_EGRESS: &str = "link_hostfw_egress";

/// Attaches the programs to the device `ifindex`: `to_netdev` at its egress, and `from_netdev`
/// at its ingress when `ingress` (else a link of an earlier run there is taken off).
pub fn attach(pins: &Path, ifindex: u32, ingress: bool) -> Result<(), DatapathError> {
    attach_at(pins, ifindex, ingress, (LINK_EGRESS, LINK_INGRESS))
}

/// The pinned TCX links on the agent's tunnel device (tunnel mode): what the node sends to
/// other nodes' pods leaves through it before encapsulation, and what their pods send the node
/// arrives on it after decapsulation.
pub const LINK_TUNNEL_INGRESS: &str = "link_hostfw_tunnel_ingress";
pub const LINK_TUNNEL_EGRESS: &str = "link_hostfw_tunnel_egress";

/// As [`attach`], on the tunnel device `ifindex` (its own links).
pub fn attach_tunnel(pins: &Path, ifindex: u32, ingress: bool) -> Result<(), DatapathError> {
    attach_at(
        pins,
        ifindex,
        ingress,
        (LINK_TUNNEL_EGRESS, LINK_TUNNEL_INGRESS),
    )
}

fn attach_at(
    pins: &Path,
    ifindex: u32,
    ingress: bool,
    (egress_link, ingress_link): (&str, &str),
) -> Result<(), DatapathError> {
    let mut storage = MaybeUninit::uninit();
    let skel = load_netdev_program(&mut storage, pins, true)?;
    let fail = |e: tcx::TcxError| DatapathError::System {
        operation: format!("attach the host firewall to ifindex {ifindex}"),
        message: e.to_string(),
    };
    tcx::attach(
        &skel.progs.to_netdev,
        ifindex as i32,
        Hook::Egress,
        &pins.join(egress_link),
    )
    .map_err(fail)?;
    if ingress {
        tcx::attach(
            &skel.progs.from_netdev,
            ifindex as i32,
            Hook::Ingress,
            &pins.join(ingress_link),
        )
        .map_err(fail)?;
    } else {
        tcx::detach(&pins.join(ingress_link));
    }
    Ok(())
}

/// Takes every host firewall program off (the host firewall turned off).
pub fn detach(pins: &Path) {
    for link in [
        LINK_EGRESS,
        LINK_INGRESS,
        LINK_TUNNEL_EGRESS,
        LINK_TUNNEL_INGRESS,
    ] {
        tcx::detach(&pins.join(link));
    }
}
