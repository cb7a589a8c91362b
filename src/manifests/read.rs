//! Reading a manifest directory safely: what is found, what is refused, and the I/O worker
//! that keeps a blocked read from blocking anything else.
//!
//! What the directory accepts (the README says the same):
//! - regular files named `*.yaml`, `*.yml` or `*.json`, in the directory and its
//!   subdirectories, except names starting with `.` or ending with `~`;
//! - symbolic links are followed: a link to a directory already being read (a loop) is not
//!   followed again, and directories deeper than [`Limits::max_depth`] are not entered;
//! - a file larger than [`Limits::max_file_bytes`], a manifest name that is not a regular file
//!   (a FIFO, a device, a socket), a dangling link and a file that is not UTF-8 are refused.
//!
//! Every refusal is reported like a parse error (the file's previous objects stay, the rest of
//! the directory is applied). All I/O runs on an [`IoWorker`] thread with a timeout per
//! operation: a read that hangs (a FUSE or network file system) is reported as such, and the
//! path is skipped until that read returns.

use std::collections::HashSet;
use std::fs::{File, Metadata};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Bounds on what one directory may make the agent read and hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Larger files are refused (`--manifest-max-file-bytes`).
    pub max_file_bytes: u64,
    /// Documents in the whole directory; a file that would exceed it is refused
    /// (`--manifest-max-documents`).
    pub max_documents: usize,
    /// Directory levels below the manifest directory that are read.
    pub max_depth: usize,
    /// How long one file system operation may take before it is reported as hung.
    pub io_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_file_bytes: 16 << 20,
            max_documents: 100_000,
            max_depth: 16,
            io_timeout: Duration::from_secs(10),
        }
    }
}

/// Identifies a file's content without reading it: if none of these changed, neither did the
/// file (but see [`Stamp::racy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    pub fn of(m: &Metadata) -> Stamp {
        Stamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }

    /// Whether a read at `read_at` (seconds since the epoch) could have missed a later write
    /// with the same stamp: file systems keep time in coarse ticks, so a write within the same
    /// tick as the read leaves the stamp unchanged (git's "racy clean" problem). Such a file is
    /// read again at the next scan.
    pub fn racy(&self, read_at: i64) -> bool {
        self.mtime.0 + 1 >= read_at
    }
}

/// A manifest file found in the directory.
#[derive(Debug, Clone)]
pub struct Found {
    /// Path relative to the manifest directory: the file's name in every report.
    pub rel: Arc<str>,
    pub path: PathBuf,
    pub stamp: Stamp,
}

/// What a walk of the directory found.
#[derive(Debug, Default)]
pub struct Listing {
    /// Manifest files, sorted by `rel`.
    pub files: Vec<Found>,
    /// Paths that look like manifests (or links and directories that could hold some) but are
    /// refused, with the reason.
    pub refused: Vec<(Arc<str>, String)>,
}

/// Whether a file name is one the directory reads.
pub fn is_manifest_name(name: &str) -> bool {
    !name.starts_with('.')
        && !name.ends_with('~')
        && matches!(
            Path::new(name).extension().and_then(|x| x.to_str()),
            Some("yaml" | "yml" | "json")
        )
}

fn kind_of(m: &Metadata) -> &'static str {
    let t = m.file_type();
    if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// One entry of a directory: the link's own metadata and, for a link, its target's.
type DirEntry = (String, std::io::Result<Metadata>, bool);

enum Job {
    ListDir(PathBuf),
    ReadFile(PathBuf, u64),
    /// Hangs until told to go on: the tests' stand-in for a hung file system.
    #[cfg(test)]
    Wait(PathBuf, Receiver<()>),
}

enum JobResult {
    ListDir(std::io::Result<Vec<DirEntry>>),
    ReadFile(Result<(Stamp, Vec<u8>), String>),
}

/// A worker thread: where to send it jobs (each with where to answer), and its handle.
type Worker = (
    Sender<(Job, Sender<JobResult>)>,
    std::thread::JoinHandle<()>,
);

/// A thread that does the file system calls, so that a call that hangs costs a timeout, not the
/// caller. A worker that times out is abandoned (it exits once its call returns) and the next
/// call gets a new one; the path stays marked as blocked until the old call returns.
pub struct IoWorker {
    timeout: Duration,
    worker: Option<Worker>,
    /// Paths with a call still in progress on an abandoned worker.
    blocked: Arc<Mutex<HashSet<PathBuf>>>,
}

/// Why an I/O call did not answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoError {
    /// The call took longer than the timeout (it may still be running).
    TimedOut(Duration),
    /// An earlier call on this path has not returned yet.
    StillBlocked,
}

impl std::fmt::Display for IoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoError::TimedOut(t) => write!(f, "no answer from the file system within {t:?}"),
            IoError::StillBlocked => write!(f, "an earlier read of it has still not returned"),
        }
    }
}

impl IoWorker {
    pub fn new(timeout: Duration) -> IoWorker {
        IoWorker {
            timeout,
            worker: None,
            blocked: Arc::default(),
        }
    }

    fn call(&mut self, path: &Path, job: Job) -> Result<JobResult, IoError> {
        if self.blocked.lock().is_ok_and(|b| b.contains(path)) {
            return Err(IoError::StillBlocked);
        }
        let (jobs, _) = match &self.worker {
            Some(w) if !w.1.is_finished() => w,
            _ => self.worker.insert(spawn_worker(self.blocked.clone())),
        };
        let (tx, rx) = channel();
        if jobs.send((job, tx)).is_err() {
            self.worker = None;
            return Err(IoError::TimedOut(Duration::ZERO));
        }
        match rx.recv_timeout(self.timeout) {
            Ok(r) => Ok(r),
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                // Abandon this worker: dropping its job sender ends it after the call returns.
                self.worker = None;
                Err(IoError::TimedOut(self.timeout))
            }
        }
    }

    /// The entries of a directory, each with the metadata of what it names (links followed)
    /// and whether it is a link.
    fn list_dir(&mut self, dir: &Path) -> Result<std::io::Result<Vec<DirEntry>>, IoError> {
        match self.call(dir, Job::ListDir(dir.to_path_buf()))? {
            JobResult::ListDir(r) => Ok(r),
            JobResult::ReadFile(_) => unreachable!("a ListDir job answers ListDir"),
        }
    }

    /// Reads a regular file of at most `max` bytes.
    pub fn read_file(&mut self, path: &Path, max: u64) -> Result<(Stamp, Vec<u8>), String> {
        match self.call(path, Job::ReadFile(path.to_path_buf(), max)) {
            Ok(JobResult::ReadFile(r)) => r,
            Ok(JobResult::ListDir(_)) => unreachable!("a ReadFile job answers ReadFile"),
            Err(e) => Err(e.to_string()),
        }
    }
}

fn spawn_worker(blocked: Arc<Mutex<HashSet<PathBuf>>>) -> Worker {
    let (tx, rx): (Sender<(Job, Sender<JobResult>)>, Receiver<_>) = channel();
    let handle = std::thread::Builder::new()
        .name("manifest-io".into())
        .spawn(move || {
            for (job, reply) in rx {
                let path = match &job {
                    Job::ListDir(p) | Job::ReadFile(p, _) => p.clone(),
                    #[cfg(test)]
                    Job::Wait(p, _) => p.clone(),
                };
                if let Ok(mut b) = blocked.lock() {
                    b.insert(path.clone());
                }
                let result = match job {
                    Job::ListDir(dir) => JobResult::ListDir(list_dir(&dir)),
                    Job::ReadFile(p, max) => JobResult::ReadFile(read_file(&p, max)),
                    #[cfg(test)]
                    Job::Wait(_, go_on) => JobResult::ListDir(
                        go_on.recv().map(|_| vec![]).map_err(std::io::Error::other),
                    ),
                };
                if let Ok(mut b) = blocked.lock() {
                    b.remove(&path);
                }
                // The caller may have given up on this call; then this worker is abandoned.
                if reply.send(result).is_err() {
                    return;
                }
            }
        })
        .expect("spawn the manifest I/O thread");
    (tx, handle)
}

fn list_dir(dir: &Path) -> std::io::Result<Vec<DirEntry>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let is_link = e.file_type().map(|t| t.is_symlink()).unwrap_or(false);
        // Links are followed here; their own loops (a -> b -> a) fail with ELOOP.
        let meta = std::fs::metadata(e.path());
        out.push((name, meta, is_link));
    }
    Ok(out)
}

fn read_file(path: &Path, max: u64) -> Result<(Stamp, Vec<u8>), String> {
    // Non-blocking open: a FIFO swapped in after the walk does not hang the open.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot open: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("cannot stat: {e}"))?;
    if !meta.is_file() {
        return Err(format!("{}, not a regular file", kind_of(&meta)));
    }
    if meta.len() > max {
        return Err(too_large(meta.len(), max));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // A file that grows while it is read is still capped.
    (&file as &File)
        .take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > max {
        return Err(too_large(bytes.len() as u64, max));
    }
    Ok((Stamp::of(&meta), bytes))
}

fn too_large(size: u64, max: u64) -> String {
    format!(
        "{size} bytes is more than the {max} a manifest file may have (--manifest-max-file-bytes)"
    )
}

/// Walks `root`: manifest files (links followed, loops and depth bounded) and refusals.
pub fn walk(io: &mut IoWorker, root: &Path, limits: &Limits) -> Result<Listing, String> {
    let mut listing = Listing::default();
    let root_meta = std::fs::metadata(root).map_err(|e| format!("{}: {e}", root.display()))?;
    // Directories on the path being read: a link back to one of them is a loop.
    let mut open = vec![(root_meta.dev(), root_meta.ino())];
    let entries = match io.list_dir(root) {
        Ok(r) => r.map_err(|e| format!("{}: {e}", root.display()))?,
        Err(e) => return Err(format!("{}: {e}", root.display())),
    };
    walk_entries(io, root, "", entries, 1, &mut open, limits, &mut listing);
    listing.files.sort_by(|a, b| a.rel.cmp(&b.rel));
    listing.refused.sort();
    Ok(listing)
}

#[allow(clippy::too_many_arguments)]
fn walk_entries(
    io: &mut IoWorker,
    dir: &Path,
    prefix: &str,
    mut entries: Vec<DirEntry>,
    depth: usize,
    open: &mut Vec<(u64, u64)>,
    limits: &Limits,
    out: &mut Listing,
) {
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, meta, is_link) in entries {
        if name.starts_with('.') || name.ends_with('~') {
            continue;
        }
        let rel: Arc<str> = format!("{prefix}{name}").into();
        let path = dir.join(&name);
        let manifest = is_manifest_name(&name);
        let meta = match meta {
            Ok(m) => m,
            Err(e) => {
                // A dangling link or a link loop (ELOOP): worth a report only where a manifest
                // or a directory of them could have been.
                if manifest || is_link {
                    out.refused.push((rel, format!("cannot follow: {e}")));
                }
                continue;
            }
        };
        if meta.is_dir() {
            let id = (meta.dev(), meta.ino());
            if open.contains(&id) {
                out.refused.push((
                    rel,
                    "a link back to a directory being read (a loop): not followed".into(),
                ));
                continue;
            }
            if depth >= limits.max_depth {
                out.refused.push((
                    rel,
                    format!(
                        "deeper than {} directory levels: not read",
                        limits.max_depth
                    ),
                ));
                continue;
            }
            match io.list_dir(&path) {
                Ok(Ok(sub)) => {
                    open.push(id);
                    let prefix = format!("{rel}/");
                    walk_entries(io, &path, &prefix, sub, depth + 1, open, limits, out);
                    open.pop();
                }
                Ok(Err(e)) => out.refused.push((rel, format!("cannot list: {e}"))),
                Err(e) => out.refused.push((rel, format!("cannot list: {e}"))),
            }
        } else if manifest {
            if meta.is_file() {
                out.files.push(Found {
                    rel,
                    path,
                    stamp: Stamp::of(&meta),
                });
            } else {
                out.refused
                    .push((rel, format!("{}, not a regular file", kind_of(&meta))));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn rels(l: &Listing) -> Vec<&str> {
        l.files.iter().map(|f| &*f.rel).collect()
    }

    #[test]
    fn regular_manifest_files_are_found_in_sort_order_and_the_rest_is_skipped() {
        let d = tempfile::tempdir().unwrap();
        for f in [
            "b.yaml",
            "a.yml",
            "c.json",
            "notes.txt",
            ".hidden.yaml",
            "x.yaml~",
        ] {
            std::fs::write(d.path().join(f), "").unwrap();
        }
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("sub/p.yaml"), "").unwrap();
        let l = walk(
            &mut IoWorker::new(Duration::from_secs(5)),
            d.path(),
            &Limits::default(),
        )
        .unwrap();
        assert_eq!(rels(&l), vec!["a.yml", "b.yaml", "c.json", "sub/p.yaml"]);
        assert!(l.refused.is_empty(), "{:?}", l.refused);
    }

    #[test]
    fn fifos_devices_loops_and_dangling_links_are_refused_with_a_reason() {
        let d = tempfile::tempdir().unwrap();
        let m = d.path();
        std::fs::write(m.join("good.yaml"), "").unwrap();
        nix::unistd::mkfifo(&m.join("pipe.yaml"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        symlink("/dev/zero", m.join("zero.yaml")).unwrap();
        symlink(".", m.join("loop")).unwrap();
        symlink(".", m.join("loop2")).unwrap();
        symlink("missing.yaml", m.join("dangling.yaml")).unwrap();
        symlink("self.yaml", m.join("self.yaml")).unwrap();
        let l = walk(
            &mut IoWorker::new(Duration::from_secs(5)),
            m,
            &Limits::default(),
        )
        .unwrap();
        assert_eq!(rels(&l), vec!["good.yaml"]);
        let refused: Vec<(&str, &str)> = l.refused.iter().map(|(r, e)| (&**r, &**e)).collect();
        let reason = |name: &str| {
            refused
                .iter()
                .find(|(r, _)| *r == name)
                .map(|(_, e)| e.to_string())
                .unwrap_or_else(|| panic!("{name} not refused: {refused:?}"))
        };
        assert!(reason("pipe.yaml").contains("FIFO"));
        assert!(reason("zero.yaml").contains("character device"));
        assert!(reason("loop").contains("loop"));
        assert!(reason("loop2").contains("loop"));
        assert!(reason("dangling.yaml").contains("cannot follow"));
        assert!(reason("self.yaml").contains("cannot follow"));
        assert_eq!(refused.len(), 6, "{refused:?}");
    }

    #[test]
    fn a_link_to_another_directory_is_followed_and_depth_is_capped() {
        let d = tempfile::tempdir().unwrap();
        let (m, other) = (d.path().join("m"), d.path().join("other"));
        std::fs::create_dir_all(other.join("deep/er")).unwrap();
        std::fs::create_dir(&m).unwrap();
        std::fs::write(other.join("p.yaml"), "").unwrap();
        std::fs::write(other.join("deep/er/q.yaml"), "").unwrap();
        symlink(&other, m.join("linked")).unwrap();
        let limits = Limits {
            max_depth: 2,
            ..Limits::default()
        };
        let l = walk(&mut IoWorker::new(Duration::from_secs(5)), &m, &limits).unwrap();
        assert_eq!(rels(&l), vec!["linked/p.yaml"]);
        assert_eq!(&*l.refused[0].0, "linked/deep");
        assert!(l.refused[0].1.contains("deeper than 2"));
    }

    #[test]
    fn reads_are_capped_and_only_regular_files_are_read() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("big.yaml");
        std::fs::write(&f, vec![b'a'; 1000]).unwrap();
        let mut io = IoWorker::new(Duration::from_secs(5));
        let err = io.read_file(&f, 999).unwrap_err();
        assert!(err.contains("1000 bytes is more than the 999"), "{err}");
        assert_eq!(io.read_file(&f, 1000).unwrap().1.len(), 1000);
        let err = io.read_file(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(err.contains("character device"), "{err}");
        let fifo = d.path().join("p.yaml");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let err = io.read_file(&fifo, 1 << 20).unwrap_err();
        assert!(err.contains("FIFO"), "{err}");
    }

    #[test]
    fn a_hung_call_times_out_the_path_stays_blocked_and_other_paths_go_on() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("p.yaml"), "x").unwrap();
        let mut io = IoWorker::new(Duration::from_millis(100));
        let hung = PathBuf::from("/hung/by/the/test");
        let (release, wait) = channel();
        let started = std::time::Instant::now();
        assert!(matches!(
            io.call(&hung, Job::Wait(hung.clone(), wait)),
            Err(IoError::TimedOut(_))
        ));
        assert!(started.elapsed() < Duration::from_secs(2));
        // While the call hangs, the path is refused at once and the others are served by a new
        // worker.
        assert_eq!(
            io.read_file(&hung, 10).unwrap_err(),
            IoError::StillBlocked.to_string()
        );
        assert_eq!(io.read_file(&d.path().join("p.yaml"), 10).unwrap().1, b"x");
        assert_eq!(io.list_dir(d.path()).unwrap().unwrap().len(), 1);
        // Once the hung call returns, the path may be tried again.
        release.send(()).unwrap();
        eventually(|| io.blocked.lock().unwrap().is_empty());
    }

    fn eventually(f: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(std::time::Instant::now() < deadline, "not within 5 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
