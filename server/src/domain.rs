//! The domain, below everything else: what a store is asked (validated buckets, settlements and
//! slots), what it answers (the contract's messages, under the contract's names), the contract's
//! bounds, and the error of a rejected request.
//!
//! Each operation (`ops/`) decodes its request from either wire form and validates it into these
//! types; only validated values ever reach a store, so a bad request can never write anything.

use std::fmt;

/// The contract's bounds and algorithms (contract/README.md), from the contract crate.
pub use contract::bounds::{
    BUCKET_OVERHEAD_BYTES, MAX_AMOUNT, MAX_BATCH_BYTES, MAX_BATCH_TAKES, MAX_BUCKETS, MAX_DELAY_MS,
    MAX_INSTANCE_BYTES, MAX_KEY_BYTES, MAX_PERIOD_MS, MAX_RULE_BYTES, MAX_SETTLE_ID_BYTES,
    MAX_TAKE_BYTES, SETTLE_ID_TTL_MS,
};
pub use contract::Algorithm;

/// One validated bucket of a take: every field is within the contract's bounds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BucketSpec {
    /// Bucket identity, 1..=4096 bytes.
    pub key: String,
    /// Burst size, 1..=1e9.
    pub capacity: u64,
    /// Tokens added per period, 1..=1e9 (equal to capacity when the caller left it out).
    pub rate: u64,
    /// Period length in milliseconds, 1..=one year.
    pub period_ms: u64,
    /// Tokens this request takes, 1..=1e9. Above capacity it is denied, never an error.
    pub cost: u64,
    /// Counting scheme.
    pub algorithm: Algorithm,
    /// Lease mode: take up to this many tokens (cost..=1e9) when the request is allowed, as many as
    /// the bucket holds but never fewer than `cost`. Equal to `cost` when the caller left it out.
    pub lease: u64,
    /// Shaping (token bucket only): a take whose tokens are there within this many ms is granted
    /// with that `delay_ms` (contract/README.md, "Shaping"); 0..=[`MAX_DELAY_MS`], 0 = none.
    pub max_delay_ms: u64,
}

/// The answer for one bucket, for a take, and for a batch: the contract's messages, whose serde
/// forms are the JSON bodies (the protobuf ones are mapped in `api::grpc`).
pub use contract::take::{BatchResponse, BucketResult, TakeResponse};

/// The contract's slot bounds: longest deadline (one day), longest slot id, and what a denial
/// suggests waiting at most.
pub use contract::bounds::{MAX_SLOT_BYTES, MAX_SLOT_TTL_MS, SLOT_DENIED_RETRY_MS};

/// The answers to an acquire (per key, and in all) and to a release: the contract's, whose serde
/// forms are the JSON response bodies of `POST /v1/acquire` and `POST /v1/release`.
pub use contract::slots::{AcquireResponse, ReleaseResponse, SlotResult};

/// One validated key of an acquire (concurrency slots, contract/README.md "Acquire and release").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotSpec {
    /// The key, 1..=4096 bytes; distinct from the other keys of the acquire.
    pub key: String,
    /// Most slots held at once for this key, 1..=1e9.
    pub limit: u64,
    /// The slot's deadline from now, 1..=[`MAX_SLOT_TTL_MS`] ms.
    pub ttl_ms: u64,
}

/// The delay a denied slot key suggests: [`SLOT_DENIED_RETRY_MS`], or sooner when the oldest
/// slot's deadline (`earliest_left_ms` from now) is sooner.
pub fn slot_retry_after(earliest_left_ms: Option<u64>) -> u64 {
    earliest_left_ms.map_or(SLOT_DENIED_RETRY_MS, |ms| ms.clamp(1, SLOT_DENIED_RETRY_MS))
}

/// Checks an instance id: 1..=[`MAX_INSTANCE_BYTES`] bytes of `A-Z a-z 0-9 . _ : -`.
pub fn check_instance(field: &str, id: Option<&str>) -> Result<(), InvalidArgument> {
    let Some(id) = id else { return Ok(()) };
    if id.is_empty() || id.len() > MAX_INSTANCE_BYTES {
        return Err(InvalidArgument::new(
            field,
            format!("must be 1..={MAX_INSTANCE_BYTES} bytes, got {}", id.len()),
        ));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b".-_:".contains(&b))
    {
        return Err(InvalidArgument::new(
            field,
            "may hold only letters, digits, '.', '_', ':' and '-'",
        ));
    }
    Ok(())
}

/// A rejected request: which field, and why. Becomes 400 / `INVALID_ARGUMENT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidArgument {
    /// The offending field, e.g. `buckets[0].capacity` (empty when the body as a whole is bad).
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl InvalidArgument {
    /// A new error about `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        InvalidArgument {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for InvalidArgument {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

impl std::error::Error for InvalidArgument {}

impl InvalidArgument {
    /// The same error about take `i` of a batch: `buckets[0].key` becomes
    /// `takes[i].buckets[0].key`, and an error about the take as a whole, `takes[i]`.
    pub fn within_take(self, i: usize) -> Self {
        let field = if self.field.is_empty() {
            format!("takes[{i}]")
        } else {
            format!("takes[{i}].{}", self.field)
        };
        InvalidArgument { field, ..self }
    }
}

/// One validated bucket of a settle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettleSpec {
    /// The bucket, validated as a take's (`cost` and `lease` are 1 and mean nothing here).
    pub bucket: BucketSpec,
    /// Tokens charged at the request, 0..=1e9.
    pub estimate: u64,
    /// Tokens actually used, 0..=1e9.
    pub used: u64,
    /// Fixed windows only: the window the estimate was charged in, if known.
    pub window: Option<u64>,
}

/// A validated settle: its id and buckets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    /// 1..=[`MAX_SETTLE_ID_BYTES`] printable ASCII characters (no space).
    pub id: String,
    /// 1..=[`MAX_BUCKETS`] buckets, settled in order.
    pub buckets: Vec<SettleSpec>,
}

/// The answers to a settle: the contract's.
pub use contract::settle::{SettleResponse, SettleResult};

/// A rate bucket as it stands, read on the store's clock without changing it (`GET /v1/buckets`,
/// `ops/buckets.rs`). A bucket that is not stored reads as a new one: full, owing nothing.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BucketState {
    /// Whether the store holds the bucket (false: never charged, or expired, so full).
    pub exists: bool,
    /// Whole tokens a take could use now (a window: capacity minus its count; 0 while it owes).
    pub remaining: u64,
    /// Whole tokens owed (a token bucket below zero, a window counted above its capacity).
    pub debt: u64,
    /// Tokens or requests counted against the limit now: `capacity - remaining + debt`.
    pub used: u64,
    /// Milliseconds until the bucket is full again (a token bucket) or its window ends.
    pub reset_ms: u64,
    /// A calendar window's period now, on the service's clock (absent for other algorithms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period: Option<Period>,
}

/// A calendar window's period: its bounds in ms since the epoch and as RFC 3339 in its zone.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Period {
    /// Its first millisecond.
    pub start_ms: u64,
    /// Its end (the next period's first millisecond).
    pub end_ms: u64,
    /// `start_ms` in the window's zone, e.g. `2026-12-01T00:00:00+01:00`.
    pub start: String,
    /// `end_ms` likewise.
    pub end: String,
}

impl BucketState {
    /// The state of a bucket of `capacity` that holds `held` (remaining and debt) and is full
    /// again (or its window ends) in `reset_ms`.
    pub fn new(exists: bool, capacity: u64, held: SettleResult, reset_ms: u64) -> Self {
        BucketState {
            exists,
            remaining: held.remaining,
            debt: held.debt,
            used: capacity
                .saturating_sub(held.remaining)
                .saturating_add(held.debt),
            reset_ms,
            period: None,
        }
    }
}

/// A key's concurrency slots as they stand, read on the store's clock without changing them.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SlotsState {
    /// Live slots (deadline not passed).
    pub in_flight: u64,
    /// Milliseconds until each live slot's deadline, soonest first; at most
    /// [`MAX_LISTED_SLOTS`] listed (`in_flight` counts them all).
    pub deadlines_ms: Vec<u64>,
}

/// Most slot deadlines one inspection lists.
pub const MAX_LISTED_SLOTS: usize = 100;

/// What a reset deletes: every key of one bucket (`POST /v1/buckets/reset`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResetTarget {
    /// A rate bucket: its algorithm and key.
    Bucket(Algorithm, String),
    /// A concurrency key's slot set (its live slots and the names released early).
    Slots(String),
}
