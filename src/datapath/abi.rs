//! The datapath's view of policy: map entries as the kernel stores them.
//!
//! The engine's `MapKey` has port *ranges*; the datapath's policy map (like Cilium's) holds
//! prefix-masked ports: `{identity, direction, protocol, port, port prefix length}`. A range
//! becomes the minimal set of aligned power-of-two blocks that cover it. Two engine keys can
//! expand to the same datapath entry (80-81 and 80-80 both need 80/16), so an
//! [`EntryTable`] counts the contributors of every entry, allow and deny separately. An entry
//! goes away only with its last contributor, and it is a deny whenever any contributor is a deny.

use smallvec::SmallVec;

use crate::hashing::HashMap;
use crate::policy::attribution::Cookie;
use crate::policy::identity::NumericIdentity;
use crate::policy::mapstate::{MapDelta, MapKey};
use crate::policy::rule::Direction;

/// Entries one endpoint's policy map can hold (Cilium's default `bpf-policy-map-max`).
pub const POLICY_MAP_MAX_ENTRIES: usize = 16384;
/// Entries the ipcache can hold.
pub const IPCACHE_MAX_ENTRIES: usize = 512_000;

/// One policy map key as the datapath stores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyEntryKey {
    pub identity: NumericIdentity,
    pub egress: bool,
    /// 0: any protocol (then the port prefix length is 0 too).
    pub protocol: u8,
    pub port: u16,
    /// How many leading bits of `port` must match (16: exact port, 0: any port).
    pub port_prefix_len: u8,
}

impl PolicyEntryKey {
    /// The inclusive port range this entry covers.
    pub fn port_range(&self) -> (u16, u16) {
        let size = 1u32 << (16 - self.port_prefix_len as u32);
        (self.port, (self.port as u32 + size - 1) as u16)
    }
}

/// A datapath policy entry's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PolicyEntryValue {
    pub deny: bool,
    pub packets: u64,
    pub bytes: u64,
}

/// Splits an inclusive port range into aligned prefix blocks: `(port, prefix_len)`.
pub fn port_range_to_prefixes(lo: u16, hi: u16) -> Vec<(u16, u8)> {
    let mut out = Vec::new();
    let (mut start, end) = (lo as u32, hi as u32);
    while start <= end {
        // The largest aligned block starting at `start` that stays within `end`.
        let mut size_bits = if start == 0 {
            16
        } else {
            start.trailing_zeros().min(16)
        };
        while size_bits > 0 && start + (1u32 << size_bits) - 1 > end {
            size_bits -= 1;
        }
        out.push((start as u16, (16 - size_bits) as u8));
        start += 1u32 << size_bits;
    }
    out
}

/// The datapath entries one engine key stands for (usually one: kept inline).
pub fn expand_key(k: &MapKey) -> SmallVec<[PolicyEntryKey; 2]> {
    let egress = k.direction == Direction::Egress;
    if k.protocol == 0 {
        // L3-only entries cover every protocol and port.
        return smallvec::smallvec![PolicyEntryKey {
            identity: k.identity,
            egress,
            protocol: 0,
            port: 0,
            port_prefix_len: 0,
        }];
    }
    if k.port_lo == k.port_hi {
        return smallvec::smallvec![PolicyEntryKey {
            identity: k.identity,
            egress,
            protocol: k.protocol,
            port: k.port_lo,
            port_prefix_len: 16,
        }];
    }
    port_range_to_prefixes(k.port_lo, k.port_hi)
        .into_iter()
        .map(|(port, port_prefix_len)| PolicyEntryKey {
            identity: k.identity,
            egress,
            protocol: k.protocol,
            port,
            port_prefix_len,
        })
        .collect()
}

/// A change to apply to the kernel map: an entry with its deny flag, attribution cookie and
/// whether its allowed connections go to the HTTP proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryChange {
    Upsert(PolicyEntryKey, bool, Cookie, bool),
    Delete(PolicyEntryKey),
}

/// What one engine key contributes to a datapath entry: deny, cookie, redirect.
type Contribution = (bool, Cookie, bool);

/// The engine keys that expand to one datapath entry (usually one), with their deny flag,
/// cookie and redirect flag. The entry denies if any does; its cookie is the first (smallest
/// key) of those that decide it, so an entry several rules overlap on names one of them; an
/// allow redirects if any of its allows does. Inline: an entry almost always has one
/// contributor, and a table holds thousands of entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Contributors(SmallVec<[(MapKey, bool, Cookie, bool); 1]>);

impl Contributors {
    fn value(&self) -> Option<Contribution> {
        let deny = self.0.iter().any(|c| c.1);
        let redirect = !deny && self.0.iter().any(|c| c.3);
        self.0
            .iter()
            .filter(|c| c.1 == deny)
            .min_by_key(|c| c.0)
            .map(|c| (deny, c.2, redirect))
    }
}

/// Engine keys realized in one endpoint's map, with the datapath entries they expand to. An
/// engine key's own contribution is found in the first entry it expands to (each entry keeps
/// its contributors): no second table, whose lookups were as many cache misses again (a table
/// per endpoint, a thousand endpoints: the loader's one thread missed twice per key).
#[derive(Debug, Clone, Default)]
pub struct EntryTable {
    /// Unordered (a hash map: most of a regeneration's lookups are here); the dumps sort.
    entries: HashMap<PolicyEntryKey, Contributors>,
}

impl EntryTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of datapath entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The deny flag of one datapath entry, when present.
    pub fn get(&self, k: &PolicyEntryKey) -> Option<bool> {
        self.entries
            .get(k)
            .and_then(Contributors::value)
            .map(|(d, _, _)| d)
    }

    /// The datapath entries and their deny flag, in no particular order.
    pub fn entries(&self) -> impl Iterator<Item = (PolicyEntryKey, bool)> + '_ {
        self.entries
            .iter()
            .filter_map(|(k, c)| c.value().map(|(d, _, _)| (*k, d)))
    }

    /// The datapath entries with their deny flag, cookie and redirect flag, in no particular
    /// order.
    pub fn values(&self) -> impl Iterator<Item = (PolicyEntryKey, bool, Cookie, bool)> + '_ {
        self.entries
            .iter()
            .filter_map(|(k, c)| c.value().map(|(d, cookie, r)| (*k, d, cookie, r)))
    }

    /// Every cookie its entries' contributors carry (the ones the map holds among them).
    pub fn cookies(&self) -> impl Iterator<Item = Cookie> + '_ {
        self.entries.values().flat_map(|c| c.0.iter().map(|x| x.2))
    }

    /// What `key` contributes now (`None`: absent); `first`: the first entry it expands to.
    fn contribution(&self, first: Option<&PolicyEntryKey>, key: &MapKey) -> Option<Contribution> {
        let c = self.entries.get(first?)?;
        c.0.iter().find(|x| x.0 == *key).map(|x| (x.1, x.2, x.3))
    }

    /// `key` contributes `value` to each entry it expands to (`expanded`), replacing what it
    /// contributed before.
    fn set(&mut self, key: &MapKey, expanded: &[PolicyEntryKey], value: Contribution) {
        let mine = (*key, value.0, value.1, value.2);
        for e in expanded {
            let c = self.entries.entry(*e).or_default();
            match c.0.iter_mut().find(|x| x.0 == *key) {
                Some(x) => *x = mine,
                None => c.0.push(mine),
            }
        }
    }

    /// `key` contributes nothing any more to the entries it expands to (`expanded`).
    fn withdraw(&mut self, key: &MapKey, expanded: &[PolicyEntryKey]) {
        for e in expanded {
            let Some(c) = self.entries.get_mut(e) else {
                continue;
            };
            if let Some(i) = c.0.iter().position(|x| x.0 == *key) {
                c.0.swap_remove(i);
            }
            if c.0.is_empty() {
                self.entries.remove(e);
            }
        }
    }

    /// Applies an engine-level delta and returns the entry-level changes for the kernel map
    /// (only entries whose presence, deny flag or cookie actually changed).
    pub fn apply(&mut self, delta: &MapDelta) -> Vec<EntryChange> {
        self.apply_tracked(delta)
            .into_iter()
            .map(|(c, _)| c)
            .collect()
    }

    /// Upper bound of the datapath entries after `delta` (for a capacity check before it).
    pub fn len_bound_after(&self, delta: &MapDelta) -> usize {
        self.entries.len()
            + delta
                .upserts
                .iter()
                .map(|(k, _)| expand_key(k).len())
                .sum::<usize>()
    }

    /// [`apply`](Self::apply), each change with the entry's deny flag before it (`None`:
    /// absent).
    pub fn apply_tracked(&mut self, delta: &MapDelta) -> Vec<(EntryChange, Option<bool>)> {
        let deletes: Vec<SmallVec<[PolicyEntryKey; 2]>> =
            delta.deletes.iter().map(expand_key).collect();
        let upserts: Vec<SmallVec<[PolicyEntryKey; 2]>> =
            delta.upserts.iter().map(|(k, _)| expand_key(k)).collect();
        // Each touched entry's value before the change, in key order (a sorted vector: the
        // delta's keys come sorted, and most expand to one entry). These lookups are the
        // table's cache misses; what follows finds the same entries in the cache.
        let mut before: Vec<(PolicyEntryKey, Option<Contribution>)> =
            Vec::with_capacity(delta.upserts.len() + delta.deletes.len());
        for e in upserts.iter().chain(&deletes).flatten() {
            before.push((*e, self.entries.get(e).and_then(Contributors::value)));
        }
        before.sort_unstable_by_key(|(e, _)| *e);
        before.dedup_by_key(|(e, _)| *e);
        for (k, expanded) in delta.deletes.iter().zip(&deletes) {
            self.withdraw(k, expanded);
        }
        for ((k, deny), expanded) in delta.upserts.iter().zip(&upserts) {
            let value = (
                *deny,
                delta.cookies.get(k).copied().unwrap_or(0),
                delta.redirects.contains(k),
            );
            if self.contribution(expanded.first(), k) != Some(value) {
                self.set(k, expanded, value);
            }
        }
        let mut out = Vec::new();
        for (e, was) in before {
            let was_deny = was.map(|(d, _, _)| d);
            match (was, self.entries.get(&e).and_then(Contributors::value)) {
                (a, b) if a == b => {}
                (_, Some((deny, cookie, redirect))) => {
                    out.push((EntryChange::Upsert(e, deny, cookie, redirect), was_deny))
                }
                (Some(_), None) => out.push((EntryChange::Delete(e), was_deny)),
                (None, None) => {}
            }
        }
        out
    }

    /// Forgets everything (the kernel map was cleared).
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Deny-wins lookup over the datapath entries: the contract the BPF program implements.
    pub fn lookup(
        &self,
        identity: NumericIdentity,
        egress: bool,
        protocol: u8,
        port: u16,
    ) -> Option<bool> {
        let mut allowed = false;
        for id in [identity, 0] {
            for proto in [protocol, 0] {
                // Every prefix length, as the program probes them.
                for len in 0..=16u8 {
                    let mask = if len == 0 { 0 } else { u16::MAX << (16 - len) };
                    let k = PolicyEntryKey {
                        identity: id,
                        egress,
                        protocol: proto,
                        port: port & mask,
                        port_prefix_len: len,
                    };
                    match self.entries.get(&k).and_then(Contributors::value) {
                        Some((true, _, _)) => return Some(true),
                        Some(_) => allowed = true,
                        None => {}
                    }
                }
                if id == 0 && proto == 0 {
                    break;
                }
            }
            if identity == 0 {
                break;
            }
        }
        allowed.then_some(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_redirects_when_any_allow_behind_it_does_and_never_when_it_denies() {
        let mk = |lo, hi| MapKey {
            direction: Direction::Ingress,
            identity: 300,
            protocol: 6,
            port_lo: lo,
            port_hi: hi,
        };
        let mut t = EntryTable::new();
        // 79-80 (L7) expands to 79/16 and 80/16; 80 (L3/L4) to 80/16 too.
        let ch = t.apply(&MapDelta {
            upserts: vec![(mk(79, 80), false), (mk(80, 80), false)],
            redirects: [mk(79, 80)].into_iter().collect(),
            ..Default::default()
        });
        assert!(
            ch.iter()
                .all(|c| matches!(c, EntryChange::Upsert(_, false, _, true))),
            "{ch:?}"
        );
        // The redirect flag alone changing rewrites the entries.
        let ch = t.apply(&MapDelta {
            upserts: vec![(mk(79, 80), false)],
            ..Default::default()
        });
        assert!(
            ch.iter()
                .all(|c| matches!(c, EntryChange::Upsert(_, false, _, false)))
                && ch.len() == 2,
            "{ch:?}"
        );
        let ch = t.apply(&MapDelta {
            upserts: vec![(mk(79, 80), false), (mk(80, 80), true)],
            redirects: [mk(79, 80)].into_iter().collect(),
            ..Default::default()
        });
        assert!(
            ch.iter()
                .any(|c| matches!(c, EntryChange::Upsert(k, true, _, false) if k.port == 80)),
            "{ch:?}"
        );
    }

    #[test]
    fn ranges_split_into_aligned_blocks() {
        assert_eq!(port_range_to_prefixes(80, 80), vec![(80, 16)]);
        assert_eq!(port_range_to_prefixes(0, 65535), vec![(0, 0)]);
        assert_eq!(port_range_to_prefixes(8080, 8083), vec![(8080, 14)]);
        assert_eq!(
            port_range_to_prefixes(1, 4),
            vec![(1, 16), (2, 15), (4, 16)]
        );
        for (lo, hi) in [(1u16, 1000u16), (5, 65535), (1024, 2047), (3, 3)] {
            let blocks = port_range_to_prefixes(lo, hi);
            let covered: u32 = blocks.iter().map(|(_, l)| 1u32 << (16 - *l as u32)).sum();
            assert_eq!(covered, (hi - lo) as u32 + 1, "{lo}-{hi}");
            for (p, l) in blocks {
                let k = PolicyEntryKey {
                    identity: 1,
                    egress: false,
                    protocol: 6,
                    port: p,
                    port_prefix_len: l,
                };
                let (a, b) = k.port_range();
                assert!(a >= lo && b <= hi);
            }
        }
    }

    fn mk(identity: u32, lo: u16, hi: u16) -> MapKey {
        MapKey {
            direction: Direction::Ingress,
            identity,
            protocol: 6,
            port_lo: lo,
            port_hi: hi,
        }
    }

    #[test]
    fn overlapping_keys_share_entries_and_deny_wins() {
        let mut t = EntryTable::new();
        let ch = t.apply(&MapDelta {
            upserts: vec![(mk(300, 79, 80), false), (mk(300, 80, 80), false)],
            deletes: vec![],
            ..Default::default()
        });
        assert_eq!(t.len(), 2, "79/16 and 80/16");
        assert_eq!(ch.len(), 2);
        // Removing the 80-80 key keeps entry 80/16 (still needed by 79-80).
        let ch = t.apply(&MapDelta {
            upserts: vec![],
            deletes: vec![mk(300, 80, 80)],
            ..Default::default()
        });
        assert!(ch.is_empty());
        assert_eq!(t.lookup(300, false, 6, 80), Some(false));
        // A deny on 80 turns that entry into a deny; the allow on 81 stays.
        let ch = t.apply(&MapDelta {
            upserts: vec![(mk(300, 80, 80), true)],
            deletes: vec![],
            ..Default::default()
        });
        assert_eq!(
            ch,
            vec![EntryChange::Upsert(
                PolicyEntryKey {
                    identity: 300,
                    egress: false,
                    protocol: 6,
                    port: 80,
                    port_prefix_len: 16
                },
                true,
                0,
                false
            )]
        );
        // An attribution change alone rewrites the entry (its cookie), nothing else.
        let ch = t.apply(&MapDelta {
            upserts: vec![(mk(300, 80, 80), true)],
            cookies: [(mk(300, 80, 80), 77)].into_iter().collect(),
            ..Default::default()
        });
        assert!(
            matches!(ch.as_slice(), [EntryChange::Upsert(k, true, 77, false)] if k.port == 80),
            "{ch:?}"
        );
        assert_eq!(t.lookup(300, false, 6, 80), Some(true));
        assert_eq!(t.lookup(300, false, 6, 79), Some(false));
        assert_eq!(t.lookup(300, false, 6, 81), None);
    }

    #[test]
    fn wildcards_and_deny_precedence_in_lookup() {
        let mut t = EntryTable::new();
        let any = MapKey {
            direction: Direction::Ingress,
            identity: 0,
            protocol: 0,
            port_lo: 0,
            port_hi: 65535,
        };
        t.apply(&MapDelta {
            upserts: vec![(mk(300, 1000, 2000), false), (any, true)],
            deletes: vec![],
            ..Default::default()
        });
        assert_eq!(t.lookup(300, false, 6, 1500), Some(true));
        assert_eq!(t.lookup(300, true, 6, 1500), None);
    }
}
