//! Redis Sentinel with real processes: a master, its replica and three sentinels (testkit's
//! `SentinelSetup`). Decisions go to the master the sentinels name; after `SENTINEL FAILOVER` they
//! go to the promoted replica, with the counts replication carried over, and in between clients
//! see 503 at worst, never "allowed" from nowhere.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::binary::ServerProc;
use common::{bucket, post_take, Service};
use serde_json::json;
use tollgate_server::domain::{Algorithm, BucketSpec};
use tollgate_server::store::redis::{RedisStore, SentinelConfig};
use tollgate_server::store::Store;
use tollgate_testkit::redis::SentinelSetup;

const NAME: &str = "tollgate-master";

/// One Sentinel setup at a time: each is five processes whose failover timing (sentinels' pings,
/// INFO every second during a failover) suffers when several compete for a busy machine.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn store(setup: &SentinelSetup, timeout_ms: u64) -> RedisStore {
    store_with(setup, setup.sentinel_urls(), None, timeout_ms)
}

fn store_with(
    setup: &SentinelSetup,
    sentinels: Vec<String>,
    master_password: Option<&str>,
    timeout_ms: u64,
) -> RedisStore {
    RedisStore::with_sentinel(
        common::redis_config(None, vec![], timeout_ms),
        &SentinelConfig {
            sentinels,
            master: setup.name.clone(),
            master_password: master_password.map(str::to_string),
        },
    )
    .expect("sentinel store")
}

/// A token bucket that never refills during a test: every count stays visible.
fn hourly(key: &str, capacity: u64) -> BucketSpec {
    BucketSpec {
        key: key.into(),
        capacity,
        rate: 1,
        period_ms: 3_600_000,
        cost: 1,
        algorithm: Algorithm::TokenBucket,
        lease: 1,
        max_delay_ms: 0,
    }
}

fn keys_on(setup: &SentinelSetup, port: u16) -> String {
    setup.cli(port, &["KEYS", "*"]).unwrap_or_default()
}

/// Waits until the sentinels name a master other than `old`; the new master's port and how
/// long it took.
pub(crate) fn wait_switched(setup: &SentinelSetup, old: u16, limit: Duration) -> (u16, Duration) {
    let t = Instant::now();
    let new = setup.other(old);
    assert!(
        tollgate_testkit::process::eventually(limit, || setup.master() == Some(new)),
        "the sentinels still name {old} after {limit:?}"
    );
    (new, t.elapsed())
}

/// Whether the node on `port` is a replica now.
fn demoted(setup: &SentinelSetup, port: u16) -> bool {
    setup
        .cli(port, &["ROLE"])
        .is_some_and(|r| r.starts_with("slave"))
}

/// Takes `b` until a take is decided (at most 1 s of failures); the decision and the failures.
async fn decided(
    s: &RedisStore,
    b: &BucketSpec,
) -> (tollgate_server::domain::TakeResponse, Vec<String>) {
    let since = Instant::now();
    let mut failed = Vec::new();
    loop {
        match s.take(std::slice::from_ref(b)).await {
            Ok(d) => return (d, failed),
            Err(e) => failed.push(e.to_string()),
        }
        assert!(
            since.elapsed() < Duration::from_secs(1),
            "no decision within 1 s: {failed:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn decides_on_the_master_the_sentinels_name() {
    let _one = ONE_AT_A_TIME.lock().await;
    let setup = SentinelSetup::start(NAME, &[]);
    let master = setup.master().expect("a master");
    assert_eq!(master, setup.nodes[0]);
    let s = Arc::new(store(&setup, 500));
    assert_eq!(s.kind(), "redis-sentinel");
    s.ping().await.expect("PING through the sentinels");

    let b = hourly("one", 3);
    for left in [2, 1, 0] {
        let d = s.take(std::slice::from_ref(&b)).await.unwrap();
        assert!(d.allowed);
        assert_eq!(d.buckets[0].remaining, left);
    }
    assert!(!s.take(std::slice::from_ref(&b)).await.unwrap().allowed);
    // A batch, as the coalescer sends them: one script run on the master.
    let batch = s
        .take_batch(&[vec![hourly("two", 1)], vec![hourly("two", 1)]])
        .await
        .unwrap();
    assert_eq!(
        batch.iter().map(|d| d.allowed).collect::<Vec<_>>(),
        [true, false]
    );
    // The buckets live on the master (and reach its replica), nowhere else.
    let on_master = keys_on(&setup, master);
    assert!(
        on_master.contains("one") && on_master.contains("two"),
        "{on_master}"
    );
    assert!(setup.wait_replicated(master, Duration::from_secs(5)));
    assert!(keys_on(&setup, setup.other(master)).contains("one"));

    // Through the service: JSON answers as with any Redis.
    let svc = Service::start(s.clone(), None).await;
    let client = reqwest::Client::new();
    let body = json!({"buckets": [bucket("svc", 2, 1, 3_600_000, 1)]});
    let answers: Vec<bool> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            let (status, a) = post_take(&client, &svc, &body).await;
            assert_eq!(status, 200, "{a}");
            v.push(a["allowed"] == true);
        }
        v
    };
    assert_eq!(answers, [true, true, false]);
    assert_eq!(
        reqwest::get(svc.url("/readyz")).await.unwrap().status(),
        200
    );
    svc.stop().await;
}

/// No load during the failover: every count replicated before it is on the new master, and the
/// first take after the promotion is decided there (the demoted master's `READONLY` or its
/// dropped connection sends the service back to the sentinels within that take).
#[tokio::test]
async fn failover_between_takes_keeps_every_count() {
    let _one = ONE_AT_A_TIME.lock().await;
    let setup = SentinelSetup::start(NAME, &[]);
    let old = setup.master().expect("a master");
    let s = store(&setup, 200);
    let b = hourly("kept", 100);
    for _ in 0..30 {
        assert!(s.take(std::slice::from_ref(&b)).await.unwrap().allowed);
    }
    assert!(setup.wait_replicated(old, Duration::from_secs(5)));

    let t = Instant::now();
    assert!(setup.failover(), "SENTINEL FAILOVER refused");
    let (new, promoted) = wait_switched(&setup, old, Duration::from_secs(20));
    eprintln!("SENTINEL FAILOVER: {new} named master after {promoted:?}");

    // The old master turns replica once the sentinels reconfigure it.
    assert!(
        tollgate_testkit::process::eventually(Duration::from_secs(20), || demoted(&setup, old)),
        "{old} was not demoted"
    );
    eprintln!("{old} demoted {:?} after the failover", t.elapsed());

    let since = Instant::now();
    let (d, failed) = decided(&s, &b).await;
    eprintln!(
        "first decision {:?} after the demotion, {} failed before it: {failed:?}",
        since.elapsed(),
        failed.len()
    );
    assert!(d.allowed);
    assert_eq!(
        d.buckets[0].remaining, 69,
        "the 30 takes before the failover are kept, this one charged once"
    );
    // Decided on the new master: its replica (the old master) receives the charge.
    assert!(setup.wait_replicated(new, Duration::from_secs(20)));
    let (d, _) = decided(&s, &b).await;
    assert_eq!(d.buckets[0].remaining, 68);
    assert_eq!(setup.master(), Some(new));
}

/// Capacity of the buckets taken under load.
const CAPACITY: u64 = 100_000;

/// The service on the setup, 30 takes of a bucket of `key` (`CAPACITY`, no refill in the test),
/// and the master's replica caught up with them; the service, a client and the take's body.
async fn thirty_replicated(
    setup: &SentinelSetup,
    key: &str,
) -> (Service, reqwest::Client, serde_json::Value) {
    // Generous: the machine running the tests may be busy; a Redis timeout is a 503 too.
    let svc = Service::start(Arc::new(store(setup, 500)), None).await;
    let client = reqwest::Client::new();
    let body = json!({"buckets": [bucket(key, CAPACITY, 1, 3_600_000, 1)]});
    for _ in 0..30 {
        assert_eq!(post_take(&client, &svc, &body).await.0, 200);
    }
    let master = setup.master().expect("a master");
    assert!(setup.wait_replicated(master, Duration::from_secs(5)));
    (svc, client, body)
}

/// A client taking without pause while `SENTINEL FAILOVER` runs: every answer is a decision or a
/// 503 (never another 5xx, never "allowed" without a master), the 503s last a bounded time, and
/// the bucket on the new master holds the counts replication carried (at most the takes the old
/// master answered after the replica was promoted are lost with it).
#[tokio::test]
async fn failover_under_load_answers_503_at_most_briefly() {
    let _one = ONE_AT_A_TIME.lock().await;
    let setup = SentinelSetup::start(NAME, &[]);
    let old = setup.master().expect("a master");
    let (svc, client, body) = thirty_replicated(&setup, "load").await;

    // (time since start, status, allowed, remaining)
    let start = Instant::now();
    let mut answers: Vec<(Duration, u16, bool, u64)> = Vec::new();
    let mut failover_at = None;
    let mut named_at = None;
    let mut switched_at = None;
    let deadline = Duration::from_secs(30);
    loop {
        let (status, v) = post_take(&client, &svc, &body).await;
        let allowed = v["allowed"] == true;
        let remaining = v["buckets"][0]["remaining"].as_u64().unwrap_or(0);
        answers.push((start.elapsed(), status, allowed, remaining));
        let now = start.elapsed();
        if failover_at.is_none() && now > Duration::from_millis(300) {
            assert!(setup.failover(), "SENTINEL FAILOVER refused");
            failover_at = Some(start.elapsed());
        }
        if failover_at.is_some() && named_at.is_none() && setup.master() != Some(old) {
            named_at = Some(start.elapsed());
        }
        if named_at.is_some() && switched_at.is_none() && demoted(&setup, old) {
            switched_at = Some(start.elapsed());
        }
        // Run on for 2 s once the old master is a replica.
        if switched_at.is_some_and(|s| now > s + Duration::from_secs(2)) {
            break;
        }
        assert!(now < deadline, "no failover within {deadline:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (failover_at, named_at, switched_at) = (
        failover_at.unwrap(),
        named_at.unwrap(),
        switched_at.unwrap(),
    );

    let bad: Vec<_> = answers
        .iter()
        .filter(|(_, st, _, _)| *st != 200 && *st != 503)
        .collect();
    assert!(bad.is_empty(), "answers other than 200 and 503: {bad:?}");
    let unavailable: Vec<Duration> = answers
        .iter()
        .filter(|(_, st, _, _)| *st == 503)
        .map(|(t, _, _, _)| *t)
        .collect();
    let window = match (unavailable.first(), unavailable.last()) {
        (Some(a), Some(b)) => *b - *a,
        _ => Duration::ZERO,
    };
    let last = answers.last().unwrap();
    assert_eq!(
        last.1,
        200,
        "decisions again at the end: {:?}",
        &answers[answers.len().saturating_sub(20)..]
    );
    assert!(last.2, "still allowed: {last:?}");
    let admitted = 30 + answers.iter().filter(|a| a.1 == 200 && a.2).count() as u64;
    // What the new master's bucket shows beyond what was admitted: takes the old master answered
    // and did not replicate before it was demoted.
    let lost = (last.3 + admitted).saturating_sub(CAPACITY);
    // The old master takes writes until the service hears of the switch (`+switch-master`, as
    // the sentinels name the new master), not until the sentinels demote it (seconds later).
    let after_failover = answers
        .iter()
        .filter(|a| a.0 >= failover_at && a.0 <= named_at + Duration::from_millis(200) && a.2)
        .count() as u64;
    eprintln!(
        "{} answers, {} of them 503 over {window:?}; new master named {:?} and the old one \
         demoted {:?} after SENTINEL FAILOVER; {admitted} admitted, {lost} lost with the old \
         master ({after_failover} admitted from the failover to 200 ms after the naming)",
        answers.len(),
        unavailable.len(),
        named_at - failover_at,
        switched_at - failover_at,
    );
    assert!(
        window < Duration::from_secs(2),
        "503s for {window:?} around the failover"
    );
    assert!(
        last.3 + 30 <= CAPACITY,
        "the takes before the failover are kept: {} remaining",
        last.3
    );
    assert!(
        lost <= after_failover,
        "{lost} takes lost, more than the {after_failover} admitted before the switch was announced"
    );
    assert!(keys_on(&setup, setup.master().unwrap()).contains("load"));
    svc.stop().await;
}

/// The real binary, its flags from the environment, with passwords on the data nodes and on the
/// sentinels: takes are decided, and neither password shows in its logs; a wrong master password
/// is 503, never "allowed".
#[tokio::test]
async fn the_binary_through_password_protected_sentinels() {
    let _one = ONE_AT_A_TIME.lock().await;
    let setup =
        SentinelSetup::start_with_passwords(NAME, &[], Some("node-pw-123"), Some("sent-pw-456"));
    let help = std::process::Command::new(common::binary::bin())
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--redis-sentinel ",
        "TOLLGATE_REDIS_SENTINEL]",
        "--redis-sentinel-master",
        "TOLLGATE_REDIS_SENTINEL_MASTER",
        "--redis-master-password",
        "TOLLGATE_REDIS_MASTER_PASSWORD",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}:\n{help}");
    }
    let urls: Vec<String> = setup
        .sentinels
        .iter()
        .map(|p| format!("redis://:sent-pw-456@127.0.0.1:{p}"))
        .collect();
    let svc = ServerProc::start(&[
        "--redis-sentinel",
        &urls.join(","),
        "--redis-sentinel-master",
        NAME,
        "--redis-master-password",
        "node-pw-123",
        // The point is the passwords, not the timeout: a busy machine may take longer than the
        // default 50 ms to answer.
        "--redis-timeout-ms",
        "1000",
    ]);
    let client = reqwest::Client::new();
    // Ready once it reached the master the sentinels name, as a rollout would wait for it.
    let since = Instant::now();
    while client
        .get(svc.url("/readyz"))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .ok()
        != Some(200)
    {
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "never ready:\n{}",
            svc.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let take = || async {
        let r = client
            .post(svc.url("/v1/take"))
            .json(&json!({"buckets": [bucket("bin", 2, 1, 3_600_000, 1)]}))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (
            status,
            r.json::<serde_json::Value>().await.unwrap_or_default(),
        )
    };
    let mut allowed = Vec::new();
    for _ in 0..3 {
        let (status, v) = take().await;
        assert_eq!(status, 200, "{v}\n{}", svc.logs());
        allowed.push(v["allowed"] == true);
    }
    assert_eq!(allowed, [true, true, false]);
    let logs = svc.logs();
    assert!(logs.contains("using Redis Sentinel"), "{logs}");
    assert!(
        !logs.contains("node-pw-123") && !logs.contains("sent-pw-456"),
        "{logs}"
    );
    assert!(keys_on(&setup, setup.master().unwrap()).contains("bin"));

    // The master's password wrong: no decision, 503.
    let s = Service::start(
        Arc::new(store_with(&setup, urls.clone(), Some("wrong"), 200)),
        None,
    )
    .await;
    let (status, v) = post_take(
        &client,
        &s,
        &json!({"buckets": [bucket("bin2", 2, 1, 3_600_000, 1)]}),
    )
    .await;
    assert_eq!(status, 503, "{v}");
    s.stop().await;
}

/// The master killed (SIGKILL) under load: 503 while no master answers (never another 5xx,
/// never "allowed"), decisions again within 1 s of a sentinel naming the promoted replica (the
/// replica answers `ROLE` as master about a second before the sentinels confirm it; the service
/// follows the sentinels, not a node's own word), and the counts replicated before the kill kept.
#[tokio::test]
async fn master_killed_under_load_decisions_back_within_a_second_of_the_promotion() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut setup = SentinelSetup::start(NAME, &[]);
    let old = setup.master().expect("a master");
    let (svc, client, body) = thirty_replicated(&setup, "killed").await;

    let start = Instant::now();
    setup.kill_node(old);
    let mut answers: Vec<(Duration, u16, bool, u64)> = Vec::new();
    let new = setup.other(old);
    let mut promoted_at = None;
    let mut named_at = None;
    // Answers given while the replica was still a replica afterwards: no master anywhere.
    let mut masterless = Vec::new();
    loop {
        let (status, v) = post_take(&client, &svc, &body).await;
        let now = start.elapsed();
        answers.push((
            now,
            status,
            v["allowed"] == true,
            v["buckets"][0]["remaining"].as_u64().unwrap_or(0),
        ));
        if promoted_at.is_none() {
            if setup
                .cli(new, &["ROLE"])
                .is_some_and(|r| r.starts_with("master"))
            {
                promoted_at = Some(start.elapsed());
            } else {
                masterless.push(answers.len() - 1);
            }
        }
        if named_at.is_none() && setup.masters().contains(&Some(new)) {
            named_at = Some(start.elapsed());
        }
        if named_at.is_some_and(|p| now > p + Duration::from_secs(2)) {
            break;
        }
        assert!(
            now < Duration::from_secs(30),
            "no promotion within 30 s of the kill"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (promoted_at, named_at) = (promoted_at.unwrap(), named_at.unwrap());
    let bad: Vec<_> = answers
        .iter()
        .filter(|a| a.1 != 200 && a.1 != 503)
        .collect();
    assert!(bad.is_empty(), "answers other than 200 and 503: {bad:?}");
    let before: Vec<_> = masterless.iter().map(|&i| answers[i]).collect();
    assert!(
        before.iter().all(|a| a.1 == 503),
        "decided with no master: {:?}",
        before.iter().find(|a| a.1 != 503)
    );
    let back = *answers
        .iter()
        .find(|a| a.1 == 200)
        .expect("decisions after the promotion");
    let named = setup.master();
    let last = answers.last().unwrap();
    eprintln!(
        "master killed: the replica promoted after {promoted_at:?}, named by a sentinel after \
         {named_at:?}; {} answers 503 before the promotion, first decision {:?} after the naming; \
         {} remaining at the end",
        before.len(),
        back.0.saturating_sub(named_at),
        last.3
    );
    assert_eq!(named, Some(new));
    assert!(
        back.0.saturating_sub(named_at) < Duration::from_secs(1),
        "decisions back {:?} after a sentinel named the new master",
        back.0.saturating_sub(named_at)
    );
    assert!(answers.iter().filter(|a| a.0 > back.0).all(|a| a.1 == 200));
    let admitted_after = answers.iter().filter(|a| a.1 == 200 && a.2).count() as u64;
    assert_eq!(
        last.3,
        CAPACITY - 30 - admitted_after,
        "the 30 replicated takes kept, every later one charged once"
    );
    svc.stop().await;
}

/// Commands the setup's sentinels have served (`total_commands_processed`; a sentinel has no
/// `commandstats`), summed.
fn sentinel_calls(setup: &SentinelSetup) -> u64 {
    setup
        .sentinels
        .iter()
        .map(|&p| {
            setup
                .cli(p, &["INFO", "stats"])
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.trim().strip_prefix("total_commands_processed:"))
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum()
}

/// No master at all (both data nodes killed): every take is 503 / `UNAVAILABLE`, and the
/// sentinels are asked at most once per 25 ms however many takes arrive, not once per take.
#[tokio::test]
async fn without_any_master_takes_fail_and_the_sentinels_are_not_flooded() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut setup = SentinelSetup::start(NAME, &[]);
    let s = Arc::new(store(&setup, 100));
    let b = hourly("none", 10);
    // Decided while the master is there (retried: a busy machine can miss 100 ms once).
    assert!(decided(&s, &b).await.0.allowed);
    for port in setup.nodes {
        setup.kill_node(port);
    }
    // What clients see: 503 / UNAVAILABLE.
    let svc = Service::start(s.clone(), None).await;
    let body = json!({"buckets": [bucket("none", 10, 1, 3_600_000, 1)]});
    let (status, v) = post_take(&reqwest::Client::new(), &svc, &body).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "unavailable");
    let e = svc
        .grpc()
        .await
        .take(tollgate_server::api::grpc::pb::TakeRequest {
            buckets: vec![common::pb_bucket("none")],
            ..Default::default()
        })
        .await
        .expect_err("no master");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    svc.stop().await;
    let before = sentinel_calls(&setup);
    let start = Instant::now();
    let mut takes = 0u64;
    while start.elapsed() < Duration::from_millis(500) {
        let r = s.take(std::slice::from_ref(&b)).await;
        assert!(r.is_err(), "decided with no master: {r:?}");
        takes += 1;
    }
    let elapsed = start.elapsed();
    let calls = sentinel_calls(&setup) - before;
    // Each lookup asks the three sentinels (SENTINEL MASTERS); the INFO calls count too.
    let bound = 3 * (elapsed.as_millis() as u64 / 25 + 10);
    eprintln!(
        "no master: {takes} takes failed in {elapsed:?}, {calls} commands to the sentinels (bound {bound})"
    );
    assert!(takes > 50, "{takes} takes only");
    assert!(
        calls <= bound,
        "{calls} commands to the sentinels for {takes} takes"
    );
}
