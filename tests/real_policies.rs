//! Checks the parser against the third-party corpus in `../shared/examples/real-policies/`
//! (read in place, never copied): every document Cilium 1.16 accepts must be accepted, and the
//! files `EXPECTED.md` lists as rejected must be rejected.

mod common;

use std::path::{Path, PathBuf};

use ciliate::policy::translate::parse_policy;

/// Files Cilium 1.16 rejects (EXPECTED.md, "Rejected by Cilium 1.16").
const REJECTED: &[&str] = &[
    "cilium-examples/minikube/malformed_policy.yaml",
    "cilium-examples/host/lock-down-ingress.yaml",
    "cilium-examples/host/allow-extended-protocols.yaml",
    "cilium-examples/l3/match-expressions/and-statement.yaml",
    "cilium-examples/l3/match-expressions/or-statement.yaml",
    "cilium-examples/l3/entities/customnodes.yaml",
    "cilium-examples/l3/entities/from_nodes.yaml",
];

fn corpus() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/examples/real-policies");
    p.is_dir().then_some(p)
}

use common::yaml_files;

#[test]
fn real_world_policies_get_cilium_1_16_verdicts() {
    let Some(root) = corpus() else {
        assert!(
            std::env::var("CI").is_err(),
            "the real-policies corpus must be beside the repo in CI"
        );
        eprintln!("skipped: ../shared/examples/real-policies not found");
        return;
    };
    let mut files = Vec::new();
    yaml_files(&root, &mut files);
    files.sort();
    assert!(files.len() >= 100, "corpus has {} files", files.len());
    let mut problems = Vec::new();
    let mut documents = 0;
    for f in &files {
        let rel = f
            .strip_prefix(&root)
            .unwrap_or(f)
            .to_string_lossy()
            .to_string();
        let text = std::fs::read_to_string(f).unwrap_or_default();
        let mut errors = Vec::new();
        for (i, de) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            let doc = match serde::Deserialize::deserialize(de) {
                Ok(serde_yaml::Value::Null) => continue,
                Ok(v) => v,
                Err(e) => {
                    errors.push(format!("YAML: {e}"));
                    continue;
                }
            };
            documents += 1;
            if let Err(e) = parse_policy(&doc, "default", &format!("{rel}#{i}")) {
                errors.push(e.to_string());
            }
        }
        let want_rejected = REJECTED.contains(&rel.as_str());
        match (want_rejected, errors.is_empty()) {
            (true, true) => problems.push(format!("{rel}: accepted, but Cilium 1.16 rejects it")),
            (false, false) => problems.push(format!("{rel}: rejected: {}", errors.join("; "))),
            (true, false) => eprintln!("{rel}: rejected as expected: {}", errors.join("; ")),
            (false, true) => {}
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
    eprintln!("{} files, {documents} documents checked", files.len());
}
