//! The host endpoint (`--enable-host-firewall`, `endpoint::host`): created once at start (from
//! the previous run's record, so its audit mode survives a restart), its labels and addresses
//! following this node's Node object.

use super::*;
use crate::endpoint::host::{host_labels, HOST_ENDPOINT_ID, HOST_ENDPOINT_NAME};
use crate::policy::identity::IDENTITY_HOST;
use crate::traceable;

/// Creates the host endpoint (once; a second request changes nothing).
#[derive(Debug, Message)]
#[rtype(result = "Result<EndpointModel, ApiError>")]
pub struct AddHostEndpoint {
    /// The previous run's record (its audit mode is kept).
    pub restore: Option<EndpointRecord>,
}
traceable!(
    AddHostEndpoint,
    "AddHostEndpoint",
    |m| if m.restore.is_some() {
        "restore".to_string()
    } else {
        String::new()
    }
);

impl Handler<AddHostEndpoint> for PolicyRepoActor {
    type Result = Result<EndpointModel, ApiError>;
    fn handle(&mut self, msg: AddHostEndpoint, _: &mut Context<Self>) -> Self::Result {
        if self.endpoints.get(HOST_ENDPOINT_ID).is_some() {
            return Err(ApiError::Conflict(
                "the host endpoint exists already".into(),
            ));
        }
        let (labels, ips) = self.host_view();
        let record = EndpointRecord {
            id: HOST_ENDPOINT_ID,
            name: HOST_ENDPOINT_NAME.into(),
            ips,
            interface: None,
            identity: Some(IDENTITY_HOST),
            labels: labels.to_strings(),
            policy_revision: msg.restore.as_ref().map_or(0, |r| r.policy_revision),
            container_id: None,
            netns: None,
            mac: None,
            audit: msg.restore.as_ref().is_some_and(|r| r.audit),
            host: true,
        };
        let model = self.spawn_endpoint(record, labels, Vec::new());
        self.react(
            Reaction::new("host endpoint added")
                .regenerating([HOST_ENDPOINT_ID])
                .forced(),
        );
        Ok(model)
    }
}

impl PolicyRepoActor {
    /// The host endpoint's labels and addresses, from this node's Node object (none known yet:
    /// `reserved:host` alone, no address).
    fn host_view(&self) -> (Labels, Vec<IpAddr>) {
        match self.index.nodes().get(&self.shared.node_name) {
            Some(n) => (host_labels(&n.labels), n.ips.clone()),
            None => (host_labels(std::iter::empty()), Vec::new()),
        }
    }

    /// This node's Node object changed: the host endpoint (if any) takes its labels and
    /// addresses. Returns whether they changed (it then regenerates).
    pub(super) fn refresh_host_endpoint(&mut self) -> bool {
        let (labels, ips) = self.host_view();
        let Some(e) = self.endpoints.get_mut(HOST_ENDPOINT_ID) else {
            return false;
        };
        if e.labels == labels && e.record.ips == ips {
            return false;
        }
        e.labels = labels.clone();
        e.record.labels = labels.to_strings();
        e.record.ips = ips.clone();
        e.handle.do_send(
            SetIdentity {
                identity: Some(IDENTITY_HOST),
                labels,
                named_ports: Vec::new(),
                ips: Some(ips),
            },
            NAME,
        );
        true
    }

    /// Whether a reaction regenerates the host endpoint: every policy change (its rules may
    /// have come or gone), and while host rules exist, every change of identities or addresses
    /// (their peers may have moved).
    pub(super) fn host_hit(&self, policy_change: bool, others: bool) -> bool {
        policy_change || (others && self.engine().has_host_rules())
    }
}
