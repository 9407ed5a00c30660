//! The proxy side of the core's [`Host`] port: what a request's flow (or the root's timer) asks
//! of Envoy, over an [`Abi`], every callout recorded in the VM's ledger the moment it starts, and
//! the delivery of settlements.

use super::abi::{self, Abi, HeaderMap};
use super::metrics::SettleCount;
use super::plugin::{Plugin, Waiter};
use crate::core::base::ledger::{CalloutId, Ledger};
use crate::core::base::place::Memos;
use crate::core::base::store::{CasStore, SetError};
use crate::core::config::Config;
use crate::core::flow::{self, Applied, Callout, Host, Metric, Unsent};
use crate::core::outbox::Leave;
use crate::core::settle;
use crate::core::wire::batch;
use crate::core::wire::callout::{self, CalloutRequest};
use crate::core::wire::plan::{CalloutResult, LocalReply, Plan};
use crate::core::wire::stream::Route;
use crate::core::wire::TakeRequest;
use log::{debug, warn};
use std::rc::Rc;

/// The shortest timeout of a callout no request waits for (releases, refunds, settlements), ms.
const BACKGROUND_TIMEOUT_MS: u64 = 1000;

/// The proxy side of the core's [`Host`] port, acting for one request context (or for the root
/// itself: `context` 0). Every callout it starts is recorded in the ledger as it starts.
pub(super) struct Proxy<'a, A: Abi> {
    abi: &'a A,
    plugin: &'a Rc<Plugin>,
    shared: Shared<'a, A>,
    ledger: &'a mut Ledger<Waiter>,
    context: u32,
}

impl<'a, A: Abi> Proxy<'a, A> {
    pub(super) fn new(
        abi: &'a A,
        plugin: &'a Rc<Plugin>,
        ledger: &'a mut Ledger<Waiter>,
        context: u32,
    ) -> Self {
        Proxy {
            abi,
            plugin,
            shared: Shared::of(abi, plugin),
            ledger,
            context,
        }
    }

    /// Records callout `token` (just dispatched) in the ledger; its id there. A token Envoy hands
    /// out while an entry still holds it is counted (`tollgate.callouts.collided`); the entry it
    /// displaced fails when the callback ends (`Dispatcher::end_callback`).
    pub(super) fn open(&mut self, token: u32, waiter: Waiter) -> CalloutId {
        if self.ledger.open(token, self.plugin.root, waiter) {
            warn!("callout token {token} handed out again while still in flight: the callout it named fails");
            self.plugin.metrics.collided(self.abi);
        }
        CalloutId::from(token)
    }

    /// Starts a take (`plan`'s, for `waiter`): sent now, or queued for the next batch when the
    /// plugin batches and one of its callouts is in flight. Its id in the ledger (one of the
    /// VM's own if it goes in a batch or a message).
    pub(super) fn take(
        &mut self,
        cfg: &Config,
        plan: &Plan,
        refill: bool,
    ) -> Result<CalloutId, Unsent> {
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
        let leave = self
            .plugin
            .outbox
            .borrow()
            .leave(cfg, plan.rls.is_some(), trace.is_some());
        let context = self.context;
        // Its own callout (`gates`: holding the batch queue back), or its place in a batch.
        let waiter = |own: Option<bool>| match (refill, own) {
            (true, gates) => Waiter::Refill {
                plugin: plugin.clone(),
                plan: plan.clone(),
                gates: gates.unwrap_or(false),
            },
            (false, Some(gates)) => Waiter::Take {
                context,
                plugin: plugin.clone(),
                gates,
            },
            (false, None) => Waiter::Member { context },
        };
        if leave == Leave::Queue {
            let id = self.ledger.reserve(self.plugin.root, waiter(None));
            let queued = self.plugin.outbox.borrow_mut().queue.push(
                batch::queue_bound(cfg),
                id,
                &plan.request,
                self.abi.now_ms(),
            );
            if let Err(why) = queued {
                self.ledger.close(id);
                return Err(Unsent { why, local: true });
            }
            return Ok(id);
        }
        if leave == Leave::Message {
            // Alone now, it leaves at once: a message of one take on the stream.
            let id = self.ledger.reserve(self.plugin.root, waiter(None));
            let now = self.abi.now_ms();
            let deadline = now.saturating_add(cfg.service.timeout_ms);
            if let Err(why) = self.send_batch(cfg, vec![id], &[&plan.request], now, deadline) {
                self.ledger.close(id);
                return Err(why.into());
            }
            return Ok(id);
        }
        let timeout = cfg.service.timeout_ms;
        let take = callout::take(cfg, self.instance(), plan);
        if !refill {
            self.abi.callout_for(&[context], None);
        }
        let sent = self.send_within(cfg, take, timeout, trace.as_deref());
        let token = sent.map_err(|why| {
            warn!(
                "callout to cluster {:?} failed to dispatch: {why}",
                cfg.service.cluster
            );
            why
        })?;
        let gates = leave == (Leave::Call { gates: true });
        if gates {
            let now = self.abi.now_ms();
            self.plugin.outbox.borrow_mut().queue.started(now);
        }
        let w = waiter(Some(gates));
        Ok(self.open(token, w))
    }

    /// Sends `takes` (for the waiters of the ids `members`, in order) as one batch at
    /// `now`, due by `deadline_ms`: a message on the plugin's stream (`service.stream`), or a
    /// batch callout with what is left until then as its timeout. It holds the batch queue back
    /// until it ends, and is recorded in the ledger as a [`Waiter::Batch`].
    pub(super) fn send_batch(
        &mut self,
        cfg: &Config,
        members: Vec<CalloutId>,
        takes: &[&TakeRequest],
        now: u64,
        deadline_ms: u64,
    ) -> Result<(), String> {
        let n = members.len();
        let waiting: Vec<u32> = members
            .iter()
            .filter_map(|id| match self.ledger.get(*id)?.waiter {
                Waiter::Member { context } => Some(context),
                _ => None,
            })
            .collect();
        let batch = Waiter::Batch {
            plugin: self.plugin.clone(),
            members,
        };
        if cfg.service.stream {
            self.send_message(cfg, takes, batch, &waiting, now, deadline_ms)?;
        } else {
            let request = callout::batch(cfg, self.instance(), takes);
            let left = deadline_ms.saturating_sub(now).max(1);
            self.abi.callout_for(&waiting, None);
            let token = self.send_within(cfg, request, left, None)?;
            self.open(token, batch);
        }
        self.plugin.metrics.batched(self.abi, n);
        self.plugin.outbox.borrow_mut().queue.started(now);
        Ok(())
    }

    /// Sends `takes` as one message on the plugin's stream (opening one if need be) at `now`, due
    /// by `deadline_ms`; `batch` waits for its answer under an id of the VM's own, the message's,
    /// as do the requests `waiting`.
    fn send_message(
        &mut self,
        cfg: &Config,
        takes: &[&TakeRequest],
        batch: Waiter,
        waiting: &[u32],
        now: u64,
        deadline_ms: u64,
    ) -> Result<(), String> {
        let stream = self.stream(cfg, now)?;
        // Its ledger id is the message's id on the wire, which its answer carries back.
        let id = self.ledger.reserve(self.plugin.root, batch);
        let message = callout::stream_message(self.instance(), takes, id);
        self.abi.callout_for(waiting, Some(id.0));
        if let Err(status) = self.abi.grpc_send(stream, &message) {
            // Envoy does not know the stream: nothing more will come of it.
            self.ledger.close(id);
            self.plugin
                .outbox
                .borrow_mut()
                .stream
                .lost(stream, now, cfg.breaker.open_ms);
            self.ledger.close(CalloutId::from(stream));
            return Err(format!(
                "stream {stream} lost: {}",
                abi::status_name(status)
            ));
        }
        self.plugin
            .outbox
            .borrow_mut()
            .stream
            .sent(id, deadline_ms, takes.len(), now);
        Ok(())
    }

    /// The plugin's open stream, opened now if there is none (an old idle one is replaced):
    /// its token, or why there is none (backing off after streams that answered nothing, or
    /// Envoy refused to open one).
    fn stream(&mut self, cfg: &Config, now: u64) -> Result<u32, String> {
        let route = self.plugin.outbox.borrow().stream.route(now);
        match route {
            Route::Send(token) => return Ok(token),
            Route::Wait(until) => {
                return Err(format!(
                    "no stream to the service for {} ms more (backing off)",
                    until.saturating_sub(now)
                ))
            }
            Route::Replace(old) => {
                // Nothing is in flight on it: cancelled, it loses nothing.
                if let Err(s) = self.abi.grpc_cancel(old) {
                    debug!("stream {old} not cancelled: {}", abi::status_name(s));
                }
                self.ledger.close(CalloutId::from(old));
                self.plugin.outbox.borrow_mut().stream.retired(old);
            }
            Route::Open => {}
        }
        let mut metadata: Vec<(&str, &str)> = Vec::new();
        if let Some(b) = self.plugin.bearer.as_deref() {
            metadata.push(("authorization", b));
        }
        let (service, method) = callout::STREAM;
        match self
            .abi
            .grpc_stream(&self.plugin.grpc_service, service, method, &metadata)
        {
            Ok(token) => {
                self.plugin.outbox.borrow_mut().stream.opened(token, now);
                let plugin = self.plugin.clone();
                self.open(token, Waiter::Stream { plugin });
                Ok(token)
            }
            Err(status) => {
                self.plugin
                    .outbox
                    .borrow_mut()
                    .stream
                    .open_failed(now, cfg.breaker.open_ms);
                Err(format!(
                    "stream to cluster {:?} not opened: {}",
                    cfg.service.cluster,
                    abi::status_name(status)
                ))
            }
        }
    }

    /// Sends a callout no request waits for (a release, a refund, a settlement) and records it
    /// for `waiter`. `service.timeout_ms` bounds how long a *request* waits, and a release cut
    /// off by a short one under load would leave its slot to the deadline: so the timeout is at
    /// least [`BACKGROUND_TIMEOUT_MS`].
    pub(super) fn send_background(
        &mut self,
        cfg: &Config,
        request: CalloutRequest,
        waiter: Waiter,
    ) -> Result<CalloutId, String> {
        let timeout = cfg.service.timeout_ms.max(BACKGROUND_TIMEOUT_MS);
        let token = self.send_within(cfg, request, timeout, None)?;
        Ok(self.open(token, waiter))
    }

    /// Dispatches `request` to the service cluster with `timeout_ms`, the bearer token, and the
    /// request's `traceparent` when it is traced (`service.trace`: an HTTP header or gRPC
    /// metadata); the callout's token.
    pub(super) fn send_within(
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
    pub(super) fn send_settles(&mut self) {
        let plugin = self.plugin;
        let cfg = &plugin.config;
        let now = self.abi.now_ms();
        let due: Vec<(String, Vec<u8>)> = plugin
            .outbox
            .borrow_mut()
            .settles
            .due(now)
            .into_iter()
            .map(|p| {
                (
                    p.id.clone(),
                    settle::encode(&p.id, plugin.applied.instance.as_deref(), &p.what),
                )
            })
            .collect();
        for (id, body) in due {
            self.count_settle(SettleCount::Sent, 1);
            let waiter = Waiter::Settle {
                plugin: plugin.clone(),
                id: id.clone(),
            };
            let attempt = callout::beside(cfg, "settle", body);
            if let Err(why) = self.send_background(cfg, attempt, waiter) {
                debug!("settlement {id} not dispatched: {why}");
                let delivery = plugin.outbox.borrow_mut().settles.answered(&id, false, now);
                self.settle_delivery(&id, delivery);
            }
        }
    }

    /// The answer to settlement `id`: applied (or applied before), refused for good, or failed
    /// (tried again from the timer).
    pub(super) fn settle_answer(&self, id: &str, result: &CalloutResult) {
        let now = self.abi.now_ms();
        let status = match result {
            CalloutResult::Http { status, .. } => *status,
            _ => None,
        };
        let mut outbox = self.plugin.outbox.borrow_mut();
        let q = &mut outbox.settles;
        if matches!(status, Some(200..=299)) {
            // Applied: the tokens it gave back are in the buckets, and a denial remembered of
            // them no longer holds.
            if let Some(items) = q.get(id) {
                flow::settlement_applied(&self.plugin.config, items, self.store());
            }
        }
        let delivery = match status {
            Some(200..=299) => q.answered(id, true, now),
            Some(s @ 400..=499) if s != 408 && s != 429 => {
                warn!("settlement {id} refused by the service (HTTP {s}): not sent again");
                q.refused(id)
            }
            _ => q.answered(id, false, now),
        };
        drop(outbox);
        self.settle_delivery(id, delivery);
    }

    pub(super) fn settle_delivery(&self, id: &str, delivery: settle::Delivery) {
        match delivery {
            settle::Delivery::Delivered => self.count_settle(SettleCount::Delivered, 1),
            settle::Delivery::Retry { at_ms } => {
                debug!("settlement {id} failed; trying again at {at_ms}");
                self.count_settle(SettleCount::Retried, 1);
            }
            settle::Delivery::GaveUp => {
                warn!("settlement {id} given up: the service never applied it");
                self.count_settle(SettleCount::GivenUp, 1);
            }
        }
    }

    pub(super) fn count_settle(&self, what: SettleCount, n: u64) {
        self.plugin.metrics.settled(self.abi, what, n);
    }

    /// This Envoy's instance id, which every callout carries.
    fn instance(&self) -> Option<&'a str> {
        self.plugin.applied.instance.as_deref()
    }
}

/// Proxy-wasm shared data: process-wide, shared by every worker's VM of the same `vm_id`.
pub(super) struct Shared<'a, A: Abi> {
    pub(super) abi: &'a A,
    /// The plugin's shared-data key prefix.
    pub(super) prefix: &'a str,
    /// The plugin's memo of the places last found in its tables.
    pub(super) memos: &'a Memos,
}

impl<'a, A: Abi> Shared<'a, A> {
    /// `plugin`'s shared data: its prefix, its memo.
    pub(super) fn of(abi: &'a A, plugin: &'a Plugin) -> Self {
        Shared {
            abi,
            prefix: &plugin.prefix,
            memos: &plugin.memos,
        }
    }

    /// The shared-data key of `key`: the plugin's prefix, then `key` (joined without `format!`,
    /// whose machinery cost every read and write of an exact request more than the join).
    fn name(&self, key: &str) -> String {
        let mut name = String::with_capacity(self.prefix.len() + key.len());
        name.push_str(self.prefix);
        name.push_str(key);
        name
    }
}

impl<A: Abi> CasStore for Shared<'_, A> {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.abi.shared_get(&self.name(key))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.abi.shared_set(&self.name(key), value, cas)
    }

    fn memos(&self) -> &Memos {
        self.memos
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

    fn send(&mut self, cfg: &Config, out: Callout<'_>) -> Result<CalloutId, Unsent> {
        match out {
            Callout::Take(plan) => self.take(cfg, plan, false),
            Callout::Refill(plan) => self.take(cfg, plan, true),
            Callout::Refund(request) => {
                let refund = callout::refund(cfg, self.instance(), request);
                Ok(self.send_background(cfg, refund, Waiter::Refund)?)
            }
            Callout::Acquire(body) => {
                let acquire = callout::beside(cfg, "acquire", body);
                self.abi.callout_for(&[self.context], None);
                let token = self.send_within(cfg, acquire, cfg.service.timeout_ms, None)?;
                let context = self.context;
                Ok(self.open(token, Waiter::Acquire { context }))
            }
            Callout::Release(body) => {
                let plugin = self.plugin.clone();
                let release = callout::beside(cfg, "release", body);
                Ok(self.send_background(cfg, release, Waiter::Release { plugin })?)
            }
        }
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

    fn count(&mut self, metric: Metric) {
        self.plugin.metrics.count(self.abi, metric);
    }

    fn place(&mut self, rule: usize, max: u32) -> bool {
        self.plugin.outbox.borrow_mut().place(rule, max)
    }

    fn unplace(&mut self, rule: usize) {
        self.plugin.outbox.borrow_mut().unplace(rule);
    }

    fn applied(&self) -> &Applied {
        &self.plugin.applied
    }
}
