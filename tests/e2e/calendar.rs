//! A calendar quota across its boundary, for real: the service with its clock moved (libfaketime)
//! to eight seconds before the 1st of a month at midnight UTC (Envoy's start fits before it even
//! on a loaded machine), Envoy with its own clock. The month's
//! quota is spent, refused until the 1st and not a moment before, then the new month starts at
//! zero.
//!
//! The service counts in its memory store here, on its own (moved) clock: libfaketime 0.9.10
//! cannot start Debian's redis-server (jemalloc calls `clock_gettime` while the library
//! initialises: "Unexpected recursive calls to clock_gettime()"). Redis's side of a boundary is
//! `server/tests/integration/lua_reference.rs`: the script against the contract's arithmetic on
//! spans whose boundary is within 20 ms of Redis's `TIME`, crossed during the cases.

use crate::common;

use common::config::plugin;
use common::{Client, Components, Envoy, EnvoySpec, Service, TempDir, Transport, Upstream};
use contract::calendar::{civil_from_days, days_from_civil, DAY_MS};
use serde_json::json;
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[test]
fn a_monthly_quota_resets_at_the_first_and_not_before() {
    // The 1st of the month after next, midnight UTC: a boundary in the future whatever today is.
    let (y, m, _) = civil_from_days(now_ms() / DAY_MS);
    let months = y * 12 + i64::from(m) - 1 + 2;
    let first = days_from_civil(months / 12, (months % 12) as u32 + 1, 1) * DAY_MS;
    // The service's clock at 8 s before it, from now on (whole seconds: libfaketime's offset).
    let lead_ms: i64 = 8_000;
    let shift_s = (first - lead_ms - now_ms()) / 1000;
    let offset = format!("+{shift_s}s");
    let boundary_real = first - shift_s * 1000; // when the boundary comes, on the real clock

    let c = Components::get();
    let dir = TempDir::new("calendar-boundary");
    let service = Service::start_skewed(&dir, None, &[], &offset);
    let upstream = Upstream::start();
    let cfg = plugin(
        Transport::Grpc,
        vec![
            json!({"name": "monthly", "key": ["literal:team"], "capacity": 3,
                    "algorithm": "calendar_window", "calendar": "month"}),
        ],
        json!({"service": {"batch": 0}, "response": {"headers": ["x-ratelimit"]}}),
    );
    let envoy = Envoy::start(
        &c,
        &dir,
        &EnvoySpec::new(Some(cfg), service.port, upstream.port),
    );
    let client = Client::new();
    let get = || client.get(&envoy.url("/"), &[]);

    for _ in 0..3 {
        assert_eq!(get().status, 200);
    }
    let r = get();
    assert_eq!(r.status, 429, "the month is spent");
    let left_ms = boundary_real - now_ms();
    assert!(
        left_ms > 1_500,
        "the test reached the boundary too early ({left_ms} ms left)"
    );
    let retry: i64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(
        (retry * 1000 - left_ms).abs() <= 1_500,
        "Retry-After {retry} s, the 1st is {left_ms} ms away"
    );
    // A second before the 1st (room for a loaded machine's delay before the store decides):
    // still this month's, still spent.
    thread::sleep(Duration::from_millis(
        (boundary_real - now_ms() - 1_000).max(0) as u64,
    ));
    assert_eq!(get().status, 429, "not before the 1st");
    // Past it: the new month starts at zero.
    thread::sleep(Duration::from_millis(
        (boundary_real - now_ms() + 300).max(0) as u64,
    ));
    for _ in 0..3 {
        assert_eq!(get().status, 200, "the new month's quota");
    }
    assert_eq!(get().status, 429, "and it is spent in its turn");
}
