//! What the agent binds and raises before any actor runs: the open-file limit, the API socket
//! (0600 in a 0700 directory, whatever the umask) and the debug listener. Each of these can fail
//! on a careless configuration, so they come first and a failure ends the start with one clear
//! line, before there is anything to tear down.

use std::ffi::OsString;
use std::fs;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Component, Path, PathBuf};

/// Mode of the API socket: only the agent's user may connect (the API adds and deletes
/// endpoints).
pub const SOCKET_MODE: u32 = 0o600;
/// Mode of the socket's directory: nobody else can reach, replace or race the socket.
pub const SOCKET_DIR_MODE: u32 = 0o700;

/// Why a listener could not be set up; each names the flag and the path or address concerned.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// A file-system call on the socket's path or directory failed.
    #[error("--api-socket {socket}: {what} {path}: {source}")]
    Io {
        socket: PathBuf,
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// The socket's directory is not one the agent may keep its socket in.
    #[error("--api-socket {socket}: directory {dir} {reason}")]
    Directory {
        socket: PathBuf,
        dir: PathBuf,
        reason: String,
    },
    /// Something other than a stale socket sits at the socket's path.
    #[error("--api-socket {socket}: exists and is not a socket; remove it or choose another path")]
    NotASocket { socket: PathBuf },
    /// The socket did not end up with the mode asked for.
    #[error("--api-socket {socket}: mode is {mode:04o} after chmod {SOCKET_MODE:04o}")]
    Mode { socket: PathBuf, mode: u32 },
    /// The debug address cannot be bound (taken, or not an address of this host).
    #[error("--debug-addr {addr}: cannot listen: {source}")]
    Debug { addr: SocketAddr, source: io::Error },
}

/// The listeners, bound; the socket file is removed when this is dropped.
#[derive(Debug)]
pub struct Listeners {
    pub api: UnixListener,
    pub debug: TcpListener,
    pub socket: SocketFile,
}

impl Listeners {
    /// Binds the API socket (its directory secured first) and the debug address. `state_dir` is
    /// the agent's own directory: when the socket lives in it (the default layout), tightening
    /// its mode touches nothing of anyone else's.
    pub fn bind(
        api_socket: &Path,
        state_dir: &Path,
        debug_addr: SocketAddr,
    ) -> Result<Listeners, ListenError> {
        let api = bind_api_socket(api_socket, state_dir)?;
        let socket = SocketFile(api_socket.to_path_buf());
        let debug = TcpListener::bind(debug_addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|source| ListenError::Debug {
                addr: debug_addr,
                source,
            })?;
        Ok(Listeners { api, debug, socket })
    }
}

/// Removes the API socket when the agent stops, on success or failure alike (the state lock,
/// taken before the bind, proves the path is this agent's).
#[derive(Debug)]
pub struct SocketFile(PathBuf);

impl SocketFile {
    /// Removes `path` when dropped: a socket this agent bound (its state lock held).
    pub fn removed_on_drop(path: PathBuf) -> SocketFile {
        SocketFile(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Creates or secures the socket's directory, removes a stale socket, binds, and sets the
/// socket's mode. The directory is 0700 before the bind, so the socket is never reachable with
/// the looser mode the umask gives it between `bind` and `chmod`.
fn bind_api_socket(socket: &Path, state_dir: &Path) -> Result<UnixListener, ListenError> {
    let io_err = |what, path: &Path| {
        let socket = socket.to_path_buf();
        let path = path.to_path_buf();
        move |source| ListenError::Io {
            socket,
            what,
            path,
            source,
        }
    };
    let dir = match socket.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    secure_dir(socket, &dir, state_dir)?;
    match fs::symlink_metadata(socket) {
        Ok(m) if m.file_type().is_socket() => {
            fs::remove_file(socket).map_err(io_err("remove the stale socket", socket))?
        }
        Ok(_) => {
            return Err(ListenError::NotASocket {
                socket: socket.to_path_buf(),
            })
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("inspect", socket)(e)),
    }
    let listener = UnixListener::bind(socket).map_err(io_err("listen on", socket))?;
    fs::set_permissions(socket, fs::Permissions::from_mode(SOCKET_MODE))
        .map_err(io_err("chmod", socket))?;
    let mode = fs::symlink_metadata(socket)
        .map_err(io_err("inspect", socket))?
        .mode()
        & 0o7777;
    if mode != SOCKET_MODE {
        return Err(ListenError::Mode {
            socket: socket.to_path_buf(),
            mode,
        });
    }
    listener
        .set_nonblocking(true)
        .map_err(io_err("listen on", socket))?;
    Ok(listener)
}

/// Makes sure nobody else can reach, replace or race the socket in `dir`. A missing directory is
/// created 0700. An existing one must be owned by our user; it is tightened to 0700 when it is
/// the agent's own (the state directory, or nothing in it but the socket and the state
/// directory), never when it is shared: a shared directory is accepted as it is when others
/// cannot write to it (the socket's own 0600 keeps them out), and refused when they can, as
/// they could then replace the socket.
fn secure_dir(socket: &Path, dir: &Path, state_dir: &Path) -> Result<(), ListenError> {
    let refuse = |reason: String| ListenError::Directory {
        socket: socket.to_path_buf(),
        dir: dir.to_path_buf(),
        reason,
    };
    let io_err = |what| {
        move |source| ListenError::Io {
            socket: socket.to_path_buf(),
            what,
            path: dir.to_path_buf(),
            source,
        }
    };
    let created = match fs::metadata(dir) {
        Ok(_) => false,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(SOCKET_DIR_MODE)
                .create(dir)
                .map_err(io_err("create"))?;
            true
        }
        Err(e) => return Err(io_err("inspect")(e)),
    };
    let meta = fs::metadata(dir).map_err(io_err("inspect"))?;
    if !meta.is_dir() {
        return Err(refuse("is not a directory".into()));
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(refuse(format!(
            "is owned by uid {}, not by the agent's uid {me}; give the socket a directory of its own",
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o7077 == 0 {
        // Nobody but the owner has any access (0700, or tighter).
        return Ok(());
    }
    if !created {
        let ours = is_same_dir(dir, state_dir) || {
            let entries = fs::read_dir(dir)
                .map_err(io_err("list"))?
                .map(|e| e.map(|e| e.file_name()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(io_err("list"))?;
            holds_only_agent_files(&entries, socket, dir, state_dir)
        };
        let sticky = mode & 0o1000 != 0;
        if !ours || sticky {
            if mode & 0o022 == 0 {
                return Ok(());
            }
            return Err(refuse(format!(
                "is mode {mode:04o}: other users could replace the socket; give the socket a \
                 directory of its own (the agent creates it {SOCKET_DIR_MODE:04o})"
            )));
        }
        tracing::warn!(
            dir = %dir.display(),
            from = format!("{mode:04o}"),
            to = format!("{SOCKET_DIR_MODE:04o}"),
            "tightened the API socket's directory"
        );
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(SOCKET_DIR_MODE))
        .map_err(io_err("chmod"))?;
    let now = fs::metadata(dir).map_err(io_err("inspect"))?.mode() & 0o7777;
    if now != SOCKET_DIR_MODE {
        return Err(refuse(format!(
            "is mode {now:04o} after chmod {SOCKET_DIR_MODE:04o}"
        )));
    }
    Ok(())
}

fn is_same_dir(a: &Path, b: &Path) -> bool {
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// True when every entry of `dir` is the agent's: the socket (a stale one) or the top of the
/// state directory when that lies inside `dir`.
fn holds_only_agent_files(
    entries: &[OsString],
    socket: &Path,
    dir: &Path,
    state_dir: &Path,
) -> bool {
    let socket_name = socket.file_name();
    let state_top = state_dir.strip_prefix(dir).ok().and_then(|rest| {
        rest.components().next().and_then(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            _ => None,
        })
    });
    entries
        .iter()
        .all(|e| Some(e.as_os_str()) == socket_name || Some(e) == state_top.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: &[&str]) -> Vec<OsString> {
        n.iter().map(OsString::from).collect()
    }

    /// A directory of mode `mode` that someone else uses too (it holds a file of theirs).
    fn shared_dir(mode: u32) -> (tempfile::TempDir, std::path::PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let shared = tmp.path().join("shared");
        fs::create_dir(&shared).unwrap();
        fs::set_permissions(&shared, fs::Permissions::from_mode(mode)).unwrap();
        fs::write(shared.join("someone-else"), "x").unwrap();
        (tmp, shared)
    }

    /// The permission bits of `path` (not following a link).
    fn mode_of(path: &std::path::Path) -> u32 {
        fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    #[test]
    fn a_directory_with_only_the_socket_and_the_state_dir_is_the_agents() {
        let dir = Path::new("/x/run");
        let socket = Path::new("/x/run/ciliate.sock");
        let state = Path::new("/x/run/state/deeper");
        assert!(holds_only_agent_files(&[], socket, dir, state));
        assert!(holds_only_agent_files(
            &names(&["ciliate.sock", "state"]),
            socket,
            dir,
            state
        ));
        assert!(!holds_only_agent_files(
            &names(&["ciliate.sock", "dbus"]),
            socket,
            dir,
            state
        ));
        // A state directory elsewhere claims nothing here.
        assert!(!holds_only_agent_files(
            &names(&["state"]),
            socket,
            dir,
            Path::new("/var/lib/state")
        ));
    }

    #[test]
    fn a_missing_directory_is_created_0700_and_the_socket_is_0600() {
        // (Under `umask 000` too: tests/hardening_access.rs starts the agent so. The umask is
        // process-wide, so it is not changed here, among tests running in parallel.)
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("a/run");
        let socket = run.join("api.sock");
        let _listener = bind_api_socket(&socket, &tmp.path().join("state")).unwrap();
        let mode = |p: &Path| fs::symlink_metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&socket), SOCKET_MODE);
        assert_eq!(mode(&run), SOCKET_DIR_MODE);
        assert!(fs::symlink_metadata(&socket)
            .unwrap()
            .file_type()
            .is_socket());
    }

    #[test]
    fn a_shared_directory_is_refused_and_left_as_it_was() {
        let (tmp, shared) = shared_dir(0o1777);
        let socket = shared.join("api.sock");
        let err = bind_api_socket(&socket, &tmp.path().join("state")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("--api-socket") && msg.contains("1777"),
            "{msg}"
        );
        assert_eq!(mode_of(&shared), 0o1777);
        assert!(!socket.exists());
    }

    #[test]
    fn a_shared_directory_others_cannot_write_is_left_as_it_is() {
        let (tmp, shared) = shared_dir(0o755);
        let socket = shared.join("api.sock");
        let _listener = bind_api_socket(&socket, &tmp.path().join("state")).unwrap();
        assert_eq!(mode_of(&shared), 0o755);
        assert_eq!(mode_of(&socket), SOCKET_MODE);
    }

    #[test]
    fn a_loose_directory_of_the_agents_own_is_tightened_and_a_stale_socket_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        fs::create_dir(&run).unwrap();
        fs::set_permissions(&run, fs::Permissions::from_mode(0o777)).unwrap();
        let socket = run.join("api.sock");
        drop(UnixListener::bind(&socket).unwrap());
        let _listener = bind_api_socket(&socket, &run.join("state")).unwrap();
        assert_eq!(mode_of(&run), SOCKET_DIR_MODE);
        assert_eq!(mode_of(&socket), SOCKET_MODE);
    }

    #[test]
    fn a_file_at_the_socket_path_is_not_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let socket = tmp.path().join("api.sock");
        fs::write(&socket, "data").unwrap();
        let err = bind_api_socket(&socket, &tmp.path().join("state")).unwrap_err();
        assert!(matches!(err, ListenError::NotASocket { .. }), "{err}");
        assert_eq!(fs::read_to_string(&socket).unwrap(), "data");
    }
}
