//! The service's protobuf take decoder (`ops::take::decode_pb`) and validation over any message
//! bytes (the gRPC body without its 5-byte frame header), as any client could send it.
//!
//! Properties: no panic; it never holds more than 16 buckets; it agrees with prost's plain
//! decoding for every message of at most 16 buckets; a decoded take re-encodes to bytes that
//! decode to the same take; a valid take is valid with the same buckets over JSON; the Redis keys
//! derived from it are distinct per bucket and stay in their hash tag's Cluster slot.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use tollgate_fuzz::server::{check_store_keys, top_level_group};
use tollgate_server::api::grpc::pb;
use tollgate_server::domain::MAX_BUCKETS;
use tollgate_server::ops::take;

fuzz_target!(|data: &[u8]| {
    let decoded = take::decode_pb(data);
    match pb::TakeRequest::decode(data) {
        Ok(plain) if plain.buckets.len() <= MAX_BUCKETS => match &decoded {
            Ok(d) => assert_eq!(
                Ok(d),
                take::raw_from_pb(&plain).as_ref(),
                "differs from prost"
            ),
            // Refusing what prost skips (a group) or what the conversion refuses is stricter.
            Err(e) => assert!(
                take::raw_from_pb(&plain).is_err() || top_level_group(data),
                "prost reads it: {e:?}"
            ),
        },
        Ok(_) => assert!(decoded.is_err(), "a 17th bucket was accepted"),
        // Stricter than prost is allowed (groups are refused), looser is not.
        Err(e) => assert!(decoded.is_err(), "prost refuses it: {e}"),
    }
    let Ok(raw) = decoded else { return };
    let n = raw.buckets.as_ref().map_or(0, Vec::len);
    assert!(n <= MAX_BUCKETS);

    let again = take::pb_from_raw(&raw).encode_to_vec();
    assert_eq!(take::decode_pb(&again).as_ref(), Ok(&raw));

    let Ok(specs) = take::validate(raw.clone()) else {
        return;
    };
    check_store_keys(&specs);
    let body = serde_json::to_vec(&take::encode_json(&raw)).expect("encodes");
    let over_json = take::decode_json(&body).and_then(take::validate);
    assert_eq!(over_json.as_ref(), Ok(&specs));
});
