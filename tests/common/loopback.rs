//! Clients told apart by their source address, clients that vanish mid-request, and a trusted load
//! balancer in front of Envoy. All of 127.0.0.0/8 is loopback on Linux, so a socket bound to
//! 127.0.0.2 before it connects is, to Envoy, another client than one bound to 127.0.0.3.
//!
//! Raw sockets, not ureq: a client here binds its source address before it connects, or sends a
//! request and hangs up (or resets) without reading the answer; ureq does neither.

use super::process::accept_on_free_port;
use socket2::{Domain, Socket, Type};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// A TCP connection from `src` (any port) to 127.0.0.1:`port`.
pub fn connect_from(src: Ipv4Addr, port: u16) -> std::io::Result<TcpStream> {
    let sock = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    sock.bind(&SocketAddr::from((src, 0)).into())?;
    sock.connect_timeout(
        &SocketAddr::from((Ipv4Addr::LOCALHOST, port)).into(),
        IO_TIMEOUT,
    )?;
    let s: TcpStream = sock.into();
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(s)
}

/// One `GET path` over HTTP/1.1 from `src`, with `headers`; the response status, `None` when the
/// connection failed or the answer was not HTTP.
pub fn get_from(src: Ipv4Addr, port: u16, path: &str, headers: &[(&str, &str)]) -> Option<u16> {
    let mut s = connect_from(src, port).ok()?;
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let req = format!("GET {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n{extra}\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut resp = Vec::new();
    let _ = s.read_to_end(&mut resp);
    let line = String::from_utf8_lossy(&resp);
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Opens `count` connections to 127.0.0.1:`port` and writes one `GET path` on each, without
/// waiting for answers: requests Envoy now holds. Source addresses rotate over 127.0.1.1 ..
/// 127.0.1.64 (from `first`), so the connections' TIME_WAIT entries never exhaust one address's
/// ports. Connections that fail are left out.
pub fn send_requests(port: u16, path: &str, count: u64, first: u64) -> Vec<TcpStream> {
    let req = format!("GET {path} HTTP/1.1\r\nhost: test\r\n\r\n");
    (first..first + count)
        .filter_map(|i| {
            let src = Ipv4Addr::new(127, 0, 1, 1 + (i % 64) as u8);
            let mut s = connect_from(src, port).ok()?;
            s.write_all(req.as_bytes()).ok()?;
            Some(s)
        })
        .collect()
}

/// The clients go away: each connection is reset (RST), not closed (a FIN would not do: Envoy
/// keeps an HTTP/1.1 request whose client half-closed).
pub fn reset_all(conns: Vec<TcpStream>) {
    for s in conns {
        let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
    }
}

/// A trusted load balancer: an HTTP/1.1 proxy on a free 127.0.0.1 port that forwards each
/// connection to 127.0.0.1:`target`, adding `x-forwarded-for: <client address>` to every request
/// head (after whatever x-forwarded-for the client sent, as load balancers append). Stops on drop.
pub struct XffProxy {
    pub port: u16,
    stop: Arc<AtomicBool>,
}

impl XffProxy {
    pub fn start(target: u16) -> XffProxy {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let port = accept_on_free_port(
            "xff proxy",
            move || stopped.load(Ordering::SeqCst),
            move |conn| {
                thread::spawn(move || forward_with_xff(conn, target));
            },
        );
        XffProxy { port, stop }
    }
}

impl Drop for XffProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Reads request heads from `client` (requests without a body: the tests send GETs), appends the
/// x-forwarded-for line, forwards them, and pipes the answers back.
fn forward_with_xff(client: TcpStream, target: u16) {
    let Ok(peer) = client.peer_addr() else { return };
    let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
        return;
    };
    let (Ok(mut from_server), Ok(mut to_client)) = (server.try_clone(), client.try_clone()) else {
        return;
    };
    let back = thread::spawn(move || {
        let _ = std::io::copy(&mut from_server, &mut to_client);
        let _ = to_client.shutdown(Shutdown::Both);
    });
    let (mut client, mut server) = (client, server);
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = &buf[..end + 2];
            let mut out = head.to_vec();
            out.extend_from_slice(format!("x-forwarded-for: {}\r\n\r\n", peer.ip()).as_bytes());
            if server.write_all(&out).is_err() {
                return;
            }
            buf.drain(..end + 4);
        }
        match client.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
        }
    }
    let _ = server.shutdown(Shutdown::Write);
    let _ = back.join();
}

/// Resident memory of a process (VmRSS), in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}
