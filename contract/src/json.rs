//! The JSON form of a take and its answer (`POST /v1/take`, `POST /v1/take_batch`).
//!
//! A take is written by hand (no serde derive: the filter's module would pay for it); an answer
//! is read through `serde_json::Value`, whose error paths cost the module far less than a
//! derive's (about 20 KiB less). The service reads takes with its own field-naming decoder over
//! [`crate::fields`] and writes answers with serde (feature `serde`).

use std::fmt::Write as _;

use serde_json::Value;

use crate::fields;
use crate::take::{Bucket, BucketResult, DecodeError, Sender, TakeRequest, TakeResponse};
use crate::Algorithm;

/// Appends `s` as a JSON string literal.
pub fn push_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Appends `"name":` (after a comma unless `first`). Every encoder of the contract writes its
/// fields with this and [`push_u64`].
pub(crate) fn push_name(out: &mut String, name: &str, first: bool) {
    if !first {
        out.push(',');
    }
    out.push('"');
    out.push_str(name);
    out.push_str("\":");
}

/// Appends `,"name":v`.
pub(crate) fn push_u64(out: &mut String, name: &str, v: u64) {
    push_name(out, name, false);
    let _ = write!(out, "{v}");
}

/// Encodes a take. Absent optional fields are omitted; the sender's instance id and rule names
/// are added when it has them.
pub fn encode_take(req: &TakeRequest, sender: &Sender<'_>) -> Vec<u8> {
    let mut s = String::with_capacity(64 + 128 * req.buckets.len());
    push_take(&mut s, req, sender);
    push_instance(&mut s, sender);
    s.push('}');
    s.into_bytes()
}

/// Encodes a batch of takes (`{"takes": [...]}`); the instance id is sent once, for all.
pub fn encode_batch(takes: &[&TakeRequest], sender: &Sender<'_>) -> Vec<u8> {
    let mut s = String::with_capacity(16 + 160 * takes.len());
    s.push('{');
    push_name(&mut s, fields::TAKES, true);
    s.push('[');
    for (i, t) in takes.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        push_take(&mut s, t, sender);
        s.push('}');
    }
    s.push(']');
    push_instance(&mut s, sender);
    s.push('}');
    s.into_bytes()
}

/// `,"instance":"<id>"` when the sender has one.
fn push_instance(s: &mut String, sender: &Sender<'_>) {
    if let Some(id) = sender.instance {
        push_name(s, fields::INSTANCE, false);
        push_string(s, id);
    }
}

/// A take's object without its closing brace (the caller may add `instance`).
fn push_take(s: &mut String, req: &TakeRequest, sender: &Sender<'_>) {
    s.push('{');
    push_name(s, fields::BUCKETS, true);
    s.push('[');
    for (i, b) in req.buckets.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push('{');
        push_name(s, fields::KEY, true);
        push_string(s, &b.key);
        push_u64(s, fields::CAPACITY, b.capacity);
        if let Some(r) = b.rate {
            push_u64(s, fields::RATE, r);
        }
        push_u64(s, fields::PERIOD_MS, b.period_ms);
        if let Some(c) = b.cost {
            push_u64(s, fields::COST, c);
        }
        if let Some(a) = b.algorithm {
            push_name(s, fields::ALGORITHM, false);
            push_string(s, a.name());
        }
        if let Some(l) = b.lease {
            push_u64(s, fields::LEASE, l);
        }
        if let Some(r) = (sender.rule)(b) {
            push_name(s, fields::RULE, false);
            push_string(s, r);
        }
        s.push('}');
    }
    s.push(']');
}

/// The `buckets` list of a take or an answer.
fn buckets_of(v: &Value) -> Result<&Vec<Value>, DecodeError> {
    v.get(fields::BUCKETS)
        .and_then(Value::as_array)
        .ok_or_else(|| DecodeError(format!("`{}` missing or not a list", fields::BUCKETS)))
}

/// Reads a take back from its JSON form, as [`encode_take`] writes it (for tests and tools: the
/// service reads takes with its own decoder, which names the field of every error). The
/// sender's `instance` and `rule` are not part of the [`TakeRequest`] and are passed over.
pub fn read_take(v: &Value) -> Result<TakeRequest, DecodeError> {
    let opt = |b: &Value, field: &str| match b.get(field) {
        None => Ok(None),
        Some(_) => json_u64(b, field).map(Some),
    };
    let list = buckets_of(v)?;
    let mut buckets = Vec::with_capacity(list.len());
    for b in list {
        let algorithm = match b.get(fields::ALGORITHM) {
            None => None,
            Some(a) => Some(
                a.as_str()
                    .and_then(Algorithm::from_name)
                    .ok_or_else(|| DecodeError(format!("unknown algorithm {a}")))?,
            ),
        };
        buckets.push(Bucket {
            key: b
                .get(fields::KEY)
                .and_then(Value::as_str)
                .ok_or_else(|| DecodeError(format!("`{}` missing", fields::KEY)))?
                .to_string(),
            capacity: json_u64(b, fields::CAPACITY)?,
            rate: opt(b, fields::RATE)?,
            period_ms: json_u64(b, fields::PERIOD_MS)?,
            cost: opt(b, fields::COST)?,
            algorithm,
            lease: opt(b, fields::LEASE)?,
        });
    }
    Ok(TakeRequest { buckets })
}

fn json_bool(v: &Value, field: &str) -> Result<bool, DecodeError> {
    v.get(field)
        .and_then(Value::as_bool)
        .ok_or_else(|| DecodeError(format!("`{field}` missing or not a boolean")))
}

/// An optional non-negative integer (absent = 0, as in protobuf).
fn json_u64(v: &Value, field: &str) -> Result<u64, DecodeError> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(0),
        Some(x) => x
            .as_u64()
            .ok_or_else(|| DecodeError(format!("`{field}` is not a non-negative integer"))),
    }
}

/// Decodes an answer. `allowed` is required at both levels, and `buckets`; the numbers default
/// to 0; unknown fields are ignored (a newer service may add some).
pub fn decode_answer(body: &[u8]) -> Result<TakeResponse, DecodeError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| DecodeError(e.to_string()))?;
    answer(&v)
}

/// Decodes a batch answer (`{"results": [...]}`): one answer per take, in order.
pub fn decode_batch_answer(body: &[u8]) -> Result<Vec<TakeResponse>, DecodeError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| DecodeError(e.to_string()))?;
    v.get(fields::RESULTS)
        .and_then(Value::as_array)
        .ok_or_else(|| DecodeError(format!("`{}` missing or not a list", fields::RESULTS)))?
        .iter()
        .map(answer)
        .collect()
}

fn answer(v: &Value) -> Result<TakeResponse, DecodeError> {
    let allowed = json_bool(v, fields::ALLOWED)?;
    let list = buckets_of(v)?;
    let mut buckets = Vec::with_capacity(list.len());
    for b in list {
        buckets.push(BucketResult {
            allowed: json_bool(b, fields::ALLOWED)?,
            limit: json_u64(b, fields::LIMIT)?,
            remaining: json_u64(b, fields::REMAINING)?,
            reset_ms: json_u64(b, fields::RESET_MS)?,
            retry_after_ms: json_u64(b, fields::RETRY_AFTER_MS)?,
            granted: json_u64(b, fields::GRANTED)?,
        });
    }
    // A count that is not a number is no count (as protobuf's absent field).
    let instances = v
        .get(fields::INSTANCES)
        .and_then(Value::as_u64)
        .unwrap_or(0);
    Ok(TakeResponse {
        allowed,
        buckets,
        instances,
    })
}
