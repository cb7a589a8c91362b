//! The BPF datapath with real packets: two "pods" in their own network namespaces, wired to the
//! host through veth pairs (host routes and proxy ARP, as Cilium does), the real programs
//! attached to the host-side veths, TCP and UDP sent between them from threads that enter the
//! namespaces with setns. Privileged: root is needed; with CI=true these tests must run. Every
//! namespace, link and pin is removed even when a test fails (guards).

mod common;

use common::netns::{
    privileged, privileged_two_pods, tcp_ok, tcp_server, udp_ok, udp_server, world,
};

use ciliate::datapath::bpf::datapath::BpfDatapath;
use ciliate::datapath::{Datapath, EndpointAttachment, EndpointFlags};
use ciliate::policy::mapstate::{MapDelta, MapKey};
use ciliate::policy::rule::{Direction, PROTO_TCP, PROTO_UDP};

fn key(direction: Direction, identity: u32, protocol: u8, lo: u16, hi: u16) -> MapKey {
    MapKey {
        direction,
        identity,
        protocol,
        port_lo: lo,
        port_hi: hi,
    }
}

fn allow(keys: &[MapKey]) -> MapDelta {
    MapDelta {
        upserts: keys.iter().map(|k| (*k, false)).collect(),
        deletes: vec![],
        ..Default::default()
    }
}

/// Each pod's address in the ipcache with its identity, and the pod attached as an endpoint.
fn attach_pods(dp: &mut BpfDatapath, pods: &[(&common::netns::Pod, u16, u32)]) {
    for (p, ep, ident) in pods {
        dp.upsert_ipcache(format!("{}/32", p.addr).parse().unwrap(), *ident)
            .unwrap();
        dp.attach_endpoint(&EndpointAttachment {
            id: *ep,
            interface: Some(p.host_if.clone()),
            ips: vec![p.addr],
            identity: *ident,
            mac: None,
        })
        .unwrap();
    }
}

const ISOLATED_IN: EndpointFlags = EndpointFlags {
    ingress_default_deny: true,
    egress_default_deny: false,
    drop_all: false,
    ingress_cookie: 0,
    egress_cookie: 0,
    audit: false,
    dns_proxy: false,
};
const ISOLATED_BOTH: EndpointFlags = EndpointFlags {
    ingress_default_deny: true,
    egress_default_deny: true,
    drop_all: false,
    ingress_cookie: 0,
    egress_cookie: 0,
    audit: false,
    dns_proxy: false,
};
const OPEN: EndpointFlags = EndpointFlags {
    ingress_default_deny: false,
    egress_default_deny: false,
    drop_all: false,
    ingress_cookie: 0,
    egress_cookie: 0,
    audit: false,
    dns_proxy: false,
};

#[test]
fn policy_on_real_veths_with_live_edits_replies_and_a_restart_without_a_gap() {
    let Some(w) = privileged_two_pods(&[8080, 9090]) else {
        return;
    };
    let (a, b) = (&w.pods[0], &w.pods[1]);
    let (id_a, id_b) = (1001u32, 1002u32);
    udp_server(&b.netns, b.addr, 5353);

    // Before anything is attached the pods talk freely.
    assert!(
        tcp_ok(&a.netns, b.addr, 8080),
        "plain routing works without the datapath"
    );

    let mut dp = BpfDatapath::open(&w.pins).expect("open the datapath");
    attach_pods(&mut dp, &[(a, 1, id_a), (b, 2, id_b)]);
    // Attached but not yet realized: fail closed.
    assert!(
        !tcp_ok(&a.netns, b.addr, 8080),
        "an endpoint drops until its policy is realized"
    );

    // b admits a on TCP 8080 and UDP 5353 only; a is not isolated.
    dp.sync_policy(1, OPEN, &MapDelta::default(), true).unwrap();
    let b_rules = [
        key(Direction::Ingress, id_a, PROTO_TCP, 8080, 8080),
        key(Direction::Ingress, id_a, PROTO_UDP, 5353, 5353),
    ];
    dp.sync_policy(2, ISOLATED_IN, &allow(&b_rules), true)
        .unwrap();
    assert!(tcp_ok(&a.netns, b.addr, 8080));
    assert!(!tcp_ok(&a.netns, b.addr, 9090));
    assert!(
        udp_ok(&a.netns, b.addr, 5353),
        "the UDP reply comes back through conntrack"
    );
    let dump = dp.dump_policy(2).unwrap();
    let counted = dump.entries.iter().find(|e| e.port == 8080).unwrap();
    assert!(counted.packets >= 1 && counted.bytes > 0, "{counted:?}");

    // A live edit: 9090 instead of 8080.
    let edit = MapDelta {
        upserts: vec![(key(Direction::Ingress, id_a, PROTO_TCP, 9090, 9090), false)],
        deletes: vec![key(Direction::Ingress, id_a, PROTO_TCP, 8080, 8080)],
        ..Default::default()
    };
    dp.sync_policy(2, ISOLATED_IN, &edit, false).unwrap();
    assert!(tcp_ok(&a.netns, b.addr, 9090));
    assert!(!tcp_ok(&a.netns, b.addr, 8080));

    // Default deny in both directions on a: only its egress rule opens the way, and the replies
    // pass under its ingress default deny.
    dp.sync_policy(
        1,
        ISOLATED_BOTH,
        &allow(&[key(Direction::Egress, id_b, PROTO_TCP, 9090, 9090)]),
        true,
    )
    .unwrap();
    assert!(tcp_ok(&a.netns, b.addr, 9090));
    assert!(
        !udp_ok(&a.netns, b.addr, 5353),
        "a's egress does not allow UDP"
    );
    // b cannot open a connection to a (a's ingress is isolated).
    tcp_server(&a.netns, a.addr, 7070);
    assert!(!tcp_ok(&b.netns, a.addr, 7070));

    // A deny beats the allow.
    dp.sync_policy(
        2,
        ISOLATED_IN,
        &MapDelta {
            upserts: vec![(key(Direction::Ingress, 0, 0, 0, 65535), true)],
            deletes: vec![],
            ..Default::default()
        },
        false,
    )
    .unwrap();
    assert!(!tcp_ok(&a.netns, b.addr, 9090));
    dp.sync_policy(
        2,
        ISOLATED_IN,
        &MapDelta {
            upserts: vec![],
            deletes: vec![key(Direction::Ingress, 0, 0, 0, 65535)],
            ..Default::default()
        },
        false,
    )
    .unwrap();
    assert!(tcp_ok(&a.netns, b.addr, 9090));

    // Attached with TCX (this kernel has it): pinned links on each host veth.
    let link = |ep: u16, dir: &str| {
        ciliate::datapath::bpf::tcx::pinned_link_info(
            &w.pins.join(format!("ciliate/link_{ep}_{dir}")),
        )
    };
    let ifindex_b = nix::net::if_::if_nametoindex(b.host_if.as_str()).unwrap();
    let before = link(2, "egress").expect("b's to_container program is a pinned TCX link");
    assert_eq!(before.0, ifindex_b, "on b's host veth");
    assert!(link(2, "ingress").is_some() && link(1, "ingress").is_some());

    // The agent goes away: enforcement stays (pinned maps, pinned links hold the programs).
    drop(dp);
    assert!(
        tcp_ok(&a.netns, b.addr, 9090),
        "allowed flows keep working while the agent is gone"
    );
    assert!(
        !tcp_ok(&a.netns, b.addr, 8080),
        "denied flows stay denied while the agent is gone"
    );

    // It comes back: reopens the pins, re-attaches, replaces the policy without a gap.
    let mut dp = BpfDatapath::open(&w.pins).expect("reopen the datapath");
    for (p, ep, ident) in [(a, 1u16, id_a), (b, 2u16, id_b)] {
        dp.attach_endpoint(&EndpointAttachment {
            id: ep,
            interface: Some(p.host_if.clone()),
            ips: vec![p.addr],
            identity: ident,
            mac: None,
        })
        .unwrap();
    }
    assert!(
        tcp_ok(&a.netns, b.addr, 9090),
        "re-attaching keeps the realized policy"
    );
    let after = link(2, "egress").expect("the link is still pinned");
    assert_eq!(after.0, ifindex_b);
    assert_eq!(
        (after.2, dp.kept_on_reattach),
        (before.2, 2),
        "the same build's running instances are kept, not reloaded"
    );
    // As an upgrade does it: a new instance swapped into the same link.
    dp.set_reuse_running_programs(false);
    dp.attach_endpoint(&EndpointAttachment {
        id: 2,
        interface: Some(b.host_if.clone()),
        ips: vec![b.addr],
        identity: id_b,
        mac: None,
    })
    .unwrap();
    let swapped = link(2, "egress").expect("the link is still pinned");
    assert_ne!(
        swapped.2, before.2,
        "the same link now runs a new program instance"
    );
    assert!(
        tcp_ok(&a.netns, b.addr, 9090),
        "and it enforces the same policy"
    );
    dp.sync_policy(
        1,
        ISOLATED_BOTH,
        &allow(&[key(Direction::Egress, id_b, PROTO_TCP, 9090, 9090)]),
        true,
    )
    .unwrap();
    dp.sync_policy(
        2,
        ISOLATED_IN,
        &allow(&[key(Direction::Ingress, id_a, PROTO_TCP, 9090, 9090)]),
        true,
    )
    .unwrap();
    assert!(tcp_ok(&a.netns, b.addr, 9090));
    assert!(!tcp_ok(&a.netns, b.addr, 8080));
    assert_eq!(
        dp.dump_policy(2).unwrap().entries.len(),
        1,
        "the replace removed what is no longer wanted"
    );

    // Detach removes the programs: the path is open again.
    dp.detach_endpoint(1).unwrap();
    dp.detach_endpoint(2).unwrap();
    assert!(
        link(2, "egress").is_none() && link(1, "ingress").is_none(),
        "links unpinned"
    );
    assert!(tcp_ok(&a.netns, b.addr, 8080));
    assert!(!w.pins.join("policy_1").exists());
}

/// A server in `b` that, for its one connection, answers `ping` and sends `push` when told to:
/// data the server initiates, which an isolated egress lets out only as part of a tracked
/// connection.
fn push_server(netns: &str, addr: std::net::IpAddr, port: u16) -> std::sync::mpsc::Sender<()> {
    use std::io::{Read, Write};
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (push_tx, push_rx) = std::sync::mpsc::channel::<()>();
    common::netns::in_netns(netns, move || {
        let l = std::net::TcpListener::bind((addr, port)).unwrap();
        ready_tx.send(()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let mut buf = [0u8; 4];
        if s.read_exact(&mut buf).is_ok() {
            let _ = s.write_all(b"pong");
        }
        while push_rx.recv().is_ok() {
            let _ = s.write_all(b"push");
        }
    });
    ready_rx.recv().unwrap();
    push_tx
}

#[test]
fn conntrack_gc_removes_expired_entries_and_keeps_live_ones() {
    use std::io::{Read, Write};
    use std::time::Duration;
    if !privileged() {
        return;
    }
    let w = world(2);
    let (a, b) = (&w.pods[0], &w.pods[1]);
    let (id_a, id_b) = (2001u32, 2002u32);
    let mut dp = BpfDatapath::open(&w.pins).expect("open the datapath");
    attach_pods(&mut dp, &[(a, 1, id_a), (b, 2, id_b)]);
    dp.sync_policy(1, OPEN, &MapDelta::default(), true).unwrap();
    // b: ingress from a on 7070 only, egress isolated.
    dp.sync_policy(
        2,
        ISOLATED_BOTH,
        &allow(&[key(Direction::Ingress, id_a, PROTO_TCP, 7070, 7070)]),
        true,
    )
    .unwrap();
    let push = push_server(&b.netns, b.addr, 7070);
    let to = std::net::SocketAddr::new(b.addr, 7070);
    let mut conn = common::netns::in_netns(&a.netns, move || {
        std::net::TcpStream::connect_timeout(&to, Duration::from_secs(1)).unwrap()
    })
    .join()
    .unwrap();
    conn.set_read_timeout(Some(Duration::from_millis(700)))
        .unwrap();
    conn.write_all(b"ping").unwrap();
    let mut buf = [0u8; 4];
    conn.read_exact(&mut buf)
        .expect("the reply passes b's isolated egress");
    assert_eq!(&buf, b"pong");

    let map = libbpf_rs::MapHandle::from_pinned_path(w.pins.join("ciliate/conntrack4")).unwrap();
    let now = ciliate::datapath::bpf::conntrack::monotonic_ns();
    // Default timeouts: a connection that just talked is kept.
    let kept = ciliate::datapath::bpf::conntrack::sweep(
        &map,
        now,
        &ciliate::datapath::ConntrackTimeouts::default(),
    );
    assert!(kept.scanned >= 2, "a's and b's entries: {kept:?}");
    assert_eq!(kept.removed, 0, "{kept:?}");
    push.send(()).unwrap();
    conn.read_exact(&mut buf)
        .expect("b may still push on the tracked connection");
    assert_eq!(&buf, b"push");

    // Zero timeouts: everything is expired and removed; b's egress now has nothing to let its
    // push out (fail closed), while a's side is re-created by its own allowed egress.
    let zero = ciliate::datapath::ConntrackTimeouts {
        tcp: Duration::ZERO,
        tcp_syn: Duration::ZERO,
        tcp_closing: Duration::ZERO,
        other: Duration::ZERO,
    };
    std::thread::sleep(Duration::from_millis(5));
    let gone = ciliate::datapath::bpf::conntrack::sweep(
        &map,
        ciliate::datapath::bpf::conntrack::monotonic_ns(),
        &zero,
    );
    assert!(gone.removed >= 2, "{gone:?}");
    assert_eq!(libbpf_rs::MapCore::keys(&map).count(), 0, "nothing left");
    push.send(()).unwrap();
    assert!(
        conn.read_exact(&mut buf).is_err(),
        "b's push is dropped: its egress permission was the expired entry"
    );
}

fn tc_filters(dev: &str) -> String {
    let out = std::process::Command::new("tc")
        .args(["filter", "show", "dev", dev, "ingress"])
        .output()
        .expect("tc (iproute2) is installed");
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn legacy_tc_attachments_are_taken_over_by_tcx_without_a_gap() {
    let Some(w) = privileged_two_pods(&[8080, 9090]) else {
        return;
    };
    let (a, b) = (&w.pods[0], &w.pods[1]);
    let (id_a, id_b) = (4001u32, 4002u32);
    let attach_all = |dp: &mut BpfDatapath| {
        attach_pods(dp, &[(a, 1, id_a), (b, 2, id_b)]);
    };
    // As an older agent did it: legacy clsact filters.
    let mut dp = BpfDatapath::open_with(
        &w.pins,
        ciliate::datapath::bpf::datapath::AttachMode::LegacyTc,
    )
    .unwrap();
    attach_all(&mut dp);
    dp.sync_policy(1, OPEN, &MapDelta::default(), true).unwrap();
    dp.sync_policy(
        2,
        ISOLATED_IN,
        &allow(&[key(Direction::Ingress, id_a, PROTO_TCP, 8080, 8080)]),
        true,
    )
    .unwrap();
    assert!(tc_filters(&a.host_if).contains("bpf"), "a legacy tc filter");
    assert!(
        !w.pins.join("ciliate/link_1_ingress").exists(),
        "no TCX link"
    );
    assert!(tcp_ok(&a.netns, b.addr, 8080));
    assert!(!tcp_ok(&a.netns, b.addr, 9090));
    drop(dp);

    // The new agent attaches with TCX while a prober keeps the allowed flow busy.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = {
        let (stop, ns, to) = (stop.clone(), a.netns.clone(), b.addr);
        std::thread::spawn(move || {
            let (mut ok, mut failed) = (0, 0);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if tcp_ok(&ns, to, 8080) {
                    ok += 1;
                } else {
                    failed += 1;
                }
            }
            (ok, failed)
        })
    };
    let mut dp = BpfDatapath::open(&w.pins).unwrap();
    attach_all(&mut dp);
    std::thread::sleep(std::time::Duration::from_millis(200));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (ok, failed) = prober.join().unwrap();
    assert!(
        ok > 0 && failed == 0,
        "the take-over broke the allowed flow ({ok} ok, {failed} failed)"
    );
    assert!(
        w.pins.join("ciliate/link_1_ingress").exists(),
        "TCX links now"
    );
    assert!(
        !tc_filters(&a.host_if).contains("bpf"),
        "the legacy filter is gone"
    );
    assert!(tcp_ok(&a.netns, b.addr, 8080));
    assert!(
        !tcp_ok(&a.netns, b.addr, 9090),
        "still enforced, now through TCX"
    );
}
