//! `ciliate demo --once`, the README's first command without the wait for Ctrl-C: it must
//! create its pods through CNI, measure the expected matrices with real connections, exit 0,
//! and leave nothing behind. Privileged: with CI=true it must run.

mod common;

use common::agent::{free_port, BIN};
use common::cni::unique_pod_cidr;
use common::netns::privileged;

#[test]
fn the_demo_shows_policies_taking_effect_and_cleans_up() {
    if !privileged() {
        return;
    }
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
    let after = stdout.split("After:").nth(1).expect("an after matrix");
    let row = |name: &str| {
        after
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no row {name}: {stdout}"))
            .split_whitespace()
            .skip(1)
            .collect::<Vec<_>>()
    };
    // Columns: frontend:80, backend:8080, db:5432, debug:22.
    assert_eq!(
        row("shop/frontend"),
        ["-", "allow", "DENY", "allow"],
        "{stdout}"
    );
    assert_eq!(
        row("shop/backend"),
        ["allow", "-", "allow", "allow"],
        "{stdout}"
    );
    assert_eq!(row("shop/db"), ["allow", "DENY", "-", "allow"], "{stdout}");
    assert_eq!(
        row("tools/debug"),
        ["allow", "DENY", "DENY", "-"],
        "{stdout}"
    );
    assert!(
        stdout.contains("tools/debug    -> shop/db:TCP/5432") && stdout.contains("policy-deny"),
        "the deny rule's drop is explained: {stdout}"
    );
    let netns = std::process::Command::new("ip")
        .args(["netns"])
        .output()
        .unwrap();
    let leftovers: Vec<String> = String::from_utf8_lossy(&netns.stdout)
        .lines()
        .filter(|l| l.starts_with("ciliate-demo-"))
        .map(str::to_string)
        .collect();
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
}
