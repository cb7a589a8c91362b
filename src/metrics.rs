//! Prometheus metrics (prometheus-client), with the names `interfaces.md` section 3 fixes.

use std::sync::Mutex;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActorLabels {
    pub actor: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActorMessageLabels {
    pub actor: String,
    pub message: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

/// `ciliate_policy_verdicts_total` labels (bounded: 2 x 3 x 7 values).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabels {
    pub direction: String,
    pub verdict: String,
    pub r#match: String,
}

/// `hubble_flows_processed_total` labels, Hubble's names (bounded: 4 types x 3 subtypes x 3
/// verdicts).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HubbleFlowLabels {
    pub r#type: &'static str,
    pub subtype: &'static str,
    pub verdict: &'static str,
}

/// `hubble_drop_total` labels (bounded: 6 reasons x 5 protocols).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HubbleDropLabels {
    pub reason: &'static str,
    pub protocol: String,
}

/// `ciliate_policy_staged_verdicts_total` labels: a staged policy (`Kind ns/name`; as many as
/// staged policies, which only the cluster's administrators write) and the verdict it would give
/// (`dropped`, `forwarded`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StagedLabels {
    pub policy: String,
    pub verdict: String,
}

/// `hubble_policy_verdicts_total` labels (bounded: 2 directions x 8 matches x 3 actions).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HubblePolicyLabels {
    pub direction: String,
    pub r#match: String,
    pub action: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScopeLabels {
    pub scope: String,
}

/// Every metric the agent exports.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    pub resource: String,
}

pub struct Metrics {
    registry: Mutex<Registry>,
    pub policy_implementation_delay: Histogram,
    pub endpoint_regeneration: Histogram,
    pub policy_revision: Gauge,
    pub endpoints: Gauge,
    pub identities: Gauge,
    pub actor_mailbox: Family<ActorLabels, Gauge>,
    pub actor_messages_handled: Family<ActorMessageLabels, Counter>,
    pub regenerations: Family<OutcomeLabels, Counter>,
    pub policy_map_full: Counter,
    pub datapath_errors: Counter,
    pub policies_rejected: Gauge,
    /// Connection-tracking entries left after the last garbage-collection pass.
    pub conntrack_entries: Gauge,
    /// Connection-tracking entries removed as expired.
    pub conntrack_gc_removed: Counter,
    /// Kubernetes mode: watch events received and watch failures, by resource kind.
    pub k8s_watch_events: Family<ResourceLabels, Counter>,
    pub k8s_watch_errors: Family<ResourceLabels, Counter>,
    /// Kubernetes mode: CNP/CCNP status writes by outcome (`ok`, `error`).
    pub policy_status_writes: Family<OutcomeLabels, Counter>,
    /// Debug-server connections open now, and those closed at once because the cap was reached.
    pub debug_connections: Gauge,
    pub debug_connections_refused: Counter,
    /// Saved endpoints at start-up by what became of them (`restored`, `interface_gone`, ...).
    pub endpoint_restore: Family<OutcomeLabels, Counter>,
    /// Policy verdicts the datapath reported (drops, audits, new allowed connections).
    pub policy_verdicts: Family<VerdictLabels, Counter>,
    /// New connections whose verdict a staged policy would change, by policy and the verdict
    /// it would give.
    pub staged_verdicts: Family<StagedLabels, Counter>,
    /// Hubble's flow metrics, with Hubble's names and labels (Cilium's Grafana dashboards).
    pub hubble_flows_processed: Family<HubbleFlowLabels, Counter>,
    pub hubble_drops: Family<HubbleDropLabels, Counter>,
    pub hubble_policy_verdicts: Family<HubblePolicyLabels, Counter>,
    /// Verdict events the datapath's ring buffer had no room for.
    pub events_lost: Counter,
    /// Start-up phases: seconds each took (Cilium's `agent_bootstrap_seconds`).
    pub bootstrap: Family<ScopeLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// DNS queries the proxy decided, by verdict (`forwarded`, `refused`).
    pub dns_proxy_requests: Family<VerdictOnlyLabels, Counter>,
    /// Time the proxy spent on one query, without the upstream server's.
    pub dns_proxy_processing: Histogram,
    /// Names in the FQDN cache.
    pub fqdn_cache_entries: Gauge,
    /// Attribution cookies the agent can resolve (`CookieJar`), as of the loader's last check.
    pub attribution_cookies: Gauge,
    /// Attribution cookies swept: no endpoint's map held them at two sweeps in a row.
    pub attribution_cookies_swept: Counter,
    /// Address claims refused or outranked (`objects::addresses`): another node's slice naming
    /// this node's pod or a node address, a special address, an address outside its node's
    /// pod CIDRs.
    pub address_conflicts: Counter,
    /// FQDN cache entries evicted before their time, by reason (`policy::fqdn_bounds`).
    pub fqdn_cache_evictions: Family<ReasonLabels, Counter>,
    /// Failed writes of the identity-number journal (`endpoint::numbering`): a restart may
    /// renumber identities the kernel holds.
    pub identity_journal_errors: Counter,
    /// HTTP requests (and TLS connections) the HTTP proxy judged, by verdict.
    pub l7_requests: Family<VerdictOnlyLabels, Counter>,
    /// Time the HTTP proxy added to one request, without the server's.
    pub l7_proxy_latency: Histogram,
    /// Records of requests the HTTP proxy could not hand the agent (as it last said).
    pub l7_records_dropped: Gauge,
    /// Distinct connections in the flow history (`--flow-history`).
    pub flow_history_connections: Gauge,
    /// Flows the history did not record: its reader fell behind the flow broadcast.
    pub flow_history_missed: Counter,
    /// Connections the history forgot before `--flow-history` to stay within its bound.
    pub flow_history_evicted: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictOnlyLabels {
    pub verdict: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registry::default();
        // 100us .. ~100s
        let delay = Histogram::new(exponential_buckets(0.0001, 2.0, 20));
        let regen = Histogram::new(exponential_buckets(0.00001, 2.0, 22));
        let m = Metrics {
            registry: Mutex::new(Registry::default()),
            policy_implementation_delay: delay,
            endpoint_regeneration: regen,
            policy_revision: Gauge::default(),
            endpoints: Gauge::default(),
            identities: Gauge::default(),
            actor_mailbox: Family::default(),
            actor_messages_handled: Family::default(),
            regenerations: Family::default(),
            policy_map_full: Counter::default(),
            datapath_errors: Counter::default(),
            policies_rejected: Gauge::default(),
            conntrack_entries: Gauge::default(),
            conntrack_gc_removed: Counter::default(),
            k8s_watch_events: Family::default(),
            k8s_watch_errors: Family::default(),
            policy_status_writes: Family::default(),
            debug_connections: Gauge::default(),
            debug_connections_refused: Counter::default(),
            endpoint_restore: Family::default(),
            policy_verdicts: Family::default(),
            staged_verdicts: Family::default(),
            hubble_flows_processed: Family::default(),
            hubble_drops: Family::default(),
            hubble_policy_verdicts: Family::default(),
            events_lost: Counter::default(),
            bootstrap: Family::default(),
            // 10us .. ~5s
            dns_proxy_requests: Family::default(),
            dns_proxy_processing: Histogram::new(exponential_buckets(0.00001, 2.0, 20)),
            fqdn_cache_entries: Gauge::default(),
            attribution_cookies: Gauge::default(),
            attribution_cookies_swept: Counter::default(),
            flow_history_connections: Gauge::default(),
            flow_history_missed: Counter::default(),
            flow_history_evicted: Counter::default(),
            address_conflicts: Counter::default(),
            fqdn_cache_evictions: Family::default(),
            identity_journal_errors: Counter::default(),
            l7_requests: Family::default(),
            l7_proxy_latency: Histogram::new(exponential_buckets(0.000005, 2.0, 20)),
            l7_records_dropped: Gauge::default(),
        };
        r.register(
            "ciliate_l7_records_dropped",
            "Records of HTTP requests the HTTP proxy could not hand the agent since it started (no flow for them)",
            m.l7_records_dropped.clone(),
        );
        r.register(
            "ciliate_l7_requests",
            "HTTP requests (and TLS connections) the HTTP proxy judged, by verdict (forwarded, dropped, audit)",
            m.l7_requests.clone(),
        );
        r.register(
            "ciliate_l7_proxy_latency_seconds",
            "Time the HTTP proxy added to one request, without the server's",
            m.l7_proxy_latency.clone(),
        );
        r.register(
            "ciliate_identity_journal_errors",
            "Failed writes of the identity-number journal (STATE_DIR/identities.jsonl): a restart may renumber identities the kernel holds",
            m.identity_journal_errors.clone(),
        );
        r.register(
            "ciliate_fqdn_cache_evictions",
            "FQDN cache entries evicted before their time, by reason (ips_per_name, endpoint_names, names, zombies)",
            m.fqdn_cache_evictions.clone(),
        );
        r.register(
            "ciliate_address_conflicts",
            "Pod address claims not applied: refused (never a pod address, wrong pod CIDR) or held by a higher-ranked source (this node's pods, a node)",
            m.address_conflicts.clone(),
        );
        r.register(
            "ciliate_dns_proxy_requests",
            "DNS queries the DNS proxy decided, by verdict (forwarded, refused)",
            m.dns_proxy_requests.clone(),
        );
        r.register(
            "ciliate_dns_proxy_processing_seconds",
            "Time the DNS proxy spent on one query (decision, parsing, waiting for policy), without the upstream server's",
            m.dns_proxy_processing.clone(),
        );
        r.register(
            "ciliate_fqdn_cache_entries",
            "Names in the FQDN cache",
            m.fqdn_cache_entries.clone(),
        );
        r.register(
            "ciliate_attribution_cookies",
            "Attribution cookies the agent can resolve to policies (checked every 30 s)",
            m.attribution_cookies.clone(),
        );
        r.register(
            "ciliate_attribution_cookies_swept",
            "Attribution cookies removed: no endpoint's policy map held them at two sweeps in a row",
            m.attribution_cookies_swept.clone(),
        );
        r.register(
            "ciliate_agent_bootstrap_seconds",
            "Seconds each start-up phase took (init, maps, restore, ipam, api, sync, regeneration)",
            m.bootstrap.clone(),
        );
        r.register(
            "ciliate_flow_history_connections",
            "Distinct connections kept in the flow history (policy diff, policy recommend)",
            m.flow_history_connections.clone(),
        );
        r.register(
            "ciliate_flow_history_missed",
            "Flows the flow history did not record because its reader fell behind",
            m.flow_history_missed.clone(),
        );
        r.register(
            "ciliate_flow_history_evicted",
            "Connections the flow history forgot before --flow-history to stay within its bound",
            m.flow_history_evicted.clone(),
        );
        r.register(
            "ciliate_datapath_events_lost",
            "Verdict events lost because the datapath's ring buffer was full (also shown by `ciliate monitor`)",
            m.events_lost.clone(),
        );
        r.register(
            "ciliate_policy_verdicts",
            "Policy verdicts reported by the datapath (every drop and audit, the first packet of every new allowed connection), by direction, verdict and match",
            m.policy_verdicts.clone(),
        );
        r.register(
            "ciliate_policy_staged_verdicts",
            "New connections whose verdict staged policies (policy.ciliate.io/mode: audit) would change, by staged policy and the verdict it would give",
            m.staged_verdicts.clone(),
        );
        r.register(
            "hubble_flows_processed",
            "Flows processed, by Cilium's event type, subtype and verdict (Hubble's metric)",
            m.hubble_flows_processed.clone(),
        );
        r.register(
            "hubble_drop",
            "Dropped flows, by drop reason and protocol (Hubble's metric)",
            m.hubble_drops.clone(),
        );
        r.register(
            "hubble_policy_verdicts",
            "Policy verdicts, by direction, match and action (Hubble's metric)",
            m.hubble_policy_verdicts.clone(),
        );
        r.register(
            "ciliate_k8s_watch_events",
            "Kubernetes watch events received (list items included), by resource kind",
            m.k8s_watch_events.clone(),
        );
        r.register(
            "ciliate_k8s_watch_errors",
            "Kubernetes watch or list failures (each retried with backoff), by resource kind",
            m.k8s_watch_errors.clone(),
        );
        r.register(
            "ciliate_policy_status_writes",
            "CiliumNetworkPolicy/CiliumClusterwideNetworkPolicy status writes by outcome",
            m.policy_status_writes.clone(),
        );
        r.register(
            "ciliate_policy_implementation_delay_seconds",
            "Time from a policy change being accepted to every affected endpoint's datapath realizing it",
            m.policy_implementation_delay.clone(),
        );
        r.register(
            "ciliate_endpoint_regeneration_seconds",
            "Time one endpoint regeneration took (resolve, diff, datapath sync, state write)",
            m.endpoint_regeneration.clone(),
        );
        r.register(
            "ciliate_policy_revision",
            "Current policy repository revision",
            m.policy_revision.clone(),
        );
        r.register(
            "ciliate_endpoints",
            "Endpoints managed by this agent",
            m.endpoints.clone(),
        );
        r.register(
            "ciliate_identities",
            "Security identities allocated",
            m.identities.clone(),
        );
        r.register(
            "ciliate_actor_mailbox_messages",
            "Messages waiting in the mailboxes of the actors of a kind",
            m.actor_mailbox.clone(),
        );
        r.register(
            "ciliate_actor_messages_handled",
            "Messages handled, by actor kind and message",
            m.actor_messages_handled.clone(),
        );
        r.register(
            "ciliate_endpoint_regenerations",
            "Endpoint regenerations by outcome",
            m.regenerations.clone(),
        );
        r.register(
            "ciliate_policy_map_full",
            "Policy syncs refused because an endpoint's policy map was full (the endpoint fails closed)",
            m.policy_map_full.clone(),
        );
        r.register(
            "ciliate_datapath_errors",
            "Datapath operations that failed",
            m.datapath_errors.clone(),
        );
        r.register(
            "ciliate_policies_rejected",
            "Policies currently rejected by validation",
            m.policies_rejected.clone(),
        );
        r.register(
            "ciliate_conntrack_entries",
            "Connection-tracking entries after the last garbage-collection pass",
            m.conntrack_entries.clone(),
        );
        r.register(
            "ciliate_conntrack_gc_removed",
            "Connection-tracking entries removed because they expired",
            m.conntrack_gc_removed.clone(),
        );
        r.register(
            "ciliate_debug_connections",
            "Connections open on the debug HTTP server",
            m.debug_connections.clone(),
        );
        r.register(
            "ciliate_debug_connections_refused",
            "Debug HTTP connections closed as soon as accepted because --debug-max-connections were open",
            m.debug_connections_refused.clone(),
        );
        r.register(
            "ciliate_endpoint_restore",
            "Saved endpoints at start-up, by outcome: restored, or removed (interface_gone, netns_gone, pod_gone, duplicate_address), and stray pinned endpoints swept (stray_pins)",
            m.endpoint_restore.clone(),
        );
        if let Ok(mut reg) = m.registry.lock() {
            *reg = r;
        }
        m
    }

    /// Counts one saved endpoint's outcome at start-up.
    pub fn restore_outcome(&self, outcome: crate::endpoint::restore::Outcome) {
        self.endpoint_restore
            .get_or_create(&OutcomeLabels {
                outcome: outcome.label().into(),
            })
            .inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Ok(reg) = self.registry.lock() {
            let _ = encode(&mut out, &reg);
        }
        out
    }
}
