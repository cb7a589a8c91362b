//! Engine bench helpers shared by `benches/policy.rs` and `benches/icount.rs`.

use std::collections::BTreeMap;

use ciliate::policy::engine::PolicyEngine;
use ciliate::policy::labels::Labels;
use ciliate::policy::translate::parse_policy;

pub fn pod_labels(ns: &str, app: &str) -> Labels {
    let pod: BTreeMap<String, String> = [("app".to_string(), app.to_string())].into();
    Labels::for_pod(ns, &pod, &BTreeMap::new(), Some("default"))
}

pub fn add_policy(engine: &mut PolicyEngine, yaml: &str) {
    let doc: serde_yaml::Value = serde_yaml::from_str(yaml).expect("bench policy is YAML");
    let p = parse_policy(&doc, "default", "bench").expect("bench policy is valid");
    engine.upsert_policy(p);
}
