//! The ledger: one table of every callout a VM has in flight, whoever waits for its answer.
//!
//! Envoy answers a callout with the token it handed out when the callout started (on the root
//! context of the plugin that made it), and one VM runs every plugin configuration of its
//! `vm_config`: two listeners, two WasmPlugins from one image, an old and a new configuration
//! during a push. So the table is the VM's, not a plugin's, and so is the token space of the
//! requests that wait in a batch queue (their *virtual* tokens, [`VIRTUAL`] set, which Envoy never
//! hands out: its ids count up by 4 from 0 and wrap far below it): no two waiters, of one plugin
//! or of two, ever hold the same token, across wrap-around too.
//!
//! Each entry says which root context the callout belongs to, so that when Envoy destroys a root
//! (and with it, silently, every callout it made) the adapter can expire them ([`Ledger::close_root`]):
//! every entry is closed exactly once, by its answer or by its root's end. What waits (a request,
//! a batch, a refill, a settlement...) is the adapter's type `W`, so an answer is one `match`.

use std::collections::HashMap;

/// Bit set in every virtual token ([`Ledger::reserve`]); never set in a token Envoy hands out.
pub const VIRTUAL: u32 = 0x8000_0000;

/// One callout in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<W> {
    /// The root context (plugin configuration) the callout was made for.
    pub root: u32,
    /// Who waits for the answer.
    pub waiter: W,
}

/// Hashes the ids Envoy hands out (context ids, callout tokens): small integers no client
/// chooses, so one multiplication spreads them. The default, SipHash, is built for keys an
/// attacker may choose, and these maps are looked up in every callback.
#[derive(Default)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A map keyed by context id or callout token.
pub type IdMap<V> = HashMap<u32, V, std::hash::BuildHasherDefault<IdHasher>>;

/// Every callout of one VM in flight, by token.
#[derive(Debug)]
pub struct Ledger<W> {
    entries: IdMap<Entry<W>>,
    /// The last virtual token handed out, without [`VIRTUAL`].
    last_virtual: u32,
    /// Whether a waiter is a request (counted in [`Ledger::waiting`]).
    is_request: fn(&W) -> bool,
    waiting: usize,
}

impl<W> Ledger<W> {
    /// An empty ledger; `is_request` tells the waiters that are requests (paused streams) from
    /// the rest, for [`Ledger::waiting`].
    pub fn new(is_request: fn(&W) -> bool) -> Self {
        Ledger {
            entries: IdMap::default(),
            last_virtual: 0,
            is_request,
            waiting: 0,
        }
    }

    fn counted(&mut self, added: Option<&W>, removed: Option<&W>) {
        if added.is_some_and(self.is_request) {
            self.waiting += 1;
        }
        if removed.is_some_and(self.is_request) {
            self.waiting = self.waiting.saturating_sub(1);
        }
    }

    /// Records the callout Envoy started under `token`. Envoy does not hand out a token that is
    /// still in flight; if it ever did, the entry it displaces is returned, for the caller to
    /// expire, so that no waiter is left without an end.
    pub fn open(&mut self, token: u32, root: u32, waiter: W) -> Option<Entry<W>> {
        let waits = (self.is_request)(&waiter);
        let old = self.entries.insert(token, Entry { root, waiter });
        self.counted(None, old.as_ref().map(|e| &e.waiter));
        if waits {
            self.waiting += 1;
        }
        old
    }

    /// A token no callout of this VM holds, for a waiter with no callout of its own yet (a
    /// request queued for the next batch), recorded under it.
    pub fn reserve(&mut self, root: u32, waiter: W) -> u32 {
        // At most `len` tokens are taken, far fewer than the 2^31 virtual ones: a free one is
        // found within `len + 1` steps.
        let mut token = VIRTUAL;
        for _ in 0..=self.entries.len() {
            let n = self.last_virtual.wrapping_add(1) & !VIRTUAL;
            self.last_virtual = n;
            token = VIRTUAL | n;
            if !self.entries.contains_key(&token) {
                break;
            }
        }
        self.counted(Some(&waiter), None);
        self.entries.insert(token, Entry { root, waiter });
        token
    }

    /// The answer to `token` arrived (or its waiter went away): the entry, removed.
    pub fn close(&mut self, token: u32) -> Option<Entry<W>> {
        let e = self.entries.remove(&token);
        self.counted(None, e.as_ref().map(|e| &e.waiter));
        e
    }

    /// Removes the entry of `token` if `is` accepts its waiter.
    pub fn close_if(&mut self, token: u32, is: impl FnOnce(&W) -> bool) -> Option<Entry<W>> {
        if self.entries.get(&token).is_some_and(|e| is(&e.waiter)) {
            return self.close(token);
        }
        None
    }

    /// The entry of `token`.
    pub fn get(&self, token: u32) -> Option<&Entry<W>> {
        self.entries.get(&token)
    }

    /// Hands the answer of `token` to another waiter (a request that went away while its callout
    /// was in flight leaves the answer to its root); the one it had.
    pub fn replace(&mut self, token: u32, waiter: W) -> Option<W> {
        let e = self.entries.get_mut(&token)?;
        let old = std::mem::replace(&mut e.waiter, waiter);
        let is_request = self.is_request;
        if is_request(&old) {
            self.waiting = self.waiting.saturating_sub(1);
        }
        if self
            .entries
            .get(&token)
            .is_some_and(|e| is_request(&e.waiter))
        {
            self.waiting += 1;
        }
        Some(old)
    }

    /// Root context `root` is gone, and Envoy cancelled its callouts without a word: their
    /// entries, removed (in no particular order).
    pub fn close_root(&mut self, root: u32) -> Vec<(u32, W)> {
        let tokens: Vec<u32> = self
            .entries
            .iter()
            .filter(|(_, e)| e.root == root)
            .map(|(&t, _)| t)
            .collect();
        tokens
            .into_iter()
            .filter_map(|t| self.close(t).map(|e| (t, e.waiter)))
            .collect()
    }

    /// Entries whose waiter is a request (paused, waiting for its callout or its batch).
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// Callouts in flight (and queued requests).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Nothing is in flight.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[test]
    fn two_roots_never_share_a_virtual_token() {
        let mut l: Ledger<&str> = Ledger::new(|w| w.len() > 1);
        let a = l.reserve(1, "a");
        let b = l.reserve(2, "b");
        assert_ne!(a, b);
        assert!(a & VIRTUAL != 0 && b & VIRTUAL != 0);
        assert_eq!(l.close(a).map(|e| e.waiter), Some("a"));
        assert_eq!(l.close(b).map(|e| (e.root, e.waiter)), Some((2, "b")));
        assert!(l.is_empty());
    }

    #[test]
    fn wrap_around_skips_the_tokens_still_waiting() {
        let mut l: Ledger<u32> = Ledger::new(|_| true);
        let first = l.reserve(1, 0);
        l.last_virtual = !VIRTUAL - 1;
        let top = l.reserve(1, 1);
        assert_eq!(top, u32::MAX);
        // The counter wraps to 0, then 1, which is still taken by `first`: skipped.
        let zero = l.reserve(1, 2);
        assert_eq!(zero, VIRTUAL);
        let next = l.reserve(1, 3);
        assert_ne!(next, first);
        assert_eq!(next, VIRTUAL | 2);
        assert_eq!(l.len(), 4);
    }

    #[test]
    fn a_root_going_away_closes_its_entries_only() {
        let mut l: Ledger<&str> = Ledger::new(|w| w.len() > 1);
        l.open(8, 1, "take");
        l.open(12, 2, "other plugin's take");
        let q = l.reserve(1, "queued");
        let mut closed = l.close_root(1);
        closed.sort_unstable();
        assert_eq!(closed, vec![(8, "take"), (q, "queued")]);
        assert_eq!(l.len(), 1);
        assert_eq!(l.close_if(12, |w| *w == "nope"), None);
        assert_eq!(l.waiting(), 1);
        assert_eq!(l.replace(12, "x"), Some("other plugin's take"));
        assert_eq!(l.waiting(), 0, "a request's answer handed to a non-request");
        assert!(l.close_if(12, |w| *w == "x").is_some());
        assert!(l.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Envoy starts a callout for root `r % 3`.
        Open(u8),
        /// A request of root `r % 3` joins a batch queue.
        Reserve(u8),
        /// The `i`-th live token is answered (or its waiter goes away).
        Close(u16),
        /// A root goes away.
        DropRoot(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            any::<u8>().prop_map(Op::Open),
            any::<u8>().prop_map(Op::Reserve),
            any::<u16>().prop_map(Op::Close),
            any::<u8>().prop_map(Op::DropRoot),
        ]
    }

    proptest! {
        /// Whatever the order of callouts, queued requests, answers and roots going away: no
        /// token is ever held by two waiters, and every waiter ends exactly once (by its answer or
        /// by its root's end), starting near the virtual counter's wrap-around.
        #[test]
        fn every_waiter_ends_exactly_once(ops in proptest::collection::vec(op(), 1..200), start in any::<u32>()) {
            let mut l: Ledger<u64> = Ledger::new(|w| w % 2 == 0);
            l.last_virtual = (start & !VIRTUAL) | 0x7fff_ff00;
            let mut next_envoy: u32 = 0;
            let mut next_waiter: u64 = 0;
            let mut live: Vec<(u32, u64)> = Vec::new();
            let mut ended: HashSet<u64> = HashSet::new();
            for op in ops {
                match op {
                    Op::Open(r) => {
                        next_envoy = next_envoy.wrapping_add(4) & !VIRTUAL;
                        if live.iter().any(|(t, _)| *t == next_envoy) {
                            continue;
                        }
                        let w = next_waiter;
                        next_waiter += 1;
                        prop_assert!(l.open(next_envoy, u32::from(r % 3), w).is_none());
                        live.push((next_envoy, w));
                    }
                    Op::Reserve(r) => {
                        let w = next_waiter;
                        next_waiter += 1;
                        let t = l.reserve(u32::from(r % 3), w);
                        prop_assert!(t & VIRTUAL != 0);
                        prop_assert!(!live.iter().any(|(lt, _)| *lt == t), "token {} handed out twice", t);
                        live.push((t, w));
                    }
                    Op::Close(i) => {
                        if live.is_empty() {
                            continue;
                        }
                        let (t, w) = live.swap_remove(usize::from(i) % live.len());
                        let e = l.close(t);
                        prop_assert_eq!(e.map(|e| e.waiter), Some(w));
                        prop_assert!(ended.insert(w));
                        prop_assert!(l.close(t).is_none(), "closed twice");
                    }
                    Op::DropRoot(r) => {
                        let root = u32::from(r % 3);
                        for (_, w) in l.close_root(root) {
                            prop_assert!(ended.insert(w));
                            live.retain(|(_, lw)| *lw != w);
                        }
                    }
                }
                prop_assert_eq!(l.len(), live.len());
                prop_assert_eq!(l.waiting(), live.iter().filter(|(_, w)| w % 2 == 0).count());
            }
            for (t, w) in live {
                prop_assert_eq!(l.close(t).map(|e| e.waiter), Some(w));
                prop_assert!(ended.insert(w));
            }
            prop_assert_eq!(ended.len() as u64, next_waiter);
        }
    }
}
