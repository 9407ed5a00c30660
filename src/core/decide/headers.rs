//! Rate limit response headers.
//!
//! - `retry-after`: delay-seconds (RFC 9110), rounded up and at least 1, on every denial.
//! - `draft`: draft-ietf-httpapi-ratelimit-headers (the structured-field form of drafts 09+):
//!   `RateLimit-Policy: "per-ip";q=100;w=60` (the policy: quota `q` per window of `w` seconds)
//!   and `RateLimit: "per-ip";r=99;t=1` (the live state: `r` remaining, `t` seconds until the
//!   quota is restored), one list member per rule that applied, the member being a quoted string
//!   (the contract's formatter, [`contract::headers`], which the service's RLS answers use too).
//!   A token bucket's window is the time it takes to refill from empty,
//!   `ceil(capacity × period / rate)`.
//! - `x-ratelimit`: the de-facto `X-RateLimit-Limit`, `-Remaining`, `-Reset` (seconds), for the
//!   most restrictive bucket (least remaining).

use crate::core::config::{HeaderStyle, Rule, RuleKind};
use crate::core::wire::BucketResult;
use contract::headers::{ceil_secs, push_policy, push_state, retry_after_secs, u64_string};

/// The `retry-after` value for a wait of `ms`.
pub fn retry_after(ms: u64) -> String {
    u64_string(retry_after_secs(ms))
}

/// The policy window of a rule, in seconds (at least 1): a concurrency rule's is its deadline.
pub fn window_secs(rule: &Rule) -> u64 {
    let ms = match &rule.kind {
        RuleKind::Rate(l) if crate::core::local::bucket::windowed(l.algorithm) => {
            u128::from(l.period_ms)
        }
        RuleKind::Rate(l) => {
            (u128::from(l.capacity) * u128::from(l.period_ms)).div_ceil(u128::from(l.rate.max(1)))
        }
        RuleKind::Concurrency(c) => u128::from(c.deadline_ms),
    };
    u64::try_from(ms.div_ceil(1000)).unwrap_or(u64::MAX).max(1)
}

/// The headers of `styles` for the buckets of a decision, as (lower-case name, value) pairs.
pub fn rate_limit_headers(
    styles: &[HeaderStyle],
    items: &[(&Rule, &BucketResult)],
) -> Vec<(String, String)> {
    if items.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(3);
    for style in styles {
        match style {
            HeaderStyle::Draft => {
                // A member is the quoted name and about 20 bytes of parameters.
                let size = items.iter().map(|(r, _)| r.name.len() + 24).sum();
                let mut policy = String::with_capacity(size);
                let mut state = String::with_capacity(size);
                for (i, (rule, r)) in items.iter().enumerate() {
                    if i > 0 {
                        policy.push_str(", ");
                        state.push_str(", ");
                    }
                    push_policy(&mut policy, &rule.name, r.limit, window_secs(rule));
                    push_state(
                        &mut state,
                        &rule.name,
                        r.remaining,
                        Some(ceil_secs(r.reset_ms)),
                    );
                }
                out.push(("ratelimit-policy".to_string(), policy));
                out.push(("ratelimit".to_string(), state));
            }
            HeaderStyle::XRateLimit => {
                let tightest = items.iter().min_by(|a, b| {
                    a.1.remaining
                        .cmp(&b.1.remaining)
                        .then(b.1.reset_ms.cmp(&a.1.reset_ms))
                });
                if let Some((_, r)) = tightest {
                    out.push(("x-ratelimit-limit".to_string(), u64_string(r.limit)));
                    out.push(("x-ratelimit-remaining".to_string(), u64_string(r.remaining)));
                    out.push((
                        "x-ratelimit-reset".to_string(),
                        u64_string(ceil_secs(r.reset_ms)),
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::config::{Algorithm, RateLimit};

    fn rule(name: &str, capacity: u64, rate: u64, period_ms: u64, algorithm: Algorithm) -> Rule {
        Rule {
            kind: RuleKind::Rate(RateLimit {
                rate,
                period_ms,
                algorithm,
                ..RateLimit::for_test(capacity)
            }),
            ..Rule::for_test(name, capacity)
        }
    }

    fn res(limit: u64, remaining: u64, reset_ms: u64) -> BucketResult {
        BucketResult {
            allowed: true,
            limit,
            remaining,
            reset_ms,
            retry_after_ms: 0,
            granted: 1,
            delay_ms: 0,
            window: 0,
        }
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        assert_eq!(retry_after(41_250), "42");
        assert_eq!(retry_after(1_000), "1");
        assert_eq!(retry_after(1_001), "2");
        assert_eq!(retry_after(0), "1");
        assert_eq!(retry_after(u64::MAX), (u64::MAX / 1000 + 1).to_string());
    }

    #[test]
    fn draft_headers_list_every_rule() {
        let a = rule("per-ip", 100, 100, 60_000, Algorithm::TokenBucket);
        let b = rule("burst", 10, 1, 1_000, Algorithm::TokenBucket);
        let (ra, rb) = (res(100, 99, 600), res(10, 0, 10_000));
        let h = rate_limit_headers(&[HeaderStyle::Draft], &[(&a, &ra), (&b, &rb)]);
        assert_eq!(
            h,
            vec![
                (
                    "ratelimit-policy".into(),
                    "\"per-ip\";q=100;w=60, \"burst\";q=10;w=10".into()
                ),
                (
                    "ratelimit".into(),
                    "\"per-ip\";r=99;t=1, \"burst\";r=0;t=10".into()
                ),
            ]
        );
    }

    #[test]
    fn x_ratelimit_reports_the_tightest_bucket() {
        let a = rule("a", 100, 100, 60_000, Algorithm::TokenBucket);
        let b = rule("b", 10, 10, 1_000, Algorithm::FixedWindow);
        let (ra, rb) = (res(100, 50, 30_000), res(10, 3, 400));
        let h = rate_limit_headers(&[HeaderStyle::XRateLimit], &[(&a, &ra), (&b, &rb)]);
        assert_eq!(
            h,
            vec![
                ("x-ratelimit-limit".into(), "10".into()),
                ("x-ratelimit-remaining".into(), "3".into()),
                ("x-ratelimit-reset".into(), "1".into()),
            ]
        );
        assert!(rate_limit_headers(&[], &[(&a, &ra)]).is_empty());
        assert!(rate_limit_headers(&[HeaderStyle::Draft], &[]).is_empty());
    }

    #[test]
    fn windows() {
        assert_eq!(
            window_secs(&rule("a", 100, 100, 60_000, Algorithm::TokenBucket)),
            60
        );
        assert_eq!(
            window_secs(&rule("a", 100, 10, 1_000, Algorithm::TokenBucket)),
            10
        );
        assert_eq!(
            window_secs(&rule("a", 1, 1000, 1_000, Algorithm::TokenBucket)),
            1
        );
        assert_eq!(
            window_secs(&rule("a", 5, 1, 1_500, Algorithm::FixedWindow)),
            2
        );
    }

    #[test]
    fn sf_strings_are_escaped() {
        let mut s = String::new();
        contract::headers::push_name(&mut s, "a\"b\\c\né");
        assert_eq!(s, "\"a\\\"b\\\\c??\"");
    }
}
