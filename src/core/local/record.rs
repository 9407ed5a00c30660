//! The admission record: the one shared-data entry every request reads at admission, holding the
//! breaker's own state and, apart from it, the marks the other local stages leave there for the
//! next request (whether debts or remembered denials may be outstanding, the number of proxies).
//! One read answers all of them; this module alone knows the format, so no stage reads another's
//! facts out of the breaker's state.
//!
//! **Format** (version: the [`table::BREAKER`] format byte, five words; a record of another
//! format or length reads as [`Record::default`]: a closed breaker, no marks):
//!
//! | word | holds |
//! |------|-------|
//! | 0 | low half: the breaker's consecutive failures ([`BreakerState::failures`]); high half: the number of proxies learned ([`Marks::instances`], at most `u32::MAX`, 0: none yet) |
//! | 1 | until when the breaker is open, ms since the epoch ([`BreakerState::open_until_ms`], 0: closed) |
//! | 2 | the breaker's current open interval, ms ([`BreakerState::interval_ms`]) |
//! | 3 | until when fallback debts may be outstanding ([`Marks::debt_until_ms`], 0: none) |
//! | 4 | until when a remembered denial may hold ([`Marks::denied_until_ms`], 0: none) |
//!
//! The identity bytes of the [`table`] record are zero (one record per configuration's prefix).
//! The entry keeps the name and layout the breaker's entry had ([`KEY`]), so a configuration
//! push that loads this module over an earlier one keeps the breaker, the marks and the count.
//!
//! **Read once, written when something changed.** A request reads the record once, at
//! admission (the breaker's stage; a request the lease pools decide reads none). What the stages
//! change after an answer (the breaker's failure or success, a denial's mark, a new count, a
//! debt's mark) is written under CAS by the stage that changes it, only when it changes it: a
//! steady request writes nothing here. The changes are not gathered into one write at the end of
//! a decision, because later stages of the same decision read them: the lease pools deposit by
//! the count an answer has just taught, and the pools' refills are not sent while the breaker is
//! open, as the answer has just left it.
//!
//! **Why one per Envoy, not one per bucket.** The breaker and the number of proxies are this
//! Envoy's, not a bucket's: kept in every bucket's record, a breaker transition or a new count
//! would rewrite up to `fallback.max_keys` records. The marks are what spares a steady request
//! any per-bucket read while nothing is owed or remembered. The per-bucket records (fallback
//! shares with their debts, remembered denials, lease pools) stay in their own tables: they are
//! keyed by different identities (a share survives a changed limit, a denial and a pool do not;
//! the shares' table changes with `fallback.max_keys`, the denials' does not), and a denial is
//! written without compare-and-swap (a lost write costs a callout) where a share's charge must be
//! stored.

use crate::core::base::store::{update, CasStore, Change, Updated};
use crate::core::local::table;

/// Shared-data key of the admission record (the breaker's entry's name, kept).
pub const KEY: &str = "tollgate.breaker";

/// The breaker's own state ([`crate::core::local::breaker`] decides over it). Closed when
/// `open_until_ms == 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BreakerState {
    /// Consecutive failures while closed.
    pub failures: u32,
    /// While open: until when (ms since the epoch).
    pub open_until_ms: u64,
    /// Current open interval (doubles after each failed probe).
    pub interval_ms: u64,
}

impl BreakerState {
    /// The breaker's part of the record in `b` ([`Record::decode`]).
    pub fn decode(b: Option<&[u8]>) -> BreakerState {
        Record::decode(b).breaker
    }

    /// Whether the breaker is open (or half-open with a probe in flight).
    pub fn is_open(&self) -> bool {
        self.open_until_ms != 0
    }
}

/// What the other stages leave in the record for the next request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Marks {
    /// Until when fallback debts may be outstanding (0: none): while it lasts, callouts carry
    /// them ([`crate::core::local::fallback::attach_debts`]).
    pub debt_until_ms: u64,
    /// Until when a remembered denial may hold (0: none): while it lasts, requests look their
    /// buckets up in [`crate::core::local::denials`] before calling.
    pub denied_until_ms: u64,
    /// The number of proxies last learned from the service's answers (0: none yet), what the
    /// fallback splits a limit by ([`crate::core::local::fallback::learn`]): an answer that
    /// reports the number its request's admission read writes nothing and reads nothing more.
    pub instances: u64,
}

/// The admission record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Record {
    /// The breaker's state.
    pub breaker: BreakerState,
    /// The other stages' marks.
    pub marks: Marks,
}

impl Record {
    /// Serialised form (the module doc's table).
    pub fn encode(&self) -> Vec<u8> {
        let (b, m) = (&self.breaker, &self.marks);
        let counts = u64::from(b.failures) | (m.instances.min(u64::from(u32::MAX)) << 32);
        let words = [
            counts,
            b.open_until_ms,
            b.interval_ms,
            m.debt_until_ms,
            m.denied_until_ms,
        ];
        table::encode(table::BREAKER, &[0; table::ID_BYTES], &words)
    }

    /// Parses [`Record::encode`]'s output; anything else reads as the default record (a closed
    /// breaker, no marks).
    pub fn decode(b: Option<&[u8]>) -> Record {
        let Some((_, [counts, open_until_ms, interval_ms, debt_until_ms, denied_until_ms])) =
            b.and_then(|b| table::decode::<5>(table::BREAKER, b))
        else {
            return Record::default();
        };
        Record {
            breaker: BreakerState {
                failures: (counts & u64::from(u32::MAX)) as u32,
                open_until_ms,
                interval_ms,
            },
            marks: Marks {
                debt_until_ms,
                denied_until_ms,
                instances: counts >> 32,
            },
        }
    }
}

/// The stored record (the default when there is none).
pub fn read<S: CasStore + ?Sized>(store: &S) -> Record {
    Record::decode(store.get(KEY).as_ref().map(|(v, _)| v.as_slice()))
}

/// Read-modify-write of the record under CAS: `f` sees the current record and returns the one to
/// store (`None`: nothing to write) and its answer.
pub fn update_with<S, R, F>(store: &S, mut f: F) -> Updated<R>
where
    S: CasStore + ?Sized,
    F: FnMut(Record) -> (Option<Record>, R),
{
    update(store, KEY, |cur| match f(Record::decode(cur)) {
        (Some(next), r) => Change::Write(next.encode(), r),
        (None, r) => Change::Keep(r),
    })
}

/// Rewrites the marks as `change` says (`None`: leaves them as they are), under CAS, the
/// breaker's state kept.
pub fn rewrite<S: CasStore + ?Sized>(store: &S, change: &dyn Fn(Marks) -> Option<Marks>) {
    update_with(store, |r| {
        let next = change(r.marks).map(|marks| Record { marks, ..r });
        (next, ())
    });
}

/// Records that the fallback admitted on credit: debts may be outstanding until `until_ms`.
/// Written only when it extends the mark by more than a second, so an outage costs about one
/// write per second here.
pub fn mark_debt<S: CasStore + ?Sized>(store: &S, until_ms: u64) {
    rewrite(store, &|m| {
        (m.debt_until_ms.saturating_add(1000) < until_ms).then_some(Marks {
            debt_until_ms: until_ms,
            ..m
        })
    });
}

/// Records that a denial is remembered until `until_ms` ([`crate::core::local::denials`]). The
/// mark runs a second past the latest denial it covers, so a flood of denials writes here about
/// once a second, not once per denial; a mark that runs long only costs a lookup.
pub fn mark_denied<S: CasStore + ?Sized>(store: &S, until_ms: u64) {
    rewrite(store, &|m| {
        (m.denied_until_ms < until_ms).then_some(Marks {
            denied_until_ms: until_ms.saturating_add(1000),
            ..m
        })
    });
}

/// The number of proxies last learned from the service's answers, if any ([`Marks::instances`]).
pub fn learned_instances<S: CasStore + ?Sized>(store: &S) -> Option<u64> {
    let (v, _) = store.get(KEY)?;
    Some(Record::decode(Some(&v)).marks.instances).filter(|&n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_and_garbage_is_the_default() {
        let r = Record {
            breaker: BreakerState {
                failures: 7,
                open_until_ms: u64::MAX,
                interval_ms: 3,
            },
            marks: Marks {
                debt_until_ms: 9,
                denied_until_ms: 11,
                instances: 13,
            },
        };
        assert_eq!(Record::decode(Some(&r.encode())), r);
        assert_eq!(Record::decode(Some(&[1, 2, 3])), Record::default());
        assert_eq!(Record::decode(None), Record::default());
    }
}
