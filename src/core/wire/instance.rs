//! This proxy's instance id, and the number of live instances the service reports.
//!
//! **The id.** One per Envoy process, shared by its VMs: the first VM to configure draws 8 random
//! bytes (the standard library's per-process random hash keys, from WASI `random_get`) and stores
//! their hex in shared data ([`ID_KEY`]); every VM adopts what is stored ([`adopt`]). Two VMs
//! configuring at the same instant may each store their own and, for a while, send two ids for one
//! Envoy: the service then counts one proxy too many, which only makes every fallback share
//! smaller. The id travels with every take (`instance`, contract/README.md), 16 bytes.
//!
//! **The count.** Every answer carries the deployment's live instances (`instances`); after each
//! answer the fallback stores it in shared data for every worker of this Envoy
//! (`crate::core::local::fallback`), which splits limits by it.
//!
//! The adapter adopts the id when it takes a configuration and keeps it in that configuration
//! (`Config::instance`); every encoder is given it (`None`: a callout without one, as in native
//! tests and the checker).

use std::hash::{BuildHasher, Hasher};

use crate::core::base::store::CasStore;

/// Shared-data key of this Envoy's instance id.
pub const ID_KEY: &str = "tollgate.instance";
/// Length of an id: 16 hex digits.
pub const ID_LEN: usize = 16;

fn valid(id: &[u8]) -> bool {
    id.len() == ID_LEN && id.iter().all(u8::is_ascii_hexdigit)
}

/// 16 random hex digits.
pub fn fresh() -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u8(0);
    let n = h.finish();
    (0..ID_LEN)
        .rev()
        .map(|i| crate::core::base::hash::hex_digit(((n >> (4 * i)) & 0xf) as u8, false))
        .collect()
}

/// This Envoy's id, created when no VM has one yet.
pub fn adopt<S: CasStore + ?Sized>(store: &S) -> String {
    let stored = |s: &S| {
        s.get(ID_KEY)
            .filter(|(v, _)| valid(v))
            .and_then(|(v, _)| String::from_utf8(v).ok())
    };
    let id = match stored(store) {
        Some(id) => id,
        None => {
            let mine = fresh();
            let _ = store.set(ID_KEY, mine.as_bytes(), None);
            // Whoever wrote last wins; read it back so VMs racing here mostly agree.
            stored(store).unwrap_or(mine)
        }
    };
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::base::store::fake::FakeStore;

    #[test]
    fn one_id_per_envoy() {
        let store = FakeStore::default();
        let a = adopt(&store);
        assert!(valid(a.as_bytes()), "{a}");
        assert_eq!(adopt(&store), a, "a second VM adopts the first one's id");
        assert_ne!(fresh(), fresh(), "random");
    }
}
