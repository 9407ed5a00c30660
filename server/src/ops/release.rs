//! `release`: an acquire's slots given back (see [`super::acquire`]). `POST /v1/release` and
//! `tollgate.v1.RateLimiter/Release`: the slot id as issued and the keys it holds; per key, whether
//! it was still held (a slot past its deadline is free already).

use serde::de::MapAccess;

use contract::fields;

use super::acquire::{check_key, check_keys, check_slot, MAX_BODY_BYTES};
use super::{invalid, GrpcOperation, Operation};
use crate::api::grpc::{non_empty, pb};
use crate::api::json::{self, Field, Object};
use crate::api::{Api, ApiError};
use crate::domain::{check_instance, InvalidArgument, ReleaseResponse};

/// A release as decoded, before validation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawRelease {
    /// `instance`, as in a take.
    pub instance: Option<String>,
    /// `slot`.
    pub slot: Option<String>,
    /// `keys`.
    pub keys: Option<Vec<String>>,
}

/// Validates a release: a slot id as issued (1..=64 bytes of `0-9a-f`) and 1..=16 keys.
pub fn validate(raw: RawRelease) -> Result<(String, Vec<String>), InvalidArgument> {
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

// ---------------------------------------------------------------------------------------------
// JSON

impl Object for RawRelease {
    const FIELDS: &'static [&'static str] = &[fields::INSTANCE, fields::SLOT, fields::KEYS];

    fn read<'de, A: MapAccess<'de>>(
        &mut self,
        name: &'static str,
        v: Field<'_, '_, A>,
    ) -> Result<(), A::Error> {
        match name {
            fields::INSTANCE => self.instance = v.string()?,
            fields::SLOT => self.slot = v.string()?,
            fields::KEYS => self.keys = v.strings()?,
            // FIELDS holds no other name.
            _ => {}
        }
        Ok(())
    }
}

/// Decodes a JSON release body (the strict reader, [`crate::api::json`]).
pub fn decode_json(body: &[u8]) -> Result<RawRelease, InvalidArgument> {
    json::decode(body)
}

// ---------------------------------------------------------------------------------------------
// Protobuf

/// A `ReleaseRequest` as a [`RawRelease`].
pub fn raw_from_pb(req: &pb::ReleaseRequest) -> RawRelease {
    RawRelease {
        instance: non_empty(&req.instance),
        slot: Some(req.slot.clone()),
        keys: Some(req.keys.clone()),
    }
}

// ---------------------------------------------------------------------------------------------
// The handler

/// The release operation.
pub struct Release;

impl Operation for Release {
    type Raw = RawRelease;
    type Answer = ReleaseResponse;
    const BODY_BYTES: usize = MAX_BODY_BYTES;

    /// Validates and performs one admitted release; when the store fails, the slot is left to
    /// its deadline.
    async fn handle(
        api: &Api,
        raw: Result<RawRelease, InvalidArgument>,
    ) -> Result<ReleaseResponse, ApiError> {
        let checked = raw.and_then(|r| {
            check_instance("instance", r.instance.as_deref())?;
            api.instances(r.instance.as_deref());
            validate(r)
        });
        let (slot, keys) = checked.map_err(|e| invalid("release", e))?;
        let released = api
            .store_call("release", api.store.release(&slot, &keys))
            .await?;
        let found = released.iter().filter(|&&b| b).count() as u64;
        api.metrics.slots("released", found);
        api.metrics
            .slots("already_free", released.len() as u64 - found);
        Ok(ReleaseResponse { released })
    }
}

impl GrpcOperation for Release {
    type Request = pb::ReleaseRequest;
    type Response = pb::ReleaseResponse;

    fn from_pb(req: pb::ReleaseRequest) -> Result<RawRelease, InvalidArgument> {
        Ok(raw_from_pb(&req))
    }

    fn to_pb(answer: &ReleaseResponse) -> pb::ReleaseResponse {
        pb::ReleaseResponse {
            released: answer.released.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field<T>(r: Result<T, InvalidArgument>) -> String {
        match r {
            Ok(_) => "<accepted>".into(),
            Err(e) => e.field,
        }
    }

    #[test]
    fn validation_names_the_field() {
        let rel = |slot: &str, keys: Vec<String>| {
            field(validate(RawRelease {
                instance: None,
                slot: Some(slot.into()),
                keys: Some(keys),
            }))
        };
        assert_eq!(rel("xyz", vec!["a".into()]), "slot");
        assert_eq!(rel("ab", vec![]), "keys");
        assert_eq!(rel("ab", vec![String::new()]), "keys[0]");
        assert_eq!(rel("ab12", vec!["a".into()]), "<accepted>");
    }

    /// The JSON reader names the field of a decoding error, as a take's does.
    #[test]
    fn decoding_names_the_field() {
        assert_eq!(
            field(decode_json(br#"{"slot":"ab","keys":["a",1]}"#)),
            "keys[1]"
        );
        assert_eq!(field(decode_json(br#"{"slot":"ab","keys":"a"}"#)), "keys");
        assert_eq!(field(decode_json(br#"{"slot":"ab","key":["a"]}"#)), "key");
        assert_eq!(
            decode_json(br#"{"slot":"ab","keys":["a"]}"#).map(|r| r.keys),
            Ok(Some(vec!["a".to_string()]))
        );
    }
}
