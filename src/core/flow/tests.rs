//! The state machine's tests, over a recording fake host.

use super::*;
use crate::core::base::store::fake::FakeStore;

struct FakeHost {
    store: FakeStore,
    now: u64,
    dispatch_fails: bool,
    next_id: CalloutId,
    dispatched: u32,
    resumed: u32,
    replies: Vec<LocalReply>,
    counts: Vec<Decision>,
    failures: Vec<Cause>,
    events: Vec<Event>,
    leases: Vec<(Count, u64)>,
    sent: Vec<Plan>,
    rule_counts: Vec<(usize, RuleCount)>,
    refills: Vec<Plan>,
    given_back: Vec<TakeRequest>,
    acquires: Vec<Vec<u8>>,
    releases: Vec<Vec<u8>>,
    slot_counts: Vec<crate::core::inflight::Count>,
    late: Vec<u64>,
    decided_by: Vec<Cause>,
    places: Vec<u32>,
    shaped: Vec<Shaped>,
    applied: Applied,
}

impl Default for FakeHost {
    /// A host whose shared tables were prepared, as `on_configure` does.
    fn default() -> Self {
        let store = FakeStore::default();
        crate::core::local::fallback::prepare(&store, 10_000);
        crate::core::local::table::prepare(
            &store,
            crate::core::local::table::POOLS_TABLE,
            10_000,
            &[0],
        );
        FakeHost {
            store,
            now: 0,
            dispatch_fails: false,
            next_id: CalloutId(0),
            dispatched: 0,
            resumed: 0,
            replies: Vec::new(),
            counts: Vec::new(),
            failures: Vec::new(),
            events: Vec::new(),
            leases: Vec::new(),
            sent: Vec::new(),
            rule_counts: Vec::new(),
            refills: Vec::new(),
            given_back: Vec::new(),
            applied: Applied::default(),
            acquires: Vec::new(),
            releases: Vec::new(),
            slot_counts: Vec::new(),
            late: Vec::new(),
            decided_by: Vec::new(),
            places: Vec::new(),
            shaped: Vec::new(),
        }
    }
}

impl Host for FakeHost {
    type Store = FakeStore;
    fn store(&self) -> &FakeStore {
        &self.store
    }
    fn now_ms(&self) -> u64 {
        self.now
    }
    fn send(&mut self, _: &Config, out: Callout<'_>) -> Result<CalloutId, Unsent> {
        match out {
            Callout::Take(plan) => {
                self.sent.push(plan.clone());
                if self.dispatch_fails {
                    return Err("BadArgument".into());
                }
                self.dispatched += 1;
            }
            Callout::Refill(plan) => {
                if self.dispatch_fails {
                    return Err("BadArgument".into());
                }
                self.refills.push(plan.clone());
            }
            Callout::Refund(request) => self.given_back.push(request.clone()),
            Callout::Acquire(body) => {
                self.acquires.push(body);
                if self.dispatch_fails {
                    return Err("BadArgument".into());
                }
            }
            Callout::Release(body) => self.releases.push(body),
        }
        self.next_id.0 += 1;
        Ok(self.next_id)
    }
    fn resume(&mut self) {
        self.resumed += 1;
    }
    fn applied(&self) -> &Applied {
        &self.applied
    }
    fn reply(&mut self, reply: &LocalReply) {
        self.replies.push(reply.clone());
    }
    fn count(&mut self, metric: Metric) {
        match metric {
            Metric::Decision(d) => self.counts.push(d),
            Metric::Rule(rule, what) => self.rule_counts.push((rule, what)),
            Metric::Failure(c) => self.failures.push(c),
            Metric::FailureMode(c) => self.decided_by.push(c),
            Metric::Breaker(e) => self.events.push(e),
            Metric::Lease(c, n) => self.leases.push((c, n)),
            Metric::Slots(c) => self.slot_counts.push(c),
            Metric::Late { returned } => self.late.push(returned),
            Metric::Shape(s) => self.shaped.push(s),
        }
    }
    fn place(&mut self, rule: usize, max: u32) -> bool {
        if self.places.len() <= rule {
            self.places.resize(rule + 1, 0);
        }
        let free = self.places[rule] < max;
        if free {
            self.places[rule] += 1;
        }
        free
    }
    fn unplace(&mut self, rule: usize) {
        self.places[rule] -= 1;
    }
}

fn cfg(extra: &str) -> Config {
    let json = format!(
        r#"{{"service":{{"cluster":"svc"}},
             "rules":[{{"name":"r","match":{{"path_prefix":"/api"}},"key":["literal:k"],"capacity":2,"period_ms":60000}}],
             "breaker":{{"failures":2,"open_ms":100}} {extra}}}"#
    );
    Config::parse(json.as_bytes()).unwrap()
}

fn req(path: &str) -> Request {
    Request {
        headers: vec![(":path".into(), path.as_bytes().to_vec())],
        peer: None,
        properties: Vec::new(),
        ..Default::default()
    }
}

fn answer(allowed: bool) -> CalloutResult {
    let body = format!(
        r#"{{"allowed":{allowed},"buckets":[{{"allowed":{allowed},"limit":2,"remaining":0,"reset_ms":1000,"retry_after_ms":{}}}]}}"#,
        if allowed { 0 } else { 1000 }
    );
    CalloutResult::Http {
        status: Some(200),
        body: body.into_bytes(),
    }
}

#[test]
fn no_rule_no_callout_no_pause() {
    let (c, mut h, mut f) = (cfg(""), FakeHost::default(), Flow::default());
    assert_eq!(
        f.on_request_headers(&c, &req("/other"), &mut h),
        Next::Continue
    );
    assert_eq!(
        (h.dispatched, h.resumed, f.phase.clone()),
        (0, 0, Phase::Done)
    );
    assert!(h.counts.is_empty());
}

#[test]
fn pause_on_dispatch_then_resume_on_allowed() {
    let (c, mut h, mut f) = (cfg(""), FakeHost::default(), Flow::default());
    assert_eq!(f.on_request_headers(&c, &req("/api"), &mut h), Next::Pause);
    assert_eq!(
        f.on_request_data(),
        Next::Pause,
        "body waits for the decision"
    );
    assert!(f.waits_for(CalloutId(1)));
    f.on_callout_result(&c, CalloutId(1), answer(true), &mut h);
    assert_eq!((h.resumed, h.replies.len()), (1, 0));
    assert_eq!(h.counts, vec![Decision::Allowed]);
    assert_eq!(f.on_request_data(), Next::Continue);
    // A duplicate or stale reply changes nothing.
    f.on_callout_result(&c, CalloutId(1), answer(false), &mut h);
    assert_eq!((h.resumed, h.replies.len(), h.counts.len()), (1, 0, 1));
}

#[test]
fn limited_replies_without_resuming() {
    let (c, mut h, mut f) = (cfg(""), FakeHost::default(), Flow::default());
    f.on_request_headers(&c, &req("/api"), &mut h);
    f.on_callout_result(&c, CalloutId(2), answer(false), &mut h);
    assert!(f.waits_for(CalloutId(1)), "another token is not ours");
    f.on_callout_result(&c, CalloutId(1), answer(false), &mut h);
    assert_eq!((h.resumed, h.replies.len()), (0, 1));
    assert_eq!(h.replies[0].status, 429);
    assert_eq!(h.counts, vec![Decision::Limited]);
}

#[test]
fn dispatch_error_decides_synchronously_and_never_resumes() {
    let c = cfg(r#","failure_mode":"allow""#);
    let mut h = FakeHost {
        dispatch_fails: true,
        ..FakeHost::default()
    };
    let mut f = Flow::default();
    assert_eq!(
        f.on_request_headers(&c, &req("/api"), &mut h),
        Next::Continue
    );
    assert_eq!(h.resumed, 0, "never paused, so never resumed");
    assert_eq!(h.failures, vec![Cause::Dispatch]);
    assert_eq!(h.counts, vec![Decision::FailureOpenAllowed]);

    let c = cfg(r#","failure_mode":"deny""#);
    let mut f = Flow::default();
    assert_eq!(f.on_request_headers(&c, &req("/api"), &mut h), Next::Pause);
    assert_eq!((h.resumed, h.replies.len()), (0, 1));
}

fn granted(allowed: bool, remaining: u64, granted: u64) -> CalloutResult {
    let body = format!(
        r#"{{"allowed":{allowed},"buckets":[{{"allowed":{allowed},"limit":2,"remaining":{remaining},"reset_ms":1000,"retry_after_ms":0,"granted":{granted}}}]}}"#
    );
    CalloutResult::Http {
        status: Some(200),
        body: body.into_bytes(),
    }
}

/// The service did not answer in time (Envoy's 504 for a callout past its timeout).
fn timed_out() -> CalloutResult {
    CalloutResult::Http {
        status: Some(504),
        body: vec![],
    }
}

#[test]
fn the_fallback_continues_from_the_last_answer_and_its_debt_is_repaid() {
    // Capacity 2, no refill to speak of. The service said 1 left: the fallback admits 1, not 2.
    let c = cfg(r#","breaker":{"failures":0}"#);
    let mut h = FakeHost::default();
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/api"), &mut h);
    f.on_callout_result(&c, h.next_id, granted(true, 1, 1), &mut h);
    for _ in 0..2 {
        let mut f = Flow::default();
        f.on_request_headers(&c, &req("/api"), &mut h);
        f.on_callout_result(&c, h.next_id, timed_out(), &mut h);
    }
    assert_eq!(
        h.counts,
        vec![
            Decision::Allowed,
            Decision::FallbackAllowed,
            Decision::FallbackLimited
        ]
    );
    // The service is back: the next callout carries the one token admitted on credit.
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/api"), &mut h);
    let sent = h.sent.last().unwrap();
    assert_eq!(sent.request.buckets[0].lease, Some(2), "cost 1 + debt 1");
    assert_eq!(sent.debt, vec![1]);
    f.on_callout_result(&c, h.next_id, granted(true, 0, 2), &mut h);
    assert_eq!(
        h.counts.last(),
        Some(&Decision::Allowed),
        "cost and debt covered"
    );
    // Repaid: the following callout asks for its cost only.
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/api"), &mut h);
    assert_eq!(h.sent.last().unwrap().request.buckets[0].lease, None);
    assert_eq!(h.sent.last().unwrap().debt, Vec::<u64>::new());
}

#[test]
fn a_grant_short_of_the_debt_repays_first_and_denies() {
    let c = cfg(r#","breaker":{"failures":0}"#);
    let mut h = FakeHost::default();
    // Two admitted on credit (capacity 2, a vacant share starts full).
    for _ in 0..2 {
        let mut f = Flow::default();
        f.on_request_headers(&c, &req("/api"), &mut h);
        f.on_callout_result(&c, h.next_id, timed_out(), &mut h);
    }
    // The service has 1 token: it grants 1 of the 3 asked (cost 1 + debt 2) and allows.
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/api"), &mut h);
    assert_eq!(h.sent.last().unwrap().request.buckets[0].lease, Some(3));
    f.on_callout_result(&c, h.next_id, granted(true, 0, 1), &mut h);
    assert_eq!(h.counts.last(), Some(&Decision::Limited), "debt first");
    assert_eq!(h.replies.last().unwrap().status, 429);
    // One of the two owed was repaid; the next callout carries the other.
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/api"), &mut h);
    assert_eq!(h.sent.last().unwrap().request.buckets[0].lease, Some(2));
}

#[test]
fn a_denial_by_shadow_rules_alone_asks_again_for_the_enforced_ones() {
    let c = Config::parse(
        br#"{"service":{"cluster":"svc"},"rules":[
            {"name":"enforced","key":["literal:a"],"capacity":2,"period_ms":60000},
            {"name":"trial","key":["literal:b"],"capacity":1,"period_ms":60000,"shadow":true}]}"#,
    )
    .unwrap();
    let mut h = FakeHost::default();
    let mut f = Flow::default();
    assert_eq!(f.on_request_headers(&c, &req("/"), &mut h), Next::Pause);
    assert_eq!(h.sent[0].request.buckets.len(), 2);
    let body = br#"{"allowed":false,"buckets":[
        {"allowed":true,"limit":2,"remaining":1,"reset_ms":1,"retry_after_ms":0},
        {"allowed":false,"limit":1,"remaining":0,"reset_ms":1,"retry_after_ms":5}]}"#;
    f.on_callout_result(
        &c,
        h.next_id,
        CalloutResult::Http {
            status: Some(200),
            body: body.to_vec(),
        },
        &mut h,
    );
    assert_eq!(h.dispatched, 2, "asked again");
    assert_eq!(h.sent[1].request.buckets.len(), 1);
    assert_eq!(h.sent[1].rules, vec![0]);
    assert!(h.counts.is_empty() && h.resumed == 0, "not decided yet");
    let body = br#"{"allowed":true,"buckets":[{"allowed":true,"limit":2,"remaining":1,"reset_ms":1,"retry_after_ms":0}]}"#;
    f.on_callout_result(
        &c,
        h.next_id,
        CalloutResult::Http {
            status: Some(200),
            body: body.to_vec(),
        },
        &mut h,
    );
    assert_eq!((h.resumed, h.replies.len()), (1, 0));
    assert_eq!(h.counts, vec![Decision::Allowed]);
    assert_eq!(
        h.rule_counts,
        vec![(0, RuleCount::Allowed), (1, RuleCount::ShadowLimited)]
    );
}

#[test]
fn a_denied_callout_keeps_the_debt_for_the_next() {
    let c = cfg(r#","breaker":{"failures":0}"#);
    let mut h = FakeHost::default();
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/api"), &mut h);
    f.on_callout_result(
        &c,
        h.next_id,
        CalloutResult::Http {
            status: None,
            body: vec![],
        },
        &mut h,
    );
    assert_eq!(h.counts, vec![Decision::FallbackAllowed]);
    for round in 0..2 {
        let mut f = Flow::default();
        assert_eq!(f.on_request_headers(&c, &req("/api"), &mut h), Next::Pause);
        assert_eq!(h.dispatched, round + 2);
        assert_eq!(h.sent.last().unwrap().request.buckets[0].lease, Some(2));
        f.on_callout_result(&c, h.next_id, answer(false), &mut h);
        // Past the denial's retry_after (1 s): the next request asks again.
        h.now += 1000;
    }
}

#[test]
fn a_denial_carrying_a_debt_is_remembered_and_one_the_debt_caused_is_not() {
    let c = cfg(r#","breaker":{"failures":0}"#);
    let mut h = FakeHost::default();
    // One admitted on credit: the callouts after it carry the debt (lease 2 = cost 1 + 1).
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/api"), &mut h);
    f.on_callout_result(&c, h.next_id, timed_out(), &mut h);
    assert_eq!(h.counts, vec![Decision::FallbackAllowed]);
    // The service denies (the bucket cannot pay the cost): remembered for a second.
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/api"), &mut h);
    assert_eq!(h.sent.last().unwrap().request.buckets[0].lease, Some(2));
    f.on_callout_result(&c, h.next_id, answer(false), &mut h);
    assert_eq!(h.dispatched, 2);
    // A flood meanwhile is answered here, the debt still owed.
    for n in 0..3 {
        let replied = h.replies.len();
        let mut f = Flow::default();
        f.on_request_headers(&c, &req("/api"), &mut h);
        assert_eq!(h.replies.len(), replied + 1, "request {n} answered at once");
        assert_eq!(h.replies.last().unwrap().status, 429);
    }
    assert_eq!(h.dispatched, 2, "no callout while the denial holds");
    // Past it, the service admits with a grant short of the debt: denied here, debt first,
    // and that denial is not remembered: the next request asks (and repays) again.
    h.now += 1000;
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/api"), &mut h);
    f.on_callout_result(&c, h.next_id, granted(true, 0, 1), &mut h);
    assert_eq!(h.counts.last(), Some(&Decision::Limited), "debt first");
    let mut f = Flow::default();
    assert_eq!(f.on_request_headers(&c, &req("/api"), &mut h), Next::Pause);
    assert_eq!(h.dispatched, 4);
}

#[test]
fn every_failure_goes_through_the_failure_mode_and_the_breaker() {
    let c = cfg("");
    let mut h = FakeHost::default();
    let failures = [
        CalloutResult::Http {
            status: Some(504),
            body: vec![],
        },
        CalloutResult::Http {
            status: None,
            body: vec![],
        },
    ];
    for (i, r) in failures.into_iter().enumerate() {
        let mut f = Flow::default();
        assert_eq!(
            f.on_request_headers(&c, &req("/api"), &mut h),
            Next::Pause,
            "request {i}"
        );
        f.on_callout_result(&c, h.next_id, r, &mut h);
    }
    assert_eq!(h.failures, vec![Cause::Timeout, Cause::Reset]);
    assert_eq!(
        h.counts,
        vec![Decision::FallbackAllowed, Decision::FallbackAllowed]
    );
    assert_eq!(h.resumed, 2);
    assert_eq!(h.events, vec![Event::Opened]);
    // Open: no callout, the failure mode decides synchronously (fallback bucket now empty).
    let mut f = Flow::default();
    assert_eq!(f.on_request_headers(&c, &req("/api"), &mut h), Next::Pause);
    assert_eq!(h.dispatched, 2);
    assert_eq!(h.counts.last(), Some(&Decision::FallbackLimited));
    assert_eq!(h.replies.len(), 1);
    // After the interval one request probes; its success closes the breaker.
    h.now = 100;
    let mut probe = Flow::default();
    assert_eq!(
        probe.on_request_headers(&c, &req("/api"), &mut h),
        Next::Pause
    );
    let mut other = Flow::default();
    other.on_request_headers(&c, &req("/api"), &mut h);
    assert_eq!(h.dispatched, 3, "only the probe calls");
    probe.on_callout_result(&c, CalloutId(3), answer(true), &mut h);
    assert_eq!(h.events, vec![Event::Opened, Event::Closed]);
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/api"), &mut h);
    assert_eq!(h.dispatched, 4, "closed: calls again");
}

#[test]
fn shadow_resumes_instead_of_denying() {
    let (c, mut h, mut f) = (
        cfg(r#","shadow":true"#),
        FakeHost::default(),
        Flow::default(),
    );
    f.on_request_headers(&c, &req("/api"), &mut h);
    f.on_callout_result(&c, CalloutId(1), answer(false), &mut h);
    assert_eq!((h.resumed, h.replies.len()), (1, 0));
    assert_eq!(h.counts, vec![Decision::ShadowLimited]);
}

fn lease_cfg(extra: &str) -> Config {
    let json = format!(
        r#"{{"service":{{"cluster":"svc"}},
             "rules":[{{"name":"r","key":["literal:k"],"capacity":100,"period_ms":60000,
                        "lease":{{"size":8,"max_age_ms":1000}}}}] {extra}}}"#
    );
    Config::parse(json.as_bytes()).unwrap()
}

fn lease_answer(allowed: bool, granted: u64, retry: u64) -> CalloutResult {
    let body = format!(
        r#"{{"allowed":{allowed},"buckets":[{{"allowed":{allowed},"limit":100,"remaining":40,"reset_ms":1000,"retry_after_ms":{retry},"granted":{granted}}}]}}"#
    );
    CalloutResult::Http {
        status: Some(200),
        body: body.into_bytes(),
    }
}

#[test]
fn lease_pool_admits_without_a_callout_or_a_pause() {
    let c = lease_cfg(r#","response":{"on_allowed":true}"#);
    let mut h = FakeHost::default();
    let mut f = Flow::default();
    assert_eq!(f.on_request_headers(&c, &req("/"), &mut h), Next::Pause);
    assert_eq!(h.sent[0].request.buckets[0].lease, Some(8));
    f.on_callout_result(&c, CalloutId(1), lease_answer(true, 8, 0), &mut h);
    assert_eq!(h.leases, vec![(Count::Granted, 8)]);
    // 7 in the pool; 5 can be spent before the refill mark (8 / 4 = 2).
    for i in 0..5 {
        let mut f = Flow::default();
        assert_eq!(
            f.on_request_headers(&c, &req("/"), &mut h),
            Next::Continue,
            "request {i}"
        );
        assert_eq!(f.phase, Phase::Done);
        assert!(
            f.response_headers
                .iter()
                .any(|(k, v)| k == "ratelimit" && v == &format!("\"r\";r={};t=1", 46 - i)),
            "pool + last global remaining: {:?}",
            f.response_headers
        );
    }
    assert_eq!(
        (h.dispatched, h.resumed),
        (1, 1),
        "no more callouts, nothing resumed"
    );
    assert_eq!(
        h.counts,
        vec![Decision::Allowed; 6],
        "every decision counts"
    );
    assert_eq!(
        h.leases.iter().filter(|(c, _)| *c == Count::Local).count(),
        5
    );
    // The sixth leaves 1, below the mark: admitted at once, and a background refill of 8 - 1
    // goes out; no request waits for it.
    let mut f = Flow::default();
    assert_eq!(f.on_request_headers(&c, &req("/"), &mut h), Next::Continue);
    assert_eq!(h.dispatched, 1);
    assert_eq!(h.refills.len(), 1);
    assert_eq!(h.refills[0].request.buckets[0].lease, Some(7));
    assert!(h.leases.contains(&(Count::Refills, 1)));
    // The last token is spent meanwhile, without a second refill.
    let mut f = Flow::default();
    assert_eq!(f.on_request_headers(&c, &req("/"), &mut h), Next::Continue);
    assert_eq!(h.refills.len(), 1);
    // Pool empty, refill in flight: the next request waits for a callout of its own cost.
    let mut plain = Flow::default();
    assert_eq!(plain.on_request_headers(&c, &req("/"), &mut h), Next::Pause);
    assert_eq!(h.sent[1].request.buckets[0].lease, None);
    // The refill's answer fills the pool: local again.
    let refill = h.refills[0].clone();
    let watched = on_refill_result(&c, &refill, lease_answer(true, 7, 0), &mut h);
    assert_eq!(h.leases.last(), Some(&(Count::Granted, 7)));
    assert_eq!(
        watched.len(),
        1,
        "the pool it filled is watched from then on"
    );
    let mut f = Flow::default();
    assert_eq!(f.on_request_headers(&c, &req("/"), &mut h), Next::Continue);
    assert_eq!(h.dispatched, 2);
}

#[test]
fn lease_denial_is_cached_until_retry_after_at_most_remember_denials_ms() {
    let c = lease_cfg("");
    let mut h = FakeHost::default();
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/"), &mut h);
    f.on_callout_result(&c, CalloutId(1), lease_answer(false, 0, 2500), &mut h);
    assert_eq!(h.counts, vec![Decision::Limited]);
    h.now = 500;
    let mut f = Flow::default();
    assert_eq!(f.on_request_headers(&c, &req("/"), &mut h), Next::Pause);
    assert_eq!(h.dispatched, 1, "denied locally");
    assert_eq!(h.replies.len(), 2);
    assert!(h.replies[1]
        .headers
        .contains(&("retry-after".to_string(), "2".to_string())));
    assert_eq!(h.counts, vec![Decision::Limited; 2]);
    assert_eq!(h.leases, vec![(Count::LocalLimited, 1)]);
    // remember_denials_ms (1 s by default) caps it, though the service said 2.5 s.
    h.now = 1000;
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/"), &mut h);
    assert_eq!(h.dispatched, 2, "asks again after remember_denials_ms");
}

#[test]
fn lease_failure_goes_to_the_failure_mode_and_the_pool_stays_spendable() {
    let c = lease_cfg(r#","failure_mode":"deny""#);
    let mut h = FakeHost::default();
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/"), &mut h);
    f.on_callout_result(&c, CalloutId(1), lease_answer(true, 8, 0), &mut h);
    // 6 spent locally, the sixth starting a background refill, which fails.
    for _ in 0..6 {
        let mut f = Flow::default();
        assert_eq!(f.on_request_headers(&c, &req("/"), &mut h), Next::Continue);
    }
    let refill = h.refills[0].clone();
    let timeout = CalloutResult::Http {
        status: Some(504),
        body: vec![],
    };
    let watched = on_refill_result(&c, &refill, timeout, &mut h);
    assert!(watched.is_empty(), "nothing was deposited");
    assert_eq!(h.failures, vec![Cause::Timeout]);
    assert_eq!(h.replies.len(), 0, "no request waited for it");
    // Its claim ended: the last token is spent and claims the refill again.
    let mut f = Flow::default();
    assert_eq!(f.on_request_headers(&c, &req("/"), &mut h), Next::Continue);
    assert_eq!(h.refills.len(), 2);
    // The pool is empty: a request waits for its own callout, which fails: the failure mode.
    let mut f = Flow::default();
    assert_eq!(f.on_request_headers(&c, &req("/"), &mut h), Next::Pause);
    f.on_callout_result(
        &c,
        h.next_id,
        CalloutResult::Http {
            status: None,
            body: vec![],
        },
        &mut h,
    );
    assert_eq!(h.counts.last(), Some(&Decision::FailureClosedLimited));
    assert_eq!(h.replies.len(), 1);
    // With the breaker refusing, the claim is released as well.
    let c = lease_cfg(r#","failure_mode":"allow","breaker":{"failures":1,"open_ms":100}"#);
    let mut h = FakeHost {
        dispatch_fails: true,
        ..FakeHost::default()
    };
    Flow::default().on_request_headers(&c, &req("/"), &mut h);
    assert_eq!(h.events, vec![Event::Opened]);
    Flow::default().on_request_headers(&c, &req("/"), &mut h);
    assert_eq!(h.sent.len(), 1, "breaker open: no dispatch");
    assert_eq!(h.counts, vec![Decision::FailureOpenAllowed; 2]);
    h.now = 100;
    h.dispatch_fails = false;
    Flow::default().on_request_headers(&c, &req("/"), &mut h);
    assert_eq!(
        h.sent[1].request.buckets[0].lease,
        Some(8),
        "the probe refills"
    );
}

#[test]
fn a_late_answer_gives_back_what_it_granted_to_token_buckets_only() {
    use crate::core::config::Algorithm;
    use crate::core::wire::{Bucket, BucketResult, TakeResponse};
    let c = cfg("");
    let bucket = |key: &str, algorithm: Option<Algorithm>| Bucket {
        key: key.into(),
        capacity: 10,
        rate: None,
        period_ms: 1000,
        cost: Some(2),
        algorithm,
        lease: Some(8),
        max_delay_ms: 0,
        calendar: None,
    };
    let take = |buckets: Vec<Bucket>| Some(TakeRequest { buckets });
    let result = |allowed: bool, granted: &[u64]| TakeResponse {
        allowed,
        buckets: granted
            .iter()
            .map(|&g| BucketResult {
                allowed,
                granted: g,
                ..Default::default()
            })
            .collect(),
        instances: 0,
        delay_ms: 0,
    };
    let takes = vec![
        // Granted 8 on a token bucket and 2 on a fixed window (which cannot be given back).
        take(vec![
            bucket("a", None),
            bucket("w", Some(Algorithm::FixedWindow)),
        ]),
        // A request that had gone: its grant cannot be told apart, and is not sent back.
        None,
        // The same token bucket again, from an older service that reports no grant: its cost.
        take(vec![bucket("a", None)]),
        // Denied: nothing was charged.
        take(vec![bucket("b", None)]),
    ];
    let answers = CalloutResult::Answers(vec![
        result(true, &[8, 2]),
        result(true, &[5]),
        result(true, &[0]),
        result(false, &[0]),
    ]);
    let mut h = FakeHost::default();
    late_answer(&c, &takes, answers, &mut h);
    assert_eq!(h.late, vec![8 + 2]);
    assert_eq!(h.given_back.len(), 1, "one refund");
    let b = &h.given_back[0].buckets;
    assert_eq!(b.len(), 1, "a's two grants in one bucket: {b:?}");
    assert_eq!(
        (b[0].key.as_str(), b[0].cost, b[0].lease),
        ("a", Some(10), None)
    );
    // A late error, or answers that do not match the takes: counted, nothing sent.
    let mut h = FakeHost::default();
    late_answer(&c, &takes, CalloutResult::Expired, &mut h);
    late_answer(&c, &takes, CalloutResult::Answers(Vec::new()), &mut h);
    assert_eq!((h.late, h.given_back.len()), (vec![0, 0], 0));
}

/// The global bucket as the service keeps it, for tests of a fleet: whole tokens refilled
/// at `per_ms`, up to `cap`, and a take with the contract's lease semantics (granted: the
/// lease, or what is held, from the cost up).
struct Global {
    level: f64,
    at: u64,
    cap: f64,
    per_ms: f64,
    /// What each take was granted.
    grants: Vec<u64>,
}

impl Global {
    fn answer(&mut self, plan: &Plan, now: u64) -> CalloutResult {
        self.level = (self.level + (now - self.at) as f64 * self.per_ms).min(self.cap);
        self.at = now;
        let b = &plan.request.buckets[0];
        let cost = b.cost();
        let whole = self.level.floor() as u64;
        let g = match whole >= cost {
            true => b.lease.unwrap_or(cost).min(whole),
            false => 0,
        };
        self.grants.push(g);
        self.level -= g as f64;
        granted(g > 0, whole - g, g)
    }

    /// Tokens given back (`POST /v1/refund`).
    fn refund(&mut self, back: &[TakeRequest]) {
        for r in back {
            self.level += r.buckets.iter().map(|b| b.cost()).sum::<u64>() as f64;
        }
    }
}

/// One request through `h` at `now`: answered by `global`, or timed out when it is `None`.
/// Its decision.
fn one(c: &Config, h: &mut FakeHost, mut global: Option<&mut Global>, now: u64) -> Decision {
    h.now = now;
    let mut f = Flow::default();
    f.on_request_headers(c, &req("/api"), h);
    if matches!(f.phase, Phase::Calling { .. }) {
        let plan = h.sent.last().cloned().unwrap();
        let result = match &mut global {
            Some(g) => g.answer(&plan, now),
            None => timed_out(),
        };
        f.on_callout_result(c, h.next_id, result, h);
    }
    if let Some(g) = global {
        g.refund(&std::mem::take(&mut h.given_back));
    }
    *h.counts.last().unwrap()
}

#[test]
fn a_proxy_back_first_does_not_spend_what_the_others_owe() {
    // Two proxies, one key of capacity 10 refilling 1 a second, drained when the service
    // stops answering; the breaker opens at the first failure and probes 5 s later.
    let c = Config::parse(
        br#"{"service":{"cluster":"svc"},"fallback":{"instances":2},
             "rules":[{"name":"r","key":["literal:k"],"capacity":10,"rate":1,"period_ms":1000}],
             "breaker":{"failures":1,"open_ms":5000,"max_open_ms":5000}}"#,
    )
    .unwrap();
    let mut g = Global {
        level: 0.0,
        at: 0,
        cap: 10.0,
        per_ms: 0.001,
        grants: Vec::new(),
    };
    let (mut a, mut b) = (FakeHost::default(), FakeHost::default());
    let admitted = |h: &FakeHost| {
        h.counts
            .iter()
            .filter(|d| matches!(d, Decision::Allowed | Decision::FallbackAllowed))
            .count()
    };
    // Both asking: the bucket is empty, so are their shares.
    for h in [&mut a, &mut b] {
        assert_eq!(one(&c, h, Some(&mut g), 0), Decision::Limited);
    }
    // The outage: both fall back, each admitting its share's refill (half a token a second)
    // on credit: 2 each by 5 s, the 4 tokens the bucket gathers meanwhile (5 by then).
    for now in (10..5_000).step_by(100) {
        for h in [&mut a, &mut b] {
            one(&c, h, None, now);
        }
    }
    assert_eq!((admitted(&a), admitted(&b)), (2, 2));
    // The service is back. A probes first and repays its 2 (3 granted with its cost); then
    // A's next requests, then B's probe with its debt.
    one(&c, &mut a, Some(&mut g), 5_020);
    assert_eq!(a.sent.last().unwrap().debt, vec![2]);
    for now in [5_030, 5_040, 5_050] {
        one(&c, &mut a, Some(&mut g), now);
    }
    one(&c, &mut b, Some(&mut g), 5_060);
    assert_eq!(b.sent.last().unwrap().debt, vec![2]);
    // Never more than the bucket held and gathered: 5 tokens by 5.06 s. A proxy that spent
    // the refill B's debt needed, once its own was repaid, had 7 admitted.
    let total = admitted(&a) + admitted(&b);
    assert!(total <= 5, "{total} admitted, the bucket had 5");
    assert_eq!(
        g.grants.last(),
        Some(&3),
        "B repaid its whole debt with its cost"
    );
    // A's probe was admitted by the service, not by its share (half a token): denied, and
    // its cost given back to the bucket for B's debt. A's next requests, in recovery, were
    // denied by the share without a callout.
    assert_eq!(a.counts[a.counts.len() - 4], Decision::FallbackLimited);
    assert_eq!(
        a.sent.len(),
        3,
        "asked at 0, 10 and the probe; then decided locally"
    );
    // Past the recovery (`breaker.max_open_ms` after the last refusal) the service decides
    // alone again.
    assert_eq!(one(&c, &mut a, Some(&mut g), 11_000), Decision::Allowed);
}

fn shaped_cfg(max_held: u32) -> Config {
    let json = format!(
        r#"{{"service":{{"cluster":"svc"}},
             "rules":[{{"name":"r","match":{{"path_prefix":"/api"}},"key":["literal:k"],"capacity":2,"period_ms":1000,
                        "shape":{{"max_delay_ms":500,"max_held":{max_held}}}}}]}}"#
    );
    Config::parse(json.as_bytes()).unwrap()
}

/// A shaped grant: allowed, its tokens there in `delay_ms`.
fn later(delay_ms: u64) -> CalloutResult {
    let body = format!(
        r#"{{"allowed":true,"buckets":[{{"allowed":true,"limit":2,"remaining":0,"reset_ms":1000,"retry_after_ms":0,"granted":1,"delay_ms":{delay_ms}}}],"delay_ms":{delay_ms}}}"#
    );
    CalloutResult::Http {
        status: Some(200),
        body: body.into_bytes(),
    }
}

#[test]
fn a_grant_for_later_is_held_until_then_and_told_to_the_client() {
    let c = shaped_cfg(8);
    let (mut h, mut f) = (FakeHost::default(), Flow::default());
    h.now = 1000;
    assert_eq!(f.on_request_headers(&c, &req("/api"), &mut h), Next::Pause);
    assert_eq!(
        h.sent[0].request.buckets[0].max_delay_ms, 500,
        "the take asks for a grant up to max_delay_ms ahead"
    );
    assert_eq!(h.places, vec![1]);
    f.on_callout_result(&c, h.next_id, later(120), &mut h);
    assert_eq!(f.held_until(), Some(1120));
    assert_eq!(h.resumed, 0, "held, not let through");
    assert_eq!(f.on_request_data(), Next::Pause, "its body waits too");
    assert_eq!(h.counts, vec![Decision::Allowed]);
    assert_eq!(h.shaped, vec![Shaped::Held]);
    h.now = 1125;
    f.on_release(&c, &mut h);
    assert_eq!(
        (h.resumed, h.places[0]),
        (1, 0),
        "let through, its place back"
    );
    assert!(f
        .response_headers
        .contains(&(HELD_HEADER.to_string(), "125".to_string())));
    assert_eq!(f.on_end(&c, &mut h), vec![]);
    assert!(
        h.given_back.is_empty(),
        "it went through: nothing to give back"
    );
}

#[test]
fn a_held_request_whose_client_leaves_gives_its_tokens_back() {
    let c = shaped_cfg(8);
    let (mut h, mut f) = (FakeHost::default(), Flow::default());
    f.on_request_headers(&c, &req("/api"), &mut h);
    f.on_callout_result(&c, h.next_id, later(300), &mut h);
    assert!(f.held_until().is_some());
    h.now = 100;
    assert_eq!(f.on_end(&c, &mut h), vec![]);
    assert_eq!(h.given_back.len(), 1, "its cost refunded");
    assert_eq!(h.given_back[0].buckets[0].cost, Some(1));
    assert_eq!(h.given_back[0].buckets[0].max_delay_ms, 0);
    assert_eq!(h.places[0], 0);
    assert_eq!(h.shaped, vec![Shaped::Held, Shaped::Left { returned: 1 }]);
    f.on_release(&c, &mut h);
    assert_eq!(h.resumed, 0, "a request gone is never resumed");
}

#[test]
fn without_a_place_a_take_is_asked_for_unshaped_and_places_come_back_whatever_the_answer() {
    let c = shaped_cfg(1);
    let mut h = FakeHost::default();
    let mut first = Flow::default();
    first.on_request_headers(&c, &req("/api"), &mut h);
    let first_id = h.next_id;
    let mut second = Flow::default();
    second.on_request_headers(&c, &req("/api"), &mut h);
    assert_eq!(
        h.sent[1].request.buckets[0].max_delay_ms, 0,
        "no place left"
    );
    assert_eq!(h.shaped, vec![Shaped::Full]);
    first.on_callout_result(&c, first_id, answer(true), &mut h);
    assert_eq!(h.places[0], 0, "an answer for now gives the place back");
    // A request gone while its take was out gives its place back too.
    let mut f = Flow::default();
    f.on_request_headers(&c, &req("/api"), &mut h);
    assert_eq!(h.places[0], 1);
    f.on_end(&c, &mut h);
    assert_eq!(h.places[0], 0);
    // A failure, a denial: neither holds, and the place comes back.
    for result in [timed_out(), answer(false)] {
        let mut f = Flow::default();
        f.on_request_headers(&c, &req("/api"), &mut h);
        assert_eq!(h.places[0], 1);
        f.on_callout_result(&c, h.next_id, result, &mut h);
        assert_eq!((f.held_until(), h.places[0]), (None, 0));
    }
}
