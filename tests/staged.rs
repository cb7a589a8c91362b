//! Staged policies (issue #32, interfaces section 16) on real packets in the cluster harness:
//! a CiliumNetworkPolicy annotated `policy.ciliate.io/mode: audit` that would isolate pod b
//! (node 2) and admit only pod a (node 1) is resolved but not enforced. Every connection still
//! passes; the flows it would drop (pod c's) carry `staged: {verdict: dropped, policies}`, those
//! it would keep (pod a's) carry nothing, and the staged-verdict metric counts them. Once the
//! annotation is removed the same policy is enforced and drops exactly c's connections.
//! Privileged: with CI=true it must run.

mod common;

use std::net::IpAddr;

use common::agent::http_get_at;
use common::cluster::Cluster;
use common::eventually;
use common::netns::{in_netns, privileged, tcp_ok};
use serde_json::{json, Value};

/// b admits a on TCP 8080 (and so isolates b's ingress), staged or enforced.
fn b_from_a(staged: bool) -> Value {
    let mut metadata = json!({"name": "b-from-a", "namespace": "x"});
    if staged {
        metadata["annotations"] = json!({"policy.ciliate.io/mode": "audit"});
    }
    json!({
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": metadata,
        "spec": {
            "endpointSelector": {"matchLabels": {"app": "b"}},
            "ingress": [{
                "fromEndpoints": [{"matchLabels": {"app": "a"}}],
                "toPorts": [{"ports": [{"port": "8080", "protocol": "TCP"}]}],
            }],
        },
    })
}

/// GET on node 2's debug listener, which listens in the node's network namespace.
fn node2_get(c: &Cluster, path: &str) -> (u16, String) {
    let (addr, path) = (c.nodes[1].agent().debug.clone(), path.to_string());
    in_netns(&c.nodes[1].netns, move || http_get_at(&addr, &path))
        .join()
        .unwrap()
}

/// Node 2's kept flows into b on 8080 from the pod `from` (`x/a`, `x/c`), as `/debug/flows`
/// serves them (`ciliate monitor -o json`'s objects).
fn flows_into_b(c: &Cluster, from: &str) -> Vec<Value> {
    let (code, body) = node2_get(
        c,
        &format!("/debug/flows?from={from}&to=x/b&port=8080&limit=10000"),
    );
    assert_eq!(code, 200, "{body}");
    match serde_json::from_str(&body) {
        Ok(Value::Array(flows)) => flows,
        other => panic!("{other:?}: {body}"),
    }
}

#[test]
fn a_staged_policy_reports_the_flows_it_would_drop_and_drops_exactly_those_once_enforced() {
    let Some(mut c) = privileged().then(|| Cluster::start(2)) else {
        return;
    };
    let (a, other, b) = c.a_and_c_to_b(&[8080]);
    let b_addr = IpAddr::V4(b.addr);

    c.api()
        .apply_json(b_from_a(true))
        .expect("the staged policy");
    // Staged: accepted and resolved, not enforced. Connections made once node 2 has it keep
    // passing, and c's are reported as the policy would decide them.
    eventually("c's connections carry the staged drop", || {
        assert!(tcp_ok(&a.netns, b_addr, 8080), "a still reaches b");
        assert!(
            tcp_ok(&other.netns, b_addr, 8080),
            "c still reaches b: a staged policy enforces nothing"
        );
        flows_into_b(&c, "x/c")
            .iter()
            .any(|f| f["staged"].is_object())
    });
    let from_c = flows_into_b(&c, "x/c");
    let staged: Vec<&Value> = from_c.iter().filter(|f| f["staged"].is_object()).collect();
    for f in &staged {
        assert_eq!(f["verdict"], "forwarded", "{f}");
        assert_eq!(f["staged"]["verdict"], "dropped", "{f}");
        assert_eq!(
            f["staged"]["policies"],
            json!([{"kind": "CiliumNetworkPolicy", "namespace": "x", "name": "b-from-a", "tier": "network-policy"}]),
            "the staged drop names the policy that would isolate b: {f}"
        );
    }
    // a's connections, which the policy would allow, carry no staged verdict.
    let from_a = flows_into_b(&c, "x/a");
    assert!(!from_a.is_empty(), "a's connections are reported");
    assert!(
        from_a.iter().all(|f| f.get("staged").is_none()),
        "a's connections keep their verdict under the staged policy: {from_a:?}"
    );
    // The metric counts the staged drops per staged policy.
    let (_, metrics) = node2_get(&c, "/metrics");
    let counted: f64 = metrics
        .lines()
        .find(|l| {
            l.starts_with("ciliate_policy_staged_verdicts_total{")
                && l.contains("policy=\"CiliumNetworkPolicy x/b-from-a\"")
                && l.contains("verdict=\"dropped\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no staged verdict metric: {metrics}"));
    assert!(
        counted >= staged.len() as f64,
        "{counted} < {}",
        staged.len()
    );

    // The annotation removed: enforced as staged. Exactly c's connections drop.
    c.api()
        .apply_json(b_from_a(false))
        .expect("the policy enforced");
    eventually("c no longer reaches b", || {
        !tcp_ok(&other.netns, b_addr, 8080)
    });
    assert!(tcp_ok(&a.netns, b_addr, 8080), "a still reaches b");
    let dropped = flows_into_b(&c, "x/c")
        .into_iter()
        .filter(|f| f["verdict"] == "dropped")
        .collect::<Vec<_>>();
    assert!(!dropped.is_empty(), "c's drops are reported");
    assert!(
        dropped
            .iter()
            .all(|f| f["policies"][0]["name"] == "b-from-a" && f.get("staged").is_none()),
        "enforced, nothing is staged any more: {dropped:?}"
    );
}
