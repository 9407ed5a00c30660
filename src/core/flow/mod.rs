//! The per-request state machine, over a [`Host`] port the adapter implements with proxy-wasm
//! (and the tests with a recording fake).
//!
//! ```text
//! Idle ──no rule──────────────────────────────▶ Done            (Continue, no callout)
//! Idle ──lease pools decide──────────▶ verdict ▶ Done           (Continue or reply, no callout)
//! Idle ──breaker open / dispatch error──▶ verdict ▶ Done        (Continue or reply, never paused)
//! Idle ──dispatch ok──▶ Calling{id} ──reply for id──▶ verdict ▶ Done    (resume or reply)
//! ```
//!
//! The stream is paused only after a dispatch succeeded, and resumed only from `Calling`: a
//! synchronous failure is decided on the spot, and a stream that was never paused is never
//! resumed. A reply for another callout (or a second reply) is ignored.
//!
//! Lease mode ([`crate::core::local::lease`]) sits in front of the callout: when the pools of every
//! bucket can pay (or one holds a cached denial) the request is decided on the spot; otherwise the
//! callout carries `lease` on the buckets this request refills, and its outcome (whatever it is,
//! the breaker's refusal and a dispatch error included) is settled into the pools before the
//! verdict.
//!
//! After an outage a request may be in recovery ([`Recovery`], `fallback::attach_debts`): its
//! fallback shares must pay for it as well as the service. They are asked before the callout
//! (a request they cannot pay is denied on the spot, as in the outage); the breaker's probe and
//! a request carrying a debt call anyway, and the shares look at the answer.
//!
//! `slots`: a request's concurrency slots ([`crate::core::inflight`]) as the flow drives them.

use crate::core::base::ledger::CalloutId;
use crate::core::base::store::CasStore;
use crate::core::config::Config;
use crate::core::decide;
use crate::core::local::breaker::{self, Admission, Event};
use crate::core::local::bucket;
use crate::core::local::denials;
use crate::core::local::fallback;
use crate::core::local::lease::{self, Count, Local};
use crate::core::rules::Request;
use crate::core::settle;
use crate::core::wire::plan::{
    Action, CalloutResult, Cause, Decision, LocalReply, Outcome, Plan, RuleCount, Step,
};
use crate::core::wire::TakeRequest;
use log::debug;

mod slots;
pub use slots::{release, Slots};

/// What the state machine needs from the proxy: I/O alone (shared data, the clock, starting a
/// callout, resuming or answering the request, counting). Whatever a request leaves behind when
/// it ends comes back from [`Flow::on_end`] as [`Leftover`] values.
pub trait Host {
    /// The shared store (fallback buckets, breaker, pools, slots).
    type Store: CasStore + ?Sized;
    /// The shared store.
    fn store(&self) -> &Self::Store;
    /// Wall-clock time in ms since the epoch.
    fn now_ms(&self) -> u64;
    /// Starts `callout`; its id in the ledger, or why it could not start.
    fn send(&mut self, cfg: &Config, callout: Callout<'_>) -> Result<CalloutId, String>;
    /// Resumes the paused request.
    fn resume(&mut self);
    /// Sends a local reply (the request ends there).
    fn reply(&mut self, reply: &LocalReply);
    /// Counts `metric`.
    fn count(&mut self, metric: Metric);
}

/// A callout the flow starts; the variant says where its answer goes.
#[derive(Debug)]
pub enum Callout<'a> {
    /// The request's take: its answer comes to [`Flow::on_callout_result`].
    Take(&'a Plan),
    /// A background lease refill no request waits for: its answer comes to [`on_refill_result`]
    /// with this plan.
    Refill(&'a Plan),
    /// Unspent tokens given back to the global bucket. Not awaited (a lost refund only leaves
    /// those tokens spent).
    Refund(&'a TakeRequest),
    /// The request's acquire of concurrency slots (JSON, `POST /v1/acquire`): its answer comes to
    /// [`Flow::on_callout_result`].
    Acquire(Vec<u8>),
    /// A release of concurrency slots (JSON, `POST /v1/release`), awaited by no request (its
    /// answer is counted).
    Release(Vec<u8>),
}

/// What the flow counts: every metric goes through one call of the port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// A request's decision.
    Decision(Decision),
    /// A per-rule event of rule `.0` (index in `Config::rules`).
    Rule(usize, RuleCount),
    /// A failed callout.
    Failure(Cause),
    /// A request the failure mode decided (`failure_mode`: the fallback, allow or deny), and why
    /// the service did not: a failed callout, the open breaker, or a take that waited its
    /// timeout in the batch queue.
    FailureMode(Cause),
    /// A breaker transition (metrics, log).
    Breaker(Event),
    /// `n` added to a lease counter.
    Lease(Count, u64),
    /// A concurrency-slot event.
    Slots(crate::core::inflight::Count),
    /// An answer on the stream to a message that had failed at its deadline, and the tokens it
    /// granted that went back to the service ([`late_answer`]).
    Late {
        /// Tokens given back.
        returned: u64,
    },
}

/// What a request leaves behind when its stream ends, for the adapter to carry out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leftover {
    /// What the response used, to settle with the service (already spent from this proxy's
    /// fallback shares).
    Settle(Vec<crate::core::settle::Item>),
    /// Slots held at the service, to release: the release's JSON body.
    Release(Vec<u8>),
    /// The take in flight under `id` (or queued under it): its answer is no one's now.
    Abandoned {
        /// Its callout's id in the ledger.
        id: CalloutId,
    },
    /// The acquire in flight under `id`: unless its answer is a denial (nothing taken), the
    /// slots go back at once, by the name this proxy gave them.
    Orphan {
        /// Its callout's id in the ledger.
        id: CalloutId,
        /// The slots' id.
        slot: String,
        /// The keys asked for.
        keys: Vec<String>,
    },
}

/// What the end of a request's callout tells the breaker ([`Flow`]'s `record`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Report {
    /// The callout was the breaker's probe.
    probe: bool,
    /// A success needs no record: admitted while the breaker was clean, and answered within a
    /// tick.
    quiet: bool,
    /// A failure is this callout's own, not a share of its batch's failure that another take
    /// reported ([`CalloutResult::Shared`]).
    counted: bool,
    /// When the callout ended (ms).
    now: u64,
    /// What the fallback shares have to say about the answer (after an outage).
    recovery: Recovery,
}

/// What to tell the proxy about the current callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Go on.
    Continue,
    /// Stop iteration (waiting for a callout, or a local reply was sent).
    Pause,
}

/// Where a request is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Headers not seen yet.
    Idle,
    /// Paused, waiting for callout `id`; `probe` if it is the breaker's probe.
    Calling {
        /// Its callout's id in the ledger.
        id: CalloutId,
        /// What was asked.
        plan: Plan,
        /// Whether this callout is the breaker's probe.
        probe: bool,
        /// The admission saw a clean breaker: a quick success records nothing.
        clean: bool,
        /// When the callout started (ms): a success that took a tick or longer
        /// ([`crate::core::config::Service::tick_ms`]) is recorded, so that failures counted
        /// meanwhile (by this worker or another) do not stand against a service that answers.
        since_ms: u64,
        /// What the fallback shares have to say about the answer (after an outage).
        recovery: Recovery,
    },
    /// Decided.
    Done,
}

/// A request in recovery from an outage (`fallback::attach_debts`): admitted only when the
/// service admits it and its fallback shares can pay for it too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// Not in recovery: the service's answer decides.
    None,
    /// The shares paid before the callout: given back unless the service admits it.
    Prepaid,
    /// The callout had to go whatever the shares held (the breaker's probe, or a debt to
    /// repay): an admission stands only if the shares can pay for it after the answer (the
    /// service charged it either way: stricter, never looser).
    Check,
}

/// One request's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flow {
    /// Where the request is.
    pub phase: Phase,
    /// Headers to add to the upstream's response (`response.on_allowed`).
    pub response_headers: Vec<(String, String)>,
    /// Per-rule counts beside the verdict's, counted with it: shadow rules that denied in a first
    /// answer (see [`decide::without_shadow`]), rules whose remembered denial answered
    /// ([`denials`]).
    pub shadow_counts: Vec<(usize, RuleCount)>,
    /// Concurrency slots ([`crate::core::inflight`]): taken after the rate rules admitted the
    /// request, released by [`Flow::on_end`].
    pub slots: Slots,
    /// Rules charged by the response: what the admitted request reserved, settled when its
    /// stream ends ([`crate::core::settle`]).
    pub meter: Option<crate::core::settle::Meter>,
    /// Lease pools this request's work deposited into: the adapter's timer watches them
    /// ([`lease::sweep`]), and takes them from here after each call.
    pub watched: Vec<lease::Held>,
}

impl Default for Flow {
    fn default() -> Self {
        Flow {
            phase: Phase::Idle,
            response_headers: Vec::new(),
            shadow_counts: Vec::new(),
            slots: Slots::None,
            meter: None,
            watched: Vec::new(),
        }
    }
}

impl Flow {
    /// The request headers arrived.
    pub fn on_request_headers<H: Host>(
        &mut self,
        cfg: &Config,
        req: &Request,
        host: &mut H,
    ) -> Next {
        if self.phase != Phase::Idle {
            return Next::Continue;
        }
        let matched = decide::decide(cfg, req);
        self.slots.want(matched.slots);
        let mut plan = match matched.step {
            Step::Continue => {
                self.phase = Phase::Done;
                return self.slots.acquire(cfg, false, host);
            }
            Step::Callout(plan) => plan,
        };
        let now = host.now_ms();
        let (local, chores) = lease::local(cfg, &mut plan, host.store(), now);
        run_chores(cfg, chores, &mut self.watched, host);
        if let Local::Answer(outcome) = local {
            let count = match outcome {
                Outcome::Allowed(_) => Count::Local,
                _ => Count::LocalLimited,
            };
            host.count(Metric::Lease(count, 1));
            return self.conclude(cfg, &plan, &outcome, false, now, host);
        }
        let seen = breaker::admit_seen(host.store(), &cfg.breaker, now);
        let (admission, clean) = (seen.admission, seen.clean);
        plan.instances = seen.instances;
        if seen.denials && admission == Admission::Call {
            if let Some(resp) = denials::recall(cfg, &plan, host.store(), now) {
                // The service denied this cost moments ago and could not pay it yet.
                for (i, b) in resp.buckets.iter().enumerate() {
                    if let (false, Some(&r)) = (b.allowed, plan.rules.get(i)) {
                        self.shadow_counts.push((r, RuleCount::LimitedLocally));
                    }
                }
                return self.conclude(cfg, &plan, &Outcome::Limited(resp), false, now, host);
            }
        }
        // The fallback admitted on credit recently (or the breaker refused): this callout repays
        // what its buckets owe, and says whether they are in recovery from an outage.
        let recovering = seen.debt && fallback::attach_debts(cfg, &mut plan, host.store(), now);
        if admission == Admission::Reject {
            let outcome = settle(
                cfg,
                &plan,
                Outcome::Failed(Cause::Breaker),
                &mut self.watched,
                now,
                host,
            );
            return self.conclude(cfg, &plan, &outcome, false, now, host);
        }
        let probe = admission == Admission::Probe;
        let recovery = match recovering {
            false => Recovery::None,
            // The probe must call, and so must a debt to repay: the shares look at the answer.
            true if probe || !plan.debt.is_empty() => Recovery::Check,
            true => {
                let sh = fallback::Shares::of_plan(cfg, &plan, host.store());
                let spend = fallback::Charge::SPEND;
                let paid = fallback::take_all_as(host.store(), &sh, &plan.request, now, spend);
                if !paid.allowed {
                    // Denied by the shares, as in the outage: no callout.
                    let verdict = decide::from_shares(cfg, &plan, &paid);
                    return self.apply(cfg, &plan, verdict, false, now, host);
                }
                Recovery::Prepaid
            }
        };
        match host.send(cfg, Callout::Take(&plan)) {
            Ok(id) => {
                self.phase = Phase::Calling {
                    id,
                    plan,
                    probe,
                    clean,
                    since_ms: now,
                    recovery,
                };
                Next::Pause
            }
            Err(why) => {
                debug!(
                    "callout to cluster {:?} not dispatched: {why}",
                    cfg.service.cluster
                );
                let report = Report {
                    probe,
                    quiet: clean,
                    counted: true,
                    now,
                    recovery,
                };
                let failed = Outcome::Failed(Cause::Dispatch);
                self.after_callout(cfg, &plan, report, failed, false, host)
            }
        }
    }

    /// Body or trailers arrived: they wait while the callout is in flight (letting them through
    /// would let Envoy forward the request before the decision).
    pub fn on_request_data(&self) -> Next {
        if matches!(self.phase, Phase::Calling { .. }) {
            Next::Pause
        } else {
            Next::Continue
        }
    }

    /// Whether `id` is the callout this request waits for.
    pub fn waits_for(&self, id: CalloutId) -> bool {
        matches!(self.phase, Phase::Calling { id: t, .. } if t == id)
            || self.slots.callout() == Some(id)
    }

    /// The stream ended, however it ended (response sent, upstream reset, client gone): what the
    /// request leaves behind, exactly once (a second call leaves nothing). What the response used
    /// beyond its reservation is spent from this proxy's fallback shares here (so an outage does
    /// not admit as if it had not been used), and locally held slots go back to the shared
    /// counters; the rest is for the adapter to carry out.
    pub fn on_end<H: Host>(&mut self, cfg: &Config, host: &mut H) -> Vec<Leftover> {
        let mut left = Vec::new();
        if let Some(meter) = self.meter.take() {
            let items = meter.finish(cfg);
            if !items.is_empty() {
                fallback::spend_extras(cfg, host.store(), &items, host.now_ms());
                left.push(Leftover::Settle(items));
            }
        }
        if let Phase::Calling { id, .. } = self.phase {
            self.phase = Phase::Done;
            left.push(Leftover::Abandoned { id });
        }
        left.extend(self.slots.end(cfg, host));
        left
    }

    /// The callout `token` ended with `result`. Ignored unless this request is paused on it.
    pub fn on_callout_result<H: Host>(
        &mut self,
        cfg: &Config,
        id: CalloutId,
        result: CalloutResult,
        host: &mut H,
    ) {
        if self.slots.callout() == Some(id) {
            self.slots.on_result(cfg, id, &result, host);
            return;
        }
        if !self.waits_for(id) {
            return;
        }
        let Phase::Calling {
            plan,
            probe,
            clean,
            since_ms,
            recovery,
            ..
        } = std::mem::replace(&mut self.phase, Phase::Done)
        else {
            return;
        };
        let now = host.now_ms();
        // A success after a clean admission records nothing (the steady path reads the breaker
        // once), unless it was slow: failures may have been counted while it was out, and a
        // service that answers resets them.
        let quiet = clean && now.saturating_sub(since_ms) < cfg.service.tick_ms();
        // A share of a batch's failure another take fed the breaker with is not counted again.
        let counted = !matches!(result, CalloutResult::Shared(_));
        let outcome = decide::interpret(&plan, result);
        if let Some((enforced, shadowed)) = decide::without_shadow(cfg, &plan, &outcome) {
            // Only shadow rules denied, and the service charges all or nothing: it charged none
            // of the enforced rules' buckets. Settle this answer, then ask again for those alone,
            // so shadow rules never change what enforced rules count.
            let report = Report {
                probe,
                quiet,
                counted,
                now,
                recovery,
            };
            self.record(cfg, report, true, host);
            give_back(cfg, &plan, recovery, host);
            settle(cfg, &plan, outcome, &mut self.watched, now, host);
            self.shadow_counts = shadowed;
            let mut enforced = enforced;
            let (_, debt) = breaker::admit_shared(host.store(), &cfg.breaker, now);
            let recovering = debt && fallback::attach_debts(cfg, &mut enforced, host.store(), now);
            // Asked again whatever the shares hold: they look at the answer.
            let recovery = match recovering || recovery != Recovery::None {
                true => Recovery::Check,
                false => Recovery::None,
            };
            match host.send(cfg, Callout::Take(&enforced)) {
                Ok(id) => {
                    self.phase = Phase::Calling {
                        id,
                        plan: enforced,
                        probe: false,
                        clean: false,
                        since_ms: now,
                        recovery,
                    };
                }
                Err(_) => {
                    let report = Report {
                        probe: false,
                        quiet: false,
                        counted: true,
                        now,
                        recovery,
                    };
                    let failed = Outcome::Failed(Cause::Dispatch);
                    self.after_callout(cfg, &enforced, report, failed, true, host);
                }
            }
            return;
        }
        let report = Report {
            probe,
            quiet,
            counted,
            now,
            recovery,
        };
        self.after_callout(cfg, &plan, report, outcome, true, host);
    }

    /// Feeds a callout's result to the breaker (nothing to do for a `quiet` success: quick, after
    /// a clean admission, so the steady path reads the shared state once).
    fn record<H: Host>(&self, cfg: &Config, report: Report, success: bool, host: &mut H) {
        if !breaker::needs_record(report.quiet, success) {
            return;
        }
        let (now, probe) = (report.now, report.probe);
        let event = breaker::record_shared(host.store(), &cfg.breaker, now, success, probe);
        if event != Event::None {
            host.count(Metric::Breaker(event));
        }
    }

    /// A callout ended or could not start: count it, feed the breaker, conclude. The breaker
    /// hears of a failure only when a callout failed (a take that was never sent, a breaker that
    /// refused, are no news of the service) and only once per failed callout
    /// ([`Report::counted`]; the probe's always). A request in recovery that prepaid its shares
    /// and was not admitted gives them back first ([`give_back`]), before the answer lowers them
    /// or the fallback takes from them.
    fn after_callout<H: Host>(
        &mut self,
        cfg: &Config,
        plan: &Plan,
        report: Report,
        outcome: Outcome,
        paused: bool,
        host: &mut H,
    ) -> Next {
        match outcome {
            Outcome::Failed(cause) if cause.is_callout() => {
                host.count(Metric::Failure(cause));
                if report.counted || report.probe {
                    self.record(cfg, report, false, host);
                }
            }
            Outcome::Failed(_) => {}
            _ => self.record(cfg, report, true, host),
        }
        if !matches!(outcome, Outcome::Allowed(_)) {
            give_back(cfg, plan, report.recovery, host);
        }
        let now = report.now;
        let outcome = settle(cfg, plan, outcome, &mut self.watched, now, host);
        if let (Recovery::Check, Outcome::Allowed(_)) = (report.recovery, &outcome) {
            // Admitted by the service (its debts repaid): the shares have the last word.
            let sh = fallback::Shares::of_plan(cfg, plan, host.store());
            let spend = fallback::Charge::SPEND;
            let paid = fallback::take_all_as(host.store(), &sh, &plan.request, now, spend);
            if !paid.allowed {
                // Not admitted: what the service charged for its cost goes back to the global
                // bucket, where the debts of the proxies not back yet find it (a window's
                // tokens end with their window: nothing to give back).
                let back: Vec<crate::core::wire::Bucket> = plan
                    .request
                    .buckets
                    .iter()
                    .filter(|b| bucket::refundable(b.algorithm.unwrap_or_default()))
                    .map(|b| crate::core::wire::Bucket {
                        lease: None,
                        ..b.clone()
                    })
                    .collect();
                if !back.is_empty() {
                    refund(cfg, &TakeRequest { buckets: back }, host);
                }
                let verdict = decide::from_shares(cfg, plan, &paid);
                return self.apply(cfg, plan, verdict, paused, now, host);
            }
        }
        self.conclude(cfg, plan, &outcome, paused, now, host)
    }

    /// Resolves the outcome at `now` into a verdict and applies it.
    fn conclude<H: Host>(
        &mut self,
        cfg: &Config,
        plan: &Plan,
        outcome: &Outcome,
        paused: bool,
        now: u64,
        host: &mut H,
    ) -> Next {
        let verdict = decide::resolve(cfg, plan, outcome, host.store(), now);
        if matches!(outcome, Outcome::Failed(Cause::Breaker))
            && cfg.failure_mode == crate::core::config::FailureMode::Fallback
        {
            // The breaker refused: this proxy's later requests look at their buckets' shares
            // for a recovery (`fallback::attach_debts`), also when it admitted nothing on credit.
            breaker::mark_debt(
                host.store(),
                now.saturating_add(fallback::debt_horizon_ms(cfg)),
            );
        }
        if let Outcome::Failed(cause) = *outcome {
            host.count(Metric::FailureMode(cause));
            debug!(
                "no answer from the service ({}): {}",
                cause.name(),
                verdict.decision.metric()
            );
        }
        self.apply(cfg, plan, verdict, paused, now, host)
    }

    /// Applies the verdict at `now`: let through (resuming only if paused) or reply locally.
    fn apply<H: Host>(
        &mut self,
        cfg: &Config,
        plan: &Plan,
        verdict: crate::core::wire::plan::Verdict,
        paused: bool,
        now: u64,
        host: &mut H,
    ) -> Next {
        host.count(Metric::Decision(verdict.decision));
        for &(rule, what) in verdict
            .rule_counts
            .iter()
            .chain(std::mem::take(&mut self.shadow_counts).iter())
        {
            host.count(Metric::Rule(rule, what));
        }
        if verdict.decision == Decision::FallbackAllowed {
            // Admitted on credit: the next callouts must carry the debt until it is repaid.
            breaker::mark_debt(
                host.store(),
                now.saturating_add(fallback::debt_horizon_ms(cfg)),
            );
        }
        if log::log_enabled!(log::Level::Debug) {
            for i in &verdict.denied_by {
                let rule = plan
                    .rules
                    .get(*i)
                    .and_then(|r| cfg.rules.get(*r))
                    .map_or("?", |r| r.name.as_str());
                let key = plan.request.buckets.get(*i).map_or("?", |b| b.key.as_str());
                debug!("{} rule={rule} key={key}", verdict.decision.metric());
            }
        }
        self.phase = Phase::Done;
        match verdict.action {
            Action::Allow(headers) => {
                if matches!(
                    verdict.decision,
                    Decision::Allowed | Decision::FallbackAllowed
                ) {
                    // The estimates were charged (by the service, or as fallback debt).
                    self.meter = crate::core::settle::reserve(cfg, plan);
                }
                self.response_headers = headers;
                if self.slots.wanted() {
                    return self.slots.acquire(cfg, paused, host);
                }
                if paused {
                    host.resume();
                }
                Next::Continue
            }
            Action::Deny(reply) => {
                host.reply(&reply);
                Next::Pause
            }
        }
    }
}

/// What a request in recovery prepaid from its shares ([`Recovery::Prepaid`]) goes back to them:
/// its callout did not admit it.
fn give_back<H: Host>(cfg: &Config, plan: &Plan, recovery: Recovery, host: &mut H) {
    if recovery == Recovery::Prepaid {
        let sh = fallback::Shares::of_plan(cfg, plan, host.store());
        fallback::refund_spent(host.store(), &sh, &plan.request, host.now_ms());
    }
}

/// Settles a callout's outcome (or why none was made) into the lease pools, and counts it. A
/// denial or failure that the pools can still pay (granted tokens stay good) becomes an admission
/// from the pools (counted as allowed, not as `lease.local`: it did make a callout); any other
/// outcome is returned as is.
fn settle<H: Host>(
    cfg: &Config,
    plan: &Plan,
    outcome: Outcome,
    watched: &mut Vec<lease::Held>,
    now: u64,
    host: &mut H,
) -> Outcome {
    // Only the service's own denials are remembered: one `settle_debts` makes of an admission whose
    // grant fell short of the debt it carried is about the debt, and the next callout repays more.
    let denied_by_service = matches!(outcome, Outcome::Limited(_));
    let (outcome, repaid) = fallback::settle_debts(plan, outcome);
    fallback::remember(cfg, plan, &outcome, &repaid, host.store(), now);
    if denied_by_service {
        let until = denials::remember(cfg, plan, &outcome, host.store(), now);
        if until > 0 {
            breaker::mark_denied(host.store(), until);
        }
    }
    let (granted, chores) = lease::settle(cfg, plan, &outcome, host.store(), now);
    if granted > 0 {
        host.count(Metric::Lease(Count::Granted, granted));
    }
    run_chores(cfg, chores, watched, host);
    if !matches!(outcome, Outcome::Allowed(_)) {
        if let Some(paid) = lease::rescue(cfg, plan, host.store(), now) {
            return paid;
        }
    }
    outcome
}

/// Sends what the lease pools left to do: expired tokens back to the service, and background
/// refills (not while the breaker is open: the requests' own callouts probe it). The pools this
/// worker deposited into go to `watched`, for the adapter's timer ([`lease::sweep`]).
fn run_chores<H: Host>(
    cfg: &Config,
    chores: lease::Chores,
    watched: &mut Vec<lease::Held>,
    host: &mut H,
) {
    if chores.dropped > 0 {
        host.count(Metric::Lease(Count::Expired, chores.dropped));
    }
    watched.extend(chores.watch);
    for r in &chores.returns {
        refund(cfg, r, host);
        let n = r.buckets.iter().map(|b| b.cost()).sum();
        host.count(Metric::Lease(Count::Returned, n));
    }
    if chores.refills.is_empty() {
        return;
    }
    let open = breaker::State::decode(
        host.store()
            .get(breaker::KEY)
            .as_ref()
            .map(|(v, _)| v.as_slice()),
    )
    .is_open();
    for plan in chores.refills {
        if open {
            lease::abandon(cfg, &plan, host.store());
            continue;
        }
        match host.send(cfg, Callout::Refill(&plan)) {
            Ok(_) => host.count(Metric::Lease(Count::Refills, 1)),
            Err(why) => {
                debug!("background lease refill not dispatched: {why}");
                lease::abandon(cfg, &plan, host.store());
            }
        }
    }
}

/// A background lease refill ended with `result`: its grant goes to the pool (or its denial is
/// cached, or its claim ends), the breaker and the fallback shares learn from it as from any
/// answer. No request waits for it. The pools this worker deposited into, for the adapter's
/// timer ([`lease::sweep`]).
#[must_use]
pub fn on_refill_result<H: Host>(
    cfg: &Config,
    plan: &Plan,
    result: CalloutResult,
    host: &mut H,
) -> Vec<lease::Held> {
    let counted = !matches!(result, CalloutResult::Shared(_));
    let outcome = decide::interpret(plan, result);
    let now = host.now_ms();
    // As a request's callout feeds it (`Flow::after_callout`), a success always.
    let feeds = match outcome {
        Outcome::Failed(cause) if cause.is_callout() => {
            host.count(Metric::Failure(cause));
            counted.then_some(false)
        }
        Outcome::Failed(_) => None,
        _ => Some(true),
    };
    if let Some(success) = feeds {
        let event = breaker::record_shared(host.store(), &cfg.breaker, now, success, false);
        if event != Event::None {
            host.count(Metric::Breaker(event));
        }
    }
    let (outcome, repaid) = fallback::settle_debts(plan, outcome);
    fallback::remember(cfg, plan, &outcome, &repaid, host.store(), now);
    let (granted, chores) = lease::refilled(cfg, plan, &outcome, host.store(), now);
    if granted > 0 {
        host.count(Metric::Lease(Count::Granted, granted));
    }
    let mut watched = Vec::new();
    run_chores(cfg, chores, &mut watched, host);
    watched
}

/// A settlement was applied: a denial this Envoy remembered of a bucket it gave tokens back to no
/// longer holds.
pub fn settlement_applied<S: CasStore + ?Sized>(cfg: &Config, items: &[settle::Item], store: &S) {
    denials::forget(cfg, settle::given_back(items), store);
}

/// Sends `request`'s costs back to the global bucket as unspent tokens, not awaited. A denial this
/// Envoy remembered of those buckets no longer holds once they are back.
fn refund<H: Host>(cfg: &Config, request: &TakeRequest, host: &mut H) {
    if let Err(why) = host.send(cfg, Callout::Refund(request)) {
        debug!("refund not dispatched: {why}");
        return;
    }
    denials::forget(cfg, &request.buckets, host.store());
}

/// An answer on the stream, `result`, to a message that failed at its deadline, whose takes were
/// `takes` (`None`: one whose request had gone): each of them went on without it (the failure
/// mode decided it), so what it granted, no request spends. Those tokens go back to the global
/// bucket as unspent ones, so nothing is charged twice: a token bucket's, by refund (one refund
/// per bucket, at most [`contract::bounds::MAX_BUCKETS`] buckets each); a window's tokens cannot
/// be given back. A denial or an error needs nothing.
pub fn late_answer<H: Host>(
    cfg: &Config,
    takes: &[Option<TakeRequest>],
    result: CalloutResult,
    host: &mut H,
) {
    let answers = match result {
        CalloutResult::Answers(a) if a.len() == takes.len() => a,
        _ => Vec::new(),
    };
    let mut back: Vec<crate::core::wire::Bucket> = Vec::new();
    for (take, answer) in takes.iter().zip(&answers) {
        let Some(take) = take.as_ref().filter(|_| answer.allowed) else {
            continue;
        };
        for (b, r) in take.buckets.iter().zip(&answer.buckets) {
            if !crate::core::local::bucket::refundable(b.algorithm.unwrap_or_default()) {
                continue;
            }
            // What this take was charged: its grant (its cost, debt and lease included), or its
            // cost from a service that reports no grant.
            let n = if r.granted > 0 { r.granted } else { b.cost() };
            let same = |o: &crate::core::wire::Bucket| {
                (&o.key, o.capacity, o.rate, o.period_ms, o.algorithm)
                    == (&b.key, b.capacity, b.rate, b.period_ms, b.algorithm)
            };
            match back.iter_mut().find(|o| same(o)) {
                Some(o) => o.cost = Some(o.cost.unwrap_or(0).saturating_add(n)),
                None => back.push(crate::core::wire::Bucket {
                    cost: Some(n),
                    lease: None,
                    ..b.clone()
                }),
            }
        }
    }
    let returned = back.iter().map(|b| b.cost.unwrap_or(0)).sum();
    for buckets in back.chunks(contract::bounds::MAX_BUCKETS) {
        let request = TakeRequest {
            buckets: buckets.to_vec(),
        };
        refund(cfg, &request, host);
    }
    host.count(Metric::Late { returned });
}

/// The timer's look at the lease pools this worker deposited into (`held`): tokens left unspent
/// past their age go back to the service.
pub fn sweep<H: Host>(cfg: &Config, held: &mut Vec<lease::Held>, host: &mut H) {
    let now = host.now_ms();
    let (returns, tokens) = lease::sweep(host.store(), held, now);
    for r in &returns {
        refund(cfg, r, host);
    }
    if tokens > 0 {
        host.count(Metric::Lease(Count::Expired, tokens));
        host.count(Metric::Lease(Count::Returned, tokens));
    }
}

/// How often the adapter's timer should call: as often as the stream's messages and the batch
/// queue need their deadlines looked at (`service.stream` or `service.batch`:
/// [`crate::core::config::Service::tick_ms`]), and at least as often as the settlements and lease
/// pools need (`chores_period_ms`); `None`: never.
pub fn tick_period_ms(cfg: &Config) -> Option<u32> {
    let svc = &cfg.service;
    let waits = (svc.stream || svc.batch > 0).then(|| u32::try_from(svc.tick_ms()).unwrap_or(50));
    match (waits, chores_period_ms(cfg)) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The timer the settlements and lease pools need: every first backoff of the settlements when
/// a rule is charged by the response, else to look at the lease pools for expired tokens, half
/// the shortest `max_age_ms` of the token-bucket lease rules, between 100 ms and a second;
/// `None`: never.
fn chores_period_ms(cfg: &Config) -> Option<u32> {
    if cfg.charges_by_response() {
        // Settlements are tried again from the timer (the first backoff is 100 ms).
        return u32::try_from(crate::core::settle::FIRST_BACKOFF_MS).ok();
    }
    let shortest = cfg
        .rules
        .iter()
        .filter_map(crate::core::config::Rule::rate_limit)
        .filter(|r| r.algorithm == crate::core::config::Algorithm::TokenBucket)
        .filter_map(|r| r.lease.map(|l| l.max_age_ms))
        .min()?;
    u32::try_from((shortest / 2).clamp(100, 1000)).ok()
}

#[cfg(test)]
mod tests {
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
    }

    impl Default for FakeHost {
        /// A host whose shared tables were prepared, as `on_configure` does.
        fn default() -> Self {
            let store = FakeStore::default();
            crate::core::local::fallback::prepare(&store, 10_000);
            crate::core::local::fallback::prepare_table(
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
                acquires: Vec::new(),
                releases: Vec::new(),
                slot_counts: Vec::new(),
                late: Vec::new(),
                decided_by: Vec::new(),
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
        fn send(&mut self, _: &Config, out: Callout<'_>) -> Result<CalloutId, String> {
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
            }
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
}
