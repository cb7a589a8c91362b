//! `ciliate demo --once`, the README's first command without the wait for Ctrl-C: it must
//! create its pods through CNI, measure the expected matrices with real connections, exit 0,
//! and leave nothing behind. And `ciliate demo --no-policies`, the README's walk from no policy
//! to an enforced default deny with `policy recommend` and `policy diff`, as the demo prints
//! the commands. Privileged: with CI=true it must run.

mod common;

use std::io::Read;
use std::sync::Mutex;

use common::agent::{free_port, BIN};
use common::cni::unique_pod_cidr;
use common::netns::{in_netns, privileged};

/// One demo at a time: each checks that nothing of any demo is left behind.
static ONE_DEMO: Mutex<()> = Mutex::new(());

#[test]
fn the_demo_shows_policies_taking_effect_and_cleans_up() {
    if !privileged() {
        return;
    }
    let _one = ONE_DEMO.lock().unwrap_or_else(|e| e.into_inner());
    let tables_before = nft_tables();
    let out = std::process::Command::new(BIN)
        .args(["demo", "--once", "--debug-addr"])
        .arg(format!("127.0.0.1:{}", free_port()))
        .args(["--pod-cidr", &unique_pod_cidr()])
        .output()
        .expect("the demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status
    );
    assert!(!stdout.contains("unexpected"), "{stdout}");
    // The rows of the matrix after `title` (the first cell, the pod, left out).
    let rows_after = |title: &str, name: &str| -> Vec<String> {
        stdout
            .split(title)
            .nth(1)
            .unwrap_or_else(|| panic!("no matrix {title:?}: {stdout}"))
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no row {name} after {title:?}: {stdout}"))
            .split_whitespace()
            .skip(1)
            .map(str::to_string)
            .collect()
    };
    let row = |name: &str| rows_after("\nAfter:", name);
    // Columns: frontend:80, backend:8080 (node 1), db:5432, debug:22 (node 2).
    assert_eq!(
        row("shop/frontend"),
        ["-", "allow", "DENY", "allow"],
        "{stdout}"
    );
    // The backend's egress allows db:5432 only, across the nodes.
    assert_eq!(
        row("shop/backend"),
        ["DENY", "-", "allow", "DENY"],
        "{stdout}"
    );
    assert_eq!(row("shop/db"), ["allow", "DENY", "-", "allow"], "{stdout}");
    assert_eq!(
        row("tools/debug"),
        ["allow", "DENY", "DENY", "-"],
        "{stdout}"
    );
    // Services (svc/db -> db on node 2, svc/frontend -> frontend), from node 1's pods: every
    // probe got through before the policies; after them the egress rule judges the backend.
    let services = "Through Services (ClusterIP translated";
    assert_eq!(
        rows_after(services, "shop/frontend"),
        ["allow", "-"],
        "{stdout}"
    );
    assert_eq!(
        rows_after(services, "shop/backend"),
        ["allow", "allow"],
        "{stdout}"
    );
    let after = "Through Services, after";
    assert_eq!(
        rows_after(after, "shop/frontend"),
        ["DENY", "-"],
        "{stdout}"
    );
    assert_eq!(
        rows_after(after, "shop/backend"),
        ["allow", "DENY"],
        "{stdout}"
    );
    assert!(
        stdout.contains("demo-node-1 -> ") && stdout.contains("(native routing)"),
        "both nodes route to each other: {stdout}"
    );
    let why = |from: &str| {
        stdout
            .lines()
            .find(|l| l.trim_start().starts_with(from) && l.contains("dropped at"))
            .unwrap_or_else(|| panic!("no Why? line for {from}: {stdout}"))
            .to_string()
    };
    assert!(
        why("tools/debug    -> shop/db:TCP/5432")
            .ends_with("denied by CiliumClusterwideNetworkPolicy no-tools-to-db[0]"),
        "the deny rule's drop names the CCNP and its rule: {stdout}"
    );
    assert!(
        why("shop/backend   -> shop/frontend:TCP/80")
            .contains("default deny: selected by CiliumNetworkPolicy shop/tiers"),
        "a default deny names the policy that isolates the endpoint: {stdout}"
    );
    let leftovers = ip_lines(&["netns"], |l| l.starts_with("ciliate-demo-"));
    assert!(
        leftovers.is_empty(),
        "namespaces left behind: {leftovers:?}"
    );
    let pins: Vec<_> = std::fs::read_dir("/sys/fs/bpf")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("ciliate-demo-"))
        .collect();
    assert!(pins.is_empty(), "pins left behind: {pins:?}");
    let tag_links = ip_lines(&["-o", "link", "show"], |l| l.contains(": cdm"));
    assert!(
        tag_links.is_empty(),
        "node links left behind: {tag_links:?}"
    );
    let tables: Vec<_> = nft_tables()
        .into_iter()
        .filter(|t| !tables_before.contains(t))
        .collect();
    assert!(tables.is_empty(), "nft tables left behind: {tables:?}");
    let cgroups: Vec<_> = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flat_map(|d| d.flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with("ciliate-demo-"))
        .collect();
    assert!(cgroups.is_empty(), "cgroups left behind: {cgroups:?}");
}

/// The commands the demo prints, run as a user would (`ciliate` is this build).
fn run_printed(stdout: &str, starts: &str) -> String {
    let line = stdout
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with(starts))
        .unwrap_or_else(|| panic!("the demo prints no {starts:?}: {stdout}"));
    let args: Vec<&str> = line.split_whitespace().skip(1).collect();
    let out = std::process::Command::new(BIN)
        .args(&args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{line}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn the_demo_walks_from_no_policy_to_an_enforced_default_deny() {
    if !privileged() {
        return;
    }
    let _one = ONE_DEMO.lock().unwrap_or_else(|e| e.into_inner());
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut demo = Demo(
        std::process::Command::new(BIN)
            .args(["demo", "--no-policies", "--debug-addr"])
            .arg(format!("127.0.0.1:{}", free_port()))
            .args(["--pod-cidr", &unique_pod_cidr()])
            .stdout(log.reopen().unwrap())
            .spawn()
            .expect("the demo runs"),
    );
    let mut stdout = String::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !stdout.contains("Ctrl-C to stop") {
        assert!(
            std::time::Instant::now() < deadline,
            "the demo is not up: {stdout}"
        );
        assert!(
            demo.0.try_wait().unwrap().is_none(),
            "the demo ended: {stdout}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
        stdout.clear();
        log.reopen().unwrap().read_to_string(&mut stdout).unwrap();
    }
    assert!(!stdout.contains("\nAfter:"), "no policy applied: {stdout}");

    // Recommended from both nodes' flows: one policy per workload of shop, nothing else.
    let recommended = run_printed(&stdout, "ciliate policy recommend");
    let kinds = recommended.matches("kind: CiliumNetworkPolicy").count();
    assert_eq!(kinds, 3, "frontend, backend and db: {recommended}");
    // The demo's own policies would cut what its After matrix shows cut: six connections.
    let diff = run_printed(&stdout, "ciliate policy diff");
    assert!(
        diff.starts_with(
            "6 connection(s) would be newly dropped, 0 newly forwarded, of 12 observed"
        ),
        "{diff}"
    );
    assert!(
        diff.contains("tools/debug (app=debug) -> shop/db (app=db) TCP/5432  seen 1 time(s)")
            && diff.contains("by CiliumClusterwideNetworkPolicy no-tools-to-db[0]"),
        "{diff}"
    );

    // Enforced: what was seen still passes, what was not is dropped.
    let dir = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("scratch directory "))
        .expect("the scratch directory")
        .to_string();
    let ip_of = |pod: &str| -> std::net::IpAddr {
        stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix(&format!("pod {pod} (")))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address of {pod}: {stdout}"))
    };
    std::fs::write(format!("{dir}/manifests/policies.yaml"), &recommended).unwrap();
    let frontend = format!("ciliate-demo-{}-frontend", demo.0.id());
    let db = ip_of("shop/db");
    let connect = |port: u16| {
        in_netns(&frontend, move || {
            std::net::TcpStream::connect_timeout(
                &std::net::SocketAddr::new(db, port),
                std::time::Duration::from_millis(700),
            )
            .map(|_| ())
            .map_err(|e| e.kind())
        })
        .join()
        .unwrap()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    // Allowed, a port without a server refuses; dropped, it times out.
    while connect(22) != Err(std::io::ErrorKind::TimedOut) {
        assert!(
            std::time::Instant::now() < deadline,
            "frontend -> db:22 not dropped"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert_eq!(
        connect(5432),
        Ok(()),
        "frontend -> db:5432 was seen: it passes"
    );

    let status = demo.stop();
    assert!(status.success(), "{status:?}");
    let leftovers = ip_lines(&["netns"], |l| l.starts_with("ciliate-demo-"));
    assert!(
        leftovers.is_empty(),
        "namespaces left behind: {leftovers:?}"
    );
}

/// The demo process: stopped as Ctrl-C stops it (and cleans up) whatever the test's outcome.
struct Demo(std::process::Child);

impl Demo {
    fn stop(&mut self) -> std::process::ExitStatus {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGINT,
        );
        self.0.wait().expect("the demo ends")
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            self.stop();
        }
    }
}

/// The nft tables of this host's namespace (`family name`).
fn nft_tables() -> Vec<String> {
    let out = std::process::Command::new("nft")
        .args(["list", "tables"])
        .output()
        .expect("nft (installed by .ci/setup)");
    assert!(out.status.success(), "nft list tables failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("table "))
        .map(str::to_string)
        .collect()
}

/// The lines of `ip ARGS` that `keep` accepts.
fn ip_lines(args: &[&str], keep: impl Fn(&str) -> bool) -> Vec<String> {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| keep(l))
        .map(str::to_string)
        .collect()
}
