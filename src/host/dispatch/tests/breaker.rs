//! The breaker: takes that expire in the queue and the shares of one failed batch do not open it;
//! slow successes reset the failures counted while they were out.

use super::*;

/// The breaker opens on the service failing, not on takes that queued too long, nor once per take
/// of one failed batch.
#[test]
fn takes_that_expire_in_the_queue_and_shares_of_one_failed_batch_do_not_open_the_breaker() {
    let cfg = slow_batch_config("").replace(r#""failures":10000"#, r#""failures":2"#);
    let mut d = dispatcher(&cfg);
    // Eight slow callouts, and two takes queued behind them that wait their whole timeout.
    let mut id = 20;
    assert_eq!(start(&mut d, id, "/api"), PAUSE);
    for _ in 1..8 {
        id += 1;
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
        d.abi.clock.set(d.abi.clock.get() + 5);
        d.on_tick(ROOT);
    }
    for extra in [100, 101] {
        assert_eq!(start(&mut d, extra, "/api"), PAUSE);
    }
    d.abi.clock.set(d.abi.clock.get() + 20);
    d.on_tick(ROOT);
    assert_eq!(d.abi.replied.borrow().len(), 2);
    assert_eq!(
        d.abi.metric("tollgate.breaker.opened"),
        0,
        "queued too long: no news of the service"
    );
    // Three more queue; the first callout answers, and they leave as one batch, which fails (a
    // reset): one failed callout, not three.
    for extra in [102, 103, 104] {
        assert_eq!(start(&mut d, extra, "/api"), PAUSE);
    }
    allowed_reply(&d);
    let first = d.abi.dispatched.borrow()[0].0;
    d.on_http_call_response(first, 1, 1000);
    let batch = last_token(&d);
    assert_eq!(d.abi.dispatched.borrow().len(), 9);
    *d.abi.reply.borrow_mut() = (None, Vec::new());
    d.on_http_call_response(batch, 0, 0);
    assert_eq!(
        d.abi.metric("tollgate.callout_failure.reset"),
        3,
        "each take counted"
    );
    assert_eq!(d.abi.metric("tollgate.breaker.opened"), 0);
    // A second failed callout in a row opens it.
    let second = d.abi.dispatched.borrow()[1].0;
    d.on_http_call_response(second, 0, 0);
    assert_eq!(d.abi.metric("tollgate.breaker.opened"), 1);
    // What the failure mode decided, by cause: two queued too long, four reset, one refused by
    // the open breaker.
    assert_eq!(start(&mut d, 200, "/api"), PAUSE);
    for (cause, n) in [("queued", 2), ("reset", 4), ("breaker", 1), ("timeout", 0)] {
        assert_eq!(
            d.abi.metric(&format!("tollgate.failure_mode.{cause}")),
            n,
            "{cause}"
        );
    }
}

/// Successes reset the consecutive failures even when their admission saw none, if they were
/// slow (a tick or more): failures counted while they were out do not stand against a service
/// that answers. Quick successes after a clean admission still write nothing.
#[test]
fn slow_successes_reset_the_failures_counted_while_they_were_out() {
    let cfg = config("http", "").replace(r#""failures":10000"#, r#""failures":3"#);
    let cfg = cfg.replace(r#""batch":0"#, r#""batch":0,"timeout_ms":40"#);
    let mut d = dispatcher(&cfg);
    // Six requests out at once, all admitted with the breaker clean.
    let ids: Vec<u32> = (10..16).collect();
    let mut tokens = Vec::new();
    for id in &ids {
        assert_eq!(start(&mut d, *id, "/api"), PAUSE);
        tokens.push(last_token(&d));
    }
    // Failures and slow successes interleave: two failures, a success, two failures, a
    // success... never three failures in a row.
    d.abi.clock.set(10);
    for (i, t) in tokens.iter().enumerate() {
        if i % 3 == 2 {
            allowed_reply(&d);
            d.on_http_call_response(*t, 1, 1000);
        } else {
            *d.abi.reply.borrow_mut() = (Some(b"503".to_vec()), Vec::new());
            d.on_http_call_response(*t, 1, 0);
        }
    }
    assert_eq!(d.abi.metric("tollgate.callout_failure.status"), 4);
    assert_eq!(
        d.abi.metric("tollgate.breaker.opened"),
        0,
        "successes reset the count"
    );
}
