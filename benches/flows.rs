//! Flow benchmarks (issue #14's targets), no root needed:
//! - `flow_query_100k`: `ciliate monitor --since ... --from NS/POD --verdict dropped` answered from
//!   a full ring of 100,000 flows (target <= 50 ms);
//! - `flow_consume`: what the agent does per verdict event the datapath reports (attribution,
//!   pod names, per-policy hits, verdict metrics, the ring and the live broadcast); events/s is
//!   1e9 / the time per event (target >= 200,000 events/s).
//!
//! - `hubble_get_flows_last_10k`: Hubble's `GetFlows` for the last 10,000 forwarded flows of a
//!   full ring of 100,000, through the agent's Hubble server on a unix socket, with a client
//!   generated from `proto/` (target <= 50 ms, issue #30; 46.6-50.7 ms against 65.0-67.1 ms for
//!   96624db, run one after the other on the 2-core VM, 2026-11-28);
//! - `flow_consume_hubble_follow`: `flow_consume` with a Hubble follow stream attached and drained
//!   (target: <= 2 us more than `flow_consume`, issue #30).
//!
//! `cargo bench --bench flows`

/// The ciliate binary's allocator (`ciliate::memory`), so that in-process figures are the agent's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::IpAddr;
use std::sync::Arc;

use criterion::{black_box, criterion_group, criterion_main, Criterion};

use ciliate::datapath::events::{verdict_event, FlowFilter, VerdictEvent};
use ciliate::datapath::flows::FlowRing;
use ciliate::hubble::proto::{flow as fpb, observer as opb};
use ciliate::policy::attribution::{isolation_cookie, CookieJar, MatchKind, PolicyHits};
use ciliate::policy::rule::{PolicyKey, PolicyKind};
use ciliate::runtime::FlowSink;
use opb::observer_client::ObserverClient;

const RING: usize = 100_000;

fn addr(i: u32) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[..4].copy_from_slice(&[10, 1, (i >> 8) as u8, i as u8]);
    a
}

/// The i-th of a varied stream: 250 sources, 250 destinations, ports, 1 in 4 dropped.
fn event(i: u32, cookie: u32) -> VerdictEvent {
    let reason = if i.is_multiple_of(4) {
        "drop-default-deny"
    } else {
        "allow-policy"
    };
    verdict_event(
        u64::from(i),
        1 + i % 50,
        256 + i % 100,
        i.is_multiple_of(2),
        6,
        8000 + (i % 20) as u16,
        reason,
        4,
        addr(i % 250),
        addr(1000 + i % 250),
        cookie,
    )
}

fn new_sink() -> (FlowSink, u32) {
    let cookies = Arc::new(CookieJar::default());
    let p = Arc::new(PolicyKey::new(PolicyKind::NetworkPolicy, Some("x"), "deny"));
    let (cookie, refs) = isolation_cookie(&[p]);
    cookies.register(cookie, MatchKind::DefaultDeny, refs, 7);
    let pod_names = Arc::new(dashmap::DashMap::new());
    for i in 0..250u32 {
        let a = addr(i);
        pod_names.insert(IpAddr::from([a[0], a[1], a[2], a[3]]), format!("x/pod-{i}"));
    }
    let sink = FlowSink {
        cookies,
        pod_names,
        policy_hits: Arc::new(PolicyHits::default()),
        metrics: Arc::new(ciliate::metrics::Metrics::new()),
        flows: Arc::new(FlowRing::new(RING, 4096)),
    };
    (sink, cookie)
}

fn bench_flows(c: &mut Criterion) {
    let (sink, cookie) = new_sink();
    // A live subscriber, as a running `ciliate monitor` would be (drained as it goes).
    let mut live = sink.flows.subscribe();
    let mut i = 0u32;
    c.bench_function("flow_consume", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            sink.consume(black_box(event(i, cookie)));
            while live.try_recv().is_ok() {}
        })
    });

    let (sink, cookie) = new_sink();
    for i in 0..RING as u32 {
        sink.consume(event(i, cookie));
    }
    assert_eq!(sink.flows.len(), RING);
    let filter = FlowFilter {
        from: Some("x/pod-8".into()),
        verdict: Some("dropped".into()),
        ..Default::default()
    };
    let hits = sink.flows.query(0, &filter).len();
    assert!(hits > 0, "the query finds flows");
    println!("flow_query_100k: {hits} of {RING} flows match");
    c.bench_function("flow_query_100k", |b| {
        b.iter(|| black_box(sink.flows.query(black_box(0), &filter)))
    });
}

/// The client's HTTP/2 receive window (the relay's; grpc-go's clients, the hubble CLI among
/// them, grow theirs to the bandwidth-delay product).
const WINDOW: u32 = ciliate::hubble::relay::WINDOW_BYTES;

/// The agent's Hubble server over `flows`, on a socket in `dir`, and a client of it.
fn hubble(
    rt: &tokio::runtime::Runtime,
    dir: &std::path::Path,
    flows: Arc<FlowRing>,
) -> ObserverClient<tonic::transport::Channel> {
    use ciliate::hubble::server as hs;
    let engine = Arc::new(std::sync::RwLock::new(
        ciliate::policy::engine::PolicyEngine::new(),
    ));
    let sources = hs::Sources {
        node: "node-1".into(),
        flows,
        lookup: Arc::new(hs::EngineLookup(engine)),
        nodes: tokio::sync::watch::channel(Default::default()).1,
        started: std::time::Instant::now(),
        port: 4244,
        local_address: String::new(),
        tls: false,
    };
    let listeners = hs::bind(dir, &hs::HubbleConfig::default()).expect("hubble.sock");
    let socket = listeners.socket.clone();
    hs::spawn(hs::Hubble::new(sources), listeners).expect("the Hubble thread");
    rt.block_on(async move {
        let ch = tonic::transport::Endpoint::from_static("http://hubble.local")
            .initial_stream_window_size(Some(WINDOW))
            .initial_connection_window_size(Some(WINDOW))
            .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                let socket = socket.clone();
                async move {
                    let s = tokio::net::UnixStream::connect(socket).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
                }
            }))
            .await
            .expect("connect to hubble.sock");
        ObserverClient::new(ch)
    })
}

/// Flows of one `GetFlows` that does not follow.
async fn count_flows(
    c: &mut ObserverClient<tonic::transport::Channel>,
    req: opb::GetFlowsRequest,
) -> usize {
    let mut s = c.get_flows(req).await.expect("GetFlows").into_inner();
    let mut n = 0;
    while let Some(r) = s.message().await.expect("a response") {
        n += usize::from(matches!(
            r.response_types,
            Some(opb::get_flows_response::ResponseTypes::Flow(_))
        ));
    }
    n
}

fn bench_hubble(c: &mut Criterion) {
    // One worker thread: the client's connection is driven between calls too (the follow
    // stream below is drained there while the agent's side is measured).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (sink, cookie) = new_sink();
    for i in 0..RING as u32 {
        sink.consume(event(i, cookie));
    }
    let mut client = hubble(&rt, dir.path(), sink.flows.clone());
    let last_10k = opb::GetFlowsRequest {
        number: 10_000,
        whitelist: vec![fpb::FlowFilter {
            verdict: vec![fpb::Verdict::Forwarded as i32],
            ..Default::default()
        }],
        ..Default::default()
    };
    assert_eq!(
        rt.block_on(count_flows(&mut client, last_10k.clone())),
        10_000
    );
    let mut g = c.benchmark_group("hubble");
    g.sample_size(20);
    g.bench_function("hubble_get_flows_last_10k", |b| {
        b.iter(|| rt.block_on(count_flows(&mut client, last_10k.clone())))
    });
    g.finish();

    // The agent's per-event work while a follow stream drains every flow on the Hubble thread.
    let follow = opb::GetFlowsRequest {
        follow: true,
        ..Default::default()
    };
    let mut stream = rt
        .block_on(client.get_flows(follow))
        .expect("follow")
        .into_inner();
    let drained = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = drained.clone();
    rt.spawn(async move {
        while let Ok(Some(_)) = stream.message().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    let mut live = sink.flows.subscribe();
    let mut i = 0u32;
    c.bench_function("flow_consume_hubble_follow", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            sink.consume(black_box(event(i, cookie)));
            while live.try_recv().is_ok() {}
        })
    });
    std::thread::sleep(std::time::Duration::from_millis(500));
    println!(
        "flow_consume_hubble_follow: the follow stream received {} flows",
        drained.load(std::sync::atomic::Ordering::Relaxed)
    );
}

criterion_group!(benches, bench_flows, bench_hubble);
criterion_main!(benches);
