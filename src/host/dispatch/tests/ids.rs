//! Callout ids against the fake host: Envoy's tokens wrapping through 0 and handed out again while
//! one is in flight, replies for tokens and contexts nobody knows, and the ledger and the pending
//! gauge bounded by the requests alive, including a property test of every request getting its own
//! answer across the wrap.

use super::*;

#[test]
fn callout_ids_wrap_around_without_a_leak_or_a_trap() {
    let cfg = config("http", "");
    let mut d = dispatcher(&cfg);
    allowed_reply(&d);
    // Envoy's counter after about 2^30 callouts: the next few ids wrap through 0.
    d.abi.next_http.set(0u32.wrapping_sub(4 * 50));
    let mut orphaned = Vec::new();
    let mut id = 100;
    // 200 requests: every other client disconnects while its callout is in flight.
    for i in 0..200 {
        id += 1;
        assert_eq!(start(&mut d, id, "/api/x"), PAUSE);
        let token = last_token(&d);
        if i % 2 == 0 {
            disconnect(&mut d, id);
            orphaned.push(token);
        } else {
            d.on_http_call_response(token, 1, 1000);
            assert_eq!(
                d.abi.resumed.borrow().last(),
                Some(&id),
                "resumed its own request"
            );
            d.on_delete(id);
        }
        assert_eq!(
            d.pending_callouts(),
            0,
            "nothing kept once the request is gone"
        );
    }
    {
        let sent = d.abi.dispatched.borrow();
        assert_eq!(
            sent.first().map(|s| s.0),
            Some(u32::MAX - 195),
            "started near the top"
        );
        assert!(sent.iter().any(|s| s.0 == 0), "and wrapped through 0");
    }
    // Late replies for requests that are gone: dropped.
    for t in &orphaned {
        d.on_http_call_response(*t, 1, 1000);
    }
    assert_eq!(d.abi.resumed.borrow().len(), 100);
    // The counter comes round to the orphaned ids again: each is simply a new callout.
    let first = orphaned[0];
    d.abi.next_http.set(first.wrapping_sub(4));
    id += 1;
    assert_eq!(start(&mut d, id, "/api/x"), PAUSE);
    assert_eq!(
        last_token(&d),
        first,
        "an id whose request vanished is handed out again"
    );
    d.on_http_call_response(first, 1, 1000);
    assert_eq!(d.abi.resumed.borrow().last(), Some(&id));
    d.on_delete(id);
    assert_eq!((d.pending_callouts(), d.live_requests()), (0, 0));
    assert_eq!(d.abi.metric("tollgate.callouts.pending"), 0);
    assert_eq!(d.abi.metric("tollgate.allowed"), 101);
    assert_eq!(d.abi.metric("tollgate.callouts.collided"), 0);
}

/// Envoy repeating a token still in flight (its counter wraps unchecked: 2^30 callouts while one
/// waits) is an error counted, and the callout the token named fails: its request takes the
/// failure path, and the answer goes to the new callout's request alone.
#[test]
fn a_token_envoy_hands_out_again_fails_the_callout_it_named() {
    for transport in ["http", "grpc"] {
        let cfg = config(transport, r#","failure_mode":"deny""#);
        let mut d = dispatcher(&cfg);
        assert_eq!(start(&mut d, 10, "/api"), PAUSE);
        let token = last_token(&d);
        d.abi.tokens_from(token);
        assert_eq!(start(&mut d, 11, "/api"), PAUSE);
        assert_eq!(last_token(&d), token, "{transport}: the same token again");
        assert_eq!(d.abi.metric("tollgate.callouts.collided"), 1);
        assert_eq!(*d.abi.replied.borrow(), vec![(10, 429)], "{transport}");
        assert_eq!(d.abi.metric("tollgate.callout_failure.reset"), 1);
        assert_eq!((d.pending_callouts(), d.ledger_entries()), (1, 1));
        allowed_reply(&d);
        if transport == "http" {
            d.on_http_call_response(token, 1, 1000);
        } else {
            *d.abi.reply.borrow_mut() = (None, vec![0x08, 1, 0x12, 2, 0x08, 1]);
            d.on_grpc_response(token, 0, 6);
        }
        assert_eq!(*d.abi.resumed.borrow(), vec![11], "{transport}");
        assert_eq!(d.abi.replied.borrow().len(), 1);
        assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
        assert_eq!(d.abi.metric("tollgate.callouts.pending"), 0);
    }
}

/// What the fake service does next in [`every_request_gets_its_own_answer_across_envoys_wrap`].
#[derive(Debug, Clone)]
enum Step {
    /// A request arrives (it calls, or queues behind the callout in flight).
    Start,
    /// The `i`-th callout not yet answered is answered, whatever its age.
    Answer(u8),
    /// The `i`-th request still waiting goes away.
    Leave(u8),
    /// Envoy's counters jump to `n` calls below 2^32 (callouts of other filters of the worker),
    /// once.
    Jump(u8),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        3 => Just(Step::Start),
        3 => any::<u8>().prop_map(Step::Answer),
        1 => any::<u8>().prop_map(Step::Leave),
        1 => any::<u8>().prop_map(Step::Jump),
    ]
}

/// The fake service's answer to callout `body` (a take or a batch of them, JSON): every take
/// denied, retried after as many seconds as the id of the request its key names, so a request's
/// `retry-after` says whose answer it got.
fn answer_naming_each_request(body: &[u8]) -> Vec<u8> {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    let one = |take: &serde_json::Value| {
        let key = take["buckets"][0]["key"].as_str().unwrap();
        let id: u64 = key.trim_start_matches("r|").parse().unwrap();
        format!(
            r#"{{"allowed":false,"buckets":[{{"allowed":false,"limit":5,"remaining":0,"reset_ms":1,"retry_after_ms":{}}}]}}"#,
            id * 1000
        )
    };
    match v["takes"].as_array() {
        Some(takes) => {
            let parts: Vec<String> = takes.iter().map(one).collect();
            format!(r#"{{"results":[{}]}}"#, parts.join(",")).into_bytes()
        }
        None => one(&v).into_bytes(),
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Envoy's tokens from just below 2^31 (where the ledger once marked its own ids), then
    /// across 2^32 back to 0, with requests calling and queueing, clients leaving and answers
    /// arriving in every order: every request gets its own answer or none (it left), and nothing
    /// is left behind in the ledger or the pending gauge.
    #[test]
    fn every_request_gets_its_own_answer_across_envoys_wrap(
        steps in proptest::collection::vec(step(), 1..120),
        below in 0u32..64,
    ) {
        let cfg = r#"{"service":{"cluster":"svc","transport":"http","batch":4,"remember_denials_ms":0},
            "rules":[{"name":"r","key":["header:x-id"],"capacity":5,"period_ms":60000}],
            "breaker":{"failures":10000,"open_ms":100},"failure_mode":"deny"}"#;
        let mut d = dispatcher(cfg);
        d.abi.tokens_from(0x8000_0000 - 4 * below);
        let mut next_id = 100u32;
        let mut waiting: Vec<u32> = Vec::new();
        let mut left: Vec<u32> = Vec::new();
        let mut answered = 0;
        let mut jumped = false;
        let answer = |d: &mut Dispatcher<Fake>, answered: &mut usize, i: usize| {
            // Answer the i-th of those not yet answered: swap it to the front of the rest.
            let sent = d.abi.dispatched.borrow().len();
            let k = *answered + i % (sent - *answered);
            d.abi.dispatched.borrow_mut().swap(*answered, k);
            let (token, body) = d.abi.dispatched.borrow()[*answered].clone();
            *answered += 1;
            let reply = answer_naming_each_request(&body);
            let n = reply.len();
            *d.abi.reply.borrow_mut() = (Some(b"200".to_vec()), reply);
            d.on_http_call_response(token, 1, n);
        };
        for s in steps {
            match s {
                Step::Start if waiting.len() < 16 => {
                    next_id += 1;
                    let id = next_id;
                    d.on_context_create(id, ROOT);
                    d.abi.known.borrow_mut().push(id);
                    *d.abi.request.borrow_mut() = vec![
                        (":path".into(), b"/".to_vec()),
                        ("x-id".into(), id.to_string().into_bytes()),
                    ];
                    d.abi.effective.set(id);
                    proptest::prop_assert_eq!(d.on_request_headers(id, false), PAUSE);
                    waiting.push(id);
                }
                Step::Start => {}
                Step::Answer(i) => {
                    if d.abi.dispatched.borrow().len() > answered {
                        answer(&mut d, &mut answered, usize::from(i));
                    }
                }
                Step::Leave(i) => {
                    if !waiting.is_empty() {
                        let id = waiting.swap_remove(usize::from(i) % waiting.len());
                        if !d.abi.replied.borrow().iter().any(|(c, _)| *c == id) {
                            left.push(id);
                        }
                        disconnect(&mut d, id);
                    }
                }
                // Envoy's counter only moves on: once, from below 2^31 to below 2^32.
                Step::Jump(n) if !jumped => {
                    d.abi.tokens_from(0u32.wrapping_sub(4 * u32::from(n % 16)));
                    jumped = true;
                }
                Step::Jump(_) => {}
            }
            // A request answered is deleted by Envoy after its reply.
            let replied: Vec<u32> = d.abi.replied.borrow().iter().map(|(c, _)| *c).collect();
            for id in replied {
                if let Some(i) = waiting.iter().position(|w| *w == id) {
                    waiting.swap_remove(i);
                    d.on_delete(id);
                }
            }
        }
        while d.abi.dispatched.borrow().len() > answered {
            answer(&mut d, &mut answered, 0);
            let replied: Vec<u32> = d.abi.replied.borrow().iter().map(|(c, _)| *c).collect();
            for id in replied {
                if let Some(i) = waiting.iter().position(|w| *w == id) {
                    waiting.swap_remove(i);
                    d.on_delete(id);
                }
            }
        }
        proptest::prop_assert!(waiting.is_empty(), "never answered: {:?}", waiting);
        let replied = d.abi.replied.borrow();
        let retry = d.abi.retry_after.borrow();
        for ((c, status), r) in replied.iter().zip(retry.iter()) {
            proptest::prop_assert_eq!(*status, 429);
            proptest::prop_assert_eq!(r.clone(), Some(c.to_string()), "request {} got another's answer", c);
            proptest::prop_assert!(!left.contains(c), "request {} answered after it left", c);
        }
        let mut seen: Vec<u32> = replied.iter().map(|(c, _)| *c).collect();
        seen.sort_unstable();
        seen.dedup();
        proptest::prop_assert_eq!(seen.len(), replied.len(), "a request answered twice");
        proptest::prop_assert!(d.abi.resumed.borrow().is_empty());
        proptest::prop_assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
        proptest::prop_assert_eq!(d.abi.metric("tollgate.callouts.pending"), 0);
        proptest::prop_assert_eq!(d.abi.metric("tollgate.callouts.collided"), 0);
    }
}

#[test]
fn bookkeeping_stays_bounded_by_live_requests() {
    let cfg = config("grpc", "");
    let mut d = dispatcher(&cfg);
    for round in 0..50u32 {
        let ids: Vec<u32> = (0..20).map(|i| 1_000 + round * 20 + i).collect();
        for id in &ids {
            assert_eq!(start(&mut d, *id, "/api"), PAUSE);
        }
        assert_eq!(d.pending_callouts(), 20);
        assert_eq!(d.abi.metric("tollgate.callouts.pending"), 20);
        for id in &ids {
            disconnect(&mut d, *id);
        }
        assert_eq!((d.pending_callouts(), d.live_requests()), (0, 0));
    }
    assert_eq!(d.abi.metric("tollgate.callouts.pending"), 0);
    // gRPC ids are ≡ 1 mod 4 and every one of them went out.
    let sent = d.abi.dispatched.borrow();
    assert_eq!(sent.len(), 1_000);
    assert!(sent.iter().all(|(t, _)| t % 4 == 1));
}

#[test]
fn unknown_contexts_and_tokens_are_no_ops() {
    let cfg = config("http", "");
    let mut d = dispatcher(&cfg);
    assert_eq!(d.on_request_headers(42, false), CONTINUE);
    assert_eq!(d.on_request_body(42, Some(0), false), CONTINUE);
    assert_eq!(d.on_response_headers(42, false), CONTINUE);
    assert_eq!(d.on_response_body(42, 10, true), CONTINUE);
    assert_eq!(d.on_response_trailers(42), CONTINUE);
    d.on_delete(42);
    d.on_http_call_response(8, 0, 0);
    d.on_grpc_response(9, 0, 10);
    // A request whose root was never configured passes untouched.
    d.on_context_create(50, 49);
    assert_eq!(d.on_request_headers(50, false), CONTINUE);
    // A root that is deleted while its requests live on: they keep their plugin.
    assert_eq!(start(&mut d, 51, "/api"), PAUSE);
    d.on_delete(ROOT);
    allowed_reply(&d);
    d.on_http_call_response(last_token(&d), 1, 1000);
    assert_eq!(*d.abi.resumed.borrow(), vec![51]);
    // Envoy no longer knows the request when its reply comes: nothing is resumed.
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 60, "/api"), PAUSE);
    d.abi.known.borrow_mut().clear();
    d.on_http_call_response(last_token(&d), 1, 1000);
    assert!(d.abi.resumed.borrow().is_empty());
    assert_eq!(d.pending_callouts(), 0);
}
