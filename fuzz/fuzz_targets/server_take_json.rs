//! The service's JSON take decoder (`ops::take::decode_json`) and validation (`ops::take::validate`)
//! over any body, as any client could send it.
//!
//! Properties: no panic; what it decodes agrees with the reference reading of the contract (a
//! walk over a `serde_json::Value`, in the fuzz crate), in both directions for bodies without
//! repeated fields; it never decodes a 17th bucket; a decoded take re-encodes to a body that
//! decodes to the same take; a valid take is valid with the same buckets over protobuf; what
//! validation passes is within the contract's bounds, and the Redis keys derived from it are
//! distinct per bucket and stay in their hash tag's Cluster slot.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use tollgate_fuzz::server::{check_store_keys, has_duplicate_fields, reference_take};
use tollgate_server::domain::{
    Algorithm, MAX_AMOUNT, MAX_BUCKETS, MAX_DELAY_MS, MAX_KEY_BYTES, MAX_PERIOD_MS,
};
use tollgate_server::ops::take::{self, RawTake};

fuzz_target!(|data: &[u8]| {
    let decoded = take::decode_json(data);
    let reference = reference_take(data);
    match &decoded {
        Ok(raw) => {
            assert!(raw.buckets.as_ref().is_none_or(|b| b.len() <= MAX_BUCKETS));
            assert_eq!(
                reference.as_ref(),
                Some(raw),
                "the reference reads it differently"
            );
        }
        Err(e) => {
            let fits = reference
                .as_ref()
                .is_some_and(|r| r.buckets.as_ref().is_none_or(|b| b.len() <= MAX_BUCKETS));
            assert!(
                !fits || has_duplicate_fields(data),
                "refused a take the reference reads: {e:?}"
            );
        }
    }
    let Ok(raw) = decoded else { return };

    // Encoding what was decoded gives it back (an absent list is written as an empty one).
    let again = serde_json::to_vec(&take::encode_json(&raw)).expect("encodes");
    let expected = RawTake {
        buckets: Some(raw.buckets.clone().unwrap_or_default()),
        instance: raw.instance.clone(),
    };
    assert_eq!(take::decode_json(&again).as_ref(), Ok(&expected));

    let Ok(specs) = take::validate(raw.clone()) else {
        return;
    };
    assert!((1..=MAX_BUCKETS).contains(&specs.len()));
    for s in &specs {
        assert!(!s.key.is_empty() && s.key.len() <= MAX_KEY_BYTES);
        for v in [s.capacity, s.rate, s.cost, s.lease] {
            assert!((1..=MAX_AMOUNT).contains(&v));
        }
        assert!((1..=MAX_PERIOD_MS).contains(&s.period_ms));
        assert!(s.cost <= s.lease);
        // Shaping: bounded, and on token buckets only.
        assert!(s.max_delay_ms <= MAX_DELAY_MS);
        assert!(s.max_delay_ms == 0 || s.algorithm == Algorithm::TokenBucket);
    }
    check_store_keys(&specs);

    // The same take over gRPC is the same take.
    let pb = take::pb_from_raw(&raw).encode_to_vec();
    let over_grpc = take::decode_pb(&pb).and_then(take::validate);
    assert_eq!(over_grpc.as_ref(), Ok(&specs));
});
