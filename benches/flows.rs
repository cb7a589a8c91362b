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
//! - `flow_consume_staged`: `flow_consume` for endpoints selected by staged policies (10 of
//!   1,000 loaded), each flow judged again with them enforced (target: <= 5 us, issue #32);
//! - `flow_consume_hubble_follow`: `flow_consume` with a Hubble follow stream attached and drained
//!   (target: <= 2 us more than `flow_consume`, issue #30).
//!
//! `cargo bench --bench flows`

/// The ciliate binary's allocator (`ciliate::memory`), so that in-process figures are the agent's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// With the binary's options (`ciliate::memory`), set before anything allocates as the binary
/// sets them: mimalloc's defaults commit arenas eagerly, in huge pages that a purge gives back
/// and the next allocation faults in again, 2 MiB zeroed at a time (a tenth of the CPU of a
/// change selecting 1,000 endpoints in `benches/agent.rs`), which the agent never pays.
#[used]
#[link_section = ".init_array"]
static CONFIGURE_ALLOCATOR: extern "C" fn() = ciliate::memory::configure_allocator;

use std::sync::Arc;

use criterion::{black_box, criterion_group, criterion_main, Criterion};

use ciliate::datapath::events::FlowFilter;
use ciliate::hubble::proto::{flow as fpb, observer as opb};
use opb::observer_client::ObserverClient;

#[path = "shared/flows.rs"]
mod shared;
use shared::{event, new_sink, observer, serve_hubble};

const RING: usize = 100_000;

fn bench_flows(c: &mut Criterion) {
    let (sink, cookie) = new_sink(RING);
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

    // The same with staged policies (issue #32: <= 5 us per new flow with 1,000 policies
    // loaded, 10 staged): every event's endpoint is selected by them, so each is judged again.
    let (sink, cookie) = new_sink(RING);
    let staged = staged_view();
    for ep in 1..=50 {
        sink.staged.insert(ep, staged.clone());
    }
    let mut live = sink.flows.subscribe();
    let mut changed = 0u32;
    for i in 0..1000 {
        sink.consume(event(i, cookie));
    }
    while let Ok(f) = live.try_recv() {
        changed += f.staged.is_some() as u32;
    }
    println!("flow_consume_staged: {changed} of 1000 flows carry a staged verdict");
    assert!(
        changed > 0 && changed < 1000,
        "the staged policies change some verdicts"
    );
    let mut i = 0u32;
    c.bench_function("flow_consume_staged", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            sink.consume(black_box(event(i, cookie)));
            while live.try_recv().is_ok() {}
        })
    });

    let (sink, cookie) = new_sink(RING);
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

/// An endpoint's policy with staged policies enforced, among 1,000 policies: 990 enforced
/// CiliumNetworkPolicies selecting every pod (egress to 5 apps each) and 10 staged ones (ingress
/// from 5 apps each on the events' ports: they isolate the endpoint's ingress), over the 100
/// identities the bench's events name (256-355).
fn staged_view() -> Arc<ciliate::policy::engine::StagedPolicy> {
    use ciliate::policy::engine::{EndpointView, PolicyEngine};
    use ciliate::policy::labels::Labels;
    use ciliate::policy::translate::parse_policy;
    let mut engine = PolicyEngine::new();
    let labels = |i: usize| {
        let l: std::collections::BTreeMap<String, String> =
            [("app".to_string(), format!("app-{i}"))].into();
        Labels::for_pod("x", &l, &std::collections::BTreeMap::new(), None)
    };
    for i in 0..100 {
        assert_eq!(engine.allocate_identity(&labels(i)).id(), 256 + i as u32);
    }
    for r in 0..1000 {
        let apps: Vec<String> = (0..5)
            .map(|k| format!("app-{}", (r + k * 20) % 100))
            .collect();
        let (direction, peer, mode) = if r % 100 == 0 {
            (
                "ingress",
                "fromEndpoints",
                ", annotations: {policy.ciliate.io/mode: audit}",
            )
        } else {
            ("egress", "toEndpoints", "")
        };
        let yaml = format!(
            "{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: r{r}, namespace: x{mode}}}, spec: {{endpointSelector: {{}}, {direction}: [{{{peer}: [{{matchExpressions: [{{key: app, operator: In, values: [{}]}}]}}], toPorts: [{{ports: [{{port: \"{}\", protocol: TCP}}]}}]}}]}}}}",
            apps.join(", "),
            8000 + r % 20
        );
        let doc: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
        engine.upsert_policy(parse_policy(&doc, "x", "bench").unwrap());
    }
    let l = labels(0);
    let view = EndpointView {
        identity: 256,
        labels: &l,
        named_ports: &[],
        host: false,
    };
    let staged = engine
        .resolve_staged(&view)
        .expect("staged policies select the endpoint");
    assert_eq!(staged.staged.len(), 10);
    Arc::new(staged)
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
    let (sink, cookie) = new_sink(RING);
    for i in 0..RING as u32 {
        sink.consume(event(i, cookie));
    }
    let socket = serve_hubble(dir.path(), "node-1", sink.flows.clone());
    let mut client = rt.block_on(async { observer(&format!("unix://{}", socket.display())) });
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
