//! The workers' timer. Envoy's dynamic module ABI gives an HTTP filter no timer, only a
//! scheduler per request that posts an event to the request's worker (from any thread, a no-op
//! once the request is gone). So each worker publishes when its next tick is due ([`Wake`]), and
//! keeps the scheduler of one request that waits (made when a request pauses and the worker has
//! none, deleted with that request); one thread of the module sleeps until the earliest tick due
//! and commits that worker's scheduler. A worker with no request waiting has nothing held and
//! nothing in flight for a request: its ticks run at the start of its next callback.

use super::ffi;
use super::state::Landed;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Once, PoisonError, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The longest the thread sleeps without looking (a worker whose tick is due but that has no
/// scheduler yet is looked at again then).
const IDLE_MS: u64 = 50;

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The scheduler a worker's tick is posted through.
#[derive(Default)]
struct Slot {
    /// Envoy's scheduler (`0`: none).
    scheduler: usize,
    /// The request (context id) it belongs to.
    owner: u32,
    /// An event is posted and not yet run.
    committed: bool,
}

/// One worker's next tick, shared with the timer thread, and the answers the main thread hands it.
#[derive(Default)]
pub struct Wake {
    /// When the next tick is due, ms since the epoch (0: none).
    due_ms: AtomicU64,
    slot: Mutex<Slot>,
    /// Callouts the main thread made for this worker that ended (`calls.rs`).
    inbox: Mutex<Vec<Landed>>,
    /// Something waits in `inbox` (looked at in every callback, the lock only taken then).
    landed: AtomicBool,
}

struct Timer {
    wakes: Mutex<Vec<Weak<Wake>>>,
    bell: Condvar,
}

static TIMER: Timer = Timer {
    wakes: Mutex::new(Vec::new()),
    bell: Condvar::new(),
};
static START: Once = Once::new();

impl Wake {
    /// A worker's wake, known to the timer thread (started by the first).
    pub fn register() -> Arc<Wake> {
        let wake = Arc::new(Wake::default());
        TIMER
            .wakes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::downgrade(&wake));
        START.call_once(|| {
            let _ = std::thread::Builder::new()
                .name("tollgate-timer".to_string())
                .spawn(run);
        });
        wake
    }

    /// The worker's next tick is due at `due_ms` (0: none).
    pub fn publish(&self, due_ms: u64) {
        let old = self.due_ms.swap(due_ms, Ordering::Relaxed);
        if due_ms != 0 && (old == 0 || due_ms < old || old <= now_ms()) {
            ring();
        }
    }

    /// Request `owner` waits: its scheduler carries the ticks if the worker has none.
    pub fn adopt(&self, owner: u32, filter: ffi::FilterEnvoy) {
        let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.scheduler != 0 {
            return;
        }
        // SAFETY: on the filter's worker, inside one of its hooks: the pointer is live.
        let scheduler =
            unsafe { ffi::envoy_dynamic_module_callback_http_filter_scheduler_new(filter) };
        if scheduler.is_null() {
            return;
        }
        *slot = Slot {
            scheduler: scheduler as usize,
            owner,
            committed: false,
        };
        drop(slot);
        ring();
    }

    /// Request `owner` is over: its scheduler goes with it (true if it had the worker's).
    pub fn release(&self, owner: u32) -> bool {
        let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.scheduler != 0 && slot.owner == owner {
            // SAFETY: Envoy made this scheduler and it was not deleted (the slot held it); the
            // lock keeps the timer thread from committing it meanwhile.
            unsafe {
                ffi::envoy_dynamic_module_callback_http_filter_scheduler_delete(
                    slot.scheduler as ffi::Scheduler,
                )
            };
            *slot = Slot::default();
            return true;
        }
        false
    }

    /// A callout the main thread made for this worker ended (on the main thread): the worker
    /// reads it at its next callback, which its timer posts now if a request waits.
    pub fn land(&self, landed: Landed) {
        self.inbox
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(landed);
        self.landed.store(true, Ordering::Release);
        self.publish(now_ms());
    }

    /// What the main thread handed over since the last look (on the worker).
    pub fn landed(&self) -> Vec<Landed> {
        if !self.landed.swap(false, Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.inbox.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The posted tick runs.
    pub fn ran(&self) {
        self.slot
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .committed = false;
    }
}

/// Wakes the timer thread to look again. Under its lock, so the bell cannot ring between its
/// look and its sleep.
fn ring() {
    let _wakes = TIMER.wakes.lock().unwrap_or_else(PoisonError::into_inner);
    TIMER.bell.notify_one();
}

/// The timer thread: posts each worker's tick when it is due, sleeps until the next.
fn run() {
    let mut wakes = TIMER.wakes.lock().unwrap_or_else(PoisonError::into_inner);
    loop {
        let now = now_ms();
        let mut next = now + IDLE_MS;
        wakes.retain(|w| w.strong_count() > 0);
        for wake in wakes.iter().filter_map(Weak::upgrade) {
            let due = wake.due_ms.load(Ordering::Relaxed);
            if due == 0 {
                continue;
            }
            if due > now {
                next = next.min(due);
                continue;
            }
            let mut slot = wake.slot.lock().unwrap_or_else(PoisonError::into_inner);
            if slot.scheduler != 0 && !slot.committed {
                // SAFETY: the slot's scheduler is live while the slot holds it (the lock);
                // commit may be called from any thread.
                unsafe {
                    ffi::envoy_dynamic_module_callback_http_filter_scheduler_commit(
                        slot.scheduler as ffi::Scheduler,
                        0,
                    )
                };
                slot.committed = true;
            }
        }
        let wait = Duration::from_millis(next.saturating_sub(now).max(1));
        wakes = TIMER
            .bell
            .wait_timeout(wakes, wait)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}
