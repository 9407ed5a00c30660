//! A configuration arriving and leaving: parsed and prepared once (`on_configure`: its metrics,
//! its shared-data tables, its timer), and, when a push replaces it, its callouts expired and what
//! of its outbox must outlive it handed to the configuration that calls the same service.

use super::*;

impl<A: Abi> Dispatcher<A> {
    pub fn on_configure(&mut self, id: u32, size: usize) -> bool {
        self.abi.enter(None, false);
        self.sync_log_level();
        let bytes = self.abi.buffer(Buffer::PluginConfiguration, 0, size);
        if bytes.is_empty() {
            error!("invalid configuration: config: missing (put the JSON in a google.protobuf.StringValue)");
            return false;
        }
        let config = match Config::parse_all(&bytes) {
            Ok(c) => c,
            Err(refusals) => {
                // Every refusal, a line each, so that one push shows them all; the configuration
                // is refused as a whole.
                for e in &refusals {
                    error!("invalid configuration: {e}");
                }
                return false;
            }
        };
        let metrics = match Metrics::define(&self.abi, &config) {
            Ok(m) => m,
            Err(s) => {
                error!("could not define metrics: {}", abi::status_name(s));
                return false;
            }
        };
        if self.gauges.is_none() {
            let pending = self
                .abi
                .define_metric(MetricKind::Gauge, "tollgate.callouts.pending");
            let memory = self
                .abi
                .define_metric(MetricKind::Gauge, "tollgate.vm.memory_bytes");
            if let (Ok(pending), Ok(memory)) = (pending, memory) {
                self.gauges = Some(VmGauges { pending, memory });
            }
        }
        if config.failure_mode == FailureMode::Fallback {
            for r in &config.rules {
                let Some(l) = r.rate_limit() else { continue };
                if l.capacity < config.fallback.instances {
                    warn!(
                        "rule {}: capacity {} < fallback.instances {}: its fallback bucket admits nothing",
                        r.name, l.capacity, config.fallback.instances
                    );
                }
            }
        }
        info!(
            "configured {} rule(s) ({} of kind concurrency), service cluster {:?} over {}, failure_mode {:?}{}",
            config.rules.len(),
            config
                .rules
                .iter()
                .filter(|r| r.concurrency().is_some())
                .count(),
            config.service.cluster,
            match config.service.transport {
                Transport::Http => "http",
                Transport::Grpc => "grpc",
                Transport::Rls => "rls",
            },
            config.failure_mode,
            if config.shadow { ", shadow mode" } else { "" }
        );
        let prefix = crate::core::local::table::state_prefix(&config);
        // Nothing here looks a bucket's place up: a memo of its own, dropped after.
        let memos = crate::core::base::place::Memos::default();
        let shared = Shared {
            abi: &self.abi,
            prefix: &prefix,
            memos: &memos,
        };
        let applied = flow::Applied {
            // Every callout of this configuration carries this Envoy's instance id.
            instance: Some(crate::core::wire::instance::adopt(&shared)),
            // Every slot exists before any request writes one (shared data has no
            // insert-if-absent).
            previous_max_keys: crate::core::local::fallback::prepare_for(&config, &shared),
        };
        if inflight::local_enabled(&config) {
            // The local fallback slots' counters, zero, before any request.
            crate::core::local::table::prepare(
                &shared,
                crate::core::local::table::SLOTS_TABLE,
                config.fallback.max_keys,
                &[0; 8],
            );
        }
        let plugin = Plugin {
            root: id,
            prefix,
            bearer: config.service.token.as_ref().map(|t| format!("Bearer {t}")),
            grpc_service: callout::grpc_service(&config.service.cluster),
            reads: Reads::of(&config),
            outbox: RefCell::new(Outbox::new(&crate::core::wire::instance::fresh())),
            memos: crate::core::base::place::Memos::default(),
            applied,
            config,
            metrics,
        };
        if let Some(ms) = flow::tick_period_ms(&plugin.config) {
            // The timer that times out the stream's messages, sends a queue that waited, gives
            // back the tokens of pools nobody spends any more, and sends settlements again.
            if let Err(s) = self.abi.set_tick_period(ms) {
                warn!(
                    "no timer for the stream, batch queue, lease pools and settlements: {}",
                    abi::status_name(s)
                );
            }
        }
        self.roots.insert(id, Some(Rc::new(plugin)));
        self.report_memory();
        true
    }

    /// Root context `old` is gone, and Envoy cancelled its callouts silently: each entry ends
    /// here. A request still waiting takes its failure path (as for a reset), a refill's claim
    /// ends; a settlement attempt needs nothing here ([`Dispatcher::hand_over`]).
    pub(super) fn root_ended(&mut self, old: &Rc<Plugin>) {
        for (id, waiter) in self.ledger.close_root(old.root) {
            match waiter {
                Waiter::Take { .. } | Waiter::Member { .. } | Waiter::Acquire { .. } => {
                    self.answer(id, waiter, &mut Ready(Some(reset())));
                }
                Waiter::Refill { plugin, plan, .. } => {
                    lease::abandon(&plugin.config, &plan, &Shared::of(&self.abi, &plugin));
                }
                // The attempt is sent again by whoever takes over the queue (its in-flight mark is
                // cleared by the hand-over), under the same id.
                Waiter::Settle { .. }
                | Waiter::Batch { .. }
                | Waiter::Late { .. }
                | Waiter::Stream { .. }
                | Waiter::Refund
                | Waiter::Release { .. }
                | Waiter::Orphan { .. }
                | Waiter::Abandoned { .. } => {}
            }
        }
        old.outbox.borrow_mut().root_ended();
    }

    /// Another configuration of this worker that calls the same service as `old` (their shared
    /// data and settlements are the same service's), if any.
    pub(super) fn heir(&self, old: &Plugin) -> Option<Rc<Plugin>> {
        self.roots
            .values()
            .flatten()
            .find(|p| p.prefix == old.prefix)
            .cloned()
    }

    /// `heir` takes over something that needs its timer: started at a second if its own
    /// configuration asks for none.
    pub(super) fn wake(&self, heir: &Plugin) {
        if flow::tick_period_ms(&heir.config).is_none()
            && self.abi.set_effective_context(heir.root).is_ok()
        {
            if let Err(s) = self.abi.set_tick_period(1000) {
                warn!(
                    "no timer for what a configuration handed over: {}",
                    abi::status_name(s)
                );
            }
        }
    }

    /// Root `old` went: if its timer was the one letting held requests through, another root's
    /// takes over.
    pub(super) fn keep_releasing(&mut self, old: u32) {
        if self.fast_tick != Some(old) {
            return;
        }
        self.fast_tick = None;
        if self.held.is_empty() {
            return;
        }
        if let Some(root) = self.roots.values().flatten().next().map(|p| p.root) {
            self.speed_up(root);
        }
    }

    /// A configuration went away (a push replaced it): what of its outbox must outlive it goes
    /// to another configuration of this worker that calls the same service (their shared data
    /// and settlements are the same service's). The lease pools it filled (their names carry the
    /// service, not the configuration) are watched there, and given back when they expire; its
    /// settlements not yet delivered are delivered from there, under their ids (the service
    /// applies each once). With no such configuration the settlements are given up, and counted
    /// so.
    pub(super) fn hand_over(&mut self, old: &Plugin) {
        let left = old.outbox.borrow_mut().hand_over();
        if left.pools.is_empty() && left.settles.is_empty() {
            return;
        }
        let Some(heir) = self.heir(old) else {
            if !left.settles.is_empty() {
                warn!(
                    "{} settlement(s) given up: no configuration calls their service any more",
                    left.settles.len()
                );
            }
            return;
        };
        let dropped = heir.outbox.borrow_mut().adopt(left, self.abi.now_ms());
        if dropped > 0 {
            warn!("settlement queue full: {dropped} handed-over settlement(s) dropped");
        }
        self.wake(&heir);
    }
}
