//! Benchmarks for the policy-engine targets of issue #2:
//! - `resolve/no_matching_rules_20k`: one endpoint against 20,000 rules none of which select it.
//! - `resolve/selected_by_1000_rules`: one endpoint selected by 1,000 rules over 1,000 identities.
//! - `resolve/tiers_100x25_plus_1000_cnp` (and `_shared`, its tiers' compilation shared with an
//!   endpoint resolved before, `policy::tier_memo`): the same endpoint also selected by 100
//!   ClusterNetworkPolicies of 25 rules each (issue #28: <= 1 ms).
//! - `resolve/tiers_write_floor`: writing that resolution's tier entries alone (34,000), through
//!   the compiler's write path: what the map representation costs with nothing to decide.
//! - `selector_cache/new_identity_10k_selectors`: an identity appearing (and going) with 10,000
//!   selectors cached.
//! - `simulate/world_5000_pods`: `simulate` on 5,000 pods, 500 namespaces, 2,000 policies and
//!   10,000 probes, YAML parsing included.

/// The ciliate binary's allocator (`ciliate::memory`), so that in-process figures are the agent's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// With the binary's options (`ciliate::memory`), set before anything allocates as the binary
/// sets them: mimalloc's defaults commit arenas eagerly, in huge pages that a purge gives back
/// and the next allocation faults in again, 2 MiB zeroed at a time (a tenth of the CPU of a
/// change selecting 1,000 endpoints in `benches/agent.rs`), which the agent never pays.
#[used]
#[link_section = ".init_array"]
static CONFIGURE_ALLOCATOR: extern "C" fn() = ciliate::memory::configure_allocator;

use criterion::{black_box, criterion_group, criterion_main, Criterion};

use ciliate::policy::engine::{EndpointView, PolicyEngine};
use ciliate::policy::identity::IdentityInfo;
use ciliate::policy::labels::{Label, Labels};
use ciliate::policy::selector::{LabelSelector, Operator, Requirement, Selector};
use ciliate::policy::selector_cache::SelectorCache;
use ciliate::simulate::generate::{generate_world, WorldSize};

#[path = "shared/engine.rs"]
mod engine;
use engine::{add_policy, add_tier_policies, pod_labels};

/// A pod endpoint of `identity` with `labels`, without named ports.
fn pod_view(
    identity: ciliate::policy::identity::NumericIdentity,
    labels: &Labels,
) -> EndpointView<'_> {
    EndpointView {
        identity,
        labels,
        named_ports: &[],
        host: false,
    }
}

/// The datapath entries a map becomes, and the hash lookups a new connection costs at most
/// (one per port prefix length in use, per identity class: `bpf/lib/policy.h`).
fn datapath_shape(map: &ciliate::policy::mapstate::MapState) -> String {
    let (mut entries, mut id, mut any) = (0usize, 0u32, 0u32);
    for (k, _) in map.entries() {
        for e in ciliate::datapath::abi::expand_key(&k) {
            entries += 1;
            let bit = if e.protocol == 0 {
                1 << 31
            } else {
                1u32 << e.port_prefix_len
            };
            if e.identity == 0 {
                any |= bit;
            } else {
                id |= bit;
            }
        }
    }
    format!(
        "{entries} datapath entries, at most {} lookups per new connection ({} for the peer's identity, {} for any peer)",
        id.count_ones() + any.count_ones(),
        id.count_ones(),
        any.count_ones()
    )
}

fn bench_resolve(c: &mut Criterion) {
    // 20,000 rules in 100 namespaces (and the endpoint's own), none selecting the endpoint.
    let mut engine = PolicyEngine::new();
    for n in 0..200 {
        engine.allocate_identity(&pod_labels(&format!("ns-{}", n % 100), &format!("app-{n}")));
    }
    for r in 0..20_000 {
        let ns = if r % 4 == 0 {
            "target".to_string()
        } else {
            format!("ns-{}", r % 100)
        };
        add_policy(
            &mut engine,
            &format!(
                "{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: r{r}, namespace: {ns}}}, spec: {{endpointSelector: {{matchLabels: {{app: other-{r}}}}}, ingress: [{{fromEndpoints: [{{matchLabels: {{app: app-{}}}}}], toPorts: [{{ports: [{{port: \"80\", protocol: TCP}}]}}]}}]}}}}",
                r % 200
            ),
        );
    }
    let labels = pod_labels("target", "mine");
    let id = engine.allocate_identity(&labels).id();
    let view = pod_view(id, &labels);
    let resolved = engine.resolve(&view);
    assert!(resolved.map.is_empty() && resolved.selected_by.is_empty());
    c.bench_function("resolve/no_matching_rules_20k", |b| {
        b.iter(|| black_box(engine.resolve(black_box(&view))))
    });

    // 1,000 identities; 1,000 rules select the endpoint, each allowing 5 peer identities on 2 ports.
    let mut engine = PolicyEngine::new();
    for i in 0..1000 {
        engine.allocate_identity(&pod_labels("x", &format!("app-{i}")));
    }
    for r in 0..1000 {
        let vals: Vec<String> = (0..5)
            .map(|k| format!("app-{}", (r + k * 200) % 1000))
            .collect();
        add_policy(
            &mut engine,
            &format!(
                "{{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: r{r}, namespace: x}}, spec: {{endpointSelector: {{}}, ingress: [{{fromEndpoints: [{{matchExpressions: [{{key: app, operator: In, values: [{}]}}]}}], toPorts: [{{ports: [{{port: \"{}\", protocol: TCP}}, {{port: \"{}\", protocol: UDP}}]}}]}}]}}}}",
                vals.join(", "),
                1000 + r % 50,
                2000 + r % 50
            ),
        );
    }
    let labels = pod_labels("x", "app-0");
    let id = engine.allocate_identity(&labels).id();
    let view = pod_view(id, &labels);
    let resolved = engine.resolve(&view);
    assert_eq!(resolved.selected_by.len(), 1000);
    assert!(
        resolved.map.len() >= 1000,
        "map has {} entries",
        resolved.map.len()
    );
    eprintln!(
        "selected_by_1000_rules: map state has {} entries; {}",
        resolved.map.len(),
        datapath_shape(&resolved.map)
    );
    c.bench_function("resolve/selected_by_1000_rules", |b| {
        b.iter(|| black_box(engine.resolve(black_box(&view))))
    });

    // The same, plus 100 ClusterNetworkPolicies of 25 rules each (issue #28): Admin and
    // Baseline, Allow/Deny/Pass, peers by pod selector (5 apps) or by namespace, on TCP ports.
    add_tier_policies(&mut engine, 100);
    let resolved = engine.resolve(&view);
    assert!(resolved.tiered() && resolved.selected_by.len() == 1100);
    eprintln!(
        "tiers_100x25_plus_1000_cnp: map state has {} entries; {}",
        resolved.map.len(),
        datapath_shape(&resolved.map)
    );
    // Cold: every resolution compiles the tiers (the first endpoint of its kind); warm: the
    // tiers' compilation is shared (`policy::tier_memo`) with an endpoint resolved before.
    // One resolution per batch: criterion keeps a batch's results until its end, and hundreds
    // of 34,000-entry maps alive at once made the figure one of fresh pages (the agent drops
    // an endpoint's previous map once the new one is in place).
    c.bench_function("resolve/tiers_100x25_plus_1000_cnp", |b| {
        b.iter_batched(
            || engine.clear_tier_memo(),
            |()| black_box(engine.resolve(black_box(&view))),
            criterion::BatchSize::PerIteration,
        )
    });
    c.bench_function("resolve/tiers_100x25_plus_1000_cnp_shared", |b| {
        b.iter(|| black_box(engine.resolve(black_box(&view))))
    });
    bench_write_floor(c, &resolved.map);
}

/// The floor of the cold figure under today's map representation: writing the entries of the
/// tiers' result alone (the same keys, deny flags and origins), through the compiler's own
/// write path (a scratch `Group` per identity, `take_exact`, `MapState::insert_group`), with
/// nothing to decide.
fn bench_write_floor(c: &mut Criterion, map: &ciliate::policy::mapstate::MapState) {
    use ciliate::policy::mapstate::{Group, MapState};
    use ciliate::policy::rule::Direction;
    type Row = (
        (u8, u16, u16),
        bool,
        std::sync::Arc<ciliate::policy::rule::RuleOrigin>,
    );
    let mut by_id: Vec<(u32, Vec<Row>)> = Vec::new();
    for (k, e) in map.entries() {
        if k.direction != Direction::Ingress {
            continue;
        }
        let row = (
            (k.protocol, k.port_lo, k.port_hi),
            e.deny,
            e.derived_from[0].clone(),
        );
        match by_id.last_mut() {
            Some((id, rows)) if *id == k.identity => rows.push(row),
            _ => by_id.push((k.identity, vec![row])),
        }
    }
    let entries: usize = by_id.iter().map(|(_, r)| r.len()).sum();
    eprintln!(
        "tiers_write_floor: {entries} entries of {} identities",
        by_id.len()
    );
    // As the cold resolution: one map per batch, dropped outside the timing.
    c.bench_function("resolve/tiers_write_floor", |b| {
        b.iter_batched(
            || (),
            |()| {
                let mut out = MapState::new();
                let mut scratch = Group::new(0);
                for (id, rows) in &by_id {
                    scratch.reset(*id);
                    for (ports, deny, origin) in rows {
                        scratch.insert_l7(*ports, *deny, origin, None);
                    }
                    out.insert_group(Direction::Ingress, scratch.take_exact());
                }
                black_box(out)
            },
            criterion::BatchSize::PerIteration,
        )
    });
}

fn bench_selector_cache(c: &mut Criterion) {
    let mut cache = SelectorCache::new();
    let ns_req = |n: usize| {
        Requirement::equals(
            Some("k8s"),
            "io.kubernetes.pod.namespace",
            &format!("ns-{}", n % 100),
        )
    };
    for i in 0..10_000 {
        let sel = if i % 100 == 0 {
            // 1% of selectors have no equality requirement and must be tested against everything.
            LabelSelector::new(vec![Requirement::new(
                None,
                "tier".into(),
                Operator::NotIn,
                vec![format!("t{i}")],
            )])
        } else {
            LabelSelector::new(vec![
                Requirement::equals(None, "app", &format!("app-{i}")),
                ns_req(i),
            ])
        };
        cache.add_selector(&Selector::labels(sel));
    }
    for i in 0..2000 {
        let l: Labels = [
            Label::k8s("app", &format!("app-{i}")),
            Label::k8s("io.kubernetes.pod.namespace", &format!("ns-{}", i % 100)),
        ]
        .into_iter()
        .collect();
        cache.add_identity(&IdentityInfo {
            id: 256 + i,
            labels: l.into(),
            cidr: None,
        });
    }
    assert_eq!(cache.len(), 10_000);
    let labels: Labels = [
        Label::k8s("app", "app-4242"),
        Label::k8s("tier", "front"),
        Label::k8s("io.kubernetes.pod.namespace", "ns-42"),
        Label::k8s("io.cilium.k8s.policy.cluster", "default"),
    ]
    .into_iter()
    .collect();
    let info = IdentityInfo {
        id: 90_000,
        labels: labels.into(),
        cidr: None,
    };
    let newly = cache.add_identity(&info);
    assert_eq!(
        newly.len(),
        101,
        "the app-4242 selector and the 100 NotIn selectors"
    );
    cache.remove_identity(info.id);
    c.bench_function("selector_cache/new_identity_10k_selectors", |b| {
        b.iter(|| {
            let n = cache.add_identity(black_box(&info));
            cache.remove_identity(info.id);
            black_box(n)
        })
    });
}

fn bench_simulate(c: &mut Criterion) {
    let text = generate_world(
        WorldSize {
            namespaces: 500,
            pods: 5000,
            policies: 2000,
            probes: 10_000,
        },
        1,
    );
    let mut group = c.benchmark_group("simulate");
    group.sample_size(10);
    group.bench_function("world_5000_pods", |b| {
        b.iter(|| {
            let sim = ciliate::simulate::simulate(black_box(&text)).expect("usable world");
            assert_eq!(sim.results.len(), 10_000);
            black_box(sim)
        })
    });
    group.finish();
}

criterion_group!(benches, bench_resolve, bench_selector_cache, bench_simulate);
criterion_main!(benches);
