//! An in-memory datapath: a faithful model of the BPF maps (same entry keys, same capacity
//! limits, same errors), without a kernel. For unit tests and machines without BPF; never a
//! replacement for the real datapath in acceptance tests.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use ipnet::IpNet;

use super::abi::{
    EntryChange, EntryTable, PolicyEntryKey, IPCACHE_MAX_ENTRIES, POLICY_MAP_MAX_ENTRIES,
};
use super::{
    Datapath, DatapathError, EndpointAttachment, EndpointFlags, EndpointId, PolicyMapDump,
    PolicyMapEntry, SyncStats,
};
use crate::policy::identity::{NumericIdentity, IDENTITY_WORLD_IPV4, IDENTITY_WORLD_IPV6};
use crate::policy::mapstate::MapDelta;

#[derive(Debug, Clone)]
struct Endpoint {
    attachment: EndpointAttachment,
    flags: EndpointFlags,
    table: EntryTable,
    counters: HashMap<super::abi::PolicyEntryKey, (u64, u64)>,
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct MemoryDatapath {
    endpoints: BTreeMap<EndpointId, Endpoint>,
    ipcache: BTreeMap<IpNet, NumericIdentity>,
    policy_capacity: usize,
    ipcache_capacity: usize,
}

impl Default for MemoryDatapath {
    fn default() -> Self {
        Self::new()
    }
}

/// What `MemoryDatapath::decide` concluded for a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    Drop,
}

impl MemoryDatapath {
    pub fn new() -> Self {
        Self::with_capacity(POLICY_MAP_MAX_ENTRIES, IPCACHE_MAX_ENTRIES)
    }

    /// A datapath with smaller maps (tests of the capacity limits).
    pub fn with_capacity(policy_capacity: usize, ipcache_capacity: usize) -> Self {
        MemoryDatapath {
            endpoints: BTreeMap::new(),
            ipcache: BTreeMap::new(),
            policy_capacity,
            ipcache_capacity,
        }
    }

    /// The identity the ipcache gives `ip` (longest prefix; world if none).
    pub fn identity_of(&self, ip: IpAddr) -> NumericIdentity {
        self.ipcache
            .iter()
            .filter(|(p, _)| p.contains(&ip))
            .max_by_key(|(p, _)| p.prefix_len())
            .map(|(_, id)| *id)
            .unwrap_or(if ip.is_ipv4() {
                IDENTITY_WORLD_IPV4
            } else {
                IDENTITY_WORLD_IPV6
            })
    }

    /// Decides a packet for endpoint `id` in one direction, as the BPF program does.
    pub fn decide(
        &self,
        id: EndpointId,
        egress: bool,
        peer: IpAddr,
        protocol: u8,
        port: u16,
    ) -> Option<Verdict> {
        let ep = self.endpoints.get(&id)?;
        if ep.flags.drop_all {
            return Some(Verdict::Drop);
        }
        let identity = self.identity_of(peer);
        Some(match ep.table.lookup(identity, egress, protocol, port) {
            Some(true) => Verdict::Drop,
            Some(false) => Verdict::Allow,
            None => {
                let isolated = if egress {
                    ep.flags.egress_default_deny
                } else {
                    ep.flags.ingress_default_deny
                };
                if isolated {
                    Verdict::Drop
                } else {
                    Verdict::Allow
                }
            }
        })
    }
}

impl Datapath for MemoryDatapath {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn attach_endpoint(&mut self, ep: &EndpointAttachment) -> Result<(), DatapathError> {
        match self.endpoints.get_mut(&ep.id) {
            Some(e) => e.attachment = ep.clone(),
            None => {
                self.endpoints.insert(
                    ep.id,
                    Endpoint {
                        attachment: ep.clone(),
                        // A freshly attached endpoint drops everything until its first policy
                        // sync: never a window of allow-all.
                        flags: EndpointFlags {
                            drop_all: true,
                            ..Default::default()
                        },
                        table: EntryTable::new(),
                        counters: HashMap::new(),
                    },
                );
            }
        }
        Ok(())
    }

    fn detach_endpoint(&mut self, id: EndpointId) -> Result<(), DatapathError> {
        self.endpoints.remove(&id);
        Ok(())
    }

    fn sync_policy(
        &mut self,
        id: EndpointId,
        flags: EndpointFlags,
        delta: &MapDelta,
        replace: bool,
    ) -> Result<SyncStats, DatapathError> {
        let capacity = self.policy_capacity;
        let ep = self
            .endpoints
            .get_mut(&id)
            .ok_or(DatapathError::UnknownEndpoint(id))?;
        // As the BPF datapath: in place (taken, put back below) when the change fits whatever
        // it holds; else on a copy, so a failed sync leaves nothing half-applied.
        let in_place = !replace && ep.table.len_bound_after(delta) <= capacity;
        let mut table = if replace {
            EntryTable::new()
        } else if in_place {
            std::mem::take(&mut ep.table)
        } else {
            ep.table.clone()
        };
        let changes = table.apply(delta);
        if table.len() > capacity {
            ep.flags = EndpointFlags {
                drop_all: true,
                ..flags
            };
            return Err(DatapathError::PolicyMapFull {
                endpoint: id,
                needed: table.len(),
                capacity,
            });
        }
        let mut stats = SyncStats::default();
        for c in &changes {
            match c {
                EntryChange::Upsert(..) => stats.upserted += 1,
                EntryChange::Delete(k) => {
                    ep.counters.remove(k);
                    stats.deleted += 1;
                }
            }
        }
        stats.entries = table.len();
        ep.table = table;
        ep.flags = flags;
        Ok(stats)
    }

    fn upsert_ipcache(
        &mut self,
        prefix: IpNet,
        identity: NumericIdentity,
    ) -> Result<(), DatapathError> {
        if !self.ipcache.contains_key(&prefix) && self.ipcache.len() >= self.ipcache_capacity {
            return Err(DatapathError::IpcacheFull {
                prefix,
                capacity: self.ipcache_capacity,
            });
        }
        self.ipcache.insert(prefix, identity);
        Ok(())
    }

    fn remove_ipcache(&mut self, prefix: IpNet) -> Result<(), DatapathError> {
        self.ipcache.remove(&prefix);
        Ok(())
    }

    fn dump_policy(&self, id: EndpointId) -> Result<PolicyMapDump, DatapathError> {
        let ep = self
            .endpoints
            .get(&id)
            .ok_or(DatapathError::UnknownEndpoint(id))?;
        let mut keys: Vec<(PolicyEntryKey, bool)> = ep.table.entries().collect();
        keys.sort_unstable();
        let entries = keys
            .into_iter()
            .map(|(k, deny)| {
                let (packets, bytes) = ep.counters.get(&k).copied().unwrap_or_default();
                PolicyMapEntry::new(&k, deny, packets, bytes)
            })
            .collect();
        Ok(PolicyMapDump {
            endpoint: id,
            flags: ep.flags,
            capacity: self.policy_capacity,
            entries,
        })
    }

    fn dump_ipcache(&self) -> Vec<(IpNet, NumericIdentity)> {
        self.ipcache.iter().map(|(p, i)| (*p, *i)).collect()
    }

    fn endpoints(&self) -> Vec<EndpointId> {
        self.endpoints.keys().copied().collect()
    }

    fn cookies_in_use(&self) -> std::collections::HashSet<crate::policy::attribution::Cookie> {
        let mut out = Default::default();
        for ep in self.endpoints.values() {
            crate::datapath::cookies_of(&ep.flags, &ep.table, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::mapstate::MapKey;
    use crate::policy::rule::{Direction, PROTO_TCP};

    fn attach(dp: &mut MemoryDatapath, id: EndpointId) {
        dp.attach_endpoint(&EndpointAttachment {
            id,
            interface: None,
            ips: vec![],
            identity: 300,
            mac: None,
        })
        .unwrap();
    }

    /// Syncs `upserts` into endpoint `id`'s map.
    fn upsert(
        dp: &mut MemoryDatapath,
        id: EndpointId,
        flags: EndpointFlags,
        upserts: Vec<(MapKey, bool)>,
    ) {
        let delta = MapDelta {
            upserts,
            ..Default::default()
        };
        dp.sync_policy(id, flags, &delta, false).unwrap();
    }

    fn allow(identity: u32, lo: u16, hi: u16) -> (MapKey, bool) {
        (
            MapKey {
                direction: Direction::Ingress,
                identity,
                protocol: PROTO_TCP,
                port_lo: lo,
                port_hi: hi,
            },
            false,
        )
    }

    #[test]
    fn attached_endpoints_drop_until_first_sync() {
        let mut dp = MemoryDatapath::new();
        attach(&mut dp, 7);
        let peer: IpAddr = "10.0.0.9".parse().unwrap();
        assert_eq!(
            dp.decide(7, false, peer, PROTO_TCP, 80),
            Some(Verdict::Drop)
        );
        let flags = EndpointFlags {
            ingress_default_deny: true,
            ..Default::default()
        };
        dp.upsert_ipcache("10.0.0.9/32".parse().unwrap(), 400)
            .unwrap();
        upsert(&mut dp, 7, flags, vec![allow(400, 80, 80)]);
        assert_eq!(
            dp.decide(7, false, peer, PROTO_TCP, 80),
            Some(Verdict::Allow)
        );
        assert_eq!(
            dp.decide(7, false, peer, PROTO_TCP, 81),
            Some(Verdict::Drop)
        );
        assert_eq!(
            dp.decide(7, true, peer, PROTO_TCP, 81),
            Some(Verdict::Allow)
        );
    }

    #[test]
    fn a_full_map_fails_closed_and_keeps_the_old_entries() {
        let mut dp = MemoryDatapath::with_capacity(4, 16);
        attach(&mut dp, 1);
        let flags = EndpointFlags {
            ingress_default_deny: true,
            ..Default::default()
        };
        upsert(&mut dp, 1, flags, vec![allow(400, 80, 80)]);
        // 1..=1000 needs more than four prefix blocks.
        let err = dp
            .sync_policy(
                1,
                flags,
                &MapDelta {
                    upserts: vec![allow(401, 1, 1000)],
                    deletes: vec![],
                    ..Default::default()
                },
                false,
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                DatapathError::PolicyMapFull {
                    endpoint: 1,
                    capacity: 4,
                    ..
                }
            ),
            "{err}"
        );
        let dump = dp.dump_policy(1).unwrap();
        assert!(dump.flags.drop_all);
        assert_eq!(dump.entries.len(), 1);
        assert_eq!(
            dp.decide(1, false, "10.0.0.1".parse().unwrap(), PROTO_TCP, 80),
            Some(Verdict::Drop)
        );
    }

    #[test]
    fn ipcache_capacity_is_enforced() {
        let mut dp = MemoryDatapath::with_capacity(4, 1);
        dp.upsert_ipcache("10.0.0.1/32".parse().unwrap(), 300)
            .unwrap();
        dp.upsert_ipcache("10.0.0.1/32".parse().unwrap(), 301)
            .unwrap();
        assert!(matches!(
            dp.upsert_ipcache("10.0.0.2/32".parse().unwrap(), 300),
            Err(DatapathError::IpcacheFull { .. })
        ));
    }
}
