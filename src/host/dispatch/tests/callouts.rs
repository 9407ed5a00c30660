//! What a callout carries and how a failed one is counted: the gRPC target serialised as a
//! `GrpcService`, a refused gRPC dispatch, gRPC replies and failures, this Envoy's one id on every
//! callout, and a sampled `traceparent` riding its own callout.

use super::*;
use crate::core::wire::callout::grpc_service;
use crate::core::wire::plan::Decision;

#[test]
fn a_refused_grpc_dispatch_is_a_counted_failure_not_a_panic() {
    for status in [abi::BAD_ARGUMENT, 4, 10, 6] {
        let cfg = config("grpc", r#","failure_mode":"allow""#);
        let mut d = dispatcher(&cfg);
        d.abi.refuse.set(Some(status));
        assert_eq!(start(&mut d, 7, "/api"), CONTINUE, "never paused");
        assert_eq!(d.abi.metric("tollgate.callout_failure.dispatch"), 1);
        assert_eq!(d.abi.metric(Decision::FailureOpenAllowed.metric()), 1);
        assert_eq!(d.pending_callouts(), 0);
        assert!(d.abi.resumed.borrow().is_empty());
        d.on_delete(7);
    }
    // With failure_mode deny the same refusal answers locally.
    let cfg = config("grpc", r#","failure_mode":"deny""#);
    let mut d = dispatcher(&cfg);
    d.abi.refuse.set(Some(abi::BAD_ARGUMENT));
    assert_eq!(start(&mut d, 7, "/api"), PAUSE);
    assert_eq!(d.abi.replied.borrow().len(), 1);
}

#[test]
fn grpc_target_is_sent_as_a_serialised_grpc_service() {
    let cfg = config("grpc", "").replace("\"svc\"", "\"abcdefghi\"");
    let mut d = dispatcher(&cfg);
    start(&mut d, 9, "/api");
    let sent = d.abi.dispatched.borrow()[0].1.clone();
    // GrpcService{ envoy_grpc(1){ cluster_name(1) } }
    let mut want = vec![0x0a, 11, 0x0a, 9];
    want.extend_from_slice(b"abcdefghi");
    assert_eq!(sent, want);
    let long = "c".repeat(200);
    let enc = grpc_service(&long);
    assert_eq!(&enc[..5], &[0x0a, 0xcb, 0x01, 0x0a, 0xc8]);
    assert_eq!(enc.len(), 5 + 1 + 200);
}

#[test]
fn grpc_replies_reach_their_request_and_failures_are_counted() {
    let cfg = config("grpc", r#","failure_mode":"deny""#);
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 3, "/api"), PAUSE);
    let token = last_token(&d);
    // A status for an unknown token (a dispatch Envoy failed inline still reports one): dropped.
    d.on_grpc_response(token + 4, 14, 0);
    assert!(d.abi.replied.borrow().is_empty());
    d.on_grpc_response(token, 14, 0);
    assert_eq!(*d.abi.replied.borrow(), vec![(3, 429)]);
    assert_eq!(d.abi.metric("tollgate.callout_failure.grpc_status"), 1);
    // A second report for the same token changes nothing.
    d.on_grpc_response(token, 0, 3);
    assert_eq!(d.abi.replied.borrow().len(), 1);
    assert!(d.abi.resumed.borrow().is_empty());
}

#[test]
fn every_callout_of_every_configuration_carries_this_envoys_one_id() {
    let id_of = |body: &[u8]| -> String {
        let v: serde_json::Value = serde_json::from_slice(body).unwrap();
        v["instance"].as_str().unwrap_or_default().to_string()
    };
    // A take of the first configuration.
    let mut d = dispatcher(&config("http", ""));
    allowed_reply(&d);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let first = id_of(&d.abi.dispatched.borrow()[0].1);
    assert!(
        first.len() == 16 && first.bytes().all(|b| b.is_ascii_hexdigit()),
        "{first:?}"
    );
    d.on_http_call_response(last_token(&d), 1, 200);
    // A second configuration of the same VM (a second listener, or a push), whose request settles.
    configure(&mut d, 2, &charged_config());
    allowed_reply(&d);
    d.on_context_create(20, 2);
    d.abi.known.borrow_mut().push(20);
    d.abi.set_request("/v1/chat");
    assert_eq!(d.on_request_headers(20, false), PAUSE);
    let take = d.abi.dispatched.borrow().last().unwrap().1.clone();
    assert_eq!(id_of(&take), first, "the second configuration's take");
    d.on_http_call_response(last_token(&d), 1, 200);
    *d.abi.response.borrow_mut() = vec![("x-usage".into(), b"30".to_vec())];
    assert_eq!(d.on_response_headers(20, true), CONTINUE);
    d.on_delete(20);
    let settle = d.abi.dispatched.borrow().last().unwrap().1.clone();
    assert!(
        String::from_utf8_lossy(&settle).contains("\"used\":30"),
        "a settle was sent"
    );
    assert_eq!(id_of(&settle), first, "its settle");
}

/// `service.trace`: a sampled request's `traceparent` goes on its callout (header or metadata), and
/// the callout leaves at once even while a batch is forming; an unsampled or malformed one is not
/// forwarded and the request batches as before.
#[test]
fn a_sampled_traceparent_rides_its_own_callout() {
    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    for transport in ["http", "grpc"] {
        let cfg = config(transport, "").replace(r#""batch":0"#, r#""batch":8,"trace":true"#);
        let mut d = dispatcher(&cfg);
        let traced = |d: &Dispatcher<Fake>, i: usize| {
            d.abi.sent_headers.borrow()[i]
                .iter()
                .find(|(k, _)| k == "traceparent")
                .map(|(_, v)| v.clone())
        };
        // A request without one calls at once (nothing in flight) and carries none.
        assert_eq!(start(&mut d, 10, "/api"), PAUSE);
        assert_eq!(traced(&d, 0), None);
        // While that callout is in flight a plain request queues, a traced one calls alone.
        assert_eq!(start(&mut d, 11, "/api"), PAUSE);
        assert_eq!(d.abi.dispatched.borrow().len(), 1, "queued");
        assert_eq!(start_traced(&mut d, 12, TP), PAUSE);
        assert_eq!(
            d.abi.dispatched.borrow().len(),
            2,
            "{transport}: traced, alone"
        );
        assert_eq!(traced(&d, 1).as_deref(), Some(TP), "{transport}");
        // Unsampled, or not a traceparent: not forwarded, queued with the others.
        for tp in [
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "garbage",
        ] {
            assert_eq!(start_traced(&mut d, 13, tp), PAUSE);
            assert_eq!(
                d.abi.dispatched.borrow().len(),
                2,
                "{transport} {tp}: queued"
            );
            disconnect(&mut d, 13);
        }
    }
    // Off (the default): the header is not even read.
    let mut d = dispatcher(&config("http", ""));
    start_traced(&mut d, 12, TP);
    assert!(d.abi.sent_headers.borrow()[0]
        .iter()
        .all(|(k, _)| k != "traceparent"));
}
