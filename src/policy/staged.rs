//! Staged policies (`policy.ciliate.io/mode: audit`, interfaces section 16): loaded, validated
//! and resolved, never enforced. For each new connection the agent also asks what the verdict
//! would be with them enforced ([`StagedPolicy::judge`]); a flow whose verdict would differ
//! carries that verdict and the policies that would decide it.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::attribution::{entry_cookie, isolation_cookie, MatchKind, PolicyRef};
use super::engine::StagedPolicy;
use super::identity::NumericIdentity;
use super::mapstate::{MapEntry, MapVerdict};
use super::rule::{Direction, PolicyKey};

/// A flow's verdict with the staged policies enforced, where it differs from the one in force.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedVerdict {
    /// `dropped` or `forwarded` (Hubble's words, as the flow's own `verdict`).
    pub verdict: String,
    /// The policies that would decide it: the rules that would allow or deny it, or for a
    /// default deny the policies that would isolate the endpoint (shared by every flow they
    /// decide alike).
    pub policies: Arc<[PolicyRef]>,
}

/// What [`StagedPolicy::judge`] found: the staged verdict and the staged policies behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedChange {
    pub verdict: StagedVerdict,
    /// The staged policies among the deciding ones (all the staged policies that select the
    /// endpoint when none of them is among them: a staged rule can change a verdict without
    /// being the rule that decides it, e.g. a tier's `Pass`).
    pub responsible: Arc<[Arc<PolicyKey>]>,
}

/// The deciding policies of one kind of staged verdict, and the staged ones among them.
#[derive(Debug, Clone)]
pub struct Deciders {
    policies: Arc<[PolicyRef]>,
    responsible: Arc<[Arc<PolicyKey>]>,
}

impl StagedPolicy {
    /// The verdict of a new connection with `peer` (direction `d`, `protocol`, `port`) with the
    /// staged policies enforced, when it differs from the verdict in force (`allowed_now`).
    /// As `EndpointPolicy::decide` decides, without its explanations' allocations: this runs
    /// for every new connection of the endpoint.
    pub fn judge(
        &self,
        d: Direction,
        peer: NumericIdentity,
        protocol: u8,
        port: u16,
        allowed_now: bool,
    ) -> Option<StagedChange> {
        let isolated = !self.policy.direction(d).isolated_by.is_empty();
        let found = self.policy.map.lookup(d, peer, protocol, port);
        let allowed = match found {
            MapVerdict::Denied(_) => false,
            MapVerdict::Allowed(_) => true,
            MapVerdict::NoMatch => !isolated,
        };
        // Most flows: the same verdict. Nothing more to do.
        if allowed == allowed_now {
            return None;
        }
        let deciders = match found {
            MapVerdict::Denied(e) => self.deciders(e, true),
            MapVerdict::Allowed(e) if isolated => self.deciders(e, false),
            // Not isolated: no policy decides it.
            MapVerdict::Allowed(_) | MapVerdict::NoMatch if allowed => {
                self.with_responsible(vec![])
            }
            // A default deny: the same for every flow of the direction, made once.
            _ => self.default_deny[d as usize]
                .get_or_init(|| {
                    let refs = isolation_cookie(&self.policy.direction(d).isolated_by).1;
                    self.with_responsible(refs)
                })
                .clone(),
        };
        Some(StagedChange {
            verdict: StagedVerdict {
                verdict: if allowed { "forwarded" } else { "dropped" }.into(),
                policies: deciders.policies,
            },
            responsible: deciders.responsible,
        })
    }

    /// The deciders of an entry of `policy.map` (a deny names its first origin, as
    /// `EndpointPolicy::decide`), made once per entry.
    fn deciders(&self, e: &MapEntry, deny: bool) -> Deciders {
        let at = e as *const MapEntry as usize;
        let made = || {
            let (origins, kind) = if deny {
                (&e.derived_from[..1], MatchKind::DenyRule)
            } else {
                (&e.derived_from[..], MatchKind::L3L4)
            };
            self.with_responsible(entry_cookie(origins, kind).1)
        };
        let Ok(mut by_entry) = self.by_entry.lock() else {
            return made();
        };
        by_entry.entry(at).or_insert_with(made).clone()
    }

    fn with_responsible(&self, policies: Vec<PolicyRef>) -> Deciders {
        let mut responsible: Vec<Arc<PolicyKey>> = self
            .staged
            .iter()
            .filter(|k| policies.iter().any(|p| p.names(k)))
            .cloned()
            .collect();
        if responsible.is_empty() {
            responsible = self.staged.clone();
        }
        Deciders {
            policies: policies.into(),
            responsible: responsible.into(),
        }
    }
}
