//! Cluster objects: pods, namespaces and nodes through the cluster index, the initial
//! sync and what follows it.

use super::*;
use crate::traceable;

// ------------------------------------------------------------------ cluster objects

/// A pod appeared or changed.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct PodUpsert {
    pub pod: PodInfo,
}
traceable!(PodUpsert, "PodUpsert", |m| format!("pod {}", m.pod.key()));

impl Handler<PodUpsert> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: PodUpsert, _: &mut Context<Self>) {
        let key = msg.pod.key();
        self.note_workload(&key, msg.pod.workload.as_ref());
        let change = self.indexed(|ix, e| ix.apply_pod(e, &key, Some(msg.pod)));
        self.index_changed(format!("pod {key}"), change);
    }
}

/// Pods of the initial sync, in one message (no per-pod message, reason or reaction).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct PodsUpsert {
    pub pods: Vec<PodInfo>,
}
traceable!(PodsUpsert, "PodsUpsert", |m| format!(
    "{} pods",
    m.pods.len()
));

impl Handler<PodsUpsert> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: PodsUpsert, _: &mut Context<Self>) {
        let n = msg.pods.len();
        for pod in &msg.pods {
            self.note_workload(&pod.key(), pod.workload.as_ref());
        }
        let change = self.indexed(|ix, e| {
            let mut all = IndexChange::default();
            for pod in msg.pods {
                let key = pod.key();
                all.extend(ix.apply_pod(e, &key, Some(pod)));
            }
            all
        });
        self.index_changed(format!("{n} pods"), change);
    }
}

/// A pod went away.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct PodDelete {
    /// `namespace/name`.
    pub key: String,
}
traceable!(PodDelete, "PodDelete", |m| format!("pod {}", m.key));

impl Handler<PodDelete> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: PodDelete, _: &mut Context<Self>) {
        self.note_workload(&msg.key, None);
        let change = self.indexed(|ix, e| ix.apply_pod(e, &msg.key, None));
        self.index_changed(format!("pod {} deleted", msg.key), change);
    }
}

/// A namespace appeared or its labels changed: its pods' identities follow.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct NamespaceUpsert {
    pub namespace: NamespaceInfo,
}
traceable!(NamespaceUpsert, "NamespaceUpsert", |m| format!(
    "namespace {}",
    m.namespace.name
));

impl Handler<NamespaceUpsert> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: NamespaceUpsert, _: &mut Context<Self>) {
        let name = msg.namespace.name.clone();
        let change = self.indexed(|ix, e| ix.upsert_namespace(e, msg.namespace));
        self.index_changed(format!("namespace {name}"), change);
    }
}

/// A namespace went away.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct NamespaceDelete {
    pub name: String,
}
traceable!(NamespaceDelete, "NamespaceDelete", |m| format!(
    "namespace {}",
    m.name
));

impl Handler<NamespaceDelete> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: NamespaceDelete, _: &mut Context<Self>) {
        let change = self.indexed(|ix, e| ix.delete_namespace(e, &msg.name));
        self.index_changed(format!("namespace {} deleted", msg.name), change);
    }
}

/// A node appeared or changed: its addresses are `host` (this node) or `remote-node`.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct NodeUpsert {
    pub node: NodeInfo,
}
traceable!(NodeUpsert, "NodeUpsert", |m| format!(
    "node {}",
    m.node.name
));

impl PolicyRepoActor {
    /// Hubble's workloads follow the pods' controllers (one entry per pod a controller owns).
    fn note_workload(&self, key: &str, workload: Option<&crate::objects::Workload>) {
        match workload {
            Some(w) => {
                self.shared.workloads.insert(key.to_string(), w.clone());
            }
            None => {
                self.shared.workloads.remove(key);
            }
        }
    }

    /// This node's Node object names its pod CIDRs (`ParseNode`: `spec.podCIDRs`, else the
    /// annotations), one per enabled family: IPAM serves those ranges from now on, with every
    /// endpoint's address reserved. A range already handing out addresses is never swapped
    /// under its pods.
    pub(super) fn adopt_node_pod_cidr(&self, node: &crate::objects::NodeInfo) {
        let Ok(families) = self.shared.ipam.lock().map(|g| g.families) else {
            return;
        };
        for ipv6 in [false, true] {
            if (ipv6 && families.ipv6) || (!ipv6 && families.ipv4) {
                self.adopt_node_pod_cidr_of(node, ipv6);
            }
        }
    }

    fn adopt_node_pod_cidr_of(&self, node: &crate::objects::NodeInfo, ipv6: bool) {
        let found = crate::ipam::node_pod_cidr_of(&node.pod_cidrs, &node.annotations, ipv6);
        let (cidr, source) = match found {
            Ok(Some(c)) => c,
            Ok(None) => return,
            Err(e) => {
                tracing::error!(node = %node.name, error = %e, "this node's pod CIDR is unusable; IPAM keeps what it had");
                return;
            }
        };
        let held = self.endpoints.held_addresses();
        let Ok(mut g) = self.shared.ipam.lock() else {
            return;
        };
        match g.adopt(cidr, source, held) {
            Ok(true) => {
                tracing::info!(node = %node.name, pod_cidr = %cidr, ?source, "IPAM serves this node's pod CIDR")
            }
            Ok(false) => {}
            Err(e) => tracing::error!(node = %node.name, error = %e, "IPAM keeps what it had"),
        }
    }
}

impl PolicyRepoActor {
    /// Hands the node set to the route reconciler (it keeps only the newest, and applies
    /// nothing before the initial sync): during the initial sync the set is sent once, at its
    /// end, not once per node (a 5,000-node cluster would copy 25 million nodes).
    pub(super) fn publish_nodes(&self) {
        if !self.initial_sync_done {
            return;
        }
        self.shared.nodes.send_replace(
            self.index
                .nodes()
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        );
    }
}

impl Handler<NodeUpsert> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: NodeUpsert, _: &mut Context<Self>) {
        if msg.node.name == self.shared.node_name {
            self.adopt_node_pod_cidr(&msg.node);
            let port = msg.node.kubelet_port.map_or(0, u32::from);
            self.shared
                .kubelet_port
                .store(port, std::sync::atomic::Ordering::Relaxed);
        }
        let local = msg.node.name == self.shared.node_name;
        let change = self.indexed(|ix, e| ix.upsert_node(e, msg.node, local));
        self.publish_nodes();
        let host = local && self.refresh_host_endpoint();
        // `affected`: subjects of cluster tiers' `nodes` peers (the nodes or their labels
        // changed), regenerated at the same revision (`forced`).
        self.react(
            Reaction::new("node")
                .affecting(change.affected.iter().copied())
                .regenerating(host.then_some(crate::endpoint::host::HOST_ENDPOINT_ID))
                .forced()
                .ipcache(change.ipcache),
        );
    }
}

/// The addresses of this node's native devices (`network::devices`), from the route
/// reconciler: each is `host`.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct DeviceAddresses {
    pub addrs: std::collections::BTreeSet<std::net::IpAddr>,
}
traceable!(DeviceAddresses, "DeviceAddresses", |m| format!(
    "{} addresses",
    m.addrs.len()
));

impl Handler<DeviceAddresses> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: DeviceAddresses, _: &mut Context<Self>) {
        let change = self.indexed(|ix, e| ix.set_device_addresses(e, msg.addrs));
        if change.ipcache.is_empty() {
            return;
        }
        self.react(Reaction::new("device addresses").ipcache(change.ipcache));
    }
}

/// A node went away.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct NodeDelete {
    pub name: String,
}
traceable!(NodeDelete, "NodeDelete", |m| format!("node {}", m.name));

impl Handler<NodeDelete> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: NodeDelete, _: &mut Context<Self>) {
        let Some(change) = self.indexed(|ix, e| ix.delete_node(e, &msg.name)) else {
            return;
        };
        self.publish_nodes();
        self.react(
            Reaction::new("node deleted")
                .affecting(change.affected.iter().copied())
                .forced()
                .ipcache(change.ipcache),
        );
    }
}

/// The watcher delivered the initial state: regenerate every endpoint, then report ready.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct InitialSyncDone;
traceable!(InitialSyncDone, "InitialSyncDone", |_m| String::new());

impl Handler<InitialSyncDone> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, _: InitialSyncDone, _: &mut Context<Self>) {
        if self.initial_sync_done {
            return;
        }
        self.after_initial_sync();
    }
}

/// During the initial sync, ipcache changes go to the datapath in chunks of this many.
pub(super) const SYNC_IPCACHE_CHUNK: usize = 8192;

impl PolicyRepoActor {
    /// A reaction that regenerates nothing and releases `ipcache` (the initial sync's chunks).
    pub(super) fn send_reaction(&self, revision: u64, reason: String, ipcache: Vec<IpcacheChange>) {
        self.journal_numbers();
        self.reaction.do_send(
            PolicyReaction {
                revision,
                accepted_at: Instant::now(),
                reason,
                to_regenerate: vec![],
                to_bump: vec![],
                force: false,
                ipcache,
                observe_delay: false,
                set_ready: false,
                release_memory: false,
                peers: None,
                immediate: false,
                done: None,
            },
            NAME,
        );
    }

    /// The initial state is in: publish the nodes, give restored endpoints their pods'
    /// identities, and regenerate every endpoint (the reaction reports ready when done).
    pub(super) fn after_initial_sync(&mut self) {
        self.initial_sync_done = true;
        self.publish_nodes();
        self.shared.bootstrap.synced(&self.shared.metrics);
        let mut ipcache = self.sync_ipcache.take();
        ipcache.extend(self.refresh_all_identities());
        ipcache.extend(self.end_numbering_restore());
        let (revision, endpoints) = (self.engine().revision(), self.endpoints.len());
        let to_regenerate = self.endpoints_with_identity();
        tracing::info!(
            revision,
            endpoints,
            "initial sync done; regenerating endpoints"
        );
        self.reaction.do_send(
            PolicyReaction {
                revision,
                accepted_at: Instant::now(),
                reason: "initial sync".into(),
                to_regenerate,
                to_bump: vec![],
                force: true,
                ipcache,
                observe_delay: false,
                set_ready: true,
                release_memory: true,
                peers: None,
                immediate: false,
                done: None,
            },
            NAME,
        );
        self.update_gauges();
    }
}

impl PolicyRepoActor {
    /// Restored endpoints whose pods are now known take their identity from the pod; returns
    /// the ipcache changes that makes.
    pub(super) fn refresh_all_identities(&mut self) -> Vec<IpcacheChange> {
        let ids = self.endpoints.ids();
        let mut ipcache = Vec::new();
        // Every endpoint regenerates after this: who else is affected does not matter.
        let mut affected = BTreeSet::new();
        for id in ids {
            self.refresh_endpoint_identity(id, &mut ipcache, &mut affected);
        }
        ipcache
    }

    /// Every endpoint that has an identity (the others cannot be regenerated yet).
    pub(super) fn endpoints_with_identity(&self) -> Vec<EndpointHandle> {
        self.endpoints
            .iter()
            .filter(|(_, e)| e.record.identity.is_some())
            .map(|(id, e)| (id, e.handle.clone()))
            .collect()
    }
}
