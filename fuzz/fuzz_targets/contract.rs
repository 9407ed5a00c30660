//! Both ends of the wire contract against each other, on generated values: what the filter
//! encodes (`wire::encode_json`, `wire::encode_proto`) the service decodes to the same buckets
//! over both transports, and what the service answers (its JSON body, its protobuf message) the
//! filter decodes to the same decision.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tollgate::core::config::Algorithm as FilterAlgorithm;
use tollgate::core::wire::{self, Bucket, TakeRequest};
use tollgate_server::domain::{Algorithm, BucketResult, TakeResponse, MAX_BUCKETS};
use tollgate_server::ops::take::{self, RawBucket};

/// A number near the contract's bounds more often than a uniform `u64` would be.
#[derive(Debug, Arbitrary)]
enum Num {
    Small(u8),
    Bound(bool),
    Any(u64),
}

impl Num {
    fn get(&self) -> u64 {
        match self {
            Num::Small(n) => u64::from(*n),
            Num::Bound(above) => 1_000_000_000 + u64::from(*above),
            Num::Any(n) => *n,
        }
    }
}

#[derive(Debug, Arbitrary)]
struct InBucket {
    key: String,
    capacity: Num,
    rate: Option<Num>,
    period_ms: Num,
    cost: Option<Num>,
    fixed_window: Option<bool>,
    lease: Option<Num>,
    max_delay_ms: Num,
}

#[derive(Debug, Arbitrary)]
struct Input {
    request: Vec<InBucket>,
    allowed: bool,
    answer: Vec<(bool, u64, u64, u64, u64, u64, u64)>,
    instances: u64,
    delay_ms: u64,
}

fuzz_target!(|input: Input| {
    let req = TakeRequest {
        buckets: input
            .request
            .iter()
            .map(|b| Bucket {
                key: b.key.clone(),
                capacity: b.capacity.get(),
                rate: b.rate.as_ref().map(Num::get),
                period_ms: b.period_ms.get(),
                cost: b.cost.as_ref().map(Num::get),
                algorithm: b.fixed_window.map(|f| {
                    if f {
                        FilterAlgorithm::FixedWindow
                    } else {
                        FilterAlgorithm::TokenBucket
                    }
                }),
                lease: b.lease.as_ref().map(Num::get),
                max_delay_ms: b.max_delay_ms.get(),
            })
            .collect(),
    };
    let over_json = take::decode_json(&wire::encode_json(&req, None));
    let over_grpc = take::decode_pb(&wire::encode_proto(&req, None));
    if req.buckets.len() > MAX_BUCKETS {
        assert!(over_json.is_err() && over_grpc.is_err());
    } else {
        let raw = over_json
            .clone()
            .expect("the service reads the filter's JSON");
        let from_pb = over_grpc
            .clone()
            .expect("the service reads the filter's protobuf");
        let expected: Vec<RawBucket> = req
            .buckets
            .iter()
            .map(|b| RawBucket {
                key: Some(b.key.clone()),
                capacity: Some(b.capacity),
                rate: b.rate,
                period_ms: Some(b.period_ms),
                cost: b.cost,
                algorithm: b.algorithm.map(|a| match a {
                    FilterAlgorithm::TokenBucket => Algorithm::TokenBucket,
                    FilterAlgorithm::FixedWindow => Algorithm::FixedWindow,
                    FilterAlgorithm::SlidingWindow => Algorithm::SlidingWindow,
                }),
                lease: b.lease,
                // The filter sends a bucket's rule name outside this encoder.
                rule: None,
                // Absent when 0 (JSON); protobuf reads 0 (below).
                max_delay_ms: (b.max_delay_ms > 0).then_some(b.max_delay_ms),
            })
            .collect();
        assert_eq!(raw.buckets.as_ref(), Some(&expected));
        // Protobuf cannot tell an absent algorithm from token_bucket, nor the rest differs.
        let mut expected_pb = expected;
        for b in &mut expected_pb {
            b.algorithm.get_or_insert(Algorithm::TokenBucket);
            b.max_delay_ms.get_or_insert(0);
        }
        assert_eq!(from_pb.buckets.as_ref(), Some(&expected_pb));
    }
    let a = over_json.and_then(take::validate);
    let b = over_grpc.and_then(take::validate);
    assert_eq!(a.is_ok(), b.is_ok(), "{a:?} / {b:?}");
    if let (Ok(a), Ok(b)) = (&a, &b) {
        assert_eq!(a, b, "the transports disagree");
    }

    let decision = TakeResponse {
        allowed: input.allowed,
        buckets: input
            .answer
            .iter()
            .map(
                |&(allowed, limit, remaining, reset_ms, retry_after_ms, granted, delay_ms)| {
                    BucketResult {
                        allowed,
                        limit,
                        remaining,
                        reset_ms,
                        retry_after_ms,
                        granted,
                        delay_ms,
                    }
                },
            )
            .collect(),
        // The filter reads the count elsewhere; its decoders must accept an answer carrying it.
        instances: input.instances,
        delay_ms: input.delay_ms,
    };
    // One type on both sides (the contract crate's): the filter reads back what the service wrote.
    let expected = &decision;
    let body = serde_json::to_vec(&decision).expect("encodes");
    assert_eq!(wire::decode_json(&body).as_ref(), Ok(expected));
    let message = take::pb_from_answer(&decision).encode_to_vec();
    assert_eq!(wire::decode_proto(&message).as_ref(), Ok(expected));
});
