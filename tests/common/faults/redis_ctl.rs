//! Redis as a fault source: a raw RESP connection for commands sent mid-load (`CONFIG SET`,
//! `REPLICAOF`, `INFO`), signals to a process by PID (SIGSTOP / SIGCONT), and a Redis Cluster of
//! masters with one replica each, whose masters can be killed for a real failover.

use crate::common::{free_port, redis_ping, wait_until, Components, Proc, TempDir};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

/// Sends `signal` (`STOP`, `CONT`, `KILL`...) to `pid` with kill(1).
pub fn signal(pid: u32, signal: &str) {
    let st = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .expect("run kill");
    assert!(st.success(), "kill -{signal} {pid}: {st}");
}

/// One open connection to a Redis, opened before a fault so that sending a command costs a round trip
/// and nothing else.
pub struct RedisConn {
    pub port: u16,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl RedisConn {
    pub fn open(port: u16) -> RedisConn {
        let s = TcpStream::connect(("127.0.0.1", port))
            .unwrap_or_else(|e| panic!("connect to Redis on {port}: {e}"));
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("read timeout");
        let _ = s.set_nodelay(true);
        let writer = s.try_clone().expect("clone Redis connection");
        RedisConn {
            port,
            reader: BufReader::new(s),
            writer,
        }
    }

    /// Sends one command; `Ok` with the reply as text (bulk strings as they are, integers and simple
    /// strings without their marker, arrays joined by newlines), `Err` with a Redis error's text.
    pub fn cmd(&mut self, args: &[&str]) -> Result<String, String> {
        let mut out = format!("*{}\r\n", args.len());
        for a in args {
            out.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        self.writer
            .write_all(out.as_bytes())
            .map_err(|e| format!("write: {e}"))?;
        self.reply()
    }

    /// As [`RedisConn::cmd`], failing the test on an error reply.
    pub fn ok(&mut self, args: &[&str]) -> String {
        let port = self.port;
        self.cmd(args)
            .unwrap_or_else(|e| panic!("Redis {port}: {args:?}: {e}"))
    }

    fn line(&mut self) -> Result<String, String> {
        let mut l = String::new();
        self.reader
            .read_line(&mut l)
            .map_err(|e| format!("read: {e}"))?;
        if l.is_empty() {
            return Err("connection closed".to_string());
        }
        Ok(l.trim_end_matches(['\r', '\n']).to_string())
    }

    fn reply(&mut self) -> Result<String, String> {
        let l = self.line()?;
        let (kind, rest) = l.split_at(1.min(l.len()));
        match kind {
            "+" | ":" => Ok(rest.to_string()),
            "-" => Err(rest.to_string()),
            "$" => {
                let n: i64 = rest
                    .parse()
                    .map_err(|_| format!("bad bulk length {rest}"))?;
                if n < 0 {
                    return Ok(String::new());
                }
                let mut buf = vec![0u8; n as usize + 2];
                std::io::Read::read_exact(&mut self.reader, &mut buf)
                    .map_err(|e| format!("read: {e}"))?;
                buf.truncate(n as usize);
                Ok(String::from_utf8_lossy(&buf).into_owned())
            }
            "*" => {
                let n: i64 = rest
                    .parse()
                    .map_err(|_| format!("bad array length {rest}"))?;
                let mut items = Vec::new();
                for _ in 0..n.max(0) {
                    items.push(self.reply()?);
                }
                Ok(items.join("\n"))
            }
            _ => Err(format!("unexpected reply {l:?}")),
        }
    }

    /// One field of `INFO <section>` (e.g. `role` of `replication`).
    pub fn info_field(&mut self, section: &str, field: &str) -> Option<String> {
        let info = self.cmd(&["INFO", section]).ok()?;
        info_value(&info, field)
    }
}

/// The value of `field` in `INFO` text.
pub fn info_value(info: &str, field: &str) -> Option<String> {
    info.lines()
        .filter_map(|l| l.trim().split_once(':'))
        .find(|(k, _)| *k == field)
        .map(|(_, v)| v.to_string())
}

/// Waits (bounded) until the Redis on `port` reports `master_link_status:up` (a replica in sync).
pub fn wait_replica_in_sync(port: u16, limit: Duration) {
    let mut conn = RedisConn::open(port);
    let deadline = Instant::now() + limit;
    loop {
        if conn
            .info_field("replication", "master_link_status")
            .as_deref()
            == Some("up")
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "Redis {port} not in sync with its master after {limit:?}: {:?}",
            conn.cmd(&["INFO", "replication"])
        );
        thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------------------------
// Redis Cluster

/// One node of a [`Cluster`].
pub struct Node {
    pub port: u16,
    pub proc: Proc,
}

/// A Redis Cluster on 127.0.0.1: `masters` masters with one replica each, made by `redis-cli --cluster
/// create --cluster-replicas 1`. Nodes are killed by PID on drop.
pub struct Cluster {
    pub nodes: Vec<Node>,
}

impl Cluster {
    /// Starts `2 × masters` nodes with `cluster-node-timeout` `node_timeout_ms` (how long a master may
    /// be unreachable before its replica takes over), joins them, and waits until the cluster is ok
    /// and every replica is in sync.
    pub fn start(c: &Components, dir: &TempDir, masters: usize, node_timeout_ms: u64) -> Cluster {
        let nodes: Vec<Node> = (0..2 * masters)
            .map(|_| Cluster::node(c, dir, node_timeout_ms))
            .collect();
        let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
        tollgate_testkit::redis::create_cluster(&ports, 1, &[]);
        let cluster = Cluster { nodes };
        let deadline = Instant::now() + Duration::from_secs(30);
        for n in &cluster.nodes {
            let mut conn = RedisConn::open(n.port);
            loop {
                let ok = conn.info_field_cluster_ok();
                let role = conn.info_field("replication", "role");
                let synced = role.as_deref() == Some("master")
                    || conn
                        .info_field("replication", "master_link_status")
                        .as_deref()
                        == Some("up");
                if ok && synced {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster node {} not ready (role {role:?})",
                    n.port
                );
                thread::sleep(Duration::from_millis(50));
            }
        }
        cluster
    }

    fn node(c: &Components, dir: &TempDir, node_timeout_ms: u64) -> Node {
        for _ in 0..3 {
            let port = free_port();
            let node_timeout = node_timeout_ms.to_string();
            let conf = format!("nodes-{port}.conf");
            // The cluster bus on a free port of its own, not `port + 10000`.
            let bus = free_port().to_string();
            let mut proc = tollgate_testkit::redis::spawn(
                &c.redis_server,
                port,
                dir.path(),
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-port",
                    &bus,
                    "--cluster-config-file",
                    &conf,
                    "--cluster-node-timeout",
                    &node_timeout,
                ],
                dir.log_file(&format!("redis-{port}")),
            );
            if wait_until("redis cluster node", &mut proc, || redis_ping(port)).is_ok() {
                return Node { port, proc };
            }
        }
        panic!("a Redis Cluster node did not start in 3 attempts");
    }

    /// Seed URLs of every node, comma-separated (the service's `--redis-cluster`).
    pub fn seeds(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The index of the master holding a bucket (the first with a token bucket or fixed window key),
    /// if any.
    pub fn master_with_keys(&self) -> Option<usize> {
        self.nodes.iter().position(|n| {
            let mut conn = RedisConn::open(n.port);
            // A bucket's key, not the service's live-instance set (`<prefix>instances:{..}`).
            conn.info_field("replication", "role").as_deref() == Some("master")
                && ["*tb:{*", "*fw:{*"]
                    .iter()
                    .any(|p| conn.cmd(&["KEYS", p]).is_ok_and(|k| !k.is_empty()))
        })
    }

    /// The index of the replica of the node at `master`.
    pub fn replica_of(&self, master: usize) -> Option<usize> {
        let port = self.nodes.get(master)?.port.to_string();
        self.nodes.iter().position(|n| {
            RedisConn::open(n.port)
                .info_field("replication", "master_port")
                .as_deref()
                == Some(port.as_str())
        })
    }
}

impl RedisConn {
    fn info_field_cluster_ok(&mut self) -> bool {
        self.cmd(&["CLUSTER", "INFO"])
            .map(|i| i.contains("cluster_state:ok"))
            .unwrap_or(false)
    }

    /// Whether this node is a master and the cluster is ok as it sees it.
    pub fn is_serving_master(&mut self) -> bool {
        self.info_field("replication", "role").as_deref() == Some("master")
            && self.info_field_cluster_ok()
    }
}
