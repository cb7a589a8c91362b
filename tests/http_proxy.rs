//! L7 HTTP policy on real connections (issue #27): pods as network namespaces, hyper servers
//! and clients inside them, the agent with the BPF datapath and the HTTP proxy it starts.
//! Privileged: with CI=true these tests must run.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::agent::Agent;
use common::http::{serve, Conn};
use common::netns::{privileged, world, World};

/// Namespace `x`: `client` (app: client, other: client), `stranger` (app: stranger), `echo`
/// (kind: echo) serving HTTP on 8080.
struct Setup {
    w: World,
    _tmp: tempfile::TempDir,
    agent: Agent,
}

const ECHO_POLICY: &str = "apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: echo, namespace: x}
spec:
  endpointSelector: {matchLabels: {kind: echo}}
  ingress:
    - fromEndpoints: [{matchLabels: {app: client}}]
      toPorts:
        - ports: [{port: '8080', protocol: TCP}]
          rules:
            http:
              - {method: GET, path: '/$'}
              - {method: GET, path: '/public$'}
              - {method: GET, path: '/private$', headers: ['X-Very-Secret-Token: 42']}
";

fn setup(policy: &str) -> Option<Setup> {
    if !privileged() {
        return None;
    }
    let w = world(3);
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    let (c, s, e) = (w.pods[0].addr, w.pods[1].addr, w.pods[2].addr);
    std::fs::write(
        m.join("cluster.yaml"),
        format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: x}}
---
apiVersion: v1\nkind: Pod\nmetadata: {{name: client, namespace: x, labels: {{app: client, other: client}}}}
status: {{podIPs: [{{ip: {c}}}]}}
---
apiVersion: v1\nkind: Pod\nmetadata: {{name: stranger, namespace: x, labels: {{app: stranger}}}}
status: {{podIPs: [{{ip: {s}}}]}}
---
apiVersion: v1\nkind: Pod\nmetadata: {{name: echo, namespace: x, labels: {{kind: echo}}}}
spec: {{containers: [{{name: echo, ports: [{{name: http-8080, containerPort: 8080, protocol: TCP}}]}}]}}
status: {{podIPs: [{{ip: {e}}}]}}
"
        ),
    )
    .unwrap();
    std::fs::write(m.join("policy.yaml"), policy).unwrap();
    serve(&w.pods[2].netns, e, 8080);
    let pins = w.pins.to_string_lossy().to_string();
    let agent = Agent::start_with(tmp.path(), &["--datapath", "bpf", "--bpf-root", &pins]);
    for (name, p) in [("x/client", 0), ("x/stranger", 1), ("x/echo", 2)] {
        agent.add_endpoint(name, w.pods[p].addr, &w.pods[p].host_if);
    }
    agent.wait_realized(agent.revision());
    agent.wait_until("the HTTP proxy is connected", || {
        agent.json("/debug/http")["proxy"]["connected"] == true
    });
    Some(Setup {
        w,
        _tmp: tmp,
        agent,
    })
}

impl Setup {
    /// What to look at when a request goes wrong.
    fn why(&self) -> String {
        if std::env::var_os("CILIATE_TEST_HOLD").is_some() {
            eprintln!(
                "holding: pods {:?}, state {}",
                self.w
                    .pods
                    .iter()
                    .map(|p| (&p.netns, &p.host_if, p.addr))
                    .collect::<Vec<_>>(),
                self._tmp.path().display()
            );
            std::thread::sleep(Duration::from_secs(600));
        }
        let proxy_log = std::fs::read_to_string(self._tmp.path().join("state/http-proxy.log"))
            .unwrap_or_default();
        format!(
            "/debug/http: {}\nproxy log:\n{proxy_log}\nagent log (tail):\n{}",
            self.agent.json("/debug/http"),
            self.agent
                .log()
                .lines()
                .rev()
                .take(30)
                .collect::<Vec<_>>()
                .join("\n")
        )
    }

    fn echo(&self) -> SocketAddr {
        SocketAddr::new(self.w.pods[2].addr, 8080)
    }
    fn conn(&self, from: usize) -> Conn {
        Conn::open(&self.w.pods[from].netns, self.echo()).expect("connect")
    }
}

#[test]
fn ingress_http_rules_judge_each_request_on_a_kept_connection() {
    let Some(s) = setup(ECHO_POLICY) else { return };
    let client = s.w.pods[0].addr;
    let mut c = s.conn(0);
    let r = c
        .request("GET", "/public", &[])
        .unwrap_or_else(|e| panic!("{e}: {}", s.why()));
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        r.body.starts_with(&format!("GET /public from={client}")),
        "the server sees the client's own address: {}",
        r.body
    );
    let r = c.request("GET", "/private", &[]).unwrap();
    assert_eq!((r.status, r.body.as_str()), (403, "Access denied\r\n"));
    let r = c
        .request("GET", "/private", &[("X-Very-Secret-Token", "42")])
        .unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let r = c.request("POST", "/public", &[]).unwrap();
    assert_eq!(r.status, 403);
    let r = c.request("GET", "/", &[]).unwrap();
    assert_eq!(r.status, 200, "the connection still serves: {r:?}");
    // Another pod: L3/L4 already denies it (no connection).
    assert!(Conn::open(&s.w.pods[1].netns, s.echo())
        .and_then(|mut c| c.request("GET", "/", &[]))
        .is_err());
    let _ = Duration::from_secs(0);
}
