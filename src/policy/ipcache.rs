//! The ipcache: longest-prefix match from an IP address to the security identity behind it.
//!
//! Kept as one hash map per prefix length, probed from the longest length present down to the
//! shortest: a lookup costs at most one hash probe per *distinct* prefix length in use (a handful
//! in practice: /32, /128 for endpoints, and the CIDR rules' lengths).

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;

use ipnet::IpNet;

use super::identity::{NumericIdentity, IDENTITY_WORLD_IPV4, IDENTITY_WORLD_IPV6};

/// One change of the ipcache, as the datapath applies them (in order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IpcacheChange {
    Upsert(IpNet, NumericIdentity),
    Remove(IpNet),
}

#[derive(Debug, Clone, Default)]
struct Family {
    /// (prefix length, masked address) -> identity.
    entries: HashMap<(u8, u128), NumericIdentity>,
    /// Prefix lengths in use with their entry counts, longest first when iterated in reverse.
    lengths: BTreeSet<u8>,
    count_by_len: HashMap<u8, usize>,
}

impl Family {
    fn mask(addr: u128, len: u8, bits: u8) -> u128 {
        if len == 0 {
            return 0;
        }
        let shift = bits - len;
        (addr >> shift) << shift
    }

    fn upsert(
        &mut self,
        addr: u128,
        len: u8,
        bits: u8,
        id: NumericIdentity,
    ) -> Option<NumericIdentity> {
        let key = (len, Self::mask(addr, len, bits));
        let old = self.entries.insert(key, id);
        if old.is_none() {
            *self.count_by_len.entry(len).or_default() += 1;
            self.lengths.insert(len);
        }
        old
    }

    fn remove(&mut self, addr: u128, len: u8, bits: u8) -> Option<NumericIdentity> {
        let key = (len, Self::mask(addr, len, bits));
        let old = self.entries.remove(&key)?;
        let c = self.count_by_len.entry(len).or_default();
        *c -= 1;
        if *c == 0 {
            self.count_by_len.remove(&len);
            self.lengths.remove(&len);
        }
        Some(old)
    }

    fn lookup(&self, addr: u128, bits: u8) -> Option<(u8, NumericIdentity)> {
        self.lengths.iter().rev().find_map(|&len| {
            self.entries
                .get(&(len, Self::mask(addr, len, bits)))
                .map(|id| (len, *id))
        })
    }
}

/// Prefix -> identity, with longest-prefix-match lookups.
#[derive(Debug, Clone, Default)]
pub struct IpCache {
    v4: Family,
    v6: Family,
}

fn split(prefix: &IpNet) -> (bool, u128, u8) {
    match prefix {
        IpNet::V4(p) => (true, u32::from(p.addr()) as u128, p.prefix_len()),
        IpNet::V6(p) => (false, u128::from(p.addr()), p.prefix_len()),
    }
}

impl IpCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Maps `prefix` to `id`; returns the identity it mapped to before, if any.
    pub fn upsert(&mut self, prefix: IpNet, id: NumericIdentity) -> Option<NumericIdentity> {
        let (v4, addr, len) = split(&prefix);
        if v4 {
            self.v4.upsert(addr, len, 32, id)
        } else {
            self.v6.upsert(addr, len, 128, id)
        }
    }

    pub fn remove(&mut self, prefix: IpNet) -> Option<NumericIdentity> {
        let (v4, addr, len) = split(&prefix);
        if v4 {
            self.v4.remove(addr, len, 32)
        } else {
            self.v6.remove(addr, len, 128)
        }
    }

    /// The identity of exactly `prefix`, if it has an entry.
    pub fn get(&self, prefix: &IpNet) -> Option<NumericIdentity> {
        let (v4, addr, len) = split(prefix);
        let (family, bits) = if v4 { (&self.v4, 32) } else { (&self.v6, 128) };
        family
            .entries
            .get(&(len, Family::mask(addr, len, bits)))
            .copied()
    }

    /// The identity of the longest prefix containing `ip`, or world (per family) when none does.
    pub fn lookup(&self, ip: IpAddr) -> NumericIdentity {
        self.lookup_prefix(ip)
            .map(|(_, id)| id)
            .unwrap_or(match ip {
                IpAddr::V4(_) => IDENTITY_WORLD_IPV4,
                IpAddr::V6(_) => IDENTITY_WORLD_IPV6,
            })
    }

    /// The longest matching prefix and its identity, if any prefix contains `ip`.
    pub fn lookup_prefix(&self, ip: IpAddr) -> Option<(IpNet, NumericIdentity)> {
        match ip {
            IpAddr::V4(a) => self.v4.lookup(u32::from(a) as u128, 32).map(|(len, id)| {
                (
                    IpNet::new(ip, len)
                        .map(|n| n.trunc())
                        .unwrap_or(IpNet::from(ip)),
                    id,
                )
            }),
            IpAddr::V6(a) => self.v6.lookup(u128::from(a), 128).map(|(len, id)| {
                (
                    IpNet::new(ip, len)
                        .map(|n| n.trunc())
                        .unwrap_or(IpNet::from(ip)),
                    id,
                )
            }),
        }
    }

    pub fn len(&self) -> usize {
        self.v4.entries.len() + self.v6.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every entry, as (prefix, identity), IPv4 first, sorted.
    pub fn entries(&self) -> Vec<(IpNet, NumericIdentity)> {
        let mut out: Vec<(IpNet, NumericIdentity)> = Vec::with_capacity(self.len());
        for ((len, addr), id) in &self.v4.entries {
            let ip = IpAddr::V4((*addr as u32).into());
            if let Ok(n) = IpNet::new(ip, *len) {
                out.push((n, *id));
            }
        }
        for ((len, addr), id) in &self.v6.entries {
            let ip = IpAddr::V6((*addr).into());
            if let Ok(n) = IpNet::new(ip, *len) {
                out.push((n, *id));
            }
        }
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> IpNet {
        s.parse().unwrap()
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn longest_prefix_wins() {
        let mut c = IpCache::new();
        c.upsert(p("10.0.0.0/8"), 100);
        c.upsert(p("10.1.0.0/16"), 101);
        c.upsert(p("10.1.2.3/32"), 300);
        assert_eq!(c.lookup(ip("10.1.2.3")), 300);
        assert_eq!(c.lookup(ip("10.1.2.4")), 101);
        assert_eq!(c.lookup(ip("10.9.9.9")), 100);
        assert_eq!(c.lookup(ip("11.0.0.1")), IDENTITY_WORLD_IPV4);
        assert_eq!(c.lookup(ip("2001:db8::1")), IDENTITY_WORLD_IPV6);
    }

    #[test]
    fn remove_restores_shorter_match() {
        let mut c = IpCache::new();
        c.upsert(p("10.0.0.0/8"), 100);
        c.upsert(p("10.1.0.0/16"), 101);
        assert_eq!(c.remove(p("10.1.0.0/16")), Some(101));
        assert_eq!(c.lookup(ip("10.1.2.4")), 100);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn ipv6_and_zero_length_prefixes() {
        let mut c = IpCache::new();
        c.upsert(p("::/0"), 5);
        c.upsert(p("2001:db8::/32"), 6);
        assert_eq!(c.lookup(ip("2001:db8::1")), 6);
        assert_eq!(c.lookup(ip("2001:db9::1")), 5);
        assert_eq!(c.lookup(ip("1.2.3.4")), IDENTITY_WORLD_IPV4);
    }
}
