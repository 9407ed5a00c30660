//! `take_stream`: batches as messages on one bidirectional gRPC stream,
//! `tollgate.v1.RateLimiter/TakeStream` (contract/README.md, "Batches on a stream"). A proxy keeps
//! one open per worker, because a message on an open stream costs Envoy about a third of what a
//! unary call costs.
//!
//! Every message is a `TakeBatchRequest`, decided by [`Batch`]'s [`super::Operation::handle`] as a
//! `TakeBatch` call with that body would be, counted as one such call, and answered by one
//! `TakeBatchResponse`. What stands in front of it:
//!
//! | check | where | refused with |
//! |---|---|---|
//! | the token, once, from the stream's headers | `router.rs`, [`Api::admit_token`] | `UNAUTHENTICATED`, before any message is read |
//! | each message's length prefix, at most [`MAX_BATCH_BYTES`] | the generated server (`max_decoding_message_size`), before the message is read | tonic's `OUT_OF_RANGE`, answered as the contract's `RESOURCE_EXHAUSTED` |
//! | each message's bytes | [`crate::api::grpc::DecodeStrict`] (`batch.rs`), as a `TakeBatch` body: decoding stops at a 65th take or a 17th bucket | `INVALID_ARGUMENT`, the field named |
//! | a permit of the take limiter while the message is decided | [`Api::permit`] | `UNAVAILABLE`, counted as shed |
//!
//! A stream's messages are decided one at a time, in the order they arrived: the next one is not
//! read before the answer to the last one was handed to tonic (HTTP/2 flow control holds back a
//! client that sends faster than it is answered), so the n-th answer is the n-th message's. The
//! stream ends at its first error (that error's status, logged at debug level); at the client's
//! half-close, with `OK`; or when the service shuts down ([`Api::shut_down`]): the message being
//! decided is answered first, then the stream ends with `UNAVAILABLE`, and a stream waiting for
//! its next message ends at once.
//!
//! A message has no metadata of its own, so its span (`tollgate.batch`) has no parent
//! ([`crate::trace`]).

use std::sync::Arc;

use futures_util::stream::{self, BoxStream};
use tokio::sync::watch;
use tonic::{Code, Status, Streaming};

use super::batch::Batch;
use super::grpc_message;
use crate::api::grpc::{pb, status_of};
use crate::api::{Api, ApiError};
use crate::domain::{InvalidArgument, MAX_BATCH_BYTES};
use crate::metrics::Metrics;
use crate::trace;

/// The answers of one stream, as tonic sends them: one per message, then, when the stream ends
/// early, its status (an `Err` is the last item; the stream running out is `OK`).
pub type Answers = BoxStream<'static, Result<pb::TakeBatchResponse, Status>>;

/// What a stream's client is told when the service shuts down.
const SHUTTING_DOWN: &str = "the service is shutting down: open a new stream";

/// The answers to the messages of a stream whose token was checked ([`Api::admit_token`]).
pub fn answers(api: Arc<Api>, messages: Streaming<pb::TakeBatchRequest>) -> Answers {
    let open = Open {
        shutdown: api.shutdown_signal(),
        _counted: Counted::new(api.metrics.clone()),
        api,
        messages,
        ended: false,
    };
    Box::pin(stream::unfold(open, next))
}

/// What a stream holds between two messages.
struct Open {
    api: Arc<Api>,
    messages: Streaming<pb::TakeBatchRequest>,
    shutdown: watch::Receiver<bool>,
    /// Its ending was handed out: nothing follows it.
    ended: bool,
    _counted: Counted,
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
    /// A message was refused or could not be decided, with the error a `TakeBatch` call would
    /// have had (counted as such).
    Failed(ApiError),
    /// tonic could not read a frame (a bad compression flag, a message cut short by the
    /// half-close), or the client's side broke: its status as tonic gave it, and not counted, as
    /// with a unary call.
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

/// The stream's next item: the answer to its next message, or its ending (once).
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
    /// Waits for the next message and decides it; `None` once the client half-closed.
    async fn answer_next(&mut self) -> Option<Result<pb::TakeBatchResponse, Ending>> {
        let received = tokio::select! {
            // Between two messages the shutdown wins; a message being decided is not raced
            // against it, and sees it here once it is answered.
            biased;
            _ = self.shutdown.wait_for(|down| *down) => return Some(Err(Ending::ShuttingDown)),
            m = self.messages.message() => m,
        };
        let message = match received {
            Ok(Some(m)) => m,
            Ok(None) => return None,
            Err(status) => return Some(Err(self.refused(status))),
        };
        let permit = match self.api.permit() {
            Ok(p) => p,
            Err(e) => {
                self.api.metrics.request("grpc", e.code());
                return Some(Err(Ending::Failed(e)));
            }
        };
        let answer = grpc_message::<Batch>(&self.api, trace::Parent::default(), message).await;
        drop(permit);
        Some(answer.map_err(Ending::Failed))
    }

    /// A message the generated server could not hand over, as the error a `TakeBatch` call
    /// would have had where there is one, and counted as such: tonic refuses a length prefix
    /// over the bound with `OUT_OF_RANGE`, where a unary call's body over the same bound is
    /// `RESOURCE_EXHAUSTED`; [`crate::api::grpc::DecodeStrict`]'s `INVALID_ARGUMENT` names the
    /// field already.
    fn refused(&self, status: Status) -> Ending {
        let e = match status.code() {
            Code::OutOfRange => ApiError::TooLarge(MAX_BATCH_BYTES),
            Code::InvalidArgument => ApiError::Invalid(InvalidArgument::new("", status.message())),
            _ => return Ending::Unread(status),
        };
        self.api.metrics.request("grpc", e.code());
        Ending::Failed(e)
    }
}
