//! The Lua scripts: their sources (the shared files concatenated before each driver), how each
//! operation lays out its ARGV, EVALSHA with recovery from `NOSCRIPT`, and the takes' `FCALL` of
//! the library built from the same sources (`library.rs`).

use redis::{RedisError, Script};

use super::conn::map_err;
use super::library::{Called, Function, Library};
use super::link::Conn;
use super::reply::Ints;
use super::RedisStore;
use crate::domain::{Algorithm, BucketSpec, Settlement};
use crate::store::StoreError;

use crate::store::algorithm;

const PRELUDE: &str = include_str!("../lua/prelude.lua");
const TAKE_ONE: &str = include_str!("../lua/take_one.lua");
const TAKE: &str = include_str!("../lua/take.lua");
const TAKE_BATCH: &str = include_str!("../lua/take_batch.lua");
const REFUND: &str = include_str!("../lua/refund.lua");
const SETTLE: &str = include_str!("../lua/settle.lua");
const INSPECT: &str = include_str!("../lua/inspect.lua");
pub(super) const RESET: &str = include_str!("../lua/reset.lua");
pub(super) const INSTANCES: &str = include_str!("../lua/instances.lua");

/// A script's full source: the prelude, every algorithm's Lua ([`algorithm::lua`]), then `parts`.
fn source(parts: &[&str]) -> String {
    source_with(&algorithm::lua(), parts)
}

/// A script's full source: the prelude, the algorithms' Lua `algorithms`, then `parts`.
fn source_with(algorithms: &str, parts: &[&str]) -> String {
    let mut s = [PRELUDE, algorithms].join("\n");
    for p in parts {
        s.push('\n');
        s.push_str(p);
    }
    s
}

/// The full source of the take script (prelude, algorithms, driver), e.g. for `redis-benchmark`.
/// `Some(a)`: the script of takes whose buckets all use `a` (only `a`'s Lua); `None`: any take.
pub fn take_script_source(only: Option<Algorithm>) -> String {
    match only {
        Some(a) => source_with(algorithm::lua_of(a), &[TAKE_ONE, TAKE]),
        None => source(&[TAKE_ONE, TAKE]),
    }
}

/// The full source of the batch script (prelude, algorithms, the take of one request, the loop),
/// of `only`'s algorithm or of any, as [`take_script_source`].
pub fn take_batch_script_source(only: Option<Algorithm>) -> String {
    match only {
        Some(a) => source_with(algorithm::lua_of(a), &[TAKE_ONE, TAKE_BATCH]),
        None => source(&[TAKE_ONE, TAKE_BATCH]),
    }
}

/// The takes' library (`library.rs`): the prelude, every algorithm and `take_one.lua`, with
/// `take.lua` and `take_batch.lua` as its two functions.
pub(super) fn take_library() -> Library {
    Library::new(&source(&[TAKE_ONE]), TAKE, TAKE_BATCH)
}

/// The full source of the takes' library, as `FUNCTION LOAD` receives it.
pub fn take_library_source() -> String {
    take_library().source().to_string()
}

/// One driver's scripts: one per algorithm, holding only that algorithm's Lua, and one holding
/// every algorithm's. Redis runs a script's whole body on each call, defining every function in
/// it, so a token-bucket take run by a script of all three algorithms paid for the other two
/// (BENCHMARKS.md, "The exact path's regression").
pub(super) struct Scripts {
    each: Vec<(Algorithm, Script)>,
    any: Script,
}

impl Scripts {
    /// The scripts of a driver whose source is `source(only)`.
    pub(super) fn new(source: fn(Option<Algorithm>) -> String) -> Self {
        Scripts {
            each: Algorithm::ALL
                .iter()
                .map(|&a| (a, Script::new(&source(Some(a)))))
                .collect(),
            any: Script::new(&source(None)),
        }
    }

    /// The script for `buckets`: their algorithm's when they share one, else the one of all.
    pub(super) fn of<'a>(&self, mut buckets: impl Iterator<Item = &'a BucketSpec>) -> &Script {
        let Some(first) = buckets.next().map(|b| b.algorithm) else {
            return &self.any;
        };
        if !buckets.all(|b| b.algorithm == first) {
            return &self.any;
        }
        self.each
            .iter()
            .find(|(a, _)| *a == first)
            .map_or(&self.any, |(_, s)| s)
    }
}

/// The full source of the refund script.
pub fn refund_script_source() -> String {
    source(&[REFUND])
}

/// The full source of the settle script.
pub fn settle_script_source() -> String {
    source(&[SETTLE])
}

/// The full source of the inspect script.
pub fn inspect_script_source() -> String {
    source(&[INSPECT])
}

/// `inspect.lua`'s ARGV for a bucket: algorithm, capacity, rate, period.
pub(super) fn inspect_args(b: &BucketSpec) -> [i64; 4] {
    // Every amount is at most 1e9 and a period at most a year: all fit an i64.
    [
        alg_code(b.algorithm) as i64,
        b.capacity as i64,
        b.rate as i64,
        b.period_ms as i64,
    ]
}

/// `inspect.lua`'s ARGV for a slot set.
pub(super) const INSPECT_SLOTS_ARGS: [i64; 1] = [-1];

/// Sends `cmd` (an EVALSHA of `script`); on `NOSCRIPT` (Redis restarted, or `SCRIPT FLUSH`) loads
/// the script and sends it once more, as `redis::Script::invoke_async` does.
pub(super) async fn evalsha<C: redis::aio::ConnectionLike>(
    script: &Script,
    cmd: &redis::Cmd,
    con: &mut C,
) -> Result<Vec<i64>, RedisError> {
    match cmd.query_async::<Ints>(con).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load_async(con).await?;
            cmd.query_async::<Ints>(con).await.map(|v| v.0)
        }
        r => r.map(|v| v.0),
    }
}

pub(super) fn alg_code(a: Algorithm) -> u64 {
    algorithm::code(a)
}

/// Integers per bucket in a `take.lua` reply (and per bucket of its ARGV).
pub(super) const PER_BUCKET: usize = 7;
/// Integers per bucket of `refund.lua`'s ARGV.
pub(super) const PER_REFUND: usize = 6;

/// One bucket's ARGV in `take.lua` and `take_batch.lua`: algorithm, capacity, rate, period, cost,
/// lease, max_delay_ms.
pub(super) fn take_args(b: &BucketSpec) -> [u64; PER_BUCKET] {
    [
        alg_code(b.algorithm),
        b.capacity,
        b.rate,
        b.period_ms,
        b.cost,
        b.lease,
        b.max_delay_ms,
    ]
}

/// `take_batch.lua`'s ARGV: the number of takes, each take's number of buckets, then every
/// bucket's [`take_args`] in order.
pub(super) fn batch_args(takes: &[&[BucketSpec]]) -> Vec<u64> {
    let n: usize = takes.iter().map(|t| t.len()).sum();
    let mut args = Vec::with_capacity(1 + takes.len() + PER_BUCKET * n);
    args.push(takes.len() as u64);
    args.extend(takes.iter().map(|t| t.len() as u64));
    for b in takes.iter().flat_map(|t| t.iter()) {
        args.extend(take_args(b));
    }
    args
}

/// One bucket's ARGV in `refund.lua`: algorithm, capacity, rate, period, the tokens to give back
/// and the mark `take.lua` answered for the charge (the window charged; 0 for token buckets).
pub(super) fn refund_args(b: &BucketSpec, amount: u64, mark: u64) -> [u64; PER_REFUND] {
    [
        alg_code(b.algorithm),
        b.capacity,
        b.rate,
        b.period_ms,
        amount,
        mark,
    ]
}

/// `settle.lua`'s ARGV for the buckets `idx` of `s`: the id's TTL, then per bucket algorithm,
/// capacity, rate, period, estimate, used and window (-1: none).
pub(super) fn settle_args(s: &Settlement, idx: &[usize], id_ttl_ms: u64) -> Vec<i64> {
    let mut args: Vec<i64> = Vec::with_capacity(1 + 7 * idx.len());
    args.push(id_ttl_ms as i64);
    for &i in idx {
        let b = &s.buckets[i];
        // Every amount is at most 1e9 and a period at most a year: all fit an i64.
        args.extend([
            alg_code(b.bucket.algorithm) as i64,
            b.bucket.capacity as i64,
            b.bucket.rate as i64,
            b.bucket.period_ms as i64,
            b.estimate as i64,
            b.used as i64,
            b.window
                .map_or(-1, |w| i64::try_from(w).unwrap_or(i64::MAX)),
        ]);
    }
    args
}

/// `instances.lua`'s ARGV: the TTL, then the ids heard from.
pub(super) fn instances_args(seen: &[String], ttl_ms: u64) -> Vec<String> {
    let mut args = Vec::with_capacity(1 + seen.len());
    args.push(ttl_ms.to_string());
    args.extend(seen.iter().cloned());
    args
}

impl RedisStore {
    /// Calls the library's function `f` with keys and integer args on the right connection, within
    /// the timeout; on a Redis without functions runs `script` (the same driver) instead, from then
    /// on (`library.rs`).
    pub(super) async fn invoke_function<A: redis::ToRedisArgs>(
        &self,
        f: Function,
        script: &Script,
        keys: &[&str],
        args: &[A],
    ) -> Result<Vec<i64>, StoreError> {
        let lib = &self.library;
        if lib.scripts_only() {
            return self.invoke(script, keys, args).await;
        }
        let cmd = lib.call(f, keys, args);
        let call = async {
            match &self.conn {
                Conn::Single(m) => {
                    let mut m = m.clone();
                    lib.fcall(&cmd, &mut m).await.map_err(map_err)
                }
                Conn::Cluster(cc) => {
                    let mut c = cc.get().await?;
                    lib.fcall(&cmd, &mut c).await.map_err(map_err)
                }
                Conn::Sentinel(s) => {
                    let cmd = &cmd;
                    s.query(|mut c| async move { lib.fcall(cmd, &mut c).await })
                        .await
                }
            }
        };
        match tokio::time::timeout(self.config.timeout, call).await {
            Ok(Ok(Called::Reply(v))) => Ok(v),
            Ok(Ok(Called::Refused)) => {
                lib.use_scripts();
                self.invoke(script, keys, args).await
            }
            Ok(Err(StoreError::Timeout(_))) | Err(_) => Err(StoreError::Timeout(self.timeout_ms())),
            Ok(Err(e)) => Err(e),
        }
    }

    /// Runs `script` with keys and integer args on the right connection, within the timeout.
    pub(super) async fn invoke<A: redis::ToRedisArgs>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[A],
    ) -> Result<Vec<i64>, StoreError> {
        // EVALSHA written straight from the keys and integers: `ScriptInvocation` would first copy
        // every key and argument into a buffer of its own, then into the command.
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash())
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        let call = async {
            match &self.conn {
                Conn::Single(m) => {
                    let mut m = m.clone();
                    evalsha(script, &cmd, &mut m).await.map_err(map_err)
                }
                Conn::Cluster(cc) => {
                    let mut c = cc.get().await?;
                    evalsha(script, &cmd, &mut c).await.map_err(map_err)
                }
                Conn::Sentinel(s) => {
                    let cmd = &cmd;
                    s.query(|mut c| async move { evalsha(script, cmd, &mut c).await })
                        .await
                }
            }
        };
        match tokio::time::timeout(self.config.timeout, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(StoreError::Timeout(_))) | Err(_) => Err(StoreError::Timeout(self.timeout_ms())),
            Ok(Err(e)) => Err(e),
        }
    }
}
