//! A delaying TCP proxy: put between Envoy and the service, it makes the service slow without touching
//! it. Bytes from the client (Envoy) reach the target at once; bytes back are held for the current delay
//! before they are written, in order. So a take reaches the service (and Redis) straight away and only
//! its answer is late: a callout that times out at the filter may still have been applied.

use crate::common::process::accept_on_free_port;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// A TCP proxy on a free 127.0.0.1 port in front of `target`; its answer delay can be changed while
/// connections are open (new bytes get the new delay, never overtaking bytes already held). Stopped on
/// drop (open connections are shut down).
pub struct DelayProxy {
    pub port: u16,
    state: Arc<State>,
}

struct State {
    target: u16,
    delay_us: AtomicU64,
    stop: AtomicBool,
    /// Both ends of every connection, to shut them down on drop.
    conns: Mutex<Vec<TcpStream>>,
}

impl DelayProxy {
    /// Starts forwarding to `target` with no delay.
    pub fn start(target: u16) -> DelayProxy {
        let state = Arc::new(State {
            target,
            delay_us: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
        });
        let (st, stop) = (state.clone(), state.clone());
        let port = accept_on_free_port(
            "delay proxy",
            move || stop.stop.load(Ordering::SeqCst),
            move |conn| {
                let st = st.clone();
                thread::spawn(move || proxy(conn, st));
            },
        );
        DelayProxy { port, state }
    }

    /// The delay of the answers from now on.
    pub fn set_delay(&self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.state.delay_us.store(us, Ordering::SeqCst);
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        if let Ok(mut v) = self.state.conns.lock() {
            for c in v.drain(..) {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn proxy(client: TcpStream, st: Arc<State>) {
    let Ok(server) = TcpStream::connect(("127.0.0.1", st.target)) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = server.set_nodelay(true);
    let _ = client.set_nodelay(true);
    let clones = (
        client.try_clone(),
        server.try_clone(),
        client.try_clone(),
        server.try_clone(),
    );
    let (Ok(c_in), Ok(s_out), Ok(c_keep), Ok(s_keep)) = clones else {
        return;
    };
    if let Ok(mut v) = st.conns.lock() {
        v.push(c_keep);
        v.push(s_keep);
    }
    // Client to target: straight through.
    let forward = thread::spawn(move || {
        let (mut from, mut to) = (c_in, s_out);
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(Shutdown::Write);
    });
    // Target to client: each chunk is stamped with the time it may leave, never before the chunk ahead
    // of it, and a writer thread sends it then.
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let mut to_client = client;
    let writer = thread::spawn(move || {
        for (at, bytes) in rx {
            let wait = at.saturating_duration_since(Instant::now());
            if !wait.is_zero() {
                thread::sleep(wait);
            }
            if to_client.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = to_client.shutdown(Shutdown::Both);
    });
    let mut from_server = server;
    let mut buf = vec![0u8; 16 * 1024];
    let mut last = Instant::now();
    loop {
        match from_server.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let delay = Duration::from_micros(st.delay_us.load(Ordering::SeqCst));
                last = last.max(Instant::now() + delay);
                if tx.send((last, buf[..n].to_vec())).is_err() {
                    break;
                }
            }
        }
    }
    drop(tx);
    let _ = writer.join();
    let _ = from_server.shutdown(Shutdown::Both);
    let _ = forward.join();
}
