//! The proxy-wasm ABI as Envoy drives it: contexts, callouts and their bookkeeping, over an [`Abi`]
//! (Envoy's imports in the module, a fake in the tests).
//!
//! Envoy makes every callout on the plugin's root context: the reply comes back with the root's
//! context id and the callout's token. Every callout this VM starts, whatever it is for (a
//! request's take or acquire, a batch, a lease refill, a refund, a release, a settlement), is one
//! entry of one VM-wide [`Ledger`], recorded by [`Proxy`] the moment it is dispatched; its
//! [`Waiter`] says who waits for the answer, and an answer is one `match` ([`Dispatcher::deliver`]).
//!
//! - A request whose client goes away while its callout is in flight is deleted
//!   (`proxy_on_delete`) without any word about the callout; Envoy 1.40 still delivers the answer
//!   (to the root). The entry stays and its waiter becomes the root's: an abandoned take is
//!   dropped when answered (it still held the batch queue back until then), an orphaned acquire
//!   gives back the slot it was granted.
//! - A root context that goes (a configuration push) takes its callouts with it, silently: its
//!   entries are expired then ([`Ledger::close_root`]): a request still waiting gets the failure
//!   path, settlements in flight or queued go to the configuration that calls the same service.
//! - A reply for a token nobody waits for is dropped.
//!
//! Nothing here panics: an unknown context id in any callback is a no-op.

use super::abi::{self, Abi, Buffer, HeaderMap, MetricKind, Status};
use crate::core::base::ledger::{IdMap, Ledger};
use crate::core::base::store::{CasStore, SetError};
use crate::core::config::{Config, FailureMode, HeaderMatch, Rule, Transport};
use crate::core::flow::{self, Flow, Host, Next, Phase};
use crate::core::inflight;
use crate::core::local::breaker::Event;
use crate::core::local::lease;
use crate::core::rules::{keys, matches_headers, Headers, Request};
use crate::core::settle;
use crate::core::wire::batch;
use crate::core::wire::callout::{self, CalloutRequest};
use crate::core::wire::plan::{CalloutResult, Cause, Decision, LocalReply, Plan, RuleCount};
use crate::core::wire::TakeRequest;
use contract::bounds::MAX_ANSWER_BYTES;
use log::{debug, error, info, warn};
use std::cell::RefCell;
use std::rc::Rc;

/// A stream callback's answer: go on (`FilterHeadersStatus` / `FilterDataStatus` `Continue`).
pub const CONTINUE: u32 = 0;
/// A stream callback's answer: stop (`StopIteration` / `StopIterationAndBuffer`).
pub const PAUSE: u32 = 1;

fn status_code(next: Next) -> u32 {
    match next {
        Next::Continue => CONTINUE,
        Next::Pause => PAUSE,
    }
}

/// The shortest timeout of a callout no request waits for (releases, refunds, settlements), ms.
const BACKGROUND_TIMEOUT_MS: u64 = 1000;

/// One configured plugin (a root context's configuration), shared by its requests.
struct Plugin {
    /// Its root context.
    root: u32,
    config: Config,
    metrics: Metrics,
    /// Shared-data key prefix ([`crate::core::local::fallback::state_prefix`]: a digest of the service
    /// cluster), so a configuration push keeps the fallback shares, lease pools and breaker.
    prefix: String,
    /// `authorization` value of every callout.
    bearer: Option<String>,
    /// The gRPC target as a serialised `GrpcService { envoy_grpc { cluster_name } }`: Envoy tries
    /// to parse the name it is given as that message first, and a cluster name whose bytes happen
    /// to parse (e.g. `abcdefghi`) makes it abort the whole process. Sent serialised, the cluster
    /// name is never read as protobuf.
    grpc_service: Vec<u8>,
    /// The headers whose first values decide whether any rule matches; `None` when some rule
    /// matches every request. Lets a request no rule matches be passed after reading only these.
    match_headers: Option<Vec<String>>,
    /// The headers the rules can read, each read by name for a request some rule may match;
    /// `None`: the whole header map is read (a rule needs every value of a header, or reads so
    /// many that one read of the map is cheaper).
    request_headers: Option<Vec<String>>,
    /// Group commit of this plugin's takes (`service.batch`): the requests queued for the next
    /// batch (their virtual tokens are the ledger's).
    queue: RefCell<batch::Queue>,
    /// Lease pools this worker deposited into, looked at on every tick ([`lease::sweep`]).
    held: RefCell<Vec<lease::Held>>,
    /// Settlements of responses that ended (rules charged by the response), delivered from here
    /// with bounded retries (an attempt in flight is a [`Waiter::Settle`] in the ledger).
    settles: RefCell<settle::Queue<Vec<settle::Item>>>,
}

/// How a callout's result is had: read from the host, only when someone wants it (a stray reply
/// costs no host calls), or already in hand (a batch member's share, a cancelled callout). One
/// `dyn` type, so the answer path is compiled once, not once per kind of reply.
trait Read<A> {
    fn read(&mut self, abi: &A) -> CalloutResult;
}

/// A result read from the host by the closure.
struct FromHost<F>(F);

impl<A, F: Fn(&A) -> CalloutResult> Read<A> for FromHost<F> {
    fn read(&mut self, abi: &A) -> CalloutResult {
        (self.0)(abi)
    }
}

/// A result in hand (read at most once; a second read cannot happen, and would be a failure).
struct Ready(Option<CalloutResult>);

impl<A> Read<A> for Ready {
    fn read(&mut self, _: &A) -> CalloutResult {
        self.0.take().unwrap_or(CalloutResult::DispatchError)
    }
}

/// Who waits for a callout's answer: the variant of a ledger entry.
enum Waiter {
    /// A request's take (or a request queued for the next batch, under a virtual token); `gates`:
    /// the callout holds the plugin's batch queue back until it ends.
    Take {
        context: u32,
        plugin: Rc<Plugin>,
        gates: bool,
    },
    /// A request's acquire of concurrency slots.
    Acquire { context: u32 },
    /// A batch callout, carrying the virtual tokens of its takes (each its own entry).
    Batch {
        plugin: Rc<Plugin>,
        members: Vec<u32>,
    },
    /// A background lease refill (no request waits).
    Refill {
        plugin: Rc<Plugin>,
        plan: Plan,
        gates: bool,
    },
    /// A refund of unspent lease tokens: nothing to do with the answer.
    Refund,
    /// A release of concurrency slots: its answer is counted.
    Release { plugin: Rc<Plugin> },
    /// The acquire of a request that ended first, the id it gave the slots and the keys it asked
    /// for: unless the answer is a denial (nothing taken), the slots go back at once, by name.
    Orphan {
        plugin: Rc<Plugin>,
        slot: String,
        keys: Vec<String>,
    },
    /// An attempt to deliver settlement `id`.
    Settle { plugin: Rc<Plugin>, id: String },
    /// The take of a request that went away: its answer is dropped (it still holds the batch
    /// queue back until it arrives).
    Abandoned { plugin: Rc<Plugin>, gates: bool },
}

impl Waiter {
    /// A request waits (a paused stream): what the `tollgate.callouts.pending` gauge counts.
    fn is_request(&self) -> bool {
        matches!(self, Waiter::Take { .. } | Waiter::Acquire { .. })
    }

    /// The plugin whose batch queue this callout holds back, if any.
    fn gate(&self) -> Option<&Rc<Plugin>> {
        match self {
            Waiter::Take {
                plugin,
                gates: true,
                ..
            }
            | Waiter::Refill {
                plugin,
                gates: true,
                ..
            }
            | Waiter::Abandoned {
                plugin,
                gates: true,
            }
            | Waiter::Batch { plugin, .. } => Some(plugin),
            _ => None,
        }
    }
}

/// Metric ids, defined once per configuration.
struct Metrics {
    /// `tollgate.batch.callouts` and `tollgate.batch.takes`: batch callouts and the takes they
    /// carried.
    batch_callouts: u32,
    batch_takes: u32,
    decisions: Vec<u32>,
    /// Per rule (in configuration order), one id per [`RuleCount::ALL`] (none for a rule of
    /// another kind than rate: those count `inflight`).
    rules: Vec<Vec<u32>>,
    failures: Vec<u32>,
    breaker_opened: u32,
    breaker_open: u32,
    leases: Vec<u32>,
    /// One id per [`inflight::Count::ALL`] (empty without concurrency rules).
    inflight: Vec<u32>,
    /// One id per [`SettleCount::ALL`] (empty without rules charged by the response).
    settles: Vec<u32>,
}

/// What happens to settlements, counted as `tollgate.settle.<name>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SettleCount {
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
    fn define(abi: &impl Abi, cfg: &Config) -> Result<Metrics, Status> {
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
        if charges_by_response(cfg) {
            for c in SettleCount::ALL {
                settles.push(abi.define_metric(MetricKind::Counter, c.metric())?);
            }
        }
        Ok(Metrics {
            inflight,
            settles,
            batch_callouts: abi.define_metric(MetricKind::Counter, "tollgate.batch.callouts")?,
            batch_takes: abi.define_metric(MetricKind::Counter, "tollgate.batch.takes")?,
            decisions,
            rules,
            failures,
            leases,
            breaker_opened: abi.define_metric(MetricKind::Counter, "tollgate.breaker.opened")?,
            breaker_open: abi.define_metric(MetricKind::Gauge, "tollgate.breaker.open")?,
        })
    }
}

/// Gauges of the VM itself (defined at the first configuration). Both are process-wide sums: each
/// VM adds and subtracts its own share.
struct VmGauges {
    /// `tollgate.callouts.pending`: callouts whose request still waits for them.
    pending: u32,
    /// `tollgate.vm.memory_bytes`: linear memory of the VMs.
    memory: u32,
}

impl Metrics {
    fn batched(&self, abi: &impl Abi, takes: usize) {
        abi.increment_metric(self.batch_callouts, 1);
        abi.increment_metric(self.batch_takes, i64::try_from(takes).unwrap_or(i64::MAX));
    }
}

fn nth<T: PartialEq>(all: &[T], x: &T) -> Option<usize> {
    all.iter().position(|y| y == x)
}

/// The proxy side of the core's [`Host`] port, acting for one request context (or for the root
/// itself: `context` 0). Every callout it starts is recorded in the ledger as it starts.
struct Proxy<'a, A: Abi> {
    abi: &'a A,
    plugin: &'a Rc<Plugin>,
    shared: Shared<'a, A>,
    ledger: &'a mut Ledger<Waiter>,
    context: u32,
}

impl<'a, A: Abi> Proxy<'a, A> {
    fn new(
        abi: &'a A,
        plugin: &'a Rc<Plugin>,
        ledger: &'a mut Ledger<Waiter>,
        context: u32,
    ) -> Self {
        Proxy {
            abi,
            plugin,
            shared: Shared {
                abi,
                prefix: &plugin.prefix,
            },
            ledger,
            context,
        }
    }

    /// Records callout `token` (just dispatched) in the ledger.
    fn open(&mut self, token: u32, waiter: Waiter) {
        if self.ledger.open(token, self.plugin.root, waiter).is_some() {
            warn!("callout token {token} handed out again while still in flight");
        }
    }

    /// Starts a take (`plan`'s, for `waiter`): sent now, or queued for the next batch when the
    /// plugin batches and one of its callouts is in flight. Its token (virtual if queued).
    fn take(&mut self, cfg: &Config, plan: &Plan, refill: bool) -> Result<u32, String> {
        let plugin = self.plugin.clone();
        // `service.trace`: a sampled request's callout carries its `traceparent`, and goes alone
        // (a batch has no one parent). Read here, so a configuration without it pays nothing.
        let trace = if cfg.service.trace && !refill {
            self.abi
                .header(HeaderMap::Request, callout::TRACEPARENT)
                .and_then(|v| callout::sampled_traceparent(&v))
        } else {
            None
        };
        let batching = cfg.service.batch > 0 && plan.rls.is_none() && trace.is_none();
        let waiter = |gates: bool| {
            if refill {
                Waiter::Refill {
                    plugin: plugin.clone(),
                    plan: plan.clone(),
                    gates,
                }
            } else {
                Waiter::Take {
                    context: self.context,
                    plugin: plugin.clone(),
                    gates,
                }
            }
        };
        if batching && self.plugin.queue.borrow().busy() {
            let token = self.ledger.reserve(self.plugin.root, waiter(false));
            let queued = self.plugin.queue.borrow_mut().push(
                batch::QUEUE_BATCHES * cfg.service.batch,
                token,
                &plan.request,
            );
            if let Err(why) = queued {
                self.ledger.close(token);
                return Err(why);
            }
            return Ok(token);
        }
        let timeout = cfg.service.timeout_ms;
        let sent = self.send_within(cfg, callout::take(cfg, plan), timeout, trace.as_deref());
        let token = sent.map_err(|why| {
            warn!(
                "callout to cluster {:?} failed to dispatch: {why}",
                cfg.service.cluster
            );
            why
        })?;
        if batching {
            self.plugin.queue.borrow_mut().started();
        }
        let w = waiter(batching);
        self.open(token, w);
        Ok(token)
    }

    /// Dispatches `request` to the service cluster, with its timeout and bearer token; the
    /// callout's token.
    fn send(&self, cfg: &Config, request: CalloutRequest) -> Result<u32, String> {
        self.send_within(cfg, request, cfg.service.timeout_ms, None)
    }

    /// [`Proxy::send`] for a callout no request waits for (a release, a refund, a settlement):
    /// `service.timeout_ms` bounds how long a *request* waits, and a release cut off by a short
    /// one under load would leave its slot to the deadline. So at least [`BACKGROUND_TIMEOUT_MS`].
    fn send_background(&self, cfg: &Config, request: CalloutRequest) -> Result<u32, String> {
        let timeout = cfg.service.timeout_ms.max(BACKGROUND_TIMEOUT_MS);
        self.send_within(cfg, request, timeout, None)
    }

    /// [`Proxy::send`] with a timeout, and the request's `traceparent` when it is traced
    /// (`service.trace`): an HTTP header, or gRPC metadata.
    fn send_within(
        &self,
        cfg: &Config,
        request: CalloutRequest,
        timeout_ms: u64,
        trace: Option<&str>,
    ) -> Result<u32, String> {
        let svc = &cfg.service;
        let timeout = u32::try_from(timeout_ms).unwrap_or(u32::MAX);
        let bearer = self.plugin.bearer.as_deref();
        let sent = match &request {
            CalloutRequest::Http { path, body } => {
                let mut headers = vec![
                    (":method", "POST"),
                    (":path", path.as_str()),
                    (":authority", svc.authority.as_str()),
                    ("content-type", "application/json"),
                ];
                if let Some(b) = bearer {
                    headers.push(("authorization", b));
                }
                if let Some(t) = trace {
                    headers.push((callout::TRACEPARENT, t));
                }
                self.abi.http_call(&svc.cluster, &headers, body, timeout)
            }
            CalloutRequest::Grpc {
                service,
                method,
                message,
            } => {
                let mut metadata: Vec<(&str, &str)> = Vec::new();
                if let Some(b) = bearer {
                    metadata.push(("authorization", b));
                }
                if let Some(t) = trace {
                    metadata.push((callout::TRACEPARENT, t));
                }
                self.abi.grpc_call(
                    &self.plugin.grpc_service,
                    service,
                    method,
                    &metadata,
                    message,
                    timeout,
                )
            }
        };
        sent.map_err(|status| abi::status_name(status).to_string())
    }

    /// Sends the settlements that are due (`POST <base>/settle`, JSON whatever the transport, as
    /// acquires and releases).
    fn send_settles(&mut self) {
        let cfg = &self.plugin.config;
        let now = self.abi.now_ms();
        let due: Vec<(String, Vec<u8>)> = self
            .plugin
            .settles
            .borrow_mut()
            .due(now)
            .into_iter()
            .map(|p| {
                (
                    p.id.clone(),
                    settle::encode(&p.id, cfg.instance.as_deref(), &p.what),
                )
            })
            .collect();
        for (id, body) in due {
            self.count_settle(SettleCount::Sent, 1);
            match self.send_background(cfg, callout::beside(cfg, "settle", body)) {
                Ok(token) => {
                    let plugin = self.plugin.clone();
                    self.open(token, Waiter::Settle { plugin, id });
                }
                Err(why) => {
                    debug!("settlement {id} not dispatched: {why}");
                    let outcome = self.plugin.settles.borrow_mut().answered(&id, false, now);
                    self.settle_outcome(&id, outcome);
                }
            }
        }
    }

    /// The answer to settlement `id`: applied (or applied before), refused for good, or failed
    /// (tried again from the timer).
    fn settle_answer(&self, id: &str, result: &CalloutResult) {
        let now = self.abi.now_ms();
        let status = match result {
            CalloutResult::Http { status, .. } => *status,
            _ => None,
        };
        let mut q = self.plugin.settles.borrow_mut();
        let outcome = match status {
            Some(200..=299) => q.answered(id, true, now),
            Some(s @ 400..=499) if s != 408 && s != 429 => {
                warn!("settlement {id} refused by the service (HTTP {s}): not sent again");
                q.refused(id)
            }
            _ => q.answered(id, false, now),
        };
        drop(q);
        self.settle_outcome(id, outcome);
    }

    fn settle_outcome(&self, id: &str, outcome: settle::Outcome) {
        match outcome {
            settle::Outcome::Delivered => self.count_settle(SettleCount::Delivered, 1),
            settle::Outcome::Retry { at_ms } => {
                debug!("settlement {id} failed; trying again at {at_ms}");
                self.count_settle(SettleCount::Retried, 1);
            }
            settle::Outcome::GaveUp => {
                warn!("settlement {id} given up: the service never applied it");
                self.count_settle(SettleCount::GivenUp, 1);
            }
        }
    }

    fn count_settle(&self, what: SettleCount, n: u64) {
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        self.counter(
            &self.plugin.metrics.settles,
            nth(&SettleCount::ALL, &what),
            n,
        );
    }

    fn counter(&self, ids: &[u32], idx: Option<usize>, n: i64) {
        if let Some(&id) = idx.and_then(|i| ids.get(i)) {
            self.abi.increment_metric(id, n);
        }
    }
}

/// Proxy-wasm shared data: process-wide, shared by every worker's VM of the same `vm_id`.
struct Shared<'a, A: Abi> {
    abi: &'a A,
    prefix: &'a str,
}

impl<A: Abi> CasStore for Shared<'_, A> {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.abi.shared_get(&format!("{}{key}", self.prefix))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.abi
            .shared_set(&format!("{}{key}", self.prefix), value, cas)
    }
}

impl<'a, A: Abi> Host for Proxy<'a, A> {
    type Store = Shared<'a, A>;

    fn store(&self) -> &Shared<'a, A> {
        &self.shared
    }

    fn now_ms(&self) -> u64 {
        self.abi.now_ms()
    }

    fn dispatch(&mut self, cfg: &Config, plan: &Plan) -> Result<u32, String> {
        self.take(cfg, plan, false)
    }

    fn resume(&mut self) {
        if let Err(s) = self.abi.resume_request() {
            warn!("could not resume the request: {}", abi::status_name(s));
        }
    }

    fn reply(&mut self, reply: &LocalReply) {
        if let Err(s) =
            self.abi
                .send_local_response(reply.status, &reply.headers, reply.body.as_bytes())
        {
            warn!("could not send the denial: {}", abi::status_name(s));
        }
    }

    fn count(&mut self, decision: Decision) {
        let m = &self.plugin.metrics;
        self.counter(&m.decisions, nth(&Decision::ALL, &decision), 1);
    }

    fn count_rule(&mut self, rule: usize, what: RuleCount) {
        if let Some(ids) = self.plugin.metrics.rules.get(rule) {
            self.counter(ids, nth(&RuleCount::ALL, &what), 1);
        }
    }

    fn count_failure(&mut self, cause: Cause) {
        let m = &self.plugin.metrics;
        self.counter(&m.failures, nth(&Cause::CALLOUT, &cause), 1);
    }

    fn breaker_event(&mut self, event: Event) {
        let m = &self.plugin.metrics;
        match event {
            Event::Opened => {
                self.abi.increment_metric(m.breaker_opened, 1);
                self.abi.record_metric(m.breaker_open, 1);
                warn!("circuit breaker opened: the decision service is failing, using the failure mode");
            }
            Event::Reopened => debug!("breaker probe failed, staying open"),
            Event::Closed => {
                self.abi.record_metric(m.breaker_open, 0);
                info!("circuit breaker closed: the decision service answers again");
            }
            Event::None => {}
        }
    }

    fn count_lease(&mut self, count: lease::Count, n: u64) {
        let m = &self.plugin.metrics;
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        self.counter(&m.leases, nth(&lease::Count::ALL, &count), n);
    }

    fn dispatch_refill(&mut self, cfg: &Config, plan: Plan) -> Result<(), String> {
        self.take(cfg, &plan, true).map(|_| ())
    }

    fn acquire(&mut self, cfg: &Config, body: &[u8]) -> Result<u32, String> {
        let token = self.send(cfg, callout::beside(cfg, "acquire", body.to_vec()))?;
        let context = self.context;
        self.open(token, Waiter::Acquire { context });
        Ok(token)
    }

    fn release(&mut self, cfg: &Config, body: &[u8]) -> bool {
        match self.send_background(cfg, callout::beside(cfg, "release", body.to_vec())) {
            Ok(token) => {
                let plugin = self.plugin.clone();
                self.open(token, Waiter::Release { plugin });
                true
            }
            Err(why) => {
                debug!("release not dispatched: {why}");
                false
            }
        }
    }

    fn count_inflight(&mut self, count: inflight::Count) {
        let m = &self.plugin.metrics;
        self.counter(&m.inflight, nth(&inflight::Count::ALL, &count), 1);
    }

    fn give_back(&mut self, cfg: &Config, request: &TakeRequest) {
        match self.send_background(cfg, callout::refund(cfg, request)) {
            Ok(token) => self.open(token, Waiter::Refund),
            Err(why) => debug!("refund not dispatched: {why}"),
        }
    }

    fn watch(&mut self, held: lease::Held) {
        lease::watch(&mut self.plugin.held.borrow_mut(), held);
    }
}

/// One request: the core's [`Flow`] and the plugin it runs under (`None`: the root was never
/// configured, which Envoy does not allow; the request then passes untouched).
struct Filter {
    plugin: Option<Rc<Plugin>>,
    flow: Flow,
}

fn waiting_token(flow: &Flow) -> Option<u32> {
    match flow.phase {
        Phase::Calling { token, .. } => Some(token),
        _ => flow.slots.token(),
    }
}

/// Every context of one VM and the callouts they wait for.
pub struct Dispatcher<A: Abi> {
    abi: A,
    /// Root contexts and their plugin (`None` until configured).
    roots: IdMap<Option<Rc<Plugin>>>,
    /// Request contexts.
    filters: IdMap<Filter>,
    /// Every callout of this VM in flight, and who waits for it.
    ledger: Ledger<Waiter>,
    /// Requests waiting, as last added to `tollgate.callouts.pending` by this VM.
    pending_reported: usize,
    /// The match headers' values of the request being looked at (see [`may_match`]).
    probe: Vec<Option<Vec<u8>>>,
    gauges: Option<VmGauges>,
    /// Linear memory last added to `tollgate.vm.memory_bytes` by this VM.
    memory_reported: u64,
}

impl<A: Abi> Dispatcher<A> {
    pub fn new(abi: A) -> Self {
        Dispatcher {
            abi,
            roots: IdMap::default(),
            filters: IdMap::default(),
            ledger: Ledger::new(Waiter::is_request),
            pending_reported: 0,
            probe: Vec::new(),
            gauges: None,
            memory_reported: 0,
        }
    }

    /// Callouts whose request still waits for them.
    #[cfg(test)]
    pub fn pending_callouts(&self) -> usize {
        self.ledger.waiting()
    }

    /// Entries of the ledger: callouts in flight and queued requests, whoever waits.
    #[cfg(test)]
    pub fn ledger_entries(&self) -> usize {
        self.ledger.len()
    }

    /// Live request contexts.
    #[cfg(test)]
    pub fn live_requests(&self) -> usize {
        self.filters.len()
    }

    fn sync_log_level(&self) {
        if let Some(level) = self.abi.log_level() {
            log::set_max_level(level.filter());
        }
    }

    pub fn on_context_create(&mut self, id: u32, root_id: u32) {
        if root_id == 0 {
            self.roots.insert(id, None);
            return;
        }
        let plugin = self.roots.get(&root_id).cloned().flatten();
        self.filters.insert(
            id,
            Filter {
                plugin,
                flow: Flow::default(),
            },
        );
    }

    pub fn on_vm_start(&mut self) -> bool {
        self.sync_log_level();
        info!(
            "tollgate {} (git {}) starting",
            env!("CARGO_PKG_VERSION"),
            env!("TOLLGATE_GIT_HASH")
        );
        true
    }

    pub fn on_configure(&mut self, id: u32, size: usize) -> bool {
        self.sync_log_level();
        let bytes = self.abi.buffer(Buffer::PluginConfiguration, size);
        if bytes.is_empty() {
            error!("invalid configuration: config: missing (put the JSON in a google.protobuf.StringValue)");
            return false;
        }
        let config = match Config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                error!("invalid configuration: {e}");
                return false;
            }
        };
        let metrics = match Metrics::define(&self.abi, &config) {
            Ok(m) => m,
            Err(s) => {
                error!("could not define metrics: {}", abi::status_name(s));
                return false;
            }
        };
        if self.gauges.is_none() {
            let pending = self
                .abi
                .define_metric(MetricKind::Gauge, "tollgate.callouts.pending");
            let memory = self
                .abi
                .define_metric(MetricKind::Gauge, "tollgate.vm.memory_bytes");
            if let (Ok(pending), Ok(memory)) = (pending, memory) {
                self.gauges = Some(VmGauges { pending, memory });
            }
        }
        if config.failure_mode == FailureMode::Fallback {
            for r in &config.rules {
                let Some(l) = r.rate_limit() else { continue };
                if l.capacity < config.fallback.instances {
                    warn!(
                        "rule {}: capacity {} < fallback.instances {}: its fallback bucket admits nothing",
                        r.name, l.capacity, config.fallback.instances
                    );
                }
            }
        }
        info!(
            "configured {} rule(s) ({} of kind concurrency), service cluster {:?} over {}, failure_mode {:?}{}",
            config.rules.len(),
            config
                .rules
                .iter()
                .filter(|r| r.concurrency().is_some())
                .count(),
            config.service.cluster,
            match config.service.transport {
                Transport::Http => "http",
                Transport::Grpc => "grpc",
                Transport::Rls => "rls",
            },
            config.failure_mode,
            if config.shadow { ", shadow mode" } else { "" }
        );
        let prefix = crate::core::local::fallback::state_prefix(&config);
        // Every slot exists before any request writes one (shared data has no insert-if-absent).
        let mut config = config;
        // Every callout of this configuration carries this Envoy's instance id.
        config.instance = Some(crate::core::wire::instance::adopt(&Shared {
            abi: &self.abi,
            prefix: &prefix,
        }));
        config.fallback.previous_max_keys = crate::core::local::fallback::prepare_for(
            &config,
            &Shared {
                abi: &self.abi,
                prefix: &prefix,
            },
        );
        if inflight::local_enabled(&config) {
            // The local fallback slots' counters, zero, before any request.
            crate::core::local::fallback::prepare_table(
                &Shared {
                    abi: &self.abi,
                    prefix: &prefix,
                },
                crate::core::local::table::SLOTS_TABLE,
                config.fallback.max_keys,
                &[0; 8],
            );
        }
        let plugin = Plugin {
            root: id,
            prefix,
            bearer: config.service.token.as_ref().map(|t| format!("Bearer {t}")),
            grpc_service: grpc_service(&config.service.cluster),
            match_headers: match_headers(&config),
            request_headers: request_headers(&config),
            queue: RefCell::new(batch::Queue::default()),
            held: RefCell::new(Vec::new()),
            settles: RefCell::new(settle::Queue::new(&crate::core::wire::instance::fresh())),
            config,
            metrics,
        };
        if let Some(ms) = tick_period_ms(&plugin.config) {
            // The timer that gives back the tokens of pools nobody spends any more, and sends
            // settlements again.
            if let Err(s) = self.abi.set_tick_period(ms) {
                warn!(
                    "no timer for lease pools and settlements: {}",
                    abi::status_name(s)
                );
            }
        }
        self.roots.insert(id, Some(Rc::new(plugin)));
        self.report_memory();
        true
    }

    /// The root context's timer: expired tokens of the lease pools this worker filled go back to
    /// the service.
    pub fn on_tick(&mut self, id: u32) {
        let Some(Some(plugin)) = self.roots.get(&id).cloned() else {
            return;
        };
        if !plugin.settles.borrow().is_empty() {
            Proxy::new(&self.abi, &plugin, &mut self.ledger, 0).send_settles();
        }
        if plugin.held.borrow().is_empty() {
            return;
        }
        let mut proxy = Proxy::new(&self.abi, &plugin, &mut self.ledger, 0);
        let now = proxy.now_ms();
        let (returns, tokens) = lease::sweep(proxy.store(), &mut plugin.held.borrow_mut(), now);
        for r in &returns {
            proxy.give_back(&plugin.config, r);
        }
        if tokens > 0 {
            proxy.count_lease(lease::Count::Expired, tokens);
            proxy.count_lease(lease::Count::Returned, tokens);
        }
    }

    pub fn on_request_headers(&mut self, id: u32) -> u32 {
        let Some(f) = self.filters.get_mut(&id) else {
            return CONTINUE;
        };
        let Some(plugin) = f.plugin.clone() else {
            return CONTINUE;
        };
        if f.flow.phase != Phase::Idle {
            return CONTINUE;
        }
        if !may_match(&self.abi, &plugin, &mut self.probe) {
            f.flow.phase = Phase::Done;
            return CONTINUE;
        }
        let req = read_request(&self.abi, &plugin);
        let mut proxy = Proxy::new(&self.abi, &plugin, &mut self.ledger, id);
        let next = f.flow.on_request_headers(&plugin.config, &req, &mut proxy);
        self.report_pending();
        status_code(next)
    }

    /// Body or trailers: held while the callout is in flight.
    pub fn on_request_data(&mut self, id: u32) -> u32 {
        match self.filters.get(&id) {
            Some(f) => status_code(f.flow.on_request_data()),
            None => CONTINUE,
        }
    }

    pub fn on_response_headers(&mut self, id: u32, end_of_stream: bool) -> u32 {
        let Some(f) = self.filters.get_mut(&id) else {
            return CONTINUE;
        };
        if let (Some(meter), Some(plugin)) = (&mut f.flow.meter, &f.plugin) {
            let cfg = &plugin.config;
            let abi = &self.abi;
            let read = |name: &str| {
                abi.header(HeaderMap::Response, name)
                    .and_then(|v| String::from_utf8(v).ok())
            };
            let content_type = read("content-type");
            let mut usage: Vec<(&str, Option<String>)> = Vec::new();
            for name in meter.usage_headers(cfg) {
                usage.push((name, read(name)));
            }
            meter.on_headers(
                cfg,
                content_type.as_deref(),
                |name| {
                    usage
                        .iter()
                        .find(|(n, _)| *n == name)
                        .and_then(|(_, v)| v.clone())
                },
                end_of_stream,
            );
        }
        if f.flow.response_headers.is_empty() {
            return CONTINUE;
        }
        for (k, v) in std::mem::take(&mut f.flow.response_headers) {
            if let Err(s) = self.abi.add_header(HeaderMap::Response, &k, &v) {
                debug!("could not add {k} to the response: {}", abi::status_name(s));
            }
        }
        CONTINUE
    }

    /// A piece of the response body: read for the usage it reports when a rule charged by the
    /// response waits for it (it is never held).
    pub fn on_response_body(&mut self, id: u32, size: usize, end_of_stream: bool) -> u32 {
        let Some(meter) = self
            .filters
            .get_mut(&id)
            .and_then(|f| f.flow.meter.as_mut())
        else {
            return CONTINUE;
        };
        if meter.wants_body() {
            let chunk = self.abi.buffer(Buffer::HttpResponseBody, size);
            meter.on_body(&chunk, end_of_stream);
        }
        CONTINUE
    }

    /// Response trailers: the body is complete.
    pub fn on_response_trailers(&mut self, id: u32) -> u32 {
        if let Some(meter) = self
            .filters
            .get_mut(&id)
            .and_then(|f| f.flow.meter.as_mut())
        {
            meter.on_trailers();
        }
        CONTINUE
    }

    /// A context is gone (request finished, client disconnected, or root removed). What a request
    /// leaves behind goes to its root: a settlement of what it used, the release of its slots, the
    /// answer to a callout still in flight (dropped, or a granted slot given back).
    pub fn on_delete(&mut self, id: u32) {
        if let Some(mut f) = self.filters.remove(&id) {
            if let Some(p) = f.plugin.clone() {
                self.request_ended(id, &mut f, &p);
            }
            self.report_pending();
            self.report_memory();
        } else if let Some(Some(old)) = self.roots.remove(&id) {
            self.root_ended(&old);
            self.hand_over_pools(&old);
            self.hand_over_settlements(&old);
            self.report_pending();
        }
    }

    fn request_ended(&mut self, id: u32, f: &mut Filter, p: &Rc<Plugin>) {
        if let Some(meter) = f.flow.meter.take() {
            // The response ended, however it ended: what it used is settled once.
            let items = meter.finish(&p.config);
            if !items.is_empty() {
                let now = self.abi.now_ms();
                // What a response used beyond its reservation also comes out of this proxy's
                // fallback share, so an outage does not admit as if it had not been used.
                let shares = Shared {
                    abi: &self.abi,
                    prefix: &p.prefix,
                };
                crate::core::local::fallback::spend_extras(&p.config, &shares, &items, now);
                let dropped = {
                    let mut q = p.settles.borrow_mut();
                    let before = q.given_up;
                    q.push(items, now);
                    q.given_up - before
                };
                let mut proxy = Proxy::new(&self.abi, p, &mut self.ledger, 0);
                if dropped > 0 {
                    warn!("settlement queue full: the oldest settlement was dropped");
                    proxy.count_settle(SettleCount::GivenUp, dropped);
                }
                proxy.send_settles();
            }
        }
        if let Some(token) = waiting_token(&f.flow) {
            // A callout this request waits for: its answer is the root's now. A queued take has
            // no callout yet: it leaves the queue.
            let mine = |w: &Waiter| match w {
                Waiter::Take { context, .. } | Waiter::Acquire { context, .. } => *context == id,
                _ => false,
            };
            let heir = match self.ledger.get(token).map(|e| &e.waiter) {
                Some(w) if !mine(w) => None,
                Some(Waiter::Take { gates, .. })
                    if token & crate::core::base::ledger::VIRTUAL == 0 =>
                {
                    Some(Waiter::Abandoned {
                        plugin: p.clone(),
                        gates: *gates,
                    })
                }
                Some(Waiter::Acquire { .. }) => match &f.flow.slots {
                    crate::core::flow::Slots::Acquiring { wants, slot, .. } => {
                        Some(Waiter::Orphan {
                            plugin: p.clone(),
                            slot: slot.clone(),
                            keys: wants.iter().map(|w| w.key.clone()).collect(),
                        })
                    }
                    _ => Some(Waiter::Refund),
                },
                _ => None,
            };
            match heir {
                Some(w) => {
                    self.ledger.replace(token, w);
                }
                None => {
                    if self.ledger.close_if(token, mine).is_some() {
                        p.queue.borrow_mut().forget(token);
                    }
                }
            }
        }
        let holds = !matches!(
            f.flow.slots,
            crate::core::flow::Slots::None | crate::core::flow::Slots::Done
        );
        if holds {
            // The stream is over, however it ended: its concurrency slots go back now.
            let mut proxy = Proxy::new(&self.abi, p, &mut self.ledger, 0);
            f.flow.on_end(&p.config, &mut proxy);
        }
    }

    /// Root context `old` is gone, and Envoy cancelled its callouts silently: each entry ends
    /// here. A request still waiting takes its failure path (as for a reset), a refill's claim
    /// ends; a settlement attempt needs nothing here ([`Dispatcher::hand_over_settlements`]).
    fn root_ended(&mut self, old: &Rc<Plugin>) {
        for (token, waiter) in self.ledger.close_root(old.root) {
            match waiter {
                Waiter::Take { .. } | Waiter::Acquire { .. } => {
                    let reset = CalloutResult::Http {
                        status: None,
                        body: Vec::new(),
                    };
                    self.answer(token, waiter, &mut Ready(Some(reset)));
                }
                Waiter::Refill { plugin, plan, .. } => {
                    lease::abandon(
                        &plugin.config,
                        &plan,
                        &Shared {
                            abi: &self.abi,
                            prefix: &plugin.prefix,
                        },
                    );
                }
                // The attempt is sent again by whoever takes over the queue (its in-flight mark is
                // cleared by the hand-over), under the same id.
                Waiter::Settle { .. }
                | Waiter::Batch { .. }
                | Waiter::Refund
                | Waiter::Release { .. }
                | Waiter::Orphan { .. }
                | Waiter::Abandoned { .. } => {}
            }
        }
        *old.queue.borrow_mut() = batch::Queue::default();
    }

    /// Another configuration of this worker that calls the same service as `old` (their shared
    /// data and settlements are the same service's), if any.
    fn heir(&self, old: &Plugin) -> Option<Rc<Plugin>> {
        self.roots
            .values()
            .flatten()
            .find(|p| p.prefix == old.prefix)
            .cloned()
    }

    /// `heir` takes over something that needs its timer: started at a second if its own
    /// configuration asks for none.
    fn wake(&self, heir: &Plugin) {
        if tick_period_ms(&heir.config).is_none()
            && self.abi.set_effective_context(heir.root).is_ok()
        {
            if let Err(s) = self.abi.set_tick_period(1000) {
                warn!(
                    "no timer for what a configuration handed over: {}",
                    abi::status_name(s)
                );
            }
        }
    }

    /// A configuration went away (a push replaced it): the lease pools it filled outlive it
    /// (their names carry the service, not the configuration), so another configuration of this
    /// worker calling the same service watches them, and gives their tokens back when they expire.
    fn hand_over_pools(&mut self, old: &Plugin) {
        let held = std::mem::take(&mut *old.held.borrow_mut());
        if held.is_empty() {
            return;
        }
        let Some(heir) = self.heir(old) else {
            return;
        };
        {
            let mut watched = heir.held.borrow_mut();
            for h in held {
                lease::watch(&mut watched, h);
            }
        }
        self.wake(&heir);
    }

    /// A configuration went away with settlements not yet delivered (queued, or an attempt that
    /// its end cancelled): the configuration that calls the same service delivers them, under
    /// their ids (the service applies each once). With no such configuration they are given up,
    /// and counted so.
    fn hand_over_settlements(&mut self, old: &Plugin) {
        let pending = old.settles.borrow_mut().hand_over();
        if pending.is_empty() {
            return;
        }
        let Some(heir) = self.heir(old) else {
            warn!(
                "{} settlement(s) given up: no configuration calls their service any more",
                pending.len()
            );
            return;
        };
        let now = self.abi.now_ms();
        let dropped = heir.settles.borrow_mut().adopt(pending, now);
        if dropped > 0 {
            warn!("settlement queue full: {dropped} handed-over settlement(s) dropped");
        }
        self.wake(&heir);
    }

    pub fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        self.deliver(
            token,
            &mut FromHost(|abi: &A| {
                if num_headers == 0 {
                    // Envoy reports a reset (and some other failures) as a response without headers.
                    return CalloutResult::Http {
                        status: None,
                        body: Vec::new(),
                    };
                }
                let status = abi
                    .header(HeaderMap::HttpCallResponse, ":status")
                    .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u32>().ok());
                if body_size > MAX_ANSWER_BYTES {
                    return CalloutResult::TooLarge { size: body_size };
                }
                let body = abi.buffer(Buffer::HttpCallResponseBody, body_size);
                CalloutResult::Http { status, body }
            }),
        );
    }

    /// A unary gRPC callout ended: `status` 0 with the message (`proxy_on_grpc_receive`), or a
    /// failure status without one (`proxy_on_grpc_close`).
    pub fn on_grpc_response(&mut self, token: u32, status: u32, size: usize) {
        self.deliver(
            token,
            &mut FromHost(|abi: &A| {
                if status != 0 {
                    return CalloutResult::Grpc {
                        status,
                        message: abi.grpc_status_message(),
                        body: Vec::new(),
                    };
                }
                if size > MAX_ANSWER_BYTES {
                    return CalloutResult::TooLarge { size };
                }
                let body = abi.buffer(Buffer::GrpcReceive, size);
                CalloutResult::Grpc {
                    status: 0,
                    message: None,
                    body,
                }
            }),
        );
    }

    /// Callout `token` ended with the result `read` gives: its ledger entry says who waits.
    /// After any callout that held a plugin's batch queue back, the requests queued behind it
    /// leave together.
    fn deliver(&mut self, token: u32, read: &mut dyn Read<A>) {
        let Some(entry) = self.ledger.close(token) else {
            debug!("reply to callout {token}: no one waits for it");
            return;
        };
        let gate = entry.waiter.gate().cloned();
        if let Some(p) = &gate {
            p.queue.borrow_mut().ended();
        }
        self.answer(token, entry.waiter, read);
        if let Some(p) = gate {
            self.flush(&p);
        }
        self.report_pending();
    }

    /// The one place an answer goes: to whoever waits for callout `token`. `read` runs only when
    /// someone wants the result (a stray reply costs no host calls), as the request's context.
    fn answer(&mut self, token: u32, waiter: Waiter, read: &mut dyn Read<A>) {
        match waiter {
            Waiter::Take { context, .. } | Waiter::Acquire { context, .. } => {
                self.resume_request(context, token, read);
            }
            Waiter::Batch { members, .. } => {
                // The batch's own token waits in no request; each member is its own entry.
                let parts = batch::split(read.read(&self.abi), members.len());
                for (member, result) in members.into_iter().zip(parts) {
                    self.answer_member(member, result);
                }
            }
            Waiter::Refill { plugin, plan, .. } => {
                let result = read.read(&self.abi);
                let mut proxy = Proxy::new(&self.abi, &plugin, &mut self.ledger, 0);
                flow::on_refill_result(&plugin.config, &plan, result, &mut proxy);
            }
            Waiter::Release { plugin } => {
                let result = read.read(&self.abi);
                let mut proxy = Proxy::new(&self.abi, &plugin, &mut self.ledger, 0);
                proxy.count_inflight(if inflight::released(&result) {
                    inflight::Count::Released
                } else {
                    inflight::Count::ReleaseFailed
                });
            }
            Waiter::Orphan { plugin, slot, keys } => {
                let result = read.read(&self.abi);
                let id = match inflight::interpret(&result, keys.len()) {
                    inflight::Acquired::Denied(..) => return,
                    inflight::Acquired::Held(id) => id,
                    // No answer: the slots may have been taken all the same.
                    inflight::Acquired::Failed => slot,
                };
                let mut proxy = Proxy::new(&self.abi, &plugin, &mut self.ledger, 0);
                if !proxy.release(
                    &plugin.config,
                    &inflight::encode_release(&plugin.config, &id, &keys),
                ) {
                    proxy.count_inflight(inflight::Count::ReleaseFailed);
                }
            }
            Waiter::Settle { plugin, id } => {
                let result = read.read(&self.abi);
                Proxy::new(&self.abi, &plugin, &mut self.ledger, 0).settle_answer(&id, &result);
            }
            Waiter::Refund | Waiter::Abandoned { .. } => {}
        }
    }

    /// A batch member's share of the batch answer (its entry closes here).
    fn answer_member(&mut self, member: u32, result: CalloutResult) {
        if let Some(e) = self.ledger.close(member) {
            self.answer(member, e.waiter, &mut Ready(Some(result)));
        }
    }

    /// Hands `read`'s result to request `context`, if it still waits for `token`.
    fn resume_request(&mut self, context: u32, token: u32, read: &mut dyn Read<A>) {
        let Some(f) = self.filters.get_mut(&context) else {
            return;
        };
        let Some(plugin) = f.plugin.clone() else {
            return;
        };
        if !f.flow.waits_for(token) {
            return;
        }
        // The reply arrives on the root context; resume / reply must act on the request's.
        if let Err(s) = self.abi.set_effective_context(context) {
            debug!(
                "request of callout {token} is gone: {}",
                abi::status_name(s)
            );
            return;
        }
        let result = read.read(&self.abi);
        let mut proxy = Proxy::new(&self.abi, &plugin, &mut self.ledger, context);
        f.flow
            .on_callout_result(&plugin.config, token, result, &mut proxy);
    }

    /// Sends the requests queued on `plugin`: one batch callout, or several when the batch's byte
    /// bounds split them (a split is not a throttle: a queue that waits for one answer per batch
    /// would overflow under load).
    fn flush(&mut self, plugin: &Rc<Plugin>) {
        // Each round takes at least one request; a failed dispatch sends none back to the queue.
        let rounds = plugin.queue.borrow().waiting();
        for _ in 0..rounds {
            let queued = plugin
                .queue
                .borrow_mut()
                .drain(plugin.config.service.batch.max(1));
            if queued.is_empty() {
                return;
            }
            self.send_batch(plugin, queued);
        }
    }

    /// One batch callout carrying `queued`.
    fn send_batch(&mut self, plugin: &Rc<Plugin>, queued: Vec<(u32, TakeRequest)>) {
        let takes: Vec<&TakeRequest> = queued.iter().map(|(_, t)| t).collect();
        let members: Vec<u32> = queued.iter().map(|(t, _)| *t).collect();
        let mut proxy = Proxy::new(&self.abi, plugin, &mut self.ledger, 0);
        match proxy.send(&plugin.config, callout::batch(&plugin.config, &takes)) {
            Ok(token) => {
                plugin.metrics.batched(&self.abi, members.len());
                plugin.queue.borrow_mut().started();
                let batch = Waiter::Batch {
                    plugin: plugin.clone(),
                    members,
                };
                proxy.open(token, batch);
            }
            Err(why) => {
                debug!("batch of {} not dispatched: {why}", members.len());
                for m in members {
                    self.answer_member(m, CalloutResult::DispatchError);
                }
            }
        }
    }

    /// Adds the change in waiting requests to `tollgate.callouts.pending`.
    fn report_pending(&mut self) {
        let now = self.ledger.waiting();
        if now == self.pending_reported {
            return;
        }
        if let Some(g) = &self.gauges {
            let delta = i64::try_from(now).unwrap_or(i64::MAX)
                - i64::try_from(self.pending_reported).unwrap_or(i64::MAX);
            self.abi.increment_metric(g.pending, delta);
        }
        self.pending_reported = now;
    }

    fn report_memory(&mut self) {
        let Some(g) = &self.gauges else {
            return;
        };
        let now = self.abi.memory_bytes();
        if now != self.memory_reported {
            let delta = i64::try_from(now)
                .unwrap_or(i64::MAX)
                .saturating_sub(i64::try_from(self.memory_reported).unwrap_or(i64::MAX));
            self.abi.increment_metric(g.memory, delta);
            self.memory_reported = now;
        }
    }
}

/// How often a configuration's lease pools are looked at for expired tokens: half the shortest
/// `max_age_ms` of its token-bucket lease rules, between 100 ms and a second; `None` without any.
fn tick_period_ms(cfg: &Config) -> Option<u32> {
    if charges_by_response(cfg) {
        // Settlements are tried again from the timer (the first backoff is 100 ms).
        return u32::try_from(settle::FIRST_BACKOFF_MS).ok();
    }
    let shortest = cfg
        .rules
        .iter()
        .filter_map(Rule::rate_limit)
        .filter(|r| r.algorithm == crate::core::config::Algorithm::TokenBucket)
        .filter_map(|r| r.lease.map(|l| l.max_age_ms))
        .min()?;
    u32::try_from((shortest / 2).clamp(100, 1000)).ok()
}

/// Whether some rule is charged by the response (`charge: response`).
fn charges_by_response(cfg: &Config) -> bool {
    cfg.rules
        .iter()
        .any(|r| r.rate_limit().is_some_and(|l| l.charge.is_some()))
}

/// `GrpcService { envoy_grpc: EnvoyGrpc { cluster_name } }`, serialised (both field 1, length
/// delimited).
fn grpc_service(cluster: &str) -> Vec<u8> {
    fn field1(out: &mut Vec<u8>, bytes: &[u8]) {
        out.push(0x0a);
        let mut n = bytes.len();
        loop {
            let b = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(b);
                break;
            }
            out.push(b | 0x80);
        }
        out.extend_from_slice(bytes);
    }
    let mut inner = Vec::with_capacity(cluster.len() + 4);
    field1(&mut inner, cluster.as_bytes());
    let mut out = Vec::with_capacity(inner.len() + 4);
    field1(&mut out, &inner);
    out
}

/// The header names the rules' match conditions read, or `None` if a rule matches everything.
fn match_headers(cfg: &Config) -> Option<Vec<String>> {
    let mut names: Vec<String> = Vec::new();
    let mut add = |n: &str| {
        if !names.iter().any(|x| x == n) {
            names.push(n.to_string());
        }
    };
    for r in &cfg.rules {
        let m = &r.matcher;
        // A rule for every request, or one whose conditions read the client address or negate
        // (a partial view of the request could not tell): read the request whole.
        if (m.path.is_none() && m.methods.is_empty() && m.headers.is_empty())
            || m.reads_client_ip()
            || m.not.is_some()
        {
            return None;
        }
        if m.path.is_some() {
            add(":path");
        }
        if !m.methods.is_empty() {
            add(":method");
        }
        for h in &m.headers {
            match h {
                HeaderMatch::Present(n, _) | HeaderMatch::Equals(n, _) => add(n),
            }
        }
    }
    Some(names)
}

/// The headers `match_headers` names, as read for one request (`values[i]` is `names[i]`'s).
struct Probe<'a> {
    names: &'a [String],
    values: &'a [Option<Vec<u8>>],
}

impl Headers for Probe<'_> {
    fn first(&self, name: &str) -> Option<&[u8]> {
        let i = self.names.iter().position(|n| n == name)?;
        self.values.get(i)?.as_deref()
    }
}

/// Whether some rule may match, reading only the headers the conditions name into `values`, which
/// is kept from request to request: the only allocations are the host's copies of the values.
fn may_match(abi: &impl Abi, plugin: &Plugin, values: &mut Vec<Option<Vec<u8>>>) -> bool {
    let Some(names) = &plugin.match_headers else {
        return true;
    };
    values.clear();
    values.extend(names.iter().map(|n| abi.header(HeaderMap::Request, n)));
    let view = Probe { names, values };
    let cfg = &plugin.config;
    // `match_headers` is `None` when a condition reads the client address: not here.
    cfg.rules.iter().any(|r| matches_headers(&r.matcher, &view))
}

/// Most headers read one by one; a configuration whose rules read more gets the whole map in one
/// host call instead.
const MAX_HEADERS_BY_NAME: usize = 8;

/// The headers [`read_request`] reads by name ([`keys::headers_read`] over every rule), or `None`
/// for the whole map.
fn request_headers(cfg: &Config) -> Option<Vec<String>> {
    let mut names = Vec::new();
    for r in &cfg.rules {
        if !keys::headers_read(r, cfg.trusted_hops, &mut names) {
            return None;
        }
    }
    (names.len() <= MAX_HEADERS_BY_NAME).then_some(names)
}

/// What the core reads of a request: the headers its rules can read (by name, or the whole map),
/// and the peer address when a rule needs it.
fn read_request(abi: &impl Abi, plugin: &Plugin) -> Request {
    let cfg = &plugin.config;
    let headers = match &plugin.request_headers {
        Some(names) => names
            .iter()
            .filter_map(|n| abi.header(HeaderMap::Request, n).map(|v| (n.clone(), v)))
            .collect(),
        None => abi.headers(HeaderMap::Request).unwrap_or_default(),
    };
    let peer = if cfg.needs_peer_address {
        abi.property(&["source", "address"])
            .and_then(|b| String::from_utf8(b).ok())
    } else {
        None
    };
    Request { headers, peer }
}

#[cfg(test)]
mod tests;
