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
    load_program_for(storage, pin_root, endpoint_id, false)
}

/// [`load_program`] for TCX attachment when `tcx`: the programs' expected attach types are
/// the TCX hooks (libbpf's TCX attach uses them; legacy tc ignores them).
pub fn load_program_for<'obj>(
    storage: &'obj mut MaybeUninit<OpenObject>,
    pin_root: &Path,
    endpoint_id: u32,
    tcx: bool,
) -> Result<skel::CiliateSkel<'obj>, DatapathError> {
    load_instance(storage, pin_root, Instance::Endpoint(endpoint_id), tcx)
}

/// Loads the node device's program (`from_netdev`, BPF host routing's receive side) on the
/// pinned maps; only that program of the object is loaded.
pub fn load_netdev_program<'obj>(
    storage: &'obj mut MaybeUninit<OpenObject>,
    pin_root: &Path,
    tcx: bool,
) -> Result<skel::CiliateSkel<'obj>, DatapathError> {
    load_instance(storage, pin_root, Instance::Netdev, tcx)
}

/// Which programs of the object an instance carries: each one verified costs load time.
#[derive(Clone, Copy)]
enum Instance {
    /// `from_container` and `to_container` with `ENDPOINT_ID` set.
    Endpoint(u32),
    /// `from_netdev` (`ENDPOINT_ID` 0).
    Netdev,
}

fn load_instance<'obj>(
    storage: &'obj mut MaybeUninit<OpenObject>,
    pin_root: &Path,
    instance: Instance,
    tcx: bool,
) -> Result<skel::CiliateSkel<'obj>, DatapathError> {
    use libbpf_rs::libbpf_sys as lsys;
    use libbpf_rs::AsRawLibbpf;
    std::fs::create_dir_all(pin_root).map_err(|e| DatapathError::System {
        operation: format!("create {}", pin_root.display()),
        message: e.to_string(),
    })?;
    let root =
        CString::new(pin_root.as_os_str().as_bytes()).map_err(|e| DatapathError::System {
            operation: format!("pin root {}", pin_root.display()),
            message: e.to_string(),
        })?;
    let opts = lsys::bpf_object_open_opts {
        sz: std::mem::size_of::<lsys::bpf_object_open_opts>() as _,
        pin_root_path: root.as_ptr(),
        ..Default::default()
    };
    let mut open = skel::CiliateSkelBuilder::default()
        .open_opts(opts, storage)
        .map_err(sys("open the BPF object"))?;
    let (endpoint_id, netdev) = match instance {
        Instance::Endpoint(id) => (id, false),
        Instance::Netdev => (0, true),
    };
    if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
        ro.ENDPOINT_ID = endpoint_id;
    }
    open.progs.from_container.set_autoload(!netdev);
    open.progs.to_container.set_autoload(!netdev);
    open.progs.from_netdev.set_autoload(netdev);
    if tcx {
        unsafe {
            lsys::bpf_program__set_expected_attach_type(
                open.progs.from_container.as_libbpf_object().as_ptr(),
                lsys::BPF_TCX_INGRESS,
            );
            lsys::bpf_program__set_expected_attach_type(
                open.progs.to_container.as_libbpf_object().as_ptr(),
                lsys::BPF_TCX_EGRESS,
            );
            lsys::bpf_program__set_expected_attach_type(
                open.progs.from_netdev.as_libbpf_object().as_ptr(),
                lsys::BPF_TCX_INGRESS,
            );
        }
    }
    let moved = migrate::set_aside_incompatible_pins(open.open_object(), pin_root)?;
    let what = match instance {
        Instance::Endpoint(id) => format!("load the BPF program for endpoint {id}"),
        Instance::Netdev => "load the node device's BPF program".to_string(),
    };
    let skel = open.load().map_err(sys(what))?;
    for m in moved {
        m.finish(pin_root);
    }
    Ok(skel)
}

/// Program return codes (`linux/pkt_cls.h`).
pub const TC_ACT_OK: i32 = 0;
pub const TC_ACT_SHOT: i32 = 2;

/// Endpoint flags (`CILIATE_EP_*` in `bpf/ciliate.h`).
pub const EP_INGRESS_DEFAULT_DENY: u32 = 0x1;
pub const EP_EGRESS_DEFAULT_DENY: u32 = 0x2;
pub const EP_DROP_ALL: u32 = 0x4;
pub const EP_SPLIT_LENS: u32 = 0x8;
pub const EP_AUDIT: u32 = 0x10;
/// Probe-mask bit for entries of every protocol (`CILIATE_LENS_ALL_PROTOCOLS`).
pub const LENS_ALL_PROTOCOLS: u32 = 1 << 17;

/// Verdict reasons (`enum ciliate_reason` in `bpf/ciliate.h`), by counter index.
pub const REASONS: [&str; 14] = [
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
    "conntrack-full",
    "audit-policy-deny",
    "audit-default-deny",
    "events-lost",
];

/// The verdict counter of events the ring buffer had no room for.
pub const EVENTS_LOST: u32 = 13;

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
unsafe impl Pod for types::ct4_key {}
unsafe impl Pod for types::ct6_key {}
unsafe impl Pod for types::ct_value {}
unsafe impl Pod for types::verdict_event {}
unsafe impl Pod for types::datapath_config {}
unsafe impl Pod for types::local_endpoint {}

pub mod conntrack;
pub mod datapath;
mod encoding;
pub mod host_delivery;
pub mod host_routes;
mod map_io;
mod migrate;
pub mod services;
pub mod tcx;

#[cfg(test)]
mod tests;
