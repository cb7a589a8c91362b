//! The `ciliate` command line (clap). Each subcommand's logic lives in its own module; this file
//! only parses arguments and maps results to exit codes.

use std::io::Write;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::simulate;

/// Exit status: every policy accepted.
pub const EXIT_OK: i32 = 0;
/// Exit status: the input itself is unusable.
pub const EXIT_UNUSABLE: i32 = 2;
/// Exit status: one or more policies were rejected (verdicts still printed).
pub const EXIT_REJECTED: i32 = 3;

pub mod commands;
pub mod traffic;

pub use commands::run_client;

/// Default paths and addresses (interfaces.md section 2).
pub use crate::config::DEFAULT_SOCKET;

#[derive(Debug, Parser)]
#[command(
    name = "ciliate",
    version,
    about = "Cilium-compatible network policy agent, simulator and CNI plugin"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Output format of client commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

/// Options every client command takes.
#[derive(Debug, Clone, clap::Args)]
pub struct ClientOpts {
    /// The agent's API socket.
    #[arg(long, global = true, default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Output format.
    #[arg(
        short = 'o',
        long = "output",
        global = true,
        value_enum,
        default_value = "table"
    )]
    pub output: Output,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent.
    Agent(Box<AgentArgs>),
    /// Policy tools (simulate needs no agent; get asks the agent).
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// The agent's status.
    Status {
        #[command(flatten)]
        client: ClientOpts,
    },
    /// Endpoints managed by the agent.
    Endpoint {
        #[command(subcommand)]
        command: EndpointCommand,
        #[command(flatten)]
        client: ClientOpts,
    },
    /// Cluster nodes: addresses, pod CIDRs and the state of the routes to them.
    Node {
        #[command(subcommand)]
        command: NodeCommand,
        #[command(flatten)]
        client: ClientOpts,
    },
    /// Security identities.
    Identity {
        #[command(subcommand)]
        command: IdentityCommand,
        #[command(flatten)]
        client: ClientOpts,
    },
    /// Stream flows: the datapath's policy verdicts (every drop, the first packet of every new
    /// allowed connection), one line each, naming the deciding policies.
    Monitor {
        /// Exit after this many (matching) events.
        #[arg(long)]
        count: Option<u64>,
        /// First the flows the agent kept from this long ago on (`30s`, `5m`, `2h`; the agent
        /// keeps the last --flow-buffer-capacity flows), then live ones.
        #[arg(long)]
        since: Option<String>,
        #[command(flatten)]
        filter: crate::datapath::events::FlowFilter,
        #[command(flatten)]
        client: ClientOpts,
    },
    /// The out-of-the-box demonstration (root): an agent with the eBPF datapath, pods created
    /// through CNI, connectivity measured before and after policies; runs until Ctrl-C.
    Demo {
        /// Print the matrices and clean up instead of waiting for Ctrl-C.
        #[arg(long)]
        once: bool,
        /// Apply no policy (the traffic is then the base of `policy recommend` and `policy
        /// diff`; the demo's policies are written beside as a proposal).
        #[arg(long)]
        no_policies: bool,
        /// The agent's debug HTTP address.
        #[arg(long, default_value = "127.0.0.1:9962")]
        debug_addr: std::net::SocketAddr,
        /// The pods' addresses.
        #[arg(long, default_value = "10.248.0.0/24")]
        pod_cidr: ipnet::Ipv4Net,
    },
    /// Services: every frontend (ClusterIP:port/protocol) with its backends.
    Service {
        #[command(subcommand)]
        command: ServiceCommand,
        #[command(flatten)]
        client: ClientOpts,
    },
    /// The datapath's maps.
    Bpf {
        #[command(subcommand)]
        command: BpfCommand,
        #[command(flatten)]
        client: ClientOpts,
    },
    /// DNS-aware policy: the names learned from allowed DNS answers.
    Fqdn {
        #[command(subcommand)]
        command: FqdnCommand,
        #[command(flatten)]
        client: ClientOpts,
    },
    /// The transparent DNS proxy of an agent's state directory (`ciliate agent` starts one
    /// when none runs; in a DaemonSet it may run as a container of its own). It keeps serving
    /// while the agent is stopped.
    DnsProxy(DnsProxyArgs),
    /// Hubble's Observer API for the whole cluster (Hubble Relay's role and flag names): the
    /// agents come from one agent's Peer service; every call asks all of them.
    Relay(RelayArgs),
    /// The HTTP proxy of an agent's state directory: L7 HTTP rules and TLS server names
    /// (`ciliate agent` starts one when none runs). It keeps serving while the agent is
    /// stopped; a new one takes over a running one's sockets without a failed request.
    HttpProxy(HttpProxyArgs),
}

#[derive(Debug, clap::Args)]
pub struct HttpProxyArgs {
    /// The agent's state directory (the proxy's sockets and kept table live there).
    #[arg(long, default_value = "/var/run/ciliate")]
    pub state_dir: PathBuf,
    #[arg(long, default_value = "/sys/fs/bpf")]
    pub bpf_root: PathBuf,
    /// The listener for what pods send (0: an ephemeral port).
    #[arg(long, default_value_t = 0)]
    pub egress_port: u16,
    /// The listener for what pods receive (0: an ephemeral port).
    #[arg(long, default_value_t = 0)]
    pub ingress_port: u16,
    /// After handing its sockets over (or SIGTERM), how long it lets open connections finish.
    #[arg(long, default_value_t = 30)]
    pub drain_timeout_secs: u64,
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
pub enum FqdnCommand {
    Cache {
        #[command(subcommand)]
        command: FqdnCacheCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum FqdnCacheCommand {
    /// Every name: its addresses, when they expire, the endpoints that asked.
    List,
}

#[derive(Debug, clap::Args)]
pub struct DnsProxyArgs {
    /// The agent's state directory (the proxy's socket and kept rules live there).
    #[arg(long, default_value = "/var/run/ciliate")]
    pub state_dir: PathBuf,
    #[arg(long, default_value = "/sys/fs/bpf")]
    pub bpf_root: PathBuf,
    /// 0: an ephemeral port.
    #[arg(long, default_value_t = 0)]
    pub udp_port: u16,
    /// 0: an ephemeral port.
    #[arg(long, default_value_t = 0)]
    pub tcp_port: u16,
    /// Longest an allowed answer waits for the agent to put its addresses into policy.
    #[arg(long, default_value_t = 2000)]
    pub learn_timeout_ms: u64,
    /// UDP queries per second one pod (source address) may send through the proxy, with a
    /// burst of two seconds' worth; past it, and past 1,024 of its queries waiting at once, its
    /// queries are dropped (its resolver retries). 0: no rate limit.
    #[arg(long, default_value_t = 1_000)]
    pub max_qps_per_pod: u32,
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// standalone (manifests directory) or kubernetes. Default: kubernetes in a cluster or with
    /// --kubeconfig, else standalone.
    #[arg(long, value_enum)]
    pub mode: Option<crate::config::Mode>,
    /// Standalone: a directory of YAML manifests, watched for edits.
    #[arg(long)]
    pub manifests: Option<PathBuf>,
    /// Kubernetes mode outside a cluster.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Default: the host name.
    #[arg(long)]
    pub node_name: Option<String>,
    #[arg(long, value_enum, default_value = "bpf")]
    pub datapath: crate::config::DatapathKind,
    #[arg(long, default_value = "/var/run/ciliate")]
    pub state_dir: PathBuf,
    #[arg(long, default_value = "/sys/fs/bpf")]
    pub bpf_root: PathBuf,
    #[arg(long, default_value = DEFAULT_SOCKET)]
    pub api_socket: PathBuf,
    #[arg(long, default_value = "127.0.0.1:9962")]
    pub debug_addr: std::net::SocketAddr,
    /// Connections the debug server serves at once; more are closed as soon as accepted (and
    /// counted in ciliate_debug_connections_refused_total), so local clients of the debug port
    /// can never take the open files the API socket and the CNI plugin need.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub debug_max_connections: u64,
    /// A cgroup v2 directory: sockets of the processes in it (the pods) have their connections
    /// to ClusterIPs translated to a ready backend (socket-level load balancing). Without it,
    /// nothing is translated.
    #[arg(long)]
    pub cgroup_root: Option<PathBuf>,
    /// IPAM range when the Node object gives none: once per address family.
    #[arg(long)]
    pub pod_cidr: Vec<ipnet::IpNet>,
    /// Pods get an IPv4 address (Cilium's flag). `false` with `--enable-ipv6=true`: an
    /// IPv6-only node (no IPv4 pool, no IPv4 pod routes, no IPv4 masquerading).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_ipv4: bool,
    /// Pods get an IPv6 address too (Cilium's flag): from the Node's IPv6 pod CIDR, or an IPv6
    /// `--pod-cidr`.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub enable_ipv6: bool,
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Seconds between passes of the connection-tracking garbage collector.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub conntrack_gc_interval: u64,
    /// Standalone: a manifest file larger than this is refused (its previous objects stay).
    #[arg(long, default_value_t = 16 << 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub manifest_max_file_bytes: u64,
    /// Standalone: documents the manifest directory may hold in all; a file that would exceed
    /// it is refused (its previous objects stay).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub manifest_max_documents: u64,
    /// How pod traffic reaches other nodes: native (routes via each node's InternalIP) or tunnel.
    #[arg(long, value_enum, default_value = "native")]
    pub routing_mode: crate::network::RoutingMode,
    /// Tunnel mode: the encapsulation.
    #[arg(long, value_enum, default_value = "vxlan")]
    pub tunnel_protocol: crate::network::TunnelProtocol,
    /// Tunnel mode: the outer packets' address family (Cilium's flag): `ipv4`, or `ipv6` for
    /// nodes with IPv6 addresses only (then only IPv6 pod CIDRs are routed).
    #[arg(long, value_enum, default_value = "ipv4")]
    pub underlay_protocol: crate::network::UnderlayProtocol,
    /// Native mode: install a route to every other node's pod CIDRs via its InternalIP.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub auto_direct_node_routes: bool,
    /// The cluster's pod address space: other nodes' pod CIDRs outside it are not routed.
    #[arg(long)]
    pub ipv4_native_routing_cidr: Option<ipnet::Ipv4Net>,
    /// The cluster's IPv6 pod address space (`--enable-ipv6`): other nodes' IPv6 pod CIDRs
    /// outside it are not routed.
    #[arg(long)]
    pub ipv6_native_routing_cidr: Option<ipnet::Ipv6Net>,
    /// SNAT this node's pods' traffic that leaves --ipv4-native-routing-cidr (and goes to no
    /// node) to the node's address (nftables, a table of this agent's own).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_ipv4_masquerade: bool,
    /// With `--enable-ipv6`: SNAT this node's pods' IPv6 traffic that leaves
    /// --ipv6-native-routing-cidr (and goes to no node) to the node's IPv6 address (an `ip6`
    /// table of this agent's own). Cilium's flag and default.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_ipv6_masquerade: bool,
    /// Send pod traffic to other nodes through the host stack's forwarding (netfilter
    /// included) instead of BPF host routing (straight from the pod's veth to the node's
    /// device, or into the tunnel, once policy allowed it).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub enable_host_legacy_routing: bool,
    /// Enforcement: `default` (isolated once a policy selects the endpoint), `always` (default
    /// deny everywhere), `never` (nothing enforced; would-be drops reported as audit).
    #[arg(long, value_enum, default_value_t = crate::config::PolicyEnforcement::Default)]
    pub enable_policy: crate::config::PolicyEnforcement,
    /// Audit every endpoint: what policy would drop passes and is reported as `audit`.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub policy_audit_mode: bool,
    /// The host firewall: the node is an endpoint (`reserved:host`, the Node's labels), and
    /// CiliumClusterwideNetworkPolicies with a `nodeSelector` are enforced on its traffic.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub enable_host_firewall: bool,
    /// The node's native devices (Cilium's flag; once per device or comma-separated; `eth+`
    /// is a prefix): the host firewall's programs go on each, and their addresses are the
    /// node's (`host`). Default: every device with a global address.
    #[arg(long, value_name = "NAME")]
    pub devices: Vec<String>,
    /// Recent flows kept for `ciliate monitor --since` (the oldest go first; 0 keeps none).
    #[arg(long, default_value_t = crate::datapath::flows::DEFAULT_CAPACITY)]
    pub flow_buffer_capacity: usize,
    /// How long the distinct connections observed are kept for `policy diff` and `policy
    /// recommend` (`30m`, `24h`, `7d`; `0` keeps none). Saved across restarts.
    #[arg(long, default_value = "24h", value_name = "DURATION",
          value_parser = |s: &str| crate::traffic::parse_duration("--flow-history", s))]
    pub flow_history: u64,
    /// At most this many distinct connections are kept (the least recently seen go first).
    #[arg(long, default_value_t = 1_000_000)]
    pub flow_history_max: usize,
    /// Hubble's Observer and Peer services on TCP too (Cilium's flag): `HOST:PORT`, or `:PORT`
    /// for every address. They are always served on `STATE_DIR/hubble.sock`.
    #[arg(long, value_name = "ADDR", value_parser = crate::hubble::server::parse_listen_address)]
    pub hubble_listen_address: Option<std::net::SocketAddr>,
    /// The TLS certificate of `--hubble-listen-address` (PEM); without it, plain text.
    #[arg(long, value_name = "FILE", requires_all = ["hubble_tls_key_file", "hubble_listen_address"])]
    pub hubble_tls_cert_file: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, value_name = "FILE", requires = "hubble_tls_cert_file")]
    pub hubble_tls_key_file: Option<PathBuf>,
    /// CAs whose client certificates are required (mutual TLS; comma-separated or repeated).
    #[arg(
        long,
        value_name = "FILE",
        value_delimiter = ',',
        requires = "hubble_tls_cert_file"
    )]
    pub hubble_tls_client_ca_files: Vec<PathBuf>,
    /// Addresses learned from DNS answers stay selected by toFQDNs at least this long (and
    /// while a connection through them is tracked).
    #[arg(long, default_value_t = 3600)]
    pub tofqdns_min_ttl: u64,
    /// Addresses the FQDN cache keeps per name (the soonest to expire go first).
    #[arg(long, default_value_t = 1_000)]
    pub tofqdns_endpoint_max_ip_per_hostname: usize,
    /// Names one endpoint's lookups may hold in the FQDN cache (its least recently used,
    /// unselected names go first).
    #[arg(long, default_value_t = 10_000)]
    pub tofqdns_endpoint_max_names: usize,
    /// Names the FQDN cache holds in all.
    #[arg(long, default_value_t = 100_000)]
    pub tofqdns_max_names: usize,
    /// Addresses kept past their TTL because a connection still uses them (the oldest go
    /// first, and their connections are then judged without them).
    #[arg(long, default_value_t = 10_000)]
    pub tofqdns_max_deferred_connection_deletes: usize,
    /// The DNS proxy (bpf datapath): `auto` starts one for the state directory when none runs
    /// and adopts one that does; `external` only adopts one (a container of its own);
    /// `disabled` runs none (DNS of endpoints with DNS rules is then dropped: fail closed).
    #[arg(long, value_enum, default_value = "auto")]
    pub dns_proxy: crate::config::DnsProxyMode,
    /// `--max-qps-per-pod` of the DNS proxy this agent starts (`--dns-proxy auto`).
    #[arg(long, default_value_t = 1_000)]
    pub dns_proxy_max_qps_per_pod: u32,
    /// The HTTP proxy (bpf datapath), as `--dns-proxy`: `auto`, `external` or `disabled`
    /// (connections an L7 rule covers are then dropped: fail closed).
    #[arg(long, value_enum, default_value = "auto")]
    pub http_proxy: crate::config::DnsProxyMode,
    /// Kubernetes mode: learn other nodes' pods by watching every Pod (small clusters) instead
    /// of the CiliateEndpointSlices their agents write. Either way the agent writes its own
    /// node's slices.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub watch_pods: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// What-if analysis: load a world (namespaces, pods, policies, probes) and print one JSON
    /// verdict per probe. Exit 0: all policies accepted; 3: some rejected; 2: unusable world.
    Simulate {
        /// The world file (YAML).
        #[arg(long)]
        world: PathBuf,
    },
    /// Print a synthetic world of the given size (for benchmarks and load tests).
    GenerateWorld {
        #[arg(long, default_value_t = 500)]
        namespaces: usize,
        #[arg(long, default_value_t = 5000)]
        pods: usize,
        #[arg(long, default_value_t = 2000)]
        policies: usize,
        #[arg(long, default_value_t = 10000)]
        probes: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// The agent's policies and their status.
    Get {
        #[command(flatten)]
        client: ClientOpts,
    },
    /// What would this change break? Replays the observed connections against the policies
    /// in force and against them with the change; prints every connection whose verdict would
    /// flip (newly dropped first), with counts, last seen and the deciding policies.
    Diff(traffic::DiffArgs),
    /// Least-privilege policies for a namespace's workloads from the connections observed
    /// (YAML on stdout).
    Recommend(traffic::RecommendArgs),
}

#[derive(Debug, Subcommand)]
pub enum EndpointCommand {
    /// List endpoints.
    List,
    /// Show one endpoint.
    Get { id: u16 },
    /// Register a workload not created through CNI (labels come from its Pod and Namespace).
    Add {
        /// namespace/pod
        #[arg(long)]
        name: String,
        /// An address of the workload (repeat for IPv6).
        #[arg(long = "ip", required = true)]
        ips: Vec<std::net::IpAddr>,
        /// The host-side interface.
        #[arg(long)]
        interface: Option<String>,
    },
    /// Delete an endpoint.
    Delete { id: u16 },
    /// Change an endpoint's configuration: `PolicyAuditMode=Enabled|Disabled`.
    Config {
        id: u16,
        /// `OPTION=VALUE`
        #[arg(required = true)]
        options: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// List the nodes the agent knows.
    List,
}

#[derive(Debug, Subcommand)]
pub enum IdentityCommand {
    /// List identities.
    List,
}

#[derive(Debug, Subcommand)]
pub enum ServiceCommand {
    /// List frontends and their backends.
    List,
}

#[derive(Debug, Subcommand)]
pub enum BpfCommand {
    /// Policy map entries.
    Policy {
        #[command(subcommand)]
        command: BpfPolicyCommand,
    },
    /// The datapath's ipcache: prefix -> identity, as the kernel holds it.
    Ipcache {
        #[command(subcommand)]
        command: BpfIpcacheCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum BpfIpcacheCommand {
    /// Every entry.
    List,
}

#[derive(Debug, Subcommand)]
pub enum BpfPolicyCommand {
    /// The realized entries of one endpoint's policy map.
    Get { id: u16 },
}

/// Runs `ciliate policy simulate`, writing verdicts to `out` and diagnostics to `err`.
/// Returns the exit status.
pub fn run_simulate(path: &std::path::Path, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let text = match simulate::read_world(path) {
        Ok(t) => t,
        Err(e) => {
            let _ = writeln!(err, "error: {}: {e}", path.display());
            return EXIT_UNUSABLE;
        }
    };
    let sim = match simulate::simulate(&text) {
        Ok(s) => s,
        Err(e) => {
            let _ = writeln!(err, "error: {}: {e}", path.display());
            return EXIT_UNUSABLE;
        }
    };
    for w in &sim.warnings {
        let _ = writeln!(err, "warning: {w}");
    }
    for r in &sim.rejections {
        let _ = writeln!(err, "error: rejected {r}");
    }
    for r in &sim.results {
        match serde_json::to_string(r) {
            Ok(line) => {
                let _ = writeln!(out, "{line}");
            }
            Err(e) => {
                let _ = writeln!(err, "error: cannot encode a result: {e}");
                return EXIT_UNUSABLE;
            }
        }
    }
    if sim.rejections.is_empty() {
        EXIT_OK
    } else {
        EXIT_REJECTED
    }
}

/// `ciliate relay`'s flags (Hubble Relay's names).
#[derive(Debug, clap::Args)]
pub struct RelayArgs {
    /// An agent's Peer service: `HOST:PORT` or `unix:///path` (its `hubble.sock`).
    #[arg(long, default_value = "unix:///var/run/ciliate/hubble.sock")]
    pub peer_service: String,
    /// Where the relay serves the Observer API: `HOST:PORT`, or `:PORT` for every address.
    #[arg(long, default_value = ":4245", value_parser = crate::hubble::server::parse_listen_address)]
    pub listen_address: std::net::SocketAddr,
    /// CAs of the agents' Hubble certificates: with them the relay dials the Peer service and
    /// every agent that announces TLS with TLS (and refuses those that do not).
    #[arg(long, value_name = "FILE", value_delimiter = ',')]
    pub tls_hubble_server_ca_files: Vec<PathBuf>,
    /// The relay's client certificate, for agents that require one (PEM).
    #[arg(long, value_name = "FILE", requires_all = ["tls_client_key_file", "tls_hubble_server_ca_files"])]
    pub tls_client_cert_file: Option<PathBuf>,
    #[arg(long, value_name = "FILE", requires = "tls_client_cert_file")]
    pub tls_client_key_file: Option<PathBuf>,
    /// `text` or `json` logs.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}
