//! Helpers shared by the integration tests (each test binary uses a part of them).
#![allow(dead_code)]

pub mod agent;
pub mod cluster;
pub mod cni;
pub mod grpc;
pub mod http;
pub mod netns;

#[allow(unused_imports)]
pub use agent::http_reply;
#[allow(unused_imports)]
pub use netns::available;

/// Polls `f` every 100 ms for up to 20 s; panics naming `what` when it never holds.
pub fn eventually(what: &str, f: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while std::time::Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("timed out waiting until {what}");
}

/// Namespace `x` and its pods as manifests: each `(name, app, ip)` gets the label `app: <app>`
/// and, with an address, `status.podIPs` (without one the CNI plugin gives the address).
pub fn namespace_x(pods: &[(&str, &str, Option<&str>)]) -> String {
    let mut out = "apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n".to_string();
    for (name, app, ip) in pods {
        out.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: x, labels: {{app: {app}}}}}\n"
        ));
        if let Some(ip) = ip {
            out.push_str(&format!("status: {{podIPs: [{{ip: {ip}}}]}}\n"));
        }
    }
    out
}

/// Namespace `x` with a DNS server pod `dns` (`k8s-app: kube-dns`) at `dns` and client pods
/// (`app: client`), for the DNS-aware policy tests and bench.
pub fn namespace_x_dns(dns: &str, clients: &[(&str, &str)]) -> String {
    let mut out = format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: x}}\n---
apiVersion: v1\nkind: Pod\nmetadata: {{name: dns, namespace: x, labels: {{k8s-app: kube-dns}}}}
status: {{podIPs: [{{ip: {dns}}}]}}\n"
    );
    for (name, ip) in clients {
        out.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: x, labels: {{app: client}}}}\nstatus: {{podIPs: [{{ip: {ip}}}]}}\n"
        ));
    }
    out
}

/// A CiliumNetworkPolicy `x/NAME` for `app: client`: DNS to kube-dns allowed for
/// `*.example.com`, and `toFQDNs: [SELECTOR]` on TCP 443.
pub fn dns_client_policy(name: &str, fqdn_selector: &str) -> String {
    format!(
        "apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {{name: {name}, namespace: x}}
spec:
  endpointSelector: {{matchLabels: {{app: client}}}}
  egress:
    - toEndpoints: [{{matchLabels: {{k8s-app: kube-dns}}}}]
      toPorts:
        - ports: [{{port: '53', protocol: ANY}}]
          rules: {{dns: [{{matchPattern: '*.example.com'}}]}}
    - toFQDNs: [{fqdn_selector}]
      toPorts: [{{ports: [{{port: '443', protocol: TCP}}]}}]
"
    )
}

/// Namespace `x` and its pods as manifests: each `(name, ip)` gets the label `app: <name>`.
pub fn namespace_x_with_pods(pods: &[(&str, &str)]) -> String {
    let pods: Vec<_> = pods.iter().map(|(n, ip)| (*n, *n, Some(*ip))).collect();
    namespace_x(&pods)
}

/// Asserts that two `/debug/endpoints` listings hold the same endpoints with the same ids,
/// identities, addresses, interfaces and containers (a restart restored them as they were).
pub fn assert_same_endpoints(before: &serde_json::Value, after: &serde_json::Value) {
    let fields = ["id", "identity", "ips", "interface", "container_id"];
    let pick = |e: &serde_json::Value| fields.map(|f| e[f].clone());
    let list = |v: &serde_json::Value| -> Vec<_> {
        v.as_array()
            .expect("a list of endpoints")
            .iter()
            .map(pick)
            .collect()
    };
    assert_eq!(
        list(before),
        list(after),
        "the endpoints changed across the restart"
    );
}

/// A kube-rs client through the kubeconfig the test API server writes (the path users take).
pub async fn kube_client(
    server: &ciliate_test_apiserver::TestApiServer,
    dir: &std::path::Path,
) -> kube::Client {
    use kube::config::{KubeConfigOptions, Kubeconfig};
    let path = dir.join("kubeconfig");
    server.kubeconfig(&path).expect("write kubeconfig");
    let kubeconfig = Kubeconfig::read_from(&path).expect("read kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("kubeconfig accepted");
    kube::Client::try_from(config).expect("client")
}

/// Every `.yaml`/`.yml` file below `dir`, depth first.
pub fn yaml_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            out.push(p);
        }
    }
}

/// Waits for a child to exit (killing it after `limit`) and returns its stdout.
pub fn wait_output(mut child: std::process::Child, limit: std::time::Duration) -> String {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// An AdminNetworkPolicy (v1alpha1) on the ingress of pods `app: b` from pods `app: a` on TCP
/// `port`, one rule (`NAME-rule`) with `action` (Allow, Deny, Pass) at `priority`.
pub fn anp_b_from_a(name: &str, priority: u32, action: &str, port: u16) -> String {
    format!(
        "apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {{name: {name}}}
spec:
  priority: {priority}
  subject: {{pods: {{namespaceSelector: {{}}, podSelector: {{matchLabels: {{app: b}}}}}}}}
  ingress:
    - name: {name}-rule
      action: {action}
      from: [{{pods: {{namespaceSelector: {{}}, podSelector: {{matchLabels: {{app: a}}}}}}}}]
      ports: [{{portNumber: {{protocol: TCP, port: {port}}}}}]
"
    )
}
