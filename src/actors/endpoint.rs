//! `EndpointActor`, one per endpoint: Cilium's `Endpoint` with its event queue, `regenerate` and
//! `regenerateBPF`.
//!
//! States: waiting-for-identity -> ready <-> regenerating, and disconnecting at the end;
//! not-ready when the datapath refused the policy (it then fails closed).
//!
//! Regenerations coalesce: `Regenerate` only raises the wanted revision and schedules one
//! `DoRegenerate` at the back of the mailbox, so a burst of changes is absorbed before the policy
//! is computed once, from the engine's newest revision. A regeneration computes the map state,
//! diffs it against what is realized, and sends only the delta to `LoaderActor`; the mailbox
//! waits for the datapath's answer, so regenerations of one endpoint never overlap and a stale
//! one can never land after a newer one.

use std::collections::BTreeSet;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use actix::{
    Actor, ActorContext, ActorFutureExt, AsyncContext, Context, Handler, Message, WrapFuture,
};
use serde::Serialize;

use super::loader::{AttachEndpoint, DetachEndpoint, LoaderActor, SyncPolicyMap};
use crate::datapath::events::Notification;
use crate::datapath::{DatapathError, EndpointAttachment, EndpointFlags, EndpointId, SyncStats};
pub use crate::endpoint::regeneration::EndpointState;
use crate::endpoint::regeneration::{Action, Event, Regeneration};
use crate::endpoint::state::EndpointRecord;
use crate::introspect::{
    current_change, ChangeId, ChangeScope, Journal, Traced, TracedAddr, TracedRecipient,
};
use crate::policy::attribution::{isolation_cookie, isolation_cookie_value, MatchKind};
use crate::policy::engine::{EndpointView, NamedPort, PolicyEngine};
use crate::policy::identity::NumericIdentity;
use crate::policy::labels::Labels;
use crate::policy::mapstate::MapState;
use crate::proxy::applied::APPLY_WAIT;
use crate::runtime::Shared;

/// An endpoint as the API shows it (`/debug/endpoints`, `ciliate endpoint get`).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct EndpointModel {
    pub id: EndpointId,
    pub name: String,
    pub identity: Option<NumericIdentity>,
    pub labels: Vec<String>,
    pub ips: Vec<String>,
    pub interface: Option<String>,
    pub state: String,
    pub policy_revision: u64,
    pub policy_entries: usize,
    pub ingress_enforced: bool,
    pub egress_enforced: bool,
    pub regenerations: u64,
    pub error: Option<String>,
    pub container_id: Option<String>,
    /// `PolicyAuditMode` of this endpoint (the agent-wide `--policy-audit-mode` aside).
    #[serde(default)]
    pub audit: bool,
}

pub struct EndpointActor {
    record: EndpointRecord,
    labels: Labels,
    named_ports: Vec<NamedPort>,
    /// Wanted and realized revisions, queueing, failures (`endpoint::regeneration`).
    regen: Regeneration,
    realized: MapState,
    realized_flags: EndpointFlags,
    attached: bool,
    engine: Arc<RwLock<PolicyEngine>>,
    loader: TracedAddr<LoaderActor>,
    reports: Reports,
    shared: Shared,
    journal: Arc<Journal>,
    /// The state directory is behind what a restore needs.
    needs_persist: bool,
    /// The latest change that asked for a regeneration: what the endpoint sends for it (to the
    /// loader, its report) belongs to that change, also after a queued `DoRegenerate`.
    change: Option<ChangeId>,
    /// The next computation must be a full one (anything may have changed).
    full_needed: bool,
    /// Peer identities whose selections changed since the last computation, when those are the
    /// only changes asked for (`Regenerate::peers`): the next one may be incremental.
    pending_peers: BTreeSet<NumericIdentity>,
}

/// An endpoint finished a regeneration (or a revision bump) at `revision`.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct EndpointRealized {
    pub id: EndpointId,
    pub revision: u64,
    /// False when the regeneration failed: the endpoint stops counting as pending, without a
    /// delay observation.
    pub ok: bool,
}

crate::traceable!(EndpointRealized, "EndpointRealized", |m| {
    format!(
        "endpoint {}, rev {}{}",
        m.id,
        m.revision,
        if m.ok { "" } else { ", failed" }
    )
});

/// An endpoint went away: nothing waits for it any more.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct EndpointGone {
    pub id: EndpointId,
}

crate::traceable!(EndpointGone, "EndpointGone", |m| format!(
    "endpoint {}",
    m.id
));

/// Where an endpoint reports its regenerations and its end (the reaction tracker), without
/// naming the actor that listens.
#[derive(Clone)]
pub struct Reports {
    pub realized: TracedRecipient<EndpointRealized>,
    pub gone: TracedRecipient<EndpointGone>,
}

impl Reports {
    pub fn to<A>(addr: &TracedAddr<A>) -> Reports
    where
        A: Actor + Handler<Traced<EndpointRealized>> + Handler<Traced<EndpointGone>>,
        A::Context: actix::dev::ToEnvelope<A, Traced<EndpointRealized>>
            + actix::dev::ToEnvelope<A, Traced<EndpointGone>>,
    {
        Reports {
            realized: addr.recipient(),
            gone: addr.recipient(),
        }
    }
}

impl EndpointActor {
    pub fn new(
        record: EndpointRecord,
        labels: Labels,
        named_ports: Vec<NamedPort>,
        shared: Shared,
        loader: TracedAddr<LoaderActor>,
        reports: Reports,
        journal: Arc<Journal>,
    ) -> Self {
        EndpointActor {
            labels,
            named_ports,
            regen: Regeneration::new(record.identity.is_some()),
            realized: MapState::new(),
            realized_flags: EndpointFlags::default(),
            attached: false,
            engine: shared.engine.clone(),
            loader,
            reports,
            journal,
            shared,
            needs_persist: true,
            change: None,
            full_needed: true,
            pending_peers: BTreeSet::new(),
            record,
        }
    }

    fn name(&self) -> String {
        format!("EndpointActor/{}", self.record.id)
    }

    /// What the datapath needs of this endpoint, with `identity`.
    fn attachment(&self, identity: NumericIdentity) -> EndpointAttachment {
        EndpointAttachment {
            id: self.record.id,
            interface: self.record.interface.clone(),
            ips: self.record.ips.clone(),
            identity,
            mac: self.record.mac.clone(),
        }
    }

    fn model(&self) -> EndpointModel {
        EndpointModel {
            id: self.record.id,
            name: self.record.name.clone(),
            identity: self.record.identity,
            labels: self.labels.to_strings(),
            ips: self.record.ips.iter().map(|i| i.to_string()).collect(),
            interface: self.record.interface.clone(),
            state: self.regen.state.as_str().to_string(),
            policy_revision: self.regen.realized,
            policy_entries: self.realized.len(),
            ingress_enforced: self.realized_flags.ingress_default_deny,
            egress_enforced: self.realized_flags.egress_default_deny,
            regenerations: self.regen.regenerations,
            error: self.regen.error.clone(),
            container_id: self.record.container_id.clone(),
            audit: self.record.audit,
        }
    }

    /// The endpoint's part of the HTTP proxy's table, from its whole map state (`map` holds
    /// only `peers`' entries after an incremental resolution: merged into what is realized).
    /// Returns the table's generation when it changed (the proxy is waited for).
    fn update_http_table(
        &self,
        map: &MapState,
        peers: Option<&BTreeSet<NumericIdentity>>,
        audit: bool,
    ) -> Option<u64> {
        let id = self.record.id as u64;
        let merged;
        let l7 = self.shared.http.has(id) || map.any_redirect();
        let whole = match peers {
            // Neither before nor now: nothing for the proxy (no connection of the endpoint
            // reaches it), and no table built and compared on every regeneration.
            _ if !l7 => return None,
            None => map,
            Some(p) => {
                let mut m = self.realized.clone();
                m.replace_peers(p, map.clone());
                merged = m;
                &merged
            }
        };
        let table = crate::proxy::http::table::endpoint_table(
            id,
            &self.record.name,
            &self.record.ips,
            audit,
            whole,
        );
        self.shared.http.set_table(id, Some(table))
    }

    /// What the staged policies selecting this endpoint would make of its new connections
    /// (`Shared::staged`, read by the flow sink); gone when none selects it.
    fn publish_staged(&self, staged: Option<crate::policy::engine::StagedPolicy>) {
        match staged {
            Some(s) => {
                self.shared
                    .staged
                    .insert(self.record.id as u32, Arc::new(s));
            }
            None => {
                self.shared.staged.remove(&(self.record.id as u32));
            }
        }
    }

    /// Writes the state directory when something worth restoring changed.
    fn persist(&mut self) {
        // Only what a restore needs is written: it changes with the identity, not with every
        // regeneration (the recorded policy revision is informational).
        if !self.needs_persist {
            return;
        }
        let mut rec = self.record.clone();
        rec.labels = self.labels.to_strings();
        match self.shared.state_dir.write(&rec) {
            // On failure the flag stays up: the next regeneration tries again.
            Ok(()) => self.needs_persist = false,
            Err(e) => {
                tracing::error!(endpoint = self.record.id, error = %e, "cannot write endpoint state")
            }
        }
    }

    /// Feeds the state machine one event and carries out what it says.
    fn step(&mut self, ctx: &mut Context<Self>, event: Event) {
        if let Some(c) = current_change() {
            self.change = Some(c);
        }
        let _change = ChangeScope::enter(self.change);
        for action in self.regen.step(event) {
            match action {
                Action::Queue => ctx.notify(DoRegenerate),
                Action::QueueAfter(delay) => {
                    ctx.run_later(delay, |_, ctx| ctx.notify(DoRegenerate));
                }
                Action::Compute { replace } => self.regenerate(ctx, replace),
                Action::Report { revision, ok } => self.report(revision, ok),
            }
        }
        self.record.policy_revision = self.regen.realized;
    }

    fn report(&self, revision: u64, ok: bool) {
        self.reports.realized.do_send(
            EndpointRealized {
                id: self.record.id,
                revision,
                ok,
            },
            self.name(),
        );
    }

    /// The host endpoint: warns (once per change of the warnings) when its policy would cut
    /// the node from what it depends on, naming the rule (`status` lists them meanwhile).
    fn check_lifelines(
        &self,
        engine: &PolicyEngine,
        policy: &crate::policy::engine::EndpointPolicy,
    ) {
        use crate::endpoint::host::{cut_lifelines, Lifeline};
        use crate::policy::rule::Direction;
        let kubelet = self
            .shared
            .kubelet_port
            .load(std::sync::atomic::Ordering::Relaxed);
        let mut lifelines = Vec::new();
        if let Some(api) = self.shared.api_server {
            let peer = engine.identity_of_ip(api.ip());
            lifelines.push(Lifeline {
                what: format!("its API server {api}"),
                direction: Direction::Egress,
                peer,
                protocol: 6,
                port: api.port(),
            });
            if let Ok(port @ 1..) = u16::try_from(kubelet) {
                lifelines.push(Lifeline {
                    what: format!(
                        "its kubelet's port {port}, which the API server {} reaches for logs, exec and port-forward",
                        api.ip()
                    ),
                    direction: Direction::Ingress,
                    peer,
                    protocol: 6,
                    port,
                });
            }
        }
        let warnings = cut_lifelines(policy, &lifelines);
        let Ok(mut shown) = self.shared.host_firewall_warnings.lock() else {
            return;
        };
        if *shown != warnings {
            for w in &warnings {
                tracing::warn!(warning = %w, "host firewall");
            }
            *shown = warnings;
        }
    }

    /// Computes the policy and sends it to the datapath; the answer comes back in `finish`.
    fn regenerate(&mut self, ctx: &mut Context<Self>, replace: bool) {
        let Some(identity) = self.record.identity else {
            return; // the machine only computes with an identity
        };
        let started = Instant::now();
        // Incremental when only some peers' selections changed since the last full one (the
        // host endpoint's few rules are always resolved whole).
        let peers =
            (!replace && !self.full_needed && !self.record.host && !self.pending_peers.is_empty())
                .then(|| std::mem::take(&mut self.pending_peers));
        self.pending_peers.clear();
        self.full_needed = false;
        let (revision, policy, diffs) = {
            let engine = match self.engine.read() {
                Ok(e) => e,
                Err(poisoned) => poisoned.into_inner(),
            };
            let view = EndpointView {
                identity,
                labels: &self.labels,
                named_ports: &self.named_ports,
                host: self.record.host,
            };
            let policy = engine.resolve_peers(&view, peers.as_ref());
            if self.record.host {
                self.check_lifelines(&engine, &policy);
            }
            self.publish_staged(engine.resolve_staged(&view));
            (engine.revision(), policy, engine.diff_memo())
        };
        // Cluster tiers resolve whole (`EndpointPolicy::tiered`): realized whole too.
        let peers = peers.filter(|_| !policy.tiered());
        for note in policy.tiers.iter().flat_map(|t| &t.notes) {
            tracing::warn!(endpoint = self.record.id, %note, "cluster tiers: denied beyond the policies (fail closed)");
        }
        let ingress_cookie = isolation_cookie_value(&policy.ingress.isolated_by);
        let egress_cookie = isolation_cookie_value(&policy.egress.isolated_by);
        let (ingress_default_deny, egress_default_deny, audit) = self.shared.enforcement.apply(
            !policy.ingress.isolated_by.is_empty(),
            !policy.egress.isolated_by.is_empty(),
            self.record.audit,
        );
        let flags = EndpointFlags {
            ingress_default_deny,
            egress_default_deny,
            drop_all: false,
            ingress_cookie,
            egress_cookie,
            audit,
            dns_proxy: policy.dns_redirected(),
        };
        // The proxy learns the rules before the datapath sends it this endpoint's DNS (until
        // then it refuses the endpoint's queries: fail closed).
        let dns = self.shared.dns.set_rules(
            self.record.id as u64,
            policy
                .dns_redirected()
                .then(|| crate::proxy::dns::EndpointRules {
                    id: self.record.id as u64,
                    pod: self.record.name.clone(),
                    ips: self.record.ips.clone(),
                    entries: policy.dns.clone(),
                }),
        );
        // Likewise the HTTP proxy learns the endpoint's L7 rules before connections they cover
        // reach it (until then it holds them briefly, then denies: fail closed).
        let http = self.update_http_table(&policy.map, peers.as_ref(), audit);
        let delta = match (&peers, replace) {
            (_, true) => policy.map.diff_from_shared(&MapState::new(), &diffs),
            (Some(p), false) => policy.map.diff_peers_from(&self.realized, p),
            (None, false) => policy.map.diff_from_shared(&self.realized, &diffs),
        };
        // Every cookie is resolvable before the datapath can report it (and kept by a sweep
        // that begins before the loader holds it: `CookieJar::touch`).
        let jar = &self.shared.cookies;
        for (cookie, kind, refs) in &delta.attributions {
            if !jar.touch(*cookie) {
                jar.register(*cookie, *kind, refs.to_vec(), revision);
            }
        }
        for (cookie, by) in [
            (ingress_cookie, &policy.ingress.isolated_by),
            (egress_cookie, &policy.egress.isolated_by),
        ] {
            if !jar.touch(cookie) {
                jar.register(
                    cookie,
                    MatchKind::DefaultDeny,
                    isolation_cookie(by).1,
                    revision,
                );
            }
        }
        let name = self.name();
        if !self.attached {
            let att = self.attachment(identity);
            self.loader
                .do_send(AttachEndpoint { attachment: att }, name.clone());
            self.attached = true;
        }
        let sync = SyncPolicyMap {
            id: self.record.id,
            flags,
            delta,
            replace,
            revision,
        };
        let change = self.change;
        let synced = self.loader.send(sync, name.clone());
        // Realized means enforced: by the proxies too when their rules for the endpoint
        // changed (as Cilium's regeneration waits for Envoy's ACK; `proxy::applied`).
        let proxies = [
            (
                "HTTP",
                http.map(|g| self.shared.http.sync.wait(g, APPLY_WAIT)),
            ),
            ("DNS", dns.map(|g| self.shared.dns.sync.wait(g, APPLY_WAIT))),
        ];
        let (id, pod) = (self.record.id, self.record.name.clone());
        let fut = async move {
            let res = synced.await;
            for (proxy, applied) in proxies {
                if let Some(applied) = applied {
                    if !applied.await {
                        tracing::warn!(endpoint = id, %pod, proxy, "the proxy did not confirm the endpoint's new rules in time; reported realized anyway");
                    }
                }
            }
            res
        };
        let fut = fut.into_actor(self).map(move |res, act, ctx| {
            let _change = ChangeScope::enter(change);
            let res: Result<SyncStats, DatapathError> = match res {
                Ok(r) => r,
                Err(e) => Err(DatapathError::System {
                    operation: "send to LoaderActor".into(),
                    message: e.to_string(),
                }),
            };
            act.finish(ctx, revision, (policy.map, peers), flags, res, started);
        });
        ctx.wait(fut);
    }

    fn finish(
        &mut self,
        ctx: &mut Context<Self>,
        revision: u64,
        (map, peers): (MapState, Option<BTreeSet<NumericIdentity>>),
        flags: EndpointFlags,
        res: Result<SyncStats, DatapathError>,
        started: Instant,
    ) {
        let elapsed = started.elapsed();
        self.shared
            .metrics
            .endpoint_regeneration
            .observe(elapsed.as_secs_f64());
        let started_at =
            chrono::Utc::now() - chrono::Duration::from_std(elapsed).unwrap_or_default();
        let outcome = match &res {
            Ok(s) => Ok(format!(
                "rev {revision}: {} entries, +{} -{}",
                s.entries, s.upserted, s.deleted
            )),
            Err(e) => Err(e.to_string()),
        };
        let (summary, result) = match outcome {
            Ok(s) => (s, Ok(())),
            Err(e) => (format!("rev {revision}"), Err(e)),
        };
        self.journal
            .note("PolicyRealized", summary, "LoaderActor", started_at, result);
        let label = if res.is_ok() { "ok" } else { "error" };
        self.shared
            .metrics
            .regenerations
            .get_or_create(&outcome_label(label))
            .inc();
        let (id, name) = (self.record.id as u32, self.record.name.clone());
        let notice = match res {
            Ok(_) => {
                match peers {
                    Some(p) => self.realized.replace_peers(&p, map),
                    None => self.realized = map,
                }
                self.realized_flags = flags;
                self.step(ctx, Event::Realized { revision });
                self.persist();
                Notification::endpoint("regenerated", id, &name, revision, None)
            }
            Err(e) => {
                self.full_needed = true;
                tracing::error!(endpoint = self.record.id, error = %e, "regeneration failed; the endpoint fails closed");
                let error = e.to_string();
                self.step(
                    ctx,
                    Event::Failed {
                        revision,
                        error: error.clone(),
                    },
                );
                Notification::endpoint("regeneration-failed", id, &name, revision, Some(error))
            }
        };
        let _ = self.shared.notifications.send(notice);
    }
}

fn outcome_label(s: &str) -> crate::metrics::OutcomeLabels {
    crate::metrics::OutcomeLabels {
        outcome: s.to_string(),
    }
}

impl Actor for EndpointActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.persist();
        // Restored or new endpoints regenerate only when told (after the initial sync).
        let _ = ctx;
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        self.shared.registry.deregister(&self.name());
    }
}
crate::traced_actor!(EndpointActor: Regenerate, BumpRevision, SetIdentity, SetAudit, GetEndpoint, GetRealizedPolicy, Delete);

/// `PolicyAuditMode`: the endpoint audits (`true`) or enforces. Applied at once by a forced
/// regeneration (the endpoint record's flags), persisted with the endpoint.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct SetAudit {
    pub audit: bool,
}

crate::traceable!(SetAudit, "SetAudit", |m| format!(
    "audit {}",
    if m.audit { "enabled" } else { "disabled" }
));

impl Handler<SetAudit> for EndpointActor {
    type Result = ();
    fn handle(&mut self, msg: SetAudit, ctx: &mut Context<Self>) {
        if self.record.audit == msg.audit {
            return;
        }
        self.record.audit = msg.audit;
        self.full_needed = true;
        self.needs_persist = true;
        self.persist();
        let revision = self.regen.wanted;
        self.step(
            ctx,
            Event::Requested {
                revision,
                force: true,
            },
        );
    }
}

/// Compute and realize the policy (sent by `RuleReactionActor`).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Regenerate {
    pub revision: u64,
    pub reason: String,
    /// Regenerate even if `revision` is realized already (identity or label changes).
    pub force: bool,
    /// Only these peer identities' selections changed (a DNS name learned or expired): the
    /// endpoint may update their entries alone. `None`: anything may have changed.
    pub peers: Option<BTreeSet<NumericIdentity>>,
}

crate::traceable!(Regenerate, "Regenerate", |m| {
    format!(
        "rev {}, reason: {}{}",
        m.revision,
        m.reason,
        if m.force { " (forced)" } else { "" }
    )
});

impl Handler<Regenerate> for EndpointActor {
    type Result = ();
    fn handle(&mut self, msg: Regenerate, ctx: &mut Context<Self>) {
        let (revision, force) = (msg.revision, msg.force);
        match msg.peers {
            Some(p) => self.pending_peers.extend(p),
            None => self.full_needed = true,
        }
        self.step(ctx, Event::Requested { revision, force });
    }
}

/// A change that does not affect this endpoint: its realized revision moves on.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct BumpRevision {
    pub revision: u64,
}

crate::traceable!(BumpRevision, "BumpRevision", |m| format!(
    "rev {}",
    m.revision
));

impl Handler<BumpRevision> for EndpointActor {
    type Result = ();
    fn handle(&mut self, msg: BumpRevision, ctx: &mut Context<Self>) {
        let revision = msg.revision;
        self.step(ctx, Event::Bumped { revision });
    }
}

/// Internal: run the scheduled regeneration.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct DoRegenerate;

impl Handler<DoRegenerate> for EndpointActor {
    type Result = ();
    fn handle(&mut self, _: DoRegenerate, ctx: &mut Context<Self>) {
        if self.regen.state == EndpointState::Disconnecting {
            return;
        }
        let _change = ChangeScope::enter(self.change);
        self.journal.note(
            "DoRegenerate",
            format!("wanted rev {}", self.regen.wanted),
            "self",
            chrono::Utc::now(),
            Ok(()),
        );
        self.step(ctx, Event::Due);
    }
}

/// The endpoint's identity changed (its pod or namespace labels changed, or the pod appeared).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct SetIdentity {
    pub identity: Option<NumericIdentity>,
    pub labels: Labels,
    pub named_ports: Vec<NamedPort>,
    /// New addresses (the host endpoint follows its Node's); `None`: unchanged.
    pub ips: Option<Vec<std::net::IpAddr>>,
}

crate::traceable!(SetIdentity, "SetIdentity", |m| {
    match m.identity {
        Some(id) => format!("identity {id}"),
        None => "no identity".into(),
    }
});

impl Handler<SetIdentity> for EndpointActor {
    type Result = ();
    fn handle(&mut self, msg: SetIdentity, ctx: &mut Context<Self>) {
        let changed = msg.identity != self.record.identity || msg.named_ports != self.named_ports;
        self.record.identity = msg.identity;
        self.labels = msg.labels;
        self.named_ports = msg.named_ports;
        if let Some(ips) = msg.ips {
            self.record.ips = ips;
        }
        if changed {
            self.full_needed = true;
            let has_identity = msg.identity.is_some();
            self.step(ctx, Event::IdentityChanged { has_identity });
            if let (Some(id), true) = (msg.identity, self.attached) {
                let att = self.attachment(id);
                self.loader
                    .do_send(AttachEndpoint { attachment: att }, self.name());
            }
            self.needs_persist = true;
            self.persist();
        }
    }
}

/// The endpoint as the API shows it.
#[derive(Debug, Message)]
#[rtype(result = "Result<EndpointModel, String>")]
pub struct GetEndpoint;

crate::traceable!(GetEndpoint, "GetEndpoint", |_m| String::new());

impl Handler<GetEndpoint> for EndpointActor {
    type Result = Result<EndpointModel, String>;
    fn handle(&mut self, _: GetEndpoint, _: &mut Context<Self>) -> Self::Result {
        Ok(self.model())
    }
}

/// The realized map state (what was sent to the datapath), for tests and debugging.
#[derive(Debug, Message)]
#[rtype(result = "Result<MapState, String>")]
pub struct GetRealizedPolicy;

crate::traceable!(GetRealizedPolicy, "GetRealizedPolicy", |_m| String::new());

impl Handler<GetRealizedPolicy> for EndpointActor {
    type Result = Result<MapState, String>;
    fn handle(&mut self, _: GetRealizedPolicy, _: &mut Context<Self>) -> Self::Result {
        Ok(self.realized.clone())
    }
}

/// Remove the endpoint: detach it from the datapath, delete its state, stop.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), String>")]
pub struct Delete {
    /// Keep the datapath and state directory (agent shutdown, not endpoint deletion).
    pub keep_datapath: bool,
}

crate::traceable!(Delete, "Delete", |m| {
    if m.keep_datapath {
        "shutdown".into()
    } else {
        "delete".into()
    }
});

impl Handler<Delete> for EndpointActor {
    type Result = Result<(), String>;
    fn handle(&mut self, msg: Delete, ctx: &mut Context<Self>) -> Self::Result {
        self.step(ctx, Event::Disconnect);
        self.publish_staged(None);
        if !msg.keep_datapath {
            self.shared.dns.set_rules(self.record.id as u64, None);
            self.shared.http.set_table(self.record.id as u64, None);
            self.loader
                .do_send(DetachEndpoint { id: self.record.id }, self.name());
            self.shared
                .state_dir
                .remove(self.record.id)
                .map_err(|e| e.to_string())?;
        }
        self.reports
            .gone
            .do_send(EndpointGone { id: self.record.id }, self.name());
        ctx.stop();
        Ok(())
    }
}
