//! Answers paced ([`crate::host::pace`]): Envoy queues each resume and local reply until the
//! module's callback returns and runs them one inside another when they call back into the VM,
//! so no round (from one callback Envoy makes from its event loop to the next) asks more than
//! [`MAX_ANSWERS_PER_ROUND`] of it; the rest wait, oldest first, and the timer runs fast until
//! they are out.

use super::*;
use crate::host::pace::MAX_ANSWERS_PER_ROUND;

/// A streaming configuration with batches of 64, a 200 ms timeout (a 25 ms tick), denying when
/// the service does not answer.
fn deny_config() -> String {
    r#"{"service":{"cluster":"svc","transport":"grpc","batch":64,"timeout_ms":200,
                   "remember_denials_ms":0},
        "rules":[{"name":"r","match":{"path_prefix":"/api"},"key":["literal:k"],"capacity":5,"period_ms":60000}],
        "breaker":{"failures":10000,"open_ms":100},"failure_mode":"deny"}"#
        .to_string()
}

/// Requests `ids` start, the first a message on the stream, the others queued behind it; then
/// the clock passes their timeout. Envoy's own period for the timer.
fn waiting_past_the_timeout(d: &mut Dispatcher<Fake>, ids: std::ops::Range<u32>) -> u32 {
    d.abi.known.borrow_mut().push(ROOT);
    let period = d.abi.tick_ms.get();
    assert_eq!(period, 25);
    for id in ids {
        assert_eq!(start(d, id, "/api"), PAUSE);
    }
    assert_eq!(
        d.abi.stream_sent.borrow().len(),
        1,
        "one message, the rest queued"
    );
    assert!(d.abi.replied.borrow().is_empty());
    d.abi.clock.set(d.abi.clock.get() + 200);
    period
}

fn replied(d: &Dispatcher<Fake>) -> Vec<u32> {
    d.abi.replied.borrow().iter().map(|(c, _)| *c).collect()
}

#[test]
fn a_tick_that_fails_200_requests_answers_a_round_of_them_and_the_rest_on_the_next_ticks() {
    let mut d = dispatcher(&deny_config());
    let period = waiting_past_the_timeout(&mut d, 100..300);
    // One tick fails them all (the message past its deadline, the queue its whole timeout):
    // one round's worth is answered, the timer runs fast for the rest.
    d.on_tick(ROOT);
    assert_eq!(replied(&d), (100..164).collect::<Vec<_>>());
    assert_eq!(d.abi.tick_ms.get(), flow::HOLD_TICK_MS);
    assert_eq!(d.pending_callouts(), 0, "every take is decided");
    // Each tick is a round: the next 64 in order, then the last 8; the timer slows down again.
    d.on_tick(ROOT);
    assert_eq!(replied(&d), (100..228).collect::<Vec<_>>());
    d.on_tick(ROOT);
    d.on_tick(ROOT);
    assert_eq!(replied(&d), (100..300).collect::<Vec<_>>(), "each once");
    assert!(d.abi.replied.borrow().iter().all(|(_, s)| *s == 429));
    assert_eq!(
        d.abi.tick_ms.get(),
        period,
        "none waits: its own period again"
    );
    d.on_tick(ROOT);
    assert_eq!(replied(&d).len(), 200);
}

#[test]
fn only_callbacks_from_envoys_event_loop_begin_a_round_and_a_request_gone_is_not_answered() {
    let mut d = dispatcher(&deny_config());
    waiting_past_the_timeout(&mut d, 100..300);
    d.on_tick(ROOT);
    assert_eq!(replied(&d).len(), MAX_ANSWERS_PER_ROUND);
    // Envoy may run these from its queue of actions, inside the answers just given: they begin
    // no round. Request 200 goes away while its answer waits.
    disconnect(&mut d, 200);
    d.on_http_call_response(12_345, 0, 0);
    d.on_grpc_close(12_345, 14);
    assert_eq!(replied(&d).len(), MAX_ANSWERS_PER_ROUND);
    // A request's headers are read off the network: a round, the oldest answers first, its own
    // (429: the bucket's service still does not answer, so it queues and waits) behind them.
    assert_eq!(start(&mut d, 400, "/api"), PAUSE);
    let oldest: Vec<u32> = (100..229).filter(|c| *c != 200).collect();
    assert_eq!(replied(&d), oldest);
    // A message received is a round too (this one names no message: it only ends the round).
    let stream = d.abi.streams.borrow()[0].0;
    d.on_grpc_receive(stream, 0);
    let oldest: Vec<u32> = (100..293).filter(|c| *c != 200).collect();
    assert_eq!(replied(&d), oldest);
    // The timer's next round ends the backlog.
    d.on_tick(ROOT);
    let all: Vec<u32> = (100..300).filter(|c| *c != 200).collect();
    assert_eq!(replied(&d), all);
}
