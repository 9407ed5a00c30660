//! contract/fixtures/cases.json: every message decodes and encodes identically in JSON (serde)
//! and protobuf (prost), in both directions.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use prost::Message;
use serde_json::Value;
use tollgate_server::api::grpc::pb;
use tollgate_server::domain::{BatchResponse, TakeResponse};
use tollgate_server::ops::{batch, take};

fn hex_decode(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn cases() -> Vec<Value> {
    let path = common::workspace().join("contract/fixtures/cases.json");
    let text = std::fs::read_to_string(&path).expect("read cases.json");
    let v: Value = serde_json::from_str(&text).expect("parse cases.json");
    let cases = v["cases"].as_array().expect("cases").clone();
    assert!(cases.len() >= 4);
    cases
}

#[test]
fn requests_agree_in_both_encodings() {
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        // JSON -> domain -> JSON.
        let body = serde_json::to_vec(&case["request_json"]).unwrap();
        let raw_json = take::decode_json(&body).expect(name);
        assert_eq!(take::encode_json(&raw_json), case["request_json"], "{name}");
        // protobuf bytes -> domain -> bytes.
        let bytes = hex_decode(case["request_pb_hex"].as_str().unwrap());
        let msg = pb::TakeRequest::decode(bytes.as_slice()).expect(name);
        assert_eq!(take::decode_message(&bytes).expect(name), msg, "{name}");
        let raw_pb = take::raw_from_pb(msg).expect(name);
        assert_eq!(
            hex_encode(&take::pb_from_raw(&raw_pb).encode_to_vec()),
            case["request_pb_hex"],
            "{name}"
        );
        // JSON -> protobuf bytes.
        assert_eq!(
            hex_encode(&take::pb_from_raw(&raw_json).encode_to_vec()),
            case["request_pb_hex"],
            "{name}"
        );
        // Both mean the same validated request.
        assert_eq!(
            take::validate(raw_json).expect(name),
            take::validate(raw_pb).expect(name),
            "{name}"
        );
    }
}

#[test]
fn responses_agree_in_both_encodings() {
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let decision: TakeResponse =
            serde_json::from_value(case["response_json"].clone()).expect(name);
        // domain -> JSON.
        assert_eq!(
            serde_json::to_value(&decision).unwrap(),
            case["response_json"],
            "{name}"
        );
        // domain -> protobuf bytes, and back.
        let bytes = take::pb_from_answer(&decision).encode_to_vec();
        assert_eq!(hex_encode(&bytes), case["response_pb_hex"], "{name}");
        let back = pb::TakeResponse::decode(
            hex_decode(case["response_pb_hex"].as_str().unwrap()).as_slice(),
        )
        .expect(name);
        assert_eq!(take::answer_from_pb(&back), decision, "{name}");
    }
}

fn batch_cases() -> Vec<Value> {
    let path = common::workspace().join("contract/fixtures/cases.json");
    let text = std::fs::read_to_string(&path).expect("read cases.json");
    let v: Value = serde_json::from_str(&text).expect("parse cases.json");
    let cases = v["batch_cases"].as_array().expect("batch_cases").clone();
    assert!(cases.len() >= 2);
    cases
}

#[test]
fn batch_requests_agree_in_both_encodings() {
    for case in batch_cases() {
        let name = case["name"].as_str().unwrap();
        // JSON -> domain -> JSON.
        let body = serde_json::to_vec(&case["request_json"]).unwrap();
        let raw_json = batch::decode_json(&body).expect(name);
        assert_eq!(
            batch::encode_json(&raw_json),
            case["request_json"],
            "{name}"
        );
        // protobuf bytes -> domain -> bytes.
        let bytes = hex_decode(case["request_pb_hex"].as_str().unwrap());
        let msg = pb::TakeBatchRequest::decode(bytes.as_slice()).expect(name);
        assert_eq!(batch::decode_message(&bytes).expect(name), msg, "{name}");
        let raw_pb = batch::raw_from_pb(msg).expect(name);
        assert_eq!(
            hex_encode(&batch::pb_from_raw(&raw_pb).encode_to_vec()),
            case["request_pb_hex"],
            "{name}"
        );
        // JSON -> protobuf bytes.
        assert_eq!(
            hex_encode(&batch::pb_from_raw(&raw_json).encode_to_vec()),
            case["request_pb_hex"],
            "{name}"
        );
        // Both mean the same validated batch, and each take the same as it would alone.
        let takes = batch::validate(raw_json.clone()).expect(name).takes;
        assert_eq!(takes, batch::validate(raw_pb).expect(name).takes, "{name}");
        for (take, raw) in takes.iter().zip(raw_json.takes.unwrap()) {
            assert_eq!(take, &take::validate(raw).expect(name), "{name}");
        }
    }
}

#[test]
fn batch_responses_agree_in_both_encodings() {
    for case in batch_cases() {
        let name = case["name"].as_str().unwrap();
        let batch: BatchResponse =
            serde_json::from_value(case["response_json"].clone()).expect(name);
        assert_eq!(
            serde_json::to_value(&batch).unwrap(),
            case["response_json"],
            "{name}"
        );
        let bytes = batch::pb_from_answer(&batch.results).encode_to_vec();
        assert_eq!(hex_encode(&bytes), case["response_pb_hex"], "{name}");
        let back = pb::TakeBatchResponse::decode(
            hex_decode(case["response_pb_hex"].as_str().unwrap()).as_slice(),
        )
        .expect(name);
        assert_eq!(batch::answer_from_pb(&back), batch.results, "{name}");
    }
}

/// A TakeStream's messages and answers (`stream_cases`): prost reads the id the filter's codec
/// wrote, and writes each answer (results or a message's error, with the id) to the fixture's bytes.
#[test]
fn stream_messages_and_answers_agree_with_prost() {
    let path = common::workspace().join("contract/fixtures/cases.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let batches = v["batch_cases"].as_array().unwrap();
    let cases = v["stream_cases"].as_array().expect("stream_cases");
    assert!(cases.len() >= 2);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let batch = batches.iter().find(|b| b["name"] == case["batch"]).unwrap();
        let id = case["id"].as_u64().unwrap();
        let msg = pb::TakeBatchRequest::decode(
            hex_decode(case["request_pb_hex"].as_str().unwrap()).as_slice(),
        )
        .expect(name);
        assert_eq!(msg.id, id, "{name}");
        let plain = pb::TakeBatchRequest::decode(
            hex_decode(batch["request_pb_hex"].as_str().unwrap()).as_slice(),
        )
        .unwrap();
        assert_eq!(
            pb::TakeBatchRequest { id: 0, ..msg },
            plain,
            "{name}: the batch"
        );
        let answer = match case.get("error") {
            None => {
                let results: BatchResponse =
                    serde_json::from_value(batch["response_json"].clone()).unwrap();
                pb::TakeBatchResponse {
                    id,
                    ..batch::pb_from_answer(&results.results)
                }
            }
            Some(e) => pb::TakeBatchResponse {
                results: Vec::new(),
                id,
                error: Some(pb::MessageError {
                    code: u32::try_from(e["code"].as_u64().unwrap()).unwrap(),
                    message: e["message"].as_str().unwrap().to_owned(),
                    field: e["field"].as_str().unwrap().to_owned(),
                }),
            },
        };
        assert_eq!(
            hex_encode(&answer.encode_to_vec()),
            case["response_pb_hex"],
            "{name}: answer"
        );
    }
}

/// The contract crate's codec (the filter's) against prost and serde on the same fixtures.
mod contract_codec {
    use super::*;
    use contract::calendar::{Calendar, Unit};
    use contract::{json as cjson, proto as cproto, Bucket, Sender, TakeRequest};
    use tollgate_server::ops::take::RawTake;

    /// The fixtures' rule names are the keys' leading parts (`<rule>|...`), as the filter sends.
    fn rule_of_key(b: &Bucket) -> Option<&str> {
        b.key.split_once('|').map(|(r, _)| r)
    }

    fn request(raw: &RawTake) -> TakeRequest {
        TakeRequest {
            buckets: raw
                .buckets
                .iter()
                .flatten()
                .map(|b| {
                    assert_eq!(
                        b.rule.as_deref(),
                        b.key
                            .as_deref()
                            .and_then(|k| k.split_once('|'))
                            .map(|r| r.0)
                    );
                    Bucket {
                        key: b.key.clone().unwrap(),
                        capacity: b.capacity.unwrap(),
                        rate: b.rate,
                        period_ms: b.period_ms.unwrap(),
                        cost: b.cost,
                        algorithm: b.algorithm,
                        lease: b.lease,
                        max_delay_ms: b.max_delay_ms.unwrap_or(0),
                        calendar: b.calendar.as_deref().map(|u| Calendar {
                            unit: Unit::from_name(u).unwrap(),
                            zone: b.time_zone.clone().unwrap_or_else(|| "UTC".into()),
                        }),
                    }
                })
                .collect(),
        }
    }

    fn sender(instance: Option<&str>) -> Sender<'_> {
        Sender {
            instance,
            rule: rule_of_key,
        }
    }

    #[test]
    fn takes_and_answers_agree_with_prost_and_serde() {
        for case in cases() {
            let name = case["name"].as_str().unwrap();
            let body = serde_json::to_vec(&case["request_json"]).unwrap();
            let raw = take::decode_json(&body).expect(name);
            let req = request(&raw);
            let from = sender(raw.instance.as_deref());
            assert_eq!(
                cproto::encode_take(&req, &from),
                take::pb_from_raw(&raw).encode_to_vec(),
                "{name}: protobuf"
            );
            let ours: Value = serde_json::from_slice(&cjson::encode_take(&req, &from)).unwrap();
            assert_eq!(ours, take::encode_json(&raw), "{name}: JSON");

            let bytes = hex_decode(case["response_pb_hex"].as_str().unwrap());
            let prost = take::answer_from_pb(&pb::TakeResponse::decode(bytes.as_slice()).unwrap());
            assert_eq!(cproto::decode_answer(&bytes).unwrap(), prost, "{name}");
            let serde: TakeResponse =
                serde_json::from_value(case["response_json"].clone()).unwrap();
            let body = serde_json::to_vec(&case["response_json"]).unwrap();
            assert_eq!(cjson::decode_answer(&body).unwrap(), serde, "{name}");
        }
    }

    #[test]
    fn batches_agree_with_prost_and_serde() {
        for case in batch_cases() {
            let name = case["name"].as_str().unwrap();
            let body = serde_json::to_vec(&case["request_json"]).unwrap();
            let raw = batch::decode_json(&body).expect(name);
            let takes: Vec<TakeRequest> = raw.takes.iter().flatten().map(request).collect();
            let refs: Vec<&TakeRequest> = takes.iter().collect();
            let from = sender(raw.instance.as_deref());
            assert_eq!(
                cproto::encode_batch(&refs, &from),
                batch::pb_from_raw(&raw).encode_to_vec(),
                "{name}: protobuf"
            );
            let ours: Value = serde_json::from_slice(&cjson::encode_batch(&refs, &from)).unwrap();
            assert_eq!(ours, batch::encode_json(&raw), "{name}: JSON");

            let bytes = hex_decode(case["response_pb_hex"].as_str().unwrap());
            let prost =
                batch::answer_from_pb(&pb::TakeBatchResponse::decode(bytes.as_slice()).unwrap());
            assert_eq!(
                cproto::decode_batch_answer(&bytes).unwrap(),
                prost,
                "{name}"
            );
            let serde: BatchResponse =
                serde_json::from_value(case["response_json"].clone()).unwrap();
            let body = serde_json::to_vec(&case["response_json"]).unwrap();
            assert_eq!(
                cjson::decode_batch_answer(&body).unwrap(),
                serde.results,
                "{name}"
            );
        }
    }
}
