//! Datapath bench helpers shared by `benches/datapath.rs` and `benches/datapath_ab.rs`: test
//! packets, peer addresses and policy keys.
#![allow(dead_code)]

use libbpf_rs::ProgramInput;

use ciliate::datapath::bpf::datapath::BpfDatapath;
use ciliate::datapath::{Datapath, EndpointAttachment, EndpointFlags};
use ciliate::policy::mapstate::{MapDelta, MapKey};
use ciliate::policy::rule::{Direction, PROTO_TCP};

pub const SYN: u8 = 0x02;
pub const ACK: u8 = 0x10;

/// The ingress key of `identity` on TCP `port`.
pub fn tcp_in(identity: u32, port: u16) -> MapKey {
    ciliate::policy::mapstate::ingress_key(identity, PROTO_TCP, port, port)
}

/// Ingress entries allowing identities 1000.. 17383 on TCP/80.
pub fn allow_16k() -> Vec<(MapKey, bool)> {
    (0..16_384u32)
        .map(|i| (tcp_in(1000 + i, 80), false))
        .collect()
}

pub fn packet(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16, tcp_flags: u8) -> Vec<u8> {
    let mut p = vec![0u8; 14 + 20 + 20];
    p[12] = 0x08;
    p[14] = 0x45;
    p[16..18].copy_from_slice(&40u16.to_be_bytes());
    p[22] = 64;
    p[23] = 6;
    p[26..30].copy_from_slice(&src);
    p[30..34].copy_from_slice(&dst);
    p[34..36].copy_from_slice(&sport.to_be_bytes());
    p[36..38].copy_from_slice(&dport.to_be_bytes());
    p[46] = 0x50;
    p[47] = tcp_flags;
    p
}

/// `packet` over IPv6 (no extension header).
pub fn packet6(src: [u8; 16], dst: [u8; 16], sport: u16, dport: u16, tcp_flags: u8) -> Vec<u8> {
    let mut p = vec![0u8; 14 + 40 + 20];
    p[12] = 0x86;
    p[13] = 0xdd;
    p[14] = 0x60;
    p[18..20].copy_from_slice(&20u16.to_be_bytes());
    p[20] = 6;
    p[21] = 64;
    p[22..38].copy_from_slice(&src);
    p[38..54].copy_from_slice(&dst);
    p[54..56].copy_from_slice(&sport.to_be_bytes());
    p[56..58].copy_from_slice(&dport.to_be_bytes());
    p[66] = 0x50;
    p[67] = tcp_flags;
    p
}

/// The IPv6 peer standing for `addr(i)`: `fd00:100::` and `addr(i)`'s four bytes.
pub fn addr6(i: u32) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[..4].copy_from_slice(&[0xfd, 0x00, 0x01, 0x00]);
    a[12..].copy_from_slice(&addr(i));
    a
}

pub fn addr(i: u32) -> [u8; 4] {
    [10, 100 + (i >> 16) as u8, (i >> 8) as u8, i as u8]
}

/// 100,000 ipcache host entries: `addr(i)` has identity `1000 + i`.
pub fn fill_ipcache(dp: &mut BpfDatapath) {
    for i in 0..100_000u32 {
        let a = addr(i);
        dp.upsert_ipcache(
            format!("{}.{}.{}.{}/32", a[0], a[1], a[2], a[3])
                .parse()
                .unwrap(),
            1000 + i,
        )
        .unwrap();
    }
}

/// One kernel-timed test run of `prog` on `pkt`, `repeat` times: (verdict, ns per run).
pub fn timed_run(prog: &libbpf_rs::ProgramMut<'_>, pkt: &[u8], repeat: u32) -> (u32, f64) {
    let out = prog
        .test_run(ProgramInput {
            data_in: Some(pkt),
            repeat,
            ..Default::default()
        })
        .unwrap();
    (out.return_value, out.duration.as_nanos() as f64)
}

/// An endpoint without interface, identity 1 (the benches' endpoints), with `flags` and the
/// policy entries `upserts`.
pub fn endpoint_with(
    dp: &mut BpfDatapath,
    id: u16,
    flags: EndpointFlags,
    upserts: Vec<(MapKey, bool)>,
) {
    dp.attach_endpoint(&EndpointAttachment {
        id,
        interface: None,
        ips: vec![],
        identity: 1,
        mac: None,
    })
    .unwrap();
    let delta = MapDelta {
        upserts,
        ..Default::default()
    };
    dp.sync_policy(id, flags, &delta, true).unwrap();
}

/// The node's address in the host firewall's benches (identity host).
pub const NODE: [u8; 4] = [10, 98, 0, 1];

/// The host endpoint as the benches use it: the node at `NODE`, default deny both ways, TCP
/// 22 in from `addr(2)` (identity 1002) and TCP 443 out to `addr(3)` (1003), after
/// `fill_ipcache`.
pub fn host_endpoint(dp: &mut BpfDatapath) {
    dp.upsert_ipcache("10.98.0.1/32".parse().unwrap(), 1)
        .unwrap();
    let flags = EndpointFlags {
        ingress_default_deny: true,
        egress_default_deny: true,
        ..Default::default()
    };
    let out = MapKey {
        direction: Direction::Egress,
        identity: 1003,
        protocol: 6,
        port_lo: 443,
        port_hi: 443,
    };
    let upserts = vec![
        (
            ciliate::policy::mapstate::ingress_key(1002, 6, 22, 22),
            false,
        ),
        (out, false),
    ];
    endpoint_with(dp, ciliate::datapath::HOST_ENDPOINT_ID, flags, upserts);
}
