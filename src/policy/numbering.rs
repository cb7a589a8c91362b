//! Identity numbers across agent restarts.
//!
//! The kernel keeps what an agent wrote (ipcache, policy maps) while the agent is stopped or
//! killed, and so do the DNS proxy's rule tables. They all speak in identity numbers. If a
//! restarted agent handed out numbers in a different order, a number the kernel still holds
//! would stand for another label set until every map was rewritten: the DNS proxy judged a
//! server by a number its table no longer knew (and forwarded names its rules refuse), and an
//! old policy map entry could admit the peer that now had the number.
//!
//! So numbers never change meaning across a restart (Cilium restores its local identities
//! from the ipcache for the same reason):
//! - every number the allocator hands out is journaled ([`NumberRecord`]) before anything can
//!   reach the kernel, and a restarted agent replays the journal ([`Restored`]): a label set
//!   or prefix it knew gets its old number back;
//! - a CIDR identity's meaning is its prefix, so the kernel's ipcache also restores those;
//! - every other number the kernel holds is unknown and never handed out again: numbering
//!   goes on after the highest number seen (and only wraps around over free numbers).
//!
//! Pure: the journal's file belongs to the agent (`endpoint::numbering`).

use std::collections::{HashMap, HashSet};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::identity::{NumericIdentity, FIRST_CLUSTER_IDENTITY, LOCAL_IDENTITY_FLAG};
use super::labels::{Label, Labels};

/// One line of the journal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NumberRecord {
    /// A label set's number (`source:key=value` labels, as endpoint records keep them).
    Labels {
        id: NumericIdentity,
        labels: Vec<String>,
    },
    /// A CIDR identity's number.
    Cidr { id: NumericIdentity, cidr: IpNet },
    /// Where numbering goes on (written when the journal is compacted).
    Next {
        next_cluster: NumericIdentity,
        next_local: NumericIdentity,
    },
}

/// What a previous run's numbers say, while the agent restores its state.
#[derive(Debug, Clone, Default)]
pub struct Restored {
    by_labels: HashMap<Labels, NumericIdentity>,
    by_cidr: HashMap<IpNet, NumericIdentity>,
    /// Every number the journal or the kernel holds, claimed or not: never a new label set's.
    held: HashSet<NumericIdentity>,
    /// Numbering goes on from here (after the highest number seen).
    pub next_cluster: NumericIdentity,
    /// The `n` of the next `LOCAL_IDENTITY_FLAG | n`.
    pub next_local: NumericIdentity,
}

/// What went into [`Restored`], for the start-up log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RestoredCounts {
    pub label_sets: usize,
    pub prefixes: usize,
    /// Kernel numbers no record explains: held, never handed out again.
    pub unknown: usize,
}

impl Restored {
    /// Replays `records` (oldest first: a later record of a number or key wins) and the
    /// kernel's ipcache entries.
    pub fn new(
        records: impl IntoIterator<Item = NumberRecord>,
        kernel: &[(IpNet, NumericIdentity)],
    ) -> (Restored, RestoredCounts) {
        let mut r = Restored {
            next_cluster: FIRST_CLUSTER_IDENTITY,
            next_local: 1,
            ..Default::default()
        };
        // number -> what it stood for last, so a later record of the number replaces it.
        let mut owner: HashMap<NumericIdentity, Result<Labels, IpNet>> = HashMap::new();
        for rec in records {
            match rec {
                NumberRecord::Labels { id, labels } if is_cluster(id) => {
                    let labels: Labels = labels.iter().filter_map(|s| Label::parse(s)).collect();
                    r.forget(owner.insert(id, Ok(labels.clone())));
                    if let Some(old) = r.by_labels.insert(labels, id) {
                        owner.remove(&old);
                    }
                    r.saw(id);
                }
                NumberRecord::Cidr { id, cidr } if is_local(id) => {
                    let cidr = cidr.trunc();
                    r.forget(owner.insert(id, Err(cidr)));
                    if let Some(old) = r.by_cidr.insert(cidr, id) {
                        owner.remove(&old);
                    }
                    r.saw(id);
                }
                NumberRecord::Next {
                    next_cluster,
                    next_local,
                } => {
                    r.next_cluster = r.next_cluster.max(next_cluster);
                    r.next_local = r.next_local.max(next_local);
                }
                _ => {} // a number out of its range: nothing to restore
            }
        }
        r.by_labels
            .retain(|l, id| owner.get(id) == Some(&Ok(l.clone())));
        r.by_cidr.retain(|p, id| owner.get(id) == Some(&Err(*p)));
        let mut unknown = 0;
        for (prefix, id) in kernel {
            let (id, prefix) = (*id, prefix.trunc());
            if is_local(id) && !owner.contains_key(&id) && !r.by_cidr.contains_key(&prefix) {
                owner.insert(id, Err(prefix));
                r.by_cidr.insert(prefix, id);
            } else if (is_cluster(id) || is_local(id)) && !owner.contains_key(&id) {
                unknown += 1;
            }
            r.saw(id);
        }
        let counts = RestoredCounts {
            label_sets: r.by_labels.len(),
            prefixes: r.by_cidr.len(),
            unknown,
        };
        (r, counts)
    }

    fn forget(&mut self, before: Option<Result<Labels, IpNet>>) {
        match before {
            Some(Ok(l)) => {
                self.by_labels.remove(&l);
            }
            Some(Err(p)) => {
                self.by_cidr.remove(&p);
            }
            None => {}
        }
    }

    fn saw(&mut self, id: NumericIdentity) {
        if is_cluster(id) {
            self.held.insert(id);
            self.next_cluster = self.next_cluster.max(id.saturating_add(1));
        } else if is_local(id) {
            self.held.insert(id);
            self.next_local = self.next_local.max((id & !LOCAL_IDENTITY_FLAG) + 1);
        }
    }

    /// The number a label set had.
    pub fn labels(&self, labels: &Labels) -> Option<NumericIdentity> {
        self.by_labels.get(labels).copied()
    }

    /// The number a CIDR prefix had.
    pub fn cidr(&self, prefix: &IpNet) -> Option<NumericIdentity> {
        self.by_cidr.get(prefix).copied()
    }

    /// A number the previous run used: never another label set's or prefix's while restoring.
    pub fn holds(&self, id: NumericIdentity) -> bool {
        self.held.contains(&id)
    }
}

/// A label set's number: between the reserved ones and the local (CIDR) ones.
pub fn is_cluster(id: NumericIdentity) -> bool {
    (FIRST_CLUSTER_IDENTITY..LOCAL_IDENTITY_FLAG).contains(&id)
}

/// A node-local (CIDR) number.
pub fn is_local(id: NumericIdentity) -> bool {
    id & LOCAL_IDENTITY_FLAG != 0 && id & !LOCAL_IDENTITY_FLAG != 0 && id < LOCAL_IDENTITY_FLAG << 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::identity::{Allocation, IdentityAllocator};

    fn labels(app: &str) -> Labels {
        [Label::k8s("app", app)].into_iter().collect()
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    /// A run that allocated `apps` (in that order) and one CIDR, and what it journaled.
    fn previous_run(apps: &[&str]) -> (IdentityAllocator, Vec<NumberRecord>) {
        let mut a = IdentityAllocator::new();
        a.keep_journal();
        for app in apps {
            a.allocate(&labels(app));
        }
        a.allocate_cidr(net("192.0.2.7/32"));
        let j = a.take_journal();
        (a, j)
    }

    #[test]
    fn a_restart_gives_label_sets_and_prefixes_their_numbers_whatever_the_order() {
        let (before, journal) = previous_run(&["first", "dns", "client"]);
        let old = |app: &str| before.lookup_labels(&labels(app)).unwrap();
        let kernel = vec![(net("10.0.0.2/32"), old("dns"))];
        let (restored, counts) = Restored::new(journal, &kernel);
        assert_eq!(
            (counts.label_sets, counts.prefixes, counts.unknown),
            (3, 1, 0)
        );

        let mut after = IdentityAllocator::new();
        after.restore_numbering(restored);
        // `first` is gone; the others come back in another order.
        assert_eq!(
            after.allocate(&labels("client")),
            Allocation::New(old("client"))
        );
        assert_eq!(after.allocate(&labels("dns")), Allocation::New(old("dns")));
        let newcomer = after.allocate(&labels("new")).id();
        assert!(
            newcomer > old("client"),
            "{newcomer}: after every old number"
        );
        assert_eq!(
            after.allocate_cidr(net("192.0.2.7/32")).id(),
            before.lookup_cidr(&net("192.0.2.7/32")).unwrap()
        );
        after.end_restore();
        // `first`'s number is never handed to anything else (numbering goes on after it).
        let later = after.allocate(&labels("later")).id();
        assert!(later > newcomer && later != old("first"));
    }

    #[test]
    fn kernel_numbers_no_record_explains_are_held_and_cidrs_come_back_from_the_ipcache() {
        let local = LOCAL_IDENTITY_FLAG | 40;
        let kernel = vec![
            (net("10.0.0.9/32"), 300),
            (net("198.51.100.0/24"), local),
            (net("10.0.0.1/32"), 1),
        ];
        let (restored, counts) = Restored::new(vec![], &kernel);
        assert_eq!(
            (counts.label_sets, counts.prefixes, counts.unknown),
            (0, 1, 1)
        );
        let mut a = IdentityAllocator::new();
        a.restore_numbering(restored);
        let id = a.allocate(&labels("x")).id();
        assert_eq!(id, 301, "after the kernel's highest number");
        assert_eq!(a.allocate_cidr(net("198.51.100.0/24")).id(), local);
        assert_eq!(
            a.allocate_cidr(net("203.0.113.0/24")).id(),
            LOCAL_IDENTITY_FLAG | 41
        );
    }

    #[test]
    fn later_records_win_and_a_taken_number_is_not_given_twice() {
        let rec = |id, app: &str| NumberRecord::Labels {
            id,
            labels: labels(app).to_strings(),
        };
        let records = vec![
            rec(256, "a"),
            rec(257, "b"),
            rec(256, "c"), // 256 was freed and went to c
            rec(260, "b"), // b came back as 260
            NumberRecord::Next {
                next_cluster: 400,
                next_local: 9,
            },
        ];
        let (r, _) = Restored::new(records, &[]);
        assert_eq!(r.labels(&labels("a")), None);
        assert_eq!(r.labels(&labels("b")), Some(260));
        assert_eq!(r.labels(&labels("c")), Some(256));
        assert_eq!((r.next_cluster, r.next_local), (400, 9));
        let mut a = IdentityAllocator::new();
        a.restore_numbering(r);
        // An endpoint record restored 256 for another label set first: c gets a new number.
        a.restore(256, &labels("restored")).unwrap();
        assert_eq!(a.allocate(&labels("c")).id(), 400);
        assert_eq!(a.allocate(&labels("a")).id(), 401, "a's old number is c's");
    }

    #[test]
    fn the_compacted_journal_restores_what_is_in_use() {
        let (mut before, _) = previous_run(&["a", "b"]);
        let b = before.lookup_labels(&labels("b")).unwrap();
        before.release(before.lookup_labels(&labels("a")).unwrap());
        let (r, counts) = Restored::new(before.numbering(), &[]);
        assert_eq!((counts.label_sets, counts.prefixes), (1, 1));
        assert_eq!(r.labels(&labels("b")), Some(b));
        assert!(r.next_cluster > b);
    }
}
