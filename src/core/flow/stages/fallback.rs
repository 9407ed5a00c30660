//! The fallback shares as a stage ([`crate::core::local::fallback`]): before the call, the debts
//! the request's buckets owe ride on it and, in recovery after an outage, the shares pay first;
//! after an answer, the debts it carried are settled and the shares kept in step; when the
//! service did not admit, the shares answer for a failure (`failure_mode: fallback`), and in
//! recovery they have the last word on an admission.

use super::{refund, Cx, Early, Stage};
use crate::core::decide;
use crate::core::flow::{Host, Recovery};
use crate::core::local::breaker::Admission;
use crate::core::local::bucket;
use crate::core::local::fallback;
use crate::core::wire::plan::{Outcome, Plan, Verdict};
use crate::core::wire::{Bucket, TakeRequest};

/// The fallback shares and their debts.
pub(in crate::core::flow) struct Fallback;

impl<H: Host> Stage<H> for Fallback {
    /// The fallback admitted on credit recently (or the breaker refused): this callout repays what
    /// its buckets owe, and says whether they are in recovery from an outage ([`Recovery`]).
    fn before(&self, cx: &mut Cx<'_, H>, plan: &mut Plan) -> Option<Early> {
        let seen = cx.seen?;
        let store = cx.host.store();
        let previous = cx.host.applied().previous_max_keys;
        if !(seen.debt && fallback::attach_debts(cx.cfg, previous, plan, store, cx.now)) {
            return None;
        }
        // The probe must call, and so must a debt to repay: the shares look at the answer.
        if seen.admission == Admission::Probe || !plan.debt.is_empty() {
            cx.recovery = Recovery::Check;
            return None;
        }
        let sh = fallback::Shares::of_plan(cx.cfg, previous, plan, store);
        let spend = fallback::Charge::SPEND;
        let paid = fallback::take_all_as(store, &sh, &plan.request, cx.now, spend);
        if !paid.allowed {
            // Denied by the shares, as in the outage: no callout.
            return Some(Early::Verdict(decide::from_shares(cx.cfg, plan, &paid)));
        }
        cx.recovery = Recovery::Prepaid;
        None
    }

    /// What a request in recovery prepaid from its shares goes back to them when its callout did
    /// not admit it (before the answer lowers them or the fallback takes from them); then the
    /// debts the callout carried are settled and every bucket's share follows the answer.
    fn after(&self, cx: &mut Cx<'_, H>, plan: &Plan, outcome: Outcome) -> Outcome {
        let store = cx.host.store();
        let previous = cx.host.applied().previous_max_keys;
        if cx.recovery == Recovery::Prepaid && !matches!(outcome, Outcome::Allowed(_)) {
            let sh = fallback::Shares::of_plan(cx.cfg, previous, plan, store);
            fallback::refund_spent(store, &sh, &plan.request, cx.host.now_ms());
        }
        let (outcome, repaid) = fallback::repay_debts(plan, outcome);
        fallback::remember(cx.cfg, previous, plan, &outcome, &repaid, store, cx.now);
        outcome
    }

    fn admit(&self, cx: &mut Cx<'_, H>, plan: &Plan, outcome: Outcome) -> Result<Outcome, Verdict> {
        let store = cx.host.store();
        let previous = cx.host.applied().previous_max_keys;
        match (&outcome, cx.recovery) {
            (Outcome::Allowed(_), Recovery::Check) => {
                // Admitted by the service (its debts repaid): the shares have the last word.
                let sh = fallback::Shares::of_plan(cx.cfg, previous, plan, store);
                let spend = fallback::Charge::SPEND;
                let paid = fallback::take_all_as(store, &sh, &plan.request, cx.now, spend);
                if !paid.allowed {
                    give_back_charged(cx, plan);
                    return Err(decide::from_shares(cx.cfg, plan, &paid));
                }
            }
            (Outcome::Failed(cause), _) => {
                let req = &plan.request;
                cx.shares = fallback::on_failure(cx.cfg, previous, req, *cause, store, cx.now);
            }
            _ => {}
        }
        Ok(outcome)
    }
}

/// Not admitted in the end: what the service charged for the request's cost goes back to the
/// global bucket, where the debts of the proxies not back yet find it (a window's tokens end with
/// their window: nothing to give back).
fn give_back_charged<H: Host>(cx: &mut Cx<'_, H>, plan: &Plan) {
    let back: Vec<Bucket> = plan
        .request
        .buckets
        .iter()
        .filter(|b| bucket::refundable(b.algorithm.unwrap_or_default()))
        .map(|b| Bucket {
            lease: None,
            ..b.clone()
        })
        .collect();
    if !back.is_empty() {
        refund(cx.cfg, &TakeRequest { buckets: back }, cx.host);
    }
}
