//! A bucket's place in a shared-data table ([`Place`]: the entry's name and the identity its record
//! carries), and the memo of the last places a store's tables were asked for ([`Memos`]). The
//! scheme that picks a place is `core::local::table`'s; the memo is state of whoever owns the
//! store (a configuration, in the module: [`super::store::CasStore::memos`]), so two owners never
//! share one and nothing of it lives in the thread.

use std::cell::Cell;

/// Length of the identity kept in a record.
pub const ID_BYTES: usize = 16;

/// One bucket's place in a table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// Shared-data key of the place.
    pub name: String,
    /// Identity of the bucket (truncated SHA-256 of what identifies it).
    pub id: [u8; ID_BYTES],
}

/// The last place computed, beside what it was computed for (an identity `I` and the key): a memo
/// of one, which changes no answer (the table's tests compare it with the place computed afresh).
pub struct Memo<I> {
    last: Cell<Option<(I, String, Place)>>,
}

impl<I: PartialEq> Default for Memo<I> {
    fn default() -> Self {
        Memo::new()
    }
}

impl<I: PartialEq> Memo<I> {
    /// An empty memo.
    pub const fn new() -> Self {
        Memo {
            last: Cell::new(None),
        }
    }

    /// The place of `id` and `key`: the one held when it was asked for the same last, else
    /// `compute`'s, which is then held.
    pub fn remembered(&self, id: I, key: &str, compute: impl FnOnce() -> Place) -> Place {
        let mut last = self.last.take();
        let s = match &last {
            Some((i, k, s)) if *i == id && k == key => s.clone(),
            _ => {
                let s = compute();
                last = Some((id, key.to_string(), s.clone()));
                s
            }
        };
        self.last.set(last);
        s
    }
}

/// What a place in a table other than the shares' is remembered under, beside the key: the table,
/// the global limits (capacity, rate, period), the algorithm's code and the table size.
pub type PlaceInId = (&'static str, u64, u64, u64, u8, u32);

/// The memos of one store's place lookups: the last fallback share (under the algorithm's code and
/// the table size) and the last place of another table ([`PlaceInId`]).
#[derive(Default)]
pub struct Memos {
    /// The last fallback share's place.
    pub shares: Memo<(u8, u32)>,
    /// The last place of another table.
    pub tables: Memo<PlaceInId>,
}
