//! The gRPC machinery every operation shares: the protobuf types generated from
//! `contract/tollgate.proto` and the operator's `proto/tollgate/admin.proto` (checked in under
//! `src/generated/`; `make protos` writes them again after a proto changes), a codec that turns malformed
//! protobuf into `INVALID_ARGUMENT`, a constant-memory scan of a message's repeated field, and
//! the one mapping of an [`ApiError`] to a gRPC status (a call's, or, on a stream, a message's
//! error answer). Each operation's messages are converted in
//! its own module (`ops/`).

use std::marker::PhantomData;

use prost::bytes::Buf;
use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstDecoder, ProstEncoder};

use super::ApiError;
use crate::domain::{Algorithm, InvalidArgument};

/// Generated protobuf messages, server and client.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    include!("../generated/tollgate.v1.rs");
}

/// Generated from `proto/tollgate/admin.proto`: the operator's service (`ops/buckets.rs`).
#[allow(missing_docs, clippy::all)]
pub mod admin_pb {
    include!("../generated/tollgate.admin.v1.rs");
}

pub(crate) fn malformed(e: &dyn std::fmt::Display) -> InvalidArgument {
    InvalidArgument::new("", format!("malformed protobuf: {e}"))
}

/// Walks the top-level fields of a message in constant memory, calling `on_one` with the index
/// and payload of every field 1 (length-delimited; other wire types get an empty payload, and
/// prost refuses them later). More than `max` of them stop the walk with `too_many()`.
pub(crate) fn scan_field_one(
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

/// prost's codec for responses; requests go through [`DecodeStrict`] (a take's scans its buckets
/// first, `ops/take.rs`), so a body that does not decode is `INVALID_ARGUMENT` (the caller's
/// fault), not `INTERNAL`, and a 17th bucket is never decoded.
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

/// Messages read by prost as they are: nothing to bound before they are built.
macro_rules! decode_plain {
    ($($message:ty),*) => {$(
        impl DecodeStrict for $message {
            fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
                <$message>::decode(bytes).map_err(|e| malformed(&e))
            }
        }
    )*};
}

decode_plain!(
    pb::TakeResponse,
    pb::TakeBatchResponse,
    pb::AcquireRequest,
    pb::AcquireResponse,
    pb::ReleaseRequest,
    pb::ReleaseResponse,
    pb::SettleRequest,
    pb::SettleResponse,
    admin_pb::BucketRef,
    admin_pb::InspectBucketResponse,
    admin_pb::ResetBucketResponse
);

impl<U: DecodeStrict + Message + Default> Decoder for StrictDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // One message, bounded by its length prefix: a unary call's body was read whole before
        // tonic saw it, a stream's message was gathered by tonic; one contiguous copy.
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
pub(crate) fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

/// [`non_empty`] of a string the caller owns: moved, not copied.
pub(crate) fn non_empty_owned(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

/// A gRPC status for an API error.
pub fn status_of(e: &ApiError) -> Status {
    match e {
        ApiError::Invalid(_) => Status::invalid_argument(e.message()),
        ApiError::Unauthenticated => Status::unauthenticated(e.message()),
        ApiError::AdminOff => Status::not_found(e.message()),
        ApiError::TooLarge(_) => Status::resource_exhausted(e.message()),
        ApiError::BodyTimeout(_) => Status::deadline_exceeded(e.message()),
        ApiError::Overloaded(_)
        | ApiError::StreamBusy(_)
        | ApiError::BufferFull(_)
        | ApiError::Unavailable(_) => Status::unavailable(e.message()),
    }
}

/// A `TakeStream` message's error answer (`TakeBatchResponse.error`): the status a `TakeBatch`
/// call would have ended with ([`status_of`]), and the field named when the message is invalid.
pub fn message_error(e: &ApiError) -> pb::MessageError {
    let (message, field) = match e {
        ApiError::Invalid(inv) => (inv.message.clone(), inv.field.clone()),
        _ => (e.message(), String::new()),
    };
    pb::MessageError {
        code: u32::try_from(i32::from(status_of(e).code())).unwrap_or(2),
        message,
        field,
    }
}

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};
    use std::collections::BTreeSet;
    use std::fs;
    use std::path::{Path, PathBuf};

    fn hex_sha256(file: &Path) -> Result<String, String> {
        let bytes = fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?;
        Ok(Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect())
    }

    /// Every `.proto` under `dir`, relative to the repository root `root`.
    fn protos_under(root: &Path, dir: &Path, into: &mut BTreeSet<PathBuf>) -> Result<(), String> {
        let entries =
            fs::read_dir(root.join(dir)).map_err(|e| format!("{}: {e}", dir.display()))?;
        for entry in entries {
            let path = dir.join(entry.map_err(|e| e.to_string())?.file_name());
            if root.join(&path).is_dir() {
                protos_under(root, &path, into)?;
            } else if path.extension().is_some_and(|e| e == "proto") {
                into.insert(path);
            }
        }
        Ok(())
    }

    /// The checked-in code in `src/generated/` is what `make protos` makes of today's protos:
    /// `inputs.sha256` names every proto the service is built from, with the digest it had then.
    #[test]
    fn generated_code_is_from_these_protos() -> Result<(), String> {
        let server = Path::new(env!("CARGO_MANIFEST_DIR"));
        let root = server.parent().ok_or("the repository root")?;
        let list = fs::read_to_string(server.join("src/generated/inputs.sha256"))
            .map_err(|e| format!("src/generated/inputs.sha256: {e}"))?;
        let mut listed = BTreeSet::new();
        for line in list.lines() {
            let (digest, path) = line.split_once("  ").ok_or("`<sha256>  <path>` lines")?;
            assert_eq!(
                hex_sha256(&root.join(path))?,
                digest,
                "{path} changed since src/generated/ was written: run `make protos`"
            );
            listed.insert(PathBuf::from(path));
        }
        let mut protos = BTreeSet::from([PathBuf::from("contract/tollgate.proto")]);
        protos_under(root, Path::new("server/proto"), &mut protos)?;
        assert_eq!(
            listed, protos,
            "the protos changed since src/generated/ was written: run `make protos`"
        );
        Ok(())
    }
}
