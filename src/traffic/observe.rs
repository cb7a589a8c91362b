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
use crate::policy::identity::{reserved_name, NumericIdentity, IDENTITY_HOST};

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

/// What one ends' identity and address make a peer: a pod by its identity's labels, anything
/// else by its reserved name (`world` for every outside address, whatever CIDR identities
/// policies made of it), its address and the names it was learned under.
fn peer_of(engine: &PolicyEngine, id: NumericIdentity, ip: IpAddr, pod: Option<&String>) -> Peer {
    let info = engine.identity(id).filter(|_| reserved_name(id).is_none());
    let pod_labels = info.filter(|i| i.cidr.is_none());
    if let Some(i) = pod_labels {
        let mut p = Peer::new(
            i.labels.iter().map(|l| l.to_string()).collect(),
            None,
            vec![],
        );
        if p.is_pod() {
            p.pod = pod.cloned();
            p.ip = Some(ip);
            return p;
        }
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
    let outside = engine.identity(id).is_none_or(|i| i.cidr.is_some()) || id == IDENTITY_HOST;
    let key = (id, outside.then_some(ip));
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
