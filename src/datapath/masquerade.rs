//! Masquerading of pod traffic that leaves the cluster (`--enable-ipv4-masquerade`): an nftables
//! table of this agent's own, written over netlink (nfnetlink through `nftnl`/`mnl`; nothing is
//! shelled out).
//!
//! The table `ip ciliate_<tag>` holds one NAT chain on the postrouting hook:
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
use std::net::{IpAddr, Ipv4Addr};

use ipnet::Ipv4Net;
use nftnl::{
    nft_expr, Batch, Chain, ChainType, FinalizedBatch, Hook, MsgType, ProtoFamily, Rule, Table,
};

/// What to masquerade.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasqueradeSpec {
    /// This node's pod CIDRs: only their traffic is masqueraded.
    pub pod_cidrs: Vec<Ipv4Net>,
    /// The cluster's pod address space (`--ipv4-native-routing-cidr`): never masqueraded. When
    /// absent, the node's own pod CIDRs are.
    pub native_routing_cidr: Option<Ipv4Net>,
    /// Every node's addresses: traffic to a node keeps the pod's address.
    pub node_ips: Vec<Ipv4Addr>,
}

impl MasqueradeSpec {
    /// The destinations that keep the pod's address, in rule order.
    pub fn exempt(&self) -> Vec<Ipv4Net> {
        let mut out: Vec<Ipv4Net> = match self.native_routing_cidr {
            Some(c) => vec![c],
            None => self.pod_cidrs.clone(),
        };
        let mut nodes: Vec<Ipv4Net> = self
            .node_ips
            .iter()
            .map(|ip| Ipv4Net::from(*ip))
            .filter(|n| !out.iter().any(|o| o.contains(n)))
            .collect();
        nodes.sort();
        nodes.dedup();
        out.extend(nodes);
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

/// Writes (or rewrites) this agent's masquerade table in the current network namespace.
pub fn apply(tag: &str, spec: &MasqueradeSpec) -> Result<(), MasqueradeError> {
    let name = table_name(tag);
    let err = |what: &str| MasqueradeError::Build {
        table: name.clone(),
        what: what.to_string(),
    };
    let cname = CString::new(name.clone()).map_err(|_| err("a NUL in the name"))?;
    let table = Table::new(&cname, ProtoFamily::Ipv4);
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
    for cidr in &spec.pod_cidrs {
        let mut rule = Rule::new(&chain);
        rule.add_expr(&nft_expr!(payload ipv4 saddr));
        rule.add_expr(&nft_expr!(bitwise mask IpAddr::V4(cidr.netmask()), xor 0u32));
        rule.add_expr(&nft_expr!(cmp == IpAddr::V4(cidr.network())));
        rule.add_expr(&nft_expr!(verdict goto c"from-pods".to_owned()));
        batch.add(&rule, MsgType::Add);
    }
    for net in spec.exempt() {
        let mut rule = Rule::new(&from_pods);
        rule.add_expr(&nft_expr!(payload ipv4 daddr));
        rule.add_expr(&nft_expr!(bitwise mask IpAddr::V4(net.netmask()), xor 0u32));
        rule.add_expr(&nft_expr!(cmp == IpAddr::V4(net.network())));
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

/// Deletes this agent's masquerade table, if there is one.
pub fn remove(tag: &str) -> Result<(), MasqueradeError> {
    let name = table_name(tag);
    let cname = CString::new(name.clone()).map_err(|_| MasqueradeError::Build {
        table: name.clone(),
        what: "a NUL in the name".into(),
    })?;
    let table = Table::new(&cname, ProtoFamily::Ipv4);
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
    fn the_native_cidr_and_every_node_outside_it_are_exempt() {
        let spec = MasqueradeSpec {
            pod_cidrs: vec!["10.244.1.0/24".parse().unwrap()],
            native_routing_cidr: Some("10.244.0.0/16".parse().unwrap()),
            node_ips: vec![
                "172.18.0.3".parse().unwrap(),
                "172.18.0.2".parse().unwrap(),
                "172.18.0.3".parse().unwrap(),
                "10.244.0.1".parse().unwrap(),
            ],
        };
        let exempt: Vec<String> = spec.exempt().iter().map(|n| n.to_string()).collect();
        assert_eq!(
            exempt,
            vec!["10.244.0.0/16", "172.18.0.2/32", "172.18.0.3/32"]
        );
        let no_native = MasqueradeSpec {
            native_routing_cidr: None,
            node_ips: vec![],
            ..spec
        };
        assert_eq!(
            no_native.exempt(),
            vec!["10.244.1.0/24".parse::<Ipv4Net>().unwrap()]
        );
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
