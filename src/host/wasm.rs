//! The module's side of the proxy-wasm ABI (0.2.1): the host functions it imports from Envoy
//! (module `env`), the `proxy_on_*` callbacks it exports, the allocator the host writes through,
//! the logger and the panic hook. Each export hands over to the VM's one [`Dispatcher`].
//!
//! Only the callbacks the filter needs are exported: Envoy skips the VM call for the others
//! (response body and trailers, access log, `on_done`), which is per-request work saved.
//!
//! Memory the host returns was allocated through [`proxy_on_memory_allocate`] as a boxed slice of
//! exactly the requested size, so it is taken back with `Vec::from_raw_parts(p, n, n)`.

use super::abi::{self, Abi, Buffer, HeaderMap, Level, MetricKind, Status};
use super::dispatch::{Dispatcher, CONTINUE};
use crate::core::base::hostmap;
use crate::core::base::store::SetError;
use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::ptr::{null, null_mut};

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_log_level(return_level: *mut u32) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_add_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: u32,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
    fn proxy_http_call(
        upstream_data: *const u8,
        upstream_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        body_data: *const u8,
        body_size: usize,
        trailers_data: *const u8,
        trailers_size: usize,
        timeout: u32,
        return_token: *mut u32,
    ) -> u32;
    fn proxy_grpc_call(
        upstream_data: *const u8,
        upstream_size: usize,
        service_name_data: *const u8,
        service_name_size: usize,
        method_name_data: *const u8,
        method_name_size: usize,
        initial_metadata_data: *const u8,
        initial_metadata_size: usize,
        message_data: *const u8,
        message_size: usize,
        timeout: u32,
        return_token: *mut u32,
    ) -> u32;
    fn proxy_grpc_stream(
        upstream_data: *const u8,
        upstream_size: usize,
        service_name_data: *const u8,
        service_name_size: usize,
        method_name_data: *const u8,
        method_name_size: usize,
        initial_metadata_data: *const u8,
        initial_metadata_size: usize,
        return_token: *mut u32,
    ) -> u32;
    fn proxy_grpc_send(
        token: u32,
        message_data: *const u8,
        message_size: usize,
        end_stream: u32,
    ) -> u32;
    fn proxy_grpc_cancel(token: u32) -> u32;
    fn proxy_get_status(
        return_code: *mut u32,
        return_message_data: *mut *mut u8,
        return_message_size: *mut usize,
    ) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
}

/// Takes ownership of a host-allocated buffer.
fn owned(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() || size == 0 {
        return Vec::new();
    }
    // SAFETY: the host wrote `size` bytes into a buffer it obtained from this module's allocator
    // (`proxy_on_memory_allocate`, a boxed slice of exactly `size` bytes), and hands it to us.
    unsafe { Vec::from_raw_parts(data, size, size) }
}

fn result(status: u32) -> Result<(), Status> {
    if status == abi::OK {
        Ok(())
    } else {
        Err(status)
    }
}

/// A host call that returns a buffer through out-pointers: the buffer if the status is `Ok`.
fn fetch(call: impl FnOnce(*mut *mut u8, *mut usize) -> u32) -> Result<Vec<u8>, Status> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    let status = call(&mut data, &mut size);
    let bytes = owned(data, size);
    result(status).map(|()| bytes)
}

/// Pairs in the host's map format.
fn map(pairs: &[(&str, &str)]) -> Vec<u8> {
    let owned: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect();
    hostmap::serialize(&owned)
}

/// The proxy-wasm imports of the running Envoy.
pub struct Envoy;

impl Abi for Envoy {
    fn log_level(&self) -> Option<Level> {
        let mut level = 0u32;
        // SAFETY: plain host call with an out-pointer to a local.
        let status = unsafe { proxy_get_log_level(&mut level) };
        result(status).ok().map(|()| Level::from_host(level))
    }

    fn memory_bytes(&self) -> u64 {
        let pages = core::arch::wasm32::memory_size(0);
        u64::try_from(pages).unwrap_or(0).saturating_mul(65_536)
    }

    fn now_ms(&self) -> u64 {
        let mut ns = 0u64;
        // SAFETY: plain host call with an out-pointer to a local.
        let status = unsafe { proxy_get_current_time_nanoseconds(&mut ns) };
        if status == abi::OK {
            ns / 1_000_000
        } else {
            0
        }
    }

    fn buffer(&self, which: Buffer, start: usize, size: usize) -> Vec<u8> {
        // SAFETY: plain host call with out-pointers to `fetch`'s locals.
        fetch(|d, s| unsafe { proxy_get_buffer_bytes(which as u32, start, size, d, s) })
            .unwrap_or_default()
    }

    fn header(&self, map: HeaderMap, name: &str) -> Option<Vec<u8>> {
        // SAFETY: pointers into a live borrowed string and out-pointers to `fetch`'s locals.
        fetch(|d, s| unsafe {
            proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), d, s)
        })
        .ok()
    }

    fn headers(&self, map: HeaderMap) -> Option<Vec<(String, Vec<u8>)>> {
        // SAFETY: plain host call with out-pointers to `fetch`'s locals.
        let bytes = fetch(|d, s| unsafe { proxy_get_header_map_pairs(map as u32, d, s) }).ok()?;
        hostmap::parse(&bytes)
    }

    fn add_header(&self, map: HeaderMap, name: &str, value: &str) -> Result<(), Status> {
        // SAFETY: plain host call with pointers into live borrowed strings.
        result(unsafe {
            proxy_add_header_map_value(
                map as u32,
                name.as_ptr(),
                name.len(),
                value.as_ptr(),
                value.len(),
            )
        })
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        let mut joined = String::new();
        for (i, p) in path.iter().enumerate() {
            if i > 0 {
                joined.push('\0');
            }
            joined.push_str(p);
        }
        // SAFETY: a pointer into a live local string and out-pointers to `fetch`'s locals.
        fetch(|d, s| unsafe { proxy_get_property(joined.as_ptr(), joined.len(), d, s) }).ok()
    }

    fn shared_get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        let mut cas = 0u32;
        // SAFETY: a pointer into a live borrowed string and out-pointers to locals.
        let value =
            fetch(|d, s| unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), d, s, &mut cas) })
                .ok()?;
        Some((value, cas))
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        // SAFETY: plain host call with pointers into live borrowed buffers.
        let status = unsafe {
            proxy_set_shared_data(
                key.as_ptr(),
                key.len(),
                value.as_ptr(),
                value.len(),
                cas.unwrap_or(0),
            )
        };
        match status {
            abi::OK => Ok(()),
            abi::CAS_MISMATCH => Err(SetError::CasMismatch),
            _ => Err(SetError::Other),
        }
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, Status> {
        let mut id = 0u32;
        // SAFETY: a pointer into a live borrowed string and an out-pointer to a local.
        let status =
            unsafe { proxy_define_metric(kind as u32, name.as_ptr(), name.len(), &mut id) };
        result(status).map(|()| id)
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        // SAFETY: plain host call.
        let _ = unsafe { proxy_increment_metric(id, delta) };
    }

    fn record_metric(&self, id: u32, value: u64) {
        // SAFETY: plain host call.
        let _ = unsafe { proxy_record_metric(id, value) };
    }

    fn http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, Status> {
        let headers = map(headers);
        let trailers = map(&[]);
        let mut token = 0u32;
        // SAFETY: pointers into live local and borrowed buffers, an out-pointer to a local.
        let status = unsafe {
            proxy_http_call(
                cluster.as_ptr(),
                cluster.len(),
                headers.as_ptr(),
                headers.len(),
                body.as_ptr(),
                body.len(),
                trailers.as_ptr(),
                trailers.len(),
                timeout_ms,
                &mut token,
            )
        };
        result(status).map(|()| token)
    }

    fn grpc_call(
        &self,
        service: &[u8],
        service_name: &str,
        method: &str,
        metadata: &[(&str, &str)],
        message: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, Status> {
        let metadata = map(metadata);
        let mut token = 0u32;
        // SAFETY: pointers into live local and borrowed buffers, an out-pointer to a local.
        let status = unsafe {
            proxy_grpc_call(
                service.as_ptr(),
                service.len(),
                service_name.as_ptr(),
                service_name.len(),
                method.as_ptr(),
                method.len(),
                metadata.as_ptr(),
                metadata.len(),
                message.as_ptr(),
                message.len(),
                timeout_ms,
                &mut token,
            )
        };
        result(status).map(|()| token)
    }

    fn grpc_stream(
        &self,
        service: &[u8],
        service_name: &str,
        method: &str,
        metadata: &[(&str, &str)],
    ) -> Result<u32, Status> {
        let metadata = map(metadata);
        let mut token = 0u32;
        // SAFETY: pointers into live local and borrowed buffers, an out-pointer to a local.
        let status = unsafe {
            proxy_grpc_stream(
                service.as_ptr(),
                service.len(),
                service_name.as_ptr(),
                service_name.len(),
                method.as_ptr(),
                method.len(),
                metadata.as_ptr(),
                metadata.len(),
                &mut token,
            )
        };
        result(status).map(|()| token)
    }

    fn grpc_send(&self, token: u32, message: &[u8]) -> Result<(), Status> {
        // SAFETY: a pointer into a live borrowed buffer; 0: the stream stays open.
        result(unsafe { proxy_grpc_send(token, message.as_ptr(), message.len(), 0) })
    }

    fn grpc_cancel(&self, token: u32) -> Result<(), Status> {
        // SAFETY: plain host call.
        result(unsafe { proxy_grpc_cancel(token) })
    }

    fn grpc_status_message(&self) -> Option<String> {
        let mut code = 0u32;
        // SAFETY: plain host call with out-pointers to locals.
        let bytes = fetch(|d, s| unsafe { proxy_get_status(&mut code, d, s) }).ok()?;
        if bytes.is_empty() {
            return None;
        }
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn set_tick_period(&self, period_ms: u32) -> Result<(), Status> {
        // SAFETY: plain host call.
        result(unsafe { proxy_set_tick_period_milliseconds(period_ms) })
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), Status> {
        // SAFETY: plain host call.
        result(unsafe { proxy_set_effective_context(context_id) })
    }

    fn resume_request(&self) -> Result<(), Status> {
        // SAFETY: plain host call; 0 = the HTTP request stream.
        result(unsafe { proxy_continue_stream(0) })
    }

    fn send_local_response(
        &self,
        status: u32,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<(), Status> {
        let map = hostmap::serialize(headers);
        // SAFETY: pointers into live local buffers; -1 = no explicit gRPC status (Envoy derives
        // one for gRPC clients).
        result(unsafe {
            proxy_send_local_response(
                status,
                null(),
                0,
                body.as_ptr(),
                body.len(),
                map.as_ptr(),
                map.len(),
                -1,
            )
        })
    }
}

/// Log records go to Envoy's `wasm` logger; `log::max_level` follows Envoy's level for it, so
/// disabled levels are not even formatted.
struct Logger;

fn log_to_host(level: Level, message: &str) {
    // SAFETY: plain host call with a pointer into a live borrowed string.
    let _ = unsafe { proxy_log(level as u32, message.as_ptr(), message.len()) };
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        let level = Level::of_record(record.level());
        log_to_host(level, &record.args().to_string());
    }

    fn flush(&self) {}
}

static LOGGER: Logger = Logger;

thread_local! {
    static DISPATCHER: RefCell<Dispatcher<Envoy>> = RefCell::new(Dispatcher::new(Envoy));
}

/// Runs `f` on the dispatcher; `default` if it is busy (a host that re-entered the module from
/// inside a callback, which Envoy does not do: it defers such calls).
fn with<R>(default: R, f: impl FnOnce(&mut Dispatcher<Envoy>) -> R) -> R {
    DISPATCHER.with(|d| match d.try_borrow_mut() {
        Ok(mut d) => f(&mut d),
        Err(_) => default,
    })
}

fn size(n: u32) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

extern "C" {
    fn __wasm_call_ctors();
}

/// The reactor's entry point: runs the static constructors, then sets up logging and the panic
/// hook (a panic would end every request on this worker; it must at least be logged).
#[no_mangle]
pub extern "C" fn _initialize() {
    // SAFETY: called once by the host, before any other export, as the reactor ABI requires.
    unsafe { __wasm_call_ctors() };
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Info);
    std::panic::set_hook(Box::new(|info| {
        log_to_host(Level::Critical, &format!("panic: {info}"));
    }));
}

/// The ABI version this module speaks.
#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// The host allocates the buffers it hands the module here: a boxed slice of exactly `size`.
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let mut buf: Vec<MaybeUninit<u8>> = Vec::with_capacity(size);
    // SAFETY: capacity is exactly `size` (`with_capacity`'s guarantee) and `MaybeUninit` needs no
    // initialisation; the host fills the bytes before handing the buffer back.
    unsafe { buf.set_len(size) };
    Box::into_raw(buf.into_boxed_slice()).cast::<u8>()
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(context_id: u32, parent_id: u32) {
    with((), |d| d.on_context_create(context_id, parent_id));
}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_context_id: u32, _vm_configuration_size: u32) -> u32 {
    u32::from(with(false, |d| d.on_vm_start()))
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(context_id: u32, configuration_size: u32) -> u32 {
    u32::from(with(false, |d| {
        d.on_configure(context_id, size(configuration_size))
    }))
}

/// `end_of_stream`: no body follows. A pause here is turned by the host (proxy-wasm-cpp-host,
/// `convertVmCallResultToFilterHeadersStatus`) into Envoy's `StopAllIterationAndWatermark`: the
/// body is then held from the module too, so a request that waits for its body's model lets its
/// headers go on ([`Dispatcher::on_request_headers`]).
#[no_mangle]
pub extern "C" fn proxy_on_request_headers(context_id: u32, _headers: u32, eos: u32) -> u32 {
    with(CONTINUE, |d| d.on_request_headers(context_id, eos != 0))
}

/// `body_size`: the body buffered so far, all of it when the previous call paused (Envoy adds
/// each piece to the buffered body before the call; a pause is `StopIterationAndBuffer`).
#[no_mangle]
pub extern "C" fn proxy_on_request_body(context_id: u32, body_size: u32, eos: u32) -> u32 {
    with(CONTINUE, |d| {
        d.on_request_body(context_id, Some(size(body_size)), eos != 0)
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(context_id: u32, _trailers: u32) -> u32 {
    with(CONTINUE, |d| d.on_request_body(context_id, None, true))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(context_id: u32, _headers: u32, eos: u32) -> u32 {
    with(CONTINUE, |d| d.on_response_headers(context_id, eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(context_id: u32, body_size: u32, eos: u32) -> u32 {
    with(CONTINUE, |d| {
        d.on_response_body(context_id, size(body_size), eos != 0)
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_response_trailers(context_id: u32, _trailers: u32) -> u32 {
    with(CONTINUE, |d| d.on_response_trailers(context_id))
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(context_id: u32) {
    with((), |d| d.on_delete(context_id));
}

#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(
    _context_id: u32,
    token: u32,
    headers: u32,
    body_size: u32,
    _trailers: u32,
) {
    with((), |d| {
        d.on_http_call_response(token, size(headers), size(body_size))
    });
}

#[no_mangle]
pub extern "C" fn proxy_on_grpc_receive(_context_id: u32, token: u32, response_size: u32) {
    with((), |d| d.on_grpc_receive(token, size(response_size)));
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(context_id: u32) {
    with((), |d| d.on_tick(context_id));
}

#[no_mangle]
pub extern "C" fn proxy_on_grpc_close(_context_id: u32, token: u32, status: u32) {
    with((), |d| d.on_grpc_close(token, status));
}
