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
use crate::core::config::{Config, FailureMode, Limit, Rule, RuleKind, Transport};
use crate::core::local::breaker;
use crate::core::local::fallback;
use crate::core::local::slots::{self, Want};
use crate::core::rules::limits::limit_for;
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
        let (capacity, rate, period_ms) = match limit_for(rule, l, req, cfg.trusted_hops) {
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
            cost: Some(keys::cost(l, req)),
            algorithm: Some(l.algorithm),
            // Set by the lease pools when this request is the one that refills (core::lease).
            lease: None,
            max_delay_ms: 0,
        });
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
    Matched { step, slots }
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
    let mut styles = cfg.response.headers.clone();
    for (r, _) in its {
        for st in &r.response.headers {
            if !styles.contains(st) {
                styles.push(*st);
            }
        }
    }
    let mut out = Vec::new();
    for style in styles {
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
            denied_by: Vec::new(),
            rule_counts,
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
            denied_by,
            rule_counts,
        };
    };
    let wait = resp
        .buckets
        .iter()
        .filter(|b| !b.allowed)
        .map(|b| b.retry_after_ms)
        .max()
        .unwrap_or(0);
    let mut headers = vec![("retry-after".to_string(), retry_after(wait))];
    headers.extend(headers_for(cfg, &its, false));
    Verdict {
        action: Action::Deny(reply(denier, headers)),
        decision: if fallback {
            Decision::FallbackLimited
        } else {
            Decision::Limited
        },
        denied_by,
        rule_counts,
    }
}

/// The verdict of the fallback shares on `plan` ([`fallback::take_all_as`]'s answer `resp`): what
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
/// that is not in shadow mode denied; the first such rule's response is sent). `store` holds the
/// fallback buckets; `now_ms` is the host's clock (used by the fallback only).
pub fn resolve<S: CasStore + ?Sized>(
    cfg: &Config,
    plan: &Plan,
    outcome: &Outcome,
    store: &S,
    now_ms: u64,
) -> Verdict {
    match outcome {
        Outcome::Allowed(resp) | Outcome::Limited(resp) => from_answer(cfg, plan, resp, false),
        Outcome::Failed(cause) => match cfg.failure_mode {
            FailureMode::Fallback => {
                // A request the breaker refused puts its buckets in recovery for as long as the
                // other proxies' breakers may still be open (`fallback::attach_debts`).
                let how = if *cause == Cause::Breaker {
                    let entry = store.get(breaker::KEY);
                    let open = breaker::State::decode(entry.as_ref().map(|(v, _)| v.as_slice()));
                    fallback::Charge::outage(fallback::recovery_until(
                        cfg,
                        now_ms,
                        open.interval_ms,
                    ))
                } else {
                    fallback::Charge::OWE
                };
                let shares = fallback::Shares::of(cfg);
                let resp = fallback::take_all_as(store, &shares, &plan.request, now_ms, how);
                from_answer(cfg, plan, &resp, true)
            }
            FailureMode::Allow => Verdict {
                action: Action::Allow(Vec::new()),
                decision: Decision::FailureOpenAllowed,
                denied_by: Vec::new(),
                rule_counts: plan
                    .rules
                    .iter()
                    .map(|&r| (r, RuleCount::Allowed))
                    .collect(),
            },
            FailureMode::Deny => {
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
                let denied_by = (0..plan.rules.len()).collect();
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
                    },
                    None => Verdict {
                        action: Action::Allow(Vec::new()),
                        decision: Decision::ShadowLimited,
                        denied_by,
                        rule_counts,
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
mod tests {
    use super::*;
    use crate::core::base::store::fake::FakeStore;
    use crate::core::config::{Config, HeaderStyle};
    use crate::core::wire::decode_proto;

    fn cfg(extra: &str) -> Config {
        let json = format!(
            r#"{{"service":{{"cluster":"svc"}},
                 "rules":[{{"name":"per-ip","key":["client_ip"],"capacity":2,"period_ms":60000}},
                          {{"name":"login","match":{{"path_exact":"/login","methods":["POST"]}},
                            "key":["header:x-user"],"capacity":5,"rate":1,"period_ms":1000}}]
                 {extra}}}"#
        );
        Config::parse(json.as_bytes()).unwrap()
    }

    fn req(path: &str, method: &str, user: Option<&str>) -> Request {
        let mut headers = vec![
            (":path".to_string(), path.as_bytes().to_vec()),
            (":method".to_string(), method.as_bytes().to_vec()),
        ];
        if let Some(u) = user {
            headers.push(("x-user".to_string(), u.as_bytes().to_vec()));
        }
        Request {
            headers,
            peer: Some("10.0.0.7:5555".into()),
        }
    }

    fn plan_of(c: &Config, r: &Request) -> Plan {
        match decide(c, r).step {
            Step::Callout(p) => p,
            Step::Continue => panic!("expected a callout"),
        }
    }

    fn answer(allowed: &[bool]) -> Vec<u8> {
        let buckets: Vec<String> = allowed
            .iter()
            .map(|a| {
                format!(
                    r#"{{"allowed":{a},"limit":2,"remaining":{},"reset_ms":2500,"retry_after_ms":{}}}"#,
                    if *a { 1 } else { 0 },
                    if *a { 0 } else { 30_001 }
                )
            })
            .collect();
        format!(
            r#"{{"allowed":{},"buckets":[{}]}}"#,
            allowed.iter().all(|a| *a),
            buckets.join(",")
        )
        .into_bytes()
    }

    fn http(status: u32, body: &[u8]) -> CalloutResult {
        CalloutResult::Http {
            status: Some(status),
            body: body.to_vec(),
        }
    }

    #[test]
    fn no_matching_rule_means_no_callout() {
        let c = Config::parse(
            br#"{"service":{"cluster":"svc"},"rules":[{"name":"a","match":{"path_prefix":"/api/"},"capacity":1,"period_ms":1}]}"#,
        )
        .unwrap();
        assert_eq!(decide(&c, &req("/other", "GET", None)).step, Step::Continue);
        // A rule whose key part is missing is skipped (on_missing: skip).
        let c = cfg("");
        let mut r = req("/x", "GET", None);
        r.peer = None;
        assert_eq!(decide(&c, &r).step, Step::Continue);
    }

    #[test]
    fn all_matching_rules_go_into_one_callout() {
        let c = cfg("");
        let p = plan_of(&c, &req("/login?x=1", "POST", Some("alice")));
        assert_eq!(p.rules, vec![0, 1]);
        let keys: Vec<&str> = p.request.buckets.iter().map(|b| b.key.as_str()).collect();
        assert_eq!(keys, vec!["per-ip|10.0.0.7", "login|alice"]);
        assert_eq!(p.request.buckets[1].rate, Some(1));
        assert_eq!(p.request.buckets[1].cost, Some(1));
        let p = plan_of(&c, &req("/login", "GET", Some("alice")));
        assert_eq!(p.rules, vec![0]);
    }

    #[test]
    fn interpret_every_kind_of_result() {
        let c = cfg("");
        let p = plan_of(&c, &req("/login", "POST", Some("a")));
        let cases: Vec<(CalloutResult, &str)> = vec![
            (http(200, &answer(&[true, true])), "allowed"),
            (http(200, &answer(&[true, false])), "limited"),
            (http(200, &answer(&[true])), "decode"),
            (http(200, b"{\"allowed\":true,\"buckets\":[{\"allowed\":false},{\"allowed\":true}]}"), "decode"),
            (http(200, b"not json"), "decode"),
            (http(204, b""), "decode"),
            (http(500, b"oops"), "status"),
            (http(503, b"{\"error\":{\"code\":\"unavailable\"}}"), "status"),
            (http(400, b"{}"), "status"),
            (http(401, b"{}"), "status"),
            (http(503, b"upstream connect error or disconnect/reset before headers. reset reason: connection failure"), "connect"),
            (http(503, b"no healthy upstream"), "connect"),
            (http(504, b"upstream request timeout"), "timeout"),
            (CalloutResult::Http { status: None, body: vec![] }, "reset"),
            (CalloutResult::DispatchError, "dispatch"),
            (CalloutResult::Grpc { status: 14, message: Some("upstream request timeout".into()), body: vec![] }, "timeout"),
            (CalloutResult::Grpc { status: 4, message: None, body: vec![] }, "timeout"),
            (CalloutResult::Expired, "timeout"),
            (CalloutResult::Grpc { status: 14, message: Some("upstream connect error or disconnect/reset before headers. reset reason: connection failure".into()), body: vec![] }, "connect"),
            (CalloutResult::Grpc { status: 14, message: Some("store unavailable".into()), body: vec![] }, "grpc_status"),
            (CalloutResult::Grpc { status: 16, message: None, body: vec![] }, "grpc_status"),
            (CalloutResult::Grpc { status: 0, message: None, body: vec![0x08, 0x01, 0x12, 0x00, 0x12, 0x00] }, "decode"),
            (CalloutResult::Grpc { status: 0, message: None, body: vec![0x08, 0x01, 0x12, 0x02, 0x08, 0x01, 0x12, 0x02, 0x08, 0x01] }, "allowed"),
            (CalloutResult::Grpc { status: 0, message: None, body: vec![0x12, 0x02, 0x08, 0x01, 0x12, 0x00] }, "limited"),
            (CalloutResult::Grpc { status: 0, message: None, body: vec![0xff] }, "decode"),
            (CalloutResult::TooLarge { size: 1 << 20 }, "decode"),
            (CalloutResult::BatchMismatch, "decode"),
            (CalloutResult::Answers(Vec::new()), "decode"),
            (CalloutResult::Unsent, "queued"),
            (CalloutResult::Expired.shared(), "timeout"),
            (CalloutResult::DispatchError.shared().shared(), "dispatch"),
        ];
        for (i, (result, want)) in cases.into_iter().enumerate() {
            let got = match interpret(&p, result) {
                Outcome::Allowed(_) => "allowed",
                Outcome::Limited(_) => "limited",
                Outcome::Failed(c) => c.name(),
            };
            assert_eq!(got, want, "case {i}");
        }
        assert!(decode_proto(&[0x08, 0x01]).is_ok());
    }

    #[test]
    fn limited_answer_becomes_a_denial_with_headers() {
        let c = cfg(r#","response":{"headers":["draft","x-ratelimit"]}"#);
        let p = plan_of(&c, &req("/login", "POST", Some("a")));
        let o = interpret(&p, http(200, &answer(&[true, false])));
        let v = resolve(&c, &p, &o, &FakeStore::default(), 0);
        assert_eq!(v.decision, Decision::Limited);
        assert_eq!(v.denied_by, vec![1]);
        let Action::Deny(r) = v.action else {
            panic!("not denied")
        };
        assert_eq!(r.status, 429);
        assert_eq!(r.body, "rate limited\n");
        let h = |n: &str| {
            r.headers
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(h("retry-after").as_deref(), Some("31"));
        assert_eq!(h("content-type").as_deref(), Some("text/plain"));
        assert_eq!(
            h("ratelimit-policy").as_deref(),
            Some("\"per-ip\";q=2;w=60, \"login\";q=2;w=5")
        );
        assert_eq!(
            h("ratelimit").as_deref(),
            Some("\"per-ip\";r=1;t=3, \"login\";r=0;t=3")
        );
        assert_eq!(h("x-ratelimit-remaining").as_deref(), Some("0"));
    }

    #[test]
    fn allowed_answer_adds_headers_only_when_asked() {
        let c = cfg("");
        let p = plan_of(&c, &req("/x", "GET", None));
        let o = interpret(&p, http(200, &answer(&[true])));
        let v = resolve(&c, &p, &o, &FakeStore::default(), 0);
        assert_eq!(v.action, Action::Allow(vec![]));
        assert_eq!(v.decision, Decision::Allowed);
        let c = cfg(r#","response":{"on_allowed":true}"#);
        let v = resolve(&c, &p, &o, &FakeStore::default(), 0);
        let Action::Allow(h) = v.action else { panic!() };
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn failure_modes() {
        let p_for = |c: &Config| plan_of(c, &req("/x", "GET", None));
        let failed = Outcome::Failed(Cause::Timeout);

        let c = cfg(r#","failure_mode":"allow""#);
        let v = resolve(&c, &p_for(&c), &failed, &FakeStore::default(), 0);
        assert_eq!(
            (v.action, v.decision),
            (Action::Allow(vec![]), Decision::FailureOpenAllowed)
        );

        let c = cfg(r#","failure_mode":"deny""#);
        let v = resolve(&c, &p_for(&c), &failed, &FakeStore::default(), 0);
        assert_eq!(v.decision, Decision::FailureClosedLimited);
        let Action::Deny(r) = v.action else { panic!() };
        assert!(r
            .headers
            .contains(&("retry-after".to_string(), "1".to_string())));

        // Fallback: capacity 2 per key, shared through the store.
        let c = cfg(r#","failure_mode":"fallback""#);
        let store = FakeStore::default();
        crate::core::local::fallback::prepare(&store, c.fallback.max_keys);
        let p = p_for(&c);
        let ds: Vec<Decision> = (0..3)
            .map(|_| resolve(&c, &p, &failed, &store, 0).decision)
            .collect();
        assert_eq!(
            ds,
            vec![
                Decision::FallbackAllowed,
                Decision::FallbackAllowed,
                Decision::FallbackLimited
            ]
        );
        let v = resolve(&c, &p, &failed, &store, 0);
        let Action::Deny(r) = v.action else { panic!() };
        assert!(
            r.headers
                .contains(&("retry-after".to_string(), "30".to_string())),
            "{:?}",
            r.headers
        );
        // Breaker refusals take the same path.
        let v = resolve(&c, &p, &Outcome::Failed(Cause::Breaker), &store, 30_000);
        assert_eq!(v.decision, Decision::FallbackAllowed);

        // instances divides the local capacity: 2 / 2 = 1.
        let c = cfg(r#","fallback":{"instances":2}"#);
        let store = FakeStore::default();
        crate::core::local::fallback::prepare(&store, c.fallback.max_keys);
        let p = p_for(&c);
        let ds: Vec<Decision> = (0..2)
            .map(|_| resolve(&c, &p, &failed, &store, 0).decision)
            .collect();
        assert_eq!(
            ds,
            vec![Decision::FallbackAllowed, Decision::FallbackLimited]
        );
    }

    #[test]
    fn shadow_never_denies() {
        let c = cfg(r#","shadow":true,"failure_mode":"deny""#);
        let p = plan_of(&c, &req("/x", "GET", None));
        for o in [
            interpret(&p, http(200, &answer(&[false]))),
            Outcome::Failed(Cause::Reset),
        ] {
            let v = resolve(&c, &p, &o, &FakeStore::default(), 0);
            assert_eq!(v.action, Action::Allow(vec![]));
            assert_eq!(v.decision, Decision::ShadowLimited);
        }
        let v = resolve(
            &c,
            &p,
            &interpret(&p, http(200, &answer(&[true]))),
            &FakeStore::default(),
            0,
        );
        assert_eq!(v.decision, Decision::Allowed);
    }

    #[test]
    fn shadow_status_body_and_headers_per_rule() {
        // Rule `per-ip` enforces with its own status and body; `login` is in shadow mode and asks
        // for x-ratelimit headers only; the global response is the default for the rest.
        let json = r#"{"service":{"cluster":"svc"},
             "response":{"status":429,"body":"global","headers":["draft"]},
             "rules":[{"name":"per-ip","key":["client_ip"],"capacity":2,"period_ms":60000,
                       "response":{"status":403,"body":"no more"}},
                      {"name":"login","match":{"path_exact":"/login","methods":["POST"]},
                       "key":["header:x-user"],"capacity":5,"rate":1,"period_ms":1000,
                       "shadow":true,"response":{"headers":["x-ratelimit"],"on_allowed":true}}]}"#;
        let c = Config::parse(json.as_bytes()).unwrap();
        assert_eq!(
            c.rules[0].response.headers,
            vec![HeaderStyle::Draft],
            "inherited"
        );
        assert_eq!(c.rules[1].response.body, "global", "inherited");
        let p = plan_of(&c, &req("/login", "POST", Some("u")));
        let resolve_with = |a: &[bool]| {
            resolve(
                &c,
                &p,
                &interpret(&p, http(200, &answer(a))),
                &FakeStore::default(),
                0,
            )
        };
        // Only the shadow rule denies: let through, counted per rule.
        let v = resolve_with(&[true, false]);
        assert_eq!(v.action, Action::Allow(vec![]));
        assert_eq!(v.decision, Decision::ShadowLimited);
        assert_eq!(v.rule_counts, vec![(1, RuleCount::ShadowLimited)]);
        // The enforcing rule denies: its status and body, both rules' headers in their styles.
        let v = resolve_with(&[false, false]);
        assert_eq!(v.decision, Decision::Limited);
        let Action::Deny(r) = v.action else { panic!() };
        assert_eq!((r.status, r.body.as_str()), (403, "no more"));
        let names: Vec<&str> = r.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert!(names.contains(&"ratelimit-policy") && names.contains(&"x-ratelimit-limit"));
        let policy = &r
            .headers
            .iter()
            .find(|(n, _)| n == "ratelimit-policy")
            .unwrap()
            .1;
        assert!(
            policy.contains("per-ip") && !policy.contains("login"),
            "{policy}"
        );
        assert_eq!(
            v.rule_counts,
            vec![(0, RuleCount::Limited), (1, RuleCount::ShadowLimited)]
        );
        // Allowed: headers only for the rule with on_allowed; near_limit at 1 of 2 left (50% ≤ 20%? no).
        let v = resolve_with(&[true, true]);
        let Action::Allow(h) = v.action else { panic!() };
        assert!(h.iter().all(|(n, _)| n.starts_with("x-ratelimit")), "{h:?}");
        assert_eq!(
            v.rule_counts,
            vec![(0, RuleCount::Allowed), (1, RuleCount::Allowed)]
        );
    }

    #[test]
    fn near_limit_is_counted_at_the_configured_share() {
        let c = cfg(r#","near_limit":0.5"#);
        let p = plan_of(&c, &req("/x", "GET", None));
        // 1 of 2 left: half used, at the 0.5 mark.
        let v = resolve(
            &c,
            &p,
            &interpret(&p, http(200, &answer(&[true]))),
            &FakeStore::default(),
            0,
        );
        assert_eq!(
            v.rule_counts,
            vec![(0, RuleCount::Allowed), (0, RuleCount::NearLimit)]
        );
        let c = cfg(r#","near_limit":0.9"#);
        let v = resolve(
            &c,
            &p,
            &interpret(&p, http(200, &answer(&[true]))),
            &FakeStore::default(),
            0,
        );
        assert_eq!(v.rule_counts, vec![(0, RuleCount::Allowed)]);
        for bad in [r#","near_limit":1.5"#, r#","near_limit":"x""#] {
            let json = format!(
                r#"{{"service":{{"cluster":"svc"}},"rules":[{{"name":"a","capacity":1,"period_ms":1}}]{bad}}}"#
            );
            assert_eq!(
                Config::parse(json.as_bytes()).unwrap_err().field,
                "near_limit"
            );
        }
        let json = r#"{"service":{"cluster":"svc"},"rules":[{"name":"a","capacity":1,"period_ms":1,"response":{"status":200}}]}"#;
        assert_eq!(
            Config::parse(json.as_bytes()).unwrap_err().field,
            "rules[0].response.status"
        );
    }

    #[test]
    fn metric_names_are_the_agreed_ones() {
        let names: Vec<&str> = Decision::ALL.iter().map(|d| d.metric()).collect();
        assert_eq!(
            names,
            vec![
                "tollgate.allowed",
                "tollgate.limited",
                "tollgate.shadow_limited",
                "tollgate.fallback.allowed",
                "tollgate.fallback.limited",
                "tollgate.failure_open.allowed",
                "tollgate.failure_closed.limited"
            ]
        );
        let causes: Vec<&str> = Cause::CALLOUT.iter().map(|c| c.name()).collect();
        assert_eq!(
            causes,
            vec![
                "dispatch",
                "timeout",
                "reset",
                "connect",
                "status",
                "grpc_status",
                "decode"
            ]
        );
    }

    /// One pass gives the rate rules' buckets and the concurrency rules' slots, each naming its
    /// rule by its index in `Config::rules`, whatever the kinds' order.
    #[test]
    fn one_pass_gives_buckets_and_slots_by_rule_index() {
        let c = Config::parse(
            br#"{"service":{"cluster":"svc"},"rules":[
                {"name":"cc","kind":"concurrency","key":["literal:k"],"max_in_flight":4},
                {"name":"r","capacity":5,"period_ms":1000},
                {"name":"off","kind":"concurrency","match":{"path_exact":"/never"},"max_in_flight":1},
                {"name":"dd","kind":"concurrency","max_in_flight":2}]}"#,
        )
        .unwrap();
        let m = decide(&c, &req("/api", "GET", None));
        let Step::Callout(plan) = m.step else {
            panic!("expected a callout")
        };
        assert_eq!(plan.rules, vec![1]);
        assert_eq!(plan.request.buckets[0].key, "r");
        assert_eq!(
            m.slots,
            vec![
                Want {
                    rule: 0,
                    key: "cc|k".into()
                },
                Want {
                    rule: 3,
                    key: "dd".into()
                }
            ]
        );
    }

    #[test]
    fn a_failed_acquire_follows_the_failure_mode() {
        let slots_cfg = |mode: &str| {
            let json = format!(
                r#"{{"service":{{"cluster":"svc"}},"failure_mode":"{mode}","fallback":{{"max_keys":8,"instances":2}},
                    "rules":[{{"name":"cc","kind":"concurrency","key":["literal:k"],"max_in_flight":4,"deadline_ms":5000}}]}}"#
            );
            Config::parse(json.as_bytes()).unwrap()
        };
        let wants = [Want {
            rule: 0,
            key: "cc|k".into(),
        }];
        let store = FakeStore::default();
        assert_eq!(
            resolve_slots(&slots_cfg("allow"), &wants, &store),
            SlotsVerdict::Open
        );
        assert_eq!(
            resolve_slots(&slots_cfg("deny"), &wants, &store),
            SlotsVerdict::Closed(vec![0])
        );
        // fallback: this proxy's share, 4 / 2 instances = 2 local slots, then full.
        let c = slots_cfg("fallback");
        fallback::prepare_table(&store, crate::core::local::table::SLOTS_TABLE, 8, &[0; 8]);
        let first = resolve_slots(&c, &wants, &store);
        assert!(
            matches!(first, SlotsVerdict::Local(ref held) if held.len() == 1),
            "{first:?}"
        );
        assert!(matches!(
            resolve_slots(&c, &wants, &store),
            SlotsVerdict::Local(_)
        ));
        assert_eq!(
            resolve_slots(&c, &wants, &store),
            SlotsVerdict::LocalFull(0)
        );
        if let SlotsVerdict::Local(held) = first {
            slots::release_local(&store, &held);
        }
        assert!(
            matches!(resolve_slots(&c, &wants, &store), SlotsVerdict::Local(_)),
            "one given back"
        );
    }
}
