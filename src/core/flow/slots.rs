//! A request's concurrency slots as the flow drives them: planned with the rate rules, acquired
//! once they admitted the request, released once when its stream ends
//! ([`crate::core::inflight`] holds the slots' bodies and answers, [`crate::core::local::slots`]
//! the local counters, and [`crate::core::decide::resolve_slots`] applies the failure mode).

use super::{Callout, Host, Leftover, Metric, Next};
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
    /// Paused, waiting for the acquire callout `token`.
    Acquiring {
        /// Callout token.
        token: u32,
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
    pub fn token(&self) -> Option<u32> {
        match self {
            Slots::Acquiring { token, .. } => Some(*token),
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
        match host.send(cfg, Callout::Acquire(encode_acquire(cfg, &slot, &wants))) {
            Ok(token) => {
                *self = Slots::Acquiring {
                    token,
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

    /// The acquire callout `token` ended with `result` (the stream is paused on it).
    pub fn on_result<H: Host>(
        &mut self,
        cfg: &Config,
        token: u32,
        result: &CalloutResult,
        host: &mut H,
    ) {
        if self.token() != Some(token) {
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
                release(cfg, encode_release(cfg, &slot, &keys), host);
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
    pub fn end<H: Host>(&mut self, cfg: &Config, host: &mut H) -> Option<Leftover> {
        match std::mem::replace(self, Slots::Done) {
            Slots::Held { slot, keys } => {
                Some(Leftover::Release(encode_release(cfg, &slot, &keys)))
            }
            Slots::Acquiring {
                token, slot, wants, ..
            } => Some(Leftover::Orphan {
                token,
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
