//! The engine's hot paths in instructions (issue #33 item 4): each case of `benches/icount.rs`
//! (the `icount` profile) runs under valgrind's callgrind, and its instruction count must stay within
//! `TOLERANCE` of the figure committed in `benches/icount.json`. Counts are deterministic on a
//! noisy machine (two runs agree to 0.05 %), so a change of a few percent shows.
//!
//! A figure that moves, worse or better, fails here; a change that moves one on purpose updates
//! `benches/icount.json` in the same commit (`CILIATE_ICOUNT_UPDATE=1 cargo test --test icount`)
//! and says why in its message. The counts hold for one kind of machine: glibc and std pick
//! string routines by CPU features (valgrind presents the host's, AVX2 at most), so a machine of
//! another kind updates the figures first.
//!
//! Without valgrind the test says so and passes, except under `CI=true` (`.ci/setup` installs it).
//!
//! The BPF programs the same way, in the verifier's processed instructions (`verified_insns`, as
//! root): committed in `benches/bpf_insns.json`, they hold for one kernel and one clang. The
//! per-packet times are `cargo bench --bench datapath_ab`'s (interleaved against a baseline).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The largest relative change of a figure that passes.
const TOLERANCE: f64 = 0.02;

#[test]
fn bpf_programs_keep_their_verified_instruction_counts() {
    use ciliate::datapath::bpf::{ensure_bpffs, load_netdev_program, load_program};
    use std::os::fd::{AsFd, AsRawFd};
    if !nix::unistd::geteuid().is_root() {
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true"),
            "CI runs as root"
        );
        eprintln!("SKIP: loading BPF programs needs root");
        return;
    }
    let root = PathBuf::from(format!("/sys/fs/bpf/ciliate-icount-{}", std::process::id()));
    ensure_bpffs(&root).unwrap();
    let pins = root.join("ciliate");
    let verified = |fd: std::os::fd::BorrowedFd<'_>| {
        let mut info = libbpf_rs::libbpf_sys::bpf_prog_info::default();
        let mut len = std::mem::size_of_val(&info) as u32;
        let rc = unsafe {
            libbpf_rs::libbpf_sys::bpf_prog_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len)
        };
        assert_eq!(rc, 0, "bpf_prog_get_info_by_fd");
        info.verified_insns as u64
    };
    let mut measured = BTreeMap::new();
    {
        let mut s = std::mem::MaybeUninit::uninit();
        let ep = load_program(&mut s, &pins, 7).unwrap();
        measured.insert(
            "to_container".to_string(),
            verified(ep.progs.to_container.as_fd()),
        );
        measured.insert(
            "from_container".to_string(),
            verified(ep.progs.from_container.as_fd()),
        );
        let mut s = std::mem::MaybeUninit::uninit();
        let dev = load_netdev_program(&mut s, &pins, false).unwrap();
        measured.insert(
            "from_netdev".to_string(),
            verified(dev.progs.from_netdev.as_fd()),
        );
        measured.insert(
            "to_netdev".to_string(),
            verified(dev.progs.to_netdev.as_fd()),
        );
    }
    let _ = std::fs::remove_dir_all(&root);
    check("bpf_insns.json", &measured);
}

/// Compares `measured` with the figures committed in `benches/NAME` (or, with
/// `CILIATE_ICOUNT_UPDATE=1`, writes them there).
fn check(name: &str, measured: &BTreeMap<String, u64>) {
    let figures = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("benches")
        .join(name);
    if std::env::var("CILIATE_ICOUNT_UPDATE").is_ok_and(|v| v == "1") {
        let text = serde_json::to_string_pretty(measured).unwrap();
        std::fs::write(&figures, text + "\n").unwrap();
        eprintln!("updated {}: {measured:?}", figures.display());
        return;
    }
    let committed: BTreeMap<String, u64> =
        serde_json::from_str(&std::fs::read_to_string(&figures).unwrap()).unwrap();
    let mut report = Vec::new();
    let mut moved = false;
    for (case, &now) in measured {
        let Some(&then) = committed.get(case) else {
            moved = true;
            report.push(format!("{case}: {now} instructions, no committed figure"));
            continue;
        };
        let ratio = now as f64 / then as f64;
        let out = (ratio - 1.0).abs() > TOLERANCE;
        moved |= out;
        report.push(format!(
            "{case}: {now} instructions against {then} committed ({:+.2} %){}",
            (ratio - 1.0) * 100.0,
            if out { "  <- moved" } else { "" }
        ));
    }
    for case in committed.keys().filter(|c| !measured.contains_key(*c)) {
        moved = true;
        report.push(format!("{case}: committed, but no such case any more"));
    }
    eprintln!("{}", report.join("\n"));
    assert!(
        !moved,
        "instruction counts in benches/{name} moved by more than {:.0} %:\n{}\n(a change made on purpose updates the figures: CILIATE_ICOUNT_UPDATE=1 cargo test --test icount)",
        TOLERANCE * 100.0,
        report.join("\n")
    );
}

#[test]
fn engine_hot_paths_keep_their_instruction_counts() {
    if Command::new("valgrind").arg("--version").output().is_err() {
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true"),
            "valgrind is missing under CI=true (.ci/setup installs it)"
        );
        eprintln!("SKIP: valgrind is not installed (bash .ci/setup installs it)");
        return;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bin = build_icount(repo);
    let list = Command::new(&bin).arg("--list").output().unwrap();
    let cases: Vec<String> = String::from_utf8(list.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert!(cases.len() >= 6, "cases: {cases:?}");
    let measured: BTreeMap<String, u64> = cases
        .iter()
        .map(|c| (c.clone(), instructions(&bin, c)))
        .collect();
    check("icount.json", &measured);
}

/// Builds `benches/icount.rs` with the `icount` profile (Cargo.toml: this crate at release
/// level, its dependencies' own code unoptimized, to keep CI's build short); its executable.
fn build_icount(repo: &Path) -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(repo)
        .args([
            "build",
            "--profile",
            "icount",
            "--bench",
            "icount",
            "--message-format=json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo build --profile icount --bench icount: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["target"]["name"] == "icount")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .expect("the icount bench's executable")
}

/// The instructions callgrind counts inside the case's measured function.
fn instructions(bin: &Path, case: &str) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("callgrind.out");
    let out = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", file.display()))
        .arg("--toggle-collect=*icount_measured*")
        .arg(bin)
        .arg(case)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "callgrind {case}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&file).unwrap();
    let n = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no summary in callgrind's output for {case}"));
    assert!(
        n > 0,
        "{case}: nothing counted (is icount_measured inlined away?)"
    );
    n
}
