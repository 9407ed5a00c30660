//! The accept loop: hyper-util's auto builder (HTTP/1.1 and HTTP/2 cleartext on one port) with the
//! limits that keep slow, idle or numerous clients from holding the service.
//!
//! | limit | what happens |
//! |---|---|
//! | `max_connections` | a connection accepted beyond it is closed at once (counted) |
//! | `header_timeout` | HTTP/1.1: a request head (also the next one on a keep-alive connection) must arrive within it, else hyper closes the connection; any protocol: a connection that has sent no request by then is closed |
//! | `idle_timeout` | a connection with no request in progress for this long is shut down gracefully (HTTP/2: GOAWAY); a request is in progress until its response body has ended (or was dropped), so an open stream (`TakeStream`) keeps its connection |
//! | `http2_max_streams` | concurrent streams per HTTP/2 connection (SETTINGS_MAX_CONCURRENT_STREAMS) |
//!
//! Request bodies are bounded in size and time per request by `Api::admit` (`api/mod.rs`), before any decoding;
//! a stream's messages one by one, by their length prefix, a deadline and one budget for the bytes
//! of messages not yet whole (`api/frames.rs`). The flow-control windows bound what HTTP/2 holds of
//! bodies not yet read: `H2_CONNECTION_WINDOW` per connection (`ops/stream.rs` sums up what a
//! hostile client can make the service hold).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::response::Response;
use hyper::body::{Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower::{Service, ServiceExt};

use crate::metrics::Metrics;

/// Connection-level limits (see the module doc).
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Time to receive a request head; also how long a new connection may stay silent.
    pub header_timeout: Duration,
    /// Time a connection may stay open with no request in progress.
    pub idle_timeout: Duration,
    /// Concurrent streams per HTTP/2 connection.
    pub http2_max_streams: u32,
}

/// How long a connection told to shut down (idle, or the service stopping) may take to finish
/// its requests before it is dropped.
const GRACE: Duration = Duration::from_secs(3);
/// Largest HTTP/1.1 read buffer, hence largest request head.
const H1_MAX_BUF: usize = 64 * 1024;
/// Largest HTTP/2 header list.
const H2_MAX_HEADER_LIST: u32 = 16 * 1024;
/// HTTP/2 flow-control windows: a stream may send a whole take at once; a connection, a few.
const H2_STREAM_WINDOW: u32 = 128 * 1024;
/// What a connection may send that no request has read yet, all its streams together.
const H2_CONNECTION_WINDOW: u32 = 1024 * 1024;

/// Serves `app` on `listener` until `shutdown` completes, then lets open connections finish
/// (each within 3 s).
pub async fn serve<S>(
    listener: TcpListener,
    app: S,
    limits: ConnectionLimits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(H1_MAX_BUF);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.http2_max_streams.max(1))
        .max_header_list_size(H2_MAX_HEADER_LIST)
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONNECTION_WINDOW);
    let slots = Arc::new(Semaphore::new(
        limits.max_connections.clamp(1, Semaphore::MAX_PERMITS),
    ));
    let (stop_tx, stop_rx) = watch::channel(());
    tokio::pin!(shutdown);
    loop {
        let (stream, _peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics.connection_refused();
            drop(stream);
            continue;
        };
        // Responses are small and latency-bound: no Nagle delay.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY");
        }
        let conn = Conn {
            builder: builder.clone(),
            limits: limits.clone(),
            stop: stop_rx.clone(),
            metrics: metrics.clone(),
            _slot: slot,
        };
        tokio::spawn(conn.run(stream, app.clone()));
    }
    drop(listener);
    drop(stop_rx);
    // Every connection holds a receiver; `closed` completes once the last one is gone.
    let _ = stop_tx.send(());
    stop_tx.closed().await;
    Ok(())
}

/// What a connection knows about its requests, updated by the service wrapper.
struct Activity {
    start: Instant,
    in_flight: AtomicUsize,
    requests: AtomicU64,
    /// Milliseconds after `start` of the last request's start or end.
    last_ms: AtomicU64,
    /// Wakes the watchdog when the first request arrives (it was waiting for the header timeout).
    first_request: Notify,
}

impl Activity {
    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

/// Counts a request in progress; dropped with its response body ([`Tracked`]), or with the
/// request when the client went away before the response was ready.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(a: &Arc<Activity>) -> Self {
        a.in_flight.fetch_add(1, Ordering::Relaxed);
        a.touch();
        if a.requests.fetch_add(1, Ordering::Relaxed) == 0 {
            a.first_request.notify_one();
        }
        InFlight(a.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that keeps its request counted in progress until the body has ended or is
/// dropped: a response whose head is sent is not finished while its body still streams (a
/// stream's answers), and its connection must not be idled out under it.
struct Tracked {
    body: Body,
    in_flight: Option<InFlight>,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        if matches!(frame, Poll::Ready(None | Some(Err(_)))) {
            this.in_flight = None;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

struct Conn {
    builder: Builder<TokioExecutor>,
    limits: ConnectionLimits,
    stop: watch::Receiver<()>,
    metrics: Arc<Metrics>,
    _slot: OwnedSemaphorePermit,
}

impl Conn {
    async fn run<S>(mut self, stream: TcpStream, app: S)
    where
        S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
        S::Future: Send + 'static,
    {
        self.metrics.connection(true);
        let activity = Arc::new(Activity {
            start: Instant::now(),
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
            first_request: Notify::new(),
        });
        let a = activity.clone();
        let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let in_flight = InFlight::new(&a);
            let app = app.clone();
            async move {
                let resp = app.oneshot(req.map(Body::new)).await;
                resp.map(|r| {
                    r.map(|body| Tracked {
                        body,
                        in_flight: Some(in_flight),
                    })
                })
            }
        });
        let conn = self.builder.serve_connection(TokioIo::new(stream), svc);
        tokio::pin!(conn);
        let mut closing: Option<Instant> = None;
        let mut waiting_first = true;
        loop {
            let wake = match closing {
                Some(until) => until,
                None if activity.requests.load(Ordering::Relaxed) == 0 => {
                    activity.start + self.limits.header_timeout
                }
                None if activity.in_flight.load(Ordering::Relaxed) > 0 => {
                    Instant::now() + self.limits.idle_timeout
                }
                None => activity.last() + self.limits.idle_timeout,
            };
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "connection ended");
                    }
                    break;
                }
                () = tokio::time::sleep_until(wake) => {
                    if closing.is_some() {
                        break;
                    }
                    let now = Instant::now();
                    if activity.requests.load(Ordering::Relaxed) == 0 {
                        // Not a single request head in `header_timeout`: nothing to finish.
                        break;
                    }
                    if activity.in_flight.load(Ordering::Relaxed) == 0
                        && now >= activity.last() + self.limits.idle_timeout
                    {
                        conn.as_mut().graceful_shutdown();
                        closing = Some(now + GRACE);
                    }
                }
                () = activity.first_request.notified(), if waiting_first => {
                    waiting_first = false;
                }
                _ = self.stop.changed(), if closing.is_none() => {
                    conn.as_mut().graceful_shutdown();
                    closing = Some(Instant::now() + GRACE);
                }
            }
        }
        self.metrics.connection(false);
    }
}
