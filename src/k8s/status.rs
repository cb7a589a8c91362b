//! Policy status in Kubernetes mode: each agent records in every CiliumNetworkPolicy and
//! CiliumClusterwideNetworkPolicy whether its node enforces the policy, at which revision, or why
//! it rejected it (`status.nodes.<node>`), plus the `Valid` condition.
//!
//! The actors report what happens ([`PolicyStatusEvent`], through a [`PolicyStatusSink`] kept in
//! `Shared`); [`run_status_writer`] turns that into merge patches of the status subresource.
//! Writes are rate-limited: one write per policy at most every `per_policy_interval` (changes in
//! between are coalesced into the next write) and at most `max_writes_per_second` overall, so a
//! burst of policy edits or an agent start with a thousand policies never floods the API server.
//! A write that fails is retried with backoff; a policy that is gone (404) is forgotten.
//!
//! "Enforcing" follows the revisions: a policy accepted at revision `r` is enforced once the
//! fan-out of revision `r` (`RuleReactionActor`) has been realized by every endpoint it
//! affects. Policies accepted before the initial sync are enforced once the initial sync's
//! regeneration of every endpoint is done.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::json;

use super::crd::{ConditionStatus, PolicyCondition, PolicyNodeStatus, CONDITION_VALID};
use crate::kinds::Family;
use crate::policy::rule::{PolicyKey, TierPlace};

/// The condition type of a cluster tier's policy (network-policy-api) saying whether ciliate
/// accepted it; its message is the validation error with its field path.
pub const CONDITION_ACCEPTED: &str = "Accepted";
/// The condition type present while other policies share the policy's tier and priority; its
/// message says the order ciliate evaluates them in.
pub const CONDITION_SAME_PRIORITY: &str = "SamePriority";

/// Policies a `SamePriority` message names before it counts the rest.
const MAX_NAMES: usize = 10;
/// A condition message's length at most (the upstream schema allows 32,768; a longer one
/// would be refused, and retried, forever).
const MAX_MESSAGE: usize = 4096;

/// `message`, cut to `MAX_MESSAGE` bytes (on a character boundary) with a mark.
fn bounded(message: String) -> String {
    if message.len() <= MAX_MESSAGE {
        return message;
    }
    let mut end = MAX_MESSAGE - 20;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{} ... (truncated)", &message[..end])
}

/// What happened to a policy, as the status writer needs to know it.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyStatusEvent {
    /// The policy passed validation and holds from `revision` on.
    Accepted {
        key: PolicyKey,
        revision: u64,
        /// Parts enforced partially or not at all (fail closed), shown as annotations.
        notes: Vec<String>,
        /// A cluster tier's policy: its tier and priority (for the same-priority condition).
        place: Option<TierPlace>,
    },
    /// The policy failed validation; `previous_enforced` when an earlier version stays in force.
    Rejected {
        key: PolicyKey,
        error: String,
        previous_enforced: bool,
    },
    /// The policy was deleted: nothing more to write.
    Deleted { key: PolicyKey },
    /// Every endpoint affected by the change at `revision` realized it (`all_ok`: without a
    /// failure). `initial`: the initial sync's regeneration of every endpoint, which covers every
    /// revision up to `revision`.
    Realized {
        revision: u64,
        all_ok: bool,
        initial: bool,
    },
}

/// Where the actors send [`PolicyStatusEvent`]s. Cloning is cheap; sending never blocks.
#[derive(Debug, Clone)]
pub struct PolicyStatusSink(tokio::sync::mpsc::UnboundedSender<PolicyStatusEvent>);

impl PolicyStatusSink {
    /// A sink and the receiver [`run_status_writer`] consumes.
    pub fn channel() -> (
        PolicyStatusSink,
        tokio::sync::mpsc::UnboundedReceiver<PolicyStatusEvent>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (PolicyStatusSink(tx), rx)
    }

    pub fn report(&self, event: PolicyStatusEvent) {
        // The writer only stops when the agent does.
        let _ = self.0.send(event);
    }
}

/// How often the writer may write.
#[derive(Debug, Clone)]
pub struct WriterOptions {
    /// At most one write per policy this often; changes in between are coalesced.
    pub per_policy_interval: Duration,
    /// At most this many writes per second overall.
    pub max_writes_per_second: u32,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            per_policy_interval: Duration::from_millis(500),
            max_writes_per_second: 50,
        }
    }
}

/// The status one policy should have, and how writing it goes.
#[derive(Debug, Clone)]
struct Entry {
    node: PolicyNodeStatus,
    valid: (ConditionStatus, String, String),
    /// When `valid.0` last changed.
    transition: String,
    /// The accepted revision not yet known to be realized.
    awaiting: Option<u64>,
    /// A cluster tier's policy in force: its tier and priority.
    place: Option<TierPlace>,
    /// The notes of the version in force (cluster tiers: the `Accepted` message).
    notes: Vec<String>,
    dirty: bool,
    last_write: Option<Instant>,
    /// Do not try before this (backoff after a failed write).
    not_before: Instant,
    failures: u32,
}

fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// The writer's bookkeeping, without I/O (unit-tested on its own).
#[derive(Debug, Default)]
pub struct StatusBook {
    entries: HashMap<PolicyKey, Entry>,
    /// The per-node policies whose `awaiting` is set: what a `Realized` event looks at (every
    /// revision realized, a hundred a second under pod churn, walked every policy: 4.6 % of
    /// the agent's CPU during the k8s bench's churn at 2,000 CNPs).
    awaiting: rustc_hash::FxHashSet<PolicyKey>,
    /// The initial sync has been realized; earlier `Realized` events are not about endpoints.
    synced: bool,
}

/// A policy whose status tells this node's enforcement (Cilium's kinds; cluster tiers' status
/// has no per-node enforcement to update).
fn per_node(k: &PolicyKey) -> bool {
    k.kind.family() == Some(Family::Cilium)
}

impl StatusBook {
    /// Takes one event in. False: it marked no policy for a write (a `Realized` no policy
    /// awaited), so the writer need not look for any.
    pub fn apply(&mut self, event: PolicyStatusEvent) -> bool {
        match event {
            PolicyStatusEvent::Accepted {
                key,
                revision,
                notes,
                place,
            } => {
                if !has_status(&key) {
                    return false;
                }
                let old = self.entries.get(&key).and_then(|e| e.place);
                self.touch_places([old, place]);
                let e = self.entry(key.clone());
                e.place = place;
                e.notes = notes.clone();
                let annotations: BTreeMap<String, String> = notes
                    .into_iter()
                    .enumerate()
                    .map(|(i, n)| (format!("ciliate.io/note-{i}"), n))
                    .collect();
                let e = self.entry(key.clone());
                e.node = PolicyNodeStatus {
                    ok: true,
                    error: None,
                    enforcing: false,
                    local_policy_revision: revision as i64,
                    last_updated: String::new(),
                    annotations,
                };
                e.awaiting = Some(revision);
                set_valid(e, ConditionStatus::True, "Accepted", "");
                e.dirty = true;
                if per_node(&key) {
                    self.awaiting.insert(key);
                }
            }
            PolicyStatusEvent::Rejected {
                key,
                error,
                previous_enforced,
            } => {
                if !has_status(&key) {
                    return false;
                }
                let e = self.entry(key.clone());
                e.node.ok = false;
                e.node.error = Some(error.clone());
                // An earlier accepted version keeps being enforced (at its revision).
                e.node.enforcing = previous_enforced && e.node.enforcing;
                if !previous_enforced {
                    e.awaiting = None;
                    self.awaiting.remove(&key);
                    let e = self.entry(key);
                    e.node.local_policy_revision = 0;
                    // Nothing of it is in force: it shares no priority any more.
                    let old = e.place.take();
                    e.notes.clear();
                    set_valid(e, ConditionStatus::False, "Invalid", &error);
                    e.dirty = true;
                    self.touch_places([old, None]);
                    return true;
                }
                set_valid(e, ConditionStatus::False, "Invalid", &error);
                e.dirty = true;
            }
            PolicyStatusEvent::Deleted { key } => {
                self.awaiting.remove(&key);
                let old = self.entries.remove(&key).and_then(|e| e.place);
                self.touch_places([old, None]);
            }
            PolicyStatusEvent::Realized {
                revision,
                all_ok,
                initial,
            } => {
                if initial {
                    self.synced = true;
                } else if !self.synced {
                    return false;
                }
                let mut marked = false;
                let entries = &mut self.entries;
                self.awaiting.retain(|k| {
                    let Some(e) = entries.get_mut(k) else {
                        return false;
                    };
                    let hit = match e.awaiting {
                        Some(r) if initial => r <= revision,
                        Some(r) => r == revision,
                        None => false,
                    };
                    if hit {
                        e.awaiting = None;
                        e.node.enforcing = all_ok;
                        if !all_ok {
                            e.node.error = Some(
                                "some endpoints failed to realize this revision (see the agent's /debug/endpoints)"
                                    .into(),
                            );
                        }
                        e.dirty = true;
                        marked = true;
                    }
                    !hit
                });
                return marked;
            }
        }
        true
    }

    /// Some policy is marked for a write (due now or later).
    fn any_dirty(&self) -> bool {
        self.entries.values().any(|e| e.dirty)
    }

    fn entry(&mut self, key: PolicyKey) -> &mut Entry {
        self.entries.entry(key).or_insert_with(|| Entry {
            node: PolicyNodeStatus::default(),
            valid: (ConditionStatus::False, String::new(), String::new()),
            transition: String::new(),
            awaiting: None,
            place: None,
            notes: Vec::new(),
            dirty: false,
            last_write: None,
            not_before: Instant::now(),
            failures: 0,
        })
    }

    /// The policies due for a write now, at most `limit`.
    fn due(&self, now: Instant, options: &WriterOptions, limit: usize) -> Vec<PolicyKey> {
        let mut due: Vec<(&PolicyKey, Option<Instant>)> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                e.dirty
                    && e.not_before <= now
                    && e.last_write
                        .is_none_or(|t| now.duration_since(t) >= options.per_policy_interval)
            })
            .map(|(k, e)| (k, e.last_write))
            .collect();
        // Never-written first, then the longest waiting: only the first `limit` are put in
        // order (this runs every tick, over every policy while writes are pending).
        if due.len() > limit {
            due.select_nth_unstable_by_key(limit, |(_, t)| *t);
            due.truncate(limit);
        }
        due.sort_by_key(|(_, t)| *t);
        due.into_iter()
            .take(limit)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Marks every entry at these places for a write (who shares their priority changed).
    fn touch_places(&mut self, places: [Option<TierPlace>; 2]) {
        for e in self.entries.values_mut() {
            if e.place.is_some() && places.contains(&e.place) {
                e.dirty = true;
            }
        }
    }

    /// The other policies in force at `key`'s tier and priority, in ciliate's order
    /// (`PolicyKey`'s: kind, then name), `key` among them.
    fn same_priority(&self, key: &PolicyKey) -> Vec<&PolicyKey> {
        let Some(place) = self.entries.get(key).and_then(|e| e.place) else {
            return Vec::new();
        };
        let mut keys: Vec<&PolicyKey> = self
            .entries
            .iter()
            .filter(|(_, e)| e.place == Some(place))
            .map(|(k, _)| k)
            .collect();
        keys.sort();
        if keys.len() < 2 {
            keys.clear();
        }
        keys
    }

    /// The merge patch for a policy's status: per family (`patch`).
    fn patch(&mut self, key: &PolicyKey, node_name: &str) -> Option<serde_json::Value> {
        match key.kind.family() {
            Some(Family::NetworkPolicyApi) => self.tier_patch(key),
            _ => self.cilium_patch(key, node_name),
        }
    }

    /// A cluster tier's status: `metav1.Condition`s only, the same on every node (validation
    /// and the same-priority order depend on the policies alone), so that agents writing the
    /// whole list in turn agree.
    fn tier_patch(&mut self, key: &PolicyKey) -> Option<serde_json::Value> {
        let ties = self.same_priority(key);
        let e = self.entries.get(key)?;
        let message = if e.valid.0 == ConditionStatus::True {
            e.notes.join("; ")
        } else {
            e.valid.2.clone()
        };
        let mut conditions = vec![json!({
            "type": CONDITION_ACCEPTED,
            "status": e.valid.0,
            "reason": if e.valid.0 == ConditionStatus::True { "Accepted" } else { "Invalid" },
            "message": bounded(message),
            "lastTransitionTime": e.transition,
        })];
        if let Some(place) = e.place.filter(|_| !ties.is_empty()) {
            // Bounded: a thousand policies may share a priority.
            let mut names: Vec<String> =
                ties.iter().take(MAX_NAMES).map(|k| k.to_string()).collect();
            if ties.len() > MAX_NAMES {
                names.push(format!("{} more", ties.len() - MAX_NAMES));
            }
            if let Some(at) = ties
                .iter()
                .position(|k| *k == key)
                .filter(|&i| i >= MAX_NAMES)
            {
                names.push(format!("... {key} is number {} of them", at + 1));
            }
            conditions.push(json!({
                "type": CONDITION_SAME_PRIORITY,
                "status": ConditionStatus::True,
                "reason": "SamePriority",
                "message": bounded(format!(
                    "{} policies share tier {} priority {}; ciliate evaluates them by kind \
                     (AdminNetworkPolicy, BaselineAdminNetworkPolicy, ClusterNetworkPolicy), \
                     then name: {}",
                    ties.len(),
                    place.tier.as_str(),
                    place.priority,
                    names.join(", then ")
                )),
                "lastTransitionTime": now_rfc3339(),
            }));
        }
        Some(json!({"status": {"conditions": conditions}}))
    }

    /// A Cilium policy's status: this node's entry, and the `Valid` condition. Stamps
    /// `lastUpdated`.
    fn cilium_patch(&mut self, key: &PolicyKey, node_name: &str) -> Option<serde_json::Value> {
        let e = self.entries.get_mut(key)?;
        e.node.last_updated = now_rfc3339();
        let condition = PolicyCondition {
            type_: CONDITION_VALID.into(),
            status: e.valid.0,
            reason: e.valid.1.clone(),
            message: e.valid.2.clone(),
            last_transition_time: e.transition.clone(),
        };
        Some(json!({"status": {
            "nodes": {node_name: e.node},
            "conditions": [condition],
        }}))
    }

    fn written(&mut self, key: &PolicyKey, at: Instant) {
        if let Some(e) = self.entries.get_mut(key) {
            e.dirty = false;
            e.last_write = Some(at);
            e.failures = 0;
        }
    }

    fn failed(&mut self, key: &PolicyKey, at: Instant) {
        if let Some(e) = self.entries.get_mut(key) {
            e.failures += 1;
            let backoff = Duration::from_millis(200) * 2u32.pow(e.failures.min(8));
            e.not_before = at + backoff.min(Duration::from_secs(30));
        }
    }
}

fn has_status(key: &PolicyKey) -> bool {
    key.kind.has_status()
}

fn set_valid(e: &mut Entry, status: ConditionStatus, reason: &str, message: &str) {
    if e.transition.is_empty() || e.valid.0 != status {
        e.transition = now_rfc3339();
    }
    e.valid = (status, reason.into(), message.into());
}

/// The API of the key's kind (`has_status` kinds only: they are in the registry).
fn api_for(client: &kube::Client, key: &PolicyKey) -> Option<Api<DynamicObject>> {
    let resource = super::api_resource(key.kind.info()?);
    Some(match &key.namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    })
}

/// Writes policy status until every sink is dropped.
pub async fn run_status_writer(
    client: kube::Client,
    node_name: String,
    mut events: tokio::sync::mpsc::UnboundedReceiver<PolicyStatusEvent>,
    options: WriterOptions,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
) {
    let outcome = |o: &str| {
        metrics
            .policy_status_writes
            .get_or_create(&crate::metrics::OutcomeLabels {
                outcome: o.to_string(),
            })
            .inc();
    };
    const TICK: Duration = Duration::from_millis(50);
    let per_tick =
        ((options.max_writes_per_second as u64 * TICK.as_millis() as u64) / 1000).max(1) as usize;
    let mut book = StatusBook::default();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Ticks only while some policy is marked for a write: at rest (and under pod churn, whose
    // `Realized` events mark nothing) the writer neither wakes nor walks every policy, where
    // it did both 20 times a second (a quarter of the idle agent's CPU at 2,000 CNPs).
    let mut pending = false;
    loop {
        tokio::select! {
            ev = events.recv() => match ev {
                Some(ev) => pending |= book.apply(ev),
                None => return,
            },
            _ = tick.tick(), if pending => {
                for key in book.due(Instant::now(), &options, per_tick) {
                    let Some(patch) = book.patch(&key, &node_name) else { continue };
                    let Some(api) = api_for(&client, &key) else { continue };
                    match api
                        .patch_status(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    {
                        Ok(_) => {
                            outcome("ok");
                            book.written(&key, Instant::now());
                        }
                        Err(kube::Error::Api(s)) if s.code == 404 => {
                            tracing::debug!(policy = %key, "policy gone before its status was written");
                            book.entries.remove(&key);
                        }
                        Err(e) => {
                            outcome("error");
                            tracing::warn!(policy = %key, error = %e, "cannot write the policy status; retrying");
                            book.failed(&key, Instant::now());
                        }
                    }
                }
                // Still marked: not yet due (the rate, a backoff) or beyond this tick's share.
                pending = book.any_dirty();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::rule::PolicyKind;

    fn cnp(name: &str) -> PolicyKey {
        PolicyKey::new(PolicyKind::CiliumNetworkPolicy, Some("x"), name)
    }

    fn accepted(name: &str, revision: u64) -> PolicyStatusEvent {
        PolicyStatusEvent::Accepted {
            key: cnp(name),
            revision,
            notes: vec![],
            place: None,
        }
    }

    fn realized(revision: u64, initial: bool) -> PolicyStatusEvent {
        PolicyStatusEvent::Realized {
            revision,
            all_ok: true,
            initial,
        }
    }

    fn node_status(book: &mut StatusBook, name: &str) -> serde_json::Value {
        book.patch(&cnp(name), "n1").expect("entry")["status"]["nodes"]["n1"].clone()
    }

    #[test]
    fn only_events_that_mark_a_policy_keep_the_writer_ticking() {
        let mut book = StatusBook::default();
        let options = WriterOptions::default();
        assert!(!book.any_dirty());
        assert!(
            !book.apply(realized(1, true)),
            "no policy awaited the initial sync"
        );
        assert!(book.apply(accepted("a", 3)));
        assert!(book.any_dirty());
        let t0 = Instant::now();
        assert_eq!(book.due(t0, &options, 10), [cnp("a")]);
        for key in book.due(t0, &options, 10) {
            book.written(&key, t0);
        }
        assert!(!book.any_dirty(), "written: nothing to tick for");
        // Pod churn: revisions realized that no policy awaits mark nothing.
        assert!(!book.apply(realized(2, false)));
        assert!(!book.any_dirty());
        // The revision "a" awaits marks it (its enforcement to report).
        assert!(book.apply(realized(3, false)));
        assert!(book.any_dirty());
        assert_eq!(
            book.due(t0 + options.per_policy_interval, &options, 10),
            [cnp("a")]
        );
    }

    #[test]
    fn enforcing_follows_the_realized_revision() {
        let mut book = StatusBook::default();
        book.apply(accepted("a", 3));
        // Before the initial sync, realized fan-outs reached no endpoint yet.
        book.apply(realized(3, false));
        assert_eq!(node_status(&mut book, "a")["enforcing"], false);
        book.apply(realized(5, true));
        assert_eq!(node_status(&mut book, "a")["enforcing"], true);
        book.apply(accepted("a", 7));
        book.apply(accepted("b", 8));
        book.apply(realized(8, false));
        assert_eq!(node_status(&mut book, "a")["enforcing"], false);
        assert_eq!(node_status(&mut book, "b")["enforcing"], true);
        assert_eq!(node_status(&mut book, "b")["localPolicyRevision"], 8);
        book.apply(realized(7, false));
        assert_eq!(node_status(&mut book, "a")["enforcing"], true);
    }

    #[test]
    fn a_realized_revision_looks_only_at_the_policies_awaiting_one() {
        let mut book = StatusBook::default();
        book.apply(realized(1, true));
        book.apply(accepted("a", 3));
        book.apply(accepted("b", 4));
        book.apply(accepted("c", 5));
        assert_eq!(book.awaiting.len(), 3);
        book.apply(realized(4, false));
        assert_eq!(book.awaiting.len(), 2, "b is enforced: no longer looked at");
        assert_eq!(node_status(&mut book, "b")["enforcing"], true);
        book.apply(PolicyStatusEvent::Deleted { key: cnp("a") });
        book.apply(PolicyStatusEvent::Rejected {
            key: cnp("c"),
            error: "bad".into(),
            previous_enforced: false,
        });
        assert!(
            book.awaiting.is_empty(),
            "deleted and rejected await nothing"
        );
        // A rejected edit of an enforced policy keeps what it awaited.
        book.apply(accepted("d", 6));
        book.apply(PolicyStatusEvent::Rejected {
            key: cnp("d"),
            error: "bad".into(),
            previous_enforced: true,
        });
        assert_eq!(book.awaiting.len(), 1);
        book.apply(realized(6, false));
        assert!(book.awaiting.is_empty());
        // Cluster tiers have no per-node enforcement: never awaited.
        book.apply(PolicyStatusEvent::Accepted {
            key: PolicyKey::new(PolicyKind::ClusterNetworkPolicy, None, "t"),
            revision: 7,
            notes: vec![],
            place: None,
        });
        assert!(book.awaiting.is_empty());
    }

    #[test]
    fn rejection_sets_the_error_and_the_valid_condition() {
        let mut book = StatusBook::default();
        book.apply(PolicyStatusEvent::Rejected {
            key: cnp("bad"),
            error: "spec.ingress[0].fromCIDR[0]: \"nope\" is not a CIDR".into(),
            previous_enforced: false,
        });
        let patch = book.patch(&cnp("bad"), "n1").unwrap();
        let node = &patch["status"]["nodes"]["n1"];
        assert_eq!(node["ok"], false);
        assert_eq!(node["enforcing"], false);
        assert!(node["error"].as_str().unwrap().contains("fromCIDR[0]"));
        let cond = &patch["status"]["conditions"][0];
        assert_eq!(cond["type"], "Valid");
        assert_eq!(cond["status"], "False");
        assert!(cond["message"].as_str().unwrap().contains("not a CIDR"));
    }

    #[test]
    fn writes_are_coalesced_per_policy_and_limited_overall() {
        let options = WriterOptions {
            per_policy_interval: Duration::from_secs(1),
            max_writes_per_second: 10,
        };
        let mut book = StatusBook::default();
        for i in 0..5 {
            book.apply(accepted(&format!("p{i}"), i + 1));
        }
        let t0 = Instant::now();
        assert_eq!(book.due(t0, &options, 3).len(), 3, "the overall limit");
        for k in book.due(t0, &options, 10) {
            book.written(&k, t0);
        }
        assert!(book.due(t0, &options, 10).is_empty(), "nothing left dirty");
        book.apply(accepted("p0", 9));
        assert!(
            book.due(t0 + Duration::from_millis(500), &options, 10)
                .is_empty(),
            "p0 was written less than a second ago"
        );
        assert_eq!(
            book.due(t0 + Duration::from_secs(1), &options, 10),
            vec![cnp("p0")]
        );
        // Under the limit, the never-written come first, then the longest waiting.
        for (i, at) in [(1, 3), (2, 1), (3, 4), (4, 2)] {
            book.written(&cnp(&format!("p{i}")), t0 + Duration::from_secs(at));
            book.apply(accepted(&format!("p{i}"), 20 + i));
        }
        book.apply(accepted("p5", 30));
        let later = t0 + Duration::from_secs(10);
        assert_eq!(
            book.due(later, &options, 3),
            vec![cnp("p5"), cnp("p0"), cnp("p2")]
        );
        assert_eq!(book.due(later, &options, 1), vec![cnp("p5")]);
    }

    #[test]
    fn network_policies_have_no_status_to_write() {
        let mut book = StatusBook::default();
        book.apply(PolicyStatusEvent::Accepted {
            key: PolicyKey::new(PolicyKind::NetworkPolicy, Some("x"), "np"),
            revision: 1,
            notes: vec![],
            place: None,
        });
        assert!(book.entries.is_empty());
    }

    fn anp(name: &str) -> PolicyKey {
        PolicyKey::new(PolicyKind::AdminNetworkPolicy, None, name)
    }

    fn tier_accepted(key: PolicyKey, priority: u32, revision: u64) -> PolicyStatusEvent {
        PolicyStatusEvent::Accepted {
            key,
            revision,
            notes: vec![],
            place: Some(TierPlace {
                tier: crate::policy::rule::Tier::Admin,
                priority,
            }),
        }
    }

    fn conditions(book: &mut StatusBook, key: &PolicyKey) -> Vec<serde_json::Value> {
        let patch = book.patch(key, "n1").expect("entry");
        assert!(
            patch["status"].get("nodes").is_none(),
            "a cluster tier's status has conditions only: {patch}"
        );
        patch["status"]["conditions"].as_array().unwrap().clone()
    }

    #[test]
    fn cluster_tiers_get_accepted_or_the_field_that_is_wrong() {
        let mut book = StatusBook::default();
        book.apply(tier_accepted(anp("ok"), 10, 1));
        let c = conditions(&mut book, &anp("ok"));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0]["type"], "Accepted");
        assert_eq!(c[0]["status"], "True");
        assert_eq!(c[0]["reason"], "Accepted");
        for field in ["message", "lastTransitionTime"] {
            assert!(c[0][field].is_string(), "{field} is required upstream");
        }
        book.apply(PolicyStatusEvent::Rejected {
            key: anp("bad"),
            error: "spec.priority: 1001 is above 1000".into(),
            previous_enforced: false,
        });
        let c = conditions(&mut book, &anp("bad"));
        assert_eq!(c[0]["status"], "False");
        assert_eq!(c[0]["reason"], "Invalid");
        assert_eq!(c[0]["message"], "spec.priority: 1001 is above 1000");
        // Realized revisions concern per-node status only: no write for tiers.
        for k in book.due(Instant::now(), &WriterOptions::default(), 10) {
            book.written(&k, Instant::now());
        }
        book.apply(realized(1, true));
        assert!(book
            .due(
                Instant::now() + Duration::from_secs(1),
                &WriterOptions::default(),
                10
            )
            .is_empty());
    }

    #[test]
    fn policies_sharing_a_priority_say_so_and_the_order_until_they_no_longer_do() {
        let mut book = StatusBook::default();
        let cnp = PolicyKey::new(PolicyKind::ClusterNetworkPolicy, None, "a-cnp");
        book.apply(tier_accepted(anp("b"), 10, 1));
        book.apply(tier_accepted(cnp.clone(), 10, 2));
        book.apply(tier_accepted(anp("c"), 20, 3));
        let later = Instant::now() + Duration::from_secs(1);
        for k in book.due(later, &WriterOptions::default(), 10) {
            book.written(&k, later);
        }
        book.apply(tier_accepted(anp("a"), 10, 4));
        let options = WriterOptions::default();
        let mut due = book.due(later + Duration::from_secs(1), &options, 10);
        due.sort();
        assert_eq!(due, vec![anp("a"), anp("b"), cnp.clone()], "c is elsewhere");
        for key in [anp("a"), anp("b"), cnp.clone()] {
            let c = conditions(&mut book, &key);
            assert_eq!(c[1]["type"], "SamePriority", "{key}");
            assert_eq!(
                c[1]["message"],
                "3 policies share tier Admin priority 10; ciliate evaluates them by kind \
                 (AdminNetworkPolicy, BaselineAdminNetworkPolicy, ClusterNetworkPolicy), then \
                 name: AdminNetworkPolicy a, then AdminNetworkPolicy b, then \
                 ClusterNetworkPolicy a-cnp"
            );
        }
        assert_eq!(conditions(&mut book, &anp("c")).len(), 1);
        // b moves away and a is deleted: the CNP shares its priority with nobody.
        book.apply(tier_accepted(anp("b"), 30, 5));
        book.apply(PolicyStatusEvent::Deleted { key: anp("a") });
        assert_eq!(conditions(&mut book, &cnp).len(), 1);
        assert_eq!(conditions(&mut book, &anp("b")).len(), 1);
        // A rejected version with nothing in force shares nothing either.
        book.apply(tier_accepted(anp("d"), 30, 6));
        assert_eq!(conditions(&mut book, &anp("b")).len(), 2);
        book.apply(PolicyStatusEvent::Rejected {
            key: anp("d"),
            error: "spec.subject: required".into(),
            previous_enforced: false,
        });
        assert_eq!(conditions(&mut book, &anp("b")).len(), 1);
    }

    #[test]
    fn condition_messages_stay_bounded() {
        let mut book = StatusBook::default();
        for i in 0..30 {
            book.apply(tier_accepted(anp(&format!("p{i:02}")), 7, i + 1));
        }
        let c = conditions(&mut book, &anp("p25"));
        let m = c[1]["message"].as_str().unwrap();
        assert!(
            m.starts_with("30 policies share tier Admin priority 7"),
            "{m}"
        );
        assert!(m.contains("AdminNetworkPolicy p09, then 20 more"), "{m}");
        assert!(!m.contains("AdminNetworkPolicy p10"), "{m}");
        assert!(
            m.ends_with("AdminNetworkPolicy p25 is number 26 of them"),
            "{m}"
        );
        book.apply(PolicyStatusEvent::Rejected {
            key: anp("long"),
            error: "é".repeat(10_000),
            previous_enforced: false,
        });
        let m = conditions(&mut book, &anp("long"))[0]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            m.len() <= MAX_MESSAGE && m.ends_with("(truncated)"),
            "{}",
            m.len()
        );
    }
}
