//! The agent's side of the CNI plugin (`POST /v1/cni/{add,del,check}` on the unix socket): node
//! IPAM, the pod's veth pair, the endpoint and its first policy, in the order Cilium's
//! `cmdAdd` and the agent's `PutEndpointID` do them. Every step of ADD is undone when a later
//! one fails, so a failed ADD leaves no device, address or endpoint behind.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse};

use super::{endpoint_model, AppState, FROM};
use crate::actors::endpoint::EndpointModel;
use crate::actors::policy_repo::{AddEndpoint, DeleteEndpoint, EndpointRequest, FindEndpoint};
use crate::cni::{code, CniError, CniInterface, CniIp, CniRequest, CniResult, CniRoute};
use crate::datapath::netdev::{self, PodInterfaceSpec, POD_GATEWAY};
use crate::datapath::EndpointId;

/// How long ADD waits for the agent's initial sync and for the endpoint's first policy.
const ADD_WAIT: Duration = Duration::from_secs(20);
/// The pod interface's MTU.
const POD_MTU: u32 = 1500;

fn cni_error(status: StatusCode, e: CniError) -> HttpResponse {
    let body = serde_json::to_string(&e).unwrap_or_else(|_| e.msg.clone());
    HttpResponse::build(status).json(serde_json::json!({ "error": body }))
}

fn fail(code: u32, msg: impl Into<String>, details: impl Into<String>) -> HttpResponse {
    let status = match code {
        code::UNKNOWN_CONTAINER => StatusCode::NOT_FOUND,
        code::INVALID_ENV | code::INVALID_CONFIG => StatusCode::BAD_REQUEST,
        code::TRY_AGAIN_LATER => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    cni_error(status, CniError::new(code, msg, details))
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
        ips: m
            .ips
            .iter()
            .filter_map(|s| s.parse::<Ipv4Addr>().ok())
            .map(|ip| CniIp {
                address: format!("{ip}/32"),
                gateway: POD_GATEWAY.to_string(),
                interface: 1,
            })
            .collect(),
        routes: vec![CniRoute {
            dst: "0.0.0.0/0".into(),
            gw: Some(POD_GATEWAY.to_string()),
        }],
        dns: serde_json::json!({}),
    }
}

fn host_mac(name: &str) -> String {
    std::fs::read_to_string(format!("/sys/class/net/{name}/address"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// `POST /v1/cni/add`.
pub async fn add(st: web::Data<AppState>, req: web::Json<CniRequest>) -> HttpResponse {
    let req = req.into_inner();
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
    // A repeated ADD for a container that has its endpoint answers with what exists.
    match find(&st, &req.container_id).await {
        Err(r) => return r,
        Ok(Some(id)) => {
            let Some(m) = model(&st, id).await else {
                return fail(code::AGENT_FAILURE, format!("endpoint {id} vanished"), "");
            };
            let ip = m.ips.iter().find_map(|s| s.parse::<Ipv4Addr>().ok());
            let (netns2, ifname) = (netns.clone(), req.ifname.clone());
            let pod_mac = match ip {
                Some(ip) => web::block(move || netdev::inspect_pod_interface(&netns2, &ifname, ip))
                    .await
                    .ok()
                    .and_then(Result::ok),
                None => None,
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
            return HttpResponse::Ok().json(result_for(&req, &m, &host, &pod_mac));
        }
        Ok(None) => {}
    }
    // IPAM.
    let ip = {
        let mut ipam = match st.shared.ipam.lock() {
            Ok(g) => g,
            Err(_) => return fail(code::AGENT_FAILURE, "IPAM state is poisoned", ""),
        };
        let Some(ipam) = ipam.ipam.as_mut() else {
            return fail(
                code::INVALID_CONFIG,
                "this node has no pod CIDR",
                "start the agent with --pod-cidr CIDR (or give the Node spec.podCIDRs)",
            );
        };
        match ipam.allocate(&req.container_id) {
            Ok(ip) => ip,
            Err(e) => return fail(code::AGENT_FAILURE, "IP allocation failed", e.to_string()),
        }
    };
    let release = |st: &AppState| {
        if let Ok(mut g) = st.shared.ipam.lock() {
            if let Some(i) = g.ipam.as_mut() {
                i.release(IpAddr::V4(ip));
            }
        }
    };
    // The veth pair and the pod's side.
    let host_if = netdev::host_interface_name(&req.container_id);
    let spec = PodInterfaceSpec {
        host_if: host_if.clone(),
        netns: netns.clone(),
        pod_if: req.ifname.clone(),
        ip,
        mtu: POD_MTU,
    };
    let ifs = match web::block(move || netdev::create_pod_interface(&spec)).await {
        Ok(Ok(ifs)) => ifs,
        Ok(Err(e)) => {
            release(&st);
            return fail(
                code::AGENT_FAILURE,
                "pod interface setup failed",
                e.to_string(),
            );
        }
        Err(e) => {
            release(&st);
            return fail(
                code::AGENT_FAILURE,
                "pod interface setup failed",
                e.to_string(),
            );
        }
    };
    let undo_interface = |name: String| async move {
        let _ = web::block(move || netdev::delete_host_interface(&name)).await;
    };
    // The endpoint: identity from the Pod and Namespace, programs attached (dropping until its
    // first policy is realized).
    let added = st
        .repo
        .send(
            AddEndpoint {
                request: EndpointRequest {
                    name: format!("{ns}/{pod}"),
                    ips: vec![IpAddr::V4(ip)],
                    interface: Some(host_if.clone()),
                    container_id: Some(req.container_id.clone()),
                    netns: Some(netns.display().to_string()),
                },
                restore: None,
            },
            FROM,
        )
        .await;
    let m = match added {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => {
            undo_interface(host_if).await;
            release(&st);
            return fail(
                code::AGENT_FAILURE,
                "endpoint creation failed",
                e.to_string(),
            );
        }
        Err(e) => {
            undo_interface(host_if).await;
            release(&st);
            return fail(
                code::TRY_AGAIN_LATER,
                "the agent is shutting down",
                e.to_string(),
            );
        }
    };
    // Wait for the first policy, so the pod starts with its policy in force rather than with
    // the drop-all of a fresh endpoint. A pod the agent has no labels for stays fail-closed
    // (it drops) until its Pod object arrives; that is not worth failing the ADD for.
    let id = m.id;
    let mut current = m;
    while current.identity.is_some() && !(current.regenerations > 0 && current.state == "ready") {
        if Instant::now() > deadline {
            let _ = st.repo.send(DeleteEndpoint { id }, FROM).await;
            undo_interface(host_if).await;
            release(&st);
            return fail(
                code::TRY_AGAIN_LATER,
                format!("endpoint {id} did not realize its policy in time"),
                current.error.unwrap_or_default(),
            );
        }
        actix_rt::time::sleep(Duration::from_millis(5)).await;
        match model(&st, id).await {
            Some(m) => current = m,
            None => {
                undo_interface(host_if).await;
                release(&st);
                return fail(
                    code::AGENT_FAILURE,
                    format!("endpoint {id} was deleted while being created"),
                    "",
                );
            }
        }
    }
    if current.identity.is_none() {
        tracing::warn!(endpoint = id, pod = %format!("{ns}/{pod}"), "no Pod object for this container: the endpoint drops all traffic until one arrives");
    }
    tracing::info!(endpoint = id, pod = %format!("{ns}/{pod}"), %ip, interface = %host_if, "CNI ADD");
    HttpResponse::Ok().json(result_for(&req, &current, &ifs.host_mac, &ifs.pod_mac))
}

/// `POST /v1/cni/del`: idempotent; removes the endpoint (programs and policy map), the veth pair
/// and the address, whichever of them still exist.
pub async fn del(st: web::Data<AppState>, req: web::Json<CniRequest>) -> HttpResponse {
    let req = req.into_inner();
    let mut ips: Vec<IpAddr> = Vec::new();
    let mut host_if = netdev::host_interface_name(&req.container_id);
    match find(&st, &req.container_id).await {
        Err(r) => return r,
        Ok(None) => {}
        Ok(Some(id)) => {
            if let Some(m) = model(&st, id).await {
                ips = m.ips.iter().filter_map(|s| s.parse().ok()).collect();
                if let Some(i) = m.interface {
                    host_if = i;
                }
            }
            match st.repo.send(DeleteEndpoint { id }, FROM).await {
                Ok(Ok(())) => {}
                Ok(Err(crate::actors::policy_repo::ApiError::NotFound(_))) => {}
                Ok(Err(e)) => {
                    return fail(
                        code::AGENT_FAILURE,
                        "endpoint deletion failed",
                        e.to_string(),
                    )
                }
                Err(e) => {
                    return fail(
                        code::TRY_AGAIN_LATER,
                        "the agent is shutting down",
                        e.to_string(),
                    )
                }
            }
        }
    }
    let name = host_if.clone();
    match web::block(move || netdev::delete_host_interface(&name)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            return fail(
                code::AGENT_FAILURE,
                "pod interface removal failed",
                e.to_string(),
            )
        }
        Err(e) => {
            return fail(
                code::AGENT_FAILURE,
                "pod interface removal failed",
                e.to_string(),
            )
        }
    }
    if let Ok(mut g) = st.shared.ipam.lock() {
        if let Some(ipam) = g.ipam.as_mut() {
            for ip in &ips {
                ipam.release(*ip);
            }
            // An ADD that died between allocation and endpoint creation leaves its address
            // owned by the container id alone.
            for ip in ipam.owned_by(&req.container_id) {
                ipam.release(ip);
            }
        }
    }
    tracing::info!(container = %req.container_id, interface = %host_if, "CNI DEL");
    HttpResponse::Ok().json(serde_json::json!({}))
}

/// `POST /v1/cni/check`: the endpoint exists, its host interface exists, and the pod's
/// interface holds the endpoint's address.
pub async fn check(st: web::Data<AppState>, req: web::Json<CniRequest>) -> HttpResponse {
    let req = req.into_inner();
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
    let (Some(netns), Some(ip)) = (
        req.netns.clone(),
        m.ips.iter().find_map(|s| s.parse::<Ipv4Addr>().ok()),
    ) else {
        return fail(code::INVALID_ENV, "CNI_NETNS is required for CHECK", "");
    };
    let ifname = req.ifname.clone();
    match web::block(move || netdev::inspect_pod_interface(&netns, &ifname, ip)).await {
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
