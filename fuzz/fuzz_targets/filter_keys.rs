//! Key building (`core::rules::keys`, through `decide`) for any request under any configuration.
//!
//! Input: byte 0 picks the configuration (below 0x80: one of the fixed ones; otherwise the bytes
//! up to the first NUL are the configuration's JSON), byte 1 overrides `trusted_hops` (below 17),
//! and the rest is the request's header map in the host's format (`core::hostmap`), as the
//! adapter reads it; a header `x-fuzz-peer` stands for the peer address property.
//!
//! Properties: a key is at most the contract's 4096 bytes of UTF-8; it is the rule's name and one
//! `|`-separated part per key part; each part decodes back to the request's bytes (or is the
//! marked SHA-256 of bytes too long to keep, or the marker of a missing part), so distinct
//! requests never share a key; a client address is canonical; a cost is within the rule's bounds;
//! the callout body encodes the keys losslessly.
#![no_main]

use std::net::IpAddr;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tollgate::core::config::MAX_PART_BYTES;
use tollgate::core::config::{Config, Cost, KeyPart, OnMissing, Rule};
use tollgate::core::decide::decide;
use tollgate::core::base::hash::sha256_hex;
use tollgate::core::base::hostmap;
use tollgate::core::wire::plan::Step;
use tollgate::core::rules::keys::{build_key, client_ip, cost, MAX_KEY_BYTES};
use tollgate::core::rules::Request;
use tollgate::core::wire::encode_json;
use tollgate_fuzz::{configs, percent_decode};

fn fixed() -> &'static [Config] {
    static C: OnceLock<Vec<Config>> = OnceLock::new();
    C.get_or_init(configs)
}

/// What the request holds for one key part (`None`: absent).
fn raw_part(p: &KeyPart, req: &Request, hops: u32) -> Option<Vec<u8>> {
    match p {
        KeyPart::Literal(s) => Some(s.as_bytes().to_vec()),
        KeyPart::Header(h) => req.header(h).map(<[u8]>::to_vec),
        KeyPart::ClientIp => client_ip(req, hops).map(String::into_bytes),
        KeyPart::Path => Some(req.path().to_vec()),
        KeyPart::Method => Some(req.method().to_vec()),
        KeyPart::Authority => req.authority().map(<[u8]>::to_vec),
    }
}

fn escaped_len(raw: &[u8]) -> usize {
    raw.iter()
        .map(|&b| {
            if b.is_ascii_alphanumeric() || b"-._~/:@!$&'()*+,;=".contains(&b) {
                1
            } else {
                3
            }
        })
        .sum()
}

fn check_rule(rule: &Rule, req: &Request, hops: u32) {
    let raws: Vec<Option<Vec<u8>>> = rule.key.iter().map(|p| raw_part(p, req, hops)).collect();
    let Some(key) = build_key(rule, req, hops) else {
        assert!(
            rule.on_missing == OnMissing::Skip && raws.iter().any(Option::is_none),
            "no key although every part is present"
        );
        return;
    };
    assert!(key.len() <= MAX_KEY_BYTES, "{} bytes", key.len());
    let mut parts = key.split('|');
    assert_eq!(parts.next(), Some(rule.name.as_str()));
    let parts: Vec<&str> = parts.collect();
    assert_eq!(parts.len(), rule.key.len(), "{key:?}");
    for (part, raw) in parts.iter().zip(&raws) {
        match raw {
            None => assert_eq!(*part, "%-", "a missing part has its own marker"),
            Some(raw) if escaped_len(raw) > MAX_PART_BYTES => {
                assert_eq!(part.strip_prefix('#'), Some(sha256_hex(raw).as_str()));
            }
            Some(raw) => {
                assert!(!part.starts_with('#') && *part != "%-", "{part:?}");
                assert_eq!(percent_decode(part).as_ref(), Some(raw), "{part:?}");
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let [pick, hops, rest @ ..] = data else {
        return;
    };
    let (mut cfg, map) = if *pick < 0x80 {
        let all = fixed();
        (all[usize::from(*pick) % all.len()].clone(), rest)
    } else {
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        let Ok(cfg) = Config::parse(&rest[..end]) else {
            return;
        };
        (cfg, rest.get(end + 1..).unwrap_or(&[]))
    };
    if *hops <= 16 {
        cfg.trusted_hops = u32::from(*hops);
    }
    let Some(mut headers) = hostmap::parse(map) else {
        return;
    };
    let peer = headers
        .iter()
        .position(|(n, _)| n == "x-fuzz-peer")
        .map(|i| String::from_utf8_lossy(&headers.remove(i).1).into_owned());
    let req = Request { headers, peer };

    if let Some(ip) = client_ip(&req, cfg.trusted_hops) {
        let parsed: IpAddr = ip.parse().expect("a client address parses");
        assert_eq!(parsed.to_string(), ip, "canonical form");
    }
    for rule in &cfg.rules {
        check_rule(rule, &req, cfg.trusted_hops);
        let Some(l) = rule.rate_limit() else {
            continue;
        };
        let c = cost(l, &req);
        match &l.cost {
            Cost::Fixed(f) => assert_eq!(c, *f),
            Cost::Header { default, max, .. } => assert!(c >= 1 && (c == *default || c <= *max)),
        }
    }
    if let Step::Callout(plan) = decide(&cfg, &req).step {
        assert_eq!(plan.request.buckets.len(), plan.rules.len());
        let body: serde_json::Value =
            serde_json::from_slice(&encode_json(&plan.request, None)).expect("the callout is JSON");
        for (i, b) in plan.request.buckets.iter().enumerate() {
            assert_eq!(body["buckets"][i]["key"].as_str(), Some(b.key.as_str()));
            assert!(!b.key.is_empty() && b.key.len() <= MAX_KEY_BYTES);
        }
    }
});
