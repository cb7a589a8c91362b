//! L7 HTTP policy on real connections (issue #27): pods as network namespaces, hyper servers
//! and clients inside them, the agent with the BPF datapath and the HTTP proxy it starts.
//! Privileged: with CI=true these tests must run.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::agent::Agent;
use common::http::{serve, Conn};
use common::netns::{ip_out, privileged, world, World};

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

/// The server's established connections on 8080, by the client's address.
fn server_conns(s: &Setup) -> Vec<String> {
    ip_out(&[
        "netns",
        "exec",
        &s.w.pods[2].netns,
        "ss",
        "-Htn",
        "state",
        "established",
        "( sport = :8080 )",
    ])
    .lines()
    .filter_map(|l| l.split_whitespace().last().map(str::to_string))
    .collect()
}

#[test]
fn idle_client_connections_are_parked_and_hold_no_upstream_connection() {
    let Some(s) = setup(ECHO_POLICY) else { return };
    let client = s.w.pods[0].addr;
    // 40 kept client connections, one request each, one after the other.
    let mut conns: Vec<Conn> = (0..40).map(|_| s.conn(0)).collect();
    for c in &mut conns {
        let r = c
            .request("GET", "/public", &[])
            .unwrap_or_else(|e| panic!("{e}: {}", s.why()));
        assert_eq!(r.status, 200, "{r:?}");
    }
    let upstream = server_conns(&s);
    assert!(
        !upstream.is_empty() && upstream.len() <= 2,
        "40 idle client connections, one request each in turn, share the upstream: the server has {upstream:?}"
    );
    assert!(
        upstream
            .iter()
            .all(|peer| peer.starts_with(&format!("{client}:"))),
        "made as the client: {upstream:?}"
    );
    // Idle for longer than a second, they are parked: no HTTP state held.
    s.agent.wait_until("40 client connections parked", || {
        s.agent.json("/debug/http")["proxy"]["holds"]["parked"].as_u64() >= Some(40)
    });
    // Each idle connection serves on, judged as before; the server still sees the client.
    for c in &mut conns {
        let r = c.request("GET", "/public", &[]).unwrap();
        assert!(
            r.body.starts_with(&format!("GET /public from={client}")),
            "{r:?}"
        );
        assert_eq!(c.request("GET", "/private", &[]).unwrap().status, 403);
    }
    // Requests at once take as many upstream connections as they need, then share them again.
    let threads: Vec<_> = conns
        .into_iter()
        .take(8)
        .map(|mut c| {
            std::thread::spawn(move || {
                for _ in 0..50 {
                    assert_eq!(c.request("GET", "/public", &[]).unwrap().status, 200);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let after = server_conns(&s);
    assert!(
        after.len() <= 8,
        "at most one per concurrent request: {after:?}"
    );
    let holds = &s.agent.json("/debug/http")["proxy"]["holds"];
    assert_eq!(holds["connections"], 40, "{holds}");
}

/// client2 (`other: client`) may only POST /public and /private on echo (the connectivity
/// suite's `client-egress-l7-http-method`, written here by hand).
const CLIENT_EGRESS: &str = "apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: client-egress, namespace: x}
spec:
  endpointSelector: {matchLabels: {other: client}}
  egress:
    - toEndpoints: [{matchLabels: {kind: echo}}]
      toPorts:
        - ports: [{port: '8080', protocol: TCP}]
          rules:
            http:
              - {method: POST, path: '/public$'}
              - {method: POST, path: '/private$'}
";

#[test]
fn egress_and_ingress_http_rules_both_judge_a_request_and_name_their_rules() {
    let both = format!("{ECHO_POLICY}---\n{CLIENT_EGRESS}");
    let Some(s) = setup(&both) else { return };
    let mut c = s.conn(0);
    // Egress allows POST only, ingress GET only: nothing passes both.
    let r = c
        .request("POST", "/public", &[("Content-Length", "0")])
        .unwrap_or_else(|e| panic!("{e}: {}", s.why()));
    assert_eq!(r.status, 403, "ingress denies POST: {r:?}");
    let r = c.request("GET", "/public", &[]).unwrap();
    assert_eq!(r.status, 403, "egress denies GET");
    // Without the ingress policy, egress alone decides.
    std::fs::write(s.agent.manifests().join("policy.yaml"), CLIENT_EGRESS).unwrap();
    let rev = s.agent.revision();
    s.agent
        .wait_until("the edit applies", || s.agent.revision() > rev);
    s.agent.wait_realized(s.agent.revision());
    // Realized includes the proxy: it judges by the agent's newest table already (it answered
    // the table's generation before the endpoint reported the revision realized).
    let sync = &s.agent.json("/debug/http")["rules_sync"];
    assert_eq!(sync["answering"], true, "{sync}");
    assert_eq!(sync["applied"], sync["generation"], "{sync}");
    // The same connection: the edit applies to its next request.
    c.send_raw(b"POST /public HTTP/1.1\r\nHost: echo\r\nContent-Length: 3\r\n\r\nabc")
        .unwrap();
    let r = c.response().unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        r.body.contains("body=3"),
        "the body went through: {}",
        r.body
    );
    let r = c.request("GET", "/public", &[]).unwrap();
    assert_eq!(r.status, 403);
    // The flows name the deciding rules, with the HTTP rule that matched.
    s.agent.wait_until("l7 flows are recorded", || {
        let f = s.agent.json("/debug/http")["flows"].clone();
        let f = f.as_array().cloned().unwrap_or_default();
        let forwarded = f.iter().any(|e| {
            e["verdict"] == "forwarded"
                && e["direction"] == "egress"
                && e["http"]["method"] == "POST"
                && e["http"]["code"] == 200
                && e["policies"][0]["name"] == "client-egress"
                && e["policies"][0]["http"] == 0
                && e["source_pod"] == "x/client"
                && e["destination_pod"] == "x/echo"
        });
        let dropped = f.iter().any(|e| {
            e["verdict"] == "dropped" && e["http"]["method"] == "GET" && e["http"]["code"] == 403
        });
        forwarded && dropped
    });
}

#[test]
fn http2_streams_are_judged_each_on_its_own() {
    let Some(s) = setup(ECHO_POLICY) else { return };
    let got = common::http::h2_requests(
        &s.w.pods[0].netns,
        s.echo(),
        vec![
            ("GET", "/public".into()),
            ("GET", "/private".into()),
            ("POST", "/".into()),
            ("GET", "/".into()),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}: {}", s.why()));
    let codes: Vec<u16> = got.iter().map(|(c, _)| *c).collect();
    assert_eq!(codes, [200, 403, 403, 200], "{got:?}");
    assert!(
        got[0].1.starts_with("GET http://") && got[0].1.contains(":8080/public from="),
        "{}",
        got[0].1
    );
    assert_eq!(got[1].1, "Access denied\r\n");
}

#[test]
fn a_websocket_upgrade_is_judged_then_its_bytes_flow() {
    let policy = ECHO_POLICY.replace(
        "- {method: GET, path: '/$'}",
        "- {method: GET, path: '/ws$'}",
    );
    let Some(s) = setup(&policy) else { return };
    let mut c = s.conn(0);
    let r = c
        .request(
            "GET",
            "/ws",
            &[("Connection", "Upgrade"), ("Upgrade", "websocket")],
        )
        .unwrap_or_else(|e| panic!("{e}: {}", s.why()));
    assert_eq!(r.status, 101, "{r:?}");
    use std::io::{Read, Write};
    c.stream().get_mut().write_all(b"frames flow").unwrap();
    let mut buf = [0u8; 11];
    c.stream().read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"frames flow");
    // An upgrade the rules do not allow.
    let mut c = s.conn(0);
    let r = c
        .request(
            "GET",
            "/chat",
            &[("Connection", "Upgrade"), ("Upgrade", "websocket")],
        )
        .unwrap();
    assert_eq!(r.status, 403);
}

/// Parking an idle connection (after a second without a request) loses nothing: an answer the
/// client is slow to read, pipelined requests, an upgrade on a connection that was parked.
#[test]
fn parking_idle_connections_loses_nothing() {
    let policy = ECHO_POLICY
        .replace(
            "- {method: GET, path: '/$'}",
            "- {method: GET, path: '/ws$'}",
        )
        .replace(
            "- ports: [{port: '8080', protocol: TCP}]",
            "- ports: [{port: '8080', protocol: TCP}, {port: '8090', protocol: TCP}]",
        );
    let Some(s) = setup(&policy) else { return };
    const BIG: usize = 32 << 20;
    common::http::serve_fixed(&s.w.pods[2].netns, s.w.pods[2].addr, 8090, BIG);
    let big = SocketAddr::new(s.w.pods[2].addr, 8090);
    // A client that reads nothing of a 32 MiB answer (more than the sockets buffer) for 2.5 s,
    // then all of it.
    let mut slow = Conn::open(&s.w.pods[0].netns, big).unwrap();
    slow.send_raw(b"GET /public HTTP/1.1\r\nHost: e\r\n\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    let r = slow
        .response()
        .unwrap_or_else(|e| panic!("{e}: {}", s.why()));
    assert_eq!((r.status, r.body.len()), (200, BIG));
    // Two requests in one write, before and after the connection was parked.
    let mut c = s.conn(0);
    for round in 0..2 {
        c.send_raw(
            b"GET /public HTTP/1.1\r\nHost: e\r\n\r\nGET /private HTTP/1.1\r\nHost: e\r\n\r\n",
        )
        .unwrap();
        let (a, b) = (c.response().unwrap(), c.response().unwrap());
        assert_eq!((a.status, b.status), (200, 403), "round {round}");
        std::thread::sleep(Duration::from_millis(1500));
    }
    s.agent.wait_until("the connections parked", || {
        s.agent.json("/debug/http")["proxy"]["holds"]["parked"].as_u64() >= Some(2)
    });
    // The slow client's connection, parked, serves again; then an upgrade on the other.
    let r = slow.request("GET", "/public", &[]).unwrap();
    assert_eq!((r.status, r.body.len()), (200, BIG));
    let r = c
        .request(
            "GET",
            "/ws",
            &[("Connection", "Upgrade"), ("Upgrade", "websocket")],
        )
        .unwrap();
    assert_eq!(r.status, 101, "{r:?}");
    use std::io::{Read, Write};
    c.stream().get_mut().write_all(b"after parking").unwrap();
    let mut buf = [0u8; 13];
    c.stream().read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"after parking");
    // A tunnel is never parked: quiet for longer than a second, its bytes still flow.
    std::thread::sleep(Duration::from_millis(1500));
    c.stream().get_mut().write_all(b"still flowing").unwrap();
    c.stream().read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"still flowing");
}

/// What a hostile pod sends to get around path rules or confuse the server about where a
/// request ends: each is judged as the server will read it, or refused.
#[test]
fn requests_built_to_bypass_the_rules_are_normalised_or_refused() {
    let Some(s) = setup(ECHO_POLICY) else { return };
    let mut c = s.conn(0);
    let send = |c: &mut Conn, raw: &str| {
        c.send_raw(raw.as_bytes()).unwrap();
        c.response()
            .unwrap_or_else(|e| panic!("{raw:?}: {e}: {}", s.why()))
    };
    // Dot-segments, escapes, repeated slashes and the absolute form are normalised, and the
    // server sees what was matched.
    let r = send(
        &mut c,
        "GET /public/../private HTTP/1.1\r\nHost: echo\r\n\r\n",
    );
    assert_eq!(r.status, 403, "/public/../private is /private");
    let r = send(&mut c, "GET /%70ublic HTTP/1.1\r\nHost: echo\r\n\r\n");
    assert_eq!(r.status, 200);
    assert!(
        r.body.starts_with("GET /public "),
        "forwarded as matched: {}",
        r.body
    );
    let r = send(&mut c, "GET //public HTTP/1.1\r\nHost: echo\r\n\r\n");
    assert!(
        r.status == 200 && r.body.starts_with("GET /public "),
        "{r:?}"
    );
    let r = send(
        &mut c,
        "GET http://echo:8080/private HTTP/1.1\r\nHost: echo\r\n\r\n",
    );
    assert_eq!(r.status, 403, "absolute form");
    let r = send(&mut c, "GET /%2e%2e/private HTTP/1.1\r\nHost: echo\r\n\r\n");
    assert_eq!(r.status, 403);
    // Header names in any case.
    let r = send(
        &mut c,
        "GET /private HTTP/1.1\r\nHost: echo\r\nx-VERY-secret-TOKEN: 42\r\n\r\n",
    );
    assert_eq!(r.status, 200, "{r:?}");
    // Ambiguous framing and a second Host: 400 (each on a connection of its own: the proxy
    // may close it).
    for raw in [
        "POST /public HTTP/1.1\r\nHost: echo\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "POST /public HTTP/1.1\r\nHost: echo\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
        "GET /public HTTP/1.1\r\nHost: echo\r\nHost: evil\r\n\r\n",
        "GET /public HTTP/1.1\r\nHost: echo\r\nX-Folded: a\r\n b\r\n\r\n",
    ] {
        let mut c = s.conn(0);
        let r = send(&mut c, raw);
        assert_eq!(r.status, 400, "{raw:?}: {r:?}");
    }
}

#[test]
fn a_grpc_call_the_rules_deny_fails_with_permission_denied_and_the_connection_serves_on() {
    let policy = ECHO_POLICY.replace(
        "- {method: GET, path: '/$'}",
        "- {method: POST, path: '/test.Echo/Say'}",
    );
    let Some(s) = setup(&policy) else { return };
    // The HTTP echo server holds 8080: the gRPC one serves on 8081.
    let to = SocketAddr::new(s.w.pods[2].addr, 8081);
    common::grpc::serve(&s.w.pods[2].netns, to);
    let policy = policy.replace("port: '8080'", "port: '8081'");
    std::fs::write(s.agent.manifests().join("policy.yaml"), policy).unwrap();
    let rev = s.agent.revision();
    s.agent
        .wait_until("the edit applies", || s.agent.revision() > rev);
    s.agent.wait_realized(s.agent.revision());
    let ns = &s.w.pods[0].netns;
    let say = common::grpc::call(ns, to, "Say", "hi", 3);
    assert_eq!(
        say,
        vec![Ok("echo hi".to_string()); 3],
        "allowed calls: {}",
        s.why()
    );
    let admin = common::grpc::call(ns, to, "Admin", "x", 2);
    assert_eq!(admin, vec![Err(tonic::Code::PermissionDenied); 2]);
}

/// A TCP server that answers each connection's first bytes with `got N` and closes.
fn tls_sink(netns: &str, addr: SocketAddr) {
    let (tx, rx) = std::sync::mpsc::channel();
    common::netns::in_netns(netns, move || {
        let l = std::net::TcpListener::bind(addr).expect("bind");
        tx.send(()).unwrap();
        for s in l.incoming().flatten() {
            use std::io::{Read, Write};
            let mut s = s;
            let mut buf = [0u8; 17000];
            if let Ok(n) = s.read(&mut buf) {
                let _ = s.write_all(format!("got {n}").as_bytes());
            }
        }
    });
    rx.recv().unwrap();
}

/// Sends `first` on a new connection from `netns` and returns what came back.
fn first_exchange(netns: &str, to: SocketAddr, first: Vec<u8>) -> String {
    common::netns::in_netns(netns, move || {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(3)) else {
            return "connect failed".to_string();
        };
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let _ = s.write_all(&first);
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    })
    .join()
    .unwrap()
}

#[test]
fn tls_server_names_are_judged_from_the_client_hello() {
    let policy = "apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: tls, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
    - toEndpoints: [{matchLabels: {kind: echo}}]
      toPorts:
        - ports: [{port: '443', protocol: TCP}]
          serverNames: [api.example.com, '*.svc.example']
";
    let Some(s) = setup(policy) else { return };
    let to = SocketAddr::new(s.w.pods[2].addr, 443);
    tls_sink(&s.w.pods[2].netns, to);
    let hello = |n: &str| ciliate::proxy::http::sni::client_hello_for(n);
    let ns = &s.w.pods[0].netns;
    let len = hello("api.example.com").len();
    assert_eq!(
        first_exchange(ns, to, hello("api.example.com")),
        format!("got {len}"),
        "{}",
        s.why()
    );
    assert!(first_exchange(ns, to, hello("a.svc.example")).starts_with("got "));
    assert_eq!(
        first_exchange(ns, to, hello("evil.com")),
        "",
        "closed unseen"
    );
    assert_eq!(
        first_exchange(ns, to, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
        "",
        "not TLS: closed"
    );
}

#[test]
fn without_a_proxy_l7_connections_are_dropped_and_status_says_why() {
    if !privileged() {
        return;
    }
    let w = world(2);
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    let (c, e) = (w.pods[0].addr, w.pods[1].addr);
    std::fs::write(
        m.join("cluster.yaml"),
        format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: x}}
---
apiVersion: v1\nkind: Pod\nmetadata: {{name: client, namespace: x, labels: {{app: client}}}}
status: {{podIPs: [{{ip: {c}}}]}}
---
apiVersion: v1\nkind: Pod\nmetadata: {{name: echo, namespace: x, labels: {{kind: echo}}}}
status: {{podIPs: [{{ip: {e}}}]}}
"
        ),
    )
    .unwrap();
    std::fs::write(m.join("policy.yaml"), ECHO_POLICY).unwrap();
    serve(&w.pods[1].netns, e, 8080);
    serve(&w.pods[1].netns, e, 9090);
    let pins = w.pins.to_string_lossy().to_string();
    let agent = Agent::start_with(
        tmp.path(),
        &[
            "--datapath",
            "bpf",
            "--bpf-root",
            &pins,
            "--http-proxy",
            "disabled",
        ],
    );
    agent.add_endpoint("x/client", c, &w.pods[0].host_if);
    agent.add_endpoint("x/echo", e, &w.pods[1].host_if);
    agent.wait_realized(agent.revision());
    assert!(
        Conn::open(&w.pods[0].netns, SocketAddr::new(e, 8080))
            .and_then(|mut c| c.request("GET", "/public", &[]))
            .is_err(),
        "no proxy: the connection is dropped, not let through unjudged"
    );
    let status = agent.cli_json(&["status"]);
    let why = status["http_proxy"]["error"].as_str().unwrap_or_default();
    assert!(why.contains("disabled"), "{status}");
    assert_eq!(status["http_proxy"]["connected"], false);
    assert_eq!(status["http_proxy"]["endpoints_with_l7_rules"], 1);
    // A drop the monitor names.
    let drops = agent.cli(&[
        "monitor",
        "-o",
        "json",
        "--since",
        "1m",
        "--verdict",
        "dropped",
        "--count",
        "1",
    ]);
    assert!(drops.1.contains("not-realized"), "{drops:?}");
    // Other ports, without L7 rules, are L3/L4 as ever: 9090 is not allowed at all here.
    assert!(Conn::open(&w.pods[0].netns, SocketAddr::new(e, 9090))
        .and_then(|mut c| c.request("GET", "/", &[]))
        .is_err());
}

#[test]
fn monitor_shows_l7_flows_with_hubbles_fields() {
    let Some(s) = setup(ECHO_POLICY) else { return };
    let mut c = s.conn(0);
    assert_eq!(c.request("GET", "/public", &[]).unwrap().status, 200);
    assert_eq!(c.request("DELETE", "/public", &[]).unwrap().status, 403);
    let (code, out, err) = s.agent.cli(&[
        "monitor", "-o", "json", "--type", "l7", "--since", "1m", "--count", "2",
    ]);
    assert_eq!(code, 0, "{err}");
    let flows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(flows.len(), 2, "{out}");
    let (ok, denied) = (&flows[0], &flows[1]);
    assert_eq!(ok["type"], "l7");
    assert_eq!(ok["verdict"], "forwarded");
    assert_eq!(ok["direction"], "ingress");
    assert_eq!(ok["source_pod"], "x/client");
    assert_eq!(ok["destination_pod"], "x/echo");
    assert_eq!(ok["port"], 8080);
    assert_eq!(ok["http"]["method"], "GET");
    assert_eq!(ok["http"]["code"], 200);
    assert_eq!(ok["http"]["protocol"], "HTTP/1.1");
    assert!(ok["http"]["url"].as_str().unwrap().ends_with("/public"));
    assert!(ok["latency_ns"].as_u64().is_some());
    assert_eq!(ok["policies"][0]["name"], "echo");
    assert_eq!(ok["policies"][0]["http"], 1);
    assert_eq!(denied["verdict"], "dropped");
    assert_eq!(denied["http"]["code"], 403);
    // Per-rule hits and metrics.
    let metrics = s.agent.http_get("/metrics").1;
    assert!(
        metrics.contains("ciliate_l7_requests_total{verdict=\"dropped\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("ciliate_l7_proxy_latency_seconds_count 2"));
}

/// Clients sending requests as fast as they get answers, each on a kept connection (a new
/// one every few requests): what went wrong, and how many were answered. A client retries a
/// request once on a fresh connection when its kept one closed before any byte of the answer
/// (RFC 9112 section 9.3.1: an idle connection may close at any time).
struct Load {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<(u64, Vec<String>)>>,
}

impl Load {
    fn start(netns: &str, to: SocketAddr, clients: usize) -> Load {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..clients)
            .map(|i| {
                let (stop, ns) = (stop.clone(), netns.to_string());
                std::thread::spawn(move || {
                    let (mut ok, mut failures) = (0u64, Vec::new());
                    let mut conn: Option<Conn> = None;
                    let mut n = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                        n += 1;
                        // Every 20th request opens a new connection.
                        if n % 20 == (i as u64 % 20) {
                            conn = None;
                        }
                        let attempt = |fresh: bool, conn: &mut Option<Conn>| {
                            if fresh || conn.is_none() {
                                *conn = Some(Conn::open(&ns, to)?);
                            }
                            let c = conn.as_mut().expect("a connection");
                            let r = c.request("GET", "/public", &[]);
                            if r.as_ref()
                                .is_ok_and(|r| r.header("connection") == Some("close"))
                            {
                                *conn = None;
                            }
                            r
                        };
                        let r = match attempt(false, &mut conn) {
                            Err(e)
                                if e.kind() == std::io::ErrorKind::UnexpectedEof
                                    || e.kind() == std::io::ErrorKind::ConnectionReset
                                    || e.kind() == std::io::ErrorKind::BrokenPipe =>
                            {
                                attempt(true, &mut conn)
                            }
                            r => r,
                        };
                        match r {
                            Ok(r) if r.status == 200 => ok += 1,
                            Ok(r) => failures.push(format!("status {}", r.status)),
                            Err(e) => {
                                failures.push(e.to_string());
                                conn = None;
                            }
                        }
                    }
                    (ok, failures)
                })
            })
            .collect();
        Load { stop, threads }
    }

    fn stop(self) -> (u64, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut all = (0, Vec::new());
        for t in self.threads {
            let (ok, f) = t.join().unwrap();
            all.0 += ok;
            all.1.extend(f);
        }
        all
    }
}

#[test]
fn kill_9_of_the_agent_under_load_fails_no_request() {
    let Some(mut s) = setup(ECHO_POLICY) else {
        return;
    };
    let load = Load::start(&s.w.pods[0].netns, s.echo(), 4);
    std::thread::sleep(Duration::from_millis(500));
    let args: Vec<String> = vec![
        "--datapath".into(),
        "bpf".into(),
        "--bpf-root".into(),
        s.w.pins.to_string_lossy().into(),
    ];
    for _ in 0..2 {
        let mut child = s.agent.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(700));
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        s.agent = Agent::start_with(s._tmp.path(), &a);
        s.agent
            .wait_until("ready", || s.agent.http_get("/readyz").0 == 200);
        std::thread::sleep(Duration::from_millis(500));
    }
    let (ok, failures) = load.stop();
    assert!(
        failures.is_empty(),
        "{} of {} failed: {:?}",
        failures.len(),
        ok + failures.len() as u64,
        &failures[..failures.len().min(5)]
    );
    assert!(ok > 200, "{ok} requests answered");
    // Still judged after the restarts.
    assert_eq!(
        s.conn(0).request("GET", "/private", &[]).unwrap().status,
        403
    );
}

#[test]
fn a_new_proxy_takes_over_under_load_without_a_failed_request() {
    let Some(s) = setup(ECHO_POLICY) else { return };
    let old = s.agent.json("/debug/http")["proxy"]["pid"]
        .as_u64()
        .unwrap();
    let load = Load::start(&s.w.pods[0].netns, s.echo(), 4);
    std::thread::sleep(Duration::from_millis(500));
    let state = s._tmp.path().join("state");
    let mut new = std::process::Command::new(common::agent::BIN)
        .args(["http-proxy", "--state-dir"])
        .arg(&state)
        .arg("--bpf-root")
        .arg(&s.w.pins)
        .stderr(std::fs::File::create(s._tmp.path().join("new-proxy.log")).unwrap())
        .spawn()
        .unwrap();
    // The old one hands its listeners over, drains and exits.
    s.agent.wait_until("the old proxy exited", || {
        !std::path::Path::new(&format!("/proc/{old}")).exists()
            || std::fs::read_to_string(format!("/proc/{old}/stat"))
                .is_ok_and(|st| st.contains(") Z"))
    });
    s.agent.wait_until("the agent talks to the new proxy", || {
        s.agent.json("/debug/http")["proxy"]["pid"].as_u64() == Some(new.id() as u64)
    });
    std::thread::sleep(Duration::from_millis(500));
    let (ok, failures) = load.stop();
    assert!(
        failures.is_empty(),
        "{} of {} failed: {:?}\n{}",
        failures.len(),
        ok + failures.len() as u64,
        &failures[..failures.len().min(5)],
        std::fs::read_to_string(s._tmp.path().join("new-proxy.log")).unwrap_or_default()
    );
    assert!(ok > 200, "{ok} requests answered");
    assert_eq!(
        s.conn(0).request("GET", "/private", &[]).unwrap().status,
        403
    );
    let _ = new.kill();
    let _ = new.wait();
}
