//! The ledger: one table of every callout a VM has in flight, whoever waits for its answer.
//!
//! Envoy answers a callout with the token it handed out when the callout started (on the root
//! context of the plugin that made it), and one VM runs every plugin configuration of its
//! `vm_config`: two listeners, two WasmPlugins from one image, an old and a new configuration
//! during a push. So the table is the VM's, not a plugin's, and so are the ids of what waits
//! without a token of Envoy's (a request queued for the next batch, a message on a stream).
//!
//! An entry is keyed by a [`CalloutId`], a `u64` from two spaces that cannot meet: Envoy's tokens
//! (`u32`, below 2^32; its counter steps by 4 for the life of a worker's VM and wraps with no
//! check) and the VM's own ([`Ledger::reserve`]), counted up from 2^32 and never reused (at a
//! million a second, the counter would take half a million years to wrap). A token Envoy hands out
//! while an entry still holds it is an error of its bookkeeping, not ours: the entry it displaces is
//! set aside ([`Ledger::displaced`]) for the adapter to fail, never handed to the new callout's
//! waiter.
//!
//! Each entry says which root context the callout belongs to, so that when Envoy destroys a root
//! (and with it, silently, every callout it made) the adapter can expire them ([`Ledger::close_root`]):
//! every entry is closed exactly once, by its answer, by its root's end, or by being displaced.
//! What waits (a request, a batch, a refill, a settlement...) is the adapter's type `W`, so an
//! answer is one `match`.

use std::collections::HashMap;

/// The id of a callout (or of something that waits like one) in the ledger: one of Envoy's tokens
/// (`CalloutId::from(token)`, below 2^32) or one of the VM's own (from [`FIRST_OWN`] up). The
/// VM's own ids are also the ids of the messages on a stream of takes (contract/README.md: 1..,
/// distinct among a stream's messages in flight).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CalloutId(pub u64);

/// The first id the VM hands out itself: above every token of Envoy's.
pub const FIRST_OWN: u64 = 1 << 32;

impl From<u32> for CalloutId {
    /// One of Envoy's callout tokens.
    fn from(token: u32) -> Self {
        CalloutId(u64::from(token))
    }
}

impl core::fmt::Display for CalloutId {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        self.0.fmt(f)
    }
}

/// One callout in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<W> {
    /// The root context (plugin configuration) the callout was made for.
    pub root: u32,
    /// Who waits for the answer.
    pub waiter: W,
}

/// Hashes the ids Envoy hands out (context ids, callout tokens) and the VM's own: integers no
/// client chooses, so one multiplication spreads them. The default, SipHash, is built for keys an
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

    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A map keyed by context id.
pub type IdMap<V> = HashMap<u32, V, std::hash::BuildHasherDefault<IdHasher>>;

/// Every callout of one VM in flight, by id.
#[derive(Debug)]
pub struct Ledger<W> {
    entries: HashMap<CalloutId, Entry<W>, std::hash::BuildHasherDefault<IdHasher>>,
    /// The next id the VM hands out itself.
    next_own: u64,
    /// Entries a token of Envoy's displaced, for the adapter to fail ([`Ledger::displaced`]).
    displaced: Vec<(CalloutId, Entry<W>)>,
    /// Whether a waiter is a request (counted in [`Ledger::waiting`]).
    is_request: fn(&W) -> bool,
    waiting: usize,
}

impl<W> Ledger<W> {
    /// An empty ledger; `is_request` tells the waiters that are requests (paused streams) from
    /// the rest, for [`Ledger::waiting`].
    pub fn new(is_request: fn(&W) -> bool) -> Self {
        Ledger {
            entries: HashMap::default(),
            next_own: FIRST_OWN,
            displaced: Vec::new(),
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

    /// Records the callout Envoy started under `token`. Envoy should not hand out a token still
    /// in flight, but its counter wraps unchecked: if it does, the entry it displaces is set
    /// aside for the adapter to fail ([`Ledger::displaced`]) and `true` is returned (an error to
    /// count), so that no waiter is left without an end or handed another's answer.
    pub fn open(&mut self, token: u32, root: u32, waiter: W) -> bool {
        let id = CalloutId::from(token);
        self.counted(Some(&waiter), None);
        let Some(old) = self.entries.insert(id, Entry { root, waiter }) else {
            return false;
        };
        self.counted(None, Some(&old.waiter));
        self.displaced.push((id, old));
        true
    }

    /// An id no callout of this VM holds or ever held, for a waiter with no token of Envoy's (a
    /// request queued for the next batch, a message on a stream), recorded under it.
    pub fn reserve(&mut self, root: u32, waiter: W) -> CalloutId {
        let id = CalloutId(self.next_own);
        self.next_own = self.next_own.saturating_add(1);
        self.counted(Some(&waiter), None);
        self.entries.insert(id, Entry { root, waiter });
        id
    }

    /// The answer to `id` arrived (or its waiter went away): the entry, removed.
    pub fn close(&mut self, id: CalloutId) -> Option<Entry<W>> {
        let e = self.entries.remove(&id);
        self.counted(None, e.as_ref().map(|e| &e.waiter));
        e
    }

    /// Removes the entry of `id` if `is` accepts its waiter.
    pub fn close_if(&mut self, id: CalloutId, is: impl FnOnce(&W) -> bool) -> Option<Entry<W>> {
        if self.entries.get(&id).is_some_and(|e| is(&e.waiter)) {
            return self.close(id);
        }
        None
    }

    /// The entry of `id`.
    pub fn get(&self, id: CalloutId) -> Option<&Entry<W>> {
        self.entries.get(&id)
    }

    /// Hands the answer of `id` to another waiter (a request that went away while its callout
    /// was in flight leaves the answer to its root); the one it had.
    pub fn replace(&mut self, id: CalloutId, waiter: W) -> Option<W> {
        let is_request = self.is_request;
        let e = self.entries.get_mut(&id)?;
        let now_request = is_request(&waiter);
        let old = std::mem::replace(&mut e.waiter, waiter);
        if is_request(&old) {
            self.waiting = self.waiting.saturating_sub(1);
        }
        if now_request {
            self.waiting += 1;
        }
        Some(old)
    }

    /// Root context `root` is gone, and Envoy cancelled its callouts without a word: their
    /// entries, removed (in no particular order).
    pub fn close_root(&mut self, root: u32) -> Vec<(CalloutId, W)> {
        let ids: Vec<CalloutId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.root == root)
            .map(|(&id, _)| id)
            .collect();
        ids.into_iter()
            .filter_map(|id| self.close(id).map(|e| (id, e.waiter)))
            .collect()
    }

    /// The entries Envoy's tokens displaced since the last call ([`Ledger::open`]), each to end
    /// on its failure path.
    pub fn displaced(&mut self) -> Vec<(CalloutId, Entry<W>)> {
        std::mem::take(&mut self.displaced)
    }

    /// Whether an entry was displaced since the last [`Ledger::displaced`].
    pub fn any_displaced(&self) -> bool {
        !self.displaced.is_empty()
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
    fn the_vms_own_ids_are_above_every_token_of_envoys_and_never_repeat() {
        let mut l: Ledger<&str> = Ledger::new(|w| w.len() > 1);
        let a = l.reserve(1, "a");
        let b = l.reserve(2, "b");
        assert_eq!((a, b), (CalloutId(FIRST_OWN), CalloutId(FIRST_OWN + 1)));
        assert!(
            CalloutId::from(u32::MAX) < a,
            "no token of Envoy's reaches them"
        );
        assert_eq!(l.close(a).map(|e| e.waiter), Some("a"));
        assert_eq!(l.close(b).map(|e| (e.root, e.waiter)), Some((2, "b")));
        assert_eq!(l.reserve(1, "c"), CalloutId(FIRST_OWN + 2), "not reused");
    }

    #[test]
    fn a_token_handed_out_again_displaces_its_entry_for_the_adapter_to_fail() {
        let mut l: Ledger<&str> = Ledger::new(|w| w.starts_with("req"));
        assert!(!l.open(8, 1, "req a"));
        assert!(!l.any_displaced());
        assert!(l.open(8, 1, "req b"), "an error to count");
        assert!(l.any_displaced());
        assert_eq!(l.waiting(), 1, "only the new waiter waits on the token");
        let displaced = l.displaced();
        assert_eq!(displaced.len(), 1);
        assert_eq!(
            (displaced[0].0, displaced[0].1.waiter),
            (CalloutId(8), "req a")
        );
        assert!(l.displaced().is_empty(), "handed over once");
        assert_eq!(l.close(CalloutId(8)).map(|e| e.waiter), Some("req b"));
        assert_eq!(l.waiting(), 0);
    }

    #[test]
    fn a_root_going_away_closes_its_entries_only() {
        let mut l: Ledger<&str> = Ledger::new(|w| w.len() > 1);
        l.open(8, 1, "take");
        l.open(12, 2, "other plugin's take");
        let q = l.reserve(1, "queued");
        let mut closed = l.close_root(1);
        closed.sort_unstable();
        assert_eq!(closed, vec![(CalloutId(8), "take"), (q, "queued")]);
        assert_eq!(l.len(), 1);
        let t = CalloutId(12);
        assert_eq!(l.close_if(t, |w| *w == "nope"), None);
        assert_eq!(l.waiting(), 1);
        assert_eq!(l.replace(t, "x"), Some("other plugin's take"));
        assert_eq!(l.waiting(), 0, "a request's answer handed to a non-request");
        assert!(l.close_if(t, |w| *w == "x").is_some());
        assert!(l.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Envoy starts a callout for root `r % 3` (its token counter steps by 4).
        Open(u8),
        /// Envoy's counter jumps by `n` steps (callouts of other filters in the worker).
        Skip(u16),
        /// A request of root `r % 3` joins a batch queue.
        Reserve(u8),
        /// The `i`-th live entry is answered (or its waiter goes away).
        Close(u16),
        /// A root goes away.
        DropRoot(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => any::<u8>().prop_map(Op::Open),
            1 => any::<u16>().prop_map(Op::Skip),
            3 => any::<u8>().prop_map(Op::Reserve),
            4 => any::<u16>().prop_map(Op::Close),
            1 => any::<u8>().prop_map(Op::DropRoot),
        ]
    }

    proptest! {
        /// Whatever the order of callouts, queued requests, answers and roots going away, with
        /// Envoy's counter starting anywhere (across its wrap-around, and coming round to tokens
        /// still live): no id is ever held by two waiters, and every waiter ends exactly once (by
        /// its answer, by its root's end, or displaced by a token Envoy handed out again).
        #[test]
        fn every_waiter_ends_exactly_once(
            ops in proptest::collection::vec(op(), 1..200),
            start in any::<u32>(),
            ring in 2u32..64,
        ) {
            let mut l: Ledger<u64> = Ledger::new(|w| w % 2 == 0);
            let base = start & !3;
            let mut envoy: u32 = base;
            let mut next_waiter: u64 = 0;
            let mut live: Vec<(CalloutId, u64)> = Vec::new();
            let mut ended: HashSet<u64> = HashSet::new();
            for op in ops {
                match op {
                    Op::Open(r) => {
                        // A small ring of tokens, so that Envoy comes round to live ones.
                        envoy = base.wrapping_add(envoy.wrapping_sub(base).wrapping_add(4) % (4 * ring));
                        let w = next_waiter;
                        next_waiter += 1;
                        let clash = live.iter().position(|(t, _)| *t == CalloutId::from(envoy));
                        prop_assert_eq!(l.open(envoy, u32::from(r % 3), w), clash.is_some());
                        if let Some(i) = clash {
                            let (_, old) = live.swap_remove(i);
                            let d = l.displaced();
                            prop_assert_eq!(d.len(), 1);
                            prop_assert_eq!(d[0].1.waiter, old);
                            prop_assert!(ended.insert(old));
                        }
                        live.push((CalloutId::from(envoy), w));
                    }
                    Op::Skip(n) => envoy = envoy.wrapping_add(4 * u32::from(n) % (4 * ring)),
                    Op::Reserve(r) => {
                        let w = next_waiter;
                        next_waiter += 1;
                        let t = l.reserve(u32::from(r % 3), w);
                        prop_assert!(t.0 >= FIRST_OWN);
                        prop_assert!(!live.iter().any(|(lt, _)| *lt == t), "id {} handed out twice", t);
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
