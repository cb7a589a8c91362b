//! Connection-tracking garbage collection: entries idle past their timeout leave the pinned
//! `conntrack4` and `conntrack6` maps. The program only ever refreshes `last_seen_ns` and marks
//! `replied` and `closing`; deciding what has expired is user space's job, as in Cilium's CT GC.
//!
//! Also the move out of the single `conntrack` table of older versions ([`adopt_legacy`]): its
//! programs keep inserting into it until each endpoint's program is replaced, so it is drained
//! every second while it is pinned, and unpinned once no loaded program uses it.

use std::path::Path;
use std::time::Duration;

use libbpf_rs::{MapCore, MapFlags, MapHandle};

use super::{types, Pod};
use crate::datapath::{ConntrackGcStats, ConntrackTimeouts};

/// The pinned names of the conntrack tables, IPv4 and IPv6.
pub const TABLES: [&str; 2] = ["conntrack4", "conntrack6"];
/// The pinned name of the single table of older versions.
pub const LEGACY_TABLE: &str = "conntrack";

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of the program's `bpf_ktime_get_coarse_ns()`
/// (which lags it by at most a tick, so an entry may look a few milliseconds older than it is).
pub fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

fn expired(v: &types::ct_value, protocol: u8, now_ns: u64, t: &ConntrackTimeouts) -> bool {
    let ttl = t.for_entry(protocol, v.replied != 0, v.closing != 0);
    Duration::from_nanos(now_ns.saturating_sub(v.last_seen_ns)) > ttl
}

/// The protocol of a key of either table (told apart by size).
fn protocol_of(key: &[u8]) -> Option<u8> {
    types::ct4_key::from_bytes(key)
        .map(|k| k.protocol)
        .or_else(|| types::ct6_key::from_bytes(key).map(|k| k.protocol))
}

/// Both addresses of a key of either table.
fn addresses_of(key: &[u8]) -> Vec<std::net::IpAddr> {
    if let Some(k) = types::ct4_key::from_bytes(key) {
        return vec![k.saddr.into(), k.daddr.into()];
    }
    match types::ct6_key::from_bytes(key) {
        Some(k) if k.family == 4 => {
            let v4 = |a: [u8; 16]| std::net::IpAddr::from([a[0], a[1], a[2], a[3]]);
            vec![v4(k.saddr), v4(k.daddr)]
        }
        Some(k) => vec![k.saddr.into(), k.daddr.into()],
        None => vec![],
    }
}

/// One pass over `map` (either table) at time `now_ns`: every expired entry is removed. An
/// entry is read again just before its removal, so one that saw a packet meanwhile stays.
pub fn sweep(map: &MapHandle, now_ns: u64, timeouts: &ConntrackTimeouts) -> ConntrackGcStats {
    let mut stats = ConntrackGcStats::default();
    let read = |kb: &[u8]| {
        map.lookup(kb, MapFlags::ANY)
            .ok()
            .flatten()
            .and_then(|b| types::ct_value::from_bytes(&b))
    };
    let keys: Vec<Vec<u8>> = map.keys().collect();
    for kb in keys {
        stats.scanned += 1;
        let Some(protocol) = protocol_of(&kb) else {
            continue;
        };
        let is_expired =
            |v: Option<types::ct_value>| v.is_some_and(|v| expired(&v, protocol, now_ns, timeouts));
        if is_expired(read(&kb)) && is_expired(read(&kb)) && map.delete(&kb).is_ok() {
            stats.removed += 1;
        } else {
            stats.live.extend(addresses_of(&kb));
        }
    }
    stats
}

/// What one [`adopt_legacy`] pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LegacyAdoption {
    /// Entries moved into this version's tables (or already there, newer).
    pub moved: usize,
    /// Entries that could not be moved (a full table); they stay for the next pass.
    pub failed: usize,
    /// The old table is gone: empty, used by no loaded program, and unpinned.
    pub unpinned: bool,
}

/// Moves the entries of an older version's single `conntrack` table, pinned in `pins`, into
/// `conntrack4` and `conntrack6` (pinned there by this version's program). An entry the new
/// tables already hold is newer and stays. When no loaded program uses the old table any
/// more, a last pass empties it and it is unpinned. `None` when there is no old table.
pub fn adopt_legacy(pins: &Path) -> Option<LegacyAdoption> {
    let path = pins.join(LEGACY_TABLE);
    if !path.exists() {
        return None;
    }
    let legacy = MapHandle::from_pinned_path(&path).ok()?;
    let info = legacy.info().ok()?;
    if info.info.key_size as usize != std::mem::size_of::<types::ct6_key>()
        || info.info.value_size as usize != std::mem::size_of::<types::ct_value>()
    {
        tracing::warn!(path = %path.display(), "an old conntrack table of unknown layout: left as it is");
        return None;
    }
    let v4 = MapHandle::from_pinned_path(pins.join(TABLES[0])).ok()?;
    let v6 = MapHandle::from_pinned_path(pins.join(TABLES[1])).ok()?;
    let in_use = super::tcx::map_in_use(info.info.id);
    let mut out = drain(&legacy, &v4, &v6);
    if !in_use {
        // Nothing inserts any more: what a program added during the pass above is moved now.
        let last = drain(&legacy, &v4, &v6);
        out.moved += last.moved;
        out.failed = last.failed;
        if last.failed == 0 && std::fs::remove_file(&path).is_ok() {
            out.unpinned = true;
        }
    }
    Some(out)
}

fn drain(legacy: &MapHandle, v4: &MapHandle, v6: &MapHandle) -> LegacyAdoption {
    let mut out = LegacyAdoption::default();
    let keys: Vec<Vec<u8>> = legacy.keys().collect();
    for kb in keys {
        let (Some(k), Some(v)) = (
            types::ct6_key::from_bytes(&kb),
            legacy.lookup(&kb, MapFlags::ANY).ok().flatten(),
        ) else {
            continue;
        };
        let (table, key) = if k.family == 4 {
            let mut k4 = types::ct4_key {
                sport: k.sport,
                dport: k.dport,
                protocol: k.protocol,
                endpoint_id: k.endpoint_id,
                ..Default::default()
            };
            k4.saddr.copy_from_slice(&k.saddr[..4]);
            k4.daddr.copy_from_slice(&k.daddr[..4]);
            (v4, k4.as_bytes().to_vec())
        } else {
            (v6, kb.clone())
        };
        let moved = match table.update(&key, &v, MapFlags::NO_EXIST) {
            Ok(()) => true,
            // The new program tracked it already: its entry is the newer one.
            Err(e) => e.kind() == libbpf_rs::ErrorKind::AlreadyExists,
        };
        if moved {
            let _ = legacy.delete(&kb);
            out.moved += 1;
        } else {
            out.failed += 1;
        }
    }
    out
}

/// Every `interval`, runs [`sweep`] on both tables pinned in `pins`, for the rest of the
/// process; while an older version's table is pinned there, it is drained every second.
pub fn spawn_gc(
    pins: std::path::PathBuf,
    interval: Duration,
    timeouts: ConntrackTimeouts,
    mut report: Box<dyn FnMut(ConntrackGcStats) + Send>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let tick = Duration::from_secs(1).min(interval);
    std::thread::Builder::new()
        .name("ciliate-ct-gc".into())
        .spawn(move || {
            let mut since_sweep = Duration::ZERO;
            loop {
                std::thread::sleep(tick);
                since_sweep += tick;
                if let Some(a) = adopt_legacy(&pins) {
                    if a.moved > 0 || a.unpinned {
                        tracing::info!(moved = a.moved, failed = a.failed, unpinned = a.unpinned, "conntrack entries of an older version moved to this version's tables");
                    }
                }
                if since_sweep < interval {
                    continue;
                }
                since_sweep = Duration::ZERO;
                let mut total = ConntrackGcStats {
                    started: crate::policy::fqdn::unix_now(),
                    complete: true,
                    ..Default::default()
                };
                for name in TABLES {
                    let path = pins.join(name);
                    match MapHandle::from_pinned_path(&path) {
                        Ok(map) => {
                            let s = sweep(&map, monotonic_ns(), &timeouts);
                            total.scanned += s.scanned;
                            total.removed += s.removed;
                            total.live.extend(s.live);
                        }
                        Err(e) => {
                            total.complete = false;
                            tracing::warn!(path = %path.display(), error = %e, "conntrack GC cannot open the map")
                        }
                    }
                }
                report(total);
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_follow_protocol_and_state() {
        let t = ConntrackTimeouts::default();
        let v = |replied, closing, age_s: u64| {
            types::ct_value {
                last_seen_ns: 0,
                replied,
                closing,
                ..Default::default()
            }
            .with_age(age_s)
        };
        let now = 100_000 * 1_000_000_000;
        // TCP: answered lives 6 h, unanswered 60 s, closing 10 s.
        assert!(!expired(&v(1, 0, 3600), 6, now, &t));
        assert!(expired(&v(1, 0, 21601), 6, now, &t));
        assert!(expired(&v(0, 0, 61), 6, now, &t));
        assert!(!expired(&v(0, 0, 59), 6, now, &t));
        assert!(expired(&v(1, 1, 11), 6, now, &t));
        assert!(!expired(&v(1, 1, 9), 6, now, &t));
        // UDP and ICMP: 60 s whatever the flags.
        assert!(expired(&v(1, 0, 61), 17, now, &t));
        assert!(!expired(&v(1, 0, 59), 1, now, &t));
    }

    trait WithAge {
        fn with_age(self, s: u64) -> Self;
    }
    impl WithAge for types::ct_value {
        fn with_age(mut self, s: u64) -> Self {
            self.last_seen_ns = 100_000 * 1_000_000_000 - s * 1_000_000_000;
            self
        }
    }
}
