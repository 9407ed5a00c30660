//! [`Native`]: the dispatcher's [`Abi`] over Envoy's dynamic module callbacks, on the worker's
//! state ([`HOST`]): reads of the request a callback is for, callouts through `calls.rs`, shared
//! data in process memory, metrics by the ids their configuration was given, answers carried out
//! when the callback returns.

use super::ffi::{self, EnvoyBuffer, EnvoyHeader, FilterEnvoy, ModuleBuffer};
use super::grpc;
use super::shared::Store;
use super::state::{self, Kind, Native, Stream, MESSAGE_TIMEOUT_MS};
use super::timer::now_ms;
use super::worker::{Answer, DEFINING, HOST};
use crate::core::base::store::SetError;
use crate::host::abi::{self, Abi, Buffer, HeaderMap, Level, MetricKind, Status};
use std::sync::atomic::Ordering;
use std::sync::LazyLock;

/// Shared data, one store for the process (every worker, every configuration).
static SHARED: LazyLock<Store> = LazyLock::new(Store::new);

fn header_type(map: HeaderMap) -> Option<i32> {
    match map {
        HeaderMap::Request => Some(ffi::REQUEST_HEADER),
        HeaderMap::Response => Some(ffi::RESPONSE_HEADER),
        HeaderMap::HttpCallResponse => None,
    }
}

/// A request's body as Envoy holds it in its callback: what it buffered, then what just came.
fn body(envoy: FilterEnvoy, buffered: i32, received: i32) -> Vec<u8> {
    let mut out = Vec::new();
    for which in [buffered, received] {
        // SAFETY: a live request's pointer; the array is sized by Envoy's own count.
        unsafe {
            let n = ffi::envoy_dynamic_module_callback_http_get_body_chunks_size(envoy, which);
            if n == 0 {
                continue;
            }
            let mut chunks = vec![EnvoyBuffer::EMPTY; n];
            if ffi::envoy_dynamic_module_callback_http_get_body_chunks(
                envoy,
                which,
                chunks.as_mut_ptr(),
            ) {
                for c in &chunks {
                    out.extend_from_slice(c.bytes());
                }
            }
        }
    }
    out
}

/// The size of a request's or response's body in its callback (buffered and just come).
pub fn body_size(envoy: FilterEnvoy, request: bool) -> usize {
    let (buffered, received) = if request {
        (ffi::BUFFERED_REQUEST_BODY, ffi::RECEIVED_REQUEST_BODY)
    } else {
        (ffi::BUFFERED_RESPONSE_BODY, ffi::RECEIVED_RESPONSE_BODY)
    };
    // SAFETY: a live request's pointer, in its callback.
    unsafe {
        ffi::envoy_dynamic_module_callback_http_get_body_size(envoy, buffered)
            + ffi::envoy_dynamic_module_callback_http_get_body_size(envoy, received)
    }
}

fn range(bytes: &[u8], start: usize, size: usize) -> Vec<u8> {
    let end = start.saturating_add(size).min(bytes.len());
    bytes
        .get(start..end)
        .map(<[u8]>::to_vec)
        .unwrap_or_default()
}

impl Abi for Native {
    fn log_level(&self) -> Option<Level> {
        // SAFETY: a plain call.
        let level = unsafe { ffi::envoy_dynamic_module_callback_get_log_level() };
        Some(match u32::try_from(level) {
            Ok(n) if level < ffi::LOG_OFF => Level::from_host(n),
            _ => Level::Critical,
        })
    }

    fn memory_bytes(&self) -> u64 {
        0
    }

    fn now_ms(&self) -> u64 {
        now_ms()
    }

    fn buffer(&self, which: Buffer, start: usize, size: usize) -> Vec<u8> {
        HOST.with(|h| match which {
            Buffer::PluginConfiguration => h
                .configuring
                .borrow()
                .as_ref()
                .map(|c| range(&c.json, start, size))
                .unwrap_or_default(),
            Buffer::HttpCallResponseBody => range(&h.reply.borrow().body, start, size),
            Buffer::GrpcReceive => range(&h.reply.borrow().message, start, size),
            Buffer::HttpRequestBody => h
                .current_filter()
                .map(|f| {
                    range(
                        &body(f, ffi::BUFFERED_REQUEST_BODY, ffi::RECEIVED_REQUEST_BODY),
                        start,
                        size,
                    )
                })
                .unwrap_or_default(),
            Buffer::HttpResponseBody => h
                .current_filter()
                .map(|f| {
                    range(
                        &body(f, ffi::BUFFERED_RESPONSE_BODY, ffi::RECEIVED_RESPONSE_BODY),
                        start,
                        size,
                    )
                })
                .unwrap_or_default(),
        })
    }

    fn header(&self, map: HeaderMap, name: &str) -> Option<Vec<u8>> {
        HOST.with(|h| {
            let Some(t) = header_type(map) else {
                return h
                    .reply
                    .borrow()
                    .headers
                    .iter()
                    .find(|(k, _)| k.as_slice() == name.as_bytes())
                    .map(|(_, v)| v.clone());
            };
            let f = h.current_filter()?;
            let mut value = EnvoyBuffer::EMPTY;
            // SAFETY: a live request's pointer in one of its callbacks; the value is copied
            // before anything else is asked of Envoy.
            unsafe {
                ffi::envoy_dynamic_module_callback_http_get_header(
                    f,
                    t,
                    ModuleBuffer::of(name.as_bytes()),
                    &mut value,
                    0,
                    std::ptr::null_mut(),
                )
                .then(|| value.bytes().to_vec())
            }
        })
    }

    fn headers(&self, map: HeaderMap) -> Option<Vec<(String, Vec<u8>)>> {
        HOST.with(|h| {
            let Some(t) = header_type(map) else {
                return Some(
                    h.reply
                        .borrow()
                        .headers
                        .iter()
                        .map(|(k, v)| (String::from_utf8_lossy(k).into_owned(), v.clone()))
                        .collect(),
                );
            };
            let f = h.current_filter()?;
            // SAFETY: as `header`; the array is sized by Envoy's own count.
            unsafe {
                let n = ffi::envoy_dynamic_module_callback_http_get_headers_size(f, t);
                let mut all = vec![
                    EnvoyHeader {
                        key_ptr: std::ptr::null(),
                        key_length: 0,
                        value_ptr: std::ptr::null(),
                        value_length: 0,
                    };
                    n
                ];
                if !ffi::envoy_dynamic_module_callback_http_get_headers(f, t, all.as_mut_ptr()) {
                    return None;
                }
                Some(
                    all.iter()
                        .map(|e| {
                            let (k, v) = e.pair();
                            (String::from_utf8_lossy(k).into_owned(), v.to_vec())
                        })
                        .collect(),
                )
            }
        })
    }

    fn add_header(&self, map: HeaderMap, name: &str, value: &str) -> Result<(), Status> {
        HOST.with(|h| {
            let (Some(t), Some(f)) = (header_type(map), h.current_filter()) else {
                return Err(abi::NOT_FOUND);
            };
            // SAFETY: a live request's pointer in one of its callbacks.
            let done = unsafe {
                ffi::envoy_dynamic_module_callback_http_add_header(
                    f,
                    t,
                    ModuleBuffer::of(name.as_bytes()),
                    ModuleBuffer::of(value.as_bytes()),
                )
            };
            if done {
                Ok(())
            } else {
                Err(abi::NOT_FOUND)
            }
        })
    }

    /// `source.address`, and dynamic metadata a namespace's top-level field
    /// (`metadata.filter_metadata.<ns>.<key>`: a string as its bytes, a number as proxy-wasm gives
    /// it, 8 bytes of a double). The ABI reads no deeper field: a longer path reads nothing.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        HOST.with(|h| {
            let f = h.current_filter()?;
            match path {
                ["source", "address"] => {
                    let mut value = EnvoyBuffer::EMPTY;
                    // SAFETY: a live request's pointer in one of its callbacks; copied at once.
                    unsafe {
                        ffi::envoy_dynamic_module_callback_http_filter_get_attribute_string(
                            f,
                            ffi::ATTRIBUTE_SOURCE_ADDRESS,
                            &mut value,
                        )
                        .then(|| value.bytes().to_vec())
                    }
                }
                ["metadata", "filter_metadata", ns, key] => {
                    let (ns, key) = (
                        ModuleBuffer::of(ns.as_bytes()),
                        ModuleBuffer::of(key.as_bytes()),
                    );
                    let mut value = EnvoyBuffer::EMPTY;
                    let mut number = 0f64;
                    // SAFETY: as above.
                    unsafe {
                        if ffi::envoy_dynamic_module_callback_http_get_metadata_string(
                            f,
                            ffi::METADATA_DYNAMIC,
                            ns,
                            key,
                            &mut value,
                        ) {
                            Some(value.bytes().to_vec())
                        } else if ffi::envoy_dynamic_module_callback_http_get_metadata_number(
                            f,
                            ffi::METADATA_DYNAMIC,
                            ns,
                            key,
                            &mut number,
                        ) {
                            Some(number.to_ne_bytes().to_vec())
                        } else {
                            None
                        }
                    }
                }
                _ => None,
            }
        })
    }

    fn shared_get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        SHARED.get(key)
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        SHARED.set(key, value, cas)
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, Status> {
        let defined = DEFINING.with(|d| {
            let mut d = d.borrow_mut();
            let c = d.as_mut()?;
            if let Some(id) = c.names.get(name) {
                return Some(Ok(*id));
            }
            let mut envoy_id = 0usize;
            let define = match kind {
                MetricKind::Counter => {
                    ffi::envoy_dynamic_module_callback_http_filter_config_define_counter
                }
                MetricKind::Gauge => {
                    ffi::envoy_dynamic_module_callback_http_filter_config_define_gauge
                }
            };
            // SAFETY: Envoy's configuration object, inside `on_http_filter_config_new`; no labels.
            let result = unsafe {
                define(
                    c.envoy,
                    ModuleBuffer::of(name.as_bytes()),
                    std::ptr::null_mut(),
                    0,
                    &mut envoy_id,
                )
            };
            if result != ffi::METRICS_SUCCESS {
                return Some(Err(abi::BAD_ARGUMENT));
            }
            let id = c
                .metric_base
                .saturating_add(u32::try_from(c.metrics.len()).unwrap_or(u32::MAX));
            c.metrics.push((kind, envoy_id));
            c.names.insert(name.to_string(), id);
            Some(Ok(id))
        });
        if let Some(result) = defined {
            return result;
        }
        HOST.with(|h| {
            h.configuring
                .borrow()
                .as_ref()
                .and_then(|c| c.names.get(name).copied())
                .ok_or(abi::NOT_FOUND)
        })
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        metric(id, |envoy, kind, envoy_id| {
            let f = match (kind, delta < 0) {
                (MetricKind::Counter, false) => {
                    ffi::envoy_dynamic_module_callback_http_filter_config_increment_counter
                }
                (MetricKind::Counter, true) => return,
                (MetricKind::Gauge, false) => {
                    ffi::envoy_dynamic_module_callback_http_filter_config_increment_gauge
                }
                (MetricKind::Gauge, true) => {
                    ffi::envoy_dynamic_module_callback_http_filter_config_decrement_gauge
                }
            };
            // SAFETY: a live configuration's object (checked by `metric`); no labels.
            unsafe {
                f(
                    envoy,
                    envoy_id,
                    std::ptr::null_mut(),
                    0,
                    delta.unsigned_abs(),
                )
            };
        });
    }

    fn record_metric(&self, id: u32, value: u64) {
        metric(id, |envoy, _, envoy_id| {
            // SAFETY: as `increment_metric`.
            unsafe {
                ffi::envoy_dynamic_module_callback_http_filter_config_set_gauge(
                    envoy,
                    envoy_id,
                    std::ptr::null_mut(),
                    0,
                    value,
                )
            };
        });
    }

    fn http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, Status> {
        HOST.with(|h| h.call(cluster, headers, body, u64::from(timeout_ms), Kind::Http))
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
        let cluster = grpc::cluster_of(service).ok_or(abi::BAD_ARGUMENT)?;
        let path = format!("/{service_name}/{method}");
        let metadata = state::owned_pairs(metadata);
        let headers = state::grpc_headers(&path, &cluster, &metadata);
        HOST.with(|h| {
            h.call(
                &cluster,
                &headers,
                &grpc::frame(message),
                u64::from(timeout_ms),
                Kind::Unary,
            )
        })
    }

    fn grpc_stream(
        &self,
        service: &[u8],
        service_name: &str,
        method: &str,
        metadata: &[(&str, &str)],
    ) -> Result<u32, Status> {
        let cluster = grpc::cluster_of(service).ok_or(abi::BAD_ARGUMENT)?;
        let path = format!("/{service_name}/{method}");
        let metadata = state::owned_pairs(metadata);
        HOST.with(|h| {
            // One worker: one stream on Envoy. Several: a message per call (`stream.rs`).
            if let Some(config) = h.config().filter(|c| c.single_worker) {
                return h.open_stream(config, &cluster, &path, &metadata);
            }
            let token = h.token();
            h.streams.borrow_mut().insert(
                token,
                Stream {
                    cluster,
                    path,
                    metadata,
                },
            );
            Ok(token)
        })
    }

    fn callout_for(&self, contexts: &[u32], message: Option<u64>) {
        HOST.with(|h| {
            let mut hint = h.hint.borrow_mut();
            hint.0.clear();
            hint.0.extend_from_slice(contexts);
            hint.1 = message;
        });
    }

    fn grpc_send(&self, token: u32, message: &[u8]) -> Result<(), Status> {
        HOST.with(|h| {
            if h.is_real(token) {
                return h.send_on(token, message);
            }
            let (cluster, path, metadata) = {
                let streams = h.streams.borrow();
                let s = streams.get(&token).ok_or(abi::NOT_FOUND)?;
                (s.cluster.clone(), s.path.clone(), s.metadata.clone())
            };
            let headers = state::grpc_headers(&path, &cluster, &metadata);
            h.call(
                &cluster,
                &headers,
                &grpc::frame(message),
                MESSAGE_TIMEOUT_MS,
                Kind::Message(token),
            )
            .map(|_| ())
        })
    }

    fn grpc_cancel(&self, token: u32) -> Result<(), Status> {
        HOST.with(|h| {
            if h.streams.borrow_mut().remove(&token).is_some() || h.reset_stream(token) {
                return Ok(());
            }
            if h.cancel(token) {
                Ok(())
            } else {
                Err(abi::NOT_FOUND)
            }
        })
    }

    fn grpc_status_message(&self) -> Option<String> {
        HOST.with(|h| h.reply.borrow().grpc_message.clone())
    }

    fn set_tick_period(&self, period_ms: u32) -> Result<(), Status> {
        HOST.with(|h| {
            let root = h.current_root.get();
            let now = now_ms();
            if let Some(r) = h.roots.borrow_mut().iter_mut().find(|r| r.id == root) {
                r.period_ms = period_ms;
                r.due_ms = now + u64::from(period_ms);
            }
            h.publish();
            Ok(())
        })
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), Status> {
        HOST.with(|h| {
            if h.filters.borrow().contains_key(&context_id) {
                h.current.set(context_id);
                Ok(())
            } else if h.roots.borrow().iter().any(|r| r.id == context_id) {
                h.enter_root(context_id);
                Ok(())
            } else {
                Err(abi::NOT_FOUND)
            }
        })
    }

    fn resume_request(&self) -> Result<(), Status> {
        answer(Answer::Resume)
    }

    fn send_local_response(
        &self,
        status: u32,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<(), Status> {
        answer(Answer::Reply {
            status,
            headers: headers.to_vec(),
            body: body.to_vec(),
        })
    }
}

/// An answer for the current request, carried out when the callback returns.
fn answer(a: Answer) -> Result<(), Status> {
    HOST.with(|h| {
        let ctx = h.current.get();
        match h.filters.borrow_mut().get_mut(&ctx) {
            // Answered: no callout is made on it from now on.
            Some(live) => live.waiting = false,
            None => return Err(abi::NOT_FOUND),
        }
        h.answers.borrow_mut().push_back((ctx, a));
        Ok(())
    })
}

/// Metric `id`'s configuration object, kind and Envoy's id, if its configuration is alive.
fn metric(id: u32, f: impl FnOnce(ffi::ConfigEnvoy, MetricKind, usize)) {
    HOST.with(|h| {
        let roots = h.roots.borrow();
        let configuring = h.configuring.borrow();
        let found = roots
            .iter()
            .map(|r| &r.config)
            .chain(configuring.iter())
            .find_map(|c| c.metric(id).map(|m| (c, m)));
        if let Some((c, (kind, envoy_id))) = found {
            if c.alive.load(Ordering::Acquire) {
                f(c.envoy, kind, envoy_id);
            }
        }
    });
}
