//! What no request waits for: a background lease refill's answer, a late answer on the stream, a
//! settlement applied, the timer's look at the lease pools, and how often the timer runs.

use super::stages::{lease::run_chores, refund};
use super::{Host, Metric};
use crate::core::base::store::CasStore;
use crate::core::config::Config;
use crate::core::decide;
use crate::core::local::breaker::{self, Event};
use crate::core::local::denials;
use crate::core::local::fallback;
use crate::core::local::lease::{self, Count};
use crate::core::settle;
use crate::core::wire::plan::{CalloutResult, Outcome, Plan};
use crate::core::wire::TakeRequest;

/// A background lease refill ended with `result`: its grant goes to the pool (or its denial is
/// cached, or its claim ends), the breaker and the fallback shares learn from it as from any
/// answer. No request waits for it. The pools this worker deposited into, for the adapter's
/// timer ([`lease::sweep`]).
#[must_use]
pub fn on_refill_result<H: Host>(
    cfg: &Config,
    plan: &Plan,
    result: CalloutResult,
    host: &mut H,
) -> Vec<lease::Held> {
    let counted = !matches!(result, CalloutResult::Shared(_));
    let outcome = decide::interpret(plan, result);
    let now = host.now_ms();
    // As a request's callout feeds it (the breaker's stage), a success always.
    let feeds = match outcome {
        Outcome::Failed(cause) if cause.is_callout() => {
            host.count(Metric::Failure(cause));
            counted.then_some(false)
        }
        Outcome::Failed(_) => None,
        _ => Some(true),
    };
    if let Some(success) = feeds {
        let event = breaker::record_shared(host.store(), &cfg.breaker, now, success, false);
        if event != Event::None {
            host.count(Metric::Breaker(event));
        }
    }
    let (outcome, repaid) = fallback::repay_debts(plan, outcome);
    let previous = host.applied().previous_max_keys;
    fallback::remember(cfg, previous, plan, &outcome, &repaid, host.store(), now);
    let (granted, chores) = lease::refilled(cfg, plan, &outcome, host.store(), now);
    if granted > 0 {
        host.count(Metric::Lease(Count::Granted, granted));
    }
    let mut watched = Vec::new();
    run_chores(cfg, chores, &mut watched, host);
    watched
}

/// A settlement was applied: a denial this Envoy remembered of a bucket it gave tokens back to no
/// longer holds.
pub fn settlement_applied<S: CasStore + ?Sized>(cfg: &Config, items: &[settle::Item], store: &S) {
    denials::forget(cfg, settle::given_back(items), store);
}

/// An answer on the stream, `result`, to a message that failed at its deadline, whose takes were
/// `takes` (`None`: one whose request had gone): each of them went on without it (the failure
/// mode decided it), so what it granted, no request spends. Those tokens go back to the global
/// bucket as unspent ones, so nothing is charged twice: a token bucket's, by refund (one refund
/// per bucket, at most [`contract::bounds::MAX_BUCKETS`] buckets each); a window's tokens cannot
/// be given back. A denial or an error needs nothing.
pub fn late_answer<H: Host>(
    cfg: &Config,
    takes: &[Option<TakeRequest>],
    result: CalloutResult,
    host: &mut H,
) {
    let answers = match result {
        CalloutResult::Answers(a) if a.len() == takes.len() => a,
        _ => Vec::new(),
    };
    let mut back: Vec<crate::core::wire::Bucket> = Vec::new();
    for (take, answer) in takes.iter().zip(&answers) {
        let Some(take) = take.as_ref().filter(|_| answer.allowed) else {
            continue;
        };
        for (b, r) in take.buckets.iter().zip(&answer.buckets) {
            if !crate::core::local::bucket::refundable(b.algorithm.unwrap_or_default()) {
                continue;
            }
            // What this take was charged: its grant (its cost, debt and lease included), or its
            // cost from a service that reports no grant.
            let n = if r.granted > 0 { r.granted } else { b.cost() };
            let same = |o: &crate::core::wire::Bucket| {
                (&o.key, o.capacity, o.rate, o.period_ms, o.algorithm)
                    == (&b.key, b.capacity, b.rate, b.period_ms, b.algorithm)
            };
            match back.iter_mut().find(|o| same(o)) {
                Some(o) => o.cost = Some(o.cost.unwrap_or(0).saturating_add(n)),
                None => back.push(crate::core::wire::Bucket {
                    cost: Some(n),
                    lease: None,
                    ..b.clone()
                }),
            }
        }
    }
    let returned = back.iter().map(|b| b.cost.unwrap_or(0)).sum();
    for buckets in back.chunks(contract::bounds::MAX_BUCKETS) {
        let request = TakeRequest {
            buckets: buckets.to_vec(),
        };
        refund(cfg, &request, host);
    }
    host.count(Metric::Late { returned });
}

/// The timer's look at the lease pools this worker deposited into (`held`): tokens left unspent
/// past their age go back to the service.
pub fn sweep<H: Host>(cfg: &Config, held: &mut Vec<lease::Held>, host: &mut H) {
    let now = host.now_ms();
    let (returns, tokens) = lease::sweep(host.store(), held, now);
    for r in &returns {
        refund(cfg, r, host);
    }
    if tokens > 0 {
        host.count(Metric::Lease(Count::Expired, tokens));
        host.count(Metric::Lease(Count::Returned, tokens));
    }
}

/// The timer's period while requests are held (shaping): a held request is let through at most
/// this long after its time (plus the host's own timer lateness). The adapter runs one root's timer
/// this fast only while the VM holds a request, so shaping costs nothing while none is held.
pub const HOLD_TICK_MS: u32 = 5;

/// How often the adapter's timer should call: as often as the stream's messages and the batch
/// queue need their deadlines looked at (`service.stream` or `service.batch`:
/// [`crate::core::config::Service::tick_ms`]), and at least as often as the settlements and lease
/// pools need (`chores_period_ms`); `None`: never.
pub fn tick_period_ms(cfg: &Config) -> Option<u32> {
    let svc = &cfg.service;
    let waits = (svc.stream || svc.batch > 0).then(|| u32::try_from(svc.tick_ms()).unwrap_or(50));
    match (waits, chores_period_ms(cfg)) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The timer the settlements and lease pools need: every first backoff of the settlements when
/// a rule is charged by the response, else to look at the lease pools for expired tokens, half
/// the shortest `max_age_ms` of the token-bucket lease rules, between 100 ms and a second;
/// `None`: never.
fn chores_period_ms(cfg: &Config) -> Option<u32> {
    if cfg.charges_by_response() {
        // Settlements are tried again from the timer (the first backoff is 100 ms).
        return u32::try_from(crate::core::settle::FIRST_BACKOFF_MS).ok();
    }
    let shortest = cfg
        .rules
        .iter()
        .filter_map(crate::core::config::Rule::rate_limit)
        .filter(|r| r.algorithm == crate::core::config::Algorithm::TokenBucket)
        .filter_map(|r| r.lease.map(|l| l.max_age_ms))
        .min()?;
    u32::try_from((shortest / 2).clamp(100, 1000)).ok()
}
