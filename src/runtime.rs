//! The services every actor and the API share while the agent runs (`Shared`): introspection,
//! metrics, the engine, the endpoint state directory, IPAM, the node and routing views, Service
//! translation, and the record of recent policy implementations. A leaf of the runtime: it
//! imports the libraries it holds and nothing that builds on it (actors, API, agent).

use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, RwLock};

use serde::Serialize;

use crate::policy::engine::PolicyEngine;

/// How many recent policy implementations `/debug/policy` keeps.
pub const IMPLEMENTATIONS_KEPT: usize = 256;

/// One policy change, from being accepted to every affected endpoint realizing it.
#[derive(Debug, Clone, Serialize)]
pub struct Implementation {
    pub revision: u64,
    pub reason: String,
    pub endpoints: usize,
    pub seconds: f64,
}

/// Services every actor can reach.
#[derive(Clone)]
pub struct Shared {
    pub registry: Arc<crate::introspect::Registry>,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// The policy engine. `PolicyRepoActor` is its only writer; endpoints read it to resolve
    /// their policy at the revision they observe.
    pub engine: Arc<RwLock<PolicyEngine>>,
    pub state_dir: crate::endpoint::state::StateDir,
    pub node_name: String,
    /// Initial sync done and every restored endpoint regenerated.
    pub ready: Arc<AtomicBool>,
    /// The most recent policy implementations (newest last).
    pub implementations: Arc<Mutex<VecDeque<Implementation>>>,
    /// Node IPAM (the CNI plugin's addresses): set from `--pod-cidr` at start, or from this
    /// node's Node object when it gives a pod CIDR.
    pub ipam: Arc<Mutex<crate::ipam::NodeIpam>>,
    /// Policy verdict events from the datapath, for `ciliate monitor` (each subscriber gets all).
    /// What each attribution cookie the datapath may report stands for.
    pub cookies: Arc<crate::policy::attribution::CookieJar>,
    /// `--enable-policy`, `--policy-audit-mode`.
    pub enforcement: crate::config::Enforcement,
    /// Verdicts by deciding policy (`/debug/policy`, `policy get`).
    pub policy_hits: Arc<crate::policy::attribution::PolicyHits>,
    /// Start-up phase timings.
    pub bootstrap: Arc<Bootstrap>,
    /// Pods by address (`namespace/name`), for flows (`source_pod`, `destination_pod`).
    pub pod_names: Arc<dashmap::DashMap<std::net::IpAddr, String>>,
    /// Workloads by pod (`namespace/name`), of the pods the agent reads Pod objects of (not
    /// those it knows from endpoint slices alone): Hubble's `Endpoint.workloads`.
    pub workloads: Arc<dashmap::DashMap<String, crate::objects::Workload>>,
    /// Policy and endpoint notifications for `ciliate monitor`.
    pub notifications: tokio::sync::broadcast::Sender<crate::datapath::events::Notification>,
    /// Verdict events: the recent ones (`monitor --since`) and the live broadcast.
    pub flows: Arc<crate::datapath::flows::FlowRing>,
    /// Endpoints selected by staged policies: their policy with those enforced, by endpoint
    /// id (written by each `EndpointActor`, read for every new flow: `FlowSink`).
    pub staged: StagedViews,
    pub staged_counters: StagedCounters,
    /// The distinct connections observed (`--flow-history`; `agent::history` records them).
    pub flow_history: crate::traffic::observe::SharedHistory,
    /// What the initial sync still waits for (e.g. `CiliumNetworkPolicy: not listed yet (last
    /// error: ...)`), shown by `/readyz` while not ready.
    pub sync_waiting: Arc<Mutex<Vec<String>>>,
    /// Kubernetes mode: the optional kinds (`kinds::KindInfo::optional`) the API server does not
    /// serve (their CRD is not installed), shown by `status`.
    pub kinds_not_served: Arc<Mutex<std::collections::BTreeSet<&'static str>>>,
    /// Kubernetes mode: where policy outcomes go to be written into CNP/CCNP status.
    pub policy_status: Option<crate::k8s::status::PolicyStatusSink>,
    /// The Node objects known, for the route reconciler (`PolicyRepoActor` publishes them).
    pub nodes: tokio::sync::watch::Sender<crate::network::NodeSet>,
    /// Routing as realized: mode, routes installed, one row per node (`node list`).
    pub routing: Arc<Mutex<crate::network::RoutingView>>,
    /// The MTU the CNI gives pod interfaces (lowered by the tunnel's overhead in tunnel mode).
    pub pod_mtu: u32,
    /// Services and their translation (in process until the agent attaches the BPF programs).
    pub services: Arc<crate::services::ServiceLb>,
    /// DNS-aware policy: the FQDN cache, endpoints' DNS rules, the proxy (`proxy::dns::state`).
    pub dns: Arc<crate::proxy::dns::state::DnsState>,
    /// L7 HTTP policy: endpoints' tables, the proxy (`proxy::http::state`).
    pub http: Arc<crate::proxy::http::state::HttpState>,
    /// Kubernetes mode: where other nodes' pods come from, and this node's endpoint slices.
    pub pod_source: Arc<Mutex<crate::k8s::slices::PodSourceView>>,
    /// Kubernetes mode: the API server's address (a connection the host firewall warns
    /// before cutting: `endpoint::host::Lifeline`).
    pub api_server: Option<std::net::SocketAddr>,
    /// The port this node's kubelet reports in its Node object (0: none): the API server's
    /// connections to it (logs, exec, port-forward) are the host firewall's second lifeline.
    pub kubelet_port: Arc<std::sync::atomic::AtomicU32>,
    /// What the host policies in force would cut of the node's own connections (`status`).
    pub host_firewall_warnings: Arc<Mutex<Vec<String>>>,
}

impl Shared {
    /// Where the datapath's verdict events go.
    pub fn flow_sink(&self) -> FlowSink {
        FlowSink {
            cookies: self.cookies.clone(),
            pod_names: self.pod_names.clone(),
            policy_hits: self.policy_hits.clone(),
            metrics: self.metrics.clone(),
            flows: self.flows.clone(),
            staged: self.staged.clone(),
            staged_counters: self.staged_counters.clone(),
        }
    }

    /// Fresh services for one agent: metrics hooked to the actors' journals.
    pub fn new(node_name: &str, state_dir: crate::endpoint::state::StateDir) -> Shared {
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let hook_metrics = metrics.clone();
        // Each journal asks once per message kind (`introspect::HandledHook`).
        let hook: crate::introspect::HandledHook = Arc::new(move |actor, message| {
            hook_metrics
                .actor_messages_handled
                .get_or_create(&crate::metrics::ActorMessageLabels {
                    actor: actor.to_string(),
                    message: message.to_string(),
                })
                .clone()
        });
        Shared {
            registry: Arc::new(crate::introspect::Registry::new(Some(hook))),
            metrics,
            engine: Arc::new(RwLock::new(PolicyEngine::new())),
            state_dir,
            node_name: node_name.to_string(),
            ready: Arc::new(AtomicBool::new(false)),
            implementations: Arc::new(Mutex::new(VecDeque::new())),
            ipam: Arc::new(Mutex::new(crate::ipam::NodeIpam::default())),
            flows: Arc::new(crate::datapath::flows::FlowRing::new(
                crate::datapath::flows::DEFAULT_CAPACITY,
                4096,
            )),
            notifications: tokio::sync::broadcast::channel(1024).0,
            staged: Default::default(),
            staged_counters: Default::default(),
            flow_history: Default::default(),
            cookies: Default::default(),
            enforcement: Default::default(),
            policy_hits: Default::default(),
            bootstrap: Default::default(),
            pod_names: Default::default(),
            workloads: Default::default(),
            sync_waiting: Arc::new(Mutex::new(Vec::new())),
            kinds_not_served: Default::default(),
            policy_status: None,
            nodes: tokio::sync::watch::channel(Default::default()).0,
            routing: Arc::new(Mutex::new(crate::network::RoutingView {
                mode: crate::network::RoutingMode::Native.as_str().into(),
                ..Default::default()
            })),
            pod_mtu: crate::network::tunnel::LINK_MTU,
            services: Arc::new(crate::services::ServiceLb::memory(None)),
            dns: Default::default(),
            http: Default::default(),
            pod_source: Default::default(),
            api_server: None,
            kubelet_port: Default::default(),
            host_firewall_warnings: Default::default(),
        }
    }

    /// Records a finished policy implementation.
    pub fn record_implementation(&self, imp: Implementation) {
        self.metrics
            .policy_implementation_delay
            .observe(imp.seconds);
        if let Ok(mut v) = self.implementations.lock() {
            if v.len() == IMPLEMENTATIONS_KEPT {
                v.pop_front();
            }
            v.push_back(imp);
        }
    }

    /// Tells the policy status writer (Kubernetes mode) what happened to a policy.
    pub fn report_policy(&self, event: crate::k8s::status::PolicyStatusEvent) {
        if let Some(sink) = &self.policy_status {
            sink.report(event);
        }
    }

    /// The recorded implementations, oldest first.
    pub fn implementations(&self) -> Vec<Implementation> {
        self.implementations
            .lock()
            .map(|v| v.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// What the agent does with each verdict event the datapath reports: attribution (the cookie's
/// policies), pod names, per-policy hits, verdict metrics, and the flow ring.
#[derive(Clone)]
pub struct FlowSink {
    pub cookies: Arc<crate::policy::attribution::CookieJar>,
    pub pod_names: Arc<dashmap::DashMap<std::net::IpAddr, String>>,
    pub policy_hits: Arc<crate::policy::attribution::PolicyHits>,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub flows: Arc<crate::datapath::flows::FlowRing>,
    pub staged: StagedViews,
    pub staged_counters: StagedCounters,
}

/// `ciliate_policy_staged_verdicts_total`'s counters by staged policy (the address of its
/// current version's `Arc`, which the entry holds, so that no other policy's key can be
/// allocated there while it is cached) and verdict, so that a flow counts without formatting
/// labels. Bounded: emptied when it reaches `STAGED_COUNTERS_MAX` (policy versions come and
/// go; the counters live on in the metric family). The family's label sets are those of the
/// policies the engine holds: [`prune`](Self::prune) takes a deleted policy's series out.
#[derive(Clone, Default)]
pub struct StagedCounters(Arc<Mutex<StagedInner>>);

#[derive(Default)]
struct StagedInner {
    counters: std::collections::HashMap<(usize, bool), StagedCounter>,
    /// The policies with label sets in the family, by their label.
    labelled: std::collections::HashMap<String, Arc<crate::policy::rule::PolicyKey>>,
}

type StagedCounter = (
    Arc<crate::policy::rule::PolicyKey>,
    prometheus_client::metrics::counter::Counter,
);

const STAGED_COUNTERS_MAX: usize = 4096;

/// The `verdict` label values.
const STAGED_VERDICTS: [&str; 2] = ["forwarded", "dropped"];

impl StagedCounters {
    pub(crate) fn inc(
        &self,
        metrics: &crate::metrics::Metrics,
        policy: &Arc<crate::policy::rule::PolicyKey>,
        dropped: bool,
    ) {
        let Ok(mut m) = self.0.lock() else {
            return;
        };
        let key = (Arc::as_ptr(policy) as usize, dropped);
        if !m.counters.contains_key(&key) {
            if m.counters.len() >= STAGED_COUNTERS_MAX {
                m.counters.clear();
            }
            let labels = crate::metrics::StagedLabels {
                policy: policy.to_string(),
                verdict: STAGED_VERDICTS[dropped as usize].into(),
            };
            let c = metrics.staged_verdicts.get_or_create(&labels).clone();
            m.labelled.insert(labels.policy, policy.clone());
            m.counters.insert(key, (policy.clone(), c));
        }
        if let Some((_, c)) = m.counters.get(&key) {
            c.inc();
        }
    }

    /// Takes the series of the policies `known` says are gone out of the metric family (a
    /// deleted staged policy's counts would otherwise be exported for the agent's lifetime);
    /// returns how many policies went.
    pub fn prune(
        &self,
        metrics: &crate::metrics::Metrics,
        known: impl Fn(&crate::policy::rule::PolicyKey) -> bool,
    ) -> usize {
        let Ok(mut m) = self.0.lock() else {
            return 0;
        };
        let gone: Vec<String> = m
            .labelled
            .iter()
            .filter(|(_, k)| !known(k))
            .map(|(l, _)| l.clone())
            .collect();
        for policy in &gone {
            m.labelled.remove(policy);
            for verdict in STAGED_VERDICTS {
                metrics
                    .staged_verdicts
                    .remove(&crate::metrics::StagedLabels {
                        policy: policy.clone(),
                        verdict: verdict.into(),
                    });
            }
        }
        m.counters.retain(|_, (k, _)| known(k));
        gone.len()
    }
}

/// Endpoints' policies with the staged policies enforced (`Shared::staged`).
pub type StagedViews = Arc<
    dashmap::DashMap<u32, Arc<crate::policy::engine::StagedPolicy>, crate::hashing::RandomState>,
>;

impl FlowSink {
    /// Hubble's flow metrics of one record (its loss reports are not flows).
    fn hubble_metrics(&self, ev: &crate::datapath::events::VerdictEvent) {
        use crate::hubble::convert;
        if ev.lost.is_some() {
            return;
        }
        let m = &self.metrics;
        let (r#type, subtype, verdict) = convert::processed_labels(ev);
        let labels = crate::metrics::HubbleFlowLabels {
            r#type,
            subtype,
            verdict,
        };
        m.hubble_flows_processed.get_or_create(&labels).inc();
        if ev.verdict == "dropped" {
            let reason = convert::drop_reason(ev).as_str_name();
            let protocol = ev.protocol.clone();
            let labels = crate::metrics::HubbleDropLabels { reason, protocol };
            m.hubble_drops.get_or_create(&labels).inc();
        }
        if convert::event_type(ev).0 == convert::EVENT_POLICY_VERDICT {
            let labels = crate::metrics::HubblePolicyLabels {
                direction: ev.direction.clone(),
                r#match: ev.match_kind.clone().unwrap_or_default(),
                action: ev.verdict.clone(),
            };
            m.hubble_policy_verdicts.get_or_create(&labels).inc();
        }
    }

    /// A new connection's verdict with the staged policies that select its endpoint enforced,
    /// when it differs (`VerdictEvent::staged`), counted per staged policy.
    fn judge_staged(&self, ev: &mut crate::datapath::events::VerdictEvent) {
        if ev.match_kind.is_none() || self.staged.is_empty() {
            return;
        }
        let Some(view) = self.staged.get(&ev.endpoint).map(|v| v.clone()) else {
            return;
        };
        let Some((direction, protocol)) = ev.decision_inputs() else {
            return;
        };
        let allowed_now = ev.verdict == "forwarded";
        let Some(change) = view.judge(direction, ev.peer_identity, protocol, ev.port, allowed_now)
        else {
            return;
        };
        let dropped = change.verdict.verdict == "dropped";
        for p in change.responsible.iter() {
            self.staged_counters.inc(&self.metrics, p, dropped);
        }
        ev.staged = Some(change.verdict);
    }

    pub fn consume(&self, mut ev: crate::datapath::events::VerdictEvent) {
        ev.attribute(&self.cookies);
        ev.name_pods(|ip| self.pod_names.get(&ip).map(|n| n.clone()));
        if let Some(n) = ev.lost {
            tracing::warn!(
                lost = n,
                "verdict events lost: the datapath's ring buffer was full"
            );
            self.metrics.events_lost.inc_by(n);
        }
        self.policy_hits.record(&ev.policies, &ev.verdict);
        self.judge_staged(&mut ev);
        self.hubble_metrics(&ev);
        if let Some(m) = &ev.match_kind {
            self.metrics
                .policy_verdicts
                .get_or_create(&crate::metrics::VerdictLabels {
                    direction: ev.direction.clone(),
                    verdict: ev.verdict.clone(),
                    r#match: m.clone(),
                })
                .inc();
        }
        self.flows.publish(ev);
    }
}

/// Start-up phases and how long each took (the second seed's `bootstrapStats`): `init`,
/// `maps`, `restore`, `api`, `sync` (the initial policy sync), `regeneration` (every endpoint
/// realizing it). Shown on `/debug/startup`, in `status` and as
/// `ciliate_agent_bootstrap_seconds{scope}`.
#[derive(Debug, Default)]
pub struct Bootstrap {
    phases: Mutex<Vec<(String, f64)>>,
    /// When the initial sync started and when it ended (the two open phases).
    sync_started: Mutex<Option<std::time::Instant>>,
    synced: Mutex<Option<std::time::Instant>>,
}

impl Bootstrap {
    pub fn record(
        &self,
        scope: &str,
        took: std::time::Duration,
        metrics: &crate::metrics::Metrics,
    ) {
        metrics
            .bootstrap
            .get_or_create(&crate::metrics::ScopeLabels {
                scope: scope.to_string(),
            })
            .set(took.as_secs_f64());
        if let Ok(mut p) = self.phases.lock() {
            p.push((scope.to_string(), took.as_secs_f64()));
        }
    }

    pub fn sync_started(&self) {
        if let Ok(mut s) = self.sync_started.lock() {
            *s = Some(std::time::Instant::now());
        }
    }

    /// The initial sync is done: records `sync`.
    pub fn synced(&self, metrics: &crate::metrics::Metrics) {
        let now = std::time::Instant::now();
        let started = self.sync_started.lock().ok().and_then(|s| *s);
        if let (Some(s), Ok(mut done)) = (started, self.synced.lock()) {
            if done.is_none() {
                *done = Some(now);
                drop(done);
                self.record("sync", now - s, metrics);
            }
        }
    }

    /// Every endpoint realized the initial policy: records `regeneration`.
    pub fn ready(&self, metrics: &crate::metrics::Metrics) {
        if let Some(s) = self.synced.lock().ok().and_then(|s| *s) {
            let already = self
                .phases
                .lock()
                .map(|p| p.iter().any(|(k, _)| k == "regeneration"))
                .unwrap_or(true);
            if !already {
                self.record("regeneration", s.elapsed(), metrics);
            }
        }
    }

    /// `(scope, seconds)` in the order they finished.
    pub fn phases(&self) -> Vec<(String, f64)> {
        self.phases.lock().map(|p| p.clone()).unwrap_or_default()
    }
}
