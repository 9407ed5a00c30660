//! The native adapter's data, below every part that works on it: a callout and what it sends,
//! a stream's route, an answer while the dispatcher reads it, what the main thread hands a
//! worker, an open stream's reading; the headers the ABI takes; and [`Native`], the dispatcher's
//! host (its calls in `abi.rs`).

use super::config::ModuleConfig;
use super::ffi::{EnvoyBuffer, EnvoyHeader, ModuleHeader};
use super::grpc::Deframer;
use std::sync::Arc;

/// A stream message's call: long enough never to end before the core's own deadline for it.
pub(super) const MESSAGE_TIMEOUT_MS: u64 = 60_000;

/// What a callout's answer is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Http,
    Unary,
    /// A message of the stream with this token.
    Message(u32),
}

/// Who carries a callout now.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Carrier {
    /// Request `ctx`'s filter, under Envoy's id `id` there.
    Request { ctx: u32, id: u64 },
    /// The main thread.
    Main,
}

/// A callout in flight.
pub(super) struct Owned {
    pub(super) carrier: Carrier,
    pub(super) kind: Kind,
    /// The requests waiting for its answer (none: a callout no request waits for).
    pub(super) members: Vec<u32>,
    /// A stream message's id.
    pub(super) message: Option<u64>,
    /// What it sends (again, if it must).
    pub(super) request: Arc<Request>,
    /// Times it went again for want of a connection.
    pub(super) retries: u8,
}

/// A callout as sent.
pub(super) struct Request {
    pub(super) config: Arc<ModuleConfig>,
    pub(super) cluster: String,
    pub(super) headers: Vec<(String, String)>,
    pub(super) body: Vec<u8>,
    pub(super) timeout_ms: u64,
}

/// A stream: where its messages go.
pub(super) struct Stream {
    pub(super) cluster: String,
    pub(super) path: String,
    pub(super) metadata: Vec<(String, String)>,
}

/// A callout's answer, while the dispatcher reads it.
#[derive(Default)]
pub(super) struct Reply {
    pub(super) headers: Vec<(Vec<u8>, Vec<u8>)>,
    pub(super) body: Vec<u8>,
    pub(super) message: Vec<u8>,
    pub(super) grpc_message: Option<String>,
}

/// A callout's end as Envoy reports it: its result (`envoy_dynamic_module_type_http_callout_result`)
/// and the response's headers and body, Envoy's, valid for the hook that reports it.
pub struct Done<'a> {
    pub result: i32,
    pub headers: &'a [EnvoyHeader],
    pub chunks: &'a [EnvoyBuffer],
}

/// A main-thread callout's end, copied for its worker.
pub struct Landed {
    pub(super) token: u32,
    pub(super) result: i32,
    pub(super) headers: Vec<(Vec<u8>, Vec<u8>)>,
    pub(super) body: Vec<u8>,
}

/// Headers as the ABI takes them: pointers into `headers`, which must outlive the call.
pub(super) fn module_headers<K: AsRef<[u8]>, V: AsRef<[u8]>>(
    headers: &[(K, V)],
) -> Vec<ModuleHeader> {
    headers
        .iter()
        .map(|(k, v)| ModuleHeader::of(k.as_ref(), v.as_ref()))
        .collect()
}

/// Metadata as owned pairs.
pub(super) fn owned_pairs(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect()
}

/// The gRPC request headers of a call on `path`.
pub(super) fn grpc_headers<'a>(
    path: &'a str,
    cluster: &'a str,
    metadata: &'a [(String, String)],
) -> Vec<(&'a str, &'a str)> {
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", cluster),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ];
    headers.extend(metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    headers
}

/// An open stream: its configuration, Envoy's id, what is read off it so far.
pub(super) struct Real {
    pub(super) config: Arc<ModuleConfig>,
    pub(super) id: u64,
    pub(super) deframer: Deframer,
    /// The gRPC status its headers or trailers carried, and its message.
    pub(super) status: Option<(u32, Option<String>)>,
}

/// The dispatcher's host calls over Envoy's dynamic module callbacks, on this worker's state.
pub struct Native;
