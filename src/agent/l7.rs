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

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use super::proxies::{supervise, Supervised};
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
    let proxy = Supervised {
        what: "HTTP proxy",
        auto: cfg.mode == DnsProxyMode::Auto,
        socket: socket_path(&cfg.state_dir),
        start: &|| start_proxy(&cfg),
        state: &*shared.http,
    };
    supervise(&shared, proxy, |s| serve(&shared, s)).await
}

/// One connection to the proxy; returns why it ended.
async fn serve(shared: &Shared, s: UnixStream) -> String {
    let (rd, mut wr) = s.into_split();
    let mut changed = shared.http.sync.changed.subscribe();
    changed.borrow_and_update();
    let sink = shared.flow_sink();
    let mut lines = BufReader::new(rd).lines();
    let mut send = true;
    loop {
        if send {
            send = false;
            let Ok(mut line) = serde_json::to_string(&ToProxy::Table(shared.http.table_to_send()))
            else {
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
            acks_tables,
        } => {
            tracing::info!(pid, egress_port, ingress_port, "HTTP proxy connected");
            shared.http.sync.connected(acks_tables);
            shared.http.update_proxy(|v| {
                v.connected = true;
                v.pid = Some(pid);
                v.egress_port = Some(egress_port);
                v.ingress_port = Some(ingress_port);
                v.error = None;
            });
        }
        FromProxy::Applied { generation } => shared.http.sync.applied(generation),
        FromProxy::Stats(s) => {
            shared.http.sync.applied(s.table_generation);
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
                    verdict: r.verdict.to_string(),
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
    // `address:port` (`[v6]:port`) -> the address, as datapath flows name it.
    let ip = |s: &str| {
        let host = s.rsplit_once(':').map_or(s, |(h, _)| h);
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        host.to_string()
    };
    VerdictEvent {
        kind: "l7".into(),
        timestamp_ns: r.time_ns,
        time: None,
        endpoint: r.endpoint as u32,
        peer_identity: r.peer_identity,
        direction: r.direction.into_owned(),
        protocol: "TCP".into(),
        port: r.port,
        // `address:port`: the client's port.
        source_port: r
            .source
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or(0),
        tcp_flags: 0,
        reason: if r.verdict == "dropped" {
            "l7-deny".into()
        } else {
            "l7".into()
        },
        verdict: r.verdict.into_owned(),
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
        dns: None,
        staged: None,
        labels: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::events::HttpFields;

    /// A record as the proxy writes it, read back as the agent reads it.
    fn read(source: &str, destination: &str) -> L7Record {
        let line = format!(
            r#"{{"record":{{"endpoint":7,"direction":"ingress","verdict":"dropped","source":"{source}","destination":"{destination}","port":8080,"peer_identity":4242,"http":{{"method":"POST","url":"http://s/admin","protocol":"HTTP/1.1","code":403}},"latency_ns":1500,"policies":[],"time_ns":9}}}}"#
        );
        match serde_json::from_str::<FromProxy>(&line).expect("a record") {
            FromProxy::Record(r) => *r,
            other => panic!("not a record: {other:?}"),
        }
    }

    #[test]
    fn a_record_becomes_an_l7_flow_naming_addresses_without_ports() {
        let f = flow_of(read("10.0.0.5:41000", "10.0.0.9:8080"));
        assert_eq!(
            (f.source.as_str(), f.destination.as_str()),
            ("10.0.0.5", "10.0.0.9")
        );
        assert_eq!((f.kind.as_str(), f.reason.as_str()), ("l7", "l7-deny"));
        assert_eq!(
            (f.verdict.as_str(), f.direction.as_str()),
            ("dropped", "ingress")
        );
        assert_eq!((f.endpoint, f.peer_identity, f.port), (7, 4242, 8080));
        assert_eq!(
            f.http,
            Some(HttpFields {
                method: "POST".into(),
                url: "http://s/admin".into(),
                protocol: "HTTP/1.1".into(),
                code: 403,
            })
        );
        let f = flow_of(read("[fd00::5]:41000", "[fd00::9]:8080"));
        assert_eq!(
            (f.source.as_str(), f.destination.as_str()),
            ("fd00::5", "fd00::9")
        );
    }

    #[test]
    fn a_record_written_by_the_proxy_reads_back_the_same() {
        let r = read("10.0.0.5:41000", "10.0.0.9:8080");
        let line = serde_json::to_string(&FromProxy::Record(Box::new(r.clone()))).unwrap();
        match serde_json::from_str::<FromProxy>(&line).unwrap() {
            FromProxy::Record(back) => assert_eq!(*back, r),
            other => panic!("not a record: {other:?}"),
        }
    }
}
