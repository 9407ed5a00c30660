//! The JSON form of a take and its answer (`POST /v1/take`, `POST /v1/take_batch`).
//!
//! A take is written by hand (no serde derive: the filter's module would pay for it); an answer
//! is read through `serde_json::Value`, whose error paths cost the module far less than a
//! derive's (about 20 KiB less). The service reads takes with its own field-naming decoder over
//! [`crate::fields`] and writes answers with serde (feature `serde`).

use std::fmt::Write as _;

use serde_json::Value;

use crate::calendar::{self, Calendar, Unit};
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

/// A calendar window's `calendar` and `time_zone` (left out when UTC), after other fields.
pub(crate) fn push_calendar(s: &mut String, c: &Calendar) {
    push_name(s, fields::CALENDAR, false);
    push_string(s, c.unit.name());
    if c.zone != calendar::UTC {
        push_name(s, fields::TIME_ZONE, false);
        push_string(s, &c.zone);
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
        if b.max_delay_ms > 0 {
            push_u64(s, fields::MAX_DELAY_MS, b.max_delay_ms);
        }
        if let Some(c) = &b.calendar {
            push_calendar(s, c);
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
        .ok_or_else(|| missing_list(fields::BUCKETS))
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
            max_delay_ms: opt(b, fields::MAX_DELAY_MS)?.unwrap_or(0),
            calendar: match b.get(fields::CALENDAR) {
                None => None,
                Some(u) => Some(Calendar {
                    unit: u
                        .as_str()
                        .and_then(Unit::from_name)
                        .ok_or_else(|| DecodeError(format!("unknown calendar {u}")))?,
                    zone: b
                        .get(fields::TIME_ZONE)
                        .and_then(Value::as_str)
                        .unwrap_or(calendar::UTC)
                        .to_string(),
                }),
            },
        });
    }
    Ok(TakeRequest { buckets })
}

#[cfg(test)]
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
/// to 0; unknown fields are ignored (a newer service may add some). Read by one serde visitor
/// ([`Read`]) into the fields an answer holds, so no `serde_json::Value` tree is built for it:
/// every exact decision over HTTP reads one. [`read_answer`], through `Value`, is the reference
/// it is tested against.
pub fn decode_answer(body: &[u8]) -> Result<TakeResponse, DecodeError> {
    match read(body, Want::Answer)? {
        Got::Answer(a) => a.answer(),
        _ => Err(missing_allowed()),
    }
}

/// Decodes a batch answer (`{"results": [...]}`): one answer per take, in order.
pub fn decode_batch_answer(body: &[u8]) -> Result<Vec<TakeResponse>, DecodeError> {
    let Got::Batch(Some(list)) = read(body, Want::Batch)? else {
        return Err(missing_list(fields::RESULTS));
    };
    list.into_iter()
        .map(|a| match a {
            Got::Answer(a) => a.answer(),
            _ => Err(missing_allowed()),
        })
        .collect()
}

fn read(body: &[u8], want: Want) -> Result<Got, DecodeError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde::de::DeserializeSeed::deserialize(Read(want), &mut de)
        .and_then(|g| de.end().map(|()| g))
        .map_err(|e| DecodeError(e.to_string()))
}

fn missing_allowed() -> DecodeError {
    DecodeError(format!("`{}` missing or not a boolean", fields::ALLOWED))
}

fn missing_list(field: &str) -> DecodeError {
    DecodeError(format!("`{field}` missing or not a list"))
}

/// A scalar where an answer holds one, as read: what `serde_json::Value` would have held there,
/// kept only as far as the answer looks at it. Any other value (a string, a list, an object) is
/// `Other`.
#[derive(Clone, Copy, Default, PartialEq)]
enum Scalar {
    #[default]
    Absent,
    Null,
    Bool(bool),
    /// A number `Value::as_u64` reads (a non-negative integer).
    Unsigned(u64),
    Other,
}

impl Scalar {
    fn boolean(self, field: &str) -> Result<bool, DecodeError> {
        match self {
            Scalar::Bool(b) => Ok(b),
            _ => Err(DecodeError(format!("`{field}` missing or not a boolean"))),
        }
    }

    /// An optional non-negative integer (absent or null = 0, as in protobuf).
    fn unsigned(self, field: &str) -> Result<u64, DecodeError> {
        match self {
            Scalar::Absent | Scalar::Null => Ok(0),
            Scalar::Unsigned(n) => Ok(n),
            _ => Err(DecodeError(format!(
                "`{field}` is not a non-negative integer"
            ))),
        }
    }
}

/// What [`Read`] is reading: the shape it expects where it is.
#[derive(Clone, Copy)]
enum Want {
    /// A value the answer holds as a scalar, or one it does not hold at all.
    Scalar,
    /// An answer (`{"allowed": .., "buckets": [..], "instances": ..}`).
    Answer,
    /// A bucket's result.
    Bucket,
    /// A batch answer (`{"results": [..]}`).
    Batch,
    /// A list of answers or buckets.
    List(Element),
}

#[derive(Clone, Copy)]
enum Element {
    Answer,
    Bucket,
}

/// An answer's fields as read (`None` for a list of buckets that is absent or not a list).
#[derive(Default)]
struct RawAnswer {
    allowed: Scalar,
    buckets: Option<Vec<Got>>,
    instances: Scalar,
    delay_ms: Scalar,
}

/// What [`Read`] read. A value of another shape than the one wanted is `Scalar(Other)` (or the
/// scalar it is): what a field holds is judged when the answer is read, after the whole body, so a
/// later duplicate replaces an earlier one as in `Value`'s map.
enum Got {
    Scalar(Scalar),
    Answer(RawAnswer),
    /// A bucket's result: allowed, limit, remaining, reset_ms, retry_after_ms, granted, delay_ms,
    /// window.
    Bucket([Scalar; 8]),
    Batch(Option<Vec<Got>>),
    List(Vec<Got>),
}

impl Got {
    fn scalar(self) -> Scalar {
        match self {
            Got::Scalar(s) => s,
            _ => Scalar::Other,
        }
    }

    fn list(self) -> Option<Vec<Got>> {
        match self {
            Got::List(l) => Some(l),
            _ => None,
        }
    }
}

impl RawAnswer {
    fn answer(self) -> Result<TakeResponse, DecodeError> {
        let allowed = self.allowed.boolean(fields::ALLOWED)?;
        let list = self.buckets.ok_or_else(|| missing_list(fields::BUCKETS))?;
        let mut buckets = Vec::with_capacity(list.len());
        for b in list {
            let Got::Bucket(
                [a, limit, remaining, reset_ms, retry_after_ms, granted, delay_ms, window],
            ) = b
            else {
                return Err(missing_allowed());
            };
            buckets.push(BucketResult {
                allowed: a.boolean(fields::ALLOWED)?,
                limit: limit.unsigned(fields::LIMIT)?,
                remaining: remaining.unsigned(fields::REMAINING)?,
                reset_ms: reset_ms.unsigned(fields::RESET_MS)?,
                retry_after_ms: retry_after_ms.unsigned(fields::RETRY_AFTER_MS)?,
                granted: granted.unsigned(fields::GRANTED)?,
                delay_ms: delay_ms.unsigned(fields::DELAY_MS)?,
                window: window.unsigned(fields::WINDOW)?,
            });
        }
        Ok(TakeResponse {
            allowed,
            buckets,
            // A count that is not a number is no count (as protobuf's absent field).
            instances: self.instances.unsigned(fields::INSTANCES).unwrap_or(0),
            delay_ms: self.delay_ms.unsigned(fields::DELAY_MS)?,
        })
    }
}

/// The names of a bucket's result, in the order of [`Got::Bucket`].
const BUCKET_FIELDS: [&str; 8] = [
    fields::ALLOWED,
    fields::LIMIT,
    fields::REMAINING,
    fields::RESET_MS,
    fields::RETRY_AFTER_MS,
    fields::GRANTED,
    fields::DELAY_MS,
    fields::WINDOW,
];

/// The one visitor of an answer, at every level: it reads every value, those the answer does not
/// hold too (as [`Scalar::Other`], not passed over with serde's `IgnoredAny`, so their strings are
/// checked as `Value` checks them: escapes, UTF-8). One visitor type, so the module carries
/// serde_json's reader once for it.
struct Read(Want);

impl<'de> serde::de::DeserializeSeed<'de> for Read {
    type Value = Got;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Got, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Read {
    type Value = Got;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, b: bool) -> Result<Got, E> {
        Ok(Got::Scalar(Scalar::Bool(b)))
    }
    fn visit_u64<E>(self, n: u64) -> Result<Got, E> {
        Ok(Got::Scalar(Scalar::Unsigned(n)))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Got, E> {
        // serde_json hands non-negative integers to visit_u64; `Value::as_u64` reads no other.
        Ok(Got::Scalar(
            u64::try_from(n).map_or(Scalar::Other, Scalar::Unsigned),
        ))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Got, E> {
        Ok(Got::Scalar(Scalar::Other))
    }
    fn visit_str<E>(self, _: &str) -> Result<Got, E> {
        Ok(Got::Scalar(Scalar::Other))
    }
    fn visit_unit<E>(self) -> Result<Got, E> {
        Ok(Got::Scalar(Scalar::Null))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Got, A::Error> {
        let element = match self.0 {
            Want::List(Element::Answer) => Want::Answer,
            Want::List(Element::Bucket) => Want::Bucket,
            _ => Want::Scalar,
        };
        let mut out = Vec::new();
        while let Some(g) = a.next_element_seed(Read(element))? {
            if matches!(self.0, Want::List(_)) {
                out.push(g);
            }
        }
        Ok(match self.0 {
            Want::List(_) => Got::List(out),
            _ => Got::Scalar(Scalar::Other),
        })
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Got, A::Error> {
        let mut answer = RawAnswer::default();
        let mut bucket = [Scalar::Absent; 8];
        let mut results = None;
        while let Some(key) = a.next_key::<Key<'de>>()? {
            let key: &str = &key.0;
            match self.0 {
                Want::Answer if key == fields::ALLOWED => {
                    answer.allowed = a.next_value_seed(Read(Want::Scalar))?.scalar();
                }
                Want::Answer if key == fields::INSTANCES => {
                    answer.instances = a.next_value_seed(Read(Want::Scalar))?.scalar();
                }
                Want::Answer if key == fields::DELAY_MS => {
                    answer.delay_ms = a.next_value_seed(Read(Want::Scalar))?.scalar();
                }
                Want::Answer if key == fields::BUCKETS => {
                    answer.buckets = a.next_value_seed(Read(Want::List(Element::Bucket)))?.list();
                }
                Want::Batch if key == fields::RESULTS => {
                    results = a.next_value_seed(Read(Want::List(Element::Answer)))?.list();
                }
                Want::Bucket => {
                    let v = a.next_value_seed(Read(Want::Scalar))?.scalar();
                    if let Some(slot) = BUCKET_FIELDS
                        .iter()
                        .position(|n| *n == key)
                        .and_then(|i| bucket.get_mut(i))
                    {
                        *slot = v;
                    }
                }
                _ => {
                    a.next_value_seed(Read(Want::Scalar))?;
                }
            }
        }
        Ok(match self.0 {
            Want::Answer => Got::Answer(answer),
            Want::Bucket => Got::Bucket(bucket),
            Want::Batch => Got::Batch(results),
            _ => Got::Scalar(Scalar::Other),
        })
    }
}

/// A key, borrowed when it holds no escape.
struct Key<'a>(std::borrow::Cow<'a, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a key")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(std::borrow::Cow::Borrowed(s)))
            }
            fn visit_str<E>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key(std::borrow::Cow::Owned(s.to_string())))
            }
        }
        d.deserialize_str(V)
    }
}

/// [`decode_answer`] through `serde_json::Value`: the reference reading.
#[cfg(test)]
pub(crate) fn read_answer(body: &[u8]) -> Result<TakeResponse, DecodeError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| DecodeError(e.to_string()))?;
    answer(&v)
}

/// [`decode_batch_answer`] through `serde_json::Value`: the reference reading.
#[cfg(test)]
pub(crate) fn read_batch_answer(body: &[u8]) -> Result<Vec<TakeResponse>, DecodeError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| DecodeError(e.to_string()))?;
    v.get(fields::RESULTS)
        .and_then(Value::as_array)
        .ok_or_else(|| DecodeError(format!("`{}` missing or not a list", fields::RESULTS)))?
        .iter()
        .map(answer)
        .collect()
}

#[cfg(test)]
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
            delay_ms: json_u64(b, fields::DELAY_MS)?,
            window: json_u64(b, fields::WINDOW)?,
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
        delay_ms: json_u64(v, fields::DELAY_MS)?,
    })
}
