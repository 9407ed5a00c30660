//! Shaping as a stage (a rule's `shape`): before the call, each bucket of a shaping rule asks for
//! a grant up to `max_delay_ms` ahead, if the rule has a place left for one more held request in
//! this worker (`shape.max_held`; else it is asked for unshaped, and counted). The service then
//! grants a take that cannot pay now but can within that time, for the moment its tokens will be
//! there, and the flow holds the request until then ([`crate::core::flow::Phase::Held`]).
//!
//! A place is taken here and given back by the flow once the request is not held (any verdict
//! but a delayed grant), is let through, or goes away ([`free_places`]). A shadow rule never
//! shapes (it never holds a request back). What the other stages admit in the service's place
//! (the pools, the fallback shares) is never held: those answers are now or never.
//!
//! A request a shaping rule had no place for, whose take then found the batch queue full
//! (`Cause::Queued`: this worker's own bound, the service still answering), is refused here,
//! before the fallback shares could admit it: this worker is holding or asking for `max_held` of
//! the rule's requests already, granted by the service up to `max_delay_ms` ahead, so the
//! bucket's refill is spoken for, and a share of it admitted locally would be admitted twice.

use super::{Cx, Early, Stage};
use crate::core::flow::{Host, Metric, Shaped};
use crate::core::wire::plan::{Cause, Outcome, Plan, RuleCount, Verdict};
use crate::core::wire::{Bucket, BucketResult, TakeRequest, TakeResponse};

/// Shaping.
pub(in crate::core::flow) struct Shape;

impl<H: Host> Stage<H> for Shape {
    fn before(&self, cx: &mut Cx<'_, H>, plan: &mut Plan) -> Option<Early> {
        for (b, &rule) in plan.request.buckets.iter_mut().zip(&plan.rules) {
            let Some(r) = cx.cfg.rules.get(rule).filter(|r| !r.shadow) else {
                continue;
            };
            let Some(shape) = r.rate_limit().and_then(|l| l.shape) else {
                continue;
            };
            if cx.host.place(rule, shape.max_held) {
                b.max_delay_ms = shape.max_delay_ms;
            } else {
                cx.host.count(Metric::Shape(Shaped::Full));
            }
        }
        None
    }

    fn after(&self, _: &mut Cx<'_, H>, _: &Plan, outcome: Outcome) -> Outcome {
        outcome
    }

    /// A full queue refuses what a shaping rule had no place for (the module's doc); anything
    /// else goes on.
    fn admit(&self, cx: &mut Cx<'_, H>, plan: &Plan, outcome: Outcome) -> Result<Outcome, Verdict> {
        if !matches!(outcome, Outcome::Failed(Cause::Queued)) {
            return Ok(outcome);
        }
        let mut denied = false;
        let mut buckets = Vec::with_capacity(plan.request.buckets.len());
        for (b, &rule) in plan.request.buckets.iter().zip(&plan.rules) {
            let full = match cx.cfg.rules.get(rule).filter(|r| !r.shadow) {
                Some(r) => r
                    .rate_limit()
                    .and_then(|l| l.shape)
                    .filter(|_| b.max_delay_ms == 0),
                None => None,
            };
            buckets.push(match full {
                Some(shape) => {
                    denied = true;
                    cx.counts.push((rule, RuleCount::LimitedLocally));
                    // The longest the service grants ahead: the bucket's refill is spoken for at
                    // most that far.
                    BucketResult {
                        allowed: false,
                        limit: b.capacity,
                        remaining: 0,
                        reset_ms: shape.max_delay_ms,
                        retry_after_ms: shape.max_delay_ms,
                        ..BucketResult::default()
                    }
                }
                None => BucketResult {
                    allowed: true,
                    limit: b.capacity,
                    remaining: b.capacity,
                    ..BucketResult::default()
                },
            });
        }
        if !denied {
            return Ok(outcome);
        }
        Ok(Outcome::Limited(TakeResponse::from_buckets(buckets)))
    }
}

/// The places `plan`'s shaped buckets took ([`Shape::before`]) given back.
pub(in crate::core::flow) fn free_places<H: Host>(plan: &Plan, host: &mut H) {
    for (b, &rule) in plan.request.buckets.iter().zip(&plan.rules) {
        if b.max_delay_ms > 0 {
            host.unplace(rule);
        }
    }
}

/// What a held request that goes away before it is let through gives back: the cost of each of
/// its buckets that can take tokens back (a token bucket's; its debt, repaid, stays repaid), as
/// one refund. `None`: nothing to give back.
pub(in crate::core::flow) fn unspent(plan: &Plan) -> Option<TakeRequest> {
    let buckets: Vec<Bucket> = plan
        .request
        .buckets
        .iter()
        .filter(|b| crate::core::local::bucket::refundable(b.algorithm.unwrap_or_default()))
        .map(|b| Bucket {
            cost: Some(b.cost()),
            lease: None,
            max_delay_ms: 0,
            ..b.clone()
        })
        .collect();
    (!buckets.is_empty()).then_some(TakeRequest { buckets })
}
