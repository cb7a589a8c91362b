//! Node identities for cluster tiers' `nodes` peers.
//!
//! A node's addresses have the identity `host` on the node itself and `remote-node` elsewhere,
//! so a `nodes` peer that selects some nodes and not others cannot be told apart by identity
//! alone. Here remote nodes are grouped into classes instead: the nodes whose labels agree on
//! every key some `nodes` peer names (the relevant keys) are one class. No selector over those
//! keys can tell two nodes of a class apart, so a class is always wholly selected or wholly
//! not. Each class with at least one relevant label has an identity of its own, labelled
//! `reserved:remote-node` (the `remote-node`, `cluster` and `all` entities select it as they
//! select `remote-node`) and `reserved:node-class=<its relevant labels>`; nodes with none of
//! the relevant keys keep `remote-node`. Without any `nodes` peer there are no relevant keys
//! and every remote node is `remote-node`, as before.
//!
//! The node's own addresses stay `host`, which is exact: it is one node, whose labels decide.
//!
//! At most [`MAX_CLASSES`] classes: beyond that every remote node is `remote-node` again and
//! the peers that select some of them fail closed, with a note (each class is an identity in
//! every policy map that names `remote-node`).
//!
//! Pure: the engine allocates and releases the identities through the closures it passes.

use std::collections::{BTreeMap, BTreeSet};

use super::identity::{NumericIdentity, IDENTITY_HOST, IDENTITY_REMOTE_NODE};
use super::labels::{Label, Labels, SOURCE_RESERVED};
use super::selector::LabelSelector;
use super::tier_networks::Cover;

/// The most classes that get identities of their own.
pub const MAX_CLASSES: usize = 256;

/// The label key that sets a class's identity apart (source `reserved`).
pub const CLASS_LABEL: &str = "node-class";

/// The nodes, their labels and their classes.
#[derive(Debug, Clone, Default)]
pub struct NodeClasses {
    /// Node name -> its Kubernetes labels and its class (its relevant labels).
    nodes: BTreeMap<String, Node>,
    /// This agent's own node (its addresses are `host`).
    local: Option<String>,
    /// The keys some `nodes` peer names.
    keys: BTreeSet<String>,
    /// Each class with relevant labels -> how many nodes it has.
    members: BTreeMap<Labels, usize>,
    /// A class -> its identity, holding one reference.
    classes: BTreeMap<Labels, NumericIdentity>,
    /// More classes than [`MAX_CLASSES`]: none has an identity.
    overflow: bool,
    /// Each node's identity as of the last regrouping.
    assigned: BTreeMap<String, NumericIdentity>,
    /// Nodes to look at on the next regrouping (all of them: `all_dirty`).
    dirty: BTreeSet<String>,
    all_dirty: bool,
    /// Nodes whose identity changed since [`Self::take_moved`].
    moved: BTreeSet<String>,
}

#[derive(Debug, Clone)]
struct Node {
    labels: Labels,
    class: Labels,
}

/// What the selectors of one `nodes` peer cover: the node identities that stand only for
/// selected nodes (`full`) and those that also stand for others (`partial`: too many classes,
/// or this node not known).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodesCover {
    pub cover: Cover,
    /// How many nodes it selects, of how many.
    pub selected: usize,
    pub of: usize,
}

/// Identities a regrouping created and released.
#[derive(Debug, Default)]
pub struct Regrouped {
    pub new: Vec<NumericIdentity>,
    pub gone: Vec<NumericIdentity>,
}

impl NodeClasses {
    /// A node appeared or its labels changed. True when anything changed.
    pub fn set_node(&mut self, name: &str, labels: Labels) -> bool {
        if self.nodes.get(name).is_some_and(|n| n.labels == labels) {
            return false;
        }
        let class = self.class_of(&labels);
        self.count(&class, 1);
        if let Some(old) = self.nodes.insert(name.to_string(), Node { labels, class }) {
            self.count(&old.class, -1);
        }
        self.dirty.insert(name.to_string());
        true
    }

    /// A node went away. True when it was known.
    pub fn remove_node(&mut self, name: &str) -> bool {
        self.moved.remove(name);
        self.assigned.remove(name);
        self.dirty.remove(name);
        match self.nodes.remove(name) {
            Some(old) => {
                self.count(&old.class, -1);
                true
            }
            None => false,
        }
    }

    fn count(&mut self, class: &Labels, by: isize) {
        if class.is_empty() {
            return;
        }
        let n = self.members.entry(class.clone()).or_default();
        *n = n.saturating_add_signed(by);
        if *n == 0 {
            self.members.remove(class);
        }
    }

    /// This agent's own node.
    pub fn set_local(&mut self, name: &str) -> bool {
        if self.local.as_deref() == Some(name) {
            return false;
        }
        self.local = Some(name.to_string());
        true
    }

    /// The keys the `nodes` peers name now. True when they changed (every node's class is
    /// worked out again).
    pub fn set_keys<'a>(&mut self, selectors: impl IntoIterator<Item = &'a LabelSelector>) -> bool {
        let keys: BTreeSet<String> = selectors
            .into_iter()
            .flat_map(|s| s.requirements().iter().map(|r| r.key.clone()))
            .collect();
        if keys == self.keys {
            return false;
        }
        self.keys = keys;
        self.members.clear();
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        for name in names {
            let class = self.class_of(&self.nodes[&name].labels);
            self.count(&class, 1);
            if let Some(n) = self.nodes.get_mut(&name) {
                n.class = class;
            }
        }
        self.all_dirty = true;
        true
    }

    /// This agent's own node, when known.
    pub fn local(&self) -> Option<&str> {
        self.local.as_deref()
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// A node's relevant labels.
    fn class_of(&self, labels: &Labels) -> Labels {
        if self.keys.is_empty() {
            return Labels::new();
        }
        labels
            .iter()
            .filter(|l| self.keys.contains(&l.key))
            .cloned()
            .collect()
    }

    /// The identity a class's nodes have elsewhere.
    pub fn class_labels(class: &Labels) -> Labels {
        [
            Label::reserved("remote-node"),
            Label::new(SOURCE_RESERVED, CLASS_LABEL, &class.to_strings().join(",")),
        ]
        .into_iter()
        .collect()
    }

    /// The identity of node `name`'s addresses on other nodes (`remote-node` for an unknown
    /// node).
    pub fn identity(&self, name: &str) -> NumericIdentity {
        self.nodes
            .get(name)
            .and_then(|n| self.classes.get(&n.class))
            .copied()
            .unwrap_or(IDENTITY_REMOTE_NODE)
    }

    /// Gives the classes their identities after a change: `allocate` gives a new class its
    /// identity, `release` lets one go. Known nodes whose identity changed are kept for
    /// [`Self::take_moved`] (a node new since the last regrouping is not: whoever added it
    /// asks for its identity). Costs the number of classes, plus the nodes that changed
    /// (every node after a change of the keys, or across the class limit).
    pub fn regroup(
        &mut self,
        mut allocate: impl FnMut(&Labels) -> NumericIdentity,
        mut release: impl FnMut(NumericIdentity),
    ) -> Regrouped {
        let overflow = self.members.len() > MAX_CLASSES;
        if overflow != self.overflow {
            self.overflow = overflow;
            self.all_dirty = true;
        }
        let mut out = Regrouped::default();
        let members = &self.members;
        self.classes.retain(|class, id| {
            let keep = !overflow && members.contains_key(class);
            if !keep {
                release(*id);
                out.gone.push(*id);
            }
            keep
        });
        if !overflow {
            for class in self.members.keys() {
                if !self.classes.contains_key(class) {
                    let id = allocate(&Self::class_labels(class));
                    out.new.push(id);
                    self.classes.insert(class.clone(), id);
                }
            }
        }
        let names: Vec<String> = if std::mem::take(&mut self.all_dirty) {
            self.dirty.clear();
            self.nodes.keys().cloned().collect()
        } else {
            std::mem::take(&mut self.dirty).into_iter().collect()
        };
        for name in names {
            let id = self.identity(&name);
            if let Some(old) = self.assigned.insert(name.clone(), id) {
                if old != id {
                    self.moved.insert(name);
                }
            }
        }
        out
    }

    /// Nodes whose identity changed since the last call.
    pub fn take_moved(&mut self) -> Vec<String> {
        std::mem::take(&mut self.moved).into_iter().collect()
    }

    /// What a `nodes` peer of these selectors covers. `None`: it selects no node.
    pub fn cover(&self, sels: &[&LabelSelector]) -> Option<NodesCover> {
        let selects = |l: &Labels| sels.iter().any(|s| s.matches(l));
        let selected = self.nodes.values().filter(|n| selects(&n.labels)).count();
        if selected == 0 {
            return None;
        }
        let all = selected == self.nodes.len();
        let mut cover = Cover::default();
        if self.overflow {
            let shared = vec![IDENTITY_HOST, IDENTITY_REMOTE_NODE];
            if all {
                cover.full = shared;
            } else {
                cover.partial = shared;
            }
        } else {
            cover.full = self
                .classes
                .iter()
                .filter(|(class, _)| selects(class))
                .map(|(_, id)| *id)
                .collect();
            // The nodes with none of the relevant labels.
            if selects(&Labels::new()) {
                cover.full.push(IDENTITY_REMOTE_NODE);
            }
            match self.local.as_ref().and_then(|n| self.nodes.get(n)) {
                Some(local) if selects(&local.labels) => cover.full.push(IDENTITY_HOST),
                Some(_) => {}
                None if all => cover.full.push(IDENTITY_HOST),
                None => cover.partial.push(IDENTITY_HOST),
            }
            cover.full.sort_unstable();
        }
        Some(NodesCover {
            cover,
            selected,
            of: self.nodes.len(),
        })
    }

    /// Why a cover is partial.
    pub fn mixed_reason(&self) -> &'static str {
        if self.overflow {
            "the nodes fall into more than 256 classes of the labels nodes peers name, so their addresses share the host and remote-node identities"
        } else {
            "this agent's own node is not known, so the host identity may stand for a node it does not select"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::selector::Requirement;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| Label::k8s(k, v)).collect()
    }

    fn role(r: &str) -> LabelSelector {
        LabelSelector::new(vec![Requirement::equals(None, "role", r)])
    }

    /// A fake allocator: numbers from 1000, with the live ones.
    #[derive(Default)]
    struct Ids {
        next: NumericIdentity,
        live: BTreeMap<NumericIdentity, Labels>,
    }

    fn regroup(c: &mut NodeClasses, ids: &mut Ids) -> Regrouped {
        let live = std::cell::RefCell::new(std::mem::take(&mut ids.live));
        let next = std::cell::Cell::new(ids.next.max(1000));
        let out = c.regroup(
            |l| {
                let id = next.get();
                next.set(id + 1);
                live.borrow_mut().insert(id, l.clone());
                id
            },
            |id| {
                assert!(live.borrow_mut().remove(&id).is_some(), "released twice");
            },
        );
        ids.live = live.into_inner();
        ids.next = next.get();
        out
    }

    #[test]
    fn nodes_are_grouped_by_the_labels_nodes_peers_name_and_covered_exactly() {
        let mut c = NodeClasses::default();
        let mut ids = Ids::default();
        c.set_node("cp", labels(&[("role", "control-plane"), ("zone", "a")]));
        c.set_node("w1", labels(&[("role", "worker"), ("zone", "a")]));
        c.set_node("w2", labels(&[("role", "worker"), ("zone", "b")]));
        c.set_node("bare", labels(&[("zone", "b")]));
        c.set_local("w1");
        // No nodes peer: every node is remote-node, no identity allocated.
        let r = regroup(&mut c, &mut ids);
        assert!(r.new.is_empty() && ids.live.is_empty());
        assert_eq!(c.identity("cp"), IDENTITY_REMOTE_NODE);

        // A peer names `role`: two classes, "bare" has no role and stays remote-node.
        let sel = role("worker");
        assert!(c.set_keys([&sel]));
        let r = regroup(&mut c, &mut ids);
        assert_eq!(r.new.len(), 2);
        let (cp, w) = (c.identity("cp"), c.identity("w2"));
        assert_ne!(cp, w);
        assert_eq!(c.identity("w1"), w, "w1 and w2 agree on role");
        assert_eq!(c.identity("bare"), IDENTITY_REMOTE_NODE);
        assert!(ids.live[&w].has_reserved("remote-node"));
        assert_eq!(
            ids.live[&w].get(CLASS_LABEL).unwrap().value,
            "k8s:role=worker"
        );
        assert_eq!(
            c.take_moved(),
            vec!["cp".to_string(), "w1".into(), "w2".into()]
        );
        // The workers' class and this node (a worker): exact.
        let full = |c: &NodeClasses, s: &LabelSelector| {
            let n = c.cover(&[s]).unwrap();
            assert!(n.cover.partial.is_empty());
            n.cover.full
        };
        let mut both = vec![IDENTITY_HOST, w];
        both.sort();
        assert_eq!(full(&c, &sel), both);
        // A selector that nodes without the key match covers remote-node too.
        let no_role = LabelSelector::new(vec![Requirement::new(
            None,
            "role".into(),
            crate::policy::selector::Operator::DoesNotExist,
            vec![],
        )]);
        assert_eq!(full(&c, &no_role), vec![IDENTITY_REMOTE_NODE]);
        assert_eq!(c.cover(&[&role("gpu")]), None);

        // cp becomes a worker: its class goes, it moves, nothing else does.
        c.set_node("cp", labels(&[("role", "worker")]));
        let r = regroup(&mut c, &mut ids);
        assert_eq!((r.new.len(), r.gone), (0, vec![cp]));
        assert_eq!(c.identity("cp"), w);
        assert_eq!(c.take_moved(), vec!["cp".to_string()]);
        assert_eq!(ids.live.len(), 1);

        // The peer goes: every node is remote-node again, the class released.
        assert!(c.set_keys([]));
        let r = regroup(&mut c, &mut ids);
        assert_eq!(r.gone, vec![w]);
        assert!(ids.live.is_empty());
        assert_eq!(c.identity("w2"), IDENTITY_REMOTE_NODE);
    }

    #[test]
    fn too_many_classes_or_no_own_node_fall_back_to_the_shared_identities() {
        let mut c = NodeClasses::default();
        let mut ids = Ids::default();
        let host = LabelSelector::new(vec![Requirement::equals(None, "host", "n0")]);
        c.set_keys([&host]);
        for i in 0..=MAX_CLASSES {
            c.set_node(&format!("n{i}"), labels(&[("host", &format!("n{i}"))]));
        }
        c.set_local("n1");
        regroup(&mut c, &mut ids);
        assert!(ids.live.is_empty(), "no class identity beyond the limit");
        let n = c.cover(&[&host]).unwrap();
        assert_eq!((n.selected, n.of), (1, MAX_CLASSES + 1));
        assert_eq!(n.cover.partial, vec![IDENTITY_HOST, IDENTITY_REMOTE_NODE]);
        assert!(n.cover.full.is_empty());
        assert!(c.mixed_reason().contains("more than 256"));
        // One node fewer: each has its own identity.
        c.remove_node(&format!("n{MAX_CLASSES}"));
        regroup(&mut c, &mut ids);
        assert_eq!(ids.live.len(), MAX_CLASSES);
        let n0 = c.identity("n0");
        let n = c.cover(&[&host]).unwrap();
        assert_eq!((n.cover.full, n.cover.partial), (vec![n0], vec![]));

        // Without its own node the agent cannot tell host apart.
        let mut c = NodeClasses::default();
        c.set_keys([&host]);
        c.set_node("n0", labels(&[("host", "n0")]));
        c.set_node("n1", labels(&[("host", "n1")]));
        regroup(&mut c, &mut Ids::default());
        let n = c.cover(&[&host]).unwrap();
        let n0 = c.identity("n0");
        assert_eq!(
            (n.cover.full, n.cover.partial),
            (vec![n0], vec![IDENTITY_HOST])
        );
        assert!(c.mixed_reason().contains("own node"));
        // Every node selected: host too, exactly.
        let any = LabelSelector::new(vec![]);
        let n = c.cover(&[&any]).unwrap();
        assert!(n.cover.partial.is_empty());
        assert!(n.cover.full.contains(&IDENTITY_HOST));
    }
}
