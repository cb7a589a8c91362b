//! The agent binary on a temporary directory, driven through its socket and debug server.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_ciliate");

/// The binary the harness runs as the agent: `CILIATE_AGENT_BIN` when set (an A/B bench runs
/// one bench binary against two builds, one after the other), else this build's.
pub fn agent_bin() -> String {
    std::env::var("CILIATE_AGENT_BIN").unwrap_or_else(|_| BIN.to_string())
}

pub struct Agent {
    pub child: Option<Child>,
    pub dir: PathBuf,
    pub debug: String,
    /// The API socket (`dir/ciliate.sock` unless the test chose another).
    pub socket: PathBuf,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl Agent {
    pub fn manifests(&self) -> PathBuf {
        self.dir.join("manifests")
    }
    pub fn socket(&self) -> PathBuf {
        self.socket.clone()
    }

    pub fn start_in(dir: &Path) -> Agent {
        Agent::start_with(dir, &["--datapath", "memory"])
    }

    /// Starts the agent with extra arguments (e.g. `--datapath bpf --bpf-root DIR`).
    pub fn start_with(dir: &Path, extra: &[&str]) -> Agent {
        let manifests = dir.join("manifests");
        let mut args = vec!["--mode", "standalone", "--manifests"];
        args.push(manifests.to_str().expect("UTF-8 path"));
        args.extend(extra);
        Agent::spawn(dir, &args)
    }

    /// Starts the agent in Kubernetes mode against the API server `kubeconfig` points at.
    pub fn start_kubernetes(dir: &Path, kubeconfig: &Path, extra: &[&str]) -> Agent {
        let a = Agent::spawn_kubernetes(dir, kubeconfig, extra);
        a.wait_until("the agent is ready", || a.http_get("/readyz").0 == 200);
        a
    }

    /// Like `start_kubernetes`, without waiting for it to be ready.
    pub fn spawn_kubernetes(dir: &Path, kubeconfig: &Path, extra: &[&str]) -> Agent {
        let mut args = vec!["--mode", "kubernetes", "--kubeconfig"];
        args.push(kubeconfig.to_str().expect("UTF-8 path"));
        args.extend(extra);
        Agent::spawn_unready(dir, &args)
    }

    fn spawn(dir: &Path, args: &[&str]) -> Agent {
        let a = Agent::spawn_unready(dir, args);
        a.wait_until("the agent is ready", || a.http_get("/readyz").0 == 200);
        a
    }

    fn spawn_unready(dir: &Path, args: &[&str]) -> Agent {
        let debug = format!("127.0.0.1:{}", free_port());
        let socket = dir.join("ciliate.sock");
        let mut cmd = Agent::command(dir, &socket, &debug, args);
        Agent::spawn_command(dir, socket, debug, &mut cmd)
    }

    /// The agent's command line as the harness runs it (`--state-dir dir/state`, the given
    /// socket and debug address), for tests that change how the process starts (resource
    /// limits, umask, environment) or watch a start fail.
    pub fn command(dir: &Path, socket: &Path, debug: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new(agent_bin());
        cmd.arg("agent");
        // node-1 unless the test names another node.
        if !args.contains(&"--node-name") {
            cmd.args(["--node-name", "node-1"]);
        }
        cmd.args(args)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--api-socket")
            .arg(socket)
            .args(["--debug-addr", debug])
            .env("RUST_LOG", "info");
        cmd
    }

    /// Spawns a command made by `command` (its log in `dir`), without waiting for it to be ready.
    pub fn spawn_command(dir: &Path, socket: PathBuf, debug: String, cmd: &mut Command) -> Agent {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let log = std::fs::File::create(dir.join(format!("agent-{nanos}.log"))).unwrap();
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("agent starts");
        Agent {
            child: Some(child),
            dir: dir.to_path_buf(),
            debug,
            socket,
        }
    }

    pub fn wait_until(&self, what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if f() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("timed out waiting until {what}; agent log:\n{}", self.log());
    }

    pub fn log(&self) -> String {
        let mut out = String::new();
        for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with("agent-") {
                out.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
            }
        }
        out
    }

    /// GET on the debug HTTP server: (status, body).
    pub fn http_get(&self, path: &str) -> (u16, String) {
        http_get_at(&self.debug, path)
    }

    pub fn json(&self, path: &str) -> Value {
        let (status, body) = self.http_get(path);
        assert_eq!(status, 200, "GET {path}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {e}: {body}"))
    }

    /// Runs a CLI client command against this agent.
    /// The newest flow of the last five minutes that `filters` (`ciliate monitor` flags)
    /// select, as JSON (`null` when none).
    pub fn last_flow(&self, filters: &[&str]) -> Value {
        let mut args = vec!["monitor", "-o", "json", "--since", "5m", "--count", "1"];
        args.extend_from_slice(filters);
        let (code, out, err) = self.cli(&args);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str(out.lines().next().unwrap_or("null")).expect("a flow")
    }

    pub fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(BIN)
            .args(args)
            .arg("--socket")
            .arg(self.socket())
            .output()
            .expect("cli runs");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    }

    pub fn cli_json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        let (code, out, err) = self.cli(&a);
        assert_eq!(code, 0, "ciliate {args:?}: {err}");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("ciliate {args:?}: {e}: {out}"))
    }

    /// `ciliate endpoint add --name NAME --ip IP --interface IF -o json`.
    pub fn add_endpoint(&self, name: &str, ip: impl ToString, interface: &str) -> Value {
        let ip = ip.to_string();
        self.cli_json(&[
            "endpoint",
            "add",
            "--name",
            name,
            "--ip",
            &ip,
            "--interface",
            interface,
        ])
    }

    pub fn endpoint(&self, id: u64) -> Value {
        self.cli_json(&["endpoint", "get", &id.to_string()])
    }

    pub fn revision(&self) -> u64 {
        self.json("/debug/policy")["revision"].as_u64().unwrap_or(0)
    }

    /// Waits until every endpoint realized at least `rev`.
    pub fn wait_realized(&self, rev: u64) {
        self.wait_until(&format!("every endpoint realized revision {rev}"), || {
            let eps = self.json("/debug/endpoints");
            eps.as_array().is_some_and(|a| {
                a.iter().filter(|e| !e["identity"].is_null()).all(|e| {
                    e["policy_revision"].as_u64().unwrap_or(0) >= rev && e["state"] == "ready"
                })
            })
        });
    }

    /// The realized entries of an endpoint: (direction, identity, protocol, port, deny).
    pub fn entries(&self, id: u64) -> Vec<(String, u64, u64, u64, bool)> {
        let v = self.cli_json(&["bpf", "policy", "get", &id.to_string()]);
        v["entries"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                (
                    e["direction"].as_str().unwrap_or("").to_string(),
                    e["identity"].as_u64().unwrap_or(0),
                    e["protocol"].as_u64().unwrap_or(0),
                    e["port"].as_u64().unwrap_or(0),
                    e["deny"].as_bool().unwrap_or(false),
                )
            })
            .collect()
    }

    pub fn stop(&mut self) -> i32 {
        let Some(mut c) = self.child.take() else {
            return 0;
        };
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(s)) = c.try_wait() {
                return s.code().unwrap_or(-1);
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                panic!("agent did not stop on SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.remove_masquerade_table();
    }
}

impl Agent {
    /// An agent keeps masquerading after it stops (by design: a restart must not cut pods off),
    /// so a test agent in the machine's own namespace would leave its `ip ciliate_<tag>` table
    /// there for good. Once no agent runs on this agent's state directory any more, the
    /// table goes (in whatever namespace this test runs; one of another namespace is not seen).
    fn remove_masquerade_table(&self) {
        let state = self.dir.join("state");
        let state_arg = state.to_string_lossy().into_owned();
        let running = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
            .any(|cmd| {
                // An agent (its proxies outlive it until the directory goes).
                let mut args = cmd.split(|b| *b == 0).skip(1);
                args.next() == Some(b"agent".as_slice())
                    && args.any(|a| a == b"--state-dir")
                    && args.next() == Some(state_arg.as_bytes())
            });
        if running {
            return;
        }
        let table = ciliate::datapath::masquerade::table_name(
            &ciliate::datapath::masquerade::tag_for(&state),
        );
        let _ = Command::new("nft")
            .args(["delete", "table", "ip", &table])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// GET on the HTTP server at `addr` (run it inside a node's namespace to reach that node's
/// agent): (status, body).
pub fn http_get_at(addr: &str, path: &str) -> (u16, String) {
    http_reply(&http_get_raw_at(addr, path))
}

/// GET on the HTTP server at `addr`: the whole response, headers included (empty when it
/// cannot connect).
pub fn http_get_raw_at(addr: &str, path: &str) -> String {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    );
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    raw
}

/// (status code, body) of a raw HTTP/1.1 response (0 when it has no status line).
pub fn http_reply(raw: &str) -> (u16, String) {
    let code = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}
