//! The JSON form of the contract. Decoding walks a `serde_json::Value` by hand so every error
//! names its field (`buckets[0].capacity`) and unknown fields are refused; encoding uses serde. A
//! response body is the serde form of [`crate::domain::TakeDecision`].

use serde::Serialize;
use serde_json::{Map, Value};

use crate::domain::{Algorithm, InvalidArgument, RawBucket, RawTake};

/// The JSON spelling of an algorithm.
pub fn algorithm_name(a: Algorithm) -> &'static str {
    match a {
        Algorithm::TokenBucket => "token_bucket",
        Algorithm::FixedWindow => "fixed_window",
    }
}

fn no_unknown(obj: &Map<String, Value>, known: &[&str], at: &str) -> Result<(), InvalidArgument> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(InvalidArgument::new(format!("{at}{k}"), "unknown field")),
        None => Ok(()),
    }
}

fn uint(obj: &Map<String, Value>, name: &str, at: &str) -> Result<Option<u64>, InvalidArgument> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            InvalidArgument::new(format!("{at}{name}"), "must be a non-negative integer")
        }),
    }
}

/// Decodes a `POST /v1/take` body.
pub fn decode_request(body: &[u8]) -> Result<RawTake, InvalidArgument> {
    // The common case, a well-formed take, is read straight into its fields, without a `Value`
    // tree (a map and a string per field). Whatever that reader refuses goes through the walk over
    // a `Value` below, which names the offending field: the answer for any body is the walk's.
    if let Ok(fast::Take(raw)) = serde_json::from_slice::<fast::Take>(body) {
        return Ok(raw);
    }
    decode_value(body)
}

/// The field-by-field decoding over a `serde_json::Value`: the reference for every body.
fn decode_value(body: &[u8]) -> Result<RawTake, InvalidArgument> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| InvalidArgument::new("", format!("malformed JSON: {e}")))?;
    let Value::Object(obj) = v else {
        return Err(InvalidArgument::new("", "the body must be a JSON object"));
    };
    no_unknown(&obj, &["buckets"], "")?;
    let buckets = match obj.get("buckets") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let at = format!("buckets[{i}].");
                let Value::Object(b) = item else {
                    return Err(InvalidArgument::new(
                        format!("buckets[{i}]"),
                        "must be an object",
                    ));
                };
                no_unknown(
                    b,
                    &[
                        "key",
                        "capacity",
                        "rate",
                        "period_ms",
                        "cost",
                        "algorithm",
                        "lease",
                    ],
                    &at,
                )?;
                let key = match b.get("key") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(_) => {
                        return Err(InvalidArgument::new(format!("{at}key"), "must be a string"))
                    }
                };
                let algorithm = match b.get("algorithm") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) if s == "token_bucket" => Some(Algorithm::TokenBucket),
                    Some(Value::String(s)) if s == "fixed_window" => Some(Algorithm::FixedWindow),
                    Some(_) => {
                        return Err(InvalidArgument::new(
                            format!("{at}algorithm"),
                            "must be \"token_bucket\" or \"fixed_window\"",
                        ))
                    }
                };
                out.push(RawBucket {
                    key,
                    capacity: uint(b, "capacity", &at)?,
                    rate: uint(b, "rate", &at)?,
                    period_ms: uint(b, "period_ms", &at)?,
                    cost: uint(b, "cost", &at)?,
                    algorithm,
                    lease: uint(b, "lease", &at)?,
                });
            }
            Some(out)
        }
        Some(_) => return Err(InvalidArgument::new("buckets", "must be a list")),
    };
    Ok(RawTake { buckets })
}

/// A take read without building a `Value` tree, accepting exactly what [`decode_value`] accepts
/// and with the same result: objects only (never the array form serde allows for structs), no
/// unknown field, `null` as absent, integers that fit a `u64`, the two algorithm names, and the
/// last of repeated fields (as a `Value` map keeps it). Anything else is an error, and the caller
/// then asks [`decode_value`].
mod fast {
    use std::fmt;

    use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};

    use crate::domain::{Algorithm, RawBucket, RawTake};

    pub(super) struct Take(pub(super) RawTake);
    struct Bucket(RawBucket);
    struct Alg(Algorithm);

    enum Field {
        Buckets,
        Key,
        Capacity,
        Rate,
        PeriodMs,
        Cost,
        Algorithm,
        Lease,
        Unknown,
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
                        "buckets" => Field::Buckets,
                        "key" => Field::Key,
                        "capacity" => Field::Capacity,
                        "rate" => Field::Rate,
                        "period_ms" => Field::PeriodMs,
                        "cost" => Field::Cost,
                        "algorithm" => Field::Algorithm,
                        "lease" => Field::Lease,
                        _ => Field::Unknown,
                    })
                }
            }
            d.deserialize_identifier(V)
        }
    }

    fn unknown<E: de::Error>() -> E {
        E::custom("unknown field")
    }

    impl<'de> Deserialize<'de> for Take {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Take;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a take")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Take, A::Error> {
                    let mut buckets = None;
                    while let Some(field) = map.next_key::<Field>()? {
                        match field {
                            Field::Buckets => {
                                buckets = map
                                    .next_value::<Option<Vec<Bucket>>>()?
                                    .map(|v| v.into_iter().map(|b| b.0).collect())
                            }
                            _ => return Err(unknown()),
                        }
                    }
                    Ok(Take(RawTake { buckets }))
                }
            }
            d.deserialize_map(V)
        }
    }

    impl<'de> Deserialize<'de> for Bucket {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Bucket;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a bucket")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Bucket, A::Error> {
                    let mut b = RawBucket::default();
                    while let Some(field) = map.next_key::<Field>()? {
                        match field {
                            Field::Key => b.key = map.next_value()?,
                            Field::Capacity => b.capacity = map.next_value()?,
                            Field::Rate => b.rate = map.next_value()?,
                            Field::PeriodMs => b.period_ms = map.next_value()?,
                            Field::Cost => b.cost = map.next_value()?,
                            Field::Algorithm => {
                                b.algorithm = map.next_value::<Option<Alg>>()?.map(|a| a.0)
                            }
                            Field::Lease => b.lease = map.next_value()?,
                            Field::Buckets | Field::Unknown => return Err(unknown()),
                        }
                    }
                    Ok(Bucket(b))
                }
            }
            d.deserialize_map(V)
        }
    }

    impl<'de> Deserialize<'de> for Alg {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl Visitor<'_> for V {
                type Value = Alg;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("an algorithm name")
                }
                fn visit_str<E: de::Error>(self, v: &str) -> Result<Alg, E> {
                    match v {
                        "token_bucket" => Ok(Alg(Algorithm::TokenBucket)),
                        "fixed_window" => Ok(Alg(Algorithm::FixedWindow)),
                        _ => Err(E::custom("unknown algorithm")),
                    }
                }
            }
            d.deserialize_str(V)
        }
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
            algorithm: b.algorithm.map(algorithm_name),
            lease: b.lease,
        })
        .collect();
    serde_json::json!({ "buckets": buckets })
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
        match decode_request(body.as_bytes()).and_then(crate::domain::validate) {
            Err(e) => e.field,
            Ok(v) => unreachable!("accepted {body}: {v:?}"),
        }
    }

    #[test]
    fn the_fast_reader_agrees_with_the_walk() {
        let bodies = [
            r#"{"buckets":[{"key":"a","capacity":1,"period_ms":1}]}"#,
            r#"{"buckets":[{"key":"a\u00e9\"","capacity":10,"rate":5,"period_ms":1000,"cost":2,"algorithm":"fixed_window","lease":3}]}"#,
            r#"{"buckets":[{"key":"a","capacity":1,"period_ms":1,"algorithm":"token_bucket"},{"key":"b","capacity":2,"period_ms":2,"lease":null}]}"#,
            r#" {"buckets": null} "#,
            r#"{}"#,
            r#"{"buckets":[]}"#,
            r#"{"buckets":[{"key":null,"capacity":null,"rate":null}]}"#,
            r#"{"buckets":[{"key":"a","capacity":1,"capacity":2,"period_ms":1}]}"#,
            r#"{"buckets":[{"key":"a","capacity":"x","capacity":2,"period_ms":1}]}"#,
            r#"{"buckets":[],"buckets":[{"key":"a","capacity":2,"period_ms":1}]}"#,
            r#"{"buckets":[["a",1,1,1,1,null,null]]}"#,
            r#"[[{"key":"a","capacity":1,"period_ms":1}]]"#,
            r#"{"buckets":[{"key":"a","capacity":1.0,"period_ms":1}]}"#,
            r#"{"buckets":[{"key":"a","capacity":-0,"period_ms":1}]}"#,
            r#"{"buckets":[{"key":"a","capacity":18446744073709551616,"period_ms":1}]}"#,
            r#"{"buckets":[{"key":"a","capacity":1,"period_ms":1,"algorithm":"gcra"}]}"#,
            r#"{"buckets":[{"key":"a","capacity":1,"period_ms":1,"x":1}]}"#,
            r#"{"buckets":[{"key":"a","capacity":1,"period_ms":1}],"x":1}"#,
            r#"{"buckets":[{"key":"a","capacity":1,"period_ms":1}]} x"#,
            r#"{"buckets":[{"key":5,"capacity":1,"period_ms":1}]}"#,
        ];
        for body in bodies {
            assert_eq!(
                decode_request(body.as_bytes()),
                decode_value(body.as_bytes()),
                "{body}"
            );
        }
        assert!(serde_json::from_str::<fast::Take>(bodies[0]).is_ok());
        assert!(serde_json::from_str::<fast::Take>(bodies[7]).is_ok());
        assert!(serde_json::from_str::<fast::Take>(bodies[10]).is_err());
        assert!(serde_json::from_str::<fast::Take>(bodies[11]).is_err());
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
    }
}
