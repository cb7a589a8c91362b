//! Queries to the servers pods asked, over UDP, on shared sockets.
//!
//! Each server gets one connected socket at a time, shared by all queries to it; a reader task
//! hands each answer to the query waiting for it. Until 2026-11 every query bound, connected,
//! registered and closed a socket of its own: a sixth of the proxy's time at 16,000 queries/s.
//!
//! - **Ids.** A query goes out under an id of the proxy's, drawn at random among those not in
//!   flight on its socket, and its answer gets the pod's id back. Pods choose their ids, so two
//!   pods asking one server under one id stay apart.
//! - **Ports.** A socket serves `ROTATE_AFTER` queries or `ROTATE_AGE`, then a new one (a new
//!   random port) takes over while the old one drains: an off-path attacker must guess the
//!   port and the id of a short-lived socket, as with one socket per query. The kernel only
//!   delivers datagrams from the server's address and port to a connected socket.
//! - **Errors.** A socket whose receive fails (an ICMP error from the server, say) is retired
//!   and its waiting queries fail at once (the pods' resolvers retry); the next query opens a
//!   new one.
//! - **Bounds.** A pod chooses the server address: at most `MAX_SERVERS` servers have a socket;
//!   past that, all are retired and made anew. A retired socket's reader ends once no query
//!   waits on it; a query waits at most its timeout.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;
use tokio::sync::oneshot;

use crate::proxy::lock;

/// Queries one socket sends before a new one takes over.
pub const ROTATE_AFTER: u32 = 1024;

/// How long one socket takes new queries, at most (a quiet server's port does not live on).
pub const ROTATE_AGE: Duration = Duration::from_secs(60);

/// Servers with a socket at once, at most.
pub const MAX_SERVERS: usize = 256;

/// How often a retired socket's reader checks whether any query still waits on it.
const DRAIN_CHECK: Duration = Duration::from_secs(1);

/// A query's waiter: its token (see `Waiter`) and where its answer goes.
type Waiting = (u64, oneshot::Sender<Vec<u8>>);

/// One connected socket and the queries waiting on it, by the id they went out under.
struct Conn {
    sock: UdpSocket,
    /// By id: the waiter's token (see `Waiter`) and where its answer goes.
    waiting: Mutex<HashMap<u16, Waiting>>,
    /// Tokens of waiters.
    tokens: AtomicU64,
    /// Queries sent (for `ROTATE_AFTER`).
    sent: AtomicU32,
    opened: Instant,
    /// No new query uses it: rotated, evicted, or its socket failed.
    retired: AtomicBool,
}

impl Conn {
    async fn open(server: SocketAddr) -> io::Result<Arc<Conn>> {
        let any: SocketAddr = if server.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let sock = UdpSocket::bind(any).await?;
        sock.connect(server).await?;
        let c = Arc::new(Conn {
            sock,
            waiting: Mutex::new(HashMap::new()),
            sent: AtomicU32::new(0),
            opened: Instant::now(),
            tokens: AtomicU64::new(0),
            retired: AtomicBool::new(false),
        });
        tokio::spawn(read_answers(c.clone()));
        Ok(c)
    }

    fn usable(&self) -> bool {
        !self.retired.load(Ordering::Acquire)
            && self.sent.load(Ordering::Relaxed) < ROTATE_AFTER
            && self.opened.elapsed() < ROTATE_AGE
    }

    /// Registers a waiter under an id not in flight here; `None` when the socket is full (it
    /// cannot be: at most `ROTATE_AFTER` queries ever use it).
    fn register(&self, ids: &Ids) -> Option<(Waiter<'_>, oneshot::Receiver<Vec<u8>>)> {
        let token = self.tokens.fetch_add(1, Ordering::Relaxed);
        let mut w = lock(&self.waiting);
        for _ in 0..64 {
            let id = ids.next();
            if let std::collections::hash_map::Entry::Vacant(e) = w.entry(id) {
                let (tx, rx) = oneshot::channel();
                e.insert((token, tx));
                let waiter = Waiter {
                    conn: self,
                    id,
                    token,
                };
                return Some((waiter, rx));
            }
        }
        None
    }

    fn idle(&self) -> bool {
        lock(&self.waiting).is_empty()
    }
}

/// Removes a query's waiter when the query ends, timed out or cancelled. Once answered, its id
/// may already serve another query: only an entry with its own token is removed.
struct Waiter<'a> {
    conn: &'a Conn,
    id: u16,
    token: u64,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        let mut w = lock(&self.conn.waiting);
        if w.get(&self.id).is_some_and(|(t, _)| *t == self.token) {
            w.remove(&self.id);
        }
    }
}

/// Hands each answer on `c` to the query waiting under its id; ends when `c` is retired and
/// nothing waits, or when its socket fails (its waiters then fail at once).
async fn read_answers(c: Arc<Conn>) {
    // Room for the largest datagram, not zeroed: recv_buf fills the spare capacity.
    let mut buf = Vec::with_capacity(65535);
    loop {
        buf.clear();
        match tokio::time::timeout(DRAIN_CHECK, c.sock.recv_buf(&mut buf)).await {
            Ok(Ok(_)) => {
                // Only answers (QR set) with a header: anything else leaves the query waiting.
                if buf.len() >= 12 && buf[2] & 0x80 != 0 {
                    let id = u16::from_be_bytes([buf[0], buf[1]]);
                    if let Some((_, tx)) = lock(&c.waiting).remove(&id) {
                        let _ = tx.send(buf.clone());
                    }
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "DNS proxy: an upstream socket failed; a new one takes over");
                c.retired.store(true, Ordering::Release);
                lock(&c.waiting).clear();
                return;
            }
            Err(_) => {}
        }
        if c.retired.load(Ordering::Acquire) && c.idle() {
            return;
        }
    }
}

/// Random query ids, drawn from the OS in batches.
struct Ids(Mutex<(Vec<u16>, usize)>);

impl Ids {
    fn new() -> Ids {
        Ids(Mutex::new((vec![0; 512], 512)))
    }

    fn next(&self) -> u16 {
        let mut g = lock(&self.0);
        let (pool, at) = &mut *g;
        if *at == pool.len() {
            let mut bytes = vec![0u8; pool.len() * 2];
            // The OS's generator does not fail on Linux once booted; were it to, ids would
            // still be unique per socket (checked in `register`), only predictable.
            if let Err(e) = getrandom::fill(&mut bytes) {
                tracing::warn!(error = %e, "DNS proxy: no random query ids");
            }
            for (i, p) in pool.iter_mut().enumerate() {
                *p = u16::from_ne_bytes([bytes[2 * i], bytes[2 * i + 1]]);
            }
            *at = 0;
        }
        *at += 1;
        pool[*at - 1]
    }
}

/// The shared upstream sockets of one proxy.
pub struct Upstreams {
    conns: Mutex<HashMap<SocketAddr, Arc<Conn>>>,
    ids: Ids,
}

impl Default for Upstreams {
    fn default() -> Self {
        Upstreams {
            conns: Mutex::new(HashMap::new()),
            ids: Ids::new(),
        }
    }
}

impl Upstreams {
    /// Sends `query` (a whole DNS message) to `server` and returns the answer with the query's
    /// own id, or an error after `timeout`.
    pub async fn ask(
        &self,
        server: SocketAddr,
        query: &[u8],
        timeout: Duration,
    ) -> io::Result<Vec<u8>> {
        if query.len() < 12 {
            return Err(io::Error::other("a query without a header"));
        }
        let conn = self.conn(server).await?;
        let (waiter, rx) = conn
            .register(&self.ids)
            .ok_or_else(|| io::Error::other("no free query id"))?;
        let mut out = query.to_vec();
        out[..2].copy_from_slice(&waiter.id.to_be_bytes());
        if let Err(e) = conn.sock.send(&out).await {
            conn.retired.store(true, Ordering::Release);
            return Err(e);
        }
        let mut answer = tokio::time::timeout(timeout, rx)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the DNS server did not answer"))?
            .map_err(|_| io::Error::other("the upstream socket failed"))?;
        answer[..2].copy_from_slice(&query[..2]);
        Ok(answer)
    }

    /// The socket for `server`: the current one, or a new one past `ROTATE_AFTER` queries or
    /// `ROTATE_AGE`.
    async fn conn(&self, server: SocketAddr) -> io::Result<Arc<Conn>> {
        if let Some(c) = self.current(server) {
            return Ok(c);
        }
        let fresh = Conn::open(server).await?;
        let mut conns = lock(&self.conns);
        // Another query may have opened one meanwhile: the first stays, this one retires.
        if let Some(c) = conns.get(&server).filter(|c| c.usable()) {
            fresh.retired.store(true, Ordering::Release);
            c.sent.fetch_add(1, Ordering::Relaxed);
            return Ok(c.clone());
        }
        if conns.len() >= MAX_SERVERS && !conns.contains_key(&server) {
            for (_, c) in conns.drain() {
                c.retired.store(true, Ordering::Release);
            }
        }
        fresh.sent.fetch_add(1, Ordering::Relaxed);
        if let Some(old) = conns.insert(server, fresh.clone()) {
            old.retired.store(true, Ordering::Release);
        }
        Ok(fresh)
    }

    /// The current socket for `server` with room for one more query, counted.
    fn current(&self, server: SocketAddr) -> Option<Arc<Conn>> {
        let conns = lock(&self.conns);
        let c = conns.get(&server)?;
        if c.usable() && c.sent.fetch_add(1, Ordering::Relaxed) < ROTATE_AFTER {
            return Some(c.clone());
        }
        None
    }

    #[cfg(test)]
    fn sockets(&self) -> usize {
        lock(&self.conns).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server on loopback that answers each query with its header's QR bit set, after
    /// `delay_first` for the first one: answers may come back out of order.
    async fn echo_server(
        delay_first: Duration,
    ) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let s = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let addr = s.local_addr().unwrap();
        let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let ports = Arc::new(Mutex::new(std::collections::HashSet::new()));
        let (s2, seen2) = (s.clone(), seen.clone());
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            let mut first = true;
            loop {
                let (n, from) = s2.recv_from(&mut buf).await.unwrap();
                lock(&ports).insert(from.port());
                seen2.store(lock(&ports).len(), Ordering::SeqCst);
                let mut a = buf[..n].to_vec();
                a[2] |= 0x80;
                let (s3, d) = (s2.clone(), if first { delay_first } else { Duration::ZERO });
                first = false;
                tokio::spawn(async move {
                    tokio::time::sleep(d).await;
                    let _ = s3.send_to(&a, from).await;
                });
            }
        });
        (addr, seen)
    }

    fn query(id: u16, tag: u8) -> Vec<u8> {
        let mut q = vec![0u8; 13];
        q[..2].copy_from_slice(&id.to_be_bytes());
        q[12] = tag;
        q
    }

    #[tokio::test]
    async fn answers_reach_their_own_queries_with_their_own_ids() {
        let (server, _) = echo_server(Duration::from_millis(50)).await;
        let up = Arc::new(Upstreams::default());
        // Many queries at once under one pod id (two pods choosing the same id): each gets
        // the answer to its own query (the tag), under the id it was sent with.
        let mut tasks = Vec::new();
        for tag in 0..200u8 {
            let up = up.clone();
            tasks.push(tokio::spawn(async move {
                let a = up
                    .ask(server, &query(7, tag), Duration::from_secs(5))
                    .await
                    .unwrap();
                (tag, a)
            }));
        }
        for t in tasks {
            let (tag, a) = t.await.unwrap();
            assert_eq!(u16::from_be_bytes([a[0], a[1]]), 7);
            assert_eq!(a[12], tag);
            assert_ne!(a[2] & 0x80, 0);
        }
        assert_eq!(up.sockets(), 1);
    }

    #[tokio::test]
    async fn a_socket_serves_a_bounded_number_of_queries_then_a_new_port_takes_over() {
        let (server, ports) = echo_server(Duration::ZERO).await;
        let up = Upstreams::default();
        for i in 0..(2 * ROTATE_AFTER + 1) {
            up.ask(server, &query(i as u16, 0), Duration::from_secs(5))
                .await
                .unwrap();
        }
        assert_eq!(ports.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_silent_server_times_out_and_leaves_nothing_waiting() {
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let up = Upstreams::default();
        let e = up
            .ask(
                silent.local_addr().unwrap(),
                &query(1, 0),
                Duration::from_millis(50),
            )
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        let c = up.current(silent.local_addr().unwrap()).unwrap();
        assert!(c.idle());
    }

    #[tokio::test]
    async fn servers_with_a_socket_are_bounded() {
        let up = Upstreams::default();
        let mut silent = Vec::new();
        for _ in 0..(MAX_SERVERS + 10) {
            let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let _ = up
                .ask(
                    s.local_addr().unwrap(),
                    &query(1, 0),
                    Duration::from_millis(1),
                )
                .await;
            silent.push(s);
        }
        assert!(up.sockets() <= MAX_SERVERS);
    }
}
