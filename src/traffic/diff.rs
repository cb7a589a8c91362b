//! `ciliate policy diff`: every observed connection judged against the policies in force and
//! against them with a change applied; the connections whose verdict flips, newly dropped
//! first, each with the policies that decide it after the change.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::history::{verdict_word, FlowHistory};
use super::replay::Replay;
use super::Connection;
use crate::policy::attribution::PolicyRef;
use crate::policy::rule::{PolicyKey, PolicyKind};
use crate::policy::translate::ParsedPolicy;

/// The change: policies added or replaced (by their key), and policies deleted.
#[derive(Debug, Clone, Default)]
pub struct Proposal {
    pub upserts: Vec<ParsedPolicy>,
    pub deletes: Vec<PolicyKey>,
}

/// `--delete KIND/NAMESPACE/NAME` (`KIND/NAME` for a clusterwide kind).
pub fn parse_delete(s: &str) -> Result<PolicyKey, String> {
    let parts: Vec<&str> = s.split('/').collect();
    let kind = PolicyKind::from_kind(parts[0]).ok_or_else(|| {
        format!(
            "--delete {s:?}: {:?} is not a policy kind ciliate reads",
            parts[0]
        )
    })?;
    match (kind.is_namespaced(), parts.as_slice()) {
        (true, [_, ns, name]) if !ns.is_empty() && !name.is_empty() => {
            Ok(PolicyKey::new(kind, Some(ns), name))
        }
        (false, [_, name]) if !name.is_empty() => Ok(PolicyKey::new(kind, None, name)),
        (true, _) => Err(format!(
            "--delete {s:?}: expected {}/NAMESPACE/NAME",
            parts[0]
        )),
        (false, _) => Err(format!("--delete {s:?}: expected {}/NAME", parts[0])),
    }
}

/// `KIND/NAMESPACE/NAME`, as `--delete` takes it.
pub fn key_text(k: &PolicyKey) -> String {
    match &k.namespace {
        Some(ns) => format!("{}/{ns}/{}", k.kind.as_str(), k.name),
        None => format!("{}/{}", k.kind.as_str(), k.name),
    }
}

/// The proposal from policy documents (each with where it came from, for errors) and
/// `--delete` arguments. A document that is not a policy kind is left out (a directory of
/// manifests holds Deployments too); a policy that does not validate is an error naming the
/// document and its field: a diff of half a proposal would mislead.
pub fn proposal(
    docs: &[(String, serde_yaml::Value)],
    deletes: &[String],
) -> Result<Proposal, String> {
    let mut p = Proposal {
        upserts: policies(docs)?,
        deletes: vec![],
    };
    for d in deletes {
        p.deletes.push(parse_delete(d)?);
    }
    if p.upserts.is_empty() && p.deletes.is_empty() {
        return Err("nothing proposed: no policy document and no --delete".into());
    }
    Ok(p)
}

/// The policy documents among `docs`, validated (other kinds left out; a policy twice, or
/// one that does not validate, is an error naming the document).
pub fn policies(docs: &[(String, serde_yaml::Value)]) -> Result<Vec<ParsedPolicy>, String> {
    let mut out: Vec<ParsedPolicy> = Vec::new();
    for (location, doc) in docs {
        let kind = doc.get("kind").and_then(|k| k.as_str()).unwrap_or_default();
        if PolicyKind::from_kind(kind).is_none() {
            continue;
        }
        let parsed = crate::policy::translate::parse_policy(doc, "default", location)
            .map_err(|e| format!("{location}: {e}"))?;
        if out.iter().any(|q| q.key == parsed.key) {
            return Err(format!(
                "{location}: {kind} {} is given twice",
                parsed.key.short()
            ));
        }
        out.push(parsed);
    }
    Ok(out)
}

/// `--since DUR` as unix seconds (none: everything kept).
pub fn since_secs(since: Option<&str>, now: u64) -> Result<u64, String> {
    match since {
        None => Ok(0),
        Some(s) => Ok(now.saturating_sub(super::parse_duration("--since", s)?)),
    }
}

/// The policies in force with the proposal applied. Deleting a policy that is not in force is
/// an error (a mistyped name must not read as "nothing changes").
pub fn apply(in_force: &[ParsedPolicy], p: &Proposal) -> Result<Vec<ParsedPolicy>, String> {
    for k in &p.deletes {
        if !in_force.iter().any(|q| q.key.as_ref() == k) {
            return Err(format!(
                "--delete {}: no such policy is in force",
                key_text(k)
            ));
        }
    }
    let replaced: BTreeSet<&PolicyKey> = p.upserts.iter().map(|q| q.key.as_ref()).collect();
    let mut out: Vec<ParsedPolicy> = in_force
        .iter()
        .filter(|q| !replaced.contains(q.key.as_ref()) && !p.deletes.contains(&q.key))
        .cloned()
        .collect();
    out.extend(p.upserts.iter().cloned());
    Ok(out)
}

/// One connection whose verdict the change flips.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Flip {
    /// The connection as observed (its verdict: the last one seen).
    #[serde(flatten)]
    pub connection: Connection,
    /// Replayed against the policies in force, and with the change.
    pub before: String,
    pub after: String,
    /// The policies that decide it after the change (empty: no policy selects either end).
    pub by: Vec<PolicyRef>,
}

/// What `policy diff` prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffReport {
    /// Connections replayed (observed since `since`).
    pub connections: usize,
    pub since: u64,
    pub policies_in_force: usize,
    pub policies_after: usize,
    pub newly_dropped: usize,
    pub newly_forwarded: usize,
    /// Connections whose replay against the policies in force differs from the verdict last
    /// observed (policies changed since, or the policies in force are not the ones that
    /// judged these flows).
    pub replay_differs_from_observed: usize,
    pub flips: Vec<Flip>,
}

/// The diff of `history` (connections last seen at or after `since`) under `proposal`.
pub fn diff(
    history: &FlowHistory,
    since: u64,
    in_force: Vec<ParsedPolicy>,
    proposal: &Proposal,
) -> Result<DiffReport, String> {
    let after_policies = apply(&in_force, proposal)?;
    let (policies_in_force, policies_after) = (in_force.len(), after_policies.len());
    let mut before = Replay::new(history.peers(), in_force);
    let mut after = Replay::new(history.peers(), after_policies);
    let mut report = DiffReport {
        connections: 0,
        since,
        policies_in_force,
        policies_after,
        newly_dropped: 0,
        newly_forwarded: 0,
        replay_differs_from_observed: 0,
        flips: vec![],
    };
    for v in history.iter_since(since) {
        report.connections += 1;
        let b = before.dropped(v.src, v.dst, v.proto, v.port);
        report.replay_differs_from_observed += (b != v.dropped) as usize;
        let a = after.dropped(v.src, v.dst, v.proto, v.port);
        if a == b {
            continue;
        }
        let judged = after.judge(v.src, v.dst, v.proto, v.port);
        match a {
            true => report.newly_dropped += 1,
            false => report.newly_forwarded += 1,
        }
        report.flips.push(Flip {
            connection: v.to_connection(),
            before: verdict_word(b).into(),
            after: verdict_word(a).into(),
            by: judged.policies(),
        });
    }
    report.flips.sort_by(|x, y| {
        let key = |f: &Flip| {
            (
                f.after != "dropped",
                std::cmp::Reverse(f.connection.count),
                std::cmp::Reverse(f.connection.last_seen),
            )
        };
        key(x).cmp(&key(y)).then_with(|| {
            let c = |f: &Flip| {
                (
                    f.connection.source.clone(),
                    f.connection.destination.clone(),
                    f.connection.protocol.clone(),
                    f.connection.port,
                )
            };
            c(x).cmp(&c(y))
        })
    });
    Ok(report)
}

/// The report in words, one line per flip.
pub fn render(r: &DiffReport) -> String {
    let mut out = format!(
        "{} connection(s) would be newly dropped, {} newly forwarded, of {} observed{} \
         ({} policies in force, {} with the change)\n",
        r.newly_dropped,
        r.newly_forwarded,
        r.connections,
        match r.since {
            0 => String::new(),
            s => format!(" since {}", super::rfc3339(s)),
        },
        r.policies_in_force,
        r.policies_after,
    );
    if r.replay_differs_from_observed > 0 {
        out.push_str(&format!(
            "note: for {} connection(s) the policies in force give another verdict than the one \
             observed (policies changed since, or other policies judged them)\n",
            r.replay_differs_from_observed
        ));
    }
    for f in &r.flips {
        let c = &f.connection;
        let by: Vec<String> = f.by.iter().map(PolicyRef::named).collect();
        let by = match by.is_empty() {
            true => "no policy selects either end".to_string(),
            false => by.join(", "),
        };
        out.push_str(&format!(
            "{:<9} {} -> {} {}/{}  seen {} time(s), last {}  by {by}\n",
            f.after.to_uppercase(),
            c.source.describe(),
            c.destination.describe(),
            c.protocol,
            c.port,
            c.count,
            super::rfc3339(c.last_seen),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::translate::parse_policy;
    use crate::traffic::history::Observation;
    use crate::traffic::Peer;

    fn pod(ns: &str, app: &str, name: &str) -> Peer {
        Peer {
            pod: Some(format!("{ns}/{name}")),
            ..Peer::new(
                vec![
                    format!("k8s:app={app}"),
                    format!("k8s:io.kubernetes.pod.namespace={ns}"),
                ],
                None,
                vec![],
            )
        }
    }

    fn policy(yaml: &str) -> ParsedPolicy {
        parse_policy(&serde_yaml::from_str(yaml).unwrap(), "default", "test").unwrap()
    }

    const ALLOW_A_TO_B: &str = "
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: b-from-a, namespace: y}
spec:
  endpointSelector: {matchLabels: {app: b}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: a, k8s:io.kubernetes.pod.namespace: x}}]
    toPorts: [{ports: [{port: '80', protocol: TCP}]}]
";

    #[test]
    fn a_new_default_deny_names_what_it_drops_and_a_deletion_what_it_frees() {
        let mut h = FlowHistory::new(86_400, 1000);
        let a = h.peer(pod("x", "a", "a-1"));
        let c = h.peer(pod("x", "c", "c-1"));
        let b = h.peer(pod("y", "b", "b-1"));
        let seen = |h: &mut FlowHistory, src, port, n: u64| {
            for t in 0..n {
                h.record(Observation {
                    src,
                    dst: b,
                    proto: 6,
                    port,
                    egress: true,
                    dropped: false,
                    policies: &[],
                    now: 1000 + t,
                });
            }
        };
        seen(&mut h, a, 80, 3);
        seen(&mut h, a, 81, 1);
        seen(&mut h, c, 80, 5);
        let p = Proposal {
            upserts: vec![policy(ALLOW_A_TO_B)],
            deletes: vec![],
        };
        let r = diff(&h, 0, vec![], &p).unwrap();
        assert_eq!(
            (r.connections, r.newly_dropped, r.newly_forwarded),
            (3, 2, 0)
        );
        assert_eq!(r.replay_differs_from_observed, 0);
        // The busier first: c -> b:80 (5), then a -> b:81 (1); a -> b:80 stays allowed.
        let flips: Vec<(&str, u16)> = r
            .flips
            .iter()
            .map(|f| {
                (
                    f.connection.source.pod.as_deref().unwrap(),
                    f.connection.port,
                )
            })
            .collect();
        assert_eq!(flips, vec![("x/c-1", 80), ("x/a-1", 81)]);
        let by = &r.flips[0].by;
        assert_eq!(by.len(), 1);
        assert_eq!((by[0].name.as_str(), by[0].rule), ("b-from-a", None));
        let text = render(&r);
        assert!(
            text.contains("DROPPED   x/c-1 (app=c) -> y/b-1 (app=b) TCP/80  seen 5 time(s)"),
            "{text}"
        );
        // Deleting it again frees exactly those.
        let del = Proposal {
            upserts: vec![],
            deletes: vec![parse_delete("CiliumNetworkPolicy/y/b-from-a").unwrap()],
        };
        let r = diff(&h, 0, vec![policy(ALLOW_A_TO_B)], &del).unwrap();
        assert_eq!((r.newly_dropped, r.newly_forwarded), (0, 2));
        assert_eq!(
            r.replay_differs_from_observed, 2,
            "observed without the policy"
        );
        assert!(r.flips.iter().all(|f| f.by.is_empty()));
    }

    #[test]
    fn deletions_are_checked_by_name() {
        assert!(parse_delete("CiliumNetworkPolicy/y")
            .unwrap_err()
            .contains("NAMESPACE/NAME"));
        assert!(parse_delete("Pod/y/p")
            .unwrap_err()
            .contains("not a policy kind"));
        let k = parse_delete("CiliumClusterwideNetworkPolicy/all").unwrap();
        assert_eq!(key_text(&k), "CiliumClusterwideNetworkPolicy/all");
        let e = apply(
            &[],
            &Proposal {
                upserts: vec![],
                deletes: vec![k],
            },
        )
        .unwrap_err();
        assert!(e.contains("no such policy is in force"), "{e}");
    }
}
