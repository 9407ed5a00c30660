//! Batches on one gRPC stream (`tollgate.v1.RateLimiter/TakeStream`). Messages with ids: answered
//! by id as each is decided (a later one overtaking a slow one), a message's error its answer and
//! the stream going on (invalid, shed at the take limit or at the stream's bound, a store
//! failure), the messages being decided answered at shutdown, the stream's bounds (a message not
//! whole in time, the bytes held of messages not yet whole). Messages of id 0, the earlier
//! contract: answers in order and equal to `TakeBatch`'s, exactness across streams, the stream's
//! endings (a bad message, the token, an oversized message, a store outage, a shed message, the
//! service's shutdown, the client's half-close), and a stream keeping its connection from idling
//! out. Over the memory store and real Redis.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::gated::Gated;
use common::h2_stream::{self, H2Stream};
use common::{pb_bucket, unique, RedisProc, Service};
use prost::bytes::BufMut;
use prost::Message;
use tokio::sync::mpsc;
use tollgate_server::api::grpc::pb;
use tollgate_server::domain::{MAX_BATCH_BYTES, MAX_KEY_BYTES};
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

/// `m` as a message with `id`.
fn with_id(id: u64, m: pb::TakeBatchRequest) -> pb::TakeBatchRequest {
    pb::TakeBatchRequest { id, ..m }
}

/// An answer's id, and its error's code or its takes' verdicts.
fn verdict(r: &pb::TakeBatchResponse) -> (u64, Result<Vec<bool>, u32>) {
    match &r.error {
        Some(e) => {
            assert!(r.results.is_empty(), "an error and results: {r:?}");
            (r.id, Err(e.code))
        }
        None => (r.id, Ok(allowed(r))),
    }
}

/// gRPC's INVALID_ARGUMENT, DEADLINE_EXCEEDED and UNAVAILABLE, as a message's error carries them.
const INVALID: u32 = 3;
const UNAVAILABLE: u32 = 14;

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
    answers_in_order_as_take_batch(common::memory_store()).await;
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
    exact_across_streams(common::memory_store()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_across_streams_redis() {
    let r = RedisProc::start();
    exact_across_streams(Arc::new(common::redis_store(&r.url(), 2000))).await;
}

// ---------------------------------------------------------------------------------------------
// Messages with ids

/// A message held in the store, then a later one: the later one is answered first, each answer
/// carrying its message's id; the held one once the store lets it through.
async fn a_later_message_overtakes_a_slow_one(store: Arc<dyn Store>) {
    let gated = Arc::new(Gated::over(store).only("held"));
    let svc = Service::start(gated.clone(), None).await;
    let mut s = open(&svc, None).await.unwrap();
    s.send(&with_id(7, batch_of(&unique("held"), 5, 1)));
    gated.arrival().await;
    s.send(&with_id(8, batch_of(&unique("free"), 5, 2)));
    assert_eq!(verdict(&s.answer().await), (8, Ok(vec![true, true])));
    gated.open();
    assert_eq!(verdict(&s.answer().await), (7, Ok(vec![true])));
    svc.stop().await;
}

#[tokio::test]
async fn a_later_message_overtakes_a_slow_one_memory() {
    a_later_message_overtakes_a_slow_one(common::memory_store()).await;
}

#[tokio::test]
async fn a_later_message_overtakes_a_slow_one_redis() {
    let r = RedisProc::start();
    a_later_message_overtakes_a_slow_one(Arc::new(common::redis_store(&r.url(), 2000))).await;
}

/// Invalid messages (a zero capacity in a second take, 65 takes, bytes that stop being protobuf
/// after the id) are each answered INVALID_ARGUMENT under their ids, the field named, nothing
/// charged; the stream goes on and answers the next message. Bytes that stop being protobuf
/// before an id could be read end it: no answer could name them.
async fn an_invalid_message_is_answered_and_the_stream_goes_on(store: Arc<dyn Store>) {
    let svc = Service::start(store.clone(), None).await;
    let k = unique("untouched");
    let mut zero = batch_of(&k, 1, 2);
    zero.takes[1].buckets[0].capacity = 0;
    let mut garbage = with_id(13, batch_of(&k, 1, 1)).encode_to_vec();
    garbage.extend_from_slice(&[0xff; 3]);
    let mut s = open(&svc, None).await.unwrap();
    s.send(&with_id(11, zero));
    s.send(&with_id(12, batch_of(&k, 1, 65)));
    s.send_bytes(garbage);
    s.send(&with_id(14, batch_of(&unique("next"), 1, 1)));
    let mut errors = Vec::new();
    for want in 11..=13 {
        let a = s.answer().await;
        assert_eq!(verdict(&a), (want, Err(INVALID)), "{a:?}");
        let e = a.error.unwrap();
        errors.push((e.field, e.message));
    }
    assert_eq!(errors[0].0, "takes[1].buckets[0].capacity");
    assert_eq!(errors[1].0, "takes");
    assert!(errors[1].1.contains("at most 64"), "{errors:?}");
    assert_eq!(errors[2].0, "");
    assert!(errors[2].1.starts_with("malformed protobuf"), "{errors:?}");
    assert_eq!(verdict(&s.answer().await), (14, Ok(vec![true])));

    s.send_bytes(vec![0xff; 3]);
    let e = s.ending().await;
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().starts_with("malformed protobuf"), "{e:?}");
    let m = metrics(&svc).await;
    for needle in [
        r#"tollgate_requests_total{transport="grpc",code="invalid_argument"} 4"#,
        r#"tollgate_requests_total{transport="grpc",code="ok"} 1"#,
    ] {
        assert!(m.contains(needle), "no {needle} in\n{m}");
    }
    assert!(
        common::never_charged(store.as_ref(), &k).await,
        "a refused message charged {k}"
    );
    svc.stop().await;
}

#[tokio::test]
async fn an_invalid_message_is_answered_and_the_stream_goes_on_memory() {
    an_invalid_message_is_answered_and_the_stream_goes_on(common::memory_store()).await;
}

#[tokio::test]
async fn an_invalid_message_is_answered_and_the_stream_goes_on_redis() {
    let r = RedisProc::start();
    an_invalid_message_is_answered_and_the_stream_goes_on(Arc::new(common::redis_store(
        &r.url(),
        2000,
    )))
    .await;
}

/// `max_in_flight` 2 and six messages on one stream, all held in the store: the first two hold
/// the permits, the other four are answered UNAVAILABLE under their ids at once (shed, counted as
/// such); the two are answered once the store goes on, and the stream answers the next message.
async fn messages_shed_at_the_take_limit_are_answered(store: Arc<dyn Store>) {
    let gated = Arc::new(Gated::over(store));
    let config = ServiceConfig {
        max_in_flight: 2,
        ..ServiceConfig::default()
    };
    let svc = Service::start_with(gated.clone(), config).await;
    let mut s = open(&svc, None).await.unwrap();
    let start = Instant::now();
    for id in 1..=6 {
        s.send(&with_id(id, batch_of(&unique("limit"), 1, 1)));
    }
    for id in 3..=6 {
        let a = s.answer().await;
        assert_eq!(verdict(&a), (id, Err(UNAVAILABLE)), "{a:?}");
        assert!(a.error.unwrap().message.contains("shed"));
    }
    let shed_in = start.elapsed();
    assert!(shed_in < Duration::from_millis(500), "{shed_in:?}");
    gated.open();
    let mut held = vec![verdict(&s.answer().await), verdict(&s.answer().await)];
    held.sort();
    assert_eq!(held, [(1, Ok(vec![true])), (2, Ok(vec![true]))]);
    assert_eq!(
        verdict(&s.ask(&with_id(7, batch_of(&unique("after"), 1, 1))).await),
        (7, Ok(vec![true]))
    );
    let m = metrics(&svc).await;
    for needle in [
        "tollgate_shed_total 4",
        r#"tollgate_requests_total{transport="grpc",code="unavailable"} 4"#,
        r#"tollgate_requests_total{transport="grpc",code="ok"} 3"#,
    ] {
        assert!(m.contains(needle), "no {needle} in\n{m}");
    }
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_shed_at_the_take_limit_are_answered_memory() {
    messages_shed_at_the_take_limit_are_answered(common::memory_store()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_shed_at_the_take_limit_are_answered_redis() {
    let r = RedisProc::start();
    messages_shed_at_the_take_limit_are_answered(Arc::new(common::redis_store(&r.url(), 2000)))
        .await;
}

/// `stream_max_in_flight` 3 and five messages held in the store: the fourth and fifth are
/// answered UNAVAILABLE at once, counted at the stream's bound (not as shed at the take limit);
/// another stream is not held back by this one's bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_decides_at_most_its_bound_at_once() {
    let gated = Arc::new(Gated::new().only("held"));
    let config = ServiceConfig {
        stream_max_in_flight: 3,
        ..ServiceConfig::default()
    };
    let svc = Service::start_with(gated.clone(), config).await;
    let mut s = open(&svc, None).await.unwrap();
    for id in 1..=5 {
        s.send(&with_id(id, batch_of(&unique("held"), 1, 1)));
    }
    for id in 4..=5 {
        let a = s.answer().await;
        assert_eq!(verdict(&a), (id, Err(UNAVAILABLE)), "{a:?}");
        assert!(a
            .error
            .unwrap()
            .message
            .contains("3 messages of this stream"));
    }
    let mut other = open(&svc, None).await.unwrap();
    assert_eq!(
        verdict(
            &other
                .ask(&with_id(1, batch_of(&unique("free"), 1, 1)))
                .await
        ),
        (1, Ok(vec![true]))
    );
    gated.open();
    let mut held: Vec<u64> = Vec::new();
    for _ in 0..3 {
        held.push(s.answer().await.id);
    }
    held.sort();
    assert_eq!(held, [1, 2, 3]);
    let m = metrics(&svc).await;
    for needle in [
        r#"tollgate_stream_refusals_total{reason="in_flight"} 2"#,
        "tollgate_shed_total 0",
    ] {
        assert!(m.contains(needle), "no {needle} in\n{m}");
    }
    svc.stop().await;
}

/// Redis gone: a message is answered UNAVAILABLE under its id, and the stream goes on; once Redis
/// is back, the same stream's messages are decided again.
#[tokio::test]
async fn a_store_failure_is_a_message_answer() {
    let mut r = RedisProc::start();
    let svc = Service::start(Arc::new(common::redis_store(&r.url(), 200)), None).await;
    let mut s = open(&svc, None).await.unwrap();
    let key = unique("outage");
    assert_eq!(
        verdict(&s.ask(&with_id(1, batch_of(&key, 5, 1))).await),
        (1, Ok(vec![true]))
    );
    r.kill();
    let start = Instant::now();
    let a = s.ask(&with_id(2, batch_of(&key, 5, 1))).await;
    assert_eq!(verdict(&a), (2, Err(UNAVAILABLE)), "{a:?}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    r.restart();
    let back = Instant::now() + Duration::from_secs(10);
    let mut id = 3;
    loop {
        let (got, verdict) = verdict(&s.ask(&with_id(id, batch_of(&key, 5, 1))).await);
        assert_eq!(got, id);
        match verdict {
            Ok(v) => {
                assert_eq!(v, [true]);
                break;
            }
            Err(code) => assert_eq!(code, UNAVAILABLE),
        }
        assert!(
            Instant::now() < back,
            "not decided again 10 s after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        id += 1;
    }
    eprintln!(
        "store failure: the stream answered again after {} message(s) since Redis came back",
        id - 2
    );
    let m = metrics(&svc).await;
    assert!(m.contains("tollgate_streams_open 1"), "{m}");
    svc.stop().await;
}

/// Messages of id 0 (the earlier contract): the second is not decided while the first is held,
/// both are answered in order once it goes on, and an invalid one ends the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn id_zero_is_decided_one_at_a_time_in_order() {
    let gated = Arc::new(Gated::new());
    let svc = Service::start(gated.clone(), None).await;
    let mut s = open(&svc, None).await.unwrap();
    let key = unique("zero");
    s.send(&batch_of(&key, 1, 1));
    s.send(&batch_of(&key, 1, 1));
    gated.arrivals(1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        gated.arrived(),
        1,
        "the second was decided beside the first"
    );
    gated.open();
    assert_eq!(verdict(&s.answer().await), (0, Ok(vec![true])));
    assert_eq!(verdict(&s.answer().await), (0, Ok(vec![false])));
    s.send(&batch_of(&key, 0, 1));
    let e = s.ending().await;
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    svc.stop().await;
}

/// The service stopping while three messages are being decided: all three are answered, then the
/// stream ends UNAVAILABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_every_message_being_decided() {
    let gated = Arc::new(Gated::new());
    let svc = Service::start(gated.clone(), None).await;
    let mut s = open(&svc, None).await.unwrap();
    for id in 1..=3 {
        s.send(&with_id(id, batch_of(&unique("deciding"), 1, 1)));
    }
    gated.arrivals(3).await;
    let stopping = tokio::spawn(svc.stop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    gated.open();
    let mut ids: Vec<u64> = Vec::new();
    for _ in 0..3 {
        let a = s.answer().await;
        assert_eq!(allowed(&a), [true], "{a:?}");
        ids.push(a.id);
    }
    ids.sort();
    assert_eq!(ids, [1, 2, 3]);
    let e = s.ending().await;
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("shutting down"), "{e:?}");
    stopping.await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Bounds

/// A gauge's value in `/metrics`.
async fn gauge(svc: &Service, name: &str) -> i64 {
    let m = metrics(svc).await;
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{m}"))
}

/// Waits for the gauge `name` to read `want`.
async fn gauge_reaches(svc: &Service, name: &str, want: i64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = gauge(svc, name).await;
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "{name} is {got}, not {want}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A body timeout of 300 ms: after a whole message, one that began to arrive and stops ends the
/// stream DEADLINE_EXCEEDED at the timeout, counted; a stream waiting between messages is not cut.
#[tokio::test]
async fn a_message_not_whole_in_time_ends_the_stream() {
    let config = ServiceConfig {
        body_timeout: Duration::from_millis(300),
        ..ServiceConfig::default()
    };
    let svc = Service::start_with(common::memory_store(), config).await;
    let conn = h2_stream::connect(&svc.addr.to_string()).await;
    let mut s = H2Stream::open(&conn, None).await.unwrap();
    s.send_message(&with_id(1, batch_of(&unique("whole"), 1, 1)));
    let a = tokio::time::timeout(Duration::from_secs(5), s.next()).await;
    assert_eq!(verdict(&a.unwrap().unwrap().unwrap()), (1, Ok(vec![true])));
    // Idle for longer than the timeout: nothing is cut.
    tokio::time::sleep(Duration::from_millis(600)).await;
    s.send_message(&with_id(2, batch_of(&unique("whole"), 1, 1)));
    let a = tokio::time::timeout(Duration::from_secs(5), s.next()).await;
    assert_eq!(verdict(&a.unwrap().unwrap().unwrap()), (2, Ok(vec![true])));
    let start = Instant::now();
    let mut begun = h2_stream::prefix(100).to_vec();
    begun.extend_from_slice(&[0x0a; 10]);
    s.send(begun.into()).unwrap();
    let e = tokio::time::timeout(Duration::from_secs(5), s.next())
        .await
        .expect("the stream ended within 5 s")
        .expect_err("an error");
    let took = start.elapsed();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(1500),
        "{took:?}"
    );
    let m = metrics(&svc).await;
    for needle in [
        r#"tollgate_stream_refusals_total{reason="deadline"} 1"#,
        r#"tollgate_requests_total{transport="grpc",code="deadline_exceeded"} 1"#,
    ] {
        assert!(m.contains(needle), "no {needle} in\n{m}");
    }
    svc.stop().await;
}

/// A budget of 100 KiB: two streams hold 96 KiB of messages not yet whole (announced at 1 MB);
/// a message of 8 KiB arriving whole in one frame is still decided (it holds nothing); a third
/// stream whose message would hold 8 KiB more ends UNAVAILABLE, counted, and gives it back.
#[tokio::test]
async fn the_bytes_held_of_messages_not_yet_whole_are_bounded() {
    const BUDGET: usize = 100 * 1024;
    const GAUGE: &str = "tollgate_stream_buffered_bytes";
    let config = ServiceConfig {
        stream_buffer_bytes: BUDGET,
        body_timeout: Duration::from_secs(10),
        ..ServiceConfig::default()
    };
    let svc = Service::start_with(common::memory_store(), config).await;
    let conn = h2_stream::connect(&svc.addr.to_string()).await;
    let begun = |n: usize| {
        let mut b = h2_stream::prefix(1_000_000).to_vec();
        b.extend(std::iter::repeat_n(0x0a, n - 5));
        axum::body::Bytes::from(b)
    };
    // 64 KiB arrive in four frames: held in a buffer doubled to 64 KiB; then 32 KiB in two.
    let mut a = H2Stream::open(&conn, None).await.unwrap();
    a.send(begun(60 * 1024)).unwrap();
    gauge_reaches(&svc, GAUGE, 64 * 1024).await;
    let mut b = H2Stream::open(&conn, None).await.unwrap();
    b.send(begun(30 * 1024)).unwrap();
    gauge_reaches(&svc, GAUGE, 96 * 1024).await;

    let long = |i: usize| pb::TakeRequest {
        buckets: vec![pb_bucket(&format!("{i}-{}", "k".repeat(4000)))],
        ..Default::default()
    };
    let whole = pb::TakeBatchRequest {
        takes: vec![long(1), long(2)],
        id: 1,
        ..Default::default()
    };
    assert!(
        whole.encoded_len() > BUDGET - 96 * 1024,
        "{}",
        whole.encoded_len()
    );
    let mut s = open(&svc, None).await.unwrap();
    assert_eq!(verdict(&s.ask(&whole).await), (1, Ok(vec![true, true])));

    let mut c = H2Stream::open(&conn, None).await.unwrap();
    c.send(begun(8 * 1024)).unwrap();
    let e = tokio::time::timeout(Duration::from_secs(5), c.next())
        .await
        .expect("refused within 5 s")
        .expect_err("an error");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains(&BUDGET.to_string()), "{e:?}");
    gauge_reaches(&svc, GAUGE, 96 * 1024).await;
    let m = metrics(&svc).await;
    for needle in [
        r#"tollgate_stream_refusals_total{reason="buffer"} 1"#,
        r#"tollgate_requests_total{transport="grpc",code="unavailable"} 1"#,
    ] {
        assert!(m.contains(needle), "no {needle} in\n{m}");
    }
    drop((a, b));
    gauge_reaches(&svc, GAUGE, 0).await;
    svc.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Endings (id 0: the earlier contract)

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
    a_bad_message_ends_the_stream(common::memory_store()).await;
}

#[tokio::test]
async fn a_bad_message_ends_the_stream_redis() {
    let r = RedisProc::start();
    a_bad_message_ends_the_stream(Arc::new(common::redis_store(&r.url(), 2000))).await;
}

/// Without the token, or with a wrong one, the stream is refused UNAUTHENTICATED as it opens.
#[tokio::test]
async fn the_token_is_checked_when_the_stream_opens() {
    let svc = Service::start(common::memory_store(), Some(TOKEN)).await;
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
    let svc = Service::start(common::memory_store(), None).await;
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
    let svc = Service::start(common::memory_store(), None).await;
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
    let svc = Service::start_with(common::memory_store(), config).await;
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
    let svc = Service::start(common::memory_store(), Some(TOKEN)).await;
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

/// The binary on one thread (`--runtime current-thread`, what `auto` picks on one CPU): takes as
/// messages on a stream, in batches, and as JSON are all decided, each bucket exactly (capacity 2:
/// the third take of a key is denied).
#[tokio::test]
async fn the_binary_on_one_thread_decides_every_transport() {
    use common::binary::ServerProc;
    let svc = ServerProc::start(&["--runtime", "current-thread"]);
    assert!(
        svc.logs().contains(r#""runtime":"current-thread""#),
        "{}",
        svc.logs()
    );
    let conn = h2_stream::connect(&svc.addr()).await;
    let mut s = H2Stream::open(&conn, None).await.unwrap();
    let key = unique("one-thread");
    s.send_message(&with_id(1, batch_of(&key, 2, 3)));
    let a = tokio::time::timeout(Duration::from_secs(5), s.next()).await;
    assert_eq!(
        verdict(&a.unwrap().unwrap().unwrap()),
        (1, Ok(vec![true, true, false]))
    );
    let client = reqwest::Client::new();
    let body =
        serde_json::json!({"buckets": [{"key": key, "capacity": 2, "rate": 1, "period_ms": HOUR}]});
    let r: serde_json::Value = client
        .post(svc.url("/v1/take"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        r["allowed"], false,
        "the stream's takes spent the bucket: {r}"
    );
    let auto = ServerProc::start(&["--worker-threads", "1"]);
    assert!(
        auto.logs().contains(r#""runtime":"current-thread""#),
        "auto with one worker thread: {}",
        auto.logs()
    );
}
