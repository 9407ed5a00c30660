//! The gRPC form: `tollgate.v1.RateLimiter/Take` and `TakeBatch`, types generated at build time from
//! `contract/tollgate.proto` (protox + tonic-prost-build, no protoc).

use std::marker::PhantomData;
use std::sync::Arc;

use prost::bytes::Buf;
use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::{Request, Response, Status};
use tonic_prost::{ProstDecoder, ProstEncoder};

use super::ApiError;
use crate::api::Api;
use crate::domain::{
    Algorithm, BucketResult, InvalidArgument, RawBatch, RawBucket, RawTake, TakeResponse,
    MAX_BATCH_TAKES, MAX_BUCKETS,
};

/// Generated protobuf messages, server and client.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("tollgate.v1");
}

fn malformed(e: &dyn std::fmt::Display) -> InvalidArgument {
    InvalidArgument::new("", format!("malformed protobuf: {e}"))
}

/// Walks the top-level fields of a message in constant memory, calling `on_one` with the index
/// and payload of every field 1 (length-delimited; other wire types get an empty payload, and
/// prost refuses them later). More than `max` of them stop the walk with `too_many()`.
fn scan_field_one(
    bytes: &[u8],
    max: usize,
    too_many: impl Fn() -> InvalidArgument,
    mut on_one: impl FnMut(usize, &[u8]) -> Result<(), InvalidArgument>,
) -> Result<(), InvalidArgument> {
    use prost::encoding::{decode_key, decode_varint, WireType};
    let mut buf = bytes;
    let mut seen = 0usize;
    while !buf.is_empty() {
        let (tag, wire_type) = decode_key(&mut buf).map_err(|e| malformed(&e))?;
        if tag == 1 {
            if seen == max {
                return Err(too_many());
            }
            seen += 1;
        }
        let skip = match wire_type {
            WireType::Varint => {
                decode_varint(&mut buf).map_err(|e| malformed(&e))?;
                0
            }
            WireType::SixtyFourBit => 8,
            WireType::ThirtyTwoBit => 4,
            WireType::LengthDelimited => {
                let len = decode_varint(&mut buf).map_err(|e| malformed(&e))?;
                usize::try_from(len).unwrap_or(usize::MAX)
            }
            WireType::StartGroup | WireType::EndGroup => {
                return Err(malformed(&"groups are not part of this contract"))
            }
        };
        let payload = buf
            .get(..skip)
            .ok_or_else(|| malformed(&"a field runs past the end"))?;
        if tag == 1 && wire_type == WireType::LengthDelimited {
            on_one(seen - 1, payload)?;
        }
        buf = &buf[skip..];
    }
    Ok(())
}

/// Checks a `TakeRequest`'s bucket count without building it: a 17th bucket stops the walk.
fn scan_take(bytes: &[u8]) -> Result<(), InvalidArgument> {
    scan_field_one(
        bytes,
        MAX_BUCKETS,
        || {
            InvalidArgument::new(
                "buckets",
                format!("must hold at most {MAX_BUCKETS} buckets (decoding stopped at the 17th)"),
            )
        },
        |_, _| Ok(()),
    )
}

/// Decodes a `TakeRequest` message (protobuf bytes, without gRPC's 5-byte frame header): a pure
/// function over the bytes. The top-level fields are scanned first, in constant memory, and a
/// 17th bucket stops the decoding there; only then does prost build the message (at most 16
/// buckets, each no larger than the input).
pub fn decode_take_message(bytes: &[u8]) -> Result<pb::TakeRequest, InvalidArgument> {
    scan_take(bytes)?;
    pb::TakeRequest::decode(bytes).map_err(|e| malformed(&e))
}

/// Decodes a `TakeBatchRequest` message as [`decode_take_message`] decodes a take: the takes are
/// scanned first (a 65th take, or a 17th bucket in any take, stops the decoding there, the
/// latter named `takes[i].buckets`); only then does prost build the message.
pub fn decode_batch_message(bytes: &[u8]) -> Result<pb::TakeBatchRequest, InvalidArgument> {
    scan_field_one(
        bytes,
        MAX_BATCH_TAKES,
        || {
            InvalidArgument::new(
                "takes",
                format!("must hold at most {MAX_BATCH_TAKES} takes (decoding stopped at the 65th)"),
            )
        },
        |i, take| scan_take(take).map_err(|e| e.within_take(i)),
    )?;
    pb::TakeBatchRequest::decode(bytes).map_err(|e| malformed(&e))
}

/// Decodes a `TakeBatchRequest` message into the domain's [`RawBatch`].
pub fn decode_batch(bytes: &[u8]) -> Result<RawBatch, InvalidArgument> {
    decode_batch_message(bytes).and_then(|m| raw_batch_from_pb(&m))
}

/// Decodes a `TakeRequest` message into the domain's [`RawTake`]: [`decode_take_message`], then
/// [`raw_from_pb`]. The protobuf counterpart of [`crate::api::json::decode_take`].
pub fn decode_take(bytes: &[u8]) -> Result<RawTake, InvalidArgument> {
    decode_take_message(bytes).and_then(|m| raw_from_pb(&m))
}

/// prost's codec for responses; requests go through [`decode_take_message`], so a body that does
/// not decode is `INVALID_ARGUMENT` (the caller's fault), not `INTERNAL`, and a 17th bucket is
/// never decoded.
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

/// A message type that [`StrictDecoder`] reads from bytes.
pub trait DecodeStrict: Sized {
    /// Decodes one message.
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument>;
}

impl DecodeStrict for pb::TakeRequest {
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
        decode_take_message(bytes)
    }
}

impl DecodeStrict for pb::TakeBatchRequest {
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
        decode_batch_message(bytes)
    }
}

impl DecodeStrict for pb::TakeBatchResponse {
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
        pb::TakeBatchResponse::decode(bytes).map_err(|e| malformed(&e))
    }
}

impl DecodeStrict for pb::TakeResponse {
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
        pb::TakeResponse::decode(bytes)
            .map_err(|e| InvalidArgument::new("", format!("malformed protobuf: {e}")))
    }
}

impl<U: DecodeStrict + Message + Default> Decoder for StrictDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // The body was read whole (and bounded) before tonic saw it: one contiguous copy.
        let bytes = buf.copy_to_bytes(buf.remaining());
        U::decode_strict(&bytes)
            .map(Some)
            .map_err(|e| Status::invalid_argument(e.to_string()))
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

impl<T, U> Codec for StrictCodec<T, U>
where
    T: Message + Send + 'static,
    U: DecodeStrict + Message + Default + Send + 'static,
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
        let algorithm = algorithm_from_pb(i, b.algorithm)?;
        buckets.push(RawBucket {
            key: Some(b.key.clone()),
            capacity: Some(b.capacity),
            rate: b.rate,
            period_ms: Some(b.period_ms),
            cost: b.cost,
            algorithm: Some(algorithm),
            lease: b.lease,
            rule: non_empty(&b.rule),
        });
    }
    Ok(RawTake {
        buckets: Some(buckets),
        instance: non_empty(&req.instance),
    })
}

/// The algorithm of bucket `i` from its `tollgate.v1.Algorithm` value.
pub fn algorithm_from_pb(i: usize, code: i32) -> Result<Algorithm, InvalidArgument> {
    Algorithm::from_code(code).ok_or_else(|| {
        InvalidArgument::new(
            format!("buckets[{i}].algorithm"),
            format!("unknown algorithm {code}"),
        )
    })
}

/// Protobuf's empty string is "not sent".
fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

/// Converts a decoded protobuf batch: each take as [`raw_from_pb`] converts one, its errors named
/// from the batch.
pub fn raw_batch_from_pb(req: &pb::TakeBatchRequest) -> Result<RawBatch, InvalidArgument> {
    let takes = req
        .takes
        .iter()
        .enumerate()
        .map(|(i, t)| raw_from_pb(t).map_err(|e| e.within_take(i)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(RawBatch {
        takes: Some(takes),
        instance: non_empty(&req.instance),
    })
}

/// Encodes a batch request as protobuf (tests and the load generator).
pub fn pb_batch_from_raw(raw: &RawBatch) -> pb::TakeBatchRequest {
    pb::TakeBatchRequest {
        takes: raw.takes.iter().flatten().map(pb_from_raw).collect(),
        instance: raw.instance.clone().unwrap_or_default(),
    }
}

/// Encodes a batch's decisions as protobuf.
pub fn pb_from_batch(ds: &[TakeResponse]) -> pb::TakeBatchResponse {
    pb::TakeBatchResponse {
        results: ds.iter().map(pb_from_decision).collect(),
    }
}

/// Decodes a protobuf batch response.
pub fn batch_from_pb(r: &pb::TakeBatchResponse) -> Vec<TakeResponse> {
    r.results.iter().map(decision_from_pb).collect()
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
                algorithm: b.algorithm.unwrap_or_default().code(),
                lease: b.lease,
                rule: b.rule.clone().unwrap_or_default(),
            })
            .collect(),
        instance: raw.instance.clone().unwrap_or_default(),
    }
}

/// Encodes a decision as protobuf.
pub fn pb_from_decision(d: &TakeResponse) -> pb::TakeResponse {
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
        instances: d.instances,
    }
}

/// Decodes a protobuf decision.
pub fn decision_from_pb(r: &pb::TakeResponse) -> TakeResponse {
    TakeResponse {
        allowed: r.allowed,
        buckets: r
            .buckets
            .iter()
            .map(|b| BucketResult {
                allowed: b.allowed,
                limit: b.limit,
                remaining: b.remaining,
                reset_ms: b.reset_ms,
                retry_after_ms: b.retry_after_ms,
                granted: b.granted,
            })
            .collect(),
        instances: r.instances,
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
        ApiError::TooLarge(_) => Status::resource_exhausted(e.message()),
        ApiError::BodyTimeout(_) => Status::deadline_exceeded(e.message()),
        ApiError::Overloaded(_) | ApiError::Unavailable(_) => Status::unavailable(e.message()),
    }
}

/// Reached only through [`crate::api::http::router`], after [`Api::admit`] (token, bounded body,
/// permit).
#[tonic::async_trait]
impl pb::rate_limiter_server::RateLimiter for RateLimiterService {
    async fn take(
        &self,
        request: Request<pb::TakeRequest>,
    ) -> Result<Response<pb::TakeResponse>, Status> {
        let raw = raw_from_pb(request.get_ref());
        match self.api.take(raw).await {
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

    async fn take_batch(
        &self,
        request: Request<pb::TakeBatchRequest>,
    ) -> Result<Response<pb::TakeBatchResponse>, Status> {
        let raw = raw_batch_from_pb(request.get_ref());
        match self.api.take_batch(raw).await {
            Ok(ds) => {
                self.api.metrics.request("grpc", "ok");
                Ok(Response::new(pb_from_batch(&ds)))
            }
            Err(e) => {
                self.api.metrics.request("grpc", e.code());
                Err(status_of(&e))
            }
        }
    }

    async fn acquire(
        &self,
        request: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::AcquireResponse>, Status> {
        let raw = crate::inflight::raw_acquire_from_pb(request.get_ref());
        self.answer(
            self.api
                .acquire(Ok(raw))
                .await
                .map(|d| crate::inflight::pb_from_acquire(&d)),
        )
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let raw = crate::inflight::raw_release_from_pb(request.get_ref());
        self.answer(
            self.api
                .release(Ok(raw))
                .await
                .map(|d| pb::ReleaseResponse {
                    released: d.released,
                }),
        )
    }

    async fn settle(
        &self,
        request: Request<pb::SettleRequest>,
    ) -> Result<Response<pb::SettleResponse>, Status> {
        let raw = super::settle::raw_settle_from_pb(request.get_ref());
        self.answer(
            self.api
                .settle(raw)
                .await
                .map(|d| super::settle::pb_from_settle(&d)),
        )
    }
}

impl RateLimiterService {
    /// Counts and converts a result of the slot operations.
    fn answer<T>(&self, result: Result<T, ApiError>) -> Result<Response<T>, Status> {
        match result {
            Ok(m) => {
                self.api.metrics.request("grpc", "ok");
                Ok(Response::new(m))
            }
            Err(e) => {
                self.api.metrics.request("grpc", e.code());
                Err(status_of(&e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding_stops_at_the_seventeenth_bucket() {
        // `0a 00`: field 1 (buckets), length 0: an empty bucket.
        let sixteen = [0x0a, 0x00].repeat(16);
        assert_eq!(
            decode_take(&sixteen).map(|r| r.buckets.map(|b| b.len())),
            Ok(Some(16))
        );
        // Two million of them: refused at the 17th, whatever follows.
        let mut huge = [0x0a, 0x00].repeat(2_000_000);
        huge.extend_from_slice(&[0xff; 3]);
        let e = decode_take(&huge).err();
        assert_eq!(
            e.as_ref().map(|e| e.field.as_str()),
            Some("buckets"),
            "{e:?}"
        );
        // Other fields do not count: unknown ones are skipped as prost would.
        let mut other = [0x18, 0x05].repeat(40);
        other.extend_from_slice(&[0x0a, 0x00]);
        assert_eq!(
            decode_take(&other).map(|r| r.buckets.map(|b| b.len())),
            Ok(Some(1))
        );
    }

    #[test]
    fn batch_decoding_stops_at_the_sixty_fifth_take() {
        // `0a 02 0a 00`: field 1 (takes), length 2: a take of one empty bucket.
        let ok = [0x0a, 0x02, 0x0a, 0x00].repeat(64);
        assert_eq!(
            decode_batch(&ok).map(|r| r.takes.map(|t| t.len())),
            Ok(Some(64))
        );
        let mut huge = [0x0a, 0x02, 0x0a, 0x00].repeat(100_000);
        huge.extend_from_slice(&[0xff; 3]);
        let e = decode_batch(&huge).err();
        assert_eq!(e.as_ref().map(|e| e.field.as_str()), Some("takes"), "{e:?}");
        // A 17th bucket in take 2 is found before prost builds anything.
        let mut bad = [0x0a, 0x02, 0x0a, 0x00].repeat(2);
        bad.extend_from_slice(&[0x0a, 34]);
        bad.extend_from_slice(&[0x0a, 0x00].repeat(17));
        let e = decode_batch(&bad).err();
        assert_eq!(
            e.as_ref().map(|e| e.field.as_str()),
            Some("takes[2].buckets"),
            "{e:?}"
        );
        // A bad algorithm is named from the batch.
        let mut alg = [0x0a, 0x02, 0x0a, 0x00].to_vec();
        alg.extend_from_slice(&[0x0a, 0x04, 0x0a, 0x02, 0x30, 0x07]);
        let e = decode_batch(&alg).err();
        assert_eq!(
            e.as_ref().map(|e| e.field.as_str()),
            Some("takes[1].buckets[0].algorithm"),
            "{e:?}"
        );
    }

    #[test]
    fn malformed_bytes_are_invalid_arguments() {
        for bytes in [
            &[0x0a][..],               // a tag and no length
            &[0x0a, 0x05, 0x00],       // a length past the end
            &[0x0b, 0x0c],             // a group
            &[0xff; 11],               // a varint that never ends
            &[0x0a, 0x02, 0x08, 0xff], // a bucket whose field is cut
        ] {
            let e = decode_take(bytes).err();
            assert!(
                e.as_ref()
                    .is_some_and(|e| e.message.starts_with("malformed protobuf")),
                "{bytes:02x?}: {e:?}"
            );
        }
    }
}
