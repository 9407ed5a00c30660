//! A take and its answer (contract/README.md, "Request", "Response", "Batches"): the messages both
//! sides speak, whatever the encoding ([`crate::json`], [`crate::proto`]).

use crate::calendar::Calendar;
use crate::Algorithm;

/// One bucket of a take, as a caller sends it. Absent optional fields are not encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Bucket identity, 1..=4096 bytes of UTF-8.
    pub key: String,
    /// Burst size, 1..=1e9.
    pub capacity: u64,
    /// Tokens added per period; `None` = capacity.
    pub rate: Option<u64>,
    /// Period length in ms, 1..=one year.
    pub period_ms: u64,
    /// Tokens to take; `None` = 1.
    pub cost: Option<u64>,
    /// `None` = the default algorithm (token bucket).
    pub algorithm: Option<Algorithm>,
    /// Lease mode: take up to this many tokens at once (`cost..=1e9`); `None` = exactly `cost`.
    pub lease: Option<u64>,
    /// Shaping (token bucket only): a take this bucket cannot pay now but can within this many
    /// ms is granted for the moment its tokens will be there (`delay_ms` of its result);
    /// `0..=`[`crate::bounds::MAX_DELAY_MS`]; 0 = no shaping (not encoded).
    pub max_delay_ms: u64,
    /// A calendar window's period and zone (algorithm `calendar_window`, and only then).
    pub calendar: Option<Calendar>,
}

impl Bucket {
    /// Tokens this take costs the bucket: `cost`, or 1 when it is absent.
    pub fn cost(&self) -> u64 {
        self.cost.unwrap_or(1)
    }

    /// Tokens added per period: `rate`, or `capacity` when it is absent.
    pub fn rate(&self) -> u64 {
        self.rate.unwrap_or(self.capacity)
    }
}

/// A take: charge every bucket, or none.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TakeRequest {
    /// 1..=16 buckets.
    pub buckets: Vec<Bucket>,
}

/// Who sends a take: what the message carries besides its buckets.
#[derive(Debug, Clone, Copy)]
pub struct Sender<'a> {
    /// The calling proxy's instance id (`instance`), counted among the live instances.
    pub instance: Option<&'a str>,
    /// The rule name a bucket is sent with (`rule`, for the service's metrics), if any.
    pub rule: fn(&Bucket) -> Option<&str>,
}

impl Sender<'_> {
    /// A sender that adds nothing: no instance id, no rule names.
    pub const ANONYMOUS: Sender<'static> = Sender {
        instance: None,
        rule: no_rule,
    };
}

fn no_rule(_: &Bucket) -> Option<&str> {
    None
}

/// The answer for one bucket, in the contract's units. With the `serde` feature its serde form is
/// the JSON form of a bucket result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields)
)]
pub struct BucketResult {
    /// This bucket alone could pay its cost.
    pub allowed: bool,
    /// The bucket's capacity.
    pub limit: u64,
    /// Whole tokens left after this bucket's own charge when it could pay (even if another bucket
    /// denied the request and nothing was charged in the end); otherwise as the bucket stands.
    pub remaining: u64,
    /// Milliseconds until the bucket is full again (token bucket) or the window ends (fixed window).
    pub reset_ms: u64,
    /// When this bucket denied: milliseconds until it could pay its cost (an upper bound, rounded
    /// up); 0 when it allowed. A cost above capacity can never be paid: then it is `period_ms`.
    /// Times are clamped to 2^53 - 1 ms so both stores answer the same exact integers.
    pub retry_after_ms: u64,
    /// Tokens charged to this bucket by this decision: 0 when the request was denied, `cost`
    /// without a lease, `cost..=lease` with one (0 from a service that predates lease mode).
    pub granted: u64,
    /// Shaping: ms from the decision until this bucket's tokens are there (rounded up, at most its
    /// `max_delay_ms`); 0 when it could pay at once, when it denied, and from a service that
    /// predates shaping (not encoded when 0).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "is_zero"))]
    pub delay_ms: u64,
    /// The window a window algorithm charged (a fixed or sliding window's index, a calendar
    /// window's first millisecond): what a settle of this take names as its `window` so that a
    /// refund finds it. 0 (not encoded) for a token bucket, a denial, and from a service that
    /// predates it.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "is_zero"))]
    pub window: u64,
}

/// The answer to a take. With the `serde` feature its serde form is the JSON response body of
/// `POST /v1/take`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields)
)]
pub struct TakeResponse {
    /// Every bucket could pay and all were charged; `false`: none was charged.
    pub allowed: bool,
    /// One result per request bucket, in request order.
    pub buckets: Vec<BucketResult>,
    /// Live proxy instances of the deployment, as the service last counted them (contract/README.md,
    /// "Instances"); 0 (not encoded) when none is known.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "is_zero"))]
    pub instances: u64,
    /// Shaping: how long the request is held before it goes, the largest `delay_ms` of its
    /// buckets; 0 (not encoded) when it may go at once or was denied.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "is_zero"))]
    pub delay_ms: u64,
}

/// serde's `skip_serializing_if` for counts that are left out when 0 (here and in `settle`).
#[cfg(feature = "serde")]
pub(crate) fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl TakeResponse {
    /// The answer from per-bucket results: allowed only if every bucket allowed. A denied take
    /// charged nothing, so every `granted` and `delay_ms` is then 0; an allowed one is held for
    /// the largest of its buckets' delays.
    pub fn from_buckets(mut buckets: Vec<BucketResult>) -> Self {
        let allowed = !buckets.is_empty() && buckets.iter().all(|b| b.allowed);
        if !allowed {
            for b in &mut buckets {
                b.granted = 0;
                b.delay_ms = 0;
                b.window = 0;
            }
        }
        let delay_ms = buckets.iter().map(|b| b.delay_ms).max().unwrap_or(0);
        TakeResponse {
            allowed,
            buckets,
            instances: 0,
            delay_ms,
        }
    }
}

/// The answer to a batch: one [`TakeResponse`] per take, in the batch's order. With the `serde`
/// feature its serde form is the JSON response body of `POST /v1/take_batch`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields)
)]
pub struct BatchResponse {
    /// One result per take, in request order.
    pub results: Vec<TakeResponse>,
}

/// The answer to one message of a TakeStream (contract/README.md, "Batches on a stream"): the
/// message's id and its results, one per take in order, or why it was not decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamAnswer {
    /// The id of the message this answers (0 from a service that predates ids).
    pub id: u64,
    /// The message's results, or its error (the stream goes on).
    pub answer: Result<Vec<TakeResponse>, MessageError>,
}

/// Why one message of a TakeStream was not decided: the status a TakeBatch call with it would have
/// ended with.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MessageError {
    /// The gRPC status code (3 invalid, 4 deadline exceeded, 8 too large, 14 unavailable).
    pub code: u32,
    /// For people; not to be matched.
    pub message: String,
    /// An invalid message: the field named from the batch (`takes[3].buckets[0].capacity`).
    pub field: String,
}

/// A body that is not a valid answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DecodeError {}
