//! `WatcherActor` in standalone mode: the manifest directory plays the API server.
//!
//! The directory is read on a thread of its own (the *scanner*), never on the actors' thread or
//! the API's: a file that blocks, a huge directory or a slow disk cannot hold up endpoints, CNI or
//! the API. The scanner ([`crate::manifests::Scanner`]) reads only what changed, merges documents
//! across files (the last file in sort order wins; see `manifests::merge`) and hands each delta to
//! the [`Feed`], which converts objects and sends typed messages to `PolicyRepoActor`.
//!
//! The actor itself watches the directory (inotify through `notify`, debounced), schedules
//! rescans (also periodically, as a backstop for missed events) and records what each scan did.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{Actor, AsyncContext, Context, Handler, Message};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use notify::{Config, Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use serde_yaml::Value;

use super::feed::{refused_part, Item, Origin, ToRepo, WatchFeed};
use super::policy_repo::{ManifestStatus, PolicyRepoActor};
use crate::introspect::{with_change, ChangeId, ChangeScope, Journal, Registry, TracedAddr};
use crate::manifests::{Body, Delta, Limits, ObjKey, ScanStats, Scanner};
use crate::objects::{
    endpoint_slice_info, namespace_info, node_info, pod_info, service_info, Kind,
};
use crate::services::ServiceLb;
use crate::traced_actor;

const NAME: &str = "WatcherActor";

/// Edits within this window share one rescan (editors write files in several steps).
const DEBOUNCE: Duration = Duration::from_millis(150);
/// A rescan backs the file watch up (missed events, targets of links outside the directory). It
/// costs a `stat` per file unless something changed.
const PERIODIC: Duration = Duration::from_secs(10);
/// Duplicates named in the log per scan.
const DUPLICATES_LOGGED: usize = 10;

pub struct WatcherActor {
    dir: PathBuf,
    limits: Limits,
    repo: TracedAddr<PolicyRepoActor>,
    watcher: Option<RecommendedWatcher>,
    me: Option<TracedAddr<WatcherActor>>,
    /// Asks the scanner for a scan; one queued request stands for any number.
    scans: Option<SyncSender<()>>,
    /// A rescan is scheduled (changes within `DEBOUNCE` share it).
    rescan_scheduled: bool,
    /// Where Service and EndpointSlice changes go for service translation.
    services: Option<Arc<ServiceLb>>,
    /// Where each scan that changes objects begins a change (`/debug/changes`).
    changes: Option<Arc<Registry>>,
}

impl WatcherActor {
    pub fn new(dir: PathBuf, limits: Limits, repo: TracedAddr<PolicyRepoActor>) -> Self {
        WatcherActor {
            dir,
            limits,
            repo,
            watcher: None,
            me: None,
            scans: None,
            rescan_scheduled: false,
            services: None,
            changes: None,
        }
    }

    /// Gives Service and EndpointSlice changes to service translation too.
    pub fn with_services(mut self, services: Arc<ServiceLb>) -> Self {
        self.services = Some(services);
        self
    }

    /// Begins a change (`/debug/changes`) for every scan that changes objects.
    pub fn with_changes(mut self, registry: Arc<Registry>) -> Self {
        self.changes = Some(registry);
        self
    }

    /// Gives the actor its own traced address (for the file-watch and scanner threads).
    pub fn with_self(mut self, me: TracedAddr<WatcherActor>) -> Self {
        self.me = Some(me);
        self
    }

    fn request_scan(&self) {
        if let Some(scans) = &self.scans {
            match scans.try_send(()) {
                // Full: a scan is queued already and will see this change too.
                Ok(()) | Err(TrySendError::Full(())) => {}
                Err(TrySendError::Disconnected(())) => {
                    tracing::error!("the manifest scanner has stopped; edits are not applied")
                }
            }
        }
    }

    fn watch(&mut self, me: TracedAddr<WatcherActor>) {
        let handler = move |res: notify::Result<Event>| match res {
            Ok(ev) if matches!(ev.kind, EventKind::Access(_)) => {}
            Ok(_) => me.do_send(FilesChanged, "inotify"),
            Err(e) => {
                tracing::warn!(error = %e, "file watch error; rescanning");
                me.do_send(FilesChanged, "inotify");
            }
        };
        // Links are not followed by the watch (a link loop must not make it recurse); the
        // periodic rescan covers edits behind links.
        let config = Config::default().with_follow_symlinks(false);
        match RecommendedWatcher::new(handler, config) {
            Ok(mut w) => match w.watch(&self.dir, RecursiveMode::Recursive) {
                Ok(()) => self.watcher = Some(w),
                Err(e) => {
                    tracing::error!(dir = %self.dir.display(), error = %e, "cannot watch the manifest directory; edits apply at the periodic rescan")
                }
            },
            Err(e) => tracing::error!(error = %e, "cannot start the file watcher"),
        }
    }
}

impl Actor for WatcherActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let Some(me) = self.me.clone() else {
            tracing::error!("WatcherActor started without its own address; no manifests read");
            return;
        };
        // Watch first, then read: a change in between is seen by the watch.
        self.watch(me.clone());
        let (scans, requests) = sync_channel(1);
        self.scans = Some(scans);
        let scanner = Scanner::new(self.dir.clone(), self.limits);
        let mut feed = Feed::new(
            self.repo.clone(),
            self.services.clone(),
            self.changes.clone(),
        );
        feed.journal = Some(me.journal.clone());
        let spawned = std::thread::Builder::new()
            .name("manifest-scan".into())
            .spawn(move || run_scanner(scanner, feed, requests, me));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the manifest scanner");
            self.scans = None;
            return;
        }
        if let Some(me) = self.me.clone() {
            ctx.run_interval(PERIODIC, move |_, _| {
                me.do_send(Rescan { reason: "periodic" }, NAME)
            });
        }
    }
}
traced_actor!(WatcherActor: Rescan, FilesChanged, ScanDone);

/// The scanner thread: a scan at start (then `InitialSyncDone`), and one per request. It ends
/// when the actor goes away.
fn run_scanner(
    mut scanner: Scanner,
    mut feed: Feed,
    requests: Receiver<()>,
    watcher: TracedAddr<WatcherActor>,
) {
    let mut first = true;
    loop {
        let started = Instant::now();
        let outcome = scanner.scan().map(|(delta, stats)| {
            let sent = feed.apply(delta);
            (stats, sent)
        });
        if first {
            match &outcome {
                Ok((stats, sent)) => tracing::info!(
                    dir = %scanner.root().display(),
                    files = stats.files,
                    objects = stats.objects,
                    events = sent,
                    "manifests loaded"
                ),
                Err(e) => tracing::error!(error = %e, "initial manifest scan failed"),
            }
            let out = feed.feed.synced();
            let n = ToRepo::objects(&out);
            let begun = feed.begin(format!(
                "initial sync: {n} objects from the manifest directory"
            ));
            with_change(begun.as_ref().map(|b| b.0), || feed.send(out));
            feed.done(begun);
            first = false;
        }
        watcher.do_send(
            ScanDone {
                outcome,
                took: started.elapsed(),
            },
            "scanner",
        );
        if requests.recv().is_err() {
            return;
        }
    }
}

/// Turns deltas into objects for the [`WatchFeed`], and reports what cannot be read by file.
struct Feed {
    repo: TracedAddr<PolicyRepoActor>,
    /// Dedupe, order, Services and policy translation (shared with the Kubernetes watcher).
    feed: WatchFeed,
    /// Objects whose last upsert could not be used (in whole or in part), with the location it
    /// was reported under.
    unusable: HashMap<ObjKey, String>,
    changes: Option<Arc<Registry>>,
    /// The watcher's journal: each change's feed work is noted there, the change's first step.
    journal: Option<Arc<Journal>>,
}

impl Feed {
    fn new(
        repo: TracedAddr<PolicyRepoActor>,
        lb: Option<Arc<ServiceLb>>,
        changes: Option<Arc<Registry>>,
    ) -> Feed {
        Feed {
            repo,
            feed: WatchFeed::new(lb),
            unusable: HashMap::new(),
            changes,
            journal: None,
        }
    }

    /// Begins a change caused by `cause`; `done` notes the feed's part of it in the watcher's
    /// journal (the change's first step).
    fn begin(&self, cause: String) -> Option<(ChangeId, String, chrono::DateTime<chrono::Utc>)> {
        let id = self.changes.as_ref()?.begin_change(cause.clone());
        Some((id, cause, chrono::Utc::now()))
    }

    fn done(&self, begun: Option<(ChangeId, String, chrono::DateTime<chrono::Utc>)>) {
        if let (Some((id, cause, at)), Some(j)) = (begun, &self.journal) {
            with_change(Some(id), || j.note("Feed", cause, "scanner", at, Ok(())));
        }
    }

    fn send(&self, out: Vec<ToRepo>) {
        for m in out {
            m.send(&self.repo, NAME);
        }
    }

    /// Sends a delta; returns how many objects it changed.
    fn apply(&mut self, delta: Delta<Body>) -> usize {
        for (file, error) in delta.status {
            match &error {
                Some(e) => {
                    tracing::warn!(file = %file, error = %e, "manifest not loaded; its previous objects stay in force")
                }
                None => tracing::info!(file = %file, "manifest loaded again"),
            }
            self.repo.do_send(
                ManifestStatus {
                    file: file.to_string(),
                    error,
                },
                NAME,
            );
        }
        // A file of thousands of duplicates must not flood the log: the first few are named.
        for d in delta.duplicates.iter().take(DUPLICATES_LOGGED) {
            tracing::warn!(object = %d.key, winner = %d.winner, shadowed = ?d.shadowed, "object defined more than once; the last file in sort order wins");
        }
        if delta.duplicates.len() > DUPLICATES_LOGGED {
            tracing::warn!(
                more = delta.duplicates.len() - DUPLICATES_LOGGED,
                "more objects defined more than once"
            );
        }
        let sent = delta.deletes.len() + delta.upserts.len();
        let files: Vec<String> = delta
            .upserts
            .iter()
            .map(|u| u.location.to_string())
            .take(3)
            .collect();
        // The whole delta is one change: a file edit.
        let begun = (sent > 0 && self.feed.is_synced())
            .then(|| {
                self.begin(format!(
                    "manifests: {sent} objects changed ({})",
                    files.join(", ")
                ))
            })
            .flatten();
        let scope = ChangeScope::enter(begun.as_ref().map(|b| b.0));
        for k in &delta.deletes {
            self.usable(k);
            if let Some(kind) = Kind::parse(&k.kind) {
                let out = self.feed.delete(kind, &object_key(k));
                self.send(out);
            }
        }
        for u in delta.upserts {
            match convert(&u.key, &u.body) {
                Ok(item) => {
                    // Part of it refused (logged by the feed): the status says so until fixed.
                    match refused_part(&object_key(&u.key), &item) {
                        Some(refused) => self.report(&u.key, &u.location, refused),
                        None => self.usable(&u.key),
                    }
                    let out =
                        self.feed
                            .upsert(&object_key(&u.key), item, Origin::file(&u.location));
                    self.send(out);
                }
                Err(e) => self.unusable(&u.key, &u.location, e),
            }
        }
        drop(scope);
        self.done(begun);
        sent
    }

    fn unusable(&mut self, k: &ObjKey, location: &str, error: String) {
        tracing::warn!(%location, error = %error, "object not usable");
        self.report(k, location, error);
    }

    /// Shows `error` for the object in the manifest status until it is usable again.
    fn report(&mut self, k: &ObjKey, location: &str, error: String) {
        if let Some(old) = self.unusable.insert(k.clone(), location.to_string()) {
            self.clear_status(old);
        }
        self.repo.do_send(
            ManifestStatus {
                file: location.to_string(),
                error: Some(error),
            },
            NAME,
        );
    }

    fn usable(&mut self, k: &ObjKey) {
        if let Some(old) = self.unusable.remove(k) {
            self.clear_status(old);
        }
    }

    fn clear_status(&self, location: String) {
        self.repo.do_send(
            ManifestStatus {
                file: location,
                error: None,
            },
            NAME,
        );
    }
}

/// `namespace/name`, or `name` for cluster-scoped objects (as the feed names objects).
fn object_key(k: &ObjKey) -> String {
    if k.namespace.is_empty() {
        k.name.clone()
    } else {
        format!("{}/{}", k.namespace, k.name)
    }
}

/// Reads a document into what the agent uses. Policies are validated by the feed (a rejected
/// policy is the repository's to record); anything else that does not read is unusable.
fn convert(k: &ObjKey, body: &Body) -> Result<Item, String> {
    let value: Value = serde_yaml::from_str(body).map_err(|e| e.to_string())?;
    let ns = &k.namespace;
    fn read<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, String> {
        serde_yaml::from_value(v).map_err(|e| e.to_string())
    }
    match Kind::parse(&k.kind) {
        Some(Kind::Namespace) => namespace_info(&read::<Namespace>(value)?).map(Item::Namespace),
        Some(Kind::Node) => node_info(&read::<Node>(value)?).map(Item::Node),
        Some(Kind::Service) => service_info(&read::<Service>(value)?, ns).map(Item::Service),
        Some(Kind::EndpointSlice) => {
            endpoint_slice_info(&read::<EndpointSlice>(value)?).map(Item::EndpointSlice)
        }
        Some(Kind::Pod) => pod_info(&read::<Pod>(value)?, ns).map(Item::Pod),
        Some(policy) => Ok(Item::Policy(policy, value)),
        None => Err(format!("kind {} is not watched", k.kind)),
    }
}

/// Re-read the manifest directory (queued on the scanner).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Rescan {
    pub reason: &'static str,
}

crate::traceable!(Rescan, "Rescan", |m| m.reason.to_string());

impl Handler<Rescan> for WatcherActor {
    type Result = ();
    fn handle(&mut self, _: Rescan, _: &mut Context<Self>) {
        self.request_scan();
    }
}

/// Something in the manifest directory changed: rescan after `DEBOUNCE`.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct FilesChanged;

crate::traceable!(FilesChanged, "FilesChanged", |_m| String::new());

impl Handler<FilesChanged> for WatcherActor {
    type Result = ();
    fn handle(&mut self, _: FilesChanged, ctx: &mut Context<Self>) {
        if self.rescan_scheduled {
            return;
        }
        self.rescan_scheduled = true;
        ctx.run_later(DEBOUNCE, |act, _| {
            act.rescan_scheduled = false;
            act.request_scan();
        });
    }
}

/// The scanner finished a scan (its deltas are sent already).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct ScanDone {
    pub outcome: Result<(ScanStats, usize), String>,
    pub took: Duration,
}

crate::traceable!(ScanDone, "ScanDone", |m| {
    match &m.outcome {
        Ok((s, sent)) => format!(
            "{} files ({} read, {} refused), {} objects, {sent} changes, {:?}",
            s.files, s.read, s.refused, s.objects, m.took
        ),
        Err(e) => format!("failed: {e}"),
    }
});

impl Handler<ScanDone> for WatcherActor {
    type Result = ();
    fn handle(&mut self, msg: ScanDone, _: &mut Context<Self>) {
        if let Err(e) = msg.outcome {
            tracing::warn!(dir = %self.dir.display(), error = %e, "manifest directory not read; everything stays as it was");
        }
    }
}
