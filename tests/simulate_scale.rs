//! `policy simulate` on a large world in bounded memory (hardening issue, item 5: a 20 MB world
//! peaked at 1.5 GB RSS, a 200 MB one at 9.5 GB). The world is generated into a temp directory;
//! the peak RSS of the simulating process is read from `getrusage(RUSAGE_CHILDREN)`, which holds
//! the largest of the children this test binary has waited for (this file spawns only these).

use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_ciliate");

#[test]
fn a_twenty_megabyte_world_simulates_in_a_few_hundred_megabytes() {
    let dir = tempfile::tempdir().unwrap();
    let world = dir.path().join("world.yaml");
    let out = Command::new(BIN)
        .args(["policy", "generate-world", "--pods", "135000"])
        .output()
        .expect("generate-world runs");
    assert!(out.status.success());
    assert!(out.stdout.len() > 20_000_000, "{} bytes", out.stdout.len());
    std::fs::write(&world, &out.stdout).unwrap();
    drop(out);

    let sim = Command::new(BIN)
        .args(["policy", "simulate", "--world"])
        .arg(&world)
        .stderr(Stdio::piped())
        .output()
        .expect("simulate runs");
    assert!(
        sim.status.success(),
        "{}",
        String::from_utf8_lossy(&sim.stderr)
    );
    let verdicts = sim.stdout.split(|b| *b == b'\n').filter(|l| !l.is_empty());
    assert_eq!(verdicts.count(), 10_000, "one verdict per probe");
    let peak_kib = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
        .expect("getrusage")
        .max_rss();
    println!(
        "peak RSS of simulate on a 20 MB world: {} MiB",
        peak_kib / 1024
    );
    assert!(
        peak_kib < 600 * 1024,
        "simulate peaked at {} MiB on a 20 MB world",
        peak_kib / 1024
    );
}
