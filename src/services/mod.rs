//! Services resolved before egress policy: the service table ([`table`]) and what keeps the
//! datapath's service maps in step with it ([`ServiceLb`]).
//!
//! Both watchers (manifest directory and Kubernetes) hand Service and EndpointSlice changes to
//! the one `ServiceLb` of the agent, which writes each change to the maps at once (no
//! batching: an EndpointSlice change reaches them within the watcher's delivery time).
//! Before the initial sync nothing is written: what the previous agent left pinned keeps
//! translating (Cilium's `RestoreServices`), and the first full table replaces it.

pub mod table;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;

use serde::Serialize;

pub use table::{
    refused_backend, Backend, Frontend, FrontendState, Ids, ServiceName, ServicePort, ServiceSpec,
    ServiceTable, SliceEndpoint, SlicePort, SliceSpec, TargetPort,
};

/// What a datapath's service maps need to be told. Writes for one frontend come in an order
/// that is safe for a program reading concurrently: backends first, then the frontend's
/// slots, then its master entry, then removals.
pub trait LbMaps: Send {
    /// A short name for status ("bpf", "memory").
    fn name(&self) -> &'static str;
    fn upsert_backend(&mut self, id: u32, backend: &Backend) -> Result<(), String>;
    /// `backend` is what `id` was written as (its family names the map).
    fn delete_backend(&mut self, id: u32, backend: &Backend) -> Result<(), String>;
    /// Writes slots 1..=backends.len(), then the master entry, then removes slots up to
    /// `old_count`.
    fn upsert_frontend(
        &mut self,
        fe: &Frontend,
        service_id: u32,
        backends: &[u32],
        old_count: usize,
    ) -> Result<(), String>;
    /// Removes the master entry first (no new connection picks a slot), then the slots.
    fn delete_frontend(&mut self, fe: &Frontend, old_count: usize) -> Result<(), String>;
    /// Records the id counters (so a restart never hands out an old id).
    fn save_ids(&mut self, next_service: u32, next_backend: u32) -> Result<(), String>;
}

/// What the previous agent left in the maps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restored {
    /// Frontend -> (service id, backend ids in slot order).
    pub frontends: BTreeMap<Frontend, (u32, Vec<u32>)>,
    /// Backend id -> backend.
    pub backends: BTreeMap<u32, Backend>,
    pub next_service: u32,
    pub next_backend: u32,
}

/// The in-process model (`--datapath memory`, and with no `--cgroup-root`): nothing is
/// attached; the table is kept and shown.
#[derive(Debug, Default)]
pub struct NoMaps;

impl LbMaps for NoMaps {
    fn name(&self) -> &'static str {
        "memory"
    }
    fn upsert_backend(&mut self, _: u32, _: &Backend) -> Result<(), String> {
        Ok(())
    }
    fn delete_backend(&mut self, _: u32, _: &Backend) -> Result<(), String> {
        Ok(())
    }
    fn upsert_frontend(&mut self, _: &Frontend, _: u32, _: &[u32], _: usize) -> Result<(), String> {
        Ok(())
    }
    fn delete_frontend(&mut self, _: &Frontend, _: usize) -> Result<(), String> {
        Ok(())
    }
    fn save_ids(&mut self, _: u32, _: u32) -> Result<(), String> {
        Ok(())
    }
}

/// One backend of `ciliate service list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BackendView {
    pub ip: IpAddr,
    pub port: u16,
    pub ready: bool,
}

/// One frontend of `ciliate service list` (interfaces.md section 8), with its ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FrontendView {
    pub namespace: String,
    pub name: String,
    pub frontend: String,
    pub backends: Vec<BackendView>,
    pub service_id: Option<u32>,
    pub backend_ids: Vec<u32>,
}

/// Counts for `ciliate status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ServiceCounts {
    pub services: usize,
    pub frontends: usize,
    pub backends: usize,
    pub translation: String,
}

struct Realized {
    /// The service it was written for (`None`: restored, not yet synced).
    service: Option<ServiceName>,
    service_id: u32,
    backends: Vec<u32>,
}

struct Inner {
    table: ServiceTable,
    ids: Ids,
    /// What the maps hold, per frontend.
    realized: BTreeMap<Frontend, Realized>,
    /// Backend id -> (backend, frontends using it).
    backend_refs: BTreeMap<u32, (Backend, usize)>,
    maps: Box<dyn LbMaps>,
    synced: bool,
    /// Why translation is off, if it is (shown in status).
    note: Option<String>,
}

/// The agent's services: the table, the ids and the maps they are written to.
pub struct ServiceLb {
    inner: Mutex<Inner>,
}

impl ServiceLb {
    /// Nothing attached: the table is kept in process.
    pub fn memory(note: Option<String>) -> ServiceLb {
        ServiceLb::new(Box::new(NoMaps), Restored::default(), note)
    }

    /// Over `maps`, with what the previous agent left in them.
    pub fn new(maps: Box<dyn LbMaps>, restored: Restored, note: Option<String>) -> ServiceLb {
        let mut backend_refs: BTreeMap<u32, (Backend, usize)> = restored
            .backends
            .iter()
            .map(|(id, b)| (*id, (*b, 0)))
            .collect();
        let mut realized = BTreeMap::new();
        let mut services = Vec::new();
        for (fe, (sid, bids)) in &restored.frontends {
            for b in bids {
                if let Some(r) = backend_refs.get_mut(b) {
                    r.1 += 1;
                }
            }
            services.push((*fe, *sid));
            realized.insert(
                *fe,
                Realized {
                    service: None,
                    service_id: *sid,
                    backends: bids.clone(),
                },
            );
        }
        let ids = Ids::restore(
            services,
            restored.backends.iter().map(|(id, b)| (*b, *id)),
            restored.next_service,
            restored.next_backend,
        );
        ServiceLb {
            inner: Mutex::new(Inner {
                table: ServiceTable::default(),
                ids,
                realized,
                backend_refs,
                maps,
                synced: false,
                note,
            }),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        // A panic elsewhere while holding the lock leaves consistent data (every write is
        // complete per frontend): keep serving.
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// A Service appeared or changed (`Some`) or went away (`None`).
    pub fn set_service(&self, namespace: &str, name: &str, spec: Option<ServiceSpec>) {
        self.with(|i| {
            let affected = i
                .table
                .set_service((namespace.to_string(), name.to_string()), spec);
            i.apply(&affected);
        })
    }

    /// An EndpointSlice (`namespace/name`) appeared or changed (`Some`) or went away (`None`).
    pub fn set_slice(&self, key: &str, slice: Option<SliceSpec>) {
        self.with(|i| {
            let affected = i.table.set_slice(key, slice);
            i.apply(&affected);
        })
    }

    /// The initial sync is complete: the table is whole, so the maps are made to match it
    /// (frontends and backends only the previous agent knew are removed).
    pub fn initial_sync_done(&self) {
        self.with(|i| {
            if i.synced {
                return;
            }
            i.synced = true;
            let (wanted, conflicts) = i.table.frontends();
            for (fe, svc) in conflicts {
                tracing::warn!(frontend = %fe, service = %format!("{}/{}", svc.0, svc.1), "frontend already used by another service; ignored");
            }
            let stale: Vec<Frontend> = i
                .realized
                .keys()
                .filter(|fe| !wanted.contains_key(fe))
                .copied()
                .collect();
            for fe in stale {
                i.realize(&fe, None);
            }
            for (fe, st) in &wanted {
                i.realize(fe, Some(st));
            }
            i.collect_backends();
            tracing::info!(frontends = i.realized.len(), "services synced to the datapath");
        })
    }

    /// Every frontend of the table, with its backends and ids.
    pub fn list(&self) -> Vec<FrontendView> {
        self.with(|i| {
            let (all, _) = i.table.frontends();
            all.into_iter()
                .map(|(fe, st)| {
                    let realized = i.realized.get(&fe);
                    FrontendView {
                        namespace: st.service.0.clone(),
                        name: st.service.1.clone(),
                        frontend: fe.to_string(),
                        backends: st
                            .backends
                            .iter()
                            .map(|(b, ready)| BackendView {
                                ip: b.ip,
                                port: b.port,
                                ready: *ready,
                            })
                            .collect(),
                        service_id: realized.map(|r| r.service_id),
                        backend_ids: realized.map(|r| r.backends.clone()).unwrap_or_default(),
                    }
                })
                .collect()
        })
    }

    pub fn counts(&self) -> ServiceCounts {
        self.with(|i| {
            let (all, _) = i.table.frontends();
            let backends: std::collections::BTreeSet<Backend> = all
                .values()
                .flat_map(|s| s.backends.iter().map(|(b, _)| *b))
                .collect();
            ServiceCounts {
                services: i.table.services().count(),
                frontends: all.len(),
                backends: backends.len(),
                translation: match &i.note {
                    Some(n) => format!("{} ({n})", i.maps.name()),
                    None => i.maps.name().to_string(),
                },
            }
        })
    }
}

impl Inner {
    /// Writes the frontends of the affected services (after the initial sync).
    fn apply(&mut self, affected: &[ServiceName]) {
        if !self.synced {
            return;
        }
        for id in affected {
            let wanted = self.table.frontends_of(id);
            let gone: Vec<Frontend> = self
                .realized
                .iter()
                .filter(|(fe, r)| r.service.as_ref() == Some(id) && !wanted.contains_key(fe))
                .map(|(fe, _)| *fe)
                .collect();
            for fe in gone {
                self.realize(&fe, None);
            }
            for (fe, st) in &wanted {
                // A frontend another service still claims stays with it (the first service
                // keeps it; a restart gives it to the first by name).
                if let Some(other) = self.claimed_by_other(fe, id) {
                    tracing::warn!(frontend = %fe, service = %format!("{}/{}", id.0, id.1), holder = %format!("{}/{}", other.0, other.1), "frontend already used by another service; ignored");
                    continue;
                }
                self.realize(fe, Some(st));
            }
        }
        self.collect_backends();
    }

    /// The other service holding `fe` in the maps, if it still claims it.
    fn claimed_by_other(&self, fe: &Frontend, id: &ServiceName) -> Option<ServiceName> {
        let holder = self.realized.get(fe)?.service.clone()?;
        (&holder != id && self.table.frontends_of(&holder).contains_key(fe)).then_some(holder)
    }

    /// Makes the maps hold `state` for `fe` (`None`: remove it).
    fn realize(&mut self, fe: &Frontend, state: Option<&FrontendState>) {
        let old_count = self.realized.get(fe).map_or(0, |r| r.backends.len());
        let Some(state) = state else {
            if let Some(old) = self.realized.remove(fe) {
                if let Err(e) = self.maps.delete_frontend(fe, old_count) {
                    tracing::error!(frontend = %fe, error = %e, "service not removed from the datapath");
                }
                self.unref(&old.backends);
            }
            self.ids.release_service(fe);
            return;
        };
        let service_id = self.ids.service(*fe);
        let mut ids = Vec::new();
        for b in state.ready() {
            let id = self.ids.backend(b);
            let entry = self.backend_refs.entry(id).or_insert((b, 0));
            if entry.1 == 0 {
                if let Err(e) = self.maps.upsert_backend(id, &b) {
                    tracing::error!(backend = id, error = %e, "backend not written");
                    continue;
                }
            }
            ids.push(id);
        }
        if let Some(r) = self
            .realized
            .get_mut(fe)
            .filter(|r| r.service_id == service_id && r.backends == ids)
        {
            r.service = Some(state.service.clone());
            return;
        }
        if let Err(e) = self.maps.upsert_frontend(fe, service_id, &ids, old_count) {
            // Fail closed: a frontend that cannot be written completely gets no backends.
            tracing::error!(frontend = %fe, error = %e, "service not written; its connections fail");
            let _ = self.maps.upsert_frontend(fe, service_id, &[], old_count);
            ids.clear();
        }
        for id in &ids {
            if let Some(r) = self.backend_refs.get_mut(id) {
                r.1 += 1;
            }
        }
        let old = self.realized.insert(
            *fe,
            Realized {
                service: Some(state.service.clone()),
                service_id,
                backends: ids,
            },
        );
        if let Some(old) = old {
            self.unref(&old.backends);
        }
        if let Err(e) = self
            .maps
            .save_ids(self.ids.next_service, self.ids.next_backend)
        {
            tracing::error!(error = %e, "service id counters not saved");
        }
    }

    fn unref(&mut self, ids: &[u32]) {
        for id in ids {
            if let Some(r) = self.backend_refs.get_mut(id) {
                r.1 = r.1.saturating_sub(1);
            }
        }
    }

    /// Removes backends no frontend uses any more (after the frontends stopped naming them).
    fn collect_backends(&mut self) {
        let unused: Vec<(u32, Backend)> = self
            .backend_refs
            .iter()
            .filter(|(_, (_, n))| *n == 0)
            .map(|(id, (b, _))| (*id, *b))
            .collect();
        for (id, b) in unused {
            if let Err(e) = self.maps.delete_backend(id, &b) {
                tracing::error!(backend = id, error = %e, "backend not removed");
                continue;
            }
            self.backend_refs.remove(&id);
            self.ids.release_backend(&b);
        }
    }
}

#[cfg(test)]
mod tests;
