//! The agent's HTTP surfaces (actix-web): the read-only debug server on TCP (`--debug-addr`,
//! interfaces.md section 3) and the REST API on the unix socket (`--api-socket`, section 4) that
//! the CLI and the CNI plugin use. Handlers only translate HTTP to actor messages.

mod cni;
mod page;
mod traffic;

pub(crate) use cni::remove_container;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse};
use futures_util::future::LocalBoxFuture;
use serde::Serialize;

use crate::actors::endpoint::{EndpointModel, GetEndpoint};
use crate::actors::loader::{GetIpcache, GetPolicyMap, LoaderActor};
use crate::actors::policy_repo::{
    AddEndpoint, ApiError, ConfigureEndpoint, DeleteEndpoint, EndpointRequest, FindEndpoint,
    GetIdentities, GetIpcacheView, GetPolicies, IpcacheModel, ListEndpoints, PolicyRepoActor,
};
use crate::datapath::EndpointId;
use crate::introspect::TracedAddr;
use crate::runtime::Shared;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub shared: Shared,
    pub repo: TracedAddr<PolicyRepoActor>,
    pub loader: TracedAddr<LoaderActor>,
    pub mode: &'static str,
    pub datapath: &'static str,
    pub started: Instant,
}

const FROM: &str = "api";

fn error(status: StatusCode, message: String) -> HttpResponse {
    HttpResponse::build(status).json(serde_json::json!({ "error": message }))
}

fn api_error(e: ApiError) -> HttpResponse {
    let status = match &e {
        ApiError::NotFound(_) => StatusCode::NOT_FOUND,
        ApiError::Conflict(_) => StatusCode::CONFLICT,
        ApiError::Invalid(_) => StatusCode::BAD_REQUEST,
        ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error(status, e.to_string())
}

fn mailbox_error(e: actix::MailboxError) -> HttpResponse {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("agent is shutting down: {e}"),
    )
}

/// `GET /v1/status` (and `ciliate status`).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct StatusModel {
    pub node_name: String,
    pub mode: String,
    pub datapath: String,
    pub ready: bool,
    pub policy_revision: u64,
    pub endpoints: usize,
    pub identities: usize,
    pub policies: usize,
    pub policies_rejected: usize,
    pub uptime_seconds: u64,
    /// Node IPAM, when the node has an IPv4 pod CIDR.
    #[serde(default)]
    pub ipam: Option<IpamStatus>,
    /// The same for the node's IPv6 pod CIDR (`--enable-ipv6`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipam_ipv6: Option<IpamStatus>,
    /// `native` or `tunnel` (`--routing-mode`).
    #[serde(default)]
    pub routing_mode: String,
    /// Routes to other nodes' pod CIDRs this agent has in the kernel.
    #[serde(default)]
    pub routes_installed: usize,
    /// `--enable-ipv4-masquerade`: `enabled`, `disabled`, `none` (memory datapath) or `error: ...`.
    #[serde(default)]
    pub masquerade: String,
    /// `--enable-ipv6-masquerade` (with `--enable-ipv6`): the same states; absent without IPv6.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub masquerade_ipv6: String,
    /// BPF host routing: `bpf (<device>)`, `bpf, send side only: <why>`, `legacy` or `none`.
    #[serde(default)]
    pub host_routing: String,
    /// Tunnel mode: `bpf (<node address>)`, `kernel (<why>)` or `kernel: <error>`; absent in
    /// native routing.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tunnel: String,
    /// Start-up phases and the seconds each took (`/debug/startup`).
    #[serde(default)]
    pub bootstrap_seconds: std::collections::BTreeMap<String, f64>,
    /// Services, frontends and backends known, and where they are translated.
    #[serde(default)]
    pub services: Option<crate::services::ServiceCounts>,
    /// Kubernetes mode: where other nodes' pods come from (`CiliateEndpointSlice`, or `Pod`
    /// with `--watch-pods`) and this node's endpoint slices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_pods: Option<crate::k8s::slices::PodSourceView>,
    /// Kubernetes mode: policy kinds the API server does not serve (their CRD is not
    /// installed), e.g. `AdminNetworkPolicy`: none of them can exist, so none is enforced.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kinds_not_served: Vec<String>,
    /// The HTTP proxy (L7 HTTP policy) as last seen: connected, or why not (connections L7
    /// rules cover are dropped meanwhile), and how many endpoints have L7 rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_proxy: Option<HttpProxyStatus>,
    /// `--enable-policy`: `default`, `always` or `never`.
    #[serde(default)]
    pub policy_enforcement: String,
    /// `--policy-audit-mode`: every endpoint audits (reports drops, forwards the packets);
    /// `--enable-policy=never` audits too. An endpoint's own setting is in its `audit`.
    #[serde(default)]
    pub policy_audit_mode: bool,
    /// `--enable-host-firewall`: `enforcing`, `audit` (the host endpoint's or every
    /// endpoint's audit mode) or `off`.
    #[serde(default)]
    pub host_firewall: String,
    /// Where the host firewall's programs are: the native devices, comma-separated, `off`, or
    /// what is wrong.
    #[serde(default)]
    pub host_firewall_device: String,
    /// Connections of the node's own the host policies in force would cut (its API server).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_firewall_warnings: Vec<String>,
}

/// `status`'s view of the HTTP proxy.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct HttpProxyStatus {
    #[serde(flatten)]
    pub proxy: crate::proxy::http::state::ProxyView,
    pub endpoints_with_l7_rules: usize,
}

fn ipam_status(
    pool: Option<&crate::ipam::Ipam>,
    source: Option<crate::ipam::CidrSource>,
) -> Option<IpamStatus> {
    pool.map(|i| IpamStatus {
        pod_cidr: i.cidr().to_string(),
        source,
        allocated: i.used(),
        capacity: i.capacity(),
    })
}

/// The node's pod CIDR and how much of it is in use.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct IpamStatus {
    pub pod_cidr: String,
    /// `node-spec`, `node-annotation` or `flag`.
    pub source: Option<crate::ipam::CidrSource>,
    pub allocated: usize,
    pub capacity: u64,
}

async fn healthz() -> HttpResponse {
    HttpResponse::Ok().content_type("text/plain").body("ok\n")
}

async fn readyz(st: web::Data<AppState>) -> HttpResponse {
    if st.shared.ready.load(Ordering::SeqCst) {
        HttpResponse::Ok()
            .content_type("text/plain")
            .body("ready\n")
    } else {
        let mut body = String::from("initial sync not done\n");
        for w in st
            .shared
            .sync_waiting
            .lock()
            .map(|w| w.clone())
            .unwrap_or_default()
        {
            body.push_str(&format!("waiting for {w}\n"));
        }
        HttpResponse::ServiceUnavailable()
            .content_type("text/plain")
            .body(body)
    }
}

async fn metrics(st: web::Data<AppState>) -> HttpResponse {
    let m = &st.shared.metrics;
    for (kind, depth) in st.shared.registry.mailboxes_by_kind() {
        m.actor_mailbox
            .get_or_create(&crate::metrics::ActorLabels {
                actor: kind.to_string(),
            })
            .set(depth);
    }
    HttpResponse::Ok()
        // What prometheus-client writes: OpenMetrics text, not the 0.0.4 format.
        .content_type("application/openmetrics-text; version=1.0.0; charset=utf-8")
        .body(m.encode())
}

async fn actors(st: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(st.shared.registry.summaries())
}

async fn actor_messages(st: web::Data<AppState>, name: web::Path<String>) -> HttpResponse {
    let name = name.into_inner().replace("%2F", "/").replace("%2f", "/");
    match st.shared.registry.get(&name) {
        Some(j) => HttpResponse::Ok().json(j.messages()),
        None => error(StatusCode::NOT_FOUND, format!("no actor named {name:?}")),
    }
}

/// `/debug/changes`: recent changes, newest first.
async fn changes(st: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(st.shared.registry.changes())
}

/// `/debug/changes/{id}`: one change's messages through the actors, in the order they were sent.
async fn change(st: web::Data<AppState>, id: web::Path<String>) -> HttpResponse {
    let Ok(id) = id.parse::<crate::introspect::ChangeId>() else {
        return error(
            StatusCode::BAD_REQUEST,
            format!("change id {id:?} is not a number"),
        );
    };
    match st.shared.registry.change(id) {
        Some(c) => HttpResponse::Ok().json(c),
        None => error(
            StatusCode::NOT_FOUND,
            format!(
                "no change {id} (only the last {} are kept)",
                crate::introspect::CHANGES_KEPT
            ),
        ),
    }
}

/// `/debug/flows?since_ms=..&limit=..` plus `ciliate monitor`'s filters: kept flows, oldest
/// first (the last `limit`, default 500).
async fn debug_flows(st: web::Data<AppState>, q: web::Query<MonitorQuery>) -> HttpResponse {
    let q = q.into_inner();
    let limit = q.limit.unwrap_or(500);
    let since = q.since_ms.unwrap_or(0);
    let mut flows = st.shared.flows.query(since, &q.filter());
    let skip = flows.len().saturating_sub(limit);
    let shown: Vec<FlowView> = flows
        .split_off(skip)
        .into_iter()
        .map(|flow| FlowView {
            why: flow.why(),
            flow,
        })
        .collect();
    HttpResponse::Ok().json(shown)
}

/// A flow with its deciding policies in words, as `ciliate monitor` prints them.
#[derive(Serialize)]
struct FlowView {
    #[serde(flatten)]
    flow: crate::datapath::flows::Flow,
    why: Option<String>,
}

/// Every endpoint's model, by asking each endpoint actor.
pub async fn endpoint_models(st: &AppState) -> Result<Vec<EndpointModel>, HttpResponse> {
    let handles = st
        .repo
        .send(ListEndpoints, FROM)
        .await
        .map_err(mailbox_error)?
        .map_err(api_error)?;
    let futs = handles.iter().map(|(_, addr)| addr.send(GetEndpoint, FROM));
    let mut out = Vec::new();
    for r in futures_join(futs).await {
        if let Ok(Ok(m)) = r {
            out.push(m);
        }
    }
    out.sort_by_key(|m| m.id);
    Ok(out)
}

async fn futures_join<F: std::future::Future>(futs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut out = Vec::new();
    for f in futs.collect::<Vec<_>>() {
        out.push(f.await);
    }
    out
}

async fn endpoints(st: web::Data<AppState>) -> HttpResponse {
    match endpoint_models(&st).await {
        Ok(v) => HttpResponse::Ok().json(v),
        Err(r) => r,
    }
}

/// One endpoint's model, asking only that endpoint's actor.
pub async fn endpoint_model(st: &AppState, id: EndpointId) -> Result<EndpointModel, HttpResponse> {
    let handles = st
        .repo
        .send(ListEndpoints, FROM)
        .await
        .map_err(mailbox_error)?
        .map_err(api_error)?;
    let Some((_, addr)) = handles.into_iter().find(|(i, _)| *i == id) else {
        return Err(api_error(ApiError::NotFound(format!("endpoint {id}"))));
    };
    match addr.send(GetEndpoint, FROM).await {
        Ok(Ok(m)) => Ok(m),
        Ok(Err(e)) => Err(error(StatusCode::INTERNAL_SERVER_ERROR, e)),
        Err(e) => Err(mailbox_error(e)),
    }
}

async fn endpoint(st: web::Data<AppState>, id: web::Path<EndpointId>) -> HttpResponse {
    match endpoint_model(&st, id.into_inner()).await {
        Ok(m) => HttpResponse::Ok().json(m),
        Err(r) => r,
    }
}

async fn policy(st: web::Data<AppState>) -> HttpResponse {
    match st.repo.send(GetPolicies, FROM).await {
        Ok(Ok(p)) => HttpResponse::Ok().json(p),
        Ok(Err(e)) => api_error(e),
        Err(e) => mailbox_error(e),
    }
}

async fn identities(st: web::Data<AppState>) -> HttpResponse {
    match st.repo.send(GetIdentities, FROM).await {
        Ok(Ok(p)) => HttpResponse::Ok().json(p),
        Ok(Err(e)) => api_error(e),
        Err(e) => mailbox_error(e),
    }
}

async fn ipcache(st: web::Data<AppState>) -> HttpResponse {
    match st.repo.send(GetIpcacheView, FROM).await {
        Ok(Ok(p)) => HttpResponse::Ok().json(p),
        Ok(Err(e)) => api_error(e),
        Err(e) => mailbox_error(e),
    }
}

async fn bpf_policy(st: web::Data<AppState>, id: web::Path<EndpointId>) -> HttpResponse {
    match st
        .loader
        .send(
            GetPolicyMap {
                id: id.into_inner(),
            },
            FROM,
        )
        .await
    {
        Ok(Ok(d)) => HttpResponse::Ok().json(d),
        Ok(Err(crate::datapath::DatapathError::UnknownEndpoint(id))) => api_error(
            ApiError::NotFound(format!("endpoint {id} has no policy map")),
        ),
        Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        Err(e) => mailbox_error(e),
    }
}

/// The datapath's own ipcache (what the kernel holds, not the engine's view).
async fn bpf_ipcache(st: web::Data<AppState>) -> HttpResponse {
    match st.loader.send(GetIpcache, FROM).await {
        Ok(Ok(entries)) => {
            let rows: Vec<_> = entries
                .into_iter()
                .map(|(prefix, identity)| IpcacheModel {
                    prefix: prefix.to_string(),
                    identity,
                })
                .collect();
            HttpResponse::Ok().json(rows)
        }
        Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        Err(e) => mailbox_error(e),
    }
}

/// `status`'s `host_firewall`: off without `--enable-host-firewall`, else the host endpoint's
/// audit mode (its own, or the agent's `--policy-audit-mode` / `--enable-policy=never`).
async fn host_firewall_mode(st: &AppState) -> &'static str {
    let e = st.shared.enforcement;
    if !e.host_firewall {
        return crate::endpoint::host::firewall_mode(false, false);
    }
    let own = match st.repo.send(ListEndpoints, FROM).await {
        Ok(Ok(handles)) => match handles
            .into_iter()
            .find(|(id, _)| *id == crate::endpoint::host::HOST_ENDPOINT_ID)
        {
            Some((_, addr)) => matches!(addr.send(GetEndpoint, FROM).await, Ok(Ok(m)) if m.audit),
            None => false,
        },
        _ => false,
    };
    let (_, _, audit) = e.apply(false, false, own);
    crate::endpoint::host::firewall_mode(true, audit)
}

/// `--enable-policy`'s value, as given.
fn enforcement_name(mode: crate::config::PolicyEnforcement) -> &'static str {
    use crate::config::PolicyEnforcement as P;
    match mode {
        P::Default => "default",
        P::Always => "always",
        P::Never => "never",
    }
}

async fn status(st: web::Data<AppState>) -> HttpResponse {
    let pol = match st.repo.send(GetPolicies, FROM).await {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return api_error(e),
        Err(e) => return mailbox_error(e),
    };
    let (endpoints, identities) = {
        let e = match st.shared.engine.read() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        (
            st.shared.metrics.endpoints.get() as usize,
            e.identities().len(),
        )
    };
    let routing = routing_view(&st);
    let host_firewall = host_firewall_mode(&st).await;
    HttpResponse::Ok().json(StatusModel {
        node_name: st.shared.node_name.clone(),
        mode: st.mode.into(),
        datapath: st.datapath.into(),
        ready: st.shared.ready.load(Ordering::SeqCst),
        policy_revision: pol.revision,
        endpoints,
        identities,
        policies: pol
            .policies
            .iter()
            .filter(|p| p.status == "accepted" || p.previous_version_enforced)
            .count(),
        policies_rejected: pol
            .policies
            .iter()
            .filter(|p| p.status != "accepted")
            .count(),
        uptime_seconds: st.started.elapsed().as_secs(),
        ipam: st
            .shared
            .ipam
            .lock()
            .ok()
            .and_then(|g| ipam_status(g.ipam.as_ref(), g.source)),
        ipam_ipv6: st
            .shared
            .ipam
            .lock()
            .ok()
            .and_then(|g| ipam_status(g.ipam6.as_ref(), g.source6)),
        routing_mode: routing.mode,
        routes_installed: routing.routes_installed,
        masquerade: routing.masquerade,
        masquerade_ipv6: routing.masquerade_ipv6,
        host_routing: routing.host_routing,
        tunnel: routing.tunnel,
        bootstrap_seconds: st.shared.bootstrap.phases().into_iter().collect(),
        services: Some(st.shared.services.counts()),
        remote_pods: st
            .shared
            .pod_source
            .lock()
            .ok()
            .map(|v| v.clone())
            .filter(|v| !v.remote_pods_from.is_empty()),
        kinds_not_served: st
            .shared
            .kinds_not_served
            .lock()
            .map(|k| k.iter().map(|s| s.to_string()).collect())
            .unwrap_or_default(),
        http_proxy: (st.datapath == "bpf").then(|| HttpProxyStatus {
            proxy: st.shared.http.proxy(),
            endpoints_with_l7_rules: st.shared.http.endpoints(),
        }),
        policy_enforcement: enforcement_name(st.shared.enforcement.mode).into(),
        policy_audit_mode: {
            let (_, _, audit) = st.shared.enforcement.apply(false, false, false);
            audit
        },
        host_firewall: host_firewall.into(),
        host_firewall_device: routing.host_firewall_device,
        host_firewall_warnings: st
            .shared
            .host_firewall_warnings
            .lock()
            .map(|w| w.clone())
            .unwrap_or_default(),
    })
}

/// `GET /debug/startup`: each start-up phase and the seconds it took, in order.
async fn startup(st: web::Data<AppState>) -> HttpResponse {
    let phases: Vec<serde_json::Value> = st
        .shared
        .bootstrap
        .phases()
        .into_iter()
        .map(|(scope, seconds)| serde_json::json!({"scope": scope, "seconds": seconds}))
        .collect();
    HttpResponse::Ok().json(phases)
}

fn routing_view(st: &AppState) -> crate::network::RoutingView {
    match st.shared.routing.lock() {
        Ok(g) => g.clone(),
        Err(p) => p.into_inner().clone(),
    }
}

/// `GET /debug/nodes`: the routing mode, the routes installed and every node's row.
async fn debug_nodes(st: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(routing_view(&st))
}

/// `GET /v1/nodes`: every node with its addresses, pod CIDRs and route state.
async fn nodes(st: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(routing_view(&st).nodes)
}

/// `GET /debug/services`: the counts `ciliate status` shows and every frontend.
async fn debug_services(st: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({
        "counts": st.shared.services.counts(),
        "frontends": st.shared.services.list(),
    }))
}

/// `GET /v1/fqdn/cache` (and `ciliate fqdn cache list`): every learned name, its addresses,
/// when the last of them expires (seconds since the epoch), the endpoints that asked.
async fn fqdn_cache(st: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(fqdn_rows(&st))
}

fn fqdn_rows(st: &AppState) -> Vec<serde_json::Value> {
    let cache = st.shared.dns.cache();
    cache
        .names
        .iter()
        .map(|(name, e)| {
            serde_json::json!({
                "name": name,
                "ips": e.ips.iter().map(|c| c.ip.to_string()).collect::<Vec<_>>(),
                "expires_at": e.ips.iter().map(|c| c.expires_at).max().unwrap_or(0),
                "endpoints": e.endpoints,
            })
        })
        .collect()
}

/// `GET /debug/dns`: the proxy as last seen and the FQDN cache.
async fn debug_dns(st: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({
        "proxy": st.shared.dns.proxy_view(),
        "endpoints_with_dns_rules": st.shared.dns.rules().endpoints.len(),
        "rules_sync": st.shared.dns.sync.view(),
        "cache": fqdn_rows(&st),
    }))
}

/// `GET /debug/http`: the HTTP proxy as last seen, endpoints with L7 rules, recent L7 flows.
async fn debug_http(st: web::Data<AppState>) -> HttpResponse {
    let filter = crate::datapath::events::FlowFilter {
        kind: Some("l7".into()),
        ..Default::default()
    };
    let (recent, _) = st.shared.flows.follow(0, &filter);
    let recent: Vec<_> = recent.into_iter().rev().take(100).collect();
    HttpResponse::Ok().json(serde_json::json!({
        "proxy": st.shared.http.proxy(),
        "endpoints_with_l7_rules": st.shared.http.endpoints(),
        "rules_sync": st.shared.http.sync.view(),
        "flows": recent,
    }))
}

/// `GET /v1/services` (and `ciliate service list`): every frontend with its backends.
async fn services(st: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(st.shared.services.list())
}

async fn add_endpoint(st: web::Data<AppState>, req: web::Json<EndpointRequest>) -> HttpResponse {
    match st
        .repo
        .send(
            AddEndpoint {
                request: req.into_inner(),
                restore: None,
            },
            FROM,
        )
        .await
    {
        Ok(Ok(m)) => HttpResponse::Created().json(m),
        Ok(Err(e)) => api_error(e),
        Err(e) => mailbox_error(e),
    }
}

async fn delete_endpoint(st: web::Data<AppState>, id: web::Path<EndpointId>) -> HttpResponse {
    match st
        .repo
        .send(
            DeleteEndpoint {
                id: id.into_inner(),
            },
            FROM,
        )
        .await
    {
        Ok(Ok(())) => HttpResponse::NoContent().finish(),
        Ok(Err(e)) => api_error(e),
        Err(e) => mailbox_error(e),
    }
}

/// `PATCH /v1/endpoints/{id}/config` with `{"PolicyAuditMode": "Enabled"|"Disabled"}`.
async fn configure_endpoint(
    st: web::Data<AppState>,
    id: web::Path<EndpointId>,
    body: web::Json<std::collections::BTreeMap<String, String>>,
) -> HttpResponse {
    let id = id.into_inner();
    let audit = match audit_setting(id, &body) {
        Ok(a) => a,
        Err(e) => return api_error(ApiError::Invalid(e)),
    };
    match st.repo.send(ConfigureEndpoint { id, audit }, FROM).await {
        Ok(Ok(())) => HttpResponse::NoContent().finish(),
        Ok(Err(e)) => api_error(e),
        Err(e) => mailbox_error(e),
    }
}

/// The one option `endpoint config` knows, as Cilium names it.
fn audit_setting(
    id: EndpointId,
    options: &std::collections::BTreeMap<String, String>,
) -> Result<bool, String> {
    if let Some(other) = options.keys().find(|k| *k != "PolicyAuditMode") {
        return Err(format!(
            "endpoint {id}: unknown option {other:?} (known: PolicyAuditMode)"
        ));
    }
    match options.get("PolicyAuditMode").map(String::as_str) {
        Some("Enabled") => Ok(true),
        Some("Disabled") => Ok(false),
        Some(v) => Err(format!(
            "endpoint {id}: PolicyAuditMode must be Enabled or Disabled, not {v:?}"
        )),
        None => Err(format!(
            "endpoint {id}: no option given (PolicyAuditMode=Enabled|Disabled)"
        )),
    }
}

#[derive(serde::Deserialize)]
struct ByContainer {
    container_id: String,
}

async fn find_endpoint(st: web::Data<AppState>, q: web::Query<ByContainer>) -> HttpResponse {
    match st
        .repo
        .send(
            FindEndpoint {
                container_id: q.into_inner().container_id,
            },
            FROM,
        )
        .await
    {
        Ok(Ok(Some(id))) => HttpResponse::Ok().json(serde_json::json!({ "id": id })),
        Ok(Ok(None)) => api_error(ApiError::NotFound("no endpoint for that container".into())),
        Ok(Err(e)) => api_error(e),
        Err(e) => mailbox_error(e),
    }
}

/// `GET /v1/monitor`: policy verdict events as they happen, one JSON object per line.
/// `/v1/monitor`'s query: the flow filters, and `since_ms` (unix milliseconds) to start with
/// the kept flows received since then.
#[derive(Debug, serde::Deserialize)]
struct MonitorQuery {
    since_ms: Option<u64>,
    /// `/debug/flows`: at most this many (the newest).
    limit: Option<usize>,
    from: Option<String>,
    to: Option<String>,
    port: Option<u16>,
    verdict: Option<String>,
    policy: Option<String>,
    tier: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
}

/// Flows (the kept ones first with `since_ms`, then live ones; filtered here so that a narrow
/// question does not stream everything) and notifications, as JSON lines.
async fn monitor(st: web::Data<AppState>, q: web::Query<MonitorQuery>) -> HttpResponse {
    let q = q.into_inner();
    let filter = q.filter();
    let (history, live) = match q.since_ms {
        Some(since) => st.shared.flows.follow(since, &filter),
        None => (Vec::new(), st.shared.flows.subscribe()),
    };
    use futures_util::StreamExt;
    let engine = st.shared.engine.clone();
    let labeled = move |e: &crate::datapath::flows::Flow| match engine.read() {
        Ok(eng) => json_line(&crate::traffic::observe::with_labels(&eng, e)),
        Err(_) => json_line(e),
    };
    let kept = history
        .into_iter()
        .map(|e| Ok(labeled(&e)))
        .collect::<Vec<_>>();
    let kept = futures_util::stream::iter(kept);
    let live = json_lines(live, move |e| filter.accepts(e), labeled);
    let notices = json_lines(st.shared.notifications.subscribe(), |_| true, json_line);
    HttpResponse::Ok()
        .content_type("application/x-ndjson")
        .streaming(kept.chain(futures_util::stream::select(live, notices)))
}

impl MonitorQuery {
    fn filter(&self) -> crate::datapath::events::FlowFilter {
        crate::datapath::events::FlowFilter {
            from: self.from.clone(),
            to: self.to.clone(),
            port: self.port,
            verdict: self.verdict.clone(),
            policy: self.policy.clone(),
            tier: self.tier.clone(),
            kind: self.kind.clone(),
        }
    }
}

fn json_line<T: Serialize>(v: &T) -> actix_web::web::Bytes {
    let mut line = serde_json::to_vec(v).unwrap_or_default();
    line.push(b'\n');
    actix_web::web::Bytes::from(line)
}

/// A broadcast channel as a stream of JSON lines; a slow reader is told how many it missed.
fn json_lines<T: Serialize + Clone + Send + 'static>(
    rx: tokio::sync::broadcast::Receiver<T>,
    keep: impl Fn(&T) -> bool + 'static,
    render: impl Fn(&T) -> actix_web::web::Bytes + 'static,
) -> impl futures_util::Stream<Item = Result<actix_web::web::Bytes, actix_web::Error>> {
    use tokio::sync::broadcast::error::RecvError;
    let keep = std::rc::Rc::new(keep);
    let render = std::rc::Rc::new(render);
    futures_util::stream::unfold(rx, move |mut rx| {
        let (keep, render) = (keep.clone(), render.clone());
        async move {
            let line = loop {
                match rx.recv().await {
                    Ok(ev) if !keep(&ev) => continue,
                    Ok(ev) => break render(&ev),
                    // A slow reader missed events: say how many, and go on.
                    Err(RecvError::Lagged(n)) => {
                        break actix_web::web::Bytes::from(
                            format!("{{\"lost\":{n}}}\n").into_bytes(),
                        )
                    }
                    Err(RecvError::Closed) => return None,
                }
            };
            Some((Ok(line), rx))
        }
    })
}

/// Read-only routes, served on both the debug address and the socket.
pub fn read_routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/healthz", web::get().to(healthz))
        .route("/readyz", web::get().to(readyz))
        .route("/metrics", web::get().to(metrics))
        .route("/debug/", web::get().to(page::page))
        .route("/debug", web::get().to(page::page))
        .route("/debug/actors", web::get().to(actors))
        .route(
            "/debug/actors/{name:.+}/messages",
            web::get().to(actor_messages),
        )
        .route("/debug/endpoints", web::get().to(endpoints))
        .route("/debug/startup", web::get().to(startup))
        .route("/debug/policy", web::get().to(policy))
        .route("/debug/identities", web::get().to(identities))
        .route("/debug/ipcache", web::get().to(ipcache))
        .route("/debug/nodes", web::get().to(debug_nodes))
        .route("/debug/flows", web::get().to(debug_flows))
        .route("/debug/changes", web::get().to(changes))
        .route("/debug/changes/{id}", web::get().to(change))
        .route("/debug/services", web::get().to(debug_services))
        .route("/debug/dns", web::get().to(debug_dns))
        .route("/debug/http", web::get().to(debug_http));
}

/// Limits of the debug server, which every local user can reach: it must never take the
/// agent's open files from the API socket and the CNI plugin.
#[derive(Debug, Clone, Copy)]
pub struct DebugLimits {
    /// Connections served at once; any beyond are closed as soon as they are accepted.
    pub max_connections: usize,
    /// How long a connection may sit idle, before its first request or between requests.
    pub idle_timeout: Duration,
}

/// One of the debug server's connection slots, given back when the connection ends.
struct ConnectionSlot {
    active: Arc<AtomicUsize>,
    metrics: Arc<crate::metrics::Metrics>,
}

impl ConnectionSlot {
    /// A slot if fewer than `max` are taken.
    fn take(
        active: &Arc<AtomicUsize>,
        max: usize,
        metrics: &Arc<crate::metrics::Metrics>,
    ) -> Option<ConnectionSlot> {
        active
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        metrics.debug_connections.inc();
        Some(ConnectionSlot {
            active: active.clone(),
            metrics: metrics.clone(),
        })
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.active.fetch_sub(1, Ordering::SeqCst);
        self.metrics.debug_connections.dec();
    }
}

/// The debug server on an already bound listener: the read-only routes behind a connection
/// cap. actix-web's own `max_connections` stops accepting at the cap, which leaves the excess
/// in the kernel's queue unseen; here each one is accepted, counted and closed at once.
pub fn debug_server(
    listener: std::net::TcpListener,
    data: web::Data<AppState>,
    limits: DebugLimits,
) -> std::io::Result<actix_server::Server> {
    use actix_service::{apply_fn_factory, map_config, Service};
    let addr = listener.local_addr()?;
    let active = Arc::new(AtomicUsize::new(0));
    let metrics = data.shared.metrics.clone();
    Ok(actix_server::Server::build()
        .workers(1)
        .disable_signals()
        .shutdown_timeout(1)
        .listen("debug", listener, move || {
            let app = actix_web::App::new()
                .app_data(data.clone())
                .configure(read_routes);
            let http = actix_http::HttpService::build()
                .keep_alive(actix_http::KeepAlive::Timeout(limits.idle_timeout))
                .client_request_timeout(limits.idle_timeout)
                .client_disconnect_timeout(Duration::from_secs(1))
                .local_addr(addr)
                .finish(map_config(app, |_| actix_web::dev::AppConfig::default()))
                .tcp();
            let (active, metrics) = (active.clone(), metrics.clone());
            apply_fn_factory(http, move |io: actix_rt::net::TcpStream, http| {
                let served: LocalBoxFuture<'static, _> =
                    match ConnectionSlot::take(&active, limits.max_connections, &metrics) {
                        Some(slot) => {
                            let conn = http.call(io);
                            Box::pin(async move {
                                let r = conn.await;
                                drop(slot);
                                r
                            })
                        }
                        None => {
                            metrics.debug_connections_refused.inc();
                            drop(io);
                            Box::pin(std::future::ready(Ok(())))
                        }
                    };
                served
            })
        })?
        .run())
}

/// The unix-socket API server on an already bound listener.
pub fn socket_server(
    listener: std::os::unix::net::UnixListener,
    data: web::Data<AppState>,
) -> std::io::Result<actix_server::Server> {
    Ok(actix_web::HttpServer::new(move || {
        actix_web::App::new()
            .app_data(data.clone())
            .configure(socket_routes)
    })
    .workers(1)
    .disable_signals()
    // `/v1/monitor` streams never end by themselves: do not let one hold up shutdown.
    .shutdown_timeout(1)
    .listen_uds(listener)?
    .run())
}

/// The REST API of the unix socket (read and write).
pub fn socket_routes(cfg: &mut web::ServiceConfig) {
    read_routes(cfg);
    cfg.route("/v1/status", web::get().to(status))
        .route("/v1/endpoints", web::get().to(endpoints))
        .route("/v1/endpoints", web::post().to(add_endpoint))
        .route("/v1/endpoints/by-container", web::get().to(find_endpoint))
        .route("/v1/endpoints/{id}", web::get().to(endpoint))
        .route("/v1/endpoints/{id}", web::delete().to(delete_endpoint))
        .route(
            "/v1/endpoints/{id}/config",
            web::patch().to(configure_endpoint),
        )
        .route("/v1/policy", web::get().to(policy))
        .route("/v1/identities", web::get().to(identities))
        .route("/v1/ipcache", web::get().to(ipcache))
        .route("/v1/nodes", web::get().to(nodes))
        .route("/v1/services", web::get().to(services))
        .route("/v1/fqdn/cache", web::get().to(fqdn_cache))
        .route("/v1/bpf/policy/{id}", web::get().to(bpf_policy))
        .route("/v1/bpf/ipcache", web::get().to(bpf_ipcache))
        .route("/v1/monitor", web::get().to(monitor))
        .route("/v1/flows/history", web::get().to(traffic::history))
        .service(
            // A proposal may hold many policies: up to 32 MiB of them.
            web::resource("/v1/policy/diff")
                .app_data(web::JsonConfig::default().limit(32 << 20))
                .route(web::post().to(traffic::policy_diff)),
        )
        .route(
            "/v1/policy/recommend",
            web::get().to(traffic::policy_recommend),
        )
        .route("/v1/cni/add", web::post().to(cni::add))
        .route("/v1/cni/del", web::post().to(cni::del))
        .route("/v1/cni/check", web::post().to(cni::check));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_slots_stop_at_the_cap_and_come_back_when_connections_end() {
        let active = Arc::new(AtomicUsize::new(0));
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let a = ConnectionSlot::take(&active, 2, &metrics).expect("first slot");
        let b = ConnectionSlot::take(&active, 2, &metrics).expect("second slot");
        assert!(ConnectionSlot::take(&active, 2, &metrics).is_none());
        assert_eq!(metrics.debug_connections.get(), 2);
        drop(a);
        let c = ConnectionSlot::take(&active, 2, &metrics).expect("a slot given back");
        drop((b, c));
        assert_eq!(active.load(Ordering::SeqCst), 0);
        assert_eq!(metrics.debug_connections.get(), 0);
    }
}
