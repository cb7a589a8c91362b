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

/// `count` ClusterNetworkPolicies of 25 ingress rules each, selecting every pod (issue #28):
/// Admin and Baseline (every fourth), Accept/Deny/Pass, peers by namespace `x` (one rule in
/// five: every identity of it) or by 5 pods' `app` of `app-0`..`app-999`, on TCP ports
/// 1000-1049.
pub fn add_tier_policies(engine: &mut PolicyEngine, count: usize) {
    for p in 0..count {
        let tier = if p % 4 == 3 { "Baseline" } else { "Admin" };
        let rules: Vec<String> = (0..25)
            .map(|k| {
                let action = ["Accept", "Deny", "Pass"][(p + k) % 3];
                let action = if tier == "Baseline" && action == "Pass" {
                    "Deny"
                } else {
                    action
                };
                let peer = if k % 5 == 0 {
                    "{namespaces: {matchLabels: {kubernetes.io/metadata.name: x}}}".to_string()
                } else {
                    let apps: Vec<String> = (0..5)
                        .map(|j| format!("app-{}", (p * 25 + k + j * 97) % 1000))
                        .collect();
                    format!(
                        "{{pods: {{namespaceSelector: {{}}, podSelector: {{matchExpressions: [{{key: app, operator: In, values: [{}]}}]}}}}}}",
                        apps.join(", ")
                    )
                };
                format!(
                    "{{name: r{k}, action: {action}, from: [{peer}], protocols: [{{tcp: {{destinationPort: {{number: {}}}}}}}]}}",
                    1000 + (p + k) % 50
                )
            })
            .collect();
        add_policy(
            engine,
            &format!(
                "{{apiVersion: policy.networking.k8s.io/v1alpha2, kind: ClusterNetworkPolicy, metadata: {{name: t{p}}}, spec: {{tier: {tier}, priority: {}, subject: {{namespaces: {{}}}}, ingress: [{}]}}}}",
                p % 1000,
                rules.join(", ")
            ),
        );
    }
}
