//! DNS names: what the DNS proxy learned, their expiry, and the cache a previous run
//! saved.

use super::*;
use crate::traceable;

// ------------------------------------------------------------------ DNS names

/// The DNS proxy forwarded an allowed answer: `name` resolved to `ips` for `endpoint`. `done`
/// is told once every selecting endpoint's policy map and the ipcache hold the addresses.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct LearnFqdn {
    pub name: String,
    pub ips: Vec<IpAddr>,
    pub ttl: std::time::Duration,
    pub endpoint: Option<EndpointId>,
    pub done: tokio::sync::oneshot::Sender<()>,
}
traceable!(LearnFqdn, "LearnFqdn", |m| format!(
    "{} -> {:?}",
    m.name, m.ips
));

impl Handler<LearnFqdn> for PolicyRepoActor {
    type Result = ();
    fn handle(&mut self, msg: LearnFqdn, _: &mut Context<Self>) {
        let evicted = self.cache_learning(&msg);
        let mut change = self.engine_mut().learn_selected_fqdn(&msg.name, &msg.ips);
        for c in evicted {
            change.absorb_peers(c);
        }
        if change.affected.is_empty() && ipcache_of(&change).is_empty() {
            // A name no selector matches (or nothing new): nothing to wait for.
            let _ = msg.done.send(());
            return;
        }
        self.react(
            Reaction::new(format!(
                "fqdn {}",
                crate::policy::fqdn::normalize(&msg.name)
            ))
            .affecting(change.affected.iter().copied())
            .forced() // selections changed, not the revision
            .only_peers(change.peers.clone())
            .ipcache(ipcache_of(&change))
            .waited_for(msg.done),
        );
    }
}

/// Addresses past their TTL (and no longer used by a tracked connection) leave the cache, and
/// the selectors of their names let go.
#[derive(Debug, Message)]
#[rtype(result = "usize")]
pub struct ExpireFqdn {
    pub now: u64,
}
traceable!(ExpireFqdn, "ExpireFqdn", |m| format!("at {}", m.now));

impl Handler<ExpireFqdn> for PolicyRepoActor {
    type Result = usize;
    fn handle(&mut self, msg: ExpireFqdn, _: &mut Context<Self>) -> usize {
        let dns = self.shared.dns.clone();
        let (mut gone, zombies) = {
            let mut cache = dns.cache();
            let gone = cache.expire(msg.now, &|ip, at| dns.may_be_in_use(ip, at));
            (gone, cache.bound_zombies(&dns.limits, msg.now))
        };
        if !zombies.is_empty() {
            self.forget_evicted(crate::policy::fqdn_bounds::Evicted {
                gone: Vec::new(),
                counts: zombies.counts,
            });
            gone.extend(zombies.gone);
        }
        if gone.is_empty() {
            if std::mem::take(&mut self.fqdn_dirty) {
                self.fqdn_changed();
            }
            return 0;
        }
        self.fqdn_changed();
        let changes: Vec<_> = {
            let mut e = self.engine_mut();
            gone.iter().map(|(n, ip)| e.forget_fqdn(n, *ip)).collect()
        };
        self.react_to_all(format!("{} DNS addresses expired", gone.len()), &changes);
        gone.len()
    }
}

/// Start-up, before endpoints are restored: the cache a previous run saved selects again.
#[derive(Debug, Message)]
#[rtype(result = "usize")]
pub struct RestoreFqdn {
    pub cache: crate::policy::fqdn::FqdnCache,
}
traceable!(RestoreFqdn, "RestoreFqdn", |m| format!(
    "{} names",
    m.cache.len()
));

impl Handler<RestoreFqdn> for PolicyRepoActor {
    type Result = usize;
    fn handle(&mut self, msg: RestoreFqdn, _: &mut Context<Self>) -> usize {
        let changes: Vec<_> = {
            let mut e = self.engine_mut();
            let learn = |(n, c): (&String, &crate::policy::fqdn::CacheEntry)| {
                e.learn_selected_fqdn(n, &c.ips.iter().map(|i| i.ip).collect::<Vec<_>>())
            };
            msg.cache.names.iter().map(learn).collect()
        };
        let n = msg.cache.len();
        *self.shared.dns.cache() = msg.cache;
        self.fqdn_changed();
        self.react_to_all(format!("{n} DNS names restored"), &changes);
        n
    }
}

impl PolicyRepoActor {
    /// The engine's FQDN generation and the rules (peer rules) the policy `key` has now (before
    /// a change).
    pub(super) fn fqdn_generation_and_rules(&self, key: &PolicyKey) -> (u64, usize) {
        let engine = self.engine();
        let rules = engine.policy(key).map_or(0, |p| {
            p.rules.iter().map(|r| r.peer_rules.len().max(1)).sum()
        });
        (engine.fqdn_generation(), rules)
    }

    /// Puts a learning into the FQDN cache and keeps the cache within its bounds; returns
    /// what forgetting the evicted names did to the engine.
    pub(super) fn cache_learning(
        &mut self,
        msg: &LearnFqdn,
    ) -> Vec<crate::policy::engine::PolicyChange> {
        let dns = self.shared.dns.clone();
        let now = crate::policy::fqdn::unix_now();
        let ep = msg.endpoint.map(|e| e as u64);
        let (selected, new, evicted) = {
            let engine = self.engine();
            let referenced = |name: &str, e: &crate::policy::fqdn::CacheEntry| {
                engine.fqdn_selected(name) || e.ips.iter().any(|c| dns.is_live(c.ip))
            };
            let mut cache = dns.cache();
            let new = cache.learn(&msg.name, &msg.ips, msg.ttl, dns.min_ttl, ep, now);
            let evicted = cache.bound(&dns.limits, &msg.name, ep, &referenced);
            (engine.fqdn_selected(&msg.name), new, evicted)
        };
        if new && selected {
            // In policy now: saved at once, so that a restart restores it.
            self.fqdn_changed();
        } else {
            // Nothing in policy changed (or only askers and expiries): saved by the next tick,
            // at most once a second, so a flood of names does not rewrite the file per name.
            self.fqdn_dirty = true;
        }
        if evicted.is_empty() {
            return Vec::new();
        }
        self.forget_evicted(evicted)
    }

    /// The engine forgets what the cache evicted; the evictions are counted.
    pub(super) fn forget_evicted(
        &mut self,
        evicted: crate::policy::fqdn_bounds::Evicted,
    ) -> Vec<crate::policy::engine::PolicyChange> {
        for (why, n) in &evicted.counts {
            let labels = crate::metrics::ReasonLabels {
                reason: why.as_str().into(),
            };
            let family = &self.shared.metrics.fqdn_cache_evictions;
            family.get_or_create(&labels).inc_by(*n as u64);
        }
        let mut engine = self.engine_mut();
        let gone = evicted.gone.iter();
        gone.map(|(n, ip)| engine.forget_fqdn(n, *ip)).collect()
    }

    /// After a policy change: when `toFQDNs` selectors came or went (the engine's FQDN
    /// generation moved from `generation`), the cached names follow them
    /// (`PolicyEngine::resync_fqdn`), in the policy's own reaction.
    pub(super) fn follow_fqdn_selectors(
        &self,
        generation: u64,
        change: &mut crate::policy::engine::PolicyChange,
    ) {
        if self.engine().fqdn_generation() == generation {
            return;
        }
        let cached: Vec<(String, Vec<IpAddr>)> = {
            let cache = self.shared.dns.cache();
            let names = cache.names.iter();
            names
                .map(|(n, e)| (n.clone(), e.ips.iter().map(|c| c.ip).collect()))
                .collect()
        };
        let resync = self.engine_mut().resync_fqdn(&cached);
        change.absorb(resync);
    }

    /// One reaction for several engine changes.
    pub(super) fn react_to_all(
        &self,
        reason: String,
        changes: &[crate::policy::engine::PolicyChange],
    ) {
        let affected = changes.iter().flat_map(|c| c.affected.iter().copied());
        let peers = changes
            .iter()
            .flat_map(|c| c.peers.iter().copied())
            .collect();
        let ipcache = changes.iter().flat_map(ipcache_of).collect();
        self.react(
            Reaction::new(reason)
                .affecting(affected)
                .forced() // selections changed, not the revision
                .only_peers(peers)
                .ipcache(ipcache),
        );
    }

    /// The cache changed: its gauge, and its file (written off this thread; a failed write is
    /// logged and the next change writes it again).
    pub(super) fn fqdn_changed(&mut self) {
        self.fqdn_dirty = false;
        let dns = &self.shared.dns;
        let n = dns.cache().len();
        self.shared.metrics.fqdn_cache_entries.set(n as i64);
        dns.request_save(self.shared.state_dir.root());
    }
}
