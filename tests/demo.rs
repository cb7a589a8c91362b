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
