//! A worker's stream of takes (transport `grpc` with `service.stream`): one bidirectional
//! `tollgate.v1.RateLimiter/TakeStream` per configuration and worker VM, opened by the root
//! context when a take first needs it. Every batch of takes ([`super::batch`]) is one message on
//! it instead of a call of its own: a message costs Envoy no new HTTP/2 stream, no headers and no
//! call set up and torn down (BENCHMARKS.md, "A take as a message on a stream").
//!
//! Every message carries an id, its ledger id ([`CalloutId`], one of the VM's own: never 0, never
//! reused), and the service answers each once with that id, in any order (contract/README.md): an
//! answer is matched by its id alone ([`Stream::answered`]), and a message's error is that
//! message's answer. This module keeps what that needs, as plain data the adapter drives: the
//! stream's token, the messages in flight with their deadlines, the messages that failed and may
//! still be answered, and when the next stream may be opened.
//!
//! - **A deadline per message**, the first of its takes' (`service.timeout_ms` from each take, so
//!   a take that waited in the batch queue waits no longer in all), checked on the root context's
//!   tick ([`crate::core::config::Service::tick_ms`]). A message past it fails alone, as a timeout
//!   ([`Stream::expired`]: each of its takes takes the failure path a unary callout's timeout
//!   takes), and the stream and its other messages go on.
//! - **A late answer is not lost**: a message that failed at its deadline is remembered (at
//!   most [`MAX_LATE_TAKES`] takes of a configuration, each for [`late_for_ms`]), and the tokens
//!   its answer granted, which no request spends (each went on without it), go back to the
//!   service (`crate::core::flow::late_answer`), so nothing is charged twice.
//! - **A stream is given up only when it is lost**: nothing answered for `service.timeout_ms`
//!   (to within a tick: an answer is noted by the next tick, so the hot path reads no clock)
//!   while messages were in flight or awaited late. The adapter cancels it, and its messages in
//!   flight fail as timeouts (what was awaited late on it is forgotten). A stream that ends (the
//!   service's status, a reset, a connection Envoy could not make) fails every message in flight
//!   on it with that status ([`Stream::ended`]); a send Envoy refuses loses the stream
//!   ([`Stream::lost`]).
//! - **An answer without an id** (a service of the contract before ids, which answers in order)
//!   is the oldest message's, as long as no message of that stream failed alone; after that it
//!   matches nothing, so the stream falls silent and is given up, as before ids.
//! - **Reopened with backoff**: the next message opens a new stream at once when the last one
//!   answered something; after a stream that answered nothing, not before a backoff that starts
//!   at [`FIRST_BACKOFF_MS`] and doubles up to a ceiling (the breaker's `open_ms`, so the
//!   breaker's probe always finds the backoff over). A message that finds no stream and may not
//!   open one fails at once, as a dispatch error.
//! - **Spread over replicas**: Envoy balances a stream once, when it opens. A stream older than
//!   [`MAX_AGE_MS`] is replaced when it has nothing in flight nor awaited late (the adapter
//!   cancels it, losing nothing), so a replica that came up after the streams opened gets its
//!   share of new ones.

use crate::core::base::ledger::CalloutId;
use crate::core::wire::plan::CalloutResult;

/// The backoff after the first stream that ended without an answer.
pub const FIRST_BACKOFF_MS: u64 = 10;

/// A stream this old is replaced once it has nothing in flight.
pub const MAX_AGE_MS: u64 = 30_000;

/// The most takes of one configuration whose messages failed and are awaited late: as many as a
/// full batch queue of a configuration without shaping holds ([`super::batch::QUEUE_BATCHES`]
/// batches of the contract's largest; a shaping configuration's queue may hold more,
/// `batch::queue_bound`, and its late answers beyond this are not refunded). The oldest are
/// forgotten first.
pub const MAX_LATE_TAKES: usize = super::batch::QUEUE_BATCHES * contract::bounds::MAX_BATCH_TAKES;

/// How long a message that failed at its deadline is awaited late: ten timeouts, at least a
/// second (the service answers within its own store timeout, 50 ms by default, once it decides).
pub fn late_for_ms(timeout_ms: u64) -> u64 {
    timeout_ms.saturating_mul(10).max(1_000)
}

/// Where the next message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// On the open stream with this token.
    Send(u32),
    /// On a new stream: the adapter opens one and reports it with [`Stream::opened`] (or
    /// [`Stream::open_failed`]).
    Open,
    /// On a new stream, once the stream with this token (idle, past [`MAX_AGE_MS`]) is
    /// cancelled and forgotten with [`Stream::retired`].
    Replace(u32),
    /// Nowhere before this time (backing off after streams that answered nothing).
    Wait(u64),
}

/// A message in flight on the open stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Flight {
    id: CalloutId,
    deadline_ms: u64,
    takes: usize,
}

/// A message that failed at its deadline while its stream went on: its answer may still come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Late {
    id: CalloutId,
    /// The stream it was sent on.
    stream: u32,
    /// Forgotten at this time.
    until_ms: u64,
    takes: usize,
}

/// A stream that is open.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Open {
    token: u32,
    since_ms: u64,
    /// Messages in flight, oldest first.
    in_flight: Vec<Flight>,
    /// Whether it answered a message.
    answered: bool,
    /// When it was last heard from: the tick after its last answer (an answer reads no clock),
    /// or when it began to be waited for (a message sent while nothing was in flight nor awaited
    /// late on it).
    heard_ms: u64,
    /// It answered since the last tick.
    fresh: bool,
    /// A message on it failed alone: an answer without an id can no longer be placed.
    skipped: bool,
}

/// What the tick found, for the adapter to carry out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expired {
    /// The stream to cancel (lost: nothing answered for the timeout).
    pub cancel: Option<u32>,
    /// Messages past their deadline on a stream that goes on: each fails as a timeout, and
    /// stays in the ledger for its late answer.
    pub late: Vec<CalloutId>,
    /// Messages that fail as timeouts for good (their stream lost), oldest first.
    pub failed: Vec<CalloutId>,
    /// Messages no longer awaited late: their ledger entries close.
    pub forgotten: Vec<CalloutId>,
}

impl Expired {
    fn is_empty(&self) -> bool {
        self.cancel.is_none()
            && self.late.is_empty()
            && self.failed.is_empty()
            && self.forgotten.is_empty()
    }
}

/// One configuration's stream in one worker VM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stream {
    open: Option<Open>,
    /// Messages of a stream Envoy forgot without a word ([`Stream::lost`]): they fail on the
    /// next tick.
    orphans: Vec<CalloutId>,
    /// Messages awaited late, oldest first ([`MAX_LATE_TAKES`] takes at most).
    late: Vec<Late>,
    /// Streams in a row that ended (or could not open) without answering.
    failures: u32,
    /// No stream is opened before this time.
    not_before_ms: u64,
}

impl Stream {
    /// Where a message sent at `now` goes.
    pub fn route(&self, now: u64) -> Route {
        match &self.open {
            Some(o)
                if o.in_flight.is_empty()
                    && now.saturating_sub(o.since_ms) >= MAX_AGE_MS
                    && !self.late.iter().any(|l| l.stream == o.token) =>
            {
                Route::Replace(o.token)
            }
            Some(o) => Route::Send(o.token),
            None if now < self.not_before_ms => Route::Wait(self.not_before_ms),
            None => Route::Open,
        }
    }

    /// The stream [`Route::Replace`] named was cancelled: it is forgotten (nothing was in flight
    /// on it, and it answered: the next one opens at once).
    pub fn retired(&mut self, token: u32) {
        if self.token() == Some(token) {
            self.open = None;
        }
    }

    /// A stream opened under `token` at `now`.
    pub fn opened(&mut self, token: u32, now: u64) {
        self.open = Some(Open {
            token,
            since_ms: now,
            in_flight: Vec::new(),
            answered: false,
            heard_ms: now,
            fresh: false,
            skipped: false,
        });
    }

    /// Opening a stream failed at `now`: a failure for the backoff, whose ceiling is
    /// `max_backoff_ms`.
    pub fn open_failed(&mut self, now: u64, max_backoff_ms: u64) {
        self.fail(now, max_backoff_ms);
    }

    fn fail(&mut self, now: u64, max_backoff_ms: u64) {
        self.failures = self.failures.saturating_add(1);
        // The first failure in a row reopens at once: a stream the service ended (a replica
        // shutting down) is replaced without a pause; a second one waits.
        let backoff = match self.failures {
            0 | 1 => 0,
            n => FIRST_BACKOFF_MS
                .saturating_mul(1u64 << (n - 2).min(20))
                .min(max_backoff_ms.max(FIRST_BACKOFF_MS)),
        };
        self.not_before_ms = now.saturating_add(backoff);
    }

    /// Message `id`, carrying `takes` takes, was sent on the open stream at `now`, to be
    /// answered by `deadline_ms`.
    pub fn sent(&mut self, id: CalloutId, deadline_ms: u64, takes: usize, now: u64) {
        let Some(o) = &mut self.open else {
            return;
        };
        if o.in_flight.is_empty() && !self.late.iter().any(|l| l.stream == o.token) {
            // Waited for from now: the silence that loses a stream counts from here.
            o.heard_ms = now;
        }
        o.in_flight.push(Flight {
            id,
            deadline_ms,
            takes,
        });
    }

    /// Message `id` of stream `token` will never be answered and no request waits for it (a host
    /// whose calls end with the request that made them saw that request go): it leaves the
    /// stream's bookkeeping without counting as an answer, nor as a failure.
    pub fn forget(&mut self, token: u32, id: CalloutId) -> bool {
        let Some(o) = self.open.as_mut().filter(|o| o.token == token) else {
            return false;
        };
        if let Some(i) = o.in_flight.iter().position(|f| f.id == id) {
            o.in_flight.remove(i);
            return true;
        }
        match self
            .late
            .iter()
            .position(|l| l.id == id && l.stream == token)
        {
            Some(i) => {
                self.late.remove(i);
                true
            }
            None => false,
        }
    }

    /// An answer carrying `id` (0: none) arrived on stream `token`: the message it answers, in
    /// flight or awaited late (its ledger entry says which), or `None` for an answer that names
    /// no message of this stream (another stream's, another configuration's, one forgotten, or
    /// without an id once a message failed alone).
    pub fn answered(&mut self, token: u32, id: u64) -> Option<CalloutId> {
        let o = self.open.as_mut().filter(|o| o.token == token)?;
        let found = if id == 0 {
            // A service that predates ids answers in order.
            (!o.skipped && !o.in_flight.is_empty()).then(|| o.in_flight.remove(0).id)
        } else if let Some(i) = o.in_flight.iter().position(|f| f.id.0 == id) {
            Some(o.in_flight.remove(i).id)
        } else {
            let i = self
                .late
                .iter()
                .position(|l| l.id.0 == id && l.stream == token);
            i.map(|i| self.late.remove(i).id)
        };
        if found.is_some() {
            o.answered = true;
            o.fresh = true;
            self.failures = 0;
            self.not_before_ms = 0;
        }
        found
    }

    /// Stream `token` ended at `now` (the service's status, a reset, no connection): the
    /// messages that were in flight on it, oldest first, each to fail. Not the open stream (one
    /// replaced or given up already): nothing. What was awaited late on it is forgotten on a
    /// later tick.
    pub fn ended(&mut self, token: u32, now: u64, max_backoff_ms: u64) -> Vec<CalloutId> {
        if self.token() != Some(token) {
            return Vec::new();
        }
        self.close(now, max_backoff_ms)
    }

    fn close(&mut self, now: u64, max_backoff_ms: u64) -> Vec<CalloutId> {
        let Some(o) = self.open.take() else {
            return Vec::new();
        };
        // Nothing more can come on it.
        for l in &mut self.late {
            if l.stream == o.token {
                l.until_ms = now;
            }
        }
        if !o.answered {
            self.fail(now, max_backoff_ms);
        }
        o.in_flight.into_iter().map(|f| f.id).collect()
    }

    /// Sending on stream `token` failed: Envoy does not know it any more, so nothing will come
    /// of it. It is forgotten (a failure for the backoff); its messages in flight fail on the
    /// next tick ([`Stream::expired`]).
    pub fn lost(&mut self, token: u32, now: u64, max_backoff_ms: u64) {
        if self.token() == Some(token) {
            let messages = self.close(now, max_backoff_ms);
            self.orphans.extend(messages);
        }
    }

    /// The tick at `now`, with `timeout_ms` (`service.timeout_ms`): messages of a lost stream
    /// fail; a stream that answered nothing for `timeout_ms` while it was waited for is lost
    /// (to cancel; it counts as one that answered nothing), and its messages in flight fail;
    /// otherwise each message past its deadline fails alone and is awaited late. Late messages
    /// past [`late_for_ms`] are forgotten. `None`: nothing to do.
    pub fn expired(&mut self, now: u64, timeout_ms: u64, max_backoff_ms: u64) -> Option<Expired> {
        let mut out = Expired {
            failed: std::mem::take(&mut self.orphans),
            ..Expired::default()
        };
        if let Some(o) = self.open.as_mut().filter(|o| o.fresh) {
            o.heard_ms = now;
            o.fresh = false;
        }
        if let Some(token) = self.token() {
            let waited = self.in_flight() > 0 || self.late.iter().any(|l| l.stream == token);
            let heard = self.open.as_ref().map_or(now, |o| o.heard_ms);
            if waited && now >= heard.saturating_add(timeout_ms) {
                if let Some(o) = &mut self.open {
                    o.answered = false;
                }
                out.cancel = Some(token);
                let failed = self.close(now, max_backoff_ms);
                out.failed.extend(failed);
            } else if let Some(o) = &mut self.open {
                let until_ms = now.saturating_add(late_for_ms(timeout_ms));
                let mut i = 0;
                while let Some(&f) = o.in_flight.get(i) {
                    if f.deadline_ms > now {
                        i += 1;
                        continue;
                    }
                    o.in_flight.remove(i);
                    o.skipped = true;
                    if f.takes > MAX_LATE_TAKES {
                        // Too large to await: it simply fails.
                        out.failed.push(f.id);
                        continue;
                    }
                    out.late.push(f.id);
                    self.late.push(Late {
                        id: f.id,
                        stream: token,
                        until_ms,
                        takes: f.takes,
                    });
                }
            }
        }
        // Forgotten: what is past its time, then the oldest while more takes are awaited than
        // the bound (never one that went late just now: each fits the bound alone).
        let awaited: usize = self
            .late
            .iter()
            .filter(|l| l.until_ms > now)
            .map(|l| l.takes)
            .sum();
        let mut excess = awaited.saturating_sub(MAX_LATE_TAKES);
        let forgotten = &mut out.forgotten;
        self.late.retain(|l| {
            let keep = l.until_ms > now && excess == 0;
            if !keep {
                if l.until_ms > now {
                    excess = excess.saturating_sub(l.takes);
                }
                forgotten.push(l.id);
            }
            keep
        });
        (!out.is_empty()).then_some(out)
    }

    /// The open stream's token.
    pub fn token(&self) -> Option<u32> {
        self.open.as_ref().map(|o| o.token)
    }

    /// Messages in flight on the open stream.
    pub fn in_flight(&self) -> usize {
        self.open.as_ref().map_or(0, |o| o.in_flight.len())
    }
}

/// An answer on the stream (a `TakeBatchResponse` with its id): the id it carries (0: none) and
/// what it is to its message: its takes' answers, or its error as the failure a unary call would
/// have ended with (`MessageError::code` as the gRPC status). `None`: not an answer at all (it
/// names no message, so it answers none).
pub fn read_answer(body: &[u8]) -> Option<(u64, CalloutResult)> {
    let answer = contract::proto::decode_stream_answer(body).ok()?;
    let result = match answer.answer {
        Ok(results) => CalloutResult::Answers(results),
        // An error whose code says OK would pass for an answer: it is a failure all the same.
        Err(e) => CalloutResult::Grpc {
            status: if e.code == 0 { 2 } else { e.code },
            message: Some(e.message),
            body: Vec::new(),
        },
    };
    Some((answer.id, result))
}

#[cfg(test)]
mod tests {
    use super::*;
    use contract::proto::{put_bytes, put_u64};

    const CEILING: u64 = 250;
    const TIMEOUT: u64 = 20;

    fn id(n: u64) -> CalloutId {
        CalloutId(n)
    }

    fn opened_at(now: u64) -> Stream {
        let mut s = Stream::default();
        assert_eq!(s.route(now), Route::Open);
        s.opened(7, now);
        s
    }

    #[test]
    fn answers_go_to_the_messages_they_name_in_any_order() {
        let mut s = opened_at(0);
        assert_eq!(s.route(1), Route::Send(7));
        s.sent(id(101), 50, 1, 1);
        s.sent(id(102), 60, 2, 1);
        s.sent(id(103), 60, 1, 2);
        assert_eq!(s.in_flight(), 3);
        assert_eq!(s.answered(9, 101), None, "another stream's answer");
        assert_eq!(s.answered(7, 555), None, "an id of no message of ours");
        assert_eq!(s.answered(7, 102), Some(id(102)));
        assert_eq!(s.answered(7, 103), Some(id(103)));
        assert_eq!(s.answered(7, 102), None, "answered once");
        assert_eq!(s.answered(7, 101), Some(id(101)));
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn a_message_past_its_deadline_fails_alone_and_its_late_answer_still_finds_it() {
        let mut s = opened_at(0);
        s.sent(id(101), 20, 1, 0);
        s.sent(id(102), 30, 1, 10);
        assert_eq!(s.answered(7, 102), Some(id(102)), "the stream answers");
        s.sent(id(103), 40, 1, 20);
        assert_eq!(s.expired(19, TIMEOUT, CEILING), None);
        assert_eq!(
            s.expired(20, TIMEOUT, CEILING),
            Some(Expired {
                late: vec![id(101)],
                ..Expired::default()
            }),
            "the stream goes on"
        );
        assert_eq!(s.token(), Some(7));
        assert_eq!(s.route(21), Route::Send(7));
        assert_eq!(s.answered(7, 103), Some(id(103)), "the next one answered");
        assert_eq!(s.answered(7, 101), Some(id(101)), "late, still matched");
        assert_eq!(s.answered(7, 101), None, "once");
        assert_eq!(s.expired(2_000, TIMEOUT, CEILING), None);
    }

    #[test]
    fn a_stream_that_answers_nothing_for_the_timeout_is_lost() {
        let mut s = opened_at(0);
        s.sent(id(101), 20, 1, 0);
        s.sent(id(102), 25, 1, 5);
        assert_eq!(s.expired(19, TIMEOUT, CEILING), None);
        assert_eq!(
            s.expired(20, TIMEOUT, CEILING),
            Some(Expired {
                cancel: Some(7),
                failed: vec![id(101), id(102)],
                ..Expired::default()
            })
        );
        assert_eq!(s.token(), None);
        assert_eq!(s.expired(30, TIMEOUT, CEILING), None);
        // A late answer or end of the given-up stream touches nothing.
        assert_eq!(s.answered(7, 101), None);
        assert_eq!(s.ended(7, 30, CEILING), Vec::<CalloutId>::new());
        // Silence counts from the last answer, or from a message sent when nothing was awaited.
        s.opened(8, 100);
        s.sent(id(201), 200, 1, 150);
        assert_eq!(
            s.expired(169, TIMEOUT, CEILING),
            None,
            "not since 100: since 150"
        );
        s.sent(id(202), 200, 1, 160);
        assert_eq!(s.answered(8, 201), Some(id(201)));
        // The next tick notes the answer.
        assert_eq!(s.expired(165, TIMEOUT, CEILING), None);
        assert_eq!(s.expired(184, TIMEOUT, CEILING), None);
        let e = s.expired(185, TIMEOUT, CEILING).unwrap();
        assert_eq!((e.cancel, e.failed), (Some(8), vec![id(202)]));
    }

    #[test]
    fn what_is_awaited_late_keeps_a_stream_watched_and_is_forgotten_in_time_or_past_its_bound() {
        let mut s = opened_at(0);
        s.sent(id(1), 10, 1, 0);
        s.sent(id(2), 30, 1, 5);
        assert_eq!(s.answered(7, 2), Some(id(2)));
        let e = s.expired(10, TIMEOUT, CEILING).unwrap();
        assert_eq!(e.late, vec![id(1)]);
        // Awaited late and nothing heard for the timeout (since the tick that noted 2's answer):
        // the stream is lost, 1 forgotten.
        assert_eq!(s.expired(29, TIMEOUT, CEILING), None);
        let e = s.expired(30, TIMEOUT, CEILING).unwrap();
        assert_eq!((e.cancel, e.forgotten), (Some(7), vec![id(1)]));
        // On time, forgotten after ten timeouts (at least a second).
        s.opened(8, 100);
        s.sent(id(3), 110, 1, 100);
        s.sent(id(4), 200, 1, 105);
        assert_eq!(s.expired(110, TIMEOUT, CEILING).unwrap().late, vec![id(3)]);
        assert_eq!(s.answered(8, 4), Some(id(4)));
        assert_eq!(s.route(112), Route::Send(8));
        s.sent(id(5), 200, 1, 112);
        assert_eq!(s.answered(8, 5), Some(id(5)));
        assert_eq!(late_for_ms(TIMEOUT), 1_000);
        assert_eq!(s.expired(1_109, 2_000, CEILING), None);
        let e = s.expired(1_110, 2_000, CEILING).unwrap();
        assert_eq!(e.forgotten, vec![id(3)]);
        assert_eq!(s.answered(8, 3), None, "forgotten: no one's");
        // At most MAX_LATE_TAKES takes awaited: the oldest go first; a message larger than the
        // bound alone fails as if it had never been awaited, and displaces nothing.
        let big = MAX_LATE_TAKES / 2;
        s.sent(id(6), 2_000, big, 1_200);
        s.sent(id(7), 2_001, big, 1_200);
        let e = s.expired(2_001, 60_000, CEILING).unwrap();
        assert_eq!(e.late, vec![id(6), id(7)]);
        s.sent(id(8), 2_002, 1, 2_001);
        let e = s.expired(2_002, 60_000, CEILING).unwrap();
        assert_eq!((e.late, e.forgotten), (vec![id(8)], vec![id(6)]));
        s.sent(id(9), 2_003, MAX_LATE_TAKES + 1, 2_002);
        let e = s.expired(2_003, 60_000, CEILING).unwrap();
        assert_eq!(e.late, Vec::<CalloutId>::new());
        assert_eq!(e.failed, vec![id(9)]);
        assert_eq!(e.forgotten, Vec::<CalloutId>::new());
    }

    #[test]
    fn an_answer_without_an_id_is_the_oldest_until_a_message_failed_alone() {
        let mut s = opened_at(0);
        s.sent(id(101), 20, 1, 0);
        s.sent(id(102), 30, 1, 1);
        s.sent(id(103), 40, 1, 2);
        assert_eq!(s.answered(7, 0), Some(id(101)));
        assert_eq!(s.expired(30, TIMEOUT, CEILING).unwrap().late, vec![id(102)]);
        assert_eq!(s.answered(7, 0), None, "in order no more");
        assert_eq!(s.answered(7, 103), Some(id(103)));
    }

    #[test]
    fn a_stream_that_answered_is_reopened_at_once_and_one_that_did_not_backs_off() {
        let mut s = opened_at(0);
        s.sent(id(101), 20, 1, 0);
        assert_eq!(s.answered(7, 101), Some(id(101)));
        s.sent(id(102), 40, 1, 2);
        // The service ends a stream that answered (a replica shutting down): reopen at once.
        assert_eq!(s.ended(7, 30, CEILING), vec![id(102)]);
        assert_eq!(s.route(30), Route::Open);
        // Streams that answer nothing: at once, then 10, 20, 40 ms... up to the ceiling.
        let mut now = 30;
        let mut waits = Vec::new();
        for token in 8..16 {
            match s.route(now) {
                Route::Open => {}
                Route::Wait(until) => {
                    waits.push(until - now);
                    now = until;
                }
                other => panic!("{other:?}"),
            }
            s.opened(token, now);
            let m = id(200 + u64::from(token));
            s.sent(m, now + 20, 1, now);
            let e = s.expired(now + 20, TIMEOUT, CEILING).unwrap();
            assert_eq!((e.cancel, e.failed), (Some(token), vec![m]));
            now += 20;
        }
        assert_eq!(waits, vec![10, 20, 40, 80, 160, 250]);
        // An answer ends the backoff.
        s.opened(20, now + 250);
        s.sent(id(300), now + 270, 1, now + 250);
        assert_eq!(s.answered(20, 300), Some(id(300)));
        assert_eq!(s.ended(20, now + 260, CEILING), Vec::<CalloutId>::new());
        assert_eq!(s.route(now + 260), Route::Open);
    }

    #[test]
    fn a_lost_stream_is_forgotten_and_its_messages_fail_on_the_next_tick() {
        let mut s = opened_at(0);
        s.sent(id(101), 20, 1, 0);
        s.lost(7, 5, CEILING);
        assert_eq!(s.route(5), Route::Open, "a new stream at once");
        s.opened(8, 5);
        s.sent(id(102), 25, 1, 5);
        assert_eq!(
            s.expired(6, TIMEOUT, CEILING),
            Some(Expired {
                failed: vec![id(101)],
                ..Expired::default()
            })
        );
        assert_eq!(
            s.expired(6, TIMEOUT, CEILING),
            None,
            "the new stream is on time"
        );
        assert_eq!(s.answered(8, 102), Some(id(102)));
    }

    #[test]
    fn a_stream_that_cannot_open_backs_off_from_the_second_failure() {
        let mut s = Stream::default();
        s.open_failed(100, CEILING);
        assert_eq!(s.route(100), Route::Open);
        s.open_failed(100, CEILING);
        assert_eq!(s.route(105), Route::Wait(110));
        assert_eq!(s.route(110), Route::Open);
    }

    #[test]
    fn an_old_stream_is_replaced_only_when_nothing_is_in_flight_or_awaited() {
        let mut s = opened_at(1_000);
        let old = 1_000 + MAX_AGE_MS;
        s.sent(id(101), old + 20, 1, 1_000);
        assert_eq!(s.route(old), Route::Send(7), "busy: kept");
        assert_eq!(s.answered(7, 101), Some(id(101)));
        assert_eq!(s.route(old - 1), Route::Send(7), "young: kept");
        s.sent(id(102), old, 1, old);
        s.sent(id(103), old + 10, 1, old);
        assert_eq!(
            s.expired(old, TIMEOUT, CEILING).unwrap().late,
            vec![id(102)]
        );
        assert_eq!(s.answered(7, 103), Some(id(103)));
        assert_eq!(
            s.route(old + 1),
            Route::Send(7),
            "102 may still be answered"
        );
        assert_eq!(s.answered(7, 102), Some(id(102)));
        assert_eq!(s.route(old + 2), Route::Replace(7));
        s.retired(7);
        assert_eq!(s.route(old + 2), Route::Open);
    }

    #[test]
    fn an_answer_reads_as_its_id_and_its_results_or_its_error() {
        // TakeBatchResponse { results: [{ allowed, buckets: [{ allowed }] }], id: 77 }.
        let mut body = vec![0x0a, 6, 0x08, 1, 0x12, 2, 0x08, 1];
        put_u64(&mut body, 2, 77);
        let (n, r) = read_answer(&body).unwrap();
        assert_eq!(n, 77);
        let CalloutResult::Answers(a) = r else {
            panic!("{r:?}")
        };
        assert_eq!(a.len(), 1);
        assert!(a[0].allowed);
        // { id: 78, error: { code: 14, message: "shed" } }: the unary call's failure.
        let mut error = Vec::new();
        put_u64(&mut error, 1, 14);
        put_bytes(&mut error, 2, b"shed");
        let mut body = Vec::new();
        put_u64(&mut body, 2, 78);
        put_bytes(&mut body, 3, &error);
        assert_eq!(
            read_answer(&body),
            Some((
                78,
                CalloutResult::Grpc {
                    status: 14,
                    message: Some("shed".into()),
                    body: Vec::new()
                }
            ))
        );
        assert_eq!(read_answer(&[0xff]), None);
    }
}
