//! Our bindings of the part of Envoy's dynamic module ABI the native build speaks, written from
//! `source/extensions/dynamic_modules/abi/abi.h` (the C header every module is built against; the
//! 1.38 and 1.39 headers declare each item below identically, and 1.40, whose ABI string is
//! "v0.2.0", only adds). Envoy resolves the module's hooks by name and calls them through its own
//! prototypes, and the module calls the callbacks Envoy's binary exports: nothing checks a
//! parameter list at load time, so each item names the C declaration it mirrors.
//!
//! - Envoy's objects (`*_envoy_ptr`) and the module's (`*_module_ptr`) are opaque pointers.
//! - C enums cross as `i32`/`u32`: a value Envoy adds later can never be an invalid Rust enum.
//! - Buffers Envoy passes (`envoy_buffer`, `envoy_http_header`) are valid for the call only.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_void};

/// The ABI version the module was built against (Envoy 1.40.0's `ENVOY_DYNAMIC_MODULES_ABI_VERSION`):
/// Envoy logs "matched" for it, or a warning, and loads the module either way.
pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// `envoy_dynamic_module_type_http_filter_config_envoy_ptr` (`void*`).
pub type ConfigEnvoy = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_config_module_ptr` (`const void*`).
pub type ConfigModule = *const c_void;
/// `envoy_dynamic_module_type_http_filter_envoy_ptr` (`void*`): valid until the filter's destroy hook.
pub type FilterEnvoy = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_module_ptr` (`const void*`).
pub type FilterModule = *const c_void;
/// `envoy_dynamic_module_type_http_filter_scheduler_module_ptr` (`void*`): Envoy allocates it, the
/// module deletes it.
pub type Scheduler = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_config_scheduler_module_ptr` (`void*`): the same for a
/// configuration's scheduler, whose events run on the main thread.
pub type ConfigScheduler = *mut c_void;

/// `envoy_dynamic_module_type_envoy_buffer`: bytes Envoy owns.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

impl EnvoyBuffer {
    pub const EMPTY: EnvoyBuffer = EnvoyBuffer {
        ptr: std::ptr::null(),
        length: 0,
    };

    /// The bytes, for as long as Envoy keeps them (the hook or callback that handed them over).
    ///
    /// # Safety
    /// `ptr` must point to `length` readable bytes for `'a`, or be null.
    pub unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            &[]
        } else {
            // SAFETY: the caller's promise.
            unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.length) }
        }
    }
}

/// `envoy_dynamic_module_type_module_buffer`: bytes the module owns, read during the call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

impl ModuleBuffer {
    pub fn of(bytes: &[u8]) -> ModuleBuffer {
        ModuleBuffer {
            ptr: bytes.as_ptr().cast(),
            length: bytes.len(),
        }
    }
}

/// `envoy_dynamic_module_type_module_http_header`: a header the module owns.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

impl ModuleHeader {
    pub fn of(key: &[u8], value: &[u8]) -> ModuleHeader {
        ModuleHeader {
            key_ptr: key.as_ptr().cast(),
            key_length: key.len(),
            value_ptr: value.as_ptr().cast(),
            value_length: value.len(),
        }
    }
}

/// `envoy_dynamic_module_type_envoy_http_header`: a header Envoy owns.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

impl EnvoyHeader {
    /// Name and value.
    ///
    /// # Safety
    /// Both pointers must be valid for their lengths for `'a` (or null).
    pub unsafe fn pair<'a>(&self) -> (&'a [u8], &'a [u8]) {
        // SAFETY: the caller's promise.
        unsafe {
            (
                EnvoyBuffer {
                    ptr: self.key_ptr,
                    length: self.key_length,
                }
                .bytes(),
                EnvoyBuffer {
                    ptr: self.value_ptr,
                    length: self.value_length,
                }
                .bytes(),
            )
        }
    }
}

/// `envoy_dynamic_module_type_http_header_type`.
pub const REQUEST_HEADER: i32 = 0;
pub const RESPONSE_HEADER: i32 = 2;
/// `envoy_dynamic_module_type_http_body_type`.
pub const RECEIVED_REQUEST_BODY: i32 = 0;
pub const BUFFERED_REQUEST_BODY: i32 = 1;
pub const RECEIVED_RESPONSE_BODY: i32 = 2;
pub const BUFFERED_RESPONSE_BODY: i32 = 3;
/// `envoy_dynamic_module_type_log_level`: Trace 0 .. Critical 5, Off 6.
pub const LOG_OFF: i32 = 6;
/// `envoy_dynamic_module_type_http_callout_init_result_Success`.
pub const CALLOUT_INIT_SUCCESS: i32 = 0;
/// `envoy_dynamic_module_type_http_callout_result`: Success 0, Reset 1, ExceedResponseBufferLimit 2.
pub const CALLOUT_SUCCESS: i32 = 0;
pub const CALLOUT_TOO_LARGE: i32 = 2;
/// `envoy_dynamic_module_type_metrics_result_Success`.
pub const METRICS_SUCCESS: i32 = 0;
/// `envoy_dynamic_module_type_metadata_source_Dynamic`: the stream's dynamic metadata.
pub const METADATA_DYNAMIC: i32 = 0;
/// `envoy_dynamic_module_type_attribute_id`: `source.address` (24).
pub const ATTRIBUTE_SOURCE_ADDRESS: i32 = 24;
/// `..._on_http_filter_request_headers_status_StopIteration`: after a local reply.
pub const STOP_ITERATION: i32 = 1;
/// `..._on_http_filter_request_headers_status_StopAllIterationAndWatermark`: what Envoy's wasm
/// host makes of a proxy-wasm pause in request headers, so the body waits for the module too.
pub const HEADERS_STOP_ALL: i32 = 4;

extern "C" {
    /// `void envoy_dynamic_module_callback_log(envoy_dynamic_module_type_log_level level,
    /// envoy_dynamic_module_type_module_buffer message)`: Envoy's `dynamic_modules` logger.
    pub fn envoy_dynamic_module_callback_log(level: i32, message: ModuleBuffer);

    /// `envoy_dynamic_module_type_log_level envoy_dynamic_module_callback_get_log_level(void)`
    /// (added in 1.40): the `dynamic_modules` logger's level.
    pub fn envoy_dynamic_module_callback_get_log_level() -> i32;

    /// `bool envoy_dynamic_module_callback_http_get_header(filter_envoy_ptr,
    /// envoy_dynamic_module_type_http_header_type header_type,
    /// envoy_dynamic_module_type_module_buffer key, envoy_dynamic_module_type_envoy_buffer*
    /// result_buffer, size_t index, size_t* optional_size)`: value `index` of a header.
    pub fn envoy_dynamic_module_callback_http_get_header(
        filter: FilterEnvoy,
        header_type: i32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;

    /// `size_t envoy_dynamic_module_callback_http_get_headers_size(filter_envoy_ptr, header_type)`.
    pub fn envoy_dynamic_module_callback_http_get_headers_size(
        filter: FilterEnvoy,
        header_type: i32,
    ) -> usize;

    /// `bool envoy_dynamic_module_callback_http_get_headers(filter_envoy_ptr, header_type,
    /// envoy_dynamic_module_type_envoy_http_header* result_headers)`: the caller sizes the array
    /// with `get_headers_size`.
    pub fn envoy_dynamic_module_callback_http_get_headers(
        filter: FilterEnvoy,
        header_type: i32,
        result: *mut EnvoyHeader,
    ) -> bool;

    /// `bool envoy_dynamic_module_callback_http_add_header(filter_envoy_ptr, header_type,
    /// envoy_dynamic_module_type_module_buffer key, envoy_dynamic_module_type_module_buffer value)`:
    /// appends a value.
    pub fn envoy_dynamic_module_callback_http_add_header(
        filter: FilterEnvoy,
        header_type: i32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;

    /// `size_t envoy_dynamic_module_callback_http_get_body_size(filter_envoy_ptr,
    /// envoy_dynamic_module_type_http_body_type body_type)`.
    pub fn envoy_dynamic_module_callback_http_get_body_size(
        filter: FilterEnvoy,
        body_type: i32,
    ) -> usize;

    /// `size_t envoy_dynamic_module_callback_http_get_body_chunks_size(filter_envoy_ptr, body_type)`.
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter: FilterEnvoy,
        body_type: i32,
    ) -> usize;

    /// `bool envoy_dynamic_module_callback_http_get_body_chunks(filter_envoy_ptr, body_type,
    /// envoy_dynamic_module_type_envoy_buffer* result_buffer_vector)`.
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: FilterEnvoy,
        body_type: i32,
        result: *mut EnvoyBuffer,
    ) -> bool;

    /// `bool envoy_dynamic_module_callback_http_filter_get_attribute_string(filter_envoy_ptr,
    /// envoy_dynamic_module_type_attribute_id attribute_id, envoy_dynamic_module_type_envoy_buffer*
    /// result)`.
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: FilterEnvoy,
        attribute: i32,
        result: *mut EnvoyBuffer,
    ) -> bool;

    /// `void envoy_dynamic_module_callback_http_send_response(filter_envoy_ptr, uint32_t
    /// status_code, envoy_dynamic_module_type_module_http_header* headers_vector, size_t
    /// headers_vector_size, envoy_dynamic_module_type_module_buffer body,
    /// envoy_dynamic_module_type_module_buffer details)`: a local reply, carried out at once; the
    /// filter's own response hooks are not called for it.
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter: FilterEnvoy,
        status: u32,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );

    /// `void envoy_dynamic_module_callback_http_filter_continue_decoding(filter_envoy_ptr)`:
    /// resumes a request whose last request hook did not return Continue.
    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: FilterEnvoy);

    /// `envoy_dynamic_module_type_http_callout_init_result
    /// envoy_dynamic_module_callback_http_filter_http_callout(filter_envoy_ptr, uint64_t*
    /// callout_id_out, envoy_dynamic_module_type_module_buffer cluster_name,
    /// envoy_dynamic_module_type_module_http_header* headers, size_t headers_size,
    /// envoy_dynamic_module_type_module_buffer body, uint64_t timeout_milliseconds)`: a callout the
    /// filter owns, on its worker's async client; its answer comes to the filter's
    /// `on_http_filter_http_callout_done`, and a filter destroyed first cancels it silently.
    /// Needs `:method`, `:path` and `host`.
    pub fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter: FilterEnvoy,
        callout_id_out: *mut u64,
        cluster: ModuleBuffer,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> i32;

    /// `envoy_dynamic_module_type_metrics_result
    /// envoy_dynamic_module_callback_http_filter_config_define_counter(filter_config_envoy_ptr,
    /// envoy_dynamic_module_type_module_buffer name, envoy_dynamic_module_type_module_buffer*
    /// label_names, size_t label_names_length, size_t* counter_id_ptr)`: only during
    /// `on_http_filter_config_new` (Frozen after).
    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: ConfigEnvoy,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id: *mut usize,
    ) -> i32;

    /// `..._http_filter_config_define_gauge`: as `define_counter`.
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: ConfigEnvoy,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id: *mut usize,
    ) -> i32;

    /// `envoy_dynamic_module_type_metrics_result
    /// envoy_dynamic_module_callback_http_filter_config_increment_counter(filter_config_envoy_ptr,
    /// size_t id, envoy_dynamic_module_type_module_buffer* label_values, size_t
    /// label_values_length, uint64_t value)` (1.39+): from any hook, no request needed.
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: ConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> i32;

    /// `..._http_filter_config_increment_gauge`: as `increment_counter`.
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(
        config: ConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> i32;

    /// `..._http_filter_config_decrement_gauge`: as `increment_counter`.
    pub fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
        config: ConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> i32;

    /// `..._http_filter_config_set_gauge`: as `increment_counter`.
    pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: ConfigEnvoy,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> i32;

    /// `envoy_dynamic_module_type_http_filter_scheduler_module_ptr
    /// envoy_dynamic_module_callback_http_filter_scheduler_new(filter_envoy_ptr)`: on the filter's
    /// worker; the module deletes it.
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(
        filter: FilterEnvoy,
    ) -> Scheduler;

    /// `void envoy_dynamic_module_callback_http_filter_scheduler_commit(scheduler_module_ptr,
    /// uint64_t event_id)`: from any thread; posts `on_http_filter_scheduled` to the filter's
    /// worker, a no-op once the filter is destroyed.
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler: Scheduler,
        event_id: u64,
    );

    /// `void envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler_module_ptr)`.
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: Scheduler);

    /// `envoy_dynamic_module_type_http_filter_config_scheduler_module_ptr
    /// envoy_dynamic_module_callback_http_filter_config_scheduler_new(filter_config_envoy_ptr)`:
    /// its events run `on_http_filter_config_scheduled` on the main thread.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config: ConfigEnvoy,
    ) -> ConfigScheduler;

    /// `void envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
    /// scheduler_module_ptr, uint64_t event_id)`: from any thread; posts to the main thread.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: ConfigScheduler,
        event_id: u64,
    );

    /// `void envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
    /// scheduler_module_ptr)`.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
        scheduler: ConfigScheduler,
    );

    /// `envoy_dynamic_module_type_http_callout_init_result
    /// envoy_dynamic_module_callback_http_filter_config_http_callout(filter_config_envoy_ptr,
    /// uint64_t* callout_id_out, envoy_dynamic_module_type_module_buffer cluster_name,
    /// envoy_dynamic_module_type_module_http_header* headers, size_t headers_size,
    /// envoy_dynamic_module_type_module_buffer body, uint64_t timeout_milliseconds)`: a callout
    /// the configuration owns, on the calling thread's async client; its answer comes to
    /// `on_http_filter_config_http_callout_done` on that thread. Envoy 1.40 keeps these in a map
    /// without a lock: made from the main thread only.
    pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: ConfigEnvoy,
        callout_id_out: *mut u64,
        cluster: ModuleBuffer,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> i32;

    /// `bool envoy_dynamic_module_callback_http_get_metadata_string(filter_envoy_ptr,
    /// envoy_dynamic_module_type_metadata_source metadata_source,
    /// envoy_dynamic_module_type_module_buffer ns, envoy_dynamic_module_type_module_buffer key,
    /// envoy_dynamic_module_type_envoy_buffer* result)`: a string value of metadata `ns`'s `key`.
    pub fn envoy_dynamic_module_callback_http_get_metadata_string(
        filter: FilterEnvoy,
        source: i32,
        ns: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
    ) -> bool;

    /// `bool envoy_dynamic_module_callback_http_get_metadata_number(filter_envoy_ptr,
    /// envoy_dynamic_module_type_metadata_source metadata_source,
    /// envoy_dynamic_module_type_module_buffer ns, envoy_dynamic_module_type_module_buffer key,
    /// double* result)`: a number value of metadata `ns`'s `key`.
    pub fn envoy_dynamic_module_callback_http_get_metadata_number(
        filter: FilterEnvoy,
        source: i32,
        ns: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut f64,
    ) -> bool;

    /// `uint32_t envoy_dynamic_module_callback_get_concurrency(void)`: the number of worker
    /// threads; on the main thread only.
    pub fn envoy_dynamic_module_callback_get_concurrency() -> u32;

    /// `envoy_dynamic_module_type_http_callout_init_result
    /// envoy_dynamic_module_callback_http_filter_config_start_http_stream(filter_config_envoy_ptr,
    /// uint64_t* stream_id_out, envoy_dynamic_module_type_module_buffer cluster_name,
    /// envoy_dynamic_module_type_module_http_header* headers, size_t headers_size,
    /// envoy_dynamic_module_type_module_buffer body, bool end_stream, uint64_t
    /// timeout_milliseconds)`: a stream the configuration owns, on the calling thread's async
    /// client; its events come to the `on_http_filter_config_http_stream_*` hooks on that thread.
    /// Needs `:method`, `:path` and `host`; a timeout of 0 is none. Envoy 1.40 keeps these in a map
    /// without a lock: made only when one worker runs (`stream.rs`).
    pub fn envoy_dynamic_module_callback_http_filter_config_start_http_stream(
        config: ConfigEnvoy,
        stream_id_out: *mut u64,
        cluster: ModuleBuffer,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        end_stream: bool,
        timeout_ms: u64,
    ) -> i32;

    /// `bool envoy_dynamic_module_callback_http_filter_config_stream_send_data(
    /// filter_config_envoy_ptr, uint64_t stream_id, envoy_dynamic_module_type_module_buffer data,
    /// bool end_stream)`: false when the stream is gone.
    pub fn envoy_dynamic_module_callback_http_filter_config_stream_send_data(
        config: ConfigEnvoy,
        stream_id: u64,
        data: ModuleBuffer,
        end_stream: bool,
    ) -> bool;

    /// `void envoy_dynamic_module_callback_http_filter_config_reset_http_stream(
    /// filter_config_envoy_ptr, uint64_t stream_id)`: ends in the reset hook.
    pub fn envoy_dynamic_module_callback_http_filter_config_reset_http_stream(
        config: ConfigEnvoy,
        stream_id: u64,
    );
}
