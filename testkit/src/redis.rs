//! Redis for tests: `redis-server` processes on 127.0.0.1 without persistence, PING over a raw
//! socket, one command through `redis-cli`, and a Redis Cluster made of started nodes.

use crate::process::{required_component, Proc};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// redis-server (`TOLLGATE_REDIS_SERVER`, default `.tools/redis-server`); missing = test failure.
pub fn server_bin() -> PathBuf {
    required_component(
        "TOLLGATE_REDIS_SERVER",
        ".tools/redis-server",
        ". Run `make tools`, or set TOLLGATE_REDIS_SERVER.",
    )
}

/// redis-cli (`TOLLGATE_REDIS_CLI`, default `.tools/redis-cli`); missing = test failure.
pub fn cli_bin() -> PathBuf {
    required_component(
        "TOLLGATE_REDIS_CLI",
        ".tools/redis-cli",
        ". Run `make tools`, or set TOLLGATE_REDIS_CLI.",
    )
}

/// Starts `redis-server` (`bin`) on 127.0.0.1:`port` with no persistence, its files in `dir`, its
/// output in `log`, and `extra` arguments; the process, not yet waited for (see [`ping`], [`cli`]).
pub fn spawn(bin: &Path, port: u16, dir: &Path, extra: &[&str], log: PathBuf) -> Proc {
    let mut cmd = Command::new(bin);
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .args(extra);
    Proc::spawn("redis-server", cmd, log)
}

/// PING over a raw socket: true when the server answers `+PONG` (or `-NOAUTH`: it is up and wants a
/// password).
pub fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 16];
    matches!(s.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG") || buf[..n].starts_with(b"-NOAUTH"))
}

/// One command through `redis-cli` to 127.0.0.1:`port` (`cli`: more redis-cli arguments, e.g.
/// `--tls --cacert ca.pem`): its output, trimmed; `None` when redis-cli failed or could not connect.
pub fn cli(port: u16, cli: &[&str], args: &[&str]) -> Option<String> {
    let out = Command::new(cli_bin())
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(cli)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!s.starts_with("Could not connect")).then_some(s)
}

/// Joins the nodes listening on `ports` (started with `--cluster-enabled yes`) into a Redis
/// Cluster with `replicas` replicas per master (`redis-cli --cluster create`; `cli` goes before it,
/// e.g. `--tls --cacert ...`), and waits until every node reports `cluster_state:ok`.
pub fn create_cluster(ports: &[u16], replicas: usize, cli_args: &[&str]) {
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let out = Command::new(cli_bin())
        .args(cli_args)
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
        .stdin(Stdio::null())
        .output()
        .expect("run redis-cli --cluster create");
    assert!(
        out.status.success(),
        "redis-cli --cluster create: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    for &port in ports {
        loop {
            let info = cli(port, cli_args, &["CLUSTER", "INFO"]).unwrap_or_default();
            if info.contains("cluster_state:ok") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "cluster node {port} not ok: {info}"
            );
            thread::sleep(Duration::from_millis(50));
        }
    }
}
