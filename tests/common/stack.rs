//! A whole stack: Redis, the service, a counting upstream and Envoy started together.

use super::envoy::EnvoySpec;
use super::envoy_process::Envoy;
use super::http::{Client, Reply};
use super::process::{Components, TempDir};
use super::redis::Redis;
use super::service::Service;
use super::upstream::Upstream;

/// Redis + service + upstream + Envoy with one plugin configuration; fields drop in reverse order
/// of need (Envoy first).
pub struct Stack {
    pub envoy: Envoy,
    pub upstream: Upstream,
    pub service: Option<Service>,
    pub redis: Option<Redis>,
    pub client: Client,
    pub dir: TempDir,
    pub components: Components,
}

impl Stack {
    /// Starts Redis, the service on it, a counting upstream and Envoy whose `tollgate` cluster points
    /// at the service. `plugin_config` is the JSON of the plugin configuration.
    pub fn start(label: &str, plugin_config: &str) -> Stack {
        Stack::start_with(label, plugin_config, |_| {})
    }

    /// As [`Stack::start`], with `adjust` applied to the Envoy spec first.
    pub fn start_with(
        label: &str,
        plugin_config: &str,
        adjust: impl FnOnce(&mut EnvoySpec),
    ) -> Stack {
        let c = Components::get();
        let dir = TempDir::new(label);
        let redis = Redis::start(&c, &dir);
        let service = Service::start(&c, &dir, Some(&redis.url()));
        let upstream = Upstream::start();
        let mut spec = EnvoySpec::new(Some(plugin_config.to_string()), service.port, upstream.port);
        adjust(&mut spec);
        let envoy = Envoy::start(&c, &dir, &spec);
        Stack {
            envoy,
            upstream,
            service: Some(service),
            redis: Some(redis),
            client: Client::new(),
            dir,
            components: c,
        }
    }

    /// Starts Envoy whose `tollgate` cluster points at `service_port` (a gate, a closed port ...),
    /// with no service or Redis of its own.
    pub fn start_without_service(label: &str, plugin_config: &str, service_port: u16) -> Stack {
        Stack::start_without_service_with(label, plugin_config, service_port, |_| {})
    }

    /// As [`Stack::start_without_service`], with `adjust` applied to the Envoy spec first.
    pub fn start_without_service_with(
        label: &str,
        plugin_config: &str,
        service_port: u16,
        adjust: impl FnOnce(&mut EnvoySpec),
    ) -> Stack {
        let c = Components::get();
        let dir = TempDir::new(label);
        let upstream = Upstream::start();
        let mut spec = EnvoySpec::new(Some(plugin_config.to_string()), service_port, upstream.port);
        adjust(&mut spec);
        let envoy = Envoy::start(&c, &dir, &spec);
        Stack {
            envoy,
            upstream,
            service: None,
            redis: None,
            client: Client::new(),
            dir,
            components: c,
        }
    }

    pub fn url(&self, path: &str) -> String {
        self.envoy.url(path)
    }

    pub fn get(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        self.client.get(&self.url(path), headers)
    }
}
