//! The task that writes this node's `CiliateEndpointSlice`s (`k8s::slices`): the Kubernetes
//! watcher hands it every change of a local pod ([`LocalPod`]), and it writes the slices that
//! changed, at most once per [`BATCH`] (changes within it share one write per slice).
//!
//! At start it lists the slices the API server holds for this node (an earlier run wrote them),
//! so pods keep their places, and writes nothing until the local pods have listed once: then
//! what the listing no longer holds is removed from the slices. A failed write is retried with
//! backoff; the slices then lag, other agents keep the last version they saw. Slices name the
//! Node as their owner, so the API server's garbage collector deletes them with the Node.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::core::ObjectMeta;
use kube::Resource;
use tokio::sync::mpsc;

use super::slices::{
    CiliateEndpointSlice, CiliateEndpointSliceSpec, PodSourceView, SliceBook, SliceObject,
    SliceWrite, NODE_LABEL,
};
use crate::objects::PodInfo;

/// How long changes gather before the slices they touch are written.
pub const BATCH: Duration = Duration::from_millis(100);

/// A change of a pod on this node, from the watcher.
#[derive(Debug)]
pub enum LocalPod {
    /// A pod with addresses appeared or changed.
    Upsert(PodInfo),
    /// A pod went away or has no identity any more (`namespace/name`).
    Delete(String),
    /// The local pods have listed once: every pod the slices hold that was not upserted since
    /// start is gone.
    Listed,
}

/// Writes this node's slices until the sender is dropped.
pub async fn run_slice_writer(
    client: kube::Client,
    node: String,
    mut changes: mpsc::UnboundedReceiver<LocalPod>,
    view: Arc<Mutex<PodSourceView>>,
) {
    let api: Api<CiliateEndpointSlice> = Api::all(client.clone());
    let mut book = SliceBook::new(&node);
    let mut failures: u32 = 0;
    // What this node's slices hold now (an earlier run of the agent wrote them).
    let existing = loop {
        match list_own(&client, &node).await {
            Ok(e) => break e,
            Err(e) => {
                failures += 1;
                note_error(&view, format!("listing this node's slices: {e}"));
                tokio::time::sleep(backoff(failures)).await;
            }
        }
    };
    let strays = book.adopt(existing);
    let owner = node_owner(&client, &node).await;
    // Until the local pods have listed: only gather.
    let mut seen = HashSet::new();
    loop {
        match changes.recv().await {
            None => return,
            Some(LocalPod::Listed) => break,
            Some(change) => {
                if let LocalPod::Upsert(p) = &change {
                    seen.insert(p.key());
                }
                apply(&mut book, change);
            }
        }
    }
    for key in book.keys() {
        if !seen.contains(&key) {
            book.remove(&key);
        }
    }
    let mut pending: Vec<SliceWrite> = strays;
    failures = 0;
    loop {
        pending.extend(book.writes());
        let mut failed = false;
        for write in pending.drain(..) {
            match execute(&api, &node, owner.as_ref(), &write).await {
                Ok(()) => book.written(&write),
                Err(e) => {
                    failed = true;
                    note_error(&view, format!("writing slice {}: {e}", write.name()));
                    book.failed(&write);
                }
            }
        }
        if let Ok(mut v) = view.lock() {
            v.slices_written = book.slice_count();
            v.local_pods = book.len();
            if !failed {
                v.last_error = None;
            }
        }
        // Wait for the next change (or the retry), then let the batch gather.
        if failed {
            failures += 1;
            let wait = backoff(failures);
            if let Ok(Some(change)) = tokio::time::timeout(wait, changes.recv()).await {
                apply(&mut book, change);
            }
        } else {
            failures = 0;
            match changes.recv().await {
                None => return,
                Some(change) => apply(&mut book, change),
            }
        }
        tokio::time::sleep(BATCH).await;
        while let Ok(change) = changes.try_recv() {
            apply(&mut book, change);
        }
    }
}

fn apply(book: &mut SliceBook, change: LocalPod) {
    match change {
        LocalPod::Upsert(p) if !p.ips.is_empty() => book.upsert(p),
        LocalPod::Upsert(p) => book.remove(&p.key()),
        LocalPod::Delete(key) => book.remove(&key),
        LocalPod::Listed => {}
    }
}

fn backoff(failures: u32) -> Duration {
    (Duration::from_millis(250) * 2u32.pow(failures.min(7))).min(Duration::from_secs(30))
}

fn note_error(view: &Arc<Mutex<PodSourceView>>, error: String) {
    tracing::warn!(error = %error, "endpoint slices: retrying with backoff");
    if let Ok(mut v) = view.lock() {
        v.last_error = Some(error);
    }
}

/// This node's slices as the API server holds them. Read as `SliceObject`s, so that a slice
/// someone broke is replaced rather than blocking the list (it reads as empty and is rewritten).
async fn list_own(
    client: &kube::Client,
    node: &str,
) -> Result<Vec<(String, CiliateEndpointSliceSpec)>, kube::Error> {
    let api: Api<SliceObject> = Api::all(client.clone());
    let lp = ListParams::default().labels(&format!("{NODE_LABEL}={node}"));
    let list = api.list(&lp).await?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|o| {
            let name = o.metadata.name.clone()?;
            Some((name, o.into_spec().unwrap_or_default()))
        })
        .collect())
}

/// The Node as owner of the slices (for garbage collection), if it can be read.
async fn node_owner(client: &kube::Client, node: &str) -> Option<OwnerReference> {
    let nodes: Api<Node> = Api::all(client.clone());
    for attempt in 0..5u32 {
        match nodes.get(node).await {
            Ok(n) => {
                let uid = n.metadata.uid?;
                return Some(OwnerReference {
                    api_version: Node::api_version(&()).into(),
                    kind: Node::kind(&()).into(),
                    name: node.into(),
                    uid,
                    ..Default::default()
                });
            }
            Err(e) => {
                tracing::debug!(node, error = %e, attempt, "reading the Node for slice ownership");
                tokio::time::sleep(backoff(attempt)).await;
            }
        }
    }
    tracing::warn!(
        node,
        "the Node object cannot be read: this node's endpoint slices carry no owner and outlive the Node"
    );
    None
}

async fn execute(
    api: &Api<CiliateEndpointSlice>,
    node: &str,
    owner: Option<&OwnerReference>,
    write: &SliceWrite,
) -> Result<(), kube::Error> {
    match write {
        SliceWrite::Delete(name) => match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e),
        },
        SliceWrite::Apply(name, spec) => {
            let obj = CiliateEndpointSlice {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    labels: Some(BTreeMap::from([(NODE_LABEL.to_string(), node.to_string())])),
                    owner_references: owner.map(|o| vec![o.clone()]),
                    ..Default::default()
                },
                spec: spec.clone(),
            };
            match api.replace(name, &PostParams::default(), &obj).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 => {
                    api.create(&PostParams::default(), &obj).await.map(|_| ())
                }
                Err(e) => Err(e),
            }
        }
    }
}
