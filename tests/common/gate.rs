//! The gate: a controllable TCP listener in front of the service.

use super::process::accept_on_free_port;
use std::io::Read;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

/// What a [`Gate`] does with a new connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateMode {
    /// Pipe it to the target port.
    Forward = 0,
    /// Accept, then close at once (the service is "down" but the port is open).
    Refuse = 1,
    /// Accept and read, never answer (a hung service: callouts time out).
    BlackHole = 2,
}

/// A TCP listener on a free port whose behaviour can be switched while a test runs; it counts the
/// connections it accepted. Stopped on drop (open connections are shut down).
pub struct Gate {
    pub port: u16,
    state: Arc<GateState>,
}

struct GateState {
    mode: AtomicU8,
    target: u16,
    stop: AtomicBool,
    accepted: AtomicU64,
    conns: Mutex<Vec<TcpStream>>,
}

impl Gate {
    pub fn start(mode: GateMode, target: u16) -> Gate {
        let state = Arc::new(GateState {
            mode: AtomicU8::new(mode as u8),
            target,
            stop: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
            conns: Mutex::new(Vec::new()),
        });
        let (st, stop) = (state.clone(), state.clone());
        let port = accept_on_free_port(
            "gate",
            move || stop.stop.load(Ordering::SeqCst),
            move |conn| {
                st.accepted.fetch_add(1, Ordering::SeqCst);
                let mode = st.mode.load(Ordering::SeqCst);
                if let Ok(c) = conn.try_clone() {
                    if let Ok(mut v) = st.conns.lock() {
                        v.push(c);
                    }
                }
                match mode {
                    0 => {
                        let target = st.target;
                        thread::spawn(move || pipe(conn, target));
                    }
                    1 => {
                        let _ = conn.shutdown(Shutdown::Both);
                    }
                    _ => {
                        thread::spawn(move || {
                            let mut conn = conn;
                            let mut sink = [0u8; 4096];
                            while let Ok(n) = conn.read(&mut sink) {
                                if n == 0 {
                                    break;
                                }
                            }
                        });
                    }
                }
            },
        );
        Gate { port, state }
    }

    pub fn set_mode(&self, mode: GateMode) {
        self.state.mode.store(mode as u8, Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.state.accepted.load(Ordering::SeqCst)
    }

    /// Closes every connection accepted so far (forwarded ones included).
    pub fn drop_connections(&self) {
        if let Ok(mut v) = self.state.conns.lock() {
            for c in v.drain(..) {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        self.drop_connections();
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn pipe(client: TcpStream, target: u16) {
    let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let (Ok(mut c2), Ok(mut s2)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let (mut c1, mut s1) = (client, server);
    let t = thread::spawn(move || {
        let _ = std::io::copy(&mut c1, &mut s1);
        let _ = s1.shutdown(Shutdown::Both);
        let _ = c1.shutdown(Shutdown::Both);
    });
    let _ = std::io::copy(&mut s2, &mut c2);
    let _ = c2.shutdown(Shutdown::Both);
    let _ = s2.shutdown(Shutdown::Both);
    let _ = t.join();
}
