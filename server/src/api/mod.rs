//! What every operation shares, below them all (`ops/` holds the operations): the store, the
//! metrics, the token check, readiness, the live instances, admission and the shutdown signal.
//! Both transports admit a request through [`Api::admit`] (the token from the headers, then the
//! body, bounded in size and time, then a permit or an immediate 503) before anything is decoded;
//! a stream of batches (`ops/stream.rs`), whose body is never read whole, through
//! [`Api::admit_token`] when it opens, its messages read through [`Api::stream_messages`]
//! (bounded, charged to the service's buffer budget, timed) and each decided under its own
//! [`Api::permit`]. An operation then reaches the store through [`Api::store_call`] (timed, a
//! failure counted and logged, answered 503 / `UNAVAILABLE`).
//!
//! | file | what |
//! |---|---|
//! | `json.rs` | the one strict JSON reader (unknown fields refused, the bad field named) and the error body |
//! | `grpc.rs` | protobuf types generated from `contract/tollgate.proto`, a codec that turns malformed protobuf into `INVALID_ARGUMENT`, the gRPC status of an error (a call's, or a stream message's error answer) |
//! | `frames.rs` | a stream's messages read from its body (gRPC's framing), what it holds between reads charged to the service's budget, each message whole within the body timeout |
//! | `http.rs` | an operation's answer over HTTP: its JSON body, or its error's status and body |
//! | `instances.rs` | the live proxy instances every answer reports (reported to the store once a second) |

pub mod frames;
pub mod grpc;
pub mod http;
pub mod instances;
pub mod json;

use std::future::Future;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap};
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use crate::domain::{InvalidArgument, MAX_BATCH_BYTES, MAX_BATCH_TAKES};
use crate::metrics::Metrics;
use crate::store::{Store, StoreError};

/// Why a body was not read.
enum BodyError {
    /// It was over the bound.
    TooLarge,
    /// The connection failed while it was read.
    Read(axum::Error),
}

/// A request's whole body, at most `bound` bytes (more is refused as soon as it arrives). A body
/// of one data frame, as a proxy sends a small body, is returned as it came, without a copy;
/// trailers are ignored.
async fn read_body(mut body: Body, bound: usize) -> Result<Bytes, BodyError> {
    // The first data frame, kept as it came until a second one arrives; from then on every byte
    // so far is in `joined`.
    let mut first: Option<Bytes> = None;
    let mut joined: Vec<u8> = Vec::new();
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(BodyError::Read)?.into_data() else {
            continue;
        };
        len += data.len();
        if len > bound {
            return Err(BodyError::TooLarge);
        }
        if data.is_empty() {
            continue;
        }
        match first.take() {
            None if joined.is_empty() => first = Some(data),
            earlier => {
                if let Some(f) = earlier {
                    joined.extend_from_slice(&f);
                }
                joined.extend_from_slice(&data);
            }
        }
    }
    Ok(first.unwrap_or_else(|| Bytes::from(joined)))
}

/// Why a take was not answered. Each maps to one HTTP status and one gRPC code.
#[derive(Debug)]
pub enum ApiError {
    /// 400 / `INVALID_ARGUMENT`.
    Invalid(InvalidArgument),
    /// 401 / `UNAUTHENTICATED`.
    Unauthenticated,
    /// 413 / `RESOURCE_EXHAUSTED`: the take is over this bound, in bytes (gRPC's frame header
    /// not counted).
    TooLarge(usize),
    /// 408 / `DEADLINE_EXCEEDED`: the body did not arrive within this many milliseconds.
    BodyTimeout(u64),
    /// 503 / `UNAVAILABLE`: this many takes were already in flight; the take was shed, not queued.
    Overloaded(usize),
    /// `UNAVAILABLE`, a message of a `TakeStream` stream only: this many messages of its stream
    /// were being decided (`--stream-max-in-flight`); it was shed, not queued.
    StreamBusy(usize),
    /// `UNAVAILABLE`, a `TakeStream` stream only: the message it was sending, not yet whole,
    /// would have taken the bytes the streams hold past this bound (`--stream-buffer-bytes`).
    BufferFull(usize),
    /// 404 / `NOT_FOUND`: the admin endpoints (`ops/buckets.rs`) are off: no admin token is set.
    AdminOff,
    /// 503 / `UNAVAILABLE`: the store could not decide. The text is what the caller may see (the
    /// detail went to the log).
    Unavailable(&'static str),
}

impl crate::trace::Coded for ApiError {
    fn code(&self) -> &'static str {
        ApiError::code(self)
    }
}

impl ApiError {
    /// The contract's error code, also the metrics label.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::Invalid(_) => "invalid_argument",
            ApiError::Unauthenticated => "unauthenticated",
            ApiError::AdminOff => "not_found",
            ApiError::TooLarge(_) => "resource_exhausted",
            ApiError::BodyTimeout(_) => "deadline_exceeded",
            ApiError::Overloaded(_)
            | ApiError::StreamBusy(_)
            | ApiError::BufferFull(_)
            | ApiError::Unavailable(_) => "unavailable",
        }
    }

    /// The message both transports send with the error: nothing about the store's internals.
    pub fn message(&self) -> String {
        match self {
            ApiError::Invalid(inv) => inv.to_string(),
            ApiError::Unauthenticated => "missing or wrong bearer token".to_string(),
            ApiError::AdminOff => {
                "not found: the admin endpoints are off (no --admin-token)".to_string()
            }
            ApiError::TooLarge(bound) if *bound == MAX_BATCH_BYTES => format!(
                "request body over the bound of {bound} bytes (a batch: 1 MiB, at most {MAX_BATCH_TAKES} takes)"
            ),
            ApiError::TooLarge(bound) => format!(
                "request body over the bound of {bound} bytes (16 buckets of 4096-byte keys)"
            ),
            ApiError::BodyTimeout(ms) => format!("request body not received within {ms} ms"),
            ApiError::Overloaded(n) => {
                format!("overloaded: {n} takes in flight, this one was shed; retry later")
            }
            ApiError::StreamBusy(n) => format!(
                "{n} messages of this stream are being decided, this one was shed; retry later"
            ),
            ApiError::BufferFull(n) => format!(
                "the streams hold {n} bytes of messages not yet whole: this stream was ended; open a new one"
            ),
            ApiError::Unavailable(m) => (*m).to_string(),
        }
    }

    /// Whether the connection should be closed after this answer (a body was left unread).
    pub fn closes_connection(&self) -> bool {
        matches!(self, ApiError::TooLarge(_) | ApiError::BodyTimeout(_))
    }
}

/// The bearer token check. Compares SHA-256 digests in constant time, so neither the content nor
/// the length of the expected token leaks through timing.
#[derive(Clone)]
pub struct Auth {
    expected: Option<[u8; 32]>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("token", &self.expected.map(|_| "***"))
            .finish()
    }
}

impl Auth {
    /// `None`: every call is accepted.
    pub fn new(token: Option<&str>) -> Self {
        Auth {
            expected: token.map(|t| Sha256::digest(format!("Bearer {t}").as_bytes()).into()),
        }
    }

    /// Checks an `authorization` header (HTTP) or metadata value (gRPC).
    pub fn check(&self, header: Option<&[u8]>) -> bool {
        let Some(expected) = &self.expected else {
            return true;
        };
        let header = header.unwrap_or_default();
        // The scheme is case-insensitive (RFC 9110); the token is compared exactly.
        let mut h = Sha256::new();
        match header.get(..7) {
            Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => {
                h.update(b"Bearer ");
                h.update(&header[7..]);
            }
            _ => h.update(header),
        }
        let got: [u8; 32] = h.finalize().into();
        bool::from(got.ct_eq(expected))
    }
}

/// The store's readiness as last checked by the refresher [`crate::run`] starts: `/readyz`
/// answers from it, so a flood of probes never reaches the store.
#[derive(Debug, Default)]
pub struct Readiness(AtomicU8);

// 0: not checked yet.
const READY: u8 = 1;
const NOT_READY: u8 = 2;

impl Readiness {
    /// The last check's result (not ready before the first).
    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Relaxed) == READY
    }

    /// Checks the store once, records the result, logs a change (with the store's detail).
    pub async fn refresh(&self, store: &dyn Store) {
        let result = store.ping().await;
        let now = if result.is_ok() { READY } else { NOT_READY };
        if self.0.swap(now, Ordering::Relaxed) == now {
            return;
        }
        match result {
            Err(e) => {
                tracing::warn!(error = %e, store = store.kind(), "store not ready; takes fail with 503 until it is")
            }
            Ok(()) => tracing::info!(store = store.kind(), "store ready"),
        }
    }
}

/// What both transports share: the store, the metrics, the token and the take limiter.
pub struct Api {
    /// Where buckets live.
    pub store: Arc<dyn Store>,
    /// Counters and histograms (shared with the accept loop).
    pub metrics: Arc<Metrics>,
    /// Bearer token check.
    pub auth: Auth,
    /// The admin endpoints' token check (`ops/buckets.rs`), never the takes' token; `None`: the
    /// endpoints are off and answer 404.
    pub admin: Option<Auth>,
    /// Cached store readiness.
    pub readiness: Readiness,
    /// The live proxy instances every answer reports.
    pub instances: Arc<instances::Instances>,
    /// Longest wait for a take's body.
    pub body_timeout: Duration,
    /// Takes being decoded or decided at once (after their body arrived); more are shed.
    in_flight: Arc<Semaphore>,
    max_in_flight: usize,
    /// Messages of one stream decoded or decided at once (`ops/stream.rs`); more are shed.
    pub stream_max_in_flight: usize,
    /// The bytes the streams hold of messages not yet whole ([`frames`]).
    stream_buffer: Arc<frames::Budget>,
    /// `true` once the service began to shut down ([`Api::shut_down`]). A value, not a
    /// notification: a stream that opens or looks after it began still sees it.
    shutdown: watch::Sender<bool>,
}

impl Api {
    /// The shared state of the transports.
    pub fn new(
        store: Arc<dyn Store>,
        token: Option<&str>,
        max_in_flight: usize,
        body_timeout: Duration,
    ) -> Self {
        let max_in_flight = max_in_flight.clamp(1, Semaphore::MAX_PERMITS);
        let metrics = Arc::new(Metrics::new());
        Api {
            store,
            stream_buffer: Arc::new(frames::Budget::new(STREAM_BUFFER_BYTES, metrics.clone())),
            metrics,
            auth: Auth::new(token),
            admin: None,
            readiness: Readiness::default(),
            instances: Arc::new(instances::Instances::default()),
            body_timeout,
            in_flight: Arc::new(Semaphore::new(max_in_flight)),
            max_in_flight,
            stream_max_in_flight: STREAM_MAX_IN_FLIGHT,
            shutdown: watch::Sender::new(false),
        }
    }

    /// Turns the admin endpoints on, guarded by `token` (`None`: off, the default).
    pub fn with_admin_token(mut self, token: Option<&str>) -> Self {
        self.admin = token.map(|t| Auth::new(Some(t)));
        self
    }

    /// Keeps a proxy instance counted for `ttl_ms` after its last callout (the default:
    /// [`instances::DEFAULT_TTL_MS`]).
    pub fn with_instance_ttl(mut self, ttl_ms: u64) -> Self {
        self.instances = Arc::new(instances::Instances::new(ttl_ms));
        self
    }

    /// Bounds the streams (`ops/stream.rs`): each decides at most `max_in_flight` of its messages
    /// at once, and all together hold at most `buffer_bytes` of messages not yet whole (the
    /// defaults: [`STREAM_MAX_IN_FLIGHT`], [`STREAM_BUFFER_BYTES`]).
    pub fn with_stream_limits(mut self, max_in_flight: usize, buffer_bytes: usize) -> Self {
        self.stream_max_in_flight = max_in_flight.max(1);
        self.stream_buffer = Arc::new(frames::Budget::new(buffer_bytes, self.metrics.clone()));
        self
    }

    /// [`Api::admit`] for the admin endpoints: 404 when they are off, then their own token (the
    /// takes' token does not open them), the body and a permit as any request.
    pub async fn admit_admin(
        &self,
        headers: &HeaderMap,
        body: Body,
        limit: usize,
        framing: usize,
    ) -> Result<(Bytes, OwnedSemaphorePermit), ApiError> {
        let admin = self.admin.as_ref().ok_or(ApiError::AdminOff)?;
        self.admit_as(admin, headers, body, limit, framing).await
    }

    /// Everything a request goes through before it is decoded, in this order: the token (from
    /// the headers alone), the body (at most `limit` bytes, its operation's bound, plus the
    /// transport's `framing` bytes, within the body timeout: no permit is held while a slow client
    /// sends it), then a permit, granted at once or refused (shed). The permit is held until the
    /// answer is ready. A batch holds one permit, like a take: the permits bound the requests
    /// being decided, each of which is one store call on standalone Redis.
    pub async fn admit(
        &self,
        headers: &HeaderMap,
        body: Body,
        limit: usize,
        framing: usize,
    ) -> Result<(Bytes, OwnedSemaphorePermit), ApiError> {
        self.admit_as(&self.auth, headers, body, limit, framing)
            .await
    }

    /// The token check alone, from the headers: the admission of a stream (`ops/stream.rs`),
    /// whose body is never read whole here. Its messages are read through
    /// [`Api::stream_messages`], and each takes its own [`Api::permit`].
    pub fn admit_token(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        token(&self.auth, headers)
    }

    /// The messages of a stream's `body`, one at a time: each at most [`MAX_BATCH_BYTES`] (from
    /// its length prefix), what the stream holds between two reads charged to the service's
    /// budget, and each message whole within the body timeout of its first byte.
    pub fn stream_messages(&self, body: Body) -> frames::Messages {
        frames::Messages::new(body, self.stream_buffer.clone(), self.body_timeout)
    }

    /// One permit of the take limiter, granted at once or refused (counted as shed, answered
    /// 503 / `UNAVAILABLE`), never waited for: held while one admitted request, or one message of
    /// a stream, is decided.
    pub fn permit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.in_flight.clone().try_acquire_owned().map_err(|_| {
            self.metrics.shed();
            ApiError::Overloaded(self.max_in_flight)
        })
    }

    /// Begins the shutdown ([`crate::run`] calls it before the connections are told to close):
    /// every open stream ends with `UNAVAILABLE` once the message it is deciding is answered.
    pub fn shut_down(&self) {
        self.shutdown.send_replace(true);
    }

    /// What [`Api::shut_down`] sets: `true` once the shutdown began, also for a receiver made
    /// after it.
    pub fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }

    /// [`Api::admit`] under the token check `auth`.
    async fn admit_as(
        &self,
        auth: &Auth,
        headers: &HeaderMap,
        body: Body,
        limit: usize,
        framing: usize,
    ) -> Result<(Bytes, OwnedSemaphorePermit), ApiError> {
        let bound = limit + framing;
        token(auth, headers)?;
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > bound as u64) {
            return Err(ApiError::TooLarge(limit));
        }
        let bytes = match tokio::time::timeout(self.body_timeout, read_body(body, bound)).await {
            Err(_) => {
                let ms = u64::try_from(self.body_timeout.as_millis()).unwrap_or(u64::MAX);
                return Err(ApiError::BodyTimeout(ms));
            }
            Ok(Err(BodyError::TooLarge)) => return Err(ApiError::TooLarge(limit)),
            Ok(Err(BodyError::Read(e))) => {
                return Err(ApiError::Invalid(InvalidArgument::new(
                    "",
                    format!("cannot read the body: {e}"),
                )))
            }
            Ok(Ok(bytes)) => bytes,
        };
        self.permit().map(|permit| (bytes, permit))
    }

    /// Notes the caller's instance id (every operation's: a take, a batch, a refund, a settle, an
    /// acquire, a release) and returns the live-instance count an answer carries;
    /// when a report to the store is due, starts it in the background (off the take path).
    pub(crate) fn instances(&self, id: Option<&str>) -> u64 {
        let now = Instant::now();
        let (n, due) = self.instances.note(id, now);
        if due {
            let (reg, store, metrics) = (
                self.instances.clone(),
                self.store.clone(),
                self.metrics.clone(),
            );
            tokio::spawn(async move {
                let n = reg.flush(&*store, now).await;
                metrics.live_instances(n);
            });
        }
        n
    }

    /// One store call of an operation (`what`, for the log): timed, its failure counted and
    /// logged with the store's detail, and answered with what a caller may see.
    pub async fn store_call<T>(
        &self,
        what: &'static str,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, ApiError> {
        let start = Instant::now();
        let result = call.await;
        let took = start.elapsed().as_secs_f64();
        self.metrics.store_duration(took);
        crate::trace::note(|| {
            vec![opentelemetry::KeyValue::new(
                "tollgate.store_ms",
                took * 1000.0,
            )]
        });
        result.map_err(|e| {
            self.metrics.store_error(e.kind());
            tracing::warn!(error = %e, transient = e.is_transient(), store = self.store.kind(), "{what} failed");
            ApiError::Unavailable(e.public_message())
        })
    }
}

/// The `authorization` header checked by `auth`.
fn token(auth: &Auth, headers: &HeaderMap) -> Result<(), ApiError> {
    let header = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    if auth.check(header) {
        Ok(())
    } else {
        Err(ApiError::Unauthenticated)
    }
}

/// gRPC's frame header before a message (compression flag, length): a gRPC take's body is one
/// message of at most [`crate::domain::MAX_TAKE_BYTES`] behind it.
pub const GRPC_FRAMING_BYTES: usize = 5;

/// The default of `--stream-max-in-flight`: a stream's messages decided at once. A proxy worker
/// sends a message per callout on its one stream, so this is its callouts awaiting an answer: 64
/// is a worker's 64,000 callouts a second at a millisecond each, and as many single-take messages
/// as one coalesced store call carries (`--coalesce`, at most 64). One stream then holds at most
/// a sixteenth of the default take limit (1024): a stuck or greedy worker leaves the rest to the
/// others.
pub const STREAM_MAX_IN_FLIGHT: usize = 64;

/// The default of `--stream-buffer-bytes`: the bytes all streams together hold of messages not
/// yet whole. A proxy's messages are a few hundred bytes and arrive whole within a frame (they
/// charge nothing); 64 MiB holds 64 largest messages (1 MiB) half-arrived at once, a quarter of
/// the 256 MiB the deployment gives a replica.
pub const STREAM_BUFFER_BYTES: usize = 64 * 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auth() {
        let a = Auth::new(Some("s3cret"));
        assert!(a.check(Some(b"Bearer s3cret")));
        assert!(!a.check(Some(b"Bearer s3cre")));
        assert!(a.check(Some(b"bearer s3cret")));
        assert!(!a.check(Some(b"Bearer s3cret ")));
        assert!(!a.check(None));
        assert!(Auth::new(None).check(None));
        assert!(!format!("{a:?}").contains("s3cret"));
    }

    /// A body sent in `parts` (HTTP/1.1 chunks, HTTP/2 DATA frames).
    fn sent_in(parts: &[&'static str]) -> Body {
        let chunks: Vec<Result<Bytes, std::io::Error>> = parts
            .iter()
            .map(|p| Ok(Bytes::from_static(p.as_bytes())))
            .collect();
        Body::from_stream(futures_util::stream::iter(chunks))
    }

    /// The body as read, or whether it was refused as too large.
    async fn read(parts: &[&'static str], bound: usize) -> Result<Vec<u8>, bool> {
        read_body(sent_in(parts), bound)
            .await
            .map(|b| b.to_vec())
            .map_err(|e| matches!(e, BodyError::TooLarge))
    }

    #[tokio::test]
    async fn a_body_is_read_whole_and_refused_past_its_bound() {
        assert_eq!(
            read(&["{\"a\":", "", "1", "}"], 64).await,
            Ok(b"{\"a\":1}".to_vec())
        );
        assert_eq!(read(&["one"], 3).await, Ok(b"one".to_vec()));
        assert_eq!(read(&["", "one"], 3).await, Ok(b"one".to_vec()));
        assert_eq!(read(&[], 3).await, Ok(Vec::new()));
        assert_eq!(read(&["ab", "c"], 3).await, Ok(b"abc".to_vec()));
        assert_eq!(read(&["ab", "cd"], 3).await, Err(true));
        assert_eq!(read(&["abcd"], 3).await, Err(true));
    }
}
