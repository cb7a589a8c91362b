//! Idle HTTP/1.1 client connections, parked: a kept-alive connection that has been quiet for
//! [`IDLE_PARK`] leaves hyper (whose state holds a read and a write buffer, about 24 KiB) and
//! waits for its next request on the socket alone; the next request gets a new hyper
//! connection on the same socket. 10,000 idle connections then cost the proxy what their
//! sockets and tasks cost.
//!
//! [`Parking`] wraps a connection's socket as hyper sees it. When hyper asks for the next
//! request and none has come for `IDLE_PARK`, it ends hyper's read with an end of file; hyper
//! takes that for the client closing an idle connection and finishes without touching the
//! socket (`poll_without_shutdown`), and the caller takes the socket back (`into_parts`). It
//! does so only when nothing is under way, so that ending hyper loses nothing:
//! - between requests ([`Boundary`]: no part of a head or body read, every head taken);
//! - no request in flight and every answer's last byte handed to the socket: [`Exchanges`]
//!   counts requests from their start to the drop of their answer's body, which hyper drops
//!   once it has encoded the last of it, and marks each flush of the socket (hyper flushes the
//!   socket only with its own buffer empty) after which nothing ended.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How long a connection stays in hyper without a request.
pub const IDLE_PARK: Duration = Duration::from_secs(1);

/// Whether the bytes read so far end between two requests.
pub trait Boundary {
    fn between_requests(&self) -> bool;
}

/// One connection's requests: started, ended (answer body dropped), and the ended count at the
/// last flush of the socket.
#[derive(Default)]
pub struct Exchanges {
    started: AtomicU64,
    ended: AtomicU64,
    flushed: AtomicU64,
}

impl Exchanges {
    /// A request starts; the guard ends it when dropped (with its answer's body).
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.started.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }

    /// Nothing in flight and every ended answer flushed since.
    fn quiet(&self) -> bool {
        let ended = self.ended.load(Ordering::SeqCst);
        self.started.load(Ordering::SeqCst) == ended && self.flushed.load(Ordering::SeqCst) == ended
    }

    fn flushed(&self) {
        self.flushed
            .store(self.ended.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

/// A request in flight (see [`Exchanges::begin`]).
pub struct InFlight(Arc<Exchanges>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.ended.fetch_add(1, Ordering::SeqCst);
    }
}

/// An answer's body that ends its request when hyper drops it.
pub struct Counted<B> {
    body: B,
    _request: InFlight,
}

impl<B> Counted<B> {
    pub fn new(body: B, request: InFlight) -> Counted<B> {
        Counted {
            body,
            _request: request,
        }
    }
}

impl<B: Body + Unpin> Body for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A client connection's socket as hyper sees it (see the module).
pub struct Parking<T> {
    inner: T,
    exchanges: Arc<Exchanges>,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    parked: bool,
}

impl<T: Boundary> Parking<T> {
    pub fn new(inner: T, exchanges: Arc<Exchanges>) -> Parking<T> {
        Parking {
            inner,
            exchanges,
            timer: None,
            parked: false,
        }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    pub fn into_inner(self) -> T {
        self.inner
    }

    /// Whether this connection's hyper ended because it was parked (and not by the client);
    /// cleared for the next.
    pub fn take_parked(&mut self) -> bool {
        std::mem::take(&mut self.parked)
    }

    /// Whether the idle time is up (arming the timer, which wakes the task, when it is not).
    fn idle_for_long(&mut self, cx: &mut Context<'_>) -> bool {
        if !(self.inner.between_requests() && self.exchanges.quiet()) {
            self.timer = None;
            return false;
        }
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(IDLE_PARK)));
        if timer.as_mut().poll(cx).is_ready() {
            self.timer = None;
            return true;
        }
        false
    }
}

impl<T: AsyncRead + Boundary + Unpin> AsyncRead for Parking<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Pending => {
                if self.idle_for_long(cx) {
                    self.parked = true;
                    return Poll::Ready(Ok(())); // nothing read: hyper sees the end
                }
                Poll::Pending
            }
            r => {
                self.timer = None;
                r
            }
        }
    }
}

impl<T: AsyncWrite + Boundary + Unpin> AsyncWrite for Parking<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    /// hyper flushes the socket once its own buffer is written out.
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        if let Poll::Ready(Ok(())) = r {
            self.exchanges.flushed();
            // Armed here too: hyper may have asked for the next request before this answer
            // ended, and asks again only when woken.
            let _ = self.idle_for_long(cx);
        }
        r
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A socket half whose boundary the test sets.
    struct Sock {
        io: tokio::io::DuplexStream,
        between: Arc<AtomicBool>,
    }

    impl Boundary for Sock {
        fn between_requests(&self) -> bool {
            self.between.load(Ordering::SeqCst)
        }
    }
    impl AsyncRead for Sock {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_read(cx, buf)
        }
    }
    impl AsyncWrite for Sock {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.io).poll_write(cx, buf)
        }
        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_flush(cx)
        }
        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_shutdown(cx)
        }
    }

    fn parking() -> (
        Parking<Sock>,
        tokio::io::DuplexStream,
        Arc<AtomicBool>,
        Arc<Exchanges>,
    ) {
        let (a, b) = tokio::io::duplex(64);
        let between = Arc::new(AtomicBool::new(true));
        let ex = Arc::new(Exchanges::default());
        let p = Parking::new(
            Sock {
                io: a,
                between: between.clone(),
            },
            ex.clone(),
        );
        (p, b, between, ex)
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_connection_reads_an_end_after_the_idle_time_and_says_it_was_parked() {
        let (mut p, _peer, _, _) = parking();
        let mut buf = [0u8; 8];
        let t = tokio::time::Instant::now();
        assert_eq!(p.read(&mut buf).await.unwrap(), 0);
        assert!(t.elapsed() >= IDLE_PARK);
        assert!(p.take_parked());
        assert!(!p.take_parked(), "cleared");
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_in_flight_or_an_answer_not_flushed_keeps_it_from_parking() {
        let (mut p, mut peer, between, ex) = parking();
        let mut buf = [0u8; 8];
        // A request in flight: no end, however long.
        let req = ex.begin();
        let read = tokio::time::timeout(IDLE_PARK * 5, p.read(&mut buf)).await;
        assert!(read.is_err(), "no end while a request is in flight");
        // Its answer ended but is not flushed yet: still none.
        drop(req);
        let read = tokio::time::timeout(IDLE_PARK * 5, p.read(&mut buf)).await;
        assert!(read.is_err(), "no end before the flush");
        // Part of a head read: none either.
        p.flush().await.unwrap();
        between.store(false, Ordering::SeqCst);
        let read = tokio::time::timeout(IDLE_PARK * 5, p.read(&mut buf)).await;
        assert!(read.is_err(), "no end mid-request");
        // Bytes from the client are read as they come.
        between.store(true, Ordering::SeqCst);
        peer.write_all(b"GET").await.unwrap();
        assert_eq!(p.read(&mut buf).await.unwrap(), 3);
        assert!(!p.take_parked());
        // Quiet again: parked.
        assert_eq!(p.read(&mut buf).await.unwrap(), 0);
        assert!(p.take_parked());
    }

    /// hyper itself, over a pipe that takes 1 KiB at a time: an answer the client starts to
    /// read only after several idle periods arrives whole; then the connection parks.
    #[tokio::test(start_paused = true)]
    async fn hyper_is_never_ended_with_an_answer_unwritten() {
        use http_body_util::Full;
        let (p, mut client, _, ex) = parking();
        const LEN: usize = 100_000;
        let svc = hyper::service::service_fn(move |_req| {
            let request = ex.begin();
            let body = Full::new(bytes::Bytes::from(vec![b'x'; LEN]));
            std::future::ready(Ok::<_, std::convert::Infallible>(hyper::Response::new(
                Counted::new(body, request),
            )))
        });
        let served = tokio::spawn(async move {
            let mut conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(p), svc);
            let r = std::future::poll_fn(|cx| conn.poll_without_shutdown(cx)).await;
            let mut io = conn.into_parts().io.into_inner();
            (r.is_ok(), io.take_parked())
        });
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(IDLE_PARK * 5).await;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let body = |got: &[u8]| {
            got.windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map_or(0, |i| got.len() - i - 4)
        };
        while body(&got) < LEN {
            let n = client.read(&mut buf).await.unwrap();
            assert!(n > 0, "the answer was cut after {} bytes", got.len());
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(body(&got), LEN, "the whole body, nothing more");
        assert_eq!(served.await.unwrap(), (true, true), "then parked");
    }
}
