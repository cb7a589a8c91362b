//! Data-driven policy tests: every `tests/worlds/NAME.yaml` (and `examples/NAME.yaml`) is run through the real
//! `ciliate policy simulate` binary and compared with `NAME.expected.jsonl` (verdicts, compared on
//! the keys the expected line has) and, when present, `NAME.expected-rejections.txt` (one line per
//! rejected policy: `Kind namespace/name<TAB>field.path`; exit status 3 expected, else 0).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn worlds_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/worlds")
}

fn check_world(yaml: &Path) -> Result<(), String> {
    let stem = yaml
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default();
    let dir = yaml.parent().unwrap_or(Path::new("."));
    let expected_path = dir.join(format!("{stem}.expected.jsonl"));
    let expected = std::fs::read_to_string(&expected_path)
        .map_err(|e| format!("{}: {e}", expected_path.display()))?;
    let rejections = std::fs::read_to_string(dir.join(format!("{stem}.expected-rejections.txt")))
        .unwrap_or_default();
    let out = Command::new(env!("CARGO_BIN_EXE_ciliate"))
        .args(["policy", "simulate", "--world"])
        .arg(yaml)
        .output()
        .map_err(|e| format!("cannot run ciliate: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mut problems = Vec::new();

    let want_code = if rejections.trim().is_empty() { 0 } else { 3 };
    if out.status.code() != Some(want_code) {
        problems.push(format!(
            "exit status {:?}, want {want_code}; stderr:\n{stderr}",
            out.status.code()
        ));
    }
    for line in rejections.lines().filter(|l| !l.trim().is_empty()) {
        let (policy, field) = line.split_once('\t').unwrap_or((line, ""));
        let hit = stderr
            .lines()
            .any(|l| l.contains(policy.trim()) && l.contains(field.trim()));
        if !hit {
            problems.push(format!(
                "no stderr line names {policy:?} and field {field:?}; stderr:\n{stderr}"
            ));
        }
    }
    let got: Vec<&str> = stdout.lines().collect();
    let want: Vec<&str> = expected.lines().filter(|l| !l.trim().is_empty()).collect();
    if got.len() != want.len() {
        problems.push(format!("{} result lines, want {}", got.len(), want.len()));
    }
    for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
        let g: Value =
            serde_json::from_str(g).map_err(|e| format!("line {i}: not JSON: {e}: {g}"))?;
        let w: Value = serde_json::from_str(w).map_err(|e| format!("expected line {i}: {e}"))?;
        if g.get("reason")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            problems.push(format!("probe {i}: no reason: {g}"));
        }
        let Some(wo) = w.as_object() else { continue };
        for (k, wv) in wo {
            if g.get(k) != Some(wv) {
                problems.push(format!(
                    "probe {i} ({} -> {}): {k} = {}, want {wv}; reason: {}",
                    w["from"],
                    w["to"],
                    g.get(k).unwrap_or(&Value::Null),
                    g.get("reason").unwrap_or(&Value::Null)
                ));
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n  "))
    }
}

#[test]
fn every_world_gives_its_expected_verdicts() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut worlds: Vec<PathBuf> = std::fs::read_dir(worlds_dir())
        .expect("tests/worlds exists")
        .chain(std::fs::read_dir(examples).expect("examples exists"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    worlds.sort();
    assert!(worlds.len() >= 2, "no worlds found");
    let failures: Vec<String> = worlds
        .iter()
        .filter_map(|w| {
            check_world(w)
                .err()
                .map(|e| format!("{}:\n  {e}", w.display()))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} worlds failed:\n{}",
        failures.len(),
        worlds.len(),
        failures.join("\n")
    );
    eprintln!("{} worlds passed", worlds.len());
}
