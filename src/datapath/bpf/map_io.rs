//! Bulk map I/O: batched updates and deletes, and typed reads of a whole map.

use std::os::fd::{AsFd, AsRawFd};

use libbpf_rs::{MapCore, MapFlags, MapHandle};

use super::Pod;

/// Updates many entries in one `bpf_map_update_batch` call. `keys` and `values` are the
/// concatenated entries.
pub(super) fn update_batch(
    map: &MapHandle,
    keys: &[u8],
    values: &[u8],
    count: usize,
) -> Result<(), std::io::Error> {
    if count == 0 {
        return Ok(());
    }
    let opts = libbpf_rs::libbpf_sys::bpf_map_batch_opts {
        sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_map_batch_opts>() as _,
        ..Default::default()
    };
    let mut n = count as u32;
    // SAFETY: the buffers hold `count` keys and values of the map's sizes, and outlive the call.
    let r = unsafe {
        libbpf_rs::libbpf_sys::bpf_map_update_batch(
            map.as_fd().as_raw_fd(),
            keys.as_ptr().cast(),
            values.as_ptr().cast(),
            &mut n,
            &opts,
        )
    };
    if r < 0 {
        return Err(std::io::Error::from_raw_os_error(-r));
    }
    Ok(())
}

/// Deletes many entries in one `bpf_map_delete_batch` call; entries already gone are skipped
/// one by one (a batch stops at the first missing key).
pub(super) fn delete_batch(map: &MapHandle, keys: &[u8], key_size: usize) {
    if keys.is_empty() {
        return;
    }
    let opts = libbpf_rs::libbpf_sys::bpf_map_batch_opts {
        sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_map_batch_opts>() as _,
        ..Default::default()
    };
    let mut n = (keys.len() / key_size) as u32;
    // SAFETY: `keys` holds `n` keys of the map's key size and outlives the call.
    let r = unsafe {
        libbpf_rs::libbpf_sys::bpf_map_delete_batch(
            map.as_fd().as_raw_fd(),
            keys.as_ptr().cast(),
            &mut n,
            &opts,
        )
    };
    if r < 0 {
        // `n` entries were deleted; finish one by one.
        for k in keys[n as usize * key_size..].chunks(key_size) {
            let _ = map.delete(k);
        }
    }
}

/// Every entry of a map as its shared key and value types (entries that vanish while being
/// read, or do not decode, are skipped).
pub(super) fn typed_entries<K: Pod, V: Pod>(map: &MapHandle) -> Vec<(K, V)> {
    map.keys()
        .filter_map(|kb| {
            let k = K::from_bytes(&kb)?;
            let v = map.lookup(&kb, MapFlags::ANY).ok().flatten()?;
            Some((k, V::from_bytes(&v)?))
        })
        .collect()
}

/// Makes the keys of the pinned map at `path` exactly `want`, each new one with `value` (the
/// missing ones added first, then the others removed); `name` says what a key is in errors.
/// `Ok(false)`: there is no such map (yet).
pub(super) fn sync_keys(
    path: &std::path::Path,
    want: &std::collections::BTreeSet<Vec<u8>>,
    value: &[u8],
    name: impl Fn(&[u8]) -> String,
) -> Result<bool, crate::datapath::DatapathError> {
    if !path.exists() {
        return Ok(false);
    }
    let err = |operation: String| {
        move |e: libbpf_rs::Error| crate::datapath::DatapathError::System {
            operation,
            message: e.to_string(),
        }
    };
    let map = MapHandle::from_pinned_path(path).map_err(err(format!("open {}", path.display())))?;
    let have: std::collections::BTreeSet<Vec<u8>> = map.keys().collect();
    for add in want.difference(&have) {
        map.update(add, value, MapFlags::ANY)
            .map_err(err(format!("add {}", name(add))))?;
    }
    for gone in have.difference(want) {
        map.delete(gone)
            .map_err(err(format!("remove {}", name(gone))))?;
    }
    Ok(true)
}
