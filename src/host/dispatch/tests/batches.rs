//! Takes queued behind a callout in flight, leaving in batches: each gets its own answer, none
//! waits past its timeout, a queue leaves beside a callout out a tick (up to eight in
//! flight), the byte bounds split a queue, and an abandoned take holds the queue until its answer.

use super::*;

#[test]
fn queued_requests_leave_in_one_batch_and_each_gets_its_own_answer() {
    let cfg = config("http", "").replace(r#""batch":0"#, r#""batch":8"#);
    let mut d = dispatcher(&cfg);
    // A lone request calls at once.
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    assert_eq!(d.abi.dispatched.borrow().len(), 1);
    let first = last_token(&d);
    // Three more while it is in flight: queued, no callout; one goes away before its batch.
    for id in [11, 12, 13] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 1, "queued, not called");
    disconnect(&mut d, 12);
    // The first answer comes back: request 10 resumes and the queue leaves as one batch.
    allowed_reply(&d);
    d.on_http_call_response(first, 1, 200);
    assert_eq!(*d.abi.resumed.borrow(), vec![10]);
    assert_eq!(d.abi.dispatched.borrow().len(), 2);
    let (batch, body) = d.abi.dispatched.borrow().last().cloned().unwrap();
    let body = String::from_utf8(body).unwrap();
    assert!(body.starts_with(r#"{"takes":[{"buckets":"#), "{body}");
    assert_eq!(
        body.matches("\"key\"").count(),
        2,
        "the departed request is not sent: {body}"
    );
    assert_eq!(d.abi.metric("tollgate.batch.takes"), 2);
    // Its answer: one allowed, one denied, in order.
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"results":[
            {"allowed":true,"buckets":[{"allowed":true,"limit":5,"remaining":1,"reset_ms":1,"retry_after_ms":0}]},
            {"allowed":false,"buckets":[{"allowed":false,"limit":5,"remaining":0,"reset_ms":1,"retry_after_ms":9}]}]}"#
            .to_vec(),
    );
    d.on_http_call_response(batch, 1, 400);
    assert_eq!(
        *d.abi.resumed.borrow(),
        vec![10, 11],
        "{:?}",
        d.abi.replied.borrow()
    );
    assert_eq!(*d.abi.replied.borrow(), vec![(13, 429)]);
    assert_eq!(d.pending_callouts(), 0, "nothing left waiting");
    // The denial is remembered by the worker until it could be paid (9 ms): a request meanwhile
    // is answered without a callout, and one after it calls again.
    assert_eq!(start(&mut d, 14, "/api"), PAUSE);
    assert_eq!(d.abi.dispatched.borrow().len(), 2, "denied from memory");
    assert_eq!(d.abi.replied.borrow().len(), 2, "and answered 429");
    assert_eq!(d.abi.metric("tollgate.rule.r.limited_locally"), 1);
    d.abi.clock.set(d.abi.clock.get() + 9);
    // A failed batch fails each of its requests (here: the fallback decides).
    assert_eq!(start(&mut d, 20, "/api"), PAUSE);
    let lone = last_token(&d);
    for id in [21, 22] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    allowed_reply(&d);
    d.on_http_call_response(lone, 1, 200);
    let batch = last_token(&d);
    *d.abi.reply.borrow_mut() = (None, Vec::new());
    d.on_http_call_response(batch, 0, 0);
    assert_eq!(d.abi.metric("tollgate.callout_failure.reset"), 2);
    assert_eq!(d.pending_callouts(), 0);
}

/// `service.timeout_ms` bounds a request's wait from its take: in the batch queue and in its
/// batch together. A batch's timeout is what is left of its oldest request's; a request that
/// waited it all in the queue fails as a timeout without a callout.
#[test]
fn a_queued_request_waits_no_longer_than_its_timeout_in_all() {
    let cfg = config("http", "").replace(r#""batch":0"#, r#""batch":8,"timeout_ms":20"#);
    let cfg = cfg.replace(
        r#""breaker":{"failures":10000,"open_ms":100}"#,
        r#""breaker":{"failures":10000,"open_ms":100},"failure_mode":"deny""#,
    );
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let first = last_token(&d);
    d.abi.clock.set(4);
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    // 11 ms later the first answer: 11 leaves with the 9 ms it has left.
    d.abi.clock.set(15);
    allowed_reply(&d);
    d.on_http_call_response(first, 1, 200);
    assert_eq!(*d.abi.timeouts.borrow(), vec![20, 9]);
    let batch = last_token(&d);
    assert_eq!(start(&mut d, 12, "/api"), PAUSE);
    // The batch times out at Envoy (a 504); 12 has waited its 20 ms by then.
    d.abi.clock.set(40);
    *d.abi.reply.borrow_mut() = (Some(b"504".to_vec()), Vec::new());
    d.on_http_call_response(batch, 1, 0);
    assert_eq!(d.abi.dispatched.borrow().len(), 2, "no callout for 12");
    assert_eq!(*d.abi.replied.borrow(), vec![(11, 429), (12, 429)]);
    assert_eq!(
        d.abi.metric("tollgate.callout_failure.timeout"),
        1,
        "12 was never sent: no callout of its failed"
    );
    // What the failure mode decided, by cause.
    assert_eq!(d.abi.metric("tollgate.failure_mode.timeout"), 1);
    assert_eq!(d.abi.metric("tollgate.failure_mode.queued"), 1);
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
}

/// A slow callout holds the queue back for a tick at most: once the latest callout has been out
/// a tick, the queue leaves beside it (on the tick, or at once when a take arrives), so a take
/// pays its own round trip once; up to 8 callouts in flight, after which the queue waits.
#[test]
fn a_queue_behind_a_slow_callout_leaves_after_a_tick_up_to_eight_in_flight() {
    let mut d = dispatcher(&slow_batch_config(""));
    assert_eq!(
        d.abi.tick_ms.get(),
        5,
        "a batching configuration has a tick"
    );
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let slow = last_token(&d);
    d.abi.clock.set(1);
    for id in [11, 12] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    d.abi.clock.set(4);
    d.on_tick(ROOT);
    assert_eq!(
        d.abi.dispatched.borrow().len(),
        1,
        "the callout left 4 ms ago: not yet"
    );
    d.abi.clock.set(5);
    d.on_tick(ROOT);
    assert_eq!(
        d.abi.dispatched.borrow().len(),
        2,
        "out a tick: a second batch"
    );
    let second = last_token(&d);
    assert_eq!(
        *d.abi.timeouts.borrow(),
        vec![20, 16],
        "due 20 ms after the first take queued"
    );
    // Just after a batch left, a take queues; one arriving a tick after it left takes the queue
    // along at once, without waiting for the timer.
    d.abi.clock.set(6);
    assert_eq!(start(&mut d, 13, "/api"), PAUSE);
    assert_eq!(d.abi.dispatched.borrow().len(), 2, "queued");
    d.abi.clock.set(10);
    assert_eq!(start(&mut d, 14, "/api"), PAUSE);
    assert_eq!(
        d.abi.dispatched.borrow().len(),
        3,
        "left on arrival, with the one queued"
    );
    let third = last_token(&d);
    // The later batches are answered first: their requests do not wait for the slow one.
    batch_reply(&d, &[(true, 5), (true, 5)]);
    d.on_http_call_response(second, 1, 1000);
    assert_eq!(*d.abi.resumed.borrow(), vec![11, 12]);
    batch_reply(&d, &[(true, 5), (true, 5)]);
    d.on_http_call_response(third, 1, 1000);
    assert_eq!(*d.abi.resumed.borrow(), vec![11, 12, 13, 14]);
    allowed_reply(&d);
    d.on_http_call_response(slow, 1, 200);
    assert_eq!(*d.abi.resumed.borrow(), vec![11, 12, 13, 14, 10]);
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
    // Eight callouts out: the queue waits for one of them to end.
    let mut id = 20;
    assert_eq!(start(&mut d, id, "/api"), PAUSE);
    for _ in 1..8 {
        id += 1;
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
        d.abi.clock.set(d.abi.clock.get() + 5);
        d.on_tick(ROOT);
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 3 + 8);
    id += 1;
    assert_eq!(start(&mut d, id, "/api"), PAUSE);
    d.abi.clock.set(d.abi.clock.get() + 5);
    d.on_tick(ROOT);
    assert_eq!(
        d.abi.dispatched.borrow().len(),
        11,
        "eight in flight: it waits"
    );
    let oldest = d.abi.dispatched.borrow()[3].0;
    allowed_reply(&d);
    d.on_http_call_response(oldest, 1, 200);
    assert_eq!(
        d.abi.dispatched.borrow().len(),
        12,
        "one ended: the queue left"
    );
}

/// A take never waits in the queue past its deadline, even with every callout slot held: the
/// tick fails it there, unsent.
#[test]
fn a_queued_take_never_outlives_its_deadline() {
    let mut d = dispatcher(&slow_batch_config(""));
    let mut id = 20;
    assert_eq!(start(&mut d, id, "/api"), PAUSE);
    for _ in 1..8 {
        id += 1;
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
        d.abi.clock.set(d.abi.clock.get() + 5);
        d.on_tick(ROOT);
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 8);
    // Two more queue at 35 ms (Envoy has not timed the eight out: the fake never does).
    for extra in [100, 101] {
        assert_eq!(start(&mut d, extra, "/api"), PAUSE);
    }
    let queued_at = d.abi.clock.get();
    d.abi.clock.set(queued_at + 19);
    d.on_tick(ROOT);
    assert!(d.abi.replied.borrow().iter().all(|(c, _)| *c < 100));
    d.abi.clock.set(queued_at + 20);
    d.on_tick(ROOT);
    let replied: Vec<(u32, u32)> = d
        .abi
        .replied
        .borrow()
        .iter()
        .filter(|(c, _)| *c >= 100)
        .copied()
        .collect();
    assert_eq!(
        replied,
        vec![(100, 429), (101, 429)],
        "failed at their deadline, unsent"
    );
    assert_eq!(d.abi.dispatched.borrow().len(), 8);
}

#[test]
fn an_abandoned_take_holds_the_batch_queue_until_its_answer_and_then_leaves_nothing() {
    let cfg = config("http", "").replace(r#""batch":0"#, r#""batch":8"#);
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let first = last_token(&d);
    disconnect(&mut d, 10);
    assert_eq!(d.pending_callouts(), 0, "no request waits");
    assert_eq!(
        d.ledger_entries(),
        1,
        "but the callout is still Envoy's, in flight"
    );
    // The next request queues behind it (the service is still busy with it).
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    assert_eq!(d.abi.dispatched.borrow().len(), 1);
    allowed_reply(&d);
    d.on_http_call_response(first, 1, 200);
    assert!(
        d.abi.resumed.borrow().is_empty(),
        "the abandoned answer is dropped"
    );
    let batch = last_token(&d);
    batch_reply(&d, &[(true, 5)]);
    d.on_http_call_response(batch, 1, 200);
    assert_eq!(*d.abi.resumed.borrow(), vec![11]);
    d.on_delete(11);
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
}

#[test]
fn a_queue_the_byte_bounds_split_leaves_in_several_batches_at_once() {
    // 12 rules on every request: 63 queued takes would be answered with ~130 KB in one batch.
    let rules: Vec<String> = (0..12)
        .map(|i| {
            format!(
                r#"{{"name":"r{i}","key":["literal:{i}"],"capacity":1000000,"period_ms":1000}}"#
            )
        })
        .collect();
    let cfg = format!(
        r#"{{"service":{{"cluster":"svc","transport":"http","batch":64}},"rules":[{}]}}"#,
        rules.join(",")
    );
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 10, "/"), PAUSE);
    let first = last_token(&d);
    for id in 11..74 {
        assert_eq!(start(&mut d, id, "/"), PAUSE, "request {id} queued");
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 1);
    *d.abi.reply.borrow_mut() = (Some(b"503".to_vec()), Vec::new());
    d.on_http_call_response(first, 1, 0);
    let sent = d.abi.dispatched.borrow();
    let batches: Vec<usize> = sent[1..]
        .iter()
        .map(|(_, b)| String::from_utf8_lossy(b).matches("\"buckets\"").count())
        .collect();
    assert!(batches.len() >= 2, "{batches:?}");
    assert_eq!(
        batches.iter().sum::<usize>(),
        63,
        "every queued take left: {batches:?}"
    );
    for n in &batches {
        assert!(contract::bounds::batch_answer_bytes(*n, n * 12) <= MAX_ANSWER_BYTES);
    }
    assert_eq!(d.abi.metric("tollgate.callout_failure.dispatch"), 0);
}

/// A burst larger than the batch queue: the takes it cannot hold fail here, decided by the
/// failure mode with cause `queued`, and never open the breaker (a full queue is this worker's
/// own bound, no news of the service), however many there are.
#[test]
fn a_full_batch_queue_never_opens_the_breaker() {
    let cfg = config("http", r#","failure_mode":"deny""#)
        .replace(r#""batch":0"#, r#""batch":2"#)
        .replace(r#""failures":10000"#, r#""failures":2"#);
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    // A queue of 4 × 2 behind it, then 6 that find it full.
    for id in 11..25 {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    assert_eq!(
        d.abi.dispatched.borrow().len(),
        1,
        "one callout out, 8 queued"
    );
    assert_eq!(d.abi.replied.borrow().len(), 6, "the rest denied here");
    assert_eq!(d.abi.metric("tollgate.failure_mode.queued"), 6);
    assert_eq!(d.abi.metric("tollgate.callout_failure.dispatch"), 0);
    assert_eq!(d.abi.metric("tollgate.breaker.opened"), 0);
    // The service answers: the next request calls as usual.
    allowed_reply(&d);
    d.on_http_call_response(last_token(&d), 1, 200);
    assert_eq!(start(&mut d, 30, "/api"), PAUSE);
    assert_eq!(d.abi.metric("tollgate.breaker.opened"), 0);
}
