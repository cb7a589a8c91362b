//! What the API shows of the repository (policies, identities, the ipcache) and a
//! regeneration of every endpoint on request.

use super::*;
use crate::traceable;

/// `/debug/policy`.
#[derive(Debug, Message)]
#[rtype(result = "Result<PolicyOverview, ApiError>")]
pub struct GetPolicies;
traceable!(GetPolicies, "GetPolicies", |_m| String::new());

impl Handler<GetPolicies> for PolicyRepoActor {
    type Result = Result<PolicyOverview, ApiError>;
    fn handle(&mut self, _: GetPolicies, _: &mut Context<Self>) -> Self::Result {
        Ok(PolicyOverview {
            revision: self.engine().revision(),
            policies: self
                .statuses
                .policies()
                .map(|p| PolicyStatus {
                    hits: self
                        .shared
                        .policy_hits
                        .get(&p.kind, p.namespace.as_deref(), &p.name),
                    ..p.clone()
                })
                .collect(),
            manifest_errors: self.statuses.manifest_errors().clone(),
            recent_implementations: self.shared.implementations(),
        })
    }
}

/// `/debug/identities`.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<IdentityModel>, ApiError>")]
pub struct GetIdentities;
traceable!(GetIdentities, "GetIdentities", |_m| String::new());

impl Handler<GetIdentities> for PolicyRepoActor {
    type Result = Result<Vec<IdentityModel>, ApiError>;
    fn handle(&mut self, _: GetIdentities, _: &mut Context<Self>) -> Self::Result {
        let e = self.engine();
        let mut v: Vec<IdentityModel> = e
            .identities()
            .iter()
            .map(|i| IdentityModel {
                id: i.id,
                labels: i.labels.to_strings(),
                kind: if reserved_name(i.id).is_some() {
                    "reserved"
                } else if i.cidr.is_some() {
                    "cidr"
                } else if i
                    .labels
                    .has_reserved(crate::policy::node_classes::CLASS_LABEL)
                {
                    "node"
                } else {
                    "cluster"
                },
            })
            .collect();
        v.sort_by_key(|i| i.id);
        Ok(v)
    }
}

/// `/debug/ipcache`: the engine's view (the datapath's may lag until regenerations finish).
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<IpcacheModel>, ApiError>")]
pub struct GetIpcacheView;
traceable!(GetIpcacheView, "GetIpcacheView", |_m| String::new());

impl Handler<GetIpcacheView> for PolicyRepoActor {
    type Result = Result<Vec<IpcacheModel>, ApiError>;
    fn handle(&mut self, _: GetIpcacheView, _: &mut Context<Self>) -> Self::Result {
        Ok(self
            .engine()
            .ipcache()
            .entries()
            .into_iter()
            .map(|(p, id)| IpcacheModel {
                prefix: p.to_string(),
                identity: id,
            })
            .collect())
    }
}

/// Asks every endpoint to regenerate (used after restore and by tests).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct RegenerateAll {
    pub reason: String,
}
traceable!(RegenerateAll, "RegenerateAll", |m| m.reason.clone());

impl Handler<RegenerateAll> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: RegenerateAll, _: &mut Context<Self>) {
        let revision = self.engine().revision();
        for (_, e) in self.endpoints.iter() {
            e.handle.do_send(
                Regenerate {
                    revision,
                    reason: msg.reason.clone(),
                    force: true,
                    peers: None,
                },
                NAME,
            );
        }
    }
}
