//! Who holds each pod, endpoint and node address, and so which identity the ipcache maps it
//! to. Several sources may name one address at once: this node's endpoints and Pods, another
//! node's `CiliateEndpointSlice` (or, with `--watch-pods`, another node's Pods), the Node
//! objects. As Cilium ranks ipcache sources (`pkg/source`: local endpoints above what other
//! nodes publish), the highest [`Rank`] holds the address; among claims of one rank the newest
//! holds it (address reuse: the pod that got the address last). When the holder lets go, the
//! next claim takes over, so that a pod that goes never takes its address away from the pod
//! that now has it.
//!
//! Trust: what this node's kubelet and CNI say of this node's pods (`LocalPod`) and what the
//! API server says of nodes (`Node`) outrank anything another node publishes (`RemotePod`).
//! Another node can never move an address of this node's pods or of any node, whatever it
//! writes. Pure: `ClusterIndex` applies what a claim changes to the policy engine.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use crate::policy::identity::NumericIdentity;

/// Why `ip` can never be a pod's address (nor a Service backend's), or `None` when it can be.
pub fn not_a_pod_address(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(a) => {
            if a.is_unspecified() {
                Some("unspecified")
            } else if a.is_loopback() {
                Some("loopback")
            } else if a.is_broadcast() {
                Some("broadcast")
            } else if a.is_multicast() {
                Some("multicast")
            } else if a.is_link_local() {
                Some("link-local")
            } else {
                None
            }
        }
        IpAddr::V6(a) => {
            if let Some(v4) = a.to_ipv4_mapped() {
                return not_a_pod_address(IpAddr::V4(v4));
            }
            if a.is_unspecified() {
                Some("unspecified")
            } else if a.is_loopback() {
                Some("loopback")
            } else if a.is_multicast() {
                Some("multicast")
            } else if a.segments()[0] & 0xffc0 == 0xfe80 {
                Some("link-local")
            } else {
                None
            }
        }
    }
}

/// How much a source of an address is trusted; higher wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rank {
    /// A pod of another node, as that node (its slice) or the API server says.
    RemotePod,
    /// A pod or endpoint of this node.
    LocalPod,
    /// A Node's address (`host` or `remote-node`): never a pod's.
    Node,
}

/// Who claims an address.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Holder {
    /// A pod, by `namespace/name`.
    Pod(Arc<str>),
    /// A local endpoint, by its pod's `namespace/name`.
    Endpoint(Arc<str>),
    /// A node, by name.
    Node(Arc<str>),
    /// This node's native devices, as the kernel lists their addresses (`network::devices`).
    Devices,
}

impl Holder {
    /// The pod behind the holder (`namespace/name`), if it is one.
    pub fn pod(&self) -> Option<&str> {
        match self {
            Holder::Pod(k) | Holder::Endpoint(k) => Some(k),
            Holder::Node(_) | Holder::Devices => None,
        }
    }
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holder::Pod(k) => write!(f, "pod {k}"),
            Holder::Endpoint(k) => write!(f, "endpoint of pod {k}"),
            Holder::Node(n) => write!(f, "node {n}"),
            Holder::Devices => write!(f, "this node's devices"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    pub rank: Rank,
    pub holder: Holder,
    pub identity: NumericIdentity,
}

/// The claims on one address, oldest first. Nearly every address has one.
#[derive(Debug)]
enum Claims {
    One(Claim),
    Many(Vec<Claim>),
}

impl Claims {
    fn as_slice(&self) -> &[Claim] {
        match self {
            Claims::One(c) => std::slice::from_ref(c),
            Claims::Many(v) => v,
        }
    }

    /// The claim in force: the highest rank, the newest among equals.
    fn effective(&self) -> &Claim {
        let s = self.as_slice();
        let (mut best, mut i) = (&s[0], 1);
        while i < s.len() {
            if s[i].rank >= best.rank {
                best = &s[i];
            }
            i += 1;
        }
        best
    }
}

/// What a claim or a release did to the address: who held it and with which identity, before
/// and after. The ipcache changes when the two differ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Effect {
    pub before: Option<Claim>,
    pub after: Option<Claim>,
}

impl Effect {
    pub fn changed(&self) -> bool {
        self.before != self.after
    }

    /// Whether `holder`'s claim is the one in force afterwards.
    pub fn held_by(&self, holder: &Holder) -> bool {
        self.after.as_ref().is_some_and(|c| &c.holder == holder)
    }
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct AddressBook {
    by_ip: HashMap<IpAddr, Claims>,
}

impl AddressBook {
    /// The claim in force for `ip`.
    pub fn holder(&self, ip: IpAddr) -> Option<&Claim> {
        self.by_ip.get(&ip).map(Claims::effective)
    }

    /// Every claim on `ip`, oldest first.
    pub fn claims(&self, ip: IpAddr) -> &[Claim] {
        self.by_ip.get(&ip).map_or(&[], Claims::as_slice)
    }

    pub fn len(&self) -> usize {
        self.by_ip.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_ip.is_empty()
    }

    /// `claim.holder` claims `ip` (again: its earlier claim is replaced, and this one is the
    /// newest).
    pub fn claim(&mut self, ip: IpAddr, claim: Claim) -> Effect {
        let before = self.holder(ip).cloned();
        match self.by_ip.get_mut(&ip) {
            None => {
                self.by_ip.insert(ip, Claims::One(claim));
            }
            Some(slot) => {
                let mut v = match std::mem::replace(slot, Claims::Many(Vec::new())) {
                    Claims::One(c) => vec![c],
                    Claims::Many(v) => v,
                };
                v.retain(|c| c.holder != claim.holder);
                v.push(claim);
                *slot = if v.len() == 1 {
                    Claims::One(v.pop().expect("one claim"))
                } else {
                    Claims::Many(v)
                };
            }
        }
        let after = self.holder(ip).cloned();
        Effect { before, after }
    }

    /// `holder` lets go of `ip` (nothing when it held no claim).
    pub fn release(&mut self, ip: IpAddr, holder: &Holder) -> Effect {
        let before = self.holder(ip).cloned();
        let Some(slot) = self.by_ip.get_mut(&ip) else {
            return Effect {
                before,
                after: None,
            };
        };
        match slot {
            Claims::One(c) if &c.holder == holder => {
                self.by_ip.remove(&ip);
            }
            Claims::One(_) => {}
            Claims::Many(v) => {
                v.retain(|c| &c.holder != holder);
                if v.len() == 1 {
                    *slot = Claims::One(v.pop().expect("one claim"));
                }
            }
        }
        let after = self.holder(ip).cloned();
        Effect { before, after }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }
    fn pod(k: &str) -> Holder {
        Holder::Pod(Arc::from(k))
    }
    fn claim(rank: Rank, holder: Holder, identity: NumericIdentity) -> Claim {
        Claim {
            rank,
            holder,
            identity,
        }
    }

    #[test]
    fn special_addresses_are_never_pod_addresses() {
        for (a, why) in [
            ("0.0.0.0", "unspecified"),
            ("127.0.0.1", "loopback"),
            ("127.9.9.9", "loopback"),
            ("255.255.255.255", "broadcast"),
            ("224.0.0.1", "multicast"),
            ("169.254.169.254", "link-local"),
            ("::", "unspecified"),
            ("::1", "loopback"),
            ("ff02::1", "multicast"),
            ("fe80::1", "link-local"),
            ("::ffff:127.0.0.1", "loopback"),
        ] {
            assert_eq!(not_a_pod_address(ip(a)), Some(why), "{a}");
        }
        for a in ["10.0.0.1", "192.168.1.255", "fd00::1", "2001:db8::1"] {
            assert_eq!(not_a_pod_address(ip(a)), None, "{a}");
        }
    }

    #[test]
    fn a_local_pod_outranks_a_remote_claim_whatever_the_order() {
        let mut b = AddressBook::default();
        let a = ip("10.0.1.5");
        let e = b.claim(a, claim(Rank::LocalPod, pod("x/a"), 100));
        assert!(e.changed() && e.held_by(&pod("x/a")));
        // Another node claims it afterwards: nothing changes.
        let e = b.claim(a, claim(Rank::RemotePod, pod("x/evil"), 200));
        assert!(!e.changed());
        assert_eq!(b.holder(a).unwrap().identity, 100);
        // The remote claim first, then the local pod: the local pod takes it.
        let mut b2 = AddressBook::default();
        b2.claim(a, claim(Rank::RemotePod, pod("x/evil"), 200));
        let e = b2.claim(a, claim(Rank::LocalPod, pod("x/a"), 100));
        assert!(e.changed() && e.held_by(&pod("x/a")));
        // The remote claim renewed: still outranked.
        assert!(!b2
            .claim(a, claim(Rank::RemotePod, pod("x/evil"), 201))
            .changed());
        assert_eq!(b2.holder(a).unwrap().identity, 100);
    }

    #[test]
    fn node_addresses_outrank_every_pod() {
        let mut b = AddressBook::default();
        let a = ip("172.20.0.11");
        b.claim(a, claim(Rank::Node, Holder::Node(Arc::from("n1")), 1));
        for r in [Rank::RemotePod, Rank::LocalPod] {
            assert!(!b.claim(a, claim(r, pod("x/p"), 300)).changed());
        }
        assert_eq!(b.holder(a).unwrap().identity, 1);
    }

    #[test]
    fn among_equals_the_newest_holds_and_a_leaver_takes_only_its_own_claim() {
        let mut b = AddressBook::default();
        let a = ip("10.0.1.7");
        b.claim(a, claim(Rank::LocalPod, pod("x/old"), 100));
        // Address reuse: the new pod's claim arrives before the old pod's delete.
        let e = b.claim(a, claim(Rank::LocalPod, pod("x/new"), 101));
        assert!(e.held_by(&pod("x/new")));
        let e = b.release(a, &pod("x/old"));
        assert!(
            !e.changed(),
            "the old pod's delete leaves the address to the new one"
        );
        assert_eq!(b.holder(a).unwrap().identity, 101);
        // The holder goes: the next claim takes over; the last one empties the slot.
        b.claim(a, claim(Rank::RemotePod, pod("y/r"), 7));
        let e = b.release(a, &pod("x/new"));
        assert!(e.held_by(&pod("y/r")));
        let e = b.release(a, &pod("y/r"));
        assert_eq!(e.after, None);
        assert!(b.is_empty());
        // Releasing what one never claimed changes nothing.
        assert!(!b.release(a, &pod("z/z")).changed());
    }
}
