//! The filter's decoder of the service's JSON answer (`wire::decode_json`) over any bytes: no
//! panic; an answer it reads re-encodes (as JSON and as protobuf) to bytes that decode to the same
//! answer; whatever the service's serde reader reads (the contract's type with its `serde` derives),
//! the filter's hand-written reader reads the same way.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate::core::wire::{decode_json, decode_proto};
use tollgate_fuzz::{response_json, response_proto};
use tollgate_server::domain::TakeResponse;

fuzz_target!(|data: &[u8]| {
    let ours = decode_json(data);
    // An answer is a JSON object on the wire (contract/README.md); serde's derive also reads a
    // struct from an array of its fields (`[true, []]`), a form the filter rightly refuses.
    let object = matches!(
        serde_json::from_slice::<serde_json::Value>(data),
        Ok(serde_json::Value::Object(_))
    );
    if let (true, Ok(service)) = (object, serde_json::from_slice::<TakeResponse>(data)) {
        assert_eq!(
            ours.as_ref().ok(),
            Some(&service),
            "the service's own reader differs"
        );
    }
    let Ok(resp) = ours else { return };
    assert_eq!(decode_json(&response_json(&resp)).as_ref(), Ok(&resp));
    assert_eq!(decode_proto(&response_proto(&resp)).as_ref(), Ok(&resp));
});
