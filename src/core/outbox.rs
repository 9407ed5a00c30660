//! The outbox of one configuration in one worker: how each of its takes leaves, and everything of
//! its traffic that waits or is in flight here. The core decides; the adapter (`src/host/`) carries
//! out what it says and keeps no state of its own beside it.
//!
//! - [`Outbox::leave`]: a take goes as a call of its own, as a message on the worker's stream, or
//!   into the batch queue behind the callouts in flight.
//! - the batch queue ([`batch::Queue`]), the stream and its messages ([`Stream`]), the lease pools
//!   this worker deposited into ([`lease::Held`], given back when they expire), and the
//!   settlements of responses that ended, delivered with retries ([`settle::Queue`]).
//! - [`Outbox::chores`]: what the root context's timer has to look at.
//! - [`Outbox::root_ended`], [`Outbox::hand_over`], [`Outbox::adopt`]: a configuration replaced
//!   by a push passes what must outlive it to the configuration calling the same service.

use crate::core::config::Config;
use crate::core::local::lease;
use crate::core::settle;
use crate::core::wire::batch;
use crate::core::wire::stream::Stream;

/// How a take leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leave {
    /// Into the batch queue: one of the configuration's callouts is in flight, and the queue
    /// leaves beside it or after it ([`batch::Queue::due`]).
    Queue,
    /// As a message on the worker's stream (`service.stream`).
    Message,
    /// As a call of its own (a unary gRPC call or an HTTP callout; also every traced take, which
    /// goes alone with its `traceparent`). `gates`: the call holds the batch queue back while it
    /// is out (takes that come meanwhile queue behind it).
    Call { gates: bool },
}

/// What the timer has to look at on a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Chores {
    /// Messages of the stream past their deadline, a silent stream.
    pub messages: bool,
    /// The batch queue: takes past their timeout, a queue due.
    pub queue: bool,
    /// Settlements due.
    pub settles: bool,
    /// Lease pools whose tokens expired.
    pub pools: bool,
}

/// What a configuration leaves to the one that takes over its service (see the module doc).
#[derive(Debug, Default)]
pub struct HandOver {
    /// Lease pools it deposited into, still to be given back when they expire.
    pub pools: Vec<lease::Held>,
    /// Settlements not yet delivered (queued, or an attempt that its end cancelled).
    pub settles: Vec<settle::Pending<Vec<settle::Item>>>,
}

/// One configuration's outbox in one worker.
#[derive(Debug)]
pub struct Outbox {
    /// Group commit of its takes (`service.batch`).
    pub queue: batch::Queue,
    /// Its stream of takes (`service.stream`): the open stream and its messages in flight.
    pub stream: Stream,
    /// Lease pools this worker deposited into, looked at on every tick ([`lease::sweep`]).
    pub pools: Vec<lease::Held>,
    /// Settlements of responses that ended (rules charged by the response).
    pub settles: settle::Queue<Vec<settle::Item>>,
    /// Per rule (by index), requests held or asked to be held (shaping, `shape.max_held`).
    places: Vec<u32>,
}

impl Outbox {
    /// An empty outbox; `instance` names this VM in its settlements' ids.
    pub fn new(instance: &str) -> Outbox {
        Outbox {
            queue: batch::Queue::default(),
            stream: Stream::default(),
            pools: Vec::new(),
            settles: settle::Queue::new(instance),
            places: Vec::new(),
        }
    }

    /// How a take of `cfg` leaves now. `rls`: it speaks Envoy's RLS protocol (one call a take,
    /// never batched); `traced`: it carries a sampled request's `traceparent` (alone, as a call).
    pub fn leave(&self, cfg: &Config, rls: bool, traced: bool) -> Leave {
        let svc = &cfg.service;
        let batching = svc.batch > 0 && !rls && !traced;
        if batching && self.queue.busy() {
            Leave::Queue
        } else if svc.stream && !traced {
            Leave::Message
        } else {
            Leave::Call { gates: batching }
        }
    }

    /// What the timer has to look at now.
    pub fn chores(&self, cfg: &Config) -> Chores {
        Chores {
            messages: cfg.service.stream,
            queue: cfg.service.batch > 0 && self.queue.waiting() > 0,
            settles: !self.settles.is_empty(),
            pools: !self.pools.is_empty(),
        }
    }

    /// A place for one more held request of rule `rule`, if it holds fewer than `max`.
    pub fn place(&mut self, rule: usize, max: u32) -> bool {
        if self.places.len() <= rule {
            self.places.resize(rule + 1, 0);
        }
        match self.places.get_mut(rule) {
            Some(n) if *n < max => {
                *n += 1;
                true
            }
            _ => false,
        }
    }

    /// A place of rule `rule` given back.
    pub fn unplace(&mut self, rule: usize) {
        if let Some(n) = self.places.get_mut(rule) {
            *n = n.saturating_sub(1);
        }
    }

    /// Lease pools a request or a refill deposited into, watched from now on.
    pub fn watch(&mut self, pools: Vec<lease::Held>) {
        for h in pools {
            lease::watch(&mut self.pools, h);
        }
    }

    /// Its root context is gone, and Envoy cancelled its callouts: nothing holds the queue back
    /// any more, and nothing waits in it (the adapter failed each waiting take).
    pub fn root_ended(&mut self) {
        self.queue = batch::Queue::default();
    }

    /// What must outlive this configuration, taken out of it.
    pub fn hand_over(&mut self) -> HandOver {
        HandOver {
            pools: std::mem::take(&mut self.pools),
            settles: self.settles.hand_over(),
        }
    }

    /// Takes over what another configuration of the same service left at `now_ms`; the number
    /// of settlements dropped because the queue was full.
    pub fn adopt(&mut self, left: HandOver, now_ms: u64) -> u64 {
        self.watch(left.pools);
        if left.settles.is_empty() {
            return 0;
        }
        self.settles.adopt(left.settles, now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::base::ledger::CalloutId;

    fn config(service: &str) -> Config {
        let json = format!(
            r#"{{"service":{{"cluster":"svc",{service}}},
                "rules":[{{"name":"r","key":["literal:k"],"capacity":5,"period_ms":1000}}]}}"#
        );
        Config::parse(json.as_bytes()).unwrap_or_else(|e| unreachable!("{e}"))
    }

    #[test]
    fn a_take_leaves_as_the_configuration_and_the_queue_say() {
        let stream = config(r#""transport":"grpc","batch":8"#);
        let http = config(r#""transport":"http","batch":8"#);
        let alone = config(r#""transport":"http","batch":0"#);
        let mut o = Outbox::new("i");
        assert_eq!(o.leave(&stream, false, false), Leave::Message);
        assert_eq!(o.leave(&http, false, false), Leave::Call { gates: true });
        o.queue.started(0);
        assert_eq!(
            o.leave(&stream, false, false),
            Leave::Queue,
            "behind one in flight"
        );
        assert_eq!(o.leave(&http, false, false), Leave::Queue);
        let alone_call = Leave::Call { gates: false };
        assert_eq!(o.leave(&alone, false, false), alone_call, "no batching");
        assert_eq!(
            o.leave(&stream, false, true),
            alone_call,
            "a traced take goes alone"
        );
        assert_eq!(
            o.leave(&http, true, false),
            alone_call,
            "an RLS take is never batched"
        );
    }

    #[test]
    fn the_timer_looks_at_what_waits() {
        let cfg = config(r#""transport":"http","batch":8"#);
        let mut o = Outbox::new("i");
        assert_eq!(o.chores(&cfg), Chores::default());
        o.queue.started(0);
        let take = crate::core::wire::TakeRequest::default();
        o.queue
            .push(8, CalloutId(1), &take, 0)
            .unwrap_or_else(|e| unreachable!("{e}"));
        assert!(o.chores(&cfg).queue);
        o.root_ended();
        assert!(
            !o.chores(&cfg).queue,
            "a root that ended leaves nothing queued"
        );
    }
}
