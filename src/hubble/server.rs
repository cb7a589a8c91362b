//! The Observer and Peer services over the agent's flows and Node objects, and where they are
//! served: always the unix socket `STATE_DIR/hubble.sock` (0600), and the TCP address of
//! `--hubble-listen-address` when one is named (TLS from `--hubble-tls-*` files, or plain text
//! when none is given). The services run on a thread of their own, so a slow client never
//! holds up the actors; a follow stream's client that cannot keep up is told how many flows it
//! missed (`lost_events`, `OBSERVER_EVENTS_QUEUE`) instead of holding the agent's memory.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::datapath::events::VerdictEvent;
use crate::datapath::flows::{Flow, FlowRing};
use crate::network::NodeSet;
use crate::objects::Workload;
use crate::policy::engine::PolicyEngine;

use bytes::Bytes;
use prost::Message;

use super::convert::{self, Lookup};
use super::filter::Filters;
use super::proto::{flow as fpb, observer as opb, peer as ppb, relay as rpb};
use super::wire::{self, Writer};

/// `--hubble-listen-address` and the `--hubble-tls-*` files.
#[derive(Debug, Clone, Default)]
pub struct HubbleConfig {
    pub listen: Option<SocketAddr>,
    pub tls: Option<TlsFiles>,
}

/// `--hubble-tls-cert-file`, `--hubble-tls-key-file`, `--hubble-tls-client-ca-files` (clients
/// must then present a certificate one of these signed).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_cas: Vec<PathBuf>,
}

/// `--hubble-listen-address` (and the relay's `--listen-address`): `HOST:PORT`, or `:PORT` for
/// every address (Cilium's form).
pub fn parse_listen_address(s: &str) -> Result<SocketAddr, String> {
    let full = match s.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => s.to_string(),
    };
    full.parse()
        .map_err(|_| format!("{s:?} is not HOST:PORT or :PORT"))
}

/// What the services read.
pub struct Sources {
    pub node: String,
    pub flows: Arc<FlowRing>,
    pub lookup: Arc<dyn Lookup + Send + Sync>,
    /// The Node objects (Peer's list); the local node is listed even when it has none.
    pub nodes: watch::Receiver<NodeSet>,
    pub started: Instant,
    /// The port other nodes' Observers listen on (this node's `--hubble-listen-address`).
    pub port: u16,
    /// Where this node's Observer is reached when its Node object gives no address.
    pub local_address: String,
    pub tls: bool,
}

/// The engine's identities, ipcache and DNS names, and the pods' workloads, read as each flow
/// is converted.
pub struct EngineLookup {
    pub engine: Arc<RwLock<PolicyEngine>>,
    /// `runtime::Shared::workloads`.
    pub workloads: Arc<dashmap::DashMap<String, Workload>>,
}

impl Lookup for EngineLookup {
    fn identity_of(&self, ip: IpAddr) -> u32 {
        self.engine.read().map_or(0, |e| e.identity_of_ip(ip))
    }
    fn workload_of(&self, pod: &str) -> Option<Workload> {
        self.workloads.get(pod).map(|w| w.clone())
    }
    fn labels_of(&self, identity: u32) -> Vec<String> {
        let Ok(e) = self.engine.read() else {
            return Vec::new();
        };
        e.identity(identity)
            .map(|i| i.labels.iter().map(|l| l.to_string()).collect())
            .unwrap_or_default()
    }
    fn names_of(&self, ip: IpAddr) -> Vec<String> {
        let Ok(e) = self.engine.read() else {
            return Vec::new();
        };
        e.fqdn_names_of(ip)
            .map(|n| n.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// What one `GetFlows` asks for.
#[derive(Debug)]
pub struct Plan {
    pub number: u64,
    pub first: bool,
    pub follow: bool,
    pub since_ms: Option<u64>,
    pub until_ms: Option<u64>,
    pub filters: Filters,
}

fn ms(t: &prost_types::Timestamp) -> u64 {
    (t.seconds.max(0) as u64) * 1000 + (t.nanos.max(0) as u64) / 1_000_000
}

impl Plan {
    pub fn new(r: &opb::GetFlowsRequest) -> Result<Plan, String> {
        if r.first && r.follow {
            return Err("first and follow cannot be asked for together".into());
        }
        Ok(Plan {
            number: r.number,
            first: r.first,
            follow: r.follow,
            since_ms: r.since.as_ref().map(ms),
            until_ms: r.until.as_ref().map(ms),
            filters: Filters::new(&r.whitelist, &r.blacklist)?,
        })
    }

    /// Of the kept flows (oldest first), those to send, each as `wanted` makes it (`None`:
    /// filtered out): the last (or first) `number` that pass; with no number, all that pass,
    /// except that a follow with neither number nor `since` sends only what comes next. Only
    /// the flows needed are looked at: the last 10,000 of a full ring cost 10,000 conversions
    /// when most pass, not one per kept flow.
    pub fn pick<T, R>(&self, kept: &[T], wanted: impl FnMut(&T) -> Option<R>) -> Vec<R> {
        let n = self.number as usize;
        match (n, self.first) {
            (0, _) if self.follow && self.since_ms.is_none() => Vec::new(),
            (0, _) => kept.iter().filter_map(wanted).collect(),
            (n, true) => kept.iter().filter_map(wanted).take(n).collect(),
            (n, false) => {
                let mut last: Vec<R> = kept.iter().rev().filter_map(wanted).take(n).collect();
                last.reverse();
                last
            }
        }
    }

    fn in_time(&self, at: Option<&prost_types::Timestamp>) -> bool {
        let at = at.map_or(0, ms);
        self.since_ms.is_none_or(|s| at >= s) && self.until_ms.is_none_or(|u| at <= u)
    }
}

/// Streams (`GetFlows`, `Notify`) one agent serves at once; one more is refused with
/// RESOURCE_EXHAUSTED. Each holds at most 256 responses and a place in the live broadcast, so
/// this bounds what clients can make the agent hold.
pub const MAX_STREAMS: usize = 64;

/// The places of the streams one server (an agent, the relay) serves at once.
#[derive(Clone)]
pub struct StreamPlaces(Arc<tokio::sync::Semaphore>);

impl Default for StreamPlaces {
    fn default() -> Self {
        StreamPlaces(Arc::new(tokio::sync::Semaphore::new(MAX_STREAMS)))
    }
}

impl StreamPlaces {
    /// A place for one more stream, held until the stream ends.
    pub fn take(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Status> {
        self.0.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!("at most {MAX_STREAMS} streams at once"))
        })
    }
}

/// The Observer and Peer services, and the places of the streams they serve.
#[derive(Clone)]
pub struct Hubble(Arc<Sources>, StreamPlaces);

type Stream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

impl Hubble {
    pub fn new(sources: Sources) -> Hubble {
        Hubble(Arc::new(sources), StreamPlaces::default())
    }

    /// Whether the plan wants `ev` (a loss report always passes), with the time it was
    /// received.
    fn wanted(&self, plan: &Plan, ev: &Flow, lookup: &dyn Lookup) -> Option<Picked> {
        let time = convert::received(ev);
        if ev.lost.is_some() {
            return Some((ev.clone(), time));
        }
        let verdict = convert::verdict(ev) as i32;
        if !plan.filters.may_accept_verdict(verdict) || !plan.in_time(time.as_ref()) {
            return None;
        }
        let accepted = match plan.filters.accepts_verdict(verdict) {
            Some(yes) => yes,
            None => plan
                .filters
                .accepts(&convert::to_flow(ev, &self.0.node, lookup)),
        };
        accepted.then(|| (ev.clone(), time))
    }

    /// A picked flow's response, encoded.
    fn encode(&self, w: &mut Writer, (ev, time): Picked) -> Bytes {
        match ev.lost {
            Some(n) => wire::encode(&loss(
                &self.0.node,
                fpb::LostEventSource::PerfEventRingBuffer,
                n,
                time,
            )),
            None => w.response(&ev, time),
        }
    }

    /// The encoded responses of one `GetFlows`: the history, then (following) each new flow.
    fn flows(&self, req: &opb::GetFlowsRequest) -> Result<Stream<Bytes>, Status> {
        let plan = Plan::new(req).map_err(Status::invalid_argument)?;
        let place = self.1.take()?;
        let (kept, live) = self.0.flows.follow_all(plan.since_ms.unwrap_or(0));
        let history = history(self, &plan, &kept);
        drop(kept);
        if !plan.follow {
            // The place is held until the client has the history or goes.
            let held = tokio_stream::StreamExt::map(history, move |r| {
                let _ = &place;
                r
            });
            return Ok(Box::pin(held));
        }
        let (tx, rx) = mpsc::channel(256);
        let hubble = self.clone();
        tokio::spawn(async move {
            follow_flows(hubble, plan, live, tx).await;
            drop(place);
        });
        Ok(Box::pin(tokio_stream::StreamExt::chain(
            history,
            ReceiverStream::new(rx),
        )))
    }

    fn node(&self) -> opb::Node {
        let s = &self.0;
        opb::Node {
            name: s.node.clone(),
            version: env!("CARGO_PKG_VERSION").into(),
            address: s.local_address.clone(),
            state: rpb::NodeState::NodeConnected as i32,
            tls: Some(opb::Tls {
                enabled: s.tls,
                server_name: if s.tls {
                    server_name(&s.node)
                } else {
                    String::new()
                },
            }),
            uptime_ns: s.started.elapsed().as_nanos() as u64,
            num_flows: s.flows.len() as u64,
            max_flows: s.flows.capacity() as u64,
            seen_flows: s.flows.seen(),
        }
    }
}

/// The name a node's Hubble certificate is for (Cilium's convention; one cluster, `default`).
pub fn server_name(node: &str) -> String {
    format!("{node}.default.hubble-grpc.cilium.io")
}

/// A flow picked for a response, with the time it was received.
type Picked = (Flow, Option<prost_types::Timestamp>);

/// The history's responses, as a stream of its own (no task, no channel per response): the
/// flows are picked now, and each is encoded as the stream is read, so the client decodes the
/// first while the agent encodes the next. One writer for the call reads the agent's state once
/// per identity and address.
fn history(
    hubble: &Hubble,
    plan: &Plan,
    kept: &[Flow],
) -> impl tokio_stream::Stream<Item = Result<Bytes, Status>> + Send + 'static {
    let mut w = Writer::new(&hubble.0.node, hubble.0.lookup.clone());
    let picked = plan.pick(kept, |e| hubble.wanted(plan, e, w.lookup()));
    let hubble = hubble.clone();
    tokio_stream::iter(
        picked
            .into_iter()
            .map(move |p| Ok(hubble.encode(&mut w, p))),
    )
}

/// Sends every new flow that passes, until the client goes or `until` is passed.
async fn follow_flows(
    hubble: Hubble,
    plan: Plan,
    mut live: broadcast::Receiver<Flow>,
    tx: mpsc::Sender<Result<Bytes, Status>>,
) {
    loop {
        let next = tokio::select! {
            next = live.recv() => next,
            // A client that went away frees its place now, not at the next flow.
            _ = tx.closed() => return,
        };
        let r = match next {
            Ok(ev) => {
                // Each followed flow reads the agent's state as it is now.
                let mut w = Writer::new(&hubble.0.node, hubble.0.lookup.clone());
                match hubble.wanted(&plan, &ev, w.lookup()) {
                    Some(p) => hubble.encode(&mut w, p),
                    None if past(&plan, &ev) => return,
                    None => continue,
                }
            }
            Err(broadcast::error::RecvError::Lagged(n)) => wire::encode(&loss(
                &hubble.0.node,
                fpb::LostEventSource::ObserverEventsQueue,
                n,
                None,
            )),
            Err(broadcast::error::RecvError::Closed) => return,
        };
        if tx.send(Ok(r)).await.is_err() {
            return;
        }
    }
}

/// Whether a followed flow came after the request's `until`.
fn past(plan: &Plan, ev: &VerdictEvent) -> bool {
    let at = convert::received(ev);
    plan.until_ms
        .is_some_and(|u| at.as_ref().is_some_and(|t| ms(t) > u))
}

/// A report of `n` flows lost at `source`.
fn loss(
    node: &str,
    source: fpb::LostEventSource,
    n: u64,
    time: Option<prost_types::Timestamp>,
) -> opb::GetFlowsResponse {
    opb::GetFlowsResponse {
        response_types: Some(opb::get_flows_response::ResponseTypes::LostEvents(
            fpb::LostEvent {
                source: source as i32,
                num_events_lost: n,
                cpu: None,
            },
        )),
        node_name: node.to_string(),
        time,
    }
}

#[tonic::async_trait]
impl opb::observer_server::Observer for Hubble {
    type GetFlowsStream = Stream<opb::GetFlowsResponse>;

    /// A direct call (the agent's server answers `GetFlows` through `ObserverService`): the
    /// same responses, decoded.
    async fn get_flows(
        &self,
        req: Request<opb::GetFlowsRequest>,
    ) -> Result<Response<Self::GetFlowsStream>, Status> {
        let flows = self.flows(req.get_ref())?;
        let decoded = tokio_stream::StreamExt::map(flows, |r| {
            r.and_then(|b| {
                opb::GetFlowsResponse::decode(b).map_err(|e| Status::internal(e.to_string()))
            })
        });
        Ok(Response::new(Box::pin(decoded)))
    }

    async fn get_nodes(
        &self,
        _: Request<opb::GetNodesRequest>,
    ) -> Result<Response<opb::GetNodesResponse>, Status> {
        Ok(Response::new(opb::GetNodesResponse {
            nodes: vec![self.node()],
        }))
    }

    async fn get_namespaces(
        &self,
        _: Request<opb::GetNamespacesRequest>,
    ) -> Result<Response<opb::GetNamespacesResponse>, Status> {
        let namespaces = self.0.flows.namespaces().into_iter();
        Ok(Response::new(opb::GetNamespacesResponse {
            namespaces: namespaces
                .map(|namespace| opb::Namespace {
                    cluster: "default".into(),
                    namespace,
                })
                .collect(),
        }))
    }

    async fn server_status(
        &self,
        _: Request<opb::ServerStatusRequest>,
    ) -> Result<Response<opb::ServerStatusResponse>, Status> {
        let n = self.node();
        Ok(Response::new(opb::ServerStatusResponse {
            num_flows: n.num_flows,
            max_flows: n.max_flows,
            seen_flows: n.seen_flows,
            uptime_ns: n.uptime_ns,
            num_connected_nodes: Some(1),
            num_unavailable_nodes: Some(0),
            unavailable_nodes: Vec::new(),
            version: n.version,
        }))
    }
}

/// Each peer by name: where its Observer listens.
pub fn peers(s: &Sources, nodes: &NodeSet) -> BTreeMap<String, ppb::ChangeNotification> {
    let tls = |name: &str| {
        s.tls.then(|| ppb::Tls {
            server_name: server_name(name),
        })
    };
    let mut out: BTreeMap<_, _> = nodes
        .values()
        .map(|n| {
            let ip = n.ips.iter().find(|ip| ip.is_ipv4()).or(n.ips.first());
            let address = ip.map_or(String::new(), |ip| SocketAddr::new(*ip, s.port).to_string());
            (n.name.clone(), (address, tls(&n.name)))
        })
        .collect();
    out.entry(s.node.clone())
        .or_insert_with(|| (s.local_address.clone(), tls(&s.node)));
    out.into_iter()
        .map(|(name, (address, tls))| {
            let n = ppb::ChangeNotification {
                name: name.clone(),
                address,
                r#type: ppb::ChangeNotificationType::PeerAdded as i32,
                tls,
            };
            (name, n)
        })
        .collect()
}

/// What changed from `old` to `new`: added, updated (address or TLS), deleted.
pub fn peer_changes(
    old: &BTreeMap<String, ppb::ChangeNotification>,
    new: &BTreeMap<String, ppb::ChangeNotification>,
) -> Vec<ppb::ChangeNotification> {
    use ppb::ChangeNotificationType as T;
    let with = |n: &ppb::ChangeNotification, t: T| ppb::ChangeNotification {
        r#type: t as i32,
        ..n.clone()
    };
    let mut out = Vec::new();
    for (name, n) in new {
        match old.get(name) {
            None => out.push(with(n, T::PeerAdded)),
            Some(o) if o.address != n.address || o.tls != n.tls => {
                out.push(with(n, T::PeerUpdated))
            }
            Some(_) => {}
        }
    }
    for (name, o) in old {
        if !new.contains_key(name) {
            out.push(with(o, T::PeerDeleted));
        }
    }
    out
}

async fn notify_peers(
    hubble: Hubble,
    mut nodes: watch::Receiver<NodeSet>,
    tx: mpsc::Sender<Result<ppb::ChangeNotification, Status>>,
) {
    let mut known = BTreeMap::new();
    loop {
        let now = peers(&hubble.0, &nodes.borrow_and_update());
        for change in peer_changes(&known, &now) {
            if tx.send(Ok(change)).await.is_err() {
                return;
            }
        }
        known = now;
        tokio::select! {
            changed = nodes.changed() => if changed.is_err() { return },
            _ = tx.closed() => return,
        }
    }
}

#[tonic::async_trait]
impl ppb::peer_server::Peer for Hubble {
    type NotifyStream = Stream<ppb::ChangeNotification>;

    async fn notify(
        &self,
        _: Request<ppb::NotifyRequest>,
    ) -> Result<Response<Self::NotifyStream>, Status> {
        let place = self.1.take()?;
        let (tx, rx) = mpsc::channel(64);
        let (hubble, nodes) = (self.clone(), self.0.nodes.clone());
        tokio::spawn(async move {
            notify_peers(hubble, nodes, tx).await;
            drop(place);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// The bound listeners, before the services run (binding fails at start, with the flag named).
pub struct Listeners {
    pub unix: std::os::unix::net::UnixListener,
    pub socket: PathBuf,
    pub tcp: Option<std::net::TcpListener>,
    pub tls: Option<tonic::transport::ServerTlsConfig>,
}

/// Binds `STATE_DIR/hubble.sock` (a stale socket of an earlier run is replaced; anything else
/// there is refused) and the TCP address, and reads the TLS files.
pub fn bind(state_dir: &Path, cfg: &HubbleConfig) -> Result<Listeners, String> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let socket = state_dir.join(super::SOCKET_NAME);
    match std::fs::symlink_metadata(&socket) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(&socket).map_err(|e| {
            format!(
                "hubble socket {}: remove the stale socket: {e}",
                socket.display()
            )
        })?,
        Ok(_) => {
            return Err(format!(
                "hubble socket {}: exists and is not a socket",
                socket.display()
            ))
        }
        Err(_) => {}
    }
    let unix = std::os::unix::net::UnixListener::bind(&socket)
        .map_err(|e| format!("hubble socket {}: {e}", socket.display()))?;
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("hubble socket {}: chmod 0600: {e}", socket.display()))?;
    let tcp = cfg
        .listen
        .map(|a| {
            std::net::TcpListener::bind(a).map_err(|e| format!("--hubble-listen-address {a}: {e}"))
        })
        .transpose()?;
    let tls = cfg.tls.as_ref().map(load_tls).transpose()?;
    Ok(Listeners {
        unix,
        socket,
        tcp,
        tls,
    })
}

fn read(flag: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{flag} {}: {e}", path.display()))
}

/// The server's certificate and key, and the client CAs (mutual TLS) when given.
pub fn load_tls(files: &TlsFiles) -> Result<tonic::transport::ServerTlsConfig, String> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let cert = read("--hubble-tls-cert-file", &files.cert)?;
    let key = read("--hubble-tls-key-file", &files.key)?;
    let mut cfg = ServerTlsConfig::new().identity(Identity::from_pem(cert, key));
    if !files.client_cas.is_empty() {
        let mut pem = Vec::new();
        for ca in &files.client_cas {
            pem.extend(read("--hubble-tls-client-ca-files", ca)?);
            pem.push(b'\n');
        }
        cfg = cfg.client_ca_root(Certificate::from_pem(pem));
    }
    Ok(cfg)
}

/// Runs the services on their own thread until the process ends.
pub fn spawn(hubble: Hubble, listeners: Listeners) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("ciliate-hubble".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(error = %e, "Hubble's API cannot start: no runtime");
                    return;
                }
            };
            rt.block_on(serve(hubble, listeners));
        })
        .map(|_| ())
}

/// The Observer service as the agent serves it: `GetFlows` from the responses `wire` encodes
/// (`Hubble::flows`), every other call by the generated server.
#[derive(Clone)]
struct ObserverService {
    hubble: Hubble,
    generated: opb::observer_server::ObserverServer<Hubble>,
}

impl ObserverService {
    fn new(hubble: Hubble) -> Self {
        let generated = opb::observer_server::ObserverServer::new(hubble.clone());
        ObserverService { hubble, generated }
    }
}

impl tonic::server::NamedService for ObserverService {
    const NAME: &'static str = opb::observer_server::SERVICE_NAME;
}

/// `GetFlows` answered with encoded responses.
struct EncodedFlows(Hubble);

impl tonic::server::ServerStreamingService<opb::GetFlowsRequest> for EncodedFlows {
    type Response = Bytes;
    type ResponseStream = Stream<Bytes>;
    type Future = std::future::Ready<Result<Response<Stream<Bytes>>, Status>>;

    fn call(&mut self, req: Request<opb::GetFlowsRequest>) -> Self::Future {
        std::future::ready(self.0.flows(req.get_ref()).map(Response::new))
    }
}

impl<B> tower::Service<http::Request<B>> for ObserverService
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        tower::Service::<http::Request<B>>::poll_ready(&mut self.generated, cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != "/observer.Observer/GetFlows" {
            return self.generated.call(req);
        }
        let flows = EncodedFlows(self.hubble.clone());
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(wire::Codec);
            Ok(grpc.server_streaming(flows, req).await)
        })
    }
}

fn router(
    hubble: &Hubble,
    tls: Option<tonic::transport::ServerTlsConfig>,
) -> Result<tonic::transport::server::Router, tonic::transport::Error> {
    let mut b = tonic::transport::Server::builder().max_concurrent_streams(Some(128));
    if let Some(tls) = tls {
        b = b.tls_config(tls)?;
    }
    Ok(b.add_service(ObserverService::new(hubble.clone()))
        .add_service(ppb::peer_server::PeerServer::new(hubble.clone())))
}

async fn serve(hubble: Hubble, l: Listeners) {
    use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
    let unix = async {
        l.unix.set_nonblocking(true)?;
        let incoming = UnixListenerStream::new(tokio::net::UnixListener::from_std(l.unix)?);
        let r = router(&hubble, None).map_err(std::io::Error::other)?;
        r.serve_with_incoming(incoming)
            .await
            .map_err(std::io::Error::other)
    };
    let tcp = async {
        let Some(tcp) = l.tcp else {
            return Ok(());
        };
        tcp.set_nonblocking(true)?;
        let incoming = TcpListenerStream::new(tokio::net::TcpListener::from_std(tcp)?);
        let r = router(&hubble, l.tls).map_err(std::io::Error::other)?;
        r.serve_with_incoming(incoming)
            .await
            .map_err(std::io::Error::other)
    };
    let (u, t) = tokio::join!(unix, tcp);
    for (what, r) in [("hubble socket", u), ("--hubble-listen-address", t)] {
        if let Err(e) = r {
            tracing::error!(error = %e, "Hubble's API on the {what} stopped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sources(nodes: NodeSet) -> Sources {
        Sources {
            node: "n1".into(),
            flows: Arc::new(FlowRing::new(16, 16)),
            lookup: Arc::new(convert::NoLookup),
            nodes: watch::channel(nodes).1,
            started: Instant::now(),
            port: 4244,
            local_address: "unix:///run/ciliate/hubble.sock".into(),
            tls: false,
        }
    }

    fn node(name: &str, ips: &[&str]) -> crate::objects::NodeInfo {
        crate::objects::NodeInfo {
            name: name.into(),
            labels: Default::default(),
            annotations: Default::default(),
            ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
            pod_cidrs: vec![],
            kubelet_port: None,
        }
    }

    #[test]
    fn peers_are_the_nodes_at_the_observer_port_and_changes_are_typed() {
        let s = sources(NodeSet::new());
        let mut set = NodeSet::new();
        set.insert("n2".into(), node("n2", &["fd00::2", "192.168.1.2"]));
        let first = peers(&s, &set);
        assert_eq!(first["n2"].address, "192.168.1.2:4244");
        assert_eq!(
            first["n1"].address, "unix:///run/ciliate/hubble.sock",
            "the local node always"
        );
        let added = peer_changes(&BTreeMap::new(), &first);
        assert_eq!(added.len(), 2);
        assert!(added
            .iter()
            .all(|c| c.r#type == ppb::ChangeNotificationType::PeerAdded as i32));

        set.insert("n2".into(), node("n2", &["192.168.1.22"]));
        set.insert("n3".into(), node("n3", &["192.168.1.3"]));
        let second = peers(&s, &set);
        let types: Vec<(String, i32)> = peer_changes(&first, &second)
            .into_iter()
            .map(|c| (c.name, c.r#type))
            .collect();
        assert_eq!(
            types,
            [
                (
                    "n2".to_string(),
                    ppb::ChangeNotificationType::PeerUpdated as i32
                ),
                (
                    "n3".to_string(),
                    ppb::ChangeNotificationType::PeerAdded as i32
                ),
            ]
        );
        set.remove("n3");
        let third = peers(&s, &set);
        let gone = peer_changes(&second, &third);
        assert_eq!(gone.len(), 1);
        assert_eq!(
            gone[0].r#type,
            ppb::ChangeNotificationType::PeerDeleted as i32
        );
    }

    #[tokio::test]
    async fn get_flows_sends_the_picked_flows_as_to_flow_builds_them() {
        use opb::observer_server::Observer;
        use tokio_stream::StreamExt;
        let s = sources(NodeSet::new());
        for i in 0..6u8 {
            let reason = if i % 3 == 0 {
                "drop-default-deny"
            } else {
                "allow-policy"
            };
            let mut a = [0u8; 16];
            a[..4].copy_from_slice(&[10, 0, 0, i]);
            let ev = crate::datapath::events::verdict_event(
                u64::from(i),
                1,
                256,
                i % 2 == 0,
                6,
                8080,
                reason,
                4,
                a,
                a,
                0,
            );
            s.flows.publish(ev);
        }
        let (kept, _) = s.flows.follow_all(0);
        let h = Hubble::new(s);
        // The last two forwarded flows: the fifth and sixth kept are forwarded, so 4 and 5.
        let req = opb::GetFlowsRequest {
            number: 2,
            whitelist: vec![fpb::FlowFilter {
                verdict: vec![fpb::Verdict::Forwarded as i32],
                ..Default::default()
            }],
            ..Default::default()
        };
        let got: Vec<opb::GetFlowsResponse> = Observer::get_flows(&h, Request::new(req))
            .await
            .unwrap()
            .into_inner()
            .map(Result::unwrap)
            .collect()
            .await;
        let want: Vec<opb::GetFlowsResponse> = kept[4..]
            .iter()
            .map(|ev| opb::GetFlowsResponse {
                response_types: Some(opb::get_flows_response::ResponseTypes::Flow(Box::new(
                    convert::to_flow(ev, "n1", &convert::NoLookup),
                ))),
                node_name: "n1".into(),
                time: convert::received(ev),
            })
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_plan_picks_the_last_or_first_number() {
        let plan = |number, first, follow, since: bool| {
            Plan::new(&opb::GetFlowsRequest {
                number,
                first,
                follow,
                since: since.then_some(prost_types::Timestamp {
                    seconds: 1,
                    nanos: 0,
                }),
                ..Default::default()
            })
            .unwrap()
        };
        let v = [1, 2, 3, 4, 5];
        let all = |x: &i32| Some(*x);
        let odd = |x: &i32| (x % 2 == 1).then_some(*x);
        assert_eq!(plan(2, false, false, false).pick(&v, all), [4, 5]);
        assert_eq!(plan(2, true, false, false).pick(&v, all), [1, 2]);
        assert_eq!(
            plan(2, false, false, false).pick(&v, odd),
            [3, 5],
            "of those that pass"
        );
        assert_eq!(plan(2, true, false, false).pick(&v, odd), [1, 3]);
        assert_eq!(plan(9, false, false, false).pick(&v, all), [1, 2, 3, 4, 5]);
        assert_eq!(plan(0, false, false, false).pick(&v, all), [1, 2, 3, 4, 5]);
        assert!(
            plan(0, false, true, false).pick(&v, all).is_empty(),
            "follow: only what comes"
        );
        assert_eq!(plan(0, false, true, true).pick(&v, all), [1, 2, 3, 4, 5]);
        let both = opb::GetFlowsRequest {
            first: true,
            follow: true,
            ..Default::default()
        };
        assert!(Plan::new(&both).is_err());
    }

    #[test]
    fn listen_addresses_in_ciliums_forms() {
        assert_eq!(
            parse_listen_address(":4244").unwrap().to_string(),
            "0.0.0.0:4244"
        );
        assert_eq!(
            parse_listen_address("127.0.0.1:5000").unwrap().to_string(),
            "127.0.0.1:5000"
        );
        assert!(parse_listen_address("4244")
            .unwrap_err()
            .contains("HOST:PORT"));
    }
}
