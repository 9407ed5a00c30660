//! The upstream: a counting HTTP/1.1 server in the test process, optionally slow (it then counts the
//! requests it holds); it records when each request arrived, for tests of a rate over time.

use super::process::accept_on_free_port;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// A minimal HTTP/1.1 server (keep-alive, a thread per connection) answering 200 "upstream\n" and
/// recording the head of every request it received (the first 10,000), and optionally counting the
/// requests per value of one header.
pub struct Upstream {
    pub port: u16,
    state: Arc<UpstreamState>,
}

struct UpstreamState {
    stop: AtomicBool,
    requests: AtomicU64,
    heads: Mutex<Vec<String>>,
    /// When each request arrived (its head read), with its path: the first 10,000.
    arrivals: Mutex<Vec<(Instant, String)>>,
    bodies: Mutex<Vec<Vec<u8>>>,
    /// The header (lower case) whose values are counted, and the counts.
    count_by: Option<String>,
    counts: Mutex<BTreeMap<String, u64>>,
    /// How long each request is held before its answer: (`delay`, `hold` for paths starting with
    /// `/hold`); `None`: answered at once. A slow upstream also resets requests to `/reset...`.
    slow: Option<(Duration, Duration)>,
    /// Requests held now, and the most ever held at once.
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
}

impl Upstream {
    pub fn start() -> Upstream {
        Upstream::launch(None, None)
    }

    /// A slow upstream: holds each request `delay` (`hold` for paths starting with `/hold`) before
    /// it answers, and counts the requests it holds ([`Upstream::in_flight`]); a request to a path
    /// starting with `/reset` is reset (the connection dropped unanswered: Envoy answers 503).
    pub fn start_slow(delay: Duration, hold: Duration) -> Upstream {
        Upstream::launch(None, Some((delay, hold)))
    }

    /// As [`Upstream::start`], also counting requests per value of `header` ("?" when absent); see
    /// [`Upstream::counts`].
    pub fn start_counting_by(header: &str) -> Upstream {
        Upstream::launch(Some(header.to_ascii_lowercase()), None)
    }

    fn launch(count_by: Option<String>, slow: Option<(Duration, Duration)>) -> Upstream {
        let state = Arc::new(UpstreamState {
            stop: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            heads: Mutex::new(Vec::new()),
            arrivals: Mutex::new(Vec::new()),
            bodies: Mutex::new(Vec::new()),
            count_by,
            counts: Mutex::new(BTreeMap::new()),
            slow,
            in_flight: AtomicU64::new(0),
            max_in_flight: AtomicU64::new(0),
        });
        let (st, stop) = (state.clone(), state.clone());
        let port = accept_on_free_port(
            "upstream",
            move || stop.stop.load(Ordering::SeqCst),
            move |conn| {
                let st = st.clone();
                thread::spawn(move || serve_upstream(conn, st));
            },
        );
        Upstream { port, state }
    }

    /// Requests received so far.
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// Requests a slow upstream holds now.
    pub fn in_flight(&self) -> u64 {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    /// The most requests a slow upstream ever held at once.
    pub fn max_in_flight(&self) -> u64 {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    /// Requests that came through the Envoy listening on `port` (their `host` header is the one the
    /// client gave it, `127.0.0.1:<port>`): a port this upstream was given after another test's
    /// upstream let it go may still receive that test's requests.
    pub fn requests_through(&self, port: u16) -> usize {
        let host = format!("host: 127.0.0.1:{port}\r\n");
        self.heads()
            .iter()
            .filter(|h| h.to_ascii_lowercase().contains(&host))
            .count()
    }

    /// The request heads received so far (request line and headers).
    pub fn heads(&self) -> Vec<String> {
        self.state
            .heads
            .lock()
            .map(|h| h.clone())
            .unwrap_or_default()
    }

    /// When each request received so far arrived, with its path, in the order they arrived (the
    /// first 10,000).
    pub fn arrivals(&self) -> Vec<(Instant, String)> {
        self.state
            .arrivals
            .lock()
            .map(|a| a.clone())
            .unwrap_or_default()
    }

    /// Requests received so far per value of the header named in [`Upstream::start_counting_by`].
    pub fn counts(&self) -> BTreeMap<String, u64> {
        self.state
            .counts
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default()
    }

    /// The request bodies received so far (those of the first 100 requests).
    pub fn bodies(&self) -> Vec<Vec<u8>> {
        self.state
            .bodies
            .lock()
            .map(|b| b.clone())
            .unwrap_or_default()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn serve_upstream(mut conn: TcpStream, st: Arc<UpstreamState>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let Some((head, body)) =
            next_request(&mut conn, &mut buf, || st.stop.load(Ordering::SeqCst))
        else {
            return;
        };
        let arrived = Instant::now();
        if let Ok(mut b) = st.bodies.lock() {
            if b.len() < 100 {
                b.push(body);
            }
        }
        st.requests.fetch_add(1, Ordering::SeqCst);
        if let Some(name) = &st.count_by {
            let value = header_value(&head, name).unwrap_or("?").to_string();
            if let Ok(mut m) = st.counts.lock() {
                *m.entry(value).or_default() += 1;
            }
        }
        let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
        if let Ok(mut a) = st.arrivals.lock() {
            if a.len() < 10_000 {
                a.push((arrived, path.clone()));
            }
        }
        if let Ok(mut h) = st.heads.lock() {
            if h.len() < 10_000 {
                h.push(head);
            }
        }
        if let Some((delay, hold)) = st.slow {
            if path.starts_with("/reset") {
                return;
            }
            let now = st.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            st.max_in_flight.fetch_max(now, Ordering::SeqCst);
            thread::sleep(if path.starts_with("/hold") {
                hold
            } else {
                delay
            });
            st.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
        let body = "upstream\n";
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if conn.write_all(resp.as_bytes()).is_err() {
            return;
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The value of header `name` in a request or response head (first match, trimmed).
pub fn header_value<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim())
}

/// Reads the next HTTP/1.1 request on `conn` (keep-alive: `buf` keeps what was read past it): its
/// head and its body (by `content-length`). `None` when the connection ends or `stopped()`.
pub fn next_request(
    conn: &mut TcpStream,
    buf: &mut Vec<u8>,
    stopped: impl Fn() -> bool,
) -> Option<(String, Vec<u8>)> {
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = find(buf, b"\r\n\r\n") {
            break i + 4;
        }
        match conn.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        if stopped() {
            return None;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let body_len: usize = header_value(&head, "content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + body_len {
        match conn.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let body = buf.drain(..head_end + body_len).skip(head_end).collect();
    Some((head, body))
}
