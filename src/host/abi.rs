//! The host calls the adapter makes, as a trait: [`super::wasm`] implements it with the proxy-wasm
//! imports of the running Envoy, the dispatcher's tests with a fake host. Every call returns what
//! the host said (a value, or its status code); none of them can panic.

use crate::core::base::store::SetError;

/// A proxy-wasm status code (`WasmResult`), as the host returns it.
pub type Status = u32;

/// `WasmResult::Ok`.
pub const OK: Status = 0;
/// `WasmResult::NotFound`.
pub const NOT_FOUND: Status = 1;
/// `WasmResult::BadArgument`.
pub const BAD_ARGUMENT: Status = 2;
/// `WasmResult::CasMismatch`.
pub const CAS_MISMATCH: Status = 8;

/// A status code's name, for logs and dispatch errors.
pub fn status_name(status: Status) -> &'static str {
    match status {
        OK => "Ok",
        NOT_FOUND => "NotFound",
        BAD_ARGUMENT => "BadArgument",
        3 => "SerializationFailure",
        4 => "ParseFailure",
        5 => "BadExpression",
        6 => "InvalidMemoryAccess",
        7 => "Empty",
        CAS_MISMATCH => "CasMismatch",
        9 => "ResultMismatch",
        10 => "InternalFailure",
        11 => "BrokenConnection",
        12 => "Unimplemented",
        _ => "Unknown",
    }
}

/// Log levels of the ABI (the host's numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

impl Level {
    /// The level the host numbered `n`.
    pub fn from_host(n: u32) -> Level {
        match n {
            0 => Level::Trace,
            1 => Level::Debug,
            2 => Level::Info,
            3 => Level::Warn,
            4 => Level::Error,
            _ => Level::Critical,
        }
    }

    /// The level of a `log` record (for the loggers of the wasm and the native build).
    #[cfg(any(target_family = "wasm", feature = "dynamic-module"))]
    pub fn of_record(level: log::Level) -> Level {
        match level {
            log::Level::Error => Level::Error,
            log::Level::Warn => Level::Warn,
            log::Level::Info => Level::Info,
            log::Level::Debug => Level::Debug,
            log::Level::Trace => Level::Trace,
        }
    }

    /// The `log` crate's filter that lets exactly this level and above through.
    pub fn filter(self) -> log::LevelFilter {
        match self {
            Level::Trace => log::LevelFilter::Trace,
            Level::Debug => log::LevelFilter::Debug,
            Level::Info => log::LevelFilter::Info,
            Level::Warn => log::LevelFilter::Warn,
            Level::Error | Level::Critical => log::LevelFilter::Error,
        }
    }
}

/// Metric kinds of the ABI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter = 0,
    Gauge = 1,
}

/// Buffers the adapter reads (the ABI's `BufferType` numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    HttpRequestBody = 0,
    HttpResponseBody = 1,
    HttpCallResponseBody = 4,
    GrpcReceive = 5,
    PluginConfiguration = 7,
}

/// Header maps the adapter reads or writes (the ABI's `MapType` numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderMap {
    Request = 0,
    Response = 2,
    HttpCallResponse = 6,
}

/// What the adapter asks of the host. "Current context" is the one Envoy is calling into, or the
/// one made current by [`Abi::set_effective_context`].
pub trait Abi {
    /// The host's log level for this module.
    fn log_level(&self) -> Option<Level>;
    /// Size of this VM's linear memory, in bytes.
    fn memory_bytes(&self) -> u64;
    /// Wall-clock time, ms since the epoch (0 if the host refuses).
    fn now_ms(&self) -> u64;
    /// Bytes `start..start + size` of a buffer (empty if absent or refused).
    fn buffer(&self, which: Buffer, start: usize, size: usize) -> Vec<u8>;
    /// The first value of one header of a map; `None` when absent.
    fn header(&self, map: HeaderMap, name: &str) -> Option<Vec<u8>>;
    /// A whole header map; `None` if the host refused or sent garbage.
    fn headers(&self, map: HeaderMap) -> Option<Vec<(String, Vec<u8>)>>;
    /// Adds a header to a map.
    fn add_header(&self, map: HeaderMap, name: &str, value: &str) -> Result<(), Status>;
    /// A property (path parts as in the ABI, e.g. `["source", "address"]`).
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// A shared-data value and its CAS version.
    fn shared_get(&self, key: &str) -> Option<(Vec<u8>, u32)>;
    /// Writes shared data, with CAS when `cas` is `Some`.
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;
    /// Defines a metric; its id.
    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, Status>;
    /// Adds `delta` to a metric.
    fn increment_metric(&self, id: u32, delta: i64);
    /// Sets a gauge.
    fn record_metric(&self, id: u32, value: u64);
    /// Starts an HTTP callout; its token.
    fn http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, Status>;
    /// Starts a unary gRPC callout; its token. `service` is what the ABI calls the "upstream": a
    /// cluster name, or a serialised `envoy.config.core.v3.GrpcService`.
    fn grpc_call(
        &self,
        service: &[u8],
        service_name: &str,
        method: &str,
        metadata: &[(&str, &str)],
        message: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, Status>;
    /// Opens a bidirectional gRPC stream from the current (root) context; its token. Its
    /// messages arrive as `proxy_on_grpc_receive` and its end as `proxy_on_grpc_close`, both with
    /// this token, on the root context.
    fn grpc_stream(
        &self,
        service: &[u8],
        service_name: &str,
        method: &str,
        metadata: &[(&str, &str)],
    ) -> Result<u32, Status>;
    /// The requests (context ids) the next callout or stream message is for, each waiting for
    /// its answer, and the message's id on the stream (`message`): a host whose callouts belong
    /// to a request (the native build's) makes it on one of them, so it lives as long as someone
    /// waits for it. Nothing to do for proxy-wasm, whose callouts belong to the root.
    fn callout_for(&self, _contexts: &[u32], _message: Option<u64>) {}
    /// Sends one message on stream `token`.
    fn grpc_send(&self, token: u32, message: &[u8]) -> Result<(), Status>;
    /// Resets stream `token` (or cancels a unary call): no callback follows, and Envoy forgets
    /// the token.
    fn grpc_cancel(&self, token: u32) -> Result<(), Status>;
    /// The gRPC status message of the callout being reported.
    fn grpc_status_message(&self) -> Option<String>;
    /// Asks for `proxy_on_tick` on the current (root) context every `period_ms` (0: never).
    fn set_tick_period(&self, period_ms: u32) -> Result<(), Status>;
    /// Makes `context_id` the current context (a callout reply arrives on the root context).
    fn set_effective_context(&self, context_id: u32) -> Result<(), Status>;
    /// Resumes the current (paused) request. Envoy carries it out once the callback returns
    /// (as a local reply), and may call into the module from there: the dispatcher paces both
    /// (`pace.rs`).
    fn resume_request(&self) -> Result<(), Status>;
    /// Answers the current request locally.
    fn send_local_response(
        &self,
        status: u32,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<(), Status>;
}
