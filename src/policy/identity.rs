//! Security identities: reserved ones, one per distinct label set, and node-local CIDR identities.

use crate::hashing::HashMap;
use std::fmt;
use std::sync::Arc;

use ipnet::IpNet;

use super::labels::{Label, Labels, SOURCE_CIDR};
use super::numbering::{NumberRecord, Restored};

/// A numeric security identity. 0 is the wildcard in policy maps.
pub type NumericIdentity = u32;

/// The wildcard identity used in map keys ("any peer").
pub const IDENTITY_ANY: NumericIdentity = 0;
pub const IDENTITY_HOST: NumericIdentity = 1;
pub const IDENTITY_WORLD: NumericIdentity = 2;
pub const IDENTITY_UNMANAGED: NumericIdentity = 3;
pub const IDENTITY_HEALTH: NumericIdentity = 4;
pub const IDENTITY_INIT: NumericIdentity = 5;
pub const IDENTITY_REMOTE_NODE: NumericIdentity = 6;
pub const IDENTITY_KUBE_APISERVER: NumericIdentity = 7;
pub const IDENTITY_INGRESS: NumericIdentity = 8;
pub const IDENTITY_WORLD_IPV4: NumericIdentity = 9;
pub const IDENTITY_WORLD_IPV6: NumericIdentity = 10;

/// First identity handed out for label sets (Cilium's cluster-scoped range starts here).
pub const FIRST_CLUSTER_IDENTITY: NumericIdentity = 256;
/// Node-local CIDR identities are `LOCAL_IDENTITY_FLAG | n` (Cilium's `1<<24 | n`).
pub const LOCAL_IDENTITY_FLAG: NumericIdentity = 1 << 24;

/// The reserved identities with their `reserved:` label names.
pub const RESERVED: &[(NumericIdentity, &str)] = &[
    (IDENTITY_HOST, "host"),
    (IDENTITY_WORLD, "world"),
    (IDENTITY_UNMANAGED, "unmanaged"),
    (IDENTITY_HEALTH, "health"),
    (IDENTITY_INIT, "init"),
    (IDENTITY_REMOTE_NODE, "remote-node"),
    (IDENTITY_KUBE_APISERVER, "kube-apiserver"),
    (IDENTITY_INGRESS, "ingress"),
    (IDENTITY_WORLD_IPV4, "world-ipv4"),
    (IDENTITY_WORLD_IPV6, "world-ipv6"),
];

/// The name of a reserved identity (`host`, `world`, ...), if `id` is one.
pub fn reserved_name(id: NumericIdentity) -> Option<&'static str> {
    RESERVED
        .iter()
        .find(|(n, _)| *n == id)
        .map(|(_, name)| *name)
}

/// An identity and what defines it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentityInfo {
    pub id: NumericIdentity,
    /// Shared: the allocator, the selector cache and every copy of the info hold one label set
    /// per identity.
    pub labels: Arc<Labels>,
    /// Set for CIDR identities: the prefix they stand for.
    pub cidr: Option<IpNet>,
}

impl IdentityInfo {
    /// A CIDR identity: labels `cidr:<prefix>` and `reserved:world-ipv4|world-ipv6`, so the
    /// `world` entities select it as Cilium's do.
    pub fn cidr(id: NumericIdentity, prefix: IpNet) -> Self {
        let world = if matches!(prefix, IpNet::V4(_)) {
            "world-ipv4"
        } else {
            "world-ipv6"
        };
        let labels: Labels = [
            Label::new(SOURCE_CIDR, &prefix.to_string(), ""),
            Label::reserved(world),
        ]
        .into_iter()
        .collect();
        IdentityInfo {
            id,
            labels: Arc::new(labels),
            cidr: Some(prefix),
        }
    }

    /// True for the world identities that stand for addresses of the given family.
    pub fn is_world_of_family(&self, v4: bool) -> bool {
        self.id == IDENTITY_WORLD
            || (v4 && self.id == IDENTITY_WORLD_IPV4)
            || (!v4 && self.id == IDENTITY_WORLD_IPV6)
    }

    pub fn is_reserved(&self) -> bool {
        self.id < FIRST_CLUSTER_IDENTITY
    }
}

impl fmt::Display for IdentityInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(name) = reserved_name(self.id) {
            return write!(f, "{} (reserved:{name})", self.id);
        }
        if let Some(p) = self.cidr {
            return write!(f, "{} (cidr:{p})", self.id);
        }
        write!(f, "{}", self.id)
    }
}

/// What changed in the identity set, for the selector cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allocation {
    /// The identity was created by this call.
    New(NumericIdentity),
    /// The identity already existed; its reference count went up.
    Existing(NumericIdentity),
}

impl Allocation {
    pub fn id(&self) -> NumericIdentity {
        match self {
            Allocation::New(id) | Allocation::Existing(id) => *id,
        }
    }
}

/// Hands out identities: one per distinct label set, one per CIDR prefix, reference counted.
/// Reserved identities always exist and are never released.
#[derive(Debug, Clone)]
pub struct IdentityAllocator {
    by_id: HashMap<NumericIdentity, (IdentityInfo, u32)>,
    /// Keyed by the same shared label set as `by_id`'s info.
    by_labels: HashMap<Arc<Labels>, NumericIdentity>,
    by_cidr: HashMap<IpNet, NumericIdentity>,
    next_cluster: NumericIdentity,
    next_local: NumericIdentity,
    /// While the agent restores its state: the numbers a previous run used (`numbering`).
    restored: Option<Box<Restored>>,
    /// Numbers handed out since the journal was last taken, when the owner keeps one.
    journal: Option<Vec<NumberRecord>>,
}

impl Default for IdentityAllocator {
    fn default() -> Self {
        Self::new()
    }
}

impl IdentityAllocator {
    pub fn new() -> Self {
        let mut a = IdentityAllocator {
            by_id: HashMap::default(),
            by_labels: HashMap::default(),
            by_cidr: HashMap::default(),
            next_cluster: FIRST_CLUSTER_IDENTITY,
            next_local: 1,
            restored: None,
            journal: None,
        };
        for (id, name) in RESERVED {
            let labels: Arc<Labels> = Arc::new([Label::reserved(name)].into_iter().collect());
            a.by_labels.insert(labels.clone(), *id);
            a.by_id.insert(
                *id,
                (
                    IdentityInfo {
                        id: *id,
                        labels,
                        cidr: None,
                    },
                    u32::MAX,
                ),
            );
        }
        a
    }

    /// The identity for a label set, created on first use (with the number a previous run
    /// gave it, while restoring).
    pub fn allocate(&mut self, labels: &Labels) -> Allocation {
        if let Some(id) = self.by_labels.get(labels).copied() {
            self.retain(id);
            return Allocation::Existing(id);
        }
        let id = match self.restored_number(|r| r.labels(labels)) {
            Some(id) => id,
            None => self.next_cluster_number(),
        };
        let labels = Arc::new(labels.clone());
        self.by_labels.insert(labels.clone(), id);
        self.journal_labels(id, &labels);
        let info = IdentityInfo {
            id,
            labels,
            cidr: None,
        };
        self.by_id.insert(id, (info, 1));
        Allocation::New(id)
    }

    /// A restored number, unless something of this run holds it already.
    fn restored_number(
        &self,
        f: impl FnOnce(&Restored) -> Option<NumericIdentity>,
    ) -> Option<NumericIdentity> {
        let id = f(self.restored.as_deref()?)?;
        (!self.by_id.contains_key(&id)).then_some(id)
    }

    /// Whether `id` is taken, or held for what a previous run gave it.
    fn taken(&self, id: NumericIdentity) -> bool {
        self.by_id.contains_key(&id) || self.restored.as_ref().is_some_and(|r| r.holds(id))
    }

    /// The next free label-set number; after the last one numbering wraps around.
    fn next_cluster_number(&mut self) -> NumericIdentity {
        // Skips numbers restored endpoints hold, so restores do not renumber anything else.
        for _ in FIRST_CLUSTER_IDENTITY..LOCAL_IDENTITY_FLAG {
            if self.next_cluster >= LOCAL_IDENTITY_FLAG {
                self.next_cluster = FIRST_CLUSTER_IDENTITY;
            }
            let id = self.next_cluster;
            self.next_cluster += 1;
            if !self.taken(id) {
                return id;
            }
        }
        // Sixteen million label sets at once: not a cluster this agent can hold anyway.
        panic!("identity numbers exhausted")
    }

    /// The next free CIDR number.
    fn next_local_number(&mut self) -> NumericIdentity {
        for _ in 1..LOCAL_IDENTITY_FLAG {
            if self.next_local >= LOCAL_IDENTITY_FLAG {
                self.next_local = 1;
            }
            let id = LOCAL_IDENTITY_FLAG | self.next_local;
            self.next_local += 1;
            if !self.taken(id) {
                return id;
            }
        }
        panic!("CIDR identity numbers exhausted")
    }

    fn journal_labels(&mut self, id: NumericIdentity, labels: &Labels) {
        if let Some(j) = self.journal.as_mut() {
            j.push(NumberRecord::Labels {
                id,
                labels: labels.to_strings(),
            });
        }
    }

    /// From now on every number handed out is also kept for [`Self::take_journal`].
    pub fn keep_journal(&mut self) {
        self.journal.get_or_insert_with(Vec::new);
    }

    /// The numbers handed out since the last call (oldest first).
    pub fn take_journal(&mut self) -> Vec<NumberRecord> {
        self.journal
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Every number in use and where numbering goes on: a compacted journal.
    pub fn numbering(&self) -> Vec<NumberRecord> {
        let mut out = vec![NumberRecord::Next {
            next_cluster: self.next_cluster,
            next_local: self.next_local,
        }];
        let mut live: Vec<&IdentityInfo> = self.iter().filter(|i| !i.is_reserved()).collect();
        live.sort_by_key(|i| i.id);
        out.extend(live.into_iter().map(|i| match i.cidr {
            Some(cidr) => NumberRecord::Cidr { id: i.id, cidr },
            None => NumberRecord::Labels {
                id: i.id,
                labels: i.labels.to_strings(),
            },
        }));
        out
    }

    /// While the agent restores its state, label sets and prefixes a previous run knew get
    /// their old numbers, and no other number it used is handed out.
    pub fn restore_numbering(&mut self, restored: Restored) {
        self.next_cluster = self.next_cluster.max(restored.next_cluster);
        self.next_local = self.next_local.max(restored.next_local);
        self.restored = Some(Box::new(restored));
    }

    /// The state is restored: numbering goes on from the highest number the previous run
    /// used (its unclaimed numbers are not handed out again before it wraps around).
    pub fn end_restore(&mut self) {
        self.restored = None;
    }

    /// Re-creates an identity with a known number (endpoint restore). Fails if the number is
    /// taken by another label set.
    pub fn restore(&mut self, id: NumericIdentity, labels: &Labels) -> Result<Allocation, String> {
        if let Some(existing) = self.by_labels.get(labels).copied() {
            if existing == id {
                self.retain(id);
                return Ok(Allocation::Existing(id));
            }
            return Err(format!("labels already have identity {existing}, not {id}"));
        }
        if self.by_id.contains_key(&id) {
            return Err(format!("identity {id} is taken by other labels"));
        }
        let labels = Arc::new(labels.clone());
        self.by_labels.insert(labels.clone(), id);
        self.journal_labels(id, &labels);
        self.by_id.insert(
            id,
            (
                IdentityInfo {
                    id,
                    labels,
                    cidr: None,
                },
                1,
            ),
        );
        Ok(Allocation::New(id))
    }

    /// The node-local identity for a CIDR prefix, created on first use.
    pub fn allocate_cidr(&mut self, prefix: IpNet) -> Allocation {
        let prefix = prefix.trunc();
        if let Some(id) = self.by_cidr.get(&prefix).copied() {
            self.retain(id);
            return Allocation::Existing(id);
        }
        let id = match self.restored_number(|r| r.cidr(&prefix)) {
            Some(id) => id,
            None => self.next_local_number(),
        };
        self.by_cidr.insert(prefix, id);
        if let Some(j) = self.journal.as_mut() {
            j.push(NumberRecord::Cidr { id, cidr: prefix });
        }
        self.by_id.insert(id, (IdentityInfo::cidr(id, prefix), 1));
        Allocation::New(id)
    }

    fn retain(&mut self, id: NumericIdentity) {
        if let Some((_, rc)) = self.by_id.get_mut(&id) {
            *rc = rc.saturating_add(1);
        }
    }

    /// Drops one reference. Returns the identity when this was the last one (it is gone now).
    /// Whether releasing `id` once would free it (its last reference).
    pub fn is_last_reference(&self, id: NumericIdentity) -> bool {
        self.by_id.get(&id).is_some_and(|(_, rc)| *rc == 1)
    }

    pub fn release(&mut self, id: NumericIdentity) -> Option<IdentityInfo> {
        let (_, rc) = self.by_id.get_mut(&id)?;
        if *rc == u32::MAX {
            return None; // reserved
        }
        *rc -= 1;
        if *rc > 0 {
            return None;
        }
        let (info, _) = self.by_id.remove(&id)?;
        self.by_labels.remove(&info.labels);
        if let Some(p) = info.cidr {
            self.by_cidr.remove(&p);
        }
        Some(info)
    }

    /// Gives a CIDR identity the `fqdn:<name>` labels of the names its address was learned
    /// for (none: back to its plain CIDR labels). The number stays; only the labels change.
    pub fn set_fqdn_names<'a>(
        &mut self,
        id: NumericIdentity,
        names: impl IntoIterator<Item = &'a String>,
    ) -> Option<&IdentityInfo> {
        let (info, _) = self.by_id.get_mut(&id)?;
        let prefix = info.cidr?;
        let mut fresh = IdentityInfo::cidr(id, prefix);
        let labels = Arc::make_mut(&mut fresh.labels);
        for n in names {
            labels.insert(Label::new(crate::policy::fqdn::SOURCE_FQDN, n, ""));
        }
        *info = fresh;
        Some(info)
    }

    pub fn get(&self, id: NumericIdentity) -> Option<&IdentityInfo> {
        self.by_id.get(&id).map(|(i, _)| i)
    }

    pub fn lookup_labels(&self, labels: &Labels) -> Option<NumericIdentity> {
        self.by_labels.get(labels).copied()
    }

    pub fn lookup_cidr(&self, prefix: &IpNet) -> Option<NumericIdentity> {
        self.by_cidr.get(&prefix.trunc()).copied()
    }

    pub fn iter(&self) -> impl Iterator<Item = &IdentityInfo> {
        self.by_id.values().map(|(i, _)| i)
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_labels_same_identity_and_refcounted() {
        let mut a = IdentityAllocator::new();
        let l: Labels = [Label::k8s("app", "x")].into_iter().collect();
        let first = a.allocate(&l);
        assert_eq!(first, Allocation::New(FIRST_CLUSTER_IDENTITY));
        assert_eq!(a.allocate(&l), Allocation::Existing(FIRST_CLUSTER_IDENTITY));
        assert!(a.release(first.id()).is_none());
        assert!(a.release(first.id()).is_some());
        assert!(a.get(first.id()).is_none());
    }

    #[test]
    fn reserved_identities_exist_and_are_never_released() {
        let mut a = IdentityAllocator::new();
        assert!(a.get(IDENTITY_HOST).unwrap().labels.has_reserved("host"));
        assert!(a.release(IDENTITY_WORLD).is_none());
        assert!(a.get(IDENTITY_WORLD).is_some());
    }

    #[test]
    fn cidr_identities_are_node_local() {
        let mut a = IdentityAllocator::new();
        let id = a.allocate_cidr("10.0.0.5/8".parse().unwrap()).id();
        assert_eq!(id, LOCAL_IDENTITY_FLAG | 1);
        assert_eq!(a.lookup_cidr(&"10.0.0.0/8".parse().unwrap()), Some(id));
        assert!(a.get(id).unwrap().labels.has_reserved("world-ipv4"));
    }

    #[test]
    fn restore_keeps_the_number_and_allocation_skips_it() {
        let mut a = IdentityAllocator::new();
        let l: Labels = [Label::k8s("app", "x")].into_iter().collect();
        assert_eq!(a.restore(257, &l), Ok(Allocation::New(257)));
        let other: Labels = [Label::k8s("app", "y")].into_iter().collect();
        let third: Labels = [Label::k8s("app", "z")].into_iter().collect();
        assert_eq!(a.allocate(&other).id(), 256);
        assert_eq!(a.allocate(&third).id(), 258);
        assert!(a.restore(257, &other).is_err());
    }
}
