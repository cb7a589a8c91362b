//! Security identities: reserved ones, one per distinct label set, and node-local CIDR identities.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use ipnet::IpNet;

use super::labels::{Label, Labels, SOURCE_CIDR};

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
}

impl Default for IdentityAllocator {
    fn default() -> Self {
        Self::new()
    }
}

impl IdentityAllocator {
    pub fn new() -> Self {
        let mut a = IdentityAllocator {
            by_id: HashMap::new(),
            by_labels: HashMap::new(),
            by_cidr: HashMap::new(),
            next_cluster: FIRST_CLUSTER_IDENTITY,
            next_local: 1,
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

    /// The identity for a label set, created on first use.
    pub fn allocate(&mut self, labels: &Labels) -> Allocation {
        if let Some(id) = self.by_labels.get(labels).copied() {
            self.retain(id);
            return Allocation::Existing(id);
        }
        // Skip numbers restored endpoints hold, so restores do not renumber everything else.
        while self.by_id.contains_key(&self.next_cluster) {
            self.next_cluster += 1;
        }
        let id = self.next_cluster;
        self.next_cluster += 1;
        let labels = Arc::new(labels.clone());
        self.by_labels.insert(labels.clone(), id);
        let info = IdentityInfo {
            id,
            labels,
            cidr: None,
        };
        self.by_id.insert(id, (info, 1));
        Allocation::New(id)
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
        let id = LOCAL_IDENTITY_FLAG | self.next_local;
        self.next_local += 1;
        self.by_cidr.insert(prefix, id);
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
