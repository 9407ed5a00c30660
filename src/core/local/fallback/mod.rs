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
//! bucket holds, debt first ([`repay_debts`]): the request is admitted only when the grant covers
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
//! never below `fallback.min_instances`. It is kept in shared data (the admission record,
//! [`learned_instances`]) so every worker of this Envoy splits by the same N, and a change carries
//! the shares over like any other change of the limits: a fleet grown from 4 to 8 proxies halves
//! every share at its next use. While the service is away N stays what it last said.
//!
//! Layout: the table ([`slot`], [`prepare`]; the scheme is [`table`]'s); the record (`Entry`); the
//! operations on one slot ([`take`], [`refund`], [`remember_one`], [`owed`]); over a request
//! ([`take_all`], [`take_all_as`], [`refund_spent`], [`remember`]); `debts`: the debts a callout
//! carries and the recovery after an outage ([`attach_debts`], [`repay_debts`],
//! [`recovery_until`], [`on_failure`]); `tests`.

mod debts;

use crate::core::base::place::Memos;
use crate::core::base::store::{update, CasStore, Change};
use crate::core::config::{Algorithm, Config, FailureMode};
use crate::core::local::bucket::{self, Limits, State};
use crate::core::local::record::{self, learned_instances};
use crate::core::local::table;
pub use crate::core::local::table::Place;
use crate::core::settle;
use crate::core::wire::plan::{Outcome, Plan};
use crate::core::wire::{Bucket, BucketResult, TakeRequest, TakeResponse};
pub use debts::{attach_debts, on_failure, recovery_until, repay_debts};

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
    /// floor): what holds until the service reports the live instances. `previous`: the table
    /// sizes earlier configurations used ([`prepare_for`]'s answer when this one was applied).
    pub fn of(cfg: &Config, previous: [u32; 3]) -> Shares {
        Shares {
            max_keys: cfg.fallback.max_keys,
            instances: cfg.fallback.instances.max(cfg.fallback.min_instances),
            horizon_ms: debt_horizon_ms(cfg),
            previous,
        }
    }

    /// The shares `plan` is taken in: split by the number of proxies its admission read
    /// ([`Plan::instances`]), or, when it read none, by the one stored now ([`Shares::learned`]).
    pub fn of_plan<S: CasStore + ?Sized>(
        cfg: &Config,
        previous: [u32; 3],
        plan: &Plan,
        store: &S,
    ) -> Shares {
        match plan.instances {
            0 => Shares::of(cfg, previous).learned(store),
            known => Shares {
                instances: known,
                ..Shares::of(cfg, previous)
            },
        }
    }

    /// These shares split by the number of proxies learned from the answers, when one was
    /// ([`learn`]; it is stored already floored, in the admission record: [`learned_instances`]).
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

/// Stores `heard` (the live instances an answer reported), floored at `fallback.min_instances`,
/// as this Envoy's number of proxies; writes only when it changed. `known` is the number the
/// request's admission read ([`crate::core::local::breaker::Seen::instances`], 0 if none): when the floored number is
/// that one, nothing is read or written (another worker may have stored a different number since;
/// the next admission reads it, and the next answer that differs from it writes). Returns that
/// number, so the caller need not read it back.
pub fn learn<S: CasStore + ?Sized>(cfg: &Config, store: &S, heard: u64, known: u64) -> u64 {
    let n = heard.max(cfg.fallback.min_instances).max(1);
    if n == known {
        return n;
    }
    record::rewrite(store, &|m| {
        (m.instances != n).then_some(record::Marks { instances: n, ..m })
    });
    n
}

/// The slot of a fallback bucket in the table of `max_keys` slots ([`table::share_place`], last
/// found in `memos`).
pub fn slot(memos: &Memos, key: &str, l: &Limits, max_keys: u32) -> Place {
    table::share_place(memos, key, l, max_keys)
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
        let old = slot(store.memos(), key, l, size);
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

/// [`table::prepare`] for the fallback table of `max_keys` slots.
pub fn prepare<S: CasStore + ?Sized>(store: &S, max_keys: u32) {
    table::prepare(
        store,
        &table::shares_table(max_keys),
        max_keys,
        &table::vacant(),
    );
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
            return Change::Keep(old);
        }
        let mut new = vec![max_keys];
        new.extend(old.into_iter().filter(|&n| n != max_keys).take(3));
        let bytes = new.iter().flat_map(|n| n.to_le_bytes()).collect();
        Change::Write(bytes, new)
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
/// the fallback table sizes earlier configurations used (for `flow::Applied::previous_max_keys`).
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
        table::prepare(
            store,
            table::POOLS_TABLE,
            cfg.fallback.max_keys,
            &table::vacant(),
        );
    }
    previous
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
        window: 0,
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
    let slot = slot(store.memos(), key, l, sh.max_keys);
    let done = update(store, &slot.name, |cur| {
        let (state, debt, until) = match entry(store, sh, key, l, &slot.id, cur, now_ms) {
            Entry::Missing => return Change::Keep(None),
            // The holder owes tokens: it keeps its slot, the newcomer gets nothing.
            Entry::Other { debt } if debt > 0 => return Change::Keep(None),
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
        Change::Write(
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
    let slot = slot(store.memos(), key, l, sh.max_keys);
    update(store, &slot.name, |cur| {
        match entry(store, sh, key, l, &slot.id, cur, now_ms) {
            Entry::Ours(s, d, _, outage) => Change::Write(
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
            _ => Change::Keep(()),
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

/// What an answer reported of one bucket, for its share ([`remember_one`]): the whole tokens
/// left and, when the global balance is below zero (shaping: the service granted takes ahead of
/// the refill, this one's or others'), how long until it is back at zero: the refill is spoken
/// for until then.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reported {
    /// Whole tokens left (0 when below zero).
    pub remaining: u64,
    /// Ms from the answer until the balance is back at zero (0: not below zero by a token).
    pub owed_ms: u64,
}

impl From<u64> for Reported {
    /// `remaining` tokens left, nothing owed.
    fn from(remaining: u64) -> Self {
        Reported {
            remaining,
            owed_ms: 0,
        }
    }
}

impl Reported {
    /// What `r`, the answer for `b`, reports: a grant for later is due when the balance is back
    /// at zero (its `delay_ms`); a token bucket's denial at zero left could pay its cost after
    /// `retry_after_ms`, so its balance is back at zero the cost's refill earlier (counted when it
    /// is a token or more below zero; a cost above the capacity is never paid: nothing known).
    pub fn of(b: &Bucket, r: &BucketResult) -> Self {
        let owed_ms = match b.algorithm.unwrap_or_default() {
            _ if r.allowed => r.delay_ms,
            Algorithm::TokenBucket if r.remaining == 0 && b.cost() <= b.capacity => {
                let per = |tokens: u64| {
                    let ms =
                        u128::from(tokens) * u128::from(b.period_ms) / u128::from(b.rate().max(1));
                    u64::try_from(ms).unwrap_or(u64::MAX)
                };
                let owed = r.retry_after_ms.saturating_sub(per(b.cost()));
                if owed >= per(1) {
                    owed
                } else {
                    0
                }
            }
            _ => 0,
        };
        Reported {
            remaining: r.remaining,
            owed_ms,
        }
    }
}

/// Keeps one bucket's share in line with an answer from the service: the share becomes at most
/// `remaining / N − debt` (after `repaid` tokens of the debt were charged by this answer), or
/// nothing until the balance is back at zero when the answer says it is below ([`Reported`]),
/// and is never raised by an answer (refill does that). Writes only when the share drops by a
/// token or more, starts refilling later, or the debt changed, so a steady bucket costs one read
/// per answer.
pub fn remember_one<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    key: &str,
    l: &Limits,
    now_ms: u64,
    reported: impl Into<Reported>,
    repaid: u64,
) {
    let reported = reported.into();
    let slot = slot(store.memos(), key, l, sh.max_keys);
    update(store, &slot.name, |cur| {
        let (held, debt, changed, outage) = match entry(store, sh, key, l, &slot.id, cur, now_ms) {
            Entry::Missing | Entry::Other { debt: 1.. } => return Change::Keep(()),
            Entry::Vacant | Entry::Other { .. } => (None, 0, false, 0),
            Entry::Ours(s, d, changed, o) => (Some(s), d, changed, o),
        };
        let debt_left = debt.saturating_sub(repaid);
        let known = match reported.owed_ms {
            0 => bucket::share(l, reported.remaining, debt_left, now_ms),
            ms => bucket::empty_until(l, now_ms, now_ms.saturating_add(ms)),
        };
        let next = match held {
            Some(h) => bucket::stricter(l, h, known, now_ms),
            None => known,
        };
        match held {
            Some(h) if debt_left == debt && !changed => {
                let drop = bucket::available(l, h, now_ms)
                    .saturating_sub(bucket::available(l, next, now_ms));
                // Refilling from later: what a grant ahead of the refill leaves.
                let later =
                    bucket::project(l, next, now_ms).stamp > bucket::project(l, h, now_ms).stamp;
                if drop == 0 && !later {
                    return Change::Keep(());
                }
            }
            // A full share of a bucket not held yet is what a vacant slot means already.
            None if debt_left == 0 && bucket::available(l, next, now_ms) >= l.capacity => {
                return Change::Keep(());
            }
            _ => {}
        }
        Change::Write(encode(&slot.id, l, next, debt_left, now_ms, outage), ())
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
    let slot = slot(store.memos(), key, l, sh.max_keys);
    update(store, &slot.name, |cur| {
        let (state, debt, outage) = match entry(store, sh, key, l, &slot.id, cur, now_ms) {
            Entry::Ours(s, d, _, o) => (Some(s), d, o),
            Entry::Vacant => (None, 0, 0),
            Entry::Missing | Entry::Other { .. } => return Change::Keep(()),
        };
        let held = state.map_or(l.capacity, |s| bucket::available(l, s, now_ms));
        let drained = amount.min(held);
        if drained == 0 {
            return Change::Keep(());
        }
        let (state, _) = bucket::take(l, state, now_ms, drained);
        Change::Write(encode(&slot.id, l, state, debt, now_ms, outage), ())
    });
}

/// [`spend`] for each extra charge of a response's settlement ([`settle::Item`]s whose `used` is
/// above their `estimate`), in the shares as this proxy splits them now.
pub fn spend_extras<S: CasStore + ?Sized>(
    cfg: &Config,
    previous: [u32; 3],
    store: &S,
    items: &[settle::Item],
    now_ms: u64,
) {
    let sh = Shares::of(cfg, previous).learned(store);
    for i in items.iter().filter(|i| i.used > i.estimate) {
        let l = limits_of(&i.bucket, sh.instances);
        spend(store, &sh, &i.bucket.key, &l, now_ms, i.used - i.estimate);
    }
}

/// The local limits of a request bucket for `instances` proxies.
fn limits_of(b: &crate::core::wire::Bucket, instances: u64) -> Limits {
    Limits::local(
        b.capacity,
        b.calendar
            .as_ref()
            .map_or_else(|| b.rate(), bucket::calendar_rate),
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

/// What a bucket's slot says before a callout: what it owes, and until when it is in recovery
/// (0: never was, or the slot is another bucket's).
fn standing<S: CasStore + ?Sized>(
    store: &S,
    sh: &Shares,
    key: &str,
    l: &Limits,
    now_ms: u64,
) -> (u64, u64) {
    let slot = slot(store.memos(), key, l, sh.max_keys);
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

/// After an answer from the service: every bucket's share follows the answer ([`remember_one`]),
/// and its debt is reduced by `repaid` (from [`repay_debts`]). Failures change nothing here (the
/// failure mode charges the shares).
pub fn remember<S: CasStore + ?Sized>(
    cfg: &Config,
    previous: [u32; 3],
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
        0 => Shares::of_plan(cfg, previous, plan, store),
        heard => Shares {
            instances: learn(cfg, store, heard, plan.instances),
            ..Shares::of(cfg, previous)
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
        let mut reported = Reported::of(b, r);
        if leases {
            reported.remaining = 0;
        }
        remember_one(store, &sh, &b.key, &l, now_ms, reported, paid);
    }
}

/// How long a debt may wait for its bucket's next answer before it no longer matters: the
/// longest time any rule's bucket takes to fill from empty, at least 10 s and at most an hour
/// (computed with the configuration). Past that, the global bucket would have been full again.
pub fn debt_horizon_ms(cfg: &Config) -> u64 {
    cfg.fallback.debt_horizon_ms
}

#[cfg(test)]
mod tests;
