//! The fleet under a fault: N Envoys behind an L4 round-robin front (client connections dealt to the
//! Envoys in turn), a load of persistent client connections that records every request's start,
//! latency and status, and a sampler of each Envoy's decision counters over time.

use crate::common::{
    tollgate_stats_at, Client, Components, Envoy, EnvoySpec, Plugin, TempDir, Transport, Upstream,
};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

// ---------------------------------------------------------------------------------------------
// The load

/// One request as a client saw it. `status` 0: no HTTP response (connection error, timeout).
#[derive(Clone, Copy, Debug)]
pub struct Rec {
    /// The client that sent it (client `k` is connected to Envoy `k % n`).
    pub client: usize,
    pub start: Instant,
    pub latency: Duration,
    pub status: u16,
}

/// Client connections, each kept open to one Envoy (connection `k` goes to Envoy `k % n`, as an L4
/// balancer deals them), each sending a GET, reading the answer, pausing, and again. While
/// [`Load::set_abandon`] is on, the odd-numbered clients instead open a connection (to the Envoys in
/// turn), send a request and close the connection `abandon_after` later without reading the answer,
/// then pause as the others do.
pub struct Load {
    stop: Arc<AtomicBool>,
    abandon: Arc<AtomicBool>,
    abandoned: Arc<AtomicU64>,
    pub started: Instant,
    clients: Vec<JoinHandle<Vec<Rec>>>,
}

/// What the clients saw.
pub struct Seen {
    pub recs: Vec<Rec>,
    /// Requests sent by abandoning clients (not in `recs`).
    pub abandoned: u64,
    pub started: Instant,
    /// From before the first request to after the last answer.
    pub elapsed: Duration,
}

impl Load {
    /// Starts `clients` connections over `ports`, pausing about `pause` after each answer (drawn
    /// around it, [`Rng::around`]), for at most
    /// `limit`. `abandon_after`: the range (ms) of how long an abandoning client waits before it closes.
    pub fn start(
        ports: &[u16],
        clients: usize,
        pause: Duration,
        limit: Duration,
        abandon_after: (u64, u64),
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let abandon = Arc::new(AtomicBool::new(false));
        let abandoned = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let deadline = started + limit;
        let ports: Arc<Vec<u16>> = Arc::new(ports.to_vec());
        let clients = (0..clients)
            .map(|k| {
                let port = ports[k % ports.len()];
                let ports = ports.clone();
                let (stop, abandon, abandoned) = (stop.clone(), abandon.clone(), abandoned.clone());
                thread::spawn(move || {
                    let client = Client::new();
                    let mut recs = Vec::new();
                    let mut rng =
                        Rng(0x9e37_79b9_7f4a_7c15
                            ^ (k as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
                    let mut j = 0u64;
                    while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
                        j += 1;
                        let path = format!("/faults/{k}/{j}");
                        if k % 2 == 1 && abandon.load(Ordering::SeqCst) {
                            let wait =
                                abandon_after.0 + rng.below(abandon_after.1 - abandon_after.0 + 1);
                            // Each abandoned request on a new connection, dealt round-robin.
                            let to = ports[(k + j as usize) % ports.len()];
                            if abandon_one(to, &path, Duration::from_millis(wait)) {
                                abandoned.fetch_add(1, Ordering::SeqCst);
                            }
                            thread::sleep(rng.around(pause));
                            continue;
                        }
                        let start = Instant::now();
                        let status =
                            match client.try_get(&format!("http://127.0.0.1:{port}{path}"), &[]) {
                                Ok(r) => r.status,
                                Err(_) => 0,
                            };
                        recs.push(Rec {
                            client: k,
                            start,
                            latency: start.elapsed(),
                            status,
                        });
                        thread::sleep(rng.around(pause));
                    }
                    recs
                })
            })
            .collect();
        Load {
            stop,
            abandon,
            abandoned,
            started,
            clients,
        }
    }

    /// Turns the abandoning clients on or off.
    pub fn set_abandon(&self, on: bool) {
        self.abandon.store(on, Ordering::SeqCst);
    }

    /// Stops the clients and returns what they saw.
    pub fn finish(mut self) -> Seen {
        self.stop.store(true, Ordering::SeqCst);
        let mut recs = Vec::new();
        for h in std::mem::take(&mut self.clients) {
            recs.extend(h.join().expect("client thread"));
        }
        Seen {
            recs,
            abandoned: self.abandoned.load(Ordering::SeqCst),
            started: self.started,
            elapsed: self.started.elapsed(),
        }
    }
}

/// A test that fails half-way stops its clients too.
impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Opens a connection, sends one GET and closes the connection after `wait` without reading: the
/// request is abandoned while Envoy is still deciding it. True when the request was sent.
/// (A raw socket: ureq cannot hang up on a request it sent.)
fn abandon_one(port: u16, path: &str, wait: Duration) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let sent = s
        .write_all(format!("GET {path} HTTP/1.1\r\nhost: faults\r\n\r\n").as_bytes())
        .is_ok();
    thread::sleep(wait);
    drop(s);
    sent
}

/// xorshift64: enough randomness for spreading waits, no dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }

    /// A pause drawn evenly from `pause / 2 ..= 3 × pause / 2` (the same mean): clients that
    /// all paused exactly `pause` stayed in step, so requests came in waves `pause` apart, and
    /// a fault that fell just after a wave met no request for up to `pause` (the time to the
    /// fallback then measured the load, not the limiter).
    fn around(&mut self, pause: Duration) -> Duration {
        let us = u64::try_from(pause.as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(us / 2 + self.below(us + 1))
    }
}

impl Seen {
    /// Status -> count.
    pub fn statuses(&self) -> BTreeMap<u16, u64> {
        let mut m = BTreeMap::new();
        for r in &self.recs {
            *m.entry(r.status).or_default() += 1;
        }
        m
    }

    /// Requests answered with anything but 200 or 429 (5xx, other codes, no answer).
    pub fn bad(&self) -> u64 {
        self.recs
            .iter()
            .filter(|r| r.status != 200 && r.status != 429)
            .count() as u64
    }

    /// Answers with `status` to requests started in `[from, to)`.
    pub fn count_between(&self, status: u16, from: Instant, to: Instant) -> u64 {
        self.recs
            .iter()
            .filter(|r| r.status == status && r.start >= from && r.start < to)
            .count() as u64
    }

    /// Answers with `status` to requests started in consecutive windows of `step`, from `from` on.
    pub fn per_window(&self, status: u16, from: Instant, step: Duration) -> Vec<u64> {
        let mut v: Vec<u64> = Vec::new();
        for r in self
            .recs
            .iter()
            .filter(|r| r.status == status && r.start >= from)
        {
            let i = (r.start.duration_since(from).as_micros() / step.as_micros().max(1)) as usize;
            if v.len() <= i {
                v.resize(i + 1, 0);
            }
            v[i] += 1;
        }
        v
    }

    /// The `q`-quantile (0..=1) of the latencies of requests started in `[from, to)`.
    pub fn latency_quantile(&self, from: Instant, to: Instant, q: f64) -> Option<Duration> {
        let mut l: Vec<Duration> = self
            .recs
            .iter()
            .filter(|r| r.start >= from && r.start < to)
            .map(|r| r.latency)
            .collect();
        if l.is_empty() {
            return None;
        }
        l.sort();
        let i = ((l.len() as f64 * q).ceil() as usize).clamp(1, l.len()) - 1;
        l.get(i).copied()
    }
}

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
