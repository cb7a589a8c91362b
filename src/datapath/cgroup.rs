//! cgroup v2 paths: where the hierarchy is mounted and where a process sits in it. Socket-level
//! Service translation attaches to a cgroup v2 directory (`--cgroup-root`); the demo, tests
//! and benches make their own directories there.

use std::path::{Path, PathBuf};

/// Where cgroup v2 is mounted (`/sys/fs/cgroup` on most hosts, `/sys/fs/cgroup/unified` on
/// hybrid ones), from `/proc/self/mountinfo`.
pub fn cgroup2_mount() -> Result<PathBuf, String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    info.lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            (post.split_whitespace().next() == Some("cgroup2"))
                .then(|| pre.split_whitespace().nth(4).map(PathBuf::from))
                .flatten()
        })
        .ok_or_else(|| "no cgroup v2 mount: socket-level Service translation needs one".into())
}

/// This process's cgroup v2 directory (the `0::PATH` line of `/proc/self/cgroup`).
pub fn own_cgroup(mount: &Path) -> Result<PathBuf, String> {
    let text = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| format!("/proc/self/cgroup: {e}"))?;
    let path = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or_else(|| "/proc/self/cgroup has no cgroup v2 line".to_string())?;
    Ok(mount.join(path.trim_start_matches('/')))
}

/// Moves this whole process (every thread) into the cgroup `dir`.
pub fn join_cgroup(dir: &Path) -> Result<(), String> {
    std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
        .map_err(|e| format!("join cgroup {}: {e}", dir.display()))
}
