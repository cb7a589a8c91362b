//! The prefixes BPF host routing applies to (`bpf/lib/hostroute.h`): the other nodes' pod
//! CIDRs this agent has kernel routes for. Written by the route reconciler after each pass,
//! so a prefix is in the map only while its route is in the kernel: the program's FIB lookup
//! then always finds the route the agent installed.

use std::collections::BTreeSet;
use std::path::Path;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use libbpf_rs::{MapCore, MapFlags, MapHandle};

use crate::datapath::DatapathError;

/// The pinned map's name under `<bpf-root>/ciliate/`.
pub const MAP: &str = "host_routes";
/// The IPv6 prefixes' map.
pub const MAP6: &str = "host_routes6";
/// The count of packets sent by host routing (per CPU), for tests and introspection.
pub const COUNTER: &str = "host_routed";

/// The map key: prefix length, then the address in network order.
pub fn key(net: Ipv4Net) -> [u8; 8] {
    let mut k = [0u8; 8];
    k[..4].copy_from_slice(&u32::from(net.prefix_len()).to_ne_bytes());
    k[4..].copy_from_slice(&net.network().octets());
    k
}

/// The IPv6 map's key: prefix length, then the address.
pub fn key6(net: Ipv6Net) -> [u8; 20] {
    let mut k = [0u8; 20];
    k[..4].copy_from_slice(&u32::from(net.prefix_len()).to_ne_bytes());
    k[4..].copy_from_slice(&net.network().octets());
    k
}

fn decode(k: &[u8]) -> Option<IpNet> {
    let len = u8::try_from(u32::from_ne_bytes(k.get(..4)?.try_into().ok()?)).ok()?;
    if let Ok(a) = <[u8; 16]>::try_from(k.get(4..)?) {
        return Ipv6Net::new(a.into(), len).ok().map(IpNet::V6);
    }
    let a: [u8; 4] = k.get(4..8)?.try_into().ok()?;
    Ipv4Net::new(a.into(), len).ok().map(IpNet::V4)
}

/// Makes the maps hold exactly `want` (each family's prefixes in its map). `Ok(false)`: the
/// datapath has not created the maps (yet).
pub fn sync(pins: &Path, want: &BTreeSet<IpNet>) -> Result<bool, DatapathError> {
    let name = |k: &[u8]| {
        format!(
            "host route {}",
            decode(k).map_or_else(|| format!("{k:?}"), |n| n.to_string())
        )
    };
    let (mut v4, mut v6) = (BTreeSet::new(), BTreeSet::new());
    for n in want {
        match n {
            IpNet::V4(n) => v4.insert(key(*n).to_vec()),
            IpNet::V6(n) => v6.insert(key6(*n).to_vec()),
        };
    }
    let one = 1u32.to_ne_bytes();
    let done4 = super::map_io::sync_keys(&pins.join(MAP), &v4, &one, name)?;
    let done6 = super::map_io::sync_keys(&pins.join(MAP6), &v6, &one, name)?;
    Ok(done4 && done6)
}

/// Packets sent by host routing so far (all CPUs).
pub fn routed_packets(pins: &Path) -> Result<u64, DatapathError> {
    percpu_counter(pins, COUNTER)
}

/// The sum over CPUs of a pinned one-slot per-CPU counter (`host_routed`, `host_delivered`).
pub fn percpu_counter(pins: &Path, name: &str) -> Result<u64, DatapathError> {
    percpu_counter_at(pins, name, 0)
}

/// Slot `index` of a pinned per-CPU counter array, summed over CPUs.
pub fn percpu_counter_at(pins: &Path, name: &str, index: u32) -> Result<u64, DatapathError> {
    let path = pins.join(name);
    let map = MapHandle::from_pinned_path(&path).map_err(|e| DatapathError::System {
        operation: format!("open {}", path.display()),
        message: e.to_string(),
    })?;
    percpu_sum(&map, name, index)
}

/// Slot `index` of an open per-CPU counter array, summed over CPUs.
pub fn percpu_sum(map: &MapHandle, name: &str, index: u32) -> Result<u64, DatapathError> {
    let per_cpu = map
        .lookup_percpu(&index.to_ne_bytes(), MapFlags::ANY)
        .map_err(|e| DatapathError::System {
            operation: format!("read {name}"),
            message: e.to_string(),
        })?
        .unwrap_or_default();
    Ok(per_cpu
        .iter()
        .filter_map(|v| v.get(..8).and_then(|b| b.try_into().ok()))
        .map(u64::from_ne_bytes)
        .sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_in_the_programs_layout() {
        let net: Ipv4Net = "10.200.2.0/24".parse().unwrap();
        let k = key(net);
        assert_eq!(&k[4..], &[10, 200, 2, 0], "the address in network order");
        assert_eq!(decode(&k), Some(IpNet::V4(net)));
        let net6: Ipv6Net = "fd00:200:2::/112".parse().unwrap();
        let k6 = key6(net6);
        assert_eq!(&k6[4..6], &[0xfd, 0], "the address in network order");
        assert_eq!(decode(&k6), Some(IpNet::V6(net6)));
    }
}
