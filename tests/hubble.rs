//! Hubble's API on a real agent (interfaces.md section 15): a client generated from the
//! project's protos calls every service of an agent with the BPF datapath while pods in network
//! namespaces make real connections, over the unix socket and over TCP (plain, and TLS with a
//! certificate the test makes). It checks the flows' fields (verdict, drop reason, pods,
//! labels, identities, the deciding policies), Hubble's filters, `number`/`first`/`since`,
//! a follow stream, the status calls, the Peer service, Hubble's metrics, and that the
//! Observer and `ciliate monitor` report the same flows.
//! Privileged: with CI=true these tests must run.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ciliate::hubble::proto::{flow as fpb, observer as opb, peer as ppb};
use common::agent::{free_port, Agent};
use common::netns::{privileged, tcp_ok, tcp_server, world};
use opb::observer_client::ObserverClient;
use tonic::transport::{Channel, Endpoint};

const KNP: &str = "apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: b-from-a, namespace: x}
spec:
  podSelector: {matchLabels: {app: b}}
  policyTypes: [Ingress]
  ingress:
    - from: [{podSelector: {matchLabels: {app: a}}}]
      ports: [{port: 8080, protocol: TCP}]
";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn over_unix(path: PathBuf) -> Channel {
    Endpoint::from_static("http://hubble.local")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
        .expect("connect to hubble.sock")
}

/// Every flow `req` returns (the stream ends without follow).
async fn flows(c: &mut ObserverClient<Channel>, req: opb::GetFlowsRequest) -> Vec<fpb::Flow> {
    let mut s = c.get_flows(req).await.expect("GetFlows").into_inner();
    let mut out = Vec::new();
    while let Some(r) = s.message().await.expect("a response") {
        if let Some(opb::get_flows_response::ResponseTypes::Flow(f)) = r.response_types {
            assert_eq!(
                r.node_name, f.node_name,
                "the response names the flow's node"
            );
            out.push(*f);
        }
    }
    out
}

fn req(whitelist: Vec<fpb::FlowFilter>, blacklist: Vec<fpb::FlowFilter>) -> opb::GetFlowsRequest {
    opb::GetFlowsRequest {
        number: 1000,
        whitelist,
        blacklist,
        ..Default::default()
    }
}

fn port_of(f: &fpb::Flow) -> u32 {
    match f.l4.as_ref().and_then(|l| l.protocol.as_ref()) {
        Some(fpb::layer4::Protocol::Tcp(t)) => t.destination_port,
        _ => 0,
    }
}

fn pod(e: &Option<fpb::Endpoint>) -> String {
    e.as_ref()
        .map(|e| format!("{}/{}", e.namespace, e.pod_name))
        .unwrap_or_default()
}

fn policies(p: &[fpb::Policy]) -> Vec<String> {
    p.iter()
        .map(|p| format!("{} {}/{}", p.kind, p.namespace, p.name))
        .collect()
}

/// Three pods a, b, c in namespace x (servers on b's 8080 and 9090), the policy above, and an
/// agent with the BPF datapath serving Hubble on `extra`'s flags.
fn scene(extra: &[&str]) -> (common::netns::World, tempfile::TempDir, Agent) {
    let w = world(3);
    for port in [8080, 9090] {
        tcp_server(&w.pods[1].netns, w.pods[1].addr, port);
    }
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("manifests");
    std::fs::create_dir_all(&m).unwrap();
    let [a, b, c] = [0, 1, 2].map(|i| w.pods[i].addr.to_string());
    let cluster = common::namespace_x_with_pods(&[("a", &a), ("b", &b), ("c", &c)]);
    // b is a Deployment's pod: its ReplicaSet is named after the pod template's hash.
    let b_meta = "metadata: {name: b, namespace: x, labels: {app: b}}";
    assert_eq!(cluster.matches(b_meta).count(), 1);
    let cluster = cluster.replace(
        b_meta,
        "metadata: {name: b, namespace: x, labels: {app: b, pod-template-hash: 7c5d9f},
  ownerReferences: [{apiVersion: apps/v1, kind: ReplicaSet, name: b-7c5d9f, uid: u-b,
    controller: true}]}",
    );
    std::fs::write(m.join("cluster.yaml"), cluster).unwrap();
    std::fs::write(m.join("knp.yaml"), KNP).unwrap();
    let pins = w.pins.to_string_lossy().to_string();
    let mut args = vec!["--datapath", "bpf", "--bpf-root", pins.as_str()];
    args.extend(extra);
    let agent = Agent::start_with(tmp.path(), &args);
    for (i, name) in ["x/a", "x/b", "x/c"].iter().enumerate() {
        agent.add_endpoint(name, w.pods[i].addr, &w.pods[i].host_if);
    }
    agent.wait_realized(agent.revision());
    (w, tmp, agent)
}

fn hubble_socket(tmp: &Path) -> PathBuf {
    tmp.join("state").join("hubble.sock")
}

#[test]
fn the_observer_serves_the_agents_flows_as_hubble_does() {
    if !privileged() {
        return;
    }
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let (w, tmp, agent) = scene(&["--hubble-listen-address", &listen]);
    let (a, b, c) = (&w.pods[0], &w.pods[1], &w.pods[2]);
    let sock = hubble_socket(tmp.path());
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the socket is the agent user's alone");

    assert!(tcp_ok(&a.netns, b.addr, 8080), "a -> b:8080 is allowed");
    assert!(
        !tcp_ok(&a.netns, b.addr, 9090),
        "a -> b:9090 is denied by default"
    );
    assert!(
        !tcp_ok(&c.netns, b.addr, 8080),
        "c -> b:8080 is denied by default"
    );

    let rt = rt();
    rt.block_on(async {
        let mut unix = ObserverClient::new(over_unix(sock.clone()).await);
        let mut tcp = ObserverClient::connect(format!("http://{listen}"))
            .await
            .unwrap();
        let dropped = fpb::FlowFilter {
            verdict: vec![fpb::Verdict::Dropped as i32],
            destination_port: vec!["9090".into()],
            ..Default::default()
        };
        // The drop arrives through the datapath's event batching (a millisecond) and the ring.
        let deadline = Instant::now() + Duration::from_secs(10);
        let denied = loop {
            let got = flows(&mut unix, req(vec![dropped.clone()], vec![])).await;
            if let Some(f) = got.into_iter().find(|f| pod(&f.source) == "x/a") {
                break f;
            }
            assert!(
                Instant::now() < deadline,
                "no drop of a -> b:9090 in GetFlows"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(pod(&denied.destination), "x/b");
        // Workloads from the pods' controllers: b's Deployment; a has no controller.
        let b_deployment = fpb::Workload {
            name: "b".into(),
            kind: "Deployment".into(),
        };
        assert_eq!(
            denied.destination.as_ref().unwrap().workloads,
            std::slice::from_ref(&b_deployment)
        );
        assert!(denied.source.as_ref().unwrap().workloads.is_empty());
        let to_deployment = |kind: &str| fpb::FlowFilter {
            destination_workload: vec![fpb::Workload {
                kind: kind.into(),
                ..b_deployment.clone()
            }],
            ..dropped.clone()
        };
        assert!(
            !flows(&mut unix, req(vec![to_deployment("Deployment")], vec![]))
                .await
                .is_empty()
        );
        assert!(
            flows(&mut unix, req(vec![to_deployment("StatefulSet")], vec![]))
                .await
                .is_empty()
        );
        assert_eq!(
            denied.traffic_direction,
            fpb::TrafficDirection::Ingress as i32
        );
        assert_eq!(
            denied.drop_reason_desc,
            fpb::DropReason::PolicyDenied as i32
        );
        assert_eq!(
            denied.event_type.as_ref().unwrap().r#type,
            5,
            "a policy verdict"
        );
        assert_eq!(denied.r#type, fpb::FlowType::L3L4 as i32);
        // The packet judged: from the client's ephemeral port, a SYN.
        let Some(fpb::layer4::Protocol::Tcp(t)) = denied.l4.as_ref().and_then(|l| l.protocol)
        else {
            panic!("not TCP: {denied:?}")
        };
        assert!(t.source_port >= 1024, "{t:?}");
        let flags = t.flags.expect("TCP flags");
        assert!(flags.syn && !flags.ack, "{flags:?}");
        // Hubble's TCP flags filter: every flag asked for is set.
        let syn = |f: fpb::TcpFlags| fpb::FlowFilter {
            tcp_flags: vec![f],
            ..dropped.clone()
        };
        let with_syn = syn(fpb::TcpFlags {
            syn: true,
            ..Default::default()
        });
        let with_ack = syn(fpb::TcpFlags {
            syn: true,
            ack: true,
            ..Default::default()
        });
        assert!(!flows(&mut unix, req(vec![with_syn], vec![]))
            .await
            .is_empty());
        assert!(flows(&mut unix, req(vec![with_ack], vec![]))
            .await
            .is_empty());
        // And the source port, as Hubble's `--from-port`.
        let from_port = fpb::FlowFilter {
            source_port: vec![t.source_port.to_string()],
            ..dropped.clone()
        };
        let same = flows(&mut unix, req(vec![from_port], vec![])).await;
        assert!(same.iter().any(|f| f.uuid == denied.uuid), "{same:?}");
        assert_eq!(denied.node_name, "node-1");
        assert_eq!(denied.is_reply, Some(false));
        assert_eq!(denied.ip.as_ref().unwrap().source, a.addr.to_string());
        let (src, dst) = (
            denied.source.as_ref().unwrap(),
            denied.destination.as_ref().unwrap(),
        );
        assert!(src.labels.contains(&"k8s:app=a".to_string()), "{src:?}");
        assert!(dst.labels.contains(&"k8s:app=b".to_string()), "{dst:?}");
        assert!(
            src.identity >= 256 && dst.identity >= 256,
            "{src:?} {dst:?}"
        );
        assert_ne!(dst.id, 0, "the endpoint that judged it");
        assert_eq!(
            policies(&denied.ingress_denied_by),
            ["NetworkPolicy x/b-from-a"],
            "a default deny names the policy that isolates b"
        );
        assert!(
            denied.summary.contains("default deny"),
            "{}",
            denied.summary
        );

        // The allowed connection names its policy and how it matched.
        let allowed = fpb::FlowFilter {
            verdict: vec![fpb::Verdict::Forwarded as i32],
            source_pod: vec!["x/a".into()],
            destination_port: vec!["8080".into()],
            event_type: vec![fpb::EventTypeFilter {
                r#type: 5,
                ..Default::default()
            }],
            ..Default::default()
        };
        let ok = flows(&mut tcp, req(vec![allowed], vec![])).await;
        let ingress: Vec<_> = ok
            .iter()
            .filter(|f| f.traffic_direction == fpb::TrafficDirection::Ingress as i32)
            .collect();
        assert_eq!(ingress.len(), 1, "{ok:#?}");
        assert_eq!(
            policies(&ingress[0].ingress_allowed_by),
            ["NetworkPolicy x/b-from-a"]
        );
        assert_eq!(ingress[0].policy_match_type, 2, "L3 and L4");

        // Labels as selectors, identities, IPs, the blacklist, event types.
        let from_c = fpb::FlowFilter {
            source_label: vec!["k8s:app=c".into()],
            ..Default::default()
        };
        let got = flows(&mut tcp, req(vec![from_c], vec![])).await;
        assert!(!got.is_empty());
        assert!(got.iter().all(|f| pod(&f.source) == "x/c"), "{got:#?}");
        let b_identity = dst.identity;
        let to_b = fpb::FlowFilter {
            destination_identity: vec![b_identity],
            destination_ip: vec![format!("{}/32", b.addr)],
            ..Default::default()
        };
        let not_dropped = fpb::FlowFilter {
            verdict: vec![fpb::Verdict::Dropped as i32],
            ..Default::default()
        };
        let got = flows(&mut tcp, req(vec![to_b.clone()], vec![not_dropped])).await;
        assert!(!got.is_empty());
        assert!(got
            .iter()
            .all(|f| f.verdict == fpb::Verdict::Forwarded as i32 && pod(&f.destination) == "x/b"));
        let drops_of_b = fpb::FlowFilter {
            event_type: vec![fpb::EventTypeFilter {
                r#type: 1,
                ..Default::default()
            }],
            ..to_b
        };
        let got = flows(&mut tcp, req(vec![drops_of_b], vec![])).await;
        let ports: std::collections::BTreeSet<_> = got.iter().map(port_of).collect();
        assert_eq!(
            ports,
            [8080, 9090].into(),
            "both drops count as drops: {got:#?}"
        );

        // number / first / since / until.
        // (Taken again until no flow came in between.)
        let (all, last2, first1) = loop {
            let all = flows(&mut tcp, req(vec![], vec![])).await;
            let last = opb::GetFlowsRequest {
                number: 2,
                ..Default::default()
            };
            let last2 = flows(&mut tcp, last).await;
            let first = opb::GetFlowsRequest {
                number: 1,
                first: true,
                ..Default::default()
            };
            let first1 = flows(&mut tcp, first).await;
            if flows(&mut tcp, req(vec![], vec![])).await == all {
                break (all, last2, first1);
            }
        };
        assert!(all.len() >= 4, "{all:#?}");
        assert_eq!(
            last2,
            all[all.len() - 2..].to_vec(),
            "the last two, oldest first"
        );
        assert_eq!(first1, all[..1].to_vec());
        let future = prost_types::Timestamp {
            seconds: all.last().unwrap().time.unwrap().seconds + 3600,
            nanos: 0,
        };
        let later = flows(
            &mut tcp,
            opb::GetFlowsRequest {
                since: Some(future),
                ..Default::default()
            },
        )
        .await;
        assert!(later.is_empty());
        let before = flows(
            &mut tcp,
            opb::GetFlowsRequest {
                until: Some(all[0].time.unwrap()),
                ..Default::default()
            },
        )
        .await;
        assert!(!before.is_empty() && before.len() < all.len());

        // A bad filter is refused, naming the field.
        let bad = fpb::FlowFilter {
            source_ip: vec!["10.0.0.300".into()],
            ..Default::default()
        };
        let err = tcp.get_flows(req(vec![bad], vec![])).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("whitelist[0].source_ip"), "{err}");

        // A follow stream gets the next matching flow as it happens.
        let follow = opb::GetFlowsRequest {
            follow: true,
            whitelist: vec![fpb::FlowFilter {
                source_pod: vec!["x/c".into()],
                destination_port: vec!["9090".into()],
                // (c's own egress is forwarded: no policy selects c.)
                traffic_direction: vec![fpb::TrafficDirection::Ingress as i32],
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut stream = tcp.get_flows(follow).await.unwrap().into_inner();
        let c_ns = c.netns.clone();
        let b_addr = b.addr;
        let probe = tokio::task::spawn_blocking(move || tcp_ok(&c_ns, b_addr, 9090));
        let next = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("a followed flow within 10 s")
            .unwrap()
            .unwrap();
        assert!(!probe.await.unwrap());
        match next.response_types {
            Some(opb::get_flows_response::ResponseTypes::Flow(f)) => {
                assert_eq!((pod(&f.source), port_of(&f)), ("x/c".into(), 9090));
                assert_eq!(f.verdict, fpb::Verdict::Dropped as i32);
            }
            other => panic!("{other:?}"),
        }
        std::mem::drop(stream);

        // A client holds at most MAX_STREAMS streams of the agent; a place frees when its
        // stream's client goes.
        let max = ciliate::hubble::server::MAX_STREAMS;
        let follow_all = || opb::GetFlowsRequest {
            follow: true,
            ..Default::default()
        };
        let mut held = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while held.len() < max {
            match tcp.get_flows(follow_all()).await {
                Ok(s) => held.push(s.into_inner()),
                // The place of the stream dropped above may not be free yet.
                Err(e) if Instant::now() < deadline => {
                    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("stream {} of {max}: {e}", held.len() + 1),
            }
        }
        let err = tcp.get_flows(follow_all()).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
        held.pop();
        let deadline = Instant::now() + Duration::from_secs(5);
        let again = loop {
            match tcp.get_flows(follow_all()).await {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(e) => panic!("a freed place is not taken again: {e}"),
            }
        };
        std::mem::drop((held, again));
        // (Their places free as the agent sees the streams reset.)
        tokio::time::sleep(Duration::from_millis(300)).await;

        // Status, nodes, namespaces.
        let st = tcp
            .server_status(opb::ServerStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        assert!(
            st.num_flows >= all.len() as u64 && st.seen_flows >= st.num_flows,
            "{st:?}"
        );
        assert_eq!(st.max_flows, 16_384);
        assert_eq!(st.num_connected_nodes, Some(1));
        assert!(st.uptime_ns > 0 && !st.version.is_empty());
        let nodes = tcp
            .get_nodes(opb::GetNodesRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(nodes.nodes.len(), 1);
        assert_eq!(nodes.nodes[0].name, "node-1");
        assert_eq!(nodes.nodes[0].state, 1, "connected");
        let ns = tcp
            .get_namespaces(opb::GetNamespacesRequest {})
            .await
            .unwrap()
            .into_inner();
        let names: Vec<_> = ns.namespaces.iter().map(|n| n.namespace.as_str()).collect();
        assert_eq!(names, ["x"]);

        // The Peer service lists this node.
        let mut peer = ppb::peer_client::PeerClient::new(over_unix(sock.clone()).await);
        let mut changes = peer
            .notify(ppb::NotifyRequest {})
            .await
            .unwrap()
            .into_inner();
        let first = tokio::time::timeout(Duration::from_secs(5), changes.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(first.name, "node-1");
        assert_eq!(first.r#type, ppb::ChangeNotificationType::PeerAdded as i32);
        assert_eq!(first.address, listen, "the named address");

        // The Observer and `ciliate monitor` report the same flows: the same records.
        let ours: std::collections::BTreeSet<(String, String, u32, i32)> = all
            .iter()
            .map(|f| {
                let ip = f.ip.clone().unwrap();
                (ip.source, ip.destination, port_of(f), f.verdict)
            })
            .collect();
        let (code, out, err) = agent.cli(&[
            "monitor",
            "-o",
            "json",
            "--since",
            "1h",
            "--count",
            &all.len().to_string(),
        ]);
        assert_eq!(code, 0, "{err}");
        let theirs: std::collections::BTreeSet<(String, String, u32, i32)> = out
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["type"] == "flow")
            .map(|v| {
                let verdict = match v["verdict"].as_str() {
                    Some("forwarded") => fpb::Verdict::Forwarded,
                    Some("dropped") => fpb::Verdict::Dropped,
                    _ => fpb::Verdict::Audit,
                } as i32;
                (
                    v["source"].as_str().unwrap().to_string(),
                    v["destination"].as_str().unwrap().to_string(),
                    v["port"].as_u64().unwrap() as u32,
                    verdict,
                )
            })
            .collect();
        assert_eq!(ours, theirs);
    });

    // Hubble's metrics, with Hubble's names and labels.
    let (_, metrics) = agent.http_get("/metrics");
    for line in [
        "hubble_flows_processed_total{type=\"PolicyVerdict\",subtype=\"\",verdict=\"DROPPED\"}",
        "hubble_drop_total{reason=\"POLICY_DENIED\",protocol=\"TCP\"}",
        "hubble_policy_verdicts_total{direction=\"ingress\",match=\"l3-l4\",action=\"forwarded\"}",
    ] {
        assert!(metrics.contains(line), "{line} in:\n{metrics}");
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, and a certificate it signed for each name (key `NAME.key`, certificate `NAME.crt`,
/// subject alternative name `DNS:NAME`).
fn certificates(dir: &Path, names: &[&str]) {
    let named: Vec<(&str, String)> = names.iter().map(|n| (*n, format!("DNS:{n}"))).collect();
    certificates_with(dir, &named);
}

/// A CA, and a certificate it signed for each (file name, subject alternative names).
fn certificates_with(dir: &Path, names: &[(&str, String)]) {
    let run = |cmd: String| openssl(dir, &cmd.split_whitespace().collect::<Vec<_>>());
    let ec = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes";
    run(format!(
        "req -x509 {ec} -keyout ca.key -out ca.crt -days 1 -subj /CN=test-ca"
    ));
    for (name, sans) in names {
        run(format!(
            "req {ec} -keyout {name}.key -out {name}.csr -subj /CN={name}"
        ));
        let ext = dir.join(format!("{name}.ext"));
        std::fs::write(&ext, format!("subjectAltName={sans}\n")).unwrap();
        run(format!(
            "x509 -req -in {name}.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out {name}.crt \
             -days 1 -extfile {}",
            ext.display()
        ));
    }
}

/// With certificate files the TCP listener speaks TLS only, and with client CAs it requires a
/// client certificate they signed; the Peer service then says TLS and the server name.
#[test]
fn tls_from_certificate_files_and_client_certificates() {
    if !privileged() {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    let server = "node-1.default.hubble-grpc.cilium.io";
    certificates(certs.path(), &[server, "client"]);
    let file = |n: &str| certs.path().join(n).to_string_lossy().to_string();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let (cert, key, ca) = (
        file(&format!("{server}.crt")),
        file(&format!("{server}.key")),
        file("ca.crt"),
    );
    let (_w, tmp, _agent) = scene(&[
        "--hubble-listen-address",
        &listen,
        "--hubble-tls-cert-file",
        &cert,
        "--hubble-tls-key-file",
        &key,
        "--hubble-tls-client-ca-files",
        &ca,
    ]);
    rt().block_on(async {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        let ca = Certificate::from_pem(std::fs::read(file("ca.crt")).unwrap());
        let tls = |with_client: bool| {
            let t = ClientTlsConfig::new()
                .ca_certificate(ca.clone())
                .domain_name(server);
            if with_client {
                let id = Identity::from_pem(
                    std::fs::read(file("client.crt")).unwrap(),
                    std::fs::read(file("client.key")).unwrap(),
                );
                t.identity(id)
            } else {
                t
            }
        };
        let url = format!("https://{listen}");
        let ch = Endpoint::from_shared(url.clone())
            .unwrap()
            .tls_config(tls(true))
            .unwrap();
        let mut c = ObserverClient::new(ch.connect().await.expect("a TLS connection"));
        let st = c
            .server_status(opb::ServerStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(st.max_flows, 16_384);
        let nodes = c
            .get_nodes(opb::GetNodesRequest {})
            .await
            .unwrap()
            .into_inner();
        let t = nodes.nodes[0].tls.clone().unwrap();
        assert!(t.enabled);
        assert_eq!(t.server_name, server);

        // Without a client certificate: refused.
        let ch = Endpoint::from_shared(url)
            .unwrap()
            .tls_config(tls(false))
            .unwrap();
        let refused = match ch.connect().await {
            Err(_) => true,
            Ok(ch) => ObserverClient::new(ch)
                .server_status(opb::ServerStatusRequest {})
                .await
                .is_err(),
        };
        assert!(refused, "a client without a certificate is refused");
        // Plain text: refused.
        let plain = match Endpoint::from_shared(format!("http://{listen}"))
            .unwrap()
            .connect()
            .await
        {
            Err(_) => true,
            Ok(ch) => ObserverClient::new(ch)
                .server_status(opb::ServerStatusRequest {})
                .await
                .is_err(),
        };
        assert!(plain, "plain text is refused on a TLS listener");
        // The socket stays plain (the agent user's alone).
        let mut unix = ObserverClient::new(over_unix(hubble_socket(tmp.path())).await);
        assert!(unix
            .server_status(opb::ServerStatusRequest {})
            .await
            .is_ok());
    });
}

/// A bad Hubble flag stops the start with the flag named (exit 1 for a file that cannot be
/// read, 2 for a malformed address).
#[test]
fn bad_hubble_flags_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(tmp.path().join("manifests")).unwrap();
    let run = |args: &[&str]| {
        let socket = tmp.path().join("ciliate.sock");
        let debug = format!("127.0.0.1:{}", free_port());
        let m = tmp.path().join("manifests");
        let mut all = vec![
            "--mode",
            "standalone",
            "--datapath",
            "memory",
            "--manifests",
            m.to_str().unwrap(),
        ];
        all.extend(args);
        Agent::command(tmp.path(), &socket, &debug, &all)
            .output()
            .unwrap()
    };
    let out = run(&["--hubble-listen-address", "4244"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--hubble-listen-address"));
    let listen = format!("127.0.0.1:{}", free_port());
    let out = run(&[
        "--hubble-listen-address",
        &listen,
        "--hubble-tls-cert-file",
        "/nonexistent/cert.pem",
        "--hubble-tls-key-file",
        "/nonexistent/key.pem",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--hubble-tls-cert-file /nonexistent/cert.pem"),
        "{err}"
    );
}

/// `ciliate relay` in the cluster harness's API namespace, on the bridge with the nodes.
struct RelayProcess(std::process::Child);

impl RelayProcess {
    fn start(c: &common::cluster::Cluster, listen: &str, extra: &[&str]) -> RelayProcess {
        use std::os::unix::process::CommandExt;
        let ns = std::fs::File::open(format!("/run/netns/{}", c.api_ns)).expect("netns");
        let fd = std::os::fd::AsRawFd::as_raw_fd(&ns);
        let peer = format!("{}:4244", common::cluster::node_ip(1));
        let log =
            std::fs::File::create(c.dir.path().join(format!("relay-{}.log", free_port()))).unwrap();
        let mut cmd = std::process::Command::new(common::agent::BIN);
        cmd.args(["relay", "--peer-service", &peer, "--listen-address", listen])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(log);
        // SAFETY: setns is async-signal-safe; the descriptor outlives the spawn.
        unsafe {
            cmd.pre_exec(move || {
                if nix::libc::setns(fd, nix::libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("ciliate relay");
        drop(ns);
        RelayProcess(child)
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The node status events and flows of a response stream, as they come.
fn status_of(r: &opb::GetFlowsResponse) -> Option<(i32, Vec<String>)> {
    match &r.response_types {
        Some(opb::get_flows_response::ResponseTypes::NodeStatus(s)) => {
            Some((s.state_change, s.node_names.clone()))
        }
        _ => None,
    }
}

/// Waits on a followed stream for a response `pred` accepts (10 s at most).
async fn next_matching(
    s: &mut tonic::Streaming<opb::GetFlowsResponse>,
    what: &str,
    pred: impl Fn(&opb::GetFlowsResponse) -> bool,
) -> opb::GetFlowsResponse {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let r = tokio::time::timeout_at(deadline, s.message())
            .await
            .unwrap_or_else(|_| panic!("nothing for {what} within 15 s"))
            .expect("the stream stays up")
            .expect("the stream goes on");
        if pred(&r) {
            return r;
        }
    }
}

/// The relay over a three-node cluster: it learns the nodes from one agent's Peer service, serves
/// every node's flows in time order with their node names and policies, reports each node's
/// state, and a following stream survives `kill -9` of an agent: the node is reported
/// unavailable, then connected again, and its flows come through the same stream afterwards.
#[test]
fn the_relay_serves_the_clusters_flows_and_survives_an_agent_going_away() {
    use common::cluster::Cluster;
    if !privileged() {
        return;
    }
    let mut c = Cluster::start_with(3, &["--hubble-listen-address", ":4244"]);
    let a = c.add_pod(1, "a", "a");
    let b = c.add_pod(2, "b", "b");
    let d = c.add_pod(3, "d", "d");
    let (b_addr, d_addr) = (std::net::IpAddr::V4(b.addr), std::net::IpAddr::V4(d.addr));
    for port in [8080, 9090] {
        tcp_server(&b.netns, b_addr, port);
        tcp_server(&d.netns, d_addr, port);
    }
    // b (node-2) and d (node-3) admit a on 8080 only.
    let policy: serde_json::Value = serde_yaml::from_str(KNP).unwrap();
    c.api().apply_json(policy).expect("the NetworkPolicy");
    let d_policy = KNP
        .replace("b-from-a", "d-from-a")
        .replace("app: b", "app: d");
    let d_policy: serde_json::Value = serde_yaml::from_str(&d_policy).unwrap();
    c.api()
        .apply_json(d_policy)
        .expect("the NetworkPolicy of d");
    for addr in [b_addr, d_addr] {
        common::eventually("a reaches 8080 across nodes", || {
            tcp_ok(&a.netns, addr, 8080)
        });
        common::eventually("a -> 9090 is dropped", || !tcp_ok(&a.netns, addr, 9090));
    }

    let _relay = RelayProcess::start(&c, "127.0.0.1:4245", &[]);
    let kubeconfig = c.kubeconfig.clone();
    let (a_ns, api_ns) = (a.netns.clone(), c.api_ns.clone());
    // The client runs beside the relay, in the API namespace.
    let (to_main, from_client) = std::sync::mpsc::channel::<&'static str>();
    let (to_client, from_main) = std::sync::mpsc::channel::<()>();
    let client = common::netns::in_netns(&api_ns, move || {
        rt().block_on(async move {
            let connect = || async {
                let ep = Endpoint::from_static("http://127.0.0.1:4245");
                for _ in 0..100 {
                    if let Ok(ch) = ep.connect().await {
                        return ObserverClient::new(ch);
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                panic!("the relay does not listen");
            };
            let mut relay = connect().await;
            // Every node, once the Peer service has named them.
            let deadline = Instant::now() + Duration::from_secs(20);
            let nodes = loop {
                let n = relay
                    .get_nodes(opb::GetNodesRequest {})
                    .await
                    .unwrap()
                    .into_inner();
                if n.nodes.len() == 3 && n.nodes.iter().all(|n| n.state == 1) {
                    break n.nodes;
                }
                assert!(
                    Instant::now() < deadline,
                    "the relay knows every node: {n:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
            let names: Vec<_> = nodes.iter().map(|n| n.name.as_str()).collect();
            assert_eq!(names, ["node-1", "node-2", "node-3"]);
            assert_eq!(nodes[1].address, "172.20.0.12:4244");
            assert!(nodes.iter().all(|n| n.max_flows == 16_384));

            // History: every node's flows, in time order, each named by its node.
            let mut s = relay
                .get_flows(req(vec![], vec![]))
                .await
                .unwrap()
                .into_inner();
            let (mut statuses, mut got) = (Vec::new(), Vec::new());
            while let Some(r) = s.message().await.unwrap() {
                match status_of(&r) {
                    Some(st) => statuses.push(st),
                    None => got.push(r),
                }
            }
            let every = ["node-1", "node-2", "node-3"].map(String::from).to_vec();
            assert_eq!(statuses, [(1, every)]);
            let times: Vec<_> = got
                .iter()
                .map(|r| r.time.map(|t| (t.seconds, t.nanos)))
                .collect();
            let mut sorted = times.clone();
            sorted.sort();
            assert_eq!(times, sorted, "in time order");
            let flows: Vec<(String, fpb::Flow)> = got
                .into_iter()
                .filter_map(|r| match r.response_types {
                    Some(opb::get_flows_response::ResponseTypes::Flow(f)) => {
                        Some((r.node_name, *f))
                    }
                    _ => None,
                })
                .collect();
            let from = |node: &str| {
                flows
                    .iter()
                    .filter(|(n, f)| n == node && f.node_name == node)
                    .count()
            };
            assert!(
                (1..=3).all(|i| from(&format!("node-{i}")) > 0),
                "{flows:#?}"
            );
            let denied = flows
                .iter()
                .find(|(n, f)| {
                    n == "node-2" && port_of(f) == 9090 && f.verdict == fpb::Verdict::Dropped as i32
                })
                .expect("node-2's drop of a -> b:9090");
            assert_eq!(
                policies(&denied.1.ingress_denied_by),
                ["NetworkPolicy x/b-from-a"]
            );
            let st = relay
                .server_status(opb::ServerStatusRequest {})
                .await
                .unwrap()
                .into_inner();
            assert_eq!(
                (st.num_connected_nodes, st.num_unavailable_nodes),
                (Some(3), Some(0))
            );
            assert_eq!(st.max_flows, 3 * 16_384);

            // A following stream across kill -9 and restart of node-2's agent.
            let follow = opb::GetFlowsRequest {
                follow: true,
                whitelist: vec![fpb::FlowFilter {
                    destination_port: vec!["9090".into()],
                    verdict: vec![fpb::Verdict::Dropped as i32],
                    ..Default::default()
                }],
                ..Default::default()
            };
            let mut s = relay.get_flows(follow).await.unwrap().into_inner();
            let mut connected = std::collections::BTreeSet::new();
            while connected.len() < 3 {
                let r = next_matching(&mut s, "every node connected", |r| {
                    status_of(r).is_some_and(|(state, _)| state == 1)
                })
                .await;
                connected.extend(status_of(&r).unwrap().1);
            }
            to_main.send("kill").unwrap();
            from_main.recv().unwrap();
            next_matching(&mut s, "node-2 unavailable", |r| {
                status_of(r) == Some((2, vec!["node-2".to_string()]))
            })
            .await;
            let n = relay
                .get_nodes(opb::GetNodesRequest {})
                .await
                .unwrap()
                .into_inner();
            assert_eq!(
                n.nodes.iter().map(|n| n.state).collect::<Vec<_>>(),
                [1, 2, 1]
            );
            let st = relay
                .server_status(opb::ServerStatusRequest {})
                .await
                .unwrap()
                .into_inner();
            assert_eq!(st.unavailable_nodes, ["node-2"]);
            // The stream goes on with the other nodes meanwhile.
            to_main.send("probe-d").unwrap();
            from_main.recv().unwrap();
            next_matching(&mut s, "node-3's drop while node-2 is away", |r| {
                r.node_name == "node-3"
            })
            .await;
            to_main.send("restart").unwrap();
            from_main.recv().unwrap();
            next_matching(&mut s, "node-2 connected again", |r| {
                status_of(r) == Some((1, vec!["node-2".to_string()]))
            })
            .await;
            to_main.send("probe").unwrap();
            from_main.recv().unwrap();
            let r = next_matching(&mut s, "node-2's drop after its return", |r| {
                r.node_name == "node-2"
            })
            .await;
            match r.response_types {
                Some(opb::get_flows_response::ResponseTypes::Flow(f)) => {
                    assert_eq!(
                        (port_of(&f), f.verdict),
                        (9090, fpb::Verdict::Dropped as i32)
                    )
                }
                other => panic!("{other:?}"),
            }
            to_main.send("done").unwrap();
        })
    });
    loop {
        match from_client.recv_timeout(Duration::from_secs(120)) {
            Ok("kill") => c.node(2).kill9_agent(),
            Ok("restart") => c.node(2).start_agent(&kubeconfig),
            Ok("probe") => assert!(!tcp_ok(&a_ns, b_addr, 9090)),
            Ok("probe-d") => assert!(!tcp_ok(&a_ns, d_addr, 9090)),
            Ok(_) => break,
            Err(e) => {
                let _ = client.join();
                panic!("the client stopped: {e}");
            }
        }
        to_client.send(()).unwrap();
    }
    client.join().expect("the client's checks");
}

/// The relay toward agents that serve TLS and require client certificates: with the agents' CA
/// and its client certificate it reaches both nodes (the Peer service checked against the
/// address it dials, each agent against the server name its Peer entry gives); without the
/// client certificate the agents refuse it, and it names no node connected.
#[test]
fn the_relay_dials_tls_agents_with_its_client_certificate() {
    use common::cluster::{node_ip, Cluster};
    if !privileged() {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    // One certificate for every agent, as `make hubble-certs` makes it (a wildcard for the
    // nodes' server names), and the address the relay dials the Peer service at.
    let sans = format!("DNS:*.default.hubble-grpc.cilium.io,IP:{}", node_ip(1));
    let relay_san = "DNS:hubble-relay".to_string();
    certificates_with(certs.path(), &[("agent", sans), ("relay", relay_san)]);
    let file = |n: &str| certs.path().join(n).to_string_lossy().to_string();
    let (cert, key, ca) = (file("agent.crt"), file("agent.key"), file("ca.crt"));
    let mut c = Cluster::start_with(
        2,
        &[
            "--hubble-listen-address",
            ":4244",
            "--hubble-tls-cert-file",
            &cert,
            "--hubble-tls-key-file",
            &key,
            "--hubble-tls-client-ca-files",
            &ca,
        ],
    );
    let a = c.add_pod(1, "a", "a");
    let b = c.add_pod(2, "b", "b");
    let b_addr = std::net::IpAddr::V4(b.addr);
    tcp_server(&b.netns, b_addr, 8080);
    common::eventually("a reaches b:8080 across nodes", || {
        tcp_ok(&a.netns, b_addr, 8080)
    });

    let (rcert, rkey) = (file("relay.crt"), file("relay.key"));
    let tls = ["--tls-hubble-server-ca-files", ca.as_str()];
    let client = [
        "--tls-client-cert-file",
        &rcert,
        "--tls-client-key-file",
        &rkey,
    ];
    let _good = RelayProcess::start(&c, "127.0.0.1:4245", &[&tls[..], &client[..]].concat());
    let _without = RelayProcess::start(&c, "127.0.0.1:4246", &tls);
    let api_ns = c.api_ns.clone();
    common::netns::in_netns(&api_ns, move || {
        rt().block_on(async move {
            let connect = |port: u16| async move {
                let ep = Endpoint::from_shared(format!("http://127.0.0.1:{port}")).unwrap();
                for _ in 0..100 {
                    if let Ok(ch) = ep.connect().await {
                        return ObserverClient::new(ch);
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                panic!("the relay on {port} does not listen");
            };
            // Both nodes connected, once the Peer service has named them.
            let mut good = connect(4245).await;
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let n = good.get_nodes(opb::GetNodesRequest {}).await.unwrap();
                let states: Vec<i32> = n.into_inner().nodes.iter().map(|n| n.state).collect();
                if states == [1, 1] {
                    break;
                }
                assert!(Instant::now() < deadline, "both nodes over TLS: {states:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let got = flows(&mut good, req(vec![], vec![])).await;
            assert!(got.iter().any(|f| f.node_name == "node-1"), "{got:#?}");
            assert!(got.iter().any(|f| f.node_name == "node-2"), "{got:#?}");

            // Without a client certificate the agents (the Peer service among them) refuse it.
            let mut without = connect(4246).await;
            tokio::time::sleep(Duration::from_secs(2)).await;
            let n = without.get_nodes(opb::GetNodesRequest {}).await.unwrap();
            let n = n.into_inner();
            assert!(n.nodes.iter().all(|n| n.state != 1), "{n:?}");
            let st = without
                .server_status(opb::ServerStatusRequest {})
                .await
                .unwrap()
                .into_inner();
            assert_eq!(st.num_connected_nodes, Some(0), "{st:?}");
        })
    })
    .join()
    .expect("the client's checks");
}

/// Cilium's `api/v1` field numbers and types of every field `proto/` declares (transcribed from
/// Cilium's flow, observer, peer and relay protos): `message field number type`. A field of
/// ours missing here, or numbered or typed otherwise, breaks wire compatibility with Hubble's
/// clients.
const CILIUM_FIELDS: &str = "
flow.Flow time 1 .google.protobuf.Timestamp
flow.Flow uuid 34 string
flow.Flow verdict 2 .flow.Verdict
flow.Flow drop_reason 3 uint32
flow.Flow IP 5 .flow.IP
flow.Flow l4 6 .flow.Layer4
flow.Flow source 8 .flow.Endpoint
flow.Flow destination 9 .flow.Endpoint
flow.Flow Type 10 .flow.FlowType
flow.Flow node_name 11 string
flow.Flow source_names 13 string
flow.Flow destination_names 14 string
flow.Flow l7 15 .flow.Layer7
flow.Flow reply 16 bool
flow.Flow event_type 19 .flow.CiliumEventType
flow.Flow source_service 20 .flow.Service
flow.Flow destination_service 21 .flow.Service
flow.Flow traffic_direction 22 .flow.TrafficDirection
flow.Flow policy_match_type 23 uint32
flow.Flow trace_observation_point 24 .flow.TraceObservationPoint
flow.Flow drop_reason_desc 25 .flow.DropReason
flow.Flow is_reply 26 .google.protobuf.BoolValue
flow.Flow egress_allowed_by 21001 .flow.Policy
flow.Flow ingress_allowed_by 21002 .flow.Policy
flow.Flow egress_denied_by 21004 .flow.Policy
flow.Flow ingress_denied_by 21005 .flow.Policy
flow.Flow Summary 100000 string
flow.Layer4 TCP 1 .flow.TCP
flow.Layer4 UDP 2 .flow.UDP
flow.Layer4 ICMPv4 3 .flow.ICMPv4
flow.Layer4 ICMPv6 4 .flow.ICMPv6
flow.Layer4 SCTP 5 .flow.SCTP
flow.Layer7 type 1 .flow.L7FlowType
flow.Layer7 latency_ns 2 uint64
flow.Layer7 dns 100 .flow.DNS
flow.Layer7 http 101 .flow.HTTP
flow.Endpoint ID 1 uint32
flow.Endpoint identity 2 uint32
flow.Endpoint namespace 3 string
flow.Endpoint labels 4 string
flow.Endpoint pod_name 5 string
flow.Endpoint workloads 6 .flow.Workload
flow.Workload name 1 string
flow.Workload kind 2 string
flow.TCP source_port 1 uint32
flow.TCP destination_port 2 uint32
flow.TCP flags 3 .flow.TCPFlags
flow.IP source 1 string
flow.IP destination 2 string
flow.IP ipVersion 3 .flow.IPVersion
flow.IP encrypted 4 bool
flow.TCPFlags FIN 1 bool
flow.TCPFlags SYN 2 bool
flow.TCPFlags RST 3 bool
flow.TCPFlags PSH 4 bool
flow.TCPFlags ACK 5 bool
flow.TCPFlags URG 6 bool
flow.TCPFlags ECE 7 bool
flow.TCPFlags CWR 8 bool
flow.TCPFlags NS 9 bool
flow.UDP source_port 1 uint32
flow.UDP destination_port 2 uint32
flow.SCTP source_port 1 uint32
flow.SCTP destination_port 2 uint32
flow.ICMPv4 type 1 uint32
flow.ICMPv4 code 2 uint32
flow.ICMPv6 type 1 uint32
flow.ICMPv6 code 2 uint32
flow.EventTypeFilter type 1 int32
flow.EventTypeFilter match_sub_type 2 bool
flow.EventTypeFilter sub_type 3 int32
flow.CiliumEventType type 1 int32
flow.CiliumEventType sub_type 2 int32
flow.FlowFilter uuid 29 string
flow.FlowFilter source_ip 1 string
flow.FlowFilter source_pod 2 string
flow.FlowFilter source_fqdn 7 string
flow.FlowFilter source_label 10 string
flow.FlowFilter source_service 16 string
flow.FlowFilter source_workload 26 .flow.Workload
flow.FlowFilter destination_ip 3 string
flow.FlowFilter destination_pod 4 string
flow.FlowFilter destination_fqdn 8 string
flow.FlowFilter destination_label 11 string
flow.FlowFilter destination_service 17 string
flow.FlowFilter destination_workload 27 .flow.Workload
flow.FlowFilter traffic_direction 30 .flow.TrafficDirection
flow.FlowFilter verdict 5 .flow.Verdict
flow.FlowFilter event_type 6 .flow.EventTypeFilter
flow.FlowFilter http_status_code 9 string
flow.FlowFilter protocol 12 string
flow.FlowFilter source_port 13 string
flow.FlowFilter destination_port 14 string
flow.FlowFilter reply 15 bool
flow.FlowFilter dns_query 18 string
flow.FlowFilter source_identity 19 uint32
flow.FlowFilter destination_identity 20 uint32
flow.FlowFilter http_method 21 string
flow.FlowFilter http_path 22 string
flow.FlowFilter tcp_flags 23 .flow.TCPFlags
flow.FlowFilter node_name 24 string
flow.FlowFilter ip_version 25 .flow.IPVersion
flow.FlowFilter trace_id 28 string
flow.DNS query 1 string
flow.DNS ips 2 string
flow.DNS ttl 3 uint32
flow.DNS cnames 4 string
flow.DNS observation_source 5 string
flow.DNS rcode 6 uint32
flow.DNS qtypes 7 string
flow.DNS rrtypes 8 string
flow.HTTPHeader key 1 string
flow.HTTPHeader value 2 string
flow.HTTP code 1 uint32
flow.HTTP method 2 string
flow.HTTP url 3 string
flow.HTTP protocol 4 string
flow.HTTP headers 5 .flow.HTTPHeader
flow.Service name 1 string
flow.Service namespace 2 string
flow.LostEvent source 1 .flow.LostEventSource
flow.LostEvent num_events_lost 2 uint64
flow.LostEvent cpu 3 .google.protobuf.Int32Value
flow.Policy name 1 string
flow.Policy namespace 2 string
flow.Policy labels 3 string
flow.Policy revision 4 uint64
flow.Policy kind 5 string
relay.NodeStatusEvent state_change 1 .relay.NodeState
relay.NodeStatusEvent node_names 2 string
relay.NodeStatusEvent message 3 string
peer.ChangeNotification name 1 string
peer.ChangeNotification address 2 string
peer.ChangeNotification type 3 .peer.ChangeNotificationType
peer.ChangeNotification tls 4 .peer.TLS
peer.TLS server_name 1 string
observer.ServerStatusResponse num_flows 1 uint64
observer.ServerStatusResponse max_flows 2 uint64
observer.ServerStatusResponse seen_flows 3 uint64
observer.ServerStatusResponse uptime_ns 4 uint64
observer.ServerStatusResponse num_connected_nodes 5 .google.protobuf.UInt32Value
observer.ServerStatusResponse num_unavailable_nodes 6 .google.protobuf.UInt32Value
observer.ServerStatusResponse unavailable_nodes 7 string
observer.ServerStatusResponse version 8 string
observer.GetFlowsRequest number 1 uint64
observer.GetFlowsRequest first 9 bool
observer.GetFlowsRequest follow 3 bool
observer.GetFlowsRequest blacklist 5 .flow.FlowFilter
observer.GetFlowsRequest whitelist 6 .flow.FlowFilter
observer.GetFlowsRequest since 7 .google.protobuf.Timestamp
observer.GetFlowsRequest until 8 .google.protobuf.Timestamp
observer.GetFlowsResponse flow 1 .flow.Flow
observer.GetFlowsResponse node_status 2 .relay.NodeStatusEvent
observer.GetFlowsResponse lost_events 3 .flow.LostEvent
observer.GetFlowsResponse node_name 1000 string
observer.GetFlowsResponse time 1001 .google.protobuf.Timestamp
observer.GetNodesResponse nodes 1 .observer.Node
observer.Node name 1 string
observer.Node version 2 string
observer.Node address 3 string
observer.Node state 4 .relay.NodeState
observer.Node tls 5 .observer.TLS
observer.Node uptime_ns 6 uint64
observer.Node num_flows 7 uint64
observer.Node max_flows 8 uint64
observer.Node seen_flows 9 uint64
observer.TLS enabled 1 bool
observer.TLS server_name 2 string
observer.GetNamespacesResponse namespaces 1 .observer.Namespace
observer.Namespace cluster 1 string
observer.Namespace namespace 2 string
";

/// Cilium's enum values of every enum `proto/` declares: `enum name number`.
const CILIUM_ENUMS: &str = "
flow.FlowType UNKNOWN_TYPE 0
flow.FlowType L3_L4 1
flow.FlowType L7 2
flow.FlowType SOCK 3
flow.TraceObservationPoint UNKNOWN_POINT 0
flow.TraceObservationPoint TO_PROXY 1
flow.TraceObservationPoint TO_HOST 2
flow.TraceObservationPoint TO_STACK 3
flow.TraceObservationPoint TO_OVERLAY 4
flow.TraceObservationPoint TO_ENDPOINT 101
flow.TraceObservationPoint FROM_ENDPOINT 5
flow.TraceObservationPoint FROM_PROXY 6
flow.TraceObservationPoint FROM_HOST 7
flow.TraceObservationPoint FROM_STACK 8
flow.TraceObservationPoint FROM_OVERLAY 9
flow.TraceObservationPoint FROM_NETWORK 10
flow.TraceObservationPoint TO_NETWORK 11
flow.L7FlowType UNKNOWN_L7_TYPE 0
flow.L7FlowType REQUEST 1
flow.L7FlowType RESPONSE 2
flow.L7FlowType SAMPLE 3
flow.IPVersion IP_NOT_USED 0
flow.IPVersion IPv4 1
flow.IPVersion IPv6 2
flow.Verdict VERDICT_UNKNOWN 0
flow.Verdict FORWARDED 1
flow.Verdict DROPPED 2
flow.Verdict ERROR 3
flow.Verdict AUDIT 4
flow.Verdict REDIRECTED 5
flow.Verdict TRACED 6
flow.Verdict TRANSLATED 7
flow.DropReason DROP_REASON_UNKNOWN 0
flow.DropReason INVALID_SOURCE_IP 132
flow.DropReason POLICY_DENIED 133
flow.DropReason INVALID_PACKET_DROPPED 134
flow.DropReason UNSUPPORTED_L3_PROTOCOL 139
flow.DropReason NO_CONFIGURATION_AVAILABLE_TO_PERFORM_POLICY_DECISION 165
flow.DropReason POLICY_DENY 181
flow.TrafficDirection TRAFFIC_DIRECTION_UNKNOWN 0
flow.TrafficDirection INGRESS 1
flow.TrafficDirection EGRESS 2
flow.LostEventSource UNKNOWN_LOST_EVENT_SOURCE 0
flow.LostEventSource PERF_EVENT_RING_BUFFER 1
flow.LostEventSource OBSERVER_EVENTS_QUEUE 2
flow.LostEventSource HUBBLE_RING_BUFFER 3
relay.NodeState UNKNOWN_NODE_STATE 0
relay.NodeState NODE_CONNECTED 1
relay.NodeState NODE_UNAVAILABLE 2
relay.NodeState NODE_GONE 3
relay.NodeState NODE_ERROR 4
peer.ChangeNotificationType UNKNOWN 0
peer.ChangeNotificationType PEER_ADDED 1
peer.ChangeNotificationType PEER_DELETED 2
peer.ChangeNotificationType PEER_UPDATED 3
";

/// `proto/` keeps Cilium's wire format: every field and enum value it declares has Cilium's
/// number and type, and the services have Cilium's names, methods and streaming.
#[test]
fn the_protos_keep_ciliums_field_numbers() {
    use prost_types::field_descriptor_proto::Type;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("proto");
    let files = [
        "flow/flow.proto",
        "relay/relay.proto",
        "peer/peer.proto",
        "observer/observer.proto",
    ];
    let set = protox::compile(files.map(|f| root.join(f)), [&root]).expect("proto/ parses");
    let pinned: std::collections::BTreeSet<String> = CILIUM_FIELDS
        .lines()
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    let pinned_enums: std::collections::BTreeSet<String> = CILIUM_ENUMS
        .lines()
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    let (mut ours, mut our_enums, mut services) = (
        std::collections::BTreeSet::new(),
        std::collections::BTreeSet::new(),
        Vec::new(),
    );
    for file in set.file.iter().filter(|f| files.contains(&f.name())) {
        let pkg = file.package();
        for m in &file.message_type {
            for f in &m.field {
                let ty = match f.r#type() {
                    Type::Message | Type::Enum => f.type_name().to_string(),
                    Type::String => "string".into(),
                    Type::Bool => "bool".into(),
                    Type::Uint32 => "uint32".into(),
                    Type::Uint64 => "uint64".into(),
                    Type::Int32 => "int32".into(),
                    other => format!("{other:?}"),
                };
                ours.insert(format!(
                    "{pkg}.{} {} {} {ty}",
                    m.name(),
                    f.name(),
                    f.number()
                ));
            }
        }
        for e in &file.enum_type {
            for v in &e.value {
                our_enums.insert(format!("{pkg}.{} {} {}", e.name(), v.name(), v.number()));
            }
        }
        for s in &file.service {
            for m in &s.method {
                services.push(format!(
                    "{pkg}.{}/{} {} -> {}{}",
                    s.name(),
                    m.name(),
                    m.input_type(),
                    if m.server_streaming() { "stream " } else { "" },
                    m.output_type()
                ));
            }
        }
    }
    let not_ciliums: Vec<_> = ours.difference(&pinned).collect();
    assert!(
        not_ciliums.is_empty(),
        "fields unlike Cilium's: {not_ciliums:#?}"
    );
    assert_eq!(ours, pinned, "the table pins every field of proto/");
    assert_eq!(our_enums, pinned_enums);
    services.sort();
    assert_eq!(
        services,
        [
            "observer.Observer/GetFlows .observer.GetFlowsRequest -> stream .observer.GetFlowsResponse",
            "observer.Observer/GetNamespaces .observer.GetNamespacesRequest -> .observer.GetNamespacesResponse",
            "observer.Observer/GetNodes .observer.GetNodesRequest -> .observer.GetNodesResponse",
            "observer.Observer/ServerStatus .observer.ServerStatusRequest -> .observer.ServerStatusResponse",
            "peer.Peer/Notify .peer.NotifyRequest -> stream .peer.ChangeNotification",
        ]
    );
}
