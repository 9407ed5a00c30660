//! The dispatcher driven by a fake host that hands out callout tokens the way Envoy does
//! (`+4` per call, HTTP ids ≡ 0 mod 4, gRPC ids ≡ 1 mod 4, wrapping at 2^32), deletes contexts
//! without a word about their callouts, and delivers replies late or for tokens nobody knows.
//!
//! Layout: this file is the fake host ([`Fake`]) and the helpers every module shares
//! (configurations, starting and ending requests, answers); the tests, one module per concern:
//! - `ids`: Envoy's callout tokens wrapping at 2^32 or handed out again, unknown contexts and
//!   tokens, the ledger bounded by the requests alive (a property test across the wrap).
//! - `callouts`: what a callout carries (the gRPC target, this Envoy's id, a sampled
//!   `traceparent`) and a refused or failed gRPC callout.
//! - `reads`: what a request reads from the host (headers, shared data), and the match prefilter
//!   agreeing with the core.
//! - `answers`: resumes and local replies paced, a round of them at a time.
//! - `models`: a request that waits for its body's model: keyed and priced by it, no model when
//!   the body ends, closes or passes its bound without one.
//! - `batches`: takes queued behind a callout leaving in batches: one answer each, deadlines,
//!   a slow callout, the byte bounds, an abandoned take.
//! - `breaker`: what opens the breaker and what resets its count of failures.
//! - `leases`: a background lease refill, and the watched pools handed to a pushed configuration.
//! - `settlements`: a request priced by its response, settled once (and a denied one not at all).
//! - `configs`: a configuration refused, two in one VM, one removed by a push.
//! - `held`: requests held for a grant for later (shaping), let through by the timer.
//! - `stream`: the stream of takes (`service.stream`) against the same fake.

use super::*;
use crate::core::base::store::SetError;
use crate::host::abi::Status;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

const ROOT: u32 = 1;

/// The metadata (or headers) a call or stream was opened with.
type Metadata = Vec<(String, String)>;

#[derive(Default)]
struct Fake {
    /// The plugin configuration the next `on_configure` reads.
    config: RefCell<Vec<u8>>,
    /// The current request's headers (every request context sees these).
    request: RefCell<Vec<(String, Vec<u8>)>>,
    next_http: Cell<u32>,
    next_grpc: Cell<u32>,
    next_stream: Cell<u32>,
    /// Streams opened (token, metadata), messages sent (stream token, message), streams
    /// cancelled, in order.
    streams: RefCell<Vec<(u32, Metadata)>>,
    stream_sent: RefCell<Vec<(u32, Vec<u8>)>>,
    cancelled: RefCell<Vec<u32>>,
    /// Status every stream send fails with, if set.
    refuse_send: Cell<Option<Status>>,
    /// Status every dispatch fails with, if set.
    refuse: Cell<Option<Status>>,
    /// Reply to the callout being reported: (`:status`, body).
    reply: RefCell<(Option<Vec<u8>>, Vec<u8>)>,
    effective: Cell<u32>,
    /// Contexts Envoy still knows (set_effective_context fails for others).
    known: RefCell<Vec<u32>>,
    metrics: RefCell<Vec<(String, i64)>>,
    shared: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    /// Shared-data reads (each copies a value into the module: Envoy calls back to allocate).
    shared_reads: Cell<u32>,
    full_reads: Cell<u32>,
    header_reads: Cell<u32>,
    dispatched: RefCell<Vec<(u32, Vec<u8>)>>,
    /// The timeout of each call, in order.
    timeouts: RefCell<Vec<u32>>,
    /// The headers (HTTP) or metadata (gRPC) of each dispatch, in order.
    sent_headers: RefCell<Vec<Vec<(String, String)>>>,
    resumed: RefCell<Vec<u32>>,
    replied: RefCell<Vec<(u32, u32)>>,
    /// The `retry-after` of each local reply (in `replied`'s order), if it had one.
    retry_after: RefCell<Vec<Option<String>>>,
    /// The tick period asked for (0: none).
    tick_ms: Cell<u32>,
    /// The upstream response's headers and the body piece being reported.
    response: RefCell<Vec<(String, Vec<u8>)>>,
    response_body: RefCell<Vec<u8>>,
    /// The request body buffered so far.
    request_body: RefCell<Vec<u8>>,
    /// Milliseconds added to the clock.
    clock: Cell<u64>,
}

impl Fake {
    fn new(config: &str) -> Fake {
        let f = Fake {
            config: RefCell::new(config.as_bytes().to_vec()),
            ..Fake::default()
        };
        f.next_grpc.set(1);
        f.next_stream.set(2);
        f
    }

    /// Envoy's counters from `first` on: HTTP calls `first` rounded down to a multiple of 4 (then
    /// +4 each), gRPC calls and streams 1 and 2 above it, as Envoy's one counter per kind.
    fn tokens_from(&self, first: u32) {
        let base = first & !3;
        self.next_http.set(base.wrapping_sub(4));
        self.next_grpc.set(base.wrapping_sub(3));
        self.next_stream.set(base.wrapping_sub(2));
    }

    fn metric(&self, name: &str) -> i64 {
        let m = self.metrics.borrow();
        m.iter().find(|(n, _)| n == name).map_or(0, |(_, v)| *v)
    }

    fn set_request(&self, path: &str) {
        *self.request.borrow_mut() = vec![
            (":path".into(), path.as_bytes().to_vec()),
            (":method".into(), b"GET".to_vec()),
        ];
    }
}

impl Abi for Fake {
    fn log_level(&self) -> Option<abi::Level> {
        Some(abi::Level::from_host(2))
    }
    fn memory_bytes(&self) -> u64 {
        65_536
    }
    fn now_ms(&self) -> u64 {
        1_000 + self.clock.get()
    }
    fn buffer(&self, which: Buffer, start: usize, size: usize) -> Vec<u8> {
        let range = |body: &[u8]| {
            let end = start.saturating_add(size).min(body.len());
            body.get(start.min(end)..end).unwrap_or_default().to_vec()
        };
        match which {
            Buffer::PluginConfiguration => self.config.borrow().clone(),
            Buffer::HttpResponseBody => range(&self.response_body.borrow()),
            Buffer::HttpRequestBody => range(&self.request_body.borrow()),
            _ => {
                let body = self.reply.borrow().1.clone();
                body.get(..size).map(<[u8]>::to_vec).unwrap_or(body)
            }
        }
    }
    fn header(&self, map: HeaderMap, name: &str) -> Option<Vec<u8>> {
        match map {
            HeaderMap::HttpCallResponse if name == ":status" => self.reply.borrow().0.clone(),
            HeaderMap::Request => {
                self.header_reads.set(self.header_reads.get() + 1);
                let r = self.request.borrow();
                r.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
            }
            HeaderMap::Response => {
                let r = self.response.borrow();
                r.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
            }
            _ => None,
        }
    }
    fn headers(&self, _map: HeaderMap) -> Option<Vec<(String, Vec<u8>)>> {
        self.full_reads.set(self.full_reads.get() + 1);
        Some(self.request.borrow().clone())
    }
    fn add_header(&self, _: HeaderMap, _: &str, _: &str) -> Result<(), Status> {
        Ok(())
    }
    fn property(&self, _: &[&str]) -> Option<Vec<u8>> {
        Some(b"10.0.0.1:5555".to_vec())
    }
    fn shared_get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.shared_reads.set(self.shared_reads.get() + 1);
        self.shared.borrow().get(key).cloned()
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        let mut m = self.shared.borrow_mut();
        let version = m.get(key).map_or(0, |(_, v)| *v);
        if cas.is_some_and(|c| c != version) {
            return Err(SetError::CasMismatch);
        }
        m.insert(key.to_string(), (value.to_vec(), version + 1));
        Ok(())
    }
    fn define_metric(&self, _: MetricKind, name: &str) -> Result<u32, Status> {
        let mut m = self.metrics.borrow_mut();
        // As Envoy: a name defined again (by another configuration) is the same metric.
        if let Some(i) = m.iter().position(|(n, _)| n == name) {
            return Ok(u32::try_from(i).unwrap());
        }
        m.push((name.to_string(), 0));
        Ok(u32::try_from(m.len() - 1).unwrap())
    }
    fn increment_metric(&self, id: u32, delta: i64) {
        if let Some(m) = self.metrics.borrow_mut().get_mut(id as usize) {
            m.1 += delta;
        }
    }
    fn record_metric(&self, id: u32, value: u64) {
        if let Some(m) = self.metrics.borrow_mut().get_mut(id as usize) {
            m.1 = i64::try_from(value).unwrap();
        }
    }
    fn http_call(
        &self,
        _: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, Status> {
        if let Some(s) = self.refuse.get() {
            return Err(s);
        }
        self.timeouts.borrow_mut().push(timeout_ms);
        self.sent_headers.borrow_mut().push(
            headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        let token = self.next_http.get().wrapping_add(4);
        self.next_http.set(token);
        self.dispatched.borrow_mut().push((token, body.to_vec()));
        Ok(token)
    }
    fn grpc_call(
        &self,
        service: &[u8],
        _: &str,
        _: &str,
        metadata: &[(&str, &str)],
        _: &[u8],
        _: u32,
    ) -> Result<u32, Status> {
        if let Some(s) = self.refuse.get() {
            return Err(s);
        }
        self.sent_headers.borrow_mut().push(
            metadata
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        let token = self.next_grpc.get().wrapping_add(4);
        self.next_grpc.set(token);
        self.dispatched.borrow_mut().push((token, service.to_vec()));
        Ok(token)
    }
    fn grpc_stream(
        &self,
        _: &[u8],
        service: &str,
        method: &str,
        metadata: &[(&str, &str)],
    ) -> Result<u32, Status> {
        if let Some(s) = self.refuse.get() {
            return Err(s);
        }
        assert_eq!((service, method), ("tollgate.v1.RateLimiter", "TakeStream"));
        let token = self.next_stream.get().wrapping_add(4);
        self.next_stream.set(token);
        let metadata = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.streams.borrow_mut().push((token, metadata));
        Ok(token)
    }
    fn grpc_send(&self, token: u32, message: &[u8]) -> Result<(), Status> {
        if let Some(s) = self.refuse_send.get() {
            return Err(s);
        }
        self.stream_sent
            .borrow_mut()
            .push((token, message.to_vec()));
        Ok(())
    }
    fn grpc_cancel(&self, token: u32) -> Result<(), Status> {
        self.cancelled.borrow_mut().push(token);
        Ok(())
    }
    fn grpc_status_message(&self) -> Option<String> {
        Some("unavailable".into())
    }
    fn set_tick_period(&self, period_ms: u32) -> Result<(), Status> {
        self.tick_ms.set(period_ms);
        Ok(())
    }
    fn set_effective_context(&self, id: u32) -> Result<(), Status> {
        if !self.known.borrow().contains(&id) {
            return Err(abi::BAD_ARGUMENT);
        }
        self.effective.set(id);
        Ok(())
    }
    fn resume_request(&self) -> Result<(), Status> {
        self.resumed.borrow_mut().push(self.effective.get());
        Ok(())
    }
    fn send_local_response(
        &self,
        status: u32,
        headers: &[(String, String)],
        _: &[u8],
    ) -> Result<(), Status> {
        self.replied
            .borrow_mut()
            .push((self.effective.get(), status));
        let retry = headers.iter().find(|(k, _)| k == "retry-after");
        self.retry_after
            .borrow_mut()
            .push(retry.map(|(_, v)| v.clone()));
        Ok(())
    }
}

/// A configuration over `transport`, every take a callout of its own (no batches; gRPC's takes
/// unary calls, not messages on a stream: [`stream_config`]).
fn config(transport: &str, extra: &str) -> String {
    let stream = if transport == "grpc" {
        r#","stream":false"#
    } else {
        ""
    };
    format!(
        r#"{{"service":{{"cluster":"svc","transport":"{transport}","batch":0{stream}}},
             "rules":[{{"name":"r","match":{{"path_prefix":"/api"}},"key":["literal:k"],"capacity":5,"period_ms":60000}}],
             "breaker":{{"failures":10000,"open_ms":100}}{extra}}}"#
    )
}

fn dispatcher(cfg: &str) -> Dispatcher<Fake> {
    let mut d = Dispatcher::new(Fake::new(cfg));
    d.on_context_create(ROOT, 0);
    assert!(d.on_vm_start());
    assert!(d.on_configure(ROOT, cfg.len()));
    d
}

/// A request context that reached its headers: `PAUSE` if it now waits for a callout.
fn start(d: &mut Dispatcher<Fake>, id: u32, path: &str) -> u32 {
    start_on(d, ROOT, id, path)
}

/// [`start`] under root context `root`.
fn start_on(d: &mut Dispatcher<Fake>, root: u32, id: u32, path: &str) -> u32 {
    d.on_context_create(id, root);
    d.abi.known.borrow_mut().push(id);
    d.abi.set_request(path);
    // Envoy calls into the module as the request's context.
    d.abi.effective.set(id);
    d.on_request_headers(id, false)
}

/// A second root context (another configuration of the same VM: a second listener, or a push)
/// configured with `cfg`.
fn configure(d: &mut Dispatcher<Fake>, root: u32, cfg: &str) {
    *d.abi.config.borrow_mut() = cfg.as_bytes().to_vec();
    d.on_context_create(root, 0);
    d.abi.known.borrow_mut().push(root);
    assert!(d.on_configure(root, cfg.len()));
}

/// The client went away: Envoy deletes the context and says nothing about its callout.
fn disconnect(d: &mut Dispatcher<Fake>, id: u32) {
    d.abi.known.borrow_mut().retain(|k| *k != id);
    d.on_delete(id);
}

fn allowed_reply(d: &Dispatcher<Fake>) {
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"allowed":true,"buckets":[{"allowed":true,"limit":5,"remaining":4,"reset_ms":1000,"retry_after_ms":0}]}"#.to_vec(),
    );
}

/// The body of the last call sent, as JSON.
fn last_sent(d: &Dispatcher<Fake>) -> serde_json::Value {
    let body = d.abi.dispatched.borrow().last().map(|(_, b)| b.clone());
    serde_json::from_slice(&body.expect("a call was sent")).expect("a JSON body")
}

fn last_token(d: &Dispatcher<Fake>) -> u32 {
    d.abi.dispatched.borrow().last().map(|(t, _)| *t).unwrap()
}

/// A batching configuration over HTTP with a 20 ms timeout (a 5 ms tick) that denies when the
/// service does not answer.
fn slow_batch_config(extra: &str) -> String {
    config("http", extra)
        .replace(r#""batch":0"#, r#""batch":8,"timeout_ms":20"#)
        .replace(
            r#""breaker":{"failures":10000,"open_ms":100}"#,
            r#""breaker":{"failures":10000,"open_ms":100},"failure_mode":"deny""#,
        )
}

/// A rule charged by the response: estimate 100 from `x-max-tokens` (absent: the default).
fn charged_config() -> String {
    r#"{"service":{"cluster":"svc","transport":"http","batch":0},
        "rules":[{"name":"llm","key":["literal:k"],"capacity":10000,"period_ms":60000,
                  "cost":{"header":"x-max-tokens","default":100,"max":4000},
                  "charge":"response","usage":{"header":"x-usage"}}]}"#
        .to_string()
}

/// An admitted request of `charged_config` whose response sends `content_type` and `body` in one
/// piece (`end`: the stream ended), then is deleted; the settle body sent, if any.
fn settle_after(
    d: &mut Dispatcher<Fake>,
    id: u32,
    headers: &[(&str, &str)],
    body: &[u8],
    end: bool,
) -> Option<String> {
    allowed_reply(d);
    assert_eq!(start(d, id, "/v1/chat"), PAUSE);
    d.on_http_call_response(last_token(d), 1, 1000);
    let sent_before = d.abi.dispatched.borrow().len();
    *d.abi.response.borrow_mut() = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
        .collect();
    *d.abi.response_body.borrow_mut() = body.to_vec();
    assert_eq!(d.on_response_headers(id, false), CONTINUE);
    assert_eq!(d.on_response_body(id, body.len(), end), CONTINUE);
    d.on_delete(id);
    let sent = d.abi.dispatched.borrow();
    sent.get(sent_before)
        .map(|(_, b)| String::from_utf8(b.clone()).unwrap())
}

/// `n` JSON answers in a batch answer, each allowed (`limit` as given) or denied.
fn batch_reply(d: &Dispatcher<Fake>, answers: &[(bool, u64)]) {
    let parts: Vec<String> = answers
        .iter()
        .map(|(ok, limit)| {
            format!(
                r#"{{"allowed":{ok},"buckets":[{{"allowed":{ok},"limit":{limit},"remaining":0,"reset_ms":1,"retry_after_ms":{}}}]}}"#,
                if *ok { 0 } else { 1000 }
            )
        })
        .collect();
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        format!(r#"{{"results":[{}]}}"#, parts.join(",")).into_bytes(),
    );
}

/// [`start`] for `/api` with a `traceparent` header.
fn start_traced(d: &mut Dispatcher<Fake>, id: u32, traceparent: &str) -> u32 {
    d.on_context_create(id, ROOT);
    d.abi.known.borrow_mut().push(id);
    d.abi.set_request("/api");
    d.abi
        .request
        .borrow_mut()
        .push(("traceparent".into(), traceparent.as_bytes().to_vec()));
    d.on_request_headers(id, false)
}

mod answers;
mod batches;
mod breaker;
mod callouts;
mod configs;
mod held;
mod ids;
mod leases;
mod models;
mod reads;
mod settlements;
mod stream;
