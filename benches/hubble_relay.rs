//! `ciliate relay` under load (issue #30): three agents' Hubble servers, each on its own thread
//! and socket as in the agent, are fed flows through the agent's flow sink at 30,000 flows/s in
//! all; the relay follows them (as `ciliate relay` does, on one thread, over the agents' unix
//! sockets) and serves one client following the whole cluster over loopback TCP.
//!
//! Reported: the lag from each flow's receipt by its agent (its `time`, milliseconds) to its
//! arrival at the client (p50, p99, max), and flows lost (sent by an agent and never received, or
//! reported lost by a `LostEvents`). Target: p99 <= 1 s, none lost. The relay sorts followed
//! flows within 100 ms windows, so 100-200 ms of lag is the design's.
//!
//! `cargo bench --bench hubble_relay [-- SECONDS [FLOWS_PER_SECOND]]` (default 10 s, 30,000/s)

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// With the binary's options (`ciliate::memory`), set before anything allocates as the binary
/// sets them: mimalloc's defaults commit arenas eagerly, in huge pages that a purge gives back
/// and the next allocation faults in again, 2 MiB zeroed at a time (a tenth of the CPU of a
/// change selecting 1,000 endpoints in `benches/agent.rs`), which the agent never pays.
#[used]
#[link_section = ".init_array"]
static CONFIGURE_ALLOCATOR: extern "C" fn() = ciliate::memory::configure_allocator;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ciliate::hubble::proto::{observer as opb, peer as ppb, relay as rpb};
use opb::get_flows_response::ResponseTypes;

#[path = "shared/flows.rs"]
mod shared;
use shared::{event, new_sink, observer, serve_hubble};

const NODES: usize = 3;
/// Flows are sent in bursts every tick, each node's share of the rate.
const TICK: Duration = Duration::from_millis(10);

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The relay over the agents' sockets, on its own thread, serving on loopback; its address.
fn serve_relay(sockets: &[std::path::PathBuf]) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let peers: Vec<ppb::ChangeNotification> = sockets
        .iter()
        .enumerate()
        .map(|(i, s)| ppb::ChangeNotification {
            name: format!("node-{i}"),
            address: format!("unix://{}", s.display()),
            r#type: ppb::ChangeNotificationType::PeerAdded as i32,
            tls: None,
        })
        .collect();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let relay = ciliate::hubble::relay::Relay::new(None);
            peers.into_iter().for_each(|p| relay.apply(p));
            listener.set_nonblocking(true).unwrap();
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(
                tokio::net::TcpListener::from_std(listener).unwrap(),
            );
            tonic::transport::Server::builder()
                .add_service(opb::observer_server::ObserverServer::new(relay))
                .serve_with_incoming(incoming)
                .await
                .unwrap();
        })
    });
    address
}

/// What the client saw.
#[derive(Default)]
struct Seen {
    per_node: [u64; NODES],
    lags_ms: Vec<i64>,
    lost: u64,
    connected: std::collections::BTreeSet<String>,
}

impl Seen {
    fn take(&mut self, r: opb::GetFlowsResponse) {
        match r.response_types {
            Some(ResponseTypes::Flow(f)) => {
                let t = f.time.expect("a flow has its time");
                let at = t.seconds * 1000 + i64::from(t.nanos) / 1_000_000;
                self.lags_ms.push(unix_ms() - at);
                let node = f.node_name.trim_start_matches("node-").parse::<usize>();
                self.per_node[node.expect("a node's name")] += 1;
            }
            Some(ResponseTypes::LostEvents(l)) => self.lost += l.num_events_lost,
            Some(ResponseTypes::NodeStatus(s))
                if s.state_change == rpb::NodeState::NodeConnected as i32 =>
            {
                self.connected.extend(s.node_names);
            }
            _ => {}
        }
    }
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let seconds = args.first().copied().unwrap_or(10);
    let rate = args.get(1).copied().unwrap_or(30_000);
    let dirs: Vec<_> = (0..NODES).map(|_| tempfile::tempdir().unwrap()).collect();
    let sinks: Vec<_> = (0..NODES).map(|_| new_sink(100_000)).collect();
    let sockets: Vec<_> = (0..NODES)
        .map(|i| {
            serve_hubble(
                dirs[i].path(),
                &format!("node-{i}"),
                sinks[i].0.flows.clone(),
            )
        })
        .collect();
    let relay = serve_relay(&sockets);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Seen::default()));
    let mut stream = rt.block_on(async {
        let mut client = observer(&relay);
        let req = opb::GetFlowsRequest {
            follow: true,
            ..Default::default()
        };
        loop {
            match client.get_flows(req.clone()).await {
                Ok(s) => break s.into_inner(),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    });
    // Read until every node is followed; then the flows start.
    rt.block_on(async {
        while seen.lock().unwrap().connected.len() < NODES {
            let r = stream.message().await.expect("the relay's stream").unwrap();
            seen.lock().unwrap().take(r);
        }
    });
    let reader = {
        let seen = seen.clone();
        rt.spawn(async move {
            while let Ok(Some(r)) = stream.message().await {
                seen.lock().unwrap().take(r);
            }
        })
    };

    let done = Arc::new(AtomicBool::new(false));
    let producer = {
        let done = done.clone();
        std::thread::spawn(move || {
            let per_tick = (rate as f64 * TICK.as_secs_f64() / NODES as f64).round() as u32;
            let start = Instant::now();
            let mut i = 0u32;
            for tick in 0.. {
                let at = start + TICK * tick;
                if at >= start + Duration::from_secs(seconds) {
                    break;
                }
                std::thread::sleep(at.saturating_duration_since(Instant::now()));
                for _ in 0..per_tick {
                    for (sink, cookie) in &sinks {
                        sink.consume(event(i, *cookie));
                    }
                    i += 1;
                }
            }
            done.store(true, Ordering::Relaxed);
            (u64::from(i), start.elapsed())
        })
    };
    let (per_node, took) = rt.block_on(async {
        while !done.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (sent, took) = producer.join().unwrap();
        // The tail: every flow sent, or 5 s.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && seen.lock().unwrap().per_node.iter().any(|n| *n < sent) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        (sent, took)
    });
    reader.abort();
    let s = seen.lock().unwrap();
    let mut lags = s.lags_ms.clone();
    lags.sort_unstable();
    let q = |p: f64| lags[((lags.len() - 1) as f64 * p) as usize];
    let received: u64 = s.per_node.iter().sum();
    let missing = per_node * NODES as u64 - received;
    println!(
        "hubble_relay: {NODES} nodes, {} flows in {:.2} s ({:.0} flows/s); received {received} \
         {:?}; missing {missing}; LostEvents {}",
        per_node * NODES as u64,
        took.as_secs_f64(),
        (per_node * NODES as u64) as f64 / took.as_secs_f64(),
        s.per_node,
        s.lost
    );
    println!(
        "hubble_relay: lag from the agent's receipt to the client: p50 {} ms, p99 {} ms, max {} ms \
         (target p99 <= 1000 ms, none lost): {}",
        q(0.5),
        q(0.99),
        q(1.0),
        if q(0.99) <= 1000 && missing == 0 && s.lost == 0 {
            "met"
        } else {
            "NOT met"
        }
    );
}
