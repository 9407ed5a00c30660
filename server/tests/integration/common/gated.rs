//! A store (the memory store, or any other) whose takes wait at a gate until the test opens it: a
//! decision held in progress for as long as the test needs (shutdown while deciding, a permit
//! held, a slow message overtaken by a later one).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};
use tollgate_server::domain::{
    AcquireResponse, BucketSpec, BucketState, ResetTarget, SettleResponse, Settlement, SlotSpec,
    SlotsState, TakeResponse,
};
use tollgate_server::store::memory::MemoryStore;
use tollgate_server::store::{Store, StoreError};

/// A store with its takes (single and batch) held at a gate, closed at first; every other call
/// goes straight through (the readiness ping too). [`Gated::only`]: only the takes of some keys.
pub struct Gated {
    inner: Arc<dyn Store>,
    /// Only takes with a key that starts with this wait at the gate; `None`: every take.
    only: Option<String>,
    /// No permit while closed; one, handed back by every take that passes, once opened.
    gate: Semaphore,
    /// Notified as each take reaches the gate.
    arrived: Notify,
    /// Takes that reached the gate so far.
    arrivals: AtomicUsize,
}

impl Gated {
    /// Over a fresh [`MemoryStore`].
    pub fn new() -> Self {
        Self::over(Arc::new(MemoryStore::new()))
    }

    /// Over `inner` (its `kind` is the store's: a Redis store is coalesced as in production).
    pub fn over(inner: Arc<dyn Store>) -> Self {
        Gated {
            inner,
            only: None,
            gate: Semaphore::new(0),
            arrived: Notify::new(),
            arrivals: AtomicUsize::new(0),
        }
    }

    /// Gates only the takes with a key that starts with `prefix` (a batch: any of its keys).
    pub fn only(mut self, prefix: &str) -> Self {
        self.only = Some(prefix.to_string());
        self
    }

    /// Lets every take waiting at the gate, and every later one, through.
    pub fn open(&self) {
        self.gate.add_permits(1);
    }

    /// Waits until a take has reached the gate (a take that arrived before the call counts).
    pub async fn arrival(&self) {
        tokio::time::timeout(Duration::from_secs(10), self.arrived.notified())
            .await
            .expect("a take reached the gate within 10 s");
    }

    /// Waits until `n` takes in all have reached the gate.
    pub async fn arrivals(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.arrivals.load(Ordering::SeqCst) < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{n} takes did not reach the gate within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Takes that reached the gate so far.
    pub fn arrived(&self) -> usize {
        self.arrivals.load(Ordering::SeqCst)
    }

    async fn pass<'a>(&self, mut keys: impl Iterator<Item = &'a str>) {
        if let Some(prefix) = &self.only {
            if !keys.any(|k| k.starts_with(prefix.as_str())) {
                return;
            }
        }
        self.arrivals.fetch_add(1, Ordering::SeqCst);
        self.arrived.notify_one();
        drop(self.gate.acquire().await.expect("the gate is never closed"));
    }
}

#[async_trait::async_trait]
impl Store for Gated {
    async fn take(&self, buckets: &[BucketSpec]) -> Result<TakeResponse, StoreError> {
        self.pass(buckets.iter().map(|b| b.key.as_str())).await;
        self.inner.take(buckets).await
    }

    async fn take_batch(&self, takes: &[Vec<BucketSpec>]) -> Result<Vec<TakeResponse>, StoreError> {
        self.pass(takes.iter().flatten().map(|b| b.key.as_str()))
            .await;
        self.inner.take_batch(takes).await
    }

    async fn acquire(&self, specs: &[SlotSpec], slot: &str) -> Result<AcquireResponse, StoreError> {
        self.inner.acquire(specs, slot).await
    }

    async fn release(&self, slot: &str, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        self.inner.release(slot, keys).await
    }

    async fn refund(&self, buckets: &[BucketSpec]) -> Result<u64, StoreError> {
        self.inner.refund(buckets).await
    }

    async fn settle(&self, settlement: &Settlement) -> Result<SettleResponse, StoreError> {
        self.inner.settle(settlement).await
    }

    async fn inspect(&self, bucket: &BucketSpec) -> Result<BucketState, StoreError> {
        self.inner.inspect(bucket).await
    }

    async fn inspect_slots(&self, key: &str) -> Result<SlotsState, StoreError> {
        self.inner.inspect_slots(key).await
    }

    async fn reset(&self, target: &ResetTarget) -> Result<bool, StoreError> {
        self.inner.reset(target).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    async fn live_instances(
        &self,
        seen: &[String],
        ttl_ms: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.live_instances(seen, ttl_ms).await
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
}
