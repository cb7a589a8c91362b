use super::*;

fn world(probes: &str) -> String {
    format!(
        "namespaces: {{x: {{}}}}
pods:
  - {{namespace: x, name: a, labels: {{app: a}}, ips: [10.0.0.1, 'fd00::1']}}
  - {{namespace: x, name: b, labels: {{app: b}}, ips: [10.0.0.2]}}
policies: []
probes:
{probes}"
    )
}

#[test]
fn unusable_worlds_name_the_entry() {
    let cases = [
        (world("  - {from: x/a, to: x/nope, port: 80}"), "probes[0].to"),
        (world("  - {from: nonsense, to: x/b, port: 80}"), "probes[0].from"),
        (world("  - {from: x/a, to: x/b}"), "probes[0].port"),
        (world("  - {from: x/a, to: x/b, port: 70000}"), "probes[0].port"),
        (world("  - {from: x/a, to: x/b, port: 80, protocol: GRE}"), "probes[0].protocol"),
        (world("  - {from: x/a, to: x/b, protocol: ICMPv6}"), "probes[0]"),
        (world("  - {from: x/a, to: x/b, port: 80, colour: red}"), "probes[0]"),
        ("pods: [{namespace: x, name: a, ips: [999.1.1.1]}]".to_string(), "pods[0].ips[0]"),
        ("pods: [{namespace: x, name: a, ips: [10.0.0.1]}, {namespace: x, name: b, ips: [10.0.0.1]}]".to_string(), "pods[1].ips[0]"),
        ("pods: [{namespace: x, name: a, node: ghost}]".to_string(), "pods[0].node"),
        (": : :".to_string(), "(document)"),
    ];
    for (text, entry) in cases {
        let e = simulate(&text).expect_err(&text);
        assert!(
            e.entry.starts_with(entry),
            "{text}: got entry {:?}: {}",
            e.entry,
            e.message
        );
    }
}

#[test]
fn empty_world_has_no_results() {
    let sim = simulate("{}").unwrap();
    assert!(sim.results.is_empty() && sim.rejections.is_empty());
}

#[test]
fn results_echo_the_probe_and_explain() {
    let sim = simulate(&world(
        "  - {from: x/a, to: x/b, port: 80}\n  - {from: x/a, to: x/b, protocol: icmp}\n  - {from: x/a, to: x/a, port: 1}",
    ))
    .unwrap();
    let r = &sim.results;
    assert_eq!(
        (r[0].protocol.as_str(), r[0].port, r[0].icmp_type),
        ("TCP", Some(80), None)
    );
    assert_eq!(
        (r[1].protocol.as_str(), r[1].port, r[1].icmp_type),
        ("ICMP", None, Some(8))
    );
    assert!(r
        .iter()
        .all(|r| r.verdict == "allow" && !r.reason.is_empty()));
    assert!(r[2].reason.contains("itself"));
    let line = serde_json::to_string(&r[1]).unwrap();
    assert_eq!(
        line,
        r#"{"from":"x/a","to":"x/b","protocol":"ICMP","icmpType":8,"verdict":"allow","reason":"allowed: x/a egress is not isolated; x/b ingress is not isolated"}"#
    );
}
