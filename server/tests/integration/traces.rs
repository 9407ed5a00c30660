//! OpenTelemetry traces (`--otlp-endpoint`): the real binary exports a span per decision over
//! OTLP/gRPC to a receiver started here (OpenTelemetry's own collector service), joined to the
//! caller's W3C `traceparent` (HTTP header or gRPC metadata), with the rule names and outcome and
//! never a key; calls without a parent follow `--otlp-sample-ratio`, an unsampled parent makes
//! no span.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::time::Duration;

use common::binary::ServerProc;
use serde_json::json;
use tollgate_server::api::grpc::pb;
use tollgate_testkit::otlp::{Receiver, Span};

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";
const KEY: &str = "tenant-secret-key-7";

fn traceparent(trace: &str, parent: &str, sampled: bool) -> String {
    format!("00-{trace}-{parent}-{}", if sampled { "01" } else { "00" })
}

fn take_body(rule: &str) -> serde_json::Value {
    json!({"buckets": [{"key": KEY, "capacity": 1, "period_ms": 60000, "rule": rule}]})
}

/// No attribute value holds the key.
fn assert_no_key(s: &Span) {
    for (k, v) in &s.attributes {
        assert!(!v.contains(KEY), "attribute {k} holds the key: {s:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_is_a_span_of_the_callers_trace() {
    let receiver = Receiver::start();
    let endpoint = receiver.endpoint();
    // Calls without a parent start no trace here: every span below is one a caller asked for.
    let svc = ServerProc::start(&["--otlp-endpoint", &endpoint, "--otlp-sample-ratio", "0"]);
    let http = reqwest::Client::new();
    let wait = Duration::from_secs(10);

    // HTTP take with a sampled parent: allowed, then denied (capacity 1).
    for _ in 0..2 {
        let r = http
            .post(svc.url("/v1/take"))
            .header("traceparent", traceparent(TRACE, PARENT, true))
            .json(&take_body("per-tenant"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let take = |outcome: &'static str| {
        move |s: &Span| {
            s.name == "tollgate.take"
                && s.trace_id == TRACE
                && s.attributes.get("tollgate.outcome").map(String::as_str) == Some(outcome)
        }
    };
    let allowed = receiver
        .wait_for(wait, take("allowed"))
        .unwrap_or_else(|| panic!("no allowed take span: {:?}", receiver.spans()));
    assert_eq!(allowed.parent_span_id, PARENT, "{allowed:?}");
    assert_eq!(allowed.service, "tollgate-server");
    assert_eq!(allowed.attributes["tollgate.rules"], "per-tenant");
    assert_eq!(allowed.attributes["tollgate.buckets"], "1");
    let store_ms: f64 = allowed.attributes["tollgate.store_ms"].parse().unwrap();
    assert!((0.0..1000.0).contains(&store_ms), "{allowed:?}");
    assert_no_key(&allowed);
    let limited = receiver
        .wait_for(wait, take("limited"))
        .unwrap_or_else(|| panic!("no limited take span: {:?}", receiver.spans()));
    assert_ne!(limited.span_id, allowed.span_id, "a span per decision");
    assert_no_key(&limited);

    // gRPC, the parent in metadata.
    let grpc_trace = "0af7651916cd43dd8448eb211c80319c";
    let mut client = common::grpc_client(&svc.url("")).await;
    let mut req = tonic::Request::new(pb::TakeRequest {
        buckets: vec![common::pb_bucket("grpc-key")],
        ..Default::default()
    });
    req.metadata_mut().insert(
        "traceparent",
        traceparent(grpc_trace, "b7ad6b7169203331", true)
            .parse()
            .unwrap(),
    );
    client.take(req).await.unwrap();
    let g = receiver
        .wait_for(wait, |s| s.trace_id == grpc_trace)
        .unwrap_or_else(|| panic!("no gRPC span: {:?}", receiver.spans()));
    assert_eq!(
        (g.name.as_str(), g.parent_span_id.as_str()),
        ("tollgate.take", "b7ad6b7169203331")
    );

    // A batch: one span for its one store call.
    let batch_trace = "11111111111111111111111111111111";
    let r = http
        .post(svc.url("/v1/take_batch"))
        .header("traceparent", traceparent(batch_trace, PARENT, true))
        .json(&json!({"takes": [take_body("a"), take_body("b")]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let b = receiver
        .wait_for(wait, |s| s.trace_id == batch_trace)
        .unwrap_or_else(|| panic!("no batch span: {:?}", receiver.spans()));
    assert_eq!(b.name, "tollgate.batch");
    assert_eq!(b.attributes["tollgate.batch.takes"], "2");
    assert_eq!(b.attributes["tollgate.rules"], "a,b");
    assert_no_key(&b);

    // An invalid take: the span says why.
    let bad_trace = "22222222222222222222222222222222";
    let r = http
        .post(svc.url("/v1/take"))
        .header("traceparent", traceparent(bad_trace, PARENT, true))
        .json(&json!({"buckets": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let bad = receiver
        .wait_for(wait, |s| s.trace_id == bad_trace)
        .unwrap_or_else(|| panic!("no span for the invalid take: {:?}", receiver.spans()));
    assert_eq!(bad.status, 2, "an error status: {bad:?}");

    // An unsampled parent, and no parent at ratio 0: no span for either.
    let unsampled = "33333333333333333333333333333333";
    for tp in [Some(traceparent(unsampled, PARENT, false)), None] {
        let mut r = http.post(svc.url("/v1/take")).json(&take_body("quiet"));
        if let Some(tp) = tp {
            r = r.header("traceparent", tp);
        }
        assert_eq!(r.send().await.unwrap().status(), 200);
    }
    // The exporter sends every 500 ms: two rounds later, nothing came for them.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let spans = receiver.spans();
    assert!(
        spans.iter().all(|s| s.trace_id != unsampled
            && s.attributes.get("tollgate.rules").map(String::as_str) != Some("quiet")),
        "{spans:?}"
    );
    assert_eq!(
        spans.len(),
        5,
        "two takes, gRPC, a batch, the invalid one: {spans:?}"
    );
}
