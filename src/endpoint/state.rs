//! Per-endpoint state on disk (`STATE_DIR/<endpoint-id>/endpoint.json`), the intent records of
//! CNI ADDs in progress (`STATE_DIR/cni-adds/<container-id>.json`), and the state-directory
//! lock that keeps a second agent away.
//!
//! Writes are atomic: the new state goes into a fresh directory that then replaces the old one
//! with `renameat2(RENAME_EXCHANGE)`, so a crash leaves either the old or the new state, never a
//! torn file. An intent record is written to a temporary file and linked into place with
//! `renameat2(RENAME_NOREPLACE)`: it appears whole or not at all, and a second ADD of the same
//! container finds the first one's record.

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
/// Where the intent records of CNI ADDs in progress live.
const INTENTS_DIR: &str = "cni-adds";
/// Prefix of an endpoint directory set aside by restore (kept for a human, never restored).
const REJECTED_PREFIX: &str = "rejected-";

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
    /// The pod interface's MAC, when the CNI plugin made it (records of older versions have
    /// none: their pods are then reached through the host stack only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// `ciliate endpoint config ID PolicyAuditMode=Enabled`: this endpoint audits.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub audit: bool,
    /// The node's own endpoint (`--enable-host-firewall`, `endpoint::host`): re-created by the
    /// agent at start, never restored as a pod.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub host: bool,
}

/// A CNI ADD in progress, recorded before anything is created for the container and removed once
/// its endpoint record is on disk. A record left behind by a crash tells the next agent what to
/// roll back: the host veth (if it is still this agent's) and the address, which stays reserved
/// until the rollback is done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddIntent {
    pub container_id: String,
    /// The host side of the veth pair the ADD creates.
    pub host_if: String,
    /// The address IPAM handed out for it (the first family's).
    pub ip: IpAddr,
    /// The addresses of the other families (dual stack); absent in records of agents that
    /// handed out one address.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub more_ips: Vec<IpAddr>,
    pub netns: String,
    pub ifname: String,
    /// The agent run that wrote it: a record of another run is a leftover of a crash.
    pub run: String,
}

impl AddIntent {
    /// Every address the ADD was handed.
    pub fn ips(&self) -> Vec<IpAddr> {
        std::iter::once(self.ip)
            .chain(self.more_ips.iter().copied())
            .collect()
    }
}

/// A restored endpoint record that was refused because an address it claims is claimed by an
/// earlier (lower id) record: two live endpoints never share an address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("endpoint {id} ({name}) claims {ip}, which endpoint {holder} already holds")]
pub struct DuplicateIp {
    pub id: EndpointId,
    pub name: String,
    pub ip: IpAddr,
    pub holder: EndpointId,
}

/// Splits restored records (sorted by id, as `load_all` returns them) into those to restore and
/// those refused: the lowest id claiming an address keeps it, every later record claiming any
/// address already kept is refused whole.
pub fn partition_duplicate_ips(
    records: Vec<EndpointRecord>,
) -> (Vec<EndpointRecord>, Vec<(EndpointRecord, DuplicateIp)>) {
    let mut holders: std::collections::BTreeMap<IpAddr, EndpointId> = Default::default();
    let (mut keep, mut refused) = (Vec::new(), Vec::new());
    for rec in records {
        let clash = rec
            .ips
            .iter()
            .find_map(|ip| holders.get(ip).map(|h| (*ip, *h)));
        match clash {
            Some((ip, holder)) => {
                let why = DuplicateIp {
                    id: rec.id,
                    name: rec.name.clone(),
                    ip,
                    holder,
                };
                refused.push((rec, why));
            }
            None => {
                for ip in &rec.ips {
                    holders.insert(*ip, rec.id);
                }
                keep.push(rec);
            }
        }
    }
    (keep, refused)
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
    /// An intent record exists already for this container.
    #[error("{path}: an ADD of this container is in progress")]
    InProgress { path: PathBuf },
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

    /// Whether an endpoint's record is on disk.
    pub fn has_endpoint(&self, id: EndpointId) -> bool {
        self.endpoint_dir(id).join(STATE_FILE).is_file()
    }

    /// Moves an endpoint's directory aside (`rejected-<id>-<nanos>`, with the reason in
    /// `reason.txt`): it is never restored again, and is kept for a human to look at.
    pub fn set_aside(&self, id: EndpointId, reason: &str) -> Result<PathBuf, StateError> {
        let from = self.endpoint_dir(id);
        let to = self
            .root
            .join(format!("{REJECTED_PREFIX}{id}-{}", unique_suffix()));
        fs::rename(&from, &to).map_err(io(&from))?;
        let why = to.join("reason.txt");
        fs::write(&why, format!("{reason}\n")).map_err(io(&why))?;
        sync_dir(&self.root);
        Ok(to)
    }

    fn intents_dir(&self) -> PathBuf {
        self.root.join(INTENTS_DIR)
    }

    fn intent_path(&self, container_id: &str) -> Result<PathBuf, StateError> {
        // The name becomes a file name: nothing that could leave the directory.
        if container_id.is_empty()
            || container_id.starts_with('.')
            || container_id.contains(['/', '\0'])
        {
            return Err(StateError::Invalid {
                path: self.intents_dir(),
                message: format!("{container_id:?} is not a usable container id"),
            });
        }
        Ok(self.intents_dir().join(format!("{container_id}.json")))
    }

    /// Records an ADD in progress, durably, before anything is created for it. Fails with
    /// `InProgress` when a record for the container exists already.
    pub fn begin_add(&self, intent: &AddIntent) -> Result<(), StateError> {
        let dst = self.intent_path(&intent.container_id)?;
        let dir = self.intents_dir();
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        let tmp = dir.join(format!(".tmp-{}-{}", intent.container_id, unique_suffix()));
        let body = serde_json::to_vec_pretty(intent).map_err(|e| StateError::Invalid {
            path: dst.clone(),
            message: e.to_string(),
        })?;
        let written = File::create(&tmp)
            .and_then(|mut f| f.write_all(&body).and_then(|()| f.sync_all()))
            .map_err(io(&tmp));
        let linked = written.and_then(|()| {
            renameat2(
                AT_FDCWD,
                &tmp,
                AT_FDCWD,
                &dst,
                RenameFlags::RENAME_NOREPLACE,
            )
            .map_err(|e| match e {
                nix::errno::Errno::EEXIST => StateError::InProgress { path: dst.clone() },
                e => StateError::Io {
                    path: dst.clone(),
                    source: e.into(),
                },
            })
        });
        if linked.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        linked?;
        sync_dir(&dir);
        Ok(())
    }

    /// The intent record of a container, if there is one.
    pub fn intent(&self, container_id: &str) -> Result<Option<AddIntent>, StateError> {
        let path = self.intent_path(container_id)?;
        match fs::read_to_string(&path) {
            Ok(text) => read_intent(&path, &text).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StateError::Io { path, source: e }),
        }
    }

    /// Removes a container's intent record (the ADD finished, or was rolled back).
    pub fn end_add(&self, container_id: &str) -> Result<(), StateError> {
        let path = self.intent_path(container_id)?;
        match fs::remove_file(&path) {
            Ok(()) => {
                sync_dir(&self.intents_dir());
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StateError::Io { path, source: e }),
        }
    }

    /// Every intent record on disk, plus one error per record that could not be read (left in
    /// place). Leftover temporary files are removed.
    pub fn load_intents(&self) -> (Vec<AddIntent>, Vec<StateError>) {
        let (mut out, mut errs) = (Vec::new(), Vec::new());
        let entries = match entries(&self.intents_dir(), true) {
            Ok(e) => e,
            Err(e) => return (out, vec![e]),
        };
        for (path, name) in entries {
            let Some(container) = name.strip_suffix(".json") else {
                continue;
            };
            match fs::read_to_string(&path)
                .map_err(io(&path))
                .and_then(|t| read_intent(&path, &t))
            {
                Ok(i) if i.container_id == container => out.push(i),
                Ok(i) => errs.push(StateError::Invalid {
                    path,
                    message: format!(
                        "holds container {} in the file of {container}",
                        i.container_id
                    ),
                }),
                Err(err) => errs.push(err),
            }
        }
        out.sort_by(|a, b| a.container_id.cmp(&b.container_id));
        (out, errs)
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
        let entries = match entries(&self.root, false) {
            Ok(e) => e,
            Err(e) => return (recs, vec![e]),
        };
        for (path, name) in entries {
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

/// The entries of a state directory (path, name), after removing what an interrupted write left
/// (`.tmp-*`). A missing directory is empty when `missing_is_empty`, else an error.
fn entries(dir: &Path, missing_is_empty: bool) -> Result<Vec<(PathBuf, String)>, StateError> {
    let listing = match fs::read_dir(dir) {
        Ok(l) => l,
        Err(e) if missing_is_empty && e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Vec::new())
        }
        Err(e) => {
            return Err(StateError::Io {
                path: dir.to_path_buf(),
                source: e,
            })
        }
    };
    let mut out = Vec::new();
    for e in listing.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with(".tmp-") {
            let _ = if path.is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            continue;
        }
        out.push((path, name));
    }
    Ok(out)
}

fn read_intent(path: &Path, text: &str) -> Result<AddIntent, StateError> {
    serde_json::from_str(text).map_err(|e| StateError::Invalid {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// A suffix that makes a temporary name unique within this process and across restarts.
fn unique_suffix() -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{nanos}-{n}")
}

/// Makes a rename or removal in `dir` durable (best effort: the data itself was synced).
fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
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
            mac: None,
            audit: false,
            host: false,
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

    fn intent(container: &str, ip: &str) -> AddIntent {
        AddIntent {
            container_id: container.into(),
            host_if: "lxc0123456789ab".into(),
            ip: ip.parse().unwrap(),
            more_ips: Vec::new(),
            netns: "/var/run/netns/p".into(),
            ifname: "eth0".into(),
            run: "1-1".into(),
        }
    }

    #[test]
    fn intents_are_exclusive_per_container_and_survive_as_written() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateDir::open(dir.path()).unwrap();
        assert_eq!(s.intent("c1").unwrap(), None);
        s.begin_add(&intent("c1", "10.0.0.1")).unwrap();
        s.begin_add(&intent("c2", "10.0.0.2")).unwrap();
        let second = s.begin_add(&intent("c1", "10.0.0.3")).unwrap_err();
        assert!(
            matches!(second, StateError::InProgress { .. }),
            "a second ADD of c1 is refused: {second}"
        );
        assert_eq!(
            s.intent("c1").unwrap(),
            Some(intent("c1", "10.0.0.1")),
            "the first record is untouched"
        );
        // A torn temporary file of a crash is swept; a record that does not parse is reported.
        fs::write(dir.path().join("cni-adds/.tmp-c3-1"), "{").unwrap();
        fs::write(dir.path().join("cni-adds/c4.json"), "{not json").unwrap();
        let (all, errs) = s.load_intents();
        assert_eq!(
            all,
            vec![intent("c1", "10.0.0.1"), intent("c2", "10.0.0.2")]
        );
        assert_eq!(errs.len(), 1);
        assert!(errs[0].to_string().contains("c4.json"), "{}", errs[0]);
        assert!(!dir.path().join("cni-adds/.tmp-c3-1").exists());
        s.end_add("c1").unwrap();
        s.end_add("c1").expect("removing twice is fine");
        assert_eq!(s.intent("c1").unwrap(), None);
        s.begin_add(&intent("c1", "10.0.0.3"))
            .expect("after the end, a new ADD may begin");
        // The endpoint directories are not confused with the intents.
        assert!(s.load_all().0.is_empty());
    }

    #[test]
    fn a_dual_stack_intent_keeps_both_addresses_and_older_records_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateDir::open(dir.path()).unwrap();
        let mut dual = intent("c1", "10.0.0.1");
        dual.more_ips = vec!["fd00::1".parse().unwrap()];
        s.begin_add(&dual).unwrap();
        let read = s.intent("c1").unwrap().unwrap();
        assert_eq!(
            read.ips(),
            vec![
                "10.0.0.1".parse::<IpAddr>().unwrap(),
                "fd00::1".parse().unwrap()
            ]
        );
        // Written by an agent that handed out one address: no more_ips field.
        let old = serde_json::json!({
            "container_id": "c2", "host_if": "lxc0123456789ab", "ip": "10.0.0.2",
            "netns": "/var/run/netns/p", "ifname": "eth0", "run": "1-1"
        });
        fs::write(dir.path().join("cni-adds/c2.json"), old.to_string()).unwrap();
        let read = s.intent("c2").unwrap().unwrap();
        assert_eq!(read.ips(), vec!["10.0.0.2".parse::<IpAddr>().unwrap()]);
        assert!(!serde_json::to_string(&intent("c3", "10.0.0.3"))
            .unwrap()
            .contains("more_ips"));
    }

    #[test]
    fn intent_names_cannot_leave_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateDir::open(dir.path()).unwrap();
        for bad in ["", "../x", "a/b", ".hidden"] {
            let e = s.begin_add(&intent(bad, "10.0.0.1")).unwrap_err();
            assert!(matches!(e, StateError::Invalid { .. }), "{bad:?}: {e}");
        }
        assert!(!dir.path().join("x.json").exists());
    }

    #[test]
    fn the_first_record_claiming_an_address_keeps_it() {
        let mut a = rec(1, 1);
        a.ips = vec!["10.0.0.1".parse().unwrap()];
        let mut b = rec(2, 1);
        b.ips = vec!["10.0.0.2".parse().unwrap(), "10.0.0.1".parse().unwrap()];
        let mut c = rec(3, 1);
        c.ips = vec!["10.0.0.2".parse().unwrap()];
        let (keep, refused) = partition_duplicate_ips(vec![a.clone(), b.clone(), c.clone()]);
        assert_eq!(
            keep,
            vec![a, c],
            "b is refused whole, so its other address stays free for c"
        );
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].0, b);
        assert_eq!(
            refused[0].1.to_string(),
            "endpoint 2 (x/a) claims 10.0.0.1, which endpoint 1 already holds"
        );
    }

    #[test]
    fn a_set_aside_endpoint_is_not_restored_and_keeps_its_reason() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateDir::open(dir.path()).unwrap();
        s.write(&rec(4, 1)).unwrap();
        let to = s.set_aside(4, "duplicate address").unwrap();
        assert!(s.load_all().0.is_empty());
        assert!(!s.has_endpoint(4));
        assert!(to.join("endpoint.json").is_file());
        assert_eq!(
            fs::read_to_string(to.join("reason.txt")).unwrap(),
            "duplicate address\n"
        );
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
