//! HTTP servers and clients inside network namespaces, for the HTTP proxy's tests: real
//! hyper servers (HTTP/1.1 and h2c), a raw HTTP/1.1 client that keeps its connection (and can
//! send what a hostile pod would), and hyper's HTTP/2 client.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

use super::netns::in_netns;

/// What the server saw of one request, as its answer: `METHOD PATH from=PEER_IP host=HOST
/// token=X-TOKEN`, plus the body length it read.
fn echo(req: &hyper::Request<hyper::body::Incoming>, peer: SocketAddr, body_len: usize) -> String {
    let h = |n: &str| {
        req.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string()
    };
    format!(
        "{} {} from={} host={} token={} added={} body={body_len}",
        req.method(),
        req.uri(),
        peer.ip(),
        h("host"),
        h("x-very-secret-token"),
        h("x-added"),
    )
}

/// Serves HTTP/1.1 and h2c (prior knowledge) on `addr:port` inside `netns`, for the rest of the
/// process: every request is answered `200` with [`echo`]'s line (a WebSocket-style upgrade
/// is accepted with `101` and its bytes echoed).
pub fn serve(netns: &str, addr: IpAddr, port: u16) {
    let (tx, rx) = std::sync::mpsc::channel();
    in_netns(netns, move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind(SocketAddr::new(addr, port))
                .await
                .expect("bind");
            tx.send(()).unwrap();
            loop {
                let Ok((s, peer)) = l.accept().await else {
                    continue;
                };
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |mut req| async move {
                        if req.headers().contains_key("upgrade") {
                            let up = hyper::upgrade::on(&mut req);
                            tokio::spawn(async move {
                                if let Ok(u) = up.await {
                                    let mut io = TokioIo::new(u);
                                    let mut buf = [0u8; 1024];
                                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                                    while let Ok(n) = io.read(&mut buf).await {
                                        if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                                            break;
                                        }
                                    }
                                }
                            });
                            let mut r = hyper::Response::new(Full::new(Bytes::new()));
                            *r.status_mut() = hyper::StatusCode::SWITCHING_PROTOCOLS;
                            r.headers_mut()
                                .insert("connection", "upgrade".parse().unwrap());
                            r.headers_mut()
                                .insert("upgrade", "websocket".parse().unwrap());
                            return Ok::<_, hyper::Error>(r);
                        }
                        let line0 = echo(&req, peer, 0);
                        let body = req.into_body().collect().await?.to_bytes();
                        let line = line0.replace("body=0", &format!("body={}", body.len()));
                        Ok(hyper::Response::new(Full::new(Bytes::from(line))))
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection_with_upgrades(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
    });
    rx.recv().unwrap();
}

/// Serves HTTP/1.1 (and h2c) on `addr:port` inside `netns`, answering every request with
/// `len` bytes (benchmarks).
pub fn serve_fixed(netns: &str, addr: IpAddr, port: u16, len: usize) {
    let (tx, rx) = std::sync::mpsc::channel();
    in_netns(netns, move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let body = Bytes::from(vec![b'x'; len]);
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind(SocketAddr::new(addr, port))
                .await
                .expect("bind");
            tx.send(()).unwrap();
            loop {
                let Ok((s, _)) = l.accept().await else {
                    continue;
                };
                let body = body.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |_req| {
                        let body = body.clone();
                        async move { Ok::<_, hyper::Error>(hyper::Response::new(Full::new(body))) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
    });
    rx.recv().unwrap();
}

/// A kept HTTP/1.1 connection from a pod, speaking raw bytes.
pub struct Conn {
    s: BufReader<TcpStream>,
}

/// A response: status, headers (lower-case names), body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Resp {
    pub fn header(&self, n: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    }
}

impl Conn {
    /// Connects from `netns` to `to`.
    pub fn open(netns: &str, to: SocketAddr) -> std::io::Result<Conn> {
        let s = in_netns(netns, move || {
            TcpStream::connect_timeout(&to, Duration::from_secs(3))
        })
        .join()
        .expect("connect thread")?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        Ok(Conn {
            s: BufReader::new(s),
        })
    }

    /// Sends `raw` as it is.
    pub fn send_raw(&mut self, raw: &[u8]) -> std::io::Result<()> {
        self.s.get_mut().write_all(raw)
    }

    /// `METHOD target` with `Host: h` and `headers`, no body.
    pub fn request(
        &mut self,
        method: &str,
        target: &str,
        headers: &[(&str, &str)],
    ) -> std::io::Result<Resp> {
        let mut raw = format!("{method} {target} HTTP/1.1\r\nHost: echo\r\n");
        for (n, v) in headers {
            raw.push_str(&format!("{n}: {v}\r\n"));
        }
        raw.push_str("\r\n");
        self.send_raw(raw.as_bytes())?;
        self.response()
    }

    /// Reads one response (Content-Length or chunked body).
    pub fn response(&mut self) -> std::io::Result<Resp> {
        let mut line = String::new();
        if self.s.read_line(&mut line)? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the connection closed",
            ));
        }
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            self.s.read_line(&mut h)?;
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((n, v)) = h.split_once(':') {
                headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
        }
        let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
        let mut body = Vec::new();
        if status == 101 {
        } else if let Some(n) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
            body.resize(n, 0);
            self.s.read_exact(&mut body)?;
        } else if get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
            loop {
                let mut size = String::new();
                self.s.read_line(&mut size)?;
                let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
                let mut chunk = vec![0u8; n + 2];
                self.s.read_exact(&mut chunk)?;
                if n == 0 {
                    break;
                }
                body.extend_from_slice(&chunk[..n]);
            }
        }
        Ok(Resp {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }

    /// The raw stream (after an upgrade).
    pub fn stream(&mut self) -> &mut BufReader<TcpStream> {
        &mut self.s
    }
}

/// One HTTP/2 (h2c, prior knowledge) connection from `netns` to `to`, with `requests` sent on
/// it concurrently: (method, path) -> (status, body).
pub fn h2_requests(
    netns: &str,
    to: SocketAddr,
    requests: Vec<(&'static str, String)>,
) -> Result<Vec<(u16, String)>, String> {
    let s = in_netns(netns, move || {
        TcpStream::connect_timeout(&to, Duration::from_secs(3))
    })
    .join()
    .expect("connect thread")
    .map_err(|e| e.to_string())?;
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let s = tokio::net::TcpStream::from_std(s).map_err(|e| e.to_string())?;
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(s))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let mut tasks = Vec::new();
        for (method, path) in requests {
            let mut send = send.clone();
            tasks.push(tokio::spawn(async move {
                let req = hyper::Request::builder()
                    .method(method)
                    .uri(format!("http://{to}{path}"))
                    .body(Full::new(Bytes::new()))
                    .map_err(|e| e.to_string())?;
                send.ready().await.map_err(|e| e.to_string())?;
                let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
                let status = resp.status().as_u16();
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                Ok::<_, String>((status, String::from_utf8_lossy(&body).into_owned()))
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.map_err(|e| e.to_string())??);
        }
        Ok(out)
    })
}
