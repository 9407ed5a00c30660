//! Two host calls done by hand, because the SDK's wrappers can panic on data a client or a
//! service controls: the header map deserialiser unwraps `String::from_utf8` on header names, and
//! `get_grpc_status` unwraps it on the status message. Here both are parsed with bounds checks and
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
}

/// `MapType::HttpRequestHeaders`.
pub const REQUEST_HEADERS: u32 = 0;

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
