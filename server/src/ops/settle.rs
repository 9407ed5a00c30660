//! `settle`: the second half of "reserve, then settle" (limits priced in what a response used).
//! A take charged an estimate when the request arrived; when the response ends, the caller sends
//! `POST /v1/settle` (or gRPC `Settle`) with what it really used, and the store gives back or
//! charges the difference in the same buckets, atomically, at most once per settlement id.
//!
//! Both wire forms decode into a [`RawSettle`] and go through [`validate`], which checks each
//! bucket exactly as a take's (same field names in errors). The store's semantics (debt, windows,
//! the id's record) are described on [`crate::store::Store::settle`] and in
//! `store/lua/settle.lua`.

use serde::de::MapAccess;
use serde_json::{Map, Value};

use contract::fields;

use super::take::{self, RawBucket, RawTake};
use super::{invalid, GrpcOperation, Operation};
use crate::api::grpc::{algorithm_from_pb, non_empty, pb};
use crate::api::json::{self, Field, Object};
use crate::api::{Api, ApiError};
use crate::domain::{
    check_instance, Algorithm, InvalidArgument, SettleResponse, SettleResult, SettleSpec,
    Settlement, MAX_AMOUNT, MAX_SETTLE_ID_BYTES, MAX_TAKE_BYTES,
};

/// A settle (`POST /v1/settle`, `Settle`) as decoded from either wire form.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawSettle {
    /// `id`: the settlement's id, applied at most once.
    pub id: Option<String>,
    /// `instance`, as in a take.
    pub instance: Option<String>,
    /// `buckets`, absent when missing from JSON.
    pub buckets: Option<Vec<RawSettleBucket>>,
}

/// One bucket of a settle as decoded: the bucket as a take names it, and the amounts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawSettleBucket {
    /// The bucket's fields as in a take (`cost` and `lease` are never set: a settle has none).
    pub bucket: RawBucket,
    /// `estimate`: the tokens the take charged at the request.
    pub estimate: Option<u64>,
    /// `used`: the tokens the response actually used.
    pub used: Option<u64>,
    /// `window`: the window the take charged (its answer's `window`), when the caller knows it.
    pub window: Option<u64>,
}

/// Checks a decoded settle: the id, then every bucket as a take's (same fields, same bounds and
/// the same error names; a settle has no `cost` nor `lease`), then its amounts.
pub fn validate(raw: RawSettle) -> Result<Settlement, InvalidArgument> {
    let id = raw
        .id
        .ok_or_else(|| InvalidArgument::new("id", "is required"))?;
    if id.is_empty() || id.len() > MAX_SETTLE_ID_BYTES {
        return Err(InvalidArgument::new(
            "id",
            format!("must be 1..={MAX_SETTLE_ID_BYTES} bytes, got {}", id.len()),
        ));
    }
    if !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(InvalidArgument::new(
            "id",
            "may hold only printable ASCII characters, no space",
        ));
    }
    let raws = raw
        .buckets
        .ok_or_else(|| InvalidArgument::new("buckets", "is required"))?;
    let mut amounts = Vec::with_capacity(raws.len());
    let mut takes = Vec::with_capacity(raws.len());
    for b in raws {
        amounts.push((b.estimate, b.used, b.window));
        takes.push(RawBucket {
            cost: None,
            lease: None,
            ..b.bucket
        });
    }
    let specs = take::validate(RawTake {
        buckets: Some(takes),
        instance: None,
    })?;
    let buckets = specs
        .into_iter()
        .zip(amounts)
        .enumerate()
        .map(|(i, (bucket, (estimate, used, window)))| {
            let f = |name: &str| format!("buckets[{i}].{name}");
            let amount = |name: &str, v: Option<u64>| match v {
                None => Err(InvalidArgument::new(f(name), "is required")),
                Some(v) if v > MAX_AMOUNT => Err(InvalidArgument::new(
                    f(name),
                    format!("must be at most {MAX_AMOUNT}, got {v}"),
                )),
                Some(v) => Ok(v),
            };
            let estimate = amount("estimate", estimate)?;
            let used = amount("used", used)?;
            if window.is_some() && bucket.algorithm == Algorithm::TokenBucket {
                return Err(InvalidArgument::new(
                    f("window"),
                    "applies to the windows only (fixed, sliding, calendar)",
                ));
            }
            Ok(SettleSpec {
                bucket,
                estimate,
                used,
                window,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Settlement { id, buckets })
}

// ---------------------------------------------------------------------------------------------
// JSON

/// A settle's fields: the take's `instance` beside its own.
const SETTLE_FIELDS: [&str; 3] = [fields::ID, fields::BUCKETS, fields::INSTANCE];

impl Object for RawSettle {
    const FIELDS: &'static [&'static str] = &SETTLE_FIELDS;

    fn read<'de, A: MapAccess<'de>>(
        &mut self,
        name: &'static str,
        v: Field<'_, '_, A>,
    ) -> Result<(), A::Error> {
        match name {
            fields::ID => self.id = v.string()?,
            fields::BUCKETS => self.buckets = v.objects(None)?,
            fields::INSTANCE => self.instance = v.string()?,
            // FIELDS holds no other name.
            _ => {}
        }
        Ok(())
    }
}

impl Object for RawSettleBucket {
    const FIELDS: &'static [&'static str] = &fields::SETTLE_BUCKET;

    fn read<'de, A: MapAccess<'de>>(
        &mut self,
        name: &'static str,
        v: Field<'_, '_, A>,
    ) -> Result<(), A::Error> {
        match name {
            fields::ESTIMATE => self.estimate = v.uint()?,
            fields::USED => self.used = v.uint()?,
            fields::WINDOW => self.window = v.uint()?,
            // The bucket's own fields, read as a take's bucket reads them (FIELDS holds no `cost`
            // or `lease`, so those never reach it).
            _ => self.bucket.read(name, v)?,
        }
        Ok(())
    }
}

/// Decodes a JSON settle body (the strict reader, [`crate::api::json`]); the bounds are
/// [`validate`]'s.
pub fn decode_json(body: &[u8]) -> Result<RawSettle, InvalidArgument> {
    json::decode(body)
}

/// Encodes a settle as JSON (the inverse of [`decode_json`]; for tests and load tools).
pub fn encode_json(raw: &RawSettle) -> Value {
    let mut o = Map::new();
    if let Some(id) = &raw.id {
        o.insert("id".into(), Value::from(id.as_str()));
    }
    if let Some(buckets) = &raw.buckets {
        let list = buckets
            .iter()
            .map(|s| {
                let b = &s.bucket;
                let mut m = Map::new();
                let mut put = |k: &str, v: Option<Value>| {
                    if let Some(v) = v {
                        m.insert(k.into(), v);
                    }
                };
                put("key", b.key.as_deref().map(Value::from));
                put("capacity", b.capacity.map(Value::from));
                put("rate", b.rate.map(Value::from));
                put("period_ms", b.period_ms.map(Value::from));
                put("algorithm", b.algorithm.map(|a| Value::from(a.name())));
                put("rule", b.rule.as_deref().map(Value::from));
                put("estimate", s.estimate.map(Value::from));
                put("used", s.used.map(Value::from));
                put("window", s.window.map(Value::from));
                put("calendar", b.calendar.as_deref().map(Value::from));
                put("time_zone", b.time_zone.as_deref().map(Value::from));
                Value::Object(m)
            })
            .collect();
        o.insert("buckets".into(), Value::Array(list));
    }
    Value::Object(o)
}

// ---------------------------------------------------------------------------------------------
// Protobuf

/// Converts a decoded protobuf settle. Protobuf cannot tell an absent id, key, capacity,
/// period or amount from an empty or zero one: those are "sent as empty/zero" and validated so.
pub fn raw_from_pb(req: &pb::SettleRequest) -> Result<RawSettle, InvalidArgument> {
    let mut buckets = Vec::with_capacity(req.buckets.len());
    for (i, b) in req.buckets.iter().enumerate() {
        let algorithm = algorithm_from_pb(i, b.algorithm)?;
        buckets.push(RawSettleBucket {
            bucket: RawBucket {
                key: Some(b.key.clone()),
                capacity: Some(b.capacity),
                rate: b.rate,
                period_ms: Some(b.period_ms),
                cost: None,
                algorithm: Some(algorithm),
                lease: None,
                rule: non_empty(&b.rule),
                max_delay_ms: None,
                calendar: take::calendar_from_pb(b.calendar),
                time_zone: non_empty(&b.time_zone),
            },
            estimate: Some(b.estimate),
            used: Some(b.used),
            window: b.window,
        });
    }
    Ok(RawSettle {
        // An empty id is "not sent": refused as required.
        id: non_empty(&req.id),
        instance: non_empty(&req.instance),
        buckets: Some(buckets),
    })
}

/// The protobuf form of a settle's answer.
pub fn pb_from_answer(d: &SettleResponse) -> pb::SettleResponse {
    pb::SettleResponse {
        duplicate: d.duplicate,
        buckets: d
            .buckets
            .iter()
            .map(|b: &SettleResult| pb::SettleResult {
                remaining: b.remaining,
                debt: b.debt,
            })
            .collect(),
    }
}

// ---------------------------------------------------------------------------------------------
// The handler

/// The settle operation.
pub struct Settle;

impl Operation for Settle {
    type Raw = RawSettle;
    type Answer = SettleResponse;
    const BODY_BYTES: usize = MAX_TAKE_BYTES;

    /// Validates and applies one settle.
    async fn handle(
        api: &Api,
        raw: Result<RawSettle, InvalidArgument>,
    ) -> Result<SettleResponse, ApiError> {
        let checked = raw.and_then(|r| {
            check_instance("instance", r.instance.as_deref())?;
            let instance = r.instance.clone();
            validate(r).map(|s| (s, instance))
        });
        let (settlement, instance) = checked.map_err(|e| invalid("settle", e))?;
        api.instances(instance.as_deref());
        let d = api
            .store_call("settle", api.store.settle(&settlement))
            .await?;
        api.metrics
            .settlements(if d.duplicate { "duplicate" } else { "applied" });
        Ok(d)
    }
}

impl GrpcOperation for Settle {
    type Request = pb::SettleRequest;
    type Response = pb::SettleResponse;

    fn from_pb(req: pb::SettleRequest) -> Result<RawSettle, InvalidArgument> {
        raw_from_pb(&req)
    }

    fn to_pb(answer: &SettleResponse) -> pb::SettleResponse {
        pb_from_answer(answer)
    }
}
