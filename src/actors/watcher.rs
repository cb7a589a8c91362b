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

use super::policy_repo::{
    InitialSyncDone, ManifestStatus, NamespaceDelete, NamespaceUpsert, NodeDelete, NodeUpsert,
    PodDelete, PodUpsert, PolicyDelete, PolicyRejected, PolicyRepoActor, PolicyUpsert,
};
use super::services_feed::ServicesFeed;
use crate::introspect::{Traceable, TracedAddr};
use crate::manifests::{Body, Delta, Limits, ObjKey, ScanStats, Scanner, DEFAULT_NAMESPACE};
use crate::objects::{
    endpoint_slice_info, namespace_info, node_info, pod_info, service_info, ServiceInfo,
};
use crate::policy::rule::PolicyKey;
use crate::policy::translate::parse_policy_with_services;
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
        }
    }

    /// Gives Service and EndpointSlice changes to service translation too.
    pub fn with_services(mut self, services: Arc<ServiceLb>) -> Self {
        self.services = Some(services);
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
        let lb = self.services.clone();
        let mut feed = Feed::new(self.repo.clone());
        if let Some(lb) = &lb {
            feed.services.set_lb(lb.clone());
        }
        let spawned = std::thread::Builder::new()
            .name("manifest-scan".into())
            .spawn(move || run_scanner(scanner, feed, lb, requests, me));
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
    lb: Option<Arc<ServiceLb>>,
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
            if let Some(lb) = &lb {
                lb.initial_sync_done();
            }
            feed.repo.do_send(InitialSyncDone, NAME);
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

/// Turns deltas into the repository's typed messages, and keeps what `toServices` needs.
struct Feed {
    repo: TracedAddr<PolicyRepoActor>,
    /// Services, EndpointSlices and the `toServices` policies (document and location).
    services: ServicesFeed<ObjKey, (Body, String)>,
    /// Objects whose last upsert could not be used, with the location it was reported under.
    unusable: HashMap<ObjKey, String>,
}

impl Feed {
    fn new(repo: TracedAddr<PolicyRepoActor>) -> Feed {
        Feed {
            repo,
            services: ServicesFeed::new(None),
            unusable: HashMap::new(),
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
        for k in &delta.deletes {
            self.send_delete(k);
        }
        for u in delta.upserts {
            self.send_upsert(&u.key, &u.body, &u.location);
        }
        sent
    }

    /// Translates `toServices` policies again against the current services.
    fn resend(&mut self, policies: Vec<(ObjKey, (Body, String))>) {
        for (k, (body, location)) in policies {
            self.send_upsert(&k, &body, &location);
        }
    }

    fn unusable(&mut self, k: &ObjKey, location: &str, error: String) {
        tracing::warn!(%location, error = %error, "object not usable");
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

    fn send_upsert(&mut self, k: &ObjKey, body: &Body, location: &str) {
        let value: Value = match serde_yaml::from_str(body) {
            Ok(v) => v,
            Err(e) => return self.unusable(k, location, e.to_string()),
        };
        let ns = &k.namespace;
        let converted: Result<(), String> = match k.kind.as_str() {
            "Namespace" => serde_yaml::from_value::<Namespace>(value)
                .map_err(|e| e.to_string())
                .and_then(|n| namespace_info(&n))
                .map(|namespace| self.repo.do_send(NamespaceUpsert { namespace }, NAME)),
            "Node" => serde_yaml::from_value::<Node>(value)
                .map_err(|e| e.to_string())
                .and_then(|n| node_info(&n))
                .map(|node| self.repo.do_send(NodeUpsert { node }, NAME)),
            "Service" => serde_yaml::from_value::<Service>(value)
                .map_err(|e| e.to_string())
                .and_then(|s| service_info(&s, ns))
                .map(|service| self.upsert_service(service)),
            "EndpointSlice" => serde_yaml::from_value::<EndpointSlice>(value)
                .map_err(|e| e.to_string())
                .and_then(|s| endpoint_slice_info(&s))
                .map(|slice| {
                    let again = self.services.set_slice(ns, &k.name, Some(slice));
                    self.resend(again);
                }),
            "Pod" => serde_yaml::from_value::<Pod>(value)
                .map_err(|e| e.to_string())
                .and_then(|p| pod_info(&p, ns))
                .map(|pod| self.repo.do_send(PodUpsert { pod }, NAME)),
            _ => {
                self.upsert_policy(k, &value, body, location);
                Ok(())
            }
        };
        match converted {
            Ok(()) => self.usable(k),
            Err(e) => self.unusable(k, location, e),
        }
    }

    fn upsert_service(&mut self, service: ServiceInfo) {
        let (msg, again) = self.services.upsert_service(service);
        self.repo.do_send(msg, NAME);
        self.resend(again);
    }

    /// A policy is validated here; a rejection is the repository's to record (the previous
    /// version stays enforced).
    fn upsert_policy(&mut self, k: &ObjKey, value: &Value, body: &Body, location: &str) {
        match parse_policy_with_services(value, DEFAULT_NAMESPACE, location, self.services.table())
        {
            Ok(policy) => {
                self.services.policy_translated(
                    k.clone(),
                    (body.clone(), location.to_string()),
                    policy.uses_services,
                );
                for w in &policy.warnings {
                    tracing::warn!(%location, "{w}");
                }
                self.repo.do_send(
                    PolicyUpsert {
                        policy,
                        source: location.to_string(),
                    },
                    NAME,
                )
            }
            Err(e) => self.repo.do_send(
                PolicyRejected {
                    key: policy_key(k),
                    error: e.to_string(),
                    source: location.to_string(),
                },
                NAME,
            ),
        }
    }

    fn send_delete(&mut self, k: &ObjKey) {
        self.usable(k);
        let (ns, name) = (&k.namespace, &k.name);
        match k.kind.as_str() {
            "EndpointSlice" => {
                let again = self.services.set_slice(ns, name, None);
                self.resend(again);
            }
            "Namespace" => self
                .repo
                .do_send(NamespaceDelete { name: name.clone() }, NAME),
            "Node" => self.repo.do_send(NodeDelete { name: name.clone() }, NAME),
            "Service" => {
                let (msg, again) = self.services.delete_service(ns, name);
                self.resend(again);
                self.repo.do_send(msg, NAME);
            }
            "Pod" => self.repo.do_send(
                PodDelete {
                    key: format!("{ns}/{name}"),
                },
                NAME,
            ),
            _ => {
                self.services.policy_deleted(k);
                if let Some(key) = policy_key(k) {
                    self.repo.do_send(PolicyDelete { key }, NAME);
                }
            }
        }
    }
}

fn policy_key(k: &ObjKey) -> Option<PolicyKey> {
    PolicyKey::for_object(&k.kind, &k.namespace, &k.name)
}

/// Re-read the manifest directory (queued on the scanner).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Rescan {
    pub reason: &'static str,
}

impl Traceable for Rescan {
    const KIND: &'static str = "Rescan";
    fn summary(&self) -> String {
        self.reason.to_string()
    }
}

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

impl Traceable for FilesChanged {
    const KIND: &'static str = "FilesChanged";
    fn summary(&self) -> String {
        String::new()
    }
}

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

impl Traceable for ScanDone {
    const KIND: &'static str = "ScanDone";
    fn summary(&self) -> String {
        match &self.outcome {
            Ok((s, sent)) => format!(
                "{} files ({} read, {} refused), {} objects, {sent} changes, {:?}",
                s.files, s.read, s.refused, s.objects, self.took
            ),
            Err(e) => format!("failed: {e}"),
        }
    }
}

impl Handler<ScanDone> for WatcherActor {
    type Result = ();
    fn handle(&mut self, msg: ScanDone, _: &mut Context<Self>) {
        if let Err(e) = msg.outcome {
            tracing::warn!(dir = %self.dir.display(), error = %e, "manifest directory not read; everything stays as it was");
        }
    }
}
