//! Flow bench helpers shared by `benches/flows.rs` and `benches/hubble_relay.rs`: a varied stream
//! of verdict events, the agent's flow sink, and an agent's Hubble server over it.
#![allow(dead_code)]

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ciliate::datapath::events::{verdict_event, VerdictEvent};
use ciliate::datapath::flows::FlowRing;
use ciliate::hubble::proto::observer::observer_client::ObserverClient;
use ciliate::policy::attribution::{isolation_cookie, CookieJar, MatchKind, PolicyHits};
use ciliate::policy::rule::{PolicyKey, PolicyKind};
use ciliate::runtime::FlowSink;

pub fn addr(i: u32) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[..4].copy_from_slice(&[10, 1, (i >> 8) as u8, i as u8]);
    a
}

/// The i-th of a varied stream: 250 sources, 250 destinations, ports, 1 in 4 dropped.
pub fn event(i: u32, cookie: u32) -> VerdictEvent {
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

/// The agent's flow sink over a ring of `ring` flows (a live buffer of 4,096, the agent's), and
/// the cookie of its one default deny.
pub fn new_sink(ring: usize) -> (FlowSink, u32) {
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
        flows: Arc::new(FlowRing::new(ring, 4096)),
        staged: Default::default(),
        staged_counters: Default::default(),
    };
    (sink, cookie)
}

/// The agent's Hubble server for node `node` over `flows`, on its own thread as in the agent,
/// serving `dir/hubble.sock`; returns the socket.
pub fn serve_hubble(dir: &Path, node: &str, flows: Arc<FlowRing>) -> PathBuf {
    use ciliate::hubble::server as hs;
    let engine = Arc::new(std::sync::RwLock::new(
        ciliate::policy::engine::PolicyEngine::new(),
    ));
    let sources = hs::Sources {
        node: node.into(),
        flows,
        lookup: Arc::new(hs::EngineLookup {
            engine,
            workloads: Default::default(),
        }),
        nodes: tokio::sync::watch::channel(Default::default()).1,
        started: std::time::Instant::now(),
        port: 4244,
        local_address: String::new(),
        tls: false,
    };
    let listeners = hs::bind(dir, &hs::HubbleConfig::default()).expect("hubble.sock");
    let socket = listeners.socket.clone();
    hs::spawn(hs::Hubble::new(sources), listeners).expect("the Hubble thread");
    socket
}

/// An Observer client of `address` (`unix:///path` or `HOST:PORT`) with the relay's HTTP/2
/// windows (grpc-go's clients, the hubble CLI among them, grow theirs to the bandwidth-delay
/// product), connected when first used.
pub fn observer(address: &str) -> ObserverClient<tonic::transport::Channel> {
    ObserverClient::new(ciliate::hubble::relay::channel(address, None).expect("a channel"))
}
