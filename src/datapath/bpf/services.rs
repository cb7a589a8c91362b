//! Socket-level service translation in the kernel: loads `bpf/services.bpf.c` with its maps
//! pinned under `<bpf-root>/ciliate/`, attaches its eight cgroup v2 programs (connect, sendmsg,
//! recvmsg and getpeername, per family) to `--cgroup-root`
//! through BPF links pinned beside the maps (they outlive the agent: translation goes on while
//! it is stopped), and implements [`LbMaps`] over the pinned maps.
//!
//! A restarted agent swaps its new programs into the pinned links (`bpf_link_update`, atomic)
//! when they sit on the same cgroup, and reads the maps back ([`BpfLbMaps::restore`]) before
//! the watchers start.

use std::mem::MaybeUninit;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use libbpf_rs::libbpf_sys as sys;
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, MapHandle};

use super::{sys as syserr, Pod};
use crate::datapath::DatapathError;
use crate::services::{Backend, Frontend, LbMaps, Restored};

super::skeleton!(skel, "services.skel.rs");

use skel::types::{
    lb4_backend, lb4_key, lb4_revnat_key, lb4_revnat_value, lb4_service, lb6_backend, lb6_key,
    lb6_revnat_key, lb6_revnat_value, lb_ids,
};

// SAFETY: integer-only structs with explicit padding (bpf/services.h); sizes checked in tests.
unsafe impl Pod for lb4_key {}
unsafe impl Pod for lb4_service {}
unsafe impl Pod for lb4_backend {}
unsafe impl Pod for lb4_revnat_key {}
unsafe impl Pod for lb4_revnat_value {}
unsafe impl Pod for lb6_key {}
unsafe impl Pod for lb6_backend {}
unsafe impl Pod for lb6_revnat_key {}
unsafe impl Pod for lb6_revnat_value {}
unsafe impl Pod for lb_ids {}

/// The pinned links, by hook.
const LINKS: [&str; 8] = [
    "lb_link_connect4",
    "lb_link_sendmsg4",
    "lb_link_recvmsg4",
    "lb_link_getpeername4",
    "lb_link_connect6",
    "lb_link_sendmsg6",
    "lb_link_recvmsg6",
    "lb_link_getpeername6",
];

fn fail(operation: impl Into<String>) -> impl FnOnce(std::io::Error) -> DatapathError {
    let operation = operation.into();
    move |e| DatapathError::System {
        operation,
        message: e.to_string(),
    }
}

/// The service maps of one agent: per family, frontends and backends (backend ids are shared
/// by both families).
pub struct BpfLbMaps {
    services: MapHandle,
    backends: MapHandle,
    services6: MapHandle,
    backends6: MapHandle,
    ids: MapHandle,
}

/// Loads the program, attaches it under `cgroup` (links pinned in `pins`) and opens its maps.
pub fn attach(pins: &Path, cgroup: &Path) -> Result<BpfLbMaps, DatapathError> {
    let meta =
        std::fs::metadata(cgroup).map_err(fail(format!("--cgroup-root {}", cgroup.display())))?;
    if !is_cgroup2(cgroup) {
        return Err(DatapathError::System {
            operation: format!("--cgroup-root {}", cgroup.display()),
            message: "not a cgroup v2 directory".into(),
        });
    }
    let cgroup_fd =
        std::fs::File::open(cgroup).map_err(fail(format!("open {}", cgroup.display())))?;
    let (_root, opts) = super::pinned_under(pins)?;
    let mut storage = MaybeUninit::uninit();
    let open = skel::ServicesSkelBuilder::default()
        .open_opts(opts, &mut storage)
        .map_err(syserr("open the service translation program"))?;
    let skel = open
        .load()
        .map_err(syserr("load the service translation program"))?;
    let progs = [
        &skel.progs.sock4_connect,
        &skel.progs.sock4_sendmsg,
        &skel.progs.sock4_recvmsg,
        &skel.progs.sock4_getpeername,
        &skel.progs.sock6_connect,
        &skel.progs.sock6_sendmsg,
        &skel.progs.sock6_recvmsg,
        &skel.progs.sock6_getpeername,
    ];
    for (prog, name) in progs.into_iter().zip(LINKS) {
        attach_one(
            prog,
            cgroup_fd.as_fd().as_raw_fd(),
            meta.ino(),
            &pins.join(name),
        )?;
    }
    let open_map = |name: &str| {
        MapHandle::from_pinned_path(pins.join(name)).map_err(syserr(format!(
            "open pinned map {}",
            pins.join(name).display()
        )))
    };
    Ok(BpfLbMaps {
        services: open_map("lb4_services")?,
        backends: open_map("lb4_backends")?,
        services6: open_map("lb6_services")?,
        backends6: open_map("lb6_backends")?,
        ids: open_map("lb_ids")?,
    })
}

fn is_cgroup2(p: &Path) -> bool {
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    #[allow(clippy::unnecessary_cast)]
    nix::sys::statfs::statfs(p).is_ok_and(|st| st.filesystem_type().0 as i64 == CGROUP2_SUPER_MAGIC)
}

/// The cgroup id a pinned cgroup link is attached to (`None`: no pin, or not such a link).
fn pinned_cgroup(pin: &Path) -> Option<(i32, u64)> {
    let path = std::ffi::CString::new(pin.as_os_str().as_encoded_bytes()).ok()?;
    let fd = unsafe { sys::bpf_obj_get(path.as_ptr()) };
    if fd < 0 {
        return None;
    }
    let mut info: sys::bpf_link_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<sys::bpf_link_info>() as u32;
    if unsafe { sys::bpf_link_get_info_by_fd(fd, &mut info, &mut len) } != 0
        || info.type_ != sys::BPF_LINK_TYPE_CGROUP
    {
        unsafe { nix::libc::close(fd) };
        return None;
    }
    Some((fd, unsafe { info.__bindgen_anon_1.cgroup.cgroup_id }))
}

/// Puts `prog` on the cgroup: into the pinned link when it sits on the same cgroup (atomic
/// replacement), else through a new link, pinned.
fn attach_one(
    prog: &libbpf_rs::ProgramMut<'_>,
    cgroup_fd: i32,
    cgroup_id: u64,
    pin: &Path,
) -> Result<(), DatapathError> {
    if let Some((fd, id)) = pinned_cgroup(pin) {
        let updated = id == cgroup_id
            && unsafe { sys::bpf_link_update(fd, prog.as_fd().as_raw_fd(), std::ptr::null()) } == 0;
        unsafe { nix::libc::close(fd) };
        if updated {
            return Ok(());
        }
    }
    // A link of another cgroup (the flag changed) or a stale pin: replaced. Removing the pin
    // detaches the old link once nothing else holds it.
    let _ = std::fs::remove_file(pin);
    let mut link = prog
        .attach_cgroup(cgroup_fd)
        .map_err(syserr(format!("attach {} to the cgroup", pin.display())))?;
    link.pin(pin)
        .map_err(syserr(format!("pin {}", pin.display())))?;
    Ok(())
}

/// Removes the pinned links of `pins` (the translation stops once nothing holds them).
pub fn detach(pins: &Path) {
    for name in LINKS {
        let _ = std::fs::remove_file(pins.join(name));
    }
}

/// The pinned link paths (for tests and tools).
pub fn link_pins(pins: &Path) -> Vec<PathBuf> {
    LINKS.iter().map(|n| pins.join(n)).collect()
}

/// An address as the program reads it from `struct bpf_sock_addr` (network byte order words).
fn words6(a: &Ipv6Addr) -> [u32; 4] {
    let o = a.octets();
    std::array::from_fn(|i| {
        u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
    })
}

fn from_words6(w: [u32; 4]) -> Ipv6Addr {
    let mut o = [0u8; 16];
    for (i, w) in w.iter().enumerate() {
        o[4 * i..4 * i + 4].copy_from_slice(&w.to_ne_bytes());
    }
    Ipv6Addr::from(o)
}

/// The key of slot `slot` of `fe`, in its family's map.
fn key(fe: &Frontend, slot: usize) -> Result<Vec<u8>, String> {
    let backend_slot = u16::try_from(slot).map_err(|_| format!("{fe}: too many backends"))?;
    Ok(match fe.ip {
        IpAddr::V4(a) => lb4_key {
            address: u32::from_ne_bytes(a.octets()),
            dport: fe.port.to_be(),
            backend_slot,
            proto: fe.protocol,
            ..Default::default()
        }
        .as_bytes()
        .to_vec(),
        IpAddr::V6(a) => lb6_key {
            address: words6(&a),
            dport: fe.port.to_be(),
            backend_slot,
            proto: fe.protocol,
            ..Default::default()
        }
        .as_bytes()
        .to_vec(),
    })
}

impl BpfLbMaps {
    /// The frontend map of `ip`'s family, with its name.
    fn services_of(&self, ip: &IpAddr) -> (&MapHandle, &'static str) {
        match ip {
            IpAddr::V4(_) => (&self.services, "lb4_services"),
            IpAddr::V6(_) => (&self.services6, "lb6_services"),
        }
    }

    fn backends_of(&self, ip: &IpAddr) -> (&MapHandle, &'static str) {
        match ip {
            IpAddr::V4(_) => (&self.backends, "lb4_backends"),
            IpAddr::V6(_) => (&self.backends6, "lb6_backends"),
        }
    }
}

fn err(what: &str) -> impl FnOnce(libbpf_rs::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

impl LbMaps for BpfLbMaps {
    fn name(&self) -> &'static str {
        "bpf"
    }

    fn upsert_backend(&mut self, id: u32, b: &Backend) -> Result<(), String> {
        let v = match b.ip {
            IpAddr::V4(a) => lb4_backend {
                address: u32::from_ne_bytes(a.octets()),
                port: b.port.to_be(),
                proto: b.protocol,
                ..Default::default()
            }
            .as_bytes()
            .to_vec(),
            IpAddr::V6(a) => lb6_backend {
                address: words6(&a),
                port: b.port.to_be(),
                proto: b.protocol,
                ..Default::default()
            }
            .as_bytes()
            .to_vec(),
        };
        let (map, name) = self.backends_of(&b.ip);
        map.update(&id.to_ne_bytes(), &v, MapFlags::ANY)
            .map_err(err(name))
    }

    fn delete_backend(&mut self, id: u32, b: &Backend) -> Result<(), String> {
        let (map, name) = self.backends_of(&b.ip);
        match map.delete(&id.to_ne_bytes()) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == libbpf_rs::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("{name}: {e}")),
        }
    }

    fn upsert_frontend(
        &mut self,
        fe: &Frontend,
        service_id: u32,
        backends: &[u32],
        old_count: usize,
    ) -> Result<(), String> {
        let count =
            u16::try_from(backends.len()).map_err(|_| format!("{fe}: too many backends"))?;
        let (map, name) = self.services_of(&fe.ip);
        for (i, b) in backends.iter().enumerate() {
            let v = lb4_service {
                backend_id: *b,
                service_id,
                ..Default::default()
            };
            map.update(&key(fe, i + 1)?, v.as_bytes(), MapFlags::ANY)
                .map_err(err(name))?;
        }
        let master = lb4_service {
            count,
            service_id,
            ..Default::default()
        };
        map.update(&key(fe, 0)?, master.as_bytes(), MapFlags::ANY)
            .map_err(err(name))?;
        for slot in backends.len() + 1..=old_count {
            let _ = map.delete(&key(fe, slot)?);
        }
        Ok(())
    }

    fn delete_frontend(&mut self, fe: &Frontend, old_count: usize) -> Result<(), String> {
        let (map, _) = self.services_of(&fe.ip);
        for slot in 0..=old_count {
            let _ = map.delete(&key(fe, slot)?);
        }
        Ok(())
    }

    fn save_ids(&mut self, next_service: u32, next_backend: u32) -> Result<(), String> {
        let v = lb_ids {
            next_service,
            next_backend,
        };
        self.ids
            .update(&0u32.to_ne_bytes(), v.as_bytes(), MapFlags::ANY)
            .map_err(err("lb_ids"))
    }
}

impl BpfLbMaps {
    /// What the previous agent left: every frontend with its id and backends in slot order,
    /// every backend, and the id counters.
    pub fn restore(&self) -> Restored {
        let mut r = Restored::default();
        let mut slots: Vec<(Frontend, u16, lb4_service)> = Vec::new();
        for (map, v6) in [(&self.services, false), (&self.services6, true)] {
            for (k, v) in entries(map) {
                let Some(v) = lb4_service::from_bytes(&v) else {
                    continue;
                };
                let key = if v6 {
                    lb6_key::from_bytes(&k).map(|k| {
                        (
                            IpAddr::V6(from_words6(k.address)),
                            k.dport,
                            k.backend_slot,
                            k.proto,
                        )
                    })
                } else {
                    lb4_key::from_bytes(&k).map(|k| {
                        let a = Ipv4Addr::from(k.address.to_ne_bytes());
                        (IpAddr::V4(a), k.dport, k.backend_slot, k.proto)
                    })
                };
                let Some((ip, dport, slot, protocol)) = key else {
                    continue;
                };
                let port = u16::from_be(dport);
                slots.push((Frontend { ip, port, protocol }, slot, v));
            }
        }
        slots.sort_by_key(|(fe, slot, _)| (*fe, *slot));
        for (fe, slot, v) in slots {
            let e = r.frontends.entry(fe).or_insert((v.service_id, Vec::new()));
            if slot > 0 {
                e.1.push(v.backend_id);
            }
        }
        for (map, v6) in [(&self.backends, false), (&self.backends6, true)] {
            for (k, v) in entries(map) {
                let Some(id) = k.get(..4).and_then(|b| b.try_into().ok()) else {
                    continue;
                };
                let backend = if v6 {
                    lb6_backend::from_bytes(&v)
                        .map(|v| (IpAddr::V6(from_words6(v.address)), v.port, v.proto))
                } else {
                    lb4_backend::from_bytes(&v).map(|v| {
                        let a = Ipv4Addr::from(v.address.to_ne_bytes());
                        (IpAddr::V4(a), v.port, v.proto)
                    })
                };
                let Some((ip, port, protocol)) = backend else {
                    continue;
                };
                let port = u16::from_be(port);
                r.backends
                    .insert(u32::from_ne_bytes(id), Backend { ip, port, protocol });
            }
        }
        if let Ok(Some(v)) = self.ids.lookup(&0u32.to_ne_bytes(), MapFlags::ANY) {
            if let Some(ids) = lb_ids::from_bytes(&v) {
                r.next_service = ids.next_service;
                r.next_backend = ids.next_backend;
            }
        }
        r
    }
}

/// Every (key, value) of `map`.
fn entries(map: &MapHandle) -> Vec<(Vec<u8>, Vec<u8>)> {
    map.keys()
        .filter_map(|k| match map.lookup(&k, MapFlags::ANY) {
            Ok(Some(v)) => Some((k, v)),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_words_are_the_addresses_bytes_in_order() {
        let a: Ipv6Addr = "fd00:96::1:2".parse().unwrap();
        let w = words6(&a);
        assert_eq!(w[0].to_ne_bytes(), [0xfd, 0, 0, 0x96]);
        assert_eq!(from_words6(w), a);
    }

    #[test]
    fn shared_structs_have_no_implicit_padding() {
        use std::mem::size_of;
        assert_eq!(size_of::<lb4_key>(), 12);
        assert_eq!(size_of::<lb4_service>(), 12);
        assert_eq!(size_of::<lb4_backend>(), 8);
        assert_eq!(size_of::<lb4_revnat_key>(), 16);
        assert_eq!(size_of::<lb4_revnat_value>(), 12);
        assert_eq!(size_of::<lb6_key>(), 24);
        assert_eq!(size_of::<lb6_backend>(), 20);
        assert_eq!(size_of::<lb6_revnat_key>(), 32);
        assert_eq!(size_of::<lb6_revnat_value>(), 24);
        assert_eq!(size_of::<lb_ids>(), 8);
    }
}
