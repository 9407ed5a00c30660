//! Redis-specific behaviour with real redis-server processes: the race the script prevents, TTLs,
//! outages and recovery, NOSCRIPT recovery, and a real 3-master Redis Cluster.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bucket, post_take, RedisProc, Service};
use serde_json::json;
use tollgate_server::api::grpc::pb;
use tollgate_server::domain::{Algorithm, BucketSpec};
use tollgate_server::store::keys;
use tollgate_server::store::redis::RedisStore;
use tollgate_server::store::Store;

fn tb(key: &str, capacity: u64, rate: u64, period_ms: u64, cost: u64) -> BucketSpec {
    BucketSpec {
        key: key.into(),
        capacity,
        rate,
        period_ms,
        cost,
        algorithm: Algorithm::TokenBucket,
        lease: cost,
        max_delay_ms: 0,
    }
}

/// The seed's exercise, literally. Servers A and B share a bucket with one token left.
/// Naive two-step (HMGET, then HSET) through the bad interleaving: two admissions on one token.
/// The Lua script through the same steps: one.
#[tokio::test]
async fn naive_two_step_races_and_the_script_does_not() {
    let r = RedisProc::start();
    let (mut a, mut b) = (r.conn(), r.conn());
    let key = "naive:{bucket}";
    redis::cmd("HSET")
        .arg(key)
        .arg("tokens")
        .arg(1)
        .arg("last")
        .arg(0)
        .query::<()>(&mut a)
        .unwrap();
    let read = |c: &mut redis::Connection| -> f64 {
        let (tokens, _last): (f64, f64) = redis::cmd("HMGET")
            .arg(key)
            .arg("tokens")
            .arg("last")
            .query(c)
            .unwrap();
        tokens
    };
    // A: HMGET -> 1; B: HMGET -> 1; A: HSET 0, allow; B: HSET 0, allow.
    let ta = read(&mut a);
    let tb_ = read(&mut b);
    let mut admitted = 0;
    for (c, tokens) in [(&mut a, ta), (&mut b, tb_)] {
        if tokens >= 1.0 {
            redis::cmd("HSET")
                .arg(key)
                .arg("tokens")
                .arg(tokens - 1.0)
                .arg("last")
                .arg(0)
                .query::<()>(c)
                .unwrap();
            admitted += 1;
        }
    }
    assert_eq!(
        admitted, 2,
        "the naive read-modify-write admits twice on one token"
    );

    // The script: servers A and B are two store instances (two connections). One token
    // (capacity 1, refill once an hour), A's call then B's call, and then both at once many times.
    let sa = common::redis_store(&r.url(), 1000);
    let sb = common::redis_store(&r.url(), 1000);
    let one = tb("seed", 1, 1, 3_600_000, 1);
    let da = sa.take(std::slice::from_ref(&one)).await.unwrap();
    let db = sb.take(std::slice::from_ref(&one)).await.unwrap();
    assert!(da.allowed);
    assert!(!db.allowed, "the script serializes: B sees 0 tokens");
    for i in 0..50 {
        let b = tb(&format!("seed-{i}"), 1, 1, 3_600_000, 1);
        let (x, y) = tokio::join!(
            sa.take(std::slice::from_ref(&b)),
            sb.take(std::slice::from_ref(&b))
        );
        let n = [x.unwrap().allowed, y.unwrap().allowed]
            .iter()
            .filter(|a| **a)
            .count();
        assert_eq!(n, 1, "round {i}");
    }
}

fn keys_of(r: &RedisProc) -> Vec<String> {
    let mut c = r.conn();
    redis::cmd("KEYS").arg("*").query(&mut c).unwrap()
}

#[tokio::test]
async fn every_key_has_a_ttl_and_idle_buckets_vanish() {
    let r = RedisProc::start();
    let s = common::redis_store(&r.url(), 1000);
    let fw = BucketSpec {
        algorithm: Algorithm::FixedWindow,
        ..tb("w", 5, 5, 100, 1)
    };
    let d = s
        .take(&[tb("a", 2, 2, 100, 1), tb("b{x}", 1, 1, 100, 1), fw])
        .await
        .unwrap();
    assert!(d.allowed);
    let ks = keys_of(&r);
    assert_eq!(ks.len(), 3, "{ks:?}");
    let mut c = r.conn();
    for k in &ks {
        let pttl: i64 = redis::cmd("PTTL").arg(k).query(&mut c).unwrap();
        // Full again within 100 ms, plus the 1 s margin.
        assert!(pttl > 0 && pttl <= 1100, "{k}: PTTL {pttl}");
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while !keys_of(&r).is_empty() {
        assert!(
            Instant::now() < deadline,
            "keys did not expire: {:?}",
            keys_of(&r)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn password_in_the_url_is_used_and_never_shown() {
    let r = RedisProc::start_on(common::free_port(), &["--requirepass", "hunter2-secret"]);
    let good = common::redis_store(
        &format!("redis://:hunter2-secret@127.0.0.1:{}", r.port),
        1000,
    );
    assert!(!format!("{good:?}").contains("hunter2"), "{good:?}");
    assert!(good.take(&[tb("pw", 1, 1, 1000, 1)]).await.unwrap().allowed);
    let bad = common::redis_store(&format!("redis://:wrong@127.0.0.1:{}", r.port), 1000);
    let e = bad
        .take(&[tb("pw", 1, 1, 1000, 1)])
        .await
        .expect_err("wrong password");
    assert!(!e.to_string().contains("wrong@"), "{e}");
}

/// How many times Redis ran `command` (`INFO commandstats`), 0 when never.
fn calls_of(r: &RedisProc, command: &str) -> u64 {
    let stats = r.cmd(&["INFO", "commandstats"]).unwrap_or_default();
    let prefix = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|l| l.trim().strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().expect("a call count"))
}

/// On Redis 7 the takes are `FCALL`s of the library (no script runs), which the store loads
/// itself, and loads again after `FUNCTION FLUSH` (or a restart without persistence).
#[tokio::test]
async fn takes_run_as_functions_and_a_flushed_library_is_loaded_again() {
    let r = RedisProc::start();
    let s = common::redis_store(&r.url(), 1000);
    let b = tb("fn", 4, 4, 3_600_000, 1);
    assert!(s.take(std::slice::from_ref(&b)).await.unwrap().allowed);
    assert!(s.take_batch(&[vec![b.clone()]]).await.unwrap()[0].allowed);
    let list = r.cmd(&["FUNCTION", "LIST"]).unwrap_or_default();
    assert!(list.contains("tollgate_"), "the library is loaded: {list}");
    assert_eq!(
        calls_of(&r, "fcall"),
        3,
        "the first take finds no library, loads it and calls again; the batch finds it"
    );
    assert_eq!(calls_of(&r, "evalsha"), 0, "no script ran");

    assert_eq!(r.cmd(&["FUNCTION", "FLUSH"]).as_deref(), Some("OK"));
    let d = s
        .take(std::slice::from_ref(&b))
        .await
        .expect("the library is loaded again");
    assert_eq!(d.buckets[0].remaining, 1);
    assert_eq!(r.cmd(&["FUNCTION", "FLUSH"]).as_deref(), Some("OK"));
    let ds = s
        .take_batch(&[vec![b.clone()], vec![b]])
        .await
        .expect("the library is loaded again for a batch");
    assert_eq!(
        ds.iter().map(|d| d.allowed).collect::<Vec<_>>(),
        [true, false]
    );
    assert_eq!(calls_of(&r, "evalsha"), 0, "still no script");
}

/// A Redis without functions (before 7.0: `FCALL` unknown, as here with it renamed away; or an
/// ACL that refuses it) is taken with the scripts, as exactly.
#[tokio::test]
async fn a_redis_without_functions_is_taken_with_scripts() {
    let renamed = RedisProc::start_on(
        common::free_port(),
        &["--rename-command", "FCALL", "fcall-renamed-away"],
    );
    let refused = RedisProc::start();
    assert_eq!(
        refused
            .cmd(&["ACL", "SETUSER", "default", "-fcall", "-function"])
            .as_deref(),
        Some("OK")
    );
    for r in [&renamed, &refused] {
        let s = common::redis_store(&r.url(), 1000);
        let b = tb("nofn", 3, 3, 3_600_000, 1);
        let d = s.take(std::slice::from_ref(&b)).await.unwrap();
        assert!(d.allowed && d.buckets[0].remaining == 2, "{d:?}");
        let ds = s
            .take_batch(&[vec![b.clone()], vec![b.clone()], vec![b]])
            .await;
        assert_eq!(
            ds.unwrap().iter().map(|d| d.allowed).collect::<Vec<_>>(),
            [true, true, false]
        );
        assert!(calls_of(r, "evalsha") >= 2, "the takes ran as scripts");
    }
    assert!(
        !refused
            .cmd(&["FUNCTION", "LIST"])
            .unwrap_or_default()
            .contains("tollgate_"),
        "nothing was loaded where functions are refused"
    );
}

/// `NOSCRIPT` (after a restart or `SCRIPT FLUSH`) is recovered: on a Redis without functions,
/// whose takes are scripts.
#[tokio::test]
async fn script_flush_is_recovered() {
    let r = RedisProc::start_on(
        common::free_port(),
        &["--rename-command", "FCALL", "fcall-renamed-away"],
    );
    let s = common::redis_store(&r.url(), 1000);
    let b = tb("flush", 3, 3, 3_600_000, 1);
    assert!(s.take(std::slice::from_ref(&b)).await.unwrap().allowed);
    assert_eq!(r.cmd(&["SCRIPT", "FLUSH"]).as_deref(), Some("OK"));
    let d = s
        .take(std::slice::from_ref(&b))
        .await
        .expect("NOSCRIPT is recovered");
    assert_eq!(d.buckets[0].remaining, 1);
    // The batch script too.
    assert_eq!(r.cmd(&["SCRIPT", "FLUSH"]).as_deref(), Some("OK"));
    let ds = s
        .take_batch(&[vec![b.clone()], vec![b]])
        .await
        .expect("NOSCRIPT is recovered for a batch");
    assert_eq!(
        ds.iter().map(|d| d.allowed).collect::<Vec<_>>(),
        [true, false]
    );
}

/// A dead or hung Redis is a 503 / UNAVAILABLE within the configured timeout, and the service
/// recovers by itself when Redis is back on the same port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_is_503_within_the_timeout_and_recovers() {
    const TIMEOUT_MS: u64 = 100;
    let mut r = RedisProc::start();
    let svc = Service::start(Arc::new(common::redis_store(&r.url(), TIMEOUT_MS)), None).await;
    let client = reqwest::Client::new();
    let body = json!({"buckets": [bucket("outage", 1000, 1000, 3_600_000, 1)]});
    assert_eq!(post_take(&client, &svc, &body).await.0, 200);

    // Hung: Redis accepts nothing for 2 s (CLIENT PAUSE): the response timeout must fire.
    assert_eq!(
        r.cmd(&["CLIENT", "PAUSE", "2000", "ALL"]).as_deref(),
        Some("OK")
    );
    let t = Instant::now();
    let (status, v) = post_take(&client, &svc, &body).await;
    let hung = t.elapsed();
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "unavailable");
    eprintln!("hung Redis: 503 after {hung:?} (timeout {TIMEOUT_MS} ms)");
    assert!(
        hung < Duration::from_millis(TIMEOUT_MS + 250),
        "hung Redis answered after {hung:?}"
    );
    assert!(hung >= Duration::from_millis(TIMEOUT_MS - 5), "{hung:?}");
    r.cmd(&["CLIENT", "UNPAUSE"]);

    // Killed.
    r.kill();
    let mut g = svc.grpc().await;
    for _ in 0..3 {
        let t = Instant::now();
        let (status, _) = post_take(&client, &svc, &body).await;
        let dead = t.elapsed();
        assert_eq!(status, 503);
        eprintln!("dead Redis: 503 after {dead:?}");
        assert!(
            dead < Duration::from_millis(TIMEOUT_MS + 250),
            "dead Redis answered after {dead:?}"
        );
        let t = Instant::now();
        let e = g
            .take(pb::TakeRequest {
                buckets: vec![pb::Bucket {
                    key: "outage".into(),
                    capacity: 1000,
                    rate: Some(1000),
                    period_ms: 3_600_000,
                    cost: None,
                    algorithm: 0,
                    lease: None,
                    ..Default::default()
                }],
                ..Default::default()
            })
            .await
            .expect_err("no Redis");
        assert_eq!(e.code(), tonic::Code::Unavailable);
        assert!(t.elapsed() < Duration::from_millis(TIMEOUT_MS + 250));
    }

    // Back on the same port: success again without restarting the service.
    r.restart();
    let back = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, v) = post_take(&client, &svc, &body).await;
        if status == 200 {
            assert_eq!(v["allowed"], true);
            eprintln!(
                "success again {:?} after Redis answered PING",
                back.elapsed()
            );
            break;
        }
        assert!(Instant::now() < deadline, "no recovery: {status} {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    svc.stop().await;
}

/// Three masters, started here, on free ports.
struct Cluster {
    nodes: Vec<RedisProc>,
}

impl Cluster {
    fn start() -> Self {
        let nodes = common::start_cluster(3);
        Cluster { nodes }
    }

    fn store(&self) -> RedisStore {
        common::cluster_store(&self.nodes, 1000)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_slots_and_all_or_nothing() {
    let cluster = Cluster::start();
    let s = cluster.store();
    assert_eq!(s.kind(), "redis-cluster");
    s.ping().await.expect("cluster answers");

    // Two keys in different slots (and, with 3 masters, usually on different nodes).
    let a = tb("cluster-a", 10, 10, 3_600_000, 3);
    let mut b = tb("cluster-b", 2, 2, 3_600_000, 3);
    let mut i = 0;
    while keys::slot(&keys::redis_key("test:", &a)) / 5462
        == keys::slot(&keys::redis_key("test:", &b)) / 5462
    {
        i += 1;
        b.key = format!("cluster-b{i}");
    }

    // b cannot pay 3: the request is denied and a keeps its 10 tokens.
    let d = s.take(&[a.clone(), b.clone()]).await.unwrap();
    assert!(!d.allowed);
    assert!(d.buckets[0].allowed && !d.buckets[1].allowed, "{d:?}");
    // The same with a lease on a: the whole grant (10, not the cost 3) is given back.
    let leased_a = BucketSpec {
        lease: 10,
        ..a.clone()
    };
    let d = s.take(&[leased_a, b.clone()]).await.unwrap();
    assert!(!d.allowed);
    assert_eq!(d.buckets[0].granted, 0);
    let all_of_a = tb(&a.key, 10, 10, 3_600_000, 10);
    let d = s.take(std::slice::from_ref(&all_of_a)).await.unwrap();
    assert!(d.allowed, "a was refunded: {d:?}");

    // Buckets on different slots both charged when both can pay.
    let c = tb(&format!("{}-c", a.key), 4, 4, 3_600_000, 1);
    let b2 = tb(&b.key, 2, 2, 3_600_000, 1);
    let d = s.take(&[c.clone(), b2.clone()]).await.unwrap();
    assert!(d.allowed);
    assert_eq!((d.buckets[0].remaining, d.buckets[1].remaining), (3, 1));

    // The takes' library loaded again on every primary after a flush.
    for n in &cluster.nodes {
        assert_eq!(n.cmd(&["FUNCTION", "FLUSH"]).as_deref(), Some("OK"));
    }
    let d = s
        .take(&[c, b2])
        .await
        .expect("the library is loaded again on the cluster");
    assert!(d.allowed);
    assert_eq!((d.buckets[0].remaining, d.buckets[1].remaining), (2, 0));

    // Batches: takes of one slot go in one script call per slot, in order; a take spanning slots
    // is taken as a single take (with refunds), beside them.
    let hour = 3_600_000;
    let p = tb("batch-p", 1, 1, hour, 1);
    let mut q = tb("batch-q", 2, 2, hour, 1);
    let mut k = 0;
    while keys::slot(&keys::redis_key("test:", &p)) == keys::slot(&keys::redis_key("test:", &q)) {
        k += 1;
        q.key = format!("batch-q{k}");
    }
    let too_much = tb(&p.key, 1, 1, hour, 2);
    let batch = [
        vec![p.clone()],
        vec![q.clone()],
        vec![p.clone()],
        vec![q.clone(), too_much],
    ];
    for n in &cluster.nodes {
        assert_eq!(n.cmd(&["SCRIPT", "FLUSH"]).as_deref(), Some("OK"));
    }
    let ds = s.take_batch(&batch).await.expect("a batch on the cluster");
    assert_eq!(
        ds.iter().map(|d| d.allowed).collect::<Vec<_>>(),
        [true, true, false, false],
        "{ds:?}"
    );
    // q: charged once by take 1; take 3 was denied across slots and refunded.
    let d = s.take(std::slice::from_ref(&q)).await.unwrap();
    assert!(d.allowed, "{d:?}");
    assert_eq!(d.buckets[0].remaining, 0);

    // Exactness across slots under concurrency: 16 tasks race for a 2-slot request.
    let s = Arc::new(s);
    let x = tb("race-x", 20, 1, 3_600_000, 1);
    let mut y = tb("race-y", 5, 1, 3_600_000, 1);
    let mut j = 0;
    while keys::slot(&keys::redis_key("test:", &x)) == keys::slot(&keys::redis_key("test:", &y)) {
        j += 1;
        y.key = format!("race-y{j}");
    }
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (s, x, y) = (s.clone(), x.clone(), y.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            for _ in 0..4 {
                if s.take(&[x.clone(), y.clone()]).await.unwrap().allowed {
                    n += 1;
                }
            }
            n
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    assert!(admitted <= 5, "never over-admits across slots: {admitted}");
    assert!(admitted >= 1);
}

/// The scripts' exact arithmetic (prelude.lua's muldivmod) against u128, on all three paths:
/// below 2^52 (float division, corrected), limb division (divisor < 2^37), bit division.
#[tokio::test]
async fn lua_integer_arithmetic_is_exact() {
    let r = RedisProc::start();
    let prelude = include_str!("../../src/store/lua/prelude.lua");
    let script = redis::Script::new(&format!(
        "{prelude}\nlocal q, r = muldivmod(tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]))\nreturn {{fmt(q), fmt(r)}}"
    ));
    let mut c = redis::Client::open(r.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |bits: u32| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> (64 - bits)).max(1)
    };
    let mut cases: Vec<(u64, u64, u64, u64)> = vec![
        (1, 1, 0, 1),
        ((1 << 53) - 1, 1, 0, 3),
        (31_536_000_000, 1_000_000_000_000, 999, 31_536_000_000),
        (
            1_000_000_000_000_000,
            31_536_000_000,
            0,
            1_000_000_000_000_000,
        ),
        (4_500_000, 1_000_000_000_000, 12_345, 1000),
    ];
    for _ in 0..300 {
        let c_bits = [30, 36, 37, 45, 51][(next(8) % 5) as usize];
        let c = next(c_bits);
        let a = next(53);
        let b_bits = 53 - (next(6) % 40) as u32;
        let b = next(b_bits);
        cases.push((a, b, next(63) % c, c));
    }
    let mut checked = 0;
    for (a, b, add, cc) in cases {
        let x = u128::from(a) * u128::from(b) + u128::from(add);
        let (q, rem) = (x / u128::from(cc), x % u128::from(cc));
        if q >= 1 << 53 {
            continue; // outside the documented exact range
        }
        let got: Vec<String> = script
            .arg(a)
            .arg(b)
            .arg(add)
            .arg(cc)
            .invoke_async(&mut c)
            .await
            .unwrap();
        assert_eq!(
            got,
            vec![q.to_string(), rem.to_string()],
            "muldivmod({a}, {b}, {add}, {cc})"
        );
        checked += 1;
    }
    assert!(checked > 150, "only {checked} cases in range");
}
