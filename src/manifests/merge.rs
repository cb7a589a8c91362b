//! What a manifest directory says, merged across its files: pure, no I/O.
//!
//! Each file holds documents; each document is one object, named by an [`ObjKey`]. An object
//! may be defined in several files (or twice in one). The rule, documented in the README:
//! - the definition from the file **last in sort order** of its path relative to the directory
//!   wins, and within one file the **last** document wins;
//! - removing (or emptying) the winning file restores the next definition in that order;
//! - a file that can no longer be read or parsed keeps the objects it held when it last parsed,
//!   and they take part in the merge as before.
//!
//! [`ManifestSet::apply`] takes what changed in some files and returns the [`Delta`] that brings
//! the delivered state (what the agent was last told) to what the directory now says. Its cost is
//! linear in the documents of the changed files (plus a sort of the objects they touch), whatever
//! the size of the rest of the directory.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Names an object: apply order first (namespaces before pods, pods before policies), so that
/// sorting keys sorts a batch into dependency order.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjKey {
    pub order: u8,
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ObjKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{} {}", self.kind, self.name)
        } else {
            write!(f, "{} {}/{}", self.kind, self.namespace, self.name)
        }
    }
}

/// One document of a file: its object, a hash of its content and the content itself.
#[derive(Debug, Clone)]
pub struct Doc<B> {
    pub key: ObjKey,
    pub hash: u64,
    pub body: B,
}

/// What became of one file since the last [`ManifestSet::apply`].
#[derive(Debug, Clone)]
pub enum FileUpdate<B> {
    /// Read and parsed: these are all its documents now, in file order.
    Parsed(Vec<Doc<B>>),
    /// Could not be read or parsed (or was refused): its previous objects stay.
    Failed(String),
    /// Gone from the directory: its objects go with it.
    Removed,
}

/// Bring the delivered state to what the directory says.
#[derive(Debug)]
pub struct Delta<B> {
    /// Objects no file defines any more, in reverse apply order (policies before pods).
    pub deletes: Vec<ObjKey>,
    /// Objects whose winning definition is new or changed, in apply order.
    pub upserts: Vec<Upsert<B>>,
    /// Files whose error changed: `Some` (newly failing or a new error) or `None` (fine again,
    /// or removed).
    pub status: Vec<(Arc<str>, Option<String>)>,
    /// Objects touched by this change that are defined more than once.
    pub duplicates: Vec<Duplicate>,
}

impl<B> Delta<B> {
    pub fn is_empty(&self) -> bool {
        self.deletes.is_empty() && self.upserts.is_empty() && self.status.is_empty()
    }
}

/// An object to deliver: the winning definition.
#[derive(Debug, Clone)]
pub struct Upsert<B> {
    pub key: ObjKey,
    pub body: B,
    /// `file#index`: where the winning document is.
    pub location: String,
}

/// An object defined more than once, with the definition that wins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Duplicate {
    pub key: ObjKey,
    pub winner: String,
    pub shadowed: Vec<String>,
}

/// One file's definition of an object.
#[derive(Debug, Clone)]
struct Def<B> {
    file: Arc<str>,
    index: usize,
    hash: u64,
    body: B,
}

impl<B> Def<B> {
    fn location(&self) -> String {
        format!("{}#{}", self.file, self.index)
    }
}

#[derive(Debug, Default)]
struct FileEntry {
    /// The objects this file defines (each once).
    keys: Vec<ObjKey>,
    error: Option<String>,
}

/// The merged state of a manifest directory and what was last delivered from it.
#[derive(Debug)]
pub struct ManifestSet<B> {
    files: HashMap<Arc<str>, FileEntry>,
    /// Every definition of each object, one per file (usually exactly one).
    defs: HashMap<ObjKey, Vec<Def<B>>>,
    /// What was last delivered for each object: content hash and the file it came from.
    delivered: HashMap<ObjKey, (u64, Arc<str>)>,
}

impl<B> Default for ManifestSet<B> {
    fn default() -> Self {
        ManifestSet {
            files: HashMap::new(),
            defs: HashMap::new(),
            delivered: HashMap::new(),
        }
    }
}

impl<B: Clone> ManifestSet<B> {
    /// How many objects the directory defines.
    pub fn objects(&self) -> usize {
        self.defs.len()
    }

    /// How many documents `file` contributes (0 for an unknown file).
    pub fn documents_of(&self, file: &str) -> usize {
        self.files.get(file).map_or(0, |f| f.keys.len())
    }

    /// The files known, with their current error.
    pub fn file_errors(&self) -> impl Iterator<Item = (&Arc<str>, &String)> {
        self.files
            .iter()
            .filter_map(|(f, e)| e.error.as_ref().map(|e| (f, e)))
    }

    /// Whether `file` is known (it was found at the last apply that mentioned it).
    pub fn has_file(&self, file: &str) -> bool {
        self.files.contains_key(file)
    }

    /// The files known.
    pub fn files(&self) -> impl Iterator<Item = &Arc<str>> {
        self.files.keys()
    }

    /// Applies what changed in some files and returns what to deliver.
    pub fn apply(
        &mut self,
        updates: impl IntoIterator<Item = (Arc<str>, FileUpdate<B>)>,
    ) -> Delta<B> {
        let mut touched: HashSet<ObjKey> = HashSet::new();
        let mut status = Vec::new();
        let mut duplicates = Vec::new();
        for (file, update) in updates {
            match update {
                FileUpdate::Removed => {
                    if let Some(entry) = self.files.remove(&file) {
                        self.forget(&file, entry.keys, &mut touched);
                        if entry.error.is_some() {
                            status.push((file, None));
                        }
                    }
                }
                FileUpdate::Failed(error) => {
                    let entry = self.files.entry(file.clone()).or_default();
                    if entry.error.as_ref() != Some(&error) {
                        entry.error = Some(error.clone());
                        status.push((file, Some(error)));
                    }
                }
                FileUpdate::Parsed(docs) => {
                    let entry = self.files.entry(file.clone()).or_default();
                    if entry.error.take().is_some() {
                        status.push((file.clone(), None));
                    }
                    let old = std::mem::take(&mut entry.keys);
                    self.forget(&file, old, &mut touched);
                    let keys = self.define(&file, docs, &mut touched, &mut duplicates);
                    if let Some(entry) = self.files.get_mut(&file) {
                        entry.keys = keys;
                    }
                }
            }
        }
        let mut touched: Vec<ObjKey> = touched.into_iter().collect();
        touched.sort_unstable();
        let mut deletes = Vec::new();
        let mut upserts = Vec::new();
        for key in touched {
            let winner = self.defs.get(&key).and_then(|defs| {
                if defs.len() > 1 {
                    duplicates.push(duplicate(&key, defs));
                }
                winner(defs)
            });
            match winner {
                None => {
                    if self.delivered.remove(&key).is_some() {
                        deletes.push(key);
                    }
                }
                Some(w) => {
                    let now = (w.hash, w.file.clone());
                    if self.delivered.get(&key) != Some(&now) {
                        upserts.push(Upsert {
                            key: key.clone(),
                            body: w.body.clone(),
                            location: w.location(),
                        });
                        self.delivered.insert(key, now);
                    }
                }
            }
        }
        deletes.reverse();
        Delta {
            deletes,
            upserts,
            status,
            duplicates,
        }
    }

    /// Drops `file`'s definitions of `keys`.
    fn forget(&mut self, file: &Arc<str>, keys: Vec<ObjKey>, touched: &mut HashSet<ObjKey>) {
        for key in keys {
            if let Some(defs) = self.defs.get_mut(&key) {
                defs.retain(|d| d.file != *file);
                if defs.is_empty() {
                    self.defs.remove(&key);
                }
            }
            touched.insert(key);
        }
    }

    /// Records `file`'s documents (the last of several for one object wins) and returns the
    /// objects it defines.
    fn define(
        &mut self,
        file: &Arc<str>,
        docs: Vec<Doc<B>>,
        touched: &mut HashSet<ObjKey>,
        duplicates: &mut Vec<Duplicate>,
    ) -> Vec<ObjKey> {
        let mut at: HashMap<ObjKey, usize> = HashMap::with_capacity(docs.len());
        let mut mine: Vec<Def<B>> = Vec::with_capacity(docs.len());
        let mut keys: Vec<ObjKey> = Vec::with_capacity(docs.len());
        for (index, doc) in docs.into_iter().enumerate() {
            let def = Def {
                file: file.clone(),
                index,
                hash: doc.hash,
                body: doc.body,
            };
            match at.get(&doc.key) {
                Some(&i) => {
                    duplicates.push(Duplicate {
                        key: doc.key.clone(),
                        winner: def.location(),
                        shadowed: vec![mine[i].location()],
                    });
                    mine[i] = def;
                }
                None => {
                    at.insert(doc.key.clone(), mine.len());
                    mine.push(def);
                    keys.push(doc.key);
                }
            }
        }
        for (key, def) in keys.iter().zip(mine) {
            self.defs.entry(key.clone()).or_default().push(def);
            touched.insert(key.clone());
        }
        keys
    }
}

/// The definition from the file last in sort order.
fn winner<B>(defs: &[Def<B>]) -> Option<&Def<B>> {
    defs.iter().max_by(|a, b| a.file.cmp(&b.file))
}

fn duplicate<B>(key: &ObjKey, defs: &[Def<B>]) -> Duplicate {
    let mut locations: Vec<(&Arc<str>, String)> =
        defs.iter().map(|d| (&d.file, d.location())).collect();
    locations.sort();
    let winner = locations.pop().map(|(_, l)| l).unwrap_or_default();
    Duplicate {
        key: key.clone(),
        winner,
        shadowed: locations.into_iter().map(|(_, l)| l).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn key(name: &str) -> ObjKey {
        ObjKey {
            order: 4,
            kind: "NetworkPolicy".into(),
            namespace: "shop".into(),
            name: name.into(),
        }
    }

    fn doc(name: &str, content: u32) -> Doc<u32> {
        Doc {
            key: key(name),
            hash: u64::from(content),
            body: content,
        }
    }

    fn parsed(file: &str, docs: Vec<Doc<u32>>) -> (Arc<str>, FileUpdate<u32>) {
        (file.into(), FileUpdate::Parsed(docs))
    }

    fn removed(file: &str) -> (Arc<str>, FileUpdate<u32>) {
        (file.into(), FileUpdate::Removed)
    }

    /// The delivered state, as a consumer of the deltas sees it.
    #[derive(Default)]
    struct Consumer(BTreeMap<ObjKey, (u32, String)>);

    impl Consumer {
        fn take(&mut self, delta: Delta<u32>) {
            for k in delta.deletes {
                assert!(self.0.remove(&k).is_some(), "delete of {k} never delivered");
            }
            for u in delta.upserts {
                let file = u.location.split('#').next().unwrap_or_default().to_string();
                self.0.insert(u.key, (u.body, file));
            }
        }
    }

    #[test]
    fn a_duplicate_in_an_earlier_file_does_not_replace_the_later_files_object() {
        // Item 1 of the hardening issue: policies.yaml holds the enforcing version; 00-dup.yaml,
        // earlier in sort order, holds a weaker one. The later file wins, whatever arrives when.
        let mut set = ManifestSet::default();
        let mut seen = Consumer::default();
        seen.take(set.apply([parsed("policies.yaml", vec![doc("default-deny", 1)])]));
        let delta = set.apply([parsed("00-dup.yaml", vec![doc("default-deny", 2)])]);
        assert!(
            delta.upserts.is_empty(),
            "the shadowed duplicate was delivered"
        );
        assert_eq!(
            delta.duplicates,
            vec![Duplicate {
                key: key("default-deny"),
                winner: "policies.yaml#0".into(),
                shadowed: vec!["00-dup.yaml#0".into()],
            }]
        );
        seen.take(delta);
        assert_eq!(seen.0[&key("default-deny")], (1, "policies.yaml".into()));
        seen.take(set.apply([removed("00-dup.yaml")]));
        assert_eq!(seen.0[&key("default-deny")], (1, "policies.yaml".into()));
    }

    #[test]
    fn removing_the_winning_file_restores_the_other_definition() {
        let mut set = ManifestSet::default();
        let mut seen = Consumer::default();
        seen.take(set.apply([
            parsed("a.yaml", vec![doc("p", 1)]),
            parsed("b.yaml", vec![doc("p", 2)]),
        ]));
        assert_eq!(seen.0[&key("p")], (2, "b.yaml".into()));
        let delta = set.apply([removed("b.yaml")]);
        assert_eq!(delta.upserts.len(), 1);
        seen.take(delta);
        assert_eq!(seen.0[&key("p")], (1, "a.yaml".into()));
        let delta = set.apply([removed("a.yaml")]);
        assert_eq!(delta.deletes, vec![key("p")]);
        seen.take(delta);
        assert!(seen.0.is_empty());
    }

    #[test]
    fn within_a_file_the_last_document_wins() {
        let mut set = ManifestSet::default();
        let delta = set.apply([parsed("a.yaml", vec![doc("p", 1), doc("p", 2)])]);
        assert_eq!(delta.upserts.len(), 1);
        assert_eq!(delta.upserts[0].body, 2);
        assert_eq!(delta.upserts[0].location, "a.yaml#1");
        assert_eq!(delta.duplicates[0].shadowed, vec!["a.yaml#0".to_string()]);
        assert_eq!(set.documents_of("a.yaml"), 1);
    }

    #[test]
    fn a_failing_file_keeps_its_objects_and_its_error_is_reported_once() {
        let mut set = ManifestSet::default();
        set.apply([parsed("a.yaml", vec![doc("p", 1)])]);
        let failed = || ("a.yaml".into(), FileUpdate::Failed("not valid YAML".into()));
        let delta = set.apply([failed()]);
        assert!(delta.deletes.is_empty() && delta.upserts.is_empty());
        assert_eq!(
            delta.status,
            vec![("a.yaml".into(), Some("not valid YAML".to_string()))]
        );
        assert!(set.apply([failed()]).is_empty(), "the same error twice");
        let delta = set.apply([parsed("a.yaml", vec![doc("p", 1)])]);
        assert_eq!(delta.status, vec![("a.yaml".into(), None)]);
        assert!(
            delta.upserts.is_empty(),
            "unchanged content is not delivered again"
        );
    }

    #[test]
    fn deletes_come_in_reverse_apply_order_and_upserts_in_apply_order() {
        let ns = ObjKey {
            order: 0,
            kind: "Namespace".into(),
            namespace: String::new(),
            name: "shop".into(),
        };
        let mut set = ManifestSet::default();
        let delta = set.apply([parsed(
            "a.yaml",
            vec![
                doc("p", 1),
                Doc {
                    key: ns.clone(),
                    hash: 7,
                    body: 7,
                },
            ],
        )]);
        let order: Vec<_> = delta.upserts.iter().map(|u| u.key.order).collect();
        assert_eq!(order, vec![0, 4]);
        let delta = set.apply([removed("a.yaml")]);
        assert_eq!(delta.deletes, vec![key("p"), ns]);
    }

    mod model {
        //! The property test that would have caught the duplicate bug: random sequences of file
        //! writes, edits, failures and removals, checked after every step against a small
        //! reference model of what the directory says.
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            /// Write (or rewrite) a file with these (object, content) documents.
            Write(usize, Vec<(usize, u32)>),
            /// The file stops parsing.
            Break(usize),
            Remove(usize),
        }

        const FILES: [&str; 4] = ["00-dup.yaml", "a/policies.yaml", "b.yaml", "policies.yaml"];
        const NAMES: [&str; 3] = ["p", "q", "r"];

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0..FILES.len(), prop::collection::vec((0..NAMES.len(), 0u32..3), 0..4))
                    .prop_map(|(f, docs)| Op::Write(f, docs)),
                1 => (0..FILES.len()).prop_map(Op::Break),
                2 => (0..FILES.len()).prop_map(Op::Remove),
            ]
        }

        /// What the directory says: each present file's last good documents.
        fn expected(files: &BTreeMap<&str, Vec<(usize, u32)>>) -> BTreeMap<ObjKey, (u32, String)> {
            let mut out = BTreeMap::new();
            // Files in sort order, documents in file order: a later one overwrites.
            for (file, docs) in files {
                for (name, content) in docs {
                    out.insert(key(NAMES[*name]), (*content, file.to_string()));
                }
            }
            out
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]
            #[test]
            fn the_delivered_state_is_always_what_the_directory_says(
                ops in prop::collection::vec(op(), 1..40),
                batch in 1usize..4,
            ) {
                let mut set = ManifestSet::default();
                let mut seen = Consumer::default();
                let mut files: BTreeMap<&str, Vec<(usize, u32)>> = BTreeMap::new();
                // Several operations may reach one apply (one rescan sees several edits).
                for chunk in ops.chunks(batch) {
                    let mut updates = Vec::new();
                    for op in chunk {
                        match op {
                            Op::Write(f, docs) => {
                                files.insert(FILES[*f], docs.clone());
                                let docs = docs.iter().map(|(n, c)| doc(NAMES[*n], *c)).collect();
                                updates.push(parsed(FILES[*f], docs));
                            }
                            Op::Break(f) => {
                                // A file that never parsed holds nothing; one that did keeps
                                // its last good documents.
                                files.entry(FILES[*f]).or_default();
                                updates.push((FILES[*f].into(), FileUpdate::Failed("bad".into())));
                            }
                            Op::Remove(f) => {
                                files.remove(FILES[*f]);
                                updates.push(removed(FILES[*f]));
                            }
                        }
                    }
                    seen.take(set.apply(updates));
                    prop_assert_eq!(&seen.0, &expected(&files));
                    prop_assert_eq!(set.objects(), seen.0.len());
                }
                // Nothing changed: nothing to deliver.
                let again: Vec<_> = files
                    .iter()
                    .map(|(f, docs)| parsed(f, docs.iter().map(|(n, c)| doc(NAMES[*n], *c)).collect()))
                    .collect();
                let delta = set.apply(again);
                prop_assert!(delta.upserts.is_empty() && delta.deletes.is_empty());
            }
        }
    }
}
