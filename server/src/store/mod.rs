//! Where buckets live. Handlers speak to a [`Store`] in domain terms and never see Redis types.
//!
//! | file | what |
//! |---|---|
//! | `algorithm/` | one module per algorithm behind one trait: its arithmetic (the memory store's, the reference), its Lua, its key tag and script code |
//! | `memory.rs` | in-process store: one mutex, monotonic clock, idle buckets expire |
//! | `redis/` | Redis standalone, Cluster or Sentinel: the store (`mod.rs`: slot grouping, refunds), where Redis is and TLS (`conn.rs`), the connection (`link.rs`), the master the sentinels name (`sentinel.rs`), scripts and their arguments (`scripts.rs`), the takes as one Redis Functions library (`library.rs`), a reply's integers (`reply.rs`), replies into decisions (`decode.rs`) |
//! | `coalesce.rs` | a wrapper that sends concurrent takes to the store as one batch call |
//! | `keys.rs` | Redis key layout and hash slots (pure) |
//! | `slots.rs` | concurrency slots: the memory store's table (the reference) and the glue of `acquire.lua` / `release.lua` |
//! | `lua/*.lua` | the scripts: the prelude, one file per algorithm (each owned by its module in `algorithm/`), the decision of one take (`take_one.lua`), and the take, batch, refund, settle and inspect drivers, which reach an algorithm only through the prelude's `ALGORITHMS` table; `reset.lua` deletes one bucket's key |

pub mod algorithm;
pub mod coalesce;
pub mod keys;
pub mod memory;
pub mod redis;
pub mod slots;

use crate::domain::{
    AcquireResponse, BucketSpec, BucketState, ResetTarget, SettleResponse, Settlement, SlotSpec,
    SlotsState, TakeResponse,
};

/// A store failure. Every one of them becomes 503 / gRPC `UNAVAILABLE`: the service never answers
/// "allowed" when it could not decide.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// No answer within the configured timeout.
    #[error("store timed out after {0} ms")]
    Timeout(u64),
    /// Could not connect, or the connection broke.
    #[error("store unreachable: {0}")]
    Connection(String),
    /// The store answered with an error (e.g. a script error, OOM, cluster down).
    #[error("store error: {0}")]
    Server(String),
    /// The store answered something the service cannot read.
    #[error("unexpected store reply: {0}")]
    Protocol(String),
    /// The memory store holds its maximum number of buckets and this take needs a new one.
    #[error("memory store full: {0} buckets held (--memory-max-buckets)")]
    Full(usize),
}

impl StoreError {
    /// Whether retrying later may succeed (an outage) rather than a defect (a bad reply).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Timeout(_)
                | StoreError::Connection(_)
                | StoreError::Server(_)
                | StoreError::Full(_)
        )
    }

    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Connection(_) => "connection",
            StoreError::Server(_) => "server",
            StoreError::Protocol(_) => "protocol",
            StoreError::Full(_) => "full",
        }
    }

    /// What a caller is told: the kind of failure, never the store's own text (addresses, key
    /// names, server messages), which goes to the log.
    pub fn public_message(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "store timed out",
            StoreError::Connection(_) | StoreError::Server(_) | StoreError::Protocol(_) => {
                "store unavailable"
            }
            StoreError::Full(_) => "store full: no room for a new bucket",
        }
    }
}

/// Bucket storage that decides takes atomically.
///
/// No method has a default body: a store, and a wrapper such as
/// [`coalesce::Coalescer`], must say what each operation does, so a wrapper that forgot one does
/// not compile (a default would silently answer in place of the wrapped store).
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Charges `cost` to every bucket, or to none: `allowed` is true only if all could pay.
    /// `buckets` is validated (fields within the contract's bounds; 1..=16 entries from the
    /// wire, any number from the RLS endpoint, which builds its takes itself).
    async fn take(&self, buckets: &[BucketSpec]) -> Result<TakeResponse, StoreError>;

    /// Decides a batch of takes: each exactly as [`Store::take`] would (atomic, all-or-nothing
    /// within itself, independent of the others), answered in order. `takes` holds
    /// 1..=[`crate::domain::MAX_BATCH_TAKES`] validated takes. An error fails the whole batch;
    /// takes decided before it may have been charged (a possible false denial, never an
    /// admission).
    async fn take_batch(&self, takes: &[Vec<BucketSpec>]) -> Result<Vec<TakeResponse>, StoreError>;

    /// Takes one slot of every key (under the id `slot`), or of none: allowed only if every key
    /// holds fewer than its limit after dropping the slots whose deadline passed (see
    /// `ops/acquire.rs`). `specs` is validated (1..=16 distinct keys).
    async fn acquire(&self, specs: &[SlotSpec], slot: &str) -> Result<AcquireResponse, StoreError>;

    /// Gives back the slot `slot` of each key; per key, whether it was still held.
    async fn release(&self, slot: &str, keys: &[String]) -> Result<Vec<bool>, StoreError>;

    /// Gives `cost` tokens back to each bucket (token buckets only: tokens a caller was granted
    /// and will not spend, e.g. a lease that ended). Refilled up to now first and capped at the
    /// capacity, so a bucket never holds more than it would had those tokens never been charged;
    /// a bucket that no longer exists is full already. Returns how many buckets took tokens back.
    /// `buckets` is validated.
    async fn refund(&self, buckets: &[BucketSpec]) -> Result<u64, StoreError>;

    /// Settles a reservation (contract/README.md, "Settle"), at most once per id: each bucket is
    /// given back `estimate - used` when the response used less (refilled up to now first, capped
    /// at capacity; an expired bucket is full already), or charged `used - estimate` more when it
    /// used more. A token bucket may go below zero, to minus its capacity at most (the debt the
    /// following takes wait for); a fixed window's count may pass its capacity, up to twice it,
    /// in the window the estimate was charged in (a refund needs that window; an extra charge
    /// without `window` goes to the current one). The id is remembered
    /// [`crate::domain::SETTLE_ID_TTL_MS`] beside the buckets; a repeated id changes nothing and
    /// answers `duplicate`.
    async fn settle(&self, settlement: &Settlement) -> Result<SettleResponse, StoreError>;

    /// Reads a bucket under `bucket`'s limits (its cost is not used) on the store's clock,
    /// changing nothing: what a take would find now.
    async fn inspect(&self, bucket: &BucketSpec) -> Result<BucketState, StoreError>;

    /// Reads the live concurrency slots of `key` on the store's clock, changing nothing.
    async fn inspect_slots(&self, key: &str) -> Result<SlotsState, StoreError>;

    /// Deletes what `target` names, so the next take finds a new bucket (full) or no slot held.
    /// Returns whether anything was stored.
    async fn reset(&self, target: &ResetTarget) -> Result<bool, StoreError>;

    /// Checks the store answers (readiness).
    async fn ping(&self) -> Result<(), StoreError>;

    /// Records the proxy instance ids this replica heard from since the last call, and counts the
    /// deployment's live instances (heard from by any replica within `ttl_ms`). Called about once
    /// a second by the live-instance registry (`api/instances.rs`), never on the take path. `None`: the store is this
    /// replica's alone (memory), so the replica's own count is the whole truth.
    async fn live_instances(&self, seen: &[String], ttl_ms: u64)
        -> Result<Option<u64>, StoreError>;

    /// A short name for logs: `memory`, `redis` or `redis-cluster`.
    fn kind(&self) -> &'static str;
}
