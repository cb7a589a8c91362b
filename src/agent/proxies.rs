//! What the agent's proxy links share: starting a proxy process that outlives the agent.

use std::ffi::OsString;
use std::path::Path;
use std::process::Child;

/// Starts `ciliate ARGS` unless something answers on `socket` (a proxy already serves the
/// state directory): in a process group of its own, so that a signal to the agent's group (a
/// terminal's ^C, a test's kill of the agent) does not take it along; its log appended to
/// `log`. Returns the child to reap, when one was started.
pub fn start_detached(
    socket: &Path,
    log: &Path,
    args: &[OsString],
) -> std::io::Result<Option<Child>> {
    if std::os::unix::net::UnixStream::connect(socket).is_ok() {
        return Ok(None);
    }
    use std::os::unix::process::CommandExt;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let child = std::process::Command::new(std::env::current_exe()?)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .process_group(0)
        .spawn()?;
    Ok(Some(child))
}
