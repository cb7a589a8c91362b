//! The manifest directory under load (hardening issue), a bench binary:
//! `cargo bench --bench manifests`.
//!
//! 1. **Load time against size:** one file of N Pod documents (each its own label set, so each
//!    its own identity), N = 10,000, 20,000, 40,000 and 80,000: from the agent's start until
//!    every pod has its identity. Linear growth keeps the ratio per document flat.
//! 2. **Soak:** 10,000 files (one Pod each, plus a policy file), then one file rewritten every
//!    10 ms for 60 s (`CILIATE_SOAK_SECS`), with a file created or removed every 100th edit.
//!    Meanwhile the unix-socket API (`GET /v1/endpoints`) is timed every 20 ms and the agent's RSS
//!    read every second. At the end the agent must say what the directory says.
//!
//! The real `ciliate agent` binary (release build), `--datapath memory`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Kills the agent when the bench ends, panics included.
struct Agent {
    child: Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    fn start(dir: tempfile::TempDir) -> Agent {
        let socket = dir.path().join("sock");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let child = Command::new(env!("CARGO_BIN_EXE_ciliate"))
            .args(["agent", "--datapath", "memory", "--node-name", "node-1"])
            .arg("--manifests")
            .arg(dir.path().join("m"))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg("--api-socket")
            .arg(&socket)
            .args(["--debug-addr", &format!("127.0.0.1:{port}")])
            .args(["--manifest-max-documents", "200000"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("agent.log")).expect("log file"))
            .spawn()
            .expect("agent starts");
        Agent {
            child,
            socket,
            _dir: dir,
        }
    }

    fn get(&self, path: &str) -> Option<serde_json::Value> {
        ciliate::client::request(&self.socket, "GET", path, None)
            .ok()
            .and_then(|b| serde_json::from_str(&b).ok())
    }

    fn identities(&self) -> u64 {
        self.get("/v1/status")
            .and_then(|v| v["identities"].as_u64())
            .unwrap_or(0)
    }

    fn rss_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }
}

fn pod(i: usize, version: usize) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: p{i}, namespace: shop, labels: {{app: a{i}, v: v{version}}}}}\n\
         status: {{podIPs: [{{ip: 10.{}.{}.{}}}]}}\n",
        100 + i / 62_500,
        (i / 250) % 250,
        i % 250 + 1
    )
}

const NAMESPACE: &str = "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n";
const POLICY: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
    metadata: {name: default-deny, namespace: shop}\nspec: {podSelector: {}, policyTypes: [Ingress]}\n";

fn new_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = dir.path().join("m");
    std::fs::create_dir_all(&m).expect("mkdir");
    std::fs::write(m.join("00-shop.yaml"), format!("{NAMESPACE}---\n{POLICY}")).expect("write");
    (dir, m)
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t.elapsed()
}

fn load_time() {
    println!("load time, one file of N Pod documents (each its own identity):");
    for n in [10_000, 20_000, 40_000, 80_000] {
        let (dir, m) = new_dir();
        let text: Vec<String> = (0..n).map(|i| pod(i, 0)).collect();
        std::fs::write(m.join("pods.yaml"), text.join("---\n")).expect("write");
        let t = Instant::now();
        let agent = Agent::start(dir);
        wait_for(
            "every pod has its identity",
            Duration::from_secs(600),
            || agent.identities() >= n as u64,
        );
        let took = t.elapsed();
        let (rss, hwm) = agent.rss_kib();
        println!(
            "  N = {n:>6}: {:>6.2} s, {:>5.1} us per document; RSS {} MiB (peak {} MiB)",
            took.as_secs_f64(),
            took.as_secs_f64() * 1e6 / n as f64,
            rss / 1024,
            hwm / 1024
        );
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn soak() {
    const FILES: usize = 10_000;
    let secs: u64 = std::env::var("CILIATE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let (dir, m) = new_dir();
    let path = |i: usize| m.join(format!("pod-{i:05}.yaml"));
    for i in 0..FILES {
        std::fs::write(path(i), pod(i, 0)).expect("write");
    }
    let t = Instant::now();
    let agent = Arc::new(Agent::start(dir));
    let loaded = wait_for("10,000 files load", Duration::from_secs(300), || {
        agent.identities() >= FILES as u64
    });
    println!(
        "soak: 10,000 files loaded in {:.2} s; editing one every 10 ms for {secs} s",
        loaded.max(t.elapsed()).as_secs_f64()
    );

    let stop = Arc::new(AtomicBool::new(false));
    let prober = {
        let (agent, stop) = (agent.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut lat = Vec::new();
            let mut failures = 0;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                if agent.get("/v1/endpoints").is_none() {
                    failures += 1;
                }
                lat.push(t.elapsed());
                std::thread::sleep(Duration::from_millis(20));
            }
            (lat, failures)
        })
    };
    let mut rss = Vec::new();
    let mut versions = vec![0usize; FILES];
    let mut extra: Vec<usize> = Vec::new();
    let start = Instant::now();
    let mut edits = 0usize;
    let mut next_rss = Instant::now();
    // A deterministic walk over the files.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    while start.elapsed() < Duration::from_secs(secs) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = (x % FILES as u64) as usize;
        versions[i] += 1;
        std::fs::write(path(i), pod(i, versions[i])).expect("write");
        edits += 1;
        if edits.is_multiple_of(100) {
            // Now and then a file comes or goes.
            if extra.len() < 50 && x.is_multiple_of(2) {
                let j = FILES + extra.len();
                std::fs::write(path(j), pod(j, 0)).expect("write");
                extra.push(j);
            } else if let Some(j) = extra.pop() {
                std::fs::remove_file(path(j)).expect("remove");
            }
        }
        if Instant::now() >= next_rss {
            rss.push(agent.rss_kib().0);
            next_rss += Duration::from_secs(1);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::Relaxed);
    let (mut lat, failures) = prober.join().expect("prober");
    lat.sort();
    // Converged: every pod's identity carries its last version's label.
    let expected = FILES + extra.len();
    let settle = wait_for("the agent converges", Duration::from_secs(60), || {
        identities_match(&agent, &versions, &extra)
    });
    let (rss_now, hwm) = agent.rss_kib();
    println!(
        "  {edits} edits; API GET /v1/endpoints over {} calls: p50 {:?}, p99 {:?}, max {:?}, {failures} failed",
        lat.len(),
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        lat[lat.len() - 1]
    );
    println!(
        "  RSS during the soak (1 s samples): min {} MiB, max {} MiB; after: {} MiB (peak {} MiB)",
        rss.iter().min().copied().unwrap_or(0) / 1024,
        rss.iter().max().copied().unwrap_or(0) / 1024,
        rss_now / 1024,
        hwm / 1024
    );
    println!(
        "  converged {:.2} s after the last edit: {expected} pods, each with its last labels",
        settle.as_secs_f64()
    );
    assert!(
        pct(&lat, 0.99) < Duration::from_millis(100),
        "API p99 over 100 ms"
    );
}

/// Whether every pod's identity has its last written labels (from `/v1/identities`).
fn identities_match(agent: &Agent, versions: &[usize], extra: &[usize]) -> bool {
    let Some(ids) = agent.get("/v1/identities") else {
        return false;
    };
    // Every identity of a pod (app=aN), with the version label it carries: exactly one each,
    // the last one written (an identity that outlives its label set is a leak).
    let mut have: Vec<(usize, usize)> = Vec::new();
    for id in ids.as_array().into_iter().flatten() {
        let labels: Vec<&str> = id["labels"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l.as_str())
            .collect();
        let app = labels.iter().find_map(|l| l.strip_prefix("k8s:app=a"));
        let v = labels.iter().find_map(|l| l.strip_prefix("k8s:v=v"));
        if let (Some(app), Some(v)) = (app, v) {
            have.push((
                app.parse().unwrap_or(usize::MAX),
                v.parse().unwrap_or(usize::MAX),
            ));
        }
    }
    have.sort_unstable();
    let mut want: Vec<(usize, usize)> = versions.iter().copied().enumerate().collect();
    want.extend(extra.iter().map(|&j| (j, 0)));
    want.sort_unstable();
    have == want
}

fn main() {
    // `cargo test --benches` runs bench binaries without `--bench`; keep that quick.
    if !std::env::args().any(|a| a == "--bench") {
        println!("manifests bench: run with `cargo bench --bench manifests`");
        return;
    }
    let only = std::env::var("CILIATE_BENCH_ONLY").unwrap_or_default();
    if only.is_empty() || only == "load" {
        load_time();
    }
    if only.is_empty() || only == "soak" {
        soak();
    }
}
