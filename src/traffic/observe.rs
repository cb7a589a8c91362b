//! What the agent observes, into the flow history: the connection of each flow a policy
//! decided, with both ends as the engine knows them (`record`), and the same ends added to a
//! flow as `ciliate monitor -o json` serves it (`with_labels`). Pure but for the lock the
//! history is shared behind; the agent's recorder thread (`agent::history`) drives it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use super::history::{FlowHistory, Observation};
use super::Peer;
use crate::datapath::events::VerdictEvent;
use crate::policy::engine::PolicyEngine;
use crate::policy::identity::{reserved_name, NumericIdentity};

/// The history the API reads and the recorder writes.
#[derive(Clone)]
pub struct SharedHistory(Arc<Mutex<FlowHistory>>);

impl SharedHistory {
    pub fn new(h: FlowHistory) -> SharedHistory {
        SharedHistory(Arc::new(Mutex::new(h)))
    }

    pub fn lock(&self) -> MutexGuard<'_, FlowHistory> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Default for SharedHistory {
    fn default() -> Self {
        SharedHistory::new(FlowHistory::new(0, 1))
    }
}

/// The identity's labels when it is one the agent allocated from labels (a pod's, a class of
/// nodes'), not a reserved or a CIDR one.
fn allocated(engine: &PolicyEngine, id: NumericIdentity) -> Option<&crate::policy::labels::Labels> {
    let i = engine.identity(id)?;
    (reserved_name(id).is_none() && i.cidr.is_none()).then_some(&*i.labels)
}

/// What one ends' identity and address make a peer: a pod (or any identity made of labels) by
/// its labels, anything else by its reserved name (`world` for every outside address, whatever
/// CIDR identities policies made of it), its address and the names it was learned under.
fn peer_of(engine: &PolicyEngine, id: NumericIdentity, ip: IpAddr, pod: Option<&String>) -> Peer {
    if let Some(labels) = allocated(engine, id) {
        let mut p = Peer::new(
            labels.iter().map(|l| l.to_string()).collect(),
            Some(ip),
            vec![],
        );
        if p.is_pod() {
            p.pod = pod.cloned();
        }
        return p;
    }
    let name = match reserved_name(id) {
        Some(n) if !n.starts_with("world") => n,
        _ => "world",
    };
    let names = match name {
        "world" => engine
            .fqdn_names_of(ip)
            .map(|n| n.iter().cloned().collect())
            .unwrap_or_default(),
        _ => vec![],
    };
    Peer::new(vec![format!("reserved:{name}")], Some(ip), names)
}

/// Peers already made this round, by identity (and address, outside the pods). Emptied every
/// few seconds, and whenever the history renumbers its peers.
pub type PeerCache = HashMap<(NumericIdentity, Option<IpAddr>), u32>;

fn peer_index(
    h: &mut FlowHistory,
    cache: &mut PeerCache,
    engine: &PolicyEngine,
    id: NumericIdentity,
    ip: IpAddr,
    pod: Option<&String>,
) -> u32 {
    // A pod's identity is its peer whatever its address; anything else is one per address.
    let pod_identity = allocated(engine, id)
        .is_some_and(|l| l.get(crate::policy::labels::POD_NAMESPACE_LABEL).is_some());
    let key = (id, (!pod_identity).then_some(ip));
    if let Some(i) = cache.get(&key) {
        return *i;
    }
    let i = h.peer(peer_of(engine, id, ip, pod));
    cache.insert(key, i);
    i
}

/// A policy-decided flow's ends: each one's identity and address, whether it was judged at
/// the source's egress, and its protocol number.
struct Ends {
    src: (NumericIdentity, IpAddr),
    dst: (NumericIdentity, IpAddr),
    egress: bool,
    proto: u8,
}

fn ends(engine: &PolicyEngine, ev: &VerdictEvent) -> Option<Ends> {
    if ev.kind != "flow" || ev.match_kind.is_none() {
        return None;
    }
    let (direction, proto) = ev.decision_inputs()?;
    let s = ev.source.parse::<IpAddr>().ok()?;
    let d = ev.destination.parse::<IpAddr>().ok()?;
    let egress = direction == crate::policy::rule::Direction::Egress;
    let (src_id, dst_id) = match egress {
        true => (engine.identity_of_ip(s), ev.peer_identity),
        false => (ev.peer_identity, engine.identity_of_ip(d)),
    };
    Some(Ends {
        src: (src_id, s),
        dst: (dst_id, d),
        egress,
        proto,
    })
}

/// The flow with both ends' labels and DNS names, as `ciliate monitor -o json` shows it (what
/// `policy diff|recommend --flows FILE` read back); other records as they are.
pub fn with_labels<'a>(
    engine: &PolicyEngine,
    ev: &'a VerdictEvent,
) -> std::borrow::Cow<'a, VerdictEvent> {
    let Some(e) = ends(engine, ev) else {
        return std::borrow::Cow::Borrowed(ev);
    };
    let src = peer_of(engine, e.src.0, e.src.1, None);
    let dst = peer_of(engine, e.dst.0, e.dst.1, None);
    let mut out = ev.clone();
    out.labels = Some(Box::new(crate::datapath::events::FlowLabels {
        source: src.labels.to_vec(),
        destination: dst.labels.to_vec(),
        source_names: src.names,
        destination_names: dst.names,
    }));
    std::borrow::Cow::Owned(out)
}

/// Records one flow, when a policy decided it.
pub fn record(
    h: &mut FlowHistory,
    cache: &mut PeerCache,
    engine: &PolicyEngine,
    ev: &VerdictEvent,
    now: u64,
) {
    let Some(Ends {
        src: (src_id, s),
        dst: (dst_id, d),
        egress,
        proto,
    }) = ends(engine, ev)
    else {
        return;
    };
    let src = peer_index(h, cache, engine, src_id, s, ev.source_pod.as_ref());
    let dst = peer_index(h, cache, engine, dst_id, d, ev.destination_pod.as_ref());
    h.record(Observation {
        src,
        dst,
        proto,
        port: ev.port,
        egress,
        dropped: ev.verdict == "dropped",
        policies: &ev.policies,
        // When the agent received it, as monitor shows it (so a file of the same flows gives
        // the same first and last seen); now for a record without one.
        now: ev
            .time
            .as_deref()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map_or(now, |t| t.timestamp().max(0) as u64),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::identity::IDENTITY_WORLD_IPV4;
    use crate::policy::labels::Labels;

    fn flow(src: &str, dst: &str, peer: NumericIdentity, port: u16) -> VerdictEvent {
        let mut ev = crate::datapath::events::lost_event(0);
        ev.kind = "flow".into();
        ev.lost = None;
        ev.direction = "egress".into();
        ev.protocol = "TCP".into();
        ev.port = port;
        ev.verdict = "forwarded".into();
        ev.reason = "policy".into();
        ev.match_kind = Some("l3-l4".into());
        ev.source = src.into();
        ev.destination = dst.into();
        ev.source_pod = Some("x/a-1".into());
        ev.peer_identity = peer;
        ev
    }

    #[test]
    fn a_pod_is_one_peer_and_every_outside_address_one_of_its_own() {
        let mut engine = PolicyEngine::new();
        let labels = Labels::for_pod("x", [(&"app".to_string(), &"a".to_string())], [], None);
        let a = engine.allocate_identity(&labels).id();
        for ip in ["10.0.0.1", "10.0.0.2"] {
            engine.upsert_endpoint_ip(ip.parse().unwrap(), a);
        }
        engine.learn_fqdn("api.example", &["203.0.113.9".parse().unwrap()]);
        let mut h = FlowHistory::new(3600, 100);
        let mut cache = PeerCache::default();
        for (src, dst) in [
            ("10.0.0.1", "203.0.113.9"),
            ("10.0.0.2", "203.0.113.9"),
            ("10.0.0.1", "198.51.100.7"),
        ] {
            record(
                &mut h,
                &mut cache,
                &engine,
                &flow(src, dst, IDENTITY_WORLD_IPV4, 443),
                10,
            );
        }
        let c = h.connections(0);
        assert_eq!(c.len(), 2, "both pods of a are one workload: {c:?}");
        assert_eq!(c[0].count, 2);
        assert_eq!(c[0].source.pod.as_deref(), Some("x/a-1"));
        let outside: Vec<_> = c
            .iter()
            .map(|c| (c.destination.ip, c.destination.names.clone()))
            .collect();
        assert_eq!(
            outside,
            vec![
                (
                    Some("203.0.113.9".parse().unwrap()),
                    vec!["api.example".to_string()]
                ),
                (Some("198.51.100.7".parse().unwrap()), vec![]),
            ],
            "each outside address is a peer of its own, with the names it was learned under"
        );
        assert!(c
            .iter()
            .all(|c| c.destination.labels.as_ref() == ["reserved:world".to_string()]));
        // monitor's JSON carries the same ends.
        let ev = flow("10.0.0.1", "203.0.113.9", IDENTITY_WORLD_IPV4, 443);
        let shown = with_labels(&engine, &ev);
        let ends = shown.labels.as_ref().unwrap();
        assert!(ends.source.contains(&"k8s:app=a".to_string()));
        assert_eq!(ends.destination_names, vec!["api.example".to_string()]);
    }
}
