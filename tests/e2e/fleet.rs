//! N proxies, one limit: end-to-end tests across several Envoys.
//!
//! Real Envoys (each `--concurrency 2`, each running the real module), the real `tollgate-server`, real
//! Redis, and an upstream inside the test that counts what reaches it. The test client spreads its
//! requests round-robin over the Envoys, as a load balancer in front of a fleet would, so a limiter that
//! kept one bucket per proxy (or per worker) would admit a multiple of the limit and fail here.
//!
//! Counts are compared exactly. The only slack is what the refill rate allows over the elapsed time the
//! test measures itself (`floor(rate × elapsed)`), plus one token where a comment says why.
//!
//! Layout:
//! - the processes come from the shared harness (`tests/common`): Redis, the service (also under a
//!   skewed clock, and again on the port it had), N Envoys started at once, the upstream counting per
//!   Envoy; `start_fleet` builds the fleet's Envoy specs.
//! - `Sampler` (the fleet's decision counters over time), at the end of the file; the load
//!   (concurrent clients, round-robin over the Envoys) is the harness's (`common::load`).
//! - the tests: `global_mode_is_one_bucket_across_envoys`,
//!   `a_flood_of_denials_is_answered_locally_and_still_exact`, `fallback_splits_the_limit_across_envoys`,
//!   `service_killed_under_load_falls_back_then_resumes`, `redis_killed_under_load_falls_back_then_resumes`,
//!   `skewed_service_clock_still_one_bucket`.
// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::common;

use common::faults::redis_ctl::signal;
use common::load::{Load, Tally};
use common::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The tests in this file each start several Envoys; they run one at a time so that their timings are
/// not distorted by each other on a small machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Flags of every service replica here. The store timeout is up from the harness's: these tests count
/// admissions, and on a small machine busy with other work Redis can stall longer than that; a
/// timed-out take would read as a failed callout. (Store timeouts are the service's own tests' subject.)
const SERVICE_FLAGS: &[&str] = &["--redis-timeout-ms", "1000"];

/// The request header each Envoy of a fleet adds (its index), so the upstream can tell who admitted what.
const ENVOY_HEADER: &str = "x-fleet-envoy";

/// Starts `n` Envoys at once (`--concurrency 2` each), each with `plugin_json` on its listener, one
/// `tollgate` cluster over `service_ports` (round-robin) and its index in [`ENVOY_HEADER`] on every
/// request it forwards to the upstream.
fn start_fleet(
    c: &Components,
    dir: &TempDir,
    n: usize,
    plugin_json: &str,
    service_ports: &[u16],
    upstream_port: u16,
) -> Vec<Envoy> {
    let specs: Vec<EnvoySpec> = (0..n)
        .map(|i| {
            let mut spec =
                EnvoySpec::new(Some(plugin_json.to_string()), 0, upstream_port).under_load();
            spec.service_ports = service_ports.to_vec();
            spec.request_headers = vec![(ENVOY_HEADER.to_string(), i.to_string())];
            spec
        })
        .collect();
    Envoy::start_all(c, dir, &specs)
}

/// `base` with one rule over one shared key (every request, every Envoy, one bucket).
fn plugin(key: &str, capacity: u64, rate: u64, period_ms: u64, base: Plugin) -> String {
    base.rule(
        serde_json::json!({"name": "fleet", "key": [format!("literal:{key}")],
                                 "capacity": capacity, "rate": rate, "period_ms": period_ms}),
    )
    .response(r#"{"status": 429, "headers": ["x-ratelimit"]}"#)
    .json()
}

/// Calls over HTTP, a callout timing out after 1 s.
fn over_http() -> Plugin {
    Plugin::new("http", 1000)
}

/// What a fleet admitted of a load against one key.
struct OneKey {
    run: Tally,
    /// What reached the upstream.
    admitted: u64,
    /// The ideal: capacity + floor(refill over the measured time).
    expected: u64,
    /// The fleet's Tollgate stats, summed.
    stats: BTreeMap<String, u64>,
    /// What reached the upstream, per Envoy.
    per_envoy: BTreeMap<String, u64>,
    /// Callouts the Envoys sent to the service.
    callouts: u64,
}

/// `n` Envoys (failing closed: a failed callout shows as a missing admission, never as a fallback
/// one) in front of the real service and Redis, one key at `capacity, rate per period_ms`,
/// `clients` round-robin clients for `millis` ms (at most `max_total` requests).
fn one_key_under_load(
    name: &str,
    n: usize,
    (capacity, rate, period_ms): (u64, u64, u64),
    clients: usize,
    millis: u64,
    max_total: u64,
) -> OneKey {
    let c = Components::get();
    let dir = TempDir::new(name);
    let redis = Redis::start(&c, &dir);
    let service = Service::start_with(&c, &dir, Some(&redis.url()), SERVICE_FLAGS);
    let upstream = Upstream::start_counting_by(ENVOY_HEADER);
    let cfg = plugin(
        name,
        capacity,
        rate,
        period_ms,
        over_http().failure_mode("deny"),
    );
    let envoys = start_fleet(&c, &dir, n, &cfg, &[service.port], upstream.port);
    let run = Load::run(
        &envoys,
        clients,
        Duration::from_millis(millis),
        max_total,
        Duration::ZERO,
    );
    let elapsed_ms = run.elapsed.as_secs_f64() * 1000.0;
    let refill = (rate as f64 * elapsed_ms / period_ms as f64).floor() as u64;
    OneKey {
        admitted: upstream.requests(),
        expected: capacity + refill,
        stats: tg_total(&envoys),
        per_envoy: upstream.counts(),
        callouts: replica_requests(&envoys, &[service.port]).values().sum(),
        run,
    }
}

/// Global mode through three Envoys hit round-robin by 16 concurrent clients: what reaches the upstream
/// is exactly the capacity plus the tokens refilled while the test ran.
#[test]
pub(crate) fn global_mode_is_one_bucket_across_envoys() {
    let _serial = serial();
    const N: usize = 3;
    const CAPACITY: u64 = 150;
    // A slow refill (2 tokens per second) against a demand of thousands per second: every refilled token
    // is spent at once, so the count is capacity + floor(rate × elapsed).
    const RATE: u64 = 2;
    const PERIOD_MS: u64 = 1000;

    // Failing closed here: a failed callout must show up as a missing admission, never hide behind a
    // fallback admission. 3.25 s: refill × duration (6.5 tokens) sits between two whole tokens, so
    // the measured window's few ms of edges rarely decide the last token (with exactly 3 s they
    // nearly always would).
    let OneKey {
        run,
        admitted,
        expected,
        stats,
        per_envoy,
        ..
    } = one_key_under_load("global", N, (CAPACITY, RATE, PERIOD_MS), 16, 3250, 30_000);
    let elapsed = run.elapsed.as_secs_f64();
    eprintln!(
        "global: {} requests in {elapsed:.3} s, admitted {admitted} (expected {expected} = {CAPACITY} + \
         floor({RATE}/s × {elapsed:.3} s)), per Envoy {per_envoy:?}, statuses {:?}, filter stats {stats:?}",
        run.sent(),
        run.statuses
    );

    assert_eq!(
        run.other(),
        0,
        "only 200 and 429 may reach the client: {:?}",
        run.statuses
    );
    assert!(
        run.sent() > 4 * expected,
        "demand must exceed the limit by far: {}",
        run.sent()
    );
    assert_eq!(
        run.count(200),
        admitted,
        "a 200 at the client is a request at the upstream and back"
    );
    // The bucket starts full at the first take and refills continuously; every client keeps asking, so
    // each token is spent within milliseconds of its arrival. All takes happen inside the measured
    // window, hence at most `expected`. The window also includes the first request's way in and the last
    // response's way out (a few ms, worth 2/s × a few ms ≪ 1 token): if a refill boundary falls into
    // those ms, the token arriving there is not taken, so the count may be one below, never more.
    assert!(
        admitted <= expected && admitted + 1 >= expected,
        "admitted {admitted}, expected {expected} (or one less, for the token in flight at the boundary)"
    );
    assert_eq!(
        stat(&stats, "failure_closed.limited"),
        0,
        "no callout may fail: {stats:?}"
    );
    // Every Envoy took part: the one bucket is shared, not merely one Envoy's.
    assert_eq!(
        per_envoy.len(),
        N,
        "every Envoy admitted some: {per_envoy:?}"
    );
}

/// A flood against one key at 100 a minute through four Envoys (99 % denied): each denial the
/// service gives is remembered by every worker of that Envoy until the bucket could pay again (at
/// most `service.remember_denials_ms`, 1 s by default), so most 429s are answered without a
/// callout, while what reaches the upstream stays the ideal count to within one token.
#[test]
pub(crate) fn a_flood_of_denials_is_answered_locally_and_still_exact() {
    let _serial = serial();
    const N: usize = 4;
    const CAPACITY: u64 = 100;
    const RATE: u64 = 100;
    const PERIOD_MS: u64 = 60_000;

    // 3.9 s: 6.5 tokens refilled, between two whole tokens (as in the test above).
    let OneKey {
        run,
        admitted,
        expected,
        stats,
        callouts,
        ..
    } = one_key_under_load("flood", N, (CAPACITY, RATE, PERIOD_MS), 64, 3900, 200_000);
    let elapsed = run.elapsed.as_secs_f64();
    let (limited, locally) = (
        stat(&stats, "rule.fleet.limited"),
        stat(&stats, "rule.fleet.limited_locally"),
    );
    eprintln!(
        "flood: {} requests in {elapsed:.3} s, admitted {admitted} (expected {expected}), statuses \
         {:?}, {callouts} callouts, {limited} limited of which {locally} from a remembered denial",
        run.sent(),
        run.statuses
    );
    assert_eq!(run.other(), 0, "only 200 and 429: {:?}", run.statuses);
    assert_eq!(run.count(200), admitted);
    assert!(
        run.sent() > 10 * expected,
        "a flood: {} requests",
        run.sent()
    );
    assert!(
        admitted <= expected && admitted + 1 >= expected,
        "admitted {admitted}, expected {expected} (or one less, for the token in flight at the edge)"
    );
    assert_eq!(limited, run.count(429), "every 429 is a denial: {stats:?}");
    assert!(
        locally * 10 >= limited * 8,
        "most denials answered from memory: {locally} of {limited}"
    );
    assert!(
        callouts * 4 <= run.sent(),
        "a flood costs few callouts: {callouts} for {} requests",
        run.sent()
    );
    // A remembered denial still says when to come back: within the second it is remembered for.
    assert!(
        run.retry_after.iter().all(|&s| (1..=1).contains(&s)),
        "Retry-After of a 100/min bucket is one second: {:?}",
        run.retry_after.iter().max()
    );
}

/// The service unreachable (its cluster points at a closed port): each Envoy falls back to a local
/// bucket of capacity/N refilling at rate/N, so the fleet stays within capacity + refill, and each Envoy
/// within its share.
#[test]
fn fallback_splits_the_limit_across_envoys() {
    let _serial = serial();
    const N: usize = 3;
    const CAPACITY: u64 = 60;
    const RATE: u64 = 3;
    const PERIOD_MS: u64 = 1000;

    let c = Components::get();
    let dir = TempDir::new("fallback");
    let upstream = Upstream::start_counting_by(ENVOY_HEADER);
    let closed = closed_port(); // nothing listens there: every callout is refused
    let cfg = plugin(
        "fallback",
        CAPACITY,
        RATE,
        PERIOD_MS,
        over_http().failure_mode("fallback").fallback(N as u64, 100),
    );
    let envoys = start_fleet(&c, &dir, N, &cfg, &[closed], upstream.port);

    let run = Load::run(&envoys, 16, Duration::from_secs(2), 20_000, Duration::ZERO);
    let elapsed = run.elapsed.as_secs_f64();
    let total = upstream.requests();
    let per = upstream.counts();
    let share = CAPACITY / N as u64;
    let total_bound = CAPACITY + (RATE as f64 * elapsed * 1000.0 / PERIOD_MS as f64).floor() as u64;
    let share_bound =
        share + (RATE as f64 / N as f64 * elapsed * 1000.0 / PERIOD_MS as f64).floor() as u64;
    let stats = tg_total(&envoys);
    eprintln!(
        "fallback: {} requests in {elapsed:.3} s, admitted {total} (bound {total_bound}), per Envoy {per:?} \
         (each bound {share_bound}, share {share}), statuses {:?}, filter stats {stats:?}",
        run.sent(),
        run.statuses
    );

    assert_eq!(
        run.other(),
        0,
        "only 200 and 429 may reach the client: {:?}",
        run.statuses
    );
    assert_eq!(run.count(200), total);
    assert!(
        total <= total_bound,
        "fleet admitted {total} > {total_bound}"
    );
    assert_eq!(per.len(), N, "every Envoy admitted some: {per:?}");
    for (envoy, n) in &per {
        assert!(
            *n <= share_bound,
            "Envoy {envoy} admitted {n} > its share {share_bound}"
        );
        // The fallback is a limit, not a kill switch: each Envoy spends its whole share under this demand.
        assert!(
            *n >= share,
            "Envoy {envoy} admitted {n} < its share {share}"
        );
    }
    assert!(
        stat(&stats, "fallback.limited") > 0 && stat(&stats, "fallback.allowed") >= total,
        "the decisions were the fallback's: {stats:?}"
    );
}

/// What a recovery run kills and brings back.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Victim {
    Service,
    Redis,
}

/// The callout timeout used while killing things: the fallback must engage within it.
const RECOVERY_TIMEOUT_MS: u64 = 100;
/// The breaker's longest open period: once the service is back, the next probe comes within it.
const RECOVERY_MAX_OPEN_MS: u64 = 400;

fn recovery(victim: Victim) {
    const N: usize = 3;
    let c = Components::get();
    let dir = TempDir::new(&format!("recovery-{victim:?}").to_lowercase());
    let mut redis = Redis::start(&c, &dir);
    let mut service = Service::start_with(&c, &dir, Some(&redis.url()), SERVICE_FLAGS);
    let service_port = service.port;
    let upstream = Upstream::start_counting_by(ENVOY_HEADER);
    let cfg = plugin(
        &format!("recovery-{victim:?}"),
        200,
        200,
        1000,
        Plugin::new("http", RECOVERY_TIMEOUT_MS)
            .failure_mode("fallback")
            .fallback(N as u64, 100)
            .breaker(3, 100, RECOVERY_MAX_OPEN_MS),
    );
    let envoys = start_fleet(&c, &dir, N, &cfg, &[service_port], upstream.port);

    // 12 clients, each pausing 3 ms between requests: steady load that leaves the machine room to
    // measure the transitions.
    let load = Load::round_robin(
        &envoys,
        12,
        Duration::from_secs(20),
        100_000,
        Duration::from_millis(3),
    );
    let sampler = Sampler::start(&envoys);
    std::thread::sleep(Duration::from_millis(800));
    let before = sampler.last();
    assert!(
        before.decided > 0,
        "steady state before the kill is global: {before:?}"
    );

    // Kill.
    let t_kill = Instant::now();
    match victim {
        Victim::Service => service.proc.kill(),
        Victim::Redis => redis.stop(),
    }
    let fb_at = sampler.wait_for(Duration::from_secs(3), |_, s| s.fallback > before.fallback);
    let fb_at =
        fb_at.unwrap_or_else(|| panic!("no fallback decision within 3 s of killing {victim:?}"));
    let to_fallback = fb_at.saturating_duration_since(t_kill);

    // Stay down long enough for the breaker to open and back off to its longest period.
    std::thread::sleep(Duration::from_millis(1200));

    // Back, on the same port.
    let t_back = match victim {
        Victim::Service => {
            service = Service::start_on(&c, &dir, service_port, Some(&redis.url()), SERVICE_FLAGS);
            Instant::now()
        }
        Victim::Redis => {
            redis = Redis::start_on(&c, &dir, redis.port);
            Instant::now()
        }
    };
    let at_back = sampler.last();
    let global_at = sampler.wait_for(Duration::from_secs(5), |prev, s| {
        // A sampling interval (a few ms) with more decisions than fallback decisions had some made by
        // the service.
        s.decided.saturating_sub(prev.decided) > s.fallback.saturating_sub(prev.fallback)
    });
    let global_at = global_at
        .unwrap_or_else(|| panic!("global decisions did not resume within 5 s ({victim:?})"));
    let to_global = global_at.saturating_duration_since(t_back);
    std::thread::sleep(Duration::from_millis(300));
    let run = load.finish().tally();
    let samples = sampler.finish();
    let after = samples.last().copied().unwrap_or(at_back);

    eprintln!(
        "recovery ({victim:?}): kill -> first fallback decision {:.1} ms (callout timeout \
         {RECOVERY_TIMEOUT_MS} ms); {victim:?} ready again -> first global decision {:.1} ms; {} \
         requests, statuses {:?}; samples {}; counters before {before:?}, at return {at_back:?}, end {after:?}",
        to_fallback.as_secs_f64() * 1000.0,
        to_global.as_secs_f64() * 1000.0,
        run.sent(),
        run.statuses,
        samples.len(),
    );
    drop(service);
    drop(redis);

    assert_eq!(
        run.other(),
        0,
        "only 200 and 429 may reach the client: {:?}",
        run.statuses
    );
    // The sample that first showed a fallback decision was taken this long after the kill: the decision
    // itself came no later.
    assert!(
        to_fallback <= Duration::from_millis(RECOVERY_TIMEOUT_MS),
        "fallback engaged {to_fallback:?} after the kill, more than the callout timeout"
    );
    assert!(
        to_global <= Duration::from_secs(1),
        "global limiting resumed {to_global:?} after {victim:?} returned (limit 1 s)"
    );
    assert!(
        after.decided > at_back.decided,
        "decisions went on after the return"
    );
}

/// The service is killed while clients keep sending, then restarted on the same port.
#[test]
fn service_killed_under_load_falls_back_then_resumes() {
    let _serial = serial();
    recovery(Victim::Service);
}

/// Redis is killed while clients keep sending (the service stays up and answers 503), then restarted.
#[test]
pub(crate) fn redis_killed_under_load_falls_back_then_resumes() {
    let _serial = serial();
    recovery(Victim::Redis);
}

/// Two service replicas over one Redis, one of them an hour ahead (libfaketime), the Envoys alternating
/// between them: still one bucket, because the bucket reads only Redis TIME. Were the replica's clock
/// used, its hour of skew would refill the whole bucket (rate = capacity per hour) and about twice the
/// capacity would pass.
#[test]
fn skewed_service_clock_still_one_bucket() {
    let _serial = serial();
    const N: usize = 3;
    const CAPACITY: u64 = 40;
    const RATE: u64 = 40;
    const PERIOD_MS: u64 = 3_600_000;
    const SKEW_S: i64 = 3600;

    let c = Components::get();
    libfaketime(); // missing: fail before starting anything
    let dir = TempDir::new("clock");
    let redis = Redis::start(&c, &dir);
    let honest = Service::start_with(&c, &dir, Some(&redis.url()), SERVICE_FLAGS);
    let skewed = Service::start_skewed(
        &dir,
        Some(&redis.url()),
        SERVICE_FLAGS,
        &format!("+{SKEW_S}s"),
    );
    // The skew is real: the replica's own HTTP Date header is an hour ahead of the honest one's.
    let d_honest = http_date(honest.port).expect("Date header from the honest replica");
    let d_skewed = http_date(skewed.port).expect("Date header from the skewed replica");
    let measured_skew = d_skewed - d_honest;
    assert!(
        (measured_skew - SKEW_S).abs() <= 5,
        "the skewed replica's clock is {measured_skew} s ahead, wanted {SKEW_S}"
    );

    let upstream = Upstream::start_counting_by(ENVOY_HEADER);
    let cfg = plugin(
        "clock",
        CAPACITY,
        RATE,
        PERIOD_MS,
        // Every request asks a replica (no remembered denials): the replicas' clocks are what is
        // tested, and each must decide its share of the denials.
        over_http().remember_denials_ms(0).failure_mode("deny"),
    );
    // One `tollgate` cluster with both replicas, ROUND_ROBIN: consecutive decisions alternate.
    let envoys = start_fleet(
        &c,
        &dir,
        N,
        &cfg,
        &[honest.port, skewed.port],
        upstream.port,
    );
    let run = Load::run(&envoys, 16, Duration::from_secs(5), 600, Duration::ZERO);
    let admitted = upstream.requests();
    let elapsed = run.elapsed.as_secs_f64();
    let refill_f = RATE as f64 * elapsed * 1000.0 / PERIOD_MS as f64;
    let expected = CAPACITY + refill_f.floor() as u64;
    let per_replica = replica_requests(&envoys, &[honest.port, skewed.port]);
    eprintln!(
        "clock: replica skew {measured_skew} s; {} requests in {elapsed:.3} s, admitted {admitted} \
         (expected {expected}, refill {refill_f:.4} tokens), decisions per replica {per_replica:?}, \
         statuses {:?}, retry-after {:?}..{:?} s, x-ratelimit-reset up to {:?} s",
        run.sent(),
        run.statuses,
        run.retry_after.iter().min(),
        run.retry_after.iter().max(),
        run.reset.iter().max(),
    );

    assert!(
        refill_f < 1.0,
        "the refill over the run must be negligible: {refill_f}"
    );
    assert_eq!(run.other(), 0, "only 200 and 429: {:?}", run.statuses);
    assert_eq!(run.count(200), admitted);
    assert_eq!(admitted, expected, "one bucket: exactly the capacity");
    for (port, n) in &per_replica {
        assert!(
            *n >= 50,
            "replica on port {port} decided only {n} requests: {per_replica:?}"
        );
    }
    // Sane timing values: a denied client is told to wait for one token (one per 90 s) at most, and the
    // bucket is full again within one period. A skewed clock leaking into the math would show here as
    // a wait of about zero or of an hour more.
    let per_token_s = PERIOD_MS.div_ceil(RATE) / 1000;
    assert_eq!(
        run.retry_after.len() as u64,
        run.count(429),
        "every 429 carries Retry-After"
    );
    for ra in &run.retry_after {
        assert!(
            (1..=per_token_s).contains(ra),
            "Retry-After {ra} s outside 1..={per_token_s}"
        );
    }
    for reset in &run.reset {
        assert!(
            *reset <= PERIOD_MS / 1000,
            "X-RateLimit-Reset {reset} s > one period"
        );
    }
}

/// The default transport over two service replicas: a stream per Envoy worker, each take a
/// message on it. One replica is shut down under load (SIGTERM): it answers what it is deciding,
/// ends its streams with UNAVAILABLE, and every worker reopens its stream at once, on the other
/// replica (or, the cluster still listing the one gone, on its refused port first, and then on the
/// other). No client sees a 5xx, the limit holds (failing closed: a failed take is never an
/// admission), the other replica decides everything after, and few takes fail on the way.
#[test]
pub(crate) fn a_replica_shut_down_hands_its_streams_to_the_other() {
    let _serial = serial();
    const N: usize = 2;
    const CAPACITY: u64 = 400;
    let c = Components::get();
    let dir = TempDir::new("replica-shutdown");
    let redis = Redis::start(&c, &dir);
    let mut a = Service::start_with(&c, &dir, Some(&redis.url()), SERVICE_FLAGS);
    let b = Service::start_with(&c, &dir, Some(&redis.url()), SERVICE_FLAGS);
    let upstream = Upstream::start_counting_by(ENVOY_HEADER);
    let cfg = plugin(
        "replicas",
        CAPACITY,
        1,
        3_600_000,
        Plugin::defaults()
            .service("timeout_ms", 1000)
            .remember_denials_ms(0)
            .failure_mode("deny"),
    );
    let envoys = start_fleet(&c, &dir, N, &cfg, &[a.port, b.port], upstream.port);
    let load = Load::round_robin(
        &envoys,
        16,
        Duration::from_secs(4),
        40_000,
        Duration::from_millis(2),
    );
    thread::sleep(Duration::from_millis(1500));
    let streams_on_a = metric_sum(&a.metrics(), "tollgate_streams_open");
    let decided_by_a = metric_sum(&a.metrics(), "tollgate_decisions_total");
    let failed_before = failures(&envoys);
    let shut_down = Instant::now();
    signal(a.proc.pid(), "TERM");
    thread::sleep(Duration::from_millis(500));
    let failed_after_shutdown = failures(&envoys) - failed_before;
    let b_then = metric_sum(&b.metrics(), "tollgate_decisions_total");
    thread::sleep(Duration::from_millis(1000));
    let b_later = metric_sum(&b.metrics(), "tollgate_decisions_total");
    let run = load.finish().tally();
    let gone = a.proc.exited();
    let admitted = upstream.requests();
    let stats = tg_total(&envoys);
    eprintln!(
        "replicas: {} requests in {:.2} s, statuses {:?}, admitted {admitted} of {CAPACITY}; replica A had \
         {streams_on_a} stream(s) open and {decided_by_a} decisions before its shutdown, exited: \
         {gone:?}; takes failed within 500 ms of it: {failed_after_shutdown}; replica B decided \
         {} in the second after; stats {stats:?}",
        run.sent(),
        run.elapsed.as_secs_f64(),
        run.statuses,
        b_later - b_then,
    );
    assert_eq!(run.other(), 0, "only 200 and 429: {:?}", run.statuses);
    assert!(admitted <= CAPACITY, "admitted {admitted} > {CAPACITY}");
    assert!(
        gone.is_some() && shut_down.elapsed() < Duration::from_secs(4),
        "the replica shut down gracefully within its grace period"
    );
    assert!(
        b_later - b_then >= 100,
        "the other replica decided only {} takes in the second after",
        b_later - b_then
    );
    // A message sent as its stream ended, and a reopen that chose the refused port: a few per
    // worker (each failing the takes of one message).
    assert!(
        failed_after_shutdown <= 64,
        "{failed_after_shutdown} takes failed over the shutdown: {stats:?}"
    );
}

/// The sum of a Prometheus metric's samples (every label set) in `text`.
fn metric_sum(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Failed takes over the fleet (every `callout_failure.*`).
fn failures(envoys: &[Envoy]) -> u64 {
    tg_total(envoys)
        .iter()
        .filter(|(k, _)| k.starts_with("callout_failure."))
        .map(|(_, v)| v)
        .sum()
}

/// Requests each `tollgate` cluster endpoint received from all Envoys (admin `/clusters`, `rq_total`).
fn replica_requests(envoys: &[Envoy], ports: &[u16]) -> BTreeMap<u16, u64> {
    let mut out: BTreeMap<u16, u64> = ports.iter().map(|p| (*p, 0)).collect();
    for e in envoys {
        let body = http_get(e.admin_port, "/clusters")
            .map(|r| r.body)
            .unwrap_or_default();
        for line in body.lines() {
            // tollgate::127.0.0.1:PORT::rq_total::N
            let parts: Vec<&str> = line.split("::").collect();
            if parts.len() == 4 && parts[0] == "tollgate" && parts[2] == "rq_total" {
                let port = parts[1]
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.parse::<u16>().ok());
                if let (Some(port), Ok(n)) = (port, parts[3].trim().parse::<u64>()) {
                    *out.entry(port).or_default() += n;
                }
            }
        }
    }
    out
}

/// The `Date` header of `GET /healthz` as Unix seconds.
fn http_date(port: u16) -> Option<i64> {
    parse_http_date(http_get(port, "/healthz")?.header("date")?)
}

/// Parses an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`) to Unix seconds.
fn parse_http_date(s: &str) -> Option<i64> {
    let f: Vec<&str> = s.split_whitespace().collect();
    if f.len() != 6 {
        return None;
    }
    let day: i64 = f[1].parse().ok()?;
    let months = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let month = months.iter().position(|m| *m == f[2])? as i64 + 1;
    let year: i64 = f[3].parse().ok()?;
    let hms: Vec<i64> = f[4].split(':').filter_map(|x| x.parse().ok()).collect();
    if hms.len() != 3 {
        return None;
    }
    // Days from the civil date (proleptic Gregorian), after H. Hinnant's algorithm.
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + hms[0] * 3600 + hms[1] * 60 + hms[2])
}

#[test]
fn http_dates_parse() {
    assert_eq!(
        parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT"),
        Some(784_111_777)
    );
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    assert!(now > 784_111_777);
}
fn stat(stats: &BTreeMap<String, u64>, name: &str) -> u64 {
    stats.get(name).copied().unwrap_or(0)
}

// --------------------------------------------------------------------------------------------
// Sampling the fleet's decision counters over time

/// The fleet's decision counters at one moment.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub at: Instant,
    /// `allowed + limited`. Whether these also count the fallback's decisions or only the
    /// service's, an interval in which they grew by more than `fallback` had service decisions.
    pub decided: u64,
    /// `fallback.allowed + fallback.limited`.
    pub fallback: u64,
}

pub struct Sampler {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    handle: JoinHandle<()>,
}

impl Sampler {
    /// Polls every Envoy's admin `/stats` back to back (a few ms per round), for at most 60 s.
    pub fn start(envoys: &[Envoy]) -> Sampler {
        let admins: Vec<u16> = envoys.iter().map(|e| e.admin_port).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (st, sm) = (stop.clone(), samples.clone());
        let handle = thread::spawn(move || {
            let end = Instant::now() + Duration::from_secs(60);
            while !st.load(Ordering::SeqCst) && Instant::now() < end {
                let mut decided = 0;
                let mut fallback = 0;
                for port in &admins {
                    // Not `Envoy::tg_all`: an admin hiccup leaves a gap here instead of a panic.
                    for (k, v) in tollgate_stats_at(*port).unwrap_or_default() {
                        match k.as_str() {
                            "allowed" | "limited" => decided += v,
                            "fallback.allowed" | "fallback.limited" => fallback += v,
                            _ => {}
                        }
                    }
                }
                // The sample is stamped when its round ended: every decision it shows happened
                // no later than that.
                let s = Sample {
                    at: Instant::now(),
                    decided,
                    fallback,
                };
                if let Ok(mut v) = sm.lock() {
                    v.push(s);
                }
                thread::sleep(Duration::from_millis(2));
            }
        });
        Sampler {
            stop,
            samples,
            handle,
        }
    }

    /// The latest sample (waits for the first one).
    pub fn last(&self) -> Sample {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(s) = self.samples.lock().ok().and_then(|v| v.last().copied()) {
                return s;
            }
            assert!(Instant::now() < deadline, "no stats sample within 5 s");
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// The time of the first sample taken from now on that satisfies `cond(previous, sample)`,
    /// waiting up to `limit`.
    pub fn wait_for(
        &self,
        limit: Duration,
        cond: impl Fn(&Sample, &Sample) -> bool,
    ) -> Option<Instant> {
        let from = self.samples.lock().map(|v| v.len()).unwrap_or(0).max(1);
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(v) = self.samples.lock() {
                if let Some(w) = v
                    .get(from - 1..)
                    .and_then(|tail| tail.windows(2).find(|w| cond(&w[0], &w[1])))
                {
                    return Some(w[1].at);
                }
            }
            thread::sleep(Duration::from_millis(2));
        }
        None
    }

    pub fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.handle.join();
        self.samples.lock().map(|v| v.clone()).unwrap_or_default()
    }
}
