//! Observed connections judged again against a set of policies, by the engine the agent and
//! `policy simulate` use: each workload gets an identity from its labels, each outside address
//! the identity the ipcache gives it (with the DNS names it was seen under learned first, so
//! `toFQDNs` selects it), and a connection is the source's egress and the destination's
//! ingress, as a probe of a world is.
//!
//! What a replay cannot know: the pods' named container ports (a rule naming a port matches
//! nothing here), and HTTP requests (an L7 rule's connection is judged at L3/L4).

use crate::policy::attribution::{entry_cookie, isolation_cookie, MatchKind, PolicyRef};
use crate::policy::engine::{Decision, EndpointPolicy, EndpointView, PolicyEngine};
use crate::policy::identity::{
    NumericIdentity, IDENTITY_HEALTH, IDENTITY_HOST, IDENTITY_INGRESS, IDENTITY_KUBE_APISERVER,
    IDENTITY_REMOTE_NODE, IDENTITY_UNMANAGED, IDENTITY_WORLD,
};
use crate::policy::labels::{Label, Labels};
use crate::policy::rule::{Direction, Rule};
use crate::policy::translate::ParsedPolicy;

use super::Peer;

/// One peer as the replay engine sees it.
struct Party {
    identity: NumericIdentity,
    /// A subject of policy (a pod, or the host endpoint): its labels.
    subject: Option<(Labels, bool)>,
    policy: Option<EndpointPolicy>,
}

/// An engine holding one set of policies and the peers of a history.
pub struct Replay {
    engine: PolicyEngine,
    parties: Vec<Party>,
}

/// One side's decision (`None`: that side is not a subject of policy).
pub struct Judged {
    pub egress: Option<Decision>,
    pub ingress: Option<Decision>,
}

impl Judged {
    pub fn dropped(&self) -> bool {
        [&self.egress, &self.ingress]
            .into_iter()
            .flatten()
            .any(|d| !d.is_allowed())
    }

    /// The policies that decided it: the side that drops it (egress first), or the rules that
    /// allow it on both sides.
    pub fn policies(&self) -> Vec<PolicyRef> {
        let sides = [&self.egress, &self.ingress];
        if let Some(d) = sides.into_iter().flatten().find(|d| !d.is_allowed()) {
            return deciders(d);
        }
        let mut out: Vec<PolicyRef> = sides.into_iter().flatten().flat_map(deciders).collect();
        out.sort();
        out.dedup();
        out
    }
}

fn deciders(d: &Decision) -> Vec<PolicyRef> {
    match d {
        Decision::Allowed(origins) => entry_cookie(origins, MatchKind::L3L4).1,
        Decision::Denied(o) => entry_cookie(std::slice::from_ref(o), MatchKind::DenyRule).1,
        Decision::DefaultDenied { isolated_by, .. } => isolation_cookie(isolated_by).1,
        Decision::NotIsolated => vec![],
    }
}

/// The reserved identity a `reserved:` label names (`host` and `world` aside).
fn reserved_identity(peer: &Peer) -> Option<NumericIdentity> {
    [
        ("reserved:remote-node", IDENTITY_REMOTE_NODE),
        ("reserved:kube-apiserver", IDENTITY_KUBE_APISERVER),
        ("reserved:health", IDENTITY_HEALTH),
        ("reserved:ingress", IDENTITY_INGRESS),
        ("reserved:unmanaged", IDENTITY_UNMANAGED),
    ]
    .into_iter()
    .find(|(l, _)| peer.has_label(l))
    .map(|(_, id)| id)
}

fn labels_of(peer: &Peer) -> Labels {
    peer.labels.iter().filter_map(|l| Label::parse(l)).collect()
}

impl Replay {
    /// An engine with `policies` and the `peers` (indexes as in the history they came from).
    pub fn new(peers: &[Peer], policies: Vec<ParsedPolicy>) -> Replay {
        let mut engine = PolicyEngine::new();
        engine.set_local_node("local");
        engine.upsert_node_labels("local", Labels::default());
        let mut identities = Vec::with_capacity(peers.len());
        for p in peers {
            let id = if p.is_pod() {
                engine.allocate_identity(&labels_of(p)).id()
            } else {
                0
            };
            identities.push(id);
        }
        for p in peers.iter().filter(|p| !p.is_pod()) {
            if let Some(ip) = p.ip {
                for name in &p.names {
                    engine.learn_fqdn(name, &[ip]);
                }
            }
        }
        for p in policies {
            engine.upsert_policy(p);
        }
        let parties = peers
            .iter()
            .zip(identities)
            .map(|(p, id)| {
                let host = p.has_label("reserved:host");
                let identity = match (p.is_pod(), host, reserved_identity(p), p.ip) {
                    (true, ..) => id,
                    (false, true, ..) => IDENTITY_HOST,
                    (false, false, Some(r), _) => r,
                    (false, false, None, Some(ip)) => engine.identity_of_ip(ip),
                    (false, false, None, None) => IDENTITY_WORLD,
                };
                let subject = (p.is_pod() || host).then(|| (labels_of(p), host));
                Party {
                    identity,
                    subject,
                    policy: None,
                }
            })
            .collect();
        Replay { engine, parties }
    }

    fn policy(&mut self, i: usize) -> Option<&EndpointPolicy> {
        let party = &mut self.parties[i];
        let (labels, host) = party.subject.as_ref()?;
        if party.policy.is_none() {
            let view = EndpointView {
                identity: party.identity,
                labels,
                named_ports: &[],
                host: *host,
            };
            party.policy = Some(self.engine.resolve(&view));
        }
        party.policy.as_ref()
    }

    /// The connection from peer `src` to peer `dst`.
    pub fn judge(&mut self, src: u32, dst: u32, proto: u8, port: u16) -> Judged {
        let (s, d) = (src as usize, dst as usize);
        let (src_id, dst_id) = (self.parties[s].identity, self.parties[d].identity);
        let egress = self
            .policy(s)
            .map(|p| p.decide(Direction::Egress, dst_id, proto, port));
        let ingress = self
            .policy(d)
            .map(|p| p.decide(Direction::Ingress, src_id, proto, port));
        Judged { egress, ingress }
    }

    /// Whether the connection is dropped (`judge(..).dropped()`, without the reasons).
    pub fn dropped(&mut self, src: u32, dst: u32, proto: u8, port: u16) -> bool {
        let (s, d) = (src as usize, dst as usize);
        let (src_id, dst_id) = (self.parties[s].identity, self.parties[d].identity);
        let egress = self
            .policy(s)
            .is_some_and(|p| !p.permits(Direction::Egress, dst_id, proto, port));
        egress
            || self
                .policy(d)
                .is_some_and(|p| !p.permits(Direction::Ingress, src_id, proto, port))
    }

    /// How many policies the engine holds.
    pub fn policy_count(&self) -> usize {
        self.engine.repository().len()
    }
}

/// The policies a PolicyEngine holds, as values another engine takes (`Replay::new`).
pub fn policies_of(engine: &PolicyEngine) -> Vec<ParsedPolicy> {
    engine
        .repository()
        .policies()
        .map(|stored| ParsedPolicy {
            key: stored.key.clone(),
            rules: stored.rules.iter().map(|r| Rule::clone(r)).collect(),
            warnings: vec![],
            notes: stored.notes.clone(),
            uses_services: false,
            staged: stored.rules.iter().any(|r| r.staged),
        })
        .collect()
}
