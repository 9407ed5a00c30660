//! The model a request asks for, read from its body before it is decided (`model.body`): the
//! headers go on (the host would hold the body from the module too while they wait), the body is
//! held until the model is found or known absent, then the request is keyed and priced by it.

use super::*;

/// Keyed by team and model, priced per model; the body read for its model, at most 64 bytes.
fn model_config() -> String {
    r#"{"service":{"cluster":"svc","transport":"http","batch":0},
        "model":{"body":true,"max_body_bytes":64},
        "rules":[{"name":"llm","key":["literal:t","model"],"capacity":10000,"period_ms":60000,
                  "cost":{"header":"x-max-tokens","default":100,"max":4000},
                  "charge":"response",
                  "usage":{"weights":{"prompt":1,"completion":1},
                           "prices":{"big":{"prompt":3,"completion":10}}}}]}"#
        .to_string()
}

/// A request whose headers were read: `CONTINUE` while its body's model is read. The host gives
/// no headers after their phase: they are gone from the fake too.
fn begin(d: &mut Dispatcher<Fake>, id: u32) -> u32 {
    d.abi.request_body.borrow_mut().clear();
    let status = start(d, id, "/v1/chat");
    d.abi.request.borrow_mut().clear();
    status
}

/// Feeds `pieces` of the request body as Envoy buffers them (each call sees all of it so far);
/// the status of each call.
fn body_in(d: &mut Dispatcher<Fake>, id: u32, pieces: &[&[u8]], end: bool) -> Vec<u32> {
    let mut out = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        d.abi.request_body.borrow_mut().extend_from_slice(p);
        let size = d.abi.request_body.borrow().len();
        out.push(d.on_request_body(id, Some(size), end && i + 1 == pieces.len()));
    }
    out
}

fn take_key(d: &Dispatcher<Fake>) -> String {
    last_sent(d)["buckets"][0]["key"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn the_take_waits_for_the_body_s_model_and_is_keyed_by_it() {
    let cfg = model_config();
    let mut d = dispatcher(&cfg);
    allowed_reply(&d);
    assert_eq!(begin(&mut d, 10), CONTINUE, "the headers go on");
    assert!(
        d.abi.dispatched.borrow().is_empty(),
        "nothing asked before the model"
    );
    let statuses = body_in(
        &mut d,
        10,
        &[br#"{"messages":[],"#, br#""model":"sm"#],
        false,
    );
    assert_eq!(statuses, vec![PAUSE, PAUSE]);
    assert!(d.abi.dispatched.borrow().is_empty());
    // The value's closing quote: the request is decided, its body held under flow control (not
    // buffered) for the callout, and so is what follows.
    assert_eq!(
        body_in(&mut d, 10, &[br#"all","stream":true}"#], false),
        vec![HOLD_BODY]
    );
    assert_eq!(d.abi.dispatched.borrow().len(), 1);
    assert_eq!(take_key(&d), "llm|t|small");
    d.on_http_call_response(last_token(&d), 1, 1000);
    assert_eq!(d.abi.resumed.borrow().as_slice(), &[10]);

    // No model before the bound (64 bytes): the rule's `on_missing` (skip): no callout at all.
    let n = d.abi.dispatched.borrow().len();
    assert_eq!(begin(&mut d, 11), CONTINUE);
    let filler = format!(r#"{{"messages":"{}","model":"late"}}"#, "x".repeat(80));
    assert_eq!(
        body_in(&mut d, 11, &[filler.as_bytes()], false),
        vec![CONTINUE]
    );
    assert_eq!(d.abi.dispatched.borrow().len(), n, "skipped");
    // A body that ends without one, at the trailers: the same.
    assert_eq!(begin(&mut d, 12), CONTINUE);
    assert_eq!(body_in(&mut d, 12, &[br#"{"a":1,"#], false), vec![PAUSE]);
    assert_eq!(d.on_request_body(12, None, true), CONTINUE);
    // A top-level object that closes without one: decided at its `}`.
    assert_eq!(begin(&mut d, 14), CONTINUE);
    assert_eq!(body_in(&mut d, 14, &[br#"{"a":1}"#], false), vec![CONTINUE]);
    // A request without a body is decided at its headers (no model: skipped).
    d.on_context_create(13, ROOT);
    d.abi.known.borrow_mut().push(13);
    d.abi.effective.set(13);
    assert_eq!(d.on_request_headers(13, true), CONTINUE);
    assert_eq!(d.abi.dispatched.borrow().len(), n);
}

#[test]
fn a_response_is_priced_by_the_request_s_model() {
    let cfg = model_config();
    let mut d = dispatcher(&cfg);
    let settled = |d: &mut Dispatcher<Fake>, id: u32, model: &str| -> serde_json::Value {
        allowed_reply(d);
        assert_eq!(begin(d, id), CONTINUE);
        let body = format!(r#"{{"model":"{model}"}}"#);
        body_in(d, id, &[body.as_bytes()], true);
        d.on_http_call_response(last_token(d), 1, 1000);
        let before = d.abi.dispatched.borrow().len();
        let usage = br#"{"usage":{"prompt_tokens":10,"completion_tokens":20}}"#;
        *d.abi.response.borrow_mut() = vec![("content-type".into(), b"application/json".to_vec())];
        *d.abi.response_body.borrow_mut() = usage.to_vec();
        assert_eq!(d.on_response_headers(id, false), CONTINUE);
        assert_eq!(d.on_response_body(id, usage.len(), true), CONTINUE);
        d.on_delete(id);
        let sent = d
            .abi
            .dispatched
            .borrow()
            .get(before)
            .map(|(_, b)| b.clone());
        serde_json::from_slice(&sent.expect("a settle")).unwrap()
    };
    // 10 × 3 + 20 × 10 for "big"; 10 + 20 at `weights` for a model not priced.
    assert_eq!(settled(&mut d, 20, "big")["buckets"][0]["used"], 230);
    assert_eq!(settled(&mut d, 21, "small")["buckets"][0]["used"], 30);
}
