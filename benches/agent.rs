//! Agent performance (issue #3), a bench binary: `cargo bench --bench agent`.
//!
//! In process, with the real actors and the in-memory datapath, on a cluster of 1,000 local
//! endpoints, 5,000 remote pods and 1,000 policies:
//! - implementation delay of one change selecting 100 of the 1,000 endpoints (p50/p99),
//! - implementation delay of one change selecting all 1,000 endpoints (p50/p99),
//! - implementation delay of a priority change of one ClusterNetworkPolicy selecting the 1,000
//!   endpoints (issue #28: p99 <= 50 ms), among 10 of 5 rules each, and among 100 of 25,
//! - a burst of 1,000 policy edits within one second: regenerations per endpoint until the final
//!   revision is realized everywhere.
//!
//! Then the real `ciliate agent` binary on a manifest directory of the same cluster, with the
//! 1,000 endpoints added through its API: its RSS once every endpoint is realized.

/// The ciliate binary's allocator (`ciliate::memory`), so that in-process figures are the agent's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// With the binary's options (`ciliate::memory`), set before anything allocates as the binary
/// sets them: mimalloc's defaults commit arenas eagerly, in huge pages that a purge gives back
/// and the next allocation faults in again, 2 MiB zeroed at a time (a tenth of the CPU of a
/// change selecting 1,000 endpoints in `benches/agent.rs`), which the agent never pays.
#[used]
#[link_section = ".init_array"]
static CONFIGURE_ALLOCATOR: extern "C" fn() = ciliate::memory::configure_allocator;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ciliate::actors::endpoint::GetEndpoint;
use ciliate::actors::policy_repo::{
    AddEndpoint, EndpointRequest, GetPolicies, InitialSyncDone, ListEndpoints, NamespaceUpsert,
    PodUpsert, PolicyUpsert,
};
use ciliate::agent::run::{spawn_core, Core};
use ciliate::datapath::memory::MemoryDatapath;
use ciliate::endpoint::state::StateDir;
use ciliate::objects::{NamespaceInfo, PodInfo};
use ciliate::policy::translate::parse_policy;
use ciliate::runtime::Shared;

const NAMESPACES: usize = 50;
const REMOTE_PODS: usize = 5000;
const LOCAL: usize = 1000;
const POLICIES: usize = 1000;

fn local_ip(i: usize) -> String {
    format!("10.10.{}.{}", i / 250, i % 250 + 1)
}
fn remote_ip(i: usize) -> String {
    format!("10.20.{}.{}", i / 250, i % 250 + 1)
}

fn local_pod(i: usize) -> PodInfo {
    let labels: BTreeMap<String, String> = [
        ("app".to_string(), format!("e-{}", i % 100)),
        ("grp".to_string(), format!("g-{}", i / 100)),
        ("role".to_string(), "bench".to_string()),
    ]
    .into();
    PodInfo {
        namespace: format!("ns-{}", i % NAMESPACES),
        name: format!("e-{i}"),
        labels: labels.into(),
        ips: vec![local_ip(i).parse().unwrap()],
        node: Some("node-1".into()),
        service_account: "default".into(),
        named_ports: vec![],
        workload: None,
    }
}

fn remote_pod(i: usize) -> PodInfo {
    let labels: BTreeMap<String, String> = [("app".to_string(), format!("r-{}", i % 100))].into();
    PodInfo {
        namespace: format!("ns-{}", i % NAMESPACES),
        name: format!("r-{i}"),
        labels: labels.into(),
        ips: vec![remote_ip(i).parse().unwrap()],
        node: Some("node-2".into()),
        service_account: "default".into(),
        named_ports: vec![],
        workload: None,
    }
}

fn background_policy(k: usize) -> String {
    format!(
        "{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: bg-{k}, namespace: ns-{}}}, spec: {{endpointSelector: {{matchLabels: {{app: e-{}}}}}, ingress: [{{fromEndpoints: [{{matchLabels: {{app: r-{}}}}}], toPorts: [{{ports: [{{port: '{}', protocol: TCP}}]}}]}}], egress: [{{toEndpoints: [{{matchLabels: {{app: r-{}}}}}]}}]}}}}",
        k % NAMESPACES,
        k % 100,
        (k + 1) % 100,
        8000 + k % 50,
        (k + 7) % 100
    )
}

/// A ClusterNetworkPolicy selecting every endpoint (`role: bench`) with `rules` ingress rules:
/// Admin or Baseline, Accept/Deny/Pass, peers by namespace (one in five) or by pod label, on
/// TCP ports.
fn tier_policy(p: usize, priority: u32, rules: usize) -> String {
    let tier = if p % 4 == 3 { "Baseline" } else { "Admin" };
    let rules: Vec<String> = (0..rules)
        .map(|k| {
            let action = ["Accept", "Deny", "Pass"][(p + k) % 3];
            let action = if tier == "Baseline" && action == "Pass" { "Deny" } else { action };
            let peer = if k % 5 == 0 {
                format!("{{namespaces: {{matchLabels: {{kubernetes.io/metadata.name: ns-{}}}}}}}", (p + k) % NAMESPACES)
            } else {
                format!("{{pods: {{namespaceSelector: {{}}, podSelector: {{matchLabels: {{app: r-{}}}}}}}}}", (p * 25 + k) % 100)
            };
            format!(
                "{{name: r{k}, action: {action}, from: [{peer}], protocols: [{{tcp: {{destinationPort: {{number: {}}}}}}}]}}",
                7000 + (p + k) % 50
            )
        })
        .collect();
    format!(
        "{{apiVersion: policy.networking.k8s.io/v1alpha2, kind: ClusterNetworkPolicy, metadata: {{name: tier-{p}}}, spec: {{tier: {tier}, priority: {priority}, subject: {{pods: {{namespaceSelector: {{}}, podSelector: {{matchLabels: {{role: bench}}}}}}}}, ingress: [{}]}}}}",
        rules.join(", ")
    )
}

fn policy(yaml: &str) -> ciliate::policy::translate::ParsedPolicy {
    let doc: serde_yaml::Value = serde_yaml::from_str(yaml).expect("bench YAML");
    parse_policy(&doc, "default", "bench").expect("bench policy is valid")
}

/// The CPU time this process has used (user and system), in seconds: what a change costs on
/// every core, where a delay says only how long the busiest took.
fn cpu_seconds() -> f64 {
    let r = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
        .expect("getrusage of this process");
    let s = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 * 1e-6;
    s(r.user_time()) + s(r.system_time())
}

fn pct(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return 0.0;
    }
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

/// Sends a policy to the repository and waits for its revision.
async fn upsert(core: &Core, yaml: &str) -> u64 {
    core.repo
        .send(
            PolicyUpsert {
                policy: policy(yaml),
                source: "bench".into(),
            },
            "bench",
        )
        .await
        .unwrap()
        .unwrap()
}

async fn endpoint_stats(core: &Core) -> Vec<(u64, u64, String)> {
    let handles = core
        .repo
        .send(ListEndpoints, "bench")
        .await
        .unwrap()
        .unwrap();
    let mut out = Vec::new();
    for (_, a) in handles {
        let m = a.send(GetEndpoint, "bench").await.unwrap().unwrap();
        out.push((m.policy_revision, m.regenerations, m.state));
    }
    out
}

async fn wait_all_realized(core: &Core, rev: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let st = endpoint_stats(core).await;
        if st.iter().all(|(r, _, s)| *r >= rev && s == "ready") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "endpoints did not realize revision {rev}"
        );
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits for the implementation record of `revision`; returns its seconds.
async fn implementation_of(shared: &Shared, revision: u64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(i) = shared
            .implementations()
            .iter()
            .find(|i| i.revision == revision)
        {
            return i.seconds;
        }
        assert!(
            Instant::now() < deadline,
            "revision {revision} was never implemented"
        );
        actix_rt::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn in_process() {
    let tmp = tempfile::tempdir().unwrap();
    let shared = Shared::new("node-1", StateDir::open(&tmp.path().join("state")).unwrap());
    let core = spawn_core(&shared, Box::new(MemoryDatapath::new()));
    let t0 = Instant::now();
    for n in 0..NAMESPACES {
        core.repo.do_send(
            NamespaceUpsert {
                namespace: NamespaceInfo {
                    name: format!("ns-{n}"),
                    labels: [("team".to_string(), format!("t{}", n % 5))].into(),
                },
            },
            "bench",
        );
    }
    for i in 0..REMOTE_PODS {
        core.repo.do_send(PodUpsert { pod: remote_pod(i) }, "bench");
    }
    for i in 0..LOCAL {
        core.repo.do_send(PodUpsert { pod: local_pod(i) }, "bench");
    }
    for k in 0..POLICIES {
        upsert(&core, &background_policy(k)).await;
    }
    core.repo.send(InitialSyncDone, "bench").await.unwrap();
    for i in 0..LOCAL {
        let p = local_pod(i);
        let req = EndpointRequest {
            name: p.key(),
            ips: p.ips.clone(),
            interface: Some(format!("lxc{i}")),
            container_id: None,
            netns: None,
            mac: None,
        };
        core.repo
            .send(
                AddEndpoint {
                    request: req,
                    restore: None,
                },
                "bench",
            )
            .await
            .unwrap()
            .unwrap();
    }
    let rev = shared.engine.read().unwrap().revision();
    wait_all_realized(&core, rev).await;
    println!(
        "setup: {NAMESPACES} namespaces, {REMOTE_PODS} remote pods, {LOCAL} endpoints, {POLICIES} policies realized in {:.2}s",
        t0.elapsed().as_secs_f64()
    );

    // CILIATE_BENCH_AGENT_TIERS=all|light|heavy: only the tier phases (both, or one of them), for
    // profiling them; `none`: only the changes before them.
    let tiers = std::env::var("CILIATE_BENCH_AGENT_TIERS").ok();
    if tiers.is_none() || tiers.as_deref() == Some("none") {
        changes_of_ccnps(&core, &shared).await;
    }
    if tiers.as_deref() == Some("none") {
        return;
    }

    // Cluster tiers (issue #28): ClusterNetworkPolicies selecting every endpoint; one of them
    // changes priority, again and again. Light: 10 policies of 5 rules; heavy: 100 of 25 (each
    // endpoint's map then holds ~10,000 entries, recomputed whole on every change).
    let cases = [(10, 5, 30), (100, 25, 20)];
    let cases = cases
        .into_iter()
        .filter(|&(p, _, _)| match tiers.as_deref() {
            Some("light") => p == 10,
            Some("heavy") => p == 100,
            _ => true,
        });
    for (policies, rules, changes) in cases {
        for p in 0..policies {
            upsert(&core, &tier_policy(p, p as u32, rules)).await;
        }
        let rev = shared.engine.read().unwrap().revision();
        wait_all_realized(&core, rev).await;
        let mut dtier = Vec::new();
        let cpu0 = cpu_seconds();
        for i in 0..changes {
            let priority = if i % 2 == 0 { 500 } else { 0 };
            let rev = upsert(&core, &tier_policy(0, priority, rules)).await;
            dtier.push(implementation_of(&shared, rev).await);
        }
        let cpu = (cpu_seconds() - cpu0) / changes as f64;
        if std::env::var_os("CILIATE_BENCH_SAMPLES").is_some() {
            let ms: Vec<f64> = dtier.iter().map(|x| (x * 1e4).round() / 10.0).collect();
            eprintln!("priority changes among {policies}, each change's delay (ms): {ms:?}");
        }
        println!(
            "priority change of one of {policies} ClusterNetworkPolicies ({rules} rules each) selecting all 1000 endpoints: implementation delay p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} changes); the process's CPU time {:.1} ms per change",
            pct(dtier.clone(), 0.5) * 1e3,
            pct(dtier.clone(), 0.99) * 1e3,
            pct(dtier.clone(), 1.0) * 1e3,
            dtier.len(),
            cpu * 1e3
        );
        for p in 0..policies {
            let key = ciliate::policy::rule::PolicyKey::new(
                ciliate::policy::rule::PolicyKind::ClusterNetworkPolicy,
                None,
                &format!("tier-{p}"),
            );
            core.repo
                .send(ciliate::actors::policy_repo::PolicyDelete { key }, "bench")
                .await
                .unwrap()
                .expect("the tier policy exists");
        }
    }

    if tiers.is_some() {
        return;
    }
    // A burst: 1,000 edits of one policy selecting every endpoint, spread over one second.
    let before: Vec<u64> = endpoint_stats(&core).await.iter().map(|s| s.1).collect();
    let start = Instant::now();
    for i in 0..1000u64 {
        let due = start + Duration::from_micros(i * 1000);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            actix_rt::time::sleep(wait).await;
        }
        let y = format!(
            "{{apiVersion: cilium.io/v2, kind: CiliumClusterwideNetworkPolicy, metadata: {{name: burst}}, spec: {{endpointSelector: {{matchLabels: {{role: bench}}}}, egress: [{{toEndpoints: [{{matchLabels: {{app: r-{}}}}}], toPorts: [{{ports: [{{port: '{}', protocol: TCP}}]}}]}}]}}}}",
            i % 100,
            20000 + i
        );
        core.repo.do_send(
            PolicyUpsert {
                policy: policy(&y),
                source: "bench".into(),
            },
            "bench",
        );
    }
    let sent = start.elapsed();
    // Behind the edits in the same mailbox: the revision after the last one.
    let last = core
        .repo
        .send(GetPolicies, "bench")
        .await
        .unwrap()
        .unwrap()
        .revision;
    wait_all_realized(&core, last).await;
    let converged = start.elapsed();
    let after: Vec<u64> = endpoint_stats(&core).await.iter().map(|s| s.1).collect();
    let per: Vec<f64> = after
        .iter()
        .zip(before.iter())
        .map(|(a, b)| (a - b) as f64)
        .collect();
    println!(
        "burst of 1000 edits sent in {:.2}s: every endpoint at the final revision after {:.2}s; regenerations per endpoint: max {}, mean {:.2}",
        sent.as_secs_f64(),
        converged.as_secs_f64(),
        pct(per.clone(), 1.0),
        per.iter().sum::<f64>() / per.len() as f64
    );
}

/// Implementation delay of CCNP changes selecting 100, then all 1,000 endpoints.
async fn changes_of_ccnps(core: &Core, shared: &Shared) {
    // One change selecting 100 of 1,000 endpoints (grp=g-k holds 100 endpoints).
    let mut d100 = Vec::new();
    for i in 0..40 {
        let y = format!(
            "{{apiVersion: cilium.io/v2, kind: CiliumClusterwideNetworkPolicy, metadata: {{name: sel100-{i}}}, spec: {{endpointSelector: {{matchLabels: {{grp: g-{}}}}}, ingress: [{{fromEndpoints: [{{matchLabels: {{app: r-{}}}}}], toPorts: [{{ports: [{{port: '{}', protocol: TCP}}]}}]}}]}}}}",
            i % 10,
            i % 100,
            9000 + i
        );
        let rev = upsert(core, &y).await;
        d100.push(implementation_of(shared, rev).await);
        let imp = shared.implementations();
        assert_eq!(
            imp.iter().find(|x| x.revision == rev).map(|x| x.endpoints),
            Some(100)
        );
    }
    println!(
        "change selecting 100 of 1000 endpoints: implementation delay p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} changes)",
        pct(d100.clone(), 0.5) * 1e3,
        pct(d100.clone(), 0.99) * 1e3,
        pct(d100.clone(), 1.0) * 1e3,
        d100.len()
    );

    // One change selecting all 1,000 endpoints.
    let mut d1000 = Vec::new();
    let cpu0 = cpu_seconds();
    for i in 0..30 {
        let y = format!(
            "{{apiVersion: cilium.io/v2, kind: CiliumClusterwideNetworkPolicy, metadata: {{name: all-{}}}, spec: {{endpointSelector: {{matchLabels: {{role: bench}}}}, ingress: [{{fromEndpoints: [{{matchLabels: {{app: r-{}}}}}], toPorts: [{{ports: [{{port: '{}', protocol: TCP}}]}}]}}]}}}}",
            i % 3,
            i % 100,
            10000 + i
        );
        let rev = upsert(core, &y).await;
        d1000.push(implementation_of(shared, rev).await);
    }
    // CILIATE_BENCH_SAMPLES=1: every change's delay in order (ms), to tell a warming-up from
    // a tail (the p99 of 30 is their maximum).
    if std::env::var_os("CILIATE_BENCH_SAMPLES").is_some() {
        let ms: Vec<f64> = d1000.iter().map(|x| (x * 1e4).round() / 10.0).collect();
        eprintln!("change selecting all 1000 endpoints, each change's delay (ms): {ms:?}");
    }
    let cpu = (cpu_seconds() - cpu0) / d1000.len() as f64;
    println!(
        "change selecting all 1000 endpoints: implementation delay p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} changes); the process's CPU time {:.1} ms per change",
        pct(d1000.clone(), 0.5) * 1e3,
        pct(d1000.clone(), 0.99) * 1e3,
        pct(d1000.clone(), 1.0) * 1e3,
        d1000.len(),
        cpu * 1e3
    );
}

/// Kills the agent when the bench ends, panics included.
struct Reap(std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn rss_of_real_agent() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    let mut y = String::new();
    for n in 0..NAMESPACES {
        y.push_str(&format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: ns-{n}, labels: {{team: t{}}}}}\n---\n", n % 5));
    }
    let pod = |p: &PodInfo| {
        let labels: Vec<String> = p.labels.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {}, namespace: {}, labels: {{{}}}}}\nspec: {{nodeName: {}, containers: [{{name: c}}]}}\nstatus: {{podIPs: [{{ip: {}}}]}}\n---\n",
            p.name,
            p.namespace,
            labels.join(", "),
            p.node.as_deref().unwrap_or("node-1"),
            p.ips[0]
        )
    };
    for i in 0..REMOTE_PODS {
        y.push_str(&pod(&remote_pod(i)));
    }
    for i in 0..LOCAL {
        y.push_str(&pod(&local_pod(i)));
    }
    std::fs::write(m.join("cluster.yaml"), y).unwrap();
    let pols: Vec<String> = (0..POLICIES).map(background_policy).collect();
    std::fs::write(m.join("policies.yaml"), pols.join("\n---\n")).unwrap();

    let sock = tmp.path().join("sock");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Reap(
        Command::new(env!("CARGO_BIN_EXE_ciliate"))
            .args(["agent", "--datapath", "memory", "--node-name", "node-1"])
            .arg("--manifests")
            .arg(&m)
            .arg("--state-dir")
            .arg(tmp.path().join("state"))
            .arg("--api-socket")
            .arg(&sock)
            .args(["--debug-addr", &format!("127.0.0.1:{port}")])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(tmp.path().join("agent.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let log_tail = || {
        let log = std::fs::read_to_string(tmp.path().join("agent.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    };
    let t0 = Instant::now();
    let ready = || {
        ciliate::client::request(&sock, "GET", "/v1/status", None)
            .ok()
            .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok())
            .is_some_and(|v| v["ready"] == true)
    };
    while !ready() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "agent never became ready; log:\n{}",
            log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let ready_after = t0.elapsed();
    for i in 0..LOCAL {
        let p = local_pod(i);
        let body =
            serde_json::json!({ "name": p.key(), "ips": p.ips, "interface": format!("lxc{i}") })
                .to_string();
        ciliate::client::request(&sock, "POST", "/v1/endpoints", Some(&body)).unwrap();
    }
    loop {
        let body = ciliate::client::request(&sock, "GET", "/v1/endpoints", None).unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let eps = v.as_array().unwrap();
        if eps.len() == LOCAL
            && eps
                .iter()
                .all(|e| e["state"] == "ready" && e["regenerations"].as_u64() >= Some(1))
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "endpoints never realized"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.0.id())).unwrap();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .unwrap_or("VmRSS: ?")
        .to_string();
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .unwrap_or("VmHWM: ?")
        .to_string();
    println!(
        "real agent: ready after {:.2}s; with {LOCAL} endpoints, {REMOTE_PODS} remote pods, {POLICIES} policies: {rss} ({hwm})",
        ready_after.as_secs_f64()
    );
    // A clean stop; `Reap` waits for it (and kills it if the bench panicked before).
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
}

fn main() {
    // `cargo test --benches` runs bench binaries with `--bench` absent; keep that quick.
    if !std::env::args().any(|a| a == "--bench") {
        println!("agent bench: run with `cargo bench --bench agent`");
        return;
    }
    let sys = actix::System::new();
    if std::env::var_os("CILIATE_BENCH_SKIP_IN_PROCESS").is_none() {
        sys.block_on(in_process());
    }
    if std::env::var_os("CILIATE_BENCH_AGENT_TIERS").is_none() {
        rss_of_real_agent();
    }
}
