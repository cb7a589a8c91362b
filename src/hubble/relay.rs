//! `ciliate relay` (Hubble Relay's role): the Observer API for the whole cluster. It learns the
//! agents from one agent's Peer service (`--peer-service`), keeps a connection to each, and
//! answers every Observer call by asking all of them:
//! - `GetFlows`: every node's flows, ordered by time (history: sorted whole; following: sorted
//!   within each 100 ms window), preceded by node status events (`NODE_CONNECTED`,
//!   `NODE_UNAVAILABLE`). A following stream survives an agent that goes away: it is reported
//!   unavailable, retried every second, and on its return followed again from the millisecond
//!   of the last flow received from it (the flows of that millisecond already forwarded are
//!   not forwarded again), so the flows it kept meanwhile are neither lost nor repeated;
//! - `ServerStatus`: the sums over the connected nodes, and which ones are unavailable;
//! - `GetNodes`: every known node with its state; `GetNamespaces`: the union.
//!
//! Trust: the relay believes the Peer service about which nodes exist and where their Observers
//! listen; it forwards what each Observer says, naming the node it came from. It holds no state
//! a client can grow: each request's streams end with the request.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use super::proto::{observer as opb, peer as ppb, relay as rpb};

/// How long one node may take to answer a unary call or to start a stream.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a lost peer or Peer service waits before it is tried again.
const RETRY: Duration = Duration::from_secs(1);
/// The HTTP/2 receive window the relay gives each stream and connection to an agent: a node's
/// history (thousands of flows) flows without waiting on window updates every 64 KiB.
pub const WINDOW_BYTES: u32 = 4 << 20;
/// Followed flows are sorted by time within windows of this length.
const WINDOW: Duration = Duration::from_millis(100);

/// `ciliate relay`'s settings (Hubble Relay's flag names).
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// `--peer-service`: `HOST:PORT` or `unix:///path`.
    pub peer_service: String,
    /// `--listen-address`.
    pub listen: SocketAddr,
    /// TLS toward the agents (Hubble Relay's `--tls-hubble-server-ca-files`,
    /// `--tls-client-cert-file`, `--tls-client-key-file`); none: plain text.
    pub tls: Option<PeerTls>,
}

/// The CAs the agents' certificates must chain to, and the relay's client certificate (for
/// agents that require one).
#[derive(Debug, Clone)]
pub struct PeerTls {
    pub server_cas: Vec<std::path::PathBuf>,
    pub client: Option<(std::path::PathBuf, std::path::PathBuf)>,
}

/// `PeerTls` read from its files: a TLS configuration per server name.
#[derive(Clone)]
pub struct ClientTls {
    ca: tonic::transport::Certificate,
    identity: Option<tonic::transport::Identity>,
}

impl ClientTls {
    pub fn load(t: &PeerTls) -> Result<ClientTls, String> {
        let read = |flag: &str, p: &std::path::Path| {
            std::fs::read(p).map_err(|e| format!("{flag} {}: {e}", p.display()))
        };
        let mut pem = Vec::new();
        for ca in &t.server_cas {
            pem.extend(read("--tls-hubble-server-ca-files", ca)?);
            pem.push(b'\n');
        }
        let identity = match &t.client {
            Some((cert, key)) => Some(tonic::transport::Identity::from_pem(
                read("--tls-client-cert-file", cert)?,
                read("--tls-client-key-file", key)?,
            )),
            None => None,
        };
        Ok(ClientTls {
            ca: tonic::transport::Certificate::from_pem(pem),
            identity,
        })
    }

    fn config(&self, server_name: &str) -> tonic::transport::ClientTlsConfig {
        let c = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .domain_name(server_name);
        match &self.identity {
            Some(id) => c.identity(id.clone()),
            None => c,
        }
    }
}

/// The host of `HOST:PORT` (`[v6]:PORT`), the name the peer service's certificate is checked
/// against.
fn host_of(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// A channel to an Observer or Peer service at `HOST:PORT` or `unix:///path`, connected when
/// first used and reconnected by tonic after a failure.
pub fn channel(
    address: &str,
    tls: Option<tonic::transport::ClientTlsConfig>,
) -> Result<Channel, String> {
    if let Some(path) = address.strip_prefix("unix://") {
        let path = std::path::PathBuf::from(path);
        let ep =
            windows(Endpoint::from_static("http://hubble.local")).connect_timeout(CALL_TIMEOUT);
        return Ok(ep.connect_with_connector_lazy(tower::service_fn(
            move |_: tonic::transport::Uri| {
                let path = path.clone();
                async move {
                    let s = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
                }
            },
        )));
    }
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut ep = windows(
        Endpoint::from_shared(format!("{scheme}://{address}"))
            .map_err(|e| format!("{address:?}: {e}"))?,
    );
    if let Some(tls) = tls {
        ep = ep
            .tls_config(tls)
            .map_err(|e| format!("{address:?}: {e}"))?;
    }
    Ok(ep.connect_timeout(CALL_TIMEOUT).connect_lazy())
}

fn windows(ep: Endpoint) -> Endpoint {
    ep.initial_stream_window_size(Some(WINDOW_BYTES))
        .initial_connection_window_size(Some(WINDOW_BYTES))
}

#[derive(Clone)]
struct Peer {
    address: String,
    channel: Channel,
}

/// The relay's view of the cluster: the peers the Peer service named.
#[derive(Clone)]
pub struct Relay {
    peers: Arc<Mutex<BTreeMap<String, Peer>>>,
    /// Bumped whenever the peer set changes (following streams start or stop followers).
    changed: watch::Sender<u64>,
    started: Instant,
    tls: Option<ClientTls>,
    /// Places of the streams served at once (`server::MAX_STREAMS`).
    streams: super::server::StreamPlaces,
}

impl Relay {
    /// A relay with no peers yet, dialing them with `tls` (none: plain text).
    pub fn new(tls: Option<ClientTls>) -> Relay {
        Relay {
            peers: Default::default(),
            changed: watch::channel(0).0,
            started: Instant::now(),
            tls,
            streams: Default::default(),
        }
    }

    /// How to dial a peer that announces `tls`: TLS exactly when both sides have it; a peer
    /// that differs from the relay is refused, never dialed in plain text instead.
    fn peer_tls(
        &self,
        tls: Option<&ppb::Tls>,
    ) -> Result<Option<tonic::transport::ClientTlsConfig>, String> {
        match (&self.tls, tls) {
            (Some(c), Some(t)) => Ok(Some(c.config(&t.server_name))),
            (None, None) => Ok(None),
            (Some(_), None) => Err("it serves plain text and the relay speaks TLS".into()),
            (None, Some(_)) => Err("it serves TLS and the relay has no CA for it".into()),
        }
    }
}

impl Relay {
    fn snapshot(&self) -> Vec<(String, Peer)> {
        let peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        peers.iter().map(|(n, p)| (n.clone(), p.clone())).collect()
    }

    /// One Peer service notification applied.
    pub fn apply(&self, n: ppb::ChangeNotification) {
        use ppb::ChangeNotificationType as T;
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        match T::try_from(n.r#type) {
            Ok(T::PeerDeleted) => {
                peers.remove(&n.name);
            }
            Ok(T::PeerAdded | T::PeerUpdated) => {
                if peers.get(&n.name).is_some_and(|p| p.address == n.address) {
                    return;
                }
                match self
                    .peer_tls(n.tls.as_ref())
                    .and_then(|tls| channel(&n.address, tls))
                {
                    Ok(channel) => {
                        let address = n.address;
                        peers.insert(n.name, Peer { address, channel });
                    }
                    Err(e) => tracing::warn!(peer = %n.name, error = %e, "peer not dialed"),
                }
            }
            _ => return,
        }
        drop(peers);
        self.changed.send_modify(|g| *g += 1);
    }

    /// The names of the peers known now.
    pub fn peer_names(&self) -> Vec<String> {
        self.snapshot().into_iter().map(|(n, _)| n).collect()
    }
}

/// Follows the Peer service for as long as the relay runs, reconnecting after a failure.
pub async fn discover(relay: Relay, peer_service: String) {
    let tls = relay.tls.as_ref().map(|t| t.config(host_of(&peer_service)));
    loop {
        match notify(&peer_service, tls.clone()).await {
            Ok(mut s) => loop {
                match s.message().await {
                    Ok(Some(n)) => relay.apply(n),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "the Peer service's stream failed");
                        break;
                    }
                }
            },
            Err(e) => tracing::warn!(peer_service = %peer_service, error = %e, "no Peer service"),
        }
        tokio::time::sleep(RETRY).await;
    }
}

async fn notify(
    address: &str,
    tls: Option<tonic::transport::ClientTlsConfig>,
) -> Result<tonic::Streaming<ppb::ChangeNotification>, String> {
    let mut c = ppb::peer_client::PeerClient::new(channel(address, tls)?);
    let s = tokio::time::timeout(CALL_TIMEOUT, c.notify(ppb::NotifyRequest {}))
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| e.to_string())?;
    Ok(s.into_inner())
}

fn observer(p: &Peer) -> opb::observer_client::ObserverClient<Channel> {
    opb::observer_client::ObserverClient::new(p.channel.clone())
}

fn node_status(state: rpb::NodeState, names: Vec<String>) -> opb::GetFlowsResponse {
    opb::GetFlowsResponse {
        response_types: Some(opb::get_flows_response::ResponseTypes::NodeStatus(
            rpb::NodeStatusEvent {
                state_change: state as i32,
                node_names: names,
                message: String::new(),
            },
        )),
        node_name: String::new(),
        time: None,
    }
}

fn time_key(r: &opb::GetFlowsResponse) -> (i64, i32) {
    r.time.map_or((0, 0), |t| (t.seconds, t.nanos))
}

/// Every response one node gives to a request that does not follow.
async fn collect(p: Peer, req: opb::GetFlowsRequest) -> Result<Vec<opb::GetFlowsResponse>, Status> {
    let call = async {
        let mut s = observer(&p).get_flows(req).await?.into_inner();
        let mut out = Vec::new();
        while let Some(r) = s.message().await? {
            out.push(r);
        }
        Ok(out)
    };
    tokio::time::timeout(CALL_TIMEOUT * 4, call)
        .await
        .map_err(|_| Status::deadline_exceeded("the node did not answer in time"))?
}

/// The history of every node, merged by time and cut to `number`.
async fn history(
    relay: Relay,
    req: opb::GetFlowsRequest,
    tx: mpsc::Sender<Result<opb::GetFlowsResponse, Status>>,
) {
    let peers = relay.snapshot();
    let calls = peers.iter().map(|(_, p)| collect(p.clone(), req.clone()));
    let results = futures_util::future::join_all(calls).await;
    let (mut ok, mut gone, mut flows) = (Vec::new(), Vec::new(), Vec::new());
    for ((name, _), r) in peers.into_iter().zip(results) {
        match r {
            Ok(v) => {
                ok.push(name);
                flows.extend(v);
            }
            Err(_) => gone.push(name),
        }
    }
    flows.sort_by_key(time_key);
    if req.number > 0 {
        let n = (req.number as usize).min(flows.len());
        flows = if req.first {
            flows.into_iter().take(n).collect()
        } else {
            flows.split_off(flows.len() - n)
        };
    }
    let mut out = vec![node_status(rpb::NodeState::NodeConnected, ok)];
    if !gone.is_empty() {
        out.push(node_status(rpb::NodeState::NodeUnavailable, gone));
    }
    for r in out.into_iter().chain(flows) {
        if tx.send(Ok(r)).await.is_err() {
            return;
        }
    }
}

/// Follows one node: forwards its responses, reports it unavailable when its stream fails and
/// connected when it is back, and resumes after the last flow it sent.
async fn follow_peer(
    name: String,
    p: Peer,
    mut req: opb::GetFlowsRequest,
    out: mpsc::Sender<opb::GetFlowsResponse>,
) {
    let mut up = None;
    let mut resume = Resume::default();
    loop {
        let stream = tokio::time::timeout(CALL_TIMEOUT, observer(&p).get_flows(req.clone())).await;
        if let Ok(Ok(s)) = stream {
            if up != Some(true) {
                up = Some(true);
                let ev = node_status(rpb::NodeState::NodeConnected, vec![name.clone()]);
                if out.send(ev).await.is_err() {
                    return;
                }
            }
            let mut s = s.into_inner();
            while let Ok(Some(r)) = s.message().await {
                if !resume.first_time(&r) {
                    continue;
                }
                if let Some(since) = resume.since() {
                    // Resume from this flow's millisecond, with a fresh history count.
                    req.since = Some(since);
                    req.number = 0;
                }
                if out.send(r).await.is_err() {
                    return;
                }
            }
        }
        if up != Some(false) {
            up = Some(false);
            let ev = node_status(rpb::NodeState::NodeUnavailable, vec![name.clone()]);
            if out.send(ev).await.is_err() {
                return;
            }
        }
        if req.since.is_none() {
            // Never heard from: from now on.
            req.since = Some(now());
            req.number = 0;
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// Where a node's follow stream resumes. Flow times are kept to the millisecond and an agent's
/// `since` counts whole milliseconds, so a resumed stream starts with the last millisecond
/// already forwarded: its flows (by uuid, stable across calls) are not forwarded twice, and
/// none of that millisecond is skipped.
#[derive(Debug, Default)]
struct Resume {
    /// The last millisecond forwarded, in milliseconds since the epoch.
    ms: Option<i64>,
    /// The flows of that millisecond already forwarded.
    uuids: std::collections::HashSet<String>,
}

impl Resume {
    /// Whether `r` is forwarded for the first time (responses that are no flow always are).
    fn first_time(&mut self, r: &opb::GetFlowsResponse) -> bool {
        let (Some(opb::get_flows_response::ResponseTypes::Flow(f)), Some(t)) =
            (&r.response_types, &r.time)
        else {
            return true;
        };
        let ms = t.seconds * 1000 + i64::from(t.nanos) / 1_000_000;
        match self.ms {
            // Earlier than the last (the agent's clock stepped back): new, and no resume point.
            Some(last) if ms < last => return true,
            Some(last) if ms == last => return self.uuids.insert(f.uuid.clone()),
            _ => {}
        }
        self.ms = Some(ms);
        self.uuids.clear();
        self.uuids.insert(f.uuid.clone());
        true
    }

    /// The `since` a resumed stream asks for (`None`: no flow forwarded yet).
    fn since(&self) -> Option<prost_types::Timestamp> {
        self.ms.map(|ms| prost_types::Timestamp {
            seconds: ms.div_euclid(1000),
            nanos: (ms.rem_euclid(1000) * 1_000_000) as i32,
        })
    }
}

fn now() -> prost_types::Timestamp {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    prost_types::Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// Starts a follower for every peer that has none, and stops those of peers gone.
fn sync_followers(
    relay: &Relay,
    req: &opb::GetFlowsRequest,
    running: &mut BTreeMap<String, tokio::task::JoinHandle<()>>,
    merged: &mpsc::Sender<opb::GetFlowsResponse>,
) {
    let peers = relay.snapshot();
    running.retain(|name, h| {
        let keep = peers.iter().any(|(n, _)| n == name);
        if !keep {
            h.abort();
        }
        keep
    });
    for (name, p) in peers {
        running
            .entry(name.clone())
            .or_insert_with(|| tokio::spawn(follow_peer(name, p, req.clone(), merged.clone())));
    }
}

/// Every node's flows as they come, sorted within each window, while the client listens.
async fn follow(
    relay: Relay,
    req: opb::GetFlowsRequest,
    tx: mpsc::Sender<Result<opb::GetFlowsResponse, Status>>,
) {
    let (merged, mut rx) = mpsc::channel(1024);
    let mut changed = relay.changed.subscribe();
    let mut running = BTreeMap::new();
    sync_followers(&relay, &req, &mut running, &merged);
    let mut buf = Vec::new();
    let mut tick = tokio::time::interval(WINDOW);
    let stop = |running: BTreeMap<String, tokio::task::JoinHandle<()>>| {
        running.values().for_each(|h| h.abort())
    };
    loop {
        tokio::select! {
            Some(r) = rx.recv() => buf.push(r),
            _ = changed.changed() => sync_followers(&relay, &req, &mut running, &merged),
            _ = tick.tick() => {
                buf.sort_by_key(time_key);
                for r in buf.drain(..) {
                    if tx.send(Ok(r)).await.is_err() {
                        return stop(running);
                    }
                }
            }
            _ = tx.closed() => return stop(running),
        }
    }
}

/// Each known node's status, or why it could not be asked.
async fn statuses(relay: &Relay) -> Vec<(String, Peer, Option<opb::ServerStatusResponse>)> {
    let peers = relay.snapshot();
    let calls = peers.iter().map(|(_, p)| async move {
        let mut client = observer(p);
        let call = client.server_status(opb::ServerStatusRequest {});
        match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(Ok(r)) => Some(r.into_inner()),
            _ => None,
        }
    });
    let results = futures_util::future::join_all(calls).await;
    peers
        .into_iter()
        .zip(results)
        .map(|((n, p), r)| (n, p, r))
        .collect()
}

type Stream<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl opb::observer_server::Observer for Relay {
    type GetFlowsStream = Stream<opb::GetFlowsResponse>;

    async fn get_flows(
        &self,
        req: Request<opb::GetFlowsRequest>,
    ) -> Result<Response<Self::GetFlowsStream>, Status> {
        let req = req.into_inner();
        // Filters are checked by every node; the relay refuses what none could answer.
        super::server::Plan::new(&req).map_err(Status::invalid_argument)?;
        let place = self.streams.take()?;
        let (tx, rx) = mpsc::channel(256);
        let relay = self.clone();
        tokio::spawn(async move {
            if req.follow {
                follow(relay, req, tx).await;
            } else {
                history(relay, req, tx).await;
            }
            drop(place);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_nodes(
        &self,
        _: Request<opb::GetNodesRequest>,
    ) -> Result<Response<opb::GetNodesResponse>, Status> {
        let nodes = statuses(self).await.into_iter().map(|(name, p, st)| {
            let state = match st {
                Some(_) => rpb::NodeState::NodeConnected,
                None => rpb::NodeState::NodeUnavailable,
            };
            let st = st.unwrap_or_default();
            opb::Node {
                name,
                version: st.version,
                address: p.address,
                state: state as i32,
                tls: Some(opb::Tls::default()),
                uptime_ns: st.uptime_ns,
                num_flows: st.num_flows,
                max_flows: st.max_flows,
                seen_flows: st.seen_flows,
            }
        });
        Ok(Response::new(opb::GetNodesResponse {
            nodes: nodes.collect(),
        }))
    }

    async fn get_namespaces(
        &self,
        _: Request<opb::GetNamespacesRequest>,
    ) -> Result<Response<opb::GetNamespacesResponse>, Status> {
        let calls = self.snapshot().into_iter().map(|(_, p)| async move {
            let mut client = observer(&p);
            let call = client.get_namespaces(opb::GetNamespacesRequest {});
            match tokio::time::timeout(CALL_TIMEOUT, call).await {
                Ok(Ok(r)) => r.into_inner().namespaces,
                _ => Vec::new(),
            }
        });
        let all = futures_util::future::join_all(calls)
            .await
            .into_iter()
            .flatten();
        let set: std::collections::BTreeSet<(String, String)> =
            all.map(|n| (n.cluster, n.namespace)).collect();
        Ok(Response::new(opb::GetNamespacesResponse {
            namespaces: set
                .into_iter()
                .map(|(cluster, namespace)| opb::Namespace { cluster, namespace })
                .collect(),
        }))
    }

    async fn server_status(
        &self,
        _: Request<opb::ServerStatusRequest>,
    ) -> Result<Response<opb::ServerStatusResponse>, Status> {
        let mut out = opb::ServerStatusResponse {
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_ns: self.started.elapsed().as_nanos() as u64,
            ..Default::default()
        };
        let (mut up, mut down) = (0u32, 0u32);
        for (name, _, st) in statuses(self).await {
            match st {
                Some(st) => {
                    up += 1;
                    out.num_flows += st.num_flows;
                    out.max_flows += st.max_flows;
                    out.seen_flows += st.seen_flows;
                }
                None => {
                    down += 1;
                    out.unavailable_nodes.push(name);
                }
            }
        }
        out.num_connected_nodes = Some(up);
        out.num_unavailable_nodes = Some(down);
        Ok(Response::new(out))
    }
}

/// Runs the relay until the process is stopped.
pub fn run(cfg: RelayConfig) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("no runtime: {e}"))?;
    rt.block_on(async {
        let tls = cfg.tls.as_ref().map(ClientTls::load).transpose()?;
        channel(&cfg.peer_service, None).map_err(|e| format!("--peer-service {e}"))?;
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| format!("--listen-address {}: {e}", cfg.listen))?;
        let relay = Relay::new(tls);
        tokio::spawn(discover(relay.clone(), cfg.peer_service.clone()));
        tracing::info!(listen = %cfg.listen, peer_service = %cfg.peer_service, "relay serving");
        tonic::transport::Server::builder()
            .max_concurrent_streams(Some(128))
            .add_service(opb::observer_server::ObserverServer::new(relay))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .map_err(|e| format!("--listen-address {}: {e}", cfg.listen))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(name: &str, address: &str, t: ppb::ChangeNotificationType) -> ppb::ChangeNotification {
        ppb::ChangeNotification {
            name: name.into(),
            address: address.into(),
            r#type: t as i32,
            tls: None,
        }
    }

    fn flow_at(ms: i64, uuid: &str) -> opb::GetFlowsResponse {
        let t = prost_types::Timestamp {
            seconds: ms / 1000,
            nanos: (ms % 1000 * 1_000_000) as i32,
        };
        opb::GetFlowsResponse {
            response_types: Some(opb::get_flows_response::ResponseTypes::Flow(Box::new(
                crate::hubble::proto::flow::Flow {
                    uuid: uuid.into(),
                    time: Some(t),
                    ..Default::default()
                },
            ))),
            node_name: "n1".into(),
            time: Some(t),
        }
    }

    #[test]
    fn a_resumed_stream_forwards_each_flow_of_its_last_millisecond_once() {
        let mut r = Resume::default();
        assert_eq!(r.since(), None);
        for (ms, uuid) in [(1_000, "a"), (1_001, "b"), (1_001, "c")] {
            assert!(r.first_time(&flow_at(ms, uuid)));
        }
        // The stream resumes from 1.001 s: b and c again, then d of that millisecond, e later.
        assert_eq!(
            r.since(),
            Some(prost_types::Timestamp {
                seconds: 1,
                nanos: 1_000_000
            })
        );
        let again: Vec<bool> = [(1_001, "b"), (1_001, "c"), (1_001, "d"), (1_002, "e")]
            .iter()
            .map(|(ms, uuid)| r.first_time(&flow_at(*ms, uuid)))
            .collect();
        assert_eq!(again, [false, false, true, true]);
        // Earlier than the last (a clock stepped back): forwarded, the resume point kept.
        assert!(r.first_time(&flow_at(1_000, "z")));
        assert_eq!(r.since().map(|t| t.nanos), Some(2_000_000));
        // Status events always pass.
        assert!(r.first_time(&node_status(
            rpb::NodeState::NodeConnected,
            vec!["n1".into()]
        )));
    }

    #[tokio::test]
    async fn peers_follow_the_peer_services_notifications() {
        use ppb::ChangeNotificationType as T;
        let r = Relay::new(None);
        let mut changed = r.changed.subscribe();
        r.apply(note("n1", "10.0.0.1:4244", T::PeerAdded));
        r.apply(note("n2", "unix:///run/x/hubble.sock", T::PeerAdded));
        assert_eq!(r.peer_names(), ["n1", "n2"]);
        assert!(changed.has_changed().unwrap());
        changed.borrow_and_update();
        // The same address again: nothing changes.
        r.apply(note("n1", "10.0.0.1:4244", T::PeerAdded));
        assert!(!changed.has_changed().unwrap());
        r.apply(note("n1", "10.0.0.9:4244", T::PeerUpdated));
        assert_eq!(r.snapshot()[0].1.address, "10.0.0.9:4244");
        r.apply(note("n2", "", T::PeerDeleted));
        assert_eq!(r.peer_names(), ["n1"]);
        // A name without a usable address is not a peer.
        r.apply(note("n3", "not an address", T::PeerAdded));
        assert_eq!(r.peer_names(), ["n1"]);
        // A peer that speaks TLS, to a relay without TLS: refused, not dialed in plain text.
        let mut tls = note("n4", "10.0.0.4:4244", T::PeerAdded);
        tls.tls = Some(ppb::Tls {
            server_name: "n4.default.hubble-grpc.cilium.io".into(),
        });
        r.apply(tls);
        assert_eq!(r.peer_names(), ["n1"]);
        assert_eq!(
            host_of("hubble-peer.kube-system.svc:4244"),
            "hubble-peer.kube-system.svc"
        );
        assert_eq!(host_of("[fd00::1]:4244"), "fd00::1");
    }
}
