//! L7 HTTP policy across two nodes of the cluster harness (issue #27), with the HTTP
//! manifests of Cilium's connectivity suite (`../shared/examples/real-policies/
//! cilium-connectivity`) loaded unchanged into namespace `x`: pods made through CNI, hyper
//! servers inside them, each request of a kept connection judged as Cilium judges it, the
//! server on the same node and on the other one. Privileged: with CI=true it must run.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use common::cluster::{pod_object, Cluster};
use common::cni::CniPod;
use common::http::{serve, Conn};
use common::netns::privileged;
use serde_json::{json, Value};

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/examples/real-policies/cilium-connectivity")
}

/// A manifest of the corpus as the API server gets it (`kubectl apply -n x`).
fn manifest(file: &str) -> Value {
    let text = std::fs::read_to_string(corpus().join(file)).expect("a corpus manifest");
    let mut v: Value = serde_yaml::from_str(&text).expect("YAML");
    v["metadata"]["namespace"] = json!("x");
    v
}

/// The connectivity suite's pods: `client` (kind: client), `client2` (kind: client,
/// other: client) on node 1, `echo-same-node` on node 1 and `echo-other-node` on node 2
/// (kind: echo, port `http-8080` = 8080), each echo serving HTTP on 8080.
struct Suite {
    c: Cluster,
    client: CniPod,
    client2: CniPod,
    echoes: Vec<CniPod>,
}

fn pod(name: &str, labels: Value, ports: Value) -> Value {
    let mut o = pod_object(name, "", "", None);
    o["metadata"]["labels"] = labels;
    o["spec"]["containers"][0]["ports"] = ports;
    o
}

impl Suite {
    fn start() -> Option<Suite> {
        if !privileged() {
            return None;
        }
        let mut c = Cluster::start(2);
        let none = json!([]);
        let http = json!([{"name": "http-8080", "containerPort": 8080, "protocol": "TCP"}]);
        let client = c.add_pod_from(
            1,
            "client",
            pod("client", json!({"kind": "client"}), none.clone()),
        );
        let client2 = c.add_pod_from(
            1,
            "client2",
            pod(
                "client2",
                json!({"kind": "client", "other": "client"}),
                none,
            ),
        );
        let mut echoes = Vec::new();
        for (node, name) in [(1, "echo-same-node"), (2, "echo-other-node")] {
            let e = c.add_pod_from(node, name, pod(name, json!({"kind": "echo"}), http.clone()));
            serve(&e.netns, IpAddr::V4(e.addr), 8080);
            echoes.push(e);
        }
        let s = Suite {
            c,
            client,
            client2,
            echoes,
        };
        for n in &s.c.nodes {
            let a = n.agent();
            a.wait_until("the HTTP proxy is connected", || {
                a.cli_json(&["status"])["http_proxy"]["connected"] == true
            });
        }
        Some(s)
    }

    /// Applies `file` and waits until both agents realized it.
    fn apply(&self, file: &str) -> Value {
        let m = manifest(file);
        let name = m["metadata"]["name"].as_str().unwrap().to_string();
        self.c.api().apply_json(m.clone()).expect("apply");
        self.realized(&name, true);
        m
    }

    fn delete(&self, m: &Value) {
        let name = m["metadata"]["name"].as_str().unwrap();
        self.c
            .api()
            .delete_object("cilium.io/v2", "CiliumNetworkPolicy", "x", name)
            .expect("delete");
        self.realized(name, false);
    }

    fn realized(&self, name: &str, present: bool) {
        for n in &self.c.nodes {
            let a = n.agent();
            // The agents' debug servers are in their nodes' namespaces: the API socket tells.
            let mut rev = 0;
            a.wait_until(&format!("{name} is in force on {}", n.name), || {
                let p = a.cli_json(&["policy", "get"]);
                rev = p["revision"].as_u64().unwrap_or(0);
                let listed = p["policies"].as_array().is_some_and(|v| {
                    v.iter()
                        .any(|x| x["name"] == name && x["status"] == "accepted")
                });
                listed == present
            });
            a.wait_until(&format!("{} realized revision {rev}", n.name), || {
                let eps = a.cli_json(&["endpoint", "list"]);
                eps.as_array().is_some_and(|v| {
                    v.iter().all(|e| {
                        e["policy_revision"].as_u64().unwrap_or(0) >= rev && e["state"] == "ready"
                    })
                })
            });
        }
    }

    fn echo(&self, i: usize) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.echoes[i].addr), 8080)
    }

    /// One kept connection from `from` to echo `i`: each (method, path, header) -> status.
    fn statuses(&self, from: &CniPod, i: usize, reqs: &[Req<'_>]) -> Vec<u16> {
        let Ok(mut c) = Conn::open(&from.netns, self.echo(i)) else {
            return vec![0; reqs.len()];
        };
        reqs.iter()
            .map(|(m, p, h)| {
                let hs: Vec<(&str, &str)> = h.iter().copied().collect();
                match c.request(m, p, &hs) {
                    Ok(r) => r.status,
                    Err(_) => 0,
                }
            })
            .collect()
    }
}

const TOKEN: Option<(&str, &str)> = Some(("X-Very-Secret-Token", "42"));

/// A request: method, path, and one header.
type Req<'a> = (&'a str, &'a str, Option<(&'a str, &'a str)>);

/// The echo-ingress manifests: client2 (`other: client`) may GET `/`, `/public`, and
/// `/private` with the token; client is not selected at all (no connection).
#[test]
fn the_connectivity_suites_http_manifests_are_enforced_across_nodes() {
    let Some(s) = Suite::start() else { return };
    let ingress_reqs = [
        ("GET", "/public", None),
        ("GET", "/private", None),
        ("GET", "/private", TOKEN),
        ("POST", "/", None),
        ("GET", "/", None),
        ("GET", "/public/../private", None),
    ];
    let want_client2 = vec![200, 403, 200, 403, 200, 403];
    for file in [
        "echo-ingress-l7-http.yaml",
        "echo-ingress-l7-http-named-port.yaml",
        "echo-ingress-l7-http-port-range.yaml",
    ] {
        let m = s.apply(file);
        for i in 0..2 {
            assert_eq!(
                s.statuses(&s.client2, i, &ingress_reqs),
                want_client2,
                "{file}: client2 -> {}",
                s.echoes[i].name
            );
            assert_eq!(
                s.statuses(&s.client, i, &ingress_reqs[..1]),
                vec![0],
                "{file}: client is not allowed at L3/L4"
            );
        }
        s.delete(&m);
    }
    // From anywhere: GET / only (the path is a full match).
    let m = s.apply("echo-ingress-l7-http-from-anywhere.yaml");
    for i in 0..2 {
        for p in [&s.client, &s.client2] {
            assert_eq!(
                s.statuses(p, i, &[("GET", "/", None), ("GET", "/public", None)]),
                vec![200, 403],
                "from-anywhere: {} -> {}",
                p.name,
                s.echoes[i].name
            );
        }
    }
    s.delete(&m);

    // Egress, at the client: client-egress-l7-http{,-named-port}: client2 may GET "/" (a full
    // match: not /public); client-egress-l7-http-method: POST /public and /private only.
    for (file, reqs, want) in [
        (
            "client-egress-l7-http.yaml",
            vec![
                ("GET", "/", None),
                ("GET", "/public", None),
                ("POST", "/", None),
            ],
            vec![200, 403, 403],
        ),
        (
            "client-egress-l7-http-named-port.yaml",
            vec![("GET", "/", None), ("GET", "/public", None)],
            vec![200, 403],
        ),
        (
            "client-egress-l7-http-method.yaml",
            vec![
                ("POST", "/public", None),
                ("POST", "/private", None),
                ("GET", "/public", None),
            ],
            vec![200, 200, 403],
        ),
    ] {
        let m = s.apply(file);
        for i in 0..2 {
            let post = |r: &Req| r.0 == "POST";
            let reqs: Vec<_> = reqs
                .iter()
                .map(|r| {
                    if post(r) {
                        (r.0, r.1, Some(("Content-Length", "0")))
                    } else {
                        *r
                    }
                })
                .collect();
            assert_eq!(
                s.statuses(&s.client2, i, &reqs),
                want,
                "{file}: client2 -> {}",
                s.echoes[i].name
            );
            // client is not selected by these: no egress policy, everything passes.
            assert_eq!(
                s.statuses(&s.client, i, &reqs[..1]),
                vec![200],
                "{file}: client"
            );
        }
        s.delete(&m);
    }
    // kind: client (both clients) egress GET "/" only.
    let m = s.apply("client-egress-l7-http-from-any.yaml");
    for i in 0..2 {
        for p in [&s.client, &s.client2] {
            assert_eq!(
                s.statuses(p, i, &[("GET", "/", None), ("GET", "/x", None)]),
                vec![200, 403],
                "from-any: {} -> {}",
                p.name,
                s.echoes[i].name
            );
        }
    }
    s.delete(&m);
}
