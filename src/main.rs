use clap::Parser;

/// mimalloc for every ciliate process (`ciliate::memory` says why and how it is set up).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's options, set before anything allocates.
#[used]
#[link_section = ".init_array"]
static CONFIGURE_ALLOCATOR: extern "C" fn() = ciliate::memory::configure_allocator;

use ciliate::agent::run::{run, AgentConfig, Mode};
use ciliate::cli::commands::ClientCall;
use ciliate::cli::{
    run_client, run_simulate, AgentArgs, Cli, ClientOpts, Command, LogFormat, PolicyCommand,
};
use ciliate::datapath::events::FlowFilter;
use ciliate::simulate::generate::{generate_world, WorldSize};

/// kube's client logs every failed request at ERROR, which floods the log while the API server
/// is unreachable; the watchers report the same failure once per resource and half minute.
/// Unless `RUST_LOG` says otherwise about it, that logger is silenced.
const QUIET_KUBE_CLIENT: &str = "kube_client::client::builder=off";

fn init_logging(format: LogFormat) {
    let spec = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    let spec = if spec.contains("kube_client") {
        spec
    } else {
        format!("{spec},{QUIET_KUBE_CLIENT}")
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&spec)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => b.json().init(),
        LogFormat::Text => b.init(),
    }
}

fn agent(args: AgentArgs) -> i32 {
    init_logging(args.log_format);
    let mode = args.mode.unwrap_or(
        if args.kubeconfig.is_some() || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            Mode::Kubernetes
        } else {
            Mode::Standalone
        },
    );
    let node_name = args.node_name.unwrap_or_else(|| {
        nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "localhost".into())
    });
    let bpf_host_routing = (args.datapath == ciliate::config::DatapathKind::Bpf
        && !args.enable_host_legacy_routing)
        .then(|| args.bpf_root.join("ciliate"));
    let bpf_pins = (args.datapath == ciliate::config::DatapathKind::Bpf)
        .then(|| args.bpf_root.join("ciliate"));
    let devices = match ciliate::network::devices::DeviceSelector::parse(&args.devices) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let config = AgentConfig {
        mode,
        manifests: args.manifests,
        kubeconfig: args.kubeconfig,
        node_name,
        datapath: args.datapath,
        state_dir: args.state_dir,
        bpf_root: args.bpf_root,
        api_socket: args.api_socket,
        debug_addr: args.debug_addr,
        pod_cidr: args.pod_cidr,
        families: ciliate::ipam::Families {
            ipv4: args.enable_ipv4,
            ipv6: args.enable_ipv6,
        },
        conntrack_gc_interval: std::time::Duration::from_secs(args.conntrack_gc_interval),
        manifest_limits: ciliate::manifests::Limits {
            max_file_bytes: args.manifest_max_file_bytes,
            max_documents: usize::try_from(args.manifest_max_documents).unwrap_or(usize::MAX),
            ..Default::default()
        },
        debug_max_connections: args.debug_max_connections as usize,
        routing: ciliate::network::RoutingConfig {
            mode: args.routing_mode,
            tunnel_protocol: args.tunnel_protocol,
            underlay: args.underlay_protocol,
            auto_direct_node_routes: args.auto_direct_node_routes,
            native_routing_cidr: args.ipv4_native_routing_cidr.map(|n| n.trunc()),
            ipv4: args.enable_ipv4,
            ipv6: args.enable_ipv6,
            ipv6_native_routing_cidr: args.ipv6_native_routing_cidr.map(|n| n.trunc()),
            install: args.datapath == ciliate::config::DatapathKind::Bpf,
            masquerade: args.enable_ipv4 && args.enable_ipv4_masquerade,
            masquerade6: args.enable_ipv6 && args.enable_ipv6_masquerade,
            bpf_host_routing,
            bpf_pins,
            host_firewall: args.enable_host_firewall,
            devices,
        },
        cgroup_root: args.cgroup_root,
        enforcement: ciliate::config::Enforcement {
            mode: args.enable_policy,
            audit: args.policy_audit_mode,
            host_firewall: args.enable_host_firewall,
        },
        flow_buffer_capacity: args.flow_buffer_capacity,
        flow_history: ciliate::agent::history::HistoryConfig {
            keep: args.flow_history,
            max: args.flow_history_max.max(1),
        },
        tofqdns_min_ttl: std::time::Duration::from_secs(args.tofqdns_min_ttl),
        tofqdns_limits: ciliate::policy::fqdn_bounds::CacheLimits {
            max_ips_per_name: args.tofqdns_endpoint_max_ip_per_hostname.max(1),
            max_names_per_endpoint: args.tofqdns_endpoint_max_names.max(1),
            max_names: args.tofqdns_max_names.max(1),
            max_zombies: args.tofqdns_max_deferred_connection_deletes,
        },
        dns_proxy: args.dns_proxy,
        dns_proxy_max_qps_per_pod: args.dns_proxy_max_qps_per_pod,
        http_proxy: args.http_proxy,
        watch_pods: args.watch_pods,
        hubble: ciliate::hubble::server::HubbleConfig {
            listen: args.hubble_listen_address,
            tls: args
                .hubble_tls_cert_file
                .map(|cert| ciliate::hubble::server::TlsFiles {
                    cert,
                    key: args.hubble_tls_key_file.unwrap_or_default(),
                    client_cas: args.hubble_tls_client_ca_files,
                }),
        },
    };
    match run(config) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn client(opts: &ClientOpts, call: ClientCall) -> i32 {
    match run_client(opts, call) {
        Ok(out) => {
            print!("{out}");
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn monitor(opts: &ClientOpts, count: Option<u64>, since: Option<&str>, filter: &FlowFilter) -> i32 {
    use std::io::Write;
    let path = match monitor_path(since, filter) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let mut seen = 0u64;
    let stdout = std::io::stdout();
    let r = ciliate::client::stream_lines(&opts.socket, &path, |line| {
        let kind = serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_string));
        let (shown, table) = match kind.as_deref() {
            Some("flow" | "lost") | None => {
                let ev = serde_json::from_str::<ciliate::datapath::events::VerdictEvent>(line).ok();
                (
                    ev.as_ref().is_none_or(|e| filter.accepts(e)),
                    ev.map(|e| e.line()),
                )
            }
            Some(other) => (
                filter.accepts_other(other),
                serde_json::from_str::<ciliate::datapath::events::Notification>(line)
                    .ok()
                    .map(|n| n.line()),
            ),
        };
        if !shown {
            return true;
        }
        let text = match (&opts.output, table) {
            (ciliate::cli::Output::Table, Some(t)) => t,
            _ => line.to_string(),
        };
        let mut out = stdout.lock();
        if writeln!(out, "{text}").and_then(|_| out.flush()).is_err() {
            return false;
        }
        seen += 1;
        count.is_none_or(|c| seen < c)
    });
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// `/v1/monitor` with the filters (and `--since` as a point in time) as its query.
fn monitor_path(since: Option<&str>, filter: &FlowFilter) -> Result<String, String> {
    let mut query = serde_urlencoded::to_string(filter).map_err(|e| e.to_string())?;
    if let Some(since) = since {
        let from =
            ciliate::datapath::flows::since_to_ms(since, ciliate::datapath::flows::unix_now_ms())?;
        if !query.is_empty() {
            query.push('&');
        }
        query.push_str(&format!("since_ms={from}"));
    }
    Ok(if query.is_empty() {
        "/v1/monitor".into()
    } else {
        format!("/v1/monitor?{query}")
    })
}

/// `ciliate-cni`: the same binary, called by a container runtime as a CNI plugin.
fn cni_plugin() -> i32 {
    use std::io::Read;
    let env = std::env::vars().collect();
    let mut stdin = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut stdin) {
        eprintln!("error: reading the network configuration from stdin: {e}");
    }
    let stdout = std::io::stdout();
    ciliate::cni::run_plugin(&env, &stdin, &mut stdout.lock())
}

/// `ciliate dns-proxy`: serves until SIGTERM, or until its state directory or maps vanish.
fn dns_proxy(args: ciliate::cli::DnsProxyArgs) -> i32 {
    init_logging(args.log_format);
    match ciliate::proxy::dns::server::run(ciliate::proxy::dns::server::ProxyOptions {
        pins: args.bpf_root.join("ciliate"),
        state_dir: args.state_dir,
        udp_port: args.udp_port,
        tcp_port: args.tcp_port,
        learn_timeout: std::time::Duration::from_millis(args.learn_timeout_ms),
        source_limits: ciliate::proxy::dns::limit::SourceLimits {
            rate: args.max_qps_per_pod,
            ..Default::default()
        },
    }) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// `ciliate relay`: serves until stopped.
fn relay(args: ciliate::cli::RelayArgs) -> i32 {
    init_logging(args.log_format);
    let cfg = ciliate::hubble::relay::RelayConfig {
        peer_service: args.peer_service,
        listen: args.listen_address,
        tls: (!args.tls_hubble_server_ca_files.is_empty()).then(|| {
            ciliate::hubble::relay::PeerTls {
                server_cas: args.tls_hubble_server_ca_files,
                client: args.tls_client_cert_file.zip(args.tls_client_key_file),
            }
        }),
    };
    match ciliate::hubble::relay::run(cfg) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// `ciliate http-proxy`: serves until SIGTERM or a successor, or until its state directory or
/// maps vanish.
fn http_proxy(args: ciliate::cli::HttpProxyArgs) -> i32 {
    init_logging(args.log_format);
    match ciliate::proxy::http::server::run(ciliate::proxy::http::server::ProxyOptions {
        pins: args.bpf_root.join("ciliate"),
        state_dir: args.state_dir,
        egress_port: args.egress_port,
        ingress_port: args.ingress_port,
        drain_timeout: std::time::Duration::from_secs(args.drain_timeout_secs),
    }) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn main() {
    let invoked_as = std::env::args_os().next().unwrap_or_default();
    if std::path::Path::new(&invoked_as)
        .file_name()
        .is_some_and(|n| n.to_string_lossy().ends_with("ciliate-cni"))
    {
        std::process::exit(cni_plugin());
    }
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Agent(args) => agent(*args),
        Command::Policy {
            command: PolicyCommand::Simulate { world },
        } => {
            let stdout = std::io::stdout();
            let stderr = std::io::stderr();
            run_simulate(&world, &mut stdout.lock(), &mut stderr.lock())
        }
        Command::Policy {
            command:
                PolicyCommand::GenerateWorld {
                    namespaces,
                    pods,
                    policies,
                    probes,
                    seed,
                },
        } => {
            print!(
                "{}",
                generate_world(
                    WorldSize {
                        namespaces,
                        pods,
                        policies,
                        probes
                    },
                    seed
                )
            );
            0
        }
        Command::Policy {
            command: PolicyCommand::Get { client: c },
        } => client(&c, ClientCall::PolicyGet),
        Command::Policy {
            command: PolicyCommand::Diff(a),
        } => ciliate::cli::traffic::run_diff(
            &a,
            &mut std::io::stdout().lock(),
            &mut std::io::stderr().lock(),
        ),
        Command::Policy {
            command: PolicyCommand::Recommend(a),
        } => ciliate::cli::traffic::run_recommend(
            &a,
            &mut std::io::stdout().lock(),
            &mut std::io::stderr().lock(),
        ),
        Command::Status { client: c } => client(&c, ClientCall::Status),
        Command::Endpoint { command, client: c } => client(&c, ClientCall::Endpoint(&command)),
        Command::Identity { command, client: c } => client(&c, ClientCall::Identity(&command)),
        Command::Node {
            command: ciliate::cli::NodeCommand::List,
            client: c,
        } => client(&c, ClientCall::NodeList),
        Command::Service {
            command: ciliate::cli::ServiceCommand::List,
            client: c,
        } => client(&c, ClientCall::ServiceList),
        Command::Bpf { command, client: c } => client(&c, ClientCall::Bpf(&command)),
        Command::Fqdn {
            command:
                ciliate::cli::FqdnCommand::Cache {
                    command: ciliate::cli::FqdnCacheCommand::List,
                },
            client: c,
        } => client(&c, ClientCall::FqdnCacheList),
        Command::DnsProxy(args) => dns_proxy(args),
        Command::Relay(args) => relay(args),
        Command::HttpProxy(args) => http_proxy(args),
        Command::Monitor {
            count,
            since,
            filter,
            client: c,
        } => monitor(&c, count, since.as_deref(), &filter),
        Command::Demo {
            once,
            no_policies,
            debug_addr,
            pod_cidr,
        } => ciliate::demo::run(ciliate::demo::DemoConfig {
            once,
            no_policies,
            debug_addr,
            pod_cidr,
        }),
    };
    std::process::exit(code);
}
