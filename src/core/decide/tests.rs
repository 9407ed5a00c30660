//! The decision's tests: plans, interpretation, the failure modes, headers.

use super::*;
use crate::core::base::store::fake::FakeStore;
use crate::core::config::{Config, HeaderStyle};
use crate::core::local::fallback;
use crate::core::wire::decode_proto;

/// [`super::resolve`] with what the flow's fallback stage takes for a failure.
fn resolve<S: CasStore + ?Sized>(
    c: &Config,
    p: &Plan,
    o: &Outcome,
    store: &S,
    now: u64,
) -> Verdict {
    let shares = match o {
        Outcome::Failed(cause) => fallback::on_failure(c, [0; 3], &p.request, *cause, store, now),
        _ => None,
    };
    super::resolve(c, p, o, shares.as_ref())
}

fn cfg(extra: &str) -> Config {
    let json = format!(
        r#"{{"service":{{"cluster":"svc"}},
             "rules":[{{"name":"per-ip","key":["client_ip"],"capacity":2,"period_ms":60000}},
                      {{"name":"login","match":{{"path_exact":"/login","methods":["POST"]}},
                        "key":["header:x-user"],"capacity":5,"rate":1,"period_ms":1000}}]
             {extra}}}"#
    );
    Config::parse(json.as_bytes()).unwrap()
}

fn req(path: &str, method: &str, user: Option<&str>) -> Request {
    let mut headers = vec![
        (":path".to_string(), path.as_bytes().to_vec()),
        (":method".to_string(), method.as_bytes().to_vec()),
    ];
    if let Some(u) = user {
        headers.push(("x-user".to_string(), u.as_bytes().to_vec()));
    }
    Request {
        headers,
        peer: Some("10.0.0.7:5555".into()),
        properties: Vec::new(),
        ..Default::default()
    }
}

fn plan_of(c: &Config, r: &Request) -> Plan {
    match decide(c, r).step {
        Step::Callout(p) => p,
        Step::Continue => panic!("expected a callout"),
    }
}

fn answer(allowed: &[bool]) -> Vec<u8> {
    let buckets: Vec<String> = allowed
        .iter()
        .map(|a| {
            format!(
                r#"{{"allowed":{a},"limit":2,"remaining":{},"reset_ms":2500,"retry_after_ms":{}}}"#,
                if *a { 1 } else { 0 },
                if *a { 0 } else { 30_001 }
            )
        })
        .collect();
    format!(
        r#"{{"allowed":{},"buckets":[{}]}}"#,
        allowed.iter().all(|a| *a),
        buckets.join(",")
    )
    .into_bytes()
}

fn http(status: u32, body: &[u8]) -> CalloutResult {
    CalloutResult::Http {
        status: Some(status),
        body: body.to_vec(),
    }
}

#[test]
fn no_matching_rule_means_no_callout() {
    let c = Config::parse(
        br#"{"service":{"cluster":"svc"},"rules":[{"name":"a","match":{"path_prefix":"/api/"},"capacity":1,"period_ms":1}]}"#,
    )
    .unwrap();
    assert_eq!(decide(&c, &req("/other", "GET", None)).step, Step::Continue);
    // A rule whose key part is missing is skipped (on_missing: skip).
    let c = cfg("");
    let mut r = req("/x", "GET", None);
    r.peer = None;
    assert_eq!(decide(&c, &r).step, Step::Continue);
}

#[test]
fn all_matching_rules_go_into_one_callout() {
    let c = cfg("");
    let p = plan_of(&c, &req("/login?x=1", "POST", Some("alice")));
    assert_eq!(p.rules, vec![0, 1]);
    let keys: Vec<&str> = p.request.buckets.iter().map(|b| b.key.as_str()).collect();
    assert_eq!(keys, vec!["per-ip|10.0.0.7", "login|alice"]);
    assert_eq!(p.request.buckets[1].rate, Some(1));
    assert_eq!(p.request.buckets[1].cost, Some(1));
    let p = plan_of(&c, &req("/login", "GET", Some("alice")));
    assert_eq!(p.rules, vec![0]);
}

#[test]
fn interpret_every_kind_of_result() {
    let c = cfg("");
    let p = plan_of(&c, &req("/login", "POST", Some("a")));
    let cases: Vec<(CalloutResult, &str)> = vec![
        (http(200, &answer(&[true, true])), "allowed"),
        (http(200, &answer(&[true, false])), "limited"),
        (http(200, &answer(&[true])), "decode"),
        (http(200, b"{\"allowed\":true,\"buckets\":[{\"allowed\":false},{\"allowed\":true}]}"), "decode"),
        (http(200, b"not json"), "decode"),
        (http(204, b""), "decode"),
        (http(500, b"oops"), "status"),
        (http(503, b"{\"error\":{\"code\":\"unavailable\"}}"), "status"),
        (http(400, b"{}"), "status"),
        (http(401, b"{}"), "status"),
        (http(503, b"upstream connect error or disconnect/reset before headers. reset reason: connection failure"), "connect"),
        (http(503, b"no healthy upstream"), "connect"),
        (http(504, b"upstream request timeout"), "timeout"),
        (CalloutResult::Http { status: None, body: vec![] }, "reset"),
        (CalloutResult::DispatchError, "dispatch"),
        (CalloutResult::Grpc { status: 14, message: Some("upstream request timeout".into()), body: vec![] }, "timeout"),
        (CalloutResult::Grpc { status: 4, message: None, body: vec![] }, "timeout"),
        (CalloutResult::Expired, "timeout"),
        (CalloutResult::Grpc { status: 14, message: Some("upstream connect error or disconnect/reset before headers. reset reason: connection failure".into()), body: vec![] }, "connect"),
        (CalloutResult::Grpc { status: 14, message: Some("store unavailable".into()), body: vec![] }, "grpc_status"),
        (CalloutResult::Grpc { status: 16, message: None, body: vec![] }, "grpc_status"),
        (CalloutResult::Grpc { status: 0, message: None, body: vec![0x08, 0x01, 0x12, 0x00, 0x12, 0x00] }, "decode"),
        (CalloutResult::Grpc { status: 0, message: None, body: vec![0x08, 0x01, 0x12, 0x02, 0x08, 0x01, 0x12, 0x02, 0x08, 0x01] }, "allowed"),
        (CalloutResult::Grpc { status: 0, message: None, body: vec![0x12, 0x02, 0x08, 0x01, 0x12, 0x00] }, "limited"),
        (CalloutResult::Grpc { status: 0, message: None, body: vec![0xff] }, "decode"),
        (CalloutResult::TooLarge { size: 1 << 20 }, "decode"),
        (CalloutResult::BatchMismatch, "decode"),
        (CalloutResult::Answers(Vec::new()), "decode"),
        (CalloutResult::Unsent, "queued"),
        (CalloutResult::Expired.shared(), "timeout"),
        (CalloutResult::DispatchError.shared().shared(), "dispatch"),
    ];
    for (i, (result, want)) in cases.into_iter().enumerate() {
        let got = match interpret(&p, result) {
            Outcome::Allowed(_) => "allowed",
            Outcome::Limited(_) => "limited",
            Outcome::Failed(c) => c.name(),
        };
        assert_eq!(got, want, "case {i}");
    }
    assert!(decode_proto(&[0x08, 0x01]).is_ok());
}

#[test]
fn limited_answer_becomes_a_denial_with_headers() {
    let c = cfg(r#","response":{"headers":["draft","x-ratelimit"]}"#);
    let p = plan_of(&c, &req("/login", "POST", Some("a")));
    let o = interpret(&p, http(200, &answer(&[true, false])));
    let v = resolve(&c, &p, &o, &FakeStore::default(), 0);
    assert_eq!(v.decision, Decision::Limited);
    assert_eq!(&*v.denied_by, &[1]);
    let Action::Deny(r) = v.action else {
        panic!("not denied")
    };
    assert_eq!(r.status, 429);
    assert_eq!(r.body, "rate limited\n");
    let h = |n: &str| {
        r.headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(h("retry-after").as_deref(), Some("31"));
    assert_eq!(h("content-type").as_deref(), Some("text/plain"));
    assert_eq!(
        h("ratelimit-policy").as_deref(),
        Some("\"per-ip\";q=2;w=60, \"login\";q=2;w=5")
    );
    assert_eq!(
        h("ratelimit").as_deref(),
        Some("\"per-ip\";r=1;t=3, \"login\";r=0;t=3")
    );
    assert_eq!(h("x-ratelimit-remaining").as_deref(), Some("0"));
}

#[test]
fn allowed_answer_adds_headers_only_when_asked() {
    let c = cfg("");
    let p = plan_of(&c, &req("/x", "GET", None));
    let o = interpret(&p, http(200, &answer(&[true])));
    let v = resolve(&c, &p, &o, &FakeStore::default(), 0);
    assert_eq!(v.action, Action::Allow(vec![]));
    assert_eq!(v.decision, Decision::Allowed);
    let c = cfg(r#","response":{"on_allowed":true}"#);
    let v = resolve(&c, &p, &o, &FakeStore::default(), 0);
    let Action::Allow(h) = v.action else { panic!() };
    assert_eq!(h.len(), 2);
}

#[test]
fn failure_modes() {
    let p_for = |c: &Config| plan_of(c, &req("/x", "GET", None));
    let failed = Outcome::Failed(Cause::Timeout);

    let c = cfg(r#","failure_mode":"allow""#);
    let v = resolve(&c, &p_for(&c), &failed, &FakeStore::default(), 0);
    assert_eq!(
        (v.action, v.decision),
        (Action::Allow(vec![]), Decision::FailureOpenAllowed)
    );

    let c = cfg(r#","failure_mode":"deny""#);
    let v = resolve(&c, &p_for(&c), &failed, &FakeStore::default(), 0);
    assert_eq!(v.decision, Decision::FailureClosedLimited);
    let Action::Deny(r) = v.action else { panic!() };
    assert!(r
        .headers
        .contains(&("retry-after".to_string(), "1".to_string())));

    // Fallback: capacity 2 per key, shared through the store.
    let c = cfg(r#","failure_mode":"fallback""#);
    let store = FakeStore::default();
    crate::core::local::fallback::prepare(&store, c.fallback.max_keys);
    let p = p_for(&c);
    let ds: Vec<Decision> = (0..3)
        .map(|_| resolve(&c, &p, &failed, &store, 0).decision)
        .collect();
    assert_eq!(
        ds,
        vec![
            Decision::FallbackAllowed,
            Decision::FallbackAllowed,
            Decision::FallbackLimited
        ]
    );
    let v = resolve(&c, &p, &failed, &store, 0);
    let Action::Deny(r) = v.action else { panic!() };
    assert!(
        r.headers
            .contains(&("retry-after".to_string(), "30".to_string())),
        "{:?}",
        r.headers
    );
    // Breaker refusals take the same path.
    let v = resolve(&c, &p, &Outcome::Failed(Cause::Breaker), &store, 30_000);
    assert_eq!(v.decision, Decision::FallbackAllowed);

    // instances divides the local capacity: 2 / 2 = 1.
    let c = cfg(r#","fallback":{"instances":2}"#);
    let store = FakeStore::default();
    crate::core::local::fallback::prepare(&store, c.fallback.max_keys);
    let p = p_for(&c);
    let ds: Vec<Decision> = (0..2)
        .map(|_| resolve(&c, &p, &failed, &store, 0).decision)
        .collect();
    assert_eq!(
        ds,
        vec![Decision::FallbackAllowed, Decision::FallbackLimited]
    );
}

#[test]
fn shadow_never_denies() {
    let c = cfg(r#","shadow":true,"failure_mode":"deny""#);
    let p = plan_of(&c, &req("/x", "GET", None));
    for o in [
        interpret(&p, http(200, &answer(&[false]))),
        Outcome::Failed(Cause::Reset),
    ] {
        let v = resolve(&c, &p, &o, &FakeStore::default(), 0);
        assert_eq!(v.action, Action::Allow(vec![]));
        assert_eq!(v.decision, Decision::ShadowLimited);
    }
    let v = resolve(
        &c,
        &p,
        &interpret(&p, http(200, &answer(&[true]))),
        &FakeStore::default(),
        0,
    );
    assert_eq!(v.decision, Decision::Allowed);
}

#[test]
fn shadow_status_body_and_headers_per_rule() {
    // Rule `per-ip` enforces with its own status and body; `login` is in shadow mode and asks
    // for x-ratelimit headers only; the global response is the default for the rest.
    let json = r#"{"service":{"cluster":"svc"},
         "response":{"status":429,"body":"global","headers":["draft"]},
         "rules":[{"name":"per-ip","key":["client_ip"],"capacity":2,"period_ms":60000,
                   "response":{"status":403,"body":"no more"}},
                  {"name":"login","match":{"path_exact":"/login","methods":["POST"]},
                   "key":["header:x-user"],"capacity":5,"rate":1,"period_ms":1000,
                   "shadow":true,"response":{"headers":["x-ratelimit"],"on_allowed":true}}]}"#;
    let c = Config::parse(json.as_bytes()).unwrap();
    assert_eq!(
        c.rules[0].response.headers,
        vec![HeaderStyle::Draft],
        "inherited"
    );
    assert_eq!(c.rules[1].response.body, "global", "inherited");
    let p = plan_of(&c, &req("/login", "POST", Some("u")));
    let resolve_with = |a: &[bool]| {
        resolve(
            &c,
            &p,
            &interpret(&p, http(200, &answer(a))),
            &FakeStore::default(),
            0,
        )
    };
    // Only the shadow rule denies: let through, counted per rule.
    let v = resolve_with(&[true, false]);
    assert_eq!(v.action, Action::Allow(vec![]));
    assert_eq!(v.decision, Decision::ShadowLimited);
    assert_eq!(v.rule_counts, vec![(1, RuleCount::ShadowLimited)]);
    // The enforcing rule denies: its status and body, both rules' headers in their styles.
    let v = resolve_with(&[false, false]);
    assert_eq!(v.decision, Decision::Limited);
    let Action::Deny(r) = v.action else { panic!() };
    assert_eq!((r.status, r.body.as_str()), (403, "no more"));
    let names: Vec<&str> = r.headers.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"ratelimit-policy") && names.contains(&"x-ratelimit-limit"));
    let policy = &r
        .headers
        .iter()
        .find(|(n, _)| n == "ratelimit-policy")
        .unwrap()
        .1;
    assert!(
        policy.contains("per-ip") && !policy.contains("login"),
        "{policy}"
    );
    assert_eq!(
        v.rule_counts,
        vec![(0, RuleCount::Limited), (1, RuleCount::ShadowLimited)]
    );
    // Allowed: headers only for the rule with on_allowed; near_limit at 1 of 2 left (50% ≤ 20%? no).
    let v = resolve_with(&[true, true]);
    let Action::Allow(h) = v.action else { panic!() };
    assert!(h.iter().all(|(n, _)| n.starts_with("x-ratelimit")), "{h:?}");
    assert_eq!(
        v.rule_counts,
        vec![(0, RuleCount::Allowed), (1, RuleCount::Allowed)]
    );
}

#[test]
fn near_limit_is_counted_at_the_configured_share() {
    let c = cfg(r#","near_limit":0.5"#);
    let p = plan_of(&c, &req("/x", "GET", None));
    // 1 of 2 left: half used, at the 0.5 mark.
    let v = resolve(
        &c,
        &p,
        &interpret(&p, http(200, &answer(&[true]))),
        &FakeStore::default(),
        0,
    );
    assert_eq!(
        v.rule_counts,
        vec![(0, RuleCount::Allowed), (0, RuleCount::NearLimit)]
    );
    let c = cfg(r#","near_limit":0.9"#);
    let v = resolve(
        &c,
        &p,
        &interpret(&p, http(200, &answer(&[true]))),
        &FakeStore::default(),
        0,
    );
    assert_eq!(v.rule_counts, vec![(0, RuleCount::Allowed)]);
    for bad in [r#","near_limit":1.5"#, r#","near_limit":"x""#] {
        let json = format!(
            r#"{{"service":{{"cluster":"svc"}},"rules":[{{"name":"a","capacity":1,"period_ms":1}}]{bad}}}"#
        );
        assert_eq!(
            Config::parse(json.as_bytes()).unwrap_err().field,
            "near_limit"
        );
    }
    let json = r#"{"service":{"cluster":"svc"},"rules":[{"name":"a","capacity":1,"period_ms":1,"response":{"status":200}}]}"#;
    assert_eq!(
        Config::parse(json.as_bytes()).unwrap_err().field,
        "rules[0].response.status"
    );
}

#[test]
fn metric_names_are_the_agreed_ones() {
    let names: Vec<&str> = Decision::ALL.iter().map(|d| d.metric()).collect();
    assert_eq!(
        names,
        vec![
            "tollgate.allowed",
            "tollgate.limited",
            "tollgate.shadow_limited",
            "tollgate.fallback.allowed",
            "tollgate.fallback.limited",
            "tollgate.failure_open.allowed",
            "tollgate.failure_closed.limited"
        ]
    );
    let causes: Vec<&str> = Cause::CALLOUT.iter().map(|c| c.name()).collect();
    assert_eq!(
        causes,
        vec![
            "dispatch",
            "timeout",
            "reset",
            "connect",
            "status",
            "grpc_status",
            "decode"
        ]
    );
}

/// One pass gives the rate rules' buckets and the concurrency rules' slots, each naming its
/// rule by its index in `Config::rules`, whatever the kinds' order.
#[test]
fn one_pass_gives_buckets_and_slots_by_rule_index() {
    let c = Config::parse(
        br#"{"service":{"cluster":"svc"},"rules":[
            {"name":"cc","kind":"concurrency","key":["literal:k"],"max_in_flight":4},
            {"name":"r","capacity":5,"period_ms":1000},
            {"name":"off","kind":"concurrency","match":{"path_exact":"/never"},"max_in_flight":1},
            {"name":"dd","kind":"concurrency","max_in_flight":2}]}"#,
    )
    .unwrap();
    let m = decide(&c, &req("/api", "GET", None));
    let Step::Callout(plan) = m.step else {
        panic!("expected a callout")
    };
    assert_eq!(plan.rules, vec![1]);
    assert_eq!(plan.request.buckets[0].key, "r");
    assert_eq!(
        m.slots,
        vec![
            Want {
                rule: 0,
                key: "cc|k".into()
            },
            Want {
                rule: 3,
                key: "dd".into()
            }
        ]
    );
}

#[test]
fn a_failed_acquire_follows_the_failure_mode() {
    let slots_cfg = |mode: &str| {
        let json = format!(
            r#"{{"service":{{"cluster":"svc"}},"failure_mode":"{mode}","fallback":{{"max_keys":8,"instances":2}},
                "rules":[{{"name":"cc","kind":"concurrency","key":["literal:k"],"max_in_flight":4,"deadline_ms":5000}}]}}"#
        );
        Config::parse(json.as_bytes()).unwrap()
    };
    let wants = [Want {
        rule: 0,
        key: "cc|k".into(),
    }];
    let store = FakeStore::default();
    assert_eq!(
        resolve_slots(&slots_cfg("allow"), &wants, &store),
        SlotsVerdict::Open
    );
    assert_eq!(
        resolve_slots(&slots_cfg("deny"), &wants, &store),
        SlotsVerdict::Closed(vec![0])
    );
    // fallback: this proxy's share, 4 / 2 instances = 2 local slots, then full.
    let c = slots_cfg("fallback");
    crate::core::local::table::prepare(&store, crate::core::local::table::SLOTS_TABLE, 8, &[0; 8]);
    let first = resolve_slots(&c, &wants, &store);
    assert!(
        matches!(first, SlotsVerdict::Local(ref held) if held.len() == 1),
        "{first:?}"
    );
    assert!(matches!(
        resolve_slots(&c, &wants, &store),
        SlotsVerdict::Local(_)
    ));
    assert_eq!(
        resolve_slots(&c, &wants, &store),
        SlotsVerdict::LocalFull(0)
    );
    if let SlotsVerdict::Local(held) = first {
        slots::release_local(&store, &held);
    }
    assert!(
        matches!(resolve_slots(&c, &wants, &store), SlotsVerdict::Local(_)),
        "one given back"
    );
}
