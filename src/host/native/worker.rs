//! A worker's side of the native adapter: its contexts (a root per configuration, made on its
//! first request under it, and a context per request), the answers to carry out when the
//! callback returns, its ticks; and the configurations as Envoy made them, with their metrics.

use super::config::{ModuleConfig, NEXT_METRIC};
use super::ffi::{self, FilterEnvoy, ModuleBuffer};
use super::state::{self, Native, Owned, Real, Reply, Stream};
use super::timer::{now_ms, Wake};
use crate::core::base::ledger::{IdHasher, IdMap};
use crate::host::dispatch::Dispatcher;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::sync::atomic::Ordering;
use std::sync::Arc;

thread_local! {
    /// The configuration whose metrics are being defined (in `on_http_filter_config_new`).
    pub(super) static DEFINING: RefCell<Option<ModuleConfig>> = const { RefCell::new(None) };
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
    pub(super) period_ms: u32,
    pub(super) due_ms: u64,
}

/// The key of a callout a request carries: its context id and Envoy's id for the callout there
/// (a request's callouts are counted from 1, far below 2^32).
pub(super) fn carry_key(ctx: u32, id: u64) -> u64 {
    (u64::from(ctx) << 32) ^ id
}

/// A request on this worker.
pub(super) struct Live {
    pub(super) envoy: FilterEnvoy,
    /// Its last request callback did not let it go on, and no answer carried it on since.
    pub(super) waiting: bool,
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
    pub(super) filters: RefCell<IdMap<Live>>,
    /// The request the host acts on (0: a root's callback).
    pub(super) current: Cell<u32>,
    /// The root of a root's callback (its tick, its configuration).
    pub(super) current_root: Cell<u32>,
    /// The configuration being configured (its JSON is the plugin configuration).
    pub(super) configuring: RefCell<Option<Arc<ModuleConfig>>>,
    pub(super) next_token: Cell<u32>,
    /// The requests the next callout is for, and its message id (`Abi::callout_for`).
    pub(super) hint: RefCell<(Vec<u32>, Option<u64>)>,
    /// Callouts carried by a request: ([`carry_key`] of its context and Envoy's id) -> token.
    pub(super) by_callout: RefCell<HashMap<u64, u32, BuildHasherDefault<IdHasher>>>,
    /// Every callout in flight, by token.
    pub(super) by_token: RefCell<IdMap<Owned>>,
    pub(super) streams: RefCell<IdMap<Stream>>,
    /// Streams open on Envoy, when one worker runs (`stream.rs`).
    pub(super) real: RefCell<IdMap<Real>>,
    pub(super) reply: RefCell<Reply>,
    pub(super) answers: RefCell<VecDeque<(u32, Answer)>>,
    draining: Cell<bool>,
    pub wake: RefCell<Option<Arc<Wake>>>,
}

impl Host {
    fn new() -> Host {
        Host {
            next_context: Cell::new(1),
            started: Cell::new(false),
            roots: RefCell::new(Vec::new()),
            filters: RefCell::new(IdMap::default()),
            current: Cell::new(0),
            current_root: Cell::new(0),
            configuring: RefCell::new(None),
            next_token: Cell::new(1),
            hint: RefCell::new((Vec::new(), None)),
            by_callout: RefCell::new(HashMap::default()),
            by_token: RefCell::new(IdMap::default()),
            streams: RefCell::new(IdMap::default()),
            real: RefCell::new(IdMap::default()),
            reply: RefCell::new(Reply::default()),
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

    pub(super) fn wake(&self) -> Arc<Wake> {
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

    pub(super) fn enter_root(&self, id: u32) {
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

    pub(super) fn publish(&self) {
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

    /// Whether request `ctx` is still on this worker.
    pub fn is_open(&self, ctx: u32) -> bool {
        self.filters.borrow().contains_key(&ctx)
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

    /// A local reply for `ctx` waits to be carried out.
    pub fn replies(&self, ctx: u32) -> bool {
        self.answers
            .borrow()
            .iter()
            .any(|(c, a)| *c == ctx && matches!(a, Answer::Reply { .. }))
    }

    /// Request `ctx` is over (or destroyed; the second time does nothing): the dispatcher forgets it. Envoy cancelled the callouts it
    /// owned without a word: each goes again on a request that waits for it (or, for one no
    /// request waits for, on any request of the worker); with none left, one that requests wait
    /// for fails, and a stream message nobody waits for is forgotten.
    pub fn close(&self, d: &mut Dispatcher<Native>, ctx: u32) {
        if self.filters.borrow_mut().remove(&ctx).is_none() {
            return;
        }
        self.answers.borrow_mut().retain(|(c, _)| *c != ctx);
        if let Some(w) = self.wake.borrow().as_ref() {
            // Its scheduler carried the worker's ticks: another request that waits takes over.
            if w.release(ctx) {
                let next = self
                    .filters
                    .borrow()
                    .iter()
                    .find(|(_, l)| l.waiting)
                    .map(|(c, l)| (*c, l.envoy));
                if let Some((c, envoy)) = next {
                    w.adopt(c, envoy);
                }
            }
        }
        d.on_delete(ctx);
        self.orphans(d, ctx);
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
                    let mut hs = state::module_headers(&headers);
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

    /// The configuration a callout now is for: the current root's, else the worker's first.
    pub(super) fn config(&self) -> Option<Arc<ModuleConfig>> {
        let roots = self.roots.borrow();
        let root = self.current_root.get();
        roots
            .iter()
            .find(|r| r.id == root)
            .or_else(|| roots.first())
            .map(|r| r.config.clone())
    }

    pub(super) fn current_filter(&self) -> Option<FilterEnvoy> {
        let ctx = self.current.get();
        self.filters.borrow().get(&ctx).map(|l| l.envoy)
    }
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
