//! No file under deploy/ carries a token the real service would start with: every token written
//! there, in every form, is a marker the service refuses.

use super::*;

/// Every bearer token written in `text`: the value of a `token:` key (YAML, or JSON's
/// `"token":`) and the word after `Bearer `. Comment lines, empty values and what stands for a
/// token elsewhere (`{{ ... }}`, `$VAR`, `<token>`) are left out.
fn tokens_in(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        let keys = ["token:", "\"token\":"].into_iter().flat_map(|key| {
            line.match_indices(key)
                .filter(|(at, _)| {
                    line[..*at]
                        .chars()
                        .next_back()
                        .is_none_or(|c| !(c.is_alphanumeric() || "_-.".contains(c)))
                })
                .map(move |(at, _)| &line[at + key.len()..])
        });
        let bearers = line
            .match_indices("Bearer ")
            .map(|(at, _)| &line[at + "Bearer ".len()..]);
        for rest in keys.chain(bearers) {
            let word = rest
                .trim_start()
                .split([' ', ',', '}'])
                .next()
                .unwrap_or("")
                .trim_matches(['"', '\'', '\\']);
            if !word.is_empty() && !word.starts_with(['$', '{', '<']) {
                found.push(word.to_string());
            }
        }
    }
    found
}

/// No file under deploy/ carries a token the service would start with: each manifest's Secret,
/// WasmPlugin, EnvoyExtensionPolicy and EnvoyFilter holds a marker that the real service refuses
/// (a cluster applied as shipped has no token anyone could know). The check itself finds tokens
/// in every form they take there and tells a real token from a marker.
#[test]
fn no_manifest_carries_a_token_the_service_accepts() {
    let c = Components::get();
    let dir = TempDir::new("deploy-tokens");
    // The check can fail: it finds each form, and the service starts with a real token.
    let sample = "  token: tok-a\n    {\"token\": \"tok-b\", \"x\": 1}\n  value: Bearer tok-c\n\
                  # token: not-one\n  automountServiceAccountToken: false\n  token: \"{{ x }}\"\n\
                  fail \"service.token: with ...\"\n";
    assert_eq!(tokens_in(sample), ["tok-a", "tok-b", "tok-c"]);
    let real = "Zx8Qm2LrT5vN0kWc7HdJ4pYs1FgB9aEu6tRoXi3MqVnKbLhC";
    assert_eq!(service_takes_token(&c.server, &dir, "real", real), Ok(()));

    let mut files = Vec::new();
    all_files(&workspace_root().join("deploy"), &mut files);
    let mut places = Vec::new();
    for f in &files {
        let Ok(text) = fs::read_to_string(f) else {
            continue;
        };
        for token in tokens_in(&text) {
            places.push((
                f.strip_prefix(workspace_root()).unwrap_or(f).to_path_buf(),
                token,
            ));
        }
    }
    for shipped in [
        "deploy/kubernetes/tollgate.yaml",
        "deploy/istio/wasmplugin.yaml",
        "deploy/istio/wasmplugin-grpc.yaml",
        "deploy/istio/envoyfilter-ratelimit.yaml",
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
    ] {
        assert!(
            places.iter().any(|(f, _)| f == Path::new(shipped)),
            "no token found in {shipped}: {places:?}"
        );
    }
    let mut tokens: Vec<&String> = places.iter().map(|(_, t)| t).collect();
    tokens.sort();
    tokens.dedup();
    for (i, token) in tokens.into_iter().enumerate() {
        let at: Vec<_> = places
            .iter()
            .filter(|(_, t)| t == token)
            .map(|(f, _)| f)
            .collect();
        let said = service_takes_token(&c.server, &dir, &format!("shipped-{i}"), token)
            .err()
            .unwrap_or_else(|| panic!("the service starts with {token:?}, shipped in {at:?}"));
        assert!(
            said.contains("the bearer token (--token, TOLLGATE_TOKEN or --token-file)"),
            "{token:?} ({at:?}) refused for another reason:\n{said}"
        );
        eprintln!("{token:?}, in {at:?}: refused by the service");
    }
}

/// Every file under `dir`, recursively.
fn all_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            all_files(&p, out);
        } else {
            out.push(p);
        }
    }
}
