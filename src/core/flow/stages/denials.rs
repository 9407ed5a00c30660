//! Remembered denials as a stage ([`crate::core::local::denials`]): before the call, a denial
//! the service gave moments ago answers (only while the admission record's mark says one may
//! hold); after the service's own denial, it is remembered and the mark extended.

use super::{Cx, Early, Stage};
use crate::core::flow::Host;
use crate::core::local::breaker::Admission;
use crate::core::local::denials;
use crate::core::local::record;
use crate::core::wire::plan::{Outcome, Plan, RuleCount, Verdict};

/// The remembered denials.
pub(in crate::core::flow) struct Denials;

impl<H: Host> Stage<H> for Denials {
    fn before(&self, cx: &mut Cx<'_, H>, plan: &mut Plan) -> Option<Early> {
        let seen = cx.seen?;
        if !seen.denials || seen.admission != Admission::Call {
            return None;
        }
        // The service denied this cost moments ago and could not pay it yet.
        let resp = denials::recall(cx.cfg, plan, cx.host.store(), cx.now)?;
        for (i, b) in resp.buckets.iter().enumerate() {
            if let (false, Some(&r)) = (b.allowed, plan.rules.get(i)) {
                cx.counts.push((r, RuleCount::LimitedLocally));
            }
        }
        Some(Early::Outcome(Outcome::Limited(resp)))
    }

    /// Only the service's own denials are remembered: one the fallback's debts made of an
    /// admission whose grant fell short of the debt it carried is about the debt, and the next
    /// callout repays more.
    fn after(&self, cx: &mut Cx<'_, H>, plan: &Plan, outcome: Outcome) -> Outcome {
        if cx.denied_by_service {
            let until = denials::remember(cx.cfg, plan, &outcome, cx.host.store(), cx.now);
            if until > 0 {
                record::mark_denied(cx.host.store(), until);
            }
        }
        outcome
    }

    fn admit(&self, _: &mut Cx<'_, H>, _: &Plan, outcome: Outcome) -> Result<Outcome, Verdict> {
        Ok(outcome)
    }
}
