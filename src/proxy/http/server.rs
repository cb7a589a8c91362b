//! The HTTP proxy process (`ciliate http-proxy`).
//!
//! - Listeners: transparent TCP sockets, both families, one port for what pods send (egress)
//!   and one for what they receive (ingress), ephemeral unless given. The datapath assigns
//!   redirected connections to them without changing their addresses, so each accepted
//!   socket's local address is the server the client asked for.
//! - Each connection: its endpoint (the client for egress, the server for ingress), the peer's
//!   identity from the pinned ipcache, then either HTTP (hyper: HTTP/1.1 with keep-alive,
//!   pipelining, chunked bodies and upgrades; HTTP/2 by prior knowledge, each stream on its
//!   own) or, when the port's rules are TLS server names, the ClientHello's SNI. Every request
//!   is judged by the rules in force when it arrives (a policy edit applies to the next
//!   request of an open connection); denied: `403 Access denied` (gRPC: `PERMISSION_DENIED`),
//!   the connection kept. Allowed requests go on over upstream connections made as the pod
//!   (`upstream`) and shared by the client connections that would make the same one
//!   (`pool`: an idle client connection holds none), bodies streamed, never buffered whole.
//!   An HTTP/1.1 connection quiet for a second is parked (`park`): it holds no HTTP state
//!   until its next request; every second the proxy tells the agent what it holds (`Stats`).
//! - Routing and the datapath: the rule `fwmark local_mark -> local` and the pinned
//!   `l7_proxy` map (ports, marks); mark 0 there means no proxy (flows dropped, fail closed).
//! - Hand-over: a new `ciliate http-proxy` for the same state directory takes the listening
//!   sockets over its hand-over socket (SCM_RIGHTS), so no connection attempt meets a closed
//!   port; the old one stops accepting, finishes the requests in flight, closes idle
//!   keep-alive connections between requests (HTTP/2: GOAWAY), and exits.
//! - It serves one state directory: its agent socket there is its lock; it exits when the
//!   directory or the pinned maps go away.

use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use libbpf_rs::{MapCore, MapFlags, MapHandle};
use socket2::{Protocol, Socket, Type};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};

use super::park::{Counted, Exchanges, Parking};
use super::pool::{Pool, Pooled};
use super::request::{self, Headers, Prepared};
use super::sni::{client_hello, Hello, MAX_HELLO};
use super::spin::Spin;
use super::upstream::{self, Conntrack, Upstream};
use super::{FromProxy, Index, IndexedGrant, L7Record, ProxyTable, RuleCache, ToProxy};
use crate::datapath::events::HttpFields;
use crate::policy::attribution::PolicyRef;
use crate::policy::identity::{
    IDENTITY_WORLD, IDENTITY_WORLD_IPV4, IDENTITY_WORLD_IPV6, LOCAL_IDENTITY_FLAG,
};
use crate::policy::l7::http::{judge, server_name_allowed, Grant, HttpVerdict, RequestView};
use crate::proxy::lock;
use crate::proxy::Ipcache;

#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// The agent's state directory (sockets, kept table).
    pub state_dir: PathBuf,
    /// The agent's pinned maps (`<bpf-root>/ciliate`).
    pub pins: PathBuf,
    /// 0: ephemeral.
    pub egress_port: u16,
    pub ingress_port: u16,
    /// How long the old process waits for its connections after a hand-over or SIGTERM.
    pub drain_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("an HTTP proxy already serves {0} (and did not hand over)")]
    AlreadyRunning(PathBuf),
    #[error("{0}: {1}")]
    Setup(String, String),
}

fn setup<E: std::fmt::Display>(what: impl Into<String>) -> impl FnOnce(E) -> ProxyError {
    let what = what.into();
    move |e| ProxyError::Setup(what, e.to_string())
}

/// The marks of a proxy whose egress listener is on `port` (`l7_proxy_config`): every proxy
/// on a machine has its own, and its own routing rule for `local`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marks {
    pub local: u32,
    pub upstream_egress: u32,
    pub upstream_ingress: u32,
    pub downstream: u32,
}

impl Marks {
    pub fn of(port: u16) -> Marks {
        let p = port as u32;
        Marks {
            local: 0x0E00_0000 | p,
            upstream_egress: 0x0E10_0000 | p,
            upstream_ingress: 0x0E20_0000 | p,
            downstream: 0x0E30_0000 | p,
        }
    }
}

/// Writes the ports and marks into the pinned `l7_proxy` map (`None`: no proxy).
fn publish(pins: &Path, ports: Option<(u16, u16, Marks)>) -> Result<(), ProxyError> {
    let path = pins.join("l7_proxy");
    let map = MapHandle::from_pinned_path(&path)
        .map_err(setup(format!("open pinned map {}", path.display())))?;
    use crate::datapath::bpf::{types, Pod};
    let v = match ports {
        Some((e, i, m)) => types::l7_proxy_config {
            egress_port: e,
            ingress_port: i,
            local_mark: m.local,
            upstream_egress_mark: m.upstream_egress,
            upstream_ingress_mark: m.upstream_ingress,
            downstream_mark: m.downstream,
            pad: 0,
        },
        None => types::l7_proxy_config::default(),
    };
    map.update(&0u32.to_ne_bytes(), v.as_bytes(), MapFlags::ANY)
        .map_err(setup("write the l7_proxy map"))
}

/// Records waiting for the agent, at most (older ones are dropped and counted).
const RECORDS_MAX: usize = 65_536;

/// Records wait this long for the ones after them: one write to the agent for many.
const RECORD_BATCH: Duration = Duration::from_millis(10);

/// Batches (and other messages) queued for the agent's connection.
const RECORD_BATCHES: usize = 1024;

/// How long a connection of an endpoint the table does not know yet waits for it.
const TABLE_WAIT: Duration = Duration::from_secs(2);

/// How long a client has to send its TLS ClientHello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

struct Proxy {
    index: RwLock<Arc<Index>>,
    cache: Mutex<RuleCache>,
    /// Bumped on every table (connections waiting for their endpoint's table).
    generation: watch::Sender<u64>,
    ipcache: Ipcache,
    conntrack: Conntrack,
    marks: Marks,
    state_dir: PathBuf,
    /// The agent connection's writer: JSON lines, each message ending in a newline.
    records: Mutex<Option<mpsc::Sender<String>>>,
    records_dropped: AtomicU64,
    /// The agent's generation of the table judged by (0 until this connection's first).
    applied: AtomicU64,
    /// Records of the last few milliseconds, for the next batch (`flush_records`).
    pending: Mutex<Vec<L7Record>>,
    pending_ready: tokio::sync::Notify,
    /// To the thread that writes batches as JSON lines, off the requests' thread.
    batches: std::sync::mpsc::SyncSender<Vec<L7Record>>,
    /// Redirected client connections open now: (client address, server, client port).
    active: Mutex<HashSet<(IpAddr, SocketAddr, u16)>>,
    /// The threads that serve client connections (`Shard`), and the next to take one.
    shards: Vec<Arc<Shard>>,
    next_shard: AtomicUsize,
    /// Client connections parked now.
    parked_now: AtomicU64,
}

/// One of the proxy's serving threads: a runtime of its own that a client connection lives
/// on from its hand-off to its end, with the upstream connections its requests use (`pool`,
/// one per thread), so that a request wakes no other thread. Accepting, the agent's link and
/// the records stay on the process's main thread.
struct Shard {
    handle: tokio::runtime::Handle,
    /// Idle upstream connections made on this thread.
    pool: Mutex<Pool<UpKey, Sender>>,
    /// Client connections parked on this thread since its last trim.
    parked: AtomicU64,
    /// Its requests waiting upstream, polled for without sleeping while that pays (`spin`).
    spin: Arc<Spin>,
}

impl Shard {
    /// Starts the thread `n` and its runtime; every second it drops expired upstream
    /// connections and, after parking, hands its heap's free memory back (a thread's own).
    fn start(n: usize) -> io::Result<Arc<Shard>> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name(format!("http-proxy-{n}"))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => return drop(tx.send(Err(e))),
                };
                let shard = Arc::new(Shard {
                    handle: rt.handle().clone(),
                    pool: Mutex::new(Pool::new(POOL_MAX_IDLE, POOL_IDLE_TIMEOUT)),
                    parked: AtomicU64::new(0),
                    spin: Arc::new(Spin::default()),
                });
                rt.spawn(shard.spin.clone().run());
                if tx.send(Ok(shard.clone())).is_err() {
                    return;
                }
                rt.block_on(async move {
                    let mut tick = tokio::time::interval(Duration::from_secs(1));
                    loop {
                        tick.tick().await;
                        lock(&shard.pool).sweep(Instant::now());
                        if shard.parked.swap(0, Ordering::Relaxed) >= TRIM_AFTER_PARKED {
                            crate::memory::release_free_memory();
                        }
                    }
                })
            })?;
        rx.recv()
            .map_err(|_| io::Error::other("the serving thread ended at its start"))?
    }
}

/// Serving threads: one per core, at most `MAX_SHARDS` (the proxy shares the node's cores
/// with the pods it serves; on a node of two, one thread left the other core idle a fifth of
/// the time at the highest rate, `benches/http_proxy.rs` part 2).
const MAX_SHARDS: usize = 4;

fn shard_count() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, MAX_SHARDS)
}

/// What makes an upstream connection what it is (`pool`): the address it is made from (`None`:
/// the node's), the server, the mark (which side judged it), HTTP/2 or not.
#[derive(Clone, PartialEq, Eq, Hash)]
struct UpKey(Option<IpAddr>, SocketAddr, u32, bool);

/// Parked connections (in one second, on one thread) worth a trim of that thread's heap: an
/// allocator keeps freed memory resident until told, and many idle connections would
/// otherwise hold the proxy at its busiest size.
const TRIM_AFTER_PARKED: u64 = 64;

/// Idle upstream connections kept per key, and for how long.
const POOL_MAX_IDLE: usize = 64;
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

impl Proxy {
    fn index(&self) -> Arc<Index> {
        self.index.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set_table(&self, table: &ProxyTable) {
        let idx = Index::new(table, &mut lock(&self.cache));
        *self.index.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(idx);
        self.generation.send_modify(|g| *g += 1);
        self.applied.store(table.generation, Ordering::Relaxed);
        keep_table(&self.state_dir, table);
    }

    /// Takes the agent's table and says so: from now on requests are judged by it.
    fn apply_table(&self, table: &ProxyTable) {
        self.set_table(table);
        self.send_now(&FromProxy::Applied {
            generation: table.generation,
        });
    }

    /// The serving thread for the next client connection (round robin).
    fn shard(&self) -> Arc<Shard> {
        let n = self.next_shard.fetch_add(1, Ordering::Relaxed);
        self.shards[n % self.shards.len()].clone()
    }

    /// Tells the agent what the proxy holds (dropped when the agent is not reading).
    fn send_stats(&self, connections: u64) {
        let stats = super::ProxyStats {
            connections,
            parked: self.parked_now.load(Ordering::Relaxed),
            upstream_idle: self.shards.iter().map(|s| lock(&s.pool).len() as u64).sum(),
            records_dropped: self.records_dropped.load(Ordering::Relaxed),
            table_generation: self.applied.load(Ordering::Relaxed),
        };
        self.send_now(&FromProxy::Stats(stats));
    }

    /// Sends one message to the agent now (dropped when the agent is not reading).
    fn send_now(&self, m: &FromProxy) {
        if let Ok(mut line) = serde_json::to_string(m) {
            line.push('\n');
            if let Some(tx) = lock(&self.records).as_ref() {
                let _ = tx.try_send(line);
            }
        }
    }

    /// Keeps a request's record for the next batch (counted as dropped beyond `RECORDS_MAX`).
    fn record(&self, r: L7Record) {
        let mut pending = lock(&self.pending);
        if pending.len() >= RECORDS_MAX {
            self.records_dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        pending.push(r);
        if pending.len() == 1 {
            self.pending_ready.notify_one();
        }
    }

    /// Hands the records kept so far to the writing thread.
    fn flush_records(&self) {
        let batch = std::mem::take(&mut *lock(&self.pending));
        let n = batch.len() as u64;
        if n > 0 && self.batches.try_send(batch).is_err() {
            self.records_dropped.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Writes batches of records as JSON lines to the agent's connection (one message for a
    /// batch), on a thread of its own.
    fn write_batches(self: Arc<Self>, rx: std::sync::mpsc::Receiver<Vec<L7Record>>) {
        for batch in rx {
            let n = batch.len() as u64;
            let mut out = String::with_capacity(batch.len() * 512);
            for r in batch {
                if let Ok(line) = serde_json::to_string(&FromProxy::Record(Box::new(r))) {
                    out.push_str(&line);
                    out.push('\n');
                }
            }
            let sent = lock(&self.records)
                .as_ref()
                .is_some_and(|tx| tx.try_send(out).is_ok());
            if !sent {
                self.records_dropped.fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}

/// Keeps the table on disk (`proxy::kept`: never a torn file).
fn keep_table(state_dir: &Path, t: &ProxyTable) {
    let path = super::rules_path(state_dir);
    if let Err(e) = crate::proxy::kept::write(&path, t) {
        tracing::warn!(path = %path.display(), error = %e, "HTTP proxy: cannot keep its table on disk");
    }
}

/// The table a previous run kept; an empty one when it cannot be read (and the log says so)
/// until the agent sends one.
fn kept_table(state_dir: &Path) -> ProxyTable {
    crate::proxy::kept::read(&super::rules_path(state_dir)).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "HTTP proxy: its kept table is unreadable; none until the agent sends one");
        ProxyTable::default()
    })
}

/// The listening sockets: egress and ingress, each on one port for both families.
struct Listeners {
    egress: Vec<std::net::TcpListener>,
    ingress: Vec<std::net::TcpListener>,
    egress_port: u16,
    ingress_port: u16,
}

impl Listeners {
    fn bind(egress_port: u16, ingress_port: u16) -> io::Result<Listeners> {
        let pair = |port: u16, avoid: u16| -> io::Result<(Vec<std::net::TcpListener>, u16)> {
            loop {
                let (socks, got) = crate::proxy::bind_both(port, Type::STREAM, Protocol::TCP)?;
                // The egress port names the marks: ingress may not take the same.
                if port == 0 && got == avoid {
                    continue;
                }
                let out = socks
                    .into_iter()
                    .map(|s: Socket| {
                        s.set_mark(Marks::of(if avoid == 0 { got } else { avoid }).downstream)?;
                        s.listen(1024)?;
                        Ok(s.into())
                    })
                    .collect::<io::Result<Vec<std::net::TcpListener>>>()?;
                return Ok((out, got));
            }
        };
        let (egress, egress_port) = pair(egress_port, 0)?;
        let (ingress, ingress_port) = pair(ingress_port, egress_port)?;
        Ok(Listeners {
            egress,
            ingress,
            egress_port,
            ingress_port,
        })
    }

    fn fds(&self) -> Vec<RawFd> {
        self.egress
            .iter()
            .chain(self.ingress.iter())
            .map(|l| l.as_raw_fd())
            .collect()
    }
}

/// What a proxy hands its successor: the ports, and how many descriptors of each.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Handed {
    egress_port: u16,
    ingress_port: u16,
    egress: usize,
    ingress: usize,
}

/// A successor's side of the hand-over: the running proxy's listeners, if one answers.
fn take_over(state_dir: &Path) -> io::Result<Option<Listeners>> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let Ok(mut s) = std::os::unix::net::UnixStream::connect(super::handover_path(state_dir)) else {
        return Ok(None);
    };
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(b"takeover\n")?;
    let mut buf = [0u8; 512];
    let mut cmsg = nix::cmsg_space!([RawFd; 16]);
    let mut iov = [io::IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty())
        .map_err(io::Error::from)?;
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(v) = c {
            // SAFETY: descriptors just received are ours alone.
            fds.extend(v.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    let n = msg.bytes;
    let h: Handed = serde_json::from_slice(&buf[..n]).map_err(io::Error::other)?;
    if fds.len() != h.egress + h.ingress {
        return Err(io::Error::other(
            "the hand-over brought the wrong number of sockets",
        ));
    }
    let mut l: Vec<std::net::TcpListener> = fds.into_iter().map(Into::into).collect();
    let ingress = l.split_off(h.egress);
    for s in l.iter().chain(ingress.iter()) {
        s.set_nonblocking(true)?;
    }
    // Let the old one know the sockets arrived.
    let _ = s.write_all(b"ok\n");
    Ok(Some(Listeners {
        egress: l,
        ingress,
        egress_port: h.egress_port,
        ingress_port: h.ingress_port,
    }))
}

/// The old proxy's side: hands the listeners to the first successor that asks, then tells
/// `handed`.
fn serve_handover(
    path: PathBuf,
    fds: Vec<RawFd>,
    handed: Handed,
    done: tokio::sync::oneshot::Sender<()>,
) -> io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let _ = std::fs::remove_file(&path);
    let l = std::os::unix::net::UnixListener::bind(&path)?;
    std::thread::Builder::new()
        .name("http-proxy-handover".into())
        .spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                let mut line = [0u8; 9];
                if s.read_exact(&mut line).is_err() || &line != b"takeover\n" {
                    continue;
                }
                let body = serde_json::to_vec(&handed).unwrap_or_default();
                let iov = [io::IoSlice::new(&body)];
                let rights = [ControlMessage::ScmRights(&fds)];
                if sendmsg::<()>(s.as_raw_fd(), &iov, &rights, MsgFlags::empty(), None).is_err() {
                    continue;
                }
                let mut ok = [0u8; 3];
                let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                if s.read_exact(&mut ok).is_ok() {
                    let _ = std::fs::remove_file(&path);
                    let _ = done.send(());
                    return;
                }
            }
        })?;
    Ok(())
}

/// Runs the proxy until SIGTERM/SIGINT, a successor, or until its state directory or pinned
/// maps vanish.
pub fn run(opts: ProxyOptions) -> Result<(), ProxyError> {
    // Every client connection is a file, and so is every upstream connection.
    match crate::limits::raise_fd_limit() {
        Ok((old, new)) => tracing::info!(from = old, to = new, "HTTP proxy: open-file limit"),
        Err(e) => tracing::warn!(error = %e, "HTTP proxy: could not raise the open-file limit"),
    }
    let mut told = false;
    while !opts.pins.join("l7_proxy").exists() || !opts.state_dir.is_dir() {
        if !told {
            tracing::info!(pins = %opts.pins.display(), state_dir = %opts.state_dir.display(), "HTTP proxy: waiting for the agent's pinned maps and state directory");
            told = true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let sock_path = super::socket_path(&opts.state_dir);
    let (listeners, successor) = match take_over(&opts.state_dir) {
        Ok(Some(l)) => (l, true),
        Ok(None) => {
            if std::os::unix::net::UnixStream::connect(&sock_path).is_ok() {
                return Err(ProxyError::AlreadyRunning(opts.state_dir.clone()));
            }
            let l = Listeners::bind(opts.egress_port, opts.ingress_port)
                .map_err(setup("bind the proxy's listeners"))?;
            (l, false)
        }
        Err(e) => {
            return Err(ProxyError::Setup(
                "take the listeners over".into(),
                e.to_string(),
            ))
        }
    };
    // This thread accepts, links to the agent and batches records; each client connection is
    // handed to a serving thread (`Shard`) where its requests, their judging and their upstream
    // connections are tasks of that one thread, so a request costs no wake-up across threads
    // (on a small node those cost more than the proxy's own work).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(setup("start the runtime"))?;
    rt.block_on(serve(opts, listeners, successor))
}

/// The sysctl the hand-over of forwarded packets to the proxy needs off.
const EARLY_DEMUX: &str = "/proc/sys/net/ipv4/tcp_early_demux";

/// The proxy's sockets share their tuples with the flows they serve (transparently). With
/// TCP early demux on, a packet of such a flow that the host stack forwards toward the pod
/// (before to_container sends it back in to the proxy) is matched to the proxy's socket on
/// the way and then dropped by the forwarding path (`ip_forward`: "a packet for a local
/// socket"). So it is turned off in this namespace, and said so.
fn disable_early_demux() -> Result<(), ProxyError> {
    match std::fs::read_to_string(EARLY_DEMUX) {
        Ok(v) if v.trim() == "0" => return Ok(()),
        Ok(_) => {}
        Err(e) => {
            return Err(ProxyError::Setup(
                format!("read {EARLY_DEMUX}"),
                e.to_string(),
            ))
        }
    }
    std::fs::write(EARLY_DEMUX, "0").map_err(|e| {
        ProxyError::Setup(
            format!("set {EARLY_DEMUX} to 0 (forwarded packets of proxied connections would be dropped)"),
            e.to_string(),
        )
    })?;
    tracing::warn!(
        sysctl = "net.ipv4.tcp_early_demux",
        "set to 0: the HTTP proxy's transparent sockets share tuples with the flows the host forwards to it"
    );
    Ok(())
}

async fn serve(
    opts: ProxyOptions,
    listeners: Listeners,
    successor: bool,
) -> Result<(), ProxyError> {
    disable_early_demux()?;
    let marks = Marks::of(listeners.egress_port);
    if !successor {
        crate::proxy::local_delivery(marks.local, true)
            .map_err(|e| ProxyError::Setup("policy routing for the HTTP proxy".into(), e))?;
    }
    let (batches, batches_rx) = std::sync::mpsc::sync_channel(RECORD_BATCHES);
    let proxy = Arc::new(Proxy {
        index: RwLock::new(Arc::new(Index::default())),
        cache: Mutex::new(RuleCache::default()),
        generation: watch::channel(0).0,
        ipcache: Ipcache::open(&opts.pins).map_err(|e| ProxyError::Setup("ipcache".into(), e))?,
        conntrack: Conntrack::open(&opts.pins)
            .map_err(|e| ProxyError::Setup("conntrack".into(), e))?,
        marks,
        state_dir: opts.state_dir.clone(),
        records: Mutex::new(None),
        records_dropped: AtomicU64::new(0),
        applied: AtomicU64::new(0),
        pending: Mutex::new(Vec::new()),
        pending_ready: tokio::sync::Notify::new(),
        batches,
        active: Mutex::new(HashSet::new()),
        shards: (0..shard_count())
            .map(Shard::start)
            .collect::<io::Result<_>>()
            .map_err(setup("start the serving threads"))?,
        next_shard: AtomicUsize::new(0),
        parked_now: AtomicU64::new(0),
    });
    proxy.set_table(&kept_table(&opts.state_dir));
    {
        let p = proxy.clone();
        std::thread::Builder::new()
            .name("http-proxy-records".into())
            .spawn(move || p.write_batches(batches_rx))
            .map_err(setup("start the records thread"))?;
        let p = proxy.clone();
        tokio::spawn(async move {
            loop {
                p.pending_ready.notified().await;
                tokio::time::sleep(RECORD_BATCH).await;
                p.flush_records();
            }
        });
    }
    let sock_path = super::socket_path(&opts.state_dir);
    let _ = std::fs::remove_file(&sock_path);
    let agents = UnixListener::bind(&sock_path)
        .map_err(setup(format!("listen on {}", sock_path.display())))?;
    publish(
        &opts.pins,
        Some((listeners.egress_port, listeners.ingress_port, marks)),
    )?;
    let (handed_tx, mut handed_rx) = tokio::sync::oneshot::channel();
    serve_handover(
        super::handover_path(&opts.state_dir),
        listeners.fds(),
        Handed {
            egress_port: listeners.egress_port,
            ingress_port: listeners.ingress_port,
            egress: listeners.egress.len(),
            ingress: listeners.ingress.len(),
        },
        handed_tx,
    )
    .map_err(setup("serve the hand-over socket"))?;
    tracing::info!(
        egress = listeners.egress_port,
        ingress = listeners.ingress_port,
        mark = marks.local,
        successor,
        "HTTP proxy serving"
    );
    let live = Arc::new(watch::channel(0usize).0);
    let (stop_accepting, accepting) = watch::channel(false);
    let hello = FromProxy::Hello {
        pid: std::process::id(),
        egress_port: listeners.egress_port,
        ingress_port: listeners.ingress_port,
        acks_tables: true,
    };
    let mut accept_tasks = Vec::new();
    for (egress, list) in [(true, listeners.egress), (false, listeners.ingress)] {
        for l in list {
            let l = TcpListener::from_std(l).map_err(setup("register a listener"))?;
            accept_tasks.push(tokio::spawn(accept_loop(
                proxy.clone(),
                l,
                egress,
                live.clone(),
                accepting.clone(),
            )));
        }
    }
    let agent_task = {
        let p = proxy.clone();
        tokio::spawn(async move {
            loop {
                if let Ok((s, _)) = agents.accept().await {
                    tokio::spawn(serve_agent(p.clone(), s, hello.clone()));
                }
            }
        })
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(setup("SIGTERM handler"))?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let handed_over = loop {
        tokio::select! {
            _ = term.recv() => break false,
            _ = tokio::signal::ctrl_c() => break false,
            _ = &mut handed_rx => break true,
            _ = tick.tick() => {
                proxy.send_stats(*live.borrow() as u64);
                if !opts.state_dir.exists() || !opts.pins.join("l7_proxy").exists() {
                    tracing::info!("HTTP proxy: its state directory or maps are gone; exiting");
                    break false;
                }
            }
        }
    };
    // Stop accepting (after a hand-over the successor accepts on the same sockets), stop
    // serving the agent, then let the connections finish.
    let _ = stop_accepting.send(true);
    for t in accept_tasks {
        let _ = t.await;
    }
    agent_task.abort();
    if !handed_over {
        let _ = publish(&opts.pins, None);
        let _ = crate::proxy::local_delivery(marks.local, false);
        let _ = std::fs::remove_file(&sock_path);
        let _ = std::fs::remove_file(super::handover_path(&opts.state_dir));
    }
    tracing::info!(handed_over, "HTTP proxy draining its connections");
    // Each connection was told (`accepting`): HTTP/1.1 ones end after the request in flight,
    // parked ones at once, HTTP/2 ones after a GOAWAY; tunnels (TLS, upgraded connections)
    // when their peers close them.
    let drained = tokio::time::timeout(opts.drain_timeout, async {
        let _ = live.subscribe().wait_for(|n| *n == 0).await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!("HTTP proxy: connections still open after the drain timeout; closed");
    }
    Ok(())
}

/// Accepts redirected connections until told to stop.
async fn accept_loop(
    proxy: Arc<Proxy>,
    l: TcpListener,
    egress: bool,
    live: Arc<watch::Sender<usize>>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            r = l.accept() => {
                let Ok((s, peer)) = r else { continue };
                let Ok(local) = s.local_addr() else { continue };
                let _ = s.set_nodelay(true);
                let Ok(s) = s.into_std() else { continue };
                let (proxy, live, stop) = (proxy.clone(), Live::new(&live), stop.clone());
                let shard = proxy.shard();
                // Registered with the serving thread's runtime, where the connection lives.
                shard.handle.clone().spawn(async move {
                    match TcpStream::from_std(s) {
                        Ok(s) => Conn::new(proxy, shard, egress, peer, local).run(s, live, stop).await,
                        Err(e) => tracing::warn!(error = %e, client = %peer, "HTTP proxy: could not serve a connection"),
                    }
                });
            }
        }
    }
}

/// One redirected connection.
struct Conn {
    proxy: Arc<Proxy>,
    /// The thread it lives on (its upstream connections come from that thread's pool).
    shard: Arc<Shard>,
    egress: bool,
    /// The client (the pod for egress) and the server it asked for.
    client: SocketAddr,
    server: SocketAddr,
    /// `client` and `server` as records name them (written once per connection, not per request).
    names: (Arc<str>, Arc<str>),
    peer_identity: u32,
    /// What the framing tracker found in each HTTP/1.1 request head, in order.
    framing: super::framing::Verdicts,
    /// Requests in flight and answers flushed (parking, `park`).
    exchanges: Arc<Exchanges>,
    /// The server's side of an upgrade the server accepted (`101`), for the connection to
    /// splice once hyper hands the client's side back.
    upgrade: Mutex<Option<hyper::upgrade::OnUpgrade>>,
}

/// Counts a parked connection while it is parked.
struct ParkedNow<'a>(&'a Proxy);

impl<'a> ParkedNow<'a> {
    fn new(p: &'a Proxy) -> ParkedNow<'a> {
        p.parked_now.fetch_add(1, Ordering::Relaxed);
        ParkedNow(p)
    }
}

impl Drop for ParkedNow<'_> {
    fn drop(&mut self) {
        self.0.parked_now.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts one client connection while it lives (the drain waits for none).
struct Live(Arc<watch::Sender<usize>>);

impl Live {
    fn new(t: &Arc<watch::Sender<usize>>) -> Live {
        t.send_modify(|n| *n += 1);
        Live(t.clone())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

enum Sender {
    H1(hyper::client::conn::http1::SendRequest<Incoming>),
    H2(hyper::client::conn::http2::SendRequest<Incoming>),
}

impl Pooled for Sender {
    fn is_closed(&self) -> bool {
        match self {
            Sender::H1(s) => s.is_closed(),
            Sender::H2(s) => s.is_closed(),
        }
    }
    fn is_ready(&self) -> bool {
        match self {
            Sender::H1(s) => s.is_ready(),
            Sender::H2(s) => s.is_ready(),
        }
    }
    fn shared(&self) -> Option<Sender> {
        match self {
            Sender::H1(_) => None,
            Sender::H2(s) => Some(Sender::H2(s.clone())),
        }
    }
}

/// Removes a connection from `Proxy::active` when it ends.
struct Active(Arc<Proxy>, (IpAddr, SocketAddr, u16));

impl Drop for Active {
    fn drop(&mut self) {
        lock(&self.0.active).remove(&self.1);
    }
}

type Body = Either<Incoming, Full<Bytes>>;

/// What the service returns: its future boxed, so that hyper's connection can be polled
/// without shutting the socket down (`poll_without_shutdown` wants it `Unpin`).
type Answer = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Result<Response<Counted<Body>>, std::convert::Infallible>>
            + Send,
    >,
>;

impl Conn {
    fn new(
        proxy: Arc<Proxy>,
        shard: Arc<Shard>,
        egress: bool,
        client: SocketAddr,
        server: SocketAddr,
    ) -> Arc<Conn> {
        let peer = if egress { server.ip() } else { client.ip() };
        let peer_identity = proxy.ipcache.identity(peer);
        Arc::new(Conn {
            proxy,
            shard,
            egress,
            client,
            server,
            names: (client.to_string().into(), server.to_string().into()),
            peer_identity,
            framing: Default::default(),
            exchanges: Default::default(),
            upgrade: Mutex::new(None),
        })
    }

    /// The endpoint's address: the client's for egress, the server's for ingress.
    fn endpoint_ip(&self) -> IpAddr {
        if self.egress {
            self.client.ip()
        } else {
            self.server.ip()
        }
    }

    /// The endpoint's entries for this connection, waiting a little for a table that does
    /// not know the endpoint yet (the datapath may redirect before the table arrives).
    async fn lookup(&self) -> Option<super::Lookup> {
        let now = || {
            self.proxy.index().lookup(
                self.endpoint_ip(),
                self.egress,
                self.peer_identity,
                self.server.port(),
            )
        };
        if let Some(l) = now() {
            return Some(l);
        }
        let deadline = Instant::now() + TABLE_WAIT;
        // Subscribed before looking again: a table that comes in between is not missed.
        let mut gen = self.proxy.generation.subscribe();
        loop {
            if let Some(l) = now() {
                return Some(l);
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            if tokio::time::timeout(left, gen.changed()).await.is_err() {
                return None;
            }
        }
    }

    async fn run(self: Arc<Self>, s: TcpStream, _live: Live, mut stop: watch::Receiver<bool>) {
        let key = (self.client.ip(), self.server, self.client.port());
        lock(&self.proxy.active).insert(key);
        let _active = Active(self.proxy.clone(), key);
        let tls = self.lookup().await.is_some_and(|l| {
            l.grants
                .iter()
                .flatten()
                .any(|g| g.rules.as_ref().is_some_and(|c| c.source().is_tls()))
        });
        // The sub-futures are boxed: a parked connection's task holds only what parking needs.
        if tls {
            Box::pin(self.tls(s)).await;
            return;
        }
        let h2 = tokio::select! {
            h2 = http2_preface(&s) => h2,
            _ = stop.wait_for(|s| *s) => return,
        };
        match h2 {
            Ok(true) => Box::pin(self.serve_h2(s, stop)).await,
            Ok(false) => self.serve_h1(s, stop).await,
            Err(e) => tracing::debug!(error = %e, client = %self.client, "HTTP proxy: no request"),
        }
    }

    /// The service hyper calls for each request of this connection.
    fn service(
        self: &Arc<Self>,
    ) -> impl hyper::service::Service<
        Request<Incoming>,
        Response = Response<Counted<Body>>,
        Error = std::convert::Infallible,
        Future = Answer,
    > + Unpin {
        let me = self.clone();
        hyper::service::service_fn(move |req| {
            let me = me.clone();
            let answer: Answer = Box::pin(async move {
                let request = me.exchanges.begin();
                let r = me.request(req).await;
                Ok(r.map(|b| Counted::new(b, request)))
            });
            answer
        })
    }

    /// HTTP/2: one hyper connection for the connection's life; told to stop, it sends GOAWAY.
    async fn serve_h2(self: &Arc<Self>, s: TcpStream, mut stop: watch::Receiver<bool>) {
        let builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        let conn = builder.serve_connection(TokioIo::new(s), self.service());
        tokio::pin!(conn);
        let mut told = false;
        loop {
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = stop.wait_for(|s| *s), if !told => {
                    told = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }

    /// HTTP/1.1: a hyper connection while requests come, parked between them when idle
    /// (`park`); an upgrade the server accepted is spliced once hyper is done.
    async fn serve_h1(self: &Arc<Self>, s: TcpStream, mut stop: watch::Receiver<bool>) {
        let mut io = Parking::new(
            super::framing::Watched::new(s, self.framing.clone()),
            self.exchanges.clone(),
        );
        loop {
            // Boxed: dropped when parked, it leaves the task small.
            let mut conn = Box::new(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(io), self.service()),
            );
            let mut told = *stop.borrow();
            if told {
                std::pin::Pin::new(&mut *conn).graceful_shutdown();
            }
            let done = loop {
                tokio::select! {
                    r = std::future::poll_fn(|cx| conn.poll_without_shutdown(cx)) => break r,
                    _ = stop.wait_for(|s| *s), if !told => {
                        told = true;
                        std::pin::Pin::new(&mut *conn).graceful_shutdown();
                    }
                }
            };
            let parts = (*conn).into_parts();
            io = parts.io.into_inner();
            let upgrade = lock(&self.upgrade).take();
            if let Some(up) = upgrade {
                splice(io.into_inner().into_inner(), parts.read_buf, up).await;
                return;
            }
            if done.is_err() || !io.take_parked() || told {
                return;
            }
            if !parts.read_buf.is_empty() {
                tracing::warn!(client = %self.client, "HTTP proxy: bytes read past an idle connection's end; closed");
                return;
            }
            self.shard.parked.fetch_add(1, Ordering::Relaxed);
            // Parked: the socket alone waits for the next request (or the client's close).
            let _parked = ParkedNow::new(&self.proxy);
            tokio::select! {
                r = io.get_ref().get_ref().readable() => if r.is_err() { return },
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }

    /// Judges one request and forwards it, or answers it.
    async fn request(self: &Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let started = Instant::now();
        let (mut parts, body) = req.into_parts();
        let grpc = request::is_grpc(&parts.headers);
        let protocol = version_name(parts.version);
        let framing = match super::framing::next(&self.framing) {
            Some(why) => Err(why),
            None => Ok(()),
        };
        let prepared = match framing.and_then(|_| {
            request::prepare(
                &parts.method,
                &mut parts.uri,
                parts.version,
                &mut parts.headers,
            )
        }) {
            Ok(p) => p,
            Err(why) => {
                let p = Prepared {
                    method: parts.method.to_string(),
                    path: parts.uri.to_string(),
                    host: String::new(),
                    url: parts.uri.to_string(),
                };
                self.record(p, protocol, 400, "dropped", vec![], started);
                drain(body).await;
                return left(request::status(StatusCode::BAD_REQUEST, why, grpc));
            }
        };
        let (verdict, grants, audit) = self.judge(&prepared, &parts.headers).await;
        let policies = policy_refs(&verdict, &grants);
        let allowed = verdict.is_allowed();
        if !allowed && !audit {
            let r = request::denied(grpc);
            self.record(prepared, protocol, 403, "dropped", policies, started);
            drain(body).await;
            return left(r);
        }
        if let HttpVerdict::Allowed { matched, .. } = &verdict {
            request::apply_actions(&mut parts.headers, &matched.actions);
        }
        let mut req = Request::from_parts(parts, body);
        strip_hop_by_hop(req.headers_mut());
        let sent = Instant::now();
        let result = self.forward(req).await;
        let server_time = sent.elapsed();
        let word = if allowed { "forwarded" } else { "audit" };
        match result {
            Ok(mut resp) => {
                let code = resp.status().as_u16();
                if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
                    *lock(&self.upgrade) = Some(hyper::upgrade::on(&mut resp));
                }
                strip_hop_by_hop_response(resp.headers_mut());
                let spent = started.elapsed().saturating_sub(server_time);
                self.record_timed(prepared, protocol, code, word, policies, spent);
                resp.map(Either::Left)
            }
            Err(e) => {
                tracing::debug!(error = %e, server = %self.server, "HTTP proxy: upstream failed");
                self.record(prepared, protocol, 503, word, policies, started);
                left(request::status(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "upstream connect error or disconnect/reset before headers",
                    grpc,
                ))
            }
        }
    }

    /// The rules' verdict with the grants it refers to, and whether the endpoint audits (a
    /// denial passes, reported).
    async fn judge(
        &self,
        p: &Prepared,
        headers: &http::HeaderMap,
    ) -> (HttpVerdict, Vec<IndexedGrant>, bool) {
        // An endpoint the table does not know (after a short wait): denied, fail closed.
        let Some(l) = self.lookup().await else {
            let none = HttpVerdict::Denied {
                considered: vec![],
                grants: vec![],
            };
            return (none, vec![], false);
        };
        // No L7 rule applies any more: L3/L4 let the connection through; so do its requests.
        let Some(grants) = l.grants else {
            let l4 = HttpVerdict::AllowedL4 {
                by: "no L7 rule applies".into(),
                grant: usize::MAX,
            };
            return (l4, vec![], l.audit);
        };
        let g: Vec<Grant> = grants
            .iter()
            .map(|g| Grant {
                rule: &g.rule,
                rules: g.rules.as_deref(),
            })
            .collect();
        let h = Headers(headers);
        let view = RequestView {
            method: &p.method,
            path: &p.path,
            host: &p.host,
            headers: &h,
        };
        let v = judge(&g, &view);
        (v, grants, l.audit)
    }

    /// Sends an allowed request on over an idle upstream connection of its key, or a new one.
    /// A request the kept connection turns away unsent (the server closed it meanwhile) goes
    /// on a new one. An upgrade gets a connection of its own, never kept.
    async fn forward(&self, mut req: Request<Incoming>) -> Result<Response<Incoming>, String> {
        let upgrade = req.headers().contains_key(http::header::UPGRADE)
            || req.method() == http::Method::CONNECT;
        let key = self.up_key(req.version());
        loop {
            let kept = match upgrade {
                true => None,
                false => lock(&self.shard.pool).checkout(&key, Instant::now()),
            };
            let fresh = kept.is_none();
            let sender = match kept {
                Some(s) => s,
                None => self.connect(req.version()).await?,
            };
            let sent = match sender {
                Sender::H1(mut s) => {
                    let r = self.shard.spin.answer(s.try_send_request(req)).await;
                    let reusable = r
                        .as_ref()
                        .is_ok_and(|r| r.status() != StatusCode::SWITCHING_PROTOCOLS);
                    if reusable && !upgrade {
                        lock(&self.shard.pool).checkin(key.clone(), Sender::H1(s), Instant::now());
                    }
                    r
                }
                Sender::H2(mut s) => {
                    if fresh {
                        lock(&self.shard.pool).checkin(
                            key.clone(),
                            Sender::H2(s.clone()),
                            Instant::now(),
                        );
                    }
                    self.shard.spin.answer(s.try_send_request(req)).await
                }
            };
            match sent {
                Ok(r) => return Ok(r),
                Err(mut e) => match e.take_message() {
                    Some(r) if !fresh => req = r,
                    _ => return Err(e.into_error().to_string()),
                },
            }
        }
    }

    /// The pool key of this connection's requests of `version`.
    fn up_key(&self, version: Version) -> UpKey {
        let (from, mark) = self.up_from();
        UpKey(from, self.server, mark, version >= Version::HTTP_2)
    }

    /// The address upstream connections are made from (`None`: the node's, for a peer outside
    /// the cluster judged at egress) and their mark.
    fn up_from(&self) -> (Option<IpAddr>, u32) {
        let m = self.proxy.marks;
        let outside = matches!(
            self.peer_identity,
            IDENTITY_WORLD | IDENTITY_WORLD_IPV4 | IDENTITY_WORLD_IPV6
        ) || self.peer_identity & LOCAL_IDENTITY_FLAG != 0;
        let from = (!(self.egress && outside)).then_some(self.client.ip());
        let mark = if self.egress {
            m.upstream_egress
        } else {
            m.upstream_ingress
        };
        (from, mark)
    }

    async fn connect(&self, version: Version) -> Result<Sender, String> {
        let stream = self.connect_tcp().await.map_err(|e| e.to_string())?;
        let io = TokioIo::new(stream);
        if version >= Version::HTTP_2 {
            let (s, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            Ok(Sender::H2(s))
        } else {
            let (s, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| e.to_string())?;
            tokio::spawn(conn.with_upgrades());
            Ok(Sender::H1(s))
        }
    }

    /// The TCP connection to the server, as the pod.
    async fn connect_tcp(&self) -> io::Result<TcpStream> {
        let (from, mark) = self.up_from();
        let endpoint = self
            .egress
            .then(|| self.proxy.index().endpoint_of(self.client.ip()))
            .flatten();
        let active = &self.proxy.active;
        let (client, server) = (self.client.ip(), self.server);
        let busy = move |port: u16| lock(active).contains(&(client, server, port));
        upstream::connect(Upstream {
            from,
            to: self.server,
            mark,
            record: match (from, endpoint) {
                (Some(_), Some(ep)) => Some((&self.proxy.conntrack, ep as u32)),
                _ => None,
            },
            busy: &busy,
        })
        .await
    }

    /// TLS passthrough judged by the ClientHello's server name.
    async fn tls(&self, mut s: TcpStream) {
        let started = Instant::now();
        let mut buf = Vec::with_capacity(1024);
        let sni = tokio::time::timeout(HELLO_TIMEOUT, async {
            loop {
                match client_hello(&buf) {
                    Hello::Incomplete if buf.len() < MAX_HELLO => {}
                    Hello::ServerName(n) => return Some(n),
                    _ => return None,
                }
                let mut chunk = [0u8; 4096];
                match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
        })
        .await
        .ok()
        .flatten();
        let name = sni.clone().flatten().unwrap_or_default();
        let p = Prepared {
            method: String::new(),
            path: String::new(),
            host: name.clone(),
            url: name.clone(),
        };
        let lookup = self.lookup().await;
        let audit = lookup.as_ref().is_some_and(|l| l.audit);
        // A known endpoint with no L7 rule for this peer and port any more: L3/L4 decided.
        let no_rules = lookup.as_ref().is_some_and(|l| l.grants.is_none());
        let grants = lookup.and_then(|l| l.grants).unwrap_or_default();
        let by = grants.iter().find(|g| match &g.rules {
            None => true,
            Some(c) => sni.is_some() && server_name_allowed(&c.source().server_names, &name),
        });
        let policies: Vec<PolicyRef> = match by {
            Some(g) => vec![(*g.policy).clone()],
            None => grants.iter().map(|g| (*g.policy).clone()).collect(),
        };
        let by = by.is_some() || no_rules;
        if !by && !audit {
            self.record(p, "TLS", 0, "dropped", policies, started);
            return;
        }
        let word = if by { "forwarded" } else { "audit" };
        let mut up = match self.connect_tcp().await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(error = %e, "HTTP proxy: TLS upstream failed");
                return;
            }
        };
        self.record(p, "TLS", 0, word, policies, started);
        if up.write_all(&buf).await.is_ok() {
            let _ = tokio::io::copy_bidirectional(&mut s, &mut up).await;
        }
    }

    fn record(
        &self,
        p: Prepared,
        protocol: &'static str,
        code: u16,
        verdict: &'static str,
        policies: Vec<PolicyRef>,
        started: Instant,
    ) {
        self.record_timed(p, protocol, code, verdict, policies, started.elapsed());
    }

    fn record_timed(
        &self,
        p: Prepared,
        protocol: &'static str,
        code: u16,
        verdict: &'static str,
        policies: Vec<PolicyRef>,
        spent: Duration,
    ) {
        let endpoint = self
            .proxy
            .index()
            .endpoint_of(self.endpoint_ip())
            .unwrap_or(0);
        self.proxy.record(L7Record {
            endpoint,
            direction: if self.egress { "egress" } else { "ingress" }.into(),
            verdict: verdict.into(),
            source: self.names.0.clone(),
            destination: self.names.1.clone(),
            port: self.server.port(),
            peer_identity: self.peer_identity,
            http: HttpFields {
                method: p.method,
                url: p.url,
                protocol: protocol.into(),
                code,
            },
            latency_ns: spent.as_nanos() as u64,
            policies,
            time_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0),
        });
    }
}

/// `HTTP/1.1` and the like, as records name a request's version.
fn version_name(v: Version) -> &'static str {
    match v {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_11 => "HTTP/1.1",
        Version::HTTP_2 => "HTTP/2.0",
        Version::HTTP_3 => "HTTP/3.0",
        _ => "HTTP",
    }
}

/// The rules a verdict names, as flows name them (the matching HTTP rule's index included).
fn policy_refs(v: &HttpVerdict, grants: &[IndexedGrant]) -> Vec<PolicyRef> {
    let of = |i: &usize| grants.get(*i).map(|g| (*g.policy).clone());
    match v {
        HttpVerdict::Allowed { grant, matched, .. } => of(grant)
            .map(|mut p| {
                p.http = Some(matched.index);
                vec![p]
            })
            .unwrap_or_default(),
        HttpVerdict::AllowedL4 { grant, .. } => of(grant).into_iter().collect(),
        HttpVerdict::Denied { grants: tried, .. } => tried.iter().filter_map(of).collect(),
    }
}

fn left(r: Response<Full<Bytes>>) -> Response<Body> {
    r.map(Either::Right)
}

/// Reads a refused request's body to its end (discarding it) so the connection can carry the
/// next request.
async fn drain(mut body: Incoming) {
    while let Some(f) = body.frame().await {
        if f.is_err() {
            return;
        }
    }
}

/// Headers about this hop only (RFC 9110 section 7.6.1): hyper frames the next hop itself.
/// An upgrade keeps `Connection: upgrade` and `Upgrade`.
fn strip_hop_by_hop(h: &mut http::HeaderMap) {
    let upgrade = h.contains_key(http::header::UPGRADE);
    let listed: Vec<String> = h
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|t| t.trim().to_ascii_lowercase()))
        .filter(|t| t != "upgrade")
        .collect();
    for n in listed {
        h.remove(n.as_str());
    }
    for n in &HOP_BY_HOP {
        h.remove(n);
    }
    if !upgrade {
        h.remove(http::header::CONNECTION);
    }
}

fn strip_hop_by_hop_response(h: &mut http::HeaderMap) {
    for n in &HOP_BY_HOP {
        h.remove(n);
    }
}

/// Hop-by-hop headers dropped whether or not `Connection` lists them (names made once, not
/// parsed from text on every request).
const HOP_BY_HOP: [http::HeaderName; 3] = [
    http::HeaderName::from_static("keep-alive"),
    http::HeaderName::from_static("proxy-connection"),
    http::header::TRANSFER_ENCODING,
];

/// Both sides of an upgraded connection (WebSocket): the bytes the client sent after its
/// upgrade request first, then bytes flow both ways, judged no further.
async fn splice(mut down: TcpStream, early: Bytes, up: hyper::upgrade::OnUpgrade) {
    let Ok(up) = up.await else {
        return;
    };
    let mut up = TokioIo::new(up);
    if !early.is_empty() && up.write_all(&early).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
}

/// Whether a client connection starts with HTTP/2's preface (prior knowledge), peeked so that
/// hyper reads the connection from its first byte either way.
async fn http2_preface(s: &TcpStream) -> io::Result<bool> {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let deadline = Instant::now() + HELLO_TIMEOUT;
    let mut buf = [0u8; PREFACE.len()];
    loop {
        let n = s.peek(&mut buf).await?;
        if n == 0 || buf[..n] != PREFACE[..n] {
            return Ok(false);
        }
        if n == PREFACE.len() {
            return Ok(true);
        }
        // Part of the preface so far: wait for the rest.
        if Instant::now() > deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "a partial HTTP/2 preface",
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn serve_agent(proxy: Arc<Proxy>, s: UnixStream, hello: FromProxy) {
    let (rd, mut wr) = s.into_split();
    let (tx, mut rx) = mpsc::channel::<String>(RECORD_BATCHES);
    *lock(&proxy.records) = Some(tx);
    // Generations are this connection's agent's: none applied yet.
    proxy.applied.store(0, Ordering::Relaxed);
    proxy.send_now(&hello);
    let writer = tokio::spawn(async move {
        while let Some(lines) = rx.recv().await {
            if wr.write_all(lines.as_bytes()).await.is_err() {
                return;
            }
        }
    });
    let mut lines = BufReader::new(rd).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        match serde_json::from_str::<ToProxy>(&line) {
            Ok(ToProxy::Table(t)) => proxy.apply_table(&t),
            Err(e) => {
                tracing::warn!(error = %e, "HTTP proxy: a line from the agent was not understood")
            }
        }
    }
    writer.abort();
}
