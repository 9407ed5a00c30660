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
