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
        ("".to_string(), "(document)"),
        ("# only a comment\n".to_string(), "(document)"),
        ("---\n".to_string(), "(document)"),
        ("[]".to_string(), "(document)"),
        ("pods: []\ncolour: red\n".to_string(), "(document) line 2"),
        ("pods: []\npods: []\n".to_string(), "(document) line 2"),
        ("pods: []\n---\npods: []\n".to_string(), "(document) line 2"),
        ("namespaces: {x: {}}\nnamespaces: {y: {}}\n".to_string(), "(document)"),
        ("pods: {a: 1}".to_string(), "pods"),
        ("namespaces: {x: {'bad key': v}}".to_string(), "namespaces.x"),
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

#[test]
fn a_probe_field_of_the_other_kind_is_an_error() {
    for (probe, entry, message) in [
        (
            "{from: x/a, to: x/b, port: 80, icmpType: 8}",
            "probes[0].icmpType",
            "a TCP probe takes no icmpType",
        ),
        (
            "{from: x/a, to: x/b, protocol: ICMP, port: 80}",
            "probes[0].port",
            "an ICMP probe takes no port",
        ),
    ] {
        let e = simulate(&world(&format!("  - {probe}"))).unwrap_err();
        assert_eq!((e.entry.as_str(), e.message.as_str()), (entry, message));
    }
}

#[test]
fn empty_worlds_are_unusable() {
    for text in ["", "\n\n", "# a comment\n# another\n", "---\n...\n", "~"] {
        let e = simulate(text).expect_err(text);
        assert!(e.message.contains("empty"), "{text:?}: {e}");
    }
}

#[test]
fn type_errors_name_the_path_once() {
    let e = simulate(&world("  - {from: x/a, to: x/b, port: abc}")).unwrap_err();
    assert_eq!(e.entry, "probes[0].port");
    assert!(!e.message.contains("probes[0]"), "{e}");
    assert!(e.message.ends_with("line 7 column 32"), "{e}");
    let e = simulate("pods:\n  - {namespace: x, name: a, ips: [10.0.0.1]}\n  - {namespace: x, name: b, ips: {}}\n").unwrap_err();
    assert_eq!(e.entry, "pods[1].ips");
    assert!(
        !e.message.contains("pods[1]") && e.message.contains("line 3"),
        "{e}"
    );
}

#[test]
fn sections_load_in_dependency_order_whatever_the_file_order() {
    let text = "probes: [{from: x/a, to: x/b, port: 80}]
policies:
  - {apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, metadata: {name: d, namespace: x}, spec: {podSelector: {matchLabels: {app: b}}, policyTypes: [Ingress]}}
pods:
  - namespace: x
    name: a
    labels: {app: a}
    ips: [10.0.0.1]
  - namespace: x
    name: b
    labels: {app: b}
    ips: [10.0.0.2]
namespaces:
  x: {team: blue}
";
    let sim = simulate(text).unwrap();
    assert_eq!(sim.results.len(), 1);
    assert_eq!(sim.results[0].verdict, "deny", "{:?}", sim.results[0]);
}

#[test]
fn invalid_labels_make_the_world_unusable() {
    let long = "v".repeat(64);
    let huge = "v".repeat(1 << 20);
    let cases = [
        (
            format!("pods: [{{namespace: x, name: a, labels: {{app: {long}}}}}]"),
            "pods[0].labels",
        ),
        (
            format!("pods: [{{namespace: x, name: a, labels: {{app: {huge}}}}}]"),
            "pods[0].labels",
        ),
        (
            format!("pods: [{{namespace: x, name: a, labels: {{{long}: v}}}}]"),
            "pods[0].labels",
        ),
        (
            "pods: [{namespace: x, name: a, labels: {'Bad.Prefix/app': v}}]".to_string(),
            "pods[0].labels",
        ),
        (
            format!("namespaces: {{x: {{team: {long}}}}}"),
            "namespaces.x",
        ),
        (
            format!("nodes: [{{name: n, labels: {{zone: {long}}}}}]"),
            "nodes[0].labels",
        ),
    ];
    for (text, entry) in cases {
        let e = simulate(&text).expect_err(&text[..60.min(text.len())]);
        assert_eq!(e.entry, entry, "{e}");
        assert!(
            e.message.contains("63") || e.message.contains("RFC 1123"),
            "{e}"
        );
        assert!(
            e.message.len() < 400,
            "message echoes the value: {} bytes",
            e.message.len()
        );
    }
    let ok = format!(
        "pods: [{{namespace: x, name: a, labels: {{app.kubernetes.io/name: {}}}}}]",
        "v".repeat(63)
    );
    simulate(&ok).expect("63 characters are allowed");
}

#[test]
fn oversized_worlds_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.yaml");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(MAX_WORLD_BYTES + 1).unwrap();
    let e = read_world(&path).unwrap_err();
    assert!(e.contains("larger than"), "{e}");
}

/// A pod allowed DNS to kube-dns only for `*.example.com`, and HTTPS to what
/// `api.example.com` resolved to (interfaces.md section 9).
const DNS_WORLD: &str = "namespaces: {x: {}, kube-system: {}}
dns:
  api.example.com: [203.0.113.10]
  www.example.com: [203.0.113.30]
  evil.test: [203.0.113.66]
pods:
  - {namespace: x, name: a, labels: {app: a}, ips: [10.0.0.1]}
  - {namespace: x, name: open, labels: {app: open}, ips: [10.0.0.3]}
  - {namespace: kube-system, name: coredns, labels: {k8s-app: kube-dns}, ips: [10.0.0.53], ports: [{name: dns, port: 53, protocol: UDP}]}
  - {namespace: x, name: other-dns, labels: {app: other-dns}, ips: [10.0.0.54]}
policies:
  - apiVersion: cilium.io/v2
    kind: CiliumNetworkPolicy
    metadata: {name: a-egress, namespace: x}
    spec:
      endpointSelector: {matchLabels: {app: a}}
      egress:
        - toEndpoints: [{matchLabels: {k8s:io.kubernetes.pod.namespace: kube-system, k8s-app: kube-dns}}]
          toPorts: [{ports: [{port: dns, protocol: UDP}], rules: {dns: [{matchPattern: '*.example.com'}]}}]
        - toFQDNs: [{matchName: API.example.com.}]
          toPorts: [{ports: [{port: '443', protocol: TCP}]}]
probes:
  - {from: x/a, dns: api.example.com}
  - {from: x/a, dns: API.Example.COM.}
  - {from: x/a, dns: evil.test}
  - {from: x/a, dns: a.b.example.com}
  - {from: x/a, dns: api.example.com, to: x/other-dns}
  - {from: x/open, dns: evil.test}
  - {from: x/a, to: 203.0.113.10, port: 443}
  - {from: x/a, to: 203.0.113.10, port: 80}
  - {from: x/a, to: 203.0.113.30, port: 443}
  - {from: x/a, to: 203.0.113.66, port: 443}
";

#[test]
fn dns_probes_and_to_fqdns_follow_the_names_the_world_resolved() {
    let sim = simulate(DNS_WORLD).unwrap();
    assert!(sim.rejections.is_empty(), "{:?}", sim.rejections);
    let v: Vec<(&str, &str)> = sim
        .results
        .iter()
        .map(|r| (r.verdict, r.reason.as_str()))
        .collect();
    let verdicts: Vec<&str> = v.iter().map(|x| x.0).collect();
    assert_eq!(
        verdicts,
        ["allow", "allow", "refuse", "refuse", "deny", "allow", "allow", "deny", "deny", "deny"],
        "{v:#?}"
    );
    // The default server is the kube-dns pod, named in the output.
    assert_eq!(sim.results[0].to, "kube-system/coredns");
    assert_eq!(sim.results[0].dns.as_deref(), Some("api.example.com"));
    assert!(
        v[2].1.contains("matchPattern:*.example.com") && v[2].1.contains("a-egress"),
        "{}",
        v[2].1
    );
    // An IP learned for the name is reached through toFQDNs, and named so.
    assert!(v[6].1.contains("203.0.113.10"), "{}", v[6].1);
    // The JSON line of a DNS probe: from, dns, to, verdict, reason.
    let line = serde_json::to_value(&sim.results[2]).unwrap();
    let keys: Vec<&String> = line.as_object().unwrap().keys().collect();
    assert_eq!(keys.len(), 5, "{line}");
    for k in ["from", "dns", "to", "verdict", "reason"] {
        assert!(line.get(k).is_some(), "{line}");
    }
}

#[test]
fn a_port_rule_without_dns_rules_lets_every_name_through() {
    let text = DNS_WORLD.replace(
        "        - toFQDNs:",
        "        - toEndpoints: [{matchLabels: {k8s-app: kube-dns, k8s:io.kubernetes.pod.namespace: kube-system}}]\n          toPorts: [{ports: [{port: '53', protocol: UDP}]}]\n        - toFQDNs:",
    );
    let sim = simulate(&text).unwrap();
    assert_eq!(sim.results[2].verdict, "allow", "{:?}", sim.results[2]);
}

#[test]
fn dns_probe_mistakes_name_the_entry() {
    for (probe, entry) in [
        ("  - {from: x/a, dns: x.example.com, port: 53}", "probes[0]"),
        ("  - {from: 10.9.9.9, dns: x.example.com}", "probes[0].from"),
        ("  - {from: x/a, dns: x.example.com}", "probes[0].to"),
        ("  - {from: x/a}", "probes[0].to"),
    ] {
        let e = simulate(&world(probe)).expect_err(probe);
        assert!(e.entry.starts_with(entry), "{probe}: {e}");
    }
    let e = simulate("dns: {'bad name!': [10.0.0.1]}").unwrap_err();
    assert!(e.entry.starts_with("dns."), "{e}");
    let e = simulate("dns: {a.example.com: [nope]}").unwrap_err();
    assert_eq!(e.entry, "dns.a.example.com[0]", "{e}");
}

/// Anchors shared across entries and sections (as `yaml.safe_dump` writes a structure it meets
/// twice) give what the world written out gives; an error in such a world still names its
/// entry; an unknown anchor or an alias bomb leaves the world unusable, never a panic.
#[test]
fn aliases_across_entries_read_as_the_world_written_out() {
    let aliased = "namespaces:\n  x: &l {team: a}\n  y: *l\npods:\n  - {namespace: x, name: a, labels: *l, ips: [10.0.0.1]}\n  - {namespace: y, name: b, labels: {app: b}, ips: [10.0.0.2]}\npolicies:\n  - &p {apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: y}, spec: {endpointSelector: {}, ingress: [{fromEndpoints: [{matchLabels: {team: a}}]}]}}\nprobes:\n  - &q {from: y/b, to: y/b, port: 80}\n  - {from: x/a, to: y/b, port: 80}\n  - {from: y/b, to: x/a, port: 80}\n  - *q\n";
    let written = "namespaces:\n  x: {team: a}\n  y: {team: a}\npods:\n  - {namespace: x, name: a, labels: {team: a}, ips: [10.0.0.1]}\n  - {namespace: y, name: b, labels: {app: b}, ips: [10.0.0.2]}\npolicies:\n  - {apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: y}, spec: {endpointSelector: {}, ingress: [{fromEndpoints: [{matchLabels: {team: a}}]}]}}\nprobes:\n  - {from: y/b, to: y/b, port: 80}\n  - {from: x/a, to: y/b, port: 80}\n  - {from: y/b, to: x/a, port: 80}\n  - {from: y/b, to: y/b, port: 80}\n";
    let (a, w) = (simulate(aliased).unwrap(), simulate(written).unwrap());
    assert_eq!(a.results, w.results);
    assert_eq!(a.results.len(), 4);
    assert!(a.rejections.is_empty(), "{:?}", a.rejections);

    let bad_ip = "namespaces: {x: {}}\npods:\n  - {namespace: x, name: a, labels: &l {app: a}, ips: [10.0.0.1]}\n  - {namespace: x, name: b, labels: *l, ips: [nope]}\n";
    let e = simulate(bad_ip).unwrap_err();
    assert_eq!(e.entry, "pods[1].ips[0]", "{}", e.message);

    let unknown = "pods:\n  - {namespace: x, name: a, labels: {app: *nowhere}}\n";
    let e = simulate(unknown).unwrap_err();
    assert!(e.message.contains("unknown anchor"), "{}", e.message);

    let mut bomb = String::from("probes: []\npolicies:\n  - a: &a [x, x, x, x, x, x, x, x, x]\n");
    for (prev, next) in ('a'..'i').zip('b'..'j') {
        let row = vec![format!("*{prev}"); 9].join(", ");
        bomb.push_str(&format!("    {next}: &{next} [{row}]\n"));
    }
    let e = simulate(&bomb).unwrap_err();
    assert!(e.message.contains("repetition limit"), "{}", e.message);
}
