//! The host firewall at the node's native devices (`bpf/lib/hostfw.h`, `network::devices`):
//! `to_netdev` on each device's TCX egress, and `from_netdev` on its ingress unless BPF host
//! routing put it there already (`host_delivery`: the same program judges both); in tunnel
//! mode the same on the agent's tunnel device, for the node's traffic with other nodes' pods
//! (inside the tunnel). The links are pinned per device (`link_hostfw_egress_<device>`), so
//! that a device that is no longer native loses them, also across a restart.
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

/// The pinned TCX links: `<LINK_EGRESS>_<device>` and `<LINK_INGRESS>_<device>`. An earlier
/// release, which attached to one device only, pinned them under these names alone; those are
/// taken off by [`sweep_devices`].
const LINK_INGRESS: &str = "link_hostfw_ingress";
const LINK_EGRESS: &str = "link_hostfw_egress";

/// The pinned TCX links on the native device `name`: `from_netdev` (when the host firewall
/// attached it) and `to_netdev`.
fn device_links(name: &str) -> (String, String) {
    (
        format!("{LINK_EGRESS}_{name}"),
        format!("{LINK_INGRESS}_{name}"),
    )
}

/// Attaches the programs to the native device `name` (`ifindex`): `to_netdev` at its egress,
/// and `from_netdev` at its ingress when `ingress` (else a link of an earlier run there is
/// taken off).
pub fn attach(pins: &Path, name: &str, ifindex: u32, ingress: bool) -> Result<(), DatapathError> {
    let (egress_link, ingress_link) = device_links(name);
    attach_at(pins, ifindex, ingress, (&egress_link, &ingress_link))
}

/// Takes the programs off the native device `name`.
pub fn detach_device(pins: &Path, name: &str) {
    let (egress_link, ingress_link) = device_links(name);
    tcx::detach(&pins.join(egress_link));
    tcx::detach(&pins.join(ingress_link));
}

/// The native devices the pinned links under `pins` are on (whichever run attached them).
pub fn pinned_devices(pins: &Path) -> BTreeSet<String> {
    let Ok(dir) = std::fs::read_dir(pins) else {
        return BTreeSet::new();
    };
    let (egress, ingress) = device_links("");
    dir.flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter_map(|n| {
            n.strip_prefix(&egress)
                .or_else(|| n.strip_prefix(&ingress))
                .map(String::from)
        })
        .collect()
}

/// Takes the programs off every native device but those in `keep`, and the links of the
/// one-device release: what an earlier run left on devices that are no native device now.
pub fn sweep_devices(pins: &Path, keep: &BTreeSet<String>) -> Vec<String> {
    tcx::detach(&pins.join(LINK_EGRESS));
    tcx::detach(&pins.join(LINK_INGRESS));
    let stale: Vec<String> = pinned_devices(pins).difference(keep).cloned().collect();
    for name in &stale {
        detach_device(pins, name);
    }
    stale
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
    sweep_devices(pins, &BTreeSet::new());
    for link in [LINK_TUNNEL_EGRESS, LINK_TUNNEL_INGRESS] {
        tcx::detach(&pins.join(link));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The links are named per device; a sweep takes off those of devices that are no longer
    /// native and the one-device release's, never the tunnel device's or a kept device's.
    #[test]
    fn a_sweep_takes_off_the_links_of_devices_no_longer_native_and_of_the_old_release() {
        let dir = tempfile::tempdir().unwrap();
        let names = [
            "link_hostfw_egress_eth0",
            "link_hostfw_ingress_eth0",
            "link_hostfw_egress_eth1",
            "link_hostfw_ingress_eth1",
            "link_hostfw_egress",
            "link_hostfw_ingress",
            "link_hostfw_tunnel_egress",
            "link_7_egress",
        ];
        for n in names {
            std::fs::write(dir.path().join(n), b"").unwrap();
        }
        assert_eq!(
            pinned_devices(dir.path()),
            BTreeSet::from(["eth0".to_string(), "eth1".to_string()])
        );
        let keep = BTreeSet::from(["eth0".to_string()]);
        assert_eq!(sweep_devices(dir.path(), &keep), ["eth1"]);
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "link_7_egress",
                "link_hostfw_egress_eth0",
                "link_hostfw_ingress_eth0",
                "link_hostfw_tunnel_egress"
            ]
        );
        detach(dir.path());
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(left.len(), 1, "only the endpoint's link stays");
    }
}
