//! Requests priced by their response (`charge: response`): settled once with what the response
//! reported (retried, never sent twice), and a denied request reserving and settling nothing.

use super::*;

#[test]
fn a_response_priced_request_settles_what_its_response_reported_once() {
    let cfg = charged_config();
    let mut d = dispatcher(&cfg);
    assert_eq!(
        d.abi.tick_ms.get(),
        100,
        "the timer that retries settlements"
    );
    // JSON body: 30 used of the 100 reserved.
    let json =
        br#"{"id":"x","usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30}}"#;
    let body = settle_after(
        &mut d,
        10,
        &[("content-type", "application/json")],
        json,
        true,
    )
    .expect("a settle was sent");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["buckets"][0]["estimate"], 100);
    assert_eq!(v["buckets"][0]["used"], 30);
    assert_eq!(v["buckets"][0]["key"], "llm|k");
    assert_eq!(v["buckets"][0]["rule"], "llm");
    let first_id = v["id"].as_str().unwrap().to_string();
    // The service answers 503: sent again from the timer after 100 ms, with the same id.
    *d.abi.reply.borrow_mut() = (Some(b"503".to_vec()), Vec::new());
    d.on_http_call_response(last_token(&d), 1, 0);
    assert_eq!(d.abi.metric("tollgate.settle.retried"), 1);
    let n = d.abi.dispatched.borrow().len();
    d.on_tick(ROOT);
    assert_eq!(d.abi.dispatched.borrow().len(), n, "not before its backoff");
    d.abi.clock.set(100);
    d.on_tick(ROOT);
    let again = d
        .abi
        .dispatched
        .borrow()
        .last()
        .map(|(_, b)| b.clone())
        .unwrap();
    let again: serde_json::Value = serde_json::from_slice(&again).unwrap();
    assert_eq!(again, v, "the same settlement, same id");
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"duplicate":false,"buckets":[{"remaining":9970}]}"#.to_vec(),
    );
    d.on_http_call_response(last_token(&d), 1, 0);
    assert_eq!(d.abi.metric("tollgate.settle.delivered"), 1);
    d.abi.clock.set(10_000);
    let n = d.abi.dispatched.borrow().len();
    d.on_tick(ROOT);
    assert_eq!(
        d.abi.dispatched.borrow().len(),
        n,
        "delivered: never sent again"
    );
    // A header wins over the body, and a bigger usage is an extra charge.
    let body = settle_after(
        &mut d,
        11,
        &[("content-type", "application/json"), ("x-usage", "250")],
        json,
        true,
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["buckets"][0]["used"], 250);
    assert_ne!(v["id"].as_str().unwrap(), first_id);
    // A streamed response: the final event's usage.
    let sse = b"data: {\"choices\":[],\"usage\":null}\n\ndata: {\"usage\":{\"total_tokens\":64}}\n\ndata: [DONE]\n\n";
    let body = settle_after(
        &mut d,
        12,
        &[("content-type", "text/event-stream")],
        sse,
        true,
    )
    .unwrap();
    assert!(body.contains("\"used\":64"), "{body}");
    // No usage reported: the estimate stands, nothing is sent.
    assert_eq!(
        settle_after(
            &mut d,
            13,
            &[("content-type", "application/json")],
            b"{}",
            true
        ),
        None
    );
    // A stream cut before its report: charged the most it could have reserved (`cost.max`).
    let cut = settle_after(
        &mut d,
        14,
        &[("content-type", "text/event-stream")],
        b"data: {\"choices\":[]}\n\n",
        false,
    )
    .unwrap();
    assert!(cut.contains("\"estimate\":100,\"used\":4000"), "{cut}");
    // A refusal (400) is not retried.
    let _ = settle_after(&mut d, 15, &[("x-usage", "7")], b"", true).unwrap();
    *d.abi.reply.borrow_mut() = (Some(b"400".to_vec()), Vec::new());
    d.on_http_call_response(last_token(&d), 1, 0);
    assert_eq!(d.abi.metric("tollgate.settle.given_up"), 1);
    d.abi.clock.set(60_000);
    let n = d.abi.dispatched.borrow().len();
    d.on_tick(ROOT);
    assert_eq!(d.abi.dispatched.borrow().len(), n);
}

#[test]
fn a_denied_request_reserves_nothing_and_settles_nothing() {
    let cfg = charged_config();
    let mut d = dispatcher(&cfg);
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"allowed":false,"buckets":[{"allowed":false,"limit":10000,"remaining":0,"reset_ms":1000,"retry_after_ms":500}]}"#.to_vec(),
    );
    assert_eq!(start(&mut d, 20, "/v1/chat"), PAUSE);
    d.on_http_call_response(last_token(&d), 1, 1000);
    assert_eq!(d.abi.replied.borrow().last(), Some(&(20, 429)));
    let n = d.abi.dispatched.borrow().len();
    d.on_delete(20);
    assert_eq!(d.abi.dispatched.borrow().len(), n);
    assert_eq!(d.abi.metric("tollgate.settle.sent"), 0);
}
