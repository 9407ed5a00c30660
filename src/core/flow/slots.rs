//! A request's concurrency slots as the flow drives them: planned with the rate rules, acquired
//! once they admitted the request, released once when its stream ends
//! ([`crate::core::inflight`] holds the slots' bodies and answers, [`crate::core::local::slots`]
//! the local counters, and [`crate::core::decide::resolve_slots`] applies the failure mode).

use super::{Callout, Host, Leftover, Metric, Next};
use crate::core::base::ledger::CalloutId;
use crate::core::config::Config;
use crate::core::decide::{resolve_slots, SlotsVerdict};
use crate::core::inflight::{
    denial, encode_acquire, encode_release, interpret, new_slot_id, release_local, Acquired, Count,
    Want,
};
use crate::core::local::breaker::{self, Admission};
use crate::core::wire::plan::CalloutResult;
use contract::bounds::SLOT_DENIED_RETRY_MS;

/// A request's concurrency slots, driven by [`super::Flow`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Slots {
    /// No concurrency rule applies (or the request was decided without a slot).
    #[default]
    None,
    /// Slots to take once the rate rules admitted the request.
    Wanted(Vec<Want>),
    /// Paused, waiting for the acquire callout `id`.
    Acquiring {
        /// Its callout's id in the ledger.
        id: CalloutId,
        /// The id this proxy gave the slots it asked for: what a release names even when the
        /// answer never arrives (the service may have taken them before the callout timed out).
        slot: String,
        /// What was asked.
        wants: Vec<Want>,
        /// Whether this callout is the breaker's probe.
        probe: bool,
    },
    /// Held at the service under `slot`; released when the stream ends.
    Held {
        /// Slot id.
        slot: String,
        /// The keys it holds.
        keys: Vec<String>,
    },
    /// Held locally (fallback): the shared counters to give back when the stream ends.
    Local(Vec<String>),
    /// Released (or never held): nothing more to do.
    Done,
}

impl Slots {
    /// Notes the slots a request wants (its matching concurrency rules',
    /// [`crate::core::decide::Matched::slots`]).
    pub fn want(&mut self, wants: Vec<Want>) {
        if !wants.is_empty() {
            *self = Slots::Wanted(wants);
        }
    }

    /// Whether slots are still to be taken.
    pub fn wanted(&self) -> bool {
        matches!(self, Slots::Wanted(_))
    }

    /// The acquire callout this request waits for.
    pub fn callout(&self) -> Option<CalloutId> {
        match self {
            Slots::Acquiring { id, .. } => Some(*id),
            _ => None,
        }
    }

    /// Asks the service for the wanted slots (`paused`: whether the stream is paused already).
    pub fn acquire<H: Host>(&mut self, cfg: &Config, paused: bool, host: &mut H) -> Next {
        let Slots::Wanted(wants) = std::mem::replace(self, Slots::Done) else {
            return allow(paused, host);
        };
        // The breaker the takes feed: while it is open, no acquire is sent either.
        let (admission, _) = breaker::admit_shared(host.store(), &cfg.breaker, host.now_ms());
        if admission == Admission::Reject {
            return self.failed(cfg, &wants, paused, host);
        }
        let probe = admission == Admission::Probe;
        let slot = new_slot_id();
        let body = encode_acquire(cfg, host.applied().instance.as_deref(), &slot, &wants);
        match host.send(cfg, Callout::Acquire(body)) {
            Ok(id) => {
                *self = Slots::Acquiring {
                    id,
                    slot,
                    wants,
                    probe,
                };
                Next::Pause
            }
            Err(_) => {
                record(cfg, false, probe, host);
                self.failed(cfg, &wants, paused, host)
            }
        }
    }

    /// The acquire callout `id` ended with `result` (the stream is paused on it).
    pub fn on_result<H: Host>(
        &mut self,
        cfg: &Config,
        id: CalloutId,
        result: &CalloutResult,
        host: &mut H,
    ) {
        if self.callout() != Some(id) {
            return;
        }
        let Slots::Acquiring {
            wants, probe, slot, ..
        } = std::mem::replace(self, Slots::Done)
        else {
            return;
        };
        let acquired = interpret(result, wants.len());
        record(cfg, acquired != Acquired::Failed, probe, host);
        match acquired {
            Acquired::Held(slot) => {
                host.count(Metric::Slots(Count::Acquired));
                *self = Slots::Held {
                    slot,
                    keys: wants.into_iter().map(|w| w.key).collect(),
                };
                host.resume();
            }
            Acquired::Denied(full, wait) => {
                let rules: Vec<usize> = full
                    .iter()
                    .filter_map(|&i| wants.get(i).map(|w| w.rule))
                    .collect();
                deny_or_shadow(cfg, &rules, wait, true, host, Count::Limited);
            }
            Acquired::Failed => {
                // The service may have taken the slots before the answer was lost (a timeout):
                // they are released by name, or they would count until their deadline.
                let keys: Vec<String> = wants.iter().map(|w| w.key.clone()).collect();
                let body = encode_release(host.applied().instance.as_deref(), &slot, &keys);
                release(cfg, body, host);
                self.failed(cfg, &wants, true, host);
            }
        }
    }

    /// No answer from the service: the failure mode decides.
    fn failed<H: Host>(
        &mut self,
        cfg: &Config,
        wants: &[Want],
        paused: bool,
        host: &mut H,
    ) -> Next {
        match resolve_slots(cfg, wants, host.store()) {
            SlotsVerdict::Open => {
                host.count(Metric::Slots(Count::FailureOpen));
                allow(paused, host)
            }
            SlotsVerdict::Closed(rules) => deny_or_shadow(
                cfg,
                &rules,
                SLOT_DENIED_RETRY_MS,
                paused,
                host,
                Count::FailureClosed,
            ),
            SlotsVerdict::Local(counters) => {
                host.count(Metric::Slots(Count::FallbackAcquired));
                *self = Slots::Local(counters);
                allow(paused, host)
            }
            SlotsVerdict::LocalFull(rule) => deny_or_shadow(
                cfg,
                &[rule],
                SLOT_DENIED_RETRY_MS,
                paused,
                host,
                Count::FallbackLimited,
            ),
        }
    }

    /// The stream ended (however): what it holds goes back, once. Local slots are given back
    /// here; slots held at the service, or asked for by an acquire still in flight, are left to
    /// the adapter.
    pub fn end<H: Host>(&mut self, host: &mut H) -> Option<Leftover> {
        match std::mem::replace(self, Slots::Done) {
            Slots::Held { slot, keys } => {
                let body = encode_release(host.applied().instance.as_deref(), &slot, &keys);
                Some(Leftover::Release(body))
            }
            Slots::Acquiring {
                id, slot, wants, ..
            } => Some(Leftover::Orphan {
                id,
                slot,
                keys: wants.into_iter().map(|w| w.key).collect(),
            }),
            Slots::Local(counters) => {
                release_local(host.store(), &counters);
                None
            }
            Slots::None | Slots::Wanted(_) | Slots::Done => None,
        }
    }
}

/// Sends a release of concurrency slots no request waits for (`body`: its JSON), counted as
/// failed when it cannot start.
pub fn release<H: Host>(cfg: &Config, body: Vec<u8>, host: &mut H) {
    if let Err(why) = host.send(cfg, Callout::Release(body)) {
        log::debug!("release not dispatched: {why}");
        host.count(Metric::Slots(Count::ReleaseFailed));
    }
}

/// Feeds an acquire's success or failure to the breaker.
fn record<H: Host>(cfg: &Config, success: bool, probe: bool, host: &mut H) {
    let now = host.now_ms();
    let event = breaker::record_shared(host.store(), &cfg.breaker, now, success, probe);
    if event != breaker::Event::None {
        host.count(Metric::Breaker(event));
    }
}

fn allow<H: Host>(paused: bool, host: &mut H) -> Next {
    if paused {
        host.resume();
    }
    Next::Continue
}

/// Denies with the first rule of `rules` that is not in shadow mode, counting `count`; when all
/// are in shadow mode, lets the request through without a slot.
fn deny_or_shadow<H: Host>(
    cfg: &Config,
    rules: &[usize],
    wait_ms: u64,
    paused: bool,
    host: &mut H,
    count: Count,
) -> Next {
    let enforcing = rules
        .iter()
        .filter_map(|&i| cfg.rules.get(i))
        .filter(|r| !r.shadow)
        .find_map(|r| Some((r, r.concurrency()?)));
    match enforcing {
        Some((r, c)) => {
            host.count(Metric::Slots(count));
            host.reply(&denial(r, c, wait_ms));
            Next::Pause
        }
        None => {
            host.count(Metric::Slots(Count::ShadowLimited));
            allow(paused, host)
        }
    }
}

#[cfg(test)]
mod tests {
    //! The flow driving a request's slots over a recording host.

    use super::*;
    use crate::core::base::store::fake::FakeStore;
    use crate::core::flow::Applied;
    use crate::core::flow::Flow;
    use crate::core::inflight::tests::{cfg, req};
    use crate::core::inflight::{encode_release, Count};
    use crate::core::wire::plan::LocalReply;
    use serde_json::Value;

    /// A host that records what the flow asks of it.
    #[derive(Default)]
    struct Fake {
        store: FakeStore,
        applied: Applied,
        acquire_fails: bool,
        acquires: Vec<Vec<u8>>,
        releases: Vec<Vec<u8>>,
        resumed: u32,
        replies: Vec<LocalReply>,
        counts: Vec<Count>,
        rule_counts: Vec<(usize, crate::core::wire::plan::RuleCount)>,
    }

    impl Host for Fake {
        type Store = FakeStore;
        fn store(&self) -> &FakeStore {
            &self.store
        }
        fn now_ms(&self) -> u64 {
            0
        }
        fn send(
            &mut self,
            _: &Config,
            out: Callout<'_>,
        ) -> Result<CalloutId, crate::core::flow::Unsent> {
            match out {
                Callout::Acquire(body) => {
                    self.acquires.push(body);
                    if self.acquire_fails {
                        return Err("BadArgument".into());
                    }
                    Ok(CalloutId(7))
                }
                Callout::Release(body) => {
                    self.releases.push(body);
                    Ok(CalloutId(8))
                }
                Callout::Take(_) | Callout::Refill(_) | Callout::Refund(_) => Ok(CalloutId(100)),
            }
        }
        fn applied(&self) -> &Applied {
            &self.applied
        }
        fn resume(&mut self) {
            self.resumed += 1;
        }
        fn place(&mut self, _: usize, _: u32) -> bool {
            true
        }
        fn unplace(&mut self, _: usize) {}
        fn reply(&mut self, r: &LocalReply) {
            self.replies.push(r.clone());
        }
        fn count(&mut self, metric: Metric) {
            match metric {
                Metric::Rule(rule, what) => self.rule_counts.push((rule, what)),
                Metric::Slots(c) => self.counts.push(c),
                _ => {}
            }
        }
    }

    /// Ends `f` as the adapter does: a slot it still holds is released (the leftover's callout).
    fn end(f: &mut Flow, c: &Config, h: &mut Fake) {
        for left in f.on_end(c, h) {
            if let Leftover::Release(body) = left {
                crate::core::flow::release(c, body, h);
            }
        }
    }

    fn answer(body: &str) -> CalloutResult {
        CalloutResult::Http {
            status: Some(200),
            body: body.as_bytes().to_vec(),
        }
    }

    const HELD: &str = r#"{"allowed":true,"slot":"ab","buckets":[{"allowed":true,"limit":4,"in_flight":1,"retry_after_ms":0}]}"#;
    const FULL: &str = r#"{"allowed":false,"buckets":[{"allowed":false,"limit":4,"in_flight":4,"retry_after_ms":1000}]}"#;

    #[test]
    fn flow_pauses_resumes_and_releases_exactly_once() {
        let c = cfg("");
        let (mut h, mut f) = (Fake::default(), Flow::default());
        assert_eq!(
            f.on_request_headers(&c, &req("/slow", "u"), &mut h),
            Next::Pause
        );
        assert!(f.waits_for(CalloutId(7)));
        f.on_callout_result(&c, CalloutId(7), answer(HELD), &mut h);
        assert_eq!((h.resumed, h.counts.clone()), (1, vec![Count::Acquired]));
        end(&mut f, &c, &mut h);
        end(&mut f, &c, &mut h);
        assert_eq!(
            h.releases,
            vec![encode_release(None, "ab", &["cc|u".into()])]
        );
        // No rule matches: no acquire, no pause.
        let (mut h, mut f) = (Fake::default(), Flow::default());
        assert_eq!(
            f.on_request_headers(&c, &req("/fast", "u"), &mut h),
            Next::Continue
        );
        end(&mut f, &c, &mut h);
        assert!(h.acquires.is_empty() && h.releases.is_empty());
    }

    /// Rules of both kinds in one list: the rate rule's bucket is counted under its own index,
    /// the slot is asked for the concurrency rule (limit, deadline) and denied with its response.
    #[test]
    fn a_rate_rule_after_a_concurrency_rule_keeps_its_index() {
        let json = r#"{"service":{"cluster":"svc"},"rules":[
            {"name":"cc","kind":"concurrency","key":["header:x-user"],"max_in_flight":4,
             "deadline_ms":5000,"response":{"status":503}},
            {"name":"r","capacity":5,"period_ms":1000}]}"#;
        let c = Config::parse(json.as_bytes()).unwrap();
        let (mut h, mut f) = (Fake::default(), Flow::default());
        assert_eq!(
            f.on_request_headers(&c, &req("/slow", "u"), &mut h),
            Next::Pause
        );
        assert!(f.waits_for(CalloutId(100)), "the take goes first");
        let took = r#"{"allowed":true,"buckets":[{"allowed":true,"limit":5,"remaining":4,"reset_ms":200,"retry_after_ms":0}]}"#;
        f.on_callout_result(&c, CalloutId(100), answer(took), &mut h);
        assert_eq!(
            h.rule_counts,
            vec![(1, crate::core::wire::plan::RuleCount::Allowed)]
        );
        let asked: Value = serde_json::from_slice(&h.acquires[0]).unwrap();
        assert_eq!(
            asked["buckets"],
            serde_json::json!([{"key":"cc|u","limit":4,"ttl_ms":5000}])
        );
        f.on_callout_result(&c, CalloutId(7), answer(FULL), &mut h);
        assert_eq!(h.replies.len(), 1);
        assert_eq!(h.replies[0].status, 503);
        assert_eq!(h.counts, vec![Count::Limited]);
    }

    #[test]
    fn flow_denies_a_full_key_and_holds_nothing() {
        let c = cfg("");
        let (mut h, mut f) = (Fake::default(), Flow::default());
        f.on_request_headers(&c, &req("/slow", "u"), &mut h);
        f.on_callout_result(&c, CalloutId(7), answer(FULL), &mut h);
        assert_eq!((h.resumed, h.replies.len()), (0, 1));
        assert_eq!(h.replies[0].status, 429);
        assert!(h.replies[0]
            .headers
            .contains(&("retry-after".into(), "1".into())));
        end(&mut f, &c, &mut h);
        assert!(h.releases.is_empty());
        // In shadow mode the same answer lets the request through, without a slot.
        let c = cfg(r#","shadow":true"#);
        let (mut h, mut f) = (Fake::default(), Flow::default());
        f.on_request_headers(&c, &req("/slow", "u"), &mut h);
        f.on_callout_result(&c, CalloutId(7), answer(FULL), &mut h);
        assert_eq!(
            (h.resumed, h.counts.clone()),
            (1, vec![Count::ShadowLimited])
        );
    }

    #[test]
    fn flow_without_an_answer_follows_the_failure_mode() {
        // allow: through, nothing held; deny: 429.
        for (mode, resumed, replies, count) in [
            ("allow", 1, 0, Count::FailureOpen),
            ("deny", 0, 1, Count::FailureClosed),
        ] {
            let c = cfg(&format!(r#","failure_mode":"{mode}""#));
            let (mut h, mut f) = (Fake::default(), Flow::default());
            f.on_request_headers(&c, &req("/slow", "u"), &mut h);
            f.on_callout_result(
                &c,
                CalloutId(7),
                CalloutResult::Http {
                    status: Some(503),
                    body: vec![],
                },
                &mut h,
            );
            assert_eq!(
                (h.resumed, h.replies.len(), h.counts.clone()),
                (resumed, replies, vec![count]),
                "{mode}"
            );
            // The service may have taken the slots before its answer was lost: they are released
            // under the id the acquire gave them.
            let asked: Value = serde_json::from_slice(&h.acquires[0]).unwrap();
            let slot = asked["slot"].as_str().unwrap();
            assert_eq!(slot.len(), 32);
            assert_eq!(
                h.releases,
                vec![encode_release(None, slot, &["cc|u".into()])]
            );
            end(&mut f, &c, &mut h);
            assert_eq!(h.releases.len(), 1, "{mode}: released once");
        }
        // fallback: local slots, 4 here; given back when each stream ends. A dispatch error is
        // decided at once, without pausing.
        let c = cfg(r#","fallback":{"max_keys":8}"#);
        let mut h = Fake {
            acquire_fails: true,
            ..Fake::default()
        };
        crate::core::local::table::prepare(
            &h.store,
            crate::core::local::table::SLOTS_TABLE,
            8,
            &[0; 8],
        );
        let mut flows: Vec<Flow> = (0..5).map(|_| Flow::default()).collect();
        let next: Vec<Next> = flows
            .iter_mut()
            .map(|f| f.on_request_headers(&c, &req("/slow", "u"), &mut h))
            .collect();
        assert_eq!(
            next,
            vec![
                Next::Continue,
                Next::Continue,
                Next::Continue,
                Next::Continue,
                Next::Pause
            ]
        );
        assert_eq!(h.replies.len(), 1);
        assert_eq!(h.resumed, 0, "never paused");
        end(&mut flows[0], &c, &mut h);
        let mut again = Flow::default();
        assert_eq!(
            again.on_request_headers(&c, &req("/slow", "u"), &mut h),
            Next::Continue
        );
        assert!(h.releases.is_empty(), "local slots are not the service's");
    }

    #[test]
    fn a_failing_service_opens_the_breaker_and_acquires_stop() {
        let c = cfg(r#","failure_mode":"allow","breaker":{"failures":2,"open_ms":1000}"#);
        let mut h = Fake::default();
        for _ in 0..2 {
            let mut f = Flow::default();
            f.on_request_headers(&c, &req("/slow", "u"), &mut h);
            f.on_callout_result(
                &c,
                CalloutId(7),
                CalloutResult::Http {
                    status: Some(504),
                    body: vec![],
                },
                &mut h,
            );
        }
        assert_eq!(h.acquires.len(), 2);
        let mut f = Flow::default();
        assert_eq!(
            f.on_request_headers(&c, &req("/slow", "u"), &mut h),
            Next::Continue,
            "decided at once by the failure mode"
        );
        assert_eq!(h.acquires.len(), 2, "no callout while the breaker is open");
        assert_eq!(h.counts.last(), Some(&Count::FailureOpen));
    }
}
