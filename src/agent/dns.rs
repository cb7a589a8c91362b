//! The agent's link to its DNS proxy (`ciliate dns-proxy`, `crate::proxy::dns`).
//!
//! - `--dns-proxy auto` starts a proxy for the state directory when none answers on its socket
//!   (a process of its own, in its own process group, so that it outlives the agent), and
//!   adopts one that does; `external` only adopts; `disabled` runs none.
//! - Once the agent is ready (every restored endpoint regenerated, so the rules table is
//!   whole), it connects, sends the endpoints' DNS rules, and again on every change.
//! - Each learning (an allowed answer's addresses) goes to `PolicyRepoActor` as `LearnFqdn`;
//!   the proxy is told `Ack` once every selecting endpoint's policy map and the ipcache hold
//!   them, and only then releases the answer to the pod.
//! - Verdicts become metrics, `dns` notifications for `ciliate monitor`, and L7 DNS flows in
//!   the flow ring (Hubble's `GetFlows`; `monitor` shows them as its `dns` events only).
//!
//! Before the agent is ready, and while it is down, the proxy serves by the rules it kept and
//! queues its learnings; they reach the agent when the link is up.

use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

use super::proxies::{supervise, Supervised};
use crate::actors::policy_repo::{LearnFqdn, PolicyRepoActor};
use crate::config::DnsProxyMode;
use crate::datapath::events::{Notification, VerdictEvent};
use crate::introspect::TracedAddr;
use crate::proxy::dns::{socket_path, DnsConn, DnsVerdict, FromProxy, Learned, ToProxy};
use crate::runtime::Shared;

const NAME: &str = "dns-proxy-link";

#[derive(Debug, Clone)]
pub struct LinkConfig {
    pub mode: DnsProxyMode,
    pub state_dir: PathBuf,
    pub bpf_root: PathBuf,
    /// The started proxy's `--max-qps-per-pod`.
    pub max_qps_per_pod: u32,
}

impl LinkConfig {
    fn mode_name(&self) -> &'static str {
        match self.mode {
            DnsProxyMode::Auto => "auto",
            DnsProxyMode::External => "external",
            DnsProxyMode::Disabled => "disabled",
        }
    }
}

/// Starts a proxy for the state directory (auto mode) unless one answers on its socket.
/// Returns the child to reap, when one was started.
pub fn start_proxy(cfg: &LinkConfig) -> std::io::Result<Option<std::process::Child>> {
    let args: Vec<std::ffi::OsString> = vec![
        "dns-proxy".into(),
        "--state-dir".into(),
        cfg.state_dir.clone().into(),
        "--bpf-root".into(),
        cfg.bpf_root.clone().into(),
        "--max-qps-per-pod".into(),
        cfg.max_qps_per_pod.to_string().into(),
    ];
    let child = super::proxies::start_detached(
        &socket_path(&cfg.state_dir),
        &cfg.state_dir.join("dns-proxy.log"),
        &args,
    )?;
    if let Some(c) = &child {
        tracing::info!(pid = c.id(), "DNS proxy started");
    }
    Ok(child)
}

/// Runs the link until the agent stops.
pub async fn run_link(shared: Shared, repo: TracedAddr<PolicyRepoActor>, cfg: LinkConfig) {
    shared.dns.update_proxy(|v| v.mode = cfg.mode_name().into());
    if cfg.mode == DnsProxyMode::Disabled {
        return;
    }
    let proxy = Supervised {
        what: "DNS proxy",
        auto: cfg.mode == DnsProxyMode::Auto,
        socket: socket_path(&cfg.state_dir),
        start: &|| start_proxy(&cfg),
        state: &*shared.dns,
    };
    supervise(&shared, proxy, |s| serve(&shared, &repo, s)).await
}

/// One connection to the proxy; returns why it ended.
async fn serve(shared: &Shared, repo: &TracedAddr<PolicyRepoActor>, s: UnixStream) -> String {
    let (rd, mut wr) = s.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<ToProxy>();
    let mut rules_changed = shared.dns.sync.changed.subscribe();
    rules_changed.borrow_and_update();
    let _ = tx.send(ToProxy::Rules(shared.dns.rules()));
    let mut lines = BufReader::new(rd).lines();
    loop {
        tokio::select! {
            out = rx.recv() => {
                let Some(m) = out else { return "closed".into() };
                let Ok(mut line) = serde_json::to_string(&m) else { continue };
                line.push('\n');
                if let Err(e) = wr.write_all(line.as_bytes()).await {
                    return format!("write: {e}");
                }
            }
            changed = rules_changed.changed() => {
                if changed.is_err() {
                    return "agent stopping".into();
                }
                rules_changed.borrow_and_update();
                let _ = tx.send(ToProxy::Rules(shared.dns.rules()));
            }
            line = lines.next_line() => {
                let line = match line {
                    Ok(Some(l)) => l,
                    Ok(None) => return "the proxy closed the connection".into(),
                    Err(e) => return format!("read: {e}"),
                };
                match serde_json::from_str::<FromProxy>(&line) {
                    Ok(m) => handle(shared, repo, &tx, m),
                    Err(e) => tracing::warn!(error = %e, "unreadable line from the DNS proxy"),
                }
            }
        }
    }
}

fn handle(
    shared: &Shared,
    repo: &TracedAddr<PolicyRepoActor>,
    tx: &mpsc::UnboundedSender<ToProxy>,
    m: FromProxy,
) {
    match m {
        FromProxy::Hello {
            pid,
            udp_port,
            tcp_port,
            acks_rules,
        } => {
            tracing::info!(pid, udp_port, tcp_port, "DNS proxy connected");
            shared.dns.sync.connected(acks_rules);
            shared.dns.update_proxy(|v| {
                v.connected = true;
                v.pid = Some(pid);
                v.udp_port = Some(udp_port);
                v.tcp_port = Some(tcp_port);
                v.error = None;
            });
        }
        FromProxy::Applied { generation } => shared.dns.sync.applied(generation),
        FromProxy::Learn(l) => learn(&shared.dns, repo, tx, l),
        FromProxy::Verdict(v) => verdict(shared, v),
    }
}

fn learn(
    dns: &std::sync::Arc<crate::proxy::dns::state::DnsState>,
    repo: &TracedAddr<PolicyRepoActor>,
    tx: &mpsc::UnboundedSender<ToProxy>,
    l: Learned,
) {
    let (done, realized) = tokio::sync::oneshot::channel();
    let (name, ips) = (l.name.clone(), l.ips.clone());
    repo.do_send(
        LearnFqdn {
            name: l.name,
            ips: l.ips,
            ttl: Duration::from_secs(l.ttl as u64),
            endpoint: u32::try_from(l.endpoint)
                .ok()
                .filter(|e| *e != 0)
                .map(|e| e as _),
            done,
        },
        NAME,
    );
    let tx = tx.clone();
    let dns = dns.clone();
    actix_rt::spawn(async move {
        // Dropped unrealized (the agent stopping): no Ack; the proxy's own timeout releases.
        if realized.await.is_ok() {
            let expires_at = dns.expiry(&name, &ips);
            let _ = tx.send(ToProxy::Ack {
                seq: l.seq,
                expires_at,
            });
        }
    });
}

fn verdict(shared: &Shared, v: DnsVerdict) {
    shared
        .metrics
        .dns_proxy_requests
        .get_or_create(&crate::metrics::VerdictOnlyLabels {
            verdict: v.fields.verdict.clone(),
        })
        .inc();
    shared
        .metrics
        .dns_proxy_processing
        .observe(v.processing_seconds);
    if let Some(conn) = v.conn {
        let server = shared
            .engine
            .read()
            .map_or(0, |e| e.identity_of_ip(conn.server.ip()));
        shared.flow_sink().consume(flow_of(&v, conn, server));
    }
    let _ = shared
        .notifications
        .send(Notification::dns(v.endpoint as u32, v.fields));
}

/// A DNS verdict as an L7 flow (`type: l7` with `dns`): egress from the pod to the server it
/// asked, `forwarded` with the answer's addresses, or `dropped` (refused); `server_identity` is
/// the server's identity.
pub fn flow_of(v: &DnsVerdict, conn: DnsConn, server_identity: u32) -> VerdictEvent {
    let refused = v.fields.verdict == "refused";
    VerdictEvent {
        kind: "l7".into(),
        timestamp_ns: crate::datapath::bpf::conntrack::monotonic_ns(),
        time: None,
        endpoint: v.endpoint as u32,
        peer_identity: server_identity,
        direction: "egress".into(),
        protocol: if conn.protocol == 6 { "TCP" } else { "UDP" }.into(),
        port: conn.server.port(),
        source_port: conn.client.port(),
        tcp_flags: 0,
        verdict: if refused { "dropped" } else { "forwarded" }.into(),
        reason: if refused { "l7-deny" } else { "l7" }.into(),
        source: conn.client.ip().to_string(),
        destination: conn.server.ip().to_string(),
        source_pod: Some(v.fields.pod.clone()),
        destination_pod: None,
        match_kind: None,
        policies: Vec::new(),
        revision: None,
        cookie: 0,
        lost: None,
        http: None,
        latency_ns: Some((v.processing_seconds * 1e9) as u64),
        dns: Some(v.fields.clone()),
        staged: None,
        labels: None,
    }
}
