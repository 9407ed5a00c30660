//! A memory store whose takes wait at a gate until the test opens it: a decision held in
//! progress for as long as the test needs (shutdown while deciding, a permit held).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use tokio::sync::{Notify, Semaphore};
use tollgate_server::domain::{
    AcquireResponse, BucketSpec, BucketState, ResetTarget, SettleResponse, Settlement, SlotSpec,
    SlotsState, TakeResponse,
};
use tollgate_server::store::memory::MemoryStore;
use tollgate_server::store::{Store, StoreError};

/// [`MemoryStore`] with its takes (single and batch) held at a gate, closed at first; every other
/// call goes straight through (the readiness ping too).
pub struct Gated {
    inner: MemoryStore,
    /// No permit while closed; one, handed back by every take that passes, once opened.
    gate: Semaphore,
    /// Notified as each take reaches the gate.
    arrived: Notify,
}

impl Gated {
    pub fn new() -> Self {
        Gated {
            inner: MemoryStore::new(),
            gate: Semaphore::new(0),
            arrived: Notify::new(),
        }
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

    async fn pass(&self) {
        self.arrived.notify_one();
        drop(self.gate.acquire().await.expect("the gate is never closed"));
    }
}

#[async_trait::async_trait]
impl Store for Gated {
    async fn take(&self, buckets: &[BucketSpec]) -> Result<TakeResponse, StoreError> {
        self.pass().await;
        self.inner.take(buckets).await
    }

    async fn take_batch(&self, takes: &[Vec<BucketSpec>]) -> Result<Vec<TakeResponse>, StoreError> {
        self.pass().await;
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
