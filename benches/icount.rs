//! Instruction counts of the engine's hot paths (issue #33 item 4), a bench binary that
//! `tests/icount.rs` runs under valgrind's callgrind: deterministic figures on a noisy machine,
//! checked in CI against `benches/icount.json`.
//!
//! `icount CASE` builds the case's state, then runs its measured part once inside a function
//! whose name holds `icount_measured`; callgrind counts only inside it
//! (`--toggle-collect=*icount_measured*`). `icount --list` names the cases.
//!
//! - `resolve_no_match`: resolve one endpoint that none of 2,000 rules selects.
//! - `resolve_selected_by_200`: resolve one endpoint selected by 200 rules (5 peers, 2 ports
//!   each).
//! - `resolve_tiers`: the same endpoint also selected by 20 ClusterNetworkPolicies of 25 rules
//!   each (Admin and Baseline; Accept, Deny, Pass; a namespace of 1,000 identities or 5 pods as
//!   peers; TCP ports).
//! - `selector_cache_new_identity`: a new identity against 2,000 selectors.
//! - `mapstate_diff`: the delta between two 10,000-entry map states that differ in 1,000.
//! - `entry_table_apply`: that delta applied to the datapath's mirror of a 10,000-entry policy
//!   map (`datapath::abi::EntryTable`: the kernel map's entries and their changes, the loader's
//!   part of every regeneration).
//! - `ipcache_upsert`: 1,000 host entries into an ipcache of 10,000.
//! - `pod_event`: the agent's per-event path for a pod: 100 pod updates into the cluster index
//!   (new pods of existing label sets, then a label change of each).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Arc;

use ciliate::objects::index::ClusterIndex;
use ciliate::objects::PodInfo;
use ciliate::policy::engine::{EndpointView, PolicyEngine};
use ciliate::policy::identity::IdentityInfo;
use ciliate::policy::ipcache::IpCache;
use ciliate::policy::labels::{Label, Labels};
use ciliate::policy::mapstate::{MapKey, MapState};
use ciliate::policy::rule::{PolicyKey, PolicyKind, RuleOrigin, Section, PROTO_TCP};
use ciliate::policy::selector::{LabelSelector, Requirement, Selector};
use ciliate::policy::selector_cache::SelectorCache;

#[path = "shared/engine.rs"]
mod engine;
use engine::{add_policy, add_tier_policies, pod_labels};

const CASES: [&str; 8] = [
    "resolve_no_match",
    "resolve_selected_by_200",
    "resolve_tiers",
    "selector_cache_new_identity",
    "mapstate_diff",
    "entry_table_apply",
    "ipcache_upsert",
    "pod_event",
];

fn main() {
    let arg = std::env::args().nth(1).unwrap_or_default();
    match arg.as_str() {
        "--list" => CASES.iter().for_each(|c| println!("{c}")),
        "resolve_no_match" => resolve_no_match(),
        "resolve_selected_by_200" => resolve_selected_by_200(),
        "resolve_tiers" => resolve_tiers(),
        "selector_cache_new_identity" => selector_cache_new_identity(),
        "mapstate_diff" => mapstate_diff(),
        "entry_table_apply" => entry_table_apply(),
        "ipcache_upsert" => ipcache_upsert(),
        "pod_event" => pod_event(),
        // `cargo bench` runs every bench binary with `--bench`: nothing to time here.
        _ => println!("icount: instruction counts run by `cargo test --test icount` (valgrind)"),
    }
}

fn resolve_no_match() {
    let mut engine = PolicyEngine::new();
    for n in 0..200 {
        engine.allocate_identity(&pod_labels(&format!("ns-{}", n % 100), &format!("app-{n}")));
    }
    for r in 0..2_000 {
        let ns = if r % 4 == 0 {
            "target".to_string()
        } else {
            format!("ns-{}", r % 100)
        };
        add_policy(&mut engine, &format!(
            "{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: r{r}, namespace: {ns}}}, spec: {{endpointSelector: {{matchLabels: {{app: other-{r}}}}}, ingress: [{{fromEndpoints: [{{matchLabels: {{app: app-{}}}}}], toPorts: [{{ports: [{{port: \"80\", protocol: TCP}}]}}]}}]}}}}",
            r % 200
        ));
    }
    let labels = pod_labels("target", "mine");
    let id = engine.allocate_identity(&labels).id();
    let view = EndpointView {
        identity: id,
        labels: &labels,
        named_ports: &[],
        host: false,
    };
    assert!(engine.resolve(&view).map.is_empty());
    icount_measured_resolve(&engine, &view);
}

fn resolve_selected_by_200() {
    let (engine, labels, id) = selected_by_200();
    let view = EndpointView {
        identity: id,
        labels: &labels,
        named_ports: &[],
        host: false,
    };
    assert_eq!(engine.resolve(&view).selected_by.len(), 200);
    icount_measured_resolve(&engine, &view);
}

fn resolve_tiers() {
    let (mut engine, labels, id) = selected_by_200();
    add_tier_policies(&mut engine, 20);
    let view = EndpointView {
        identity: id,
        labels: &labels,
        named_ports: &[],
        host: false,
    };
    let resolved = engine.resolve(&view);
    assert!(resolved.tiered() && resolved.selected_by.len() == 220);
    // Cold: the tiers compile again (not shared from the resolution above).
    engine.clear_tier_memo();
    icount_measured_resolve(&engine, &view);
}

/// One endpoint selected by 200 rules (5 peers, 2 ports each) over 1,000 identities.
fn selected_by_200() -> (
    PolicyEngine,
    Labels,
    ciliate::policy::identity::NumericIdentity,
) {
    let mut engine = PolicyEngine::new();
    for i in 0..1000 {
        engine.allocate_identity(&pod_labels("x", &format!("app-{i}")));
    }
    for r in 0..200 {
        let vals: Vec<String> = (0..5)
            .map(|k| format!("app-{}", (r + k * 200) % 1000))
            .collect();
        add_policy(&mut engine, &format!(
            "{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: r{r}, namespace: x}}, spec: {{endpointSelector: {{}}, ingress: [{{fromEndpoints: [{{matchExpressions: [{{key: app, operator: In, values: [{}]}}]}}], toPorts: [{{ports: [{{port: \"{}\", protocol: TCP}}, {{port: \"{}\", protocol: UDP}}]}}]}}]}}}}",
            vals.join(", "), 1000 + r % 50, 2000 + r % 50
        ));
    }
    let labels = pod_labels("x", "app-0");
    let id = engine.allocate_identity(&labels).id();
    (engine, labels, id)
}

#[inline(never)]
fn icount_measured_resolve(engine: &PolicyEngine, view: &EndpointView) {
    black_box(engine.resolve(black_box(view)));
}

fn selector_cache_new_identity() {
    let mut cache = SelectorCache::new();
    for i in 0..2_000 {
        cache.add_selector(&Selector::labels(LabelSelector::new(vec![
            Requirement::equals(None, "app", &format!("app-{i}")),
            Requirement::equals(
                Some("k8s"),
                "io.kubernetes.pod.namespace",
                &format!("ns-{}", i % 100),
            ),
        ])));
    }
    let labels: Labels = [
        Label::k8s("app", "app-1242"),
        Label::k8s("io.kubernetes.pod.namespace", "ns-42"),
    ]
    .into_iter()
    .collect();
    let info = IdentityInfo {
        id: 90_000,
        labels: labels.into(),
        cidr: None,
    };
    icount_measured_selector_cache(&mut cache, &info);
}

#[inline(never)]
fn icount_measured_selector_cache(cache: &mut SelectorCache, info: &IdentityInfo) {
    assert_eq!(black_box(cache.add_identity(black_box(info))).len(), 1);
}

fn key(identity: u32, port: u16) -> MapKey {
    ciliate::policy::mapstate::ingress_key(identity, PROTO_TCP, port, port)
}

/// `mapstate_diff`'s two map states: 10,000 entries, 1,000 of them on another port.
fn two_map_states() -> (MapState, MapState) {
    let origin = Arc::new(RuleOrigin {
        policy: Arc::new(PolicyKey::new(
            PolicyKind::CiliumNetworkPolicy,
            Some("x"),
            "p",
        )),
        section: Section::Ingress,
        path: "spec.ingress[0]".into(),
        l7: false,
        tier: None,
    });
    let mut realized = MapState::new();
    let mut wanted = MapState::new();
    for i in 0..10_000u32 {
        realized.insert(key(1000 + i, 80), false, &origin);
        wanted.insert(
            key(1000 + i, if i % 10 == 0 { 443 } else { 80 }),
            false,
            &origin,
        );
    }
    (wanted, realized)
}

fn mapstate_diff() {
    let (wanted, realized) = two_map_states();
    icount_measured_diff(&wanted, &realized);
}

fn entry_table_apply() {
    let (wanted, realized) = two_map_states();
    let mut table = ciliate::datapath::abi::EntryTable::new();
    table.apply(&realized.diff_from(&MapState::new()));
    assert_eq!(table.len(), 10_000);
    let delta = wanted.diff_from(&realized);
    icount_measured_apply(&mut table, &delta);
}

#[inline(never)]
fn icount_measured_apply(
    table: &mut ciliate::datapath::abi::EntryTable,
    delta: &ciliate::policy::mapstate::MapDelta,
) {
    let changes = black_box(table.apply(black_box(delta)));
    assert_eq!(changes.len(), 2000);
}

#[inline(never)]
fn icount_measured_diff(wanted: &MapState, realized: &MapState) {
    let d = black_box(wanted.diff_from(black_box(realized)));
    assert_eq!((d.upserts.len(), d.deletes.len()), (1000, 1000));
}

fn ipcache_upsert() {
    let mut ipc = IpCache::new();
    for i in 0..10_000u32 {
        ipc.upsert(
            format!("10.1.{}.{}/32", i >> 8, i & 255).parse().unwrap(),
            1000 + i,
        );
    }
    let new: Vec<ipnet::IpNet> = (0..1_000u32)
        .map(|i| format!("10.2.{}.{}/32", i >> 8, i & 255).parse().unwrap())
        .collect();
    icount_measured_ipcache(&mut ipc, &new);
}

#[inline(never)]
fn icount_measured_ipcache(ipc: &mut IpCache, new: &[ipnet::IpNet]) {
    for (i, p) in new.iter().enumerate() {
        black_box(ipc.upsert(*p, 50_000 + i as u32));
    }
    assert_eq!(ipc.len(), 11_000);
}

fn pod(i: u32, app: &Arc<BTreeMap<String, String>>) -> PodInfo {
    PodInfo {
        namespace: format!("ns-{}", i % 10),
        name: format!("pod-{i}"),
        labels: app.clone(),
        ips: vec![format!("10.3.{}.{}", i >> 8, i & 255).parse().unwrap()],
        node: Some("node-1".into()),
        service_account: "default".into(),
        named_ports: vec![],
        workload: None,
    }
}

fn pod_event() {
    let mut engine = PolicyEngine::new();
    let mut index = ClusterIndex::for_node("node-1");
    let sets: Vec<Arc<BTreeMap<String, String>>> = (0..20)
        .map(|k| Arc::new([("app".to_string(), format!("app-{k}"))].into()))
        .collect();
    for i in 0..1_000u32 {
        let p = pod(i, &sets[i as usize % 20]);
        index.apply_pod(&mut engine, &p.key(), Some(p.clone()));
    }
    let updates: Vec<PodInfo> = (1_000..1_050u32)
        .map(|i| pod(i, &sets[i as usize % 20]))
        .chain((0..50u32).map(|i| pod(i, &sets[(i as usize + 1) % 20])))
        .collect();
    icount_measured_pod_events(&mut index, &mut engine, updates);
}

#[inline(never)]
fn icount_measured_pod_events(
    index: &mut ClusterIndex,
    engine: &mut PolicyEngine,
    updates: Vec<PodInfo>,
) {
    for p in updates {
        black_box(index.apply_pod(engine, &p.key(), Some(p)));
    }
}
