//! Pinned maps of another version: a map whose definition (type, key or value size,
//! capacity, flags) differs from this build's is moved aside before the load and its entries
//! carried over after it; host addresses an older version kept in the ipcache trie move to the
//! host table. Enforcement goes on throughout: old programs keep the maps they hold.

use std::path::Path;

use libbpf_rs::{MapCore, MapFlags, MapHandle, MapType, OpenObject};

use super::{types, Pod};
use crate::datapath::DatapathError;

/// A pinned map whose definition differs from this build's, moved aside for migration.
pub(super) struct MovedPin {
    name: String,
    old_path: std::path::PathBuf,
    old: MapHandle,
}

fn same_definition(want: &libbpf_rs::OpenMap<'_>, have: &libbpf_rs::MapInfo) -> bool {
    want.map_type() == have.map_type()
        && want.key_size() == have.info.key_size
        && want.value_size() == have.info.value_size
        && want.max_entries() == have.info.max_entries
        && want.map_flags() == have.info.map_flags
}

/// Maps pinned by another version with another definition (type, key or value size, capacity,
/// flags) would make the load fail. Each is moved aside so the load creates this build's map;
/// [`MovedPin::finish`] then carries its entries over. Programs of the old version keep the old
/// maps (they hold them) until they are replaced, so enforcement goes on meanwhile.
pub(super) fn set_aside_incompatible_pins(
    obj: &OpenObject,
    pin_root: &Path,
) -> Result<Vec<MovedPin>, DatapathError> {
    let mut moved = Vec::new();
    for want in obj.maps() {
        let name = want.name().to_string_lossy().to_string();
        let path = pin_root.join(&name);
        if !path.exists() {
            continue;
        }
        let Ok(old) = MapHandle::from_pinned_path(&path) else {
            continue;
        };
        let Ok(have) = old.info() else {
            continue;
        };
        if same_definition(&want, &have) {
            continue;
        }
        // No dots: bpffs refuses them in names.
        let old_path = pin_root.join(format!("migrating_{name}"));
        let _ = std::fs::remove_file(&old_path);
        std::fs::rename(&path, &old_path).map_err(|e| DatapathError::System {
            operation: format!("move {} aside for migration", path.display()),
            message: e.to_string(),
        })?;
        tracing::warn!(
            map = %name,
            old = ?(have.map_type(), have.info.key_size, have.info.value_size, have.info.max_entries, have.info.map_flags),
            new = ?(want.map_type(), want.key_size(), want.value_size(), want.max_entries(), want.map_flags()),
            "pinned map of another version: migrating"
        );
        moved.push(MovedPin {
            name,
            old_path,
            old,
        });
    }
    Ok(moved)
}

/// Maps whose entries are work in flight, not state: never copied into another layout.
const IN_FLIGHT: [&str; 1] = ["event_batches"];

/// Old maps of [`IN_FLIGHT`], held for the life of the process: programs of the old version
/// still write into theirs until they are replaced, and its flush timers run only while user
/// space holds the map (the kernel cancels them once no descriptor or pin is left).
static KEPT_IN_FLIGHT: std::sync::Mutex<Vec<MapHandle>> = std::sync::Mutex::new(Vec::new());

impl MovedPin {
    /// Copies what fits into this build's map (same key and value sizes), then unpins the old.
    pub(super) fn finish(self, pin_root: &Path) {
        if IN_FLIGHT.contains(&self.name.as_str()) {
            let _ = std::fs::remove_file(&self.old_path);
            tracing::info!(map = %self.name, "pinned map of another version kept until exit, not copied: its events leave by its own timers");
            KEPT_IN_FLIGHT
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(self.old);
            return;
        }
        let new_path = pin_root.join(&self.name);
        let (copied, failed) = match MapHandle::from_pinned_path(&new_path) {
            Ok(new) => copy_entries(&self.old, &new),
            Err(_) => (0, 0),
        };
        let _ = std::fs::remove_file(&self.old_path);
        tracing::info!(map = %self.name, copied, not_copied = failed, "pinned map migrated");
    }
}

/// Copies every entry of `old` into `new` when their key and value sizes agree (per-CPU values
/// included). Returns (copied, not copied).
pub fn copy_entries(old: &MapHandle, new: &MapHandle) -> (usize, usize) {
    let (Ok(a), Ok(b)) = (old.info(), new.info()) else {
        return (0, 0);
    };
    let percpu = |t: MapType| {
        matches!(
            t,
            MapType::PercpuArray | MapType::PercpuHash | MapType::LruPercpuHash
        )
    };
    // Plain data (maps of maps are handled above; a ring buffer holds no entries).
    let plain = |t: MapType| {
        matches!(
            t,
            MapType::Hash
                | MapType::LruHash
                | MapType::PercpuHash
                | MapType::LruPercpuHash
                | MapType::Array
                | MapType::PercpuArray
                | MapType::LpmTrie
        )
    };
    let (ta, tb) = (a.map_type(), b.map_type());
    let map_of_maps = |t: MapType| matches!(t, MapType::HashOfMaps | MapType::ArrayOfMaps);
    if map_of_maps(ta) && map_of_maps(tb) && a.info.key_size == b.info.key_size {
        return copy_inner_maps(old, new);
    }
    if !plain(ta) || !plain(tb) {
        return (0, 0);
    }
    let keys: Vec<Vec<u8>> = old.keys().collect();
    // Values that grew (fields appended, which read as 0: "unknown") carry over zero-extended;
    // per-CPU values only as they are.
    let size = b.info.value_size as usize;
    let fits = if percpu(ta) {
        a.info.value_size == b.info.value_size
    } else {
        a.info.value_size <= b.info.value_size
    };
    if a.info.key_size != b.info.key_size || percpu(ta) != percpu(tb) || !fits {
        return (0, keys.len());
    }
    let (mut copied, mut failed) = (0, 0);
    for k in keys {
        let ok = if percpu(ta) {
            match old.lookup_percpu(&k, MapFlags::ANY) {
                Ok(Some(v)) => new.update_percpu(&k, &v, MapFlags::ANY).is_ok(),
                _ => false,
            }
        } else {
            match old.lookup(&k, MapFlags::ANY) {
                Ok(Some(mut v)) => {
                    v.resize(size, 0);
                    new.update(&k, &v, MapFlags::ANY).is_ok()
                }
                _ => false,
            }
        };
        if ok {
            copied += 1;
        } else {
            failed += 1;
        }
    }
    (copied, failed)
}

/// Copies a map of maps: user space reads an inner map's id but writes a descriptor, so each
/// inner map is opened by its id and registered in `new` under the same key. An array of
/// maps lists every index as a key: empty slots read as absent and are skipped.
fn copy_inner_maps(old: &MapHandle, new: &MapHandle) -> (usize, usize) {
    use std::os::fd::{AsFd, AsRawFd};
    let (mut copied, mut failed) = (0, 0);
    for k in old.keys() {
        let Ok(Some(v)) = old.lookup(&k, MapFlags::ANY) else {
            continue;
        };
        let Some(id) = v
            .get(..4)
            .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        else {
            failed += 1;
            continue;
        };
        let ok = MapHandle::from_map_id(id).is_ok_and(|inner| {
            let fd = inner.as_fd().as_raw_fd() as u32;
            new.update(&k, &fd.to_ne_bytes(), MapFlags::ANY).is_ok()
        });
        if ok {
            copied += 1;
        } else {
            failed += 1;
        }
    }
    (copied, failed)
}

/// Maps pinned by an older version kept host addresses in the trie: each is copied to the
/// host table before it leaves the trie, so no lookup misses it on the way.
pub(super) fn migrate_host_prefixes(ipcache: &MapHandle, ipcache_hosts: &MapHandle) {
    let mut moved = 0usize;
    for kb in ipcache.keys() {
        let Some(k) = types::ipcache_key::from_bytes(&kb) else {
            continue;
        };
        let full = if k.family == 4 { 64 } else { 160 };
        if k.prefixlen != full {
            continue;
        }
        let Some(v) = ipcache.lookup(&kb, MapFlags::ANY).ok().flatten() else {
            continue;
        };
        let hk = types::ipcache_host_key {
            family: k.family,
            addr: k.addr,
        };
        if ipcache_hosts
            .update(hk.as_bytes(), &v, MapFlags::ANY)
            .is_ok()
        {
            let _ = ipcache.delete(&kb);
            moved += 1;
        }
    }
    if moved > 0 {
        tracing::info!(moved, "ipcache: host addresses moved from the prefix trie to the host table (maps of an older version)");
    }
}
