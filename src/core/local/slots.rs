//! This Envoy's local concurrency slots, for concurrency rules when the service cannot be asked
//! (`failure_mode: fallback`): at most `max_in_flight / N` per key in this proxy, counted in shared
//! data by every worker (hashed into `fallback.max_keys` counters of
//! [`crate::core::local::table::SLOTS_TABLE`]: two keys on one counter share it, which can only
//! admit fewer) and given back when the stream ends. [`crate::core::decide::resolve_slots`]
//! decides when they are used.

use crate::core::base::store::{self, CasStore};
use crate::core::config::{Config, FailureMode, Rule};

/// One slot a request asks for: the index of its (concurrency) rule in `Config::rules`, and the
/// key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Want {
    /// Index in `Config::rules`.
    pub rule: usize,
    /// The key (`<rule name>|<parts>`, as a rate rule's).
    pub key: String,
}

/// Whether local fallback slots are in use (their table is created at configure time).
pub fn local_enabled(cfg: &Config) -> bool {
    cfg.failure_mode == FailureMode::Fallback && cfg.rules.iter().any(|r| r.concurrency().is_some())
}

/// The counter (in [`crate::core::local::table::SLOTS_TABLE`]) of `key`: FNV-1a of the key, modulo the table size.
fn counter_of(cfg: &Config, key: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!(
        "{}.{}",
        crate::core::local::table::SLOTS_TABLE,
        h % u64::from(cfg.fallback.max_keys.max(1))
    )
}

fn read_count(v: Option<&[u8]>) -> u64 {
    v.and_then(|b| <[u8; 8]>::try_from(b.get(..8)?).ok())
        .map_or(0, u64::from_le_bytes)
}

/// Takes a local slot of every want (each key at most `max / N` in this proxy, N the proxies
/// learned from the service's answers as for the fallback shares, `fallback.instances` before any),
/// or none. `Ok(counters)` holds what to give back with [`release_local`]; `Err(i)`: want `i`
/// was full.
pub fn acquire_local<S: CasStore + ?Sized>(
    cfg: &Config,
    wants: &[Want],
    store_: &S,
) -> Result<Vec<String>, usize> {
    let mut taken: Vec<String> = Vec::with_capacity(wants.len());
    let n = crate::core::local::record::learned_instances(store_)
        .unwrap_or(cfg.fallback.instances.max(cfg.fallback.min_instances))
        .max(1);
    for (i, w) in wants.iter().enumerate() {
        let Some(c) = cfg.rules.get(w.rule).and_then(Rule::concurrency) else {
            continue;
        };
        let cap = c.max_in_flight / n;
        let name = counter_of(cfg, &w.key);
        if !add(store_, &name, true, cap) {
            release_local(store_, &taken);
            return Err(i);
        }
        taken.push(name);
    }
    Ok(taken)
}

/// Gives back local slots taken by [`acquire_local`].
pub fn release_local<S: CasStore + ?Sized>(store_: &S, counters: &[String]) {
    for name in counters {
        add(store_, name, false, u64::MAX);
    }
}

/// Adds one to counter `name` while it is under `cap` (`up`), or takes one off while above zero;
/// whether that was stored. A counter that was not prepared holds nothing.
fn add<S: CasStore + ?Sized>(store_: &S, name: &str, up: bool, cap: u64) -> bool {
    let u = store::update(store_, name, |cur| {
        let n = read_count(cur);
        let next = match (cur, up) {
            (None, _) => None,
            (Some(_), true) => (n < cap).then(|| n + 1),
            (Some(_), false) => n.checked_sub(1),
        };
        match next {
            Some(v) => store::Change::Write(v.to_le_bytes().to_vec(), true),
            None => store::Change::Keep(false),
        }
    });
    u.stored && u.value
}
