//! The model a request asks for, read from its JSON body (`"model": {"body": true}`) before it is
//! decided: a limit per team and model, and one budget in money units across models (each model's
//! tokens at its own price). Real Envoy (the body held while it is read, whole or in pieces), the
//! real service on real Redis, an upstream that answers like an LLM API.

use crate::common;

use common::config::plugin;
use common::{Client, Components, Envoy, EnvoySpec, Llm, Redis, Service, TempDir, Transport};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::Duration;

const BUDGET: u64 = 100_000;

fn config(max_body_bytes: u64) -> String {
    plugin(
        Transport::Grpc,
        vec![
            // Two requests per team and model a minute.
            json!({"name": "per-model", "key": ["header:x-team", "model"],
                   "capacity": 2, "period_ms": 60_000, "algorithm": "fixed_window"}),
            // One budget across models: a "big" token costs 3 (prompt) or 10 (completion), any
            // other model's 1.
            json!({"name": "spend", "key": ["header:x-team"], "capacity": BUDGET,
                   "period_ms": 3_600_000, "rate": 1,
                   "cost": {"reserve": "max", "max": 2000}, "charge": "response",
                   "usage": {"weights": {"prompt": 1, "completion": 1},
                             "prices": {"big": {"prompt": 3, "completion": 10}}}}),
        ],
        json!({"model": {"body": true, "max_body_bytes": max_body_bytes},
               "service": {"batch": 0}}),
    )
}

fn ask(client: &Client, envoy: &Envoy, team: &str, body: &str) -> u16 {
    // 100 tokens reported: 25 prompt, 75 completion.
    client
        .post(
            &envoy.url("/v1/chat/completions"),
            &[
                ("x-team", team),
                ("content-type", "application/json"),
                ("x-llm-usage", "100"),
            ],
            body.as_bytes(),
        )
        .status
}

/// The same request, its body written in two pieces 100 ms apart (Envoy reads it as it comes).
fn ask_in_pieces(envoy: &Envoy, team: &str, body: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", envoy.port)).expect("connect to envoy");
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: llm\r\nx-team: {team}\r\nx-llm-usage: 100\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let (a, b) = body.split_at(body.len() / 2);
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(a.as_bytes()).unwrap();
    s.flush().unwrap();
    thread::sleep(Duration::from_millis(100));
    s.write_all(b.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).ok();
    out
}

/// The team's budget as it stands at the service (a settle of nothing).
fn spent(client: &Client, service: &Service, team: &str) -> u64 {
    let body = json!({"id": format!("probe-{team}-{}", std::process::id()),
        "buckets": [{"key": format!("spend|{team}"), "capacity": BUDGET, "rate": 1,
                     "period_ms": 3_600_000, "estimate": 0, "used": 0}]});
    let r = client.post(
        &format!("http://127.0.0.1:{}/v1/settle", service.port),
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    BUDGET - v["buckets"][0]["remaining"].as_u64().unwrap()
}

#[test]
fn limits_and_prices_follow_the_model_in_the_body() {
    let c = Components::get();
    let dir = TempDir::new("models");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let llm = Llm::start();
    let envoy = Envoy::start(
        &c,
        &dir,
        &EnvoySpec::new(Some(config(1024)), service.port, llm.port),
    );
    let client = Client::new();
    let big = r#"{"messages":[{"role":"user","content":"hi"}],"model":"big"}"#;
    let small = r#"{"model":"small","messages":[{"role":"user","content":"hi"}]}"#;

    // Two a minute per model: "big" twice, then refused; "small" is its own bucket.
    assert_eq!(ask(&client, &envoy, "t1", big), 200);
    assert_eq!(ask(&client, &envoy, "t1", big), 200);
    assert_eq!(ask(&client, &envoy, "t1", big), 429);
    assert_eq!(ask(&client, &envoy, "t1", small), 200);
    // A body that arrives in two pieces is read as one: its model is counted.
    let r = ask_in_pieces(&envoy, "t1", small);
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert_eq!(
        ask(&client, &envoy, "t1", small),
        429,
        "the pieces' request counted"
    );
    // The model past `max_body_bytes` (1,024): not read, the per-model rule skipped.
    let late = format!(r#"{{"pad":"{}","model":"big"}}"#, "x".repeat(2000));
    assert_eq!(ask(&client, &envoy, "t1", &late), 200);
    // Not JSON: no model either.
    assert_eq!(ask(&client, &envoy, "t1", "model=big"), 200);
    // 10 MB, its model at the end: past the bound, no model; the body, held while the take is
    // in flight (under flow control, never buffered whole), reaches the upstream whole.
    let huge = format!(r#"{{"pad":"{}","model":"big"}}"#, "x".repeat(10 << 20));
    assert_eq!(ask(&client, &envoy, "t1", &huge), 200);

    // The budget: each response reported 25 prompt and 75 completion tokens. Two "big" ones at
    // 3 and 10 (825 each); two "small" ones and the three without a model at 1 and 1 (100 each).
    assert!(
        common::eventually(Duration::from_secs(10), || {
            envoy.tg("settle.delivered") >= 7
        }),
        "settlements: {:?}",
        envoy.tg_all()
    );
    assert_eq!(spent(&client, &service, "t1"), 2 * 825 + 5 * 100);
    // The two refused requests never reached the upstream as requests: it answered the seven
    // admitted ones only (their headers went on before the decision; the body, held, did not).
    assert_eq!(llm.served().len(), 7, "{:?}", llm.served());
    drop(envoy);
}

/// The model read by Envoy's own `json_to_metadata` filter in front (it holds the headers until it
/// has parsed the body) and Tollgate reading it from the dynamic metadata at the headers: nothing
/// reaches the router before the decision, and a route that answers at its headers is limited too.
#[test]
fn the_model_from_metadata_is_read_before_anything_goes_on() {
    let c = Components::get();
    let dir = TempDir::new("models-metadata");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let llm = Llm::start();
    let cfg = plugin(
        Transport::Grpc,
        vec![
            json!({"name": "per-model", "key": ["header:x-team", "model"],
                    "capacity": 2, "period_ms": 60_000, "algorithm": "fixed_window"}),
        ],
        json!({"model": {"metadata": ["envoy.filters.http.json_to_metadata", "model"]},
               "service": {"batch": 0}}),
    );
    let mut spec = EnvoySpec::new(Some(cfg), service.port, llm.port);
    spec.first_http_filters = vec![r#"name: envoy.filters.http.json_to_metadata
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata
  request_rules:
    rules:
    - selectors: [{key: model}]
      on_present: {metadata_namespace: envoy.filters.http.json_to_metadata, key: model, type: STRING}
"#
    .to_string()];
    let envoy = Envoy::start(&c, &dir, &spec);
    let client = Client::new();
    let big = r#"{"messages":[],"model":"big"}"#;
    let small = r#"{"model":"small"}"#;
    for (body, want) in [
        (big, 200),
        (big, 200),
        (big, 429),
        (small, 200),
        (small, 200),
        (small, 429),
    ] {
        assert_eq!(ask(&client, &envoy, "t1", body), want, "{body}");
    }
    // Another team: its own buckets.
    assert_eq!(ask(&client, &envoy, "t2", big), 200);
    // The upstream answered the five admitted requests only.
    assert_eq!(llm.served().len(), 5, "{:?}", llm.served());
    drop(envoy);
}
