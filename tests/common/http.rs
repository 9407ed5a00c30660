//! HTTP clients (ureq): [`Client`] for requests through Envoy, [`http_get`] for admin and health
//! endpoints.

use std::collections::BTreeMap;
use std::time::Duration;

/// A response as the client sees it.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    /// Lower-case header names; repeated headers joined with ", ".
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }
}

impl From<ureq::http::Response<ureq::Body>> for Reply {
    fn from(mut resp: ureq::http::Response<ureq::Body>) -> Reply {
        let status = resp.status().as_u16();
        let mut map: BTreeMap<String, String> = BTreeMap::new();
        for (k, v) in resp.headers() {
            let v = v.to_str().unwrap_or("").to_string();
            map.entry(k.as_str().to_ascii_lowercase())
                .and_modify(|e| {
                    e.push_str(", ");
                    e.push_str(&v)
                })
                .or_insert(v);
        }
        let body = resp.body_mut().read_to_string().unwrap_or_default();
        Reply {
            status,
            headers: map,
            body,
        }
    }
}

/// An HTTP client with keep-alive that never turns a status into an error.
#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
}

impl Default for Client {
    fn default() -> Self {
        Client::new()
    }
}

impl Client {
    pub fn new() -> Client {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        Client { agent }
    }

    /// GET `url` with `headers`.
    pub fn get(&self, url: &str, headers: &[(&str, &str)]) -> Reply {
        self.try_get(url, headers)
            .unwrap_or_else(|e| panic!("GET {url} failed: {e}"))
    }

    /// GET `url` with `headers`; `Err` when no HTTP response came (connection, timeout).
    pub fn try_get(&self, url: &str, headers: &[(&str, &str)]) -> Result<Reply, ureq::Error> {
        let mut req = self.agent.get(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.call().map(Reply::from)
    }

    /// POST `body` to `url` with `headers`.
    pub fn post(&self, url: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        let mut req = self.agent.post(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req
            .send(body)
            .unwrap_or_else(|e| panic!("POST {url} failed: {e}"));
        Reply::from(resp)
    }

    /// `n` sequential GETs, returning the statuses.
    pub fn statuses(&self, url: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
        (0..n).map(|_| self.get(url, headers).status).collect()
    }
}

/// Counts `code` in `statuses`.
pub fn count(statuses: &[u16], code: u16) -> usize {
    statuses.iter().filter(|s| **s == code).count()
}

/// GET http://127.0.0.1:`port``path` on a fresh connection (admin and health endpoints, readiness
/// polls): the reply, `None` when no HTTP answer came within the short timeouts.
pub fn http_get(port: u16, path: &str) -> Option<Reply> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_millis(500)))
        .timeout_global(Some(Duration::from_secs(5)))
        .max_idle_connections(0)
        .build()
        .into();
    agent
        .get(&format!("http://127.0.0.1:{port}{path}"))
        .call()
        .ok()
        .map(Reply::from)
}

/// The status of [`http_get`].
pub fn http_get_status(port: u16, path: &str) -> Option<u16> {
    http_get(port, path).map(|r| r.status)
}

/// `clients` threads released together, client `i` on a connection of its own (so spread over
/// Envoy's workers) sending up to `n` GETs with `headers` to `urls[i % urls.len()]`; every reply
/// (clients are in order, each client's replies in order). A client stops early at `limit` after the
/// start, so a test that hangs shows as missing replies, not as a hang.
pub fn burst(
    urls: &[String],
    clients: usize,
    n: usize,
    headers: &[(&str, &str)],
    limit: Duration,
) -> Vec<Reply> {
    let deadline = std::time::Instant::now() + limit;
    let barrier = std::sync::Barrier::new(clients);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|i| {
                let (url, barrier) = (&urls[i % urls.len()], &barrier);
                s.spawn(move || {
                    let client = Client::new();
                    barrier.wait();
                    (0..n)
                        .take_while(|_| std::time::Instant::now() <= deadline)
                        .map(|_| client.get(url, headers))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("client thread"))
            .collect()
    })
}
