//! `BpfDatapath`: the `Datapath` trait on the real kernel maps and programs.
//!
//! Every map is pinned under `<bpf-root>/ciliate/` (reopened when the agent starts again, so
//! enforcement never stops), each endpoint has its own policy map pinned as `policy_<id>` and
//! its own program instance (`ENDPOINT_ID` set before load) attached to its host-side veth with
//! clsact tc filters, which stay in place when the agent exits or crashes.

use std::collections::{BTreeMap, BTreeSet};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

use ipnet::IpNet;
use libbpf_rs::{MapCore, MapFlags, MapHandle, MapType};

use super::encoding::{
    abi_key, flags_of_info, ip_of, ipcache_host_key, ipcache_key, pinned_endpoint_id, ProbeMasks,
};
use super::map_io::{delete_batch, typed_entries, update_batch};
use super::tcx::{self, Hook};
use super::{ensure_bpffs, load_program, types, Pod, EP_DROP_ALL};
use crate::datapath::abi::{
    EntryChange, EntryTable, PolicyEntryKey, IPCACHE_MAX_ENTRIES, POLICY_MAP_MAX_ENTRIES,
};
use crate::datapath::{
    Datapath, DatapathError, EndpointAttachment, EndpointFlags, EndpointId, PolicyMapDump,
    PolicyMapEntry, SyncStats,
};
use crate::policy::identity::{NumericIdentity, IDENTITY_HOST};
use crate::policy::mapstate::MapDelta;

mod attach;

fn sys<E: std::fmt::Display>(operation: impl Into<String>) -> impl FnOnce(E) -> DatapathError {
    let operation = operation.into();
    move |e| DatapathError::System {
        operation,
        message: e.to_string(),
    }
}

struct Endpoint {
    attachment: EndpointAttachment,
    flags: EndpointFlags,
    table: EntryTable,
    policy: MapHandle,
    ifindex: Option<i32>,
}

/// How programs are attached to interfaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    /// TCX links where the kernel has them (6.6+), legacy tc otherwise.
    Auto,
    /// Legacy tc only (clsact filters).
    LegacyTc,
}

/// See the module documentation.
pub struct BpfDatapath {
    pins: PathBuf,
    /// Still trying TCX (Auto mode and no "unsupported" answer yet).
    use_tcx: bool,
    /// The kernel tags of this build's two programs (the same for every instance).
    build_tags: Option<([u8; 8], [u8; 8])>,
    /// Ids of the maps pinned now that every current program instance must use.
    pinned_map_ids: Vec<u32>,
    /// Endpoints whose running programs were kept on re-attach (counted for tests and logs).
    pub kept_on_reattach: usize,
    /// Keep running programs of this build on re-attach (on by default).
    reuse_running: bool,
    /// Prefixes shorter than a host address (longest-prefix match).
    ipcache: MapHandle,
    /// Host addresses (/32, /128), probed first.
    ipcache_hosts: MapHandle,
    endpoint_map: MapHandle,
    policy_maps: MapHandle,
    /// This node's pods by address, for the node device's program (`host_delivery`).
    local_endpoints: MapHandle,
    local_endpoints6: MapHandle,
    /// This node's own IPv4 addresses, mirrored from the host table (`host_addrs`).
    host_addrs: super::host_addrs::HostAddrs,
    endpoints: BTreeMap<EndpointId, Endpoint>,
}

impl BpfDatapath {
    /// Opens (or creates) the pinned maps under `<bpf_root>/ciliate/`.
    pub fn open(bpf_root: &Path) -> Result<Self, DatapathError> {
        Self::open_with(bpf_root, AttachMode::Auto)
    }

    /// [`BpfDatapath::open`] with an explicit way of attaching programs.
    pub fn open_with(bpf_root: &Path, mode: AttachMode) -> Result<Self, DatapathError> {
        Self::open_for(bpf_root, mode, None)
    }

    /// [`BpfDatapath::open_with`] deciding how the IPv6 conntrack table is allocated
    /// (`Some(true)`: preallocated, as an agent with `--enable-ipv6` wants; `Some(false)`: per
    /// entry; `None`: as pinned, else per entry). See [`super::load_program_deciding_ct6`].
    pub fn open_for(
        bpf_root: &Path,
        mode: AttachMode,
        ipv6: Option<bool>,
    ) -> Result<Self, DatapathError> {
        // libbpf's own messages go to the log (some are expected, e.g. an existing clsact).
        libbpf_rs::set_print(Some((
            libbpf_rs::PrintLevel::Info,
            |level, msg| match level {
                libbpf_rs::PrintLevel::Warn => {
                    tracing::debug!(target: "libbpf", "{}", msg.trim_end())
                }
                _ => tracing::trace!(target: "libbpf", "{}", msg.trim_end()),
            },
        )));
        ensure_bpffs(bpf_root)?;
        let pins = bpf_root.join("ciliate");
        let build_tags = {
            // Loading an instance creates every map and pins it, or reuses the pins.
            let mut storage = MaybeUninit::uninit();
            let skel = match ipv6 {
                Some(v6) => super::load_program_deciding_ct6(&mut storage, &pins, 0, v6)?,
                None => load_program(&mut storage, &pins, 0)?,
            };
            tcx::tag_of(&skel.progs.from_container).zip(tcx::tag_of(&skel.progs.to_container))
        };
        let open = |name: &str| {
            MapHandle::from_pinned_path(pins.join(name)).map_err(sys(format!(
                "open pinned map {}",
                pins.join(name).display()
            )))
        };
        let dp = BpfDatapath {
            ipcache: open("ipcache")?,
            ipcache_hosts: open("ipcache_hosts")?,
            endpoint_map: open("endpoints")?,
            policy_maps: open("policy_maps")?,
            local_endpoints: open(super::host_delivery::MAP)?,
            local_endpoints6: open(super::host_delivery::MAP6)?,
            host_addrs: {
                let hosts = open("ipcache_hosts")?;
                super::migrate::migrate_host_prefixes(&open("ipcache")?, &hosts);
                super::host_addrs::HostAddrs::open(&pins, &hosts)?
            },
            endpoints: BTreeMap::new(),
            pins,
            use_tcx: mode == AttachMode::Auto,
            build_tags,
            pinned_map_ids: Vec::new(),
            kept_on_reattach: 0,
            reuse_running: true,
        };
        let mut dp = dp;
        dp.pinned_map_ids = [&dp.endpoint_map, &dp.policy_maps, &dp.ipcache_hosts]
            .iter()
            .filter_map(|m| m.info().ok().map(|i| i.info.id))
            .collect();
        if let Some(a) = super::conntrack::adopt_legacy(&dp.pins) {
            tracing::info!(
                moved = a.moved,
                failed = a.failed,
                unpinned = a.unpinned,
                "conntrack: entries of an older version's single table moved to the IPv4 and IPv6 tables"
            );
        }
        // Policy verdict events for the first packet of every new allowed connection, as
        // Cilium's policy-verdict notifications (drops are always reported).
        dp.set_allow_events(true)?;
        Ok(dp)
    }

    /// Whether the programs report allowed new connections too (drops are always reported).
    pub fn set_allow_events(&self, on: bool) -> Result<(), DatapathError> {
        let path = self.pins.join("settings");
        let map =
            MapHandle::from_pinned_path(&path).map_err(sys(format!("open {}", path.display())))?;
        let c = types::datapath_config {
            emit_allow_events: on as u32,
            pad: 0,
        };
        map.update(&0u32.to_ne_bytes(), c.as_bytes(), MapFlags::ANY)
            .map_err(sys("write the datapath settings"))
    }

    /// Whether re-attaching keeps a running instance of this build instead of loading a new
    /// one (tests turn it off to exercise the in-place link update an upgrade goes through).
    pub fn set_reuse_running_programs(&mut self, reuse: bool) {
        self.reuse_running = reuse;
    }

    /// Where the maps are pinned.
    pub fn pin_dir(&self) -> &Path {
        &self.pins
    }

    /// Starts the one consumer of the verdict ring buffer: a thread that decodes every event
    /// and hands it to `sink` until `sink` returns false.
    pub fn spawn_event_reader(
        &self,
        sink: impl FnMut(crate::datapath::events::VerdictEvent) -> bool + Send + 'static,
    ) -> Result<std::thread::JoinHandle<()>, DatapathError> {
        let path = self.pins.join("events");
        let map =
            MapHandle::from_pinned_path(&path).map_err(sys(format!("open {}", path.display())))?;
        // Opened once: the reader looks at the loss counter after every poll.
        let counters_path = self.pins.join("verdict_counters");
        let counters = MapHandle::from_pinned_path(&counters_path)
            .map_err(sys(format!("open {}", counters_path.display())))?;
        let lost_count = move || {
            super::host_routes::percpu_sum(&counters, "verdict_counters", super::EVENTS_LOST)
                .unwrap_or(0)
        };
        let handle = std::thread::Builder::new()
            .name("ciliate-events".into())
            .spawn(move || {
                let keep = std::rc::Rc::new(std::cell::Cell::new(true));
                let sink = std::rc::Rc::new(std::cell::RefCell::new(sink));
                let (keep_cb, sink_cb) = (keep.clone(), sink.clone());
                let mut builder = libbpf_rs::RingBufferBuilder::new();
                let added = builder.add(&map, move |data: &[u8]| {
                    for e in super::record_events(data) {
                        let reason = super::REASONS.get(e.reason as usize).copied().unwrap_or("drop-unknown");
                        let mut ev = crate::datapath::events::verdict_event(
                            e.timestamp_ns, e.endpoint_id, e.peer_identity, e.egress != 0, e.protocol, e.port, reason, e.family, e.saddr, e.daddr, e.cookie,
                        );
                        (ev.source_port, ev.tcp_flags) = (e.sport, e.tcp_flags);
                        if !(sink_cb.borrow_mut())(ev) {
                            keep_cb.set(false);
                        }
                    }
                    0
                });
                let rb = match added.map(|_| ()).and_then(|()| builder.build()) {
                    Ok(rb) => rb,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot read the verdict ring buffer; `ciliate monitor` will show nothing");
                        return;
                    }
                };
                // Losses of this run (the counter is pinned: earlier runs' are not ours).
                let mut lost = lost_count();
                while keep.get() {
                    if let Err(e) = rb.poll(std::time::Duration::from_millis(200)) {
                        tracing::warn!(error = %e, "verdict ring buffer poll failed");
                    }
                    let now = lost_count();
                    if now > lost {
                        let ev = crate::datapath::events::lost_event(now - lost);
                        lost = now;
                        if !(sink.borrow_mut())(ev) {
                            keep.set(false);
                        }
                    }
                }
            })
            .map_err(sys("start the event reader thread"))?;
        Ok(handle)
    }

    fn policy_map(&self, id: EndpointId) -> Result<MapHandle, DatapathError> {
        let path = self.pins.join(format!("policy_{id}"));
        if path.exists() {
            return MapHandle::from_pinned_path(&path)
                .map_err(sys(format!("open {}", path.display())));
        }
        let opts = libbpf_rs::libbpf_sys::bpf_map_create_opts {
            sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_map_create_opts>() as _,
            ..Default::default()
        };
        let mut m = MapHandle::create(
            MapType::Hash,
            Some(format!("ciliate_pol_{id}")),
            std::mem::size_of::<types::policy_key>() as u32,
            std::mem::size_of::<types::policy_value>() as u32,
            POLICY_MAP_MAX_ENTRIES as u32,
            &opts,
        )
        .map_err(sys(format!("create the policy map of endpoint {id}")))?;
        m.pin(&path)
            .map_err(sys(format!("pin {}", path.display())))?;
        Ok(m)
    }

    /// The endpoint's record; `None` for an empty slot (identity 0) of the endpoint array.
    fn read_info(&self, id: EndpointId) -> Option<types::endpoint_info> {
        let k = (id as u32).to_ne_bytes();
        self.endpoint_map
            .lookup(&k, MapFlags::ANY)
            .ok()
            .flatten()
            .and_then(|b| types::endpoint_info::from_bytes(&b))
            .filter(|i| i.identity != 0)
    }

    /// Rewrites the endpoint's slot in place. The program may read any mix of the old and the
    /// new record's fields, so callers order their writes so that every mix is safe.
    fn write_info(&self, id: EndpointId, info: &types::endpoint_info) -> Result<(), DatapathError> {
        self.endpoint_map
            .update(&(id as u32).to_ne_bytes(), info.as_bytes(), MapFlags::ANY)
            .map_err(sys(format!("update endpoint {id} in the endpoint map")))
    }
}

impl Datapath for BpfDatapath {
    fn name(&self) -> &'static str {
        "bpf"
    }

    fn attach_endpoint(&mut self, att: &EndpointAttachment) -> Result<(), DatapathError> {
        let id = att.id;
        if id == 0 || att.identity == 0 {
            // Endpoint 0 is the unmanaged program's id, and identity 0 marks an empty slot.
            return Err(DatapathError::System {
                operation: format!("attach endpoint {id}"),
                message: format!(
                    "endpoint id and identity must not be 0 (id {id}, identity {})",
                    att.identity
                ),
            });
        }
        let policy = self.policy_map(id)?;
        // A map-in-map update waits for an RCU grace period (milliseconds): skip it when this
        // very map is registered already (a restarted agent).
        let registered = self
            .policy_maps
            .lookup(&(id as u32).to_ne_bytes(), MapFlags::ANY)
            .ok()
            .flatten()
            .and_then(|b| {
                b.get(..4)
                    .map(|x| u32::from_ne_bytes([x[0], x[1], x[2], x[3]]))
            });
        let this = policy.info().ok().map(|i| i.info.id);
        if registered.is_none() || registered != this {
            let fd = policy.as_fd().as_raw_fd() as u32;
            self.policy_maps
                .update(&(id as u32).to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY)
                .map_err(sys(format!("register the policy map of endpoint {id}")))?;
        }
        // A new endpoint drops until its policy is realized; a known one (agent restart) keeps
        // enforcing what it had.
        let info = match self.read_info(id) {
            Some(mut i) => {
                i.identity = att.identity;
                i
            }
            None => ProbeMasks::default().info(att.identity, EP_DROP_ALL),
        };
        self.write_info(id, &info)?;
        let ifindex = match &att.interface {
            Some(ifname) => Some(self.attach_programs(id, ifname)?),
            None => None,
        };
        // Only now that its programs are in place may the node device's program deliver to it.
        if let (Some(ifname), Some(ifindex)) = (&att.interface, ifindex) {
            self.publish_local(att, ifname, ifindex as u32)?;
        }
        let flags = flags_of_info(&info);
        match self.endpoints.get_mut(&id) {
            Some(e) => {
                e.attachment = att.clone();
                e.ifindex = ifindex.or(e.ifindex);
            }
            None => {
                self.endpoints.insert(
                    id,
                    Endpoint {
                        attachment: att.clone(),
                        flags,
                        table: EntryTable::new(),
                        policy,
                        ifindex,
                    },
                );
            }
        }
        Ok(())
    }

    fn detach_endpoint(&mut self, id: EndpointId) -> Result<(), DatapathError> {
        // First: the node device's program stops delivering to it.
        super::host_delivery::withdraw(&self.local_endpoints, id)?;
        super::host_delivery::withdraw(&self.local_endpoints6, id)?;
        let ifindex = self.endpoints.remove(&id).and_then(|e| e.ifindex);
        match ifindex {
            Some(i) => self.detach_programs(id, i),
            // Not attached in this run: its pinned links may still be there.
            None => {
                for hook in [Hook::Ingress, Hook::Egress] {
                    tcx::detach(&self.pins.join(hook.pin_name(id)));
                }
            }
        }
        let k = (id as u32).to_ne_bytes();
        let _ = self.policy_maps.delete(&k);
        // An array slot cannot be deleted: identity 0 empties it.
        let _ = self.endpoint_map.update(
            &k,
            types::endpoint_info::default().as_bytes(),
            MapFlags::ANY,
        );
        let path = self.pins.join(format!("policy_{id}"));
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(DatapathError::System {
                operation: format!("unpin {}", path.display()),
                message: e.to_string(),
            }),
        }
    }

    fn sync_policy(
        &mut self,
        id: EndpointId,
        flags: EndpointFlags,
        delta: &MapDelta,
        replace: bool,
    ) -> Result<SyncStats, DatapathError> {
        let ep = self
            .endpoints
            .get_mut(&id)
            .ok_or(DatapathError::UnknownEndpoint(id))?;
        // The endpoint's table is changed in place (taken, put back below) unless the change
        // may not fit: then a copy is changed, and the table stays as it was when it does not.
        let in_place = !replace && ep.table.len_bound_after(delta) <= POLICY_MAP_MAX_ENTRIES;
        let mut table = if replace {
            EntryTable::new()
        } else if in_place {
            std::mem::take(&mut ep.table)
        } else {
            ep.table.clone()
        };
        let tracked = table.apply_tracked(delta);
        // Each entry's deny flag before this change (`None`: absent).
        let before: std::collections::HashMap<PolicyEntryKey, Option<bool>> = tracked
            .iter()
            .map(|(c, was)| match c {
                EntryChange::Upsert(k, ..) | EntryChange::Delete(k) => (*k, *was),
            })
            .collect();
        let mut changes: Vec<EntryChange> = tracked.into_iter().map(|(c, _)| c).collect();
        let result = (|| -> Result<SyncStats, DatapathError> {
            let ep = &self.endpoints[&id];
            let identity = ep.attachment.identity;
            let old_masks = self
                .read_info(id)
                .map(|i| ProbeMasks::of_info(&i))
                .unwrap_or_default();
            if table.len() > POLICY_MAP_MAX_ENTRIES {
                let info = old_masks.info_for(
                    identity,
                    EndpointFlags {
                        drop_all: true,
                        ..flags
                    },
                );
                self.write_info(id, &info)?;
                return Err(DatapathError::PolicyMapFull {
                    endpoint: id,
                    needed: table.len(),
                    capacity: POLICY_MAP_MAX_ENTRIES,
                });
            }
            let policy = &ep.policy;
            if replace {
                // Everything desired is written first, then what is no longer desired is removed:
                // an agent restart never opens a gap.
                let desired: BTreeSet<Vec<u8>> = table
                    .entries()
                    .map(|(k, _)| abi_key(&k).as_bytes().to_vec())
                    .collect();
                changes = table
                    .values()
                    .map(|(k, d, c, r)| EntryChange::Upsert(k, d, c, r))
                    .collect();
                for kb in policy.keys() {
                    if !desired.contains(&kb) {
                        if let Some(k) = types::policy_key::from_bytes(&kb) {
                            changes.push(EntryChange::Delete(PolicyEntryKey {
                                identity: k.identity,
                                egress: k.egress != 0,
                                protocol: k.protocol,
                                port: k.port,
                                port_prefix_len: k.port_prefix_len,
                            }));
                        }
                    }
                }
            }
            let new_masks = ProbeMasks::of(&table);
            // While entries change, probe what the old and the new entries need.
            let during = old_masks.union(new_masks).info_for(identity, ep.flags);
            self.write_info(id, &during)?;
            let mut stats = SyncStats::default();
            // Order by safety, which also keeps the map within its capacity: first remove allows
            // and add denies (both only narrow what passes), then add allows, and remove denies
            // last. No step ever lets through what neither the old nor the new policy allows.
            // Each group goes to the kernel as one batch.
            let old = |k: &PolicyEntryKey| {
                if replace {
                    None
                } else {
                    before.get(k).copied().flatten()
                }
            };
            let kernel_value = |kb: &[u8]| {
                policy
                    .lookup(kb, MapFlags::ANY)
                    .ok()
                    .flatten()
                    .and_then(|b| types::policy_value::from_bytes(&b))
            };
            let (mut allow_up, mut deny_up) = (
                (Vec::new(), Vec::new(), 0usize),
                (Vec::new(), Vec::new(), 0usize),
            );
            let (mut allow_del, mut deny_del) = (Vec::new(), Vec::new());
            for c in &changes {
                match c {
                    EntryChange::Upsert(k, deny, cookie, redirect) => {
                        let key = abi_key(k);
                        let kb = key.as_bytes();
                        // Keep the counters of an entry that already exists and only changes verdict.
                        let mut v = if replace || old(k).is_some() {
                            kernel_value(kb).unwrap_or_default()
                        } else {
                            types::policy_value::default()
                        };
                        v.deny = *deny as u8;
                        v.proxy = *redirect as u8;
                        v.cookie = *cookie;
                        let g = if *deny { &mut deny_up } else { &mut allow_up };
                        g.0.extend_from_slice(kb);
                        g.1.extend_from_slice(v.as_bytes());
                        g.2 += 1;
                    }
                    EntryChange::Delete(k) => {
                        let key = abi_key(k);
                        let was_deny = match old(k) {
                            Some(d) => d,
                            None => kernel_value(key.as_bytes()).is_some_and(|v| v.deny != 0),
                        };
                        if was_deny {
                            &mut deny_del
                        } else {
                            &mut allow_del
                        }
                        .extend_from_slice(key.as_bytes());
                    }
                }
            }
            let key_size = std::mem::size_of::<types::policy_key>();
            let fail = |e: std::io::Error| DatapathError::System {
                operation: format!("update the policy map of endpoint {id}"),
                message: e.to_string(),
            };
            delete_batch(policy, &allow_del, key_size);
            update_batch(policy, &deny_up.0, &deny_up.1, deny_up.2).map_err(fail)?;
            update_batch(policy, &allow_up.0, &allow_up.1, allow_up.2).map_err(fail)?;
            delete_batch(policy, &deny_del, key_size);
            let upserts = allow_up.2 + deny_up.2;
            let deletes = (allow_del.len() + deny_del.len()) / key_size;
            stats.upserted = upserts;
            stats.deleted = deletes;
            stats.entries = table.len();
            let info = new_masks.info_for(identity, flags);
            self.write_info(id, &info)?;
            Ok(stats)
        })();
        if let Some(e) = self.endpoints.get_mut(&id) {
            // A table changed in place goes back even on failure: it is what was asked for,
            // and the endpoint, failed closed, is rewritten in full by its next regeneration.
            if result.is_ok() || in_place {
                e.table = table;
            }
            if result.is_ok() {
                e.flags = flags;
            }
        }
        result
    }

    fn upsert_ipcache(
        &mut self,
        prefix: IpNet,
        identity: NumericIdentity,
    ) -> Result<(), DatapathError> {
        let v = types::ipcache_value { identity, pad: 0 };
        let r = match ipcache_host_key(&prefix) {
            Some(hk) => self
                .ipcache_hosts
                .update(hk.as_bytes(), v.as_bytes(), MapFlags::ANY),
            None => {
                self.ipcache
                    .update(ipcache_key(&prefix).as_bytes(), v.as_bytes(), MapFlags::ANY)
            }
        };
        r.map_err(|e| {
            if e.kind() == libbpf_rs::ErrorKind::OutOfMemory || e.to_string().contains("No space") {
                DatapathError::IpcacheFull {
                    prefix,
                    capacity: IPCACHE_MAX_ENTRIES,
                }
            } else {
                DatapathError::System {
                    operation: format!("ipcache update {prefix}"),
                    message: e.to_string(),
                }
            }
        })?;
        // The node's own IPv4 addresses, after the host table has them.
        match prefix {
            IpNet::V4(n) if n.prefix_len() == 32 => {
                self.host_addrs.set(n.addr(), identity == IDENTITY_HOST)
            }
            _ => Ok(()),
        }
    }

    fn remove_ipcache(&mut self, prefix: IpNet) -> Result<(), DatapathError> {
        if let Some(hk) = ipcache_host_key(&prefix) {
            let _ = self.ipcache_hosts.delete(hk.as_bytes());
        }
        let _ = self.ipcache.delete(ipcache_key(&prefix).as_bytes());
        match prefix {
            IpNet::V4(n) if n.prefix_len() == 32 => self.host_addrs.set(n.addr(), false),
            _ => Ok(()),
        }
    }

    fn dump_policy(&self, id: EndpointId) -> Result<PolicyMapDump, DatapathError> {
        let ep = self
            .endpoints
            .get(&id)
            .ok_or(DatapathError::UnknownEndpoint(id))?;
        let info = self.read_info(id).unwrap_or_default();
        let mut entries = Vec::new();
        for (k, v) in typed_entries::<types::policy_key, types::policy_value>(&ep.policy) {
            let ek = PolicyEntryKey {
                identity: k.identity,
                egress: k.egress != 0,
                protocol: k.protocol,
                port: k.port,
                port_prefix_len: k.port_prefix_len,
            };
            entries.push(PolicyMapEntry::new(&ek, v.deny != 0, v.packets, v.bytes));
        }
        entries.sort_by_key(|e| {
            (
                e.direction,
                e.identity,
                e.protocol,
                e.port,
                e.port_prefix_len,
            )
        });
        Ok(PolicyMapDump {
            endpoint: id,
            flags: flags_of_info(&info),
            capacity: POLICY_MAP_MAX_ENTRIES,
            entries,
        })
    }

    fn dump_ipcache(&self) -> Vec<(IpNet, NumericIdentity)> {
        let mut out = Vec::new();
        for (k, v) in typed_entries::<types::ipcache_key, types::ipcache_value>(&self.ipcache) {
            let len = k.prefixlen.saturating_sub(32) as u8;
            if let Ok(n) = IpNet::new(ip_of(k.family, &k.addr), len) {
                out.push((n, v.identity));
            }
        }
        for (k, v) in
            typed_entries::<types::ipcache_host_key, types::ipcache_value>(&self.ipcache_hosts)
        {
            out.push((IpNet::from(ip_of(k.family, &k.addr)), v.identity));
        }
        out.sort();
        out
    }

    fn endpoints(&self) -> Vec<EndpointId> {
        self.endpoints.keys().copied().collect()
    }

    fn cookies_in_use(&self) -> std::collections::HashSet<crate::policy::attribution::Cookie> {
        let mut out = Default::default();
        for ep in self.endpoints.values() {
            crate::datapath::cookies_of(&ep.flags, &ep.table, &mut out);
        }
        out
    }

    fn pinned_endpoints(&self) -> Vec<EndpointId> {
        let mut ids: Vec<EndpointId> = std::fs::read_dir(&self.pins)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| pinned_endpoint_id(&e.file_name().to_string_lossy()))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    fn start_events(
        &self,
        sink: Box<dyn FnMut(crate::datapath::events::VerdictEvent) -> bool + Send>,
    ) -> Result<(), DatapathError> {
        self.spawn_event_reader(sink).map(|_| ())
    }

    fn start_conntrack_gc(
        &self,
        interval: std::time::Duration,
        timeouts: crate::datapath::ConntrackTimeouts,
        report: Box<dyn FnMut(crate::datapath::ConntrackGcStats) + Send>,
    ) -> Result<bool, DatapathError> {
        super::conntrack::spawn_gc(self.pins.clone(), interval, timeouts, report)
            .map(|_| true)
            .map_err(|e| DatapathError::System {
                operation: "start the conntrack garbage collector".into(),
                message: e.to_string(),
            })
    }
}
