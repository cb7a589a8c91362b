//! Pods created the way a container runtime creates them: a network namespace, then
//! `ciliate-cni ADD` (the agent's binary invoked under the plugin's name) with the CNI
//! environment and network configuration. Everything is removed when the `CniPods` is dropped,
//! even when the test failed: CNI DEL, then the namespaces and any device left behind.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::Value;

use super::agent::BIN;
use super::netns::ip;

static N: AtomicU32 = AtomicU32::new(0);

/// A pod created through CNI.
#[derive(Debug, Clone)]
pub struct CniPod {
    pub namespace: String,
    pub name: String,
    pub netns: String,
    pub container_id: String,
    /// From the CNI result: the IPv4 address (`0.0.0.0` from an IPv6-only agent).
    pub addr: std::net::Ipv4Addr,
    /// The result's IPv6 address, when the agent hands out both families.
    pub addr6: Option<std::net::Ipv6Addr>,
    pub host_if: String,
}

/// The pods of one test, and what it needs to clean them up.
pub struct CniPods {
    pub socket: PathBuf,
    pub tag: String,
    pub pods: Vec<CniPod>,
    /// Namespaces created, pods or not (an ADD may have failed).
    pub netns: Vec<String>,
    pub pins: PathBuf,
}

/// A pod CIDR (/24) that no other test of this run uses.
pub fn unique_pod_cidr() -> String {
    let n = N.fetch_add(1, Ordering::SeqCst);
    format!("10.{}.{}.0/24", 240 + std::process::id() % 10, n % 250)
}

/// Runs the plugin: (exit status, parsed stdout).
pub fn cni(
    socket: &Path,
    command: &str,
    container_id: &str,
    netns: Option<&str>,
    pod: Option<(&str, &str)>,
) -> (i32, Value) {
    let conf = serde_json::json!({
        "cniVersion": "1.0.0", "name": "ciliate", "type": "ciliate-cni",
        "agentSocket": socket,
    });
    let mut cmd = Command::new(BIN);
    cmd.arg0("ciliate-cni")
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/opt/cni/bin")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(ns) = netns {
        cmd.env("CNI_NETNS", format!("/var/run/netns/{ns}"));
    }
    if let Some((namespace, name)) = pod {
        cmd.env(
            "CNI_ARGS",
            format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}"),
        );
    }
    let mut child = cmd.spawn().expect("the plugin runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(conf.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let v = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("plugin output {text:?}: {e}"))
    };
    (out.status.code().unwrap_or(-1), v)
}

impl CniPods {
    pub fn new(socket: &Path, pins: &Path) -> CniPods {
        let n = N.fetch_add(1, Ordering::SeqCst);
        CniPods {
            socket: socket.to_path_buf(),
            tag: format!("{}{}", std::process::id() % 100_000, n),
            pods: vec![],
            netns: vec![],
            pins: pins.to_path_buf(),
        }
    }

    /// A fresh network namespace of this test.
    pub fn netns(&mut self, suffix: &str) -> String {
        let ns = format!("cni-{}-{suffix}", self.tag);
        ip(&["netns", "add", &ns]);
        self.netns.push(ns.clone());
        ns
    }

    /// Creates `namespace/name` through CNI ADD and checks the result's shape.
    pub fn add(&mut self, namespace: &str, name: &str) -> CniPod {
        let (pod, refused) = self.add_retrying(namespace, name, std::time::Duration::ZERO);
        assert!(
            refused.is_empty(),
            "CNI ADD {namespace}/{name}: {refused:?}"
        );
        pod
    }

    /// Like `add`, retrying every 50 ms for up to `patience` while the plugin answers "try
    /// again later" (code 11), as the kubelet does. Returns the pod and the refusals seen.
    pub fn add_retrying(
        &mut self,
        namespace: &str,
        name: &str,
        patience: std::time::Duration,
    ) -> (CniPod, Vec<Value>) {
        let netns = self.netns(name);
        let container_id = format!("ctr-{}-{name}", self.tag);
        let deadline = std::time::Instant::now() + patience;
        let mut refused = Vec::new();
        let (code, v) = loop {
            let (code, v) = cni(
                &self.socket,
                "ADD",
                &container_id,
                Some(&netns),
                Some((namespace, name)),
            );
            if code == 0 || v["code"] != 11 || std::time::Instant::now() >= deadline {
                break (code, v);
            }
            refused.push(v);
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert_eq!(code, 0, "CNI ADD {namespace}/{name}: {v}");
        assert_eq!(v["cniVersion"], "1.0.0", "{v}");
        // One address per family, IPv4's first.
        let ips = v["ips"].as_array().cloned().unwrap_or_default();
        fn of<T: std::str::FromStr>(ips: &[Value], suffix: &str) -> Option<T> {
            ips.iter()
                .filter_map(|i| i["address"].as_str()?.strip_suffix(suffix)?.parse().ok())
                .next()
        }
        let addr4: Option<std::net::Ipv4Addr> = of(&ips, "/32");
        let addr6: Option<std::net::Ipv6Addr> = of(&ips, "/128");
        assert!(
            (addr4.is_some() || addr6.is_some())
                && ips.len() == 1 + usize::from(addr6.is_some() && addr4.is_some()),
            "CNI result with one address per family: {v}"
        );
        assert!(ips.iter().all(|i| i["interface"] == 1), "{v}");
        let addr = addr4.unwrap_or(std::net::Ipv4Addr::UNSPECIFIED);
        assert_eq!(v["interfaces"][1]["name"], "eth0", "{v}");
        assert_eq!(
            v["interfaces"][1]["sandbox"],
            format!("/var/run/netns/{netns}"),
            "{v}"
        );
        let first_route = if addr4.is_some() { "0.0.0.0/0" } else { "::/0" };
        assert_eq!(v["routes"][0]["dst"], first_route, "{v}");
        let host_if = v["interfaces"][0]["name"].as_str().unwrap().to_string();
        let pod = CniPod {
            namespace: namespace.into(),
            name: name.into(),
            netns,
            container_id,
            addr,
            addr6,
            host_if,
        };
        self.pods.push(pod.clone());
        (pod, refused)
    }

    /// CNI DEL of one pod: (exit status, output).
    pub fn del(&self, pod: &CniPod) -> (i32, Value) {
        cni(
            &self.socket,
            "DEL",
            &pod.container_id,
            Some(&pod.netns),
            Some((&pod.namespace, &pod.name)),
        )
    }
}

impl Drop for CniPods {
    fn drop(&mut self) {
        for p in &self.pods {
            let _ = self.del(p);
            let _ = Command::new("ip")
                .args(["link", "del", &p.host_if])
                .stderr(Stdio::null())
                .output();
        }
        for ns in &self.netns {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        let _ = std::fs::remove_dir_all(&self.pins);
    }
}
