//! A worker's side of the native adapter: its contexts (a root per configuration, a context per
//! request), its callouts and who owns them, the answers to carry out when the callback returns,
//! its ticks; and [`Native`], the dispatcher's [`Abi`] over Envoy's dynamic module callbacks.

use super::ffi::{self, EnvoyBuffer, EnvoyHeader, FilterEnvoy, ModuleBuffer, ModuleHeader};
use super::grpc::{self, status};
use super::shared::Store;
use super::timer::{now_ms, Wake};
use crate::core::base::ledger::CalloutId;
use crate::core::base::store::SetError;
use crate::host::abi::{self, Abi, Buffer, HeaderMap, Level, MetricKind, Status};
use crate::host::dispatch::Dispatcher;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, LazyLock};

/// Shared data, one store for the process (every worker, every configuration).
static SHARED: LazyLock<Store> = LazyLock::new(Store::new);

/// Metric ids, one space for the process: each configuration takes a range when Envoy creates it.
static NEXT_METRIC: AtomicU32 = AtomicU32::new(1);

/// A stream message's call: long enough never to end before the core's own deadline for it.
const MESSAGE_TIMEOUT_MS: u64 = 60_000;

/// `WasmResult::InternalFailure`, for a callout Envoy would not start.
const INTERNAL_FAILURE: Status = 10;

/// A filter configuration as Envoy made it (on the main thread), shared by the workers.
pub struct ModuleConfig {
    /// Envoy's configuration object: valid until `on_http_filter_config_destroy`.
    envoy: ffi::ConfigEnvoy,
    /// The plugin configuration (JSON).
    pub json: Vec<u8>,
    /// The first metric id of this configuration's range.
    metric_base: u32,
    /// Kind and Envoy's id of each metric, in id order.
    metrics: Vec<(MetricKind, usize)>,
    names: HashMap<String, u32>,
    /// Cleared when Envoy destroys the configuration: its metrics are not touched after.
    alive: AtomicBool,
}

// SAFETY: Envoy's configuration object is shared by its workers by design, and the only calls
// made on it from a worker are metric updates, which Envoy makes thread-safe (atomic stats).
unsafe impl Send for ModuleConfig {}
// SAFETY: as above; the rest is immutable after creation, `alive` atomic.
unsafe impl Sync for ModuleConfig {}

impl ModuleConfig {
    pub fn new(envoy: ffi::ConfigEnvoy, json: Vec<u8>) -> ModuleConfig {
        ModuleConfig {
            envoy,
            json,
            metric_base: NEXT_METRIC.load(Ordering::Relaxed),
            metrics: Vec::new(),
            names: HashMap::new(),
            alive: AtomicBool::new(true),
        }
    }

    pub fn destroyed(&self) {
        self.alive.store(false, Ordering::Release);
    }

    fn metric(&self, id: u32) -> Option<(MetricKind, usize)> {
        let at = usize::try_from(id.checked_sub(self.metric_base)?).ok()?;
        self.metrics.get(at).copied()
    }
}

thread_local! {
    /// The configuration whose metrics are being defined (in `on_http_filter_config_new`).
    static DEFINING: RefCell<Option<ModuleConfig>> = const { RefCell::new(None) };
    pub static HOST: Host = Host::new();
}

/// Defines `config`'s metrics through `define` (the dispatcher's own definitions, run on the
/// main thread while Envoy allows it), and returns it with them.
pub fn define_metrics(
    config: ModuleConfig,
    define: impl FnOnce(&Native) -> bool,
) -> Option<ModuleConfig> {
    DEFINING.with(|d| *d.borrow_mut() = Some(config));
    let ok = define(&Native);
    let config = DEFINING.with(|d| d.borrow_mut().take())?;
    NEXT_METRIC.store(
        config
            .metric_base
            .saturating_add(u32::try_from(config.metrics.len()).unwrap_or(u32::MAX)),
        Ordering::Relaxed,
    );
    ok.then_some(config)
}

/// A root context: one configuration on this worker.
pub struct Root {
    pub id: u32,
    pub config: Arc<ModuleConfig>,
    period_ms: u32,
    due_ms: u64,
}

/// A request on this worker.
struct Live {
    envoy: FilterEnvoy,
    /// Its last request callback did not let it go on, and no answer carried it on since.
    waiting: bool,
}

/// What a callout's answer is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Http,
    Unary,
    /// A message of the stream with this token.
    Message(u32),
}

struct Owned {
    /// The request that owns it, and Envoy's id for it there.
    owner: u32,
    id: u64,
    kind: Kind,
    /// The requests waiting for its answer (none: a callout no request waits for).
    members: Vec<u32>,
    /// A stream message's id.
    message: Option<u64>,
    /// What it sends, to send again on another request when its owner goes first.
    request: Request,
}

/// A callout as sent.
struct Request {
    cluster: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    timeout_ms: u64,
}

/// A stream: where its messages go.
struct Stream {
    cluster: String,
    path: String,
    metadata: Vec<(String, String)>,
}

/// A callout's answer, while the dispatcher reads it.
#[derive(Default)]
struct Reply {
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    body: Vec<u8>,
    message: Vec<u8>,
    grpc_message: Option<String>,
}

/// A request's answer, carried out when the callback returns.
pub enum Answer {
    Resume,
    Reply {
        status: u32,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
}

/// This worker's state, beside its dispatcher.
pub struct Host {
    next_context: Cell<u32>,
    /// The dispatcher was told the VM started.
    started: Cell<bool>,
    pub roots: RefCell<Vec<Root>>,
    filters: RefCell<HashMap<u32, Live>>,
    /// The request the host acts on (0: a root's callback).
    current: Cell<u32>,
    /// The root of a root's callback (its tick, its configuration).
    current_root: Cell<u32>,
    /// The configuration being configured (its JSON is the plugin configuration).
    configuring: RefCell<Option<Arc<ModuleConfig>>>,
    next_token: Cell<u32>,
    /// The requests the next callout is for, and its message id ([`Abi::callout_for`]).
    hint: RefCell<(Vec<u32>, Option<u64>)>,
    by_callout: RefCell<HashMap<(u32, u64), u32>>,
    by_token: RefCell<HashMap<u32, Owned>>,
    streams: RefCell<HashMap<u32, Stream>>,
    reply: RefCell<Reply>,
    answers: RefCell<VecDeque<(u32, Answer)>>,
    draining: Cell<bool>,
    pub wake: RefCell<Option<Arc<Wake>>>,
}

impl Host {
    fn new() -> Host {
        Host {
            next_context: Cell::new(1),
            started: Cell::new(false),
            roots: RefCell::new(Vec::new()),
            filters: RefCell::new(HashMap::new()),
            current: Cell::new(0),
            current_root: Cell::new(0),
            configuring: RefCell::new(None),
            next_token: Cell::new(1),
            hint: RefCell::new((Vec::new(), None)),
            by_callout: RefCell::new(HashMap::new()),
            by_token: RefCell::new(HashMap::new()),
            streams: RefCell::new(HashMap::new()),
            reply: RefCell::new(Reply {
                headers: Vec::new(),
                body: Vec::new(),
                message: Vec::new(),
                grpc_message: None,
            }),
            answers: RefCell::new(VecDeque::new()),
            draining: Cell::new(false),
            wake: RefCell::new(None),
        }
    }

    fn context(&self) -> u32 {
        let id = self.next_context.get();
        self.next_context.set(id.wrapping_add(1).max(1));
        id
    }

    fn wake(&self) -> Arc<Wake> {
        self.wake
            .borrow_mut()
            .get_or_insert_with(Wake::register)
            .clone()
    }

    /// The root for `config` on this worker, made and configured on first use.
    pub fn root(&self, d: &mut Dispatcher<Native>, config: &Arc<ModuleConfig>) -> u32 {
        if let Some(r) = self
            .roots
            .borrow()
            .iter()
            .find(|r| Arc::ptr_eq(&r.config, config))
        {
            return r.id;
        }
        let id = self.context();
        let first = !self.started.replace(true);
        self.roots.borrow_mut().push(Root {
            id,
            config: config.clone(),
            period_ms: 0,
            due_ms: 0,
        });
        *self.configuring.borrow_mut() = Some(config.clone());
        self.enter_root(id);
        d.on_context_create(id, 0);
        if first {
            d.on_vm_start();
        }
        d.on_configure(id, config.json.len());
        *self.configuring.borrow_mut() = None;
        id
    }

    /// Roots whose configuration Envoy destroyed go, with their callouts.
    pub fn prune(&self, d: &mut Dispatcher<Native>) {
        let gone: Vec<u32> = self
            .roots
            .borrow()
            .iter()
            .filter(|r| !r.config.alive.load(Ordering::Acquire))
            .map(|r| r.id)
            .collect();
        for id in gone {
            self.roots.borrow_mut().retain(|r| r.id != id);
            d.on_delete(id);
        }
    }

    fn enter_root(&self, id: u32) {
        self.current.set(0);
        self.current_root.set(id);
    }

    /// A request's callback begins.
    pub fn enter(&self, ctx: u32) {
        self.current.set(ctx);
    }

    /// The ticks that are due run, and the worker's next one is published.
    pub fn ticks(&self, d: &mut Dispatcher<Native>) {
        let now = now_ms();
        loop {
            let due = self
                .roots
                .borrow_mut()
                .iter_mut()
                .find(|r| r.period_ms > 0 && r.due_ms <= now)
                .map(|r| {
                    r.due_ms = now + u64::from(r.period_ms);
                    r.id
                });
            let Some(id) = due else { break };
            self.enter_root(id);
            d.on_tick(id);
        }
        self.publish();
    }

    fn publish(&self) {
        let next = self
            .roots
            .borrow()
            .iter()
            .filter(|r| r.period_ms > 0)
            .map(|r| r.due_ms)
            .min()
            .unwrap_or(0);
        self.wake().publish(next);
    }

    /// A new request, under root `root`.
    pub fn open(&self, d: &mut Dispatcher<Native>, root: u32, envoy: FilterEnvoy) -> u32 {
        let ctx = self.context();
        self.filters.borrow_mut().insert(
            ctx,
            Live {
                envoy,
                waiting: false,
            },
        );
        d.on_context_create(ctx, root);
        ctx
    }

    /// Request `ctx` waits (its callback did not let it go on).
    pub fn waits(&self, ctx: u32) {
        let envoy = match self.filters.borrow_mut().get_mut(&ctx) {
            Some(live) => {
                live.waiting = true;
                live.envoy
            }
            None => return,
        };
        self.wake().adopt(ctx, envoy);
    }

    /// A resume for `ctx` asked while its own headers callback runs: taken back, the callback
    /// lets it go on instead.
    pub fn take_resume(&self, ctx: u32) -> bool {
        let mut answers = self.answers.borrow_mut();
        match answers
            .iter()
            .position(|(c, a)| *c == ctx && matches!(a, Answer::Resume))
        {
            Some(at) => {
                answers.remove(at);
                true
            }
            None => false,
        }
    }

    /// Request `ctx` is destroyed: the dispatcher forgets it. Envoy cancelled the callouts it
    /// owned without a word: each goes again on a request that waits for it (or, for one no
    /// request waits for, on any request of the worker); with none left, one that requests wait
    /// for fails, and a stream message nobody waits for is forgotten.
    pub fn close(&self, d: &mut Dispatcher<Native>, ctx: u32) {
        self.filters.borrow_mut().remove(&ctx);
        self.answers.borrow_mut().retain(|(c, _)| *c != ctx);
        if let Some(w) = self.wake.borrow().as_ref() {
            w.release(ctx);
        }
        d.on_delete(ctx);
        let owned: Vec<(u32, Owned)> = {
            let mut by_token = self.by_token.borrow_mut();
            let tokens: Vec<u32> = by_token
                .iter()
                .filter(|(_, o)| o.owner == ctx)
                .map(|(t, _)| *t)
                .collect();
            tokens
                .into_iter()
                .filter_map(|t| {
                    let o = by_token.remove(&t)?;
                    self.by_callout.borrow_mut().remove(&(o.owner, o.id));
                    Some((t, o))
                })
                .collect()
        };
        for (token, o) in owned {
            let again = {
                let filters = self.filters.borrow();
                if o.members.is_empty() {
                    owner_of(&filters, &[], 0)
                } else {
                    o.members
                        .iter()
                        .find_map(|c| filters.get(c).filter(|l| l.waiting).map(|l| (*c, l.envoy)))
                }
            };
            if let Some(owner) = again {
                if self
                    .start(
                        token,
                        owner,
                        o.kind,
                        o.members.clone(),
                        o.message,
                        o.request,
                    )
                    .is_ok()
                {
                    continue;
                }
            }
            self.current.set(0);
            match o.kind {
                Kind::Http => d.on_http_call_response(token, 0, 0),
                Kind::Unary => {
                    self.reply.borrow_mut().grpc_message = Some("request gone".to_string());
                    d.on_grpc_close(token, status::UNAVAILABLE);
                }
                Kind::Message(stream) => {
                    if let Some(id) = o.message {
                        d.on_message_abandoned(stream, CalloutId(id));
                    }
                }
            }
        }
    }

    /// A callout request `ctx` owned is answered.
    pub fn answered(&self, d: &mut Dispatcher<Native>, ctx: u32, id: u64, done: Done<'_>) {
        let Done {
            result,
            headers,
            chunks,
        } = done;
        let Some(token) = self.by_callout.borrow_mut().remove(&(ctx, id)) else {
            return;
        };
        let Some(owned) = self.by_token.borrow_mut().remove(&token) else {
            return;
        };
        {
            let mut reply = self.reply.borrow_mut();
            reply.headers.clear();
            reply.body.clear();
            reply.grpc_message = None;
            if result == ffi::CALLOUT_SUCCESS {
                for h in headers {
                    // SAFETY: Envoy's header, valid for the hook (`Done`).
                    let (k, v) = unsafe { h.pair() };
                    reply.headers.push((k.to_vec(), v.to_vec()));
                }
                for c in chunks {
                    // SAFETY: Envoy's buffer, valid for the hook (`Done`).
                    reply.body.extend_from_slice(unsafe { c.bytes() });
                }
            }
        }
        self.current.set(0);
        let ok = result == ffi::CALLOUT_SUCCESS;
        match owned.kind {
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
                if let Some(code) = code.filter(|c| *c != status::OK) {
                    // The call carrying a stream's message failed as the stream would have.
                    self.note_grpc_message();
                    d.on_grpc_close(stream, code);
                    return;
                }
                let body = std::mem::take(&mut self.reply.borrow_mut().body);
                let mut messages = Vec::new();
                if grpc::Deframer::default()
                    .push(&body, |m| messages.push(m.to_vec()))
                    .is_err()
                {
                    d.on_grpc_close(stream, status::UNKNOWN);
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

    /// Carries out the answers asked for, oldest first, each on its request if it is still
    /// there. Not from inside itself: a local reply runs hooks that may ask for more, and the
    /// outer loop carries those out after.
    pub fn finish(&self) {
        if self.draining.replace(true) {
            return;
        }
        loop {
            let Some((ctx, answer)) = self.answers.borrow_mut().pop_front() else {
                break;
            };
            let envoy = match self.filters.borrow_mut().get_mut(&ctx) {
                Some(live) => {
                    live.waiting = false;
                    live.envoy
                }
                None => continue,
            };
            match answer {
                // SAFETY: a live request's pointer, on its worker.
                Answer::Resume => unsafe {
                    ffi::envoy_dynamic_module_callback_http_filter_continue_decoding(envoy)
                },
                Answer::Reply {
                    status,
                    headers,
                    body,
                } => {
                    let mut hs: Vec<ModuleHeader> = headers
                        .iter()
                        .map(|(k, v)| ModuleHeader::of(k.as_bytes(), v.as_bytes()))
                        .collect();
                    // SAFETY: a live request's pointer; the headers and body outlive the call.
                    unsafe {
                        ffi::envoy_dynamic_module_callback_http_send_response(
                            envoy,
                            status,
                            hs.as_mut_ptr(),
                            hs.len(),
                            ModuleBuffer::of(&body),
                            ModuleBuffer::of(b"tollgate"),
                        )
                    };
                }
            }
        }
        self.draining.set(false);
    }

    fn current_filter(&self) -> Option<FilterEnvoy> {
        let ctx = self.current.get();
        self.filters.borrow().get(&ctx).map(|l| l.envoy)
    }

    fn token(&self) -> u32 {
        loop {
            let t = self.next_token.get();
            self.next_token.set(t.wrapping_add(1).max(1));
            if !self.by_token.borrow().contains_key(&t) && !self.streams.borrow().contains_key(&t) {
                return t;
            }
        }
    }

    /// Sends a callout for the requests [`Abi::callout_for`] named last (a callout no request
    /// waits for if none): its token.
    fn call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
        kind: Kind,
    ) -> Result<u32, Status> {
        let (members, message) = std::mem::take(&mut *self.hint.borrow_mut());
        let owner = owner_of(&self.filters.borrow(), &members, self.current.get())
            .ok_or(INTERNAL_FAILURE)?;
        let mut headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect();
        if !headers
            .iter()
            .any(|(k, _)| k == ":authority" || k == "host")
        {
            headers.push(("host".to_string(), cluster.to_string()));
        }
        let request = Request {
            cluster: cluster.to_string(),
            headers,
            body: body.to_vec(),
            timeout_ms,
        };
        let token = self.token();
        self.start(token, owner, kind, members, message, request)?;
        Ok(token)
    }

    /// Starts `request` on request `owner`, as callout `token`.
    fn start(
        &self,
        token: u32,
        (owner, envoy): (u32, FilterEnvoy),
        kind: Kind,
        members: Vec<u32>,
        message: Option<u64>,
        request: Request,
    ) -> Result<(), Status> {
        let mut hs: Vec<ModuleHeader> = request
            .headers
            .iter()
            .map(|(k, v)| ModuleHeader::of(k.as_bytes(), v.as_bytes()))
            .collect();
        let mut id = 0u64;
        // SAFETY: a live request's pointer on its worker; every buffer outlives the call.
        let init = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_http_callout(
                envoy,
                &mut id,
                ModuleBuffer::of(request.cluster.as_bytes()),
                hs.as_mut_ptr(),
                hs.len(),
                ModuleBuffer::of(&request.body),
                request.timeout_ms,
            )
        };
        if init != ffi::CALLOUT_INIT_SUCCESS {
            return Err(match init {
                2 => abi::BAD_ARGUMENT,
                _ => INTERNAL_FAILURE,
            });
        }
        self.by_callout.borrow_mut().insert((owner, id), token);
        self.by_token.borrow_mut().insert(
            token,
            Owned {
                owner,
                id,
                kind,
                members,
                message,
                request,
            },
        );
        Ok(())
    }

    fn grpc_headers<'a>(
        path: &'a str,
        cluster: &'a str,
        metadata: &'a [(String, String)],
    ) -> Vec<(&'a str, &'a str)> {
        let mut headers = vec![
            (":method", "POST"),
            (":path", path),
            (":authority", cluster),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ];
        headers.extend(metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        headers
    }
}

/// The request a callout is made on: the first of `members` that still waits; for a callout no
/// request waits for, the one being served (`current`) if it waits, else the newest one that
/// waits, else the one being served, else any.
fn owner_of(
    filters: &HashMap<u32, Live>,
    members: &[u32],
    current: u32,
) -> Option<(u32, FilterEnvoy)> {
    if let Some(found) = members
        .iter()
        .find_map(|c| filters.get(c).filter(|l| l.waiting).map(|l| (*c, l.envoy)))
    {
        return Some(found);
    }
    if let Some(l) = filters.get(&current).filter(|l| l.waiting) {
        return Some((current, l.envoy));
    }
    if let Some((c, l)) = filters
        .iter()
        .filter(|(_, l)| l.waiting)
        .max_by_key(|(c, _)| **c)
    {
        return Some((*c, l.envoy));
    }
    if let Some(l) = filters.get(&current) {
        return Some((current, l.envoy));
    }
    filters.iter().next().map(|(c, l)| (*c, l.envoy))
}

fn failure_status(result: i32) -> u32 {
    if result == ffi::CALLOUT_TOO_LARGE {
        status::RESOURCE_EXHAUSTED
    } else {
        status::UNAVAILABLE
    }
}

fn pairs(headers: &[(Vec<u8>, Vec<u8>)]) -> impl Iterator<Item = (&[u8], &[u8])> {
    headers.iter().map(|(k, v)| (k.as_slice(), v.as_slice()))
}

/// A callout's end as Envoy reports it: its result (`envoy_dynamic_module_type_http_callout_result`)
/// and the response's headers and body, Envoy's, valid for the hook that reports it.
pub struct Done<'a> {
    pub result: i32,
    pub headers: &'a [EnvoyHeader],
    pub chunks: &'a [EnvoyBuffer],
}

/// # Safety
/// `ptr` must point to `n` items valid for `'a`, or be null.
pub unsafe fn slice<'a, T>(ptr: *const T, n: usize) -> &'a [T] {
    if ptr.is_null() || n == 0 {
        &[]
    } else {
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts(ptr, n) }
    }
}

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

/// The dispatcher's host calls over Envoy's dynamic module callbacks, on this worker's state.
pub struct Native;

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

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        if path != ["source", "address"] {
            return None;
        }
        HOST.with(|h| {
            let f = h.current_filter()?;
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
        let metadata: Vec<(String, String)> = metadata
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect();
        let headers = Host::grpc_headers(&path, &cluster, &metadata);
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
        HOST.with(|h| {
            let token = h.token();
            h.streams.borrow_mut().insert(
                token,
                Stream {
                    cluster,
                    path: format!("/{service_name}/{method}"),
                    metadata: metadata
                        .iter()
                        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                        .collect(),
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
            let (cluster, path, metadata) = {
                let streams = h.streams.borrow();
                let s = streams.get(&token).ok_or(abi::NOT_FOUND)?;
                (s.cluster.clone(), s.path.clone(), s.metadata.clone())
            };
            let headers = Host::grpc_headers(&path, &cluster, &metadata);
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
            if h.streams.borrow_mut().remove(&token).is_some() {
                return Ok(());
            }
            match h.by_token.borrow_mut().remove(&token) {
                Some(o) => {
                    h.by_callout.borrow_mut().remove(&(o.owner, o.id));
                    Ok(())
                }
                None => Err(abi::NOT_FOUND),
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
