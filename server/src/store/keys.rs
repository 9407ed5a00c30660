//! Redis key layout and Redis Cluster hash slots. Pure functions, unit-tested.
//!
//! A bucket key is `<prefix><alg>:{<tag>}` where `<tag>` is the caller's key with `%`, `{`, `}`
//! and `#` percent-escaped, or `#` + hex SHA-256 of the key when it is longer than [`HASH_ABOVE`]
//! bytes. The escaped form never contains `}` nor starts with `#`, so the layout is injective over
//! `(algorithm, key)`, and the braces make the whole `<tag>` the Redis Cluster hash tag.
//!
//! The limits are not part of the key: a bucket is its algorithm and key, and the hash records the
//! limits it was last charged with, so a changed limit carries the bucket over (the scripts scale
//! it, `lua/token_bucket.lua`) instead of starting a fresh, full one.

use std::fmt::Write;

use sha2::{Digest, Sha256};

use crate::domain::{Algorithm, BucketSpec};

/// Keys longer than this many bytes are replaced by their SHA-256 in the Redis key.
pub const HASH_ABOVE: usize = 100;

/// Checks a key prefix can be used: braces would move the hash tag into the prefix.
pub fn check_prefix(prefix: &str) -> Result<(), String> {
    if prefix.contains('{') || prefix.contains('}') {
        return Err("the key prefix must not contain '{' or '}'".into());
    }
    Ok(())
}

/// Appends the `<tag>` of `key` to `out`.
pub(crate) fn push_tag(out: &mut String, key: &str) {
    if key.len() > HASH_ABOVE {
        out.push('#');
        for b in Sha256::digest(key.as_bytes()) {
            let _ = write!(out, "{b:02x}");
        }
        return;
    }
    for c in key.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            '#' => out.push_str("%23"),
            c => out.push(c),
        }
    }
}

/// The Redis key of a bucket, built in one allocation.
pub fn redis_key(prefix: &str, b: &BucketSpec) -> String {
    bucket_key(prefix, b.algorithm, &b.key)
}

/// The Redis key of the bucket of `algorithm` and `key` (its limits are not part of it).
pub fn bucket_key(prefix: &str, algorithm: Algorithm, key: &str) -> String {
    // Room for the tag unescaped (or `#` and its hash), the algorithm and the braces.
    let tag = if key.len() > HASH_ABOVE {
        65
    } else {
        key.len()
    };
    let mut out = String::with_capacity(prefix.len() + tag + 8);
    out.push_str(prefix);
    out.push_str(algorithm.tag());
    out.push_str(":{");
    push_tag(&mut out, key);
    out.push('}');
    out
}

/// The Redis key of the deployment's live-instance set (`lua/instances.lua`): one key, so its
/// own hash tag, in whatever slot that is; it is never touched by a take script.
pub fn instances_key(prefix: &str) -> String {
    format!("{prefix}instances:{{instances}}")
}

/// CRC16/XMODEM, the checksum Redis Cluster uses for slots.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The Redis Cluster hash slot of a key (0..16384), honouring `{hash tags}`.
pub fn slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = match bytes.iter().position(|&c| c == b'{') {
        Some(open) => match bytes[open + 1..].iter().position(|&c| c == b'}') {
            Some(len) if len > 0 => &bytes[open + 1..open + 1 + len],
            _ => bytes,
        },
        None => bytes,
    };
    crc16(hashed) % 16384
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Algorithm;

    fn spec(key: &str) -> BucketSpec {
        BucketSpec {
            key: key.into(),
            capacity: 10,
            rate: 5,
            period_ms: 1000,
            cost: 1,
            algorithm: Algorithm::TokenBucket,
            lease: 1,
            max_delay_ms: 0,
        }
    }

    #[test]
    fn layout() {
        assert_eq!(redis_key("tg:", &spec("ip:1")), "tg:tb:{ip:1}");
        assert_eq!(
            redis_key("tg:", &spec("user:{alice}%#")),
            "tg:tb:{user:%7Balice%7D%25%23}"
        );
        let mut fw = spec("a");
        fw.algorithm = Algorithm::FixedWindow;
        assert_eq!(redis_key("", &fw), "fw:{a}");
        let long = "x".repeat(101);
        let k = redis_key("", &spec(&long));
        assert!(k.starts_with("tb:{#") && k.len() == 4 + 65 + 1, "{k}");
        assert_eq!(redis_key("", &spec(&"x".repeat(100))).len(), 100 + 5);
    }

    #[test]
    fn injective_on_tricky_keys_and_blind_to_limits() {
        let keys = [
            "a}b", "a%7Db", "a%b", "a%25b", "#x", "%23x", "a", "a:10", "{", "}",
        ];
        let mut seen = std::collections::HashSet::new();
        for k in keys {
            assert!(seen.insert(redis_key("", &spec(k))), "{k}");
        }
        let mut fw = spec("a");
        fw.algorithm = Algorithm::FixedWindow;
        assert!(seen.insert(redis_key("", &fw)));
        let mut other = spec("a");
        (other.capacity, other.rate, other.period_ms) = (11, 1, 60_000);
        assert_eq!(redis_key("", &other), redis_key("", &spec("a")));
    }

    #[test]
    fn slots_match_redis() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("foo{}{bar}"), slot("foo{}{bar}"));
        assert_eq!(slot("foo{{bar}}zap"), slot("{bar"));
        let k = redis_key("tg:", &spec("a}b"));
        assert_eq!(slot(&k), slot(&format!("{k}:123")));
    }

    #[test]
    fn prefix_without_braces() {
        assert!(check_prefix("tollgate:").is_ok());
        assert!(check_prefix("x{y}").is_err());
    }
}
