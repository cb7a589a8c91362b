//! The identity-number journal, `STATE_DIR/identities.jsonl`: one
//! [`NumberRecord`](crate::policy::numbering::NumberRecord) per line, appended by
//! `PolicyRepoActor` before the numbers it hands out can reach the kernel, replayed at start-up
//! so that a restart renumbers nothing (`policy::numbering` says why).
//!
//! Appends are plain `write`s without `fsync`: the journal must outlive the agent's process,
//! which the page cache does; a reboot loses the kernel's maps with it. The file is compacted
//! (rewritten atomically with the numbers in use) after each start's restore and whenever it
//! holds many more lines than numbers in use, so it stays proportional to the identities.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::policy::numbering::NumberRecord;

const FILE: &str = "identities.jsonl";

/// The journal file, open for appending.
#[derive(Debug)]
pub struct NumberJournal {
    path: PathBuf,
    file: Option<File>,
    lines: usize,
}

/// What a journal held at start-up.
#[derive(Debug, Default)]
pub struct Loaded {
    pub records: Vec<NumberRecord>,
    /// Lines that were no record (`line N: why`); a torn last line is one after a crash.
    pub skipped: Vec<String>,
    /// The file could not be read at all.
    pub error: Option<io::Error>,
}

impl NumberJournal {
    /// The journal of the state directory `root` and what it holds.
    pub fn open(root: &Path) -> (NumberJournal, Loaded) {
        let path = root.join(FILE);
        let mut loaded = Loaded::default();
        match fs::read_to_string(&path) {
            Ok(text) => {
                for (i, line) in text.lines().enumerate() {
                    if line.trim().is_empty() {
                        continue;
                    }
                    match serde_json::from_str(line) {
                        Ok(r) => loaded.records.push(r),
                        Err(e) => loaded.skipped.push(format!("line {}: {e}", i + 1)),
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => loaded.error = Some(e),
        }
        let journal = NumberJournal {
            path,
            file: None,
            lines: loaded.records.len(),
        };
        (journal, loaded)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Lines in the file (records written since it was last compacted, and before).
    pub fn lines(&self) -> usize {
        self.lines
    }

    /// Appends `records` in one write.
    pub fn append(&mut self, records: &[NumberRecord]) -> io::Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(records.len() * 64);
        for r in records {
            serde_json::to_writer(&mut buf, r).map_err(io::Error::other)?;
            buf.push(b'\n');
        }
        if self.file.is_none() {
            let f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)?;
            self.file = Some(f);
        }
        let file = self
            .file
            .as_mut()
            .ok_or_else(|| io::Error::other("closed"))?;
        if let Err(e) = file.write_all(&buf) {
            self.file = None; // reopened by the next append
            return Err(e);
        }
        self.lines += records.len();
        Ok(())
    }

    /// Replaces the file with `records` (written aside, then renamed over it).
    pub fn compact(&mut self, records: &[NumberRecord]) -> io::Result<()> {
        let tmp = self.path.with_extension("jsonl.tmp");
        let mut buf = Vec::with_capacity(records.len() * 64);
        for r in records {
            serde_json::to_writer(&mut buf, r).map_err(io::Error::other)?;
            buf.push(b'\n');
        }
        {
            let mut f = File::create(&tmp)?;
            f.write_all(&buf)?;
            f.sync_all()?;
        }
        fs::rename(&tmp, &self.path)?;
        self.file = None;
        self.lines = records.len();
        Ok(())
    }

    /// Whether the file is worth compacting with `live` numbers in use.
    pub fn wants_compaction(&self, live: usize) -> bool {
        self.lines > 2 * live + 4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: u32, label: &str) -> NumberRecord {
        NumberRecord::Labels {
            id,
            labels: vec![format!("k8s:app={label}")],
        }
    }

    #[test]
    fn appended_records_come_back_and_a_torn_last_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, loaded) = NumberJournal::open(dir.path());
        assert!(loaded.records.is_empty() && loaded.error.is_none());
        j.append(&[rec(256, "a")]).unwrap();
        j.append(&[rec(257, "b"), rec(258, "c")]).unwrap();
        // A crash in the middle of a write.
        let mut f = OpenOptions::new().append(true).open(j.path()).unwrap();
        f.write_all(b"{\"id\": 259, \"lab").unwrap();
        let (j2, loaded) = NumberJournal::open(dir.path());
        assert_eq!(
            loaded.records,
            vec![rec(256, "a"), rec(257, "b"), rec(258, "c")]
        );
        assert_eq!(loaded.skipped.len(), 1, "{:?}", loaded.skipped);
        assert!(loaded.skipped[0].starts_with("line 4:"));
        assert_eq!(j2.lines(), 3);
    }

    #[test]
    fn compaction_replaces_the_file_and_appends_go_on_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = NumberJournal::open(dir.path());
        j.append(&[rec(256, "a"), rec(257, "b")]).unwrap();
        j.compact(&[rec(257, "b")]).unwrap();
        j.append(&[rec(300, "c")]).unwrap();
        let (j, loaded) = NumberJournal::open(dir.path());
        assert_eq!(loaded.records, vec![rec(257, "b"), rec(300, "c")]);
        assert_eq!(j.lines(), 2);
        assert!(!j.wants_compaction(1));
        assert!(NumberJournal { lines: 4099, ..j }.wants_compaction(1));
    }
}
