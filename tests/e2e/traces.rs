//! Traces through real Envoy: a client's sampled W3C `traceparent` reaches the service on the
//! filter's callout (`service.trace`), and the service's span for that decision (exported over
//! OTLP/gRPC to a receiver started here) is a child of the client's span, over both transports.
//! Unsampled requests are not traced. (That a traced request leaves its batch is the adapter's
//! test `a_sampled_traceparent_rides_its_own_callout`.)

use crate::both_transports;
use crate::common;

use common::config::{plugin, rule};
use common::*;
use serde_json::json;
use std::time::Duration;
use tollgate_testkit::otlp::Receiver;

both_transports!(a_sampled_request_s_decision_is_a_span_of_its_trace);

fn a_sampled_request_s_decision_is_a_span_of_its_trace(t: Transport) {
    let c = Components::get();
    let dir = TempDir::new("traces");
    let receiver = Receiver::start();
    let endpoint = receiver.endpoint();
    let service = Service::start_with(
        &c,
        &dir,
        None,
        &["--otlp-endpoint", &endpoint, "--otlp-sample-ratio", "0"],
    );
    let upstream = Upstream::start();
    let cfg = plugin(
        t,
        vec![rule("per-tenant", &["header:x-api-key"], 1)],
        json!({"service": {"trace": true}}),
    );
    let envoy = Envoy::start(
        &c,
        &dir,
        &EnvoySpec::new(Some(cfg), service.port, upstream.port),
    );
    let client = Client::new();
    let url = envoy.url("/");
    let trace = "5bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "10f067aa0ba902b7";
    let sampled = format!("00-{trace}-{parent}-01");
    let key = "tenant-e2e-secret";
    let statuses: Vec<u16> = (0..2)
        .map(|_| {
            client
                .get(&url, &[("x-api-key", key), ("traceparent", &sampled)])
                .status
        })
        .collect();
    assert_eq!(statuses, vec![200, 429]);
    let unsampled = "6bf92f3577b34da6a3ce929d0e0e4736";
    client.get(
        &url,
        &[
            ("x-api-key", "other"),
            ("traceparent", &format!("00-{unsampled}-{parent}-00")),
        ],
    );
    let span = receiver
        .wait_for(Duration::from_secs(10), |s| {
            s.trace_id == trace
                && s.attributes.get("tollgate.outcome").map(String::as_str) == Some("limited")
        })
        .unwrap_or_else(|| panic!("no span of the client's trace: {:?}", receiver.spans()));
    assert_eq!(span.name, "tollgate.take");
    assert_eq!(span.parent_span_id, parent, "a child of the client's span");
    assert_eq!(span.attributes["tollgate.rules"], "per-tenant");
    for v in span.attributes.values() {
        assert!(!v.contains(key), "no key in a span: {span:?}");
    }
    // Two rounds of the exporter later, the unsampled request has no span.
    std::thread::sleep(Duration::from_millis(1200));
    let spans = receiver.spans();
    assert!(spans.iter().all(|s| s.trace_id != unsampled), "{spans:?}");
    assert_eq!(
        spans.iter().filter(|s| s.trace_id == trace).count(),
        2,
        "one span per decision: {spans:?}"
    );
}
