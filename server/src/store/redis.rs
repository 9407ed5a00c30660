//! The Redis store: standalone (`redis://`, `rediss://`) or Redis Cluster (seed nodes).
//!
//! # What is guaranteed
//!
//! * **Standalone Redis**: one call of `take.lua` decides and charges every bucket of a request.
//!   Redis runs a script start to finish with nothing interleaved, so a take is atomic and
//!   all-or-nothing: a denied request writes nothing. Concurrent takes from any number of service
//!   replicas never admit more than the limit.
//! * **Redis Cluster**: the buckets of one request may hash to different slots, and one script can
//!   only touch one slot. Buckets are grouped by slot; each group is taken atomically by its own
//!   `take.lua` call (the groups run concurrently). When any group denies or fails, every group
//!   that was charged is given back with `refund.lua` (exactly what it granted, lease included). The limit is never exceeded. The price:
//!   between a charge and its refund (one round trip), a concurrent request may find those tokens
//!   spent and be denied (a rare false denial, never a false admission). If the refund itself fails
//!   (Redis unreachable), those tokens stay spent until they refill: again a denial, never an
//!   admission. A request whose buckets share a slot (one key, or keys of one `{hash tag}`) is as
//!   atomic as on standalone Redis.
//! * **Batches** ([`Store::take_batch`]): on standalone Redis, one call of `take_batch.lua` decides
//!   every take of the batch, one after the other, each exactly as `take.lua` would (both run
//!   `take_one.lua`): one round trip, each take atomic and all-or-nothing (the whole batch is in fact
//!   one atomic script run). A loop in one script rather than a pipeline of EVALSHA: one reply to
//!   read, one script start, and NOSCRIPT recovery stays one retry of one command (a pipeline
//!   could be cut between charged and unknown takes). On a Cluster, takes whose keys share one
//!   slot go in one `take_batch.lua` call per slot; a take spanning slots is taken as a single take
//!   (slot by slot, with refunds); all of them concurrently.
//! * **Outages**: every round trip is bounded by the configured timeout (connect and response; a
//!   Cluster take that must refund makes two round trips); a take that cannot complete is a
//!   [`StoreError`], which the service answers with 503 /
//!   `UNAVAILABLE`, never "allowed". A script whose reply was lost to a timeout may still have
//!   charged its buckets: again a possible false denial only. Connections are multiplexed
//!   (a `ConnectionManager`, or the cluster client) and reconnect by themselves when Redis is back.
//!
//! # TLS
//!
//! `rediss://` URLs (standalone or every Cluster seed) connect with rustls. By default the server
//! certificate must chain to a public (webpki) root; [`RedisTls`] replaces those roots by a private
//! CA bundle (cert-manager, a cloud provider's managed Redis) and adds a client certificate for
//! Redis with `tls-auth-clients yes`. The files are checked once, in [`RedisStore::new`]
//! ([`RedisTls::check`]), so a bad bundle stops the service at startup instead of failing every
//! connect. A failed handshake (unknown CA, missing client certificate) is a connection error like
//! any other: 503 / `UNAVAILABLE`, and `/readyz` reports not ready.
//!
//! # Scripts
//!
//! `take.lua`, `take_batch.lua` (and `refund.lua`) are built by concatenating `prelude.lua` (exact
//! integer arithmetic, the TIME clock), `token_bucket.lua` and `fixed_window.lua` (one file per
//! algorithm), `take_one.lua` (the decision of one take; not in `refund.lua`) and the driver. One script handles a mix of algorithms so that all buckets of a slot are taken in
//! one call. They are sent with EVALSHA; on `NOSCRIPT` (after a restart or `SCRIPT FLUSH`)
//! `redis::Script` loads them (`SCRIPT LOAD`, sent to every primary on a cluster) and retries.
//! Keys are laid out by [`super::keys`]. The reply is turned into decisions by [`decode_take`], a
//! pure function.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Script};
use tokio::sync::OnceCell;

use super::keys::{redis_key, slot};
use super::{Store, StoreError};
use crate::domain::{
    Algorithm, BucketDecision, BucketSpec, SettleDecision, SettleResult, Settlement, TakeDecision,
    SETTLE_ID_TTL_MS,
};

const PRELUDE: &str = include_str!("lua/prelude.lua");
const TOKEN_BUCKET: &str = include_str!("lua/token_bucket.lua");
const FIXED_WINDOW: &str = include_str!("lua/fixed_window.lua");
const TAKE_ONE: &str = include_str!("lua/take_one.lua");
const TAKE: &str = include_str!("lua/take.lua");
const TAKE_BATCH: &str = include_str!("lua/take_batch.lua");
const REFUND: &str = include_str!("lua/refund.lua");
const SETTLE: &str = include_str!("lua/settle.lua");
const INSTANCES: &str = include_str!("lua/instances.lua");

/// The full source of the take script (prelude, algorithms, driver), e.g. for `redis-benchmark`.
pub fn take_script_source() -> String {
    [PRELUDE, TOKEN_BUCKET, FIXED_WINDOW, TAKE_ONE, TAKE].join("\n")
}

/// The full source of the batch script (prelude, algorithms, the take of one request, the loop).
pub fn take_batch_script_source() -> String {
    [PRELUDE, TOKEN_BUCKET, FIXED_WINDOW, TAKE_ONE, TAKE_BATCH].join("\n")
}

/// The full source of the refund script.
pub fn refund_script_source() -> String {
    [PRELUDE, TOKEN_BUCKET, FIXED_WINDOW, REFUND].join("\n")
}

/// The full source of the settle script.
pub fn settle_script_source() -> String {
    [PRELUDE, TOKEN_BUCKET, FIXED_WINDOW, SETTLE].join("\n")
}

/// Where Redis is and how long to wait for it.
#[derive(Clone)]
pub struct RedisConfig {
    /// `redis://[user:password@]host:port[/db]` or `rediss://...` for standalone Redis.
    pub url: Option<String>,
    /// Seed node URLs of a Redis Cluster (takes precedence over `url`).
    pub cluster: Vec<String>,
    /// Prepended to every key (must not contain braces).
    pub key_prefix: String,
    /// Bound of one connect or one command round trip.
    pub timeout: Duration,
    /// CA bundle and client certificate for `rediss://` URLs; `None` = public roots, no client
    /// certificate. Only valid with `rediss://` URLs.
    pub tls: Option<RedisTls>,
}

/// TLS material for `rediss://` connections, PEM as read from files.
#[derive(Clone, Default)]
pub struct RedisTls {
    /// CA certificates to trust instead of the public (webpki) roots.
    pub ca: Option<Vec<u8>>,
    /// Client certificate (chain) and key, for Redis configured with `tls-auth-clients yes`.
    pub client: Option<ClientIdentity>,
}

/// A client certificate chain and its private key, both PEM.
#[derive(Clone)]
pub struct ClientIdentity {
    /// The client certificate first, then any intermediates.
    pub cert: Vec<u8>,
    /// The private key (PKCS#8, PKCS#1 or SEC1).
    pub key: Vec<u8>,
}

impl fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTls")
            .field("ca", &self.ca.as_ref().map(|pem| pem.len()))
            .field("client_cert", &self.client.is_some())
            .finish()
    }
}

/// Which TLS file is wrong, and why (the caller names the file or flag).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsFileError {
    /// The CA bundle.
    #[error("CA bundle: {0}")]
    Ca(String),
    /// The client certificate.
    #[error("client certificate: {0}")]
    Cert(String),
    /// The client private key (unreadable, or not the certificate's key).
    #[error("client key: {0}")]
    Key(String),
}

impl RedisTls {
    /// Checks the PEM: the CA bundle holds at least one certificate usable as a trust anchor;
    /// the client chain holds at least one certificate, the key parses and belongs to the
    /// certificate. What rustls would otherwise only find at the first handshake.
    pub fn check(&self) -> Result<(), TlsFileError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        if let Some(pem) = &self.ca {
            let certs = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| TlsFileError::Ca(format!("bad PEM: {e}")))?;
            if certs.is_empty() {
                return Err(TlsFileError::Ca("no PEM certificate in it".into()));
            }
            let mut roots = rustls::RootCertStore::empty();
            for (i, c) in certs.into_iter().enumerate() {
                roots
                    .add(c)
                    .map_err(|e| TlsFileError::Ca(format!("certificate {}: {e}", i + 1)))?;
            }
        }
        if let Some(id) = &self.client {
            let chain = CertificateDer::pem_slice_iter(&id.cert)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| TlsFileError::Cert(format!("bad PEM: {e}")))?;
            if chain.is_empty() {
                return Err(TlsFileError::Cert("no PEM certificate in it".into()));
            }
            let key = PrivateKeyDer::from_pem_slice(&id.key)
                .map_err(|e| TlsFileError::Key(format!("no usable PEM private key: {e}")))?;
            let provider = rustls::crypto::ring::default_provider();
            let signer = provider
                .key_provider
                .load_private_key(key)
                .map_err(|e| TlsFileError::Key(e.to_string()))?;
            match rustls::sign::CertifiedKey::new(chain, signer).keys_match() {
                Ok(())
                | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {}
                Err(rustls::Error::InconsistentKeys(_)) => {
                    return Err(TlsFileError::Key(
                        "does not belong to the client certificate".into(),
                    ))
                }
                Err(e) => return Err(TlsFileError::Cert(e.to_string())),
            }
        }
        Ok(())
    }

    fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self.client.as_ref().map(|c| redis::ClientTlsConfig {
                client_cert: c.cert.clone(),
                client_key: c.key.clone(),
            }),
            root_cert: self.ca.clone(),
        }
    }
}

/// rustls needs a process-wide crypto provider before the first handshake, and the redis crate
/// asks for the default one. Installing `ring` when one is already installed is a no-op.
fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &self.url.as_deref().map(redact_url))
            .field(
                "cluster",
                &self
                    .cluster
                    .iter()
                    .map(|u| redact_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("key_prefix", &self.key_prefix)
            .field("timeout", &self.timeout)
            .field("tls", &self.tls)
            .finish()
    }
}

/// A Redis URL fit for logs and `Debug`: the password, the query (a `unix://` URL may carry
/// `?pass=`) and any fragment become `***`. The URL is parsed, not cut at some character, so no
/// shape of password (`/`, `@`, `#` in it) shows; one that does not parse at all is shown as its
/// scheme only.
pub fn redact_url(url: &str) -> String {
    let unparseable = || match url.split_once("://") {
        Some((scheme, _))
            if !scheme.is_empty()
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
        {
            format!("{scheme}://*** (unparseable URL, not shown)")
        }
        _ => "*** (unparseable URL, not shown)".to_string(),
    };
    let Ok(mut u) = url::Url::parse(url) else {
        return unparseable();
    };
    if u.password().is_some() && u.set_password(Some("***")).is_err() {
        return unparseable();
    }
    if u.query().is_some() {
        u.set_query(Some("***"));
    }
    if u.fragment().is_some() {
        u.set_fragment(Some("***"));
    }
    // A network URL's path is the database number; anything else there (a mistyped password
    // after a `/`, say) is not shown. A unix socket's path is shown.
    let db_only = u.path().strip_prefix('/').unwrap_or(u.path());
    if matches!(u.scheme(), "redis" | "rediss") && !db_only.bytes().all(|b| b.is_ascii_digit()) {
        u.set_path("/***");
    }
    u.to_string()
}

enum Conn {
    Single(ConnectionManager),
    Cluster(Box<ClusterConn>),
}

struct ClusterConn {
    client: redis::cluster::ClusterClient,
    conn: OnceCell<ClusterConnection>,
    /// A second connection for the live-instance registry ([`Store::live_instances`]), so that
    /// its once-a-second call, failing on a node that is down, never disturbs the takes'
    /// connection (its reconnects and slot refreshes).
    side: OnceCell<ClusterConnection>,
}

impl ClusterConn {
    /// The cluster connection, made on first use (a handle to the shared, multiplexed one).
    async fn get(&self) -> Result<ClusterConnection, StoreError> {
        let c = self
            .conn
            .get_or_try_init(|| async { self.client.get_async_connection().await.map_err(map_err) })
            .await?;
        Ok(c.clone())
    }

    /// The registry's connection, made on first use.
    async fn side(&self) -> Result<ClusterConnection, StoreError> {
        let c = self
            .side
            .get_or_try_init(|| async { self.client.get_async_connection().await.map_err(map_err) })
            .await?;
        Ok(c.clone())
    }
}

/// The Redis [`Store`]. Cheap to share behind an `Arc`.
pub struct RedisStore {
    conn: Conn,
    config: RedisConfig,
    take: Arc<Script>,
    take_batch: Arc<Script>,
    refund: Arc<Script>,
    settle: Arc<Script>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn map_err(e: RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::Timeout(0)
    } else if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
        StoreError::Connection(e.to_string())
    } else {
        StoreError::Server(e.to_string())
    }
}

/// One slot's share of a request: indexes into the request's buckets.
struct Group {
    idx: Vec<usize>,
}

/// What one `take.lua` call answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupReply {
    /// Every bucket of the call could pay, and they were charged.
    pub charged: bool,
    /// Per bucket: the decision (with the tokens charged if the call charged) and the fixed window
    /// index charged (0 for token buckets).
    pub buckets: Vec<(BucketDecision, u64)>,
}

/// Integers per bucket in a `take.lua` reply (and per bucket of its ARGV).
const PER_BUCKET: usize = 6;

/// Turns a `take.lua` reply (see its header) into decisions for `specs` (the call's buckets).
/// `granted` is kept as the script charged it (a refund needs it); [`TakeDecision::from_buckets`]
/// reports 0 for a denied request.
pub fn decode_take(reply: &[i64], specs: &[&BucketSpec]) -> Result<GroupReply, StoreError> {
    if reply.len() != 1 + PER_BUCKET * specs.len() {
        return Err(StoreError::Protocol(format!(
            "take reply has {} integers, expected {}",
            reply.len(),
            1 + PER_BUCKET * specs.len()
        )));
    }
    let num = |v: i64, what: &str| {
        u64::try_from(v).map_err(|_| StoreError::Protocol(format!("negative {what}: {v}")))
    };
    let flag = |v: i64| match v {
        0 => Ok(false),
        1 => Ok(true),
        v => Err(StoreError::Protocol(format!(
            "flag is {v}, expected 0 or 1"
        ))),
    };
    let charged = flag(reply[0])?;
    let mut buckets = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let r = &reply[1 + PER_BUCKET * i..1 + PER_BUCKET * (i + 1)];
        let d = BucketDecision {
            allowed: flag(r[0])?,
            limit: spec.capacity,
            remaining: num(r[1], "remaining")?,
            reset_ms: num(r[2], "reset_ms")?,
            retry_after_ms: num(r[3], "retry_after_ms")?,
            granted: num(r[4], "granted")?,
        };
        if d.allowed && !(spec.cost..=spec.lease).contains(&d.granted) {
            return Err(StoreError::Protocol(format!(
                "granted {} outside {}..={}",
                d.granted, spec.cost, spec.lease
            )));
        }
        buckets.push((d, num(r[5], "mark")?));
    }
    if charged != buckets.iter().all(|(d, _)| d.allowed) {
        return Err(StoreError::Protocol(
            "take reply's overall flag disagrees with its buckets".into(),
        ));
    }
    Ok(GroupReply { charged, buckets })
}

/// Splits a `take_batch.lua` reply into one [`take.lua`-shaped](decode_take) reply per take and
/// decodes each.
pub fn decode_batch(
    reply: &[i64],
    takes: &[&[BucketSpec]],
) -> Result<Vec<TakeDecision>, StoreError> {
    let expected: usize = takes.iter().map(|t| 1 + PER_BUCKET * t.len()).sum();
    if reply.len() != expected {
        return Err(StoreError::Protocol(format!(
            "batch reply has {} integers, expected {expected}",
            reply.len()
        )));
    }
    let mut at = 0;
    let mut out = Vec::with_capacity(takes.len());
    for specs in takes {
        let len = 1 + PER_BUCKET * specs.len();
        let these: Vec<&BucketSpec> = specs.iter().collect();
        let g = decode_take(&reply[at..at + len], &these)?;
        at += len;
        out.push(TakeDecision::from_buckets(
            g.buckets.into_iter().map(|(d, _)| d).collect(),
        ));
    }
    Ok(out)
}

impl RedisStore {
    /// Creates the store. Connects lazily: the service starts (and reports not ready) while Redis
    /// is down, and every take fails fast until it is back.
    pub fn new(config: RedisConfig) -> Result<Self, String> {
        super::keys::check_prefix(&config.key_prefix)?;
        if let Some(tls) = &config.tls {
            tls.check().map_err(|e| e.to_string())?;
        }
        let t = config.timeout;
        let conn = if !config.cluster.is_empty() {
            let nodes = config
                .cluster
                .iter()
                .map(|u| connection_info(u))
                .collect::<Result<Vec<_>, _>>()?;
            let tls_nodes = nodes.iter().filter(|n| is_tls(n)).count();
            if tls_nodes != 0 && tls_nodes != nodes.len() {
                return Err("Redis Cluster seed nodes mix redis:// and rediss://".into());
            }
            if tls_nodes == 0 && config.tls.is_some() {
                return Err(
                    "TLS certificates given for redis:// Cluster seed nodes (use rediss://)".into(),
                );
            }
            if tls_nodes != 0 {
                install_crypto_provider();
            }
            let mut builder = redis::cluster::ClusterClient::builder(nodes);
            if let Some(tls) = &config.tls {
                builder = builder.certs(tls.certificates());
            }
            let client = builder
                .connection_timeout(t)
                .response_timeout(t)
                .retries(1)
                .min_retry_wait(5)
                .max_retry_wait(u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(5))
                .build()
                .map_err(|e| format!("bad Redis Cluster seed nodes: {e}"))?;
            Conn::Cluster(Box::new(ClusterConn {
                client,
                conn: OnceCell::new(),
                side: OnceCell::new(),
            }))
        } else {
            let url = config
                .url
                .as_deref()
                .ok_or_else(|| "no Redis URL given".to_string())?;
            let info = connection_info(url)?;
            if is_tls(&info) {
                install_crypto_provider();
            }
            let client = match &config.tls {
                Some(_) if !is_tls(&info) => {
                    return Err(format!(
                        "TLS certificates given for {} (use rediss://)",
                        redact_url(url)
                    ))
                }
                Some(tls) => redis::Client::build_with_tls(info, tls.certificates()),
                None => redis::Client::open(info),
            }
            .map_err(|e| format!("bad Redis URL {}: {e}", redact_url(url)))?;
            let cm = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(Some(t))
                .set_response_timeout(Some(t))
                .set_number_of_retries(1)
                .set_min_delay(Duration::from_millis(5))
                .set_max_delay(t);
            let manager = ConnectionManager::new_lazy_with_config(client, cm)
                .map_err(|e| format!("Redis connection manager: {e}"))?;
            Conn::Single(manager)
        };
        Ok(RedisStore {
            conn,
            config,
            take: Arc::new(Script::new(&take_script_source())),
            take_batch: Arc::new(Script::new(&take_batch_script_source())),
            refund: Arc::new(Script::new(&refund_script_source())),
            settle: Arc::new(Script::new(&settle_script_source())),
        })
    }

    fn timeout_ms(&self) -> u64 {
        u64::try_from(self.config.timeout.as_millis()).unwrap_or(u64::MAX)
    }

    /// Runs `script` with keys and integer args on the right connection, within the timeout.
    async fn invoke<A: redis::ToRedisArgs>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[A],
    ) -> Result<Vec<i64>, StoreError> {
        // EVALSHA written straight from the keys and integers: `ScriptInvocation` would first copy
        // every key and argument into a buffer of its own, then into the command.
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash())
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        let call = async {
            match &self.conn {
                Conn::Single(m) => {
                    let mut m = m.clone();
                    evalsha(script, &cmd, &mut m).await.map_err(map_err)
                }
                Conn::Cluster(cc) => {
                    let mut c = cc.get().await?;
                    evalsha(script, &cmd, &mut c).await.map_err(map_err)
                }
            }
        };
        match tokio::time::timeout(self.config.timeout, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(StoreError::Timeout(_))) | Err(_) => Err(StoreError::Timeout(self.timeout_ms())),
            Ok(Err(e)) => Err(e),
        }
    }

    async fn take_group(
        &self,
        group: &Group,
        keys: &[String],
        specs: &[BucketSpec],
    ) -> Result<GroupReply, StoreError> {
        let ks: Vec<&str> = group.idx.iter().map(|&i| keys[i].as_str()).collect();
        let mut args = Vec::with_capacity(PER_BUCKET * group.idx.len());
        let mut these = Vec::with_capacity(group.idx.len());
        for &i in &group.idx {
            let b = &specs[i];
            args.extend([
                alg_code(b.algorithm),
                b.capacity,
                b.rate,
                b.period_ms,
                b.cost,
                b.lease,
            ]);
            these.push(b);
        }
        let reply = self.invoke(&self.take, &ks, &args).await?;
        decode_take(&reply, &these)
    }

    /// Decides `takes` with one call of `take_batch.lua`: one round trip, each take atomic. On a
    /// cluster every key of every take must be in one slot.
    async fn batch_call(&self, takes: &[&[BucketSpec]]) -> Result<Vec<TakeDecision>, StoreError> {
        let n: usize = takes.iter().map(|t| t.len()).sum();
        let keys: Vec<String> = takes
            .iter()
            .flat_map(|t| t.iter())
            .map(|b| redis_key(&self.config.key_prefix, b))
            .collect();
        let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut args = Vec::with_capacity(1 + takes.len() + PER_BUCKET * n);
        args.push(takes.len() as u64);
        args.extend(takes.iter().map(|t| t.len() as u64));
        for b in takes.iter().flat_map(|t| t.iter()) {
            args.extend([
                alg_code(b.algorithm),
                b.capacity,
                b.rate,
                b.period_ms,
                b.cost,
                b.lease,
            ]);
        }
        let reply = self.invoke(&self.take_batch, &ks, &args).await?;
        decode_batch(&reply, takes)
    }

    async fn refund_group(
        &self,
        group: &Group,
        keys: &[String],
        specs: &[BucketSpec],
        reply: &GroupReply,
    ) -> Result<(), StoreError> {
        let ks: Vec<&str> = group.idx.iter().map(|&i| keys[i].as_str()).collect();
        let mut args = Vec::with_capacity(6 * group.idx.len());
        for (&i, (d, mark)) in group.idx.iter().zip(&reply.buckets) {
            let b = &specs[i];
            // Give back exactly what was charged: the grant, which is more than cost with a lease.
            args.extend([
                alg_code(b.algorithm),
                b.capacity,
                b.rate,
                b.period_ms,
                d.granted,
                *mark,
            ]);
        }
        self.invoke(&self.refund, &ks, &args).await.map(|_| ())
    }
}

/// Sends `cmd` (an EVALSHA of `script`); on `NOSCRIPT` (Redis restarted, or `SCRIPT FLUSH`) loads
/// the script and sends it once more, as `redis::Script::invoke_async` does.
async fn evalsha<C: redis::aio::ConnectionLike>(
    script: &Script,
    cmd: &redis::Cmd,
    con: &mut C,
) -> Result<Vec<i64>, RedisError> {
    match cmd.query_async::<Vec<i64>>(con).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load_async(con).await?;
            cmd.query_async::<Vec<i64>>(con).await
        }
        r => r,
    }
}

/// Parses a URL and turns Nagle's algorithm off: small pipelined commands must not wait for an ACK
/// (with delayed ACKs that is a 40 ms stall).
fn connection_info(url: &str) -> Result<redis::ConnectionInfo, String> {
    use redis::IntoConnectionInfo;
    let info = url
        .into_connection_info()
        .map_err(|e| format!("bad Redis URL {}: {e}", redact_url(url)))?;
    Ok(info.set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true)))
}

fn is_tls(info: &redis::ConnectionInfo) -> bool {
    matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. })
}

fn alg_code(a: Algorithm) -> u64 {
    match a {
        Algorithm::TokenBucket => 0,
        Algorithm::FixedWindow => 1,
    }
}

impl RedisStore {
    /// Gives tokens back with `refund.lua`, one bucket per call (each in its own slot).
    async fn refund_each(&self, specs: &[BucketSpec]) -> Result<u64, StoreError> {
        let mut n = 0;
        for b in specs
            .iter()
            .filter(|b| b.algorithm == Algorithm::TokenBucket)
        {
            let key = redis_key(&self.config.key_prefix, b);
            let args = [
                alg_code(b.algorithm),
                b.capacity,
                b.rate,
                b.period_ms,
                b.cost,
                0,
            ];
            let reply = self.invoke(&self.refund, &[key.as_str()], &args).await?;
            n += reply.first().map_or(0, |&r| u64::try_from(r).unwrap_or(0));
        }
        Ok(n)
    }
}

impl RedisStore {
    /// Settles the buckets `idx` of `s` (one slot) with one `settle.lua` call. The id's record
    /// takes the hash tag of the group's first bucket, so it shares their slot: a settlement
    /// spanning slots is remembered once per slot, and one resent after a partial failure applies
    /// only the slots it had not reached.
    async fn settle_group(
        &self,
        s: &Settlement,
        idx: &[usize],
        keys: &[String],
    ) -> Result<(bool, Vec<SettleResult>), StoreError> {
        let first = &keys[idx[0]];
        // The prefix holds no brace (keys::check_prefix): the first one opens the bucket's tag.
        let tag = first
            .find('{')
            .map_or(first.as_str(), |open| &first[open..]);
        let record = format!("{}settled:{tag}:{}", self.config.key_prefix, s.id);
        let mut ks: Vec<&str> = Vec::with_capacity(1 + idx.len());
        ks.push(&record);
        ks.extend(idx.iter().map(|&i| keys[i].as_str()));
        let mut args: Vec<i64> = Vec::with_capacity(1 + 7 * idx.len());
        args.push(SETTLE_ID_TTL_MS as i64);
        for &i in idx {
            let b = &s.buckets[i];
            // Every amount is at most 1e9 and a period at most a year: all fit an i64.
            args.extend([
                alg_code(b.bucket.algorithm) as i64,
                b.bucket.capacity as i64,
                b.bucket.rate as i64,
                b.bucket.period_ms as i64,
                b.estimate as i64,
                b.used as i64,
                b.window
                    .map_or(-1, |w| i64::try_from(w).unwrap_or(i64::MAX)),
            ]);
        }
        let reply = self.invoke(&self.settle, &ks, &args).await?;
        decode_settle(&reply, idx.len())
    }
}

/// Turns a `settle.lua` reply (see its header) into whether the id was known and `n` results.
pub fn decode_settle(reply: &[i64], n: usize) -> Result<(bool, Vec<SettleResult>), StoreError> {
    if reply.len() != 1 + 2 * n {
        return Err(StoreError::Protocol(format!(
            "settle reply has {} integers, expected {}",
            reply.len(),
            1 + 2 * n
        )));
    }
    let uint = |v: i64| {
        u64::try_from(v)
            .map_err(|_| StoreError::Protocol(format!("negative value {v} in settle reply")))
    };
    let results = reply[1..]
        .chunks_exact(2)
        .map(|p| {
            Ok(SettleResult {
                remaining: uint(p[0])?,
                debt: uint(p[1])?,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok((reply[0] == 1, results))
}

#[async_trait::async_trait]
impl Store for RedisStore {
    async fn take(&self, specs: &[BucketSpec]) -> Result<TakeDecision, StoreError> {
        let keys: Vec<String> = specs
            .iter()
            .map(|b| redis_key(&self.config.key_prefix, b))
            .collect();
        let groups: Vec<Group> = match self.conn {
            Conn::Single(_) => vec![Group {
                idx: (0..specs.len()).collect(),
            }],
            Conn::Cluster(_) => {
                let mut groups: Vec<(u16, Group)> = Vec::new();
                for (i, k) in keys.iter().enumerate() {
                    let s = slot(k);
                    match groups.iter_mut().find(|(gs, _)| *gs == s) {
                        Some((_, g)) => g.idx.push(i),
                        None => groups.push((s, Group { idx: vec![i] })),
                    }
                }
                groups.into_iter().map(|(_, g)| g).collect()
            }
        };
        if let [group] = groups.as_slice() {
            let reply = self.take_group(group, &keys, specs).await?;
            return Ok(TakeDecision::from_buckets(
                reply.buckets.into_iter().map(|(d, _)| d).collect(),
            ));
        }
        let replies =
            futures_util::future::join_all(groups.iter().map(|g| self.take_group(g, &keys, specs)))
                .await;
        let all_charged = replies.iter().all(|r| matches!(r, Ok(g) if g.charged));
        if !all_charged {
            let refunds = groups.iter().zip(&replies).filter_map(|(g, r)| match r {
                Ok(reply) if reply.charged => Some(self.refund_group(g, &keys, specs, reply)),
                _ => None,
            });
            for r in futures_util::future::join_all(refunds).await {
                if let Err(e) = r {
                    tracing::warn!(error = %e, "refund failed; those tokens stay spent until they refill");
                }
            }
        }
        let mut out: Vec<Option<BucketDecision>> = vec![None; specs.len()];
        for (g, r) in groups.iter().zip(replies) {
            let reply = r?;
            for (&i, (d, _)) in g.idx.iter().zip(reply.buckets) {
                out[i] = Some(d);
            }
        }
        let buckets: Option<Vec<BucketDecision>> = out.into_iter().collect();
        let buckets =
            buckets.ok_or_else(|| StoreError::Protocol("a bucket got no decision".into()))?;
        Ok(TakeDecision::from_buckets(buckets))
    }

    async fn take_batch(&self, takes: &[Vec<BucketSpec>]) -> Result<Vec<TakeDecision>, StoreError> {
        if let Conn::Single(_) = self.conn {
            let all: Vec<&[BucketSpec]> = takes.iter().map(Vec::as_slice).collect();
            return self.batch_call(&all).await;
        }
        // Cluster: takes whose keys share one slot go in one batch call per slot; a take that
        // spans slots is taken as a single take is (slot by slot, with refunds). All concurrently.
        let mut by_slot: Vec<(u16, Vec<usize>)> = Vec::new();
        let mut spanning: Vec<usize> = Vec::new();
        for (i, specs) in takes.iter().enumerate() {
            let mut slots = specs
                .iter()
                .map(|b| slot(&redis_key(&self.config.key_prefix, b)));
            let first = slots.next();
            match first {
                Some(s) if slots.all(|o| o == s) => {
                    match by_slot.iter_mut().find(|(gs, _)| *gs == s) {
                        Some((_, idx)) => idx.push(i),
                        None => by_slot.push((s, vec![i])),
                    }
                }
                _ => spanning.push(i),
            }
        }
        let grouped = futures_util::future::join_all(by_slot.iter().map(|(_, idx)| {
            let these: Vec<&[BucketSpec]> = idx.iter().map(|&i| takes[i].as_slice()).collect();
            async move { self.batch_call(&these).await }
        }));
        let single = futures_util::future::join_all(spanning.iter().map(|&i| self.take(&takes[i])));
        let (grouped, single) = futures_util::future::join(grouped, single).await;
        let mut out: Vec<Option<TakeDecision>> = vec![None; takes.len()];
        for ((_, idx), r) in by_slot.iter().zip(grouped) {
            for (&i, d) in idx.iter().zip(r?) {
                out[i] = Some(d);
            }
        }
        for (&i, r) in spanning.iter().zip(single) {
            out[i] = Some(r?);
        }
        out.into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| StoreError::Protocol("a take got no decision".into()))
    }

    async fn acquire(
        &self,
        specs: &[crate::inflight::SlotSpec],
        slot_id: &str,
    ) -> Result<crate::inflight::AcquireDecision, StoreError> {
        use super::slots;
        static ACQUIRE: std::sync::LazyLock<Script> =
            std::sync::LazyLock::new(|| Script::new(slots::ACQUIRE));
        let keys: Vec<String> = specs
            .iter()
            .map(|s| slots::redis_key(&self.config.key_prefix, &s.key))
            .collect();
        // One call per hash slot (every key in one call on standalone Redis).
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let s = match self.conn {
                Conn::Single(_) => 0,
                Conn::Cluster(_) => slot(k),
            };
            match groups.iter_mut().find(|(gs, _)| *gs == s) {
                Some((_, idx)) => idx.push(i),
                None => groups.push((s, vec![i])),
            }
        }
        let calls = groups.iter().map(|(_, idx)| {
            let ks: Vec<&str> = idx.iter().map(|&i| keys[i].as_str()).collect();
            let these: Vec<&crate::inflight::SlotSpec> = idx.iter().map(|&i| &specs[i]).collect();
            async move {
                let reply = self
                    .invoke(&ACQUIRE, &ks, &slots::acquire_args(&these, slot_id))
                    .await?;
                slots::decode_acquire(&reply, &these)
            }
        });
        let replies = futures_util::future::join_all(calls).await;
        let all = replies.iter().all(|r| matches!(r, Ok((true, _))));
        if !all && groups.len() > 1 {
            // All or nothing across slots: give back what the other slots took.
            for ((_, idx), r) in groups.iter().zip(&replies) {
                if matches!(r, Ok((true, _))) {
                    let ks: Vec<String> = idx.iter().map(|&i| specs[i].key.clone()).collect();
                    if let Err(e) = self.release(slot_id, &ks).await {
                        tracing::warn!(error = %e, "releasing a partial acquire failed; those slots wait for their deadline");
                    }
                }
            }
        }
        let mut out: Vec<Option<crate::inflight::SlotDecision>> = vec![None; specs.len()];
        for ((_, idx), r) in groups.iter().zip(replies) {
            let (taken, ds) = r?;
            for (&i, mut d) in idx.iter().zip(ds) {
                if taken && !all {
                    // Given back above: report the set as it stands.
                    d.in_flight = d.in_flight.saturating_sub(1);
                }
                out[i] = Some(d);
            }
        }
        let buckets: Vec<crate::inflight::SlotDecision> = out
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| StoreError::Protocol("a key got no decision".into()))?;
        Ok(crate::inflight::AcquireDecision::from_buckets(
            buckets, slot_id,
        ))
    }

    async fn release(&self, slot_id: &str, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        use super::slots;
        static RELEASE: std::sync::LazyLock<Script> =
            std::sync::LazyLock::new(|| Script::new(slots::RELEASE));
        let rkeys: Vec<String> = keys
            .iter()
            .map(|k| slots::redis_key(&self.config.key_prefix, k))
            .collect();
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, k) in rkeys.iter().enumerate() {
            let s = match self.conn {
                Conn::Single(_) => 0,
                Conn::Cluster(_) => slot(k),
            };
            match groups.iter_mut().find(|(gs, _)| *gs == s) {
                Some((_, idx)) => idx.push(i),
                None => groups.push((s, vec![i])),
            }
        }
        let mut out = vec![false; keys.len()];
        for (_, idx) in &groups {
            let ks: Vec<&str> = idx.iter().map(|&i| rkeys[i].as_str()).collect();
            let reply = self.invoke(&RELEASE, &ks, &[slot_id]).await?;
            for (&i, r) in idx.iter().zip(slots::decode_release(&reply, idx.len())?) {
                out[i] = r;
            }
        }
        Ok(out)
    }

    async fn refund(&self, buckets: &[BucketSpec]) -> Result<u64, StoreError> {
        self.refund_each(buckets).await
    }

    async fn settle(&self, s: &Settlement) -> Result<SettleDecision, StoreError> {
        let keys: Vec<String> = s
            .buckets
            .iter()
            .map(|b| redis_key(&self.config.key_prefix, &b.bucket))
            .collect();
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let at = match self.conn {
                Conn::Single(_) => 0,
                Conn::Cluster(_) => slot(k),
            };
            match groups.iter_mut().find(|(g, _)| *g == at) {
                Some((_, idx)) => idx.push(i),
                None => groups.push((at, vec![i])),
            }
        }
        let replies = futures_util::future::join_all(
            groups
                .iter()
                .map(|(_, idx)| self.settle_group(s, idx, &keys)),
        )
        .await;
        let mut out = vec![SettleResult::default(); keys.len()];
        let mut duplicate = true;
        for ((_, idx), reply) in groups.iter().zip(replies) {
            let (dup, results) = reply?;
            duplicate &= dup;
            for (&i, r) in idx.iter().zip(results) {
                out[i] = r;
            }
        }
        Ok(SettleDecision {
            duplicate,
            buckets: out,
        })
    }

    async fn live_instances(
        &self,
        seen: &[String],
        ttl_ms: u64,
    ) -> Result<Option<u64>, StoreError> {
        static SCRIPT: std::sync::LazyLock<Script> =
            std::sync::LazyLock::new(|| Script::new(INSTANCES));
        let key = super::keys::instances_key(&self.config.key_prefix);
        let mut args = Vec::with_capacity(1 + seen.len());
        args.push(ttl_ms.to_string());
        args.extend(seen.iter().cloned());
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(SCRIPT.get_hash()).arg(1).arg(&key).arg(&args);
        let call = async {
            match &self.conn {
                Conn::Single(m) => {
                    let mut m = m.clone();
                    evalsha(&SCRIPT, &cmd, &mut m).await.map_err(map_err)
                }
                Conn::Cluster(cc) => {
                    let mut c = cc.side().await?;
                    evalsha(&SCRIPT, &cmd, &mut c).await.map_err(map_err)
                }
            }
        };
        let reply = match tokio::time::timeout(self.config.timeout, call).await {
            Ok(r) => r?,
            Err(_) => return Err(StoreError::Timeout(self.timeout_ms())),
        };
        match reply.as_slice() {
            [n] => u64::try_from(*n)
                .map(Some)
                .map_err(|_| StoreError::Protocol(format!("negative instance count {n}"))),
            r => Err(StoreError::Protocol(format!(
                "instances reply has {} integers, expected 1",
                r.len()
            ))),
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let call = async {
            match &self.conn {
                Conn::Single(m) => {
                    let mut m = m.clone();
                    redis::cmd("PING")
                        .query_async::<String>(&mut m)
                        .await
                        .map_err(map_err)
                }
                Conn::Cluster(cc) => {
                    let mut c = cc.get().await?;
                    redis::cmd("PING")
                        .query_async::<String>(&mut c)
                        .await
                        .map_err(map_err)
                }
            }
        };
        match tokio::time::timeout(self.config.timeout, call).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(StoreError::Timeout(_))) | Err(_) => Err(StoreError::Timeout(self.timeout_ms())),
            Ok(Err(e)) => Err(e),
        }
    }

    fn kind(&self) -> &'static str {
        match self.conn {
            Conn::Single(_) => "redis",
            Conn::Cluster(_) => "redis-cluster",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(cap: u64) -> BucketSpec {
        BucketSpec {
            key: "k".into(),
            capacity: cap,
            rate: cap,
            period_ms: 1000,
            cost: 1,
            algorithm: Algorithm::TokenBucket,
            lease: 1,
        }
    }

    #[test]
    fn decodes_a_reply() {
        let (a, b) = (spec(10), spec(3));
        let g = decode_take(&[0, 1, 9, 100, 0, 1, 0, 0, 2, 5, 7, 0, 42], &[&a, &b]).unwrap_or_else(
            |e| {
                unreachable!("{e}");
            },
        );
        assert!(!g.charged);
        assert_eq!(
            g.buckets,
            vec![
                (
                    BucketDecision {
                        allowed: true,
                        limit: 10,
                        remaining: 9,
                        reset_ms: 100,
                        retry_after_ms: 0,
                        granted: 1
                    },
                    0
                ),
                (
                    BucketDecision {
                        allowed: false,
                        limit: 3,
                        remaining: 2,
                        reset_ms: 5,
                        retry_after_ms: 7,
                        granted: 0
                    },
                    42
                )
            ]
        );
    }

    #[test]
    fn rejects_bad_replies() {
        let a = spec(10);
        assert!(decode_take(&[1, 1, 9, 100, 0, 1], &[&a]).is_err());
        assert!(decode_take(&[1, 1, -9, 100, 0, 1, 0], &[&a]).is_err());
        assert!(decode_take(&[1, 2, 9, 100, 0, 1, 0], &[&a]).is_err());
        assert!(decode_take(&[1, 0, 9, 100, 0, 0, 0], &[&a]).is_err());
        assert!(decode_take(&[0, 1, 9, 100, 0, 1, 0], &[&a]).is_err());
        assert!(
            decode_take(&[1, 1, 9, 100, 0, 2, 0], &[&a]).is_err(),
            "granted above lease"
        );
        assert!(decode_take(&[1, 1, 9, 100, 0, 1, 0], &[&a]).is_ok());
    }

    #[test]
    fn redacts_passwords_of_any_url_shape() {
        // (URL, the secret in it, what is shown)
        let cases = [
            (
                "redis://:s3cret@h:6379/0",
                "s3cret",
                "redis://:***@h:6379/0",
            ),
            (
                "rediss://user:p@ss@h:6380",
                "p@ss",
                "rediss://user:***@h:6380",
            ),
            (
                "redis://:ab/cd@host",
                "ab/cd",
                "redis://*** (unparseable URL, not shown)",
            ),
            (
                "redis://:ab/cd@host:6379/2",
                "ab/cd",
                "redis://*** (unparseable URL, not shown)",
            ),
            (
                "redis://:p#w@h",
                "p#w",
                "redis://*** (unparseable URL, not shown)",
            ),
            (
                "redis://:p?w@h",
                "p?w",
                "redis://*** (unparseable URL, not shown)",
            ),
            ("redis://u:p%2Fw@h", "p%2Fw", "redis://u:***@h"),
            ("redis://:pw@[::1]:6379", "pw@", "redis://:***@[::1]:6379"),
            (
                "redis+unix:///run/r.sock?pass=s3cret",
                "s3cret",
                "redis+unix:///run/r.sock?***",
            ),
            (
                "unix:///run/r.sock?db=1&pass=s3cret",
                "s3cret",
                "unix:///run/r.sock?***",
            ),
            ("redis://h:6379/0#s3cret", "s3cret", "redis://h:6379/0#***"),
            (
                "redis://h:6379/x://:s3cret@y",
                "s3cret",
                "redis://h:6379/***",
            ),
            ("redis://h/0", "s3cret", "redis://h/0"),
            ("s3cret", "s3cret", "*** (unparseable URL, not shown)"),
            (
                ":s3cret@h:6379",
                "s3cret",
                "*** (unparseable URL, not shown)",
            ),
        ];
        for (url, secret, shown) in cases {
            let r = redact_url(url);
            assert!(!r.contains(secret), "{url} -> {r}");
            assert_eq!(r, shown, "{url}");
        }
        assert_eq!(redact_url("redis://h:6379"), "redis://h:6379");
        let c = RedisConfig {
            url: Some("redis://u:topsecret@h".into()),
            cluster: vec!["redis://:pw2@a:1".into(), "redis://:x/pw3@b".into()],
            key_prefix: "t:".into(),
            timeout: Duration::from_millis(50),
            tls: None,
        };
        let dbg = format!("{c:?}");
        assert!(
            !dbg.contains("topsecret") && !dbg.contains("pw2") && !dbg.contains("pw3"),
            "{dbg}"
        );
    }
}
