//! Masquerading of pod traffic that leaves the cluster (`--enable-ipv4-masquerade`,
//! `--enable-ipv6-masquerade`): an nftables table of this agent's own per address family,
//! written over netlink (nfnetlink through `nftnl`/`mnl`; nothing is shelled out).
//!
//! The table `ip ciliate_<tag>` (IPv4; `ip6 ciliate_<tag>` the same for IPv6) holds one NAT
//! chain on the postrouting hook:
//! ```text
//! ip saddr != POD_CIDR return        only this node's pods
//! ip daddr NATIVE_CIDR return        pod to pod (any node): never masqueraded, so policy keeps
//!                                    seeing pod identities
//! ip daddr NODE_IP return            (each node) traffic to a node keeps the pod's address
//! masquerade                         the rest leaves with the address of the outgoing device
//! ```
//! The kernel's connection tracking reverses the translation on replies, before they reach the
//! pod's interface (and so before the pod's ingress policy and conntrack see them).
//!
//! The whole table is written in one netlink batch (a transaction): the old table is deleted and
//! the new one created atomically, so a re-apply never duplicates a rule and no packet sees a
//! half-written table. The tag names the agent (a hash of its state directory): several agents
//! on one machine each own their table and never touch another's. The table outlives the agent
//! (a stopped or killed agent keeps masquerading), and [`remove`] deletes it when masquerading
//! is turned off.

use std::ffi::CString;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use nftnl::{
    nft_expr, Batch, Chain, ChainType, FinalizedBatch, Hook, MsgType, ProtoFamily, Rule, Table,
};

/// What to masquerade, for one address family (`ipv6`): prefixes and addresses of the other
/// family are left out of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasqueradeSpec {
    /// Whether this is the `ip6` table (else `ip`).
    pub ipv6: bool,
    /// This node's pod CIDRs: only their traffic is masqueraded.
    pub pod_cidrs: Vec<IpNet>,
    /// The cluster's pod address space (`--ipv4-native-routing-cidr`,
    /// `--ipv6-native-routing-cidr`): never masqueraded.
    pub native_routing_cidr: Option<IpNet>,
    /// Every node's pod CIDRs (this node's too): pod-to-pod traffic is never masqueraded, even
    /// where no native routing CIDR is given.
    pub cluster_pod_cidrs: Vec<IpNet>,
    /// Every node's addresses: traffic to a node keeps the pod's address.
    pub node_ips: Vec<IpAddr>,
}

impl MasqueradeSpec {
    fn of_family(&self, n: &IpNet) -> bool {
        matches!(n, IpNet::V6(_)) == self.ipv6
    }

    /// This node's pod CIDRs of the spec's family.
    pub fn sources(&self) -> Vec<IpNet> {
        let mut out: Vec<IpNet> = self
            .pod_cidrs
            .iter()
            .filter(|n| self.of_family(n))
            .copied()
            .collect();
        out.dedup();
        out
    }

    /// The destinations that keep the pod's address, in rule order: the native routing CIDR,
    /// then the pod CIDRs and node addresses it does not already cover (the spec's family).
    pub fn exempt(&self) -> Vec<IpNet> {
        let mut out: Vec<IpNet> = self
            .native_routing_cidr
            .into_iter()
            .filter(|n| self.of_family(n))
            .collect();
        let mut rest: Vec<IpNet> = self
            .pod_cidrs
            .iter()
            .chain(&self.cluster_pod_cidrs)
            .copied()
            .chain(self.node_ips.iter().map(|ip| IpNet::from(*ip)))
            .filter(|n| self.of_family(n) && !out.iter().any(|o| o.contains(n)))
            .collect();
        rest.sort();
        rest.dedup();
        out.extend(rest);
        out
    }
}

/// Why the table could not be written.
#[derive(Debug, thiserror::Error)]
pub enum MasqueradeError {
    #[error("nftables table {table}: {source}")]
    Netlink { table: String, source: io::Error },
    #[error("nftables table {table}: {what}")]
    Build { table: String, what: String },
}

/// The table's name for the agent with this tag.
pub fn table_name(tag: &str) -> String {
    format!("ciliate_{tag}")
}

/// A short tag that names an agent by its state directory.
pub fn tag_for(state_dir: &std::path::Path) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::fs::canonicalize(state_dir)
        .unwrap_or_else(|_| state_dir.to_path_buf())
        .hash(&mut h);
    format!("{:08x}", h.finish() as u32)
}

/// The nftables family and how the table is named in errors (`ip6 ciliate_<tag>`).
fn family(tag: &str, ipv6: bool) -> (ProtoFamily, String) {
    match ipv6 {
        false => (ProtoFamily::Ipv4, format!("ip {}", table_name(tag))),
        true => (ProtoFamily::Ipv6, format!("ip6 {}", table_name(tag))),
    }
}

/// `payload ip[6] saddr|daddr & mask == network`.
fn match_prefix(rule: &mut Rule, net: &IpNet, source: bool) {
    match (net, source) {
        (IpNet::V4(_), true) => rule.add_expr(&nft_expr!(payload ipv4 saddr)),
        (IpNet::V4(_), false) => rule.add_expr(&nft_expr!(payload ipv4 daddr)),
        (IpNet::V6(_), true) => rule.add_expr(&nft_expr!(payload ipv6 saddr)),
        (IpNet::V6(_), false) => rule.add_expr(&nft_expr!(payload ipv6 daddr)),
    }
    let zero = match net {
        IpNet::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpNet::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    rule.add_expr(&nft_expr!(bitwise mask net.netmask(), xor zero));
    rule.add_expr(&nft_expr!(cmp == net.network()));
}

/// Writes (or rewrites) this agent's masquerade table of the spec's family in the current
/// network namespace.
pub fn apply(tag: &str, spec: &MasqueradeSpec) -> Result<(), MasqueradeError> {
    let (proto, name) = family(tag, spec.ipv6);
    let err = |what: &str| MasqueradeError::Build {
        table: name.clone(),
        what: what.to_string(),
    };
    let cname = CString::new(table_name(tag)).map_err(|_| err("a NUL in the name"))?;
    let table = Table::new(&cname, proto);
    let mut batch = Batch::new();
    // Add first so that the delete never fails on a missing table, then delete and recreate:
    // all in one transaction.
    batch.add(&table, MsgType::Add);
    batch.add(&table, MsgType::Del);
    batch.add(&table, MsgType::Add);
    let mut chain = Chain::new(c"postrouting", &table);
    chain.set_type(ChainType::Nat);
    chain.set_hook(Hook::PostRouting, 100);
    chain.set_policy(nftnl::Policy::Accept);
    batch.add(&chain, MsgType::Add);

    // Packets from this node's pods go on to `from-pods`; the rest is left alone.
    // A regular chain (no hook, so no policy: the kernel refuses one).
    let from_pods = Chain::new(c"from-pods", &table);
    batch.add(&from_pods, MsgType::Add);
    for cidr in spec.sources() {
        let mut rule = Rule::new(&chain);
        match_prefix(&mut rule, &cidr, true);
        rule.add_expr(&nft_expr!(verdict goto c"from-pods".to_owned()));
        batch.add(&rule, MsgType::Add);
    }
    for net in spec.exempt() {
        let mut rule = Rule::new(&from_pods);
        match_prefix(&mut rule, &net, false);
        rule.add_expr(&nft_expr!(verdict return));
        batch.add(&rule, MsgType::Add);
    }
    let mut masq = Rule::new(&from_pods);
    masq.add_expr(&nft_expr!(counter));
    masq.add_expr(&nft_expr!(masquerade));
    batch.add(&masq, MsgType::Add);
    send(&batch.finalize()).map_err(|source| MasqueradeError::Netlink {
        table: name.clone(),
        source,
    })
}

/// Deletes this agent's masquerade table of one family, if there is one.
pub fn remove(tag: &str, ipv6: bool) -> Result<(), MasqueradeError> {
    let (proto, name) = family(tag, ipv6);
    let cname = CString::new(table_name(tag)).map_err(|_| MasqueradeError::Build {
        table: name.clone(),
        what: "a NUL in the name".into(),
    })?;
    let table = Table::new(&cname, proto);
    let mut batch = Batch::new();
    batch.add(&table, MsgType::Add);
    batch.add(&table, MsgType::Del);
    send(&batch.finalize()).map_err(|source| MasqueradeError::Netlink {
        table: name,
        source,
    })
}

/// Sends a batch and checks every acknowledgement: the transaction applies whole or not at all.
fn send(batch: &FinalizedBatch) -> io::Result<()> {
    let socket = mnl::Socket::new(mnl::Bus::Netfilter)?;
    let portid = socket.portid();
    socket.send_all(batch)?;
    let mut buffer = vec![0; nftnl::nft_nlmsg_maxsize() as usize];
    let mut expected = batch.sequence_numbers();
    while !expected.is_empty() {
        for message in socket.recv(&mut buffer[..])? {
            let message = message?;
            let Some(seq) = expected.next() else {
                return Err(io::Error::other("an acknowledgement nobody asked for"));
            };
            mnl::cb_run(message, seq, portid)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_and_nodes_are_exempt_inside_or_outside_the_native_cidr() {
        let spec = MasqueradeSpec {
            ipv6: false,
            pod_cidrs: vec!["10.244.1.0/24".parse().unwrap()],
            native_routing_cidr: Some("10.244.0.0/16".parse().unwrap()),
            cluster_pod_cidrs: vec![
                "10.244.2.0/24".parse().unwrap(),
                "10.99.0.0/24".parse().unwrap(),
                "fd00:244:2::/64".parse().unwrap(),
            ],
            node_ips: vec![
                "172.18.0.3".parse().unwrap(),
                "172.18.0.2".parse().unwrap(),
                "172.18.0.3".parse().unwrap(),
                "10.244.0.1".parse().unwrap(),
                "fd00::2".parse().unwrap(),
            ],
        };
        let exempt: Vec<String> = spec.exempt().iter().map(|n| n.to_string()).collect();
        assert_eq!(
            exempt,
            vec![
                "10.244.0.0/16",
                "10.99.0.0/24",
                "172.18.0.2/32",
                "172.18.0.3/32"
            ]
        );
        // Without a native routing CIDR every known pod CIDR is exempt.
        let no_native = MasqueradeSpec {
            native_routing_cidr: None,
            node_ips: vec![],
            ..spec
        };
        let exempt: Vec<String> = no_native.exempt().iter().map(|n| n.to_string()).collect();
        assert_eq!(
            exempt,
            vec!["10.99.0.0/24", "10.244.1.0/24", "10.244.2.0/24"]
        );
    }

    #[test]
    fn an_ipv6_spec_holds_only_ipv6_prefixes() {
        let spec = MasqueradeSpec {
            ipv6: true,
            pod_cidrs: vec![
                "10.244.1.0/24".parse().unwrap(),
                "fd00:244:1::/64".parse().unwrap(),
            ],
            native_routing_cidr: Some("fd00:244::/32".parse().unwrap()),
            cluster_pod_cidrs: vec![
                "fd00:244:2::/64".parse().unwrap(),
                "fd00:99::/64".parse().unwrap(),
                "10.99.0.0/24".parse().unwrap(),
            ],
            node_ips: vec!["172.18.0.2".parse().unwrap(), "fd00::2".parse().unwrap()],
        };
        let shown = |v: Vec<IpNet>| v.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(shown(spec.sources()), vec!["fd00:244:1::/64"]);
        assert_eq!(
            shown(spec.exempt()),
            vec!["fd00:244::/32", "fd00::2/128", "fd00:99::/64"]
        );
        assert_eq!(family("t", true).1, "ip6 ciliate_t");
    }

    #[test]
    fn tags_differ_by_state_directory_and_names_are_valid() {
        let a = tag_for(std::path::Path::new("/var/run/ciliate"));
        let b = tag_for(std::path::Path::new("/tmp/other-agent"));
        assert_ne!(a, b);
        assert_eq!(a.len(), 8);
        assert!(table_name(&a).len() < 32, "nftables names are short");
    }
}
