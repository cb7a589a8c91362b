//! What both watchers (manifests and Kubernetes) do with Services and EndpointSlices, written
//! once: keep socket-level translation (`ServiceLb`) and the `toServices` tracker in step, and
//! say which `toServices` policies must be translated again. The watchers only parse objects
//! and send messages; `K` is how a watcher names a policy, `D` the document it keeps to
//! translate the policy again.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::policy_repo::ServiceUpsert;
use crate::objects::{EndpointSliceInfo, ServiceInfo};
use crate::policy::services::{ServiceTable, ServiceTracker};
use crate::services::ServiceLb;

pub struct ServicesFeed<K, D> {
    /// Services and their EndpointSlice backends, for `toServices`.
    tracker: ServiceTracker,
    /// Policies with `toServices`: translated again when a service or its backends change.
    policies: BTreeMap<K, D>,
    /// Service translation (`None`: not wired, e.g. some tests).
    lb: Option<Arc<ServiceLb>>,
}

/// The `ServiceInfo` a deleted Service is sent as.
fn deleted_service(namespace: &str, name: &str) -> ServiceInfo {
    ServiceInfo {
        namespace: namespace.into(),
        name: name.into(),
        labels: Default::default(),
        selector: Default::default(),
        cluster_ips: vec![],
        ports: vec![],
    }
}

impl<K: Ord + Clone, D: Clone> ServicesFeed<K, D> {
    pub fn new(lb: Option<Arc<ServiceLb>>) -> Self {
        ServicesFeed {
            tracker: ServiceTracker::default(),
            policies: BTreeMap::new(),
            lb,
        }
    }

    pub fn set_lb(&mut self, lb: Arc<ServiceLb>) {
        self.lb = Some(lb);
    }

    /// What `toServices` resolves against.
    pub fn table(&self) -> &ServiceTable {
        self.tracker.table()
    }

    /// A Service appeared or changed: the repository's message, and the policies to translate
    /// again.
    pub fn upsert_service(&mut self, s: ServiceInfo) -> (ServiceUpsert, Vec<(K, D)>) {
        if let Some(lb) = &self.lb {
            lb.set_service(&s.namespace, &s.name, Some(s.spec()));
        }
        let changed = self.tracker.set_service(
            &s.namespace,
            &s.name,
            Some((s.labels.clone(), !s.selector.is_empty())),
        );
        let msg = ServiceUpsert {
            service: s,
            deleted: false,
        };
        (msg, self.resend_if(changed))
    }

    /// A Service went away: the repository's message, and the policies to translate again.
    pub fn delete_service(&mut self, namespace: &str, name: &str) -> (ServiceUpsert, Vec<(K, D)>) {
        if let Some(lb) = &self.lb {
            lb.set_service(namespace, name, None);
        }
        let changed = self.tracker.set_service(namespace, name, None);
        let msg = ServiceUpsert {
            service: deleted_service(namespace, name),
            deleted: true,
        };
        (msg, self.resend_if(changed))
    }

    /// The EndpointSlice `namespace/name` appeared, changed (`Some`) or went away (`None`);
    /// returns the policies to translate again.
    pub fn set_slice(
        &mut self,
        namespace: &str,
        name: &str,
        slice: Option<EndpointSliceInfo>,
    ) -> Vec<(K, D)> {
        let key = format!("{namespace}/{name}");
        if let Some(lb) = &self.lb {
            lb.set_slice(&key, slice.as_ref().map(|s| s.spec(namespace)));
        }
        let tracked = slice.map(|s| {
            let ns = if s.namespace.is_empty() {
                namespace.to_string()
            } else {
                s.namespace
            };
            (ns, s.service, s.addresses)
        });
        let changed = self.tracker.set_slice(&key, tracked);
        self.resend_if(changed)
    }

    /// A policy was translated: kept for re-translation when it uses `toServices`.
    pub fn policy_translated(&mut self, key: K, doc: D, uses_services: bool) {
        if uses_services {
            self.policies.insert(key, doc);
        } else {
            self.policies.remove(&key);
        }
    }

    pub fn policy_deleted(&mut self, key: &K) {
        self.policies.remove(key);
    }

    fn resend_if(&self, changed: bool) -> Vec<(K, D)> {
        if !changed {
            return Vec::new();
        }
        self.policies
            .iter()
            .map(|(k, d)| (k.clone(), d.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str, labels: &[(&str, &str)]) -> ServiceInfo {
        let mut s = deleted_service("x", name);
        s.labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        s
    }

    #[test]
    fn only_changes_that_matter_send_the_service_policies_again() {
        let mut f: ServicesFeed<&str, &str> = ServicesFeed::new(None);
        f.policy_translated("uses", "doc-1", true);
        f.policy_translated("plain", "doc-2", false);
        let (msg, again) = f.upsert_service(svc("a", &[("app", "a")]));
        assert!(!msg.deleted && msg.service.name == "a");
        assert_eq!(again, [("uses", "doc-1")]);
        assert!(
            f.upsert_service(svc("a", &[("app", "a")])).1.is_empty(),
            "the same service again changes nothing"
        );
        f.policy_translated("uses", "doc-1", false);
        let (msg, again) = f.delete_service("x", "a");
        assert!(msg.deleted && msg.service.name == "a");
        assert!(again.is_empty(), "no policy uses services now");
        f.policy_translated("uses", "doc-3", true);
        f.policy_deleted(&"uses");
        assert!(f.upsert_service(svc("b", &[])).1.is_empty());
    }
}
