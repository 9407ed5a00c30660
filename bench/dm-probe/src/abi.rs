//! Our bindings of the part of Envoy 1.40's dynamic module ABI this probe uses, written from
//! `source/extensions/dynamic_modules/abi/abi.h` (the C header every module is built against).
//!
//! Nothing checks these at load time: Envoy resolves each hook by name with `dlsym` and calls it
//! through its own prototype, so a wrong parameter list here is silent undefined behaviour. Each
//! item below names the C declaration it mirrors; keep them in step with that header.
//!
//! Where they come from: the header as stored by the code index (a version from the 1.39–1.40
//! cycle, its ABI string still "v0.1.0"; no copy at the v1.40.0 tag could be read), the list of
//! hooks from the filter configuration's loader (`filter_config.cc`), and the callbacks' names from
//! the 1.40.0 binary's dynamic symbols. The 1.40.0 binary's own ABI string is "v0.2.0": Envoy logs
//! "Dynamic module ABI version v0.2.0 matched" for this module, and every hook and callback below
//! runs under scripts/bench-instructions.sh (dm-empty, dm-stream).
//!
//! - Envoy's objects (`*_envoy_ptr`) and the module's (`*_module_ptr`) are opaque pointers.
//! - C enums cross as `i32` (the C `int` an enum is): a value Envoy passes that Rust would not
//!   know can then never be an invalid Rust enum.
//! - `bool` is C's `_Bool` (one byte, 0 or 1), the same as Rust's `bool`.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_void};

/// `envoy_dynamic_module_type_abi_version_module_ptr`: a NUL-terminated string the module owns.
pub type AbiVersionPtr = *const c_char;

/// The version this module is built against: 1.40.0's `ENVOY_DYNAMIC_MODULES_ABI_VERSION`.
/// Envoy compares it with its own after `envoy_dynamic_module_on_program_init` and logs "matched"
/// (info) or "is deprecated" (warn), loading the module either way.
pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// `envoy_dynamic_module_type_http_filter_config_envoy_ptr` (`void*`): Envoy's
/// `DynamicModuleHttpFilterConfig`.
pub type FilterConfigEnvoyPtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_config_module_ptr` (`const void*`): ours.
pub type FilterConfigModulePtr = *const c_void;
/// `envoy_dynamic_module_type_http_filter_envoy_ptr` (`void*`): Envoy's `DynamicModuleHttpFilter`.
pub type FilterEnvoyPtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_module_ptr` (`const void*`): ours.
pub type FilterModulePtr = *const c_void;

/// `envoy_dynamic_module_type_envoy_buffer`: bytes Envoy owns, valid for the call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

/// `envoy_dynamic_module_type_module_buffer`: bytes the module owns, valid for the call.
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
pub struct ModuleHttpHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

impl ModuleHttpHeader {
    pub fn of(key: &'static [u8], value: &'static [u8]) -> ModuleHttpHeader {
        ModuleHttpHeader {
            key_ptr: key.as_ptr().cast(),
            key_length: key.len(),
            value_ptr: value.as_ptr().cast(),
            value_length: value.len(),
        }
    }
}

/// `envoy_dynamic_module_type_envoy_http_header`: a header Envoy owns (only passed through here).
#[repr(C)]
pub struct EnvoyHttpHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

/// The `Continue` of every `envoy_dynamic_module_type_on_http_filter_*_status` enum (request and
/// response headers, body, trailers): their first member, 0.
pub const CONTINUE: i32 = 0;
/// `envoy_dynamic_module_type_on_http_filter_request_headers_status_StopIteration`: the request
/// waits until the module calls `continue_decoding`.
pub const STOP_ITERATION: i32 = 1;
/// `envoy_dynamic_module_type_http_callout_init_result_Success`.
pub const CALLOUT_INIT_SUCCESS: i32 = 0;

// Callbacks: functions Envoy exports (the `envoy` binary's dynamic symbol table) and the module
// calls. Only the ones used.
extern "C" {
    /// `void envoy_dynamic_module_callback_http_filter_continue_decoding(
    ///     envoy_dynamic_module_type_http_filter_envoy_ptr filter_envoy_ptr)`: resumes a request
    /// whose headers hook returned StopIteration.
    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: FilterEnvoyPtr);

    /// `envoy_dynamic_module_type_http_callout_init_result
    /// envoy_dynamic_module_callback_http_filter_config_start_http_stream(
    ///     envoy_dynamic_module_type_http_filter_config_envoy_ptr filter_config_envoy_ptr,
    ///     uint64_t* stream_id_out, envoy_dynamic_module_type_module_buffer cluster_name,
    ///     envoy_dynamic_module_type_module_http_header* headers, size_t headers_size,
    ///     envoy_dynamic_module_type_module_buffer body, bool end_stream,
    ///     uint64_t timeout_milliseconds)`: a stream owned by the filter configuration (it outlives
    /// requests), on the calling thread's async client; its events come back through the
    /// `envoy_dynamic_module_on_http_filter_config_http_stream_*` hooks on that thread. Needs
    /// `:method`, `:path` and `host`.
    pub fn envoy_dynamic_module_callback_http_filter_config_start_http_stream(
        config: FilterConfigEnvoyPtr,
        stream_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        end_stream: bool,
        timeout_milliseconds: u64,
    ) -> i32;

    /// `bool envoy_dynamic_module_callback_http_filter_config_stream_send_data(
    ///     envoy_dynamic_module_type_http_filter_config_envoy_ptr filter_config_envoy_ptr,
    ///     uint64_t stream_id, envoy_dynamic_module_type_module_buffer data, bool end_stream)`:
    /// false when the stream is gone.
    pub fn envoy_dynamic_module_callback_http_filter_config_stream_send_data(
        config: FilterConfigEnvoyPtr,
        stream_id: u64,
        data: ModuleBuffer,
        end_stream: bool,
    ) -> bool;
}
