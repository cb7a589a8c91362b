//! An in-memory Kubernetes API server over plain HTTP on loopback, for tests and local
//! development: the real kube-rs client and the real kubectl both talk to it.
//!
//! `store.rs` holds the objects, versions and history (no HTTP); `http.rs` maps the REST API
//! onto it; `resources.rs` describes the served types and discovery; `selector.rs` and
//! `patch.rs` are the label/field selector and patch formats.
//!
//! It speaks JSON only: protobuf bodies get 415 (so kubectl's `create namespace`-style
//! generators fail; use `kubectl apply -f`), and an Accept header that lists JSON after
//! protobuf gets JSON. It serves a schema-less OpenAPI v3 document that tells kubectl the
//! server validates fields itself, so `kubectl apply -f` works without `--validate=false`.
//! What it does not do: auth, admission, defaulting, schema validation, pagination (`limit`
//! and `continue` are ignored), deletecollection, JSON patch, server-side apply field
//! ownership (apply patches are merge patches), graceful deletion.

mod http;
pub mod patch;
pub mod resources;
pub mod selector;
pub mod store;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

pub use store::Store;

/// A request the API server refuses; each maps to a `kind: Status` reply with its reason and code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The object, resource or path does not exist (404 NotFound).
    #[error("{0}")]
    NotFound(String),
    /// An object with that name exists already (409 AlreadyExists).
    #[error("{0}")]
    AlreadyExists(String),
    /// The write carried a stale resourceVersion (409 Conflict).
    #[error("{0}")]
    Conflict(String),
    /// The request is malformed (400 BadRequest).
    #[error("{0}")]
    BadRequest(String),
    /// The object fails validation (422 Invalid).
    #[error("{0}")]
    Invalid(String),
    /// The path does not support the method (405 MethodNotAllowed).
    #[error("{0}")]
    MethodNotAllowed(String),
    /// The body's media type is not supported, e.g. protobuf (415 UnsupportedMediaType).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// No acceptable response media type (406 NotAcceptable).
    #[error("{0}")]
    NotAcceptable(String),
    /// The requested resourceVersion is older than the history (410 Expired).
    #[error("{0}")]
    Expired(String),
}

impl ApiError {
    /// The HTTP status code.
    pub fn code(&self) -> u16 {
        match self {
            ApiError::NotFound(_) => 404,
            ApiError::AlreadyExists(_) | ApiError::Conflict(_) => 409,
            ApiError::BadRequest(_) => 400,
            ApiError::Invalid(_) => 422,
            ApiError::MethodNotAllowed(_) => 405,
            ApiError::UnsupportedMediaType(_) => 415,
            ApiError::NotAcceptable(_) => 406,
            ApiError::Expired(_) => 410,
        }
    }

    /// The Status `reason`.
    pub fn reason(&self) -> &'static str {
        match self {
            ApiError::NotFound(_) => "NotFound",
            ApiError::AlreadyExists(_) => "AlreadyExists",
            ApiError::Conflict(_) => "Conflict",
            ApiError::BadRequest(_) => "BadRequest",
            ApiError::Invalid(_) => "Invalid",
            ApiError::MethodNotAllowed(_) => "MethodNotAllowed",
            ApiError::UnsupportedMediaType(_) => "UnsupportedMediaType",
            ApiError::NotAcceptable(_) => "NotAcceptable",
            ApiError::Expired(_) => "Expired",
        }
    }

    /// The `kind: Status` object the API server answers with.
    pub fn status(&self) -> Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.to_string(),
            "reason": self.reason(),
            "code": self.code(),
        })
    }
}

/// Why the server could not start or write its kubeconfig.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Binding the listening socket failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The bind error.
        source: std::io::Error,
    },
    /// The server thread ended before reporting its address.
    #[error("the API server thread ended while starting")]
    Thread,
    /// Writing the kubeconfig failed.
    #[error("cannot write kubeconfig {path}: {source}")]
    Kubeconfig {
        /// The kubeconfig path.
        path: String,
        /// The write error.
        source: std::io::Error,
    },
    /// Waiting for a termination signal failed.
    #[error("cannot wait for signals: {0}")]
    Signal(std::io::Error),
}

/// How the server behaves where tests may want it faster than a real one.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// How often a watch with `allowWatchBookmarks=true` gets a BOOKMARK.
    pub bookmark_interval: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            bookmark_interval: Duration::from_secs(2),
        }
    }
}

/// A running test API server; stops when dropped.
pub struct TestApiServer {
    store: Arc<Store>,
    addr: SocketAddr,
    handle: actix_web::dev::ServerHandle,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestApiServer {
    /// Starts a server on a free loopback port in a thread of its own.
    pub fn start() -> Result<Self, ServerError> {
        Self::start_with(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            ServerOptions::default(),
        )
    }

    /// Starts a server on `addr`.
    pub fn start_with(addr: SocketAddr, options: ServerOptions) -> Result<Self, ServerError> {
        let store = Arc::new(Store::new());
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = http::Shared {
            store: store.clone(),
            options,
        };
        let thread = std::thread::Builder::new()
            .name("test-apiserver".into())
            .spawn(move || {
                let system = actix_web::rt::System::new();
                system.block_on(async move {
                    match http::bind(addr, shared) {
                        Ok((server, bound)) => {
                            let _ = tx.send(Ok((server.handle(), bound)));
                            // The error, if any, is the server's own shutdown; nobody to tell.
                            let _ = server.await;
                        }
                        Err(source) => {
                            let _ = tx.send(Err(ServerError::Bind { addr, source }));
                        }
                    }
                });
            })
            .map_err(|_| ServerError::Thread)?;
        let (handle, addr) = rx.recv().map_err(|_| ServerError::Thread)??;
        Ok(Self {
            store,
            addr,
            handle,
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The object store, for in-process reads and writes.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Writes a kubeconfig (one cluster, user and context; no auth) for kubectl and kube-rs.
    pub fn kubeconfig(&self, path: &Path) -> Result<(), ServerError> {
        write_kubeconfig(&self.url(), path)
    }

    /// Bytes sent on watch streams so far, by resource (`plural.group`, core kinds `plural`):
    /// what the watching clients received.
    pub fn watch_bytes(&self) -> std::collections::BTreeMap<String, u64> {
        self.store.watch_bytes()
    }

    /// Ends every open watch stream; clients re-watch from their last resourceVersion.
    pub fn break_watches(&self) {
        self.store.break_watches();
    }

    /// Forgets the watch history: the next watch resumed from an earlier resourceVersion gets
    /// a 410 Expired event and its client must relist.
    pub fn compact(&self) {
        self.store.compact();
    }

    /// Creates or wholly replaces an object (status included), by its apiVersion and kind.
    pub fn apply_json(&self, object: Value) -> Result<Value, ApiError> {
        self.store.apply_whole(object)
    }

    /// Deletes an object by apiVersion, kind, namespace ("" when cluster-scoped) and name.
    pub fn delete_object(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Value, ApiError> {
        let rt = self.store.resolve_kind(api_version, kind)?;
        let deleted = self.store.delete(&rt, namespace, name)?;
        if rt.group.is_empty() && rt.kind == "Namespace" {
            // In process there is no need to wait: clear it at once.
            self.store.finalize_namespace(name);
        }
        Ok(deleted)
    }
}

impl Drop for TestApiServer {
    fn drop(&mut self) {
        self.store.break_watches();
        // stop() sends the command at once; its future only reports completion.
        drop(self.handle.stop(false));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Writes a kubeconfig pointing at `url` with no credentials.
pub fn write_kubeconfig(url: &str, path: &Path) -> Result<(), ServerError> {
    let text = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: ciliate-test
  cluster:
    server: {url}
contexts:
- name: ciliate-test
  context:
    cluster: ciliate-test
    user: ciliate-test
    namespace: default
current-context: ciliate-test
users:
- name: ciliate-test
  user: {{}}
preferences: {{}}
"
    );
    std::fs::write(path, text).map_err(|source| ServerError::Kubeconfig {
        path: path.display().to_string(),
        source,
    })
}

/// The `ciliate-test-apiserver` binary: serves on `listen` until SIGINT or SIGTERM.
pub fn run_until_signal(
    listen: SocketAddr,
    kubeconfig_out: Option<&Path>,
) -> Result<(), ServerError> {
    let server = TestApiServer::start_with(listen, ServerOptions::default())?;
    if let Some(path) = kubeconfig_out {
        server.kubeconfig(path)?;
    }
    eprintln!("test API server listening on {}", server.url());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ServerError::Signal)?;
    runtime.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).map_err(ServerError::Signal)?;
        let mut int = signal(SignalKind::interrupt()).map_err(ServerError::Signal)?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        Ok::<(), ServerError>(())
    })?;
    drop(server);
    Ok(())
}
