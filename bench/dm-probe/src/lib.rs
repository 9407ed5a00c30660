//! The floor of a native filter: an Envoy 1.40 dynamic module loaded by
//! `envoy.filters.http.dynamic_modules`, in one of two modes given as its `filter_config`:
//!
//! - `empty`: every hook lets the request through and does nothing else; no allocation per
//!   request. The native counterpart of bench/empty-filter.
//! - `stream`: on each request's headers, one message of a one-bucket take's size on this worker's
//!   HTTP/2 stream to the `tollgate` cluster (`/tollgate.bench.Probe/TakeStream`, gRPC framing),
//!   and the request waits until an answer arrives. The stream belongs to the filter
//!   configuration (it outlives requests), is opened by the worker's first request and kept open;
//!   answers come back in order on the worker that opened it, so the first request waiting is the
//!   one an answer resumes. The native counterpart of bench/stream-probe's `stream`: no keys, no
//!   decision, no failure path (a request that finds no stream, or whose send fails, goes on; a
//!   stream that ends lets its waiting requests go on).
//!
//! `abi` holds our bindings of the ABI; the hooks below are the ones Envoy 1.40 resolves when it
//! creates the filter configuration (the first missing one fails the configuration), with the
//! configuration's stream hooks, which it resolves if present.
#![allow(clippy::missing_safety_doc)]

mod abi;

use abi::*;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

// 38 opaque bytes, about the size of a one-bucket take in protobuf (bench/stream-probe's; neither
// side decodes them), behind gRPC's 5-byte prefix (not compressed, big-endian length).
const MSG: &[u8] =
    b"\x0a\x1a\x0a\x0ctollgate:tb:bench\x10\x80\x94\xeb\xdc\x03\x18\x80\x94\xeb\xdc\x03\x20\xe8\x07\x28\x01";
const FRAME: [u8; 5 + MSG.len()] = frame();
const fn frame() -> [u8; 5 + MSG.len()] {
    let mut f = [0u8; 5 + MSG.len()];
    let len = (MSG.len() as u32).to_be_bytes();
    f[1] = len[0];
    f[2] = len[1];
    f[3] = len[2];
    f[4] = len[3];
    let mut i = 0;
    while i < MSG.len() {
        f[5 + i] = MSG[i];
        i += 1;
    }
    f
}
const CLUSTER: &[u8] = b"tollgate";
/// The stream's timeout: none in practice (an hour; the bench lasts minutes).
const STREAM_TIMEOUT_MS: u64 = 3_600_000;

/// The filter configuration's mode, parsed once in `envoy_dynamic_module_on_http_filter_config_new`.
struct Config {
    stream: bool,
    /// Envoy's configuration object: the stream callbacks take it.
    envoy: FilterConfigEnvoyPtr,
}

thread_local! {
    /// This worker's stream, once opened.
    static STREAM: Cell<Option<u64>> = const { Cell::new(None) };
    /// This worker's requests waiting for an answer, oldest first (Envoy's filter pointers).
    static WAITING: RefCell<VecDeque<FilterEnvoyPtr>> = const { RefCell::new(VecDeque::new()) };
    /// The bytes of an answer not yet whole (gRPC frames may arrive split or together).
    static PARTIAL: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// `envoy_dynamic_module_type_abi_version_module_ptr envoy_dynamic_module_on_program_init(void)`:
/// called once when Envoy loads the library; null would refuse the module.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> AbiVersionPtr {
    ABI_VERSION.as_ptr().cast()
}

/// `envoy_dynamic_module_type_http_filter_config_module_ptr
/// envoy_dynamic_module_on_http_filter_config_new(
///     envoy_dynamic_module_type_http_filter_config_envoy_ptr filter_config_envoy_ptr,
///     envoy_dynamic_module_type_envoy_buffer name, envoy_dynamic_module_type_envoy_buffer config)`:
/// on the main thread; null refuses the configuration (an unknown mode).
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: FilterConfigEnvoyPtr,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> FilterConfigModulePtr {
    let text: &[u8] = if config.ptr.is_null() {
        b""
    } else {
        std::slice::from_raw_parts(config.ptr.cast(), config.length)
    };
    let stream = match text {
        b"" | b"empty" => false,
        b"stream" => true,
        _ => return std::ptr::null(),
    };
    Box::into_raw(Box::new(Config { stream, envoy })) as FilterConfigModulePtr
}

/// `void envoy_dynamic_module_on_http_filter_config_destroy(
///     envoy_dynamic_module_type_http_filter_config_module_ptr filter_config_ptr)`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(
    config: FilterConfigModulePtr,
) {
    drop(Box::from_raw(config as *mut Config));
}

/// `envoy_dynamic_module_type_http_filter_module_ptr envoy_dynamic_module_on_http_filter_new(
///     envoy_dynamic_module_type_http_filter_config_module_ptr filter_config_ptr,
///     envoy_dynamic_module_type_http_filter_envoy_ptr filter_envoy_ptr)`: per request; null
/// would close the stream.
///
/// A filter keeps no state of its own (a waiting request is known by Envoy's pointer, in
/// `WAITING`), so its pointer is its configuration's, which Envoy keeps alive as long as any of
/// its filters.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: FilterConfigModulePtr,
    _filter: FilterEnvoyPtr,
) -> FilterModulePtr {
    config
}

/// `envoy_dynamic_module_type_on_http_filter_request_headers_status
/// envoy_dynamic_module_on_http_filter_request_headers(
///     envoy_dynamic_module_type_http_filter_envoy_ptr filter_envoy_ptr,
///     envoy_dynamic_module_type_http_filter_module_ptr filter_module_ptr, bool end_of_stream)`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    filter: FilterEnvoyPtr,
    module: FilterModulePtr,
    _end_of_stream: bool,
) -> i32 {
    // The filter's pointer is its configuration (envoy_dynamic_module_on_http_filter_new).
    let config = &*(module as *const Config);
    if config.stream {
        ask(config, filter)
    } else {
        CONTINUE
    }
}

/// One message on this worker's stream (opened first if there is none), then the request waits.
unsafe fn ask(config: &Config, filter: FilterEnvoyPtr) -> i32 {
    let stream = match STREAM.get() {
        Some(s) => s,
        None => match open(config) {
            Some(s) => s,
            None => return CONTINUE,
        },
    };
    if !envoy_dynamic_module_callback_http_filter_config_stream_send_data(
        config.envoy,
        stream,
        ModuleBuffer::of(&FRAME),
        false,
    ) {
        STREAM.set(None);
        return CONTINUE;
    }
    WAITING.with(|w| w.borrow_mut().push_back(filter));
    STOP_ITERATION
}

unsafe fn open(config: &Config) -> Option<u64> {
    let mut headers = [
        ModuleHttpHeader::of(b":method", b"POST"),
        ModuleHttpHeader::of(b":path", b"/tollgate.bench.Probe/TakeStream"),
        ModuleHttpHeader::of(b"host", b"tollgate"),
        ModuleHttpHeader::of(b"content-type", b"application/grpc"),
        ModuleHttpHeader::of(b"te", b"trailers"),
    ];
    let mut id = 0u64;
    let result = envoy_dynamic_module_callback_http_filter_config_start_http_stream(
        config.envoy,
        &mut id,
        ModuleBuffer::of(CLUSTER),
        headers.as_mut_ptr(),
        headers.len(),
        ModuleBuffer::of(b""),
        false,
        STREAM_TIMEOUT_MS,
    );
    if result != CALLOUT_INIT_SUCCESS {
        return None;
    }
    STREAM.set(Some(id));
    Some(id)
}

/// `void envoy_dynamic_module_on_http_filter_config_http_stream_data(
///     envoy_dynamic_module_type_http_filter_config_envoy_ptr filter_config_envoy_ptr,
///     envoy_dynamic_module_type_http_filter_config_module_ptr filter_config_ptr, uint64_t stream_id,
///     const envoy_dynamic_module_type_envoy_buffer* data, size_t data_count, bool end_stream)`:
/// each whole answer resumes the oldest waiting request.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_data(
    _envoy: FilterConfigEnvoyPtr,
    _config: FilterConfigModulePtr,
    _stream_id: u64,
    data: *const EnvoyBuffer,
    data_count: usize,
    _end_stream: bool,
) {
    let answers = PARTIAL.with(|p| {
        let mut p = p.borrow_mut();
        if !data.is_null() {
            for b in std::slice::from_raw_parts(data, data_count) {
                if !b.ptr.is_null() {
                    p.extend_from_slice(std::slice::from_raw_parts(b.ptr.cast(), b.length));
                }
            }
        }
        let mut answers = 0;
        let mut at = 0;
        while p.len() - at >= 5 {
            let len = u32::from_be_bytes([p[at + 1], p[at + 2], p[at + 3], p[at + 4]]) as usize;
            if p.len() - at - 5 < len {
                break;
            }
            at += 5 + len;
            answers += 1;
        }
        p.drain(..at);
        answers
    });
    for _ in 0..answers {
        resume_oldest();
    }
}

fn resume_oldest() {
    if let Some(filter) = WAITING.with(|w| w.borrow_mut().pop_front()) {
        // The filter is alive: one that ends while waiting leaves WAITING first
        // (envoy_dynamic_module_on_http_filter_stream_complete).
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(filter) };
    }
}

/// The stream ended: every waiting request goes on, the next request opens a new stream.
fn stream_gone() {
    STREAM.set(None);
    PARTIAL.with(|p| p.borrow_mut().clear());
    while WAITING.with(|w| !w.borrow().is_empty()) {
        resume_oldest();
    }
}

/// `void envoy_dynamic_module_on_http_filter_config_http_stream_complete(
///     envoy_dynamic_module_type_http_filter_config_envoy_ptr filter_config_envoy_ptr,
///     envoy_dynamic_module_type_http_filter_config_module_ptr filter_config_ptr,
///     uint64_t stream_id)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_complete(
    _envoy: FilterConfigEnvoyPtr,
    _config: FilterConfigModulePtr,
    _stream_id: u64,
) {
    stream_gone();
}

/// `void envoy_dynamic_module_on_http_filter_config_http_stream_reset(
///     envoy_dynamic_module_type_http_filter_config_envoy_ptr filter_config_envoy_ptr,
///     envoy_dynamic_module_type_http_filter_config_module_ptr filter_config_ptr, uint64_t stream_id,
///     envoy_dynamic_module_type_http_stream_reset_reason reason)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_reset(
    _envoy: FilterConfigEnvoyPtr,
    _config: FilterConfigModulePtr,
    _stream_id: u64,
    _reason: i32,
) {
    stream_gone();
}

/// `void envoy_dynamic_module_on_http_filter_config_http_stream_headers(
///     envoy_dynamic_module_type_http_filter_config_envoy_ptr filter_config_envoy_ptr,
///     envoy_dynamic_module_type_http_filter_config_module_ptr filter_config_ptr, uint64_t stream_id,
///     envoy_dynamic_module_type_envoy_http_header* headers, size_t headers_size, bool end_stream)`:
/// the peer's response headers, not looked at.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_headers(
    _envoy: FilterConfigEnvoyPtr,
    _config: FilterConfigModulePtr,
    _stream_id: u64,
    _headers: *mut EnvoyHttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

/// `void envoy_dynamic_module_on_http_filter_config_http_stream_trailers(
///     envoy_dynamic_module_type_http_filter_config_envoy_ptr filter_config_envoy_ptr,
///     envoy_dynamic_module_type_http_filter_config_module_ptr filter_config_ptr, uint64_t stream_id,
///     envoy_dynamic_module_type_envoy_http_header* trailers, size_t trailers_size)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_trailers(
    _envoy: FilterConfigEnvoyPtr,
    _config: FilterConfigModulePtr,
    _stream_id: u64,
    _trailers: *mut EnvoyHttpHeader,
    _trailers_size: usize,
) {
}

/// `void envoy_dynamic_module_on_http_filter_stream_complete(
///     envoy_dynamic_module_type_http_filter_envoy_ptr filter_envoy_ptr,
///     envoy_dynamic_module_type_http_filter_module_ptr filter_module_ptr)`: before the filter is
/// destroyed; a request still waiting (its client went away) leaves the queue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
) {
    WAITING.with(|w| {
        let mut w = w.borrow_mut();
        if let Some(i) = w.iter().position(|f| *f == filter) {
            w.remove(i);
        }
    });
}

// The other hooks Envoy 1.40 requires of an HTTP filter module: each continues, or does nothing.

/// `..._request_body_status envoy_dynamic_module_on_http_filter_request_body(filter_envoy_ptr,
/// filter_module_ptr, bool end_of_stream)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _end_of_stream: bool,
) -> i32 {
    CONTINUE
}

/// `..._request_trailers_status envoy_dynamic_module_on_http_filter_request_trailers(
/// filter_envoy_ptr, filter_module_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
) -> i32 {
    CONTINUE
}

/// `..._response_headers_status envoy_dynamic_module_on_http_filter_response_headers(
/// filter_envoy_ptr, filter_module_ptr, bool end_of_stream)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _end_of_stream: bool,
) -> i32 {
    CONTINUE
}

/// `..._response_body_status envoy_dynamic_module_on_http_filter_response_body(filter_envoy_ptr,
/// filter_module_ptr, bool end_of_stream)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _end_of_stream: bool,
) -> i32 {
    CONTINUE
}

/// `..._response_trailers_status envoy_dynamic_module_on_http_filter_response_trailers(
/// filter_envoy_ptr, filter_module_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
) -> i32 {
    CONTINUE
}

/// `void envoy_dynamic_module_on_http_filter_destroy(filter_module_ptr)`: nothing to free.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(_module: FilterModulePtr) {}

/// `void envoy_dynamic_module_on_http_filter_http_callout_done(filter_envoy_ptr,
/// filter_module_ptr, uint64_t callout_id, envoy_dynamic_module_type_http_callout_result result,
/// envoy_dynamic_module_type_envoy_http_header* headers, size_t headers_size,
/// envoy_dynamic_module_type_envoy_buffer* body_chunks, size_t body_chunks_size)`: never called
/// (no per-request callouts).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _callout_id: u64,
    _result: i32,
    _headers: *mut EnvoyHttpHeader,
    _headers_size: usize,
    _body_chunks: *mut EnvoyBuffer,
    _body_chunks_size: usize,
) {
}

/// `void envoy_dynamic_module_on_http_filter_http_stream_headers(filter_envoy_ptr,
/// filter_module_ptr, uint64_t stream_id, envoy_dynamic_module_type_envoy_http_header* headers,
/// size_t headers_size, bool end_stream)`: never called (no per-request streams).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _stream_id: u64,
    _headers: *mut EnvoyHttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

/// `void envoy_dynamic_module_on_http_filter_http_stream_data(filter_envoy_ptr, filter_module_ptr,
/// uint64_t stream_id, const envoy_dynamic_module_type_envoy_buffer* data, size_t data_count,
/// bool end_stream)`: never called.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

/// `void envoy_dynamic_module_on_http_filter_http_stream_trailers(filter_envoy_ptr,
/// filter_module_ptr, uint64_t stream_id, envoy_dynamic_module_type_envoy_http_header* trailers,
/// size_t trailers_size)`: never called.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _stream_id: u64,
    _trailers: *mut EnvoyHttpHeader,
    _trailers_size: usize,
) {
}

/// `void envoy_dynamic_module_on_http_filter_http_stream_complete(filter_envoy_ptr,
/// filter_module_ptr, uint64_t stream_id)`: never called.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _stream_id: u64,
) {
}

/// `void envoy_dynamic_module_on_http_filter_http_stream_reset(filter_envoy_ptr,
/// filter_module_ptr, uint64_t stream_id, envoy_dynamic_module_type_http_stream_reset_reason
/// reason)`: never called.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _stream_id: u64,
    _reason: i32,
) {
}

/// `void envoy_dynamic_module_on_http_filter_scheduled(filter_envoy_ptr, filter_module_ptr,
/// uint64_t event_id)`: never called (no scheduler).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
    _event_id: u64,
) {
}

/// `void envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
/// filter_envoy_ptr, filter_module_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
) {
}

/// `void envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
/// filter_envoy_ptr, filter_module_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _filter: FilterEnvoyPtr,
    _module: FilterModulePtr,
) {
}
