//! The JSON field names of the contract's messages: the encoders write them and the service's
//! decoders accept exactly them (any other name is refused, so a typo never changes a limit).

/// A take's list of buckets; an answer's list of bucket results.
pub const BUCKETS: &str = "buckets";
/// A batch's list of takes.
pub const TAKES: &str = "takes";
/// A batch answer's list of take answers.
pub const RESULTS: &str = "results";
/// The calling proxy's instance id (a take, a batch).
pub const INSTANCE: &str = "instance";
/// A bucket's key.
pub const KEY: &str = "key";
/// A bucket's capacity.
pub const CAPACITY: &str = "capacity";
/// A bucket's refill per period.
pub const RATE: &str = "rate";
/// A bucket's period.
pub const PERIOD_MS: &str = "period_ms";
/// What a take charges a bucket.
pub const COST: &str = "cost";
/// A bucket's algorithm (its JSON name, [`crate::Algorithm::name`]).
pub const ALGORITHM: &str = "algorithm";
/// Lease mode: the most a take may charge a bucket.
pub const LEASE: &str = "lease";
/// The rule a bucket belongs to (metrics only).
pub const RULE: &str = "rule";
/// Shaping: the longest a take may wait for its tokens (a bucket).
pub const MAX_DELAY_MS: &str = "max_delay_ms";
/// Shaping: how long a granted take waits for its tokens (a bucket result, an answer).
pub const DELAY_MS: &str = "delay_ms";
/// A calendar window's unit (`day`, `week`, `month`, `year`).
pub const CALENDAR: &str = "calendar";
/// A calendar window's zone.
pub const TIME_ZONE: &str = "time_zone";

/// The fields of a take's bucket, in the order the encoders write them.
pub const TAKE_BUCKET: [&str; 11] = [
    KEY,
    CAPACITY,
    RATE,
    PERIOD_MS,
    COST,
    ALGORITHM,
    LEASE,
    MAX_DELAY_MS,
    CALENDAR,
    TIME_ZONE,
    RULE,
];
/// The fields of a take.
pub const TAKE: [&str; 2] = [BUCKETS, INSTANCE];
/// The fields of a batch of takes.
pub const BATCH: [&str; 2] = [TAKES, INSTANCE];

/// An answer: every bucket could pay.
pub const ALLOWED: &str = "allowed";
/// An answer: the live instances.
pub const INSTANCES: &str = "instances";
/// A bucket result: the capacity.
pub const LIMIT: &str = "limit";
/// A bucket result: whole tokens left.
pub const REMAINING: &str = "remaining";
/// A bucket result: ms until full, or until the window ends.
pub const RESET_MS: &str = "reset_ms";
/// A bucket result: ms until it could pay.
pub const RETRY_AFTER_MS: &str = "retry_after_ms";
/// A bucket result: tokens charged.
pub const GRANTED: &str = "granted";

/// An acquire key's deadline.
pub const TTL_MS: &str = "ttl_ms";
/// The id of held slots (an acquire's answer, a release).
pub const SLOT: &str = "slot";
/// A release's keys.
pub const KEYS: &str = "keys";
/// A slot result: the key's live slots.
pub const IN_FLIGHT: &str = "in_flight";
/// A release's answer: per key, whether the slot was still held.
pub const RELEASED: &str = "released";

/// A settle's id (and its answer's `duplicate`), and a settle bucket's amounts.
pub const ID: &str = "id";
/// Tokens the take charged (a settle bucket).
pub const ESTIMATE: &str = "estimate";
/// Tokens the response used (a settle bucket).
pub const USED: &str = "used";
/// The window a window algorithm's estimate was charged in (a settle bucket).
pub const WINDOW: &str = "window";
/// The settle's id had been applied before.
pub const DUPLICATE: &str = "duplicate";
/// Tokens a bucket owes after a settle.
pub const DEBT: &str = "debt";
/// The fields a settle's bucket may carry.
pub const SETTLE_BUCKET: [&str; 11] = [
    KEY, CAPACITY, RATE, PERIOD_MS, ALGORITHM, RULE, ESTIMATE, USED, WINDOW, CALENDAR, TIME_ZONE,
];
/// The fields of a settle.
pub const SETTLE: [&str; 2] = [ID, BUCKETS];
