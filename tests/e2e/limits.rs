//! End to end, service up: limits enforced through real Envoy, the real module, the real service and
//! real Redis, over both transports. What is checked is what a client sees and what reaches the
//! upstream.

// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::both_transports;
use crate::common;

use common::config::{plugin, rule, SLOW_PERIOD_MS};
use common::*;
use serde_json::json;

both_transports!(
    limit_enforced_with_headers,
    response_options,
    cost_fixed,
    cost_from_header,
    two_rules_all_or_nothing,
    key_from_header,
    key_from_header_shared_when_missing,
    key_from_client_ip_trusted_hop,
    key_from_peer_ignores_x_forwarded_for,
    key_from_client_ip_resolved_by_envoy,
    match_limits_only_matching_requests,
    fixed_window_and_refill,
    request_body_passes_intact,
    long_keys_stay_distinct,
    key_from_authority_path_and_method,
);

fn header_u64(r: &Reply, name: &str) -> u64 {
    r.header(name)
        .unwrap_or_else(|| panic!("no {name} in {r:?}"))
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{name} is not an integer in {r:?}"))
}

/// Capacity 3: exactly three 200s, then 429s with Retry-After, both header families on every
/// response (on_allowed), the configured body; the upstream sees the three admitted requests only.
pub(crate) fn limit_enforced_with_headers(t: Transport) {
    let cfg = plugin(
        t,
        vec![rule("per-ip", &["client_ip"], 3)],
        json!({"response": {"headers": ["draft", "x-ratelimit"], "on_allowed": true,
                            "body": "slow down\n"}}),
    );
    let s = Stack::start("limit", &cfg);
    for i in 0..3u64 {
        let r = s.get("/", &[]);
        assert_eq!(r.status, 200, "request {i}: {r:?}");
        assert_eq!(r.body, "upstream\n");
        assert_eq!(header_u64(&r, "x-ratelimit-limit"), 3, "{r:?}");
        assert_eq!(header_u64(&r, "x-ratelimit-remaining"), 2 - i, "{r:?}");
        assert!(r.header("x-ratelimit-reset").is_some(), "{r:?}");
        let policy = r.header("ratelimit-policy").unwrap_or_default();
        assert!(
            policy.contains("per-ip"),
            "RateLimit-Policy names the rule: {r:?}"
        );
        assert!(r.header("ratelimit").is_some(), "{r:?}");
        assert!(
            r.header("retry-after").is_none(),
            "no Retry-After when allowed: {r:?}"
        );
    }
    for _ in 0..4 {
        let r = s.get("/", &[]);
        assert_eq!(r.status, 429, "{r:?}");
        assert_eq!(r.body, "slow down\n");
        let retry = header_u64(&r, "retry-after");
        assert!(
            (1..=SLOW_PERIOD_MS / 1000).contains(&retry),
            "Retry-After within one refill period: {r:?}"
        );
        assert_eq!(header_u64(&r, "x-ratelimit-limit"), 3, "{r:?}");
        assert_eq!(header_u64(&r, "x-ratelimit-remaining"), 0, "{r:?}");
        assert!(r.header("x-ratelimit-reset").is_some(), "{r:?}");
        assert!(
            r.header("ratelimit-policy")
                .unwrap_or_default()
                .contains("per-ip"),
            "{r:?}"
        );
        assert!(r.header("ratelimit").is_some(), "{r:?}");
    }
    assert_eq!(
        s.upstream.requests(),
        3,
        "denied requests never reach the upstream"
    );
    assert_eq!(s.envoy.tg("allowed"), 3);
    assert_eq!(s.envoy.tg("limited"), 4);
}

/// A configured status and only the X-RateLimit family, on denials only (on_allowed false).
fn response_options(t: Transport) {
    let cfg = plugin(
        t,
        vec![rule("tight", &["literal:all"], 1)],
        json!({"response": {"status": 503, "body": "{\"error\":\"limited\"}",
                            "content_type": "application/json", "headers": ["x-ratelimit"]}}),
    );
    let s = Stack::start("response", &cfg);
    let ok = s.get("/", &[]);
    assert_eq!(ok.status, 200);
    assert!(
        ok.header("x-ratelimit-limit").is_none(),
        "on_allowed is false: {ok:?}"
    );
    assert!(ok.header("ratelimit-policy").is_none(), "{ok:?}");
    let r = s.get("/", &[]);
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.body, "{\"error\":\"limited\"}");
    assert_eq!(r.header("content-type"), Some("application/json"), "{r:?}");
    assert!(
        r.header("retry-after").is_some(),
        "Retry-After always on a denial: {r:?}"
    );
    assert_eq!(header_u64(&r, "x-ratelimit-limit"), 1);
    assert!(
        r.header("ratelimit-policy").is_none(),
        "draft headers not configured: {r:?}"
    );
    assert!(r.header("ratelimit").is_none(), "{r:?}");
    assert_eq!(s.upstream.requests(), 1);
}

/// cost 4 from capacity 10: two requests pass (8 tokens), the third cannot pay 4 of the 2 left.
fn cost_fixed(t: Transport) {
    let mut r = rule("heavy", &["literal:x"], 10);
    r["cost"] = json!(4);
    let s = Stack::start("cost-fixed", &plugin(t, vec![r], json!({})));
    let st = s.client.statuses(&s.url("/"), &[], 5);
    assert_eq!(st, vec![200, 200, 429, 429, 429]);
    assert_eq!(s.upstream.requests(), 2);
}

/// Cost from a header (default 1, max 1000): capacity 10 pays 6, not 5 of the 4 left, then 4, then
/// the default 1 finds nothing left. A denied request takes nothing, so the 4 is still there.
fn cost_from_header(t: Transport) {
    let mut r = rule("weighted", &["literal:x"], 10);
    r["cost"] = json!({"header": "x-cost", "default": 1, "max": 1000});
    let s = Stack::start("cost-header", &plugin(t, vec![r], json!({})));
    let url = s.url("/");
    let never = s.client.get(&url, &[("x-cost", "50")]);
    assert_eq!(
        never.status, 429,
        "a cost above capacity is denied: {never:?}"
    );
    assert!(never.header("retry-after").is_some(), "{never:?}");
    assert_eq!(
        s.client.get(&url, &[("x-cost", "6")]).status,
        200,
        "nothing was charged"
    );
    assert_eq!(s.client.get(&url, &[("x-cost", "5")]).status, 429);
    assert_eq!(s.client.get(&url, &[("x-cost", "4")]).status, 200);
    assert_eq!(
        s.client.get(&url, &[]).status,
        429,
        "default cost 1, none left"
    );
    assert_eq!(s.upstream.requests(), 2);
    let stats = s.envoy.tg_all();
    assert_eq!(
        stats.get("limited"),
        Some(&3),
        "denied by the service: {stats:?}"
    );
    let failures: u64 = stats
        .iter()
        .filter(|(k, _)| k.starts_with("callout_failure."))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(failures, 0, "no request was an error: {stats:?}");
}

/// Rule A (shared, capacity 5) and rule B (per user, capacity 2) on every request. Requests denied
/// by B must not spend A's tokens: after user 1's three denials, users 2 and 3 still get A's
/// remaining three tokens, and only then does A deny.
fn two_rules_all_or_nothing(t: Transport) {
    let s = Stack::start(
        "two-rules",
        &plugin(
            t,
            vec![
                rule("global", &["literal:all"], 5),
                rule("per-user", &["header:x-user"], 2),
            ],
            json!({"response": {"headers": ["draft"]}}),
        ),
    );
    let url = s.url("/");
    let u = |user: &str| s.client.get(&url, &[("x-user", user)]);
    let u1: Vec<u16> = (0..5).map(|_| u("u1").status).collect();
    assert_eq!(u1, vec![200, 200, 429, 429, 429], "B limits user 1");
    assert_eq!(u("u2").status, 200, "A not charged by B's denials");
    assert_eq!(u("u2").status, 200);
    assert_eq!(u("u3").status, 200, "A's fifth token");
    let denied = u("u3");
    assert_eq!(denied.status, 429, "A is empty: {denied:?}");
    assert!(
        denied
            .header("ratelimit-policy")
            .unwrap_or_default()
            .contains("global"),
        "the denying rule is named: {denied:?}"
    );
    assert_eq!(s.upstream.requests(), 5);
}

/// `header:x-api-key` keys, on_missing skip (the default): each key has its own bucket; requests
/// without the header are not limited by this rule.
fn key_from_header(t: Transport) {
    let s = Stack::start(
        "key-header",
        &plugin(
            t,
            vec![rule("per-key", &["header:x-api-key"], 2)],
            json!({}),
        ),
    );
    let url = s.url("/");
    let a = s.client.statuses(&url, &[("x-api-key", "a")], 3);
    let b = s.client.statuses(&url, &[("x-api-key", "b")], 3);
    let none = s.client.statuses(&url, &[], 5);
    assert_eq!(a, vec![200, 200, 429]);
    assert_eq!(b, vec![200, 200, 429]);
    assert_eq!(none, vec![200; 5], "skipped when the header is missing");
    assert_eq!(s.upstream.requests(), 9);
}

/// on_missing shared: every request without the header shares one bucket.
fn key_from_header_shared_when_missing(t: Transport) {
    let mut r = rule("per-key", &["header:x-api-key"], 2);
    r["on_missing"] = json!("shared");
    let s = Stack::start("key-shared", &plugin(t, vec![r], json!({})));
    let url = s.url("/");
    assert_eq!(s.client.statuses(&url, &[], 3), vec![200, 200, 429]);
    assert_eq!(s.client.statuses(&url, &[("x-api-key", "a")], 1), vec![200]);
    assert_eq!(s.upstream.requests(), 3);
}

/// trusted_hops 1: the client address comes from x-forwarded-for, so two clients behind one
/// trusted proxy (same peer address) have separate buckets. Envoy is configured as behind a proxy
/// (`use_remote_address: false`: it leaves x-forwarded-for as the proxy wrote it).
fn key_from_client_ip_trusted_hop(t: Transport) {
    let s = Stack::start_with(
        "key-xff",
        &plugin(
            t,
            vec![rule("per-ip", &["client_ip"], 2)],
            json!({"trusted_hops": 1}),
        ),
        |spec| spec.use_remote_address = false,
    );
    let url = s.url("/");
    let one = s
        .client
        .statuses(&url, &[("x-forwarded-for", "203.0.113.1")], 3);
    let two = s
        .client
        .statuses(&url, &[("x-forwarded-for", "203.0.113.2")], 3);
    assert_eq!(one, vec![200, 200, 429]);
    assert_eq!(two, vec![200, 200, 429], "another client, another bucket");
    assert_eq!(s.upstream.requests(), 4);
}

/// An edge Envoy that trusts one proxy in front (`use_remote_address: true`,
/// `xff_num_trusted_hops: 1`) resolves the client address itself; with trusted_hops 0 the filter keys
/// on that address. (Note: `trusted_hops` counts x-forwarded-for entries as the filter sees them,
/// after Envoy appended its own, so the filter-side equivalent here would be trusted_hops 2.)
fn key_from_client_ip_resolved_by_envoy(t: Transport) {
    let s = Stack::start_with(
        "key-envoy-xff",
        &plugin(t, vec![rule("per-ip", &["client_ip"], 2)], json!({})),
        |spec| spec.xff_num_trusted_hops = 1,
    );
    let url = s.url("/");
    let one = s
        .client
        .statuses(&url, &[("x-forwarded-for", "203.0.113.1")], 3);
    let two = s
        .client
        .statuses(&url, &[("x-forwarded-for", "203.0.113.2")], 3);
    assert_eq!(one, vec![200, 200, 429]);
    assert_eq!(two, vec![200, 200, 429], "another client, another bucket");
}

/// trusted_hops 0: the peer address is the client; a forged x-forwarded-for changes nothing.
/// Envoy is an edge proxy here (`use_remote_address: true`); with Envoy's default (false) Envoy
/// itself takes the downstream address, which the filter reads, from x-forwarded-for.
fn key_from_peer_ignores_x_forwarded_for(t: Transport) {
    let s = Stack::start(
        "key-peer",
        &plugin(t, vec![rule("per-ip", &["client_ip"], 2)], json!({})),
    );
    let url = s.url("/");
    let st: Vec<u16> = (0..4)
        .map(|i| {
            let xff = format!("198.51.100.{i}");
            s.client.get(&url, &[("x-forwarded-for", &xff)]).status
        })
        .collect();
    assert_eq!(st, vec![200, 200, 429, 429]);
    assert_eq!(s.upstream.requests(), 2);
}

/// A rule with `match` limits only the requests it matches.
fn match_limits_only_matching_requests(t: Transport) {
    let mut r = rule("login", &["literal:login"], 1);
    r["match"] = json!({"path_exact": "/login", "methods": ["GET"]});
    let s = Stack::start("match", &plugin(t, vec![r], json!({})));
    assert_eq!(
        s.client.statuses(&s.url("/login?x=1"), &[], 2),
        vec![200, 429]
    );
    assert_eq!(s.client.statuses(&s.url("/other"), &[], 3), vec![200; 3]);
    assert_eq!(s.upstream.requests(), 4);
}

/// fixed_window counts per window; a token bucket refills continuously (here 2 per second, so a
/// denied client is admitted again after half a second).
fn fixed_window_and_refill(t: Transport) {
    let mut fw = rule("window", &["literal:w"], 3);
    fw["algorithm"] = json!("fixed_window");
    fw["match"] = json!({"path_prefix": "/fw"});
    let refill = json!({"name": "refill", "match": {"path_prefix": "/tb"}, "key": ["literal:t"],
                        "capacity": 2, "rate": 2, "period_ms": 1000});
    let s = Stack::start("algorithms", &plugin(t, vec![fw, refill], json!({})));
    assert_eq!(
        s.client.statuses(&s.url("/fw"), &[], 5),
        vec![200, 200, 200, 429, 429]
    );
    assert_eq!(s.client.statuses(&s.url("/tb"), &[], 3)[..2], [200, 200]);
    let denied = s.get("/tb", &[]);
    assert_eq!(denied.status, 429, "{denied:?}");
    assert_eq!(
        denied.header("retry-after"),
        Some("1"),
        "at most 500 ms, rounded up to 1 s"
    );
    std::thread::sleep(std::time::Duration::from_millis(600));
    assert_eq!(
        s.get("/tb", &[]).status,
        200,
        "refilled after 600 ms at 2/s"
    );
}

/// The JSON transport also works over an HTTP/1.1 cluster.
#[test]
fn http_transport_over_an_http1_cluster() {
    let s = Stack::start_with(
        "http1",
        &plugin(
            Transport::Http,
            vec![rule("per-ip", &["client_ip"], 2)],
            json!({}),
        ),
        |spec| spec.service_http2 = false,
    );
    assert_eq!(s.client.statuses(&s.url("/"), &[], 3), vec![200, 200, 429]);
    assert_eq!(s.envoy.tg("allowed"), 2);
    assert_eq!(s.upstream.requests(), 2);
}

/// A unary gRPC call over a cluster without HTTP/2 cannot work: Envoy accepts the configuration
/// and every call fails (its answer's status travels in trailers, which HTTP/1.1 does not carry
/// here). The filter treats that as a failed callout (here: the fallback), not as an answer.
#[test]
fn unary_grpc_over_an_http1_cluster_falls_back() {
    let s = Stack::start_with(
        "grpc-http1",
        &plugin(
            Transport::GrpcUnary,
            vec![rule("per-ip", &["client_ip"], 4)],
            json!({"fallback": {"instances": 2}}),
        ),
        |spec| spec.service_http2 = false,
    );
    let st = s.client.statuses(&s.url("/"), &[], 3);
    let stats = s.envoy.tg_all();
    assert_eq!(st, vec![200, 200, 429], "{stats:?}");
    assert_eq!(stats.get("allowed").copied().unwrap_or(0), 0, "{stats:?}");
    assert_eq!(stats.get("fallback.allowed"), Some(&2), "{stats:?}");
    assert_eq!(s.upstream.requests(), 2);
}

/// The stream of takes (gRPC's default) needs no HTTP/2: its messages travel in the bodies of one
/// HTTP/1.1 request and its response, which Envoy and the service both stream; the limit is the
/// service's, exactly.
#[test]
fn the_grpc_stream_works_over_an_http1_cluster() {
    let s = Stack::start_with(
        "stream-http1",
        &plugin(
            Transport::Grpc,
            vec![rule("per-ip", &["client_ip"], 4)],
            json!({"fallback": {"instances": 2}}),
        ),
        |spec| spec.service_http2 = false,
    );
    let st = s.client.statuses(&s.url("/"), &[], 6);
    let stats = s.envoy.tg_all();
    assert_eq!(st, vec![200, 200, 200, 200, 429, 429], "{stats:?}");
    assert_eq!(stats.get("allowed"), Some(&4), "{stats:?}");
    assert_eq!(stats.get("limited"), Some(&2), "{stats:?}");
    assert_eq!(s.upstream.requests(), 4);
}

/// A POST body waits while the filter asks the service and reaches the upstream intact; a denied
/// POST reaches nothing.
fn request_body_passes_intact(t: Transport) {
    let s = Stack::start(
        "body",
        &plugin(t, vec![rule("per-ip", &["client_ip"], 1)], json!({})),
    );
    let body: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let r = s.client.post(&s.url("/upload"), &[], &body);
    assert_eq!(r.status, 200, "{r:?}");
    let r = s.client.post(&s.url("/upload"), &[], &body);
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(s.upstream.requests(), 1);
    let got = s.upstream.bodies();
    assert_eq!(got.len(), 1);
    assert!(
        got[0] == body,
        "body of {} bytes arrived as {} bytes",
        body.len(),
        got[0].len()
    );
}

/// Keys far longer than the service accepts (header values of 6000 bytes, differing only at the
/// end) are still one bucket per value.
fn long_keys_stay_distinct(t: Transport) {
    let s = Stack::start(
        "long-keys",
        &plugin(
            t,
            vec![rule("per-key", &["header:x-api-key"], 2)],
            json!({}),
        ),
    );
    let url = s.url("/");
    let base = "k".repeat(6000);
    let (a, b) = (format!("{base}a"), format!("{base}b"));
    assert_eq!(
        s.client.statuses(&url, &[("x-api-key", &a)], 3),
        vec![200, 200, 429]
    );
    assert_eq!(
        s.client.statuses(&url, &[("x-api-key", &b)], 3),
        vec![200, 200, 429]
    );
    assert_eq!(s.envoy.tg("allowed"), 4, "{:?}", s.envoy.tg_all());
}

/// Keys from the request itself: authority, path (without query) and method.
fn key_from_authority_path_and_method(t: Transport) {
    let s = Stack::start(
        "key-request",
        &plugin(
            t,
            vec![rule("per-route", &["authority", "path", "method"], 1)],
            json!({}),
        ),
    );
    let get = |host: &str, path: &str| s.client.get(&s.url(path), &[("host", host)]).status;
    assert_eq!(get("a.example", "/x?q=1"), 200);
    assert_eq!(
        get("a.example", "/x?q=2"),
        429,
        "the query string is not part of the path"
    );
    assert_eq!(get("b.example", "/x"), 200, "another authority");
    assert_eq!(get("a.example", "/y"), 200, "another path");
    let post = s.client.post(&s.url("/x"), &[("host", "a.example")], b"");
    assert_eq!(post.status, 200, "another method: {post:?}");
    assert_eq!(s.upstream.requests(), 4);
    let hosts: Vec<bool> = s
        .upstream
        .heads()
        .iter()
        .map(|h| h.to_ascii_lowercase().contains("host: b.example"))
        .collect();
    assert!(
        hosts.contains(&true),
        "the host header was sent as given: {hosts:?}"
    );
}
