//! The harness itself, on real processes: Envoy without the filter routes to the counting upstream,
//! Redis answers PING, the gate forwards, refuses and black-holes as told.

// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

mod common;

use common::*;
use std::time::Duration;

#[test]
fn envoy_without_filter_reaches_the_counting_upstream() {
    let c = Components::get();
    let dir = TempDir::new("harness");
    let upstream = Upstream::start();
    let spec = EnvoySpec::new(None, closed_port(), upstream.port);
    let envoy = Envoy::start(&c, &dir, &spec);
    let client = Client::new();
    for _ in 0..5 {
        let r = client.get(&envoy.url("/x"), &[("x-test", "1")]);
        assert_eq!(r.status, 200);
        assert_eq!(r.body, "upstream\n");
    }
    assert_eq!(upstream.requests(), 5);
    assert!(upstream.heads()[0].starts_with("GET /x HTTP/1.1"));
    let stats = envoy.stats("cluster.upstream.upstream_rq_total");
    assert_eq!(stats.get("cluster.upstream.upstream_rq_total"), Some(&5));
}

#[test]
fn redis_and_gate_modes() {
    let c = Components::get();
    let dir = TempDir::new("harness-redis");
    let mut redis = Redis::start(&c, &dir);
    assert!(redis_ping(redis.port));
    let gate = Gate::start(GateMode::Forward, redis.port);
    assert!(redis_ping(gate.port), "forwarded PING");
    gate.set_mode(GateMode::Refuse);
    assert!(!redis_ping(gate.port), "refused");
    gate.set_mode(GateMode::BlackHole);
    let t = std::time::Instant::now();
    assert!(!redis_ping(gate.port), "black hole answers nothing");
    assert!(t.elapsed() >= Duration::from_millis(400));
    assert_eq!(gate.accepted(), 3);
    redis.stop();
    assert!(!redis_ping(redis.port));
}

/// A module panic or trap in Envoy's log fails the test that ran that Envoy.
#[test]
#[should_panic(expected = "the module failed in Envoy")]
fn a_module_failure_in_envoys_log_fails_the_test() {
    use std::io::Write;
    let c = Components::get();
    let dir = TempDir::new("harness-panic");
    let spec = EnvoySpec::new(None, closed_port(), closed_port());
    let mut envoy = Envoy::start(&c, &dir, &spec);
    envoy.proc.kill();
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .open(&envoy.proc.log)
        .expect("open envoy log");
    writeln!(
        log,
        "[critical][wasm] wasm log tollgate: panic: injected by the test"
    )
    .expect("write");
    drop(envoy);
}

/// The checked-in `envoy.yaml` (what `make run` starts) and the generator cannot drift apart: Envoy
/// loads both, the file (on free ports, the module under test in place) and the generator's output
/// for the same inputs (its plugin configuration, ports, connect timeout, failure policy), and the
/// edge connection manager (its HTTP filters included, its routes aside) and the `tollgate` and
/// `upstream` clusters in the two `/config_dump`s are the same.
#[test]
fn the_generator_matches_the_checked_in_envoy_yaml() {
    let c = Components::get();
    let dir = TempDir::new("harness-envoy-yaml");
    let text = std::fs::read_to_string(workspace_root().join("envoy.yaml")).expect("envoy.yaml");
    let module = "filename: dist/tollgate.wasm";
    assert!(text.contains(module), "envoy.yaml loads {module}");
    let checked_in = text.replace(module, &format!("filename: \"{}\"", c.wasm.display()));
    let plugin_json = block_scalar_after(&text, "value: |");
    // envoy.yaml's own upstream listener, on a free port; its `upstream` cluster points there.
    let upstream_port = free_port();
    let mut spec = EnvoySpec::new(Some(plugin_json), 8081, upstream_port);
    spec.connect_timeout_ms = 250;
    spec.failure_policy = Some("FAIL_RELOAD".to_string());
    let from_file =
        Envoy::try_start_from(&c, &dir, &spec, Duration::from_secs(30), &|port, admin| {
            checked_in
                .replace("port_value: 9901", &format!("port_value: {admin}"))
                .replace("port_value: 10000", &format!("port_value: {port}"))
                .replace("port_value: 10001", &format!("port_value: {upstream_port}"))
        })
        .unwrap_or_else(|f| panic!("envoy.yaml did not start: {:?}\n{}", f.status, f.log));
    let generated = Envoy::start(&c, &dir, &spec);
    let (file, generated) = (config_dump(&from_file), config_dump(&generated));
    assert_eq!(
        edge_connection_manager(&file),
        edge_connection_manager(&generated)
    );
    for name in ["tollgate", "upstream"] {
        assert_eq!(
            static_cluster(&file, name),
            static_cluster(&generated, name)
        );
    }
    // Not a comparison of nothing: the filter and the HTTP/2 option are there.
    let hcm = edge_connection_manager(&generated).to_string();
    assert!(
        hcm.contains("envoy.filters.http.wasm") && hcm.contains("FAIL_RELOAD"),
        "{hcm}"
    );
    assert!(static_cluster(&generated, "tollgate")
        .to_string()
        .contains("http2_protocol_options"));
}

/// The lines of the YAML block scalar that follows the line `key` (trimmed), without their
/// indentation.
fn block_scalar_after(text: &str, key: &str) -> String {
    let mut lines = text.lines().skip_while(|l| l.trim() != key).skip(1);
    let first = lines.next().expect("a block scalar");
    let indent = first.len() - first.trim_start().len();
    std::iter::once(first)
        .chain(lines.take_while(|l| l.len() > indent && l[..indent].trim().is_empty()))
        .map(|l| &l[indent..])
        .collect::<Vec<_>>()
        .join("\n")
}

fn config_dump(envoy: &Envoy) -> serde_json::Value {
    let reply = http_get(envoy.admin_port, "/config_dump").expect("admin /config_dump");
    assert_eq!(reply.status, 200, "{}", reply.body);
    serde_json::from_str(&reply.body).expect("config_dump is JSON")
}

/// The section of a config dump whose `@type` ends with `kind`.
fn dump_section<'a>(dump: &'a serde_json::Value, kind: &str) -> &'a serde_json::Value {
    dump["configs"]
        .as_array()
        .and_then(|configs| {
            configs
                .iter()
                .find(|c| c["@type"].as_str().is_some_and(|t| t.ends_with(kind)))
        })
        .unwrap_or_else(|| panic!("no {kind} in the config dump"))
}

/// The edge listener's HTTP connection manager without its routes.
fn edge_connection_manager(dump: &serde_json::Value) -> serde_json::Value {
    let listeners = dump_section(dump, "ListenersConfigDump")["static_listeners"]
        .as_array()
        .expect("static listeners");
    let edge = listeners
        .iter()
        .find(|l| l["listener"]["name"] == "edge")
        .expect("the edge listener");
    let mut hcm = edge["listener"]["filter_chains"][0]["filters"][0]["typed_config"].clone();
    hcm.as_object_mut()
        .expect("typed_config")
        .remove("route_config");
    hcm
}

fn static_cluster(dump: &serde_json::Value, name: &str) -> serde_json::Value {
    dump_section(dump, "ClustersConfigDump")["static_clusters"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["cluster"]["name"] == name))
        .map(|c| c["cluster"].clone())
        .unwrap_or_else(|| panic!("no cluster {name}"))
}
