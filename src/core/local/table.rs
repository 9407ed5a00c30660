//! The proxy's tables in shared data, in one place: how a bucket finds its slot, how a table is
//! created before any request, and the one record format every slot and the breaker's entry use.
//!
//! **Slots.** A table `<name>` of `max_keys` entries `<name>.0 .. <name>.<max_keys-1>` is created
//! at configuration time ([`prepare`]), so that every later write is a compare-and-swap on an
//! entry that exists (shared data has no insert-if-absent). A bucket's slot is picked by SHA-256 of
//! its identity; the first 16 bytes of the digest are the identity kept in the record, so a bucket
//! recognises its own record and a colliding one as another's ([`slot_of`]).
//!
//! **Records.** `[format: u8][identity: 16 bytes][words: n × u64 little endian]`. The format byte
//! says what the record is (and which version of it): a reader that finds another format, or a
//! length that is not its own, treats the record as not its own, never misreads it. So a record
//! written by another version of the module (a configuration push that loads a new module keeps
//! shared data) reads as foreign, and each table's rule for a foreign record applies (the
//! fallback: a newcomer starts empty; a lease pool: none; the breaker: closed).

use crate::core::base::hash::sha256;
use crate::core::base::store::CasStore;

/// A vacant slot (created, never written by a bucket).
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
/// bucket's slot depends on the size, so a push that changes it starts a table of its own and
/// reads what the earlier ones hold, `fallback::Shares::previous`).
pub const SHARES_TABLE: &str = "tollgate.fb";
/// The lease pools' table.
pub const POOLS_TABLE: &str = "tollgate.lease";
/// The remembered denials' table (written without CAS: a lost write only costs a callout).
pub const DENIALS_TABLE: &str = "tollgate.deny";
/// The local fallback slots' table (concurrency rules; counters, not records).
pub const SLOTS_TABLE: &str = "tollgate.cc";

/// Length of the identity kept in a record.
pub const ID_BYTES: usize = 16;

/// One bucket's place in a table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// Shared-data key of the slot.
    pub name: String,
    /// Identity of the bucket (truncated SHA-256 of what identifies it).
    pub id: [u8; ID_BYTES],
}

/// The slot of identity `material` in `table` of `max_keys` slots.
pub fn slot_of(table: &str, material: &[u8], max_keys: u32) -> Slot {
    let h = sha256(material);
    let mut id = [0u8; ID_BYTES];
    id.copy_from_slice(h.get(..ID_BYTES).unwrap_or(&[0u8; ID_BYTES]));
    let mut idx = [0u8; 8];
    idx.copy_from_slice(h.get(16..24).unwrap_or(&[0u8; 8]));
    let n = u64::from_le_bytes(idx) % u64::from(max_keys.max(1));
    Slot {
        name: format!("{table}.{n}"),
        id,
    }
}

/// Creates the slots `<table>.0 .. <table>.<max_keys - 1>` that do not exist yet, holding `vacant`,
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
            "a vacant slot has no identity"
        );
    }

    #[test]
    fn slots_spread_and_identities_differ() {
        let a = slot_of("t", b"a", 8);
        let b = slot_of("t", b"b", 8);
        assert_ne!(a.id, b.id);
        assert!(a.name.starts_with("t.") && a.name[2..].parse::<u32>().unwrap() < 8);
        assert_eq!(slot_of("t", b"a", 8), a, "stable");
    }
}
