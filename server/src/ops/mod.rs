//! The operations, one module each (tokio-rs/mini-redis's `cmd/` is the model): every module
//! owns its operation's raw form, validation, JSON and protobuf forms and handler, and is reached
//! through [`Operation`] (and [`GrpcOperation`] where it has a gRPC method), so the transports
//! hold no operation's code.
//!
//! | file | what |
//! |---|---|
//! | `take.rs` | `POST /v1/take`, `Take`: 1..=16 buckets charged all or none; the take's validation every other operation reuses |
//! | `batch.rs` | `POST /v1/take_batch`, `TakeBatch`: 1..=64 takes, one store call |
//! | `stream.rs` | `TakeStream`: batches as messages on one gRPC stream, each decided by `batch.rs`, several at once, and answered by its id as it is decided |
//! | `acquire.rs` | `POST /v1/acquire`, `Acquire`: concurrency slots taken |
//! | `release.rs` | `POST /v1/release`, `Release`: slots given back |
//! | `buckets.rs` | `GET /v1/buckets`, `POST /v1/buckets/reset`, `tollgate.admin.v1.Admin` (admin token): one bucket's state read on the store's clock, or deleted |
//! | `refund.rs` | `POST /v1/refund` (JSON only): a lease's unspent tokens given back |
//! | `settle.rs` | `POST /v1/settle`, `Settle`: reserve-then-settle, applied once per settlement id |
//!
//! This file: the two traits, the one HTTP handler and the one gRPC message handler over them
//! (a unary call's, or a stream's message), the routes, the tonic service of
//! `tollgate.v1.RateLimiter`, and [`Decide`], what RLS may ask.

pub mod acquire;
pub mod batch;
pub mod buckets;
pub mod refund;
pub mod release;
pub mod settle;
pub mod stream;
pub mod take;

use std::future::Future;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use tonic::Status;

use crate::api::grpc::{pb, status_of};
use crate::api::http::answer;
use crate::api::json::{self, Object};
use crate::api::{Api, ApiError};
use crate::domain::{BucketSpec, InvalidArgument, SettleResponse, TakeResponse};
use crate::metrics::Metrics;
use crate::trace;

/// One operation: how its JSON body is read and how it is decided.
pub trait Operation {
    /// The request as decoded, before validation; its JSON form is read by the strict reader.
    type Raw: Object;
    /// The answer; its serde form is the JSON response body.
    type Answer: serde::Serialize;
    /// The largest JSON body accepted (gRPC's framing not counted).
    const BODY_BYTES: usize;
    /// The name of its span when traces are on ([`crate::trace`]); `None`: not traced.
    const SPAN: Option<&'static str> = None;

    /// Validates and decides one admitted request (a decoding error is answered as it is).
    fn handle(
        api: &Api,
        raw: Result<Self::Raw, InvalidArgument>,
    ) -> impl Future<Output = Result<Self::Answer, ApiError>> + Send;
}

/// An operation with a gRPC method: its request and answer in protobuf.
pub trait GrpcOperation: Operation {
    /// The request message.
    type Request;
    /// The answer message.
    type Response;

    /// Converts a decoded request. Protobuf cannot tell an absent scalar from zero; zero values
    /// are passed on and rejected by validation with the field's name.
    fn from_pb(req: Self::Request) -> Result<Self::Raw, InvalidArgument>;

    /// Encodes an answer.
    fn to_pb(answer: &Self::Answer) -> Self::Response;
}

/// `POST /v1/<operation>`: admitted (token first, the body within the operation's bound and the
/// body timeout, then a permit or an immediate 503), decoded, decided, counted.
async fn http<Op: Operation>(State(api): State<Arc<Api>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let call = async {
        match api.admit(&parts.headers, body, Op::BODY_BYTES, 0).await {
            Ok((bytes, _permit)) => Op::handle(&api, json::decode(&bytes)).await,
            Err(e) => Err(e),
        }
    };
    let result = match Op::SPAN {
        Some(name) => trace::traced(name, trace::Parent::of_headers(&parts.headers), call).await,
        None => call.await,
    };
    answer(&api, result)
}

/// A request that failed decoding or validation (`what` names its operation in the log): logged
/// at debug level, answered 400 / `INVALID_ARGUMENT`.
fn invalid(what: &'static str, e: InvalidArgument) -> ApiError {
    tracing::debug!(error = %e, "invalid {what}");
    ApiError::Invalid(e)
}

/// The JSON routes of every operation.
pub fn routes() -> Router<Arc<Api>> {
    Router::new()
        .route("/v1/take", post(http::<take::Take>))
        .route("/v1/take_batch", post(http::<batch::Batch>))
        .route("/v1/acquire", post(http::<acquire::Acquire>))
        .route("/v1/release", post(http::<release::Release>))
        .route("/v1/refund", post(http::<refund::Refund>))
        .route("/v1/settle", post(http::<settle::Settle>))
        .route("/v1/buckets", get(buckets::http_inspect))
        .route("/v1/buckets/reset", post(buckets::http_reset))
}

/// One gRPC call, admitted before it reached tonic: decided and counted.
async fn grpc<Op: GrpcOperation>(
    api: &Api,
    request: tonic::Request<Op::Request>,
) -> Result<tonic::Response<Op::Response>, Status> {
    let (metadata, _, message) = request.into_parts();
    grpc_message::<Op>(api, trace::Parent::of_metadata(&metadata), Ok(message))
        .await
        .map(tonic::Response::new)
        .map_err(|e| status_of(&e))
}

/// One admitted gRPC message of `Op` (a unary call's, or one on a stream, whose decoding error
/// is answered as a call's), its span a child of `parent`: decided, and counted as one call of
/// `Op`.
async fn grpc_message<Op: GrpcOperation>(
    api: &Api,
    parent: trace::Parent<'_>,
    message: Result<Op::Request, InvalidArgument>,
) -> Result<Op::Response, ApiError> {
    let call = Op::handle(api, message.and_then(Op::from_pb));
    let result = match Op::SPAN {
        Some(name) => trace::traced(name, parent, call).await,
        None => call.await,
    };
    match result {
        Ok(a) => {
            api.metrics.request("grpc", "ok");
            Ok(Op::to_pb(&a))
        }
        Err(e) => {
            api.metrics.request("grpc", e.code());
            Err(e)
        }
    }
}

/// The tonic service of `tollgate.v1.RateLimiter`.
pub struct RateLimiterService {
    api: Arc<Api>,
}

impl RateLimiterService {
    /// Wraps the shared API.
    pub fn new(api: Arc<Api>) -> Self {
        RateLimiterService { api }
    }
}

/// Reached only through [`crate::router::router`], after [`Api::admit`] (token, bounded body,
/// permit). `TakeStream` never reaches it: the router hands the stream to [`stream::respond`],
/// which reads the messages from the body itself, to decode each on its own.
#[tonic::async_trait]
impl pb::rate_limiter_server::RateLimiter for RateLimiterService {
    type TakeStreamStream = stream::Answers;

    async fn take(
        &self,
        request: tonic::Request<pb::TakeRequest>,
    ) -> Result<tonic::Response<pb::TakeResponse>, Status> {
        grpc::<take::Take>(&self.api, request).await
    }

    async fn take_batch(
        &self,
        request: tonic::Request<pb::TakeBatchRequest>,
    ) -> Result<tonic::Response<pb::TakeBatchResponse>, Status> {
        grpc::<batch::Batch>(&self.api, request).await
    }

    /// Never called (see above): the generated server would have decoded every message already,
    /// and ended the stream at the first that does not decode.
    async fn take_stream(
        &self,
        _request: tonic::Request<tonic::Streaming<pb::TakeBatchRequest>>,
    ) -> Result<tonic::Response<Self::TakeStreamStream>, Status> {
        Err(Status::unimplemented(
            "TakeStream is served by the router (ops/stream.rs)",
        ))
    }

    async fn acquire(
        &self,
        request: tonic::Request<pb::AcquireRequest>,
    ) -> Result<tonic::Response<pb::AcquireResponse>, Status> {
        grpc::<acquire::Acquire>(&self.api, request).await
    }

    async fn release(
        &self,
        request: tonic::Request<pb::ReleaseRequest>,
    ) -> Result<tonic::Response<pb::ReleaseResponse>, Status> {
        grpc::<release::Release>(&self.api, request).await
    }

    async fn settle(
        &self,
        request: tonic::Request<pb::SettleRequest>,
    ) -> Result<tonic::Response<pb::SettleResponse>, Status> {
        grpc::<settle::Settle>(&self.api, request).await
    }
}

/// What Envoy's RLS endpoint ([`crate::rls`]) may ask of the service: a take of buckets it built
/// itself (any number of them), a settlement, and the metrics to count them in. Nothing else of
/// [`Api`] reaches it.
pub trait Decide: Send + Sync + 'static {
    /// Decides validated buckets in one store call ([`take::take_specs`]).
    fn take_specs(
        &self,
        specs: &[BucketSpec],
    ) -> impl Future<Output = Result<TakeResponse, ApiError>> + Send;

    /// Validates and applies a settlement, as `POST /v1/settle` does.
    fn settle(
        &self,
        raw: settle::RawSettle,
    ) -> impl Future<Output = Result<SettleResponse, ApiError>> + Send;

    /// The counters every answer is counted in.
    fn metrics(&self) -> &Metrics;
}

impl Decide for Api {
    fn take_specs(
        &self,
        specs: &[BucketSpec],
    ) -> impl Future<Output = Result<TakeResponse, ApiError>> + Send {
        take::take_specs(self, specs)
    }

    fn settle(
        &self,
        raw: settle::RawSettle,
    ) -> impl Future<Output = Result<SettleResponse, ApiError>> + Send {
        <settle::Settle as Operation>::handle(self, Ok(raw))
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}
