//! A worker's stream of takes (transport `grpc` with `service.stream`): one bidirectional
//! `tollgate.v1.RateLimiter/TakeStream` per configuration and worker VM, opened by the root
//! context when a take first needs it. Every batch of takes ([`super::batch`]) is one message on
//! it instead of a call of its own: a message costs Envoy no new HTTP/2 stream, no headers and no
//! call set up and torn down (BENCHMARKS.md, "A take as a message on a stream").
//!
//! The service answers every message once, in the order the messages arrived (contract/README.md),
//! so an answer is the oldest message's. This module keeps what that needs, as plain data the
//! adapter drives: the stream's token, the messages in flight in order with their deadlines, and
//! when the next stream may be opened.
//!
//! - **A deadline per message**, the first of its takes' (`service.timeout_ms` from each take, so
//!   a take that waited in the batch queue waits no longer in all), checked on the root context's
//!   tick ([`tick_period_ms`]). When the oldest message's passes, the stream is given up
//!   ([`Stream::expired`]): the adapter cancels it, since an answer arriving later could no longer
//!   be matched to its message, and every message in flight on it fails as a timeout. Each then
//!   takes the failure path a unary callout's timeout takes (breaker, fallback).
//! - **A stream that ends** (the service's status, a reset, a connection Envoy could not make)
//!   fails every message in flight on it with that status ([`Stream::ended`]).
//! - **Reopened with backoff**: the next message opens a new stream at once when the last one
//!   answered something; after a stream that answered nothing, not before a backoff that starts
//!   at [`FIRST_BACKOFF_MS`] and doubles up to a ceiling (the breaker's `open_ms`, so the
//!   breaker's probe always finds the backoff over). A message that finds no stream and may not
//!   open one fails at once, as a dispatch error.
//! - **Spread over replicas**: Envoy balances a stream once, when it opens. A stream older than
//!   [`MAX_AGE_MS`] is replaced when it has nothing in flight (the adapter cancels it, losing
//!   nothing), so a replica that came up after the streams opened gets its share of new ones.

use crate::core::base::ledger::CalloutId;
use std::collections::VecDeque;

/// The backoff after the first stream that ended without an answer.
pub const FIRST_BACKOFF_MS: u64 = 10;

/// A stream this old is replaced once it has nothing in flight.
pub const MAX_AGE_MS: u64 = 30_000;

/// The shortest and longest tick while streaming: a message's timeout is noticed within an
/// eighth of `service.timeout_ms` of its deadline (plus the timer's own lateness), in these
/// bounds. A tick is one call into the VM that looks at one deadline: 200 a second cost a worker
/// far less than one decision's callout.
const MIN_TICK_MS: u64 = 5;
const MAX_TICK_MS: u64 = 50;

/// The root context's tick a stream needs: an eighth of the timeout, within
/// [`MIN_TICK_MS`]..=[`MAX_TICK_MS`].
pub fn tick_period_ms(timeout_ms: u64) -> u32 {
    u32::try_from((timeout_ms / 8).clamp(MIN_TICK_MS, MAX_TICK_MS)).unwrap_or(50)
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

/// A stream that is open.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Open {
    token: u32,
    since_ms: u64,
    /// Messages in flight, oldest first: (the message's token, its deadline).
    in_flight: VecDeque<(CalloutId, u64)>,
    /// Whether it answered a message.
    answered: bool,
}

/// What the tick found: a stream to cancel, and messages to fail as timeouts, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    /// The stream to cancel (`None`: Envoy no longer knows it).
    pub cancel: Option<u32>,
    /// The messages that were in flight on it.
    pub messages: Vec<CalloutId>,
}

/// One configuration's stream in one worker VM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stream {
    open: Option<Open>,
    /// Messages of a stream Envoy forgot without a word ([`Stream::lost`]): they fail on the
    /// next tick.
    orphans: Vec<CalloutId>,
    /// Streams in a row that ended (or could not open) without answering.
    failures: u32,
    /// No stream is opened before this time.
    not_before_ms: u64,
}

impl Stream {
    /// Where a message sent at `now` goes.
    pub fn route(&self, now: u64) -> Route {
        match &self.open {
            Some(o) if o.in_flight.is_empty() && now.saturating_sub(o.since_ms) >= MAX_AGE_MS => {
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
            in_flight: VecDeque::new(),
            answered: false,
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

    /// Message `message` was sent on the open stream, to be answered by `deadline_ms`.
    pub fn sent(&mut self, message: CalloutId, deadline_ms: u64) {
        if let Some(o) = &mut self.open {
            o.in_flight.push_back((message, deadline_ms));
        }
    }

    /// An answer arrived on stream `token`: the message it answers (the oldest in flight), or
    /// `None` for a stream that is not the open one or has nothing in flight.
    pub fn answered(&mut self, token: u32) -> Option<CalloutId> {
        let o = self.open.as_mut().filter(|o| o.token == token)?;
        let (message, _) = o.in_flight.pop_front()?;
        o.answered = true;
        self.failures = 0;
        self.not_before_ms = 0;
        Some(message)
    }

    /// Stream `token` ended at `now` (the service's status, a reset, no connection): the
    /// messages that were in flight on it, oldest first, each to fail. Not the open stream (one
    /// replaced or given up already): nothing.
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
        if !o.answered {
            self.fail(now, max_backoff_ms);
        }
        o.in_flight.into_iter().map(|(m, _)| m).collect()
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

    /// The tick at `now`: messages of a lost stream, or, when the oldest message's deadline has
    /// passed, the stream to cancel and every message in flight on it (the stream counts as one
    /// that answered nothing). Each message fails as a timeout.
    pub fn expired(&mut self, now: u64, max_backoff_ms: u64) -> Option<Expired> {
        if !self.orphans.is_empty() {
            return Some(Expired {
                cancel: None,
                messages: std::mem::take(&mut self.orphans),
            });
        }
        let o = self.open.as_mut()?;
        let &(_, deadline) = o.in_flight.front()?;
        if now < deadline {
            return None;
        }
        let token = o.token;
        o.answered = false;
        Some(Expired {
            cancel: Some(token),
            messages: self.close(now, max_backoff_ms),
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    const CEILING: u64 = 250;

    fn opened_at(now: u64) -> Stream {
        let mut s = Stream::default();
        assert_eq!(s.route(now), Route::Open);
        s.opened(7, now);
        s
    }

    #[test]
    fn answers_go_to_the_messages_in_the_order_they_were_sent() {
        let mut s = opened_at(0);
        assert_eq!(s.route(1), Route::Send(7));
        s.sent(CalloutId(101), 50);
        s.sent(CalloutId(102), 60);
        assert_eq!(s.in_flight(), 2);
        assert_eq!(
            s.answered(9),
            None,
            "another stream's answer is no message's"
        );
        assert_eq!(s.answered(7), Some(CalloutId(101)));
        assert_eq!(s.answered(7), Some(CalloutId(102)));
        assert_eq!(s.answered(7), None, "nothing left in flight");
    }

    #[test]
    fn a_missed_deadline_gives_the_stream_up_with_every_message_on_it() {
        let mut s = opened_at(0);
        s.sent(CalloutId(101), 20);
        s.sent(CalloutId(102), 25);
        assert_eq!(s.expired(19, CEILING), None);
        assert_eq!(
            s.expired(20, CEILING),
            Some(Expired {
                cancel: Some(7),
                messages: vec![CalloutId(101), CalloutId(102)]
            })
        );
        assert_eq!(s.token(), None);
        assert_eq!(s.expired(30, CEILING), None);
        // A late answer or end of the given-up stream touches nothing.
        assert_eq!(s.answered(7), None);
        assert_eq!(s.ended(7, 30, CEILING), Vec::<CalloutId>::new());
    }

    #[test]
    fn a_stream_that_answered_is_reopened_at_once_and_one_that_did_not_backs_off() {
        let mut s = opened_at(0);
        s.sent(CalloutId(101), 20);
        assert_eq!(s.answered(7), Some(CalloutId(101)));
        s.sent(CalloutId(102), 40);
        // The service ends a stream that answered (a replica shutting down): reopen at once.
        assert_eq!(s.ended(7, 30, CEILING), vec![CalloutId(102)]);
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
            s.sent(CalloutId(200 + u64::from(token)), now + 20);
            let e = s.expired(now + 20, CEILING).unwrap();
            assert_eq!(
                (e.cancel, e.messages),
                (Some(token), vec![CalloutId(200 + u64::from(token))])
            );
            now += 20;
        }
        assert_eq!(waits, vec![10, 20, 40, 80, 160, 250]);
        // An answer ends the backoff.
        s.opened(20, now + 250);
        s.sent(CalloutId(300), now + 270);
        assert_eq!(s.answered(20), Some(CalloutId(300)));
        assert_eq!(s.ended(20, now + 260, CEILING), Vec::<CalloutId>::new());
        assert_eq!(s.route(now + 260), Route::Open);
    }

    #[test]
    fn a_lost_stream_is_forgotten_and_its_messages_fail_on_the_next_tick() {
        let mut s = opened_at(0);
        s.sent(CalloutId(101), 20);
        s.lost(7, 5, CEILING);
        assert_eq!(s.route(5), Route::Open, "a new stream at once");
        s.opened(8, 5);
        s.sent(CalloutId(102), 25);
        assert_eq!(
            s.expired(6, CEILING),
            Some(Expired {
                cancel: None,
                messages: vec![CalloutId(101)]
            })
        );
        assert_eq!(s.expired(6, CEILING), None, "the new stream is on time");
        assert_eq!(s.answered(8), Some(CalloutId(102)));
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
    fn an_old_stream_is_replaced_only_when_nothing_is_in_flight() {
        let mut s = opened_at(1_000);
        s.sent(CalloutId(101), 1_000 + MAX_AGE_MS + 20);
        assert_eq!(s.route(1_000 + MAX_AGE_MS), Route::Send(7), "busy: kept");
        assert_eq!(s.answered(7), Some(CalloutId(101)));
        assert_eq!(
            s.route(1_000 + MAX_AGE_MS - 1),
            Route::Send(7),
            "young: kept"
        );
        assert_eq!(s.route(1_000 + MAX_AGE_MS), Route::Replace(7));
        s.retired(7);
        assert_eq!(s.route(1_000 + MAX_AGE_MS), Route::Open);
    }

    #[test]
    fn the_tick_is_an_eighth_of_the_timeout_within_its_bounds() {
        assert_eq!(tick_period_ms(20), 5);
        assert_eq!(tick_period_ms(50), 6);
        assert_eq!(tick_period_ms(200), 25);
        assert_eq!(tick_period_ms(1_000), 50);
        assert_eq!(tick_period_ms(1), 5);
    }
}
