//! Group commit for callouts (`service.batch`): per worker VM and plugin, a request that needs the
//! service while one of the plugin's callouts is in flight joins a queue instead of calling; when
//! a callout of the plugin ends, one callout carries every queued take (`/v1/take_batch`,
//! `tollgate.v1.RateLimiter/TakeBatch`), and its answer is split back onto the waiting requests.
//! A lone request still calls at once, so light load gets no added latency.
//!
//! Queued requests wait under a token of their own ([`VIRTUAL`] set, never one Envoy hands out:
//! its ids count up by 4 from 0 and wrap far below it); the core's [`crate::core::flow::Flow`]
//! does not know the difference. A full queue is a dispatch failure (the failure mode decides);
//! a failed batch fails each of its requests the way a single callout would have.

use crate::core::plan::CalloutResult;
use crate::core::wire::{self, TakeRequest};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// Bit set in every token this module hands out to a queued request.
pub const VIRTUAL: u32 = 0x8000_0000;

/// The batching state of one plugin in one VM.
#[derive(Default)]
pub struct Batcher {
    /// Callouts of this plugin in flight (single or batch).
    in_flight: Cell<u32>,
    /// Real callout tokens of this plugin → the queued tokens a batch carries (empty: a single
    /// request's own callout).
    calls: RefCell<HashMap<u32, Vec<u32>>>,
    /// Requests waiting for the next batch: (their token, their take).
    queue: RefCell<Vec<(u32, TakeRequest)>>,
    next: Cell<u32>,
}

impl Batcher {
    /// A request needs a callout. `None`: nothing is in flight, call now. `Some(Ok(token))`: it
    /// waits in the queue under `token`. `Some(Err)`: the queue is full.
    pub fn join(&self, max: usize, req: &TakeRequest) -> Option<Result<u32, String>> {
        if self.in_flight.get() == 0 {
            return None;
        }
        let mut q = self.queue.borrow_mut();
        if q.len() >= max {
            return Some(Err(format!("batch queue full ({max} waiting)")));
        }
        let n = self.next.get().wrapping_add(1) & !VIRTUAL;
        self.next.set(n);
        let token = VIRTUAL | n;
        q.push((token, req.clone()));
        Some(Ok(token))
    }

    /// A callout of this plugin started: `token` carries `members` (empty: a single request's).
    pub fn started(&self, token: u32, members: Vec<u32>) {
        self.in_flight.set(self.in_flight.get().saturating_add(1));
        self.calls.borrow_mut().insert(token, members);
    }

    /// Callout `token` ended: `None` if it is not this plugin's, else the queued tokens it carried.
    pub fn ended(&self, token: u32) -> Option<Vec<u32>> {
        let members = self.calls.borrow_mut().remove(&token)?;
        self.in_flight.set(self.in_flight.get().saturating_sub(1));
        Some(members)
    }

    /// Takes the waiting requests (at most `max`) for the next batch.
    pub fn drain(&self, max: usize) -> Vec<(u32, TakeRequest)> {
        let mut q = self.queue.borrow_mut();
        let n = q.len().min(max);
        q.drain(..n).collect()
    }

    /// A queued request went away before its batch left: it leaves the queue.
    pub fn forget(&self, token: u32) {
        self.queue.borrow_mut().retain(|(t, _)| *t != token);
    }

    /// Requests waiting (for tests).
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        self.queue.borrow().len()
    }
}

/// Splits a batch callout's result into one result per member: each member's own answer when
/// the batch was answered (`Answer`), else the batch's failure for every member (so each takes
/// its failure path exactly as a single callout would). An answer that does not decode, or does
/// not hold one result per member, is a decode failure for all.
pub fn split(result: CalloutResult, members: usize) -> Vec<CalloutResult> {
    let decoded = match &result {
        CalloutResult::Http {
            status: Some(200..=299),
            body,
        } => Some(wire::decode_batch_json(body)),
        CalloutResult::Grpc {
            status: 0, body, ..
        } => Some(wire::decode_batch_proto(body)),
        _ => None,
    };
    match decoded {
        Some(Ok(answers)) if answers.len() == members => {
            answers.into_iter().map(CalloutResult::Answer).collect()
        }
        Some(_) => vec![CalloutResult::BatchMismatch; members],
        None => vec![result; members],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::decide::interpret;
    use crate::core::plan::{Cause, Outcome, Plan};
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
            }],
        }
    }

    #[test]
    fn a_lone_request_calls_at_once_then_others_queue_until_it_ends() {
        let b = Batcher::default();
        assert_eq!(b.join(2, &take()), None, "nothing in flight");
        b.started(4, Vec::new());
        let t1 = b.join(2, &take()).unwrap().unwrap();
        let t2 = b.join(2, &take()).unwrap().unwrap();
        assert!(t1 & VIRTUAL != 0 && t2 & VIRTUAL != 0 && t1 != t2);
        assert!(b.join(2, &take()).unwrap().is_err(), "full");
        assert_eq!(b.ended(8), None, "not this plugin's callout");
        assert_eq!(b.ended(4), Some(Vec::new()));
        b.forget(t1);
        let next: Vec<u32> = b.drain(64).into_iter().map(|(t, _)| t).collect();
        assert_eq!(next, vec![t2]);
        assert_eq!(b.waiting(), 0);
        assert_eq!(b.join(2, &take()), None, "in flight is back to 0");
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
