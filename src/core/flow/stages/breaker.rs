//! The circuit breaker as a stage ([`crate::core::local::breaker`]): before the call it reads
//! the admission record (claiming the probe there when the open interval is over) and, open,
//! refuses the call; after a callout it hears of its success or failure.

use super::{Cx, Early, Stage};
use crate::core::flow::{Host, Metric};
use crate::core::local::breaker::{self, Admission, Event};
use crate::core::wire::plan::{Cause, Outcome, Plan, Verdict};

/// The circuit breaker.
pub(in crate::core::flow) struct Breaker;

impl<H: Host> Stage<H> for Breaker {
    /// One read of the admission record: the breaker's admission, and the marks the later stages
    /// look at ([`Cx::seen`]); the plan carries the number of proxies it held.
    fn before(&self, cx: &mut Cx<'_, H>, plan: &mut Plan) -> Option<Early> {
        let seen = breaker::admit_seen(cx.host.store(), &cx.cfg.breaker, cx.now);
        plan.instances = seen.instances;
        cx.seen = Some(seen);
        (seen.admission == Admission::Reject).then_some(Early::Refused(Cause::Breaker))
    }

    /// The breaker hears of a failure only when a callout failed (a take that was never sent, a
    /// breaker that refused, are no news of the service) and only once per failed callout
    /// (the report's `counted`; the probe's always); of a success unless it
    /// was quiet ([`breaker::needs_record`]).
    fn after(&self, cx: &mut Cx<'_, H>, _: &Plan, outcome: Outcome) -> Outcome {
        let Some(report) = cx.report else {
            return outcome;
        };
        let success = match outcome {
            Outcome::Failed(cause) if cause.is_callout() => {
                cx.host.count(Metric::Failure(cause));
                if !(report.counted || report.probe) {
                    return outcome;
                }
                false
            }
            Outcome::Failed(_) => return outcome,
            _ => true,
        };
        if breaker::needs_record(report.quiet, success) {
            let (now, probe) = (report.now, report.probe);
            let store = cx.host.store();
            let event = breaker::record_shared(store, &cx.cfg.breaker, now, success, probe);
            if event != Event::None {
                cx.host.count(Metric::Breaker(event));
            }
        }
        outcome
    }

    fn admit(&self, _: &mut Cx<'_, H>, _: &Plan, outcome: Outcome) -> Result<Outcome, Verdict> {
        Ok(outcome)
    }
}
