//! The datapath: where policy is enforced. A [`Datapath`] trait with an in-memory implementation
//! ([`memory::MemoryDatapath`], for unit tests and machines without BPF); the eBPF implementation
//! plugs in behind the same trait. Only `LoaderActor` owns a datapath.

pub mod abi;
pub mod bpf;
pub mod cgroup;
pub mod events;
pub mod flows;
pub mod masquerade;
pub mod memory;
pub mod netdev;

use std::collections::HashSet;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::Serialize;

use crate::policy::attribution::Cookie;
use crate::policy::identity::NumericIdentity;
use crate::policy::mapstate::MapDelta;

/// Endpoint numbers, as Cilium's (1..=65535).
pub type EndpointId = u16;

/// The host endpoint's id (`endpoint::host`; `CILIATE_HOST_ENDPOINT_ID` in `bpf/ciliate.h`):
/// the last one, never a pod's.
pub const HOST_ENDPOINT_ID: EndpointId = EndpointId::MAX;

/// What the datapath needs to enforce policy for an endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EndpointAttachment {
    pub id: EndpointId,
    pub interface: Option<String>,
    pub ips: Vec<IpAddr>,
    pub identity: NumericIdentity,
    /// The pod interface's MAC (`aa:bb:..`), when known: with it (and an interface) packets
    /// arriving on the node's device are delivered straight into the pod.
    pub mac: Option<String>,
}

/// Per-endpoint switches in the endpoint map.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct EndpointFlags {
    /// Drop ingress traffic no entry allows.
    pub ingress_default_deny: bool,
    /// Drop egress traffic no entry allows.
    pub egress_default_deny: bool,
    /// Drop everything: set when the policy could not be realized (fail closed).
    pub drop_all: bool,
    /// Attribution of a default deny per direction: the cookie of the isolating policies
    /// (`policy::attribution::isolation_cookie`; 0 when not isolated).
    pub ingress_cookie: u32,
    pub egress_cookie: u32,
    /// Audit mode: what policy would drop passes and is reported as `audit`.
    pub audit: bool,
    /// Egress policy has DNS rules: allowed DNS goes through the DNS proxy.
    pub dns_proxy: bool,
}

/// One realized policy map entry, for `ciliate bpf policy get`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PolicyMapEntry {
    pub identity: NumericIdentity,
    pub direction: &'static str,
    pub protocol: u8,
    pub port: u16,
    pub port_prefix_len: u8,
    /// Inclusive port range covered by `port`/`port_prefix_len`.
    pub port_range: (u16, u16),
    pub deny: bool,
    pub packets: u64,
    pub bytes: u64,
}

impl PolicyMapEntry {
    /// An entry as a datapath holds it, with its counters.
    pub fn new(k: &abi::PolicyEntryKey, deny: bool, packets: u64, bytes: u64) -> Self {
        PolicyMapEntry {
            identity: k.identity,
            direction: if k.egress { "egress" } else { "ingress" },
            protocol: k.protocol,
            port: k.port,
            port_prefix_len: k.port_prefix_len,
            port_range: k.port_range(),
            deny,
            packets,
            bytes,
        }
    }
}

/// Everything realized for one endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PolicyMapDump {
    pub endpoint: EndpointId,
    pub flags: EndpointFlags,
    pub capacity: usize,
    pub entries: Vec<PolicyMapEntry>,
}

/// Counts of what a sync changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SyncStats {
    pub upserted: usize,
    pub deleted: usize,
    pub entries: usize,
}

/// Datapath failures. Each names the endpoint or entry concerned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DatapathError {
    /// The endpoint is not attached.
    #[error("endpoint {0} is not attached to the datapath")]
    UnknownEndpoint(EndpointId),
    /// The policy would need more entries than the map holds; the endpoint now drops all
    /// traffic until a policy that fits is applied (fail closed).
    #[error("policy map of endpoint {endpoint} is full: {needed} entries needed, capacity {capacity}; the endpoint drops all traffic until its policy fits")]
    PolicyMapFull {
        endpoint: EndpointId,
        needed: usize,
        capacity: usize,
    },
    /// The ipcache is full.
    #[error("ipcache is full ({capacity} entries): cannot add {prefix}")]
    IpcacheFull { prefix: IpNet, capacity: usize },
    /// A kernel or system call failed.
    #[error("{operation}: {message}")]
    System { operation: String, message: String },
}

/// How long an idle connection-tracking entry lives (Cilium's defaults; `CILIATE_CT_TIMEOUT_*`
/// in `bpf/ciliate.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConntrackTimeouts {
    /// TCP that saw a reply and no FIN/RST.
    pub tcp: std::time::Duration,
    /// TCP that never saw a reply (a SYN nobody answered).
    pub tcp_syn: std::time::Duration,
    /// TCP that saw a FIN or RST.
    pub tcp_closing: std::time::Duration,
    /// Everything else (UDP, ICMP, SCTP).
    pub other: std::time::Duration,
}

impl Default for ConntrackTimeouts {
    fn default() -> Self {
        use std::time::Duration;
        ConntrackTimeouts {
            tcp: Duration::from_secs(21600),
            tcp_syn: Duration::from_secs(60),
            tcp_closing: Duration::from_secs(10),
            other: Duration::from_secs(60),
        }
    }
}

impl ConntrackTimeouts {
    /// The lifetime of an idle entry of `protocol` in the given state.
    pub fn for_entry(&self, protocol: u8, replied: bool, closing: bool) -> std::time::Duration {
        match (protocol, replied, closing) {
            (6, _, true) => self.tcp_closing,
            (6, false, false) => self.tcp_syn,
            (6, true, false) => self.tcp,
            _ => self.other,
        }
    }
}

/// What one conntrack garbage-collection pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ConntrackGcStats {
    pub scanned: usize,
    pub removed: usize,
    /// The addresses (either end) of the entries kept: connections alive, whose peers learned
    /// from DNS stay selected past their TTL (Cilium's zombies).
    #[serde(skip)]
    pub live: std::collections::HashSet<std::net::IpAddr>,
    /// When the pass began (Unix seconds): a connection opened before then is in `live`.
    pub started: u64,
    /// Every table was read: `live` names every connection kept. A pass that could not read a
    /// table says nothing about which connections are alive.
    pub complete: bool,
}

/// Adds the cookies one endpoint's map (`table`) and flags may report to `out`.
pub(crate) fn cookies_of(
    flags: &EndpointFlags,
    table: &abi::EntryTable,
    out: &mut HashSet<Cookie>,
) {
    out.extend(table.cookies());
    out.extend([flags.ingress_cookie, flags.egress_cookie]);
    out.remove(&0);
}

/// The operations `LoaderActor` performs on a datapath.
pub trait Datapath: Send + 'static {
    /// A short name for logs and status (`memory`, `bpf`).
    fn name(&self) -> &'static str;
    /// Creates (or updates) the endpoint's entry in the endpoint map and its policy map.
    fn attach_endpoint(&mut self, ep: &EndpointAttachment) -> Result<(), DatapathError>;
    /// Removes the endpoint and its policy map. Removing an unknown endpoint is not an error.
    fn detach_endpoint(&mut self, id: EndpointId) -> Result<(), DatapathError>;
    /// Applies an engine-level delta to the endpoint's policy map and sets its flags.
    /// `replace`: clear the map first (resynchronisation after an error or a restart).
    fn sync_policy(
        &mut self,
        id: EndpointId,
        flags: EndpointFlags,
        delta: &MapDelta,
        replace: bool,
    ) -> Result<SyncStats, DatapathError>;
    fn upsert_ipcache(
        &mut self,
        prefix: IpNet,
        identity: NumericIdentity,
    ) -> Result<(), DatapathError>;
    fn remove_ipcache(&mut self, prefix: IpNet) -> Result<(), DatapathError>;
    fn dump_policy(&self, id: EndpointId) -> Result<PolicyMapDump, DatapathError>;
    fn dump_ipcache(&self) -> Vec<(IpNet, NumericIdentity)>;
    /// The endpoints attached.
    fn endpoints(&self) -> Vec<EndpointId>;
    /// Every attribution cookie the endpoints' maps and flags may report (what
    /// `CookieJar::sweep` must keep). No default: a datapath that answered "none" would have
    /// every attribution swept.
    fn cookies_in_use(&self) -> HashSet<Cookie>;
    /// Endpoints with something pinned (programs' links, a policy map), attached in this run or
    /// not: what a restart finds of the previous run. Datapaths without pins have none.
    fn pinned_endpoints(&self) -> Vec<EndpointId> {
        Vec::new()
    }
    /// Starts garbage-collecting connection tracking every `interval` (entries idle past their
    /// timeout are removed), reporting each pass to `report`. Off the caller's thread, so a
    /// long pass never delays a policy update. Datapaths without conntrack do nothing.
    fn start_conntrack_gc(
        &self,
        interval: std::time::Duration,
        timeouts: ConntrackTimeouts,
        report: Box<dyn FnMut(ConntrackGcStats) + Send>,
    ) -> Result<bool, DatapathError> {
        let _ = (interval, timeouts, report);
        Ok(false)
    }
    /// Starts delivering policy verdict events to `sink` (until it returns false). Datapaths
    /// without events (the in-memory one) deliver none.
    fn start_events(
        &self,
        sink: Box<dyn FnMut(events::VerdictEvent) -> bool + Send>,
    ) -> Result<(), DatapathError> {
        let _ = sink;
        Ok(())
    }
}
