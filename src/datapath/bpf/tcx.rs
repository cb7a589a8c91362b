//! TCX attachment (Linux 6.6+): each endpoint's programs hang on the host-side veth through
//! BPF links pinned under the pin root, so they outlive the agent like the maps do. A restarted
//! agent opens the pinned link and swaps in its new program instance with `bpf_link_update`,
//! an atomic replacement: no packet meets an interface without a program. Kernels without TCX
//! fall back to legacy tc (clsact) in the caller.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use libbpf_rs::libbpf_sys as sys;
use libbpf_rs::AsRawLibbpf;

/// Which side of the host veth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// Traffic the pod sends (tc ingress of the host veth).
    Ingress,
    /// Traffic the pod receives (tc egress of the host veth).
    Egress,
}

impl Hook {
    fn attach_type(self) -> u32 {
        match self {
            Hook::Ingress => sys::BPF_TCX_INGRESS,
            Hook::Egress => sys::BPF_TCX_EGRESS,
        }
    }

    /// The link's pin name for an endpoint.
    pub fn pin_name(self, endpoint: u16) -> String {
        match self {
            Hook::Ingress => format!("link_{endpoint}_ingress"),
            Hook::Egress => format!("link_{endpoint}_egress"),
        }
    }
}

/// TCX failures.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TcxError {
    /// The kernel has no TCX: use legacy tc.
    #[error("TCX is not supported by this kernel ({0})")]
    Unsupported(String),
    #[error("{operation}: {message}")]
    Failed { operation: String, message: String },
}

fn errno_text(code: i32) -> String {
    std::io::Error::from_raw_os_error(code.abs()).to_string()
}

/// What a pinned link is attached to: (ifindex, attach type, program id). `None` when the pin
/// is missing or is not a TCX link.
pub fn pinned_link_info(pin: &Path) -> Option<(u32, u32, u32)> {
    let path = CString::new(pin.as_os_str().as_bytes()).ok()?;
    let fd = unsafe { sys::bpf_obj_get(path.as_ptr()) };
    if fd < 0 {
        return None;
    }
    let info = link_info(fd);
    unsafe { nix::libc::close(fd) };
    info
}

fn link_info(fd: i32) -> Option<(u32, u32, u32)> {
    let mut info: sys::bpf_link_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<sys::bpf_link_info>() as u32;
    if unsafe { sys::bpf_link_get_info_by_fd(fd, &mut info, &mut len) } != 0
        || info.type_ != sys::BPF_LINK_TYPE_TCX
    {
        return None;
    }
    let tcx = unsafe { info.__bindgen_anon_1.tcx };
    Some((tcx.ifindex, tcx.attach_type, info.prog_id))
}

/// Makes `prog` the endpoint's program at `hook` of `ifindex`: the pinned link is updated in
/// place when it exists and still sits on that interface, else a new link is created and
/// pinned. Returns true when an existing link was updated.
pub fn attach(
    prog: &libbpf_rs::Program<'_>,
    ifindex: i32,
    hook: Hook,
    pin: &Path,
) -> Result<bool, TcxError> {
    let path = CString::new(pin.as_os_str().as_bytes()).map_err(|e| TcxError::Failed {
        operation: format!("pin path {}", pin.display()),
        message: e.to_string(),
    })?;
    let prog_fd = prog.as_fd().as_raw_fd();
    let existing = unsafe { sys::bpf_obj_get(path.as_ptr()) };
    if existing >= 0 {
        let same_place = link_info(existing)
            .is_some_and(|(i, t, _)| i == ifindex as u32 && t == hook.attach_type());
        let updated =
            same_place && unsafe { sys::bpf_link_update(existing, prog_fd, std::ptr::null()) } == 0;
        unsafe { nix::libc::close(existing) };
        if updated {
            return Ok(true);
        }
        // A link of an interface that is gone (or another one): replace it.
        let _ = std::fs::remove_file(pin);
    }
    let opts = sys::bpf_tcx_opts {
        sz: std::mem::size_of::<sys::bpf_tcx_opts>() as _,
        ..Default::default()
    };
    let link =
        unsafe { sys::bpf_program__attach_tcx(prog.as_libbpf_object().as_ptr(), ifindex, &opts) };
    let err = unsafe { sys::libbpf_get_error(link as *const _) } as i32;
    if link.is_null() || err != 0 {
        let code = if err != 0 { err } else { -nix::libc::EINVAL };
        let text = errno_text(code);
        return Err(match code.abs() {
                nix::libc::EINVAL | nix::libc::EOPNOTSUPP | 524 /* ENOTSUPP */ => {
                    TcxError::Unsupported(text)
                }
                _ => TcxError::Failed {
                    operation: format!("TCX attach to ifindex {ifindex}"),
                    message: text,
                },
            });
    }
    let pinned = unsafe { sys::bpf_link__pin(link, path.as_ptr()) };
    // The pin holds the link from here on; our handle lets go without detaching. A
    // disconnected link's destroy does not close its descriptor: we do (else every attach left
    // one open for good, two per pod). If the pin failed, closing it detaches the link.
    let fd = unsafe { sys::bpf_link__fd(link) };
    unsafe {
        sys::bpf_link__disconnect(link);
        sys::bpf_link__destroy(link);
    }
    if fd >= 0 {
        unsafe { nix::libc::close(fd) };
    }
    if pinned != 0 {
        return Err(TcxError::Failed {
            operation: format!("pin {}", pin.display()),
            message: errno_text(pinned),
        });
    }
    Ok(false)
}

/// Removes an endpoint's link at `hook`. The link is detached explicitly first: the kernel
/// frees an unpinned link later, from a work queue, and the program would keep deciding
/// packets until then.
pub fn detach(pin: &Path) {
    if let Ok(path) = CString::new(pin.as_os_str().as_bytes()) {
        let fd = unsafe { sys::bpf_obj_get(path.as_ptr()) };
        if fd >= 0 {
            unsafe {
                sys::bpf_link_detach(fd);
                nix::libc::close(fd);
            }
        }
    }
    let _ = std::fs::remove_file(pin);
}

/// What the kernel says about a loaded program: its tag (a hash of its instructions with map
/// references blanked, so every instance of one build shares it), the ids of the maps it
/// uses, and the `ENDPOINT_ID` in its read-only data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedProgram {
    pub tag: [u8; 8],
    pub map_ids: Vec<u32>,
    pub endpoint_id: Option<u32>,
}

fn prog_info(fd: i32, map_ids: Option<&mut Vec<u32>>) -> Option<sys::bpf_prog_info> {
    let mut info: sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    if let Some(ids) = map_ids {
        info.nr_map_ids = ids.len() as u32;
        info.map_ids = ids.as_mut_ptr() as u64;
    }
    let mut len = std::mem::size_of::<sys::bpf_prog_info>() as u32;
    (unsafe { sys::bpf_prog_get_info_by_fd(fd, &mut info, &mut len) } == 0).then_some(info)
}

/// The tag of a loaded program.
pub fn tag_of(prog: &libbpf_rs::Program<'_>) -> Option<[u8; 8]> {
    prog_info(prog.as_fd().as_raw_fd(), None).map(|i| i.tag)
}

/// Reads what [`LoadedProgram`] describes for the program with kernel id `prog_id`.
pub fn loaded_program(prog_id: u32) -> Option<LoadedProgram> {
    let fd = unsafe { sys::bpf_prog_get_fd_by_id(prog_id) };
    if fd < 0 {
        return None;
    }
    let out = (|| {
        let n = prog_info(fd, None)?.nr_map_ids as usize;
        let mut ids = vec![0u32; n];
        let info = prog_info(fd, Some(&mut ids))?;
        ids.truncate(info.nr_map_ids as usize);
        let mut endpoint_id = None;
        for id in &ids {
            let mfd = unsafe { sys::bpf_map_get_fd_by_id(*id) };
            if mfd < 0 {
                continue;
            }
            let mut m: sys::bpf_map_info = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<sys::bpf_map_info>() as u32;
            let ok = unsafe { sys::bpf_map_get_info_by_fd(mfd, &mut m, &mut len) } == 0;
            let name: Vec<u8> = m
                .name
                .iter()
                .take_while(|c| **c != 0)
                .map(|c| *c as u8)
                .collect();
            if ok && name.ends_with(b".rodata") && m.value_size >= 4 {
                let key = 0u32;
                let mut value = vec![0u8; m.value_size as usize];
                let found = unsafe {
                    sys::bpf_map_lookup_elem(
                        mfd,
                        &key as *const u32 as *const _,
                        value.as_mut_ptr() as *mut _,
                    )
                } == 0;
                if found {
                    endpoint_id =
                        Some(u32::from_ne_bytes([value[0], value[1], value[2], value[3]]));
                }
            }
            unsafe { nix::libc::close(mfd) };
        }
        Some(LoadedProgram {
            tag: info.tag,
            map_ids: ids,
            endpoint_id,
        })
    })();
    unsafe { nix::libc::close(fd) };
    out
}

/// The program the pinned link at `pin` runs, if the link sits at `hook` of `ifindex`.
pub fn current_program(pin: &Path, ifindex: i32, hook: Hook) -> Option<LoadedProgram> {
    let (i, t, prog_id) = pinned_link_info(pin)?;
    if i != ifindex as u32 || t != hook.attach_type() {
        return None;
    }
    loaded_program(prog_id)
}

/// Whether any program loaded in the kernel uses the map with kernel id `map_id`.
pub fn map_in_use(map_id: u32) -> bool {
    let mut id = 0u32;
    loop {
        let mut next = 0u32;
        if unsafe { sys::bpf_prog_get_next_id(id, &mut next) } != 0 {
            return false;
        }
        id = next;
        let fd = unsafe { sys::bpf_prog_get_fd_by_id(id) };
        if fd < 0 {
            continue; // unloaded meanwhile
        }
        let uses = (|| {
            let n = prog_info(fd, None)?.nr_map_ids as usize;
            let mut ids = vec![0u32; n];
            let info = prog_info(fd, Some(&mut ids))?;
            ids.truncate(info.nr_map_ids as usize);
            Some(ids.contains(&map_id))
        })();
        unsafe { nix::libc::close(fd) };
        if uses == Some(true) {
            return true;
        }
    }
}
