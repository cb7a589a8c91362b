//! `--flows FILE`: flows read from a file instead of an agent, into a [`FlowHistory`]. Two
//! forms, told apart line by line:
//! - `ciliate monitor -o json`: flow events (`"type": "flow"`) with the `labels` of both ends;
//! - Hubble's `hubble observe -o jsonpb` (and `-o json`): one `{"flow": {...}}` per line, with
//!   Hubble's field names (`traffic_direction`, `egress_allowed_by`, ...; lowerCamelCase too).
//!
//! Only what decided a new connection counts: for TCP the packet with SYN and without ACK (a
//! flow without flags counts too), never a reply nor a flow of no known direction (Hubble's
//! `TRAFFIC_DIRECTION_UNKNOWN`, left out of jsonpb: no policy decided it). Other lines (DNS, L7, notifications, lost
//! events) are skipped; a line that is not JSON, or a flow without what a connection needs,
//! is an error naming the line.

use std::net::IpAddr;

use serde::Deserialize;

use super::history::{FlowHistory, Observation};
use super::Peer;
use crate::datapath::events::VerdictEvent;
use crate::hubble::proto::flow as fpb;
use crate::policy::attribution::{PolicyRef, PolicyTier};
use crate::policy::rule::{
    protocol_number, PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP,
};

/// What a file gave.
#[derive(Debug)]
pub struct Read {
    pub history: FlowHistory,
    /// Flows counted, and lines skipped (not flows, replies, established packets).
    pub flows: usize,
    pub skipped: usize,
}

/// Reads every line of `text` (`source` names the file in errors).
pub fn read(text: &str, source: &str, max: usize) -> Result<Read, String> {
    let mut out = Read {
        history: FlowHistory::new(u64::MAX, max),
        flows: 0,
        skipped: 0,
    };
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = || format!("{source}: line {}", i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{}: not JSON: {e}", at()))?;
        let counted = match v.get("flow") {
            Some(f) => hubble_flow(&mut out.history, f).map_err(|e| format!("{}: {e}", at()))?,
            None => monitor_event(&mut out.history, v).map_err(|e| format!("{}: {e}", at()))?,
        };
        match counted {
            true => out.flows += 1,
            false => out.skipped += 1,
        }
    }
    Ok(out)
}

fn unix_secs(t: Option<&str>) -> Result<u64, String> {
    let t = t.ok_or("no time")?;
    chrono::DateTime::parse_from_rfc3339(t)
        .map(|d| d.timestamp().max(0) as u64)
        .map_err(|e| format!("time {t:?}: {e}"))
}

fn monitor_event(h: &mut FlowHistory, v: serde_json::Value) -> Result<bool, String> {
    if v.get("type").and_then(|t| t.as_str()) != Some("flow") || v.get("match").is_none() {
        return Ok(false);
    }
    let ev: VerdictEvent = serde_json::from_value(v).map_err(|e| format!("not a flow: {e}"))?;
    if ev.labels.is_none() && ev.decision_inputs().is_none() {
        // No direction or protocol a policy decides by: the agent shows it without labels
        // and keeps no connection of it (`traffic::observe`); skipped here alike.
        return Ok(false);
    }
    let Some(ends) = &ev.labels else {
        return Err(
            "the flow has no `labels` (recorded by an agent older than this one?): \
                    without them its workloads are unknown"
                .into(),
        );
    };
    let proto = protocol_number(&ev.protocol)
        .ok_or_else(|| format!("protocol {:?}: unknown", ev.protocol))?;
    let ip = |s: &str| {
        s.parse::<IpAddr>()
            .map_err(|_| format!("address {s:?}: not an IP"))
    };
    let mut src = Peer::new(
        ends.source.clone(),
        Some(ip(&ev.source)?),
        ends.source_names.clone(),
    );
    src.pod = ev.source_pod.clone();
    let mut dst = Peer::new(
        ends.destination.clone(),
        Some(ip(&ev.destination)?),
        ends.destination_names.clone(),
    );
    dst.pod = ev.destination_pod.clone();
    let (src, dst) = (h.peer(src), h.peer(dst));
    h.record(Observation {
        src,
        dst,
        proto,
        port: ev.port,
        egress: ev.direction == "egress",
        dropped: ev.verdict == "dropped",
        policies: &ev.policies,
        now: unix_secs(ev.time.as_deref())?,
    });
    Ok(true)
}

/// Hubble's `flow.Flow`, the fields a connection needs (protojson: the proto's names, or
/// lowerCamelCase).
#[derive(Deserialize, Default)]
#[serde(default)]
struct HubbleFlow {
    time: Option<String>,
    verdict: String,
    #[serde(rename = "IP")]
    ip: Option<HubbleIp>,
    l4: Option<HubbleL4>,
    source: Option<HubbleEndpoint>,
    destination: Option<HubbleEndpoint>,
    #[serde(alias = "sourceNames")]
    source_names: Vec<String>,
    #[serde(alias = "destinationNames")]
    destination_names: Vec<String>,
    #[serde(alias = "trafficDirection")]
    traffic_direction: String,
    #[serde(alias = "isReply")]
    is_reply: Option<bool>,
    #[serde(alias = "egressAllowedBy")]
    egress_allowed_by: Vec<HubblePolicy>,
    #[serde(alias = "ingressAllowedBy")]
    ingress_allowed_by: Vec<HubblePolicy>,
    #[serde(alias = "egressDeniedBy")]
    egress_denied_by: Vec<HubblePolicy>,
    #[serde(alias = "ingressDeniedBy")]
    ingress_denied_by: Vec<HubblePolicy>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct HubbleIp {
    source: String,
    destination: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct HubbleL4 {
    #[serde(rename = "TCP")]
    tcp: Option<HubblePorts>,
    #[serde(rename = "UDP")]
    udp: Option<HubblePorts>,
    #[serde(rename = "SCTP")]
    sctp: Option<HubblePorts>,
    #[serde(rename = "ICMPv4")]
    icmpv4: Option<HubbleIcmp>,
    #[serde(rename = "ICMPv6")]
    icmpv6: Option<HubbleIcmp>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct HubblePorts {
    #[serde(alias = "destinationPort")]
    destination_port: u16,
    flags: Option<HubbleTcpFlags>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct HubbleTcpFlags {
    #[serde(rename = "SYN")]
    syn: bool,
    #[serde(rename = "ACK")]
    ack: bool,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct HubbleIcmp {
    #[serde(rename = "type")]
    kind: u8,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct HubbleEndpoint {
    namespace: String,
    labels: Vec<String>,
    #[serde(alias = "podName")]
    pod_name: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct HubblePolicy {
    name: String,
    namespace: String,
    kind: String,
}

impl HubbleL4 {
    /// Protocol, port (ICMP: the type), and whether the packet opens a connection.
    fn what(&self) -> Option<(u8, u16, bool)> {
        let opens = |p: &HubblePorts| p.flags.as_ref().is_none_or(|f| f.syn && !f.ack);
        if let Some(p) = &self.tcp {
            return Some((PROTO_TCP, p.destination_port, opens(p)));
        }
        if let Some(p) = &self.udp {
            return Some((PROTO_UDP, p.destination_port, true));
        }
        if let Some(p) = &self.sctp {
            return Some((PROTO_SCTP, p.destination_port, true));
        }
        if let Some(i) = &self.icmpv4 {
            return Some((PROTO_ICMP, i.kind as u16, true));
        }
        self.icmpv6
            .as_ref()
            .map(|i| (PROTO_ICMPV6, i.kind as u16, true))
    }
}

fn hubble_peer(e: Option<&HubbleEndpoint>, ip: &str, names: &[String]) -> Result<Peer, String> {
    let ip: IpAddr = ip
        .parse()
        .map_err(|_| format!("IP address {ip:?}: not an address"))?;
    let e = e.map_or_else(Default::default, |e| HubbleEndpoint {
        namespace: e.namespace.clone(),
        labels: e.labels.clone(),
        pod_name: e.pod_name.clone(),
    });
    let mut labels = e.labels;
    let ns_label = format!(
        "k8s:{}={}",
        crate::policy::labels::POD_NAMESPACE_LABEL,
        e.namespace
    );
    if !e.namespace.is_empty() && !e.pod_name.is_empty() && !labels.contains(&ns_label) {
        labels.push(ns_label);
    }
    if labels.is_empty() {
        labels.push("reserved:world".into());
    }
    let mut p = Peer::new(labels, Some(ip), names.to_vec());
    if p.is_pod() && !e.pod_name.is_empty() {
        p.pod = Some(format!("{}/{}", e.namespace, e.pod_name));
    }
    Ok(p)
}

fn hubble_policies(list: &[HubblePolicy]) -> Vec<PolicyRef> {
    list.iter()
        .map(|p| PolicyRef {
            kind: p.kind.clone(),
            namespace: (!p.namespace.is_empty()).then(|| p.namespace.clone()),
            name: p.name.clone(),
            rule: None,
            http: None,
            tier: PolicyTier::NetworkPolicy,
        })
        .collect()
}

fn hubble_flow(h: &mut FlowHistory, v: &serde_json::Value) -> Result<bool, String> {
    let f: HubbleFlow =
        serde_json::from_value(v.clone()).map_err(|e| format!("not a Hubble flow: {e}"))?;
    record_hubble(h, f)
}

/// A flow from an Observer (a relay's `GetFlows`, or an agent's), as a file's line would
/// give it: counted when it decided a new connection (`Ok(false)`: skipped).
pub fn observer_flow(h: &mut FlowHistory, f: &fpb::Flow) -> Result<bool, String> {
    use fpb::layer4::Protocol;
    let ports = |dst: u32, flags: Option<&fpb::TcpFlags>| HubblePorts {
        destination_port: dst as u16,
        flags: flags.map(|f| HubbleTcpFlags {
            syn: f.syn,
            ack: f.ack,
        }),
    };
    let mut l4 = HubbleL4::default();
    match f.l4.as_ref().and_then(|l| l.protocol.as_ref()) {
        Some(Protocol::Tcp(t)) => l4.tcp = Some(ports(t.destination_port, t.flags.as_ref())),
        Some(Protocol::Udp(u)) => l4.udp = Some(ports(u.destination_port, None)),
        Some(Protocol::Sctp(s)) => l4.sctp = Some(ports(s.destination_port, None)),
        Some(Protocol::IcmPv4(i)) => {
            l4.icmpv4 = Some(HubbleIcmp {
                kind: i.r#type as u8,
            })
        }
        Some(Protocol::IcmPv6(i)) => {
            l4.icmpv6 = Some(HubbleIcmp {
                kind: i.r#type as u8,
            })
        }
        None => return Ok(false),
    }
    let end = |e: &Option<fpb::Endpoint>| {
        e.as_ref().map(|e| HubbleEndpoint {
            namespace: e.namespace.clone(),
            labels: e.labels.clone(),
            pod_name: e.pod_name.clone(),
        })
    };
    let policies = |l: &[fpb::Policy]| {
        l.iter()
            .map(|p| HubblePolicy {
                name: p.name.clone(),
                namespace: p.namespace.clone(),
                kind: p.kind.clone(),
            })
            .collect()
    };
    let verdict = fpb::Verdict::try_from(f.verdict).map_or("", |v| v.as_str_name());
    let direction =
        fpb::TrafficDirection::try_from(f.traffic_direction).map_or("", |d| d.as_str_name());
    let time = f.time.as_ref().and_then(|t| {
        chrono::DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32).map(|d| d.to_rfc3339())
    });
    record_hubble(
        h,
        HubbleFlow {
            time,
            verdict: verdict.to_string(),
            ip: f.ip.as_ref().map(|i| HubbleIp {
                source: i.source.clone(),
                destination: i.destination.clone(),
            }),
            l4: Some(l4),
            source: end(&f.source),
            destination: end(&f.destination),
            source_names: f.source_names.clone(),
            destination_names: f.destination_names.clone(),
            traffic_direction: direction.to_string(),
            is_reply: f.is_reply,
            egress_allowed_by: policies(&f.egress_allowed_by),
            ingress_allowed_by: policies(&f.ingress_allowed_by),
            egress_denied_by: policies(&f.egress_denied_by),
            ingress_denied_by: policies(&f.ingress_denied_by),
        },
    )
}

fn record_hubble(h: &mut FlowHistory, f: HubbleFlow) -> Result<bool, String> {
    let dropped = match f.verdict.as_str() {
        "FORWARDED" | "AUDIT" => false,
        "DROPPED" => true,
        _ => return Ok(false),
    };
    let (Some(ipf), Some(l4)) = (&f.ip, &f.l4) else {
        return Ok(false);
    };
    let Some((proto, port, opens)) = l4.what() else {
        return Ok(false);
    };
    if f.is_reply == Some(true) || !opens {
        return Ok(false);
    }
    let egress = match f.traffic_direction.as_str() {
        "EGRESS" => true,
        "INGRESS" => false,
        // Hubble does not know the direction (jsonpb leaves the zero value out): a drop before
        // any policy (an invalid packet, a missing route), which decided no connection.
        "" | "TRAFFIC_DIRECTION_UNKNOWN" => return Ok(false),
        other => {
            return Err(format!(
                "traffic_direction {other:?}: neither EGRESS nor INGRESS"
            ))
        }
    };
    let src = hubble_peer(f.source.as_ref(), &ipf.source, &f.source_names)?;
    let dst = hubble_peer(
        f.destination.as_ref(),
        &ipf.destination,
        &f.destination_names,
    )?;
    let policies = match (egress, dropped) {
        (true, false) => hubble_policies(&f.egress_allowed_by),
        (false, false) => hubble_policies(&f.ingress_allowed_by),
        (true, true) => hubble_policies(&f.egress_denied_by),
        (false, true) => hubble_policies(&f.ingress_denied_by),
    };
    let (src, dst) = (h.peer(src), h.peer(dst));
    h.record(Observation {
        src,
        dst,
        proto,
        port,
        egress,
        dropped,
        policies: &policies,
        now: unix_secs(f.time.as_deref())?,
    });
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HUBBLE: &str = r#"{"flow":{"time":"2026-11-29T08:00:01.123456789Z","verdict":"FORWARDED","IP":{"source":"10.0.1.5","destination":"10.0.2.7","ipVersion":"IPv4"},"l4":{"TCP":{"source_port":40000,"destination_port":80,"flags":{"SYN":true}}},"source":{"ID":12,"identity":3001,"namespace":"x","labels":["k8s:app=a","k8s:io.kubernetes.pod.namespace=x"],"pod_name":"a-1"},"destination":{"ID":40,"identity":3002,"namespace":"y","labels":["k8s:app=b","k8s:io.kubernetes.pod.namespace=y"],"pod_name":"b-1"},"Type":"L3_L4","event_type":{"type":5},"traffic_direction":"INGRESS","is_reply":false,"ingress_allowed_by":[{"name":"b-from-a","namespace":"y","kind":"CiliumNetworkPolicy"}]},"node_name":"n2"}
{"flow":{"time":"2026-11-29T08:00:01.2Z","verdict":"FORWARDED","IP":{"source":"10.0.2.7","destination":"10.0.1.5"},"l4":{"TCP":{"source_port":80,"destination_port":40000,"flags":{"SYN":true,"ACK":true}}},"traffic_direction":"INGRESS","is_reply":true}}
{"flow":{"time":"2026-11-29T08:00:02Z","verdict":"DROPPED","IP":{"source":"10.0.1.5","destination":"203.0.113.9"},"l4":{"UDP":{"sourcePort":5000,"destinationPort":53}},"source":{"namespace":"x","labels":["k8s:app=a","k8s:io.kubernetes.pod.namespace=x"],"podName":"a-2"},"destination":{"labels":["reserved:world"]},"destinationNames":["dns.example"],"trafficDirection":"EGRESS","egressDeniedBy":[{"name":"no-dns","namespace":"x","kind":"CiliumNetworkPolicy"}]}}
{"node_status":{"state_change":"NODE_CONNECTED"}}
{"flow":{"time":"2026-11-29T08:00:03Z","verdict":"DROPPED","drop_reason_desc":"INVALID_SOURCE_IP","IP":{"source":"10.0.9.9","destination":"10.0.2.7"},"l4":{"TCP":{"destination_port":80,"flags":{"SYN":true}}},"source":{"labels":["reserved:world"]}}}
{"flow":{"time":"2026-11-29T08:00:04Z","verdict":"DROPPED","IP":{"source":"10.0.9.9","destination":"10.0.2.7"},"l4":{"UDP":{"destination_port":53}},"traffic_direction":"TRAFFIC_DIRECTION_UNKNOWN"}}
"#;

    #[test]
    fn hubble_jsonpb_flows_become_connections() {
        let r = read(HUBBLE, "flows.json", 100).unwrap();
        assert_eq!(
            (r.flows, r.skipped),
            (2, 4),
            "the reply, the node status and the drops of no direction skipped"
        );
        let c = r.history.connections(0);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].source.pod.as_deref(), Some("x/a-1"));
        assert_eq!(c[0].destination.namespace.as_deref(), Some("y"));
        assert_eq!((c[0].protocol.as_str(), c[0].port), ("TCP", 80));
        assert_eq!(c[0].first_seen, 1_795_939_201);
        assert_eq!(c[0].policies[0].name, "b-from-a");
        assert_eq!((c[1].verdict.as_str(), c[1].port), ("dropped", 53));
        assert_eq!(c[1].destination.names, vec!["dns.example".to_string()]);
        assert_eq!(c[1].destination.ip, Some("203.0.113.9".parse().unwrap()));
        // Both pods of workload a are one peer.
        assert_eq!(r.history.peers().len(), 3);
    }

    #[test]
    fn a_bad_line_is_named() {
        let e = read("{}\nnot json\n", "f.json", 10).unwrap_err();
        assert!(e.starts_with("f.json: line 2: not JSON"), "{e}");
        let no_labels = r#"{"type":"flow","timestamp_ns":1,"time":"2026-11-29T08:00:00Z","endpoint":1,"peer_identity":2,"direction":"egress","protocol":"TCP","port":80,"verdict":"forwarded","reason":"policy","source":"10.0.0.1","destination":"10.0.0.2","match":"l3-l4","policies":[]}"#;
        let e = read(no_labels, "m.json", 10).unwrap_err();
        assert!(e.contains("line 1: the flow has no `labels`"), "{e}");
        // One of no direction a policy decides by is skipped, as the agent keeps none.
        let sideways = no_labels.replace("\"egress\"", "\"\"");
        let r = read(&sideways, "m.json", 10).unwrap();
        assert_eq!((r.flows, r.skipped), (0, 1));
        let odd = r#"{"flow":{"time":"2026-11-29T08:00:00Z","verdict":"FORWARDED","IP":{"source":"10.0.0.1","destination":"10.0.0.2"},"l4":{"UDP":{"destination_port":53}},"traffic_direction":"SIDEWAYS"}}"#;
        let e = read(odd, "h.json", 10).unwrap_err();
        assert!(e.contains("line 1: traffic_direction \"SIDEWAYS\""), "{e}");
    }
}
