//! Local fallback buckets, shared by every worker thread through a [`CasStore`].
//!
//! Bounded by construction: a fixed table of `max_keys` slots, one shared-data entry per slot
//! (`tollgate.fb.<n>`). A bucket lives in the slot its identity hashes to; a different bucket
//! hashing to the same slot evicts it (and starts full). Memory is therefore at most `max_keys`
//! entries of [`SLOT_BYTES`] bytes, whatever clients send. The identity is a SHA-256 of the key
//! and the local limits, so a crafted key cannot pose as another bucket.
//!
//! A request's buckets are taken one by one; if one denies, those already charged are refunded,
//! which approximates the service's all-or-nothing take.

use crate::core::bucket::{self, Limits, State};
use crate::core::config::Algorithm;
use crate::core::hash::sha256;
use crate::core::store::{update, CasStore, Step};
use crate::core::wire::{BucketResult, TakeRequest, TakeResponse};

/// Stored bytes per slot: version, 16-byte identity, level, stamp.
pub const SLOT_BYTES: usize = 1 + 16 + 8 + 8;
const FORMAT: u8 = 1;

/// One bucket's place in the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// Shared-data key of the slot.
    pub name: String,
    /// Identity of the bucket (truncated SHA-256).
    pub id: [u8; 16],
}

/// The slot of a fallback bucket (table `tollgate.fb`).
pub fn slot(key: &str, l: &Limits, max_keys: u32) -> Slot {
    slot_in("tollgate.fb", key, l, max_keys)
}

/// The slot of a bucket in the table `table` of `max_keys` slots (`<table>.<n>`). The lease pools
/// ([`crate::core::lease`]) use the same scheme in a table of their own.
pub fn slot_in(table: &str, key: &str, l: &Limits, max_keys: u32) -> Slot {
    let mut material = Vec::with_capacity(key.len() + 48);
    material.extend_from_slice(key.as_bytes());
    material.push(0);
    for v in [l.capacity, l.rate, l.period_ms, l.divisor] {
        material.extend_from_slice(&v.to_le_bytes());
    }
    material.push(match l.algorithm {
        Algorithm::TokenBucket => 0,
        Algorithm::FixedWindow => 1,
    });
    let h = sha256(&material);
    let mut id = [0u8; 16];
    id.copy_from_slice(h.get(..16).unwrap_or(&[0u8; 16]));
    let mut idx = [0u8; 8];
    idx.copy_from_slice(h.get(16..24).unwrap_or(&[0u8; 8]));
    let n = u64::from_le_bytes(idx) % u64::from(max_keys.max(1));
    Slot {
        name: format!("{table}.{n}"),
        id,
    }
}

fn encode(id: &[u8; 16], s: State) -> Vec<u8> {
    let mut v = Vec::with_capacity(SLOT_BYTES);
    v.push(FORMAT);
    v.extend_from_slice(id);
    v.extend_from_slice(&s.level.to_le_bytes());
    v.extend_from_slice(&s.stamp.to_le_bytes());
    v
}

/// The state stored in a slot, if it belongs to bucket `id` (else the bucket is new or evicted).
fn decode(id: &[u8; 16], bytes: Option<&[u8]>) -> Option<State> {
    let b = bytes?;
    if b.len() != SLOT_BYTES || b.first() != Some(&FORMAT) || b.get(1..17)? != id {
        return None;
    }
    let mut level = [0u8; 8];
    level.copy_from_slice(b.get(17..25)?);
    let mut stamp = [0u8; 8];
    stamp.copy_from_slice(b.get(25..33)?);
    Some(State {
        level: u64::from_le_bytes(level),
        stamp: u64::from_le_bytes(stamp),
    })
}

/// Takes `cost` from one local bucket. When the CAS loop gives up under contention the computed
/// decision is still returned (not stored): the fallback is an approximation by design.
pub fn take<S: CasStore + ?Sized>(
    store: &S,
    key: &str,
    l: &Limits,
    max_keys: u32,
    now_ms: u64,
    cost: u64,
) -> BucketResult {
    let slot = slot(key, l, max_keys);
    update(store, &slot.name, |cur| {
        let (state, result) = bucket::take(l, decode(&slot.id, cur), now_ms, cost);
        Step::Write(encode(&slot.id, state), result)
    })
    .value
}

/// Gives `cost` back to a bucket charged earlier in the same request (skipped if it was evicted
/// meanwhile).
pub fn refund<S: CasStore + ?Sized>(store: &S, key: &str, l: &Limits, max_keys: u32, cost: u64) {
    let slot = slot(key, l, max_keys);
    update(store, &slot.name, |cur| match decode(&slot.id, cur) {
        Some(s) => Step::Write(encode(&slot.id, bucket::refund(l, s, cost)), ()),
        None => Step::Keep(()),
    });
}

/// Takes every bucket of `req` locally, all or nothing, with capacity and rate divided by
/// `instances`. The answer has the contract's shape, so the rest of the filter treats it like the
/// service's.
pub fn take_all<S: CasStore + ?Sized>(
    store: &S,
    req: &TakeRequest,
    instances: u64,
    max_keys: u32,
    now_ms: u64,
) -> TakeResponse {
    let mut results = Vec::with_capacity(req.buckets.len());
    let mut charged: Vec<(usize, Limits, u64)> = Vec::new();
    let mut allowed = true;
    for (i, b) in req.buckets.iter().enumerate() {
        let l = Limits::local(
            b.capacity,
            b.rate.unwrap_or(b.capacity),
            b.period_ms,
            b.algorithm.unwrap_or_default(),
            instances,
        );
        let cost = b.cost.unwrap_or(1);
        let r = take(store, &b.key, &l, max_keys, now_ms, cost);
        if r.allowed {
            charged.push((i, l, cost));
        } else {
            allowed = false;
        }
        results.push(r);
    }
    if !allowed {
        for (i, l, cost) in charged {
            if let Some(b) = req.buckets.get(i) {
                refund(store, &b.key, &l, max_keys, cost);
            }
        }
    }
    TakeResponse {
        allowed,
        buckets: results,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::store::fake::FakeStore;
    use crate::core::wire::Bucket;

    fn tb(cap: u64) -> Limits {
        Limits::local(cap, cap, 1000, Algorithm::TokenBucket, 1)
    }

    fn bucket(key: &str, cap: u64) -> Bucket {
        Bucket {
            key: key.into(),
            capacity: cap,
            rate: Some(cap),
            period_ms: 1000,
            cost: Some(1),
            algorithm: Some(Algorithm::TokenBucket),
            lease: None,
        }
    }

    #[test]
    fn shared_across_callers_and_bounded() {
        let s = FakeStore::default();
        for i in 0..3 {
            let r = take(&s, "k", &tb(3), 100, 0, 1);
            assert!(r.allowed, "take {i}");
        }
        assert!(!take(&s, "k", &tb(3), 100, 0, 1).allowed);
        for i in 0..1000 {
            take(&s, &format!("key{i}"), &tb(3), 100, 0, 1);
        }
        assert!(
            s.map.borrow().len() <= 100,
            "{} slots",
            s.map.borrow().len()
        );
        assert!(s.map.borrow().values().all(|(v, _)| v.len() == SLOT_BYTES));
    }

    #[test]
    fn colliding_key_evicts_the_older_entry() {
        let s = FakeStore::default();
        // One slot: every key collides.
        assert!(take(&s, "a", &tb(1), 1, 0, 1).allowed);
        assert!(!take(&s, "a", &tb(1), 1, 0, 1).allowed);
        assert!(
            take(&s, "b", &tb(1), 1, 0, 1).allowed,
            "b evicts a and starts full"
        );
        assert!(
            take(&s, "a", &tb(1), 1, 0, 1).allowed,
            "a was evicted: starts full again"
        );
        assert_eq!(s.map.borrow().len(), 1);
    }

    #[test]
    fn other_limits_are_another_bucket() {
        assert_ne!(slot("k", &tb(1), 1).id, slot("k", &tb(2), 1).id);
    }

    #[test]
    fn cas_conflicts_are_retried_and_nothing_is_lost() {
        let s = FakeStore::default();
        take(&s, "k", &tb(5), 10, 0, 1);
        s.conflicts.set(3);
        assert!(take(&s, "k", &tb(5), 10, 0, 1).allowed);
        let r = take(&s, "k", &tb(5), 10, 0, 1);
        assert_eq!(r.remaining, 2, "both takes stored despite the conflicts");
    }

    #[test]
    fn all_or_nothing_refunds() {
        let s = FakeStore::default();
        let req = TakeRequest {
            buckets: vec![bucket("wide", 10), bucket("narrow", 1)],
        };
        let a = take_all(&s, &req, 1, 100, 0);
        assert!(a.allowed);
        assert_eq!(a.buckets[0].remaining, 9);
        let b = take_all(&s, &req, 1, 100, 0);
        assert!(!b.allowed);
        assert!(b.buckets[0].allowed && !b.buckets[1].allowed);
        let c = take(&s, "wide", &tb(10), 100, 0, 1);
        assert_eq!(
            c.remaining, 8,
            "the denied request's charge on `wide` was refunded"
        );
    }

    #[test]
    fn instances_divide_the_limit() {
        let s = FakeStore::default();
        let req = TakeRequest {
            buckets: vec![bucket("k", 10)],
        };
        let admitted = (0..10)
            .filter(|_| take_all(&s, &req, 3, 100, 0).allowed)
            .count();
        assert_eq!(admitted, 3);
    }

    #[test]
    fn garbage_in_a_slot_is_a_new_bucket() {
        let s = FakeStore::default();
        let sl = slot("k", &tb(2), 10);
        s.map
            .borrow_mut()
            .insert(sl.name.clone(), (vec![1, 2, 3], 7));
        assert_eq!(take(&s, "k", &tb(2), 10, 0, 1).remaining, 1);
    }
}
