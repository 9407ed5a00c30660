//! Two host calls done by hand, because the SDK's wrappers can panic on data a client or a
//! service controls: the header map deserialiser unwraps `String::from_utf8` on header names, and
//! `get_grpc_status` unwraps it on the status message. Here both are parsed with bounds checks and
//! lossy UTF-8. The memory the host returns was allocated through the SDK's exported allocator,
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

fn u32_at(b: &[u8], at: usize) -> Option<usize> {
    let s = b.get(at..at.checked_add(4)?)?;
    let mut a = [0u8; 4];
    a.copy_from_slice(s);
    usize::try_from(u32::from_le_bytes(a)).ok()
}

/// Parses the host's serialised map: count, then (name length, value length) pairs, then the
/// NUL-terminated names and values. `None` if it is malformed.
pub fn parse_map(b: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    if b.is_empty() {
        return Some(Vec::new());
    }
    let n = u32_at(b, 0)?;
    let mut p = n.checked_mul(8)?.checked_add(4)?;
    let mut out = Vec::with_capacity(n.min(1024));
    for i in 0..n {
        let s = 4 + i * 8;
        let klen = u32_at(b, s)?;
        let vlen = u32_at(b, s + 4)?;
        let k = b.get(p..p.checked_add(klen)?)?;
        p = p.checked_add(klen)?.checked_add(1)?;
        let v = b.get(p..p.checked_add(vlen)?)?;
        p = p.checked_add(vlen)?.checked_add(1)?;
        out.push((String::from_utf8_lossy(k).into_owned(), v.to_vec()));
    }
    Some(out)
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
    parse_map(&bytes)
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
