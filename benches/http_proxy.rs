//! The HTTP proxy's cost (issue #27), a bench binary: `sudo cargo bench --bench http_proxy`.
//!
//! Pods as network namespaces (as in `tests/http_proxy.rs`): `client` and `server`, the agent
//! with the BPF datapath and the HTTP proxy it starts. The server answers every request with
//! 1 KiB on two ports: 8080, which an ingress HTTP rule covers (every request goes through the
//! proxy), and 9090, allowed at L3/L4 only (straight to the server). The same client threads,
//! server and cores serve both, measured in one run.
//!
//! 1. Added latency: `CONNS` kept connections, each sending GETs paced so that all of them
//!    together make `RATE` requests/s, for `SECONDS`, through the proxy and straight,
//!    alternating `ROUNDS` times; each request's time from its send to its last byte. Reported:
//!    p50 and p99 of both, and their difference (goal: p50 <= 50 us, p99 <= 500 us).
//! 2. Highest rate: as many requests as `RATE_CONNS` connections answer (closed loop), for
//!    `SECONDS`, through the proxy and straight, alternating `ROUNDS` times: the ratio of the
//!    medians (goal >= 0.5), and the CPU time the proxy and the agent spent per proxied
//!    request (steadier than the rates, for A/B comparisons).
//! 3. Idle connections: `IDLE` connections through the proxy, each after one request: the
//!    proxy's RSS before and after (goal <= 150 MiB).
//! 4. Many rules: 1,000 path regexes on one port (in process, the proxy's own matcher): the
//!    time to judge a request that matches the last one and one that matches none.
//! 5. Policy edit to the next request judged by it: the rule is switched between allowing and
//!    denying `/edit`, `EDITS` times; from the agent's revision moving (the edit accepted) to
//!    the first request of a kept connection judged by the new rule (goal p99 <= 50 ms).
//!
//! Environment: `CILIATE_BENCH_HTTP_PART=N` runs only part N; `CILIATE_BENCH_HTTP_IDLE=N`;
//! `CILIATE_BENCH_HTTP_SIDE=egress` puts the HTTP rule at the client's egress.

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::agent::Agent;
use common::http::{serve_fixed, Conn};
use common::netns::{in_netns, world};

const CONNS: usize = 8;
/// Connections of the closed loop: enough that the cores, not the round trips, set the rate.
const RATE_CONNS: usize = 32;
const RATE: f64 = 5000.0;
const SECONDS: f64 = 2.0;

/// `CILIATE_BENCH_HTTP_SECONDS` lengthens part 2's rounds (to profile one of them).
fn rate_seconds() -> f64 {
    std::env::var("CILIATE_BENCH_HTTP_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(SECONDS)
}
const ROUNDS: usize = 3;
const EDITS: usize = 40;

fn part(n: u32) -> bool {
    std::env::var("CILIATE_BENCH_HTTP_PART").map_or(true, |p| p == n.to_string())
}

/// Where the HTTP rule sits: the server's ingress (default) or, with
/// `CILIATE_BENCH_HTTP_SIDE=egress`, the client's egress.
fn egress_side() -> bool {
    std::env::var("CILIATE_BENCH_HTTP_SIDE").is_ok_and(|s| s == "egress")
}

fn policy(edit: bool) -> String {
    let verb = if edit { "GET" } else { "POST" };
    let (subject, dir, peer, other) = if egress_side() {
        ("client", "egress", "toEndpoints", "server")
    } else {
        ("server", "ingress", "fromEndpoints", "client")
    };
    format!(
        "apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {{name: l7, namespace: x}}
spec:
  endpointSelector: {{matchLabels: {{app: {subject}}}}}
  {dir}:
    - {peer}: [{{matchLabels: {{app: {other}}}}}]
      toPorts:
        - ports: [{{port: '8080', protocol: TCP}}]
          rules:
            http:
              - {{method: GET, path: '/x'}}
              - {{method: {verb}, path: '/edit'}}
    - {peer}: [{{matchLabels: {{app: {other}}}}}]
      toPorts:
        - ports: [{{port: '9090', protocol: TCP}}]
"
    )
}

fn percentile(v: &mut [u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// Paced GETs over `CONNS` kept connections for `secs`: each request's latency (ns).
fn paced(netns: &str, to: SocketAddr, rate: f64, secs: f64) -> Vec<u64> {
    let per_conn = rate / CONNS as f64;
    let threads: Vec<_> = (0..CONNS)
        .map(|i| {
            let ns = netns.to_string();
            std::thread::spawn(move || {
                let mut c = Conn::open(&ns, to).expect("connect");
                let gap = Duration::from_secs_f64(1.0 / per_conn);
                let start = Instant::now() + gap.mul_f64(i as f64 / CONNS as f64);
                let mut out = Vec::new();
                let mut next = start;
                while next.duration_since(start).as_secs_f64() < secs {
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    }
                    let t = Instant::now();
                    let r = c.request("GET", "/x", &[]).expect("request");
                    assert_eq!(r.status, 200);
                    out.push(t.elapsed().as_nanos() as u64);
                    next += gap;
                }
                out
            })
        })
        .collect();
    threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect()
}

/// Closed loop over `conns` connections for `secs`: requests answered per second.
fn closed(netns: &str, to: SocketAddr, conns: usize, secs: f64) -> f64 {
    let threads: Vec<_> = (0..conns)
        .map(|_| {
            let ns = netns.to_string();
            std::thread::spawn(move || {
                let mut c = Conn::open(&ns, to).expect("connect");
                let t = Instant::now();
                let mut n = 0u64;
                while t.elapsed().as_secs_f64() < secs {
                    assert_eq!(c.request("GET", "/x", &[]).expect("request").status, 200);
                    n += 1;
                }
                n
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).sum::<u64>() as f64 / secs
}

/// CPU time a process's threads have run, in ns (`/proc/PID/task/*/schedstat`).
fn cpu_ns(pid: u64) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| {
            s.split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum()
}

fn rss_kib(pid: u64) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("http_proxy bench: needs root (network namespaces, BPF); skipped");
        return;
    }
    let _ =
        nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, 65536, 65536);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if part(4) {
        many_rules();
    }
    if !(part(1) || part(2) || part(3) || part(5)) {
        return;
    }
    let w = world(2);
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    let (c, s) = (w.pods[0].addr, w.pods[1].addr);
    std::fs::write(
        m.join("cluster.yaml"),
        format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: x}}
---
apiVersion: v1\nkind: Pod\nmetadata: {{name: client, namespace: x, labels: {{app: client}}}}
status: {{podIPs: [{{ip: {c}}}]}}
---
apiVersion: v1\nkind: Pod\nmetadata: {{name: server, namespace: x, labels: {{app: server}}}}
status: {{podIPs: [{{ip: {s}}}]}}
"
        ),
    )
    .unwrap();
    std::fs::write(m.join("policy.yaml"), policy(true)).unwrap();
    for port in [8080, 9090] {
        serve_fixed(&w.pods[1].netns, s, port, 1024);
    }
    let pins = w.pins.to_string_lossy().to_string();
    let agent = Agent::start_with(tmp.path(), &["--datapath", "bpf", "--bpf-root", &pins]);
    agent.add_endpoint("x/client", c, &w.pods[0].host_if);
    agent.add_endpoint("x/server", s, &w.pods[1].host_if);
    agent.wait_realized(agent.revision());
    agent.wait_until("the HTTP proxy is connected", || {
        agent.json("/debug/http")["proxy"]["connected"] == true
    });
    let proxy_pid = agent.json("/debug/http")["proxy"]["pid"].as_u64().unwrap();
    let ns = &w.pods[0].netns;
    let (proxied, direct) = (SocketAddr::new(s, 8080), SocketAddr::new(s, 9090));
    let side = if egress_side() {
        "the client's egress"
    } else {
        "the server's ingress"
    };
    println!("machine: {cores} cores; 1 KiB responses; the HTTP rule at {side}");
    // Warm up both paths.
    let _ = paced(ns, proxied, 1000.0, 0.3);
    let _ = paced(ns, direct, 1000.0, 0.3);

    if part(1) {
        let (mut p_all, mut d_all) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            p_all.extend(paced(ns, proxied, RATE, SECONDS));
            d_all.extend(paced(ns, direct, RATE, SECONDS));
        }
        let (p50, p99) = (percentile(&mut p_all, 0.5), percentile(&mut p_all, 0.99));
        let (d50, d99) = (percentile(&mut d_all, 0.5), percentile(&mut d_all, 0.99));
        println!("\n1. added latency at {RATE} requests/s ({ROUNDS} alternating rounds of {SECONDS} s, {} + {} requests)", p_all.len(), d_all.len());
        println!(
            "   through the proxy: p50 {} us  p99 {} us; straight: p50 {} us  p99 {} us",
            p50 / 1000,
            p99 / 1000,
            d50 / 1000,
            d99 / 1000
        );
        println!(
            "   added: p50 {} us  p99 {} us",
            p50.saturating_sub(d50) / 1000,
            p99.saturating_sub(d99) / 1000
        );
    }
    if part(2) {
        let agent_pid = agent.child.as_ref().map_or(0, |c| c.id() as u64);
        let (mut p, mut d) = (Vec::new(), Vec::new());
        let (mut proxy_ns, mut agent_ns, mut requests) = (0u64, 0u64, 0f64);
        for _ in 0..ROUNDS {
            let (p0, a0) = (cpu_ns(proxy_pid), cpu_ns(agent_pid));
            let rate = closed(ns, proxied, RATE_CONNS, rate_seconds());
            proxy_ns += cpu_ns(proxy_pid) - p0;
            agent_ns += cpu_ns(agent_pid) - a0;
            requests += rate * rate_seconds();
            p.push(rate);
            d.push(closed(ns, direct, RATE_CONNS, rate_seconds()));
        }
        p.sort_by(f64::total_cmp);
        d.sort_by(f64::total_cmp);
        let (pm, dm) = (p[p.len() / 2], d[d.len() / 2]);
        println!(
            "\n2. highest rate, closed loop over {RATE_CONNS} connections ({ROUNDS} alternating rounds)"
        );
        println!(
            "   through the proxy {pm:.0}/s (rounds {p:.0?}); straight {dm:.0}/s (rounds {d:.0?}); ratio {:.2}",
            pm / dm
        );
        println!(
            "   CPU per proxied request: proxy {:.1} us, agent {:.1} us",
            proxy_ns as f64 / requests / 1000.0,
            agent_ns as f64 / requests / 1000.0
        );
    }
    if part(3) {
        let idle: usize = std::env::var("CILIATE_BENCH_HTTP_IDLE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(10_000);
        let before = rss_kib(proxy_pid);
        let conns = in_netns(ns, move || {
            let mut v = Vec::with_capacity(idle);
            for _ in 0..idle {
                let s = std::net::TcpStream::connect(proxied).expect("connect");
                v.push(s);
            }
            v
        })
        .join()
        .unwrap();
        // One request on each (an upstream connection served it), then idle.
        let mut kept = Vec::with_capacity(conns.len());
        for s in conns {
            use std::io::{Read, Write};
            let mut s = s;
            s.write_all(b"GET /x HTTP/1.1\r\nHost: s\r\n\r\n").unwrap();
            let mut buf = vec![0u8; 2048];
            let mut got = 0;
            while got < 1024 + 40 {
                let n = s.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                got += n;
            }
            kept.push(s);
        }
        // Idle: parked after a second, the heap trimmed at the next tick.
        std::thread::sleep(Duration::from_secs(3));
        let after = rss_kib(proxy_pid);
        println!(
            "\n3. {} idle kept connections through the proxy, one request each: proxy RSS {} -> {} MiB (the proxy holds {})",
            kept.len(),
            before / 1024,
            after / 1024,
            agent.json("/debug/http")["proxy"]["holds"]
        );
        drop(kept);
    }
    if part(5) {
        let mut c = Conn::open(ns, proxied).expect("connect");
        let mut lat = Vec::new();
        for i in 0..EDITS {
            let allow = i % 2 == 1;
            let rev = agent.revision();
            std::fs::write(m.join("policy.yaml"), policy(allow)).unwrap();
            while agent.revision() == rev {
                std::thread::sleep(Duration::from_millis(1));
            }
            let accepted = Instant::now();
            let want = if allow { 200 } else { 403 };
            loop {
                let r = c.request("GET", "/edit", &[]).expect("request");
                if r.status == want {
                    break;
                }
                if accepted.elapsed() > Duration::from_secs(5) {
                    panic!("the edit never applied");
                }
            }
            lat.push(accepted.elapsed().as_micros() as u64);
        }
        println!(
            "\n5. policy edit (accepted) -> next request judged by it, {EDITS} edits: p50 {} ms  p99 {} ms  max {} ms",
            percentile(&mut lat, 0.5) as f64 / 1000.0,
            percentile(&mut lat, 0.99) as f64 / 1000.0,
            lat.iter().max().copied().unwrap_or(0) as f64 / 1000.0
        );
    }
    drop(agent);
    drop(w);
}

/// Part 4, in process: the proxy's matcher with 1,000 path regexes on one port, each with a
/// literal prefix (as paths in policies usually are: `/api/v3/...`), then each without one
/// (`.*/item3/...`, matched together as one regex set).
fn many_rules() {
    for (what, pattern, hit, miss) in [
        (
            "with literal prefixes",
            "/api/v{i}/items/[0-9]+(/details)?",
            "/api/v999/items/42",
            "/api/v12345/items/1",
        ),
        (
            "without (.*/itemN/...)",
            ".*/item{i}/[0-9]+",
            "/a/b/item999/42",
            "/a/b/item12345/1",
        ),
    ] {
        let (compile, per) = judge_many(pattern, hit, miss);
        println!(
            "4. 1,000 path regexes on one port, {what}: compiled in {} ms; a request matching the last: {:.0} ns, matching none: {:.0} ns",
            compile.as_millis(),
            per[0],
            per[1]
        );
    }
}

fn judge_many(pattern: &str, hit: &str, miss: &str) -> (Duration, Vec<f64>) {
    use ciliate::policy::l7::http::{CompiledRules, HttpRule, L7PortRules, RequestView};
    let rules: Vec<HttpRule> = (0..1000)
        .map(|i| HttpRule {
            method: Some("GET".into()),
            path: Some(pattern.replace("{i}", &i.to_string())),
            ..Default::default()
        })
        .collect();
    let t = Instant::now();
    let c = CompiledRules::compile(Arc::new(L7PortRules {
        http: rules,
        server_names: vec![],
    }))
    .expect("compiles");
    let compile = t.elapsed();
    let none: Vec<(String, String)> = vec![];
    let judge = |path: &str| {
        let view = RequestView {
            method: "GET",
            path,
            host: "api",
            headers: &none,
        };
        c.first_match(&view)
    };
    assert_eq!(judge(hit).map(|m| m.index), Some(999));
    assert!(judge(miss).is_none());
    let n = 20_000;
    let mut per = Vec::new();
    for path in [hit, miss] {
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(judge(std::hint::black_box(path)));
        }
        per.push(t.elapsed().as_nanos() as f64 / n as f64);
    }
    (compile, per)
}
