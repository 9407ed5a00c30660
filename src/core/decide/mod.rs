//! The per-request decision, as pure functions the adapter drives:
//!
//! 1. [`decide`]: which buckets a request takes from, and which concurrency slots it wants, in one
//!    pass over the rules. No matching rate rule → [`Step::Continue`], no callout at all; otherwise
//!    one [`Plan`] with every matching rate rule's bucket (one callout, all or nothing, in rule
//!    order).
//! 2. [`interpret`]: what a callout's result means. Every way a callout can fail (dispatch error,
//!    timeout, reset, connect failure, non-2xx, gRPC status ≠ 0, undecodable or mismatched body)
//!    becomes one value, [`Outcome::Failed`] with its [`Cause`].
//! 3. [`resolve`]: the single place that turns an outcome into a [`Verdict`]: the service's answer
//!    as is, or the failure mode (`fallback` / `allow` / `deny`) for a failure (the breaker's
//!    refusal included), then shadow mode on top. [`resolve_slots`] is its counterpart for a
//!    concurrency rule's acquire that got no answer: the same `failure_mode`, applied to slots.

//!
//! `headers`: `Retry-After`, `RateLimit` / `RateLimit-Policy`, `X-RateLimit-*`.

pub mod headers;

use crate::core::base::store::CasStore;
use crate::core::config::{
    Config, FailureMode, HeaderStyle, KeyPart, Limit, Rule, RuleKind, Transport,
};
use crate::core::local::slots::{self, Want};
use crate::core::rules::limits::{cost_for, limit_for};
use crate::core::rules::{keys, matches, Request};
use crate::core::wire::{self, Bucket, BucketResult, TakeRequest, TakeResponse};
use headers::{rate_limit_headers, retry_after};
use std::borrow::Cow;

use crate::core::wire::plan::{
    Action, CalloutResult, Cause, Decision, LocalReply, Outcome, Plan, RuleCount, Step, Verdict,
};

/// What `req`'s rules ask of it, found in one pass over `Config::rules`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched {
    /// The callout of the matching rate rules (or none).
    pub step: Step,
    /// The slots of the matching concurrency rules, taken once the rate rules admitted it.
    pub slots: Vec<Want>,
    /// Per-rule events of reading the request (a limit read from it clamped, or absent), to count.
    pub counts: Vec<(usize, RuleCount)>,
}

/// Whether a rule `req` matches reads the request's model: keyed by it (its key or its RLS
/// descriptor), or priced by it (`usage.prices`).
pub fn reads_model(cfg: &Config, req: &Request) -> bool {
    cfg.rules.iter().any(|rule| {
        let by_key = rule.key.contains(&KeyPart::Model);
        let by_rate = rule.rate_limit().is_some_and(|l| {
            l.descriptor.iter().any(|(_, p)| *p == KeyPart::Model)
                || l.charge.as_ref().is_some_and(|c| !c.prices.is_empty())
        });
        (by_key || by_rate) && matches(&rule.matcher, req, cfg.trusted_hops)
    })
}

/// Plans the callout for `req` and notes the slots it wants: each rule that matches and whose key
/// could be built gives a bucket (a rate rule) or a slot (a concurrency rule).
pub fn decide(cfg: &Config, req: &Request) -> Matched {
    let mut plan = Plan {
        request: TakeRequest::default(),
        rules: Vec::new(),
        debt: Vec::new(),
        rls: (cfg.service.transport == Transport::Rls).then(|| wire::RlsRequest {
            domain: cfg.service.domain.clone(),
            descriptors: Vec::new(),
        }),
        instances: 0,
    };
    let mut slots = Vec::new();
    let mut counts = Vec::new();
    for (i, rule) in cfg.rules.iter().enumerate() {
        if !matches(&rule.matcher, req, cfg.trusted_hops) {
            continue;
        }
        let Some(key) = keys::build_key(rule, req, cfg.trusted_hops) else {
            continue;
        };
        let l = match &rule.kind {
            RuleKind::Rate(l) => l,
            RuleKind::Concurrency(_) => {
                slots.push(Want { rule: i, key });
                continue;
            }
        };
        let mut noted = Vec::new();
        let limit = limit_for(rule, l, req, cfg.trusted_hops, &mut noted);
        let (capacity, rate, period_ms) = match limit {
            // An allow-listed key: this rule takes no bucket for the request.
            Limit::Unlimited => continue,
            Limit::Tokens {
                capacity,
                rate,
                period_ms,
            } => (capacity, rate, period_ms),
        };
        plan.request.buckets.push(Bucket {
            key,
            capacity,
            rate: Some(rate),
            period_ms,
            cost: Some(cost_for(l, req, &mut noted)),
            algorithm: Some(l.algorithm),
            // Set by the lease pools when this request is the one that refills (core::lease).
            lease: None,
            max_delay_ms: 0,
            calendar: l.calendar.clone(),
        });
        counts.extend(noted.into_iter().map(|c| (i, c)));
        plan.rules.push(i);
        if let Some(rls) = &mut plan.rls {
            rls.descriptors
                .push(keys::descriptor(l, req, cfg.trusted_hops));
        }
    }
    let step = if plan.rules.is_empty() {
        Step::Continue
    } else {
        Step::Callout(plan)
    };
    Matched {
        step,
        slots,
        counts,
    }
}

/// When an answer denied only because of rules in shadow mode while other rules of the request
/// enforce: the plan of the enforcing rules' buckets alone (to ask again, since the service charged
/// none of them: all or nothing), and the shadow rules' counts. `None` otherwise.
pub fn without_shadow(
    cfg: &Config,
    plan: &Plan,
    outcome: &Outcome,
) -> Option<(Plan, Vec<(usize, RuleCount)>)> {
    let Outcome::Limited(resp) = outcome else {
        return None;
    };
    let shadow = |i: usize| {
        plan.rules
            .get(i)
            .and_then(|&r| cfg.rules.get(r))
            .is_some_and(|r| r.shadow)
    };
    let n = plan.request.buckets.len();
    let denied: Vec<usize> = (0..n)
        .filter(|&i| resp.buckets.get(i).is_some_and(|b| !b.allowed))
        .collect();
    if denied.is_empty() || !denied.iter().all(|&i| shadow(i)) || (0..n).all(shadow) {
        return None;
    }
    let mut enforced = Plan {
        request: TakeRequest::default(),
        rules: Vec::new(),
        debt: Vec::new(),
        rls: plan.rls.as_ref().map(|r| wire::RlsRequest {
            domain: r.domain.clone(),
            descriptors: Vec::new(),
        }),
        instances: plan.instances,
    };
    for i in (0..n).filter(|&i| !shadow(i)) {
        if let (Some(b), Some(&r)) = (plan.request.buckets.get(i), plan.rules.get(i)) {
            let mut b = b.clone();
            // What this bucket asks for itself: its debt, if any, is attached again.
            b.lease = plan.own_lease(i);
            enforced.request.buckets.push(b);
            enforced.rules.push(r);
            if let (Some(to), Some(from)) = (&mut enforced.rls, &plan.rls) {
                to.descriptors
                    .push(from.descriptors.get(i).cloned().unwrap_or_default());
            }
        }
    }
    let counts = denied
        .iter()
        .filter_map(|&i| plan.rules.get(i).map(|&r| (r, RuleCount::ShadowLimited)))
        .collect();
    Some((enforced, counts))
}

/// Envoy's own 503 when it cannot reach the cluster (as opposed to the service's JSON 503).
fn is_envoy_connect_failure(body: &[u8]) -> bool {
    const MARKERS: [&[u8]; 3] = [
        b"upstream connect error",
        b"no healthy upstream",
        b"connection failure",
    ];
    MARKERS
        .iter()
        .any(|m| body.windows(m.len()).any(|w| w == *m))
}

fn grpc_message_says(message: &Option<String>, needles: &[&str]) -> bool {
    let Some(m) = message else { return false };
    let m = m.to_ascii_lowercase();
    needles.iter().any(|n| m.contains(n))
}

/// Interprets a callout's result for `plan`.
pub fn interpret(plan: &Plan, result: CalloutResult) -> Outcome {
    let decoded = match result {
        CalloutResult::DispatchError => return Outcome::Failed(Cause::Dispatch),
        CalloutResult::Answer(resp) => Ok(resp),
        CalloutResult::Http { status: None, .. } => return Outcome::Failed(Cause::Reset),
        CalloutResult::Http {
            status: Some(s),
            body,
        } => match s {
            200..=299 => wire::decode_json(&body),
            504 => return Outcome::Failed(Cause::Timeout),
            503 if is_envoy_connect_failure(&body) => return Outcome::Failed(Cause::Connect),
            _ => return Outcome::Failed(Cause::Status),
        },
        CalloutResult::Grpc {
            status: 0, body, ..
        } => match &plan.rls {
            Some(_) => wire::decode_rls(&body, &plan.request),
            None => wire::decode_proto(&body),
        },
        CalloutResult::Grpc { status: 4, .. } => return Outcome::Failed(Cause::Timeout),
        CalloutResult::Grpc {
            status: 14,
            message,
            ..
        } => {
            return Outcome::Failed(if grpc_message_says(&message, &["timeout", "timed out"]) {
                Cause::Timeout
            } else if grpc_message_says(
                &message,
                &[
                    "upstream connect error",
                    "no healthy upstream",
                    "connection failure",
                ],
            ) {
                Cause::Connect
            } else {
                Cause::GrpcStatus
            })
        }
        CalloutResult::Grpc { .. } => return Outcome::Failed(Cause::GrpcStatus),
        CalloutResult::TooLarge { size } => {
            log::debug!("an answer of {size} bytes is larger than any valid one");
            return Outcome::Failed(Cause::Decode);
        }
        // A batch's answers reach a take only split ([`crate::core::wire::batch::split`]).
        CalloutResult::BatchMismatch | CalloutResult::Answers(_) => {
            return Outcome::Failed(Cause::Decode)
        }
        CalloutResult::Expired => return Outcome::Failed(Cause::Timeout),
        CalloutResult::Unsent => return Outcome::Failed(Cause::Queued),
        CalloutResult::Shared(inner) => return interpret(plan, *inner),
    };
    let Ok(resp) = decoded else {
        return Outcome::Failed(Cause::Decode);
    };
    // An answer must cover exactly the buckets asked about, and agree with itself.
    if resp.buckets.len() != plan.request.buckets.len() {
        return Outcome::Failed(Cause::Decode);
    }
    if resp.allowed != resp.buckets.iter().all(|b| b.allowed) {
        return Outcome::Failed(Cause::Decode);
    }
    if resp.allowed {
        Outcome::Allowed(resp)
    } else {
        Outcome::Limited(resp)
    }
}

/// The rule and result of each bucket, for headers.
/// The rule of each bucket of `plan`, with the limits that bucket was asked with (an override or a
/// tier may have replaced the rule's own), for the headers.
fn effective<'a>(cfg: &'a Config, plan: &Plan) -> Vec<Cow<'a, Rule>> {
    plan.rules
        .iter()
        .zip(&plan.request.buckets)
        .filter_map(|(&i, b)| {
            let rule = cfg.rules.get(i)?;
            let l = rule.rate_limit()?;
            let rate = b.rate();
            if (b.capacity, rate, b.period_ms) == (l.capacity, l.rate, l.period_ms) {
                return Some(Cow::Borrowed(rule));
            }
            let mut r = rule.clone();
            if let RuleKind::Rate(l) = &mut r.kind {
                (l.capacity, l.rate, l.period_ms) = (b.capacity, rate, b.period_ms);
            }
            Some(Cow::Owned(r))
        })
        .collect()
}

/// The rate limit headers of a decision: each rule's bucket in the styles its `response.headers`
/// asks for (on an allowed request only for rules with `response.on_allowed`), styles in the order
/// of the global `response.headers`.
fn headers_for(
    cfg: &Config,
    its: &[(&Rule, &BucketResult)],
    allowed: bool,
) -> Vec<(String, String)> {
    // The styles in the order they are first named (at most two: no allocation for the list).
    let mut styles: [Option<HeaderStyle>; 2] = [None; 2];
    let named = cfg
        .response
        .headers
        .iter()
        .chain(its.iter().flat_map(|(r, _)| r.response.headers.iter()));
    for st in named {
        if styles.contains(&Some(*st)) {
            continue;
        }
        if let Some(free) = styles.iter_mut().find(|s| s.is_none()) {
            *free = Some(*st);
        }
    }
    let mut out = Vec::with_capacity(5);
    for style in styles.into_iter().flatten() {
        let chosen: Vec<(&Rule, &BucketResult)> = its
            .iter()
            .filter(|(r, _)| {
                r.response.headers.contains(&style) && (!allowed || r.response.on_allowed)
            })
            .copied()
            .collect();
        out.extend(rate_limit_headers(&[style], &chosen));
    }
    out
}

fn near_limit(cfg: &Config, r: &BucketResult) -> bool {
    r.limit > 0
        && u128::from(r.remaining) * 1000
            <= u128::from(r.limit) * u128::from(cfg.near_limit_left_permille)
}

fn from_answer(cfg: &Config, plan: &Plan, resp: &TakeResponse, fallback: bool) -> Verdict {
    let rules = effective(cfg, plan);
    let its: Vec<(&Rule, &BucketResult)> =
        rules.iter().map(AsRef::as_ref).zip(&resp.buckets).collect();
    if resp.allowed {
        let mut rule_counts = Vec::with_capacity(plan.rules.len());
        for (&ri, r) in plan.rules.iter().zip(&resp.buckets) {
            rule_counts.push((ri, RuleCount::Allowed));
            if near_limit(cfg, r) {
                rule_counts.push((ri, RuleCount::NearLimit));
            }
        }
        return Verdict {
            action: Action::Allow(headers_for(cfg, &its, true)),
            decision: if fallback {
                Decision::FallbackAllowed
            } else {
                Decision::Allowed
            },
            denied_by: Box::default(),
            rule_counts,
            // The fallback's windows are this proxy's count, not the service's; a token bucket
            // has none (no allocation on the path most admissions take).
            windows: if fallback || resp.buckets.iter().all(|b| b.window == 0) {
                Box::default()
            } else {
                resp.buckets.iter().map(|b| b.window).collect()
            },
        };
    }
    let denied_by: Vec<usize> = resp
        .buckets
        .iter()
        .enumerate()
        .filter(|(_, b)| !b.allowed)
        .map(|(i, _)| i)
        .collect();
    let mut rule_counts = Vec::with_capacity(denied_by.len());
    let mut enforcing: Option<&Rule> = None;
    for &i in &denied_by {
        let (Some(&ri), Some((rule, _))) = (plan.rules.get(i), its.get(i)) else {
            continue;
        };
        if rule.shadow {
            rule_counts.push((ri, RuleCount::ShadowLimited));
        } else {
            rule_counts.push((ri, RuleCount::Limited));
            enforcing = enforcing.or(Some(*rule));
        }
    }
    let Some(denier) = enforcing else {
        // Only shadow rules denied: counted, logged, let through.
        return Verdict {
            action: Action::Allow(Vec::new()),
            decision: Decision::ShadowLimited,
            denied_by: denied_by.into(),
            rule_counts,
            windows: Box::default(),
        };
    };
    let wait = resp
        .buckets
        .iter()
        .filter(|b| !b.allowed)
        .map(|b| b.retry_after_ms)
        .max()
        .unwrap_or(0);
    // retry-after, up to five rate limit headers, content-type: one allocation for the list.
    let mut headers = Vec::with_capacity(7);
    headers.push(("retry-after".to_string(), retry_after(wait)));
    headers.extend(headers_for(cfg, &its, false));
    Verdict {
        action: Action::Deny(reply(denier, headers)),
        decision: if fallback {
            Decision::FallbackLimited
        } else {
            Decision::Limited
        },
        denied_by: denied_by.into(),
        rule_counts,
        windows: Box::default(),
    }
}

/// The verdict of the fallback shares on `plan` ([`crate::core::local::fallback::take_all_as`]'s answer `resp`): what
/// a request in recovery gets when its shares cannot pay for it (`fallback::attach_debts`).
pub fn from_shares(cfg: &Config, plan: &Plan, resp: &TakeResponse) -> Verdict {
    from_answer(cfg, plan, resp, true)
}

/// The denial of `rule` (its status, body and content type).
fn reply(rule: &Rule, mut headers: Vec<(String, String)>) -> LocalReply {
    headers.push((
        "content-type".to_string(),
        rule.response.content_type.clone(),
    ));
    LocalReply {
        status: rule.response.status,
        headers,
        body: rule.response.body.clone(),
    }
}

/// Turns an outcome into the verdict: the service's answer, or the failure mode. The only place
/// that applies `failure_mode` and shadow mode (per rule: a denial counts as one only if a rule
/// that is not in shadow mode denied; the first such rule's response is sent). Pure: for a failure
/// under `failure_mode: fallback`, `shares` is what the fallback shares answered (taken by the
/// flow's fallback stage, `fallback::on_failure`); without it the failure is denied, as under
/// `deny`.
pub fn resolve(
    cfg: &Config,
    plan: &Plan,
    outcome: &Outcome,
    shares: Option<&TakeResponse>,
) -> Verdict {
    match outcome {
        Outcome::Allowed(resp) | Outcome::Limited(resp) => from_answer(cfg, plan, resp, false),
        Outcome::Failed(_) => match (cfg.failure_mode, shares) {
            (FailureMode::Fallback, Some(resp)) => from_answer(cfg, plan, resp, true),
            (FailureMode::Allow, _) => Verdict {
                action: Action::Allow(Vec::new()),
                decision: Decision::FailureOpenAllowed,
                denied_by: Box::default(),
                rule_counts: plan
                    .rules
                    .iter()
                    .map(|&r| (r, RuleCount::Allowed))
                    .collect(),
                windows: Box::default(),
            },
            (FailureMode::Deny | FailureMode::Fallback, _) => {
                let rules: Vec<(usize, &Rule)> = plan
                    .rules
                    .iter()
                    .filter_map(|&r| cfg.rules.get(r).map(|rule| (r, rule)))
                    .collect();
                let rule_counts = rules
                    .iter()
                    .map(|(r, rule)| {
                        let c = if rule.shadow {
                            RuleCount::ShadowLimited
                        } else {
                            RuleCount::Limited
                        };
                        (*r, c)
                    })
                    .collect();
                let denied_by: Box<[usize]> = (0..plan.rules.len()).collect();
                match rules.iter().find(|(_, rule)| !rule.shadow) {
                    // No bucket state to report; ask the client to come back in a second.
                    Some((_, rule)) => Verdict {
                        action: Action::Deny(reply(
                            rule,
                            vec![("retry-after".to_string(), retry_after(1000))],
                        )),
                        decision: Decision::FailureClosedLimited,
                        denied_by,
                        rule_counts,
                        windows: Box::default(),
                    },
                    None => Verdict {
                        action: Action::Allow(Vec::new()),
                        decision: Decision::ShadowLimited,
                        denied_by,
                        rule_counts,
                        windows: Box::default(),
                    },
                }
            }
        },
    }
}

/// What a request whose acquire of concurrency slots got no answer does: `failure_mode` applied
/// to slots (shadow mode is the caller's, per rule, as for a denial the service gave).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotsVerdict {
    /// `allow`: admitted without a slot.
    Open,
    /// `deny`: refused by the concurrency rules listed (indices in `Config::rules`).
    Closed(Vec<usize>),
    /// `fallback`: admitted on these local slots (give them back with
    /// [`slots::release_local`] when the stream ends).
    Local(Vec<String>),
    /// `fallback`, and this rule's local slots are all taken: refused by it.
    LocalFull(usize),
}

/// Turns a failed acquire of `wants` into its [`SlotsVerdict`]; with [`resolve`], the only place
/// that applies `failure_mode`. `store` holds the local slots.
pub fn resolve_slots<S: CasStore + ?Sized>(
    cfg: &Config,
    wants: &[Want],
    store: &S,
) -> SlotsVerdict {
    match cfg.failure_mode {
        FailureMode::Allow => SlotsVerdict::Open,
        FailureMode::Deny => SlotsVerdict::Closed(wants.iter().map(|w| w.rule).collect()),
        FailureMode::Fallback => match slots::acquire_local(cfg, wants, store) {
            Ok(counters) => SlotsVerdict::Local(counters),
            Err(i) => wants.get(i).map_or(SlotsVerdict::Closed(Vec::new()), |w| {
                SlotsVerdict::LocalFull(w.rule)
            }),
        },
    }
}

#[cfg(test)]
mod tests;
