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
use serde::Serialize;

/// How many messages each journal keeps (the debug API promises at least 256).
pub const JOURNAL_CAPACITY: usize = 256;

/// Who sent a message: actor names are mostly static; endpoint names are not.
pub type Sender = Cow<'static, str>;

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
        }
    }
}

#[derive(Debug, Default)]
struct JournalInner {
    records: VecDeque<Rec>,
    durations_us: VecDeque<u64>,
    last_message: &'static str,
}

/// Called after every handled message with (actor kind, message kind, ok): the metrics hook.
pub type HandledHook = Arc<dyn Fn(&'static str, &'static str, bool) + Send + Sync>;

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
        } = h;
        self.handled.fetch_add(1, Ordering::Relaxed);
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let ok = outcome.is_ok();
        let rec = Rec {
            seq,
            message,
            summary: summary.into_boxed_str(),
            from,
            enqueued_us: enqueued_at.timestamp_micros(),
            started_us: started_at.timestamp_micros(),
            finished_us: finished_at.timestamp_micros(),
            error: outcome.err().map(String::into_boxed_str),
        };
        let dur = (rec.finished_us - rec.started_us).max(0) as u64;
        if let Ok(mut inner) = self.inner.lock() {
            if inner.records.len() == JOURNAL_CAPACITY {
                inner.records.pop_front();
            }
            inner.records.push_back(rec);
            if inner.durations_us.len() == JOURNAL_CAPACITY {
                inner.durations_us.pop_front();
            }
            inner.durations_us.push_back(dur);
            inner.last_message = message;
        }
        if let Some(cb) = &self.on_handled {
            cb(self.kind, message, ok);
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

    /// The most recent messages, oldest first.
    pub fn messages(&self) -> Vec<MessageRecord> {
        self.inner
            .lock()
            .map(|i| i.records.iter().map(Rec::render).collect())
            .unwrap_or_default()
    }
}

/// All live actors' journals, by actor name.
#[derive(Default)]
pub struct Registry {
    journals: DashMap<String, Arc<Journal>>,
    on_handled: Option<HandledHook>,
}

impl Registry {
    /// A registry that calls `on_handled(actor kind, message kind, ok)` after every message
    /// (the metrics hook).
    pub fn new(on_handled: Option<HandledHook>) -> Self {
        Registry {
            journals: DashMap::new(),
            on_handled,
        }
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

/// Records one message around the inner handler. Used by [`traced_actor!`].
pub fn record_handled<R: Outcome>(
    journal: &Journal,
    kind: &'static str,
    summary: String,
    from: Sender,
    enqueued_at: DateTime<Utc>,
    run: impl FnOnce() -> R,
) -> R {
    let started_at = Utc::now();
    let r = run();
    journal.record(Handled {
        message: kind,
        summary,
        from,
        enqueued_at,
        started_at,
        finished_at: Utc::now(),
        outcome: r.outcome(),
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
                    let $crate::introspect::Traced { msg, from, enqueued_at, journal } = t;
                    let summary = $crate::introspect::Traceable::summary(&msg);
                    $crate::introspect::record_handled(
                        &journal,
                        <$msg as $crate::introspect::Traceable>::KIND,
                        summary,
                        from,
                        enqueued_at,
                        || <$actor as ::actix::Handler<$msg>>::handle(self, msg, ctx),
                    )
                }
            }
        )+
    };
}
