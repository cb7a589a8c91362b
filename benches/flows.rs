//! Flow benchmarks (issue #14's targets), no root needed:
//! - `flow_query_100k`: `ciliate monitor --since ... --from NS/POD --verdict dropped` answered from
//!   a full ring of 100,000 flows (target <= 50 ms);
//! - `flow_consume`: what the agent does per verdict event the datapath reports (attribution,
//!   pod names, per-policy hits, verdict metrics, the ring and the live broadcast); events/s is
//!   1e9 / the time per event (target >= 200,000 events/s).
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
use ciliate::policy::attribution::{isolation_cookie, CookieJar, MatchKind, PolicyHits};
use ciliate::policy::rule::{PolicyKey, PolicyKind};
use ciliate::runtime::FlowSink;

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

criterion_group!(benches, bench_flows);
criterion_main!(benches);
