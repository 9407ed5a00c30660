//! The messages of a `TakeStream` stream read from its request body, gRPC's framing undone here
//! (a compression flag, a 4-byte big-endian length, the message) rather than by tonic, so that
//! `ops/stream.rs` decodes every message on its own and what a stream holds is bounded:
//!
//! | what | bound | past it |
//! |---|---|---|
//! | a message | its length prefix at most [`MAX_BATCH_BYTES`], refused before its bytes are read | [`FrameError::TooLarge`] |
//! | the bytes held between two reads: the message not yet whole (one at most, its prefix included) and the rest of the last frame read | charged to the service's [`Budget`] (`--stream-buffer-bytes`): a message not yet whole grows its buffer by doubling, never past its length, so the charge is at most twice what arrived | [`FrameError::Budget`] |
//! | time | a message whole within the body timeout of its first byte read | [`FrameError::Deadline`] |
//!
//! A message that arrives whole within one read of the body (a DATA frame) is handed out as a
//! slice of that frame and charges nothing, so a client whose messages each fit a frame, as a
//! proxy's few-hundred-byte messages do, is never refused for bytes other streams hold. Bytes the
//! body has not handed over yet are HTTP/2's (bounded by the flow-control windows, `serve.rs`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use http_body_util::BodyExt;
use tokio::time::Instant;

use super::GRPC_FRAMING_BYTES;
use crate::domain::MAX_BATCH_BYTES;
use crate::metrics::Metrics;

/// The bytes every stream together may hold of messages not yet whole (`--stream-buffer-bytes`),
/// shown in `tollgate_stream_buffered_bytes`.
pub struct Budget {
    max: usize,
    used: AtomicUsize,
    metrics: Arc<Metrics>,
}

impl Budget {
    /// A budget of `max` bytes.
    pub fn new(max: usize, metrics: Arc<Metrics>) -> Self {
        Budget {
            max,
            used: AtomicUsize::new(0),
            metrics,
        }
    }

    /// Takes `n` bytes of it, or nothing when fewer are left.
    fn take(&self, n: usize) -> bool {
        let taken = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= self.max)
            })
            .is_ok();
        if taken {
            self.metrics
                .stream_buffered(i64::try_from(n).unwrap_or(i64::MAX));
        }
        taken
    }

    fn give_back(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
        self.metrics
            .stream_buffered(-i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// What one stream holds of the [`Budget`]: all of it given back when the stream's reader is
/// dropped.
struct Charge {
    budget: Arc<Budget>,
    held: usize,
}

impl Charge {
    /// Holds `n` bytes from now on: takes what is missing (or fails, holding what it held) or
    /// gives back what is over.
    fn hold(&mut self, n: usize) -> Result<(), FrameError> {
        if n > self.held {
            if !self.budget.take(n - self.held) {
                return Err(FrameError::Budget(self.budget.max));
            }
        } else {
            self.budget.give_back(self.held - n);
        }
        self.held = n;
        Ok(())
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.give_back(self.held);
    }
}

/// Why a stream's body yields no more messages, short of its end.
#[derive(Debug)]
pub enum FrameError {
    /// A length prefix over [`MAX_BATCH_BYTES`].
    TooLarge,
    /// A compression flag other than 0: no `grpc-encoding` is accepted.
    Compressed,
    /// Holding the message not yet whole would take the service's [`Budget`] past its bound,
    /// this many bytes.
    Budget(usize),
    /// A message was not whole within the body timeout of its first byte.
    Deadline,
    /// The body ended inside a message.
    CutShort,
    /// The body could not be read (the client's side broke).
    Read(axum::Error),
}

/// The messages of one stream's body, read one at a time ([`Messages::next`]).
pub struct Messages {
    body: Body,
    /// The rest of the last frame read, not yet looked at: whole messages are cut from it.
    rest: Bytes,
    /// A message not yet whole, its prefix included; empty between messages.
    partial: Vec<u8>,
    /// When the first byte of `partial` was read.
    started: Option<Instant>,
    timeout: Duration,
    charge: Charge,
    /// An error found after a message was already handed out: the next call's answer.
    owed: Option<FrameError>,
}

impl Messages {
    /// The messages of `body`, held within `budget`, each whole within `timeout` of its first
    /// byte.
    pub fn new(body: Body, budget: Arc<Budget>, timeout: Duration) -> Self {
        Messages {
            body,
            rest: Bytes::new(),
            partial: Vec::new(),
            started: None,
            timeout,
            charge: Charge { budget, held: 0 },
            owed: None,
        }
    }

    /// The next whole message (its bytes, without the framing); `None` once the client
    /// half-closed between two messages. Cancel-safe: it waits only for the body's next frame
    /// (or the deadline), and what it read is kept for the next call.
    pub async fn next(&mut self) -> Result<Option<Bytes>, FrameError> {
        if let Some(e) = self.owed.take() {
            return Err(e);
        }
        loop {
            if let Some(message) = self.cut()? {
                // The rest of the frame waits for the next call: held, so charged.
                if let Err(e) = self.charge.hold(self.rest.len()) {
                    self.owed = Some(e);
                }
                return Ok(Some(message));
            }
            // Nothing whole: all there is sits in `partial`, charged.
            let frame = match self.started {
                Some(at) => tokio::select! {
                    f = self.body.frame() => f,
                    () = tokio::time::sleep_until(at + self.timeout) => {
                        return Err(FrameError::Deadline)
                    }
                },
                None => self.body.frame().await,
            };
            match frame {
                None if self.partial.is_empty() => return Ok(None),
                None => return Err(FrameError::CutShort),
                Some(Err(e)) => return Err(FrameError::Read(e)),
                // Trailers end the body; `frame` says so next.
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.rest = data;
                    }
                }
            }
        }
    }

    /// A whole message out of what is held, or `None` once all of the rest of the frame has
    /// gone into `partial`.
    fn cut(&mut self) -> Result<Option<Bytes>, FrameError> {
        if self.partial.is_empty() {
            // Most messages: whole within the frame, a slice of it.
            if let Some(len) = length(&self.rest)? {
                if self.rest.len() >= GRPC_FRAMING_BYTES + len {
                    let mut message = self.rest.split_to(GRPC_FRAMING_BYTES + len);
                    return Ok(Some(message.split_off(GRPC_FRAMING_BYTES)));
                }
            }
            if self.rest.is_empty() {
                return Ok(None);
            }
            self.started = Some(Instant::now());
        }
        loop {
            // Gathered up to the prefix, then up to the message's end.
            let known = length(&self.partial)?;
            let whole = GRPC_FRAMING_BYTES + known.unwrap_or(0);
            if known.is_some() && self.partial.len() == whole {
                let message = Bytes::from(std::mem::take(&mut self.partial));
                self.started = None;
                return Ok(Some(message.slice(GRPC_FRAMING_BYTES..)));
            }
            if self.rest.is_empty() {
                return Ok(None);
            }
            let n = (whole - self.partial.len()).min(self.rest.len());
            self.grow(n, whole)?;
            self.partial.extend_from_slice(&self.rest.split_to(n));
        }
    }

    /// Room in `partial` for `n` more bytes of a message of `whole` bytes, charged first.
    fn grow(&mut self, n: usize, whole: usize) -> Result<(), FrameError> {
        let need = self.partial.len() + n;
        let capacity = self.partial.capacity();
        if need <= capacity {
            return Ok(());
        }
        let to = (capacity * 2).clamp(need, whole.max(need));
        self.charge.hold(to)?;
        self.partial.reserve_exact(to - self.partial.len());
        Ok(())
    }
}

/// The length a message's prefix announces, once `buf` holds the prefix; checked against the
/// bound and the compression flag.
fn length(buf: &[u8]) -> Result<Option<usize>, FrameError> {
    let Some(&[flag, a, b, c, d]) = buf.get(..GRPC_FRAMING_BYTES) else {
        return Ok(None);
    };
    if flag != 0 {
        return Err(FrameError::Compressed);
    }
    let len = u32::from_be_bytes([a, b, c, d]);
    match usize::try_from(len) {
        Ok(len) if len <= MAX_BATCH_BYTES => Ok(Some(len)),
        _ => Err(FrameError::TooLarge),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body sent in `parts`, as HTTP/2 DATA frames.
    fn body(parts: Vec<Vec<u8>>) -> Body {
        let frames: Vec<Result<Bytes, std::io::Error>> =
            parts.into_iter().map(|p| Ok(Bytes::from(p))).collect();
        Body::from_stream(futures_util::stream::iter(frames))
    }

    fn budget(max: usize) -> Arc<Budget> {
        Arc::new(Budget::new(max, Arc::new(Metrics::new())))
    }

    fn framed(message: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&u32::try_from(message.len()).unwrap_or(0).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    async fn all(parts: Vec<Vec<u8>>, budget: &Arc<Budget>) -> (Vec<Vec<u8>>, Option<FrameError>) {
        let mut m = Messages::new(body(parts), budget.clone(), Duration::from_secs(5));
        let mut got = Vec::new();
        loop {
            match m.next().await {
                Ok(Some(b)) => got.push(b.to_vec()),
                Ok(None) => return (got, None),
                Err(e) => return (got, Some(e)),
            }
        }
    }

    #[tokio::test]
    async fn messages_are_cut_from_frames_however_they_are_split() {
        let budget = budget(1 << 20);
        let (a, b, c) = (framed(b"first"), framed(b""), framed(&[7; 300]));
        let stream: Vec<u8> = [a.clone(), b.clone(), c.clone()].concat();
        // Whole, all in one frame, and cut at every byte.
        for at in 0..=stream.len() {
            let (one, two) = stream.split_at(at);
            let (got, end) = all(vec![one.to_vec(), two.to_vec()], &budget).await;
            assert!(end.is_none(), "{at}: {end:?}");
            assert_eq!(got, [b"first".to_vec(), Vec::new(), vec![7; 300]], "{at}");
        }
        let bytes: Vec<Vec<u8>> = stream.iter().map(|b| vec![*b]).collect();
        let (got, end) = all(bytes, &budget).await;
        assert!(end.is_none() && got.len() == 3, "{got:?} {end:?}");
        assert_eq!(budget.used.load(Ordering::Relaxed), 0, "all given back");
    }

    #[tokio::test]
    async fn what_is_not_a_message_ends_the_reading() {
        let budget = budget(1 << 20);
        let over = u32::try_from(MAX_BATCH_BYTES + 1)
            .unwrap_or(0)
            .to_be_bytes();
        let (_, end) = all(vec![[&[0][..], &over].concat()], &budget).await;
        assert!(matches!(end, Some(FrameError::TooLarge)), "{end:?}");
        let (_, end) = all(vec![vec![1, 0, 0, 0, 1, 0]], &budget).await;
        assert!(matches!(end, Some(FrameError::Compressed)), "{end:?}");
        let (got, end) = all(vec![framed(b"ok"), framed(b"cut")[..6].to_vec()], &budget).await;
        assert_eq!(got, [b"ok".to_vec()]);
        assert!(matches!(end, Some(FrameError::CutShort)), "{end:?}");
    }

    #[tokio::test]
    async fn held_bytes_are_charged_and_refused_past_the_budget() {
        let budget = budget(100);
        // Whole within a frame: charges nothing, however large against the budget.
        let (got, end) = all(vec![framed(&[1; 500])], &budget).await;
        assert!(end.is_none() && got.len() == 1, "{end:?}");
        // 60 bytes held, then 60 more needed: refused.
        let big = framed(&[2; 200]);
        let (_, end) = all(vec![big[..60].to_vec(), big[60..120].to_vec()], &budget).await;
        assert!(matches!(end, Some(FrameError::Budget(100))), "{end:?}");
        assert_eq!(budget.used.load(Ordering::Relaxed), 0, "given back");
        // The rest of a frame behind a whole message is held until the next call.
        let mut m = Messages::new(
            body(vec![[framed(b"a"), framed(&[3; 40])].concat()]),
            budget.clone(),
            Duration::from_secs(5),
        );
        assert_eq!(m.next().await.ok().flatten().as_deref(), Some(&b"a"[..]));
        assert_eq!(budget.used.load(Ordering::Relaxed), 45);
        drop(m);
        assert_eq!(budget.used.load(Ordering::Relaxed), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_not_whole_in_time_ends_the_reading() {
        let budget = budget(1 << 20);
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
        let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|f| (f, rx))
        }));
        let mut m = Messages::new(body, budget, Duration::from_millis(500));
        let whole = framed(b"whole");
        let _ = tx.send(Ok(Bytes::from(whole))).await;
        assert!(matches!(m.next().await, Ok(Some(_))));
        // Nothing begun: waiting is not timed.
        let waiting = tokio::time::timeout(Duration::from_secs(5), m.next()).await;
        assert!(waiting.is_err(), "an idle stream is not cut");
        let _ = tx
            .send(Ok(Bytes::from(framed(b"slow")[..6].to_vec())))
            .await;
        let start = Instant::now();
        let end = m.next().await;
        assert!(matches!(end, Err(FrameError::Deadline)), "{end:?}");
        assert_eq!(start.elapsed(), Duration::from_millis(500));
    }
}
