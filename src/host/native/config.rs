//! A filter configuration as Envoy made it on the main thread, shared by the workers: its JSON,
//! its metrics (defined in `on_http_filter_config_new`, the only time the ABI allows, under ids of
//! one process-wide space), its scheduler onto the main thread, whether Envoy runs one worker.

use super::ffi;
use crate::host::abi::MetricKind;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};

/// Metric ids, one space for the process: each configuration takes a range when Envoy creates it.
pub(super) static NEXT_METRIC: AtomicU32 = AtomicU32::new(1);

/// A filter configuration as Envoy made it (on the main thread), shared by the workers.
pub struct ModuleConfig {
    /// Envoy's configuration object: valid until `on_http_filter_config_destroy`.
    pub(super) envoy: ffi::ConfigEnvoy,
    /// The plugin configuration (JSON).
    pub json: Vec<u8>,
    /// The first metric id of this configuration's range.
    pub(super) metric_base: u32,
    /// Kind and Envoy's id of each metric, in id order.
    pub(super) metrics: Vec<(MetricKind, usize)>,
    pub(super) names: HashMap<String, u32>,
    /// Cleared when Envoy destroys the configuration: its metrics are not touched after.
    pub(super) alive: AtomicBool,
    /// Envoy runs one worker: the stream of takes is one stream on it (`stream.rs`).
    pub(super) single_worker: bool,
    /// Its scheduler (`0`: none), whose events run on the main thread: it wakes the main thread
    /// for the callouts no request carries (`calls.rs`). Deleted under the lock.
    scheduler: Mutex<usize>,
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
            // SAFETY: a plain call, on the main thread (configurations are made there).
            single_worker: unsafe { ffi::envoy_dynamic_module_callback_get_concurrency() } == 1,
            scheduler: Mutex::new(0),
        }
    }

    /// Its scheduler, made on the main thread when Envoy creates the configuration.
    pub fn schedule_on_main(&self) {
        // SAFETY: Envoy's configuration object, in `on_http_filter_config_new` (main thread).
        let s = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(self.envoy)
        };
        *self
            .scheduler
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = s as usize;
    }

    /// Envoy destroys the configuration: nothing is asked of it after.
    pub fn destroyed(&self) {
        self.alive.store(false, Ordering::Release);
        let mut s = self
            .scheduler
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *s != 0 {
            // SAFETY: made by `schedule_on_main`, deleted once (under the lock).
            unsafe {
                ffi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
                    *s as ffi::ConfigScheduler,
                )
            };
            *s = 0;
        }
    }

    /// Envoy's configuration object, while it lives.
    pub fn envoy_alive(&self) -> Option<ffi::ConfigEnvoy> {
        self.alive.load(Ordering::Acquire).then_some(self.envoy)
    }

    /// Posts an event to the main thread (from any thread); false once the configuration is gone.
    pub fn wake_main(&self) -> bool {
        let s = self
            .scheduler
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *s == 0 || !self.alive.load(Ordering::Acquire) {
            return false;
        }
        // SAFETY: a live scheduler (the lock keeps `destroyed` from deleting it meanwhile);
        // commit may be called from any thread.
        unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                *s as ffi::ConfigScheduler,
                0,
            )
        };
        true
    }

    pub(super) fn metric(&self, id: u32) -> Option<(MetricKind, usize)> {
        let at = usize::try_from(id.checked_sub(self.metric_base)?).ok()?;
        self.metrics.get(at).copied()
    }
}
