//! `acquire`: concurrency slots held while a request is in flight (contract/README.md, "Acquire
//! and release"). `POST /v1/acquire` and `tollgate.v1.RateLimiter/Acquire`.
//!
//! An acquire names 1..=16 keys, each with a limit `C` and a deadline `ttl_ms`; it takes one
//! slot of every key or of none (all or nothing, like a take), answering one slot id that holds
//! them all ([`super::release`] gives them back). A slot that is never released (the proxy died)
//! expires at its deadline, read on the store's own clock, so a crashed caller's slots come back
//! by themselves. Both wire forms decode into a [`RawAcquire`] and go through [`validate`]; only
//! validated [`SlotSpec`]s reach a store.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::de::MapAccess;

use contract::fields;

use super::{invalid, GrpcOperation, Operation};
use crate::api::grpc::{non_empty, pb};
use crate::api::json::{self, Field, Object};
use crate::api::{Api, ApiError};
use crate::domain::{
    check_instance, AcquireResponse, InvalidArgument, SlotSpec, MAX_AMOUNT, MAX_BUCKETS,
    MAX_KEY_BYTES, MAX_SLOT_BYTES, MAX_SLOT_TTL_MS,
};

/// Largest acquire or release body accepted.
pub const MAX_BODY_BYTES: usize = MAX_BUCKETS * (MAX_KEY_BYTES + 128) + 512;

/// One key of an acquire as decoded, before validation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawSlot {
    /// `key`.
    pub key: Option<String>,
    /// `limit`.
    pub limit: Option<u64>,
    /// `ttl_ms`.
    pub ttl_ms: Option<u64>,
}

/// An acquire as decoded, before validation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawAcquire {
    /// `instance`, as in a take.
    pub instance: Option<String>,
    /// `slot`: the caller's id for the slots, if it names them.
    pub slot: Option<String>,
    /// `buckets`.
    pub buckets: Option<Vec<RawSlot>>,
}

pub(super) fn check_key(at: &str, key: &str) -> Result<(), InvalidArgument> {
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        return Err(InvalidArgument::new(
            at,
            format!("must be 1..={MAX_KEY_BYTES} bytes"),
        ));
    }
    Ok(())
}

pub(super) fn check_keys(field: &str, n: usize) -> Result<(), InvalidArgument> {
    if n == 0 || n > MAX_BUCKETS {
        return Err(InvalidArgument::new(
            field,
            format!("must hold 1..={MAX_BUCKETS} entries"),
        ));
    }
    Ok(())
}

/// A slot id as the contract writes it (1..=64 bytes of `0-9a-f`), or the error naming `field`.
pub(super) fn check_slot(slot: &str) -> Result<(), InvalidArgument> {
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
pub fn slot_id(raw: &RawAcquire) -> Result<String, InvalidArgument> {
    match raw.slot.as_deref() {
        None | Some("") => Ok(new_slot_id()),
        Some(s) => check_slot(s).map(|()| s.to_string()),
    }
}

/// Validates an acquire: 1..=16 distinct keys, each with its limit and deadline in bounds.
pub fn validate(raw: RawAcquire) -> Result<Vec<SlotSpec>, InvalidArgument> {
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

// ---------------------------------------------------------------------------------------------
// JSON

impl Object for RawSlot {
    const FIELDS: &'static [&'static str] = &[fields::KEY, fields::LIMIT, fields::TTL_MS];

    fn read<'de, A: MapAccess<'de>>(
        &mut self,
        name: &'static str,
        v: Field<'_, '_, A>,
    ) -> Result<(), A::Error> {
        match name {
            fields::KEY => self.key = v.string()?,
            fields::LIMIT => self.limit = v.uint()?,
            fields::TTL_MS => self.ttl_ms = v.uint()?,
            // FIELDS holds no other name.
            _ => {}
        }
        Ok(())
    }
}

impl Object for RawAcquire {
    const FIELDS: &'static [&'static str] = &[fields::INSTANCE, fields::SLOT, fields::BUCKETS];

    fn read<'de, A: MapAccess<'de>>(
        &mut self,
        name: &'static str,
        v: Field<'_, '_, A>,
    ) -> Result<(), A::Error> {
        match name {
            fields::INSTANCE => self.instance = v.string()?,
            fields::SLOT => self.slot = v.string()?,
            // The count is [`validate`]'s (the body's bound, [`MAX_BODY_BYTES`], bounds memory).
            fields::BUCKETS => self.buckets = v.objects(None)?,
            _ => {}
        }
        Ok(())
    }
}

/// Decodes a JSON acquire body (the strict reader, [`crate::api::json`]).
pub fn decode_json(body: &[u8]) -> Result<RawAcquire, InvalidArgument> {
    json::decode(body)
}

// ---------------------------------------------------------------------------------------------
// Protobuf: it cannot tell an absent scalar from zero; zeros are passed on and rejected by
// validation with the field's name.

/// An `AcquireRequest` as a [`RawAcquire`].
pub fn raw_from_pb(req: &pb::AcquireRequest) -> RawAcquire {
    RawAcquire {
        instance: non_empty(&req.instance),
        slot: non_empty(&req.slot),
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

/// An [`AcquireResponse`] as an `AcquireResponse` (`slot` empty when not allowed).
pub fn pb_from_answer(d: &AcquireResponse) -> pb::AcquireResponse {
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

// ---------------------------------------------------------------------------------------------
// The handler

/// The acquire operation.
pub struct Acquire;

impl Operation for Acquire {
    type Raw = RawAcquire;
    type Answer = AcquireResponse;
    const BODY_BYTES: usize = MAX_BODY_BYTES;

    /// Validates and decides one admitted acquire.
    async fn handle(
        api: &Api,
        raw: Result<RawAcquire, InvalidArgument>,
    ) -> Result<AcquireResponse, ApiError> {
        let checked = raw.and_then(|r| {
            check_instance("instance", r.instance.as_deref())?;
            api.instances(r.instance.as_deref());
            let id = slot_id(&r)?;
            validate(r).map(|specs| (specs, id))
        });
        let (specs, id) = checked.map_err(|e| invalid("acquire", e))?;
        let d = api
            .store_call("acquire", api.store.acquire(&specs, &id))
            .await?;
        api.metrics
            .slots(if d.allowed { "acquired" } else { "limited" }, 1);
        Ok(d)
    }
}

impl GrpcOperation for Acquire {
    type Request = pb::AcquireRequest;
    type Response = pb::AcquireResponse;

    fn from_pb(req: pb::AcquireRequest) -> Result<RawAcquire, InvalidArgument> {
        Ok(raw_from_pb(&req))
    }

    fn to_pb(answer: &AcquireResponse) -> pb::AcquireResponse {
        pb_from_answer(answer)
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
            field(validate(RawAcquire {
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
        assert_eq!(field(validate(RawAcquire::default())), "buckets");
        assert!(decode_json(br#"{"buckets":[],"x":1}"#).is_err());
    }

    /// The JSON reader names the field of a decoding error, as a take's does.
    #[test]
    fn decoding_names_the_field() {
        assert_eq!(field(decode_json(br#"{"buckets":[],"x":1}"#)), "x");
        assert_eq!(
            field(decode_json(
                br#"{"buckets":[{"key":5,"limit":1,"ttl_ms":1}]}"#
            )),
            "buckets[0].key"
        );
        assert_eq!(
            field(decode_json(br#"{"buckets":[{"key":"a","limit":-1}]}"#)),
            "buckets[0].limit"
        );
        assert_eq!(
            field(decode_json(br#"{"buckets":[{"key":"a","ttl":1}]}"#)),
            "buckets[0].ttl"
        );
        assert_eq!(field(decode_json(br#"{"slot":7}"#)), "slot");
        assert_eq!(field(decode_json(br#"{"buckets":[3]}"#)), "buckets[0]");
        assert_eq!(field(decode_json(b"{")), "");
        assert_eq!(
            decode_json(
                br#"{"instance":"i","slot":"ab","buckets":[{"key":"a","limit":2,"ttl_ms":9}]}"#
            ),
            Ok(RawAcquire {
                instance: Some("i".into()),
                slot: Some("ab".into()),
                buckets: Some(vec![raw("a", 2, 9)]),
            })
        );
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
