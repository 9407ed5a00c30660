//! The takes as one Redis Functions library (Redis 7 and later): `FUNCTION LOAD` runs the
//! prelude, every algorithm's file and `take_one.lua` once, and each `FCALL` runs only its
//! driver. An `EVALSHA` runs its script's whole body on every call, so every `local function` of
//! the prelude and the algorithms becomes a new closure per take (BENCHMARKS.md, "The takes as a
//! Redis function": 153k instructions of Redis per take by `EVALSHA`, 135k by `FCALL`).
//!
//! The library holds the same Lua as the scripts (`scripts.rs`): the prelude, every algorithm,
//! `take_one.lua`, and `take.lua` and `take_batch.lua` each as the body of a registered function.
//! Its first lines declare `KEYS` and `ARGV` as the library's locals, and each function sets them
//! from its arguments before running its driver, so the drivers read them as they do in a
//! script. A function runs as atomically as a script; its keys are routed on a Cluster as a
//! script's are (all of one slot per call).
//!
//! * **Named by its source.** The library's name carries a digest of its source
//!   (`tollgate_<12 hex digits>`), so two versions of the service during a rollout each call
//!   their own library, never one another's. A library no service uses any more stays in Redis
//!   (a few kilobytes) until `FUNCTION DELETE` or `FUNCTION FLUSH`.
//! * **Loaded on demand.** A call that finds no such function (Redis restarted without
//!   persistence, `FUNCTION FLUSH`, a new primary that never had it) loads the library
//!   (`FUNCTION LOAD REPLACE`, which the Cluster client sends to every primary) and calls once
//!   more, as `NOSCRIPT` recovery does for a script. Replicas receive it through replication.
//! * **Without functions, scripts.** A Redis that does not know `FCALL` or `FUNCTION` (before
//!   7.0, or with them renamed) or refuses them (an ACL without them: `NOPERM`) answers the first
//!   call with that error; the store then takes with `EVALSHA` for the rest of the process.

use std::sync::atomic::{AtomicBool, Ordering};

use redis::{aio::ConnectionLike, Cmd, RedisError};
use sha2::{Digest, Sha256};

use super::reply::Ints;

/// The library: its source and its functions' names.
pub(super) struct Library {
    source: String,
    take: String,
    batch: String,
    /// Set once a Redis refused functions: every take uses its script from then on.
    scripts_only: AtomicBool,
}

/// Which of the library's functions.
#[derive(Clone, Copy, Debug)]
pub(super) enum Function {
    /// `take.lua`'s body: one take.
    Take,
    /// `take_batch.lua`'s body: several takes.
    Batch,
}

/// What a call through the library came to.
pub(super) enum Called {
    Reply(Vec<i64>),
    /// This Redis has no functions (or refuses them): use the script.
    Refused,
}

impl Library {
    /// The library of `shared` (the prelude, the algorithms and `take_one.lua`) with `take` and
    /// `batch` (the drivers' sources) as its two functions.
    pub(super) fn new(shared: &str, take: &str, batch: &str) -> Self {
        let body = format!(
            "local KEYS, ARGV\n{shared}\n\
             redis.register_function('@TAKE@', function(keys, args)\n\
             KEYS, ARGV = keys, args\n{take}\nend)\n\
             redis.register_function('@BATCH@', function(keys, args)\n\
             KEYS, ARGV = keys, args\n{batch}\nend)\n"
        );
        let digest = Sha256::digest(body.as_bytes());
        let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
        let name = format!("tollgate_{hex}");
        let take = format!("{name}_take");
        let batch = format!("{name}_batch");
        let source = format!(
            "#!lua name={name}\n{}",
            body.replace("@TAKE@", &take).replace("@BATCH@", &batch)
        );
        Library {
            source,
            take,
            batch,
            scripts_only: AtomicBool::new(false),
        }
    }

    /// The library's full source, as `FUNCTION LOAD` receives it.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The registered name of `f`.
    pub fn name(&self, f: Function) -> &str {
        match f {
            Function::Take => &self.take,
            Function::Batch => &self.batch,
        }
    }

    /// Whether a Redis refused functions already (the takes then use their scripts).
    pub(super) fn scripts_only(&self) -> bool {
        self.scripts_only.load(Ordering::Relaxed)
    }

    /// From now on the takes use their scripts.
    pub(super) fn use_scripts(&self) {
        if !self.scripts_only.swap(true, Ordering::Relaxed) {
            tracing::info!(
                "this Redis has no functions (before 7.0, renamed, or refused by its ACL): \
                 takes run as scripts (EVALSHA)"
            );
        }
    }

    /// The `FCALL` of `f` on `keys` and `args`.
    pub(super) fn call<A: redis::ToRedisArgs>(
        &self,
        f: Function,
        keys: &[&str],
        args: &[A],
    ) -> Cmd {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(self.name(f)).arg(keys.len()).arg(keys).arg(args);
        cmd
    }

    /// Sends `cmd` (an `FCALL` of this library); when Redis has no such function, loads the
    /// library and sends it once more. [`Called::Refused`] when this Redis has no functions.
    pub(super) async fn fcall<C: ConnectionLike>(
        &self,
        cmd: &Cmd,
        con: &mut C,
    ) -> Result<Called, RedisError> {
        match cmd.query_async::<Ints>(con).await {
            Ok(v) => Ok(Called::Reply(v.0)),
            Err(e) if refused(&e) => Ok(Called::Refused),
            Err(e) if not_loaded(&e) => {
                let load = redis::cmd("FUNCTION")
                    .arg("LOAD")
                    .arg("REPLACE")
                    .arg(&self.source)
                    .query_async::<String>(con)
                    .await;
                match load {
                    Ok(_) => cmd
                        .query_async::<Ints>(con)
                        .await
                        .map(|v| Called::Reply(v.0)),
                    Err(e) if refused(&e) => Ok(Called::Refused),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }
}

/// `-ERR Function not found`: the library is not loaded on that Redis.
fn not_loaded(e: &RedisError) -> bool {
    e.code() == Some("ERR")
        && e.detail()
            .is_some_and(|d| d.starts_with("Function not found"))
}

/// A Redis without functions: `FCALL` or `FUNCTION` unknown (before 7.0, or renamed), or refused
/// by the connection's ACL.
fn refused(e: &RedisError) -> bool {
    match e.code() {
        Some("NOPERM") => true,
        Some("ERR") => e.detail().is_some_and(|d| {
            d.starts_with("unknown command") || d.starts_with("unknown subcommand")
        }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::super::scripts::{take_batch_script_source, take_library, take_script_source};

    /// The library is the scripts' Lua, each line as it is there (the scripts are what
    /// `lua_reference` checks against the contract's arithmetic), and its name follows its source.
    #[test]
    fn the_library_holds_the_scripts_lua_and_is_named_by_it() {
        let lib = take_library();
        let src = lib.source();
        for script in [take_script_source(None), take_batch_script_source(None)] {
            for line in script.lines() {
                assert!(src.contains(line), "not in the library: {line}");
            }
        }
        let name = src
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("#!lua name="))
            .unwrap_or_default();
        assert_eq!(name.len(), "tollgate_".len() + 12, "{name}");
        assert_eq!(lib.name(super::Function::Take), format!("{name}_take"));
        assert_eq!(lib.name(super::Function::Batch), format!("{name}_batch"));
        let other = super::Library::new("local X = 1", "return 1", "return 2");
        assert_ne!(
            other.name(super::Function::Take),
            lib.name(super::Function::Take)
        );
    }
}
