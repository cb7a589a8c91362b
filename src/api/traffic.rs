//! Traffic analysis on the unix socket (interfaces section 16): the flow history, and `policy
//! diff` / `policy recommend` run by the agent against it (the same functions the CLI runs on a
//! `--flows FILE`). The history is copied out of its lock before any replay, so the recorder
//! never waits on one; the replay runs on a blocking thread.

use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse};
use serde::Deserialize;

use super::{error, AppState};
use crate::traffic::diff::{self, since_secs};
use crate::traffic::history::FlowHistory;
use crate::traffic::recommend::{self, Kind};

fn now() -> u64 {
    crate::datapath::flows::unix_now_ms() / 1000
}

#[derive(Deserialize)]
pub struct HistoryQuery {
    since: Option<String>,
    /// At most this many, the most recently seen first (default 10,000).
    limit: Option<usize>,
}

/// `GET /v1/flows/history?since=DUR&limit=N`: the connections, as JSON, the most recently
/// seen first.
pub async fn history(st: web::Data<AppState>, q: web::Query<HistoryQuery>) -> HttpResponse {
    let since = match since_secs(q.since.as_deref(), now()) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let limit = q.limit.unwrap_or(10_000);
    let recent = |v: &crate::traffic::history::View| std::cmp::Reverse(v.last);
    let conns: Vec<crate::traffic::Connection> = {
        let h = st.shared.flow_history.lock();
        let mut views: Vec<_> = h.iter_since(since).collect();
        if views.len() > limit {
            views.select_nth_unstable_by_key(limit, recent);
            views.truncate(limit);
        }
        views.sort_by_key(recent);
        views.iter().map(|v| v.to_connection()).collect()
    };
    HttpResponse::Ok().json(conns)
}

/// `POST /v1/policy/diff`'s body.
#[derive(Deserialize)]
pub struct DiffRequest {
    /// Policy documents, each with where it came from (`file.yaml[0]`).
    #[serde(default)]
    documents: Vec<(String, serde_json::Value)>,
    #[serde(default)]
    delete: Vec<String>,
    since: Option<String>,
    /// Connections to replay instead of this agent's history (the cluster's, from a relay).
    connections: Option<Vec<crate::traffic::Connection>>,
}

/// `POST /v1/policy/diff`: the observed connections the proposal would flip.
pub async fn policy_diff(st: web::Data<AppState>, body: web::Json<DiffRequest>) -> HttpResponse {
    let body = body.into_inner();
    let shared = st.shared.clone();
    let run = move || -> Result<diff::DiffReport, String> {
        let since = since_secs(body.since.as_deref(), now())?;
        let docs = body
            .documents
            .into_iter()
            .map(|(at, v)| {
                serde_yaml::to_value(v)
                    .map(|y| (at.clone(), y))
                    .map_err(|e| format!("{at}: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let proposal = diff::proposal(&docs, &body.delete)?;
        let in_force = {
            let e = shared
                .engine
                .read()
                .map_err(|_| "the policy engine is unusable")?;
            crate::traffic::replay::policies_of(&e)
        };
        let history = match body.connections {
            None => shared.flow_history.lock().clone(),
            Some(conns) => given(&conns)?,
        };
        diff::diff(&history, since, in_force, &proposal)
    };
    match web::block(run).await {
        Ok(Ok(r)) => HttpResponse::Ok().json(r),
        Ok(Err(e)) => error(StatusCode::BAD_REQUEST, e),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// A history of the connections a request gives (at most the agent's own bound of them).
fn given(conns: &[crate::traffic::Connection]) -> Result<FlowHistory, String> {
    if conns.len() > GIVEN_MAX {
        return Err(format!(
            "{} connections given: at most {GIVEN_MAX}",
            conns.len()
        ));
    }
    let mut h = FlowHistory::new(u64::MAX, GIVEN_MAX);
    for (i, c) in conns.iter().enumerate() {
        h.merge(c).map_err(|e| format!("connections[{i}]: {e}"))?;
    }
    Ok(h)
}

const GIVEN_MAX: usize = 10_000_000;

#[derive(Deserialize)]
pub struct RecommendQuery {
    namespace: String,
    since: Option<String>,
    kind: Option<String>,
}

/// `GET /v1/policy/recommend?namespace=NS&since=DUR&kind=KIND`: YAML.
pub async fn policy_recommend(
    st: web::Data<AppState>,
    q: web::Query<RecommendQuery>,
) -> HttpResponse {
    let q = q.into_inner();
    let kind = match q.kind.as_deref() {
        None | Some("CiliumNetworkPolicy") => Kind::CiliumNetworkPolicy,
        Some("NetworkPolicy") => Kind::NetworkPolicy,
        Some(k) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("kind {k:?}: CiliumNetworkPolicy or NetworkPolicy"),
            )
        }
    };
    let since = match since_secs(q.since.as_deref(), now()) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let history = st.shared.flow_history.lock().clone();
    match web::block(move || recommend::recommend(&history, since, &q.namespace, kind)).await {
        Ok(yaml) => HttpResponse::Ok()
            .content_type("application/yaml")
            .body(yaml),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}
