//! Settle: the second half of "reserve, then settle" (limits priced in what a response used).
//! A take charged an estimate when the request arrived; when the response ends, the caller sends
//! `POST /v1/settle` (or gRPC `Settle`) with what it really used, and the store gives back or
//! charges the difference in the same buckets, atomically, at most once per settlement id.
//!
//! Both wire forms decode into a [`RawSettle`] and go through
//! [`crate::domain::validate_settle`], which checks each bucket exactly as a take's (same field
//! names in errors). The store's semantics (debt, windows, the id's record) are described on
//! [`crate::store::Store::settle`] and in `store/lua/settle.lua`.

use std::time::Instant;

use serde_json::{Map, Value};

use super::grpc::pb;
use super::{Api, ApiError};
use crate::domain::{
    validate_settle, Algorithm, InvalidArgument, RawBucket, RawSettle, RawSettleBucket,
    SettleResponse, SettleResult,
};

/// Decodes a JSON settle body. Unknown fields are refused (naming them), `null` is absent, and
/// every type error names its field; the bounds are [`validate_settle`]'s.
pub fn decode_settle(body: &[u8]) -> Result<RawSettle, InvalidArgument> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| InvalidArgument::new("", format!("malformed JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| InvalidArgument::new("", "must be a JSON object"))?;
    if let Some(k) = obj
        .keys()
        .find(|k| !["id", "buckets", "instance"].contains(&k.as_str()))
    {
        return Err(InvalidArgument::new(k.clone(), "unknown field"));
    }
    let id = string(obj, "id", "id")?;
    let instance = string(obj, "instance", "instance")?;
    let buckets = match obj.get("buckets") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => Some(
            items
                .iter()
                .enumerate()
                .map(|(i, item)| bucket(i, item))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(_) => return Err(InvalidArgument::new("buckets", "must be a list")),
    };
    Ok(RawSettle {
        id,
        instance,
        buckets,
    })
}

fn string(
    obj: &Map<String, Value>,
    name: &str,
    field: &str,
) -> Result<Option<String>, InvalidArgument> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(InvalidArgument::new(field, "must be a string")),
    }
}

fn uint(obj: &Map<String, Value>, name: &str, field: &str) -> Result<Option<u64>, InvalidArgument> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| InvalidArgument::new(field, "must be a non-negative integer")),
    }
}

fn bucket(i: usize, v: &Value) -> Result<RawSettleBucket, InvalidArgument> {
    let at = |name: &str| format!("buckets[{i}].{name}");
    let b = v
        .as_object()
        .ok_or_else(|| InvalidArgument::new(format!("buckets[{i}]"), "must be an object"))?;
    if let Some(k) = b
        .keys()
        .find(|k| !contract::fields::SETTLE_BUCKET.contains(&k.as_str()))
    {
        return Err(InvalidArgument::new(at(k), "unknown field"));
    }
    let algorithm = match b.get("algorithm") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_str().and_then(Algorithm::from_name).ok_or_else(|| {
            InvalidArgument::new(
                at("algorithm"),
                format!("must be {}", Algorithm::expected()),
            )
        })?),
    };
    Ok(RawSettleBucket {
        bucket: RawBucket {
            key: string(b, "key", &at("key"))?,
            capacity: uint(b, "capacity", &at("capacity"))?,
            rate: uint(b, "rate", &at("rate"))?,
            period_ms: uint(b, "period_ms", &at("period_ms"))?,
            cost: None,
            algorithm,
            lease: None,
            rule: string(b, "rule", &at("rule"))?,
        },
        estimate: uint(b, "estimate", &at("estimate"))?,
        used: uint(b, "used", &at("used"))?,
        window: uint(b, "window", &at("window"))?,
    })
}

/// Encodes a settle as JSON (the inverse of [`decode_settle`]; for tests and load tools).
pub fn encode_settle(raw: &RawSettle) -> Value {
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
                Value::Object(m)
            })
            .collect();
        o.insert("buckets".into(), Value::Array(list));
    }
    Value::Object(o)
}

/// Converts a decoded protobuf settle. Protobuf cannot tell an absent id, key, capacity,
/// period or amount from an empty or zero one: those are "sent as empty/zero" and validated so.
pub fn raw_settle_from_pb(req: &pb::SettleRequest) -> Result<RawSettle, InvalidArgument> {
    let mut buckets = Vec::with_capacity(req.buckets.len());
    for (i, b) in req.buckets.iter().enumerate() {
        let algorithm = super::grpc::algorithm_from_pb(i, b.algorithm)?;
        buckets.push(RawSettleBucket {
            bucket: RawBucket {
                key: Some(b.key.clone()),
                capacity: Some(b.capacity),
                rate: b.rate,
                period_ms: Some(b.period_ms),
                cost: None,
                algorithm: Some(algorithm),
                lease: None,
                rule: (!b.rule.is_empty()).then(|| b.rule.clone()),
            },
            estimate: Some(b.estimate),
            used: Some(b.used),
            window: b.window,
        });
    }
    Ok(RawSettle {
        // An empty id is "not sent": refused as required.
        id: (!req.id.is_empty()).then(|| req.id.clone()),
        instance: (!req.instance.is_empty()).then(|| req.instance.clone()),
        buckets: Some(buckets),
    })
}

/// The protobuf form of a settle's answer.
pub fn pb_from_settle(d: &SettleResponse) -> pb::SettleResponse {
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

impl Api {
    /// Validates and applies one settle.
    pub async fn settle(
        &self,
        raw: Result<RawSettle, InvalidArgument>,
    ) -> Result<SettleResponse, ApiError> {
        let checked = raw.and_then(|r| {
            crate::domain::check_instance("instance", r.instance.as_deref())?;
            let instance = r.instance.clone();
            validate_settle(r).map(|s| (s, instance))
        });
        let settlement = match checked.map(|(s, instance)| {
            self.instances(instance.as_deref());
            s
        }) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "invalid settle");
                return Err(ApiError::Invalid(e));
            }
        };
        let start = Instant::now();
        let result = self.store.settle(&settlement).await;
        self.metrics.store_duration(start.elapsed().as_secs_f64());
        match result {
            Ok(d) => {
                self.metrics
                    .settlements(if d.duplicate { "duplicate" } else { "applied" });
                Ok(d)
            }
            Err(e) => {
                self.metrics.store_error(e.kind());
                tracing::warn!(error = %e, store = self.store.kind(), "settle failed");
                Err(ApiError::Unavailable(e.public_message()))
            }
        }
    }
}

impl super::grpc::DecodeStrict for pb::SettleRequest {
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
        use prost::Message;
        pb::SettleRequest::decode(bytes)
            .map_err(|e| InvalidArgument::new("", format!("malformed protobuf: {e}")))
    }
}

impl super::grpc::DecodeStrict for pb::SettleResponse {
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
        use prost::Message;
        pb::SettleResponse::decode(bytes)
            .map_err(|e| InvalidArgument::new("", format!("malformed protobuf: {e}")))
    }
}
