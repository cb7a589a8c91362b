//! Identity numbers across restarts (`policy::numbering`): the repository journals every
//! number it hands out before anything it sends can reach the kernel, and a restarted agent
//! hands the same label sets and prefixes the same numbers. What the kernel's ipcache held and
//! the initial sync did not write again goes when that sync is done.

use actix::{Context, Handler, Message};
use ipnet::IpNet;

use super::PolicyRepoActor;
use crate::endpoint::numbering::NumberJournal;
use crate::policy::identity::NumericIdentity;
use crate::policy::ipcache::IpcacheChange;
use crate::policy::numbering::{NumberRecord, Restored, RestoredCounts};

/// Start-up, before anything is restored or allocated: the numbers a previous run used (its
/// journal and the kernel's ipcache).
#[derive(Debug, Message)]
#[rtype(result = "Result<RestoredCounts, std::convert::Infallible>")]
pub struct RestoreNumbering {
    pub journal: NumberJournal,
    pub records: Vec<NumberRecord>,
    pub kernel: Vec<(IpNet, NumericIdentity)>,
}

crate::traceable!(RestoreNumbering, "RestoreNumbering", |m| format!(
    "{} journal records, {} kernel ipcache entries",
    m.records.len(),
    m.kernel.len()
));

impl Handler<RestoreNumbering> for PolicyRepoActor {
    type Result = Result<RestoredCounts, std::convert::Infallible>;
    fn handle(&mut self, msg: RestoreNumbering, _: &mut Context<Self>) -> Self::Result {
        let RestoreNumbering {
            journal,
            records,
            kernel,
        } = msg;
        let (restored, counts) = Restored::new(records, &kernel);
        {
            let mut engine = self.engine_mut();
            engine.keep_number_journal();
            engine.restore_numbering(restored);
        }
        *self.numbers.get_mut() = Some(journal);
        self.kernel_ipcache = kernel;
        Ok(counts)
    }
}

impl PolicyRepoActor {
    /// Writes the numbers handed out since the last call to the journal. Called before
    /// anything the repository sends: every actor runs on this thread, so nothing reaches the
    /// kernel before the handler that allocated returns. A failed append is retried as a
    /// compaction (which writes every number in use).
    pub(super) fn journal_numbers(&self) {
        let mut numbers = self.numbers.borrow_mut();
        let Some(journal) = numbers.as_mut() else {
            return;
        };
        let (records, live) = {
            let mut engine = self.engine_mut();
            (engine.take_number_journal(), engine.identities().len())
        };
        match journal.append(&records) {
            Ok(()) if !journal.wants_compaction(live) => {}
            Ok(()) => self.compact_numbers(journal),
            Err(e) => {
                tracing::error!(path = %journal.path().display(), error = %e, "identity numbers not journaled; writing the whole journal instead");
                self.compact_numbers(journal);
            }
        }
    }

    fn compact_numbers(&self, journal: &mut NumberJournal) {
        let numbering = self.engine().numbering();
        if let Err(e) = journal.compact(&numbering) {
            self.shared.metrics.identity_journal_errors.inc();
            tracing::error!(path = %journal.path().display(), error = %e, "identity journal not written: a restart may renumber identities");
        }
    }

    /// The initial sync is done: every label set and prefix that exists has its number, so
    /// the previous run's unclaimed numbers are let go (numbering goes on after them), the
    /// journal is compacted, and the kernel's entries the sync did not write again are
    /// removed (addresses whose pods went while the agent was away).
    pub(super) fn end_numbering_restore(&mut self) -> Vec<IpcacheChange> {
        let kernel = std::mem::take(&mut self.kernel_ipcache);
        let stale = {
            let mut engine = self.engine_mut();
            engine.end_numbering_restore();
            let ipcache = engine.ipcache();
            kernel
                .into_iter()
                .filter(|(p, _)| ipcache.get(p).is_none())
                .map(|(p, _)| IpcacheChange::Remove(p))
                .collect()
        };
        self.journal_numbers();
        if let Some(journal) = self.numbers.borrow_mut().as_mut() {
            self.compact_numbers(journal);
        }
        stale
    }
}
