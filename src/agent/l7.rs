//! The agent's link to its HTTP proxy (`ciliate http-proxy`, `crate::proxy::http`).
//!
//! - `--http-proxy auto` starts a proxy for the state directory when none answers on its
//!   socket (a process of its own that outlives the agent), and adopts one that does;
//!   `external` only adopts; `disabled` runs none (connections an L7 rule covers are then
//!   dropped: fail closed, and `status` says why).
//! - Once the agent is ready (every restored endpoint regenerated, so the table is whole), it
//!   connects, sends the table, and again on every change.
//! - Each judged request becomes an `l7` flow (`ciliate monitor --type l7`, per-rule hits,
//!   metrics).
//!
//! Before the agent is ready, and while it is down, the proxy judges by the table it kept.

use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::config::DnsProxyMode;
use crate::datapath::events::VerdictEvent;
use crate::proxy::http::{socket_path, FromProxy, L7Record, ToProxy};
use crate::runtime::{FlowSink, Shared};

#[derive(Debug, Clone)]
pub struct LinkConfig {
    pub mode: DnsProxyMode,
    pub state_dir: PathBuf,
    pub bpf_root: PathBuf,
}

/// Starts a proxy for the state directory (auto mode) unless one answers on its socket.
pub fn start_proxy(cfg: &LinkConfig) -> std::io::Result<Option<std::process::Child>> {
    let args: Vec<std::ffi::OsString> = vec![
        "http-proxy".into(),
        "--state-dir".into(),
        cfg.state_dir.clone().into(),
        "--bpf-root".into(),
        cfg.bpf_root.clone().into(),
    ];
    let child = super::proxies::start_detached(
        &socket_path(&cfg.state_dir),
        &cfg.state_dir.join("http-proxy.log"),
        &args,
    )?;
    if let Some(c) = &child {
        tracing::info!(pid = c.id(), "HTTP proxy started");
    }
    Ok(child)
}

fn mode_name(m: DnsProxyMode) -> &'static str {
    match m {
        DnsProxyMode::Auto => "auto",
        DnsProxyMode::External => "external",
        DnsProxyMode::Disabled => "disabled",
    }
}

/// Runs the link until the agent stops.
pub async fn run_link(shared: Shared, cfg: LinkConfig) {
    shared.http.update_proxy(|v| {
        v.mode = mode_name(cfg.mode).into();
        if cfg.mode == DnsProxyMode::Disabled {
            v.error = Some("--http-proxy disabled: connections L7 rules cover are dropped".into());
        }
    });
    if cfg.mode == DnsProxyMode::Disabled {
        return;
    }
    let mut child = None;
    loop {
        if cfg.mode == DnsProxyMode::Auto && child.is_none() {
            match start_proxy(&cfg) {
                Ok(c) => child = c,
                Err(e) => {
                    shared
                        .http
                        .update_proxy(|v| v.error = Some(format!("cannot start: {e}")));
                    tracing::error!(error = %e, "cannot start the HTTP proxy")
                }
            }
        }
        if let Some(c) = child.as_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                tracing::warn!(%status, "the HTTP proxy exited");
                child = None;
                continue;
            }
        }
        if shared.ready.load(std::sync::atomic::Ordering::SeqCst) {
            match UnixStream::connect(socket_path(&cfg.state_dir)).await {
                Ok(s) => {
                    let why = serve(&shared, s).await;
                    shared.http.update_proxy(|v| {
                        v.connected = false;
                        v.error = Some(why.clone());
                    });
                    tracing::warn!(reason = %why, "HTTP proxy link down");
                }
                Err(e) => shared
                    .http
                    .update_proxy(|v| v.error = Some(format!("not reachable: {e}"))),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One connection to the proxy; returns why it ended.
async fn serve(shared: &Shared, s: UnixStream) -> String {
    let (rd, mut wr) = s.into_split();
    let mut changed = shared.http.changed.subscribe();
    changed.borrow_and_update();
    let sink = shared.flow_sink();
    let mut lines = BufReader::new(rd).lines();
    let mut send = true;
    loop {
        if send {
            send = false;
            let Ok(mut line) = serde_json::to_string(&ToProxy::Table(shared.http.table())) else {
                return "the table could not be written".into();
            };
            line.push('\n');
            if let Err(e) = wr.write_all(line.as_bytes()).await {
                return format!("write: {e}");
            }
        }
        tokio::select! {
            c = changed.changed() => {
                if c.is_err() {
                    return "agent stopping".into();
                }
                changed.borrow_and_update();
                send = true;
            }
            line = lines.next_line() => {
                let line = match line {
                    Ok(Some(l)) => l,
                    Ok(None) => return "the proxy closed the connection".into(),
                    Err(e) => return format!("read: {e}"),
                };
                match serde_json::from_str::<FromProxy>(&line) {
                    Ok(m) => handle(shared, &sink, m),
                    Err(e) => tracing::warn!(error = %e, "unreadable line from the HTTP proxy"),
                }
            }
        }
    }
}

fn handle(shared: &Shared, sink: &FlowSink, m: FromProxy) {
    match m {
        FromProxy::Hello {
            pid,
            egress_port,
            ingress_port,
        } => {
            tracing::info!(pid, egress_port, ingress_port, "HTTP proxy connected");
            shared.http.update_proxy(|v| {
                v.connected = true;
                v.pid = Some(pid);
                v.egress_port = Some(egress_port);
                v.ingress_port = Some(ingress_port);
                v.error = None;
            });
        }
        FromProxy::Stats(s) => {
            shared
                .metrics
                .l7_records_dropped
                .set(s.records_dropped as i64);
            shared.http.update_proxy(|v| v.holds = Some(s));
        }
        FromProxy::Record(r) => {
            shared
                .metrics
                .l7_requests
                .get_or_create(&crate::metrics::VerdictOnlyLabels {
                    verdict: r.verdict.clone(),
                })
                .inc();
            shared
                .metrics
                .l7_proxy_latency
                .observe(r.latency_ns as f64 / 1e9);
            sink.consume(flow_of(*r));
        }
    }
}

/// A proxy record as a flow (`type: l7`).
pub fn flow_of(r: L7Record) -> VerdictEvent {
    let ip = |s: &str| {
        s.parse::<std::net::SocketAddr>()
            .map(|a| a.ip().to_string())
            .unwrap_or_else(|_| s.to_string())
    };
    VerdictEvent {
        kind: "l7".into(),
        timestamp_ns: r.time_ns,
        time: None,
        endpoint: r.endpoint as u32,
        peer_identity: r.peer_identity,
        direction: r.direction,
        protocol: "TCP".into(),
        port: r.port,
        reason: if r.verdict == "dropped" {
            "l7-deny".into()
        } else {
            "l7".into()
        },
        verdict: r.verdict,
        source: ip(&r.source),
        destination: ip(&r.destination),
        source_pod: None,
        destination_pod: None,
        match_kind: Some("l7".into()),
        policies: r.policies,
        revision: None,
        cookie: 0,
        lost: None,
        http: Some(r.http),
        latency_ns: Some(r.latency_ns),
    }
}
