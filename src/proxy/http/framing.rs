//! What hyper accepts silently but the proxy refuses: a request head with `Content-Length`
//! and `Transfer-Encoding` (hyper drops the length, reads chunked, and closes after), or
//! `Content-Length` twice (hyper keeps one when they agree). A server behind another
//! intermediary could frame such a request differently; the proxy answers it `400`.
//!
//! [`Watched`] sees the bytes a client sends on an HTTP/1.1 connection as hyper reads them;
//! [`Tracker`] reads each request head with httparse (hyper's own parser) and follows the body
//! framing (length or chunks, through httparse's chunk-size parser) to the next head, queueing
//! one verdict per request for the service, which handles requests in order. HTTP/2, an
//! upgrade, or bytes it cannot read turn it off for the connection (hyper then judges alone:
//! it refuses malformed heads itself and re-frames every forwarded body).

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The verdicts of the request heads read so far, oldest first: `Some(why)` for one to refuse.
pub type Verdicts = Arc<Mutex<VecDeque<Option<&'static str>>>>;

/// The longest head or chunk-size line followed (hyper's own limits are lower).
const MAX_LINE: usize = 64 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Head,
    Fixed(u64),
    ChunkSize,
    ChunkData(u64),
    ChunkEnd(u8),
    Trailers,
    Off,
}

/// Follows one connection's requests.
#[derive(Debug)]
pub struct Tracker {
    state: State,
    buf: Vec<u8>,
    verdicts: Verdicts,
}

impl Tracker {
    pub fn new(verdicts: Verdicts) -> Tracker {
        Tracker {
            state: State::Head,
            buf: Vec::new(),
            verdicts,
        }
    }

    /// Between two requests: no head or body part read and every head's verdict taken.
    pub fn between_requests(&self) -> bool {
        self.state == State::Head
            && self.buf.is_empty()
            && self
                .verdicts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
    }

    /// Reads `bytes`, the next the client sent.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() && self.state != State::Off {
            bytes = match self.state {
                State::Head => self.head(bytes),
                State::Fixed(n) => {
                    let take = (n.min(bytes.len() as u64)) as usize;
                    self.state = if take as u64 == n {
                        State::Head
                    } else {
                        State::Fixed(n - take as u64)
                    };
                    &bytes[take..]
                }
                State::ChunkSize => {
                    self.line(bytes, |t, line| match httparse::parse_chunk_size(line) {
                        Ok(httparse::Status::Complete((_, 0))) => t.state = State::Trailers,
                        Ok(httparse::Status::Complete((_, n))) => t.state = State::ChunkData(n),
                        _ => t.state = State::Off,
                    })
                }
                State::ChunkData(n) => {
                    let take = (n.min(bytes.len() as u64)) as usize;
                    self.state = if take as u64 == n {
                        State::ChunkEnd(2)
                    } else {
                        State::ChunkData(n - take as u64)
                    };
                    &bytes[take..]
                }
                State::ChunkEnd(k) => {
                    let take = (k as usize).min(bytes.len());
                    self.state = if take == k as usize {
                        State::ChunkSize
                    } else {
                        State::ChunkEnd(k - take as u8)
                    };
                    &bytes[take..]
                }
                State::Trailers => self.line(bytes, |t, line| {
                    if line == b"\r\n" || line == b"\n" {
                        t.state = State::Head;
                    }
                }),
                State::Off => &[],
            };
        }
    }

    /// Accumulates one line (through its LF), then hands it to `done`.
    fn line<'a>(&mut self, bytes: &'a [u8], done: impl FnOnce(&mut Self, &[u8])) -> &'a [u8] {
        match bytes.iter().position(|b| *b == b'\n') {
            Some(i) => {
                self.buf.extend_from_slice(&bytes[..=i]);
                let line = std::mem::take(&mut self.buf);
                done(self, &line);
                &bytes[i + 1..]
            }
            None => {
                self.buf.extend_from_slice(bytes);
                if self.buf.len() > MAX_LINE {
                    self.state = State::Off;
                }
                &[]
            }
        }
    }

    fn head<'a>(&mut self, bytes: &'a [u8]) -> &'a [u8] {
        let had = self.buf.len();
        // A head that arrives whole (the common case) is read where it lies.
        let whole = had == 0;
        if !whole {
            self.buf.extend_from_slice(bytes);
        }
        let head: &[u8] = if whole { bytes } else { &self.buf };
        let mut headers = [httparse::EMPTY_HEADER; 128];
        let mut req = httparse::Request::new(&mut headers);
        let len = match req.parse(head) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if head.len() <= MAX_LINE => {
                if whole {
                    self.buf.extend_from_slice(bytes);
                }
                return &[];
            }
            // Not HTTP/1.1 (HTTP/2's preface), or beyond what hyper reads: hyper decides.
            _ => {
                self.state = State::Off;
                return &[];
            }
        };
        let (mut cl, mut te, mut chunked, mut upgrade) = (Vec::new(), false, false, false);
        for h in req.headers.iter() {
            if h.name.eq_ignore_ascii_case("content-length") {
                cl.push(h.value);
            } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                te = true;
                chunked = std::str::from_utf8(h.value).is_ok_and(|v| {
                    v.rsplit(',')
                        .next()
                        .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"))
                });
            } else if h.name.eq_ignore_ascii_case("upgrade") {
                upgrade = true;
            }
        }
        let verdict = if te && !cl.is_empty() {
            Some("both Content-Length and Transfer-Encoding")
        } else if cl.len() > 1 {
            Some("Content-Length more than once")
        } else {
            None
        };
        push(&self.verdicts, verdict);
        let length = cl
            .first()
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        self.state = match (upgrade, chunked, length) {
            (true, _, _) => State::Off,
            (_, true, _) => State::ChunkSize,
            (_, false, Some(n)) if n > 0 => State::Fixed(n),
            _ => State::Head,
        };
        let rest = len.saturating_sub(had);
        // Nothing kept between requests (an idle connection holds no buffer).
        self.buf = Vec::new();
        &bytes[rest.min(bytes.len())..]
    }
}

fn push(v: &Verdicts, verdict: Option<&'static str>) {
    v.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push_back(verdict);
}

/// The next request's verdict (`None`: nothing to refuse, or not followed).
pub fn next(v: &Verdicts) -> Option<&'static str> {
    v.lock()
        .unwrap_or_else(|p| p.into_inner())
        .pop_front()
        .flatten()
}

/// A connection whose incoming bytes a [`Tracker`] sees.
pub struct Watched<T> {
    inner: T,
    tracker: Tracker,
}

impl<T> Watched<T> {
    pub fn new(inner: T, verdicts: Verdicts) -> Watched<T> {
        Watched {
            inner,
            tracker: Tracker::new(verdicts),
        }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    pub fn into_inner(self) -> T {
        self.inner
    }
}

impl<T> super::park::Boundary for Watched<T> {
    fn between_requests(&self) -> bool {
        self.tracker.between_requests()
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &r {
            self.tracker.feed(&buf.filled()[before..]);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdicts(stream: &[&[u8]]) -> Vec<Option<&'static str>> {
        let v: Verdicts = Default::default();
        let mut t = Tracker::new(v.clone());
        for piece in stream {
            t.feed(piece);
        }
        let out = v.lock().unwrap().iter().copied().collect();
        out
    }

    #[test]
    fn pipelined_requests_are_followed_through_their_bodies_in_any_pieces() {
        let stream = b"POST /a HTTP/1.1\r\nHost: e\r\nContent-Length: 5\r\n\r\nhello\
GET /b HTTP/1.1\r\nHost: e\r\n\r\n\
POST /c HTTP/1.1\r\nHost: e\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n\
POST /d HTTP/1.1\r\nHost: e\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n\
GET /e HTTP/1.1\r\nHost: e\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n";
        let want = vec![
            None,
            None,
            None,
            Some("both Content-Length and Transfer-Encoding"),
            Some("Content-Length more than once"),
        ];
        assert_eq!(verdicts(&[stream]), want);
        // Byte by byte: the same.
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(verdicts(&bytes), want);
        // A body holding what looks like a head is a body.
        let tricky = b"POST /a HTTP/1.1\r\nHost: e\r\nContent-Length: 56\r\n\r\nGET /x HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n";
        assert_eq!(verdicts(&[tricky]), vec![None]);
    }

    #[test]
    fn http2_and_upgrades_turn_it_off() {
        assert!(verdicts(&[b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"]).is_empty());
        let up = b"GET /ws HTTP/1.1\r\nHost: e\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\nGET /x HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx";
        assert_eq!(
            verdicts(&[up]),
            vec![None],
            "after an upgrade, bytes are not requests"
        );
    }
}
