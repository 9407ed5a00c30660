//! Redis Sentinel: the master is asked of the sentinels, connected to, and asked again when it
//! stops being one.
//!
//! The sentinels are asked (`SENTINEL MASTERS`, then `ROLE` on the named master: the redis
//! crate's `SentinelClient`) once, and the master's connection is kept until a command on it
//! fails in a way a failover causes: the connection refused, dropped or timed out, or `READONLY`
//! (a demoted master that kept our connection). Then the master is forgotten and the next command
//! asks the sentinels again. A failed command on a stale master is retried once on the new one
//! when nothing it did can count: after `READONLY` (a replica writes nothing) or a connection
//! that broke (a take the old master ran and did not answer is either lost with it or charged
//! twice: a false denial, never an admission). While no master can be found, commands fail
//! (503 / `UNAVAILABLE`), never "allowed".
//!
//! A failover that leaves the old master running does not break its connections at once: the
//! sentinels reconfigure it as a replica only later (seconds), and until then it takes writes
//! that its new master never sees. So a watcher subscribes to a sentinel's `+switch-master`
//! events and forgets the master as soon as a sentinel announces another one.
//!
//! The sentinels are asked by one task at a time, spawned so that a request that gives up (its
//! timeout) does not cancel it; every request waiting meanwhile shares its answer. A lookup that
//! found no master is not repeated for [`LOOKUP_GAP`]: the commands in between fail with its
//! error, so an outage does not turn every request into a round of questions to the sentinels.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures_util::future::{BoxFuture, FutureExt, Shared};
use redis::aio::MultiplexedConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{AsyncConnectionConfig, RedisError, TlsMode};

use super::conn::{map_err, redact_url, redact_urls, RedisConfigError, RedisTls};
use crate::store::StoreError;

/// Where the sentinels are and which master they watch.
#[derive(Clone)]
pub struct SentinelConfig {
    /// The sentinels, `redis://[user:password@]host:port` (`rediss://` for TLS to them and to the
    /// master). The credentials, if any, authenticate to the sentinels (the same in every URL).
    pub sentinels: Vec<String>,
    /// The master's name in the sentinels' configuration (`sentinel monitor <name> ...`).
    pub master: String,
    /// The password of the master (and of any replica promoted in its place), if it has one.
    pub master_password: Option<String>,
}

impl fmt::Debug for SentinelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelConfig")
            .field("sentinels", &redact_urls(&self.sentinels))
            .field("master", &self.master)
            .field(
                "master_password",
                &self.master_password.as_ref().map(|_| "***"),
            )
            .finish()
    }
}

/// The master in use: its address (for logs) and its connection, numbered so that a failure seen
/// on an old one never forgets a newer one.
#[derive(Clone)]
struct Master {
    generation: u64,
    addr: String,
    conn: MultiplexedConnection,
}

type Lookup = Shared<BoxFuture<'static, Result<Master, StoreError>>>;

/// How long a lookup that found no master stands for the next ones.
const LOOKUP_GAP: Duration = Duration::from_millis(25);

#[derive(Default)]
struct State {
    generation: u64,
    master: Option<Master>,
    /// The lookup under way, shared by every command waiting for a master.
    lookup: Option<Lookup>,
    /// Whether the `+switch-master` watcher was started (with the first lookup).
    watching: bool,
    /// When the last lookup found no master, and why.
    failed: Option<(std::time::Instant, StoreError)>,
}

struct Inner {
    client: tokio::sync::Mutex<SentinelClient>,
    master_name: String,
    connection: AsyncConnectionConfig,
    /// Bound of one lookup (several round trips: the sentinels, the master's ROLE, the connect).
    lookup_timeout: Duration,
    state: Mutex<State>,
}

/// The master's connection, found through the sentinels.
pub(super) struct SentinelConn {
    inner: Arc<Inner>,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // Nothing in this module panics while holding the lock; a poisoned state is still whole.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `e` says the master in use may no longer be the master.
fn stale(e: &RedisError) -> bool {
    read_only(e) || broken(e) || e.is_timeout() || e.is_unrecoverable_error()
}

/// A write refused by a replica: nothing was done.
fn read_only(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
        || e.code() == Some("READONLY")
}

fn broken(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped()
}

impl SentinelConn {
    /// Builds the sentinel client. Connects lazily: the first command asks the sentinels.
    pub(super) fn open(
        config: &SentinelConfig,
        tls: Option<&RedisTls>,
        timeout: Duration,
    ) -> Result<Self, RedisConfigError> {
        let infos = config
            .sentinels
            .iter()
            .map(|u| super::conn::connection_info(u))
            .collect::<Result<Vec<_>, _>>()?;
        let Some(first) = infos.first() else {
            return Err(RedisConfigError::NoUrl);
        };
        if config.master.is_empty() {
            return Err(RedisConfigError::NoSentinelMaster);
        }
        let tls_nodes = infos.iter().filter(|i| super::conn::is_tls(i)).count();
        if tls_nodes != 0 && tls_nodes != infos.len() {
            return Err(RedisConfigError::SentinelMixedSchemes);
        }
        let with_tls = tls_nodes != 0;
        if !with_tls && tls.is_some() {
            return Err(RedisConfigError::SentinelCertsWithoutTls);
        }
        let auth = first.redis_settings();
        if infos.iter().any(|i| {
            i.redis_settings().username() != auth.username()
                || i.redis_settings().password() != auth.password()
        }) {
            return Err(RedisConfigError::SentinelCredentials);
        }
        if with_tls {
            super::conn::install_crypto_provider();
        }
        let tcp = redis::io::tcp::TcpSettings::default().set_nodelay(true);
        let bad = |source| RedisConfigError::BadUrl {
            url: redact_url(&config.sentinels.join(",")),
            source,
        };
        let mut b = SentinelClientBuilder::new(
            infos.iter().map(|i| i.addr().clone()),
            &config.master,
            SentinelServerType::Master,
        )
        .map_err(bad)?
        .set_client_to_sentinel_tcp_settings(tcp.clone())
        .set_client_to_redis_tcp_settings(tcp);
        if let Some(user) = auth.username() {
            b = b.set_client_to_sentinel_username(user);
        }
        if let Some(password) = auth.password() {
            b = b.set_client_to_sentinel_password(password);
        }
        if let Some(password) = &config.master_password {
            b = b.set_client_to_redis_password(password);
        }
        if with_tls {
            b = b.set_client_to_redis_tls_mode(TlsMode::Secure);
            if let Some(tls) = tls {
                b = b
                    .set_client_to_sentinel_certificates(tls.certificates())
                    .set_client_to_redis_certificates(tls.certificates());
            }
        }
        let client = b.build().map_err(bad)?;
        Ok(SentinelConn {
            inner: Arc::new(Inner {
                client: tokio::sync::Mutex::new(client),
                master_name: config.master.clone(),
                connection: AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout)),
                lookup_timeout: (timeout * 4).max(Duration::from_millis(200)),
                state: Mutex::new(State::default()),
            }),
        })
    }

    /// Runs `f` on the master's connection; forgets the master when the error says it may have
    /// changed, and runs `f` once more on the new one when the first try cannot have counted.
    pub(super) async fn query<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: Fn(MultiplexedConnection) -> Fut,
        Fut: Future<Output = Result<T, RedisError>>,
    {
        let mut retried = false;
        loop {
            let master = self.master().await?;
            match f(master.conn).await {
                Err(e) if stale(&e) => {
                    self.forget(master.generation, &master.addr, &e);
                    if retried || !(read_only(&e) || broken(&e)) {
                        return Err(map_err(e));
                    }
                    retried = true;
                }
                r => return r.map_err(map_err),
            }
        }
    }

    /// The master in use, or the answer of a lookup (this one's or the one under way).
    async fn master(&self) -> Result<Master, StoreError> {
        let lookup = {
            let mut state = lock(&self.inner.state);
            if let Some(m) = &state.master {
                return Ok(m.clone());
            }
            if let Some((at, e)) = &state.failed {
                if state.lookup.is_none() && at.elapsed() < LOOKUP_GAP {
                    return Err(e.clone());
                }
            }
            if !state.watching {
                state.watching = true;
                tokio::spawn(Inner::watch(Arc::downgrade(&self.inner)));
            }
            state
                .lookup
                .get_or_insert_with(|| Inner::spawn_lookup(&self.inner))
                .clone()
        };
        lookup.await
    }

    fn forget(&self, generation: u64, addr: &str, e: &RedisError) {
        let mut state = lock(&self.inner.state);
        if state.master.as_ref().map(|m| m.generation) == Some(generation) {
            state.master = None;
            tracing::warn!(master = %addr, error = %e, "Redis master lost; asking the sentinels again");
        }
    }
}

impl Inner {
    fn spawn_lookup(inner: &Arc<Inner>) -> Lookup {
        let inner = Arc::clone(inner);
        let task = tokio::spawn(async move {
            let found = match tokio::time::timeout(inner.lookup_timeout, inner.look_up()).await {
                Ok(r) => r,
                Err(_) => Err(StoreError::Connection(format!(
                    "no answer from the sentinels for master {:?} within {} ms",
                    inner.master_name,
                    inner.lookup_timeout.as_millis()
                ))),
            };
            let mut state = lock(&inner.state);
            state.lookup = None;
            match found {
                Ok((addr, conn)) => {
                    state.failed = None;
                    state.generation += 1;
                    let m = Master {
                        generation: state.generation,
                        addr,
                        conn,
                    };
                    tracing::info!(master = %m.addr, name = %inner.master_name, "using the Redis master the sentinels name");
                    state.master = Some(m.clone());
                    Ok(m)
                }
                Err(e) => {
                    tracing::warn!(name = %inner.master_name, error = %e, "no Redis master found through the sentinels");
                    state.failed = Some((std::time::Instant::now(), e.clone()));
                    Err(e)
                }
            }
        });
        async move {
            task.await.unwrap_or_else(|e| {
                Err(StoreError::Connection(format!(
                    "the sentinel lookup stopped: {e}"
                )))
            })
        }
        .boxed()
        .shared()
    }

    /// Forgets the master in use when a sentinel announces `+switch-master` for ours; resubscribes
    /// (to the first sentinel that answers) when the subscription breaks. Ends with the store.
    async fn watch(inner: Weak<Inner>) {
        use futures_util::StreamExt;
        const TICK: Duration = Duration::from_secs(1);
        loop {
            let Some(me) = inner.upgrade() else { return };
            let subscribed = tokio::time::timeout(me.lookup_timeout, async {
                let client = me.client.lock().await.async_get_sentinel_client().await?;
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe("+switch-master").await?;
                Ok::<_, RedisError>(pubsub)
            })
            .await;
            let name = me.master_name.clone();
            drop(me);
            let Ok(Ok(pubsub)) = subscribed else {
                tokio::time::sleep(TICK / 10).await;
                continue;
            };
            let mut events = pubsub.into_on_message();
            loop {
                match tokio::time::timeout(TICK, events.next()).await {
                    // Quiet: go on while the store lives.
                    Err(_) if inner.strong_count() > 0 => continue,
                    Err(_) => return,
                    // The subscription broke: subscribe again.
                    Ok(None) => break,
                    Ok(Some(msg)) => {
                        // "<name> <old ip> <old port> <new ip> <new port>"
                        let payload: String = msg.get_payload().unwrap_or_default();
                        if payload.split(' ').next() != Some(name.as_str()) {
                            continue;
                        }
                        let Some(me) = inner.upgrade() else { return };
                        let mut state = lock(&me.state);
                        if let Some(m) = state.master.take() {
                            tracing::warn!(master = %m.addr, event = %payload, "the sentinels switched the Redis master");
                        }
                    }
                }
            }
        }
    }

    async fn look_up(&self) -> Result<(String, MultiplexedConnection), StoreError> {
        let client = self
            .client
            .lock()
            .await
            .async_get_client()
            .await
            .map_err(map_err)?;
        let addr = client.get_connection_info().addr().to_string();
        let conn = client
            .get_multiplexed_async_connection_with_config(&self.connection)
            .await
            .map_err(map_err)?;
        Ok((addr, conn))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(sentinels: &[&str], master: &str) -> SentinelConfig {
        SentinelConfig {
            sentinels: sentinels.iter().map(|s| s.to_string()).collect(),
            master: master.into(),
            master_password: Some("masterpw".into()),
        }
    }

    fn refusal(c: &SentinelConfig, tls: Option<&RedisTls>) -> Option<RedisConfigError> {
        SentinelConn::open(c, tls, Duration::from_millis(50)).err()
    }

    #[test]
    fn refuses_what_cannot_reach_one_master() {
        let t = Duration::from_millis(50);
        assert!(SentinelConn::open(&config(&["redis://a:26379"], "m"), None, t).is_ok());
        assert!(matches!(
            refusal(&config(&[], "m"), None),
            Some(RedisConfigError::NoUrl)
        ));
        assert!(matches!(
            refusal(&config(&["redis://a:26379"], ""), None),
            Some(RedisConfigError::NoSentinelMaster)
        ));
        assert!(matches!(
            refusal(&config(&["redis://a:26379", "rediss://b:26379"], "m"), None),
            Some(RedisConfigError::SentinelMixedSchemes)
        ));
        assert!(matches!(
            refusal(
                &config(&["redis://a:26379"], "m"),
                Some(&RedisTls::default())
            ),
            Some(RedisConfigError::SentinelCertsWithoutTls)
        ));
        assert!(matches!(
            refusal(
                &config(&["redis://:x@a:26379", "redis://:y@b:26379"], "m"),
                None
            ),
            Some(RedisConfigError::SentinelCredentials)
        ));
    }

    #[test]
    fn debug_shows_no_password() {
        let dbg = format!("{:?}", config(&["redis://:sentinelpw@a:26379"], "m"));
        assert!(
            !dbg.contains("sentinelpw") && !dbg.contains("masterpw"),
            "{dbg}"
        );
    }
}
