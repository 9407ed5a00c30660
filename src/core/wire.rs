//! The wire contract codec (contract/README.md, contract/tollgate.proto): a `TakeRequest` out, a
//! `TakeResponse` back, as JSON for the HTTP transport or protobuf for gRPC.
//!
//! The protobuf codec is hand-written (a varint and length-delimited encoder and a skipping
//! decoder): the messages are tiny and fixed, and a generated codec would cost more bytes in the
//! module than the whole filter logic. Both encodings are tested byte for byte against
//! contract/fixtures/cases.json, the same fixtures the service is tested with.

use crate::core::config::Algorithm;
use serde_json::Value as Json;
use std::fmt::Write as _;

/// One bucket of a take request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Bucket key (1..=4096 bytes of UTF-8).
    pub key: String,
    /// Burst size.
    pub capacity: u64,
    /// Tokens per period; `None` = capacity (not encoded).
    pub rate: Option<u64>,
    /// Period length in ms.
    pub period_ms: u64,
    /// Tokens to take; `None` = 1 (not encoded).
    pub cost: Option<u64>,
    /// `None` = token bucket (not encoded).
    pub algorithm: Option<Algorithm>,
    /// Lease mode: ask for up to this many tokens at once (`cost..=1e9`); `None` = take exactly
    /// `cost` (not encoded).
    pub lease: Option<u64>,
}

/// The request: take from every bucket, or from none.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TakeRequest {
    /// 1..=16 buckets.
    pub buckets: Vec<Bucket>,
}

/// The result for one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BucketResult {
    /// This bucket alone could pay.
    pub allowed: bool,
    /// The bucket's capacity.
    pub limit: u64,
    /// Whole tokens left.
    pub remaining: u64,
    /// ms until full (token bucket) or until the window ends (fixed window).
    pub reset_ms: u64,
    /// When denied: ms until it could pay; 0 otherwise.
    pub retry_after_ms: u64,
    /// Tokens charged to this bucket by this decision: 0 when denied, `cost` without a lease,
    /// `cost..=lease` with one (0 from a service that predates lease mode).
    pub granted: u64,
}

/// The response.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TakeResponse {
    /// Every bucket could pay, and all were charged.
    pub allowed: bool,
    /// One result per request bucket, in request order.
    pub buckets: Vec<BucketResult>,
}

/// A body that is not a valid response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

/// The JSON name of an algorithm (the contract's).
pub(crate) fn algorithm_name(a: Algorithm) -> &'static str {
    a.name()
}

/// Appends `s` as a JSON string literal.
pub(crate) fn push_json_string(out: &mut String, s: &str) {
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

/// The rule name a bucket is sent with: its key's leading part (keys are `<rule>|<part>...`,
/// `crate::core::rules::keys`), when that is a valid rule name. Only a VM with an instance id
/// sends rule names ([`crate::core::instance`]), so the codec's tests encode the fixtures as they
/// stand.
fn rule_of(key: &str) -> Option<&str> {
    let name = key.split('|').next()?;
    let ok = !name.is_empty()
        && name.len() <= crate::core::config::MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b));
    ok.then_some(name)
}

/// Encodes a request as JSON (`POST /v1/take`). Absent optional fields are omitted. A VM with an
/// instance id adds it and each bucket's rule name ([`crate::core::instance`]).
pub fn encode_json(req: &TakeRequest) -> Vec<u8> {
    let mut s = String::with_capacity(64 + 128 * req.buckets.len());
    crate::core::instance::with_id(|id| {
        push_json_take(&mut s, req, id.is_some());
        push_json_instance(&mut s, id);
    });
    s.push('}');
    s.into_bytes()
}

/// `,"instance":"<id>"` when there is one.
fn push_json_instance(s: &mut String, id: Option<&str>) {
    if let Some(id) = id {
        s.push_str(",\"instance\":");
        push_json_string(s, id);
    }
}

/// Encodes a batch of takes as JSON (`POST /v1/take_batch`: `{"takes": [...]}`).
pub fn encode_batch_json(takes: &[&TakeRequest]) -> Vec<u8> {
    let mut s = String::with_capacity(16 + 160 * takes.len());
    s.push_str("{\"takes\":[");
    crate::core::instance::with_id(|id| {
        for (i, t) in takes.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            push_json_take(&mut s, t, id.is_some());
            s.push('}');
        }
        s.push(']');
        push_json_instance(&mut s, id);
    });
    s.push('}');
    s.into_bytes()
}

/// A take's object without its closing brace (the caller may add `instance`).
fn push_json_take(s: &mut String, req: &TakeRequest, rules: bool) {
    s.push_str("{\"buckets\":[");
    for (i, b) in req.buckets.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str("{\"key\":");
        push_json_string(s, &b.key);
        let _ = write!(s, ",\"capacity\":{}", b.capacity);
        if let Some(r) = b.rate {
            let _ = write!(s, ",\"rate\":{r}");
        }
        let _ = write!(s, ",\"period_ms\":{}", b.period_ms);
        if let Some(c) = b.cost {
            let _ = write!(s, ",\"cost\":{c}");
        }
        if let Some(a) = b.algorithm {
            let _ = write!(s, ",\"algorithm\":\"{}\"", algorithm_name(a));
        }
        if let Some(l) = b.lease {
            let _ = write!(s, ",\"lease\":{l}");
        }
        if let Some(r) = rules.then(|| rule_of(&b.key)).flatten() {
            s.push_str(",\"rule\":");
            push_json_string(s, r);
        }
        s.push('}');
    }
    s.push(']');
}

fn json_bool(v: &Json, field: &str) -> Result<bool, DecodeError> {
    v.get(field)
        .and_then(Json::as_bool)
        .ok_or_else(|| DecodeError(format!("`{field}` missing or not a boolean")))
}

/// An optional non-negative integer (absent = 0, as in protobuf).
fn json_u64(v: &Json, field: &str) -> Result<u64, DecodeError> {
    match v.get(field) {
        None | Some(Json::Null) => Ok(0),
        Some(x) => x
            .as_u64()
            .ok_or_else(|| DecodeError(format!("`{field}` is not a non-negative integer"))),
    }
}

/// Decodes a JSON response. `allowed` is required at both levels, and `buckets`; the numbers
/// default to 0; unknown fields are ignored (the service may add some).
///
/// Read through `serde_json::Value` rather than a derive: the derive's error paths pull float
/// formatting into the module, about 20 KiB for nothing.
pub fn decode_json(body: &[u8]) -> Result<TakeResponse, DecodeError> {
    let v: Json = serde_json::from_slice(body).map_err(|e| DecodeError(e.to_string()))?;
    json_take_response(&v)
}

/// Decodes a batch answer (`{"results": [...]}`): one response per take, in order.
pub fn decode_batch_json(body: &[u8]) -> Result<Vec<TakeResponse>, DecodeError> {
    let v: Json = serde_json::from_slice(body).map_err(|e| DecodeError(e.to_string()))?;
    v.get("results")
        .and_then(Json::as_array)
        .ok_or_else(|| DecodeError("`results` missing or not a list".into()))?
        .iter()
        .map(json_take_response)
        .collect()
}

fn json_take_response(v: &Json) -> Result<TakeResponse, DecodeError> {
    let allowed = json_bool(v, "allowed")?;
    let list = v
        .get("buckets")
        .and_then(Json::as_array)
        .ok_or_else(|| DecodeError("`buckets` missing or not a list".into()))?;
    let mut buckets = Vec::with_capacity(list.len());
    for b in list {
        buckets.push(BucketResult {
            allowed: json_bool(b, "allowed")?,
            limit: json_u64(b, "limit")?,
            remaining: json_u64(b, "remaining")?,
            reset_ms: json_u64(b, "reset_ms")?,
            retry_after_ms: json_u64(b, "retry_after_ms")?,
            granted: json_u64(b, "granted")?,
        });
    }
    if let Some(n) = v.get("instances").and_then(Json::as_u64) {
        crate::core::instance::heard(n);
    }
    Ok(TakeResponse { allowed, buckets })
}

// ---------------------------------------------------------------------------------------------
// Protobuf

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_tag(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    put_varint(out, (u64::from(field) << 3) | u64::from(wire_type));
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_tag(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A proto3 scalar: zero is not encoded.
fn put_u64(out: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        put_tag(out, field, 0);
        put_varint(out, v);
    }
}

/// A proto3 `optional` scalar: encoded whenever present, even if zero.
fn put_opt_u64(out: &mut Vec<u8>, field: u32, v: Option<u64>) {
    if let Some(v) = v {
        put_tag(out, field, 0);
        put_varint(out, v);
    }
}

/// Encodes a batch of takes as protobuf (`tollgate.v1.TakeBatchRequest { repeated TakeRequest
/// takes = 1; }`).
pub fn encode_batch_proto(takes: &[&TakeRequest]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + 96 * takes.len());
    crate::core::instance::with_id(|id| {
        for t in takes {
            put_bytes(&mut out, 1, &encode_proto_take(t, id.is_some()));
        }
        if let Some(id) = id {
            put_bytes(&mut out, 2, id.as_bytes());
        }
    });
    out
}

/// Decodes `tollgate.v1.TakeBatchResponse { repeated TakeResponse results = 1; }`.
pub fn decode_batch_proto(body: &[u8]) -> Result<Vec<TakeResponse>, DecodeError> {
    let mut r = Reader { buf: body };
    let mut out = Vec::new();
    while let Some((field, value)) = r.field()? {
        match (field, value) {
            (1, Value::Bytes(b)) => out.push(decode_proto(b)?),
            (1, _) => {
                return Err(DecodeError(
                    "TakeBatchResponse field 1: wrong wire type".into(),
                ))
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Encodes a request as protobuf (`tollgate.v1.TakeRequest`); a VM with an instance id adds it
/// and each bucket's rule name, as [`encode_json`].
pub fn encode_proto(req: &TakeRequest) -> Vec<u8> {
    crate::core::instance::with_id(|id| {
        let mut out = encode_proto_take(req, id.is_some());
        if let Some(id) = id {
            put_bytes(&mut out, 2, id.as_bytes());
        }
        out
    })
}

fn encode_proto_take(req: &TakeRequest, rules: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + 64 * req.buckets.len());
    let mut b = Vec::with_capacity(64);
    for bucket in &req.buckets {
        b.clear();
        if !bucket.key.is_empty() {
            put_bytes(&mut b, 1, bucket.key.as_bytes());
        }
        put_u64(&mut b, 2, bucket.capacity);
        put_opt_u64(&mut b, 3, bucket.rate);
        put_u64(&mut b, 4, bucket.period_ms);
        put_opt_u64(&mut b, 5, bucket.cost);
        if let Some(a) = bucket.algorithm {
            put_u64(&mut b, 6, u64::from(a.code().unsigned_abs()));
        }
        put_opt_u64(&mut b, 7, bucket.lease);
        if let Some(r) = rules.then(|| rule_of(&bucket.key)).flatten() {
            put_bytes(&mut b, 8, r.as_bytes());
        }
        put_bytes(&mut out, 1, &b);
    }
    out
}

/// A protobuf reader over a byte slice; every read is bounds-checked.
struct Reader<'a> {
    buf: &'a [u8],
}

/// A decoded field value.
enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, DecodeError> {
        let mut v: u64 = 0;
        for i in 0..10 {
            let (&byte, rest) = self
                .buf
                .split_first()
                .ok_or_else(|| DecodeError("truncated varint".into()))?;
            self.buf = rest;
            v |= u64::from(byte & 0x7f) << (7 * i);
            if byte < 0x80 {
                return Ok(v);
            }
        }
        Err(DecodeError("varint too long".into()))
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], DecodeError> {
        let n = usize::try_from(n).map_err(|_| DecodeError("length too large".into()))?;
        if n > self.buf.len() {
            return Err(DecodeError("truncated field".into()));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    /// The next (field number, value), or `None` at the end.
    fn field(&mut self) -> Result<Option<(u64, Value<'a>)>, DecodeError> {
        if self.buf.is_empty() {
            return Ok(None);
        }
        let tag = self.varint()?;
        let value = match tag & 7 {
            0 => Value::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Value::Fixed
            }
            2 => {
                let n = self.varint()?;
                Value::Bytes(self.take(n)?)
            }
            5 => {
                self.take(4)?;
                Value::Fixed
            }
            t => return Err(DecodeError(format!("unsupported wire type {t}"))),
        };
        Ok(Some((tag >> 3, value)))
    }
}

fn decode_bucket_result(buf: &[u8]) -> Result<BucketResult, DecodeError> {
    let mut r = Reader { buf };
    let mut out = BucketResult::default();
    while let Some((field, value)) = r.field()? {
        if let Value::Varint(v) = value {
            match field {
                1 => out.allowed = v != 0,
                2 => out.limit = v,
                3 => out.remaining = v,
                4 => out.reset_ms = v,
                5 => out.retry_after_ms = v,
                6 => out.granted = v,
                _ => {}
            }
        } else if (1..=6).contains(&field) {
            return Err(DecodeError(format!(
                "BucketResult field {field}: wrong wire type"
            )));
        }
    }
    Ok(out)
}

/// Decodes a protobuf response (`tollgate.v1.TakeResponse`). Unknown fields are skipped, as
/// protobuf requires.
pub fn decode_proto(body: &[u8]) -> Result<TakeResponse, DecodeError> {
    let mut r = Reader { buf: body };
    let mut out = TakeResponse::default();
    while let Some((field, value)) = r.field()? {
        match (field, value) {
            (1, Value::Varint(v)) => out.allowed = v != 0,
            (2, Value::Bytes(b)) => out.buckets.push(decode_bucket_result(b)?),
            (3, Value::Varint(n)) => crate::core::instance::heard(n),
            (1 | 2, _) => {
                return Err(DecodeError(format!(
                    "TakeResponse field {field}: wrong wire type"
                )))
            }
            _ => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn cases() -> Vec<Json> {
        let text = include_str!("../../contract/fixtures/cases.json");
        let v: Json = serde_json::from_str(text).unwrap();
        v["cases"].as_array().unwrap().clone()
    }

    fn request_from_json(v: &Json) -> TakeRequest {
        TakeRequest {
            buckets: v["buckets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| Bucket {
                    key: b["key"].as_str().unwrap().to_string(),
                    capacity: b["capacity"].as_u64().unwrap(),
                    rate: b.get("rate").map(|x| x.as_u64().unwrap()),
                    period_ms: b["period_ms"].as_u64().unwrap(),
                    cost: b.get("cost").map(|x| x.as_u64().unwrap()),
                    algorithm: b.get("algorithm").map(|x| match x.as_str().unwrap() {
                        "token_bucket" => Algorithm::TokenBucket,
                        "fixed_window" => Algorithm::FixedWindow,
                        other => panic!("unknown algorithm {other}"),
                    }),
                    lease: b.get("lease").map(|x| x.as_u64().unwrap()),
                })
                .collect(),
        }
    }

    /// Test-side inverse codecs, to check "both ways" against the fixtures.
    fn decode_request_proto(buf: &[u8]) -> TakeRequest {
        let mut r = Reader { buf };
        let mut out = TakeRequest::default();
        while let Some((f, v)) = r.field().unwrap() {
            // The instance id (2) is the VM's, not the request's.
            if let (2, Value::Bytes(_)) = (f, &v) {
                continue;
            }
            let (1, Value::Bytes(b)) = (f, v) else {
                panic!("unexpected field {f}")
            };
            let mut br = Reader { buf: b };
            let mut bucket = Bucket {
                key: String::new(),
                capacity: 0,
                rate: None,
                period_ms: 0,
                cost: None,
                algorithm: None,
                lease: None,
            };
            while let Some((f, v)) = br.field().unwrap() {
                match (f, v) {
                    (1, Value::Bytes(k)) => bucket.key = String::from_utf8(k.to_vec()).unwrap(),
                    (2, Value::Varint(x)) => bucket.capacity = x,
                    (3, Value::Varint(x)) => bucket.rate = Some(x),
                    (4, Value::Varint(x)) => bucket.period_ms = x,
                    (5, Value::Varint(x)) => bucket.cost = Some(x),
                    (6, Value::Varint(1)) => bucket.algorithm = Some(Algorithm::FixedWindow),
                    (7, Value::Varint(x)) => bucket.lease = Some(x),
                    // The rule name comes from the key.
                    (8, Value::Bytes(r)) => {
                        assert_eq!(Some(r), rule_of(&bucket.key).map(str::as_bytes))
                    }
                    _ => panic!("unexpected bucket field {f}"),
                }
            }
            out.buckets.push(bucket);
        }
        out
    }

    fn encode_response_proto(resp: &TakeResponse) -> Vec<u8> {
        let mut out = Vec::new();
        put_u64(&mut out, 1, u64::from(resp.allowed));
        for b in &resp.buckets {
            let mut m = Vec::new();
            put_u64(&mut m, 1, u64::from(b.allowed));
            put_u64(&mut m, 2, b.limit);
            put_u64(&mut m, 3, b.remaining);
            put_u64(&mut m, 4, b.reset_ms);
            put_u64(&mut m, 5, b.retry_after_ms);
            put_u64(&mut m, 6, b.granted);
            put_bytes(&mut out, 2, &m);
        }
        out
    }

    #[test]
    fn fixtures_both_ways() {
        let all = cases();
        assert!(all.len() >= 4);
        assert!(
            all.iter()
                .any(|c| c["request_json"]["buckets"][0].get("lease").is_some()),
            "the fixtures cover lease mode"
        );
        for case in all {
            let name = case["name"].as_str().unwrap();
            crate::core::instance::set_id(case["request_json"]["instance"].as_str());
            let req = request_from_json(&case["request_json"]);
            let req_pb = hex(case["request_pb_hex"].as_str().unwrap());
            assert_eq!(encode_proto(&req), req_pb, "{name}: request protobuf");
            // proto3 cannot tell an absent enum from its zero value (token_bucket).
            let mut normalised = req.clone();
            for b in &mut normalised.buckets {
                if b.algorithm == Some(Algorithm::TokenBucket) {
                    b.algorithm = None;
                }
            }
            assert_eq!(
                decode_request_proto(&req_pb),
                normalised,
                "{name}: request protobuf decode"
            );
            let ours: Json = serde_json::from_slice(&encode_json(&req)).unwrap();
            assert_eq!(ours, case["request_json"], "{name}: request JSON");

            let resp_json = serde_json::to_vec(&case["response_json"]).unwrap();
            let from_json = decode_json(&resp_json).unwrap();
            let resp_pb = hex(case["response_pb_hex"].as_str().unwrap());
            let heard_json = crate::core::instance::take_heard();
            let from_pb = decode_proto(&resp_pb).unwrap();
            let heard = crate::core::instance::take_heard();
            assert_eq!(heard, heard_json, "{name}: instances, JSON vs protobuf");
            assert_eq!(heard, case["response_json"]["instances"].as_u64());
            assert_eq!(from_json, from_pb, "{name}: response JSON vs protobuf");
            let mut again = encode_response_proto(&from_pb);
            if let Some(n) = heard {
                put_u64(&mut again, 3, n);
            }
            assert_eq!(again, resp_pb, "{name}: response protobuf");
        }
        crate::core::instance::set_id(None);
    }

    #[test]
    fn batch_fixture_carries_the_instance_once() {
        let text = include_str!("../../contract/fixtures/cases.json");
        let v: Json = serde_json::from_str(text).unwrap();
        let case = v["batch_cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "batch_with_instance")
            .unwrap()
            .clone();
        let takes: Vec<TakeRequest> = case["request_json"]["takes"]
            .as_array()
            .unwrap()
            .iter()
            .map(request_from_json)
            .collect();
        let refs: Vec<&TakeRequest> = takes.iter().collect();
        crate::core::instance::set_id(case["request_json"]["instance"].as_str());
        let json: Json = serde_json::from_slice(&encode_batch_json(&refs)).unwrap();
        let pb = encode_batch_proto(&refs);
        crate::core::instance::set_id(None);
        assert_eq!(json, case["request_json"]);
        assert_eq!(pb, hex(case["request_pb_hex"].as_str().unwrap()));
        let resp = serde_json::to_vec(&case["response_json"]).unwrap();
        assert_eq!(decode_batch_json(&resp).unwrap().len(), 1);
        assert_eq!(crate::core::instance::take_heard(), Some(3));
        let resp = hex(case["response_pb_hex"].as_str().unwrap());
        assert_eq!(decode_batch_proto(&resp).unwrap().len(), 1);
        assert_eq!(crate::core::instance::take_heard(), Some(3));
    }

    #[test]
    fn lease_fixture_carries_lease_and_granted() {
        let case = cases()
            .into_iter()
            .find(|c| c["name"] == "lease_partial_grant")
            .unwrap();
        let req = request_from_json(&case["request_json"]);
        assert_eq!(req.buckets[0].lease, Some(50));
        let resp = decode_proto(&hex(case["response_pb_hex"].as_str().unwrap())).unwrap();
        let granted: Vec<u64> = resp.buckets.iter().map(|b| b.granted).collect();
        assert_eq!(granted, vec![50, 14]);
    }

    #[test]
    fn json_key_escaping() {
        let req = TakeRequest {
            buckets: vec![Bucket {
                key: "a\"b\\c\u{1}é{}".into(),
                capacity: 1,
                rate: None,
                period_ms: 1,
                cost: None,
                algorithm: None,
                lease: None,
            }],
        };
        let v: Json = serde_json::from_slice(&encode_json(&req)).unwrap();
        assert_eq!(v["buckets"][0]["key"], "a\"b\\c\u{1}é{}");
    }

    #[test]
    fn proto_decoder_rejects_garbage_without_panicking() {
        for bad in [
            &[0x08][..],               // truncated varint value
            &[0x12, 0x05, 0x08],       // length beyond the end
            &[0xff; 11],               // varint too long
            &[0x0b],                   // group wire type
            &[0x0a, 0x00],             // field 1 with wrong wire type
            &[0x12, 0x02, 0x0a, 0x00], // BucketResult field 1 with wrong wire type
        ] {
            assert!(decode_proto(bad).is_err(), "{bad:?}");
        }
        // Unknown fields of every wire type are skipped.
        let ok = [
            0x08, 0x01, 0x18, 0x05, 0x21, 0, 0, 0, 0, 0, 0, 0, 0, 0x2d, 0, 0, 0, 0, 0x32, 0x00,
        ];
        assert_eq!(
            decode_proto(&ok).unwrap(),
            TakeResponse {
                allowed: true,
                buckets: vec![]
            }
        );
        assert_eq!(decode_proto(&[]).unwrap(), TakeResponse::default());
    }

    #[test]
    fn json_decoder_rejects_wrong_shapes() {
        for bad in [
            &b""[..],
            b"{}",
            b"{\"allowed\":true}",
            b"{\"allowed\":\"yes\",\"buckets\":[]}",
            b"{\"allowed\":true,\"buckets\":[{\"allowed\":true,\"limit\":-1}]}",
            b"<html>",
        ] {
            assert!(
                decode_json(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Envoy's rate limit protocol (RLS v3), for transport `rls`: a `RateLimitRequest` out
// (envoy.service.ratelimit.v3), a `RateLimitResponse` back, mapped onto the contract's take.

/// What an RLS call asks: the domain and one descriptor (entries in order) per bucket.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RlsRequest {
    /// The RLS domain.
    pub domain: String,
    /// For bucket `i`, its descriptor's (key, value) entries.
    pub descriptors: Vec<Vec<(String, String)>>,
}

/// Encodes a `RateLimitRequest`: the domain, one descriptor per bucket, and the buckets' costs as
/// `hits_addend` (the request's when all are equal and above 1, else per descriptor).
pub fn encode_rls(rls: &RlsRequest, req: &TakeRequest) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 96 * rls.descriptors.len());
    put_bytes(&mut out, 1, rls.domain.as_bytes());
    let costs: Vec<u64> = req.buckets.iter().map(|b| b.cost.unwrap_or(1)).collect();
    let same = costs.windows(2).all(|w| w.first() == w.get(1));
    let mut d = Vec::with_capacity(96);
    let mut e = Vec::with_capacity(64);
    for (i, entries) in rls.descriptors.iter().enumerate() {
        d.clear();
        for (k, v) in entries {
            e.clear();
            put_bytes(&mut e, 1, k.as_bytes());
            put_bytes(&mut e, 2, v.as_bytes());
            put_bytes(&mut d, 1, &e);
        }
        let cost = costs.get(i).copied().unwrap_or(1);
        if !same && cost != 1 {
            // google.protobuf.UInt64Value { value = 1 }
            e.clear();
            put_u64(&mut e, 1, cost);
            put_bytes(&mut d, 3, &e);
        }
        put_bytes(&mut out, 2, &d);
    }
    match costs.first() {
        Some(&c) if same && c > 1 => {
            put_u64(&mut out, 3, u64::from(u32::try_from(c).unwrap_or(u32::MAX)))
        }
        _ => {}
    }
    out
}

/// `RateLimitResponse.Code`.
const RLS_OK: u64 = 1;
const RLS_OVER_LIMIT: u64 = 2;

/// The seconds of `RateLimit.Unit` (`SECOND` .. `YEAR`); 0 when unknown.
fn unit_ms(unit: u64) -> u64 {
    match unit {
        1 => 1_000,
        2 => 60_000,
        3 => 3_600_000,
        4 => 86_400_000,
        5 => 2_592_000_000,
        6 => 31_536_000_000,
        _ => 0,
    }
}

fn decode_duration_ms(buf: &[u8]) -> Result<u64, DecodeError> {
    let mut r = Reader { buf };
    let (mut secs, mut nanos) = (0u64, 0u64);
    while let Some((field, value)) = r.field()? {
        match (field, value) {
            (1, Value::Varint(v)) => secs = v,
            (2, Value::Varint(v)) => nanos = v & 0xffff_ffff,
            _ => {}
        }
    }
    Ok(secs
        .saturating_mul(1000)
        .saturating_add(nanos.div_ceil(1_000_000)))
}

/// One `DescriptorStatus`: (code, limit requests per unit, unit ms, remaining, ms until reset).
fn decode_status(buf: &[u8]) -> Result<(u64, u64, u64, u64, u64), DecodeError> {
    let mut r = Reader { buf };
    let (mut code, mut limit, mut unit, mut remaining, mut reset) = (0, 0, 0, 0, 0);
    while let Some((field, value)) = r.field()? {
        match (field, value) {
            (1, Value::Varint(v)) => code = v,
            (2, Value::Bytes(b)) => {
                let mut l = Reader { buf: b };
                while let Some((f, v)) = l.field()? {
                    match (f, v) {
                        (1, Value::Varint(v)) => limit = v,
                        (2, Value::Varint(v)) => unit = unit_ms(v),
                        _ => {}
                    }
                }
            }
            (3, Value::Varint(v)) => remaining = v,
            (4, Value::Bytes(b)) => reset = decode_duration_ms(b)?,
            (1 | 3, _) | (2 | 4, _) => {
                return Err(DecodeError(format!(
                    "DescriptorStatus field {field}: wrong wire type"
                )))
            }
            _ => {}
        }
    }
    Ok((code, limit, unit, remaining, reset))
}

/// Decodes a `RateLimitResponse` for the buckets of `req` (one status per descriptor, in order).
/// `OK` admits every bucket; `OVER_LIMIT` denies the request, the buckets with status
/// `OVER_LIMIT` being the ones that denied. `limit` is the server's `requests_per_unit` (the
/// bucket's capacity when the server sent none); `reset_ms` is `duration_until_reset` (or, without
/// it, the rest of the unit is unknown: the unit's length, for a denial's `retry-after`).
pub fn decode_rls(body: &[u8], req: &TakeRequest) -> Result<TakeResponse, DecodeError> {
    let mut r = Reader { buf: body };
    let mut overall = 0;
    let mut statuses = Vec::with_capacity(req.buckets.len());
    while let Some((field, value)) = r.field()? {
        match (field, value) {
            (1, Value::Varint(v)) => overall = v,
            (2, Value::Bytes(b)) => statuses.push(decode_status(b)?),
            (1 | 2, _) => {
                return Err(DecodeError(format!(
                    "RateLimitResponse field {field}: wrong wire type"
                )))
            }
            _ => {}
        }
    }
    let allowed = match overall {
        RLS_OK => true,
        RLS_OVER_LIMIT => false,
        c => return Err(DecodeError(format!("overall_code {c}"))),
    };
    if statuses.len() != req.buckets.len() {
        return Err(DecodeError(format!(
            "{} statuses for {} descriptors",
            statuses.len(),
            req.buckets.len()
        )));
    }
    let buckets = statuses
        .iter()
        .zip(&req.buckets)
        .map(|(&(code, limit, unit, remaining, reset), b)| {
            // Under OK every descriptor was admitted (a server in shadow mode may still mark one
            // over its limit); under OVER_LIMIT the ones marked so denied.
            let ok = allowed || code != RLS_OVER_LIMIT;
            let reset_ms = if reset > 0 { reset } else { unit };
            BucketResult {
                allowed: ok,
                limit: if limit > 0 { limit } else { b.capacity },
                remaining,
                reset_ms,
                retry_after_ms: if ok { 0 } else { reset_ms.max(1) },
                granted: if allowed { b.cost.unwrap_or(1) } else { 0 },
            }
        })
        .collect();
    Ok(TakeResponse { allowed, buckets })
}

#[cfg(test)]
mod rls_tests {
    use super::*;

    fn bucket(key: &str, cost: u64) -> Bucket {
        Bucket {
            key: key.into(),
            capacity: 10,
            rate: Some(10),
            period_ms: 60_000,
            cost: Some(cost),
            algorithm: None,
            lease: None,
        }
    }

    fn rls() -> RlsRequest {
        RlsRequest {
            domain: "edge".into(),
            descriptors: vec![
                vec![
                    ("rule".into(), "r".into()),
                    ("remote_address".into(), "10.0.0.1".into()),
                ],
                vec![("generic_key".into(), "all".into())],
            ],
        }
    }

    #[test]
    fn request_bytes_follow_the_rls_proto() {
        let req = TakeRequest {
            buckets: vec![bucket("a", 1), bucket("b", 1)],
        };
        let b = encode_rls(&rls(), &req);
        let mut want = vec![0x0a, 4];
        want.extend_from_slice(b"edge");
        // Decode what we wrote with the reader instead of spelling every byte: domain, two
        // descriptors with their entries, no hits_addend (cost 1).
        let mut r = Reader { buf: &b };
        let mut domain = Vec::new();
        let mut descriptors: Vec<Vec<(String, String)>> = Vec::new();
        let mut hits = None;
        while let Some((f, v)) = r.field().unwrap() {
            match (f, v) {
                (1, Value::Bytes(d)) => domain = d.to_vec(),
                (2, Value::Bytes(d)) => {
                    let mut dr = Reader { buf: d };
                    let mut entries = Vec::new();
                    while let Some((f, v)) = dr.field().unwrap() {
                        if let (1, Value::Bytes(e)) = (f, v) {
                            let mut er = Reader { buf: e };
                            let (mut k, mut val) = (String::new(), String::new());
                            while let Some((f, v)) = er.field().unwrap() {
                                match (f, v) {
                                    (1, Value::Bytes(x)) => {
                                        k = String::from_utf8(x.to_vec()).unwrap()
                                    }
                                    (2, Value::Bytes(x)) => {
                                        val = String::from_utf8(x.to_vec()).unwrap()
                                    }
                                    _ => panic!("entry field {f}"),
                                }
                            }
                            entries.push((k, val));
                        } else {
                            panic!("descriptor field {f}");
                        }
                    }
                    descriptors.push(entries);
                }
                (3, Value::Varint(h)) => hits = Some(h),
                _ => panic!("request field {f}"),
            }
        }
        assert_eq!(domain, b"edge");
        assert_eq!(descriptors, rls().descriptors);
        assert_eq!(hits, None);
        assert_eq!(&b[..6], &want[..6]);
    }

    #[test]
    fn costs_become_hits_addend() {
        let same = TakeRequest {
            buckets: vec![bucket("a", 3), bucket("b", 3)],
        };
        let b = encode_rls(&rls(), &same);
        assert_eq!(
            &b[b.len() - 2..],
            &[0x18, 3],
            "request-level hits_addend = 3"
        );
        let mixed = TakeRequest {
            buckets: vec![bucket("a", 1), bucket("b", 5)],
        };
        let b = encode_rls(&rls(), &mixed);
        // The second descriptor ends with hits_addend { value: 5 } (field 3, UInt64Value).
        assert_eq!(&b[b.len() - 4..], &[0x1a, 2, 0x08, 5]);
    }

    fn status(code: u8, limit: u8, unit: u8, remaining: u8, reset_s: u8) -> Vec<u8> {
        let mut s = vec![0x08, code];
        s.extend_from_slice(&[0x12, 4, 0x08, limit, 0x10, unit]);
        s.extend_from_slice(&[0x18, remaining]);
        s.extend_from_slice(&[0x22, 2, 0x08, reset_s]);
        s
    }

    fn response(overall: u8, statuses: &[Vec<u8>]) -> Vec<u8> {
        let mut b = vec![0x08, overall];
        for s in statuses {
            b.push(0x12);
            b.push(s.len() as u8);
            b.extend_from_slice(s);
        }
        // response_headers_to_add, skipped
        b.extend_from_slice(&[0x1a, 5, 0x0a, 1, b'x', 0x12, 0]);
        b
    }

    #[test]
    fn responses_map_onto_the_take() {
        let req = TakeRequest {
            buckets: vec![bucket("a", 1), bucket("b", 1)],
        };
        let ok = decode_rls(
            &response(1, &[status(1, 100, 2, 42, 30), status(1, 5, 1, 4, 1)]),
            &req,
        )
        .unwrap();
        assert!(ok.allowed);
        assert_eq!(
            ok.buckets[0],
            BucketResult {
                allowed: true,
                limit: 100,
                remaining: 42,
                reset_ms: 30_000,
                retry_after_ms: 0,
                granted: 1
            }
        );
        let over = decode_rls(
            &response(2, &[status(1, 100, 2, 41, 30), status(2, 5, 1, 0, 1)]),
            &req,
        )
        .unwrap();
        assert!(!over.allowed);
        assert!(over.buckets[0].allowed && !over.buckets[1].allowed);
        assert_eq!(over.buckets[1].retry_after_ms, 1000);
        assert_eq!(over.buckets[0].granted, 0, "nothing is charged on a denial");
        // A status without a limit or reset: the bucket's capacity, the unit's length unknown.
        let bare = decode_rls(&[0x08, 2, 0x12, 2, 0x08, 2, 0x12, 2, 0x08, 1], &req).unwrap();
        assert_eq!(bare.buckets[0].limit, 10);
        assert_eq!(bare.buckets[0].retry_after_ms, 1);
        // Wrong counts and codes are not answers.
        assert!(decode_rls(&response(1, &[status(1, 1, 1, 1, 1)]), &req).is_err());
        assert!(decode_rls(
            &response(0, &[status(1, 1, 1, 1, 1), status(1, 1, 1, 1, 1)]),
            &req
        )
        .is_err());
        assert!(decode_rls(&[0x12, 9, 1], &req).is_err(), "truncated");
    }
}
