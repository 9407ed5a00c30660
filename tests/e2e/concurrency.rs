//! End to end under contention: 32 clients at once against one bucket. The service's atomic take
//! must admit exactly the capacity, counted at the upstream, also when the callouts go out in
//! batches (`service.batch`); so must the fallback's bucket, which Envoy's worker threads share.

// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::common;
use crate::{both_transports, every_transport};

use common::config::{plugin, rule};
use common::*;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

both_transports!(fallback_exact_under_32_parallel_clients);
every_transport!(
    exactly_capacity_admitted_under_32_parallel_clients,
    exactly_capacity_admitted_with_batched_callouts,
);

const CLIENTS: usize = 32;
const PER_CLIENT: usize = 8;

/// 32 clients, each on its own connection (so spread over Envoy's workers), `PER_CLIENT` requests
/// each, all started together; returns every status. Bounded by a 60 s deadline.
fn hammer(s: &Stack) -> Vec<u16> {
    let all: Vec<u16> = burst(
        &[s.url("/")],
        CLIENTS,
        PER_CLIENT,
        &[],
        Duration::from_secs(60),
    )
    .iter()
    .map(|r| r.status)
    .collect();
    assert_eq!(
        all.len(),
        CLIENTS * PER_CLIENT,
        "every request answered in time"
    );
    all
}

/// The service is down: the fallback bucket, shared by Envoy's workers through CAS-updated shared
/// data, admits exactly floor(60 / 2) = 30 however the requests interleave.
fn fallback_exact_under_32_parallel_clients(t: Transport) {
    let s = Arc::new(Stack::start_without_service(
        "fallback-concurrency",
        &plugin(
            t,
            vec![rule("shared", &["literal:all"], 60)],
            json!({"fallback": {"instances": 2}}),
        ),
        closed_port(),
    ));
    let all = hammer(&s);
    assert_eq!(count(&all, 200), 30, "admitted");
    assert_eq!(count(&all, 429), all.len() - 30, "the rest limited");
    assert_eq!(s.upstream.requests(), 30, "at the upstream");
    assert_eq!(s.envoy.tg("fallback.allowed"), 30);
}

fn exactly_capacity_admitted_under_32_parallel_clients(t: Transport) {
    const CAPACITY: u64 = 50;
    let s = Arc::new(Stack::start(
        "concurrency",
        &plugin(
            t,
            vec![rule("shared", &["literal:all"], CAPACITY)],
            json!({}),
        ),
    ));
    let all = hammer(&s);
    assert_eq!(count(&all, 200) as u64, CAPACITY, "admitted");
    assert_eq!(
        count(&all, 429),
        all.len() - CAPACITY as usize,
        "the rest limited"
    );
    assert_eq!(s.upstream.requests(), CAPACITY, "at the upstream");
    assert_eq!(s.envoy.tg("allowed"), CAPACITY, "{:?}", s.envoy.tg_all());
}

/// Group commit: with 32 clients on two workers, requests queue behind each worker's callout and
/// leave in batches; every take in a batch is still decided on its own, atomically.
fn exactly_capacity_admitted_with_batched_callouts(t: Transport) {
    const CAPACITY: u64 = 50;
    let s = Arc::new(Stack::start(
        "batch-concurrency",
        &plugin(
            t,
            vec![rule("shared", &["literal:all"], CAPACITY)],
            json!({"service": {"batch": 64}}),
        ),
    ));
    let all = hammer(&s);
    assert_eq!(count(&all, 200) as u64, CAPACITY, "admitted");
    assert_eq!(s.upstream.requests(), CAPACITY, "at the upstream");
    let stats = s.envoy.tg_all();
    assert!(
        stats.get("batch.callouts").copied().unwrap_or(0) > 0,
        "requests went out in batches: {stats:?}"
    );
    assert_eq!(
        stats.get("allowed").copied().unwrap_or(0) + stats.get("limited").copied().unwrap_or(0),
        all.len() as u64,
        "every request decided by the service: {stats:?}"
    );
}
