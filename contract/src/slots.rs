//! Concurrency slots (contract/README.md, "Acquire and release"): an acquire's keys and a
//! release's slot in their JSON form (`POST /v1/acquire`, `POST /v1/release`), written by hand as
//! a take is, and the answers (serde derives behind the `serde` feature, the service's).

use crate::fields;
use crate::json::{push_string, push_u64};

/// One key of an acquire, as a caller sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotWant<'a> {
    /// The key, 1..=4096 bytes (its own namespace, apart from buckets).
    pub key: &'a str,
    /// Most slots of this key held at once, 1..=1e9.
    pub limit: u64,
    /// The slot's deadline from now, 1..=one day in ms.
    pub ttl_ms: u64,
}

/// `"instance":"<id>",` when the caller sends one (an acquire's and a release's first field).
fn push_instance(s: &mut String, instance: Option<&str>) {
    if let Some(i) = instance {
        s.push_str(fields::INSTANCE);
        s.push_str("\":");
        push_string(s, i);
        s.push_str(",\"");
    }
}

/// Encodes an acquire of slots the caller names `slot` (hex digits; empty: the service names
/// them) from proxy `instance`: `{"instance", "slot", "buckets": [{"key", "limit", "ttl_ms"}]}`.
pub fn encode_acquire<'a>(
    slot: &str,
    instance: Option<&str>,
    wants: impl IntoIterator<Item = SlotWant<'a>>,
) -> Vec<u8> {
    let mut s = String::with_capacity(128);
    s.push_str("{\"");
    push_instance(&mut s, instance);
    if !slot.is_empty() {
        s.push_str(fields::SLOT);
        s.push_str("\":");
        push_string(&mut s, slot);
        s.push_str(",\"");
    }
    s.push_str(fields::BUCKETS);
    s.push_str("\":[");
    for (i, w) in wants.into_iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str("{\"");
        s.push_str(fields::KEY);
        s.push_str("\":");
        push_string(&mut s, w.key);
        push_u64(&mut s, fields::LIMIT, w.limit);
        push_u64(&mut s, fields::TTL_MS, w.ttl_ms);
        s.push('}');
    }
    s.push_str("]}");
    s.into_bytes()
}

/// Encodes a release of the slot `slot` of `keys` from proxy `instance`:
/// `{"instance": "<id>", "slot": "<id>", "keys": [...]}`.
pub fn encode_release(slot: &str, instance: Option<&str>, keys: &[String]) -> Vec<u8> {
    let mut s = String::with_capacity(32 + slot.len() + 40 * keys.len());
    s.push_str("{\"");
    push_instance(&mut s, instance);
    s.push_str(fields::SLOT);
    s.push_str("\":");
    push_string(&mut s, slot);
    s.push_str(",\"");
    s.push_str(fields::KEYS);
    s.push_str("\":[");
    for (i, k) in keys.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        push_string(&mut s, k);
    }
    s.push_str("]}");
    s.into_bytes()
}

/// The answer for one key of an acquire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields)
)]
pub struct SlotResult {
    /// This key had a free slot.
    pub allowed: bool,
    /// The key's limit.
    pub limit: u64,
    /// Slots of this key held after the acquire (counting this one when it was taken), expired
    /// ones not counted.
    pub in_flight: u64,
    /// 0 when allowed; else how long to wait before trying again, in ms (at most
    /// [`crate::bounds::SLOT_DENIED_RETRY_MS`]).
    pub retry_after_ms: u64,
}

/// The answer to an acquire (with `serde`, the JSON response body of `POST /v1/acquire`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields)
)]
pub struct AcquireResponse {
    /// Every key had a free slot and one of each is now held; `false`: none is held.
    pub allowed: bool,
    /// The id of the held slots (present only when allowed): what a release names.
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub slot: Option<String>,
    /// One result per key, in request order.
    pub buckets: Vec<SlotResult>,
}

impl AcquireResponse {
    /// The answer from per-key results; `slot` names the held slots when every key allowed.
    pub fn from_buckets(buckets: Vec<SlotResult>, slot: &str) -> Self {
        let allowed = !buckets.is_empty() && buckets.iter().all(|b| b.allowed);
        AcquireResponse {
            allowed,
            slot: allowed.then(|| slot.to_string()),
            buckets,
        }
    }
}

/// The answer to a release (with `serde`, the JSON response body of `POST /v1/release`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields)
)]
pub struct ReleaseResponse {
    /// Per key, in request order: whether the slot was still held (false: it had expired, or
    /// was released before).
    pub released: Vec<bool>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use serde_json::Value;

    fn cases(op: &str) -> Vec<Value> {
        let v: Value = serde_json::from_str(include_str!("../fixtures/cases.json")).unwrap();
        let all = v["slot_cases"].as_array().unwrap().clone();
        all.into_iter().filter(|c| c["op"] == op).collect()
    }

    #[test]
    fn acquires_and_releases_are_the_fixtures() {
        let acquires = cases("acquire");
        assert!(acquires.len() >= 2);
        for case in acquires {
            let buckets = case["request_json"]["buckets"].as_array().unwrap();
            let wants: Vec<SlotWant<'_>> = buckets
                .iter()
                .map(|b| SlotWant {
                    key: b["key"].as_str().unwrap(),
                    limit: b["limit"].as_u64().unwrap(),
                    ttl_ms: b["ttl_ms"].as_u64().unwrap(),
                })
                .collect();
            let slot = case["request_json"]["slot"].as_str().unwrap_or("");
            let ours: Value = serde_json::from_slice(&encode_acquire(
                slot,
                case["request_json"]["instance"].as_str(),
                wants,
            ))
            .unwrap();
            assert_eq!(ours, case["request_json"], "{}", case["name"]);
        }
        for case in cases("release") {
            let r = &case["request_json"];
            let keys: Vec<String> = r["keys"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_str().unwrap().to_string())
                .collect();
            let ours: Value = serde_json::from_slice(&encode_release(
                r["slot"].as_str().unwrap(),
                r["instance"].as_str(),
                &keys,
            ))
            .unwrap();
            assert_eq!(&ours, r);
        }
        let escaped: Value =
            serde_json::from_slice(&encode_release("s", None, &["a\"\u{1}".into()])).unwrap();
        assert_eq!(escaped["keys"][0], "a\"\u{1}");
    }
}
