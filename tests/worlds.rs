//! Data-driven policy tests: every `tests/worlds/NAME.yaml` (and `examples/NAME.yaml`) is run through the real
//! `ciliate policy simulate` binary and compared with `NAME.expected.jsonl` (verdicts, compared on
//! the keys the expected line has) and, when present, `NAME.expected-rejections.txt` (one line per
//! rejected policy: `Kind namespace/name<TAB>field.path`; exit status 3 expected, else 0).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_json::Value;

fn worlds_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/worlds")
}

/// A world's file and its expected verdicts and rejections.
fn expectations(yaml: &Path) -> Result<(String, String), String> {
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
    Ok((expected, rejections))
}

fn check_world(yaml: &Path) -> Result<(), String> {
    let (expected, rejections) = expectations(yaml)?;
    simulate_and_compare(yaml, &expected, &rejections, &[])
}

/// Runs `policy simulate` on `yaml` and compares its verdicts with `expected` on every key an
/// expected line has except `ignore`, and its stderr with `rejections`.
fn simulate_and_compare(
    yaml: &Path,
    expected: &str,
    rejections: &str,
    ignore: &[&str],
) -> Result<(), String> {
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
            if !ignore.contains(&k.as_str()) && g.get(k) != Some(wv) {
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

/// The IPv6 twin of an IPv4 address: `fd00:4::a.b.c.d`. Prefixes keep their containment
/// (`a.b.c.d/n` becomes `fd00:4::a.b.c.d/(96+n)`), except `0.0.0.0/0`, which is `::/0`.
fn twin6(s: &str) -> Option<String> {
    let base = u128::from(std::net::Ipv6Addr::new(0xfd00, 4, 0, 0, 0, 0, 0, 0));
    let six = |a: std::net::Ipv4Addr| std::net::Ipv6Addr::from(base | u128::from(u32::from(a)));
    if let Ok(a) = s.parse::<std::net::Ipv4Addr>() {
        return Some(six(a).to_string());
    }
    let net = s.parse::<ipnet::Ipv4Net>().ok()?;
    Some(match net.prefix_len() {
        0 => "::/0".to_string(),
        n => format!("{}/{}", six(net.addr()), 96 + n),
    })
}

/// The ICMPv6 twin of an ICMP type: echo request and reply, destination unreachable and time
/// exceeded as ICMPv6 numbers them, any other type one-to-one into ICMPv6 numbers no rule of
/// the worlds uses (150 + type), so that which rule admits which probe stays as it was.
fn twin_icmp_type(t: u64) -> u64 {
    match t {
        8 => 128,
        0 => 129,
        3 => 1,
        11 => 3,
        t => 150 + t,
    }
}

/// Every IPv4 address and prefix in `v` (keys and values) replaced by its IPv6 twin, and ICMP
/// (probes' `protocol: ICMP` and `icmpType`, rules' `icmps` fields) by ICMPv6.
fn to_ipv6(v: serde_yaml::Value) -> serde_yaml::Value {
    use serde_yaml::Value as Y;
    match v {
        Y::String(s) => Y::String(twin6(&s).unwrap_or(s)),
        Y::Sequence(l) => Y::Sequence(l.into_iter().map(to_ipv6).collect()),
        Y::Mapping(m) => {
            // An `icmps` field: {type: N, family?: IPv4}.
            let icmp_field = m.get("type").is_some_and(Y::is_u64)
                && m.keys().all(|k| k == "type" || k == "family");
            let mut out: serde_yaml::Mapping = m
                .into_iter()
                .map(|(k, v)| {
                    let v = match (k.as_str(), v) {
                        (Some("protocol"), Y::String(p)) if p == "ICMP" => "ICMPV6".into(),
                        (Some("icmpType" | "type"), Y::Number(t)) if t.is_u64() => {
                            twin_icmp_type(t.as_u64().unwrap_or_default()).into()
                        }
                        (_, v) => to_ipv6(v),
                    };
                    (to_ipv6(k), v)
                })
                .collect();
            if icmp_field {
                out.insert("family".into(), "IPv6".into());
            }
            Y::Mapping(out)
        }
        Y::Tagged(t) => Y::Tagged(Box::new(serde_yaml::value::TaggedValue {
            tag: t.tag,
            value: to_ipv6(t.value),
        })),
        other => other,
    }
}

/// Worlds with no IPv6 twin: loopback's meaning is tied to 127.0.0.0/8, and the others are IPv6
/// or dual stack already.
const NO_IPV6_TWIN: &[&str] = &["allow-localhost", "ipv6-pods", "dual-stack"];

/// The Kubernetes NetworkPolicy worlds, the policy-tier worlds (the network-policy-api
/// conformance suite included) and every other world, with every pod, node, DNS answer,
/// probe address and CIDR moved to IPv6 (issue 31: "the e2e worlds and the tier worlds also
/// pass with IPv6 pod addresses"): the same verdicts, world by world and probe by probe.
#[test]
fn every_world_gives_the_same_verdicts_with_ipv6_addresses() {
    assert_eq!(twin6("10.40.0.1").as_deref(), Some("fd00:4::a28:1"));
    assert_eq!(twin6("10.40.0.0/16").as_deref(), Some("fd00:4::a28:0/112"));
    assert_eq!(twin6("0.0.0.0/0").as_deref(), Some("::/0"));
    assert_eq!(twin6("web"), None);
    let tmp = tempfile::tempdir().unwrap();
    let mut worlds: Vec<PathBuf> = std::fs::read_dir(worlds_dir())
        .expect("tests/worlds exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .filter(|p| {
            let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
            !NO_IPV6_TWIN.contains(&stem)
        })
        .collect();
    worlds.sort();
    let mut failures = Vec::new();
    let mut moved = 0;
    for w in &worlds {
        let text = std::fs::read_to_string(w).unwrap();
        let mut docs = Vec::new();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            // As the simulator reads policies: an integer beyond 64 bits is a float.
            let ciliate::policy::translate::Document(v) =
                Deserialize::deserialize(doc).expect("a world is YAML");
            docs.push(serde_yaml::to_string(&to_ipv6(v)).unwrap());
        }
        let twin = docs.join("---\n");
        moved += usize::from(twin.contains("fd00:4::"));
        let path = tmp.path().join(w.file_name().unwrap());
        std::fs::write(&path, twin).unwrap();
        let (expected, rejections) = expectations(w).unwrap();
        let expected: String = expected
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let v: serde_yaml::Value = serde_yaml::from_str(l).unwrap();
                let v: Value = serde_yaml::from_value(to_ipv6(v)).unwrap();
                format!("{v}\n")
            })
            .collect();
        // Reasons name addresses: compared by the IPv4 run; here the verdicts.
        if let Err(e) = simulate_and_compare(&path, &expected, &rejections, &["reason"]) {
            failures.push(format!("{} (IPv6 twin):\n  {e}", w.display()));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} IPv6 twins failed:\n{}",
        failures.len(),
        worlds.len(),
        failures.join("\n")
    );
    // The twins are twins: nearly every world has pod addresses to move.
    assert!(
        moved * 10 >= worlds.len() * 9,
        "{moved} of {} worlds moved to IPv6",
        worlds.len()
    );
    eprintln!(
        "{} IPv6 twins passed ({moved} with addresses moved)",
        worlds.len()
    );
}
