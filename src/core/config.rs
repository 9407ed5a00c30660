//! The plugin configuration (docs/filter-config.md is the user-facing reference).
//!
//! Parsed and validated once, in `on_configure`; the result is immutable and shared by every
//! request: [`Config`] holds the validated values with every default resolved. Unknown fields
//! are errors (a typo must not silently leave a limit unset), and every error names the offending
//! field, e.g.
//! `rules[1].capacity: must be between 1 and 1000000000`. The numeric bounds are the contract's
//! (contract/README.md), so the service never rejects what the filter accepted.

use serde_json::{Map, Value};
use std::fmt;

/// Largest capacity, rate and cost (the contract's); longest period (one year, in ms); at most
/// this many rules, one bucket each per request.
pub use contract::bounds::{MAX_AMOUNT, MAX_BUCKETS, MAX_PERIOD_MS};
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

fn err<T>(field: impl Into<String>, message: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError {
        field: field.into(),
        message: message.into(),
    })
}

// ---------------------------------------------------------------------------------------------
// Validated configuration

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
    /// Rules, in configuration order (also the order of buckets in a callout).
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
    /// Concurrency rules (`kind: "concurrency"`), in configuration order; not in `rules`.
    pub inflight: Vec<crate::core::inflight::InFlight>,
}

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
            .finish()
    }
}

/// One rate limit rule.
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
    /// Evaluate and count, never deny (the rule's own `shadow`, else the global one).
    pub shadow: bool,
    /// The denial and headers of this rule (its own `response` fields over the global ones).
    pub response: Response,
    /// The RLS descriptor of this rule's bucket (transport `rls`): (entry key, where its value
    /// comes from). Default: `("rule", <name>)`, then one entry per key part.
    pub descriptor: Vec<(String, KeyPart)>,
    /// `"charge": "response"`: `cost` is an estimate taken at the request, and what the response
    /// reports using is settled when it ends (`None`: the cost is the whole charge).
    pub charge: Option<Charge>,
}

/// Where a rule charged by the response reads what it used ([`crate::core::usage`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    /// A response header that holds the count (lower case); read before the body.
    pub header: Option<String>,
    /// Whether the body is read (JSON or Server-Sent Events, by its `content-type`).
    pub body: bool,
    /// Price of prompt and completion tokens; `None`: `total_tokens` (or their sum).
    pub weights: Option<crate::core::usage::Weights>,
    /// Most tokens one response is charged.
    pub max: u64,
    /// What a response cut off before its end is charged (`usage.cut`).
    pub cut: Cut,
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
            capacity,
            rate: capacity,
            period_ms: 1000,
            cost: Cost::Fixed(1),
            algorithm: Algorithm::TokenBucket,
            lease: None,
            overrides: Vec::new(),
            tiers: None,
            shadow: false,
            response: Response {
                status: 429,
                body: String::new(),
                content_type: "text/plain".into(),
                headers: Vec::new(),
                on_allowed: false,
            },
            descriptor: Vec::new(),
            charge: None,
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
/// requests from that local pool, shared by its worker threads (see [`crate::core::lease`]).
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
    /// Used until the service reports the live instances (`crate::core::instance`), which then
    /// replace it.
    pub instances: u64,
    /// The floor of the number of proxies a limit is split by, whatever the service reports.
    pub min_instances: u64,
    /// Slots in the shared fallback table (a bound on memory).
    pub max_keys: u32,
    /// How long an unpaid fallback debt matters: the longest time any rule's bucket takes to
    /// fill from empty, clamped to 10 s ..= 1 h (computed here once, read on every answer).
    pub debt_horizon_ms: u64,
    /// The table sizes earlier configurations of this Envoy used, newest first (0: none): not
    /// read from the JSON but learned when the configuration is applied
    /// ([`crate::core::fallback::prepare_for`]), so that a share or a debt recorded under another
    /// `max_keys` is carried over instead of starting afresh.
    pub previous_max_keys: [u32; 3],
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

// ---------------------------------------------------------------------------------------------
// Reading the JSON
//
// The document is parsed into a `serde_json::Value` and walked by hand: each object is checked
// against its list of known fields, and each value is read with its full path at hand, so every
// error (unknown field, wrong type, out of range) names the field. A derive with
// `deny_unknown_fields` plus a path-tracking wrapper did the same for about 60 KiB more module.

/// One JSON object being read, with its path and its known fields.
struct Obj<'a> {
    at: String,
    map: &'a Map<String, Value>,
}

fn join(at: &str, field: &str) -> String {
    if at.is_empty() {
        field.to_string()
    } else {
        format!("{at}.{field}")
    }
}

impl<'a> Obj<'a> {
    /// `v` must be an object whose fields are all in `known`.
    fn new(v: &'a Value, at: &str, known: &[&str]) -> Result<Obj<'a>, ConfigError> {
        let Value::Object(map) = v else {
            return err(
                if at.is_empty() { "config" } else { at },
                "must be an object",
            );
        };
        for k in map.keys() {
            if !known.contains(&k.as_str()) {
                // An empty key still gets a name in the error.
                let name = if k.is_empty() { "\"\"" } else { k.as_str() };
                return err(
                    join(at, name),
                    format!("unknown field (expected one of: {})", known.join(", ")),
                );
            }
        }
        Ok(Obj {
            at: at.to_string(),
            map,
        })
    }

    fn path(&self, f: &str) -> String {
        join(&self.at, f)
    }

    /// A field's value; JSON `null` counts as absent.
    fn get(&self, f: &str) -> Option<&'a Value> {
        self.map.get(f).filter(|v| !v.is_null())
    }

    fn required(&self, f: &str) -> Result<&'a Value, ConfigError> {
        match self.get(f) {
            Some(v) => Ok(v),
            None => err(self.path(f), "missing (required)"),
        }
    }

    /// An integer in `lo..=hi`, or `default` when absent.
    fn int(&self, f: &str, default: Option<u64>, lo: u64, hi: u64) -> Result<u64, ConfigError> {
        let v = match (self.get(f), default) {
            (Some(v), _) => v,
            (None, Some(d)) => return Ok(d),
            (None, None) => return err(self.path(f), "missing (required)"),
        };
        int_value(&self.path(f), v, lo, hi)
    }

    fn string(&self, f: &str) -> Result<Option<String>, ConfigError> {
        match self.get(f) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => err(self.path(f), "must be a string"),
        }
    }

    fn boolean(&self, f: &str) -> Result<bool, ConfigError> {
        match self.get(f) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => err(self.path(f), "must be true or false"),
        }
    }

    fn array(&self, f: &str) -> Result<Option<&'a Vec<Value>>, ConfigError> {
        match self.get(f) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(_) => err(self.path(f), "must be a list"),
        }
    }

    /// One of fixed names, or `default` when absent.
    fn choice<T: Copy>(
        &self,
        f: &str,
        options: &[(&str, T)],
        default: T,
    ) -> Result<T, ConfigError> {
        match self.get(f) {
            None => Ok(default),
            Some(v) => choice_value(&self.path(f), v, options),
        }
    }
}

fn int_value(at: &str, v: &Value, lo: u64, hi: u64) -> Result<u64, ConfigError> {
    match v.as_u64() {
        Some(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => err(at, format!("must be between {lo} and {hi}")),
    }
}

fn choice_value<T: Copy>(at: &str, v: &Value, options: &[(&str, T)]) -> Result<T, ConfigError> {
    if let Some(s) = v.as_str() {
        if let Some((_, t)) = options.iter().find(|(name, _)| *name == s) {
            return Ok(*t);
        }
    }
    let names: Vec<String> = options.iter().map(|(n, _)| format!("\"{n}\"")).collect();
    err(at, format!("must be one of {}", names.join(", ")))
}

impl Config {
    /// Parses and validates the plugin configuration (JSON bytes).
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        let doc: Value = match serde_json::from_slice(bytes) {
            Ok(v) => v,
            Err(e) => return err("config", format!("not valid JSON: {e}")),
        };
        let root = Obj::new(
            &doc,
            "",
            &[
                "service",
                "trusted_hops",
                "rules",
                "failure_mode",
                "fallback",
                "breaker",
                "shadow",
                "response",
                "near_limit",
            ],
        )?;
        let service = read_service(&root)?;
        let trusted_hops = root.int("trusted_hops", Some(0), 0, 16)? as u32;
        let raw_rules = root.array("rules")?.ok_or_else(|| ConfigError {
            field: "rules".into(),
            message: "missing (required)".into(),
        })?;
        if raw_rules.is_empty() || raw_rules.len() > MAX_BUCKETS {
            return err(
                "rules",
                format!("must hold between 1 and {MAX_BUCKETS} rules"),
            );
        }
        let shadow = root.boolean("shadow")?;
        let empty = Value::Object(Map::new());
        let response = read_response(
            &Obj::new(
                root.get("response").unwrap_or(&empty),
                "response",
                RESPONSE_FIELDS,
            )?,
            None,
        )?;
        let mut rules: Vec<Rule> = Vec::with_capacity(raw_rules.len());
        let mut inflight: Vec<crate::core::inflight::InFlight> = Vec::new();
        for (i, r) in raw_rules.iter().enumerate() {
            let at = format!("rules[{i}]");
            let kind = match r.get("kind").filter(|v| !v.is_null()) {
                None => false,
                Some(v) if v.as_str() == Some("rate") => false,
                Some(v) if v.as_str() == Some("concurrency") => true,
                Some(_) => {
                    return err(
                        format!("{at}.kind"),
                        "must be one of \"rate\", \"concurrency\"",
                    )
                }
            };
            if kind {
                if service.transport == Transport::Rls {
                    return err(
                        format!("{at}.kind"),
                        "concurrency is not available with transport rls (an RLS server holds no slots)",
                    );
                }
                let rule = read_rule(&at, r, shadow, &response, true)?;
                let f = crate::core::inflight::InFlight {
                    max: rule.capacity,
                    deadline_ms: rule.period_ms,
                    rule,
                };
                let name = &f.rule.name;
                if rules.iter().any(|o| &o.name == name)
                    || inflight.iter().any(|o| &o.rule.name == name)
                {
                    return err(
                        format!("{at}.name"),
                        format!("duplicate rule name {name:?}"),
                    );
                }
                inflight.push(f);
                continue;
            }
            let rule = read_rule(&at, r, shadow, &response, false)?;
            if service.transport == Transport::Rls && rule.lease.is_some() {
                return err(
                    format!("rules[{i}].lease"),
                    "not available with transport rls (an RLS server grants no leases)",
                );
            }
            if service.transport == Transport::Rls && rule.charge.is_some() {
                return err(
                    format!("rules[{i}].charge"),
                    "\"response\" is not available with transport rls (an RLS server settles nothing)",
                );
            }
            if rules.iter().any(|o| o.name == rule.name)
                || inflight.iter().any(|o| o.rule.name == rule.name)
            {
                return err(
                    format!("rules[{i}].name"),
                    format!("duplicate rule name {:?}", rule.name),
                );
            }
            rules.push(rule);
        }
        let failure_mode = root.choice(
            "failure_mode",
            &[
                ("fallback", FailureMode::Fallback),
                ("allow", FailureMode::Allow),
                ("deny", FailureMode::Deny),
            ],
            FailureMode::Fallback,
        )?;
        let fb = Obj::new(
            root.get("fallback").unwrap_or(&empty),
            "fallback",
            &["instances", "max_keys", "min_instances"],
        )?;
        let fill_ms = rules
            .iter()
            .map(|r| {
                let ms =
                    u128::from(r.capacity) * u128::from(r.period_ms) / u128::from(r.rate.max(1));
                u64::try_from(ms + 1).unwrap_or(u64::MAX)
            })
            .max()
            .unwrap_or(0);
        let fallback = Fallback {
            instances: fb.int("instances", Some(1), 1, 10_000)?,
            min_instances: fb.int("min_instances", Some(1), 1, 10_000)?,
            max_keys: fb.int("max_keys", Some(10_000), 1, 1_000_000)? as u32,
            debt_horizon_ms: fill_ms.clamp(10_000, 3_600_000),
            previous_max_keys: [0; 3],
        };
        let br = Obj::new(
            root.get("breaker").unwrap_or(&empty),
            "breaker",
            &["failures", "open_ms", "max_open_ms"],
        )?;
        let failures = br.int("failures", Some(5), 0, 10_000)? as u32;
        let open_ms = br.int("open_ms", Some(250), 1, 3_600_000)?;
        let max_open_ms = br.int("max_open_ms", Some(open_ms.max(5_000)), open_ms, 3_600_000)?;

        let near_limit_left_permille = match root.get("near_limit") {
            None => 200,
            Some(v) => match v.as_f64() {
                Some(f) if (0.0..=1.0).contains(&f) => 1000 - (f * 1000.0).round() as u64,
                _ => return err("near_limit", "must be a number between 0 and 1"),
            },
        };
        let needs_peer_address = trusted_hops == 0
            && rules
                .iter()
                .chain(inflight.iter().map(|f| &f.rule))
                .any(|r| {
                    r.key.contains(&KeyPart::ClientIp)
                        || r.matcher.reads_client_ip()
                        || (service.transport == Transport::Rls
                            && r.descriptor.iter().any(|(_, p)| *p == KeyPart::ClientIp))
                });
        Ok(Config {
            service,
            trusted_hops,
            rules,
            failure_mode,
            fallback,
            breaker: Breaker {
                failures,
                open_ms,
                max_open_ms,
            },
            shadow,
            response,
            needs_peer_address,
            near_limit_left_permille,
            inflight,
        })
    }
}

/// Text that goes into a header value or a header name must not smuggle a line break or other
/// control characters into the response.
fn header_safe(s: &str) -> bool {
    s.bytes().all(|b| (0x20..0x7f).contains(&b) || b == b'\t')
}

fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn header_name(field: &str, name: &str) -> Result<String, ConfigError> {
    if name.is_empty() || name.len() > 256 || !name.bytes().all(is_token_char) {
        return err(field, "must be a header name (1..=256 token characters)");
    }
    Ok(name.to_ascii_lowercase())
}

fn read_service(root: &Obj<'_>) -> Result<Service, ConfigError> {
    let s = Obj::new(
        root.required("service")?,
        "service",
        &[
            "cluster",
            "authority",
            "transport",
            "timeout_ms",
            "path",
            "token",
            "domain",
            "batch",
        ],
    )?;
    let cluster = s.string("cluster")?.unwrap_or_default();
    if cluster.is_empty() || !header_safe(&cluster) {
        return err("service.cluster", "must be a non-empty cluster name");
    }
    let authority = s.string("authority")?.unwrap_or_else(|| cluster.clone());
    if authority.is_empty() || !header_safe(&authority) {
        return err("service.authority", "must be a non-empty host name");
    }
    let transport = s.choice(
        "transport",
        &[
            ("http", Transport::Http),
            ("grpc", Transport::Grpc),
            ("rls", Transport::Rls),
        ],
        Transport::Http,
    )?;
    let domain = s.string("domain")?.unwrap_or_default();
    match transport {
        Transport::Rls if domain.is_empty() || domain.len() > 256 => {
            return err(
                "service.domain",
                "required with transport rls: the RLS domain, 1..=256 bytes",
            )
        }
        Transport::Http | Transport::Grpc if !domain.is_empty() => {
            return err("service.domain", "only with transport rls")
        }
        _ => {}
    }
    let timeout_ms = s.int("timeout_ms", Some(20), 1, 60_000)?;
    let path = s.string("path")?.unwrap_or_else(|| "/v1/take".to_string());
    if !path.starts_with('/') || !header_safe(&path) || path.contains(' ') {
        return err(
            "service.path",
            "must start with '/' and hold no spaces or control characters",
        );
    }
    let token = s.string("token")?;
    if let Some(t) = &token {
        if t.is_empty() || t.len() > 4096 || !header_safe(t) {
            return err("service.token", "must be 1..=4096 printable characters");
        }
    }
    let batch = s.int(
        "batch",
        Some(if transport == Transport::Rls {
            0
        } else {
            MAX_BATCH_TAKES as u64
        }),
        0,
        MAX_BATCH_TAKES as u64,
    )? as usize;
    if batch > 0 && transport == Transport::Rls {
        return err("service.batch", "not available with transport rls");
    }
    Ok(Service {
        cluster,
        authority,
        transport,
        timeout_ms,
        path,
        token,
        domain,
        batch,
    })
}

fn read_rule(
    at: &str,
    v: &Value,
    global_shadow: bool,
    global_response: &Response,
    concurrency: bool,
) -> Result<Rule, ConfigError> {
    let r = Obj::new(
        v,
        at,
        &[
            "name",
            "match",
            "key",
            "on_missing",
            "capacity",
            "rate",
            "period_ms",
            "cost",
            "algorithm",
            "lease",
            "overrides",
            "tiers",
            "shadow",
            "response",
            "descriptor",
            "kind",
            "max_in_flight",
            "deadline_ms",
            "charge",
            "usage",
        ],
    )?;
    if concurrency {
        for f in crate::core::inflight::RATE_ONLY {
            if r.get(f).is_some() {
                return err(r.path(f), "not for a concurrency rule");
            }
        }
    }
    let name = match r.required("name")? {
        Value::String(s) => s.clone(),
        _ => String::new(),
    };
    let name_ok = !name.is_empty()
        && name.len() <= MAX_RULE_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b));
    if !name_ok {
        return err(
            r.path("name"),
            format!("must be 1..={MAX_RULE_BYTES} characters from A-Z a-z 0-9 - _ . : /"),
        );
    }
    let matcher = match r.get("match") {
        None => Match::default(),
        Some(m) => read_match(&r.path("match"), m, true)?,
    };
    let raw_key = r.array("key")?.map(Vec::as_slice).unwrap_or(&[]);
    if raw_key.len() > MAX_KEY_PARTS {
        return err(
            r.path("key"),
            format!("must hold at most {MAX_KEY_PARTS} parts"),
        );
    }
    let mut key = Vec::with_capacity(raw_key.len());
    for (j, p) in raw_key.iter().enumerate() {
        let at = format!("{}[{j}]", r.path("key"));
        match p.as_str() {
            Some(p) => key.push(parse_key_part(&at, p)?),
            None => return err(at, "must be a string"),
        }
    }
    let on_missing = r.choice(
        "on_missing",
        &[("skip", OnMissing::Skip), ("shared", OnMissing::Shared)],
        OnMissing::Skip,
    )?;
    // A concurrency rule (crate::core::inflight) has its own limit and no rate fields.
    let capacity = if concurrency {
        r.int(
            "max_in_flight",
            None,
            1,
            crate::core::inflight::MAX_IN_FLIGHT,
        )?
    } else {
        for f in ["max_in_flight", "deadline_ms"] {
            if r.get(f).is_some() {
                return err(r.path(f), "only for a rule of kind \"concurrency\"");
            }
        }
        r.int("capacity", None, 1, MAX_AMOUNT)?
    };
    let rate = r.int("rate", Some(capacity), 1, MAX_AMOUNT)?;
    // A concurrency rule keeps its slots' deadline here (it has no period).
    let period_ms = if concurrency {
        let (lo, hi) = crate::core::inflight::DEADLINE_MS;
        r.int(
            "deadline_ms",
            Some(crate::core::inflight::DEFAULT_DEADLINE_MS),
            lo,
            hi,
        )?
    } else {
        r.int("period_ms", None, 1, MAX_PERIOD_MS)?
    };
    let cost = match r.get("cost") {
        None => Cost::Fixed(1),
        Some(Value::Object(_)) => read_cost(
            &Obj::new(
                r.required("cost")?,
                &r.path("cost"),
                &["header", "default", "min", "max", "reserve"],
            )?,
            capacity,
        )?,
        Some(v) => Cost::Fixed(int_value(&r.path("cost"), v, 1, MAX_AMOUNT)?),
    };
    let algorithms: Vec<_> = Algorithm::ALL.iter().map(|&a| (a.name(), a)).collect();
    let algorithm = r.choice("algorithm", &algorithms, Algorithm::default())?;
    let lease = match r.get("lease") {
        None => None,
        Some(v) => {
            let l = Obj::new(v, &r.path("lease"), &["size", "max_age_ms"])?;
            Some(Lease {
                size: match l.get("size") {
                    None => None,
                    Some(v) => Some(int_value(&l.path("size"), v, 1, capacity)?),
                },
                max_age_ms: l.int("max_age_ms", Some(1000), 1, MAX_LEASE_AGE_MS)?,
            })
        }
    };
    let mut overrides = Vec::new();
    let raw = r.array("overrides")?.map(Vec::as_slice).unwrap_or(&[]);
    if raw.len() > MAX_OVERRIDES {
        return err(
            r.path("overrides"),
            format!("must hold at most {MAX_OVERRIDES} entries"),
        );
    }
    for (k, o) in raw.iter().enumerate() {
        overrides.push(read_override(
            &format!("{}[{k}]", r.path("overrides")),
            o,
            raw_key,
            &key,
            period_ms,
        )?);
    }
    let tiers = match r.get("tiers") {
        None => None,
        Some(v) => Some(read_tiers(&r.path("tiers"), v, period_ms)?),
    };
    let shadow = match r.get("shadow") {
        None => global_shadow,
        Some(_) => r.boolean("shadow")?,
    };
    let response = match r.get("response") {
        None => global_response.clone(),
        Some(v) => read_response(
            &Obj::new(v, &r.path("response"), RESPONSE_FIELDS)?,
            Some(global_response),
        )?,
    };
    let descriptor = match r.array("descriptor")? {
        None => default_descriptor(&name, &key),
        Some(entries) => {
            if entries.is_empty() || entries.len() > MAX_KEY_PARTS + 1 {
                return err(
                    r.path("descriptor"),
                    format!("must hold 1..={} entries", MAX_KEY_PARTS + 1),
                );
            }
            let mut d = Vec::with_capacity(entries.len());
            for (k, e) in entries.iter().enumerate() {
                let eat = format!("{}[{k}]", r.path("descriptor"));
                let o = Obj::new(e, &eat, &["key", "value"])?;
                let ek = o.string("key")?.unwrap_or_default();
                if ek.is_empty() || ek.len() > 256 {
                    return err(o.path("key"), "must be 1..=256 bytes");
                }
                let value = o.string("value")?.unwrap_or_default();
                d.push((ek, parse_key_part(&o.path("value"), &value)?));
            }
            d
        }
    };
    let charge = read_charge(&r)?;
    if charge.is_some() && lease.is_some() {
        return err(
            r.path("lease"),
            "not with \"charge\": \"response\" (a lease spends tokens no response settles)",
        );
    }
    Ok(Rule {
        name,
        matcher,
        key,
        on_missing,
        capacity,
        rate,
        period_ms,
        cost,
        algorithm,
        lease,
        overrides,
        tiers,
        shadow,
        response,
        descriptor,
        charge,
    })
}

/// A `cost` object: a header's value bounded by `min` and `max` (`reserve: "hint"`, the default),
/// or `max` for every request (`reserve: "max"`: the header, its default and floor mean nothing
/// then, and are refused; `max` is required). A hint's `max` defaults to the rule's capacity.
fn read_cost(c: &Obj, capacity: u64) -> Result<Cost, ConfigError> {
    let by_max = c.choice("reserve", &[("hint", false), ("max", true)], false)?;
    if by_max {
        if let Some(f) = ["header", "default", "min"]
            .into_iter()
            .find(|f| c.get(f).is_some())
        {
            return err(
                c.path(f),
                "not with \"reserve\": \"max\" (every request reserves `max`)",
            );
        }
        return Ok(Cost::Fixed(c.int("max", None, 1, MAX_AMOUNT)?));
    }
    let name = header_name(&c.path("header"), &c.string("header")?.unwrap_or_default())?;
    let max = c.int("max", Some(capacity), 1, MAX_AMOUNT)?;
    let min = c.int("min", Some(1), 1, max)?;
    let default = c.int("default", Some(min), min, max)?;
    Ok(Cost::Header {
        name,
        default,
        min,
        max,
    })
}

/// A rule's `charge` and `usage`: `None` for `"charge": "request"` (the default).
fn read_charge(r: &Obj) -> Result<Option<Charge>, ConfigError> {
    let by_response = r.choice("charge", &[("request", false), ("response", true)], false)?;
    if !by_response {
        if r.get("usage").is_some() {
            return err(r.path("usage"), "only with \"charge\": \"response\"");
        }
        return Ok(None);
    }
    let empty = Value::Object(serde_json::Map::new());
    let u = Obj::new(
        r.get("usage").unwrap_or(&empty),
        &r.path("usage"),
        &["header", "body", "weights", "max", "cut"],
    )?;
    let header = match u.string("header")? {
        None => None,
        Some(h) => Some(header_name(&u.path("header"), &h)?),
    };
    let body = match u.get("body") {
        None => true,
        Some(_) => u.boolean("body")?,
    };
    if header.is_none() && !body {
        return err(
            u.path("body"),
            "false leaves no usage to read: name a header",
        );
    }
    let weights = match u.get("weights") {
        None => None,
        Some(v) => {
            let w = Obj::new(v, &u.path("weights"), &["prompt", "completion"])?;
            Some(crate::core::usage::Weights {
                prompt: w.int("prompt", Some(1), 0, MAX_WEIGHT)?,
                completion: w.int("completion", Some(1), 0, MAX_WEIGHT)?,
            })
        }
    };
    Ok(Some(Charge {
        header,
        body,
        weights,
        max: u.int("max", Some(MAX_AMOUNT), 1, MAX_AMOUNT)?,
        cut: u.choice(
            "cut",
            &[("bound", Cut::Bound), ("reserved", Cut::Reserved)],
            Cut::Bound,
        )?,
    }))
}

/// Largest price of one prompt or completion token (`usage.weights`).
pub const MAX_WEIGHT: u64 = 1000;

/// The RLS descriptor a rule gets without `descriptor`: `("rule", <name>)`, then per key part the
/// entry Envoy's own rate limit actions would use (`remote_address`, the header's name, `path`,
/// `method`, `authority`, `generic_key` for a literal).
fn default_descriptor(name: &str, key: &[KeyPart]) -> Vec<(String, KeyPart)> {
    let mut d = vec![("rule".to_string(), KeyPart::Literal(name.to_string()))];
    for p in key {
        let k = match p {
            KeyPart::Literal(_) => "generic_key".to_string(),
            KeyPart::Header(h) => h.clone(),
            KeyPart::ClientIp => "remote_address".to_string(),
            KeyPart::Path => "path".to_string(),
            KeyPart::Method => "method".to_string(),
            KeyPart::Authority => "authority".to_string(),
        };
        d.push((k, p.clone()));
    }
    d
}

/// The limit fields of an override or a tier: `unlimited: true`, or `capacity` (with `rate`
/// defaulting to it and `period_ms` to the rule's).
fn read_limit(o: &Obj<'_>, rule_period_ms: u64) -> Result<Limit, ConfigError> {
    if o.boolean("unlimited")? {
        for f in ["capacity", "rate", "period_ms"] {
            if o.get(f).is_some() {
                return err(o.path(f), "unlimited takes no limits");
            }
        }
        return Ok(Limit::Unlimited);
    }
    let capacity = o.int("capacity", None, 1, MAX_AMOUNT)?;
    Ok(Limit::Tokens {
        capacity,
        rate: o.int("rate", Some(capacity), 1, MAX_AMOUNT)?,
        period_ms: o.int("period_ms", Some(rule_period_ms), 1, MAX_PERIOD_MS)?,
    })
}

fn read_override(
    at: &str,
    v: &Value,
    raw_key: &[Value],
    key: &[KeyPart],
    rule_period_ms: u64,
) -> Result<Override, ConfigError> {
    let o = Obj::new(
        v,
        at,
        &[
            "key_part",
            "value",
            "prefix",
            "cidr",
            "unlimited",
            "capacity",
            "rate",
            "period_ms",
        ],
    )?;
    // Which key part: named as in `key`, or the rule's only part that is not a literal.
    let variable: Vec<usize> = key
        .iter()
        .enumerate()
        .filter(|(_, p)| !matches!(p, KeyPart::Literal(_)))
        .map(|(i, _)| i)
        .collect();
    let part = match o.string("key_part")? {
        Some(name) => match raw_key
            .iter()
            .position(|p| p.as_str() == Some(name.as_str()))
        {
            Some(i) => i,
            None => return err(o.path("key_part"), "must be one of the rule's `key` parts"),
        },
        None => match variable.as_slice() {
            [i] => *i,
            _ => {
                return err(
                    o.path("key_part"),
                    "missing: the rule's key has more or fewer than one non-literal part",
                )
            }
        },
    };
    let when = match (o.string("value")?, o.string("prefix")?, o.string("cidr")?) {
        (Some(v), None, None) => ValueMatch::Equals(v),
        (None, Some(p), None) => ValueMatch::Prefix(p),
        (None, None, Some(c)) => {
            if key.get(part) != Some(&KeyPart::ClientIp) {
                return err(o.path("cidr"), "only for a client_ip key part");
            }
            match Cidr::parse(&c) {
                Some(c) => ValueMatch::Cidr(c),
                None => {
                    return err(
                        o.path("cidr"),
                        "must be an address with a prefix length, e.g. 10.0.0.0/8",
                    )
                }
            }
        }
        _ => return err(at, "needs exactly one of `value`, `prefix` or `cidr`"),
    };
    Ok(Override {
        part,
        when,
        limit: read_limit(&o, rule_period_ms)?,
    })
}

fn read_tiers(at: &str, v: &Value, rule_period_ms: u64) -> Result<Tiers, ConfigError> {
    let t = Obj::new(v, at, &["header", "limits"])?;
    let header = header_name(&t.path("header"), &t.string("header")?.unwrap_or_default())?;
    let Value::Object(map) = t.required("limits")? else {
        return err(t.path("limits"), "must be an object of tier name → limit");
    };
    if map.is_empty() || map.len() > MAX_OVERRIDES {
        return err(
            t.path("limits"),
            format!("must hold 1..={MAX_OVERRIDES} tiers"),
        );
    }
    let mut limits = Vec::with_capacity(map.len());
    for (name, lv) in map {
        let lat = format!("{}.{name}", t.path("limits"));
        if name.is_empty() || name.len() > MAX_RULE_BYTES {
            return err(lat, format!("tier names are 1..={MAX_RULE_BYTES} bytes"));
        }
        let o = Obj::new(lv, &lat, &["unlimited", "capacity", "rate", "period_ms"])?;
        limits.push((name.clone(), read_limit(&o, rule_period_ms)?));
    }
    Ok(Tiers { header, limits })
}

fn read_match(at: &str, v: &Value, outer: bool) -> Result<Match, ConfigError> {
    let known: &[&str] = if outer {
        &[
            "path_exact",
            "path_prefix",
            "methods",
            "headers",
            "client_ip",
            "not",
        ]
    } else {
        &[
            "path_exact",
            "path_prefix",
            "methods",
            "headers",
            "client_ip",
        ]
    };
    let m = Obj::new(v, at, known)?;
    let path = match (m.string("path_exact")?, m.string("path_prefix")?) {
        (Some(_), Some(_)) => {
            return err(
                m.path("path_prefix"),
                "path_exact and path_prefix exclude each other",
            )
        }
        (Some(p), None) => {
            if !p.starts_with('/') {
                return err(m.path("path_exact"), "must start with '/'");
            }
            Some(PathMatch::Exact(p))
        }
        (None, Some(p)) => {
            if !p.starts_with('/') {
                return err(m.path("path_prefix"), "must start with '/'");
            }
            Some(PathMatch::Prefix(p))
        }
        (None, None) => None,
    };
    let mut methods = Vec::new();
    if let Some(ms) = m.array("methods")? {
        if ms.is_empty() {
            return err(
                m.path("methods"),
                "must not be empty (omit it to match any method)",
            );
        }
        for (k, method) in ms.iter().enumerate() {
            let method = method.as_str().unwrap_or_default();
            if method.is_empty() || method.len() > 32 || !method.bytes().all(is_token_char) {
                return err(
                    format!("{}[{k}]", m.path("methods")),
                    "must be an HTTP method",
                );
            }
            methods.push(method.to_ascii_uppercase());
        }
    }
    let mut headers = Vec::new();
    for (k, h) in m
        .array("headers")?
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .enumerate()
    {
        let hat = format!("{}[{k}]", m.path("headers"));
        let o = Obj::new(h, &hat, &["name", "present", "equals"])?;
        let name = header_name(&o.path("name"), &o.string("name")?.unwrap_or_default())?;
        let present = match o.get("present") {
            None => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(_) => return err(o.path("present"), "must be true or false"),
        };
        headers.push(match (present, o.string("equals")?) {
            (Some(p), None) => HeaderMatch::Present(name, p),
            (None, Some(v)) => HeaderMatch::Equals(name, v),
            _ => return err(hat, "needs exactly one of `present` or `equals`"),
        });
    }
    let mut client_ip = Vec::new();
    if let Some(nets) = m.array("client_ip")? {
        if nets.is_empty() || nets.len() > MAX_OVERRIDES {
            return err(
                m.path("client_ip"),
                format!("must hold 1..={MAX_OVERRIDES} networks"),
            );
        }
        for (k, n) in nets.iter().enumerate() {
            match n.as_str().and_then(Cidr::parse) {
                Some(c) => client_ip.push(c),
                None => {
                    return err(
                        format!("{}[{k}]", m.path("client_ip")),
                        "must be an address with a prefix length, e.g. 10.0.0.0/8",
                    )
                }
            }
        }
    }
    let not = match m.get("not") {
        None => None,
        Some(n) => {
            let inner = read_match(&m.path("not"), n, false)?;
            if inner == Match::default() {
                return err(m.path("not"), "must hold at least one condition");
            }
            Some(Box::new(inner))
        }
    };
    Ok(Match {
        path,
        methods,
        headers,
        client_ip,
        not,
    })
}

fn parse_key_part(at: &str, p: &str) -> Result<KeyPart, ConfigError> {
    if let Some(lit) = p.strip_prefix("literal:") {
        if lit.len() > MAX_PART_BYTES {
            return err(at, "literal too long (at most 256 bytes)");
        }
        return Ok(KeyPart::Literal(lit.to_string()));
    }
    if let Some(h) = p.strip_prefix("header:") {
        return Ok(KeyPart::Header(header_name(at, h)?));
    }
    match p {
        "client_ip" => Ok(KeyPart::ClientIp),
        "path" => Ok(KeyPart::Path),
        "method" => Ok(KeyPart::Method),
        "authority" => Ok(KeyPart::Authority),
        _ => err(
            at,
            format!(
                "unknown key part {p:?} (expected literal:<text>, header:<name>, client_ip, path, method or authority)"
            ),
        ),
    }
}

const RESPONSE_FIELDS: &[&str] = &["status", "body", "content_type", "headers", "on_allowed"];

/// The denial response: each field given in `r`, else `base`'s (a rule's `response` over the
/// global one), else the default.
fn read_response(r: &Obj<'_>, base: Option<&Response>) -> Result<Response, ConfigError> {
    let status = r.int(
        "status",
        Some(base.map_or(429, |b| u64::from(b.status))),
        400,
        599,
    )? as u32;
    let body = match (r.string("body")?, base) {
        (Some(b), _) => b,
        (None, Some(b)) => b.body.clone(),
        (None, None) => "rate limited\n".to_string(),
    };
    if body.len() > 65_536 {
        return err(r.path("body"), "must be at most 65536 bytes");
    }
    let content_type = match (r.string("content_type")?, base) {
        (Some(c), _) => c,
        (None, Some(b)) => b.content_type.clone(),
        (None, None) => "text/plain".to_string(),
    };
    if content_type.is_empty() || !header_safe(&content_type) {
        return err(
            r.path("content_type"),
            "must be a non-empty printable header value",
        );
    }
    let mut headers = Vec::new();
    match r.array("headers")? {
        None => match base {
            Some(b) => headers.clone_from(&b.headers),
            None => headers.push(HeaderStyle::Draft),
        },
        Some(list) => {
            for (i, v) in list.iter().enumerate() {
                let style = choice_value(
                    &format!("{}[{i}]", r.path("headers")),
                    v,
                    &[
                        ("draft", HeaderStyle::Draft),
                        ("x-ratelimit", HeaderStyle::XRateLimit),
                    ],
                )?;
                if !headers.contains(&style) {
                    headers.push(style);
                }
            }
        }
    }
    let on_allowed = match (r.get("on_allowed"), base) {
        (None, Some(b)) => b.on_allowed,
        _ => r.boolean("on_allowed")?,
    };
    Ok(Response {
        status,
        body,
        content_type,
        headers,
        on_allowed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"{"service":{"cluster":"tollgate"},
        "rules":[{"name":"per-ip","key":["client_ip"],"capacity":100,"period_ms":60000}]}"#;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::parse(s.as_bytes())
    }

    fn error_of(s: &str) -> ConfigError {
        match parse(s) {
            Ok(_) => ConfigError {
                field: "<accepted>".into(),
                message: String::new(),
            },
            Err(e) => e,
        }
    }

    /// A full config with one substitution: `"rules":[R0, R1]` where R1 is given.
    fn with_rule1(rule1: &str) -> String {
        format!(
            r#"{{"service":{{"cluster":"c"}},"rules":[
              {{"name":"a","capacity":1,"period_ms":1000}}, {rule1}]}}"#
        )
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.service.authority, "tollgate");
        assert_eq!(c.service.transport, Transport::Http);
        assert_eq!(c.service.timeout_ms, 20);
        assert_eq!(c.service.path, "/v1/take");
        assert_eq!(c.service.token, None);
        assert_eq!(c.trusted_hops, 0);
        assert_eq!(c.failure_mode, FailureMode::Fallback);
        assert_eq!(
            c.fallback,
            Fallback {
                instances: 1,
                min_instances: 1,
                max_keys: 10_000,
                // 100 tokens at 100 per minute fill in a minute (+1 ms of rounding up).
                debt_horizon_ms: 60_001,
                previous_max_keys: [0; 3],
            }
        );
        assert_eq!(
            c.breaker,
            Breaker {
                failures: 5,
                open_ms: 250,
                max_open_ms: 5000
            }
        );
        assert!(!c.shadow);
        assert_eq!(c.response.status, 429);
        assert_eq!(c.response.body, "rate limited\n");
        assert_eq!(c.response.content_type, "text/plain");
        assert_eq!(c.response.headers, vec![HeaderStyle::Draft]);
        assert!(!c.response.on_allowed);
        let r = &c.rules[0];
        assert_eq!(r.rate, 100);
        assert_eq!(r.cost, Cost::Fixed(1));
        assert_eq!(r.algorithm, Algorithm::TokenBucket);
        assert_eq!(r.on_missing, OnMissing::Skip);
        assert_eq!(r.lease, None);
        assert!(c.needs_peer_address);
    }

    #[test]
    fn lease_defaults_and_bounds() {
        let c = parse(&with_rule1(
            r#"{"name":"b","capacity":50,"period_ms":1000,"lease":{"size":50}}"#,
        ))
        .unwrap();
        assert_eq!(
            c.rules[1].lease,
            Some(Lease {
                size: Some(50),
                max_age_ms: 1000
            })
        );
        let c = parse(&with_rule1(
            r#"{"name":"b","capacity":50,"period_ms":1000,"lease":{}}"#,
        ))
        .unwrap();
        assert_eq!(c.rules[1].lease.map(|l| l.size), Some(None), "adaptive");
        let c = parse(&with_rule1(
            r#"{"name":"b","capacity":50,"period_ms":1000,"lease":{"size":1,"max_age_ms":60000}}"#,
        ))
        .unwrap();
        assert_eq!(c.rules[1].lease.map(|l| l.max_age_ms), Some(60_000));
        assert_eq!(
            error_of(&with_rule1(
                r#"{"name":"b","capacity":50,"period_ms":1000,"lease":{"size":51}}"#
            ))
            .to_string(),
            "rules[1].lease.size: must be between 1 and 50"
        );
    }

    #[test]
    fn full_config_from_the_docs_parses() {
        let full = r#"{
          "service": {"cluster": "tollgate", "authority": "tollgate.local", "transport": "grpc",
                      "timeout_ms": 50, "path": "/v1/take", "token": "secret"},
          "trusted_hops": 1,
          "rules": [{
            "name": "per-ip",
            "match": {"path_prefix": "/api/", "methods": ["get", "POST"],
                      "headers": [{"name": "X-Tenant", "present": true}, {"name": "x-plan", "equals": "free"}]},
            "key": ["literal:api", "header:x-api-key", "client_ip", "path", "method", "authority"],
            "on_missing": "shared",
            "capacity": 100, "rate": 10, "period_ms": 60000,
            "cost": {"header": "x-cost", "default": 2, "max": 50},
            "algorithm": "fixed_window"
          }],
          "failure_mode": "deny",
          "fallback": {"instances": 3, "max_keys": 100},
          "breaker": {"failures": 3, "open_ms": 100, "max_open_ms": 1000},
          "shadow": true,
          "response": {"status": 503, "body": "slow down", "content_type": "text/html",
                       "headers": ["draft", "x-ratelimit"], "on_allowed": true}
        }"#;
        let c = parse(full).unwrap();
        assert_eq!(c.service.transport, Transport::Grpc);
        assert_eq!(c.service.token.as_deref(), Some("secret"));
        let shown = format!("{c:?}");
        assert!(!shown.contains("secret") && shown.contains("<redacted>"));
        let r = &c.rules[0];
        assert_eq!(r.matcher.methods, vec!["GET", "POST"]);
        assert_eq!(
            r.matcher.headers,
            vec![
                HeaderMatch::Present("x-tenant".into(), true),
                HeaderMatch::Equals("x-plan".into(), "free".into())
            ]
        );
        assert_eq!(r.key.len(), 6);
        assert_eq!(
            r.cost,
            Cost::Header {
                name: "x-cost".into(),
                default: 2,
                min: 1,
                max: 50
            }
        );
        assert_eq!(r.algorithm, Algorithm::FixedWindow);
        assert_eq!(c.failure_mode, FailureMode::Deny);
        assert_eq!(
            c.response.headers,
            vec![HeaderStyle::Draft, HeaderStyle::XRateLimit]
        );
        assert!(
            !c.needs_peer_address,
            "trusted_hops > 0 reads x-forwarded-for instead"
        );
    }

    #[test]
    fn an_empty_unknown_key_is_named() {
        let e = Config::parse(br#"{"service":{"cluster":"c"},"":[1]}"#).unwrap_err();
        assert_eq!(e.field, "\"\"");
    }

    #[test]
    fn errors_name_their_field() {
        let cases: Vec<(String, &str)> = vec![
            (with_rule1(r#"{"name":"b","capacity":0,"period_ms":1}"#), "rules[1].capacity"),
            (with_rule1(r#"{"name":"b","capacity":1000000001,"period_ms":1}"#), "rules[1].capacity"),
            (with_rule1(r#"{"name":"b","capacity":5,"rate":0,"period_ms":1}"#), "rules[1].rate"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":0}"#), "rules[1].period_ms"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":31536000001}"#), "rules[1].period_ms"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":0}"#), "rules[1].cost"),
            (with_rule1(r#"{"name":"a","capacity":5,"period_ms":1}"#), "rules[1].name"),
            (with_rule1(r#"{"name":"","capacity":5,"period_ms":1}"#), "rules[1].name"),
            (with_rule1(r#"{"name":"b c","capacity":5,"period_ms":1}"#), "rules[1].name"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"key":["cookie"]}"#), "rules[1].key[0]"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"key":["path","header:"]}"#), "rules[1].key[1]"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"key":["path","path","path","path","path","path","path","path","path"]}"#), "rules[1].key"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":{"path_exact":"/a","path_prefix":"/b"}}"#), "rules[1].match.path_prefix"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":{"path_exact":"a"}}"#), "rules[1].match.path_exact"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":{"methods":[]}}"#), "rules[1].match.methods"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":{"headers":[{"name":"x"}]}}"#), "rules[1].match.headers[0]"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":{"headers":[{"name":"x y","present":true}]}}"#), "rules[1].match.headers[0].name"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"header":"x","max":10,"default":11}}"#), "rules[1].cost.default"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"on_missing":"ignore"}"#), "rules[1].on_missing"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"algorithm":"leaky"}"#), "rules[1].algorithm"),
            (with_rule1(r#"{"name":"b","capacity":-5,"period_ms":1}"#), "rules[1].capacity"),
            (with_rule1(r#"{"name":"b","capacity":1.5,"period_ms":1}"#), "rules[1].capacity"),
            (with_rule1(r#"{"name":"b","period_ms":1}"#), "rules[1].capacity"),
            (with_rule1(r#"{"name":"b","capacity":"5","period_ms":1}"#), "rules[1].capacity"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"key":"path"}"#), "rules[1].key"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"key":[1]}"#), "rules[1].key[0]"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":"x"}"#), "rules[1].cost"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"max":3}}"#), "rules[1].cost.header"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"header":"x","min":4,"max":3}}"#), "rules[1].cost.min"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"header":"x","min":2,"default":1}}"#), "rules[1].cost.default"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"reserve":"all","max":3}}"#), "rules[1].cost.reserve"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"reserve":"max"}}"#), "rules[1].cost.max"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"reserve":"max","max":3,"header":"x"}}"#), "rules[1].cost.header"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"reserve":"max","max":3,"min":1}}"#), "rules[1].cost.min"),
            (with_rule1(r#"{"capacity":5,"period_ms":1}"#), "rules[1].name"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":{"size":6}}"#), "rules[1].lease.size"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":{"size":0}}"#), "rules[1].lease.size"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":{"size":"8"}}"#), "rules[1].lease.size"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":{"size":2,"max_age_ms":0}}"#), "rules[1].lease.max_age_ms"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":{"size":2,"max_age_ms":60001}}"#), "rules[1].lease.max_age_ms"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":{"size":2,"ttl":5}}"#), "rules[1].lease.ttl"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":50}"#), "rules[1].lease"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"reply"}"#), "rules[1].charge"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"usage":{"header":"x-u"}}"#), "rules[1].usage"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"body":false}}"#), "rules[1].usage.body"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"header":"a b"}}"#), "rules[1].usage.header"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"weights":{"prompt":1001}}}"#), "rules[1].usage.weights.prompt"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"weights":{"cached":1}}}"#), "rules[1].usage.weights.cached"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"max":0}}"#), "rules[1].usage.max"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"from":"body"}}"#), "rules[1].usage.from"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"cut":"seen"}}"#), "rules[1].usage.cut"),
            (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","lease":{}}"#), "rules[1].lease"),
            (r#"{"service":{"cluster":"c","transport":"rls","domain":"d"},"rules":[{"name":"a","capacity":1,"period_ms":1,"charge":"response"}]}"#.into(), "rules[0].charge"),
            (r#"[1]"#.into(), "config"),
            (r#"{"service":{"cluster":"c"},"rules":[{"name":"a","capacity":1,"period_ms":1}],"shadow":"yes"}"#.into(), "shadow"),
            (r#"{"service":{"cluster":"c"},"rules":[{"name":"a","capacity":1,"period_ms":1}],"response":{"on_allowed":1}}"#.into(), "response.on_allowed"),
            (r#"{"service":{"cluster":"c"},"rules":[]}"#.into(), "rules"),
            (r#"{"rules":[]}"#.into(), "service"),
            (r#"{"service":{"cluster":"c"}"#.into(), "config"),
            (r#"{"service":{"cluster":""},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "service.cluster"),
            (r#"{"service":{"cluster":"c","transport":"udp"},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "service.transport"),
            (r#"{"service":{"cluster":"c","timeout_ms":0},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "service.timeout_ms"),
            (r#"{"service":{"cluster":"c","path":"v1"},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "service.path"),
            (r#"{"service":{"cluster":"c","token":"a\nb"},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "service.token"),
            (r#"{"service":{"cluster":"c"},"trusted_hops":17,"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "trusted_hops"),
            (r#"{"service":{"cluster":"c"},"failure_mode":"open","rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "failure_mode"),
            (r#"{"service":{"cluster":"c"},"fallback":{"instances":0},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "fallback.instances"),
            (r#"{"service":{"cluster":"c"},"fallback":{"min_instances":0},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "fallback.min_instances"),
            (r#"{"service":{"cluster":"c"},"fallback":{"max_keys":0},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "fallback.max_keys"),
            (r#"{"service":{"cluster":"c"},"breaker":{"open_ms":0},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "breaker.open_ms"),
            (r#"{"service":{"cluster":"c"},"breaker":{"open_ms":100,"max_open_ms":50},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "breaker.max_open_ms"),
            (r#"{"service":{"cluster":"c"},"response":{"status":200},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "response.status"),
            (r#"{"service":{"cluster":"c"},"response":{"headers":["ietf"]},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "response.headers[0]"),
            (r#"{"service":{"cluster":"c"},"response":{"content_type":"a\r\nb: c"},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "response.content_type"),
        ];
        for (json, field) in cases {
            let e = error_of(&json);
            assert_eq!(e.field, field, "config {json}: got error `{e}`");
            assert!(!e.message.is_empty());
        }
    }

    #[test]
    fn a_rule_charged_by_the_response_reads_its_usage_as_configured() {
        let cfg = Config::parse(
            br#"{"service":{"cluster":"c"},"rules":[
                {"name":"a","capacity":10000,"period_ms":60000,"cost":{"header":"x-max-tokens","default":500,"max":4000},
                 "charge":"response","usage":{"header":"X-Tokens","weights":{"prompt":1,"completion":3},"max":8000,"cut":"reserved"}},
                {"name":"b","capacity":10,"period_ms":1000,"charge":"response"},
                {"name":"c","capacity":10,"period_ms":1000}]}"#,
        )
        .unwrap();
        let a = cfg.rules[0].charge.clone().unwrap();
        assert_eq!(a.header.as_deref(), Some("x-tokens"));
        assert!(a.body);
        assert_eq!(
            a.weights,
            Some(crate::core::usage::Weights {
                prompt: 1,
                completion: 3
            })
        );
        assert_eq!((a.max, a.cut), (8000, Cut::Reserved));
        let b = cfg.rules[1].charge.clone().unwrap();
        assert_eq!(
            (b.header, b.body, b.weights, b.max, b.cut),
            (None, true, None, MAX_AMOUNT, Cut::Bound)
        );
        assert_eq!(cfg.rules[2].charge, None);
    }

    #[test]
    fn a_reservation_is_a_floored_hint_or_the_rules_max() {
        let cfg = Config::parse(
            br#"{"service":{"cluster":"c"},"rules":[
                {"name":"a","capacity":10000,"period_ms":60000,"charge":"response",
                 "cost":{"header":"x-max-tokens","min":256,"max":4000}},
                {"name":"b","capacity":10000,"period_ms":60000,"charge":"response",
                 "cost":{"reserve":"max","max":4000}}]}"#,
        )
        .unwrap();
        assert_eq!(
            cfg.rules[0].cost,
            Cost::Header {
                name: "x-max-tokens".into(),
                default: 256,
                min: 256,
                max: 4000
            }
        );
        assert_eq!(cfg.rules[1].cost, Cost::Fixed(4000));
        assert_eq!(
            (cfg.rules[0].cost.bound(), cfg.rules[1].cost.bound()),
            (4000, 4000)
        );
    }

    #[test]
    fn unknown_fields_are_errors_that_name_them() {
        for (json, needle) in [
            (r#"{"service":{"cluster":"c"},"rulez":[]}"#, "rulez"),
            (
                r#"{"service":{"cluster":"c","timeout":5},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#,
                "timeout",
            ),
            (
                &with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"burst":3}"#)[..],
                "burst",
            ),
            (
                &with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":{"path":"/x"}}"#)[..],
                "path",
            ),
            (
                r#"{"service":{"cluster":"c"},"breaker":{"failure":3},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#,
                "failure",
            ),
        ] {
            let e = error_of(json);
            assert_ne!(e.field, "<accepted>", "{json} was accepted");
            assert!(e.to_string().contains(needle), "{json}: {e}");
        }
        let e = error_of(&with_rule1(
            r#"{"name":"b","capacity":5,"period_ms":1,"burst":3}"#,
        ));
        assert!(e.field.starts_with("rules[1]"), "{e}");
    }

    #[test]
    fn bounds_are_inclusive() {
        let c = parse(&with_rule1(
            r#"{"name":"b","capacity":1000000000,"rate":1000000000,"period_ms":31536000000,"cost":1000000000}"#,
        ))
        .unwrap();
        assert_eq!(c.rules[1].capacity, MAX_AMOUNT);
        assert_eq!(c.rules[1].period_ms, MAX_PERIOD_MS);
    }

    #[test]
    fn display_is_field_colon_message() {
        let e = error_of(&with_rule1(r#"{"name":"b","capacity":0,"period_ms":1}"#));
        assert_eq!(
            e.to_string(),
            "rules[1].capacity: must be between 1 and 1000000000"
        );
    }
}
