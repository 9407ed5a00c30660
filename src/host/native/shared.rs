//! Shared data in the process's own memory: what proxy-wasm shared data is to the wasm build
//! (one store every worker sees, values with a version for compare-and-swap), as a map behind a
//! lock. The core's tables name a bounded set of keys (`core::local::table`), so the map is
//! bounded as the host's shared data is.
//!
//! Versions follow proxy-wasm's: a key written for the first time is at version 1, each write
//! adds one; a write with a version that is not the stored one is refused (`CasMismatch`), a
//! write without one (or with 0), or to a key not stored yet, always lands (Envoy's
//! `SharedData::set`).

use crate::core::base::store::SetError;
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

/// A map of values and their versions.
#[derive(Default)]
pub struct Store {
    map: Mutex<HashMap<String, (Vec<u8>, u32)>>,
}

impl Store {
    pub fn new() -> Store {
        Store::default()
    }

    /// The value of `key` and its version.
    pub fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        let map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        map.get(key).map(|(v, cas)| (v.clone(), *cas))
    }

    /// Writes `value` if the stored version is `cas` (any version when `None` or 0, and a key
    /// not stored yet).
    pub fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        match map.get_mut(key) {
            Some((stored, version)) => {
                if cas.is_some_and(|c| c != 0 && c != *version) {
                    return Err(SetError::CasMismatch);
                }
                stored.clear();
                stored.extend_from_slice(value);
                *version = version.wrapping_add(1).max(1);
            }
            None => {
                map.insert(key.to_string(), (value.to_vec(), 1));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::base::place::Memos;
    use crate::core::base::store::{update, CasStore, Change};
    use std::sync::Arc;

    struct On<'a>(&'a Store, Memos);

    impl CasStore for On<'_> {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.0.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
            self.0.set(key, value, cas)
        }
        fn memos(&self) -> &Memos {
            &self.1
        }
    }

    #[test]
    fn a_write_on_a_stale_version_is_refused() {
        let s = Store::new();
        assert_eq!(s.get("k"), None);
        assert_eq!(s.set("k", b"a", None), Ok(()));
        assert_eq!(s.get("k"), Some((b"a".to_vec(), 1)));
        assert_eq!(s.set("k", b"b", Some(1)), Ok(()));
        assert_eq!(s.set("k", b"c", Some(1)), Err(SetError::CasMismatch));
        assert_eq!(s.get("k"), Some((b"b".to_vec(), 2)));
        assert_eq!(s.set("k", b"d", Some(0)), Ok(()));
        assert_eq!(s.set("new", b"x", Some(3)), Ok(()));
        assert_eq!(s.get("new"), Some((b"x".to_vec(), 1)));
    }

    /// Eight threads add one each 1,000 times through the core's own retry loop: not one
    /// increment lost (a retry that gave up is counted and retried by the thread).
    #[test]
    fn workers_updating_one_key_lose_nothing() {
        let store = Arc::new(Store::new());
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let on = On(&store, Memos::default());
                    let mut done = 0;
                    while done < 1_000 {
                        let r = update(&on, "n", |v| {
                            let n = v
                                .and_then(|b| std::str::from_utf8(b).ok()?.parse::<u64>().ok())
                                .unwrap_or(0);
                            Change::Write((n + 1).to_string().into_bytes(), ())
                        });
                        if r.stored {
                            done += 1;
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            assert!(t.join().is_ok());
        }
        let (v, _) = store.get("n").unwrap_or_default();
        assert_eq!(v, b"8000");
    }
}
