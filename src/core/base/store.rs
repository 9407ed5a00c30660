//! The shared storage the fallback buckets and the breaker live in, as a trait: proxy-wasm shared
//! data in the module (process-wide, visible to every worker's VM), a map in tests.
//!
//! The only primitive is compare-and-swap: read a value with its version, write it back only if
//! the version is unchanged. [`update`] wraps that in a bounded retry loop, so concurrent workers
//! never lose each other's updates, and a storm of conflicts cannot spin forever.
//!
//! A store also holds the memo of the places its tables were last asked for
//! ([`CasStore::memos`]), so the memo is the state of whoever owns the store (a configuration, in
//! the module), never the thread's.

use super::place::Memos;

/// Attempts of one read-modify-write before giving up.
pub const MAX_CAS_ATTEMPTS: u32 = 8;

/// Why a write failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetError {
    /// Someone wrote since our read.
    CasMismatch,
    /// The host refused for another reason.
    Other,
}

/// A key-value store with versioned compare-and-swap writes.
pub trait CasStore {
    /// The value and its version (`None` when absent or unreadable).
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)>;
    /// Writes `value` if the stored version is still `cas` (`None`: unconditionally, used when the
    /// key did not exist: the host offers no "insert if absent").
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;
    /// The memo of the places last found in this store's tables (`core::local::table`): it
    /// spares a hot bucket its SHA-256 and formatted name, and changes no answer.
    fn memos(&self) -> &Memos;
}

/// What an update step decides.
pub enum Change<R> {
    /// Write this value, then return R.
    Write(Vec<u8>, R),
    /// Nothing to write; return R.
    Keep(R),
}

/// The result of [`update`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Updated<R> {
    /// What the last attempt computed.
    pub value: R,
    /// Whether it was stored (false after [`MAX_CAS_ATTEMPTS`] conflicts or a host error).
    pub stored: bool,
}

/// Read-modify-write of `key` with CAS, retried at most [`MAX_CAS_ATTEMPTS`] times. `f` sees the
/// current value (or `None`) and decides; it may run several times and must not have effects.
pub fn update<S, R, F>(store: &S, key: &str, mut f: F) -> Updated<R>
where
    S: CasStore + ?Sized,
    F: FnMut(Option<&[u8]>) -> Change<R>,
{
    let mut attempt = 0;
    loop {
        attempt += 1;
        let current = store.get(key);
        let (cur, cas) = match &current {
            Some((v, cas)) => (Some(v.as_slice()), Some(*cas)),
            None => (None, None),
        };
        match f(cur) {
            Change::Keep(value) => {
                return Updated {
                    value,
                    stored: true,
                }
            }
            Change::Write(bytes, value) => match store.set(key, &bytes, cas) {
                Ok(()) => {
                    return Updated {
                        value,
                        stored: true,
                    }
                }
                Err(SetError::CasMismatch) if attempt < MAX_CAS_ATTEMPTS => continue,
                Err(_) => {
                    return Updated {
                        value,
                        stored: false,
                    }
                }
            },
        }
    }
}

#[cfg(test)]
pub(crate) mod fake {
    //! An in-memory [`CasStore`] with Envoy's semantics, plus conflict injection.
    use super::*;
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;

    #[derive(Default)]
    pub struct FakeStore {
        pub map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        /// The next N writes see a concurrent writer bump the version first.
        pub conflicts: Cell<u32>,
        pub writes: Cell<u32>,
        pub memos: Memos,
    }

    impl CasStore for FakeStore {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.map.borrow().get(key).cloned()
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
            let mut map = self.map.borrow_mut();
            if self.conflicts.get() > 0 {
                self.conflicts.set(self.conflicts.get() - 1);
                if let Some(e) = map.get_mut(key) {
                    e.1 += 1;
                }
            }
            let entry = map.entry(key.to_string()).or_insert((Vec::new(), 0));
            if let Some(c) = cas {
                if c != entry.1 {
                    return Err(SetError::CasMismatch);
                }
            }
            entry.0 = value.to_vec();
            entry.1 += 1;
            self.writes.set(self.writes.get() + 1);
            Ok(())
        }
        fn memos(&self) -> &Memos {
            &self.memos
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::FakeStore;
    use super::*;

    fn incr(store: &FakeStore) -> Updated<u8> {
        update(store, "k", |cur| {
            let n = cur.and_then(|v| v.first().copied()).unwrap_or(0) + 1;
            Change::Write(vec![n], n)
        })
    }

    #[test]
    fn retries_on_conflict_then_stores() {
        let s = FakeStore::default();
        assert_eq!(
            incr(&s),
            Updated {
                value: 1,
                stored: true
            }
        );
        s.conflicts.set(3);
        assert_eq!(
            incr(&s),
            Updated {
                value: 2,
                stored: true
            }
        );
        assert_eq!(s.map.borrow()["k"].0, vec![2]);
    }

    #[test]
    fn gives_up_after_bounded_attempts() {
        let s = FakeStore::default();
        incr(&s);
        s.conflicts.set(MAX_CAS_ATTEMPTS);
        let u = incr(&s);
        assert!(!u.stored);
        assert_eq!(s.conflicts.get(), 0, "exactly MAX_CAS_ATTEMPTS attempts");
        assert_eq!(s.map.borrow()["k"].0, vec![1]);
    }

    #[test]
    fn keep_does_not_write() {
        let s = FakeStore::default();
        let u = update(&s, "k", |_| Change::Keep(7));
        assert_eq!(
            u,
            Updated {
                value: 7,
                stored: true
            }
        );
        assert_eq!(s.writes.get(), 0);
    }
}
