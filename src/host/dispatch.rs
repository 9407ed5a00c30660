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
//! - A reply for a token nobody waits for is dropped; an answer on a stream goes to the message
//!   whose id it carries (one awaited late gives back what it granted), and names no other.
//! - A token Envoy hands out while an entry still holds it (its counter wraps unchecked) is
//!   counted, and the displaced entry fails as if reset ([`Ledger::displaced`]), when the
//!   callback ends.
//! - The root's tick fails the stream's messages past their deadline (each alone) and gives up a
//!   silent stream, and sends a batch queue beside callouts out a tick or more (as a request
//!   that queues a take does).
//!
//! - Every resume and local reply goes through [`Paced`]: Envoy runs them after the callback
//!   returns, one inside another when they call back into the module, so at most a round's worth
//!   (64) go to it between two callbacks it makes from its event loop; the rest wait, oldest
//!   first, and the timer runs fast until they are out.
//!
//! Nothing here panics: an unknown context id in any callback is a no-op.
//!
//! Beside this file, by concern: `configure` (a configuration parsed and prepared, and one a push
//! replaced handed over), `messages` (the stream's answers, end and deadlines), `batches` (the
//! batch queue carried out); `tests` (the fake host, and a module per concern).

use super::abi::{self, Abi, Buffer, HeaderMap, MetricKind};
use super::metrics::{Metrics, SettleCount, VmGauges};
use super::pace::Paced;
use super::plugin::{Plugin, Waiter};
use super::proxy::{Proxy, Shared};
use super::request::{may_match, read_request, Reads};
use crate::core::base::held::Held;
use crate::core::base::ledger::{CalloutId, IdMap, Ledger};
use crate::core::config::{Config, FailureMode, Transport};
use crate::core::flow::{self, Flow, Leftover, Metric, Next, Phase};
use crate::core::inflight;
use crate::core::local::lease;
use crate::core::outbox::Outbox;
use crate::core::rules::Request;
use crate::core::wire::batch::{self, Queued};
use crate::core::wire::callout;
use crate::core::wire::plan::CalloutResult;
use crate::core::wire::TakeRequest;
use contract::bounds::MAX_ANSWER_BYTES;
use log::{debug, error, info, warn};
use std::cell::RefCell;
use std::rc::Rc;

/// A stream callback's answer: go on (`FilterHeadersStatus` / `FilterDataStatus` `Continue`).
pub const CONTINUE: u32 = 0;
/// A stream callback's answer: stop (`StopIteration` / `StopIterationAndBuffer`).
pub const PAUSE: u32 = 1;
/// A body callback's answer: hold the body under flow control (`StopIterationAndWatermark`).
pub const HOLD_BODY: u32 = 2;

fn status_code(next: Next) -> u32 {
    match next {
        Next::Continue => CONTINUE,
        Next::Pause => PAUSE,
    }
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

/// One request: the core's [`Flow`] and the plugin it runs under (`None`: the root was never
/// configured, which Envoy does not allow; the request then passes untouched).
struct Filter {
    plugin: Option<Rc<Plugin>>,
    flow: Flow,
}

/// Every context of one VM and the callouts they wait for.
pub struct Dispatcher<A: Abi> {
    /// The host, its resumes and local replies paced ([`Paced`]: never more than a round's
    /// worth queued in Envoy at once).
    abi: Paced<A>,
    /// Root contexts and their plugin (`None` until configured).
    roots: IdMap<Option<Rc<Plugin>>>,
    /// Request contexts.
    filters: IdMap<Filter>,
    /// Every callout of this VM in flight, and who waits for it.
    ledger: Ledger<Waiter>,
    /// Requests held until their time (shaping), whatever their configuration: any root's
    /// timer lets them through.
    held: Held,
    /// The root whose timer runs every [`flow::HOLD_TICK_MS`] while requests are held (its own
    /// period again once none is).
    fast_tick: Option<u32>,
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
            abi: Paced::new(abi),
            roots: IdMap::default(),
            filters: IdMap::default(),
            ledger: Ledger::new(Waiter::is_request),
            held: Held::default(),
            fast_tick: None,
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

    /// The root context's timer: held requests whose time came go on (any root's timer, for every
    /// configuration's), the stream's messages past their deadline fail, the batch queue leaves
    /// if it waited (or fails what waited its whole timeout), settlements due are sent again,
    /// expired tokens of the lease pools this worker filled go back to the service.
    pub fn on_tick(&mut self, id: u32) {
        self.abi.enter(None, true);
        if !self.held.is_empty() {
            self.release_held();
        }
        if let Some(Some(plugin)) = self.roots.get(&id).cloned() {
            self.chores(&plugin);
        }
        self.end_callback();
        if self.fast_tick == Some(id) && self.held.is_empty() && self.abi.waiting() == 0 {
            self.slow_down(id);
        }
    }

    /// What a configuration's timer looks at (see [`Dispatcher::on_tick`]).
    fn chores(&mut self, plugin: &Rc<Plugin>) {
        let chores = plugin.outbox.borrow().chores(&plugin.config);
        if chores.messages {
            self.expire_messages(plugin);
        }
        if chores.queue {
            self.tend_queue(plugin);
        }
        if chores.settles {
            Proxy::new(&self.abi, plugin, &mut self.ledger, 0).send_settles();
        }
        if chores.pools {
            let mut proxy = Proxy::new(&self.abi, plugin, &mut self.ledger, 0);
            flow::sweep(
                &plugin.config,
                &mut plugin.outbox.borrow_mut().pools,
                &mut proxy,
            );
        }
    }

    pub fn on_request_headers(&mut self, id: u32, end_of_stream: bool) -> u32 {
        self.abi.enter(Some(id), true);
        let Some(f) = self.filters.get_mut(&id) else {
            return CONTINUE;
        };
        let Some(plugin) = f.plugin.clone() else {
            return CONTINUE;
        };
        if f.flow.phase != Phase::Idle {
            return CONTINUE;
        }
        if !may_match(&self.abi, &plugin.config, &plugin.reads, &mut self.probe) {
            f.flow.phase = Phase::Done;
            return CONTINUE;
        }
        let mut req = read_request(&self.abi, &plugin.config, &plugin.reads, &mut self.probe);
        req.end_of_stream = end_of_stream;
        let status = self.decide_request(id, &plugin, &req);
        let reading = self
            .filters
            .get(&id)
            .is_some_and(|f| f.flow.body_read().is_some());
        if reading {
            // The proxy-wasm host turns a paused header phase into "stop everything", which
            // would hold the body from the module too: the headers go on, and the body is held
            // (buffered by Envoy) until the model is read and the request decided.
            return CONTINUE;
        }
        status
    }

    /// The request (its model read, if it was waited for) decided: the flow's step, its
    /// watched pools kept, the queue tended.
    fn decide_request(&mut self, id: u32, plugin: &Rc<Plugin>, req: &Request) -> u32 {
        let Some(f) = self.filters.get_mut(&id) else {
            return CONTINUE;
        };
        let mut proxy = Proxy::new(&self.abi, plugin, &mut self.ledger, id);
        let next = f.flow.on_request_headers(&plugin.config, req, &mut proxy);
        keep_watching(plugin, std::mem::take(&mut f.flow.watched));
        if plugin.config.service.batch > 0 {
            // A take queued behind callouts out a tick or more leaves now, not on the next tick.
            self.tend_queue(plugin);
        }
        self.end_callback();
        status_code(next)
    }

    /// A piece of the request body (`size`: all of it buffered so far; `None` at the trailers),
    /// `end_of_stream` when it is the last: read for the model while the request waits for it
    /// (then decided once it is known), else held while the callout is in flight.
    ///
    /// Bytes read for the model are buffered (`StopIterationAndBuffer`: the next call sees all of
    /// them); a body only held, once the request is decided and waits for its answer, is held
    /// under Envoy's flow control (`StopIterationAndWatermark`), not buffered, so a large body is
    /// slowed, never refused for its size (413) while it waits. Trailers stop with `StopIteration`.
    pub fn on_request_body(&mut self, id: u32, size: Option<usize>, end_of_stream: bool) -> u32 {
        let hold = if size.is_some() { HOLD_BODY } else { PAUSE };
        let Some(f) = self.filters.get_mut(&id) else {
            return CONTINUE;
        };
        let (Some(seen), Some(plugin)) = (f.flow.body_read(), f.plugin.clone()) else {
            return match f.flow.on_request_data() {
                Next::Continue => CONTINUE,
                Next::Pause => hold,
            };
        };
        self.abi.enter(Some(id), true);
        let chunk = match size {
            Some(n) if n > seen => self.abi.buffer(Buffer::HttpRequestBody, seen, n - seen),
            _ => Vec::new(),
        };
        let Some(req) = f.flow.on_body_for_model(&chunk, end_of_stream) else {
            self.end_callback();
            return PAUSE;
        };
        match self.decide_request(id, &plugin, &req) {
            PAUSE => hold,
            status => status,
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
            let chunk = self.abi.buffer(Buffer::HttpResponseBody, 0, size);
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
        self.abi.enter(None, false);
        self.abi.forget(id);
        if let Some(mut f) = self.filters.remove(&id) {
            if let Some(p) = f.plugin.clone() {
                self.request_ended(id, &mut f, &p);
            }
            self.end_callback();
            self.report_memory();
        } else if let Some(Some(old)) = self.roots.remove(&id) {
            self.root_ended(&old);
            self.hand_over(&old);
            self.keep_releasing(id);
            self.end_callback();
        }
    }

    fn request_ended(&mut self, id: u32, f: &mut Filter, p: &Rc<Plugin>) {
        if let Some(until) = f.flow.held_until() {
            self.held.forget(until, id);
        }
        let left = f.flow.on_end(
            &p.config,
            &mut Proxy::new(&self.abi, p, &mut self.ledger, 0),
        );
        for leftover in left {
            self.carry_out(id, p, leftover);
        }
    }

    /// Carries out what request `id` left behind.
    fn carry_out(&mut self, id: u32, p: &Rc<Plugin>, leftover: Leftover) {
        match leftover {
            Leftover::Settle(items) => {
                let dropped = {
                    let q = &mut p.outbox.borrow_mut().settles;
                    let before = q.given_up;
                    q.push(items, self.abi.now_ms());
                    q.given_up - before
                };
                let mut proxy = Proxy::new(&self.abi, p, &mut self.ledger, 0);
                if dropped > 0 {
                    warn!("settlement queue full: the oldest settlement was dropped");
                    proxy.count_settle(SettleCount::GivenUp, dropped);
                }
                proxy.send_settles();
            }
            Leftover::Release(body) => {
                let mut proxy = Proxy::new(&self.abi, p, &mut self.ledger, 0);
                flow::release(&p.config, body, &mut proxy);
            }
            // A take with a callout of its own: its answer is the root's now (it still holds the
            // batch queue back until it arrives). A take in a batch: it leaves the queue (if it
            // is still there), and its share of the batch's answer is no one's.
            Leftover::Abandoned {
                id: callout,
                shaped,
            } => match self.ledger.get(callout).map(|e| &e.waiter) {
                Some(Waiter::Take { context, gates, .. }) if *context == id => {
                    let gates = *gates;
                    let plugin = p.clone();
                    self.ledger.replace(
                        callout,
                        Waiter::Abandoned {
                            plugin,
                            gates,
                            shaped,
                        },
                    );
                }
                Some(Waiter::Member { context }) if *context == id => {
                    // Still queued: it leaves the queue, and no answer comes. Sent: its share of
                    // the batch's answer is no one's, but a grant for later goes back.
                    let queued = p.outbox.borrow_mut().queue.forget(callout);
                    if queued || shaped.is_none() {
                        self.ledger.close(callout);
                    } else {
                        let plugin = p.clone();
                        self.ledger.replace(
                            callout,
                            Waiter::Abandoned {
                                plugin,
                                gates: false,
                                shaped,
                            },
                        );
                    }
                }
                _ => {}
            },
            Leftover::Orphan {
                id: callout,
                slot,
                keys,
            } => {
                if matches!(
                    self.ledger.get(callout).map(|e| &e.waiter),
                    Some(Waiter::Acquire { context }) if *context == id
                ) {
                    let plugin = p.clone();
                    self.ledger
                        .replace(callout, Waiter::Orphan { plugin, slot, keys });
                }
            }
        }
    }

    pub fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        // Envoy reports a call that failed while the module ran from its after-call queue.
        self.abi.enter(None, false);
        self.deliver(
            CalloutId::from(token),
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
                let body = abi.buffer(Buffer::HttpCallResponseBody, 0, body_size);
                CalloutResult::Http { status, body }
            }),
        );
    }

    /// A unary gRPC callout ended: `status` 0 with the message (`proxy_on_grpc_receive`), or a
    /// failure status without one (`proxy_on_grpc_close`).
    pub fn on_grpc_response(&mut self, token: u32, status: u32, size: usize) {
        self.deliver(
            CalloutId::from(token),
            &mut FromHost(|abi: &A| {
                if status != 0 {
                    return CalloutResult::Grpc {
                        status,
                        message: abi.grpc_status_message(),
                        body: Vec::new(),
                    };
                }
                grpc_message(abi, size)
            }),
        );
    }

    /// Callout `id` ended with the result `read` gives: its ledger entry says who waits.
    fn deliver(&mut self, id: CalloutId, read: &mut dyn Read<A>) {
        let Some(entry) = self.ledger.close(id) else {
            debug!("reply to callout {id}: no one waits for it");
            return;
        };
        self.finish(id, entry.waiter, read);
        self.end_callback();
    }

    /// Callout `id`, closed in the ledger, ended with the result `read` gives, for `waiter`.
    /// After any callout that held a plugin's batch queue back, the requests queued behind it
    /// leave together.
    fn finish(&mut self, id: CalloutId, waiter: Waiter, read: &mut dyn Read<A>) {
        let gate = waiter.gate().cloned();
        if let Some(p) = &gate {
            p.outbox.borrow_mut().queue.ended();
        }
        self.answer(id, waiter, read);
        if let Some(p) = gate {
            self.flush(&p);
        }
    }

    /// What every callback that may start callouts or answer requests ends with: the entries a
    /// token of Envoy's displaced from the ledger fail ([`Ledger::displaced`]: a request takes its
    /// failure path as for a reset, a stream is lost), the answers waiting for a round go out as
    /// far as this one allows (the timer runs fast while some still wait: [`Paced`]), and
    /// `tollgate.callouts.pending` is brought up to date.
    fn end_callback(&mut self) {
        self.abi.enter(None, false);
        if self.ledger.any_displaced() {
            for (id, entry) in self.ledger.displaced() {
                if let Waiter::Stream { plugin } = &entry.waiter {
                    // Envoy no longer knows the stream: its messages fail on the next tick.
                    let now = self.abi.now_ms();
                    if let Ok(token) = u32::try_from(id.0) {
                        let open_ms = plugin.config.breaker.open_ms;
                        plugin.outbox.borrow_mut().stream.lost(token, now, open_ms);
                    }
                }
                self.finish(id, entry.waiter, &mut Ready(Some(reset())));
            }
        }
        self.abi.send_waiting();
        if self.abi.waiting() > 0 && self.fast_tick.is_none() {
            // Rounds come with traffic; the timer brings one when none comes.
            if let Some(root) = self.roots.values().flatten().next().map(|p| p.root) {
                self.speed_up(root);
            }
        }
        self.report_pending();
    }

    /// The one place an answer goes: to whoever waits for callout `id`. `read` runs only when
    /// someone wants the result (a stray reply costs no host calls), as the request's context.
    fn answer(&mut self, id: CalloutId, waiter: Waiter, read: &mut dyn Read<A>) {
        match waiter {
            Waiter::Take { context, .. }
            | Waiter::Member { context }
            | Waiter::Acquire { context, .. } => {
                self.resume_request(context, id, read);
            }
            Waiter::Batch { members, .. } => {
                // The batch's own token waits in no request; each member is its own entry. A
                // failed batch is one failed callout: the first member still waiting reports it,
                // the others share it.
                let parts = batch::split(read.read(&self.abi), members.len());
                let mut reported = false;
                for (member, result) in members.into_iter().zip(parts) {
                    let result = if reported { result.shared() } else { result };
                    reported |= self.answer_member(member, result);
                }
            }
            Waiter::Refill { plugin, plan, .. } => {
                let result = read.read(&self.abi);
                let mut proxy = Proxy::new(&self.abi, &plugin, &mut self.ledger, 0);
                let held = flow::on_refill_result(&plugin.config, &plan, result, &mut proxy);
                keep_watching(&plugin, held);
            }
            Waiter::Release { plugin } => {
                let result = read.read(&self.abi);
                plugin.metrics.count(
                    &self.abi,
                    Metric::Slots(if inflight::released(&result) {
                        inflight::Count::Released
                    } else {
                        inflight::Count::ReleaseFailed
                    }),
                );
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
                let body = inflight::encode_release(plugin.applied.instance.as_deref(), &id, &keys);
                flow::release(&plugin.config, body, &mut proxy);
            }
            Waiter::Settle { plugin, id } => {
                let result = read.read(&self.abi);
                Proxy::new(&self.abi, &plugin, &mut self.ledger, 0).settle_answer(&id, &result);
            }
            Waiter::Late { plugin, takes } => {
                let result = read.read(&self.abi);
                let mut proxy = Proxy::new(&self.abi, &plugin, &mut self.ledger, 0);
                flow::late_answer(&plugin.config, &takes, result, &mut proxy);
            }
            Waiter::Abandoned {
                plugin,
                shaped: Some(plan),
                ..
            } => {
                let result = read.read(&self.abi);
                let mut proxy = Proxy::new(&self.abi, &plugin, &mut self.ledger, 0);
                flow::abandoned_answer(&plugin.config, &plan, result, &mut proxy);
            }
            // A stream's answers go to its messages ([`Dispatcher::on_grpc_receive`]).
            Waiter::Refund | Waiter::Abandoned { .. } | Waiter::Stream { .. } => {}
        }
    }

    /// A batch member's share of the batch answer (its entry closes here); whether it still
    /// waited.
    fn answer_member(&mut self, member: CalloutId, result: CalloutResult) -> bool {
        let Some(e) = self.ledger.close(member) else {
            return false;
        };
        self.answer(member, e.waiter, &mut Ready(Some(result)));
        true
    }

    /// Hands `read`'s result to request `context`, if it still waits for callout `id`.
    fn resume_request(&mut self, context: u32, id: CalloutId, read: &mut dyn Read<A>) {
        let Some(f) = self.filters.get_mut(&context) else {
            return;
        };
        let Some(plugin) = f.plugin.clone() else {
            return;
        };
        if !f.flow.waits_for(id) {
            return;
        }
        // The reply arrives on the root context; resume / reply must act on the request's.
        if let Err(s) = self.abi.set_effective_context(context) {
            debug!("request of callout {id} is gone: {}", abi::status_name(s));
            return;
        }
        let result = read.read(&self.abi);
        let mut proxy = Proxy::new(&self.abi, &plugin, &mut self.ledger, context);
        f.flow
            .on_callout_result(&plugin.config, id, result, &mut proxy);
        keep_watching(&plugin, std::mem::take(&mut f.flow.watched));
        if let Some(until) = f.flow.held_until() {
            self.held.hold(until, context);
            if self.fast_tick.is_none() {
                self.speed_up(plugin.root);
            }
        }
    }

    /// Root `root`'s timer runs every [`flow::HOLD_TICK_MS`], for the held requests.
    fn speed_up(&mut self, root: u32) {
        if self.abi.set_effective_context(root).is_err() {
            return;
        }
        match self.abi.set_tick_period(flow::HOLD_TICK_MS) {
            Ok(()) => self.fast_tick = Some(root),
            Err(s) => warn!("no timer for the held requests: {}", abi::status_name(s)),
        }
    }

    /// No request is held any more: root `root`'s timer runs at its configuration's own period
    /// again (a second if it asks for none).
    fn slow_down(&mut self, root: u32) {
        self.fast_tick = None;
        let Some(Some(plugin)) = self.roots.get(&root) else {
            return;
        };
        let period = flow::tick_period_ms(&plugin.config).unwrap_or(1000);
        if self.abi.set_effective_context(root).is_ok() {
            if let Err(s) = self.abi.set_tick_period(period) {
                debug!("timer not slowed down: {}", abi::status_name(s));
            }
        }
    }

    /// The held requests whose time came go on, each as its own context, earliest first.
    fn release_held(&mut self) {
        for context in self.held.due(self.abi.now_ms()) {
            let Some(f) = self.filters.get_mut(&context) else {
                continue;
            };
            let Some(plugin) = f.plugin.clone() else {
                continue;
            };
            if let Err(s) = self.abi.set_effective_context(context) {
                debug!("held request {context} is gone: {}", abi::status_name(s));
                continue;
            }
            let mut proxy = Proxy::new(&self.abi, &plugin, &mut self.ledger, context);
            f.flow.on_release(&plugin.config, &mut proxy);
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

/// What a callout that ended without a word (its root gone, its token handed out again) ended
/// with: a reset, as Envoy reports one.
fn reset() -> CalloutResult {
    CalloutResult::Http {
        status: None,
        body: Vec::new(),
    }
}

/// The gRPC message being reported, `size` bytes (unary answer or stream message): not read when
/// it is larger than any valid answer.
fn grpc_message(abi: &impl Abi, size: usize) -> CalloutResult {
    if size > MAX_ANSWER_BYTES {
        return CalloutResult::TooLarge { size };
    }
    CalloutResult::Grpc {
        status: 0,
        message: None,
        body: abi.buffer(Buffer::GrpcReceive, 0, size),
    }
}

/// The lease pools a request or a refill deposited into: `plugin`'s timer watches them.
fn keep_watching(plugin: &Plugin, held: Vec<lease::Held>) {
    if !held.is_empty() {
        plugin.outbox.borrow_mut().watch(held);
    }
}

mod batches;
mod configure;
mod messages;
#[cfg(test)]
mod tests;
