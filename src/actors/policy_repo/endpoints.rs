//! This node's endpoints: admission, identity from their pods, configuration, listing
//! and shutdown.

use super::*;
use crate::traceable;

// ------------------------------------------------------------------ endpoints

/// Creates an endpoint (API or CNI), or restores one from the state directory.
#[derive(Debug, Message)]
#[rtype(result = "Result<EndpointModel, ApiError>")]
pub struct AddEndpoint {
    pub request: EndpointRequest,
    pub restore: Option<EndpointRecord>,
}
traceable!(AddEndpoint, "AddEndpoint", |m| format!(
    "{} {}{}",
    m.request.name,
    m.request
        .ips
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(","),
    if m.restore.is_some() {
        " (restore)"
    } else {
        ""
    }
));

impl Handler<AddEndpoint> for PolicyRepoActor {
    type Result = Result<EndpointModel, ApiError>;
    fn handle(&mut self, msg: AddEndpoint, _: &mut Context<Self>) -> Self::Result {
        self.add_endpoint(msg.request, msg.restore)
    }
}

/// Deletes an endpoint.
#[derive(Debug, Message)]
#[rtype(result = "Result<(), ApiError>")]
pub struct DeleteEndpoint {
    pub id: EndpointId,
}
traceable!(DeleteEndpoint, "DeleteEndpoint", |m| format!(
    "endpoint {}",
    m.id
));

impl Handler<DeleteEndpoint> for PolicyRepoActor {
    type Result = Result<(), ApiError>;
    fn handle(&mut self, msg: DeleteEndpoint, _: &mut Context<Self>) -> Self::Result {
        if self.endpoints.get(msg.id).is_some_and(|e| e.record.host) {
            return Err(ApiError::Invalid(format!(
                "endpoint {} is the host endpoint: it goes with --enable-host-firewall=false",
                msg.id
            )));
        }
        self.delete_endpoint(msg.id, false)
    }
}

/// Changes an endpoint's configuration (`ciliate endpoint config ID PolicyAuditMode=...`).
#[derive(Debug, Message)]
#[rtype(result = "Result<(), ApiError>")]
pub struct ConfigureEndpoint {
    pub id: EndpointId,
    pub audit: bool,
}
traceable!(ConfigureEndpoint, "ConfigureEndpoint", |m| format!(
    "endpoint {} audit {}",
    m.id, m.audit
));

impl Handler<ConfigureEndpoint> for PolicyRepoActor {
    type Result = Result<(), ApiError>;
    fn handle(&mut self, msg: ConfigureEndpoint, _: &mut Context<Self>) -> Self::Result {
        let entry = self
            .endpoints
            .get_mut(msg.id)
            .ok_or_else(|| ApiError::NotFound(format!("endpoint {}", msg.id)))?;
        entry.record.audit = msg.audit;
        entry.handle.do_send(SetAudit { audit: msg.audit }, NAME);
        Ok(())
    }
}

/// Finds an endpoint by its container id (CNI DEL).
#[derive(Debug, Message)]
#[rtype(result = "Result<Option<EndpointId>, ApiError>")]
pub struct FindEndpoint {
    pub container_id: String,
}
traceable!(FindEndpoint, "FindEndpoint", |m| format!(
    "container {}",
    m.container_id
));

impl Handler<FindEndpoint> for PolicyRepoActor {
    type Result = Result<Option<EndpointId>, ApiError>;
    fn handle(&mut self, msg: FindEndpoint, _: &mut Context<Self>) -> Self::Result {
        Ok(self.endpoints.by_container(&msg.container_id))
    }
}

/// Endpoints whose pod the agent does not know (after the initial sync: pods deleted while the
/// agent was down), with their container id when CNI made them. Empty before the initial sync.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<(EndpointId, String, Option<String>)>, ApiError>")]
pub struct ListPodlessEndpoints;
traceable!(ListPodlessEndpoints, "ListPodlessEndpoints", |_m| {
    String::new()
});

impl Handler<ListPodlessEndpoints> for PolicyRepoActor {
    type Result = Result<Vec<(EndpointId, String, Option<String>)>, ApiError>;
    fn handle(&mut self, _: ListPodlessEndpoints, _: &mut Context<Self>) -> Self::Result {
        if !self.initial_sync_done {
            return Ok(Vec::new());
        }
        Ok(self
            .endpoints
            .iter()
            .filter(|(_, e)| !e.record.host && !self.index.has_pod(&e.record.name))
            .map(|(id, e)| (id, e.record.name.clone(), e.record.container_id.clone()))
            .collect())
    }
}

/// The endpoint actors, for the API to query.
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<EndpointHandle>, ApiError>")]
pub struct ListEndpoints;
traceable!(ListEndpoints, "ListEndpoints", |_m| String::new());

impl Handler<ListEndpoints> for PolicyRepoActor {
    type Result = Result<Vec<EndpointHandle>, ApiError>;
    fn handle(&mut self, _: ListEndpoints, _: &mut Context<Self>) -> Self::Result {
        Ok(self
            .endpoints
            .iter()
            .map(|(id, e)| (id, e.handle.clone()))
            .collect())
    }
}

/// Stops every endpoint actor, leaving the datapath and state in place (agent shutdown).
#[derive(Debug, Message)]
#[rtype(result = "Result<(), ApiError>")]
pub struct Shutdown;
traceable!(Shutdown, "Shutdown", |_m| String::new());

impl Handler<Shutdown> for PolicyRepoActor {
    type Result = Result<(), ApiError>;
    fn handle(&mut self, _: Shutdown, _: &mut Context<Self>) -> Self::Result {
        for id in self.endpoints.ids() {
            self.delete_endpoint(id, true)?;
        }
        Ok(())
    }
}

impl PolicyRepoActor {
    /// Re-derives an endpoint's identity and named ports from its pod. Returns true when
    /// either changed. An identity this creates or frees adds the endpoints selecting it to
    /// `affected`.
    pub(super) fn refresh_endpoint_identity(
        &mut self,
        id: EndpointId,
        ipcache: &mut Vec<IpcacheChange>,
        affected: &mut BTreeSet<NumericIdentity>,
    ) -> bool {
        let Some(entry) = self.endpoints.get(id) else {
            return false;
        };
        let (labels, ports) = match self.index.pod(&entry.record.name) {
            Some(p) => (self.index.record_labels(p), p.named_ports.to_vec()),
            None => return false, // keep what it has (restored, or pod deleted: stays until the endpoint is)
        };
        if entry.labels == labels && entry.named_ports == ports && entry.record.identity.is_some() {
            return false;
        }
        let old = entry.record.identity;
        let (key, ips) = (entry.record.name.clone(), entry.record.ips.clone());
        let engine = self.shared.engine.clone();
        let mut engine = match engine.write() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let allocation = engine.allocate_identity(&labels);
        let new_id = allocation.id();
        if matches!(allocation, Allocation::New(_)) {
            affected.extend(engine.endpoints_affected_by_identity(new_id));
        }
        ipcache.extend(self.index.claim_endpoint(&mut engine, &key, &ips, new_id));
        if let Some(o) = old {
            if engine.identities().is_last_reference(o) {
                affected.extend(engine.endpoints_affected_by_identity(o));
            }
            engine.release_identity(o);
        }
        drop(engine);
        if let Some(e) = self.endpoints.get_mut(id) {
            e.record.identity = Some(new_id);
            e.labels = labels.clone();
            e.named_ports = ports.clone();
            e.handle.do_send(
                SetIdentity {
                    identity: Some(new_id),
                    labels,
                    named_ports: ports,
                    ips: None,
                },
                NAME,
            );
        }
        true
    }

    pub(super) fn spawn_endpoint(
        &mut self,
        record: EndpointRecord,
        labels: Labels,
        ports: Vec<NamedPort>,
    ) -> EndpointModel {
        let name = format!("EndpointActor/{}", record.id);
        let journal = self.shared.registry.register(name, "EndpointActor");
        let ports_copy = ports.clone();
        let actor = EndpointActor::new(
            record.clone(),
            labels.clone(),
            ports,
            self.shared.clone(),
            self.loader.clone(),
            crate::actors::endpoint::Reports::to(&self.reaction),
            journal.clone(),
        );
        let addr = TracedAddr::new(self.workers.start(actor), journal);
        let model = EndpointModel {
            id: record.id,
            name: record.name.clone(),
            identity: record.identity,
            labels: labels.to_strings(),
            ips: record.ips.iter().map(|i| i.to_string()).collect(),
            interface: record.interface.clone(),
            state: if record.identity.is_some() {
                "ready"
            } else {
                "waiting-for-identity"
            }
            .into(),
            policy_revision: 0,
            policy_entries: 0,
            ingress_enforced: false,
            egress_enforced: false,
            regenerations: 0,
            error: None,
            audit: record.audit,
            container_id: record.container_id.clone(),
        };
        self.endpoints.insert(Entry {
            record,
            handle: addr,
            labels,
            named_ports: ports_copy,
        });
        model
    }

    pub(super) fn add_endpoint(
        &mut self,
        req: EndpointRequest,
        restore: Option<EndpointRecord>,
    ) -> Result<EndpointModel, ApiError> {
        let (key, id) = self
            .endpoints
            .admit(Admission {
                name: &req.name,
                container_id: req.container_id.as_deref(),
                ips: &req.ips,
                restore: restore.as_ref().map(|r| r.id),
            })
            .map_err(|e| match e {
                Refusal::BadName(_) => ApiError::Invalid(e.to_string()),
                Refusal::Conflict(_) => ApiError::Conflict(e.to_string()),
                Refusal::NoFreeId => ApiError::Internal(e.to_string()),
            })?;
        let mut ipcache = Vec::new();
        let (identity, labels, ports) = {
            let pod_state = self
                .index
                .pod(&key)
                .map(|p| (self.index.record_labels(p), p.named_ports.to_vec()));
            let mut engine = self.engine_mut();
            match (pod_state, &restore) {
                (Some((labels, ports)), _) => {
                    (Some(engine.allocate_identity(&labels).id()), labels, ports)
                }
                (None, Some(r)) if r.identity.is_some() => {
                    let labels: Labels = r.labels.iter().filter_map(|s| Label::parse(s)).collect();
                    let want = r.identity.unwrap_or_default();
                    match engine.restore_identity(want, &labels) {
                        Ok(a) => (Some(a.id()), labels, vec![]),
                        Err(e) => {
                            tracing::warn!(endpoint = id, error = %e, "cannot restore identity; waiting for the pod");
                            (None, Labels::new(), vec![])
                        }
                    }
                }
                _ => (None, Labels::new(), vec![]),
            }
        };
        if let Some(ident) = identity {
            ipcache = self.indexed(|ix, e| ix.claim_endpoint(e, &key, &req.ips, ident));
        }
        let record = EndpointRecord {
            id,
            name: key.clone(),
            ips: req.ips.clone(),
            interface: req.interface.clone(),
            identity,
            labels: labels.to_strings(),
            policy_revision: restore.as_ref().map(|r| r.policy_revision).unwrap_or(0),
            container_id: req.container_id.clone(),
            netns: req.netns.clone(),
            mac: req.mac.clone(),
            audit: restore.as_ref().is_some_and(|r| r.audit),
            host: false,
        };
        // Flows name the endpoint's pod by these addresses (also where no Pod object lists
        // them: standalone pods made through CNI).
        self.name_addresses(&ipcache);
        let model = self.spawn_endpoint(record, labels, ports);
        let affected: BTreeSet<NumericIdentity> = identity
            .map(|i| self.engine().endpoints_affected_by_identity(i))
            .unwrap_or_default();
        self.react(
            Reaction::new(format!("endpoint {id} added"))
                .affecting(affected.iter().copied())
                .regenerating([id])
                .forced()
                .ipcache(ipcache),
        );
        Ok(model)
    }

    pub(super) fn delete_endpoint(
        &mut self,
        id: EndpointId,
        keep_datapath: bool,
    ) -> Result<(), ApiError> {
        let entry = self
            .endpoints
            .remove(id)
            .ok_or_else(|| ApiError::NotFound(format!("endpoint {id}")))?;
        entry.handle.do_send(Delete { keep_datapath }, NAME);
        if keep_datapath {
            return Ok(());
        }
        let mut affected = BTreeSet::new();
        // The pod's own claim (if it is still listed) keeps the addresses.
        let ipcache =
            self.indexed(|ix, e| ix.release_endpoint(e, &entry.record.name, &entry.record.ips));
        self.name_addresses(&ipcache);
        {
            let mut engine = self.engine_mut();
            if let Some(i) = entry.record.identity {
                if engine.identities().is_last_reference(i) {
                    affected.extend(engine.endpoints_affected_by_identity(i));
                }
                engine.release_identity(i);
            }
        }
        self.react(
            Reaction::new(format!("endpoint {id} deleted"))
                .affecting(affected)
                .ipcache(ipcache),
        );
        Ok(())
    }
}
