//! A worker's callouts. Each is carried by one of two things Envoy 1.40's ABI offers:
//!
//! - **a request that waits for it** (a take's own, a batch's or a stream message's members, an
//!   acquire): a one-shot callout of that request's filter, on the worker's async client, its
//!   answer back on the worker. Envoy cancels it without a word when the request ends first: it
//!   then goes again on another member that still waits, and with none left, it ends here (one
//!   requests waited for fails, which its gone requests do not count; a stream message is
//!   forgotten).
//! - **the main thread**, for a callout no request waits for (a release, a refund, a settlement,
//!   a lease refill): a request ending would cancel it, so it goes out as a callout of the
//!   configuration, from the main thread, the only thread that touches the configuration's
//!   callouts (Envoy keeps them in a map without a lock). The worker queues it and wakes the main
//!   thread through the configuration's scheduler; the answer is handed back to the worker's
//!   [`Wake`] and read at its next callback (its timer posts one when a request waits).
//!
//! A call Envoy's own router answered for want of a connection (`upstream connect error`, `no
//! healthy upstream`: it never reached the service) goes again, twice at most, as a stream that
//! lost its connection would be opened again.

use super::ffi::{self, EnvoyBuffer, EnvoyHeader, FilterEnvoy, ModuleBuffer};
use super::grpc::{self, status};
use super::state::{
    module_headers, owned_pairs, Carrier, Done, Kind, Landed, Native, Owned, Request,
};
use super::timer::Wake;
use super::worker::{carry_key, Host, Live};
use crate::core::base::ledger::{CalloutId, IdMap};
use crate::host::abi::{self, Status};
use crate::host::dispatch::Dispatcher;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// `WasmResult::InternalFailure`, for a callout Envoy would not start.
const INTERNAL_FAILURE: Status = 10;

/// How many times a call Envoy could not connect goes again.
const CONNECT_RETRIES: u8 = 2;

/// A callout a worker hands the main thread.
struct Outgoing {
    wake: Arc<Wake>,
    token: u32,
    request: Arc<Request>,
}

/// Callouts waiting for the main thread.
static OUTGOING: Mutex<Vec<Outgoing>> = Mutex::new(Vec::new());

/// The main thread's callouts in flight: (configuration, Envoy's id) -> the worker's wake and
/// its token.
type Sent = HashMap<(usize, u64), (Arc<Wake>, u32)>;

thread_local! {
    static SENT: RefCell<Sent> = RefCell::new(HashMap::new());
}

fn copy_headers(headers: &[EnvoyHeader]) -> Vec<(Vec<u8>, Vec<u8>)> {
    headers
        .iter()
        .map(|h| {
            // SAFETY: Envoy's header, valid for the hook reporting it (`Done`).
            let (k, v) = unsafe { h.pair() };
            (k.to_vec(), v.to_vec())
        })
        .collect()
}

fn copy_body(chunks: &[EnvoyBuffer]) -> Vec<u8> {
    let mut body = Vec::new();
    for c in chunks {
        // SAFETY: Envoy's buffer, valid for the hook reporting it (`Done`).
        body.extend_from_slice(unsafe { c.bytes() });
    }
    body
}

fn failure_status(result: i32) -> u32 {
    if result == ffi::CALLOUT_TOO_LARGE {
        status::RESOURCE_EXHAUSTED
    } else {
        status::UNAVAILABLE
    }
}

pub(super) fn pairs(headers: &[(Vec<u8>, Vec<u8>)]) -> impl Iterator<Item = (&[u8], &[u8])> {
    headers.iter().map(|(k, v)| (k.as_slice(), v.as_slice()))
}

/// The ABI's one-shot callout, a filter's or a configuration's (the same parameters: its owner,
/// the id out, the cluster, the headers, the body, the timeout).
type Callout = unsafe extern "C" fn(
    *mut std::ffi::c_void,
    *mut u64,
    ModuleBuffer,
    *mut ffi::ModuleHeader,
    usize,
    ModuleBuffer,
    u64,
) -> i32;

/// `r` sent through `callout` on `owner`: Envoy's id for it, or its init result.
///
/// # Safety
/// `owner` must be what `callout` takes, live, on the thread allowed to use it.
unsafe fn start(callout: Callout, owner: *mut std::ffi::c_void, r: &Request) -> Result<u64, i32> {
    let mut hs = module_headers(&r.headers);
    let mut id = 0u64;
    // SAFETY: the caller's promise for `owner`; every buffer outlives the call. A timeout of 0
    // would end a configuration's callout at once: 1 ms at least.
    let init = unsafe {
        callout(
            owner,
            &mut id,
            ModuleBuffer::of(r.cluster.as_bytes()),
            hs.as_mut_ptr(),
            hs.len(),
            ModuleBuffer::of(&r.body),
            r.timeout_ms.max(1),
        )
    };
    if init == ffi::CALLOUT_INIT_SUCCESS {
        Ok(id)
    } else {
        Err(init)
    }
}

/// The first of `members` that still waits on this worker (or is the one being served, whose
/// callback is about to make it wait).
fn waiting_member(
    filters: &IdMap<Live>,
    members: &[u32],
    current: u32,
) -> Option<(u32, FilterEnvoy)> {
    members.iter().find_map(|c| {
        filters
            .get(c)
            .filter(|l| l.waiting || *c == current)
            .map(|l| (*c, l.envoy))
    })
}

impl Host {
    pub(super) fn token(&self) -> u32 {
        loop {
            let t = self.next_token.get();
            self.next_token.set(t.wrapping_add(1).max(1));
            if !self.by_token.borrow().contains_key(&t) && !self.streams.borrow().contains_key(&t) {
                return t;
            }
        }
    }

    /// Sends a callout for the requests [`crate::host::abi::Abi::callout_for`] named last (one no
    /// request waits for if none): its token.
    pub(super) fn call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
        kind: Kind,
    ) -> Result<u32, Status> {
        let (members, message) = std::mem::take(&mut *self.hint.borrow_mut());
        let config = self.config().ok_or(INTERNAL_FAILURE)?;
        let mut headers = owned_pairs(headers);
        if !headers
            .iter()
            .any(|(k, _)| k == ":authority" || k == "host")
        {
            headers.push(("host".to_string(), cluster.to_string()));
        }
        let request = Arc::new(Request {
            config,
            cluster: cluster.to_string(),
            headers,
            body: body.to_vec(),
            timeout_ms,
        });
        let token = self.token();
        let owned = Owned {
            carrier: Carrier::Main,
            kind,
            members,
            message,
            request,
            retries: 0,
        };
        self.send(token, owned)?;
        Ok(token)
    }

    /// Sends callout `token`: on a request of its members that waits, else from the main thread.
    fn send(&self, token: u32, mut owned: Owned) -> Result<(), Status> {
        let member = waiting_member(&self.filters.borrow(), &owned.members, self.current.get());
        let r = &owned.request;
        owned.carrier = match member {
            Some((ctx, envoy)) => {
                // SAFETY: a live request's pointer, on its worker.
                let id = unsafe {
                    start(
                        ffi::envoy_dynamic_module_callback_http_filter_http_callout,
                        envoy,
                        r,
                    )
                }
                .map_err(|init| match init {
                    2 => abi::BAD_ARGUMENT,
                    _ => INTERNAL_FAILURE,
                })?;
                self.by_callout
                    .borrow_mut()
                    .insert(carry_key(ctx, id), token);
                Carrier::Request { ctx, id }
            }
            None => {
                if !r.config.wake_main() {
                    return Err(INTERNAL_FAILURE);
                }
                OUTGOING
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(Outgoing {
                        wake: self.wake(),
                        token,
                        request: r.clone(),
                    });
                Carrier::Main
            }
        };
        self.by_token.borrow_mut().insert(token, owned);
        Ok(())
    }

    /// Callout `token` is cancelled: its answer, if one comes, is nobody's (Envoy's own callout
    /// has no cancel in this ABI; a request's is cancelled with the request).
    pub(super) fn cancel(&self, token: u32) -> bool {
        let Some(o) = self.by_token.borrow_mut().remove(&token) else {
            return false;
        };
        if let Carrier::Request { ctx, id } = o.carrier {
            self.by_callout.borrow_mut().remove(&carry_key(ctx, id));
        }
        true
    }

    /// Request `ctx` is over: the callouts it carried go again on a member that still waits, or
    /// end here (one that requests waited for fails; a stream message is forgotten).
    pub(super) fn orphans(&self, d: &mut Dispatcher<Native>, ctx: u32) {
        let carried: Vec<(u32, Owned)> = {
            let mut by_token = self.by_token.borrow_mut();
            let tokens: Vec<u32> = by_token
                .iter()
                .filter(|(_, o)| matches!(o.carrier, Carrier::Request { ctx: c, .. } if c == ctx))
                .map(|(t, _)| *t)
                .collect();
            tokens
                .into_iter()
                .filter_map(|t| by_token.remove(&t).map(|o| (t, o)))
                .collect()
        };
        for (token, o) in carried {
            if let Carrier::Request { ctx, id } = o.carrier {
                self.by_callout.borrow_mut().remove(&carry_key(ctx, id));
            }
            let (kind, message) = (o.kind, o.message);
            let again = waiting_member(&self.filters.borrow(), &o.members, 0).is_some();
            if again && self.send(token, o).is_ok() {
                continue;
            }
            self.current.set(0);
            match kind {
                Kind::Http => d.on_http_call_response(token, 0, 0),
                Kind::Unary => {
                    self.reply.borrow_mut().grpc_message = Some("request gone".to_string());
                    d.on_grpc_close(token, status::UNAVAILABLE);
                }
                Kind::Message(stream) => {
                    if let Some(id) = message {
                        d.on_message_abandoned(stream, CalloutId(id));
                    }
                }
            }
        }
    }

    /// A callout request `ctx` carried is answered.
    pub fn answered(&self, d: &mut Dispatcher<Native>, ctx: u32, id: u64, done: Done<'_>) {
        let Some(token) = self.by_callout.borrow_mut().remove(&carry_key(ctx, id)) else {
            return;
        };
        let ok = done.result == ffi::CALLOUT_SUCCESS;
        let (headers, body) = if ok {
            (copy_headers(done.headers), copy_body(done.chunks))
        } else {
            (Vec::new(), Vec::new())
        };
        self.ended(d, token, done.result, headers, body);
    }

    /// The main thread's callouts that ended, handed to this worker.
    pub fn collect(&self, d: &mut Dispatcher<Native>) {
        let landed = match self.wake.borrow().as_ref() {
            Some(wake) => wake.landed(),
            None => return,
        };
        for l in landed {
            self.ended(d, l.token, l.result, l.headers, l.body);
        }
    }

    /// Callout `token` ended with `result` and this response: read by the dispatcher as the
    /// proxy-wasm callback for its kind would be, or sent again if it never reached the service.
    fn ended(
        &self,
        d: &mut Dispatcher<Native>,
        token: u32,
        result: i32,
        headers: Vec<(Vec<u8>, Vec<u8>)>,
        body: Vec<u8>,
    ) {
        let Some(mut owned) = self.by_token.borrow_mut().remove(&token) else {
            return;
        };
        let ok = result == ffi::CALLOUT_SUCCESS;
        let (kind, message) = (owned.kind, owned.message);
        if ok && owned.retries < CONNECT_RETRIES && grpc::unconnected(&headers, &body) {
            owned.retries += 1;
            if self.send(token, owned).is_ok() {
                return;
            }
            // Sent nowhere: it ends as it came.
        }
        {
            let mut reply = self.reply.borrow_mut();
            reply.headers = headers;
            reply.body = body;
            reply.grpc_message = None;
        }
        self.current.set(0);
        match kind {
            Kind::Http => {
                let (n, size) = {
                    let r = self.reply.borrow();
                    (r.headers.len(), r.body.len())
                };
                d.on_http_call_response(token, if ok { n } else { 0 }, size);
            }
            Kind::Unary => {
                let (code, message) = if ok {
                    let r = self.reply.borrow();
                    grpc::unary_answer(pairs(&r.headers), &r.body)
                } else {
                    (failure_status(result), Vec::new())
                };
                if code == status::OK {
                    let size = message.len();
                    self.reply.borrow_mut().message = message;
                    d.on_grpc_receive(token, size);
                } else {
                    self.note_grpc_message();
                    d.on_grpc_close(token, code);
                }
            }
            Kind::Message(stream) => {
                if !self.streams.borrow().contains_key(&stream) {
                    return;
                }
                let code = if ok {
                    grpc::status_of(pairs(&self.reply.borrow().headers))
                } else {
                    Some(failure_status(result))
                };
                let mut fail = |code: u32| {
                    self.note_grpc_message();
                    let text = self.reply.borrow_mut().grpc_message.take();
                    if let Some(id) = message {
                        d.on_message_failed(stream, CalloutId(id), code, text);
                    }
                };
                if let Some(code) = code.filter(|c| *c != status::OK) {
                    // The call carrying a message failed: that message fails, alone.
                    fail(code);
                    return;
                }
                let body = std::mem::take(&mut self.reply.borrow_mut().body);
                let mut messages = Vec::new();
                if grpc::Deframer::default()
                    .push(&body, |m| messages.push(m.to_vec()))
                    .is_err()
                    || messages.is_empty()
                {
                    fail(status::UNKNOWN);
                    return;
                }
                for m in messages {
                    let size = m.len();
                    self.reply.borrow_mut().message = m;
                    self.current.set(0);
                    d.on_grpc_receive(stream, size);
                }
            }
        }
    }

    fn note_grpc_message(&self) {
        let mut r = self.reply.borrow_mut();
        r.grpc_message = r
            .headers
            .iter()
            .find(|(k, _)| k == b"grpc-message")
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned());
    }
}

/// On the main thread (its scheduler's event): the callouts the workers queued go out, as the
/// configuration's.
pub fn send_queued() {
    let queued = std::mem::take(&mut *OUTGOING.lock().unwrap_or_else(PoisonError::into_inner));
    for out in queued {
        let r = &out.request;
        let Some(envoy) = r.config.envoy_alive() else {
            continue;
        };
        // SAFETY: a live configuration's object, on the main thread (the only one that makes
        // its callouts).
        let started = unsafe {
            start(
                ffi::envoy_dynamic_module_callback_http_filter_config_http_callout,
                envoy,
                r,
            )
        };
        if let Ok(id) = started {
            SENT.with(|s| {
                s.borrow_mut()
                    .insert((envoy as usize, id), (out.wake.clone(), out.token))
            });
        } else {
            out.wake.land(Landed {
                token: out.token,
                result: 1,
                headers: Vec::new(),
                body: Vec::new(),
            });
        }
    }
}

/// On the main thread: configuration `envoy`'s callout `id` ended; its worker gets the answer.
pub fn main_done(envoy: ffi::ConfigEnvoy, id: u64, done: Done<'_>) {
    let Some((wake, token)) = SENT.with(|s| s.borrow_mut().remove(&(envoy as usize, id))) else {
        return;
    };
    let ok = done.result == ffi::CALLOUT_SUCCESS;
    wake.land(Landed {
        token,
        result: done.result,
        headers: if ok {
            copy_headers(done.headers)
        } else {
            Vec::new()
        },
        body: if ok {
            copy_body(done.chunks)
        } else {
            Vec::new()
        },
    });
}
