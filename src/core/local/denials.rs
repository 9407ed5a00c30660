//! Remembered denials: in exact mode, a denial from the service holds for every worker of this
//! Envoy until the bucket could pay that cost again, so a flood of denied requests is answered
//! here instead of costing a callout each.
//!
//! **Why it never admits more.** The service denies a cost when the bucket cannot pay it, and says
//! when it could (`retry_after_ms`: an upper bound, rounded up, on Redis's clock). A bucket gains
//! tokens only by refilling (and by a refund, a settlement giving back an overestimate, or an
//! operator's reset), so until then every request of that cost or more would be denied by the
//! service too. This module only ever denies: it cannot admit a request the service would not.
//!
//! **Why it denies at most a little more.** What it may deny that the service would have admitted:
//! a request arriving after tokens came back early (a refund, a settlement, a reset), or in the
//! milliseconds between the service's clock and this proxy's receiving the answer. Both are
//! bounded by `service.remember_denials_ms` (1 s by default): a denial is remembered until its
//! `retry_after_ms` or that long, whichever is sooner. A request of a smaller cost than the one
//! denied still asks the service.
//!
//! **What is remembered.** Per bucket (its key and limits, so a changed limit is another bucket),
//! in a bounded table of `fallback.max_keys` slots in shared data (`tollgate.deny.<n>`, the slot
//! scheme of [`table`]): until when, the cost denied, and the answer's limit, remaining and reset
//! for the headers of the 429s it answers. Only buckets of enforcing rules without a lease (lease
//! pools remember their own denials), and only answers of this project's service (not
//! `transport: rls`: another server's reset times mean other things). A bucket carrying a
//! fallback debt (its `lease` is its cost plus the debt) is remembered for its cost: the service
//! grants a lease from the cost up, so it denied because the bucket could not pay the cost. A
//! denial the debt itself caused (the service admitted, its grant fell short of the debt:
//! `fallback::repay_debts`) is not the service's and is not remembered (the flow's denials stage): the
//! next callout repays what it can.
//! A bucket of a shaping rule (`shape`) is denied here only until its wait is within the rule's
//! `max_delay_ms` (the service would grant it for later from then on).
//! A slot another bucket holds is overwritten; writes are not compare-and-swap, since a lost
//! write only costs a callout.
//!
//! **What it costs.** Nothing while no denial is remembered: the admission record, read by every
//! request already, carries the latest time any remembered denial may hold
//! ([`record::mark_denied`]); only while it lasts does a request look its buckets up here.
//!
//! [`record::mark_denied`]: crate::core::local::record::mark_denied

use crate::core::base::place::Memos;
use crate::core::base::store::CasStore;
use crate::core::config::Config;
use crate::core::local::bucket::Limits;
use crate::core::local::table::{self, place_in, Place};
use crate::core::wire::plan::{Outcome, Plan};
use crate::core::wire::{Bucket, BucketResult, TakeResponse};

/// Words of a record: until when, the cost denied, the answer's limit, remaining and the time its
/// bucket is full again, and when the cost could be paid (ms since the epoch).
const WORDS: usize = 6;

/// The slot of a request bucket: its key and global limits, like the service's bucket identity.
/// One table whatever `max_keys` (a push that changes it finds the records it wrote before in
/// other slots, and each record names its bucket, so it only misses them).
fn slot(memos: &Memos, b: &Bucket, max_keys: u32) -> Place {
    let l = Limits::local(
        b.capacity,
        b.rate(),
        b.period_ms,
        b.algorithm.unwrap_or_default(),
        1,
    );
    place_in(memos, table::DENIALS_TABLE, &b.key, &l, max_keys)
}

/// Whether bucket `i` of `plan` may be remembered and answered from memory.
fn eligible(cfg: &Config, plan: &Plan, i: usize) -> bool {
    let rule = plan.rules.get(i).and_then(|&r| cfg.rules.get(r));
    let bucket = plan.request.buckets.get(i);
    matches!((rule, bucket), (Some(r), Some(_))
        if !r.shadow && r.rate_limit().is_some_and(|l| l.lease.is_none()) && plan.own_lease(i).is_none())
}

/// One remembered denial.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Denial {
    /// Answered here until then: the retry time, at most `remember_denials_ms` after the answer.
    until_ms: u64,
    cost: u64,
    limit: u64,
    remaining: u64,
    full_at_ms: u64,
    /// When the service said the cost could be paid: what `Retry-After` counts down to.
    retry_at_ms: u64,
}

impl Denial {
    fn encode(&self, id: &[u8; table::ID_BYTES]) -> Vec<u8> {
        table::encode(
            table::DENIAL,
            id,
            &[
                self.until_ms,
                self.cost,
                self.limit,
                self.remaining,
                self.full_at_ms,
                self.retry_at_ms,
            ],
        )
    }

    /// The record in `bytes` if it is this bucket's (`id`).
    fn decode(id: &[u8; table::ID_BYTES], bytes: &[u8]) -> Option<Denial> {
        let (got, [until_ms, cost, limit, remaining, full_at_ms, retry_at_ms]) =
            table::decode::<WORDS>(table::DENIAL, bytes)?;
        (&got == id).then_some(Denial {
            until_ms,
            cost,
            limit,
            remaining,
            full_at_ms,
            retry_at_ms,
        })
    }

    /// Whether this denial tells at least as much as `other` (a cost as small or smaller, for as
    /// long or longer): then `other` need not be written over it.
    fn covers(&self, other: &Denial) -> bool {
        self.cost <= other.cost && self.until_ms >= other.until_ms
    }
}

/// After an answer from the service: every bucket that denied (and may be remembered) is
/// remembered until `min(retry_after_ms, remember_denials_ms)` from `now_ms`. Returns the latest
/// time a denial written here holds (0: none), for [`record::mark_denied`](crate::core::local::record::mark_denied).
pub fn remember<S: CasStore + ?Sized>(
    cfg: &Config,
    plan: &Plan,
    outcome: &Outcome,
    store: &S,
    now_ms: u64,
) -> u64 {
    let cap = cfg.service.remember_denials_ms;
    let Outcome::Limited(resp) = outcome else {
        return 0;
    };
    if cap == 0 {
        return 0;
    }
    let mut latest = 0;
    for (i, (b, r)) in plan.request.buckets.iter().zip(&resp.buckets).enumerate() {
        if r.allowed || r.retry_after_ms == 0 || !eligible(cfg, plan, i) {
            continue;
        }
        // A shaping rule's take is granted once its wait is within `max_delay_ms`: denied here
        // only until then.
        let ahead = plan
            .rules
            .get(i)
            .and_then(|&r| cfg.rules.get(r)?.rate_limit()?.shape)
            .map_or(0, |s| s.max_delay_ms);
        let wait = r.retry_after_ms.saturating_sub(ahead);
        if wait == 0 {
            continue;
        }
        let d = Denial {
            until_ms: now_ms.saturating_add(wait.min(cap)),
            cost: b.cost(),
            limit: r.limit,
            remaining: r.remaining,
            full_at_ms: now_ms.saturating_add(r.reset_ms),
            retry_at_ms: now_ms.saturating_add(r.retry_after_ms),
        };
        let slot = slot(store.memos(), b, cfg.fallback.max_keys);
        let known = store
            .get(&slot.name)
            .and_then(|(v, _)| Denial::decode(&slot.id, &v));
        if known.is_some_and(|k| k.covers(&d)) {
            latest = latest.max(d.until_ms);
            continue;
        }
        if store.set(&slot.name, &d.encode(&slot.id), None).is_ok() {
            latest = latest.max(d.until_ms);
        }
    }
    latest
}

/// Tokens came back to `buckets` by this proxy's own hand (a refund it sent, a settlement that gave
/// back part of an estimate): a denial remembered of any of them no longer holds, so the next
/// request of that bucket asks the service. Forgetting only ever costs a callout, never an
/// admission the service would not make.
pub fn forget<'a, S: CasStore + ?Sized>(
    cfg: &Config,
    buckets: impl IntoIterator<Item = &'a Bucket>,
    store: &S,
) {
    if cfg.service.remember_denials_ms == 0 {
        return;
    }
    for b in buckets {
        let slot = slot(store.memos(), b, cfg.fallback.max_keys);
        let Some(mut d) = store
            .get(&slot.name)
            .and_then(|(v, _)| Denial::decode(&slot.id, &v))
        else {
            continue;
        };
        if d.until_ms != 0 {
            d.until_ms = 0;
            // Not compare-and-swap, as every write here: a lost write only costs a callout.
            let _ = store.set(&slot.name, &d.encode(&slot.id), None);
        }
    }
}

/// Before a callout: when a bucket of `plan` holds a remembered denial of this request's cost or
/// less, the denial the service would give, in the contract's shape (the buckets not denied are
/// reported full, so the headers' tightest bucket is the one that denied); `None` otherwise.
pub fn recall<S: CasStore + ?Sized>(
    cfg: &Config,
    plan: &Plan,
    store: &S,
    now_ms: u64,
) -> Option<TakeResponse> {
    if cfg.service.remember_denials_ms == 0 {
        return None;
    }
    let mut buckets: Vec<BucketResult> = Vec::with_capacity(plan.request.buckets.len());
    let mut denied = false;
    for (i, b) in plan.request.buckets.iter().enumerate() {
        let held = if eligible(cfg, plan, i) {
            let slot = slot(store.memos(), b, cfg.fallback.max_keys);
            store
                .get(&slot.name)
                .and_then(|(v, _)| Denial::decode(&slot.id, &v))
                .filter(|d| now_ms < d.until_ms && b.cost() >= d.cost)
        } else {
            None
        };
        buckets.push(match held {
            Some(d) => {
                denied = true;
                BucketResult {
                    allowed: false,
                    limit: d.limit,
                    remaining: d.remaining,
                    reset_ms: d.full_at_ms.saturating_sub(now_ms),
                    retry_after_ms: d.retry_at_ms.max(d.until_ms) - now_ms,
                    granted: 0,
                    delay_ms: 0,
                    window: 0,
                }
            }
            None => BucketResult {
                allowed: true,
                limit: b.capacity,
                remaining: b.capacity,
                ..BucketResult::default()
            },
        });
    }
    denied.then_some(TakeResponse {
        allowed: false,
        buckets,
        instances: 0,
        delay_ms: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::base::store::fake::FakeStore;
    use crate::core::decide;
    use crate::core::rules::Request;
    use crate::core::wire::plan::Step;

    fn cfg(extra_rule: &str, service: &str) -> Config {
        let json = format!(
            r#"{{"service":{{"cluster":"svc"{service}}},
                 "rules":[{{"name":"r","key":["literal:k"],"capacity":10,"rate":10,"period_ms":60000,
                            "cost":{{"header":"x-cost","default":1}} {extra_rule}}},
                          {{"name":"s","key":["literal:s"],"capacity":5,"period_ms":1000,"shadow":true}}]}}"#
        );
        Config::parse(json.as_bytes()).unwrap()
    }

    fn plan(c: &Config, cost: u64) -> Plan {
        let req = Request {
            headers: vec![
                (":path".into(), b"/".to_vec()),
                ("x-cost".into(), cost.to_string().into_bytes()),
            ],
            peer: None,
            properties: Vec::new(),
            ..Default::default()
        };
        match decide::decide(c, &req).step {
            Step::Callout(p) => p,
            Step::Continue => panic!("rules match"),
        }
    }

    fn denied(retry_after_ms: u64) -> BucketResult {
        BucketResult {
            allowed: false,
            limit: 10,
            remaining: 0,
            reset_ms: 6000,
            retry_after_ms,
            granted: 0,
            delay_ms: 0,
            window: 0,
        }
    }

    fn full(limit: u64) -> BucketResult {
        BucketResult {
            allowed: true,
            limit,
            remaining: limit,
            ..BucketResult::default()
        }
    }

    fn limited(buckets: Vec<BucketResult>) -> Outcome {
        Outcome::Limited(TakeResponse {
            allowed: false,
            buckets,
            instances: 0,
            delay_ms: 0,
        })
    }

    #[test]
    fn a_denial_holds_for_its_cost_and_above_until_it_could_be_paid() {
        let c = cfg("", "");
        let s = FakeStore::default();
        let p = plan(&c, 3);
        let until = remember(&c, &p, &limited(vec![denied(600), full(5)]), &s, 1000);
        assert_eq!(until, 1600);
        let got = recall(&c, &p, &s, 1100).expect("remembered");
        assert_eq!(
            got.buckets[0],
            BucketResult {
                reset_ms: 5900,
                ..denied(500)
            }
        );
        assert!(got.buckets[1].allowed, "the other bucket is reported full");
        assert!(
            recall(&c, &plan(&c, 4), &s, 1100).is_some(),
            "a dearer request too"
        );
        assert_eq!(
            recall(&c, &plan(&c, 2), &s, 1100),
            None,
            "a cheaper one asks"
        );
        assert_eq!(recall(&c, &p, &s, 1600), None, "over when it could be paid");
    }

    #[test]
    fn a_denial_is_remembered_a_second_at_most_by_default() {
        let c = cfg("", "");
        let s = FakeStore::default();
        let p = plan(&c, 1);
        assert_eq!(
            remember(&c, &p, &limited(vec![denied(3_600_000), full(5)]), &s, 0),
            1000
        );
        let got = recall(&c, &p, &s, 999).expect("remembered");
        assert_eq!(
            got.buckets[0].retry_after_ms,
            3_600_000 - 999,
            "Retry-After is the service's, not how long it is remembered"
        );
        assert_eq!(recall(&c, &p, &s, 1000), None);
        let c = cfg("", r#","remember_denials_ms":0"#);
        assert_eq!(
            remember(&c, &p, &limited(vec![denied(600), full(5)]), &s, 5000),
            0
        );
        assert_eq!(recall(&c, &p, &s, 5001), None, "off");
    }

    #[test]
    fn shadow_and_lease_rules_and_debts_are_not_remembered() {
        let c = cfg("", "");
        let s = FakeStore::default();
        let p = plan(&c, 1);
        // Only the shadow rule denied: nothing to remember.
        assert_eq!(
            remember(&c, &p, &limited(vec![full(10), denied(600)]), &s, 0),
            0
        );
        assert_eq!(recall(&c, &p, &s, 1), None);
        // A bucket asking for a lease of its own (not a rule's): not remembered.
        let mut leasing = p.clone();
        leasing.request.buckets[0].lease = Some(5);
        assert_eq!(
            remember(&c, &leasing, &limited(vec![denied(600), full(5)]), &s, 0),
            0
        );
        let c = cfg(r#","lease":{"size":5}"#, "");
        let p = plan(&c, 1);
        assert_eq!(
            remember(&c, &p, &limited(vec![denied(600), full(5)]), &s, 0),
            0
        );
    }

    #[test]
    fn a_denial_of_a_bucket_carrying_a_debt_is_remembered_for_its_cost() {
        let c = cfg("", "");
        let s = FakeStore::default();
        let p = plan(&c, 1);
        // Cost 1 with a debt of 4 riding on it as a lease of 5: the service could not pay the 1.
        let mut with_debt = p.clone();
        with_debt.request.buckets[0].lease = Some(5);
        with_debt.debt = vec![4, 0];
        assert_eq!(
            remember(&c, &with_debt, &limited(vec![denied(600), full(5)]), &s, 0),
            600
        );
        // A request without the debt (another worker repaid it) is denied as the service would.
        assert!(recall(&c, &p, &s, 599).is_some());
        assert!(recall(&c, &with_debt, &s, 599).is_some());
        assert_eq!(recall(&c, &p, &s, 600), None);
    }

    #[test]
    fn tokens_this_proxy_gave_back_end_its_denial_of_that_bucket() {
        let c = cfg("", "");
        let s = FakeStore::default();
        let p = plan(&c, 1);
        remember(&c, &p, &limited(vec![denied(600), full(5)]), &s, 0);
        // Another bucket's tokens came back: this denial holds.
        let mut other = p.request.buckets[0].clone();
        other.key.push('x');
        forget(&c, [&other], &s);
        assert!(recall(&c, &p, &s, 1).is_some());
        // Its own bucket's: the next request asks.
        forget(&c, &p.request.buckets, &s);
        assert_eq!(recall(&c, &p, &s, 1), None);
        // A settlement that gave tokens back forgets; one that charged extra does not.
        remember(&c, &p, &limited(vec![denied(600), full(5)]), &s, 10);
        let item = |estimate, used| crate::core::settle::Item {
            bucket: p.request.buckets[0].clone(),
            rule: "r".into(),
            estimate,
            used,
            window: None,
        };
        forget(&c, crate::core::settle::given_back(&[item(4, 9)]), &s);
        assert!(recall(&c, &p, &s, 11).is_some(), "an extra charge");
        forget(&c, crate::core::settle::given_back(&[item(4000, 10)]), &s);
        assert_eq!(recall(&c, &p, &s, 11), None, "settled below its estimate");
    }

    #[test]
    fn another_limit_or_key_is_another_bucket() {
        let c = cfg("", "");
        let s = FakeStore::default();
        let p = plan(&c, 1);
        remember(&c, &p, &limited(vec![denied(600), full(5)]), &s, 0);
        let mut other = p.clone();
        other.request.buckets[0].capacity = 20;
        assert_eq!(recall(&c, &other, &s, 1), None, "a changed limit");
        other = p.clone();
        other.request.buckets[0].key.push('x');
        assert_eq!(recall(&c, &other, &s, 1), None, "another key");
    }

    #[test]
    fn a_repeated_denial_writes_only_what_it_adds() {
        let c = cfg("", "");
        let s = FakeStore::default();
        let p = plan(&c, 2);
        remember(&c, &p, &limited(vec![denied(600), full(5)]), &s, 0);
        let writes = s.writes.get();
        remember(&c, &p, &limited(vec![denied(500), full(5)]), &s, 100);
        assert_eq!(s.writes.get(), writes, "the same denial again");
        remember(
            &c,
            &plan(&c, 1),
            &limited(vec![denied(500), full(5)]),
            &s,
            100,
        );
        assert_eq!(s.writes.get(), writes + 1, "a cheaper cost denied is news");
        assert!(recall(&c, &plan(&c, 1), &s, 200).is_some());
    }

    #[test]
    fn rls_answers_are_not_remembered() {
        let c = cfg("", r#","transport":"rls","domain":"d""#);
        assert_eq!(c.service.remember_denials_ms, 0);
        let err = Config::parse(
            br#"{"service":{"cluster":"svc","transport":"rls","domain":"d","remember_denials_ms":5},
                 "rules":[{"name":"r","key":["literal:k"],"capacity":1,"period_ms":1000}]}"#,
        )
        .unwrap_err();
        assert_eq!(err.field, "service.remember_denials_ms");
    }
}
