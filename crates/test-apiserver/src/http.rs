//! The REST API over the store: discovery, CRUD, patch, status subresources and watch streams.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use actix_web::http::{header, Method, StatusCode};
use actix_web::web::{self, Bytes};
use actix_web::{App, HttpRequest, HttpResponse, HttpServer};
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};

use super::resources::{self, ResourceType};
use super::selector::{FieldSelector, LabelSelector};
use super::store::{present, Filter, PatchKind, Store, StoredEvent, WatchStart, WriteScope};
use super::{ApiError, ServerOptions};

/// The Kubernetes version the server claims; kubectl's dispatcher picks its client by it.
const GIT_VERSION: &str = "v1.32.0";
/// How long a deleted namespace with content stays Terminating before its content goes.
const NAMESPACE_FINALIZE_DELAY: Duration = Duration::from_millis(500);
/// Largest request body (the real API server allows 3 MiB objects; manifests stay far below).
const MAX_BODY: usize = 8 << 20;

/// What every request handler shares.
pub(super) struct Shared {
    /// The objects.
    pub store: Arc<Store>,
    /// Timing knobs.
    pub options: ServerOptions,
}

/// Binds the server (one worker: requests are short, watches are async).
pub(super) fn bind(
    addr: SocketAddr,
    shared: Shared,
) -> std::io::Result<(actix_web::dev::Server, SocketAddr)> {
    let data = web::Data::new(shared);
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .app_data(web::PayloadConfig::new(MAX_BODY))
            .default_service(web::to(dispatch))
    })
    .workers(1)
    .disable_signals()
    .shutdown_timeout(1)
    .bind(addr)?;
    let bound = server.addrs().first().copied().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::AddrNotAvailable, "no address bound")
    })?;
    Ok((server.run(), bound))
}

fn json_reply(code: StatusCode, body: &Value) -> HttpResponse {
    HttpResponse::build(code)
        .content_type("application/json")
        .body(body.to_string())
}

fn error_reply(err: &ApiError) -> HttpResponse {
    let code = StatusCode::from_u16(err.code()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_reply(code, &err.status())
}

async fn dispatch(req: HttpRequest, body: Bytes, data: web::Data<Shared>) -> HttpResponse {
    match route(&req, &body, &data) {
        Ok(reply) => reply,
        Err(err) => {
            tracing::debug!(method = %req.method(), path = req.path(), %err, "request refused");
            error_reply(&err)
        }
    }
}

fn header_str(req: &HttpRequest, name: header::HeaderName) -> &str {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// Refuses protobuf bodies and Accept headers that allow nothing but protobuf: the server only
/// speaks JSON (kubectl lists JSON after protobuf, so it gets JSON).
fn check_media_types(req: &HttpRequest) -> Result<(), ApiError> {
    let content_type = header_str(req, header::CONTENT_TYPE);
    if content_type.contains("protobuf") {
        return Err(ApiError::UnsupportedMediaType(format!(
            "the body of type {content_type:?} is not supported; send JSON"
        )));
    }
    let accept = header_str(req, header::ACCEPT);
    if !accept.is_empty()
        && !accept
            .split(',')
            .any(|a| a.contains("json") || a.contains("*/*") || a.contains("yaml"))
    {
        return Err(ApiError::NotAcceptable(format!(
            "only application/json is served, not {accept:?}"
        )));
    }
    Ok(())
}

fn route(req: &HttpRequest, body: &Bytes, data: &Shared) -> Result<HttpResponse, ApiError> {
    let segments: Vec<&str> = req.path().split('/').filter(|s| !s.is_empty()).collect();
    let get = req.method() == Method::GET;
    let types = data.store.types();
    match segments.as_slice() {
        ["openapi", "v3"] if get => {
            return Ok(json_reply(StatusCode::OK, &resources::openapi_root(&types)))
        }
        ["openapi", "v3", gv @ ..] if get => {
            return resources::openapi_group_version(&types, &gv.join("/"))
                .map(|v| json_reply(StatusCode::OK, &v))
                .ok_or_else(|| {
                    ApiError::NotFound(format!("no OpenAPI document for {}", gv.join("/")))
                });
        }
        // No OpenAPI v2 (kubectl asks for it in protobuf); v3 above is enough for kubectl.
        ["openapi", ..] => return Err(ApiError::NotFound("OpenAPI v2 is not served".into())),
        _ => {}
    }
    check_media_types(req)?;
    let not_found = || {
        ApiError::NotFound(format!(
            "the server could not find the requested resource ({})",
            req.path()
        ))
    };
    match segments.as_slice() {
        ["version"] if get => Ok(json_reply(StatusCode::OK, &version())),
        ["healthz" | "readyz" | "livez"] if get => Ok(HttpResponse::Ok().body("ok")),
        ["api"] if get => {
            let host = req.connection_info().host().to_string();
            Ok(json_reply(StatusCode::OK, &resources::core_versions(&host)))
        }
        ["apis"] if get => Ok(json_reply(StatusCode::OK, &resources::group_list(&types))),
        ["api", "v1"] if get => resources::resource_list(&types, "", "v1")
            .map(|v| json_reply(StatusCode::OK, &v))
            .ok_or_else(not_found),
        ["apis", group] if get => resources::group(&types, group)
            .map(|v| json_reply(StatusCode::OK, &v))
            .ok_or_else(not_found),
        ["apis", group, version] if get => resources::resource_list(&types, group, version)
            .map(|v| json_reply(StatusCode::OK, &v))
            .ok_or_else(not_found),
        ["api", "v1", rest @ ..] => resource(req, body, data, "", "v1", rest),
        ["apis", group, version, rest @ ..] => resource(req, body, data, group, version, rest),
        _ => Err(not_found()),
    }
}

fn version() -> Value {
    json!({
        "major": "1",
        "minor": "32",
        "gitVersion": GIT_VERSION,
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-01-01T00:00:00Z",
        "goVersion": "go1.23.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

fn parse_body(req: &HttpRequest, body: &Bytes) -> Result<Value, ApiError> {
    let content_type = header_str(req, header::CONTENT_TYPE);
    let parsed = if content_type.contains("yaml") {
        serde_yaml::from_slice::<Value>(body).map_err(|e| e.to_string())
    } else {
        serde_json::from_slice::<Value>(body).map_err(|e| e.to_string())
    };
    parsed.map_err(|e| ApiError::BadRequest(format!("the request body is not valid: {e}")))
}

fn filter_from(
    query: &HashMap<String, String>,
    namespace: Option<&str>,
) -> Result<Filter, ApiError> {
    Ok(Filter {
        namespace: namespace.map(String::from),
        labels: match query.get("labelSelector") {
            Some(s) => LabelSelector::parse(s)?,
            None => LabelSelector::default(),
        },
        fields: match query.get("fieldSelector") {
            Some(s) => FieldSelector::parse(s)?,
            None => FieldSelector::default(),
        },
    })
}

/// A request under `/api/v1` or `/apis/{group}/{version}`.
fn resource(
    req: &HttpRequest,
    body: &Bytes,
    data: &Shared,
    group: &str,
    version: &str,
    rest: &[&str],
) -> Result<HttpResponse, ApiError> {
    // `namespaces/{ns}/status` is the namespace's own status, not a resource named "status".
    let (namespace, rest) = match rest {
        ["namespaces", ns, tail @ ..]
            if !tail.is_empty() && tail[0] != "status" && tail[0] != "finalize" =>
        {
            (Some(*ns), tail)
        }
        _ => (None, rest),
    };
    let (plural, name, subresource) = match rest {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some(*name), None),
        [plural, name, sub] => (*plural, Some(*name), Some(*sub)),
        _ => {
            return Err(ApiError::NotFound(format!(
                "the server could not find the requested resource ({})",
                req.path()
            )))
        }
    };
    let store = &data.store;
    let rt = store.resolve(group, version, plural)?;
    let method = req.method();
    let cluster_wide_list = namespace.is_none() && name.is_none() && *method == Method::GET;
    if rt.namespaced != namespace.is_some() && !cluster_wide_list {
        return Err(ApiError::NotFound(format!(
            "the server could not find the requested resource ({} is {})",
            rt.qualified_name(),
            if rt.namespaced {
                "namespaced"
            } else {
                "cluster-scoped"
            }
        )));
    }
    let ns = namespace.unwrap_or("");
    let scope = match subresource {
        None => WriteScope::Main,
        Some("status") if rt.status => WriteScope::Status,
        Some(other) => {
            return Err(ApiError::NotFound(format!(
                "the server could not find the requested resource ({}/{other})",
                rt.qualified_name()
            )))
        }
    };
    let query = web::Query::<HashMap<String, String>>::from_query(req.query_string())
        .map_err(|e| ApiError::BadRequest(format!("the query string is not valid: {e}")))?
        .into_inner();
    match (method.clone(), name) {
        (Method::GET, None) => {
            let filter = filter_from(&query, namespace)?;
            let watching = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
            if watching {
                return watch(data, rt, filter, &query);
            }
            // Paged as the API server pages (`limit`, `continue`): every page carries the
            // resourceVersion of the first, so a watch from it misses nothing changed meanwhile.
            let limit =
                match query.get("limit") {
                    Some(l) => Some(l.parse::<usize>().map_err(|_| {
                        ApiError::BadRequest(format!("limit {l:?} is not a number"))
                    })?),
                    None => None,
                };
            let from = match query.get("continue").filter(|c| !c.is_empty()) {
                Some(token) => Some(parse_continue(token)?),
                None => None,
            };
            let after = from.as_ref().map(|(_, key)| key);
            let (items, now, last) = store.list_page(&rt, &filter, after, limit);
            let rv = from.as_ref().map_or(now, |(rv, _)| *rv);
            let mut metadata = json!({"resourceVersion": rv.to_string()});
            if let Some((ns, name)) = last {
                metadata["continue"] = json!(format!("{rv}.{}.{}", hex(&ns), hex(&name)));
            }
            Ok(json_reply(
                StatusCode::OK,
                &json!({
                    "kind": format!("{}List", rt.kind),
                    "apiVersion": rt.api_version(),
                    "metadata": metadata,
                    "items": items,
                }),
            ))
        }
        (Method::POST, None) => {
            let created = store.create(&rt, ns, parse_body(req, body)?)?;
            Ok(json_reply(StatusCode::CREATED, &created))
        }
        (Method::GET, Some(name)) => Ok(json_reply(StatusCode::OK, &store.get(&rt, ns, name)?)),
        (Method::PUT, Some(name)) => {
            let updated = store.update(&rt, ns, name, parse_body(req, body)?, scope)?;
            Ok(json_reply(StatusCode::OK, &updated))
        }
        (Method::PATCH, Some(name)) => {
            let content_type = header_str(req, header::CONTENT_TYPE);
            let kind = match content_type.split(';').next().unwrap_or("").trim() {
                "application/merge-patch+json" => PatchKind::Merge,
                "application/strategic-merge-patch+json" => PatchKind::Strategic,
                "application/apply-patch+yaml" => PatchKind::Apply,
                other => {
                    return Err(ApiError::UnsupportedMediaType(format!(
                    "the patch type {other:?} is not supported; use application/merge-patch+json, \
                         application/strategic-merge-patch+json or application/apply-patch+yaml"
                )))
                }
            };
            let patched = store.patch(&rt, ns, name, kind, &parse_body(req, body)?, scope)?;
            Ok(json_reply(StatusCode::OK, &patched))
        }
        (Method::DELETE, Some(name)) if scope == WriteScope::Main => {
            let deleted = store.delete(&rt, ns, name)?;
            if deleted.pointer("/metadata/deletionTimestamp").is_some() && rt.kind == "Namespace" {
                // The namespace controller's part: clear the namespace a moment later.
                let store = store.clone();
                let name = name.to_string();
                actix_web::rt::spawn(async move {
                    tokio::time::sleep(NAMESPACE_FINALIZE_DELAY).await;
                    store.finalize_namespace(&name);
                });
            }
            Ok(json_reply(StatusCode::OK, &deleted))
        }
        (method, _) => Err(ApiError::MethodNotAllowed(format!(
            "the server does not allow this method on the requested resource ({method} {})",
            req.path()
        ))),
    }
}

/// Opens a watch stream: JSON lines, chunked, until the client leaves, `timeoutSeconds`
/// passes or `break_watches` is called.
fn watch(
    data: &Shared,
    rt: ResourceType,
    filter: Filter,
    query: &HashMap<String, String>,
) -> Result<HttpResponse, ApiError> {
    let from =
        match query.get("resourceVersion").map(String::as_str) {
            None | Some("") | Some("0") => None,
            Some(v) => Some(v.parse::<u64>().map_err(|_| {
                ApiError::BadRequest(format!("resourceVersion {v:?} is not a number"))
            })?),
        };
    let timeout = match query.get("timeoutSeconds") {
        Some(t) => Some(Duration::from_secs(t.parse::<u64>().map_err(|_| {
            ApiError::BadRequest(format!("timeoutSeconds {t:?} is not a number"))
        })?)),
        None => None,
    };
    let bookmarks = query.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let feed = Feed {
        store: data.store.clone(),
        start: data.store.watch(&rt, &filter, from),
        breaker: data.store.watch_breaker(),
        rt,
        filter,
        bookmarks: bookmarks.then_some(data.options.bookmark_interval),
        timeout,
    };
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let (store, resource) = (data.store.clone(), feed.rt.qualified_name());
    actix_web::rt::spawn(feed.run(tx));
    let stream = futures_util::stream::unfold(rx, move |mut rx| {
        let (store, resource) = (store.clone(), resource.clone());
        async move {
            let b = rx.recv().await?;
            store.note_watch_bytes(&resource, b.len());
            Some((Ok::<_, actix_web::Error>(b), rx))
        }
    });
    Ok(HttpResponse::Ok()
        .content_type("application/json")
        .streaming(stream))
}

/// The producer side of one watch stream.
struct Feed {
    store: Arc<Store>,
    start: Result<WatchStart, ApiError>,
    breaker: tokio::sync::watch::Receiver<u64>,
    rt: ResourceType,
    filter: Filter,
    bookmarks: Option<Duration>,
    timeout: Option<Duration>,
}

/// One watch event's line, `type` before `object` as kube-apiserver writes it (the field
/// order of Go's `metav1.WatchEvent`). The order matters to clients: kube-rs reads
/// `WatchEvent<K>` as an adjacently tagged enum, which reads the object straight into `K` when
/// the tag comes first and otherwise buffers the whole object in serde's generic `Content`
/// tree before reading it again (`json!` writes keys sorted, `object` first: that cost the
/// agent a sixth of its CPU under pod churn in `cargo bench --bench k8s`, a cost no real API
/// server makes it pay).
fn line(kind: &str, object: &Value) -> Bytes {
    let mut text = Vec::with_capacity(256);
    text.extend_from_slice(b"{\"type\":");
    serde_json::to_writer(&mut text, kind).expect("a string serializes");
    text.extend_from_slice(b",\"object\":");
    serde_json::to_writer(&mut text, object).expect("a JSON value serializes");
    text.extend_from_slice(b"}\n");
    Bytes::from(text)
}

impl Feed {
    /// The line for an event this watch sees, if it sees it.
    fn event_line(&self, event: &StoredEvent) -> Option<Bytes> {
        if event.key != self.rt.storage_key() {
            return None;
        }
        let kind = self.filter.view(event)?;
        Some(line(kind.as_str(), &present(&self.rt, &event.object)))
    }

    fn expired(&self, message: String) -> Bytes {
        line("ERROR", &ApiError::Expired(message).status())
    }

    async fn run(mut self, tx: mpsc::Sender<Bytes>) {
        let start = std::mem::replace(&mut self.start, Err(ApiError::Expired(String::new())));
        let mut start = match start {
            Ok(s) => s,
            Err(err) => {
                // Failures after the watch began are in-stream ERROR events in a 200 reply:
                // that is what clients (kube-runtime's watcher) relist on.
                let _ = tx.send(line("ERROR", &err.status())).await;
                return;
            }
        };
        for event in &start.backlog {
            if let Some(l) = self.event_line(event) {
                if tx.send(l).await.is_err() {
                    return;
                }
            }
        }
        let far = Duration::from_secs(10 * 365 * 24 * 3600);
        let deadline = tokio::time::sleep(self.timeout.unwrap_or(far));
        tokio::pin!(deadline);
        let period = self.bookmarks.unwrap_or(far);
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        loop {
            let out = tokio::select! {
                received = start.live.recv() => match received {
                    Ok(event) => self.event_line(&event),
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        let _ = tx.send(self.expired(format!("the watch fell {n} events behind; relist"))).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = ticks.tick(), if self.bookmarks.is_some() => {
                    // Deliver every change up to the bookmark's version before announcing it,
                    // or a client resuming from the bookmark would miss them.
                    let rv = self.store.current_rv();
                    loop {
                        match start.live.try_recv() {
                            Ok(event) => {
                                if let Some(l) = self.event_line(&event) {
                                    if tx.send(l).await.is_err() {
                                        return;
                                    }
                                }
                            }
                            Err(broadcast::error::TryRecvError::Empty) => break,
                            Err(broadcast::error::TryRecvError::Lagged(n)) => {
                                let _ = tx.send(self.expired(format!("the watch fell {n} events behind; relist"))).await;
                                return;
                            }
                            Err(broadcast::error::TryRecvError::Closed) => return,
                        }
                    }
                    Some(line("BOOKMARK", &json!({
                        "kind": self.rt.kind,
                        "apiVersion": self.rt.api_version(),
                        "metadata": {"resourceVersion": rv.to_string()},
                    })))
                }
                _ = self.breaker.changed() => return,
                _ = &mut deadline => return,
                _ = tx.closed() => return,
            };
            if let Some(l) = out {
                if tx.send(l).await.is_err() {
                    return;
                }
            }
        }
    }
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<String> {
    let bytes: Option<Vec<u8>> = (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect();
    String::from_utf8(bytes?).ok()
}

/// A `continue` token of this server: the first page's resourceVersion and the last key given.
fn parse_continue(token: &str) -> Result<(u64, (String, String)), ApiError> {
    let bad = || ApiError::BadRequest(format!("continue token {token:?} is not valid"));
    let mut parts = token.splitn(3, '.');
    let rv = parts.next().and_then(|r| r.parse().ok()).ok_or_else(bad)?;
    let ns = parts.next().and_then(unhex).ok_or_else(bad)?;
    let name = parts.next().and_then(unhex).ok_or_else(bad)?;
    Ok((rv, (ns, name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_line_names_its_type_before_its_object_as_kube_apiserver_does() {
        let object = json!({"metadata": {"name": "a \"quoted\" name"}, "apiVersion": "v1"});
        let text = String::from_utf8(line("MODIFIED", &object).to_vec()).unwrap();
        assert!(
            text.starts_with(r#"{"type":"MODIFIED","object":{"#),
            "{text}"
        );
        assert!(text.ends_with("}\n"), "{text}");
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, json!({"type": "MODIFIED", "object": object}));
    }
}
