//! What the agent records of each policy: accepted at which revision, or rejected and why (and
//! whether an earlier version stays in force), with where it came from; and the manifest files
//! that could not be read. Shown on `/debug/policy` and by `ciliate policy get`. In Kubernetes
//! mode `k8s::status` writes the same outcomes into the policies' status.

use std::collections::BTreeMap;

use serde::Serialize;

use super::attribution::Hits;
use super::rule::PolicyKey;
use super::translate::ParsedPolicy;

/// A policy as `/debug/policy` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyStatus {
    pub kind: String,
    pub namespace: Option<String>,
    pub name: String,
    pub rules: usize,
    /// `accepted`, or `rejected: <error>`.
    pub status: String,
    /// Revision at which the enforced version was accepted.
    pub revision: u64,
    pub source: String,
    /// Partial enforcement (L7, FQDN, ...).
    pub notes: Vec<String>,
    pub warnings: Vec<String>,
    /// True when a rejected update left an earlier accepted version in force.
    pub previous_version_enforced: bool,
    /// Verdicts this policy decided since the agent started.
    #[serde(default)]
    pub hits: Hits,
}

impl PolicyStatus {
    /// The record of `key` before anything is known of it but where it came from.
    fn new(key: &PolicyKey, source: String) -> PolicyStatus {
        PolicyStatus {
            kind: key.kind.as_str().into(),
            namespace: key.namespace.clone(),
            name: key.name.clone(),
            rules: 0,
            status: String::new(),
            revision: 0,
            source,
            notes: vec![],
            warnings: vec![],
            previous_version_enforced: false,
            hits: Default::default(),
        }
    }

    pub fn is_accepted(&self) -> bool {
        self.status == "accepted"
    }
}

/// The records of every policy the agent was given, and the unreadable manifest files.
#[derive(Debug, Default)]
pub struct PolicyRecords {
    policies: BTreeMap<PolicyKey, PolicyStatus>,
    manifest_errors: BTreeMap<String, String>,
    /// How many of `policies` are rejected, kept as they change (the gauge is read after
    /// every change of the cluster, and a cluster has thousands of policies).
    rejected: usize,
}

impl PolicyRecords {
    /// `policy` passed validation (its revision follows, `enforced_from`). Returns whether the
    /// policy was known before (an update, not an addition).
    pub fn accepted(&mut self, policy: &ParsedPolicy, source: String) -> bool {
        let status = PolicyStatus {
            rules: policy.rules.len(),
            status: "accepted".into(),
            notes: policy.notes.clone(),
            warnings: policy.warnings.clone(),
            ..PolicyStatus::new(&policy.key, source)
        };
        let old = self.policies.insert((*policy.key).clone(), status);
        if old.as_ref().is_some_and(|p| !p.is_accepted()) {
            self.rejected -= 1;
        }
        old.is_some()
    }

    /// The accepted `key` holds from `revision`.
    pub fn enforced_from(&mut self, key: &PolicyKey, revision: u64) {
        if let Some(p) = self.policies.get_mut(key) {
            p.revision = revision;
        }
    }

    /// `key` failed validation; `enforced`: an earlier version stays in force.
    pub fn rejected(&mut self, key: &PolicyKey, error: &str, source: String, enforced: bool) {
        let was_rejected = self.policies.get(key).is_some_and(|p| !p.is_accepted());
        if !was_rejected {
            self.rejected += 1;
        }
        let entry = self
            .policies
            .entry(key.clone())
            .or_insert_with(|| PolicyStatus::new(key, source.clone()));
        entry.status = format!("rejected: {error}");
        entry.source = source;
        entry.previous_version_enforced = enforced;
    }

    pub fn deleted(&mut self, key: &PolicyKey) {
        if self.policies.remove(key).is_some_and(|p| !p.is_accepted()) {
            self.rejected -= 1;
        }
    }

    /// A manifest file was read (`None`) or could not be (its objects stay as they were).
    pub fn manifest(&mut self, file: String, error: Option<String>) {
        match error {
            Some(e) => self.manifest_errors.insert(file, e),
            None => self.manifest_errors.remove(&file),
        };
    }

    pub fn rejected_count(&self) -> usize {
        debug_assert_eq!(
            self.rejected,
            self.policies.values().filter(|p| !p.is_accepted()).count()
        );
        self.rejected
    }

    pub fn policies(&self) -> impl Iterator<Item = &PolicyStatus> {
        self.policies.values()
    }

    pub fn manifest_errors(&self) -> &BTreeMap<String, String> {
        &self.manifest_errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::translate::parse_policy;

    fn parsed(name: &str) -> ParsedPolicy {
        let doc: serde_yaml::Value = serde_yaml::from_str(&format!(
            "apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {{name: {name}, namespace: x}}\nspec: {{endpointSelector: {{}}, ingress: [{{}}]}}\n"
        ))
        .unwrap();
        parse_policy(&doc, "default", "test").unwrap()
    }

    #[test]
    fn a_rejected_update_keeps_the_record_and_says_the_old_version_holds() {
        let mut book = PolicyRecords::default();
        let p = parsed("p");
        assert!(!book.accepted(&p, "a.yaml".into()), "added");
        assert!(book.accepted(&p, "a.yaml".into()), "updated");
        book.enforced_from(&p.key, 4);
        book.rejected(&p.key, "bad port", "b.yaml".into(), true);
        let r = book.policies().next().unwrap();
        assert_eq!(
            (r.status.as_str(), r.revision, r.rules, r.source.as_str()),
            ("rejected: bad port", 4, 1, "b.yaml")
        );
        assert!(r.previous_version_enforced);
        assert_eq!(book.rejected_count(), 1);
        book.deleted(&p.key);
        assert_eq!(book.policies().count(), 0);
    }

    #[test]
    fn manifest_errors_come_and_go_by_file() {
        let mut book = PolicyRecords::default();
        book.manifest("a.yaml".into(), Some("not YAML".into()));
        assert_eq!(book.manifest_errors().len(), 1);
        book.manifest("a.yaml".into(), None);
        assert!(book.manifest_errors().is_empty());
    }
}
