//! The manifest directory of standalone mode: what it accepts ([`read`]), how documents merge
//! across files ([`merge`]), and the [`Scanner`] that turns a look at the directory into the
//! [`Delta`] to deliver. No actors here: `actors::watcher` runs a scanner on a thread of its
//! own and forwards its deltas.

pub mod merge;
pub mod read;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_yaml::Value;

use crate::objects::Kind;
use crate::policy::translate::Document;

pub use merge::{Delta, Doc, Duplicate, FileUpdate, ManifestSet, ObjKey, Upsert};
pub use read::{IoWorker, Limits};

/// The namespace of a namespaced object whose manifest names none.
pub const DEFAULT_NAMESPACE: &str = "default";

/// Where a kind goes in the apply order; `None` for kinds the agent does not use.
pub fn kind_order(kind: &str) -> Option<u8> {
    Kind::parse(kind).map(|k| k as u8)
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    let mut v = v;
    for p in path {
        v = v.get(p)?;
    }
    v.as_str()
}

/// The object a document defines, if it is of a kind the agent uses.
pub fn object_key(doc: &Value) -> Option<ObjKey> {
    let kind = str_at(doc, &["kind"])?;
    let order = kind_order(kind)?;
    let name = str_at(doc, &["metadata", "name"]).unwrap_or("").to_string();
    let namespace = if Kind::parse(kind).is_some_and(Kind::cluster_scoped) {
        String::new()
    } else {
        str_at(doc, &["metadata", "namespace"])
            .filter(|s| !s.is_empty())
            .unwrap_or(DEFAULT_NAMESPACE)
            .to_string()
    };
    Some(ObjKey {
        order,
        kind: kind.to_string(),
        namespace,
        name,
    })
}

/// A document's content as kept between scans: compact YAML text, parsed again only when it is
/// delivered.
pub type Body = Arc<str>;

/// Parses one file into the documents the agent uses (a `kind: List` contributes its items).
/// At most `budget` documents: a file with more is refused whole.
pub fn parse_documents(bytes: &[u8], budget: usize) -> Result<Vec<Doc<Body>>, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))?;
    let mut docs = Vec::new();
    let push = |v: &Value, docs: &mut Vec<Doc<Body>>| -> Result<(), String> {
        let Some(key) = object_key(v) else {
            return Ok(());
        };
        if docs.len() >= budget {
            return Err(format!(
                "more documents than the directory may still hold ({budget} left of \
                 --manifest-max-documents)"
            ));
        }
        let body = serde_yaml::to_string(v).map_err(|e| format!("not usable YAML: {e}"))?;
        docs.push(Doc {
            key,
            hash: hash_of(&body),
            body: body.into(),
        });
        Ok(())
    };
    for de in serde_yaml::Deserializer::from_str(text) {
        // Read as `Document`: an integer beyond 64 bits rejects its object, not the file.
        let Document(v) =
            serde::Deserialize::deserialize(de).map_err(|e| format!("not valid YAML: {e}"))?;
        if str_at(&v, &["kind"]) == Some("List") {
            if let Some(items) = v.get("items").and_then(Value::as_sequence) {
                for item in items {
                    push(item, &mut docs)?;
                }
            }
        } else if !v.is_null() {
            push(&v, &mut docs)?;
        }
    }
    Ok(docs)
}

fn hash_of(s: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    s.hash(&mut h);
    h.finish()
}

/// What the scanner remembers of a file it read.
#[derive(Debug, Clone, Copy)]
struct Seen {
    stamp: read::Stamp,
    /// Seconds since the epoch when it was read.
    read_at: i64,
}

/// Looks at a manifest directory and says what changed since the last look.
///
/// Each scan lists the directory (stat only) and reads just the files whose stamp changed, so a
/// scan costs the directory's size in `stat` calls plus the documents of the changed files.
pub struct Scanner {
    root: PathBuf,
    limits: Limits,
    io: IoWorker,
    set: ManifestSet<Body>,
    seen: HashMap<Arc<str>, Seen>,
    /// Documents held in all files, against `limits.max_documents`.
    documents: usize,
}

/// What one scan did, for logs and the journal.
#[derive(Debug, Default, Clone, Copy)]
pub struct ScanStats {
    pub files: usize,
    pub read: usize,
    pub refused: usize,
    pub objects: usize,
}

impl Scanner {
    pub fn new(root: PathBuf, limits: Limits) -> Scanner {
        Scanner {
            io: IoWorker::new(limits.io_timeout),
            root,
            limits,
            set: ManifestSet::default(),
            seen: HashMap::new(),
            documents: 0,
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Looks at the directory and returns what to deliver. An error means the directory itself
    /// could not be listed: nothing changes then.
    pub fn scan(&mut self) -> Result<(Delta<Body>, ScanStats), String> {
        let listing = read::walk(&mut self.io, &self.root, &self.limits)?;
        let now = now_secs();
        let mut stats = ScanStats {
            files: listing.files.len(),
            refused: listing.refused.len(),
            ..ScanStats::default()
        };
        let mut present: HashSet<Arc<str>> = HashSet::with_capacity(listing.files.len());
        present.extend(listing.refused.iter().map(|(rel, _)| rel.clone()));
        present.extend(listing.files.iter().map(|f| f.rel.clone()));
        // Files gone from the directory (and refusals that are gone) first: they make room
        // under the document cap for the files read below.
        let mut updates: Vec<(Arc<str>, FileUpdate<Body>)> = Vec::new();
        for rel in self.set.files() {
            if !present.contains(rel) {
                updates.push((rel.clone(), FileUpdate::Removed));
            }
        }
        for (rel, _) in &updates {
            self.seen.remove(rel);
            self.documents -= self.set.documents_of(rel);
        }
        for (rel, why) in listing.refused {
            self.seen.remove(&rel);
            updates.push((rel, FileUpdate::Failed(why)));
        }
        for f in listing.files {
            let unchanged = self
                .seen
                .get(&f.rel)
                .is_some_and(|s| s.stamp == f.stamp && !s.stamp.racy(s.read_at));
            if unchanged {
                continue;
            }
            stats.read += 1;
            let update = self.read(&f, now);
            updates.push((f.rel, update));
        }
        let delta = self.set.apply(updates);
        stats.objects = self.set.objects();
        Ok((delta, stats))
    }

    /// Reads and parses one changed file within the document budget.
    fn read(&mut self, f: &read::Found, now: i64) -> FileUpdate<Body> {
        let held = self.set.documents_of(&f.rel);
        let budget = self.limits.max_documents - (self.documents - held);
        let parsed = self
            .io
            .read_file(&f.path, self.limits.max_file_bytes)
            .and_then(|(stamp, bytes)| Ok((stamp, parse_documents(&bytes, budget)?)));
        match parsed {
            Ok((stamp, docs)) => {
                self.seen.insert(
                    f.rel.clone(),
                    Seen {
                        stamp,
                        read_at: now,
                    },
                );
                // The merge keeps one definition per object and file.
                let distinct: HashSet<&ObjKey> = docs.iter().map(|d| &d.key).collect();
                self.documents = self.documents - held + distinct.len();
                FileUpdate::Parsed(docs)
            }
            Err(e) => {
                // Read again at the next scan, whatever its stamp.
                self.seen.remove(&f.rel);
                FileUpdate::Failed(e)
            }
        }
    }
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: &str = "apiVersion: v1\nkind: Pod\nmetadata: {name: a, namespace: shop}\n";

    fn scanner(dir: &Path) -> Scanner {
        Scanner::new(dir.to_path_buf(), Limits::default())
    }

    #[test]
    fn documents_of_unused_kinds_are_skipped_and_lists_contribute_their_items() {
        let text = format!(
            "{POD}---\nkind: ConfigMap\nmetadata: {{name: c}}\n---\n\
             kind: List\nitems:\n- {{kind: Namespace, metadata: {{name: shop}}}}\n"
        );
        let docs = parse_documents(text.as_bytes(), 10).unwrap();
        let keys: Vec<String> = docs.iter().map(|d| d.key.to_string()).collect();
        assert_eq!(keys, vec!["Pod shop/a", "Namespace shop"]);
        let err = parse_documents(text.as_bytes(), 1).unwrap_err();
        assert!(err.contains("--manifest-max-documents"), "{err}");
        assert!(parse_documents(b"\xff\xfe", 10)
            .unwrap_err()
            .contains("UTF-8"));
    }

    #[test]
    fn an_integer_beyond_64_bits_is_its_documents_problem_not_the_files() {
        // serde_yaml's own Value refuses such an integer: the whole file was "not valid YAML".
        let text = format!(
            "{POD}---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {{name: n, namespace: shop}}\n\
             spec: {{podSelector: {{}}, ingress: [{{ports: [{{port: 99999999999999999999999}}]}}]}}\n"
        );
        let docs = parse_documents(text.as_bytes(), 10).unwrap();
        let keys: Vec<String> = docs.iter().map(|d| d.key.to_string()).collect();
        assert_eq!(keys, vec!["Pod shop/a", "NetworkPolicy shop/n"]);
        // The policy's own validation then refuses the field, by name.
        let body: Value = serde_yaml::from_str(&docs[1].body).unwrap();
        let err = crate::policy::translate::parse_policy(&body, "default", "n").unwrap_err();
        assert!(
            err.to_string().contains("spec.ingress[0].ports[0].port"),
            "{err}"
        );
    }

    #[test]
    fn an_unchanged_file_is_not_read_again_and_an_edit_is_seen() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("pods.yaml");
        std::fs::write(&f, POD).unwrap();
        let mut s = scanner(d.path());
        let (delta, stats) = s.scan().unwrap();
        assert_eq!((delta.upserts.len(), stats.read), (1, 1));
        // Make the stamp old enough not to be racy, then scan again: nothing is read.
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(10);
        std::fs::File::options()
            .write(true)
            .open(&f)
            .unwrap()
            .set_modified(old)
            .unwrap();
        s.scan().unwrap();
        let (delta, stats) = s.scan().unwrap();
        assert_eq!((delta.upserts.len(), stats.read), (0, 0));
        std::fs::write(&f, POD.replace("name: a", "name: b")).unwrap();
        let (delta, _) = s.scan().unwrap();
        assert_eq!(delta.upserts.len(), 1);
        assert_eq!(delta.deletes.len(), 1);
    }

    #[test]
    fn the_document_cap_refuses_the_file_that_would_exceed_it() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a.yaml"), POD).unwrap();
        let two = format!(
            "{}---\n{}",
            POD.replace("name: a", "name: b"),
            POD.replace("name: a", "name: c")
        );
        std::fs::write(d.path().join("b.yaml"), two).unwrap();
        let mut s = Scanner::new(
            d.path().to_path_buf(),
            Limits {
                max_documents: 2,
                ..Limits::default()
            },
        );
        let (delta, _) = s.scan().unwrap();
        assert_eq!(delta.upserts.len(), 1);
        assert_eq!(&*delta.status[0].0, "b.yaml");
        // Removing the first file makes room.
        std::fs::remove_file(d.path().join("a.yaml")).unwrap();
        let (delta, _) = s.scan().unwrap();
        assert_eq!((delta.deletes.len(), delta.upserts.len()), (1, 2));
        assert_eq!(delta.status, vec![("b.yaml".into(), None)]);
    }
}
