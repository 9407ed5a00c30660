//! The Redis store: standalone (`redis://`, `rediss://`), Redis Cluster (seed nodes) or the
//! master of a Redis Sentinel setup (standalone as far as scripts go: `sentinel`).
//!
//! # What is guaranteed
//!
//! * **Standalone Redis**: one call of `take.lua` decides and charges every bucket of a request.
//!   Redis runs a script start to finish with nothing interleaved, so a take is atomic and
//!   all-or-nothing: a denied request writes nothing. Concurrent takes from any number of service
//!   replicas never admit more than the limit.
//! * **Redis Cluster**: the buckets of one request may hash to different slots, and one script can
//!   only touch one slot. Buckets are grouped by slot; each group is taken atomically by its own
//!   `take.lua` call (the groups run concurrently). When any group denies or fails, every group
//!   that was charged is given back with `refund.lua` (exactly what it granted, lease included). The limit is never exceeded. The price:
//!   between a charge and its refund (one round trip), a concurrent request may find those tokens
//!   spent and be denied (a rare false denial, never a false admission). If the refund itself fails
//!   (Redis unreachable), those tokens stay spent until they refill: again a denial, never an
//!   admission. A request whose buckets share a slot (one key, or keys of one `{hash tag}`) is as
//!   atomic as on standalone Redis.
//! * **Batches** ([`Store::take_batch`]): on standalone Redis, one call of `take_batch.lua` decides
//!   every take of the batch, one after the other, each exactly as `take.lua` would (both run
//!   `take_one.lua`): one round trip, each take atomic and all-or-nothing (the whole batch is in fact
//!   one atomic script run). A loop in one script rather than a pipeline of EVALSHA: one reply to
//!   read, one script start, and NOSCRIPT recovery stays one retry of one command (a pipeline
//!   could be cut between charged and unknown takes). On a Cluster, takes whose keys share one
//!   slot go in one `take_batch.lua` call per slot; a take spanning slots is taken as a single take
//!   (slot by slot, with refunds); all of them concurrently.
//! * **Outages**: every round trip is bounded by the configured timeout (connect and response; a
//!   Cluster take that must refund makes two round trips); a take that cannot complete is a
//!   [`StoreError`], which the service answers with 503 /
//!   `UNAVAILABLE`, never "allowed". A script whose reply was lost to a timeout may still have
//!   charged its buckets: again a possible false denial only. Connections are multiplexed
//!   (a `ConnectionManager`, or the cluster client) and reconnect by themselves when Redis is back.
//!
//! # TLS
//!
//! `rediss://` URLs (standalone or every Cluster seed) connect with rustls. By default the server
//! certificate must chain to a public (webpki) root; [`RedisTls`] replaces those roots by a private
//! CA bundle (cert-manager, a cloud provider's managed Redis) and adds a client certificate for
//! Redis with `tls-auth-clients yes`. The files are checked once, in [`RedisStore::new`]
//! ([`RedisTls::check`]), so a bad bundle stops the service at startup instead of failing every
//! connect. A failed handshake (unknown CA, missing client certificate) is a connection error like
//! any other: 503 / `UNAVAILABLE`, and `/readyz` reports not ready.
//!
//! # Scripts
//!
//! `take.lua`, `take_batch.lua`, `refund.lua`, `settle.lua` and `inspect.lua` are built by concatenating
//! `prelude.lua` (exact integer arithmetic, the TIME clock, the `ALGORITHMS` table), every
//! algorithm's file (one per module of [`super::algorithm`], each registering its functions),
//! `take_one.lua` (the decision of one take; takes only) and the driver, which reaches each
//! bucket's algorithm through `ALGORITHMS[code]`. One script handles a mix of algorithms so that
//! all buckets of a slot are taken in one call. They are sent with EVALSHA; on `NOSCRIPT` (after a restart or `SCRIPT FLUSH`)
//! `redis::Script` loads them (`SCRIPT LOAD`, sent to every primary on a cluster) and retries.
//! The takes (`take.lua`, `take_batch.lua`) are `FCALL`s of one Redis Functions library built
//! from the same files (`library.rs`), which defines the prelude and the algorithms once instead
//! of on every call; on a Redis without functions they are sent as scripts too.
//! Keys are laid out by [`super::keys`]. The reply is turned into decisions by [`decode_take`], a
//! pure function. `reset.lua` (one `DEL` of a bucket's one key, in its own hash slot) stands
//! alone, as `acquire.lua`, `release.lua` and `instances.lua` do.
//!
//! # Layout
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | [`RedisStore`] and its [`Store`] impl: slot grouping, refunds across slots |
//! | `conn.rs` | where Redis is, timeouts, TLS (rustls), [`redact_url`], client errors |
//! | `link.rs` | the connection: standalone, Cluster or the Sentinel-named master |
//! | `scripts.rs` | the scripts' sources, each operation's ARGV, EVALSHA with `NOSCRIPT` recovery |
//! | `library.rs` | the takes as one Redis Functions library: `FCALL`, loaded on demand, scripts without functions |
//! | `reply.rs` | a script's reply as its integers: an array, or a take's packed string |
//! | `decode.rs` | script replies into decisions (pure) |
//! | `sentinel.rs` | the master Redis Sentinel names, asked again after a failover |

mod conn;
mod decode;
mod library;
mod link;
mod reply;
mod scripts;
mod sentinel;

use std::fmt;
use std::sync::Arc;

use redis::Script;

use self::conn::map_err;
pub use self::conn::{
    redact_url, redact_urls, ClientIdentity, RedisConfig, RedisConfigError, RedisTls, TlsFileError,
};
use self::decode::decode_instances;
pub use self::decode::{decode_batch, decode_settle, decode_take, GroupReply};
use self::library::{Function, Library};
use self::link::Conn;
use self::scripts::{evalsha, Scripts, PER_BUCKET, PER_REFUND};
pub use self::scripts::{
    refund_script_source, settle_script_source, take_batch_script_source, take_library_source,
    take_script_source,
};
pub use self::sentinel::SentinelConfig;
use super::keys::{bucket_key, redis_key, slot};
use super::{Store, StoreError};
use crate::domain::{
    Algorithm, BucketResult, BucketSpec, BucketState, ResetTarget, SettleResponse, SettleResult,
    Settlement, SlotsState, TakeResponse, SETTLE_ID_TTL_MS,
};

/// The Redis [`Store`]. Cheap to share behind an `Arc`.
pub struct RedisStore {
    conn: Conn,
    config: RedisConfig,
    /// The takes as Redis functions; `take` and `take_batch` are their scripts, for a Redis
    /// without functions.
    library: Arc<Library>,
    take: Arc<Scripts>,
    take_batch: Arc<Scripts>,
    refund: Arc<Script>,
    settle: Arc<Script>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// One slot's share of a request: indexes into the request's buckets.
struct Group {
    idx: Vec<usize>,
}

impl RedisStore {
    /// Creates the store. Connects lazily: the service starts (and reports not ready) while Redis
    /// is down, and every take fails fast until it is back.
    pub fn new(config: RedisConfig) -> Result<Self, RedisConfigError> {
        super::keys::check_prefix(&config.key_prefix).map_err(RedisConfigError::KeyPrefix)?;
        if let Some(tls) = &config.tls {
            tls.check()?;
        }
        let conn = Conn::open(&config)?;
        Ok(Self::with_conn(config, conn))
    }

    /// Creates the store on the master that Redis Sentinel names (`config`'s URL and Cluster
    /// nodes are not used; its prefix, timeout and TLS files are). Connects lazily, as [`new`].
    ///
    /// [`new`]: RedisStore::new
    pub fn with_sentinel(
        config: RedisConfig,
        sentinel: &SentinelConfig,
    ) -> Result<Self, RedisConfigError> {
        super::keys::check_prefix(&config.key_prefix).map_err(RedisConfigError::KeyPrefix)?;
        if let Some(tls) = &config.tls {
            tls.check()?;
        }
        let conn = sentinel::SentinelConn::open(sentinel, config.tls.as_ref(), config.timeout)?;
        Ok(Self::with_conn(config, Conn::Sentinel(Box::new(conn))))
    }

    fn with_conn(config: RedisConfig, conn: Conn) -> Self {
        RedisStore {
            conn,
            config,
            library: Arc::new(scripts::take_library()),
            take: Arc::new(Scripts::new(take_script_source)),
            take_batch: Arc::new(Scripts::new(take_batch_script_source)),
            refund: Arc::new(Script::new(&refund_script_source())),
            settle: Arc::new(Script::new(&settle_script_source())),
        }
    }

    /// The indexes of `keys` grouped by Redis Cluster hash slot, groups in order of first
    /// appearance: one call per group (on standalone Redis every key is in one group).
    fn slot_groups(&self, keys: &[String]) -> Vec<(u16, Vec<usize>)> {
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let at = match self.conn {
                Conn::Single(_) | Conn::Sentinel(_) => 0,
                Conn::Cluster(_) => slot(k),
            };
            match groups.iter_mut().find(|(g, _)| *g == at) {
                Some((_, idx)) => idx.push(i),
                None => groups.push((at, vec![i])),
            }
        }
        groups
    }

    fn timeout_ms(&self) -> u64 {
        u64::try_from(self.config.timeout.as_millis()).unwrap_or(u64::MAX)
    }

    async fn take_group(
        &self,
        group: &Group,
        keys: &[String],
        specs: &[BucketSpec],
    ) -> Result<GroupReply, StoreError> {
        let ks: Vec<&str> = group.idx.iter().map(|&i| keys[i].as_str()).collect();
        let mut args = Vec::with_capacity(PER_BUCKET * group.idx.len());
        let mut these = Vec::with_capacity(group.idx.len());
        for &i in &group.idx {
            let b = &specs[i];
            args.extend(scripts::take_args(b));
            these.push(b);
        }
        let script = self.take.of(these.iter().copied());
        let reply = self
            .invoke_function(Function::Take, script, &ks, &args)
            .await?;
        decode_take(&reply, &these)
    }

    /// Decides `takes` with one call of `take_batch.lua`: one round trip, each take atomic. On a
    /// cluster every key of every take must be in one slot.
    async fn batch_call(&self, takes: &[&[BucketSpec]]) -> Result<Vec<TakeResponse>, StoreError> {
        let keys: Vec<String> = takes
            .iter()
            .flat_map(|t| t.iter())
            .map(|b| redis_key(&self.config.key_prefix, b))
            .collect();
        let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
        let args = scripts::batch_args(takes);
        let script = self.take_batch.of(takes.iter().flat_map(|t| t.iter()));
        let reply = self
            .invoke_function(Function::Batch, script, &ks, &args)
            .await?;
        decode_batch(&reply, takes)
    }

    async fn refund_group(
        &self,
        group: &Group,
        keys: &[String],
        specs: &[BucketSpec],
        reply: &GroupReply,
    ) -> Result<(), StoreError> {
        let ks: Vec<&str> = group.idx.iter().map(|&i| keys[i].as_str()).collect();
        let mut args = Vec::with_capacity(PER_REFUND * group.idx.len());
        for (&i, (d, mark)) in group.idx.iter().zip(&reply.buckets) {
            let b = &specs[i];
            // Give back exactly what was charged: the grant, which is more than cost with a lease.
            args.extend(scripts::refund_args(b, d.granted, *mark));
        }
        self.invoke(&self.refund, &ks, &args).await.map(|_| ())
    }
}

impl RedisStore {
    /// Gives tokens back with `refund.lua`, one bucket per call (each in its own slot).
    async fn refund_each(&self, specs: &[BucketSpec]) -> Result<u64, StoreError> {
        let mut n = 0;
        for b in specs
            .iter()
            .filter(|b| b.algorithm == Algorithm::TokenBucket)
        {
            let key = redis_key(&self.config.key_prefix, b);
            let args = scripts::refund_args(b, b.cost, 0);
            let reply = self.invoke(&self.refund, &[key.as_str()], &args).await?;
            n += reply.first().map_or(0, |&r| u64::try_from(r).unwrap_or(0));
        }
        Ok(n)
    }
}

impl RedisStore {
    /// Settles the buckets `idx` of `s` (one slot) with one `settle.lua` call. The id's record
    /// takes the hash tag of the group's first bucket, so it shares their slot: a settlement
    /// spanning slots is remembered once per slot, and one resent after a partial failure applies
    /// only the slots it had not reached.
    async fn settle_group(
        &self,
        s: &Settlement,
        idx: &[usize],
        keys: &[String],
    ) -> Result<(bool, Vec<SettleResult>), StoreError> {
        let first = &keys[idx[0]];
        // The prefix holds no brace (keys::check_prefix): the first one opens the bucket's tag.
        let tag = first
            .find('{')
            .map_or(first.as_str(), |open| &first[open..]);
        let record = format!("{}settled:{tag}:{}", self.config.key_prefix, s.id);
        let mut ks: Vec<&str> = Vec::with_capacity(1 + idx.len());
        ks.push(&record);
        ks.extend(idx.iter().map(|&i| keys[i].as_str()));
        let args = scripts::settle_args(s, idx, SETTLE_ID_TTL_MS);
        let reply = self.invoke(&self.settle, &ks, &args).await?;
        decode_settle(&reply, idx.len())
    }
}

#[async_trait::async_trait]
impl Store for RedisStore {
    async fn take(&self, specs: &[BucketSpec]) -> Result<TakeResponse, StoreError> {
        let keys: Vec<String> = specs
            .iter()
            .map(|b| redis_key(&self.config.key_prefix, b))
            .collect();
        let groups: Vec<Group> = self
            .slot_groups(&keys)
            .into_iter()
            .map(|(_, idx)| Group { idx })
            .collect();
        if let [group] = groups.as_slice() {
            let reply = self.take_group(group, &keys, specs).await?;
            return Ok(TakeResponse::from_buckets(
                reply.buckets.into_iter().map(|(d, _)| d).collect(),
            ));
        }
        let replies =
            futures_util::future::join_all(groups.iter().map(|g| self.take_group(g, &keys, specs)))
                .await;
        let all_charged = replies.iter().all(|r| matches!(r, Ok(g) if g.charged));
        if !all_charged {
            let refunds = groups.iter().zip(&replies).filter_map(|(g, r)| match r {
                Ok(reply) if reply.charged => Some(self.refund_group(g, &keys, specs, reply)),
                _ => None,
            });
            for r in futures_util::future::join_all(refunds).await {
                if let Err(e) = r {
                    tracing::warn!(error = %e, "refund failed; those tokens stay spent until they refill");
                }
            }
        }
        let mut out: Vec<Option<BucketResult>> = vec![None; specs.len()];
        for (g, r) in groups.iter().zip(replies) {
            let reply = r?;
            for (&i, (d, _)) in g.idx.iter().zip(reply.buckets) {
                out[i] = Some(d);
            }
        }
        let buckets: Option<Vec<BucketResult>> = out.into_iter().collect();
        let buckets =
            buckets.ok_or_else(|| StoreError::Protocol("a bucket got no decision".into()))?;
        Ok(TakeResponse::from_buckets(buckets))
    }

    async fn take_batch(&self, takes: &[Vec<BucketSpec>]) -> Result<Vec<TakeResponse>, StoreError> {
        if let Conn::Single(_) | Conn::Sentinel(_) = self.conn {
            let all: Vec<&[BucketSpec]> = takes.iter().map(Vec::as_slice).collect();
            return self.batch_call(&all).await;
        }
        // Cluster: takes whose keys share one slot go in one batch call per slot; a take that
        // spans slots is taken as a single take is (slot by slot, with refunds). All concurrently.
        let mut by_slot: Vec<(u16, Vec<usize>)> = Vec::new();
        let mut spanning: Vec<usize> = Vec::new();
        for (i, specs) in takes.iter().enumerate() {
            let mut slots = specs
                .iter()
                .map(|b| slot(&redis_key(&self.config.key_prefix, b)));
            let first = slots.next();
            match first {
                Some(s) if slots.all(|o| o == s) => {
                    match by_slot.iter_mut().find(|(gs, _)| *gs == s) {
                        Some((_, idx)) => idx.push(i),
                        None => by_slot.push((s, vec![i])),
                    }
                }
                _ => spanning.push(i),
            }
        }
        let grouped = futures_util::future::join_all(by_slot.iter().map(|(_, idx)| {
            let these: Vec<&[BucketSpec]> = idx.iter().map(|&i| takes[i].as_slice()).collect();
            async move { self.batch_call(&these).await }
        }));
        let single = futures_util::future::join_all(spanning.iter().map(|&i| self.take(&takes[i])));
        let (grouped, single) = futures_util::future::join(grouped, single).await;
        let mut out: Vec<Option<TakeResponse>> = vec![None; takes.len()];
        for ((_, idx), r) in by_slot.iter().zip(grouped) {
            for (&i, d) in idx.iter().zip(r?) {
                out[i] = Some(d);
            }
        }
        for (&i, r) in spanning.iter().zip(single) {
            out[i] = Some(r?);
        }
        out.into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| StoreError::Protocol("a take got no decision".into()))
    }

    async fn acquire(
        &self,
        specs: &[crate::domain::SlotSpec],
        slot_id: &str,
    ) -> Result<crate::domain::AcquireResponse, StoreError> {
        use super::slots;
        static ACQUIRE: std::sync::LazyLock<Script> =
            std::sync::LazyLock::new(|| Script::new(slots::ACQUIRE));
        let keys: Vec<String> = specs
            .iter()
            .map(|s| slots::redis_key(&self.config.key_prefix, &s.key))
            .collect();
        // One call per hash slot (every key in one call on standalone Redis).
        let groups = self.slot_groups(&keys);
        let calls = groups.iter().map(|(_, idx)| {
            let ks: Vec<&str> = idx.iter().map(|&i| keys[i].as_str()).collect();
            let these: Vec<&crate::domain::SlotSpec> = idx.iter().map(|&i| &specs[i]).collect();
            async move {
                let reply = self
                    .invoke(&ACQUIRE, &ks, &slots::acquire_args(&these, slot_id))
                    .await?;
                slots::decode_acquire(&reply, &these)
            }
        });
        let replies = futures_util::future::join_all(calls).await;
        let all = replies.iter().all(|r| matches!(r, Ok((true, _))));
        if !all && groups.len() > 1 {
            // All or nothing across slots: give back what the other slots took.
            for ((_, idx), r) in groups.iter().zip(&replies) {
                if matches!(r, Ok((true, _))) {
                    let ks: Vec<String> = idx.iter().map(|&i| specs[i].key.clone()).collect();
                    if let Err(e) = self.release(slot_id, &ks).await {
                        tracing::warn!(error = %e, "releasing a partial acquire failed; those slots wait for their deadline");
                    }
                }
            }
        }
        let mut out: Vec<Option<crate::domain::SlotResult>> = vec![None; specs.len()];
        for ((_, idx), r) in groups.iter().zip(replies) {
            let (taken, ds) = r?;
            for (&i, mut d) in idx.iter().zip(ds) {
                if taken && !all {
                    // Given back above: report the set as it stands.
                    d.in_flight = d.in_flight.saturating_sub(1);
                }
                out[i] = Some(d);
            }
        }
        let buckets: Vec<crate::domain::SlotResult> =
            out.into_iter()
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| StoreError::Protocol("a key got no decision".into()))?;
        Ok(crate::domain::AcquireResponse::from_buckets(
            buckets, slot_id,
        ))
    }

    async fn release(&self, slot_id: &str, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        use super::slots;
        static RELEASE: std::sync::LazyLock<Script> =
            std::sync::LazyLock::new(|| Script::new(slots::RELEASE));
        let rkeys: Vec<String> = keys
            .iter()
            .map(|k| slots::redis_key(&self.config.key_prefix, k))
            .collect();
        let groups = self.slot_groups(&rkeys);
        let mut out = vec![false; keys.len()];
        for (_, idx) in &groups {
            let ks: Vec<&str> = idx.iter().map(|&i| rkeys[i].as_str()).collect();
            let memory = contract::bounds::RELEASED_SLOT_MEMORY_MS.to_string();
            let reply = self.invoke(&RELEASE, &ks, &[slot_id, &memory]).await?;
            for (&i, r) in idx.iter().zip(slots::decode_release(&reply, idx.len())?) {
                out[i] = r;
            }
        }
        Ok(out)
    }

    async fn refund(&self, buckets: &[BucketSpec]) -> Result<u64, StoreError> {
        self.refund_each(buckets).await
    }

    async fn settle(&self, s: &Settlement) -> Result<SettleResponse, StoreError> {
        let keys: Vec<String> = s
            .buckets
            .iter()
            .map(|b| redis_key(&self.config.key_prefix, &b.bucket))
            .collect();
        let groups = self.slot_groups(&keys);
        let replies = futures_util::future::join_all(
            groups
                .iter()
                .map(|(_, idx)| self.settle_group(s, idx, &keys)),
        )
        .await;
        let mut out = vec![SettleResult::default(); keys.len()];
        let mut duplicate = true;
        for ((_, idx), reply) in groups.iter().zip(replies) {
            let (dup, results) = reply?;
            duplicate &= dup;
            for (&i, r) in idx.iter().zip(results) {
                out[i] = r;
            }
        }
        Ok(SettleResponse {
            duplicate,
            buckets: out,
        })
    }

    async fn inspect(&self, b: &BucketSpec) -> Result<BucketState, StoreError> {
        static SCRIPT: std::sync::LazyLock<Script> =
            std::sync::LazyLock::new(|| Script::new(&scripts::inspect_script_source()));
        let key = redis_key(&self.config.key_prefix, b);
        let reply = self
            .invoke(&SCRIPT, &[key.as_str()], &scripts::inspect_args(b))
            .await?;
        decode::decode_inspect(&reply, b.capacity)
    }

    async fn inspect_slots(&self, key: &str) -> Result<SlotsState, StoreError> {
        static SCRIPT: std::sync::LazyLock<Script> =
            std::sync::LazyLock::new(|| Script::new(&scripts::inspect_script_source()));
        let set = super::slots::redis_key(&self.config.key_prefix, key);
        let reply = self
            .invoke(&SCRIPT, &[set.as_str()], &scripts::INSPECT_SLOTS_ARGS)
            .await?;
        decode::decode_slots(&reply)
    }

    async fn reset(&self, target: &ResetTarget) -> Result<bool, StoreError> {
        static SCRIPT: std::sync::LazyLock<Script> =
            std::sync::LazyLock::new(|| Script::new(scripts::RESET));
        let key = match target {
            ResetTarget::Bucket(a, k) => bucket_key(&self.config.key_prefix, *a, k),
            ResetTarget::Slots(k) => super::slots::redis_key(&self.config.key_prefix, k),
        };
        let none: [i64; 0] = [];
        match self
            .invoke(&SCRIPT, &[key.as_str()], &none)
            .await?
            .as_slice()
        {
            [n @ (0 | 1)] => Ok(*n == 1),
            r => Err(StoreError::Protocol(format!("reset reply {r:?}"))),
        }
    }

    async fn live_instances(
        &self,
        seen: &[String],
        ttl_ms: u64,
    ) -> Result<Option<u64>, StoreError> {
        static SCRIPT: std::sync::LazyLock<Script> =
            std::sync::LazyLock::new(|| Script::new(scripts::INSTANCES));
        let key = super::keys::instances_key(&self.config.key_prefix);
        let args = scripts::instances_args(seen, ttl_ms);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(SCRIPT.get_hash()).arg(1).arg(&key).arg(&args);
        let call = async {
            match &self.conn {
                Conn::Single(m) => {
                    let mut m = m.clone();
                    evalsha(&SCRIPT, &cmd, &mut m).await.map_err(map_err)
                }
                Conn::Cluster(cc) => {
                    let mut c = cc.side().await?;
                    evalsha(&SCRIPT, &cmd, &mut c).await.map_err(map_err)
                }
                Conn::Sentinel(s) => {
                    let cmd = &cmd;
                    s.query(|mut c| async move { evalsha(&SCRIPT, cmd, &mut c).await })
                        .await
                }
            }
        };
        let reply = match tokio::time::timeout(self.config.timeout, call).await {
            Ok(r) => r?,
            Err(_) => return Err(StoreError::Timeout(self.timeout_ms())),
        };
        decode_instances(&reply)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let call = async {
            match &self.conn {
                Conn::Single(m) => {
                    let mut m = m.clone();
                    redis::cmd("PING")
                        .query_async::<String>(&mut m)
                        .await
                        .map_err(map_err)
                }
                Conn::Cluster(cc) => {
                    let mut c = cc.get().await?;
                    redis::cmd("PING")
                        .query_async::<String>(&mut c)
                        .await
                        .map_err(map_err)
                }
                Conn::Sentinel(s) => {
                    s.query(|mut c| async move {
                        redis::cmd("PING").query_async::<String>(&mut c).await
                    })
                    .await
                }
            }
        };
        match tokio::time::timeout(self.config.timeout, call).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(StoreError::Timeout(_))) | Err(_) => Err(StoreError::Timeout(self.timeout_ms())),
            Ok(Err(e)) => Err(e),
        }
    }

    fn kind(&self) -> &'static str {
        match self.conn {
            Conn::Single(_) => "redis",
            Conn::Cluster(_) => "redis-cluster",
            Conn::Sentinel(_) => "redis-sentinel",
        }
    }
}
