//! The circuit breaker, over a small state kept in the admission record in shared data
//! ([`crate::core::local::record`], updated with CAS), so every worker sees the same breaker.
//!
//! Closed: every request calls the service; `failures` consecutive failed callouts open it. A
//! failed batch (or messages on the stream that failed together) is one failed callout, however
//! many takes it carried; a take that waited its timeout in the batch queue, never sent, is none
//! (no news of the service). Every success resets the count, but a quick one after a clean
//! admission, which writes nothing ([`needs_record`]).
//! Open: requests skip the callout and go straight to the failure mode, for `interval_ms`.
//! When the interval is over, the first request to notice becomes the probe: it re-arms the
//! interval (so the others keep skipping while it is in flight) and calls. Its success closes the
//! breaker; its failure doubles the interval, up to `max_open_ms`. A dead service then costs one
//! callout timeout per interval instead of one per request. Failures of callouts that started
//! before the breaker opened do not extend it: only the probe's result counts while open.

use crate::core::base::store::CasStore;
use crate::core::config::Breaker;
use crate::core::local::record::{self, Record};

/// The breaker's state, kept in the admission record ([`record`], which also holds what the other
/// stages mark there). Closed when `open_until_ms == 0`.
pub use crate::core::local::record::BreakerState as State;

/// May this request call the service?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Closed: call.
    Call,
    /// The open interval is over and this request is the probe: call.
    Probe,
    /// Open: do not call; apply the failure mode (cause `breaker`).
    Reject,
}

/// A state change worth a metric or a log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Nothing changed that matters.
    None,
    /// Closed → open.
    Opened,
    /// A probe failed: open again, for a longer interval.
    Reopened,
    /// Open → closed.
    Closed,
}

/// Admission at `now_ms`, and the state to store (for a probe).
pub fn admit(cfg: &Breaker, s: State, now_ms: u64) -> (Admission, Option<State>) {
    if cfg.failures == 0 || !s.is_open() {
        return (Admission::Call, None);
    }
    if now_ms < s.open_until_ms {
        return (Admission::Reject, None);
    }
    let rearmed = State {
        open_until_ms: now_ms.saturating_add(s.interval_ms.max(1)),
        ..s
    };
    (Admission::Probe, Some(rearmed))
}

/// The state after a successful callout (`None`: nothing to store).
pub fn on_success(s: State) -> (Option<State>, Event) {
    let closed = State::default();
    if s.is_open() {
        (Some(closed), Event::Closed)
    } else if s.failures != 0 {
        (Some(closed), Event::None)
    } else {
        (None, Event::None)
    }
}

/// The state after a failed callout (`None`: nothing to store). `probe` says whether this callout
/// was the probe.
pub fn on_failure(cfg: &Breaker, s: State, now_ms: u64, probe: bool) -> (Option<State>, Event) {
    if cfg.failures == 0 {
        return (None, Event::None);
    }
    if s.is_open() {
        if !probe {
            return (None, Event::None);
        }
        let interval = s
            .interval_ms
            .saturating_mul(2)
            .clamp(cfg.open_ms, cfg.max_open_ms);
        let next = State {
            failures: s.failures,
            open_until_ms: now_ms.saturating_add(interval),
            interval_ms: interval,
        };
        return (Some(next), Event::Reopened);
    }
    let failures = s.failures.saturating_add(1);
    if failures >= cfg.failures {
        let next = State {
            failures,
            open_until_ms: now_ms.saturating_add(cfg.open_ms),
            interval_ms: cfg.open_ms,
        };
        (Some(next), Event::Opened)
    } else {
        (
            Some(State {
                failures,
                ..State::default()
            }),
            Event::None,
        )
    }
}

/// [`admit`] against the shared state, and whether fallback debts may be outstanding (one read
/// answers both). A probe is granted to exactly one caller: the CAS write that re-arms the
/// interval succeeds for one worker; the others re-read and see it open.
pub fn admit_shared<S: CasStore + ?Sized>(
    store: &S,
    cfg: &Breaker,
    now_ms: u64,
) -> (Admission, bool) {
    let seen = admit_seen(store, cfg, now_ms);
    (seen.admission, seen.debt)
}

/// What one read of the shared state said at admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// May this request call the service?
    pub admission: Admission,
    /// Whether fallback debts may be outstanding.
    pub debt: bool,
    /// Whether a remembered denial may hold ([`record::mark_denied`]).
    pub denials: bool,
    /// Closed with no failures counted: a success of this callout has nothing to record
    /// ([`needs_record`]).
    pub clean: bool,
    /// The number of proxies learned so far (0: none), [`record::Marks::instances`].
    pub instances: u64,
}

/// [`admit_shared`], also saying whether the state was clean: one read of the admission record,
/// its marks included.
pub fn admit_seen<S: CasStore + ?Sized>(store: &S, cfg: &Breaker, now_ms: u64) -> Seen {
    let u = record::update_with(store, |r| {
        let (s, m) = (r.breaker, r.marks);
        let debt = now_ms < m.debt_until_ms;
        let denials = now_ms < m.denied_until_ms;
        let clean = !s.is_open() && s.failures == 0;
        let seen = (debt, denials, clean, m.instances);
        match admit(cfg, s, now_ms) {
            (a, Some(next)) => (Some(Record { breaker: next, ..r }), (a, seen)),
            (a, None) => (None, (a, seen)),
        }
    });
    let (admission, (debt, denials, clean, instances)) = u.value;
    if u.stored {
        Seen {
            admission,
            debt,
            denials,
            clean,
            instances,
        }
    } else {
        // Could not claim the probe: someone else is probing.
        Seen {
            admission: Admission::Reject,
            debt,
            denials,
            clean: false,
            instances,
        }
    }
}

/// Whether a callout's result must be recorded ([`record_shared`]): a `quiet` success (after a
/// clean admission, answered within a tick) is not, so the steady path reads the state once per
/// request, not twice. A failure another worker recorded meanwhile is then reset by the next
/// success whose admission saw it, or by any slow success: failures count as consecutive to
/// within the quick callouts in flight when they began.
pub fn needs_record(quiet: bool, success: bool) -> bool {
    !(quiet && success)
}

/// Records a callout's result against the shared state.
pub fn record_shared<S: CasStore + ?Sized>(
    store: &S,
    cfg: &Breaker,
    now_ms: u64,
    success: bool,
    probe: bool,
) -> Event {
    if cfg.failures == 0 {
        return Event::None;
    }
    let u = record::update_with(store, |r| {
        let (next, event) = if success {
            on_success(r.breaker)
        } else {
            on_failure(cfg, r.breaker, now_ms, probe)
        };
        (next.map(|breaker| Record { breaker, ..r }), event)
    });
    if u.stored {
        u.value
    } else {
        Event::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::base::store::fake::FakeStore;
    use crate::core::local::record::{mark_debt, KEY};

    const CFG: Breaker = Breaker {
        failures: 3,
        open_ms: 100,
        max_open_ms: 350,
    };

    #[test]
    fn opens_after_consecutive_failures_and_success_resets_the_count() {
        let s = FakeStore::default();
        assert_eq!(record_shared(&s, &CFG, 0, false, false), Event::None);
        assert_eq!(record_shared(&s, &CFG, 0, false, false), Event::None);
        assert_eq!(
            record_shared(&s, &CFG, 0, true, false),
            Event::None,
            "success resets"
        );
        assert_eq!(record_shared(&s, &CFG, 0, false, false), Event::None);
        assert_eq!(record_shared(&s, &CFG, 0, false, false), Event::None);
        assert_eq!(admit_shared(&s, &CFG, 0).0, Admission::Call);
        assert_eq!(record_shared(&s, &CFG, 1000, false, false), Event::Opened);
        assert_eq!(admit_shared(&s, &CFG, 1000).0, Admission::Reject);
        assert_eq!(admit_shared(&s, &CFG, 1099).0, Admission::Reject);
    }

    #[test]
    fn one_probe_per_interval_and_backoff_doubles_to_the_cap() {
        let s = FakeStore::default();
        for _ in 0..3 {
            record_shared(&s, &CFG, 0, false, false);
        }
        // open until 100
        assert_eq!(admit_shared(&s, &CFG, 100).0, Admission::Probe);
        assert_eq!(
            admit_shared(&s, &CFG, 101).0,
            Admission::Reject,
            "one probe at a time"
        );
        // A late failure of an older callout does not extend the interval.
        assert_eq!(record_shared(&s, &CFG, 150, false, false), Event::None);
        assert_eq!(record_shared(&s, &CFG, 150, false, true), Event::Reopened);
        let st = State::decode(s.get(KEY).map(|v| v.0).as_deref());
        assert_eq!((st.interval_ms, st.open_until_ms), (200, 350));
        assert_eq!(admit_shared(&s, &CFG, 349).0, Admission::Reject);
        assert_eq!(admit_shared(&s, &CFG, 350).0, Admission::Probe);
        record_shared(&s, &CFG, 350, false, true);
        let st = State::decode(s.get(KEY).map(|v| v.0).as_deref());
        assert_eq!(st.interval_ms, 350, "capped at max_open_ms");
        assert_eq!(admit_shared(&s, &CFG, 700).0, Admission::Probe);
        assert_eq!(record_shared(&s, &CFG, 701, true, true), Event::Closed);
        assert_eq!(admit_shared(&s, &CFG, 702).0, Admission::Call);
        // After closing, it takes `failures` failures again, and starts from open_ms.
        for _ in 0..2 {
            assert_eq!(record_shared(&s, &CFG, 800, false, false), Event::None);
        }
        assert_eq!(record_shared(&s, &CFG, 800, false, false), Event::Opened);
        let st = State::decode(s.get(KEY).map(|v| v.0).as_deref());
        assert_eq!(st.interval_ms, 100);
    }

    #[test]
    fn a_stuck_probe_is_replaced_after_an_interval() {
        let s = FakeStore::default();
        for _ in 0..3 {
            record_shared(&s, &CFG, 0, false, false);
        }
        assert_eq!(admit_shared(&s, &CFG, 100).0, Admission::Probe);
        // The probe never reports (its VM died); the next interval gives another probe.
        assert_eq!(admit_shared(&s, &CFG, 200).0, Admission::Probe);
    }

    #[test]
    fn disabled_breaker_never_writes() {
        let off = Breaker { failures: 0, ..CFG };
        let s = FakeStore::default();
        for _ in 0..10 {
            assert_eq!(record_shared(&s, &off, 0, false, false), Event::None);
            assert_eq!(admit_shared(&s, &off, 0).0, Admission::Call);
        }
        assert_eq!(s.writes.get(), 0);
    }

    #[test]
    fn steady_success_does_not_write() {
        let s = FakeStore::default();
        for _ in 0..10 {
            let _ = admit_shared(&s, &CFG, 0);
            record_shared(&s, &CFG, 0, true, false);
        }
        assert_eq!(s.writes.get(), 0, "the hot path only reads");
    }

    #[test]
    fn a_success_after_a_clean_admission_records_nothing_and_one_after_failures_resets() {
        let s = FakeStore::default();
        let seen = admit_seen(&s, &CFG, 0);
        assert!(seen.clean);
        assert!(
            !needs_record(seen.clean, true),
            "steady success: no second read"
        );
        assert!(
            needs_record(seen.clean, false),
            "a failure is always recorded"
        );
        record_shared(&s, &CFG, 0, false, false);
        record_shared(&s, &CFG, 0, false, false);
        let seen = admit_seen(&s, &CFG, 0);
        assert!(!seen.clean, "failures counted");
        assert!(needs_record(seen.clean, true));
        record_shared(&s, &CFG, 0, true, false);
        // The success reset the count: two more failures do not open it (three would).
        record_shared(&s, &CFG, 0, false, false);
        record_shared(&s, &CFG, 0, false, false);
        assert_eq!(admit_shared(&s, &CFG, 1).0, Admission::Call);
        for _ in 0..3 {
            record_shared(&s, &CFG, 1, false, false);
        }
        assert!(!admit_seen(&s, &CFG, 2).clean, "open is never clean");
    }

    #[test]
    fn the_debt_mark_survives_transitions_and_lapses() {
        let s = FakeStore::default();
        assert!(!admit_shared(&s, &CFG, 0).1);
        mark_debt(&s, 10_000);
        let writes = s.writes.get();
        mark_debt(&s, 10_500);
        assert_eq!(s.writes.get(), writes, "less than a second later: no write");
        for _ in 0..3 {
            record_shared(&s, &CFG, 0, false, false);
        }
        assert_eq!(admit_shared(&s, &CFG, 50), (Admission::Reject, true));
        record_shared(&s, &CFG, 200, true, true);
        assert_eq!(admit_shared(&s, &CFG, 9_999), (Admission::Call, true));
        assert_eq!(admit_shared(&s, &CFG, 10_000), (Admission::Call, false));
        let off = Breaker { failures: 0, ..CFG };
        mark_debt(&s, 20_000);
        assert!(
            admit_shared(&s, &off, 15_000).1,
            "read with the breaker off too"
        );
    }

    #[test]
    fn probe_claim_under_conflict_goes_to_one_caller() {
        let s = FakeStore::default();
        for _ in 0..3 {
            record_shared(&s, &CFG, 0, false, false);
        }
        s.conflicts.set(crate::core::base::store::MAX_CAS_ATTEMPTS);
        assert_eq!(admit_shared(&s, &CFG, 100).0, Admission::Reject);
    }
}
