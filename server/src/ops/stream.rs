//! `take_stream`: batches as messages on one bidirectional gRPC stream,
//! `tollgate.v1.RateLimiter/TakeStream` (contract/README.md, "Batches on a stream"). A proxy keeps
//! one open per worker, because a message on an open stream costs Envoy about a third of what a
//! unary call costs.
//!
//! The router hands the stream here with its body still streaming ([`respond`]). Its messages are
//! read from the body by [`Api::stream_messages`] (`api/frames.rs`), not by the generated server,
//! which would decode every message with the strict codec and end the stream at the first that
//! does not decode. Every message is a `TakeBatchRequest` with an id, decided by [`Batch`]'s
//! [`super::Operation::handle`] as a `TakeBatch` call with that body would be, counted as one such
//! call, and answered by one `TakeBatchResponse` carrying its id: its results, or its error (the
//! stream goes on). What stands in front of it:
//!
//! | check | where | refused with |
//! |---|---|---|
//! | the token, once, from the stream's headers | `router.rs`, [`Api::admit_token`] | `UNAUTHENTICATED`, before any message is read |
//! | each message's length prefix, at most [`MAX_BATCH_BYTES`], uncompressed | [`Api::stream_messages`], before the message is read | the stream ends: `RESOURCE_EXHAUSTED` (`INVALID_ARGUMENT` for a compression flag) |
//! | the bytes the stream holds of a message not yet whole, within what all streams may hold (`--stream-buffer-bytes`) | [`Api::stream_messages`] | the stream ends `UNAVAILABLE` (counted `buffer`) |
//! | a message that began to arrive is whole within `--body-timeout-ms` | [`Api::stream_messages`] | the stream ends `DEADLINE_EXCEEDED` (counted `deadline`) |
//! | its id (field 3) can be read | `message_id` | the stream ends `INVALID_ARGUMENT`: no answer could name the message |
//! | fewer than `--stream-max-in-flight` messages of the stream being decided | `Open::admit` | the message answered `UNAVAILABLE` at once (counted `in_flight`) |
//! | a permit of the take limiter while the message is decoded and decided | [`Api::permit`] | the message answered `UNAVAILABLE` at once, counted as shed |
//! | its bytes | [`crate::api::grpc::DecodeStrict`] (`batch.rs`), as a `TakeBatch` body: decoding stops at a 65th take or a 17th bucket | the message answered `INVALID_ARGUMENT`, the field named |
//! | the store | [`Api::store_call`] | the message answered `UNAVAILABLE` |
//!
//! A stream's messages are decided concurrently, each in a task of its own (its permit given back
//! as soon as it is decided, whether or not the client has read the answers before it), and
//! answered as each is decided, in any order. At its bound a stream's next message is answered
//! `UNAVAILABLE` at once rather than left unread, as the contract has every bound answer: the
//! proxy applies its failure mode now, not when its own deadline passes. A client that does not
//! read its answers is held back all the same: the stream reads its body only while its answers
//! are taken (HTTP/2 flow control then stops the client), and no more answers than the bound wait
//! to be sent. The bound's default, 64: [`crate::api::STREAM_MAX_IN_FLIGHT`].
//!
//! A message with id 0 is a client of the earlier contract, which matched answers by their order:
//! it is decided alone, the next message not read before it is answered, and an error that would
//! have been its answer ends the stream with that error's status instead.
//!
//! The stream ends at bytes that are not a message (above), the messages in flight then getting
//! no answer; at the client's half-close, with `OK` once every message received is answered; or
//! when the service shuts down ([`Api::shut_down`]): no message is read after it, the messages
//! being decided are answered, then the stream ends with `UNAVAILABLE`. An ending is logged at
//! debug level.
//!
//! **What a hostile client can make the service hold**, in all, whatever it sends (with the
//! token: without it a stream is refused before it holds anything):
//! - bytes HTTP/2 received that no stream has read yet: at most the connection window
//!   (`serve.rs`, 1 MiB) per connection, `--max-connections` (1,024) of them: 1 GiB at the
//!   defaults. A stream reads its body as the bytes arrive, so this fills only while one is not
//!   read: behind a message of id 0, or while its client does not read its answers;
//! - bytes the streams hold between two reads of their bodies: at most `--stream-buffer-bytes`
//!   (64 MiB, [`crate::api::STREAM_BUFFER_BYTES`]) in all, where the streams could otherwise hold
//!   a message of up to 1 MiB each, `--max-connections` × `--http2-max-streams` (131,072) of them;
//! - messages read whole and being decoded or decided: at most `--max-in-flight` (1,024, each
//!   holding a permit) of up to 1 MiB, as `TakeBatch` calls; and at most `--stream-max-in-flight`
//!   small answers per stream waiting to be sent;
//! - each open stream's own state (HTTP/2's, the task serving it, its answers' encoder), about
//!   20 KiB: 1,000 streams sending a length prefix alone add 18 to 22 MB
//!   (`tests/integration/hostile.rs`), and the streams are at most `--max-connections` ×
//!   `--http2-max-streams`.
//!
//! A message has no metadata of its own, so its span (`tollgate.batch`) has no parent
//! ([`crate::trace`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Response};
use futures_util::stream::{self, BoxStream, FuturesUnordered, StreamExt};
use tokio::sync::watch;
use tonic::codec::{BufferSettings, EncodeBody, SingleMessageCompressionOverride};
use tonic::Status;
use tonic_prost::ProstEncoder;

use super::batch::Batch;
use super::{grpc_message, invalid};
use crate::api::frames::{FrameError, Messages};
use crate::api::grpc::{malformed, message_error, pb, status_of, DecodeStrict};
use crate::api::{Api, ApiError};
use crate::domain::{InvalidArgument, MAX_BATCH_BYTES};
use crate::metrics::Metrics;
use crate::trace;

/// The answers of one stream, as tonic encodes them: one per message, then, when the stream ends
/// early, its status (an `Err` is the last item; the stream running out is `OK`).
pub type Answers = BoxStream<'static, Result<pb::TakeBatchResponse, Status>>;

/// What a stream's client is told when the service shuts down.
const SHUTTING_DOWN: &str = "the service is shutting down: open a new stream";

/// `TakeBatchRequest.id`'s field number (contract/tollgate.proto).
const ID_FIELD: u32 = 3;

/// The response to a stream whose token was checked ([`Api::admit_token`]): gRPC's headers, then
/// the answers to its messages, framed and ended with the stream's status in the trailers by
/// tonic's encoder, as the generated server would.
pub fn respond(api: Arc<Api>, body: Body) -> Response<tonic::body::Body> {
    let encoded = EncodeBody::new_server(
        ProstEncoder::new(BufferSettings::default()),
        answers(api, body),
        None,
        SingleMessageCompressionOverride::default(),
        None,
    );
    let mut response = Response::new(tonic::body::Body::new(encoded));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    response
}

/// The answers to the messages of the stream whose request body is `body`.
fn answers(api: Arc<Api>, body: Body) -> Answers {
    let open = Open {
        messages: api.stream_messages(body),
        deciding: FuturesUnordered::new(),
        shutdown: api.shutdown_signal(),
        input: Input::Reading,
        alone: false,
        ended: false,
        _counted: Counted::new(api.metrics.clone()),
        api,
    };
    Box::pin(stream::unfold(open, next))
}

/// A message being decided in its task: its id, then its answer.
type Deciding =
    Pin<Box<dyn Future<Output = (u64, Result<pb::TakeBatchResponse, ApiError>)> + Send>>;

/// What a stream holds between two answers.
struct Open {
    api: Arc<Api>,
    messages: Messages,
    /// Its messages being decided, at most `--stream-max-in-flight`.
    deciding: FuturesUnordered<Deciding>,
    shutdown: watch::Receiver<bool>,
    input: Input,
    /// A message of id 0 is being decided: nothing more is read before its answer.
    alone: bool,
    /// Its ending was handed out: nothing follows it.
    ended: bool,
    _counted: Counted,
}

/// Whether a stream's body is still read.
enum Input {
    Reading,
    /// The client ended its side between two messages.
    HalfClosed,
    /// The service is shutting down.
    ShuttingDown,
}

/// Counts its stream in `tollgate_streams_open` while it lives: until the stream ended, or its
/// response body was dropped (the client gone).
struct Counted(Arc<Metrics>);

impl Counted {
    fn new(metrics: Arc<Metrics>) -> Self {
        metrics.stream(true);
        Counted(metrics)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.stream(false);
    }
}

/// Why a stream ends before its client half-closed.
enum Ending {
    /// Bytes that are not a message, or a message of id 0 refused or not decided, with the error
    /// a `TakeBatch` call would have had (counted as such).
    Failed(ApiError),
    /// The client's side broke while its body was read: not counted, as with a unary call.
    Unread(Status),
    /// The service is shutting down.
    ShuttingDown,
}

impl Ending {
    fn status(&self) -> Status {
        match self {
            Ending::Failed(e) => status_of(e),
            Ending::Unread(s) => s.clone(),
            Ending::ShuttingDown => Status::unavailable(SHUTTING_DOWN),
        }
    }
}

/// The stream's next item: the next answer, or its ending (once).
async fn next(mut open: Open) -> Option<(Result<pb::TakeBatchResponse, Status>, Open)> {
    if open.ended {
        return None;
    }
    match open.answer_next().await? {
        Ok(answer) => Some((Ok(answer), open)),
        Err(ending) => {
            let status = ending.status();
            tracing::debug!(code = ?status.code(), message = status.message(), "stream ended");
            open.ended = true;
            Some((Err(status), open))
        }
    }
}

impl Open {
    /// Reads and admits messages until one is answered; `None` once the client half-closed and
    /// every message is answered.
    async fn answer_next(&mut self) -> Option<Result<pb::TakeBatchResponse, Ending>> {
        loop {
            let reading = matches!(self.input, Input::Reading) && !self.alone;
            if !reading && self.deciding.is_empty() {
                match self.input {
                    Input::HalfClosed => return None,
                    Input::ShuttingDown => return Some(Err(Ending::ShuttingDown)),
                    // Not reading while reading: only behind a message of id 0 being decided.
                    Input::Reading => {}
                }
            }
            tokio::select! {
                // Answers first; then, between two reads, the shutdown (the messages being
                // decided are not raced against it: they are answered, and then it ends the
                // stream).
                biased;
                Some((id, answer)) = self.deciding.next(), if !self.deciding.is_empty() => {
                    if id == 0 {
                        self.alone = false;
                        return Some(answer.map_err(Ending::Failed));
                    }
                    return Some(Ok(answered(id, answer)));
                }
                () = shutting_down(&mut self.shutdown), if reading => {
                    self.input = Input::ShuttingDown;
                }
                read = self.messages.next(), if reading => match read {
                    Ok(Some(message)) => {
                        if let Some(answer) = self.admit(message) {
                            return Some(answer);
                        }
                    }
                    Ok(None) => self.input = Input::HalfClosed,
                    Err(e) => return Some(Err(self.unread(e))),
                },
            }
        }
    }

    /// A message read whole: its id read, then decided in a task of its own (`None`: no answer
    /// yet), or answered at once when the stream's bound or the take limit is reached.
    fn admit(&mut self, message: Bytes) -> Option<Result<pb::TakeBatchResponse, Ending>> {
        let id = match message_id(&message) {
            Ok(id) => id,
            Err(e) => {
                let e = invalid("stream message", e);
                self.api.metrics.request("grpc", e.code());
                return Some(Err(Ending::Failed(e)));
            }
        };
        let bound = self.api.stream_max_in_flight;
        let permit = if self.deciding.len() >= bound {
            self.api.metrics.stream_refused("in_flight");
            Err(ApiError::StreamBusy(bound))
        } else {
            self.api.permit()
        };
        let permit = match permit {
            Ok(p) => p,
            Err(e) => {
                self.api.metrics.request("grpc", e.code());
                return Some(if id == 0 {
                    Err(Ending::Failed(e))
                } else {
                    Ok(answered(id, Err(e)))
                });
            }
        };
        let api = self.api.clone();
        let task = tokio::spawn(async move {
            let message = pb::TakeBatchRequest::decode_strict(&message);
            let answer = grpc_message::<Batch>(&api, trace::Parent::default(), message).await;
            drop(permit);
            answer
        });
        self.deciding.push(Box::pin(async move {
            // A task fails only by a panic (a bug); its message is answered all the same.
            let answer = task.await.unwrap_or(Err(ApiError::Unavailable(
                "the message could not be decided",
            )));
            (id, answer)
        }));
        self.alone = id == 0;
        None
    }

    /// Why the body yields no more messages, as the error a `TakeBatch` call would have had where
    /// there is one, counted as such (a bound's refusal also as that bound's).
    fn unread(&self, e: FrameError) -> Ending {
        let metrics = &self.api.metrics;
        let e = match e {
            FrameError::TooLarge => ApiError::TooLarge(MAX_BATCH_BYTES),
            FrameError::Compressed => ApiError::Invalid(InvalidArgument::new(
                "",
                "a compressed message, but no grpc-encoding is accepted",
            )),
            FrameError::CutShort => ApiError::Invalid(InvalidArgument::new(
                "",
                "the stream ended inside a message",
            )),
            FrameError::Budget(bytes) => {
                metrics.stream_refused("buffer");
                ApiError::BufferFull(bytes)
            }
            FrameError::Deadline => {
                metrics.stream_refused("deadline");
                let ms = u64::try_from(self.api.body_timeout.as_millis()).unwrap_or(u64::MAX);
                ApiError::BodyTimeout(ms)
            }
            FrameError::Read(e) => {
                return Ending::Unread(Status::unknown(format!("cannot read the stream: {e}")))
            }
        };
        metrics.request("grpc", e.code());
        Ending::Failed(e)
    }
}

/// Completes once the service began to shut down.
async fn shutting_down(signal: &mut watch::Receiver<bool>) {
    // An error: the sender is gone with the `Api`, which the stream holds; never.
    let _ = signal.wait_for(|down| *down).await;
}

/// A message's answer with its id: its results, or its error (`TakeBatchResponse.error`).
fn answered(id: u64, answer: Result<pb::TakeBatchResponse, ApiError>) -> pb::TakeBatchResponse {
    match answer {
        Ok(results) => pb::TakeBatchResponse { id, ..results },
        Err(e) => pb::TakeBatchResponse {
            id,
            error: Some(message_error(&e)),
            ..Default::default()
        },
    }
}

/// A message's id (`TakeBatchRequest.id`), read without decoding the rest: the last one before
/// the message's end, or before its first bytes that are not protobuf (the message is then
/// answered `INVALID_ARGUMENT` under it); 0 when it has none. An error when the bytes stop being
/// protobuf before an id was read: no answer could name the message.
fn message_id(mut bytes: &[u8]) -> Result<u64, InvalidArgument> {
    use prost::encoding::{decode_key, decode_varint, skip_field, DecodeContext, WireType};
    let mut id = None;
    while !bytes.is_empty() {
        let step = decode_key(&mut bytes).and_then(|(tag, wire_type)| {
            if tag == ID_FIELD && wire_type == WireType::Varint {
                decode_varint(&mut bytes).map(Some)
            } else {
                skip_field(wire_type, tag, &mut bytes, DecodeContext::default()).map(|()| None)
            }
        });
        match step {
            Ok(Some(v)) => id = Some(v),
            Ok(None) => {}
            Err(e) => return id.ok_or_else(|| malformed(&e)),
        }
    }
    Ok(id.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_is_read_as_far_as_the_bytes_are_protobuf() {
        // `18 07`: field 3, varint 7; `0a 00`: an empty take.
        assert_eq!(message_id(&[0x0a, 0x00, 0x18, 0x07]).ok(), Some(7));
        assert_eq!(message_id(&[0x0a, 0x00]).ok(), Some(0));
        assert_eq!(message_id(&[]).ok(), Some(0));
        // The last one wins, as prost reads it.
        assert_eq!(message_id(&[0x18, 0x07, 0x18, 0x09]).ok(), Some(9));
        // Garbage after the id: the id; before it, none.
        assert_eq!(message_id(&[0x18, 0x07, 0xff, 0xff, 0xff]).ok(), Some(7));
        assert!(message_id(&[0xff, 0xff, 0xff, 0x18, 0x07]).is_err());
        // A take running past the end hides the id behind it.
        assert!(message_id(&[0x0a, 0x09, 0x00, 0x18, 0x07]).is_err());
        // The largest id.
        let mut max = vec![0x18];
        max.extend_from_slice(&[0xff; 9]);
        max.push(0x01);
        assert_eq!(message_id(&max).ok(), Some(u64::MAX));
    }
}
