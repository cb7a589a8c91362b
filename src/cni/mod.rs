//! The CNI plugin (`ciliate-cni`, CNI spec 1.0.0; interfaces.md section 5) and the wire types it
//! shares with the agent.
//!
//! The plugin is a thin client, as Cilium's `cilium-cni` is: it reads the network configuration
//! and the `CNI_*` environment, asks the agent over its unix socket to do the work (IPAM, veth,
//! pod-side configuration, datapath attach, endpoint), and prints the CNI result or a CNI error
//! object. Everything that must survive the plugin's process lives in the agent.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The CNI versions this plugin speaks (results are shaped as 1.0.0 and are compatible with
/// the 0.3.x/0.4.0 result schema).
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0"];

/// CNI well-known error codes (spec section "Error").
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const UNKNOWN_CONTAINER: u32 = 3;
    pub const INVALID_ENV: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODE_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// Plugin-specific: the agent refused or failed the request.
    pub const AGENT_FAILURE: u32 = 100;
}

/// A CNI error object (printed on stdout with a non-zero exit).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniError {
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    pub code: u32,
    pub msg: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> CniError {
        CniError {
            cni_version: "1.0.0".into(),
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }
}

/// What the plugin asks the agent to do (`POST /v1/cni/{add,del,check}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniRequest {
    pub container_id: String,
    /// `CNI_NETNS`: absent on some DELs.
    #[serde(default)]
    pub netns: Option<PathBuf>,
    pub ifname: String,
    /// From `CNI_ARGS` (`K8S_POD_NAMESPACE`, `K8S_POD_NAME`).
    #[serde(default)]
    pub pod_namespace: Option<String>,
    #[serde(default)]
    pub pod_name: Option<String>,
    /// The configuration's `cniVersion`, echoed in the result.
    pub cni_version: String,
}

/// The CNI result of ADD (spec 1.0.0 "Success").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniResult {
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    pub interfaces: Vec<CniInterface>,
    pub ips: Vec<CniIp>,
    pub routes: Vec<CniRoute>,
    #[serde(default)]
    pub dns: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniInterface {
    pub name: String,
    pub mac: String,
    /// The namespace path for the pod's interface; absent for the host side.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniIp {
    /// `ip/prefix`.
    pub address: String,
    pub gateway: String,
    /// Index into `interfaces`.
    pub interface: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniRoute {
    pub dst: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gw: Option<String>,
}

/// The plugin's entry in the network configuration (a conflist's plugin entry, with `name` and
/// `cniVersion` filled in by the runtime).
#[derive(Debug, Clone, Deserialize)]
struct NetConf {
    #[serde(rename = "cniVersion")]
    cni_version: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(rename = "agentSocket", default)]
    agent_socket: Option<PathBuf>,
}

/// `CNI_ARGS`: `K=V;K=V`.
pub fn parse_cni_args(s: &str) -> Result<BTreeMap<String, String>, CniError> {
    let mut out = BTreeMap::new();
    for part in s.split(';').filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=') else {
            return Err(CniError::new(
                code::INVALID_ENV,
                "CNI_ARGS is malformed",
                format!("{part:?} is not KEY=VALUE"),
            ));
        };
        out.insert(k.to_string(), v.to_string());
    }
    Ok(out)
}

/// Runs the plugin: `env` is the process environment, `stdin` the network configuration.
/// Writes the result or the error object to `out` and returns the exit status.
pub fn run_plugin(env: &BTreeMap<String, String>, stdin: &str, out: &mut dyn Write) -> i32 {
    match plugin(env, stdin) {
        Ok(text) => {
            let _ = writeln!(out, "{text}");
            0
        }
        Err(e) => {
            let _ = writeln!(
                out,
                "{}",
                serde_json::to_string(&e).unwrap_or_else(|_| format!("{{\"code\":{}}}", e.code))
            );
            1
        }
    }
}

fn plugin(env: &BTreeMap<String, String>, stdin: &str) -> Result<String, CniError> {
    let command = env.get("CNI_COMMAND").map(String::as_str).unwrap_or("");
    if command == "VERSION" {
        return Ok(serde_json::json!({
            "cniVersion": "1.0.0",
            "supportedVersions": SUPPORTED_VERSIONS,
        })
        .to_string());
    }
    let conf: NetConf = serde_json::from_str(stdin).map_err(|e| {
        CniError::new(
            code::DECODE_FAILURE,
            "cannot decode the network configuration on stdin",
            e.to_string(),
        )
    })?;
    if !SUPPORTED_VERSIONS.contains(&conf.cni_version.as_str()) {
        return Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            format!("cniVersion {} is not supported", conf.cni_version),
            format!("supported: {}", SUPPORTED_VERSIONS.join(", ")),
        ));
    }
    if let Some(kind) = &conf.kind {
        if kind != "ciliate-cni" {
            return Err(CniError::new(
                code::INVALID_CONFIG,
                format!("plugin type {kind:?} is not ciliate-cni"),
                conf.name.clone().unwrap_or_default(),
            ));
        }
    }
    let socket = conf
        .agent_socket
        .clone()
        .unwrap_or_else(|| PathBuf::from(crate::cli::DEFAULT_SOCKET));
    let need = |k: &str| -> Result<String, CniError> {
        env.get(k)
            .filter(|v| !v.is_empty())
            .cloned()
            .ok_or_else(|| {
                CniError::new(
                    code::INVALID_ENV,
                    format!("{k} is required for {command}"),
                    "",
                )
            })
    };
    let args = parse_cni_args(env.get("CNI_ARGS").map(String::as_str).unwrap_or(""))?;
    let path = match command {
        "ADD" => "/v1/cni/add",
        "DEL" => "/v1/cni/del",
        "CHECK" => "/v1/cni/check",
        "" => {
            return Err(CniError::new(
                code::INVALID_ENV,
                "CNI_COMMAND is not set",
                "one of ADD, DEL, CHECK, VERSION",
            ))
        }
        other => {
            return Err(CniError::new(
                code::INVALID_ENV,
                format!("CNI_COMMAND {other:?} is not supported"),
                "one of ADD, DEL, CHECK, VERSION",
            ))
        }
    };
    let req = CniRequest {
        container_id: need("CNI_CONTAINERID")?,
        netns: match command {
            "DEL" => env
                .get("CNI_NETNS")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            _ => Some(PathBuf::from(need("CNI_NETNS")?)),
        },
        ifname: need("CNI_IFNAME")?,
        pod_namespace: args.get("K8S_POD_NAMESPACE").cloned(),
        pod_name: args.get("K8S_POD_NAME").cloned(),
        cni_version: conf.cni_version.clone(),
    };
    let body = serde_json::to_string(&req)
        .map_err(|e| CniError::new(code::IO_FAILURE, "cannot encode the request", e.to_string()))?;
    match crate::client::request(&socket, "POST", path, Some(&body)) {
        Ok(text) if command == "ADD" => Ok(text.trim().to_string()),
        Ok(_) => Ok(String::new()),
        Err(crate::client::ClientError::Connect { socket, source }) => Err(CniError::new(
            code::TRY_AGAIN_LATER,
            format!("the ciliate agent is not reachable at {socket}"),
            source.to_string(),
        )),
        Err(crate::client::ClientError::Status {
            status, message, ..
        }) => {
            // The agent answers failures with a CNI error object as its body's `error`.
            let err = serde_json::from_str::<CniError>(&message).unwrap_or_else(|_| {
                CniError::new(
                    if status == 404 {
                        code::UNKNOWN_CONTAINER
                    } else {
                        code::AGENT_FAILURE
                    },
                    format!("{command} failed in the agent"),
                    message,
                )
            });
            Err(err)
        }
        Err(e) => Err(CniError::new(
            code::IO_FAILURE,
            format!("{command}: talking to the agent failed"),
            e.to_string(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn run(e: &[(&str, &str)], stdin: &str) -> (i32, serde_json::Value) {
        let mut out = Vec::new();
        let code = run_plugin(&env(e), stdin, &mut out);
        let v = serde_json::from_slice(&out).unwrap_or(serde_json::Value::Null);
        (code, v)
    }

    const CONF: &str = r#"{"cniVersion":"1.0.0","name":"ciliate","type":"ciliate-cni","agentSocket":"/nonexistent/ciliate.sock"}"#;

    #[test]
    fn version_needs_no_config_and_no_agent() {
        let (code, v) = run(&[("CNI_COMMAND", "VERSION")], "");
        assert_eq!(code, 0);
        assert_eq!(v["cniVersion"], "1.0.0");
        assert!(v["supportedVersions"]
            .as_array()
            .unwrap()
            .contains(&"1.0.0".into()));
    }

    #[test]
    fn errors_are_cni_error_objects_with_the_right_codes() {
        let (code, v) = run(&[("CNI_COMMAND", "ADD")], "not json");
        assert_eq!((code, v["code"].as_u64()), (1, Some(6)));
        let (_, v) = run(
            &[("CNI_COMMAND", "ADD")],
            r#"{"cniVersion":"9.9.9","type":"ciliate-cni"}"#,
        );
        assert_eq!(v["code"], 1);
        assert!(v["msg"].as_str().unwrap().contains("9.9.9"));
        let (_, v) = run(&[("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c1")], CONF);
        assert_eq!(v["code"], 4, "{v}");
        assert!(v["msg"].as_str().unwrap().contains("CNI_NETNS"));
        let (_, v) = run(&[("CNI_COMMAND", "FROB")], CONF);
        assert_eq!(v["code"], 4);
        let (_, v) = run(
            &[
                ("CNI_COMMAND", "ADD"),
                ("CNI_CONTAINERID", "c1"),
                ("CNI_NETNS", "/var/run/netns/x"),
                ("CNI_IFNAME", "eth0"),
                ("CNI_ARGS", "K8S_POD_NAMESPACE=x;broken"),
            ],
            CONF,
        );
        assert_eq!(v["code"], 4);
        let (code, v) = run(
            &[
                ("CNI_COMMAND", "DEL"),
                ("CNI_CONTAINERID", "c1"),
                ("CNI_IFNAME", "eth0"),
            ],
            CONF,
        );
        assert_eq!(code, 1);
        assert_eq!(v["code"], 11, "agent unreachable: try again later");
        assert!(v["msg"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/ciliate.sock"));
    }

    #[test]
    fn cni_args_parse() {
        let a = parse_cni_args("IgnoreUnknown=1;K8S_POD_NAMESPACE=x;K8S_POD_NAME=a").unwrap();
        assert_eq!(a["K8S_POD_NAMESPACE"], "x");
        assert_eq!(a["K8S_POD_NAME"], "a");
        assert!(parse_cni_args("").unwrap().is_empty());
    }
}
