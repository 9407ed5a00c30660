//! The real `tollgate-server` binary: flags and env vars, the `listening` line, a take, a graceful
//! exit on SIGTERM, no secret in its logs (Redis URLs of any shape), the token from a file.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::binary::{bin, run_to_end, ServerProc};
use common::RedisProc;

/// The takes' token the binary is started with: one it accepts (32 bytes or more, no placeholder).
const TOKEN: &str = "tok-secret-123-4a6c8e0f2b4d6f8a1c3e";

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
        "--runtime",
        "TOLLGATE_RUNTIME",
        "--token-file",
        "TOLLGATE_TOKEN_FILE",
        "--max-in-flight",
        "TOLLGATE_MAX_IN_FLIGHT",
        "--max-connections",
        "TOLLGATE_MAX_CONNECTIONS",
        "--header-timeout-ms",
        "TOLLGATE_HEADER_TIMEOUT_MS",
        "--body-timeout-ms",
        "TOLLGATE_BODY_TIMEOUT_MS",
        "--idle-timeout-ms",
        "TOLLGATE_IDLE_TIMEOUT_MS",
        "--http2-max-streams",
        "TOLLGATE_HTTP2_MAX_STREAMS",
        "--ready-interval-ms",
        "TOLLGATE_READY_INTERVAL_MS",
        "--memory-max-buckets",
        "TOLLGATE_MEMORY_MAX_BUCKETS",
        "--otlp-endpoint",
        "TOLLGATE_OTLP_ENDPOINT",
        "--otlp-sample-ratio",
        "TOLLGATE_OTLP_SAMPLE_RATIO",
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
        .env("TOLLGATE_TOKEN", TOKEN)
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
            .bearer_auth(TOKEN)
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
    for secret in ["pa55-word-xyz", TOKEN] {
        assert!(
            !logs.contains(secret) && !err.contains(secret),
            "{secret} leaked:\n{logs}{err}"
        );
    }
    assert!(logs.contains("redis://:***@127.0.0.1"), "{logs}");
}

/// Redis URLs of every shape, parseable or not: the password never shows in the logs, and a
/// failed take tells the caller only that the store is unavailable (no address, no Redis text).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_urls_of_any_shape_never_show_their_password() {
    let dead = common::free_port();
    let cases = [
        (format!("redis://:ab/cd@127.0.0.1:{dead}"), "ab/cd"),
        (format!("redis://:p#w0rd-x@127.0.0.1:{dead}"), "p#w0rd-x"),
        (format!("redis://:q?w0rd-y@127.0.0.1:{dead}"), "q?w0rd-y"),
        (format!("redis://user:pa55@wd@127.0.0.1:{dead}"), "pa55@wd"),
        (format!("redis://:s3cr%2Fet-z@127.0.0.1:{dead}/0"), "s3cr"),
        (format!("rediss://u:tls-pa55@127.0.0.1:{dead}"), "tls-pa55"),
        (
            "unix:///nonexistent/r.sock?db=0&pass=sock-pa55".to_string(),
            "sock-pa55",
        ),
    ];
    let client = reqwest::Client::new();
    let mut served = 0;
    for (url, secret) in &cases {
        let port = common::free_port();
        let listen = format!("127.0.0.1:{port}");
        let args = [
            "--listen",
            &listen,
            "--redis-url",
            url,
            "--redis-timeout-ms",
            "100",
            "--log-format",
            "json",
        ];
        let mut child = Command::new(bin())
            .args(args)
            .env("RUST_LOG", "debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Started (parseable URL) or refused (not): wait for either.
        let deadline = Instant::now() + Duration::from_secs(10);
        let listening = loop {
            if child.try_wait().unwrap().is_some() {
                break false;
            }
            if std::net::TcpStream::connect(&listen).is_ok() {
                break true;
            }
            assert!(
                Instant::now() < deadline,
                "{url}: neither listening nor exited"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut answer = String::new();
        if listening {
            served += 1;
            let body =
                serde_json::json!({"buckets": [{"key": "k", "capacity": 1, "period_ms": 1000}]});
            let r = client
                .post(format!("http://{listen}/v1/take"))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 503, "{url}");
            answer = r.text().await.unwrap();
            assert!(answer.contains("\"unavailable\""), "{url}: {answer}");
            assert!(!answer.contains("127.0.0.1"), "{url}: {answer}");
            let _ = child.kill();
        }
        let out = child.wait_with_output().unwrap();
        let logs = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !logs.contains(secret) && !answer.contains(secret),
            "{secret} of {url} leaked:\n{logs}{answer}"
        );
        assert!(
            logs.contains("***"),
            "{url}: the URL is not shown redacted:\n{logs}"
        );
    }
    assert_eq!(served, 4, "the four URLs that parse start the service");
}

/// `--token-file`: the token is read from a file (trailing newline ignored), is not on the
/// command line, and is required; an empty file or both --token and --token-file stop startup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_from_a_file() {
    let dir = std::env::temp_dir().join(format!("tollgate-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    std::fs::write(&file, "file-tok-9f8e7d6c5b4a39281706f5e4d3c2b1a0\n").unwrap();
    let path = file.to_str().unwrap();
    let svc = ServerProc::start(&["--token-file", path]);
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", svc.pid())).unwrap();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains("file-tok-9f8e7d6c5b4a39281706f5e4d3c2b1a0")
    );
    let client = reqwest::Client::new();
    let body = serde_json::json!({"buckets": [{"key": "k", "capacity": 1, "period_ms": 1000}]});
    let r = client
        .post(svc.url("/v1/take"))
        .bearer_auth("file-tok-9f8e7d6c5b4a39281706f5e4d3c2b1a0")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = client
        .post(svc.url("/v1/take"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    drop(svc);

    let (ok, out) = run_to_end(
        &["--token", "x", "--token-file", path],
        Duration::from_secs(5),
    );
    assert!(!ok && out.contains("--token-file"), "{out}");
    std::fs::write(&file, "\n").unwrap();
    let (ok, out) = run_to_end(&["--token-file", path], Duration::from_secs(5));
    assert!(!ok && out.contains("empty"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A token that is no secret stops startup (exit status non-zero) with a line that names the
/// flags and says how to make one, and does not show the token: the placeholder the chart and
/// deploy/ once shipped, by flag, by variable or in a file; a short one; and either as the admin
/// token.
#[test]
fn a_placeholder_or_short_token_stops_startup() {
    let dir = std::env::temp_dir().join(format!("tollgate-weak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    std::fs::write(&file, "replace-with-a-long-random-token\n").unwrap();
    let path = file.to_str().unwrap();
    let run = |args: &[&str], env: Option<(&str, &str)>| {
        let mut cmd = Command::new(bin());
        cmd.args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("TOLLGATE_TOKEN")
            .env_remove("TOLLGATE_ADMIN_TOKEN")
            .env_remove("TOLLGATE_REDIS_URL");
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        // A binary that accepted the token would serve until killed: the limit turns that into a
        // failure instead of a hang.
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("{args:?} {env:?}: still serving after 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let shown = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "{args:?} {env:?}: exit 0\n{shown}");
        assert!(
            shown.contains("make one with `openssl rand -hex 32`"),
            "{args:?} {env:?}:\n{shown}"
        );
        shown
    };
    let placeholder = "is a placeholder (it contains \"replace-with\"), not a secret";
    let bearer = "the bearer token (--token, TOLLGATE_TOKEN or --token-file)";
    for (args, env) in [
        (&["--token", "replace-with-a-long-random-token"][..], None),
        (
            &[][..],
            Some(("TOLLGATE_TOKEN", "replace-with-a-long-random-token")),
        ),
        (&["--token-file", path][..], None),
    ] {
        let shown = run(args, env);
        assert!(
            shown.contains(&format!("{bearer} {placeholder}")),
            "{args:?} {env:?}:\n{shown}"
        );
    }
    let shown = run(&[], Some(("TOLLGATE_TOKEN", "tok-secret-123")));
    assert!(
        shown.contains(&format!(
            "{bearer} is 14 bytes long, too short to be a secret (at least 32)"
        )),
        "{shown}"
    );
    assert!(
        !shown.contains("tok-secret-123"),
        "the token shown:\n{shown}"
    );

    let admin = "the admin token (--admin-token, TOLLGATE_ADMIN_TOKEN or --admin-token-file)";
    let shown = run(
        &["--token", TOKEN],
        Some(("TOLLGATE_ADMIN_TOKEN", "replace-with-a-long-random-token")),
    );
    assert!(shown.contains(&format!("{admin} {placeholder}")), "{shown}");
    let shown = run(&["--token", TOKEN, "--admin-token", "admin-123"], None);
    assert!(
        shown.contains(&format!(
            "{admin} is 9 bytes long, too short to be a secret (at least 32)"
        )),
        "{shown}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
