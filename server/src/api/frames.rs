//! The messages of a `TakeStream` stream read from its request body, gRPC's framing undone here
//! (a compression flag, a 4-byte big-endian length, the message) rather than by tonic, so that
//! `ops/stream.rs` decodes every message on its own. A message's length prefix is at most
//! [`MAX_BATCH_BYTES`], refused before its bytes are read ([`FrameError::TooLarge`]).
//!
//! A message that arrives whole within one read of the body (a DATA frame) is handed out as a
//! slice of that frame; one that does not is gathered in a buffer of its own, grown by doubling,
//! never past its length. Bytes the body has not handed over yet are HTTP/2's (bounded by the
//! flow-control windows, `serve.rs`).

use axum::body::{Body, Bytes};
use http_body_util::BodyExt;

use super::GRPC_FRAMING_BYTES;
use crate::domain::MAX_BATCH_BYTES;

/// Why a stream's body yields no more messages, short of its end.
#[derive(Debug)]
pub enum FrameError {
    /// A length prefix over [`MAX_BATCH_BYTES`].
    TooLarge,
    /// A compression flag other than 0: no `grpc-encoding` is accepted.
    Compressed,
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
}

impl Messages {
    /// The messages of `body`.
    pub fn new(body: Body) -> Self {
        Messages {
            body,
            rest: Bytes::new(),
            partial: Vec::new(),
        }
    }

    /// The next whole message (its bytes, without the framing); `None` once the client
    /// half-closed between two messages. Cancel-safe: it waits only for the body's next frame,
    /// and what it read is kept for the next call.
    pub async fn next(&mut self) -> Result<Option<Bytes>, FrameError> {
        loop {
            if let Some(message) = self.cut()? {
                return Ok(Some(message));
            }
            // Nothing whole: all there is sits in `partial`.
            match self.body.frame().await {
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
        }
        loop {
            // Gathered up to the prefix, then up to the message's end.
            let known = length(&self.partial)?;
            let whole = GRPC_FRAMING_BYTES + known.unwrap_or(0);
            if known.is_some() && self.partial.len() == whole {
                let message = Bytes::from(std::mem::take(&mut self.partial));
                return Ok(Some(message.slice(GRPC_FRAMING_BYTES..)));
            }
            if self.rest.is_empty() {
                return Ok(None);
            }
            let n = (whole - self.partial.len()).min(self.rest.len());
            self.grow(n, whole);
            self.partial.extend_from_slice(&self.rest.split_to(n));
        }
    }

    /// Room in `partial` for `n` more bytes of a message of `whole` bytes.
    fn grow(&mut self, n: usize, whole: usize) {
        let need = self.partial.len() + n;
        let capacity = self.partial.capacity();
        if need <= capacity {
            return;
        }
        let to = (capacity * 2).clamp(need, whole.max(need));
        self.partial.reserve_exact(to - self.partial.len());
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

    fn framed(message: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&u32::try_from(message.len()).unwrap_or(0).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    async fn all(parts: Vec<Vec<u8>>) -> (Vec<Vec<u8>>, Option<FrameError>) {
        let mut m = Messages::new(body(parts));
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
        let (a, b, c) = (framed(b"first"), framed(b""), framed(&[7; 300]));
        let stream: Vec<u8> = [a.clone(), b.clone(), c.clone()].concat();
        // Whole, all in one frame, and cut at every byte.
        for at in 0..=stream.len() {
            let (one, two) = stream.split_at(at);
            let (got, end) = all(vec![one.to_vec(), two.to_vec()]).await;
            assert!(end.is_none(), "{at}: {end:?}");
            assert_eq!(got, [b"first".to_vec(), Vec::new(), vec![7; 300]], "{at}");
        }
        let bytes: Vec<Vec<u8>> = stream.iter().map(|b| vec![*b]).collect();
        let (got, end) = all(bytes).await;
        assert!(end.is_none() && got.len() == 3, "{got:?} {end:?}");
    }

    #[tokio::test]
    async fn what_is_not_a_message_ends_the_reading() {
        let over = u32::try_from(MAX_BATCH_BYTES + 1)
            .unwrap_or(0)
            .to_be_bytes();
        let (_, end) = all(vec![[&[0][..], &over].concat()]).await;
        assert!(matches!(end, Some(FrameError::TooLarge)), "{end:?}");
        let (_, end) = all(vec![vec![1, 0, 0, 0, 1, 0]]).await;
        assert!(matches!(end, Some(FrameError::Compressed)), "{end:?}");
        let (got, end) = all(vec![framed(b"ok"), framed(b"cut")[..6].to_vec()]).await;
        assert_eq!(got, [b"ok".to_vec()]);
        assert!(matches!(end, Some(FrameError::CutShort)), "{end:?}");
    }
}
