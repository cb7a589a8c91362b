//! Message-level introspection of the actors.
//!
//! Every message between actors travels in a [`Traced`] envelope (sent with [`TracedAddr`]), and
//! every actor gets its `Handler<Traced<M>>` impls from one [`traced_actor!`] invocation that times the inner
//! handler and records kind, summary, sender, enqueued/started/finished times and outcome into the
//! actor's [`Journal`], a bounded ring. The debug HTTP server reads the journals; nothing here
//! knows about any particular actor or message.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::fmt::Display;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use actix::dev::{Request, ToEnvelope};
use actix::{Actor, Addr, Handler, Message};
use chrono::{DateTime, SecondsFormat, Utc};
use dashmap::DashMap;
use prometheus_client::metrics::counter::Counter;
use serde::Serialize;

/// How many messages each journal keeps (the debug API promises at least 256).
pub const JOURNAL_CAPACITY: usize = 256;

/// Who sent a message: actor names are mostly static; endpoint names are not.
pub type Sender = Cow<'static, str>;

/// The change a message descends from: a manifest scan that changed objects, a watch event, the
/// initial sync. Watchers begin changes ([`Registry::begin_change`]); every message sent while
/// an actor handles a message of a change belongs to that change too, so one change can be
/// followed through every actor to the datapath (`/debug/changes/{id}`).
pub type ChangeId = u64;

thread_local! {
    static CURRENT_CHANGE: std::cell::Cell<Option<ChangeId>> = const { std::cell::Cell::new(None) };
}

/// The change of the message being handled on this thread (or of the `with_change` scope).
pub fn current_change() -> Option<ChangeId> {
    CURRENT_CHANGE.with(|c| c.get())
}

/// Runs `f` with `change` as the current change: what it sends belongs to that change. Actors
/// use it where they send outside a handler (timers, completions of awaited futures).
pub fn with_change<R>(change: Option<ChangeId>, f: impl FnOnce() -> R) -> R {
    let _scope = ChangeScope::enter(change);
    f()
}

/// `change` is the current change until the scope ends (then the previous one is again).
#[must_use = "the change is current only while the scope lives"]
pub struct ChangeScope(Option<ChangeId>);

impl ChangeScope {
    pub fn enter(change: Option<ChangeId>) -> ChangeScope {
        ChangeScope(CURRENT_CHANGE.with(|c| c.replace(change)))
    }
}

impl Drop for ChangeScope {
    fn drop(&mut self) {
        CURRENT_CHANGE.with(|c| c.set(self.0));
    }
}

/// A message that can say what it is in one line.
pub trait Traceable: Message {
    /// The message type's name, e.g. `Regenerate`.
    const KIND: &'static str;
    /// A one-line summary, e.g. `rev 7, reason: policy x/allow`.
    fn summary(&self) -> String;
}

/// Turns a handler's result into the journal's outcome.
pub trait Outcome {
    fn outcome(&self) -> Result<(), String>;
}

impl Outcome for () {
    fn outcome(&self) -> Result<(), String> {
        Ok(())
    }
}

impl Outcome for usize {
    fn outcome(&self) -> Result<(), String> {
        Ok(())
    }
}

impl<T> Outcome for Option<T> {
    fn outcome(&self) -> Result<(), String> {
        Ok(())
    }
}

impl<T, E: Display> Outcome for Result<T, E> {
    fn outcome(&self) -> Result<(), String> {
        self.as_ref().map(|_| ()).map_err(|e| e.to_string())
    }
}

/// One handled message.
#[derive(Debug, Clone, Serialize)]
pub struct MessageRecord {
    pub seq: u64,
    pub message: &'static str,
    pub summary: String,
    pub from: String,
    pub enqueued_at: String,
    pub started_at: String,
    pub finished_at: String,
    pub outcome: String,
    /// The change this message descends from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub change: Option<ChangeId>,
}

fn rfc3339(micros: i64) -> String {
    DateTime::<Utc>::from_timestamp_micros(micros)
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// A journal entry as stored: compact (a thousand endpoints keep 256 each), rendered on read.
#[derive(Debug)]
struct Rec {
    seq: u64,
    message: &'static str,
    summary: Box<str>,
    from: Sender,
    enqueued_us: i64,
    started_us: i64,
    finished_us: i64,
    error: Option<Box<str>>,
    change: Option<ChangeId>,
}

impl JournalInner {
    /// Counts one message of kind `message` (the hook's counter, asked for once per kind).
    fn count(&mut self, actor: &'static str, message: &'static str, hook: &HandledHook) {
        if let Some((_, c)) = self.counters.iter().find(|(m, _)| *m == message) {
            c.inc();
            return;
        }
        let c = hook(actor, message);
        c.inc();
        self.counters.push((message, c));
    }
}

impl Rec {
    fn render(&self) -> MessageRecord {
        MessageRecord {
            seq: self.seq,
            message: self.message,
            summary: self.summary.to_string(),
            from: self.from.to_string(),
            enqueued_at: rfc3339(self.enqueued_us),
            started_at: rfc3339(self.started_us),
            finished_at: rfc3339(self.finished_us),
            outcome: match &self.error {
                None => "ok".into(),
                Some(e) => format!("error: {e}"),
            },
            change: self.change,
        }
    }
}

#[derive(Debug, Default)]
struct JournalInner {
    records: VecDeque<Rec>,
    durations_us: VecDeque<u64>,
    last_message: &'static str,
    /// The hook's counter of each message kind handled so far (a few per actor).
    counters: Vec<(&'static str, Counter)>,
}

/// The metrics hook: the counter of the messages of one kind one kind of actor handled (actor
/// kind, message kind). Each journal asks once per message kind and keeps it: a lookup in a
/// map every actor shares, on every message, made the threads that regenerate endpoints
/// contend for its lock.
pub type HandledHook = Arc<dyn Fn(&'static str, &'static str) -> Counter + Send + Sync>;

/// One message (or noted event) as an actor handled it.
pub struct Handled {
    pub message: &'static str,
    pub summary: String,
    pub from: Sender,
    /// When it entered the mailbox.
    pub enqueued_at: DateTime<Utc>,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub outcome: Result<(), String>,
    pub change: Option<ChangeId>,
}

/// The record of one actor: counters and the most recent messages.
pub struct Journal {
    pub name: String,
    pub kind: &'static str,
    mailbox: AtomicI64,
    handled: AtomicU64,
    seq: AtomicU64,
    inner: Mutex<JournalInner>,
    on_handled: Option<HandledHook>,
}

/// One actor as `/debug/actors` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct ActorSummary {
    pub name: String,
    pub kind: &'static str,
    pub mailbox: i64,
    pub handled: u64,
    pub last_message: &'static str,
    pub handle_p50_us: u64,
    pub handle_p99_us: u64,
}

impl Journal {
    fn new(name: String, kind: &'static str, on_handled: Option<HandledHook>) -> Self {
        Journal {
            name,
            kind,
            mailbox: AtomicI64::new(0),
            handled: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            inner: Mutex::new(JournalInner::default()),
            on_handled,
        }
    }

    /// A message was put in the mailbox.
    pub fn enqueued(&self) {
        self.mailbox.fetch_add(1, Ordering::Relaxed);
    }

    /// Records one handled message (taken from the mailbox).
    pub fn record(&self, handled: Handled) {
        self.mailbox.fetch_sub(1, Ordering::Relaxed);
        self.append(handled);
    }

    /// Records an event that did not come through the mailbox: a completion of asynchronous
    /// work (the datapath's answer to a sync) or an internal step, started at `started_at` and
    /// finished now.
    pub fn note(
        &self,
        message: &'static str,
        summary: String,
        from: &'static str,
        started_at: DateTime<Utc>,
        outcome: Result<(), String>,
    ) {
        self.append(Handled {
            message,
            summary,
            from: Cow::Borrowed(from),
            enqueued_at: started_at,
            started_at,
            finished_at: Utc::now(),
            outcome,
            change: current_change(),
        });
    }

    fn append(&self, h: Handled) {
        let Handled {
            message,
            summary,
            from,
            enqueued_at,
            started_at,
            finished_at,
            outcome,
            change,
        } = h;
        self.handled.fetch_add(1, Ordering::Relaxed);
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let rec = Rec {
            seq,
            message,
            summary: summary.into_boxed_str(),
            from,
            enqueued_us: enqueued_at.timestamp_micros(),
            started_us: started_at.timestamp_micros(),
            finished_us: finished_at.timestamp_micros(),
            error: outcome.err().map(String::into_boxed_str),
            change,
        };
        let dur = (rec.finished_us - rec.started_us).max(0) as u64;
        if let Ok(mut inner) = self.inner.lock() {
            // The whole ring at the first record: grown by doubling, every endpoint's journal
            // reallocated (and copied) at the same message count, so one policy change paid
            // for 1,000 of them at once (a 2-3x slower change, twice in the agent bench).
            if inner.records.capacity() < JOURNAL_CAPACITY {
                let missing = JOURNAL_CAPACITY - inner.records.len();
                inner.records.reserve_exact(missing);
                let missing = JOURNAL_CAPACITY - inner.durations_us.len();
                inner.durations_us.reserve_exact(missing);
            }
            if inner.records.len() == JOURNAL_CAPACITY {
                inner.records.pop_front();
            }
            inner.records.push_back(rec);
            if inner.durations_us.len() == JOURNAL_CAPACITY {
                inner.durations_us.pop_front();
            }
            inner.durations_us.push_back(dur);
            inner.last_message = message;
            if let Some(hook) = &self.on_handled {
                inner.count(self.kind, message, hook);
            }
        }
    }

    pub fn mailbox(&self) -> i64 {
        self.mailbox.load(Ordering::Relaxed).max(0)
    }

    pub fn summary(&self) -> ActorSummary {
        let (last, mut d) = match self.inner.lock() {
            Ok(i) => (
                i.last_message,
                i.durations_us.iter().copied().collect::<Vec<_>>(),
            ),
            Err(_) => ("", vec![]),
        };
        d.sort_unstable();
        let pct = |p: usize| {
            if d.is_empty() {
                0
            } else {
                d[((d.len() - 1) * p) / 100]
            }
        };
        ActorSummary {
            name: self.name.clone(),
            kind: self.kind,
            mailbox: self.mailbox(),
            handled: self.handled.load(Ordering::Relaxed),
            last_message: last,
            handle_p50_us: pct(50),
            handle_p99_us: pct(99),
        }
    }

    /// The kept messages of a change, oldest first.
    fn of_change(&self, change: ChangeId) -> Vec<MessageRecord> {
        self.inner
            .lock()
            .map(|i| {
                i.records
                    .iter()
                    .filter(|r| r.change == Some(change))
                    .map(Rec::render)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Per change: (messages, first enqueued, last finished), in microseconds.
    fn change_spans(&self, into: &mut std::collections::HashMap<ChangeId, (usize, i64, i64)>) {
        if let Ok(i) = self.inner.lock() {
            for r in i.records.iter() {
                if let Some(c) = r.change {
                    let e = into.entry(c).or_insert((0, i64::MAX, i64::MIN));
                    e.0 += 1;
                    e.1 = e.1.min(r.enqueued_us);
                    e.2 = e.2.max(r.finished_us);
                }
            }
        }
    }

    /// The most recent messages, oldest first.
    pub fn messages(&self) -> Vec<MessageRecord> {
        self.inner
            .lock()
            .map(|i| i.records.iter().map(Rec::render).collect())
            .unwrap_or_default()
    }
}

/// All live actors' journals, by actor name, and the recent changes.
#[derive(Default)]
pub struct Registry {
    journals: DashMap<String, Arc<Journal>>,
    on_handled: Option<HandledHook>,
    changes: Mutex<VecDeque<ChangeInfo>>,
    next_change: AtomicU64,
}

/// Changes kept for `/debug/changes` (their messages stay as long as the journals keep them).
pub const CHANGES_KEPT: usize = 256;

/// A change: what caused it and when.
#[derive(Debug, Clone, Serialize)]
pub struct ChangeInfo {
    pub id: ChangeId,
    pub cause: String,
    pub at: String,
}

/// A change as `/debug/changes` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct ChangeSummary {
    #[serde(flatten)]
    pub info: ChangeInfo,
    /// Messages of the change the journals still hold.
    pub messages: usize,
    /// From the first message's enqueue to the last one's end, in microseconds.
    pub took_us: i64,
}

/// One message of a change: where it waited and how long it took.
#[derive(Debug, Clone, Serialize)]
pub struct ChangeStep {
    pub actor: String,
    pub kind: &'static str,
    #[serde(flatten)]
    pub record: MessageRecord,
    /// In the mailbox, from enqueue to the start of handling.
    pub wait_us: i64,
    pub handle_us: i64,
}

/// A change with its messages in the order they were sent (`/debug/changes/{id}`).
#[derive(Debug, Clone, Serialize)]
pub struct ChangeView {
    #[serde(flatten)]
    pub info: ChangeInfo,
    pub steps: Vec<ChangeStep>,
}

fn parse_us(t: &str) -> i64 {
    DateTime::parse_from_rfc3339(t)
        .map(|d| d.timestamp_micros())
        .unwrap_or(0)
}

impl Registry {
    /// A registry whose journals count every message they record in the hook's counters
    /// (the metrics hook).
    pub fn new(on_handled: Option<HandledHook>) -> Self {
        Registry {
            journals: DashMap::new(),
            on_handled,
            changes: Mutex::new(VecDeque::new()),
            next_change: AtomicU64::new(0),
        }
    }

    /// A new change, caused by `cause` (`CiliumNetworkPolicy x/a applied`, `manifests: 2
    /// objects changed`).
    pub fn begin_change(&self, cause: impl Into<String>) -> ChangeId {
        let id = self.next_change.fetch_add(1, Ordering::Relaxed) + 1;
        let info = ChangeInfo {
            id,
            cause: cause.into(),
            at: Utc::now().to_rfc3339_opts(SecondsFormat::Micros, true),
        };
        if let Ok(mut c) = self.changes.lock() {
            if c.len() == CHANGES_KEPT {
                c.pop_front();
            }
            c.push_back(info);
        }
        id
    }

    /// The recent changes, newest first, with how many of their messages are kept and their
    /// span.
    pub fn changes(&self) -> Vec<ChangeSummary> {
        let mut spans = std::collections::HashMap::new();
        for j in self.journals.iter() {
            j.change_spans(&mut spans);
        }
        let infos: Vec<ChangeInfo> = self
            .changes
            .lock()
            .map(|c| c.iter().rev().cloned().collect())
            .unwrap_or_default();
        infos
            .into_iter()
            .map(|info| {
                let (messages, first, last) = spans.get(&info.id).copied().unwrap_or((0, 0, 0));
                ChangeSummary {
                    info,
                    messages,
                    took_us: (last - first).max(0),
                }
            })
            .collect()
    }

    /// One change and every kept message of it, in the order they were sent.
    pub fn change(&self, id: ChangeId) -> Option<ChangeView> {
        let info = self
            .changes
            .lock()
            .ok()?
            .iter()
            .find(|c| c.id == id)
            .cloned()?;
        let mut steps: Vec<ChangeStep> = Vec::new();
        for j in self.journals.iter() {
            for record in j.of_change(id) {
                let (enq, start, end) = (
                    parse_us(&record.enqueued_at),
                    parse_us(&record.started_at),
                    parse_us(&record.finished_at),
                );
                steps.push(ChangeStep {
                    actor: j.name.clone(),
                    kind: j.kind,
                    record,
                    wait_us: (start - enq).max(0),
                    handle_us: (end - start).max(0),
                });
            }
        }
        steps.sort_by(|a, b| {
            (&a.record.enqueued_at, &a.record.started_at)
                .cmp(&(&b.record.enqueued_at, &b.record.started_at))
        });
        Some(ChangeView { info, steps })
    }

    /// Creates the journal of a new actor.
    pub fn register(&self, name: String, kind: &'static str) -> Arc<Journal> {
        let j = Arc::new(Journal::new(name.clone(), kind, self.on_handled.clone()));
        self.journals.insert(name, j.clone());
        j
    }

    pub fn deregister(&self, name: &str) {
        self.journals.remove(name);
    }

    pub fn get(&self, name: &str) -> Option<Arc<Journal>> {
        self.journals.get(name).map(|j| j.clone())
    }

    /// Every actor, sorted by name.
    pub fn summaries(&self) -> Vec<ActorSummary> {
        let mut v: Vec<ActorSummary> = self.journals.iter().map(|j| j.summary()).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Total mailbox depth per actor kind.
    pub fn mailboxes_by_kind(&self) -> Vec<(&'static str, i64)> {
        let mut m: std::collections::BTreeMap<&'static str, i64> = Default::default();
        for j in self.journals.iter() {
            *m.entry(j.kind).or_default() += j.mailbox();
        }
        m.into_iter().collect()
    }
}

/// The envelope every actor message travels in.
pub struct Traced<M> {
    pub msg: M,
    pub from: Sender,
    pub enqueued_at: DateTime<Utc>,
    pub journal: Arc<Journal>,
    /// The change the sender was handling when it sent this.
    pub change: Option<ChangeId>,
}

impl<M: Message> Message for Traced<M> {
    type Result = M::Result;
}

/// An actor address that sends traced messages and counts the mailbox.
pub struct TracedAddr<A: Actor> {
    pub addr: Addr<A>,
    pub journal: Arc<Journal>,
}

impl<A: Actor> Clone for TracedAddr<A> {
    fn clone(&self) -> Self {
        TracedAddr {
            addr: self.addr.clone(),
            journal: self.journal.clone(),
        }
    }
}

impl<A: Actor> TracedAddr<A> {
    pub fn new(addr: Addr<A>, journal: Arc<Journal>) -> Self {
        TracedAddr { addr, journal }
    }

    fn wrap<M>(&self, msg: M, from: impl Into<Sender>) -> Traced<M> {
        self.journal.enqueued();
        Traced {
            msg,
            from: from.into(),
            enqueued_at: Utc::now(),
            journal: self.journal.clone(),
            change: current_change(),
        }
    }

    /// Sends and returns a future of the handler's result.
    pub fn send<M>(&self, msg: M, from: impl Into<Sender>) -> Request<A, Traced<M>>
    where
        M: Message + Send + 'static,
        M::Result: Send,
        A: Handler<Traced<M>>,
        A::Context: ToEnvelope<A, Traced<M>>,
    {
        self.addr.send(self.wrap(msg, from))
    }

    /// Sends without waiting for the result.
    pub fn do_send<M>(&self, msg: M, from: impl Into<Sender>)
    where
        M: Message + Send + 'static,
        M::Result: Send,
        A: Handler<Traced<M>>,
        A::Context: ToEnvelope<A, Traced<M>>,
    {
        self.addr.do_send(self.wrap(msg, from))
    }

    pub fn connected(&self) -> bool {
        self.addr.connected()
    }
}

/// A traced address for one message type, whoever handles it: a sender that must not name its
/// receiver's actor type (an endpoint reporting to whoever tracks reactions) holds this.
pub struct TracedRecipient<M>
where
    M: Message + Send + 'static,
    M::Result: Send,
{
    recipient: actix::Recipient<Traced<M>>,
    journal: Arc<Journal>,
}

impl<M> Clone for TracedRecipient<M>
where
    M: Message + Send + 'static,
    M::Result: Send,
{
    fn clone(&self) -> Self {
        TracedRecipient {
            recipient: self.recipient.clone(),
            journal: self.journal.clone(),
        }
    }
}

impl<M> TracedRecipient<M>
where
    M: Message + Send + 'static,
    M::Result: Send,
{
    /// Sends without waiting for the result.
    pub fn do_send(&self, msg: M, from: impl Into<Sender>) {
        self.journal.enqueued();
        self.recipient.do_send(Traced {
            msg,
            from: from.into(),
            enqueued_at: Utc::now(),
            journal: self.journal.clone(),
            change: current_change(),
        })
    }
}

impl<A: Actor> TracedAddr<A> {
    /// This address for one of its message types.
    pub fn recipient<M>(&self) -> TracedRecipient<M>
    where
        M: Message + Send + 'static,
        M::Result: Send,
        A: Handler<Traced<M>>,
        A::Context: ToEnvelope<A, Traced<M>>,
    {
        TracedRecipient {
            recipient: self.addr.clone().recipient(),
            journal: self.journal.clone(),
        }
    }
}

/// Records one message around the inner handler, which runs as part of the message's change.
/// Used by [`traced_actor!`].
pub fn record_handled<R: Outcome>(
    journal: &Journal,
    kind: &'static str,
    summary: String,
    from: Sender,
    enqueued_at: DateTime<Utc>,
    change: Option<ChangeId>,
    run: impl FnOnce() -> R,
) -> R {
    let started_at = Utc::now();
    let r = with_change(change, run);
    journal.record(Handled {
        message: kind,
        summary,
        from,
        enqueued_at,
        started_at,
        finished_at: Utc::now(),
        outcome: r.outcome(),
        change,
    });
    r
}

/// Makes a message traceable: its kind as the journal names it, and a one-line summary of it
/// (`|m| ...` with `m` the message).
#[macro_export]
macro_rules! traceable {
    ($t:ty, $kind:literal, |$s:ident| $summary:expr) => {
        impl $crate::introspect::Traceable for $t {
            const KIND: &'static str = $kind;
            fn summary(&self) -> String {
                let $s = self;
                $summary
            }
        }
    };
}

/// Gives an actor a `Handler<Traced<M>>` for each message it lists: the one place where its
/// handlers are wrapped (`traced_actor!(EndpointActor: Regenerate, BumpRevision, ...)`).
/// Handlers must return `M::Result` directly (`()` or `Result`), so the outcome is known when
/// the handler returns.
#[macro_export]
macro_rules! traced_actor {
    ($actor:ty : $($msg:ty),+ $(,)?) => {
        $(
            impl ::actix::Handler<$crate::introspect::Traced<$msg>> for $actor {
                type Result = <$actor as ::actix::Handler<$msg>>::Result;

                fn handle(&mut self, t: $crate::introspect::Traced<$msg>, ctx: &mut Self::Context) -> Self::Result {
                    let $crate::introspect::Traced { msg, from, enqueued_at, journal, change } = t;
                    let summary = $crate::introspect::Traceable::summary(&msg);
                    $crate::introspect::record_handled(
                        &journal,
                        <$msg as $crate::introspect::Traceable>::KIND,
                        summary,
                        from,
                        enqueued_at,
                        change,
                        || <$actor as ::actix::Handler<$msg>>::handle(self, msg, ctx),
                    )
                }
            }
        )+
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_journal_takes_its_whole_ring_at_the_first_record_and_never_grows_after() {
        let r = Registry::new(None);
        let j = r.register("A".into(), "A");
        let caps = || {
            let inner = j.inner.lock().unwrap();
            (inner.records.capacity(), inner.durations_us.capacity())
        };
        assert_eq!(
            caps(),
            (0, 0),
            "an actor that handled nothing holds nothing"
        );
        j.note("One", "first".into(), "test", Utc::now(), Ok(()));
        let first = caps();
        assert!(first.0 >= JOURNAL_CAPACITY && first.1 >= JOURNAL_CAPACITY);
        for i in 0..3 * JOURNAL_CAPACITY {
            j.note("More", format!("{i}"), "test", Utc::now(), Ok(()));
        }
        assert_eq!(caps(), first, "no reallocation while it fills and turns");
        assert_eq!(j.inner.lock().unwrap().records.len(), JOURNAL_CAPACITY);
    }

    #[test]
    fn every_message_is_counted_and_the_hook_asked_once_per_actor_and_kind() {
        let asked: Arc<Mutex<Vec<(&'static str, &'static str)>>> = Default::default();
        let counters: Arc<DashMap<(&'static str, &'static str), Counter>> = Default::default();
        let (a, c) = (asked.clone(), counters.clone());
        let hook: HandledHook = Arc::new(move |actor, message| {
            a.lock().unwrap().push((actor, message));
            c.entry((actor, message)).or_default().clone()
        });
        let r = Registry::new(Some(hook));
        let (x, y) = (
            r.register("x".into(), "Kind"),
            r.register("y".into(), "Kind"),
        );
        for (j, message, times) in [(&x, "One", 3), (&x, "Two", 2), (&y, "One", 4)] {
            for _ in 0..times {
                j.note(message, String::new(), "test", Utc::now(), Ok(()));
            }
        }
        // Past the ring's capacity: still counted, the hook not asked again.
        for _ in 0..JOURNAL_CAPACITY {
            x.note("Two", String::new(), "test", Utc::now(), Ok(()));
        }
        let count = |m| counters.get(&("Kind", m)).map_or(0, |c| c.get());
        assert_eq!(count("One"), 7);
        assert_eq!(count("Two"), 2 + JOURNAL_CAPACITY as u64);
        let mut asked = asked.lock().unwrap().clone();
        asked.sort();
        assert_eq!(
            asked,
            [("Kind", "One"), ("Kind", "One"), ("Kind", "Two")],
            "once per journal and message kind"
        );
    }

    #[test]
    fn a_change_follows_its_messages_and_a_scope_restores_the_one_before() {
        assert_eq!(current_change(), None);
        let r = Registry::new(None);
        let j = r.register("A".into(), "A");
        let first = r.begin_change("first");
        let second = r.begin_change("second");
        with_change(Some(first), || {
            j.note("One", "of the first".into(), "test", Utc::now(), Ok(()));
            {
                let _inner = ChangeScope::enter(Some(second));
                assert_eq!(current_change(), Some(second));
                j.note("Two", "of the second".into(), "test", Utc::now(), Ok(()));
            }
            assert_eq!(current_change(), Some(first), "the scope restored it");
            j.note("Three", "of the first".into(), "test", Utc::now(), Ok(()));
        });
        assert_eq!(current_change(), None);
        j.note("Four", "of none".into(), "test", Utc::now(), Ok(()));
        let listed = r.changes();
        assert_eq!(
            listed
                .iter()
                .map(|c| (c.info.id, c.messages))
                .collect::<Vec<_>>(),
            [(second, 1), (first, 2)],
            "newest first, with their kept messages"
        );
        let view = r.change(first).unwrap();
        assert_eq!(view.info.cause, "first");
        let steps: Vec<_> = view.steps.iter().map(|s| s.record.message).collect();
        assert_eq!(steps, ["One", "Three"]);
        assert!(view.steps.iter().all(|s| s.actor == "A" && s.wait_us >= 0));
        assert!(r.change(99).is_none());
    }

    #[test]
    fn only_the_newest_changes_are_kept() {
        let r = Registry::new(None);
        for i in 0..CHANGES_KEPT + 5 {
            r.begin_change(format!("c{i}"));
        }
        let listed = r.changes();
        assert_eq!(listed.len(), CHANGES_KEPT);
        assert_eq!(listed[0].info.cause, format!("c{}", CHANGES_KEPT + 4));
        assert!(r.change(1).is_none(), "the oldest went");
    }
}
