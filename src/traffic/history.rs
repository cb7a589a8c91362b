//! The distinct connections observed (`--flow-history`): one entry per source, destination,
//! protocol and port, with its counts, first and last seen, the last verdict and the policies
//! that decided it. Peers and policy lists are interned, so an entry is 32 bytes and an index
//! slot 5 (one million connections: about 45 MiB). Bounded: at `max` entries the least
//! recently seen eighth goes; entries older than `keep` go at each `expire`.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use hashbrown::HashTable;
use serde::{Deserialize, Serialize};

use super::{Connection, Peer};
use crate::policy::attribution::PolicyRef;
use crate::policy::rule::protocol_name;

/// One connection's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    src: u32,
    dst: u32,
    port: u16,
    proto: u8,
    dropped: bool,
    /// New connections seen at the source's egress and at the destination's ingress.
    egress: u32,
    ingress: u32,
    first: u32,
    last: u32,
    policies: u32,
}

const ENTRY_BYTES: usize = 32;

impl Entry {
    fn key(&self) -> (u32, u32, u16, u8) {
        (self.src, self.dst, self.port, self.proto)
    }

    fn count(&self) -> u64 {
        self.egress.max(self.ingress) as u64
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.src.to_le_bytes());
        out.extend_from_slice(&self.dst.to_le_bytes());
        out.extend_from_slice(&self.port.to_le_bytes());
        out.push(self.proto);
        out.push(self.dropped as u8);
        for v in [
            self.egress,
            self.ingress,
            self.first,
            self.last,
            self.policies,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    fn read(b: &[u8]) -> Entry {
        let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Entry {
            src: u(0),
            dst: u(4),
            port: u16::from_le_bytes([b[8], b[9]]),
            proto: b[10],
            dropped: b[11] != 0,
            egress: u(12),
            ingress: u(16),
            first: u(20),
            last: u(24),
            policies: u(28),
        }
    }
}

/// One new connection, as the agent saw it at one end.
#[derive(Debug, Clone, Copy)]
pub struct Observation<'a> {
    pub src: u32,
    pub dst: u32,
    pub proto: u8,
    pub port: u16,
    /// Seen at the source's egress (else at the destination's ingress).
    pub egress: bool,
    pub dropped: bool,
    pub policies: &'a [PolicyRef],
    /// Unix seconds.
    pub now: u64,
}

/// A connection as the table holds it, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    pub source: &'a Peer,
    pub destination: &'a Peer,
    /// Indexes of the two peers in `FlowHistory::peers` (equal peers, equal indexes).
    pub src: u32,
    pub dst: u32,
    pub proto: u8,
    pub port: u16,
    pub dropped: bool,
    pub count: u64,
    pub first: u64,
    pub last: u64,
    pub policies: &'a [PolicyRef],
}

impl View<'_> {
    pub fn to_connection(&self) -> Connection {
        Connection {
            source: self.source.clone(),
            destination: self.destination.clone(),
            protocol: protocol_name(self.proto),
            port: self.port,
            verdict: verdict_word(self.dropped).into(),
            count: self.count,
            first_seen: self.first,
            last_seen: self.last,
            policies: self.policies.to_vec(),
        }
    }
}

pub fn verdict_word(dropped: bool) -> &'static str {
    if dropped {
        "dropped"
    } else {
        "forwarded"
    }
}

/// The table.
#[derive(Clone)]
pub struct FlowHistory {
    peers: Vec<Peer>,
    /// Peers by `Peer::hash_key` (`Peer::same` finds one).
    peer_index: HashTable<u32>,
    /// Label sets, one allocation each, shared by the peers that have them.
    label_sets: crate::hashing::HashSet<Arc<[String]>>,
    lists: Vec<Arc<[PolicyRef]>>,
    list_index: crate::hashing::HashMap<Arc<[PolicyRef]>, u32>,
    entries: Vec<Entry>,
    index: HashTable<u32>,
    hasher: crate::hashing::RandomState,
    keep: u64,
    max: usize,
    evicted: u64,
}

impl FlowHistory {
    /// Keeps connections last seen within `keep` seconds, at most `max` of them.
    pub fn new(keep: u64, max: usize) -> FlowHistory {
        let mut h = FlowHistory {
            peers: Vec::new(),
            peer_index: HashTable::new(),
            label_sets: Default::default(),
            lists: Vec::new(),
            list_index: Default::default(),
            entries: Vec::new(),
            index: HashTable::new(),
            hasher: Default::default(),
            keep,
            max: max.max(1),
            evicted: 0,
        };
        h.list(&[]);
        h
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Connections dropped to stay within `max`.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    pub fn peers(&self) -> &[Peer] {
        &self.peers
    }

    /// The index of a peer (interned by `Peer::key`; the first example seen is kept).
    pub fn peer(&mut self, mut p: Peer) -> u32 {
        let h = self.peer_hash(&p);
        let peers = &self.peers;
        if let Some(i) = self.peer_index.find(h, |i| peers[*i as usize].same(&p)) {
            return *i;
        }
        match self.label_sets.get(&p.labels) {
            Some(l) => p.labels = l.clone(),
            None => {
                self.label_sets.insert(p.labels.clone());
            }
        }
        let i = self.peers.len() as u32;
        self.peers.push(p);
        let (peers, hasher) = (&self.peers, &self.hasher);
        self.peer_index.insert_unique(h, i, |j| {
            let mut s = hasher.build_hasher();
            peers[*j as usize].hash_key(&mut s);
            s.finish()
        });
        i
    }

    fn peer_hash(&self, p: &Peer) -> u64 {
        let mut s = self.hasher.build_hasher();
        p.hash_key(&mut s);
        s.finish()
    }

    /// Indexes every peer again (after they were renumbered or read back); equal label sets
    /// share one allocation again.
    fn index_peers(&mut self) -> Result<(), String> {
        self.label_sets.clear();
        for p in self.peers.iter_mut() {
            match self.label_sets.get(&p.labels) {
                Some(l) => p.labels = l.clone(),
                None => {
                    self.label_sets.insert(p.labels.clone());
                }
            }
        }
        let (peers, hasher) = (&self.peers, &self.hasher);
        let hash = |p: &Peer| {
            let mut s = hasher.build_hasher();
            p.hash_key(&mut s);
            s.finish()
        };
        let mut index = HashTable::with_capacity(peers.len());
        for (i, p) in peers.iter().enumerate() {
            let h = hash(p);
            if index
                .find(h, |j: &u32| peers[*j as usize].same(p))
                .is_some()
            {
                return Err("a peer is listed twice".into());
            }
            index.insert_unique(h, i as u32, |j: &u32| hash(&peers[*j as usize]));
        }
        self.peer_index = index;
        Ok(())
    }

    fn list(&mut self, l: &[PolicyRef]) -> u32 {
        if let Some(i) = self.list_index.get(l) {
            return *i;
        }
        let i = self.lists.len() as u32;
        let a: Arc<[PolicyRef]> = l.into();
        self.list_index.insert(a.clone(), i);
        self.lists.push(a);
        i
    }

    fn hash(&self, k: (u32, u32, u16, u8)) -> u64 {
        self.hasher.hash_one(k)
    }

    /// Counts one new connection.
    pub fn record(&mut self, o: Observation) {
        let now = o.now.min(u32::MAX as u64) as u32;
        let policies = self.list(o.policies);
        let key = (o.src, o.dst, o.port, o.proto);
        let h = self.hash(key);
        let entries = &self.entries;
        if let Some(i) = self.index.find(h, |i| entries[*i as usize].key() == key) {
            let e = &mut self.entries[*i as usize];
            match o.egress {
                true => e.egress = e.egress.saturating_add(1),
                false => e.ingress = e.ingress.saturating_add(1),
            }
            e.last = e.last.max(now);
            e.dropped = o.dropped;
            e.policies = policies;
            return;
        }
        if self.entries.len() >= self.max {
            self.evict_oldest();
        }
        let i = self.entries.len() as u32;
        self.entries.push(Entry {
            src: o.src,
            dst: o.dst,
            port: o.port,
            proto: o.proto,
            dropped: o.dropped,
            egress: o.egress as u32,
            ingress: !o.egress as u32,
            first: now,
            last: now,
            policies,
        });
        let (entries, hasher) = (&self.entries, &self.hasher);
        self.index
            .insert_unique(h, i, |j| hasher.hash_one(entries[*j as usize].key()));
    }

    /// A connection read from a file or another table (counts add up; the latest verdict wins).
    pub fn merge(&mut self, c: &Connection) -> Result<(), String> {
        let proto = crate::policy::rule::protocol_number(&c.protocol)
            .ok_or_else(|| format!("unknown protocol {:?}", c.protocol))?;
        let src = self.peer(c.source.clone());
        let dst = self.peer(c.destination.clone());
        let dropped = c.verdict == "dropped";
        let policies = self.list(&c.policies);
        let key = (src, dst, c.port, proto);
        let h = self.hash(key);
        let entries = &self.entries;
        let clamp = |v: u64| v.min(u32::MAX as u64) as u32;
        if let Some(i) = self.index.find(h, |i| entries[*i as usize].key() == key) {
            let e = &mut self.entries[*i as usize];
            e.egress = e.egress.saturating_add(clamp(c.count));
            e.first = e.first.min(clamp(c.first_seen));
            if clamp(c.last_seen) >= e.last {
                e.last = clamp(c.last_seen);
                e.dropped = dropped;
                e.policies = policies;
            }
            return Ok(());
        }
        if self.entries.len() >= self.max {
            self.evict_oldest();
        }
        let i = self.entries.len() as u32;
        self.entries.push(Entry {
            src,
            dst,
            port: c.port,
            proto,
            dropped,
            egress: clamp(c.count),
            ingress: 0,
            first: clamp(c.first_seen),
            last: clamp(c.last_seen),
            policies,
        });
        let (entries, hasher) = (&self.entries, &self.hasher);
        self.index
            .insert_unique(h, i, |j| hasher.hash_one(entries[*j as usize].key()));
        Ok(())
    }

    /// Drops the least recently seen eighth.
    fn evict_oldest(&mut self) {
        let n = (self.max / 8).max(1).min(self.entries.len());
        let mut lasts: Vec<u32> = self.entries.iter().map(|e| e.last).collect();
        let (_, cut, _) = lasts.select_nth_unstable(n - 1);
        let cut = *cut;
        // Everything older than the cut, then entries at the cut until `n` are gone.
        let mut at_cut = n - self.entries.iter().filter(|e| e.last < cut).count();
        let before = self.entries.len();
        self.entries.retain(|e| {
            if e.last < cut {
                return false;
            }
            if e.last == cut && at_cut > 0 {
                at_cut -= 1;
                return false;
            }
            true
        });
        self.evicted += (before - self.entries.len()) as u64;
        self.reindex();
    }

    /// Forgets connections last seen more than `keep` seconds before `now`, then peers and
    /// policy lists no connection names any more.
    pub fn expire(&mut self, now: u64) {
        let cut = now.saturating_sub(self.keep);
        let before = self.entries.len();
        self.entries.retain(|e| e.last as u64 >= cut);
        if self.entries.len() != before || self.peers.len() > 2 * self.entries.len() + 64 {
            self.compact();
        }
    }

    /// Renumbers peers and lists to those in use.
    fn compact(&mut self) {
        let mut peer_map = vec![u32::MAX; self.peers.len()];
        let mut list_map = vec![u32::MAX; self.lists.len()];
        let (mut peers, mut lists) = (Vec::new(), Vec::new());
        let keep = |map: &mut Vec<u32>, i: u32, out: &mut Vec<u32>| {
            if map[i as usize] == u32::MAX {
                map[i as usize] = out.len() as u32;
                out.push(i);
            }
            map[i as usize]
        };
        for e in &mut self.entries {
            e.src = keep(&mut peer_map, e.src, &mut peers);
            e.dst = keep(&mut peer_map, e.dst, &mut peers);
            e.policies = keep(&mut list_map, e.policies, &mut lists);
        }
        let old_peers = std::mem::take(&mut self.peers);
        self.peers = peers
            .iter()
            .map(|i| old_peers[*i as usize].clone())
            .collect();
        // Peers were distinct before: they are after.
        let _ = self.index_peers();
        let old_lists = std::mem::take(&mut self.lists);
        self.lists = lists
            .iter()
            .map(|i| old_lists[*i as usize].clone())
            .collect();
        self.list_index = self
            .lists
            .iter()
            .enumerate()
            .map(|(i, l)| (l.clone(), i as u32))
            .collect();
        self.reindex();
    }

    fn reindex(&mut self) {
        let mut index = HashTable::with_capacity(self.entries.len());
        for (i, e) in self.entries.iter().enumerate() {
            let h = self.hasher.hash_one(e.key());
            let entries = &self.entries;
            index.insert_unique(h, i as u32, |j: &u32| {
                self.hasher.hash_one(entries[*j as usize].key())
            });
        }
        self.index = index;
    }

    /// The connections last seen at or after `since` (unix seconds), in the table's order.
    pub fn iter_since(&self, since: u64) -> impl Iterator<Item = View<'_>> {
        self.entries
            .iter()
            .filter(move |e| e.last as u64 >= since)
            .map(|e| View {
                source: &self.peers[e.src as usize],
                destination: &self.peers[e.dst as usize],
                src: e.src,
                dst: e.dst,
                proto: e.proto,
                port: e.port,
                dropped: e.dropped,
                count: e.count(),
                first: e.first as u64,
                last: e.last as u64,
                policies: &self.lists[e.policies as usize],
            })
    }

    pub fn connections(&self, since: u64) -> Vec<Connection> {
        self.iter_since(since).map(|v| v.to_connection()).collect()
    }

    /// What the table holds on the heap, about (the figure `--flow-history`'s bound is
    /// checked against).
    pub fn heap_bytes(&self) -> usize {
        let peers: usize = self
            .peers
            .iter()
            .map(|p| {
                let own = p.names.iter().chain(&p.namespace).chain(&p.pod);
                std::mem::size_of::<Peer>() + own.map(|s| s.capacity() + 24).sum::<usize>()
            })
            .sum();
        let label_sets: usize = self
            .label_sets
            .iter()
            .map(|l| 16 + l.iter().map(|s| s.capacity() + 24).sum::<usize>())
            .sum();
        let lists: usize = self
            .lists
            .iter()
            .map(|l| l.len() * std::mem::size_of::<PolicyRef>() + 64)
            .sum();
        self.entries.capacity() * std::mem::size_of::<Entry>()
            + self.index.capacity() * (std::mem::size_of::<u32>() + 1)
            + self.peer_index.capacity() * (std::mem::size_of::<u32>() + 1)
            + self.label_sets.capacity() * 17
            + label_sets
            + peers
            + lists
    }

    /// The table as bytes (`STATE_DIR/flow-history`): a magic, the peers and policy lists as
    /// JSON, then fixed-size entries.
    pub fn encode(&self) -> Vec<u8> {
        let head = serde_json::to_vec(&Head {
            peers: self.peers.clone(),
            lists: self.lists.iter().map(|l| l.to_vec()).collect(),
        })
        .unwrap_or_default();
        let mut out = Vec::with_capacity(16 + head.len() + self.entries.len() * ENTRY_BYTES);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(head.len() as u64).to_le_bytes());
        out.extend_from_slice(&head);
        out.extend_from_slice(&(self.entries.len() as u64).to_le_bytes());
        for e in &self.entries {
            e.write(&mut out);
        }
        out
    }

    /// A table saved by `encode`, with this run's bounds (the oldest beyond `max` go).
    pub fn decode(b: &[u8], keep: u64, max: usize) -> Result<FlowHistory, String> {
        let rest = b
            .strip_prefix(MAGIC.as_slice())
            .ok_or("not a flow history file (or one of another version)")?;
        let (n, rest) = take_u64(rest)?;
        let head = rest.get(..n as usize).ok_or("truncated in its peers")?;
        let head: Head =
            serde_json::from_slice(head).map_err(|e| format!("its peers do not read: {e}"))?;
        let rest = &rest[n as usize..];
        let (count, rest) = take_u64(rest)?;
        if rest.len() as u64 != count.saturating_mul(ENTRY_BYTES as u64) {
            return Err(format!(
                "{count} connections announced, {} bytes of them",
                rest.len()
            ));
        }
        let mut h = FlowHistory::new(keep, max);
        h.peers = head.peers;
        h.index_peers()?;
        h.lists.clear();
        h.list_index.clear();
        for l in &head.lists {
            h.list(l);
        }
        for chunk in rest.chunks_exact(ENTRY_BYTES) {
            let e = Entry::read(chunk);
            let np = h.peers.len() as u32;
            if e.src >= np || e.dst >= np || e.policies as usize >= h.lists.len() {
                return Err("a connection names a peer or policy list that is not there".into());
            }
            h.entries.push(e);
        }
        if h.entries.len() > h.max {
            let extra = h.entries.len() - h.max;
            h.entries.sort_by_key(|e| e.last);
            h.entries.drain(..extra);
            h.evicted += extra as u64;
        }
        h.reindex();
        if h.index.len() != h.entries.len() {
            return Err("a connection is listed twice".into());
        }
        Ok(h)
    }
}

impl std::fmt::Debug for FlowHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowHistory")
            .field("connections", &self.entries.len())
            .field("peers", &self.peers.len())
            .field("max", &self.max)
            .finish()
    }
}

const MAGIC: &[u8; 8] = b"CILFH\x00\x00\x01";

#[derive(Serialize, Deserialize)]
struct Head {
    peers: Vec<Peer>,
    lists: Vec<Vec<PolicyRef>>,
}

fn take_u64(b: &[u8]) -> Result<(u64, &[u8]), String> {
    let (n, rest) = b.split_at_checked(8).ok_or("truncated")?;
    Ok((u64::from_le_bytes(n.try_into().unwrap_or_default()), rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, app: &str) -> Peer {
        Peer::new(
            vec![
                format!("k8s:app={app}"),
                format!("k8s:io.kubernetes.pod.namespace={ns}"),
            ],
            None,
            vec![],
        )
    }

    fn obs(src: u32, dst: u32, port: u16, egress: bool, now: u64) -> Observation<'static> {
        Observation {
            src,
            dst,
            proto: 6,
            port,
            egress,
            dropped: false,
            policies: &[],
            now,
        }
    }

    #[test]
    fn one_entry_per_connection_counted_at_the_busier_end() {
        let mut h = FlowHistory::new(3600, 100);
        let a = h.peer(pod("x", "a"));
        let b = h.peer(pod("y", "b"));
        assert_eq!(h.peer(pod("x", "a")), a, "interned");
        for t in 0..3 {
            h.record(obs(a, b, 80, true, 100 + t));
            h.record(obs(a, b, 80, false, 100 + t));
        }
        h.record(obs(a, b, 81, true, 200));
        assert_eq!(h.len(), 2);
        let c = h.connections(0);
        assert_eq!((c[0].count, c[0].first_seen, c[0].last_seen), (3, 100, 102));
        assert_eq!(c[1].port, 81);
        assert_eq!(h.connections(150).len(), 1, "since");
    }

    #[test]
    fn bounded_by_age_and_by_count_oldest_first() {
        let mut h = FlowHistory::new(100, 16);
        let a = h.peer(pod("x", "a"));
        let b = h.peer(pod("y", "b"));
        for p in 0..16u16 {
            h.record(obs(a, b, p, true, 1000 + p as u64));
        }
        h.record(obs(a, b, 999, true, 2000));
        // The least recently seen eighth (2 of 16) made room.
        assert_eq!(h.len(), 15);
        assert_eq!(h.evicted(), 2);
        let ports: Vec<u16> = h.connections(0).iter().map(|c| c.port).collect();
        assert!(!ports.contains(&0) && !ports.contains(&1) && ports.contains(&999));
        // A recorded connection is found again after the eviction renumbered the table.
        h.record(obs(a, b, 999, true, 2001));
        assert_eq!(h.len(), 15);
        h.expire(1115);
        assert_eq!(
            h.len(),
            2,
            "last seen at 1015 and later stay: {:?}",
            h.len()
        );
        h.expire(5000);
        assert!(h.is_empty());
        assert!(
            h.peers().is_empty(),
            "peers no connection names are forgotten"
        );
    }

    #[test]
    fn saved_and_read_back_exactly_and_damage_is_refused() {
        let mut h = FlowHistory::new(3600, 100);
        let a = h.peer(pod("x", "a"));
        let w = h.peer(Peer::new(
            vec!["reserved:world".into()],
            Some("203.0.113.9".parse().unwrap()),
            vec!["api.example".into()],
        ));
        let pol = [PolicyRef {
            kind: "CiliumNetworkPolicy".into(),
            namespace: Some("x".into()),
            name: "p".into(),
            rule: Some(0),
            http: None,
            tier: Default::default(),
        }];
        h.record(Observation {
            policies: &pol,
            dropped: true,
            ..obs(a, w, 443, true, 10)
        });
        h.record(obs(w, a, 8080, false, 11));
        let bytes = h.encode();
        let back = FlowHistory::decode(&bytes, 3600, 100).unwrap();
        assert_eq!(back.connections(0), h.connections(0));
        assert_eq!(back.connections(0)[0].policies, pol.to_vec());
        assert_eq!(back.connections(0)[0].verdict, "dropped");
        // Read back into a smaller bound: the most recent stay.
        let small = FlowHistory::decode(&bytes, 3600, 1).unwrap();
        assert_eq!(small.connections(0)[0].port, 8080);
        let cut = &bytes[..bytes.len() - 3];
        assert!(FlowHistory::decode(cut, 3600, 100)
            .unwrap_err()
            .contains("announced"));
        assert!(FlowHistory::decode(b"garbage", 3600, 100).is_err());
    }
}
