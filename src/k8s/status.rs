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
use crate::policy::rule::PolicyKey;

/// What happened to a policy, as the status writer needs to know it.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyStatusEvent {
    /// The policy passed validation and holds from `revision` on.
    Accepted {
        key: PolicyKey,
        revision: u64,
        /// Parts enforced partially or not at all (fail closed), shown as annotations.
        notes: Vec<String>,
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
    /// The initial sync has been realized; earlier `Realized` events are not about endpoints.
    synced: bool,
}

impl StatusBook {
    pub fn apply(&mut self, event: PolicyStatusEvent) {
        match event {
            PolicyStatusEvent::Accepted {
                key,
                revision,
                notes,
            } => {
                if !has_status(&key) {
                    return;
                }
                let annotations: BTreeMap<String, String> = notes
                    .into_iter()
                    .enumerate()
                    .map(|(i, n)| (format!("ciliate.io/note-{i}"), n))
                    .collect();
                let e = self.entry(key);
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
            }
            PolicyStatusEvent::Rejected {
                key,
                error,
                previous_enforced,
            } => {
                if !has_status(&key) {
                    return;
                }
                let e = self.entry(key);
                e.node.ok = false;
                e.node.error = Some(error.clone());
                // An earlier accepted version keeps being enforced (at its revision).
                e.node.enforcing = previous_enforced && e.node.enforcing;
                if !previous_enforced {
                    e.awaiting = None;
                    e.node.local_policy_revision = 0;
                }
                set_valid(e, ConditionStatus::False, "Invalid", &error);
                e.dirty = true;
            }
            PolicyStatusEvent::Deleted { key } => {
                self.entries.remove(&key);
            }
            PolicyStatusEvent::Realized {
                revision,
                all_ok,
                initial,
            } => {
                if initial {
                    self.synced = true;
                } else if !self.synced {
                    return;
                }
                for e in self.entries.values_mut() {
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
                    }
                }
            }
        }
    }

    fn entry(&mut self, key: PolicyKey) -> &mut Entry {
        self.entries.entry(key).or_insert_with(|| Entry {
            node: PolicyNodeStatus::default(),
            valid: (ConditionStatus::False, String::new(), String::new()),
            transition: String::new(),
            awaiting: None,
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
        // Never-written first, then the longest waiting.
        due.sort_by_key(|(_, t)| *t);
        due.into_iter()
            .take(limit)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// The merge patch for a policy's status, stamping `lastUpdated`.
    fn patch(&mut self, key: &PolicyKey, node_name: &str) -> Option<serde_json::Value> {
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
    loop {
        tokio::select! {
            ev = events.recv() => match ev {
                Some(ev) => book.apply(ev),
                None => return,
            },
            _ = tick.tick() => {
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
    }

    #[test]
    fn network_policies_have_no_status_to_write() {
        let mut book = StatusBook::default();
        book.apply(PolicyStatusEvent::Accepted {
            key: PolicyKey::new(PolicyKind::NetworkPolicy, Some("x"), "np"),
            revision: 1,
            notes: vec![],
        });
        assert!(book.entries.is_empty());
    }
}
