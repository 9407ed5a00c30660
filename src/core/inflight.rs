//! Concurrency limits: rules of `kind: "concurrency"` hold at most `max_in_flight` requests per key
//! in flight across the fleet.
//!
//! A matching request *acquires* one slot of every such rule's key from the service (`POST
//! /v1/acquire`, all or nothing, after the rate rules admitted it) and *releases* it (`POST
//! /v1/release`) exactly once when its stream ends, however it ends. Each slot carries a deadline
//! (`deadline_ms`) on the service's clock, so the slots of a proxy that died come back by
//! themselves; a release that fails is left to that deadline.
//!
//! When the service cannot answer, the rule follows `failure_mode` (applied by
//! [`crate::core::decide::resolve_slots`]): `allow` admits without a
//! slot, `deny` refuses, and `fallback` holds a local slot instead: at most
//! `max_in_flight / N` per key in this proxy (N learned from the answers as for the fallback
//! shares, `fallback.instances` before any), counted in shared data by every
//! worker (hashed into `fallback.max_keys` counters: two keys on one counter share it, which can
//! only admit fewer) and given back when the stream ends.
//!
//! The slots a request wants are found with its buckets, in the one pass of
//! [`crate::core::decide::decide`] over the rules.
//!
//! Pure: the state machine in [`crate::core::flow`] drives it, the adapter moves the bytes.

use crate::core::config::{Concurrency, Config, Rule};
use crate::core::decide::headers::{rate_limit_headers, retry_after};
pub use crate::core::local::slots::{acquire_local, local_enabled, release_local, Want};
use crate::core::wire::plan::{CalloutResult, LocalReply};
use crate::core::wire::BucketResult;
use contract::bounds::SLOT_DENIED_RETRY_MS;
use contract::fields;
use contract::slots::{self, SlotWant};
use serde_json::Value;

/// A new slot id for an acquire: 32 hex digits, from the process's random hash keys (as the
/// service draws its own): unique across proxies with overwhelming probability.
pub fn new_slot_id() -> String {
    let mut id = crate::core::wire::instance::fresh();
    id.push_str(&crate::core::wire::instance::fresh());
    id
}

/// The body of `POST /v1/acquire` for `wants`, the slots named `slot`, with this VM's instance id
/// (so that the service counts this proxy among the live ones whatever its callouts are; the
/// contract's hand-written encoder: serde_json's serializer would add tens of KiB to the module).
pub fn encode_acquire(cfg: &Config, instance: Option<&str>, slot: &str, wants: &[Want]) -> Vec<u8> {
    slots::encode_acquire(
        slot,
        instance,
        wants.iter().filter_map(|w| {
            let c = cfg.rules.get(w.rule)?.concurrency()?;
            Some(SlotWant {
                key: &w.key,
                limit: c.max_in_flight,
                ttl_ms: c.deadline_ms,
            })
        }),
    )
}

/// The body of `POST /v1/release` for the slot `slot` of `keys`, with this VM's instance id
/// (`instance`).
pub fn encode_release(instance: Option<&str>, slot: &str, keys: &[String]) -> Vec<u8> {
    slots::encode_release(slot, instance, keys)
}

/// What an acquire's callout came back with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    /// Every slot taken, under this id.
    Held(String),
    /// Some key was full: the indices (into the wants) of the full keys and the longest
    /// `retry_after_ms` among them.
    Denied(Vec<usize>, u64),
    /// No usable answer.
    Failed,
}

/// Interprets the answer to an acquire of `n` keys (any failure, however it happened, is
/// [`Acquired::Failed`]).
pub fn interpret(result: &CalloutResult, n: usize) -> Acquired {
    let body = match result {
        CalloutResult::Http {
            status: Some(200),
            body,
        } => body,
        _ => return Acquired::Failed,
    };
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Acquired::Failed;
    };
    let Some(buckets) = v.get(fields::BUCKETS).and_then(Value::as_array) else {
        return Acquired::Failed;
    };
    if buckets.len() != n {
        return Acquired::Failed;
    }
    match (
        v.get(fields::ALLOWED).and_then(Value::as_bool),
        v.get(fields::SLOT),
    ) {
        (Some(true), Some(Value::String(s))) if !s.is_empty() => Acquired::Held(s.clone()),
        (Some(false), _) => {
            let full: Vec<usize> = buckets
                .iter()
                .enumerate()
                .filter(|(_, b)| b.get(fields::ALLOWED).and_then(Value::as_bool) != Some(true))
                .map(|(i, _)| i)
                .collect();
            if full.is_empty() {
                return Acquired::Failed;
            }
            let wait = full
                .iter()
                .filter_map(|&i| buckets.get(i)?.get(fields::RETRY_AFTER_MS)?.as_u64())
                .max()
                .unwrap_or(SLOT_DENIED_RETRY_MS);
            Acquired::Denied(full, wait)
        }
        _ => Acquired::Failed,
    }
}

/// Whether the answer to a release says it was received (whatever it found: a slot already
/// expired is released too).
pub fn released(result: &CalloutResult) -> bool {
    matches!(
        result,
        CalloutResult::Http {
            status: Some(200),
            ..
        }
    )
}

/// The denial of concurrency rule `r` (limited by `c`; its status, body, content type):
/// `Retry-After`, and the rate limit headers the rule asks for, as for a bucket of
/// `max_in_flight` with none left that may have room again after `wait_ms`.
pub fn denial(r: &Rule, c: Concurrency, wait_ms: u64) -> LocalReply {
    let wait_ms = wait_ms.max(1);
    let state = BucketResult {
        allowed: false,
        limit: c.max_in_flight,
        remaining: 0,
        reset_ms: wait_ms,
        retry_after_ms: wait_ms,
        granted: 0,
        delay_ms: 0,
        window: 0,
    };
    let mut headers = vec![("retry-after".to_string(), retry_after(wait_ms))];
    headers.extend(rate_limit_headers(&r.response.headers, &[(r, &state)]));
    headers.push(("content-type".to_string(), r.response.content_type.clone()));
    LocalReply {
        status: r.response.status,
        headers,
        body: r.response.body.clone(),
    }
}

/// Counters of concurrency rules (`tollgate.inflight.<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// The service gave the slots.
    Acquired,
    /// A key was full: denied.
    Limited,
    /// A key was full but its rule is in shadow mode: let through without a slot.
    ShadowLimited,
    /// The service took the release.
    Released,
    /// A release could not be sent or was not answered: the slot waits for its deadline.
    ReleaseFailed,
    /// No answer: admitted on a local slot (`failure_mode: fallback`).
    FallbackAcquired,
    /// No answer, and the local slots were full.
    FallbackLimited,
    /// No answer: admitted without a slot (`failure_mode: allow`).
    FailureOpen,
    /// No answer: denied (`failure_mode: deny`).
    FailureClosed,
}

impl Count {
    /// Every counter, for defining the metrics.
    pub const ALL: [Count; 9] = [
        Count::Acquired,
        Count::Limited,
        Count::ShadowLimited,
        Count::Released,
        Count::ReleaseFailed,
        Count::FallbackAcquired,
        Count::FallbackLimited,
        Count::FailureOpen,
        Count::FailureClosed,
    ];

    /// The metric name.
    pub fn metric(self) -> &'static str {
        match self {
            Count::Acquired => "tollgate.inflight.acquired",
            Count::Limited => "tollgate.inflight.limited",
            Count::ShadowLimited => "tollgate.inflight.shadow_limited",
            Count::Released => "tollgate.inflight.released",
            Count::ReleaseFailed => "tollgate.inflight.release_failed",
            Count::FallbackAcquired => "tollgate.inflight.fallback_acquired",
            Count::FallbackLimited => "tollgate.inflight.fallback_limited",
            Count::FailureOpen => "tollgate.inflight.failure_open",
            Count::FailureClosed => "tollgate.inflight.failure_closed",
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::core::base::store::fake::FakeStore;
    use crate::core::config::RuleKind;
    use crate::core::rules::Request;

    /// The slots `req` wants under `cfg` (the concurrency half of the one matching pass).
    fn plan(cfg: &Config, req: &Request) -> Vec<Want> {
        crate::core::decide::decide(cfg, req).slots
    }

    /// One concurrency rule: at most 4 in flight per `x-user` under `/slow`, 5 s deadline.
    pub(crate) fn cfg(extra: &str) -> Config {
        let json = format!(
            r#"{{"service":{{"cluster":"svc"}},
                 "rules":[{{"name":"cc","kind":"concurrency","match":{{"path_prefix":"/slow"}},
                            "key":["header:x-user"],"max_in_flight":4,"deadline_ms":5000}}]
                 {extra}}}"#
        );
        Config::parse(json.as_bytes()).unwrap()
    }

    /// A request for `path` by `user`.
    pub(crate) fn req(path: &str, user: &str) -> Request {
        Request {
            headers: vec![
                (":path".into(), path.as_bytes().to_vec()),
                ("x-user".into(), user.as_bytes().to_vec()),
            ],
            peer: None,
            properties: Vec::new(),
            ..Default::default()
        }
    }

    #[test]
    fn config_reads_and_refuses() {
        let c = cfg("");
        assert!(c.rules[0].rate_limit().is_none());
        assert_eq!(
            c.rules[0].kind,
            RuleKind::Concurrency(Concurrency {
                max_in_flight: 4,
                deadline_ms: 5000
            })
        );
        let bad = |rule: &str| {
            let json = format!(r#"{{"service":{{"cluster":"svc"}},"rules":[{rule}]}}"#);
            Config::parse(json.as_bytes()).unwrap_err().field
        };
        assert_eq!(
            bad(r#"{"name":"a","kind":"concurrency"}"#),
            "rules[0].max_in_flight"
        );
        assert_eq!(
            bad(r#"{"name":"a","kind":"concurrency","max_in_flight":0}"#),
            "rules[0].max_in_flight"
        );
        assert_eq!(
            bad(r#"{"name":"a","kind":"concurrency","max_in_flight":1,"deadline_ms":5}"#),
            "rules[0].deadline_ms"
        );
        assert_eq!(
            bad(r#"{"name":"a","kind":"concurrency","max_in_flight":1,"capacity":3}"#),
            "rules[0].capacity"
        );
        assert_eq!(
            bad(r#"{"name":"a","kind":"sideways","capacity":1,"period_ms":1}"#),
            "rules[0].kind"
        );
        assert_eq!(
            bad(r#"{"name":"a","kind":"concurrency","max_in_flight":1,"bogus":1}"#),
            "rules[0].bogus"
        );
        assert_eq!(
            bad(
                r#"{"name":"a","capacity":1,"period_ms":1},{"name":"a","kind":"concurrency","max_in_flight":1}"#
            ),
            "rules[1].name"
        );
        assert_eq!(
            bad(r#"{"name":"a","capacity":1,"period_ms":1,"max_in_flight":2}"#),
            "rules[0].max_in_flight"
        );
        // A rate rule may say its kind.
        let json = r#"{"service":{"cluster":"svc"},"rules":[{"name":"a","kind":"rate","capacity":1,"period_ms":1}]}"#;
        assert!(Config::parse(json.as_bytes()).is_ok());
        let json = r#"{"service":{"cluster":"svc","transport":"rls","domain":"d"},"rules":[{"name":"a","kind":"concurrency","max_in_flight":1}]}"#;
        assert_eq!(
            Config::parse(json.as_bytes()).unwrap_err().field,
            "rules[0].kind"
        );
    }

    #[test]
    fn plan_and_bodies() {
        let c = cfg("");
        assert!(plan(&c, &req("/fast", "u")).is_empty());
        let w = plan(&c, &req("/slow/1", "u"));
        assert_eq!(
            w,
            vec![Want {
                rule: 0,
                key: "cc|u".into()
            }]
        );
        let body: Value = serde_json::from_slice(&encode_acquire(&c, None, "ab", &w)).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"slot":"ab","buckets":[{"key":"cc|u","limit":4,"ttl_ms":5000}]})
        );
        let id = new_slot_id();
        assert!(
            id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
            "{id}"
        );
        assert_ne!(id, new_slot_id());
        let body: Value =
            serde_json::from_slice(&encode_release(None, "ab", &["cc|u".to_string()])).unwrap();
        assert_eq!(body, serde_json::json!({"slot":"ab","keys":["cc|u"]}));
    }

    #[test]
    fn interpret_every_answer() {
        let http = |status: Option<u32>, body: &str| CalloutResult::Http {
            status,
            body: body.as_bytes().to_vec(),
        };
        let held = r#"{"allowed":true,"slot":"ab","buckets":[{"allowed":true,"limit":4,"in_flight":1,"retry_after_ms":0}]}"#;
        let full = r#"{"allowed":false,"buckets":[{"allowed":false,"limit":4,"in_flight":4,"retry_after_ms":700}]}"#;
        assert_eq!(
            interpret(&http(Some(200), held), 1),
            Acquired::Held("ab".into())
        );
        assert_eq!(
            interpret(&http(Some(200), full), 1),
            Acquired::Denied(vec![0], 700)
        );
        for bad in [
            http(Some(200), held.replace("\"ab\"", "\"\"").as_str()),
            http(
                Some(200),
                full.replace("false,\"limit", "true,\"limit").as_str(),
            ),
            http(Some(200), "nope"),
            http(Some(503), full),
            http(None, ""),
            CalloutResult::DispatchError,
        ] {
            assert_eq!(interpret(&bad, 1), Acquired::Failed, "{bad:?}");
        }
        assert_eq!(interpret(&http(Some(200), held), 2), Acquired::Failed);
        assert!(released(&http(Some(200), "{}")));
        assert!(!released(&http(Some(504), "")));
    }

    #[test]
    fn denial_has_retry_after_and_the_rules_headers() {
        let c = cfg(r#","response":{"headers":["x-ratelimit"]}"#);
        let r = denial(&c.rules[0], c.rules[0].concurrency().unwrap(), 1000);
        assert_eq!(r.status, 429);
        assert!(r.headers.contains(&("retry-after".into(), "1".into())));
        assert!(r
            .headers
            .contains(&("x-ratelimit-limit".into(), "4".into())));
    }

    #[test]
    fn local_slots_are_shared_capped_and_given_back() {
        let c = cfg(r#","fallback":{"instances":2,"max_keys":16}"#);
        let s = FakeStore::default();
        let w = plan(&c, &req("/slow", "u"));
        // Not prepared: nothing is held.
        assert_eq!(acquire_local(&c, &w, &s), Err(0));
        crate::core::local::table::prepare(&s, crate::core::local::table::SLOTS_TABLE, 16, &[0; 8]);
        let a = acquire_local(&c, &w, &s).unwrap();
        let b = acquire_local(&c, &w, &s).unwrap();
        assert_eq!(acquire_local(&c, &w, &s), Err(0), "4 / 2 proxies = 2 here");
        release_local(&s, &a);
        assert!(acquire_local(&c, &w, &s).is_ok());
        release_local(&s, &b);
    }

    #[test]
    fn local_slots_split_by_the_learned_number_of_proxies() {
        let c = cfg(r#","fallback":{"instances":1,"max_keys":16}"#);
        let s = FakeStore::default();
        let w = plan(&c, &req("/slow", "u"));
        crate::core::local::table::prepare(&s, crate::core::local::table::SLOTS_TABLE, 16, &[0; 8]);
        // The service counted 2 proxies: 4 / 2 = 2 here, not the configured 4 / 1.
        crate::core::local::fallback::learn(&c, &s, 2, 0);
        assert!(acquire_local(&c, &w, &s).is_ok());
        assert!(acquire_local(&c, &w, &s).is_ok());
        assert_eq!(acquire_local(&c, &w, &s), Err(0));
    }

    /// contract/fixtures/cases.json, `slot_cases`: what the filter sends is the fixture's request,
    /// and it reads the fixture's answers.
    #[test]
    fn slot_fixtures() {
        let v: Value =
            serde_json::from_str(include_str!("../../contract/fixtures/cases.json")).unwrap();
        let case = |name: &str| {
            v["slot_cases"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["name"] == name)
                .unwrap()
                .clone()
        };
        let json = r#"{"service":{"cluster":"svc"},"rules":[{"name":"reports","kind":"concurrency",
            "key":["header:x-tenant"],"max_in_flight":10,"deadline_ms":30000}]}"#;
        let c = Config::parse(json.as_bytes()).unwrap();
        let r = Request {
            headers: vec![("x-tenant".into(), b"acme".to_vec())],
            peer: None,
            properties: Vec::new(),
            ..Default::default()
        };
        let wants = plan(&c, &r);
        let allowed = case("acquire_allowed");
        let sent: Value = serde_json::from_slice(&encode_acquire(&c, None, "", &wants)).unwrap();
        assert_eq!(sent, allowed["request_json"]);
        let named = case("acquire_named");
        let slot = named["request_json"]["slot"].as_str().unwrap();
        let sent: Value = serde_json::from_slice(&encode_acquire(&c, None, slot, &wants)).unwrap();
        assert_eq!(sent, named["request_json"]);
        let body = |case: &Value| CalloutResult::Http {
            status: Some(200),
            body: serde_json::to_vec(&case["response_json"]).unwrap(),
        };
        let slot = allowed["response_json"]["slot"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(interpret(&body(&allowed), 1), Acquired::Held(slot.clone()));
        assert_eq!(
            interpret(&body(&case("acquire_denied_all_or_nothing")), 2),
            Acquired::Denied(vec![1], 1000)
        );
        let release = case("release");
        let sent: Value =
            serde_json::from_slice(&encode_release(None, &slot, &["reports|acme".to_string()]))
                .unwrap();
        assert_eq!(sent, release["request_json"]);
        assert!(released(&body(&release)));
    }
}
