//! BPF host routing, receive side (`from_netdev` in `bpf/ciliate.bpf.c`, `bpf/lib/hostroute.h`):
//! the program on the node device's TCX ingress and the map of this node's pods it delivers
//! to (`local_endpoints`, IPv4 address -> endpoint id, host veth, MACs).
//!
//! Invariants:
//! - an address is in `local_endpoints` only while its endpoint's own programs are attached
//!   (`BpfDatapath` writes the record after attaching them and removes it before detaching), so
//!   a packet delivered by `from_netdev` has met exactly the ingress policy `to_container` would
//!   have applied (the same policy map, endpoint record and conntrack entries);
//! - the program only ever takes packets for those addresses; everything else goes on to the
//!   next program or the stack (`TC_ACT_UNSPEC`), so another program on the device still sees it;
//! - the link is pinned under the agent's own pin root (`link_netdev_ingress`), like the
//!   endpoints' links: it keeps working while the agent is down and a restarted agent swaps its
//!   program atomically.

use std::mem::MaybeUninit;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use libbpf_rs::{MapCore, MapFlags};

use super::tcx::{self, Hook};
use super::{load_netdev_program, types, Pod};
use crate::datapath::{DatapathError, EndpointId};

/// The pinned map's name under `<bpf-root>/ciliate/`.
pub const MAP: &str = "local_endpoints";
/// The same by IPv6 address.
pub const MAP6: &str = "local_endpoints6";
/// The count of packets delivered into pods (per CPU).
pub const COUNTER: &str = "host_delivered";
/// The pinned TCX link of the node device's program.
pub const LINK: &str = "link_netdev_ingress";

fn err<E: std::fmt::Display>(operation: impl Into<String>) -> impl FnOnce(E) -> DatapathError {
    let operation = operation.into();
    move |e| DatapathError::System {
        operation,
        message: e.to_string(),
    }
}

/// Loads `from_netdev` on the pinned maps and makes it the program at the TCX ingress of
/// `ifindex` (the pinned link is updated in place, or moved from another device).
pub fn attach(pins: &Path, ifindex: u32) -> Result<(), DatapathError> {
    attach_ingress(pins, ifindex, LINK, "")
}

/// Loads `from_netdev` and makes it the program of the pinned link `link` at the TCX ingress
/// of `ifindex` (`what`: the device's role, for the error).
fn attach_ingress(pins: &Path, ifindex: u32, link: &str, what: &str) -> Result<(), DatapathError> {
    let mut storage = MaybeUninit::uninit();
    let skel = load_netdev_program(&mut storage, pins, true)?;
    tcx::attach(
        &skel.progs.from_netdev,
        ifindex as i32,
        Hook::Ingress,
        &pins.join(link),
    )
    .map(|_| ())
    .map_err(|e| DatapathError::System {
        operation: format!("attach the node device's program to {what}ifindex {ifindex}"),
        message: e.to_string(),
    })
}

/// The device the program is attached to, if any.
pub fn attached_ifindex(pins: &Path) -> Option<u32> {
    tcx::pinned_link_info(&pins.join(LINK)).map(|(ifindex, _, _)| ifindex)
}

/// Takes the program off the node device (BPF host routing turned off), and off the underlay
/// device of tunnel mode.
pub fn detach(pins: &Path) {
    tcx::detach(&pins.join(LINK));
    detach_underlay(pins);
    // An earlier run's tunnel device is not this run's to decapsulate for (the host firewall's
    // links run the same program on the underlay device).
    if let Err(e) = set_tunnel(pins, 0, Ipv4Addr::UNSPECIFIED) {
        tracing::warn!(error = %e, "an earlier run's BPF tunnel state stays");
    }
}

/// Tunnel mode in BPF (`bpf/lib/tunnel.h`): the pinned map naming the tunnel device and the
/// node's underlay address, the counts of packets decapsulated and encapsulated, and the link
/// of the program on the device the tunnel's packets arrive on (the underlay device, holding
/// the node's address).
pub const TUNNEL_CONFIG: &str = "tunnel_config";
pub const DECAP_COUNTER: &str = "tunnel_decapped";
pub const ENCAP_COUNTER: &str = "tunnel_encapped";
pub const LINK_UNDERLAY: &str = "link_netdev_underlay_ingress";

/// Tunnel mode: `from_netdev` on the TCX ingress of the underlay device `ifindex`, where it
/// decapsulates the tunnel's packets for local pods, handing what it does not deliver to the
/// tunnel device `tunnel.0`. Only while no other link of this agent puts the same program there
/// (the host firewall's, on every native device).
pub fn attach_underlay(
    pins: &Path,
    ifindex: u32,
    tunnel: (u32, Ipv4Addr),
) -> Result<(), DatapathError> {
    attach_ingress(pins, ifindex, LINK_UNDERLAY, "the underlay device, ")?;
    set_tunnel(pins, tunnel.0, tunnel.1).map(|_| ())
}

/// Takes the program off the underlay device (its decapsulation stays wherever the host
/// firewall's link runs the same program).
pub fn detach_underlay(pins: &Path) {
    tcx::detach(&pins.join(LINK_UNDERLAY));
}

/// Names the tunnel device the programs hand decapsulated packets to and encapsulate for, and
/// the node's address the outer packets leave from; ifindex 0: the kernel's device does all
/// (native routing, or no tunnel device yet). `Ok(false)` when no program pinned the map yet.
pub fn set_tunnel(pins: &Path, ifindex: u32, local: Ipv4Addr) -> Result<bool, DatapathError> {
    let path = pins.join(TUNNEL_CONFIG);
    if !path.exists() {
        return Ok(false);
    }
    let map = libbpf_rs::MapHandle::from_pinned_path(&path)
        .map_err(err(format!("open {}", path.display())))?;
    let value = types::tunnel_config {
        ifindex,
        local4: u32::from_ne_bytes(local.octets()),
    };
    map.update(&0u32.to_ne_bytes(), value.as_bytes(), MapFlags::ANY)
        .map_err(err(format!(
            "name the tunnel device (ifindex {ifindex}, local {local})"
        )))?;
    Ok(true)
}

/// Packets decapsulated by the programs so far (all CPUs).
pub fn decapsulated_packets(pins: &Path) -> Result<u64, DatapathError> {
    super::host_routes::percpu_counter(pins, DECAP_COUNTER)
}

/// Packets encapsulated by the programs so far (all CPUs).
pub fn encapsulated_packets(pins: &Path) -> Result<u64, DatapathError> {
    super::host_routes::percpu_counter(pins, ENCAP_COUNTER)
}

/// Packets delivered into pods so far (all CPUs).
pub fn delivered_packets(pins: &Path) -> Result<u64, DatapathError> {
    super::host_routes::percpu_counter(pins, COUNTER)
}

/// A MAC as six bytes (`aa:bb:cc:dd:ee:ff`).
pub fn parse_mac(mac: &str) -> Option<[u8; 6]> {
    let v: Vec<u8> = mac
        .split(':')
        .map(|p| u8::from_str_radix(p, 16).ok())
        .collect::<Option<_>>()?;
    v.try_into().ok()
}

/// The hardware address of an interface of this network namespace.
pub fn interface_mac(name: &str) -> Result<[u8; 6], DatapathError> {
    use nix::libc;
    let bytes = name.as_bytes();
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if bytes.len() >= req.ifr_name.len() {
        return Err(DatapathError::System {
            operation: format!("MAC of {name}"),
            message: "interface name too long".into(),
        });
    }
    for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(err(format!("MAC of {name}"))(
            std::io::Error::last_os_error(),
        ));
    }
    let r = unsafe { libc::ioctl(fd, libc::SIOCGIFHWADDR as _, &mut req) };
    let e = std::io::Error::last_os_error();
    unsafe { libc::close(fd) };
    if r < 0 {
        return Err(err(format!("MAC of {name}"))(e));
    }
    let sa = unsafe { req.ifr_ifru.ifru_hwaddr.sa_data };
    let mut mac = [0u8; 6];
    for (d, s) in mac.iter_mut().zip(sa.iter()) {
        *d = *s as u8;
    }
    Ok(mac)
}

/// The record of one local pod address.
pub fn record(
    id: EndpointId,
    ifindex: u32,
    mac: [u8; 6],
    node_mac: [u8; 6],
) -> types::local_endpoint {
    types::local_endpoint {
        endpoint_id: id as u32,
        ifindex,
        mac,
        node_mac,
    }
}

/// Writes the records of an endpoint's addresses: IPv4 ones into `map`, IPv6 ones into `map6`.
pub fn publish(
    map: &impl MapCore,
    map6: &impl MapCore,
    addrs: &[IpAddr],
    rec: &types::local_endpoint,
) -> Result<(), DatapathError> {
    for a in addrs {
        let (written, name) = match a {
            IpAddr::V4(v4) => (map.update(&v4.octets(), rec.as_bytes(), MapFlags::ANY), MAP),
            IpAddr::V6(v6) => (
                map6.update(&v6.octets(), rec.as_bytes(), MapFlags::ANY),
                MAP6,
            ),
        };
        written.map_err(err(format!(
            "add {a} of endpoint {} to {name}",
            rec.endpoint_id
        )))?;
    }
    Ok(())
}

/// Removes every record of endpoint `id` (whatever run wrote it) from `map` (either family's).
pub fn withdraw(map: &impl MapCore, id: EndpointId) -> Result<(), DatapathError> {
    for k in map.keys() {
        let Some(rec) = map
            .lookup(&k, MapFlags::ANY)
            .ok()
            .flatten()
            .and_then(|v| types::local_endpoint::from_bytes(&v))
        else {
            continue;
        };
        if rec.endpoint_id == id as u32 {
            map.delete(&k).map_err(err(format!(
                "remove a record of endpoint {id} from the local endpoints"
            )))?;
        }
    }
    Ok(())
}

/// Every record: address -> record.
pub fn entries(map: &impl MapCore) -> Vec<(Ipv4Addr, types::local_endpoint)> {
    map.keys()
        .filter_map(|k| {
            let a: [u8; 4] = k.get(..4)?.try_into().ok()?;
            let v = map.lookup(&k, MapFlags::ANY).ok().flatten()?;
            let rec = types::local_endpoint::from_bytes(&v)?;
            Some((Ipv4Addr::from(a), rec))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_parse_as_six_bytes_or_not_at_all() {
        assert_eq!(
            parse_mac("0a:58:0A:f4:00:01"),
            Some([0x0a, 0x58, 0x0a, 0xf4, 0, 1])
        );
        assert_eq!(parse_mac("0a:58:0a:f4:00"), None);
        assert_eq!(parse_mac("0a:58:0a:f4:00:01:02"), None);
        assert_eq!(parse_mac("zz:58:0a:f4:00:01"), None);
    }

    #[test]
    fn the_loopback_device_has_an_all_zero_mac() {
        assert_eq!(interface_mac("lo").unwrap(), [0; 6]);
        assert!(interface_mac("no-such-if0").is_err());
    }
}
