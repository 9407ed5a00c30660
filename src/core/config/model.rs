//! The validated configuration: what a configuration says once it is read, every default
//! resolved, and the bounds it is held to.

use contract::calendar::Calendar;
use std::fmt;

/// Largest capacity, rate and cost (the contract's); longest period (one year, in ms); at most
/// this many rules, one bucket each per request.
pub use contract::bounds::{MAX_AMOUNT, MAX_BUCKETS, MAX_DELAY_MS, MAX_PERIOD_MS};
/// Key parts per rule; with [`MAX_PART_BYTES`] this bounds a key well below the contract's 4096
/// bytes.
pub const MAX_KEY_PARTS: usize = 8;
/// Longest key part kept verbatim (escaped); a longer one is hashed (`crate::core::rules::keys`),
/// and a literal part may not be longer.
pub const MAX_PART_BYTES: usize = 256;
/// Most takes in one batch callout (`service.batch`).
pub use contract::bounds::MAX_BATCH_TAKES;
/// Longest rule name (it appears in keys, logs and the `RateLimit-Policy` header, and is sent as
/// a bucket's `rule`).
pub use contract::bounds::MAX_RULE_BYTES;

/// A configuration error: the field path and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Path of the offending field, e.g. `rules[1].capacity`.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// How the filter talks to the decision service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// JSON over HTTP: `POST <path>`.
    Http,
    /// Protobuf over gRPC: `tollgate.v1.RateLimiter/Take`.
    Grpc,
    /// Envoy's rate limit protocol (RLS v3) over gRPC:
    /// `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, to any RLS server.
    Rls,
}

/// What decides when the service cannot (see [`crate::core::decide`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailureMode {
    /// A local bucket per key, shared by the worker threads, at capacity/instances.
    #[default]
    Fallback,
    /// Let the request through.
    Allow,
    /// Deny the request.
    Deny,
}

/// What to do with a rule when a key part is absent (e.g. the header is missing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnMissing {
    /// The rule does not apply to this request.
    #[default]
    Skip,
    /// All requests missing that part share one bucket.
    Shared,
}

/// The bucket algorithm: the contract's.
pub use contract::Algorithm;

/// Which rate limit headers the filter writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderStyle {
    /// IETF draft `RateLimit-Policy` and `RateLimit` (structured fields).
    Draft,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    XRateLimit,
}

/// The validated configuration. Immutable once built.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The decision service.
    pub service: Service,
    /// How many x-forwarded-for entries (from the right) were written by trusted proxies.
    pub trusted_hops: u32,
    /// Rules of every kind, in configuration order: a rule's index here is how the flow, the
    /// metrics and the slots name it (rate rules' buckets go in a callout in this order).
    pub rules: Vec<Rule>,
    /// What decides when the service cannot.
    pub failure_mode: FailureMode,
    /// Local fallback buckets.
    pub fallback: Fallback,
    /// Circuit breaker.
    pub breaker: Breaker,
    /// Evaluate and count, never deny.
    pub shadow: bool,
    /// The denial response and rate limit headers.
    pub response: Response,
    /// Whether some rule uses `client_ip` with `trusted_hops == 0` (then the adapter reads the
    /// peer address property, otherwise it does not pay for that host call).
    pub needs_peer_address: bool,
    /// A bucket is near its limit when an allowed take leaves at most this share of it, in
    /// thousandths (`tollgate.rule.<name>.near_limit`; from `near_limit`, the used fraction).
    pub near_limit_left_permille: u64,
    /// Where a request's model is read (`model`), when some rule keys or prices by it.
    pub model: Option<ModelSource>,
}

/// Where the model a request asks for is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A request header a gateway in front set (lower case).
    Header(String),
    /// Dynamic metadata a filter in front wrote (Envoy's `json_to_metadata` reading the body,
    /// an AI gateway's filter): the host property path, read at the request's headers.
    Metadata(Vec<String>),
    /// The JSON body's top-level `model`, read as the body arrives, at most this many bytes of it:
    /// the request waits for it before it is decided.
    Body(usize),
}

/// Default and largest `model.max_body_bytes`.
pub const DEFAULT_MODEL_BODY_BYTES: u64 = 65_536;
/// The most of a request body read for its model (1 MiB): Envoy holds the body meanwhile.
pub const MAX_MODEL_BODY_BYTES: u64 = 1_048_576;
/// Most models `usage.prices` names.
pub const MAX_PRICES: usize = 64;

/// The decision service. Its `Debug` output never shows the bearer token.
#[derive(Clone, PartialEq, Eq)]
pub struct Service {
    /// Envoy cluster name.
    pub cluster: String,
    /// `:authority` of the callout.
    pub authority: String,
    /// HTTP+JSON or gRPC.
    pub transport: Transport,
    /// Callout timeout.
    pub timeout_ms: u64,
    /// Request path (HTTP transport).
    pub path: String,
    /// Bearer token, if the service requires one.
    pub token: Option<String>,
    /// The RLS domain (transport `rls`).
    pub domain: String,
    /// Group commit: while a callout is in flight, at most this many requests of a worker wait
    /// to go together in the next callout (0: every request calls on its own).
    pub batch: usize,
    /// Transport `grpc`: each worker keeps one `TakeStream` open and sends every take (or batch
    /// of takes) as a message on it instead of a call of its own ([`crate::core::wire::stream`]).
    pub stream: bool,
    /// How long a denial from the service is remembered by every worker of this Envoy, at most:
    /// until its `retry_after_ms` or this long, whichever is sooner (0: not remembered; see
    /// [`crate::core::local::denials`]).
    pub remember_denials_ms: u64,
    /// Forward a sampled request's W3C `traceparent` on its callout (which then goes alone, not
    /// in a batch), so the service's span joins the request's trace.
    pub trace: bool,
}

/// The shortest and longest tick of a worker that streams or batches
/// ([`Service::tick_ms`]): a deadline is noticed within an eighth of `service.timeout_ms` (plus
/// the timer's own lateness), in these bounds. A tick is one call into the VM that looks at the
/// deadlines and the batch queue: 200 a second cost a worker far less than one decision's callout.
const MIN_TICK_MS: u64 = 5;
const MAX_TICK_MS: u64 = 50;

impl Service {
    /// An eighth of `timeout_ms`, within 5..=50 ms: how often the root context's timer looks at
    /// what waits (the stream's messages, the batch queue), and how long a callout may be out
    /// before it counts as slow (another batch leaves beside it, its success is recorded).
    pub fn tick_ms(&self) -> u64 {
        (self.timeout_ms / 8).clamp(MIN_TICK_MS, MAX_TICK_MS)
    }
}

impl core::fmt::Debug for Service {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Service")
            .field("cluster", &self.cluster)
            .field("authority", &self.authority)
            .field("transport", &self.transport)
            .field("timeout_ms", &self.timeout_ms)
            .field("path", &self.path)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("domain", &self.domain)
            .field("batch", &self.batch)
            .field("stream", &self.stream)
            .field("remember_denials_ms", &self.remember_denials_ms)
            .field("trace", &self.trace)
            .finish()
    }
}

/// One rule: what every kind shares (name, conditions, key, shadow, response) and what its
/// kind limits ([`RuleKind`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Unique name: key prefix, logs, `RateLimit-Policy` item.
    pub name: String,
    /// Conditions; all must hold.
    pub matcher: Match,
    /// Key parts, in order.
    pub key: Vec<KeyPart>,
    /// What a missing key part does.
    pub on_missing: OnMissing,
    /// Evaluate and count, never deny (the rule's own `shadow`, else the global one).
    pub shadow: bool,
    /// The denial and headers of this rule (its own `response` fields over the global ones).
    pub response: Response,
    /// What the rule limits (`kind`).
    pub kind: RuleKind,
}

/// What a rule limits: its `kind` and the fields of that kind
/// ([`crate::core::config::rules::RULE_FIELDS`] says which field belongs to which).
// One per rule, built once per configuration: the size of the larger variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleKind {
    /// `kind` absent or `"rate"`: a bucket per key, taken from at every matching request.
    Rate(RateLimit),
    /// `kind: "concurrency"`: a slot per key, held while the request runs
    /// ([`crate::core::inflight`]).
    Concurrency(Concurrency),
}

/// The limit of a rate rule (`kind` absent or `"rate"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    /// Burst size.
    pub capacity: u64,
    /// Tokens per period.
    pub rate: u64,
    /// Period length.
    pub period_ms: u64,
    /// Tokens a request costs.
    pub cost: Cost,
    /// Bucket algorithm.
    pub algorithm: Algorithm,
    /// Lease mode (`None`: one callout per request).
    pub lease: Option<Lease>,
    /// Limits for particular key values, tried in order before the tiers (first match wins).
    pub overrides: Vec<Override>,
    /// Limits by a tier name that a trusted filter in front wrote into a request header.
    pub tiers: Option<Tiers>,
    /// The RLS descriptor of this rule's bucket (transport `rls`): (entry key, where its value
    /// comes from). Default: `("rule", <name>)`, then one entry per key part.
    pub descriptor: Vec<(String, KeyPart)>,
    /// `"charge": "response"`: `cost` is an estimate taken at the request, and what the response
    /// reports using is settled when it ends (`None`: the cost is the whole charge).
    pub charge: Option<Charge>,
    /// `shape`: a take that cannot pay now but can within `max_delay_ms` is granted for then, and
    /// the request held until it (`None`: refused at once, as every limiter does).
    pub shape: Option<Shape>,
    /// `from_request`: the capacity and rate a trusted filter in front wrote for this request
    /// (the rule's own when absent), after `overrides` and `tiers` (`None`: the rule's own).
    pub from_request: Option<FromRequest>,
    /// `calendar` and `time_zone` (algorithm `calendar_window`, and only then): the period its
    /// windows last, from midnight in the zone; `period_ms` is then the unit's longest.
    pub calendar: Option<Calendar>,
}

/// A rule's `from_request`: parts of its limit read from what a trusted filter in front of this
/// one wrote (an authorization or JWT filter's dynamic metadata, or a header it set), each bounded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FromRequest {
    /// The bucket's capacity (default: the rule's `capacity`).
    pub capacity: Option<Attribute>,
    /// Its rate (default: the rule's `rate`, or the capacity read when the rule left `rate` out).
    pub rate: Option<Attribute>,
    /// The rule left `rate` out and `from_request` has no `rate`: the rate is the capacity read.
    pub rate_follows_capacity: bool,
    /// What a request costs (default: the rule's fixed `cost`).
    pub cost: Option<Attribute>,
}

/// A number read from the request, within `min..=max`: absent or not a number, the rule's own
/// value (counted `limit_defaulted`); outside the bounds, clamped to them (`limit_clamped`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attribute {
    /// Where it is read.
    pub source: Source,
    /// Lower bound.
    pub min: u64,
    /// Upper bound.
    pub max: u64,
}

/// Where a number in the request is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A request header's first value (lower-case name), as decimal text.
    Header(String),
    /// Envoy's property path (`metadata`, `filter_metadata`, the filter's namespace, then field
    /// names into its struct): a string of decimal text, or a number.
    Property(Vec<String>),
}

impl Source {
    /// The property path, for a source read as a property.
    pub fn property(&self) -> Option<&[String]> {
        match self {
            Source::Property(p) => Some(p),
            Source::Header(_) => None,
        }
    }
}

/// A rule's `shape` (token buckets only): hold a request for its token instead of refusing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// The longest a request is held; a take that would wait longer is refused at once.
    pub max_delay_ms: u64,
    /// The most requests of this rule one worker holds (or has asked to hold) at once; beyond
    /// it a take is asked for unshaped (refused at once when the bucket cannot pay now).
    pub max_held: u32,
}

/// Largest `shape.max_held`.
pub const MAX_HELD: u64 = 65_536;
/// `shape.max_held` when absent.
pub const DEFAULT_MAX_HELD: u32 = 1024;

/// The limit of a concurrency rule (`kind: "concurrency"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Concurrency {
    /// Most requests per key in flight across the fleet.
    pub max_in_flight: u64,
    /// A slot's lifetime: the slot of a request still running after it is freed anyway.
    pub deadline_ms: u64,
}

impl Rule {
    /// The limit of a rate rule; `None` for another kind.
    pub fn rate_limit(&self) -> Option<&RateLimit> {
        match &self.kind {
            RuleKind::Rate(l) => Some(l),
            RuleKind::Concurrency(_) => None,
        }
    }

    /// The limit of a concurrency rule; `None` for another kind.
    pub fn concurrency(&self) -> Option<Concurrency> {
        match &self.kind {
            RuleKind::Concurrency(c) => Some(*c),
            RuleKind::Rate(_) => None,
        }
    }
}

impl Config {
    /// Whether some rule is charged by the response (`charge: response`).
    pub fn charges_by_response(&self) -> bool {
        self.rules
            .iter()
            .any(|r| r.rate_limit().is_some_and(|l| l.charge.is_some()))
    }

    /// Whether a rule shapes (holds requests for their tokens: the timer releases them).
    pub fn shapes(&self) -> bool {
        self.rules
            .iter()
            .any(|r| r.rate_limit().is_some_and(|l| l.shape.is_some()))
    }
}

/// Where a rule charged by the response reads what it used ([`crate::core::settle::usage`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    /// A response header that holds the count (lower case); read before the body.
    pub header: Option<String>,
    /// Whether the body is read (JSON or Server-Sent Events, by its `content-type`).
    pub body: bool,
    /// Price of prompt and completion tokens; `None`: `total_tokens` (or their sum).
    pub weights: Option<Weights>,
    /// Per model (the request's), the price of its prompt and completion tokens; a model not
    /// named here is priced by `weights`.
    pub prices: Vec<(String, Weights)>,
    /// Most tokens one response is charged.
    pub max: u64,
    /// What a response cut off before its end is charged (`usage.cut`).
    pub cut: Cut,
}

impl Charge {
    /// The prices of `model`'s tokens: its own in `prices`, else `weights`.
    pub fn weights_for(&self, model: Option<&str>) -> Option<Weights> {
        model
            .and_then(|m| self.prices.iter().find(|(name, _)| name == m))
            .map(|(_, w)| *w)
            .or(self.weights)
    }
}

/// What a response cut off before it ended (client gone, upstream reset) is charged: LLM APIs
/// report usage in the last event, so a client that hangs up early would otherwise pay only its
/// reservation for what was generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// `"bound"` (default): as if it had run to the end: the most the request could reserve
    /// (`cost`'s `max`, or the fixed cost), or the usage seen if larger.
    Bound,
    /// `"reserved"`: its reservation, or the usage seen if larger.
    Reserved,
}

impl Rule {
    /// A rule for tests: named `name`, a token bucket of `capacity` refilling `capacity` per
    /// second, no key, no condition, every other field at its default.
    #[cfg(test)]
    pub fn for_test(name: &str, capacity: u64) -> Rule {
        Rule {
            name: name.into(),
            matcher: Match::default(),
            key: Vec::new(),
            on_missing: OnMissing::Skip,
            shadow: false,
            response: Response {
                status: 429,
                body: String::new(),
                content_type: "text/plain".into(),
                headers: Vec::new(),
                on_allowed: false,
            },
            kind: RuleKind::Rate(RateLimit::for_test(capacity)),
        }
    }
}

impl RateLimit {
    /// The limit of [`Rule::for_test`]: a token bucket of `capacity` refilling `capacity` per
    /// second, every other field at its default.
    #[cfg(test)]
    pub fn for_test(capacity: u64) -> RateLimit {
        RateLimit {
            capacity,
            rate: capacity,
            period_ms: 1000,
            cost: Cost::Fixed(1),
            algorithm: Algorithm::TokenBucket,
            lease: None,
            overrides: Vec::new(),
            tiers: None,
            descriptor: Vec::new(),
            charge: None,
            shape: None,
            from_request: None,
            calendar: None,
        }
    }
}

/// Most `overrides` per rule, and most tiers.
pub const MAX_OVERRIDES: usize = 64;

/// The limit of one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// Not limited: the rule takes no bucket for such a request.
    Unlimited,
    /// These limits instead of the rule's own.
    Tokens {
        /// Burst size.
        capacity: u64,
        /// Tokens per period.
        rate: u64,
        /// Period length.
        period_ms: u64,
    },
}

/// A limit for the key values that match a condition on one of the rule's key parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override {
    /// Index of the key part (in `Rule::key`) the condition reads.
    pub part: usize,
    /// What the part's value must be.
    pub when: ValueMatch,
    /// The limit then.
    pub limit: Limit,
}

/// A condition on a key part's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueMatch {
    /// The value equals this, byte for byte.
    Equals(String),
    /// The value starts with this.
    Prefix(String),
    /// The value is an address in this network (`client_ip` parts only).
    Cidr(Cidr),
}

/// An IPv4 or IPv6 network: an address and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    /// The network address.
    pub addr: std::net::IpAddr,
    /// Leading bits that must equal `addr`'s.
    pub bits: u8,
}

impl Cidr {
    /// Parses `10.0.0.0/8`, `2001:db8::/32` (or a bare address: all bits).
    pub fn parse(s: &str) -> Option<Cidr> {
        let (a, b) = match s.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (s, None),
        };
        let addr: std::net::IpAddr = a.trim().parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let bits = match b {
            None => max,
            Some(b) => b.trim().parse::<u8>().ok().filter(|&n| n <= max)?,
        };
        Some(Cidr { addr, bits })
    }

    /// Whether `ip` is in this network (an IPv4 address never is in an IPv6 network, nor back).
    pub fn contains(&self, ip: &std::net::IpAddr) -> bool {
        use std::net::IpAddr::{V4, V6};
        let (a, b, width) = match (self.addr, ip) {
            (V4(a), V4(b)) => (u128::from(u32::from(a)), u128::from(u32::from(*b)), 32u32),
            (V6(a), V6(b)) => (u128::from(a), u128::from(*b), 128u32),
            _ => return false,
        };
        let bits = u32::from(self.bits);
        if bits == 0 {
            return true;
        }
        let shift = width - bits;
        a.checked_shr(shift) == b.checked_shr(shift)
    }
}

/// Limits by tier: the tier's name comes from a request header set by a trusted filter (an
/// authentication filter in front of this one), and only names listed here have a limit: a client
/// can at most choose among the configured limits, never send a number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tiers {
    /// Lower-case name of the header holding the tier's name.
    pub header: String,
    /// Tier name → limit. A missing header or an unknown name gets the rule's own limit.
    pub limits: Vec<(String, Limit)>,
}

/// Lease mode of a rule: the proxy asks the service for tokens in batches and admits later
/// requests from that local pool, shared by its worker threads (see [`crate::core::local::lease`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Most tokens a proxy holds for one key (1..=capacity); `None`: adaptive, about what the key
    /// spends at this proxy in `max_age_ms`, at most capacity / N (the proxies sharing the bucket).
    pub size: Option<u64>,
    /// How long leased tokens may be spent after the grant; then they are dropped.
    pub max_age_ms: u64,
}

/// Longest `lease.max_age_ms` (one minute: leased tokens are meant to be spent soon).
pub const MAX_LEASE_AGE_MS: u64 = 60_000;

/// Request conditions of a rule. Empty = every request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Match {
    /// Path (without query string) condition.
    pub path: Option<PathMatch>,
    /// Allowed methods (upper case); empty = any.
    pub methods: Vec<String>,
    /// Header conditions.
    pub headers: Vec<HeaderMatch>,
    /// The client address is in one of these networks (empty: any).
    pub client_ip: Vec<Cidr>,
    /// Conditions that must not all hold (a `not` holds no `not` of its own).
    pub not: Option<Box<Match>>,
}

impl Match {
    /// Whether any condition here (or under `not`) reads the client address.
    pub fn reads_client_ip(&self) -> bool {
        !self.client_ip.is_empty() || self.not.as_ref().is_some_and(|n| n.reads_client_ip())
    }
}

/// A path condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    /// The path equals this.
    Exact(String),
    /// The path starts with this.
    Prefix(String),
}

/// A header condition (names are lower case).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderMatch {
    /// The header is present (`true`) or absent (`false`).
    Present(String, bool),
    /// The header's (first) value equals this, byte for byte.
    Equals(String, String),
}

/// One part of a bucket key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    /// Fixed text.
    Literal(String),
    /// A request header's value (lower-case name).
    Header(String),
    /// The client address (peer, or x-forwarded-for with `trusted_hops`).
    ClientIp,
    /// The request path without query string.
    Path,
    /// The request method.
    Method,
    /// The request authority (host).
    Authority,
    /// The model the request asks for (the configuration's `model`).
    Model,
}

/// What a request costs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    /// Always this many tokens.
    Fixed(u64),
    /// Read from a header (a client's hint); `default` when absent or not a positive integer;
    /// clamped to `min ..= max`.
    Header {
        /// Lower-case header name.
        name: String,
        /// Cost when the header is absent or invalid.
        default: u64,
        /// Lower bound: what a request reserves whatever its header says.
        min: u64,
        /// Upper bound.
        max: u64,
    },
}

impl Cost {
    /// The most one request can reserve: what a response cut off before it reported its usage
    /// is charged (at least) by default.
    pub fn bound(&self) -> u64 {
        match self {
            Cost::Fixed(c) => *c,
            Cost::Header { max, .. } => *max,
        }
    }
}

/// Local fallback buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fallback {
    /// Proxies sharing the global limit: each local bucket gets capacity/instances, rate/instances.
    /// Used until the service reports the live instances (`crate::core::wire::instance`), which then
    /// replace it.
    pub instances: u64,
    /// The floor of the number of proxies a limit is split by, whatever the service reports.
    pub min_instances: u64,
    /// Slots in the shared fallback table (a bound on memory).
    pub max_keys: u32,
    /// How long an unpaid fallback debt matters: the longest time any rule's bucket takes to
    /// fill from empty, clamped to 10 s ..= 1 h (computed here once, read on every answer).
    pub debt_horizon_ms: u64,
}

/// Circuit breaker settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breaker {
    /// Consecutive failures that open the breaker; 0 disables it.
    pub failures: u32,
    /// First open interval.
    pub open_ms: u64,
    /// Longest open interval (the interval doubles after each failed probe).
    pub max_open_ms: u64,
}

/// The denial response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status of a denial.
    pub status: u32,
    /// Body of a denial.
    pub body: String,
    /// Content type of the body.
    pub content_type: String,
    /// Header styles.
    pub headers: Vec<HeaderStyle>,
    /// Add the headers to allowed responses too.
    pub on_allowed: bool,
}

/// How prompt and completion tokens are priced against each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Weights {
    /// Cost of one prompt token.
    pub prompt: u64,
    /// Cost of one completion token.
    pub completion: u64,
}

/// Most requests in flight a concurrency rule may allow per key.
pub const MAX_IN_FLIGHT: u64 = 1_000_000;
/// Default slot deadline: a request that outlives it no longer holds its slot.
pub const DEFAULT_DEADLINE_MS: u64 = 60_000;
/// Shortest and longest slot deadline (the contract's bound is one day).
pub const DEADLINE_MS: (u64, u64) = (100, contract::bounds::MAX_SLOT_TTL_MS);
