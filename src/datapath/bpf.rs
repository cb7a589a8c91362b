//! The eBPF datapath: the skeleton built from `bpf/ciliate.bpf.c` by `build.rs`, and the byte
//! views of the structures it shares with user space (defined once, in `bpf/ciliate.h`).

#[allow(
    clippy::all,
    clippy::pedantic,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    unused_imports
)]
pub mod skel {
    include!(concat!(env!("OUT_DIR"), "/ciliate.skel.rs"));
}

pub use skel::types;

use std::ffi::CString;
use std::mem::MaybeUninit;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::OpenObject;

use super::DatapathError;

fn sys(operation: impl Into<String>) -> impl FnOnce(libbpf_rs::Error) -> DatapathError {
    let operation = operation.into();
    move |e| DatapathError::System {
        operation,
        message: e.to_string(),
    }
}

/// `statfs` magic of the BPF filesystem.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The conventional bpffs mount point.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf";

fn is_bpffs(p: &Path) -> bool {
    #[allow(clippy::unnecessary_cast)]
    nix::sys::statfs::statfs(p).is_ok_and(|st| st.filesystem_type().0 as i64 == BPF_FS_MAGIC)
}

/// Makes sure `root` is on a BPF filesystem (pins only outlive the agent there). As Cilium does,
/// a missing bpffs is mounted: on `root` itself when it is an existing directory, or on
/// `/sys/fs/bpf` when `root` lies below it. Never on any other directory.
pub fn ensure_bpffs(root: &Path) -> Result<(), DatapathError> {
    let err = |operation: String| {
        move |e: nix::Error| DatapathError::System {
            operation,
            message: e.to_string(),
        }
    };
    let default = Path::new(DEFAULT_BPFFS);
    let mount_point = if root.starts_with(default) && !is_bpffs(default) {
        Some(default)
    } else if root.is_dir() && !is_bpffs(root) {
        Some(root)
    } else {
        None
    };
    if let Some(mp) = mount_point {
        nix::mount::mount(
            Some("bpf"),
            mp,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .map_err(err(format!("mount bpffs on {}", mp.display())))?;
    }
    std::fs::create_dir_all(root).map_err(|e| DatapathError::System {
        operation: format!("create {}", root.display()),
        message: e.to_string(),
    })?;
    if is_bpffs(root) {
        Ok(())
    } else {
        Err(DatapathError::System {
            operation: format!("--bpf-root {}", root.display()),
            message: "not on a BPF filesystem; mount one (mount -t bpf bpf DIR) or use a directory under /sys/fs/bpf".into(),
        })
    }
}

/// Opens and loads one instance of the program with `ENDPOINT_ID = endpoint_id`, its maps pinned
/// by name under `pin_root` (created or reused: every instance shares them).
pub fn load_program<'obj>(
    storage: &'obj mut MaybeUninit<OpenObject>,
    pin_root: &Path,
    endpoint_id: u32,
) -> Result<skel::CiliateSkel<'obj>, DatapathError> {
    std::fs::create_dir_all(pin_root).map_err(|e| DatapathError::System {
        operation: format!("create {}", pin_root.display()),
        message: e.to_string(),
    })?;
    let root =
        CString::new(pin_root.as_os_str().as_bytes()).map_err(|e| DatapathError::System {
            operation: format!("pin root {}", pin_root.display()),
            message: e.to_string(),
        })?;
    let opts = libbpf_rs::libbpf_sys::bpf_object_open_opts {
        sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_object_open_opts>() as _,
        pin_root_path: root.as_ptr(),
        ..Default::default()
    };
    let mut open = skel::CiliateSkelBuilder::default()
        .open_opts(opts, storage)
        .map_err(sys("open the BPF object"))?;
    if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
        ro.ENDPOINT_ID = endpoint_id;
    }
    open.load().map_err(sys(format!(
        "load the BPF program for endpoint {endpoint_id}"
    )))
}

/// Program return codes (`linux/pkt_cls.h`).
pub const TC_ACT_OK: i32 = 0;
pub const TC_ACT_SHOT: i32 = 2;

/// Endpoint flags (`CILIATE_EP_*` in `bpf/ciliate.h`).
pub const EP_INGRESS_DEFAULT_DENY: u32 = 0x1;
pub const EP_EGRESS_DEFAULT_DENY: u32 = 0x2;
pub const EP_DROP_ALL: u32 = 0x4;
pub const EP_SPLIT_LENS: u32 = 0x8;
/// Probe-mask bit for entries of every protocol (`CILIATE_LENS_ALL_PROTOCOLS`).
pub const LENS_ALL_PROTOCOLS: u32 = 1 << 17;

/// Verdict reasons (`enum ciliate_reason` in `bpf/ciliate.h`), by counter index.
pub const REASONS: [&str; 10] = [
    "allow-policy",
    "allow-not-isolated",
    "allow-established",
    "allow-reply",
    "drop-policy-deny",
    "drop-default-deny",
    "drop-not-realized",
    "drop-malformed",
    "pass-unmanaged",
    "pass-not-ip",
];

/// A shared structure that is plain old data: `repr(C)`, every byte part of a field (explicit
/// padding only), so viewing it as bytes is sound. The layout test checks the "no implicit
/// padding" part for each type listed here.
///
/// # Safety
/// Implement only for such types.
pub unsafe trait Pod: Copy + Default {
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: Pod types have no implicit padding, so every byte is initialised.
        unsafe {
            std::slice::from_raw_parts(
                (self as *const Self).cast::<u8>(),
                std::mem::size_of::<Self>(),
            )
        }
    }

    /// Reads a value from bytes of exactly its size.
    fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != std::mem::size_of::<Self>() {
            return None;
        }
        let mut v = Self::default();
        // SAFETY: sizes match and every bit pattern is valid for these integer-only structs.
        unsafe {
            std::ptr::copy_nonoverlapping(b.as_ptr(), (&mut v as *mut Self).cast::<u8>(), b.len())
        };
        Some(v)
    }
}

// SAFETY: checked by `abi_layout_is_pinned` below.
unsafe impl Pod for types::policy_key {}
unsafe impl Pod for types::policy_value {}
unsafe impl Pod for types::ipcache_key {}
unsafe impl Pod for types::ipcache_host_key {}
unsafe impl Pod for types::ipcache_value {}
unsafe impl Pod for types::endpoint_info {}
unsafe impl Pod for types::ct_key {}
unsafe impl Pod for types::ct_value {}
unsafe impl Pod for types::verdict_event {}
unsafe impl Pod for types::datapath_config {}

pub mod conntrack;
pub mod datapath;

#[cfg(test)]
mod tests;
