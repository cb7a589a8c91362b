use super::*;
use crate::policy::rule::{Peers, PortSpec, Ports, Protocol, Section, Subject};
use crate::policy::selector::SelectorKind;

fn parse(yaml: &str) -> Result<ParsedPolicy, PolicyError> {
    let doc: Value = serde_yaml::from_str(yaml).expect("test YAML");
    parse_policy(&doc, "default", "test")
}

fn selector_text(p: &ParsedPolicy, rule: usize, peer_rule: usize) -> Vec<String> {
    match &p.rules[rule].peer_rules[peer_rule].peers {
        Peers::Any => vec!["ANY".into()],
        Peers::Selectors(s) => s.iter().map(|s| s.to_string()).collect(),
    }
}

#[test]
fn cnp_subject_and_peers_are_scoped_to_the_namespace() {
    let p = parse(
        "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x},
          spec: {endpointSelector: {matchLabels: {app: a}}, ingress: [{fromEndpoints: [{}, {matchLabels: {k8s:io.kubernetes.pod.namespace: y}}, {matchLabels: {reserved:host: ''}}]}]}}",
    )
    .unwrap();
    let Subject::Endpoints(s) = &p.rules[0].subject else {
        panic!("endpoint subject")
    };
    assert_eq!(
        s.to_string(),
        "{any:app=a, k8s:io.kubernetes.pod.namespace=x}"
    );
    assert_eq!(
        selector_text(&p, 0, 0),
        vec![
            "{k8s:io.kubernetes.pod.namespace=x}".to_string(),
            "{k8s:io.kubernetes.pod.namespace=y}".to_string(),
            "{reserved:host=}".to_string(),
        ]
    );
    assert!(p.rules[0].isolates_ingress && !p.rules[0].isolates_egress);
}

#[test]
fn ccnp_peers_only_select_pods() {
    let p = parse(
        "{apiVersion: cilium.io/v2, kind: CiliumClusterwideNetworkPolicy, metadata: {name: c},
          spec: {endpointSelector: {}, egress: [{toEndpoints: [{matchLabels: {app: db}}]}]}}",
    )
    .unwrap();
    assert_eq!(p.key.namespace, None);
    assert_eq!(
        selector_text(&p, 0, 0),
        vec!["{any:app=db, k8s:io.kubernetes.pod.namespace}".to_string()]
    );
}

#[test]
fn from_requires_is_kept_apart_for_the_engine_with_its_path_and_scope() {
    let p = parse(
        "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: r, namespace: x},
          spec: {endpointSelector: {}, ingress: [{fromRequires: [{matchLabels: {env: prod}}]}, {fromEndpoints: [{matchLabels: {app: a}}]}]}}",
    )
    .unwrap();
    // The peer selector is not folded here: requirements of other policies apply too, so the
    // engine ANDs them in when it resolves an endpoint.
    assert_eq!(
        selector_text(&p, 0, 1),
        vec!["{any:app=a, k8s:io.kubernetes.pod.namespace=x}".to_string()]
    );
    assert_eq!(p.rules[0].peer_rules[1].endpoint_selectors, 1);
    let req = &p.rules[0].requires;
    assert_eq!(req.len(), 1);
    assert_eq!(req[0].origin.path, "spec.ingress[0].fromRequires[0]");
    assert_eq!(req[0].origin.section, Section::Ingress);
    assert_eq!(
        req[0].selector.to_string(),
        "{any:env=prod, k8s:io.kubernetes.pod.namespace=x}"
    );
    assert_eq!(
        req[0].describe(),
        "CiliumNetworkPolicy x/r requires env=prod"
    );
}

#[test]
fn toports_only_rule_applies_to_every_peer_and_empty_rule_to_none() {
    let p = parse(
        "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x},
          spec: {endpointSelector: {}, ingress: [{toPorts: [{ports: [{port: '80'}]}]}, {}]}}",
    )
    .unwrap();
    let prs = &p.rules[0].peer_rules;
    assert_eq!(prs[0].peers, Peers::Any);
    assert_eq!(
        prs[0].ports,
        Ports::List(vec![crate::policy::rule::PortMatch {
            protocol: Protocol::Any,
            port: PortSpec::Range(80, 80)
        }])
    );
    assert_eq!(prs[1].peers, Peers::Selectors(vec![]));
    assert_eq!(prs[1].ports, Ports::Any);
}

#[test]
fn knp_namespace_selector_becomes_namespace_label_requirements() {
    let p = parse(
        "{apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, metadata: {name: n},
          spec: {podSelector: {}, ingress: [{from: [{namespaceSelector: {matchLabels: {team: blue}}, podSelector: {matchLabels: {app: a}}}], ports: [{port: 53, protocol: UDP}]}]}}",
    )
    .unwrap();
    assert_eq!(p.key.namespace.as_deref(), Some("default"));
    assert_eq!(
        selector_text(&p, 0, 0),
        vec!["{any:app=a, k8s:io.cilium.k8s.namespace.labels.team=blue, k8s:io.kubernetes.pod.namespace}".to_string()]
    );
    // Omitted policyTypes: Ingress only, since there are no egress rules.
    assert!(p.rules[0].isolates_ingress && !p.rules[0].isolates_egress);
}

#[test]
fn knp_ip_block_is_a_cidr_selector() {
    let p = parse(
        "{apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, metadata: {name: n, namespace: x},
          spec: {podSelector: {}, policyTypes: [Egress], egress: [{to: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}}]}]}}",
    )
    .unwrap();
    let Peers::Selectors(s) = &p.rules[0].peer_rules[0].peers else {
        panic!()
    };
    assert!(matches!(s[0].kind(), SelectorKind::Cidr(_)));
    assert_eq!(p.rules[0].peer_rules[0].origin.section, Section::Egress);
}

#[test]
fn errors_name_the_policy_and_the_field() {
    let cases = [
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x}, spec: {endpointSelector: {}, egress: [{toCIDRSet: [{cidr: 10.0.0.0/8, except: [10.1.0.0/16, 11.0.0.0/16]}]}]}}",
         "CiliumNetworkPolicy x/p", "spec.egress[0].toCIDRSet[0].except[1]"),
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x}, spec: {endpointSelector: {}, nodeSelector: {}}}",
         "CiliumNetworkPolicy x/p", "spec"),
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p}, spec: {nodeSelector: {}}}",
         "CiliumNetworkPolicy default/p", "spec.nodeSelector"),
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p}, spec: {endpointSelector: {}, ingress: [{toPorts: [{ports: [{port: '70000'}]}]}]}}",
         "CiliumNetworkPolicy default/p", "spec.ingress[0].toPorts[0].ports[0].port"),
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p}, spec: {endpointSelector: {}, ingress: [{toPorts: [{ports: [{port: '80', endPort: 79}]}]}]}}",
         "CiliumNetworkPolicy default/p", "spec.ingress[0].toPorts[0].ports[0].endPort"),
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p}, spec: {endpointSelector: {}, ingress: [{toPorts: [{ports: [{port: http, endPort: 90}]}]}]}}",
         "CiliumNetworkPolicy default/p", "spec.ingress[0].toPorts[0].ports[0].endPort"),
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p}, spec: {endpointSelector: {}, ingress: [{toPorts: [{ports: [{port: '80', protocol: ICMP}]}]}]}}",
         "CiliumNetworkPolicy default/p", "spec.ingress[0].toPorts[0].ports[0].protocol"),
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p}, spec: {endpointSelector: {}, egress: [{toEntities: [internet]}]}}",
         "CiliumNetworkPolicy default/p", "spec.egress[0].toEntities[0]"),
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p}, spec: {endpointSelector: {matchExpressions: [{key: a, operator: Exists, values: [x]}]}}}",
         "CiliumNetworkPolicy default/p", "spec.endpointSelector.matchExpressions[0].values"),
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p}, spec: {endpointSelector: {}, ingress: [{fromEndpoints: [{}], fromCIDR: [1.0.0.0/8]}]}}",
         "CiliumNetworkPolicy default/p", "spec.ingress[0]"),
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p}, spec: {endpointSelector: {}, ingress: [{icmps: [{fields: [{type: 8}]}], toPorts: [{ports: [{port: '80'}]}]}]}}",
         "CiliumNetworkPolicy default/p", "spec.ingress[0]"),
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p}, spec: {endpointSelector: {}, ingress: [{toPorts: [{ports: [{port: '80', protocol: UDP}], rules: {http: [{}]}}]}]}}",
         "CiliumNetworkPolicy default/p", "spec.ingress[0].toPorts[0].ports[0].protocol"),
        ("{apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, metadata: {name: n, namespace: x}, spec: {podSelector: {}, ingress: [{ports: [{port: 80, protocol: tcp}]}]}}",
         "NetworkPolicy x/n", "spec.ingress[0].ports[0].protocol"),
        ("{apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, metadata: {name: n, namespace: x}, spec: {podSelector: {}, ingress: {}}}",
         "NetworkPolicy x/n", "spec.ingress"),
        ("{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p}}",
         "CiliumNetworkPolicy default/p", "spec"),
        ("{apiVersion: v1, kind: ConfigMap, metadata: {name: p}}", "test", "kind"),
    ];
    for (yaml, policy, field) in cases {
        let e = parse(yaml).expect_err(yaml);
        assert_eq!(
            (e.policy.as_str(), e.field.as_str()),
            (policy, field),
            "{yaml}: {e}"
        );
        assert!(!e.message.is_empty());
    }
}

#[test]
fn forty_ports_are_accepted_forty_one_rejected() {
    let ports = |n: usize| {
        (0..n)
            .map(|i| format!("{{port: '{}'}}", 1000 + i))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let yaml = |n| {
        format!("{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: p}}, spec: {{endpointSelector: {{}}, ingress: [{{toPorts: [{{ports: [{}]}}]}}]}}}}", ports(n))
    };
    assert!(parse(&yaml(40)).is_ok());
    assert_eq!(
        parse(&yaml(41)).unwrap_err().field,
        "spec.ingress[0].toPorts[0].ports"
    );
}

#[test]
fn unknown_fields_are_warnings_not_errors() {
    let p = parse(
        "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, description: hi, metadata: {name: p, labels: {a: b}},
          spec: {endpointSelector: {}, ingress: [{fromEndpoints: [{}], fancyNewField: 1}]}}",
    )
    .unwrap();
    assert_eq!(p.warnings.len(), 2, "{:?}", p.warnings);
    assert!(p.warnings.iter().any(|w| w.contains("description")));
    assert!(p
        .warnings
        .iter()
        .any(|w| w.contains("spec.ingress[0].fancyNewField")));
}

#[test]
fn dns_rules_off_port_53_and_other_l7_rules_are_noted_as_not_enforced() {
    let p = parse(
        "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p},
          spec: {endpointSelector: {}, egress: [{toPorts: [{ports: [{port: '5353', protocol: UDP}], rules: {dns: [{matchPattern: '*'}]}}]},
                 {toPorts: [{ports: [{port: '9092', protocol: TCP}], rules: {kafka: [{topic: orders}]}}]}]}}",
    )
    .unwrap();
    assert!(
        p.notes
            .iter()
            .any(|n| n.contains("rules.dns: enforced on port 53 only")),
        "{:?}",
        p.notes
    );
    assert!(
        p.notes.iter().any(|n| n.contains("L7 rules not enforced")),
        "{:?}",
        p.notes
    );
}

#[test]
fn http_rules_and_server_names_are_enforced_and_not_noted() {
    let p = parse(
        "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p},
          spec: {endpointSelector: {}, ingress: [{toPorts: [{ports: [{port: '80', protocol: TCP}], rules: {http: [{method: GET, headers: ['X-A: 1', X-B], headerMatches: [{name: X-C, value: v, mismatch: ADD}]}]}}]}],
                 egress: [{toPorts: [{ports: [{port: '443', protocol: TCP}], serverNames: [api.example.com]}]}]}}",
    )
    .unwrap();
    assert!(
        !p.notes.iter().any(|n| n.contains("not enforced")),
        "{:?}",
        p.notes
    );
    let l7: Vec<&crate::policy::rule::L7Ports> = p.rules[0]
        .peer_rules
        .iter()
        .flat_map(|pr| pr.l7.iter())
        .collect();
    assert_eq!(l7.len(), 2);
    let http = &l7[0].rules.http[0];
    assert_eq!(http.method.as_deref(), Some("GET"));
    assert_eq!(http.headers[0].name, "x-a");
    assert_eq!(http.headers[0].value.as_deref(), Some("1"));
    assert_eq!(http.headers[1].value, None);
    assert_eq!(
        http.header_matches[0].mismatch,
        crate::policy::l7::http::Mismatch::Add
    );
    assert_eq!(l7[1].rules.server_names, ["api.example.com"]);
    assert!(l7[1].rules.is_tls());
}

#[test]
fn l7_fqdn_and_auth_are_accepted_with_notes() {
    let p = parse(
        "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p},
          specs: [{endpointSelector: {}, egress: [{toFQDNs: [{matchName: example.com}]}, {toPorts: [{ports: [{port: '53', protocol: ANY}], rules: {dns: [{matchPattern: '*'}]}}]}]},
                  {endpointSelector: {}, ingress: [{fromEndpoints: [{}], authentication: {mode: required}}]}]}",
    )
    .unwrap();
    assert_eq!(p.rules.len(), 2);
    assert_eq!(p.rules[1].path, "specs[1]");
    // toFQDNs and DNS rules on port 53 are enforced (the DNS proxy): no note for them.
    assert!(
        !p.notes.iter().any(|n| n.contains("toFQDNs")),
        "{:?}",
        p.notes
    );
    assert!(
        !p.notes.iter().any(|n| n.contains("L7 rules not enforced")),
        "{:?}",
        p.notes
    );
    assert!(p.notes.iter().any(|n| n.contains("authentication")));
    // toFQDNs selects by name (the addresses learned for it); the DNS rules are kept.
    let Peers::Selectors(s) = &p.rules[0].peer_rules[0].peers else {
        panic!("selectors");
    };
    assert_eq!(s[0].to_string(), "matchName:example.com");
    assert!(!p.rules[0].peer_rules[1].origin.l7);
    let dns = &p.rules[0].peer_rules[1].dns;
    assert_eq!(dns.len(), 1);
    assert_eq!(dns[0].names[0].to_string(), "matchPattern:*");
    assert_eq!(p.rules[1].peer_rules[0].peers, Peers::Selectors(vec![]));
}

#[test]
fn icmp_types_by_number_and_name() {
    let p = parse(
        "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p},
          spec: {endpointSelector: {}, egress: [{icmps: [{fields: [{type: 8}, {type: EchoRequest, family: IPv6}]}]}]}}",
    )
    .unwrap();
    let Ports::List(l) = &p.rules[0].peer_rules[0].ports else {
        panic!()
    };
    assert_eq!(l[0].protocol, Protocol::Icmp);
    assert_eq!(l[0].port, PortSpec::Range(8, 8));
    assert_eq!(l[1].protocol, Protocol::Icmpv6);
    assert_eq!(l[1].port, PortSpec::Range(128, 128));
}

#[test]
fn fields_only_allow_rules_have_are_unknown_in_deny_rules() {
    let p = parse(
        "{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {name: p, namespace: x},
          spec: {endpointSelector: {}, enableDefaultDeny: {ingress: false, egress: false},
                 ingressDeny: [{fromEntities: [world], authentication: {mode: required}, bogus: 1}],
                 egressDeny: [{toEntities: [world], toFQDNs: [{matchName: a.com}], authentication: {mode: disabled},
                               toPorts: [{ports: [{port: '80'}], rules: {http: [{}]}}]}]}}",
    )
    .unwrap();
    assert_eq!(
        p.warnings,
        vec![
            "CiliumNetworkPolicy x/p: ignoring unknown field spec.ingressDeny[0].authentication",
            "CiliumNetworkPolicy x/p: ignoring unknown field spec.ingressDeny[0].bogus",
            "CiliumNetworkPolicy x/p: ignoring unknown field spec.egressDeny[0].toFQDNs",
            "CiliumNetworkPolicy x/p: ignoring unknown field spec.egressDeny[0].authentication",
            "CiliumNetworkPolicy x/p: ignoring unknown field spec.egressDeny[0].toPorts[0].rules",
        ]
    );
}

/// `policy.ciliate.io/mode: audit` stages every rule of any kind; `enforce` and no annotation
/// enforce; another value, or one that is not a string, is refused naming the annotation.
#[test]
fn the_mode_annotation_stages_a_policy_or_is_refused_by_name() {
    let doc = |kind: &str, meta: &str, spec: &str| {
        parse(&format!(
            "{{apiVersion: {kind}, metadata: {{name: p, namespace: x{meta}}}, spec: {spec}}}"
        ))
    };
    let cnp = "cilium.io/v2, kind: CiliumNetworkPolicy";
    let cnp_spec = "{endpointSelector: {}, ingress: [{}], egress: [{}]}";
    let knp = "networking.k8s.io/v1, kind: NetworkPolicy";
    let knp_spec = "{podSelector: {}, policyTypes: [Ingress]}";
    let audit = ", annotations: {policy.ciliate.io/mode: audit}";
    for (kind, spec) in [(cnp, cnp_spec), (knp, knp_spec)] {
        let p = doc(kind, audit, spec).unwrap();
        assert!(p.staged && !p.rules.is_empty() && p.rules.iter().all(|r| r.staged));
        assert!(
            p.notes.iter().any(|n| n.starts_with("staged")),
            "status says it is not enforced: {:?}",
            p.notes
        );
        for meta in [
            "",
            ", annotations: {policy.ciliate.io/mode: enforce}",
            ", annotations: {other: x}",
        ] {
            let p = doc(kind, meta, spec).unwrap();
            assert!(!p.staged && p.rules.iter().all(|r| !r.staged), "{meta}");
            assert!(!p.notes.iter().any(|n| n.starts_with("staged")), "{meta}");
        }
    }
    let anp = parse("{apiVersion: policy.networking.k8s.io/v1alpha1, kind: AdminNetworkPolicy, metadata: {name: a, annotations: {policy.ciliate.io/mode: audit}}, spec: {priority: 1, subject: {namespaces: {}}, ingress: [{action: Deny, from: [{namespaces: {}}]}]}}").unwrap();
    assert!(anp.staged && anp.rules.iter().all(|r| r.staged));
    let e = doc(
        cnp,
        ", annotations: {policy.ciliate.io/mode: Audit}",
        cnp_spec,
    )
    .unwrap_err();
    assert_eq!(e.field, "metadata.annotations[\"policy.ciliate.io/mode\"]");
    assert!(e.message.contains("\"Audit\""), "{e}");
    assert_eq!(e.policy, "CiliumNetworkPolicy x/p");
    let e = doc(
        cnp,
        ", annotations: {policy.ciliate.io/mode: true}",
        cnp_spec,
    )
    .unwrap_err();
    assert_eq!(e.field, "metadata.annotations[\"policy.ciliate.io/mode\"]");
}
