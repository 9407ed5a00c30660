//! Requests held for a grant for later (shaping): let through by the timer in the order of their
//! time, a held request whose client leaves giving its tokens back, and held requests outliving
//! the configuration a push replaced.

use super::*;

/// A shaping rule over HTTP, every take a callout of its own.
fn shaped_config() -> String {
    config("http", "").replace(
        r#""period_ms":60000}"#,
        r#""period_ms":60000,"shape":{"max_delay_ms":1000}}"#,
    )
}

/// A dispatcher of [`shaped_config`] whose root context Envoy knows.
fn shaping() -> Dispatcher<Fake> {
    let d = dispatcher(&shaped_config());
    d.abi.known.borrow_mut().push(ROOT);
    d
}

/// The next answer: allowed, the tokens there in `delay_ms`.
fn later_reply(d: &Dispatcher<Fake>, delay_ms: u64) {
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        format!(
            r#"{{"allowed":true,"buckets":[{{"allowed":true,"limit":5,"remaining":0,"reset_ms":1000,"retry_after_ms":0,"granted":1,"delay_ms":{delay_ms}}}],"delay_ms":{delay_ms}}}"#
        )
        .into_bytes(),
    );
}

/// Request `id` starts under `root` and is granted `delay_ms` ahead.
fn held_for(d: &mut Dispatcher<Fake>, root: u32, id: u32, delay_ms: u64) {
    assert_eq!(start_on(d, root, id, "/api"), PAUSE);
    let body = d.abi.dispatched.borrow().last().unwrap().1.clone();
    assert!(
        String::from_utf8(body)
            .unwrap()
            .contains(r#""max_delay_ms":1000"#),
        "the take asks for a grant up to max_delay_ms ahead"
    );
    later_reply(d, delay_ms);
    d.on_http_call_response(last_token(d), 1, 300);
}

#[test]
fn held_requests_go_when_their_time_comes_in_its_order() {
    let mut d = shaping();
    assert_eq!(d.abi.tick_ms.get(), 0, "no timer while nothing is held");
    held_for(&mut d, ROOT, 10, 30);
    assert_eq!(
        (d.abi.effective.get(), d.abi.tick_ms.get()),
        (ROOT, flow::HOLD_TICK_MS),
        "the root's timer runs fast while a request is held"
    );
    held_for(&mut d, ROOT, 11, 10);
    held_for(&mut d, ROOT, 12, 20);
    assert!(d.abi.resumed.borrow().is_empty(), "all three held");
    assert_eq!(d.abi.metric("tollgate.shape.held"), 3);
    d.abi.clock.set(9);
    d.on_tick(ROOT);
    assert!(d.abi.resumed.borrow().is_empty(), "none before its time");
    d.abi.clock.set(20);
    d.on_tick(ROOT);
    assert_eq!(*d.abi.resumed.borrow(), vec![11, 12]);
    d.abi.clock.set(35);
    d.on_tick(ROOT);
    assert_eq!(*d.abi.resumed.borrow(), vec![11, 12, 10]);
    assert_eq!(d.abi.tick_ms.get(), 1000, "none held: the timer slows down");
    assert_eq!(d.abi.metric("tollgate.shape.held"), 0);
    assert_eq!(d.abi.metric("tollgate.shape.held_total"), 3);
    assert!(d.abi.replied.borrow().is_empty());
}

#[test]
fn a_held_request_whose_client_leaves_gives_its_tokens_back_and_is_never_resumed() {
    let mut d = shaping();
    held_for(&mut d, ROOT, 10, 50);
    let sent = d.abi.dispatched.borrow().len();
    disconnect(&mut d, 10);
    let refund = d.abi.dispatched.borrow()[sent].1.clone();
    let refund: serde_json::Value = serde_json::from_slice(&refund).unwrap();
    assert_eq!(refund["buckets"][0]["cost"], 1, "its cost goes back");
    assert_eq!(d.abi.metric("tollgate.shape.returned"), 1);
    assert_eq!(d.abi.metric("tollgate.shape.held"), 0);
    d.abi.clock.set(100);
    d.on_tick(ROOT);
    assert!(d.abi.resumed.borrow().is_empty());
}

#[test]
fn held_requests_outlive_the_configuration_a_push_replaced() {
    let mut d = shaping();
    held_for(&mut d, ROOT, 10, 40);
    // The push: a configuration that does not shape (its own timer: none), the old root gone.
    const NEW: u32 = 7;
    configure(&mut d, NEW, &config("http", ""));
    d.abi.tick_ms.set(0);
    d.on_delete(ROOT);
    assert_eq!(
        (d.abi.effective.get(), d.abi.tick_ms.get()),
        (NEW, flow::HOLD_TICK_MS),
        "the remaining root's timer is started for the held request"
    );
    d.abi.clock.set(40);
    d.on_tick(NEW);
    assert_eq!(*d.abi.resumed.borrow(), vec![10], "let through at its time");
}

/// A shaping configuration's batch queue holds as many as its rule may hold (`max_held`, here
/// 20), not four batches (8 here): a burst behind a callout in flight asks for a grant for later
/// for each request the rule has a place for, and only what neither the places nor the queue
/// hold is decided here: refused at once (the rule has no place for it and the queue no room),
/// never by the failure mode.
#[test]
fn a_shaping_queue_holds_as_many_as_the_rule_may_hold() {
    let cfg = config("http", r#","failure_mode":"deny""#)
        .replace(r#""batch":0"#, r#""batch":2"#)
        .replace(
            r#""period_ms":60000}"#,
            r#""period_ms":60000,"shape":{"max_delay_ms":1000,"max_held":20}}"#,
        );
    let mut d = dispatcher(&cfg);
    d.abi.known.borrow_mut().push(ROOT);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    for id in 11..41 {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 1, "one callout out");
    // 20 queued (19 with a place, the 20th asked unshaped), the other 10 refused here.
    assert_eq!(d.abi.replied.borrow().len(), 10);
    assert_eq!(d.abi.metric("tollgate.failure_mode.queued"), 0);
    assert_eq!(d.abi.metric("tollgate.shape.full"), 11);
    assert_eq!(d.abi.metric("tollgate.breaker.opened"), 0);
}

/// Beyond its places, with the queue full, a shaping rule's request is refused with the longest
/// the service grants ahead as its `Retry-After`; the fallback shares (the failure mode by
/// default) neither admit it nor lose a token to it: the service is granting the bucket's refill
/// to the requests queued and held. A full queue that a rule with places left meets is still the
/// failure mode's.
#[test]
fn beyond_its_places_a_full_queue_refuses_instead_of_the_fallback() {
    let cfg = config("http", "").replace(r#""batch":0"#, r#""batch":2"#).replace(
        r#""period_ms":60000}"#,
        r#""period_ms":60000,"shape":{"max_delay_ms":3000,"max_held":4}},
           {"name":"plain","match":{"path_prefix":"/plain"},"key":["literal:p"],"capacity":5,"period_ms":60000}"#,
    );
    let mut d = dispatcher(&cfg);
    d.abi.known.borrow_mut().push(ROOT);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    // The rule's 4 places go to the first 4; the queue holds four batches (8, more than the
    // largest max_held); then 4 find it full.
    for id in 11..23 {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    assert_eq!(d.abi.replied.borrow().len(), 4);
    assert!(d
        .abi
        .replied
        .borrow()
        .iter()
        .all(|&(_, status)| status == 429));
    assert!(d
        .abi
        .retry_after
        .borrow()
        .iter()
        .all(|r| r.as_deref() == Some("3")));
    assert_eq!(d.abi.metric("tollgate.fallback.allowed"), 0);
    assert_eq!(d.abi.metric("tollgate.fallback.limited"), 0);
    assert_eq!(d.abi.metric("tollgate.failure_mode.queued"), 0);
    assert_eq!(d.abi.metric("tollgate.rule.r.limited_locally"), 4);
    assert_eq!(d.abi.metric("tollgate.rule.r.limited"), 4);
    // The queue is full for the unshaped rule too: its share decides, as for any full queue.
    assert_eq!(start(&mut d, 23, "/plain"), CONTINUE);
    assert_eq!(d.abi.metric("tollgate.fallback.allowed"), 1);
    assert_eq!(d.abi.metric("tollgate.failure_mode.queued"), 1);
}

#[test]
fn a_client_gone_before_its_answer_gives_back_a_grant_for_later() {
    let mut d = shaping();
    // Gone while its take is in flight; the answer then grants it 300 ms ahead: not yet due, the
    // tokens go back.
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let token = last_token(&d);
    disconnect(&mut d, 10);
    let sent = d.abi.dispatched.borrow().len();
    later_reply(&d, 300);
    d.on_http_call_response(token, 1, 300);
    assert_eq!(d.abi.dispatched.borrow().len(), sent + 1, "a refund");
    let refund = last_sent(&d);
    assert_eq!(refund["buckets"][0]["cost"], 1, "its cost goes back");
    assert_eq!(d.abi.metric("tollgate.shape.returned"), 1);
    assert!(d.abi.resumed.borrow().is_empty() && d.abi.replied.borrow().is_empty());
    // Granted for now: spent as any admitted request whose client left; nothing goes back.
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    let token = last_token(&d);
    disconnect(&mut d, 11);
    let calls = d.abi.dispatched.borrow().len();
    later_reply(&d, 0);
    d.on_http_call_response(token, 1, 300);
    assert_eq!(d.abi.dispatched.borrow().len(), calls, "no refund");
}

#[test]
fn a_client_gone_before_its_batch_s_answer_gives_back_a_grant_for_later() {
    let cfg = shaped_config().replace(r#""batch":0"#, r#""batch":8"#);
    let mut d = dispatcher(&cfg);
    d.abi.known.borrow_mut().push(ROOT);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let first = last_token(&d);
    for id in [11, 12] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    allowed_reply(&d);
    d.on_http_call_response(first, 1, 200);
    let batch = last_token(&d);
    let sent = d.abi.dispatched.borrow().len();
    // 12 leaves with the batch in flight; the batch grants it (and 11) 200 ms ahead.
    disconnect(&mut d, 12);
    let later = r#"{"allowed":true,"buckets":[{"allowed":true,"limit":5,"remaining":0,"reset_ms":1000,"retry_after_ms":0,"granted":1,"delay_ms":200}],"delay_ms":200}"#;
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        format!(r#"{{"results":[{later},{later}]}}"#).into_bytes(),
    );
    d.on_http_call_response(batch, 1, 400);
    assert_eq!(d.abi.dispatched.borrow().len(), sent + 1, "12's refund");
    assert_eq!(last_sent(&d)["buckets"][0]["cost"], 1);
    assert_eq!(d.abi.metric("tollgate.shape.returned"), 1);
    assert_eq!(
        d.abi.metric("tollgate.shape.held"),
        1,
        "11 is held, 12 never was"
    );
    // 11 goes at its time.
    d.abi.clock.set(300);
    d.on_tick(ROOT);
    assert_eq!(*d.abi.resumed.borrow(), vec![10, 11]);
}

/// A grant ahead of the refill speaks for the bucket's refill until it is due: a request whose
/// take fails in the meantime is refused by the fallback share, which starts refilling only then
/// (it used to refill from the answer on, admitting beside the held request).
#[test]
fn a_grant_ahead_leaves_the_fallback_share_empty_until_it_is_due() {
    let cfg = config("http", "").replace(
        r#""period_ms":60000}"#,
        r#""period_ms":1000,"shape":{"max_delay_ms":3000}}"#,
    );
    let mut d = dispatcher(&cfg);
    d.abi.known.borrow_mut().push(ROOT);
    // Capacity 5 at 5 a second, the bucket owing: this request's token is there in 2 s.
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    later_reply(&d, 2000);
    d.on_http_call_response(last_token(&d), 1, 300);
    assert_eq!(d.abi.metric("tollgate.shape.held"), 1);
    let fail = |d: &mut Dispatcher<Fake>, id: u32| {
        assert_eq!(start(d, id, "/api"), PAUSE);
        *d.abi.reply.borrow_mut() = (Some(b"503".to_vec()), Vec::new());
        d.on_http_call_response(last_token(d), 0, 0);
    };
    d.abi.clock.set(1500);
    fail(&mut d, 11);
    assert_eq!(
        (
            d.abi.metric("tollgate.fallback.limited"),
            d.abi.metric("tollgate.fallback.allowed")
        ),
        (1, 0),
        "1.5 s after the answer, the share still empty"
    );
    d.abi.clock.set(2000);
    d.on_tick(ROOT);
    assert_eq!(
        *d.abi.resumed.borrow(),
        vec![10],
        "the held request at its time"
    );
    // 250 ms after it was due: one token's refill (200 ms), and no more.
    d.abi.clock.set(2250);
    fail(&mut d, 12);
    fail(&mut d, 13);
    assert_eq!(
        (
            d.abi.metric("tollgate.fallback.limited"),
            d.abi.metric("tollgate.fallback.allowed")
        ),
        (2, 1)
    );
}
