//! Concurrency slots ((`ops/acquire.rs`, `ops/release.rs`)): the memory store's table, and what the Redis store
//! sends to and reads from `lua/acquire.lua` and `lua/release.lua`.
//!
//! The memory table is the reference the scripts are tested against (server/tests/integration/inflight.rs
//! runs one suite over both): per key, the live slots with their deadlines; an acquire first
//! drops the expired ones, then takes a slot of every key or of none.

use std::collections::HashMap;
use std::sync::Mutex;

use super::keys::push_tag;
use super::StoreError;
use crate::domain::{
    slot_retry_after, AcquireResponse, SlotResult, SlotSpec, SlotsState, MAX_LISTED_SLOTS,
};
use contract::bounds::RELEASED_SLOT_MEMORY_MS;

/// Source of `lua/acquire.lua`.
pub const ACQUIRE: &str = include_str!("lua/acquire.lua");
/// Source of `lua/release.lua`.
pub const RELEASE: &str = include_str!("lua/release.lua");

/// The Redis key of a key's slot set: `<prefix>cc:{<tag>}` (the tag as in [`super::keys`], so
/// the set is its own Cluster hash slot and no take bucket's key can equal it).
pub fn redis_key(prefix: &str, key: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + key.len().min(70) + 6);
    out.push_str(prefix);
    out.push_str("cc:{");
    push_tag(&mut out, key);
    out.push('}');
    out
}

/// The ARGV of `acquire.lua` for `specs` (all in one call): id, deadline, limits. The deadline is
/// the longest of the keys' (a slot of a request lives as long as its longest-lived rule says).
pub fn acquire_args(specs: &[&SlotSpec], slot: &str) -> Vec<String> {
    let ttl = specs.iter().map(|s| s.ttl_ms).max().unwrap_or(1);
    let mut args = Vec::with_capacity(2 + specs.len());
    args.push(slot.to_string());
    args.push(ttl.to_string());
    args.extend(specs.iter().map(|s| s.limit.to_string()));
    args
}

/// Reads `acquire.lua`'s reply for `specs`: whether it took the slots, and per key a decision.
pub fn decode_acquire(
    reply: &[i64],
    specs: &[&SlotSpec],
) -> Result<(bool, Vec<SlotResult>), StoreError> {
    if reply.len() != 1 + 3 * specs.len() {
        return Err(StoreError::Protocol(format!(
            "acquire reply has {} integers for {} keys",
            reply.len(),
            specs.len()
        )));
    }
    let nat = |v: i64| u64::try_from(v).map_err(|_| StoreError::Protocol("negative count".into()));
    let flag = |v: i64| match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(StoreError::Protocol(format!("flag {v}"))),
    };
    let taken = flag(reply[0])?;
    let mut out = Vec::with_capacity(specs.len());
    for (i, s) in specs.iter().enumerate() {
        let r = &reply[1 + 3 * i..4 + 3 * i];
        out.push(SlotResult {
            allowed: flag(r[0])?,
            limit: s.limit,
            in_flight: nat(r[1])?,
            retry_after_ms: nat(r[2])?,
        });
    }
    if taken != out.iter().all(|d| d.allowed) {
        return Err(StoreError::Protocol(
            "acquire reply disagrees with itself".into(),
        ));
    }
    Ok((taken, out))
}

/// Reads `release.lua`'s reply for `n` keys.
pub fn decode_release(reply: &[i64], n: usize) -> Result<Vec<bool>, StoreError> {
    if reply.len() != n {
        return Err(StoreError::Protocol(format!(
            "release reply has {} integers for {n} keys",
            reply.len()
        )));
    }
    Ok(reply.iter().map(|&v| v == 1).collect())
}

/// The memory store's slots: per key, (slot id, deadline in ms of the store's clock).
#[derive(Debug, Default)]
pub struct SlotTable {
    inner: Mutex<Tables>,
}

#[derive(Debug, Default)]
struct Tables {
    sets: HashMap<String, Vec<(String, u64)>>,
    /// Per key, the names released before their slot was taken, and until when (ms) an acquire
    /// under one takes nothing (`release.lua`'s `~` members).
    released: HashMap<String, Vec<(String, u64)>>,
    /// When the whole table was last swept of expired slots (ms).
    swept_ms: u64,
}

/// How often the whole table is swept (a key never touched again still goes).
const SWEEP_EVERY_MS: u64 = 1000;

impl SlotTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, Tables> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// `acquire.lua`'s semantics at the clock reading `now_ms`.
    pub fn acquire(&self, specs: &[SlotSpec], slot: &str, now_ms: u64) -> AcquireResponse {
        let mut t = self.lock();
        if now_ms >= t.swept_ms.saturating_add(SWEEP_EVERY_MS) {
            t.sets.retain(|_, v| {
                v.retain(|(_, d)| *d > now_ms);
                !v.is_empty()
            });
            t.released.retain(|_, v| {
                v.retain(|(_, until)| *until > now_ms);
                !v.is_empty()
            });
            t.swept_ms = now_ms;
        }
        let mut out = Vec::with_capacity(specs.len());
        for s in specs {
            let released = t
                .released
                .get(&s.key)
                .is_some_and(|v| v.iter().any(|(id, until)| id == slot && *until > now_ms));
            let (n, oldest) = match t.sets.get_mut(&s.key) {
                Some(v) => {
                    v.retain(|(_, d)| *d > now_ms);
                    // An acquire under an id already held here is the same slot again (a caller
                    // that names its slots and asks twice): it does not count against itself.
                    let mine = v.iter().filter(|(id, _)| id == slot).count() as u64;
                    (v.len() as u64 - mine, v.iter().map(|(_, d)| *d).min())
                }
                None => (0, None),
            };
            out.push(if n < s.limit && !released {
                SlotResult {
                    allowed: true,
                    limit: s.limit,
                    in_flight: n + 1,
                    retry_after_ms: 0,
                }
            } else {
                SlotResult {
                    allowed: false,
                    limit: s.limit,
                    in_flight: n,
                    retry_after_ms: slot_retry_after(oldest.map(|d| d.saturating_sub(now_ms))),
                }
            });
        }
        let d = AcquireResponse::from_buckets(out, slot);
        if d.allowed {
            let ttl = specs.iter().map(|s| s.ttl_ms).max().unwrap_or(1);
            for s in specs {
                let v = t.sets.entry(s.key.clone()).or_default();
                // A second acquire under the same id replaces the first, as ZADD does.
                v.retain(|(id, _)| id != slot);
                v.push((slot.to_string(), now_ms.saturating_add(ttl)));
            }
        } else {
            let mut d = d;
            for b in &mut d.buckets {
                if b.allowed {
                    b.in_flight -= 1;
                }
            }
            return d;
        }
        d
    }

    /// `release.lua`'s semantics at the clock reading `now_ms`.
    pub fn release(&self, slot: &str, keys: &[String], now_ms: u64) -> Vec<bool> {
        let mut t = self.lock();
        keys.iter()
            .map(|k| {
                let found = match t.sets.get_mut(k) {
                    Some(v) => {
                        let before = v.len();
                        v.retain(|(id, _)| id != slot);
                        let found = v.len() < before;
                        if v.is_empty() {
                            t.sets.remove(k);
                        }
                        found
                    }
                    None => false,
                };
                if !found {
                    let until = now_ms.saturating_add(RELEASED_SLOT_MEMORY_MS);
                    let names = t.released.entry(k.clone()).or_default();
                    names.retain(|(id, _)| id != slot);
                    names.push((slot.to_string(), until));
                }
                found
            })
            .collect()
    }

    /// `inspect.lua`'s slot reading at `now_ms`: the live slots of `key`, nothing changed.
    pub fn inspect(&self, key: &str, now_ms: u64) -> SlotsState {
        let t = self.lock();
        let mut left: Vec<u64> = t
            .sets
            .get(key)
            .into_iter()
            .flatten()
            .filter(|(_, d)| *d > now_ms)
            .map(|(_, d)| d - now_ms)
            .collect();
        left.sort_unstable();
        let in_flight = left.len() as u64;
        left.truncate(MAX_LISTED_SLOTS);
        SlotsState {
            in_flight,
            deadlines_ms: left,
        }
    }

    /// Forgets `key`'s slots and released names, as `reset.lua` deletes its set; whether a live
    /// slot or a remembered name was held.
    pub fn reset(&self, key: &str, now_ms: u64) -> bool {
        let mut t = self.lock();
        let slots = t
            .sets
            .remove(key)
            .is_some_and(|v| v.iter().any(|(_, d)| *d > now_ms));
        let names = t
            .released
            .remove(key)
            .is_some_and(|v| v.iter().any(|(_, until)| *until > now_ms));
        slots || names
    }

    /// Keys with slots held (expired ones included until swept).
    pub fn len(&self) -> usize {
        self.lock().sets.len()
    }

    /// Whether no key holds a slot.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(key: &str, limit: u64, ttl_ms: u64) -> SlotSpec {
        SlotSpec {
            key: key.into(),
            limit,
            ttl_ms,
        }
    }

    #[test]
    fn all_or_nothing_and_deadlines() {
        let t = SlotTable::default();
        let a = [spec("a", 1, 100)];
        assert!(t.acquire(&a, "1", 0).allowed);
        let d = t.acquire(&[spec("b", 5, 100), spec("a", 1, 100)], "2", 10);
        assert!(!d.allowed && d.slot.is_none());
        assert_eq!(d.buckets[0].in_flight, 0, "b was not taken");
        assert_eq!(d.buckets[1].retry_after_ms, 90);
        // The deadline frees the slot; a late release finds nothing.
        assert!(t.acquire(&a, "3", 100).allowed);
        assert_eq!(t.release("1", &["a".to_string()], 100), vec![false]);
        assert_eq!(t.release("3", &["a".to_string()], 100), vec![true]);
        assert!(t.is_empty());
    }

    #[test]
    fn a_release_that_overtakes_its_acquire_leaves_nothing_taken() {
        let t = SlotTable::default();
        let a = [spec("a", 1, 30_000)];
        // The caller gave up on acquire "9" and released it; the acquire arrives after that.
        assert_eq!(t.release("9", &["a".to_string()], 0), vec![false]);
        let late = t.acquire(&a, "9", 10);
        assert!(!late.allowed && late.buckets[0].in_flight == 0, "{late:?}");
        assert!(t.acquire(&a, "8", 20).allowed, "the key is free for others");
        // Remembered for a minute, then forgotten.
        assert!(t.release("8", &["a".to_string()], 30)[0]);
        let much_later = t.acquire(&a, "9", 30 + RELEASED_SLOT_MEMORY_MS + 1_001);
        assert!(much_later.allowed);
    }

    #[test]
    fn keys_are_tagged_and_apart_from_buckets() {
        assert_eq!(redis_key("tg:", "x{y}"), "tg:cc:{x%7By%7D}");
    }
}
