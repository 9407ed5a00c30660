//! What a decision costs Envoy asked over a unary gRPC call (plugin configuration `unary`) against
//! one message on this worker's bidirectional stream (`stream`): each request sends one message
//! of a one-bucket take's size and waits for its answer, which it reads. The stream is opened by
//! the root context on its tick; answers come back in order, so the first request waiting is the
//! one an answer resumes. Nothing else: no keys, no decision, no failure path (a request that
//! finds no stream, or whose send fails, goes on).
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::time::Duration;

// 38 opaque bytes, about the size of a one-bucket take in protobuf (neither side decodes them).
const MSG: &[u8] = b"\x0a\x1a\x0a\x0ctollgate:tb:bench\x10\x80\x94\xeb\xdc\x03\x18\x80\x94\xeb\xdc\x03\x20\xe8\x07\x28\x01";

thread_local! {
    static STREAM: Cell<Option<u32>> = const { Cell::new(None) };
    static QUEUE: RefCell<VecDeque<u32>> = const { RefCell::new(VecDeque::new()) };
    static MODE_STREAM: Cell<bool> = const { Cell::new(false) };
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;
impl Root {
    fn open(&self) {
        if STREAM.get().is_none() {
            if let Ok(t) = self.open_grpc_stream("tollgate", "tollgate.bench.Probe", "TakeStream", vec![]) {
                STREAM.set(Some(t));
            }
        }
    }
}
impl Context for Root {
    fn on_grpc_stream_message(&mut self, _token: u32, size: usize) {
        let _ = self.get_grpc_stream_message(0, size);
        if let Some(id) = QUEUE.with(|q| q.borrow_mut().pop_front()) {
            if hostcalls::set_effective_context(id).is_ok() {
                let _ = hostcalls::resume_http_request();
            }
        }
    }
    fn on_grpc_stream_close(&mut self, _token: u32, _status: u32) {
        STREAM.set(None);
    }
}
impl RootContext for Root {
    fn on_configure(&mut self, _: usize) -> bool {
        let cfg = self.get_plugin_configuration().unwrap_or_default();
        MODE_STREAM.set(cfg.starts_with(b"stream"));
        if MODE_STREAM.get() {
            self.set_tick_period(Duration::from_millis(200));
        }
        true
    }
    fn on_tick(&mut self) {
        self.open();
    }
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
    fn create_http_context(&self, id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Req { id }))
    }
}

struct Req {
    id: u32,
}
impl Context for Req {
    fn on_grpc_call_response(&mut self, _token: u32, _status: u32, size: usize) {
        let _ = self.get_grpc_call_response_body(0, size);
        self.resume_http_request();
    }
}
impl HttpContext for Req {
    fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
        if MODE_STREAM.get() {
            let Some(t) = STREAM.get() else { return Action::Continue };
            if hostcalls::send_grpc_stream_message(t, Some(MSG), false).is_err() {
                return Action::Continue;
            }
            QUEUE.with(|q| q.borrow_mut().push_back(self.id));
            Action::Pause
        } else {
            match self.dispatch_grpc_call("tollgate", "tollgate.bench.Probe", "Take", vec![], Some(MSG), Duration::from_secs(1)) {
                Ok(_) => Action::Pause,
                Err(_) => Action::Continue,
            }
        }
    }
}
