//! Envoy's native rate limit filter (`envoy.filters.http.ratelimit`) with `tollgate-server` as its
//! RLS v3 server: real Envoys, real Redis (and a Sentinel setup whose master is killed under load),
//! the real service with a limits file.

// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::common;
use crate::native_rls as rls;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::clock::sleep_into_next_window;
use common::*;
use rls::{native_spec, start_service, LimitsFile};

/// The route's descriptor: one entry `bucket=<x-bucket header>` (no header: no descriptor, no
/// limit), and a second descriptor `generic_key=all` on every request.
const BUCKET_ACTIONS: &str = "[{actions: [{request_headers: {header_name: x-bucket, descriptor_key: bucket}}]}, {actions: [{generic_key: {descriptor_value: all}}]}]";

/// `n` requests from each of `clients` threads at once, each with `headers`; the statuses.
fn burst_statuses(
    envoys: &[Envoy],
    clients: usize,
    n: usize,
    headers: &[(&str, &str)],
) -> Vec<u16> {
    let urls: Vec<String> = envoys.iter().map(|e| e.url("/x")).collect();
    burst(&urls, clients, n, headers, Duration::from_secs(60))
        .iter()
        .map(|r| r.status)
        .collect()
}

#[test]
fn three_envoys_admit_exactly_the_limit() {
    let c = Components::get();
    let dir = TempDir::new("rls-exact");
    let redis = Redis::start(&c, &dir);
    let limits = LimitsFile::new(
        &dir,
        "domain: e2e\ndescriptors:\n  - key: bucket\n    value: exact\n    rate_limit: {unit: hour, requests_per_unit: 20}\n",
    );
    let service = start_service(
        &c,
        &dir,
        Some(&redis.url()),
        &limits,
        200,
        &["--rls-headers"],
    );
    let upstream = Upstream::start();
    let spec = native_spec("e2e", BUCKET_ACTIONS, service.port, upstream.port);
    let envoys = Envoy::start_all(&c, &dir, &vec![spec; 3]);
    // 32 clients spread over the 3 Envoys, 8 requests each: 256 requests for a limit of 20
    // per hour (the refill over the test, 20/3600 per second, is far below one request).
    let statuses = burst_statuses(&envoys, 32, 8, &[("x-bucket", "exact")]);
    assert_eq!(statuses.len(), 256);
    let (ok, limited) = (count(&statuses, 200), count(&statuses, 429));
    eprintln!("admitted {ok}, limited {limited} of {}", statuses.len());
    assert_eq!(ok, 20, "statuses: {statuses:?}");
    assert_eq!(limited, 236);
    assert_eq!(upstream.requests(), 20);
    // A denial carries the service's headers; another bucket is untouched.
    let r = Client::new().get(&envoys[0].url("/x"), &[("x-bucket", "exact")]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-limit"), Some("20"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"e2e.bucket_exact\";q=20;w=3600")
    );
    assert!(r.header("retry-after").is_some(), "{r:?}");
    let r = Client::new().get(&envoys[1].url("/x"), &[("x-bucket", "other")]);
    assert_eq!(r.status, 200);
    // Every Envoy asked the service: its own counters saw the calls.
    for e in &envoys {
        let s = e.stats("ratelimit");
        let over: u64 = s
            .iter()
            .filter(|(k, _)| k.ends_with("ratelimit.over_limit"))
            .map(|(_, v)| v)
            .sum();
        assert!(over > 0, "{s:?}");
    }
    let metrics = service.metrics();
    assert!(metrics.contains("transport=\"rls\""));
    // Per descriptor key, as envoyproxy/ratelimit's statistics: the 256 hits of the burst and the
    // denied one after it (bucket=other matches no limit: not counted).
    for (stat, n) in [
        ("total_hits", 257),
        ("within_limit", 20),
        ("over_limit", 237),
    ] {
        let line = format!(
            "tollgate_rls_hits_total{{domain=\"e2e\",key=\"bucket_exact\",stat=\"{stat}\"}} {n}"
        );
        assert!(metrics.contains(&line), "{line}\n{metrics}");
    }
}

/// Requests with `x-bucket: bucket` one after the other until the first 429 (at most `max`): how
/// many were admitted.
fn admitted_until_denied(envoy: &Envoy, bucket: &str, max: usize) -> usize {
    let client = Client::new();
    for n in 0..max {
        let r = client.get(&envoy.url("/x"), &[("x-bucket", bucket)]);
        if r.status == 429 {
            return n;
        }
        assert_eq!(r.status, 200, "{r:?}");
    }
    panic!("{max} admitted in bucket {bucket}, none denied");
}

/// `algorithm: sliding_window` in the limits file, beside `fixed_window`, both 10 per second. 10
/// admitted early in a second; a quarter into the next second the fixed window admits 10 again,
/// while the sliding window still counts 3/4 of the burst (ceil(7.5) = 8) and admits 2 (3 or 4 if
/// the requests ran late in the window).
#[test]
fn a_sliding_window_limit_counts_the_previous_window() {
    let c = Components::get();
    let dir = TempDir::new("rls-sliding");
    let redis = Redis::start(&c, &dir);
    let limit = |value: &str, algorithm: &str| {
        format!(
            "  - key: bucket\n    value: {value}\n    rate_limit: {{unit: second, requests_per_unit: 10, \
             algorithm: {algorithm}}}\n"
        )
    };
    let limits = LimitsFile::new(
        &dir,
        &format!(
            "domain: e2e\ndescriptors:\n{}{}",
            limit("sw", "sliding_window"),
            limit("fw", "fixed_window")
        ),
    );
    let service = start_service(&c, &dir, Some(&redis.url()), &limits, 200, &[]);
    let upstream = Upstream::start();
    let envoy = Envoy::start(
        &c,
        &dir,
        &native_spec("e2e", BUCKET_ACTIONS, service.port, upstream.port),
    );
    sleep_into_next_window(1000, 50);
    for bucket in ["sw", "fw"] {
        assert_eq!(admitted_until_denied(&envoy, bucket, 20), 10, "{bucket}");
    }
    sleep_into_next_window(1000, 250);
    let fixed = admitted_until_denied(&envoy, "fw", 20);
    let slid = admitted_until_denied(&envoy, "sw", 20);
    eprintln!("a quarter into the next second: fixed window admitted {fixed}, sliding {slid}");
    assert_eq!(fixed, 10, "a fixed window starts afresh");
    assert!(
        (2..=4).contains(&slid),
        "3/4 of the burst still weighs: {slid} admitted"
    );
    assert_eq!(upstream.requests(), (20 + fixed + slid) as u64);
}

#[test]
fn a_reload_under_load_keeps_the_counts() {
    let c = Components::get();
    let dir = TempDir::new("rls-reload");
    let redis = Redis::start(&c, &dir);
    let before = "domain: e2e\ndescriptors:\n  - key: bucket\n    value: keep\n    rate_limit: {unit: hour, requests_per_unit: 200}\n  - key: bucket\n    value: change\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";
    // `keep` unchanged; `change` gets another limit (a new bucket); `new` appears.
    let after = "domain: e2e\ndescriptors:\n  - key: bucket\n    value: keep\n    rate_limit: {unit: hour, requests_per_unit: 200}\n  - key: bucket\n    value: change\n    rate_limit: {unit: hour, requests_per_unit: 7}\n  - key: bucket\n    value: new\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
    let limits = LimitsFile::new(&dir, before);
    let poll_ms = 100;
    let service = start_service(
        &c,
        &dir,
        Some(&redis.url()),
        &limits,
        poll_ms,
        &["--rls-headers"],
    );
    let upstream = Upstream::start();
    let spec = native_spec("e2e", BUCKET_ACTIONS, service.port, upstream.port);
    let envoys = Envoy::start_all(&c, &dir, &vec![spec; 3]);
    let client = Client::new();
    assert_eq!(
        count(
            &client.statuses(&envoys[0].url("/x"), &[("x-bucket", "change")], 8),
            200
        ),
        5
    );
    // Load on `keep`: 8 clients, 60 requests each, one every 50 ms (about 3 s in all), over the
    // reload.
    let (ok, total) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load: Vec<_> = (0..8)
        .map(|i| {
            let url = envoys[i % envoys.len()].url("/x");
            let (ok, total) = (ok.clone(), total.clone());
            thread::spawn(move || {
                let client = Client::new();
                for _ in 0..60 {
                    let r = client.get(&url, &[("x-bucket", "keep")]);
                    assert!(r.status == 200 || r.status == 429, "{r:?}");
                    total.fetch_add(1, Ordering::Relaxed);
                    if r.status == 200 {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    thread::sleep(Duration::from_millis(50));
                }
            })
        })
        .collect();
    // Some of `keep` spent before the reload, and not all.
    assert!(eventually(Duration::from_secs(10), || ok
        .load(Ordering::Relaxed)
        >= 50));
    let spent_before = ok.load(Ordering::Relaxed);
    assert!(spent_before < 200, "{spent_before}");
    // `new` is not limited yet; the reload is seen when its second request is denied.
    assert_eq!(
        client
            .get(&envoys[1].url("/x"), &[("x-bucket", "new")])
            .status,
        200
    );
    let replaced = Instant::now();
    limits.replace(after);
    let mut seen = None;
    let mut probes = 0;
    while replaced.elapsed() < Duration::from_secs(10) {
        probes += 1;
        if client
            .get(&envoys[1].url("/x"), &[("x-bucket", "new")])
            .status
            == 429
        {
            seen = Some(replaced.elapsed());
            break;
        }
        thread::sleep(Duration::from_millis(10));
    }
    let seen = seen.expect("the new limit never applied");
    // The first probe after the reload passed (1 per hour), the next was denied.
    eprintln!("reload seen after {seen:?} ({probes} probes, poll every {poll_ms} ms)");
    assert!(seen < Duration::from_secs(3), "{seen:?}");
    for h in load {
        h.join().expect("load thread");
    }
    let (ok, total) = (ok.load(Ordering::Relaxed), total.load(Ordering::Relaxed));
    eprintln!("keep: {ok} admitted of {total}, {spent_before} before the reload");
    // Counted across the reload: exactly the limit, not the limit again after it.
    assert_eq!(ok, 200);
    assert_eq!(total, 480);
    // `change` has a new limit: its bucket carries over scaled (contract/README.md: the fraction
    // held is kept), so the 5 spent of 5 leave none of 7, not a fresh bucket of 7.
    assert_eq!(
        count(
            &client.statuses(&envoys[2].url("/x"), &[("x-bucket", "change")], 10),
            200
        ),
        0
    );
    // A bad file is refused, the error named, and the limits in force stay.
    limits.replace("domain: e2e\ndescriptors:\n  - key: bucket\n    value: keep\n    rate_limit: {unit: fortnight, requests_per_unit: 1000}\n");
    assert!(
        eventually(Duration::from_secs(5), || service
            .proc
            .log_text()
            .contains("rls limits file refused")),
        "{}",
        service.proc.log_text()
    );
    let log = service.proc.log_text();
    assert!(
        log.contains("fortnight") && log.contains("e2e.bucket_keep"),
        "{log}"
    );
    let metrics = service.metrics();
    assert!(metrics.contains("tollgate_rls_config_ok 0"), "{metrics}");
    assert!(
        metrics.contains("tollgate_rls_config_reloads_total{outcome=\"ok\"} 1")
            && metrics.contains("tollgate_rls_config_reloads_total{outcome=\"refused\"} 1"),
        "{metrics}"
    );
    let r = client.get(&envoys[0].url("/x"), &[("x-bucket", "keep")]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-limit"), Some("200"));
    assert_eq!(
        client
            .get(&envoys[0].url("/x"), &[("x-bucket", "new")])
            .status,
        429
    );
}

/// envoyproxy/ratelimit's example configuration (examples/ratelimit/config/example.yaml in its
/// repository), as published: replaces, nested and default-value descriptors, a ban
/// (`requests_per_unit: 0`), shadow mode, unlimited, detailed_metric, quota_mode and metadata.
const UPSTREAM_EXAMPLE: &str = r#"---
domain: rl
descriptors:
  - key: category
    value: account
    rate_limit:
      replaces:
        - name: bkthomps
        - name: fake_name
      unit: minute
      requests_per_unit: 4
  - key: source_cluster
    value: proxy
    descriptors:
      - key: destination_cluster
        value: bkthomps
        rate_limit:
          replaces:
            - name: bkthomps
          unit: minute
          requests_per_unit: 2
      - key: destination_cluster
        value: mock
        rate_limit:
          unit: minute
          requests_per_unit: 1
      - key: destination_cluster
        value: override
        rate_limit:
          replaces:
            - name: banned_limit
          unit: minute
          requests_per_unit: 2
      - key: destination_cluster
        value: fake
        rate_limit:
          name: fake_name
          unit: minute
          requests_per_unit: 2
  - key: foo
    rate_limit:
      unit: minute
      requests_per_unit: 2
    descriptors:
      - key: bar
        rate_limit:
          unit: minute
          requests_per_unit: 3
      - key: bar
        value: bkthomps
        rate_limit:
          name: bkthomps
          unit: minute
          requests_per_unit: 1
      - key: bar
        value: banned
        rate_limit:
          name: banned_limit
          unit: minute
          requests_per_unit: 0
      - key: baz
        rate_limit:
          unit: second
          requests_per_unit: 1
      - key: baz
        value: not-so-shady
        rate_limit:
          unit: minute
          requests_per_unit: 3
      - key: baz
        value: shady
        rate_limit:
          unit: minute
          requests_per_unit: 3
        shadow_mode: true
      - key: bay
        rate_limit:
          unlimited: true
  - key: unspec
    detailed_metric: true
    rate_limit:
      unit: minute
      requests_per_unit: 2
  - key: qux
    rate_limit:
      unlimited: true
  - key: service
    value: service_1
    quota_mode: true
    rate_limit:
      unit: minute
      requests_per_unit: 1
    metadata:
      service_with_quota:
        name: "service_1"
  - key: service
    value: service_2
    quota_mode: true
    rate_limit:
      unit: minute
      requests_per_unit: 2
    metadata:
      service_with_quota:
        name: "service_2"
"#;

#[test]
fn envoyproxy_ratelimit_example_config_is_enforced() {
    let c = Components::get();
    let dir = TempDir::new("rls-example");
    let redis = Redis::start(&c, &dir);
    let limits = LimitsFile::new(&dir, UPSTREAM_EXAMPLE);
    let service = start_service(&c, &dir, Some(&redis.url()), &limits, 1000, &[]);
    let upstream = Upstream::start();
    // Descriptors from headers: (source_cluster, destination_cluster) from x-src/x-dst; (foo, bar)
    // or (foo, baz) or (foo, bay) from x-foo and x-bar/x-baz/x-bay; (category) from x-category.
    let h = |header: &str, key: &str| {
        format!("{{request_headers: {{header_name: {header}, descriptor_key: {key}}}}}")
    };
    let rate_limits = format!(
        "[{{actions: [{}, {}]}}, {{actions: [{}, {}]}}, {{actions: [{}, {}]}}, {{actions: [{}, {}]}}, {{actions: [{}]}}]",
        h("x-src", "source_cluster"),
        h("x-dst", "destination_cluster"),
        h("x-foo", "foo"),
        h("x-bar", "bar"),
        h("x-foo", "foo"),
        h("x-baz", "baz"),
        h("x-foo", "foo"),
        h("x-bay", "bay"),
        h("x-category", "category"),
    );
    let spec = native_spec("rl", &rate_limits, service.port, upstream.port);
    let envoys = Envoy::start_all(&c, &dir, std::slice::from_ref(&spec));
    let url = envoys[0].url("/x");
    let client = Client::new();
    let admitted =
        |headers: &[(&str, &str)], n: usize| count(&client.statuses(&url, headers, n), 200);
    // Nested, exact values: 1 per minute.
    assert_eq!(admitted(&[("x-src", "proxy"), ("x-dst", "mock")], 5), 1);
    // Default value of a nested key (bar, any value): 3 per minute, each value its own bucket.
    assert_eq!(admitted(&[("x-foo", "f"), ("x-bar", "b1")], 6), 3);
    assert_eq!(admitted(&[("x-foo", "f"), ("x-bar", "b2")], 6), 3);
    // A ban: requests_per_unit 0.
    assert_eq!(admitted(&[("x-foo", "f"), ("x-bar", "banned")], 3), 0);
    // Shadow mode: counted, never denied.
    assert_eq!(admitted(&[("x-foo", "f"), ("x-baz", "shady")], 6), 6);
    // Unlimited.
    assert_eq!(admitted(&[("x-foo", "f"), ("x-bay", "any")], 6), 6);
    // `category=account` (4 per minute) replaces the limit named bkthomps (1 per minute) for the
    // same request: 4 pass, not 1.
    assert_eq!(
        admitted(
            &[
                ("x-category", "account"),
                ("x-foo", "f"),
                ("x-bar", "bkthomps")
            ],
            6
        ),
        4
    );
    // All or nothing: a request whose second descriptor is over spends nothing from the first.
    // (foo=g, bar=bkthomps) has 1 per minute; category=other matches nothing.
    assert_eq!(admitted(&[("x-foo", "g"), ("x-bar", "bkthomps")], 1), 1);
    assert_eq!(
        admitted(
            &[
                ("x-src", "proxy"),
                ("x-dst", "fake"),
                ("x-foo", "g"),
                ("x-bar", "bkthomps")
            ],
            3
        ),
        0
    );
    // fake (2 per minute) was not charged by those 3 denied requests.
    assert_eq!(admitted(&[("x-src", "proxy"), ("x-dst", "fake")], 4), 2);
    assert_eq!(upstream.requests(), 1 + 3 + 3 + 6 + 6 + 4 + 1 + 2);
}

#[test]
fn the_token_travels_as_initial_metadata() {
    let c = Components::get();
    let dir = TempDir::new("rls-token");
    let limits = LimitsFile::new(
        &dir,
        "domain: e2e\ndescriptors:\n  - key: bucket\n    rate_limit: {unit: hour, requests_per_unit: 2}\n",
    );
    // A token the service accepts: 32 bytes or more, no placeholder.
    let token = "e2e-rls-token-8d2f6b0a4c9e1f3a5b7d9c0e2a4f6b8d";
    let service = start_service(&c, &dir, None, &limits, 1000, &["--token", token]);
    let upstream = Upstream::start();
    let mut spec = native_spec("e2e", BUCKET_ACTIONS, service.port, upstream.port);
    spec.concurrency = 1;
    if let Some(rls) = spec.native_rls.as_mut() {
        rls.token = Some(token.into());
    }
    let with_token = Envoy::start_all(&c, &dir, std::slice::from_ref(&spec));
    if let Some(rls) = spec.native_rls.as_mut() {
        rls.token = None;
    }
    let without = Envoy::start_all(&c, &dir, std::slice::from_ref(&spec));
    let client = Client::new();
    let h = [("x-bucket", "t")];
    assert_eq!(
        client.statuses(&with_token[0].url("/x"), &h, 3),
        vec![200, 200, 429]
    );
    // Refused UNAUTHENTICATED: the filter's failure_mode_deny answers 500, nothing reaches upstream.
    assert_eq!(client.get(&without[0].url("/x"), &h).status, 500);
    assert_eq!(upstream.requests(), 2);
    assert!(service.metrics().contains("code=\"unauthenticated\""));
}

/// A reply's `x-ratelimit-reset`, in seconds (0 when absent).
fn reset_secs(r: &Reply) -> u64 {
    r.header("x-ratelimit-reset")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Envoy's own `enable_x_ratelimit_headers` and a service that adds none unless `--rls-headers`:
/// each header once, and what they say is what the statuses say: the remaining as the bucket
/// holds it, the reset when it is full again (a token bucket of 20 a day: 4,320 s per request
/// taken), and on a denial when a request could pass.
#[test]
fn envoys_own_headers_come_once_and_say_what_the_answer_says() {
    let c = Components::get();
    let dir = TempDir::new("rls-envoy-headers");
    let limits = LimitsFile::new(
        &dir,
        "domain: e2e\ndescriptors:\n  - key: bucket\n    value: day\n    rate_limit: {unit: day, requests_per_unit: 20}\n",
    );
    let service = start_service(&c, &dir, None, &limits, 1000, &[]);
    let upstream = Upstream::start();
    let mut spec = native_spec("e2e", BUCKET_ACTIONS, service.port, upstream.port);
    if let Some(rls) = spec.native_rls.as_mut() {
        rls.x_ratelimit_headers = true;
    }
    let envoy = Envoy::start(&c, &dir, &spec);
    let client = Client::new();
    let h = [("x-bucket", "day")];
    let r = client.get(&envoy.url("/x"), &h);
    assert_eq!(r.status, 200, "{r:?}");
    // Only the descriptor with a limit counts (generic_key=all matches none).
    assert_eq!(
        r.header("x-ratelimit-limit"),
        Some("20, 20;w=86400"),
        "{r:?}"
    );
    assert_eq!(r.header("x-ratelimit-remaining"), Some("19"));
    assert_eq!(r.header("x-ratelimit-reset"), Some("4320"));
    assert_eq!(
        r.header("ratelimit-policy"),
        None,
        "the service's are off: {r:?}"
    );
    assert_eq!(r.header("ratelimit"), None);
    let r = client.get(&envoy.url("/x"), &h);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("18"));
    // Full again 8,640 s after the second take (less what refilled since the first).
    assert!((8630..=8640).contains(&reset_secs(&r)), "{r:?}");
    assert_eq!(count(&client.statuses(&envoy.url("/x"), &h, 18), 200), 18);
    let r = client.get(&envoy.url("/x"), &h);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    // One request passes again within 4,320 s (the refill since the first take shortens it).
    assert!((4300..=4320).contains(&reset_secs(&r)), "{r:?}");
    assert_eq!(upstream.requests(), 20);
}

/// A route with 20 rate limit actions: Envoy sends 20 descriptors, every one matching a limit.
/// They are decided together, all or nothing (not refused, which Envoy's default failure mode
/// would turn into "let everything through").
#[test]
fn twenty_descriptors_are_decided_together() {
    let c = Components::get();
    let dir = TempDir::new("rls-many");
    let redis = Redis::start(&c, &dir);
    let mut file = String::from("domain: e2e\ndescriptors:\n");
    let mut actions = Vec::new();
    for i in 0..20 {
        let rpu = if i == 13 { 2 } else { 5 };
        file.push_str(&format!(
            "  - key: d{i}\n    value: x\n    rate_limit: {{unit: minute, requests_per_unit: {rpu}}}\n"
        ));
        actions.push(format!(
            "{{actions: [{{generic_key: {{descriptor_key: d{i}, descriptor_value: x}}}}]}}"
        ));
    }
    let limits = LimitsFile::new(&dir, &file);
    let service = start_service(&c, &dir, Some(&redis.url()), &limits, 1000, &[]);
    let upstream = Upstream::start();
    let spec = native_spec(
        "e2e",
        &format!("[{}]", actions.join(", ")),
        service.port,
        upstream.port,
    );
    let envoy = Envoy::start(&c, &dir, &spec);
    // d13 (2 per minute) decides: the third request is denied.
    assert_eq!(
        Client::new().statuses(&envoy.url("/x"), &[], 4),
        vec![200, 200, 429, 429]
    );
    assert_eq!(upstream.requests(), 2);
}

/// A ban (`requests_per_unit: 0`) and a cost above the limit never pass: the 429 carries no
/// `retry-after` (it said 1 and 60), and nothing is charged.
#[test]
fn what_never_passes_has_no_retry_after() {
    let c = Components::get();
    let dir = TempDir::new("rls-never");
    let limits = LimitsFile::new(
        &dir,
        "domain: e2e\ndescriptors:\n  - key: bucket\n    value: ban\n    rate_limit: {unit: minute, requests_per_unit: 0}\n  - key: bucket\n    value: three\n    rate_limit: {unit: minute, requests_per_unit: 3}\n",
    );
    let service = start_service(&c, &dir, None, &limits, 1000, &["--rls-headers"]);
    let upstream = Upstream::start();
    // The request's cost from its x-cost header (a descriptor's hits_addend).
    let actions = "[{actions: [{request_headers: {header_name: x-bucket, descriptor_key: bucket}}], hits_addend: {format: \"%REQ(x-cost)%\"}}]";
    let mut spec = native_spec("e2e", actions, service.port, upstream.port);
    if let Some(rls) = spec.native_rls.as_mut() {
        rls.per_route = true;
    }
    let envoy = Envoy::start(&c, &dir, &spec);
    let client = Client::new();
    let r = client.get(&envoy.url("/x"), &[("x-bucket", "ban"), ("x-cost", "1")]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), None, "{r:?}");
    assert_eq!(r.header("x-ratelimit-limit"), Some("0"));
    assert_eq!(r.header("x-ratelimit-reset"), None);
    let r = client.get(&envoy.url("/x"), &[("x-bucket", "three"), ("x-cost", "4")]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), None, "{r:?}");
    let r = client.get(&envoy.url("/x"), &[("x-bucket", "three"), ("x-cost", "3")]);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    let r = client.get(&envoy.url("/x"), &[("x-bucket", "three"), ("x-cost", "1")]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("20"), "{r:?}");
    assert_eq!(upstream.requests_through(envoy.port), 1);
}

/// Envoy Gateway's and Envoy AI Gateway's response-cost pattern, through the native filter: a
/// check with `hits_addend: 0` when the request arrives, and the cost the response reported
/// (here an LLM-like upstream's `x-usage-tokens` header, put in dynamic metadata by
/// `header_to_metadata`) charged with `apply_on_stream_done` when it ends. A limit of 2 per
/// minute with `charge: response`: two responses of 1 and the third request is denied; one
/// response of 3 leaves the bucket owing 1, and the next check waits for the debt and one unit
/// (60 s).
#[test]
fn the_response_cost_pattern_denies_once_the_responses_spent_the_limit() {
    let c = Components::get();
    let dir = TempDir::new("rls-response-cost");
    let redis = Redis::start(&c, &dir);
    let limits = LimitsFile::new(
        &dir,
        "domain: e2e\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 2, charge: response}\n",
    );
    let service = start_service(&c, &dir, Some(&redis.url()), &limits, 1000, &[]);
    let llm = Llm::start();
    let tenant = "{request_headers: {header_name: x-tenant, descriptor_key: tenant}}";
    let actions = format!(
        "[{{actions: [{tenant}], hits_addend: {{number: 0}}}}, \
         {{actions: [{tenant}], apply_on_stream_done: true, \
         hits_addend: {{format: \"%DYNAMIC_METADATA(tollgate.cost:cost)%\"}}}}]"
    );
    let mut spec = native_spec("e2e", &actions, service.port, llm.port);
    if let Some(rls) = spec.native_rls.as_mut() {
        rls.x_ratelimit_headers = true;
        rls.per_route = true;
    }
    spec.extra_http_filters = vec![r#"name: envoy.filters.http.header_to_metadata
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
  response_rules:
  - header: x-usage-tokens
    on_header_present: {metadata_namespace: tollgate.cost, key: cost, type: STRING}
"#
    .to_string()];
    let envoy = Envoy::start(&c, &dir, &spec);
    let client = Client::new();
    // The charge leaves after the response: wait until the service applied it (one settlement
    // per response the client got whole; a 429 reports no usage and charges nothing) before the
    // next check. Counted from the client's side: the upstream records a response only after
    // writing it, so its own count can trail what the client already read.
    let admitted = std::cell::Cell::new(0usize);
    let get = |tenant: &str, cost: &str| {
        let h = [
            ("x-tenant", tenant),
            ("x-llm-usage", cost),
            ("x-llm-report", "header"),
        ];
        let r = client.get(&envoy.url("/v1/chat/completions"), &h);
        if r.status == 200 {
            admitted.set(admitted.get() + 1);
        }
        let want = format!(
            "tollgate_settlements_total{{outcome=\"applied\"}} {}",
            admitted.get()
        );
        assert!(
            admitted.get() == 0
                || eventually(Duration::from_secs(5), || service.metrics().contains(&want)),
            "{want}"
        );
        r
    };
    let statuses: Vec<u16> = (0..3).map(|_| get("a", "1").status).collect();
    assert_eq!(statuses, vec![200, 200, 429]);
    assert!(eventually(Duration::from_secs(1), || llm.served().len() == 2));
    let r = get("b", "3");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-usage-tokens"), Some("3"));
    assert_eq!(
        r.header("x-ratelimit-remaining"),
        Some("2"),
        "the check charged nothing: {r:?}"
    );
    let r = get("b", "1");
    assert_eq!(r.status, 429, "{r:?}");
    assert_eq!(r.header("x-ratelimit-limit"), Some("2, 2;w=60"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    // Owing 1: the debt and one unit refill in 60 s (2 per minute).
    assert!((55..=60).contains(&reset_secs(&r)), "{r:?}");
    assert!(eventually(Duration::from_secs(1), || llm.served().len() == 3));
}

/// The migration page's own configuration, run: docs/migrating.md's limits file in the service,
/// its Envoy filter and routes in a real Envoy (as the page writes them; only the RLS call's
/// timeout is raised from 50 ms, so a loaded test machine cannot turn a decision into a failure
/// Envoy lets through). `/login` from one address: the page's 20 per hour for that address, then
/// 429 with Envoy's own rate limit headers; another path from the same address is still admitted
/// (its 100 a minute has room).
#[test]
fn the_migration_page_s_configuration_limits_as_it_says() {
    use tollgate_testkit::docs::{blocks_in_of, list_items, with_routes, Kind};
    const PAGE: &str = "docs/migrating.md";
    let one = |kind: Kind| {
        blocks_in_of(Some(PAGE), kind)
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("{PAGE} has no {kind:?} block"))
            .text
    };
    let (limits, filters, routes) = (
        one(Kind::Limits),
        one(Kind::EnvoyHttpFilters),
        one(Kind::EnvoyRoutes),
    );
    assert!(limits.contains("requests_per_unit: 20"), "{limits}");
    let filters = filters.replace("timeout: 0.05s", "timeout: 1s");

    let c = Components::get();
    let dir = TempDir::new("migrating");
    let file = LimitsFile::new(&dir, &limits);
    let service = start_service(&c, &dir, None, &file, 1000, &[]);
    let upstream = Upstream::start();
    let mut spec = EnvoySpec::new(None, service.port, upstream.port);
    spec.extra_http_filters = list_items(&filters);
    let envoy = Envoy::try_start_from(&c, &dir, &spec, Duration::from_secs(20), &|port, admin| {
        with_routes(&spec.yaml(&c.wasm, port, admin), &routes).expect("the page's routes")
    })
    .unwrap_or_else(|f| panic!("Envoy with the page's configuration: {f:?}"));
    let client = Client::new();
    let login = envoy.url("/login");
    let statuses = client.statuses(&login, &[], 21);
    assert_eq!(
        statuses.iter().filter(|&&s| s == 200).count(),
        20,
        "20 an hour for one address at /login: {statuses:?}"
    );
    let denied = client.get(&login, &[]);
    assert_eq!(denied.status, 429);
    // Envoy's DRAFT_VERSION_03 headers: the denying limit first, then each descriptor's policy.
    assert_eq!(
        denied.header("x-ratelimit-limit").map(str::trim),
        Some("20, 100;w=60, 20;w=3600"),
        "{denied:?}"
    );
    assert_eq!(denied.header("x-ratelimit-remaining"), Some("0"));
    // A token of 20 an hour comes every 180 s: the next request could pass within that.
    let reset: u64 = denied
        .header("x-ratelimit-reset")
        .and_then(|v| v.parse().ok())
        .expect("x-ratelimit-reset");
    assert!((1..=180).contains(&reset), "{denied:?}");
    assert_eq!(client.get(&envoy.url("/other"), &[]).status, 200);
    assert_eq!(upstream.requests(), 21);
}

/// Envoy's native filter in front of a service on Redis Sentinel (upstream's
/// `REDIS_TYPE=sentinel`), the master killed (SIGKILL) under load: every client gets 200 or 429
/// (the moment without a master is Envoy's `failure_mode_deny: false`, requests let through
/// undecided, never a 5xx), decisions are back within 1 s of a sentinel naming the promoted
/// replica, and the limit holds across the failover: the decided admissions exceed it by at most
/// the clients in flight at the kill (whose writes may not have reached the replica).
#[test]
fn a_sentinel_master_killed_under_load_no_5xx_and_the_limit_holds() {
    const LIMIT: usize = 1000;
    const CLIENTS: usize = 8;
    let c = Components::get();
    let dir = TempDir::new("rls-sentinel");
    let name = "e2e-master";
    let mut setup = tollgate_testkit::redis::SentinelSetup::start(name, &[]);
    let limits = LimitsFile::new(
        &dir,
        &format!(
            "domain: e2e\ndescriptors:\n  - key: bucket\n    value: ha\n    rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}\n"
        ),
    );
    let sentinels = setup.sentinel_urls().join(",");
    let service = start_service(
        &c,
        &dir,
        None,
        &limits,
        200,
        &[
            "--rls-headers",
            "--redis-sentinel",
            &sentinels,
            "--redis-sentinel-master",
            name,
        ],
    );
    let upstream = Upstream::start();
    let mut spec = native_spec("e2e", BUCKET_ACTIONS, service.port, upstream.port);
    // Envoy's default: a request the service cannot decide goes through.
    if let Some(rls) = spec.native_rls.as_mut() {
        rls.failure_mode_deny = false;
    }
    let envoys = Envoy::start_all(&c, &dir, &vec![spec; 2]);
    let old = setup.master().expect("a master");
    let new = setup.other(old);

    // (when, status, decided): a decided answer carries the service's headers; one Envoy let
    // through without an answer carries none.
    let answers = std::sync::Mutex::new(Vec::<(Duration, u16, bool)>::new());
    let stop = std::sync::atomic::AtomicBool::new(false);
    let start = Instant::now();
    let (killed_at, named_at) = thread::scope(|s| {
        for i in 0..CLIENTS {
            let (url, answers, stop) = (envoys[i % envoys.len()].url("/x"), &answers, &stop);
            s.spawn(move || {
                let client = Client::new();
                while !stop.load(Ordering::Relaxed) && start.elapsed() < Duration::from_secs(40) {
                    let r = client.get(&url, &[("x-bucket", "ha")]);
                    let decided = r.header("x-ratelimit-limit").is_some();
                    answers
                        .lock()
                        .unwrap()
                        .push((start.elapsed(), r.status, decided));
                }
            });
        }
        thread::sleep(Duration::from_millis(400));
        let killed_at = start.elapsed();
        setup.kill_node(old);
        let named = tollgate_testkit::process::eventually(Duration::from_secs(30), || {
            setup.masters().contains(&Some(new))
        });
        let named_at = start.elapsed();
        // Load on until the limit has been denying for a second (or 40 s in all).
        let denying = tollgate_testkit::process::eventually(Duration::from_secs(20), || {
            let a = answers.lock().unwrap();
            a.iter()
                .find(|x| x.0 > named_at && x.1 == 429)
                .is_some_and(|first| start.elapsed() > first.0 + Duration::from_secs(1))
        });
        stop.store(true, Ordering::Relaxed);
        assert!(named, "no sentinel named {new} within 30 s of the kill");
        assert!(denying, "the limit never denied after the failover");
        (killed_at, named_at)
    });
    let answers = answers.into_inner().unwrap();
    let bad: Vec<_> = answers
        .iter()
        .filter(|a| a.1 != 200 && a.1 != 429)
        .collect();
    assert!(
        bad.is_empty(),
        "answers other than 200 and 429: {:?}",
        &bad[..bad.len().min(5)]
    );
    let undecided = answers.iter().filter(|a| !a.2).count();
    let decided_ok = answers.iter().filter(|a| a.1 == 200 && a.2).count();
    let back = answers
        .iter()
        .find(|a| a.0 > named_at && a.2)
        .expect("decisions after the promotion");
    let late_undecided = answers
        .iter()
        .filter(|a| a.0 > named_at + Duration::from_secs(1) && !a.2)
        .count();
    eprintln!(
        "sentinel: killed at {killed_at:?}, named at {named_at:?}, first decision {:?} after; \
         {} answers, {undecided} let through undecided, {decided_ok} admitted by decision (limit \
         {LIMIT}), upstream saw {}",
        back.0.saturating_sub(named_at),
        answers.len(),
        upstream.requests()
    );
    assert!(
        undecided > 0,
        "the kill went unnoticed: no answer was undecided"
    );
    assert!(
        back.0.saturating_sub(named_at) < Duration::from_secs(1),
        "decisions back {:?} after a sentinel named the new master",
        back.0.saturating_sub(named_at)
    );
    assert_eq!(
        late_undecided, 0,
        "undecided answers more than 1 s after the naming"
    );
    assert!(
        decided_ok <= LIMIT + CLIENTS,
        "{decided_ok} admitted by decision for a limit of {LIMIT}"
    );
    let admitted = answers.iter().filter(|a| a.1 == 200).count() as u64;
    assert_eq!(upstream.requests(), admitted);
}
