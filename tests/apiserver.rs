//! The in-memory test API server against the real clients: kube-rs (client and runtime
//! watcher) and the real kubectl.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use ciliate_test_apiserver::TestApiServer;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use kube::runtime::watcher;
use serde_json::{json, Value};

const CNP_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: ciliumnetworkpolicies.cilium.io
spec:
  group: cilium.io
  scope: Namespaced
  names:
    plural: ciliumnetworkpolicies
    singular: ciliumnetworkpolicy
    kind: CiliumNetworkPolicy
    listKind: CiliumNetworkPolicyList
    shortNames: [cnp, ciliumnp]
  versions:
  - name: v2
    served: true
    storage: true
    subresources:
      status: {}
    schema:
      openAPIV3Schema:
        type: object
        x-kubernetes-preserve-unknown-fields: true
"#;

const OBJECTS: &str = r#"
apiVersion: v1
kind: Namespace
metadata:
  name: x
---
apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: x
  labels: {app: web}
spec:
  nodeName: n1
  containers:
  - name: c
    image: nginx
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata:
  name: allow-web
  namespace: x
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress: [{fromEndpoints: [{}]}]
"#;

use common::kube_client as client;

fn pod(name: &str, app: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "nginx"}]}
    }))
    .expect("pod")
}

fn cnp_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("cilium.io", "v2", "CiliumNetworkPolicy"),
        "ciliumnetworkpolicies",
    )
}

fn api_code(err: kube::Error) -> u16 {
    match err {
        kube::Error::Api(status) => status.code,
        other => panic!("expected an API error, got {other}"),
    }
}

#[tokio::test]
async fn kube_client_crud_on_pods() {
    let server = TestApiServer::start().expect("server");
    let dir = tempfile::tempdir().expect("tempdir");
    let pods: Api<Pod> = Api::namespaced(client(&server, dir.path()).await, "default");

    let created = pods
        .create(&PostParams::default(), &pod("a", "web"))
        .await
        .expect("create");
    assert!(created.metadata.uid.is_some());
    pods.create(&PostParams::default(), &pod("b", "db"))
        .await
        .expect("create b");
    let dup = pods
        .create(&PostParams::default(), &pod("a", "web"))
        .await
        .unwrap_err();
    assert_eq!(api_code(dup), 409);

    let got = pods.get("a").await.expect("get");
    assert_eq!(
        got.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some("n1")
    );
    let web = pods
        .list(&ListParams::default().labels("app=web"))
        .await
        .expect("list");
    assert_eq!(web.items.len(), 1);
    assert!(web.metadata.resource_version.is_some());
    let not_db = pods
        .list(&ListParams::default().labels("app notin (db)"))
        .await
        .unwrap();
    assert_eq!(not_db.items.len(), 1);
    let on_node = pods
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .unwrap();
    assert_eq!(on_node.items.len(), 2);

    let patched = pods
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"tier": "front"}}})),
        )
        .await
        .expect("merge patch");
    assert_eq!(
        patched
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("tier"))
            .map(String::as_str),
        Some("front")
    );

    let mut replaced = patched.clone();
    replaced.spec.as_mut().expect("spec").node_name = Some("n2".into());
    let replaced = pods
        .replace("a", &PostParams::default(), &replaced)
        .await
        .expect("replace");
    assert_eq!(replaced.metadata.generation, Some(2));
    // `patched` carries a resourceVersion that is no longer current.
    let stale = pods
        .replace("a", &PostParams::default(), &patched)
        .await
        .unwrap_err();
    assert_eq!(api_code(stale), 409);

    let status = pods
        .patch_status(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"podIP": "10.0.0.7"}})),
        )
        .await
        .expect("status patch");
    assert_eq!(
        status.status.as_ref().and_then(|s| s.pod_ip.as_deref()),
        Some("10.0.0.7")
    );
    // The main endpoint ignores status changes on a type with a status subresource.
    let ignored = pods
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"podIP": "1.1.1.1"}})),
        )
        .await
        .expect("patch");
    assert_eq!(
        ignored.status.as_ref().and_then(|s| s.pod_ip.as_deref()),
        Some("10.0.0.7")
    );

    let deleted = pods
        .delete("a", &DeleteParams::default())
        .await
        .expect("delete");
    assert!(deleted.is_left(), "delete returns the object");
    assert_eq!(api_code(pods.get("a").await.unwrap_err()), 404);
    assert_eq!(
        api_code(
            pods.delete("a", &DeleteParams::default())
                .await
                .unwrap_err()
        ),
        404
    );

    let all: Api<Pod> = Api::all(pods.clone().into_client());
    assert_eq!(
        all.list(&ListParams::default())
            .await
            .expect("cluster-wide list")
            .items
            .len(),
        1
    );
}

/// Lists are paged as the API server pages them (`limit`, `continue`): kube-rs walks the pages,
/// each carries the first page's resourceVersion, and a selector applies across pages.
#[tokio::test]
async fn lists_are_paged_with_limit_and_continue() {
    let server = TestApiServer::start().expect("server");
    let dir = tempfile::tempdir().expect("tempdir");
    let pods: Api<Pod> = Api::namespaced(client(&server, dir.path()).await, "default");
    for i in 0..7 {
        let app = if i % 2 == 0 { "web" } else { "db" };
        pods.create(&PostParams::default(), &pod(&format!("p{i}"), app))
            .await
            .expect("create");
    }
    let mut seen = Vec::new();
    let mut params = ListParams::default().limit(3);
    let mut first_rv = None;
    loop {
        let page = pods.list(&params).await.expect("a page");
        assert!(page.items.len() <= 3, "at most the limit");
        let rv = page.metadata.resource_version.clone();
        first_rv.get_or_insert(rv.clone());
        assert_eq!(
            Some(&rv),
            first_rv.as_ref(),
            "every page has the first page's version"
        );
        seen.extend(page.items.iter().map(|p| name(p).to_string()));
        // A change between pages does not disturb the walk.
        if seen.len() == 3 {
            pods.create(&PostParams::default(), &pod("q", "web"))
                .await
                .expect("create q");
        }
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => break,
        }
    }
    assert_eq!(seen[..7], ["p0", "p1", "p2", "p3", "p4", "p5", "p6"]);
    let web = pods
        .list(&ListParams::default().labels("app=web").limit(2))
        .await
        .expect("list");
    assert_eq!(web.items.len(), 2);
    assert!(web.metadata.continue_.is_some(), "more web pods remain");
    let bad = pods
        .list(&ListParams::default().continue_token("nonsense"))
        .await
        .unwrap_err();
    assert_eq!(api_code(bad), 400);
}

#[tokio::test]
async fn kube_client_crd_backed_cilium_network_policy() {
    let server = TestApiServer::start().expect("server");
    let dir = tempfile::tempdir().expect("tempdir");
    let client = client(&server, dir.path()).await;
    let crd: Value = serde_yaml::from_str(CNP_CRD).expect("crd yaml");
    server.apply_json(crd).expect("register CRD");
    server
        .apply_json(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}}))
        .expect("namespace");

    let ar = cnp_resource();
    let cnps: Api<DynamicObject> = Api::namespaced_with(client.clone(), "x", &ar);
    let policy = DynamicObject::new("allow-web", &ar)
        .within("x")
        .data(json!({
            "spec": {"endpointSelector": {"matchLabels": {"app": "web"}}}
        }));
    let created = cnps
        .create(&PostParams::default(), &policy)
        .await
        .expect("create cnp");
    assert_eq!(
        created.data["spec"]["endpointSelector"]["matchLabels"]["app"],
        "web"
    );

    let patched = cnps
        .patch(
            "allow-web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"ingress": [{"fromEndpoints": [{}]}]}})),
        )
        .await
        .expect("patch cnp");
    assert_eq!(patched.metadata.generation, Some(2));
    let status = cnps
        .patch_status("allow-web", &PatchParams::default(),
                      &Patch::Merge(json!({"status": {"conditions": [{"type": "Valid", "status": "True"}]}, "spec": {}})))
        .await
        .expect("patch cnp status");
    assert_eq!(status.data["status"]["conditions"][0]["type"], "Valid");
    assert_eq!(
        status.metadata.generation,
        Some(2),
        "status writes leave the generation"
    );

    let mut replaced = status.clone();
    replaced.data["spec"]["endpointSelector"] = json!({});
    let replaced = cnps
        .replace("allow-web", &PostParams::default(), &replaced)
        .await
        .expect("replace");
    assert_eq!(replaced.data["spec"]["endpointSelector"], json!({}));
    let listed = cnps.list(&ListParams::default()).await.expect("list cnp");
    assert_eq!(listed.items.len(), 1);
    cnps.delete("allow-web", &DeleteParams::default())
        .await
        .expect("delete cnp");
    assert!(cnps
        .list(&ListParams::default())
        .await
        .expect("list")
        .items
        .is_empty());

    // Cluster-scoped CRDs are served without a namespace.
    let ccnp_crd = CNP_CRD
        .replace("ciliumnetworkpolicies", "ciliumclusterwidenetworkpolicies")
        .replace("ciliumnetworkpolicy", "ciliumclusterwidenetworkpolicy")
        .replace("CiliumNetworkPolicy", "CiliumClusterwideNetworkPolicy")
        .replace("[cnp, ciliumnp]", "[ccnp]")
        .replace("Namespaced", "Cluster");
    server
        .apply_json(serde_yaml::from_str(&ccnp_crd).expect("yaml"))
        .expect("ccnp CRD");
    let ccnp_ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("cilium.io", "v2", "CiliumClusterwideNetworkPolicy"),
        "ciliumclusterwidenetworkpolicies",
    );
    let ccnps: Api<DynamicObject> = Api::all_with(client, &ccnp_ar);
    let ccnp = DynamicObject::new("global", &ccnp_ar).data(json!({"spec": {}}));
    ccnps
        .create(&PostParams::default(), &ccnp)
        .await
        .expect("create ccnp");
    assert_eq!(
        ccnps
            .get("global")
            .await
            .expect("get ccnp")
            .metadata
            .namespace,
        None
    );
}

/// The next watcher event, or a panic naming what was awaited.
async fn next_event(
    stream: &mut (impl futures_util::Stream<Item = Result<watcher::Event<Pod>, watcher::Error>> + Unpin),
    what: &str,
) -> Result<watcher::Event<Pod>, watcher::Error> {
    tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .unwrap_or_else(|| panic!("watch stream ended while waiting for {what}"))
}

fn name(pod: &Pod) -> &str {
    pod.metadata.name.as_deref().unwrap_or("")
}

#[tokio::test]
async fn kube_runtime_watcher_sees_changes_breaks_and_relists_after_compaction() {
    let server = TestApiServer::start().expect("server");
    let dir = tempfile::tempdir().expect("tempdir");
    let pods: Api<Pod> = Api::namespaced(client(&server, dir.path()).await, "default");
    pods.create(&PostParams::default(), &pod("before", "web"))
        .await
        .expect("create");

    let mut stream = watcher(pods.clone(), watcher::Config::default().labels("app=web")).boxed();
    assert!(matches!(
        next_event(&mut stream, "Init").await,
        Ok(watcher::Event::Init)
    ));
    match next_event(&mut stream, "InitApply").await {
        Ok(watcher::Event::InitApply(p)) => assert_eq!(name(&p), "before"),
        other => panic!("expected InitApply, got {other:?}"),
    }
    assert!(matches!(
        next_event(&mut stream, "InitDone").await,
        Ok(watcher::Event::InitDone)
    ));

    pods.create(&PostParams::default(), &pod("a", "web"))
        .await
        .expect("create");
    pods.create(&PostParams::default(), &pod("ignored", "db"))
        .await
        .expect("create");
    match next_event(&mut stream, "ADDED").await {
        Ok(watcher::Event::Apply(p)) => assert_eq!(name(&p), "a"),
        other => panic!("expected Apply(a), got {other:?}"),
    }
    pods.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"n": "1"}}})),
    )
    .await
    .expect("patch");
    match next_event(&mut stream, "MODIFIED").await {
        Ok(watcher::Event::Apply(p)) => {
            assert_eq!(
                p.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("n"))
                    .map(String::as_str),
                Some("1")
            )
        }
        other => panic!("expected Apply(a) modified, got {other:?}"),
    }
    pods.delete("a", &DeleteParams::default())
        .await
        .expect("delete");
    match next_event(&mut stream, "DELETED").await {
        Ok(watcher::Event::Delete(p)) => assert_eq!(name(&p), "a"),
        other => panic!("expected Delete(a), got {other:?}"),
    }

    // A broken stream is resumed from the last version: the change made meanwhile arrives
    // once, without a relist.
    server.break_watches();
    pods.create(&PostParams::default(), &pod("after-break", "web"))
        .await
        .expect("create");
    match next_event(&mut stream, "ADDED after a break").await {
        Ok(watcher::Event::Apply(p)) => assert_eq!(name(&p), "after-break"),
        other => panic!("expected Apply(after-break), got {other:?}"),
    }

    // After compaction, resuming gets 410 Expired in the stream; the watcher reports it and
    // starts over with a fresh list.
    server.compact();
    server.break_watches();
    match next_event(&mut stream, "the 410 error").await {
        Err(watcher::Error::WatchError(status)) => assert_eq!(status.code, 410),
        other => panic!("expected a 410 watch error, got {other:?}"),
    }
    assert!(matches!(
        next_event(&mut stream, "Init after 410").await,
        Ok(watcher::Event::Init)
    ));
    let mut relisted = Vec::new();
    loop {
        match next_event(&mut stream, "the relist").await {
            Ok(watcher::Event::InitApply(p)) => relisted.push(name(&p).to_string()),
            Ok(watcher::Event::InitDone) => break,
            other => panic!("expected InitApply/InitDone, got {other:?}"),
        }
    }
    relisted.sort();
    assert_eq!(relisted, ["after-break", "before"]);
}

/// Runs kubectl with the server's kubeconfig and its own discovery cache.
fn kubectl(dir: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(dir.join("kubeconfig"))
        .arg("--cache-dir")
        .arg(dir.join("cache"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run kubectl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn kubectl_ok(dir: &Path, args: &[&str]) -> String {
    let (ok, stdout, stderr) = kubectl(dir, args);
    assert!(ok, "kubectl {args:?} failed:\n{stdout}\n{stderr}");
    stdout
}

fn kubectl_json(dir: &Path, args: &[&str]) -> Value {
    let out = kubectl_ok(dir, args);
    serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("kubectl {args:?}: not JSON ({e}):\n{out}"))
}

fn kubectl_available() -> bool {
    let found = Command::new("kubectl")
        .args(["version", "--client"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    common::available(found, "kubectl on PATH")
}

/// The JSON documents kubectl printed one after another (`get -w -o json`).
fn json_stream(text: &str) -> Vec<Value> {
    serde_json::Deserializer::from_str(text)
        .into_iter::<Value>()
        .map_while(Result::ok)
        .collect()
}

#[test]
fn real_kubectl_apply_get_watch_annotate_label_patch_delete() {
    if !kubectl_available() {
        return;
    }
    let server = TestApiServer::start().expect("server");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    server
        .kubeconfig(&d.join("kubeconfig"))
        .expect("kubeconfig");
    std::fs::write(d.join("crd.yaml"), CNP_CRD).expect("write");
    std::fs::write(d.join("objects.yaml"), OBJECTS).expect("write");
    let crd = d.join("crd.yaml").display().to_string();
    let objects = d.join("objects.yaml").display().to_string();

    let out = kubectl_ok(d, &["apply", "-f", &crd]);
    assert!(
        out.contains(
            "customresourcedefinition.apiextensions.k8s.io/ciliumnetworkpolicies.cilium.io created"
        ),
        "{out}"
    );
    let out = kubectl_ok(d, &["apply", "-f", &objects]);
    assert!(
        out.contains("namespace/x created") && out.contains("pod/web created"),
        "{out}"
    );
    assert!(
        out.contains("ciliumnetworkpolicy.cilium.io/allow-web created"),
        "{out}"
    );
    // Applying again changes nothing.
    let out = kubectl_ok(d, &["apply", "-f", &objects]);
    assert!(out.contains("pod/web unchanged"), "{out}");

    let pods = kubectl_json(d, &["get", "pods", "-n", "x", "-o", "json"]);
    assert_eq!(pods["items"][0]["metadata"]["name"], "web");
    assert_eq!(pods["items"][0]["spec"]["nodeName"], "n1");
    let cnps = kubectl_json(d, &["get", "cnp", "-n", "x", "-o", "json"]);
    assert_eq!(cnps["items"][0]["kind"], "CiliumNetworkPolicy");
    assert_eq!(
        cnps["items"][0]["spec"]["endpointSelector"]["matchLabels"]["app"],
        "web"
    );

    // A watch sees the annotation arrive.
    let mut watch = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(d.join("kubeconfig"))
        .arg("--cache-dir")
        .arg(d.join("cache"))
        .args(["get", "pods", "-n", "x", "-w", "-o", "json"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kubectl get -w");
    std::thread::sleep(Duration::from_millis(1500));
    kubectl_ok(d, &["annotate", "-n", "x", "pod", "web", "note=hello"]);
    std::thread::sleep(Duration::from_millis(1000));
    let _ = watch.kill();
    let output = watch.wait_with_output().expect("kubectl get -w output");
    let seen = json_stream(&String::from_utf8_lossy(&output.stdout));
    assert!(
        seen.iter()
            .any(|o| o["metadata"]["annotations"]["note"] == "hello"),
        "the watch did not show the annotation: {seen:?}"
    );

    kubectl_ok(d, &["label", "-n", "x", "cnp", "allow-web", "tier=db"]);
    kubectl_ok(
        d,
        &[
            "patch",
            "-n",
            "x",
            "cnp",
            "allow-web",
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"conditions":[{"type":"Valid","status":"True"}]},"spec":{"endpointSelector":{}}}"#,
        ],
    );
    let cnp = kubectl_json(
        d,
        &[
            "get",
            "ciliumnetworkpolicies.cilium.io",
            "allow-web",
            "-n",
            "x",
            "-o",
            "json",
        ],
    );
    assert_eq!(cnp["metadata"]["labels"]["tier"], "db");
    assert_eq!(cnp["status"]["conditions"][0]["type"], "Valid");
    assert_eq!(
        cnp["spec"]["endpointSelector"]["matchLabels"]["app"], "web",
        "status patch left the spec"
    );
    let pod = kubectl_json(d, &["get", "pod", "web", "-n", "x", "-o", "json"]);
    assert_eq!(pod["metadata"]["annotations"]["note"], "hello");

    let out = kubectl_ok(d, &["delete", "-f", &objects]);
    assert!(
        out.contains("pod \"web\" deleted") && out.contains("\"allow-web\" deleted"),
        "{out}"
    );
    let (ok, _, stderr) = kubectl(d, &["get", "pod", "web", "-n", "x", "-o", "json"]);
    assert!(!ok && stderr.contains("NotFound"), "{stderr}");
    let cnps = kubectl_json(d, &["get", "cnp", "-A", "-o", "json"]);
    assert_eq!(cnps["items"], json!([]));
}

/// One raw HTTP/1.1 request; returns the status line's code and the (possibly chunked) body.
fn raw_http(
    server: &TestApiServer,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> (u16, String) {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(server.addr()).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        conn,
        "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        server.addr(),
        body.len()
    )
    .expect("send");
    let mut reply = String::new();
    conn.read_to_string(&mut reply).expect("read reply");
    common::http_reply(&reply)
}

#[test]
fn errors_are_status_objects_and_watches_follow_the_protocol() {
    let options = ciliate_test_apiserver::ServerOptions {
        bookmark_interval: Duration::from_millis(200),
    };
    let server = TestApiServer::start_with(([127, 0, 0, 1], 0).into(), options).expect("server");
    let pods = "/api/v1/namespaces/default/pods";

    let (code, body) = raw_http(
        &server,
        "POST",
        pods,
        "Content-Type: application/vnd.kubernetes.protobuf\r\n",
        "x",
    );
    assert_eq!(code, 415);
    assert!(
        body.contains(r#""reason":"UnsupportedMediaType""#),
        "{body}"
    );
    let (code, body) = raw_http(&server, "GET", &format!("{pods}/nope"), "", "");
    assert_eq!(code, 404);
    assert!(
        body.contains(r#""kind":"Status""#) && body.contains(r#""reason":"NotFound""#),
        "{body}"
    );
    let (code, body) = raw_http(
        &server,
        "POST",
        &format!("{pods}/nope"),
        "Content-Type: application/json\r\n",
        "{}",
    );
    assert_eq!(code, 405, "{body}");
    let (code, body) = raw_http(
        &server,
        "POST",
        pods,
        "Content-Type: application/json\r\n",
        "{not json",
    );
    assert_eq!(code, 400, "{body}");
    let (code, body) = raw_http(
        &server,
        "PATCH",
        &format!("{pods}/p"),
        "Content-Type: application/json-patch+json\r\n",
        "[]",
    );
    assert_eq!(code, 415, "{body}");
    let (code, body) = raw_http(&server, "GET", "/version", "", "");
    assert_eq!(code, 200);
    assert!(body.contains("v1.32"), "{body}");

    server
        .apply_json(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"},
                           "status": {"podIP": "10.0.0.3"}}))
        .expect("pod");
    // No version: a synthetic ADDED per object, then bookmarks; the stream ends at timeoutSeconds.
    let (code, body) = raw_http(
        &server,
        "GET",
        &format!("{pods}?watch=1&allowWatchBookmarks=true&timeoutSeconds=1"),
        "",
        "",
    );
    assert_eq!(code, 200);
    assert!(
        body.contains(r#""type":"ADDED""#) && body.contains("10.0.0.3"),
        "{body}"
    );
    assert!(body.contains(r#""type":"BOOKMARK""#), "{body}");
    // The server counts what its watch streams sent (the k8s bench's bytes per pod event).
    // (The reply is chunked: the events are its JSON lines, each with its newline.)
    let events: usize = body
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| l.len() + 1)
        .sum();
    assert_eq!(
        server.watch_bytes().get("pods").copied(),
        Some(events as u64),
        "{body}"
    );
    // A compacted history answers an old version with an in-stream 410.
    server.compact();
    let (code, body) = raw_http(
        &server,
        "GET",
        &format!("{pods}?watch=true&resourceVersion=1&timeoutSeconds=1"),
        "",
        "",
    );
    assert_eq!(code, 200);
    assert!(
        body.contains(r#""type":"ERROR""#)
            && body.contains(r#""code":410"#)
            && body.contains("Expired"),
        "{body}"
    );
}
