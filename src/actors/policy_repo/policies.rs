//! Policies: upserts, rejections and deletes (each a reaction), and the status of
//! manifest files.

use super::*;
use crate::traceable;

// ------------------------------------------------------------------ policies

/// A policy was added or changed and passed validation.
#[derive(Debug, Message)]
#[rtype(result = "Result<u64, String>")]
pub struct PolicyUpsert {
    pub policy: ParsedPolicy,
    /// Where it came from (`file.yaml#0`, `k8s`).
    pub source: String,
}
traceable!(PolicyUpsert, "PolicyUpsert", |m| format!(
    "policy {}",
    m.policy.key
));

impl Handler<PolicyUpsert> for PolicyRepoActor {
    type Result = Result<u64, String>;
    fn handle(&mut self, msg: PolicyUpsert, _: &mut Context<Self>) -> Self::Result {
        let accepted_at = Instant::now();
        let key = (*msg.policy.key).clone();
        let notes = msg.policy.notes.clone();
        let place = msg.policy.rules.first().and_then(|r| r.tier);
        let known = self.statuses.accepted(&msg.policy, msg.source);
        let (generation, dropped) = self.fqdn_generation_and_rules(&key);
        let mut change = self.engine_mut().upsert_policy(msg.policy);
        self.follow_fqdn_selectors(generation, &mut change);
        self.shared
            .report_policy(crate::k8s::status::PolicyStatusEvent::Accepted {
                key: key.clone(),
                revision: change.revision,
                notes,
                place,
            });
        self.statuses.enforced_from(&key, change.revision);
        let ipcache = self.policy_ipcache(&change);
        self.react(
            Reaction::new(format!("policy {}", key.short()))
                .at(accepted_at)
                .affecting(change.affected.iter().copied())
                .ipcache(ipcache)
                .policy_change()
                .dropping(dropped)
                .notify(if known { "updated" } else { "added" }, &key),
        );
        Ok(change.revision)
    }
}

impl PolicyRepoActor {
    /// A policy change's ipcache updates: its CIDR identities, and the addresses of the nodes
    /// whose identity it moved (`nodes` peers naming other node labels:
    /// `policy::node_classes`), released after the regenerations that know the new identities.
    fn policy_ipcache(&mut self, change: &crate::policy::PolicyChange) -> Vec<IpcacheChange> {
        let mut out = ipcache_of(change);
        out.extend(self.indexed(|ix, e| ix.follow_moved_nodes(e)).ipcache);
        out
    }
}

/// A policy failed validation. An earlier accepted version (if any) stays in force.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct PolicyRejected {
    /// The policy, when its kind and name could be read.
    pub key: Option<PolicyKey>,
    pub error: String,
    pub source: String,
}
traceable!(PolicyRejected, "PolicyRejected", |m| m.error.clone());

impl Handler<PolicyRejected> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: PolicyRejected, _: &mut Context<Self>) {
        tracing::warn!(source = %msg.source, error = %msg.error, "policy rejected");
        let key = msg.key.unwrap_or_else(|| {
            PolicyKey::new(crate::policy::rule::PolicyKind::Builtin, None, &msg.source)
        });
        let enforced = self.engine().policy(&key).is_some();
        self.shared
            .report_policy(crate::k8s::status::PolicyStatusEvent::Rejected {
                key: key.clone(),
                error: msg.error.clone(),
                previous_enforced: enforced,
            });
        let notice = Notification::policy(
            "rejected",
            policy_ref(&key),
            None,
            None,
            Some(msg.error.clone()),
        );
        let _ = self.shared.notifications.send(notice);
        self.statuses
            .rejected(&key, &msg.error, msg.source, enforced);
        self.update_gauges();
    }
}

/// A policy was deleted.
#[derive(Debug, Message)]
#[rtype(result = "Result<u64, String>")]
pub struct PolicyDelete {
    pub key: PolicyKey,
}
traceable!(PolicyDelete, "PolicyDelete", |m| format!(
    "policy {}",
    m.key
));

impl Handler<PolicyDelete> for PolicyRepoActor {
    type Result = Result<u64, String>;
    fn handle(&mut self, msg: PolicyDelete, _: &mut Context<Self>) -> Self::Result {
        let accepted_at = Instant::now();
        self.statuses.deleted(&msg.key);
        self.shared
            .report_policy(crate::k8s::status::PolicyStatusEvent::Deleted {
                key: msg.key.clone(),
            });
        let (generation, dropped) = self.fqdn_generation_and_rules(&msg.key);
        let change = self.engine_mut().delete_policy(&msg.key);
        match change {
            Some(mut change) => {
                self.follow_fqdn_selectors(generation, &mut change);
                let ipcache = self.policy_ipcache(&change);
                self.react(
                    Reaction::new(format!("policy {} deleted", msg.key.short()))
                        .at(accepted_at)
                        .affecting(change.affected.iter().copied())
                        .ipcache(ipcache)
                        .policy_change()
                        .dropping(dropped)
                        .notify("deleted", &msg.key),
                );
                Ok(change.revision)
            }
            None => {
                self.update_gauges();
                Ok(self.engine().revision())
            }
        }
    }
}

/// A manifest file was read (error: `None`) or could not be (its objects stay as they were).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct ManifestStatus {
    pub file: String,
    pub error: Option<String>,
}
traceable!(ManifestStatus, "ManifestStatus", |m| format!(
    "{}: {}",
    m.file,
    m.error.as_deref().unwrap_or("ok")
));

impl Handler<ManifestStatus> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: ManifestStatus, _: &mut Context<Self>) {
        self.statuses.manifest(msg.file, msg.error);
    }
}
