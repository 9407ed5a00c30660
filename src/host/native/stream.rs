//! The stream of takes as one HTTP/2 stream, when Envoy runs one worker. A configuration's streams
//! live in a map of Envoy 1.40's without a lock (`filter_config.cc`), touched by the thread that
//! starts a stream, sends on it, and sees it end; with one worker that is the only thread, and the
//! worker keeps one stream to the service, as the wasm build does, each message a frame on it and
//! each answer read off it by id. With more workers, two could touch that map at once, so each
//! message goes as its own call instead (`calls.rs`).
//!
//! Its events come to the `on_http_filter_config_http_stream_*` hooks, on the worker:
//! the answers' bytes (whole gRPC messages, however they are cut), then the status in the headers
//! (a trailers-only answer) or the trailers, then its end or its reset, which the dispatcher hears
//! as proxy-wasm's `on_grpc_close`.

use super::config::ModuleConfig;
use super::ffi::{self, ModuleBuffer, ModuleHeader};
use super::grpc::{self, status, Deframer};
use super::state::{self, Native, Real};
use super::worker::Host;
use crate::host::abi::{self, Status};
use crate::host::dispatch::Dispatcher;
use std::sync::Arc;

impl Host {
    /// Opens the stream to `cluster`'s `path` for the current configuration: its token.
    pub(super) fn open_stream(
        &self,
        config: Arc<ModuleConfig>,
        cluster: &str,
        path: &str,
        metadata: &[(String, String)],
    ) -> Result<u32, Status> {
        let envoy = config.envoy_alive().ok_or(abi::NOT_FOUND)?;
        let headers = state::grpc_headers(path, cluster, metadata);
        let mut hs = state::module_headers(&headers);
        hs.push(ModuleHeader::of(b"host", cluster.as_bytes()));
        let mut id = 0u64;
        // SAFETY: a live configuration's object, on the one worker (the only thread that touches
        // its streams); every buffer outlives the call. No timeout: the core gives up a silent
        // stream itself.
        let init = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_start_http_stream(
                envoy,
                &mut id,
                ModuleBuffer::of(cluster.as_bytes()),
                hs.as_mut_ptr(),
                hs.len(),
                ModuleBuffer::of(b""),
                false,
                0,
            )
        };
        if init != ffi::CALLOUT_INIT_SUCCESS {
            return Err(if init == 2 { abi::BAD_ARGUMENT } else { 10 });
        }
        let token = self.token();
        self.real.borrow_mut().insert(
            token,
            Real {
                config,
                id,
                deframer: Deframer::default(),
                status: None,
            },
        );
        Ok(token)
    }

    /// Whether `token` is an open stream.
    pub(super) fn is_real(&self, token: u32) -> bool {
        self.real.borrow().contains_key(&token)
    }

    /// Sends `message` on stream `token`.
    pub(super) fn send_on(&self, token: u32, message: &[u8]) -> Result<(), Status> {
        let (envoy, id) = {
            let real = self.real.borrow();
            let r = real.get(&token).ok_or(abi::NOT_FOUND)?;
            (r.config.envoy_alive().ok_or(abi::NOT_FOUND)?, r.id)
        };
        let frame = grpc::frame(message);
        // SAFETY: a live configuration's object, on the one worker; the frame outlives the call.
        let sent = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_stream_send_data(
                envoy,
                id,
                ModuleBuffer::of(&frame),
                false,
            )
        };
        if sent {
            Ok(())
        } else {
            Err(abi::NOT_FOUND)
        }
    }

    /// Resets stream `token`; nothing is reported of it after (the core asked).
    pub(super) fn reset_stream(&self, token: u32) -> bool {
        let Some(r) = self.real.borrow_mut().remove(&token) else {
            return false;
        };
        if let Some(envoy) = r.config.envoy_alive() {
            // SAFETY: a live configuration's object, on the one worker. Its reset hook finds no
            // token for it any more.
            unsafe {
                ffi::envoy_dynamic_module_callback_http_filter_config_reset_http_stream(envoy, r.id)
            };
        }
        true
    }

    fn token_of(&self, envoy: ffi::ConfigEnvoy, id: u64) -> Option<u32> {
        self.real
            .borrow()
            .iter()
            .find(|(_, r)| r.id == id && r.config.envoy_alive() == Some(envoy))
            .map(|(t, _)| *t)
    }

    /// Stream `id` of configuration `envoy` said its status (headers or trailers).
    pub fn stream_status(
        &self,
        envoy: ffi::ConfigEnvoy,
        id: u64,
        said: Option<(u32, Option<String>)>,
    ) {
        let Some(token) = self.token_of(envoy, id) else {
            return;
        };
        if let (Some(said), Some(r)) = (said, self.real.borrow_mut().get_mut(&token)) {
            r.status = Some(said);
        }
    }

    /// Bytes arrived on stream `id` of configuration `envoy`: each whole answer to the dispatcher.
    pub fn stream_data(
        &self,
        d: &mut Dispatcher<Native>,
        envoy: ffi::ConfigEnvoy,
        id: u64,
        bytes: &[u8],
    ) {
        let Some(token) = self.token_of(envoy, id) else {
            return;
        };
        let mut messages = Vec::new();
        let read = match self.real.borrow_mut().get_mut(&token) {
            Some(r) => r.deframer.push(bytes, |m| messages.push(m.to_vec())),
            None => return,
        };
        for m in messages {
            let size = m.len();
            self.reply.borrow_mut().message = m;
            self.current.set(0);
            d.on_grpc_receive(token, size);
        }
        if read.is_err() {
            // Bytes that are no gRPC answer: the stream is given up, as a failed one.
            self.reset_stream(token);
            self.reply.borrow_mut().grpc_message = Some("a malformed gRPC frame".to_string());
            d.on_grpc_close(token, status::UNKNOWN);
        }
    }

    /// Stream `id` of configuration `envoy` ended (`reset`: without a status of the service's).
    pub fn stream_end(
        &self,
        d: &mut Dispatcher<Native>,
        envoy: ffi::ConfigEnvoy,
        id: u64,
        reset: bool,
    ) {
        let Some(token) = self.token_of(envoy, id) else {
            return;
        };
        let Some(r) = self.real.borrow_mut().remove(&token) else {
            return;
        };
        let (code, message) = match (r.status, reset) {
            (Some(said), false) => said,
            (_, true) => (status::UNAVAILABLE, Some("stream reset".to_string())),
            (None, false) => (
                status::UNKNOWN,
                Some("stream ended without a status".to_string()),
            ),
        };
        self.reply.borrow_mut().grpc_message = message;
        self.current.set(0);
        d.on_grpc_close(token, code);
    }
}
