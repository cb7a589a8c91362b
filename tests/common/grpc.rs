//! A gRPC service and client (tonic, written without codegen) inside network namespaces:
//! `test.Echo/Say` and `test.Echo/Admin`, both answering `echo TEXT`.

#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::codegen::{http, BoxFuture, Service, StdError};

use super::netns::in_netns;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {
    #[prost(string, tag = "1")]
    pub text: String,
}

struct Unary;

impl tonic::server::UnaryService<Msg> for Unary {
    type Response = Msg;
    type Future = BoxFuture<tonic::Response<Msg>, tonic::Status>;
    fn call(&mut self, r: tonic::Request<Msg>) -> Self::Future {
        Box::pin(async move {
            Ok(tonic::Response::new(Msg {
                text: format!("echo {}", r.get_ref().text),
            }))
        })
    }
}

#[derive(Clone)]
struct Echo;

impl tonic::server::NamedService for Echo {
    const NAME: &'static str = "test.Echo";
}

impl<B> Service<http::Request<B>> for Echo
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.unary(Unary, req).await)
        })
    }
}

/// Serves `test.Echo` over h2c on `addr` inside `netns`, for the rest of the process.
pub fn serve(netns: &str, addr: SocketAddr) {
    let (tx, rx) = std::sync::mpsc::channel();
    in_netns(netns, move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind(addr).await.expect("bind");
            tx.send(()).unwrap();
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let svc = hyper_util::service::TowerToHyperService::new(Echo);
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .http2_only()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
                });
            }
        });
    });
    rx.recv().unwrap();
}

/// Calls `method` (`Say`, `Admin`) with `text` from `netns`, `n` times over one connection.
pub fn call(
    netns: &str,
    to: SocketAddr,
    method: &'static str,
    text: &str,
    n: usize,
) -> Vec<Result<String, tonic::Code>> {
    let ns = netns.to_string();
    let text = text.to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let connector = tower::service_fn(move |_: tonic::transport::Uri| {
            let ns = ns.clone();
            async move {
                let s = in_netns(&ns, move || {
                    std::net::TcpStream::connect_timeout(&to, Duration::from_secs(3))
                })
                .join()
                .expect("connect thread")?;
                s.set_nonblocking(true)?;
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::TcpStream::from_std(s)?))
            }
        });
        let ch = match tonic::transport::Endpoint::from_shared(format!("http://{to}"))
            .expect("endpoint")
            .connect_with_connector(connector)
            .await
        {
            Ok(c) => c,
            Err(_) => return vec![Err(tonic::Code::Unavailable); n],
        };
        let mut out = Vec::new();
        for _ in 0..n {
            let mut grpc = tonic::client::Grpc::new(ch.clone());
            let r = async {
                grpc.ready()
                    .await
                    .map_err(|_| tonic::Status::unavailable("not ready"))?;
                let path = http::uri::PathAndQuery::from_static(match method {
                    "Say" => "/test.Echo/Say",
                    _ => "/test.Echo/Admin",
                });
                grpc.unary(
                    tonic::Request::new(Msg { text: text.clone() }),
                    path,
                    tonic_prost::ProstCodec::default(),
                )
                .await
            }
            .await;
            out.push(
                r.map(|r: tonic::Response<Msg>| r.into_inner().text)
                    .map_err(|s| s.code()),
            );
        }
        out
    })
}
