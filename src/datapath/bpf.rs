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

/// Program return codes (`linux/pkt_cls.h`).
pub const TC_ACT_OK: i32 = 0;
pub const TC_ACT_SHOT: i32 = 2;

/// Endpoint flags (`CILIATE_EP_*` in `bpf/ciliate.h`).
pub const EP_INGRESS_DEFAULT_DENY: u32 = 0x1;
pub const EP_EGRESS_DEFAULT_DENY: u32 = 0x2;
pub const EP_DROP_ALL: u32 = 0x4;

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
unsafe impl Pod for types::ipcache_value {}
unsafe impl Pod for types::endpoint_info {}
unsafe impl Pod for types::ct_key {}
unsafe impl Pod for types::ct_value {}
unsafe impl Pod for types::verdict_event {}
unsafe impl Pod for types::datapath_config {}

#[cfg(test)]
mod tests;
