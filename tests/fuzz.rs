//! A bounded fuzz of the manifest path, run by `cargo test` (a few seconds):
//! - policy documents from the worlds in `tests/worlds/`, `examples/` and the real-policies
//!   corpus (`../shared/examples/real-policies`, read at test time), mutated as YAML trees, go
//!   through `parse_policy` and, when accepted, the engine's upsert and resolve;
//! - the world files themselves, mutated as text, go through the world loader (`simulate`).
//!
//! Nothing may panic. Inputs are capped in size (trees by depth and breadth, texts at 64 KiB),
//! so memory stays bounded.

mod common;

use std::path::Path;
use std::sync::OnceLock;

use proptest::prelude::*;
use serde::Deserialize;
use serde_yaml::{Mapping, Value};

use ciliate::policy::engine::{EndpointView, NamedPort, PolicyEngine};
use ciliate::policy::labels::Labels;
use ciliate::policy::translate::parse_policy;
use ciliate::simulate::simulate;

const MAX_TEXT: usize = 64 << 10;

use common::yaml_files;

/// World files (text) and policy documents (trees) to start from.
struct Seeds {
    worlds: Vec<String>,
    policies: Vec<Value>,
}

fn seeds() -> &'static Seeds {
    static SEEDS: OnceLock<Seeds> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut world_files = Vec::new();
        yaml_files(&root.join("tests/worlds"), &mut world_files);
        yaml_files(&root.join("examples"), &mut world_files);
        world_files.sort();
        let mut worlds = Vec::new();
        let mut policies = Vec::new();
        for f in &world_files {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            if let Ok(v) = serde_yaml::from_str::<Value>(&text) {
                if let Some(Value::Sequence(ps)) = v.get("policies") {
                    policies.extend(ps.iter().cloned());
                }
            }
            worlds.push(text);
        }
        let corpus = root.join("../shared/examples/real-policies");
        let mut corpus_files = Vec::new();
        yaml_files(&corpus, &mut corpus_files);
        assert!(
            !corpus_files.is_empty() || std::env::var("CI").is_err(),
            "the real-policies corpus must be beside the repo in CI"
        );
        corpus_files.sort();
        for f in &corpus_files {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            for de in serde_yaml::Deserializer::from_str(&text) {
                if let Ok(v) = Value::deserialize(de) {
                    if v.is_mapping() {
                        policies.push(v);
                    }
                }
            }
        }
        assert!(worlds.len() >= 10, "{} worlds", worlds.len());
        assert!(policies.len() >= 50, "{} policy documents", policies.len());
        Seeds { worlds, policies }
    })
}

/// Values the mutations write: policy-shaped words, edge-case numbers and strings.
fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        prop::sample::select(vec![0i64, -1, 1, 53, 80, 65535, 65536, i64::MAX, i64::MIN])
            .prop_map(|n| Value::Number(n.into())),
        prop::sample::select(vec![
            "",
            " 80",
            "080",
            "010",
            "0x50",
            "http",
            "HTTP",
            "TCP",
            "ANY",
            "ICMP",
            "In",
            "NotIn",
            "Exists",
            "in",
            "world",
            "cluster",
            "all",
            "10.0.0.0/8",
            "10.0.0.0/33",
            "::/0",
            "k8s:app",
            "any:app",
            "a:b:c",
            "reserved:host",
            "Ingress",
            "Egress",
            "cilium.io/v2",
            "networking.k8s.io/v1",
            "CiliumNetworkPolicy",
            "NetworkPolicy",
            "CiliumClusterwideNetworkPolicy",
        ])
        .prop_map(|s| Value::String(s.to_string())),
        "[a-zA-Z0-9./:_ -]{0,70}".prop_map(Value::String),
        (0usize..3).prop_map(|n| Value::String("x".repeat(63 + n))),
    ]
}

/// One edit of a tree, applied at the `at`-th node in pre-order.
#[derive(Debug, Clone)]
enum Edit {
    Replace(Value),
    RemoveChild(usize),
    DuplicateChild(usize),
    InsertKey(String, Value),
    WrapInSequence,
}

fn edit() -> impl Strategy<Value = Edit> {
    let keys = prop::sample::select(vec![
        "port",
        "endPort",
        "protocol",
        "matchLabels",
        "matchExpressions",
        "key",
        "operator",
        "values",
        "toPorts",
        "ports",
        "fromEndpoints",
        "toEndpoints",
        "toCIDR",
        "toCIDRSet",
        "except",
        "fromEntities",
        "icmps",
        "rules",
        "policyTypes",
        "namespaceSelector",
        "podSelector",
        "ipBlock",
        "specs",
        "nodeSelector",
        "enableDefaultDeny",
    ]);
    prop_oneof![
        leaf().prop_map(Edit::Replace),
        any::<usize>().prop_map(Edit::RemoveChild),
        any::<usize>().prop_map(Edit::DuplicateChild),
        (keys, leaf()).prop_map(|(k, v)| Edit::InsertKey(k.to_string(), v)),
        Just(Edit::WrapInSequence),
    ]
}

/// Applies `e` at the `n`-th node (pre-order); returns how many nodes were passed.
fn apply(v: &mut Value, n: &mut usize, e: &Edit) -> bool {
    if *n == 0 {
        match e {
            Edit::Replace(x) => *v = x.clone(),
            Edit::RemoveChild(i) => match v {
                Value::Sequence(s) if !s.is_empty() => {
                    let i = i % s.len();
                    s.remove(i);
                }
                Value::Mapping(m) if !m.is_empty() => {
                    let i = i % m.len();
                    if let Some(k) = m.keys().nth(i).cloned() {
                        m.remove(&k);
                    }
                }
                _ => {}
            },
            Edit::DuplicateChild(i) => {
                if let Value::Sequence(s) = v {
                    if !s.is_empty() && s.len() < 64 {
                        let c = s[i % s.len()].clone();
                        s.push(c);
                    }
                }
            }
            Edit::InsertKey(k, x) => {
                if let Value::Mapping(m) = v {
                    m.insert(Value::String(k.clone()), x.clone());
                }
            }
            Edit::WrapInSequence => *v = Value::Sequence(vec![v.clone()]),
        }
        return true;
    }
    *n -= 1;
    match v {
        Value::Sequence(s) => s.iter_mut().any(|c| apply(c, n, e)),
        Value::Mapping(m) => m.iter_mut().any(|(_, c)| apply(c, n, e)),
        _ => false,
    }
}

fn count(v: &Value) -> usize {
    1 + match v {
        Value::Sequence(s) => s.iter().map(count).sum(),
        Value::Mapping(m) => m.values().map(count).sum(),
        _ => 0,
    }
}

/// An engine with a few pods of two namespaces, as endpoints to resolve.
fn engine_with_pods() -> (PolicyEngine, Vec<(u32, Labels)>) {
    let mut engine = PolicyEngine::new();
    let mut eps = Vec::new();
    for (ns, app) in [("default", "web"), ("default", "db"), ("other", "web")] {
        let pod: std::collections::BTreeMap<String, String> =
            [("app".to_string(), app.to_string())].into();
        let nsl: std::collections::BTreeMap<String, String> = Default::default();
        let labels = Labels::for_pod(ns, &pod, &nsl, Some("default"));
        let id = engine.allocate_identity(&labels).id();
        eps.push((id, labels));
    }
    (engine, eps)
}

fn mutate_text(text: &str, edits: &[(prop::sample::Index, u8, char)]) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    for (at, op, c) in edits {
        let i = at.index(chars.len().max(1));
        match op % 4 {
            0 if i < chars.len() => {
                chars.remove(i);
            }
            1 => chars.insert(i.min(chars.len()), *c),
            2 if i < chars.len() => chars[i] = *c,
            _ => {
                const YAML: [char; 12] =
                    ['{', '}', '[', ']', ':', '-', '\n', ' ', '"', '&', '*', '!'];
                chars.insert(i.min(chars.len()), YAML[i % YAML.len()]);
            }
        }
    }
    let mut s: String = chars.into_iter().collect();
    s.truncate(s.floor_char_boundary(MAX_TEXT));
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, .. ProptestConfig::default() })]

    #[test]
    fn mutated_policies_never_panic_in_parse_upsert_or_resolve(
        seed in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), edit()), 1..6),
    ) {
        let seeds = seeds();
        let mut doc = seeds.policies[seed.index(seeds.policies.len())].clone();
        for (at, e) in &edits {
            let mut n = at.index(count(&doc));
            apply(&mut doc, &mut n, e);
        }
        let (mut engine, eps) = engine_with_pods();
        if let Ok(p) = parse_policy(&doc, "default", "fuzz") {
            prop_assert!(!p.key.name.is_empty());
            engine.upsert_policy(p);
            let ports = [NamedPort { name: "http".into(), protocol: 6, port: 80 }];
            for (id, labels) in &eps {
                let view = EndpointView { identity: *id, labels, named_ports: &ports, host: false };
                let _ = engine.resolve(&view);
            }
        }
    }

    #[test]
    fn mutated_worlds_never_panic_in_the_loader(
        seed in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), any::<char>()), 1..8),
    ) {
        let seeds = seeds();
        let text = mutate_text(&seeds.worlds[seed.index(seeds.worlds.len())], &edits);
        if let Err(e) = simulate(&text) {
            prop_assert!(!e.entry.is_empty() && !e.message.is_empty());
        }
    }
}

/// Documents wrapped into a world: the loader and the parser see the same trees.
#[test]
fn every_seed_policy_loads_inside_a_world() {
    let seeds = seeds();
    let mut m = Mapping::new();
    m.insert("policies".into(), Value::Sequence(seeds.policies.clone()));
    let text = serde_yaml::to_string(&Value::Mapping(m)).unwrap_or_default();
    let sim = simulate(&text).expect("a world of verbatim manifests is usable");
    assert!(sim.results.is_empty());
}
