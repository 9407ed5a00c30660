//! The filter's metrics: the ids each configuration defines, and what each of the core's
//! [`Metric`]s adds to (`tollgate.*` counters and gauges, as docs/operations.md lists them).

use super::abi::{Abi, MetricKind, Status};
use crate::core::config::Config;
use crate::core::flow::{Metric, Shaped};
use crate::core::inflight;
use crate::core::local::breaker::Event;
use crate::core::local::lease;
use crate::core::wire::plan::{Cause, Decision, RuleCount};
use log::{debug, info, warn};

/// Metric ids, defined once per configuration.
pub(super) struct Metrics {
    /// `tollgate.batch.callouts` and `tollgate.batch.takes`: batch callouts and the takes they
    /// carried.
    batch_callouts: u32,
    batch_takes: u32,
    /// `tollgate.callouts.collided`: tokens Envoy handed out while an entry of the VM's ledger
    /// still held them (the callout that entry waited for failed).
    collided: u32,
    decisions: Vec<u32>,
    /// Per rule (in configuration order), one id per [`RuleCount::ALL`] (none for a rule of
    /// another kind than rate: those count `inflight`).
    rules: Vec<Vec<u32>>,
    failures: Vec<u32>,
    /// `tollgate.failure_mode.<cause>`, one id per [`Cause::ALL`]: requests the failure mode
    /// decided, by why the service did not.
    failure_modes: Vec<u32>,
    breaker_opened: u32,
    breaker_open: u32,
    leases: Vec<u32>,
    /// One id per [`inflight::Count::ALL`] (empty without concurrency rules).
    inflight: Vec<u32>,
    /// One id per [`SettleCount::ALL`] (empty without rules charged by the response).
    settles: Vec<u32>,
    /// `tollgate.stream.late` and `tollgate.stream.returned` (with `service.stream` only):
    /// answers to messages that had failed at their deadline, and the tokens they granted that
    /// went back to the service.
    late: Option<(u32, u32)>,
    /// `tollgate.shape.held` (gauge), `held_total`, `full`, `returned` (when a rule shapes).
    shape: Option<[u32; 4]>,
}

/// What happens to settlements, counted as `tollgate.settle.<name>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SettleCount {
    /// Settle callouts sent (first attempts and retries).
    Sent,
    /// Settlements the service applied (or had applied before).
    Delivered,
    /// Attempts that failed and will be tried again.
    Retried,
    /// Settlements never applied: attempts exhausted, refused, or dropped from a full queue.
    GivenUp,
}

impl SettleCount {
    const ALL: [SettleCount; 4] = [
        SettleCount::Sent,
        SettleCount::Delivered,
        SettleCount::Retried,
        SettleCount::GivenUp,
    ];

    fn metric(self) -> &'static str {
        match self {
            SettleCount::Sent => "tollgate.settle.sent",
            SettleCount::Delivered => "tollgate.settle.delivered",
            SettleCount::Retried => "tollgate.settle.retried",
            SettleCount::GivenUp => "tollgate.settle.given_up",
        }
    }
}

impl Metrics {
    pub(super) fn define(abi: &impl Abi, cfg: &Config) -> Result<Metrics, Status> {
        let mut decisions = Vec::with_capacity(Decision::ALL.len());
        for d in Decision::ALL {
            decisions.push(abi.define_metric(MetricKind::Counter, d.metric())?);
        }
        let mut rules = Vec::with_capacity(cfg.rules.len());
        for r in &cfg.rules {
            let mut ids = Vec::with_capacity(RuleCount::ALL.len());
            if r.rate_limit().is_some() {
                for c in RuleCount::ALL {
                    ids.push(abi.define_metric(MetricKind::Counter, &c.metric(&r.name))?);
                }
            }
            rules.push(ids);
        }
        let mut failures = Vec::with_capacity(Cause::CALLOUT.len());
        for c in Cause::CALLOUT {
            let name = format!("tollgate.callout_failure.{}", c.name());
            failures.push(abi.define_metric(MetricKind::Counter, &name)?);
        }
        let mut failure_modes = Vec::with_capacity(Cause::ALL.len());
        for c in Cause::ALL {
            let name = format!("tollgate.failure_mode.{}", c.name());
            failure_modes.push(abi.define_metric(MetricKind::Counter, &name)?);
        }
        let mut leases = Vec::with_capacity(lease::Count::ALL.len());
        for c in lease::Count::ALL {
            leases.push(abi.define_metric(MetricKind::Counter, c.metric())?);
        }
        let mut inflight = Vec::new();
        if cfg.rules.iter().any(|r| r.concurrency().is_some()) {
            for c in inflight::Count::ALL {
                inflight.push(abi.define_metric(MetricKind::Counter, c.metric())?);
            }
        }
        let mut settles = Vec::new();
        if cfg.charges_by_response() {
            for c in SettleCount::ALL {
                settles.push(abi.define_metric(MetricKind::Counter, c.metric())?);
            }
        }
        let late = match cfg.service.stream {
            true => Some((
                abi.define_metric(MetricKind::Counter, "tollgate.stream.late")?,
                abi.define_metric(MetricKind::Counter, "tollgate.stream.returned")?,
            )),
            false => None,
        };
        let shape = match cfg.shapes() {
            true => Some([
                abi.define_metric(MetricKind::Gauge, "tollgate.shape.held")?,
                abi.define_metric(MetricKind::Counter, "tollgate.shape.held_total")?,
                abi.define_metric(MetricKind::Counter, "tollgate.shape.full")?,
                abi.define_metric(MetricKind::Counter, "tollgate.shape.returned")?,
            ]),
            false => None,
        };
        Ok(Metrics {
            shape,
            inflight,
            settles,
            late,
            batch_callouts: abi.define_metric(MetricKind::Counter, "tollgate.batch.callouts")?,
            batch_takes: abi.define_metric(MetricKind::Counter, "tollgate.batch.takes")?,
            collided: abi.define_metric(MetricKind::Counter, "tollgate.callouts.collided")?,
            decisions,
            rules,
            failures,
            failure_modes,
            leases,
            breaker_opened: abi.define_metric(MetricKind::Counter, "tollgate.breaker.opened")?,
            breaker_open: abi.define_metric(MetricKind::Gauge, "tollgate.breaker.open")?,
        })
    }
}

/// Gauges of the VM itself (defined at the first configuration). Both are process-wide sums: each
/// VM adds and subtracts its own share.
pub(super) struct VmGauges {
    /// `tollgate.callouts.pending`: callouts whose request still waits for them.
    pub(super) pending: u32,
    /// `tollgate.vm.memory_bytes`: linear memory of the VMs.
    pub(super) memory: u32,
}

impl Metrics {
    /// A batch callout carrying `takes` takes.
    pub(super) fn batched(&self, abi: &impl Abi, takes: usize) {
        abi.increment_metric(self.batch_callouts, 1);
        abi.increment_metric(self.batch_takes, i64::try_from(takes).unwrap_or(i64::MAX));
    }

    /// A token Envoy handed out met an entry still in the ledger.
    pub(super) fn collided(&self, abi: &impl Abi) {
        abi.increment_metric(self.collided, 1);
    }

    /// `n` settlements `what`.
    pub(super) fn settled(&self, abi: &impl Abi, what: SettleCount, n: u64) {
        add(abi, &self.settles, nth(&SettleCount::ALL, &what), n);
    }

    /// Counts what the core's flow counts (a breaker transition is also logged).
    pub(super) fn count(&self, abi: &impl Abi, metric: Metric) {
        match metric {
            Metric::Decision(d) => add(abi, &self.decisions, nth(&Decision::ALL, &d), 1),
            Metric::Rule(rule, what) => {
                if let Some(ids) = self.rules.get(rule) {
                    add(abi, ids, nth(&RuleCount::ALL, &what), 1);
                }
            }
            Metric::Failure(cause) => add(abi, &self.failures, nth(&Cause::CALLOUT, &cause), 1),
            Metric::FailureMode(cause) => {
                add(abi, &self.failure_modes, nth(&Cause::ALL, &cause), 1);
            }
            Metric::Lease(count, n) => add(abi, &self.leases, nth(&lease::Count::ALL, &count), n),
            Metric::Slots(count) => add(abi, &self.inflight, nth(&inflight::Count::ALL, &count), 1),
            Metric::Late { returned } => {
                if let Some((late, back)) = self.late {
                    abi.increment_metric(late, 1);
                    add(abi, &[back], Some(0), returned);
                }
            }
            Metric::Breaker(Event::Opened) => {
                abi.increment_metric(self.breaker_opened, 1);
                abi.record_metric(self.breaker_open, 1);
                warn!("circuit breaker opened: the decision service is failing, using the failure mode");
            }
            Metric::Breaker(Event::Reopened) => debug!("breaker probe failed, staying open"),
            Metric::Breaker(Event::Closed) => {
                abi.record_metric(self.breaker_open, 0);
                info!("circuit breaker closed: the decision service answers again");
            }
            Metric::Breaker(Event::None) => {}
            Metric::Shape(what) => {
                let Some([held, total, full, returned]) = self.shape else {
                    return;
                };
                match what {
                    Shaped::Held => {
                        abi.increment_metric(held, 1);
                        abi.increment_metric(total, 1);
                    }
                    Shaped::Let => abi.increment_metric(held, -1),
                    Shaped::Left { returned: n } => {
                        abi.increment_metric(held, -1);
                        add(abi, &[returned], Some(0), n);
                    }
                    Shaped::Returned(n) => add(abi, &[returned], Some(0), n),
                    Shaped::Full => abi.increment_metric(full, 1),
                }
            }
        }
    }
}

/// Adds `n` to the counter of `ids` at `idx` (none: a metric this configuration did not define).
fn add(abi: &impl Abi, ids: &[u32], idx: Option<usize>, n: u64) {
    if let Some(&id) = idx.and_then(|i| ids.get(i)) {
        abi.increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
    }
}

fn nth<T: PartialEq>(all: &[T], x: &T) -> Option<usize> {
    all.iter().position(|y| y == x)
}
