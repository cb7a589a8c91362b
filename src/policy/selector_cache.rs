//! The selector cache: each distinct selector in use, with the identities it selects, kept up to
//! date incrementally as identities come and go.
//!
//! Cilium's SelectorCache tests every cached selector against a new identity. With thousands of
//! selectors that dominates identity churn, so this cache indexes selectors by one `key=value`
//! they require (the most selective `In` requirement): a new identity is only tested against
//! the selectors indexed under one of its own labels, plus the few selectors that have no such
//! requirement. The same index run backwards (identities by label) makes adding a selector cheap.

use std::collections::BTreeSet;

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use super::identity::{IdentityInfo, NumericIdentity};
use super::labels::POD_NAMESPACE_LABEL;
use super::selector::{LabelSelector, Operator, SelectorKind, SelectorRef};

/// Index of a selector in the cache. Stable while the selector is referenced.
pub type SelectorId = u32;

type LabelKey = (String, String);

#[derive(Debug, Clone)]
struct Entry {
    selector: SelectorRef,
    selected: BTreeSet<NumericIdentity>,
    /// Changes whenever `selected` does (from the cache's counter: never reused).
    version: u64,
    refs: u32,
    index_keys: Vec<LabelKey>,
}

/// Selectors and their selections. See the module documentation for the indexing scheme.
#[derive(Debug, Clone, Default)]
pub struct SelectorCache {
    entries: Vec<Option<Entry>>,
    free: Vec<SelectorId>,
    by_selector: HashMap<SelectorRef, SelectorId>,
    by_label: HashMap<LabelKey, HashSet<SelectorId>>,
    unindexed: HashSet<SelectorId>,
    identities: HashMap<NumericIdentity, IdentityInfo>,
    identities_by_label: HashMap<LabelKey, HashSet<NumericIdentity>>,
    selected_by: HashMap<NumericIdentity, HashSet<SelectorId>>,
    /// Bumped whenever a `toFQDNs` selector enters or leaves the cache.
    fqdn_generation: u64,
    /// The last selection version handed out (`Entry::version`).
    versions: u64,
}

/// The `key=value` pairs a selector is indexed under: the values of its most selective `In`
/// requirement, preferring any key over the namespace (which many selectors share).
fn index_keys(sel: &SelectorKind) -> Vec<LabelKey> {
    let SelectorKind::Labels(ls) = sel else {
        return Vec::new();
    };
    best_in_requirement(ls)
        .map(|r| {
            r.values
                .iter()
                .map(|v| (r.key.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default()
}

fn best_in_requirement(ls: &LabelSelector) -> Option<&super::selector::Requirement> {
    ls.requirements()
        .iter()
        .filter(|r| r.op == Operator::In && !r.values.is_empty())
        .min_by_key(|r| (r.key == POD_NAMESPACE_LABEL, r.values.len()))
}

impl SelectorCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a reference to `selector`, computing its selections the first time. Returns the
    /// cache's canonical copy: callers keep that one so later lookups compare by address.
    pub fn add_selector(&mut self, selector: &SelectorRef) -> SelectorRef {
        if let Some(&id) = self.by_selector.get(selector) {
            if let Some(e) = self.entries[id as usize].as_mut() {
                e.refs += 1;
                return e.selector.clone();
            }
        }
        let keys = index_keys(selector.kind());
        let selected: BTreeSet<NumericIdentity> = if keys.is_empty() {
            self.identities
                .values()
                .filter(|i| selector.matches(i))
                .map(|i| i.id)
                .collect()
        } else {
            keys.iter()
                .filter_map(|k| self.identities_by_label.get(k))
                .flatten()
                .filter(|id| self.identities.get(id).is_some_and(|i| selector.matches(i)))
                .copied()
                .collect()
        };
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.entries.push(None);
                (self.entries.len() - 1) as SelectorId
            }
        };
        for ident in &selected {
            self.selected_by.entry(*ident).or_default().insert(id);
        }
        if keys.is_empty() {
            self.unindexed.insert(id);
        }
        for k in &keys {
            self.by_label.entry(k.clone()).or_default().insert(id);
        }
        self.versions += 1;
        self.entries[id as usize] = Some(Entry {
            selector: selector.clone(),
            selected,
            version: self.versions,
            refs: 1,
            index_keys: keys,
        });
        self.by_selector.insert(selector.clone(), id);
        if matches!(selector.kind(), SelectorKind::Fqdn(_)) {
            self.fqdn_generation += 1;
        }
        selector.clone()
    }

    /// Whether a `toFQDNs` selector in the cache matches `name`.
    pub fn fqdn_selects(&self, name: &str) -> bool {
        self.unindexed
            .iter()
            .filter_map(|id| self.entries[*id as usize].as_ref())
            .any(|e| matches!(e.selector.kind(), SelectorKind::Fqdn(p) if p.matches(name)))
    }

    /// Changes whenever a `toFQDNs` selector enters or leaves the cache.
    pub fn fqdn_generation(&self) -> u64 {
        self.fqdn_generation
    }

    /// Drops a reference to `selector`; the entry goes away with its last reference.
    pub fn remove_selector(&mut self, selector: &SelectorRef) {
        let Some(&id) = self.by_selector.get(selector) else {
            return;
        };
        let Some(e) = self.entries[id as usize].as_mut() else {
            return;
        };
        e.refs -= 1;
        if e.refs > 0 {
            return;
        }
        let Some(e) = self.entries[id as usize].take() else {
            return;
        };
        self.by_selector.remove(&e.selector);
        if matches!(e.selector.kind(), SelectorKind::Fqdn(_)) {
            self.fqdn_generation += 1;
        }
        self.unindexed.remove(&id);
        for k in &e.index_keys {
            if let Some(set) = self.by_label.get_mut(k) {
                set.remove(&id);
                if set.is_empty() {
                    self.by_label.remove(k);
                }
            }
        }
        for ident in &e.selected {
            if let Some(set) = self.selected_by.get_mut(ident) {
                set.remove(&id);
            }
        }
        self.free.push(id);
    }

    /// Adds an identity and returns the selectors that now select it.
    pub fn add_identity(&mut self, info: &IdentityInfo) -> Vec<SelectorId> {
        let keys: Vec<LabelKey> = info
            .labels
            .iter()
            .map(|l| (l.key.clone(), l.value.clone()))
            .collect();
        let mut candidates: HashSet<SelectorId> = self.unindexed.clone();
        for k in &keys {
            if let Some(ids) = self.by_label.get(k) {
                candidates.extend(ids);
            }
        }
        let mut newly = Vec::new();
        for sid in candidates {
            if let Some(e) = self.entries[sid as usize].as_mut() {
                if e.selector.matches(info) && e.selected.insert(info.id) {
                    self.versions += 1;
                    e.version = self.versions;
                    newly.push(sid);
                }
            }
        }
        newly.sort_unstable();
        if !newly.is_empty() {
            self.selected_by
                .entry(info.id)
                .or_default()
                .extend(newly.iter().copied());
        }
        for k in keys {
            self.identities_by_label
                .entry(k)
                .or_default()
                .insert(info.id);
        }
        self.identities.insert(info.id, info.clone());
        newly
    }

    /// Removes an identity and returns the selectors that selected it.
    pub fn remove_identity(&mut self, id: NumericIdentity) -> Vec<SelectorId> {
        let Some(info) = self.identities.remove(&id) else {
            return Vec::new();
        };
        for l in info.labels.iter() {
            let k = (l.key.clone(), l.value.clone());
            if let Some(set) = self.identities_by_label.get_mut(&k) {
                set.remove(&id);
                if set.is_empty() {
                    self.identities_by_label.remove(&k);
                }
            }
        }
        let mut out: Vec<SelectorId> = self
            .selected_by
            .remove(&id)
            .map(|s| s.into_iter().collect())
            .unwrap_or_default();
        for sid in &out {
            if let Some(e) = self.entries[*sid as usize].as_mut() {
                e.selected.remove(&id);
                self.versions += 1;
                e.version = self.versions;
            }
        }
        out.sort_unstable();
        out
    }

    /// The identities `selector` selects, if it is in the cache.
    pub fn selections(&self, selector: &SelectorRef) -> Option<&BTreeSet<NumericIdentity>> {
        let id = self.by_selector.get(selector)?;
        self.entries[*id as usize].as_ref().map(|e| &e.selected)
    }

    /// A stamp of `selector`'s selections, if it is in the cache: two equal stamps (of any
    /// selectors, at any times) mean the same selections, as the version changes with every
    /// change of them and is never handed out twice.
    pub fn selection_stamp(&self, selector: &SelectorRef) -> Option<u64> {
        let id = self.by_selector.get(selector)?;
        self.entries[*id as usize].as_ref().map(|e| e.version)
    }

    /// Changes whenever any selector's selections change or a selector is added: equal
    /// versions mean every selector present then and now selects the same identities.
    pub fn selections_version(&self) -> u64 {
        self.versions
    }

    /// The cache id of `selector`, if it is in the cache.
    pub fn id_of(&self, selector: &SelectorRef) -> Option<SelectorId> {
        self.by_selector.get(selector).copied()
    }

    pub fn selector(&self, id: SelectorId) -> Option<&SelectorRef> {
        self.entries
            .get(id as usize)
            .and_then(|e| e.as_ref())
            .map(|e| &e.selector)
    }

    /// The selectors that select identity `id`.
    pub fn selecting(&self, id: NumericIdentity) -> impl Iterator<Item = SelectorId> + '_ {
        self.selected_by.get(&id).into_iter().flatten().copied()
    }

    pub fn identity(&self, id: NumericIdentity) -> Option<&IdentityInfo> {
        self.identities.get(&id)
    }

    /// Number of distinct selectors cached.
    pub fn len(&self) -> usize {
        self.by_selector.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_selector.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::labels::{Label, Labels};
    use crate::policy::selector::{CidrSelector, Requirement, Selector};

    fn ident(id: NumericIdentity, pairs: &[(&str, &str)]) -> IdentityInfo {
        let labels: Labels = pairs.iter().map(|(k, v)| Label::k8s(k, v)).collect();
        IdentityInfo {
            id,
            labels: labels.into(),
            cidr: None,
        }
    }

    fn sel(pairs: &[(&str, &str)]) -> SelectorRef {
        Selector::labels(LabelSelector::new(
            pairs
                .iter()
                .map(|(k, v)| Requirement::equals(None, k, v))
                .collect(),
        ))
    }

    #[test]
    fn selector_added_after_identities_sees_them() {
        let mut c = SelectorCache::new();
        c.add_identity(&ident(300, &[("app", "a"), ("ns", "x")]));
        c.add_identity(&ident(301, &[("app", "b"), ("ns", "x")]));
        let s = sel(&[("ns", "x")]);
        c.add_selector(&s);
        assert_eq!(
            c.selections(&s)
                .unwrap()
                .iter()
                .copied()
                .collect::<Vec<_>>(),
            vec![300, 301]
        );
    }

    #[test]
    fn identity_added_after_selectors_updates_only_matching_ones() {
        let mut c = SelectorCache::new();
        let a = sel(&[("app", "a")]);
        let b = sel(&[("app", "b")]);
        let all = Selector::labels(LabelSelector::default());
        let not_b = Selector::labels(LabelSelector::new(vec![Requirement::new(
            None,
            "app".into(),
            Operator::NotIn,
            vec!["b".into()],
        )]));
        for s in [&a, &b, &all, &not_b] {
            c.add_selector(s);
        }
        let newly = c.add_identity(&ident(300, &[("app", "a")]));
        assert_eq!(newly.len(), 3);
        assert!(c.selections(&a).unwrap().contains(&300));
        assert!(!c.selections(&b).unwrap().contains(&300));
        assert!(c.selections(&all).unwrap().contains(&300));
        assert!(c.selections(&not_b).unwrap().contains(&300));
        let gone = c.remove_identity(300);
        assert_eq!(gone.len(), 3);
        assert!(c.selections(&a).unwrap().is_empty());
    }

    #[test]
    fn selectors_are_refcounted() {
        let mut c = SelectorCache::new();
        let a = sel(&[("app", "a")]);
        let first = c.add_selector(&a);
        let second = c.add_selector(&sel(&[("app", "a")]));
        assert!(std::sync::Arc::ptr_eq(&first, &second));
        c.remove_selector(&a);
        assert!(c.selections(&a).is_some());
        c.remove_selector(&a);
        assert!(c.selections(&a).is_none());
        assert!(c.is_empty());
    }

    #[test]
    fn a_selection_stamp_changes_with_the_selections_and_is_never_reused() {
        let mut c = SelectorCache::new();
        let a = c.add_selector(&sel(&[("app", "a")]));
        let b = c.add_selector(&sel(&[("app", "b")]));
        let (a0, b0) = (
            c.selection_stamp(&a).unwrap(),
            c.selection_stamp(&b).unwrap(),
        );
        assert_ne!(a0, b0);
        // An identity only `a` selects: `a`'s stamp moves, `b`'s does not.
        c.add_identity(&ident(7, &[("app", "a")]));
        let a1 = c.selection_stamp(&a).unwrap();
        assert!(a1 != a0 && a1 != b0);
        assert_eq!(c.selection_stamp(&b), Some(b0));
        // Removed again: the same selections as before, but a new stamp all the same.
        c.remove_identity(7);
        let a2 = c.selection_stamp(&a).unwrap();
        assert!(![a0, a1, b0].contains(&a2));
        // A selector gone and one added in its slot: a stamp of its own.
        c.remove_selector(&a);
        assert_eq!(c.selection_stamp(&a), None);
        let a3 = c.add_selector(&sel(&[("app", "a")]));
        assert!(![a0, a1, a2, b0].contains(&c.selection_stamp(&a3).unwrap()));
    }

    #[test]
    fn cidr_selectors_select_cidr_identities() {
        let mut c = SelectorCache::new();
        let s = Selector::cidr(CidrSelector::new("10.0.0.0/8".parse().unwrap(), vec![]));
        c.add_selector(&s);
        let newly = c.add_identity(&IdentityInfo::cidr(
            1 << 24 | 1,
            "10.1.0.0/16".parse().unwrap(),
        ));
        assert_eq!(newly.len(), 1);
        c.add_identity(&IdentityInfo::cidr(
            1 << 24 | 2,
            "11.0.0.0/8".parse().unwrap(),
        ));
        assert_eq!(c.selections(&s).unwrap().len(), 1);
    }
}
