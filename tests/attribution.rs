//! Every verdict names its policy, on real traffic between network-namespace pods with the BPF
//! datapath: the datapath copies the deciding entry's cookie (or the endpoint's isolation
//! cookie) into its event, the agent resolves it, and `ciliate monitor -o json` shows the
//! policies. Cases: an allow through two overlapping policies (a NetworkPolicy and a
//! CiliumNetworkPolicy) names both; a default deny names every policy that selects the pod; an
//! `ingressDeny` drop names the CCNP; a pod no policy selects says so; an edit between two
//! packets gives each the revision and policies it met; a restart keeps attribution right.
//! Privileged: with CI=true these tests must run.

mod common;

use std::io::{BufRead, BufReader};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::agent::Agent;
use common::netns::{privileged, tcp_ok, tcp_server, world};
use serde_json::Value;

/// `ciliate monitor -o json`, its events collected as they come.
struct Monitor {
    child: std::process::Child,
    events: Arc<Mutex<Vec<Value>>>,
}

impl Monitor {
    fn start(agent: &Agent) -> Monitor {
        let mut child = std::process::Command::new(common::agent::BIN)
            .args(["monitor", "-o", "json", "--socket"])
            .arg(agent.socket())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("ciliate monitor");
        let out = child.stdout.take().expect("stdout");
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    sink.lock().unwrap().push(v);
                }
            }
        });
        // The subscription is in place once the command has connected.
        std::thread::sleep(Duration::from_millis(300));
        Monitor { child, events }
    }

    /// The first event (from now on) `pred` accepts.
    fn expect(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(v) = self.events.lock().unwrap().iter().find(|v| pred(v)) {
                return v.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no event: {what}; seen: {:#?}",
                self.events.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn clear(&self) {
        self.events.lock().unwrap().clear();
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

use common::wait_output;

/// `kind ns/name` of every policy an event names, sorted.
fn named(ev: &Value) -> Vec<String> {
    let mut v: Vec<String> = ev["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let ns = p["namespace"]
                .as_str()
                .map(|n| format!("{n}/"))
                .unwrap_or_default();
            format!(
                "{} {ns}{}",
                p["kind"].as_str().unwrap_or("?"),
                p["name"].as_str().unwrap_or("?")
            )
        })
        .collect();
    v.sort();
    v
}

fn flow(ev: &Value, dst: &str, port: u64, verdict: &str) -> bool {
    ev["type"] == "flow"
        && ev["destination"] == dst
        && ev["port"].as_u64() == Some(port)
        && ev["verdict"] == verdict
        && ev["direction"] == "ingress"
}

/// The namespace and three pods (`app` = their name) of the manifests.
fn cluster(a: &str, b: &str, c: &str) -> String {
    common::namespace_x_with_pods(&[("a", a), ("b", b), ("c", c)])
}

const KNP: &str = "apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: b-from-a, namespace: x}
spec:
  podSelector: {matchLabels: {app: b}}
  policyTypes: [Ingress]
  ingress:
    - from: [{podSelector: {matchLabels: {app: a}}}]
      ports: [{port: 8080, protocol: TCP}]
";

fn cnp(port: u16) -> String {
    format!(
        "apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {{name: b-from-a-too, namespace: x}}
spec:
  endpointSelector: {{matchLabels: {{app: b}}}}
  ingress:
    - fromEndpoints: [{{matchLabels: {{app: a}}}}]
      toPorts: [{{ports: [{{port: '{port}', protocol: TCP}}]}}]
"
    )
}

const CCNP: &str = "apiVersion: cilium.io/v2
kind: CiliumClusterwideNetworkPolicy
metadata: {name: no-c-into-b}
spec:
  endpointSelector: {matchLabels: {app: b}}
  ingressDeny:
    - fromEndpoints: [{matchLabels: {app: c}}]
";

/// Three pods a, b, c (servers on b's 8080 and 9090), and the manifests: the cluster and
/// `files` (name, YAML).
fn scene(files: &[(&str, String)]) -> (common::netns::World, tempfile::TempDir) {
    let w = world(3);
    for port in [8080, 9090] {
        tcp_server(&w.pods[1].netns, w.pods[1].addr, port);
    }
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    let [a, b, c] = [0, 1, 2].map(|i| w.pods[i].addr.to_string());
    std::fs::write(m.join("cluster.yaml"), cluster(&a, &b, &c)).unwrap();
    for (name, yaml) in files {
        std::fs::write(m.join(format!("{name}.yaml")), yaml).unwrap();
    }
    (w, tmp)
}

#[test]
fn every_verdict_names_its_policies_across_edits_and_restarts() {
    if !privileged() {
        return;
    }
    let (w, tmp) = scene(&[
        ("knp", KNP.into()),
        ("cnp", cnp(8080)),
        ("ccnp", CCNP.into()),
    ]);
    let (a, b, c) = (&w.pods[0], &w.pods[1], &w.pods[2]);
    for port in [8080, 9090] {
        tcp_server(&a.netns, a.addr, port);
    }
    let m = tmp.path().join("manifests");
    let (sa, sb, sc) = (a.addr.to_string(), b.addr.to_string(), c.addr.to_string());
    let pins = w.pins.to_string_lossy().to_string();
    let args = ["--datapath", "bpf", "--bpf-root", pins.as_str()];
    let mut agent = start(
        tmp.path(),
        &pins,
        &[],
        &[("x/a", a), ("x/b", b), ("x/c", c)],
    );
    // Start-up says where its time went (`/debug/startup`, `status`, the metric).
    agent.wait_until("the agent is ready", || agent.http_get("/readyz").0 == 200);
    let phases: Vec<String> = agent
        .json("/debug/startup")
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            assert!(p["seconds"].as_f64().is_some_and(|s| s >= 0.0), "{p}");
            p["scope"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(
        phases,
        [
            "init",
            "maps",
            "restore",
            "ipam",
            "api",
            "sync",
            "regeneration"
        ],
        "every phase, in order"
    );
    let status = agent.cli_json(&["status"]);
    assert!(status["bootstrap_seconds"]["sync"].is_f64(), "{status}");
    let (_, metrics) = agent.http_get("/metrics");
    assert!(
        metrics.contains("ciliate_agent_bootstrap_seconds{scope=\"regeneration\"}"),
        "{metrics}"
    );
    let mon = Monitor::start(&agent);

    // An allow through two overlapping policies names both.
    assert!(tcp_ok(&a.netns, b.addr, 8080));
    let ev = mon.expect("a -> b:8080 forwarded", |e| flow(e, &sb, 8080, "forwarded"));
    assert_eq!(
        named(&ev),
        [
            "CiliumNetworkPolicy x/b-from-a-too",
            "NetworkPolicy x/b-from-a"
        ],
        "{ev}"
    );
    assert_eq!(ev["match"], "l3-l4", "{ev}");
    assert_eq!(
        (ev["source_pod"].as_str(), ev["destination_pod"].as_str()),
        (Some("x/a"), Some("x/b")),
        "pods by name: {ev}"
    );
    assert!(ev["policies"][0]["rule"].is_u64(), "rules are named: {ev}");
    let first_revision = ev["revision"].as_u64().expect("a revision");

    // A default deny names every policy that selects b for ingress.
    assert!(!tcp_ok(&a.netns, b.addr, 9090));
    let ev = mon.expect("a -> b:9090 dropped", |e| flow(e, &sb, 9090, "dropped"));
    assert_eq!(ev["match"], "default-deny", "{ev}");
    // (A deny-only policy selects b for ingress too, so it turns default deny on as well.)
    assert_eq!(
        named(&ev),
        [
            "CiliumClusterwideNetworkPolicy no-c-into-b",
            "CiliumNetworkPolicy x/b-from-a-too",
            "NetworkPolicy x/b-from-a"
        ],
        "{ev}"
    );

    // ... and the verdict metric counts it by direction, verdict and match.
    let (_, metrics) = agent.http_get("/metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("ciliate_policy_verdicts_total{")
                && l.contains("direction=\"ingress\"")
                && l.contains("verdict=\"dropped\"")
                && l.contains("match=\"default-deny\"")),
        "{metrics}"
    );

    // An ingressDeny drop names the CCNP (no namespace).
    assert!(!tcp_ok(&c.netns, b.addr, 8080));
    let ev = mon.expect("c -> b:8080 dropped", |e| {
        flow(e, &sb, 8080, "dropped") && e["source"] == sc.as_str()
    });
    assert_eq!(ev["match"], "deny-rule", "{ev}");
    assert_eq!(
        named(&ev),
        ["CiliumClusterwideNetworkPolicy no-c-into-b"],
        "{ev}"
    );
    assert!(ev["policies"][0].get("namespace").is_none(), "{ev}");

    // No policy selects a for ingress: its verdict says so.
    assert!(tcp_ok(&b.netns, a.addr, 9090));
    let ev = mon.expect("b -> a:9090 forwarded", |e| flow(e, &sa, 9090, "forwarded"));
    assert_eq!(ev["match"], "no-policy", "{ev}");
    assert_eq!(named(&ev), Vec::<String>::new(), "{ev}");

    // Each policy counts what it decided (`/debug/policy`, `policy get`).
    let overview = agent.json("/debug/policy");
    let hits = |name: &str| {
        overview["policies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .map(|p| p["hits"].clone())
            .unwrap_or_else(|| panic!("{name} listed: {overview}"))
    };
    assert!(
        hits("no-c-into-b")["dropped"].as_u64() >= Some(1),
        "{overview}"
    );
    assert!(
        hits("b-from-a")["forwarded"].as_u64() >= Some(1),
        "{overview}"
    );
    assert!(
        hits("b-from-a")["dropped"].as_u64() >= Some(1),
        "default deny: {overview}"
    );
    let (code, table, _) = agent.cli(&["policy", "get"]);
    assert_eq!(code, 0);
    assert!(table.contains("FWD/DROP/AUDIT"), "{table}");

    // An edit between two packets: 9090 is now the CNP's port; each packet carries what it met.
    let rev = agent.revision();
    std::fs::write(m.join("cnp.yaml"), cnp(9090)).unwrap();
    agent.wait_until("the edit is applied", || agent.revision() > rev);
    agent.wait_realized(agent.revision());
    // The monitor also shows the change and the regeneration it caused.
    let notice = mon.expect("the policy update", |e| {
        e["type"] == "policy" && e["action"] == "updated" && e["policy"]["name"] == "b-from-a-too"
    });
    assert!(notice["endpoints"].as_u64() >= Some(1), "{notice}");
    assert!(
        notice["revision"].as_u64() > Some(first_revision),
        "{notice}"
    );
    mon.expect("b regenerated", |e| {
        e["type"] == "endpoint" && e["action"] == "regenerated" && e["name"] == "x/b"
    });
    mon.clear();
    assert!(tcp_ok(&a.netns, b.addr, 9090));
    let ev = mon.expect("a -> b:9090 forwarded", |e| flow(e, &sb, 9090, "forwarded"));
    assert_eq!(named(&ev), ["CiliumNetworkPolicy x/b-from-a-too"], "{ev}");
    assert!(ev["revision"].as_u64().unwrap() > first_revision, "{ev}");
    assert!(tcp_ok(&a.netns, b.addr, 8080));
    let ev = mon.expect("a -> b:8080 forwarded", |e| flow(e, &sb, 8080, "forwarded"));
    assert_eq!(
        named(&ev),
        ["NetworkPolicy x/b-from-a"],
        "only the KNP allows 8080 now: {ev}"
    );
    drop(mon);

    // A restart: attribution stays right (the entries the last run wrote resolve too).
    assert_eq!(agent.stop(), 0);
    let agent = Agent::start_with(tmp.path(), &args);
    agent.wait_realized(agent.revision());
    let mon = Monitor::start(&agent);
    // `--policy` and `--verdict` filter what the monitor shows.
    let only = std::process::Command::new(common::agent::BIN)
        .args([
            "monitor",
            "-o",
            "json",
            "--count",
            "1",
            "--verdict",
            "dropped",
        ])
        .args(["--policy", "no-c-into-b", "--socket"])
        .arg(agent.socket())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        tcp_ok(&a.netns, b.addr, 9090),
        "not shown: another policy, forwarded"
    );
    assert!(!tcp_ok(&c.netns, b.addr, 9090));
    let ev = mon.expect("c -> b:9090 dropped", |e| {
        flow(e, &sb, 9090, "dropped") && e["source"] == sc.as_str()
    });
    assert_eq!(
        named(&ev),
        ["CiliumClusterwideNetworkPolicy no-c-into-b"],
        "{ev}"
    );
    let out = wait_output(only, Duration::from_secs(10));
    let shown: Value = serde_json::from_str(out.trim()).expect("one JSON event");
    assert_eq!(
        (shown["source"].as_str(), shown["verdict"].as_str()),
        (Some(sc.as_str()), Some("dropped")),
        "{shown}"
    );
    assert!(tcp_ok(&a.netns, b.addr, 9090));
    let ev = mon.expect("a -> b:9090 forwarded", |e| flow(e, &sb, 9090, "forwarded"));
    assert_eq!(named(&ev), ["CiliumNetworkPolicy x/b-from-a-too"], "{ev}");

    // `--since`: the agent kept the flows; a monitor started now shows the past drop (with no
    // new traffic), filtered by policy, with the time the agent received it.
    let past = |since: &str| {
        let child = std::process::Command::new(common::agent::BIN)
            .args(["monitor", "-o", "json", "--count", "1", "--since", since])
            .args(["--policy", "no-c-into-b", "--socket"])
            .arg(agent.socket())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        wait_output(child, Duration::from_secs(3))
    };
    let out = past("1h");
    let kept: Value = serde_json::from_str(out.trim()).expect("one JSON event");
    assert_eq!(
        (kept["source"].as_str(), kept["verdict"].as_str()),
        (Some(sc.as_str()), Some("dropped")),
        "{kept}"
    );
    assert_eq!(named(&kept), ["CiliumClusterwideNetworkPolicy no-c-into-b"]);
    assert!(
        kept["time"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{kept}"
    );
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(
        past("1s"),
        "",
        "nothing that old is shown, and no new drop came"
    );
    let (code, _, err) = agent.cli(&["monitor", "--since", "5 parsecs"]);
    assert_eq!(code, 2, "a bad --since is a usage error");
    assert!(err.contains("unknown unit"), "{err}");
}

fn endpoint_id(agent: &Agent, name: &str) -> String {
    agent
        .cli_json(&["endpoint", "list"])
        .as_array()
        .and_then(|l| {
            l.iter()
                .find(|e| e["name"] == name)
                .map(|e| e["id"].to_string())
        })
        .expect("the endpoint")
}

fn start(
    tmp: &std::path::Path,
    pins: &str,
    extra: &[&str],
    pods: &[(&str, &common::netns::Pod)],
) -> Agent {
    let mut args = vec!["--datapath", "bpf", "--bpf-root", pins];
    args.extend(extra);
    let agent = Agent::start_with(tmp, &args);
    let known = agent.cli_json(&["endpoint", "list"]);
    for (name, pod) in pods {
        // A restart on the same state directory restores them.
        if known
            .as_array()
            .is_some_and(|l| l.iter().any(|e| e["name"] == *name))
        {
            continue;
        }
        agent.add_endpoint(name, pod.addr, &pod.host_if);
    }
    agent.wait_realized(agent.revision());
    agent
}

/// Audit mode per endpoint (`endpoint config ID PolicyAuditMode=...`): a would-be drop passes
/// and is reported as `audit` with its attribution; turned off, the next connection is dropped
/// again at once, without a restart. `--enable-policy always` isolates a pod no policy selects;
/// `--enable-policy never` enforces nothing and reports what would have been dropped.
#[test]
fn audit_mode_and_enforcement_modes() {
    if !privileged() {
        return;
    }
    let (w, tmp) = scene(&[("knp", KNP.into())]);
    let (a, b) = (&w.pods[0], &w.pods[1]);
    let (sa, sb) = (a.addr.to_string(), b.addr.to_string());
    let pins = w.pins.to_string_lossy().to_string();
    let pods = [("x/a", a), ("x/b", b)];

    let mut agent = start(tmp.path(), &pins, &[], &pods);
    let mon = Monitor::start(&agent);
    assert!(!tcp_ok(&a.netns, b.addr, 9090), "enforced");
    let id = endpoint_id(&agent, "x/b");
    let (code, _, err) = agent.cli(&["endpoint", "config", &id, "PolicyAuditMode=Enabled"]);
    assert_eq!(code, 0, "{err}");
    agent.wait_until("b audits", || tcp_ok(&a.netns, b.addr, 9090));
    let ev = mon.expect("a -> b:9090 audited", |e| flow(e, &sb, 9090, "audit"));
    assert_eq!(ev["match"], "default-deny", "{ev}");
    assert_eq!(named(&ev), ["NetworkPolicy x/b-from-a"], "{ev}");
    assert_eq!(agent.cli_json(&["endpoint", "get", &id])["audit"], true);
    let (code, _, err) = agent.cli(&["endpoint", "config", &id, "PolicyAuditMode=Disabled"]);
    assert_eq!(code, 0, "{err}");
    agent.wait_until("b enforces again", || !tcp_ok(&a.netns, b.addr, 9090));
    assert!(
        tcp_ok(&a.netns, b.addr, 8080),
        "what the policy allows still passes"
    );
    // A bad option is refused, naming it.
    let (code, _, err) = agent.cli(&["endpoint", "config", &id, "PolicyAuditMode=Maybe"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("PolicyAuditMode must be Enabled or Disabled"),
        "{err}"
    );
    drop(mon);
    assert_eq!(agent.stop(), 0);

    // always: a pod no policy selects for a direction is isolated there too (here b's egress,
    // which no policy selects: the connection dies leaving b).
    let mut agent = start(tmp.path(), &pins, &["--enable-policy", "always"], &pods);
    let mon = Monitor::start(&agent);
    tcp_server(&a.netns, a.addr, 8080);
    assert!(
        !tcp_ok(&b.netns, a.addr, 8080),
        "default deny without any policy"
    );
    let ev = mon.expect("b -> a:8080 dropped at b's egress", |e| {
        e["destination"] == sa.as_str() && e["verdict"] == "dropped" && e["direction"] == "egress"
    });
    assert_eq!(ev["match"], "default-deny", "{ev}");
    assert_eq!(
        named(&ev),
        Vec::<String>::new(),
        "no policy selects b for egress: {ev}"
    );
    drop(mon);
    assert_eq!(agent.stop(), 0);

    // never: nothing is enforced; what would have been dropped is reported as audit.
    let agent = start(tmp.path(), &pins, &["--enable-policy", "never"], &pods);
    let mon = Monitor::start(&agent);
    assert!(tcp_ok(&a.netns, b.addr, 9090), "nothing enforced");
    let ev = mon.expect("a -> b:9090 audited", |e| flow(e, &sb, 9090, "audit"));
    assert_eq!(named(&ev), ["NetworkPolicy x/b-from-a"], "{ev}");
}

/// The page's DOM as headless Chromium renders it after its scripts ran, loopback only: every
/// other address goes to a dead proxy and resolves nowhere, and background services are off.
fn rendered(url: &str, profile: &std::path::Path) -> String {
    let out = std::process::Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-default-apps",
            "--disable-domain-reliability",
            "--no-pings",
            "--proxy-server=127.0.0.1:9",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--virtual-time-budget=5000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(url)
        .stderr(std::process::Stdio::null())
        .output()
        .expect("chromium runs");
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn chromium_present() -> bool {
    let found = std::process::Command::new("chromium")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    common::available(found, "chromium (.ci/setup installs it)")
}

/// The text of the first `<tr>` of table `id` that contains `needle` (tags stripped).
fn row_with(dom: &str, id: &str, needle: &str) -> Option<String> {
    let table = dom
        .split(&format!("id=\"{id}\""))
        .nth(1)?
        .split("</table>")
        .next()?;
    table.split("<tr").find(|r| r.contains(needle)).map(|r| {
        let mut text = String::new();
        let mut in_tag = false;
        for ch in r.chars() {
            match ch {
                '<' => in_tag = true,
                '>' => {
                    in_tag = false;
                    text.push(' ');
                }
                c if !in_tag => text.push(c),
                _ => {}
            }
        }
        text.split_whitespace().collect::<Vec<_>>().join(" ")
    })
}

#[test]
fn the_debug_page_shows_the_attributed_drop_and_a_change_through_the_actors() {
    if !privileged() || !chromium_present() {
        return;
    }
    let (w, tmp) = scene(&[("cnp", cnp(8080)), ("ccnp", CCNP.into())]);
    let (a, b, c) = (&w.pods[0], &w.pods[1], &w.pods[2]);
    let pins = w.pins.to_string_lossy().to_string();
    let agent = start(
        tmp.path(),
        &pins,
        &[],
        &[("x/a", a), ("x/b", b), ("x/c", c)],
    );
    // Real traffic: c -> b is dropped by the CCNP's deny rule, a -> b:8080 allowed by the CNP.
    assert!(!tcp_ok(&c.netns, b.addr, 8080));
    assert!(tcp_ok(&a.netns, b.addr, 8080));
    // A policy edit: one change from the file write through every actor to the map write.
    let rev = agent.revision();
    std::fs::write(tmp.path().join("manifests/cnp.yaml"), cnp(9090)).unwrap();
    agent.wait_until("the edit is applied", || agent.revision() > rev);
    agent.wait_realized(agent.revision());
    let changes = agent.json("/debug/changes");
    let edit = changes
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["cause"]
                .as_str()
                .is_some_and(|s| s.starts_with("manifests: "))
        })
        .unwrap_or_else(|| panic!("the edit is a change: {changes}"))
        .clone();
    let view = agent.json(&format!("/debug/changes/{}", edit["id"]));
    let kinds: Vec<&str> = view["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["kind"].as_str().unwrap())
        .collect();
    let order = [
        "WatcherActor",
        "PolicyRepoActor",
        "RuleReactionActor",
        "EndpointActor",
        "LoaderActor",
    ];
    let firsts: Vec<usize> = order
        .iter()
        .map(|k| {
            kinds
                .iter()
                .position(|x| x == k)
                .unwrap_or_else(|| panic!("{k} is in the change: {view}"))
        })
        .collect();
    assert!(
        firsts.windows(2).all(|p| p[0] < p[1]),
        "the change runs watcher -> repository -> reaction -> endpoint -> loader: {kinds:?}"
    );
    assert!(
        view["steps"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["message"] == "SyncPolicyMap" && s["handle_us"].as_i64() >= Some(0)),
        "through to the map write: {view}"
    );

    // The page, rendered by a real browser against the running agent.
    let url = format!("http://{}/debug/", agent.debug);
    let profile = tmp.path().join("chromium");
    let mut dom = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        dom = rendered(&url, &profile);
        if row_with(&dom, "flows", "no-c-into-b").is_some()
            && row_with(&dom, "waterfall", "SyncPolicyMap").is_some()
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let drop = row_with(&dom, "flows", "no-c-into-b")
        .unwrap_or_else(|| panic!("the flows table shows the CCNP's drop: {dom}"));
    assert!(
        drop.contains("x/c")
            && drop.contains("x/b")
            && drop.contains("dropped")
            && drop.contains("denied by CiliumClusterwideNetworkPolicy no-c-into-b[0]"),
        "{drop}"
    );
    let allowed = row_with(&dom, "flows", "allowed by")
        .unwrap_or_else(|| panic!("the flows table shows the allowed connection: {dom}"));
    assert!(
        allowed.contains("CiliumNetworkPolicy x/b-from-a-too"),
        "{allowed}"
    );
    let write = row_with(&dom, "waterfall", "SyncPolicyMap").expect("the map write");
    assert!(write.contains("LoaderActor"), "{write}");
    assert!(
        row_with(&dom, "waterfall", "PolicyUpsert").is_some(),
        "{dom}"
    );
    let ccnp = row_with(&dom, "pols", "no-c-into-b").expect("the CCNP's row");
    // kind, name, rules, revision, status, then forwarded, dropped, audit.
    let hits: Vec<u64> = ccnp
        .split(' ')
        .skip_while(|w| *w != "accepted")
        .skip(1)
        .take(3)
        .map(|w| w.parse().unwrap_or_else(|_| panic!("{ccnp}")))
        .collect();
    assert!(hits[1] >= 1, "its drops are counted on the page: {ccnp}");
}
