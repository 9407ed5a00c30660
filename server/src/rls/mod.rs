//! Envoy's rate limit service (RLS v3): `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`,
//! served on the service's one port beside `tollgate.v1.RateLimiter/Take`, so Envoy's native
//! `envoy.filters.http.ratelimit` filter (and Istio's and Envoy Gateway's global rate limiting) can
//! use Tollgate unchanged. The messages are generated from `server/proto/envoy/`, the subset of
//! Envoy's API the service implements.
//!
//! | file | what |
//! |---|---|
//! | `config.rs` | the limits file (envoyproxy/ratelimit's YAML format plus `algorithm` and `burst`) and the descriptor lookup |
//! | `reload.rs` | the file loaded at startup and whenever it changes; a bad file is refused, the old limits stay |
//! | `pb.rs` | the generated messages and server trait, in modules named as Envoy's packages |
//! | `migrating.rs` (tests) | docs/migrating.md's limits files load and mean what the page says |
//! | `service.rs` | descriptors to one all-or-nothing take (checks by a take that cannot pass, `charge: response` through settle), statuses as envoyproxy/ratelimit's, response headers with `--rls-headers` |

pub mod config;
#[cfg(test)]
mod migrating;
pub mod pb;
pub mod reload;
pub mod service;

pub use reload::LimitsFile;
pub use service::RlsService;
