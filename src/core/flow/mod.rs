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
//! A request's path reads top to bottom: [`decide::decide`] → the local stages before the call
//! (`stages`: lease pools, breaker, remembered denials, fallback shares; the first that answers
//! decides) → the callout → [`decide::interpret`] → the stages after the answer (each brings its
//! state in step, then says what it admits instead) → [`decide::resolve`] (pure) → the verdict
//! applied. The breaker's refusal and a dispatch error take the same way after the call.
//!
//! After an outage a request may be in recovery ([`Recovery`], `fallback::attach_debts`): its
//! fallback shares must pay for it as well as the service. They are asked before the callout
//! (a request they cannot pay is denied on the spot, as in the outage); the breaker's probe and
//! a request carrying a debt call anyway, and the shares look at the answer.
//!
//! `slots`: a request's concurrency slots ([`crate::core::inflight`]) as the flow drives them;
//! `stages`: the local stages; `background`: what no request waits for (a refill's answer, a late
//! answer, the pools' sweep, the timer's period).

use crate::core::base::ledger::CalloutId;
use crate::core::base::store::CasStore;
use crate::core::config::{Config, ModelSource};
use crate::core::decide;
use crate::core::local::breaker::{self, Admission, Event};
use crate::core::local::fallback;
use crate::core::local::lease::{self, Count};
use crate::core::rules::model::{Found, ModelScan};
use crate::core::rules::Request;
use crate::core::wire::plan::{
    Action, CalloutResult, Cause, Decision, LocalReply, Outcome, Plan, RuleCount, Step,
};
use crate::core::wire::{TakeRequest, TakeResponse};
use log::debug;

mod background;
mod slots;
mod stages;
pub use background::{
    late_answer, on_refill_result, settlement_applied, sweep, tick_period_ms, HOLD_TICK_MS,
};
pub use slots::{release, Slots};
use stages::{refund, Early};

/// What the state machine needs from the proxy: I/O alone (shared data, the clock, starting a
/// callout, resuming or answering the request, counting), and what applying the configuration
/// read of shared data ([`Applied`]). Whatever a request leaves behind when
/// it ends comes back from [`Flow::on_end`] as [`Leftover`] values.
pub trait Host {
    /// The shared store (fallback buckets, breaker, pools, slots).
    type Store: CasStore + ?Sized;
    /// The shared store.
    fn store(&self) -> &Self::Store;
    /// Wall-clock time in ms since the epoch.
    fn now_ms(&self) -> u64;
    /// Starts `callout`; its id in the ledger, or why it could not start.
    fn send(&mut self, cfg: &Config, callout: Callout<'_>) -> Result<CalloutId, Unsent>;
    /// Resumes the paused request.
    fn resume(&mut self);
    /// Sends a local reply (the request ends there).
    fn reply(&mut self, reply: &LocalReply);
    /// Counts `metric`.
    fn count(&mut self, metric: Metric);
    /// Shaping: a place for one more request of rule `rule` held (or asked to be held) in this
    /// worker, at most `max`; whether there was one.
    fn place(&mut self, rule: usize, max: u32) -> bool;
    /// A place of rule `rule` ([`Host::place`]) given back.
    fn unplace(&mut self, rule: usize);
    /// What applying the configuration learned of this Envoy (kept apart from the immutable
    /// [`Config`]).
    fn applied(&self) -> &Applied;
}

/// Why a callout did not start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsent {
    /// What went wrong, for the log.
    pub why: String,
    /// A bound of this worker refused it (its batch queue was full): no news of the service,
    /// so the breaker does not count it, and the failure mode decides with cause `queued`.
    pub local: bool,
}

impl From<String> for Unsent {
    fn from(why: String) -> Unsent {
        Unsent { why, local: false }
    }
}

impl From<&str> for Unsent {
    fn from(why: &str) -> Unsent {
        Unsent::from(why.to_string())
    }
}

impl std::fmt::Display for Unsent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

/// What the adapter learned of this Envoy's shared data when it applied a configuration: runtime
/// state beside the immutable [`Config`], never part of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// This Envoy's instance id, which every callout carries (`crate::core::wire::instance`;
    /// `None`: callouts without an id, as in native tests).
    pub instance: Option<String>,
    /// The fallback table sizes earlier configurations of this Envoy used, newest first (0: none;
    /// [`crate::core::local::fallback::prepare_for`]), so that a share or a debt recorded under
    /// another `fallback.max_keys` is carried over instead of starting afresh.
    pub previous_max_keys: [u32; 3],
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
    /// A held request (shaping).
    Shape(Shaped),
}

/// What happens to held requests (shaping), counted as `tollgate.shape.*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shaped {
    /// A request granted for later is held (`held_total`; the `held` gauge up).
    Held,
    /// A held request was let through at its time (the `held` gauge down).
    Let,
    /// A held request's client went away before it was let through (the `held` gauge down); the
    /// tokens it gave back (`returned`).
    Left {
        /// Tokens given back.
        returned: u64,
    },
    /// A grant for later whose client went away before its answer came (it was never held):
    /// the tokens it gave back (`returned`).
    Returned(u64),
    /// A take asked for unshaped: its rule had no place left (`full`).
    Full,
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
        /// What it asked, when a bucket of it shapes: a grant for later that its answer brings
        /// goes back ([`abandoned_answer`]).
        shaped: Option<Box<Plan>>,
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

/// The answer, `result`, to the take of a request that went away while it was in flight
/// (`plan`: what it asked, a bucket of it shaping): a grant for later (shaping's `delay_ms`)
/// was not yet due, so its tokens go back, as a held request's do when its client leaves; a grant
/// for now was spent (as any admitted request whose client left), a denial took nothing.
pub fn abandoned_answer<H: Host>(cfg: &Config, plan: &Plan, result: CalloutResult, host: &mut H) {
    let Outcome::Allowed(resp) = decide::interpret(plan, result) else {
        return;
    };
    if resp.delay_ms == 0 {
        return;
    }
    let back = stages::shape::unspent(plan);
    if let Some(r) = &back {
        refund(cfg, r, host);
    }
    let returned = back.map_or(0, |r| r.buckets.iter().map(|b| b.cost()).sum());
    host.count(Metric::Shape(Shaped::Returned(returned)));
}

/// What the end of a request's callout tells the breaker (its stage, `stages::breaker`).
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
    /// The request waits for its body's model ([`ModelSource::Body`]): read as the body arrives,
    /// the body held by Envoy meanwhile; decided once it is found or known absent. The request as
    /// its headers were read is kept (the host gives no headers after their phase).
    Reading {
        /// The body's scan.
        scan: ModelScan,
        /// The request, its model not read yet.
        req: Box<Request>,
    },
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
    /// Granted for later (shaping): paused until `until_ms`, when the adapter's timer lets it
    /// through ([`Flow::on_release`]).
    Held {
        /// When it may go (ms).
        until_ms: u64,
        /// When it was granted (ms).
        since_ms: u64,
        /// What was asked (its places, and what it gives back if its client leaves first).
        plan: Plan,
        /// Headers for the upstream's response.
        headers: Vec<(String, String)>,
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
    /// The model the request asked for, once read (prices by the model: [`Flow::go`]).
    pub model: Option<String>,
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
            model: None,
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
        if let (Some(ModelSource::Body(max)), None, false) =
            (&cfg.model, &req.model, req.end_of_stream)
        {
            if decide::reads_model(cfg, req) {
                self.phase = Phase::Reading {
                    scan: ModelScan::new(*max),
                    req: Box::new(req.clone()),
                };
                return Next::Pause;
            }
        }
        self.model.clone_from(&req.model);
        let matched = decide::decide(cfg, req);
        for (rule, count) in matched.counts {
            host.count(Metric::Rule(rule, count));
        }
        self.slots.want(matched.slots);
        let mut plan = match matched.step {
            Step::Continue => {
                self.phase = Phase::Done;
                return self.slots.acquire(cfg, false, host);
            }
            Step::Callout(plan) => plan,
        };
        let now = host.now_ms();
        let mut cx = stages::Cx::new(cfg, host, now, &mut self.shadow_counts, &mut self.watched);
        let early = stages::before(&mut cx, &mut plan);
        let (seen, recovery) = (cx.seen, cx.recovery);
        match early {
            Some(Early::Outcome(outcome)) => {
                return self.conclude(cfg, &plan, &outcome, None, false, host)
            }
            Some(Early::Verdict(verdict)) => return self.apply(cfg, &plan, verdict, false, host),
            Some(Early::Refused(cause)) => {
                let report = Report {
                    probe: false,
                    quiet: false,
                    counted: false,
                    now,
                    recovery,
                };
                let failed = Outcome::Failed(cause);
                return self.after_callout(cfg, &plan, report, failed, false, host);
            }
            None => {}
        }
        let (probe, clean) = match seen {
            Some(seen) => (seen.admission == Admission::Probe, seen.clean),
            None => (false, false),
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
                    counted: !why.local,
                    now,
                    recovery,
                };
                // A full queue is this worker's own bound, not a failure of the service.
                let cause = if why.local {
                    Cause::Queued
                } else {
                    Cause::Dispatch
                };
                let failed = Outcome::Failed(cause);
                self.after_callout(cfg, &plan, report, failed, false, host)
            }
        }
    }

    /// Body or trailers arrived: they wait while the callout is in flight (letting them through
    /// would let Envoy forward the request before the decision).
    pub fn on_request_data(&self) -> Next {
        if matches!(
            self.phase,
            Phase::Calling { .. } | Phase::Held { .. } | Phase::Reading { .. }
        ) {
            Next::Pause
        } else {
            Next::Continue
        }
    }

    /// The body bytes read for the model so far (`None`: not reading it).
    pub fn body_read(&self) -> Option<usize> {
        match &self.phase {
            Phase::Reading { scan, .. } => Some(scan.seen()),
            _ => None,
        }
    }

    /// The next piece of the body while its model is read (`end`: the body ended): once the scan
    /// is over, the request as its headers were read, its model set (`None` when absent), to be
    /// decided ([`Flow::on_request_headers`]); `None` while the scan goes on.
    pub fn on_body_for_model(&mut self, chunk: &[u8], end: bool) -> Option<Request> {
        let Phase::Reading { scan, .. } = &mut self.phase else {
            return None;
        };
        let model = match scan.feed(chunk, end) {
            Found::Reading => return None,
            Found::Model(m) => Some(m.clone()),
            Found::Absent => None,
        };
        let Phase::Reading { req, .. } = std::mem::replace(&mut self.phase, Phase::Idle) else {
            return None;
        };
        let mut req = *req;
        req.model = model;
        req.end_of_stream = true;
        Some(req)
    }

    /// When a held request may go ([`Phase::Held`]); `None`: it is not held.
    pub fn held_until(&self) -> Option<u64> {
        match self.phase {
            Phase::Held { until_ms, .. } => Some(until_ms),
            _ => None,
        }
    }

    /// A held request's time came: it goes on (its concurrency slots taken first, if it wants
    /// some), its place given back, and the client told how long it was held.
    pub fn on_release<H: Host>(&mut self, cfg: &Config, host: &mut H) {
        let Phase::Held {
            since_ms,
            plan,
            mut headers,
            ..
        } = std::mem::replace(&mut self.phase, Phase::Done)
        else {
            return;
        };
        stages::shape::free_places(&plan, host);
        host.count(Metric::Shape(Shaped::Let));
        let held = host.now_ms().saturating_sub(since_ms);
        headers.push((HELD_HEADER.to_string(), held.to_string()));
        // Only the service's own admission is held: its estimates were charged.
        self.go(cfg, &plan, headers, Some(&[]), true, host);
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
                let previous = host.applied().previous_max_keys;
                fallback::spend_extras(cfg, previous, host.store(), &items, host.now_ms());
                left.push(Leftover::Settle(items));
            }
        }
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Calling { id, plan, .. } => {
                stages::shape::free_places(&plan, host);
                let shapes = plan.request.buckets.iter().any(|b| b.max_delay_ms > 0);
                left.push(Leftover::Abandoned {
                    id,
                    shaped: shapes.then(|| Box::new(plan)),
                });
            }
            // Granted for later, never let through: its tokens go back, so those held after it
            // wait less.
            Phase::Held { plan, .. } => {
                stages::shape::free_places(&plan, host);
                let back = stages::shape::unspent(&plan);
                if let Some(r) = &back {
                    refund(cfg, r, host);
                }
                let returned = back.map_or(0, |r| r.buckets.iter().map(|b| b.cost()).sum());
                host.count(Metric::Shape(Shaped::Left { returned }));
            }
            phase => self.phase = phase,
        }
        left.extend(self.slots.end(host));
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
            let denied_by_service = matches!(outcome, Outcome::Limited(_));
            let mut cx =
                stages::Cx::new(cfg, host, now, &mut self.shadow_counts, &mut self.watched);
            cx.report = Some(report);
            cx.recovery = recovery;
            cx.denied_by_service = denied_by_service;
            let outcome = stages::after(&mut cx, &plan, outcome);
            // Not concluded: the pools may still pay for it, as for any denial (what they admit
            // is not this request's verdict); the shares' last word waits for the next answer.
            cx.recovery = Recovery::None;
            let _ = stages::admit(&mut cx, &plan, outcome);
            self.shadow_counts = shadowed;
            let mut enforced = enforced;
            let (_, debt) = breaker::admit_shared(host.store(), &cfg.breaker, now);
            let previous = host.applied().previous_max_keys;
            let recovering =
                debt && fallback::attach_debts(cfg, previous, &mut enforced, host.store(), now);
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

    /// A callout ended or could not start (or the breaker refused it): the stages bring their
    /// state in step with the outcome ([`stages::after`]), then say what they admit instead
    /// ([`stages::admit`]), and the verdict is resolved.
    fn after_callout<H: Host>(
        &mut self,
        cfg: &Config,
        plan: &Plan,
        report: Report,
        outcome: Outcome,
        paused: bool,
        host: &mut H,
    ) -> Next {
        let now = report.now;
        let mut cx = stages::Cx::new(cfg, host, now, &mut self.shadow_counts, &mut self.watched);
        cx.report = Some(report);
        cx.recovery = report.recovery;
        cx.denied_by_service = matches!(outcome, Outcome::Limited(_));
        let outcome = stages::after(&mut cx, plan, outcome);
        let admitted = stages::admit(&mut cx, plan, outcome);
        let shares = cx.shares.take();
        match admitted {
            Ok(outcome) => self.conclude(cfg, plan, &outcome, shares.as_ref(), paused, host),
            Err(verdict) => self.apply(cfg, plan, verdict, paused, host),
        }
    }

    /// Resolves the outcome into a verdict (`shares`: what the fallback shares answered for a
    /// failure) and applies it.
    fn conclude<H: Host>(
        &mut self,
        cfg: &Config,
        plan: &Plan,
        outcome: &Outcome,
        shares: Option<&TakeResponse>,
        paused: bool,
        host: &mut H,
    ) -> Next {
        let verdict = decide::resolve(cfg, plan, outcome, shares);
        let delay_ms = match outcome {
            Outcome::Allowed(r) if paused => r.delay_ms,
            _ => 0,
        };
        if let Outcome::Failed(cause) = *outcome {
            host.count(Metric::FailureMode(cause));
            debug!(
                "no answer from the service ({}): {}",
                cause.name(),
                verdict.decision.metric()
            );
        }
        self.hold_or_apply(cfg, plan, verdict, delay_ms, paused, host)
    }

    /// Applies the verdict: let through (resuming only if paused) or reply locally.
    fn apply<H: Host>(
        &mut self,
        cfg: &Config,
        plan: &Plan,
        verdict: crate::core::wire::plan::Verdict,
        paused: bool,
        host: &mut H,
    ) -> Next {
        self.hold_or_apply(cfg, plan, verdict, 0, paused, host)
    }

    /// Applies the verdict; an admission granted `delay_ms` ahead (shaping, a paused request
    /// only) is held until then instead ([`Phase::Held`]). A request not held gives back the
    /// places its shaped buckets took.
    fn hold_or_apply<H: Host>(
        &mut self,
        cfg: &Config,
        plan: &Plan,
        verdict: crate::core::wire::plan::Verdict,
        delay_ms: u64,
        paused: bool,
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
        let held = delay_ms > 0 && matches!(verdict.action, Action::Allow(_));
        if !held {
            stages::shape::free_places(plan, host);
        }
        match verdict.action {
            Action::Allow(headers) if held => {
                let now = host.now_ms();
                host.count(Metric::Shape(Shaped::Held));
                self.phase = Phase::Held {
                    until_ms: now.saturating_add(delay_ms),
                    since_ms: now,
                    plan: plan.clone(),
                    headers,
                };
                Next::Pause
            }
            Action::Allow(headers) => {
                // The estimates were charged (by the service, or as fallback debt).
                let charged = matches!(
                    verdict.decision,
                    Decision::Allowed | Decision::FallbackAllowed
                );
                let windows = charged.then_some(&*verdict.windows);
                self.go(cfg, plan, headers, windows, paused, host)
            }
            Action::Deny(reply) => {
                host.reply(&reply);
                Next::Pause
            }
        }
    }

    /// An admitted request goes on: what rules charged by the response reserved is metered (if
    /// the estimates were charged: `charged`, with the windows the service charged them in), its
    /// concurrency slots are taken (if it wants some), and it is resumed if paused.
    fn go<H: Host>(
        &mut self,
        cfg: &Config,
        plan: &Plan,
        headers: Vec<(String, String)>,
        charged: Option<&[u64]>,
        paused: bool,
        host: &mut H,
    ) -> Next {
        if let Some(windows) = charged {
            self.meter = crate::core::settle::reserve(cfg, plan, windows, self.model.as_deref());
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
}

/// The header a held request's response carries: how long it was held (ms).
pub const HELD_HEADER: &str = "x-ratelimit-delay-ms";

#[cfg(test)]
mod tests;
