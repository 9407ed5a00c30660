//! A load of concurrent clients, each sending round-robin over the Envoys (as a load balancer in
//! front of a fleet would), counting what came back: the statuses and the rate limit headers.
//! (`faults::fleet::Load` is the fault matrix's: connections pinned to an Envoy, every request
//! recorded with its latency, abandoning clients.)

use crate::common::{Client, Envoy};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// What the clients saw.
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

pub struct Load {
    stop: Arc<AtomicBool>,
    started: Instant,
    clients: Vec<JoinHandle<Tally>>,
}

impl Load {
    /// Starts `clients` threads; client `c` sends its `j`-th request to Envoy `(c + j) % n`, pausing
    /// `pause` between requests, until stopped, `max_total` requests were sent in all, or `limit`
    /// has passed. The requests' paths are `/fleet/<c>/<j>`.
    pub fn start(
        envoys: &[Envoy],
        clients: usize,
        limit: Duration,
        max_total: u64,
        pause: Duration,
    ) -> Load {
        Load::start_on(envoys, "/fleet", clients, limit, max_total, pause)
    }

    /// [`Load::start`] with the paths `<path>/<c>/<j>`.
    pub fn start_on(
        envoys: &[Envoy],
        path: &str,
        clients: usize,
        limit: Duration,
        max_total: u64,
        pause: Duration,
    ) -> Load {
        let path: Arc<str> = Arc::from(path);
        let ports: Arc<Vec<u16>> = Arc::new(envoys.iter().map(|e| e.port).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let deadline = started + limit;
        let clients = (0..clients)
            .map(|c| {
                let (ports, stop, sent) = (ports.clone(), stop.clone(), sent.clone());
                let path = path.clone();
                thread::spawn(move || {
                    let client = Client::new();
                    let mut t = Tally::default();
                    let mut j = 0usize;
                    while !stop.load(Ordering::SeqCst)
                        && Instant::now() < deadline
                        && sent.fetch_add(1, Ordering::SeqCst) < max_total
                    {
                        let port = ports[(c + j) % ports.len()];
                        j += 1;
                        let url = format!("http://127.0.0.1:{port}{path}/{c}/{j}");
                        match client.try_get(&url, &[]) {
                            Ok(reply) => {
                                let num = |name: &str| {
                                    reply
                                        .header(name)
                                        .and_then(|v| v.trim().parse::<u64>().ok())
                                };
                                if reply.status == 429 {
                                    if let Some(ra) = num("retry-after") {
                                        t.retry_after.push(ra);
                                    }
                                }
                                if let Some(r) = num("x-ratelimit-reset") {
                                    t.reset.push(r);
                                }
                                *t.statuses.entry(reply.status).or_default() += 1;
                            }
                            Err(_) => *t.statuses.entry(0).or_default() += 1,
                        }
                        if !pause.is_zero() {
                            thread::sleep(pause);
                        }
                    }
                    t
                })
            })
            .collect();
        Load {
            stop,
            started,
            clients,
        }
    }

    /// Runs a load to its end (count or time) and returns the tally.
    pub fn run(
        envoys: &[Envoy],
        clients: usize,
        limit: Duration,
        max_total: u64,
        pause: Duration,
    ) -> Tally {
        Load::start(envoys, clients, limit, max_total, pause).wait()
    }

    /// Stops the clients and returns what they saw.
    pub fn finish(self) -> Tally {
        self.stop.store(true, Ordering::SeqCst);
        self.wait()
    }

    /// Waits for the clients to end (count or time) and returns what they saw.
    pub fn wait(self) -> Tally {
        let mut all = Tally::default();
        for h in self.clients {
            let t = h.join().expect("client thread");
            for (k, v) in t.statuses {
                *all.statuses.entry(k).or_default() += v;
            }
            all.retry_after.extend(t.retry_after);
            all.reset.extend(t.reset);
        }
        // From before the first request was sent to after the last response arrived.
        all.elapsed = self.started.elapsed();
        all
    }
}
