//! `tollgate-envoy-config`: the Envoy configuration generator ([`tollgate_testkit::envoy`]) for the
//! scripts (benchmarks, demo) and for `make configs`.
//!
//! ```text
//! tollgate-envoy-config checked-in [--write ROOT]   the checked-in configurations: printed, or
//!                                                   written under the repository root ROOT
//! tollgate-envoy-config [OPTION...]                 one bootstrap on stdout
//! ```
//!
//! Options (each maps to a field of `EnvoySpec`; repeat the ones marked *):
//!
//! ```text
//! --listen PORT              the edge listener's port (required)
//! --admin PORT               the admin port (default 0: any; see Envoy's --admin-address-path)
//! --name NAME                the listener's name and stat prefix (edge)
//! --wasm PATH                the module
//! --native PATH              the filter's native build instead (an Envoy dynamic module,
//!                            .../libtollgate.so; Envoy finds it through
//!                            $ENVOY_DYNAMIC_MODULES_SEARCH_PATH, which must name its folder)
//! --plugin-config JSON       the Tollgate filter running --wasm with this configuration
//! --rule JSON *              or with one built by testkit's builder (`plugin::Plugin`): a rule,
//! --service-field NAME=JSON *  a field of its `service` (the `tollgate` cluster's; e.g.
//!                            transport="grpc", timeout_ms=100),
//! --field NAME=JSON *        one of its other top-level fields (e.g. failure_mode="deny")
//! --bare-module NAME         --wasm with no plugin configuration, as VM NAME
//! --failure-policy POLICY    the wasm filter's failure_policy (e.g. FAIL_RELOAD)
//! --dynamic-module NAME      the filter of the dynamic module libNAME.so (found in
//!                            $ENVOY_DYNAMIC_MODULES_SEARCH_PATH, else Envoy's working directory)
//! --dynamic-module-config S  its filter_config, a string
//! --local-ratelimit M,F,S    Envoy's local_ratelimit: max_tokens M, tokens_per_fill F every S s
//! --native-rls DOMAIN        Envoy's ratelimit filter calling the service (RLS), with --rate-limits
//! --rate-limits YAML         the upstream routes' rate_limits (flow YAML)
//! --rls-timeout-ms MS        the RLS call's timeout (2000)
//! --rls-allow-on-failure     let requests through when the RLS call fails (default: 500)
//! --service PORT *           an endpoint of the `tollgate` cluster (HTTP/2)
//! --service-http1            the `tollgate` cluster speaks HTTP/1.1
//! --upstream PORT *          an endpoint of the upstream cluster (round-robin)
//! --upstream-cluster NAME    the upstream cluster's name (upstream)
//! --route-timeout-s S        the upstream route's timeout (Envoy's 15 s)
//! --direct BODY              the route answers 200 BODY itself instead of forwarding
//! --skip-module              the route switches the wasm filter off
//! --request-header NAME=VALUE *   added to every forwarded request
//! --access-log PATH          one line per request: start time (s, ms precision) and status
//! --use-remote-address       the connection manager's use_remote_address: true
//! --stats-flush-s S          the bootstrap's stats_flush_interval
//! --connect-timeout-ms MS    the clusters' connect_timeout (250)
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use tollgate_testkit::envoy::{Action, DynamicModule, EnvoySpec, LocalRateLimit, NativeRls, Route};
use tollgate_testkit::envoy_files;
use tollgate_testkit::plugin::Plugin;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("checked-in") => checked_in(args.get(1..).unwrap_or_default()),
        Some("-h" | "--help") | None => Err(usage()),
        _ => bootstrap(&args).map(|yaml| print!("{yaml}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tollgate-envoy-config: {e}");
            ExitCode::from(2)
        }
    }
}

fn usage() -> String {
    "usage: tollgate-envoy-config checked-in [--write ROOT] | --listen PORT [OPTION...] \
     (the options are listed in testkit/src/bin/tollgate-envoy-config.rs)"
        .to_string()
}

fn checked_in(args: &[String]) -> Result<(), String> {
    let root = match args {
        [] => None,
        [flag, root] if flag == "--write" => Some(PathBuf::from(root)),
        _ => return Err(usage()),
    };
    for (path, text) in envoy_files::checked_in() {
        match &root {
            None => print!("--- {path}\n{text}"),
            Some(root) => {
                let file = root.join(path);
                std::fs::write(&file, text).map_err(|e| format!("{}: {e}", file.display()))?;
                eprintln!("wrote {}", file.display());
            }
        }
    }
    Ok(())
}

fn bootstrap(args: &[String]) -> Result<String, String> {
    let mut spec = EnvoySpec::empty();
    let (mut listen, mut admin, mut wasm) = (None, 0u16, PathBuf::new());
    let mut rate_limits = None;
    let mut route = Route::upstream("/", None);
    let mut plugin: Option<Plugin> = None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--listen" => listen = Some(number(flag, &value()?)?),
            "--admin" => admin = number(flag, &value()?)?,
            "--name" => spec.listener_name = value()?,
            "--wasm" => wasm = PathBuf::from(value()?),
            "--native" => spec.native = Some(PathBuf::from(value()?)),
            "--plugin-config" => spec.plugin_config = Some(value()?),
            "--rule" => plugin = Some(plugin.unwrap_or_else(Plugin::defaults).rule(value()?)),
            "--service-field" | "--field" => {
                let v = value()?;
                let (name, json) = v
                    .split_once('=')
                    .ok_or_else(|| format!("{flag} {v}: expected NAME=JSON"))?;
                let p = plugin.unwrap_or_else(Plugin::defaults);
                plugin = Some(match flag.as_str() {
                    "--field" => p.field(name, json),
                    _ => p.service(name, json),
                });
            }
            "--bare-module" => {
                spec.bare_module = true;
                spec.module_name = value()?;
            }
            "--failure-policy" => spec.failure_policy = Some(value()?),
            "--dynamic-module" => {
                let name = value()?;
                spec.dynamic_module = Some(DynamicModule {
                    filter_name: name.clone(),
                    name,
                    filter_config: None,
                })
            }
            "--dynamic-module-config" => {
                spec.dynamic_module
                    .as_mut()
                    .ok_or_else(|| format!("{flag} comes after --dynamic-module"))?
                    .filter_config = Some(value()?)
            }
            "--local-ratelimit" => spec.local_ratelimit = Some(local_ratelimit(&value()?)?),
            "--native-rls" => spec.native_rls = Some(NativeRls::new(&value()?, "")),
            "--rate-limits" => rate_limits = Some(value()?),
            "--rls-timeout-ms" => rls(&mut spec, flag)?.timeout_ms = number(flag, &value()?)?,
            "--rls-allow-on-failure" => rls(&mut spec, flag)?.failure_mode_deny = false,
            "--service" => spec.service_ports.push(number(flag, &value()?)?),
            "--service-http1" => spec.service_http2 = false,
            "--upstream" => spec.upstream_ports.push(number(flag, &value()?)?),
            "--upstream-cluster" => spec.upstream_cluster = value()?,
            "--route-timeout-s" => {
                route.action = Action::Upstream {
                    timeout_s: Some(number(flag, &value()?)?),
                }
            }
            "--direct" => {
                route.action = Action::Direct {
                    status: 200,
                    body: value()?,
                }
            }
            "--skip-module" => route.skip_module = true,
            "--request-header" => {
                let v = value()?;
                let (k, v) = v
                    .split_once('=')
                    .ok_or_else(|| format!("{flag} {v}: expected NAME=VALUE"))?;
                spec.request_headers.push((k.to_string(), v.to_string()));
            }
            "--access-log" => spec.access_log = Some(value()?),
            "--use-remote-address" => spec.use_remote_address = true,
            "--stats-flush-s" => spec.stats_flush_interval_s = Some(number(flag, &value()?)?),
            "--connect-timeout-ms" => spec.connect_timeout_ms = number(flag, &value()?)?,
            other => return Err(format!("unknown option {other}; {}", usage())),
        }
    }
    let listen = listen.ok_or("--listen is required")?;
    if let Some(p) = plugin {
        if spec.plugin_config.is_some() {
            return Err(
                "--plugin-config and --rule/--service-field/--field exclude each other".into(),
            );
        }
        spec.plugin_config = Some(p.json());
    }
    match (&mut spec.native_rls, rate_limits) {
        (Some(rls), Some(r)) => rls.rate_limits = r,
        (Some(_), None) => return Err("--native-rls needs --rate-limits".to_string()),
        (None, Some(_)) => return Err("--rate-limits needs --native-rls".to_string()),
        (None, None) => {}
    }
    if spec.loads_module() && wasm == Path::new("") {
        return Err("--plugin-config and --bare-module need --wasm".to_string());
    }
    if spec.plugin_config.is_some() && spec.bare_module {
        return Err("--plugin-config and --bare-module exclude each other".to_string());
    }
    if matches!(route.action, Action::Upstream { .. }) && spec.upstream_ports.is_empty() {
        return Err(
            "the route forwards to the upstream: give --upstream PORT, or --direct".to_string(),
        );
    }
    if (spec.plugin_config.is_some() || spec.native_rls.is_some()) && spec.service_ports.is_empty()
    {
        return Err("the filter calls the service: give --service PORT".to_string());
    }
    spec.routes = vec![route];
    Ok(spec.yaml(&wasm, listen, admin))
}

fn rls<'a>(spec: &'a mut EnvoySpec, flag: &str) -> Result<&'a mut NativeRls, String> {
    spec.native_rls
        .as_mut()
        .ok_or_else(|| format!("{flag} comes after --native-rls"))
}

fn number<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("{flag} {v}: not a number in range"))
}

fn local_ratelimit(v: &str) -> Result<LocalRateLimit, String> {
    let parts: Vec<u64> = v
        .split(',')
        .map(|p| number("--local-ratelimit", p))
        .collect::<Result<_, _>>()?;
    match parts[..] {
        [max_tokens, tokens_per_fill, fill_interval_s] => Ok(LocalRateLimit {
            max_tokens,
            tokens_per_fill,
            fill_interval_s,
        }),
        _ => Err(format!("--local-ratelimit {v}: expected MAX,FILL,SECONDS")),
    }
}
