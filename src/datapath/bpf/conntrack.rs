//! Connection-tracking garbage collection: entries idle past their timeout leave the pinned
//! `conntrack` map. The program only ever refreshes `last_seen_ns` and marks `replied` and
//! `closing`; deciding what has expired is user space's job, as in Cilium's CT GC.

use std::time::Duration;

use libbpf_rs::{MapCore, MapFlags, MapHandle};

use super::{types, Pod};
use crate::datapath::{ConntrackGcStats, ConntrackTimeouts};

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

/// One pass over `map` at time `now_ns`: every expired entry is removed. An entry is read
/// again just before its removal, so one that saw a packet meanwhile stays.
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
        let Some(k) = types::ct_key::from_bytes(&kb) else {
            continue;
        };
        let is_expired = |v: Option<types::ct_value>| {
            v.is_some_and(|v| expired(&v, k.protocol, now_ns, timeouts))
        };
        if is_expired(read(&kb)) && is_expired(read(&kb)) && map.delete(&kb).is_ok() {
            stats.removed += 1;
        }
    }
    stats
}

/// Runs [`sweep`] every `interval` on the map pinned at `path`, for the rest of the process.
pub fn spawn_gc(
    path: std::path::PathBuf,
    interval: Duration,
    timeouts: ConntrackTimeouts,
    mut report: Box<dyn FnMut(ConntrackGcStats) + Send>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("ciliate-ct-gc".into())
        .spawn(move || loop {
            std::thread::sleep(interval);
            match MapHandle::from_pinned_path(&path) {
                Ok(map) => report(sweep(&map, monotonic_ns(), &timeouts)),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "conntrack GC cannot open the map")
                }
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
