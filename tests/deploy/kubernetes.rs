//! The Kubernetes manifests under deploy/ against the published schemas: every document valid
//! (custom resources against their CRDs, the rest against Kubernetes' own, strict), a typo'd field
//! failing each validator with the field named, and the RLS ConfigMap's limits file loaded by the
//! real service.

use super::*;

/// Every manifest is valid: custom resources against Istio's / Envoy Gateway's / Gateway API's CRD
/// schemas with no unknown field, every other document against Kubernetes' schemas (strict), and no
/// document left unchecked.
#[test]
fn manifests_match_published_schemas() {
    let v = Validators::get();
    let files = manifests();
    let (crd_text, k8s_text) = v.all_valid(&files);
    for kind in [
        "WasmPlugin/",
        "EnvoyExtensionPolicy/",
        "HTTPRoute/",
        "EnvoyFilter/",
    ] {
        assert!(
            crd_text
                .lines()
                .any(|l| l.starts_with("ok ") && l.contains(kind)),
            "no {kind} checked:\n{crd_text}"
        );
    }
    for kind in [
        "deployment/",
        "service/",
        "poddisruptionbudget/",
        "secret/",
        "namespace/",
        "configmap/",
    ] {
        assert!(
            k8s_text.contains(kind),
            "no {kind} in the manifests:\n{k8s_text}"
        );
    }
}

/// The validators are not rubber stamps: one typo'd field in a copy of each kind of manifest fails,
/// and the failure names the field.
#[test]
fn a_typo_fails_validation() {
    let v = Validators::get();
    let dir = TempDir::new("deploy-typo");
    let root = workspace_root();
    let cases = [
        (
            "deploy/istio/wasmplugin.yaml",
            "  failStrategy:",
            "  failStrategie:",
            "failStrategie",
            true,
        ),
        (
            "deploy/envoy-gateway/envoyextensionpolicy.yaml",
            "    failOpen:",
            "    failopen:",
            "failopen",
            true,
        ),
        (
            "deploy/envoy-gateway/tollgate-route.yaml",
            "    backendRefs:",
            "    backendRef:",
            "backendRef",
            true,
        ),
        (
            "deploy/istio/envoyfilter-ratelimit.yaml",
            "      operation: INSERT_BEFORE",
            "      operatio: INSERT_BEFORE",
            "operatio",
            true,
        ),
        (
            "deploy/kubernetes/tollgate.yaml",
            "        readinessProbe:",
            "        readinesProbe:",
            "readinesProbe",
            false,
        ),
    ];
    for (file, from, to, field, crd) in cases {
        let original = fs::read_to_string(root.join(file)).expect("read manifest");
        assert!(original.contains(from), "{file} has {from:?}");
        let bad = dir.path().join(Path::new(file).file_name().expect("name"));
        fs::write(&bad, original.replacen(from, to, 1)).expect("write");
        let out = if crd {
            v.crds(std::slice::from_ref(&bad))
        } else {
            v.core(std::slice::from_ref(&bad))
        };
        let t = text(&out);
        assert!(!out.status.success(), "{file} with {to:?} passed:\n{t}");
        assert!(t.contains(field), "{file}: the failure names {field}:\n{t}");
    }
}

/// The limits file shipped in the RLS ConfigMap (`data."limits.yaml"`), as the block's text.
fn rls_limits_of(configmap: &str) -> String {
    let mut lines = configmap
        .lines()
        .skip_while(|l| l.trim() != "limits.yaml: |");
    lines
        .next()
        .expect("a `limits.yaml: |` block in the ConfigMap");
    lines
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| format!("{}\n", l.get(4..).unwrap_or("")))
        .collect()
}

/// The limits file of deploy/kubernetes/rls-limits.yaml is accepted by the real service (which
/// refuses to start on a limits file it cannot load), and a typo in it is refused with the field
/// named.
#[test]
fn rls_limits_configmap_loads_in_the_service() {
    let c = Components::get();
    let dir = TempDir::new("deploy-rls-limits");
    let cm = fs::read_to_string(workspace_root().join("deploy/kubernetes/rls-limits.yaml"))
        .expect("read the ConfigMap");
    let limits = rls_limits_of(&cm);
    assert!(limits.contains("domain: edge"), "{limits}");
    let path = dir.path().join("limits.yaml");
    fs::write(&path, &limits).expect("write");
    let arg = path.to_str().expect("UTF-8 path");
    let service = Service::start_with(&c, &dir, None, &["--rls-config", arg]);
    assert!(
        service.proc.log_text().contains("listening"),
        "{}",
        service.proc.log_text()
    );
    drop(service);
    let bad = dir.path().join("bad.yaml");
    fs::write(
        &bad,
        limits.replacen("requests_per_unit", "request_per_unit", 1),
    )
    .expect("write");
    let out = Command::new(&c.server)
        .args(["--listen", "127.0.0.1:0", "--rls-config"])
        .arg(&bad)
        .output()
        .expect("run tollgate-server");
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(t.contains("request_per_unit"), "{t}");
}
