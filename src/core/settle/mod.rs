//! Reserve, then settle: the bookkeeping of a limit priced in what the response used (LLM tokens).
//!
//! A rule charged by the response takes an estimate when the request arrives (the reservation).
//! When the response ends, the difference between what it reported using and the estimate is
//! settled in the same bucket: given back when it used less, charged on top when it used more (the
//! bucket may then owe tokens, and following requests wait as long as the debt takes to refill).
//!
//! This module decides *what* to settle and keeps the queue of settlements the root context still
//! has to deliver; it does no I/O. Each settlement carries an id unique to this proxy's VM
//! (`<instance>-<sequence>`) so that a settlement whose answer was lost can be sent again and
//! applied once: the service records applied ids beside the bucket for the retry window.
//!
//! How a response can end, and what it is charged in all ([`charged`]; [`amount`] turns that into
//! what is settled):
//! - it ends normally: the usage it reported, or the reservation when it reported none;
//! - the upstream resets or the client leaves mid-stream: as if it had run to the end. LLM APIs
//!   report usage in their last event, so a client that hangs up early would otherwise get the
//!   whole generation for its reservation: by default (`usage.cut: "bound"`) the most the request
//!   could have reserved, or the usage seen if larger; `"reserved"`: the reservation, or the
//!   usage seen if larger;
//! - a denial before the stream starts reserved nothing: nothing to settle.
//!
//! What a response used beyond its reservation is charged in full (the bucket owes it until its
//! refill has repaid it); each response's charge is capped at its rule's `usage.max`, so one
//! settlement pushes a bucket at most `usage.max - reservation` deeper.

//!
//! `usage`: the usage an LLM response reports (JSON body or SSE stream), read in bounded memory.

pub mod usage;

use crate::core::config::{Charge, Config, Cut, Rule};
use crate::core::wire::plan::Plan;
use crate::core::wire::Bucket;
use usage::{Format, UsageReader};

/// Attempts before a settlement that only gives tokens back is dropped (and counted): with the
/// backoff below, about 7 seconds (100, 200, 400, 800, 1,600, 2,000, 2,000 ms apart). Dropping a
/// refund only leaves the bucket stricter. A settlement that charges more is never given up: it
/// is tried every [`MAX_BACKOFF_MS`] until the service applies it.
pub const MAX_ATTEMPTS: u32 = 8;

/// Wait before the first retry; doubles per attempt, up to [`MAX_BACKOFF_MS`].
pub const FIRST_BACKOFF_MS: u64 = 100;

/// Longest wait between two attempts.
pub const MAX_BACKOFF_MS: u64 = 2_000;

/// Settlements a VM keeps waiting for delivery; beyond that a refund is dropped first (the oldest),
/// and only a queue of nothing but extra charges drops its oldest (counted, with its tokens).
pub const MAX_PENDING: usize = 1024;

/// How the response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The whole body arrived.
    Complete,
    /// The upstream reset the stream, or the client went away, before the body ended.
    Cut,
}

/// What a reservation turns into when its response ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Amount {
    /// Nothing to send: the estimate stands.
    Stands,
    /// Give back this many tokens (the response used less than reserved).
    Refund(u64),
    /// Charge this many more (the response used more than reserved).
    Extra(u64),
}

/// What a response is charged in all: it reserved `reserved` (the most it could have reserved
/// is `bound`), its rule charges one response at most `max`, `seen` is the usage it reported
/// (already priced), `ending` how it ended and `cut` what a cut-off response pays.
pub fn charged(
    reserved: u64,
    bound: u64,
    seen: Option<u64>,
    ending: Ending,
    cut: Cut,
    max: u64,
) -> u64 {
    let used = match (ending, cut) {
        (Ending::Complete, _) => seen.unwrap_or(reserved),
        (Ending::Cut, Cut::Bound) => seen.unwrap_or(0).max(bound.max(reserved)),
        (Ending::Cut, Cut::Reserved) => seen.unwrap_or(0).max(reserved),
    };
    used.min(max)
}

/// What to settle for a reservation of `reserved` tokens whose response is charged `used`.
pub fn amount(reserved: u64, used: u64) -> Amount {
    match used.cmp(&reserved) {
        core::cmp::Ordering::Less => Amount::Refund(reserved - used),
        core::cmp::Ordering::Equal => Amount::Stands,
        core::cmp::Ordering::Greater => Amount::Extra(used - reserved),
    }
}

/// One bucket a response-priced request reserved its estimate in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    /// The bucket as the take named it (its `cost` is the estimate).
    pub bucket: Bucket,
    /// Index of its rule in `Config::rules`.
    pub rule: usize,
    /// What its rule's usage header reported (lower case name looked up at the response headers).
    pub header_usage: Option<u64>,
    /// The window the service charged the estimate in (a window algorithm's; `None`: a token
    /// bucket, or not the service's answer).
    pub window: Option<u64>,
}

impl Reserved {
    fn estimate(&self) -> u64 {
        self.bucket.cost()
    }
}

/// A request admitted under rules charged by the response, from its admission until its stream
/// ends: what it reserved, and what the response has reported so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meter {
    /// The buckets charged an estimate, in take order.
    pub reserved: Vec<Reserved>,
    /// Reads the body (`None`: no rule reads it, the usage headers answered, or its
    /// `content-type` is neither JSON nor an event stream).
    reader: Option<UsageReader>,
    /// The response ended as it should (end of stream seen).
    ended: bool,
    /// The model the request asked for: its prices in `usage.prices`.
    model: Option<String>,
}

/// The reservation an admitted request made: its buckets whose rule is charged by the response,
/// each with the window the service charged it in (`windows`, per bucket of the plan: its answer's;
/// empty when the service did not answer), and the model the request asked for (its prices).
/// `None` when it has none.
pub fn reserve(cfg: &Config, plan: &Plan, windows: &[u64], model: Option<&str>) -> Option<Meter> {
    let reserved: Vec<Reserved> = plan
        .request
        .buckets
        .iter()
        .zip(&plan.rules)
        .enumerate()
        .filter(|(_, (_, &r))| {
            cfg.rules
                .get(r)
                .and_then(Rule::rate_limit)
                .is_some_and(|l| l.charge.is_some())
        })
        .map(|(i, (b, &rule))| Reserved {
            bucket: Bucket {
                lease: None,
                ..b.clone()
            },
            rule,
            header_usage: None,
            window: windows.get(i).copied().filter(|&w| w > 0),
        })
        .collect();
    (!reserved.is_empty()).then_some(Meter {
        reserved,
        reader: None,
        ended: false,
        model: model.map(str::to_string),
    })
}

impl Meter {
    fn charge<'c>(&self, cfg: &'c Config, r: &Reserved) -> Option<&'c Charge> {
        cfg.rules.get(r.rule)?.rate_limit()?.charge.as_ref()
    }

    /// The usage headers to read from the response (each once).
    pub fn usage_headers<'c>(&self, cfg: &'c Config) -> Vec<&'c str> {
        let mut names: Vec<&str> = Vec::new();
        for r in &self.reserved {
            if let Some(h) = self.charge(cfg, r).and_then(|c| c.header.as_deref()) {
                if !names.contains(&h) {
                    names.push(h);
                }
            }
        }
        names
    }

    /// The response headers arrived: `header(name)` gives a usage header's value, `content_type`
    /// decides how the body is read, `end_of_stream` says there is no body.
    pub fn on_headers(
        &mut self,
        cfg: &Config,
        content_type: Option<&str>,
        header: impl Fn(&str) -> Option<String>,
        end_of_stream: bool,
    ) {
        let mut body_wanted = false;
        let charges: Vec<Option<Charge>> = self
            .reserved
            .iter()
            .map(|r| self.charge(cfg, r).cloned())
            .collect();
        for (r, c) in self.reserved.iter_mut().zip(charges) {
            let Some(c) = c else { continue };
            r.header_usage = c
                .header
                .as_deref()
                .and_then(&header)
                .and_then(|v| usage::from_header(&v));
            body_wanted |= r.header_usage.is_none() && c.body;
        }
        self.ended = end_of_stream;
        if body_wanted && !end_of_stream {
            self.reader = body_format(content_type).map(UsageReader::new);
        }
    }

    /// Whether the body is to be handed over: to be read for its usage, or, when no header
    /// reported it, only so that its end is seen (a response cut off is charged more).
    pub fn wants_body(&self) -> bool {
        !self.ended
            && (self.reader.is_some() || self.reserved.iter().any(|r| r.header_usage.is_none()))
    }

    /// A piece of the response body; `end_of_stream` when it is the last.
    pub fn on_body(&mut self, chunk: &[u8], end_of_stream: bool) {
        if let Some(reader) = &mut self.reader {
            reader.feed(chunk);
        }
        self.ended |= end_of_stream;
    }

    /// Trailers arrived: the body is complete.
    pub fn on_trailers(&mut self) {
        self.ended = true;
    }

    /// The stream is over, however it ended: what each bucket settles (buckets whose estimate
    /// stands are left out; empty: nothing to send).
    pub fn finish(mut self, cfg: &Config) -> Vec<Item> {
        let ending = if self.ended {
            Ending::Complete
        } else {
            Ending::Cut
        };
        let body = match (&mut self.reader, ending) {
            (Some(r), Ending::Complete) => r.finish(),
            (Some(r), Ending::Cut) => r.so_far(),
            (None, _) => None,
        };
        let mut items = Vec::new();
        for r in &self.reserved {
            let Some(rule) = cfg.rules.get(r.rule) else {
                continue;
            };
            let Some((l, c)) = rule
                .rate_limit()
                .and_then(|l| Some((l, l.charge.as_ref()?)))
            else {
                continue;
            };
            // A usage header came before the body: the count was final, however the body ended.
            let (seen, ending) = match r.header_usage {
                Some(u) => (Some(u), Ending::Complete),
                None => (
                    body.and_then(|u| u.tokens(c.weights_for(self.model.as_deref()))),
                    ending,
                ),
            };
            let used = charged(r.estimate(), l.cost.bound(), seen, ending, c.cut, c.max);
            if amount(r.estimate(), used) == Amount::Stands {
                continue;
            }
            items.push(Item {
                bucket: r.bucket.clone(),
                rule: rule.name.clone(),
                estimate: r.estimate(),
                used,
                window: r.window,
            });
        }
        items
    }
}

/// How a body with this `content-type` is read: JSON, an event stream, or not at all.
fn body_format(content_type: Option<&str>) -> Option<Format> {
    let ct = content_type?.split(';').next()?.trim().to_ascii_lowercase();
    if ct == "text/event-stream" {
        Some(Format::Sse)
    } else if ct == "application/json" || ct.ends_with("+json") {
        Some(Format::Json)
    } else {
        None
    }
}

/// What one bucket settles: the service charges or gives back `used - estimate`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub bucket: Bucket,
    pub rule: String,
    pub estimate: u64,
    pub used: u64,
    /// The window the estimate was charged in, when the service named it.
    pub window: Option<u64>,
}

/// What a queued settlement charges beyond its reservations: such a settlement is owed to the
/// bucket and never given up on a failure.
pub trait Owed {
    /// Tokens charged on top of the reservations (0: it only gives tokens back).
    fn extra(&self) -> u64;
}

impl Owed for Vec<Item> {
    fn extra(&self) -> u64 {
        self.iter()
            .map(|i| i.used.saturating_sub(i.estimate))
            .fold(0, u64::saturating_add)
    }
}

/// The buckets a settlement gives tokens back to (used less than its estimate).
pub fn given_back(items: &[Item]) -> impl Iterator<Item = &Bucket> {
    items
        .iter()
        .filter(|i| i.used < i.estimate)
        .map(|i| &i.bucket)
}

/// The JSON body of `POST /v1/settle` (the contract's encoder), with this VM's instance id.
pub fn encode(id: &str, instance: Option<&str>, items: &[Item]) -> Vec<u8> {
    let buckets = items.iter().map(|i| contract::settle::SettleBucket {
        key: &i.bucket.key,
        capacity: i.bucket.capacity,
        rate: i.bucket.rate,
        period_ms: i.bucket.period_ms,
        algorithm: i.bucket.algorithm,
        rule: &i.rule,
        estimate: i.estimate,
        used: i.used,
        window: i.window,
        calendar: i.bucket.calendar.as_ref(),
    });
    contract::settle::encode_settle(id, instance, buckets)
}

/// One settlement waiting for delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending<T> {
    /// `<instance>-<sequence>`: the service applies a settlement id once.
    pub id: String,
    /// What to send (the bucket and the amount, in the caller's terms).
    pub what: T,
    /// Attempts made so far.
    pub attempts: u32,
    /// Not before this time (ms).
    pub due_ms: u64,
    /// An attempt is in flight.
    pub in_flight: bool,
}

/// What happened to a settlement after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Applied (or already applied before): done.
    Delivered,
    /// Failed; it will be tried again at the given time.
    Retry { at_ms: u64 },
    /// A refund failed for the last time, or a settlement was dropped or refused: never applied
    /// by this proxy.
    GaveUp,
}

/// The settlements of one VM, sent from its root context: refunds with bounded retries, extra
/// charges until delivered.
#[derive(Debug)]
pub struct Queue<T> {
    instance: String,
    next_seq: u64,
    items: Vec<Pending<T>>,
    /// Settlements given up (a refund's attempts exhausted, or dropped when the queue was full).
    pub given_up: u64,
    /// Extra tokens never charged: those of settlements dropped from a full queue or refused.
    pub forgiven: u64,
}

impl<T: Owed> Queue<T> {
    /// An empty queue for the VM `instance`.
    pub fn new(instance: &str) -> Queue<T> {
        Queue {
            instance: instance.to_string(),
            next_seq: 0,
            items: Vec::new(),
            given_up: 0,
            forgiven: 0,
        }
    }

    /// Queues `what`, due at once; returns its id. A full queue drops its oldest refund first,
    /// and its oldest item when it holds only extra charges.
    pub fn push(&mut self, what: T, now_ms: u64) -> String {
        self.make_room();
        let id = format!("{}-{}", self.instance, self.next_seq);
        self.next_seq += 1;
        self.items.push(Pending {
            id: id.clone(),
            what,
            attempts: 0,
            due_ms: now_ms,
            in_flight: false,
        });
        id
    }

    /// The settlements to send now (due and not in flight), marked in flight.
    pub fn due(&mut self, now_ms: u64) -> Vec<&Pending<T>> {
        let mut picked = Vec::new();
        for (i, p) in self.items.iter_mut().enumerate() {
            if !p.in_flight && p.due_ms <= now_ms {
                p.in_flight = true;
                p.attempts += 1;
                picked.push(i);
            }
        }
        picked
            .into_iter()
            .filter_map(|i| self.items.get(i))
            .collect()
    }

    /// The answer to an attempt for `id`: delivered, or failed (retried with a doubling backoff
    /// until [`MAX_ATTEMPTS`]). An unknown id (already settled, or dropped) is `GaveUp`.
    pub fn answered(&mut self, id: &str, ok: bool, now_ms: u64) -> Delivery {
        let Some(i) = self.items.iter().position(|p| p.id == id) else {
            return Delivery::GaveUp;
        };
        if ok {
            self.items.remove(i);
            return Delivery::Delivered;
        }
        let (attempts, owed) = self
            .items
            .get(i)
            .map_or((MAX_ATTEMPTS, false), |p| (p.attempts, p.what.extra() > 0));
        if attempts >= MAX_ATTEMPTS && !owed {
            self.drop_at(i);
            return Delivery::GaveUp;
        }
        let backoff = (FIRST_BACKOFF_MS << attempts.saturating_sub(1).min(16)).min(MAX_BACKOFF_MS);
        let at_ms = now_ms.saturating_add(backoff);
        if let Some(p) = self.items.get_mut(i) {
            p.in_flight = false;
            p.due_ms = at_ms;
        }
        Delivery::Retry { at_ms }
    }

    /// What settlement `id` sends, while it is queued.
    pub fn get(&self, id: &str) -> Option<&T> {
        self.items.iter().find(|p| p.id == id).map(|p| &p.what)
    }

    /// The service refused `id` for good (an invalid settlement: sending it again cannot help):
    /// dropped and counted.
    pub fn refused(&mut self, id: &str) -> Delivery {
        if let Some(i) = self.items.iter().position(|p| p.id == id) {
            self.drop_at(i);
        }
        Delivery::GaveUp
    }

    /// Drops item `i`, counting it and the extra tokens it would have charged.
    /// Makes room for one more in a full queue: drops its oldest refund, or its oldest item when
    /// it holds only extra charges; whether one was dropped.
    fn make_room(&mut self) -> bool {
        if self.items.len() < MAX_PENDING {
            return false;
        }
        let i = self
            .items
            .iter()
            .position(|p| p.what.extra() == 0)
            .unwrap_or(0);
        self.drop_at(i);
        true
    }

    fn drop_at(&mut self, i: usize) {
        if i < self.items.len() {
            let p = self.items.remove(i);
            self.given_up += 1;
            self.forgiven = self.forgiven.saturating_add(p.what.extra());
        }
    }

    /// Settlements waiting (in flight or not).
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Every settlement waiting, for another queue to deliver ([`Queue::adopt`]): this queue's
    /// configuration went away, and with it any attempt in flight (Envoy cancels a removed root's
    /// callouts without a word), so none counts as in flight any more.
    pub fn hand_over(&mut self) -> Vec<Pending<T>> {
        let mut all = std::mem::take(&mut self.items);
        for p in &mut all {
            p.in_flight = false;
        }
        all
    }

    /// Takes over settlements another queue handed over, under their own ids (the service applies
    /// an id once, so one sent before the hand-over and again after is applied once), due at once.
    /// A full queue drops as [`Queue::push`] does (a refund first); how many were dropped.
    pub fn adopt(&mut self, pending: Vec<Pending<T>>, now_ms: u64) -> u64 {
        let mut dropped = 0;
        for mut p in pending {
            if self.make_room() {
                dropped += 1;
            }
            p.due_ms = p.due_ms.min(now_ms);
            self.items.push(p);
        }
        dropped
    }

    /// When the next retry is due, if any is waiting and none is in flight for it.
    pub fn next_due_ms(&self) -> Option<u64> {
        self.items
            .iter()
            .filter(|p| !p.in_flight)
            .map(|p| p.due_ms)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A settlement in tests: the extra tokens it charges.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct S(u64);

    impl Owed for S {
        fn extra(&self) -> u64 {
            self.0
        }
    }

    #[test]
    fn the_difference_is_settled_and_no_report_leaves_the_reservation() {
        let done = |seen| charged(100, 400, seen, Ending::Complete, Cut::Bound, 1000);
        assert_eq!(amount(100, done(Some(40))), Amount::Refund(60));
        assert_eq!(amount(100, done(Some(250))), Amount::Extra(150));
        assert_eq!(amount(100, done(Some(100))), Amount::Stands);
        assert_eq!(amount(100, done(None)), Amount::Stands);
        assert_eq!(
            done(Some(5000)),
            1000,
            "capped at what one response may use"
        );
    }

    #[test]
    fn a_cut_off_response_pays_as_if_it_had_run_to_the_end() {
        let cut = |seen, how| charged(100, 400, seen, Ending::Cut, how, 1000);
        // The bound (the most the request could reserve), or the usage seen if larger.
        assert_eq!(cut(None, Cut::Bound), 400);
        assert_eq!(cut(Some(30), Cut::Bound), 400);
        assert_eq!(cut(Some(700), Cut::Bound), 700);
        assert_eq!(cut(Some(5000), Cut::Bound), 1000);
        // Or the reservation, or the usage seen if larger: never a refund.
        assert_eq!(cut(None, Cut::Reserved), 100);
        assert_eq!(cut(Some(30), Cut::Reserved), 100);
        assert_eq!(cut(Some(700), Cut::Reserved), 700);
    }

    #[test]
    fn a_handed_over_settlement_keeps_its_id_and_is_due_at_once() {
        let mut old = Queue::new("vm1");
        let a = old.push(S(0), 0);
        let b = old.push(S(5), 0);
        assert_eq!(
            old.due(0).len(),
            2,
            "both in flight when the configuration goes"
        );
        let mut heir: Queue<S> = Queue::new("vm2");
        let c = heir.push(S(0), 5);
        assert_eq!(heir.adopt(old.hand_over(), 10), 0);
        assert!(old.is_empty());
        let due: Vec<String> = heir.due(10).iter().map(|p| p.id.clone()).collect();
        assert_eq!(
            due,
            vec![c, a.clone(), b],
            "the cancelled attempts are sent again"
        );
        assert_eq!(heir.answered(&a, true, 11), Delivery::Delivered);
        assert_eq!(heir.len(), 2);
    }

    #[test]
    fn a_settlement_is_sent_until_delivered_then_never_again() {
        let mut q = Queue::new("vm7");
        let id = q.push(S(0), 0);
        assert_eq!(id, "vm7-0");
        assert_eq!(q.due(0).len(), 1);
        // In flight: not handed out twice.
        assert!(q.due(0).is_empty());
        assert_eq!(q.answered(&id, false, 10), Delivery::Retry { at_ms: 110 });
        assert!(q.due(50).is_empty());
        assert_eq!(q.next_due_ms(), Some(110));
        assert_eq!(q.due(110).len(), 1);
        assert_eq!(q.answered(&id, true, 120), Delivery::Delivered);
        assert!(q.is_empty());
        // A late duplicate answer changes nothing.
        assert_eq!(q.answered(&id, true, 130), Delivery::GaveUp);
        assert_eq!(q.given_up, 0);
    }

    /// Fails every attempt of the one settlement queued, `n` times at most: the waits between them.
    fn fail(q: &mut Queue<S>, id: &str, n: u32) -> Vec<u64> {
        let mut now = 0;
        let mut waits = Vec::new();
        for _ in 0..n {
            assert_eq!(q.due(now).len(), 1);
            match q.answered(id, false, now) {
                Delivery::Retry { at_ms } => {
                    waits.push(at_ms - now);
                    now = at_ms;
                }
                Delivery::GaveUp => break,
                Delivery::Delivered => unreachable!(),
            }
        }
        waits
    }

    #[test]
    fn a_refunds_retries_back_off_and_end() {
        let mut q = Queue::new("vm");
        let id = q.push(S(0), 0);
        let waits = fail(&mut q, &id, MAX_ATTEMPTS);
        assert_eq!(waits, vec![100, 200, 400, 800, 1600, 2000, 2000]);
        assert!(q.is_empty());
        assert_eq!((q.given_up, q.forgiven), (1, 0));
    }

    #[test]
    fn an_extra_charge_is_tried_until_the_service_takes_it() {
        let mut q = Queue::new("vm");
        let id = q.push(S(2500), 0);
        // An hour of failures: still owed, tried every 2 s.
        let waits = fail(&mut q, &id, 1800);
        assert_eq!(waits.len(), 1800);
        assert!(waits.iter().skip(5).all(|&w| w == MAX_BACKOFF_MS));
        assert_eq!(q.len(), 1);
        assert_eq!(q.answered(&id, true, u64::MAX), Delivery::Delivered);
        assert_eq!((q.given_up, q.forgiven), (0, 0));
    }

    #[test]
    fn a_full_queue_drops_refunds_before_extra_charges() {
        let mut q = Queue::new("vm");
        q.push(S(7), 0);
        for _ in 1..MAX_PENDING {
            q.push(S(0), 0);
        }
        q.push(S(9), 0);
        assert_eq!(q.len(), MAX_PENDING);
        assert_eq!((q.given_up, q.forgiven), (1, 0));
        assert_eq!(q.due(0).first().map(|p| p.what), Some(S(7)));
        // Nothing but extra charges: the oldest goes, counted with its tokens.
        let mut q = Queue::new("vm");
        for i in 0..=MAX_PENDING {
            q.push(S(i as u64 + 1), 0);
        }
        assert_eq!((q.given_up, q.forgiven), (1, 1));
    }

    mod props {
        use super::super::*;
        use proptest::prelude::*;

        fn cut() -> impl Strategy<Value = Cut> {
            prop_oneof![Just(Cut::Bound), Just(Cut::Reserved)]
        }

        proptest! {
            /// Never forgives: a response is charged at least what it reported (up to what its
            /// rule lets one response use), and a cut-off one at least its reservation; what is
            /// settled is exactly the difference from the reservation.
            #[test]
            fn a_settlement_never_forgives(reserved in 1u64..5000, extra in 0u64..5000,
                                           seen in proptest::option::of(0u64..20_000),
                                           max in 1u64..20_000, complete in any::<bool>(),
                                           how in cut()) {
                let bound = reserved + extra;
                let ending = if complete { Ending::Complete } else { Ending::Cut };
                let used = charged(reserved, bound, seen, ending, how, max);
                prop_assert!(used <= max);
                if let Some(s) = seen {
                    prop_assert!(used >= s.min(max));
                }
                if !complete {
                    prop_assert!(used >= reserved.min(max));
                    if how == Cut::Bound {
                        prop_assert!(used >= bound.min(max));
                    }
                }
                let settled = match amount(reserved, used) {
                    Amount::Stands => i128::from(reserved),
                    Amount::Refund(r) => i128::from(reserved) - i128::from(r),
                    Amount::Extra(e) => i128::from(reserved) + i128::from(e),
                };
                prop_assert_eq!(settled, i128::from(used));
            }

            /// Never charges twice, never loses an extra charge: whatever the answers, each
            /// settlement is delivered at most once, and every extra charge is delivered or still
            /// waiting (the queue holds less than its bound here).
            #[test]
            fn a_queue_delivers_each_settlement_at_most_once(
                    ops in proptest::collection::vec((0u64..3, any::<bool>(), any::<bool>()), 1..200)) {
                let mut q = Queue::new("vm");
                let mut pushed: Vec<(String, u64)> = Vec::new();
                let mut delivered: Vec<String> = Vec::new();
                let mut now = 0;
                for (extra, ok, tick) in ops {
                    pushed.push((q.push(super::S(extra), now), extra));
                    let due: Vec<String> = q.due(now).into_iter().map(|p| p.id.clone()).collect();
                    for id in due {
                        if q.answered(&id, ok, now) == Delivery::Delivered {
                            prop_assert!(!delivered.contains(&id), "{} delivered twice", id);
                            delivered.push(id);
                        }
                    }
                    if tick {
                        now += 1000;
                    }
                }
                for (id, extra) in &pushed {
                    if *extra > 0 {
                        let waiting = q.items.iter().any(|p| &p.id == id);
                        prop_assert!(waiting || delivered.contains(id), "{} lost", id);
                    }
                }
                prop_assert_eq!(q.forgiven, 0);
            }
        }
    }
}
