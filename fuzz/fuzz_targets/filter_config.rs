//! The plugin configuration parser (`Config::parse`) over any bytes: it never panics, an error
//! names a field, and whatever it accepts is within the documented bounds. Every accepted
//! configuration then builds keys for a hostile request within the contract's bound.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate::core::config::{
    Config, Cost, HeaderMatch, KeyPart, PathMatch, RateLimit, RuleKind, Transport, DEADLINE_MS,
    MAX_AMOUNT, MAX_BUCKETS, MAX_IN_FLIGHT, MAX_KEY_PARTS, MAX_PERIOD_MS, MAX_RULE_BYTES,
};
use tollgate::core::rules::keys::{build_key, MAX_KEY_BYTES};
use tollgate::core::rules::Request;
use tollgate_fuzz::{header_name_safe, header_value_safe};

fn check_rate(l: &RateLimit) {
    assert!((1..=MAX_AMOUNT).contains(&l.capacity));
    assert!((1..=MAX_AMOUNT).contains(&l.rate));
    assert!((1..=MAX_PERIOD_MS).contains(&l.period_ms));
    match &l.cost {
        Cost::Fixed(c) => assert!((1..=MAX_AMOUNT).contains(c)),
        Cost::Header {
            name,
            default,
            min,
            max,
        } => {
            assert!(header_name_safe(name));
            assert!(1 <= *min && min <= default && default <= max && *max <= MAX_AMOUNT);
        }
    }
    if let Some(lease) = &l.lease {
        assert!(lease.size.is_none_or(|s| 1 <= s && s <= l.capacity));
        assert!(lease.max_age_ms >= 1);
    }
}

fn check(cfg: &Config) {
    let s = &cfg.service;
    assert!(!s.cluster.is_empty() && header_value_safe(&s.cluster));
    assert!(!s.authority.is_empty() && header_value_safe(&s.authority));
    assert!(s.path.starts_with('/') && header_value_safe(&s.path) && !s.path.contains(' '));
    assert!((1..=60_000).contains(&s.timeout_ms));
    if let Some(t) = &s.token {
        assert!(!t.is_empty() && t.len() <= 4096 && header_value_safe(t));
    }
    assert!(cfg.trusted_hops <= 16);
    assert!((1..=MAX_BUCKETS).contains(&cfg.rules.len()));
    for (i, r) in cfg.rules.iter().enumerate() {
        assert!(!r.name.is_empty() && r.name.len() <= MAX_RULE_BYTES);
        assert!(
            !r.name.contains('|'),
            "a rule name would break the key layout"
        );
        assert!(
            cfg.rules[..i].iter().all(|o| o.name != r.name),
            "duplicate name"
        );
        assert!(r.key.len() <= MAX_KEY_PARTS);
        match &r.kind {
            RuleKind::Rate(l) => check_rate(l),
            RuleKind::Concurrency(c) => {
                assert!((1..=MAX_IN_FLIGHT).contains(&c.max_in_flight));
                assert!((DEADLINE_MS.0..=DEADLINE_MS.1).contains(&c.deadline_ms));
                assert_ne!(cfg.service.transport, Transport::Rls);
            }
        }
        for p in &r.key {
            if let KeyPart::Header(h) = p {
                assert!(header_name_safe(h));
            }
        }
        match &r.matcher.path {
            Some(PathMatch::Exact(p)) | Some(PathMatch::Prefix(p)) => assert!(p.starts_with('/')),
            None => {}
        }
        for h in &r.matcher.headers {
            match h {
                HeaderMatch::Present(n, _) | HeaderMatch::Equals(n, _) => {
                    assert!(header_name_safe(n))
                }
            }
        }
    }
    assert!(cfg.fallback.instances >= 1 && cfg.fallback.max_keys >= 1);
    assert!(cfg.breaker.open_ms >= 1 && cfg.breaker.open_ms <= cfg.breaker.max_open_ms);
    assert!((400..=599).contains(&cfg.response.status));
    assert!(cfg.response.body.len() <= 65_536);
    assert!(!cfg.response.content_type.is_empty());
    assert!(header_value_safe(&cfg.response.content_type));
}

/// A request with every header a rule could read, each far longer than a key part may be.
fn hostile_request(cfg: &Config) -> Request {
    let long: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
    let mut headers: Vec<(String, Vec<u8>)> = [":path", ":method", ":authority"]
        .iter()
        .map(|n| (n.to_string(), long.clone()))
        .collect();
    for r in &cfg.rules {
        for p in &r.key {
            if let KeyPart::Header(h) = p {
                headers.push((h.clone(), long.clone()));
            }
        }
    }
    headers.push((
        "x-forwarded-for".into(),
        b"203.0.113.7, 198.51.100.1".to_vec(),
    ));
    Request {
        headers,
        peer: Some("[2001:db8::1]:4711".into()),
    }
}

fuzz_target!(|data: &[u8]| {
    match Config::parse(data) {
        // An error names its field (an empty key is named `""`).
        Err(e) => assert!(!e.field.is_empty(), "an error names its field: {e:?}"),
        Ok(cfg) => {
            check(&cfg);
            assert_eq!(
                Config::parse(data).ok().as_ref(),
                Some(&cfg),
                "deterministic"
            );
            let req = hostile_request(&cfg);
            for r in &cfg.rules {
                if let Some(k) = build_key(r, &req, cfg.trusted_hops) {
                    assert!(k.len() <= MAX_KEY_BYTES, "{} bytes", k.len());
                }
            }
        }
    }
});
