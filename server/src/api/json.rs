//! The JSON form of the contract. [`decode_take`] reads a body straight into a [`RawTake`] (and
//! [`decode_batch`] a batch into a [`RawBatch`], stopping at the 65th take) with
//! serde visitors (no `serde_json::Value` tree, so memory stays bounded by the body and 16
//! buckets), naming the field of every error (`buckets[0].capacity`) and refusing unknown fields;
//! encoding uses serde. A response body is the serde form of [`crate::domain::TakeResponse`].

use std::fmt;

use serde::de::{self, Deserialize, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Serialize;
use serde_json::{Map, Value};

use contract::fields;

use crate::domain::{
    Algorithm, InvalidArgument, RawBatch, RawBucket, RawTake, MAX_BATCH_TAKES, MAX_BUCKETS,
};

/// Decodes a `POST /v1/take` body: a pure function over the bytes, in memory bounded by the
/// input (no `Value` tree; decoding stops at the 17th bucket).
///
/// Errors name the field they are about (`buckets[0].capacity`); a body that is not JSON at all,
/// or not an object, has the empty field. Unknown fields are refused; `null` means absent; a field
/// given twice keeps its last value.
pub fn decode_take(body: &[u8]) -> Result<RawTake, InvalidArgument> {
    let slot = ErrorSlot::default();
    let mut de = serde_json::Deserializer::from_slice(body);
    let result = TakeSeed(&slot)
        .deserialize(&mut de)
        .and_then(|raw| de.end().map(|()| raw));
    finish(result, &slot)
}

/// Decodes a `POST /v1/take_batch` body, `{"takes": [<take>, ...]}`, as [`decode_take`] decodes
/// one take; an error inside take `i` names its field from the batch (`takes[3].buckets[0].key`).
/// Decoding stops at the 65th take.
pub fn decode_batch(body: &[u8]) -> Result<RawBatch, InvalidArgument> {
    let slot = ErrorSlot::default();
    let mut de = serde_json::Deserializer::from_slice(body);
    let result = BatchSeed(&slot)
        .deserialize(&mut de)
        .and_then(|raw| de.end().map(|()| raw));
    finish(result, &slot)
}

/// Turns serde's result into ours: a syntax error is about the whole body; any other error is
/// the field-named one a visitor recorded in `slot`.
fn finish<T>(result: Result<T, serde_json::Error>, slot: &ErrorSlot) -> Result<T, InvalidArgument> {
    match result {
        Ok(raw) => Ok(raw),
        // A syntax error wins over what the visitor was reading when it hit it.
        Err(e) if e.is_syntax() || e.is_eof() || e.is_io() => {
            Err(InvalidArgument::new("", format!("malformed JSON: {e}")))
        }
        Err(_) => Err(slot
            .take()
            .unwrap_or_else(|| InvalidArgument::new("", "the body must be a JSON object"))),
    }
}

/// Where a visitor leaves the field-named error it stopped on (serde's error type cannot carry
/// it); the first error recorded wins.
#[derive(Default)]
struct ErrorSlot(std::cell::RefCell<Option<InvalidArgument>>);

impl ErrorSlot {
    /// Records the error (unless one is already there) and returns a serde error to stop on.
    fn set<E: de::Error>(&self, field: impl FnOnce() -> String, message: &str) -> E {
        self.note(field, message, E::custom(message))
    }

    /// Records the error (unless one is already there) and passes `original` on: a syntax error
    /// met while reading a field stays a syntax error.
    fn note<E>(&self, field: impl FnOnce() -> String, message: &str, original: E) -> E {
        let mut s = self.0.borrow_mut();
        if s.is_none() {
            *s = Some(InvalidArgument::new(field(), message));
        }
        original
    }

    fn take(&self) -> Option<InvalidArgument> {
        self.0.borrow_mut().take()
    }
}

enum Field {
    Takes,
    Buckets,
    Key,
    Capacity,
    Rate,
    PeriodMs,
    Cost,
    Algorithm,
    Lease,
    Rule,
    Instance,
    Unknown(String),
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Field;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Field, E> {
                Ok(match v {
                    fields::TAKES => Field::Takes,
                    fields::BUCKETS => Field::Buckets,
                    fields::KEY => Field::Key,
                    fields::CAPACITY => Field::Capacity,
                    fields::RATE => Field::Rate,
                    fields::PERIOD_MS => Field::PeriodMs,
                    fields::COST => Field::Cost,
                    fields::ALGORITHM => Field::Algorithm,
                    fields::LEASE => Field::Lease,
                    fields::RULE => Field::Rule,
                    fields::INSTANCE => Field::Instance,
                    // Only the first unknown name is kept (in the error), so this is one String
                    // per request at most.
                    other => Field::Unknown(other.to_string()),
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

/// The whole body: an object with `buckets` only.
struct TakeSeed<'a>(&'a ErrorSlot);

impl<'de> DeserializeSeed<'de> for TakeSeed<'_> {
    type Value = RawTake;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RawTake, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for TakeSeed<'_> {
    type Value = RawTake;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a take object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawTake, A::Error> {
        let slot = self.0;
        let mut buckets = None;
        let mut instance = None;
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                Field::Buckets => {
                    buckets = map
                        .next_value_seed(OptionSeed(BucketsSeed(slot)))
                        .map_err(|e| slot.note(|| "buckets".into(), "must be a list", e))?;
                }
                Field::Instance => {
                    instance = map
                        .next_value::<Option<String>>()
                        .map_err(|e| slot.note(|| "instance".into(), "must be a string", e))?
                }
                Field::Unknown(name) => return Err(slot.set(|| name, "unknown field")),
                _ => return Err(slot.set(|| field_name(&field), "unknown field")),
            }
        }
        Ok(RawTake { buckets, instance })
    }
}

fn field_name(f: &Field) -> String {
    match f {
        Field::Takes => fields::TAKES,
        Field::Buckets => fields::BUCKETS,
        Field::Key => fields::KEY,
        Field::Capacity => fields::CAPACITY,
        Field::Rate => fields::RATE,
        Field::PeriodMs => fields::PERIOD_MS,
        Field::Cost => fields::COST,
        Field::Algorithm => fields::ALGORITHM,
        Field::Lease => fields::LEASE,
        Field::Rule => fields::RULE,
        Field::Instance => fields::INSTANCE,
        Field::Unknown(n) => n,
    }
    .to_string()
}

/// A whole batch body: an object with `takes` only.
struct BatchSeed<'a>(&'a ErrorSlot);

impl<'de> DeserializeSeed<'de> for BatchSeed<'_> {
    type Value = RawBatch;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RawBatch, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BatchSeed<'_> {
    type Value = RawBatch;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a batch object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawBatch, A::Error> {
        let slot = self.0;
        let mut takes = None;
        let mut instance = None;
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                Field::Takes => {
                    takes = map
                        .next_value_seed(OptionSeed(TakesSeed(slot)))
                        .map_err(|e| slot.note(|| "takes".into(), "must be a list", e))?;
                }
                Field::Instance => {
                    instance = map
                        .next_value::<Option<String>>()
                        .map_err(|e| slot.note(|| "instance".into(), "must be a string", e))?
                }
                Field::Unknown(name) => return Err(slot.set(|| name, "unknown field")),
                _ => return Err(slot.set(|| field_name(&field), "unknown field")),
            }
        }
        Ok(RawBatch { takes, instance })
    }
}

/// The `takes` list: at most [`MAX_BATCH_TAKES`] are read; a 65th stops the decoding there.
struct TakesSeed<'a>(&'a ErrorSlot);

impl<'de> DeserializeSeed<'de> for TakesSeed<'_> {
    type Value = Vec<RawTake>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for TakesSeed<'_> {
    type Value = Vec<RawTake>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of takes")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let slot = self.0;
        let mut out = Vec::new();
        loop {
            let i = out.len();
            if i == MAX_BATCH_TAKES {
                // A 65th element is refused before it is read.
                return match seq.next_element_seed(TooManyTakes(slot))? {
                    None => Ok(out),
                    Some(never) => match never {},
                };
            }
            match seq.next_element_seed(TakeInBatch { slot, i })? {
                Some(t) => out.push(t),
                None => return Ok(out),
            }
        }
    }
}

/// Stands for a take past the bound: errs without reading it.
struct TooManyTakes<'a>(&'a ErrorSlot);

impl<'de> DeserializeSeed<'de> for TooManyTakes<'_> {
    type Value = std::convert::Infallible;

    fn deserialize<D: Deserializer<'de>>(self, _: D) -> Result<Self::Value, D::Error> {
        Err(self.0.set(
            || "takes".into(),
            &format!("must hold at most {MAX_BATCH_TAKES} takes (decoding stopped at the 65th)"),
        ))
    }
}

/// Take `i` of a batch: read exactly as a single take's body, its error's field then prefixed
/// with `takes[i].`.
struct TakeInBatch<'a> {
    slot: &'a ErrorSlot,
    i: usize,
}

impl<'de> DeserializeSeed<'de> for TakeInBatch<'_> {
    type Value = RawTake;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RawTake, D::Error> {
        let inner = ErrorSlot::default();
        d.deserialize_map(TakeSeed(&inner)).map_err(|e| {
            let err = match inner.take() {
                Some(err) => err.within_take(self.i),
                None => InvalidArgument::new(format!("takes[{}]", self.i), "must be an object"),
            };
            self.slot.note(|| err.field, &err.message, e)
        })
    }
}

/// `null` or what the inner seed reads.
struct OptionSeed<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for OptionSeed<S> {
    type Value = Option<S::Value>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de, S: DeserializeSeed<'de>> Visitor<'de> for OptionSeed<S> {
    type Value = Option<S::Value>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a value or null")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.deserialize(d).map(Some)
    }
}

/// The `buckets` list: at most [`MAX_BUCKETS`] are read; a 17th stops the decoding there.
struct BucketsSeed<'a>(&'a ErrorSlot);

impl<'de> DeserializeSeed<'de> for BucketsSeed<'_> {
    type Value = Vec<RawBucket>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for BucketsSeed<'_> {
    type Value = Vec<RawBucket>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of buckets")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let slot = self.0;
        let mut out = Vec::new();
        loop {
            let i = out.len();
            if i == MAX_BUCKETS {
                // A 17th element is refused before it is read.
                return match seq.next_element_seed(TooMany(slot))? {
                    None => Ok(out),
                    Some(never) => match never {},
                };
            }
            let next = seq
                .next_element_seed(BucketSeed { slot, i })
                .map_err(|e| slot.note(|| format!("buckets[{i}]"), "must be an object", e))?;
            match next {
                Some(b) => out.push(b),
                None => return Ok(out),
            }
        }
    }
}

/// Stands for a bucket past the bound: errs without reading it.
struct TooMany<'a>(&'a ErrorSlot);

impl<'de> DeserializeSeed<'de> for TooMany<'_> {
    type Value = std::convert::Infallible;

    fn deserialize<D: Deserializer<'de>>(self, _: D) -> Result<Self::Value, D::Error> {
        Err(self.0.set(
            || "buckets".into(),
            &format!("must hold at most {MAX_BUCKETS} buckets (decoding stopped at the 17th)"),
        ))
    }
}

/// One bucket object; `i` is its index, for error fields.
struct BucketSeed<'a> {
    slot: &'a ErrorSlot,
    i: usize,
}

impl<'de> DeserializeSeed<'de> for BucketSeed<'_> {
    type Value = RawBucket;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RawBucket, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BucketSeed<'_> {
    type Value = RawBucket;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a bucket object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawBucket, A::Error> {
        let (slot, i) = (self.slot, self.i);
        let at = |name: &str| format!("buckets[{i}].{name}");
        let mut b = RawBucket::default();
        while let Some(field) = map.next_key::<Field>()? {
            let uint = |r: Result<Option<u64>, A::Error>, name: &str| {
                r.map_err(|e| slot.note(|| at(name), "must be a non-negative integer", e))
            };
            match field {
                Field::Key => {
                    b.key = map
                        .next_value::<Option<String>>()
                        .map_err(|e| slot.note(|| at("key"), "must be a string", e))?
                }
                Field::Capacity => b.capacity = uint(map.next_value(), "capacity")?,
                Field::Rate => b.rate = uint(map.next_value(), "rate")?,
                Field::PeriodMs => b.period_ms = uint(map.next_value(), "period_ms")?,
                Field::Cost => b.cost = uint(map.next_value(), "cost")?,
                Field::Lease => b.lease = uint(map.next_value(), "lease")?,
                Field::Rule => {
                    b.rule = map
                        .next_value::<Option<String>>()
                        .map_err(|e| slot.note(|| at("rule"), "must be a string", e))?
                }
                Field::Algorithm => {
                    b.algorithm = map
                        .next_value::<Option<Alg>>()
                        .map_err(|e| {
                            let expected = format!("must be {}", Algorithm::expected());
                            slot.note(|| at("algorithm"), &expected, e)
                        })?
                        .map(|a| a.0)
                }
                Field::Buckets | Field::Takes | Field::Instance => {
                    return Err(slot.set(|| at(&field_name(&field)), "unknown field"))
                }
                Field::Unknown(name) => return Err(slot.set(|| at(&name), "unknown field")),
            }
        }
        Ok(b)
    }
}

struct Alg(Algorithm);

impl<'de> Deserialize<'de> for Alg {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Alg;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an algorithm name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Alg, E> {
                Algorithm::from_name(v)
                    .map(Alg)
                    .ok_or_else(|| E::custom("unknown algorithm"))
            }
        }
        d.deserialize_str(V)
    }
}

/// A request bucket as JSON (absent fields omitted).
#[derive(Debug, Serialize)]
struct JsonBucket<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    capacity: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rate: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    period_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cost: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    algorithm: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lease: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rule: Option<&'a str>,
}

/// Encodes a request (used by tests and the load generator).
pub fn encode_request(raw: &RawTake) -> Value {
    let buckets: Vec<JsonBucket<'_>> = raw
        .buckets
        .iter()
        .flatten()
        .map(|b| JsonBucket {
            key: b.key.as_deref(),
            capacity: b.capacity,
            rate: b.rate,
            period_ms: b.period_ms,
            cost: b.cost,
            algorithm: b.algorithm.map(Algorithm::name),
            lease: b.lease,
            rule: b.rule.as_deref(),
        })
        .collect();
    let mut v = serde_json::json!({ "buckets": buckets });
    if let (Some(id), Some(o)) = (&raw.instance, v.as_object_mut()) {
        o.insert("instance".into(), Value::from(id.as_str()));
    }
    v
}

/// Encodes a batch request (used by tests and the load generator).
pub fn encode_batch_request(raw: &RawBatch) -> Value {
    let takes: Vec<Value> = raw.takes.iter().flatten().map(encode_request).collect();
    let mut v = serde_json::json!({ "takes": takes });
    if let (Some(id), Some(o)) = (&raw.instance, v.as_object_mut()) {
        o.insert("instance".into(), Value::from(id.as_str()));
    }
    v
}

/// The error body: `{"error": {"code", "field", "message"}}`.
pub fn error_body(code: &str, field: Option<&str>, message: &str) -> Value {
    let mut e = Map::new();
    e.insert("code".into(), Value::from(code));
    if let Some(f) = field {
        e.insert("field".into(), Value::from(f));
    }
    e.insert("message".into(), Value::from(message));
    serde_json::json!({ "error": e })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(body: &str) -> String {
        match decode_take(body.as_bytes()).and_then(crate::domain::validate) {
            Err(e) => e.field,
            Ok(v) => unreachable!("accepted {body}: {v:?}"),
        }
    }

    #[test]
    fn reads_what_the_contract_allows() {
        let ok = |body: &str| match decode_take(body.as_bytes()) {
            Ok(raw) => raw,
            Err(e) => unreachable!("refused {body}: {e}"),
        };
        let raw = ok(
            r#"{"buckets":[{"key":"a\u00e9\"","capacity":10,"rate":5,"period_ms":1000,"cost":2,"algorithm":"fixed_window","lease":3,"rule":"api"}],"instance":"i-1"}"#,
        );
        assert_eq!(
            raw.buckets,
            Some(vec![RawBucket {
                key: Some("a\u{e9}\"".into()),
                capacity: Some(10),
                rate: Some(5),
                period_ms: Some(1000),
                cost: Some(2),
                algorithm: Some(Algorithm::FixedWindow),
                lease: Some(3),
                rule: Some("api".into()),
            }])
        );
        assert_eq!(raw.instance.as_deref(), Some("i-1"));
        assert_eq!(ok(r#" {"buckets": null} "#).buckets, None);
        assert_eq!(ok("{}").buckets, None);
        assert_eq!(ok(r#"{"buckets":[]}"#).buckets, Some(vec![]));
        assert_eq!(
            ok(r#"{"buckets":[{"key":null,"capacity":null,"rate":null}]}"#).buckets,
            Some(vec![RawBucket::default()])
        );
        let last = ok(r#"{"buckets":[{"key":"a","capacity":1,"capacity":2,"period_ms":1}]}"#);
        assert_eq!(last.buckets.unwrap_or_default()[0].capacity, Some(2));
        let sixteen = format!(r#"{{"buckets":[{}]}}"#, vec!["{}"; 16].join(","));
        assert_eq!(ok(&sixteen).buckets.map(|b| b.len()), Some(16));
    }

    fn batch_field_of(body: &str) -> String {
        match decode_batch(body.as_bytes()).and_then(crate::domain::validate_batch) {
            Err(e) => e.field,
            Ok(v) => unreachable!("accepted {body}: {v:?}"),
        }
    }

    #[test]
    fn batches_read_each_take_as_a_take() {
        let take = r#"{"buckets":[{"key":"a","capacity":1,"period_ms":1}]}"#;
        let body = format!(r#"{{"takes":[{take},{take}]}}"#);
        let raw = decode_batch(body.as_bytes()).unwrap_or_else(|e| unreachable!("{e}"));
        let one = decode_take(take.as_bytes()).unwrap_or_else(|e| unreachable!("{e}"));
        assert_eq!(raw.takes, Some(vec![one.clone(), one]));
        assert_eq!(
            Some(encode_batch_request(&raw)),
            serde_json::from_str::<Value>(&body).ok()
        );
        assert_eq!(batch_field_of("{}"), "takes");
        assert_eq!(batch_field_of(r#"{"takes":[]}"#), "takes");
        assert_eq!(batch_field_of(r#"{"takes":3}"#), "takes");
        assert_eq!(batch_field_of(r#"{"buckets":[]}"#), "buckets");
        assert_eq!(
            batch_field_of(&format!(r#"{{"takes":[{take},7]}}"#)),
            "takes[1]"
        );
        assert_eq!(
            batch_field_of(&format!(r#"{{"takes":[{take},{{}}]}}"#)),
            "takes[1].buckets"
        );
        assert_eq!(
            batch_field_of(&format!(
                r#"{{"takes":[{take},{take},{take},{{"buckets":[{{"key":"a","capacity":0,"period_ms":1}}]}}]}}"#
            )),
            "takes[3].buckets[0].capacity"
        );
        assert_eq!(
            batch_field_of(
                r#"{"takes":[{"buckets":[{"key":"a","capacity":1,"period_ms":1,"x":1}]}]}"#
            ),
            "takes[0].buckets[0].x"
        );
        assert_eq!(batch_field_of(&format!(r#"{{"takes":[{take}] x"#)), "");
    }

    #[test]
    fn stops_at_the_sixty_fifth_take() {
        let take = r#"{"buckets":[{"key":"a","capacity":1,"period_ms":1}]}"#;
        let ok = format!(r#"{{"takes":[{}]}}"#, vec![take; 64].join(","));
        assert_eq!(
            decode_batch(ok.as_bytes()).map(|b| b.takes.map(|t| t.len())),
            Ok(Some(64))
        );
        // Garbage after the 65th `{` is never reached.
        let body = format!(r#"{{"takes":[{},{{"#, vec![take; 64].join(","));
        let e = decode_batch(body.as_bytes()).err();
        assert_eq!(e.as_ref().map(|e| e.field.as_str()), Some("takes"), "{e:?}");
        assert!(e.is_some_and(|e| e.message.contains("at most 64")));
    }

    #[test]
    fn stops_at_the_seventeenth_bucket() {
        // The rest of the body is never read: even garbage after the 17th `{` is not reached.
        let body = format!(r#"{{"buckets":[{},{{"#, vec!["{}"; 16].join(","));
        let e = decode_take(body.as_bytes()).err();
        assert_eq!(
            e.as_ref().map(|e| e.field.as_str()),
            Some("buckets"),
            "{e:?}"
        );
        assert!(e.is_some_and(|e| e.message.contains("at most 16")));
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(field_of("{"), "");
        assert_eq!(field_of("[]"), "");
        assert_eq!(field_of(r#"{"bucket": []}"#), "bucket");
        assert_eq!(field_of(r#"{"buckets": 1}"#), "buckets");
        assert_eq!(field_of(r#"{}"#), "buckets");
        assert_eq!(
            field_of(r#"{"buckets": [{"key":"a","capacity":1,"period_ms":1,"extra":1}]}"#),
            "buckets[0].extra"
        );
        assert_eq!(
            field_of(r#"{"buckets": [{"key":"a","capacity":-1,"period_ms":1}]}"#),
            "buckets[0].capacity"
        );
        assert_eq!(
            field_of(r#"{"buckets": [{"key":"a","capacity":1.5,"period_ms":1}]}"#),
            "buckets[0].capacity"
        );
        assert_eq!(
            field_of(r#"{"buckets": [{"key":"a","capacity":1,"period_ms":1,"algorithm":"gcra"}]}"#),
            "buckets[0].algorithm"
        );
        assert_eq!(
            field_of(r#"{"buckets": [{"key":5,"capacity":1,"period_ms":1}]}"#),
            "buckets[0].key"
        );
        assert_eq!(
            field_of(r#"{"buckets": [{"key":"a","capacity":1,"period_ms":1}, 3]}"#),
            "buckets[1]"
        );
        assert_eq!(field_of(r#"{"buckets":[["a",1,1]]}"#), "buckets[0]");
        assert_eq!(
            field_of(r#"{"buckets":[{"key":"a","capacity":"x","capacity":2,"period_ms":1}]}"#),
            "buckets[0].capacity"
        );
        assert_eq!(
            field_of(r#"{"buckets":[{"key":"a","capacity":1,"period_ms":1}]} x"#),
            ""
        );
        assert_eq!(field_of(r#"{"buckets":[{"key":"a\q"}]}"#), "");
    }
}
