//! Redis for tests: `redis-server` processes on 127.0.0.1 without persistence, PING over a raw
//! socket, one command through `redis-cli`, a Redis Cluster made of started nodes, and a Redis
//! Sentinel setup (a master, its replica, three sentinels).

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

/// Whether the process on `port` answers: [`ping`], or over TLS a `PING` through redis-cli.
fn up(port: u16, tls: Option<&SentinelTls>) -> bool {
    match tls {
        None => ping(port),
        Some(t) => cli(port, &t.cli_args(), &["PING"]).as_deref() == Some("PONG"),
    }
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

/// A Redis Sentinel setup on 127.0.0.1: a master, one replica of it and three sentinels
/// (`redis-server <conf> --sentinel`, the binary Debian's `redis-sentinel` links to) watching it
/// under one name, each process killed by PID on drop. [`SentinelSetup::start`] returns once every
/// sentinel knows the replica and the other two sentinels, so that a failover can happen.
pub struct SentinelSetup {
    /// The name the sentinels know the master by.
    pub name: String,
    /// The ports of the two data nodes (the first started as the master).
    pub nodes: [u16; 2],
    /// The sentinels' ports.
    pub sentinels: Vec<u16>,
    procs: Vec<Proc>,
    dir: crate::process::TempDir,
    /// The data nodes' and the sentinels' passwords, for redis-cli.
    auth: [Option<String>; 2],
    /// TLS only, on every process ([`SentinelSetup::start_tls`]).
    tls: Option<SentinelTls>,
}

/// The files of a TLS-only Sentinel setup: every process serves TLS only (`port 0`, `tls-port`)
/// with this certificate (valid for 127.0.0.1, server and client use: the nodes replicate and the
/// sentinels talk to each other over TLS), trusting `ca`; clients need no certificate.
#[derive(Clone, Debug)]
pub struct SentinelTls {
    /// The path of the processes' certificate (PEM).
    pub cert: String,
    /// The path of its key (PEM).
    pub key: String,
    /// The path of the CA that signed it (PEM).
    pub ca: String,
}

impl SentinelTls {
    /// What redis-cli needs to reach a process of the setup.
    fn cli_args(&self) -> [&str; 3] {
        ["--tls", "--cacert", &self.ca]
    }
}

impl SentinelSetup {
    /// Starts the five processes; `extra` are more arguments of both data nodes.
    pub fn start(name: &str, extra: &[&str]) -> SentinelSetup {
        Self::start_with_passwords(name, extra, None, None)
    }

    /// As [`SentinelSetup::start`], the data nodes with `requirepass` (and `masterauth`)
    /// `password` and the sentinels with `requirepass` `sentinel_password`.
    pub fn start_with_passwords(
        name: &str,
        extra: &[&str],
        password: Option<&str>,
        sentinel_password: Option<&str>,
    ) -> SentinelSetup {
        Self::start_with(name, extra, password, sentinel_password, None)
    }

    /// As [`SentinelSetup::start`], every process serving TLS only with the files of `tls`
    /// (the nodes replicating and the sentinels asking each other over TLS too).
    pub fn start_tls(name: &str, tls: &SentinelTls) -> SentinelSetup {
        Self::start_with(name, &[], None, None, Some(tls))
    }

    fn start_with(
        name: &str,
        extra: &[&str],
        password: Option<&str>,
        sentinel_password: Option<&str>,
        tls: Option<&SentinelTls>,
    ) -> SentinelSetup {
        let bin = server_bin();
        let dir = crate::process::TempDir::new("sentinel");
        let nodes = [crate::process::free_port(), crate::process::free_port()];
        let mut procs = Vec::new();
        for (i, &port) in nodes.iter().enumerate() {
            let node_dir = dir.path().join(format!("node-{port}"));
            std::fs::create_dir_all(&node_dir).expect("node dir");
            let master = nodes[0].to_string();
            let mut args: Vec<&str> = extra.to_vec();
            if let Some(pw) = password {
                args.extend(["--requirepass", pw, "--masterauth", pw]);
            }
            if i == 1 {
                args.extend(["--replicaof", "127.0.0.1", &master]);
            }
            let port_s = port.to_string();
            if let Some(t) = tls {
                // The last `--port` wins: no plaintext port, TLS on this one.
                args.extend(["--port", "0", "--tls-port", &port_s]);
                args.extend(["--tls-cert-file", &t.cert, "--tls-key-file", &t.key]);
                args.extend(["--tls-ca-cert-file", &t.ca, "--tls-auth-clients", "no"]);
                args.extend(["--tls-replication", "yes"]);
            }
            let log = dir.log_file(&format!("redis-{port}"));
            procs.push(spawn(&bin, port, &node_dir, &args, log));
            crate::process::wait_until("redis-server", procs.last_mut().expect("proc"), || {
                up(port, tls)
            })
            .expect("redis-server started");
        }
        let sentinels: Vec<u16> = (0..3).map(|_| crate::process::free_port()).collect();
        for &port in &sentinels {
            // A sentinel rewrites its configuration file: one writable file each.
            let conf = dir.path().join(format!("sentinel-{port}.conf"));
            let listen = match tls {
                None => format!("port {port}\n"),
                Some(t) => format!(
                    "port 0\ntls-port {port}\ntls-cert-file {}\ntls-key-file {}\n\
                     tls-ca-cert-file {}\ntls-auth-clients no\ntls-replication yes\n",
                    t.cert, t.key, t.ca
                ),
            };
            let text = format!(
                "{listen}bind 127.0.0.1\ndir {dir}\n\
                 sentinel monitor {name} 127.0.0.1 {master} 2\n\
                 sentinel down-after-milliseconds {name} 1000\n\
                 sentinel failover-timeout {name} 10000\n\
                 sentinel parallel-syncs {name} 1\n",
                dir = dir.path().display(),
                master = nodes[0],
            );
            let mut text = text;
            if let Some(pw) = password {
                text.push_str(&format!("sentinel auth-pass {name} {pw}\n"));
            }
            if let Some(pw) = sentinel_password {
                // The sentinels ask each other with the same password.
                text.push_str(&format!("requirepass {pw}\nsentinel sentinel-pass {pw}\n"));
            }
            std::fs::write(&conf, text).expect("write sentinel.conf");
            let mut cmd = Command::new(&bin);
            cmd.arg(&conf).arg("--sentinel");
            let log = dir.log_file(&format!("sentinel-{port}"));
            procs.push(Proc::spawn("redis-sentinel", cmd, log));
            crate::process::wait_until("redis-sentinel", procs.last_mut().expect("proc"), || {
                up(port, tls)
            })
            .expect("redis-sentinel started");
        }
        let setup = SentinelSetup {
            auth: [password, sentinel_password].map(|p| p.map(str::to_string)),
            name: name.to_string(),
            nodes,
            sentinels,
            procs,
            dir,
            tls: tls.cloned(),
        };
        setup.wait_ready(nodes[0], Duration::from_secs(30));
        setup
    }

    /// The sentinels as URLs, `redis://127.0.0.1:<port>` each (`rediss://` over TLS).
    pub fn sentinel_urls(&self) -> Vec<String> {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        self.sentinels
            .iter()
            .map(|p| format!("{scheme}://127.0.0.1:{p}"))
            .collect()
    }

    /// The master's port as the first sentinel names it (`SENTINEL GET-MASTER-ADDR-BY-NAME`).
    pub fn master(&self) -> Option<u16> {
        self.master_by(self.sentinels[0])
    }

    /// The master's port as each sentinel names it, in the order of [`SentinelSetup::sentinels`].
    pub fn masters(&self) -> Vec<Option<u16>> {
        self.sentinels.iter().map(|&s| self.master_by(s)).collect()
    }

    fn master_by(&self, sentinel: u16) -> Option<u16> {
        let out = self.cli(
            sentinel,
            &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", &self.name],
        )?;
        out.lines().nth(1)?.trim().parse().ok()
    }

    /// The data node that is not `port`.
    pub fn other(&self, port: u16) -> u16 {
        if self.nodes[0] == port {
            self.nodes[1]
        } else {
            self.nodes[0]
        }
    }

    /// Waits until every sentinel names `master`, knows its replica (healthy, its link up) and
    /// the other two sentinels; panics with the logs after `limit`.
    pub fn wait_ready(&self, master: u16, limit: Duration) {
        let ok = crate::process::eventually(limit, || {
            self.sentinels.iter().all(|&s| {
                let replicas = self
                    .cli(s, &["SENTINEL", "REPLICAS", &self.name])
                    .unwrap_or_default();
                let info = self
                    .cli(s, &["SENTINEL", "MASTER", &self.name])
                    .unwrap_or_default();
                let lines: Vec<&str> = info.lines().map(str::trim).collect();
                let field = |k: &str| {
                    lines
                        .iter()
                        .position(|l| *l == k)
                        .and_then(|i| lines.get(i + 1))
                        .copied()
                };
                self.master_by(s) == Some(master)
                    && replicas.contains(&self.other(master).to_string())
                    && !replicas.contains("s_down")
                    && field("num-other-sentinels") == Some("2")
                    && field("num-slaves") == Some("1")
            }) && self
                .cli(self.other(master), &["INFO", "REPLICATION"])
                .is_some_and(|i| i.contains("master_link_status:up"))
        });
        // The processes' logs are printed as they are dropped by the panic.
        assert!(ok, "the sentinel setup is not ready after {limit:?}");
    }

    /// Waits until the replica of `master` has received every write `master` took.
    pub fn wait_replicated(&self, master: u16, limit: Duration) -> bool {
        let offset = |port: u16, key: &str| {
            self.cli(port, &["INFO", "REPLICATION"])?
                .lines()
                .find_map(|l| l.trim().strip_prefix(key)?.parse::<u64>().ok())
        };
        crate::process::eventually(limit, || {
            let m = offset(master, "master_repl_offset:");
            m.is_some() && m == offset(self.other(master), "slave_repl_offset:")
        })
    }

    /// `SENTINEL FAILOVER <name>` through the first sentinel: promotes the replica without
    /// waiting for the master to be found down. True when the sentinel accepted it.
    pub fn failover(&self) -> bool {
        self.cli(self.sentinels[0], &["SENTINEL", "FAILOVER", &self.name])
            .as_deref()
            == Some("OK")
    }

    /// Kills (SIGKILL) the data node listening on `port`.
    pub fn kill_node(&mut self, port: u16) {
        let i = usize::from(self.nodes[1] == port);
        self.procs[i].kill();
    }

    /// One command through redis-cli to the node or sentinel on `port`, with its password.
    pub fn cli(&self, port: u16, args: &[&str]) -> Option<String> {
        let pw = if self.sentinels.contains(&port) {
            &self.auth[1]
        } else {
            &self.auth[0]
        };
        let mut with: Vec<&str> = Vec::new();
        if let Some(pw) = pw {
            with.extend(["--no-auth-warning", "-a", pw]);
        }
        if let Some(t) = &self.tls {
            with.extend(t.cli_args());
        }
        cli(port, &with, args)
    }

    /// Where the processes' files and logs are.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}
