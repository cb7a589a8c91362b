use super::*;

fn pods(store: &Store) -> ResourceType {
    store.resolve("", "v1", "pods").unwrap()
}

fn pod(name: &str, labels: Value) -> Value {
    json!({"metadata": {"name": name, "labels": labels}, "spec": {"nodeName": "n1"},
           "status": {"podIP": "10.0.0.1"}})
}

#[test]
fn create_get_update_conflict_delete() {
    let store = Store::new();
    let rt = pods(&store);
    let created = store
        .create(&rt, "default", pod("a", json!({"app": "x"})))
        .unwrap();
    assert_eq!(created["kind"], "Pod");
    assert_eq!(created["metadata"]["namespace"], "default");
    assert_eq!(created["metadata"]["generation"], 1);
    // Status is the status subresource's business.
    assert_eq!(created["status"], json!({"phase": "Pending"}));
    let err = store
        .create(&rt, "default", pod("a", json!({})))
        .unwrap_err();
    assert!(matches!(err, ApiError::AlreadyExists(_)), "{err}");
    let err = store
        .create(&rt, "nowhere", pod("b", json!({})))
        .unwrap_err();
    assert!(matches!(err, ApiError::NotFound(_)), "{err}");

    let mut changed = created.clone();
    changed["spec"]["nodeName"] = json!("n2");
    let updated = store
        .update(&rt, "default", "a", changed.clone(), WriteScope::Main)
        .unwrap();
    assert_eq!(updated["metadata"]["generation"], 2);
    assert_ne!(
        updated["metadata"]["resourceVersion"],
        created["metadata"]["resourceVersion"]
    );
    // The same body again carries the old resourceVersion now.
    let err = store
        .update(&rt, "default", "a", changed, WriteScope::Main)
        .unwrap_err();
    assert!(matches!(err, ApiError::Conflict(_)), "{err}");

    let status = store
        .patch(
            &rt,
            "default",
            "a",
            PatchKind::Merge,
            &json!({"spec": {"nodeName": "ignored"}, "status": {"podIP": "10.0.0.9"}}),
            WriteScope::Status,
        )
        .unwrap();
    assert_eq!(status["status"]["podIP"], "10.0.0.9");
    assert_eq!(status["spec"]["nodeName"], "n2");
    assert_eq!(status["metadata"]["generation"], 2);

    let deleted = store.delete(&rt, "default", "a").unwrap();
    assert_eq!(deleted["metadata"]["name"], "a");
    assert!(matches!(
        store.get(&rt, "default", "a"),
        Err(ApiError::NotFound(_))
    ));
}

#[test]
fn list_filters_and_watch_history() {
    let store = Store::new();
    let rt = pods(&store);
    store
        .create(&rt, "default", pod("a", json!({"app": "x"})))
        .unwrap();
    let (_, rv) = store.list(&rt, &Filter::default());
    store
        .create(&rt, "default", pod("b", json!({"app": "y"})))
        .unwrap();
    let filter = Filter {
        labels: LabelSelector::parse("app=y").unwrap(),
        ..Filter::default()
    };
    let (items, _) = store.list(&rt, &filter);
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["metadata"]["name"], "b");

    let start = store.watch(&rt, &Filter::default(), Some(rv)).unwrap();
    assert_eq!(start.backlog.len(), 1);
    assert_eq!(name_of(&start.backlog[0].object), "b");
    let all = store.watch(&rt, &Filter::default(), None).unwrap();
    assert_eq!(all.backlog.len(), 2);

    // A label change that leaves the selector reads as a deletion to that watch.
    let mut live = store
        .watch(&rt, &filter, Some(store.current_rv()))
        .unwrap()
        .live;
    store
        .patch(
            &rt,
            "default",
            "b",
            PatchKind::Merge,
            &json!({"metadata": {"labels": {"app": "z"}}}),
            WriteScope::Main,
        )
        .unwrap();
    let ev = live.try_recv().unwrap();
    assert_eq!(filter.view(&ev), Some(EventType::Deleted));

    store.compact();
    let err = store
        .watch(&rt, &Filter::default(), Some(rv))
        .err()
        .unwrap();
    assert!(matches!(err, ApiError::Expired(_)), "{err}");
}

#[test]
fn crd_lifecycle_registers_and_removes_types() {
    let store = Store::new();
    let crds = store.resolve(CRD_GROUP, "v1", CRD_PLURAL).unwrap();
    let crd = json!({
        "metadata": {"name": "ciliumclusterwidenetworkpolicies.cilium.io"},
        "spec": {"group": "cilium.io", "scope": "Cluster",
                 "names": {"plural": "ciliumclusterwidenetworkpolicies",
                           "kind": "CiliumClusterwideNetworkPolicy", "shortNames": ["ccnp"]},
                 "versions": [{"name": "v2", "served": true, "storage": true,
                               "subresources": {"status": {}}}]}
    });
    let created = store.create(&crds, "", crd).unwrap();
    assert_eq!(created["status"]["conditions"][1]["type"], "Established");
    let rt = store
        .resolve("cilium.io", "v2", "ciliumclusterwidenetworkpolicies")
        .unwrap();
    assert!(!rt.namespaced);
    store
        .create(&rt, "", json!({"metadata": {"name": "p"}, "spec": {}}))
        .unwrap();
    store
        .delete(&crds, "", "ciliumclusterwidenetworkpolicies.cilium.io")
        .unwrap();
    assert!(store
        .resolve("cilium.io", "v2", "ciliumclusterwidenetworkpolicies")
        .is_err());
}

#[test]
fn deleting_a_namespace_deletes_its_objects() {
    let store = Store::new();
    let rt = pods(&store);
    let ns = store.resolve("", "v1", "namespaces").unwrap();
    let created = store
        .create(&ns, "", json!({"metadata": {"name": "x"}}))
        .unwrap();
    assert_eq!(
        created["metadata"]["labels"]["kubernetes.io/metadata.name"],
        "x"
    );
    store.create(&rt, "x", pod("a", json!({}))).unwrap();
    let terminating = store.delete(&ns, "", "x").unwrap();
    assert_eq!(terminating["status"]["phase"], "Terminating");
    assert!(store.get(&rt, "x", "a").is_ok());
    store.finalize_namespace("x");
    assert!(store.get(&rt, "x", "a").is_err());
    assert!(store.get(&ns, "", "x").is_err());
    // An empty namespace goes at once.
    store
        .create(&ns, "", json!({"metadata": {"name": "y"}}))
        .unwrap();
    store.delete(&ns, "", "y").unwrap();
    assert!(store.get(&ns, "", "y").is_err());
}

#[test]
fn apply_whole_keeps_status() {
    let store = Store::new();
    let mut body = pod("a", json!({}));
    body["apiVersion"] = json!("v1");
    body["kind"] = json!("Pod");
    let created = store.apply_whole(body.clone()).unwrap();
    assert_eq!(created["status"]["podIP"], "10.0.0.1");
    body["status"]["podIP"] = json!("10.0.0.2");
    let replaced = store.apply_whole(body).unwrap();
    assert_eq!(replaced["status"]["podIP"], "10.0.0.2");
    assert_eq!(replaced["metadata"]["uid"], created["metadata"]["uid"]);
}
