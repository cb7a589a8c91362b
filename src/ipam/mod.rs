//! Node IPAM: hands out pod addresses from the node's pod CIDR (Cilium's `hostScope` allocator,
//! as the second seed's `ipam.NewIPAM` sets it up for one node).
//!
//! A pure library: no I/O. The agent reserves every restored endpoint's address before the first
//! allocation (`restoreOldEndpoints` comes before IPAM serves the CNI plugin), so an address can
//! never be handed out twice across an agent restart.
//!
//! Allocation walks the range round-robin from the last address handed out, so a freed address
//! is reused as late as possible: a new pod does not inherit conntrack entries or peers' caches
//! of a pod that just went away. And never sooner than [`REUSE_DELAY`] after it was freed: the
//! other nodes learn of the old pod's deletion through their own watches, a few milliseconds to
//! seconds later, and until then they map the address to the old pod's identity. A new pod
//! handed the address at once could be admitted under that identity (measured by the cluster
//! test `a_reused_pod_address_is_never_admitted_under_the_old_pods_identity`). When every free
//! address is that fresh, allocation fails with [`IpamError::Cooling`], which the CNI plugin
//! reports as "try again later" (the kubelet retries).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// How long a freed address stays out of use (see the module documentation): longer than the
/// other agents need to see a Pod deletion, short enough that a full range recovers quickly.
pub const REUSE_DELAY: Duration = Duration::from_secs(5);

use ipnet::IpNet;

/// The annotation Cilium reads a node's IPv4 pod CIDR from when `spec.podCIDRs` is empty.
pub const POD_CIDR_ANNOTATION: &str = "io.cilium.network.ipv4-pod-cidr";
/// The name newer Cilium releases write the same annotation under; read when the first is absent.
pub const POD_CIDR_ANNOTATION_ALIAS: &str = "network.cilium.io/ipv4-pod-cidr";
/// The annotation the agent writes the node's host IP under (Cilium's `ipv4-cilium-host`).
pub const HOST_IP_ANNOTATION: &str = "io.cilium.network.ipv4-cilium-host";
/// Cilium's annotations of a node's IPv6 pod CIDR (read when `spec.podCIDRs` has none).
pub const POD_CIDR6_ANNOTATIONS: [&str; 2] = [
    "io.cilium.network.ipv6-pod-cidr",
    "network.cilium.io/ipv6-pod-cidr",
];

/// The address families pods get addresses of (`--enable-ipv4`, `--enable-ipv6`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Families {
    pub ipv4: bool,
    pub ipv6: bool,
}

impl Default for Families {
    /// Cilium's defaults: IPv4 on, IPv6 off.
    fn default() -> Self {
        Families {
            ipv4: true,
            ipv6: false,
        }
    }
}

impl Families {
    /// Whether addresses of `net`'s family are handed out.
    pub fn serves(&self, net: &IpNet) -> bool {
        match net {
            IpNet::V4(_) => self.ipv4,
            IpNet::V6(_) => self.ipv6,
        }
    }
}

/// Where the node's pod CIDR came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CidrSource {
    /// The Node's `spec.podCIDRs`.
    NodeSpec,
    /// The Node's `io.cilium.network.ipv4-pod-cidr` annotation.
    NodeAnnotation,
    /// `--pod-cidr`.
    Flag,
}

/// The node's IPv4 pod CIDR, in the order of Cilium's `ParseNode`: the first IPv4 range of
/// `spec.podCIDRs`, else the annotation. An unparsable value is an error naming the field.
pub fn node_pod_cidr(
    pod_cidrs: &[String],
    annotations: &std::collections::BTreeMap<String, String>,
) -> Result<Option<(IpNet, CidrSource)>, String> {
    node_pod_cidr_of(pod_cidrs, annotations, false)
}

/// The node's pod CIDR of one family (`ipv6`), as `node_pod_cidr`: the first range of that
/// family in `spec.podCIDRs`, else the family's annotations.
pub fn node_pod_cidr_of(
    pod_cidrs: &[String],
    annotations: &std::collections::BTreeMap<String, String>,
    ipv6: bool,
) -> Result<Option<(IpNet, CidrSource)>, String> {
    for (i, c) in pod_cidrs.iter().enumerate() {
        let net: IpNet = c
            .parse()
            .map_err(|_| format!("spec.podCIDRs[{i}]: {c:?} is not a CIDR"))?;
        if matches!(net, IpNet::V6(_)) == ipv6 {
            return Ok(Some((net, CidrSource::NodeSpec)));
        }
    }
    let names = if ipv6 {
        POD_CIDR6_ANNOTATIONS
    } else {
        [POD_CIDR_ANNOTATION, POD_CIDR_ANNOTATION_ALIAS]
    };
    let family = if ipv6 { "IPv6" } else { "IPv4" };
    for name in names {
        if let Some(a) = annotations.get(name) {
            return match a.parse::<IpNet>() {
                Ok(n) if matches!(n, IpNet::V6(_)) == ipv6 => {
                    Ok(Some((n, CidrSource::NodeAnnotation)))
                }
                Ok(_) => Err(format!(
                    "metadata.annotations[{name}]: {a:?} is not an {family} CIDR"
                )),
                Err(_) => Err(format!("metadata.annotations[{name}]: {a:?} is not a CIDR")),
            };
        }
    }
    Ok(None)
}

/// The node's IPAM as the agent holds it: one allocator per address family (none until a CIDR
/// of that family is known), where each range came from, and the families pods get
/// addresses of.
#[derive(Debug, Clone, Default)]
pub struct NodeIpam {
    /// IPv4's.
    pub ipam: Option<Ipam>,
    pub source: Option<CidrSource>,
    /// IPv6's.
    pub ipam6: Option<Ipam>,
    pub source6: Option<CidrSource>,
    pub families: Families,
}

impl NodeIpam {
    /// The pools of `--pod-cidr` (at most one per family, each of an enabled family).
    pub fn from_flags(cidrs: &[IpNet], families: Families) -> Result<NodeIpam, String> {
        let mut n = NodeIpam {
            families,
            ..Default::default()
        };
        for c in cidrs {
            let (pool, source) = n.pool_slot(c.addr());
            if pool.is_some() {
                return Err(format!(
                    "--pod-cidr {c}: a second pod CIDR of its family (one per family)"
                ));
            }
            let ipam = Ipam::served(*c, families).map_err(|e| format!("--pod-cidr: {e}"))?;
            *pool = Some(ipam);
            *source = Some(CidrSource::Flag);
        }
        Ok(n)
    }

    fn pool_slot(&mut self, ip: IpAddr) -> (&mut Option<Ipam>, &mut Option<CidrSource>) {
        match ip {
            IpAddr::V4(_) => (&mut self.ipam, &mut self.source),
            IpAddr::V6(_) => (&mut self.ipam6, &mut self.source6),
        }
    }

    /// The pool of `ip`'s family, if there is one.
    pub fn pool_of(&mut self, ip: IpAddr) -> Option<&mut Ipam> {
        self.pool_slot(ip).0.as_mut()
    }

    /// Every pool there is, IPv4's first.
    pub fn pools(&self) -> impl Iterator<Item = &Ipam> {
        self.ipam.iter().chain(self.ipam6.iter())
    }

    /// `Ipam::reserve` in the pool of `ip`'s family; an address of a family without a pool is
    /// out of range.
    pub fn reserve(&mut self, ip: IpAddr, owner: &str) -> Result<(), IpamError> {
        match self.pool_of(ip) {
            Some(p) => p.reserve(ip, owner),
            None => Err(IpamError::NoPool { ip }),
        }
    }

    /// `Ipam::release` in the pool of `ip`'s family.
    pub fn release(&mut self, ip: IpAddr) -> bool {
        self.pool_of(ip).is_some_and(|p| p.release(ip))
    }

    /// `Ipam::owner` in the pool of `ip`'s family.
    pub fn owner(&mut self, ip: IpAddr) -> Option<String> {
        self.pool_of(ip)
            .and_then(|p| p.owner(ip).map(str::to_string))
    }

    /// The addresses `owner` holds in any pool.
    pub fn owned_by(&self, owner: &str) -> Vec<IpAddr> {
        self.pools().flat_map(|p| p.owned_by(owner)).collect()
    }

    /// One address per enabled family for `owner` (IPv4's first), or none: an address handed
    /// out before a later family fails is given back.
    pub fn allocate(&mut self, owner: &str) -> Result<Vec<IpAddr>, IpamError> {
        let mut out = Vec::new();
        let wanted = [
            (self.families.ipv4, false, "IPv4"),
            (self.families.ipv6, true, "IPv6"),
        ];
        for (on, ipv6, family) in wanted {
            if !on {
                continue;
            }
            let pool = if ipv6 {
                self.ipam6.as_mut()
            } else {
                self.ipam.as_mut()
            };
            let got = match pool {
                Some(p) => p.allocate(owner),
                None => Err(IpamError::NoCidr { family }),
            };
            match got {
                Ok(ip) => out.push(ip),
                Err(e) => {
                    for ip in out {
                        self.release(ip);
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// Serves the pod CIDR the Node object names (`cidr`, from `source`) for its family. The
    /// range in use keeps serving when it is the same (only the source is updated); an unused
    /// range is replaced, the new one reserving `held` (address, owner: the endpoints'
    /// addresses); a range with addresses handed out is never replaced. `Ok(true)`: a range
    /// was adopted.
    pub fn adopt(
        &mut self,
        cidr: IpNet,
        source: CidrSource,
        held: impl IntoIterator<Item = (IpAddr, String)>,
    ) -> Result<bool, String> {
        let families = self.families;
        let (pool, slot_source) = self.pool_slot(cidr.addr());
        if let Some(cur) = pool.as_ref() {
            if cur.cidr() == cidr.trunc() {
                *slot_source = Some(source);
                return Ok(false);
            }
            if cur.used() > 0 {
                return Err(format!(
                    "the Node's pod CIDR {cidr} differs from the range in use ({}, {} allocated); keeping the range in use",
                    cur.cidr(),
                    cur.used()
                ));
            }
        }
        let mut ipam = Ipam::served(cidr, families).map_err(|e| e.to_string())?;
        for (ip, owner) in held {
            let _ = ipam.reserve(ip, &owner);
        }
        *pool = Some(ipam);
        *slot_source = Some(source);
        Ok(true)
    }
}

/// IPAM failures, naming the address or range concerned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IpamError {
    /// The pod CIDR cannot be used (a family the agent does not serve, or too small to hold a
    /// pod).
    #[error("pod CIDR {cidr}: {why}")]
    UnusableCidr { cidr: IpNet, why: &'static str },
    /// Every address of the range is taken.
    #[error("pod CIDR {cidr} is exhausted ({capacity} addresses, all in use)")]
    Exhausted { cidr: IpNet, capacity: u64 },
    /// A reservation outside the node's range.
    #[error("{ip} is outside the pod CIDR {cidr}")]
    OutOfRange { ip: IpAddr, cidr: IpNet },
    /// A reservation of an address someone else holds.
    #[error("{ip} is already allocated to {owner}")]
    InUse { ip: IpAddr, owner: String },
    /// An address of a family this node has no pod CIDR of.
    #[error("{ip}: this node has no pod CIDR of its family")]
    NoPool { ip: IpAddr },
    /// A family pods get addresses of has no pod CIDR yet.
    #[error("this node has no {family} pod CIDR (give --pod-cidr, or the Node spec.podCIDRs)")]
    NoCidr { family: &'static str },
    /// Every free address was freed too recently to be handed out again.
    #[error("pod CIDR {cidr}: the {free} free address(es) were freed less than {}s ago and are not reused yet (other nodes may still map them to the old pods); try again", REUSE_DELAY.as_secs())]
    Cooling { cidr: IpNet, free: u64 },
}

/// The allocator of one pod CIDR, of either address family. Addresses are numbered by their
/// offset from the network address (a `u128`, whatever the family).
#[derive(Debug, Clone)]
pub struct Ipam {
    cidr: IpNet,
    /// First and last usable offsets from the network address.
    first: u128,
    last: u128,
    /// The next offset to try.
    cursor: u128,
    /// Address -> owner (a container id, or `restored:<endpoint>`).
    allocated: BTreeMap<IpAddr, String>,
    /// Addresses freed less than `REUSE_DELAY` ago, and when (pruned as they age).
    freed: BTreeMap<IpAddr, Instant>,
}

/// The usable offsets of a range: IPv4 leaves out the network and broadcast addresses (a /30 or
/// larger range is needed), IPv6 the subnet-router anycast address (offset 0; a /126 or larger).
fn usable_offsets(cidr: IpNet) -> Result<(u128, u128), IpamError> {
    let (bits, most, why) = match cidr {
        IpNet::V4(_) => (32u8, 30u8, "a /30 or larger range is needed"),
        IpNet::V6(_) => (128, 126, "a /126 or larger range is needed"),
    };
    if cidr.prefix_len() > most {
        return Err(IpamError::UnusableCidr { cidr, why });
    }
    let host_bits = u32::from(bits - cidr.prefix_len());
    let top = if host_bits == 128 {
        u128::MAX
    } else {
        (1u128 << host_bits) - 1
    };
    Ok(match cidr {
        IpNet::V4(_) => (1, top - 1),
        IpNet::V6(_) => (1, top),
    })
}

fn to_number(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

impl Ipam {
    /// An allocator over `cidr` (either family; see `usable_offsets` for what is never handed
    /// out). A CIDR with host bits set is truncated to its network.
    pub fn new(cidr: IpNet) -> Result<Ipam, IpamError> {
        let (first, last) = usable_offsets(cidr)?;
        Ok(Ipam {
            cidr: cidr.trunc(),
            first,
            last,
            cursor: first,
            allocated: BTreeMap::new(),
            freed: BTreeMap::new(),
        })
    }

    /// An allocator over a pod CIDR the agent serves: of a family pods get addresses of.
    pub fn served(cidr: IpNet, families: Families) -> Result<Ipam, IpamError> {
        if !families.serves(&cidr) {
            return Err(IpamError::UnusableCidr {
                cidr,
                why: match cidr {
                    IpNet::V4(_) => "IPv4 is not enabled (--enable-ipv4)",
                    IpNet::V6(_) => "IPv6 is not enabled (--enable-ipv6)",
                },
            });
        }
        Ipam::new(cidr)
    }

    /// The range served.
    pub fn cidr(&self) -> IpNet {
        self.cidr
    }

    /// The range served, if it is IPv4's.
    pub fn cidr_v4(&self) -> Option<ipnet::Ipv4Net> {
        match self.cidr {
            IpNet::V4(n) => Some(n),
            IpNet::V6(_) => None,
        }
    }

    /// How many addresses can be handed out in all (an IPv6 range's count saturates at
    /// `u64::MAX`).
    pub fn capacity(&self) -> u64 {
        u64::try_from(self.last - self.first).map_or(u64::MAX, |n| n.saturating_add(1))
    }

    /// How many are in use.
    pub fn used(&self) -> usize {
        self.allocated.len()
    }

    fn addr(&self, offset: u128) -> IpAddr {
        match self.cidr {
            IpNet::V4(n) => IpAddr::V4((u32::from(n.network()) + offset as u32).into()),
            IpNet::V6(n) => IpAddr::V6((u128::from(n.network()) + offset).into()),
        }
    }

    /// Hands out a free address to `owner`.
    pub fn allocate(&mut self, owner: &str) -> Result<IpAddr, IpamError> {
        self.allocate_at(owner, Instant::now())
    }

    /// `allocate` at time `now`: addresses freed less than `REUSE_DELAY` before are skipped.
    /// The walk ends at the first address neither allocated nor cooling, so it takes at most
    /// as many steps as there are such addresses, plus one.
    pub fn allocate_at(&mut self, owner: &str, now: Instant) -> Result<IpAddr, IpamError> {
        self.freed
            .retain(|_, at| now.saturating_duration_since(*at) < REUSE_DELAY);
        let capacity = self.capacity();
        if self.allocated.len() as u64 >= capacity {
            return Err(IpamError::Exhausted {
                cidr: self.cidr,
                capacity,
            });
        }
        let mut offset = self.cursor;
        for _ in 0..capacity {
            if offset > self.last || offset < self.first {
                offset = self.first;
            }
            let ip = self.addr(offset);
            offset += 1;
            if self.freed.contains_key(&ip) {
                continue;
            }
            if let std::collections::btree_map::Entry::Vacant(slot) = self.allocated.entry(ip) {
                slot.insert(owner.to_string());
                self.cursor = offset;
                return Ok(ip);
            }
        }
        Err(IpamError::Cooling {
            cidr: self.cidr,
            free: capacity - self.allocated.len() as u64,
        })
    }

    /// Marks `ip` as held by `owner` (restore). Reserving an address again for the same owner
    /// is not an error. Addresses outside the range are refused: the caller keeps the endpoint
    /// but knows this node's IPAM does not manage that address.
    pub fn reserve(&mut self, ip: IpAddr, owner: &str) -> Result<(), IpamError> {
        if !self.contains(ip) {
            return Err(IpamError::OutOfRange {
                ip,
                cidr: self.cidr,
            });
        }
        match self.allocated.get(&ip) {
            Some(o) if o != owner => Err(IpamError::InUse {
                ip,
                owner: o.clone(),
            }),
            _ => {
                self.allocated.insert(ip, owner.to_string());
                Ok(())
            }
        }
    }

    /// Frees `ip`; returns whether it was allocated. It is not handed out again for
    /// `REUSE_DELAY`.
    pub fn release(&mut self, ip: IpAddr) -> bool {
        self.release_at(ip, Instant::now())
    }

    pub fn release_at(&mut self, ip: IpAddr, now: Instant) -> bool {
        let was = self.allocated.remove(&ip).is_some();
        if was {
            self.freed.insert(ip, now);
        }
        was
    }

    /// The owner of `ip`, if allocated.
    pub fn owner(&self, ip: IpAddr) -> Option<&str> {
        self.allocated.get(&ip).map(String::as_str)
    }

    /// The addresses held by `owner`.
    pub fn owned_by(&self, owner: &str) -> Vec<IpAddr> {
        self.allocated
            .iter()
            .filter(|(_, o)| o.as_str() == owner)
            .map(|(ip, _)| *ip)
            .collect()
    }

    /// Whether `ip` is a usable address of the range (of its family).
    pub fn contains(&self, ip: IpAddr) -> bool {
        if !self.cidr.contains(&ip) {
            return false;
        }
        let offset = to_number(ip) - to_number(self.cidr.network());
        offset >= self.first && offset <= self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn node_cidr_comes_from_the_spec_then_the_annotation() {
        let ann = |v: &str| {
            [(POD_CIDR_ANNOTATION.to_string(), v.to_string())]
                .into_iter()
                .collect::<std::collections::BTreeMap<_, _>>()
        };
        let none = std::collections::BTreeMap::new();
        assert_eq!(
            node_pod_cidr(
                &["fd00::/64".into(), "10.1.0.0/24".into()],
                &ann("10.9.0.0/24")
            ),
            Ok(Some(("10.1.0.0/24".parse().unwrap(), CidrSource::NodeSpec))),
            "the first IPv4 range of the spec wins"
        );
        assert_eq!(
            node_pod_cidr(&["fd00::/64".into()], &ann("10.9.0.0/24")),
            Ok(Some((
                "10.9.0.0/24".parse().unwrap(),
                CidrSource::NodeAnnotation
            )))
        );
        assert_eq!(node_pod_cidr(&[], &none), Ok(None));
        let alias = [(
            POD_CIDR_ANNOTATION_ALIAS.to_string(),
            "10.8.0.0/24".to_string(),
        )]
        .into_iter()
        .collect();
        assert_eq!(
            node_pod_cidr(&[], &alias),
            Ok(Some((
                "10.8.0.0/24".parse().unwrap(),
                CidrSource::NodeAnnotation
            )))
        );
        let e = node_pod_cidr(&["10.1.0.0/33".into()], &none).unwrap_err();
        assert!(e.contains("spec.podCIDRs[0]"), "{e}");
        let e = node_pod_cidr(&[], &ann("nope")).unwrap_err();
        assert!(e.contains(POD_CIDR_ANNOTATION), "{e}");
    }

    #[test]
    fn a_node_cidr_is_adopted_kept_or_refused_when_in_use() {
        let mut n = NodeIpam::default();
        let a: IpNet = "10.7.0.0/24".parse().unwrap();
        let held = [("10.7.0.9".parse().unwrap(), "restored:1".to_string())];
        assert_eq!(n.adopt(a, CidrSource::NodeSpec, held.clone()), Ok(true));
        assert_eq!(
            n.ipam.as_ref().unwrap().owner("10.7.0.9".parse().unwrap()),
            Some("restored:1"),
            "endpoints' addresses stay theirs"
        );
        // The same range again: kept (the source may change).
        assert_eq!(n.adopt(a, CidrSource::NodeAnnotation, []), Ok(false));
        assert_eq!(n.source, Some(CidrSource::NodeAnnotation));
        // Another range while addresses are handed out: refused, the range in use stays.
        let b: IpNet = "10.8.0.0/24".parse().unwrap();
        let e = n.adopt(b, CidrSource::NodeSpec, []).unwrap_err();
        assert!(
            e.contains("10.8.0.0/24") && e.contains("10.7.0.0/24"),
            "{e}"
        );
        assert_eq!(
            n.ipam.as_ref().unwrap().cidr(),
            "10.7.0.0/24".parse::<IpNet>().unwrap()
        );
        // An unused range is replaced; an unusable one is an error.
        let mut m = NodeIpam::default();
        assert_eq!(m.adopt(a, CidrSource::Flag, []), Ok(true));
        assert_eq!(m.adopt(b, CidrSource::NodeSpec, []), Ok(true));
        assert!(m
            .adopt("fd00::/64".parse().unwrap(), CidrSource::NodeSpec, [])
            .is_err());
    }

    #[test]
    fn a_dual_stack_node_hands_out_one_address_per_family_or_none() {
        let both = Families {
            ipv4: true,
            ipv6: true,
        };
        let cidrs: Vec<IpNet> = vec![
            "10.9.0.0/30".parse().unwrap(),
            "fd00:9::/126".parse().unwrap(),
        ];
        let mut n = NodeIpam::from_flags(&cidrs, both).unwrap();
        let got = n.allocate("c1").unwrap();
        assert_eq!(
            got,
            vec![
                "10.9.0.1".parse::<IpAddr>().unwrap(),
                "fd00:9::1".parse().unwrap()
            ]
        );
        assert_eq!(n.owned_by("c1"), got);
        assert_eq!(n.owner(got[1]).as_deref(), Some("c1"));
        // The IPv4 range (2 addresses) outlasts the IPv6 one (3): no half allocation.
        n.allocate("c2").unwrap();
        assert!(matches!(n.allocate("c3"), Err(IpamError::Exhausted { .. })));
        assert_eq!(n.owned_by("c3"), Vec::<IpAddr>::new());
        let mut short6 = NodeIpam::from_flags(
            &[
                "10.9.0.0/29".parse().unwrap(),
                "fd00:9::/126".parse().unwrap(),
            ],
            both,
        )
        .unwrap();
        for c in ["a", "b", "c"] {
            short6.allocate(c).unwrap();
        }
        assert!(short6.allocate("d").is_err());
        assert!(
            short6.owned_by("d").is_empty(),
            "the IPv4 address handed out before the IPv6 pool failed is given back"
        );
        assert_eq!(short6.ipam.as_ref().unwrap().used(), 3);
        // A family without its range fails the allocation, naming the family.
        let mut v4_only_range = NodeIpam::from_flags(&cidrs[..1], both).unwrap();
        let e = v4_only_range.allocate("x").unwrap_err();
        assert!(e.to_string().contains("no IPv6 pod CIDR"), "{e}");
        assert_eq!(v4_only_range.ipam.as_ref().unwrap().used(), 0);
        // Flags: one range per family, each of an enabled family.
        let e =
            NodeIpam::from_flags(&[cidrs[0], "10.8.0.0/24".parse().unwrap()], both).unwrap_err();
        assert!(e.contains("one per family"), "{e}");
        let e = NodeIpam::from_flags(&cidrs, Families::default()).unwrap_err();
        assert!(e.contains("--enable-ipv6"), "{e}");
        // The Node's IPv6 range is adopted into the IPv6 pool; release by family.
        let mut k = NodeIpam {
            families: both,
            ..Default::default()
        };
        let node_cidrs = ["10.7.0.0/24".to_string(), "fd00:7::/112".to_string()];
        let (c6, src) = node_pod_cidr_of(&node_cidrs, &Default::default(), true)
            .unwrap()
            .unwrap();
        assert_eq!(
            (c6.to_string().as_str(), src),
            ("fd00:7::/112", CidrSource::NodeSpec)
        );
        let held = [("fd00:7::9".parse().unwrap(), "restored:1".to_string())];
        assert_eq!(k.adopt(c6, src, held), Ok(true));
        assert!(k.ipam.is_none());
        assert_eq!(
            k.owner("fd00:7::9".parse().unwrap()).as_deref(),
            Some("restored:1")
        );
        assert!(k.release("fd00:7::9".parse().unwrap()));
        assert!(matches!(
            k.reserve("10.7.0.3".parse().unwrap(), "x"),
            Err(IpamError::NoPool { .. })
        ));
        let ann = [(
            POD_CIDR6_ANNOTATIONS[0].to_string(),
            "fd00:8::/112".to_string(),
        )]
        .into_iter()
        .collect();
        assert_eq!(
            node_pod_cidr_of(&node_cidrs[..1], &ann, true),
            Ok(Some((
                "fd00:8::/112".parse().unwrap(),
                CidrSource::NodeAnnotation
            )))
        );
        // An annotation of the other family is refused, naming it.
        let wrong = [(
            POD_CIDR6_ANNOTATIONS[0].to_string(),
            "10.8.0.0/24".to_string(),
        )]
        .into_iter()
        .collect();
        let e = node_pod_cidr_of(&[], &wrong, true).unwrap_err();
        assert!(
            e.contains("ipv6-pod-cidr") && e.contains("not an IPv6 CIDR"),
            "{e}"
        );
    }

    fn ipam(cidr: &str) -> Ipam {
        Ipam::new(cidr.parse().unwrap()).unwrap()
    }

    #[test]
    fn hands_out_every_host_address_once_then_reports_exhaustion() {
        let mut i = ipam("10.9.0.0/29");
        assert_eq!(i.capacity(), 6);
        let got: Vec<IpAddr> = (0..6)
            .map(|n| i.allocate(&format!("c{n}")).unwrap())
            .collect();
        let want: Vec<IpAddr> = (1..=6).map(|h| Ipv4Addr::new(10, 9, 0, h).into()).collect();
        assert_eq!(
            got, want,
            "network .0 and broadcast .7 are never handed out"
        );
        assert_eq!(
            i.allocate("c7"),
            Err(IpamError::Exhausted {
                cidr: "10.9.0.0/29".parse().unwrap(),
                capacity: 6
            })
        );
    }

    #[test]
    fn freed_addresses_are_reused_last_and_never_within_the_reuse_delay() {
        let t0 = Instant::now();
        let mut i = ipam("10.9.0.0/29");
        let a = i.allocate_at("a", t0).unwrap();
        let b = i.allocate_at("b", t0).unwrap();
        assert!(i.release_at(a, t0));
        assert!(!i.release_at(a, t0), "a second release is a no-op");
        let c = i.allocate_at("c", t0).unwrap();
        assert_ne!(
            c, a,
            "round robin: the freed address is not the next one out"
        );
        assert_ne!(c, b);
        for n in 0..3 {
            i.allocate_at(&format!("x{n}"), t0).unwrap();
        }
        // Only the freed one is left: not while other nodes may still map it to the old pod.
        let soon = t0 + REUSE_DELAY - Duration::from_millis(1);
        assert_eq!(
            i.allocate_at("early", soon),
            Err(IpamError::Cooling {
                cidr: "10.9.0.0/29".parse().unwrap(),
                free: 1
            })
        );
        // Then it is found by wrapping around.
        assert_eq!(i.allocate_at("last", t0 + REUSE_DELAY).unwrap(), a);
    }

    #[test]
    fn reservations_survive_and_block_allocation() {
        let mut i = ipam("10.9.0.0/30");
        i.reserve("10.9.0.1".parse().unwrap(), "restored:1")
            .unwrap();
        i.reserve("10.9.0.1".parse().unwrap(), "restored:1")
            .expect("same owner again is fine");
        assert_eq!(
            i.reserve("10.9.0.1".parse().unwrap(), "other"),
            Err(IpamError::InUse {
                ip: "10.9.0.1".parse().unwrap(),
                owner: "restored:1".into()
            })
        );
        assert_eq!(
            i.allocate("new").unwrap(),
            IpAddr::from(Ipv4Addr::new(10, 9, 0, 2))
        );
        assert!(i.allocate("more").is_err());
        assert_eq!(i.owner("10.9.0.2".parse().unwrap()), Some("new"));
    }

    #[test]
    fn refuses_addresses_outside_the_range_and_unusable_ranges() {
        let mut i = ipam("10.9.0.0/24");
        for bad in ["10.9.1.1", "10.9.0.0", "10.9.0.255", "fd00::1"] {
            assert!(
                matches!(
                    i.reserve(bad.parse().unwrap(), "x"),
                    Err(IpamError::OutOfRange { .. })
                ),
                "{bad}"
            );
        }
        let e = Ipam::served("fd00::/64".parse().unwrap(), Families::default()).unwrap_err();
        assert!(e.to_string().contains("--enable-ipv6"), "{e}");
        assert!(Ipam::new("10.0.0.0/31".parse().unwrap()).is_err());
        // A CIDR with host bits set is truncated to its network.
        assert_eq!(ipam("10.9.0.77/24").cidr().to_string(), "10.9.0.0/24");
    }

    #[test]
    fn an_ipv6_range_leaves_out_only_its_subnet_router_address() {
        let mut i = ipam("fd00:10:244:1::/125");
        assert_eq!(i.capacity(), 7);
        let got: Vec<String> = (0..7)
            .map(|n| i.allocate(&format!("c{n}")).unwrap().to_string())
            .collect();
        let want: Vec<String> = (1..=7).map(|h| format!("fd00:10:244:1::{h}")).collect();
        assert_eq!(got, want, "::0 is the subnet-router anycast address");
        assert!(matches!(
            i.allocate("more"),
            Err(IpamError::Exhausted { capacity: 7, .. })
        ));
        let a: IpAddr = "fd00:10:244:1::3".parse().unwrap();
        assert_eq!(i.owner(a), Some("c2"));
        assert!(i.release(a));
        for bad in ["fd00:10:244:1::", "fd00:10:244:2::1", "10.9.0.1"] {
            assert!(
                matches!(
                    i.reserve(bad.parse().unwrap(), "x"),
                    Err(IpamError::OutOfRange { .. })
                ),
                "{bad}"
            );
        }
        // A /64 counts more addresses than a u64 holds less one: saturated, still served.
        let mut big = ipam("fd00:10:244:2::/64");
        assert_eq!(big.capacity(), u64::MAX);
        assert_eq!(
            big.allocate("a").unwrap(),
            "fd00:10:244:2::1".parse::<IpAddr>().unwrap()
        );
        assert!(Ipam::new("fd00::/127".parse().unwrap()).is_err());
        // The walk over cooling addresses stops at the first free one, whatever the range's size.
        let t0 = Instant::now();
        let mut w = ipam("fd00:10:244:3::/64");
        let first = w.allocate_at("a", t0).unwrap();
        assert!(w.release_at(first, t0));
        assert_eq!(
            w.allocate_at("b", t0).unwrap(),
            "fd00:10:244:3::2".parse::<IpAddr>().unwrap()
        );
    }
}
