//! The contract's bounds (contract/README.md): what a valid message holds at most. The service
//! refuses anything outside them, and the filter's configuration accepts nothing outside them, so
//! the service never rejects what the filter was configured to ask.

/// Most buckets one take (and one acquire, release or settle) may name.
pub const MAX_BUCKETS: usize = 16;
/// Longest bucket key, in bytes.
pub const MAX_KEY_BYTES: usize = 4096;
/// Upper bound of `capacity`, `rate`, `cost`, `lease`, a settle's amounts and a slot's `limit`.
pub const MAX_AMOUNT: u64 = 1_000_000_000;
/// Most tokens a token bucket may owe (8e9): a settle charges what a response used beyond its
/// estimate in full, into debt, however deep earlier settles left the bucket; only past this floor
/// is anything forgiven. It keeps every store's micro-token balance an exact integer in a Lua
/// number: (capacity + debt) × 10^6 <= 9e15 < 2^53. Each settle pushes a bucket at most its `used`
/// (<= [`MAX_AMOUNT`]) deeper.
pub const MAX_DEBT: u64 = 8 * MAX_AMOUNT;
/// Upper bound of a bucket's `max_delay_ms` (shaping): one minute. A shaped bucket owes at most
/// `rate × MAX_DELAY_MS / period_ms` tokens for grants still waiting, and a caller holds a request
/// at most this long.
pub const MAX_DELAY_MS: u64 = 60_000;
/// Upper bound of `period_ms`: one year.
pub const MAX_PERIOD_MS: u64 = 31_536_000_000;
/// Room a bucket may take in a request besides its key: the JSON field names, six numbers of at
/// most 11 digits, the algorithm's name, punctuation and some whitespace (about 160 bytes when
/// compact); protobuf needs far less (tags and varints).
pub const BUCKET_OVERHEAD_BYTES: usize = 512;
/// Largest take body accepted, JSON or protobuf (74,240 bytes): [`MAX_BUCKETS`] buckets of the
/// longest key, each with [`BUCKET_OVERHEAD_BYTES`], plus as much again for the enclosing
/// object. A larger body is refused (413 / `RESOURCE_EXHAUSTED`) before it is decoded. A JSON key
/// counts as written: one that needs many escapes (`\"`, `\u0001`) may not fit at full length.
pub const MAX_TAKE_BYTES: usize =
    MAX_BUCKETS * (MAX_KEY_BYTES + BUCKET_OVERHEAD_BYTES) + BUCKET_OVERHEAD_BYTES;

/// Longest rule name a bucket may carry (`rule`), in bytes.
pub const MAX_RULE_BYTES: usize = 64;
/// Longest instance id (`instance`), in bytes.
pub const MAX_INSTANCE_BYTES: usize = 64;

/// Most takes one batch may carry (`POST /v1/take_batch`, `TakeBatch`).
pub const MAX_BATCH_TAKES: usize = 64;
/// Largest batch body accepted, JSON or protobuf: 1 MiB. Less than [`MAX_BATCH_TAKES`] takes of
/// [`MAX_TAKE_BYTES`] each: a batch of that many takes of the longest keys does not fit and must
/// be split by its sender. A larger body is refused (413 / `RESOURCE_EXHAUSTED`) before it is
/// decoded.
pub const MAX_BATCH_BYTES: usize = 1024 * 1024;

/// Longest settlement id (`id` of a settle), in bytes.
pub const MAX_SETTLE_ID_BYTES: usize = 128;
/// How long a store remembers a settlement id it applied (5 minutes): a settle sent again within
/// that time is answered `duplicate` and changes nothing. The filter retries a refund for a few
/// seconds at most, an extra charge until it is applied: one whose first attempt was applied, its
/// answer lost, and every later attempt failed for longer than this, is applied again (charged
/// twice: stricter, never looser).
pub const SETTLE_ID_TTL_MS: u64 = 300_000;

/// Longest slot deadline (`ttl_ms` of an acquire): one day.
pub const MAX_SLOT_TTL_MS: u64 = 86_400_000;
/// Longest slot id accepted in a release (the service issues 32 hex digits).
pub const MAX_SLOT_BYTES: usize = 64;
/// How long a store remembers a slot released before it was taken (60 s): an acquire under that
/// name arriving within this time (it was late, and its caller gave up on it and released it) takes
/// nothing. A caller's release can overtake its own acquire on the way to the store.
pub const RELEASED_SLOT_MEMORY_MS: u64 = 60_000;
/// What a denied acquire suggests waiting, at most: slots come back when requests end, not on a
/// clock, so a short wait is the honest answer (sooner when the oldest slot's deadline is sooner).
pub const SLOT_DENIED_RETRY_MS: u64 = 1000;

/// Largest callout answer the filter reads (64 KiB): a larger one is not read and fails the
/// requests it answers. A valid answer to one take is far smaller ([`take_answer_bytes`]); a batch's
/// sender keeps the answers it asks for within this ([`batch_answer_bytes`]).
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;
/// Most bytes one bucket's result takes in a JSON answer (protobuf needs fewer): its six field
/// names, five numbers of at most 16 digits, `false`, punctuation (about 130 bytes when compact);
/// a shaped grant's `delay_ms` (at most [`MAX_DELAY_MS`]) comes only with a `retry_after_ms` of 0.
pub const BUCKET_ANSWER_BYTES: usize = 160;
/// Room an answer (or a batch answer) takes besides its buckets: `allowed`, `instances`, a shaped
/// answer's `delay_ms`, the list brackets and separators.
pub const ANSWER_OVERHEAD_BYTES: usize = 96;

/// The most bytes the answer to a take of `buckets` buckets can take, JSON or protobuf.
pub const fn take_answer_bytes(buckets: usize) -> usize {
    ANSWER_OVERHEAD_BYTES + buckets * BUCKET_ANSWER_BYTES
}

/// The most bytes a batch answer can take whose takes have `buckets` buckets in all (`takes` of
/// them): what a batch's sender compares with [`MAX_ANSWER_BYTES`].
pub const fn batch_answer_bytes(takes: usize, buckets: usize) -> usize {
    ANSWER_OVERHEAD_BYTES + takes * ANSWER_OVERHEAD_BYTES + buckets * BUCKET_ANSWER_BYTES
}

/// The most bytes a take of buckets with keys of `key_bytes` bytes in all (`buckets` of them) can
/// take in a request, JSON or protobuf (as [`MAX_TAKE_BYTES`] counts): what a batch's sender
/// compares with [`MAX_BATCH_BYTES`].
pub const fn take_request_bytes(buckets: usize, key_bytes: usize) -> usize {
    BUCKET_OVERHEAD_BYTES + buckets * BUCKET_OVERHEAD_BYTES + key_bytes
}

// A batch of the largest takes does not fit: its sender splits it (above).
const _: () = assert!(MAX_BATCH_BYTES < MAX_BATCH_TAKES * MAX_TAKE_BYTES);
// The answer to one take of the most buckets always fits: a batch of one is never too large.
const _: () = assert!(batch_answer_bytes(1, MAX_BUCKETS) < MAX_ANSWER_BYTES);
// But a full batch of such takes does not: its sender bounds a batch by bytes too.
const _: () =
    assert!(batch_answer_bytes(MAX_BATCH_TAKES, MAX_BATCH_TAKES * MAX_BUCKETS) > MAX_ANSWER_BYTES);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_answers_fit_their_room() {
        let max = crate::arithmetic::MAX_MS;
        let denied = format!(
            r#"{{"allowed":false,"limit":{MAX_AMOUNT},"remaining":{MAX_AMOUNT},"reset_ms":{max},"retry_after_ms":{max},"granted":0}}"#
        );
        let shaped = format!(
            r#"{{"allowed":true,"limit":{MAX_AMOUNT},"remaining":{MAX_AMOUNT},"reset_ms":{max},"retry_after_ms":0,"granted":{MAX_AMOUNT},"delay_ms":{MAX_DELAY_MS}}}"#
        );
        for one in [denied, shaped] {
            assert!(
                one.len() <= BUCKET_ANSWER_BYTES,
                "{} bytes: {one}",
                one.len()
            );
        }
        let outside = format!(
            r#"{{"allowed":false,"buckets":[],"instances":{MAX_AMOUNT},"delay_ms":{MAX_DELAY_MS}}},"#
        );
        assert!(outside.len() <= ANSWER_OVERHEAD_BYTES, "{outside}");
    }

    #[test]
    fn the_byte_bounds_are_the_readmes() {
        assert_eq!(MAX_TAKE_BYTES, 74_240);
        let readme = include_str!("../README.md");
        for needle in [
            format!("`buckets` | list | yes | the buckets this request takes from, all or none | 1..={MAX_BUCKETS} entries"),
            format!("| 1..={MAX_KEY_BYTES} bytes |"),
            format!("`takes`: 1..={MAX_BATCH_TAKES} entries"),
            format!("1..={MAX_SLOT_BYTES} hex digits"),
            // `max_delay_ms`'s row, the number written with a thousands separator.
            format!("| 0..={},{:03} |", MAX_DELAY_MS / 1000, MAX_DELAY_MS % 1000),
        ] {
            assert!(readme.contains(&needle), "README.md lacks `{needle}`");
        }
    }
}
