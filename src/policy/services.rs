//! What `toServices` resolves against (Cilium's `preprocessRules` / `rule_translate.go`): the
//! cluster's services with their labels, whether they have a pod selector, and their backend
//! addresses (from EndpointSlices).
//!
//! As in Cilium 1.16, a `toServices` entry applies to services *without* a selector: their
//! backends are not pods the policy could name by labels, so their addresses become CIDR peers
//! (/32 or /128 each). A service with a selector contributes nothing (its pods are selected with
//! `toEndpoints`), nor does a service with no backends yet: the entry then selects nothing
//! (fail closed) and the policy is translated again when the service changes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use serde_yaml::Value;

/// One service as `toServices` sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceEntry {
    pub labels: BTreeMap<String, String>,
    pub has_selector: bool,
    pub backends: BTreeSet<IpAddr>,
}

/// Every known service, by (namespace, name).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceTable {
    pub services: BTreeMap<(String, String), ServiceEntry>,
}

/// A parsed `toServices` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceRef {
    /// `k8sService: {serviceName, namespace}`; an empty namespace matches any.
    Name { name: String, namespace: String },
    /// `k8sServiceSelector: {selector, namespace}`: services whose labels match.
    Selector {
        match_labels: BTreeMap<String, String>,
        match_expressions: Vec<(String, String, Vec<String>)>,
        namespace: String,
    },
}

fn str_of(v: Option<&Value>) -> String {
    v.and_then(Value::as_str).unwrap_or("").to_string()
}

impl ServiceRef {
    /// Parses one entry; the error says which part is wrong (the caller adds the path).
    pub fn parse(v: &Value) -> Result<ServiceRef, String> {
        if let Some(s) = v.get("k8sService") {
            let name = str_of(s.get("serviceName"));
            if name.is_empty() {
                return Err("k8sService.serviceName: missing".into());
            }
            return Ok(ServiceRef::Name {
                name,
                namespace: str_of(s.get("namespace")),
            });
        }
        if let Some(s) = v.get("k8sServiceSelector") {
            let sel = s
                .get("selector")
                .ok_or("k8sServiceSelector.selector: missing")?;
            let mut match_labels = BTreeMap::new();
            if let Some(m) = sel.get("matchLabels").and_then(Value::as_mapping) {
                for (k, v) in m {
                    let (Some(k), Some(v)) = (k.as_str(), v.as_str()) else {
                        return Err("k8sServiceSelector.selector.matchLabels: keys and values must be strings".into());
                    };
                    match_labels.insert(k.to_string(), v.to_string());
                }
            }
            let mut match_expressions = Vec::new();
            for (i, e) in sel
                .get("matchExpressions")
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
                .enumerate()
            {
                let op = str_of(e.get("operator"));
                if !matches!(op.as_str(), "In" | "NotIn" | "Exists" | "DoesNotExist") {
                    return Err(format!(
                        "k8sServiceSelector.selector.matchExpressions[{i}].operator: unknown operator {op:?}"
                    ));
                }
                let values = e
                    .get("values")
                    .and_then(Value::as_sequence)
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect();
                match_expressions.push((str_of(e.get("key")), op, values));
            }
            return Ok(ServiceRef::Selector {
                match_labels,
                match_expressions,
                namespace: str_of(s.get("namespace")),
            });
        }
        Err("needs k8sService or k8sServiceSelector".into())
    }

    fn matches(&self, namespace: &str, name: &str, entry: &ServiceEntry) -> bool {
        match self {
            ServiceRef::Name {
                name: n,
                namespace: ns,
            } => n == name && (ns.is_empty() || ns == namespace),
            ServiceRef::Selector {
                match_labels,
                match_expressions,
                namespace: ns,
            } => {
                (ns.is_empty() || ns == namespace)
                    && match_labels
                        .iter()
                        .all(|(k, v)| entry.labels.get(k) == Some(v))
                    && match_expressions.iter().all(|(k, op, values)| {
                        let got = entry.labels.get(k);
                        match op.as_str() {
                            "In" => got.is_some_and(|g| values.contains(g)),
                            "NotIn" => got.is_none_or(|g| !values.contains(g)),
                            "Exists" => got.is_some(),
                            _ => got.is_none(),
                        }
                    })
            }
        }
    }
}

impl ServiceTable {
    /// The services an entry selects: ((namespace, name), entry).
    pub fn matching<'a>(
        &'a self,
        r: &'a ServiceRef,
    ) -> impl Iterator<Item = (&'a (String, String), &'a ServiceEntry)> + 'a {
        self.services
            .iter()
            .filter(move |((ns, name), e)| r.matches(ns, name, e))
    }
}

/// Keeps a [`ServiceTable`] from Service and EndpointSlice events: the table holds the services
/// that exist, each with the addresses of the slices that name it (a slice may come before its
/// service, or outlive it; it counts while both exist).
#[derive(Debug, Clone, Default)]
pub struct ServiceTracker {
    table: ServiceTable,
    /// Slice key -> (namespace, service name, addresses).
    slices: BTreeMap<String, (String, String, Vec<IpAddr>)>,
}

impl ServiceTracker {
    pub fn table(&self) -> &ServiceTable {
        &self.table
    }

    fn backends_of(&self, id: &(String, String)) -> BTreeSet<IpAddr> {
        self.slices
            .values()
            .filter(|(ns, svc, _)| *ns == id.0 && *svc == id.1)
            .flat_map(|(_, _, addrs)| addrs.iter().copied())
            .collect()
    }

    /// A service appeared or changed (`Some((labels, has_selector))`) or went away (`None`).
    /// True when the table changed.
    pub fn set_service(
        &mut self,
        namespace: &str,
        name: &str,
        service: Option<(BTreeMap<String, String>, bool)>,
    ) -> bool {
        let id = (namespace.to_string(), name.to_string());
        match service {
            None => self.table.services.remove(&id).is_some(),
            Some((labels, has_selector)) => {
                let entry = ServiceEntry {
                    labels,
                    has_selector,
                    backends: self.backends_of(&id),
                };
                self.table.services.insert(id, entry.clone()) != Some(entry)
            }
        }
    }

    /// An EndpointSlice appeared or changed (`Some((namespace, service, addresses))`) or went
    /// away (`None`). True when the table changed.
    pub fn set_slice(&mut self, key: &str, slice: Option<(String, String, Vec<IpAddr>)>) -> bool {
        let old = match slice {
            Some(s) => self.slices.insert(key.to_string(), s),
            None => self.slices.remove(key),
        };
        let affected: BTreeSet<(String, String)> = old
            .iter()
            .chain(self.slices.get(key))
            .map(|(ns, svc, _)| (ns.clone(), svc.clone()))
            .collect();
        let mut changed = false;
        for id in affected {
            let backends = self.backends_of(&id);
            if let Some(e) = self.table.services.get_mut(&id) {
                if e.backends != backends {
                    e.backends = backends;
                    changed = true;
                }
            }
        }
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> ServiceTable {
        let mut t = ServiceTable::default();
        t.services.insert(
            ("default".into(), "myservice".into()),
            ServiceEntry {
                labels: [("external".to_string(), "yes".to_string())].into(),
                has_selector: false,
                backends: ["10.9.0.1".parse().unwrap()].into(),
            },
        );
        t.services.insert(
            ("x".into(), "web".into()),
            ServiceEntry {
                labels: [("external".to_string(), "no".to_string())].into(),
                has_selector: true,
                backends: BTreeSet::new(),
            },
        );
        t
    }

    fn parse(yaml: &str) -> ServiceRef {
        ServiceRef::parse(&serde_yaml::from_str(yaml).unwrap()).unwrap()
    }

    #[test]
    fn by_name_and_by_labels() {
        let t = table();
        let r = parse("k8sService: {serviceName: myservice, namespace: default}");
        assert_eq!(t.matching(&r).count(), 1);
        let r = parse("k8sService: {serviceName: myservice, namespace: other}");
        assert_eq!(t.matching(&r).count(), 0);
        let r = parse("k8sServiceSelector: {selector: {matchLabels: {external: 'yes'}}}");
        let hits: Vec<_> = t.matching(&r).map(|(k, _)| k.1.clone()).collect();
        assert_eq!(hits, ["myservice"]);
        let r = parse("k8sServiceSelector: {selector: {matchExpressions: [{key: external, operator: Exists}]}}");
        assert_eq!(t.matching(&r).count(), 2);
    }

    #[test]
    fn the_tracker_joins_services_and_slices_in_any_order() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut t = ServiceTracker::default();
        // A slice before its service: nothing to resolve yet.
        assert!(!t.set_slice(
            "x/ext-1",
            Some(("x".into(), "ext".into(), vec![ip("192.0.2.1")]))
        ));
        assert!(t.table().services.is_empty());
        assert!(t.set_service("x", "ext", Some((BTreeMap::new(), false))));
        let backends = |t: &ServiceTracker| {
            t.table().services[&("x".to_string(), "ext".to_string())]
                .backends
                .clone()
        };
        assert_eq!(backends(&t), [ip("192.0.2.1")].into());
        assert!(t.set_slice(
            "x/ext-2",
            Some(("x".into(), "ext".into(), vec![ip("192.0.2.2")]))
        ));
        assert_eq!(backends(&t).len(), 2);
        assert!(
            !t.set_service("x", "ext", Some((BTreeMap::new(), false))),
            "no change"
        );
        assert!(t.set_slice("x/ext-1", None));
        assert_eq!(backends(&t), [ip("192.0.2.2")].into());
        assert!(t.set_service("x", "ext", None));
        assert!(!t.set_slice("x/ext-2", None), "the service is gone already");
    }

    #[test]
    fn bad_entries_are_named() {
        let e = ServiceRef::parse(&serde_yaml::from_str("k8sService: {namespace: x}").unwrap())
            .unwrap_err();
        assert!(e.contains("serviceName"), "{e}");
        let e = ServiceRef::parse(&serde_yaml::from_str("{}").unwrap()).unwrap_err();
        assert!(e.contains("k8sService or k8sServiceSelector"), "{e}");
    }
}
