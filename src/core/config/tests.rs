//! The reader's tests: every field read, every refusal naming its field.

use super::*;

const MINIMAL: &str = r#"{"service":{"cluster":"tollgate"},
    "rules":[{"name":"per-ip","key":["client_ip"],"capacity":100,"period_ms":60000}]}"#;

fn parse(s: &str) -> Result<Config, ConfigError> {
    Config::parse(s.as_bytes())
}

/// The limit of rule `i`, a rate rule.
fn rate(c: &Config, i: usize) -> &RateLimit {
    c.rules[i].rate_limit().unwrap()
}

fn error_of(s: &str) -> ConfigError {
    match parse(s) {
        Ok(_) => ConfigError {
            field: "<accepted>".into(),
            message: String::new(),
        },
        Err(e) => e,
    }
}

/// A full config with one substitution: `"rules":[R0, R1]` where R1 is given.
fn with_rule1(rule1: &str) -> String {
    format!(
        r#"{{"service":{{"cluster":"c"}},"rules":[
          {{"name":"a","capacity":1,"period_ms":1000}}, {rule1}]}}"#
    )
}

#[test]
fn minimal_config_gets_defaults() {
    let c = parse(MINIMAL).unwrap();
    assert_eq!(c.service.authority, "tollgate");
    assert_eq!(c.service.transport, Transport::Grpc);
    assert!(c.service.stream, "takes as messages on a stream");
    assert_eq!(c.service.timeout_ms, 20);
    assert_eq!(c.service.path, "/v1/take");
    assert_eq!(c.service.token, None);
    assert_eq!(c.trusted_hops, 0);
    assert_eq!(c.failure_mode, FailureMode::Fallback);
    assert_eq!(
        c.fallback,
        Fallback {
            instances: 1,
            min_instances: 1,
            max_keys: 10_000,
            // 100 tokens at 100 per minute fill in a minute (+1 ms of rounding up).
            debt_horizon_ms: 60_001,
        }
    );
    assert_eq!(
        c.breaker,
        Breaker {
            failures: 5,
            open_ms: 250,
            max_open_ms: 5000
        }
    );
    assert!(!c.shadow);
    assert_eq!(c.response.status, 429);
    assert_eq!(c.response.body, "rate limited\n");
    assert_eq!(c.response.content_type, "text/plain");
    assert_eq!(c.response.headers, vec![HeaderStyle::Draft]);
    assert!(!c.response.on_allowed);
    let r = &c.rules[0];
    let l = r.rate_limit().unwrap();
    assert_eq!(l.rate, 100);
    assert_eq!(l.cost, Cost::Fixed(1));
    assert_eq!(l.algorithm, Algorithm::TokenBucket);
    assert_eq!(r.on_missing, OnMissing::Skip);
    assert_eq!(l.lease, None);
    assert!(c.needs_peer_address);
}

#[test]
fn lease_defaults_and_bounds() {
    let c = parse(&with_rule1(
        r#"{"name":"b","capacity":50,"period_ms":1000,"lease":{"size":50}}"#,
    ))
    .unwrap();
    assert_eq!(
        rate(&c, 1).lease,
        Some(Lease {
            size: Some(50),
            max_age_ms: 1000
        })
    );
    let c = parse(&with_rule1(
        r#"{"name":"b","capacity":50,"period_ms":1000,"lease":{}}"#,
    ))
    .unwrap();
    assert_eq!(rate(&c, 1).lease.map(|l| l.size), Some(None), "adaptive");
    let c = parse(&with_rule1(
        r#"{"name":"b","capacity":50,"period_ms":1000,"lease":{"size":1,"max_age_ms":60000}}"#,
    ))
    .unwrap();
    assert_eq!(rate(&c, 1).lease.map(|l| l.max_age_ms), Some(60_000));
    assert_eq!(
        error_of(&with_rule1(
            r#"{"name":"b","capacity":50,"period_ms":1000,"lease":{"size":51}}"#
        ))
        .to_string(),
        "rules[1].lease.size: must be between 1 and 50"
    );
}

#[test]
fn full_config_from_the_docs_parses() {
    let full = r#"{
      "service": {"cluster": "tollgate", "authority": "tollgate.local", "transport": "grpc",
                  "timeout_ms": 50, "path": "/v1/take", "token": "secret"},
      "trusted_hops": 1,
      "rules": [{
        "name": "per-ip",
        "match": {"path_prefix": "/api/", "methods": ["get", "POST"],
                  "headers": [{"name": "X-Tenant", "present": true}, {"name": "x-plan", "equals": "free"}]},
        "key": ["literal:api", "header:x-api-key", "client_ip", "path", "method", "authority"],
        "on_missing": "shared",
        "capacity": 100, "rate": 10, "period_ms": 60000,
        "cost": {"header": "x-cost", "default": 2, "max": 50},
        "algorithm": "fixed_window"
      }],
      "failure_mode": "deny",
      "fallback": {"instances": 3, "max_keys": 100},
      "breaker": {"failures": 3, "open_ms": 100, "max_open_ms": 1000},
      "shadow": true,
      "response": {"status": 503, "body": "slow down", "content_type": "text/html",
                   "headers": ["draft", "x-ratelimit"], "on_allowed": true}
    }"#;
    let c = parse(full).unwrap();
    assert_eq!(c.service.transport, Transport::Grpc);
    assert_eq!(c.service.token.as_deref(), Some("secret"));
    let shown = format!("{c:?}");
    assert!(!shown.contains("secret") && shown.contains("<redacted>"));
    let r = &c.rules[0];
    let l = r.rate_limit().unwrap();
    assert_eq!(r.matcher.methods, vec!["GET", "POST"]);
    assert_eq!(
        r.matcher.headers,
        vec![
            HeaderMatch::Present("x-tenant".into(), true),
            HeaderMatch::Equals("x-plan".into(), "free".into())
        ]
    );
    assert_eq!(r.key.len(), 6);
    assert_eq!(
        l.cost,
        Cost::Header {
            name: "x-cost".into(),
            default: 2,
            min: 1,
            max: 50
        }
    );
    assert_eq!(l.algorithm, Algorithm::FixedWindow);
    assert_eq!(c.failure_mode, FailureMode::Deny);
    assert_eq!(
        c.response.headers,
        vec![HeaderStyle::Draft, HeaderStyle::XRateLimit]
    );
    assert!(
        !c.needs_peer_address,
        "trusted_hops > 0 reads x-forwarded-for instead"
    );
}

#[test]
fn an_empty_unknown_key_is_named() {
    let e = Config::parse(br#"{"service":{"cluster":"c"},"":[1]}"#).unwrap_err();
    assert_eq!(e.field, "\"\"");
}

#[test]
fn errors_name_their_field() {
    let cases: Vec<(String, &str)> = vec![
        (with_rule1(r#"{"name":"b","capacity":0,"period_ms":1}"#), "rules[1].capacity"),
        (with_rule1(r#"{"name":"b","capacity":1000000001,"period_ms":1}"#), "rules[1].capacity"),
        (with_rule1(r#"{"name":"b","capacity":5,"rate":0,"period_ms":1}"#), "rules[1].rate"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":0}"#), "rules[1].period_ms"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":31536000001}"#), "rules[1].period_ms"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":0}"#), "rules[1].cost"),
        (with_rule1(r#"{"name":"a","capacity":5,"period_ms":1}"#), "rules[1].name"),
        (with_rule1(r#"{"name":"","capacity":5,"period_ms":1}"#), "rules[1].name"),
        (with_rule1(r#"{"name":"b c","capacity":5,"period_ms":1}"#), "rules[1].name"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"key":["cookie"]}"#), "rules[1].key[0]"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"key":["path","header:"]}"#), "rules[1].key[1]"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"key":["path","path","path","path","path","path","path","path","path"]}"#), "rules[1].key"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":{"path_exact":"/a","path_prefix":"/b"}}"#), "rules[1].match.path_prefix"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":{"path_exact":"a"}}"#), "rules[1].match.path_exact"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":{"methods":[]}}"#), "rules[1].match.methods"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":{"headers":[{"name":"x"}]}}"#), "rules[1].match.headers[0]"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":{"headers":[{"name":"x y","present":true}]}}"#), "rules[1].match.headers[0].name"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"header":"x","max":10,"default":11}}"#), "rules[1].cost.default"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"on_missing":"ignore"}"#), "rules[1].on_missing"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"algorithm":"leaky"}"#), "rules[1].algorithm"),
        (with_rule1(r#"{"name":"b","capacity":-5,"period_ms":1}"#), "rules[1].capacity"),
        (with_rule1(r#"{"name":"b","capacity":1.5,"period_ms":1}"#), "rules[1].capacity"),
        (with_rule1(r#"{"name":"b","period_ms":1}"#), "rules[1].capacity"),
        (with_rule1(r#"{"name":"b","capacity":"5","period_ms":1}"#), "rules[1].capacity"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"key":"path"}"#), "rules[1].key"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"key":[1]}"#), "rules[1].key[0]"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":"x"}"#), "rules[1].cost"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"max":3}}"#), "rules[1].cost.header"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"header":"x","min":4,"max":3}}"#), "rules[1].cost.min"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"header":"x","min":2,"default":1}}"#), "rules[1].cost.default"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"reserve":"all","max":3}}"#), "rules[1].cost.reserve"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"reserve":"max"}}"#), "rules[1].cost.max"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"reserve":"max","max":3,"header":"x"}}"#), "rules[1].cost.header"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"reserve":"max","max":3,"min":1}}"#), "rules[1].cost.min"),
        (with_rule1(r#"{"capacity":5,"period_ms":1}"#), "rules[1].name"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":{"size":6}}"#), "rules[1].lease.size"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":{"size":0}}"#), "rules[1].lease.size"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":{"size":"8"}}"#), "rules[1].lease.size"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":{"size":2,"max_age_ms":0}}"#), "rules[1].lease.max_age_ms"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":{"size":2,"max_age_ms":60001}}"#), "rules[1].lease.max_age_ms"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":{"size":2,"ttl":5}}"#), "rules[1].lease.ttl"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"lease":50}"#), "rules[1].lease"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"reply"}"#), "rules[1].charge"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"usage":{"header":"x-u"}}"#), "rules[1].usage"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"body":false}}"#), "rules[1].usage.body"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"header":"a b"}}"#), "rules[1].usage.header"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"weights":{"prompt":1001}}}"#), "rules[1].usage.weights.prompt"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"weights":{"cached":1}}}"#), "rules[1].usage.weights.cached"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"max":0}}"#), "rules[1].usage.max"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"from":"body"}}"#), "rules[1].usage.from"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","usage":{"cut":"seen"}}"#), "rules[1].usage.cut"),
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"charge":"response","lease":{}}"#), "rules[1].lease"),
        (r#"{"service":{"cluster":"c","transport":"rls","domain":"d"},"rules":[{"name":"a","capacity":1,"period_ms":1,"charge":"response"}]}"#.into(), "rules[0].charge"),
        (r#"[1]"#.into(), "config"),
        (r#"{"service":{"cluster":"c"},"rules":[{"name":"a","capacity":1,"period_ms":1}],"shadow":"yes"}"#.into(), "shadow"),
        (r#"{"service":{"cluster":"c"},"rules":[{"name":"a","capacity":1,"period_ms":1}],"response":{"on_allowed":1}}"#.into(), "response.on_allowed"),
        (r#"{"service":{"cluster":"c"},"rules":[]}"#.into(), "rules"),
        (r#"{"rules":[]}"#.into(), "service"),
        (r#"{"service":{"cluster":"c"}"#.into(), "config"),
        (r#"{"service":{"cluster":""},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "service.cluster"),
        (r#"{"service":{"cluster":"c","transport":"udp"},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "service.transport"),
        (r#"{"service":{"cluster":"c","timeout_ms":0},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "service.timeout_ms"),
        (r#"{"service":{"cluster":"c","path":"v1"},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "service.path"),
        (r#"{"service":{"cluster":"c","token":"a\nb"},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "service.token"),
        (r#"{"service":{"cluster":"c"},"trusted_hops":17,"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "trusted_hops"),
        (r#"{"service":{"cluster":"c"},"failure_mode":"open","rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "failure_mode"),
        (r#"{"service":{"cluster":"c"},"fallback":{"instances":0},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "fallback.instances"),
        (r#"{"service":{"cluster":"c"},"fallback":{"min_instances":0},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "fallback.min_instances"),
        (r#"{"service":{"cluster":"c"},"fallback":{"max_keys":0},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "fallback.max_keys"),
        (r#"{"service":{"cluster":"c"},"breaker":{"open_ms":0},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "breaker.open_ms"),
        (r#"{"service":{"cluster":"c"},"breaker":{"open_ms":100,"max_open_ms":50},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "breaker.max_open_ms"),
        (r#"{"service":{"cluster":"c"},"response":{"status":200},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "response.status"),
        (r#"{"service":{"cluster":"c"},"response":{"headers":["ietf"]},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "response.headers[0]"),
        (r#"{"service":{"cluster":"c"},"response":{"content_type":"a\r\nb: c"},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(), "response.content_type"),
    ];
    for (json, field) in cases {
        let e = error_of(&json);
        assert_eq!(e.field, field, "config {json}: got error `{e}`");
        assert!(!e.message.is_empty());
        // One mistake, one refusal: nothing is refused again for depending on it (the one
        // configuration with two mistakes, no `service` and no rule, has two).
        let all = refusals_of(&json);
        let mistakes = 1 + usize::from(json == r#"{"rules":[]}"#);
        assert_eq!(all.len(), mistakes, "{json}: {all:#?}");
    }
}

#[test]
fn a_rule_charged_by_the_response_reads_its_usage_as_configured() {
    let cfg = Config::parse(
        br#"{"service":{"cluster":"c"},"rules":[
            {"name":"a","capacity":10000,"period_ms":60000,"cost":{"header":"x-max-tokens","default":500,"max":4000},
             "charge":"response","usage":{"header":"X-Tokens","weights":{"prompt":1,"completion":3},"max":8000,"cut":"reserved"}},
            {"name":"b","capacity":10,"period_ms":1000,"charge":"response"},
            {"name":"c","capacity":10,"period_ms":1000}]}"#,
    )
    .unwrap();
    let a = rate(&cfg, 0).charge.clone().unwrap();
    assert_eq!(a.header.as_deref(), Some("x-tokens"));
    assert!(a.body);
    assert_eq!(
        a.weights,
        Some(Weights {
            prompt: 1,
            completion: 3
        })
    );
    assert_eq!((a.max, a.cut), (8000, Cut::Reserved));
    let b = rate(&cfg, 1).charge.clone().unwrap();
    assert_eq!(
        (b.header, b.body, b.weights, b.max, b.cut),
        (None, true, None, MAX_AMOUNT, Cut::Bound)
    );
    assert_eq!(rate(&cfg, 2).charge, None);
}

#[test]
fn a_reservation_is_a_floored_hint_or_the_rules_max() {
    let cfg = Config::parse(
        br#"{"service":{"cluster":"c"},"rules":[
            {"name":"a","capacity":10000,"period_ms":60000,"charge":"response",
             "cost":{"header":"x-max-tokens","min":256,"max":4000}},
            {"name":"b","capacity":10000,"period_ms":60000,"charge":"response",
             "cost":{"reserve":"max","max":4000}}]}"#,
    )
    .unwrap();
    assert_eq!(
        rate(&cfg, 0).cost,
        Cost::Header {
            name: "x-max-tokens".into(),
            default: 256,
            min: 256,
            max: 4000
        }
    );
    assert_eq!(rate(&cfg, 1).cost, Cost::Fixed(4000));
    assert_eq!(
        (rate(&cfg, 0).cost.bound(), rate(&cfg, 1).cost.bound()),
        (4000, 4000)
    );
}

/// Every refusal of `s` (`Config::parse_all`), as logged: `field: message`.
fn refusals_of(s: &str) -> Vec<String> {
    match Config::parse_all(s.as_bytes()) {
        Ok(_) => Vec::new(),
        Err(all) => all.iter().map(ToString::to_string).collect(),
    }
}

/// The fields [`refusals_of`] names, in its order.
fn refused_fields(s: &str) -> Vec<String> {
    refusals_of(s)
        .iter()
        .map(|e| e.split(':').next().unwrap_or_default().to_string())
        .collect()
}

#[test]
fn every_refusal_is_reported_with_its_field_in_document_order() {
    // Three independent mistakes: no `service`, an unknown field in rule 1, and rule 2 shaped with
    // a longest hold of 0 ms.
    let json = r#"{"rules":[
        {"name":"a","capacity":1,"period_ms":1000},
        {"name":"b","capacity":5,"period_ms":1000,"colour":"red"},
        {"name":"c","capacity":5,"period_ms":1000,"shape":{"max_delay_ms":0}}]}"#;
    let all = refusals_of(json);
    assert_eq!(all.len(), 3, "{all:#?}");
    assert_eq!(all[0], "service: missing (required)");
    assert!(
        all[1].starts_with("rules[1].colour: unknown field (expected one of: name, match,"),
        "{all:#?}"
    );
    assert_eq!(
        all[2],
        format!("rules[2].shape.max_delay_ms: must be between 1 and {MAX_DELAY_MS}")
    );
    // `parse` answers the first of them.
    assert_eq!(error_of(json).to_string(), all[0]);

    // The top level in its table's order, whatever order the reader reads it in (it reads
    // `shadow` and `response` before the rules), the rules by index, a rule's unknown fields
    // first.
    let json = r#"{"near_limit":2,"response":{"status":200},"shadow":"yes",
        "breaker":{"open_ms":0},"fallback":{"instances":0},"failure_mode":"open",
        "rules":[{"name":"a","capacity":0,"period_ms":0,"burst":1},{"name":"b c","capacity":1,"period_ms":1}],
        "trusted_hops":17,"service":{"cluster":"","timeout_ms":0},"colour":1}"#;
    let fields = refused_fields(json);
    assert_eq!(
        fields,
        [
            "colour",
            "service.cluster",
            "service.timeout_ms",
            "trusted_hops",
            "rules[0].burst",
            "rules[0].capacity",
            "rules[0].period_ms",
            "rules[1].name",
            "failure_mode",
            "fallback.instances",
            "breaker.open_ms",
            "shadow",
            "response.status",
            "near_limit",
        ]
    );
}

#[test]
fn what_depends_on_a_refused_value_is_skipped_not_refused_again() {
    for (json, only) in [
        // A `match` that is not an object has no conditions to read.
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":"/api"}"#), "rules[1].match"),
        // The kind decides which fields belong to the rule.
        (with_rule1(r#"{"name":"b","kind":"gauge","max_in_flight":5}"#), "rules[1].kind"),
        // The transport decides what a rule may ask of it.
        (
            r#"{"service":{"cluster":"c","transport":"udp"},"rules":[{"name":"a","capacity":5,"period_ms":1,"lease":{}}]}"#.into(),
            "service.transport",
        ),
        // A shape is for one algorithm.
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"algorithm":"leaky","shape":{"max_delay_ms":10}}"#), "rules[1].algorithm"),
        // A lease's size is bounded by the capacity, checked against the largest amount then.
        (with_rule1(r#"{"name":"b","capacity":0,"period_ms":1,"lease":{"size":3}}"#), "rules[1].capacity"),
        // An override names a part of the key.
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"key":["cookie"],"overrides":[{"value":"x","capacity":9}]}"#), "rules[1].key[0]"),
        // A cost's `min` is bounded by its `max`.
        (with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"cost":{"header":"x","max":0,"min":3}}"#), "rules[1].cost.max"),
        // The breaker's longest interval is bounded by its first.
        (
            r#"{"service":{"cluster":"c"},"breaker":{"open_ms":0,"max_open_ms":1},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#.into(),
            "breaker.open_ms",
        ),
    ] {
        let all = refusals_of(&json);
        assert_eq!(all.len(), 1, "{json}: {all:#?}");
        assert!(all[0].starts_with(&format!("{only}: ")), "{json}: {all:#?}");
    }
}

#[test]
fn every_rule_and_every_field_a_transport_cannot_carry_is_refused() {
    // 17 rules are too many, and each is still read; a refused rule does not hide the next.
    let rule = |i: usize| format!(r#"{{"name":"r{i}","capacity":1,"period_ms":1}}"#);
    let mut rules: Vec<String> = (0..17).map(rule).collect();
    rules[3] = r#"{"name":"r3","capacity":0,"period_ms":1}"#.into();
    rules[9] = r#"{"name":"r9","capacity":1,"period_ms":0}"#.into();
    let json = format!(
        r#"{{"service":{{"cluster":"c"}},"rules":[{}]}}"#,
        rules.join(",")
    );
    let fields = refused_fields(&json);
    assert_eq!(fields, ["rules", "rules[3].capacity", "rules[9].period_ms"]);
    // Over rls, each field it cannot carry, of `service` and of every rule.
    let json = r#"{"service":{"cluster":"c","transport":"rls","domain":"d","stream":true,"batch":5},
        "rules":[{"name":"a","capacity":1,"period_ms":1,"lease":{}},{"name":"b","kind":"concurrency","max_in_flight":1}]}"#;
    let fields = refused_fields(json);
    assert_eq!(
        fields,
        [
            "service.stream",
            "service.batch",
            "rules[0].lease",
            "rules[1].kind"
        ]
    );
}

#[test]
fn unknown_fields_are_errors_that_name_them() {
    for (json, needle) in [
        (r#"{"service":{"cluster":"c"},"rulez":[]}"#, "rulez"),
        (
            r#"{"service":{"cluster":"c","timeout":5},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#,
            "timeout",
        ),
        (
            &with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"burst":3}"#)[..],
            "burst",
        ),
        (
            &with_rule1(r#"{"name":"b","capacity":5,"period_ms":1,"match":{"path":"/x"}}"#)[..],
            "path",
        ),
        (
            r#"{"service":{"cluster":"c"},"breaker":{"failure":3},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#,
            "failure",
        ),
    ] {
        let e = error_of(json);
        assert_ne!(e.field, "<accepted>", "{json} was accepted");
        assert!(e.to_string().contains(needle), "{json}: {e}");
    }
    let e = error_of(&with_rule1(
        r#"{"name":"b","capacity":5,"period_ms":1,"burst":3}"#,
    ));
    assert!(e.field.starts_with("rules[1]"), "{e}");
}

#[test]
fn bounds_are_inclusive() {
    let c = parse(&with_rule1(
        r#"{"name":"b","capacity":1000000000,"rate":1000000000,"period_ms":31536000000,"cost":1000000000}"#,
    ))
    .unwrap();
    assert_eq!(rate(&c, 1).capacity, MAX_AMOUNT);
    assert_eq!(rate(&c, 1).period_ms, MAX_PERIOD_MS);
}

#[test]
fn display_is_field_colon_message() {
    let e = error_of(&with_rule1(r#"{"name":"b","capacity":0,"period_ms":1}"#));
    assert_eq!(
        e.to_string(),
        "rules[1].capacity: must be between 1 and 1000000000"
    );
}

/// The filter_config fuzz seeds (fuzz/seeds/filter_config, written by fuzz/seeds.py) that the
/// reader accepts reach every field of the table, each in a rule of the kind it belongs to: the
/// fuzzer starts from every field there is.
#[test]
fn the_fuzz_seeds_reach_every_rule_field() {
    use super::rules::{Kinds, RULE_FIELDS};
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/seeds/filter_config");
    let mut seen: Vec<(String, Kinds)> = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        if Config::parse(&bytes).is_err() {
            continue;
        }
        let doc: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        for rule in doc["rules"].as_array().unwrap() {
            let kind = if rule["kind"] == "concurrency" {
                Kinds::Concurrency
            } else {
                Kinds::Rate
            };
            for field in rule.as_object().unwrap().keys() {
                seen.push((field.clone(), kind));
            }
        }
    }
    let unreached: Vec<&str> = RULE_FIELDS
        .iter()
        .filter(|(name, kinds)| {
            !seen
                .iter()
                .any(|(f, k)| f == name && (*kinds == Kinds::Every || k == kinds))
        })
        .map(|(name, _)| *name)
        .collect();
    assert!(
        unreached.is_empty(),
        "no accepted seed in {dir} holds {unreached:?} (add one to fuzz/seeds.py)"
    );
}

#[test]
fn takes_stream_over_grpc_unless_told_otherwise_and_only_over_grpc() {
    let service = |fields: &str| {
        format!(
            r#"{{"service":{{"cluster":"c"{fields}}},
                 "rules":[{{"name":"a","capacity":1,"period_ms":1000}}]}}"#
        )
    };
    let stream = |fields: &str| parse(&service(fields)).map(|c| c.service.stream);
    assert_eq!(stream(""), Ok(true), "gRPC, the default transport");
    assert_eq!(stream(r#","transport":"grpc""#), Ok(true));
    assert_eq!(stream(r#","transport":"grpc","stream":false"#), Ok(false));
    assert_eq!(stream(r#","transport":"http""#), Ok(false));
    let rls = r#","transport":"rls","domain":"d""#;
    assert_eq!(stream(rls), Ok(false));
    for refused in [
        r#","transport":"http","stream":true"#.to_string(),
        format!(r#"{rls},"stream":true"#),
        r#","stream":"yes""#.to_string(),
    ] {
        assert_eq!(
            error_of(&service(&refused)).field,
            "service.stream",
            "{refused}"
        );
    }
}

#[test]
fn the_tick_is_an_eighth_of_the_timeout_within_its_bounds() {
    for (timeout, tick) in [(20, 5), (50, 6), (200, 25), (1_000, 50), (1, 5)] {
        let c = parse(&format!(
            r#"{{"service":{{"cluster":"c","timeout_ms":{timeout}}},"rules":[{{"name":"r","capacity":1,"period_ms":1}}]}}"#
        ))
        .unwrap();
        assert_eq!(c.service.tick_ms(), tick, "timeout {timeout}");
    }
}

#[test]
fn a_shaping_rule_is_a_token_bucket_asked_over_our_service_with_its_bounds() {
    let c = parse(&with_rule1(
        r#"{"name":"b","capacity":5,"period_ms":1000,"shape":{"max_delay_ms":3000}}"#,
    ))
    .unwrap();
    assert_eq!(
        rate(&c, 1).shape,
        Some(Shape {
            max_delay_ms: 3000,
            max_held: DEFAULT_MAX_HELD
        })
    );
    assert!(c.shapes());
    let rule = |shape: &str, more: &str| {
        with_rule1(&format!(
            r#"{{"name":"b","capacity":5,"period_ms":1000,"shape":{shape}{more}}}"#
        ))
    };
    let cases = [
        (rule(r#"{"max_held":4}"#, ""), "rules[1].shape.max_delay_ms"),
        (
            rule(r#"{"max_delay_ms":0}"#, ""),
            "rules[1].shape.max_delay_ms",
        ),
        (
            rule(r#"{"max_delay_ms":60001}"#, ""),
            "rules[1].shape.max_delay_ms",
        ),
        (
            rule(r#"{"max_delay_ms":1,"max_held":0}"#, ""),
            "rules[1].shape.max_held",
        ),
        (
            rule(r#"{"max_delay_ms":1,"max_held":65537}"#, ""),
            "rules[1].shape.max_held",
        ),
        (
            rule(r#"{"max_delay_ms":1,"hold":1}"#, ""),
            "rules[1].shape.hold",
        ),
        (
            rule(r#"{"max_delay_ms":1}"#, r#","algorithm":"fixed_window""#),
            "rules[1].shape",
        ),
        (
            rule(r#"{"max_delay_ms":1}"#, r#","algorithm":"sliding_window""#),
            "rules[1].shape",
        ),
        (
            rule(r#"{"max_delay_ms":1}"#, r#","lease":{}"#),
            "rules[1].shape",
        ),
    ];
    for (json, field) in cases {
        assert_eq!(error_of(&json).field, field, "{json}");
    }
    let rls = r#"{"service":{"cluster":"c","transport":"rls","domain":"d"},
        "rules":[{"name":"b","capacity":5,"period_ms":1000,"shape":{"max_delay_ms":10}}]}"#;
    let e = error_of(rls);
    assert_eq!(e.field, "rules[0].shape");
    assert!(
        e.message.contains("not available with transport rls"),
        "{e}"
    );
    let concurrency = r#"{"service":{"cluster":"c"},"rules":[{"name":"b","kind":"concurrency",
        "max_in_flight":2,"shape":{"max_delay_ms":10}}]}"#;
    assert_eq!(error_of(concurrency).field, "rules[0].shape");
}

#[test]
fn a_calendar_window_names_its_unit_and_zone_and_no_period() {
    let c = parse(&with_rule1(
        r#"{"name":"b","key":["header:x-team"],"capacity":500,"algorithm":"calendar_window","calendar":"month","time_zone":"Europe/Berlin"}"#,
    ))
    .unwrap();
    let l = rate(&c, 1);
    let cal = l.calendar.as_ref().unwrap();
    assert_eq!(
        (cal.unit, cal.zone.as_str()),
        (contract::calendar::Unit::Month, "Europe/Berlin")
    );
    assert_eq!(
        l.period_ms,
        31 * 86_400_000,
        "the longest month, sent and named in the policy"
    );
    let utc = parse(&with_rule1(
        r#"{"name":"b","capacity":5,"algorithm":"calendar_window","calendar":"week"}"#,
    ))
    .unwrap();
    assert_eq!(rate(&utc, 1).calendar.as_ref().unwrap().zone, "UTC");
    for (rule, field, says) in [
        (
            r#"{"name":"b","capacity":5,"algorithm":"calendar_window"}"#,
            "rules[1].calendar",
            "missing",
        ),
        (
            r#"{"name":"b","capacity":5,"algorithm":"calendar_window","calendar":"fortnight"}"#,
            "rules[1].calendar",
            "must be one of",
        ),
        (
            r#"{"name":"b","capacity":5,"algorithm":"calendar_window","calendar":"day","period_ms":1000}"#,
            "rules[1].period_ms",
            "calendar",
        ),
        (
            r#"{"name":"b","capacity":5,"algorithm":"calendar_window","calendar":"day","time_zone":"+15:00"}"#,
            "rules[1].time_zone",
            "14:00",
        ),
        (
            r#"{"name":"b","capacity":5,"algorithm":"calendar_window","calendar":"day","time_zone":"Mars/Olympus Mons"}"#,
            "rules[1].time_zone",
            "a zone is",
        ),
        (
            r#"{"name":"b","capacity":5,"period_ms":1000,"calendar":"day"}"#,
            "rules[1].calendar",
            "only with algorithm \"calendar_window\"",
        ),
        (
            r#"{"name":"b","capacity":5,"period_ms":1000,"algorithm":"fixed_window","time_zone":"UTC"}"#,
            "rules[1].time_zone",
            "only with",
        ),
        (
            r#"{"name":"b","capacity":5,"key":["header:x"],"algorithm":"calendar_window","calendar":"day","overrides":[{"value":"v","capacity":9,"period_ms":5}]}"#,
            "rules[1].overrides[0].period_ms",
            "the rule's `calendar`",
        ),
        (
            r#"{"name":"b","capacity":5,"algorithm":"calendar_window","calendar":"day","shape":{"max_delay_ms":10}}"#,
            "rules[1].shape",
            "only for algorithm",
        ),
    ] {
        let e = error_of(&with_rule1(rule));
        assert_eq!(e.field, field, "{rule}: {e}");
        assert!(e.message.contains(says), "{rule}: {e}");
    }
    let rls = r#"{"service":{"cluster":"c","transport":"rls","domain":"d"},"rules":[{"name":"a","capacity":5,"algorithm":"calendar_window","calendar":"day"}]}"#;
    let e = error_of(rls);
    assert_eq!(e.field, "rules[0].calendar", "{e}");
}

#[test]
fn the_model_is_read_from_a_header_or_the_body_and_keys_and_prices_by_it() {
    let with = |model: &str, rule: &str| {
        format!(r#"{{"service":{{"cluster":"c"}},{model}"rules":[{rule}]}}"#)
    };
    let keyed = r#"{"name":"m","key":["header:x-team","model"],"capacity":5,"period_ms":1000}"#;
    let c = parse(&with(r#""model":{"body":true},"#, keyed)).unwrap();
    assert_eq!(c.model, Some(ModelSource::Body(65_536)));
    assert_eq!(c.rules[0].key[1], KeyPart::Model);
    let c = parse(&with(
        r#""model":{"body":true,"max_body_bytes":4096},"#,
        keyed,
    ))
    .unwrap();
    assert_eq!(c.model, Some(ModelSource::Body(4096)));
    let c = parse(&with(r#""model":{"header":"x-ai-model"},"#, keyed)).unwrap();
    assert_eq!(c.model, Some(ModelSource::Header("x-ai-model".into())));
    let c = parse(&with(
        r#""model":{"metadata":["envoy.filters.http.json_to_metadata","model"]},"#,
        keyed,
    ))
    .unwrap();
    assert_eq!(
        c.model,
        Some(ModelSource::Metadata(vec![
            "metadata".into(),
            "filter_metadata".into(),
            "envoy.filters.http.json_to_metadata".into(),
            "model".into()
        ]))
    );
    let priced = r#"{"name":"p","key":["header:x-team"],"capacity":100000,"period_ms":60000,
        "cost":{"reserve":"max","max":4000},"charge":"response",
        "usage":{"weights":{"prompt":2,"completion":8},
                 "prices":{"gpt-4o":{"prompt":5,"completion":15},"gpt-4o-mini":{"completion":4}}}}"#;
    let c = parse(&with(r#""model":{"body":true},"#, priced)).unwrap();
    let charge = rate(&c, 0).charge.clone().unwrap();
    let w = |m: Option<&str>| charge.weights_for(m).map(|w| (w.prompt, w.completion));
    assert_eq!(w(Some("gpt-4o")), Some((5, 15)));
    assert_eq!(
        w(Some("gpt-4o-mini")),
        Some((1, 4)),
        "a price left out is 1"
    );
    assert_eq!(
        w(Some("other")),
        Some((2, 8)),
        "a model not named: `weights`"
    );
    assert_eq!(w(None), Some((2, 8)));
    for (json, field, says) in [
        (with("", keyed), "rules[0].key[1]", "the top-level `model`"),
        (
            with("", priced),
            "rules[0].usage.prices",
            "the top-level `model`",
        ),
        (with(r#""model":{},"#, keyed), "model.header", "exactly one"),
        (
            with(r#""model":{"header":"x-m","metadata":["ns","m"]},"#, keyed),
            "model.header",
            "exactly one",
        ),
        (
            with(r#""model":{"metadata":["ns"]},"#, keyed),
            "model.metadata",
            "namespace then",
        ),
        (
            with(
                r#""model":{"metadata":["ns","m"],"max_body_bytes":10},"#,
                keyed,
            ),
            "model.max_body_bytes",
            "only with",
        ),
        (
            with(r#""model":{"header":"x-m","body":true},"#, keyed),
            "model.header",
            "exactly one",
        ),
        (
            with(r#""model":{"header":"x-m","max_body_bytes":10},"#, keyed),
            "model.max_body_bytes",
            "only with",
        ),
        (
            with(r#""model":{"body":true,"max_body_bytes":0},"#, keyed),
            "model.max_body_bytes",
            "between",
        ),
        (
            with(r#""model":{"body":true,"max_body_bytes":1048577},"#, keyed),
            "model.max_body_bytes",
            "between",
        ),
        (
            with(r#""model":{"header":"X-Bad Name"},"#, keyed),
            "model.header",
            "",
        ),
        (
            with(
                r#""model":{"body":true},"#,
                &priced.replace(
                    r#""gpt-4o":{"prompt":5,"completion":15}"#,
                    r#""gpt-4o":{"prompt":-1}"#,
                ),
            ),
            "rules[0].usage.prices.gpt-4o.prompt",
            "between",
        ),
        (
            with(
                r#""model":{"body":true},"#,
                &priced.replace(r#""prices":{"#, r#""prices":{"":{},"#),
            ),
            "rules[0].usage.prices.",
            "1..=128",
        ),
    ] {
        let e = error_of(&json);
        assert_eq!(e.field, field, "{json}: {e}");
        assert!(e.message.contains(says), "{json}: {e}");
    }
}
