//! This node's own IPv4 addresses for the programs (`host_addrs4`, `bpf/lib/ipcache.h`): the
//! node device's paths ask "is this packet for the node, or from it?" of every packet (the host
//! firewall, and `from_netdev` before it looks for a local pod), and a few compares in one
//! array record answer that for far less than a hash lookup.
//!
//! Invariants:
//! - the record mirrors the ipcache's host table: an IPv4 address is in it exactly while its
//!   `/32` entry there has identity host (`BpfDatapath` updates both, the ipcache first);
//! - an update changes only the slots of the addresses that come or go, never moves an address
//!   between slots, so a program reading the record while it is rewritten sees every other
//!   address where it was;
//! - with more addresses than slots, `overflow` is set and the programs ask the host table
//!   itself: an address is never missed (the host firewall fails closed).

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::Path;

use libbpf_rs::{MapCore, MapFlags, MapHandle};

use super::{types, Pod};
use crate::datapath::DatapathError;
use crate::policy::identity::IDENTITY_HOST;

/// The pinned map's name under `<bpf-root>/ciliate/`.
pub const MAP: &str = "host_addrs4";
/// Slots in the record (`CILIATE_HOST_ADDRS4_MAX`).
pub const SLOTS: usize = 8;

/// Which slot holds which address; the addresses past the slots (pure; no map).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Slots {
    slots: [Option<Ipv4Addr>; SLOTS],
    extra: BTreeSet<Ipv4Addr>,
}

impl Slots {
    /// The slots of a record read back from the map (an earlier run's).
    pub fn from_record(r: &types::host_addrs4) -> Slots {
        let mut s = Slots::default();
        for (slot, a) in s.slots.iter_mut().zip(r.addr) {
            *slot = (a != 0).then(|| Ipv4Addr::from(u32::from_be(a)));
        }
        s
    }

    /// Makes `addr` one of the node's addresses (`host`) or not; whether anything changed.
    /// An address that goes frees its slot for one waiting past the slots.
    pub fn set(&mut self, addr: Ipv4Addr, host: bool) -> bool {
        let at = self.slots.iter().position(|s| *s == Some(addr));
        match (host, at) {
            (true, Some(_)) => false,
            (true, None) if self.extra.contains(&addr) => false,
            (true, None) => {
                match self.slots.iter_mut().find(|s| s.is_none()) {
                    Some(free) => *free = Some(addr),
                    None => {
                        self.extra.insert(addr);
                    }
                }
                true
            }
            (false, Some(i)) => {
                self.slots[i] = self.extra.pop_first();
                true
            }
            (false, None) => self.extra.remove(&addr),
        }
    }

    /// Keeps exactly `truth`: the addresses already in a slot stay where they are.
    pub fn retain_exactly(&mut self, truth: &BTreeSet<Ipv4Addr>) {
        let gone: Vec<Ipv4Addr> = self.addresses().filter(|a| !truth.contains(a)).collect();
        for a in gone {
            self.set(a, false);
        }
        for a in truth {
            self.set(*a, true);
        }
    }

    /// Every address, in slots or past them.
    pub fn addresses(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        self.slots
            .iter()
            .flatten()
            .copied()
            .chain(self.extra.iter().copied())
    }

    /// The map's record.
    pub fn record(&self) -> types::host_addrs4 {
        let mut r = types::host_addrs4::default();
        for (out, slot) in r.addr.iter_mut().zip(&self.slots) {
            *out = slot.map_or(0, |a| u32::from(a).to_be());
        }
        r.overflow = u32::from(!self.extra.is_empty());
        r
    }
}

/// The pinned record and what it holds.
pub struct HostAddrs {
    map: MapHandle,
    slots: Slots,
}

fn err<E: std::fmt::Display>(e: E) -> DatapathError {
    DatapathError::System {
        operation: format!("write the node's addresses ({MAP})"),
        message: e.to_string(),
    }
}

impl HostAddrs {
    /// Opens the pinned record and brings it to the ipcache host table's identity-host IPv4
    /// entries (after an upgrade that added the map, or whatever an earlier run left).
    pub fn open(pins: &Path, ipcache_hosts: &MapHandle) -> Result<HostAddrs, DatapathError> {
        let map = MapHandle::from_pinned_path(pins.join(MAP)).map_err(err)?;
        let old = map
            .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
            .map_err(err)?
            .and_then(|b| types::host_addrs4::from_bytes(&b))
            .unwrap_or_default();
        let truth: BTreeSet<Ipv4Addr> = super::map_io::typed_entries::<
            types::ipcache_host_key,
            types::ipcache_value,
        >(ipcache_hosts)
        .into_iter()
        .filter(|(k, v)| k.family == 4 && v.identity == IDENTITY_HOST)
        .map(|(k, _)| Ipv4Addr::new(k.addr[0], k.addr[1], k.addr[2], k.addr[3]))
        .collect();
        let mut slots = Slots::from_record(&old);
        slots.retain_exactly(&truth);
        let h = HostAddrs { map, slots };
        h.write()?;
        Ok(h)
    }

    /// `addr` is one of the node's addresses (`host`) or no longer.
    pub fn set(&mut self, addr: Ipv4Addr, host: bool) -> Result<(), DatapathError> {
        if self.slots.set(addr, host) {
            self.write()?;
        }
        Ok(())
    }

    fn write(&self) -> Result<(), DatapathError> {
        self.map
            .update(
                &0u32.to_ne_bytes(),
                self.slots.record().as_bytes(),
                MapFlags::ANY,
            )
            .map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(i: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 0, 0, i)
    }

    #[test]
    fn addresses_keep_their_slots_and_overflow_is_flagged() {
        let mut s = Slots::default();
        for i in 1..=8 {
            assert!(s.set(a(i), true));
        }
        assert!(!s.set(a(3), true), "already there");
        assert_eq!(s.record().overflow, 0);
        assert_eq!(s.record().addr[2], u32::from(a(3)).to_be());
        // A ninth address waits past the slots: the programs must ask the host table.
        assert!(s.set(a(9), true));
        assert_eq!(s.record().overflow, 1);
        // One going frees its slot for the waiting one; nothing else moves.
        let before = s.record();
        assert!(s.set(a(5), false));
        let after = s.record();
        assert_eq!(after.addr[4], u32::from(a(9)).to_be());
        for i in (0..8).filter(|i| *i != 4) {
            assert_eq!(before.addr[i], after.addr[i]);
        }
        assert_eq!(after.overflow, 0);
        assert!(!s.set(a(5), false), "already gone");
        assert!(s.set(a(2), false));
        assert_eq!(s.record().addr[1], 0);
    }

    #[test]
    fn reopening_keeps_the_slots_of_addresses_that_stay() {
        let mut s = Slots::default();
        for i in 1..=3 {
            s.set(a(i), true);
        }
        let mut again = Slots::from_record(&s.record());
        assert_eq!(again, s);
        again.retain_exactly(&[a(3), a(4)].into_iter().collect());
        let r = again.record();
        assert_eq!(r.addr[2], u32::from(a(3)).to_be(), "a(3) stays in its slot");
        assert_eq!(
            r.addr[0],
            u32::from(a(4)).to_be(),
            "a(4) takes the first free one"
        );
        assert_eq!(r.addr[1], 0);
        assert_eq!(again.addresses().count(), 2);
    }
}
