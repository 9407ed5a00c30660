//! End to end under contention: 32 clients at once against one bucket. The service's atomic take
//! must admit exactly the capacity, counted at the upstream.

// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

mod common;

use common::config::{plugin, rule};
use common::*;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

both_transports!(exactly_capacity_admitted_under_32_parallel_clients);

fn exactly_capacity_admitted_under_32_parallel_clients(t: Transport) {
    const CLIENTS: usize = 32;
    const PER_CLIENT: usize = 8;
    const CAPACITY: u64 = 50;
    let s = Arc::new(Stack::start(
        "concurrency",
        &plugin(
            t,
            vec![rule("shared", &["literal:all"], CAPACITY)],
            json!({}),
        ),
    ));
    let deadline = Instant::now() + Duration::from_secs(60);
    let barrier = Arc::new(std::sync::Barrier::new(CLIENTS));
    let handles: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let s = s.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                // Each client its own connection, so requests spread over Envoy's workers.
                let client = Client::new();
                let url = s.url("/");
                barrier.wait();
                let mut st = Vec::new();
                for _ in 0..PER_CLIENT {
                    if Instant::now() > deadline {
                        break;
                    }
                    st.push(client.get(&url, &[]).status);
                }
                st
            })
        })
        .collect();
    let all: Vec<u16> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("client thread"))
        .collect();
    assert_eq!(
        all.len(),
        CLIENTS * PER_CLIENT,
        "every request answered in time"
    );
    assert_eq!(count(&all, 200) as u64, CAPACITY, "admitted");
    assert_eq!(
        count(&all, 429),
        all.len() - CAPACITY as usize,
        "the rest limited"
    );
    assert_eq!(s.upstream.requests(), CAPACITY, "at the upstream");
    assert_eq!(s.envoy.tg("allowed"), CAPACITY);
}
