//! The connection the store sends its commands on: standalone (a `ConnectionManager`), Cluster
//! (the cluster client) or the master Redis Sentinel names (`sentinel.rs`), built from
//! `conn.rs`'s settings.

use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;

use super::conn::{connection_info, install_crypto_provider, is_tls, map_err, redact_url};
use super::conn::{RedisConfig, RedisConfigError};
use super::sentinel::SentinelConn;
use crate::store::StoreError;

pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(Box<ClusterConn>),
    /// The master named by Redis Sentinel (`sentinel.rs`).
    Sentinel(Box<SentinelConn>),
}

pub(super) struct ClusterConn {
    client: redis::cluster::ClusterClient,
    conn: OnceCell<ClusterConnection>,
    /// A second connection for the live-instance registry ([`Store::live_instances`]), so that
    /// its once-a-second call, failing on a node that is down, never disturbs the takes'
    /// connection (its reconnects and slot refreshes).
    side: OnceCell<ClusterConnection>,
}

impl ClusterConn {
    /// The cluster connection, made on first use (a handle to the shared, multiplexed one).
    pub(super) async fn get(&self) -> Result<ClusterConnection, StoreError> {
        let c = self
            .conn
            .get_or_try_init(|| async { self.client.get_async_connection().await.map_err(map_err) })
            .await?;
        Ok(c.clone())
    }

    /// The registry's connection, made on first use.
    pub(super) async fn side(&self) -> Result<ClusterConnection, StoreError> {
        let c = self
            .side
            .get_or_try_init(|| async { self.client.get_async_connection().await.map_err(map_err) })
            .await?;
        Ok(c.clone())
    }
}

impl Conn {
    /// Builds the client for `config` (Cluster when seed nodes are given). Connects lazily: the
    /// first command connects, and the connections reconnect by themselves.
    pub(super) fn open(config: &RedisConfig) -> Result<Conn, RedisConfigError> {
        let t = config.timeout;
        let conn = if !config.cluster.is_empty() {
            let nodes = config
                .cluster
                .iter()
                .map(|u| connection_info(u))
                .collect::<Result<Vec<_>, _>>()?;
            let tls_nodes = nodes.iter().filter(|n| is_tls(n)).count();
            if tls_nodes != 0 && tls_nodes != nodes.len() {
                return Err(RedisConfigError::MixedSchemes);
            }
            if tls_nodes == 0 && config.tls.is_some() {
                return Err(RedisConfigError::ClusterCertsWithoutTls);
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
                .map_err(RedisConfigError::ClusterNodes)?;
            Conn::Cluster(Box::new(ClusterConn {
                client,
                conn: OnceCell::new(),
                side: OnceCell::new(),
            }))
        } else {
            let url = config.url.as_deref().ok_or(RedisConfigError::NoUrl)?;
            let info = connection_info(url)?;
            if is_tls(&info) {
                install_crypto_provider();
            }
            let client = match &config.tls {
                Some(_) if !is_tls(&info) => {
                    return Err(RedisConfigError::CertsWithoutTls {
                        url: redact_url(url),
                    })
                }
                Some(tls) => redis::Client::build_with_tls(info, tls.certificates()),
                None => redis::Client::open(info),
            }
            .map_err(|source| RedisConfigError::BadUrl {
                url: redact_url(url),
                source,
            })?;
            let cm = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(Some(t))
                .set_response_timeout(Some(t))
                .set_number_of_retries(1)
                .set_min_delay(Duration::from_millis(5))
                .set_max_delay(t);
            let manager = ConnectionManager::new_lazy_with_config(client, cm)
                .map_err(RedisConfigError::Manager)?;
            Conn::Single(manager)
        };
        Ok(conn)
    }
}
