//! TLS to Redis with a private CA, as in Kubernetes: real TLS-only redis-server processes and a
//! throwaway CA, server and client certificates made here with the `openssl` CLI. A private CA
//! makes takes work and stay exact; without it the store is unavailable (503, never allowed);
//! mutual TLS works with a client certificate and fails without; the real binary keeps the URL's
//! password out of its logs and names the flag at fault when a TLS file is wrong; a TLS Redis
//! Cluster works with the same files.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bucket, post_take, RedisProc, Service};
use serde_json::json;
use tollgate_server::ops::take;
use tollgate_server::store::redis::{ClientIdentity, RedisConfig, RedisStore, RedisTls};
use tollgate_server::store::Store;

/// A throwaway PKI in a temp dir: a CA, a node certificate for 127.0.0.1 (IP SAN; Redis uses it
/// as server and, in a Cluster, as client of the bus), a client certificate, and a second,
/// unrelated CA.
struct Pki {
    dir: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("the `openssl` CLI is needed to make test certificates: {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Pki {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("tollgate-pki-{}", common::unique("tls")));
        std::fs::create_dir_all(&dir).unwrap();
        for ca in ["ca", "other-ca"] {
            openssl(
                &dir,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:prime256v1",
                    "-nodes",
                    "-keyout",
                    &format!("{ca}.key"),
                    "-out",
                    &format!("{ca}.crt"),
                    "-days",
                    "2",
                    "-subj",
                    &format!("/CN=tollgate test {ca}"),
                    "-addext",
                    "basicConstraints=critical,CA:TRUE",
                    "-addext",
                    "keyUsage=critical,keyCertSign,cRLSign",
                ],
            );
        }
        let leaf = |name: &str, ext: &str, serial: &str| {
            openssl(
                &dir,
                &[
                    "req",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:prime256v1",
                    "-nodes",
                    "-keyout",
                    &format!("{name}.key"),
                    "-out",
                    &format!("{name}.csr"),
                    "-subj",
                    &format!("/CN={name}"),
                ],
            );
            std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
            openssl(
                &dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{name}.csr"),
                    "-CA",
                    "ca.crt",
                    "-CAkey",
                    "ca.key",
                    "-set_serial",
                    serial,
                    "-days",
                    "2",
                    "-out",
                    &format!("{name}.crt"),
                    "-extfile",
                    &format!("{name}.ext"),
                ],
            );
        };
        leaf(
            "node",
            "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n",
            "2",
        );
        leaf(
            "client",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n",
            "3",
        );
        Pki { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_str().unwrap().to_string()
    }

    fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(name)).unwrap()
    }

    /// The private CA only.
    fn ca_only(&self) -> RedisTls {
        RedisTls {
            ca: Some(self.read("ca.crt")),
            client: None,
        }
    }

    /// The private CA and the client certificate.
    fn mutual(&self) -> RedisTls {
        RedisTls {
            ca: Some(self.read("ca.crt")),
            client: Some(ClientIdentity {
                cert: self.read("client.crt"),
                key: self.read("client.key"),
            }),
        }
    }

    /// A redis-server that only speaks TLS on a free port (`--port 0`), with extra arguments.
    fn redis(&self, auth_clients: bool, extra: &[&str]) -> RedisProc {
        let (crt, key, ca) = (
            self.path("node.crt"),
            self.path("node.key"),
            self.path("ca.crt"),
        );
        let mut args = vec![
            "--port",
            "0",
            "--tls-port",
            "",
            "--tls-cert-file",
            &crt,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            if auth_clients { "yes" } else { "no" },
        ];
        let port = common::free_port();
        let port_s = port.to_string();
        args[3] = &port_s;
        args.extend_from_slice(extra);
        RedisProc::start_with_cli(
            port,
            &args,
            &["--tls", "--cacert", &ca, "--cert", &crt, "--key", &key],
        )
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn tls_store(url: &str, tls: Option<RedisTls>, timeout_ms: u64) -> RedisStore {
    RedisStore::new(RedisConfig {
        key_prefix: "tls:".into(),
        tls,
        ..common::redis_config(Some(url.to_string()), vec![], timeout_ms)
    })
    .expect("redis store")
}

async fn status_of(client: &reqwest::Client, svc: &Service, path: &str) -> u16 {
    client
        .get(svc.url(path))
        .send()
        .await
        .expect("GET")
        .status()
        .as_u16()
}

/// Capacity 3, refilled once an hour: three takes with 2, 1, 0 left, then denied.
async fn three_then_denied(client: &reqwest::Client, svc: &Service, key: &str) {
    let body = json!({"buckets": [bucket(key, 3, 3, 3_600_000, 1)]});
    for left in [2, 1, 0] {
        let (status, v) = post_take(client, svc, &body).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["allowed"], true, "{v}");
        assert_eq!(v["buckets"][0]["remaining"], left, "{v}");
    }
    let (status, v) = post_take(client, svc, &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["allowed"], false, "the fourth take is denied: {v}");
}

/// A take that must fail: 503 `unavailable` (never allowed), and /readyz 503. `why`: a part of
/// the error message that shows it failed for the expected reason (the TLS alert or check).
async fn unavailable(client: &reqwest::Client, svc: &Service, what: &str, why: Option<&str>) {
    let body = json!({"buckets": [bucket("refused", 1000, 1000, 3_600_000, 1)]});
    for _ in 0..3 {
        let (status, v) = post_take(client, svc, &body).await;
        assert_eq!(status, 503, "{what}: {v}");
        assert_eq!(v["error"]["code"], "unavailable", "{what}: {v}");
        if let Some(why) = why {
            // The caller is told only that the store is unavailable; the store's own error,
            // which goes to the log, says why.
            let msg = v["error"]["message"].as_str().unwrap_or_default();
            assert!(
                !msg.contains(why),
                "{what}: {why:?} reached the caller: {v}"
            );
            let spec =
                take::validate(take::decode_json(body.to_string().as_bytes()).unwrap()).unwrap();
            let detail = svc.store.take(&spec).await.expect_err(what).to_string();
            assert!(detail.contains(why), "{what}: expected {why:?} in {detail}");
        }
    }
    // /readyz answers from a check refreshed every 50 ms here.
    let deadline = Instant::now() + Duration::from_secs(5);
    while status_of(client, svc, "/readyz").await != 503 {
        assert!(Instant::now() < deadline, "{what}: /readyz still 200");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_ca_makes_takes_work_and_exact() {
    let pki = Pki::new();
    let r = pki.redis(false, &[]);
    let url = format!("rediss://127.0.0.1:{}", r.port);
    let svc = Service::start(Arc::new(tls_store(&url, Some(pki.ca_only()), 1000)), None).await;
    let client = reqwest::Client::new();

    // The first take pays the TCP connect and the TLS handshake; later ones reuse the connection.
    let body = json!({"buckets": [bucket("first", 10, 10, 3_600_000, 1)]});
    let t = Instant::now();
    let (status, v) = post_take(&client, &svc, &body).await;
    let first = t.elapsed();
    assert_eq!((status, &v["allowed"]), (200, &json!(true)), "{v}");
    let t = Instant::now();
    let n = 20;
    for _ in 0..n {
        assert_eq!(post_take(&client, &svc, &body).await.0, 200);
    }
    let warm = t.elapsed() / n;
    eprintln!("rediss:// with a private CA: first take (connect + handshake) {first:?}, then {warm:?} per take");

    three_then_denied(&client, &svc, "exact").await;
    assert_eq!(status_of(&client, &svc, "/readyz").await, 200);

    // What a (re)connect costs: a fresh store's first PING (connect, handshake, PING), plain TCP
    // against TLS; medians of 9.
    let plain = RedisProc::start();
    let cases = [
        ("redis://", plain.url(), None),
        ("rediss:// (private CA)", url.clone(), Some(pki.ca_only())),
    ];
    for (what, u, tls) in cases {
        let mut t = Vec::new();
        for _ in 0..9 {
            let s = tls_store(&u, tls.clone(), 1000);
            let start = Instant::now();
            s.ping().await.expect("ping");
            t.push(start.elapsed());
        }
        t.sort();
        eprintln!(
            "{what}: first PING on a fresh connection {:?} (median of 9)",
            t[4]
        );
    }

    // Redis restarts (same port, same certificates): the service reconnects, handshake included.
    let mut r = r;
    r.kill();
    unavailable(&client, &svc, "TLS Redis down", None).await;
    r.restart();
    let deadline = Instant::now() + Duration::from_secs(5);
    while status_of(&client, &svc, "/readyz").await != 200 {
        assert!(Instant::now() < deadline, "no recovery after the restart");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    three_then_denied(&client, &svc, "after-restart").await;
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_private_ca_the_store_is_unavailable() {
    let pki = Pki::new();
    let r = pki.redis(false, &[]);
    let url = format!("rediss://127.0.0.1:{}", r.port);
    let client = reqwest::Client::new();

    // Public (webpki) roots: the private CA is unknown.
    let svc = Service::start(Arc::new(tls_store(&url, None, 200)), None).await;
    unavailable(&client, &svc, "public roots only", Some("UnknownIssuer")).await;
    svc.stop().await;

    // Another CA: the server's chain does not lead to it.
    let other = RedisTls {
        ca: Some(pki.read("other-ca.crt")),
        client: None,
    };
    let svc = Service::start(Arc::new(tls_store(&url, Some(other), 200)), None).await;
    unavailable(&client, &svc, "another CA", Some("UnknownIssuer")).await;
    svc.stop().await;

    // Plain TCP to a TLS port.
    let plain = format!("redis://127.0.0.1:{}", r.port);
    let svc = Service::start(Arc::new(tls_store(&plain, None, 200)), None).await;
    unavailable(&client, &svc, "redis:// to a TLS port", None).await;
    svc.stop().await;

    // Nothing was charged by the failed attempts, and the right CA works on the same server.
    let svc = Service::start(Arc::new(tls_store(&url, Some(pki.ca_only()), 1000)), None).await;
    three_then_denied(&client, &svc, "after-refusals").await;
    svc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_needs_the_client_certificate() {
    let pki = Pki::new();
    let r = pki.redis(true, &[]);
    let url = format!("rediss://127.0.0.1:{}", r.port);
    let client = reqwest::Client::new();

    let svc = Service::start(Arc::new(tls_store(&url, Some(pki.ca_only()), 300)), None).await;
    unavailable(
        &client,
        &svc,
        "no client certificate",
        Some("CertificateRequired"),
    )
    .await;
    svc.stop().await;

    let svc = Service::start(Arc::new(tls_store(&url, Some(pki.mutual()), 1000)), None).await;
    three_then_denied(&client, &svc, "mtls").await;
    assert_eq!(status_of(&client, &svc, "/readyz").await, 200);
    svc.stop().await;
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_tollgate-server")
}

/// The binary, killed on drop; stdout and stderr gathered by reader threads.
struct Bin {
    child: Child,
    lines: mpsc::Receiver<String>,
    readers: Vec<std::thread::JoinHandle<String>>,
}

impl Bin {
    fn start(envs: &[(&str, String)]) -> Self {
        let mut cmd = Command::new(bin());
        cmd.env_remove("TOLLGATE_REDIS_CLUSTER")
            .env("RUST_LOG", "debug")
            .env("TOLLGATE_LOG_FORMAT", "json");
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel::<String>();
        let mut readers = Vec::new();
        let out: Box<dyn std::io::Read + Send> = Box::new(child.stdout.take().unwrap());
        let err: Box<dyn std::io::Read + Send> = Box::new(child.stderr.take().unwrap());
        for stream in [out, err] {
            let tx = tx.clone();
            readers.push(std::thread::spawn(move || {
                let mut all = String::new();
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = tx.send(line.clone());
                    all.push_str(&line);
                    all.push('\n');
                }
                all
            }));
        }
        Bin {
            child,
            lines,
            readers,
        }
    }

    fn wait_listening(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(10))
                .expect("a log line");
            if line.contains("listening") {
                return;
            }
            assert!(Instant::now() < deadline, "no `listening` line");
        }
    }

    /// Waits for the exit (at most 10 s) and returns the status and everything it printed.
    fn finish(mut self, stop: bool) -> (std::process::ExitStatus, String) {
        if stop {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("tollgate-server did not exit");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let logs = self
            .readers
            .drain(..)
            .map(|r| r.join().unwrap())
            .collect::<String>();
        (status, logs)
    }
}

impl Drop for Bin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The binary over mutual TLS with a password in the URL: it serves, and the password shows in no
/// log line, neither while it works nor while the handshake fails.
#[test]
fn binary_over_mutual_tls_keeps_the_password_out_of_logs() {
    let pki = Pki::new();
    let secret = "tls-pa55-word-q9";
    let r = pki.redis(true, &["--requirepass", secret]);
    let url = format!("rediss://:{secret}@127.0.0.1:{}", r.port);
    let rt = tokio::runtime::Runtime::new().unwrap();
    for mutual in [true, false] {
        let port = common::free_port();
        let mut envs = vec![
            ("TOLLGATE_LISTEN", format!("127.0.0.1:{port}")),
            ("TOLLGATE_REDIS_URL", url.clone()),
            ("TOLLGATE_REDIS_TLS_CA", pki.path("ca.crt")),
        ];
        if mutual {
            envs.push(("TOLLGATE_REDIS_TLS_CERT", pki.path("client.crt")));
            envs.push(("TOLLGATE_REDIS_TLS_KEY", pki.path("client.key")));
        }
        let b = Bin::start(&envs);
        b.wait_listening();
        let (take, ready) = rt.block_on(async {
            let client = reqwest::Client::new();
            let body = json!({"buckets": [{"key": "bin-tls", "capacity": 5, "period_ms": 60000}]});
            let r = client
                .post(format!("http://127.0.0.1:{port}/v1/take"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let take = (
                r.status().as_u16(),
                r.json::<serde_json::Value>().await.unwrap(),
            );
            // /readyz answers from a check refreshed every second: wait for the one after the
            // take (the check at startup may have raced the first handshake).
            let want = if mutual { 200 } else { 503 };
            let deadline = Instant::now() + Duration::from_secs(5);
            let ready = loop {
                let ready = client
                    .get(format!("http://127.0.0.1:{port}/readyz"))
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16();
                if ready == want || Instant::now() > deadline {
                    break ready;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            (take, ready)
        });
        let (status, logs) = b.finish(true);
        if mutual {
            assert_eq!(take.0, 200, "{take:?}\n{logs}");
            assert_eq!(take.1["allowed"], true, "{take:?}");
            assert_eq!(ready, 200);
            assert!(status.success(), "{status:?}\n{logs}");
        } else {
            assert_eq!(take.0, 503, "no client certificate: {take:?}\n{logs}");
            assert_eq!(ready, 503);
        }
        assert!(!logs.contains(secret), "password leaked:\n{logs}");
        assert!(logs.contains("rediss://:***@127.0.0.1"), "{logs}");
    }
}

/// Bad TLS flags stop the binary at startup with an error that names the flag.
#[test]
fn bad_tls_flags_are_refused_naming_the_flag() {
    let pki = Pki::new();
    std::fs::write(pki.dir.join("junk.pem"), "not a certificate\n").unwrap();
    let tls_url = "rediss://127.0.0.1:1".to_string();
    let missing = pki.path("missing.pem");
    // (environment beyond a rediss:// URL, what the error must mention)
    type Case<'a> = (Vec<(&'a str, String)>, Vec<&'a str>);
    let cases: Vec<Case> = vec![
        (
            vec![("TOLLGATE_REDIS_TLS_CA", missing.clone())],
            vec!["--redis-tls-ca", "missing.pem", "cannot read"],
        ),
        (
            vec![("TOLLGATE_REDIS_TLS_CA", pki.path("junk.pem"))],
            vec!["--redis-tls-ca", "junk.pem", "no PEM certificate"],
        ),
        (
            vec![("TOLLGATE_REDIS_TLS_CA", pki.path("ca.key"))],
            vec!["--redis-tls-ca", "no PEM certificate"],
        ),
        (
            vec![("TOLLGATE_REDIS_TLS_CERT", pki.path("client.crt"))],
            vec!["--redis-tls-cert needs --redis-tls-key"],
        ),
        (
            vec![("TOLLGATE_REDIS_TLS_KEY", pki.path("client.key"))],
            vec!["--redis-tls-key needs --redis-tls-cert"],
        ),
        (
            vec![
                ("TOLLGATE_REDIS_TLS_CERT", pki.path("client.crt")),
                ("TOLLGATE_REDIS_TLS_KEY", pki.path("node.key")),
            ],
            vec![
                "--redis-tls-key",
                "does not belong to the client certificate",
            ],
        ),
        (
            vec![
                ("TOLLGATE_REDIS_TLS_CERT", pki.path("client.crt")),
                ("TOLLGATE_REDIS_TLS_KEY", pki.path("junk.pem")),
            ],
            vec!["--redis-tls-key", "junk.pem"],
        ),
        (
            vec![
                ("TOLLGATE_REDIS_TLS_CERT", pki.path("client.key")),
                ("TOLLGATE_REDIS_TLS_KEY", pki.path("client.key")),
            ],
            vec!["--redis-tls-cert", "no PEM certificate"],
        ),
        (
            vec![
                ("TOLLGATE_REDIS_URL", "redis://:hide-me@127.0.0.1:1".into()),
                ("TOLLGATE_REDIS_TLS_CA", pki.path("ca.crt")),
            ],
            vec![
                "--redis-tls-ca",
                "--redis-url",
                "redis://:***@127.0.0.1:1",
                "rediss://",
            ],
        ),
        (
            vec![
                (
                    "TOLLGATE_REDIS_CLUSTER",
                    "rediss://127.0.0.1:1,redis://127.0.0.1:2".into(),
                ),
                ("TOLLGATE_REDIS_TLS_CA", pki.path("ca.crt")),
            ],
            vec!["--redis-tls-ca", "--redis-cluster", "redis://127.0.0.1:2"],
        ),
    ];
    for (env, expected) in cases {
        let port = common::free_port();
        let mut envs = vec![
            ("TOLLGATE_LISTEN", format!("127.0.0.1:{port}")),
            ("TOLLGATE_REDIS_URL", tls_url.clone()),
        ];
        envs.extend(env.iter().cloned());
        let (status, logs) = Bin::start(&envs).finish(false);
        assert!(!status.success(), "{env:?} was accepted:\n{logs}");
        for e in &expected {
            assert!(logs.contains(e), "{env:?}: no {e:?} in:\n{logs}");
        }
        assert!(
            !logs.contains("hide-me") && !logs.contains("listening"),
            "{logs}"
        );
    }
    // No Redis at all (memory store) and a TLS flag: refused too.
    let port = common::free_port();
    let mut cmd = Command::new(bin());
    let out = cmd
        .env_remove("TOLLGATE_REDIS_URL")
        .env_remove("TOLLGATE_REDIS_CLUSTER")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--redis-tls-ca", &pki.path("ca.crt")])
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("--redis-tls-ca") && all.contains("no Redis"),
        "{all}"
    );
}

/// Three TLS-only masters with a TLS cluster bus, created by `redis-cli --tls --cluster create`:
/// takes over rediss:// seed nodes with the private CA and a client certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_redis_cluster_with_a_private_ca() {
    let pki = Pki::new();
    let nodes: Vec<RedisProc> = (0..3)
        .map(|_| {
            // The cluster bus on a free port of its own, not `port + 10000`.
            let bus = common::free_port().to_string();
            pki.redis(
                true,
                &[
                    "--tls-cluster",
                    "yes",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-port",
                    &bus,
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ],
            )
        })
        .collect();
    let (ca, cert, key) = (
        pki.path("ca.crt"),
        pki.path("node.crt"),
        pki.path("node.key"),
    );
    common::create_cluster(
        &nodes,
        &["--tls", "--cacert", &ca, "--cert", &cert, "--key", &key],
    );
    let cluster = vec![format!("rediss://127.0.0.1:{}", nodes[0].port)];
    let store = RedisStore::new(RedisConfig {
        key_prefix: "tls:".into(),
        tls: Some(pki.mutual()),
        ..common::redis_config(None, cluster.clone(), 1000)
    })
    .expect("cluster store");
    assert_eq!(store.kind(), "redis-cluster");
    let svc = Service::start(Arc::new(store), None).await;
    let client = reqwest::Client::new();
    // Keys on every master (different slots): each one exact.
    for k in ["a", "b", "c", "d"] {
        three_then_denied(&client, &svc, &format!("cluster-{k}")).await;
    }
    // One request over two slots: all or nothing.
    let body = json!({"buckets": [
        bucket("cluster-two-1", 5, 5, 3_600_000, 1),
        bucket("cluster-two-2", 5, 5, 3_600_000, 1)
    ]});
    let (status, v) = post_take(&client, &svc, &body).await;
    assert_eq!((status, &v["allowed"]), (200, &json!(true)), "{v}");
    assert_eq!(status_of(&client, &svc, "/readyz").await, 200);
    svc.stop().await;

    // Without the client certificate the cluster cannot be reached.
    let store = RedisStore::new(RedisConfig {
        key_prefix: "tls:".into(),
        tls: Some(pki.ca_only()),
        ..common::redis_config(None, cluster, 300)
    })
    .expect("cluster store");
    let svc = Service::start(Arc::new(store), None).await;
    unavailable(
        &client,
        &svc,
        "cluster without client certificate",
        Some("CertificateRequired"),
    )
    .await;
    svc.stop().await;
}

/// Redis Sentinel over TLS, as most Redis charts deploy it with TLS on: the real binary finds the
/// master through `rediss://` sentinels (the private CA its only TLS file), decides on it over TLS,
/// and after a failover decides on the new master with every count kept.
#[test]
fn sentinel_over_tls_decides_on_the_master_and_follows_a_failover() {
    use tollgate_testkit::redis::{SentinelSetup, SentinelTls};
    let pki = Pki::new();
    let tls = SentinelTls {
        cert: pki.path("node.crt"),
        key: pki.path("node.key"),
        ca: pki.path("ca.crt"),
    };
    let name = "tls-master";
    let mut setup = SentinelSetup::start_tls(name, &tls);
    let urls = setup.sentinel_urls();
    assert!(urls.iter().all(|u| u.starts_with("rediss://")), "{urls:?}");
    let port = common::free_port();
    let b = Bin::start(&[
        ("TOLLGATE_LISTEN", format!("127.0.0.1:{port}")),
        ("TOLLGATE_REDIS_SENTINEL", urls.join(",")),
        ("TOLLGATE_REDIS_SENTINEL_MASTER", name.to_string()),
        ("TOLLGATE_REDIS_TLS_CA", pki.path("ca.crt")),
        // The point is TLS, not the timeout: a busy machine may need more than 50 ms.
        ("TOLLGATE_REDIS_TIMEOUT_MS", "1000".to_string()),
    ]);
    b.wait_listening();
    let old = setup.master().expect("a master");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = reqwest::Client::new();
    let body = json!({"buckets": [{"key": "sentinel-tls", "capacity": 3, "rate": 1, "period_ms": 3_600_000}]});
    // Takes until one is decided (a failover answers 503 for a moment); whether it was allowed.
    let take = || {
        rt.block_on(async {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let r = client
                    .post(format!("http://127.0.0.1:{port}/v1/take"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                let v = r.json::<serde_json::Value>().await.unwrap_or_default();
                if status == 200 {
                    return v["allowed"] == true;
                }
                assert!(
                    Instant::now() < deadline,
                    "no decision within 10 s: {status} {v}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    assert!(take());
    assert!(take());
    // The writes reached the master over TLS: its key is there, read with the CA alone.
    let keys = setup.cli(old, &["KEYS", "*"]).unwrap_or_default();
    assert!(
        keys.contains("sentinel-tls"),
        "keys on the master: {keys:?}"
    );
    assert!(
        setup.wait_replicated(old, Duration::from_secs(10)),
        "the replica did not catch up"
    );
    // The master dies (so no write can land on it any more) and its replica is promoted.
    setup.kill_node(old);
    assert!(setup.failover(), "SENTINEL FAILOVER refused");
    let (new, _) = crate::redis_sentinel::wait_switched(&setup, old, Duration::from_secs(30));
    // The new master holds the count: one token left of three, then denied.
    assert!(take(), "the third token, on the new master");
    assert!(!take(), "a fourth take after the failover was allowed");
    let (_, logs) = b.finish(true);
    assert!(
        logs.contains(&format!("127.0.0.1:{new}")),
        "the service never named the new master:\n{logs}"
    );
}
