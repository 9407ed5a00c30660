//! The proxy's tables in shared data, in one place: how a bucket finds its place ([`place_in`],
//! [`share_place`], the last one remembered in the store's [`Memos`]), how a table is created before any request
//! ([`prepare`]), the prefix every name of a configuration's state carries ([`state_prefix`]), and
//! the one record format every place and the admission record use.
//!
//! **Places.** A table `<name>` of `max_keys` entries `<name>.0 .. <name>.<max_keys-1>` is created
//! at configuration time ([`prepare`]), so that every later write is a compare-and-swap on an
//! entry that exists (shared data has no insert-if-absent). A bucket's place is picked by SHA-256 of
//! its identity; the first 16 bytes of the digest are the identity kept in the record, so a bucket
//! recognises its own record and a colliding one as another's ([`place_of`]).
//!
//! **Records.** `[format: u8][identity: 16 bytes][words: n × u64 little endian]`. The format byte
//! says what the record is (and which version of it): a reader that finds another format, or a
//! length that is not its own, treats the record as not its own, never misreads it. So a record
//! written by another version of the module (a configuration push that loads a new module keeps
//! shared data) reads as foreign, and each table's rule for a foreign record applies (the
//! fallback: a newcomer starts empty; a lease pool: none; the breaker: closed).

use crate::core::base::hash::sha256;
use crate::core::base::place::{Memos, PlaceInId};
pub use crate::core::base::place::{Place, ID_BYTES};
use crate::core::base::store::CasStore;
use crate::core::config::Config;
use crate::core::local::bucket::{self, Limits};

/// A vacant place (created, never written by a bucket).
pub const VACANT: u8 = 0;
/// A fallback share ([`crate::core::local::fallback`]).
pub const SHARE: u8 = 0x11;
/// A lease pool ([`crate::core::local::lease`]).
pub const POOL: u8 = 0x12;
/// The breaker's state ([`crate::core::local::breaker`]).
pub const BREAKER: u8 = 0x13;
/// A remembered denial ([`crate::core::local::denials`]).
pub const DENIAL: u8 = 0x14;

/// Shared-data tables of the fallback shares: one per table size, `tollgate.fb.<max_keys>` (a
/// bucket's place depends on the size, so a push that changes it starts a table of its own and
/// reads what the earlier ones hold, `fallback::Shares::previous`).
pub const SHARES_TABLE: &str = "tollgate.fb";
/// The lease pools' table.
pub const POOLS_TABLE: &str = "tollgate.lease";
/// The remembered denials' table (written without CAS: a lost write only costs a callout).
pub const DENIALS_TABLE: &str = "tollgate.deny";
/// The local fallback slots' table (concurrency rules; counters, not records).
pub const SLOTS_TABLE: &str = "tollgate.cc";

/// The place of identity `material` in `table` of `max_keys` places.
pub fn place_of(table: &str, material: &[u8], max_keys: u32) -> Place {
    let h = sha256(material);
    let mut id = [0u8; ID_BYTES];
    id.copy_from_slice(h.get(..ID_BYTES).unwrap_or(&[0u8; ID_BYTES]));
    let mut idx = [0u8; 8];
    idx.copy_from_slice(h.get(16..24).unwrap_or(&[0u8; 8]));
    let n = u64::from_le_bytes(idx) % u64::from(max_keys.max(1));
    Place {
        name: format!("{table}.{n}"),
        id,
    }
}

/// The place of a fallback share of bucket `key` in the table `table` of `max_keys` places
/// ([`crate::core::local::fallback`]). The identity covers the key and the algorithm only: the
/// limits are recorded in the place, and a change carries the share over. Remembered in `memos`
/// (the store's, [`CasStore::memos`]): every answer of a hot bucket asks for the same one, and a
/// SHA-256 with two formatted names cost Envoy about 9,500 instructions of an exact request's
/// 326,000.
/// The table's name is formatted only when the place is computed: a remembered place costs no
/// allocation (formatting it on every answer was 880 of a steady exact request's instructions,
/// natively).
pub fn share_place(memos: &Memos, key: &str, l: &Limits, max_keys: u32) -> Place {
    let alg = bucket::code(l.algorithm);
    memos.shares.remembered((alg, max_keys), key, || {
        compute_share_place(&shares_table(max_keys), key, alg, max_keys)
    })
}

/// The name of the fallback shares' table of `max_keys` places (`tollgate.fb.<max_keys>`).
pub fn shares_table(max_keys: u32) -> String {
    format!("{SHARES_TABLE}.{max_keys}")
}

/// [`share_place`] without the memo: the key and the algorithm's code, hashed into the table.
fn compute_share_place(table: &str, key: &str, alg: u8, max_keys: u32) -> Place {
    let mut material = Vec::with_capacity(key.len() + 2);
    material.extend_from_slice(key.as_bytes());
    material.push(0);
    material.push(alg);
    place_of(table, &material, max_keys)
}

/// The place of a bucket in the table `table` of `max_keys` places (`<table>.<n>`). The identity
/// covers the key and the global limits (not the number of proxies), like the service's bucket
/// identity: the lease pools' and the remembered denials' scheme. Remembered in `memos`, as
/// [`share_place`]'s is: every request of a flood denied from memory asks for the same one, and its
/// SHA-256 and formatted name were a quarter of such a request's work in the module.
pub fn place_in(memos: &Memos, table: &'static str, key: &str, l: &Limits, max_keys: u32) -> Place {
    memos
        .tables
        .remembered(place_in_id(table, l, max_keys), key, || {
            compute_place_in(table, key, l, max_keys)
        })
}

/// What [`place_in`] remembers its last place under, beside the key.
fn place_in_id(table: &'static str, l: &Limits, max_keys: u32) -> PlaceInId {
    (
        table,
        l.global,
        l.rate,
        l.period_ms,
        bucket::code(l.algorithm),
        max_keys,
    )
}

/// [`place_in`] without the memo.
fn compute_place_in(table: &str, key: &str, l: &Limits, max_keys: u32) -> Place {
    let mut material = Vec::with_capacity(key.len() + 48);
    material.extend_from_slice(key.as_bytes());
    material.push(0);
    for v in [l.global, l.rate, l.period_ms] {
        material.extend_from_slice(&v.to_le_bytes());
    }
    material.push(bucket::code(l.algorithm));
    place_of(table, &material, max_keys)
}

/// The prefix of every shared-data name a configuration uses: a digest of the service cluster.
/// Fallback shares, lease pools and the admission record describe that service's buckets
/// (identified by key and limits, like the service's own), so a configuration push that keeps the
/// cluster keeps them, and two plugins calling one service share them; memory stays bounded by
/// the largest table.
pub fn state_prefix(cfg: &Config) -> String {
    let digest = crate::core::base::hash::sha256_hex(cfg.service.cluster.as_bytes());
    format!("{}/", digest.get(..12).unwrap_or(&digest))
}

/// Creates the places `<table>.0 .. <table>.<max_keys - 1>` that do not exist yet, holding `vacant`,
/// so that every later write is a CAS on an existing entry. Called at configuration time by every
/// VM; `<table>.ready` remembers the largest table prepared so later VMs skip the walk. Two VMs
/// preparing at once both write the same vacant record, which is harmless.
pub fn prepare<S: CasStore + ?Sized>(store: &S, table: &str, max_keys: u32, vacant: &[u8]) {
    let ready = format!("{table}.ready");
    let done = store
        .get(&ready)
        .and_then(|(v, _)| <[u8; 4]>::try_from(v.get(..4)?).ok())
        .map(u32::from_le_bytes)
        .unwrap_or(0);
    if done >= max_keys {
        return;
    }
    for n in 0..max_keys {
        let name = format!("{table}.{n}");
        if store.get(&name).is_none() {
            let _ = store.set(&name, vacant, None);
        }
    }
    let _ = store.set(&ready, &max_keys.to_le_bytes(), None);
}

/// A record of `format` for identity `id` holding `words`.
pub fn encode(format: u8, id: &[u8; ID_BYTES], words: &[u64]) -> Vec<u8> {
    let mut v = Vec::with_capacity(1 + ID_BYTES + 8 * words.len());
    v.push(format);
    v.extend_from_slice(id);
    for w in words {
        v.extend_from_slice(&w.to_le_bytes());
    }
    v
}

/// A vacant record (what [`prepare`] writes): the format byte alone.
pub fn vacant() -> Vec<u8> {
    vec![VACANT]
}

/// Whether `bytes` is a vacant record.
pub fn is_vacant(bytes: &[u8]) -> bool {
    bytes == [VACANT]
}

/// The identity and the `N` words of a record of `format`; `None` for any other format or length.
pub fn decode<const N: usize>(format: u8, bytes: &[u8]) -> Option<([u8; ID_BYTES], [u64; N])> {
    if bytes.len() != 1 + ID_BYTES + 8 * N || bytes.first() != Some(&format) {
        return None;
    }
    let mut id = [0u8; ID_BYTES];
    id.copy_from_slice(bytes.get(1..1 + ID_BYTES)?);
    let mut words = [0u64; N];
    for (w, chunk) in words
        .iter_mut()
        .zip(bytes.get(1 + ID_BYTES..)?.chunks_exact(8))
    {
        let mut b = [0u8; 8];
        b.copy_from_slice(chunk);
        *w = u64::from_le_bytes(b);
    }
    Some((id, words))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_only_as_its_own_format_and_length() {
        let id = [7u8; ID_BYTES];
        let r = encode(SHARE, &id, &[1, u64::MAX, 3]);
        assert_eq!(r.len(), 1 + 16 + 24);
        assert_eq!(decode::<3>(SHARE, &r), Some((id, [1, u64::MAX, 3])));
        assert_eq!(decode::<3>(POOL, &r), None, "another format");
        assert_eq!(decode::<2>(SHARE, &r), None, "another length");
        assert_eq!(decode::<4>(SHARE, &r), None);
        assert_eq!(decode::<3>(SHARE, &r[..r.len() - 1]), None);
        assert!(is_vacant(&vacant()));
        assert!(!is_vacant(&r));
        assert_eq!(
            decode::<0>(VACANT, &vacant()),
            None,
            "a vacant place has no identity"
        );
    }

    #[test]
    fn places_spread_and_identities_differ() {
        let a = place_of("t", b"a", 8);
        let b = place_of("t", b"b", 8);
        assert_ne!(a.id, b.id);
        assert!(a.name.starts_with("t.") && a.name[2..].parse::<u32>().unwrap() < 8);
        assert_eq!(place_of("t", b"a", 8), a, "stable");
    }

    fn tb(cap: u64) -> Limits {
        Limits::local(
            cap,
            cap,
            1000,
            crate::core::config::Algorithm::TokenBucket,
            1,
        )
    }

    #[test]
    fn a_remembered_place_is_the_one_computed() {
        use crate::core::config::Algorithm;
        let memos = Memos::default();
        let place = |key: &str, l: &Limits, n: u32| share_place(&memos, key, l, n);
        let computed = |key: &str, l: &Limits, n: u32| {
            compute_share_place(&shares_table(n), key, bucket::code(l.algorithm), n)
        };
        let fw = Limits::local(10, 10, 1000, Algorithm::FixedWindow, 1);
        // Asked again, in turn and after others: the same key with another algorithm or table
        // size is another place.
        for (key, l, n) in [
            ("a", tb(10), 64),
            ("a", tb(10), 64),
            ("a", fw, 64),
            ("a", tb(10), 128),
            ("b", tb(10), 64),
            ("a", tb(10), 64),
            ("", tb(10), 64),
        ] {
            assert_eq!(place(key, &l, n), computed(key, &l, n), "{key} {n}");
        }
        assert_ne!(place("a", &tb(10), 64), place("a", &fw, 64));
    }

    #[test]
    fn a_remembered_place_in_a_table_is_the_one_computed() {
        use crate::core::config::Algorithm;
        let fw = Limits::local(10, 10, 1000, Algorithm::FixedWindow, 1);
        let slower = Limits::local(10, 10, 2000, Algorithm::TokenBucket, 1);
        let shared_by_3 = Limits::local(10, 10, 1000, Algorithm::TokenBucket, 3);
        let memos = Memos::default();
        // Asked again, in turn and after others: another table, key, limit, algorithm or table
        // size is another place; the number of proxies is not part of the identity.
        for (table, key, l, n) in [
            (DENIALS_TABLE, "a", tb(10), 64),
            (DENIALS_TABLE, "a", tb(10), 64),
            (POOLS_TABLE, "a", tb(10), 64),
            (DENIALS_TABLE, "a", fw, 64),
            (DENIALS_TABLE, "a", tb(11), 64),
            (DENIALS_TABLE, "a", slower, 64),
            (DENIALS_TABLE, "a", tb(10), 128),
            (DENIALS_TABLE, "b", tb(10), 64),
            (DENIALS_TABLE, "a", shared_by_3, 64),
            (DENIALS_TABLE, "", tb(10), 64),
        ] {
            assert_eq!(
                place_in(&memos, table, key, &l, n),
                compute_place_in(table, key, &l, n),
                "{table} {key} {n}"
            );
        }
        assert_ne!(
            place_in(&memos, DENIALS_TABLE, "a", &tb(10), 64),
            place_in(&memos, POOLS_TABLE, "a", &tb(10), 64)
        );
    }

    #[test]
    fn two_stores_do_not_share_a_memo() {
        use crate::core::base::store::fake::FakeStore;
        use std::cell::Cell;
        // Two configurations' stores: a place found through one is remembered there alone.
        let (one, other) = (FakeStore::default(), FakeStore::default());
        let l = tb(10);
        let found = place_in(one.memos(), DENIALS_TABLE, "k", &l, 64);
        let computes = |store: &FakeStore| {
            let n = Cell::new(0);
            let place =
                store
                    .memos()
                    .tables
                    .remembered(place_in_id(DENIALS_TABLE, &l, 64), "k", || {
                        n.set(n.get() + 1);
                        compute_place_in(DENIALS_TABLE, "k", &l, 64)
                    });
            assert_eq!(place, found);
            n.get()
        };
        assert_eq!(computes(&one), 0, "remembered by the store that found it");
        assert_eq!(computes(&other), 1, "computed afresh by the other");
        assert_eq!(computes(&other), 0, "then remembered there too");
    }
}
