//! The filter's hand-written protobuf decoder of the service's gRPC answer (`wire::decode_proto`)
//! over any bytes: no panic; an answer it reads re-encodes (as protobuf and as JSON) to bytes that
//! decode to the same answer; where prost (the service's generated codec) also reads the bytes,
//! both read the same answer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use tollgate::core::wire::{decode_json, decode_proto, BucketResult, TakeResponse};
use tollgate_fuzz::{response_json, response_proto};
use tollgate_server::api::grpc::pb;

fuzz_target!(|data: &[u8]| {
    let ours = decode_proto(data);
    if let (Ok(ours), Ok(theirs)) = (&ours, pb::TakeResponse::decode(data)) {
        let expected = TakeResponse {
            allowed: theirs.allowed,
            buckets: theirs
                .buckets
                .iter()
                .map(|b| BucketResult {
                    allowed: b.allowed,
                    limit: b.limit,
                    remaining: b.remaining,
                    reset_ms: b.reset_ms,
                    retry_after_ms: b.retry_after_ms,
                    granted: b.granted,
                    delay_ms: b.delay_ms,
                })
                .collect(),
            instances: theirs.instances,
            delay_ms: theirs.delay_ms,
        };
        assert_eq!(ours, &expected, "prost reads these bytes differently");
    }
    let Ok(resp) = ours else { return };
    assert_eq!(decode_proto(&response_proto(&resp)).as_ref(), Ok(&resp));
    assert_eq!(decode_json(&response_json(&resp)).as_ref(), Ok(&resp));
});
