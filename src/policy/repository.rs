//! The policy repository: rules keyed by the resource they came from, replaced whole on update,
//! with a revision counter bumped on every change and indexes by selector.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::rule::{PolicyKey, Rule, Subject};
use super::selector::SelectorRef;

/// What the repository keeps of one accepted policy resource.
#[derive(Debug, Clone)]
pub struct StoredPolicy {
    pub key: Arc<PolicyKey>,
    pub rules: Vec<Arc<Rule>>,
    /// Partial-enforcement notes (L7, FQDN, ...), for status.
    pub notes: Vec<String>,
}

/// Rules by resource, and indexes to find them by selector.
#[derive(Debug, Clone, Default)]
pub struct Repository {
    policies: BTreeMap<Arc<PolicyKey>, StoredPolicy>,
    revision: u64,
    /// Endpoint rules by their subject selector, each list in resolution order (policy key,
    /// then rule path: `rule_order`), so that resolving an endpoint merges sorted runs
    /// instead of sorting.
    by_subject: HashMap<SelectorRef, Vec<Arc<Rule>>>,
    /// Rules by every peer selector they use.
    by_peer: HashMap<SelectorRef, Vec<Arc<Rule>>>,
    /// Host (nodeSelector) rules; few, matched directly against node labels.
    host_rules: Vec<Arc<Rule>>,
}

/// The order rules apply in: by policy, then by rule path.
pub fn rule_order(a: &Rule, b: &Rule) -> std::cmp::Ordering {
    if Arc::ptr_eq(&a.policy, &b.policy) {
        a.path.cmp(&b.path)
    } else {
        a.policy.cmp(&b.policy)
    }
}

fn unindex(map: &mut HashMap<SelectorRef, Vec<Arc<Rule>>>, sel: &SelectorRef, rule: &Arc<Rule>) {
    if let Some(v) = map.get_mut(sel) {
        v.retain(|r| !Arc::ptr_eq(r, rule));
        if v.is_empty() {
            map.remove(sel);
        }
    }
}

impl Repository {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Replaces every rule of `policy.key` by `policy.rules`. Returns the new revision and
    /// what was stored before.
    pub fn upsert(&mut self, policy: StoredPolicy) -> (u64, Option<StoredPolicy>) {
        let old = self.remove_locked(&policy.key);
        for rule in &policy.rules {
            self.index(rule);
        }
        self.policies.insert(policy.key.clone(), policy);
        self.revision += 1;
        (self.revision, old)
    }

    /// Deletes a resource's rules. Returns the new revision and what was stored, or `None`
    /// (and no revision bump) when nothing was stored under `key`.
    pub fn delete(&mut self, key: &PolicyKey) -> Option<(u64, StoredPolicy)> {
        let old = self.remove_locked(key)?;
        self.revision += 1;
        Some((self.revision, old))
    }

    fn index(&mut self, rule: &Arc<Rule>) {
        match &rule.subject {
            Subject::Endpoints(s) => {
                let v = self.by_subject.entry(s.clone()).or_default();
                let at = v.partition_point(|r| rule_order(r, rule).is_lt());
                v.insert(at, rule.clone());
            }
            Subject::Nodes(_) => self.host_rules.push(rule.clone()),
        }
        for sel in rule.selectors().skip(1) {
            let v = self.by_peer.entry(sel.clone()).or_default();
            if !v.iter().any(|r| Arc::ptr_eq(r, rule)) {
                v.push(rule.clone());
            }
        }
    }

    /// Removes a resource without bumping the revision (callers bump once per change).
    fn remove_locked(&mut self, key: &PolicyKey) -> Option<StoredPolicy> {
        let old = self.policies.remove(key)?;
        for rule in &old.rules {
            match &rule.subject {
                Subject::Endpoints(s) => unindex(&mut self.by_subject, s, rule),
                Subject::Nodes(_) => self.host_rules.retain(|r| !Arc::ptr_eq(r, rule)),
            }
            for sel in rule.selectors().skip(1) {
                unindex(&mut self.by_peer, sel, rule);
            }
        }
        Some(old)
    }

    pub fn get(&self, key: &PolicyKey) -> Option<&StoredPolicy> {
        self.policies.get(key)
    }

    pub fn policies(&self) -> impl Iterator<Item = &StoredPolicy> {
        self.policies.values()
    }

    pub fn len(&self) -> usize {
        self.policies.len()
    }

    pub fn is_empty(&self) -> bool {
        self.policies.is_empty()
    }

    /// Endpoint rules whose subject is `sel`.
    pub fn rules_with_subject(&self, sel: &SelectorRef) -> &[Arc<Rule>] {
        self.by_subject.get(sel).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Rules that use `sel` as a peer selector.
    pub fn rules_with_peer(&self, sel: &SelectorRef) -> &[Arc<Rule>] {
        self.by_peer.get(sel).map(Vec::as_slice).unwrap_or(&[])
    }

    pub fn host_rules(&self) -> &[Arc<Rule>] {
        &self.host_rules
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::rule::PolicyKind;
    use crate::policy::selector::{LabelSelector, Requirement, Selector};

    fn stored(name: &str, app: &str) -> StoredPolicy {
        let key = Arc::new(PolicyKey::new(
            PolicyKind::CiliumNetworkPolicy,
            Some("x"),
            name,
        ));
        let subject = Selector::labels(LabelSelector::new(vec![Requirement::equals(
            None, "app", app,
        )]));
        StoredPolicy {
            key: key.clone(),
            rules: vec![Arc::new(Rule {
                policy: key,
                path: "spec".into(),
                subject: Subject::Endpoints(subject),
                isolates_ingress: true,
                isolates_egress: false,
                peer_rules: vec![],
                requires: vec![],
                tier: None,
                staged: false,
            })],
            notes: vec![],
        }
    }

    #[test]
    fn upsert_replaces_by_resource_and_bumps_revision() {
        let mut r = Repository::new();
        let (rev1, old) = r.upsert(stored("p", "a"));
        assert_eq!((rev1, old.is_none()), (1, true));
        let (rev2, old) = r.upsert(stored("p", "b"));
        assert_eq!(rev2, 2);
        assert!(old.is_some());
        assert_eq!(r.len(), 1);
        let a = Selector::labels(LabelSelector::new(vec![Requirement::equals(
            None, "app", "a",
        )]));
        let b = Selector::labels(LabelSelector::new(vec![Requirement::equals(
            None, "app", "b",
        )]));
        assert!(r.rules_with_subject(&a).is_empty());
        assert_eq!(r.rules_with_subject(&b).len(), 1);
    }

    #[test]
    fn delete_of_unknown_resource_changes_nothing() {
        let mut r = Repository::new();
        r.upsert(stored("p", "a"));
        let missing = PolicyKey::new(PolicyKind::CiliumNetworkPolicy, Some("x"), "nope");
        assert!(r.delete(&missing).is_none());
        assert_eq!(r.revision(), 1);
        let key = PolicyKey::new(PolicyKind::CiliumNetworkPolicy, Some("x"), "p");
        assert_eq!(r.delete(&key).map(|(rev, _)| rev), Some(2));
        assert!(r.is_empty());
    }
}
