//! Process limits the agent and its proxies raise at start.

/// Raises the soft open-file limit to the hard limit: every connection, watch and map is a
/// file, and the common soft limit of 1,024 is easily reached. Returns (old, new) soft limits.
pub fn raise_fd_limit() -> nix::Result<(u64, u64)> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok((soft, hard.max(soft)))
}
