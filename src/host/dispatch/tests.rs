//! The dispatcher driven by a fake host that hands out callout tokens the way Envoy does
//! (`+4` per call, HTTP ids ≡ 0 mod 4, gRPC ids ≡ 1 mod 4, wrapping at 2^32), deletes contexts
//! without a word about their callouts, and delivers replies late or for tokens nobody knows.
//! `stream`: the stream of takes (`service.stream`) against the same fake.

use super::*;
use crate::core::base::store::SetError;
use crate::core::rules::Request;
use crate::core::wire::callout::grpc_service;
use crate::core::wire::plan::Decision;
use crate::host::abi::Status;
use crate::host::request::match_headers;
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
    fn buffer(&self, which: Buffer, size: usize) -> Vec<u8> {
        match which {
            Buffer::PluginConfiguration => self.config.borrow().clone(),
            Buffer::HttpResponseBody => {
                let body = self.response_body.borrow();
                body.get(..size).unwrap_or(&body).to_vec()
            }
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
    d.on_request_headers(id)
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

fn last_token(d: &Dispatcher<Fake>) -> u32 {
    d.abi.dispatched.borrow().last().map(|(t, _)| *t).unwrap()
}

#[test]
fn callout_ids_wrap_around_without_a_leak_or_a_trap() {
    let cfg = config("http", "");
    let mut d = dispatcher(&cfg);
    allowed_reply(&d);
    // Envoy's counter after about 2^30 callouts: the next few ids wrap through 0.
    d.abi.next_http.set(0u32.wrapping_sub(4 * 50));
    let mut orphaned = Vec::new();
    let mut id = 100;
    // 200 requests: every other client disconnects while its callout is in flight.
    for i in 0..200 {
        id += 1;
        assert_eq!(start(&mut d, id, "/api/x"), PAUSE);
        let token = last_token(&d);
        if i % 2 == 0 {
            disconnect(&mut d, id);
            orphaned.push(token);
        } else {
            d.on_http_call_response(token, 1, 1000);
            assert_eq!(
                d.abi.resumed.borrow().last(),
                Some(&id),
                "resumed its own request"
            );
            d.on_delete(id);
        }
        assert_eq!(
            d.pending_callouts(),
            0,
            "nothing kept once the request is gone"
        );
    }
    {
        let sent = d.abi.dispatched.borrow();
        assert_eq!(
            sent.first().map(|s| s.0),
            Some(u32::MAX - 195),
            "started near the top"
        );
        assert!(sent.iter().any(|s| s.0 == 0), "and wrapped through 0");
    }
    // Late replies for requests that are gone: dropped.
    for t in &orphaned {
        d.on_http_call_response(*t, 1, 1000);
    }
    assert_eq!(d.abi.resumed.borrow().len(), 100);
    // The counter comes round to the orphaned ids again: each is simply a new callout.
    let first = orphaned[0];
    d.abi.next_http.set(first.wrapping_sub(4));
    id += 1;
    assert_eq!(start(&mut d, id, "/api/x"), PAUSE);
    assert_eq!(
        last_token(&d),
        first,
        "an id whose request vanished is handed out again"
    );
    d.on_http_call_response(first, 1, 1000);
    assert_eq!(d.abi.resumed.borrow().last(), Some(&id));
    d.on_delete(id);
    assert_eq!((d.pending_callouts(), d.live_requests()), (0, 0));
    assert_eq!(d.abi.metric("tollgate.callouts.pending"), 0);
    assert_eq!(d.abi.metric("tollgate.allowed"), 101);
    assert_eq!(d.abi.metric("tollgate.callouts.collided"), 0);
}

/// Envoy repeating a token still in flight (its counter wraps unchecked: 2^30 callouts while one
/// waits) is an error counted, and the callout the token named fails: its request takes the
/// failure path, and the answer goes to the new callout's request alone.
#[test]
fn a_token_envoy_hands_out_again_fails_the_callout_it_named() {
    for transport in ["http", "grpc"] {
        let cfg = config(transport, r#","failure_mode":"deny""#);
        let mut d = dispatcher(&cfg);
        assert_eq!(start(&mut d, 10, "/api"), PAUSE);
        let token = last_token(&d);
        d.abi.tokens_from(token);
        assert_eq!(start(&mut d, 11, "/api"), PAUSE);
        assert_eq!(last_token(&d), token, "{transport}: the same token again");
        assert_eq!(d.abi.metric("tollgate.callouts.collided"), 1);
        assert_eq!(*d.abi.replied.borrow(), vec![(10, 429)], "{transport}");
        assert_eq!(d.abi.metric("tollgate.callout_failure.reset"), 1);
        assert_eq!((d.pending_callouts(), d.ledger_entries()), (1, 1));
        allowed_reply(&d);
        if transport == "http" {
            d.on_http_call_response(token, 1, 1000);
        } else {
            *d.abi.reply.borrow_mut() = (None, vec![0x08, 1, 0x12, 2, 0x08, 1]);
            d.on_grpc_response(token, 0, 6);
        }
        assert_eq!(*d.abi.resumed.borrow(), vec![11], "{transport}");
        assert_eq!(d.abi.replied.borrow().len(), 1);
        assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
        assert_eq!(d.abi.metric("tollgate.callouts.pending"), 0);
    }
}

/// What the fake service does next in [`every_request_gets_its_own_answer_across_envoys_wrap`].
#[derive(Debug, Clone)]
enum Step {
    /// A request arrives (it calls, or queues behind the callout in flight).
    Start,
    /// The `i`-th callout not yet answered is answered, whatever its age.
    Answer(u8),
    /// The `i`-th request still waiting goes away.
    Leave(u8),
    /// Envoy's counters jump to `n` calls below 2^32 (callouts of other filters of the worker),
    /// once.
    Jump(u8),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        3 => Just(Step::Start),
        3 => any::<u8>().prop_map(Step::Answer),
        1 => any::<u8>().prop_map(Step::Leave),
        1 => any::<u8>().prop_map(Step::Jump),
    ]
}

/// The fake service's answer to callout `body` (a take or a batch of them, JSON): every take
/// denied, retried after as many seconds as the id of the request its key names, so a request's
/// `retry-after` says whose answer it got.
fn answer_naming_each_request(body: &[u8]) -> Vec<u8> {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    let one = |take: &serde_json::Value| {
        let key = take["buckets"][0]["key"].as_str().unwrap();
        let id: u64 = key.trim_start_matches("r|").parse().unwrap();
        format!(
            r#"{{"allowed":false,"buckets":[{{"allowed":false,"limit":5,"remaining":0,"reset_ms":1,"retry_after_ms":{}}}]}}"#,
            id * 1000
        )
    };
    match v["takes"].as_array() {
        Some(takes) => {
            let parts: Vec<String> = takes.iter().map(one).collect();
            format!(r#"{{"results":[{}]}}"#, parts.join(",")).into_bytes()
        }
        None => one(&v).into_bytes(),
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Envoy's tokens from just below 2^31 (where the ledger once marked its own ids), then
    /// across 2^32 back to 0, with requests calling and queueing, clients leaving and answers
    /// arriving in every order: every request gets its own answer or none (it left), and nothing
    /// is left behind in the ledger or the pending gauge.
    #[test]
    fn every_request_gets_its_own_answer_across_envoys_wrap(
        steps in proptest::collection::vec(step(), 1..120),
        below in 0u32..64,
    ) {
        let cfg = r#"{"service":{"cluster":"svc","transport":"http","batch":4,"remember_denials_ms":0},
            "rules":[{"name":"r","key":["header:x-id"],"capacity":5,"period_ms":60000}],
            "breaker":{"failures":10000,"open_ms":100},"failure_mode":"deny"}"#;
        let mut d = dispatcher(cfg);
        d.abi.tokens_from(0x8000_0000 - 4 * below);
        let mut next_id = 100u32;
        let mut waiting: Vec<u32> = Vec::new();
        let mut left: Vec<u32> = Vec::new();
        let mut answered = 0;
        let mut jumped = false;
        let answer = |d: &mut Dispatcher<Fake>, answered: &mut usize, i: usize| {
            // Answer the i-th of those not yet answered: swap it to the front of the rest.
            let sent = d.abi.dispatched.borrow().len();
            let k = *answered + i % (sent - *answered);
            d.abi.dispatched.borrow_mut().swap(*answered, k);
            let (token, body) = d.abi.dispatched.borrow()[*answered].clone();
            *answered += 1;
            let reply = answer_naming_each_request(&body);
            let n = reply.len();
            *d.abi.reply.borrow_mut() = (Some(b"200".to_vec()), reply);
            d.on_http_call_response(token, 1, n);
        };
        for s in steps {
            match s {
                Step::Start if waiting.len() < 16 => {
                    next_id += 1;
                    let id = next_id;
                    d.on_context_create(id, ROOT);
                    d.abi.known.borrow_mut().push(id);
                    *d.abi.request.borrow_mut() = vec![
                        (":path".into(), b"/".to_vec()),
                        ("x-id".into(), id.to_string().into_bytes()),
                    ];
                    d.abi.effective.set(id);
                    proptest::prop_assert_eq!(d.on_request_headers(id), PAUSE);
                    waiting.push(id);
                }
                Step::Start => {}
                Step::Answer(i) => {
                    if d.abi.dispatched.borrow().len() > answered {
                        answer(&mut d, &mut answered, usize::from(i));
                    }
                }
                Step::Leave(i) => {
                    if !waiting.is_empty() {
                        let id = waiting.swap_remove(usize::from(i) % waiting.len());
                        if !d.abi.replied.borrow().iter().any(|(c, _)| *c == id) {
                            left.push(id);
                        }
                        disconnect(&mut d, id);
                    }
                }
                // Envoy's counter only moves on: once, from below 2^31 to below 2^32.
                Step::Jump(n) if !jumped => {
                    d.abi.tokens_from(0u32.wrapping_sub(4 * u32::from(n % 16)));
                    jumped = true;
                }
                Step::Jump(_) => {}
            }
            // A request answered is deleted by Envoy after its reply.
            let replied: Vec<u32> = d.abi.replied.borrow().iter().map(|(c, _)| *c).collect();
            for id in replied {
                if let Some(i) = waiting.iter().position(|w| *w == id) {
                    waiting.swap_remove(i);
                    d.on_delete(id);
                }
            }
        }
        while d.abi.dispatched.borrow().len() > answered {
            answer(&mut d, &mut answered, 0);
            let replied: Vec<u32> = d.abi.replied.borrow().iter().map(|(c, _)| *c).collect();
            for id in replied {
                if let Some(i) = waiting.iter().position(|w| *w == id) {
                    waiting.swap_remove(i);
                    d.on_delete(id);
                }
            }
        }
        proptest::prop_assert!(waiting.is_empty(), "never answered: {:?}", waiting);
        let replied = d.abi.replied.borrow();
        let retry = d.abi.retry_after.borrow();
        for ((c, status), r) in replied.iter().zip(retry.iter()) {
            proptest::prop_assert_eq!(*status, 429);
            proptest::prop_assert_eq!(r.clone(), Some(c.to_string()), "request {} got another's answer", c);
            proptest::prop_assert!(!left.contains(c), "request {} answered after it left", c);
        }
        let mut seen: Vec<u32> = replied.iter().map(|(c, _)| *c).collect();
        seen.sort_unstable();
        seen.dedup();
        proptest::prop_assert_eq!(seen.len(), replied.len(), "a request answered twice");
        proptest::prop_assert!(d.abi.resumed.borrow().is_empty());
        proptest::prop_assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
        proptest::prop_assert_eq!(d.abi.metric("tollgate.callouts.pending"), 0);
        proptest::prop_assert_eq!(d.abi.metric("tollgate.callouts.collided"), 0);
    }
}

#[test]
fn bookkeeping_stays_bounded_by_live_requests() {
    let cfg = config("grpc", "");
    let mut d = dispatcher(&cfg);
    for round in 0..50u32 {
        let ids: Vec<u32> = (0..20).map(|i| 1_000 + round * 20 + i).collect();
        for id in &ids {
            assert_eq!(start(&mut d, *id, "/api"), PAUSE);
        }
        assert_eq!(d.pending_callouts(), 20);
        assert_eq!(d.abi.metric("tollgate.callouts.pending"), 20);
        for id in &ids {
            disconnect(&mut d, *id);
        }
        assert_eq!((d.pending_callouts(), d.live_requests()), (0, 0));
    }
    assert_eq!(d.abi.metric("tollgate.callouts.pending"), 0);
    // gRPC ids are ≡ 1 mod 4 and every one of them went out.
    let sent = d.abi.dispatched.borrow();
    assert_eq!(sent.len(), 1_000);
    assert!(sent.iter().all(|(t, _)| t % 4 == 1));
}

#[test]
fn a_refused_grpc_dispatch_is_a_counted_failure_not_a_panic() {
    for status in [abi::BAD_ARGUMENT, 4, 10, 6] {
        let cfg = config("grpc", r#","failure_mode":"allow""#);
        let mut d = dispatcher(&cfg);
        d.abi.refuse.set(Some(status));
        assert_eq!(start(&mut d, 7, "/api"), CONTINUE, "never paused");
        assert_eq!(d.abi.metric("tollgate.callout_failure.dispatch"), 1);
        assert_eq!(d.abi.metric(Decision::FailureOpenAllowed.metric()), 1);
        assert_eq!(d.pending_callouts(), 0);
        assert!(d.abi.resumed.borrow().is_empty());
        d.on_delete(7);
    }
    // With failure_mode deny the same refusal answers locally.
    let cfg = config("grpc", r#","failure_mode":"deny""#);
    let mut d = dispatcher(&cfg);
    d.abi.refuse.set(Some(abi::BAD_ARGUMENT));
    assert_eq!(start(&mut d, 7, "/api"), PAUSE);
    assert_eq!(d.abi.replied.borrow().len(), 1);
}

#[test]
fn grpc_target_is_sent_as_a_serialised_grpc_service() {
    let cfg = config("grpc", "").replace("\"svc\"", "\"abcdefghi\"");
    let mut d = dispatcher(&cfg);
    start(&mut d, 9, "/api");
    let sent = d.abi.dispatched.borrow()[0].1.clone();
    // GrpcService{ envoy_grpc(1){ cluster_name(1) } }
    let mut want = vec![0x0a, 11, 0x0a, 9];
    want.extend_from_slice(b"abcdefghi");
    assert_eq!(sent, want);
    let long = "c".repeat(200);
    let enc = grpc_service(&long);
    assert_eq!(&enc[..5], &[0x0a, 0xcb, 0x01, 0x0a, 0xc8]);
    assert_eq!(enc.len(), 5 + 1 + 200);
}

#[test]
fn grpc_replies_reach_their_request_and_failures_are_counted() {
    let cfg = config("grpc", r#","failure_mode":"deny""#);
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 3, "/api"), PAUSE);
    let token = last_token(&d);
    // A status for an unknown token (a dispatch Envoy failed inline still reports one): dropped.
    d.on_grpc_response(token + 4, 14, 0);
    assert!(d.abi.replied.borrow().is_empty());
    d.on_grpc_response(token, 14, 0);
    assert_eq!(*d.abi.replied.borrow(), vec![(3, 429)]);
    assert_eq!(d.abi.metric("tollgate.callout_failure.grpc_status"), 1);
    // A second report for the same token changes nothing.
    d.on_grpc_response(token, 0, 3);
    assert_eq!(d.abi.replied.borrow().len(), 1);
    assert!(d.abi.resumed.borrow().is_empty());
}

#[test]
fn a_request_no_rule_matches_reads_only_the_match_headers() {
    let cfg = config("http", "");
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 5, "/other"), CONTINUE);
    assert_eq!(d.abi.full_reads.get(), 0, "the header map is not read");
    assert_eq!(d.abi.header_reads.get(), 1, ":path only");
    assert_eq!(d.on_request_data(5), CONTINUE);
    assert!(d.abi.dispatched.borrow().is_empty());
    assert_eq!(start(&mut d, 6, "/api/v1"), PAUSE);
    assert_eq!(d.abi.full_reads.get(), 0, "the rule reads :path alone");
    assert_eq!(
        d.abi.header_reads.get(),
        3,
        ":path to match, :path for the request"
    );
    assert_eq!(d.on_request_data(6), PAUSE, "body waits for the decision");
}

#[test]
fn a_steady_exact_request_reads_shared_data_twice() {
    let cfg = config("http", "");
    let mut d = dispatcher(&cfg);
    // As the service answers: with the live instances it counts.
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"allowed":true,"instances":3,"buckets":[{"allowed":true,"limit":5,"remaining":4,"reset_ms":1000,"retry_after_ms":0}]}"#.to_vec(),
    );
    let mut reads = Vec::new();
    for id in [101, 102, 103] {
        let before = d.abi.shared_reads.get();
        assert_eq!(start(&mut d, id, "/api/x"), PAUSE);
        d.on_http_call_response(last_token(&d), 1, 1000);
        d.on_delete(id);
        reads.push(d.abi.shared_reads.get() - before);
    }
    // The breaker's entry at admission (which also holds the learned number of proxies), and the
    // bucket's fallback share with the answer: an answer reporting the number its admission read
    // reads nothing more. The first answer also learned the number (one read, one write).
    assert_eq!(reads, vec![3, 2, 2]);
}

#[test]
fn a_matching_request_reads_the_headers_its_rules_read_and_no_more() {
    let key = |k: &str, hops: u32| {
        format!(
            r#"{{"service":{{"cluster":"svc","transport":"http","batch":0}},"trusted_hops":{hops},
                 "rules":[{{"name":"r","key":[{k}],"capacity":5,"period_ms":60000}}]}}"#
        )
    };
    // (config, whole-map reads, by-name reads) for one request.
    for (cfg, full, by_name) in [
        (key(r#""header:x-user","method""#, 0), 0, 2),
        (key(r#""client_ip""#, 0), 0, 0),
        (key(r#""authority""#, 0), 0, 2),
        (key(r#""client_ip""#, 1), 1, 0),
    ] {
        let mut d = dispatcher(&cfg);
        *d.abi.request.borrow_mut() = vec![
            (":path".into(), b"/x".to_vec()),
            (":method".into(), b"GET".to_vec()),
            (":authority".into(), b"example.com".to_vec()),
            ("x-user".into(), b"u".to_vec()),
            ("x-forwarded-for".into(), b"10.0.0.9".to_vec()),
        ];
        d.on_context_create(7, ROOT);
        d.abi.known.borrow_mut().push(7);
        assert_eq!(d.on_request_headers(7), PAUSE, "{cfg}");
        assert_eq!(
            (d.abi.full_reads.get(), d.abi.header_reads.get()),
            (full, by_name),
            "{cfg}"
        );
        let sent = String::from_utf8(d.abi.dispatched.borrow()[0].1.clone()).unwrap();
        assert!(
            sent.contains("r|u|GET") || !cfg.contains("x-user"),
            "the key is built from what was read: {sent}"
        );
    }
}

#[test]
fn the_match_prefilter_agrees_with_the_core() {
    let configs = [
        r#"[{"name":"a","match":{"path_exact":"/login","methods":["POST"]},"key":["literal:x"],"capacity":1,"period_ms":1000},
            {"name":"b","match":{"headers":[{"name":"x-tenant","present":true},{"name":"x-plan","equals":"free"}]},"key":["header:x-tenant"],"capacity":1,"period_ms":1000}]"#,
        r#"[{"name":"a","match":{"path_prefix":"/api","headers":[{"name":"x-internal","present":false}]},"key":["path"],"capacity":1,"period_ms":1000}]"#,
    ];
    let requests: Vec<Vec<(&str, &[u8])>> = vec![
        vec![(":path", b"/login"), (":method", b"POST")],
        vec![(":path", b"/login?x=1"), (":method", b"GET")],
        vec![(":path", b"/x"), ("x-tenant", b"t"), ("x-plan", b"free")],
        vec![(":path", b"/x"), ("x-tenant", b"t"), ("x-plan", b"paid")],
        vec![(":path", b"/api/v1")],
        vec![(":path", b"/api/v1"), ("x-internal", b"1")],
        vec![
            (":path", b"/apix"),
            ("x-plan", b"free"),
            ("x-plan", b"paid"),
        ],
        vec![],
    ];
    for rules in configs {
        let json = format!(r#"{{"service":{{"cluster":"svc"}},"rules":{rules}}}"#);
        let cfg = Config::parse(json.as_bytes()).unwrap();
        let names = match_headers(&cfg).unwrap();
        for r in &requests {
            let full = Request {
                headers: r.iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect(),
                peer: Some("10.0.0.1:1".into()),
            };
            let fake = Fake::new("");
            *fake.request.borrow_mut() = full.headers.clone();
            let plugin = Plugin {
                root: ROOT,
                config: cfg.clone(),
                metrics: Metrics::define(&fake, &cfg).unwrap(),
                prefix: String::new(),
                bearer: None,
                grpc_service: Vec::new(),
                reads: Reads {
                    match_headers: Some(names.clone()),
                    request_headers: None,
                },
                queue: Default::default(),
                stream: Default::default(),
                held: Default::default(),
                settles: RefCell::new(settle::Queue::new("t")),
            };
            let core = crate::core::decide::decide(&cfg, &full).step;
            let pre = may_match(&fake, &plugin.config, &plugin.reads, &mut Vec::new());
            assert_eq!(
                pre,
                !matches!(core, crate::core::wire::plan::Step::Continue),
                "{r:?} under {rules}"
            );
        }
    }
    let every = r#"{"service":{"cluster":"svc"},"rules":[{"name":"a","key":["client_ip"],"capacity":1,"period_ms":1}]}"#;
    assert_eq!(
        match_headers(&Config::parse(every.as_bytes()).unwrap()),
        None
    );
}

#[test]
fn unknown_contexts_and_tokens_are_no_ops() {
    let cfg = config("http", "");
    let mut d = dispatcher(&cfg);
    assert_eq!(d.on_request_headers(42), CONTINUE);
    assert_eq!(d.on_request_data(42), CONTINUE);
    assert_eq!(d.on_response_headers(42, false), CONTINUE);
    assert_eq!(d.on_response_body(42, 10, true), CONTINUE);
    assert_eq!(d.on_response_trailers(42), CONTINUE);
    d.on_delete(42);
    d.on_http_call_response(8, 0, 0);
    d.on_grpc_response(9, 0, 10);
    // A request whose root was never configured passes untouched.
    d.on_context_create(50, 49);
    assert_eq!(d.on_request_headers(50), CONTINUE);
    // A root that is deleted while its requests live on: they keep their plugin.
    assert_eq!(start(&mut d, 51, "/api"), PAUSE);
    d.on_delete(ROOT);
    allowed_reply(&d);
    d.on_http_call_response(last_token(&d), 1, 1000);
    assert_eq!(*d.abi.resumed.borrow(), vec![51]);
    // Envoy no longer knows the request when its reply comes: nothing is resumed.
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 60, "/api"), PAUSE);
    d.abi.known.borrow_mut().clear();
    d.on_http_call_response(last_token(&d), 1, 1000);
    assert!(d.abi.resumed.borrow().is_empty());
    assert_eq!(d.pending_callouts(), 0);
}

#[test]
fn a_configuration_envoy_must_refuse_is_refused() {
    let mut d = Dispatcher::new(Fake::new(r#"{"service":{}}"#));
    d.on_context_create(ROOT, 0);
    assert!(!d.on_configure(ROOT, 14));
    let mut d = Dispatcher::new(Fake::new(""));
    d.on_context_create(ROOT, 0);
    assert!(!d.on_configure(ROOT, 0));
}

#[test]
fn queued_requests_leave_in_one_batch_and_each_gets_its_own_answer() {
    let cfg = config("http", "").replace(r#""batch":0"#, r#""batch":8"#);
    let mut d = dispatcher(&cfg);
    // A lone request calls at once.
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    assert_eq!(d.abi.dispatched.borrow().len(), 1);
    let first = last_token(&d);
    // Three more while it is in flight: queued, no callout; one goes away before its batch.
    for id in [11, 12, 13] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 1, "queued, not called");
    disconnect(&mut d, 12);
    // The first answer comes back: request 10 resumes and the queue leaves as one batch.
    allowed_reply(&d);
    d.on_http_call_response(first, 1, 200);
    assert_eq!(*d.abi.resumed.borrow(), vec![10]);
    assert_eq!(d.abi.dispatched.borrow().len(), 2);
    let (batch, body) = d.abi.dispatched.borrow().last().cloned().unwrap();
    let body = String::from_utf8(body).unwrap();
    assert!(body.starts_with(r#"{"takes":[{"buckets":"#), "{body}");
    assert_eq!(
        body.matches("\"key\"").count(),
        2,
        "the departed request is not sent: {body}"
    );
    assert_eq!(d.abi.metric("tollgate.batch.takes"), 2);
    // Its answer: one allowed, one denied, in order.
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"results":[
            {"allowed":true,"buckets":[{"allowed":true,"limit":5,"remaining":1,"reset_ms":1,"retry_after_ms":0}]},
            {"allowed":false,"buckets":[{"allowed":false,"limit":5,"remaining":0,"reset_ms":1,"retry_after_ms":9}]}]}"#
            .to_vec(),
    );
    d.on_http_call_response(batch, 1, 400);
    assert_eq!(
        *d.abi.resumed.borrow(),
        vec![10, 11],
        "{:?}",
        d.abi.replied.borrow()
    );
    assert_eq!(*d.abi.replied.borrow(), vec![(13, 429)]);
    assert_eq!(d.pending_callouts(), 0, "nothing left waiting");
    // The denial is remembered by the worker until it could be paid (9 ms): a request meanwhile
    // is answered without a callout, and one after it calls again.
    assert_eq!(start(&mut d, 14, "/api"), PAUSE);
    assert_eq!(d.abi.dispatched.borrow().len(), 2, "denied from memory");
    assert_eq!(d.abi.replied.borrow().len(), 2, "and answered 429");
    assert_eq!(d.abi.metric("tollgate.rule.r.limited_locally"), 1);
    d.abi.clock.set(d.abi.clock.get() + 9);
    // A failed batch fails each of its requests (here: the fallback decides).
    assert_eq!(start(&mut d, 20, "/api"), PAUSE);
    let lone = last_token(&d);
    for id in [21, 22] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    allowed_reply(&d);
    d.on_http_call_response(lone, 1, 200);
    let batch = last_token(&d);
    *d.abi.reply.borrow_mut() = (None, Vec::new());
    d.on_http_call_response(batch, 0, 0);
    assert_eq!(d.abi.metric("tollgate.callout_failure.reset"), 2);
    assert_eq!(d.pending_callouts(), 0);
}

/// `service.timeout_ms` bounds a request's wait from its take: in the batch queue and in its
/// batch together. A batch's timeout is what is left of its oldest request's; a request that
/// waited it all in the queue fails as a timeout without a callout.
#[test]
fn a_queued_request_waits_no_longer_than_its_timeout_in_all() {
    let cfg = config("http", "").replace(r#""batch":0"#, r#""batch":8,"timeout_ms":20"#);
    let cfg = cfg.replace(
        r#""breaker":{"failures":10000,"open_ms":100}"#,
        r#""breaker":{"failures":10000,"open_ms":100},"failure_mode":"deny""#,
    );
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let first = last_token(&d);
    d.abi.clock.set(5);
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    // 10 ms later the first answer: 11 leaves with the 10 ms it has left.
    d.abi.clock.set(15);
    allowed_reply(&d);
    d.on_http_call_response(first, 1, 200);
    assert_eq!(*d.abi.timeouts.borrow(), vec![20, 10]);
    let batch = last_token(&d);
    assert_eq!(start(&mut d, 12, "/api"), PAUSE);
    // The batch times out at Envoy (a 504); 12 has waited its 20 ms by then.
    d.abi.clock.set(40);
    *d.abi.reply.borrow_mut() = (Some(b"504".to_vec()), Vec::new());
    d.on_http_call_response(batch, 1, 0);
    assert_eq!(d.abi.dispatched.borrow().len(), 2, "no callout for 12");
    assert_eq!(*d.abi.replied.borrow(), vec![(11, 429), (12, 429)]);
    assert_eq!(
        d.abi.metric("tollgate.callout_failure.timeout"),
        1,
        "12 was never sent: no callout of its failed"
    );
    // What the failure mode decided, by cause.
    assert_eq!(d.abi.metric("tollgate.failure_mode.timeout"), 1);
    assert_eq!(d.abi.metric("tollgate.failure_mode.queued"), 1);
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
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

/// A slow callout holds the queue back for a tick at most: then the queue leaves beside it, so a
/// take pays its own round trip once; up to 8 callouts in flight, after which the queue waits.
#[test]
fn a_queue_behind_a_slow_callout_leaves_after_a_tick_up_to_eight_in_flight() {
    let mut d = dispatcher(&slow_batch_config(""));
    assert_eq!(
        d.abi.tick_ms.get(),
        5,
        "a batching configuration has a tick"
    );
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let slow = last_token(&d);
    d.abi.clock.set(1);
    for id in [11, 12] {
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
    }
    d.abi.clock.set(5);
    d.on_tick(ROOT);
    assert_eq!(d.abi.dispatched.borrow().len(), 1, "waited 4 ms: not yet");
    d.abi.clock.set(6);
    d.on_tick(ROOT);
    assert_eq!(d.abi.dispatched.borrow().len(), 2, "a tick: a second batch");
    let second = last_token(&d);
    assert_eq!(
        *d.abi.timeouts.borrow(),
        vec![20, 15],
        "due 20 ms after the first take queued"
    );
    // The second batch is answered first: its requests do not wait for the slow one.
    batch_reply(&d, &[(true, 5), (true, 5)]);
    d.on_http_call_response(second, 1, 1000);
    assert_eq!(*d.abi.resumed.borrow(), vec![11, 12]);
    allowed_reply(&d);
    d.on_http_call_response(slow, 1, 200);
    assert_eq!(*d.abi.resumed.borrow(), vec![11, 12, 10]);
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
    // Eight callouts out: the queue waits for one of them to end.
    let mut id = 20;
    assert_eq!(start(&mut d, id, "/api"), PAUSE);
    for _ in 1..8 {
        id += 1;
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
        d.abi.clock.set(d.abi.clock.get() + 5);
        d.on_tick(ROOT);
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 2 + 8);
    id += 1;
    assert_eq!(start(&mut d, id, "/api"), PAUSE);
    d.abi.clock.set(d.abi.clock.get() + 5);
    d.on_tick(ROOT);
    assert_eq!(
        d.abi.dispatched.borrow().len(),
        10,
        "eight in flight: it waits"
    );
    let oldest = d.abi.dispatched.borrow()[2].0;
    allowed_reply(&d);
    d.on_http_call_response(oldest, 1, 200);
    assert_eq!(
        d.abi.dispatched.borrow().len(),
        11,
        "one ended: the queue left"
    );
}

/// A take never waits in the queue past its deadline, even with every callout slot held: the
/// tick fails it there, unsent.
#[test]
fn a_queued_take_never_outlives_its_deadline() {
    let mut d = dispatcher(&slow_batch_config(""));
    let mut id = 20;
    assert_eq!(start(&mut d, id, "/api"), PAUSE);
    for _ in 1..8 {
        id += 1;
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
        d.abi.clock.set(d.abi.clock.get() + 5);
        d.on_tick(ROOT);
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 8);
    // Two more queue at 35 ms (Envoy has not timed the eight out: the fake never does).
    for extra in [100, 101] {
        assert_eq!(start(&mut d, extra, "/api"), PAUSE);
    }
    let queued_at = d.abi.clock.get();
    d.abi.clock.set(queued_at + 19);
    d.on_tick(ROOT);
    assert!(d.abi.replied.borrow().iter().all(|(c, _)| *c < 100));
    d.abi.clock.set(queued_at + 20);
    d.on_tick(ROOT);
    let replied: Vec<(u32, u32)> = d
        .abi
        .replied
        .borrow()
        .iter()
        .filter(|(c, _)| *c >= 100)
        .copied()
        .collect();
    assert_eq!(
        replied,
        vec![(100, 429), (101, 429)],
        "failed at their deadline, unsent"
    );
    assert_eq!(d.abi.dispatched.borrow().len(), 8);
}

/// The breaker opens on the service failing, not on takes that queued too long, nor once per take
/// of one failed batch.
#[test]
fn takes_that_expire_in_the_queue_and_shares_of_one_failed_batch_do_not_open_the_breaker() {
    let cfg = slow_batch_config("").replace(r#""failures":10000"#, r#""failures":2"#);
    let mut d = dispatcher(&cfg);
    // Eight slow callouts, and two takes queued behind them that wait their whole timeout.
    let mut id = 20;
    assert_eq!(start(&mut d, id, "/api"), PAUSE);
    for _ in 1..8 {
        id += 1;
        assert_eq!(start(&mut d, id, "/api"), PAUSE);
        d.abi.clock.set(d.abi.clock.get() + 5);
        d.on_tick(ROOT);
    }
    for extra in [100, 101] {
        assert_eq!(start(&mut d, extra, "/api"), PAUSE);
    }
    d.abi.clock.set(d.abi.clock.get() + 20);
    d.on_tick(ROOT);
    assert_eq!(d.abi.replied.borrow().len(), 2);
    assert_eq!(
        d.abi.metric("tollgate.breaker.opened"),
        0,
        "queued too long: no news of the service"
    );
    // Three more queue; the first callout answers, and they leave as one batch, which fails (a
    // reset): one failed callout, not three.
    for extra in [102, 103, 104] {
        assert_eq!(start(&mut d, extra, "/api"), PAUSE);
    }
    allowed_reply(&d);
    let first = d.abi.dispatched.borrow()[0].0;
    d.on_http_call_response(first, 1, 1000);
    let batch = last_token(&d);
    assert_eq!(d.abi.dispatched.borrow().len(), 9);
    *d.abi.reply.borrow_mut() = (None, Vec::new());
    d.on_http_call_response(batch, 0, 0);
    assert_eq!(
        d.abi.metric("tollgate.callout_failure.reset"),
        3,
        "each take counted"
    );
    assert_eq!(d.abi.metric("tollgate.breaker.opened"), 0);
    // A second failed callout in a row opens it.
    let second = d.abi.dispatched.borrow()[1].0;
    d.on_http_call_response(second, 0, 0);
    assert_eq!(d.abi.metric("tollgate.breaker.opened"), 1);
    // What the failure mode decided, by cause: two queued too long, four reset, one refused by
    // the open breaker.
    assert_eq!(start(&mut d, 200, "/api"), PAUSE);
    for (cause, n) in [("queued", 2), ("reset", 4), ("breaker", 1), ("timeout", 0)] {
        assert_eq!(
            d.abi.metric(&format!("tollgate.failure_mode.{cause}")),
            n,
            "{cause}"
        );
    }
}

/// Successes reset the consecutive failures even when their admission saw none, if they were
/// slow (a tick or more): failures counted while they were out do not stand against a service
/// that answers. Quick successes after a clean admission still write nothing.
#[test]
fn slow_successes_reset_the_failures_counted_while_they_were_out() {
    let cfg = config("http", "").replace(r#""failures":10000"#, r#""failures":3"#);
    let cfg = cfg.replace(r#""batch":0"#, r#""batch":0,"timeout_ms":40"#);
    let mut d = dispatcher(&cfg);
    // Six requests out at once, all admitted with the breaker clean.
    let ids: Vec<u32> = (10..16).collect();
    let mut tokens = Vec::new();
    for id in &ids {
        assert_eq!(start(&mut d, *id, "/api"), PAUSE);
        tokens.push(last_token(&d));
    }
    // Failures and slow successes interleave: two failures, a success, two failures, a
    // success... never three failures in a row.
    d.abi.clock.set(10);
    for (i, t) in tokens.iter().enumerate() {
        if i % 3 == 2 {
            allowed_reply(&d);
            d.on_http_call_response(*t, 1, 1000);
        } else {
            *d.abi.reply.borrow_mut() = (Some(b"503".to_vec()), Vec::new());
            d.on_http_call_response(*t, 1, 0);
        }
    }
    assert_eq!(d.abi.metric("tollgate.callout_failure.status"), 4);
    assert_eq!(
        d.abi.metric("tollgate.breaker.opened"),
        0,
        "successes reset the count"
    );
}

#[test]
fn a_background_lease_refill_is_answered_without_any_request() {
    let cfg = r#"{"service":{"cluster":"svc","transport":"http","batch":0},
        "rules":[{"name":"r","key":["literal:k"],"capacity":100,"period_ms":60000,"lease":{"size":4}}]}"#;
    let mut d = dispatcher(cfg);
    assert_eq!(
        d.abi.tick_ms.get(),
        500,
        "a timer for the pools: max_age_ms / 2"
    );
    let granted = |d: &Dispatcher<Fake>, n: u64| {
        *d.abi.reply.borrow_mut() = (
            Some(b"200".to_vec()),
            format!(r#"{{"allowed":true,"buckets":[{{"allowed":true,"limit":100,"remaining":50,"reset_ms":1000,"retry_after_ms":0,"granted":{n}}}]}}"#).into_bytes(),
        );
    };
    assert_eq!(start(&mut d, 2, "/"), PAUSE);
    granted(&d, 4);
    d.on_http_call_response(last_token(&d), 1, 200);
    assert_eq!(d.abi.resumed.borrow().len(), 1);
    // 3 pooled: the third local take leaves 0, below 4 / 4, and sends the refill itself.
    for id in 3..6 {
        assert_eq!(start(&mut d, id, "/"), CONTINUE, "request {id}");
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 2, "one background refill");
    assert_eq!(d.pending_callouts(), 0, "no request waits for it");
    granted(&d, 4);
    d.on_http_call_response(last_token(&d), 1, 200);
    assert_eq!(d.abi.metric("tollgate.lease.granted"), 8);
    assert_eq!(d.abi.metric("tollgate.lease.refills"), 1);
    for id in 6..9 {
        assert_eq!(start(&mut d, id, "/"), CONTINUE, "request {id}");
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 2, "spent from the refill");
    // Nothing expired yet: the timer sends nothing.
    d.on_tick(ROOT);
    assert_eq!(d.abi.dispatched.borrow().len(), 2);
}

#[test]
fn a_push_hands_the_watched_pools_to_the_new_configuration() {
    let cfg = r#"{"service":{"cluster":"svc","transport":"http","batch":0},
        "rules":[{"name":"r","key":["literal:k"],"capacity":100,"period_ms":60000,"lease":{"size":4}}]}"#;
    let mut d = dispatcher(cfg);
    let held = |d: &Dispatcher<Fake>, root: u32| match d.roots.get(&root) {
        Some(Some(p)) => p.held.borrow().len(),
        _ => usize::MAX,
    };
    assert_eq!(start(&mut d, 2, "/"), PAUSE);
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"allowed":true,"buckets":[{"allowed":true,"limit":100,"remaining":50,"reset_ms":1000,"retry_after_ms":0,"granted":4}]}"#.to_vec(),
    );
    d.on_http_call_response(last_token(&d), 1, 200);
    assert_eq!(held(&d, ROOT), 1, "the pool it filled is watched");
    // The push: a new root context is configured, then the old one deleted.
    d.on_context_create(7, 0);
    d.abi.known.borrow_mut().push(7);
    assert!(d.on_configure(7, cfg.len()));
    assert_eq!(held(&d, 7), 0);
    d.on_delete(ROOT);
    assert_eq!(held(&d, 7), 1, "still watched, by the new configuration");
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

#[test]
fn a_response_priced_request_settles_what_its_response_reported_once() {
    let cfg = charged_config();
    let mut d = dispatcher(&cfg);
    assert_eq!(
        d.abi.tick_ms.get(),
        100,
        "the timer that retries settlements"
    );
    // JSON body: 30 used of the 100 reserved.
    let json =
        br#"{"id":"x","usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30}}"#;
    let body = settle_after(
        &mut d,
        10,
        &[("content-type", "application/json")],
        json,
        true,
    )
    .expect("a settle was sent");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["buckets"][0]["estimate"], 100);
    assert_eq!(v["buckets"][0]["used"], 30);
    assert_eq!(v["buckets"][0]["key"], "llm|k");
    assert_eq!(v["buckets"][0]["rule"], "llm");
    let first_id = v["id"].as_str().unwrap().to_string();
    // The service answers 503: sent again from the timer after 100 ms, with the same id.
    *d.abi.reply.borrow_mut() = (Some(b"503".to_vec()), Vec::new());
    d.on_http_call_response(last_token(&d), 1, 0);
    assert_eq!(d.abi.metric("tollgate.settle.retried"), 1);
    let n = d.abi.dispatched.borrow().len();
    d.on_tick(ROOT);
    assert_eq!(d.abi.dispatched.borrow().len(), n, "not before its backoff");
    d.abi.clock.set(100);
    d.on_tick(ROOT);
    let again = d
        .abi
        .dispatched
        .borrow()
        .last()
        .map(|(_, b)| b.clone())
        .unwrap();
    let again: serde_json::Value = serde_json::from_slice(&again).unwrap();
    assert_eq!(again, v, "the same settlement, same id");
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"duplicate":false,"buckets":[{"remaining":9970}]}"#.to_vec(),
    );
    d.on_http_call_response(last_token(&d), 1, 0);
    assert_eq!(d.abi.metric("tollgate.settle.delivered"), 1);
    d.abi.clock.set(10_000);
    let n = d.abi.dispatched.borrow().len();
    d.on_tick(ROOT);
    assert_eq!(
        d.abi.dispatched.borrow().len(),
        n,
        "delivered: never sent again"
    );
    // A header wins over the body, and a bigger usage is an extra charge.
    let body = settle_after(
        &mut d,
        11,
        &[("content-type", "application/json"), ("x-usage", "250")],
        json,
        true,
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["buckets"][0]["used"], 250);
    assert_ne!(v["id"].as_str().unwrap(), first_id);
    // A streamed response: the final event's usage.
    let sse = b"data: {\"choices\":[],\"usage\":null}\n\ndata: {\"usage\":{\"total_tokens\":64}}\n\ndata: [DONE]\n\n";
    let body = settle_after(
        &mut d,
        12,
        &[("content-type", "text/event-stream")],
        sse,
        true,
    )
    .unwrap();
    assert!(body.contains("\"used\":64"), "{body}");
    // No usage reported: the estimate stands, nothing is sent.
    assert_eq!(
        settle_after(
            &mut d,
            13,
            &[("content-type", "application/json")],
            b"{}",
            true
        ),
        None
    );
    // A stream cut before its report: charged the most it could have reserved (`cost.max`).
    let cut = settle_after(
        &mut d,
        14,
        &[("content-type", "text/event-stream")],
        b"data: {\"choices\":[]}\n\n",
        false,
    )
    .unwrap();
    assert!(cut.contains("\"estimate\":100,\"used\":4000"), "{cut}");
    // A refusal (400) is not retried.
    let _ = settle_after(&mut d, 15, &[("x-usage", "7")], b"", true).unwrap();
    *d.abi.reply.borrow_mut() = (Some(b"400".to_vec()), Vec::new());
    d.on_http_call_response(last_token(&d), 1, 0);
    assert_eq!(d.abi.metric("tollgate.settle.given_up"), 1);
    d.abi.clock.set(60_000);
    let n = d.abi.dispatched.borrow().len();
    d.on_tick(ROOT);
    assert_eq!(d.abi.dispatched.borrow().len(), n);
}

#[test]
fn a_denied_request_reserves_nothing_and_settles_nothing() {
    let cfg = charged_config();
    let mut d = dispatcher(&cfg);
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"allowed":false,"buckets":[{"allowed":false,"limit":10000,"remaining":0,"reset_ms":1000,"retry_after_ms":500}]}"#.to_vec(),
    );
    assert_eq!(start(&mut d, 20, "/v1/chat"), PAUSE);
    d.on_http_call_response(last_token(&d), 1, 1000);
    assert_eq!(d.abi.replied.borrow().last(), Some(&(20, 429)));
    let n = d.abi.dispatched.borrow().len();
    d.on_delete(20);
    assert_eq!(d.abi.dispatched.borrow().len(), n);
    assert_eq!(d.abi.metric("tollgate.settle.sent"), 0);
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

#[test]
fn two_configurations_of_one_vm_never_answer_each_others_requests() {
    // Listener A's rule admits everything, listener B's almost nothing; both batch, one VM.
    let a = config("http", "").replace(r#""batch":0"#, r#""batch":8"#);
    let b = a.replace(r#""capacity":5"#, r#""capacity":1"#);
    let mut d = dispatcher(&a);
    const B: u32 = 3;
    configure(&mut d, B, &b);
    // Each configuration: one request calls, two queue behind it.
    assert_eq!(start_on(&mut d, ROOT, 10, "/api"), PAUSE);
    let a_first = last_token(&d);
    for id in [11, 12] {
        assert_eq!(start_on(&mut d, ROOT, id, "/api"), PAUSE);
    }
    assert_eq!(start_on(&mut d, B, 20, "/api"), PAUSE);
    let b_first = last_token(&d);
    for id in [21, 22] {
        assert_eq!(start_on(&mut d, B, id, "/api"), PAUSE);
    }
    assert_eq!(
        d.pending_callouts(),
        6,
        "six requests wait, none displaced another"
    );
    // A's callouts are answered "allowed": only A's requests resume.
    allowed_reply(&d);
    d.on_http_call_response(a_first, 1, 200);
    let a_batch = last_token(&d);
    batch_reply(&d, &[(true, 1_000_000), (true, 1_000_000)]);
    d.on_http_call_response(a_batch, 1, 400);
    assert_eq!(*d.abi.resumed.borrow(), vec![10, 11, 12]);
    // B's are answered "denied": B's requests get 429, and only they.
    batch_reply(&d, &[(false, 1)]);
    let denied = d.abi.reply.borrow().1.clone();
    let one = br#"{"allowed":false,"buckets":[{"allowed":false,"limit":1,"remaining":0,"reset_ms":1,"retry_after_ms":1000}]}"#;
    *d.abi.reply.borrow_mut() = (Some(b"200".to_vec()), one.to_vec());
    d.on_http_call_response(b_first, 1, 200);
    let b_batch = last_token(&d);
    assert_ne!(b_batch, a_batch);
    *d.abi.reply.borrow_mut() = (Some(b"200".to_vec()), denied);
    batch_reply(&d, &[(false, 1), (false, 1)]);
    d.on_http_call_response(b_batch, 1, 400);
    assert_eq!(
        *d.abi.replied.borrow(),
        vec![(20, 429), (21, 429), (22, 429)]
    );
    assert_eq!(
        d.abi.resumed.borrow().len(),
        3,
        "no B request was let through"
    );
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
}

#[test]
fn an_abandoned_take_holds_the_batch_queue_until_its_answer_and_then_leaves_nothing() {
    let cfg = config("http", "").replace(r#""batch":0"#, r#""batch":8"#);
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let first = last_token(&d);
    disconnect(&mut d, 10);
    assert_eq!(d.pending_callouts(), 0, "no request waits");
    assert_eq!(
        d.ledger_entries(),
        1,
        "but the callout is still Envoy's, in flight"
    );
    // The next request queues behind it (the service is still busy with it).
    assert_eq!(start(&mut d, 11, "/api"), PAUSE);
    assert_eq!(d.abi.dispatched.borrow().len(), 1);
    allowed_reply(&d);
    d.on_http_call_response(first, 1, 200);
    assert!(
        d.abi.resumed.borrow().is_empty(),
        "the abandoned answer is dropped"
    );
    let batch = last_token(&d);
    batch_reply(&d, &[(true, 5)]);
    d.on_http_call_response(batch, 1, 200);
    assert_eq!(*d.abi.resumed.borrow(), vec![11]);
    d.on_delete(11);
    assert_eq!((d.pending_callouts(), d.ledger_entries()), (0, 0));
}

#[test]
fn a_removed_configuration_fails_its_waiting_requests_and_hands_its_settlements_over() {
    let cfg = charged_config();
    let mut d = dispatcher(&cfg);
    // A settlement in flight when the push removes the configuration.
    let body = settle_after(&mut d, 10, &[("x-usage", "30")], b"", true).unwrap();
    let sent: serde_json::Value = serde_json::from_str(&body).unwrap();
    // A request of the old configuration waiting for its take.
    assert_eq!(start(&mut d, 11, "/v1/chat"), PAUSE);
    configure(&mut d, 7, &cfg);
    d.on_delete(ROOT);
    // Envoy cancelled the old root's callouts: the request takes the failure path at once (the
    // fallback: its share of the 4 tokens the last answer left cannot pay the estimate of 100),
    // and nothing of the old root is left in the ledger.
    assert_eq!(*d.abi.replied.borrow(), vec![(11, 429)]);
    assert_eq!(d.abi.metric("tollgate.callout_failure.reset"), 1);
    assert_eq!(d.ledger_entries(), 0);
    // The new configuration delivers the settlement, under the same id.
    let n = d.abi.dispatched.borrow().len();
    d.on_tick(7);
    let again = d
        .abi
        .dispatched
        .borrow()
        .get(n)
        .map(|(_, b)| b.clone())
        .unwrap();
    let again: serde_json::Value = serde_json::from_slice(&again).unwrap();
    assert_eq!(again, sent);
    *d.abi.reply.borrow_mut() = (
        Some(b"200".to_vec()),
        br#"{"duplicate":false,"buckets":[{"remaining":9970}]}"#.to_vec(),
    );
    d.on_http_call_response(last_token(&d), 1, 0);
    assert_eq!(d.abi.metric("tollgate.settle.delivered"), 1);
    assert_eq!(d.ledger_entries(), 0);
}

#[test]
fn a_queue_the_byte_bounds_split_leaves_in_several_batches_at_once() {
    // 12 rules on every request: 63 queued takes would be answered with ~130 KB in one batch.
    let rules: Vec<String> = (0..12)
        .map(|i| {
            format!(
                r#"{{"name":"r{i}","key":["literal:{i}"],"capacity":1000000,"period_ms":1000}}"#
            )
        })
        .collect();
    let cfg = format!(
        r#"{{"service":{{"cluster":"svc","transport":"http","batch":64}},"rules":[{}]}}"#,
        rules.join(",")
    );
    let mut d = dispatcher(&cfg);
    assert_eq!(start(&mut d, 10, "/"), PAUSE);
    let first = last_token(&d);
    for id in 11..74 {
        assert_eq!(start(&mut d, id, "/"), PAUSE, "request {id} queued");
    }
    assert_eq!(d.abi.dispatched.borrow().len(), 1);
    *d.abi.reply.borrow_mut() = (Some(b"503".to_vec()), Vec::new());
    d.on_http_call_response(first, 1, 0);
    let sent = d.abi.dispatched.borrow();
    let batches: Vec<usize> = sent[1..]
        .iter()
        .map(|(_, b)| String::from_utf8_lossy(b).matches("\"buckets\"").count())
        .collect();
    assert!(batches.len() >= 2, "{batches:?}");
    assert_eq!(
        batches.iter().sum::<usize>(),
        63,
        "every queued take left: {batches:?}"
    );
    for n in &batches {
        assert!(contract::bounds::batch_answer_bytes(*n, n * 12) <= MAX_ANSWER_BYTES);
    }
    assert_eq!(d.abi.metric("tollgate.callout_failure.dispatch"), 0);
}

#[test]
fn every_callout_of_every_configuration_carries_this_envoys_one_id() {
    let id_of = |body: &[u8]| -> String {
        let v: serde_json::Value = serde_json::from_slice(body).unwrap();
        v["instance"].as_str().unwrap_or_default().to_string()
    };
    // A take of the first configuration.
    let mut d = dispatcher(&config("http", ""));
    allowed_reply(&d);
    assert_eq!(start(&mut d, 10, "/api"), PAUSE);
    let first = id_of(&d.abi.dispatched.borrow()[0].1);
    assert!(
        first.len() == 16 && first.bytes().all(|b| b.is_ascii_hexdigit()),
        "{first:?}"
    );
    d.on_http_call_response(last_token(&d), 1, 200);
    // A second configuration of the same VM (a second listener, or a push), whose request settles.
    configure(&mut d, 2, &charged_config());
    allowed_reply(&d);
    d.on_context_create(20, 2);
    d.abi.known.borrow_mut().push(20);
    d.abi.set_request("/v1/chat");
    assert_eq!(d.on_request_headers(20), PAUSE);
    let take = d.abi.dispatched.borrow().last().unwrap().1.clone();
    assert_eq!(id_of(&take), first, "the second configuration's take");
    d.on_http_call_response(last_token(&d), 1, 200);
    *d.abi.response.borrow_mut() = vec![("x-usage".into(), b"30".to_vec())];
    assert_eq!(d.on_response_headers(20, true), CONTINUE);
    d.on_delete(20);
    let settle = d.abi.dispatched.borrow().last().unwrap().1.clone();
    assert!(
        String::from_utf8_lossy(&settle).contains("\"used\":30"),
        "a settle was sent"
    );
    assert_eq!(id_of(&settle), first, "its settle");
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
    d.on_request_headers(id)
}

/// `service.trace`: a sampled request's `traceparent` goes on its callout (header or metadata), and
/// the callout leaves at once even while a batch is forming; an unsampled or malformed one is not
/// forwarded and the request batches as before.
#[test]
fn a_sampled_traceparent_rides_its_own_callout() {
    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    for transport in ["http", "grpc"] {
        let cfg = config(transport, "").replace(r#""batch":0"#, r#""batch":8,"trace":true"#);
        let mut d = dispatcher(&cfg);
        let traced = |d: &Dispatcher<Fake>, i: usize| {
            d.abi.sent_headers.borrow()[i]
                .iter()
                .find(|(k, _)| k == "traceparent")
                .map(|(_, v)| v.clone())
        };
        // A request without one calls at once (nothing in flight) and carries none.
        assert_eq!(start(&mut d, 10, "/api"), PAUSE);
        assert_eq!(traced(&d, 0), None);
        // While that callout is in flight a plain request queues, a traced one calls alone.
        assert_eq!(start(&mut d, 11, "/api"), PAUSE);
        assert_eq!(d.abi.dispatched.borrow().len(), 1, "queued");
        assert_eq!(start_traced(&mut d, 12, TP), PAUSE);
        assert_eq!(
            d.abi.dispatched.borrow().len(),
            2,
            "{transport}: traced, alone"
        );
        assert_eq!(traced(&d, 1).as_deref(), Some(TP), "{transport}");
        // Unsampled, or not a traceparent: not forwarded, queued with the others.
        for tp in [
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "garbage",
        ] {
            assert_eq!(start_traced(&mut d, 13, tp), PAUSE);
            assert_eq!(
                d.abi.dispatched.borrow().len(),
                2,
                "{transport} {tp}: queued"
            );
            disconnect(&mut d, 13);
        }
    }
    // Off (the default): the header is not even read.
    let mut d = dispatcher(&config("http", ""));
    start_traced(&mut d, 12, TP);
    assert!(d.abi.sent_headers.borrow()[0]
        .iter()
        .all(|(k, _)| k != "traceparent"));
}

mod stream;
