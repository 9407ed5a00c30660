//! The real `tollgate-server` binary: flags and env vars, the `listening` line, a take, a graceful
//! exit on SIGTERM, and no secret in its logs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::RedisProc;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_tollgate-server")
}

#[test]
fn help_documents_every_flag_and_env_var() {
    let out = Command::new(bin()).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for s in [
        "--listen",
        "TOLLGATE_LISTEN",
        "--redis-url",
        "TOLLGATE_REDIS_URL",
        "--redis-cluster",
        "TOLLGATE_REDIS_CLUSTER",
        "--key-prefix",
        "TOLLGATE_KEY_PREFIX",
        "--redis-timeout-ms",
        "TOLLGATE_REDIS_TIMEOUT_MS",
        "--redis-tls-ca",
        "TOLLGATE_REDIS_TLS_CA",
        "--redis-tls-cert",
        "TOLLGATE_REDIS_TLS_CERT",
        "--redis-tls-key",
        "TOLLGATE_REDIS_TLS_KEY",
        "--token",
        "TOLLGATE_TOKEN",
        "--log-format",
        "TOLLGATE_LOG_FORMAT",
    ] {
        assert!(help.contains(s), "--help lacks {s}:\n{help}");
    }
}

#[test]
fn serves_logs_without_secrets_and_stops_on_sigterm() {
    let redis = RedisProc::start_on(common::free_port(), &["--requirepass", "pa55-word-xyz"]);
    let port = common::free_port();
    let mut child = Command::new(bin())
        .env("TOLLGATE_LISTEN", format!("127.0.0.1:{port}"))
        .env(
            "TOLLGATE_REDIS_URL",
            format!("redis://:pa55-word-xyz@127.0.0.1:{}", redis.port),
        )
        .env("TOLLGATE_TOKEN", "tok-secret-123")
        .env("TOLLGATE_LOG_FORMAT", "json")
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a log line");
        if line.contains("listening") {
            assert!(line.contains(&format!("127.0.0.1:{port}")), "{line}");
            break;
        }
        assert!(Instant::now() < deadline, "no `listening` line");
    }
    // One take with the token, one without.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = reqwest::Client::new();
        let url = format!("http://127.0.0.1:{port}/v1/take");
        let body =
            serde_json::json!({"buckets": [{"key": "bin", "capacity": 2, "period_ms": 1000}]});
        let r = client
            .post(&url)
            .bearer_auth("tok-secret-123")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let r = client.post(&url).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 401);
        let r = client
            .get(format!("http://127.0.0.1:{port}/readyz"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    });
    let t = Instant::now();
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            panic!("did not stop within 5 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status:?}");
    let logs = reader.join().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    for secret in ["pa55-word-xyz", "tok-secret-123"] {
        assert!(
            !logs.contains(secret) && !err.contains(secret),
            "{secret} leaked:\n{logs}{err}"
        );
    }
    assert!(logs.contains("redis://:***@127.0.0.1"), "{logs}");
}
