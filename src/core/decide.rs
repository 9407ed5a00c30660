//! The per-request decision, as pure functions the adapter drives:
//!
//! 1. [`decide`]: which buckets a request takes from. No matching rule → [`Step::Continue`], no
//!    callout at all; otherwise one [`Plan`] with every matching rule's bucket (one callout, all or
//!    nothing, in rule order).
//! 2. [`interpret`]: what a callout's result means. Every way a callout can fail (dispatch error,
//!    timeout, reset, connect failure, non-2xx, gRPC status ≠ 0, undecodable or mismatched body)
//!    becomes one value, [`Outcome::Failed`] with its [`Cause`].
//! 3. [`resolve`]: the single place that turns an outcome into a [`Verdict`]: the service's answer
//!    as is, or the failure mode (`fallback` / `allow` / `deny`) for a failure (the breaker's
//!    refusal included), then shadow mode on top.

use crate::core::config::{Config, FailureMode, Limit, Rule};
use crate::core::fallback;
use crate::core::headers::{rate_limit_headers, retry_after};
use crate::core::rules::limits::limit_for;
use crate::core::rules::{keys, matches, Request};
use crate::core::store::CasStore;
use crate::core::wire::{self, Bucket, BucketResult, TakeRequest, TakeResponse};
use std::borrow::Cow;

/// The buckets one request takes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The callout body, before encoding.
    pub request: TakeRequest,
    /// For bucket `i`, the index of its rule in `Config::rules`.
    pub rules: Vec<usize>,
    /// For bucket `i`, the tokens it owes from the fallback and carries in its `lease` on top of
    /// what it asks for itself (empty: none; see [`crate::core::fallback`]).
    pub debt: Vec<u64>,
}

impl Plan {
    /// The debt bucket `i` carries.
    pub fn debt(&self, i: usize) -> u64 {
        self.debt.get(i).copied().unwrap_or(0)
    }

    /// The `lease` bucket `i` asks for itself (its `lease` less the debt it carries; `None` when
    /// it asks for its cost only).
    pub fn own_lease(&self, i: usize) -> Option<u64> {
        let b = self.request.buckets.get(i)?;
        let cost = b.cost.unwrap_or(1);
        b.lease
            .map(|l| l.saturating_sub(self.debt(i)))
            .filter(|&l| l > cost)
    }

    /// Of `granted` tokens charged to bucket `i` of an admitted request, those that repaid its debt:
    /// what was charged beyond its cost, up to the debt (a request is admitted only when the grant
    /// covers its cost and its whole debt, `fallback::settle_debts`; a lease is filled after that).
    pub fn repaid(&self, i: usize, granted: u64) -> u64 {
        let cost = self
            .request
            .buckets
            .get(i)
            .and_then(|b| b.cost)
            .unwrap_or(1);
        self.debt(i).min(granted.saturating_sub(cost))
    }
}

/// What to do with a request's headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// No rule applies: let it through, no callout.
    Continue,
    /// Ask the service (or, if it cannot be asked, the failure mode).
    Callout(Plan),
}

/// Plans the callout for `req`.
pub fn decide(cfg: &Config, req: &Request) -> Step {
    let mut plan = Plan {
        request: TakeRequest::default(),
        rules: Vec::new(),
        debt: Vec::new(),
    };
    for (i, rule) in cfg.rules.iter().enumerate() {
        if !matches(&rule.matcher, req, cfg.trusted_hops) {
            continue;
        }
        let Some(key) = keys::build_key(rule, req, cfg.trusted_hops) else {
            continue;
        };
        let (capacity, rate, period_ms) = match limit_for(rule, req, cfg.trusted_hops) {
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
            cost: Some(keys::cost(rule, req)),
            algorithm: Some(rule.algorithm),
            // Set by the lease pools when this request is the one that refills (core::lease).
            lease: None,
        });
        plan.rules.push(i);
    }
    if plan.rules.is_empty() {
        Step::Continue
    } else {
        Step::Callout(plan)
    }
}

/// What came back from a callout (as the adapter saw it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CalloutResult {
    /// The dispatch itself failed synchronously (e.g. unknown cluster).
    DispatchError,
    /// HTTP transport. `status` is `None` when the response had no headers at all: that is how
    /// Envoy reports a reset.
    Http {
        /// `:status`, if any.
        status: Option<u32>,
        /// The body.
        body: Vec<u8>,
    },
    /// gRPC transport.
    Grpc {
        /// gRPC status code.
        status: u32,
        /// gRPC status message, if any.
        message: Option<String>,
        /// The response message (status 0 only).
        body: Vec<u8>,
    },
}

/// Why a callout failed, or why none was made. Names are the metric suffixes
/// (`tollgate.callout_failure.<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// Synchronous dispatch error.
    Dispatch,
    /// The callout timed out.
    Timeout,
    /// The callout was reset.
    Reset,
    /// Envoy could not connect to the service.
    Connect,
    /// The service answered a non-2xx status.
    Status,
    /// The service answered a gRPC status other than OK.
    GrpcStatus,
    /// The body was not a valid answer.
    Decode,
    /// No callout: the breaker is open.
    Breaker,
}

impl Cause {
    /// Every cause a callout can fail with (the breaker is not a callout failure).
    pub const CALLOUT: [Cause; 7] = [
        Cause::Dispatch,
        Cause::Timeout,
        Cause::Reset,
        Cause::Connect,
        Cause::Status,
        Cause::GrpcStatus,
        Cause::Decode,
    ];

    /// The metric / log name.
    pub fn name(self) -> &'static str {
        match self {
            Cause::Dispatch => "dispatch",
            Cause::Timeout => "timeout",
            Cause::Reset => "reset",
            Cause::Connect => "connect",
            Cause::Status => "status",
            Cause::GrpcStatus => "grpc_status",
            Cause::Decode => "decode",
            Cause::Breaker => "breaker",
        }
    }
}

/// What a callout's result means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The service charged every bucket.
    Allowed(TakeResponse),
    /// The service denied (and charged nothing).
    Limited(TakeResponse),
    /// The service could not decide.
    Failed(Cause),
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
        } => wire::decode_proto(&body),
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

/// The decision, in metric terms (`tollgate.<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The service allowed.
    Allowed,
    /// The service denied.
    Limited,
    /// A denial that shadow mode let through.
    ShadowLimited,
    /// The fallback bucket allowed.
    FallbackAllowed,
    /// The fallback bucket denied.
    FallbackLimited,
    /// Failure mode `allow`.
    FailureOpenAllowed,
    /// Failure mode `deny`.
    FailureClosedLimited,
}

impl Decision {
    /// Every decision, for defining the metrics.
    pub const ALL: [Decision; 7] = [
        Decision::Allowed,
        Decision::Limited,
        Decision::ShadowLimited,
        Decision::FallbackAllowed,
        Decision::FallbackLimited,
        Decision::FailureOpenAllowed,
        Decision::FailureClosedLimited,
    ];

    /// The metric name.
    pub fn metric(self) -> &'static str {
        match self {
            Decision::Allowed => "tollgate.allowed",
            Decision::Limited => "tollgate.limited",
            Decision::ShadowLimited => "tollgate.shadow_limited",
            Decision::FallbackAllowed => "tollgate.fallback.allowed",
            Decision::FallbackLimited => "tollgate.fallback.limited",
            Decision::FailureOpenAllowed => "tollgate.failure_open.allowed",
            Decision::FailureClosedLimited => "tollgate.failure_closed.limited",
        }
    }
}

/// A local response that ends the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    /// Status code.
    pub status: u32,
    /// Headers (lower-case names).
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: String,
}

/// What the adapter does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Let the request through; add these headers to the upstream's response.
    Allow(Vec<(String, String)>),
    /// Answer locally; the request never reaches the upstream.
    Deny(LocalReply),
}

/// The final word on a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// What to do.
    pub action: Action,
    /// What to count.
    pub decision: Decision,
    /// Indices (into the plan's buckets) of the buckets that denied, for the debug log.
    pub denied_by: Vec<usize>,
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
            let rate = b.rate.unwrap_or(b.capacity);
            if (b.capacity, rate, b.period_ms) == (rule.capacity, rule.rate, rule.period_ms) {
                return Some(Cow::Borrowed(rule));
            }
            let mut r = rule.clone();
            (r.capacity, r.rate, r.period_ms) = (b.capacity, rate, b.period_ms);
            Some(Cow::Owned(r))
        })
        .collect()
}

fn from_answer(cfg: &Config, plan: &Plan, resp: &TakeResponse, fallback: bool) -> Verdict {
    let rules = effective(cfg, plan);
    let its: Vec<(&Rule, &BucketResult)> =
        rules.iter().map(AsRef::as_ref).zip(&resp.buckets).collect();
    if resp.allowed {
        let headers = if cfg.response.on_allowed {
            rate_limit_headers(&cfg.response.headers, &its)
        } else {
            Vec::new()
        };
        return Verdict {
            action: Action::Allow(headers),
            decision: if fallback {
                Decision::FallbackAllowed
            } else {
                Decision::Allowed
            },
            denied_by: Vec::new(),
        };
    }
    let denied_by: Vec<usize> = resp
        .buckets
        .iter()
        .enumerate()
        .filter(|(_, b)| !b.allowed)
        .map(|(i, _)| i)
        .collect();
    let wait = resp
        .buckets
        .iter()
        .filter(|b| !b.allowed)
        .map(|b| b.retry_after_ms)
        .max()
        .unwrap_or(0);
    let mut headers = vec![("retry-after".to_string(), retry_after(wait))];
    headers.extend(rate_limit_headers(&cfg.response.headers, &its));
    Verdict {
        action: Action::Deny(reply(cfg, headers)),
        decision: if fallback {
            Decision::FallbackLimited
        } else {
            Decision::Limited
        },
        denied_by,
    }
}

fn reply(cfg: &Config, mut headers: Vec<(String, String)>) -> LocalReply {
    headers.push((
        "content-type".to_string(),
        cfg.response.content_type.clone(),
    ));
    LocalReply {
        status: cfg.response.status,
        headers,
        body: cfg.response.body.clone(),
    }
}

/// Turns an outcome into the verdict: the service's answer, or the failure mode. The only place
/// that applies `failure_mode` and `shadow`. `store` holds the fallback buckets; `now_ms` is the
/// host's clock (used by the fallback only).
pub fn resolve<S: CasStore + ?Sized>(
    cfg: &Config,
    plan: &Plan,
    outcome: &Outcome,
    store: &S,
    now_ms: u64,
) -> Verdict {
    let verdict = match outcome {
        Outcome::Allowed(resp) | Outcome::Limited(resp) => from_answer(cfg, plan, resp, false),
        Outcome::Failed(_) => match cfg.failure_mode {
            FailureMode::Fallback => {
                let resp =
                    fallback::take_all(store, &fallback::Shares::of(cfg), &plan.request, now_ms);
                from_answer(cfg, plan, &resp, true)
            }
            FailureMode::Allow => Verdict {
                action: Action::Allow(Vec::new()),
                decision: Decision::FailureOpenAllowed,
                denied_by: Vec::new(),
            },
            FailureMode::Deny => Verdict {
                // No bucket state to report; ask the client to come back in a second.
                action: Action::Deny(reply(
                    cfg,
                    vec![("retry-after".to_string(), retry_after(1000))],
                )),
                decision: Decision::FailureClosedLimited,
                denied_by: (0..plan.rules.len()).collect(),
            },
        },
    };
    if cfg.shadow {
        if let Action::Deny(_) = verdict.action {
            return Verdict {
                action: Action::Allow(Vec::new()),
                decision: Decision::ShadowLimited,
                denied_by: verdict.denied_by,
            };
        }
    }
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::config::Config;
    use crate::core::store::fake::FakeStore;
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
        match decide(c, r) {
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
        assert_eq!(decide(&c, &req("/other", "GET", None)), Step::Continue);
        // A rule whose key part is missing is skipped (on_missing: skip).
        let c = cfg("");
        let mut r = req("/x", "GET", None);
        r.peer = None;
        assert_eq!(decide(&c, &r), Step::Continue);
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
            (CalloutResult::Grpc { status: 14, message: Some("upstream connect error or disconnect/reset before headers. reset reason: connection failure".into()), body: vec![] }, "connect"),
            (CalloutResult::Grpc { status: 14, message: Some("store unavailable".into()), body: vec![] }, "grpc_status"),
            (CalloutResult::Grpc { status: 16, message: None, body: vec![] }, "grpc_status"),
            (CalloutResult::Grpc { status: 0, message: None, body: vec![0x08, 0x01, 0x12, 0x00, 0x12, 0x00] }, "decode"),
            (CalloutResult::Grpc { status: 0, message: None, body: vec![0x08, 0x01, 0x12, 0x02, 0x08, 0x01, 0x12, 0x02, 0x08, 0x01] }, "allowed"),
            (CalloutResult::Grpc { status: 0, message: None, body: vec![0x12, 0x02, 0x08, 0x01, 0x12, 0x00] }, "limited"),
            (CalloutResult::Grpc { status: 0, message: None, body: vec![0xff] }, "decode"),
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
        crate::core::fallback::prepare(&store, c.fallback.max_keys);
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
        crate::core::fallback::prepare(&store, c.fallback.max_keys);
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
}
