//! `LoaderActor`: owns the datapath (Cilium's `Loader`). Every kernel-facing operation goes
//! through its mailbox, so map updates are serialised and never race.

use std::time::Duration;

use actix::{Actor, AsyncContext, Context, Handler, Message};
use ipnet::IpNet;

use crate::datapath::{
    Datapath, DatapathError, EndpointAttachment, EndpointFlags, EndpointId, PolicyMapDump,
    SyncStats,
};
use crate::policy::attribution::Swept;
use crate::policy::identity::NumericIdentity;
use crate::policy::mapstate::MapDelta;
use crate::runtime::Shared;
use crate::traced_actor;

pub struct LoaderActor {
    datapath: Box<dyn Datapath>,
    shared: Shared,
}

impl LoaderActor {
    pub fn new(datapath: Box<dyn Datapath>, shared: Shared) -> Self {
        LoaderActor { datapath, shared }
    }

    /// See `SweepCookies`.
    fn sweep_cookies(&mut self, force: bool) -> Option<Swept> {
        let jar = &self.shared.cookies;
        // Not before every restored endpoint regenerated: until then their flags hold the
        // previous run's isolation cookies, which this run registers as it regenerates them.
        let ready = self.shared.ready.load(std::sync::atomic::Ordering::Acquire);
        let due = ready && jar.wants_sweep();
        if !(force || due) {
            return None;
        }
        // The generation first: what endpoints register or touch from here on is kept.
        let generation = jar.begin_sweep();
        let swept = jar.sweep(generation, &self.datapath.cookies_in_use());
        let removed = &self.shared.metrics.attribution_cookies_swept;
        removed.inc_by(swept.removed as u64);
        tracing::debug!(
            removed = swept.removed,
            kept = swept.kept,
            "attribution cookies swept"
        );
        if swept.unknown > 0 {
            tracing::error!(
                cookies = swept.unknown,
                "policy maps hold attribution cookies the agent never registered: their verdicts \
                 name no policy"
            );
        }
        Some(swept)
    }

    /// Forgets the verdict counts (`PolicyHits`) of policies the engine no longer holds, once
    /// there are more policies with hits than policies (or `force`), and the staged-verdict
    /// series of deleted policies; returns how many policies' hits went.
    fn forget_deleted_policies(&self, force: bool) -> usize {
        let hits = &self.shared.policy_hits;
        let engine = self.shared.engine.read().unwrap_or_else(|p| p.into_inner());
        let repo = engine.repository();
        let metrics = &self.shared.metrics;
        let staged = (self.shared.staged_counters).prune(metrics, |k| repo.get(k).is_some());
        if staged > 0 {
            tracing::debug!(
                policies = staged,
                "staged-verdict series of deleted policies removed"
            );
        }
        if !force && hits.len() <= repo.len() {
            return 0;
        }
        let known: std::collections::HashSet<(&str, Option<&str>, &str)> = repo
            .policies()
            .map(|p| {
                (
                    p.key.kind.as_str(),
                    p.key.namespace.as_deref(),
                    p.key.name.as_str(),
                )
            })
            .collect();
        hits.retain(|kind, ns, name| known.contains(&(kind, ns, name)))
    }

    fn count_error<T>(&self, r: &Result<T, DatapathError>) {
        if let Err(e) = r {
            self.shared.metrics.datapath_errors.inc();
            if matches!(e, DatapathError::PolicyMapFull { .. }) {
                self.shared.metrics.policy_map_full.inc();
            }
            tracing::warn!(error = %e, "datapath operation failed");
        }
    }
}

/// How often the loader asks whether the cookie jar has grown enough to sweep: also the least
/// time an attribution outlives the last entry that carried it (two sweeps must miss it).
pub const COOKIE_SWEEP_EVERY: Duration = Duration::from_secs(30);

impl Actor for LoaderActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(COOKIE_SWEEP_EVERY, |act, _| {
            act.sweep_cookies(false);
            let n = act.shared.cookies.len();
            act.shared.metrics.attribution_cookies.set(n as i64);
            act.forget_deleted_policies(false);
        });
    }
}
traced_actor!(LoaderActor: AttachEndpoint, DetachEndpoint, SweepStrayEndpoints, SyncPolicyMap, UpdateIpcache, Barrier, GetPolicyMap, GetIpcache, SweepCookies);

/// Adds or updates an endpoint in the endpoint map and creates its policy map.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), DatapathError>")]
pub struct AttachEndpoint {
    pub attachment: EndpointAttachment,
}

crate::traceable!(AttachEndpoint, "AttachEndpoint", |m| {
    format!(
        "endpoint {}, identity {}",
        m.attachment.id, m.attachment.identity
    )
});

impl Handler<AttachEndpoint> for LoaderActor {
    type Result = Result<(), DatapathError>;
    fn handle(&mut self, msg: AttachEndpoint, _: &mut Context<Self>) -> Self::Result {
        let r = self.datapath.attach_endpoint(&msg.attachment);
        self.count_error(&r);
        r
    }
}

/// Removes an endpoint and its policy map.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), DatapathError>")]
pub struct DetachEndpoint {
    pub id: EndpointId,
}

crate::traceable!(DetachEndpoint, "DetachEndpoint", |m| format!(
    "endpoint {}",
    m.id
));

impl Handler<DetachEndpoint> for LoaderActor {
    type Result = Result<(), DatapathError>;
    fn handle(&mut self, msg: DetachEndpoint, _: &mut Context<Self>) -> Self::Result {
        let r = self.datapath.detach_endpoint(msg.id);
        self.count_error(&r);
        r
    }
}

/// Removes whatever is pinned for endpoints not in `keep` (a restart's strays): their links,
/// policy maps and endpoint-table slots. Returns the endpoints swept.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<EndpointId>, DatapathError>")]
pub struct SweepStrayEndpoints {
    pub keep: Vec<EndpointId>,
}

crate::traceable!(SweepStrayEndpoints, "SweepStrayEndpoints", |m| format!(
    "keep {} endpoints",
    m.keep.len()
));

impl Handler<SweepStrayEndpoints> for LoaderActor {
    type Result = Result<Vec<EndpointId>, DatapathError>;
    fn handle(&mut self, msg: SweepStrayEndpoints, _: &mut Context<Self>) -> Self::Result {
        let mut swept = Vec::new();
        for id in self.datapath.pinned_endpoints() {
            if msg.keep.contains(&id) || self.datapath.endpoints().contains(&id) {
                continue;
            }
            match self.datapath.detach_endpoint(id) {
                Ok(()) => swept.push(id),
                Err(e) => {
                    tracing::warn!(endpoint = id, error = %e, "stray pinned endpoint not removed")
                }
            }
        }
        Ok(swept)
    }
}

/// Applies a policy delta to one endpoint's policy map.
#[derive(Debug, Message)]
#[rtype(result = "Result<SyncStats, DatapathError>")]
pub struct SyncPolicyMap {
    pub id: EndpointId,
    pub flags: EndpointFlags,
    pub delta: MapDelta,
    /// Clear the map first (after an error or on restore).
    pub replace: bool,
    pub revision: u64,
}

crate::traceable!(SyncPolicyMap, "SyncPolicyMap", |m| {
    format!(
        "endpoint {}, rev {}, +{} -{}{}",
        m.id,
        m.revision,
        m.delta.upserts.len(),
        m.delta.deletes.len(),
        if m.replace { ", replace" } else { "" }
    )
});

impl Handler<SyncPolicyMap> for LoaderActor {
    type Result = Result<SyncStats, DatapathError>;
    fn handle(&mut self, msg: SyncPolicyMap, _: &mut Context<Self>) -> Self::Result {
        let r = self
            .datapath
            .sync_policy(msg.id, msg.flags, &msg.delta, msg.replace);
        self.count_error(&r);
        r
    }
}

pub use crate::policy::ipcache::IpcacheChange;

/// Applies ipcache changes in order.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), DatapathError>")]
pub struct UpdateIpcache {
    pub changes: Vec<IpcacheChange>,
}

crate::traceable!(UpdateIpcache, "UpdateIpcache", |m| {
    match m.changes.as_slice() {
        [IpcacheChange::Upsert(p, id)] => format!("{p} -> {id}"),
        [IpcacheChange::Remove(p)] => format!("remove {p}"),
        c => format!("{} changes", c.len()),
    }
});

impl Handler<UpdateIpcache> for LoaderActor {
    type Result = Result<(), DatapathError>;
    fn handle(&mut self, msg: UpdateIpcache, _: &mut Context<Self>) -> Self::Result {
        let mut first_err = Ok(());
        for c in msg.changes {
            let r = match c {
                IpcacheChange::Upsert(p, id) => self.datapath.upsert_ipcache(p, id),
                IpcacheChange::Remove(p) => self.datapath.remove_ipcache(p),
            };
            self.count_error(&r);
            if first_err.is_ok() {
                first_err = r;
            }
        }
        first_err
    }
}

/// Fires `done` once every message sent to the loader before it was applied.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Barrier {
    pub done: tokio::sync::oneshot::Sender<()>,
}

crate::traceable!(Barrier, "Barrier", |_m| String::new());

impl Handler<Barrier> for LoaderActor {
    type Result = ();
    fn handle(&mut self, msg: Barrier, _: &mut Context<Self>) {
        let _ = msg.done.send(());
    }
}

/// The realized entries of one endpoint's policy map.
#[derive(Debug, Message)]
#[rtype(result = "Result<PolicyMapDump, DatapathError>")]
pub struct GetPolicyMap {
    pub id: EndpointId,
}

crate::traceable!(GetPolicyMap, "GetPolicyMap", |m| format!(
    "endpoint {}",
    m.id
));

impl Handler<GetPolicyMap> for LoaderActor {
    type Result = Result<PolicyMapDump, DatapathError>;
    fn handle(&mut self, msg: GetPolicyMap, _: &mut Context<Self>) -> Self::Result {
        self.datapath.dump_policy(msg.id)
    }
}

/// Removes the attribution cookies no endpoint's map or flags have held at two sweeps in a row
/// (`CookieJar::sweep`), when the jar has grown enough since the last sweep for one to pay, or
/// `force`. `None`: not swept. Also forgets what deleted policies left
/// (`forget_deleted_policies`).
#[derive(Debug, Message)]
#[rtype(result = "Option<Swept>")]
pub struct SweepCookies {
    pub force: bool,
}

crate::traceable!(SweepCookies, "SweepCookies", |m| if m.force {
    "forced".into()
} else {
    String::new()
});

impl Handler<SweepCookies> for LoaderActor {
    type Result = Option<Swept>;
    fn handle(&mut self, msg: SweepCookies, _: &mut Context<Self>) -> Self::Result {
        self.forget_deleted_policies(msg.force);
        self.sweep_cookies(msg.force)
    }
}

/// The datapath's ipcache.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<(IpNet, NumericIdentity)>, DatapathError>")]
pub struct GetIpcache;

crate::traceable!(GetIpcache, "GetIpcache", |_m| String::new());

impl Handler<GetIpcache> for LoaderActor {
    type Result = Result<Vec<(IpNet, NumericIdentity)>, DatapathError>;
    fn handle(&mut self, _: GetIpcache, _: &mut Context<Self>) -> Self::Result {
        Ok(self.datapath.dump_ipcache())
    }
}
