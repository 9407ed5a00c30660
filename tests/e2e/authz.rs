//! Limits the authorization layer decides (`from_request`), end to end: real Envoys whose own
//! filters in front of Tollgate write each tenant's number into the request's dynamic metadata, the
//! real service and Redis.
//!
//! - `ext_authz_sets_each_tenants_limit_across_a_fleet`: Envoy's `ext_authz` filter calls an
//!   authorization server this test runs, which answers each tenant's limit in a response header
//!   that `ext_authz` puts in its dynamic metadata; 3 Envoys, two tenants, each gets its own number
//!   exactly; a tenant whose number changes mid-run keeps its count (the bucket carried over to the
//!   new capacity keeping the fraction it held); a number the client sends itself is ignored.
//! - `a_jwt_claim_sets_the_limit`: Envoy's `jwt_authn` verifies HS256 tokens against a local JWKS
//!   and puts their claims in metadata (`payload_in_metadata`); the claim `rl` is the limit, `w` each
//!   request's cost; a token
//!   whose signature does not verify never reaches the limiter's choice of limit.
// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::common;

use common::config::plugin;
use common::upstream::{header_value, next_request};
use common::*;
use serde_json::json;
use std::collections::HashMap;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

/// The header of the authorization server's answer that `ext_authz` copies into its dynamic
/// metadata, and the name the rules read it under.
const LIMIT: &str = "x-tenant-limit";
const AUTHZ: &str = "envoy.filters.http.ext_authz";

/// An HTTP authorization server: every check is allowed; a tenant it knows (`x-tenant`) gets its
/// limit in [`LIMIT`].
struct Authz {
    port: u16,
    limits: Arc<Mutex<HashMap<String, u64>>>,
    checks: Arc<AtomicU64>,
}

impl Authz {
    fn start(limits: &[(&str, u64)]) -> Authz {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let limits = Arc::new(Mutex::new(
            limits.iter().map(|(t, n)| (t.to_string(), *n)).collect(),
        ));
        let checks = Arc::new(AtomicU64::new(0));
        let (l, c) = (limits.clone(), checks.clone());
        thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (l, c) = (l.clone(), c.clone());
                thread::spawn(move || serve_checks(conn, &l, &c));
            }
        });
        Authz {
            port,
            limits,
            checks,
        }
    }

    fn set(&self, tenant: &str, limit: u64) {
        self.limits
            .lock()
            .unwrap()
            .insert(tenant.to_string(), limit);
    }

    /// The `ext_authz` filter, first in the chain, calling this server (`authz` cluster): the
    /// tenant header goes to it, its limit header comes back as dynamic metadata.
    fn filter() -> String {
        format!(
            r#"name: {AUTHZ}
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz
  transport_api_version: V3
  failure_mode_allow: false
  http_service:
    server_uri: {{uri: "http://127.0.0.1/", cluster: authz, timeout: 2s}}
    authorization_request:
      allowed_headers: {{patterns: [{{exact: x-tenant}}]}}
    authorization_response:
      dynamic_metadata_from_headers: {{patterns: [{{exact: {LIMIT}}}]}}
"#
        )
    }

    fn cluster(&self) -> String {
        envoy::cluster("authz", None, &[self.port], 1000, "")
    }
}

fn serve_checks(mut conn: TcpStream, limits: &Mutex<HashMap<String, u64>>, checks: &AtomicU64) {
    let mut buf = Vec::new();
    while let Some((head, _)) = next_request(&mut conn, &mut buf, || false) {
        checks.fetch_add(1, Ordering::SeqCst);
        let limit = header_value(&head, "x-tenant")
            .and_then(|t| limits.lock().unwrap().get(t).copied())
            .map(|n| format!("{LIMIT}: {n}\r\n"))
            .unwrap_or_default();
        let reply = format!("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n{limit}\r\n");
        if conn.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

/// One bucket per tenant (`x-tenant`), 3 by default, its capacity read from `from` (bounded to
/// 1..=1000), an hour to refill (nothing comes back during the test).
fn tenant_rule(from: serde_json::Value) -> serde_json::Value {
    json!({"name": "tenant", "key": ["header:x-tenant"], "capacity": 3, "period_ms": 3_600_000,
           "from_request": {"capacity": from}})
}

/// `n` requests of `tenant` round-robin over `urls` (with `extra` headers), one after the other:
/// how many were admitted.
fn admitted(urls: &[String], tenant: &str, extra: &[(&str, &str)], n: usize) -> usize {
    let client = Client::new();
    let mut headers = vec![("x-tenant", tenant)];
    headers.extend_from_slice(extra);
    (0..n)
        .filter(|i| client.get(&urls[i % urls.len()], &headers).status == 200)
        .count()
}

#[test]
fn ext_authz_sets_each_tenants_limit_across_a_fleet() {
    let c = Components::get();
    let dir = TempDir::new("authz-fleet");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let upstream = Upstream::start();
    let authz = Authz::start(&[("acme", 5), ("globex", 8), ("initech", 10)]);
    let cfg = plugin(
        Transport::Grpc,
        vec![tenant_rule(
            json!({"metadata": [AUTHZ, LIMIT], "min": 1, "max": 1000}),
        )],
        json!({"failure_mode": "deny"}),
    );
    let specs: Vec<EnvoySpec> = (0..3)
        .map(|_| {
            let mut spec = EnvoySpec::new(Some(cfg.clone()), service.port, upstream.port);
            spec.first_http_filters = vec![Authz::filter()];
            spec.extra_clusters = vec![authz.cluster()];
            spec
        })
        .collect();
    let envoys = Envoy::start_all(&c, &dir, &specs);
    let urls: Vec<String> = envoys.iter().map(|e| e.url("/")).collect();

    let acme = admitted(&urls, "acme", &[], 12);
    let globex = admitted(&urls, "globex", &[], 12);
    // The client's own header of the metadata's name is no limit: an unknown tenant gets the
    // rule's 3, whatever it sends.
    let spoofed = admitted(&urls, "hooli", &[(LIMIT, "1000")], 12);
    // initech spends 3 of 10, then its plan drops to 5: 7 of 10 left become 3 of 5 (the fraction
    // held, rounded down); a fresh bucket would give 5, an unchanged one 7.
    let before = admitted(&urls, "initech", &[], 3);
    authz.set("initech", 5);
    let after = admitted(&urls, "initech", &[], 12);
    let defaulted: u64 = envoys
        .iter()
        .map(|e| e.tg("rule.tenant.limit_defaulted"))
        .sum();
    eprintln!(
        "ROW | limits from ext_authz, 3 Envoys | acme (5) {acme}, globex (8) {globex}, unknown with a \
         spoofed header {spoofed} (rule 3), initech 10 -> 5 after 3: {before} + {after} | checks {}, \
         limit_defaulted {defaulted} |",
        authz.checks.load(Ordering::SeqCst)
    );
    assert_eq!((acme, globex), (5, 8), "each tenant its own number");
    assert_eq!(
        spoofed, 3,
        "a client-sent header is not the authorization's metadata"
    );
    assert_eq!(
        (before, after),
        (3, 3),
        "the count carried over to the new number"
    );
    assert_eq!(
        defaulted, 12,
        "every request of the unknown tenant used the rule's own"
    );
}

/// A JWT signed with HMAC-SHA256 over `claims` (the key's id `k1`), or with a signature that does
/// not verify (`forged`).
fn jwt(claims: &serde_json::Value, key: &[u8], forged: bool) -> String {
    let header = b64(br#"{"alg":"HS256","typ":"JWT","kid":"k1"}"#);
    let payload = b64(claims.to_string().as_bytes());
    let input = format!("{header}.{payload}");
    let mut sig = hmac_sha256(key, input.as_bytes());
    if forged {
        sig[0] ^= 1;
    }
    format!("{input}.{}", b64(&sig))
}

fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    use tollgate::core::base::hash::sha256;
    let mut k = [0u8; 64];
    k[..key.len()].copy_from_slice(key);
    let pad = |b: u8| k.iter().map(|x| x ^ b).collect::<Vec<u8>>();
    let inner = sha256(&[pad(0x36), message.to_vec()].concat());
    sha256(&[pad(0x5c), inner.to_vec()].concat())
}

/// base64url without padding.
fn b64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

#[test]
fn a_jwt_claim_sets_the_limit() {
    let c = Components::get();
    let dir = TempDir::new("authz-jwt");
    let redis = Redis::start(&c, &dir);
    let service = Service::start(&c, &dir, Some(&redis.url()));
    let upstream = Upstream::start();
    let key = b"a test key of thirty-two bytes!!";
    let jwks = json!({"keys": [{"kty": "oct", "alg": "HS256", "kid": "k1", "k": b64(key)}]});
    // Verified tokens' claims in metadata; a request without a token goes on (the rule's own
    // limit); a token that does not verify is refused by jwt_authn, before the limiter.
    let filter = format!(
        r#"name: envoy.filters.http.jwt_authn
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
  providers:
    tenants:
      issuer: tenants
      local_jwks: {{inline_string: {jwks}}}
      forward: true
      payload_in_metadata: jwt_payload
  rules:
  - match: {{prefix: /}}
    requires: {{requires_any: {{requirements: [{{provider_name: tenants}}, {{allow_missing: {{}}}}]}}}}
"#,
        jwks = serde_json::to_string(&jwks.to_string()).unwrap(),
    );
    let cfg = plugin(
        Transport::Grpc,
        vec![
            json!({"name": "tenant", "key": ["header:x-tenant"], "capacity": 3,
                    "period_ms": 3_600_000,
                    "from_request": {"capacity": {
                        "metadata": ["envoy.filters.http.jwt_authn", "jwt_payload", "rl"],
                        "max": 6},
                        "cost": {"metadata": ["envoy.filters.http.jwt_authn", "jwt_payload", "w"], "max": 3}}}),
        ],
        json!({"failure_mode": "deny"}),
    );
    let mut spec = EnvoySpec::new(Some(cfg), service.port, upstream.port);
    spec.first_http_filters = vec![filter];
    let envoy = Envoy::start(&c, &dir, &spec);
    let url = [envoy.url("/")];
    let bearer = |rl: u64, forged: bool| {
        format!(
            "Bearer {}",
            jwt(
                &json!({"iss": "tenants", "sub": "t", "rl": rl}),
                key,
                forged
            )
        )
    };

    let gold = bearer(5, false);
    let claimed = admitted(&url, "gold", &[("authorization", &gold)], 8);
    // A claim above `max` is clamped to it.
    let greedy = bearer(500, false);
    let clamped = admitted(&url, "greedy", &[("authorization", &greedy)], 8);
    let none = admitted(&url, "anonymous", &[], 8);
    // A claim prices each request: 2 tokens of 6.
    let heavy = format!(
        "Bearer {}",
        jwt(
            &json!({"iss": "tenants", "sub": "h", "rl": 6, "w": 2}),
            key,
            false
        )
    );
    let weighted = admitted(&url, "heavy", &[("authorization", &heavy)], 8);
    let forged = bearer(500, true);
    let client = Client::new();
    let forged_statuses: Vec<u16> = (0..3)
        .map(|_| {
            client
                .get(
                    &url[0],
                    &[("x-tenant", "forger"), ("authorization", &forged)],
                )
                .status
        })
        .collect();
    let clamped_count = envoy.tg("rule.tenant.limit_clamped");
    eprintln!(
        "ROW | limits from a JWT claim | rl 5: {claimed} of 8, rl 500 (max 6): {clamped} of 8 \
         (limit_clamped {clamped_count}), no token: {none} of 8 (rule 3), rl 6 at w 2 each: \
         {weighted} of 8, forged: {forged_statuses:?} |"
    );
    assert_eq!(claimed, 5, "the claim is the limit");
    assert_eq!(clamped, 6, "a claim above max is clamped");
    assert_eq!(clamped_count, 8);
    assert_eq!(none, 3, "no token: the rule's own");
    assert_eq!(weighted, 3, "the claim is each request's cost");
    assert!(
        forged_statuses.iter().all(|&s| s == 401),
        "a token that does not verify is refused before the limiter: {forged_statuses:?}"
    );
    assert_eq!(
        envoy.tg("rule.tenant.allowed") + envoy.tg("rule.tenant.limited"),
        32,
        "the forged requests never reached the limiter"
    );
}
