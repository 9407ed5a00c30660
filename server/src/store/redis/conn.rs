//! How to reach Redis: where it is ([`RedisConfig`]), its timeouts, TLS with rustls (private CA,
//! client certificates), URLs redacted for logs, and a client error as a [`StoreError`]. The
//! connections themselves are `link.rs`'s.

use std::fmt;
use std::time::Duration;

use redis::RedisError;

use crate::store::StoreError;

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

    pub(super) fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self.client.as_ref().map(|c| redis::ClientTlsConfig {
                client_cert: c.cert.clone(),
                client_key: c.key.clone(),
            }),
            root_cert: self.ca.clone(),
        }
    }
}

/// Why a [`RedisConfig`] cannot make a store (found before any connection is tried). URLs in
/// the texts are redacted ([`redact_url`]).
#[derive(Debug, thiserror::Error)]
pub enum RedisConfigError {
    /// The key prefix holds a brace (it would move the hash tag).
    #[error("{0}")]
    KeyPrefix(String),
    /// A TLS file is wrong ([`RedisTls::check`]).
    #[error(transparent)]
    Tls(#[from] TlsFileError),
    /// Neither a URL nor Cluster seed nodes.
    #[error("no Redis URL given")]
    NoUrl,
    /// A URL that does not parse (or a client the redis crate refuses for it).
    #[error("bad Redis URL {url}: {source}")]
    BadUrl {
        /// The URL, redacted.
        url: String,
        /// What the redis crate said.
        source: RedisError,
    },
    /// Cluster seed nodes of both schemes.
    #[error("Redis Cluster seed nodes mix redis:// and rediss://")]
    MixedSchemes,
    /// Sentinels of both schemes.
    #[error("the sentinel URLs mix redis:// and rediss://")]
    SentinelMixedSchemes,
    /// Sentinels given without the name of the master they watch.
    #[error("no Redis Sentinel master name given")]
    NoSentinelMaster,
    /// TLS certificates for sentinels that are not `rediss://`.
    #[error("TLS certificates given for redis:// sentinels (use rediss://)")]
    SentinelCertsWithoutTls,
    /// Sentinel URLs with different credentials (one set authenticates to every sentinel).
    #[error(
        "the sentinel URLs carry different credentials (give the same user and password in each)"
    )]
    SentinelCredentials,
    /// TLS certificates for Cluster seed nodes that are not `rediss://`.
    #[error("TLS certificates given for redis:// Cluster seed nodes (use rediss://)")]
    ClusterCertsWithoutTls,
    /// TLS certificates for a standalone URL that is not `rediss://`.
    #[error("TLS certificates given for {url} (use rediss://)")]
    CertsWithoutTls {
        /// The URL, redacted.
        url: String,
    },
    /// The cluster client refused the seed nodes.
    #[error("bad Redis Cluster seed nodes: {0}")]
    ClusterNodes(RedisError),
    /// The connection manager could not be built.
    #[error("Redis connection manager: {0}")]
    Manager(RedisError),
}

/// rustls needs a process-wide crypto provider before the first handshake, and the redis crate
/// asks for the default one. Installing `ring` when one is already installed is a no-op.
pub(super) fn install_crypto_provider() {
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

/// Each of `urls` redacted ([`redact_url`]).
pub fn redact_urls(urls: &[String]) -> Vec<String> {
    urls.iter().map(|u| redact_url(u)).collect()
}

pub(super) fn map_err(e: RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::Timeout(0)
    } else if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
        StoreError::Connection(e.to_string())
    } else {
        StoreError::Server(e.to_string())
    }
}

/// Parses a URL and turns Nagle's algorithm off: small pipelined commands must not wait for an ACK
/// (with delayed ACKs that is a 40 ms stall).
pub(super) fn connection_info(url: &str) -> Result<redis::ConnectionInfo, RedisConfigError> {
    use redis::IntoConnectionInfo;
    let info = url
        .into_connection_info()
        .map_err(|source| RedisConfigError::BadUrl {
            url: redact_url(url),
            source,
        })?;
    Ok(info.set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true)))
}

pub(super) fn is_tls(info: &redis::ConnectionInfo) -> bool {
    matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. })
}

#[cfg(test)]
mod tests {
    use super::*;

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
