//! Answers to requests (resume, local reply) paced so Envoy never runs more than
//! [`MAX_ANSWERS_PER_ROUND`] of them one inside another.
//!
//! Why: Envoy does not carry out `proxy_continue_stream` or `proxy_send_local_response` when the
//! module calls it; it queues the action (`addAfterVmCallAction` in Envoy's
//! `source/extensions/common/wasm/context.cc`, `Context::continueStream` and
//! `Context::sendLocalResponse`), and proxy-wasm-cpp-host runs the queue when the call into the
//! VM returns (`DeferAfterCallActions`' destructor, `src/context.cc`, calls
//! `WasmBase::doAfterVmCallActions`, `include/proxy-wasm/wasm.h`). That queue is the VM's one
//! queue, and an action that calls into the VM again starts the same drain from inside itself: a
//! local reply goes through the encoder filters, so `proxy_on_response_headers` runs for it
//! (`ContextBase::onResponseHeaders`, with its own `DeferAfterCallActions`), and when that returns
//! the next queued action runs *inside* it. So N local replies asked for in one callback (the
//! failures of 8 batches of 64 on one tick, a stream's end) nest N deep on the native stack; V8
//! checks its stack limit there, and a few hundred deep (between 257 and 375 with this Envoy)
//! the innermost call into the module throws `RangeError: Maximum call stack size exceeded`:
//! the VM is failed, and the worker answers 503 to everything after. A resume nests the same
//! way when the router answers it at once (no healthy upstream, its circuit breaker open), and
//! a callout that fails while the module runs is reported from that queue too (Envoy defers
//! `onHttpCallFailure`, `onHttpCallSuccess` and `onGrpcCloseWrapper` when re-entered).
//!
//! So every resume and local reply the module asks for goes through [`Paced`]: at most
//! [`MAX_ANSWERS_PER_ROUND`] in one *round*, the rest wait in a first-in-first-out backlog. A
//! round begins with a callback Envoy makes from its event loop, never from that queue (a
//! request's headers, a gRPC message received, the timer's tick: [`Paced::enter`] with `fresh`);
//! callbacks that may run from the queue (response headers, a callout's failure or answer, a
//! context deleted) spend what is left of the round. The backlog goes out as rounds allow, at
//! the end of each callback, oldest first; while it is not empty the root's timer runs fast
//! (the dispatcher), so a round comes soon even when no traffic arrives. Between two rounds the
//! host's queue holds at most that many answers, and nothing nests deeper.
//!
//! An answer waiting here is the request's final word, only not yet carried out: a request whose
//! context is deleted meanwhile leaves the backlog ([`Paced::forget`]).

use super::abi::{self, Abi, Status};
use log::debug;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::ops::Deref;

/// The most requests resumed or answered locally in one round: one full batch's answers (the
/// contract's largest batch is 64) go out at once, and the nesting stays a fifth of what
/// overflowed V8's stack with this Envoy.
pub const MAX_ANSWERS_PER_ROUND: usize = 64;

/// What a request is told.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    Resume,
    Reply {
        status: u32,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
}

/// An [`Abi`] whose resumes and local replies are paced (the module doc); every other call
/// goes straight through to `A`.
pub struct Paced<A> {
    inner: A,
    /// The request the host acts on now: the callback's, or the one last made effective (`None`:
    /// the root, or not known; an answer then goes straight through).
    current: Cell<Option<u32>>,
    /// Answers the host may still take in this round.
    left: Cell<usize>,
    backlog: RefCell<VecDeque<(u32, Answer)>>,
}

impl<A> Deref for Paced<A> {
    type Target = A;

    fn deref(&self) -> &A {
        &self.inner
    }
}

impl<A: Abi> Paced<A> {
    pub fn new(inner: A) -> Self {
        Paced {
            inner,
            current: Cell::new(None),
            left: Cell::new(MAX_ANSWERS_PER_ROUND),
            backlog: RefCell::new(VecDeque::new()),
        }
    }

    /// A callback for `context` (`None`: a root's) begins; `fresh`: Envoy makes it from its event
    /// loop, never from its queue of after-call actions, so a new round begins.
    pub fn enter(&self, context: Option<u32>, fresh: bool) {
        self.current.set(context);
        if fresh {
            self.left.set(MAX_ANSWERS_PER_ROUND);
        }
    }

    /// Answers waiting for a round.
    pub fn waiting(&self) -> usize {
        self.backlog.borrow().len()
    }

    /// Request `context` is gone: its answer, if one waits, is no one's.
    pub fn forget(&self, context: u32) {
        self.backlog.borrow_mut().retain(|(c, _)| *c != context);
        if self.current.get() == Some(context) {
            self.current.set(None);
        }
    }

    /// Carries out waiting answers, oldest first, as far as the round allows (each as its own
    /// context; one whose context Envoy no longer knows is dropped). The current context is
    /// then unknown.
    pub fn send_waiting(&self) {
        loop {
            if self.left.get() == 0 {
                return;
            }
            let Some((context, answer)) = self.backlog.borrow_mut().pop_front() else {
                return;
            };
            self.current.set(None);
            if let Err(s) = self.inner.set_effective_context(context) {
                debug!(
                    "answered request {context} is gone: {}",
                    abi::status_name(s)
                );
                continue;
            }
            self.left.set(self.left.get() - 1);
            let done = match &answer {
                Answer::Resume => self.inner.resume_request(),
                Answer::Reply {
                    status,
                    headers,
                    body,
                } => self.inner.send_local_response(*status, headers, body),
            };
            if let Err(s) = done {
                debug!(
                    "request {context}: its answer refused: {}",
                    abi::status_name(s)
                );
            }
        }
    }

    /// Whether an answer for the current request must wait (the request it is for), or goes out
    /// now (`None`: the round allows it and nothing waits before it, or the current request is
    /// not known), counted against the round.
    fn must_wait(&self) -> Option<u32> {
        match self.current.get() {
            Some(context) if self.left.get() == 0 || !self.backlog.borrow().is_empty() => {
                Some(context)
            }
            _ => {
                self.left.set(self.left.get().saturating_sub(1));
                None
            }
        }
    }
}

impl<A: Abi> Abi for Paced<A> {
    fn log_level(&self) -> Option<abi::Level> {
        self.inner.log_level()
    }
    fn memory_bytes(&self) -> u64 {
        self.inner.memory_bytes()
    }
    fn now_ms(&self) -> u64 {
        self.inner.now_ms()
    }
    fn buffer(&self, which: abi::Buffer, start: usize, size: usize) -> Vec<u8> {
        self.inner.buffer(which, start, size)
    }
    fn header(&self, map: abi::HeaderMap, name: &str) -> Option<Vec<u8>> {
        self.inner.header(map, name)
    }
    fn headers(&self, map: abi::HeaderMap) -> Option<Vec<(String, Vec<u8>)>> {
        self.inner.headers(map)
    }
    fn add_header(&self, map: abi::HeaderMap, name: &str, value: &str) -> Result<(), Status> {
        self.inner.add_header(map, name, value)
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.inner.property(path)
    }
    fn shared_get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.inner.shared_get(key)
    }
    fn shared_set(
        &self,
        key: &str,
        value: &[u8],
        cas: Option<u32>,
    ) -> Result<(), crate::core::base::store::SetError> {
        self.inner.shared_set(key, value, cas)
    }
    fn define_metric(&self, kind: abi::MetricKind, name: &str) -> Result<u32, Status> {
        self.inner.define_metric(kind, name)
    }
    fn increment_metric(&self, id: u32, delta: i64) {
        self.inner.increment_metric(id, delta);
    }
    fn record_metric(&self, id: u32, value: u64) {
        self.inner.record_metric(id, value);
    }
    fn http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, Status> {
        self.inner.http_call(cluster, headers, body, timeout_ms)
    }
    fn grpc_call(
        &self,
        service: &[u8],
        service_name: &str,
        method: &str,
        metadata: &[(&str, &str)],
        message: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, Status> {
        self.inner
            .grpc_call(service, service_name, method, metadata, message, timeout_ms)
    }
    fn grpc_stream(
        &self,
        service: &[u8],
        service_name: &str,
        method: &str,
        metadata: &[(&str, &str)],
    ) -> Result<u32, Status> {
        self.inner
            .grpc_stream(service, service_name, method, metadata)
    }
    fn callout_for(&self, contexts: &[u32], message: Option<u64>) {
        self.inner.callout_for(contexts, message)
    }
    fn grpc_send(&self, token: u32, message: &[u8]) -> Result<(), Status> {
        self.inner.grpc_send(token, message)
    }
    fn grpc_cancel(&self, token: u32) -> Result<(), Status> {
        self.inner.grpc_cancel(token)
    }
    fn grpc_status_message(&self) -> Option<String> {
        self.inner.grpc_status_message()
    }
    fn set_tick_period(&self, period_ms: u32) -> Result<(), Status> {
        self.inner.set_tick_period(period_ms)
    }
    fn set_effective_context(&self, context_id: u32) -> Result<(), Status> {
        let set = self.inner.set_effective_context(context_id);
        self.current.set(set.is_ok().then_some(context_id));
        set
    }
    fn resume_request(&self) -> Result<(), Status> {
        match self.must_wait() {
            Some(context) => {
                self.backlog
                    .borrow_mut()
                    .push_back((context, Answer::Resume));
                Ok(())
            }
            None => self.inner.resume_request(),
        }
    }
    fn send_local_response(
        &self,
        status: u32,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<(), Status> {
        match self.must_wait() {
            Some(context) => {
                let answer = Answer::Reply {
                    status,
                    headers: headers.to_vec(),
                    body: body.to_vec(),
                };
                self.backlog.borrow_mut().push_back((context, answer));
                Ok(())
            }
            None => self.inner.send_local_response(status, headers, body),
        }
    }
}
