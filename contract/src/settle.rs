//! Settle (contract/README.md, "Settle"): the second half of reserve-then-settle. A settle names
//! the buckets a take charged with the estimate and what the response used; its JSON form
//! (`POST /v1/settle`) is written by hand as a take is, and the answers carry serde derives behind
//! the `serde` feature (the service's).

use crate::algorithm::Algorithm;
use crate::calendar::Calendar;
use crate::fields;
use crate::json::{push_name, push_string, push_u64};

/// One bucket of a settle, as a caller sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SettleBucket<'a> {
    /// The bucket's key, as its take named it.
    pub key: &'a str,
    /// Its capacity.
    pub capacity: u64,
    /// Its rate; `None`: the capacity (not encoded).
    pub rate: Option<u64>,
    /// Its period.
    pub period_ms: u64,
    /// Its algorithm; `None`: token bucket (not encoded).
    pub algorithm: Option<Algorithm>,
    /// The rule it belongs to (empty: not sent).
    pub rule: &'a str,
    /// Tokens the take charged.
    pub estimate: u64,
    /// Tokens the response used.
    pub used: u64,
    /// The window the estimate was charged in (window algorithms; `None`: not known).
    pub window: Option<u64>,
    /// A calendar window's period and zone (as [`crate::Bucket::calendar`]).
    pub calendar: Option<&'a Calendar>,
}

/// Encodes a settle: `{"id": "...", "buckets": [{"key", "capacity", ..., "estimate", "used"}]}`.
pub fn encode_settle<'a>(
    id: &str,
    instance: Option<&str>,
    buckets: impl IntoIterator<Item = SettleBucket<'a>>,
) -> Vec<u8> {
    let mut s = String::with_capacity(192);
    s.push_str("{\"");
    s.push_str(fields::ID);
    s.push_str("\":");
    push_string(&mut s, id);
    if let Some(i) = instance {
        s.push_str(",\"");
        s.push_str(fields::INSTANCE);
        s.push_str("\":");
        push_string(&mut s, i);
    }
    s.push_str(",\"");
    s.push_str(fields::BUCKETS);
    s.push_str("\":[");
    for (i, b) in buckets.into_iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str("{\"");
        s.push_str(fields::KEY);
        s.push_str("\":");
        push_string(&mut s, b.key);
        push_u64(&mut s, fields::CAPACITY, b.capacity);
        if let Some(rate) = b.rate {
            push_u64(&mut s, fields::RATE, rate);
        }
        push_u64(&mut s, fields::PERIOD_MS, b.period_ms);
        if let Some(a) = b.algorithm {
            push_name(&mut s, fields::ALGORITHM, false);
            push_string(&mut s, a.name());
        }
        if !b.rule.is_empty() {
            push_name(&mut s, fields::RULE, false);
            push_string(&mut s, b.rule);
        }
        push_u64(&mut s, fields::ESTIMATE, b.estimate);
        push_u64(&mut s, fields::USED, b.used);
        if let Some(w) = b.window {
            push_u64(&mut s, fields::WINDOW, w);
        }
        if let Some(c) = b.calendar {
            crate::json::push_calendar(&mut s, c);
        }
        s.push('}');
    }
    s.push_str("]}");
    s.into_bytes()
}

/// The answer for one bucket of a settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields)
)]
pub struct SettleResult {
    /// Whole tokens the bucket holds after the settle (0 while it owes).
    pub remaining: u64,
    /// Whole tokens the bucket owes (rounded up): a token bucket below zero, a window counted
    /// above its capacity. 0 (not encoded) when it owes nothing.
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "crate::take::is_zero")
    )]
    pub debt: u64,
}

/// The answer to a settle.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields)
)]
pub struct SettleResponse {
    /// The id had been applied before: nothing changed now. The buckets report how they stand.
    pub duplicate: bool,
    /// One result per request bucket, in request order.
    pub buckets: Vec<SettleResult>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use serde_json::Value;

    /// Every settle fixture's request, encoded from its fields, is the fixture's JSON.
    #[test]
    fn settles_encode_as_the_fixtures() {
        let all: Value = serde_json::from_str(include_str!("../fixtures/cases.json")).unwrap();
        let cases = all["settle_cases"].as_array().unwrap();
        assert!(!cases.is_empty());
        for c in cases {
            let req = &c["request_json"];
            let buckets: Vec<SettleBucket> = req["buckets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| SettleBucket {
                    key: b["key"].as_str().unwrap(),
                    capacity: b["capacity"].as_u64().unwrap(),
                    rate: b["rate"].as_u64(),
                    period_ms: b["period_ms"].as_u64().unwrap(),
                    algorithm: b["algorithm"].as_str().and_then(Algorithm::from_name),
                    rule: b["rule"].as_str().unwrap_or(""),
                    estimate: b["estimate"].as_u64().unwrap(),
                    used: b["used"].as_u64().unwrap(),
                    window: b["window"].as_u64(),
                    calendar: None,
                })
                .collect();
            let got = encode_settle(
                req["id"].as_str().unwrap(),
                req["instance"].as_str(),
                buckets,
            );
            let got: Value = serde_json::from_slice(&got).unwrap();
            assert_eq!(&got, req, "{}", c["name"]);
        }
    }
}
