//! Debts and recovery: what a callout carries of what its buckets owe ([`attach_debts`]), how an
//! answer settles it ([`repay_debts`]), how long a bucket the breaker refused stays in recovery
//! ([`recovery_until`]), and the failure mode's take from the shares ([`on_failure`]).

use super::MAX_LEASE;
use super::{debt_horizon_ms, enabled, limits_of, standing, take_all_as, Charge, Shares};
use crate::core::base::store::CasStore;
use crate::core::config::Config;
use crate::core::local::record;
use crate::core::wire::plan::{Cause, Outcome, Plan};
use crate::core::wire::{TakeRequest, TakeResponse};

/// Until when a bucket the breaker refused at `now_ms` stays in recovery, the breaker's open
/// interval being `interval_ms`: as long as the other proxies' breakers may still be open once
/// the service answers again. Their breakers opened with this one's and double on the same
/// schedule, so each probes within its own interval, at most twice this one's (one doubling
/// ahead) and never more than `breaker.max_open_ms` apart; and a callout timeout on either side.
pub fn recovery_until(cfg: &Config, now_ms: u64, interval_ms: u64) -> u64 {
    let spread = interval_ms
        .saturating_mul(2)
        .clamp(cfg.breaker.open_ms, cfg.breaker.max_open_ms);
    now_ms
        .saturating_add(spread)
        .saturating_add(cfg.service.timeout_ms.saturating_mul(2))
}

/// The failure mode's answer when the service could not be asked (`None` unless
/// `failure_mode: fallback`): every bucket of `req` taken from its share, owed; a request the
/// breaker refused also puts its buckets in recovery ([`Charge::outage`], for as long as the
/// other proxies' breakers may still be open). A take admitted on credit, and the breaker's
/// refusal, mark in the admission record that debts may be outstanding
/// ([`record::mark_debt`]), so the next callouts look for them ([`attach_debts`]), also when the
/// refusal admitted nothing on credit.
pub fn on_failure<S: CasStore + ?Sized>(
    cfg: &Config,
    previous: [u32; 3],
    req: &TakeRequest,
    cause: Cause,
    store: &S,
    now_ms: u64,
) -> Option<TakeResponse> {
    if !enabled(cfg) {
        return None;
    }
    let refused = cause == Cause::Breaker;
    let how = if refused {
        let open = record::read(store).breaker;
        Charge::outage(recovery_until(cfg, now_ms, open.interval_ms))
    } else {
        Charge::OWE
    };
    let resp = take_all_as(store, &Shares::of(cfg, previous), req, now_ms, how);
    if refused || resp.allowed {
        record::mark_debt(store, now_ms.saturating_add(debt_horizon_ms(cfg)));
    }
    Some(resp)
}

/// Before a callout: every bucket that owes tokens carries its debt as a lease on top of what
/// it asks (`lease = (lease or cost) + debt`, within the contract's bound), recorded in
/// `plan.debt`. Call only when debt may exist (the admission record keeps that mark: [`record::mark_debt`]), since it
/// reads one slot per bucket.
///
/// Returns whether the request is **in recovery**: one of its buckets had a request refused by
/// the breaker recently ([`recovery_until`]). The other proxies came through the same outage, each
/// admitting its share on credit, and may not be back yet: the tokens the global bucket gathered
/// meanwhile are what they owe, and a proxy back first that spent them on new requests would leave
/// their debts unpaid (admitted twice, once on credit and once by the service). So in recovery a
/// request is admitted only when its buckets' shares can pay for it too ([`Charge::SPEND`]), as
/// in the outage, while the service charges it: each proxy spends its share of the refill, and
/// the debts find the rest. Never for a leasing rule's request (its pool was charged already, its
/// share refills from empty) nor over RLS (no debts).
pub fn attach_debts<S: CasStore + ?Sized>(
    cfg: &Config,
    previous: [u32; 3],
    plan: &mut Plan,
    store: &S,
    now_ms: u64,
) -> bool {
    // An RLS server grants no leases: a debt cannot ride on its callouts (it lapses instead).
    if !enabled(cfg) || plan.rls.is_some() {
        return false;
    }
    let sh = Shares::of_plan(cfg, previous, plan, store);
    let n = plan.request.buckets.len();
    let mut debts = vec![0u64; n];
    let mut any = false;
    let mut recovering = false;
    for (i, b) in plan.request.buckets.iter_mut().enumerate() {
        let l = limits_of(b, sh.instances);
        let (d, until) = standing(store, &sh, &b.key, &l, now_ms);
        recovering |= now_ms < until;
        if d == 0 {
            continue;
        }
        let cost = b.cost();
        let base = b.lease.unwrap_or(cost);
        let d = d.min(MAX_LEASE.saturating_sub(base));
        if d == 0 {
            continue;
        }
        b.lease = Some(base + d);
        if let Some(x) = debts.get_mut(i) {
            *x = d;
        }
        any = true;
    }
    if any {
        plan.debt = debts;
    }
    let leases = plan.rules.iter().any(|&k| {
        cfg.rules
            .get(k)
            .and_then(|r| r.rate_limit())
            .is_some_and(|l| l.lease.is_some())
    });
    recovering && !leases
}

/// Applies an answer to the debts its callout carried, debt first: a bucket whose `granted` covers
/// its cost and its whole debt is admitted and its debt repaid; one whose `granted` falls short has
/// everything it was charged count towards its debt, and the request is denied (the tokens the
/// fleet already spent on credit come before new requests). Returns the outcome to act on and, per
/// bucket, the tokens of debt repaid. Buckets of a request denied this way keep what the service
/// charged them (stricter, never looser).
pub fn repay_debts(plan: &Plan, outcome: Outcome) -> (Outcome, Vec<u64>) {
    let mut repaid = vec![0u64; plan.request.buckets.len()];
    let Outcome::Allowed(mut resp) = outcome else {
        return (outcome, repaid);
    };
    if plan.debt.iter().all(|&d| d == 0) {
        return (Outcome::Allowed(resp), repaid);
    }
    let mut short = false;
    for (i, (b, r)) in plan
        .request
        .buckets
        .iter()
        .zip(resp.buckets.iter_mut())
        .enumerate()
    {
        let debt = plan.debt(i);
        if debt == 0 {
            continue;
        }
        let cost = b.cost();
        let paid = if r.granted >= cost.saturating_add(debt) {
            debt
        } else {
            short = true;
            let paid = r.granted.min(debt);
            // Denied: come back when the rest of the debt and this cost have refilled.
            let need = debt - paid + cost;
            let rate = b.rate().max(1);
            r.allowed = false;
            r.retry_after_ms = u64::try_from(
                (u128::from(need) * u128::from(b.period_ms)).div_ceil(u128::from(rate)),
            )
            .unwrap_or(u64::MAX)
            .max(1);
            paid
        };
        if let Some(x) = repaid.get_mut(i) {
            *x = paid;
        }
    }
    if short {
        resp.allowed = false;
        (Outcome::Limited(resp), repaid)
    } else {
        (Outcome::Allowed(resp), repaid)
    }
}
