//! The agent's flow history (interfaces section 16, `--flow-history`): a thread of its own
//! follows the flow broadcast (the flow sink's per-flow work does not change), records the
//! connection of every flow a policy decided, with both ends as the engine knows them, forgets
//! what is older than `--flow-history`, and saves the table to `STATE_DIR/flow-history` every
//! minute and at shutdown. At start the saved table is read back; an unreadable one is set
//! aside (`flow-history.unreadable`) and reported, never silently replaced.
//!
//! Trust: the history holds what the agent's own datapath judged and the labels the agent's
//! engine gives each identity; nothing a pod says goes in. Bounded: `--flow-history-max`
//! connections (the least recently seen go first, counted in `ciliate_flow_history_evicted`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::sync::broadcast::error::TryRecvError;

use crate::runtime::Shared;
use crate::traffic::history::FlowHistory;
use crate::traffic::observe::{record, PeerCache, SharedHistory};

/// `--flow-history` and `--flow-history-max`.
#[derive(Debug, Clone, Copy)]
pub struct HistoryConfig {
    /// Seconds a connection is kept after it was last seen (0: no history).
    pub keep: u64,
    pub max: usize,
}

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("flow-history")
}

/// The table a previous run saved, with this run's bounds; empty when none was saved.
pub fn load(state_dir: &Path, cfg: HistoryConfig) -> FlowHistory {
    let p = path(state_dir);
    let read = match std::fs::read(&p) {
        Ok(b) => FlowHistory::decode(&b, cfg.keep, cfg.max),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return FlowHistory::new(cfg.keep, cfg.max)
        }
        Err(e) => Err(e.to_string()),
    };
    match read {
        Ok(mut h) => {
            h.expire(crate::datapath::flows::unix_now_ms() / 1000);
            tracing::info!(connections = h.len(), "flow history restored");
            h
        }
        Err(e) => {
            let aside = p.with_extension("unreadable");
            let _ = std::fs::rename(&p, &aside);
            tracing::warn!(file = %p.display(), error = %e, moved_to = %aside.display(),
                "the saved flow history is unreadable; starting with an empty one");
            FlowHistory::new(cfg.keep, cfg.max)
        }
    }
}

/// Writes the table (a temporary file, then a rename: a crash leaves the last good one).
pub fn save(history: &SharedHistory, state_dir: &Path) -> std::io::Result<()> {
    let bytes = history.lock().encode();
    let p = path(state_dir);
    let tmp = p.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, &p)
}

/// Starts the recorder thread; `None` when `--flow-history` is 0.
pub fn start(shared: &Shared, history: SharedHistory, cfg: HistoryConfig) -> Option<Recorder> {
    if cfg.keep == 0 {
        return None;
    }
    let mut rx = shared.flows.subscribe();
    let engine = shared.engine.clone();
    let metrics = shared.metrics.clone();
    let state_dir = shared.state_dir.root().to_path_buf();
    let (h, dir) = (history.clone(), state_dir.clone());
    let spawned = std::thread::Builder::new()
        .name("ciliate-flow-history".into())
        .spawn(move || {
            let mut cache = PeerCache::default();
            let (mut tick, mut saved) = (Instant::now(), Instant::now());
            let mut batch: Vec<crate::datapath::flows::Flow> = Vec::with_capacity(256);
            let mut evicted = h.lock().evicted();
            loop {
                match rx.blocking_recv() {
                    Ok(f) => batch.push(f),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        metrics.flow_history_missed.inc_by(n);
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
                while batch.len() < 256 {
                    match rx.try_recv() {
                        Ok(f) => batch.push(f),
                        Err(TryRecvError::Lagged(n)) => {
                            metrics.flow_history_missed.inc_by(n);
                        }
                        Err(_) => break,
                    }
                }
                let now = crate::datapath::flows::unix_now_ms() / 1000;
                {
                    let Ok(e) = engine.read() else {
                        tracing::error!("the policy engine is unusable: the flow history stops");
                        return;
                    };
                    let mut t = h.lock();
                    for f in batch.drain(..) {
                        record(&mut t, &mut cache, &e, &f, now);
                    }
                    if tick.elapsed() >= Duration::from_secs(5) {
                        tick = Instant::now();
                        cache.clear();
                        t.expire(now);
                    }
                    metrics.flow_history_connections.set(t.len() as i64);
                    metrics.flow_history_evicted.inc_by(t.evicted() - evicted);
                    evicted = t.evicted();
                }
                if saved.elapsed() >= Duration::from_secs(60) {
                    saved = Instant::now();
                    if let Err(e) = save(&h, &dir) {
                        tracing::warn!(error = %e, "cannot save the flow history");
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no flow history: its thread did not start");
        return None;
    }
    Some(Recorder { history, state_dir })
}

/// Saves the history at shutdown.
pub struct Recorder {
    history: SharedHistory,
    state_dir: PathBuf,
}

impl Recorder {
    pub fn save_now(&self) {
        match save(&self.history, &self.state_dir) {
            Ok(()) => tracing::info!(
                connections = self.history.lock().len(),
                "flow history saved"
            ),
            Err(e) => tracing::warn!(error = %e, "cannot save the flow history"),
        }
    }
}
