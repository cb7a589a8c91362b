//! The agent binary in Kubernetes mode against the in-repo API server (plain HTTP), driven with
//! the real kubectl: policies applied with kubectl take effect on endpoints (real traffic
//! between network-namespace pods through the BPF datapath), the CNP status shows this node's
//! enforcement or the validation error, the Node gets its annotations, pod label changes move
//! endpoints between identities, and broken watches, 410 Gone and an API server outage are
//! survived without losing a policy. Privileged (root): with CI=true these tests must run.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use ciliate_test_apiserver::{ServerOptions, TestApiServer};
use common::agent::Agent;
use common::netns::{privileged, privileged_two_pods, tcp_ok, world};
use common::{anp_b_from_a as anp, eventually};
use serde_json::{json, Value};

const NODE: &str = "node-1";

struct Kubectl {
    kubeconfig: PathBuf,
    cache: PathBuf,
}

/// A fresh test API server, a directory, and kubectl configured for the server.
fn api_server() -> (TestApiServer, tempfile::TempDir, Kubectl) {
    let server = TestApiServer::start().expect("API server");
    let tmp = tempfile::tempdir().unwrap();
    let kubectl = Kubectl::new(tmp.path(), &server);
    (server, tmp, kubectl)
}

impl Kubectl {
    fn new(dir: &Path, server: &TestApiServer) -> Kubectl {
        let kubeconfig = dir.join("kubeconfig");
        server.kubeconfig(&kubeconfig).expect("write kubeconfig");
        Kubectl {
            kubeconfig,
            cache: dir.join("kube-cache"),
        }
    }

    fn run(&self, args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
        use std::io::Write;
        let mut child = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl is installed");
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(text.as_bytes())
                .expect("write kubectl stdin");
        }
        let out = child.wait_with_output().expect("kubectl runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn ok(&self, args: &[&str], stdin: Option<&str>) -> String {
        let (ok, out, err) = self.run(args, stdin);
        assert!(ok, "kubectl {args:?} failed:\n{out}\n{err}");
        out
    }

    fn apply(&self, yaml: &str) {
        self.ok(&["apply", "-f", "-"], Some(yaml));
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        let out = self.ok(&a, None);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("kubectl {args:?}: {e}: {out}"))
    }
}

fn crds_dir() -> String {
    format!("{}/manifests/crds", env!("CARGO_MANIFEST_DIR"))
}

/// A pod as the kubelet would have reported it (status with its address).
fn pod(name: &str, app: &str, ip: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "x", "labels": {"app": app}},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
    })
}

/// Namespace x, this node (pod CIDR in the spec, an InternalIP) and the given pods.
fn seed_cluster(server: &TestApiServer, kubectl: &Kubectl, pods: &[Value]) {
    kubectl.ok(&["apply", "-f", &crds_dir()], None);
    kubectl.apply("apiVersion: v1\nkind: Namespace\nmetadata: {name: x, labels: {team: blue}}\n");
    server
        .apply_json(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE},
            "spec": {"podCIDRs": ["10.250.7.0/24"]},
            "status": {"addresses": [{"type": "InternalIP", "address": "172.31.7.2"}]}
        }))
        .expect("node");
    for p in pods {
        server.apply_json(p.clone()).expect("pod");
    }
}

fn allow_port(name: &str, to: &str, from: &str, port: u16) -> String {
    format!(
        "apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {{name: {name}, namespace: x}}
spec:
  endpointSelector: {{matchLabels: {{app: {to}}}}}
  ingress:
  - fromEndpoints: [{{matchLabels: {{app: {from}}}}}]
    toPorts: [{{ports: [{{port: '{port}', protocol: TCP}}]}}]
"
    )
}

fn node_status(kubectl: &Kubectl, name: &str) -> Value {
    kubectl.json(&["get", "cnp", "-n", "x", name])["status"]["nodes"][NODE].clone()
}

fn identity_of(agent: &Agent, ip: &str) -> Option<u64> {
    agent
        .json("/debug/ipcache")
        .as_array()?
        .iter()
        .find(|e| {
            e["prefix"]
                .as_str()
                .is_some_and(|p| p.split('/').next() == Some(ip))
        })
        .and_then(|e| e["identity"].as_u64())
}

fn add_endpoint(agent: &Agent, name: &str, ip: &str, interface: Option<&str>) -> u64 {
    let mut args = vec!["endpoint", "add", "--name", name, "--ip", ip];
    if let Some(i) = interface {
        args.extend(["--interface", i]);
    }
    agent.cli_json(&args)["id"].as_u64().expect("endpoint id")
}

/// Pods a and b (network namespaces; b serves 8080 and 9090) known to a fresh API server, and
/// the agent in Kubernetes mode on the BPF datapath with both as endpoints.
struct TwoPods {
    // Dropped in this order: the agent before the API server and the namespaces.
    agent: Agent,
    kubectl: Kubectl,
    _server: TestApiServer,
    _tmp: tempfile::TempDir,
    w: common::netns::World,
    ep_a: u64,
    ep_b: u64,
}

impl TwoPods {
    /// `None` when not privileged (never under CI=true).
    fn start() -> Option<TwoPods> {
        let w = privileged_two_pods(&[8080, 9090])?;
        let (a, b) = (&w.pods[0], &w.pods[1]);
        let (a_ip, b_ip) = (a.addr.to_string(), b.addr.to_string());
        let (server, tmp, kubectl) = api_server();
        seed_cluster(
            &server,
            &kubectl,
            &[pod("a", "a", &a_ip), pod("b", "b", &b_ip)],
        );
        let pins = w.pins.to_string_lossy().to_string();
        let agent = Agent::start_kubernetes(
            tmp.path(),
            &kubectl.kubeconfig,
            &["--datapath", "bpf", "--bpf-root", &pins],
        );
        let ep_a = add_endpoint(&agent, "x/a", &a_ip, Some(&a.host_if));
        let ep_b = add_endpoint(&agent, "x/b", &b_ip, Some(&b.host_if));
        Some(TwoPods {
            agent,
            kubectl,
            _server: server,
            _tmp: tmp,
            w,
            ep_a,
            ep_b,
        })
    }

    fn a(&self) -> &common::netns::Pod {
        &self.w.pods[0]
    }

    fn b(&self) -> &common::netns::Pod {
        &self.w.pods[1]
    }

    fn a_ip(&self) -> String {
        self.a().addr.to_string()
    }
}

#[test]
fn kubectl_policies_are_enforced_with_status_annotations_and_label_moves() {
    let Some(t) = TwoPods::start() else {
        return;
    };
    let (a, b, a_ip, agent, kubectl) = (t.a(), t.b(), t.a_ip(), &t.agent, &t.kubectl);
    let (ep_a, ep_b) = (t.ep_a, t.ep_b);
    assert!(agent.endpoint(ep_b)["identity"].as_u64().is_some());

    // No policy selects b yet: both ports open.
    eventually("a reaches b:8080 and b:9090", || {
        tcp_ok(&a.netns, b.addr, 8080) && tcp_ok(&a.netns, b.addr, 9090)
    });

    // A policy applied with kubectl takes effect on real traffic.
    kubectl.apply(&allow_port("b-from-a", "b", "a", 8080));
    eventually("the policy is enforced on b", || {
        tcp_ok(&a.netns, b.addr, 8080) && !tcp_ok(&a.netns, b.addr, 9090)
    });

    // Its status shows this node's enforcement at the agent's revision.
    eventually("the CNP status says node-1 enforces it", || {
        let s = node_status(kubectl, "b-from-a");
        s["ok"] == true && s["enforcing"] == true && s["localPolicyRevision"].as_i64() > Some(0)
    });
    let cnp = kubectl.json(&["get", "cnp", "-n", "x", "b-from-a"]);
    let valid = &cnp["status"]["conditions"][0];
    assert_eq!(
        (&valid["type"], &valid["status"]),
        (&json!("Valid"), &json!("True"))
    );

    let (_, metrics) = agent.http_get("/metrics");
    for series in [
        "ciliate_policy_status_writes_total{outcome=\"ok\"}",
        "ciliate_k8s_watch_events_total{resource=\"CiliumNetworkPolicy\"}",
        "ciliate_k8s_watch_events_total{resource=\"Pod\"}",
    ] {
        let value = metrics
            .lines()
            .find_map(|l| l.strip_prefix(series))
            .and_then(|v| v.trim().parse::<f64>().ok());
        assert!(value.is_some_and(|v| v >= 1.0), "{series} in:\n{metrics}");
    }

    // The node carries its pod CIDR and host IP.
    eventually("the node is annotated", || {
        let n = kubectl.json(&["get", "node", NODE]);
        let ann = &n["metadata"]["annotations"];
        ann["io.cilium.network.ipv4-pod-cidr"] == "10.250.7.0/24"
            && ann["io.cilium.network.ipv4-cilium-host"] == "172.31.7.2"
    });

    // Removed by hand, they come back.
    kubectl.ok(
        &["annotate", "node", NODE, "io.cilium.network.ipv4-pod-cidr-"],
        None,
    );
    eventually("the node is annotated again", || {
        let n = kubectl.json(&["get", "node", NODE]);
        n["metadata"]["annotations"]["io.cilium.network.ipv4-pod-cidr"] == "10.250.7.0/24"
    });

    // An invalid policy gets an error status naming the field; the valid one stays enforced.
    kubectl.apply(
        "apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: broken, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: b}}
  ingress: [{fromCIDR: [not-a-cidr]}]
",
    );
    eventually("the invalid CNP has an error status", || {
        let cnp = kubectl.json(&["get", "cnp", "-n", "x", "broken"]);
        let s = &cnp["status"]["nodes"][NODE];
        let c = &cnp["status"]["conditions"][0];
        s["ok"] == false
            && s["error"]
                .as_str()
                .is_some_and(|e| e.contains("fromCIDR[0]"))
            && c["type"] == "Valid"
            && c["status"] == "False"
    });
    let policies = agent.json("/debug/policy");
    let accepted: Vec<&str> = policies["policies"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["status"] == "accepted")
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(accepted, ["b-from-a"], "{policies}");
    assert!(tcp_ok(&a.netns, b.addr, 8080) && !tcp_ok(&a.netns, b.addr, 9090));

    // Relabelling pod a moves its endpoint to another identity, which the policy does not admit.
    let old_a = agent.endpoint(ep_a)["identity"].as_u64().unwrap();
    kubectl.ok(
        &["label", "pod", "-n", "x", "a", "app=other", "--overwrite"],
        None,
    );
    eventually("endpoint a moved to a new identity", || {
        let e = agent.endpoint(ep_a);
        e["identity"].as_u64().is_some_and(|i| i != old_a)
            && identity_of(agent, &a_ip) == e["identity"].as_u64()
    });
    eventually("b no longer admits a", || !tcp_ok(&a.netns, b.addr, 8080));
    // And back: the policy admits it again.
    kubectl.ok(
        &["label", "pod", "-n", "x", "a", "app=a", "--overwrite"],
        None,
    );
    eventually("b admits a again", || tcp_ok(&a.netns, b.addr, 8080));

    // Deleting the policy with kubectl opens b again.
    kubectl.ok(&["delete", "cnp", "-n", "x", "b-from-a"], None);
    eventually("b is open again", || tcp_ok(&a.netns, b.addr, 9090));
}

/// A cluster tier's condition of `kind` `name` with this type.
fn tier_condition(kubectl: &Kubectl, kind: &str, name: &str, type_: &str) -> Value {
    let o = kubectl.json(&["get", kind, name]);
    o["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_).cloned())
        .unwrap_or(Value::Null)
}

/// Cluster tiers in Kubernetes mode: AdminNetworkPolicies applied with kubectl are enforced on
/// real traffic ahead of a CiliumNetworkPolicy (Deny beats its allow; a lower priority's Pass
/// hands the decision back to it), a priority change applies live, each object carries its
/// conditions (Accepted, or the field that is wrong; SamePriority with ciliate's order), and
/// deleting one with kubectl undoes it.
#[test]
fn cluster_tiers_applied_with_kubectl_are_enforced_and_report_conditions() {
    let Some(t) = TwoPods::start() else {
        return;
    };
    let (a, b, agent, kubectl) = (t.a(), t.b(), &t.agent, &t.kubectl);
    let status = agent.cli_json(&["status"]);
    assert!(
        status.get("kinds_not_served").is_none(),
        "the CRDs are installed: {status}"
    );
    kubectl.apply(&allow_port("b-from-a", "b", "a", 8080));
    eventually("the CNP admits a on 8080 only", || {
        tcp_ok(&a.netns, b.addr, 8080) && !tcp_ok(&a.netns, b.addr, 9090)
    });

    // An Admin Deny beats the CNP's allow.
    kubectl.apply(&anp("deny-a", 20, "Deny", 8080));
    eventually("the ANP denies a on 8080", || {
        !tcp_ok(&a.netns, b.addr, 8080)
    });
    eventually("deny-a is Accepted", || {
        tier_condition(kubectl, "anp", "deny-a", "Accepted")["status"] == "True"
    });

    // A Pass at a lower priority number comes first and hands over to the CNP; moved behind
    // the Deny, the Deny decides again.
    kubectl.apply(&anp("pass-a", 10, "Pass", 8080));
    eventually("the Pass hands a back to the CNP", || {
        tcp_ok(&a.netns, b.addr, 8080)
    });
    kubectl.apply(&anp("pass-a", 30, "Pass", 8080));
    eventually("after the priority change the Deny decides", || {
        !tcp_ok(&a.netns, b.addr, 8080)
    });

    // The same priority: both say so, and in which order ciliate evaluates them.
    kubectl.apply(&anp("pass-a", 20, "Pass", 8080));
    for name in ["deny-a", "pass-a"] {
        eventually(&format!("{name} says it shares priority 20"), || {
            let c = tier_condition(kubectl, "anp", name, "SamePriority");
            c["status"] == "True"
                && c["message"].as_str().is_some_and(|m| {
                    m.ends_with(
                        "then name: AdminNetworkPolicy deny-a, then AdminNetworkPolicy pass-a",
                    )
                })
        });
    }
    // deny-a comes first by name: denied.
    eventually("deny-a decides", || !tcp_ok(&a.netns, b.addr, 8080));

    // An invalid one: Accepted False with its field; the others stay enforced.
    kubectl.apply(
        "apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: no-such-tier}
spec:
  tier: Middle
  priority: 1
  subject: {namespaces: {}}
",
    );
    eventually("the invalid CNP-tier policy says which field", || {
        let c = tier_condition(
            kubectl,
            "clusternetworkpolicies",
            "no-such-tier",
            "Accepted",
        );
        c["status"] == "False"
            && c["reason"] == "Invalid"
            && c["message"]
                .as_str()
                .is_some_and(|m| m.contains("spec.tier"))
    });
    assert!(!tcp_ok(&a.netns, b.addr, 8080));
    assert!(!tcp_ok(&a.netns, b.addr, 9090), "the CNP still isolates b");

    // Deleting the Deny with kubectl: the Pass alone hands over to the CNP, and pass-a no
    // longer shares its priority.
    kubectl.ok(&["delete", "anp", "deny-a"], None);
    eventually("a reaches b:8080 again", || tcp_ok(&a.netns, b.addr, 8080));
    eventually("pass-a shares its priority with nobody", || {
        tier_condition(kubectl, "anp", "pass-a", "SamePriority").is_null()
    });
}

/// True when the endpoint's realized policy map (read from the kernel) admits `identity` on
/// `port`; false too while the endpoint has no map yet (before its first regeneration).
fn admits(agent: &Agent, ep: u64, identity: u64, port: u64) -> bool {
    let (code, out, _) = agent.cli(&["bpf", "policy", "get", &ep.to_string(), "-o", "json"]);
    if code != 0 {
        return false;
    }
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    v["entries"].as_array().into_iter().flatten().any(|e| {
        e["direction"] == "ingress"
            && e["identity"].as_u64() == Some(identity)
            && e["port"].as_u64() == Some(port)
            && e["deny"] != true
    })
}

#[test]
fn broken_watches_410_and_an_api_outage_keep_every_policy() {
    let Some((w, (server, tmp, kubectl))) = privileged().then(|| (world(0), api_server())) else {
        return;
    };
    let addr = server.addr();
    let pods = [pod("a", "a", "10.250.8.1"), pod("b", "b", "10.250.8.2")];
    seed_cluster(&server, &kubectl, &pods);
    kubectl.apply(&allow_port("p1", "a", "b", 81));
    let pins = w.pins.to_string_lossy().to_string();
    let agent = Agent::start_kubernetes(
        tmp.path(),
        &kubectl.kubeconfig,
        &["--datapath", "bpf", "--bpf-root", &pins],
    );
    let ep = add_endpoint(&agent, "x/a", "10.250.8.1", None);
    let b_id = identity_of(&agent, "10.250.8.2").expect("b has an identity");
    eventually("p1 is realized", || admits(&agent, ep, b_id, 81));

    // The other two kinds: a Kubernetes NetworkPolicy and a clusterwide policy (whose status
    // goes through the cluster-scoped status subresource).
    kubectl.apply(
        "apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: knp, namespace: x}
spec:
  podSelector: {matchLabels: {app: a}}
  ingress: [{from: [{podSelector: {matchLabels: {app: b}}}], ports: [{port: 84, protocol: TCP}]}]
---
apiVersion: cilium.io/v2
kind: CiliumClusterwideNetworkPolicy
metadata: {name: ccnp}
spec:
  endpointSelector: {matchLabels: {app: a}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: b, k8s:io.kubernetes.pod.namespace: x}}]
    toPorts: [{ports: [{port: '85', protocol: TCP}]}]
",
    );
    eventually("the NetworkPolicy and the CCNP are realized", || {
        admits(&agent, ep, b_id, 84) && admits(&agent, ep, b_id, 85)
    });
    eventually("the CCNP status says node-1 enforces it", || {
        let s = &kubectl.json(&["get", "ccnp", "ccnp"])["status"]["nodes"][NODE];
        s["ok"] == true && s["enforcing"] == true
    });
    kubectl.ok(&["delete", "ccnp", "ccnp"], None);
    kubectl.ok(&["delete", "networkpolicy", "-n", "x", "knp"], None);
    eventually("both are gone", || {
        !admits(&agent, ep, b_id, 84) && !admits(&agent, ep, b_id, 85)
    });

    // A watch broken mid-stream resumes: a policy applied afterwards still arrives.
    server.break_watches();
    kubectl.apply(&allow_port("p2", "a", "b", 82));
    eventually("p2 arrives over the resumed watch", || {
        admits(&agent, ep, b_id, 82)
    });

    // A delete the agent only learns from a relist (410 Gone: the history is compacted).
    server.break_watches();
    server
        .delete_object("cilium.io/v2", "CiliumNetworkPolicy", "x", "p2")
        .expect("delete p2");
    server.compact();
    eventually("the relist removes p2 and keeps p1", || {
        !admits(&agent, ep, b_id, 82) && admits(&agent, ep, b_id, 81)
    });

    // toServices: a service without a selector, its backends from an EndpointSlice.
    kubectl.apply(
        "apiVersion: v1
kind: Service
metadata: {name: ext, namespace: x, labels: {external: 'yes'}}
spec: {ports: [{port: 443}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: ext-1, namespace: x, labels: {kubernetes.io/service-name: ext}}
addressType: IPv4
endpoints: [{addresses: [192.0.2.10]}]
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: to-ext, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: a}}
  egress:
  - toServices: [{k8sServiceSelector: {selector: {matchLabels: {external: 'yes'}}}}]
",
    );
    let egress_to = |ip: &str| {
        identity_of(&agent, ip).is_some_and(|id| {
            agent
                .entries(ep)
                .iter()
                .any(|(dir, i, _, _, deny)| dir == "egress" && *i == id && !deny)
        })
    };
    agent.wait_until("a may reach the service backend 192.0.2.10", || {
        egress_to("192.0.2.10")
    });
    kubectl.apply(
        "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: ext-1, namespace: x, labels: {kubernetes.io/service-name: ext}}
addressType: IPv4
endpoints: [{addresses: [192.0.2.11]}]
",
    );
    agent.wait_until("the backend moved to 192.0.2.11", || {
        egress_to("192.0.2.11") && !egress_to("192.0.2.10")
    });
    kubectl.ok(&["delete", "cnp", "-n", "x", "to-ext"], None);

    // An outage: the API server goes away. Nothing the agent enforces changes meanwhile.
    let rv = server.store().current_rv();
    drop(server);
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert!(
        admits(&agent, ep, b_id, 81),
        "p1 stays in force during the outage"
    );
    assert_eq!(agent.http_get("/healthz").0, 200);
    let names: Vec<String> = agent.json("/debug/policy")["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["p1"]);

    // The API server returns (same address, fresh store, later resource versions): the agent
    // relists and applies what changed meanwhile: p1 gone, p3 new. (It may relist before the
    // store is seeded again, and then sees b deleted and re-created, with a new identity.)
    let server = TestApiServer::start_with(addr, ServerOptions::default()).expect("restart");
    while server.store().current_rv() <= rv {
        server.compact();
    }
    seed_cluster(&server, &kubectl, &pods);
    kubectl.apply(&allow_port("p3", "a", "b", 83));
    server.compact();
    agent.wait_until("after the outage p3 holds and p1 is gone", || {
        identity_of(&agent, "10.250.8.2")
            .is_some_and(|b_id| admits(&agent, ep, b_id, 83) && !admits(&agent, ep, b_id, 81))
    });
    let p1_gone = agent.json("/debug/policy")["policies"]
        .as_array()
        .is_some_and(|p| p.iter().all(|p| p["name"] != "p1"));
    assert!(p1_gone);
}

#[test]
fn readyz_says_what_the_initial_sync_waits_for() {
    let Some((w, (_server, tmp, kubectl))) = privileged().then(|| (world(0), api_server())) else {
        return;
    };
    // No CRDs yet: the policy kinds cannot be listed.
    let pins = w.pins.to_string_lossy().to_string();
    let agent = Agent::spawn_kubernetes(
        tmp.path(),
        &kubectl.kubeconfig,
        &["--datapath", "bpf", "--bpf-root", &pins],
    );
    agent.wait_until("/readyz explains what it waits for", || {
        let (code, body) = agent.http_get("/readyz");
        code == 503
            && body.contains("waiting for CiliumNetworkPolicy to be listed (last error:")
            && body.contains("CiliumClusterwideNetworkPolicy")
            && body.contains("CiliateEndpointSlice to be listed (last error:")
            && !body.contains("waiting for Pod")
            && !body.contains("AdminNetworkPolicy")
            && !body.contains(" ClusterNetworkPolicy")
    });
    // The network-policy-api's kinds are optional: not served, none exist, nothing waits.
    agent.wait_until("status names the kinds not served", || {
        agent.cli_json(&["status"])["kinds_not_served"]
            == json!([
                "AdminNetworkPolicy",
                "BaselineAdminNetworkPolicy",
                "ClusterNetworkPolicy"
            ])
    });
    kubectl.ok(&["apply", "-f", &crds_dir()], None);
    agent.wait_until("ready once the CRDs exist", || {
        agent.http_get("/readyz").0 == 200
    });
    agent.wait_until("and the tiers' kinds are served", || {
        agent
            .cli_json(&["status"])
            .get("kinds_not_served")
            .is_none()
    });
}

/// A pod deleted from the API server while the agent was down (its CNI DEL could not reach the
/// agent): after the restart's initial sync its endpoint is removed, the other is kept, and the
/// sweep is counted.
#[test]
fn an_endpoint_whose_pod_was_deleted_while_the_agent_was_down_is_removed_at_restart() {
    if !privileged() {
        return;
    }
    let (server, tmp, kubectl) = api_server();
    seed_cluster(
        &server,
        &kubectl,
        &[pod("a", "a", "10.250.7.11"), pod("b", "b", "10.250.7.12")],
    );
    let args = ["--datapath", "memory"];
    let mut agent = Agent::start_kubernetes(tmp.path(), &kubectl.kubeconfig, &args);
    let a = add_endpoint(&agent, "x/a", "10.250.7.11", None);
    let b = add_endpoint(&agent, "x/b", "10.250.7.12", None);
    agent.wait_realized(agent.revision());
    agent.stop();

    kubectl.ok(&["delete", "pod", "-n", "x", "b"], None);
    let agent = Agent::start_kubernetes(tmp.path(), &kubectl.kubeconfig, &args);
    agent.wait_until("the endpoint of the deleted pod is gone", || {
        let eps = agent.json("/debug/endpoints");
        eps.as_array()
            .is_some_and(|e| e.len() == 1 && e[0]["id"].as_u64() == Some(a))
    });
    assert!(
        !tmp.path().join(format!("state/{b}")).exists(),
        "its record is gone"
    );
    let metrics = agent.http_get("/metrics").1;
    assert!(
        metrics.contains("ciliate_endpoint_restore_total{outcome=\"pod_gone\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ciliate_endpoint_restore_total{outcome=\"restored\"} 2"),
        "{metrics}"
    );
    assert!(agent
        .log()
        .contains("endpoint removed: its pod no longer exists"));
}

/// The labels of the identity `ip` maps to in the agent's ipcache, if any.
fn labels_of(agent: &Agent, ip: &str) -> Option<Vec<String>> {
    let id = identity_of(agent, ip)?;
    let ids = agent.json("/debug/identities");
    let found = ids.as_array()?.iter().find(|i| i["id"] == id)?.clone();
    Some(
        found["labels"]
            .as_array()?
            .iter()
            .filter_map(|l| l.as_str().map(str::to_string))
            .collect(),
    )
}

fn remote_pod(name: &str, node: &str, app: &str, ip: &str) -> Value {
    let mut p = pod(name, app, ip);
    p["spec"]["nodeName"] = json!(node);
    p
}

fn slices_of(kubectl: &Kubectl, node: &str) -> Vec<Value> {
    let list = kubectl.json(&[
        "get",
        "ciliateendpointslices",
        "-l",
        &format!("ciliate.io/node={node}"),
    ]);
    list["items"].as_array().cloned().unwrap_or_default()
}

/// Watch fan-out: each agent writes its node's pods into CiliateEndpointSlices and learns the
/// other nodes' pods from theirs, not from Pods. A pod on a node without an agent is unknown
/// to it (and known to an agent started with --watch-pods); label changes and deletions travel
/// through the slices; a malformed slice is reported and its last good version kept; a
/// restarted agent adopts its slices without rewriting them.
#[test]
fn agents_learn_other_nodes_pods_from_the_slices_their_agents_write() {
    let (server, tmp, kubectl) = api_server();
    kubectl.ok(&["apply", "-f", &crds_dir()], None);
    kubectl.apply("apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n");
    for (k, node) in ["node-1", "node-2", "node-3"].iter().enumerate() {
        server
            .apply_json(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node},
                "spec": {"podCIDRs": [format!("10.250.{k}.0/24")]},
                "status": {"addresses": [{"type": "InternalIP", "address": format!("172.31.9.{}", k + 1)}]}}))
            .expect("node");
    }
    server
        .apply_json(remote_pod("web-0", "node-1", "web", "10.250.0.5"))
        .expect("pod");
    server
        .apply_json(remote_pod("db-0", "node-2", "db", "10.250.1.5"))
        .expect("pod");
    // node-3 runs no agent here (or one that wrote nothing yet): no slice lists its pod.
    server
        .apply_json(remote_pod("ghost", "node-3", "ghost", "10.250.2.5"))
        .expect("pod");

    let dirs: Vec<PathBuf> = (1..=3).map(|i| tmp.path().join(format!("a{i}"))).collect();
    for d in &dirs {
        std::fs::create_dir_all(d).unwrap();
    }
    let start = |i: usize, extra: &[&str]| {
        let node = format!("node-{}", i + 1);
        let mut args = vec!["--node-name", node.as_str(), "--datapath", "memory"];
        args.extend(extra);
        Agent::start_kubernetes(&dirs[i], &kubectl.kubeconfig, &args)
    };
    let mut a = start(0, &[]);
    let b = start(1, &[]);

    // Each agent wrote its node's slice, labelled with the node.
    eventually("node-1 and node-2 have their slices", || {
        slices_of(&kubectl, "node-1").len() == 1 && slices_of(&kubectl, "node-2").len() == 1
    });
    let s1 = &slices_of(&kubectl, "node-1")[0];
    assert_eq!(s1["metadata"]["name"], "node-1.0");
    assert_eq!(s1["spec"]["node"], "node-1");
    assert_eq!(s1["spec"]["endpoints"][0]["name"], "web-0");
    assert_eq!(s1["spec"]["endpoints"][0]["ips"], json!(["10.250.0.5"]));
    assert_eq!(s1["spec"]["profiles"][0]["labels"], json!({"app": "web"}));
    assert_eq!(s1["metadata"]["ownerReferences"][0]["kind"], "Node");

    // Each learns the other's pod, with its labels; neither knows the pod no slice lists.
    eventually("node-2's agent knows web-0 from node-1's slice", || {
        labels_of(&b, "10.250.0.5").is_some_and(|l| l.contains(&"k8s:app=web".to_string()))
    });
    eventually("node-1's agent knows db-0 from node-2's slice", || {
        labels_of(&a, "10.250.1.5").is_some_and(|l| l.contains(&"k8s:app=db".to_string()))
    });
    assert_eq!(identity_of(&a, "10.250.2.5"), None, "no slice lists ghost");
    let status = a.cli_json(&["status"]);
    assert_eq!(
        status["remote_pods"]["remote_pods_from"], "CiliateEndpointSlice",
        "{status}"
    );
    assert_eq!(status["remote_pods"]["slices_written"], 1, "{status}");
    assert_eq!(status["remote_pods"]["local_pods"], 1, "{status}");

    // An agent that watches Pods (small clusters) knows every pod, slices or not.
    let c = start(2, &["--watch-pods"]);
    assert!(identity_of(&c, "10.250.2.5").is_some() && identity_of(&c, "10.250.0.5").is_some());
    assert_eq!(
        c.cli_json(&["status"])["remote_pods"]["remote_pods_from"],
        "Pod"
    );
    // It still writes its own node's slice: now node-1's agent knows ghost too.
    eventually("node-3's slice reaches node-1's agent", || {
        identity_of(&a, "10.250.2.5").is_some()
    });
    drop(c);

    // A label change travels through the slice.
    let mut moved = remote_pod("web-0", "node-1", "api", "10.250.0.5");
    moved["metadata"]["labels"]["tier"] = json!("front");
    server.apply_json(moved).expect("relabel");
    eventually("node-2's agent sees web-0's new labels", || {
        labels_of(&b, "10.250.0.5").is_some_and(|l| {
            l.contains(&"k8s:app=api".to_string()) && l.contains(&"k8s:tier=front".to_string())
        })
    });

    // A malformed slice is reported; its last good version and the other slices stay.
    let good = json!({"apiVersion": "ciliate.io/v1alpha1", "kind": "CiliateEndpointSlice",
        "metadata": {"name": "node-9.0", "labels": {"ciliate.io/node": "node-9"}},
        "spec": {"node": "node-9", "profiles": [{"namespace": "x", "labels": {"app": "z"}}],
                 "endpoints": [{"name": "z-0", "ips": ["10.250.9.5"], "profile": 0}]}});
    server.apply_json(good.clone()).expect("slice");
    eventually("node-2's agent knows z-0", || {
        identity_of(&b, "10.250.9.5").is_some()
    });
    let mut bad = good.clone();
    bad["spec"]["endpoints"][0]["profile"] = json!(7);
    bad["spec"]["endpoints"][0]["ips"] = json!(["10.250.9.6"]);
    server.apply_json(bad).expect("bad slice");
    eventually("the bad slice is reported by field", || {
        b.log().contains("node-9.0") && b.log().contains("spec.endpoints[0].profile")
    });
    assert!(
        identity_of(&b, "10.250.9.5").is_some(),
        "last good version kept"
    );
    assert_eq!(identity_of(&b, "10.250.9.6"), None);
    assert!(identity_of(&b, "10.250.0.5").is_some());
    // A value of the wrong type arrives in the same watch stream: reported by field, the
    // stream goes on (the next good version is applied).
    let mut wrong_type = good.clone();
    wrong_type["spec"]["endpoints"][0]["ips"] = json!(["10.250.9.7", 7]);
    server.apply_json(wrong_type).expect("ill-typed slice");
    eventually("the ill-typed slice is reported by field", || {
        b.log()
            .contains("spec.endpoints[0].ips[1]: expected a string, found a number")
    });
    assert!(
        identity_of(&b, "10.250.9.5").is_some(),
        "last good version kept"
    );
    assert_eq!(identity_of(&b, "10.250.9.7"), None);
    let mut fixed = good.clone();
    fixed["spec"]["endpoints"][0]["ips"] = json!(["10.250.9.8"]);
    server.apply_json(fixed).expect("fixed slice");
    eventually("the watch goes on: the fixed slice is applied", || {
        identity_of(&b, "10.250.9.8").is_some() && identity_of(&b, "10.250.9.5").is_none()
    });
    // Its node's Node object gone and the slice with it (the API server's garbage collector
    // would delete it): z-0 goes.
    server
        .delete_object(
            "ciliate.io/v1alpha1",
            "CiliateEndpointSlice",
            "",
            "node-9.0",
        )
        .expect("delete slice");
    eventually("z-0 gone with its slice", || {
        identity_of(&b, "10.250.9.8").is_none()
    });

    // A pod listed by two nodes' slices (a StatefulSet pod recreated on node-7 while node-8's
    // agent is gone): the slice that listed it last owns it; the stale one's deletion does not
    // take it away.
    let slice = |node: &str, ip: &str| {
        json!({"apiVersion": "ciliate.io/v1alpha1", "kind": "CiliateEndpointSlice",
            "metadata": {"name": format!("{node}.0"), "labels": {"ciliate.io/node": node}},
            "spec": {"node": node, "profiles": [{"namespace": "x", "labels": {"app": "st"}}],
                     "endpoints": [{"name": "st-0", "ips": [ip], "profile": 0}]}})
    };
    server
        .apply_json(slice("node-8", "10.250.8.5"))
        .expect("slice");
    eventually("st-0 at its old address", || {
        identity_of(&b, "10.250.8.5").is_some()
    });
    server
        .apply_json(slice("node-7", "10.250.7.5"))
        .expect("slice");
    eventually("st-0 at its new address", || {
        identity_of(&b, "10.250.7.5").is_some() && identity_of(&b, "10.250.8.5").is_none()
    });
    server
        .delete_object(
            "ciliate.io/v1alpha1",
            "CiliateEndpointSlice",
            "",
            "node-8.0",
        )
        .expect("delete the stale slice");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        identity_of(&b, "10.250.7.5").is_some(),
        "the stale slice's deletion took st-0 away"
    );

    // A restarted agent adopts its node's slice: nothing is rewritten.
    let rv = slices_of(&kubectl, "node-1")[0]["metadata"]["resourceVersion"].clone();
    a.stop();
    let a2 = start(0, &[]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(
        slices_of(&kubectl, "node-1")[0]["metadata"]["resourceVersion"],
        rv,
        "the restarted agent rewrote an unchanged slice"
    );
    assert_eq!(a2.cli_json(&["status"])["remote_pods"]["slices_written"], 1);

    // The pod goes: its slice is deleted and the other agent forgets its address.
    server
        .delete_object("v1", "Pod", "x", "web-0")
        .expect("delete pod");
    eventually("node-1's slice deleted", || {
        slices_of(&kubectl, "node-1").is_empty()
    });
    eventually("node-2's agent forgot web-0", || {
        identity_of(&b, "10.250.0.5").is_none()
    });
}

/// A CiliateEndpointSlice as another node's agent (or anyone who can write one) would write it.
fn slice_json(name: &str, label: &str, node: &str, app: &str, eps: &[(&str, &str)]) -> Value {
    let endpoints: Vec<Value> = eps
        .iter()
        .map(|(n, ip)| json!({"name": n, "ips": [ip], "profile": 0}))
        .collect();
    json!({"apiVersion": "ciliate.io/v1alpha1", "kind": "CiliateEndpointSlice",
        "metadata": {"name": name, "labels": {"ciliate.io/node": label}},
        "spec": {"node": node, "profiles": [{"namespace": "x", "labels": {"app": app}}],
                 "endpoints": endpoints}})
}

/// Security (#26, defects 1 and 2): a slice from another node (or from anyone who can write
/// one) never re-labels this node's pods: `x/a`'s address keeps `x/a`'s identity, so `b`'s
/// policy (port 22 from `app=admin` only) still drops `a` on real traffic, before and after the
/// slice goes. A slice speaks only for pods of the node it names, in that node's pod CIDRs and
/// outside this node's; node addresses and special addresses are never pod addresses. Each
/// refusal is reported by field and counted.
#[test]
fn another_nodes_slice_never_relabels_a_local_pod_nor_claims_node_or_special_addresses() {
    let Some(w) = privileged_two_pods(&[22]) else {
        return;
    };
    let (a, b) = (&w.pods[0], &w.pods[1]);
    let (a_ip, b_ip) = (a.addr.to_string(), b.addr.to_string());
    let (server, tmp, kubectl) = api_server();
    seed_cluster(
        &server,
        &kubectl,
        &[pod("a", "a", &a_ip), pod("b", "b", &b_ip)],
    );
    server
        .apply_json(
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-2"},
            "spec": {"podCIDRs": ["10.250.8.0/24"]},
            "status": {"addresses": [{"type": "InternalIP", "address": "172.31.7.3"}]}}),
        )
        .expect("node-2");
    let pins = w.pins.to_string_lossy().to_string();
    let agent = Agent::start_kubernetes(
        tmp.path(),
        &kubectl.kubeconfig,
        &["--datapath", "bpf", "--bpf-root", &pins],
    );
    add_endpoint(&agent, "x/a", &a_ip, Some(&a.host_if));
    add_endpoint(&agent, "x/b", &b_ip, Some(&b.host_if));
    kubectl.apply(&allow_port("b-from-admin", "b", "admin", 22));
    eventually("b:22 is closed to a", || !tcp_ok(&a.netns, b.addr, 22));
    let id_a = identity_of(&agent, &a_ip).expect("a's identity");

    // node-3's slice (no Node object, so no pod CIDR to check it against): a's address under
    // a pod labelled app=admin, next to a pod of its own.
    server
        .apply_json(slice_json(
            "node-3.1",
            "node-3",
            "node-3",
            "admin",
            &[("evil", &a_ip), ("own", "10.250.3.9")],
        ))
        .expect("slice");
    // node-2's: an address in this node's pod CIDR, one outside node-2's, one pod of its own.
    server
        .apply_json(slice_json(
            "node-2.0",
            "node-2",
            "node-2",
            "admin",
            &[
                ("in-my-cidr", "10.250.7.99"),
                ("out-of-theirs", "10.250.9.9"),
                ("ok", "10.250.8.7"),
            ],
        ))
        .expect("slice");
    eventually("node-2's and node-3's own pods are known", || {
        identity_of(&agent, "10.250.8.7").is_some() && identity_of(&agent, "10.250.3.9").is_some()
    });
    assert_eq!(identity_of(&agent, &a_ip), Some(id_a), "a was re-labelled");
    assert!(labels_of(&agent, &a_ip).is_some_and(|l| l.contains(&"k8s:app=a".to_string())));
    for _ in 0..3 {
        assert!(!tcp_ok(&a.netns, b.addr, 22), "a reached b:22 as admin");
    }
    assert_eq!(identity_of(&agent, "10.250.7.99"), None);
    assert_eq!(identity_of(&agent, "10.250.9.9"), None);
    let log = agent.log();
    for want in [
        format!("pod x/evil on node node-3: address {a_ip} is held by "),
        "x/a, which outranks it; not taken".to_string(),
        "pod x/in-my-cidr on node node-2: address 10.250.7.99 is in this node's (node-1) pod CIDR 10.250.7.0/24".to_string(),
        "pod x/out-of-theirs on node node-2: address 10.250.9.9 is outside node node-2's pod CIDRs (10.250.8.0/24)".to_string(),
    ] {
        assert!(log.contains(&want), "not reported: {want}\n{log}");
    }
    let (_, metrics) = agent.http_get("/metrics");
    let conflicts = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ciliate_address_conflicts_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .expect("ciliate_address_conflicts_total");
    assert!(conflicts >= 3.0, "{metrics}");

    // Deleting the slice leaves a as it is (its own claim never went away).
    server
        .delete_object(
            "ciliate.io/v1alpha1",
            "CiliateEndpointSlice",
            "",
            "node-3.1",
        )
        .expect("delete slice");
    eventually("node-3's pod gone with the slice", || {
        identity_of(&agent, "10.250.3.9").is_none()
    });
    assert_eq!(identity_of(&agent, &a_ip), Some(id_a));
    assert!(!tcp_ok(&a.netns, b.addr, 22));

    // Node addresses stay the node's (node-3 has no Node object, so no pod CIDR to check):
    // this node's InternalIP stays host (1), node-2's stays remote-node (6).
    server
        .apply_json(slice_json(
            "node-3.0",
            "node-3",
            "node-3",
            "admin",
            &[
                ("n1", "172.31.7.2"),
                ("n2", "172.31.7.3"),
                ("fine", "10.250.3.3"),
            ],
        ))
        .expect("slice");
    eventually("node-3's own pod is known", || {
        identity_of(&agent, "10.250.3.3").is_some()
    });
    assert_eq!(identity_of(&agent, "172.31.7.2"), Some(1), "host moved");
    assert_eq!(
        identity_of(&agent, "172.31.7.3"),
        Some(6),
        "remote-node moved"
    );
    assert!(agent
        .log()
        .contains("pod x/n1 on node node-3: address 172.31.7.2 is held by node node-1"));

    // Special addresses refuse the whole slice by field; its last good version stays.
    for (i, special) in ["0.0.0.0", "255.255.255.255", "::", "127.0.0.1", "224.0.0.5"]
        .iter()
        .enumerate()
    {
        server
            .apply_json(slice_json(
                "node-3.0",
                "node-3",
                "node-3",
                "admin",
                &[("fine", "10.250.3.3"), ("bad", special)],
            ))
            .expect("slice");
        let want = format!("spec.endpoints[1].ips[0]: \"{special}\" is");
        eventually(&format!("{special} reported by field ({i})"), || {
            agent.log().contains(&want)
        });
        assert!(
            identity_of(&agent, special).is_none(),
            "{special} in the ipcache"
        );
        assert!(identity_of(&agent, "10.250.3.3").is_some());
    }

    // A slice whose label, name and spec.node disagree is refused whole.
    server
        .apply_json(slice_json(
            "node-4.0",
            "node-4",
            "node-5",
            "admin",
            &[("liar", "10.250.5.5")],
        ))
        .expect("slice");
    eventually("the label mismatch is reported", || {
        agent.log().contains(
            "metadata.labels[ciliate.io/node]: \"node-4\" does not match spec.node \"node-5\"",
        )
    });
    assert_eq!(identity_of(&agent, "10.250.5.5"), None);
    server
        .apply_json(slice_json(
            "node-4.0",
            "node-5",
            "node-5",
            "admin",
            &[("liar", "10.250.5.5")],
        ))
        .expect("slice");
    eventually("the name mismatch is reported", || {
        agent
            .log()
            .contains("metadata.name: \"node-4.0\" is not <spec.node>.<n>")
    });
    assert_eq!(identity_of(&agent, "10.250.5.5"), None);
}
