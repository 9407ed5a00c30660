//! The host's serialised header map (`core::hostmap`) over any bytes, as Envoy could hand it over:
//! no panic; a map that parses re-serialises to bytes that parse to the same pairs; a map never
//! claims more entries than its bytes can hold; `serialize` round-trips through `parse`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate::core::base::hostmap::{parse, serialize};
use tollgate_fuzz::hostmap_bytes;

fuzz_target!(|data: &[u8]| {
    let Some(pairs) = parse(data) else { return };
    // Four bytes of count, then per entry 8 bytes of lengths and two NULs (the last may be
    // missing at the very end).
    if !pairs.is_empty() {
        assert!(
            4 + 10 * pairs.len() - 1 <= data.len(),
            "{} entries",
            pairs.len()
        );
    }
    let as_bytes: Vec<(Vec<u8>, Vec<u8>)> = pairs
        .iter()
        .map(|(k, v)| (k.as_bytes().to_vec(), v.clone()))
        .collect();
    assert_eq!(parse(&hostmap_bytes(&as_bytes)).as_ref(), Some(&pairs));
    // The adapter's own writer (response headers) for the pairs that are text.
    let text: Vec<(String, String)> = pairs
        .iter()
        .filter_map(|(k, v)| Some((k.clone(), String::from_utf8(v.clone()).ok()?)))
        .collect();
    let back = parse(&serialize(&text)).map(|p| {
        p.into_iter()
            .map(|(k, v)| (k, String::from_utf8(v).unwrap_or_default()))
            .collect::<Vec<_>>()
    });
    assert_eq!(back, Some(text));
});
