//! The plain data of one request's decision, below everything that decides: what a request takes
//! ([`Plan`]), what came back from a callout ([`CalloutResult`]), what it means ([`Outcome`],
//! [`Cause`]), and the verdict ([`Verdict`]: [`Action`], [`Decision`], [`RuleCount`]). The decision
//! itself ([`crate::core::decide`]), the lease pools, the fallback and the flow all build on these
//! and on nothing of each other's to name them.

use crate::core::wire::{self, TakeRequest, TakeResponse};

/// The buckets one request takes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The callout body, before encoding.
    pub request: TakeRequest,
    /// For bucket `i`, the index of its rule in `Config::rules`.
    pub rules: Vec<usize>,
    /// For bucket `i`, the tokens it owes from the fallback and carries in its `lease` on top of
    /// what it asks for itself (empty: none; see [`crate::core::local::fallback`]).
    pub debt: Vec<u64>,
    /// Transport `rls`: the domain and, for bucket `i`, its descriptor's entries.
    pub rls: Option<wire::RlsRequest>,
    /// The number of proxies the admission read from the admission record (0: none read or none
    /// learned yet): an answer reporting this number has nothing to store
    /// ([`crate::core::local::fallback::learn`]).
    pub instances: u64,
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
        let cost = b.cost();
        b.lease
            .map(|l| l.saturating_sub(self.debt(i)))
            .filter(|&l| l > cost)
    }

    /// Of `granted` tokens charged to bucket `i` of an admitted request, those that repaid its debt:
    /// what was charged beyond its cost, up to the debt (a request is admitted only when the grant
    /// covers its cost and its whole debt, `fallback::repay_debts`; a lease is filled after that).
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
    /// This request's answer, already decoded from a batch answer (group commit).
    Answer(TakeResponse),
    /// A batch's answers, already decoded (a message's on the stream, which carries its id):
    /// one per take, split onto them by [`crate::core::wire::batch::split`].
    Answers(Vec<TakeResponse>),
    /// gRPC transport.
    Grpc {
        /// gRPC status code.
        status: u32,
        /// gRPC status message, if any.
        message: Option<String>,
        /// The response message (status 0 only).
        body: Vec<u8>,
    },
    /// An answer larger than any valid one (`size` bytes): not read.
    TooLarge {
        /// Its size.
        size: usize,
    },
    /// A batch answer whose takes do not match the batch's (count, or an undecodable body).
    BatchMismatch,
    /// No answer within `service.timeout_ms` of the request's take: its message on the stream
    /// passed its deadline.
    Expired,
    /// Never sent: the take waited `service.timeout_ms` in the batch queue (the callouts ahead
    /// of it held it back). No callout failed.
    Unsent,
    /// A take's share of its batch's failure (or of the failure of messages that failed
    /// together), which another take already fed the breaker with: a failed batch is one failed
    /// callout. Its failure path is the inner result's, without counting it again.
    Shared(Box<CalloutResult>),
}

impl CalloutResult {
    /// This result as a share of the same failure for another take ([`CalloutResult::Shared`]);
    /// an answer is its own.
    pub fn shared(self) -> CalloutResult {
        match self {
            CalloutResult::Answer(_) | CalloutResult::Answers(_) | CalloutResult::Shared(_) => self,
            other => CalloutResult::Shared(Box::new(other)),
        }
    }
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
    /// No callout: the take waited its whole timeout in the batch queue.
    Queued,
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

    /// Every cause, for defining the metrics of what the failure mode decided.
    pub const ALL: [Cause; 9] = [
        Cause::Dispatch,
        Cause::Timeout,
        Cause::Reset,
        Cause::Connect,
        Cause::Status,
        Cause::GrpcStatus,
        Cause::Decode,
        Cause::Breaker,
        Cause::Queued,
    ];

    /// Whether a callout failed (what `tollgate.callout_failure.*` and the breaker count), rather
    /// than none being made.
    pub fn is_callout(self) -> bool {
        !matches!(self, Cause::Breaker | Cause::Queued)
    }

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
            Cause::Queued => "queued",
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
    pub denied_by: Box<[usize]>,
    /// What to count per rule: (index in `Config::rules`, counter).
    pub rule_counts: Vec<(usize, RuleCount)>,
    /// Per bucket of the plan, the window the service charged it in (its answer's `window`; 0:
    /// none), which a settle names; empty unless the service admitted the request (a boxed
    /// slice: the verdict is returned by value through every stage).
    pub windows: Box<[u64]>,
}

/// Per-rule counters (`tollgate.rule.<name>.<metric>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleCount {
    /// The request was admitted and took from this rule's bucket.
    Allowed,
    /// This rule's bucket denied the request.
    Limited,
    /// This rule's bucket would have denied, but the rule is in shadow mode.
    ShadowLimited,
    /// An admitted take left the bucket at or under the `near_limit` share.
    NearLimit,
    /// This rule's bucket denied the request from a remembered denial, without a callout (also
    /// counted as `limited`).
    LimitedLocally,
    /// A number `from_request` read was outside its `min..=max` and was clamped to them.
    LimitClamped,
    /// A number `from_request` reads was absent or not a number: the rule's own was used.
    LimitDefaulted,
}

impl RuleCount {
    /// Every counter, for defining the metrics.
    pub const ALL: [RuleCount; 7] = [
        RuleCount::Allowed,
        RuleCount::Limited,
        RuleCount::ShadowLimited,
        RuleCount::NearLimit,
        RuleCount::LimitedLocally,
        RuleCount::LimitClamped,
        RuleCount::LimitDefaulted,
    ];

    /// The metric name's last part.
    pub fn name(self) -> &'static str {
        match self {
            RuleCount::Allowed => "allowed",
            RuleCount::Limited => "limited",
            RuleCount::ShadowLimited => "shadow_limited",
            RuleCount::NearLimit => "near_limit",
            RuleCount::LimitedLocally => "limited_locally",
            RuleCount::LimitClamped => "limit_clamped",
            RuleCount::LimitDefaulted => "limit_defaulted",
        }
    }

    /// The metric name of rule `rule`'s counter.
    pub fn metric(self, rule: &str) -> String {
        format!("tollgate.rule.{rule}.{}", self.name())
    }
}
