//! Selectors over identities: label selectors (matchLabels / matchExpressions) and CIDR selectors.
//!
//! Selectors are canonical (requirements sorted, values sorted and deduplicated) and carry a
//! precomputed hash, so the selector cache can intern them cheaply and two policies that spell the
//! same selector differently share one cache entry.

use std::collections::hash_map::DefaultHasher;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use ipnet::IpNet;

use super::identity::IdentityInfo;
use super::labels::{Labels, SOURCE_RESERVED};

/// A label-selector operator. Only the four Kubernetes spellings exist (case-sensitive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

impl fmt::Display for Operator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Operator::In => "In",
            Operator::NotIn => "NotIn",
            Operator::Exists => "Exists",
            Operator::DoesNotExist => "DoesNotExist",
        })
    }
}

/// One requirement of a label selector. `source: None` matches labels of any source.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Requirement {
    pub source: Option<String>,
    pub key: String,
    pub op: Operator,
    /// Sorted and deduplicated; empty for `Exists` / `DoesNotExist`.
    pub values: Vec<String>,
}

impl Requirement {
    pub fn new(source: Option<String>, key: String, op: Operator, mut values: Vec<String>) -> Self {
        values.sort();
        values.dedup();
        Requirement {
            source,
            key,
            op,
            values,
        }
    }

    /// `source:key = value` (matchLabels form).
    pub fn equals(source: Option<&str>, key: &str, value: &str) -> Self {
        Requirement::new(
            source.map(str::to_string),
            key.to_string(),
            Operator::In,
            vec![value.to_string()],
        )
    }

    pub fn matches(&self, labels: &Labels) -> bool {
        let found = labels.get(&self.key).filter(|l| match &self.source {
            None => true,
            Some(src) => *src == l.source,
        });
        match self.op {
            Operator::In => found.is_some_and(|l| self.values.binary_search(&l.value).is_ok()),
            Operator::NotIn => found.is_none_or(|l| self.values.binary_search(&l.value).is_err()),
            Operator::Exists => found.is_some(),
            Operator::DoesNotExist => found.is_none(),
        }
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let src = self.source.as_deref().unwrap_or("any");
        match self.op {
            Operator::In if self.values.len() == 1 => {
                write!(f, "{src}:{}={}", self.key, self.values[0])
            }
            Operator::In | Operator::NotIn => {
                write!(
                    f,
                    "{src}:{} {} ({})",
                    self.key,
                    self.op,
                    self.values.join(",")
                )
            }
            Operator::Exists => write!(f, "{src}:{}", self.key),
            Operator::DoesNotExist => write!(f, "!{src}:{}", self.key),
        }
    }
}

/// A conjunction of requirements. No requirement at all selects every identity.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabelSelector {
    requirements: Vec<Requirement>,
}

impl LabelSelector {
    pub fn new(mut requirements: Vec<Requirement>) -> Self {
        requirements.sort();
        requirements.dedup();
        LabelSelector { requirements }
    }

    pub fn requirements(&self) -> &[Requirement] {
        &self.requirements
    }

    /// Adds one requirement, keeping the canonical order.
    pub fn add(&mut self, req: Requirement) {
        self.requirements.push(req);
        self.requirements.sort();
        self.requirements.dedup();
    }

    /// True when some requirement is about `key` (any source).
    pub fn has_key(&self, key: &str) -> bool {
        self.requirements.iter().any(|r| r.key == key)
    }

    /// True when some requirement's key starts with `prefix`.
    pub fn has_key_prefix(&self, prefix: &str) -> bool {
        self.requirements.iter().any(|r| r.key.starts_with(prefix))
    }

    /// True when some requirement names a `reserved:` label.
    pub fn has_reserved_key(&self) -> bool {
        self.requirements
            .iter()
            .any(|r| r.source.as_deref() == Some(SOURCE_RESERVED))
    }

    pub fn is_wildcard(&self) -> bool {
        self.requirements.is_empty()
    }

    pub fn matches(&self, labels: &Labels) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }
}

impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.requirements.is_empty() {
            return f.write_str("{}");
        }
        let parts: Vec<String> = self.requirements.iter().map(|r| r.to_string()).collect();
        write!(f, "{{{}}}", parts.join(", "))
    }
}

/// Selects the addresses of `prefix` minus the `except` sub-prefixes, as CIDR identities.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CidrSelector {
    pub prefix: IpNet,
    pub except: Vec<IpNet>,
}

impl CidrSelector {
    pub fn new(prefix: IpNet, mut except: Vec<IpNet>) -> Self {
        except.sort();
        except.dedup();
        CidrSelector {
            prefix: prefix.trunc(),
            except,
        }
    }

    /// Every prefix this selector needs a CIDR identity for (the allowed prefix and each except,
    /// so that a longest-prefix match separates carved-out addresses).
    pub fn prefixes(&self) -> impl Iterator<Item = IpNet> + '_ {
        std::iter::once(self.prefix).chain(self.except.iter().copied())
    }

    pub fn matches(&self, identity: &IdentityInfo) -> bool {
        match identity.cidr {
            Some(p) => self.prefix.contains(&p) && !self.except.iter().any(|e| e.contains(&p)),
            // `0.0.0.0/0` and `::/0` also select the world identities (addresses no CIDR
            // identity covers), like Cilium's CIDRSlice.GetAsEndpointSelectors.
            None if self.prefix.prefix_len() == 0 => {
                let v4 = matches!(self.prefix, IpNet::V4(_));
                identity.is_world_of_family(v4)
            }
            None => false,
        }
    }
}

impl fmt::Display for CidrSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cidr:{}", self.prefix)?;
        if !self.except.is_empty() {
            let ex: Vec<String> = self.except.iter().map(|e| e.to_string()).collect();
            write!(f, " except {}", ex.join(","))?;
        }
        Ok(())
    }
}

/// What a selector is made of.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SelectorKind {
    Labels(LabelSelector),
    Cidr(CidrSelector),
    /// `toFQDNs`: the addresses learned for names it matches (their `fqdn:` labels).
    Fqdn(super::fqdn::FqdnPattern),
    /// A cluster tier's `nodes` peer: the nodes whose labels it matches. Selects no identity
    /// through the cache: node addresses share the `host` and `remote-node` identities, and
    /// the engine resolves which of those the selected nodes cover (`PolicyEngine::nodes_inside`).
    Nodes(LabelSelector),
}

/// A canonical selector with its hash computed once.
#[derive(Debug, Clone)]
pub struct Selector {
    kind: SelectorKind,
    hash: u64,
}

/// Selectors are shared between rules and the selector cache.
pub type SelectorRef = Arc<Selector>;

impl Selector {
    pub fn new(kind: SelectorKind) -> Self {
        let mut h = DefaultHasher::new();
        kind.hash(&mut h);
        Selector {
            kind,
            hash: h.finish(),
        }
    }

    pub fn labels(sel: LabelSelector) -> SelectorRef {
        Arc::new(Selector::new(SelectorKind::Labels(sel)))
    }

    pub fn cidr(sel: CidrSelector) -> SelectorRef {
        Arc::new(Selector::new(SelectorKind::Cidr(sel)))
    }

    pub fn fqdn(pattern: super::fqdn::FqdnPattern) -> SelectorRef {
        Arc::new(Selector::new(SelectorKind::Fqdn(pattern)))
    }

    pub fn nodes(sel: LabelSelector) -> SelectorRef {
        Arc::new(Selector::new(SelectorKind::Nodes(sel)))
    }

    pub fn kind(&self) -> &SelectorKind {
        &self.kind
    }

    pub fn matches(&self, identity: &IdentityInfo) -> bool {
        match &self.kind {
            SelectorKind::Labels(s) => s.matches(&identity.labels),
            SelectorKind::Cidr(c) => c.matches(identity),
            SelectorKind::Fqdn(p) => identity
                .labels
                .iter()
                .any(|l| l.source == super::fqdn::SOURCE_FQDN && p.matches(&l.key)),
            SelectorKind::Nodes(_) => false,
        }
    }
}

impl PartialEq for Selector {
    fn eq(&self, other: &Self) -> bool {
        // Interned selectors are compared by address first; the structural comparison only
        // runs for a selector that is not (yet) the cache's canonical copy.
        std::ptr::eq(self, other) || (self.hash == other.hash && self.kind == other.kind)
    }
}
impl Eq for Selector {}

impl Hash for Selector {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            SelectorKind::Labels(s) => s.fmt(f),
            SelectorKind::Cidr(c) => c.fmt(f),
            SelectorKind::Fqdn(p) => p.fmt(f),
            SelectorKind::Nodes(s) => write!(f, "nodes:{s}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::labels::Label;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| Label::k8s(k, v)).collect()
    }

    #[test]
    fn operators_follow_kubernetes_semantics() {
        let l = labels(&[("app", "web"), ("tier", "front")]);
        let req = |k: &str, op, vals: &[&str]| {
            Requirement::new(
                None,
                k.into(),
                op,
                vals.iter().map(|s| s.to_string()).collect(),
            )
        };
        assert!(req("app", Operator::In, &["web", "api"]).matches(&l));
        assert!(!req("app", Operator::In, &["api"]).matches(&l));
        assert!(req("app", Operator::NotIn, &["api"]).matches(&l));
        // NotIn matches when the key is absent.
        assert!(req("missing", Operator::NotIn, &["x"]).matches(&l));
        assert!(req("tier", Operator::Exists, &[]).matches(&l));
        assert!(req("missing", Operator::DoesNotExist, &[]).matches(&l));
        assert!(!req("tier", Operator::DoesNotExist, &[]).matches(&l));
    }

    #[test]
    fn source_must_match_when_given() {
        let l = labels(&[("app", "web")]);
        assert!(Requirement::equals(Some("k8s"), "app", "web").matches(&l));
        assert!(Requirement::equals(None, "app", "web").matches(&l));
        assert!(!Requirement::equals(Some("reserved"), "app", "web").matches(&l));
    }

    #[test]
    fn canonical_form_makes_equal_selectors_equal() {
        let a = LabelSelector::new(vec![
            Requirement::equals(None, "b", "2"),
            Requirement::equals(None, "a", "1"),
        ]);
        let b = LabelSelector::new(vec![
            Requirement::equals(None, "a", "1"),
            Requirement::equals(None, "b", "2"),
            Requirement::equals(None, "a", "1"),
        ]);
        assert_eq!(Selector::labels(a), Selector::labels(b));
    }

    #[test]
    fn cidr_selector_carves_out_excepts() {
        let sel = CidrSelector::new(
            "10.0.0.0/8".parse().unwrap(),
            vec!["10.1.0.0/16".parse().unwrap()],
        );
        let id = |p: &str| IdentityInfo::cidr(1 << 24, p.parse().unwrap());
        assert!(sel.matches(&id("10.0.0.0/8")));
        assert!(sel.matches(&id("10.2.0.0/16")));
        assert!(!sel.matches(&id("10.1.0.0/16")));
        assert!(!sel.matches(&id("10.1.2.0/24")));
        assert!(!sel.matches(&id("11.0.0.0/8")));
    }
}
