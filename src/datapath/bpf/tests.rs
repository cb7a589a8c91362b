//! Tests of the compiled BPF program itself: the kernel's verifier loads it, and real packets run
//! through it with `BPF_PROG_TEST_RUN`. Privileged: they need root (CAP_BPF). With `CI=true`
//! they must run; elsewhere, without privileges, they say so and pass nothing off as tested.

use std::mem::{offset_of, size_of, MaybeUninit};
use std::os::fd::{AsFd, AsRawFd};

use libbpf_rs::{MapCore, MapFlags, MapHandle, MapType, ProgramInput};

use super::skel::CiliateSkel;
use super::*;

/// Root, or (outside CI only) a skip.
fn privileged() -> bool {
    let root = nix::unistd::geteuid().is_root();
    let ci = std::env::var_os("CI").is_some();
    assert!(
        root || !ci,
        "CI=true: the privileged BPF tests must run as root"
    );
    if !root {
        eprintln!("skipped: BPF tests need root");
    }
    root
}

#[test]
fn abi_layout_is_pinned() {
    // Sizes and offsets of every shared structure; a change in bpf/ciliate.h shows up here.
    assert_eq!(size_of::<types::policy_key>(), 12);
    assert_eq!(offset_of!(types::policy_key, port), 6);
    assert_eq!(offset_of!(types::policy_key, port_prefix_len), 8);
    assert_eq!(size_of::<types::policy_value>(), 24);
    assert_eq!(offset_of!(types::policy_value, packets), 8);
    assert_eq!(offset_of!(types::policy_value, bytes), 16);
    assert_eq!(size_of::<types::ipcache_key>(), 24);
    assert_eq!(offset_of!(types::ipcache_key, addr), 8);
    assert_eq!(size_of::<types::ipcache_value>(), 8);
    assert_eq!(size_of::<types::ipcache_host_key>(), 20);
    assert_eq!(offset_of!(types::ipcache_host_key, addr), 4);
    assert_eq!(size_of::<types::local_endpoint>(), 20);
    assert_eq!(size_of::<types::tunnel_config>(), 8);
    assert_eq!(offset_of!(types::tunnel_config, local4), 4);
    assert_eq!(offset_of!(types::local_endpoint, mac), 8);
    assert_eq!(offset_of!(types::local_endpoint, node_mac), 14);
    assert_eq!(size_of::<types::endpoint_info>(), 24);
    assert_eq!(offset_of!(types::endpoint_info, port_prefix_lens), 8);
    assert_eq!(offset_of!(types::endpoint_info, any_identity_lens), 12);
    assert_eq!(offset_of!(types::endpoint_info, ingress_cookie), 16);
    assert_eq!(offset_of!(types::policy_value, cookie), 4);
    assert_eq!(size_of::<types::ct4_key>(), 20);
    assert_eq!(offset_of!(types::ct4_key, sport), 8);
    assert_eq!(offset_of!(types::ct4_key, protocol), 12);
    assert_eq!(offset_of!(types::ct4_key, endpoint_id), 16);
    assert_eq!(size_of::<types::ct6_key>(), 44);
    assert_eq!(offset_of!(types::ct6_key, sport), 32);
    assert_eq!(offset_of!(types::ct6_key, endpoint_id), 40);
    assert_eq!(size_of::<types::ct_value>(), 24);
    assert_eq!(size_of::<types::verdict_event>(), 64);
    assert_eq!(offset_of!(types::verdict_event, saddr), 24);
    assert_eq!(offset_of!(types::verdict_event, cookie), 56);
    assert_eq!(offset_of!(types::verdict_event, sport), 22);
    assert_eq!(offset_of!(types::verdict_event, tcp_flags), 60);
    assert_eq!(size_of::<types::verdict_event4>(), 40);
    assert_eq!(
        size_of::<types::event_batch>(),
        2152,
        "not the first form's 2144 bytes: programs of the two forms never share batches"
    );
    assert_eq!(
        offset_of!(types::verdict_event4, sport),
        32,
        "the fields a V1 batch's IPv4 events lack come after its 32 bytes"
    );
    assert_eq!(
        offset_of!(types::verdict_event4, family),
        offset_of!(types::verdict_event, family),
        "a reader tells the two forms apart by the family byte"
    );
    assert_eq!(offset_of!(types::verdict_event4, endpoint_id), 22);
    assert_eq!(offset_of!(types::verdict_event4, saddr), 24);
    assert_eq!(size_of::<types::datapath_config>(), 8);
    assert_eq!(size_of::<types::host_addrs4>(), 40);
    assert_eq!(offset_of!(types::host_addrs4, overflow), 32);
    assert_eq!(
        super::host_addrs::SLOTS,
        types::host_addrs4::default().addr.len()
    );
    assert_eq!(offset_of!(types::ct_value, dns_proxy), 20);
    assert_eq!(offset_of!(types::ct_value, l7), 21);
    assert_eq!(offset_of!(types::ct_value, proxy_upstream), 22);
    assert_eq!(offset_of!(types::policy_value, proxy), 1);
    assert_eq!(size_of::<types::dns_proxy_config>(), 8);
    assert_eq!(offset_of!(types::dns_proxy_config, mark), 4);
    assert_eq!(size_of::<types::l7_proxy_config>(), 24);
    assert_eq!(offset_of!(types::l7_proxy_config, local_mark), 4);
    assert_eq!(offset_of!(types::l7_proxy_config, downstream_mark), 16);
    // No implicit padding in any Pod type: the fields add up to the size.
    let k = types::policy_key::default();
    assert_eq!(
        4 + 1 + 1 + 2 + 1 + k.pad.len(),
        size_of::<types::policy_key>()
    );
    let e = types::verdict_event::default();
    assert_eq!(
        8 + 4 + 4 + 1 + 1 + 2 + 1 + 1 + 2 + 16 + 16 + 4 + 1 + e.pad2.len(),
        size_of::<types::verdict_event>()
    );
    let e4 = types::verdict_event4::default();
    assert_eq!(
        8 + 4 + 4 + 1 + 1 + 2 + 1 + 1 + 2 + 4 + 4 + 2 + 1 + e4.pad.len(),
        size_of::<types::verdict_event4>()
    );
}

struct Loaded {
    skel: CiliateSkel<'static>,
    _inner: Option<MapHandle>,
    pins: std::path::PathBuf,
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.pins);
    }
}

/// Loads an instance with its own pin directory (tests run in parallel).
fn load(endpoint_id: u32) -> Loaded {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    static MOUNT: std::sync::Once = std::sync::Once::new();
    MOUNT.call_once(|| {
        ensure_bpffs(std::path::Path::new("/sys/fs/bpf")).expect("bpffs on /sys/fs/bpf")
    });
    let pins = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/ciliate-unit-{}-{n}",
        std::process::id()
    ));
    let obj = Box::leak(Box::new(MaybeUninit::uninit()));
    let skel = match load_program(obj, &pins, endpoint_id) {
        Ok(s) => s,
        Err(e) => {
            // No guard exists yet: remove the pin directory here, then fail.
            let _ = std::fs::remove_dir_all(&pins);
            panic!("the verifier accepts the program: {e}");
        }
    };
    Loaded {
        skel,
        _inner: None,
        pins,
    }
}

fn ipv4(s: &str) -> [u8; 4] {
    s.parse::<std::net::Ipv4Addr>().unwrap().octets()
}

/// Ethernet + IPv4 + TCP/UDP header, no payload (checksums are not checked by the program).
fn packet(proto: u8, src: &str, dst: &str, sport: u16, dport: u16) -> Vec<u8> {
    let mut p = vec![0u8; 14 + 20 + 20];
    p[12] = 0x08; // ETH_P_IP
    p[14] = 0x45;
    p[16..18].copy_from_slice(&((20 + 20) as u16).to_be_bytes());
    p[22] = 64;
    p[23] = proto;
    p[26..30].copy_from_slice(&ipv4(src));
    p[30..34].copy_from_slice(&ipv4(dst));
    p[34..36].copy_from_slice(&sport.to_be_bytes());
    p[36..38].copy_from_slice(&dport.to_be_bytes());
    if proto == 6 {
        p[46] = 0x50; // data offset
        p[47] = 0x02; // SYN
    }
    p
}

impl Loaded {
    /// An endpoint record as an older agent wrote it: one probe mask for every class.
    fn endpoint(&self, id: u32, identity: u32, flags: u32, prefix_lens: u32) {
        self.endpoint_split(id, identity, flags, prefix_lens, 0)
    }

    /// An endpoint record with split probe masks only when `flags` has `EP_SPLIT_LENS`.
    fn endpoint_split(&self, id: u32, identity: u32, flags: u32, lens: u32, any_lens: u32) {
        let info = types::endpoint_info {
            identity,
            flags,
            port_prefix_lens: lens,
            any_identity_lens: any_lens,
            ..Default::default()
        };
        self.skel
            .maps
            .endpoints
            .update(&id.to_ne_bytes(), info.as_bytes(), MapFlags::ANY)
            .unwrap();
    }

    fn policy_map(&mut self, id: u32) {
        let inner = MapHandle::create(
            MapType::Hash,
            Some(format!("ciliate_pol_{id}")),
            size_of::<types::policy_key>() as u32,
            size_of::<types::policy_value>() as u32,
            1024,
            &libbpf_rs::libbpf_sys::bpf_map_create_opts {
                sz: size_of::<libbpf_rs::libbpf_sys::bpf_map_create_opts>() as _,
                ..Default::default()
            },
        )
        .expect("create a policy map");
        let fd = inner.as_fd().as_raw_fd() as u32;
        self.skel
            .maps
            .policy_maps
            .update(&id.to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY)
            .unwrap();
        self._inner = Some(inner);
    }

    /// Endpoint `id` (identity 300) isolated for ingress, allowing TCP 80 from the host
    /// 10.0.0.2 (identity 400).
    fn tcp_80_from_400(&mut self, id: u32) {
        self.endpoint_split(id, 300, EP_INGRESS_DEFAULT_DENY | EP_SPLIT_LENS, 1 << 16, 0);
        self.policy_map(id);
        self.ipcache_host("10.0.0.2", 400);
        self.rule(400, false, 6, 80, 16, false);
    }

    /// The one IPv4 conntrack entry there is.
    fn only_ct4_entry(&self) -> types::ct_value {
        let map = &self.skel.maps.conntrack4;
        let keys: Vec<Vec<u8>> = map.keys().collect();
        assert_eq!(keys.len(), 1, "one entry for the connection");
        let v = map.lookup(&keys[0], MapFlags::ANY).unwrap().unwrap();
        types::ct_value::from_bytes(&v).unwrap()
    }

    fn rule(&self, identity: u32, egress: bool, protocol: u8, port: u16, plen: u8, deny: bool) {
        let k = types::policy_key {
            identity,
            egress: egress as u8,
            protocol,
            port,
            port_prefix_len: plen,
            pad: [0; 3],
        };
        let v = types::policy_value {
            deny: deny as u8,
            ..Default::default()
        };
        let inner = self._inner.as_ref().expect("policy map");
        inner
            .update(k.as_bytes(), v.as_bytes(), MapFlags::ANY)
            .unwrap();
    }

    fn ipcache(&self, ip: &str, identity: u32) {
        let mut k = types::ipcache_key {
            prefixlen: 64,
            family: 4,
            ..Default::default()
        };
        k.addr[..4].copy_from_slice(&ipv4(ip));
        let v = types::ipcache_value { identity, pad: 0 };
        self.skel
            .maps
            .ipcache
            .update(k.as_bytes(), v.as_bytes(), MapFlags::ANY)
            .unwrap();
    }

    fn ipcache_host(&self, ip: &str, identity: u32) {
        let mut k = types::ipcache_host_key {
            family: 4,
            ..Default::default()
        };
        k.addr[..4].copy_from_slice(&ipv4(ip));
        let v = types::ipcache_value { identity, pad: 0 };
        self.skel
            .maps
            .ipcache_hosts
            .update(k.as_bytes(), v.as_bytes(), MapFlags::ANY)
            .unwrap();
    }

    fn run(&self, egress: bool, pkt: &[u8]) -> i32 {
        let input = ProgramInput {
            data_in: Some(pkt),
            ..Default::default()
        };
        let prog = if egress {
            &self.skel.progs.from_container
        } else {
            &self.skel.progs.to_container
        };
        prog.test_run(input)
            .expect("BPF_PROG_TEST_RUN")
            .return_value as i32
    }
}

#[test]
fn ingress_policy_allows_only_what_it_says_and_deny_wins() {
    if !privileged() {
        return;
    }
    let mut l = load(7);
    l.endpoint(7, 300, EP_INGRESS_DEFAULT_DENY, 1 << 16);
    l.policy_map(7);
    l.ipcache("10.0.0.1", 300);
    l.ipcache("10.0.0.2", 400);
    l.rule(400, false, 6, 80, 16, false);
    // Allowed: identity 400 to TCP 80.
    assert_eq!(
        l.run(false, &packet(6, "10.0.0.2", "10.0.0.1", 40000, 80)),
        TC_ACT_OK
    );
    // Other port, other protocol, other peer (world): default deny.
    assert_eq!(
        l.run(false, &packet(6, "10.0.0.2", "10.0.0.1", 40001, 81)),
        TC_ACT_SHOT
    );
    assert_eq!(
        l.run(false, &packet(17, "10.0.0.2", "10.0.0.1", 40002, 80)),
        TC_ACT_SHOT
    );
    assert_eq!(
        l.run(false, &packet(6, "192.0.2.9", "10.0.0.1", 40003, 80)),
        TC_ACT_SHOT
    );
    // Egress is not isolated: anything goes out.
    assert_eq!(
        l.run(true, &packet(17, "10.0.0.1", "192.0.2.9", 5353, 53)),
        TC_ACT_OK
    );
    // A deny for any peer on TCP 80 beats the specific allow.
    l.rule(0, false, 6, 80, 16, true);
    assert_eq!(
        l.run(false, &packet(6, "10.0.0.2", "10.0.0.1", 40004, 80)),
        TC_ACT_SHOT
    );
    // Counters: the allow entry counted its packet.
    let k = types::policy_key {
        identity: 400,
        egress: 0,
        protocol: 6,
        port: 80,
        port_prefix_len: 16,
        pad: [0; 3],
    };
    let v = l
        ._inner
        .as_ref()
        .unwrap()
        .lookup(k.as_bytes(), MapFlags::ANY)
        .unwrap()
        .unwrap();
    assert_eq!(types::policy_value::from_bytes(&v).unwrap().packets, 1);
}

#[test]
fn split_probe_masks_probe_only_what_exists_and_any_peer_denies_still_win() {
    if !privileged() {
        return;
    }
    let mut l = load(8);
    let split = EP_INGRESS_DEFAULT_DENY | EP_SPLIT_LENS;
    l.endpoint_split(8, 300, split, 1 << 16, 0);
    l.policy_map(8);
    // Host addresses in the host table; a /24 in the trie for what is no known host.
    l.ipcache_host("10.0.0.2", 400);
    l.ipcache_host("10.0.0.3", 401);
    let mut k = types::ipcache_key {
        prefixlen: 32 + 24,
        family: 4,
        ..Default::default()
    };
    k.addr[..4].copy_from_slice(&ipv4("10.0.0.0"));
    let v = types::ipcache_value {
        identity: 500,
        pad: 0,
    };
    l.skel
        .maps
        .ipcache
        .update(k.as_bytes(), v.as_bytes(), MapFlags::ANY)
        .unwrap();
    l.rule(400, false, 6, 80, 16, false);
    l.rule(500, false, 6, 80, 16, false);
    let syn = |src: &str, sport: u16| packet(6, src, "10.0.0.1", sport, 80);
    assert_eq!(
        l.run(false, &syn("10.0.0.2", 40000)),
        TC_ACT_OK,
        "host table: 400"
    );
    assert_eq!(
        l.run(false, &syn("10.0.0.3", 40001)),
        TC_ACT_SHOT,
        "401 has no rule"
    );
    assert_eq!(
        l.run(false, &syn("10.0.0.9", 40002)),
        TC_ACT_OK,
        "the trie: /24 -> 500"
    );
    // An any-peer deny for all of TCP, announced in the any-identity mask: it wins.
    l.rule(0, false, 6, 0, 0, true);
    l.endpoint_split(8, 300, split, 1 << 16, 1);
    assert_eq!(
        l.run(false, &syn("10.0.0.2", 40003)),
        TC_ACT_SHOT,
        "deny wins"
    );
    // An any-peer allow for every protocol, announced: UDP from 401 now passes.
    l.rule(0, false, 0, 0, 0, false);
    l.endpoint_split(8, 300, split, 1 << 16, 1 | LENS_ALL_PROTOCOLS);
    assert_eq!(
        l.run(false, &packet(17, "10.0.0.3", "10.0.0.1", 5000, 53)),
        TC_ACT_OK
    );
    // The record an older agent wrote for these entries (one mask over every identity, no
    // split flag) probes that mask for any peer too: still a deny.
    l.endpoint(8, 300, EP_INGRESS_DEFAULT_DENY, 1 << 16 | 1);
    assert_eq!(
        l.run(false, &syn("10.0.0.2", 40004)),
        TC_ACT_SHOT,
        "compat: deny wins"
    );
}

#[test]
fn replies_of_allowed_connections_pass_under_default_deny() {
    if !privileged() {
        return;
    }
    let mut l = load(8);
    l.endpoint(
        8,
        300,
        EP_INGRESS_DEFAULT_DENY | EP_EGRESS_DEFAULT_DENY,
        1 << 16,
    );
    l.policy_map(8);
    l.ipcache("10.0.0.2", 400);
    l.rule(400, true, 6, 443, 16, false);
    // The endpoint opens a connection to 400:443 (allowed by its egress policy)...
    assert_eq!(
        l.run(true, &packet(6, "10.0.0.1", "10.0.0.2", 50000, 443)),
        TC_ACT_OK
    );
    // A bare SYN back on the same tuple opens a connection (a simultaneous open): it meets
    // the ingress policy like any new connection, and is denied.
    assert_eq!(
        l.run(false, &packet(6, "10.0.0.2", "10.0.0.1", 443, 50000)),
        TC_ACT_SHOT
    );
    // The reply (SYN-ACK) passes its ingress default deny, and so does the rest of the flow.
    let mut synack = packet(6, "10.0.0.2", "10.0.0.1", 443, 50000);
    synack[47] = 0x12;
    assert_eq!(l.run(false, &synack), TC_ACT_OK);
    let mut ack = packet(6, "10.0.0.1", "10.0.0.2", 50000, 443);
    ack[47] = 0x10;
    assert_eq!(l.run(true, &ack), TC_ACT_OK);
    let mut reply_data = synack.clone();
    reply_data[47] = 0x18;
    assert_eq!(l.run(false, &reply_data), TC_ACT_OK);
    // A new connection from the peer is still denied.
    assert_eq!(
        l.run(false, &packet(6, "10.0.0.2", "10.0.0.1", 443, 50001)),
        TC_ACT_SHOT
    );
}

#[test]
fn port_ranges_wildcards_and_fail_closed_states() {
    if !privileged() {
        return;
    }
    let mut l = load(9);
    // 8080-8083 is one /14 block; L3-only allow from identity 500.
    l.endpoint(9, 300, EP_INGRESS_DEFAULT_DENY, (1 << 14) | 1);
    l.policy_map(9);
    l.ipcache("10.0.0.2", 400);
    l.ipcache("10.0.0.5", 500);
    l.rule(400, false, 6, 8080, 14, false);
    l.rule(500, false, 0, 0, 0, false);
    assert_eq!(
        l.run(false, &packet(6, "10.0.0.2", "10.0.0.1", 1, 8083)),
        TC_ACT_OK
    );
    assert_eq!(
        l.run(false, &packet(6, "10.0.0.2", "10.0.0.1", 2, 8084)),
        TC_ACT_SHOT
    );
    assert_eq!(
        l.run(false, &packet(17, "10.0.0.5", "10.0.0.1", 3, 9999)),
        TC_ACT_OK
    );
    // Drop-all (policy not realized) overrides everything.
    l.endpoint(9, 300, EP_INGRESS_DEFAULT_DENY | EP_DROP_ALL, (1 << 14) | 1);
    assert_eq!(
        l.run(false, &packet(17, "10.0.0.5", "10.0.0.1", 4, 9999)),
        TC_ACT_SHOT
    );
    // An attached program whose endpoint is unknown fails closed; an unmanaged one passes.
    let unknown = load(10);
    assert_eq!(
        unknown.run(false, &packet(6, "10.0.0.2", "10.0.0.1", 5, 80)),
        TC_ACT_SHOT
    );
    let unmanaged = load(0);
    assert_eq!(
        unmanaged.run(false, &packet(6, "10.0.0.2", "10.0.0.1", 6, 80)),
        TC_ACT_OK
    );
    // Not IP (ARP) passes; a truncated IP header is dropped.
    let mut arp = vec![0u8; 42];
    arp[12] = 0x08;
    arp[13] = 0x06;
    // Policy is about IP: ARP passes even on a drop-all endpoint (neighbour resolution).
    assert_eq!(l.run(false, &arp), TC_ACT_OK);
    let mut l2 = load(11);
    l2.endpoint(11, 300, 0, 0);
    assert_eq!(l2.run(false, &arp), TC_ACT_OK);
    // A valid IPv4 header followed by two bytes of TCP: malformed, dropped. (The kernel's
    // test runner itself refuses packets whose IP header is cut short.)
    assert_eq!(
        l2.run(false, &packet(6, "10.0.0.2", "10.0.0.1", 7, 80)[..36]),
        TC_ACT_SHOT
    );
    // Ports but no flags byte (13 bytes of TCP): malformed too, on an endpoint whose policy
    // would allow the port; 14 bytes hold the flags and are judged by policy.
    l2.tcp_80_from_400(11);
    let syn = packet(6, "10.0.0.2", "10.0.0.1", 8, 80);
    assert_eq!(l2.run(false, &syn[..14 + 20 + 13]), TC_ACT_SHOT);
    assert_eq!(l2.run(false, &syn[..14 + 20 + 14]), TC_ACT_OK);
}

/// Ethernet + IPv6 + an 8-byte ICMPv6 header of the given type.
fn icmpv6(src: &str, dst: &str, icmp_type: u8) -> Vec<u8> {
    let mut p = vec![0u8; 14 + 40 + 8];
    p[12] = 0x86;
    p[13] = 0xdd;
    p[14] = 0x60;
    p[18..20].copy_from_slice(&8u16.to_be_bytes());
    p[20] = 58; // next header: ICMPv6
    p[21] = 255;
    p[22..38].copy_from_slice(&src.parse::<std::net::Ipv6Addr>().unwrap().octets());
    p[38..54].copy_from_slice(&dst.parse::<std::net::Ipv6Addr>().unwrap().octets());
    p[54] = icmp_type;
    p
}

#[test]
fn ipv6_link_control_passes_and_icmpv6_follows_policy() {
    if !privileged() {
        return;
    }
    let mut l = load(12);
    l.endpoint(
        12,
        300,
        EP_INGRESS_DEFAULT_DENY | EP_EGRESS_DEFAULT_DENY,
        1 << 16,
    );
    l.policy_map(12);
    // Neighbour solicitation and an MLD report reach an isolated endpoint (no IPv6 otherwise).
    assert_eq!(
        l.run(false, &icmpv6("fe80::1", "ff02::1:ff00:2", 135)),
        TC_ACT_OK
    );
    assert_eq!(l.run(false, &icmpv6("fe80::1", "ff02::16", 143)), TC_ACT_OK);
    // An echo request from the world is decided by policy: default deny...
    assert_eq!(
        l.run(false, &icmpv6("2001:db8::9", "fd00::2", 128)),
        TC_ACT_SHOT
    );
    // ...until a rule allows ICMPv6 type 128 from any peer.
    l.rule(0, false, 58, 128, 16, false);
    assert_eq!(
        l.run(false, &icmpv6("2001:db8::9", "fd00::2", 128)),
        TC_ACT_OK
    );
    // The echo reply leaves through the isolated egress as the reply of a tracked flow, kept
    // in the IPv6 table; the endpoint's own echo request to another peer is denied.
    assert_eq!(
        l.run(true, &icmpv6("fd00::2", "2001:db8::9", 129)),
        TC_ACT_OK
    );
    assert_eq!(l.skel.maps.conntrack6.keys().count(), 1);
    assert_eq!(l.skel.maps.conntrack4.keys().count(), 0);
    assert_eq!(
        l.run(true, &icmpv6("fd00::2", "2001:db8::7", 128)),
        TC_ACT_SHOT
    );
}

#[test]
fn conntrack_entries_record_replies_and_tcp_closing() {
    if !privileged() {
        return;
    }
    let mut l = load(9);
    l.tcp_80_from_400(9);
    let syn = packet(6, "10.0.0.2", "10.0.0.1", 41000, 80);
    assert_eq!(l.run(false, &syn), TC_ACT_OK);
    let e = l.only_ct4_entry();
    assert_eq!((e.egress, e.replied, e.closing), (0, 0, 0));
    // The reply (SYN-ACK) marks it replied; a FIN from either side marks it closing.
    let mut synack = packet(6, "10.0.0.1", "10.0.0.2", 80, 41000);
    synack[47] = 0x12;
    assert_eq!(l.run(true, &synack), TC_ACT_OK);
    let e = l.only_ct4_entry();
    assert_eq!((e.replied, e.closing, e.packets), (1, 0, 2));
    let mut fin = syn.clone();
    fin[47] = 0x11;
    assert_eq!(l.run(false, &fin), TC_ACT_OK);
    assert_eq!(l.only_ct4_entry().closing, 1);
}

#[test]
fn a_syn_always_meets_the_policy_in_force() {
    if !privileged() {
        return;
    }
    let mut l = load(11);
    l.tcp_80_from_400(11);
    let syn = packet(6, "10.0.0.2", "10.0.0.1", 42000, 80);
    let mut ack = syn.clone();
    ack[47] = 0x10;
    assert_eq!(l.run(false, &syn), TC_ACT_OK);
    assert_eq!(l.run(false, &ack), TC_ACT_OK);
    // The rule goes away: the tracked flow goes on, but a SYN on the same tuple (a
    // retransmission, or the port reused) is a new connection and is denied.
    let rule = types::policy_key {
        identity: 400,
        egress: 0,
        protocol: 6,
        port: 80,
        port_prefix_len: 16,
        pad: [0; 3],
    };
    l._inner.as_ref().unwrap().delete(rule.as_bytes()).unwrap();
    assert_eq!(l.run(false, &ack), TC_ACT_OK, "established");
    assert_eq!(l.run(false, &syn), TC_ACT_SHOT, "a SYN is not established");
    // Allowed again, the SYN replaces the entry: one entry, counting from this SYN.
    l.rule(400, false, 6, 80, 16, false);
    assert_eq!(l.run(false, &syn), TC_ACT_OK);
    assert_eq!(l.only_ct4_entry().packets, 1);
}

#[test]
fn maps_pinned_by_an_older_version_are_migrated_not_crashed_on() {
    if !privileged() {
        return;
    }
    ensure_bpffs(std::path::Path::new("/sys/fs/bpf")).unwrap();
    let pins = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/ciliate-unit-migrate-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&pins).unwrap();
    struct Cleanup(std::path::PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(pins.clone());
    let opts = libbpf_rs::libbpf_sys::bpf_map_create_opts {
        sz: size_of::<libbpf_rs::libbpf_sys::bpf_map_create_opts>() as _,
        ..Default::default()
    };
    // An older version's single conntrack table (an LRU hash), with a live connection of each
    // family: 10.0.0.2:40000 -> 10.0.0.1:80 into endpoint 7, and one over IPv6.
    let mut ct = MapHandle::create(
        MapType::LruHash,
        Some("conntrack"),
        size_of::<types::ct6_key>() as u32,
        size_of::<types::ct_value>() as u32,
        262144,
        &opts,
    )
    .unwrap();
    let mut key = types::ct6_key {
        sport: 40000,
        dport: 80,
        protocol: 6,
        family: 4,
        endpoint_id: 7,
        ..Default::default()
    };
    key.saddr[..4].copy_from_slice(&ipv4("10.0.0.2"));
    key.daddr[..4].copy_from_slice(&ipv4("10.0.0.1"));
    let mut key6 = types::ct6_key {
        sport: 40001,
        dport: 80,
        protocol: 6,
        family: 6,
        endpoint_id: 7,
        ..Default::default()
    };
    key6.saddr[15] = 2;
    key6.daddr[15] = 1;
    let value = types::ct_value {
        last_seen_ns: 42,
        packets: 3,
        replied: 1,
        ..Default::default()
    };
    for k in [&key, &key6] {
        ct.update(k.as_bytes(), value.as_bytes(), MapFlags::ANY)
            .unwrap();
    }
    ct.pin(pins.join("conntrack")).unwrap();
    // Its verdict counters had one reason fewer.
    let mut counters = MapHandle::create(
        MapType::PercpuArray,
        Some("verdict_counters"),
        4,
        8,
        10,
        &opts,
    )
    .unwrap();
    let ncpu = libbpf_rs::num_possible_cpus().unwrap();
    let per_cpu: Vec<Vec<u8>> = (0..ncpu).map(|_| 5u64.to_ne_bytes().to_vec()).collect();
    counters
        .update_percpu(&0u32.to_ne_bytes(), &per_cpu, MapFlags::ANY)
        .unwrap();
    counters.pin(pins.join("verdict_counters")).unwrap();
    // Its endpoint table was a hash, and its policy maps a hash of maps: endpoint 7 allows
    // TCP 8080 from identity 400 (the host 10.0.0.2) under ingress default deny.
    // Its records were 16 bytes: no attribution cookies yet.
    let mut endpoints =
        MapHandle::create(MapType::Hash, Some("endpoints"), 4, 16, 65536, &opts).unwrap();
    let info = types::endpoint_info {
        identity: 300,
        flags: EP_INGRESS_DEFAULT_DENY | EP_SPLIT_LENS,
        port_prefix_lens: 1 << 16,
        any_identity_lens: 0,
        ..Default::default()
    };
    endpoints
        .update(&7u32.to_ne_bytes(), &info.as_bytes()[..16], MapFlags::ANY)
        .unwrap();
    endpoints.pin(pins.join("endpoints")).unwrap();
    let inner = MapHandle::create(
        MapType::Hash,
        Some("ciliate_pol_7"),
        size_of::<types::policy_key>() as u32,
        size_of::<types::policy_value>() as u32,
        16384,
        &opts,
    )
    .unwrap();
    let rule = types::policy_key {
        identity: 400,
        egress: 0,
        protocol: 6,
        port: 8080,
        port_prefix_len: 16,
        pad: [0; 3],
    };
    inner
        .update(
            rule.as_bytes(),
            types::policy_value::default().as_bytes(),
            MapFlags::ANY,
        )
        .unwrap();
    let outer_opts = libbpf_rs::libbpf_sys::bpf_map_create_opts {
        sz: size_of::<libbpf_rs::libbpf_sys::bpf_map_create_opts>() as _,
        inner_map_fd: inner.as_fd().as_raw_fd() as u32,
        ..Default::default()
    };
    let mut policy_maps = MapHandle::create(
        MapType::HashOfMaps,
        Some("policy_maps"),
        4,
        4,
        65536,
        &outer_opts,
    )
    .unwrap();
    policy_maps
        .update(
            &7u32.to_ne_bytes(),
            &(inner.as_fd().as_raw_fd() as u32).to_ne_bytes(),
            MapFlags::ANY,
        )
        .unwrap();
    policy_maps.pin(pins.join("policy_maps")).unwrap();
    // Its event batches had another layout (events in flight, never state to carry over).
    let cpus = libbpf_rs::num_possible_cpus().unwrap() as u32;
    let mut batches =
        MapHandle::create(MapType::Array, Some("event_batches"), 4, 1064, cpus, &opts).unwrap();
    batches
        .update(&0u32.to_ne_bytes(), &[0xff; 1064], MapFlags::ANY)
        .unwrap();
    batches.pin(pins.join("event_batches")).unwrap();
    let old_batches = batches.info().unwrap().info.id;
    drop((ct, counters, endpoints, policy_maps, batches));

    let obj = Box::leak(Box::new(MaybeUninit::uninit()));
    let skel = load_program(obj, &pins, 7).expect("an older version's pins do not stop the load");
    let l = Loaded {
        skel,
        _inner: None,
        pins: pins.clone(),
    };
    // The old conntrack table is no map of this build: its entries move to the IPv4 and IPv6
    // tables, and as no program uses it any more, it is unpinned.
    let moved = conntrack::adopt_legacy(&pins).expect("the old table is found");
    assert_eq!((moved.moved, moved.failed, moved.unpinned), (2, 0, true));
    assert!(!pins.join("conntrack").exists());
    let mut key4 = types::ct4_key {
        sport: 40000,
        dport: 80,
        protocol: 6,
        endpoint_id: 7,
        ..Default::default()
    };
    key4.saddr = ipv4("10.0.0.2");
    key4.daddr = ipv4("10.0.0.1");
    let got = l
        .skel
        .maps
        .conntrack4
        .lookup(key4.as_bytes(), MapFlags::ANY)
        .unwrap()
        .expect("the IPv4 connection was carried over");
    assert_eq!(types::ct_value::from_bytes(&got).unwrap().packets, 3);
    let got = l
        .skel
        .maps
        .conntrack6
        .lookup(key6.as_bytes(), MapFlags::ANY)
        .unwrap()
        .expect("the IPv6 connection was carried over");
    assert_eq!(types::ct_value::from_bytes(&got).unwrap().packets, 3);
    assert!(
        conntrack::adopt_legacy(&pins).is_none(),
        "nothing left to do"
    );
    // The tables this program uses are in use; a map no program holds is not.
    let id4 = l.skel.maps.conntrack4.info().unwrap().info.id;
    assert!(tcx::map_in_use(id4));
    let unused = MapHandle::create(MapType::Hash, Some("unused"), 4, 4, 1, &opts).unwrap();
    assert!(!tcx::map_in_use(unused.info().unwrap().info.id));
    let counters = MapHandle::from_pinned_path(pins.join("verdict_counters")).unwrap();
    assert_eq!(
        counters.info().unwrap().info.max_entries as usize,
        super::REASONS.len()
    );
    let c = counters
        .lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY)
        .unwrap()
        .unwrap();
    assert!(
        c.iter().all(|v| v.as_slice() == 5u64.to_ne_bytes()),
        "counts kept"
    );
    assert!(
        std::fs::read_dir(&pins)
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().starts_with("migrating_")),
        "the old maps are unpinned"
    );
    // The endpoint record and the policy map moved into this build's arrays...
    assert_eq!(l.skel.maps.endpoints.map_type(), MapType::Array);
    let got = l
        .skel
        .maps
        .endpoints
        .lookup(&7u32.to_ne_bytes(), MapFlags::ANY)
        .unwrap()
        .unwrap();
    assert_eq!(
        got.as_slice(),
        info.as_bytes(),
        "the record grew: its cookies read as 0"
    );
    assert_eq!(l.skel.maps.policy_maps.map_type(), MapType::ArrayOfMaps);
    let registered = l
        .skel
        .maps
        .policy_maps
        .lookup(&7u32.to_ne_bytes(), MapFlags::ANY)
        .unwrap()
        .expect("the policy map is registered");
    assert_eq!(
        u32::from_ne_bytes(registered[..4].try_into().unwrap()),
        inner.info().unwrap().info.id
    );
    // The old event batches are not copied into this build's (whose layout they would
    // corrupt), and the old map stays alive, unpinned, for programs that still write in it.
    let batch = l
        .skel
        .maps
        .event_batches
        .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
        .unwrap()
        .unwrap();
    assert!(batch.iter().all(|&b| b == 0), "nothing copied");
    assert!(
        MapHandle::from_map_id(old_batches).is_ok(),
        "the old batches are held"
    );
    // ...and the program enforces them: 8080 from 400 passes, 9090 meets default deny.
    l.ipcache_host("10.0.0.2", 400);
    assert_eq!(
        l.run(false, &packet(6, "10.0.0.2", "10.0.0.1", 40001, 8080)),
        TC_ACT_OK
    );
    assert_eq!(
        l.run(false, &packet(6, "10.0.0.2", "10.0.0.1", 40002, 9090)),
        TC_ACT_SHOT
    );
    // The carried-over connection is established: its packets pass though port 80 has no rule.
    let mut ack = packet(6, "10.0.0.2", "10.0.0.1", 40000, 80);
    ack[47] = 0x10;
    assert_eq!(l.run(false, &ack), TC_ACT_OK);
    drop(l);
}

/// The node device's program (BPF host routing, receive side): a packet for a local pod meets
/// that pod's ingress policy (the maps `to_container` uses) and, allowed, is redirected into
/// the pod with the pod's MAC as destination and its gateway's as source, TTL decremented; a
/// denied one is dropped; only tracked flows and new TCP connections are delivered; anything not for a local pod, or not addressed to this host, goes on
/// untouched (TC_ACT_UNSPEC: the next program or the stack).
#[test]
fn node_device_program_applies_the_pods_ingress_policy_before_delivering() {
    if !privileged() {
        return;
    }
    use super::host_delivery;
    let mut l = load(7);
    l.tcp_80_from_400(7);
    let storage = Box::leak(Box::new(MaybeUninit::uninit()));
    let nd =
        load_netdev_program(storage, &l.pins, false).expect("the verifier accepts from_netdev");
    let pod_mac = [0x0a, 0x58, 10, 0, 0, 7];
    let gw_mac = [0xee; 6];
    host_delivery::publish(
        &l.skel.maps.local_endpoints,
        &l.skel.maps.local_endpoints6,
        &["10.0.0.7".parse().unwrap()],
        &host_delivery::record(7, 42, pod_mac, gw_mac),
    )
    .unwrap();
    let run = |pkt: &[u8]| -> (i32, Vec<u8>) {
        let mut out = vec![0u8; pkt.len()];
        let input = ProgramInput {
            data_in: Some(pkt),
            data_out: Some(&mut out),
            ..Default::default()
        };
        let r = nd
            .progs
            .from_netdev
            .test_run(input)
            .expect("BPF_PROG_TEST_RUN");
        (r.return_value as i32, out)
    };
    const UNSPEC: i32 = -1;
    const SHOT: i32 = 2;
    const REDIRECT: i32 = 7;

    let allowed = packet(6, "10.0.0.2", "10.0.0.7", 40000, 80);
    let (verdict, out) = run(&allowed);
    assert_eq!(verdict, REDIRECT, "allowed: delivered into the pod");
    assert_eq!(&out[..6], &pod_mac, "to the pod's MAC");
    assert_eq!(&out[6..12], &gw_mac, "from its gateway's");
    assert_eq!(out[22], 63, "TTL decremented as forwarding does");
    let entry = l.only_ct4_entry();
    assert_eq!(entry.egress, 0, "tracked as the pod's ingress");
    assert_eq!(
        entry.direct, 1,
        "delivered around the stack: its replies may skip it too"
    );
    let mut ack = allowed.clone();
    ack[47] = 0x10;
    assert_eq!(run(&ack).0, REDIRECT, "the connection's next packets too");
    // A packet of no tracked flow other than a TCP SYN may be the reply to a connection the
    // stack translated (kube-proxy's DNAT): the stack takes it, to_container judges it.
    let mut stray = packet(6, "10.0.0.2", "10.0.0.7", 40009, 80);
    stray[47] = 0x12; // SYN-ACK
    assert_eq!(
        run(&stray).0,
        UNSPEC,
        "a SYN-ACK of no connection goes to the stack"
    );
    let udp = packet(17, "10.0.0.2", "10.0.0.7", 40010, 80);
    assert_eq!(run(&udp).0, UNSPEC, "a new UDP flow goes to the stack");

    let denied = packet(6, "10.0.0.2", "10.0.0.7", 40001, 81);
    assert_eq!(run(&denied).0, SHOT, "a port the policy does not allow");
    let stranger = packet(6, "10.0.0.3", "10.0.0.7", 40002, 80);
    assert_eq!(run(&stranger).0, SHOT, "a peer the policy does not allow");

    let elsewhere = packet(6, "10.0.0.2", "10.0.0.8", 40003, 80);
    let (verdict, out) = run(&elsewhere);
    assert_eq!(verdict, UNSPEC, "not a local pod: left alone");
    assert_eq!(out, elsewhere, "and untouched");
    let mut other_host = allowed.clone();
    other_host[..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    assert_eq!(run(&other_host).0, UNSPEC, "a frame for another host's MAC");
    let mut expiring = allowed.clone();
    expiring[22] = 1;
    assert_eq!(run(&expiring).0, UNSPEC, "TTL 1: the stack answers it");

    // Without the endpoint's record (being detached) the pod is never reached around policy.
    l.endpoint(7, 0, 0, 0);
    assert_eq!(run(&allowed).0, SHOT, "fails closed");
    host_delivery::withdraw(&l.skel.maps.local_endpoints, 7).unwrap();
    assert!(host_delivery::entries(&l.skel.maps.local_endpoints).is_empty());
    assert_eq!(run(&allowed).0, UNSPEC, "withdrawn: left to the stack");
}

/// Events that do not fit in the ring buffer (nobody reads it here) are counted, never lost
/// silently: the agent reports the count (`ciliate monitor`, `ciliate_datapath_events_lost`).
#[test]
fn events_the_ring_buffer_cannot_take_are_counted() {
    if !privileged() {
        return;
    }
    let mut l = load(7);
    l.tcp_80_from_400(7);
    let denied = packet(6, "10.0.0.3", "10.0.0.1", 40000, 80);
    let input = ProgramInput {
        data_in: Some(&denied),
        // IPv4 events take 40 bytes, in records of 51: about 26,000 fit in the 1 MiB ring
        // buffer (the last 51 may still wait in their batch).
        repeat: 80_000,
        ..Default::default()
    };
    let r = l
        .skel
        .progs
        .to_container
        .test_run(input)
        .expect("BPF_PROG_TEST_RUN");
    assert_eq!(r.return_value, 2, "denied");
    let lost =
        super::host_routes::percpu_counter_at(&l.pins, "verdict_counters", super::EVENTS_LOST)
            .expect("read the counter");
    assert!(lost > 50_000, "the overflow is counted: {lost}");
    assert!(lost < 58_000, "and only the overflow: {lost}");
}

/// Descriptors this process holds on TCX links of interface `ifindex` (from /proc/self/fdinfo).
fn tcx_link_fds(ifindex: i32) -> usize {
    let want = format!("ifindex:\t{ifindex}\n");
    std::fs::read_dir("/proc/self/fdinfo")
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_to_string(e.path()).ok())
                .filter(|info| info.contains("link_type:\ttcx") && info.contains(&want))
                .count()
        })
        .unwrap_or(0)
}

/// Soak finding (#26): each TCX attach kept its link's descriptor open (a disconnected link's
/// destroy does not close it), two per pod for the agent's life. The pin alone holds the link.
#[test]
fn a_pinned_tcx_link_leaves_no_descriptor_open() {
    if !privileged() {
        return;
    }
    let l = load(9);
    let storage = Box::leak(Box::new(MaybeUninit::uninit()));
    let skel = load_program_for(storage, &l.pins, 9, true).expect("a TCX program loads");
    let dev = format!("ciltcx{}", std::process::id() % 100_000);
    let ok = std::process::Command::new("ip")
        .args([
            "link",
            "add",
            &dev,
            "type",
            "veth",
            "peer",
            "name",
            &format!("{dev}p"),
        ])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "ip link add {dev}");
    struct Gone(String);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip")
                .args(["link", "del", &self.0])
                .status();
        }
    }
    let _gone = Gone(dev.clone());
    let ifindex = nix::net::if_::if_nametoindex(dev.as_str()).expect("ifindex") as i32;
    let pin = l.pins.join("tcx-leak-test");
    tcx::attach(
        &skel.progs.from_container,
        ifindex,
        tcx::Hook::Ingress,
        &pin,
    )
    .expect("TCX attach");
    assert!(pin.exists(), "the link is pinned");
    assert_eq!(
        tcx_link_fds(ifindex),
        0,
        "descriptors left open on {dev}'s links"
    );
    tcx::detach(&pin);
}

/// A ring-buffer record holds a batch (the mark, then IPv4 events short and IPv6 events in
/// full) or one event alone, which an older program wrote shorter.
#[test]
fn records_split_into_their_events() {
    let v6 = |port: u16| types::verdict_event {
        port,
        reason: 5,
        family: 6,
        saddr: [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
        cookie: 7,
        ..Default::default()
    };
    let v4 = |port: u16| types::verdict_event4 {
        timestamp_ns: 99,
        peer_identity: 400,
        cookie: 3,
        port,
        reason: 4,
        family: 4,
        endpoint_id: 65_000,
        saddr: [10, 0, 0, 2],
        daddr: [10, 0, 0, 1],
        sport: 41_000,
        tcp_flags: 0x02,
        ..Default::default()
    };
    let mut batch = EVENT_RECORD_MARK.to_ne_bytes().to_vec();
    batch.extend_from_slice(v4(80).as_bytes());
    batch.extend_from_slice(v6(81).as_bytes());
    batch.extend_from_slice(v4(82).as_bytes());
    let got = record_events(&batch);
    let ports: Vec<u16> = got.iter().map(|e| e.port).collect();
    assert_eq!(ports, [80, 81, 82]);
    let first = &got[0];
    assert_eq!(
        (
            first.timestamp_ns,
            first.peer_identity,
            first.cookie,
            first.endpoint_id
        ),
        (99, 400, 3, 65_000)
    );
    assert_eq!((first.family, first.reason), (4, 4));
    assert_eq!(&first.saddr[..4], &[10, 0, 0, 2]);
    assert_eq!(first.saddr[4..], [0; 12]);
    assert_eq!(&first.daddr[..4], &[10, 0, 0, 1]);
    assert_eq!((first.sport, first.tcp_flags), (41_000, 0x02));
    assert_eq!(
        (got[1].family, got[1].cookie, got[1].saddr),
        (6, 7, v6(0).saddr)
    );
    // A batch cut inside its last event ends at the one before.
    assert_eq!(record_events(&batch[..batch.len() - 5]).len(), 2);
    // An older program's batch: 32-byte IPv4 events, no source port or flags.
    let mut old = super::EVENT_RECORD_MARK_V1.to_ne_bytes().to_vec();
    old.extend_from_slice(&v4(80).as_bytes()[..32]);
    old.extend_from_slice(v6(81).as_bytes());
    old.extend_from_slice(&v4(82).as_bytes()[..32]);
    let got_v1 = record_events(&old);
    let seen: Vec<(u16, u16, u8)> = got_v1
        .iter()
        .map(|e| (e.port, e.sport, e.tcp_flags))
        .collect();
    assert_eq!(seen, [(80, 0, 0), (81, 0, 0), (82, 0, 0)]);
    assert_eq!(got_v1[0].endpoint_id, 65_000);
    // One event alone, in full.
    let one = record_events(v6(443).as_bytes());
    assert_eq!((one.len(), one[0].port, one[0].reason), (1, 443, 5));
    // An older, shorter event: the fields it lacks (here the cookie) read as 0.
    let old = v6(53);
    let short = &old.as_bytes()[..offset_of!(types::verdict_event, cookie)];
    let got = record_events(short);
    assert_eq!((got.len(), got[0].port, got[0].cookie), (1, 53, 0));
    assert!(record_events(&[]).is_empty());
}

/// Runs `f` on CPU 0 alone (so that every event goes into one CPU's batch), then lets the
/// thread run anywhere again.
fn on_cpu_0<T>(f: impl FnOnce() -> T) -> T {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    let before = sched_getaffinity(Pid::from_raw(0)).expect("affinity");
    let mut one = CpuSet::new();
    one.set(0).unwrap();
    sched_setaffinity(Pid::from_raw(0), &one).expect("pin to CPU 0");
    let r = f();
    sched_setaffinity(Pid::from_raw(0), &before).expect("unpin");
    r
}

/// Verdict events wait per CPU and leave in batches: several events to a record, and what
/// does not fill a batch leaves by the flush timer without any further packet; every event
/// arrives, in order, with its own fields.
#[test]
fn verdict_events_leave_in_batches_and_none_is_held_back() {
    if !privileged() {
        return;
    }
    let mut l = load(7);
    l.tcp_80_from_400(7);
    let records = std::rc::Rc::new(std::cell::RefCell::new(Vec::<Vec<u16>>::new()));
    let sink = records.clone();
    let mut builder = libbpf_rs::RingBufferBuilder::new();
    builder
        .add(&l.skel.maps.events, move |data: &[u8]| {
            sink.borrow_mut()
                .push(record_events(data).iter().map(|e| e.port).collect());
            0
        })
        .unwrap();
    let rb = builder.build().unwrap();
    // 100 denied packets (drops are always reported), each to its own port: a batch leaves
    // full at 62 IPv4 events (2,048 bytes), so the last 38 can only leave by the timer.
    let ports: Vec<u16> = (1000..1100).collect();
    on_cpu_0(|| {
        for &port in &ports {
            let denied = packet(6, "10.0.0.3", "10.0.0.1", 40000, port);
            assert_eq!(l.run(false, &denied), 2, "denied");
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while records.borrow().iter().map(Vec::len).sum::<usize>() < ports.len()
        && std::time::Instant::now() < deadline
    {
        rb.poll(std::time::Duration::from_millis(50)).unwrap();
    }
    let records = records.borrow();
    let got: Vec<u16> = records.iter().flatten().copied().collect();
    assert_eq!(got, ports, "every event, in order: {records:?}");
    assert!(
        records.iter().any(|r| r.len() > 1),
        "several events share a record: {records:?}"
    );
}

/// The node's own IPv4 addresses reach the programs through `host_addrs4`, mirrored by
/// `BpfDatapath` from the ipcache's identity-host entries: the host firewall judges a packet
/// for an address while it has identity host and not after; with more addresses than the
/// record's slots the programs ask the host table, so none is missed; and a record lost or
/// emptied (an upgrade that brings the map) is rebuilt from the host table when the agent opens
/// the datapath.
/// An agent's datapath under its own pin root (removed on drop) with the host endpoint
/// isolated both ways and no rule, and the node device's programs.
struct HostFirewall {
    dp: super::datapath::BpfDatapath,
    nd: super::skel::CiliateSkel<'static>,
    pins: std::path::PathBuf,
    root: std::path::PathBuf,
}

impl Drop for HostFirewall {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

impl HostFirewall {
    fn new(name: &str) -> HostFirewall {
        use crate::datapath::{Datapath, EndpointAttachment, EndpointFlags, HOST_ENDPOINT_ID};
        let root = std::path::PathBuf::from(format!(
            "/sys/fs/bpf/ciliate-unit-{name}-{}",
            std::process::id()
        ));
        let pins = root.join("ciliate");
        let mut dp = super::datapath::BpfDatapath::open(&root).unwrap();
        dp.attach_endpoint(&EndpointAttachment {
            id: HOST_ENDPOINT_ID,
            interface: None,
            ips: vec![],
            identity: 1,
            mac: None,
        })
        .unwrap();
        let isolated = EndpointFlags {
            ingress_default_deny: true,
            egress_default_deny: true,
            ..Default::default()
        };
        dp.sync_policy(HOST_ENDPOINT_ID, isolated, &Default::default(), true)
            .unwrap();
        let storage = Box::leak(Box::new(MaybeUninit::uninit()));
        let nd = load_netdev_program(storage, &pins, false).unwrap();
        HostFirewall { dp, nd, pins, root }
    }
}

/// The verdict of `from_netdev` (egress false) or `to_netdev` on `pkt`.
fn netdev_verdict(nd: &super::skel::CiliateSkel<'static>, egress: bool, pkt: &[u8]) -> i32 {
    let input = ProgramInput {
        data_in: Some(pkt),
        ..Default::default()
    };
    let p = if egress {
        &nd.progs.to_netdev
    } else {
        &nd.progs.from_netdev
    };
    p.test_run(input).unwrap().return_value as i32
}

#[test]
fn the_nodes_addresses_reach_the_host_firewall_through_their_record() {
    if !privileged() {
        return;
    }
    use crate::datapath::Datapath;
    let mut f = HostFirewall::new("hostaddrs");
    let (pins, root) = (f.pins.clone(), f.root.clone());
    let (dp, nd) = (&mut f.dp, &f.nd);
    const UNSPEC: i32 = -1;
    const SHOT: i32 = 2;
    let to = |addr: &str| netdev_verdict(nd, false, &packet(6, "10.0.0.2", addr, 40000, 22));
    let node = |i: u8| format!("10.98.0.{i}");
    let host = |dp: &mut super::datapath::BpfDatapath, i: u8, identity: u32| {
        dp.upsert_ipcache(format!("10.98.0.{i}/32").parse().unwrap(), identity)
            .unwrap()
    };
    let record = || {
        let m = MapHandle::from_pinned_path(pins.join(super::host_addrs::MAP)).unwrap();
        let v = m
            .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
            .unwrap()
            .unwrap();
        types::host_addrs4::from_bytes(&v).unwrap()
    };

    assert_eq!(to(&node(1)), UNSPEC, "no address of the node yet");
    host(dp, 1, 1);
    assert_eq!(to(&node(1)), SHOT, "the node's address: judged (isolated)");
    host(dp, 1, 1234);
    assert_eq!(to(&node(1)), UNSPEC, "another identity now: not the node's");
    assert_eq!(record().addr, [0; super::host_addrs::SLOTS]);

    // Nine addresses, one more than the slots: every one is judged.
    for i in 1..=9 {
        host(dp, i, 1);
    }
    assert_eq!(record().overflow, 1);
    for i in 1..=9 {
        assert_eq!(
            to(&node(i)),
            SHOT,
            "{} with the record overflowing",
            node(i)
        );
    }
    dp.remove_ipcache(format!("{}/32", node(4)).parse().unwrap())
        .unwrap();
    assert_eq!(record().overflow, 0, "the ninth took the freed slot");
    assert_eq!(to(&node(4)), UNSPEC, "removed");
    assert_eq!(to(&node(9)), SHOT, "the ninth, from its slot");

    // An emptied record (as a new map after an upgrade) is rebuilt on open.
    let m = MapHandle::from_pinned_path(pins.join(super::host_addrs::MAP)).unwrap();
    m.update(
        &0u32.to_ne_bytes(),
        types::host_addrs4::default().as_bytes(),
        MapFlags::ANY,
    )
    .unwrap();
    assert_eq!(to(&node(1)), UNSPEC, "emptied");
    *dp = super::datapath::BpfDatapath::open(&root).unwrap();
    for i in (1..=9).filter(|i| *i != 4) {
        assert_eq!(to(&node(i)), SHOT, "{} after the rebuild", node(i));
    }
    assert_eq!(to(&node(4)), UNSPEC);
}

/// The tunnel's port: `CILIATE_TUNNEL_PORT` (pinned against the tunnel device's
/// `VXLAN_PORT` by `endpoint::host`'s test; `datapath` does not depend on `network`).
const TUNNEL_PORT: u16 = 8472;

/// UDP to the tunnel port between this node and another (`from`, `to`).
fn tunnel_packet(from: &str, to: &str) -> Vec<u8> {
    packet(17, from, to, 40000, TUNNEL_PORT)
}

/// The tunnel between nodes is exempt from host policy for `remote-node` addresses and for
/// the tunnel's peers whatever their identity (a node of a class of cluster tiers' `nodes`
/// peers is no `remote-node`), in both directions; anyone else's packets to the tunnel port
/// meet the host policy.
#[test]
fn the_tunnel_between_nodes_is_exempt_for_its_peers_whatever_their_identity() {
    if !privileged() {
        return;
    }
    use crate::datapath::Datapath;
    use crate::policy::identity::IDENTITY_REMOTE_NODE;
    let mut f = HostFirewall::new("tunnelpeers");
    for (ip, identity) in [
        ("10.98.0.1", 1),
        ("10.98.0.2", 300), // a node of a class
        ("10.98.0.3", IDENTITY_REMOTE_NODE),
        ("10.98.0.4", 2), // world
    ] {
        f.dp.upsert_ipcache(format!("{ip}/32").parse().unwrap(), identity)
            .unwrap();
    }
    const UNSPEC: i32 = -1;
    const SHOT: i32 = 2;
    let (me, class, remote, stranger) = ("10.98.0.1", "10.98.0.2", "10.98.0.3", "10.98.0.4");
    let verdicts = |f: &HostFirewall| {
        [
            netdev_verdict(&f.nd, false, &tunnel_packet(class, me)),
            netdev_verdict(&f.nd, true, &tunnel_packet(me, class)),
        ]
    };
    assert_eq!(
        netdev_verdict(&f.nd, false, &tunnel_packet(remote, me)),
        UNSPEC
    );
    assert_eq!(
        netdev_verdict(&f.nd, true, &tunnel_packet(me, remote)),
        UNSPEC
    );
    assert_eq!(verdicts(&f), [SHOT, SHOT], "no peer yet: the host policy");
    let peers = [class.parse().unwrap()].into_iter().collect();
    assert!(super::host_firewall::sync_tunnel_peers(&f.pins, &peers).unwrap());
    assert_eq!(super::host_firewall::tunnel_peers(&f.pins), peers);
    assert_eq!(verdicts(&f), [UNSPEC, UNSPEC], "a peer: exempt both ways");
    assert_eq!(
        netdev_verdict(&f.nd, false, &tunnel_packet(stranger, me)),
        SHOT,
        "no peer, no node: the host policy"
    );
    let mut other = packet(17, class, me, 40000, 53);
    assert_eq!(
        netdev_verdict(&f.nd, false, &other),
        SHOT,
        "only the tunnel port"
    );
    // A TCP SYN to the tunnel port is no tunnel packet either.
    other[23] = 6;
    other[36..38].copy_from_slice(&TUNNEL_PORT.to_be_bytes());
    other[46] = 0x50;
    other[47] = 0x02;
    assert_eq!(netdev_verdict(&f.nd, false, &other), SHOT);
    assert!(super::host_firewall::sync_tunnel_peers(&f.pins, &Default::default()).unwrap());
    assert_eq!(verdicts(&f), [SHOT, SHOT], "no longer a peer");
}

/// An IPv4 ICMP error of `icmp_type` from `from` to `to`, quoting the first bytes of a packet
/// `quoted` (IP header and ports) as the error rules say.
fn icmp_error(from: &str, to: &str, icmp_type: u8, quoted: &[u8]) -> Vec<u8> {
    let mut p = packet(1, from, to, 0, 0);
    p.truncate(14 + 20);
    p[16..18].copy_from_slice(&((20 + 8 + 28) as u16).to_be_bytes());
    p.extend_from_slice(&[icmp_type, 4, 0, 0, 0, 0, 0x05, 0xdc]);
    p.extend_from_slice(&quoted[14..14 + 28]);
    p
}

/// ICMP errors about a connection the host endpoint tracks pass (path MTU discovery for the
/// node's own connections, the node's port unreachable for an allowed inbound datagram), as
/// Cilium's related traffic; errors quoting anything else, and other ICMP, meet the host
/// policy.
#[test]
fn icmp_errors_about_the_nodes_tracked_connections_pass_the_host_firewall() {
    if !privileged() {
        return;
    }
    use crate::datapath::{Datapath, EndpointFlags, HOST_ENDPOINT_ID};
    use crate::policy::mapstate::{ingress_key, MapDelta, MapKey};
    let mut f = HostFirewall::new("relatedicmp");
    for (ip, identity) in [("10.98.0.1", 1), ("10.98.0.5", 2000), ("10.98.0.9", 2)] {
        f.dp.upsert_ipcache(format!("{ip}/32").parse().unwrap(), identity)
            .unwrap();
    }
    let out = MapKey {
        direction: crate::policy::rule::Direction::Egress,
        identity: 2000,
        protocol: 6,
        port_lo: 443,
        port_hi: 443,
    };
    let delta = MapDelta {
        upserts: vec![(out, false), (ingress_key(2000, 17, 53, 53), false)],
        ..Default::default()
    };
    let isolated = EndpointFlags {
        ingress_default_deny: true,
        egress_default_deny: true,
        ..Default::default()
    };
    f.dp.sync_policy(HOST_ENDPOINT_ID, isolated, &delta, false)
        .unwrap();
    const UNSPEC: i32 = -1;
    const SHOT: i32 = 2;
    let (me, server, router) = ("10.98.0.1", "10.98.0.5", "10.98.0.9");
    let nd = &f.nd;

    // The node's connection out, then a router's "fragmentation needed" about it.
    let syn = packet(6, me, server, 40000, 443);
    assert_eq!(netdev_verdict(nd, true, &syn), UNSPEC, "allowed out");
    let frag_needed = icmp_error(router, me, 3, &syn);
    assert_eq!(netdev_verdict(nd, false, &frag_needed), UNSPEC, "related");
    let exceeded = icmp_error(router, me, 11, &syn);
    assert_eq!(
        netdev_verdict(nd, false, &exceeded),
        UNSPEC,
        "time exceeded too"
    );
    let other = packet(6, me, server, 40001, 443);
    assert_eq!(
        netdev_verdict(nd, false, &icmp_error(router, me, 3, &other)),
        SHOT,
        "about no tracked connection"
    );
    let mut echo = icmp_error(router, me, 8, &syn);
    echo.truncate(14 + 20 + 8);
    assert_eq!(netdev_verdict(nd, false, &echo), SHOT, "not an error");

    // An allowed datagram in; the node's port unreachable about it goes out.
    let query = packet(17, server, me, 5000, 53);
    assert_eq!(netdev_verdict(nd, false, &query), UNSPEC, "allowed in");
    let unreachable = icmp_error(me, server, 3, &query);
    assert_eq!(netdev_verdict(nd, true, &unreachable), UNSPEC, "related");
    let stray = packet(17, server, me, 5001, 54);
    assert_eq!(
        netdev_verdict(nd, true, &icmp_error(me, server, 3, &stray)),
        SHOT
    );
}

/// A pod isolated at ingress still gets the ICMP errors about its own connections (path MTU
/// discovery: a router's "fragmentation needed"), as Cilium's related traffic; errors about
/// no connection of the pod, and other ICMP, meet its policy.
#[test]
fn icmp_errors_about_a_pods_tracked_connections_pass_its_policy() {
    if !privileged() {
        return;
    }
    let mut l = load(7);
    l.tcp_80_from_400(7);
    let (pod, server, router) = ("10.0.0.1", "10.0.0.9", "10.0.0.254");
    let syn = packet(6, pod, server, 40000, 443);
    assert_eq!(l.run(true, &syn), TC_ACT_OK, "egress is not isolated");
    assert_eq!(
        l.run(false, &icmp_error(router, pod, 3, &syn)),
        TC_ACT_OK,
        "fragmentation needed about the pod's connection"
    );
    let other = packet(6, pod, server, 40001, 443);
    assert_eq!(
        l.run(false, &icmp_error(router, pod, 3, &other)),
        TC_ACT_SHOT,
        "about no connection of the pod"
    );
    let mut echo = icmp_error(router, pod, 8, &syn);
    echo.truncate(14 + 20 + 8);
    assert_eq!(l.run(false, &echo), TC_ACT_SHOT, "not an error");
}

/// The IPv6 conntrack table is preallocated for an agent with `--enable-ipv6` and allocated per
/// entry without it; switching either way carries the entries over, and a load that decides
/// nothing (an endpoint's program) takes the pinned table as it is.
#[test]
fn the_ipv6_conntrack_table_follows_enable_ipv6_and_keeps_its_entries() {
    if !privileged() {
        return;
    }
    ensure_bpffs(std::path::Path::new("/sys/fs/bpf")).unwrap();
    let pins = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/ciliate-unit-ct6-{}",
        std::process::id()
    ));
    struct Cleanup(std::path::PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(pins.clone());
    let table = || MapHandle::from_pinned_path(pins.join("conntrack6")).unwrap();
    let preallocated = || {
        let flags = table().info().unwrap().info.map_flags;
        flags & libbpf_rs::libbpf_sys::BPF_F_NO_PREALLOC == 0
    };
    let decide = |ipv6: bool| {
        let mut storage = MaybeUninit::uninit();
        super::load_program_deciding_ct6(&mut storage, &pins, 0, ipv6).unwrap();
    };
    decide(false);
    assert!(!preallocated(), "without IPv6: allocated per entry");
    let mut key = types::ct6_key {
        sport: 40001,
        dport: 80,
        protocol: 6,
        family: 6,
        endpoint_id: 7,
        ..Default::default()
    };
    key.saddr[15] = 2;
    key.daddr[15] = 1;
    let value = types::ct_value {
        last_seen_ns: 42,
        packets: 3,
        ..Default::default()
    };
    table()
        .update(key.as_bytes(), value.as_bytes(), MapFlags::ANY)
        .unwrap();
    let kept = || {
        table()
            .lookup(key.as_bytes(), MapFlags::ANY)
            .unwrap()
            .and_then(|v| types::ct_value::from_bytes(&v).map(|v| v.packets))
    };
    decide(true);
    assert!(preallocated(), "with IPv6: preallocated");
    assert_eq!(kept(), Some(3), "the entry moved into the new table");
    {
        let mut storage = MaybeUninit::uninit();
        load_program(&mut storage, &pins, 5).unwrap();
    }
    assert!(preallocated(), "an endpoint's load keeps the pinned table");
    decide(false);
    assert!(!preallocated());
    assert_eq!(kept(), Some(3), "and back");
}

/// The cookies the BPF datapath says its maps may report (what the cookie jar's sweep keeps):
/// every entry's, and the endpoint's isolation cookies, following its syncs.
#[test]
fn the_cookies_in_use_follow_the_maps_and_flags() {
    if !privileged() {
        return;
    }
    use crate::datapath::{Datapath, EndpointFlags, HOST_ENDPOINT_ID};
    use crate::policy::mapstate::{ingress_key, MapDelta};
    let mut f = HostFirewall::new("cookies");
    let (web, dns) = (
        ingress_key(2000, 6, 443, 443),
        ingress_key(2000, 17, 53, 53),
    );
    let delta = MapDelta {
        upserts: vec![(web, false), (dns, false)],
        cookies: [(web, 11), (dns, 12)].into_iter().collect(),
        ..Default::default()
    };
    let mut flags = EndpointFlags {
        ingress_default_deny: true,
        ingress_cookie: 21,
        ..Default::default()
    };
    f.dp.sync_policy(HOST_ENDPOINT_ID, flags, &delta, false)
        .unwrap();
    let in_use = |f: &HostFirewall| {
        let mut v: Vec<u32> = f.dp.cookies_in_use().into_iter().collect();
        v.sort();
        v
    };
    assert_eq!(in_use(&f), [11, 12, 21]);
    let delta = MapDelta {
        deletes: vec![dns],
        ..Default::default()
    };
    flags.ingress_cookie = 22;
    f.dp.sync_policy(HOST_ENDPOINT_ID, flags, &delta, false)
        .unwrap();
    assert_eq!(
        in_use(&f),
        [11, 22],
        "the deleted entry's and the old isolation's are gone"
    );
}
