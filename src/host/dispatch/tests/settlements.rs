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
    assert_eq!(last_sent(&d), v, "the same settlement, same id");
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

#[test]
fn a_calendar_month_settles_in_the_window_the_service_charged() {
    let cfg = charged_config().replace(
        r#""period_ms":60000"#,
        r#""algorithm":"calendar_window","calendar":"month","time_zone":"Europe/Berlin""#,
    );
    let mut d = dispatcher(&cfg);
    // The service charged the estimate in the month starting 2026-11-30 23:00 UTC.
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"allowed":true,"buckets":[{"allowed":true,"limit":10000,"remaining":9900,"reset_ms":86400000,"retry_after_ms":0,"granted":100,"window":1796079600000}]}"#.to_vec(),
    );
    assert_eq!(start(&mut d, 10, "/v1/chat"), PAUSE);
    let take = last_sent(&d);
    let b = &take["buckets"][0];
    assert_eq!(
        (&b["algorithm"], &b["calendar"], &b["time_zone"]),
        (
            &serde_json::json!("calendar_window"),
            &serde_json::json!("month"),
            &serde_json::json!("Europe/Berlin")
        ),
        "{take}"
    );
    d.on_http_call_response(last_token(&d), 1, 1000);
    let sent_before = d.abi.dispatched.borrow().len();
    *d.abi.response.borrow_mut() = vec![("x-usage".into(), b"30".to_vec())];
    assert_eq!(d.on_response_headers(10, true), CONTINUE);
    d.on_delete(10);
    let settle = d
        .abi
        .dispatched
        .borrow()
        .get(sent_before)
        .map(|(_, b)| b.clone());
    let v: serde_json::Value = serde_json::from_slice(&settle.expect("a settle")).unwrap();
    let b = &v["buckets"][0];
    assert_eq!(
        (&b["estimate"], &b["used"]),
        (&serde_json::json!(100), &serde_json::json!(30))
    );
    assert_eq!(b["window"], 1_796_079_600_000u64, "the month charged: {v}");
    assert_eq!(
        (&b["calendar"], &b["time_zone"]),
        (
            &serde_json::json!("month"),
            &serde_json::json!("Europe/Berlin")
        )
    );
}
