//! Generates large synthetic worlds for benchmarks and load tests (`ciliate policy generate-world`).
//!
//! Deterministic for a given seed. The mix of policies follows what clusters hold: mostly
//! namespaced CNPs and KNPs selecting by app label, some CIDR and deny rules, a few clusterwide
//! policies and entity rules.

use std::fmt::Write;

/// Size of a generated world.
#[derive(Debug, Clone, Copy)]
pub struct WorldSize {
    pub namespaces: usize,
    pub pods: usize,
    pub policies: usize,
    pub probes: usize,
}

/// A small xorshift generator: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const APPS: usize = 50;
const TIERS: [&str; 3] = ["front", "back", "db"];

fn pod_ip(i: usize) -> String {
    format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256)
}

/// Generates a world file (YAML text) of the given size.
pub fn generate_world(size: WorldSize, seed: u64) -> String {
    let mut rng = Rng(seed.max(1));
    let mut s = String::with_capacity(size.pods * 150 + size.policies * 400 + size.probes * 60);
    let nss = size.namespaces.max(1);
    s.push_str("namespaces:\n");
    for n in 0..nss {
        let _ = writeln!(
            s,
            "  ns-{n}: {{team: t{}, env: {}}}",
            n % 20,
            if n % 3 == 0 { "prod" } else { "dev" }
        );
    }
    s.push_str("pods:\n");
    for i in 0..size.pods {
        let _ = writeln!(
            s,
            "  - {{namespace: ns-{}, name: pod-{i}, labels: {{app: app-{}, tier: {}}}, ips: [{}], ports: [{{name: http, port: 8080, protocol: TCP}}]}}",
            i % nss,
            i % APPS,
            TIERS[i % 3],
            pod_ip(i)
        );
    }
    s.push_str("policies:\n");
    for p in 0..size.policies {
        let ns = rng.below(nss);
        let app = rng.below(APPS);
        let peer = rng.below(APPS);
        let port = 8000 + rng.below(100);
        match p % 20 {
            0..=7 => {
                let _ = writeln!(
                    s,
                    "  - {{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: cnp-{p}, namespace: ns-{ns}}}, spec: {{endpointSelector: {{matchLabels: {{app: app-{app}}}}}, ingress: [{{fromEndpoints: [{{matchLabels: {{app: app-{peer}}}}}], toPorts: [{{ports: [{{port: \"{port}\", protocol: TCP}}, {{port: http}}]}}]}}], egress: [{{toEndpoints: [{{matchLabels: {{tier: {}}}}}]}}]}}}}",
                    TIERS[p % 3]
                );
            }
            8..=13 => {
                let _ = writeln!(
                    s,
                    "  - {{apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, metadata: {{name: knp-{p}, namespace: ns-{ns}}}, spec: {{podSelector: {{matchLabels: {{app: app-{app}}}}}, policyTypes: [Ingress], ingress: [{{from: [{{namespaceSelector: {{matchLabels: {{team: t{}}}}}, podSelector: {{matchExpressions: [{{key: tier, operator: In, values: [front, back]}}]}}}}], ports: [{{port: {port}, endPort: {}}}]}}]}}}}",
                    rng.below(20),
                    port + 10
                );
            }
            14 | 15 => {
                let _ = writeln!(
                    s,
                    "  - {{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: cidr-{p}, namespace: ns-{ns}}}, spec: {{endpointSelector: {{matchLabels: {{app: app-{app}}}}}, egress: [{{toCIDRSet: [{{cidr: {}.0.0.0/8, except: [{}.{}.0.0/16]}}], toPorts: [{{ports: [{{port: \"443\"}}]}}]}}]}}}}",
                    20 + p % 100,
                    20 + p % 100,
                    rng.below(256)
                );
            }
            16 | 17 => {
                let _ = writeln!(
                    s,
                    "  - {{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: deny-{p}, namespace: ns-{ns}}}, spec: {{endpointSelector: {{matchLabels: {{app: app-{app}}}}}, enableDefaultDeny: {{ingress: false}}, ingressDeny: [{{fromEndpoints: [{{matchLabels: {{app: app-{peer}}}}}], toPorts: [{{ports: [{{port: \"{port}\", protocol: TCP}}]}}]}}]}}}}"
                );
            }
            18 => {
                let _ = writeln!(
                    s,
                    "  - {{apiVersion: cilium.io/v2, kind: CiliumClusterwideNetworkPolicy, metadata: {{name: ccnp-{p}}}, spec: {{endpointSelector: {{matchLabels: {{app: app-{app}, tier: {}}}}}, ingress: [{{fromEndpoints: [{{matchLabels: {{\"k8s:io.kubernetes.pod.namespace\": ns-{ns}}}}}]}}]}}}}",
                    TIERS[p % 3]
                );
            }
            _ => {
                let _ = writeln!(
                    s,
                    "  - {{apiVersion: cilium.io/v2, kind: CiliumNetworkPolicy, metadata: {{name: ent-{p}, namespace: ns-{ns}}}, spec: {{endpointSelector: {{}}, ingress: [{{fromEntities: [cluster]}}], egress: [{{toEntities: [world], toPorts: [{{ports: [{{port: \"443\", protocol: TCP}}]}}]}}]}}}}"
                );
            }
        }
    }
    s.push_str("probes:\n");
    for k in 0..size.probes {
        let from = rng.below(size.pods.max(1));
        if size.pods == 0 {
            break;
        }
        if k % 10 == 9 {
            let _ = writeln!(
                s,
                "  - {{from: ns-{}/pod-{from}, to: {}.1.2.3, port: 443}}",
                from % nss,
                20 + k % 100
            );
            continue;
        }
        let to = rng.below(size.pods);
        let port = if k % 2 == 0 {
            8080
        } else {
            8000 + rng.below(100)
        };
        let _ = writeln!(
            s,
            "  - {{from: ns-{}/pod-{from}, to: ns-{}/pod-{to}, port: {port}}}",
            from % nss,
            to % nss
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_world_simulates_cleanly() {
        let text = generate_world(
            WorldSize {
                namespaces: 10,
                pods: 60,
                policies: 40,
                probes: 50,
            },
            7,
        );
        let sim = crate::simulate::simulate(&text).expect("generated world is usable");
        assert!(sim.rejections.is_empty(), "{:?}", sim.rejections);
        assert_eq!(sim.results.len(), 50);
        assert!(sim.results.iter().any(|r| r.verdict == "allow"));
        assert!(sim.results.iter().any(|r| r.verdict == "deny"));
    }

    #[test]
    fn generation_is_deterministic() {
        let size = WorldSize {
            namespaces: 3,
            pods: 5,
            policies: 20,
            probes: 5,
        };
        assert_eq!(generate_world(size, 1), generate_world(size, 1));
    }
}
