//! The fallback shares' tests.

use super::*;
use crate::core::base::store::fake::FakeStore;
use crate::core::config::Algorithm;
use crate::core::wire::Bucket;

fn tb(cap: u64) -> Limits {
    Limits::local(cap, cap, 1000, Algorithm::TokenBucket, 1)
}

fn sh(max_keys: u32) -> Shares {
    Shares {
        max_keys,
        instances: 1,
        horizon_ms: 60_000,
        previous: [0; 3],
    }
}

fn prepared(max_keys: u32) -> FakeStore {
    let s = FakeStore::default();
    prepare(&s, max_keys);
    s
}

fn bucket(key: &str, cap: u64) -> Bucket {
    Bucket {
        key: key.into(),
        capacity: cap,
        rate: Some(cap),
        period_ms: 1000,
        cost: Some(1),
        algorithm: Some(Algorithm::TokenBucket),
        lease: None,
        max_delay_ms: 0,
        calendar: None,
    }
}

#[test]
fn an_overshoot_drains_the_share_and_is_not_owed_twice() {
    let s = prepared(100);
    let cfg = Config::parse(
        br#"{"service":{"cluster":"c"},"fallback":{"instances":1,"max_keys":100},
            "rules":[{"name":"r","capacity":100,"period_ms":1000}]}"#,
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    let item = |key: &str, estimate, used| settle::Item {
        bucket: bucket(key, 100),
        rule: "r".into(),
        estimate,
        used,
        window: None,
    };
    // Held 100 (never seen: a full share), then a response used 70 beyond its reservation.
    spend_extras(&cfg, [0; 3], &s, &[item("a", 10, 80), item("b", 50, 20)], 0);
    let l = tb(100);
    assert!(take(&s, &sh(100), "a", &l, 0, 30).allowed);
    assert!(!take(&s, &sh(100), "a", &l, 0, 1).allowed, "30 were left");
    // Owed: only what the fallback itself admitted (the settlement charges the rest).
    assert_eq!(owed(&s, &sh(100), "a", &l, 0), 30);
    // A refund drains nothing.
    assert!(take(&s, &sh(100), "b", &l, 0, 100).allowed);
    // More than it holds empties it, no further.
    spend_extras(&cfg, [0; 3], &s, &[item("a", 0, 1_000_000)], 500);
    assert!(!take(&s, &sh(100), "a", &l, 500, 1).allowed);
    assert!(
        take(&s, &sh(100), "a", &l, 510, 1).allowed,
        "it refills from empty"
    );
}

#[test]
fn shared_across_callers_and_bounded() {
    let s = prepared(100);
    for i in 0..3 {
        let r = take(&s, &sh(100), "k", &tb(3), 0, 1);
        assert!(r.allowed, "take {i}");
    }
    assert!(!take(&s, &sh(100), "k", &tb(3), 0, 1).allowed);
    for i in 0..1000 {
        take(&s, &sh(100), &format!("key{i}"), &tb(3), 0, 1);
    }
    let map = s.map.borrow();
    assert!(map.len() <= 101, "{} entries", map.len());
    assert!(map
        .iter()
        .filter(|(k, _)| !k.ends_with(".ready"))
        .all(|(_, (v, _))| v.len() == SLOT_BYTES));
}

#[test]
fn a_successor_starts_empty_and_a_debtor_keeps_its_slot() {
    let (s, t) = (prepared(1), sh(1));
    // One slot: every key collides. `a` starts full (vacant slot) and owes what it admits.
    assert!(take(&s, &t, "a", &tb(1), 0, 1).allowed);
    assert!(
        !take(&s, &t, "b", &tb(1), 0, 1).allowed,
        "a owes: b gets nothing"
    );
    assert_eq!(owed(&s, &t, "a", &tb(1), 0), 1);
    // a's debt is repaid by an answer: b may now take the slot over, but starts empty.
    remember_one(&s, &t, "a", &tb(1), 0, 0, 1);
    assert_eq!(owed(&s, &t, "a", &tb(1), 0), 0);
    assert!(!take(&s, &t, "b", &tb(1), 0, 1).allowed, "b starts empty");
    assert!(
        take(&s, &t, "b", &tb(1), 1000, 1).allowed,
        "b refills at its rate"
    );
    // a comes back: b owes now, so a gets nothing; once b's debt lapses a starts empty.
    assert!(!take(&s, &t, "a", &tb(1), 1000, 1).allowed);
    assert_eq!(owed(&s, &t, "b", &tb(1), 61_001), 0, "past the horizon");
    assert!(
        !take(&s, &t, "a", &tb(1), 61_001, 1).allowed,
        "a starts empty"
    );
    assert!(take(&s, &t, "a", &tb(1), 62_001, 1).allowed);
}

#[test]
fn a_changed_limit_keeps_the_share() {
    // Limits and the number of proxies are not part of the identity.
    let m = Memos::default();
    assert_eq!(slot(&m, "k", &tb(1), 9).id, slot(&m, "k", &tb(2), 9).id);
    let fw = Limits::local(1, 1, 1000, Algorithm::FixedWindow, 1);
    assert_ne!(slot(&m, "k", &tb(1), 9).id, slot(&m, "k", &fw, 9).id);
    let (s, t) = (prepared(10), sh(10));
    let per_hour = |cap| Limits::local(cap, cap, 3_600_000, Algorithm::TokenBucket, 1);
    for _ in 0..40 {
        assert!(take(&s, &t, "k", &per_hour(100), 0, 1).allowed);
    }
    // 100 -> 50: 60 % held is 30 tokens, not a fresh 50; the debt is kept.
    let admitted = (0..50)
        .filter(|_| take(&s, &t, "k", &per_hour(50), 0, 1).allowed)
        .count();
    assert_eq!(admitted, 30);
    assert_eq!(owed(&s, &t, "k", &per_hour(50), 0), 70);
}

#[test]
fn a_push_that_resizes_the_table_keeps_shares_and_debts() {
    let s = FakeStore::default();
    let hourly = Limits::local(20, 20, 3_600_000, Algorithm::TokenBucket, 1);
    // 64 slots: 15 of 20 taken on credit.
    prepare(&s, 64);
    assert_eq!(record_size(&s, 64), [0; 3], "the first configuration");
    let small = sh(64);
    for _ in 0..15 {
        assert!(take(&s, &small, "k", &hourly, 0, 1).allowed);
    }
    // The push: 100 slots. The bucket's slot in the new table was never written: its record
    // is carried over from the old table, share and debt, and written to the new one.
    prepare(&s, 100);
    let previous = record_size(&s, 100);
    assert_eq!(previous, [64, 0, 0]);
    assert_eq!(
        record_size(&s, 100),
        [64, 0, 0],
        "a second VM of the same push"
    );
    let big = Shares {
        previous,
        ..sh(100)
    };
    assert_eq!(owed(&s, &big, "k", &hourly, 0), 15);
    let admitted = (0..20)
        .filter(|_| take(&s, &big, "k", &hourly, 0, 1).allowed)
        .count();
    assert_eq!(admitted, 5, "what was left, not a fresh 20");
    assert_eq!(owed(&s, &big, "k", &hourly, 0), 20);
    // Without the earlier size, the same push would start the bucket full.
    let forgetful = sh(100);
    assert_eq!(owed(&s, &forgetful, "k2", &hourly, 0), 0);
    // Back to 64: the newest size first, and the old table still holds what it held.
    assert_eq!(record_size(&s, 64), [100, 0, 0]);
}

#[test]
fn more_proxies_shrink_the_share() {
    let (s, t) = (prepared(10), sh(10));
    let of = |n| Limits::local(100, 100, 3_600_000, Algorithm::TokenBucket, n);
    // 4 proxies, 40 left: a share of 10 of 25. 8 proxies: 10 * 12 / 25 = 4.8, 4 whole tokens.
    remember_one(&s, &t, "k", &of(4), 0, 40, 0);
    let admitted = (0..20)
        .filter(|_| take(&s, &t, "k", &of(8), 0, 1).allowed)
        .count();
    assert_eq!(admitted, 4);
    // A full share stays full, at the new size (12 of 100 / 8).
    remember_one(&s, &t, "j", &of(4), 0, 100, 0);
    remember_one(&s, &t, "j", &of(4), 0, 99, 0);
    let admitted = (0..20)
        .filter(|_| take(&s, &t, "j", &of(8), 0, 1).allowed)
        .count();
    assert_eq!(admitted, 12 * 24 / 25);
}

#[test]
fn the_split_follows_the_instances_heard() {
    let cfg = Config::parse(
        br#"{"service":{"cluster":"c"},"fallback":{"instances":4,"min_instances":2,"max_keys":10},
             "rules":[{"name":"a","capacity":100,"period_ms":3600000}]}"#,
    )
    .unwrap();
    let s = prepared(10);
    let req = TakeRequest {
        buckets: vec![Bucket {
            period_ms: 3_600_000,
            ..bucket("k", 100)
        }],
    };
    let admitted = |s: &FakeStore| {
        (0..100)
            .filter(|_| take_all(s, &Shares::of(&cfg, [0; 3]), &req, 0).allowed)
            .count()
    };
    // Before any answer: the configured 4, a share of 25.
    assert_eq!(admitted(&prepared(10)), 25);
    // The service reports 8 live instances: 12 each.
    learn(&cfg, &s, 8, 0);
    assert_eq!(learned_instances(&s), Some(8));
    assert_eq!(admitted(&s), 12);
    // A report of 1 is floored at min_instances (2).
    let t = prepared(10);
    learn(&cfg, &t, 1, 0);
    assert_eq!(admitted(&t), 50);
}

/// Four proxies configured, one rule of 100 a second.
fn four_proxies() -> Config {
    Config::parse(
        br#"{"service":{"cluster":"c"},"fallback":{"instances":4,"max_keys":10},
             "rules":[{"name":"a","capacity":100,"period_ms":1000}]}"#,
    )
    .unwrap()
}

#[test]
fn the_count_lives_in_the_breaker_entry_and_a_known_count_costs_nothing() {
    let cfg = four_proxies();
    let s = prepared(10);
    let open = record::Record {
        breaker: crate::core::local::breaker::State {
            failures: 3,
            open_until_ms: 9_000,
            interval_ms: 100,
        },
        marks: record::Marks {
            debt_until_ms: 7,
            denied_until_ms: 8,
            instances: 0,
        },
    };
    s.set(record::KEY, &open.encode(), None).unwrap();
    // Learned: written into the admission record, the breaker's own state kept.
    assert_eq!(learn(&cfg, &s, 5, 0), 5);
    let stored = record::read(&s);
    assert_eq!(
        stored,
        record::Record {
            marks: record::Marks {
                instances: 5,
                ..open.marks
            },
            ..open
        }
    );
    assert_eq!(learned_instances(&s), Some(5));
    // A success closing the breaker keeps the count.
    let probe = crate::core::config::Breaker {
        failures: 3,
        open_ms: 100,
        max_open_ms: 1000,
    };
    crate::core::local::breaker::record_shared(&s, &probe, 9_000, true, true);
    assert_eq!(record::read(&s).marks.instances, 5);
    // The number the admission read: nothing is written (that nothing is read either is
    // counted by the dispatcher's `a_steady_exact_request_reads_shared_data_twice`).
    let before = s.map.borrow().clone();
    s.map.borrow_mut().clear();
    assert_eq!(learn(&cfg, &s, 5, 5), 5);
    assert!(s.map.borrow().is_empty());
    *s.map.borrow_mut() = before;
    // Another number than the admission read: stored.
    assert_eq!(learn(&cfg, &s, 6, 5), 6);
    assert_eq!(learned_instances(&s), Some(6));
}

#[test]
fn an_answer_teaches_the_count_it_carries() {
    let cfg = four_proxies();
    let s = prepared(10);
    let plan = Plan {
        request: TakeRequest {
            buckets: vec![bucket("k", 100)],
        },
        rules: vec![0],
        debt: Vec::new(),
        rls: None,
        instances: 0,
    };
    let answer = |body: &str| {
        let resp = crate::core::wire::decode_json(body.as_bytes()).unwrap();
        Outcome::Allowed(resp)
    };
    let body = |n: u64| {
        format!(
            r#"{{"allowed":true,"instances":{n},"buckets":[{{"allowed":true,"remaining":50,"retry_after_ms":0,"reset_after_ms":0,"limit":100,"granted":1}}]}}"#
        )
    };
    let eight = answer(&body(8));
    // Another answer decoded before the first is remembered does not speak for it.
    let _five = answer(&body(5));
    remember(&cfg, [0; 3], &plan, &eight, &[], &s, 0);
    assert_eq!(learned_instances(&s), Some(8));
    // An answer without a count leaves the learned one.
    let none = Outcome::Allowed(crate::core::wire::decode_json(body(0).as_bytes()).unwrap());
    remember(&cfg, [0; 3], &plan, &none, &[], &s, 0);
    assert_eq!(learned_instances(&s), Some(8));
}

#[test]
fn a_changed_window_limit_keeps_the_count() {
    let (s, t) = (prepared(10), sh(10));
    let of = |cap, period| Limits::local(cap, cap, period, Algorithm::FixedWindow, 1);
    for _ in 0..4 {
        assert!(take(&s, &t, "k", &of(10, 10_000), 0, 1).allowed);
    }
    // 4 of 10 used is 2 of 5: 3 left in this window.
    let admitted = (0..5)
        .filter(|_| take(&s, &t, "k", &of(5, 10_000), 100, 1).allowed)
        .count();
    assert_eq!(admitted, 3);
    // A shorter period keeps the count while the old window lasts, then counts afresh.
    assert!(!take(&s, &t, "k", &of(5, 1_000), 5_000, 1).allowed);
    assert!(take(&s, &t, "k", &of(5, 1_000), 6_000, 1).allowed);
}

#[test]
fn cas_conflicts_are_retried_and_nothing_is_lost() {
    let s = prepared(10);
    take(&s, &sh(10), "k", &tb(5), 0, 1);
    s.conflicts.set(3);
    assert!(take(&s, &sh(10), "k", &tb(5), 0, 1).allowed);
    let r = take(&s, &sh(10), "k", &tb(5), 0, 1);
    assert_eq!(r.remaining, 2, "both takes stored despite the conflicts");
}

#[test]
fn a_charge_that_cannot_be_stored_is_denied() {
    let s = prepared(10);
    s.conflicts.set(crate::core::base::store::MAX_CAS_ATTEMPTS);
    assert!(!take(&s, &sh(10), "k", &tb(5), 0, 1).allowed, "CAS gave up");
    assert_eq!(owed(&s, &sh(10), "k", &tb(5), 0), 0);
    // A table that was never prepared stores nothing, so admits nothing.
    let bare = FakeStore::default();
    assert!(!take(&bare, &sh(10), "k", &tb(5), 0, 1).allowed);
    assert!(bare.map.borrow().is_empty(), "no unconditional first write");
}

#[test]
fn all_or_nothing_refunds() {
    let s = prepared(100);
    let req = TakeRequest {
        buckets: vec![bucket("wide", 10), bucket("narrow", 1)],
    };
    let a = take_all(&s, &sh(100), &req, 0);
    assert!(a.allowed);
    assert_eq!(a.buckets[0].remaining, 9);
    let b = take_all(&s, &sh(100), &req, 0);
    assert!(!b.allowed);
    assert!(b.buckets[0].allowed && !b.buckets[1].allowed);
    let c = take(&s, &sh(100), "wide", &tb(10), 0, 1);
    assert_eq!(
        c.remaining, 8,
        "the denied request's charge on `wide` was refunded"
    );
    assert_eq!(
        owed(&s, &sh(100), "wide", &tb(10), 0),
        2,
        "and forgiven in the debt"
    );
}

#[test]
fn instances_divide_the_limit() {
    let s = prepared(100);
    let req = TakeRequest {
        buckets: vec![bucket("k", 10)],
    };
    let three = Shares {
        instances: 3,
        ..sh(100)
    };
    let admitted = (0..10)
        .filter(|_| take_all(&s, &three, &req, 0).allowed)
        .count();
    assert_eq!(admitted, 3);
}

#[test]
fn the_share_follows_the_answers() {
    let (s, t) = (prepared(100), sh(100));
    let l = Limits::local(100, 100, 60_000, Algorithm::TokenBucket, 4);
    // The service said 8 left: this proxy's share is 2, whatever the static split (25).
    remember_one(&s, &t, "k", &l, 1_000, 8, 0);
    let admitted = (0..10)
        .filter(|_| take(&s, &t, "k", &l, 1_000, 1).allowed)
        .count();
    assert_eq!(admitted, 2);
    // An answer never raises the share; refill at rate/N does (25 per minute here).
    remember_one(&s, &t, "k", &l, 1_000, 100, 0);
    assert!(!take(&s, &t, "k", &l, 1_000, 1).allowed);
    assert!(
        take(&s, &t, "k", &l, 3_400, 1).allowed,
        "2.4 s × 25/min = 1 token"
    );
    assert_eq!(owed(&s, &t, "k", &l, 3_400), 3);
    // The debt lowers the share an answer implies: 40 left / 4 = 10, less 3 owed.
    remember_one(&s, &t, "k", &l, 3_400, 40, 0);
    let admitted = (0..10)
        .filter(|_| take(&s, &t, "k", &l, 3_400, 1).allowed)
        .count();
    assert_eq!(admitted, 0, "share 0 after the refill token was spent");
}

#[test]
fn a_leasing_rule_takes_no_share_of_an_answer() {
    let cfg = |lease: &str| {
        Config::parse(format!(
            r#"{{"service":{{"cluster":"c"}},"fallback":{{"instances":4,"min_instances":4,"max_keys":100}},
                "rules":[{{"name":"r","capacity":1000,"period_ms":3600000{lease}}}]}}"#
        ).as_bytes())
        .unwrap_or_else(|e| unreachable!("{e}"))
    };
    let answered = |cfg: &Config| {
        let s = prepared(100);
        let b = Bucket {
            period_ms: 3_600_000,
            ..bucket("k", 1000)
        };
        let plan = Plan {
            request: TakeRequest {
                buckets: vec![b.clone()],
            },
            rules: vec![0],
            debt: vec![],
            rls: None,
            instances: 0,
        };
        let answer = BucketResult {
            allowed: true,
            limit: 1000,
            remaining: 900,
            reset_ms: 0,
            retry_after_ms: 0,
            granted: 1,
            delay_ms: 0,
            window: 0,
        };
        let outcome = Outcome::Allowed(TakeResponse {
            allowed: true,
            buckets: vec![answer],
            instances: 4,
            delay_ms: 0,
        });
        remember(cfg, [0; 3], &plan, &outcome, &[], &s, 0);
        let l = limits_of(&b, 4);
        (0..300)
            .filter(|_| take(&s, &sh(100), "k", &l, 0, 1).allowed)
            .count()
    };
    // Exact: a quarter of the 900 the answer reported.
    assert_eq!(answered(&cfg("")), 225);
    // Leasing: the answer may be stale by all the others leased since; the pool is the budget.
    assert_eq!(answered(&cfg(r#","lease":{"size":100}"#)), 0);
}

#[test]
fn a_refusal_by_the_breaker_starts_a_recovery_and_a_spend_is_not_owed() {
    let cfg = Config::parse(
        br#"{"service":{"cluster":"c","timeout_ms":20},"fallback":{"instances":1,"max_keys":10},
             "breaker":{"open_ms":100,"max_open_ms":1000},
             "rules":[{"name":"r","key":["literal:k"],"capacity":10,"period_ms":3600000}]}"#,
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    // Twice the breaker's interval (within open_ms and max_open_ms) and a timeout on either
    // side.
    assert_eq!(recovery_until(&cfg, 0, 100), 240);
    assert_eq!(recovery_until(&cfg, 0, 400), 840);
    assert_eq!(recovery_until(&cfg, 0, 1_000), 1_040, "max_open_ms at most");
    assert_eq!(recovery_until(&cfg, 0, 0), 140, "open_ms at least");
    let s = prepared(10);
    let t = Shares::of(&cfg, [0; 3]);
    // No refill to speak of: 10 an hour.
    let hourly = Bucket {
        period_ms: 3_600_000,
        ..bucket("k", 10)
    };
    let req = TakeRequest {
        buckets: vec![hourly],
    };
    let plan = |now: u64, s: &FakeStore| {
        let mut p = Plan {
            request: req.clone(),
            rules: vec![0],
            debt: vec![],
            rls: None,
            instances: 0,
        };
        (attach_debts(&cfg, [0; 3], &mut p, s, now), p.debt)
    };
    // A failed callout's take is owed, and starts no recovery.
    assert!(take_all_as(&s, &t, &req, 100, Charge::OWE).allowed);
    assert_eq!(plan(200, &s), (false, vec![1]));
    // A refusal by the breaker (open for 400 ms): owed, and the bucket recovers until
    // 840 ms after it. A later refusal while the interval is shorter does not cut that.
    let refused = |now, interval| Charge::outage(recovery_until(&cfg, now, interval));
    assert!(take_all_as(&s, &t, &req, 300, refused(300, 400)).allowed);
    assert!(take_all_as(&s, &t, &req, 310, refused(310, 100)).allowed);
    assert_eq!(plan(400, &s), (true, vec![3]));
    assert_eq!(plan(1_139, &s), (true, vec![3]));
    assert_eq!(plan(1_140, &s), (false, vec![3]));
    // A spend in recovery takes from the share without owing it; given back, it is the
    // share's again, and the debt is what it was.
    let l = Limits::local(10, 10, 3_600_000, Algorithm::TokenBucket, 1);
    assert!(take_all_as(&s, &t, &req, 400, Charge::SPEND).allowed);
    assert_eq!(owed(&s, &t, "k", &l, 400), 3);
    let left = |s: &FakeStore| {
        (0..20)
            .filter(|_| take_all_as(s, &t, &req, 400, Charge::SPEND).allowed)
            .count()
    };
    let probe = s.map.borrow().clone();
    assert_eq!(left(&s), 6, "10 less 3 on credit and 1 spent");
    *s.map.borrow_mut() = probe;
    refund_spent(&s, &t, &req, 400);
    assert_eq!(owed(&s, &t, "k", &l, 400), 3);
    assert_eq!(left(&s), 7);
    // A request of a leasing rule is never in recovery (its pool was charged already).
    let leasing = Config::parse(
        br#"{"service":{"cluster":"c"},"fallback":{"instances":1,"max_keys":10},
             "rules":[{"name":"r","key":["literal:k"],"capacity":10,"period_ms":3600000,"lease":{"size":2}}]}"#,
    )
    .unwrap_or_else(|e| unreachable!("{e}"));
    let mut p = Plan {
        request: req.clone(),
        rules: vec![0],
        debt: vec![],
        rls: None,
        instances: 0,
    };
    assert!(!attach_debts(&leasing, [0; 3], &mut p, &s, 400));
}

#[test]
fn a_record_written_before_the_outage_mark_keeps_its_share_and_debt() {
    let (s, t) = (prepared(10), sh(10));
    let l = tb(10);
    let sl = slot(s.memos(), "k", &l, 10);
    // The earlier format: eight words, 4 tokens held of 10, 3 owed.
    let held = bucket::share(&l, 4, 0, 0);
    let words = [held.level, held.stamp, 3, 0, 10, 10, 1000, 1];
    s.map.borrow_mut().insert(
        sl.name.clone(),
        (table::encode(table::SHARE, &sl.id, &words), 1),
    );
    assert_eq!(owed(&s, &t, "k", &l, 0), 3);
    let admitted = (0..10)
        .filter(|_| take(&s, &t, "k", &l, 0, 1).allowed)
        .count();
    assert_eq!(admitted, 4);
    assert_eq!(owed(&s, &t, "k", &l, 0), 7);
    assert_eq!(
        s.map.borrow().get(&sl.name).map(|(v, _)| v.len()),
        Some(SLOT_BYTES),
        "written again in this format"
    );
}

#[test]
fn an_answer_repays_the_debt() {
    let (s, t) = (prepared(10), sh(10));
    let l = tb(10);
    for _ in 0..4 {
        assert!(take(&s, &t, "k", &l, 0, 1).allowed);
    }
    assert_eq!(owed(&s, &t, "k", &l, 0), 4);
    remember_one(&s, &t, "k", &l, 10, 3, 3);
    assert_eq!(owed(&s, &t, "k", &l, 10), 1);
}

#[test]
fn steady_answers_do_not_write() {
    let (s, t) = (prepared(10), sh(10));
    let l = Limits::local(100, 100, 1000, Algorithm::TokenBucket, 1);
    remember_one(&s, &t, "k", &l, 0, 100, 0);
    remember_one(&s, &t, "k", &l, 0, 50, 0);
    let writes = s.writes.get();
    remember_one(&s, &t, "k", &l, 0, 50, 0);
    remember_one(&s, &t, "k", &l, 5, 50, 0);
    assert_eq!(s.writes.get(), writes, "no change worth a write");
    remember_one(&s, &t, "k", &l, 5, 10, 0);
    assert_eq!(s.writes.get(), writes + 1);
}

#[test]
fn fixed_window_share_counts_the_window() {
    let (s, t) = (prepared(10), sh(10));
    let l = Limits::local(10, 10, 1000, Algorithm::FixedWindow, 2);
    remember_one(&s, &t, "k", &l, 5_100, 2, 0);
    assert!(take(&s, &t, "k", &l, 5_200, 1).allowed);
    assert!(!take(&s, &t, "k", &l, 5_300, 1).allowed, "share was 1");
    assert!(
        take(&s, &t, "k", &l, 6_000, 1).allowed,
        "next window: 5 again"
    );
}

#[test]
fn garbage_in_a_slot_is_another_bucket() {
    let s = prepared(10);
    let sl = slot(s.memos(), "k", &tb(2), 10);
    s.map
        .borrow_mut()
        .insert(sl.name.clone(), (vec![1, 2, 3], 7));
    assert!(
        !take(&s, &sh(10), "k", &tb(2), 0, 1).allowed,
        "starts empty"
    );
}

#[test]
fn prepare_walks_once() {
    let s = prepared(50);
    let writes = s.writes.get();
    prepare(&s, 50);
    assert_eq!(s.writes.get(), writes);
    // Another size is a table of its own (a bucket's slot depends on the size).
    prepare(&s, 20);
    assert_eq!(s.writes.get(), writes + 21, "20 slots and the mark");
    prepare(&s, 20);
    assert_eq!(s.writes.get(), writes + 21);
}

#[test]
fn a_balance_below_zero_is_read_from_the_answer() {
    // 5 a second: a token every 200 ms.
    let b = Bucket {
        capacity: 5,
        rate: Some(5),
        ..bucket("k", 5)
    };
    let answer = |allowed, remaining, retry_after_ms, delay_ms| BucketResult {
        allowed,
        limit: 5,
        remaining,
        retry_after_ms,
        delay_ms,
        ..BucketResult::default()
    };
    let owed = |r: BucketResult| Reported::of(&b, &r).owed_ms;
    assert_eq!(owed(answer(true, 0, 0, 1400)), 1400, "a grant ahead");
    assert_eq!(owed(answer(true, 3, 0, 0)), 0);
    // Denied at zero left: payable in 1.4 s, so back at zero 200 ms earlier.
    assert_eq!(owed(answer(false, 0, 1400, 0)), 1200);
    // Less than a token below zero (or above it): nothing counted.
    assert_eq!(owed(answer(false, 0, 350, 0)), 0);
    assert_eq!(owed(answer(false, 2, 1400, 0)), 0);
    let window = Bucket {
        algorithm: Some(Algorithm::FixedWindow),
        ..b.clone()
    };
    assert_eq!(Reported::of(&window, &answer(false, 0, 1400, 0)).owed_ms, 0);
}

#[test]
fn a_share_owed_ahead_refills_from_when_it_is_due_and_is_written_once() {
    let (s, t) = (prepared(10), sh(10));
    let l = Limits::local(5, 5, 1000, Algorithm::TokenBucket, 1);
    let ahead = Reported {
        remaining: 0,
        owed_ms: 2000,
    };
    remember_one(&s, &t, "k", &l, 1_000, ahead, 0);
    let writes = s.writes.get();
    // The same balance reported again (due at the same moment): nothing to write.
    let again = Reported {
        remaining: 0,
        owed_ms: 1500,
    };
    remember_one(&s, &t, "k", &l, 1_500, again, 0);
    assert_eq!(s.writes.get(), writes);
    assert!(!take(&s, &t, "k", &l, 2_900, 1).allowed, "owed until 3 s");
    assert!(
        take(&s, &t, "k", &l, 3_250, 1).allowed,
        "a token 200 ms after"
    );
    assert!(!take(&s, &t, "k", &l, 3_250, 1).allowed);
    // A later due moment is stricter, and written.
    remember_one(
        &s,
        &t,
        "k",
        &l,
        3_300,
        Reported {
            remaining: 0,
            owed_ms: 1000,
        },
        0,
    );
    assert!(!take(&s, &t, "k", &l, 4_250, 1).allowed);
    assert!(take(&s, &t, "k", &l, 4_500, 1).allowed);
}
