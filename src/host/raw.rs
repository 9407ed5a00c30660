//! Host calls done by hand, because the SDK's wrappers panic where we want an error: the header
//! map deserialiser unwraps `String::from_utf8` on header names, `get_grpc_status` unwraps it on
//! the status message, and `send_http_response` / `add_map_value` panic on any status but `Ok`
//! (a host that refuses must cost a log line, not the VM). Here both are parsed with bounds checks and
//! lossy UTF-8 ([`crate::core::hostmap`]). The memory the host returns was allocated through the SDK's exported allocator,
//! so it is taken back with `Vec::from_raw_parts`, exactly as the SDK does.

use std::ptr::null_mut;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_get_status(
        return_code: *mut u32,
        return_message_data: *mut *mut u8,
        return_message_size: *mut usize,
    ) -> u32;
    fn proxy_add_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
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

/// `MapType::HttpRequestHeaders`.
pub const REQUEST_HEADERS: u32 = 0;
/// `MapType::HttpResponseHeaders`.
pub const RESPONSE_HEADERS: u32 = 2;

/// Takes ownership of a host-allocated buffer.
fn owned(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() || size == 0 {
        return Vec::new();
    }
    // SAFETY: the host wrote `size` bytes into a buffer it obtained from this module's allocator
    // (`proxy_on_memory_allocate`, a `Vec<u8>` of capacity `size`), and hands ownership to us.
    unsafe { Vec::from_raw_parts(data, size, size) }
}

/// A header map, or `None` if the host refused or sent garbage.
pub fn get_map(map_type: u32) -> Option<Vec<(String, Vec<u8>)>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: plain host call with out-pointers to our locals.
    let status = unsafe { proxy_get_header_map_pairs(map_type, &mut data, &mut size) };
    let bytes = owned(data, size);
    if status != 0 {
        return None;
    }
    crate::core::hostmap::parse(&bytes)
}

/// The gRPC status message of the current callout, if any.
pub fn grpc_status_message() -> Option<String> {
    let mut code: u32 = 0;
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: plain host call with out-pointers to our locals.
    let status = unsafe { proxy_get_status(&mut code, &mut data, &mut size) };
    let bytes = owned(data, size);
    if status != 0 || bytes.is_empty() {
        return None;
    }
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// Adds a header to a map; the host's status on refusal.
pub fn add_header(map_type: u32, name: &str, value: &str) -> Result<(), u32> {
    // SAFETY: plain host call with pointers into live borrowed strings.
    let status = unsafe {
        proxy_add_header_map_value(
            map_type,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    };
    if status == 0 {
        Ok(())
    } else {
        Err(status)
    }
}

/// Sends a local reply (Envoy turns it into a trailers-only gRPC reply for gRPC clients); the
/// host's status on refusal.
pub fn send_local_response(
    status: u32,
    headers: &[(String, String)],
    body: &[u8],
) -> Result<(), u32> {
    let map = crate::core::hostmap::serialize(headers);
    // SAFETY: plain host call with pointers into live local buffers; -1 = no explicit gRPC status.
    let rc = unsafe {
        proxy_send_local_response(
            status,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            map.as_ptr(),
            map.len(),
            -1,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(rc)
    }
}
