//! The local stages of a request's decision, each behind one small trait ([`Stage`]) and listed
//! once, in the order they apply ([`stages`]):
//!
//! | stage | before the call | after an answer | when the service did not admit |
//! |---|---|---|---|
//! | `lease` ([`lease::Lease`]) | the pools pay, or a cached denial answers | deposits, cached denials, refills | the pools pay for a denial or a failure |
//! | `breaker` ([`breaker::Breaker`]) | reads the admission record (the probe claimed there); open: refused | the callout's success or failure | — |
//! | `denials` ([`denials::Denials`]) | a remembered denial answers | the service's denials remembered | — |
//! | `shape` ([`shape::Shape`]) | a shaping rule's bucket asks for a grant up to `max_delay_ms` ahead, while the rule has a place to hold one more request | — | a take the full batch queue refused is refused when a shaping rule had no place for it |
//! | `fallback` ([`fallback::Fallback`]) | debts attached; in recovery, the shares pay first | debts settled, shares kept in step | in recovery, the shares have the last word; a failure takes from them |
//!
//! Before the call the stages look in that order, the first answer ending the look; after an
//! answer they update their state in the reverse order (the fallback learns the number of proxies
//! an answer reports before the pools deposit by it); when the service did not admit, each says in
//! order what it admits instead. A stage module talks to its own state in `core/local/` and to
//! the admission record (`core::local::record`), never to another stage.

pub(super) mod breaker;
pub(super) mod denials;
pub(super) mod fallback;
pub(super) mod lease;
pub(super) mod shape;

use super::{Callout, Host, Recovery, Report};
use crate::core::config::Config;
use crate::core::local::breaker::Seen;
use crate::core::local::denials as remembered;
use crate::core::local::lease::Held;
use crate::core::wire::plan::{Cause, Outcome, Plan, RuleCount, Verdict};
use crate::core::wire::{TakeRequest, TakeResponse};
use log::debug;

/// What a request's stages share while it is decided: the configuration, the host, the clock,
/// the admission record as the breaker read it, and what the stages leave for the flow.
pub(super) struct Cx<'a, H: Host> {
    /// The configuration.
    pub cfg: &'a Config,
    /// The host (shared data, callouts, counters).
    pub host: &'a mut H,
    /// When the request was admitted, or its callout ended (ms).
    pub now: u64,
    /// The admission record as read at admission (`None` until the breaker's stage read it: the
    /// lease pools may decide before).
    pub seen: Option<Seen>,
    /// What the fallback shares have to say about the answer (after an outage).
    pub recovery: Recovery,
    /// How the callout ended, for the breaker.
    pub report: Option<Report>,
    /// The answer was the service's own denial (not one a debt made of an admission).
    pub denied_by_service: bool,
    /// Per-rule counts beside the verdict's (rules a remembered denial answered).
    pub counts: &'a mut Vec<(usize, RuleCount)>,
    /// Lease pools this request's work deposited into.
    pub watched: &'a mut Vec<Held>,
    /// What the fallback shares answered for a failure: the failure mode's answer
    /// ([`crate::core::decide::resolve`]).
    pub shares: Option<TakeResponse>,
}

impl<'a, H: Host> Cx<'a, H> {
    /// A request's context at `now`, nothing read or said yet.
    pub fn new(
        cfg: &'a Config,
        host: &'a mut H,
        now: u64,
        counts: &'a mut Vec<(usize, RuleCount)>,
        watched: &'a mut Vec<Held>,
    ) -> Self {
        Cx {
            cfg,
            host,
            now,
            seen: None,
            recovery: Recovery::None,
            report: None,
            denied_by_service: false,
            counts,
            watched,
            shares: None,
        }
    }
}

/// A stage's answer before the call.
#[derive(Debug)]
pub(super) enum Early {
    /// Decided here with this outcome, as an answer would be.
    Outcome(Outcome),
    /// Decided here with this verdict.
    Verdict(Verdict),
    /// No call: the failure mode decides, for this cause (the breaker's refusal).
    Refused(Cause),
}

/// One local stage.
pub(super) trait Stage<H: Host> {
    /// Before the call: an answer here (`Some`), or the next stage looks.
    fn before(&self, cx: &mut Cx<'_, H>, plan: &mut Plan) -> Option<Early>;
    /// After an answer, a failure or a refusal: this stage's state brought in step; the outcome
    /// the next stage sees.
    fn after(&self, cx: &mut Cx<'_, H>, plan: &Plan, outcome: Outcome) -> Outcome;
    /// What this stage admits when the service did not (or what it refuses of what the service
    /// admitted): the outcome the next stage sees, or the verdict.
    fn admit(&self, cx: &mut Cx<'_, H>, plan: &Plan, outcome: Outcome) -> Result<Outcome, Verdict>;
}

/// The local stages, in the order they apply before the call.
pub(super) fn stages<'s, H: Host + 's>() -> [&'s (dyn Stage<H> + 's); 5] {
    [
        &lease::Lease,
        &breaker::Breaker,
        &denials::Denials,
        &shape::Shape,
        &fallback::Fallback,
    ]
}

/// Before the call: the first stage's answer, if any.
pub(super) fn before<H: Host>(cx: &mut Cx<'_, H>, plan: &mut Plan) -> Option<Early> {
    stages::<H>().iter().find_map(|s| s.before(cx, plan))
}

/// After an answer (or a failure, or a refusal): every stage brought in step, in reverse order.
pub(super) fn after<H: Host>(cx: &mut Cx<'_, H>, plan: &Plan, outcome: Outcome) -> Outcome {
    stages::<H>()
        .iter()
        .rev()
        .fold(outcome, |o, s| s.after(cx, plan, o))
}

/// What the stages admit instead of what the service said, in order.
pub(super) fn admit<H: Host>(
    cx: &mut Cx<'_, H>,
    plan: &Plan,
    outcome: Outcome,
) -> Result<Outcome, Verdict> {
    stages::<H>()
        .iter()
        .try_fold(outcome, |o, s| s.admit(cx, plan, o))
}

/// Sends `request`'s costs back to the global bucket as unspent tokens, not awaited. A denial this
/// Envoy remembered of those buckets no longer holds once they are back.
pub(super) fn refund<H: Host>(cfg: &Config, request: &TakeRequest, host: &mut H) {
    if let Err(why) = host.send(cfg, Callout::Refund(request)) {
        debug!("refund not dispatched: {why}");
        return;
    }
    remembered::forget(cfg, &request.buckets, host.store());
}
