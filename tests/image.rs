//! The OCI images, end to end: `scripts/image.sh` builds them from the real `dist/tollgate.wasm`,
//! `dist/libtollgate.so` and the static service binary, a real registry (Debian's `docker-registry` on 127.0.0.1) receives them
//! from `skopeo copy`, and they are pulled back over the registry HTTP API the way Istio's agent
//! pulls a `WasmPlugin` (`pkg/wasm/imagefetcher.go`): manifest, classification by media types, one
//! blob. What was pulled then runs: the module in real Envoy, the binary as a process.
//!
//! Layout:
//! - tools and builds: [`tool`], [`build_images`], [`sha256_file`]
//! - [`Registry`]: a private registry process, [`push`] (skopeo), [`Registry::manifest`],
//!   [`Registry::blob`] (HTTP API, digests checked like go-containerregistry does)
//! - [`extract_wasm`]: Istio's agent's three accepted forms, in its order
//! - tests: reproducible digests; both filter forms pulled, byte-identical and limiting in Envoy;
//!   the native build's image pulled, byte-identical, labelled with its Envoy and limiting in it;
//!   the service image static, non-root, shell-less and running.
//!
//! Every tool is required: a missing one fails the test (`make images` installs them).

// A test fails by panicking; the workspace lints deny that for the module, not here.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::config::rule;
use common::*;
use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TAG: &str = "0.1.0";
const MT_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MT_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const MT_OCI_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const MT_DOCKER_LAYER: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
const MT_WASM_LAYER: &str = "application/vnd.module.wasm.content.layer.v1+wasm";
const MT_WASM_CONFIG: &str = "application/vnd.module.wasm.config.v1+json";

// ---------------------------------------------------------------------------------------------
// Tools and builds

/// A required command-line tool: fails the test when it cannot be run.
fn tool(name: &str) -> Command {
    let probe = Command::new(name)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    assert!(
        probe.is_ok(),
        "{name} is missing: run `make images` (scripts/tools.sh image). Image tests do not skip."
    );
    Command::new(name)
}

/// Runs `cmd`, failing the test with its output unless it exits 0; returns stdout.
fn run(mut cmd: Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A real component (env var, else the workspace default); missing = test failure.
fn required(var: &str, default_rel: &str) -> PathBuf {
    required_component(
        var,
        default_rel,
        ": run `make image` (it builds the module and the static binary). \
         Image tests need the real component and do not skip.",
    )
}

/// The static (musl) service binary the server image is built from.
fn static_server() -> PathBuf {
    required("TOLLGATE_SERVER_STATIC", "dist/tollgate-server-static")
}

fn native_library() -> PathBuf {
    required("TOLLGATE_NATIVE", "dist/libtollgate.so")
}

/// The module, and Envoy to run it (the other harness components are not used here).
fn components() -> Components {
    let wasm = required("TOLLGATE_WASM", "dist/tollgate.wasm");
    Components {
        envoy: required("TOLLGATE_ENVOY", ".tools/envoy"),
        redis_server: PathBuf::new(),
        server: static_server(),
        wasm,
    }
}

/// `scripts/image.sh OUT` from the real module and binary at a fixed SOURCE_DATE_EPOCH; returns
/// digests.txt as name -> (digest, manifest size).
fn build_images(out: &Path, epoch: u64) -> Vec<(String, String, u64)> {
    let c = components();
    let mut cmd = tool("bash");
    cmd.arg(workspace_root().join("scripts/image.sh"))
        .arg(out)
        .env("TOLLGATE_WASM", &c.wasm)
        .env("TOLLGATE_SERVER_STATIC", static_server())
        .env("TOLLGATE_NATIVE", native_library())
        .env("SOURCE_DATE_EPOCH", epoch.to_string())
        .env("TOLLGATE_IMAGE_TAG", TAG);
    run(cmd);
    let text = fs::read_to_string(out.join("digests.txt")).expect("digests.txt");
    let rows: Vec<(String, String, u64)> = text
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 3, "digests.txt line {l:?}");
            (
                f[0].to_string(),
                f[1].to_string(),
                f[2].parse().expect("size"),
            )
        })
        .collect();
    assert_eq!(rows.len(), 4, "four images in {text}");
    rows
}

fn digest_of(rows: &[(String, String, u64)], name: &str) -> String {
    rows.iter()
        .find(|r| r.0 == name)
        .map(|r| r.1.clone())
        .unwrap_or_else(|| panic!("{name} not in {rows:?}"))
}

/// `sha256:<hex>` of a file (coreutils; the test crate carries no hash library).
fn sha256_file(path: &Path) -> String {
    let mut cmd = tool("sha256sum");
    cmd.arg(path);
    let out = run(cmd);
    format!("sha256:{}", out.split_whitespace().next().unwrap_or(""))
}

fn sha256_bytes(dir: &TempDir, bytes: &[u8]) -> String {
    let p = dir.path().join("hash-input");
    fs::write(&p, bytes).expect("write");
    sha256_file(&p)
}

/// Every file under `dir` (relative path) with its digest, sorted: two builds compared byte for byte.
fn tree(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).expect("read_dir") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).expect("prefix").display().to_string();
                out.push((rel, sha256_file(&p)));
            }
        }
    }
    out.sort();
    out
}

// ---------------------------------------------------------------------------------------------
// A registry

/// `docker-registry serve` with a config bound to 127.0.0.1 on a free port, no auth, storage in the
/// test's directory. Killed on drop.
struct Registry {
    port: u16,
    _proc: Proc,
    agent: ureq::Agent,
}

impl Registry {
    fn start(dir: &TempDir) -> Registry {
        let port = free_port();
        let storage = dir.path().join("registry-data");
        fs::create_dir_all(&storage).expect("registry dir");
        let config = dir.path().join("registry.yml");
        fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                 http:\n  addr: 127.0.0.1:{port}\n",
                storage.display()
            ),
        )
        .expect("registry config");
        let mut cmd = tool("docker-registry");
        cmd.arg("serve").arg(&config);
        let mut proc = Proc::spawn("docker-registry", cmd, dir.path().join("registry.log"));
        if wait_until("docker-registry", &mut proc, || {
            http_get_status(port, "/v2/") == Some(200)
        })
        .is_err()
        {
            panic!("docker-registry exited before it was ready (log above)");
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(20)))
            .build()
            .into();
        Registry {
            port,
            _proc: proc,
            agent,
        }
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// GET /v2/<repo>/manifests/<reference> with the Accept list go-containerregistry sends:
    /// (body, Content-Type, Docker-Content-Digest).
    fn manifest(&self, repo: &str, reference: &str) -> (Vec<u8>, String, String) {
        let url = format!("http://{}/v2/{repo}/manifests/{reference}", self.host());
        let mut resp = self
            .agent
            .get(&url)
            .header(
                "Accept",
                "application/vnd.oci.image.manifest.v1+json,application/vnd.oci.image.index.v1+json,\
                 application/vnd.docker.distribution.manifest.v2+json,\
                 application/vnd.docker.distribution.manifest.list.v2+json",
            )
            .call()
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        assert_eq!(resp.status().as_u16(), 200, "GET {url}");
        let header = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        let (ct, dcd) = (header("content-type"), header("docker-content-digest"));
        let body = resp
            .body_mut()
            .with_config()
            .limit(1 << 20)
            .read_to_vec()
            .expect("manifest body");
        (body, ct, dcd)
    }

    /// GET /v2/<repo>/blobs/<digest>, checking size and digest as the agent's client does.
    fn blob(&self, dir: &TempDir, repo: &str, desc: &Value) -> Vec<u8> {
        let digest = desc["digest"].as_str().expect("descriptor digest");
        let url = format!("http://{}/v2/{repo}/blobs/{digest}", self.host());
        let mut resp = self
            .agent
            .get(&url)
            .call()
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        assert_eq!(resp.status().as_u16(), 200, "GET {url}");
        let body = resp
            .body_mut()
            .with_config()
            .limit(512 << 20)
            .read_to_vec()
            .expect("blob body");
        assert_eq!(
            Some(body.len() as u64),
            desc["size"].as_u64(),
            "size of {digest}"
        );
        assert_eq!(sha256_bytes(dir, &body), digest, "content of blob {digest}");
        body
    }
}

/// `skopeo copy oci:<layout>:<tag> docker://<registry>/<name>:<tag>`; returns the manifest digest
/// skopeo reports for what it pushed (`--digestfile`).
fn push(dir: &TempDir, layout: &Path, reg: &Registry, name: &str) -> String {
    let digestfile = dir.path().join(format!("{name}.digest"));
    let mut cmd = tool("skopeo");
    cmd.args(["copy", "--quiet", "--dest-tls-verify=false", "--digestfile"])
        .arg(&digestfile)
        .arg(format!("oci:{}:{TAG}", layout.join(name).display()))
        .arg(format!("docker://{}/{name}:{TAG}", reg.host()));
    run(cmd);
    fs::read_to_string(&digestfile)
        .expect("digestfile")
        .trim()
        .to_string()
}

/// Pulls `name:TAG`: the manifest checked against the digest the push reported (what a WasmPlugin
/// `sha256` pins), then parsed.
fn pull_manifest(dir: &TempDir, reg: &Registry, name: &str, pushed: &str) -> Value {
    let (body, content_type, dcd) = reg.manifest(name, TAG);
    assert_eq!(
        dcd, pushed,
        "{name}: Docker-Content-Digest is the pushed digest"
    );
    assert_eq!(sha256_bytes(dir, &body), pushed, "{name}: sha256(manifest)");
    // Pulling by digest, as Istio does once `sha256` is set, gives the same manifest.
    let (by_digest, _, _) = reg.manifest(name, pushed);
    assert_eq!(by_digest, body, "{name}: manifest by digest");
    let m: Value = serde_json::from_slice(&body).expect("manifest JSON");
    assert_eq!(m["schemaVersion"], 2, "{name}: {m}");
    assert_eq!(content_type, MT_OCI_MANIFEST, "{name}: manifest media type");
    m
}

// ---------------------------------------------------------------------------------------------
// Istio's agent: which image forms it accepts, and where the module is in each

#[derive(Debug, PartialEq)]
enum Variant {
    /// Docker manifest, last layer a Docker tar+gzip holding plugin.wasm.
    DockerCompat,
    /// OCI manifest, last layer an OCI tar+gzip holding plugin.wasm (`FROM scratch` + `COPY`).
    OciCompat,
    /// Exactly two layers, one typed as a Wasm module, its blob the raw module.
    OciArtifact,
}

/// The module in a pulled image, tried in the agent's order; `Err` says why no form matched.
fn extract_wasm(
    dir: &TempDir,
    reg: &Registry,
    repo: &str,
    m: &Value,
) -> Result<(Variant, Vec<u8>), String> {
    let layers = m["layers"].as_array().cloned().unwrap_or_default();
    let last_type = |l: &[Value]| {
        l.last()
            .and_then(|d| d["mediaType"].as_str().map(String::from))
    };
    if m["mediaType"] == MT_DOCKER_MANIFEST {
        return match last_type(&layers).as_deref() {
            Some(MT_DOCKER_LAYER) => {
                let blob = reg.blob(dir, repo, layers.last().expect("layer"));
                Ok((Variant::DockerCompat, plugin_from_tar_gz(dir, &blob)?))
            }
            other => Err(format!("docker image, last layer {other:?}")),
        };
    }
    let compat = match last_type(&layers).as_deref() {
        Some(MT_OCI_LAYER) => {
            let blob = reg.blob(dir, repo, layers.last().expect("layer"));
            plugin_from_tar_gz(dir, &blob).map(|w| (Variant::OciCompat, w))
        }
        other => Err(format!("compat: last layer {other:?}, not {MT_OCI_LAYER}")),
    };
    let compat_err = match compat {
        Ok(found) => return Ok(found),
        Err(e) => e,
    };
    if layers.len() != 2 {
        return Err(format!("{compat_err}; oci: {} layers, not 2", layers.len()));
    }
    match layers.iter().find(|l| l["mediaType"] == MT_WASM_LAYER) {
        Some(l) => Ok((Variant::OciArtifact, reg.blob(dir, repo, l))),
        None => Err(format!("{compat_err}; oci: no {MT_WASM_LAYER} layer")),
    }
}

/// The agent's `extractWasmPluginBinary`: the first entry whose base name is `plugin.wasm`.
fn plugin_from_tar_gz(dir: &TempDir, blob: &[u8]) -> Result<Vec<u8>, String> {
    let (list, out) = untar(dir, blob, "compat-layer");
    let entry = list
        .iter()
        .find(|n| Path::new(n.as_str()).file_name().and_then(|f| f.to_str()) == Some("plugin.wasm"))
        .ok_or_else(|| format!("plugin.wasm not in layer {list:?}"))?;
    fs::read(out.join(entry)).map_err(|e| e.to_string())
}

/// Lists and unpacks a tar+gzip blob into a fresh directory: (entry names, directory).
fn untar(dir: &TempDir, blob: &[u8], label: &str) -> (Vec<String>, PathBuf) {
    let file = dir.path().join(format!("{label}.tar.gz"));
    let out = dir.path().join(label);
    let _ = fs::remove_dir_all(&out);
    fs::create_dir_all(&out).expect("mkdir");
    fs::write(&file, blob).expect("write blob");
    let mut list = tool("tar");
    list.arg("-tzf").arg(&file);
    let names = run(list).lines().map(String::from).collect();
    let mut x = tool("tar");
    x.arg("-xzf").arg(&file).arg("-C").arg(&out);
    run(x);
    (names, out)
}

/// The filter `c` names (or `adjust` puts in its place) limits in real Envoy: capacity 1, the
/// service unreachable, so the fallback bucket answers 200, then 429 with `Retry-After`.
fn one_allowed_one_limited(
    c: &Components,
    dir: &TempDir,
    name: &str,
    adjust: impl FnOnce(&mut EnvoySpec),
) {
    let config = Plugin::defaults()
        .service("timeout_ms", 200)
        .rule(rule("image-check", &["literal:all"], 1))
        .failure_mode("fallback")
        .fallback(1, 100);
    let mut spec = EnvoySpec::new(Some(config.json()), closed_port(), closed_port());
    spec.answer_directly("direct\n");
    spec.concurrency = 1;
    adjust(&mut spec);
    let envoy = Envoy::start(c, dir, &spec);
    let client = Client::new();
    let first = client.get(&envoy.url("/"), &[]);
    let second = client.get(&envoy.url("/"), &[]);
    assert_eq!(
        (first.status, second.status),
        (200, 429),
        "{name}: one allowed, one limited: {first:?} {second:?}"
    );
    assert!(
        second.header("retry-after").is_some(),
        "{name}: Retry-After on the 429: {second:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Tests

/// Same inputs, same SOURCE_DATE_EPOCH: byte-identical layouts and digests. Another epoch changes
/// them, so the fixed timestamps are what makes the build reproducible.
#[test]
fn images_are_reproducible() {
    let dir = TempDir::new("image-repro");
    let (a, b, c) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    let first = build_images(&a, 1_700_000_000);
    let second = build_images(&b, 1_700_000_000);
    assert_eq!(first, second, "digests of two builds");
    assert_eq!(tree(&a), tree(&b), "every blob of two builds");
    let later = build_images(&c, 1_700_000_001);
    for name in [
        "tollgate-filter-compat",
        "tollgate-filter",
        "tollgate-native",
        "tollgate-server",
    ] {
        assert_ne!(
            digest_of(&first, name),
            digest_of(&later, name),
            "{name}: the timestamp is part of the image"
        );
    }
    for (name, digest, size) in &first {
        eprintln!("{name}: {digest} (manifest {size} bytes)");
    }
}

/// Both filter forms: pushed, pulled back as Istio's agent does, byte-identical to
/// dist/tollgate.wasm, and the pulled module limits in real Envoy (capacity 1 and the service
/// unreachable: the fallback bucket answers 200, then 429).
#[test]
fn filter_images_pull_like_istio_and_limit_in_envoy() {
    let c = components();
    let want = fs::read(&c.wasm).expect("read module");
    let dir = TempDir::new("image-filter");
    let layouts = dir.path().join("layouts");
    let digests = build_images(&layouts, 1_700_000_000);
    let reg = Registry::start(&dir);

    for (name, variant) in [
        ("tollgate-filter-compat", Variant::OciCompat),
        ("tollgate-filter", Variant::OciArtifact),
    ] {
        let pushed = push(&dir, &layouts, &reg, name);
        assert_eq!(
            pushed,
            digest_of(&digests, name),
            "{name}: skopeo kept the manifest"
        );
        let m = pull_manifest(&dir, &reg, name, &pushed);
        let layers = m["layers"].as_array().expect("layers");
        match variant {
            Variant::OciCompat => {
                assert_eq!(layers.len(), 1, "compat: exactly one layer: {m}");
                let blob = reg.blob(&dir, name, &layers[0]);
                let (entries, _) = untar(&dir, &blob, "compat-check");
                assert_eq!(
                    entries,
                    vec!["plugin.wasm"],
                    "what COPY plugin.wasm ./ makes"
                );
            }
            _ => {
                assert_eq!(
                    m["config"]["mediaType"], MT_WASM_CONFIG,
                    "artifact config: {m}"
                );
                let types: Vec<&str> = layers
                    .iter()
                    .filter_map(|l| l["mediaType"].as_str())
                    .collect();
                assert_eq!(
                    types,
                    vec![MT_WASM_CONFIG, MT_WASM_LAYER],
                    "artifact layers"
                );
                let cfg: Value =
                    serde_json::from_slice(&reg.blob(&dir, name, &layers[0])).expect("config");
                assert_eq!(cfg["type"], "envoy_proxy", "runtime config {cfg}");
                // The ABI the config announces is the one the module exports.
                for abi in cfg["abiVersions"].as_array().expect("abiVersions") {
                    let abi = abi.as_str().expect("string").as_bytes();
                    assert!(
                        want.windows(abi.len()).any(|w| w == abi),
                        "the module does not export {cfg}"
                    );
                }
            }
        }
        let (found, module) = extract_wasm(&dir, &reg, name, &m)
            .unwrap_or_else(|e| panic!("{name}: Istio's agent would reject it: {e}"));
        assert_eq!(found, variant, "{name}: classified as");
        assert!(
            module == want,
            "{name}: pulled module differs from {}",
            c.wasm.display()
        );

        // The module as pulled, in real Envoy.
        let pulled = dir.path().join(format!("{name}.wasm"));
        fs::write(&pulled, &module).expect("write pulled module");
        let envoy_c = Components {
            wasm: pulled,
            ..c.clone()
        };
        one_allowed_one_limited(&envoy_c, &dir, name, |_| {});
        eprintln!(
            "{name}: {pushed} pulled as {found:?}, {} bytes, Envoy 200 then 429",
            module.len()
        );
    }

    // The two forms are told apart by media types alone: each is one form, not the other.
    let m = pull_manifest(
        &dir,
        &reg,
        "tollgate-filter",
        &digest_of(&digests, "tollgate-filter"),
    );
    assert_ne!(
        m["layers"][1]["mediaType"], MT_OCI_LAYER,
        "the artifact must not parse as compat"
    );
}

/// The native build's image: pulled back, one layer holding exactly `libtollgate.so`,
/// byte-identical to dist/libtollgate.so, the Envoy version it fits in its annotations and
/// labels; and the library as pulled limits in real Envoy (capacity 1, the service unreachable:
/// 200, then 429).
#[test]
fn native_image_carries_the_library_that_limits_in_envoy() {
    let c = components();
    let want = fs::read(native_library()).expect("read the native build");
    let dir = TempDir::new("image-native");
    let layouts = dir.path().join("layouts");
    let digests = build_images(&layouts, 1_700_000_000);
    let reg = Registry::start(&dir);
    let name = "tollgate-native";
    let pushed = push(&dir, &layouts, &reg, name);
    assert_eq!(
        pushed,
        digest_of(&digests, name),
        "skopeo kept the manifest"
    );
    let m = pull_manifest(&dir, &reg, name, &pushed);
    assert_eq!(
        m["annotations"]["io.tollgate.envoy-version"], "1.40.0",
        "the Envoy it fits: {m}"
    );
    let cfg: Value =
        serde_json::from_slice(&reg.blob(&dir, name, &m["config"])).expect("image config");
    assert_eq!(
        cfg["config"]["Labels"]["io.tollgate.envoy-version"], "1.40.0",
        "labelled as images/native.Dockerfile does: {cfg}"
    );
    let layers = m["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 1, "one layer: {m}");
    let blob = reg.blob(&dir, name, &layers[0]);
    let (entries, root) = untar(&dir, &blob, "native-check");
    assert_eq!(
        entries,
        vec!["libtollgate.so"],
        "what COPY libtollgate.so ./ makes"
    );
    let library = root.join("libtollgate.so");
    assert!(
        fs::read(&library).expect("read pulled library") == want,
        "the pulled library differs from dist/libtollgate.so"
    );

    // The library as pulled, in real Envoy, in the wasm module's place.
    one_allowed_one_limited(&c, &dir, name, |spec| spec.native = Some(library));
    eprintln!("{name}: {pushed}, {} bytes, Envoy 200 then 429", want.len());
}

/// The service image: pulled back, a config that runs as uid 65532 and serves 8081, one layer with
/// only the static binary and passwd/group (no shell), and the binary from it runs.
#[test]
fn server_image_is_static_nonroot_and_runs() {
    let dir = TempDir::new("image-server");
    let layouts = dir.path().join("layouts");
    let digests = build_images(&layouts, 1_700_000_000);
    let reg = Registry::start(&dir);
    let name = "tollgate-server";
    let pushed = push(&dir, &layouts, &reg, name);
    assert_eq!(pushed, digest_of(&digests, name));
    let m = pull_manifest(&dir, &reg, name, &pushed);

    let cfg: Value =
        serde_json::from_slice(&reg.blob(&dir, name, &m["config"])).expect("image config");
    assert_eq!(cfg["os"], "linux");
    assert_eq!(cfg["architecture"], "amd64");
    let run_cfg = &cfg["config"];
    let user = run_cfg["User"].as_str().expect("User set");
    let uid: u32 = user
        .split(':')
        .next()
        .and_then(|u| u.parse().ok())
        .unwrap_or_else(|| panic!("User {user:?} is not a numeric uid (runAsNonRoot needs one)"));
    assert_ne!(uid, 0, "runs as root");
    assert_eq!(
        run_cfg["Entrypoint"],
        json!(["/usr/local/bin/tollgate-server"])
    );
    assert!(
        run_cfg["ExposedPorts"]["8081/tcp"].is_object(),
        "exposes 8081: {cfg}"
    );

    let layers = m["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 1, "one layer: {m}");
    assert_eq!(layers[0]["mediaType"], MT_OCI_LAYER);
    let (mut entries, root) = untar(&dir, &reg.blob(&dir, name, &layers[0]), "rootfs");
    entries.retain(|e| !e.ends_with('/'));
    entries.sort();
    assert_eq!(
        entries,
        vec!["etc/group", "etc/passwd", "usr/local/bin/tollgate-server"],
        "files in the image (no shell, no libc)"
    );
    let passwd = fs::read_to_string(root.join("etc/passwd")).expect("passwd");
    assert!(
        passwd.contains(&format!(":{uid}:")),
        "uid {uid} in /etc/passwd: {passwd}"
    );

    let bin = root.join("usr/local/bin/tollgate-server");
    let elf = fs::read(&bin).expect("binary");
    assert!(
        elf == fs::read(static_server()).expect("static binary"),
        "binary as built"
    );
    assert!(
        !has_interpreter(&elf),
        "the binary is dynamically linked (PT_INTERP)"
    );

    // It runs: --help, then serving /healthz from its memory store on a loopback port.
    let help = Command::new(&bin)
        .arg("--help")
        .env_clear()
        .output()
        .expect("run --help");
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(help.status.success(), "--help: {}", help.status);
    assert!(text.contains("--listen"), "--help lists --listen: {text}");
    let port = free_port();
    let mut cmd = Command::new(&bin);
    cmd.env_clear()
        .env("TOLLGATE_LISTEN", format!("127.0.0.1:{port}"));
    let mut proc = Proc::spawn(
        "the binary from the image",
        cmd,
        dir.log_file("image-server"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while http_get_status(port, "/healthz") != Some(200) {
        assert!(proc.exited().is_none(), "the binary from the image exited");
        assert!(Instant::now() < deadline, "/healthz not 200 within 10 s");
        std::thread::sleep(Duration::from_millis(50));
    }

    // What a container runtime would run: umoci converts the image config to an OCI runtime
    // spec (and refuses a malformed layout).
    let bundle = dir.path().join("bundle");
    let mut unpack = tool("umoci");
    unpack
        .args(["unpack", "--rootless", "--image"])
        .arg(format!("{}:{TAG}", layouts.join(name).display()))
        .arg(&bundle);
    run(unpack);
    let spec: Value =
        serde_json::from_slice(&fs::read(bundle.join("config.json")).expect("runtime spec"))
            .expect("runtime spec JSON");
    assert_eq!(spec["process"]["user"]["uid"], uid, "runtime uid: {spec}");
    assert_eq!(
        spec["process"]["args"],
        json!(["/usr/local/bin/tollgate-server"])
    );
    let env = spec["process"]["env"].to_string();
    assert!(
        env.contains("TOLLGATE_LISTEN=0.0.0.0:8081"),
        "listens beyond loopback in a pod: {env}"
    );
    assert!(
        !bundle.join("rootfs/bin/sh").exists(),
        "a shell in the image"
    );
    eprintln!("{name}: {pushed}, uid {uid}, static, {} bytes", elf.len());
}

/// True when an ELF64 file has a PT_INTERP program header (needs a dynamic loader).
fn has_interpreter(elf: &[u8]) -> bool {
    assert!(
        elf.len() > 64 && &elf[..4] == b"\x7fELF" && elf[4] == 2,
        "not an ELF64 file"
    );
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into().expect("8 bytes")) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    (0..phnum).any(|i| {
        let o = phoff + i * phentsize;
        u32::from_le_bytes(elf[o..o + 4].try_into().expect("4 bytes")) == 3
    })
}
