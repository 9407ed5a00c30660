//! Processes and ports: where the real components are, scratch directories, free 127.0.0.1 ports,
//! child processes killed by PID on drop (their logs printed when a test panics), and waiting.

use std::fs::{self, File};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

/// How long a component may take to become ready before the test fails.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Paths of the real components the end-to-end tests run.
#[derive(Clone, Debug)]
pub struct Components {
    pub envoy: PathBuf,
    pub redis_server: PathBuf,
    pub server: PathBuf,
    pub wasm: PathBuf,
}

/// The workspace root (this crate's parent directory).
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(Path::to_path_buf).unwrap_or(here)
}

fn component(var: &str, default_rel: &str) -> PathBuf {
    required_component(
        var,
        default_rel,
        &format!(
            ". Run `make build` (and `make tools`), or set {var}. \
             End-to-end tests need the real component and do not skip."
        ),
    )
}

/// The file named by env var `var`, else `default_rel` under the workspace root. A missing file
/// fails the test with "`var`: `path` is missing`remedy`".
pub fn required_component(var: &str, default_rel: &str, remedy: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(default_rel));
    assert!(
        path.is_file(),
        "{var}: {} is missing{remedy}",
        path.display()
    );
    path
}

impl Components {
    /// Resolves every component, failing the test with a clear message if one is missing.
    pub fn get() -> Components {
        Components {
            envoy: component("TOLLGATE_ENVOY", ".tools/envoy"),
            redis_server: component("TOLLGATE_REDIS_SERVER", ".tools/redis-server"),
            server: component("TOLLGATE_SERVER", "dist/tollgate-server"),
            wasm: component("TOLLGATE_WASM", "dist/tollgate.wasm"),
        }
    }
}

/// libfaketime, for running a service under a shifted clock (Debian package `faketime`, installed by
/// `scripts/tools.sh`; `TOLLGATE_LIBFAKETIME` overrides the path). Missing = test failure.
pub fn libfaketime() -> PathBuf {
    if let Some(p) = std::env::var_os("TOLLGATE_LIBFAKETIME") {
        return PathBuf::from(p);
    }
    let candidates = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/faketime/libfaketimeMT.so.1",
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "libfaketime is missing (looked in {candidates:?}): run `bash scripts/tools.sh` \
                 (Debian package faketime) or set TOLLGATE_LIBFAKETIME"
            )
        })
}

/// A scratch directory, removed on drop unless the test is failing (its logs are then kept).
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new(label: &str) -> TempDir {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "tollgate-test-{}-{}-{label}",
            std::process::id(),
            n
        ));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A new log file path `<stem>-<n>.log`: a component started again on the same port does not
    /// overwrite the log of its predecessor.
    pub fn log_file(&self, stem: &str) -> PathBuf {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        self.path.join(format!("{stem}-{n}.log"))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!("(test files kept in {})", self.path.display());
        } else {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// A free 127.0.0.1 port: bound, then released for the child to take. Ports are handed out from a
/// process-wide sequence of OS-assigned ports; the small window before the child binds is accepted.
/// A port is never handed out twice by one test process; a clash with another process (the bind fails
/// and the child exits) is retried by the `start` functions.
pub fn free_port() -> u16 {
    static HANDED: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    for _ in 0..100 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = l.local_addr().expect("local addr").port();
        let mut handed = HANDED.lock().unwrap_or_else(|e| e.into_inner());
        if !handed.contains(&port) {
            handed.push(port);
            return port;
        }
    }
    panic!("no free port found");
}

/// How many times a component is started on a new port after it exited at start (port clash).
pub const START_ATTEMPTS: usize = 3;

/// A 127.0.0.1 port where nothing listens (connections are refused), and where nothing of the suite
/// will: it lies below the kernel's ephemeral range (`ip_local_port_range`), from which every
/// `free_port` of every test process comes. A port from `free_port` would only be closed until
/// another test, in another process, was handed it for its service: a test of a refused connection
/// then reached someone else's service.
pub fn closed_port() -> u16 {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let low = ephemeral_low();
    // 12,000 ports below the range, visited from a point of this process's own.
    let span = 12_000u64.min(u64::from(low).saturating_sub(1025)).max(1);
    let start = u64::from(std::process::id()).wrapping_mul(7919);
    for _ in 0..1000 {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let offset = u16::try_from((start + n * 101) % span).unwrap_or(0);
        let port = low - 1 - offset;
        // Nothing bound there now (the bind is released at once) and nothing listening.
        if TcpListener::bind(("127.0.0.1", port)).is_ok()
            && TcpStream::connect(("127.0.0.1", port)).is_err()
        {
            return port;
        }
    }
    panic!("no closed port found below {low}");
}

/// The first port of the kernel's ephemeral range (Linux's default 32768 when it cannot be read).
fn ephemeral_low() -> u16 {
    fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .filter(|&p: &u16| p > 2048)
        .unwrap_or(32768)
}

/// A child process killed by PID on drop; its combined output goes to `log`.
pub struct Proc {
    pub name: String,
    child: Child,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `cmd` with stdin closed and stdout and stderr into `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: PathBuf) -> Proc {
        let out = File::create(&log).expect("create log file");
        let err = out.try_clone().expect("clone log file");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({:?}): {e}", cmd.get_program()));
        Proc {
            name: name.to_string(),
            child,
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The whole log so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits up to `limit` for the process to exit by itself.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(st) = self.exited() {
                return Some(st);
            }
            thread::sleep(Duration::from_millis(20));
        }
        None
    }

    fn print_log(&self) {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        let start = lines.len().saturating_sub(150);
        eprintln!(
            "----- {} (pid {}) log, last {} lines of {} -----",
            self.name,
            self.child.id(),
            lines.len() - start,
            self.log.display()
        );
        for l in &lines[start..] {
            eprintln!("{l}");
        }
        eprintln!("----- end of {} log -----", self.name);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if thread::panicking() {
            self.print_log();
        }
    }
}

/// Waits for `ready`. `Err(true)` when the process exited first (e.g. its port was taken: worth a
/// retry on another port), panics with the log when it is not ready in time.
pub fn wait_until(
    what: &str,
    proc: &mut Proc,
    mut ready: impl FnMut() -> bool,
) -> Result<(), bool> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(st) = proc.exited() {
            eprintln!("{what} exited before it was ready: {st}");
            proc.print_log();
            return Err(true);
        }
        if ready() {
            return Ok(());
        }
        if Instant::now() > deadline {
            proc.print_log();
            panic!("{what} not ready after {READY_TIMEOUT:?}");
        }
        thread::sleep(Duration::from_millis(25));
    }
}

/// Binds a free 127.0.0.1 port and accepts on a thread of its own, handing each connection to
/// `on_conn` (on that thread) until `stopped` says so. The owner stops it by making `stopped` true,
/// then connecting once to wake the loop.
pub fn accept_on_free_port(
    what: &str,
    stopped: impl Fn() -> bool + Send + 'static,
    mut on_conn: impl FnMut(TcpStream) + Send + 'static,
) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind {what}: {e}"));
    let port = listener.local_addr().expect("addr").port();
    thread::spawn(move || {
        for conn in listener.incoming() {
            if stopped() {
                break;
            }
            let Ok(conn) = conn else { continue };
            on_conn(conn);
        }
    });
    port
}

/// Waits (bounded) until `cond` holds; false on timeout.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        thread::sleep(Duration::from_millis(20));
    }
    cond()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_port_is_refused_and_never_one_a_test_is_handed() {
        let low = ephemeral_low();
        for _ in 0..20 {
            let closed = closed_port();
            assert!(
                closed < low,
                "{closed} is in the ephemeral range from {low}"
            );
            assert!(TcpStream::connect(("127.0.0.1", closed)).is_err());
            assert!(
                free_port() >= low,
                "free ports come from the ephemeral range"
            );
        }
    }
}
