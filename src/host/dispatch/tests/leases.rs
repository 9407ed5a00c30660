//! Leases: a background refill answered without any request, and a push handing the watched pools
//! to the new configuration.

use super::*;

#[test]
fn a_background_lease_refill_is_answered_without_any_request() {
    let cfg = r#"{"service":{"cluster":"svc","transport":"http","batch":0},
        "rules":[{"name":"r","key":["literal:k"],"capacity":100,"period_ms":60000,"lease":{"size":4}}]}"#;
    let mut d = dispatcher(cfg);
    assert_eq!(
        d.abi.tick_ms.get(),
        500,
        "a timer for the pools: max_age_ms / 2"
    );
    let granted = |d: &Dispatcher<Fake>, n: u64| {
        *d.abi.reply.borrow_mut() = (
            Some(b"200".to_vec()),
            format!(r#"{{"allowed":true,"buckets":[{{"allowed":true,"limit":100,"remaining":50,"reset_ms":1000,"retry_after_ms":0,"granted":{n}}}]}}"#).into_bytes(),
        );
    };
    assert_eq!(start(&mut d, 2, "/"), PAUSE);
    granted(&d, 4);
    d.on_http_call_response(last_token(&d), 1, 200);
    assert_eq!(d.abi.resumed.borrow().len(), 1);
    // 3 pooled: the third local take leaves 0, below 4 / 4, and sends the refill itself.
    for id in 3..6 {
        assert_eq!(start(&mut d, id, "/"), CONTINUE, "request {id}");
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 2, "one background refill");
    assert_eq!(d.pending_callouts(), 0, "no request waits for it");
    granted(&d, 4);
    d.on_http_call_response(last_token(&d), 1, 200);
    assert_eq!(d.abi.metric("tollgate.lease.granted"), 8);
    assert_eq!(d.abi.metric("tollgate.lease.refills"), 1);
    for id in 6..9 {
        assert_eq!(start(&mut d, id, "/"), CONTINUE, "request {id}");
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 2, "spent from the refill");
    // Nothing expired yet: the timer sends nothing.
    d.on_tick(ROOT);
    assert_eq!(d.abi.dispatched.borrow().len(), 2);
}

#[test]
fn a_push_hands_the_watched_pools_to_the_new_configuration() {
    let cfg = r#"{"service":{"cluster":"svc","transport":"http","batch":0},
        "rules":[{"name":"r","key":["literal:k"],"capacity":100,"period_ms":60000,"lease":{"size":4}}]}"#;
    let mut d = dispatcher(cfg);
    let held = |d: &Dispatcher<Fake>, root: u32| match d.roots.get(&root) {
        Some(Some(p)) => p.outbox.borrow().pools.len(),
        _ => usize::MAX,
    };
    assert_eq!(start(&mut d, 2, "/"), PAUSE);
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"allowed":true,"buckets":[{"allowed":true,"limit":100,"remaining":50,"reset_ms":1000,"retry_after_ms":0,"granted":4}]}"#.to_vec(),
    );
    d.on_http_call_response(last_token(&d), 1, 200);
    assert_eq!(held(&d, ROOT), 1, "the pool it filled is watched");
    // The push: a new root context is configured, then the old one deleted.
    d.on_context_create(7, 0);
    d.abi.known.borrow_mut().push(7);
    assert!(d.on_configure(7, cfg.len()));
    assert_eq!(held(&d, 7), 0);
    d.on_delete(ROOT);
    assert_eq!(held(&d, 7), 1, "still watched, by the new configuration");
}
