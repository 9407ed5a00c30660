//! The stream of takes (transport `grpc`, `service.stream`) as the dispatcher drives it against
//! the fake host: one stream per configuration and worker, each batch a message on it with its
//! id, answers matched by id in any order, a deadline per message on the tick (each fails alone),
//! a stream given up when it falls silent, and what a stream's end, a lost stream and a removed
//! configuration leave.

use super::*;
use contract::proto::{put_bytes, put_u64, Field, Reader};

/// A streaming configuration (the default for `grpc`): batches of up to `batch` takes, a 20 ms
/// timeout, a bearer token, denials not remembered (each request here asks the service).
fn stream_config(batch: usize, extra: &str) -> String {
    format!(
        r#"{{"service":{{"cluster":"svc","transport":"grpc","batch":{batch},"timeout_ms":20,
                       "token":"s3","remember_denials_ms":0}},
             "rules":[{{"name":"r","match":{{"path_prefix":"/api"}},"key":["literal:k"],"capacity":5,"period_ms":60000}}],
             "breaker":{{"failures":10000,"open_ms":100}}{extra}}}"#
    )
}

/// The `i`-th message sent: its id and the number of takes it carries.
fn message(d: &Dispatcher<Fake>, i: usize) -> (u64, usize) {
    let sent = d.abi.stream_sent.borrow()[i].1.clone();
    let mut r = Reader::new(&sent);
    let (mut id, mut takes) = (0, 0);
    while let Some((field, value)) = r.field().unwrap() {
        match (field, value) {
            (1, _) => takes += 1,
            (3, Field::Varint(n)) => id = n,
            _ => {}
        }
    }
    (id, takes)
}

/// A `TakeResponse` of one bucket, allowed (granting `granted`) or denied.
fn take_answer(ok: bool, granted: u64) -> Vec<u8> {
    let mut bucket = Vec::new();
    put_u64(&mut bucket, 1, u64::from(ok));
    put_u64(&mut bucket, 2, 5);
    put_u64(&mut bucket, 3, if ok { 4 } else { 0 });
    put_u64(&mut bucket, 4, 1000);
    put_u64(&mut bucket, 5, if ok { 0 } else { 1000 });
    put_u64(&mut bucket, 6, granted);
    let mut take = Vec::new();
    put_u64(&mut take, 1, u64::from(ok));
    put_bytes(&mut take, 2, &bucket);
    take
}

/// The answer to message `id`: one `TakeResponse` per take, allowed or denied in turn (a
/// `TakeBatchResponse` with its id), ready to be read; its size.
fn answer_id(d: &Dispatcher<Fake>, id: u64, allowed: &[bool]) -> usize {
    let mut body = Vec::new();
    for &ok in allowed {
        put_bytes(&mut body, 1, &take_answer(ok, u64::from(ok)));
    }
    put_u64(&mut body, 2, id);
    let n = body.len();
    *d.abi.reply.borrow_mut() = (None, body);
    n
}

/// The answer to the `i`-th message sent (see [`answer_id`]).
fn answer(d: &Dispatcher<Fake>, i: usize, allowed: &[bool]) -> usize {
    let (id, takes) = message(d, i);
    assert_eq!(takes, allowed.len(), "message {i} carries {takes} takes");
    answer_id(d, id, allowed)
}

/// The answer to the `i`-th message sent: its error (`MessageError { code, message }`).
fn error_answer(d: &Dispatcher<Fake>, i: usize, code: u64, text: &str) -> usize {
    let mut error = Vec::new();
    put_u64(&mut error, 1, code);
    put_bytes(&mut error, 2, text.as_bytes());
    let mut body = Vec::new();
    put_u64(&mut body, 2, message(d, i).0);
    put_bytes(&mut body, 3, &error);
    let n = body.len();
    *d.abi.reply.borrow_mut() = (None, body);
    n
}

fn streams(d: &Dispatcher<Fake>) -> Vec<u32> {
    d.abi.streams.borrow().iter().map(|(t, _)| *t).collect()
}

fn messages(d: &Dispatcher<Fake>) -> usize {
    d.abi.stream_sent.borrow().len()
}

fn later(d: &Dispatcher<Fake>, ms: u64) {
    d.abi.clock.set(d.abi.clock.get() + ms);
}

#[test]
fn takes_ride_one_stream_as_messages_answered_by_their_id() {
    let mut d = dispatcher(&stream_config(8, ""));
    assert_eq!(
        d.abi.tick_ms.get(),
        5,
        "an eighth of the 20 ms timeout, at least 5"
    );
    // A lone request opens the stream, its bearer token in the metadata, and sends at once.
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let s = streams(&d);
    assert_eq!(s.len(), 1);
    assert_eq!(
        d.abi.streams.borrow()[0].1,
        vec![("authorization".to_string(), "Bearer s3".to_string())]
    );
    assert_eq!(messages(&d), 1);
    assert!(d.abi.dispatched.borrow().is_empty(), "no call of its own");
    let (first, _) = message(&d, 0);
    assert!(first >= 1 << 32, "an id of the VM's own: {first}");
    // Two more while it is in flight: queued.
    for id in [11, 12] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    assert_eq!(messages(&d), 1);
    // The answer resumes the first; the queue leaves as one message on the same stream.
    let n = answer(&d, 0, &[true]);
    d.on_grpc_receive(s[0], n);
    assert_eq!(*d.abi.resumed.borrow(), vec![10]);
    assert_eq!(messages(&d), 2);
    assert_eq!(d.abi.stream_sent.borrow()[1].0, s[0]);
    let (second, takes) = message(&d, 1);
    assert_eq!(takes, 2, "a TakeBatchRequest of the two queued takes");
    assert_ne!(second, first);
    assert_eq!(d.abi.metric("tollgate.batch.takes"), 3);
    // An answer naming no message of ours (or one answered already) is no one's.
    for id in [first, 7, second + 1_000] {
        let n = answer_id(&d, id, &[true, true]);
        d.on_grpc_receive(s[0], n);
    }
    assert_eq!(d.abi.resumed.borrow().len(), 1);
    // Its answer, by its id: 11 allowed, 12 denied.
    let n = answer(&d, 1, &[true, false]);
    d.on_grpc_receive(s[0], n);
    assert_eq!(*d.abi.resumed.borrow(), vec![10, 11]);
    assert_eq!(*d.abi.replied.borrow(), vec![(12, 429)]);
    // One stream all along, and nothing left in the ledger but the stream itself.
    assert_eq!(streams(&d).len(), 1);
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 1));
    assert_eq!(d.abi.metric("tollgate.callouts.pending"), 0);
}

#[test]
fn answers_in_any_order_reach_their_own_requests() {
    // No batching: each take its own message, all in flight at once.
    let mut d = dispatcher(&stream_config(0, ""));
    for id in 10..16 {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    let s = streams(&d)[0];
    assert_eq!(messages(&d), 6);
    // Answered last first, each allowed or denied by its request's parity.
    for i in [5, 2, 4, 0, 3, 1] {
        let ok = i % 2 == 0;
        let n = answer(&d, i, &[ok]);
        d.on_grpc_receive(s, n);
        let request = 10 + u32::try_from(i).unwrap();
        if ok {
            assert_eq!(d.abi.resumed.borrow().last(), Some(&request));
        } else {
            assert_eq!(d.abi.replied.borrow().last(), Some(&(request, 429)));
        }
    }
    assert_eq!(*d.abi.resumed.borrow(), vec![12, 14, 10]);
    assert_eq!(
        *d.abi.replied.borrow(),
        vec![(15, 429), (13, 429), (11, 429)]
    );
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 1));
}

#[test]
fn a_queue_behind_a_slow_message_leaves_as_another_message_after_a_tick() {
    let mut d = dispatcher(&stream_config(8, ""));
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    later(&d, 1);
    for id in [11, 12] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    later(&d, 3);
    d.on_tick(ROOT);
    assert_eq!(messages(&d), 1, "waited 3 ms: behind the first");
    later(&d, 2);
    d.on_tick(ROOT);
    assert_eq!(messages(&d), 2, "a tick: a second message beside the first");
    assert_eq!(message(&d, 1).1, 2);
    let s = streams(&d)[0];
    // The second is answered first: 11 and 12 do not wait for 10's slow answer.
    let n = answer(&d, 1, &[true, true]);
    d.on_grpc_receive(s, n);
    assert_eq!(*d.abi.resumed.borrow(), vec![11, 12]);
    let n = answer(&d, 0, &[true]);
    d.on_grpc_receive(s, n);
    assert_eq!(*d.abi.resumed.borrow(), vec![11, 12, 10]);
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 1));
}

#[test]
fn a_message_past_its_deadline_fails_alone_and_the_stream_goes_on() {
    let mut d = dispatcher(&stream_config(0, r#","failure_mode":"deny""#));
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    later(&d, 5);
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    let s = streams(&d)[0];
    // 11 is answered at once; 10 is slow.
    let n = answer(&d, 1, &[true]);
    d.on_grpc_receive(s, n);
    assert_eq!(*d.abi.resumed.borrow(), vec![11]);
    later(&d, 14);
    d.on_tick(ROOT);
    assert!(d.abi.replied.borrow().is_empty(), "not due yet");
    later(&d, 1);
    d.on_tick(ROOT);
    // 10 fails as a timeout, alone: the stream is not cancelled.
    assert_eq!(*d.abi.replied.borrow(), vec![(10, 429)]);
    assert_eq!(d.abi.metric("tollgate.callout_failure.timeout"), 1);
    assert!(d.abi.cancelled.borrow().is_empty());
    // The next message goes on the same stream and is answered.
    assert_eq!(start(&mut d, 12, "/api"), PAUSE);
    assert_eq!(streams(&d), vec![s]);
    let n = answer(&d, 2, &[true]);
    d.on_grpc_receive(s, n);
    assert_eq!(*d.abi.resumed.borrow(), vec![11, 12]);
    // 10's answer, late, resumes nothing.
    let n = answer(&d, 0, &[false]);
    d.on_grpc_receive(s, n);
    assert_eq!(d.abi.replied.borrow().len(), 1);
    assert_eq!(d.pending_callouts(), 0);
}

#[test]
fn a_late_grant_goes_back_to_the_service_and_a_late_denial_needs_nothing() {
    let mut d = dispatcher(&stream_config(8, r#","failure_mode":"deny""#));
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    for id in [11, 12, 13] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    let s = streams(&d)[0];
    later(&d, 1);
    let n = answer(&d, 0, &[true]);
    d.on_grpc_receive(s, n);
    assert_eq!(message(&d, 1).1, 3, "the queue left as one message");
    // Due 20 ms after the takes queued: it fails alone, the stream answered 19 ms ago.
    later(&d, 19);
    d.on_tick(ROOT);
    assert_eq!(
        *d.abi.replied.borrow(),
        vec![(11, 429), (12, 429), (13, 429)]
    );
    assert!(d.abi.cancelled.borrow().is_empty());
    assert_eq!(
        d.ledger_entries(),
        2,
        "the stream, and the message awaited late"
    );
    // Its answer comes: 11 granted 1 token, 12 granted 3 (a lease, or a debt repaid), 13 denied.
    let mut body = Vec::new();
    for (ok, granted) in [(true, 1), (true, 3), (false, 0)] {
        put_bytes(&mut body, 1, &take_answer(ok, granted));
    }
    put_u64(&mut body, 2, message(&d, 1).0);
    let n = body.len();
    *d.abi.reply.borrow_mut() = (None, body);
    let before = d.abi.dispatched.borrow().len();
    d.on_grpc_receive(s, n);
    // No request saw those tokens: one refund gives the 4 back to their bucket.
    let sent = d.abi.dispatched.borrow()[before..].to_vec();
    assert_eq!(sent.len(), 1);
    let refund: serde_json::Value = serde_json::from_slice(&sent[0].1).unwrap();
    assert_eq!(refund["buckets"].as_array().map(Vec::len), Some(1));
    assert_eq!(refund["buckets"][0]["key"], "r|k");
    assert_eq!(refund["buckets"][0]["cost"], 4);
    assert!(refund["buckets"][0].get("lease").is_none());
    assert_eq!(d.abi.metric("tollgate.stream.late"), 1);
    assert_eq!(d.abi.metric("tollgate.stream.returned"), 4);
    assert!(d.abi.resumed.borrow().len() == 1, "nothing resumed by it");
    assert_eq!(d.ledger_entries(), 2, "the stream and the refund in flight");
    // A late denial: counted, nothing sent; and a message awaited late is forgotten with its
    // stream when that falls silent.
    let mut d = dispatcher(&stream_config(0, r#","failure_mode":"deny""#));
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    later(&d, 5);
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    let s = streams(&d)[0];
    let n = answer(&d, 1, &[true]);
    d.on_grpc_receive(s, n);
    later(&d, 15);
    d.on_tick(ROOT);
    assert_eq!(*d.abi.replied.borrow(), vec![(10, 429)]);
    let n = answer(&d, 0, &[false]);
    let before = d.abi.dispatched.borrow().len();
    d.on_grpc_receive(s, n);
    assert_eq!(d.abi.dispatched.borrow().len(), before);
    assert_eq!(d.abi.metric("tollgate.stream.late"), 1);
    assert_eq!(d.abi.metric("tollgate.stream.returned"), 0);
    assert_eq!(start(&mut d, 12, "/api"), PAUSE);
    later(&d, 1);
    assert_eq!(start(&mut d, 13, "/api"), PAUSE);
    let n = answer(&d, 3, &[true]);
    later(&d, 9);
    d.on_grpc_receive(s, n);
    later(&d, 10);
    d.on_tick(ROOT);
    assert_eq!(d.abi.replied.borrow().last(), Some(&(12, 429)));
    assert_eq!(
        d.ledger_entries(),
        2,
        "the stream, and 12's message awaited late"
    );
    later(&d, 20);
    d.on_tick(ROOT);
    assert_eq!(*d.abi.cancelled.borrow(), vec![s], "silent for the timeout");
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
}

#[test]
fn timeouts_among_answers_do_not_open_the_breaker() {
    let cfg = stream_config(0, r#","failure_mode":"deny""#)
        .replace(r#""failures":10000"#, r#""failures":2"#);
    let mut d = dispatcher(&cfg);
    for id in 10..16 {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    let s = streams(&d)[0];
    // Four answered, slowly (they reset what failed meanwhile); two time out on one tick.
    later(&d, 10);
    for i in [1, 3, 4, 5] {
        let n = answer(&d, i, &[true]);
        d.on_grpc_receive(s, n);
    }
    later(&d, 10);
    d.on_tick(ROOT);
    assert_eq!(*d.abi.replied.borrow(), vec![(10, 429), (12, 429)]);
    assert_eq!(d.abi.metric("tollgate.callout_failure.timeout"), 2);
    assert_eq!(
        d.abi.metric("tollgate.breaker.opened"),
        0,
        "one tick's timeouts: one failure"
    );
    // Answers go on; then two timeouts in a row with nothing answered between open it.
    for id in [20, 21] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
        later(&d, 10);
        let n = answer(&d, messages(&d) - 1, &[true]);
        d.on_grpc_receive(s, n);
        later(&d, 10);
    }
    for id in [30, 31] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
        later(&d, 20);
        d.on_tick(ROOT);
    }
    assert_eq!(d.abi.metric("tollgate.breaker.opened"), 1);
}

#[test]
fn an_error_answer_fails_its_message_alone() {
    let mut d = dispatcher(&stream_config(0, r#","failure_mode":"deny""#));
    for id in [10, 11, 12] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    let s = streams(&d)[0];
    // The service shed 11's message: UNAVAILABLE, as a unary call would have ended.
    let n = error_answer(&d, 1, 14, "shed: at the take limit");
    d.on_grpc_receive(s, n);
    assert_eq!(*d.abi.replied.borrow(), vec![(11, 429)]);
    assert_eq!(d.abi.metric("tollgate.callout_failure.grpc_status"), 1);
    // An invalid message: INVALID_ARGUMENT, its own failure.
    let n = error_answer(&d, 2, 3, "buckets[0].key: empty");
    d.on_grpc_receive(s, n);
    assert_eq!(d.abi.metric("tollgate.callout_failure.grpc_status"), 2);
    // The stream goes on: 10 is answered on it.
    let n = answer(&d, 0, &[true]);
    d.on_grpc_receive(s, n);
    assert_eq!(*d.abi.resumed.borrow(), vec![10]);
    assert!(d.abi.cancelled.borrow().is_empty());
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 1));
}

#[test]
fn a_stream_that_answers_nothing_for_the_timeout_is_cancelled_and_its_messages_fail() {
    let mut d = dispatcher(&stream_config(8, r#","failure_mode":"deny""#));
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    // Queued behind it, then sent beside it once it waited a tick.
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    later(&d, 5);
    d.on_tick(ROOT);
    assert_eq!(messages(&d), 2);
    let old = streams(&d)[0];
    later(&d, 14);
    d.on_tick(ROOT);
    assert!(d.abi.replied.borrow().is_empty(), "not due yet");
    later(&d, 1);
    d.on_tick(ROOT);
    // Nothing heard for 20 ms: the stream is cancelled and both its messages fail as timeouts.
    assert_eq!(*d.abi.cancelled.borrow(), vec![old]);
    assert_eq!(*d.abi.replied.borrow(), vec![(10, 429), (11, 429)]);
    assert_eq!(d.abi.metric("tollgate.callout_failure.timeout"), 2);
    assert_eq!(d.ledger_entries(), 0);
    // The next take opens a new stream at once (the first stream in a row to answer nothing).
    assert_eq!(start(&mut d, 12, "/api"), PAUSE);
    let s = streams(&d);
    assert_eq!(s.len(), 2);
    assert_eq!(d.abi.stream_sent.borrow().last().map(|m| m.0), Some(s[1]));
    // An answer on the cancelled stream touches nothing; the new stream's answer resumes 12.
    let n = answer(&d, 0, &[true]);
    d.on_grpc_receive(old, n);
    assert!(d.abi.resumed.borrow().is_empty());
    let n = answer(&d, 2, &[true]);
    d.on_grpc_receive(s[1], n);
    assert_eq!(*d.abi.resumed.borrow(), vec![12]);
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 1));
}

#[test]
fn a_stream_that_ends_fails_its_messages_and_is_reopened_with_backoff() {
    let mut d = dispatcher(&stream_config(8, r#","failure_mode":"deny""#));
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let first = streams(&d)[0];
    let n = answer(&d, 0, &[true]);
    d.on_grpc_receive(first, n);
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    // The service ends the stream (a replica shutting down): Envoy's entry is freed, the
    // message in flight fails with the stream's status.
    d.on_grpc_close(first, 14);
    assert_eq!(*d.abi.cancelled.borrow(), vec![first]);
    assert_eq!(*d.abi.replied.borrow(), vec![(11, 429)]);
    assert_eq!(d.abi.metric("tollgate.callout_failure.grpc_status"), 1);
    assert_eq!(d.ledger_entries(), 0);
    // It had answered: the next take opens a new stream at once.
    assert_eq!(start(&mut d, 12, "/api"), PAUSE);
    assert_eq!(streams(&d).len(), 2);
    // Streams that answer nothing: the first reopens at once, the second waits 10 ms, and a take
    // meanwhile fails at once (a dispatch error), opening nothing.
    d.on_grpc_close(streams(&d)[1], 14);
    assert_eq!(start(&mut d, 13, "/api"), PAUSE);
    assert_eq!(streams(&d).len(), 3);
    d.on_grpc_close(streams(&d)[2], 14);
    assert_eq!(start(&mut d, 14, "/api"), PAUSE);
    assert_eq!(streams(&d).len(), 3, "backing off");
    assert_eq!(d.abi.replied.borrow().last(), Some(&(14, 429)));
    assert_eq!(d.abi.metric("tollgate.callout_failure.dispatch"), 1);
    later(&d, 10);
    assert_eq!(start(&mut d, 15, "/api"), PAUSE);
    assert_eq!(streams(&d).len(), 4);
    // A late close of a stream that is gone is no one's.
    d.on_grpc_close(first, 14);
    assert_eq!(d.pending_callouts(), 1);
    let n = answer(&d, messages(&d) - 1, &[true]);
    d.on_grpc_receive(streams(&d)[3], n);
    assert_eq!(d.abi.resumed.borrow().last(), Some(&15));
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 1));
}

#[test]
fn an_old_stream_is_replaced_when_idle() {
    let mut d = dispatcher(&stream_config(8, ""));
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let first = streams(&d)[0];
    let n = answer(&d, 0, &[true]);
    d.on_grpc_receive(first, n);
    later(&d, 29_999);
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    assert_eq!(streams(&d).len(), 1, "young enough");
    let n = answer(&d, 1, &[true]);
    d.on_grpc_receive(first, n);
    later(&d, 1);
    assert_eq!(start(&mut d, 12, "/api"), PAUSE);
    // Idle and 30 s old: cancelled (nothing was in flight) and replaced.
    assert_eq!(*d.abi.cancelled.borrow(), vec![first]);
    let s = streams(&d);
    assert_eq!(s.len(), 2);
    let n = answer(&d, 2, &[true]);
    d.on_grpc_receive(s[1], n);
    assert_eq!(*d.abi.resumed.borrow(), vec![10, 11, 12]);
    assert_eq!(d.ledger_entries(), 1);
}

#[test]
fn a_send_envoy_refuses_fails_at_once_and_the_lost_streams_messages_on_the_next_tick() {
    // No batching: each take is its own message, sent at once (several in flight).
    let mut d = dispatcher(&stream_config(0, r#","failure_mode":"deny""#));
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    assert_eq!(messages(&d), 2);
    d.abi.refuse_send.set(Some(abi::NOT_FOUND));
    assert_eq!(start(&mut d, 12, "/api"), PAUSE);
    assert_eq!(*d.abi.replied.borrow(), vec![(12, 429)], "failed at once");
    // The two messages in flight on the lost stream fail on the next tick.
    d.abi.refuse_send.set(None);
    d.on_tick(ROOT);
    assert_eq!(
        *d.abi.replied.borrow(),
        vec![(12, 429), (10, 429), (11, 429)]
    );
    assert!(
        d.abi.cancelled.borrow().is_empty(),
        "Envoy forgot it already"
    );
    // The next take opens a new stream.
    assert_eq!(start(&mut d, 13, "/api"), PAUSE);
    assert_eq!(streams(&d).len(), 2);
    // The stream, its message and the request waiting for it.
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (1, 3));
}

#[test]
fn a_removed_configuration_takes_its_stream_and_fails_its_waiting_requests() {
    let cfg = stream_config(8, r#","failure_mode":"deny""#);
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    configure(&mut d, 7, &cfg);
    d.on_delete(ROOT);
    // Envoy reset the old root's stream without a word: both requests take the failure path.
    let mut replied = d.abi.replied.borrow().clone();
    replied.sort_unstable();
    assert_eq!(replied, vec![(10, 429), (11, 429)]);
    assert_eq!(d.ledger_entries(), 0);
    // The new configuration opens a stream of its own.
    assert_eq!(start_on(&mut d, 7, 12, "/api"), PAUSE);
    assert_eq!(streams(&d).len(), 2);
}

#[test]
fn another_configurations_message_id_is_not_ours() {
    // Two configurations of one VM, each with its stream: an answer on one stream naming the
    // other's message (a confused service) answers nothing.
    let cfg = stream_config(0, "");
    let mut d = dispatcher(&cfg);
    configure(&mut d, 7, &cfg);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    assert_eq!(start_on(&mut d, 7, 20, "/api"), PAUSE);
    let s = streams(&d);
    assert_eq!(s.len(), 2);
    let n = answer(&d, 1, &[true]);
    d.on_grpc_receive(s[0], n);
    assert!(d.abi.resumed.borrow().is_empty());
    d.on_grpc_receive(s[1], n);
    assert_eq!(*d.abi.resumed.borrow(), vec![20]);
}

#[test]
fn a_traced_take_and_a_configuration_that_does_not_stream_make_calls_of_their_own() {
    let unary = stream_config(0, "").replace(r#""batch":0"#, r#""batch":0,"stream":false"#);
    let mut d = dispatcher(&unary);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    assert_eq!(d.abi.dispatched.borrow().len(), 1);
    assert!(streams(&d).is_empty());
    assert_eq!(d.abi.tick_ms.get(), 0, "no timer needed");
    let traced = stream_config(8, "").replace(r#""batch":8"#, r#""batch":8,"trace":true"#);
    let mut d = dispatcher(&traced);
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    assert_eq!(start_traced(&mut d, 10, tp), PAUSE);
    assert_eq!(d.abi.dispatched.borrow().len(), 1, "the traced take alone");
    assert!(streams(&d).is_empty());
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    assert_eq!(streams(&d).len(), 1, "an untraced one on the stream");
}

/// Steady exact requests on the stream, one after another: each sends one message and is
/// resumed by its answer, and nothing is left behind (no callout pending, no context, nothing
/// queued). Also the driver of a native profile of the module's own work on this path
/// (BENCHMARKS.md): `TOLLGATE_PROFILE_REQUESTS=20000 valgrind --tool=callgrind <the lib test
/// binary> --exact host::dispatch::tests::stream::steady_exact_requests_leave_nothing_behind`.
#[test]
fn steady_exact_requests_leave_nothing_behind() {
    let n: u32 = std::env::var("TOLLGATE_PROFILE_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let mut d = dispatcher(&stream_config(64, ""));
    for id in 10..10 + n {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
        let i = d.abi.stream_sent.borrow().len() - 1;
        assert_eq!(i, (id - 10) as usize, "one message per request");
        let size = answer(&d, i, &[true]);
        let token = d.abi.stream_sent.borrow()[i].0;
        d.on_grpc_receive(token, size);
        assert_eq!(d.abi.resumed.borrow().last(), Some(&id));
        d.on_response_headers(id, false);
        disconnect(&mut d, id);
    }
    assert_eq!(d.abi.resumed.borrow().len(), n as usize);
    assert_eq!(d.pending_callouts(), 0);
    assert_eq!(d.live_requests(), 0);
    assert_eq!(d.abi.metric("tollgate.allowed"), i64::from(n));
}

/// A flood after one denial: every request is answered 429 from the remembered denial, with its
/// `Retry-After`, and none asks the service. Also the driver of the native profile of that path
/// (`TOLLGATE_PROFILE_REQUESTS`, as [`steady_exact_requests_leave_nothing_behind`]).
#[test]
fn a_flood_after_a_denial_is_answered_from_memory() {
    let n: u32 = std::env::var("TOLLGATE_PROFILE_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let cfg = stream_config(64, "").replace(r#","remember_denials_ms":0"#, "");
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 9, "/api"), PAUSE);
    let size = answer(&d, 0, &[false]);
    let token = d.abi.stream_sent.borrow()[0].0;
    d.on_grpc_receive(token, size);
    for id in 10..10 + n {
        assert_eq!(start(&mut d, id, "/api"), PAUSE, "answered locally");
        d.on_response_headers(id, false);
        disconnect(&mut d, id);
    }
    assert_eq!(
        d.abi.stream_sent.borrow().len(),
        1,
        "one message: the first"
    );
    let replied = d.abi.replied.borrow();
    assert_eq!(replied.len(), n as usize + 1);
    assert!(replied.iter().all(|&(_, status)| status == 429));
    assert!(d
        .abi
        .retry_after
        .borrow()
        .iter()
        .all(|r| r.as_deref() == Some("1")));
}

/// The native build's calls end with the request that made them: a message whose request went
/// is cancelled with it, and the adapter says so. It leaves the stream and the ledger as if
/// nobody waited for it: no timeout at its deadline, no silent stream given up, the next request
/// on the same stream.
#[test]
fn a_message_abandoned_with_its_request_fails_nothing_at_its_deadline() {
    let mut d = dispatcher(&stream_config(0, r#","failure_mode":"deny""#));
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let s = streams(&d)[0];
    let (id, takes) = message(&d, 0);
    assert_eq!(takes, 1);
    d.on_delete(10);
    d.on_message_abandoned(s, CalloutId(id));
    assert_eq!(d.ledger_entries(), 1, "the stream only");
    // Past its deadline and the stream's silence: nothing fails, nothing is cancelled.
    later(&d, 100);
    d.on_tick(ROOT);
    assert_eq!(d.abi.metric("tollgate.callout_failure.timeout"), 0);
    assert!(d.abi.cancelled.borrow().is_empty());
    assert!(d.abi.replied.borrow().is_empty());
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    assert_eq!(streams(&d), vec![s]);
    let n = answer(&d, 1, &[true]);
    d.on_grpc_receive(s, n);
    assert_eq!(*d.abi.resumed.borrow(), vec![11]);
    // A message nobody knows, or another stream's, changes nothing.
    d.on_message_abandoned(s, CalloutId(id));
    d.on_message_abandoned(s + 1, CalloutId(id));
    assert_eq!(d.ledger_entries(), 1);
}

/// The native build's stream sends each message as its own call: a call that fails fails its
/// message alone, as an error answer would, and the stream goes on.
#[test]
fn a_message_whose_call_failed_fails_alone() {
    let mut d = dispatcher(&stream_config(0, r#","failure_mode":"deny""#));
    for id in [10, 11] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    let s = streams(&d)[0];
    let (id, _) = message(&d, 1);
    d.on_message_failed(
        s,
        CalloutId(id),
        14,
        Some("shed: at the take limit".to_string()),
    );
    assert_eq!(*d.abi.replied.borrow(), vec![(11, 429)]);
    assert_eq!(d.abi.metric("tollgate.callout_failure.grpc_status"), 1);
    assert!(d.abi.cancelled.borrow().is_empty());
    // Said twice, or of a message nobody knows: nothing more.
    d.on_message_failed(s, CalloutId(id), 14, None);
    assert_eq!(d.abi.replied.borrow().len(), 1);
    let n = answer(&d, 0, &[true]);
    d.on_grpc_receive(s, n);
    assert_eq!(*d.abi.resumed.borrow(), vec![10]);
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 1));
}
