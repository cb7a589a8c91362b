//! `ServiceLb` against a model of the BPF maps' contents (slot layout as in bpf/services.h).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::*;
use crate::policy::rule::PROTO_TCP;

/// The maps' contents: (frontend, slot) -> (service id, backend id or count), backends, ids.
#[derive(Debug, Default, Clone)]
struct Contents {
    slots: BTreeMap<(Frontend, usize), (u32, u32)>,
    backends: BTreeMap<u32, Backend>,
    next: (u32, u32),
}

#[derive(Clone, Default)]
struct ModelMaps(Arc<Mutex<Contents>>);

impl LbMaps for ModelMaps {
    fn name(&self) -> &'static str {
        "model"
    }
    fn upsert_backend(&mut self, id: u32, b: &Backend) -> Result<(), String> {
        self.0.lock().unwrap().backends.insert(id, *b);
        Ok(())
    }
    fn delete_backend(&mut self, id: u32, _: &Backend) -> Result<(), String> {
        self.0.lock().unwrap().backends.remove(&id);
        Ok(())
    }
    fn upsert_frontend(
        &mut self,
        fe: &Frontend,
        sid: u32,
        backends: &[u32],
        old: usize,
    ) -> Result<(), String> {
        let mut c = self.0.lock().unwrap();
        for (i, b) in backends.iter().enumerate() {
            assert!(c.backends.contains_key(b), "a slot names a written backend");
            c.slots.insert((*fe, i + 1), (sid, *b));
        }
        c.slots.insert((*fe, 0), (sid, backends.len() as u32));
        for i in backends.len() + 1..=old {
            c.slots.remove(&(*fe, i));
        }
        Ok(())
    }
    fn delete_frontend(&mut self, fe: &Frontend, old: usize) -> Result<(), String> {
        let mut c = self.0.lock().unwrap();
        for i in 0..=old {
            c.slots.remove(&(*fe, i));
        }
        Ok(())
    }
    fn save_ids(&mut self, s: u32, b: u32) -> Result<(), String> {
        self.0.lock().unwrap().next = (s, b);
        Ok(())
    }
}

impl ModelMaps {
    fn contents(&self) -> Contents {
        self.0.lock().unwrap().clone()
    }

    /// What a restarted agent reads back.
    fn restored(&self) -> Restored {
        let c = self.contents();
        let mut frontends: BTreeMap<Frontend, (u32, Vec<u32>)> = BTreeMap::new();
        for ((fe, slot), (sid, v)) in &c.slots {
            let e = frontends.entry(*fe).or_insert((*sid, vec![]));
            if *slot > 0 {
                e.1.push(*v);
            }
        }
        Restored {
            frontends,
            backends: c.backends.clone(),
            next_service: c.next.0,
            next_backend: c.next.1,
        }
    }

    /// (count, backends) of a frontend as the program would see them.
    fn frontend(&self, fe: &Frontend) -> Option<(u32, Vec<Backend>)> {
        let c = self.contents();
        let (_, count) = *c.slots.get(&(*fe, 0))?;
        let bs = (1..=count as usize)
            .map(|i| c.backends[&c.slots[&(*fe, i)].1])
            .collect();
        Some((count, bs))
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn fe(addr: &str, port: u16) -> Frontend {
    Frontend {
        ip: ip(addr),
        port,
        protocol: PROTO_TCP,
    }
}

fn spec(addr: &str) -> ServiceSpec {
    ServiceSpec {
        cluster_ips: vec![ip(addr)],
        ports: vec![ServicePort {
            name: "http".into(),
            protocol: PROTO_TCP,
            port: 80,
            target_port: Some(TargetPort::Name("web".into())),
        }],
    }
}

/// An EndpointSlice of `service` with an `http` port on 8080.
fn slice(service: &str, eps: &[(&str, bool)]) -> SliceSpec {
    super::table::test_slice(service, eps, &[("http", 8080)])
}

fn be(addr: &str) -> Backend {
    Backend {
        ip: ip(addr),
        port: 8080,
        protocol: PROTO_TCP,
    }
}

#[test]
fn nothing_is_written_before_the_initial_sync_then_everything_is() {
    let maps = ModelMaps::default();
    let lb = ServiceLb::new(Box::new(maps.clone()), Restored::default(), None);
    lb.set_service("ns", "b", Some(spec("10.96.0.50")));
    lb.set_slice("ns/b-1", Some(slice("b", &[("10.1.0.2", true)])));
    assert!(maps.contents().slots.is_empty());
    lb.initial_sync_done();
    assert_eq!(
        maps.frontend(&fe("10.96.0.50", 80)),
        Some((1, vec![be("10.1.0.2")]))
    );
}

#[test]
fn slice_changes_reach_the_maps_and_unready_backends_get_nothing() {
    let maps = ModelMaps::default();
    let lb = ServiceLb::new(Box::new(maps.clone()), Restored::default(), None);
    lb.initial_sync_done();
    lb.set_service("ns", "b", Some(spec("10.96.0.50")));
    let f = fe("10.96.0.50", 80);
    // No backend: the master entry says 0, so connections fail at once.
    assert_eq!(maps.frontend(&f), Some((0, vec![])));
    lb.set_slice(
        "ns/b-1",
        Some(slice("b", &[("10.1.0.2", true), ("10.1.0.3", true)])),
    );
    assert_eq!(maps.frontend(&f).unwrap().0, 2);
    lb.set_slice(
        "ns/b-1",
        Some(slice("b", &[("10.1.0.2", false), ("10.1.0.3", true)])),
    );
    assert_eq!(maps.frontend(&f), Some((1, vec![be("10.1.0.3")])));
    let c = maps.contents();
    assert_eq!(c.slots.len(), 2, "the second slot is gone: {:?}", c.slots);
    assert_eq!(c.backends.len(), 1, "the unready backend is removed");
    // The list shows both, with readiness.
    let list = lb.list();
    assert_eq!(list[0].frontend, "10.96.0.50:80/TCP");
    assert_eq!(list[0].backends.len(), 2);
    assert!(!list[0].backends[0].ready && list[0].backends[1].ready);
    lb.set_service("ns", "b", None);
    let c = maps.contents();
    assert!(c.slots.is_empty() && c.backends.is_empty(), "{c:?}");
    assert_eq!(lb.counts().services, 0);
}

#[test]
fn a_restart_keeps_ids_serves_meanwhile_and_drops_only_what_is_gone() {
    let maps = ModelMaps::default();
    let lb = ServiceLb::new(Box::new(maps.clone()), Restored::default(), None);
    lb.initial_sync_done();
    lb.set_service("ns", "a", Some(spec("10.96.0.10")));
    lb.set_service("ns", "b", Some(spec("10.96.0.11")));
    lb.set_service("ns", "c", Some(spec("10.96.0.12")));
    lb.set_slice("ns/a-1", Some(slice("a", &[("10.1.0.2", true)])));
    lb.set_slice("ns/b-1", Some(slice("b", &[("10.1.0.3", true)])));
    // The highest id is released before the restart: it must still not come back.
    lb.set_service("ns", "c", None);
    let before: BTreeMap<String, (Option<u32>, Vec<u32>)> = lb
        .list()
        .into_iter()
        .map(|v| (v.name, (v.service_id, v.backend_ids)))
        .collect();
    let highest = lb.list().iter().filter_map(|v| v.service_id).max().unwrap() + 1;
    drop(lb);

    let restored = maps.restored();
    let lb = ServiceLb::new(Box::new(maps.clone()), restored, None);
    // While the table fills, the maps still hold the previous state.
    lb.set_service("ns", "a", Some(spec("10.96.0.10")));
    assert!(maps.frontend(&fe("10.96.0.11", 80)).is_some());
    lb.set_slice("ns/a-1", Some(slice("a", &[("10.1.0.2", true)])));
    lb.set_service("ns", "d", Some(spec("10.96.0.13")));
    lb.initial_sync_done();
    let after: BTreeMap<String, (Option<u32>, Vec<u32>)> = lb
        .list()
        .into_iter()
        .map(|v| (v.name, (v.service_id, v.backend_ids)))
        .collect();
    assert_eq!(after["a"], before["a"], "same service and backend ids");
    assert!(
        after["d"].0.unwrap() > highest,
        "a new service takes no old id: {after:?}"
    );
    assert_eq!(maps.frontend(&fe("10.96.0.11", 80)), None, "b is gone");
    assert_eq!(maps.contents().backends.len(), 1, "b's backend is gone");
}

/// A dual-stack Service: one frontend per ClusterIP, each with the backends of its own family
/// only; removing the IPv6 slice empties the IPv6 frontend and frees its backend.
#[test]
fn each_family_frontend_gets_its_own_familys_backends() {
    let maps = ModelMaps::default();
    let lb = ServiceLb::new(Box::new(maps.clone()), Restored::default(), None);
    lb.initial_sync_done();
    let mut dual = spec("10.96.0.10");
    dual.cluster_ips.push(ip("fd00:96::10"));
    lb.set_service("ns", "dual", Some(dual));
    lb.set_slice("ns/dual-4", Some(slice("dual", &[("10.0.0.1", true)])));
    lb.set_slice("ns/dual-6", Some(slice("dual", &[("fd00:10::1", true)])));
    assert_eq!(
        maps.frontend(&fe("10.96.0.10", 80)),
        Some((1, vec![be("10.0.0.1")]))
    );
    assert_eq!(
        maps.frontend(&fe("fd00:96::10", 80)),
        Some((1, vec![be("fd00:10::1")]))
    );
    let list = lb.list();
    assert_eq!(list.len(), 2, "{list:?}");
    assert!(list.iter().all(|f| f.service_id.is_some()), "{list:?}");
    assert!(
        list.iter().any(|f| f.frontend == "[fd00:96::10]:80/TCP"),
        "{list:?}"
    );
    lb.set_slice("ns/dual-6", None);
    assert_eq!(maps.frontend(&fe("fd00:96::10", 80)), Some((0, vec![])));
    assert_eq!(
        maps.contents().backends.len(),
        1,
        "only the IPv4 backend is left"
    );
}
