//! The hooks Envoy calls (`envoy_dynamic_module_on_*`): the program's start, a configuration's
//! life, and the twenty a filter must export (Envoy 1.40's `filter_config.cc` fails the
//! configuration on the first one missing). Each hands over to the worker's one
//! [`Dispatcher`], then carries out the answers it asked for ([`super::worker::Host::finish`]).
//!
//! A request's module pointer is its context id (never 0): nothing is allocated per request.
#![allow(clippy::missing_safety_doc)]

use super::calls;
use super::config::ModuleConfig;
use super::ffi::*;
use super::grpc;
use super::state::{Done, Native};
use super::worker::{self, Host, HOST};
use crate::core::config::Config;
use crate::host::abi::{Abi, Level, MetricKind};
use crate::host::dispatch::{Dispatcher, CONTINUE, PAUSE};
use crate::host::metrics::Metrics;
use log::error;
use std::cell::RefCell;
use std::ptr::null;
use std::sync::Arc;

thread_local! {
    /// The worker's dispatcher, made on its first request.
    static DISPATCHER: RefCell<Option<Dispatcher<Native>>> = const { RefCell::new(None) };
}

/// Runs `f` on the worker's dispatcher, then carries out the answers asked for; `default` if the
/// dispatcher is busy (a hook Envoy ran from inside a callback).
fn with<R>(default: R, f: impl FnOnce(&mut Dispatcher<Native>, &Host) -> R) -> R {
    let r = DISPATCHER.with(|cell| match cell.try_borrow_mut() {
        Ok(mut d) => {
            let d = d.get_or_insert_with(|| Dispatcher::new(Native));
            // What the main thread's callouts answered is read at the first callback after.
            HOST.with(|h| {
                h.collect(d);
                f(d, h)
            })
        }
        Err(_) => default,
    });
    HOST.with(Host::finish);
    r
}

/// As [`with`], after the worker's housekeeping: roots of destroyed configurations go, the ticks
/// that are due run. Done where a
/// worker's time passes: each new request, and the timer's event.
fn with_housekeeping<R>(default: R, f: impl FnOnce(&mut Dispatcher<Native>, &Host) -> R) -> R {
    with(default, |d, h| {
        h.prune(d);
        h.ticks(d);
        f(d, h)
    })
}

fn ctx(module: FilterModule) -> u32 {
    u32::try_from(module as usize).unwrap_or(0)
}

/// A request's hook: `f` runs as request `module`'s callback (the host acting on it); its status
/// as Envoy takes it (the dispatcher's and Envoy's numbering agree: Continue 0, then the stops).
fn on_request(
    module: FilterModule,
    f: impl FnOnce(&mut Dispatcher<Native>, &Host, u32) -> u32,
) -> i32 {
    let id = ctx(module);
    with(CONTINUE, |d, h| {
        h.enter(id);
        f(d, h, id)
    }) as i32
}

/// A request callback's status: the request waits unless it goes on.
fn waits_unless_continued(h: &Host, id: u32, status: u32) -> u32 {
    if status != CONTINUE {
        h.waits(id);
    }
    status
}

/// Log records go to Envoy's `dynamic_modules` logger.
struct Logger;

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        let level = Level::of_record(record.level());
        let message = format!("tollgate: {}", record.args());
        // SAFETY: a plain call with a buffer that outlives it.
        unsafe {
            envoy_dynamic_module_callback_log(level as i32, ModuleBuffer::of(message.as_bytes()))
        };
    }

    fn flush(&self) {}
}

static LOGGER: Logger = Logger;

fn sync_log_level() {
    if let Some(level) = Native.log_level() {
        log::set_max_level(level.filter());
    }
}

/// `envoy_dynamic_module_type_abi_version_module_ptr envoy_dynamic_module_on_program_init(void)`:
/// once, when Envoy loads the library.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const std::ffi::c_char {
    let _ = log::set_logger(&LOGGER);
    sync_log_level();
    ABI_VERSION.as_ptr().cast()
}

/// `envoy_dynamic_module_type_http_filter_config_module_ptr
/// envoy_dynamic_module_on_http_filter_config_new(filter_config_envoy_ptr,
/// envoy_dynamic_module_type_envoy_buffer name, envoy_dynamic_module_type_envoy_buffer config)`:
/// on the main thread. The configuration is the plugin's JSON, read and refused here as the wasm
/// build reads it (every refusal logged; null refuses it), and its metrics defined (only now may
/// they be).
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: ConfigEnvoy,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> ConfigModule {
    sync_log_level();
    // SAFETY: Envoy's buffer, valid for the call; copied.
    let json = unsafe { config.bytes() }.to_vec();
    let parsed = match Config::parse_all(&json) {
        Ok(c) => c,
        Err(refusals) => {
            for e in &refusals {
                error!("invalid configuration: {e}");
            }
            return null();
        }
    };
    let defined = worker::define_metrics(ModuleConfig::new(envoy, json), |n| {
        Metrics::define(n, &parsed).is_ok()
            && n.define_metric(MetricKind::Gauge, "tollgate.callouts.pending")
                .is_ok()
            && n.define_metric(MetricKind::Gauge, "tollgate.vm.memory_bytes")
                .is_ok()
    });
    match defined {
        Some(c) => {
            c.schedule_on_main();
            Arc::into_raw(Arc::new(c)).cast()
        }
        None => {
            error!("could not define metrics");
            null()
        }
    }
}

/// `void envoy_dynamic_module_on_http_filter_config_destroy(filter_config_ptr)`: the workers'
/// roots for it go at their next callback.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: ConfigModule) {
    // SAFETY: the pointer `config_new` made with `Arc::into_raw`, handed back once.
    let config = unsafe { Arc::from_raw(config.cast::<ModuleConfig>()) };
    config.destroyed();
}

/// `envoy_dynamic_module_type_http_filter_module_ptr envoy_dynamic_module_on_http_filter_new(
/// filter_config_ptr, filter_envoy_ptr)`: a request, on its worker.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: ConfigModule,
    filter: FilterEnvoy,
) -> FilterModule {
    // SAFETY: `config_new`'s pointer; Envoy keeps the configuration alive while its filters are.
    // Borrowed, not owned: the count is touched only when a worker keeps it (its first request).
    let config =
        std::mem::ManuallyDrop::new(unsafe { Arc::from_raw(config.cast::<ModuleConfig>()) });
    let id = with_housekeeping(0, |d, h| {
        let root = h.root(d, &config);
        h.open(d, root, filter)
    });
    // A context id of 0 (the dispatcher busy, which Envoy does not do) would read as null: Envoy
    // closes the stream.
    id as usize as FilterModule
}

/// `..._request_headers_status envoy_dynamic_module_on_http_filter_request_headers(
/// filter_envoy_ptr, filter_module_ptr, bool end_of_stream)`. A pause is Envoy's
/// `StopAllIterationAndWatermark`, as Envoy's wasm host makes of it: the body waits too; a request
/// answered locally in the hook stops (`StopIteration`, after Envoy sent the reply).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    _filter: FilterEnvoy,
    module: FilterModule,
    end_of_stream: bool,
) -> i32 {
    let id = ctx(module);
    with(CONTINUE as i32, |d, h| {
        h.enter(id);
        let s = d.on_request_headers(id, end_of_stream);
        if s == CONTINUE || h.take_resume(id) {
            return CONTINUE as i32;
        }
        if h.replies(id) {
            return STOP_ITERATION;
        }
        h.waits(id);
        if s == PAUSE {
            HEADERS_STOP_ALL
        } else {
            s as i32
        }
    })
}

/// `..._request_body_status envoy_dynamic_module_on_http_filter_request_body(filter_envoy_ptr,
/// filter_module_ptr, bool end_of_stream)`: the body so far is what Envoy buffered and what just
/// came.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    filter: FilterEnvoy,
    module: FilterModule,
    end_of_stream: bool,
) -> i32 {
    on_request(module, |d, h, id| {
        let size = super::abi::body_size(filter, true);
        waits_unless_continued(h, id, d.on_request_body(id, Some(size), end_of_stream))
    })
}

/// `..._request_trailers_status envoy_dynamic_module_on_http_filter_request_trailers(
/// filter_envoy_ptr, filter_module_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    _filter: FilterEnvoy,
    module: FilterModule,
) -> i32 {
    // Trailers have one stop (StopIteration, 1), whatever stop the dispatcher said.
    on_request(module, |d, h, id| {
        match waits_unless_continued(h, id, d.on_request_body(id, None, true)) {
            CONTINUE => CONTINUE,
            _ => PAUSE,
        }
    })
}

/// `..._response_headers_status envoy_dynamic_module_on_http_filter_response_headers(
/// filter_envoy_ptr, filter_module_ptr, bool end_of_stream)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    _filter: FilterEnvoy,
    module: FilterModule,
    end_of_stream: bool,
) -> i32 {
    on_request(module, |d, _, id| d.on_response_headers(id, end_of_stream))
}

/// `..._response_body_status envoy_dynamic_module_on_http_filter_response_body(filter_envoy_ptr,
/// filter_module_ptr, bool end_of_stream)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    filter: FilterEnvoy,
    module: FilterModule,
    end_of_stream: bool,
) -> i32 {
    on_request(module, |d, _, id| {
        d.on_response_body(id, super::abi::body_size(filter, false), end_of_stream)
    })
}

/// `..._response_trailers_status envoy_dynamic_module_on_http_filter_response_trailers(
/// filter_envoy_ptr, filter_module_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _filter: FilterEnvoy,
    module: FilterModule,
) -> i32 {
    on_request(module, |d, _, id| d.on_response_trailers(id))
}

/// `void envoy_dynamic_module_on_http_filter_stream_complete(filter_envoy_ptr,
/// filter_module_ptr)`: the request is over. From here Envoy's filter must not be resumed nor
/// answered (its callbacks are going), so the request leaves the worker now; its callouts, which
/// Envoy cancels when it destroys the filter, go again on another request or end here.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _filter: FilterEnvoy,
    module: FilterModule,
) {
    let id = ctx(module);
    with((), |d, h| h.close(d, id));
}

/// `void envoy_dynamic_module_on_http_filter_destroy(filter_module_ptr)`: a request that never
/// completed (its stream was never started) leaves here; one that did is already gone.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module: FilterModule) {
    let id = ctx(module);
    if HOST.with(|h| h.is_open(id)) {
        with((), |d, h| h.close(d, id));
    }
}

/// `void envoy_dynamic_module_on_http_filter_http_callout_done(filter_envoy_ptr,
/// filter_module_ptr, uint64_t callout_id, envoy_dynamic_module_type_http_callout_result result,
/// envoy_dynamic_module_type_envoy_http_header* headers, size_t headers_size,
/// envoy_dynamic_module_type_envoy_buffer* body_chunks, size_t body_chunks_size)`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _filter: FilterEnvoy,
    module: FilterModule,
    callout_id: u64,
    result: i32,
    headers: *mut EnvoyHeader,
    headers_size: usize,
    body_chunks: *mut EnvoyBuffer,
    body_chunks_size: usize,
) {
    let id = ctx(module);
    // SAFETY: Envoy's arrays of that many items, valid for the call (null when it failed).
    let done = unsafe {
        Done {
            result,
            headers: worker::slice(headers, headers_size),
            chunks: worker::slice(body_chunks, body_chunks_size),
        }
    };
    with((), |d, h| h.answered(d, id, callout_id, done));
}

/// `void envoy_dynamic_module_on_http_filter_scheduled(filter_envoy_ptr, filter_module_ptr,
/// uint64_t event_id)`: the timer thread's post (the ticks due run on entry).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _filter: FilterEnvoy,
    _module: FilterModule,
    _event_id: u64,
) {
    if let Some(w) = HOST.with(|h| h.wake.borrow().clone()) {
        w.ran();
    }
    with_housekeeping((), |_, _| ());
}

/// `void envoy_dynamic_module_on_http_filter_config_scheduled(filter_config_envoy_ptr,
/// filter_config_ptr, uint64_t event_id)`: on the main thread, woken by a worker with callouts no
/// request carries.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _envoy: ConfigEnvoy,
    _config: ConfigModule,
    _event_id: u64,
) {
    calls::send_queued();
}

/// `void envoy_dynamic_module_on_http_filter_config_http_callout_done(filter_config_envoy_ptr,
/// filter_config_ptr, uint64_t callout_id, envoy_dynamic_module_type_http_callout_result result,
/// envoy_dynamic_module_type_envoy_http_header* headers, size_t headers_size,
/// envoy_dynamic_module_type_envoy_buffer* body_chunks, size_t body_chunks_size)`: on the main
/// thread; the answer goes to the worker whose callout it was.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    envoy: ConfigEnvoy,
    _config: ConfigModule,
    callout_id: u64,
    result: i32,
    headers: *mut EnvoyHeader,
    headers_size: usize,
    body_chunks: *mut EnvoyBuffer,
    body_chunks_size: usize,
) {
    // SAFETY: Envoy's arrays of that many items, valid for the call (null when it failed).
    let done = unsafe {
        Done {
            result,
            headers: worker::slice(headers, headers_size),
            chunks: worker::slice(body_chunks, body_chunks_size),
        }
    };
    calls::main_done(envoy, callout_id, done);
}

/// The gRPC status and message in a stream's headers or trailers, if they carry one.
fn said(headers: &[EnvoyHeader]) -> Option<(u32, Option<String>)> {
    let pairs: Vec<(&[u8], &[u8])> = headers
        .iter()
        // SAFETY: Envoy's headers, valid for the hook.
        .map(|h| unsafe { h.pair() })
        .collect();
    let code = pairs
        .iter()
        .find(|(k, _)| *k == b"grpc-status")
        .map(|_| grpc::status_of(pairs.iter().copied()))?;
    let message = pairs
        .iter()
        .find(|(k, _)| *k == b"grpc-message")
        .map(|(_, v)| String::from_utf8_lossy(v).into_owned());
    code.map(|c| (c, message))
}

/// `void envoy_dynamic_module_on_http_filter_config_http_stream_headers(filter_config_envoy_ptr,
/// filter_config_ptr, uint64_t stream_id, envoy_dynamic_module_type_envoy_http_header* headers,
/// size_t headers_size, bool end_stream)`: on the worker that opened the stream (`stream.rs`).
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_headers(
    envoy: ConfigEnvoy,
    _config: ConfigModule,
    stream_id: u64,
    headers: *mut EnvoyHeader,
    headers_size: usize,
    _end_stream: bool,
) {
    // SAFETY: Envoy's array of that many headers, valid for the call.
    let status = said(unsafe { worker::slice(headers, headers_size) });
    HOST.with(|h| h.stream_status(envoy, stream_id, status));
}

/// `void envoy_dynamic_module_on_http_filter_config_http_stream_data(filter_config_envoy_ptr,
/// filter_config_ptr, uint64_t stream_id, const envoy_dynamic_module_type_envoy_buffer* data,
/// size_t data_count, bool end_stream)`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_data(
    envoy: ConfigEnvoy,
    _config: ConfigModule,
    stream_id: u64,
    data: *const EnvoyBuffer,
    data_count: usize,
    _end_stream: bool,
) {
    // SAFETY: Envoy's array of that many buffers, valid for the call.
    let chunks = unsafe { worker::slice(data, data_count) };
    with((), |d, h| {
        for c in chunks {
            // SAFETY: Envoy's buffer, valid for the call.
            h.stream_data(d, envoy, stream_id, unsafe { c.bytes() });
        }
    });
}

/// `void envoy_dynamic_module_on_http_filter_config_http_stream_trailers(filter_config_envoy_ptr,
/// filter_config_ptr, uint64_t stream_id, envoy_dynamic_module_type_envoy_http_header* trailers,
/// size_t trailers_size)`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_trailers(
    envoy: ConfigEnvoy,
    _config: ConfigModule,
    stream_id: u64,
    trailers: *mut EnvoyHeader,
    trailers_size: usize,
) {
    // SAFETY: Envoy's array of that many trailers, valid for the call.
    let status = said(unsafe { worker::slice(trailers, trailers_size) });
    HOST.with(|h| h.stream_status(envoy, stream_id, status));
}

/// `void envoy_dynamic_module_on_http_filter_config_http_stream_complete(filter_config_envoy_ptr,
/// filter_config_ptr, uint64_t stream_id)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_complete(
    envoy: ConfigEnvoy,
    _config: ConfigModule,
    stream_id: u64,
) {
    with((), |d, h| h.stream_end(d, envoy, stream_id, false));
}

/// `void envoy_dynamic_module_on_http_filter_config_http_stream_reset(filter_config_envoy_ptr,
/// filter_config_ptr, uint64_t stream_id, envoy_dynamic_module_type_http_stream_reset_reason
/// reason)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_reset(
    envoy: ConfigEnvoy,
    _config: ConfigModule,
    stream_id: u64,
    _reason: i32,
) {
    with((), |d, h| h.stream_end(d, envoy, stream_id, true));
}

// The request's own streams (never opened) and the downstream's watermarks: nothing to do.

/// `void envoy_dynamic_module_on_http_filter_http_stream_headers(filter_envoy_ptr,
/// filter_module_ptr, uint64_t stream_id, envoy_dynamic_module_type_envoy_http_header* headers,
/// size_t headers_size, bool end_stream)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _filter: FilterEnvoy,
    _module: FilterModule,
    _stream_id: u64,
    _headers: *mut EnvoyHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

/// `void envoy_dynamic_module_on_http_filter_http_stream_data(filter_envoy_ptr, filter_module_ptr,
/// uint64_t stream_id, const envoy_dynamic_module_type_envoy_buffer* data, size_t data_count,
/// bool end_stream)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _filter: FilterEnvoy,
    _module: FilterModule,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

/// `void envoy_dynamic_module_on_http_filter_http_stream_trailers(filter_envoy_ptr,
/// filter_module_ptr, uint64_t stream_id, envoy_dynamic_module_type_envoy_http_header* trailers,
/// size_t trailers_size)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _filter: FilterEnvoy,
    _module: FilterModule,
    _stream_id: u64,
    _trailers: *mut EnvoyHeader,
    _trailers_size: usize,
) {
}

/// `void envoy_dynamic_module_on_http_filter_http_stream_complete(filter_envoy_ptr,
/// filter_module_ptr, uint64_t stream_id)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _filter: FilterEnvoy,
    _module: FilterModule,
    _stream_id: u64,
) {
}

/// `void envoy_dynamic_module_on_http_filter_http_stream_reset(filter_envoy_ptr,
/// filter_module_ptr, uint64_t stream_id, envoy_dynamic_module_type_http_stream_reset_reason
/// reason)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _filter: FilterEnvoy,
    _module: FilterModule,
    _stream_id: u64,
    _reason: i32,
) {
}

/// `void envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
/// filter_envoy_ptr, filter_module_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _filter: FilterEnvoy,
    _module: FilterModule,
) {
}

/// `void envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
/// filter_envoy_ptr, filter_module_ptr)`.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _filter: FilterEnvoy,
    _module: FilterModule,
) {
}
