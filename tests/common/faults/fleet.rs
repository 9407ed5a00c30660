//! The fleet under a fault: N Envoys behind an L4 round-robin front (client connections dealt to the
//! Envoys in turn), loaded by persistent client connections that record every request's start,
//! latency and status (the harness's [`Load::start`]), and a sampler of each Envoy's decision
//! counters over time.

use crate::common::{
    tollgate_stats_at, Components, Envoy, EnvoySpec, Plugin, TempDir, Transport, Upstream,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// `n` Envoys (`--concurrency 2` each) with one plugin configuration, their `tollgate` cluster on
/// `service_port`, and the upstream that counts what they admit.
pub struct Fleet {
    pub envoys: Vec<Envoy>,
    pub upstream: Upstream,
}

/// A fleet's usual plugin configuration before its rules: over `transport`, a callout timing out
/// after `timeout_ms`, the fallback (one share of `instances`, 100 keys), a breaker opening after 3
/// failures for 250 ms.
pub fn with_fallback(transport: Transport, timeout_ms: u64, instances: usize) -> Plugin {
    transport
        .plugin(timeout_ms)
        .failure_mode("fallback")
        .fallback(instances as u64, 100)
        .field("breaker", r#"{"failures": 3, "open_ms": 250}"#)
}

impl Fleet {
    pub fn start(
        c: &Components,
        dir: &TempDir,
        n: usize,
        plugin_json: &str,
        service_port: u16,
    ) -> Fleet {
        let upstream = Upstream::start();
        let specs: Vec<EnvoySpec> = (0..n)
            .map(|_| {
                EnvoySpec::new(Some(plugin_json.to_string()), service_port, upstream.port)
                    .under_load()
            })
            .collect();
        let envoys = Envoy::start_all(c, dir, &specs);
        Fleet { envoys, upstream }
    }

    pub fn ports(&self) -> Vec<u16> {
        self.envoys.iter().map(|e| e.port).collect()
    }

    pub fn admin_ports(&self) -> Vec<u16> {
        self.envoys.iter().map(|e| e.admin_port).collect()
    }

    /// The sum over the fleet of one Envoy stat (e.g. `http.edge.downstream_rq_5xx`).
    pub fn stat(&self, name: &str) -> u64 {
        self.envoys
            .iter()
            .filter_map(|e| {
                let filter = format!("^{}$", name.replace('.', "\\."));
                e.stats(&filter).get(name).copied()
            })
            .sum()
    }
}

/// The load is the harness's ([`crate::common::load`]): connections pinned to the Envoys here.
// Each test binary uses a part of the harness: the re-exports it leaves unused are not a fault.
#[allow(unused_imports)]
pub use crate::common::load::{Load, Rec, Seen};

// ---------------------------------------------------------------------------------------------
// The decision counters over time

/// One Envoy's decision counters, read between `sent` and `at`.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub sent: Instant,
    pub at: Instant,
    /// Decisions the service made: `allowed + limited`.
    pub decided: u64,
    /// Decisions the fallback made: `fallback.allowed + fallback.limited`.
    pub fallback: u64,
    /// Failed callouts: the sum of `callout_failure.*`.
    pub failed: u64,
}

/// A thread per Envoy reading its admin `/stats` (about 0.4 ms of Envoy CPU each) every `every`, or
/// faster while hurried, for at most a minute.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    /// Until when, and how often, to sample instead of `every`.
    hurry: Arc<Mutex<(Instant, Duration)>>,
    threads: Vec<JoinHandle<Vec<Sample>>>,
}

impl Sampler {
    pub fn start(admin_ports: &[u16], every: Duration) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let hurry = Arc::new(Mutex::new((Instant::now(), every)));
        let threads = admin_ports
            .iter()
            .map(|port| {
                let (port, stop, hurry) = (*port, stop.clone(), hurry.clone());
                thread::spawn(move || {
                    let mut out = Vec::new();
                    let end = Instant::now() + Duration::from_secs(60);
                    while !stop.load(Ordering::SeqCst) && Instant::now() < end {
                        let sent = Instant::now();
                        if let Some(s) = tollgate_stats_at(port) {
                            let get = |k: &str| s.get(k).copied().unwrap_or(0);
                            out.push(Sample {
                                sent,
                                at: Instant::now(),
                                decided: get("allowed") + get("limited"),
                                fallback: get("fallback.allowed") + get("fallback.limited"),
                                failed: s
                                    .iter()
                                    .filter(|(k, _)| k.starts_with("callout_failure."))
                                    .map(|(_, v)| v)
                                    .sum(),
                            });
                        }
                        let (until, fast) = hurry.lock().map(|h| *h).unwrap_or((sent, every));
                        thread::sleep(if Instant::now() < until { fast } else { every });
                    }
                    out
                })
            })
            .collect();
        Sampler {
            stop,
            hurry,
            threads,
        }
    }

    /// Samples every `fast` for the next `span` (e.g. right after a fault, to time the fallback).
    pub fn hurry(&self, span: Duration, fast: Duration) {
        if let Ok(mut h) = self.hurry.lock() {
            *h = (Instant::now() + span, fast);
        }
    }

    /// Stops sampling; the samples of each Envoy, in time order.
    pub fn finish(mut self) -> Vec<Vec<Sample>> {
        self.stop.store(true, Ordering::SeqCst);
        std::mem::take(&mut self.threads)
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// For each Envoy, the bracket `[low, high]` (durations since `t`) in which its counter (`pick`) first
/// grew after `t`, judged from reads sent at or after `t`: `high` is when the answer of the first read
/// showing a higher value arrived, `low` when the read before it was sent. `None` for an Envoy whose
/// counter did not grow.
pub fn growth_brackets(
    samples: &[Vec<Sample>],
    t: Instant,
    pick: impl Fn(&Sample) -> u64,
) -> Vec<Option<(Duration, Duration)>> {
    samples
        .iter()
        .map(|env| {
            let from = env.iter().position(|s| s.sent >= t)?;
            let tail = env.get(from..)?;
            let base = pick(tail.first()?);
            let i = tail.iter().position(|s| pick(s) > base)?;
            let prev = tail.get(i.checked_sub(1)?)?;
            Some((prev.sent - t, tail.get(i)?.at - t))
        })
        .collect()
}

/// The fleet's total of a counter (`pick`) as last read before `t` (per Envoy, summed).
pub fn total_before(samples: &[Vec<Sample>], t: Instant, pick: impl Fn(&Sample) -> u64) -> u64 {
    samples
        .iter()
        .filter_map(|env| env.iter().rev().find(|s| s.at <= t).map(&pick))
        .sum()
}

/// The longest stretch, within `[from, to]`, during which no Envoy's counter (`pick`) grew, judged from
/// the samples of all Envoys merged by time.
pub fn longest_stall(
    samples: &[Vec<Sample>],
    from: Instant,
    to: Instant,
    pick: impl Fn(&Sample) -> u64,
) -> Duration {
    let mut growths: Vec<Instant> = vec![from];
    for env in samples {
        for w in env.windows(2) {
            if pick(&w[1]) > pick(&w[0]) && w[1].at >= from && w[1].at <= to {
                growths.push(w[1].at);
            }
        }
    }
    growths.push(to);
    growths.sort();
    growths
        .windows(2)
        .map(|w| w[1].saturating_duration_since(w[0]))
        .max()
        .unwrap_or_default()
}

/// Shared log of moments a test marks (fault applied, fault over) with the upstream's count then.
#[derive(Default)]
pub struct Marks {
    inner: Mutex<Vec<(&'static str, Instant, u64)>>,
}

impl Marks {
    pub fn mark(&self, what: &'static str, admitted: u64) -> Instant {
        let now = Instant::now();
        if let Ok(mut v) = self.inner.lock() {
            v.push((what, now, admitted));
        }
        now
    }

    pub fn get(&self, what: &str) -> Option<(Instant, u64)> {
        self.inner
            .lock()
            .ok()?
            .iter()
            .find(|(w, _, _)| *w == what)
            .map(|(_, t, n)| (*t, *n))
    }
}
