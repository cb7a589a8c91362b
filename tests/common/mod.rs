//! Helpers shared by the integration tests (each test binary uses a part of them).
#![allow(dead_code)]

pub mod agent;
pub mod cluster;
pub mod cni;
pub mod netns;

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

/// Namespace `x` and its pods as manifests: each `(name, ip)` gets the label `app: <name>`.
pub fn namespace_x_with_pods(pods: &[(&str, &str)]) -> String {
    let mut out = "apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n".to_string();
    for (name, ip) in pods {
        out.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: x, labels: {{app: {name}}}}}\nstatus: {{podIPs: [{{ip: {ip}}}]}}\n"
        ));
    }
    out
}
