//! The load: client threads sending GETs to the Envoys, each request recorded as its client saw
//! it (start, latency, status, the rate limit headers), dealt to the Envoys as one of two
//! balancers in front of a fleet would:
//! - [`Load::start`], an L4 balancer: client `k` keeps one connection to Envoy `k % n`, pausing
//!   about `pause` (drawn around it) after each answer; while [`Load::set_abandon`] is on, the
//!   odd-numbered clients abandon their requests instead (the fault matrix's load);
//! - [`Load::round_robin`], a balancer per request: client `c` sends its `j`-th request to Envoy
//!   `(c + j) % n`, pausing exactly `pause`, until `max_total` requests were sent in all; what came
//!   back counted in a [`Tally`] (statuses, `Retry-After`, `X-RateLimit-Reset`).

use crate::common::{Client, Envoy};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// One request as a client saw it. `status` 0: no HTTP response (connection error, timeout).
#[derive(Clone, Copy, Debug)]
pub struct Rec {
    /// The client that sent it (with [`Load::start`], client `k` is connected to Envoy `k % n`).
    pub client: usize,
    pub start: Instant,
    pub latency: Duration,
    pub status: u16,
    /// `Retry-After` of a 429, in seconds.
    pub retry_after: Option<u64>,
    /// `X-RateLimit-Reset`, in seconds, when the response had one.
    pub reset: Option<u64>,
    /// `x-ratelimit-delay-ms`: how long the filter held the request (shaping), when it was held.
    pub held_ms: Option<u64>,
}

/// Client threads sending until stopped, at their deadline, or at a number of requests in all.
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

/// What the clients saw, counted.
#[derive(Debug, Default)]
pub struct Tally {
    /// Status -> count; 0 stands for a transport error (no HTTP response).
    pub statuses: BTreeMap<u16, u64>,
    /// `Retry-After` of every 429, in seconds.
    pub retry_after: Vec<u64>,
    /// `X-RateLimit-Reset` of every response that had one, in seconds.
    pub reset: Vec<u64>,
    pub elapsed: Duration,
}

impl Tally {
    pub fn count(&self, status: u16) -> u64 {
        self.statuses.get(&status).copied().unwrap_or(0)
    }
    pub fn sent(&self) -> u64 {
        self.statuses.values().sum()
    }
    /// Anything but 200 and 429 (5xx, transport errors).
    pub fn other(&self) -> u64 {
        self.sent() - self.count(200) - self.count(429)
    }
}

/// How a load's clients send.
struct Plan {
    ports: Vec<u16>,
    /// Requests go to `<path>/<client>/<j>`.
    path: String,
    /// Each client keeps to one Envoy (else round-robin per request).
    pinned: bool,
    /// The pause after each answer; drawn around it ([`Rng::around`]) when `jitter`.
    pause: Duration,
    jitter: bool,
    deadline: Instant,
    max_total: u64,
    /// The range (ms) of how long an abandoning client waits before it closes.
    abandon_after: (u64, u64),
}

impl Plan {
    /// The pause after an answer (or an abandoned request).
    fn rest(&self, rng: &mut Rng) {
        if self.jitter {
            thread::sleep(rng.around(self.pause));
        } else if !self.pause.is_zero() {
            thread::sleep(self.pause);
        }
    }
}

impl Load {
    /// Starts `clients` connections over `ports` (connection `k` to `ports[k % n]`), pausing about
    /// `pause` after each answer (drawn around it, [`Rng::around`]), for at most `limit`.
    /// `abandon_after`: the range (ms) of how long an abandoning client waits before it closes.
    pub fn start(
        ports: &[u16],
        clients: usize,
        pause: Duration,
        limit: Duration,
        abandon_after: (u64, u64),
    ) -> Load {
        let plan = Plan {
            ports: ports.to_vec(),
            path: "/faults".to_string(),
            pinned: true,
            pause,
            jitter: true,
            deadline: Instant::now() + limit,
            max_total: u64::MAX,
            abandon_after,
        };
        Load::spawn(plan, clients)
    }

    /// Starts `clients` threads; client `c` sends its `j`-th request to Envoy `(c + j) % n`, pausing
    /// `pause` between requests, until stopped, `max_total` requests were sent in all, or `limit`
    /// has passed. The requests' paths are `/fleet/<c>/<j>`.
    pub fn round_robin(
        envoys: &[Envoy],
        clients: usize,
        limit: Duration,
        max_total: u64,
        pause: Duration,
    ) -> Load {
        Load::round_robin_on(envoys, "/fleet", clients, limit, max_total, pause)
    }

    /// [`Load::round_robin`] with the paths `<path>/<c>/<j>`.
    pub fn round_robin_on(
        envoys: &[Envoy],
        path: &str,
        clients: usize,
        limit: Duration,
        max_total: u64,
        pause: Duration,
    ) -> Load {
        let plan = Plan {
            ports: envoys.iter().map(|e| e.port).collect(),
            path: path.to_string(),
            pinned: false,
            pause,
            jitter: false,
            deadline: Instant::now() + limit,
            max_total,
            abandon_after: (0, 0),
        };
        Load::spawn(plan, clients)
    }

    /// Runs a round-robin load to its end (count or time) and returns the tally.
    pub fn run(
        envoys: &[Envoy],
        clients: usize,
        limit: Duration,
        max_total: u64,
        pause: Duration,
    ) -> Tally {
        Load::round_robin(envoys, clients, limit, max_total, pause)
            .wait()
            .tally()
    }

    fn spawn(plan: Plan, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let abandon = Arc::new(AtomicBool::new(false));
        let abandoned = Arc::new(AtomicU64::new(0));
        let sent = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let plan = Arc::new(plan);
        let clients = (0..clients)
            .map(|k| {
                let (plan, stop, sent) = (plan.clone(), stop.clone(), sent.clone());
                let (abandon, abandoned) = (abandon.clone(), abandoned.clone());
                thread::spawn(move || {
                    let client = Client::new();
                    let ports = &plan.ports;
                    let mut recs = Vec::new();
                    let mut rng =
                        Rng(0x9e37_79b9_7f4a_7c15
                            ^ (k as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
                    let mut j = 0u64;
                    while !stop.load(Ordering::SeqCst)
                        && Instant::now() < plan.deadline
                        && sent.fetch_add(1, Ordering::SeqCst) < plan.max_total
                    {
                        j += 1;
                        let path = format!("{}/{k}/{j}", plan.path);
                        if k % 2 == 1 && abandon.load(Ordering::SeqCst) {
                            let (least, most) = plan.abandon_after;
                            let wait = least + rng.below(most - least + 1);
                            // Each abandoned request on a new connection, dealt round-robin.
                            let to = ports[(k + j as usize) % ports.len()];
                            if abandon_one(to, &path, Duration::from_millis(wait)) {
                                abandoned.fetch_add(1, Ordering::SeqCst);
                            }
                            plan.rest(&mut rng);
                            continue;
                        }
                        let port = match plan.pinned {
                            true => ports[k % ports.len()],
                            false => ports[(k + j as usize - 1) % ports.len()],
                        };
                        let start = Instant::now();
                        let rec =
                            match client.try_get(&format!("http://127.0.0.1:{port}{path}"), &[]) {
                                Ok(reply) => {
                                    let num = |name: &str| {
                                        reply
                                            .header(name)
                                            .and_then(|v| v.trim().parse::<u64>().ok())
                                    };
                                    Rec {
                                        client: k,
                                        start,
                                        latency: start.elapsed(),
                                        status: reply.status,
                                        retry_after: (reply.status == 429)
                                            .then(|| num("retry-after"))
                                            .flatten(),
                                        reset: num("x-ratelimit-reset"),
                                        held_ms: num("x-ratelimit-delay-ms"),
                                    }
                                }
                                Err(_) => Rec {
                                    client: k,
                                    start,
                                    latency: start.elapsed(),
                                    status: 0,
                                    retry_after: None,
                                    reset: None,
                                    held_ms: None,
                                },
                            };
                        recs.push(rec);
                        plan.rest(&mut rng);
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
    pub fn finish(self) -> Seen {
        self.stop.store(true, Ordering::SeqCst);
        self.wait()
    }

    /// Waits for the clients to end (count or time) and returns what they saw.
    pub fn wait(mut self) -> Seen {
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
    /// The statuses and rate limit headers counted.
    pub fn tally(&self) -> Tally {
        let mut t = Tally {
            elapsed: self.elapsed,
            ..Tally::default()
        };
        for r in &self.recs {
            *t.statuses.entry(r.status).or_default() += 1;
            t.retry_after.extend(r.retry_after);
            t.reset.extend(r.reset);
        }
        t
    }

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
