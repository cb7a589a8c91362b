//! Per-endpoint state on disk (`STATE_DIR/<endpoint-id>/endpoint.json`) and the state-directory
//! lock that keeps a second agent away.
//!
//! Writes are atomic: the new state goes into a fresh directory that then replaces the old one
//! with `renameat2(RENAME_EXCHANGE)`, so a crash leaves either the old or the new state, never a
//! torn file.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{renameat2, Flock, FlockArg, RenameFlags, AT_FDCWD};
use serde::{Deserialize, Serialize};

use crate::datapath::EndpointId;
use crate::policy::identity::NumericIdentity;

const STATE_FILE: &str = "endpoint.json";
const LOCK_FILE: &str = "ciliate.lock";

/// What is kept of an endpoint across agent restarts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointRecord {
    pub id: EndpointId,
    /// `namespace/pod`.
    pub name: String,
    pub ips: Vec<IpAddr>,
    pub interface: Option<String>,
    pub identity: Option<NumericIdentity>,
    /// The identity's labels (`source:key=value`), to re-create the same identity on restore.
    pub labels: Vec<String>,
    pub policy_revision: u64,
    /// CNI fields, when the endpoint was created through the plugin.
    #[serde(default)]
    pub container_id: Option<String>,
    #[serde(default)]
    pub netns: Option<String>,
}

/// Errors of the state directory, naming the path concerned.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("another agent (pid {pid}) holds {path}; stop it or use another --state-dir")]
    Locked { path: PathBuf, pid: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StateError + '_ {
    move |source| StateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The state directory.
#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn open(root: &Path) -> Result<Self, StateError> {
        fs::create_dir_all(root).map_err(io(root))?;
        Ok(StateDir {
            root: root.to_path_buf(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn endpoint_dir(&self, id: EndpointId) -> PathBuf {
        self.root.join(id.to_string())
    }

    /// Writes an endpoint's state atomically.
    pub fn write(&self, rec: &EndpointRecord) -> Result<(), StateError> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let tmp = self.root.join(format!(".tmp-{}-{nanos}", rec.id));
        fs::create_dir(&tmp).map_err(io(&tmp))?;
        let file = tmp.join(STATE_FILE);
        let body = serde_json::to_vec_pretty(rec).map_err(|e| StateError::Invalid {
            path: file.clone(),
            message: e.to_string(),
        })?;
        {
            let mut f = File::create(&file).map_err(io(&file))?;
            f.write_all(&body).map_err(io(&file))?;
            f.sync_all().map_err(io(&file))?;
        }
        let dst = self.endpoint_dir(rec.id);
        if dst.exists() {
            renameat2(AT_FDCWD, &tmp, AT_FDCWD, &dst, RenameFlags::RENAME_EXCHANGE).map_err(
                |e| StateError::Io {
                    path: dst.clone(),
                    source: e.into(),
                },
            )?;
            // `tmp` now holds the previous state.
            fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
        } else {
            fs::rename(&tmp, &dst).map_err(io(&dst))?;
        }
        if let Ok(d) = File::open(&self.root) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    pub fn remove(&self, id: EndpointId) -> Result<(), StateError> {
        let d = self.endpoint_dir(id);
        match fs::remove_dir_all(&d) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StateError::Io { path: d, source: e }),
        }
    }

    /// Every stored endpoint, plus one error per directory that could not be read (those are
    /// left in place for a human to look at). Leftover temporary directories are removed.
    pub fn load_all(&self) -> (Vec<EndpointRecord>, Vec<StateError>) {
        let (mut recs, mut errs) = (Vec::new(), Vec::new());
        let entries = match fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) => {
                return (
                    recs,
                    vec![StateError::Io {
                        path: self.root.clone(),
                        source: e,
                    }],
                )
            }
        };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with(".tmp-") {
                let _ = fs::remove_dir_all(&path);
                continue;
            }
            let Ok(id) = name.parse::<EndpointId>() else {
                continue;
            };
            let file = path.join(STATE_FILE);
            let mut text = String::new();
            if let Err(err) = File::open(&file).and_then(|mut f| f.read_to_string(&mut text)) {
                errs.push(StateError::Io {
                    path: file,
                    source: err,
                });
                continue;
            }
            match serde_json::from_str::<EndpointRecord>(&text) {
                Ok(r) if r.id == id => recs.push(r),
                Ok(r) => errs.push(StateError::Invalid {
                    path: file,
                    message: format!("holds endpoint {} in directory {id}", r.id),
                }),
                Err(err) => errs.push(StateError::Invalid {
                    path: file,
                    message: err.to_string(),
                }),
            }
        }
        recs.sort_by_key(|r| r.id);
        (recs, errs)
    }
}

/// An exclusive lock on the state directory, held for the agent's lifetime.
pub struct StateLock {
    _lock: Flock<File>,
}

impl StateLock {
    pub fn acquire(root: &Path) -> Result<StateLock, StateError> {
        fs::create_dir_all(root).map_err(io(root))?;
        let path = root.join(LOCK_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&path)
            .map_err(io(&path))?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(mut lock) => {
                let _ = lock.set_len(0);
                let _ = writeln!(&mut *lock, "{}", std::process::id());
                let _ = lock.sync_all();
                Ok(StateLock { _lock: lock })
            }
            Err((_, _)) => {
                let pid = fs::read_to_string(&path)
                    .map(|s| s.trim().to_string())
                    .unwrap_or_else(|_| "unknown".into());
                Err(StateError::Locked { path, pid })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: EndpointId, rev: u64) -> EndpointRecord {
        EndpointRecord {
            id,
            name: "x/a".into(),
            ips: vec!["10.0.0.1".parse().unwrap()],
            interface: Some("lxc1".into()),
            identity: Some(300),
            labels: vec!["k8s:app=a".into()],
            policy_revision: rev,
            container_id: None,
            netns: None,
        }
    }

    #[test]
    fn write_replace_load_remove() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateDir::open(dir.path()).unwrap();
        s.write(&rec(7, 1)).unwrap();
        s.write(&rec(7, 2)).unwrap();
        s.write(&rec(9, 1)).unwrap();
        fs::create_dir(dir.path().join(".tmp-7-123")).unwrap();
        fs::create_dir(dir.path().join("12")).unwrap();
        fs::write(dir.path().join("12/endpoint.json"), "{not json").unwrap();
        let (recs, errs) = s.load_all();
        assert_eq!(recs, vec![rec(7, 2), rec(9, 1)]);
        assert_eq!(errs.len(), 1);
        assert!(errs[0].to_string().contains("12/endpoint.json"));
        assert!(!dir.path().join(".tmp-7-123").exists());
        s.remove(7).unwrap();
        s.remove(7).unwrap();
        assert_eq!(s.load_all().0, vec![rec(9, 1)]);
    }

    #[test]
    fn second_lock_is_refused_with_the_holder_pid() {
        let dir = tempfile::tempdir().unwrap();
        let _held = StateLock::acquire(dir.path()).unwrap();
        let err = StateLock::acquire(dir.path())
            .err()
            .expect("second lock refused");
        assert!(
            err.to_string().contains(&std::process::id().to_string()),
            "{err}"
        );
    }
}
