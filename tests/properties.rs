//! Property tests of the policy engine through `simulate`:
//! - one rejected policy never changes the verdicts (or reasons) of the rest;
//! - no input, however malformed, makes `simulate` panic (a light fuzz of the YAML entry point).

use proptest::prelude::*;

use ciliate::simulate::simulate;

const PODS: &str = "namespaces: {x: {team: blue}, y: {team: red}}
pods:
  - {namespace: x, name: a, labels: {app: a}, ips: [10.0.0.1], ports: [{name: web, port: 80}]}
  - {namespace: x, name: b, labels: {app: b}, ips: [10.0.0.2]}
  - {namespace: x, name: c, labels: {app: c}, ips: [10.0.0.3], ports: [{name: web, port: 81}]}
  - {namespace: y, name: a, labels: {app: a}, ips: [10.0.1.1]}
  - {namespace: y, name: b, labels: {app: b}, ips: [10.0.1.2]}
";

const APPS: [&str; 3] = ["a", "b", "c"];
const NSS: [&str; 2] = ["x", "y"];

/// One valid policy from a family of templates.
fn good_policy(i: usize, t: u8, ns: usize, app: usize, peer: usize, port: u16) -> String {
    let (ns, app, peer) = (NSS[ns], APPS[app], APPS[peer]);
    match t % 8 {
        0 => format!("{{apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, metadata: {{name: g{i}, namespace: {ns}}}, spec: {{podSelector: {{matchLabels: {{app: {app}}}}}, ingress: [{{from: [{{podSelector: {{matchLabels: {{app: {peer}}}}}}}], ports: [{{port: {port}}}]}}]}}}}"),
        1 => format!("{{apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, metadata: {{name: g{i}, namespace: {ns}}}, spec: {{podSelector: {{}}, policyTypes: [Ingress, Egress], egress: [{{to: [{{namespaceSelector: {{matchLabels: {{team: blue}}}}}}]}}]}}}}"),
        2 => format!("{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: g{i}, namespace: {ns}}}, spec: {{endpointSelector: {{matchLabels: {{app: {app}}}}}, ingress: [{{fromEndpoints: [{{matchLabels: {{app: {peer}}}}}], toPorts: [{{ports: [{{port: web}}]}}]}}]}}}}"),
        3 => format!("{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: g{i}, namespace: {ns}}}, spec: {{endpointSelector: {{}}, egressDeny: [{{toEndpoints: [{{matchLabels: {{app: {peer}}}}}], toPorts: [{{ports: [{{port: '{port}'}}]}}]}}]}}}}"),
        4 => format!("{{apiVersion: cilium.io/v2, kind: CiliumClusterwideNetworkPolicy, metadata: {{name: g{i}}}, spec: {{endpointSelector: {{matchLabels: {{app: {app}}}}}, ingress: [{{fromEndpoints: [{{}}]}}], egress: [{{toEntities: [cluster]}}]}}}}"),
        5 => format!("{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: g{i}, namespace: {ns}}}, spec: {{endpointSelector: {{matchLabels: {{app: {app}}}}}, enableDefaultDeny: {{ingress: false}}, ingressDeny: [{{fromEndpoints: [{{matchLabels: {{app: {peer}}}}}]}}]}}}}"),
        6 => format!("{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: g{i}, namespace: {ns}}}, spec: {{endpointSelector: {{matchLabels: {{app: {app}}}}}, ingress: [{{toPorts: [{{ports: [{{port: '{port}', endPort: {}}}]}}]}}]}}}}", port + 1),
        _ => format!("{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: g{i}, namespace: {ns}}}, spec: {{endpointSelector: {{}}, egress: [{{toCIDRSet: [{{cidr: 10.0.0.0/8, except: [10.0.1.0/24]}}]}}]}}}}"),
    }
}

/// Invalid policies, each rejected for a different reason. They mention existing labels, ports
/// and namespaces so that, were they accepted, verdicts would change.
const BAD: &[&str] = &[
    "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: bad, namespace: x}, spec: {endpointSelector: {}, egress: [{toCIDR: [10.0.0.0/33]}]}}",
    "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: bad, namespace: x}, spec: {endpointSelector: {}, nodeSelector: {}, ingress: [{}]}}",
    "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: bad, namespace: x}, spec: {endpointSelector: {}, ingress: [{toPorts: [{ports: [{port: '81', endPort: 80}]}]}]}}",
    "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: bad, namespace: x}, spec: {endpointSelector: {}, ingressDeny: [{fromEntities: [everyone]}]}}",
    "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: bad, namespace: y}, spec: {endpointSelector: {matchExpressions: [{key: app, operator: in, values: [a]}]}, ingress: [{}]}}",
    "{apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, metadata: {name: bad, namespace: x}, spec: {podSelector: {}, ingress: [{ports: [{port: 80, protocol: ICMP}]}]}}",
    "{apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, metadata: {name: bad, namespace: y}, spec: {podSelector: {}, policyTypes: [Ingress, Sideways]}}",
    "{apiVersion: cilium.io/v2, kind: CiliumClusterwideNetworkPolicy, metadata: {name: bad}, spec: {endpointSelector: {}, egressDeny: [{toEndpoints: [{}], toCIDR: [10.0.0.0/8]}]}}",
    "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: bad, namespace: x}, specs: [{endpointSelector: {}, ingress: [{}]}, {endpointSelector: {}, egress: {}}]}",
    "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: bad, namespace: x}, spec: {endpointSelector: {}, ingress: [{icmps: [{fields: [{type: 8}]}], toPorts: [{ports: [{port: '80'}]}]}]}}",
];

fn world(policies: &[String]) -> String {
    let mut w = String::from(PODS);
    w.push_str("policies:\n");
    for p in policies {
        w.push_str(&format!("  - {p}\n"));
    }
    w.push_str("probes:\n");
    let pods = ["x/a", "x/b", "x/c", "y/a", "y/b", "192.0.2.1"];
    for from in pods {
        for to in pods {
            if from != to && !(from.contains('.') && to.contains('.')) {
                for port in [80, 81] {
                    w.push_str(&format!("  - {{from: {from}, to: {to}, port: {port}}}\n"));
                }
            }
        }
    }
    w
}

fn good_policies() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(
        (any::<u8>(), 0..2usize, 0..3usize, 0..3usize, 80u16..82),
        0..7,
    )
    .prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (t, ns, app, peer, port))| good_policy(i, t, ns, app, peer, port))
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    #[test]
    fn a_rejected_policy_never_changes_the_other_verdicts(
        good in good_policies(),
        bad in 0..BAD.len(),
        at in any::<prop::sample::Index>(),
    ) {
        let base = simulate(&world(&good)).expect("usable world");
        prop_assert!(base.rejections.is_empty(), "{:?}", base.rejections);
        let mut with_bad = good.clone();
        with_bad.insert(at.index(good.len() + 1), BAD[bad].to_string());
        let sim = simulate(&world(&with_bad)).expect("usable world");
        prop_assert_eq!(sim.rejections.len(), 1);
        prop_assert!(sim.rejections[0].policy.contains("bad"), "{}", sim.rejections[0]);
        prop_assert_eq!(sim.results, base.results);
    }

    #[test]
    fn arbitrary_text_never_panics(text in "\\PC{0,400}") {
        let _ = simulate(&text);
    }

    #[test]
    fn mutated_worlds_never_panic(
        good in good_policies(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), 0..4u8, any::<char>()), 1..12),
    ) {
        let mut chars: Vec<char> = world(&good).chars().collect();
        for (at, op, c) in edits {
            let i = at.index(chars.len().max(1));
            match op {
                0 if i < chars.len() => { chars.remove(i); }
                1 => chars.insert(i.min(chars.len()), c),
                2 if i < chars.len() => chars[i] = c,
                _ => chars.insert(i.min(chars.len()), ['{', '}', '[', ']', ':', '-', '\n', ' ', '"', '&', '*', '!'][i % 12]),
            }
        }
        let text: String = chars.into_iter().collect();
        let _ = simulate(&text);
    }

    #[test]
    fn arbitrary_policy_documents_never_panic(doc in yaml_value(4)) {
        let mut w = String::from(PODS);
        let docs = serde_yaml::to_string(&vec![doc]).unwrap_or_default();
        w.push_str("policies:\n");
        for line in docs.lines() {
            w.push_str("  ");
            w.push_str(line);
            w.push('\n');
        }
        w.push_str("probes: [{from: x/a, to: x/b, port: 80}]\n");
        if let Ok(sim) = simulate(&w) {
            prop_assert_eq!(sim.results.len(), 1);
        }
    }
}

/// Random YAML trees biased towards policy-shaped keys and values.
fn yaml_value(depth: u32) -> impl Strategy<Value = serde_yaml::Value> {
    use serde_yaml::Value;
    let keys = prop::sample::select(vec![
        "apiVersion",
        "kind",
        "metadata",
        "name",
        "namespace",
        "spec",
        "specs",
        "endpointSelector",
        "nodeSelector",
        "podSelector",
        "matchLabels",
        "matchExpressions",
        "key",
        "operator",
        "values",
        "ingress",
        "egress",
        "ingressDeny",
        "egressDeny",
        "fromEndpoints",
        "toEndpoints",
        "toPorts",
        "ports",
        "port",
        "endPort",
        "protocol",
        "toCIDR",
        "toCIDRSet",
        "cidr",
        "except",
        "fromEntities",
        "icmps",
        "fields",
        "type",
        "family",
        "rules",
        "http",
        "dns",
        "policyTypes",
        "from",
        "to",
        "ipBlock",
        "namespaceSelector",
        "enableDefaultDeny",
        "authentication",
        "mode",
        "toFQDNs",
        "matchName",
    ]);
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|i| Value::Number(i.into())),
        prop::sample::select(vec![
            "cilium.io/v2",
            "networking.k8s.io/v1",
            "CiliumNetworkPolicy",
            "NetworkPolicy",
            "CiliumClusterwideNetworkPolicy",
            "TCP",
            "UDP",
            "ANY",
            "In",
            "Exists",
            "world",
            "all",
            "10.0.0.0/8",
            "::/0",
            "80",
            "http",
            "",
            "Ingress",
            "Egress",
            "IPv6",
        ])
        .prop_map(|s| Value::String(s.to_string())),
        "[a-z0-9./:-]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(depth, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Sequence),
            prop::collection::vec((keys.clone(), inner), 0..5).prop_map(|kv| {
                Value::Mapping(
                    kv.into_iter()
                        .map(|(k, v)| (Value::String(k.to_string()), v))
                        .collect(),
                )
            }),
        ]
    })
}
