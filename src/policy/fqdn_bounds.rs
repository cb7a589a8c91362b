//! How large the FQDN cache may grow, and what goes first when it is full.
//!
//! Whatever a pod resolves enters the cache, so the cache is bounded three ways (Cilium's
//! `--tofqdns-endpoint-max-ip-per-hostname` and `--tofqdns-max-deferred-connection-deletes`,
//! and two of ciliate's own): addresses per name, names per endpoint, names in all, and
//! addresses kept past their TTL only because a connection still uses them ("zombies"). What is
//! over a bound is evicted in one batch (down to 90 % of it, so a flood costs one scan per
//! tenth of the bound, not one per name): first the least recently used names that no
//! `toFQDNs` selector matches and no connection uses, then the others, least recently used
//! first. A name one endpoint floods is evicted only from that endpoint's share while other
//! endpoints still ask for it. Every eviction is returned, so that the engine forgets what it
//! learned from it and the agent counts it (`ciliate_fqdn_cache_evictions_total{reason}`).

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;

use super::fqdn::{CacheEntry, FqdnCache};

/// See the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLimits {
    /// Addresses kept per name (`--tofqdns-endpoint-max-ip-per-hostname`, Cilium's 1,000).
    pub max_ips_per_name: usize,
    /// Names one endpoint's lookups may hold (`--tofqdns-endpoint-max-names`).
    pub max_names_per_endpoint: usize,
    /// Names in the cache in all (`--tofqdns-max-names`).
    pub max_names: usize,
    /// Addresses kept past their TTL because a connection still uses them
    /// (`--tofqdns-max-deferred-connection-deletes`, Cilium's 10,000).
    pub max_zombies: usize,
}

impl Default for CacheLimits {
    fn default() -> Self {
        CacheLimits {
            max_ips_per_name: 1_000,
            max_names_per_endpoint: 10_000,
            max_names: 100_000,
            max_zombies: 10_000,
        }
    }
}

/// Why something left the cache before its time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Eviction {
    /// A name had more addresses than `max_ips_per_name` (the soonest to expire went).
    IpsPerName,
    /// An endpoint asked for more names than `max_names_per_endpoint`.
    EndpointNames,
    /// The cache held more names than `max_names`.
    Names,
    /// More addresses outlived their TTL for a connection than `max_zombies`.
    Zombies,
}

impl Eviction {
    pub fn as_str(&self) -> &'static str {
        match self {
            Eviction::IpsPerName => "ips_per_name",
            Eviction::EndpointNames => "endpoint_names",
            Eviction::Names => "names",
            Eviction::Zombies => "zombies",
        }
    }
}

/// What one bounding pass took out: each (name, address) the cache no longer holds, and why.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evicted {
    pub gone: Vec<(String, IpAddr)>,
    pub counts: Vec<(Eviction, usize)>,
}

impl Evicted {
    fn count(&mut self, why: Eviction, n: usize) {
        if n == 0 {
            return;
        }
        match self.counts.iter_mut().find(|(w, _)| *w == why) {
            Some((_, c)) => *c += n,
            None => self.counts.push((why, n)),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

/// Removes `endpoints` from the per-endpoint counts (a name that went).
pub(super) fn uncount(counts: &mut Option<HashMap<u64, usize>>, endpoints: &BTreeSet<u64>) {
    let Some(counts) = counts.as_mut() else {
        return;
    };
    for ep in endpoints {
        if let Some(c) = counts.get_mut(ep) {
            *c = c.saturating_sub(1);
            if *c == 0 {
                counts.remove(ep);
            }
        }
    }
}

/// The batch that brings `n` under `limit`: down to 90 % of it.
fn over(n: usize, limit: usize) -> usize {
    if n <= limit {
        return 0;
    }
    n - limit.saturating_sub(limit / 10)
}

impl FqdnCache {
    /// Counts the names each endpoint asked for, once (after a load or a restore).
    pub(super) fn count_endpoints(&mut self) {
        if self.per_endpoint.is_some() {
            return;
        }
        let mut counts: HashMap<u64, usize> = HashMap::new();
        // After a load the clock goes on from the newest name's use.
        self.clock = self
            .clock
            .max(self.names.values().map(|e| e.used).max().unwrap_or(0));
        for e in self.names.values() {
            for ep in &e.endpoints {
                *counts.entry(*ep).or_default() += 1;
            }
        }
        self.per_endpoint = Some(counts);
    }

    /// Names `endpoint` asked for that the cache holds.
    pub fn names_of_endpoint(&mut self, endpoint: u64) -> usize {
        self.count_endpoints();
        self.per_endpoint
            .as_ref()
            .and_then(|c| c.get(&endpoint).copied())
            .unwrap_or(0)
    }

    /// Brings the cache within `limits` after `name` was learned for `endpoint`. `referenced`
    /// tells the names to keep longest (a `toFQDNs` selector matches them, or a connection
    /// uses one of their addresses).
    pub fn bound(
        &mut self,
        limits: &CacheLimits,
        name: &str,
        endpoint: Option<u64>,
        referenced: &dyn Fn(&str, &CacheEntry) -> bool,
    ) -> Evicted {
        self.count_endpoints();
        let mut out = Evicted::default();
        self.bound_ips(limits, name, &mut out);
        if let Some(ep) = endpoint {
            let n = over(self.names_of_endpoint(ep), limits.max_names_per_endpoint);
            if n > 0 {
                self.evict(n, Some(ep), referenced, Eviction::EndpointNames, &mut out);
            }
        }
        let n = over(self.names.len(), limits.max_names);
        if n > 0 {
            self.evict(n, None, referenced, Eviction::Names, &mut out);
        }
        out
    }

    /// A name over `max_ips_per_name` keeps the addresses that expire last.
    fn bound_ips(&mut self, limits: &CacheLimits, name: &str, out: &mut Evicted) {
        let key = super::fqdn::normalize(name);
        let Some(e) = self.names.get_mut(&key) else {
            return;
        };
        if e.ips.len() <= limits.max_ips_per_name {
            return;
        }
        let mut by_expiry: Vec<_> = e.ips.iter().map(|c| (c.expires_at, c.ip)).collect();
        by_expiry.sort();
        let n = e.ips.len() - limits.max_ips_per_name;
        let gone: BTreeSet<IpAddr> = by_expiry[..n].iter().map(|(_, ip)| *ip).collect();
        e.ips.retain(|c| !gone.contains(&c.ip));
        out.gone
            .extend(gone.into_iter().map(|ip| (key.clone(), ip)));
        out.count(Eviction::IpsPerName, n);
    }

    /// Evicts `n` names (of `endpoint`'s, or of all): unreferenced before referenced, least
    /// recently used first. For one endpoint, a name others asked for too only loses that
    /// endpoint.
    fn evict(
        &mut self,
        n: usize,
        endpoint: Option<u64>,
        referenced: &dyn Fn(&str, &CacheEntry) -> bool,
        why: Eviction,
        out: &mut Evicted,
    ) {
        let mut candidates: Vec<(bool, u64, &String)> = self
            .names
            .iter()
            .filter(|(_, e)| endpoint.is_none_or(|ep| e.endpoints.contains(&ep)))
            .map(|(k, e)| (referenced(k, e), e.used, k))
            .collect();
        let n = n.min(candidates.len());
        if n == 0 {
            return;
        }
        candidates.select_nth_unstable(n - 1);
        let chosen: Vec<String> = candidates[..n]
            .iter()
            .map(|(_, _, k)| (*k).clone())
            .collect();
        for key in chosen {
            let Some(e) = self.names.get_mut(&key) else {
                continue;
            };
            if let Some(ep) = endpoint {
                if e.endpoints.len() > 1 {
                    e.endpoints.remove(&ep);
                    uncount(&mut self.per_endpoint, &BTreeSet::from([ep]));
                    continue;
                }
            }
            let Some(e) = self.names.remove(&key) else {
                continue;
            };
            uncount(&mut self.per_endpoint, &e.endpoints);
            out.gone.extend(e.ips.iter().map(|c| (key.clone(), c.ip)));
        }
        out.count(why, n);
    }

    /// Addresses past their TTL that only a connection keeps (`expires_at <= now`): past
    /// `max_zombies`, those that expired longest ago go (their connections are cut by the next
    /// policy lookup: fail closed).
    pub fn bound_zombies(&mut self, limits: &CacheLimits, now: u64) -> Evicted {
        self.count_endpoints();
        let mut zombies: Vec<(u64, String, IpAddr)> = self
            .names
            .iter()
            .flat_map(|(k, e)| {
                e.ips
                    .iter()
                    .filter(|c| c.expires_at <= now)
                    .map(move |c| (c.expires_at, k.clone(), c.ip))
            })
            .collect();
        let mut out = Evicted::default();
        if zombies.len() <= limits.max_zombies {
            return out;
        }
        zombies.sort();
        let n = zombies.len() - limits.max_zombies;
        for (_, key, ip) in zombies.into_iter().take(n) {
            if let Some(e) = self.names.get_mut(&key) {
                e.ips.retain(|c| c.ip != ip);
                if e.ips.is_empty() {
                    let endpoints = std::mem::take(&mut e.endpoints);
                    self.names.remove(&key);
                    uncount(&mut self.per_endpoint, &endpoints);
                }
            }
            out.gone.push((key, ip));
        }
        out.count(Eviction::Zombies, n);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ip(n: u32) -> IpAddr {
        IpAddr::V4(std::net::Ipv4Addr::from(0xc000_0200 + n))
    }

    fn limits(ips: usize, per_ep: usize, names: usize) -> CacheLimits {
        CacheLimits {
            max_ips_per_name: ips,
            max_names_per_endpoint: per_ep,
            max_names: names,
            max_zombies: 3,
        }
    }

    fn learn(c: &mut FqdnCache, l: &CacheLimits, name: &str, ips: &[IpAddr], ep: u64) -> Evicted {
        let s = Duration::from_secs;
        c.learn(name, ips, s(60), s(0), Some(ep), 1000);
        c.bound(l, name, Some(ep), &|k, _| k.ends_with(".example.com"))
    }

    #[test]
    fn one_endpoints_flood_is_bounded_to_its_share_and_others_names_stay() {
        let l = limits(10, 100, 1_000);
        let mut c = FqdnCache::default();
        // Endpoint 2 asks for a name a policy selects, and a shared one.
        learn(&mut c, &l, "api.example.com", &[ip(1)], 2);
        learn(&mut c, &l, "shared.test", &[ip(2)], 2);
        // Endpoint 1 floods: 10,000 names, the shared one among its first.
        learn(&mut c, &l, "shared.test", &[ip(2)], 1);
        let mut evicted = 0;
        for i in 0..10_000 {
            let e = learn(&mut c, &l, &format!("n{i}.flood.test"), &[ip(3)], 1);
            evicted += e
                .counts
                .iter()
                .filter(|(w, _)| *w == Eviction::EndpointNames)
                .map(|(_, n)| n)
                .sum::<usize>();
        }
        assert!(c.names_of_endpoint(1) <= 100, "{}", c.names_of_endpoint(1));
        let counted = c
            .names
            .values()
            .filter(|e| e.endpoints.contains(&1))
            .count();
        assert_eq!(c.names_of_endpoint(1), counted);
        assert_eq!(
            c.len(),
            c.names_of_endpoint(1) + 2,
            "endpoint 2's names + 1's share"
        );
        assert_eq!(evicted, 10_001 - c.names_of_endpoint(1));
        // Endpoint 2 keeps both its names; the shared one lost only endpoint 1.
        assert_eq!(c.names_of_endpoint(2), 2);
        assert_eq!(c.names["shared.test"].endpoints, BTreeSet::from([2]));
        assert!(c.names.contains_key("api.example.com"));
        // The newest of the flood stayed, the oldest went.
        assert!(c.names.contains_key("n9999.flood.test"));
        assert!(!c.names.contains_key("n0.flood.test"));
    }

    #[test]
    fn in_all_unreferenced_names_go_before_referenced_ones_least_recently_used_first() {
        let l = limits(10, 1_000, 20);
        let mut c = FqdnCache::default();
        for i in 0..10 {
            learn(&mut c, &l, &format!("s{i}.example.com"), &[ip(i)], i as u64);
        }
        for i in 0..40 {
            let e = learn(
                &mut c,
                &l,
                &format!("x{i}.test"),
                &[ip(100 + i)],
                50 + i as u64,
            );
            for (name, _) in &e.gone {
                assert!(
                    name.ends_with(".test"),
                    "{name} evicted before unreferenced names"
                );
            }
        }
        assert!(c.len() <= 20);
        for i in 0..10 {
            assert!(c.names.contains_key(&format!("s{i}.example.com")));
        }
        assert!(c.names.contains_key("x39.test") && !c.names.contains_key("x0.test"));
        // The per-endpoint counts follow the evictions.
        assert_eq!(c.names_of_endpoint(50), 0);
        assert_eq!(c.names_of_endpoint(89), 1);
    }

    #[test]
    fn a_name_keeps_the_addresses_that_expire_last_and_zombies_are_bounded() {
        let l = limits(2, 100, 100);
        let mut c = FqdnCache::default();
        let s = Duration::from_secs;
        c.learn("a.test", &[ip(1)], s(10), s(0), Some(1), 1000);
        c.learn("a.test", &[ip(2)], s(30), s(0), Some(1), 1000);
        c.learn("a.test", &[ip(3)], s(20), s(0), Some(1), 1000);
        let e = c.bound(&l, "a.test", Some(1), &|_, _| false);
        assert_eq!(e.gone, vec![("a.test".to_string(), ip(1))]);
        assert_eq!(e.counts, vec![(Eviction::IpsPerName, 1)]);
        // Five addresses past their TTL kept alive by connections: three stay.
        for i in 10..15 {
            c.learn(
                &format!("z{i}.test"),
                &[ip(i)],
                s(i as u64),
                s(0),
                Some(2),
                1000,
            );
        }
        assert!(c.expire(2000, &|_, _| true).is_empty(), "all in use");
        let e = c.bound_zombies(&l, 2000);
        assert_eq!(e.counts, vec![(Eviction::Zombies, 4)], "{e:?}");
        // The four that expired longest ago went; a.test's two and z14 stay.
        let gone: Vec<&str> = e.gone.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(gone, ["z10.test", "z11.test", "z12.test", "z13.test"]);
        assert!(c.names.contains_key("z14.test") && c.names["a.test"].ips.len() == 2);
        assert_eq!(c.names_of_endpoint(2), 1);
    }

    #[test]
    fn counts_are_rebuilt_after_a_load() {
        let mut c = FqdnCache::default();
        let s = Duration::from_secs;
        c.learn("a.test", &[ip(1)], s(10), s(0), Some(1), 1000);
        c.learn("b.test", &[ip(2)], s(10), s(0), Some(1), 1000);
        let text = serde_json::to_string(&c).unwrap();
        let mut back: FqdnCache = serde_json::from_str(&text).unwrap();
        assert_eq!(back.names_of_endpoint(1), 2);
    }
}
