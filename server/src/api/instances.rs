//! Live proxy instances: how many proxies of the deployment are calling, returned in every answer
//! so the filter's fallback can split a limit by the fleet's real size (contract/README.md,
//! "Instances").
//!
//! Each take may carry the calling proxy's `instance` id. A replica notes the ids it hears in
//! memory ([`Instances::note`], no I/O) and, about once a second, hands the ids heard since the
//! last time to the store ([`crate::store::Store::live_instances`]) in one call that also returns
//! the deployment's count; every answer carries the latest count. So the take path never waits
//! for the registry, and each replica costs the store one small call per second.
//!
//! On Redis the registry is one sorted set per key prefix (`<prefix>instances:{instances}`, ids
//! scored by the Redis `TIME` they were last reported, `lua/instances.lua`). It is deliberately not
//! updated by the take scripts: a take runs in its buckets' Redis Cluster slot, and a set shared by
//! the deployment lives in one slot, so a take script could only reach it by breaking Cluster, or
//! keep one set per slot and count only the proxies that happened to touch that slot (too few, so
//! shares too large). One single-key call per replica per second is cluster-safe by construction.
//! On the memory store the replica's own view is the count.
//!
//! The count is conservative where it can be: ids stay live for the registry's TTL
//! (`--instance-ttl-ms`, [`DEFAULT_TTL_MS`] by default: longer than a leasing proxy's quietest
//! stretch, `lease.max_age_ms` at most 60 s) after their last take,
//! replicas' views are merged in the store, and every proxy sharing the key prefix counts (two
//! fleets calling one service count as one deployment: a larger N only makes each fallback share
//! smaller, never larger).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// By default, an instance not heard from for this long is no longer live: above the longest
/// `lease.max_age_ms` (60 s), so a proxy that serves a hot key from its leases, calling out once a
/// minute or so, stays counted.
pub const DEFAULT_TTL_MS: u64 = 90_000;
/// The shortest TTL `--instance-ttl-ms` accepts: the report interval ([`FLUSH_EVERY`]); a shorter
/// one would forget an id between two reports.
pub const MIN_TTL_MS: u64 = 1_000;
/// The longest TTL `--instance-ttl-ms` accepts (one day).
pub const MAX_TTL_MS: u64 = 86_400_000;
/// How often a replica reports the ids it heard to the store and learns the count.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// Most ids one replica remembers; ids heard beyond that are not counted by it until some expire.
pub const MAX_LOCAL: usize = 10_000;

struct Local {
    /// Id -> when it was last heard, and whether the store has been told since.
    seen: HashMap<String, (Instant, bool)>,
    last_flush: Option<Instant>,
}

/// One replica's view of the live instances, and the count last learned from the store.
pub struct Instances {
    local: Mutex<Local>,
    /// The deployment's count as the store last returned it (0 before the first report).
    learned: AtomicU64,
    /// This replica's own live ids (as of the last prune) plus the ids heard since.
    known: AtomicU64,
    /// Whether a report to the store has succeeded yet: until then the count is unknown.
    reported: AtomicBool,
    flushing: AtomicBool,
    /// An id not heard from for this many milliseconds is no longer live.
    ttl_ms: u64,
}

impl Default for Instances {
    fn default() -> Self {
        Instances::new(DEFAULT_TTL_MS)
    }
}

impl Instances {
    /// An empty registry whose ids stay live for `ttl_ms` after they were last heard.
    pub fn new(ttl_ms: u64) -> Self {
        Instances {
            local: Mutex::new(Local {
                seen: HashMap::new(),
                last_flush: None,
            }),
            learned: AtomicU64::new(0),
            known: AtomicU64::new(0),
            reported: AtomicBool::new(false),
            flushing: AtomicBool::new(false),
            ttl_ms,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Local> {
        match self.local.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Notes that `id` (a validated instance id, if the take carried one) was heard at `now`.
    /// Returns the count to answer with, and whether a report to the store is due (the caller
    /// then runs [`Instances::flush`] off the take path).
    pub fn note(&self, id: Option<&str>, now: Instant) -> (u64, bool) {
        let mut l = self.lock();
        if let Some(id) = id {
            if let Some(e) = l.seen.get_mut(id) {
                e.0 = now;
            } else if l.seen.len() < MAX_LOCAL {
                l.seen.insert(id.to_string(), (now, false));
                self.known.store(l.seen.len() as u64, Ordering::Relaxed);
            }
        }
        let due = l
            .last_flush
            .is_none_or(|t| now.saturating_duration_since(t) >= FLUSH_EVERY);
        let due = due
            && self
                .flushing
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok();
        if due {
            l.last_flush = Some(now);
        }
        (self.count(), due)
    }

    /// The count an answer carries: the deployment's as last learned, at least this replica's own;
    /// 0 (unknown: the filter keeps the count it had) until the first report to the store came
    /// back. A replica started mid-run has heard only its own few callers, and answering that as
    /// the deployment's size would grow every fallback share those callers hold.
    pub fn count(&self) -> u64 {
        if !self.reported.load(Ordering::Acquire) {
            return 0;
        }
        self.learned
            .load(Ordering::Relaxed)
            .max(self.known.load(Ordering::Relaxed))
    }

    /// Reports the ids heard since the last report (and those re-heard) to the store, learns the
    /// deployment's count, and forgets ids not heard for the TTL. Only after a `note` said a
    /// report is due. A store error keeps the last count (and the ids, for the next report).
    pub async fn flush(&self, store: &dyn crate::store::Store, now: Instant) -> u64 {
        let ttl = Duration::from_millis(self.ttl_ms);
        let report: Vec<String> = {
            let mut l = self.lock();
            l.seen
                .retain(|_, (at, _)| now.saturating_duration_since(*at) < ttl);
            self.known.store(l.seen.len() as u64, Ordering::Relaxed);
            // An id is reported when new (or after a failed report), and again whenever it was
            // heard within the last interval, so the store's last-heard time stays fresh.
            l.seen
                .iter_mut()
                .filter(|(_, (at, told))| !*told || *at + FLUSH_EVERY > now)
                .map(|(id, (_, told))| {
                    *told = true;
                    id.clone()
                })
                .collect()
        };
        match store.live_instances(&report, self.ttl_ms).await {
            Ok(Some(n)) => {
                self.learned.store(n, Ordering::Relaxed);
                self.reported.store(true, Ordering::Release);
            }
            Ok(None) => {
                self.learned
                    .store(self.known.load(Ordering::Relaxed), Ordering::Relaxed);
                self.reported.store(true, Ordering::Release);
            }
            Err(e) => {
                tracing::debug!(error = %e, "live instances not reported; keeping the last count");
                let mut l = self.lock();
                for id in &report {
                    if let Some(e) = l.seen.get_mut(id) {
                        e.1 = false;
                    }
                }
            }
        }
        self.flushing.store(false, Ordering::Release);
        self.count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;

    #[tokio::test]
    async fn counts_what_it_hears_and_forgets_the_silent() {
        let reg = Instances::new(10_000);
        let store = MemoryStore::new();
        let t0 = Instant::now();
        let (n, due) = reg.note(Some("a"), t0);
        assert_eq!((n, due), (0, true), "unknown until the store answered");
        assert_eq!(reg.flush(&store, t0).await, 1);
        let (n, due) = reg.note(Some("b"), t0 + Duration::from_millis(10));
        assert_eq!((n, due), (2, false), "a report a second at most");
        reg.note(Some("a"), t0 + Duration::from_millis(20));
        assert_eq!(
            reg.note(None, t0).0,
            2,
            "a take without an id is not counted"
        );
        // `b` is heard again 5.5 s in, `a` is not: 10.5 s in, only `b` is live.
        let (_, due) = reg.note(Some("b"), t0 + Duration::from_millis(5_500));
        assert!(due);
        assert_eq!(
            reg.flush(&store, t0 + Duration::from_millis(5_500)).await,
            2
        );
        let later = t0 + Duration::from_millis(10_500);
        let (_, due) = reg.note(None, later);
        assert!(due);
        assert_eq!(reg.flush(&store, later).await, 1, "a went silent");
    }

    /// By default an id silent for a minute (a proxy serving a hot key from a lease with
    /// `max_age_ms` 60 s) is still counted; one silent for longer than 90 s is not.
    #[tokio::test]
    async fn a_leasing_proxy_stays_counted_by_default() {
        let reg = Instances::default();
        let store = MemoryStore::new();
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        reg.note(Some("leaser"), t0);
        reg.note(Some("taker"), t0);
        assert_eq!(reg.flush(&store, t0).await, 2);
        for ms in [30_000, 60_000, 89_000] {
            reg.note(Some("taker"), at(ms));
            assert_eq!(reg.flush(&store, at(ms)).await, 2, "{ms} ms in");
        }
        reg.note(Some("taker"), at(90_500));
        assert_eq!(reg.flush(&store, at(90_500)).await, 1, "90.5 s of silence");
    }

    /// A configured TTL: an id heard again within it stays, one silent for longer goes.
    #[tokio::test]
    async fn a_configured_ttl_is_kept() {
        let reg = Instances::new(3_000);
        let store = MemoryStore::new();
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        reg.note(Some("a"), t0);
        reg.note(Some("b"), t0);
        assert_eq!(reg.flush(&store, t0).await, 2);
        reg.note(Some("a"), at(1_500));
        assert_eq!(reg.flush(&store, at(1_500)).await, 2);
        reg.note(Some("a"), at(2_900));
        assert_eq!(reg.flush(&store, at(2_900)).await, 2, "b within its 3 s");
        reg.note(Some("a"), at(3_100));
        assert_eq!(reg.flush(&store, at(3_100)).await, 1, "b silent for 3.1 s");
        assert_eq!(reg.flush(&store, at(4_600)).await, 1, "a heard 1.5 s ago");
        assert_eq!(reg.flush(&store, at(6_200)).await, 0, "both silent");
    }
}
