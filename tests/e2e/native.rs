//! The scenarios that run against the filter's native build too (`make native`:
//! `dist/libtollgate.so`, an Envoy dynamic module loaded in the wasm module's place with the same
//! plugin configuration): each test here runs its namesake with `TOLLGATE_FILTER_BUILD=native`
//! (every Envoy it starts loads the native build). One per promise the two builds share:
//!
//! - accuracy: one bucket across a fleet, exact and leasing;
//! - faults: Redis stopped, the service killed and restarted, clients leaving mid-callout;
//! - the fleet: Redis killed under load, a service replica shut down;
//! - a flood of denials answered from memory, still exact;
//! - a slow backend (Redis 30 ms late), a burst held across a fleet (`shape`);
//! - a 429's headers on every transport, a bad configuration refused with its field named.
//!
//! The rest run on the wasm build only: what they check is the core's, which both builds share,
//! or the wasm host's own (its log lines, its gRPC client refusing an HTTP/1 cluster). What the
//! native build does differently is in `src/host/native/mod.rs` and docs/deploy.md (3g): an idle
//! worker's background work waits for its next request (the settlement, lease-refund and
//! slot-release tests watch an idle Envoy), and dynamic metadata is read a namespace's top-level
//! field deep (the JWT claim test reads deeper).

use crate::common::Transport;
use tollgate_testkit::envoy::native_from_env;

/// Every Envoy this test starts loads the native build, which must have been built.
fn native() {
    std::env::set_var("TOLLGATE_FILTER_BUILD", "native");
    let library = native_from_env().unwrap_or_default();
    assert!(
        library.is_file(),
        "TOLLGATE_NATIVE: {} is missing: run `make native`",
        library.display()
    );
}

macro_rules! on_native {
    ($($name:ident => $run:expr),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                native();
                $run;
            }
        )*
    };
}

on_native! {
    fleet_global_mode_is_one_bucket_across_envoys => crate::fleet::global_mode_is_one_bucket_across_envoys(),
    lease_a_lease_fleet_admits_what_exact_mode_admits => crate::lease::a_lease_fleet_admits_what_exact_mode_admits(),
    faults_redis_sigstop => crate::faults::redis_sigstop(),
    faults_service_killed_and_restarted => crate::faults::service_killed_and_restarted(),
    faults_clients_disconnect_mid_callout => crate::faults::clients_disconnect_mid_callout(),
    fleet_redis_killed_under_load_falls_back_then_resumes => crate::fleet::redis_killed_under_load_falls_back_then_resumes(),
    fleet_a_replica_shut_down_hands_its_streams_to_the_other => crate::fleet::a_replica_shut_down_hands_its_streams_to_the_other(),
    fleet_a_flood_of_denials_is_answered_locally_and_still_exact => crate::fleet::a_flood_of_denials_is_answered_locally_and_still_exact(),
    overload_redis_answering_late => crate::overload::redis_answering_late(),
    shaping_a_fleet_bursting_is_spread_exactly => crate::shaping::a_fleet_bursting_is_spread_exactly(),
    limits_limit_enforced_with_headers_http => crate::limits::limit_enforced_with_headers(Transport::Http),
    limits_limit_enforced_with_headers_grpc => crate::limits::limit_enforced_with_headers(Transport::Grpc),
    limits_limit_enforced_with_headers_grpc_unary => crate::limits::limit_enforced_with_headers(Transport::GrpcUnary),
    config_unknown_field => crate::config::unknown_field(),
}

/// How the native build carries the stream of takes (`src/host/native/stream.rs`): with one
/// worker, one HTTP/2 stream to the service, every take a message on it (the service cluster sees
/// one request); with two, each message its own call (Envoy 1.40's map of a configuration's
/// streams has no lock). Either way every take is answered on it: 12 requests, capacity 10, 10
/// admitted.
#[test]
fn one_worker_keeps_one_stream_and_two_send_each_message_alone() {
    native();
    for workers in [1, 2] {
        let cfg = crate::common::config::plugin(
            Transport::Grpc,
            vec![crate::common::config::rule(
                "one-stream",
                &["literal:k"],
                10,
            )],
            serde_json::json!({}),
        );
        let s =
            crate::common::Stack::start_with(&format!("native-stream-{workers}"), &cfg, |spec| {
                spec.concurrency = workers;
            });
        let statuses: Vec<u16> = (0..12)
            .map(|_| s.client.get(&s.url("/"), &[]).status)
            .collect();
        let admitted = statuses.iter().filter(|st| **st == 200).count();
        assert_eq!(admitted, 10, "{workers} worker(s): {statuses:?}");
        assert_eq!(
            statuses.iter().filter(|st| **st == 429).count(),
            2,
            "{statuses:?}"
        );
        let calls = s.envoy.stats("cluster.tollgate.upstream_rq_total");
        let calls = calls
            .get("cluster.tollgate.upstream_rq_total")
            .copied()
            .unwrap_or(0);
        if workers == 1 {
            assert_eq!(calls, 1, "one stream for 12 takes");
        } else {
            // A call per message (a remembered denial may answer the last request here).
            assert!(calls >= 10, "a call per message: {calls}");
        }
        assert_eq!(s.envoy.tg("callout_failure.timeout"), 0);
        eprintln!("{workers} worker(s): {calls} call(s) to the service for 12 takes, statuses {statuses:?}");
    }
}
