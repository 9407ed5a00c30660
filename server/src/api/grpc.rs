//! The gRPC form: `tollgate.v1.RateLimiter/Take`, types generated at build time from
//! `contract/tollgate.proto` (protox + tonic-prost-build, no protoc).

use std::marker::PhantomData;
use std::sync::Arc;

use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::{Request, Response, Status};
use tonic_prost::{ProstDecoder, ProstEncoder};

use super::{Api, ApiError};
use crate::domain::{Algorithm, BucketDecision, InvalidArgument, RawBucket, RawTake, TakeDecision};

/// Generated protobuf messages, server and client.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("tollgate.v1");
}

/// prost's codec, except that a body that does not decode is `INVALID_ARGUMENT` (the caller's
/// fault), not `INTERNAL`.
#[derive(Debug, Clone)]
pub struct StrictCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for StrictCodec<T, U> {
    fn default() -> Self {
        StrictCodec { _pd: PhantomData }
    }
}

/// The decoder of [`StrictCodec`].
#[derive(Debug, Clone, Default)]
pub struct StrictDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default> Decoder for StrictDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf)
            .map(Some)
            .map_err(|e| Status::invalid_argument(format!("malformed protobuf: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

impl<T, U> Codec for StrictCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = StrictDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        StrictDecoder(ProstDecoder::new(BufferSettings::default()))
    }
}

/// Converts a decoded protobuf request. Protobuf cannot tell an absent scalar from zero; zero
/// values are passed on and rejected by validation with the field's name.
pub fn raw_from_pb(req: &pb::TakeRequest) -> Result<RawTake, InvalidArgument> {
    let mut buckets = Vec::with_capacity(req.buckets.len());
    for (i, b) in req.buckets.iter().enumerate() {
        let algorithm = match pb::Algorithm::try_from(b.algorithm) {
            Ok(pb::Algorithm::TokenBucket) => Algorithm::TokenBucket,
            Ok(pb::Algorithm::FixedWindow) => Algorithm::FixedWindow,
            Err(_) => {
                return Err(InvalidArgument::new(
                    format!("buckets[{i}].algorithm"),
                    format!("unknown algorithm {}", b.algorithm),
                ))
            }
        };
        buckets.push(RawBucket {
            key: Some(b.key.clone()),
            capacity: Some(b.capacity),
            rate: b.rate,
            period_ms: Some(b.period_ms),
            cost: b.cost,
            algorithm: Some(algorithm),
            lease: b.lease,
        });
    }
    Ok(RawTake {
        buckets: Some(buckets),
    })
}

/// Encodes a request as protobuf (tests and the load generator).
pub fn pb_from_raw(raw: &RawTake) -> pb::TakeRequest {
    pb::TakeRequest {
        buckets: raw
            .buckets
            .iter()
            .flatten()
            .map(|b| pb::Bucket {
                key: b.key.clone().unwrap_or_default(),
                capacity: b.capacity.unwrap_or(0),
                rate: b.rate,
                period_ms: b.period_ms.unwrap_or(0),
                cost: b.cost,
                algorithm: match b.algorithm.unwrap_or(Algorithm::TokenBucket) {
                    Algorithm::TokenBucket => pb::Algorithm::TokenBucket as i32,
                    Algorithm::FixedWindow => pb::Algorithm::FixedWindow as i32,
                },
                lease: b.lease,
            })
            .collect(),
    }
}

/// Encodes a decision as protobuf.
pub fn pb_from_decision(d: &TakeDecision) -> pb::TakeResponse {
    pb::TakeResponse {
        allowed: d.allowed,
        buckets: d
            .buckets
            .iter()
            .map(|b| pb::BucketResult {
                allowed: b.allowed,
                limit: b.limit,
                remaining: b.remaining,
                reset_ms: b.reset_ms,
                retry_after_ms: b.retry_after_ms,
                granted: b.granted,
            })
            .collect(),
    }
}

/// Decodes a protobuf decision.
pub fn decision_from_pb(r: &pb::TakeResponse) -> TakeDecision {
    TakeDecision {
        allowed: r.allowed,
        buckets: r
            .buckets
            .iter()
            .map(|b| BucketDecision {
                allowed: b.allowed,
                limit: b.limit,
                remaining: b.remaining,
                reset_ms: b.reset_ms,
                retry_after_ms: b.retry_after_ms,
                granted: b.granted,
            })
            .collect(),
    }
}

/// The tonic service.
pub struct RateLimiterService {
    api: Arc<Api>,
}

impl RateLimiterService {
    /// Wraps the shared API.
    pub fn new(api: Arc<Api>) -> Self {
        RateLimiterService { api }
    }
}

/// A gRPC status for an API error.
pub fn status_of(e: &ApiError) -> Status {
    match e {
        ApiError::Invalid(_) => Status::invalid_argument(e.message()),
        ApiError::Unauthenticated => Status::unauthenticated(e.message()),
        ApiError::Unavailable(_) => Status::unavailable(e.message()),
    }
}

#[tonic::async_trait]
impl pb::rate_limiter_server::RateLimiter for RateLimiterService {
    async fn take(
        &self,
        request: Request<pb::TakeRequest>,
    ) -> Result<Response<pb::TakeResponse>, Status> {
        let auth = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes().to_vec());
        let raw = raw_from_pb(request.get_ref());
        let result = self.api.take(auth.as_deref(), raw).await;
        match result {
            Ok(d) => {
                self.api.metrics.request("grpc", "ok");
                Ok(Response::new(pb_from_decision(&d)))
            }
            Err(e) => {
                self.api.metrics.request("grpc", e.code());
                Err(status_of(&e))
            }
        }
    }
}
