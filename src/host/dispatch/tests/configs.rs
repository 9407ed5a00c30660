//! Configurations: one Envoy must refuse, two of one VM never answering each other's requests, and
//! a configuration removed by a push failing its waiting requests and handing its settlements over.

use super::*;

#[test]
fn a_configuration_envoy_must_refuse_is_refused() {
    let mut d = Dispatcher::new(Fake::new(r#"{"service":{}}"#));
    d.on_context_create(ROOT, 0);
    assert!(!d.on_configure(ROOT, 14));
    let mut d = Dispatcher::new(Fake::new(""));
    d.on_context_create(ROOT, 0);
    assert!(!d.on_configure(ROOT, 0));
}

#[test]
fn two_configurations_of_one_vm_never_answer_each_others_requests() {
    // Listener A's rule admits everything, listener B's almost nothing; both batch, one VM.
    let a = config("http", "").replace(r#""batch":0"#, r#""batch":8"#);
    let b = a.replace(r#""capacity":5"#, r#""capacity":1"#);
    let mut d = dispatcher(&a);
    const B: u32 = 3;
    configure(&mut d, B, &b);
    // Each configuration: one request calls, two queue behind it.
    assert_eq!(start_on(&mut d, ROOT, 10, "/api"), PAUSE);
    let a_first = last_token(&d);
    for id in [11, 12] {
        assert_eq!(start_on(&mut d, ROOT, id, "/api"), PAUSE);
    }
    assert_eq!(start_on(&mut d, B, 20, "/api"), PAUSE);
    let b_first = last_token(&d);
    for id in [21, 22] {
        assert_eq!(start_on(&mut d, B, id, "/api"), PAUSE);
    }
    assert_eq!(
        d.pending_callouts(),
        6,
        "six requests wait, none displaced another"
    );
    // A's callouts are answered "allowed": only A's requests resume.
    allowed_reply(&d);
    d.on_http_call_response(a_first, 1, 200);
    let a_batch = last_token(&d);
    batch_reply(&d, &[(true, 1_000_000), (true, 1_000_000)]);
    d.on_http_call_response(a_batch, 1, 400);
    assert_eq!(*d.abi.resumed.borrow(), vec![10, 11, 12]);
    // B's are answered "denied": B's requests get 429, and only they.
    batch_reply(&d, &[(false, 1)]);
    let denied = d.abi.reply.borrow().1.clone();
    let one = br#"{"allowed":false,"buckets":[{"allowed":false,"limit":1,"remaining":0,"reset_ms":1,"retry_after_ms":1000}]}"#;
    *d.abi.reply.borrow_mut() = (Some(b"200".to_vec()), one.to_vec());
    d.on_http_call_response(b_first, 1, 200);
    let b_batch = last_token(&d);
    assert_ne!(b_batch, a_batch);
    *d.abi.reply.borrow_mut() = (Some(b"200".to_vec()), denied);
    batch_reply(&d, &[(false, 1), (false, 1)]);
    d.on_http_call_response(b_batch, 1, 400);
    assert_eq!(
        *d.abi.replied.borrow(),
        vec![(20, 429), (21, 429), (22, 429)]
    );
    assert_eq!(
        d.abi.resumed.borrow().len(),
        3,
        "no B request was let through"
    );
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
}

#[test]
fn a_removed_configuration_fails_its_waiting_requests_and_hands_its_settlements_over() {
    let cfg = charged_config();
    let mut d = dispatcher(&cfg);
    // A settlement in flight when the push removes the configuration.
    let body = settle_after(&mut d, 10, &[("x-usage", "30")], b"", true).unwrap();
    let sent: serde_json::Value = serde_json::from_str(&body).unwrap();
    // A request of the old configuration waiting for its take.
    assert_eq!(start(&mut d, 11, "/v1/chat"), PAUSE);
    configure(&mut d, 7, &cfg);
    d.on_delete(ROOT);
    // Envoy cancelled the old root's callouts: the request takes the failure path at once (the
    // fallback: its share of the 4 tokens the last answer left cannot pay the estimate of 100),
    // and nothing of the old root is left in the ledger.
    assert_eq!(*d.abi.replied.borrow(), vec![(11, 429)]);
    assert_eq!(d.abi.metric("tollgate.callout_failure.reset"), 1);
    assert_eq!(d.ledger_entries(), 0);
    // The new configuration delivers the settlement, under the same id.
    let n = d.abi.dispatched.borrow().len();
    d.on_tick(7);
    let again = d
        .abi
        .dispatched
        .borrow()
        .get(n)
        .map(|(_, b)| b.clone())
        .unwrap();
    let again: serde_json::Value = serde_json::from_slice(&again).unwrap();
    assert_eq!(again, sent);
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"duplicate":false,"buckets":[{"remaining":9970}]}"#.to_vec(),
    );
    d.on_http_call_response(last_token(&d), 1, 0);
    assert_eq!(d.abi.metric("tollgate.settle.delivered"), 1);
    assert_eq!(d.ledger_entries(), 0);
}
