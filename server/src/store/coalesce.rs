//! Coalescing: takes that arrive together, from any connection, go to the store as one call.
//!
//! [`Coalescer`] wraps a [`Store`] and lets at most `calls` store calls run at once. A take that
//! finds a call free goes out at once, alone, as [`Store::take`]: at light load nothing waits and
//! nothing changes. A take that finds every call busy joins a queue; when a call returns, the queue
//! leaves as one [`Store::take_batch`] of at most `max_takes` takes (the Redis store runs
//! `take_batch.lua` once, once per hash slot on a Cluster). So under load one script run carries
//! many takes, and the Redis round trip, the script start and the reply parsing are paid once for
//! them instead of once each.
//!
//! **A slow store costs a take one call, not two.** A take queued behind busy calls would wait for
//! one of them to return before its own call starts: with a store 30 ms slower than usual, 60 ms,
//! past a proxy's 50 ms timeout. So once the latest call has been out
//! [`CoalesceConfig::slow_after`] (calls to a healthy Redis return well within it, so this never
//! fires then and nothing changes), the queue leaves in a call of its own beside the busy ones, up
//! to [`CoalesceConfig::extra_calls`] such calls at a time: at once for a take that arrives then,
//! else when that time comes (the take that found the queue empty watches it). Behind a slow store
//! a take waits at most `slow_after` for its call, and calls still carry many takes: one extra
//! call leaves per `slow_after` at most.
//!
//! What each caller sees is what it would see alone:
//!
//! * every take is decided independently and atomically, exactly as [`Store::take`] decides it
//!   (`take_batch.lua` and `take.lua` run the same `take_one.lua`);
//! * a failed call fails each of its takes with the store's error;
//! * a queued take waits at most `max_wait` (the store's own timeout) in all, then fails with
//!   [`StoreError::Timeout`]. A take whose caller stopped waiting (timed out, or its client went
//!   away) while still queued is dropped from the queue and never charged; one already sent may
//!   have been charged (a possible false denial, as with any timeout, never an admission).
//!
//! A batch ([`Store::take_batch`]: a `TakeBatch` call, or a message on a proxy's stream) is its
//! takes: one that finds a call free goes out at once as it is; one that finds every call busy
//! puts each of its takes in the queue, so the streams of many proxy workers, each sending a few
//! takes a message, share script runs as single takes do. Its answer is its takes' answers, in
//! order; if any of them failed (or waited `max_wait` in all) the batch fails with that error, as
//! one store call would have (its other takes may have been charged: a possible false denial,
//! never an admission).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::{Store, StoreError};
use crate::domain::{BucketSpec, TakeResponse, MAX_BATCH_TAKES};

/// How takes are coalesced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoalesceConfig {
    /// Most takes one coalesced call carries (capped at [`MAX_BATCH_TAKES`]).
    pub max_takes: usize,
    /// Most store calls in flight at once; more takes queue.
    pub calls: usize,
    /// Longest a queued take waits for its answer, queue and call together (the service sets
    /// the store's timeout). `None`: as long as the calls take, each bounded by the store's own
    /// timeout, so at most about twice that.
    pub max_wait: Option<Duration>,
    /// A queue that waited this long behind busy calls leaves in a call of its own beside them.
    pub slow_after: Duration,
    /// Most such calls in flight at once, beyond `calls`.
    pub extra_calls: usize,
}

/// [`CoalesceConfig::slow_after`] by default: a call to a healthy Redis on the same network
/// returns within a millisecond or two, so a queue that waited 5 ms is behind a slow one.
pub const SLOW_AFTER: Duration = Duration::from_millis(5);

/// [`CoalesceConfig::extra_calls`] by default: with `slow_after` 5 ms, six calls leave a 30 ms
/// call's worth of queue each 5 ms, so a take waits one slow call, not two.
pub const EXTRA_CALLS: usize = 6;

impl Default for CoalesceConfig {
    fn default() -> Self {
        CoalesceConfig {
            max_takes: MAX_BATCH_TAKES,
            calls: 2,
            max_wait: None,
            slow_after: SLOW_AFTER,
            extra_calls: EXTRA_CALLS,
        }
    }
}

type Reply = Result<TakeResponse, StoreError>;

/// A queued take and where its answer goes.
struct Job {
    specs: Vec<BucketSpec>,
    reply: oneshot::Sender<Reply>,
}

struct State {
    /// Store calls that may start now.
    free: usize,
    /// Takes waiting for a call. Invariant: non-empty only while `free == 0`.
    queue: VecDeque<Job>,
    /// Calls in flight beside the `calls` ones, for a queue behind calls out `slow_after`.
    extra: usize,
    /// When the latest call started.
    last_start: Instant,
}

struct Inner {
    store: Arc<dyn Store>,
    state: Mutex<State>,
    config: CoalesceConfig,
}

/// A [`Store`] whose concurrent takes share store calls (see the module doc).
pub struct Coalescer {
    inner: Arc<Inner>,
}

impl Coalescer {
    /// Wraps `store`. `config.calls` and `config.max_takes` are at least 1.
    pub fn new(store: Arc<dyn Store>, config: CoalesceConfig) -> Self {
        let config = CoalesceConfig {
            max_takes: config.max_takes.clamp(1, MAX_BATCH_TAKES),
            calls: config.calls.max(1),
            ..config
        };
        Coalescer {
            inner: Arc::new(Inner {
                store,
                state: Mutex::new(State {
                    free: config.calls,
                    queue: VecDeque::new(),
                    extra: 0,
                    last_start: Instant::now(),
                }),
                config,
            }),
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; a poisoned one still holds a consistent state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next takes to send, oldest first, skipping those nobody waits for any more. When there
    /// are none, the call permit is given back.
    fn next_batch(&self) -> Vec<Job> {
        let mut st = self.lock();
        let batch = self.drain(&mut st);
        if batch.is_empty() {
            st.free += 1;
        }
        batch
    }

    /// Up to `max_takes` queued takes, oldest first, skipping those nobody waits for any more;
    /// a call for them starts now.
    fn drain(&self, st: &mut State) -> Vec<Job> {
        let mut batch = Vec::new();
        while batch.len() < self.config.max_takes {
            match st.queue.pop_front() {
                Some(job) if job.reply.is_closed() => {}
                Some(job) => batch.push(job),
                None => break,
            }
        }
        if !batch.is_empty() {
            st.last_start = Instant::now();
        }
        batch
    }

    /// A call permit came back: the queue leaves in a task of its own, which keeps the permit
    /// while takes keep queueing, so the caller that held the permit is answered without waiting for
    /// others.
    fn release(self: &Arc<Self>) {
        let batch = self.next_batch();
        if batch.is_empty() {
            return;
        }
        let me = self.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    let mut batch = batch;
                    while !batch.is_empty() {
                        me.send(batch).await;
                        batch = me.next_batch();
                    }
                });
            }
            // No runtime (it is shutting down): the queued takes fail now rather than time out.
            Err(_) => {
                for job in batch {
                    let _ = job.reply.send(Err(StoreError::Connection(
                        "the service is shutting down".into(),
                    )));
                }
            }
        }
    }

    /// The latest call has been out `slow_after`: the queue leaves now in a call of its own, if
    /// fewer than `extra_calls` such calls are in flight (else a call that returns takes it).
    fn overflow(self: &Arc<Self>) {
        let batch = {
            let mut st = self.lock();
            if st.extra >= self.config.extra_calls {
                return;
            }
            let batch = self.drain(&mut st);
            if batch.is_empty() {
                return;
            }
            st.extra += 1;
            batch
        };
        let me = self.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                me.send(batch).await;
                me.lock().extra -= 1;
            });
        }
    }

    /// One store call for `jobs`, each answered on its own.
    async fn send(&self, jobs: Vec<Job>) {
        if let [_] = jobs.as_slice() {
            if let Some(job) = jobs.into_iter().next() {
                let r = self.store.take(&job.specs).await;
                let _ = job.reply.send(r);
            }
            return;
        }
        let (takes, replies): (Vec<Vec<BucketSpec>>, Vec<oneshot::Sender<Reply>>) =
            jobs.into_iter().map(|j| (j.specs, j.reply)).unzip();
        match self.store.take_batch(&takes).await {
            Ok(ds) if ds.len() == replies.len() => {
                for (reply, d) in replies.into_iter().zip(ds) {
                    let _ = reply.send(Ok(d));
                }
            }
            Ok(ds) => {
                let e = StoreError::Protocol(format!(
                    "{} decisions for a batch of {} takes",
                    ds.len(),
                    replies.len()
                ));
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
            }
            Err(e) => {
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
            }
        }
    }
}

/// A call permit held by a caller's own take; handed on when the take ends or is dropped.
struct Permit<'a>(&'a Arc<Inner>);

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

impl Coalescer {
    /// A call permit for the caller's own call (`None`), or, every call being busy, `takes` queued,
    /// each with the receiver of its answer, and, if this caller found the queue empty, how long
    /// it watches the queue before it leaves beside the busy calls: until the latest of them has
    /// been out [`CoalesceConfig::slow_after`] (zero when it has: the queue leaves now).
    fn permit_or_queue<'a>(
        &self,
        takes: impl Iterator<Item = &'a [BucketSpec]>,
    ) -> Option<(Vec<oneshot::Receiver<Reply>>, Option<Duration>)> {
        let mut st = self.inner.lock();
        if st.free > 0 {
            st.free -= 1;
            st.last_start = Instant::now();
            return None;
        }
        let watch = st.queue.is_empty().then(|| {
            let out = st.last_start.elapsed();
            self.inner.config.slow_after.saturating_sub(out)
        });
        let queued = takes
            .map(|specs| {
                let (reply, rx) = oneshot::channel();
                st.queue.push_back(Job {
                    specs: specs.to_vec(),
                    reply,
                });
                rx
            })
            .collect();
        Some((queued, watch))
    }

    /// The answers of queued takes, in order, each waited for until `max_wait` from now at most;
    /// the first error is the result.
    async fn answers(
        &self,
        (queued, watch): (Vec<oneshot::Receiver<Reply>>, Option<Duration>),
    ) -> Result<Vec<TakeResponse>, StoreError> {
        let abandoned = |_| StoreError::Connection("the coalesced call was abandoned".into());
        let answered = async {
            let mut out = Vec::with_capacity(queued.len());
            for rx in queued {
                out.push(rx.await.unwrap_or_else(|e| Err(abandoned(e)))?);
            }
            Ok(out)
        };
        let all = async {
            let Some(wait) = watch else {
                return answered.await;
            };
            if wait.is_zero() {
                self.inner.overflow();
                return answered.await;
            }
            tokio::pin!(answered);
            tokio::select! {
                biased;
                r = &mut answered => r,
                () = tokio::time::sleep(wait) => {
                    self.inner.overflow();
                    answered.await
                }
            }
        };
        let Some(max_wait) = self.inner.config.max_wait else {
            return all.await;
        };
        match tokio::time::timeout(max_wait, all).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(
                u64::try_from(max_wait.as_millis()).unwrap_or(u64::MAX),
            )),
        }
    }
}

#[async_trait::async_trait]
impl Store for Coalescer {
    async fn take(&self, buckets: &[BucketSpec]) -> Result<TakeResponse, StoreError> {
        let Some(queued) = self.permit_or_queue(std::iter::once(buckets)) else {
            let _permit = Permit(&self.inner);
            return self.inner.store.take(buckets).await;
        };
        let mut answers = self.answers(queued).await?;
        answers
            .pop()
            .ok_or_else(|| StoreError::Protocol("no decision for a take".into()))
    }

    async fn take_batch(&self, takes: &[Vec<BucketSpec>]) -> Result<Vec<TakeResponse>, StoreError> {
        let Some(queued) = self.permit_or_queue(takes.iter().map(Vec::as_slice)) else {
            let _permit = Permit(&self.inner);
            return self.inner.store.take_batch(takes).await;
        };
        self.answers(queued).await
    }

    async fn inspect(&self, b: &BucketSpec) -> Result<crate::domain::BucketState, StoreError> {
        self.inner.store.inspect(b).await
    }

    async fn inspect_slots(&self, key: &str) -> Result<crate::domain::SlotsState, StoreError> {
        self.inner.store.inspect_slots(key).await
    }

    async fn reset(&self, target: &crate::domain::ResetTarget) -> Result<bool, StoreError> {
        self.inner.store.reset(target).await
    }

    async fn acquire(
        &self,
        specs: &[crate::domain::SlotSpec],
        slot: &str,
    ) -> Result<crate::domain::AcquireResponse, StoreError> {
        self.inner.store.acquire(specs, slot).await
    }

    async fn release(&self, slot: &str, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        self.inner.store.release(slot, keys).await
    }

    async fn refund(&self, buckets: &[BucketSpec]) -> Result<u64, StoreError> {
        self.inner.store.refund(buckets).await
    }

    async fn settle(
        &self,
        settlement: &crate::domain::Settlement,
    ) -> Result<crate::domain::SettleResponse, StoreError> {
        self.inner.store.settle(settlement).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.store.ping().await
    }

    async fn live_instances(
        &self,
        seen: &[String],
        ttl_ms: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.store.live_instances(seen, ttl_ms).await
    }

    fn kind(&self) -> &'static str {
        self.inner.store.kind()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Algorithm;
    use crate::store::memory::MemoryStore;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A store that counts its calls and holds each for `delay`, over the memory store.
    struct Counting {
        mem: MemoryStore,
        singles: AtomicUsize,
        batches: AtomicUsize,
        batched: AtomicUsize,
        delay: Duration,
        fail: bool,
    }

    #[async_trait::async_trait]
    impl Store for Counting {
        async fn take(&self, b: &[BucketSpec]) -> Result<TakeResponse, StoreError> {
            self.singles.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(self.delay).await;
            if self.fail {
                return Err(StoreError::Server("down".into()));
            }
            self.mem.take(b).await
        }
        async fn take_batch(&self, t: &[Vec<BucketSpec>]) -> Result<Vec<TakeResponse>, StoreError> {
            self.batches.fetch_add(1, Ordering::SeqCst);
            self.batched.fetch_add(t.len(), Ordering::SeqCst);
            tokio::time::sleep(self.delay).await;
            if self.fail {
                return Err(StoreError::Server("down".into()));
            }
            self.mem.take_batch(t).await
        }
        async fn acquire(
            &self,
            specs: &[crate::domain::SlotSpec],
            slot: &str,
        ) -> Result<crate::domain::AcquireResponse, StoreError> {
            self.mem.acquire(specs, slot).await
        }
        async fn release(&self, slot: &str, keys: &[String]) -> Result<Vec<bool>, StoreError> {
            self.mem.release(slot, keys).await
        }
        async fn refund(&self, b: &[BucketSpec]) -> Result<u64, StoreError> {
            self.mem.refund(b).await
        }
        async fn inspect(&self, b: &BucketSpec) -> Result<crate::domain::BucketState, StoreError> {
            self.mem.inspect(b).await
        }
        async fn inspect_slots(&self, k: &str) -> Result<crate::domain::SlotsState, StoreError> {
            self.mem.inspect_slots(k).await
        }
        async fn reset(&self, t: &crate::domain::ResetTarget) -> Result<bool, StoreError> {
            self.mem.reset(t).await
        }
        async fn settle(
            &self,
            s: &crate::domain::Settlement,
        ) -> Result<crate::domain::SettleResponse, StoreError> {
            self.mem.settle(s).await
        }
        async fn ping(&self) -> Result<(), StoreError> {
            Ok(())
        }
        async fn live_instances(
            &self,
            seen: &[String],
            ttl: u64,
        ) -> Result<Option<u64>, StoreError> {
            self.mem.live_instances(seen, ttl).await
        }
        fn kind(&self) -> &'static str {
            "counting"
        }
    }

    fn counting(delay_ms: u64, fail: bool) -> Arc<Counting> {
        Arc::new(Counting {
            mem: MemoryStore::new(),
            singles: AtomicUsize::new(0),
            batches: AtomicUsize::new(0),
            batched: AtomicUsize::new(0),
            delay: Duration::from_millis(delay_ms),
            fail,
        })
    }

    fn bucket(key: &str, capacity: u64) -> BucketSpec {
        BucketSpec {
            key: key.into(),
            capacity,
            rate: 1,
            period_ms: 3_600_000,
            cost: 1,
            algorithm: Algorithm::TokenBucket,
            lease: 1,
            max_delay_ms: 0,
        }
    }

    fn config(calls: usize, max_takes: usize) -> CoalesceConfig {
        CoalesceConfig {
            max_takes,
            calls,
            max_wait: Some(Duration::from_secs(5)),
            // These tests count calls behind slow ones: no call of a queue's own.
            slow_after: Duration::from_secs(3600),
            extra_calls: 0,
        }
    }

    #[tokio::test]
    async fn a_lone_take_goes_out_alone() {
        let store = counting(0, false);
        let c = Coalescer::new(store.clone(), config(1, 64));
        for _ in 0..3 {
            let d = c.take(&[bucket("a", 10)]).await;
            assert!(matches!(d, Ok(ref d) if d.allowed), "{d:?}");
        }
        assert_eq!(store.singles.load(Ordering::SeqCst), 3);
        assert_eq!(store.batches.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn takes_behind_a_call_leave_together_and_each_is_decided() {
        let store = counting(20, false);
        let c = Arc::new(Coalescer::new(store.clone(), config(1, 8)));
        let tasks: Vec<_> = (0..40)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move { c.take(&[bucket("shared", 25)]).await })
            })
            .collect();
        let mut allowed = 0;
        for t in tasks {
            match t.await {
                Ok(Ok(d)) => allowed += usize::from(d.allowed),
                other => unreachable!("{other:?}"),
            }
        }
        assert_eq!(allowed, 25, "exactly the capacity");
        let (singles, batches, batched) = (
            store.singles.load(Ordering::SeqCst),
            store.batches.load(Ordering::SeqCst),
            store.batched.load(Ordering::SeqCst),
        );
        assert_eq!(singles + batched, 40, "every take sent once");
        assert!(batches >= 4, "{batches} batches of at most 8");
        assert!(
            singles + batches < 40,
            "{singles} single calls, {batches} batches"
        );
    }

    /// A store 30 ms slow: a take queued behind a busy call waits `slow_after`, then its own
    /// call, not the busy one's whole round trip first (it waited 60 ms, a proxy's 50 ms
    /// timeout passed); still exact.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn behind_a_slow_call_a_queue_leaves_in_a_call_of_its_own() {
        let store = counting(30, false);
        let c = Arc::new(Coalescer::new(
            store.clone(),
            CoalesceConfig {
                slow_after: Duration::from_millis(5),
                extra_calls: 6,
                ..config(1, 64)
            },
        ));
        let busy = tokio::spawn({
            let c = c.clone();
            async move { c.take(&[bucket("shared", 25)]).await }
        });
        tokio::time::sleep(Duration::from_millis(2)).await;
        let started = std::time::Instant::now();
        let tasks: Vec<_> = (0..30)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move {
                    let d = c.take(&[bucket("shared", 25)]).await;
                    (d, started.elapsed())
                })
            })
            .collect();
        let mut allowed = usize::from(matches!(busy.await, Ok(Ok(ref d)) if d.allowed));
        let mut slowest = Duration::ZERO;
        for t in tasks {
            match t.await {
                Ok((Ok(d), took)) => {
                    allowed += usize::from(d.allowed);
                    slowest = slowest.max(took);
                }
                other => unreachable!("{other:?}"),
            }
        }
        assert_eq!(allowed, 25, "exactly the capacity");
        // One call (30 ms) after 5 ms of queueing, with room for a loaded machine's timers; two
        // calls in a row would be 58 ms and more.
        assert!(
            slowest < Duration::from_millis(55),
            "a queued take waited {slowest:?}"
        );
        assert!(
            store.batches.load(Ordering::SeqCst) <= 2,
            "the queue still left together"
        );
        // Behind a quick call nothing of this happens: the queue leaves when it returns.
        let quick = counting(1, false);
        let c = Arc::new(Coalescer::new(quick.clone(), config(1, 64)));
        let tasks: Vec<_> = (0..30)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move { c.take(&[bucket("q", 100)]).await })
            })
            .collect();
        for t in tasks {
            assert!(matches!(t.await, Ok(Ok(_))));
        }
    }

    /// Batches (a stream's messages) behind a busy call share the next calls as single takes
    /// do: 20 batches of 3 in a few script runs, each batch answered in its order, exactly.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_behind_a_call_leave_together_each_answered_in_order() {
        let store = counting(20, false);
        let c = Arc::new(Coalescer::new(store.clone(), config(1, 64)));
        let tasks: Vec<_> = (0..20)
            .map(|i| {
                let c = c.clone();
                tokio::spawn(async move {
                    // One shared bucket, and two of the batch's own: allowed, allowed.
                    let own = |n: u32| vec![bucket(&format!("own-{i}-{n}"), 1)];
                    c.take_batch(&[vec![bucket("shared", 25)], own(0), own(1)])
                        .await
                })
            })
            .collect();
        let mut shared = 0;
        for t in tasks {
            match t.await {
                Ok(Ok(ds)) => {
                    assert_eq!(ds.len(), 3);
                    assert!(ds[1].allowed && ds[2].allowed, "its own, in order");
                    assert_eq!(ds[1].buckets[0].limit, 1);
                    shared += usize::from(ds[0].allowed);
                }
                other => unreachable!("{other:?}"),
            }
        }
        assert_eq!(shared, 20, "capacity 25: all 20 pass");
        let (singles, batches, batched) = (
            store.singles.load(Ordering::SeqCst),
            store.batches.load(Ordering::SeqCst),
            store.batched.load(Ordering::SeqCst),
        );
        assert_eq!(singles + batched, 60, "every take sent once");
        assert!(batches <= 4, "{batches} store calls for 20 batches");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_call_fails_each_of_its_takes() {
        let store = counting(10, true);
        let c = Arc::new(Coalescer::new(store.clone(), config(1, 64)));
        let tasks: Vec<_> = (0..10)
            .map(|i| {
                let c = c.clone();
                tokio::spawn(async move { c.take(&[bucket(&format!("k{i}"), 5)]).await })
            })
            .collect();
        for t in tasks {
            assert!(matches!(t.await, Ok(Err(StoreError::Server(_)))));
        }
        assert!(store.batches.load(Ordering::SeqCst) >= 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_queued_take_times_out_and_is_never_sent() {
        let store = counting(200, false);
        let c = Arc::new(Coalescer::new(
            store.clone(),
            CoalesceConfig {
                max_takes: 64,
                calls: 1,
                max_wait: Some(Duration::from_millis(20)),
                slow_after: Duration::from_secs(3600),
                extra_calls: 0,
            },
        ));
        let first = tokio::spawn({
            let c = c.clone();
            async move { c.take(&[bucket("t", 5)]).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let queued = c.take(&[bucket("t", 5)]).await;
        assert!(matches!(queued, Err(StoreError::Timeout(20))), "{queued:?}");
        assert!(matches!(first.await, Ok(Ok(ref d)) if d.allowed));
        // The queued take left the queue unsent; the permit is free again.
        let d = c.take(&[bucket("t", 5)]).await;
        assert!(
            matches!(d, Ok(ref d) if d.allowed && d.buckets[0].remaining == 3),
            "{d:?}"
        );
        assert_eq!(store.singles.load(Ordering::SeqCst), 2);
        assert_eq!(store.batches.load(Ordering::SeqCst), 0);
    }
}
