//! Local fallback buckets, shared by every worker thread through a [`CasStore`]: what a proxy
//! admits when the service cannot be asked, and what it remembers so that it never overshoots.
//!
//! **A share, not a fresh bucket.** Each bucket's slot holds this proxy's share of the global
//! bucket: `capacity / N` tokens at most, refilled at `rate / N`. It is kept current from the
//! service's answers ([`remember`]): after every answer the share is at most the answer's
//! `remaining / N` (less what this proxy still owes), so when the service stops answering the
//! fallback continues from what the fleet last knew, not from a full bucket. A key the proxy never
//! saw starts from the static split (`capacity / N`, full).
//!
//! **Debt.** Every token the fallback admits is also recorded as owed (`debt`): the global bucket
//! never saw it. The next callouts for that bucket carry the debt as a lease (`lease = cost +
//! debt`, [`attach_debts`]): the service then charges up to `cost + debt` from what the global
//! bucket holds, debt first ([`settle_debts`]): the request is admitted only when the grant covers
//! its cost and the whole debt; otherwise all it was charged repays the debt and it is denied. So
//! tokens admitted during an outage are charged to the global bucket once it answers again, before
//! any new request, and the fleet does not spend the same refill twice (once locally, once
//! globally). A timed-out take that Redis applied anyway is charged twice (stricter, never looser).
//!
//! **Recovery: no proxy spends what the others owe.** The global bucket gathers the refill of an
//! outage while every proxy admits its share of that refill on credit, so once the service
//! answers again the bucket holds what the fleet owes. Proxies come back one by one (each
//! breaker probes on its own schedule): one back first that repaid its debt and then admitted
//! new requests from the service would spend the tokens the others' debts need, and those
//! requests would be admitted twice over the window. So a bucket the breaker refused requests
//! of stays in recovery for a while after the last refusal ([`recovery_until`]: as long as the
//! other breakers may still be open): a request of it is admitted only when the service admits it and
//! its shares can pay for it too ([`Charge::SPEND`], not owed: the service charged it), as in
//! the outage. `attach_debts` says when; `crate::core::flow` asks the shares first (no callout
//! when they cannot pay) or, for the breaker's probe and a debt to repay, after the answer.
//!
//! **Bounded, and collisions only make it stricter.** A fixed table of `max_keys` slots
//! (`tollgate.fb.<max_keys>.<n>`), created ahead of use by [`prepare`] (shared data has no "insert if
//! absent", so a slot first written by two workers at once would lose one write). A bucket lives
//! in the slot its identity hashes to; every write is a CAS on the slot's version. When another
//! bucket holds the slot, a newcomer takes it over **starting empty** (it refills from then on),
//! unless the holder still owes tokens, in which case the newcomer is denied and the holder keeps
//! its slot. So no pattern of keys can produce a fresh full bucket for a key already in use: only
//! a slot never used yet (vacant) starts full. A take whose charge could not be stored (CAS gave
//! up, or the slot does not exist) is denied: nothing is admitted without a stored charge.
//!
//! **A resized table keeps shares and debts.** A bucket's slot depends on `max_keys`, so each size
//! is a table of its own (`tollgate.fb.<max_keys>`), and the sizes this Envoy's configurations used
//! are remembered in shared data ([`SIZES_KEY`], the last four). A bucket whose slot in the current
//! table was never written takes over its record from the newest earlier table that holds one
//! ([`Shares::previous`]): a push that changes `max_keys` neither refills a share nor forgets a
//! debt. (While the old configuration still drains, both may report the same debt: the service
//! then charges it twice, which is stricter, never looser.)
//!
//! **A changed limit keeps the share.** A bucket is identified by its key and algorithm, not by its
//! limits (like the service's buckets). Each record holds the limits it was last written with
//! (global capacity, rate, period, number of proxies); a take or answer with other limits first
//! carries the share over ([`bucket::carry`]): refilled up to now under the old limits, then scaled
//! to the new local capacity keeping the fraction held (a window: the fraction used, while its
//! window lasts), never above it. So a rule lowered from 100 to 50, or a fleet grown from 4 proxies
//! to 8, halves what each share holds instead of handing out a fresh one.
//!
//! **N, learned.** The number of proxies a limit is split by starts as `fallback.instances` and then
//! follows the live instances the service reports in its answers ([`crate::core::wire::instance`]),
//! never below `fallback.min_instances`. It is kept in shared data ([`N_KEY`]) so every worker of
//! this Envoy splits by the same N, and a change carries the shares over like any other change of
//! the limits: a fleet grown from 4 to 8 proxies halves every share at its next use. While the
//! service is away N stays what it last said.
//!
//! Layout: the slot scheme ([`slot`], [`slot_in`], [`prepare`]); the record (`Entry`); the
//! operations on one slot ([`take`], [`refund`], [`remember_one`], [`owed`]); over a request
//! ([`take_all`], [`take_all_as`], [`refund_spent`], [`attach_debts`], [`remember`]).

use crate::core::base::store::{update, CasStore, Step};
use crate::core::config::{Algorithm, Config, FailureMode};
use crate::core::local::breaker;
use crate::core::local::bucket::{self, Limits, State};
pub use crate::core::local::table::Slot;
use crate::core::local::table::{self, slot_of};
use crate::core::settle;
use crate::core::wire::plan::{Outcome, Plan};
use crate::core::wire::{BucketResult, TakeRequest, TakeResponse};

/// Shared-data key of the table sizes this Envoy's configurations used, newest first (at most 4,
/// each 4 bytes little endian).
pub const SIZES_KEY: &str = "tollgate.fb.sizes";
/// Words per share record ([`table`]): level, stamp, debt, last write, the limits written with
/// (global capacity, rate, period, number of proxies), and until when the bucket is in recovery
/// from an outage (the breaker refused requests of it, [`Charge::outage`]).
const WORDS: usize = 9;
/// Words of a record written before the recovery mark (read as one without it).
const WORDS_BEFORE_OUTAGE: usize = 8;
/// Stored bytes per occupied slot.
pub const SLOT_BYTES: usize = 1 + table::ID_BYTES + 8 * WORDS;
/// The largest debt a callout carries: the contract's bound on `lease`.
const MAX_LEASE: u64 = contract::bounds::MAX_AMOUNT;

/// How a configuration's shares are kept: the table size, the number of proxies, and how long an
/// unpaid debt matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shares {
    /// Slots in the table (`fallback.max_keys`).
    pub max_keys: u32,
    /// Proxies sharing each limit (`fallback.instances`).
    pub instances: u64,
    /// A debt whose bucket saw no take or answer for this long is forgiven ([`debt_horizon_ms`]):
    /// by then the global bucket would have refilled anyway, and its slot is free for others.
    pub horizon_ms: u64,
    /// The sizes of the tables earlier configurations wrote (0: none): a bucket whose slot in
    /// this table was never written takes over its record from the newest of them that holds one.
    pub previous: [u32; 3],
}

impl Shares {
    /// The shares of a configuration, split by the configured number of proxies (at least the
    /// floor): what holds until the service reports the live instances.
    pub fn of(cfg: &Config) -> Shares {
        Shares {
            max_keys: cfg.fallback.max_keys,
            instances: cfg.fallback.instances.max(cfg.fallback.min_instances),
            horizon_ms: debt_horizon_ms(cfg),
            previous: cfg.fallback.previous_max_keys,
        }
    }

    /// The shares `plan` is taken in: split by the number of proxies its admission read
    /// ([`Plan::instances`]), or, when it read none, by the one stored now ([`Shares::learned`]).
    pub fn of_plan<S: CasStore + ?Sized>(cfg: &Config, plan: &Plan, store: &S) -> Shares {
        match plan.instances {
            0 => Shares::of(cfg).learned(store),
            known => Shares {
                instances: known,
                ..Shares::of(cfg)
            },
        }
    }

    /// These shares split by the number of proxies learned from the answers, when one was
    /// ([`learn`]; it is stored already floored).
    pub fn learned<S: CasStore + ?Sized>(self, store: &S) -> Shares {
        match learned_instances(store) {
            Some(n) => Shares {
                instances: n,
                ..self
            },
            None => self,
        }
    }
}

/// The number of proxies last learned from the service's answers, if any. It is kept in the
/// breaker's entry ([`breaker::State::instances`]), which every request reads at admission.
pub fn learned_instances<S: CasStore + ?Sized>(store: &S) -> Option<u64> {
    let (v, _) = store.get(breaker::KEY)?;
    Some(breaker::State::decode(Some(&v)).instances).filter(|&n| n > 0)
}

/// Stores `heard` (the live instances an answer reported), floored at `fallback.min_instances`,
/// as this Envoy's number of proxies; writes only when it changed. `known` is the number the
/// request's admission read ([`breaker::Seen::instances`], 0 if none): when the floored number is
/// that one, nothing is read or written (another worker may have stored a different number since;
/// the next admission reads it, and the next answer that differs from it writes). Returns that
/// number, so the caller need not read it back.
pub fn learn<S: CasStore + ?Sized>(cfg: &Config, store: &S, heard: u64, known: u64) -> u64 {
    let n = heard.max(cfg.fallback.min_instances).max(1);
    if n == known {
        return n;
    }
    breaker::rewrite(store, &|s| {
        (s.instances != n).then_some(breaker::State { instances: n, ..s })
    });
    n
}

/// The fallback table of `max_keys` slots.
fn table_name(max_keys: u32) -> String {
    format!("{}.{max_keys}", table::SHARES_TABLE)
}

/// The slot of a fallback bucket (in the table of `max_keys` slots). The identity covers the key
/// and the algorithm only: the limits are recorded in the slot, and a change carries the share
/// over. The last slot computed is remembered ([`LAST`]): every answer of a hot bucket asks for
/// the same one, and a SHA-256 with two formatted names cost Envoy about 9,500 instructions of an
/// exact request's 326,000.
pub fn slot(key: &str, l: &Limits, max_keys: u32) -> Slot {
    let alg = alg_byte(l.algorithm);
    remembered(&LAST, (alg, max_keys), key, || {
        compute_slot(key, alg, max_keys)
    })
}

/// The last slot a memo ([`LAST`], [`LAST_IN`]) computed: the identity it was computed for beside
/// the key, and the slot.
type Memo<I> = std::cell::Cell<Option<(I, String, Slot)>>;

/// The slot of `id` and `key`: the one `memo` holds when it was asked for the same last, else
/// `compute`'s, which it then holds.
fn remembered<I: PartialEq + 'static>(
    memo: &'static std::thread::LocalKey<Memo<I>>,
    id: I,
    key: &str,
    compute: impl FnOnce() -> Slot,
) -> Slot {
    let mut last = memo.take();
    let s = match &last {
        Some((i, k, s)) if *i == id && k == key => s.clone(),
        _ => {
            let s = compute();
            last = Some((id, key.to_string(), s.clone()));
            s
        }
    };
    memo.set(last);
    s
}

/// [`slot`] without the memo: the key and the algorithm's code, hashed into the table.
fn compute_slot(key: &str, alg: u8, max_keys: u32) -> Slot {
    let mut material = Vec::with_capacity(key.len() + 2);
    material.extend_from_slice(key.as_bytes());
    material.push(0);
    material.push(alg);
    slot_of(&table_name(max_keys), &material, max_keys)
}

thread_local! {
    /// The last bucket [`slot`] was asked for (algorithm and table size, key) and its slot. One
    /// per VM, so one per Envoy worker: a memo, which changes no answer (`slot`'s tests).
    static LAST: Memo<(u8, u32)> = const { std::cell::Cell::new(None) };
}

/// What the bucket `key` holds: its slot in this table, or, when that slot was never written,
/// its record in the newest earlier table that has one (carried over: `Ours(.., true)`, so the
/// caller writes it here). A debt recorded before a push that changed `max_keys` is still owed.
fn entry<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    key: &str,
    l: &Limits,
    id: &[u8; 16],
    cur: Option<&[u8]>,
    now_ms: u64,
) -> Entry {
    let here = decode(id, l, cur, now_ms, sh.horizon_ms);
    if here != Entry::Vacant {
        return here;
    }
    for &size in sh.previous.iter().filter(|&&n| n > 0 && n != sh.max_keys) {
        let old = slot(key, l, size);
        let bytes = store.get(&old.name);
        if let Entry::Ours(s, d, _, until) = decode(
            id,
            l,
            bytes.as_ref().map(|(v, _)| v.as_slice()),
            now_ms,
            sh.horizon_ms,
        ) {
            return Entry::Ours(s, d, true, until);
        }
    }
    Entry::Vacant
}

fn alg_byte(a: Algorithm) -> u8 {
    bucket::code(a)
}

/// The slot of a bucket in the table `table` of `max_keys` slots (`<table>.<n>`). The identity
/// covers the key and the global limits (not the number of proxies), like the service's bucket
/// identity. The lease pools ([`crate::core::local::lease`]) use the same scheme in a table of their
/// own, and so do the remembered denials. The last slot computed is remembered ([`LAST_IN`]), as
/// [`slot`]'s is: every request of a flood denied from memory asks for the same one, and its SHA-256
/// and formatted name were a quarter of such a request's work in the module.
pub fn slot_in(table: &'static str, key: &str, l: &Limits, max_keys: u32) -> Slot {
    let id = (
        table,
        l.global,
        l.rate,
        l.period_ms,
        alg_byte(l.algorithm),
        max_keys,
    );
    remembered(&LAST_IN, id, key, || {
        compute_slot_in(table, key, l, max_keys)
    })
}

/// The identity [`slot_in`] remembers its last slot under, beside the key.
type SlotInId = (&'static str, u64, u64, u64, u8, u32);

thread_local! {
    /// The last bucket [`slot_in`] was asked for and its slot; a memo like [`LAST`].
    static LAST_IN: Memo<SlotInId> = const { std::cell::Cell::new(None) };
}

/// [`slot_in`] without the memo.
fn compute_slot_in(table: &str, key: &str, l: &Limits, max_keys: u32) -> Slot {
    let mut material = Vec::with_capacity(key.len() + 48);
    material.extend_from_slice(key.as_bytes());
    material.push(0);
    for v in [l.global, l.rate, l.period_ms] {
        material.extend_from_slice(&v.to_le_bytes());
    }
    material.push(alg_byte(l.algorithm));
    slot_of(table, &material, max_keys)
}

/// The tables are created as [`table::prepare`] does (kept under this name for the callers that
/// prepare a table of their own).
pub use crate::core::local::table::prepare as prepare_table;

/// [`prepare_table`] for the fallback table of `max_keys` slots.
pub fn prepare<S: CasStore + ?Sized>(store: &S, max_keys: u32) {
    prepare_table(store, &table_name(max_keys), max_keys, &table::vacant());
}

/// Records `max_keys` as the newest fallback table size of this Envoy ([`SIZES_KEY`]); the sizes
/// used before it, newest first, for [`Shares::previous`].
pub fn record_size<S: CasStore + ?Sized>(store: &S, max_keys: u32) -> [u32; 3] {
    let read = |v: &[u8]| -> Vec<u32> {
        v.chunks_exact(4)
            .filter_map(|c| <[u8; 4]>::try_from(c).ok())
            .map(u32::from_le_bytes)
            .collect()
    };
    let sizes = update(store, SIZES_KEY, |cur| {
        let old = cur.map(read).unwrap_or_default();
        if old.first() == Some(&max_keys) {
            return Step::Keep(old);
        }
        let mut new = vec![max_keys];
        new.extend(old.into_iter().filter(|&n| n != max_keys).take(3));
        let bytes = new.iter().flat_map(|n| n.to_le_bytes()).collect();
        Step::Write(bytes, new)
    })
    .value;
    let mut previous = [0u32; 3];
    for (p, n) in previous
        .iter_mut()
        .zip(sizes.into_iter().filter(|&n| n != max_keys))
    {
        *p = n;
    }
    previous
}

/// Creates the tables a configuration uses (fallback shares, lease pools) before any request;
/// the fallback table sizes earlier configurations used (for `fallback.previous_max_keys`).
pub fn prepare_for<S: CasStore + ?Sized>(cfg: &Config, store: &S) -> [u32; 3] {
    let mut previous = [0; 3];
    if enabled(cfg) {
        prepare(store, cfg.fallback.max_keys);
        previous = record_size(store, cfg.fallback.max_keys);
    }
    if cfg
        .rules
        .iter()
        .any(|r| r.rate_limit().is_some_and(|l| l.lease.is_some()))
    {
        // A lease pool decodes anything that is not one of its own records as an empty pool.
        prepare_table(
            store,
            table::POOLS_TABLE,
            cfg.fallback.max_keys,
            &table::vacant(),
        );
    }
    previous
}

/// The prefix of every shared-data name a configuration uses: a digest of the service cluster.
/// Fallback shares, lease pools and the breaker describe that service's buckets (identified by key
/// and limits, like the service's own), so a configuration push that keeps the cluster keeps them,
/// and two plugins calling one service share them; memory stays bounded by the largest table.
pub fn state_prefix(cfg: &Config) -> String {
    let digest = crate::core::base::hash::sha256_hex(cfg.service.cluster.as_bytes());
    format!("{}/", digest.get(..12).unwrap_or(&digest))
}

/// What a slot holds, as seen by bucket `id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// The slot does not exist (not prepared): nothing can be stored in it.
    Missing,
    /// Never used: a bucket starts here full.
    Vacant,
    /// This bucket's share (carried over to the caller's limits), what it still owes, whether
    /// it was recorded under other limits (then it must be written again), and until when it is
    /// in recovery from an outage (0: never was).
    Ours(State, u64, bool, u64),
    /// Another bucket's (or unreadable): a newcomer starts empty; `debt` is what the holder owes.
    Other {
        /// Tokens the holder still owes.
        debt: u64,
    },
}

fn encode(
    id: &[u8; 16],
    l: &Limits,
    s: State,
    debt: u64,
    now_ms: u64,
    recover_until_ms: u64,
) -> Vec<u8> {
    let words = [
        s.level,
        s.stamp,
        debt,
        now_ms,
        l.global,
        l.rate,
        l.period_ms,
        l.divisor,
        recover_until_ms,
    ];
    table::encode(table::SHARE, id, &words)
}

/// The words of a share record: this format's, or one written before the recovery mark (its
/// mark then reads 0, so its share and debt carry over a module upgrade).
fn share_words(b: &[u8]) -> Option<([u8; table::ID_BYTES], [u64; WORDS])> {
    if let Some(r) = table::decode::<WORDS>(table::SHARE, b) {
        return Some(r);
    }
    let (owner, old) = table::decode::<WORDS_BEFORE_OUTAGE>(table::SHARE, b)?;
    let mut words = [0u64; WORDS];
    for (w, o) in words.iter_mut().zip(old) {
        *w = o;
    }
    Some((owner, words))
}

/// What a slot holds for bucket `id` at `now_ms` under limits `l` (a share recorded under other
/// limits is carried over, [`bucket::carry`]); a debt untouched for `horizon_ms` reads as 0.
fn decode(id: &[u8; 16], l: &Limits, bytes: Option<&[u8]>, now_ms: u64, horizon_ms: u64) -> Entry {
    let Some(b) = bytes else {
        return Entry::Missing;
    };
    if table::is_vacant(b) {
        return Entry::Vacant;
    }
    let Some((owner, words)) = share_words(b) else {
        return Entry::Other { debt: 0 };
    };
    let [level, stamp, debt, touched, global, rate, period_ms, divisor, recover_until_ms] = words;
    let debt = if now_ms.saturating_sub(touched) > horizon_ms {
        0
    } else {
        debt
    };
    if owner == *id {
        let old = Limits::local(global, rate, period_ms, l.algorithm, divisor);
        let s = bucket::carry(&old, State { level, stamp }, l, now_ms);
        Entry::Ours(s, debt, old != *l, recover_until_ms)
    } else {
        Entry::Other { debt }
    }
}

/// A denial for a take that could not be stored or whose slot is held by a debtor: come back in
/// a period, when the local share has refilled.
fn unstored(l: &Limits) -> BucketResult {
    BucketResult {
        allowed: false,
        limit: l.capacity,
        remaining: 0,
        reset_ms: l.period_ms,
        retry_after_ms: l.period_ms.max(1),
        granted: 0,
        delay_ms: 0,
    }
}

/// How a take from a share counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    /// The fallback admits on credit: what it takes is owed to the global bucket.
    pub owe: bool,
    /// The breaker refused the request (an outage): the bucket is in recovery until then at
    /// least ([`recovery_until`]); 0: no refusal.
    pub recover_until_ms: u64,
}

impl Charge {
    /// The fallback's take when a callout failed: owed.
    pub const OWE: Charge = Charge {
        owe: true,
        recover_until_ms: 0,
    };
    /// A take in recovery, of a request the service charges (or is asked to): not owed.
    pub const SPEND: Charge = Charge {
        owe: false,
        recover_until_ms: 0,
    };

    /// The fallback's take when the breaker refused the callout: owed, and the bucket in
    /// recovery until `until_ms`.
    pub fn outage(until_ms: u64) -> Charge {
        Charge {
            owe: true,
            recover_until_ms: until_ms,
        }
    }
}

/// Takes `cost` from one bucket's local share; an admitted cost is added to the bucket's debt.
/// Denied when the charge could not be stored.
pub fn take<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    key: &str,
    l: &Limits,
    now_ms: u64,
    cost: u64,
) -> BucketResult {
    take_as(store, sh, key, l, now_ms, cost, Charge::OWE)
}

/// [`take`], counted as `how` says.
fn take_as<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    key: &str,
    l: &Limits,
    now_ms: u64,
    cost: u64,
    how: Charge,
) -> BucketResult {
    let slot = slot(key, l, sh.max_keys);
    let done = update(store, &slot.name, |cur| {
        let (state, debt, until) = match entry(store, sh, key, l, &slot.id, cur, now_ms) {
            Entry::Missing => return Step::Keep(None),
            // The holder owes tokens: it keeps its slot, the newcomer gets nothing.
            Entry::Other { debt } if debt > 0 => return Step::Keep(None),
            Entry::Vacant => (None, 0, 0),
            // Taken over: the newcomer starts empty, never full.
            Entry::Other { .. } => (Some(bucket::empty(l, now_ms)), 0, 0),
            Entry::Ours(s, d, _, o) => (Some(s), d, o),
        };
        let (state, result) = bucket::take(l, state, now_ms, cost);
        let debt = if result.allowed && how.owe {
            debt.saturating_add(cost)
        } else {
            debt
        };
        let until = until.max(how.recover_until_ms);
        Step::Write(
            encode(&slot.id, l, state, debt, now_ms, until),
            Some(result),
        )
    });
    match done.value {
        Some(r) if done.stored => r,
        _ => unstored(l),
    }
}

/// Gives `cost` back to a bucket charged earlier in the same request (skipped if another bucket
/// took the slot meanwhile), and forgives it in the debt.
pub fn refund<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    key: &str,
    l: &Limits,
    now_ms: u64,
    cost: u64,
) {
    refund_as(store, sh, key, l, now_ms, cost, true);
}

/// [`refund`] of a take that was owed (`owed`) or not ([`Charge::SPEND`]: the debt stays).
fn refund_as<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    key: &str,
    l: &Limits,
    now_ms: u64,
    cost: u64,
    owed: bool,
) {
    let slot = slot(key, l, sh.max_keys);
    update(store, &slot.name, |cur| {
        match entry(store, sh, key, l, &slot.id, cur, now_ms) {
            Entry::Ours(s, d, _, outage) => Step::Write(
                encode(
                    &slot.id,
                    l,
                    bucket::refund(l, s, cost),
                    if owed { d.saturating_sub(cost) } else { d },
                    now_ms,
                    outage,
                ),
                (),
            ),
            _ => Step::Keep(()),
        }
    });
}

/// What bucket `key` still owes the global bucket (0 when its slot holds another bucket).
pub fn owed<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    key: &str,
    l: &Limits,
    now_ms: u64,
) -> u64 {
    standing(store, sh, key, l, now_ms).0
}

/// Keeps one bucket's share in line with an answer from the service: the share becomes at most
/// `remaining / N − debt` (after `repaid` tokens of the debt were charged by this answer), and is
/// never raised by an answer (refill does that). Writes only when the share drops by a token or
/// more, or the debt changed, so a steady bucket costs one read per answer.
pub fn remember_one<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    key: &str,
    l: &Limits,
    now_ms: u64,
    remaining: u64,
    repaid: u64,
) {
    let slot = slot(key, l, sh.max_keys);
    update(store, &slot.name, |cur| {
        let (held, debt, changed, outage) = match entry(store, sh, key, l, &slot.id, cur, now_ms) {
            Entry::Missing | Entry::Other { debt: 1.. } => return Step::Keep(()),
            Entry::Vacant | Entry::Other { .. } => (None, 0, false, 0),
            Entry::Ours(s, d, changed, o) => (Some(s), d, changed, o),
        };
        let debt_left = debt.saturating_sub(repaid);
        let known = bucket::share(l, remaining, debt_left, now_ms);
        let next = match held {
            Some(h) => bucket::stricter(l, h, known, now_ms),
            None => known,
        };
        match held {
            Some(h) if debt_left == debt && !changed => {
                let drop = bucket::available(l, h, now_ms)
                    .saturating_sub(bucket::available(l, next, now_ms));
                if drop == 0 {
                    return Step::Keep(());
                }
            }
            // A full share of a bucket not held yet is what a vacant slot means already.
            None if debt_left == 0 && bucket::available(l, next, now_ms) >= l.capacity => {
                return Step::Keep(());
            }
            _ => {}
        }
        Step::Write(encode(&slot.id, l, next, debt_left, now_ms, outage), ())
    });
}

/// Drains `amount` tokens (or all it holds) from one bucket's local share without recording them
/// as owed: what a response used beyond its reservation, which its settlement charges the global
/// bucket itself however long it waits for the service. So while the service is away the
/// fallback counts the overshoot too, instead of admitting as if it had not happened (this
/// proxy's share drops by all of it: stricter than the global bucket's drop, never looser). A
/// bucket never seen here starts from a full share; a slot another bucket holds is left alone.
pub fn spend<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    key: &str,
    l: &Limits,
    now_ms: u64,
    amount: u64,
) {
    let slot = slot(key, l, sh.max_keys);
    update(store, &slot.name, |cur| {
        let (state, debt, outage) = match entry(store, sh, key, l, &slot.id, cur, now_ms) {
            Entry::Ours(s, d, _, o) => (Some(s), d, o),
            Entry::Vacant => (None, 0, 0),
            Entry::Missing | Entry::Other { .. } => return Step::Keep(()),
        };
        let held = state.map_or(l.capacity, |s| bucket::available(l, s, now_ms));
        let drained = amount.min(held);
        if drained == 0 {
            return Step::Keep(());
        }
        let (state, _) = bucket::take(l, state, now_ms, drained);
        Step::Write(encode(&slot.id, l, state, debt, now_ms, outage), ())
    });
}

/// [`spend`] for each extra charge of a response's settlement ([`settle::Item`]s whose `used` is
/// above their `estimate`), in the shares as this proxy splits them now.
pub fn spend_extras<S: CasStore + ?Sized>(
    cfg: &Config,
    store: &S,
    items: &[settle::Item],
    now_ms: u64,
) {
    let sh = Shares::of(cfg).learned(store);
    for i in items.iter().filter(|i| i.used > i.estimate) {
        let l = limits_of(&i.bucket, sh.instances);
        spend(store, &sh, &i.bucket.key, &l, now_ms, i.used - i.estimate);
    }
}

/// The local limits of a request bucket for `instances` proxies.
fn limits_of(b: &crate::core::wire::Bucket, instances: u64) -> Limits {
    Limits::local(
        b.capacity,
        b.rate(),
        b.period_ms,
        b.algorithm.unwrap_or_default(),
        instances,
    )
}

/// Takes every bucket of `req` locally, all or nothing, with capacity and rate divided by the
/// number of proxies. The answer has the contract's shape, so the rest of the filter treats it
/// like the service's.
pub fn take_all<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    req: &TakeRequest,
    now_ms: u64,
) -> TakeResponse {
    take_all_as(store, sh, req, now_ms, Charge::OWE)
}

/// [`take_all`], each take counted as `how` says (a refund of a request that was denied in
/// the end counts the same way).
pub fn take_all_as<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    req: &TakeRequest,
    now_ms: u64,
    how: Charge,
) -> TakeResponse {
    let sh = &sh.learned(store);
    let mut results = Vec::with_capacity(req.buckets.len());
    let mut charged: Vec<(usize, Limits, u64)> = Vec::new();
    let mut allowed = true;
    for (i, b) in req.buckets.iter().enumerate() {
        let l = limits_of(b, sh.instances);
        let cost = b.cost();
        let r = take_as(store, sh, &b.key, &l, now_ms, cost, how);
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
                refund_as(store, sh, &b.key, &l, now_ms, cost, how.owe);
            }
        }
    }
    TakeResponse {
        allowed,
        buckets: results,
        instances: 0,
        delay_ms: 0,
    }
}

/// Gives back what [`take_all_as`] with [`Charge::SPEND`] took for `req` (its request was not
/// admitted in the end): the shares get the costs back, the debts are left as they are.
pub fn refund_spent<S: CasStore + ?Sized>(store: &S, sh: &Shares, req: &TakeRequest, now_ms: u64) {
    let sh = &sh.learned(store);
    for b in &req.buckets {
        let l = limits_of(b, sh.instances);
        refund_as(store, sh, &b.key, &l, now_ms, b.cost(), false);
    }
}

/// Whether the fallback shares are in use at all (failure mode `fallback`).
fn enabled(cfg: &Config) -> bool {
    cfg.failure_mode == FailureMode::Fallback
}

/// Until when a bucket the breaker refused at `now_ms` stays in recovery, the breaker's open
/// interval being `interval_ms`: as long as the other proxies' breakers may still be open once
/// the service answers again. Their breakers opened with this one's and double on the same
/// schedule, so each probes within its own interval, at most twice this one's (one doubling
/// ahead) and never more than `breaker.max_open_ms` apart; and a callout timeout on either side.
pub fn recovery_until(cfg: &Config, now_ms: u64, interval_ms: u64) -> u64 {
    let spread = interval_ms
        .saturating_mul(2)
        .clamp(cfg.breaker.open_ms, cfg.breaker.max_open_ms);
    now_ms
        .saturating_add(spread)
        .saturating_add(cfg.service.timeout_ms.saturating_mul(2))
}

/// What a bucket's slot says before a callout: what it owes, and until when it is in recovery
/// (0: never was, or the slot is another bucket's).
fn standing<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    key: &str,
    l: &Limits,
    now_ms: u64,
) -> (u64, u64) {
    let slot = slot(key, l, sh.max_keys);
    let cur = store.get(&slot.name);
    match entry(
        store,
        sh,
        key,
        l,
        &slot.id,
        cur.as_ref().map(|(v, _)| v.as_slice()),
        now_ms,
    ) {
        Entry::Ours(_, d, _, until) => (d, until),
        _ => (0, 0),
    }
}

/// Before a callout: every bucket that owes tokens carries its debt as a lease on top of what
/// it asks (`lease = (lease or cost) + debt`, within the contract's bound), recorded in
/// `plan.debt`. Call only when debt may exist ([`crate::core::local::breaker`] keeps that flag), since it
/// reads one slot per bucket.
///
/// Returns whether the request is **in recovery**: one of its buckets had a request refused by
/// the breaker recently ([`recovery_until`]). The other proxies came through the same outage, each
/// admitting its share on credit, and may not be back yet: the tokens the global bucket gathered
/// meanwhile are what they owe, and a proxy back first that spent them on new requests would leave
/// their debts unpaid (admitted twice, once on credit and once by the service). So in recovery a
/// request is admitted only when its buckets' shares can pay for it too ([`Charge::SPEND`]), as
/// in the outage, while the service charges it: each proxy spends its share of the refill, and
/// the debts find the rest. Never for a leasing rule's request (its pool was charged already, its
/// share refills from empty) nor over RLS (no debts).
pub fn attach_debts<S: CasStore + ?Sized>(
    cfg: &Config,
    plan: &mut Plan,
    store: &S,
    now_ms: u64,
) -> bool {
    // An RLS server grants no leases: a debt cannot ride on its callouts (it lapses instead).
    if !enabled(cfg) || plan.rls.is_some() {
        return false;
    }
    let sh = Shares::of_plan(cfg, plan, store);
    let n = plan.request.buckets.len();
    let mut debts = vec![0u64; n];
    let mut any = false;
    let mut recovering = false;
    for (i, b) in plan.request.buckets.iter_mut().enumerate() {
        let l = limits_of(b, sh.instances);
        let (d, until) = standing(store, &sh, &b.key, &l, now_ms);
        recovering |= now_ms < until;
        if d == 0 {
            continue;
        }
        let cost = b.cost();
        let base = b.lease.unwrap_or(cost);
        let d = d.min(MAX_LEASE.saturating_sub(base));
        if d == 0 {
            continue;
        }
        b.lease = Some(base + d);
        if let Some(x) = debts.get_mut(i) {
            *x = d;
        }
        any = true;
    }
    if any {
        plan.debt = debts;
    }
    let leases = plan.rules.iter().any(|&k| {
        cfg.rules
            .get(k)
            .and_then(|r| r.rate_limit())
            .is_some_and(|l| l.lease.is_some())
    });
    recovering && !leases
}

/// Applies an answer to the debts its callout carried, debt first: a bucket whose `granted` covers
/// its cost and its whole debt is admitted and its debt repaid; one whose `granted` falls short has
/// everything it was charged count towards its debt, and the request is denied (the tokens the
/// fleet already spent on credit come before new requests). Returns the outcome to act on and, per
/// bucket, the tokens of debt repaid. Buckets of a request denied this way keep what the service
/// charged them (stricter, never looser).
pub fn settle_debts(plan: &Plan, outcome: Outcome) -> (Outcome, Vec<u64>) {
    let mut repaid = vec![0u64; plan.request.buckets.len()];
    let Outcome::Allowed(mut resp) = outcome else {
        return (outcome, repaid);
    };
    if plan.debt.iter().all(|&d| d == 0) {
        return (Outcome::Allowed(resp), repaid);
    }
    let mut short = false;
    for (i, (b, r)) in plan
        .request
        .buckets
        .iter()
        .zip(resp.buckets.iter_mut())
        .enumerate()
    {
        let debt = plan.debt(i);
        if debt == 0 {
            continue;
        }
        let cost = b.cost();
        let paid = if r.granted >= cost.saturating_add(debt) {
            debt
        } else {
            short = true;
            let paid = r.granted.min(debt);
            // Denied: come back when the rest of the debt and this cost have refilled.
            let need = debt - paid + cost;
            let rate = b.rate().max(1);
            r.allowed = false;
            r.retry_after_ms = u64::try_from(
                (u128::from(need) * u128::from(b.period_ms)).div_ceil(u128::from(rate)),
            )
            .unwrap_or(u64::MAX)
            .max(1);
            paid
        };
        if let Some(x) = repaid.get_mut(i) {
            *x = paid;
        }
    }
    if short {
        resp.allowed = false;
        (Outcome::Limited(resp), repaid)
    } else {
        (Outcome::Allowed(resp), repaid)
    }
}

/// After an answer from the service: every bucket's share follows the answer ([`remember_one`]),
/// and its debt is reduced by `repaid` (from [`settle_debts`]). Failures change nothing here (the
/// failure mode charges the shares).
pub fn remember<S: CasStore + ?Sized>(
    cfg: &Config,
    plan: &Plan,
    outcome: &Outcome,
    repaid: &[u64],
    store: &S,
    now_ms: u64,
) {
    if !enabled(cfg) {
        return;
    }
    let resp = match outcome {
        Outcome::Allowed(r) | Outcome::Limited(r) => r,
        Outcome::Failed(_) => return,
    };
    // The number an answer reported is the one stored; an answer that reports none (an RLS
    // server's) is split as its admission read.
    let sh = match resp.instances {
        0 => Shares::of_plan(cfg, plan, store),
        heard => Shares {
            instances: learn(cfg, store, heard, plan.instances),
            ..Shares::of(cfg)
        },
    };
    for (i, (b, r)) in plan.request.buckets.iter().zip(&resp.buckets).enumerate() {
        let l = limits_of(b, sh.instances);
        let paid = repaid.get(i).copied().unwrap_or(0);
        // A leasing proxy asks seldom, so its last `remaining` soon misses what the others leased
        // since: a share of it would hand out tokens the bucket no longer holds. Its pool (charged
        // already) is what it spends in an outage, and its share refills from empty.
        let leases = plan
            .rules
            .get(i)
            .and_then(|&k| cfg.rules.get(k)?.rate_limit())
            .is_some_and(|l| l.lease.is_some());
        let remaining = if leases { 0 } else { r.remaining };
        remember_one(store, &sh, &b.key, &l, now_ms, remaining, paid);
    }
}

/// How long a debt may wait for its bucket's next answer before it no longer matters: the
/// longest time any rule's bucket takes to fill from empty, at least 10 s and at most an hour
/// (computed with the configuration). Past that, the global bucket would have been full again.
pub fn debt_horizon_ms(cfg: &Config) -> u64 {
    cfg.fallback.debt_horizon_ms
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::base::store::fake::FakeStore;
    use crate::core::wire::Bucket;

    fn tb(cap: u64) -> Limits {
        Limits::local(cap, cap, 1000, Algorithm::TokenBucket, 1)
    }

    fn sh(max_keys: u32) -> Shares {
        Shares {
            max_keys,
            instances: 1,
            horizon_ms: 60_000,
            previous: [0; 3],
        }
    }

    fn prepared(max_keys: u32) -> FakeStore {
        let s = FakeStore::default();
        prepare(&s, max_keys);
        s
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
            max_delay_ms: 0,
        }
    }

    #[test]
    fn an_overshoot_drains_the_share_and_is_not_owed_twice() {
        let s = prepared(100);
        let cfg = Config::parse(
            br#"{"service":{"cluster":"c"},"fallback":{"instances":1,"max_keys":100},
                "rules":[{"name":"r","capacity":100,"period_ms":1000}]}"#,
        )
        .unwrap_or_else(|e| unreachable!("{e}"));
        let item = |key: &str, estimate, used| settle::Item {
            bucket: bucket(key, 100),
            rule: "r".into(),
            estimate,
            used,
        };
        // Held 100 (never seen: a full share), then a response used 70 beyond its reservation.
        spend_extras(&cfg, &s, &[item("a", 10, 80), item("b", 50, 20)], 0);
        let l = tb(100);
        assert!(take(&s, &sh(100), "a", &l, 0, 30).allowed);
        assert!(!take(&s, &sh(100), "a", &l, 0, 1).allowed, "30 were left");
        // Owed: only what the fallback itself admitted (the settlement charges the rest).
        assert_eq!(owed(&s, &sh(100), "a", &l, 0), 30);
        // A refund drains nothing.
        assert!(take(&s, &sh(100), "b", &l, 0, 100).allowed);
        // More than it holds empties it, no further.
        spend_extras(&cfg, &s, &[item("a", 0, 1_000_000)], 500);
        assert!(!take(&s, &sh(100), "a", &l, 500, 1).allowed);
        assert!(
            take(&s, &sh(100), "a", &l, 510, 1).allowed,
            "it refills from empty"
        );
    }

    #[test]
    fn shared_across_callers_and_bounded() {
        let s = prepared(100);
        for i in 0..3 {
            let r = take(&s, &sh(100), "k", &tb(3), 0, 1);
            assert!(r.allowed, "take {i}");
        }
        assert!(!take(&s, &sh(100), "k", &tb(3), 0, 1).allowed);
        for i in 0..1000 {
            take(&s, &sh(100), &format!("key{i}"), &tb(3), 0, 1);
        }
        let map = s.map.borrow();
        assert!(map.len() <= 101, "{} entries", map.len());
        assert!(map
            .iter()
            .filter(|(k, _)| !k.ends_with(".ready"))
            .all(|(_, (v, _))| v.len() == SLOT_BYTES));
    }

    #[test]
    fn a_successor_starts_empty_and_a_debtor_keeps_its_slot() {
        let (s, t) = (prepared(1), sh(1));
        // One slot: every key collides. `a` starts full (vacant slot) and owes what it admits.
        assert!(take(&s, &t, "a", &tb(1), 0, 1).allowed);
        assert!(
            !take(&s, &t, "b", &tb(1), 0, 1).allowed,
            "a owes: b gets nothing"
        );
        assert_eq!(owed(&s, &t, "a", &tb(1), 0), 1);
        // a's debt is repaid by an answer: b may now take the slot over, but starts empty.
        remember_one(&s, &t, "a", &tb(1), 0, 0, 1);
        assert_eq!(owed(&s, &t, "a", &tb(1), 0), 0);
        assert!(!take(&s, &t, "b", &tb(1), 0, 1).allowed, "b starts empty");
        assert!(
            take(&s, &t, "b", &tb(1), 1000, 1).allowed,
            "b refills at its rate"
        );
        // a comes back: b owes now, so a gets nothing; once b's debt lapses a starts empty.
        assert!(!take(&s, &t, "a", &tb(1), 1000, 1).allowed);
        assert_eq!(owed(&s, &t, "b", &tb(1), 61_001), 0, "past the horizon");
        assert!(
            !take(&s, &t, "a", &tb(1), 61_001, 1).allowed,
            "a starts empty"
        );
        assert!(take(&s, &t, "a", &tb(1), 62_001, 1).allowed);
    }

    #[test]
    fn a_changed_limit_keeps_the_share() {
        // Limits and the number of proxies are not part of the identity.
        assert_eq!(slot("k", &tb(1), 9).id, slot("k", &tb(2), 9).id);
        let fw = Limits::local(1, 1, 1000, Algorithm::FixedWindow, 1);
        assert_ne!(slot("k", &tb(1), 9).id, slot("k", &fw, 9).id);
        let (s, t) = (prepared(10), sh(10));
        let per_hour = |cap| Limits::local(cap, cap, 3_600_000, Algorithm::TokenBucket, 1);
        for _ in 0..40 {
            assert!(take(&s, &t, "k", &per_hour(100), 0, 1).allowed);
        }
        // 100 -> 50: 60 % held is 30 tokens, not a fresh 50; the debt is kept.
        let admitted = (0..50)
            .filter(|_| take(&s, &t, "k", &per_hour(50), 0, 1).allowed)
            .count();
        assert_eq!(admitted, 30);
        assert_eq!(owed(&s, &t, "k", &per_hour(50), 0), 70);
    }

    #[test]
    fn a_push_that_resizes_the_table_keeps_shares_and_debts() {
        let s = FakeStore::default();
        let hourly = Limits::local(20, 20, 3_600_000, Algorithm::TokenBucket, 1);
        // 64 slots: 15 of 20 taken on credit.
        prepare(&s, 64);
        assert_eq!(record_size(&s, 64), [0; 3], "the first configuration");
        let small = sh(64);
        for _ in 0..15 {
            assert!(take(&s, &small, "k", &hourly, 0, 1).allowed);
        }
        // The push: 100 slots. The bucket's slot in the new table was never written: its record
        // is carried over from the old table, share and debt, and written to the new one.
        prepare(&s, 100);
        let previous = record_size(&s, 100);
        assert_eq!(previous, [64, 0, 0]);
        assert_eq!(
            record_size(&s, 100),
            [64, 0, 0],
            "a second VM of the same push"
        );
        let big = Shares {
            previous,
            ..sh(100)
        };
        assert_eq!(owed(&s, &big, "k", &hourly, 0), 15);
        let admitted = (0..20)
            .filter(|_| take(&s, &big, "k", &hourly, 0, 1).allowed)
            .count();
        assert_eq!(admitted, 5, "what was left, not a fresh 20");
        assert_eq!(owed(&s, &big, "k", &hourly, 0), 20);
        // Without the earlier size, the same push would start the bucket full.
        let forgetful = sh(100);
        assert_eq!(owed(&s, &forgetful, "k2", &hourly, 0), 0);
        // Back to 64: the newest size first, and the old table still holds what it held.
        assert_eq!(record_size(&s, 64), [100, 0, 0]);
    }

    #[test]
    fn more_proxies_shrink_the_share() {
        let (s, t) = (prepared(10), sh(10));
        let of = |n| Limits::local(100, 100, 3_600_000, Algorithm::TokenBucket, n);
        // 4 proxies, 40 left: a share of 10 of 25. 8 proxies: 10 * 12 / 25 = 4.8, 4 whole tokens.
        remember_one(&s, &t, "k", &of(4), 0, 40, 0);
        let admitted = (0..20)
            .filter(|_| take(&s, &t, "k", &of(8), 0, 1).allowed)
            .count();
        assert_eq!(admitted, 4);
        // A full share stays full, at the new size (12 of 100 / 8).
        remember_one(&s, &t, "j", &of(4), 0, 100, 0);
        remember_one(&s, &t, "j", &of(4), 0, 99, 0);
        let admitted = (0..20)
            .filter(|_| take(&s, &t, "j", &of(8), 0, 1).allowed)
            .count();
        assert_eq!(admitted, 12 * 24 / 25);
    }

    #[test]
    fn the_split_follows_the_instances_heard() {
        let cfg = Config::parse(
            br#"{"service":{"cluster":"c"},"fallback":{"instances":4,"min_instances":2,"max_keys":10},
                 "rules":[{"name":"a","capacity":100,"period_ms":3600000}]}"#,
        )
        .unwrap();
        let s = prepared(10);
        let req = TakeRequest {
            buckets: vec![Bucket {
                period_ms: 3_600_000,
                ..bucket("k", 100)
            }],
        };
        let admitted = |s: &FakeStore| {
            (0..100)
                .filter(|_| take_all(s, &Shares::of(&cfg), &req, 0).allowed)
                .count()
        };
        // Before any answer: the configured 4, a share of 25.
        assert_eq!(admitted(&prepared(10)), 25);
        // The service reports 8 live instances: 12 each.
        learn(&cfg, &s, 8, 0);
        assert_eq!(learned_instances(&s), Some(8));
        assert_eq!(admitted(&s), 12);
        // A report of 1 is floored at min_instances (2).
        let t = prepared(10);
        learn(&cfg, &t, 1, 0);
        assert_eq!(admitted(&t), 50);
    }

    /// Four proxies configured, one rule of 100 a second.
    fn four_proxies() -> Config {
        Config::parse(
            br#"{"service":{"cluster":"c"},"fallback":{"instances":4,"max_keys":10},
                 "rules":[{"name":"a","capacity":100,"period_ms":1000}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn a_remembered_slot_is_the_one_computed() {
        let computed = |key: &str, l: &Limits, n: u32| compute_slot(key, alg_byte(l.algorithm), n);
        let fw = Limits::local(10, 10, 1000, Algorithm::FixedWindow, 1);
        // Asked again, in turn and after others: the same key with another algorithm or table
        // size is another slot.
        for (key, l, n) in [
            ("a", tb(10), 64),
            ("a", tb(10), 64),
            ("a", fw, 64),
            ("a", tb(10), 128),
            ("b", tb(10), 64),
            ("a", tb(10), 64),
            ("", tb(10), 64),
        ] {
            assert_eq!(slot(key, &l, n), computed(key, &l, n), "{key} {n}");
        }
        assert_ne!(slot("a", &tb(10), 64), slot("a", &fw, 64));
    }

    #[test]
    fn a_remembered_slot_in_a_table_is_the_one_computed() {
        use crate::core::local::table::{DENIALS_TABLE, POOLS_TABLE};
        let fw = Limits::local(10, 10, 1000, Algorithm::FixedWindow, 1);
        let slower = Limits::local(10, 10, 2000, Algorithm::TokenBucket, 1);
        let shared_by_3 = Limits::local(10, 10, 1000, Algorithm::TokenBucket, 3);
        // Asked again, in turn and after others: another table, key, limit, algorithm or table
        // size is another slot; the number of proxies is not part of the identity.
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
                slot_in(table, key, &l, n),
                compute_slot_in(table, key, &l, n),
                "{table} {key} {n}"
            );
        }
        assert_ne!(
            slot_in(DENIALS_TABLE, "a", &tb(10), 64),
            slot_in(POOLS_TABLE, "a", &tb(10), 64)
        );
    }

    #[test]
    fn the_count_lives_in_the_breaker_entry_and_a_known_count_costs_nothing() {
        let cfg = four_proxies();
        let s = prepared(10);
        let open = breaker::State {
            failures: 3,
            open_until_ms: 9_000,
            interval_ms: 100,
            debt_until_ms: 7,
            denied_until_ms: 8,
            instances: 0,
        };
        s.set(breaker::KEY, &open.encode(), None).unwrap();
        // Learned: written into the breaker's entry, the breaker's own state kept.
        assert_eq!(learn(&cfg, &s, 5, 0), 5);
        let stored = breaker::State::decode(s.get(breaker::KEY).map(|(v, _)| v).as_deref());
        assert_eq!(
            stored,
            breaker::State {
                instances: 5,
                ..open
            }
        );
        assert_eq!(learned_instances(&s), Some(5));
        // A success closing the breaker keeps the count.
        let (closed, _) = breaker::on_success(stored);
        assert_eq!(closed.map(|c| c.instances), Some(5));
        // The number the admission read: nothing is written (that nothing is read either is
        // counted by the dispatcher's `a_steady_exact_request_reads_shared_data_twice`).
        let before = s.map.borrow().clone();
        s.map.borrow_mut().clear();
        assert_eq!(learn(&cfg, &s, 5, 5), 5);
        assert!(s.map.borrow().is_empty());
        *s.map.borrow_mut() = before;
        // Another number than the admission read: stored.
        assert_eq!(learn(&cfg, &s, 6, 5), 6);
        assert_eq!(learned_instances(&s), Some(6));
    }

    #[test]
    fn an_answer_teaches_the_count_it_carries() {
        let cfg = four_proxies();
        let s = prepared(10);
        let plan = Plan {
            request: TakeRequest {
                buckets: vec![bucket("k", 100)],
            },
            rules: vec![0],
            debt: Vec::new(),
            rls: None,
            instances: 0,
        };
        let answer = |body: &str| {
            let resp = crate::core::wire::decode_json(body.as_bytes()).unwrap();
            Outcome::Allowed(resp)
        };
        let body = |n: u64| {
            format!(
                r#"{{"allowed":true,"instances":{n},"buckets":[{{"allowed":true,"remaining":50,"retry_after_ms":0,"reset_after_ms":0,"limit":100,"granted":1}}]}}"#
            )
        };
        let eight = answer(&body(8));
        // Another answer decoded before the first is remembered does not speak for it.
        let _five = answer(&body(5));
        remember(&cfg, &plan, &eight, &[], &s, 0);
        assert_eq!(learned_instances(&s), Some(8));
        // An answer without a count leaves the learned one.
        let none = Outcome::Allowed(crate::core::wire::decode_json(body(0).as_bytes()).unwrap());
        remember(&cfg, &plan, &none, &[], &s, 0);
        assert_eq!(learned_instances(&s), Some(8));
    }

    #[test]
    fn a_changed_window_limit_keeps_the_count() {
        let (s, t) = (prepared(10), sh(10));
        let of = |cap, period| Limits::local(cap, cap, period, Algorithm::FixedWindow, 1);
        for _ in 0..4 {
            assert!(take(&s, &t, "k", &of(10, 10_000), 0, 1).allowed);
        }
        // 4 of 10 used is 2 of 5: 3 left in this window.
        let admitted = (0..5)
            .filter(|_| take(&s, &t, "k", &of(5, 10_000), 100, 1).allowed)
            .count();
        assert_eq!(admitted, 3);
        // A shorter period keeps the count while the old window lasts, then counts afresh.
        assert!(!take(&s, &t, "k", &of(5, 1_000), 5_000, 1).allowed);
        assert!(take(&s, &t, "k", &of(5, 1_000), 6_000, 1).allowed);
    }

    #[test]
    fn cas_conflicts_are_retried_and_nothing_is_lost() {
        let s = prepared(10);
        take(&s, &sh(10), "k", &tb(5), 0, 1);
        s.conflicts.set(3);
        assert!(take(&s, &sh(10), "k", &tb(5), 0, 1).allowed);
        let r = take(&s, &sh(10), "k", &tb(5), 0, 1);
        assert_eq!(r.remaining, 2, "both takes stored despite the conflicts");
    }

    #[test]
    fn a_charge_that_cannot_be_stored_is_denied() {
        let s = prepared(10);
        s.conflicts.set(crate::core::base::store::MAX_CAS_ATTEMPTS);
        assert!(!take(&s, &sh(10), "k", &tb(5), 0, 1).allowed, "CAS gave up");
        assert_eq!(owed(&s, &sh(10), "k", &tb(5), 0), 0);
        // A table that was never prepared stores nothing, so admits nothing.
        let bare = FakeStore::default();
        assert!(!take(&bare, &sh(10), "k", &tb(5), 0, 1).allowed);
        assert!(bare.map.borrow().is_empty(), "no unconditional first write");
    }

    #[test]
    fn all_or_nothing_refunds() {
        let s = prepared(100);
        let req = TakeRequest {
            buckets: vec![bucket("wide", 10), bucket("narrow", 1)],
        };
        let a = take_all(&s, &sh(100), &req, 0);
        assert!(a.allowed);
        assert_eq!(a.buckets[0].remaining, 9);
        let b = take_all(&s, &sh(100), &req, 0);
        assert!(!b.allowed);
        assert!(b.buckets[0].allowed && !b.buckets[1].allowed);
        let c = take(&s, &sh(100), "wide", &tb(10), 0, 1);
        assert_eq!(
            c.remaining, 8,
            "the denied request's charge on `wide` was refunded"
        );
        assert_eq!(
            owed(&s, &sh(100), "wide", &tb(10), 0),
            2,
            "and forgiven in the debt"
        );
    }

    #[test]
    fn instances_divide_the_limit() {
        let s = prepared(100);
        let req = TakeRequest {
            buckets: vec![bucket("k", 10)],
        };
        let three = Shares {
            instances: 3,
            ..sh(100)
        };
        let admitted = (0..10)
            .filter(|_| take_all(&s, &three, &req, 0).allowed)
            .count();
        assert_eq!(admitted, 3);
    }

    #[test]
    fn the_share_follows_the_answers() {
        let (s, t) = (prepared(100), sh(100));
        let l = Limits::local(100, 100, 60_000, Algorithm::TokenBucket, 4);
        // The service said 8 left: this proxy's share is 2, whatever the static split (25).
        remember_one(&s, &t, "k", &l, 1_000, 8, 0);
        let admitted = (0..10)
            .filter(|_| take(&s, &t, "k", &l, 1_000, 1).allowed)
            .count();
        assert_eq!(admitted, 2);
        // An answer never raises the share; refill at rate/N does (25 per minute here).
        remember_one(&s, &t, "k", &l, 1_000, 100, 0);
        assert!(!take(&s, &t, "k", &l, 1_000, 1).allowed);
        assert!(
            take(&s, &t, "k", &l, 3_400, 1).allowed,
            "2.4 s × 25/min = 1 token"
        );
        assert_eq!(owed(&s, &t, "k", &l, 3_400), 3);
        // The debt lowers the share an answer implies: 40 left / 4 = 10, less 3 owed.
        remember_one(&s, &t, "k", &l, 3_400, 40, 0);
        let admitted = (0..10)
            .filter(|_| take(&s, &t, "k", &l, 3_400, 1).allowed)
            .count();
        assert_eq!(admitted, 0, "share 0 after the refill token was spent");
    }

    #[test]
    fn a_leasing_rule_takes_no_share_of_an_answer() {
        let cfg = |lease: &str| {
            Config::parse(format!(
                r#"{{"service":{{"cluster":"c"}},"fallback":{{"instances":4,"min_instances":4,"max_keys":100}},
                    "rules":[{{"name":"r","capacity":1000,"period_ms":3600000{lease}}}]}}"#
            ).as_bytes())
            .unwrap_or_else(|e| unreachable!("{e}"))
        };
        let answered = |cfg: &Config| {
            let s = prepared(100);
            let b = Bucket {
                period_ms: 3_600_000,
                ..bucket("k", 1000)
            };
            let plan = Plan {
                request: TakeRequest {
                    buckets: vec![b.clone()],
                },
                rules: vec![0],
                debt: vec![],
                rls: None,
                instances: 0,
            };
            let answer = BucketResult {
                allowed: true,
                limit: 1000,
                remaining: 900,
                reset_ms: 0,
                retry_after_ms: 0,
                granted: 1,
                delay_ms: 0,
            };
            let outcome = Outcome::Allowed(TakeResponse {
                allowed: true,
                buckets: vec![answer],
                instances: 4,
                delay_ms: 0,
            });
            remember(cfg, &plan, &outcome, &[], &s, 0);
            let l = limits_of(&b, 4);
            (0..300)
                .filter(|_| take(&s, &sh(100), "k", &l, 0, 1).allowed)
                .count()
        };
        // Exact: a quarter of the 900 the answer reported.
        assert_eq!(answered(&cfg("")), 225);
        // Leasing: the answer may be stale by all the others leased since; the pool is the budget.
        assert_eq!(answered(&cfg(r#","lease":{"size":100}"#)), 0);
    }

    #[test]
    fn a_refusal_by_the_breaker_starts_a_recovery_and_a_spend_is_not_owed() {
        let cfg = Config::parse(
            br#"{"service":{"cluster":"c","timeout_ms":20},"fallback":{"instances":1,"max_keys":10},
                 "breaker":{"open_ms":100,"max_open_ms":1000},
                 "rules":[{"name":"r","key":["literal:k"],"capacity":10,"period_ms":3600000}]}"#,
        )
        .unwrap_or_else(|e| unreachable!("{e}"));
        // Twice the breaker's interval (within open_ms and max_open_ms) and a timeout on either
        // side.
        assert_eq!(recovery_until(&cfg, 0, 100), 240);
        assert_eq!(recovery_until(&cfg, 0, 400), 840);
        assert_eq!(recovery_until(&cfg, 0, 1_000), 1_040, "max_open_ms at most");
        assert_eq!(recovery_until(&cfg, 0, 0), 140, "open_ms at least");
        let s = prepared(10);
        let t = Shares::of(&cfg);
        // No refill to speak of: 10 an hour.
        let hourly = Bucket {
            period_ms: 3_600_000,
            ..bucket("k", 10)
        };
        let req = TakeRequest {
            buckets: vec![hourly],
        };
        let plan = |now: u64, s: &FakeStore| {
            let mut p = Plan {
                request: req.clone(),
                rules: vec![0],
                debt: vec![],
                rls: None,
                instances: 0,
            };
            (attach_debts(&cfg, &mut p, s, now), p.debt)
        };
        // A failed callout's take is owed, and starts no recovery.
        assert!(take_all_as(&s, &t, &req, 100, Charge::OWE).allowed);
        assert_eq!(plan(200, &s), (false, vec![1]));
        // A refusal by the breaker (open for 400 ms): owed, and the bucket recovers until
        // 840 ms after it. A later refusal while the interval is shorter does not cut that.
        let refused = |now, interval| Charge::outage(recovery_until(&cfg, now, interval));
        assert!(take_all_as(&s, &t, &req, 300, refused(300, 400)).allowed);
        assert!(take_all_as(&s, &t, &req, 310, refused(310, 100)).allowed);
        assert_eq!(plan(400, &s), (true, vec![3]));
        assert_eq!(plan(1_139, &s), (true, vec![3]));
        assert_eq!(plan(1_140, &s), (false, vec![3]));
        // A spend in recovery takes from the share without owing it; given back, it is the
        // share's again, and the debt is what it was.
        let l = Limits::local(10, 10, 3_600_000, Algorithm::TokenBucket, 1);
        assert!(take_all_as(&s, &t, &req, 400, Charge::SPEND).allowed);
        assert_eq!(owed(&s, &t, "k", &l, 400), 3);
        let left = |s: &FakeStore| {
            (0..20)
                .filter(|_| take_all_as(s, &t, &req, 400, Charge::SPEND).allowed)
                .count()
        };
        let probe = s.map.borrow().clone();
        assert_eq!(left(&s), 6, "10 less 3 on credit and 1 spent");
        *s.map.borrow_mut() = probe;
        refund_spent(&s, &t, &req, 400);
        assert_eq!(owed(&s, &t, "k", &l, 400), 3);
        assert_eq!(left(&s), 7);
        // A request of a leasing rule is never in recovery (its pool was charged already).
        let leasing = Config::parse(
            br#"{"service":{"cluster":"c"},"fallback":{"instances":1,"max_keys":10},
                 "rules":[{"name":"r","key":["literal:k"],"capacity":10,"period_ms":3600000,"lease":{"size":2}}]}"#,
        )
        .unwrap_or_else(|e| unreachable!("{e}"));
        let mut p = Plan {
            request: req.clone(),
            rules: vec![0],
            debt: vec![],
            rls: None,
            instances: 0,
        };
        assert!(!attach_debts(&leasing, &mut p, &s, 400));
    }

    #[test]
    fn a_record_written_before_the_outage_mark_keeps_its_share_and_debt() {
        let (s, t) = (prepared(10), sh(10));
        let l = tb(10);
        let sl = slot("k", &l, 10);
        // The earlier format: eight words, 4 tokens held of 10, 3 owed.
        let held = bucket::share(&l, 4, 0, 0);
        let words = [held.level, held.stamp, 3, 0, 10, 10, 1000, 1];
        s.map.borrow_mut().insert(
            sl.name.clone(),
            (table::encode(table::SHARE, &sl.id, &words), 1),
        );
        assert_eq!(owed(&s, &t, "k", &l, 0), 3);
        let admitted = (0..10)
            .filter(|_| take(&s, &t, "k", &l, 0, 1).allowed)
            .count();
        assert_eq!(admitted, 4);
        assert_eq!(owed(&s, &t, "k", &l, 0), 7);
        assert_eq!(
            s.map.borrow().get(&sl.name).map(|(v, _)| v.len()),
            Some(SLOT_BYTES),
            "written again in this format"
        );
    }

    #[test]
    fn an_answer_repays_the_debt() {
        let (s, t) = (prepared(10), sh(10));
        let l = tb(10);
        for _ in 0..4 {
            assert!(take(&s, &t, "k", &l, 0, 1).allowed);
        }
        assert_eq!(owed(&s, &t, "k", &l, 0), 4);
        remember_one(&s, &t, "k", &l, 10, 3, 3);
        assert_eq!(owed(&s, &t, "k", &l, 10), 1);
    }

    #[test]
    fn steady_answers_do_not_write() {
        let (s, t) = (prepared(10), sh(10));
        let l = Limits::local(100, 100, 1000, Algorithm::TokenBucket, 1);
        remember_one(&s, &t, "k", &l, 0, 100, 0);
        remember_one(&s, &t, "k", &l, 0, 50, 0);
        let writes = s.writes.get();
        remember_one(&s, &t, "k", &l, 0, 50, 0);
        remember_one(&s, &t, "k", &l, 5, 50, 0);
        assert_eq!(s.writes.get(), writes, "no change worth a write");
        remember_one(&s, &t, "k", &l, 5, 10, 0);
        assert_eq!(s.writes.get(), writes + 1);
    }

    #[test]
    fn fixed_window_share_counts_the_window() {
        let (s, t) = (prepared(10), sh(10));
        let l = Limits::local(10, 10, 1000, Algorithm::FixedWindow, 2);
        remember_one(&s, &t, "k", &l, 5_100, 2, 0);
        assert!(take(&s, &t, "k", &l, 5_200, 1).allowed);
        assert!(!take(&s, &t, "k", &l, 5_300, 1).allowed, "share was 1");
        assert!(
            take(&s, &t, "k", &l, 6_000, 1).allowed,
            "next window: 5 again"
        );
    }

    #[test]
    fn garbage_in_a_slot_is_another_bucket() {
        let s = prepared(10);
        let sl = slot("k", &tb(2), 10);
        s.map
            .borrow_mut()
            .insert(sl.name.clone(), (vec![1, 2, 3], 7));
        assert!(
            !take(&s, &sh(10), "k", &tb(2), 0, 1).allowed,
            "starts empty"
        );
    }

    #[test]
    fn prepare_walks_once() {
        let s = prepared(50);
        let writes = s.writes.get();
        prepare(&s, 50);
        assert_eq!(s.writes.get(), writes);
        // Another size is a table of its own (a bucket's slot depends on the size).
        prepare(&s, 20);
        assert_eq!(s.writes.get(), writes + 21, "20 slots and the mark");
        prepare(&s, 20);
        assert_eq!(s.writes.get(), writes + 21);
    }
}
