//! Client commands: ask the agent over its socket and print a table or JSON.

use serde_json::Value;

use super::{
    BpfCommand, BpfIpcacheCommand, BpfPolicyCommand, ClientOpts, EndpointCommand, IdentityCommand,
    Output,
};
use crate::client::{request, table, ClientError};

/// Which client command to run.
pub enum ClientCall<'a> {
    Status,
    Endpoint(&'a EndpointCommand),
    PolicyGet,
    Identity(&'a IdentityCommand),
    Bpf(&'a BpfCommand),
    NodeList,
    ServiceList,
    FqdnCacheList,
}

/// `ciliate service list` as a table: one row per backend (a frontend without one shows `-`).
fn service_rows(v: &Value) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for f in v.as_array().into_iter().flatten() {
        let name = format!("{}/{}", s(&f["namespace"]), s(&f["name"]));
        let backends: Vec<String> = rows(&f["backends"], |b| {
            let ready = flag(&b["ready"], "", " (not ready)");
            vec![format!("{}:{}{ready}", s(&b["ip"]), s(&b["port"]))]
        })
        .concat();
        if backends.is_empty() {
            out.push(vec![
                s(&f["service_id"]),
                s(&f["frontend"]),
                name.clone(),
                "-".into(),
            ]);
        }
        for (i, b) in backends.into_iter().enumerate() {
            let (id, fe, n) = if i == 0 {
                (s(&f["service_id"]), s(&f["frontend"]), name.clone())
            } else {
                (String::new(), String::new(), String::new())
            };
            out.push(vec![id, fe, n, b]);
        }
    }
    out
}

/// One row per element of the array `v` (nothing when it is not one).
fn rows(v: &Value, row: impl Fn(&Value) -> Vec<String>) -> Vec<Vec<String>> {
    v.as_array().into_iter().flatten().map(row).collect()
}

/// `yes` when `v` is `true`, else `no`.
fn flag<'a>(v: &Value, yes: &'a str, no: &'a str) -> &'a str {
    if *v == Value::Bool(true) {
        yes
    } else {
        no
    }
}

/// The named fields of `v`, as table cells.
fn cells(v: &Value, names: &[&str]) -> Vec<String> {
    names.iter().map(|n| s(&v[*n])).collect()
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Array(a) => a.iter().map(s).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

fn parse(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or(Value::Null)
}

fn endpoint_rows(v: &Value) -> Vec<Vec<String>> {
    rows(v, |e| {
        let mut row = cells(
            e,
            &[
                "id",
                "name",
                "identity",
                "state",
                "policy_revision",
                "policy_entries",
            ],
        );
        row.extend([
            format!(
                "{}/{}",
                flag(&e["ingress_enforced"], "in", "-"),
                flag(&e["egress_enforced"], "out", "-")
            ),
            s(&e["ips"]),
        ]);
        row
    })
}

/// Turns a response into table text.
type Renderer = Box<dyn Fn(&Value) -> String>;

const ENDPOINT_HEADERS: [&str; 8] = [
    "ID", "NAME", "IDENTITY", "STATE", "REVISION", "ENTRIES", "ENFORCED", "IPS",
];

const NODE_HEADERS: [&str; 5] = ["NAME", "LOCAL", "IPS", "POD CIDRS", "ROUTE"];

fn node_rows(v: &Value) -> Vec<Vec<String>> {
    rows(v, |n| {
        cells(n, &["name", "local", "ips", "pod_cidrs", "route"])
    })
}

/// Runs a client command; returns the text to print.
pub fn run_client(opts: &ClientOpts, call: ClientCall) -> Result<String, ClientError> {
    let sock = opts.socket.as_path();
    let (body, render): (String, Renderer) = match call {
        ClientCall::Status => (
            request(sock, "GET", "/v1/status", None)?,
            Box::new(|v| {
                let rows: Vec<Vec<String>> = v
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, val)| vec![k.clone(), s(val)])
                    .collect();
                table(&["FIELD", "VALUE"], &rows)
            }),
        ),
        ClientCall::Endpoint(EndpointCommand::List) => (
            request(sock, "GET", "/v1/endpoints", None)?,
            Box::new(|v| table(&ENDPOINT_HEADERS, &endpoint_rows(v))),
        ),
        ClientCall::Endpoint(EndpointCommand::Get { id }) => (
            request(sock, "GET", &format!("/v1/endpoints/{id}"), None)?,
            Box::new(|v| {
                let mut out = table(
                    &ENDPOINT_HEADERS,
                    &endpoint_rows(&Value::Array(vec![v.clone()])),
                );
                out.push_str(&format!("labels: {}\n", s(&v["labels"])));
                if let Some(e) = v["error"].as_str() {
                    out.push_str(&format!("error: {e}\n"));
                }
                out
            }),
        ),
        ClientCall::Endpoint(EndpointCommand::Add {
            name,
            ips,
            interface,
        }) => {
            let req = serde_json::json!({ "name": name, "ips": ips, "interface": interface });
            (
                request(sock, "POST", "/v1/endpoints", Some(&req.to_string()))?,
                Box::new(|v| {
                    table(
                        &ENDPOINT_HEADERS,
                        &endpoint_rows(&Value::Array(vec![v.clone()])),
                    )
                }),
            )
        }
        ClientCall::Endpoint(EndpointCommand::Config { id, options }) => {
            let mut body = serde_json::Map::new();
            for o in options {
                let (k, v) = o
                    .split_once('=')
                    .ok_or_else(|| ClientError::Usage(format!("{o:?}: expected OPTION=VALUE")))?;
                body.insert(k.to_string(), Value::String(v.to_string()));
            }
            let body = Value::Object(body).to_string();
            request(
                sock,
                "PATCH",
                &format!("/v1/endpoints/{id}/config"),
                Some(&body),
            )?;
            let id = *id;
            (
                serde_json::json!({ "configured": id }).to_string(),
                Box::new(move |_| format!("endpoint {id} configured\n")),
            )
        }
        ClientCall::Endpoint(EndpointCommand::Delete { id }) => {
            request(sock, "DELETE", &format!("/v1/endpoints/{id}"), None)?;
            let id = *id;
            (
                serde_json::json!({ "deleted": id }).to_string(),
                Box::new(move |_| format!("endpoint {id} deleted\n")),
            )
        }
        ClientCall::NodeList => (
            request(sock, "GET", "/v1/nodes", None)?,
            Box::new(|v| table(&NODE_HEADERS, &node_rows(v))),
        ),
        ClientCall::PolicyGet => (
            request(sock, "GET", "/v1/policy", None)?,
            Box::new(|v| {
                let rows = rows(&v["policies"], |p| {
                    let name = match p["namespace"].as_str() {
                        Some(ns) => format!("{ns}/{}", s(&p["name"])),
                        None => s(&p["name"]),
                    };
                    vec![
                        s(&p["kind"]),
                        name,
                        s(&p["rules"]),
                        s(&p["revision"]),
                        s(&p["status"]),
                        cells(&p["hits"], &["forwarded", "dropped", "audit"]).join("/"),
                    ]
                });
                let mut out = format!("revision {}\n", s(&v["revision"]));
                out.push_str(&table(
                    &[
                        "KIND",
                        "NAME",
                        "RULES",
                        "REVISION",
                        "STATUS",
                        "FWD/DROP/AUDIT",
                    ],
                    &rows,
                ));
                for (f, e) in v["manifest_errors"].as_object().into_iter().flatten() {
                    out.push_str(&format!("manifest error: {f}: {}\n", s(e)));
                }
                out
            }),
        ),
        ClientCall::Identity(IdentityCommand::List) => (
            request(sock, "GET", "/v1/identities", None)?,
            Box::new(|v| {
                table(
                    &["ID", "KIND", "LABELS"],
                    &rows(v, |i| cells(i, &["id", "kind", "labels"])),
                )
            }),
        ),
        ClientCall::Bpf(BpfCommand::Ipcache {
            command: BpfIpcacheCommand::List,
        }) => (
            request(sock, "GET", "/v1/bpf/ipcache", None)?,
            Box::new(|v| {
                table(
                    &["PREFIX", "IDENTITY"],
                    &rows(v, |e| cells(e, &["prefix", "identity"])),
                )
            }),
        ),
        ClientCall::Bpf(BpfCommand::Policy {
            command: BpfPolicyCommand::Get { id },
        }) => (
            request(sock, "GET", &format!("/v1/bpf/policy/{id}"), None)?,
            Box::new(|v| {
                let rows = rows(&v["entries"], |e| {
                    let proto = crate::policy::rule::protocol_name(
                        e["protocol"].as_u64().unwrap_or(0) as u8,
                    );
                    let (lo, hi) = (&e["port_range"][0], &e["port_range"][1]);
                    let ports = if lo == hi {
                        s(lo)
                    } else if lo == 0 && hi == 65535 {
                        "ANY".into()
                    } else {
                        format!("{}-{}", s(lo), s(hi))
                    };
                    vec![
                        if e["deny"] == Value::Bool(true) {
                            "deny".into()
                        } else {
                            "allow".into()
                        },
                        s(&e["direction"]),
                        s(&e["identity"]),
                        proto,
                        ports,
                        s(&e["packets"]),
                        s(&e["bytes"]),
                    ]
                });
                let f = &v["flags"];
                let mut out = format!(
                    "endpoint {}: ingress default {}, egress default {}{}\n",
                    s(&v["endpoint"]),
                    flag(&f["ingress_default_deny"], "deny", "allow"),
                    flag(&f["egress_default_deny"], "deny", "allow"),
                    flag(&f["drop_all"], ", DROPPING ALL (policy not realized)", "")
                );
                out.push_str(&table(
                    &[
                        "VERDICT",
                        "DIRECTION",
                        "IDENTITY",
                        "PROTO",
                        "PORT",
                        "PACKETS",
                        "BYTES",
                    ],
                    &rows,
                ));
                out
            }),
        ),
        ClientCall::ServiceList => (
            request(sock, "GET", "/v1/services", None)?,
            Box::new(|v| table(&["ID", "FRONTEND", "SERVICE", "BACKENDS"], &service_rows(v))),
        ),
        ClientCall::FqdnCacheList => (
            request(sock, "GET", "/v1/fqdn/cache", None)?,
            Box::new(|v| {
                let rows = rows(v, |n| {
                    let list = |k: &str| {
                        let items: Vec<String> = rows(&n[k], |x| vec![s(x)]).concat();
                        items.join(",")
                    };
                    vec![
                        s(&n["name"]),
                        list("ips"),
                        s(&n["expires_at"]),
                        list("endpoints"),
                    ]
                });
                table(&["NAME", "IPS", "EXPIRES_AT", "ENDPOINTS"], &rows)
            }),
        ),
    };
    Ok(match opts.output {
        Output::Json => {
            let v = parse(&body);
            format!("{}\n", serde_json::to_string_pretty(&v).unwrap_or(body))
        }
        Output::Table => render(&parse(&body)),
    })
}
