//! The CNI plugin (`ciliate-cni`, CNI spec 1.0.0; interfaces.md section 5) and the wire types it
//! shares with the agent.
//!
//! The plugin is a thin client, as Cilium's `cilium-cni` is: it reads the network configuration
//! and the `CNI_*` environment, asks the agent over its unix socket to do the work (IPAM, veth,
//! pod-side configuration, datapath attach, endpoint), and prints the CNI result or a CNI error
//! object. Everything that must survive the plugin's process lives in the agent.

pub mod recover;

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

/// `CNI_CONTAINERID` as the CNI reference's `ValidateContainerID` accepts it: a letter or digit,
/// then letters, digits, `_`, `.` and `-`. The agent names files after it.
pub fn validate_container_id(id: &str) -> Result<(), CniError> {
    let mut chars = id.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphanumeric());
    if first_ok && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')) {
        return Ok(());
    }
    Err(CniError::new(
        code::INVALID_ENV,
        format!("CNI_CONTAINERID {id:?} is not a valid container id"),
        "a letter or digit, then letters, digits, '_', '.' or '-'",
    ))
}

/// `CNI_IFNAME` must be a usable interface name (the CNI reference's `ValidateInterfaceName`).
pub fn validate_ifname(name: &str) -> Result<(), CniError> {
    match crate::datapath::netdev::ifname_problem(name) {
        None => Ok(()),
        Some(why) => Err(CniError::new(
            code::INVALID_ENV,
            format!("CNI_IFNAME {name:?} {why}"),
            "an interface name: 1 to 15 bytes, not . or .., no '/', ':' or whitespace",
        )),
    }
}

/// The CNI error for a request the agent did not answer. Whenever the agent is unreachable, not
/// ready, or went away in the middle of the request (killed: the connection is reset or closed
/// before a whole response arrived), the runtime should try again later (11): every command is
/// safe to repeat, and a restarted agent rolls back an interrupted ADD.
pub fn agent_error(command: &str, e: crate::client::ClientError) -> CniError {
    use crate::client::ClientError;
    use std::io::ErrorKind;
    match e {
        ClientError::Connect { socket, source } => CniError::new(
            code::TRY_AGAIN_LATER,
            format!("the ciliate agent is not reachable at {socket}"),
            source.to_string(),
        ),
        ClientError::Status {
            status, message, ..
        } => {
            // The agent answers failures with a CNI error object as its body's `error`.
            serde_json::from_str::<CniError>(&message).unwrap_or_else(|_| {
                CniError::new(
                    match status {
                        404 => code::UNKNOWN_CONTAINER,
                        503 => code::TRY_AGAIN_LATER,
                        _ => code::AGENT_FAILURE,
                    },
                    format!("{command} failed in the agent"),
                    message,
                )
            })
        }
        ClientError::Io { ref source, .. }
            if matches!(
                source.kind(),
                ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::BrokenPipe
                    | ErrorKind::UnexpectedEof
                    | ErrorKind::TimedOut
                    | ErrorKind::WouldBlock
            ) =>
        {
            CniError::new(
                code::TRY_AGAIN_LATER,
                format!("{command}: the agent went away or stopped answering during the request"),
                e.to_string(),
            )
        }
        // Only a cut-off response is malformed: the agent died while answering.
        ClientError::Malformed { .. } => CniError::new(
            code::TRY_AGAIN_LATER,
            format!("{command}: the agent closed the connection without a whole answer"),
            e.to_string(),
        ),
        ClientError::Io { .. } => CniError::new(
            code::IO_FAILURE,
            format!("{command}: talking to the agent failed"),
            e.to_string(),
        ),
        ClientError::Usage(_) => CniError::new(
            code::AGENT_FAILURE,
            format!("{command}: bad request"),
            e.to_string(),
        ),
    }
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
        .unwrap_or_else(|| PathBuf::from(crate::config::DEFAULT_SOCKET));
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
    let container_id = need("CNI_CONTAINERID")?;
    validate_container_id(&container_id)?;
    let netns = match command {
        "DEL" => env
            .get("CNI_NETNS")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from),
        _ => Some(PathBuf::from(need("CNI_NETNS")?)),
    };
    let ifname = need("CNI_IFNAME")?;
    validate_ifname(&ifname)?;
    let req = CniRequest {
        container_id,
        netns,
        ifname,
        pod_namespace: args.get("K8S_POD_NAMESPACE").cloned(),
        pod_name: args.get("K8S_POD_NAME").cloned(),
        cni_version: conf.cni_version.clone(),
    };
    let body = serde_json::to_string(&req)
        .map_err(|e| CniError::new(code::IO_FAILURE, "cannot encode the request", e.to_string()))?;
    match crate::client::request(&socket, "POST", path, Some(&body)) {
        Ok(text) if command == "ADD" => Ok(text.trim().to_string()),
        Ok(_) => Ok(String::new()),
        Err(e) => Err(agent_error(command, e)),
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

    fn add_env(socket_conf: &str) -> (Vec<(&'static str, &'static str)>, String) {
        (
            vec![
                ("CNI_COMMAND", "ADD"),
                ("CNI_CONTAINERID", "c1"),
                ("CNI_NETNS", "/var/run/netns/x"),
                ("CNI_IFNAME", "eth0"),
                ("CNI_ARGS", "K8S_POD_NAMESPACE=x;K8S_POD_NAME=a"),
            ],
            serde_json::json!({"cniVersion": "1.0.0", "type": "ciliate-cni", "agentSocket": socket_conf})
                .to_string(),
        )
    }

    #[test]
    fn invalid_interface_names_and_container_ids_are_code_4_before_the_agent_is_asked() {
        // The socket does not exist: reaching for the agent would be code 11.
        let (base, conf) = add_env("/nonexistent/ciliate.sock");
        for bad in ["", "1234567890123456", ".", "..", "a/b", "a:b", "a b"] {
            let mut e = base.clone();
            e.retain(|(k, _)| *k != "CNI_IFNAME");
            e.push(("CNI_IFNAME", bad));
            let (code, v) = run(&e, &conf);
            assert_eq!((code, v["code"].as_u64()), (1, Some(4)), "{bad:?}: {v}");
            assert!(v["msg"].as_str().unwrap().contains("CNI_IFNAME"), "{v}");
        }
        for bad in ["../../etc", "-x", "a/b", ".hidden", "c 1"] {
            let mut e = base.clone();
            e.retain(|(k, _)| *k != "CNI_CONTAINERID");
            e.push(("CNI_CONTAINERID", bad));
            let (code, v) = run(&e, &conf);
            assert_eq!((code, v["code"].as_u64()), (1, Some(4)), "{bad:?}: {v}");
            assert!(
                v["msg"].as_str().unwrap().contains("CNI_CONTAINERID"),
                "{v}"
            );
        }
        assert!(validate_container_id("0123abc_def.g-h").is_ok());
        assert!(validate_ifname("eth0").is_ok());
    }

    /// A fake agent on a unix socket that reads one request and then answers `reply` (maybe
    /// nothing) and closes, or closes without reading when `read` is false.
    fn fake_agent(dir: &std::path::Path, read: bool, reply: &'static [u8]) -> String {
        use std::io::Read;
        let path = dir.join("agent.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            if read {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
            }
            let _ = s.write_all(reply);
        });
        path.display().to_string()
    }

    #[test]
    fn an_agent_that_goes_away_mid_request_or_is_not_there_means_try_again_later() {
        let cases: [(&str, bool, &[u8]); 3] = [
            ("closed after reading the request", true, b""),
            (
                "died while answering",
                true,
                b"HTTP/1.1 200 OK\r\nContent-Le",
            ),
            ("closed without reading", false, b""),
        ];
        for (what, read, reply) in cases {
            let dir = tempfile::tempdir().unwrap();
            let socket = fake_agent(dir.path(), read, reply);
            let (e, conf) = add_env(&socket);
            let (code, v) = run(&e, &conf);
            assert_eq!((code, v["code"].as_u64()), (1, Some(11)), "{what}: {v}");
        }
        // A stale socket file with no agent behind it (ECONNREFUSED).
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let (e, conf) = add_env(path.to_str().unwrap());
        let (code, v) = run(&e, &conf);
        assert_eq!(
            (code, v["code"].as_u64()),
            (1, Some(11)),
            "stale socket: {v}"
        );
        // An agent that is not ready answers 503 with its own error object, kept as it is.
        let dir = tempfile::tempdir().unwrap();
        let socket = fake_agent(
            dir.path(),
            true,
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n{}",
        );
        let (e, conf) = add_env(&socket);
        let (_, v) = run(&e, &conf);
        assert_eq!(v["code"], 11, "503 without a CNI error object: {v}");
    }

    #[test]
    fn cni_args_parse() {
        let a = parse_cni_args("IgnoreUnknown=1;K8S_POD_NAMESPACE=x;K8S_POD_NAME=a").unwrap();
        assert_eq!(a["K8S_POD_NAMESPACE"], "x");
        assert_eq!(a["K8S_POD_NAME"], "a");
        assert!(parse_cni_args("").unwrap().is_empty());
    }
}
