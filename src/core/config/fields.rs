//! The fields of every configuration section but a rule's own (`config::rules` has those): one
//! table per section, the top level, `service`, `fallback`, `breaker`, `response`, and the objects
//! inside a rule (`match`, `cost`, `lease`, `usage`, `tiers`, `overrides`, ...). A row is a field's
//! name, what its value is with its bounds, its default and one line of what it means.
//!
//! The reader reads a section by its table: a field not in it is refused as unknown, and a value
//! of the wrong type or out of the row's bounds is refused with the field named; a default not
//! given here (`IfAbsent::Derived`) is worked out by the reader from other fields, as the row's
//! line says. tests/docs.rs checks docs/filter-config.md against the tables (every section's
//! fields documented, and no other).
//!
//! The lines are left out of the module (`target_arch = "wasm32"`): only the tests read them.

use super::model::{
    DEFAULT_MAX_HELD, DEFAULT_MODEL_BODY_BYTES, MAX_AMOUNT, MAX_BATCH_TAKES, MAX_DELAY_MS,
    MAX_HELD, MAX_LEASE_AGE_MS, MAX_MODEL_BODY_BYTES, MAX_PERIOD_MS,
};

/// One field of a section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// Its name in the JSON.
    pub name: &'static str,
    /// What its value is.
    pub value: Value,
    /// Its value when absent.
    pub default: IfAbsent,
    /// What it means, in a line.
    #[cfg(not(target_arch = "wasm32"))]
    pub doc: &'static str,
}

/// What a field's value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value {
    /// An integer within `lo..=hi` (the reader may narrow them by other fields: the line says so).
    /// The low bounds and the defaults are small: `u32` keeps a row at 32 bytes in the module.
    Int(u32, u64),
    /// `true` or `false`.
    Bool,
    /// A string.
    Text,
    /// One of these names.
    Choice(&'static [&'static str]),
    /// A number within 0..=1.
    Fraction,
    /// An object, read by its own table.
    Object,
    /// A list.
    List,
}

/// A field's value when it is absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfAbsent {
    /// None: the field must be given.
    Required,
    /// Nothing: the setting is off, or empty.
    Nothing,
    /// This integer.
    Int(u32),
    /// This boolean.
    Bool(bool),
    /// This string, or this name of a [`Value::Choice`].
    Text(&'static str),
    /// Worked out by the reader from other fields (the line says how).
    Derived,
}

// `usage.max` defaults to the largest amount, which a default's `u32` holds.
const _: () = assert!(MAX_AMOUNT <= u32::MAX as u64);

/// A row of a table (`doc` is left out of the module).
macro_rules! field {
    ($name:literal, $value:expr, $default:expr, $doc:literal) => {
        Field {
            name: $name,
            value: $value,
            default: $default,
            #[cfg(not(target_arch = "wasm32"))]
            doc: $doc,
        }
    };
}

use IfAbsent::{Derived, Nothing, Required};
use Value::{Bool, Choice, Fraction, List, Object, Text};

/// The top level.
#[rustfmt::skip]
pub const ROOT: &[Field] = &[
    field!("service", Object, Required, "the decision service"),
    field!("trusted_hops", Value::Int(0, 16), IfAbsent::Int(0), "x-forwarded-for entries written by trusted proxies"),
    field!("rules", List, Required, "what is limited, 1..=16 rules"),
    field!("failure_mode", Choice(&["fallback", "allow", "deny"]), IfAbsent::Text("fallback"), "what decides when the service cannot"),
    field!("fallback", Object, Derived, "the local fallback shares"),
    field!("breaker", Object, Derived, "the circuit breaker"),
    field!("shadow", Bool, IfAbsent::Bool(false), "evaluate and count, never deny"),
    field!("response", Object, Derived, "the denial"),
    field!("near_limit", Fraction, Derived, "the used share of a bucket counted as near its limit (0.8)"),
    field!("model", Object, Nothing, "where a request's model is read: a header, or its JSON body"),
];

/// `model`: where the model a request asks for is read (the key part `model`, `usage.prices`).
#[rustfmt::skip]
pub const MODEL: &[Field] = &[
    field!("header", Text, Nothing, "a request header a gateway set (lower case)"),
    field!("metadata", List, Nothing, "dynamic metadata a filter in front wrote: its namespace, then 1..=4 field names"),
    field!("body", Bool, IfAbsent::Bool(false), "the JSON body's top-level `model`, read as the body arrives"),
    field!("max_body_bytes", Value::Int(1, MAX_MODEL_BODY_BYTES), IfAbsent::Int(DEFAULT_MODEL_BODY_BYTES as u32), "the most of the body read for it"),
];

/// `service`.
#[rustfmt::skip]
pub const SERVICE: &[Field] = &[
    field!("cluster", Text, Required, "Envoy cluster of the service"),
    field!("authority", Text, Derived, ":authority of the callout (the cluster name)"),
    field!("transport", Choice(&["http", "grpc", "rls"]), IfAbsent::Text("grpc"), "how the filter talks to the service"),
    field!("timeout_ms", Value::Int(1, 60_000), IfAbsent::Int(20), "callout timeout"),
    field!("path", Text, IfAbsent::Text("/v1/take"), "request path (transport http)"),
    field!("token", Text, Nothing, "the bearer token sent with callouts"),
    field!("domain", Text, Nothing, "the RLS domain (required with transport rls, only with it)"),
    field!("batch", Value::Int(0, MAX_BATCH_TAKES as u64), Derived, "most takes in a batch callout (64 where the transport batches, else 0)"),
    field!("stream", Bool, Derived, "takes as messages on a stream (true where the transport streams, else false)"),
    field!("remember_denials_ms", Value::Int(0, MAX_REMEMBER_DENIALS_MS), Derived, "how long a denial is remembered (1000 where the transport allows it, else 0)"),
    field!("trace", Bool, IfAbsent::Bool(false), "forward a sampled request's traceparent"),
];

/// `fallback`.
#[rustfmt::skip]
pub const FALLBACK: &[Field] = &[
    field!("instances", Value::Int(1, 10_000), IfAbsent::Int(1), "proxies sharing the limit, until the service reports the count"),
    field!("max_keys", Value::Int(1, 1_000_000), IfAbsent::Int(10_000), "slots in the fallback and lease tables"),
    field!("min_instances", Value::Int(1, 10_000), IfAbsent::Int(1), "the floor of the proxy count"),
];

/// `breaker`.
#[rustfmt::skip]
pub const BREAKER: &[Field] = &[
    field!("failures", Value::Int(0, 10_000), IfAbsent::Int(5), "consecutive failed callouts that open it (0: never)"),
    field!("open_ms", Value::Int(1, 3_600_000), IfAbsent::Int(250), "how long it stays open the first time"),
    field!("max_open_ms", Value::Int(1, 3_600_000), Derived, "the longest interval, at least open_ms (max(5000, open_ms))"),
];

/// `response`, and a rule's (whose defaults are the global `response`'s).
#[rustfmt::skip]
pub const RESPONSE: &[Field] = &[
    field!("status", Value::Int(400, 599), IfAbsent::Int(429), "status of a denial"),
    field!("body", Text, IfAbsent::Text("rate limited\n"), "body of a denial, at most 65536 bytes"),
    field!("content_type", Text, IfAbsent::Text("text/plain"), "its content-type"),
    field!("headers", List, Derived, "rate limit header styles, of \"draft\", \"x-ratelimit\" ([\"draft\"])"),
    field!("on_allowed", Bool, IfAbsent::Bool(false), "the headers on allowed requests too"),
];

/// A rule's `match`; its `not` holds the same fields but `not`.
#[rustfmt::skip]
pub const MATCH: &[Field] = &[
    field!("path_exact", Text, Nothing, "the path equals this"),
    field!("path_prefix", Text, Nothing, "the path starts with this"),
    field!("methods", List, Nothing, "the method is one of these"),
    field!("headers", List, Nothing, "header conditions"),
    field!("client_ip", List, Nothing, "the client is in one of these networks"),
    field!("not", Object, Nothing, "conditions that must not all hold"),
];

/// The fields of a `match`'s `not`.
pub const NOT: &[Field] = MATCH.split_at(MATCH.len() - 1).0;

/// An entry of a `match`'s `headers`.
#[rustfmt::skip]
pub const HEADER_MATCH: &[Field] = &[
    field!("name", Text, Required, "the header"),
    field!("present", Bool, Nothing, "it is present, or absent"),
    field!("equals", Text, Nothing, "its first value equals this"),
];

/// A rule's `cost` as an object.
#[rustfmt::skip]
pub const COST: &[Field] = &[
    field!("header", Text, Derived, "the header holding the cost (a hint)"),
    field!("default", Value::Int(1, MAX_AMOUNT), Derived, "the cost without the header, within min..=max (min)"),
    field!("min", Value::Int(1, MAX_AMOUNT), IfAbsent::Int(1), "the floor of the cost, at most max"),
    field!("max", Value::Int(1, MAX_AMOUNT), Derived, "the ceiling of the cost (the rule's capacity; required with reserve max)"),
    field!("reserve", Choice(&["hint", "max"]), IfAbsent::Text("hint"), "what a request reserves: the header's hint, or max"),
];

/// A rule's `lease`.
#[rustfmt::skip]
pub const LEASE: &[Field] = &[
    field!("size", Value::Int(1, MAX_AMOUNT), Nothing, "most tokens a proxy holds for a key, at most the capacity (adaptive)"),
    field!("max_age_ms", Value::Int(1, MAX_LEASE_AGE_MS), IfAbsent::Int(1000), "how long granted tokens may be spent"),
];

/// A rule's `shape` (token buckets only).
#[rustfmt::skip]
pub const SHAPE: &[Field] = &[
    field!("max_delay_ms", Value::Int(1, MAX_DELAY_MS), Required, "the longest a request is held for its token; a take that would wait longer is refused at once"),
    field!("max_held", Value::Int(1, MAX_HELD), IfAbsent::Int(DEFAULT_MAX_HELD), "the most requests of the rule one worker holds at once; beyond it a take is refused when it cannot pay now"),
];

/// A rule's `usage` (with `"charge": "response"`).
#[rustfmt::skip]
pub const USAGE: &[Field] = &[
    field!("header", Text, Nothing, "a response header reporting the usage"),
    field!("body", Bool, IfAbsent::Bool(true), "read the usage an LLM response body reports"),
    field!("weights", Object, Nothing, "the price of a token of each kind"),
    field!("prices", Object, Nothing, "per model (the request's `model`), the price of a token of each kind, as `weights`"),
    field!("max", Value::Int(1, MAX_AMOUNT), IfAbsent::Int(MAX_AMOUNT as u32), "the most a response is charged"),
    field!("cut", Choice(&["bound", "reserved"]), IfAbsent::Text("bound"), "what a response cut off is charged"),
];

/// A rule's `usage.weights`.
#[rustfmt::skip]
pub const WEIGHTS: &[Field] = &[
    field!("prompt", Value::Int(0, MAX_WEIGHT), IfAbsent::Int(1), "the price of a prompt token"),
    field!("completion", Value::Int(0, MAX_WEIGHT), IfAbsent::Int(1), "the price of a completion token"),
];

/// A rule's `from_request`: which parts of its limit a trusted filter in front sets.
#[rustfmt::skip]
pub const FROM_REQUEST: &[Field] = &[
    field!("capacity", Object, Nothing, "where the bucket's capacity is read (the rule's when absent)"),
    field!("rate", Object, Nothing, "where its rate is read (the rule's, or the capacity read when the rule has no rate)"),
    field!("cost", Object, Nothing, "where a request's cost is read (the rule's fixed cost when absent)"),
];

/// A number read from the request (`from_request.capacity`, `.rate`, `.cost`).
#[rustfmt::skip]
pub const ATTRIBUTE: &[Field] = &[
    field!("header", Text, Nothing, "a request header a trusted filter set (exactly one of header and metadata)"),
    field!("metadata", List, Nothing, "dynamic metadata: the filter's namespace, then 1..=4 field names into its struct"),
    field!("min", Value::Int(1, MAX_AMOUNT), IfAbsent::Int(1), "the lowest value used, at most max"),
    field!("max", Value::Int(1, MAX_AMOUNT), Required, "the highest value used"),
];

/// A rule's `tiers`.
#[rustfmt::skip]
pub const TIERS: &[Field] = &[
    field!("header", Text, Derived, "the header naming the tier"),
    field!("limits", Object, Required, "tier name -> limit"),
];

/// An entry of a rule's `overrides`: the condition, then the limit (the fields of a tier's limit,
/// [`LIMIT`]).
#[rustfmt::skip]
pub const OVERRIDE: &[Field] = &[
    field!("key_part", Text, Derived, "the key part the condition reads"),
    field!("value", Text, Nothing, "the part equals this"),
    field!("prefix", Text, Nothing, "the part starts with this"),
    field!("cidr", Text, Nothing, "the client_ip part is in this network"),
    field!("unlimited", Bool, IfAbsent::Bool(false), "no bucket for such a request"),
    field!("capacity", Value::Int(1, MAX_AMOUNT), Derived, "the limit's capacity (required unless unlimited)"),
    field!("rate", Value::Int(1, MAX_AMOUNT), Derived, "its rate (the capacity)"),
    field!("period_ms", Value::Int(1, MAX_PERIOD_MS), Derived, "its period (the rule's)"),
];

/// A limit of a rule's `tiers`: the limit fields of [`OVERRIDE`].
pub const LIMIT: &[Field] = OVERRIDE.split_at(4).1;

/// An entry of a rule's `descriptor`.
#[rustfmt::skip]
pub const DESCRIPTOR: &[Field] = &[
    field!("key", Text, Required, "the entry's key, 1..=256 bytes"),
    field!("value", Text, Required, "where its value comes from, as a key part"),
];

/// Largest price of one prompt or completion token (`usage.weights`).
pub const MAX_WEIGHT: u64 = 1000;

/// How long a denial is remembered at most by default (`service.remember_denials_ms`): short
/// enough that a bucket reset or a refund is seen within a second, long enough that a flood of
/// denied requests costs about one callout per key and second.
pub const DEFAULT_REMEMBER_DENIALS_MS: u64 = 1000;
/// The longest `service.remember_denials_ms`.
pub const MAX_REMEMBER_DENIALS_MS: u64 = 60_000;

/// The row of `table` named `name`.
pub fn find(table: &'static [Field], name: &str) -> Option<&'static Field> {
    table.iter().find(|f| f.name == name)
}

/// The names of `table`'s fields, in order.
pub fn names(table: &[Field]) -> impl Iterator<Item = &'static str> + '_ {
    table.iter().map(|f| f.name)
}
