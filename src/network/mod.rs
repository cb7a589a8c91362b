//! Cluster networking: routes between nodes. `routes.rs` is the pure desired state
//! (nodes -> routes, and the rows of `ciliate node list`), `netlink.rs` the thin applier, and
//! `run_route_reconciler` the task that ties them to the Node objects the agent sees.

pub mod netlink;
pub mod routes;
pub mod tunnel;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::agent::objects::NodeInfo;
pub use routes::{RoutingConfig, RoutingMode, RoutingView, TunnelProtocol};

/// How often the kernel's routes are compared with the desired state even without a Node
/// change (a route deleted by hand comes back).
const RESYNC: Duration = Duration::from_secs(10);

/// The Node objects the agent knows, published by `PolicyRepoActor` on every change.
pub type NodeSet = BTreeMap<String, NodeInfo>;

/// Recomputes and applies the routes whenever the node set changes. Nothing is applied before
/// `ready` (the initial sync): an empty node set at start must not remove the routes a
/// previous run installed.
pub async fn run_route_reconciler(
    local: String,
    cfg: RoutingConfig,
    mut applier: Option<netlink::RouteApplier>,
    mut nodes: tokio::sync::watch::Receiver<NodeSet>,
    ready: Arc<AtomicBool>,
    view: Arc<Mutex<RoutingView>>,
) {
    while !ready.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    loop {
        let snapshot = nodes.borrow_and_update().clone();
        let plans = routes::desired_routes(&local, &snapshot, &cfg);
        let want = routes::all_routes(&plans);
        let local_ip = snapshot.get(&local).and_then(routes::node_ipv4);
        let outcome = match applier.take() {
            Some(mut a) => match actix_web::web::block(move || {
                let o = a.apply(&want, local_ip);
                (a, o)
            })
            .await
            {
                Ok((a, o)) => {
                    applier = Some(a);
                    o
                }
                Err(e) => {
                    tracing::error!(error = %e, "route reconciler stopped");
                    return;
                }
            },
            None => Default::default(),
        };
        let rows: Vec<_> = plans
            .iter()
            .map(|p| routes::node_row(p, &cfg, &outcome))
            .collect();
        for r in rows.iter().filter(|r| r.route.starts_with("error")) {
            tracing::warn!(node = %r.name, state = %r.route, "node not routed");
        }
        if let Ok(mut v) = view.lock() {
            v.routes_installed = outcome.values().filter(|o| o.is_ok()).count();
            v.nodes = rows;
        }
        tokio::select! {
            changed = nodes.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(RESYNC) => {},
        }
    }
}
