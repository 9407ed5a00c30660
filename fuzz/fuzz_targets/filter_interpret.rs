//! The interpretation of a callout's result (`decide::interpret`) for any status and body, and the
//! rate limit headers built from whatever numbers an answer carries (`headers`).
//!
//! Input: byte 0 picks the kind of result (dispatch error, HTTP reset, HTTP with a status, gRPC),
//! byte 1 the configuration (one bucket per rate rule), bytes 2..4 the status (u16 LE);
//! the rest is the body (gRPC: the status message up to the first NUL, then the body).
//!
//! Properties: no panic; "allowed" and "limited" only for an answer that covers exactly the
//! planned buckets and agrees with itself; every header is a lower-case token name with a value
//! that cannot split the response (no CR, LF or other control character).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tollgate::core::config::{Config, HeaderStyle, KeyPart, Match};
use tollgate::core::decide::{decide, interpret};
use tollgate::core::decide::headers::{rate_limit_headers, retry_after};
use tollgate::core::wire::plan::{CalloutResult, Outcome, Plan, Step};
use tollgate::core::rules::Request;
use tollgate_fuzz::{configs, header_name_safe, header_value_safe};

/// The fixed configurations with every rule's conditions dropped, each with the plan `decide`
/// makes for a request that has every key part: one bucket per rate rule.
fn fixed() -> &'static [(Config, Plan)] {
    static C: OnceLock<Vec<(Config, Plan)>> = OnceLock::new();
    C.get_or_init(|| {
        configs()
            .into_iter()
            .map(|mut cfg| {
                let mut headers: Vec<(String, Vec<u8>)> = [":path", ":method", ":authority"]
                    .iter()
                    .map(|h| (h.to_string(), b"x".to_vec()))
                    .collect();
                let xff: Vec<String> = (0..20).map(|i| format!("192.0.2.{i}")).collect();
                headers.push(("x-forwarded-for".into(), xff.join(", ").into_bytes()));
                for rule in &mut cfg.rules {
                    rule.matcher = Match::default();
                    for p in &rule.key {
                        if let KeyPart::Header(h) = p {
                            headers.push((h.clone(), b"v".to_vec()));
                        }
                    }
                }
                let req = Request {
                    headers,
                    peer: Some("192.0.2.9:1".into()),
                };
                let Step::Callout(plan) = decide(&cfg, &req).step else {
                    panic!("no plan")
                };
                let rate_rules = cfg.rules.iter().filter(|r| r.rate_limit().is_some());
                assert_eq!(plan.rules.len(), rate_rules.count());
                (cfg, plan)
            })
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let [kind, pick, s0, s1, rest @ ..] = data else {
        return;
    };
    let all = fixed();
    let (cfg, plan) = &all[usize::from(*pick) % all.len()];
    let status = u32::from(u16::from_le_bytes([*s0, *s1]));
    let result = match kind % 4 {
        0 => CalloutResult::DispatchError,
        1 => CalloutResult::Http {
            status: None,
            body: rest.to_vec(),
        },
        2 => CalloutResult::Http {
            status: Some(status),
            body: rest.to_vec(),
        },
        _ => {
            let (message, body) = match rest.iter().position(|&b| b == 0) {
                Some(i) => (
                    Some(String::from_utf8_lossy(&rest[..i]).into_owned()),
                    &rest[i + 1..],
                ),
                None => (None, rest),
            };
            CalloutResult::Grpc {
                status: status % 20,
                message,
                body: body.to_vec(),
            }
        }
    };
    let answer = match interpret(plan, result) {
        Outcome::Failed(_) => return,
        Outcome::Allowed(r) => {
            assert!(r.allowed && r.buckets.iter().all(|b| b.allowed));
            r
        }
        Outcome::Limited(r) => {
            assert!(!r.allowed && r.buckets.iter().any(|b| !b.allowed));
            r
        }
    };
    assert_eq!(answer.buckets.len(), plan.request.buckets.len());
    let items: Vec<_> = plan
        .rules
        .iter()
        .filter_map(|&i| cfg.rules.get(i))
        .zip(&answer.buckets)
        .collect();
    let headers = rate_limit_headers(&[HeaderStyle::Draft, HeaderStyle::XRateLimit], &items);
    for (name, value) in &headers {
        assert!(header_name_safe(name), "{name:?}");
        assert!(header_value_safe(value), "{name}: {value:?}");
    }
    for b in &answer.buckets {
        let secs: u64 = retry_after(b.retry_after_ms)
            .parse()
            .expect("delay-seconds");
        assert!(secs >= 1);
    }
});
