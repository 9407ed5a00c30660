//! The `tollgate-server` binary: flags, tracing, bind, store, [`tollgate_server::run`]; or
//! `tollgate-server check` ([`tollgate_server::check`]).
//!
//! - `copy`: the static (musl) build's `memcpy`, linked in place of musl's.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tollgate_server::cli::{Cli, Command, LogFormat, StartupError};
use tollgate_server::run;
use tollgate_server::store::memory::MemoryStore;
use tollgate_server::store::redis::{redact_url, RedisConfig, RedisStore, SentinelConfig};
use tollgate_server::store::Store;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{registry, Layer};

/// mimalloc: about a tenth of the service's CPU went to glibc malloc/free under load.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(all(target_arch = "x86_64", any(test, target_env = "musl")))]
mod copy;

/// The static build's `memcpy` ([`copy`]): linked before musl's, it takes its place (and
/// `memmove`'s forward copies, which musl makes through it).
///
/// # Safety
/// As C's `memcpy`: `src` readable and `dst` writable for `n` bytes, the ranges disjoint.
#[cfg(all(target_env = "musl", target_arch = "x86_64"))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller's promise, as for libc's.
    unsafe { copy::copy(dst, src, n) };
    dst
}

/// musl's `memmove` copies forward through `__memcpy_fwd`, which its `memcpy` object defines
/// beside `memcpy`: defined here too, that object is not linked at all. [`copy`] is a correct
/// forward copy for a destination below an overlapping source (the short copies read everything
/// before writing; `rep movsb` copies forward byte by byte).
///
/// # Safety
/// `src` readable and `dst` writable for `n` bytes, `dst` not inside `src + 1 .. src + n`.
#[cfg(all(target_env = "musl", target_arch = "x86_64"))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __memcpy_fwd(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller's promise (memmove's forward case).
    unsafe { copy::copy(dst, src, n) };
    dst
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Check(args)) = &cli.command {
        return tollgate_server::check::main(args);
    }
    // RUST_LOG: a level, or `target=level` pairs (`info,tollgate_server=debug`); anything else
    // is `info`.
    let targets = std::env::var("RUST_LOG")
        .ok()
        .and_then(|s| s.parse::<Targets>().ok())
        .unwrap_or_else(|| Targets::new().with_default(tracing::Level::INFO));
    // Colours only on a terminal: log collectors would store the escape codes.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let layer = tracing_subscriber::fmt::layer().with_ansi(ansi);
    match cli.log_format {
        LogFormat::Json => registry().with(layer.json().with_filter(targets)).init(),
        LogFormat::Text => registry().with(layer.with_filter(targets)).init(),
    }
    // The CPUs this process may run on (its affinity, its cgroup's quota): tokio's own default.
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let one_thread = cli.runtime.one_thread(cli.worker_threads, cpus);
    let mut rt = if one_thread {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut rt = tokio::runtime::Builder::new_multi_thread();
        if cli.worker_threads > 0 {
            rt.worker_threads(cli.worker_threads);
        }
        rt
    };
    rt.enable_all();
    tracing::info!(
        runtime = if one_thread {
            "current-thread"
        } else {
            "multi-thread"
        },
        cpus,
        "runtime"
    );
    let rt = match rt.build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the runtime");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(serve(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "exiting");
            ExitCode::FAILURE
        }
    }
}

async fn serve(cli: Cli) -> Result<(), StartupError> {
    let tls = cli.redis_tls()?;
    let config = cli.service_config()?;
    let store: Arc<dyn Store> = if !cli.redis_sentinel.is_empty() {
        let config = RedisConfig {
            url: None,
            cluster: vec![],
            key_prefix: cli.key_prefix.clone(),
            timeout: Duration::from_millis(cli.redis_timeout_ms.max(1)),
            tls,
        };
        let sentinel = SentinelConfig {
            sentinels: cli.redis_sentinel.clone(),
            master: cli.redis_sentinel_master.clone().unwrap_or_default(),
            master_password: cli.redis_master_password.clone(),
        };
        let store = RedisStore::with_sentinel(config, &sentinel)?;
        tracing::info!(
            sentinels = cli.redis_sentinel.len(),
            master = %sentinel.master,
            tls = ?store_tls(&cli),
            "using Redis Sentinel"
        );
        Arc::new(store)
    } else if cli.redis_url.is_some() || !cli.redis_cluster.is_empty() {
        let config = RedisConfig {
            url: cli.redis_url.clone(),
            cluster: cli.redis_cluster.clone(),
            key_prefix: cli.key_prefix.clone(),
            timeout: Duration::from_millis(cli.redis_timeout_ms.max(1)),
            tls,
        };
        let store = RedisStore::new(config)?;
        match &cli.redis_url {
            Some(u) if cli.redis_cluster.is_empty() => {
                tracing::info!(url = %redact_url(u), tls = ?store_tls(&cli), "using Redis")
            }
            _ => tracing::info!(
                nodes = cli.redis_cluster.len(),
                tls = ?store_tls(&cli),
                "using Redis Cluster"
            ),
        }
        Arc::new(store)
    } else {
        tracing::info!("no Redis configured: buckets are kept in memory (one replica only)");
        Arc::new(MemoryStore::with_max_buckets(cli.memory_max_buckets))
    };
    let traces = match &cli.otlp_endpoint {
        Some(endpoint) => {
            let provider = tollgate_server::trace::init(endpoint, cli.otlp_sample_ratio)
                .map_err(StartupError::Otlp)?;
            tracing::info!(endpoint = %endpoint, sample_ratio = cli.otlp_sample_ratio, "exporting traces over OTLP");
            Some(provider)
        }
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(cli.listen)
        .await
        .map_err(|source| StartupError::Listen {
            addr: cli.listen,
            source,
        })?;
    let served = run(listener, store, config, shutdown_signal())
        .await
        .map_err(StartupError::Server);
    if let Some(provider) = traces {
        // The last spans leave before the process does (the batch processor's own thread).
        let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
    }
    served
}

/// How Redis's TLS is set up, for the startup line: off, public roots, or the private CA / client
/// certificate files.
fn store_tls(cli: &Cli) -> String {
    let tls = match &cli.redis_url {
        _ if !cli.redis_sentinel.is_empty() => cli
            .redis_sentinel
            .iter()
            .all(|u| u.starts_with("rediss://")),
        _ if !cli.redis_cluster.is_empty() => {
            cli.redis_cluster.iter().all(|u| u.starts_with("rediss://"))
        }
        Some(u) => u.starts_with("rediss://"),
        None => false,
    };
    if !tls {
        return "off".into();
    }
    let ca = match &cli.redis_tls_ca {
        Some(p) => format!("ca {}", p.display()),
        None => "public roots".into(),
    };
    match &cli.redis_tls_cert {
        Some(p) => format!("{ca}, client certificate {}", p.display()),
        None => ca,
    }
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down");
}
