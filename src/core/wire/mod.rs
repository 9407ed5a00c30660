//! The filter's side of the wire contract (contract/README.md): the contract crate's take and
//! answer, sent with this VM's instance id ([`instance`]) and its buckets' rule names; and Envoy's
//! RLS v3 for transport `rls`, mapped onto the same take.
//!
//! The contract's codecs (JSON for the HTTP transport, hand-written protobuf for gRPC) are the
//! `contract` crate's, tested there byte for byte against contract/fixtures/cases.json.
//!
//! What a callout carries, the layer above the configuration:
//! - `plan`: the plain data of a decision (the plan, a callout's result, the outcome, the
//!   verdict).
//! - `instance`: this Envoy's instance id, sent with every take.
//! - `callout`: every callout encoded for the adapter (a take or batch, acquire, release, refund,
//!   settle).
//! - `batch`: group commit: the queue behind a configuration's callout, bounded by count and
//!   bytes, and a batch answer split back onto its takes.
//! - `stream`: a worker's stream of takes (transport `grpc`): each batch one message on it with
//!   its id, answers matched by id, the messages' deadlines (each fails alone), a late answer
//!   still matched, the stream given up when it falls silent, and reopened.

pub mod batch;
pub mod callout;
pub mod instance;
pub mod plan;
pub mod stream;

use contract::proto::{put_bytes, put_u64, Field as Value, Reader};
use contract::{json, proto, Sender};

pub use contract::take::{Bucket, BucketResult, DecodeError, TakeRequest, TakeResponse};

/// The rule name a bucket is sent with: its key's leading part (keys are `<rule>|<part>...`,
/// `crate::core::rules::keys`), when that is a valid rule name.
fn rule_of(key: &str) -> Option<&str> {
    let name = key.split('|').next()?;
    let ok = !name.is_empty()
        && name.len() <= contract::bounds::MAX_RULE_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b));
    ok.then_some(name)
}

fn bucket_rule(b: &Bucket) -> Option<&str> {
    rule_of(&b.key)
}

/// The sender a VM with instance id `instance` is: only a VM with an id sends it and the buckets'
/// rule names ([`crate::core::wire::instance`]).
fn sender(instance: Option<&str>) -> Sender<'_> {
    match instance {
        Some(_) => Sender {
            instance,
            rule: bucket_rule,
        },
        None => Sender::ANONYMOUS,
    }
}

/// Encodes a take as JSON (`POST /v1/take`), sent by the VM with id `instance`.
pub fn encode_json(req: &TakeRequest, instance: Option<&str>) -> Vec<u8> {
    json::encode_take(req, &sender(instance))
}

/// Encodes a batch of takes as JSON (`POST /v1/take_batch`), sent by the VM with id `instance`.
pub fn encode_batch_json(takes: &[&TakeRequest], instance: Option<&str>) -> Vec<u8> {
    json::encode_batch(takes, &sender(instance))
}

/// Encodes a take as protobuf (`tollgate.v1.TakeRequest`), sent by the VM with id `instance`.
pub fn encode_proto(req: &TakeRequest, instance: Option<&str>) -> Vec<u8> {
    proto::encode_take(req, &sender(instance))
}

/// Encodes a batch of takes as protobuf (`tollgate.v1.TakeBatchRequest`), sent by the VM with id
/// `instance`.
pub fn encode_batch_proto(takes: &[&TakeRequest], instance: Option<&str>) -> Vec<u8> {
    proto::encode_batch(takes, &sender(instance))
}

/// Encodes a message of a worker's stream of takes: a batch of takes (`TakeBatchRequest`) with its
/// `id`, sent by the VM with id `instance`.
pub fn encode_stream_message(takes: &[&TakeRequest], instance: Option<&str>, id: u64) -> Vec<u8> {
    proto::encode_stream_message(takes, &sender(instance), id)
}

/// Decodes a JSON answer.
pub fn decode_json(body: &[u8]) -> Result<TakeResponse, DecodeError> {
    json::decode_answer(body)
}

/// Decodes a JSON batch answer: one answer per take, in order.
pub fn decode_batch_json(body: &[u8]) -> Result<Vec<TakeResponse>, DecodeError> {
    json::decode_batch_answer(body)
}

/// Decodes a protobuf answer (`tollgate.v1.TakeResponse`).
pub fn decode_proto(body: &[u8]) -> Result<TakeResponse, DecodeError> {
    proto::decode_answer(body)
}

/// Decodes a protobuf batch answer (`tollgate.v1.TakeBatchResponse`).
pub fn decode_batch_proto(body: &[u8]) -> Result<Vec<TakeResponse>, DecodeError> {
    proto::decode_batch_answer(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value as Json;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn case(list: &str, name: &str) -> Json {
        let text = include_str!("../../../contract/fixtures/cases.json");
        let v: Json = serde_json::from_str(text).unwrap();
        v[list]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap()
            .clone()
    }

    fn request_from_json(v: &Json) -> TakeRequest {
        contract::json::read_take(v).unwrap()
    }

    #[test]
    fn a_vm_with_an_id_sends_it_and_the_rule_names() {
        let case = case("cases", "rule_and_instance");
        let req = request_from_json(&case["request_json"]);
        let id = case["request_json"]["instance"].as_str();
        let json: Json = serde_json::from_slice(&encode_json(&req, id)).unwrap();
        let pb = encode_proto(&req, id);
        assert_eq!(json, case["request_json"]);
        assert_eq!(pb, hex(case["request_pb_hex"].as_str().unwrap()));
        // Without an id: neither.
        let json: Json = serde_json::from_slice(&encode_json(&req, None)).unwrap();
        assert_eq!(json["instance"], Json::Null);
        assert_eq!(json["buckets"][0]["rule"], Json::Null);
        assert_ne!(encode_proto(&req, None), pb);
    }

    #[test]
    fn answers_report_the_instances_they_carry() {
        let case = case("batch_cases", "batch_with_instance");
        let takes: Vec<TakeRequest> = case["request_json"]["takes"]
            .as_array()
            .unwrap()
            .iter()
            .map(request_from_json)
            .collect();
        let refs: Vec<&TakeRequest> = takes.iter().collect();
        let id = case["request_json"]["instance"].as_str();
        let json: Json = serde_json::from_slice(&encode_batch_json(&refs, id)).unwrap();
        let pb = encode_batch_proto(&refs, id);
        assert_eq!(json, case["request_json"]);
        assert_eq!(pb, hex(case["request_pb_hex"].as_str().unwrap()));
        let resp = serde_json::to_vec(&case["response_json"]).unwrap();
        let answers = decode_batch_json(&resp).unwrap();
        assert_eq!(answers.len(), 1);
        assert_eq!(answers[0].instances, 3);
        let resp = hex(case["response_pb_hex"].as_str().unwrap());
        let answers = decode_batch_proto(&resp).unwrap();
        assert_eq!(answers.len(), 1);
        assert_eq!(answers[0].instances, 3);
        let one = case_answer();
        assert_eq!(decode_json(&one.0).unwrap().instances, one.2.unwrap());
        assert_eq!(decode_proto(&one.1).unwrap().instances, one.2.unwrap());
    }

    /// The answer of `rule_and_instance`, JSON and protobuf, and the count it carries.
    fn case_answer() -> (Vec<u8>, Vec<u8>, Option<u64>) {
        let c = case("cases", "rule_and_instance");
        (
            serde_json::to_vec(&c["response_json"]).unwrap(),
            hex(c["response_pb_hex"].as_str().unwrap()),
            c["response_json"]["instances"].as_u64(),
        )
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
    let costs: Vec<u64> = req.buckets.iter().map(|b| b.cost()).collect();
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
    let mut r = Reader::new(buf);
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
    let mut r = Reader::new(buf);
    let (mut code, mut limit, mut unit, mut remaining, mut reset) = (0, 0, 0, 0, 0);
    while let Some((field, value)) = r.field()? {
        match (field, value) {
            (1, Value::Varint(v)) => code = v,
            (2, Value::Bytes(b)) => {
                let mut l = Reader::new(b);
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
    let mut r = Reader::new(body);
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
                granted: if allowed { b.cost() } else { 0 },
                delay_ms: 0,
                window: 0,
            }
        })
        .collect();
    Ok(TakeResponse {
        allowed,
        buckets,
        instances: 0,
        delay_ms: 0,
    })
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
            max_delay_ms: 0,
            calendar: None,
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
        let mut r = Reader::new(&b);
        let mut domain = Vec::new();
        let mut descriptors: Vec<Vec<(String, String)>> = Vec::new();
        let mut hits = None;
        while let Some((f, v)) = r.field().unwrap() {
            match (f, v) {
                (1, Value::Bytes(d)) => domain = d.to_vec(),
                (2, Value::Bytes(d)) => {
                    let mut dr = Reader::new(d);
                    let mut entries = Vec::new();
                    while let Some((f, v)) = dr.field().unwrap() {
                        if let (1, Value::Bytes(e)) = (f, v) {
                            let mut er = Reader::new(e);
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
                granted: 1,
                delay_ms: 0,
                window: 0,
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
