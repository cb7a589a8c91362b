//! `ciliate policy diff` and `ciliate policy recommend` (interfaces section 16): asked of the
//! agent (its flow history and the policies in force), or answered here from `--flows FILE`
//! by the same functions (`traffic::diff`, `traffic::recommend`).

use std::io::Write;
use std::path::{Path, PathBuf};

use super::{ClientOpts, Output, EXIT_OK, EXIT_UNUSABLE};
use crate::traffic::recommend::Kind;
use crate::traffic::{diff, flowfile, recommend};

/// Exit status: the agent could not be asked (or refused the request).
pub const EXIT_AGENT: i32 = 1;

/// A flow file holds at most this many distinct connections (the agent's own bound).
const FLOWS_MAX: usize = 10_000_000;

/// `ciliate policy diff`'s arguments.
#[derive(Debug, clap::Args)]
pub struct DiffArgs {
    /// The proposed policies (a file, or a directory of manifests: every policy document in
    /// it; other kinds are left out). Each adds a policy or replaces the one of its name.
    #[arg(long, value_name = "FILE|DIR")]
    pub policies: Option<PathBuf>,
    /// A policy to delete: `KIND/NAMESPACE/NAME` (`KIND/NAME` when clusterwide); repeatable.
    #[arg(long = "delete", value_name = "KIND/NS/NAME")]
    pub delete: Vec<String>,
    /// Only connections last seen this recently (`30m`, `24h`); default: all kept.
    #[arg(long, value_name = "DURATION")]
    pub since: Option<String>,
    /// Read the flows from this file (`ciliate monitor -o json`, `hubble observe -o jsonpb`)
    /// instead of asking the agent.
    #[arg(long, value_name = "FILE")]
    pub flows: Option<PathBuf>,
    /// With --flows: the policies that were in force when the flows were observed (FILE|DIR;
    /// without it, none were). The agent knows its own.
    #[arg(long, value_name = "FILE|DIR", requires = "flows")]
    pub in_force: Option<PathBuf>,
    /// The whole cluster's flows: ask this Hubble Observer (`ciliate relay`'s address
    /// `HOST:PORT`, or an agent's `unix://STATE_DIR/hubble.sock`; plain text) for the flows
    /// its agents still keep, and the agent to replay them against its policies.
    /// Repeatable: several agents' Observers read as one cluster.
    #[arg(long, value_name = "ADDR", conflicts_with = "flows")]
    pub server: Vec<String>,
    #[command(flatten)]
    pub client: ClientOpts,
}

/// `ciliate policy recommend`'s arguments.
#[derive(Debug, clap::Args)]
pub struct RecommendArgs {
    /// The namespace whose workloads get policies.
    #[arg(long)]
    pub namespace: String,
    /// Only connections last seen this recently (`30m`, `24h`); default: all kept.
    #[arg(long, value_name = "DURATION")]
    pub since: Option<String>,
    /// Read the flows from this file instead of asking the agent.
    #[arg(long, value_name = "FILE")]
    pub flows: Option<PathBuf>,
    /// The whole cluster's flows, from this Hubble Observer (as `policy diff --server`).
    /// Repeatable: several agents' Observers read as one cluster.
    #[arg(long, value_name = "ADDR", conflicts_with = "flows")]
    pub server: Vec<String>,
    /// The kind of policy written.
    #[arg(long, value_enum, default_value = "CiliumNetworkPolicy")]
    pub kind: Kind,
    #[command(flatten)]
    pub client: ClientOpts,
}

fn now() -> u64 {
    crate::datapath::flows::unix_now_ms() / 1000
}

/// Every document of a file, or of each manifest file of a directory (sorted by name), with
/// where it came from (`dir/a.yaml[1]`); a `kind: List` gives its items
/// (`dir/a.yaml[0].items[2]`).
pub fn read_documents(path: &Path) -> Result<Vec<(String, serde_yaml::Value)>, String> {
    let files = match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| format!("{}: {e}", path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.is_file()
                        && p.file_name().is_some_and(|n| {
                            crate::manifests::read::is_manifest_name(&n.to_string_lossy())
                        })
                })
                .collect();
            files.sort();
            files
        }
        Ok(_) => vec![path.to_path_buf()],
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        for (i, d) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            let v = <serde_yaml::Value as serde::Deserialize>::deserialize(d)
                .map_err(|e| format!("{}: document {i}: {e}", f.display()))?;
            let at = format!("{}[{i}]", f.display());
            // `kubectl get cnp -A -o yaml` writes a List: its items are the documents.
            match v.get("kind").and_then(|k| k.as_str()) {
                Some("List") => {
                    let items = v.get("items").and_then(|i| i.as_sequence());
                    for (j, item) in items.into_iter().flatten().enumerate() {
                        out.push((format!("{at}.items[{j}]"), item.clone()));
                    }
                }
                _ if v.is_null() => {}
                _ => out.push((at, v)),
            }
        }
    }
    Ok(out)
}

/// The flows of a file, with what was read and skipped said on stderr (nothing left out
/// silently).
fn read_flows(path: &Path) -> Result<flowfile::Read, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let read = flowfile::read(&text, &path.display().to_string(), FLOWS_MAX)?;
    eprintln!(
        "{}: {} flows that opened a connection; {} lines skipped (replies, established \
         packets, flows of no known direction, other events)",
        path.display(),
        read.flows,
        read.skipped
    );
    Ok(read)
}

/// The flows Hubble Observers (a relay, or agents) keep, last seen within `since`, as one
/// history (a connection two agents saw, each at its end, is one).
fn observer_flows(
    servers: &[String],
    since: Option<&str>,
) -> Result<crate::traffic::history::FlowHistory, String> {
    use crate::hubble::proto::observer as opb;
    let since = since
        .map(|s| crate::traffic::parse_duration("--since", s))
        .transpose()?
        .map(|d| prost_types::Timestamp {
            seconds: now().saturating_sub(d) as i64,
            nanos: 0,
        });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let mut h = crate::traffic::history::FlowHistory::new(u64::MAX, FLOWS_MAX);
    for server in servers {
        rt.block_on(async {
            let ch = crate::hubble::relay::channel(server, None)?;
            let mut c = opb::observer_client::ObserverClient::new(ch);
            let req = opb::GetFlowsRequest {
                since,
                ..Default::default()
            };
            let failed = |e: tonic::Status| format!("{server}: GetFlows: {}", e.message());
            let mut stream = c.get_flows(req).await.map_err(failed)?.into_inner();
            while let Some(r) = stream.message().await.map_err(failed)? {
                if let Some(opb::get_flows_response::ResponseTypes::Flow(f)) = r.response_types {
                    flowfile::observer_flow(&mut h, &f)?;
                }
            }
            Ok::<(), String>(())
        })?;
    }
    Ok(h)
}

fn in_force(path: Option<&Path>) -> Result<Vec<crate::policy::translate::ParsedPolicy>, String> {
    let Some(path) = path else {
        return Ok(vec![]);
    };
    let docs = read_documents(path)?;
    diff::policies(&docs)
}

/// Runs `policy diff`, printing the report (text, or JSON with `-o json`).
pub fn run_diff(a: &DiffArgs, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let fail = |err: &mut dyn Write, e: String, code| {
        let _ = writeln!(err, "error: {e}");
        code
    };
    let docs = match a.policies.as_deref().map(read_documents).transpose() {
        Ok(d) => d.unwrap_or_default(),
        Err(e) => return fail(err, e, EXIT_UNUSABLE),
    };
    let report = match &a.flows {
        Some(path) => {
            let run = || -> Result<diff::DiffReport, String> {
                let proposal = diff::proposal(&docs, &a.delete)?;
                let since = diff::since_secs(a.since.as_deref(), now())?;
                let read = read_flows(path)?;
                diff::diff(
                    &read.history,
                    since,
                    in_force(a.in_force.as_deref())?,
                    &proposal,
                )
            };
            match run() {
                Ok(r) => r,
                Err(e) => return fail(err, e, EXIT_UNUSABLE),
            }
        }
        None => {
            let docs: Vec<(String, serde_json::Value)> = docs
                .into_iter()
                .filter_map(|(at, v)| serde_json::to_value(v).ok().map(|j| (at, j)))
                .collect();
            let mut body =
                serde_json::json!({"documents": docs, "delete": a.delete, "since": a.since});
            if !a.server.is_empty() {
                match observer_flows(&a.server, a.since.as_deref()) {
                    Ok(h) => body["connections"] = serde_json::json!(h.connections(0)),
                    Err(e) => return fail(err, e, EXIT_AGENT),
                }
            }
            let sent = crate::client::request(
                &a.client.socket,
                "POST",
                "/v1/policy/diff",
                Some(&body.to_string()),
            );
            let parsed = sent.map_err(|e| e.to_string()).and_then(|t| {
                serde_json::from_str::<diff::DiffReport>(&t).map_err(|e| e.to_string())
            });
            match parsed {
                Ok(r) => r,
                Err(e) => return fail(err, e, EXIT_AGENT),
            }
        }
    };
    let text = match a.client.output {
        Output::Json => serde_json::to_string_pretty(&report).unwrap_or_default() + "\n",
        Output::Table => diff::render(&report),
    };
    let _ = out.write_all(text.as_bytes());
    EXIT_OK
}

/// Runs `policy recommend`, printing YAML.
pub fn run_recommend(a: &RecommendArgs, out: &mut dyn Write, err: &mut dyn Write) -> i32 {
    let yaml = match (&a.flows, a.server.is_empty()) {
        (None, false) => match observer_flows(&a.server, a.since.as_deref()) {
            Ok(h) => recommend::recommend(&h, 0, &a.namespace, a.kind),
            Err(e) => {
                let _ = writeln!(err, "error: {e}");
                return EXIT_AGENT;
            }
        },
        (Some(path), _) => {
            let run = || -> Result<String, String> {
                let since = diff::since_secs(a.since.as_deref(), now())?;
                let read = read_flows(path)?;
                Ok(recommend::recommend(
                    &read.history,
                    since,
                    &a.namespace,
                    a.kind,
                ))
            };
            match run() {
                Ok(y) => y,
                Err(e) => {
                    let _ = writeln!(err, "error: {e}");
                    return EXIT_UNUSABLE;
                }
            }
        }
        (None, true) => {
            let kind = match a.kind {
                Kind::CiliumNetworkPolicy => "CiliumNetworkPolicy",
                Kind::NetworkPolicy => "NetworkPolicy",
            };
            let mut q = vec![("namespace", a.namespace.as_str()), ("kind", kind)];
            if let Some(s) = &a.since {
                q.push(("since", s));
            }
            let path = format!(
                "/v1/policy/recommend?{}",
                serde_urlencoded::to_string(&q).unwrap_or_default()
            );
            match crate::client::request(&a.client.socket, "GET", &path, None) {
                Ok(y) => y,
                Err(e) => {
                    let _ = writeln!(err, "error: {e}");
                    return EXIT_AGENT;
                }
            }
        }
    };
    if a.client.output == Output::Json {
        return match as_json_list(&yaml) {
            Ok(json) => {
                // The comments (what the recommendation is based on) are not lost.
                yaml.lines()
                    .filter(|l| l.starts_with('#'))
                    .for_each(|l| drop(writeln!(err, "{l}")));
                let _ = writeln!(out, "{json}");
                EXIT_OK
            }
            Err(e) => {
                let _ = writeln!(err, "error: the recommendation as JSON: {e}");
                EXIT_UNUSABLE
            }
        };
    }
    let _ = out.write_all(yaml.as_bytes());
    EXIT_OK
}

/// The recommended policies as one JSON object, a `List` of them (as `kubectl get -o json`
/// prints several: `kubectl apply -f` takes it).
fn as_json_list(yaml: &str) -> Result<serde_json::Value, String> {
    use serde::Deserialize;
    let mut items = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let v = serde_json::Value::deserialize(doc).map_err(|e| e.to_string())?;
        if !v.is_null() {
            items.push(v);
        }
    }
    Ok(serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_gives_its_items_and_each_document_says_where_it_came_from() {
        let dir = tempfile::tempdir().unwrap();
        let cnp = |name: &str| {
            format!(
                "apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {{name: {name}, namespace: x}}\n\
                 spec: {{endpointSelector: {{}}, ingress: [{{}}]}}\n"
            )
        };
        let list = format!(
            "apiVersion: v1\nkind: List\nitems:\n- {}\n- {}\n",
            cnp("p1").replace('\n', "\n  "),
            cnp("p2").replace('\n', "\n  ")
        );
        std::fs::write(
            dir.path().join("a.yaml"),
            format!("{list}---\n{}", cnp("p3")),
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not a manifest").unwrap();
        let docs = read_documents(dir.path()).unwrap();
        let at: Vec<&str> = docs
            .iter()
            .map(|(a, _)| a.rsplit('/').next().unwrap())
            .collect();
        assert_eq!(
            at,
            vec!["a.yaml[0].items[0]", "a.yaml[0].items[1]", "a.yaml[1]"]
        );
        let names: Vec<String> = diff::policies(&docs)
            .unwrap()
            .iter()
            .map(|p| p.key.name.clone())
            .collect();
        assert_eq!(names, vec!["p1", "p2", "p3"]);
    }
}
