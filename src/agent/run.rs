//! `ciliate agent`: start-up in the order of the second seed (`initMaps`, `restoreOldEndpoints`,
//! node information, initial policy sync, regenerate restored endpoints, serve, ready), and a
//! clean shutdown on SIGTERM/SIGINT that leaves enforcement in place.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;

use actix::{Actor, AsyncContext};
use actix_web::web;

use super::listen::{ListenError, Listeners, SocketFile};
use crate::actors::kube_watcher::{KubeWatcherActor, RemotePods};
use crate::actors::loader::{GetIpcache, LoaderActor, SweepStrayEndpoints};
use crate::actors::policy_repo::{
    AddEndpoint, AddHostEndpoint, DeleteEndpoint, DeviceAddresses, EndpointRequest, ExpireFqdn,
    ListPodlessEndpoints, PolicyRepoActor, RestoreFqdn, RestoreNumbering, Shutdown,
};
use crate::actors::rule_reaction::RuleReactionActor;
use crate::actors::watcher::WatcherActor;
use crate::api::{debug_server, socket_server, AppState, DebugLimits};
use crate::datapath::memory::MemoryDatapath;
use crate::datapath::Datapath;
use crate::endpoint::restore;
use crate::endpoint::state::{EndpointRecord, StateDir, StateLock};
use crate::introspect::{Registry, TracedAddr};
use crate::limits::raise_fd_limit;
use crate::runtime::Shared;

pub use crate::config::{DatapathKind, Mode};

/// `ciliate agent` settings (interfaces.md section 2).
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub mode: Mode,
    pub manifests: Option<PathBuf>,
    pub kubeconfig: Option<PathBuf>,
    pub node_name: String,
    pub datapath: DatapathKind,
    pub state_dir: PathBuf,
    pub bpf_root: PathBuf,
    pub api_socket: PathBuf,
    pub debug_addr: SocketAddr,
    /// `--pod-cidr`, at most one per family.
    pub pod_cidr: Vec<ipnet::IpNet>,
    /// `--enable-ipv4`, `--enable-ipv6`: the families pods get addresses of.
    pub families: crate::ipam::Families,
    /// How often expired connection-tracking entries are removed.
    pub conntrack_gc_interval: std::time::Duration,
    /// Standalone: what the manifest directory may make the agent read and hold.
    pub manifest_limits: crate::manifests::Limits,
    /// Connections the debug server serves at once (any local user can open them).
    pub debug_max_connections: usize,
    /// Routes between nodes (interfaces.md section 8).
    pub routing: crate::network::RoutingConfig,
    /// Where socket-level service translation attaches (cgroup v2); none: not translated.
    /// `--enable-policy`, `--policy-audit-mode`.
    pub enforcement: crate::config::Enforcement,
    /// `--flow-buffer-capacity`: recent flows kept for `monitor --since`.
    pub flow_buffer_capacity: usize,
    /// `--flow-history`, `--flow-history-max`: the distinct connections kept.
    pub flow_history: crate::agent::history::HistoryConfig,
    pub cgroup_root: Option<PathBuf>,
    /// `--tofqdns-min-ttl`: addresses learned from DNS stay selected at least this long.
    pub tofqdns_min_ttl: std::time::Duration,
    /// `--tofqdns-endpoint-max-ip-per-hostname`, `--tofqdns-endpoint-max-names`,
    /// `--tofqdns-max-names`, `--tofqdns-max-deferred-connection-deletes`.
    pub tofqdns_limits: crate::policy::fqdn_bounds::CacheLimits,
    /// `--dns-proxy-max-qps-per-pod`: the started proxy's `--max-qps-per-pod`.
    pub dns_proxy_max_qps_per_pod: u32,
    /// `--dns-proxy`: start, adopt or run no DNS proxy (bpf datapath).
    pub dns_proxy: crate::config::DnsProxyMode,
    /// `--http-proxy`: start, adopt or run no HTTP proxy (bpf datapath).
    pub http_proxy: crate::config::DnsProxyMode,
    /// `--watch-pods`: other nodes' pods from every Pod, not from CiliateEndpointSlices.
    pub watch_pods: bool,
    /// Hubble's API: `--hubble-listen-address`, `--hubble-tls-*`.
    pub hubble: crate::hubble::server::HubbleConfig,
}

/// How long a debug-server connection may sit idle: the debug page polls every two seconds.
const DEBUG_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Why the agent could not start (exit status 1, one clear line).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    State(#[from] crate::endpoint::state::StateError),
    #[error(transparent)]
    Listen(#[from] ListenError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn register<A: Actor<Context = actix::Context<A>>>(
    registry: &Registry,
    name: &str,
    actor: A,
) -> TracedAddr<A> {
    let journal = registry.register(name.to_string(), leak_kind(name));
    TracedAddr::new(actor.start(), journal)
}

/// Actor kinds are a fixed set; map a name to its static kind.
fn leak_kind(name: &str) -> &'static str {
    match name.split('/').next().unwrap_or(name) {
        "WatcherActor" => "WatcherActor",
        "PolicyRepoActor" => "PolicyRepoActor",
        "RuleReactionActor" => "RuleReactionActor",
        "LoaderActor" => "LoaderActor",
        _ => "EndpointActor",
    }
}

/// Where the cluster state comes from, resolved from the configuration.
#[derive(Debug, Clone)]
enum Source {
    Manifests(PathBuf),
    Kubernetes { kubeconfig: Option<PathBuf> },
}

/// The source once connected: the manifest directory, or a client and the channel of policy
/// outcomes its status writer consumes.
enum Feed {
    Manifests(PathBuf),
    Kubernetes(
        kube::Client,
        tokio::sync::mpsc::UnboundedReceiver<crate::k8s::status::PolicyStatusEvent>,
    ),
}

/// Runs the agent until SIGTERM/SIGINT.
pub fn run(config: AgentConfig) -> Result<(), AgentError> {
    let started = std::time::Instant::now();
    let source = match config.mode {
        Mode::Kubernetes => {
            if config.kubeconfig.is_none() && !crate::k8s::client::in_cluster() {
                return Err(AgentError::Config(
                    "--mode kubernetes outside a cluster needs --kubeconfig FILE".into(),
                ));
            }
            Source::Kubernetes {
                kubeconfig: config.kubeconfig.clone(),
            }
        }
        Mode::Standalone => {
            let manifests = config.manifests.clone().ok_or_else(|| {
                AgentError::Config("--mode standalone needs --manifests DIR".into())
            })?;
            if !manifests.is_dir() {
                return Err(AgentError::Config(format!(
                    "--manifests {}: not a directory",
                    manifests.display()
                )));
            }
            Source::Manifests(manifests)
        }
    };
    if !config.families.ipv4 && !config.families.ipv6 {
        return Err(AgentError::Config(
            "--enable-ipv4=false and --enable-ipv6=false: pods need an address family".into(),
        ));
    }
    if config.routing.mode == crate::network::RoutingMode::Tunnel
        && config.routing.underlay == crate::network::UnderlayProtocol::Ipv6
        && config.families.ipv4
    {
        return Err(AgentError::Config(
            "--underlay-protocol ipv6 carries IPv6 pod traffic only: give --enable-ipv4=false (IPv4 pods over an IPv6 underlay are not supported)".into(),
        ));
    }
    let ipam = crate::ipam::NodeIpam::from_flags(&config.pod_cidr, config.families)
        .map_err(AgentError::Config)?;
    // Whatever the agent creates (state directory, endpoint records, the socket) is its own:
    // a careless `umask 000` must not make it writable by other users.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    match raise_fd_limit() {
        Ok((old, new)) if old != new => {
            tracing::info!(
                from = old,
                to = new,
                "raised the open-file limit (RLIMIT_NOFILE)"
            )
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "could not raise the open-file limit"),
    }
    // The lock first: a second agent must not touch the datapath (or the socket) of the first.
    let _lock = StateLock::acquire(&config.state_dir)?;
    let state_dir = StateDir::open(&config.state_dir)?;
    // Bound before anything runs: a taken port or an unusable socket path ends the start here,
    // with nothing to tear down. Connections wait in the kernel's queue until served.
    let listeners = Listeners::bind(&config.api_socket, &config.state_dir, config.debug_addr)?;
    let hubble = crate::hubble::server::bind(&config.state_dir, &config.hubble)
        .map_err(AgentError::Config)?;
    // The Hubble server's thread runs until the process ends: its socket goes when `run` returns.
    let _hubble_socket = SocketFile::removed_on_drop(hubble.socket.clone());
    let maps_started = std::time::Instant::now();
    let route_applier = open_route_applier(&config)?;
    let datapath: Box<dyn Datapath> = match config.datapath {
        DatapathKind::Memory => Box::new(MemoryDatapath::new()),
        DatapathKind::Bpf => Box::new(
            crate::datapath::bpf::datapath::BpfDatapath::open_for(
                &config.bpf_root,
                crate::datapath::bpf::datapath::AttachMode::Auto,
                Some(config.families.ipv6),
            )
            .map_err(|e| AgentError::Config(format!("--datapath bpf: {e}")))?,
        ),
    };
    let services = service_translation(&config)?;
    let early = vec![
        ("init", maps_started - started),
        ("maps", maps_started.elapsed()),
    ];
    let system = actix::System::new();
    system.block_on(run_async(
        config,
        source,
        datapath,
        state_dir,
        ipam,
        listeners,
        Network {
            route_applier,
            services,
            early,
            hubble,
        },
    ))
}

/// The addresses of the node's native devices (`--devices`, eBPF datapath) told to the
/// repository now, and a channel through which the route reconciler tells it of changes.
async fn initial_device_addresses(
    routing: &crate::network::RoutingConfig,
    repo: &TracedAddr<PolicyRepoActor>,
) -> tokio::sync::watch::Sender<std::collections::BTreeSet<std::net::IpAddr>> {
    let now = crate::network::native_devices(routing)
        .map(|d| crate::network::devices::host_addresses(&d))
        .unwrap_or_default();
    if !now.is_empty() {
        let addrs = now.clone();
        let _ = repo.send(DeviceAddresses { addrs }, "devices").await;
    }
    let (tx, mut rx) = tokio::sync::watch::channel(now);
    let repo = repo.clone();
    actix_rt::spawn(async move {
        while rx.changed().await.is_ok() {
            let addrs = rx.borrow_and_update().clone();
            tracing::info!(addresses = ?addrs, "the node's device addresses changed");
            let _ = repo.send(DeviceAddresses { addrs }, "devices").await;
        }
    });
    tx
}

/// The route applier of this agent (its record read from the state directory), or none when
/// routes are only computed (`--datapath memory`, or native mode without direct routes).
fn open_route_applier(
    config: &AgentConfig,
) -> Result<Option<crate::network::netlink::RouteApplier>, AgentError> {
    let r = &config.routing;
    if !r.install {
        return Ok(None);
    }
    let mark = crate::datapath::netdev::agent_mark(&config.state_dir);
    if r.mode == crate::network::RoutingMode::Native {
        match crate::network::tunnel::retire_device(&mark) {
            Ok(true) => tracing::info!(
                device = crate::network::tunnel::VXLAN_DEVICE,
                "native routing: this agent's tunnel device of an earlier run removed"
            ),
            Ok(false) => {}
            Err(e) => tracing::error!(error = %e, "the tunnel device of an earlier run is left"),
        }
    }
    let tunnel =
        (r.mode == crate::network::RoutingMode::Tunnel).then(|| (mark.clone(), pod_mtu(r)));
    crate::network::netlink::RouteApplier::open_with(&config.state_dir, tunnel)
        .map(Some)
        .map_err(|e| AgentError::Config(format!("route record: {e}")))
}

/// The MTU of pod interfaces (and of the tunnel device): the link's, less the tunnel's overhead
/// in tunnel mode.
fn pod_mtu(r: &crate::network::RoutingConfig) -> u32 {
    match r.mode {
        crate::network::RoutingMode::Native => crate::network::tunnel::LINK_MTU,
        crate::network::RoutingMode::Tunnel => {
            crate::network::tunnel::LINK_MTU - crate::network::tunnel::overhead(r.underlay)
        }
    }
}

/// Attaches socket-level service translation under `--cgroup-root` (eBPF datapath) and reads
/// back the service and backend ids the previous agent left in the pinned maps, before any
/// watcher talks to the API server (Cilium's `RestoreServices`).
fn service_translation(
    config: &AgentConfig,
) -> Result<std::sync::Arc<crate::services::ServiceLb>, AgentError> {
    use crate::services::ServiceLb;
    let lb = match (config.datapath, &config.cgroup_root) {
        (DatapathKind::Memory, _) => ServiceLb::memory(None),
        (DatapathKind::Bpf, None) => {
            tracing::warn!("no --cgroup-root: connections to ClusterIPs are not translated");
            ServiceLb::memory(Some("no --cgroup-root: not translated".into()))
        }
        (DatapathKind::Bpf, Some(cgroup)) => {
            let pins = config.bpf_root.join("ciliate");
            let maps = crate::datapath::bpf::services::attach(&pins, cgroup).map_err(|e| {
                AgentError::Config(format!("--cgroup-root {}: {e}", cgroup.display()))
            })?;
            let restored = maps.restore();
            tracing::info!(
                cgroup = %cgroup.display(),
                frontends = restored.frontends.len(),
                backends = restored.backends.len(),
                "service translation attached; services restored from the pinned maps"
            );
            ServiceLb::new(Box::new(maps), restored, None)
        }
    };
    Ok(std::sync::Arc::new(lb))
}

/// What start-up opened for cluster networking before the actors run.
struct Network {
    route_applier: Option<crate::network::netlink::RouteApplier>,
    services: std::sync::Arc<crate::services::ServiceLb>,
    /// Start-up phases timed before the runtime started (`init`, `maps`).
    early: Vec<(&'static str, std::time::Duration)>,
    /// Hubble's listeners, bound with the others.
    hubble: crate::hubble::server::Listeners,
}

/// The actors every mode shares, wired together.
#[derive(Clone)]
pub struct Core {
    pub loader: TracedAddr<LoaderActor>,
    pub reaction: TracedAddr<RuleReactionActor>,
    pub repo: TracedAddr<PolicyRepoActor>,
}

/// Starts `LoaderActor` (initMaps: the datapath first), `RuleReactionActor` and
/// `PolicyRepoActor`. Must run inside an actix system.
pub fn spawn_core(shared: &Shared, datapath: Box<dyn Datapath>) -> Core {
    let registry = &shared.registry;
    let loader = register(
        registry,
        "LoaderActor",
        LoaderActor::new(datapath, shared.clone()),
    );
    let reaction = register(
        registry,
        "RuleReactionActor",
        RuleReactionActor::new(shared.clone(), loader.clone()),
    );
    let repo = register(
        registry,
        "PolicyRepoActor",
        PolicyRepoActor::new(shared.clone(), loader.clone(), reaction.clone()),
    );
    Core {
        loader,
        reaction,
        repo,
    }
}

/// What Hubble's services read of the agent.
fn hubble_sources(
    config: &AgentConfig,
    shared: &Shared,
    listeners: &crate::hubble::server::Listeners,
) -> crate::hubble::server::Sources {
    let listen = config.hubble.listen;
    // Where this node's Observer is reached when no Node object says: the named address, else
    // the socket.
    let local_address = match listen {
        Some(a) if !a.ip().is_unspecified() => a.to_string(),
        _ => format!("unix://{}", listeners.socket.display()),
    };
    crate::hubble::server::Sources {
        node: shared.node_name.clone(),
        flows: shared.flows.clone(),
        lookup: std::sync::Arc::new(crate::hubble::server::EngineLookup {
            engine: shared.engine.clone(),
            workloads: shared.workloads.clone(),
        }),
        nodes: shared.nodes.subscribe(),
        started: std::time::Instant::now(),
        port: listen.map_or(crate::hubble::DEFAULT_PORT, |a| a.port()),
        local_address,
        tls: listeners.tls.is_some(),
    }
}

async fn run_async(
    config: AgentConfig,
    source: Source,
    datapath: Box<dyn Datapath>,
    state_dir: StateDir,
    ipam: crate::ipam::NodeIpam,
    listeners: Listeners,
    network: Network,
) -> Result<(), AgentError> {
    let Network {
        route_applier,
        services,
        early,
        hubble,
    } = network;
    let mut shared = Shared::new(&config.node_name, state_dir.clone());
    shared.services = services;
    if let Ok(mut v) = shared.routing.lock() {
        v.mode = config.routing.mode.as_str().into();
    }
    shared.enforcement = config.enforcement;
    shared.flows = std::sync::Arc::new(crate::datapath::flows::FlowRing::new(
        config.flow_buffer_capacity,
        4096,
    ));
    shared.flow_history = crate::traffic::observe::SharedHistory::new(crate::agent::history::load(
        state_dir.root(),
        config.flow_history,
    ));
    for (scope, took) in early {
        shared.bootstrap.record(scope, took, &shared.metrics);
    }
    shared.pod_mtu = pod_mtu(&config.routing);
    let mut dns = crate::proxy::dns::state::DnsState::new(config.tofqdns_min_ttl);
    dns.limits = config.tofqdns_limits;
    shared.dns = std::sync::Arc::new(dns);
    shared.dns.start_saver(state_dir.root().to_path_buf());
    let history =
        crate::agent::history::start(&shared, shared.flow_history.clone(), config.flow_history);
    // Kubernetes mode: the client first, so a bad kubeconfig fails the start at once.
    let feed = match source {
        Source::Kubernetes { kubeconfig } => {
            let (client, api_server) = crate::k8s::client::make_client(kubeconfig.as_deref())
                .await
                .map_err(|e| AgentError::Config(e.to_string()))?;
            shared.api_server = api_server;
            let (sink, status_events) = crate::k8s::status::PolicyStatusSink::channel();
            shared.policy_status = Some(sink);
            Feed::Kubernetes(client, status_events)
        }
        Source::Manifests(dir) => Feed::Manifests(dir),
    };
    let registry = shared.registry.clone();
    let datapath_name = datapath.name();
    let sink = shared.flow_sink();
    datapath
        .start_events(Box::new(move |ev| {
            sink.consume(ev);
            true
        }))
        .map_err(|e| AgentError::Config(format!("--datapath {datapath_name}: {e}")))?;
    let gc_metrics = shared.metrics.clone();
    let gc_dns = shared.dns.clone();
    let tracked = datapath
        .start_conntrack_gc(
            config.conntrack_gc_interval,
            crate::datapath::ConntrackTimeouts::default(),
            Box::new(move |stats| {
                if stats.complete {
                    gc_dns.set_live_peers(stats.started, stats.live);
                }
                gc_metrics
                    .conntrack_entries
                    .set((stats.scanned - stats.removed) as i64);
                gc_metrics.conntrack_gc_removed.inc_by(stats.removed as u64);
                if stats.removed > 0 {
                    tracing::debug!(
                        scanned = stats.scanned,
                        removed = stats.removed,
                        "conntrack GC"
                    );
                }
            }),
        )
        .map_err(|e| AgentError::Config(format!("--datapath {datapath_name}: {e}")))?;
    if tracked {
        shared.dns.track_connections();
    }
    let Core { loader, repo, .. } = spawn_core(&shared, datapath);

    let restore_started = std::time::Instant::now();
    // Identity numbers first: whatever is restored or allocated next gets the number the
    // kernel (and the DNS proxy) already knows it by.
    restore_numbering(&loader, &repo, state_dir.root()).await;
    // The names a previous run learned select again before any endpoint regenerates.
    restore_fqdn_cache(&repo, state_dir.root()).await;
    // restoreOldEndpoints: same ids, identities and IPs, before anything new is allocated.
    let mut node_ipam = ipam;
    let (records, errors) = state_dir.load_all();
    // The host endpoint is no pod: it is made again below (with its audit mode) or, with the
    // host firewall off, its record goes and the sweep takes its pins.
    let (host_records, records): (Vec<_>, Vec<_>) = records.into_iter().partition(|r| r.host);
    let host_record = host_records.into_iter().next();
    if let (Some(rec), false) = (&host_record, config.enforcement.host_firewall) {
        match state_dir.remove(rec.id) {
            Ok(()) => tracing::info!("host firewall off: the host endpoint is removed"),
            Err(e) => {
                tracing::error!(error = %e, "the host endpoint's record could not be removed")
            }
        }
    }
    // An endpoint whose record cannot be read may own a marked veth: nothing is swept then.
    let all_readable = errors.is_empty();
    for e in errors {
        tracing::error!(error = %e, "endpoint state not restored (left on disk)");
    }
    // Pods whose interface or namespace vanished while the agent was down are not restored.
    let (records, stale) = {
        let all = records.clone();
        web::block(move || restore::partition_stale(all, restore::presence))
            .await
            .unwrap_or((records, Vec::new()))
    };
    for (rec, outcome) in &stale {
        shared.metrics.restore_outcome(*outcome);
        match state_dir.remove(rec.id) {
            Ok(()) => {
                tracing::warn!(endpoint = rec.id, name = %rec.name, outcome = outcome.label(), "endpoint not restored: its pod is gone from this node; record removed, address free")
            }
            Err(e) => {
                tracing::error!(endpoint = rec.id, name = %rec.name, outcome = outcome.label(), error = %e, "endpoint not restored; its record could not be removed")
            }
        }
    }
    // Never two live endpoints with one address: a later record claiming a kept address is
    // refused, set aside for a human, and its interface reclaimed (crate::cni::recover).
    let (records, refused) = crate::endpoint::state::partition_duplicate_ips(records);
    let refused: Vec<_> = refused
        .into_iter()
        .map(|(rec, why)| {
            shared.metrics.restore_outcome(restore::Outcome::DuplicateAddress);
            match state_dir.set_aside(rec.id, &why.to_string()) {
                Ok(to) => tracing::error!(endpoint = rec.id, error = %why, kept = %to.display(), "endpoint not restored: duplicate address"),
                Err(e) => tracing::error!(endpoint = rec.id, error = %why, set_aside = %e, "endpoint not restored: duplicate address"),
            }
            rec
        })
        .collect();
    let restored = records.len();
    for rec in &records {
        // Their addresses are reserved before the API (and so the CNI plugin) is served.
        let owner = rec
            .container_id
            .clone()
            .unwrap_or_else(|| format!("endpoint:{}", rec.id));
        for ip in &rec.ips {
            match node_ipam.reserve(*ip, &owner) {
                Ok(())
                | Err(crate::ipam::IpamError::OutOfRange { .. })
                | Err(crate::ipam::IpamError::NoPool { .. }) => {}
                Err(e) => {
                    tracing::error!(endpoint = rec.id, error = %e, "restored address conflicts")
                }
            }
        }
        let req = EndpointRequest {
            name: rec.name.clone(),
            ips: rec.ips.clone(),
            interface: rec.interface.clone(),
            container_id: rec.container_id.clone(),
            netns: rec.netns.clone(),
            mac: rec.mac.clone(),
        };
        match repo
            .send(
                AddEndpoint {
                    request: req,
                    restore: Some(rec.clone()),
                },
                "restore",
            )
            .await
        {
            Ok(Ok(m)) => {
                shared.metrics.restore_outcome(restore::Outcome::Restored);
                tracing::info!(endpoint = m.id, name = %m.name, identity = ?m.identity, "endpoint restored")
            }
            Ok(Err(e)) => tracing::error!(endpoint = rec.id, error = %e, "endpoint not restored"),
            Err(e) => tracing::error!(endpoint = rec.id, error = %e, "endpoint not restored"),
        }
    }
    if config.enforcement.host_firewall {
        add_host_endpoint(&repo, host_record).await;
    }
    // The node's own addresses are `host` before any endpoint's policy is realized.
    let device_addresses = initial_device_addresses(&config.routing, &repo).await;
    // Pinned programs and policy maps of endpoints no record names (a stale record's, or a
    // crash's leftovers) go before anything is served.
    let mut keep: Vec<_> = records.iter().map(|r| r.id).collect();
    if config.enforcement.host_firewall {
        keep.push(crate::endpoint::host::HOST_ENDPOINT_ID);
    }
    if let Ok(Ok(swept)) = loader.send(SweepStrayEndpoints { keep }, "restore").await {
        for id in swept {
            shared.metrics.restore_outcome(restore::Outcome::StrayPins);
            tracing::warn!(
                endpoint = id,
                "stray pinned endpoint removed (links, policy map)"
            );
        }
    }
    // Stale records' interfaces (if any is left) are reclaimed with the refused ones.
    let refused: Vec<_> = refused
        .into_iter()
        .chain(stale.into_iter().map(|(rec, _)| rec))
        .collect();
    shared
        .bootstrap
        .record("restore", restore_started.elapsed(), &shared.metrics);
    // IPAM: CNI ADDs the previous agent did not finish are rolled back (their addresses
    // reserved until then), and orphaned veths of this agent removed, before any address is
    // handed out again.
    let ipam_started = std::time::Instant::now();
    let recovery = {
        let state_dir = state_dir.clone();
        web::block(move || {
            crate::cni::recover::recover(&state_dir, &records, &refused, all_readable)
        })
        .await
    };
    match recovery {
        Ok(reserve) => {
            for (ip, container) in reserve {
                match node_ipam.reserve(ip, &container) {
                    Ok(()) | Err(crate::ipam::IpamError::NoPool { .. }) => {}
                    Err(e) => {
                        tracing::error!(%container, error = %e, "address of an interrupted ADD not reserved")
                    }
                }
            }
        }
        Err(e) => tracing::error!(error = %e, "recovery of interrupted CNI ADDs failed"),
    }
    if let Ok(mut g) = shared.ipam.lock() {
        *g = node_ipam;
    }
    shared
        .bootstrap
        .record("ipam", ipam_started.elapsed(), &shared.metrics);
    if restored > 0 {
        tracing::info!(
            restored,
            "endpoints restored from {}",
            state_dir.root().display()
        );
    }
    let api_started = std::time::Instant::now();

    // The servers, on the listeners bound before: nothing here fails in practice, but if it
    // does, the actors are stopped as on SIGTERM before the error ends the start.
    let state = AppState {
        shared: shared.clone(),
        repo: repo.clone(),
        loader: loader.clone(),
        mode: match feed {
            Feed::Manifests(_) => "standalone",
            Feed::Kubernetes(..) => "kubernetes",
        },
        datapath: datapath_name,
        started: Instant::now(),
    };
    let Listeners { api, debug, socket } = listeners;
    let data = web::Data::new(state);
    let limits = DebugLimits {
        max_connections: config.debug_max_connections,
        idle_timeout: DEBUG_IDLE_TIMEOUT,
    };
    let sweep_state = data.clone();
    let servers = socket_server(api, data.clone())
        .and_then(|api| debug_server(debug, data, limits).map(|debug| (api, debug)));
    let servers = servers.and_then(|s| {
        let sources = hubble_sources(&config, &shared, &hubble);
        crate::hubble::server::spawn(crate::hubble::server::Hubble::new(sources), hubble)
            .map(|()| s)
    });
    let (socket_server, debug_server) = match servers {
        Ok(s) => s,
        Err(e) => {
            let _ = repo.send(Shutdown, "start-up failure").await;
            return Err(AgentError::Io {
                what: format!(
                    "serve on {} (or the debug or Hubble listeners)",
                    socket.path().display()
                ),
                source: e,
            });
        }
    };

    shared
        .bootstrap
        .record("api", api_started.elapsed(), &shared.metrics);
    // The initial policy sync; restored endpoints regenerate when it is done.
    shared.bootstrap.sync_started();
    let watcher_journal = registry.register("WatcherActor".into(), "WatcherActor");
    match feed {
        Feed::Manifests(dir) => {
            let repo_for_watcher = repo.clone();
            let limits = config.manifest_limits;
            let services = shared.services.clone();
            let registry = shared.registry.clone();
            WatcherActor::create(move |ctx| {
                WatcherActor::new(dir, limits, repo_for_watcher)
                    .with_services(services)
                    .with_changes(registry)
                    .with_self(TracedAddr::new(ctx.address(), watcher_journal))
            });
        }
        Feed::Kubernetes(client, status_events) => {
            actix_rt::spawn(crate::k8s::status::run_status_writer(
                client.clone(),
                config.node_name.clone(),
                status_events,
                crate::k8s::status::WriterOptions::default(),
                shared.metrics.clone(),
            ));
            let (annotations, wanted) = tokio::sync::watch::channel(Default::default());
            actix_rt::spawn(crate::k8s::node::run_node_annotator(
                client.clone(),
                config.node_name.clone(),
                wanted,
            ));
            // This node's endpoint slices, whichever way this agent learns of the others'.
            let (slice_changes, slice_rx) = tokio::sync::mpsc::unbounded_channel();
            actix_rt::spawn(crate::k8s::slice_writer::run_slice_writer(
                client.clone(),
                config.node_name.clone(),
                slice_rx,
                shared.pod_source.clone(),
            ));
            let remote_pods = if config.watch_pods {
                RemotePods::Pods
            } else {
                RemotePods::EndpointSlices
            };
            let repo_for_watcher = repo.clone();
            let shared_for_watcher = shared.clone();
            KubeWatcherActor::create(move |ctx| {
                KubeWatcherActor::new(client, shared_for_watcher, repo_for_watcher, annotations)
                    .with_remote_pods(remote_pods, Some(slice_changes))
                    .with_self(TracedAddr::new(ctx.address(), watcher_journal))
            });
        }
    }

    if sweep_state.mode == "kubernetes" {
        actix_rt::spawn(sweep_podless_endpoints(sweep_state));
    }
    actix_rt::spawn(crate::network::run_route_reconciler(
        config.node_name.clone(),
        config.routing.clone(),
        route_applier,
        crate::network::Masquerader::new(&config.state_dir, shared.ipam.clone()),
        crate::network::ReconcilerIo {
            nodes: shared.nodes.subscribe(),
            ready: shared.ready.clone(),
            view: shared.routing.clone(),
            device_addresses,
        },
    ));

    let (socket_handle, debug_handle) = (socket_server.handle(), debug_server.handle());
    actix_rt::spawn(expire_fqdn(repo.clone()));
    if config.datapath == DatapathKind::Bpf {
        actix_rt::spawn(crate::agent::dns::run_link(
            shared.clone(),
            repo.clone(),
            crate::agent::dns::LinkConfig {
                mode: config.dns_proxy,
                state_dir: config.state_dir.clone(),
                bpf_root: config.bpf_root.clone(),
                max_qps_per_pod: config.dns_proxy_max_qps_per_pod,
            },
        ));
        actix_rt::spawn(crate::agent::l7::run_link(
            shared.clone(),
            crate::agent::l7::LinkConfig {
                mode: config.http_proxy,
                state_dir: config.state_dir.clone(),
                bpf_root: config.bpf_root.clone(),
            },
        ));
    }
    actix_rt::spawn(socket_server);
    actix_rt::spawn(debug_server);
    tracing::info!(
        node = %config.node_name,
        socket = %socket.path().display(),
        debug = %config.debug_addr,
        datapath = datapath_name,
        "agent running"
    );

    wait_for_signal().await;
    tracing::info!("shutting down; enforcement stays in place");
    let _ = repo.send(Shutdown, "signal").await;
    if let Some(h) = &history {
        h.save_now();
    }
    socket_handle.stop(true).await;
    debug_handle.stop(true).await;
    drop(socket);
    actix::System::current().stop();
    Ok(())
}

/// Kubernetes mode: once the initial sync is done, endpoints whose pod was deleted while the
/// agent was down (its CNI DEL could not reach the agent) are removed as a CNI DEL would remove
/// them: endpoint, programs and policy map, host veth, address.
/// Loads the saved FQDN cache into the policy (an unreadable file is reported and set aside:
/// names are learned again from the next answers).
/// Start-up: the identity numbers a previous run used, from its journal and the kernel's
/// ipcache (`policy::numbering`).
async fn restore_numbering(
    loader: &TracedAddr<LoaderActor>,
    repo: &TracedAddr<PolicyRepoActor>,
    state_dir: &std::path::Path,
) {
    let (journal, loaded) = crate::endpoint::numbering::NumberJournal::open(state_dir);
    let path = journal.path().display().to_string();
    if let Some(e) = &loaded.error {
        tracing::error!(%path, error = %e, "identity journal unreadable: numbers the kernel holds are still never reused, but label sets may get new ones");
    }
    for why in &loaded.skipped {
        tracing::warn!(%path, %why, "identity journal line skipped");
    }
    let kernel = match loader.send(GetIpcache, "restore").await {
        Ok(Ok(entries)) => entries,
        Ok(Err(e)) => {
            tracing::error!(error = %e, "the kernel's ipcache could not be read");
            Vec::new()
        }
        Err(e) => {
            tracing::error!(error = %e, "the kernel's ipcache could not be read");
            Vec::new()
        }
    };
    let records = loaded.records;
    match repo
        .send(
            RestoreNumbering {
                journal,
                records,
                kernel,
            },
            "restore",
        )
        .await
    {
        Ok(Ok(c)) => tracing::info!(
            label_sets = c.label_sets,
            prefixes = c.prefixes,
            unknown = c.unknown,
            "identity numbers restored"
        ),
        Ok(Err(never)) => match never {},
        Err(e) => tracing::error!(error = %e, "identity numbers not restored"),
    }
}

async fn restore_fqdn_cache(repo: &TracedAddr<PolicyRepoActor>, state_dir: &std::path::Path) {
    let cache = match crate::proxy::dns::state::DnsState::load(state_dir) {
        Ok(c) => c,
        Err(e) => {
            let path = crate::proxy::dns::state::cache_path(state_dir);
            let _ = std::fs::rename(&path, path.with_extension("json.unreadable"));
            tracing::error!(error = %e, "FQDN cache not restored (kept as fqdn-cache.json.unreadable)");
            return;
        }
    };
    match repo.send(RestoreFqdn { cache }, "restore").await {
        Ok(n) if n > 0 => tracing::info!(names = n, "FQDN cache restored"),
        Ok(_) => {}
        Err(e) => tracing::error!(error = %e, "FQDN cache not restored"),
    }
}

/// Expires learned DNS addresses once a second.
async fn expire_fqdn(repo: TracedAddr<PolicyRepoActor>) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tick.tick().await;
        let now = crate::policy::fqdn::unix_now();
        if repo.send(ExpireFqdn { now }, "fqdn-gc").await.is_err() {
            return;
        }
    }
}

async fn sweep_podless_endpoints(st: web::Data<AppState>) {
    while !st.shared.ready.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let Ok(Ok(podless)) = st.repo.send(ListPodlessEndpoints, "restore").await else {
        return;
    };
    for (id, name, container) in podless {
        let removed = match &container {
            Some(c) => crate::api::remove_container(&st, c)
                .await
                .map(drop)
                .map_err(|r| format!("HTTP {}", r.status())),
            None => match st.repo.send(DeleteEndpoint { id }, "restore").await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            },
        };
        match removed {
            Ok(()) => {
                st.shared.metrics.restore_outcome(restore::Outcome::PodGone);
                tracing::warn!(endpoint = id, %name, "endpoint removed: its pod no longer exists");
            }
            Err(e) => {
                tracing::error!(endpoint = id, %name, error = %e, "endpoint of a deleted pod not removed")
            }
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {},
                _ = int.recv() => {},
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// `--enable-host-firewall`: the node's own endpoint, made before anything is served (its
/// pinned policy map, if a previous run left one, keeps enforcing until it regenerates).
async fn add_host_endpoint(repo: &TracedAddr<PolicyRepoActor>, restore: Option<EndpointRecord>) {
    match repo.send(AddHostEndpoint { restore }, "restore").await {
        Ok(Ok(m)) => {
            tracing::info!(endpoint = m.id, labels = ?m.labels, "host firewall on: host endpoint")
        }
        Ok(Err(e)) => tracing::error!(error = %e, "host endpoint not created"),
        Err(e) => tracing::error!(error = %e, "host endpoint not created"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::actors::endpoint::GetEndpoint;
    use crate::actors::loader::SweepCookies;
    use crate::actors::policy_repo::{
        InitialSyncDone, ListEndpoints, PodUpsert, PolicyDelete, PolicyUpsert,
    };
    use crate::datapath::memory::MemoryDatapath;
    use crate::endpoint::state::StateDir;
    use crate::objects::PodInfo;
    use crate::policy::attribution::{isolation_cookie, MatchKind};
    use crate::policy::rule::{PolicyKey, PolicyKind};

    fn pod(name: &str, app: &str, ip: &str, node: &str) -> PodInfo {
        PodInfo {
            namespace: "ns".into(),
            name: name.into(),
            labels: Arc::new([("app".to_string(), app.to_string())].into()),
            ips: vec![ip.parse().unwrap()],
            node: Some(node.into()),
            service_account: "default".into(),
            named_ports: vec![],
            workload: None,
        }
    }

    /// A policy of its own name each step, as a controller that names policies after a
    /// release would write.
    fn churn(i: usize) -> crate::policy::translate::ParsedPolicy {
        let yaml = format!(
            "{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: churn-{i}, namespace: ns}}, spec: {{endpointSelector: {{matchLabels: {{app: server}}}}, ingress: [{{fromEndpoints: [{{matchLabels: {{app: client}}}}], toPorts: [{{ports: [{{port: '{}', protocol: TCP}}]}}]}}]}}}}",
            8000 + i
        );
        let doc: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
        crate::policy::translate::parse_policy(&doc, "ns", "test").unwrap()
    }

    fn key(i: usize) -> Arc<PolicyKey> {
        let name = format!("churn-{i}");
        Arc::new(PolicyKey::new(
            PolicyKind::CiliumNetworkPolicy,
            Some("ns"),
            &name,
        ))
    }

    async fn realized(core: &Core, rev: u64) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let eps = core
            .repo
            .send(ListEndpoints, "test")
            .await
            .unwrap()
            .unwrap();
        for (_, a) in eps {
            while a
                .send(GetEndpoint, "test")
                .await
                .unwrap()
                .unwrap()
                .policy_revision
                < rev
            {
                assert!(Instant::now() < deadline, "revision {rev} not realized");
                actix_rt::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }

    /// Through the actors, on the in-memory datapath: policies renamed again and again leave
    /// the cookie jar bounded (what no map holds goes at its second sweep), and what the maps
    /// hold stays resolvable all along; the deleted policies' hits go too.
    #[test]
    fn renamed_policies_leave_the_cookie_jar_and_the_hits_bounded() {
        actix::System::new().block_on(async {
            let tmp = tempfile::tempdir().unwrap();
            let shared = Shared::new("node-1", StateDir::open(&tmp.path().join("s")).unwrap());
            let core = spawn_core(&shared, Box::new(MemoryDatapath::new()));
            let server = pod("server", "server", "10.1.0.2", "node-1");
            let client = pod("client", "client", "10.2.0.2", "node-2");
            core.repo.do_send(PodUpsert { pod: client }, "test");
            core.repo.do_send(
                PodUpsert {
                    pod: server.clone(),
                },
                "test",
            );
            core.repo.send(InitialSyncDone, "test").await.unwrap();
            let request = EndpointRequest {
                name: server.key().to_string(),
                ips: server.ips.clone(),
                interface: None,
                container_id: None,
                netns: None,
                mac: None,
            };
            let add = AddEndpoint {
                request,
                restore: None,
            };
            core.repo.send(add, "test").await.unwrap().unwrap();
            let sweep = || core.loader.send(SweepCookies { force: true }, "test");
            let mut most = 0;
            for i in 0..12 {
                let upsert = PolicyUpsert {
                    policy: churn(i),
                    source: "test".into(),
                };
                let mut rev = core.repo.send(upsert, "test").await.unwrap().unwrap();
                if i > 0 {
                    let delete = PolicyDelete {
                        key: (*key(i - 1)).clone(),
                    };
                    rev = core.repo.send(delete, "test").await.unwrap().unwrap();
                }
                realized(&core, rev).await;
                // A verdict of the policy in force, and a late one of the policy just deleted.
                let (_, refs) = isolation_cookie(&[key(i), key(i.saturating_sub(1))]);
                shared.policy_hits.record(&refs, "dropped");
                // And what it would have given staged (a series per policy and verdict).
                let staged = &shared.staged_counters;
                staged.inc(&shared.metrics, &key(i), true);
                staged.inc(&shared.metrics, &key(i.saturating_sub(1)), false);
                let swept = sweep().await.unwrap().expect("forced");
                assert_eq!(swept.unknown, 0, "step {i}: every cookie in use resolves");
                most = most.max(shared.cookies.len());
            }
            // Each step made two cookies (the rule's, the isolation's): 25 without sweeps.
            // Kept: the three in use, and those missed at one sweep only.
            assert!(most <= 7, "the jar held {most} cookies at most");
            let (now, _) = isolation_cookie(&[key(11)]);
            let a = shared
                .cookies
                .resolve(now)
                .expect("the isolation in force resolves");
            assert_eq!(a.policies[0].name, "churn-11");
            for old in [0, 5, 9] {
                let (c, _) = isolation_cookie(&[key(old)]);
                assert!(shared.cookies.resolve(c).is_none(), "churn-{old} was swept");
            }
            assert_eq!(
                shared.policy_hits.len(),
                1,
                "the deleted policies' hits went"
            );
            let hits = shared
                .policy_hits
                .get("CiliumNetworkPolicy", Some("ns"), "churn-11");
            assert_eq!(hits.dropped, 1);
            let series: Vec<String> = shared
                .metrics
                .encode()
                .lines()
                .filter(|l| l.starts_with("ciliate_policy_staged_verdicts_total{"))
                .map(|l| l.rsplit_once(' ').expect("a sample").0.to_string())
                .collect();
            let mine = r#"policy="CiliumNetworkPolicy ns/churn-11""#;
            assert_eq!(
                series,
                [format!(
                    r#"ciliate_policy_staged_verdicts_total{{{mine},verdict="dropped"}}"#
                )],
                "the deleted policies' staged series went"
            );
            let (last, _) = isolation_cookie(&[key(10)]);
            assert!(shared.cookies.resolve(last).is_some(), "missed once: kept");
            let swept = sweep().await.unwrap().expect("forced");
            assert!(
                shared.cookies.resolve(last).is_none(),
                "missed twice: {swept:?}"
            );
            let mut kept: Vec<String> = shared
                .cookies
                .attributions()
                .iter()
                .map(|(_, a)| {
                    let names: Vec<&str> = a.policies.iter().map(|p| p.name.as_str()).collect();
                    format!("{} {}", a.match_kind.as_str(), names.join(","))
                })
                .collect();
            kept.sort();
            // The isolation's, the rule's, and the host's implicit allow (no policy).
            assert_eq!(
                kept,
                ["default-deny churn-11", "l3-l4 churn-11", "l3-only "]
            );
            // Unforced, a sweep waits for the jar to double and for the agent to be ready
            // (restored endpoints' flags hold the previous run's cookies until then).
            let big = vec![a.policies[0].clone(); crate::policy::attribution::SWEEP_SLACK_REFS + 8];
            shared.cookies.register(1, MatchKind::L3Only, big, 99);
            let unforced = || core.loader.send(SweepCookies { force: false }, "test");
            let ready = &shared.ready;
            ready.store(false, std::sync::atomic::Ordering::SeqCst);
            assert_eq!(unforced().await.unwrap(), None, "not ready");
            ready.store(true, std::sync::atomic::Ordering::SeqCst);
            assert!(
                unforced().await.unwrap().is_some(),
                "ready, and the jar doubled"
            );
            assert_eq!(
                unforced().await.unwrap(),
                None,
                "what is kept does not count"
            );
        });
    }
}
