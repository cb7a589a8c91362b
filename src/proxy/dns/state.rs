//! The agent's side of DNS-aware policy, shared by its actors and its proxy link: the FQDN
//! cache (persisted in the state directory), the DNS rules of each endpoint (what the proxy
//! is sent), the addresses live connections use (conntrack GC's report, for zombies), and
//! what the agent knows of its proxy.

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;

use super::{EndpointRules, ProxyRules};
use crate::policy::fqdn::FqdnCache;
use crate::proxy::lock;

/// The FQDN cache's file in the state directory.
pub fn cache_path(state_dir: &Path) -> PathBuf {
    state_dir.join("fqdn-cache.json")
}

/// The proxy as the agent last heard from it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProxyView {
    /// `auto`, `external` or `disabled`.
    pub mode: String,
    pub connected: bool,
    pub pid: Option<u32>,
    pub udp_port: Option<u16>,
    pub tcp_port: Option<u16>,
    /// Why it is not connected, when known.
    pub error: Option<String>,
}

#[derive(Debug)]
pub struct DnsState {
    pub cache: Mutex<FqdnCache>,
    /// `--tofqdns-min-ttl`.
    pub min_ttl: Duration,
    /// The cache's bounds (`--tofqdns-endpoint-max-ip-per-hostname` and friends).
    pub limits: crate::policy::fqdn_bounds::CacheLimits,
    rules: Mutex<BTreeMap<u64, EndpointRules>>,
    /// Bumped on every change of `rules` (the link sends the table again).
    pub rules_changed: tokio::sync::watch::Sender<u64>,
    /// Addresses of the connections conntrack kept in its last pass.
    pub live_peers: Mutex<HashSet<IpAddr>>,
    pub proxy: Mutex<ProxyView>,
    /// The cache writer (`start_saver`): saves off the actors' thread, coalescing requests.
    saver: Mutex<Option<std::sync::mpsc::Sender<()>>>,
}

impl Default for DnsState {
    fn default() -> Self {
        DnsState::new(Duration::from_secs(3600))
    }
}

impl DnsState {
    pub fn new(min_ttl: Duration) -> DnsState {
        DnsState {
            cache: Mutex::new(FqdnCache::default()),
            min_ttl,
            limits: Default::default(),
            rules: Mutex::new(BTreeMap::new()),
            rules_changed: tokio::sync::watch::channel(0).0,
            live_peers: Mutex::new(HashSet::new()),
            proxy: Mutex::new(ProxyView::default()),
            saver: Mutex::new(None),
        }
    }

    /// Starts the thread that writes the cache to `state_dir` on request.
    pub fn start_saver(self: &std::sync::Arc<Self>, state_dir: PathBuf) {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let me = std::sync::Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("ciliate-fqdn-save".into())
            .spawn(move || {
                while rx.recv().is_ok() {
                    while rx.try_recv().is_ok() {} // one write for a burst
                    let Some(me) = me.upgrade() else { return };
                    if let Err(e) = me.save(&state_dir) {
                        tracing::warn!(error = %e, "cannot save the FQDN cache");
                    }
                }
            });
        match spawned {
            Ok(_) => *lock(&self.saver) = Some(tx),
            Err(e) => tracing::warn!(error = %e, "no FQDN cache writer thread; saving inline"),
        }
    }

    /// Saves the cache soon (on the writer thread), or now when there is none.
    pub fn request_save(&self, state_dir: &Path) {
        if let Some(tx) = lock(&self.saver).as_ref() {
            if tx.send(()).is_ok() {
                return;
            }
        }
        if let Err(e) = self.save(state_dir) {
            tracing::warn!(error = %e, "cannot save the FQDN cache");
        }
    }

    pub fn cache(&self) -> std::sync::MutexGuard<'_, FqdnCache> {
        lock(&self.cache)
    }

    /// Sets (`Some`) or removes (`None`) one endpoint's DNS rules; tells the link on a change.
    pub fn set_rules(&self, id: u64, rules: Option<EndpointRules>) {
        let mut all = lock(&self.rules);
        let changed = match rules {
            Some(r) => all.insert(id, r.clone()).as_ref() != Some(&r),
            None => all.remove(&id).is_some(),
        };
        drop(all);
        if changed {
            self.rules_changed.send_modify(|n| *n += 1);
        }
    }

    /// The table the proxy gets.
    pub fn rules(&self) -> ProxyRules {
        ProxyRules {
            endpoints: lock(&self.rules).values().cloned().collect(),
        }
    }

    /// When the first of `ips` learned for `name` expires (0 when one is not cached).
    pub fn expiry(&self, name: &str, ips: &[IpAddr]) -> u64 {
        let cache = self.cache();
        let Some(e) = cache.names.get(&crate::policy::fqdn::normalize(name)) else {
            return 0;
        };
        ips.iter()
            .map(|ip| {
                e.ips
                    .iter()
                    .find(|c| c.ip == *ip)
                    .map(|c| c.expires_at)
                    .unwrap_or(0)
            })
            .min()
            .unwrap_or(0)
    }

    pub fn set_live_peers(&self, peers: HashSet<IpAddr>) {
        *lock(&self.live_peers) = peers;
    }

    pub fn is_live(&self, ip: IpAddr) -> bool {
        lock(&self.live_peers).contains(&ip)
    }

    pub fn proxy_view(&self) -> ProxyView {
        lock(&self.proxy).clone()
    }

    pub fn update_proxy(&self, f: impl FnOnce(&mut ProxyView)) {
        f(&mut lock(&self.proxy));
    }

    /// Writes the cache (write and rename: never a torn file).
    pub fn save(&self, state_dir: &Path) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(&*self.cache())?;
        let path = cache_path(state_dir);
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &path)
    }

    /// The cache a previous run saved (empty when none). An unreadable file is an error: the
    /// caller says so and starts empty (names are learned again from the next answers).
    pub fn load(state_dir: &Path) -> Result<FqdnCache, String> {
        let path = cache_path(state_dir);
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(FqdnCache::default()),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_changes_are_signalled_once_and_the_cache_survives_a_save() {
        let s = DnsState::default();
        let mut rx = s.rules_changed.subscribe();
        let r = EndpointRules {
            id: 3,
            pod: "x/a".into(),
            ips: vec!["10.0.0.3".parse().unwrap()],
            entries: vec![],
        };
        s.set_rules(3, Some(r.clone()));
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        s.set_rules(3, Some(r));
        assert!(
            !rx.has_changed().unwrap(),
            "the same rules again are no change"
        );
        assert_eq!(s.rules().endpoints.len(), 1);
        s.set_rules(3, None);
        assert!(rx.has_changed().unwrap() && s.rules().endpoints.is_empty());

        let dir = std::env::temp_dir().join(format!("ciliate-fqdn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ip: IpAddr = "192.0.2.7".parse().unwrap();
        s.cache().learn(
            "api.example.com",
            &[ip],
            Duration::from_secs(5),
            s.min_ttl,
            Some(3),
            100,
        );
        s.save(&dir).unwrap();
        assert_eq!(DnsState::load(&dir).unwrap(), *s.cache());
        std::fs::write(cache_path(&dir), b"{").unwrap();
        assert!(DnsState::load(&dir)
            .unwrap_err()
            .contains("fqdn-cache.json"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
