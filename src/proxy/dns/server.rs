//! The DNS proxy process (`ciliate dns-proxy`).
//!
//! - Sockets: UDP and TCP, IPv4 and IPv6, with `IP_TRANSPARENT`, on one port per protocol
//!   (ephemeral unless given). The datapath assigns an endpoint's DNS packets to them without
//!   changing their addresses, so each query arrives with the server the pod asked as its
//!   destination (`IP_RECVORIGDSTADDR` for UDP, the accepted socket's local address for TCP).
//! - Routing: a policy rule `fwmark M lookup T` with `local default dev lo` in table T
//!   delivers the marked packets locally. M and T are `0x0D000000 | udp port`, so every proxy
//!   on a machine owns its own rule and table, and removes them when it exits.
//! - Answers: from the server's address and port (a transparent socket bound to them), with
//!   the query's id; REFUSED ones are made here and never forwarded.
//! - It serves one state directory: its Unix socket there is its lock, and it exits when the
//!   directory or the pinned maps go away.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use libbpf_rs::{MapCore, MapFlags, MapHandle};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream, UdpSocket, UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};

use super::{
    wire, Decision, DnsConn, DnsVerdict, FromProxy, Learned, ProxyRules, RuleIndex, ToProxy,
};
use crate::proxy::{ipv6_transparent, Ipcache};

/// The mark and routing table of a proxy whose UDP port is `port`.
pub fn mark_of(port: u16) -> u32 {
    0x0D00_0000 | port as u32
}

/// The acked (name, address) pairs are pruned of expired ones past this many.
const KNOWN_PRUNE_AT: usize = 100_000;

/// UDP queries waiting for their servers at once, at most.
const MAX_IN_FLIGHT: usize = 8192;

/// How long a forwarded UDP query waits for its server.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);

/// A pod's TCP connection to the proxy is closed after this long without a query.
const TCP_IDLE: Duration = Duration::from_secs(10);

/// Learnings kept for an absent agent, at most.
const QUEUE_MAX: usize = 10_000;

#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// The agent's state directory (socket, kept rules).
    pub state_dir: PathBuf,
    /// The agent's pinned maps (`<bpf-root>/ciliate`).
    pub pins: PathBuf,
    /// 0: ephemeral.
    pub udp_port: u16,
    pub tcp_port: u16,
    /// How long an answer waits for the agent to realize its addresses.
    pub learn_timeout: Duration,
    /// Each pod's share (`--max-qps-per-pod`).
    pub source_limits: super::limit::SourceLimits,
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("a DNS proxy already serves {0}")]
    AlreadyRunning(PathBuf),
    #[error("{0}: {1}")]
    Setup(String, String),
}

fn setup<E: std::fmt::Display>(what: impl Into<String>) -> impl FnOnce(E) -> ProxyError {
    let what = what.into();
    move |e| ProxyError::Setup(what, e.to_string())
}

/// Writes the proxy's ports and mark into the pinned `dns_proxy` map (mark 0: no proxy).
fn publish(pins: &Path, udp: u16, tcp: u16, mark: u32) -> Result<(), ProxyError> {
    let path = pins.join("dns_proxy");
    let map = MapHandle::from_pinned_path(&path)
        .map_err(setup(format!("open pinned map {}", path.display())))?;
    let mut v = udp.to_ne_bytes().to_vec();
    v.extend_from_slice(&tcp.to_ne_bytes());
    v.extend_from_slice(&mark.to_ne_bytes());
    map.update(&0u32.to_ne_bytes(), &v, MapFlags::ANY)
        .map_err(setup("write the dns_proxy map"))
}

/// A query to forward: its question, the endpoint and pod that asked, the allowing policies.
type Forward = (wire::Question, u64, String, Vec<String>);

struct Proxy {
    rules: RwLock<RuleIndex>,
    ipcache: Ipcache,
    state_dir: PathBuf,
    /// Lines to the connected agent.
    agent: Mutex<Option<mpsc::UnboundedSender<String>>>,
    /// (normalized name, address) -> the expiry the agent acked (seconds since the epoch).
    known: Mutex<HashMap<(String, IpAddr), u64>>,
    /// Permits for UDP queries in flight (`MAX_IN_FLIGHT`).
    in_flight: Arc<tokio::sync::Semaphore>,
    /// (endpoint, normalized name) pairs the agent acked: it knows they asked.
    askers: Mutex<std::collections::HashSet<(u64, String)>>,
    /// Learnings sent to the agent and not acked yet, with their held answers.
    waiting: Mutex<HashMap<u64, (Learned, oneshot::Sender<()>)>>,
    /// Learned while no agent was connected: sent when one connects.
    queued: Mutex<Vec<Learned>>,
    seq: AtomicU64,
    learn_timeout: Duration,
    /// Each pod's share of the proxy (`limit`).
    limiter: Arc<super::limit::SourceLimiter>,
    /// Transparent sockets bound to the servers pods asked (an answer's source), kept for the
    /// next answer from the same server instead of one socket per answer. A pod chooses the
    /// server address, so there are at most `REPLY_SOCKETS` (then all are dropped and made
    /// anew).
    replies: Mutex<Kept<SocketAddr, Arc<Socket>>>,
    /// Sockets to the servers pods asked, shared by their queries.
    upstreams: super::upstream::Upstreams,
}

/// Answer sockets kept at most.
const REPLY_SOCKETS: usize = 256;

/// Values kept by key, at most `max` of them: past that, all are dropped and made anew (what a
/// pod can make the proxy keep is bounded; a pod cycling through addresses costs itself new
/// sockets, not the proxy memory).
struct Kept<K, V> {
    map: HashMap<K, V>,
    max: usize,
}

impl<K: std::hash::Hash + Eq + Copy, V: Clone> Kept<K, V> {
    fn new(max: usize) -> Self {
        Kept {
            map: HashMap::new(),
            max,
        }
    }

    /// The value kept for `k`, or a new one from `make` (kept unless making it failed).
    fn get_or_make<E>(&mut self, k: K, make: impl FnOnce() -> Result<V, E>) -> Result<V, E> {
        if let Some(v) = self.map.get(&k) {
            return Ok(v.clone());
        }
        if self.map.len() >= self.max {
            self.map.clear();
        }
        let v = make()?;
        self.map.insert(k, v.clone());
        Ok(v)
    }

    fn forget(&mut self, k: &K) {
        self.map.remove(k);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
    }
}

impl Proxy {
    /// Sends `answer` to `to` from `from` (the server the pod asked).
    fn reply(&self, from: SocketAddr, to: SocketAddr, answer: &[u8]) -> io::Result<()> {
        let replies = || self.replies.lock().unwrap_or_else(|p| p.into_inner());
        let s = replies().get_or_make(from, || answer_socket(from).map(Arc::new))?;
        s.send_to(answer, &to.into()).map(|_| ()).inspect_err(|_| {
            // A socket that failed is not kept: the next answer makes a new one.
            replies().forget(&from);
        })
    }

    fn to_agent(&self, m: &FromProxy) -> bool {
        let Ok(line) = serde_json::to_string(m) else {
            return false;
        };
        match self
            .agent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            Some(tx) => tx.send(line).is_ok(),
            None => false,
        }
    }

    /// Are all of `ips` in policy for `name` (acked by the agent, not expired)? The agent
    /// keeps an address selected until the expiry it acked with, so the answer needs no wait.
    fn known(&self, name: &str, ips: &[IpAddr]) -> bool {
        let now = crate::policy::fqdn::unix_now();
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let name = crate::policy::fqdn::normalize(name);
        ips.iter().all(|ip| {
            known
                .get(&(name.clone(), *ip))
                .is_some_and(|exp| *exp > now + 1)
        })
    }

    /// Would telling the agent about this answer change nothing it acked: the same endpoint
    /// asked before, and every address is acked to live past this answer's TTL?
    fn nothing_new(&self, endpoint: u64, name: &str, ips: &[IpAddr], ttl: u32) -> bool {
        let name = crate::policy::fqdn::normalize(name);
        let asked = self
            .askers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&(endpoint, name.clone()));
        let until = crate::policy::fqdn::unix_now() + ttl as u64;
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        asked
            && ips.iter().all(|ip| {
                known
                    .get(&(name.clone(), *ip))
                    .is_some_and(|exp| *exp >= until)
            })
    }

    /// The agent acked `l`: its addresses stay selected until `expires_at`.
    fn acked(&self, l: &Learned, expires_at: u64) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let name = crate::policy::fqdn::normalize(&l.name);
        for ip in &l.ips {
            known.insert((name.clone(), *ip), expires_at);
        }
        let mut askers = self.askers.lock().unwrap_or_else(|p| p.into_inner());
        askers.insert((l.endpoint, name));
        if known.len() > KNOWN_PRUNE_AT || askers.len() > KNOWN_PRUNE_AT {
            let now = crate::policy::fqdn::unix_now();
            known.retain(|_, exp| *exp > now);
            askers.clear(); // they are told again, once each
        }
    }

    /// Tells the agent about an allowed answer and waits (bounded) until it realized it; not
    /// at all when the agent acked these addresses for this name before (the agent is still
    /// told: their expiry and askers move on).
    async fn learn(&self, endpoint: u64, name: &str, ips: Vec<IpAddr>, ttl: u32) {
        if ips.is_empty() {
            return;
        }
        if self.nothing_new(endpoint, name, &ips, ttl) {
            return; // in policy, and the agent's cache would not change
        }
        let wait = !self.known(name, &ips);
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let l = Learned {
            seq,
            endpoint,
            name: name.to_string(),
            ips,
            ttl,
        };
        let (tx, rx) = oneshot::channel();
        self.waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(seq, (l.clone(), tx));
        if !self.to_agent(&FromProxy::Learn(l.clone())) {
            self.waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&seq);
            self.queue(vec![l]);
            return;
        }
        if !wait {
            return;
        }
        if tokio::time::timeout(self.learn_timeout, rx).await.is_err() {
            self.waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&seq);
            tracing::warn!(
                name,
                seq,
                "the agent did not realize a DNS answer in time; released"
            );
        }
    }

    /// Keeps learnings for the agent's return (the oldest go first past `QUEUE_MAX`).
    fn queue(&self, learned: Vec<Learned>) {
        let mut q = self.queued.lock().unwrap_or_else(|p| p.into_inner());
        q.extend(learned);
        if q.len() > QUEUE_MAX {
            let extra = q.len() - QUEUE_MAX;
            q.drain(..extra);
            tracing::warn!(dropped = extra, "DNS proxy: learnings queued for the agent overflowed; the oldest are dropped (their names are learned again from the next answers)");
        }
    }

    fn decide(&self, src: IpAddr, dst: SocketAddr, protocol: u8, name: &str) -> Decision {
        let server = self.ipcache.identity(dst.ip());
        self.rules.read().unwrap_or_else(|p| p.into_inner()).decide(
            src,
            server,
            protocol,
            dst.port(),
            name,
        )
    }

    /// Decides a query; returns the answer to send now (REFUSED, FORMERR), or `None` to forward.
    fn judge(&self, query: &[u8], conn: DnsConn) -> (Option<Vec<u8>>, Option<Forward>) {
        let Some(q) = wire::question(query) else {
            return (wire::formerr(query), None);
        };
        let (src, dst, protocol) = (conn.client.ip(), conn.server, conn.protocol);
        match self.decide(src, dst, protocol, &q.name) {
            Decision::Refuse {
                endpoint,
                pod,
                policies,
            } => {
                let started = Instant::now();
                let answer = wire::refused(query);
                self.report(
                    &q,
                    conn,
                    endpoint,
                    &pod,
                    vec![],
                    "refused",
                    policies,
                    started.elapsed(),
                );
                (answer, None)
            }
            Decision::Forward {
                endpoint,
                pod,
                policies,
            } => (None, Some((q, endpoint, pod, policies))),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn report(
        &self,
        q: &wire::Question,
        conn: DnsConn,
        endpoint: u64,
        pod: &str,
        answers: Vec<IpAddr>,
        verdict: &str,
        policies: Vec<String>,
        spent: Duration,
    ) {
        self.to_agent(&FromProxy::Verdict(DnsVerdict {
            endpoint,
            fields: crate::datapath::events::DnsFields {
                pod: pod.to_string(),
                query: q.name.clone(),
                qtype: q.qtype.clone(),
                answers: answers.iter().map(|a| a.to_string()).collect(),
                verdict: verdict.into(),
                policies,
            },
            processing_seconds: spent.as_secs_f64(),
            conn: Some(conn),
        }));
    }

    /// After the upstream answered a forwarded query: learn, then report.
    #[allow(clippy::too_many_arguments)]
    async fn answered(
        &self,
        q: &wire::Question,
        conn: DnsConn,
        endpoint: u64,
        pod: &str,
        policies: Vec<String>,
        answer: &[u8],
        mut spent: Duration,
    ) {
        let started = Instant::now();
        let (ips, ttl) = wire::addresses(answer, q).unwrap_or_default();
        self.learn(endpoint, &q.name, ips.clone(), ttl).await;
        spent += started.elapsed();
        self.report(q, conn, endpoint, pod, ips, "forwarded", policies, spent);
    }
}

/// The four listening sockets: UDP and TCP, each on one port for both families.
struct Listeners {
    udp: Vec<UdpSocket>,
    tcp: Vec<TcpListener>,
    udp_port: u16,
    tcp_port: u16,
}

fn listeners(udp_port: u16, tcp_port: u16) -> io::Result<Listeners> {
    let (udp, udp_port) = crate::proxy::bind_both(udp_port, Type::DGRAM, Protocol::UDP)?;
    for s in &udp {
        if s.domain()? == Domain::IPV4 {
            nix::sys::socket::setsockopt(s, nix::sys::socket::sockopt::Ipv4OrigDstAddr, &true)
        } else {
            nix::sys::socket::setsockopt(s, nix::sys::socket::sockopt::Ipv6OrigDstAddr, &true)
        }
        .map_err(io::Error::from)?;
    }
    let (tcp, tcp_port) = crate::proxy::bind_both(tcp_port, Type::STREAM, Protocol::TCP)?;
    let mut tcp_listeners = Vec::new();
    for s in tcp {
        s.listen(1024)?;
        tcp_listeners.push(TcpListener::from_std(s.into())?);
    }
    Ok(Listeners {
        udp: udp
            .into_iter()
            .map(|s| UdpSocket::from_std(s.into()))
            .collect::<io::Result<_>>()?,
        tcp: tcp_listeners,
        udp_port,
        tcp_port,
    })
}

/// One datagram with its sender and the destination it was sent to.
fn recv_with_dst(fd: i32, buf: &mut [u8]) -> io::Result<(usize, SocketAddr, SocketAddr)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags, SockaddrStorage};
    let mut iov = [io::IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!(nix::libc::sockaddr_in6);
    let msg = recvmsg::<SockaddrStorage>(fd, &mut iov, Some(&mut space), MsgFlags::empty())
        .map_err(io::Error::from)?;
    let mut dst = None;
    for c in msg.cmsgs().map_err(io::Error::from)? {
        match c {
            ControlMessageOwned::Ipv4OrigDstAddr(a) => {
                dst = Some(SocketAddr::from((
                    Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                    u16::from_be(a.sin_port),
                )))
            }
            ControlMessageOwned::Ipv6OrigDstAddr(a) => {
                dst = Some(SocketAddr::from((
                    Ipv6Addr::from(a.sin6_addr.s6_addr),
                    u16::from_be(a.sin6_port),
                )))
            }
            _ => {}
        }
    }
    let src = msg.address.and_then(|a| {
        a.as_sockaddr_in()
            .map(|s| SocketAddr::from((s.ip(), s.port())))
            .or_else(|| {
                a.as_sockaddr_in6()
                    .map(|s| SocketAddr::from((s.ip(), s.port())))
            })
    });
    let n = msg.bytes;
    match (src, dst) {
        (Some(s), Some(d)) => Ok((n, s, d)),
        _ => Err(io::Error::other("a datagram without its addresses")),
    }
}

/// A transparent socket bound to `from` (a server's address and port) that answers pods in its
/// name. It only sends: the pods' queries reach the proxy's own socket (assigned by the
/// datapath), so its receive buffer is kept to the minimum.
fn answer_socket(from: SocketAddr) -> io::Result<Socket> {
    let s = Socket::new(Domain::for_address(from), Type::DGRAM, Some(Protocol::UDP))?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.set_ip_transparent(true)?;
    if from.is_ipv6() {
        ipv6_transparent(&s)?;
    }
    s.set_recv_buffer_size(0)?;
    s.bind(&from.into())?;
    Ok(s)
}

/// Asks the server the pod asked, over UDP, and waits for its answer to this question.
async fn upstream_udp(
    up: &super::upstream::Upstreams,
    dst: SocketAddr,
    q: &wire::Question,
) -> io::Result<Vec<u8>> {
    let answer = up.ask(dst, &q.forward, UPSTREAM_TIMEOUT).await?;
    if wire::addresses(&answer, q).is_none() {
        return Err(io::Error::other("the DNS server's answer is unreadable"));
    }
    Ok(answer)
}

/// A pod over its share: logged at its first drop and every 10,000th.
fn over_share(src: IpAddr, refusal: super::limit::Refusal) {
    use super::limit::Refusal;
    let (Refusal::Rate { dropped } | Refusal::InFlight { dropped }) = refusal;
    if dropped == 1 || dropped % 10_000 == 0 {
        tracing::warn!(%src, ?refusal, "DNS proxy: a pod is over its share (--max-qps-per-pod); its excess queries are dropped and its resolver retries");
    }
}

async fn serve_udp(proxy: Arc<Proxy>, sock: Arc<UdpSocket>) {
    let mut buf = vec![0u8; 65535];
    loop {
        let fd = sock.as_raw_fd();
        let got = sock
            .async_io(tokio::io::Interest::READABLE, || {
                recv_with_dst(fd, &mut buf)
            })
            .await;
        let (n, src, dst) = match got {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(error = %e, "DNS proxy: unreadable datagram");
                continue;
            }
        };
        // Each pod's share first: a flooding pod's excess is dropped before it takes any of
        // the proxy's time or its in-flight permits.
        let share = match proxy.limiter.admit(src.ip(), Instant::now()) {
            Ok(share) => share,
            Err(refusal) => {
                over_share(src.ip(), refusal);
                continue;
            }
        };
        let query = buf[..n].to_vec();
        let proxy = proxy.clone();
        // Bounded: past `MAX_IN_FLIGHT` queries waiting for their servers, new ones are dropped
        // (the pod's resolver retries), so a flood cannot grow the proxy without bound.
        let Ok(permit) = proxy.in_flight.clone().try_acquire_owned() else {
            tracing::debug!(%src, "DNS proxy: too many queries in flight; dropped");
            continue;
        };
        tokio::spawn(async move {
            let (_permit, _share) = (permit, share);
            let started = Instant::now();
            let conn = DnsConn {
                client: src,
                server: dst,
                protocol: 17,
            };
            let (now, forward) = proxy.judge(&query, conn);
            if let Some(answer) = now {
                let _ = proxy.reply(dst, src, &answer);
                return;
            }
            let Some((q, endpoint, pod, policies)) = forward else {
                return;
            };
            let spent = started.elapsed();
            match upstream_udp(&proxy.upstreams, dst, &q).await {
                Ok(answer) => {
                    proxy
                        .answered(&q, conn, endpoint, &pod, policies, &answer, spent)
                        .await;
                    if let Err(e) = proxy.reply(dst, src, &answer) {
                        tracing::warn!(error = %e, %dst, %src, "DNS proxy: cannot answer the pod");
                    }
                }
                Err(e) => tracing::debug!(error = %e, %dst, "DNS proxy: upstream failed"),
            }
        });
    }
}

async fn read_frame(s: &mut TcpStream) -> io::Result<Vec<u8>> {
    let n = s.read_u16().await? as usize;
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf).await?;
    Ok(buf)
}

async fn write_frame(s: &mut TcpStream, m: &[u8]) -> io::Result<()> {
    let mut out = (m.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(m);
    s.write_all(&out).await
}

/// One pod's TCP connection: each framed query is judged; allowed ones go over one upstream
/// connection to the server the pod asked.
async fn serve_tcp_conn(proxy: Arc<Proxy>, mut pod: TcpStream, src: SocketAddr) -> io::Result<()> {
    let dst = pod.local_addr()?;
    let mut upstream: Option<TcpStream> = None;
    loop {
        // An idle connection is closed (as DNS servers do): a pod cannot hold sockets forever.
        let query = tokio::time::timeout(TCP_IDLE, read_frame(&mut pod))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "idle"))??;
        let started = Instant::now();
        let conn = DnsConn {
            client: src,
            server: dst,
            protocol: 6,
        };
        let (now, forward) = proxy.judge(&query, conn);
        if let Some(answer) = now {
            write_frame(&mut pod, &answer).await?;
            continue;
        }
        let Some((q, endpoint, pod_name, policies)) = forward else {
            continue;
        };
        let spent = started.elapsed();
        if upstream.is_none() {
            upstream = Some(TcpStream::connect(dst).await?);
        }
        let up = upstream.as_mut().expect("just connected");
        write_frame(up, &q.forward).await?;
        let answer = tokio::time::timeout(Duration::from_secs(5), read_frame(up))
            .await
            .map_err(|_| {
                io::Error::new(io::ErrorKind::TimedOut, "the DNS server did not answer")
            })??;
        proxy
            .answered(&q, conn, endpoint, &pod_name, policies, &answer, spent)
            .await;
        write_frame(&mut pod, &answer).await?;
    }
}

async fn serve_tcp(proxy: Arc<Proxy>, l: TcpListener) {
    loop {
        match l.accept().await {
            Ok((s, src)) => {
                tokio::spawn(serve_tcp_conn(proxy.clone(), s, src));
            }
            Err(e) => tracing::debug!(error = %e, "DNS proxy: accept"),
        }
    }
}

/// One agent connection: rules and acks in; hello, queued learnings, learnings and verdicts
/// out. A new connection replaces the old one.
async fn serve_agent(proxy: Arc<Proxy>, s: UnixStream, hello: FromProxy) {
    let (rd, mut wr) = s.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let queued: Vec<Learned> =
        std::mem::take(&mut *proxy.queued.lock().unwrap_or_else(|p| p.into_inner()));
    let mut first = vec![serde_json::to_string(&hello).unwrap_or_default()];
    first.extend(
        queued
            .into_iter()
            .filter_map(|l| serde_json::to_string(&FromProxy::Learn(l)).ok()),
    );
    for line in first {
        let _ = tx.send(line);
    }
    // A new agent may know less than the last one (say, a cache it could not restore): every
    // answer waits for its ack again until it acked it.
    proxy
        .known
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clear();
    *proxy.agent.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
    let writer = tokio::spawn(async move {
        while let Some(mut line) = rx.recv().await {
            line.push('\n');
            if wr.write_all(line.as_bytes()).await.is_err() {
                break;
            }
        }
    });
    let mut lines = BufReader::new(rd).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        match serde_json::from_str::<ToProxy>(&line) {
            Ok(ToProxy::Rules(r)) => {
                keep_rules(&proxy.state_dir, &r);
                let generation = r.generation;
                *proxy.rules.write().unwrap_or_else(|p| p.into_inner()) = RuleIndex::new(r);
                // From now on queries are decided by these rules: the agent may say realized.
                proxy.to_agent(&FromProxy::Applied { generation });
            }
            Ok(ToProxy::Ack { seq, expires_at }) => {
                let w = proxy
                    .waiting
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&seq);
                if let Some((l, done)) = w {
                    proxy.acked(&l, expires_at);
                    let _ = done.send(());
                }
            }
            Err(e) => tracing::warn!(error = %e, "DNS proxy: unreadable line from the agent"),
        }
    }
    writer.abort();
    *proxy.agent.lock().unwrap_or_else(|p| p.into_inner()) = None;
    // Answers held for this agent are released now, not at their timeout: it will not ack
    // (it stopped or was killed). What they taught goes to the queue for the next agent.
    let held: Vec<_> = proxy
        .waiting
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .drain()
        .map(|(_, v)| v)
        .collect();
    let mut learned = Vec::new();
    for (l, w) in held {
        learned.push(l);
        let _ = w.send(());
    }
    proxy.queue(learned);
    tracing::info!("DNS proxy: the agent disconnected; serving with the last rules");
}

/// Keeps the rules on disk (`proxy::kept`: never a torn file).
fn keep_rules(state_dir: &Path, r: &ProxyRules) {
    let path = super::rules_path(state_dir);
    if let Err(e) = crate::proxy::kept::write(&path, r) {
        tracing::warn!(path = %path.display(), error = %e, "DNS proxy: cannot keep its rules on disk");
    }
}

/// The rules a previous run kept; none when they cannot be read (and the log says so) until
/// the agent sends them.
fn kept_rules(state_dir: &Path) -> ProxyRules {
    crate::proxy::kept::read(&super::rules_path(state_dir)).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "DNS proxy: its kept rules are unreadable; none until the agent sends them");
        ProxyRules::default()
    })
}

/// Runs the proxy until SIGTERM/SIGINT, or until its state directory or pinned maps vanish.
pub fn run(opts: ProxyOptions) -> Result<(), ProxyError> {
    let sock_path = super::socket_path(&opts.state_dir);
    if std::os::unix::net::UnixStream::connect(&sock_path).is_ok() {
        return Err(ProxyError::AlreadyRunning(opts.state_dir.clone()));
    }
    // A container of its own may start before the agent pinned its maps: wait for them.
    let mut told = false;
    while !opts.pins.join("dns_proxy").exists() || !opts.state_dir.is_dir() {
        if !told {
            tracing::info!(pins = %opts.pins.display(), state_dir = %opts.state_dir.display(), "DNS proxy: waiting for the agent's pinned maps and state directory");
            told = true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = std::fs::remove_file(&sock_path);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(setup("start the runtime"))?;
    rt.block_on(async move {
        let l = listeners(opts.udp_port, opts.tcp_port).map_err(setup("bind the proxy sockets"))?;
        let mark = mark_of(l.udp_port);
        super::super::local_delivery(mark, true)
            .map_err(setup("policy routing for the DNS proxy"))?;
        let proxy = Arc::new(Proxy {
            rules: RwLock::new(RuleIndex::new(kept_rules(&opts.state_dir))),
            ipcache: Ipcache::open(&opts.pins).map_err(setup("open the pinned ipcache"))?,
            state_dir: opts.state_dir.clone(),
            agent: Mutex::new(None),
            waiting: Mutex::new(HashMap::new()),
            known: Mutex::new(HashMap::new()),
            askers: Mutex::new(Default::default()),
            in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT)),
            queued: Mutex::new(Vec::new()),
            seq: AtomicU64::new(0),
            learn_timeout: opts.learn_timeout,
            limiter: super::limit::SourceLimiter::new(opts.source_limits),
            replies: Mutex::new(Kept::new(REPLY_SOCKETS)),
            upstreams: Default::default(),
        });
        let agents = UnixListener::bind(&sock_path)
            .map_err(setup(format!("listen on {}", sock_path.display())))?;
        publish(&opts.pins, l.udp_port, l.tcp_port, mark)?;
        tracing::info!(
            udp = l.udp_port,
            tcp = l.tcp_port,
            mark,
            "DNS proxy serving"
        );
        for u in l.udp {
            tokio::spawn(serve_udp(proxy.clone(), Arc::new(u)));
        }
        for t in l.tcp {
            tokio::spawn(serve_tcp(proxy.clone(), t));
        }
        let hello = FromProxy::Hello {
            pid: std::process::id(),
            udp_port: l.udp_port,
            tcp_port: l.tcp_port,
            acks_rules: true,
        };
        let p = proxy.clone();
        tokio::spawn(async move {
            loop {
                if let Ok((s, _)) = agents.accept().await {
                    tokio::spawn(serve_agent(p.clone(), s, hello.clone()));
                }
            }
        });
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(setup("SIGTERM handler"))?;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = tokio::signal::ctrl_c() => break,
                _ = tick.tick() => {
                    if !opts.state_dir.exists() || !opts.pins.join("dns_proxy").exists() {
                        tracing::info!("DNS proxy: its state directory or maps are gone; exiting");
                        break;
                    }
                }
            }
        }
        let _ = publish(&opts.pins, 0, 0, 0);
        let _ = super::super::local_delivery(mark, false);
        let _ = std::fs::remove_file(&sock_path);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_sockets_kept_are_bounded_however_many_servers_pods_name() {
        let mut kept: Kept<SocketAddr, u32> = Kept::new(REPLY_SOCKETS);
        let mut made = 0u32;
        // A pod naming 10,000 distinct servers (addresses it chose) in turn.
        for i in 0..10_000u32 {
            let server = SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 53));
            kept.get_or_make(server, || {
                made += 1;
                Ok::<_, ()>(i)
            })
            .unwrap();
            assert!(kept.len() <= REPLY_SOCKETS, "{} kept", kept.len());
        }
        assert_eq!(made, 10_000);
        // The usual case: one server, one socket made and reused.
        let dns: SocketAddr = "10.96.0.10:53".parse().unwrap();
        let first = kept.get_or_make(dns, || Ok::<_, ()>(7)).unwrap();
        let again = kept.get_or_make(dns, || Ok::<_, ()>(8)).unwrap();
        assert_eq!((first, again), (7, 7));
        // A value that could not be made is not kept; one forgotten is made anew.
        let other: SocketAddr = "10.96.0.11:53".parse().unwrap();
        assert_eq!(kept.get_or_make(other, || Err::<u32, _>("no")), Err("no"));
        assert_eq!(kept.get_or_make(other, || Ok::<_, &str>(9)), Ok(9));
        kept.forget(&other);
        assert_eq!(kept.get_or_make(other, || Ok::<_, &str>(10)), Ok(10));
    }
}
