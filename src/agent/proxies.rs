//! What the agent's proxy links share: starting a proxy process that outlives the agent, and
//! the loop that keeps a link to it (`supervise`).

use std::ffi::OsString;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::net::UnixStream;

use crate::runtime::Shared;

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

/// One proxy as its link's supervision sees it.
pub struct Supervised<'a> {
    /// `DNS proxy`, `HTTP proxy` (for the log).
    pub what: &'static str,
    /// Start one when none answers (`auto` mode); `external` only adopts.
    pub auto: bool,
    pub socket: PathBuf,
    /// Starts a proxy unless one answers (`start_detached`): the child to reap, if started.
    pub start: &'a dyn Fn() -> std::io::Result<Option<Child>>,
    /// The agent's record of the proxy.
    pub state: &'a dyn LinkState,
}

/// The agent's record of one proxy, as its link's supervision updates it.
pub trait LinkState {
    /// Why the proxy is not connected, for its status view.
    fn not_connected(&self, why: String);
    /// The connection ended (why): the view says so and nothing waits for the proxy any more.
    fn link_down(&self, why: String);
}

/// Both proxies' records keep the same fields in views of their own types.
macro_rules! link_state {
    ($state:ty) => {
        impl LinkState for $state {
            fn not_connected(&self, why: String) {
                self.update_proxy(|v| v.error = Some(why))
            }

            fn link_down(&self, why: String) {
                self.sync.disconnected();
                self.update_proxy(|v| {
                    v.connected = false;
                    v.error = Some(why);
                })
            }
        }
    };
}

link_state!(crate::proxy::http::state::HttpState);
link_state!(crate::proxy::dns::state::DnsState);

/// Keeps a link to the proxy until the agent stops: starts one in `auto` mode (and again when
/// the one this agent started exits: it is reaped), and once the agent is ready connects and
/// runs `serve` on the connection, every 100 ms while there is none.
pub async fn supervise<F, Fut>(shared: &Shared, p: Supervised<'_>, mut serve: F)
where
    F: FnMut(UnixStream) -> Fut,
    Fut: Future<Output = String>,
{
    let mut child = None;
    loop {
        if p.auto && child.is_none() {
            match (p.start)() {
                Ok(c) => child = c,
                Err(e) => {
                    p.state.not_connected(format!("cannot start: {e}"));
                    tracing::error!(error = %e, proxy = p.what, "cannot start the proxy")
                }
            }
        }
        if let Some(c) = child.as_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                tracing::warn!(%status, proxy = p.what, "the proxy exited");
                child = None;
                continue;
            }
        }
        if shared.ready.load(Ordering::SeqCst) {
            match UnixStream::connect(&p.socket).await {
                Ok(s) => {
                    let why = serve(s).await;
                    p.state.link_down(why.clone());
                    tracing::warn!(reason = %why, proxy = p.what, "proxy link down");
                }
                Err(e) => p.state.not_connected(format!("not reachable: {e}")),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
