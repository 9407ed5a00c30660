//! Rules the way production runs them, end to end through real Envoy, the service and Redis: limits
//! that depend on who asks (per-key overrides by exact value, prefix or client network;
//! allow-lists; tiers named by a trusted header), conditions on client networks and negations, and
//! per-rule shadow mode, denial and headers with per-rule counters. Both transports.
// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::both_transports;
use crate::common;

use common::config::{plugin, SLOW_PERIOD_MS};
use common::loopback::get_from;
use common::*;
use serde_json::json;
use std::net::Ipv4Addr;

both_transports!(
    overrides_and_tiers_choose_the_limit,
    client_networks_choose_the_limit,
    rules_match_client_networks_and_negations,
    per_rule_shadow_denial_and_counters,
);

/// Admitted of `n` requests with these headers.
fn admitted(s: &Stack, headers: &[(&str, &str)], n: usize) -> usize {
    count(&s.client.statuses(&s.url("/"), headers, n), 200)
}

fn overrides_and_tiers_choose_the_limit(t: Transport) {
    let rule = json!({
        "name": "per-key", "key": ["header:x-api-key"], "capacity": 2, "rate": 1,
        "period_ms": SLOW_PERIOD_MS,
        "overrides": [
            {"value": "partner", "capacity": 5, "rate": 1},
            {"prefix": "internal-", "unlimited": true}
        ],
        "tiers": {"header": "x-tier", "limits": {"gold": {"capacity": 4, "rate": 1}}}
    });
    let s = Stack::start(
        "overrides",
        &plugin(
            t,
            vec![rule],
            json!({"response": {"headers": ["x-ratelimit"]}}),
        ),
    );
    assert_eq!(
        admitted(&s, &[("x-api-key", "someone")], 6),
        2,
        "the rule's own"
    );
    assert_eq!(
        admitted(&s, &[("x-api-key", "partner")], 8),
        5,
        "an exact value"
    );
    let r = s.get("/", &[("x-api-key", "partner")]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-limit"), Some("5"), "{r:?}");
    assert_eq!(
        admitted(&s, &[("x-api-key", "internal-batch")], 20),
        20,
        "allow-listed by prefix"
    );
    assert_eq!(
        admitted(&s, &[("x-api-key", "g"), ("x-tier", "gold")], 6),
        4,
        "a configured tier"
    );
    assert_eq!(
        admitted(&s, &[("x-api-key", "h"), ("x-tier", "1000000")], 6),
        2,
        "a tier name that is not configured (or a number) gets the rule's own"
    );
    let stats = s.envoy.tg_all();
    // The allow-listed requests made no callout and took no bucket.
    assert_eq!(
        stats.get("allowed").copied().unwrap_or(0) + stats.get("limited").copied().unwrap_or(0),
        6 + 8 + 1 + 6 + 6,
        "{stats:?}"
    );
}

/// Clients told apart by their source address on loopback (127.0.0.2, 127.0.0.3, 127.0.0.4):
/// one network allow-listed, one with a higher limit, the rest the rule's own.
fn client_networks_choose_the_limit(t: Transport) {
    let rule = json!({
        "name": "per-ip", "key": ["client_ip"], "capacity": 2, "rate": 1,
        "period_ms": SLOW_PERIOD_MS,
        "overrides": [
            {"cidr": "127.0.0.2/32", "unlimited": true},
            {"cidr": "127.0.0.3/32", "capacity": 4, "rate": 1}
        ]
    });
    let s = Stack::start("cidr", &plugin(t, vec![rule], json!({})));
    let from = |last: u8, n: usize| {
        (0..n)
            .filter(|_| {
                get_from(Ipv4Addr::new(127, 0, 0, last), s.envoy.port, "/", &[]) == Some(200)
            })
            .count()
    };
    assert_eq!(from(2, 10), 10, "allow-listed network");
    assert_eq!(from(3, 6), 4, "its own limit");
    assert_eq!(from(4, 6), 2, "the rule's own");
}

/// A rule that applies to one network (127.0.0.0/24 here) except where a header says the request is
/// internal: clients elsewhere, and internal requests, are not limited by it.
fn rules_match_client_networks_and_negations(t: Transport) {
    let rule = json!({
        "name": "lan", "key": ["client_ip"], "capacity": 2, "rate": 1, "period_ms": SLOW_PERIOD_MS,
        "match": {"client_ip": ["127.0.0.0/24"],
                  "not": {"headers": [{"name": "x-internal", "equals": "yes"}]}}
    });
    let s = Stack::start("match-ip", &plugin(t, vec![rule], json!({})));
    let from = |ip: Ipv4Addr, headers: &[(&str, &str)], n: usize| {
        (0..n)
            .filter(|_| get_from(ip, s.envoy.port, "/", headers) == Some(200))
            .count()
    };
    assert_eq!(
        from(Ipv4Addr::new(127, 0, 0, 5), &[], 5),
        2,
        "in the network"
    );
    assert_eq!(
        from(Ipv4Addr::new(127, 0, 1, 5), &[], 5),
        5,
        "outside it: the rule does not apply"
    );
    assert_eq!(
        from(Ipv4Addr::new(127, 0, 0, 6), &[("x-internal", "yes")], 5),
        5,
        "negated"
    );
}

/// Two rules on every request: `strict` (2 per hour, its own 403 and body, x-ratelimit headers) and
/// `trial` (1 per hour, shadow mode). The trial rule never denies; both are counted on their own.
fn per_rule_shadow_denial_and_counters(t: Transport) {
    let rules = vec![
        json!({"name": "strict", "key": ["literal:a"], "capacity": 2, "rate": 1,
               "period_ms": SLOW_PERIOD_MS,
               "response": {"status": 403, "body": "strict says no\n", "headers": ["x-ratelimit"]}}),
        json!({"name": "trial", "key": ["literal:b"], "capacity": 1, "rate": 1,
               "period_ms": SLOW_PERIOD_MS, "shadow": true}),
    ];
    let s = Stack::start("per-rule", &plugin(t, rules, json!({"near_limit": 0.5})));
    let replies: Vec<Reply> = (0..3).map(|_| s.get("/", &[])).collect();
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    // 1st: both allow. 2nd: trial would deny (shadow): the service charged nothing (all or
    // nothing), so the filter asks again for strict alone, which allows. 3rd: strict denies.
    assert_eq!(statuses, vec![200, 200, 403], "{replies:?}");
    assert_eq!(replies[2].body, "strict says no\n");
    assert_eq!(
        replies[2].header("x-ratelimit-limit"),
        Some("2"),
        "{:?}",
        replies[2]
    );
    // strict asked for x-ratelimit only; trial has the global default (draft).
    let policy = replies[2].header("ratelimit-policy").unwrap_or_default();
    assert!(
        !policy.contains("strict") && policy.contains("trial"),
        "{policy}"
    );
    let st = s.envoy.tg_all();
    let get = |k: &str| st.get(k).copied().unwrap_or(0);
    assert_eq!(get("rule.strict.allowed"), 2, "{st:?}");
    assert_eq!(get("rule.strict.limited"), 1, "{st:?}");
    // strict at 1 of 2 left and at 0 of 2: both at or under half.
    assert_eq!(get("rule.strict.near_limit"), 2, "{st:?}");
    assert_eq!(get("rule.trial.allowed"), 1, "{st:?}");
    // The 2nd request (and the 3rd, which strict denied anyway).
    assert_eq!(get("rule.trial.shadow_limited"), 2, "{st:?}");
    assert_eq!(get("rule.trial.limited"), 0, "{st:?}");
    // The 2nd request was decided by strict alone, asked again: the service allowed it.
    assert_eq!(get("allowed"), 2, "{st:?}");
    assert_eq!(s.upstream.requests(), 2);
}
