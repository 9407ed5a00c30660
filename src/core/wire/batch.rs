//! Group commit for callouts (`service.batch`): per worker VM and plugin, a request that needs the
//! service while one of the plugin's callouts is in flight joins a queue instead of calling; when
//! a callout of the plugin ends, one callout carries the queued takes (`/v1/take_batch`,
//! `tollgate.v1.RateLimiter/TakeBatch`, or a message on the stream), and its answer is split back
//! onto the waiting requests. A lone request still calls at once, so light load gets no added
//! latency.
//!
//! **A slow callout holds no one back for long**: when the latest callout of the plugin left a
//! tick ago or more ([`crate::core::config::Service::tick_ms`]: an eighth of
//! `service.timeout_ms`, 5..=50 ms; a healthy service answers well within it) and fewer than
//! [`MAX_IN_FLIGHT`] callouts hold the queue back, the queue leaves as another batch beside them
//! ([`Queue::due`]), looked at when a take arrives and on the root context's tick. So a take that
//! arrives behind slow callouts leaves at once, one that arrives just after a callout left waits
//! at most the rest of that tick (and the timer's lateness), and batches still form: while the
//! service is slow, at most one leaves per tick besides those an answer lets go. A take pays its
//! own round trip once, not the one before it too; and a take that waited its whole timeout in
//! the queue (every callout slot held) fails there, on the tick, unsent ([`Queue::expired`]).
//!
//! Queued requests wait under an id the VM's ledger hands out
//! ([`crate::core::base::ledger::Ledger::reserve`]); the core's [`crate::core::flow::Flow`] does not
//! know the difference. A full queue is a dispatch failure (the failure mode decides); a failed
//! batch fails each of its requests the way a single callout would have (the breaker counting it
//! once: [`CalloutResult::Shared`]).
//!
//! A batch is bounded by count (`service.batch`, at most the contract's
//! [`contract::bounds::MAX_BATCH_TAKES`]) **and by bytes**: its request within
//! [`contract::bounds::MAX_BATCH_BYTES`], and its answer within what the filter reads,
//! [`contract::bounds::MAX_ANSWER_BYTES`] (64 takes of 12 buckets each would be answered with
//! about 100 KB). What does not fit waits for the next batch.

use crate::core::base::ledger::CalloutId;
use crate::core::config::Config;
use crate::core::wire::plan::CalloutResult;
use crate::core::wire::{self, TakeRequest};
use contract::bounds::{
    batch_answer_bytes, take_request_bytes, BUCKET_OVERHEAD_BYTES, MAX_ANSWER_BYTES,
    MAX_BATCH_BYTES,
};

/// How many batches' worth of requests a queue holds (`4 × service.batch`): more than one, since
/// Envoy spreads connections over its workers unevenly and a batch's byte bounds may split it; a
/// take the full queue refuses is decided by the failure mode (cause `queued`). A configuration
/// that shapes holds more ([`queue_bound`]).
pub const QUEUE_BATCHES: usize = 4;

/// The most a queue holds for a shaping configuration: its largest `shape.max_held`, up to this.
pub const MAX_SHAPED_QUEUE: usize = 4096;

/// The most requests `cfg`'s batch queue holds: [`QUEUE_BATCHES`] × its batch size, or, if more,
/// its shaping rules' largest `max_held` (at most [`MAX_SHAPED_QUEUE`]), so a burst larger than
/// four batches can ask for as many grants for later as the rule may hold; with the queue at
/// four batches, only those plus the batches in flight could ask, and the rest were decided by
/// the failure mode however many places were left.
pub fn queue_bound(cfg: &Config) -> usize {
    let batches = QUEUE_BATCHES * cfg.service.batch;
    let held = cfg
        .rules
        .iter()
        .filter(|r| !r.shadow)
        .filter_map(|r| r.rate_limit()?.shape)
        .map(|s| usize::try_from(s.max_held).unwrap_or(usize::MAX))
        .max()
        .unwrap_or(0)
        .min(MAX_SHAPED_QUEUE);
    if cfg.service.batch == 0 {
        return 0;
    }
    batches.max(held)
}

/// A request waiting for the next batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Queued {
    /// Its id in the ledger.
    pub id: CalloutId,
    /// Its take.
    pub take: TakeRequest,
    /// When it joined the queue (ms): `service.timeout_ms` bounds its wait from then, in the
    /// queue and in its batch together ([`Queued::deadline_ms`]).
    pub since_ms: u64,
}

impl Queued {
    /// When it must have its answer, with `timeout_ms` to wait in all.
    pub fn deadline_ms(&self, timeout_ms: u64) -> u64 {
        self.since_ms.saturating_add(timeout_ms)
    }
}

/// The most callouts (batches, messages) of one plugin a worker keeps in flight beside each
/// other before a queue waits for one to end: the timeout over the tick (8 × `timeout_ms`/8), so a
/// round trip as long as the whole timeout still lets a take leave within a tick of its arrival.
/// More could not be answered in time anyway; a slow service sees at most this many batches of a
/// worker at once, where it saw one.
pub const MAX_IN_FLIGHT: u32 = 8;

/// The batching state of one plugin in one VM.
#[derive(Debug, Default)]
pub struct Queue {
    /// Callouts of this plugin in flight that requests queue behind (single takes, batches and
    /// refills).
    in_flight: u32,
    /// When the latest of them started (ms).
    last_sent_ms: u64,
    /// Requests waiting for the next batch, in order.
    waiting: Vec<Queued>,
}

impl Queue {
    /// A take needs a callout: `false` when nothing is in flight (call now), else `true` (queue
    /// it with [`Queue::push`]).
    pub fn busy(&self) -> bool {
        self.in_flight > 0
    }

    /// Whether the queue should leave now, at `now_ms`: something waits, and no callout holds it
    /// back, or the callouts that do are slow (the latest left `tick_ms` ago or more) and fewer
    /// than [`MAX_IN_FLIGHT`].
    pub fn due(&self, now_ms: u64, tick_ms: u64) -> bool {
        if self.waiting.is_empty() {
            return false;
        }
        self.in_flight == 0
            || (self.in_flight < MAX_IN_FLIGHT
                && now_ms.saturating_sub(self.last_sent_ms) >= tick_ms)
    }

    /// The takes that have waited their whole `timeout_ms` by `now_ms`, out of the queue: each
    /// fails unsent.
    pub fn expired(&mut self, now_ms: u64, timeout_ms: u64) -> Vec<CalloutId> {
        if self
            .waiting
            .first()
            .is_none_or(|q| q.deadline_ms(timeout_ms) > now_ms)
        {
            return Vec::new();
        }
        let mut out = Vec::new();
        self.waiting.retain(|q| {
            let late = q.deadline_ms(timeout_ms) <= now_ms;
            if late {
                out.push(q.id);
            }
            !late
        });
        out
    }

    /// Queues `req` under `id` at `now_ms`, unless `max` are waiting already (a plugin's
    /// bound is [`queue_bound`]).
    pub fn push(
        &mut self,
        max: usize,
        id: CalloutId,
        req: &TakeRequest,
        now_ms: u64,
    ) -> Result<(), String> {
        if self.waiting.len() >= max {
            return Err(format!("batch queue full ({max} waiting)"));
        }
        self.waiting.push(Queued {
            id,
            take: req.clone(),
            since_ms: now_ms,
        });
        Ok(())
    }

    /// A callout that holds this queue back started, at `now_ms`.
    pub fn started(&mut self, now_ms: u64) {
        self.in_flight = self.in_flight.saturating_add(1);
        self.last_sent_ms = now_ms;
    }

    /// A callout that held this queue back ended (answered, or expired with its root).
    pub fn ended(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Takes the waiting requests for the next batch, in order: at most `max`, and no more than
    /// fit the contract's request and answer bounds (the first always does: one take's answer is
    /// a few KiB).
    pub fn drain(&mut self, max: usize) -> Vec<Queued> {
        let mut n = 0;
        let mut buckets = 0;
        let mut request_bytes = BUCKET_OVERHEAD_BYTES;
        for Queued { take: t, .. } in &self.waiting {
            let b = t.buckets.len();
            let keys: usize = t.buckets.iter().map(|b| b.key.len()).sum();
            let more = request_bytes + take_request_bytes(b, keys);
            if n >= max
                || (n > 0
                    && (batch_answer_bytes(n + 1, buckets + b) > MAX_ANSWER_BYTES
                        || more > MAX_BATCH_BYTES))
            {
                break;
            }
            n += 1;
            buckets += b;
            request_bytes = more;
        }
        self.waiting.drain(..n).collect()
    }

    /// A queued request went away before its batch left: it leaves the queue.
    pub fn forget(&mut self, id: CalloutId) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|q| q.id != id);
        self.waiting.len() < before
    }

    /// Requests waiting.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

/// Splits a batch callout's result (or a stream message's answers, decoded) into one result per
/// member: each member's own answer when the batch was answered (`Answer`), else the batch's
/// failure for every member (so each takes
/// its failure path exactly as a single callout would). An answer that does not decode, or does
/// not hold one result per member, is a decode failure for all.
pub fn split(result: CalloutResult, members: usize) -> Vec<CalloutResult> {
    let decoded = match result {
        CalloutResult::Http {
            status: Some(200..=299),
            body,
        } => wire::decode_batch_json(&body),
        CalloutResult::Grpc {
            status: 0, body, ..
        } => wire::decode_batch_proto(&body),
        CalloutResult::Answers(answers) => Ok(answers),
        failure => return vec![failure; members],
    };
    match decoded {
        Ok(answers) if answers.len() == members => {
            answers.into_iter().map(CalloutResult::Answer).collect()
        }
        _ => vec![CalloutResult::BatchMismatch; members],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::decide::interpret;
    use crate::core::wire::plan::{Cause, Outcome, Plan};
    use crate::core::wire::{Bucket, TakeResponse};

    fn take() -> TakeRequest {
        TakeRequest {
            buckets: vec![Bucket {
                key: "k".into(),
                capacity: 1,
                rate: None,
                period_ms: 1,
                cost: None,
                algorithm: None,
                lease: None,
                max_delay_ms: 0,
                calendar: None,
            }],
        }
    }

    fn take_of(buckets: usize, key_bytes: usize) -> TakeRequest {
        let mut t = take();
        let b = t.buckets.remove(0);
        t.buckets = (0..buckets)
            .map(|i| Bucket {
                key: format!("{i:0>width$}", width = key_bytes),
                ..b.clone()
            })
            .collect();
        t
    }

    #[test]
    fn a_lone_request_calls_at_once_then_others_queue_until_it_ends() {
        let mut q = Queue::default();
        assert!(!q.busy(), "nothing in flight: call now");
        q.started(0);
        assert!(q.busy());
        q.push(2, CalloutId(1), &take(), 10).unwrap();
        q.push(2, CalloutId(2), &take(), 12).unwrap();
        assert!(q.push(2, CalloutId(3), &take(), 13).is_err(), "full");
        q.ended();
        q.forget(CalloutId(1));
        let next = q.drain(64);
        assert_eq!(next.len(), 1);
        assert_eq!(next[0].id, CalloutId(2));
        assert_eq!(
            next[0].deadline_ms(20),
            32,
            "its wait counts from when it queued"
        );
        assert_eq!(q.waiting(), 0);
        assert!(!q.busy(), "in flight is back to 0");
    }

    #[test]
    fn a_queue_leaves_beside_callouts_out_a_tick_up_to_a_bound() {
        let mut q = Queue::default();
        q.started(100);
        assert!(!q.due(100, 5), "nothing waits");
        q.push(8, CalloutId(1), &take(), 101).unwrap();
        assert!(
            !q.due(104, 5),
            "the callout left 4 ms ago: its answer may let the queue go any moment"
        );
        assert!(
            q.due(105, 5),
            "out a tick: slow, the queue leaves beside it"
        );
        let _ = q.drain(64);
        q.started(105);
        q.push(8, CalloutId(2), &take(), 106).unwrap();
        assert!(
            !q.due(109, 5),
            "a batch left 4 ms ago: the next waits for its tick"
        );
        assert!(q.due(110, 5));
        // A take arriving long after the callouts in flight left goes at once.
        q.push(8, CalloutId(3), &take(), 500).unwrap();
        assert!(q.due(500, 5));
        for _ in 2..MAX_IN_FLIGHT {
            q.started(600);
        }
        assert!(
            !q.due(1_000, 5),
            "{MAX_IN_FLIGHT} in flight: it waits for one to end"
        );
        q.ended();
        assert!(q.due(1_000, 5));
        // Nothing in flight (all ended): it leaves at once.
        let mut q = Queue::default();
        q.push(8, CalloutId(4), &take(), 100).unwrap();
        assert!(q.due(100, 5));
    }

    #[test]
    fn takes_that_waited_their_timeout_leave_the_queue_unsent() {
        let mut q = Queue::default();
        q.started(0);
        q.push(8, CalloutId(1), &take(), 100).unwrap();
        q.push(8, CalloutId(2), &take(), 110).unwrap();
        assert!(q.expired(119, 20).is_empty());
        assert_eq!(q.expired(120, 20), vec![CalloutId(1)]);
        assert_eq!(q.waiting(), 1);
        assert_eq!(q.expired(200, 20), vec![CalloutId(2)]);
        assert_eq!(q.waiting(), 0);
    }

    #[test]
    fn a_batch_is_bounded_by_the_bytes_of_its_answer_and_of_its_request() {
        let mut q = Queue::default();
        q.started(0);
        // 64 takes of 12 buckets: answered whole, about 100 KB, more than the filter reads.
        for i in 0..64 {
            q.push(64, CalloutId(i), &take_of(12, 8), 0).unwrap();
        }
        let mut batches = Vec::new();
        while q.waiting() > 0 {
            let b = q.drain(64);
            let buckets: usize = b.iter().map(|q| q.take.buckets.len()).sum();
            assert!(batch_answer_bytes(b.len(), buckets) <= MAX_ANSWER_BYTES);
            batches.push(b.len());
        }
        assert_eq!(
            batches.iter().sum::<usize>(),
            64,
            "every take leaves, in order"
        );
        assert!(batches.len() >= 2 && batches[0] > 1, "{batches:?}");
        // Takes of long keys: the request bound (1 MiB) splits them first.
        for i in 0..64 {
            q.push(64, CalloutId(i), &take_of(4, 4096), 0).unwrap();
        }
        let first = q.drain(64);
        let keys: usize = first
            .iter()
            .map(|q| take_request_bytes(q.take.buckets.len(), 4 * 4096))
            .sum();
        assert!(
            first.len() < 64 && keys <= MAX_BATCH_BYTES,
            "{}",
            first.len()
        );
        // The count bound still holds, and one take always leaves, however large.
        q.drain(usize::MAX);
        for i in 0..5 {
            q.push(64, CalloutId(i), &take_of(16, 4096), 0).unwrap();
        }
        assert_eq!(q.drain(2).len(), 2);
        assert_eq!(q.drain(64).len(), 3);
    }

    #[test]
    fn a_batch_answer_is_split_and_a_failure_shared() {
        let answer = |allowed: bool| TakeResponse {
            allowed,
            buckets: vec![wire::BucketResult {
                allowed,
                ..Default::default()
            }],
            instances: 0,
            delay_ms: 0,
        };
        let body = br#"{"results":[{"allowed":true,"buckets":[{"allowed":true}]},{"allowed":false,"buckets":[{"allowed":false}]}]}"#;
        let parts = split(
            CalloutResult::Http {
                status: Some(200),
                body: body.to_vec(),
            },
            2,
        );
        assert_eq!(
            parts,
            vec![
                CalloutResult::Answer(answer(true)),
                CalloutResult::Answer(answer(false))
            ]
        );
        let plan = Plan {
            request: take(),
            rules: vec![0],
            debt: Vec::new(),
            rls: None,
            instances: 0,
        };
        // One result for two members: a decode failure for both.
        for p in split(
            CalloutResult::Http {
                status: Some(200),
                body: br#"{"results":[{"allowed":true,"buckets":[{"allowed":true}]}]}"#.to_vec(),
            },
            2,
        ) {
            assert_eq!(interpret(&plan, p), Outcome::Failed(Cause::Decode));
        }
        // A timeout of the batch is a timeout for each.
        for p in split(
            CalloutResult::Http {
                status: Some(504),
                body: Vec::new(),
            },
            3,
        ) {
            assert_eq!(interpret(&plan, p), Outcome::Failed(Cause::Timeout));
        }
        // gRPC: TakeBatchResponse { results: [TakeResponse { allowed, buckets: [{ allowed }] }] }.
        let grpc = vec![0x0a, 6, 0x08, 1, 0x12, 2, 0x08, 1];
        assert_eq!(
            split(
                CalloutResult::Grpc {
                    status: 0,
                    message: None,
                    body: grpc
                },
                1
            ),
            vec![CalloutResult::Answer(answer(true))]
        );
    }
}
