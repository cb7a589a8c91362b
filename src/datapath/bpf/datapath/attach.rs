//! Putting an endpoint's programs on its interface and taking them off: TCX links pinned per
//! endpoint (an instance of this build already running is kept), legacy tc (clsact) where the
//! kernel has no TCX, and the record that lets the node device's program deliver to it.

use std::mem::MaybeUninit;
use std::os::fd::AsFd;

use libbpf_rs::{TcHookBuilder, TC_EGRESS, TC_INGRESS};

use super::super::tcx::{self, Hook, TcxError};
use super::super::{load_program, load_program_for};
use super::{sys, BpfDatapath};
use crate::datapath::{DatapathError, EndpointAttachment, EndpointId};

impl BpfDatapath {
    pub(super) fn attach_programs(
        &mut self,
        id: EndpointId,
        ifname: &str,
    ) -> Result<i32, DatapathError> {
        let ifindex = nix::net::if_::if_nametoindex(ifname)
            .map_err(sys(format!("interface {ifname} of endpoint {id}")))?
            as i32;
        if self.use_tcx && self.reuse_running && self.running_programs_are_current(id, ifindex) {
            // A restarted agent of the same build: the pinned links already run this
            // endpoint's instance on these maps; loading and verifying another (tens of
            // milliseconds per endpoint) would change nothing.
            self.kept_on_reattach += 1;
            return Ok(ifindex);
        }
        if self.use_tcx {
            match self.attach_tcx(id, ifindex) {
                Ok(()) => {
                    // TCX runs first and its verdicts are final: a legacy filter an older
                    // version left is only cleaned up, after the link is in place.
                    self.detach_legacy(ifindex);
                    return Ok(ifindex);
                }
                Err(TcxError::Unsupported(why)) => {
                    tracing::info!(%why, "no TCX: attaching with legacy tc (clsact)");
                    self.use_tcx = false;
                    for hook in [Hook::Ingress, Hook::Egress] {
                        tcx::detach(&self.pins.join(hook.pin_name(id)));
                    }
                }
                Err(TcxError::Failed { operation, message }) => {
                    return Err(DatapathError::System { operation, message })
                }
            }
        }
        let mut storage = MaybeUninit::uninit();
        let skel = load_program(&mut storage, &self.pins, id as u32)?;
        // The tc filters hold the programs; nothing here needs to live on.
        for (prog, point, what) in [
            (skel.progs.from_container.as_fd(), TC_INGRESS, "ingress"),
            (skel.progs.to_container.as_fd(), TC_EGRESS, "egress"),
        ] {
            let mut b = TcHookBuilder::new(prog);
            b.ifindex(ifindex).replace(true).handle(1).priority(1);
            let mut hook = b.hook(point);
            let _ = hook.create(); // clsact may exist already
            hook.attach()
                .map_err(sys(format!("attach to tc {what} of {ifname}")))?;
        }
        Ok(ifindex)
    }

    /// Makes the endpoint's IPv4 addresses deliverable by the node device's program (BPF host
    /// routing), when its pod MAC is known; without one it is only reached through the stack.
    pub(super) fn publish_local(
        &self,
        att: &EndpointAttachment,
        ifname: &str,
        ifindex: u32,
    ) -> Result<(), DatapathError> {
        use super::super::host_delivery as hd;
        let Some(mac) = att.mac.as_deref() else {
            return Ok(());
        };
        let mac = hd::parse_mac(mac).ok_or_else(|| DatapathError::System {
            operation: format!("endpoint {}", att.id),
            message: format!("bad pod MAC address {mac:?}"),
        })?;
        let node_mac = hd::interface_mac(ifname)?;
        hd::publish(
            &self.local_endpoints,
            &self.local_endpoints6,
            &att.ips,
            &hd::record(att.id, ifindex, mac, node_mac),
        )
    }

    /// Whether both of the endpoint's pinned links sit on `ifindex` and run an instance of
    /// this build, for this endpoint, that uses the maps pinned now.
    pub(super) fn running_programs_are_current(&self, id: EndpointId, ifindex: i32) -> bool {
        let Some((tag_in, tag_eg)) = self.build_tags else {
            return false;
        };
        [(Hook::Ingress, tag_in), (Hook::Egress, tag_eg)]
            .into_iter()
            .all(|(hook, tag)| {
                tcx::current_program(&self.pins.join(hook.pin_name(id)), ifindex, hook).is_some_and(
                    |p| {
                        p.tag == tag
                            && p.endpoint_id == Some(id as u32)
                            && !self.pinned_map_ids.is_empty()
                            && self.pinned_map_ids.iter().all(|m| p.map_ids.contains(m))
                    },
                )
            })
    }

    /// Loads an instance for TCX and creates or updates the endpoint's pinned links.
    pub(super) fn attach_tcx(&self, id: EndpointId, ifindex: i32) -> Result<(), TcxError> {
        let mut storage = MaybeUninit::uninit();
        let skel = load_program_for(&mut storage, &self.pins, id as u32, true)
            .map_err(|e| TcxError::Unsupported(e.to_string()))?;
        for (prog, hook) in [
            (&skel.progs.from_container, Hook::Ingress),
            (&skel.progs.to_container, Hook::Egress),
        ] {
            tcx::attach(prog, ifindex, hook, &self.pins.join(hook.pin_name(id)))?;
        }
        Ok(())
    }

    /// Removes an endpoint's programs from its interface, however they were attached.
    pub(super) fn detach_programs(&self, id: EndpointId, ifindex: i32) {
        for hook in [Hook::Ingress, Hook::Egress] {
            tcx::detach(&self.pins.join(hook.pin_name(id)));
        }
        self.detach_legacy(ifindex);
    }

    pub(super) fn detach_legacy(&self, ifindex: i32) {
        // tc detach goes by interface, handle and priority; the hook only needs some
        // descriptor to be built with. The interface may already be gone with its pod.
        for point in [TC_INGRESS, TC_EGRESS] {
            let mut hook = libbpf_rs::TcHook::new(self.ipcache.as_fd());
            hook.ifindex(ifindex)
                .attach_point(point)
                .handle(1)
                .priority(1);
            let _ = hook.detach();
        }
    }
}
