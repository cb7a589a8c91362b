//! The datapath's encodings, pure and testable without root: engine flags and entries as the
//! ABI's records (`bpf/ciliate.h`), probe masks, ipcache keys, and the pin names of endpoints.

use std::net::IpAddr;

use ipnet::IpNet;

use super::{
    types, EP_AUDIT, EP_DNS_PROXY, EP_DROP_ALL, EP_EGRESS_DEFAULT_DENY, EP_INGRESS_DEFAULT_DENY,
    EP_SPLIT_LENS, LENS_ALL_PROTOCOLS,
};
use crate::datapath::abi::{EntryTable, PolicyEntryKey};
use crate::datapath::{EndpointFlags, EndpointId};
use crate::policy::identity::NumericIdentity;

pub(super) fn flags_bits(f: EndpointFlags) -> u32 {
    (if f.ingress_default_deny {
        EP_INGRESS_DEFAULT_DENY
    } else {
        0
    }) | (if f.egress_default_deny {
        EP_EGRESS_DEFAULT_DENY
    } else {
        0
    }) | (if f.drop_all { EP_DROP_ALL } else { 0 })
        | (if f.audit { EP_AUDIT } else { 0 })
        | (if f.dns_proxy { EP_DNS_PROXY } else { 0 })
}

/// The flags and isolation cookies an endpoint record holds.
pub(super) fn flags_of_info(info: &types::endpoint_info) -> EndpointFlags {
    EndpointFlags {
        ingress_default_deny: info.flags & EP_INGRESS_DEFAULT_DENY != 0,
        egress_default_deny: info.flags & EP_EGRESS_DEFAULT_DENY != 0,
        drop_all: info.flags & EP_DROP_ALL != 0,
        ingress_cookie: info.ingress_cookie,
        egress_cookie: info.egress_cookie,
        audit: info.flags & EP_AUDIT != 0,
        dns_proxy: info.flags & EP_DNS_PROXY != 0,
    }
}

/// What the program must probe for an endpoint's entries (`CILIATE_LENS_*` bits): for entries
/// with a specific peer identity, and for entries with any peer (identity 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct ProbeMasks {
    pub(super) identity: u32,
    pub(super) any_identity: u32,
}

impl ProbeMasks {
    pub(super) fn of(table: &EntryTable) -> ProbeMasks {
        let mut m = ProbeMasks::default();
        for (k, _) in table.entries() {
            let bit = if k.protocol == 0 {
                LENS_ALL_PROTOCOLS
            } else {
                1u32 << k.port_prefix_len
            };
            if k.identity == 0 {
                m.any_identity |= bit;
            } else {
                m.identity |= bit;
            }
        }
        m
    }

    /// What an endpoint record holds; a record of an older agent (no split) stands for
    /// everything it could probe.
    pub(super) fn of_info(info: &types::endpoint_info) -> ProbeMasks {
        if info.flags & EP_SPLIT_LENS != 0 {
            ProbeMasks {
                identity: info.port_prefix_lens,
                any_identity: info.any_identity_lens,
            }
        } else {
            let all = info.port_prefix_lens | LENS_ALL_PROTOCOLS;
            ProbeMasks {
                identity: all,
                any_identity: all,
            }
        }
    }

    pub(super) fn union(self, o: ProbeMasks) -> ProbeMasks {
        ProbeMasks {
            identity: self.identity | o.identity,
            any_identity: self.any_identity | o.any_identity,
        }
    }

    pub(super) fn info(self, identity: NumericIdentity, flags: u32) -> types::endpoint_info {
        types::endpoint_info {
            identity,
            flags: flags | EP_SPLIT_LENS,
            port_prefix_lens: self.identity,
            any_identity_lens: self.any_identity,
            ..Default::default()
        }
    }

    /// [`ProbeMasks::info`] with the endpoint's isolation cookies (default-deny attribution).
    pub(super) fn info_for(
        self,
        identity: NumericIdentity,
        flags: EndpointFlags,
    ) -> types::endpoint_info {
        types::endpoint_info {
            ingress_cookie: flags.ingress_cookie,
            egress_cookie: flags.egress_cookie,
            ..self.info(identity, flags_bits(flags))
        }
    }
}

pub(super) fn abi_key(k: &PolicyEntryKey) -> types::policy_key {
    types::policy_key {
        identity: k.identity,
        egress: k.egress as u8,
        protocol: k.protocol,
        port: k.port,
        port_prefix_len: k.port_prefix_len,
        pad: [0; 3],
    }
}

/// The host-table key of a host prefix (/32 or /128), `None` for shorter prefixes.
pub(super) fn ipcache_host_key(prefix: &IpNet) -> Option<types::ipcache_host_key> {
    if prefix.prefix_len() != prefix.max_prefix_len() {
        return None;
    }
    let (family, addr) = family_and_addr(prefix.addr());
    Some(types::ipcache_host_key { family, addr })
}

/// The ABI's address encoding: family 4 or 6, the address left-aligned in 16 bytes.
pub(super) fn family_and_addr(ip: IpAddr) -> (u32, [u8; 16]) {
    let mut addr = [0u8; 16];
    match ip {
        IpAddr::V4(a) => {
            addr[..4].copy_from_slice(&a.octets());
            (4, addr)
        }
        IpAddr::V6(a) => (6, a.octets()),
    }
}

pub(super) fn ip_of(family: u32, addr: &[u8; 16]) -> IpAddr {
    if family == 4 {
        IpAddr::from([addr[0], addr[1], addr[2], addr[3]])
    } else {
        IpAddr::from(*addr)
    }
}

pub(super) fn ipcache_key(prefix: &IpNet) -> types::ipcache_key {
    let (family, addr) = family_and_addr(prefix.network());
    types::ipcache_key {
        prefixlen: 32 + prefix.prefix_len() as u32,
        family,
        addr,
    }
}

/// The endpoint a pin belongs to: `policy_<id>`, `link_<id>_ingress`, `link_<id>_egress`.
pub(super) fn pinned_endpoint_id(name: &str) -> Option<EndpointId> {
    let id = name.strip_prefix("policy_").or_else(|| {
        name.strip_prefix("link_")?
            .strip_suffix("_ingress")
            .or_else(|| name.strip_prefix("link_")?.strip_suffix("_egress"))
    })?;
    id.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_and_probe_masks_encode_as_the_program_reads_them() {
        let f = EndpointFlags {
            ingress_default_deny: true,
            egress_default_deny: false,
            drop_all: true,
            ..Default::default()
        };
        assert_eq!(flags_bits(f), EP_INGRESS_DEFAULT_DENY | EP_DROP_ALL);
        let m = ProbeMasks {
            identity: 1 << 16,
            any_identity: LENS_ALL_PROTOCOLS,
        };
        let info = m.info(300, flags_bits(f));
        assert_eq!(
            info.flags & EP_SPLIT_LENS,
            EP_SPLIT_LENS,
            "this version splits"
        );
        assert_eq!(
            ProbeMasks::of_info(&info),
            m,
            "a record reads back as written"
        );
        // A record of an older agent (no split): every class is probed with its one mask.
        let old = types::endpoint_info {
            identity: 300,
            flags: 0,
            port_prefix_lens: 1 << 16,
            any_identity_lens: 0,
            ..Default::default()
        };
        let all = (1 << 16) | LENS_ALL_PROTOCOLS;
        assert_eq!(
            ProbeMasks::of_info(&old),
            ProbeMasks {
                identity: all,
                any_identity: all
            }
        );
        assert_eq!(
            m.union(ProbeMasks {
                identity: 1,
                any_identity: 0
            }),
            ProbeMasks {
                identity: (1 << 16) | 1,
                any_identity: LENS_ALL_PROTOCOLS
            }
        );
    }

    #[test]
    fn ipcache_keys_split_hosts_from_prefixes_and_round_trip() {
        let host: IpNet = "10.0.0.7/32".parse().unwrap();
        let k = ipcache_host_key(&host).expect("a host prefix");
        assert_eq!((k.family, &k.addr[..4]), (4, &[10, 0, 0, 7][..]));
        assert_eq!(ip_of(k.family, &k.addr), host.addr());
        assert!(ipcache_host_key(&"10.0.0.0/8".parse().unwrap()).is_none());
        let v6: IpNet = "fd00::1/128".parse().unwrap();
        let k6 = ipcache_host_key(&v6).unwrap();
        assert_eq!(ip_of(k6.family, &k6.addr), v6.addr());
        // The trie key counts the family word: 32 + the prefix length, network address only.
        let net = ipcache_key(&"10.1.2.3/16".parse().unwrap());
        assert_eq!((net.prefixlen, net.family), (48, 4));
        assert_eq!(&net.addr[..4], &[10, 1, 0, 0]);
    }

    #[test]
    fn pins_name_their_endpoint() {
        use super::pinned_endpoint_id as id;
        assert_eq!(id("policy_12"), Some(12));
        assert_eq!(id("link_7_ingress"), Some(7));
        assert_eq!(id("link_7_egress"), Some(7));
        assert_eq!(id("policy_maps"), None);
        assert_eq!(id("link_x_egress"), None);
        assert_eq!(id("endpoints"), None);
        assert_eq!(id("link_netdev_ingress"), None);
    }
}
