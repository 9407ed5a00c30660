//! Concurrency limits: slots held while a request is in flight (contract/README.md, "Acquire and
//! release").
//!
//! An *acquire* names 1..=16 keys, each with a limit `C` and a deadline `ttl_ms`; it takes one
//! slot of every key or of none (all or nothing, like a take), answering one slot id that holds
//! them all. A *release* gives that id's slots back. A slot that is never released (the proxy
//! died) expires at its deadline, read on the store's own clock, so a crashed caller's slots come
//! back by themselves.
//!
//! Both wire forms decode into [`RawAcquire`] / [`RawRelease`] and go through [`validate_acquire`]
//! / [`validate_release`]; only validated values reach a store.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::Deserialize;

use crate::api::{Api, ApiError};
use crate::domain::{InvalidArgument, MAX_AMOUNT, MAX_BUCKETS, MAX_KEY_BYTES};

use crate::domain::{AcquireResponse, ReleaseResponse, SlotSpec};
pub use crate::domain::{MAX_SLOT_BYTES, MAX_SLOT_TTL_MS};
/// Largest acquire or release body accepted.
pub const MAX_BODY_BYTES: usize = MAX_BUCKETS * (MAX_KEY_BYTES + 128) + 512;

/// One key of an acquire as decoded, before validation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSlot {
    /// `key`.
    pub key: Option<String>,
    /// `limit`.
    pub limit: Option<u64>,
    /// `ttl_ms`.
    pub ttl_ms: Option<u64>,
}

/// An acquire as decoded, before validation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAcquire {
    /// `instance`, as in a take.
    pub instance: Option<String>,
    /// `slot`: the caller's id for the slots, if it names them.
    pub slot: Option<String>,
    /// `buckets`.
    pub buckets: Option<Vec<RawSlot>>,
}

/// A release as decoded, before validation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRelease {
    /// `instance`, as in a take.
    pub instance: Option<String>,
    /// `slot`.
    pub slot: Option<String>,
    /// `keys`.
    pub keys: Option<Vec<String>>,
}

fn check_key(at: &str, key: &str) -> Result<(), InvalidArgument> {
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        return Err(InvalidArgument::new(
            at,
            format!("must be 1..={MAX_KEY_BYTES} bytes"),
        ));
    }
    Ok(())
}

fn check_keys(field: &str, n: usize) -> Result<(), InvalidArgument> {
    if n == 0 || n > MAX_BUCKETS {
        return Err(InvalidArgument::new(
            field,
            format!("must hold 1..={MAX_BUCKETS} entries"),
        ));
    }
    Ok(())
}

/// A slot id as the contract writes it (1..=64 bytes of `0-9a-f`), or the error naming `field`.
fn check_slot(slot: &str) -> Result<(), InvalidArgument> {
    if slot.is_empty()
        || slot.len() > MAX_SLOT_BYTES
        || !slot.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return Err(InvalidArgument::new(
            "slot",
            format!("must be a slot id: 1..={MAX_SLOT_BYTES} hex digits"),
        ));
    }
    Ok(())
}

/// The id an acquire's slots are held under: the caller's (validated), or a new one.
pub fn acquire_slot_id(raw: &RawAcquire) -> Result<String, InvalidArgument> {
    match raw.slot.as_deref() {
        None | Some("") => Ok(new_slot_id()),
        Some(s) => check_slot(s).map(|()| s.to_string()),
    }
}

/// Validates an acquire: 1..=16 distinct keys, each with its limit and deadline in bounds.
pub fn validate_acquire(raw: RawAcquire) -> Result<Vec<SlotSpec>, InvalidArgument> {
    let buckets = raw
        .buckets
        .ok_or_else(|| InvalidArgument::new("buckets", "missing (required)"))?;
    check_keys("buckets", buckets.len())?;
    let mut out: Vec<SlotSpec> = Vec::with_capacity(buckets.len());
    for (i, b) in buckets.into_iter().enumerate() {
        let at = |f: &str| format!("buckets[{i}].{f}");
        let key = b
            .key
            .ok_or_else(|| InvalidArgument::new(at("key"), "missing (required)"))?;
        check_key(&at("key"), &key)?;
        if out.iter().any(|o| o.key == key) {
            return Err(InvalidArgument::new(at("key"), "named twice"));
        }
        let limit = match b.limit {
            Some(n) if (1..=MAX_AMOUNT).contains(&n) => n,
            _ => {
                return Err(InvalidArgument::new(
                    at("limit"),
                    format!("must be between 1 and {MAX_AMOUNT}"),
                ))
            }
        };
        let ttl_ms = match b.ttl_ms {
            Some(n) if (1..=MAX_SLOT_TTL_MS).contains(&n) => n,
            _ => {
                return Err(InvalidArgument::new(
                    at("ttl_ms"),
                    format!("must be between 1 and {MAX_SLOT_TTL_MS}"),
                ))
            }
        };
        out.push(SlotSpec { key, limit, ttl_ms });
    }
    Ok(out)
}

/// Validates a release: a slot id as issued (1..=64 bytes of `0-9a-f`) and 1..=16 keys.
pub fn validate_release(raw: RawRelease) -> Result<(String, Vec<String>), InvalidArgument> {
    let slot = raw
        .slot
        .ok_or_else(|| InvalidArgument::new("slot", "missing (required)"))?;
    check_slot(&slot)?;
    let keys = raw
        .keys
        .ok_or_else(|| InvalidArgument::new("keys", "missing (required)"))?;
    check_keys("keys", keys.len())?;
    for (i, k) in keys.iter().enumerate() {
        check_key(&format!("keys[{i}]"), k)?;
    }
    Ok((slot, keys))
}

/// Decodes a JSON acquire body.
pub fn decode_acquire(body: &[u8]) -> Result<RawAcquire, InvalidArgument> {
    serde_json::from_slice(body).map_err(|e| InvalidArgument::new("", format!("bad JSON: {e}")))
}

/// Decodes a JSON release body.
pub fn decode_release(body: &[u8]) -> Result<RawRelease, InvalidArgument> {
    serde_json::from_slice(body).map_err(|e| InvalidArgument::new("", format!("bad JSON: {e}")))
}

/// A new slot id: 32 hex digits (128 bits), unique across replicas with overwhelming
/// probability: a per-process random seed (the standard library's, from the OS), a counter and
/// the time.
pub fn new_slot_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static SEEDS: std::sync::OnceLock<(RandomState, RandomState, Instant)> =
        std::sync::OnceLock::new();
    let (a, b, start) =
        SEEDS.get_or_init(|| (RandomState::new(), RandomState::new(), Instant::now()));
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    let mut h1 = a.build_hasher();
    h1.write_u64(n);
    h1.write_u64(t);
    let mut h2 = b.build_hasher();
    h2.write_u64(n);
    format!("{:016x}{:016x}", h1.finish(), h2.finish())
}

impl Api {
    /// Validates and decides one admitted acquire.
    pub async fn acquire(
        &self,
        raw: Result<RawAcquire, InvalidArgument>,
    ) -> Result<AcquireResponse, ApiError> {
        let checked = raw.and_then(|r| {
            crate::domain::check_instance("instance", r.instance.as_deref())?;
            self.instances(r.instance.as_deref());
            let id = acquire_slot_id(&r)?;
            validate_acquire(r).map(|specs| (specs, id))
        });
        let (specs, id) = checked.map_err(|e| {
            tracing::debug!(error = %e, "invalid acquire");
            ApiError::Invalid(e)
        })?;
        let start = Instant::now();
        let result = self.store.acquire(&specs, &id).await;
        self.metrics.store_duration(start.elapsed().as_secs_f64());
        if let Ok(d) = &result {
            self.metrics
                .slots(if d.allowed { "acquired" } else { "limited" }, 1);
        }
        result.map_err(|e| {
            self.metrics.store_error(e.kind());
            tracing::warn!(error = %e, store = self.store.kind(), "acquire failed");
            ApiError::Unavailable(e.public_message())
        })
    }

    /// Validates and performs one admitted release.
    pub async fn release(
        &self,
        raw: Result<RawRelease, InvalidArgument>,
    ) -> Result<ReleaseResponse, ApiError> {
        let checked = raw.and_then(|r| {
            crate::domain::check_instance("instance", r.instance.as_deref())?;
            self.instances(r.instance.as_deref());
            validate_release(r)
        });
        let (slot, keys) = checked.map_err(|e| {
            tracing::debug!(error = %e, "invalid release");
            ApiError::Invalid(e)
        })?;
        let start = Instant::now();
        let result = self.store.release(&slot, &keys).await;
        self.metrics.store_duration(start.elapsed().as_secs_f64());
        if let Ok(r) = &result {
            let found = r.iter().filter(|&&b| b).count() as u64;
            self.metrics.slots("released", found);
            self.metrics.slots("already_free", r.len() as u64 - found);
        }
        result
            .map(|released| ReleaseResponse { released })
            .map_err(|e| {
                self.metrics.store_error(e.kind());
                tracing::warn!(error = %e, store = self.store.kind(), "release failed; the slot is left to its deadline");
                ApiError::Unavailable(e.public_message())
            })
    }
}

// ---------------------------------------------------------------------------------------------
// The gRPC form (`Acquire`, `Release`): protobuf cannot tell an absent scalar from zero; zeros are
// passed on and rejected by validation with the field's name.

use crate::api::grpc::{pb, DecodeStrict};
use prost::Message;

fn malformed(e: &prost::DecodeError) -> InvalidArgument {
    InvalidArgument::new("", format!("malformed protobuf: {e}"))
}

/// An `AcquireRequest` as a [`RawAcquire`].
pub fn raw_acquire_from_pb(req: &pb::AcquireRequest) -> RawAcquire {
    RawAcquire {
        instance: (!req.instance.is_empty()).then(|| req.instance.clone()),
        slot: (!req.slot.is_empty()).then(|| req.slot.clone()),
        buckets: Some(
            req.buckets
                .iter()
                .map(|b| RawSlot {
                    key: Some(b.key.clone()),
                    limit: Some(b.limit),
                    ttl_ms: Some(b.ttl_ms),
                })
                .collect(),
        ),
    }
}

/// A `ReleaseRequest` as a [`RawRelease`].
pub fn raw_release_from_pb(req: &pb::ReleaseRequest) -> RawRelease {
    RawRelease {
        instance: (!req.instance.is_empty()).then(|| req.instance.clone()),
        slot: Some(req.slot.clone()),
        keys: Some(req.keys.clone()),
    }
}

/// An [`AcquireResponse`] as an `AcquireResponse` (`slot` empty when not allowed).
pub fn pb_from_acquire(d: &AcquireResponse) -> pb::AcquireResponse {
    pb::AcquireResponse {
        allowed: d.allowed,
        slot: d.slot.clone().unwrap_or_default(),
        buckets: d
            .buckets
            .iter()
            .map(|b| pb::SlotResult {
                allowed: b.allowed,
                limit: b.limit,
                in_flight: b.in_flight,
                retry_after_ms: b.retry_after_ms,
            })
            .collect(),
    }
}

impl DecodeStrict for pb::AcquireRequest {
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
        pb::AcquireRequest::decode(bytes).map_err(|e| malformed(&e))
    }
}

impl DecodeStrict for pb::AcquireResponse {
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
        pb::AcquireResponse::decode(bytes).map_err(|e| malformed(&e))
    }
}

impl DecodeStrict for pb::ReleaseRequest {
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
        pb::ReleaseRequest::decode(bytes).map_err(|e| malformed(&e))
    }
}

impl DecodeStrict for pb::ReleaseResponse {
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
        pb::ReleaseResponse::decode(bytes).map_err(|e| malformed(&e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(key: &str, limit: u64, ttl: u64) -> RawSlot {
        RawSlot {
            key: Some(key.into()),
            limit: Some(limit),
            ttl_ms: Some(ttl),
        }
    }

    fn field<T>(r: Result<T, InvalidArgument>) -> String {
        match r {
            Ok(_) => "<accepted>".into(),
            Err(e) => e.field,
        }
    }

    #[test]
    fn validation_names_the_field() {
        let bad = |buckets: Vec<RawSlot>| {
            field(validate_acquire(RawAcquire {
                instance: None,
                slot: None,
                buckets: Some(buckets),
            }))
        };
        assert_eq!(bad(vec![]), "buckets");
        assert_eq!(bad(vec![raw("", 1, 1)]), "buckets[0].key");
        assert_eq!(bad(vec![raw("a", 0, 1)]), "buckets[0].limit");
        assert_eq!(
            bad(vec![raw("a", 1, MAX_SLOT_TTL_MS + 1)]),
            "buckets[0].ttl_ms"
        );
        assert_eq!(bad(vec![raw("a", 1, 1), raw("a", 1, 1)]), "buckets[1].key");
        assert_eq!(field(validate_acquire(RawAcquire::default())), "buckets");
        let rel = |slot: &str, keys: Vec<String>| {
            field(validate_release(RawRelease {
                instance: None,
                slot: Some(slot.into()),
                keys: Some(keys),
            }))
        };
        assert_eq!(rel("xyz", vec!["a".into()]), "slot");
        assert_eq!(rel("ab", vec![]), "keys");
        assert_eq!(rel("ab", vec![String::new()]), "keys[0]");
        assert_eq!(rel("ab12", vec!["a".into()]), "<accepted>");
        assert!(decode_acquire(br#"{"buckets":[],"x":1}"#).is_err());
    }

    #[test]
    fn slot_ids_are_hex_and_distinct() {
        let ids: std::collections::HashSet<String> = (0..1000).map(|_| new_slot_id()).collect();
        assert_eq!(ids.len(), 1000);
        assert!(ids
            .iter()
            .all(|s| s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit())));
    }
}
