//! Helpers shared by the fuzz targets in `fuzz_targets/`: reference encoders the crates under test
//! do not export (a response in JSON and protobuf, a header map with byte names), the inverse of
//! key escaping, and the fixed configurations the key targets run against.
//!
//! Each target asserts properties, not just "no panic": a decoded value re-encodes to bytes that
//! decode to the same value, a key stays within the contract's bound and decodes back to the
//! request's bytes, both sides of the wire read what the other writes.

use tollgate::core::config::Config;
use tollgate::core::wire::{BucketResult, TakeResponse};

/// Configurations the key and callout targets use: the shipped examples (deploy/, docs/) and
/// hand-made ones that reach every key part. They are seeds of `filter_config` too.
pub const CONFIGS: [&str; 6] = [
    include_str!("../seeds/filter_config/deploy-envoy.json"),
    include_str!("../seeds/filter_config/docs-filter-config.json"),
    include_str!("../seeds/filter_config/deploy-istio.json"),
    include_str!("../seeds/filter_config/every-key-part.json"),
    include_str!("../seeds/filter_config/shared-missing-hops.json"),
    include_str!("../seeds/filter_config/fixed-window-lease.json"),
];

/// The parsed [`CONFIGS`]; a seed that stops parsing is a bug in the seed or the parser.
pub fn configs() -> Vec<Config> {
    CONFIGS
        .iter()
        .map(|c| Config::parse(c.as_bytes()).unwrap_or_else(|e| panic!("seed config: {e:?}")))
        .collect()
}

/// A response as the service writes it in JSON (every field present).
pub fn response_json(r: &TakeResponse) -> Vec<u8> {
    let buckets: Vec<serde_json::Value> = r
        .buckets
        .iter()
        .map(|b| {
            serde_json::json!({
                "allowed": b.allowed,
                "limit": b.limit,
                "remaining": b.remaining,
                "reset_ms": b.reset_ms,
                "retry_after_ms": b.retry_after_ms,
                "granted": b.granted,
                "delay_ms": b.delay_ms,
            })
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "allowed": r.allowed,
        "buckets": buckets,
        "instances": r.instances,
        "delay_ms": r.delay_ms,
    }))
    .unwrap_or_default()
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A proto3 scalar field (zero is not written).
fn put_u64(out: &mut Vec<u8>, field: u64, v: u64) {
    if v != 0 {
        put_varint(out, field << 3);
        put_varint(out, v);
    }
}

fn bucket_proto(b: &BucketResult) -> Vec<u8> {
    let mut m = Vec::new();
    put_u64(&mut m, 1, u64::from(b.allowed));
    put_u64(&mut m, 2, b.limit);
    put_u64(&mut m, 3, b.remaining);
    put_u64(&mut m, 4, b.reset_ms);
    put_u64(&mut m, 5, b.retry_after_ms);
    put_u64(&mut m, 6, b.granted);
    put_u64(&mut m, 7, b.delay_ms);
    m
}

/// A response as `tollgate.v1.TakeResponse` in protobuf.
pub fn response_proto(r: &TakeResponse) -> Vec<u8> {
    let mut out = Vec::new();
    put_u64(&mut out, 1, u64::from(r.allowed));
    for b in &r.buckets {
        let m = bucket_proto(b);
        put_varint(&mut out, (2 << 3) | 2);
        put_varint(&mut out, m.len() as u64);
        out.extend_from_slice(&m);
    }
    put_u64(&mut out, 3, r.instances);
    put_u64(&mut out, 4, r.delay_ms);
    out
}

/// The host's header map format for pairs whose names may be any bytes.
pub fn hostmap_bytes(pairs: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// The inverse of key-part escaping: `%XX` back to the byte, every other character as itself.
/// `None` for a `%` not followed by two upper-case hex digits (escaping never writes one).
pub fn percent_decode(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        if c == b'%' {
            let hex = |at: usize| -> Option<u8> {
                match *b.get(at)? {
                    d @ b'0'..=b'9' => Some(d - b'0'),
                    d @ b'A'..=b'F' => Some(d - b'A' + 10),
                    _ => None,
                }
            };
            out.push(hex(i + 1)? << 4 | hex(i + 2)?);
            i += 3;
        } else {
            out.push(c);
            i += 1;
        }
    }
    Some(out)
}

/// Whether `s` can go into an HTTP header value as is: visible ASCII, space and tab only (no CR,
/// LF, NUL or other control character that would split or end a header).
pub fn header_value_safe(s: &str) -> bool {
    s.bytes().all(|b| (0x20..0x7f).contains(&b) || b == b'\t')
}

/// Whether `s` is a lower-case header name (RFC 9110 token characters).
pub fn header_name_safe(s: &str) -> bool {
    !s.is_empty()
        && s.bytes().all(|b| {
            (b.is_ascii_alphanumeric() && !b.is_ascii_uppercase())
                || b"!#$%&'*+-.^_`|~".contains(&b)
        })
}

/// Server-side oracles: an independent reading of a take, and checks of what the store derives.
pub mod server {
    use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
    use serde_json::Value;
    use tollgate_server::domain::{Algorithm, BucketSpec};
    use tollgate_server::ops::take::{RawBucket, RawTake};
    use tollgate_server::store::keys::{redis_key, slot};

    /// The reference reading of a JSON take, a walk over a `serde_json::Value` as the contract
    /// describes it: an object with only `buckets`, a list of objects with only the seven known
    /// fields, `null` as absent, integers that fit a `u64`, the two algorithm names. `None` when
    /// the body is not such a take.
    pub fn reference_take(body: &[u8]) -> Option<RawTake> {
        let v: Value = serde_json::from_slice(body).ok()?;
        let obj = v.as_object()?;
        if obj.keys().any(|k| k != "buckets" && k != "instance") {
            return None;
        }
        let buckets = match obj.get("buckets") {
            None | Some(Value::Null) => None,
            Some(Value::Array(items)) => {
                let mut out = Vec::new();
                for item in items {
                    out.push(reference_bucket(item)?);
                }
                Some(out)
            }
            Some(_) => return None,
        };
        Some(RawTake {
            buckets,
            instance: string(obj.get("instance"))?,
        })
    }

    /// An optional string field: `Some(None)` when absent or `null`, `None` when not a string.
    fn string(v: Option<&Value>) -> Option<Option<String>> {
        match v {
            None | Some(Value::Null) => Some(None),
            Some(Value::String(s)) => Some(Some(s.clone())),
            Some(_) => None,
        }
    }

    fn reference_bucket(v: &Value) -> Option<RawBucket> {
        const KNOWN: [&str; 9] = [
            "key",
            "capacity",
            "rate",
            "period_ms",
            "cost",
            "algorithm",
            "lease",
            "rule",
            "max_delay_ms",
        ];
        let b = v.as_object()?;
        if b.keys().any(|k| !KNOWN.contains(&k.as_str())) {
            return None;
        }
        let uint = |name: &str| -> Option<Option<u64>> {
            match b.get(name) {
                None | Some(Value::Null) => Some(None),
                Some(x) => x.as_u64().map(Some),
            }
        };
        Some(RawBucket {
            key: match b.get("key") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(_) => return None,
            },
            capacity: uint("capacity")?,
            rate: uint("rate")?,
            period_ms: uint("period_ms")?,
            cost: uint("cost")?,
            algorithm: match b.get("algorithm") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) if s == "token_bucket" => Some(Algorithm::TokenBucket),
                Some(Value::String(s)) if s == "fixed_window" => Some(Algorithm::FixedWindow),
                Some(_) => return None,
            },
            lease: uint("lease")?,
            rule: string(b.get("rule"))?,
            max_delay_ms: uint("max_delay_ms")?,
        })
    }

    /// Whether some object in the JSON text names a field twice (`false` for text that is not
    /// JSON). With duplicates, what "the last value wins" means for an earlier invalid value is a
    /// choice, so the oracle comparison leaves such bodies out.
    pub fn has_duplicate_fields(body: &[u8]) -> bool {
        struct Dup<'a>(&'a mut bool);
        impl<'de> Visitor<'de> for Dup<'_> {
            type Value = ();
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_bool<E>(self, _: bool) -> Result<(), E> {
                Ok(())
            }
            fn visit_i64<E>(self, _: i64) -> Result<(), E> {
                Ok(())
            }
            fn visit_u64<E>(self, _: u64) -> Result<(), E> {
                Ok(())
            }
            fn visit_f64<E>(self, _: f64) -> Result<(), E> {
                Ok(())
            }
            fn visit_str<E>(self, _: &str) -> Result<(), E> {
                Ok(())
            }
            fn visit_unit<E>(self) -> Result<(), E> {
                Ok(())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
                while seq.next_element_seed(Seed(&mut *self.0))?.is_some() {}
                Ok(())
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
                let mut seen = std::collections::HashSet::new();
                while let Some(k) = map.next_key::<String>()? {
                    if !seen.insert(k) {
                        *self.0 = true;
                    }
                    map.next_value_seed(Seed(&mut *self.0))?;
                }
                Ok(())
            }
        }
        struct Seed<'a>(&'a mut bool);
        impl<'de> serde::de::DeserializeSeed<'de> for Seed<'_> {
            type Value = ();
            fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
                d.deserialize_any(Dup(self.0))
            }
        }
        let mut dup = false;
        let mut de = serde_json::Deserializer::from_slice(body);
        let _ = serde::de::DeserializeSeed::deserialize(Seed(&mut dup), &mut de);
        dup
    }

    /// What the Redis store derives from validated buckets: each key is the bucket's own (equal
    /// keys only for equal identities: the algorithm and key, not the limits), and every key of a bucket, the fixed window's
    /// `:<window>` suffix included, lands in the one Redis Cluster slot of its hash tag.
    pub fn check_store_keys(specs: &[BucketSpec]) {
        let keys: Vec<String> = specs.iter().map(|s| redis_key("tollgate:", s)).collect();
        for (i, (k, s)) in keys.iter().zip(specs).enumerate() {
            let open = k.find('{').expect("a hash tag");
            let close = open + k[open..].find('}').expect("a closed hash tag");
            assert!(close > open + 1, "an empty hash tag: {k:?}");
            let tag_slot = slot(&k[open..=close]);
            assert_eq!(slot(k), tag_slot, "{k:?}");
            assert_eq!(slot(&format!("{k}:123456")), tag_slot, "{k:?}");
            for (k2, s2) in keys.iter().zip(specs).take(i) {
                let same = (&s.key, s.algorithm) == (&s2.key, s2.algorithm);
                assert_eq!(k == k2, same, "{k:?} vs {k2:?}");
            }
        }
    }

    /// Whether the message holds a group (wire type 3 or 4) among its top-level fields, which
    /// prost skips as an unknown field and the contract does not use.
    pub fn top_level_group(mut buf: &[u8]) -> bool {
        use prost::encoding::{decode_key, decode_varint, WireType};
        while !buf.is_empty() {
            let Ok((_, wire_type)) = decode_key(&mut buf) else {
                return false;
            };
            let skip = match wire_type {
                WireType::Varint => match decode_varint(&mut buf) {
                    Ok(_) => 0,
                    Err(_) => return false,
                },
                WireType::SixtyFourBit => 8,
                WireType::ThirtyTwoBit => 4,
                WireType::LengthDelimited => match decode_varint(&mut buf) {
                    Ok(n) => usize::try_from(n).unwrap_or(usize::MAX),
                    Err(_) => return false,
                },
                WireType::StartGroup | WireType::EndGroup => return true,
            };
            match buf.get(skip..) {
                Some(rest) => buf = rest,
                None => return false,
            }
        }
        false
    }
}
