//! Both codecs against contract/fixtures/cases.json, byte for byte and both ways (the encoders'
//! inverses are test-side), and against bodies that are not answers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::Value;

use crate::calendar::{Calendar, Unit, UTC};
use crate::proto::{put_bytes, put_u64, Field, Reader};
use crate::take::{Bucket, Sender, TakeRequest, TakeResponse};
use crate::{json, proto, Algorithm};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn fixtures() -> Value {
    serde_json::from_str(include_str!("../fixtures/cases.json")).unwrap()
}

fn cases(list: &str) -> Vec<Value> {
    fixtures()[list].as_array().unwrap().clone()
}

/// The fixtures' rule names are the keys' leading parts (`<rule>|...`).
fn rule_of_key(b: &Bucket) -> Option<&str> {
    b.key.split_once('|').map(|(r, _)| r)
}

fn sender(v: &Value) -> Sender<'_> {
    Sender {
        instance: v["instance"].as_str(),
        rule: rule_of_key,
    }
}

fn request_from_json(v: &Value) -> TakeRequest {
    json::read_take(v).unwrap()
}

/// The inverse of [`proto::encode_take`], without the instance id and rule names.
fn decode_request_proto(buf: &[u8]) -> TakeRequest {
    let mut r = Reader::new(buf);
    let mut out = TakeRequest::default();
    while let Some((f, v)) = r.field().unwrap() {
        if let (2, Field::Bytes(_)) = (f, &v) {
            continue;
        }
        let (1, Field::Bytes(b)) = (f, v) else {
            panic!("unexpected field {f}")
        };
        let mut br = Reader::new(b);
        let mut bucket = Bucket {
            key: String::new(),
            capacity: 0,
            rate: None,
            period_ms: 0,
            cost: None,
            algorithm: None,
            lease: None,
            max_delay_ms: 0,
            calendar: None,
        };
        while let Some((f, v)) = br.field().unwrap() {
            match (f, v) {
                (1, Field::Bytes(k)) => bucket.key = String::from_utf8(k.to_vec()).unwrap(),
                (2, Field::Varint(x)) => bucket.capacity = x,
                (3, Field::Varint(x)) => bucket.rate = Some(x),
                (4, Field::Varint(x)) => bucket.period_ms = x,
                (5, Field::Varint(x)) => bucket.cost = Some(x),
                (6, Field::Varint(x)) => {
                    bucket.algorithm = Algorithm::from_code(i32::try_from(x).unwrap())
                }
                (7, Field::Varint(x)) => bucket.lease = Some(x),
                (9, Field::Varint(x)) => bucket.max_delay_ms = x,
                (10, Field::Varint(x)) => {
                    bucket.calendar = Some(Calendar {
                        unit: Unit::from_code(x).unwrap(),
                        zone: UTC.to_string(),
                    })
                }
                (11, Field::Bytes(z)) => {
                    bucket.calendar.as_mut().unwrap().zone = String::from_utf8(z.to_vec()).unwrap()
                }
                (8, Field::Bytes(r)) => {
                    assert_eq!(Some(r), rule_of_key(&bucket).map(str::as_bytes))
                }
                _ => panic!("unexpected bucket field {f}"),
            }
        }
        out.buckets.push(bucket);
    }
    out
}

/// The inverse of [`proto::decode_answer`].
fn encode_answer_proto(resp: &TakeResponse) -> Vec<u8> {
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
        put_u64(&mut m, 7, b.delay_ms);
        put_bytes(&mut out, 2, &m);
    }
    put_u64(&mut out, 3, resp.instances);
    put_u64(&mut out, 4, resp.delay_ms);
    out
}

#[test]
fn takes_and_answers_both_ways() {
    let all = cases("cases");
    assert!(all.len() >= 4);
    assert!(
        all.iter()
            .any(|c| c["request_json"]["buckets"][0].get("lease").is_some()),
        "the fixtures cover lease mode"
    );
    for case in all {
        let name = case["name"].as_str().unwrap();
        let from = sender(&case["request_json"]);
        let req = request_from_json(&case["request_json"]);
        let req_pb = hex(case["request_pb_hex"].as_str().unwrap());
        assert_eq!(proto::encode_take(&req, &from), req_pb, "{name}: protobuf");
        // proto3 cannot tell an absent enum from its zero value (the default algorithm).
        let mut normalised = req.clone();
        for b in &mut normalised.buckets {
            if b.algorithm == Some(Algorithm::default()) {
                b.algorithm = None;
            }
        }
        assert_eq!(decode_request_proto(&req_pb), normalised, "{name}");
        let ours: Value = serde_json::from_slice(&json::encode_take(&req, &from)).unwrap();
        assert_eq!(ours, case["request_json"], "{name}: JSON");

        let resp_json = serde_json::to_vec(&case["response_json"]).unwrap();
        let from_json = json::decode_answer(&resp_json).unwrap();
        assert_eq!(
            Ok(&from_json),
            json::read_answer(&resp_json).as_ref(),
            "{name}: reference"
        );
        let resp_pb = hex(case["response_pb_hex"].as_str().unwrap());
        let from_pb = proto::decode_answer(&resp_pb).unwrap();
        assert_eq!(from_json, from_pb, "{name}: JSON vs protobuf");
        assert_eq!(
            from_pb.instances,
            case["response_json"]["instances"].as_u64().unwrap_or(0)
        );
        assert_eq!(encode_answer_proto(&from_pb), resp_pb, "{name}: answer");
    }
}

#[test]
fn batches_both_ways() {
    for case in cases("batch_cases") {
        let name = case["name"].as_str().unwrap();
        let takes: Vec<TakeRequest> = case["request_json"]["takes"]
            .as_array()
            .unwrap()
            .iter()
            .map(request_from_json)
            .collect();
        let refs: Vec<&TakeRequest> = takes.iter().collect();
        let from = sender(&case["request_json"]);
        let ours: Value = serde_json::from_slice(&json::encode_batch(&refs, &from)).unwrap();
        assert_eq!(ours, case["request_json"], "{name}: JSON");
        let pb = hex(case["request_pb_hex"].as_str().unwrap());
        assert_eq!(proto::encode_batch(&refs, &from), pb, "{name}: protobuf");

        let body = serde_json::to_vec(&case["response_json"]).unwrap();
        let from_json = json::decode_batch_answer(&body).unwrap();
        assert_eq!(
            Ok(&from_json),
            json::read_batch_answer(&body).as_ref(),
            "{name}: reference"
        );
        let from_pb =
            proto::decode_batch_answer(&hex(case["response_pb_hex"].as_str().unwrap())).unwrap();
        assert_eq!(from_json, from_pb, "{name}: JSON vs protobuf");
        assert_eq!(from_json.len(), takes.len(), "{name}: one answer per take");
    }
}

#[test]
fn lease_fixture_carries_lease_and_granted() {
    let case = cases("cases")
        .into_iter()
        .find(|c| c["name"] == "lease_partial_grant")
        .unwrap();
    let req = request_from_json(&case["request_json"]);
    assert_eq!(req.buckets[0].lease, Some(50));
    let resp = proto::decode_answer(&hex(case["response_pb_hex"].as_str().unwrap())).unwrap();
    let granted: Vec<u64> = resp.buckets.iter().map(|b| b.granted).collect();
    assert_eq!(granted, vec![50, 14]);
}

#[test]
fn anonymous_senders_add_nothing() {
    // A key that needs escapes, and a rule-like prefix that an anonymous sender does not send.
    let body = serde_json::json!({"buckets": [{"key": "api|a\"b\\c\u{1}é{}", "capacity": 1, "period_ms": 1}]});
    let req = request_from_json(&body);
    assert_eq!(req.buckets[0].key, "api|a\"b\\c\u{1}é{}");
    let v: Value = serde_json::from_slice(&json::encode_take(&req, &Sender::ANONYMOUS)).unwrap();
    assert_eq!(v, body);
    assert_eq!(
        decode_request_proto(&proto::encode_take(&req, &Sender::ANONYMOUS)),
        req
    );
    assert!(
        json::read_take(&serde_json::json!({"buckets": [{"key": "k", "algorithm": "gcra"}]}))
            .is_err()
    );
}

#[test]
fn protobuf_answers_that_are_not_answers() {
    for bad in [
        &[0x08][..],               // truncated varint value
        &[0x12, 0x05, 0x08],       // length beyond the end
        &[0xff; 11],               // varint too long
        &[0x0b],                   // group wire type
        &[0x0a, 0x00],             // field 1 with wrong wire type
        &[0x12, 0x02, 0x0a, 0x00], // BucketResult field 1 with wrong wire type
    ] {
        assert!(proto::decode_answer(bad).is_err(), "{bad:?}");
    }
    // Unknown fields of every wire type are skipped.
    let ok = [
        0x08, 0x01, 0x28, 0x05, 0x21, 0, 0, 0, 0, 0, 0, 0, 0, 0x2d, 0, 0, 0, 0, 0x32, 0x00,
    ];
    assert_eq!(
        proto::decode_answer(&ok).unwrap(),
        TakeResponse {
            allowed: true,
            ..TakeResponse::default()
        }
    );
    assert_eq!(proto::decode_answer(&[]).unwrap(), TakeResponse::default());
    assert!(proto::decode_batch_answer(&[0x08, 0x01]).is_err());
}

#[test]
fn json_answers_that_are_not_answers() {
    for bad in [
        &b""[..],
        b"{}",
        b"{\"allowed\":true}",
        b"{\"allowed\":\"yes\",\"buckets\":[]}",
        b"{\"allowed\":true,\"buckets\":[{\"allowed\":true,\"limit\":-1}]}",
        b"<html>",
    ] {
        assert!(
            json::decode_answer(bad).is_err(),
            "{}",
            String::from_utf8_lossy(bad)
        );
        assert!(json::read_answer(bad).is_err());
    }
    assert!(json::decode_batch_answer(b"{\"results\":{}}").is_err());
    // Unknown fields are ignored; a count that is not a number is no count.
    let a = json::decode_answer(br#"{"allowed":true,"buckets":[],"instances":"x","new":1}"#);
    assert_eq!(
        a,
        Ok(TakeResponse {
            allowed: true,
            ..TakeResponse::default()
        })
    );
}

/// The answer read by visitors and the reference reading through `serde_json::Value` agree on
/// what they accept, refuse and read.
fn agree(body: &[u8]) {
    let text = String::from_utf8_lossy(body);
    let (ours, reference) = (json::decode_answer(body), json::read_answer(body));
    match (&ours, &reference) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "{text}"),
        (Err(_), Err(_)) => {}
        _ => panic!("{text}: visitors {ours:?}, reference {reference:?}"),
    }
    let (ours, reference) = (
        json::decode_batch_answer(body),
        json::read_batch_answer(body),
    );
    match (&ours, &reference) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "batch {text}"),
        (Err(_), Err(_)) => {}
        _ => panic!("batch {text}: visitors {ours:?}, reference {reference:?}"),
    }
}

#[test]
fn the_answer_reader_agrees_with_the_reference_on_edges() {
    let deep = |n: usize| {
        format!(
            r#"{{"allowed":true,"buckets":[],"x":{}{}}}"#,
            "[".repeat(n),
            "]".repeat(n)
        )
    };
    for body in [
        r#"{"allowed":true,"buckets":[{"allowed":true,"limit":5,"remaining":4}],"instances":3}"#.to_string(),
        r#" { "allowed" : false , "buckets" : [ { "allowed" : false } , {"allowed":true} ] } "#.into(),
        r#"{"allowed":true,"allowed":false,"buckets":[]}"#.into(),
        r#"{"allowed":true,"buckets":{},"buckets":[]}"#.into(),
        r#"{"allowed":true,"buckets":[],"buckets":1}"#.into(),
        r#"{"allow\u0065d":true,"buckets":[{"allowed":true,"rem\u0061ining":7}]}"#.into(),
        r#"{"allowed":true,"buckets":[{"allowed":true,"limit":null,"granted":18446744073709551615}]}"#.into(),
        r#"{"allowed":true,"buckets":[{"allowed":true,"limit":18446744073709551616}]}"#.into(),
        r#"{"allowed":true,"buckets":[{"allowed":true,"limit":1.0}]}"#.into(),
        r#"{"allowed":true,"buckets":[{"allowed":true,"limit":1e2}]}"#.into(),
        r#"{"allowed":true,"buckets":[{"allowed":true,"limit":-0}]}"#.into(),
        r#"{"allowed":true,"buckets":[{"allowed":true,"limit":01}]}"#.into(),
        r#"{"allowed":true,"buckets":[],"x":-1e-400}"#.into(),
        r#"{"allowed":true,"buckets":[],"x":99999999999999999999999999}"#.into(),
        r#"{"allowed":true,"buckets":[],"x":"\ud83d\ude00 \u00e9 \n"}"#.into(),
        r#"{"allowed":true,"buckets":[],"x":"\ud83d"}"#.into(),
        r#"{"allowed":true,"buckets":[],"x":"\ude00"}"#.into(),
        r#"{"allowed":true,"buckets":[],"x":"\x"}"#.into(),
        "{\"allowed\":true,\"buckets\":[],\"x\":\"\t\"}".into(),
        r#"{"allowed":true,"buckets":[],"x":[1,2,]}"#.into(),
        r#"{"allowed":true,"buckets":[],}"#.into(),
        r#"{"allowed":true,"buckets":[]} x"#.into(),
        r#"{"allowed":true,"buckets":[3,"x",null]}"#.into(),
        r#"{"allowed":true,"buckets":[{"allowed":true,"limit":"5"}]}"#.into(),
        r#"{"allowed":true,"buckets":[],"instances":-1}"#.into(),
        r#"{"allowed":true,"buckets":[],"instances":2.5}"#.into(),
        r#"[{"allowed":true,"buckets":[]}]"#.into(),
        r#"{"results":[{"allowed":true,"buckets":[]},{"allowed":false,"buckets":[{"allowed":false,"retry_after_ms":9}]}]}"#.into(),
        r#"{"results":[{"allowed":true,"buckets":[]},7]}"#.into(),
        r#"{"results":[],"results":{}}"#.into(),
        "true".into(),
        "nul".into(),
        "".into(),
        deep(126),
        deep(127),
        deep(128),
    ] {
        agree(body.as_bytes());
    }
    agree(b"{\"allowed\":true,\"buckets\":[],\"x\":\"\xff\"}");
    agree(br#"{"allowed":true,"buckets":[],"x":1e400}"#);
}

mod generated {
    use proptest::prelude::*;

    /// A JSON value of up to three levels, of every kind.
    fn value() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_string()),
            Just("true".to_string()),
            Just("false".to_string()),
            any::<u64>().prop_map(|n| n.to_string()),
            any::<i64>().prop_map(|n| n.to_string()),
            (-1e6f64..1e6).prop_map(|f| format!("{f:e}")),
            "[a-z\\\\\"\u{e9}]{0,6}".prop_map(|s| serde_json::to_string(&s).unwrap_or_default()),
            Just(r#""\u00e9\ud83d\ude00""#.to_string()),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec((key(), inner), 0..4).prop_map(|v| {
                    let m: Vec<String> = v.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
                    format!("{{{}}}", m.join(","))
                }),
            ]
        })
    }

    /// Field names an answer holds (some written with an escape), and others.
    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("\"allowed\"".to_string()),
            Just("\"buckets\"".to_string()),
            Just("\"instances\"".to_string()),
            Just("\"limit\"".to_string()),
            Just("\"remaining\"".to_string()),
            Just("\"reset_ms\"".to_string()),
            Just("\"retry_after_ms\"".to_string()),
            Just("\"granted\"".to_string()),
            Just("\"results\"".to_string()),
            Just("\"gr\\u0061nted\"".to_string()),
            "[a-z]{1,5}".prop_map(|s| format!("\"{s}\"")),
        ]
    }

    /// A bucket's result: its fields, some of another type, some twice, in any order.
    fn bucket() -> impl Strategy<Value = String> {
        let field = prop_oneof![
            4 => (key(), any::<u32>()).prop_map(|(k, n)| format!("{k}:{n}")),
            2 => any::<bool>().prop_map(|b| format!("\"allowed\":{b}")),
            1 => (key(), value()).prop_map(|(k, v)| format!("{k}:{v}")),
        ];
        prop::collection::vec(field, 0..8).prop_map(|f| format!("{{{}}}", f.join(",")))
    }

    fn answer() -> impl Strategy<Value = String> {
        let field = prop_oneof![
            3 => any::<bool>().prop_map(|b| format!("\"allowed\":{b}")),
            3 => prop::collection::vec(bucket(), 0..4).prop_map(|b| format!("\"buckets\":[{}]", b.join(","))),
            1 => any::<u8>().prop_map(|n| format!("\"instances\":{n}")),
            1 => (key(), value()).prop_map(|(k, v)| format!("{k}:{v}")),
        ];
        prop::collection::vec(field, 0..7).prop_map(|f| format!("{{{}}}", f.join(",")))
    }

    /// A document as the service writes one, or one it never would: spaces added, cut short, a
    /// byte changed.
    fn document() -> impl Strategy<Value = Vec<u8>> {
        let whole = prop_oneof![
            3 => answer(),
            1 => prop::collection::vec(answer(), 0..3).prop_map(|a| format!("{{\"results\":[{}]}}", a.join(","))),
            1 => value(),
        ];
        (
            whole,
            any::<u8>(),
            any::<prop::sample::Index>(),
            any::<u8>(),
        )
            .prop_map(|(d, how, at, byte)| {
                let mut b = d.into_bytes();
                let i = at.index(b.len() + 1);
                match how % 8 {
                    0 => b.truncate(i),
                    1 => {
                        if let Some(c) = b.get_mut(i) {
                            *c = byte;
                        }
                    }
                    2 => {
                        let spaces = b" \n\t\r".get(..usize::from(byte % 4) + 1).unwrap_or(b" ");
                        b.splice(i..i, spaces.iter().copied()).for_each(drop);
                    }
                    _ => {}
                }
                b
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        #[test]
        fn the_answer_reader_agrees_with_the_reference(doc in document()) {
            super::agree(&doc);
        }
    }
}

#[test]
fn stream_messages_carry_their_ids_both_ways() {
    let batches = cases("batch_cases");
    for case in cases("stream_cases") {
        let name = case["name"].as_str().unwrap();
        let batch = batches
            .iter()
            .find(|b| b["name"] == case["batch"])
            .unwrap_or_else(|| panic!("{name}: no batch case {}", case["batch"]));
        let takes: Vec<TakeRequest> = batch["request_json"]["takes"]
            .as_array()
            .unwrap()
            .iter()
            .map(request_from_json)
            .collect();
        let refs: Vec<&TakeRequest> = takes.iter().collect();
        let from = sender(&batch["request_json"]);
        let id = case["id"].as_u64().unwrap();
        assert_eq!(
            proto::encode_stream_message(&refs, &from, id),
            hex(case["request_pb_hex"].as_str().unwrap()),
            "{name}: request"
        );
        let got = proto::decode_stream_answer(&hex(case["response_pb_hex"].as_str().unwrap()))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got.id, id, "{name}: the id comes back");
        match (&got.answer, case.get("error")) {
            (Ok(results), None) => {
                let whole =
                    proto::decode_batch_answer(&hex(batch["response_pb_hex"].as_str().unwrap()))
                        .unwrap();
                assert_eq!(results, &whole, "{name}: the batch's results");
            }
            (Err(e), Some(want)) => {
                assert_eq!(u64::from(e.code), want["code"].as_u64().unwrap(), "{name}");
                assert_eq!(e.message, want["message"].as_str().unwrap(), "{name}");
                assert_eq!(e.field, want["field"].as_str().unwrap(), "{name}");
            }
            (other, want) => panic!("{name}: {other:?} against {want:?}"),
        }
    }
}

#[test]
fn a_stream_answer_with_results_and_an_error_is_refused() {
    // results (one empty TakeResponse), id 1, and an error: not a valid answer.
    let body = [0x0a, 0x00, 0x10, 0x01, 0x1a, 0x02, 0x08, 0x0e];
    assert!(proto::decode_stream_answer(&body).is_err());
    assert!(proto::decode_batch_answer(&body).is_err());
    // An error alone is the message's answer, and no batch's results.
    let body = [0x10, 0x01, 0x1a, 0x02, 0x08, 0x0e];
    let got = proto::decode_stream_answer(&body).unwrap();
    assert_eq!((got.id, got.answer.map_err(|e| e.code)), (1, Err(14)));
    assert!(proto::decode_batch_answer(&body).is_err());
}

#[test]
fn shaped_fixtures_carry_max_delay_and_delays() {
    let find = |name: &str| {
        cases("cases")
            .into_iter()
            .find(|c| c["name"] == name)
            .unwrap()
    };
    let answer = |c: &Value| proto::decode_answer(&hex(c["response_pb_hex"].as_str().unwrap()));
    let grant = find("shaped_grant");
    assert_eq!(
        request_from_json(&grant["request_json"]).buckets[0].max_delay_ms,
        1000
    );
    let a = answer(&grant).unwrap();
    assert_eq!(
        (a.allowed, a.delay_ms, a.buckets[0].delay_ms),
        (true, 300, 300)
    );
    let a = answer(&find("shaped_refusal_past_max_delay")).unwrap();
    assert_eq!(
        (a.allowed, a.delay_ms, a.buckets[0].retry_after_ms),
        (false, 0, 1100)
    );
    let a = answer(&find("shaped_two_buckets")).unwrap();
    let delays: Vec<u64> = a.buckets.iter().map(|b| b.delay_ms).collect();
    assert_eq!((a.delay_ms, delays), (500, vec![200, 500]), "the larger");
    assert_eq!(
        a,
        crate::take::TakeResponse::from_buckets(a.buckets.clone()),
        "the take's delay is its buckets' largest"
    );
}
