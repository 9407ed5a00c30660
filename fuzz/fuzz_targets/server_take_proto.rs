//! The service's protobuf take decoder (`api::grpc::decode_take`) and validation over any message
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
use tollgate_server::api::grpc::{self, pb};
use tollgate_server::api::json;
use tollgate_server::domain::{validate, MAX_BUCKETS};

fuzz_target!(|data: &[u8]| {
    let decoded = grpc::decode_take(data);
    match pb::TakeRequest::decode(data) {
        Ok(plain) if plain.buckets.len() <= MAX_BUCKETS => match &decoded {
            Ok(d) => assert_eq!(
                Ok(d),
                grpc::raw_from_pb(&plain).as_ref(),
                "differs from prost"
            ),
            // Refusing what prost skips (a group) or what the conversion refuses is stricter.
            Err(e) => assert!(
                grpc::raw_from_pb(&plain).is_err() || top_level_group(data),
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

    let again = grpc::pb_from_raw(&raw).encode_to_vec();
    assert_eq!(grpc::decode_take(&again).as_ref(), Ok(&raw));

    let Ok(specs) = validate(raw.clone()) else {
        return;
    };
    check_store_keys(&specs);
    let body = serde_json::to_vec(&json::encode_request(&raw)).expect("encodes");
    let over_json = json::decode_take(&body).and_then(validate);
    assert_eq!(over_json.as_ref(), Ok(&specs));
});
