//! The agent's side of the CNI plugin (`POST /v1/cni/{add,del,check}` on the unix socket): node
//! IPAM, the pod's veth pair, the endpoint and its first policy, in the order Cilium's
//! `cmdAdd` and the agent's `PutEndpointID` do them. Every step of ADD is undone when a later
//! one fails, so a failed ADD leaves no device, address or endpoint behind.
//!
//! An agent killed in the middle of an ADD cannot undo anything, so ADD first writes an intent
//! record (state.rs) and marks the host veth it creates with an alias naming the state
//! directory. At start-up, `crate::cni::recover` rolls back every ADD whose record outlived its agent and
//! sweeps marked veths no endpoint owns.

use crate::endpoint::cni::{AddProgress, Undo};
use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse};

use super::{endpoint_model, AppState, FROM};
use crate::actors::endpoint::EndpointModel;
use crate::actors::loader::DetachEndpoint;
use crate::actors::policy_repo::{AddEndpoint, DeleteEndpoint, EndpointRequest, FindEndpoint};
use crate::cni::{code, CniError, CniInterface, CniIp, CniRequest, CniResult, CniRoute};
use crate::datapath::netdev::{self, PodInterfaceSpec, POD_GATEWAY, POD_GATEWAY6};
use crate::datapath::EndpointId;
use crate::endpoint::state::{AddIntent, StateError};

/// How long ADD waits for the agent's initial sync and for the endpoint's first policy.
const ADD_WAIT: Duration = Duration::from_secs(20);

fn cni_error(status: StatusCode, e: CniError) -> HttpResponse {
    let body = serde_json::to_string(&e).unwrap_or_else(|_| e.msg.clone());
    HttpResponse::build(status).json(serde_json::json!({ "error": body }))
}

fn fail(code: u32, msg: impl Into<String>, details: impl Into<String>) -> HttpResponse {
    respond(CniError::new(code, msg, details))
}

/// An actor's answer: its value, or the CNI error to answer with (the agent failed: 100; its
/// actors are gone, it is shutting down: 11).
fn answered<T>(
    r: Result<Result<T, String>, actix::MailboxError>,
    failed: &str,
) -> Result<T, CniError> {
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(CniError::new(code::AGENT_FAILURE, failed, e)),
        Err(e) => Err(CniError::new(
            code::TRY_AGAIN_LATER,
            "the agent is shutting down",
            e.to_string(),
        )),
    }
}

/// The HTTP answer carrying a CNI error, its status from the CNI code.
fn respond(e: CniError) -> HttpResponse {
    let status = match e.code {
        code::UNKNOWN_CONTAINER => StatusCode::NOT_FOUND,
        code::INVALID_ENV | code::INVALID_CONFIG => StatusCode::BAD_REQUEST,
        code::TRY_AGAIN_LATER => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    cni_error(status, e)
}

async fn find(st: &AppState, container_id: &str) -> Result<Option<EndpointId>, HttpResponse> {
    match st
        .repo
        .send(
            FindEndpoint {
                container_id: container_id.to_string(),
            },
            FROM,
        )
        .await
    {
        Ok(Ok(id)) => Ok(id),
        Ok(Err(e)) => Err(fail(
            code::AGENT_FAILURE,
            "endpoint lookup failed",
            e.to_string(),
        )),
        Err(e) => Err(fail(
            code::TRY_AGAIN_LATER,
            "the agent is shutting down",
            e.to_string(),
        )),
    }
}

/// ADD polls this while it waits: it must ask only the one endpoint, not every actor.
async fn model(st: &AppState, id: EndpointId) -> Option<EndpointModel> {
    endpoint_model(st, id).await.ok()
}

fn result_for(req: &CniRequest, m: &EndpointModel, host_mac: &str, pod_mac: &str) -> CniResult {
    let host_if = m.interface.clone().unwrap_or_default();
    CniResult {
        cni_version: req.cni_version.clone(),
        interfaces: vec![
            CniInterface {
                name: host_if,
                mac: host_mac.to_string(),
                sandbox: None,
            },
            CniInterface {
                name: req.ifname.clone(),
                mac: pod_mac.to_string(),
                sandbox: req.netns.as_ref().map(|p| p.display().to_string()),
            },
        ],
        ips: pod_ips(m)
            .into_iter()
            .map(|ip| CniIp {
                address: match ip {
                    IpAddr::V4(_) => format!("{ip}/32"),
                    IpAddr::V6(_) => format!("{ip}/128"),
                },
                gateway: gateway_of(ip),
                interface: 1,
            })
            .collect(),
        routes: pod_ips(m)
            .into_iter()
            .map(|ip| CniRoute {
                dst: if ip.is_ipv4() { "0.0.0.0/0" } else { "::/0" }.into(),
                gw: Some(gateway_of(ip)),
            })
            .collect(),
        dns: serde_json::json!({}),
    }
}

/// An endpoint's addresses, IPv4's first (one per family, as the ADD assigned them).
fn pod_ips(m: &EndpointModel) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = m.ips.iter().filter_map(|s| s.parse().ok()).collect();
    ips.sort_by_key(|ip| ip.is_ipv6());
    ips
}

/// The pod's gateway of `ip`'s family.
fn gateway_of(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(_) => POD_GATEWAY.to_string(),
        IpAddr::V6(_) => POD_GATEWAY6.to_string(),
    }
}

fn host_mac(name: &str) -> String {
    std::fs::read_to_string(format!("/sys/class/net/{name}/address"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// This agent run, as intent records name it: a record of another run is a crash's leftover.
fn run_id() -> &'static str {
    static RUN: OnceLock<String> = OnceLock::new();
    RUN.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        format!("{}-{nanos}", std::process::id())
    })
}

fn mark(st: &AppState) -> String {
    netdev::agent_mark(st.shared.state_dir.root())
}

/// Runs blocking netlink work off the actix threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, netdev::NetdevError> + Send + 'static,
) -> Result<T, String> {
    match web::block(f).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

fn release_ip(st: &AppState, ip: IpAddr) {
    if let Ok(mut g) = st.shared.ipam.lock() {
        g.release(ip);
    }
}

/// The container id names files and the interface name a device: both are checked first.
fn validate(req: &CniRequest) -> Result<(), CniError> {
    crate::cni::validate_container_id(&req.container_id)
        .and_then(|()| crate::cni::validate_ifname(&req.ifname))
}

/// Clears the way for an ADD or DEL of `container_id` as far as intent records go: an ADD of
/// this run in progress means "try again later"; the leftover of an earlier run (its rollback
/// at start-up failed) is rolled back now.
async fn settle_intent(st: &AppState, container_id: &str) -> Result<(), HttpResponse> {
    let intent = match st.shared.state_dir.intent(container_id) {
        Ok(None) => return Ok(()),
        Ok(Some(i)) => i,
        Err(e) => {
            return Err(fail(
                code::AGENT_FAILURE,
                "cannot read the record of an earlier ADD",
                e.to_string(),
            ))
        }
    };
    if intent.run == run_id() {
        return Err(fail(
            code::TRY_AGAIN_LATER,
            format!("an ADD of container {container_id} is in progress"),
            "",
        ));
    }
    let (host_if, mark) = (intent.host_if.clone(), mark(st));
    match blocking(move || netdev::delete_owned_interface(&host_if, &mark)).await {
        Ok(r) => {
            tracing::info!(container = %container_id, interface = %intent.host_if, outcome = ?r, "an interrupted ADD rolled back")
        }
        Err(e) => {
            return Err(fail(
                code::AGENT_FAILURE,
                format!(
                    "the interface {} of an interrupted ADD cannot be removed",
                    intent.host_if
                ),
                e,
            ))
        }
    }
    if let Ok(mut g) = st.shared.ipam.lock() {
        for ip in intent.ips() {
            if g.owner(ip).as_deref() == Some(container_id) {
                g.release(ip);
            }
        }
    }
    st.shared.state_dir.end_add(container_id).map_err(|e| {
        fail(
            code::AGENT_FAILURE,
            "cannot remove an ADD record",
            e.to_string(),
        )
    })
}

/// Takes one address per enabled family for `container_id` (IPv4's first). The addresses of
/// leftover intent records (rollbacks that failed) are reserved first: a pod may still hold
/// them.
fn allocate(st: &AppState, container_id: &str) -> Result<Vec<IpAddr>, CniError> {
    let (intents, _) = st.shared.state_dir.load_intents();
    let mut g = st
        .shared
        .ipam
        .lock()
        .map_err(|_| CniError::new(code::AGENT_FAILURE, "IPAM state is poisoned", ""))?;
    if g.ipam.is_none() && g.ipam6.is_none() {
        return Err(CniError::new(
            code::INVALID_CONFIG,
            "this node has no pod CIDR",
            "start the agent with --pod-cidr CIDR (or give the Node spec.podCIDRs)",
        ));
    }
    for i in intents.iter().filter(|i| i.run != run_id()) {
        for ip in i.ips() {
            let _ = g.reserve(ip, &i.container_id);
        }
    }
    g.allocate(container_id).map_err(|e| match e {
        // Addresses come back by themselves: the kubelet's retry succeeds.
        crate::ipam::IpamError::Cooling { .. } => {
            CniError::new(code::TRY_AGAIN_LATER, "IP allocation failed", e.to_string())
        }
        e => CniError::new(code::AGENT_FAILURE, "IP allocation failed", e.to_string()),
    })
}

/// Undoes what an ADD made (`endpoint::cni::AddProgress`), newest first.
async fn undo(made: AddProgress, st: &AppState) {
    for step in made.undo() {
        match step {
            Undo::Endpoint(id) => {
                let _ = st.repo.send(DeleteEndpoint { id }, FROM).await;
            }
            Undo::Interface(name) => {
                let n = name.clone();
                if let Err(e) = blocking(move || netdev::delete_host_interface(&n)).await {
                    // The address may still be on the pod's side: it stays allocated, and the
                    // record stays for the next agent (or a DEL) to roll back.
                    tracing::error!(interface = %name, error = %e, "a failed ADD's interface cannot be removed");
                    return;
                }
            }
            Undo::Address(ip) => release_ip(st, ip),
            Undo::Intent(container) => {
                if let Err(e) = st.shared.state_dir.end_add(&container) {
                    tracing::error!(%container, error = %e, "cannot remove an ADD record");
                }
            }
        }
    }
}

/// A repeated ADD of a container that has its endpoint answers with what exists.
async fn repeat_add(st: &AppState, req: &CniRequest, netns: &Path, id: EndpointId) -> HttpResponse {
    let Some(m) = model(st, id).await else {
        return fail(code::AGENT_FAILURE, format!("endpoint {id} vanished"), "");
    };
    let ips = pod_ips(&m);
    let (netns2, ifname) = (netns.to_path_buf(), req.ifname.clone());
    let pod_mac = match ips.is_empty() {
        false => blocking(move || netdev::inspect_pod_interface(&netns2, &ifname, ips))
            .await
            .ok(),
        true => None,
    };
    let Some(pod_mac) = pod_mac else {
        return fail(
            code::AGENT_FAILURE,
            format!(
                "container {} already has endpoint {id}, but its interface is not as created",
                req.container_id
            ),
            "delete the container (CNI DEL) and add it again",
        );
    };
    let host = host_mac(m.interface.as_deref().unwrap_or(""));
    HttpResponse::Ok().json(result_for(req, &m, &host, &pod_mac))
}

/// `POST /v1/cni/add`. Before anything is created, an intent record (container, address, host
/// interface) is written to the state directory; it is removed once the endpoint's own record
/// is on disk. An agent killed in between finds the record at start-up and rolls the ADD back.
pub async fn add(st: web::Data<AppState>, req: web::Json<CniRequest>) -> HttpResponse {
    let req = req.into_inner();
    if let Err(e) = validate(&req) {
        return respond(e);
    }
    let (Some(ns), Some(pod)) = (req.pod_namespace.clone(), req.pod_name.clone()) else {
        return fail(
            code::INVALID_ENV,
            "CNI_ARGS must name the pod",
            "K8S_POD_NAMESPACE and K8S_POD_NAME are required",
        );
    };
    let Some(netns) = req.netns.clone() else {
        return fail(code::INVALID_ENV, "CNI_NETNS is required for ADD", "");
    };
    // The initial sync first: before it, the pod's labels (and so its identity) may be unknown.
    let deadline = Instant::now() + ADD_WAIT;
    while !st.shared.ready.load(Ordering::SeqCst) {
        if Instant::now() > deadline {
            return fail(
                code::TRY_AGAIN_LATER,
                "the agent has not finished its initial sync",
                "",
            );
        }
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    match find(&st, &req.container_id).await {
        Err(r) => return r,
        Ok(Some(id)) => return repeat_add(&st, &req, &netns, id).await,
        Ok(None) => {}
    }
    if let Err(r) = settle_intent(&st, &req.container_id).await {
        return r;
    }
    let ips = match allocate(&st, &req.container_id) {
        Ok(ips) if !ips.is_empty() => ips,
        Ok(_) => {
            return fail(
                code::INVALID_CONFIG,
                "IP allocation failed",
                "no address family is enabled",
            )
        }
        Err(e) => return respond(e),
    };
    let host_if = netdev::host_interface_name(&req.container_id);
    let intent = AddIntent {
        container_id: req.container_id.clone(),
        host_if: host_if.clone(),
        ip: ips[0],
        more_ips: ips[1..].to_vec(),
        netns: netns.display().to_string(),
        ifname: req.ifname.clone(),
        run: run_id().to_string(),
    };
    if let Err(e) = st.shared.state_dir.begin_add(&intent) {
        for ip in &ips {
            release_ip(&st, *ip);
        }
        return match e {
            StateError::InProgress { .. } => fail(
                code::TRY_AGAIN_LATER,
                format!("an ADD of container {} is in progress", req.container_id),
                "",
            ),
            e => fail(code::AGENT_FAILURE, "cannot record the ADD", e.to_string()),
        };
    }
    let mut made = AddProgress::new(&req.container_id, &ips);
    // The veth pair and the pod's side (a stale half-made interface of this container is
    // replaced).
    let spec = PodInterfaceSpec {
        host_if: host_if.clone(),
        netns: netns.clone(),
        pod_if: req.ifname.clone(),
        ips: ips.clone(),
        mtu: st.shared.pod_mtu,
        mark: mark(&st),
    };
    let ifs = match blocking(move || netdev::create_pod_interface(&spec)).await {
        Ok(ifs) => ifs,
        Err(e) => {
            undo(made, &st).await;
            return fail(code::AGENT_FAILURE, "pod interface setup failed", e);
        }
    };
    made.made_interface(&host_if);
    // The endpoint: identity from the Pod and Namespace, programs attached (dropping until its
    // first policy is realized).
    let added = st
        .repo
        .send(
            AddEndpoint {
                request: EndpointRequest {
                    name: format!("{ns}/{pod}"),
                    ips: ips.clone(),
                    interface: Some(host_if.clone()),
                    container_id: Some(req.container_id.clone()),
                    netns: Some(netns.display().to_string()),
                    mac: Some(ifs.pod_mac.clone()),
                },
                restore: None,
            },
            FROM,
        )
        .await;
    let m = match added {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => {
            undo(made, &st).await;
            return fail(
                code::AGENT_FAILURE,
                "endpoint creation failed",
                e.to_string(),
            );
        }
        Err(e) => {
            undo(made, &st).await;
            return fail(
                code::TRY_AGAIN_LATER,
                "the agent is shutting down",
                e.to_string(),
            );
        }
    };
    let id = m.id;
    made.made_endpoint(id);
    let current = match wait_realized(&st, m, deadline).await {
        Ok(m) => m,
        Err(r) => {
            undo(made, &st).await;
            return r;
        }
    };
    // Only an endpoint whose record is on disk survives a restart: without it, the next agent
    // would roll this ADD back under a running pod. The endpoint actor writes it when it starts
    // (and retries with each regeneration).
    while !st.shared.state_dir.has_endpoint(id) && Instant::now() < deadline {
        actix_rt::time::sleep(Duration::from_millis(5)).await;
    }
    if !st.shared.state_dir.has_endpoint(id) {
        undo(made, &st).await;
        return fail(
            code::AGENT_FAILURE,
            format!("the state of endpoint {id} could not be written"),
            st.shared.state_dir.endpoint_dir(id).display().to_string(),
        );
    }
    if let Err(e) = st.shared.state_dir.end_add(&req.container_id) {
        // Harmless: at start-up a record whose container has an endpoint is simply dropped.
        tracing::error!(container = %req.container_id, error = %e, "cannot remove the ADD record");
    }
    if current.identity.is_none() {
        tracing::warn!(endpoint = id, pod = %format!("{ns}/{pod}"), "no Pod object for this container: the endpoint drops all traffic until one arrives");
    }
    tracing::info!(endpoint = id, pod = %format!("{ns}/{pod}"), ips = ?ips, interface = %host_if, "CNI ADD");
    HttpResponse::Ok().json(result_for(&req, &current, &ifs.host_mac, &ifs.pod_mac))
}

/// Waits for the endpoint's first policy, so the pod starts with its policy in force rather
/// than with the drop-all of a fresh endpoint. A pod the agent has no labels for stays
/// fail-closed (it drops) until its Pod object arrives; that is not worth failing the ADD for.
async fn wait_realized(
    st: &AppState,
    mut current: EndpointModel,
    deadline: Instant,
) -> Result<EndpointModel, HttpResponse> {
    let id = current.id;
    while current.identity.is_some() && !(current.regenerations > 0 && current.state == "ready") {
        if Instant::now() > deadline {
            return Err(fail(
                code::TRY_AGAIN_LATER,
                format!("endpoint {id} did not realize its policy in time"),
                current.error.unwrap_or_default(),
            ));
        }
        actix_rt::time::sleep(Duration::from_millis(5)).await;
        current = model(st, id).await.ok_or_else(|| {
            fail(
                code::AGENT_FAILURE,
                format!("endpoint {id} was deleted while being created"),
                "",
            )
        })?;
    }
    Ok(current)
}

/// `POST /v1/cni/del`: idempotent; removes the endpoint (programs and policy map), the veth pair
/// and the address, whichever of them still exist.
pub async fn del(st: web::Data<AppState>, req: web::Json<CniRequest>) -> HttpResponse {
    let req = req.into_inner();
    if let Err(e) = validate(&req) {
        return respond(e);
    }
    if let Err(r) = settle_intent(&st, &req.container_id).await {
        return r;
    }
    let host_if = match remove_container(&st, &req.container_id).await {
        Ok(host_if) => host_if,
        Err(r) => return r,
    };
    tracing::info!(container = %req.container_id, interface = %host_if, "CNI DEL");
    HttpResponse::Ok().json(serde_json::json!({}))
}

/// Removes a container's endpoint (programs and policy map), host veth and addresses, whichever
/// still exist; returns the host interface's name. CNI DEL, and the start-up sweep of pods that
/// were deleted while the agent was down.
pub(crate) async fn remove_container(
    st: &AppState,
    container_id: &str,
) -> Result<String, HttpResponse> {
    let mut ips: Vec<IpAddr> = Vec::new();
    let mut host_if = netdev::host_interface_name(container_id);
    match find(st, container_id).await {
        Err(r) => return Err(r),
        Ok(None) => {}
        Ok(Some(id)) => {
            if let Some(m) = model(st, id).await {
                ips = m.ips.iter().filter_map(|s| s.parse().ok()).collect();
                if let Some(i) = m.interface {
                    host_if = i;
                }
            }
            // Detached from the datapath before DEL answers. The endpoint's actor detaches
            // too, sooner or later; whichever runs second finds nothing to do, and the id is not
            // handed out again meanwhile (ids go round, see next_endpoint_id).
            let deleted = match st.repo.send(DeleteEndpoint { id }, FROM).await {
                Ok(Err(crate::actors::policy_repo::ApiError::NotFound(_))) => Ok(Ok(false)),
                r => r.map(|r| r.map(|()| true).map_err(|e| e.to_string())),
            };
            if answered(deleted, "endpoint deletion failed").map_err(respond)? {
                let detached = st
                    .loader
                    .send(DetachEndpoint { id }, FROM)
                    .await
                    .map(|r| r.map_err(|e| e.to_string()));
                answered(detached, "datapath detach failed").map_err(respond)?;
            }
        }
    }
    let name = host_if.clone();
    match web::block(move || netdev::delete_host_interface(&name)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            return Err(fail(
                code::AGENT_FAILURE,
                "pod interface removal failed",
                e.to_string(),
            ))
        }
        Err(e) => {
            return Err(fail(
                code::AGENT_FAILURE,
                "pod interface removal failed",
                e.to_string(),
            ))
        }
    }
    if let Ok(mut g) = st.shared.ipam.lock() {
        for ip in &ips {
            g.release(*ip);
        }
        // An ADD that died between allocation and endpoint creation leaves its addresses
        // owned by the container id alone.
        for ip in g.owned_by(container_id) {
            g.release(ip);
        }
    }
    Ok(host_if)
}

/// `POST /v1/cni/check`: the endpoint exists, its host interface exists, and the pod's
/// interface holds the endpoint's address.
pub async fn check(st: web::Data<AppState>, req: web::Json<CniRequest>) -> HttpResponse {
    let req = req.into_inner();
    if let Err(e) = validate(&req) {
        return respond(e);
    }
    let id = match find(&st, &req.container_id).await {
        Err(r) => return r,
        Ok(None) => {
            return fail(
                code::UNKNOWN_CONTAINER,
                format!("no endpoint for container {}", req.container_id),
                "",
            )
        }
        Ok(Some(id)) => id,
    };
    let Some(m) = model(&st, id).await else {
        return fail(
            code::UNKNOWN_CONTAINER,
            format!("endpoint {id} vanished"),
            "",
        );
    };
    let host_if = m.interface.clone().unwrap_or_default();
    let h = host_if.clone();
    match web::block(move || netdev::host_link_exists(&h)).await {
        Ok(Ok(true)) => {}
        _ => {
            return fail(
                code::AGENT_FAILURE,
                format!("host interface {host_if} of endpoint {id} is missing"),
                "",
            )
        }
    }
    let Some(netns) = req.netns.clone() else {
        return fail(code::INVALID_ENV, "CNI_NETNS is required for CHECK", "");
    };
    let ips = pod_ips(&m);
    if ips.is_empty() {
        return fail(
            code::AGENT_FAILURE,
            format!("endpoint {id} has no address"),
            "",
        );
    }
    let ifname = req.ifname.clone();
    match web::block(move || netdev::inspect_pod_interface(&netns, &ifname, ips)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            return fail(
                code::AGENT_FAILURE,
                "pod interface check failed",
                e.to_string(),
            )
        }
        Err(e) => {
            return fail(
                code::AGENT_FAILURE,
                "pod interface check failed",
                e.to_string(),
            )
        }
    }
    if m.state != "ready" {
        return fail(
            code::AGENT_FAILURE,
            format!("endpoint {id} is {}", m.state),
            m.error.unwrap_or_default(),
        );
    }
    HttpResponse::Ok().json(serde_json::json!({}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_id_is_stable_within_a_run() {
        assert_eq!(run_id(), run_id());
        assert!(run_id().starts_with(&format!("{}-", std::process::id())));
    }
}
