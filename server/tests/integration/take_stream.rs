//! Batches on one gRPC stream (`tollgate.v1.RateLimiter/TakeStream`): answers in order and equal
//! to `TakeBatch`'s, exactness across streams, the stream's endings (a bad message, the token, an
//! oversized message, a store outage, a shed message, the service's shutdown, the client's
//! half-close), and a stream keeping its connection from idling out; over the memory store and
//! real Redis.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::gated::Gated;
use common::{pb_bucket, unique, RedisProc, Service};
use prost::bytes::BufMut;
use prost::Message;
use tokio::sync::mpsc;
use tollgate_server::api::grpc::pb;
use tollgate_server::domain::{MAX_BATCH_BYTES, MAX_KEY_BYTES};
use tollgate_server::store::memory::MemoryStore;
use tollgate_server::store::Store;
use tollgate_server::ServiceConfig;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::{Code, Status};

const HOUR: u64 = 3_600_000;
const TOKEN: &str = "s3cret";
const PATH: &str = "/tollgate.v1.RateLimiter/TakeStream";

/// Messages sent as the bytes given (a malformed one too); answers decoded by prost.
#[derive(Clone, Copy, Default)]
struct Raw;

impl Encoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = pb::TakeBatchResponse;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        pb::TakeBatchResponse::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = pb::TakeBatchResponse;
    type Encoder = Raw;
    type Decoder = Raw;

    fn encoder(&mut self) -> Raw {
        Raw
    }

    fn decoder(&mut self) -> Raw {
        Raw
    }
}

/// One open stream, on a connection of its own.
struct Stream {
    /// Dropped: the client half-closes.
    tx: Option<mpsc::UnboundedSender<Vec<u8>>>,
    answers: tonic::Streaming<pb::TakeBatchResponse>,
}

/// Opens a stream to `svc` with `token` in its metadata; the error if the service refused it.
async fn open(svc: &Service, token: Option<&str>) -> Result<Stream, Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", svc.addr))
        .unwrap()
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let (tx, rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let outgoing =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let mut req = tonic::Request::new(outgoing);
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let answers = grpc
        .streaming(req, PathAndQuery::from_static(PATH), Raw)
        .await?
        .into_inner();
    Ok(Stream {
        tx: Some(tx),
        answers,
    })
}

impl Stream {
    fn send_bytes(&self, bytes: Vec<u8>) {
        self.tx
            .as_ref()
            .expect("not half-closed")
            .send(bytes)
            .expect("the stream is open");
    }

    fn send(&self, m: &pb::TakeBatchRequest) {
        self.send_bytes(m.encode_to_vec());
    }

    /// The next answer (`None`: the stream ended with OK), or the status the stream ended with.
    async fn next(&mut self) -> Result<Option<pb::TakeBatchResponse>, Status> {
        tokio::time::timeout(Duration::from_secs(10), self.answers.message())
            .await
            .expect("an answer or the stream's end within 10 s")
    }

    /// Sends `m` and returns its answer.
    async fn ask(&mut self, m: &pb::TakeBatchRequest) -> pb::TakeBatchResponse {
        self.send(m);
        self.answer().await
    }

    async fn answer(&mut self) -> pb::TakeBatchResponse {
        match self.next().await {
            Ok(Some(a)) => a,
            other => panic!("no answer: {other:?}"),
        }
    }

    /// The status the stream ends with, which must be an error.
    async fn ending(&mut self) -> Status {
        match self.next().await {
            Err(s) => s,
            other => panic!("the stream did not end in error: {other:?}"),
        }
    }

    fn half_close(&mut self) {
        self.tx = None;
    }
}

/// A batch of `n` takes of one bucket `key` of `capacity`, one token each, no refill to speak of.
fn batch_of(key: &str, capacity: u64, n: usize) -> pb::TakeBatchRequest {
    let take = pb::TakeRequest {
        buckets: vec![pb::Bucket {
            capacity,
            rate: Some(1),
            period_ms: HOUR,
            ..pb_bucket(key)
        }],
        ..Default::default()
    };
    pb::TakeBatchRequest {
        takes: vec![take; n],
        ..Default::default()
    }
}

fn allowed(r: &pb::TakeBatchResponse) -> Vec<bool> {
    r.results.iter().map(|t| t.allowed).collect()
}

/// An answer without what moves with the clock (each bucket's `reset_ms` and `retry_after_ms`).
fn settled(r: &pb::TakeBatchResponse) -> pb::TakeBatchResponse {
    let mut r = r.clone();
    for b in r.results.iter_mut().flat_map(|t| t.buckets.iter_mut()) {
        b.reset_ms = 0;
        b.retry_after_ms = 0;
    }
    r
}

fn with_token<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    r
}

async fn metrics(svc: &Service) -> String {
    common::get_text(svc.url("/metrics")).await
}

/// Waits for `/metrics` to hold `needle` (a stream is counted closed once its body is dropped).
async fn metrics_reach(svc: &Service, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = metrics(svc).await;
        if m.contains(needle) {
            return;
        }
        assert!(Instant::now() < deadline, "no {needle} in\n{m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Answers

/// Three messages of two takes sent at once on a bucket of 3: answered in order, allowed,
/// allowed / allowed, denied / denied, denied, each as TakeBatch answers the same messages on a
/// bucket of its own; counted as TakeBatch calls, and the stream as open while it is.
async fn answers_in_order_as_take_batch(store: Arc<dyn Store>) {
    let svc = Service::start(store, Some(TOKEN)).await;
    let (on_stream, on_calls) = (unique("stream"), unique("calls"));
    let mut s = open(&svc, Some(TOKEN)).await.unwrap();
    for _ in 0..3 {
        s.send(&batch_of(&on_stream, 3, 2));
    }
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(s.answer().await);
    }
    let got: Vec<Vec<bool>> = answers.iter().map(allowed).collect();
    assert_eq!(got, [[true, true], [true, false], [false, false]]);
    assert!(metrics(&svc).await.contains("tollgate_streams_open 1"));

    let mut g = svc.grpc().await;
    for a in &answers {
        let r = g
            .take_batch(with_token(batch_of(&on_calls, 3, 2)))
            .await
            .expect("TakeBatch")
            .into_inner();
        assert_eq!(settled(a), settled(&r));
    }
    s.half_close();
    assert_eq!(s.next().await.unwrap(), None);
    metrics_reach(&svc, "tollgate_streams_open 0").await;
    let m = metrics(&svc).await;
    for needle in [
        r#"tollgate_requests_total{transport="grpc",code="ok"} 6"#,
        "tollgate_batch_takes_count 6",
        r#"tollgate_decisions_total{outcome="allowed"} 6"#,
        r#"tollgate_decisions_total{outcome="limited"} 6"#,
    ] {
        assert!(m.contains(needle), "no {needle} in\n{m}");
    }
    svc.stop().await;
}

#[tokio::test]
async fn answers_in_order_as_take_batch_memory() {
    answers_in_order_as_take_batch(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn answers_in_order_as_take_batch_redis() {
    let r = RedisProc::start();
    answers_in_order_as_take_batch(Arc::new(common::redis_store(&r.url(), 2000))).await;
}

/// 8 streams at once, each 20 messages of 4 takes of one bucket of 100 with no refill to speak
/// of: exactly 100 admitted.
async fn exact_across_streams(store: Arc<dyn Store>) {
    const STREAMS: usize = 8;
    const MESSAGES: usize = 20;
    const TAKES: usize = 4;
    const C: u64 = 100;
    let svc = Arc::new(Service::start(store, None).await);
    let key = unique("shared");
    let mut tasks = Vec::new();
    for _ in 0..STREAMS {
        let (svc, key) = (svc.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let mut s = open(&svc, None).await.unwrap();
            let mut admitted = 0;
            for _ in 0..MESSAGES {
                let r = s.ask(&batch_of(&key, C, TAKES)).await;
                assert_eq!(r.results.len(), TAKES);
                admitted += r.results.iter().filter(|t| t.allowed).count() as u64;
            }
            admitted
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    assert_eq!(total, C, "exactly the capacity is admitted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_across_streams_memory() {
    exact_across_streams(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_across_streams_redis() {
    let r = RedisProc::start();
    exact_across_streams(Arc::new(common::redis_store(&r.url(), 2000))).await;
}

// ---------------------------------------------------------------------------------------------
// Endings

/// After a valid message, an invalid one (a zero capacity in its second take; 65 takes; bytes
/// that are not protobuf) ends the stream INVALID_ARGUMENT, the field named; nothing of it is
/// charged.
async fn a_bad_message_ends_the_stream(store: Arc<dyn Store>) {
    let svc = Service::start(store.clone(), None).await;
    let k = unique("untouched");
    let mut zero = batch_of(&k, 1, 2);
    zero.takes[1].buckets[0].capacity = 0;
    let mut garbage = batch_of(&k, 1, 1).encode_to_vec();
    garbage.extend_from_slice(&[0xff; 3]);
    let cases: [(Vec<u8>, &str); 3] = [
        (zero.encode_to_vec(), "takes[1].buckets[0].capacity: "),
        (batch_of(&k, 1, 65).encode_to_vec(), "takes: "),
        (garbage, "malformed protobuf"),
    ];
    for (bad, says) in cases {
        let mut s = open(&svc, None).await.unwrap();
        let first = s.ask(&batch_of(&unique("first"), 5, 1)).await;
        assert_eq!(allowed(&first), [true]);
        s.send_bytes(bad);
        let e = s.ending().await;
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().starts_with(says), "{e:?}");
        assert_eq!(s.next().await.unwrap(), None, "nothing after the ending");
    }
    let m = metrics(&svc).await;
    let needle = r#"tollgate_requests_total{transport="grpc",code="invalid_argument"} 3"#;
    assert!(m.contains(needle), "no {needle} in\n{m}");
    assert!(
        common::never_charged(store.as_ref(), &k).await,
        "a refused message charged {k}"
    );
    svc.stop().await;
}

#[tokio::test]
async fn a_bad_message_ends_the_stream_memory() {
    a_bad_message_ends_the_stream(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn a_bad_message_ends_the_stream_redis() {
    let r = RedisProc::start();
    a_bad_message_ends_the_stream(Arc::new(common::redis_store(&r.url(), 2000))).await;
}

/// Without the token, or with a wrong one, the stream is refused UNAUTHENTICATED as it opens.
#[tokio::test]
async fn the_token_is_checked_when_the_stream_opens() {
    let svc = Service::start(Arc::new(MemoryStore::new()), Some(TOKEN)).await;
    for token in [None, Some("wrong")] {
        let e = open(&svc, token).await.err().expect("refused");
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    }
    let mut s = open(&svc, Some(TOKEN)).await.unwrap();
    assert_eq!(allowed(&s.ask(&batch_of(&unique("t"), 1, 1)).await), [true]);
    let m = metrics(&svc).await;
    let needle = r#"tollgate_requests_total{transport="grpc",code="unauthenticated"} 2"#;
    assert!(m.contains(needle), "no {needle} in\n{m}");
    svc.stop().await;
}

/// A message over 1 MiB (64 takes of 16 long keys) ends the stream RESOURCE_EXHAUSTED, naming
/// the bound, as a TakeBatch call of it is refused; the message before it stays answered.
#[tokio::test]
async fn an_oversized_message_ends_the_stream() {
    let svc = Service::start(Arc::new(MemoryStore::new()), None).await;
    let takes: Vec<pb::TakeRequest> = (0..64)
        .map(|i| pb::TakeRequest {
            buckets: (0..16)
                .map(|j| pb_bucket(&format!("{i}-{j}-{}", "k".repeat(MAX_KEY_BYTES - 16))))
                .collect(),
            ..Default::default()
        })
        .collect();
    let big = pb::TakeBatchRequest {
        takes,
        ..Default::default()
    };
    assert!(big.encoded_len() > MAX_BATCH_BYTES);
    let mut s = open(&svc, None).await.unwrap();
    assert_eq!(allowed(&s.ask(&batch_of(&unique("o"), 1, 1)).await), [true]);
    s.send(&big);
    let e = s.ending().await;
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains(&MAX_BATCH_BYTES.to_string()), "{e:?}");
    let m = metrics(&svc).await;
    let needle = r#"tollgate_requests_total{transport="grpc",code="resource_exhausted"} 1"#;
    assert!(m.contains(needle), "no {needle} in\n{m}");
    svc.stop().await;
}

/// Redis gone: the next message ends the stream UNAVAILABLE, never an answer.
#[tokio::test]
async fn a_store_outage_ends_the_stream() {
    let mut r = RedisProc::start();
    let svc = Service::start(Arc::new(common::redis_store(&r.url(), 200)), None).await;
    let mut s = open(&svc, None).await.unwrap();
    let key = unique("down");
    assert_eq!(allowed(&s.ask(&batch_of(&key, 5, 1)).await), [true]);
    r.kill();
    let start = Instant::now();
    s.send(&batch_of(&key, 5, 1));
    let e = s.ending().await;
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    let m = metrics(&svc).await;
    let needle = r#"tollgate_requests_total{transport="grpc",code="unavailable"} 1"#;
    assert!(m.contains(needle), "no {needle} in\n{m}");
    svc.stop().await;
}

/// `max_in_flight` 1 and a message held in the store: another stream's message is shed, which
/// ends that stream UNAVAILABLE at once; the held message is answered once the store goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shed_message_ends_its_stream() {
    let store = Arc::new(Gated::new());
    let config = ServiceConfig {
        max_in_flight: 1,
        ..ServiceConfig::default()
    };
    let svc = Service::start_with(store.clone(), config).await;
    let mut held = open(&svc, None).await.unwrap();
    let mut shed = open(&svc, None).await.unwrap();
    held.send(&batch_of(&unique("held"), 1, 1));
    store.arrival().await;
    let start = Instant::now();
    shed.send(&batch_of(&unique("shed"), 1, 1));
    let e = shed.ending().await;
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("shed"), "{e:?}");
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "{:?}",
        start.elapsed()
    );
    store.open();
    assert_eq!(allowed(&held.answer().await), [true]);
    let m = metrics(&svc).await;
    assert!(m.contains("tollgate_shed_total 1"), "{m}");
    svc.stop().await;
}

/// The service stopping ends an idle stream UNAVAILABLE at once (not when its connection is
/// cut a grace period later).
#[tokio::test]
async fn shutdown_ends_an_idle_stream_at_once() {
    let svc = Service::start(Arc::new(MemoryStore::new()), None).await;
    let mut s = open(&svc, None).await.unwrap();
    assert_eq!(
        allowed(&s.ask(&batch_of(&unique("idle"), 1, 1)).await),
        [true]
    );
    let start = Instant::now();
    let stopping = tokio::spawn(svc.stop());
    let e = s.ending().await;
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("shutting down"), "{e:?}");
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    stopping.await.unwrap();
}

/// The service stopping while a message is being decided: the message is answered, then the
/// stream ends UNAVAILABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_the_message_being_decided() {
    let store = Arc::new(Gated::new());
    let svc = Service::start(store.clone(), None).await;
    let mut s = open(&svc, None).await.unwrap();
    s.send(&batch_of(&unique("deciding"), 1, 2));
    store.arrival().await;
    let stopping = tokio::spawn(svc.stop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.open();
    assert_eq!(allowed(&s.answer().await), [true, false]);
    let e = s.ending().await;
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("shutting down"), "{e:?}");
    stopping.await.unwrap();
}

/// An idle timeout of 300 ms, and a stream that sends a message every second for 4 s: every one
/// is answered on the same stream (its connection is not idled out under it).
#[tokio::test]
async fn an_open_stream_keeps_its_connection() {
    let config = ServiceConfig {
        idle_timeout: Duration::from_millis(300),
        ..ServiceConfig::default()
    };
    let svc = Service::start_with(Arc::new(MemoryStore::new()), config).await;
    let key = unique("kept");
    let mut s = open(&svc, None).await.unwrap();
    for i in 0..5 {
        if i > 0 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert_eq!(allowed(&s.ask(&batch_of(&key, 10, 1)).await), [true], "{i}");
    }
    svc.stop().await;
}

/// The client's half-close after two messages: both answered, then the stream ends OK (the
/// generated client, as a proxy's codec would send them).
#[tokio::test]
async fn half_close_ends_the_stream_ok_after_its_answers() {
    let svc = Service::start(Arc::new(MemoryStore::new()), Some(TOKEN)).await;
    let key = unique("half");
    let mut g = svc.grpc().await;
    let messages = futures_util::stream::iter(vec![batch_of(&key, 1, 1), batch_of(&key, 1, 1)]);
    let mut answers = g
        .take_stream(with_token(messages))
        .await
        .expect("TakeStream")
        .into_inner();
    let mut got = Vec::new();
    while let Some(a) = answers.message().await.expect("ends OK") {
        got.push(allowed(&a));
    }
    assert_eq!(got, [[true], [false]]);
    metrics_reach(&svc, "tollgate_streams_open 0").await;
    svc.stop().await;
}
