//! Issue #16, items 7 to 9, reproduced on the real agent binary: who can reach the API socket,
//! whether debug-port clients can starve the API of open files, and whether a failed start ends
//! with one clear line instead of a panic.

mod common;

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::agent::{free_port, Agent};
use nix::sys::resource::{getrlimit, setrlimit, Resource};

/// A scratch directory with the manifests, traversable by everyone (as `/var/run` is), so only
/// the agent's own modes stand between another user and the socket.
fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let m = dir.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    std::fs::write(
        m.join("cluster.yaml"),
        common::namespace_x_with_pods(&[("a", "10.7.0.1")]),
    )
    .unwrap();
    dir
}

fn standalone(dir: &Path) -> Vec<String> {
    [
        "--mode",
        "standalone",
        "--datapath",
        "memory",
        "--manifests",
        dir.join("manifests").to_str().expect("UTF-8 path"),
    ]
    .map(String::from)
    .to_vec()
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .mode()
        & 0o7777
}

/// Starts the agent after `pre_exec` ran in the child, and waits until it is ready.
fn start(dir: &Path, socket: PathBuf, pre_exec: fn() -> std::io::Result<()>) -> Agent {
    let debug = format!("127.0.0.1:{}", free_port());
    let args = standalone(dir);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = Agent::command(dir, &socket, &debug, &args);
    // SAFETY: the hook only calls umask/setrlimit, which are async-signal-safe.
    unsafe { cmd.pre_exec(pre_exec) };
    let agent = Agent::spawn_command(dir, socket, debug, &mut cmd);
    agent.wait_until("the agent is ready", || agent.http_get("/readyz").0 == 200);
    agent
}

/// Connects to `socket` from a forked child, as `nobody` when `as_nobody`; true if it could.
fn can_connect(socket: &Path, as_nobody: bool) -> bool {
    use nix::sys::socket::{connect, socket as new_socket, AddressFamily, SockFlag, SockType};
    use nix::sys::wait::{waitpid, WaitStatus};
    use nix::unistd::{fork, setgid, setuid, ForkResult, Gid, Uid};
    use std::os::fd::AsRawFd;
    // Everything that allocates happens before the fork (the test process has threads).
    let addr = nix::sys::socket::UnixAddr::new(socket).expect("a socket path");
    let nobody = nix::unistd::User::from_name("nobody")
        .ok()
        .flatten()
        .map(|u| (u.uid, u.gid))
        .unwrap_or((Uid::from_raw(65534), Gid::from_raw(65534)));
    // SAFETY: the child only makes system calls and exits with `_exit`.
    match unsafe { fork() }.expect("fork") {
        ForkResult::Child => {
            let code = (|| {
                if as_nobody && (setgid(nobody.1).is_err() || setuid(nobody.0).is_err()) {
                    return 3;
                }
                let Ok(fd) = new_socket(
                    AddressFamily::Unix,
                    SockType::Stream,
                    SockFlag::empty(),
                    None,
                ) else {
                    return 4;
                };
                match connect(fd.as_raw_fd(), &addr) {
                    Ok(()) => 0,
                    Err(_) => 1,
                }
            })();
            // SAFETY: no destructors or atexit handlers in a forked child of a threaded process.
            unsafe { nix::libc::_exit(code) }
        }
        ForkResult::Parent { child } => match waitpid(child, None).expect("waitpid") {
            WaitStatus::Exited(_, 0) => true,
            WaitStatus::Exited(_, 1) => false,
            other => panic!("connect probe failed to run: {other:?}"),
        },
    }
}

fn umask_000_soft_limit_1024() -> std::io::Result<()> {
    nix::sys::stat::umask(nix::sys::stat::Mode::empty());
    setrlimit(Resource::RLIMIT_NOFILE, 1024, 4096).map_err(std::io::Error::from)
}

/// Item 7 (and the limit raise of item 8): under `umask 000` the socket was `srwxrwxrwx` in a
/// 0777 directory and any user could add and delete endpoints.
#[test]
fn under_umask_000_the_socket_is_0600_in_a_0700_directory_and_nobody_cannot_connect() {
    if !common::netns::privileged() {
        return;
    }
    let guard = setup();
    let dir = guard.path();
    let run = dir.join("run");
    let socket = run.join("ciliate.sock");
    let agent = start(dir, socket.clone(), umask_000_soft_limit_1024);

    assert_eq!(mode(&socket), 0o600, "socket mode");
    assert_eq!(mode(&run), 0o700, "socket directory mode");
    let (code, out, err) = agent.cli(&["endpoint", "add", "--name", "x/a", "--ip", "10.7.0.1"]);
    assert_eq!(code, 0, "root adds an endpoint: {out}{err}");
    // What the agent writes under that umask is not writable by anyone else either.
    let state = dir.join("state");
    assert_eq!(mode(&state), 0o700, "state directory mode");
    let mut files = vec![state.clone()];
    while let Some(p) = files.pop() {
        assert_eq!(mode(&p) & 0o022, 0, "{} is writable by others", p.display());
        if p.is_dir() {
            files.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        }
    }

    assert!(
        can_connect(&socket, false),
        "root connects (the probe works)"
    );
    assert!(!can_connect(&socket, true), "nobody must not connect");

    // The soft open-file limit was raised to the hard one, and the agent said so.
    let pid = agent.child.as_ref().expect("running").id();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a Max open files line");
    assert_eq!(
        line.split_whitespace().skip(3).take(2).collect::<Vec<_>>(),
        ["4096", "4096"],
        "{line}"
    );
    assert!(
        agent.log().contains("raised the open-file limit"),
        "{}",
        agent.log()
    );
}

fn limit_1024() -> std::io::Result<()> {
    // Soft and hard: the agent cannot raise it, so only the debug server's cap can keep the
    // API's open files.
    setrlimit(Resource::RLIMIT_NOFILE, 1024, 1024).map_err(std::io::Error::from)
}

fn metric(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Item 8: with 1,024 files, 2,000 keep-alive clients of the debug port starved the unix API
/// and CNI ("Too many open files").
#[test]
fn two_thousand_debug_port_clients_do_not_starve_the_api_under_a_limit_of_1024_files() {
    const CLIENTS: usize = 2000;
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    let want = (CLIENTS as u64) + 512;
    if soft < want {
        assert!(
            hard >= want,
            "this test needs {want} open files (hard limit {hard})"
        );
        setrlimit(Resource::RLIMIT_NOFILE, want, hard).unwrap();
    }
    let guard = setup();
    let dir = guard.path();
    // The socket sits in the scratch directory, which others can enter but not write (as
    // `/var/run`): the directory is left as it is, and the socket's own mode keeps them out.
    let socket = dir.join("ciliate.sock");
    let agent = start(dir, socket.clone(), limit_1024);
    assert_eq!(mode(dir), 0o755);
    assert_eq!(mode(&socket), 0o600, "socket mode");
    assert!(
        can_connect(&socket, false),
        "root connects (the probe works)"
    );
    assert!(!can_connect(&socket, true), "nobody must not connect");

    let mut flood = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        let addr = agent.debug.parse().expect("debug address");
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
            continue;
        };
        // One request, then the connection is kept open (keep-alive).
        let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
        flood.push(s);
    }
    assert!(flood.len() >= CLIENTS / 2, "only {} connected", flood.len());
    let pid = agent.child.as_ref().expect("running").id();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    eprintln!(
        "{} debug clients connected; the agent has {open} files open",
        flood.len()
    );

    for args in [&["status"][..], &["endpoint", "list"][..]] {
        let t = Instant::now();
        let (code, out, err) = agent.cli(args);
        let took = t.elapsed();
        assert_eq!(
            code,
            0,
            "ciliate {args:?} during the flood: {out}{err}\n{}",
            agent.log()
        );
        assert!(
            took < Duration::from_secs(3),
            "ciliate {args:?} took {took:?}"
        );
        eprintln!("ciliate {args:?} answered in {took:?} during the flood");
    }
    let (code, out, err) = agent.cli(&["endpoint", "add", "--name", "x/a", "--ip", "10.7.0.1"]);
    assert_eq!(code, 0, "endpoint add during the flood: {out}{err}");
    drop(flood);

    let mut refused = None;
    agent.wait_until("/metrics answers after the flood", || {
        let (status, body) = agent.http_get("/metrics");
        refused = metric(&body, "ciliate_debug_connections_refused_total");
        status == 200
    });
    let refused = refused.expect("ciliate_debug_connections_refused_total on /metrics");
    eprintln!("refused connections: {refused}");
    assert!(
        refused > 0.0 && refused <= CLIENTS as f64,
        "refused {refused}"
    );
}

/// Runs an agent that must fail to start; returns its exit code and stderr.
fn failed_start(dir: &Path, args: &[String], debug: &str) -> (Option<i32>, String) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let socket = dir.join("run").join("ciliate.sock");
    let mut cmd = Agent::command(dir, &socket, debug, &args);
    let mut child = cmd
        .env("RUST_BACKTRACE", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("agent starts");
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("try_wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the agent did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn assert_one_clear_line(what: &str, code: Option<i32>, stderr: &str, names: &str) {
    assert_eq!(code, Some(1), "{what}: exit status; stderr:\n{stderr}");
    for bad in ["panicked", "stack backtrace", "RUST_BACKTRACE"] {
        assert!(
            !stderr.contains(bad),
            "{what}: {bad:?} in stderr:\n{stderr}"
        );
    }
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{what}: one error line; stderr:\n{stderr}");
    assert!(
        errors[0].contains(names),
        "{what}: the error names {names}: {}",
        errors[0]
    );
}

/// Item 9: with the debug port taken the agent printed the error, then panicked on shutdown
/// ("there is no reactor running") with a backtrace.
#[test]
fn a_taken_debug_port_fails_the_start_with_one_line_and_no_panic() {
    let guard = setup();
    let dir = guard.path();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (code, stderr) = failed_start(dir, &standalone(dir), &addr);
    assert_one_clear_line(
        "debug port taken",
        code,
        &stderr,
        &format!("--debug-addr {addr}"),
    );
    assert!(
        !dir.join("run/ciliate.sock").exists(),
        "the socket is not left behind"
    );
}

/// The same class of failure through the other start-up paths.
#[test]
fn other_start_failures_end_with_one_line_and_no_panic() {
    let guard = setup();
    let dir = guard.path();
    let debug = format!("127.0.0.1:{}", free_port());
    let args = |mode: &str, source: &str, path: &Path| -> Vec<String> {
        [
            "--mode",
            mode,
            "--datapath",
            "memory",
            source,
            path.to_str().expect("UTF-8 path"),
        ]
        .map(String::from)
        .to_vec()
    };
    let manifests = dir.join("manifests");
    // (what, arguments, a path made a plain file first, what the error line names)
    let cases = [
        (
            "socket directory is a file",
            args("standalone", "--manifests", &manifests),
            Some(dir.join("run")),
            "--api-socket".to_string(),
        ),
        (
            "state dir is a file",
            args("standalone", "--manifests", &manifests),
            Some(dir.join("state")),
            dir.join("state").display().to_string(),
        ),
        (
            "kubeconfig missing",
            args("kubernetes", "--kubeconfig", &dir.join("no-kubeconfig")),
            None,
            "no-kubeconfig".to_string(),
        ),
        (
            "kubeconfig not YAML",
            args("kubernetes", "--kubeconfig", &dir.join("bad-kubeconfig")),
            None,
            "bad-kubeconfig".to_string(),
        ),
        (
            "manifests missing",
            args("standalone", "--manifests", &dir.join("nothing")),
            None,
            "--manifests".to_string(),
        ),
    ];
    std::fs::write(dir.join("bad-kubeconfig"), "{not: [yaml").unwrap();
    for (what, args, file, names) in cases {
        if let Some(f) = &file {
            // An earlier case may have created it as a directory.
            let _ = std::fs::remove_dir_all(f);
            std::fs::write(f, "a plain file").unwrap();
        }
        let (code, stderr) = failed_start(dir, &args, &debug);
        assert_one_clear_line(what, code, &stderr, &names);
        if let Some(f) = &file {
            std::fs::remove_file(f).unwrap();
        }
    }
}
