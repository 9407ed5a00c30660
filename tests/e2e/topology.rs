//! End to end, `client_ip` in each topology the shipped manifests document, with the
//! `trusted_hops` (and the connection manager settings) read from those manifests:
//!
//! - an edge Envoy with `use_remote_address: true` (Envoy Gateway's listener): clients connect to
//!   Envoy directly;
//! - one trusted load balancer in front, appending the client's address to `x-forwarded-for`: an
//!   ingress gateway with `use_remote_address: true` (Istio), and plain Envoy resolving the client
//!   itself (`use_remote_address: true`, `xff_num_trusted_hops: 1`, deploy/envoy/envoy.yaml).
//!
//! Clients are told apart by source address (127.0.0.2, 127.0.0.3, ... are all loopback). In each
//! topology two clients get two buckets, and a client that forges `x-forwarded-for` is still
//! charged to its own bucket: it neither spends another client's tokens nor escapes its own.

#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::common;

use common::config::{plugin, rule};
use common::loopback::{get_from, XffProxy};
use common::*;
use serde_json::json;
use std::net::Ipv4Addr;

/// Tokens per client.
const CAPACITY: u64 = 3;

const A: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const B: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
const FORGER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 4);
const VICTIM: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 5);

/// The number after `key:` (YAML) or `"key":` (JSON) on a line of a shipped manifest; the key must
/// start the line (so `trusted_hops` does not match `xff_num_trusted_hops`).
fn manifest_value(rel: &str, key: &str) -> String {
    let path = workspace_root().join(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{rel}: {e}"));
    let values: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter_map(|l| {
            l.strip_prefix(&format!("{key}:"))
                .or_else(|| l.strip_prefix(&format!("\"{key}\":")))
        })
        .map(|v| v.trim().trim_end_matches(',').to_string())
        .collect();
    assert_eq!(
        values.len(),
        1,
        "{rel}: one {key} expected, found {values:?}"
    );
    values[0].clone()
}

fn manifest_number(rel: &str, key: &str) -> u32 {
    manifest_value(rel, key)
        .parse()
        .unwrap_or_else(|e| panic!("{rel}: {key}: {e}"))
}

/// A stack whose filter keys one bucket per `client_ip` with `trusted_hops`, its connection
/// manager set by `hcm`.
fn stack(label: &str, trusted_hops: u32, hcm: impl FnOnce(&mut EnvoySpec)) -> Stack {
    let cfg = plugin(
        Transport::Http,
        vec![rule("per-ip", &["client_ip"], CAPACITY)],
        json!({"trusted_hops": trusted_hops, "failure_mode": "deny"}),
    );
    Stack::start_with(label, &cfg, hcm)
}

/// `n` requests from `src` to `port`, with `headers`: their statuses.
fn statuses(src: Ipv4Addr, port: u16, n: u64, headers: &[(&str, &str)]) -> Vec<u16> {
    (0..n)
        .map(|_| get_from(src, port, "/", headers).unwrap_or(0))
        .collect()
}

/// The checks every topology must pass, clients connecting to `port` (Envoy, or the load balancer
/// in front of it).
fn two_clients_two_buckets_and_no_forgery(s: &Stack, port: u16) {
    let ok = vec![200; CAPACITY as usize];
    // Client A spends its bucket.
    assert_eq!(statuses(A, port, CAPACITY, &[]), ok, "A's tokens");
    assert_eq!(statuses(A, port, 1, &[]), vec![429], "A is out of tokens");
    // Client B has a bucket of its own.
    assert_eq!(statuses(B, port, CAPACITY, &[]), ok, "B's own bucket");
    assert_eq!(statuses(B, port, 1, &[]), vec![429]);
    // The forger claims to be the victim: it spends its own tokens, not the victim's ...
    let as_victim = [("x-forwarded-for", "127.0.0.5")];
    assert_eq!(statuses(FORGER, port, CAPACITY, &as_victim), ok);
    assert_eq!(statuses(FORGER, port, 1, &as_victim), vec![429]);
    // ... and claiming a fresh address (or A's, or a list) buys it nothing.
    for forged in [
        "127.0.0.99",
        "127.0.0.2",
        "10.1.2.3, 127.0.0.98",
        "not-an-ip",
    ] {
        assert_eq!(
            statuses(FORGER, port, 1, &[("x-forwarded-for", forged)]),
            vec![429],
            "forged x-forwarded-for: {forged}"
        );
    }
    // The victim's tokens are all there.
    assert_eq!(
        statuses(VICTIM, port, CAPACITY, &[]),
        ok,
        "the victim's tokens"
    );
    assert_eq!(statuses(VICTIM, port, 1, &[]), vec![429]);
    // Four clients, four buckets: every admitted request reached the upstream, no more.
    assert_eq!(s.upstream.requests(), 4 * CAPACITY);
    assert_eq!(s.envoy.tg("allowed"), 4 * CAPACITY);
}

/// Envoy Gateway's listener: an edge Envoy with `use_remote_address: true`, clients connecting
/// directly.
#[test]
fn edge_envoy_with_use_remote_address() {
    let hops = manifest_number(
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
        "trusted_hops",
    );
    let s = stack("topology-edge", hops, |spec| {
        spec.use_remote_address = true;
        spec.xff_num_trusted_hops = 0;
    });
    two_clients_two_buckets_and_no_forgery(&s, s.envoy.port);
}

/// Istio's ingress gateway (`use_remote_address: true`) behind one load balancer that appends
/// `x-forwarded-for`.
#[test]
fn istio_gateway_behind_one_load_balancer() {
    let http = manifest_number("deploy/istio/wasmplugin.yaml", "trusted_hops");
    let grpc = manifest_number("deploy/istio/wasmplugin-grpc.yaml", "trusted_hops");
    assert_eq!(
        http, grpc,
        "both Istio manifests document the same topology"
    );
    let s = stack("topology-istio", http, |spec| {
        spec.use_remote_address = true;
        spec.xff_num_trusted_hops = 0;
    });
    let lb = XffProxy::start(s.envoy.port);
    two_clients_two_buckets_and_no_forgery(&s, lb.port);
}

/// Plain Envoy (deploy/envoy/envoy.yaml) behind one load balancer that appends `x-forwarded-for`,
/// with the connection manager settings of that file.
#[test]
fn plain_envoy_behind_one_load_balancer() {
    let rel = "deploy/envoy/envoy.yaml";
    let hops = manifest_number(rel, "trusted_hops");
    let remote = manifest_value(rel, "use_remote_address") == "true";
    let xff = manifest_number(rel, "xff_num_trusted_hops");
    let s = stack("topology-envoy", hops, |spec| {
        spec.use_remote_address = remote;
        spec.xff_num_trusted_hops = xff;
    });
    let lb = XffProxy::start(s.envoy.port);
    two_clients_two_buckets_and_no_forgery(&s, lb.port);
}

/// What the issue reported, kept as a check that the test can fail: behind a load balancer and a
/// gateway that appends its peer, `trusted_hops: 1` keys every client alike.
#[test]
fn one_hop_behind_a_gateway_is_one_bucket_for_all() {
    let s = stack("topology-wrong", 1, |spec| {
        spec.use_remote_address = true;
        spec.xff_num_trusted_hops = 0;
    });
    let lb = XffProxy::start(s.envoy.port);
    assert_eq!(
        statuses(A, lb.port, CAPACITY, &[]),
        vec![200; CAPACITY as usize]
    );
    assert_eq!(
        statuses(B, lb.port, 1, &[]),
        vec![429],
        "B shares A's bucket"
    );
}
