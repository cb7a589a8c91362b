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
    /// The rules' generation (the link sends the table again on every change) and what the
    /// proxy said it applied.
    pub sync: crate::proxy::applied::TableSync,
    /// Addresses of the connections conntrack kept in its last complete pass; `None` while the
    /// datapath tracks no connections (addresses then expire on their TTL alone).
    live_peers: Mutex<Option<LivePeers>>,
    pub proxy: Mutex<ProxyView>,
    /// The cache writer (`start_saver`): saves off the actors' thread, coalescing requests.
    saver: Mutex<Option<std::sync::mpsc::Sender<()>>>,
}

/// What conntrack's last complete pass found.
#[derive(Debug, Default)]
struct LivePeers {
    /// When the pass began (Unix seconds); 0 before the first.
    started: u64,
    /// The addresses (either end) of the connections it kept.
    addrs: HashSet<IpAddr>,
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
            sync: Default::default(),
            live_peers: Mutex::new(None),
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
    /// Returns the generation that includes the change (`None`: nothing changed).
    pub fn set_rules(&self, id: u64, rules: Option<EndpointRules>) -> Option<u64> {
        self.sync.set(&mut lock(&self.rules), id, rules)
    }

    /// The table the proxy gets, with the generation it includes.
    pub fn rules(&self) -> ProxyRules {
        let all = lock(&self.rules);
        ProxyRules {
            endpoints: all.values().cloned().collect(),
            generation: self.sync.generation(),
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

    /// The datapath tracks connections: from now on an expired address leaves the cache only
    /// once a conntrack pass that began after its expiry found no connection using it.
    pub fn track_connections(&self) {
        lock(&self.live_peers).get_or_insert_with(LivePeers::default);
    }

    /// A complete conntrack pass, begun at `started` (Unix seconds), found `addrs` in use.
    pub fn set_live_peers(&self, started: u64, addrs: HashSet<IpAddr>) {
        *lock(&self.live_peers) = Some(LivePeers { started, addrs });
    }

    /// Whether a connection of the last conntrack pass uses `ip`.
    pub fn is_live(&self, ip: IpAddr) -> bool {
        lock(&self.live_peers)
            .as_ref()
            .is_some_and(|l| l.addrs.contains(&ip))
    }

    /// Whether a connection may still use `ip`, expired at `expired_at`: one did in the last
    /// pass, or no pass has begun since it expired (Cilium's rule for zombies: only a complete
    /// GC run that started after the address became a zombie may declare it dead).
    pub fn may_be_in_use(&self, ip: IpAddr, expired_at: u64) -> bool {
        lock(&self.live_peers)
            .as_ref()
            .is_some_and(|l| l.started <= expired_at || l.addrs.contains(&ip))
    }

    pub fn proxy_view(&self) -> ProxyView {
        lock(&self.proxy).clone()
    }

    pub fn update_proxy(&self, f: impl FnOnce(&mut ProxyView)) {
        f(&mut lock(&self.proxy));
    }

    /// Writes the cache (`proxy::kept`: never a torn file).
    pub fn save(&self, state_dir: &Path) -> std::io::Result<()> {
        crate::proxy::kept::write(&cache_path(state_dir), &*self.cache())
    }

    /// The cache a previous run saved (empty when none). An unreadable file is an error: the
    /// caller says so and starts empty (names are learned again from the next answers).
    pub fn load(state_dir: &Path) -> Result<FqdnCache, String> {
        crate::proxy::kept::read(&cache_path(state_dir))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_changes_are_signalled_once_and_the_cache_survives_a_save() {
        let s = DnsState::default();
        let mut rx = s.sync.changed.subscribe();
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

    /// The zombie rule end to end: an address whose TTL runs out leaves the cache only after a
    /// conntrack pass that began after its expiry found no connection using it; a live set
    /// older than the expiry (the pass ran before the connection opened) keeps it.
    #[test]
    fn an_expired_address_goes_only_after_a_later_conntrack_pass_finds_it_unused() {
        let s = DnsState::new(Duration::ZERO);
        let (old, other): (IpAddr, IpAddr) =
            ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let expire = |now: u64| -> Vec<IpAddr> {
            let mut cache = s.cache();
            let gone = cache.expire(now, &|ip, at| s.may_be_in_use(ip, at));
            gone.into_iter().map(|(_, ip)| ip).collect()
        };
        let learn = |ip: IpAddr, now: u64| {
            let ttl = Duration::from_secs(1);
            s.cache()
                .learn("api.example.com", &[ip], ttl, s.min_ttl, Some(3), now);
        };
        // No connection tracking (the in-memory datapath): the TTL alone decides.
        learn(old, 100);
        assert_eq!(expire(102), vec![old]);

        s.track_connections();
        learn(old, 100);
        assert!(
            expire(102).is_empty(),
            "no pass has run since it expired at 101"
        );
        // The last pass began at 100, before the expiry, and did not see the connection
        // (opened later): its live set cannot declare the address dead.
        s.set_live_peers(100, [other].into());
        assert!(!s.is_live(old));
        assert!(
            expire(103).is_empty(),
            "a live set older than the expiry keeps it"
        );
        // A pass begun in the expiry's own second may have missed the connection too.
        s.set_live_peers(101, [other].into());
        assert!(expire(103).is_empty());
        // A pass begun after the expiry that sees the connection keeps it (a zombie)...
        s.set_live_peers(102, [old].into());
        assert!(s.is_live(old) && expire(104).is_empty());
        // ...and the first pass after the connection ended lets it go.
        s.set_live_peers(104, [other].into());
        assert_eq!(expire(105), vec![old]);
        assert!(s.cache().is_empty());
    }
}
