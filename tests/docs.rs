//! The documentation stays true:
//! - every configuration shown in README.md and docs/*.md is accepted by the parser it belongs to:
//!   filter configurations and rules by the filter's `Config::parse`, Envoy configurations and
//!   excerpts by `envoy --mode validate` with the real module (limits files: server/tests/integration/docs.rs);
//!   a block says which it is in its info string (the convention: testkit's `docs` module), and a
//!   configuration block that does not say is a failure;
//! - every field a rule may hold (the reader's table, `config::rules::RULE_FIELDS`) is documented in
//!   docs/filter-config.md with the kind of rule it belongs to, and no other; so is every field of
//!   the sections with a table (`config::fields`), with its default and upper bound;
//! - every relative link in them resolves (the file, and the heading when it names one);
//! - every module of the crates, and of the test harnesses, is named in its parent's `//!` map.
//!
//! Envoy or the module missing fails the test (`make build`, `make tools`).

// A test fails by panicking; the workspace lints deny that for the module, not here.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::fs;
use std::path::{Path, PathBuf};

use tollgate::core::config::fields;
use tollgate::core::config::rules::{self, Kinds};
use tollgate::core::config::Config;
use tollgate_testkit::docs::{self, list_items, with_routes, Block, Kind};
use tollgate_testkit::envoy::{self, EnvoySpec};
use tollgate_testkit::process::{closed_port, required_component, workspace_root, TempDir};

/// The plugin configuration a rule is shown in, and the one the generated Envoy configurations run.
fn with_rule(rule: &str) -> String {
    format!(r#"{{"service": {{"cluster": "tollgate"}}, "rules": [{rule}]}}"#)
}

// ---------------------------------------------------------------------------------------------
// Code blocks

#[test]
fn every_configuration_block_says_what_it_holds() {
    let blocks = docs::all_blocks();
    let errors: Vec<String> = blocks.iter().filter_map(|b| b.kind().err()).collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    let configs = blocks
        .iter()
        .filter(|b| !matches!(b.kind(), Ok(Kind::Prose | Kind::Partial)))
        .count();
    eprintln!("{} blocks, {configs} configurations checked", blocks.len());
}

#[test]
fn filter_configurations_are_accepted_by_the_filter() {
    let blocks = docs::blocks_of(Kind::Filter);
    assert!(!blocks.is_empty(), "no `json filter` block in the docs");
    let refused = refused_by_the_filter(&blocks, |b| b.text.clone());
    assert!(refused.is_empty(), "{}", refused.join("\n\n"));
}

#[test]
fn rules_are_accepted_by_the_filter() {
    let blocks = docs::blocks_of(Kind::Rule);
    let refused = refused_by_the_filter(&blocks, |b| with_rule(&b.text));
    assert!(refused.is_empty(), "{}", refused.join("\n\n"));
}

fn refused_by_the_filter(blocks: &[Block], config: impl Fn(&Block) -> String) -> Vec<String> {
    blocks
        .iter()
        .filter_map(|b| {
            let json = config(b);
            Config::parse(json.as_bytes())
                .err()
                .map(|e| format!("{}: the filter refuses it: {e}\n{}", b.place(), b.text))
        })
        .collect()
}

/// The check can fail: a rule with a field the filter does not know is refused, and a `json`
/// block that does not say what it holds is reported.
#[test]
fn the_block_checks_refuse_what_is_wrong() {
    let doc = "```json rule\n{\"name\": \"a\", \"capacity\": 5, \"period_ms\": 1000, \"burst\": 2}\n```\n\
               ```json\n{}\n```\n```\n{\"rules\": []}\n```\n```sh\nmake run\n```\n";
    let blocks = docs::blocks("sample.md", doc);
    assert_eq!(blocks.len(), 4);
    assert_eq!(blocks[0].kind(), Ok(Kind::Rule));
    let refused = refused_by_the_filter(&blocks[..1], |b| with_rule(&b.text));
    assert!(refused[0].contains("burst"), "{refused:?}");
    assert!(blocks[1].kind().unwrap_err().contains("sample.md:4"));
    assert!(blocks[2].kind().is_err(), "a bare block starting with {{");
    assert_eq!(blocks[3].kind(), Ok(Kind::Prose));
}

#[test]
fn envoy_configurations_validate() {
    let envoy = required_component(
        "TOLLGATE_ENVOY",
        ".tools/envoy",
        ": run `make tools`. The docs' Envoy configurations are checked by Envoy itself.",
    );
    let wasm = required_component(
        "TOLLGATE_WASM",
        "dist/tollgate.wasm",
        ": run `make build`. Envoy's validate mode loads the module.",
    );
    let dir = TempDir::new("docs-envoy");
    let mut checked = 0;
    for (i, b) in docs::all_blocks().iter().enumerate() {
        let yaml = match b.kind().unwrap_or_else(|e| panic!("{e}")) {
            Kind::Envoy => envoy::with_module(&b.text, &wasm),
            Kind::EnvoyHttpFilters => {
                let mut spec = generated();
                spec.extra_http_filters = list_items(&b.text);
                assert!(
                    !spec.extra_http_filters.is_empty(),
                    "{}: no filter in the list",
                    b.place()
                );
                spec.yaml(&wasm, closed_port(), closed_port())
            }
            Kind::EnvoyRoutes => with_routes(
                &generated().yaml(&wasm, closed_port(), closed_port()),
                &b.text,
            )
            .unwrap_or_else(|e| panic!("{}: {e}", b.place())),
            _ => continue,
        };
        let path = dir.path().join(format!("envoy-{i}.yaml"));
        fs::write(&path, &yaml).expect("write");
        if let Err(out) = envoy::validate(&envoy, &path) {
            panic!(
                "{}: Envoy refuses it:\n{}\n--- as validated:\n{yaml}\n--- Envoy:\n{out}",
                b.place(),
                b.text
            );
        }
        checked += 1;
    }
    eprintln!("{checked} Envoy blocks validated");
}

/// The bootstrap an excerpt is placed in: the Tollgate filter with one rule, the `tollgate`
/// cluster over HTTP/2, the upstream.
fn generated() -> EnvoySpec {
    let plugin = with_rule(r#"{"name": "docs", "capacity": 5, "period_ms": 1000}"#);
    EnvoySpec::new(Some(plugin), closed_port(), closed_port())
}

// ---------------------------------------------------------------------------------------------
// Rule fields

/// The part of `doc` under the first heading that starts with `heading` (`## ...`), up to the next
/// heading of its level or above.
fn section<'a>(doc: &'a str, heading: &str) -> &'a str {
    let level = heading.len() - heading.trim_start_matches('#').len();
    let start = doc
        .find(&format!("\n{heading}"))
        .unwrap_or_else(|| panic!("no heading {heading:?}"))
        + 1;
    let body = &doc[start..];
    let end = body
        .match_indices("\n#")
        .find(|(i, _)| {
            let line = &body[i + 1..];
            let hashes = line.len() - line.trim_start_matches('#').len();
            hashes <= level && line[hashes..].starts_with(' ')
        })
        .map_or(body.len(), |(i, _)| i);
    &body[..end]
}

/// The first cells of the first table in `text`, without their backticks (header and separator
/// rows left out).
fn table_fields(text: &str) -> Vec<String> {
    text.lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .filter_map(|l| l.split('|').nth(1))
        .map(|c| c.trim().trim_matches('`').to_string())
        .collect()
}

fn sorted(names: impl IntoIterator<Item = impl Into<String>>) -> Vec<String> {
    let mut v: Vec<String> = names.into_iter().map(Into::into).collect();
    v.sort();
    v
}

/// The rule table of docs/filter-config.md lists the fields of every rule and of rate rules, the
/// concurrency section's table those of concurrency rules, and that section names every field a
/// concurrency rule refuses: each as the reader's table says.
#[test]
fn every_rule_field_is_documented_with_its_kind() {
    let doc = docs::read("docs/filter-config.md");
    let rules_section = section(&doc, "## `rules`");
    let concurrency = section(rules_section, "### Concurrency limits");
    assert_eq!(
        sorted(table_fields(rules_section)),
        sorted(rules::of(Kinds::Every).chain(rules::of(Kinds::Rate))),
        "docs/filter-config.md, the table of `rules`: every rule's fields and a rate rule's"
    );
    assert_eq!(
        sorted(table_fields(concurrency)),
        sorted(rules::of(Kinds::Concurrency)),
        "docs/filter-config.md, the table of \"Concurrency limits\": a concurrency rule's fields"
    );
    let named: Vec<&str> = concurrency.split('`').skip(1).step_by(2).collect();
    let unnamed: Vec<&str> = rules::of(Kinds::Rate)
        .filter(|f| !named.contains(f))
        .collect();
    assert!(
        unnamed.is_empty(),
        "docs/filter-config.md, \"Concurrency limits\" does not say that a concurrency rule \
         refuses {unnamed:?}"
    );
}

/// Every field of the top level has a section of docs/filter-config.md, and the tables of
/// `service`, `fallback`, `breaker`, `response` and `lease` list the fields of the reader's table
/// for it (`config::fields`), each integer with the default and the upper bound the reader holds
/// it to.
#[test]
fn every_section_field_is_documented_with_its_default_and_bounds() {
    let doc = docs::read("docs/filter-config.md");
    for f in fields::ROOT {
        section(&doc, &format!("## `{}`", f.name));
    }
    for (heading, table) in [
        ("## `service`", fields::SERVICE),
        ("## `fallback`", fields::FALLBACK),
        ("## `breaker`", fields::BREAKER),
        ("## `response`", fields::RESPONSE),
        ("### Lease mode", fields::LEASE),
    ] {
        let text = section(&doc, heading);
        assert_eq!(
            sorted(table_fields(text)),
            sorted(fields::names(table)),
            "docs/filter-config.md, the table of {heading}: the reader's fields"
        );
        for row in table_rows(text) {
            let Some(f) = fields::find(table, &row[0]) else {
                continue;
            };
            if let (fields::Value::Int(_, hi), default) = (f.value, f.default) {
                if default == fields::IfAbsent::Nothing {
                    continue;
                }
                assert!(
                    row[2].contains(&format!("..={hi}")),
                    "docs/filter-config.md, {heading}: `{}` is at most {hi}, not {:?}",
                    f.name,
                    row[2]
                );
                if let fields::IfAbsent::Int(d) = default {
                    assert_eq!(
                        row[1],
                        format!("`{d}`"),
                        "docs/filter-config.md, {heading}: `{}` defaults to {d}",
                        f.name
                    );
                }
            }
        }
    }
}

/// The cells of the first table in `text` (header and separator rows left out), the first
/// without its backticks.
fn table_rows(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| {
            let mut cells: Vec<String> = l
                .replace("\\|", "\u{0}")
                .split('|')
                .skip(1)
                .map(|c| c.trim().replace('\u{0}', "|"))
                .collect();
            cells[0] = cells[0].trim_matches('`').to_string();
            cells
        })
        .collect()
}

#[test]
fn the_rule_field_check_reads_sections_and_tables() {
    let doc =
        "# T\n## `rules` (required)\nText.\n\n| field | meaning |\n|---|---|\n| `name` | a |\n\
               | `key` | b |\n\nMore `x`.\n### Sub\n| f | m |\n|---|---|\n| `max_in_flight` | c |\n\
               #### Deeper\n`y`\n## Next\n| `other` | d |\n";
    let rules_section = section(doc, "## `rules`");
    assert_eq!(table_fields(rules_section), ["name", "key"]);
    assert!(!rules_section.contains("Next"));
    let sub = section(rules_section, "### Sub");
    assert_eq!(table_fields(sub), ["max_in_flight"]);
    assert!(sub.contains("`y`"), "a deeper heading stays in its section");
}

// ---------------------------------------------------------------------------------------------
// Links

#[test]
fn relative_links_resolve() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for doc in docs::documents() {
        for link in docs::links(&docs::read(&doc)) {
            if let Some(problem) = link_problem(&doc, &link.target) {
                broken.push(format!("{doc}:{}: {}: {problem}", link.line, link.target));
            }
            checked += 1;
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    eprintln!("{checked} links resolve");
}

/// Why the link `target` in `doc` does not resolve, if it does not.
fn link_problem(doc: &str, target: &str) -> Option<String> {
    let (path, anchor) = docs::resolve(doc, target)?;
    if !path.exists() {
        return Some(format!("{} does not exist", path.display()));
    }
    let anchor = anchor.filter(|a| !a.is_empty())?;
    if path.extension().is_none_or(|x| x != "md") {
        // A line anchor into source (`#L10`) is GitHub's; the file exists.
        return None;
    }
    let text = fs::read_to_string(&path).expect("read the linked document");
    (!docs::anchors(&text).contains(&anchor)).then(|| format!("no heading #{anchor}"))
}

#[test]
fn the_link_check_finds_what_is_broken() {
    let doc = "# Guide\n## `charge: response` and more\n[a](missing.md) [b](#guide) \
               [c](#charge-response-and-more) [d](https://example.com/x) `[e](in-code.md)`\n\
               [ref]: ../Cargo.toml\n```\n[f](in-a-block.md)\n```\n";
    let targets: Vec<String> = docs::links(doc).into_iter().map(|l| l.target).collect();
    assert_eq!(
        targets,
        [
            "missing.md",
            "#guide",
            "#charge-response-and-more",
            "https://example.com/x",
            "../Cargo.toml"
        ]
    );
    assert_eq!(
        docs::anchors(doc),
        ["guide", "charge-response-and-more"],
        "GitHub's heading anchors"
    );
    assert!(link_problem("docs/x.md", "missing.md").is_some());
    assert!(link_problem("docs/x.md", "../Cargo.toml").is_none());
    assert!(link_problem("README.md", "#no-such-heading").is_some());
}

// ---------------------------------------------------------------------------------------------
// Layout maps

/// The crates' module trees, and the test harnesses' (each `tests` module, the unit tests, is left
/// out: it is not part of the layout).
const ROOTS: [&str; 7] = [
    "src/lib.rs",
    "contract/src/lib.rs",
    "server/src/lib.rs",
    "server/src/main.rs",
    "testkit/src/lib.rs",
    "tests/common/mod.rs",
    "server/tests/integration/common/mod.rs",
];

/// Every source file under these is reached from a root (or is a binary's root itself).
const SOURCE_DIRS: [&str; 4] = ["src", "contract/src", "server/src", "testkit/src"];

/// A module file: its module name, its `//!` doc, its child modules declared by `mod x;`, and the
/// files it pastes in with `include!("x")` (generated code: part of the tree, not modules).
struct ModFile {
    path: PathBuf,
    name: String,
    doc: String,
    children: Vec<(String, PathBuf)>,
    included: Vec<PathBuf>,
}

fn mod_file(path: &Path) -> ModFile {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc: String = text
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("//!"))
        .map(|l| format!("{l}\n"))
        .collect();
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let is_mod_rs = matches!(stem, "mod" | "lib" | "main");
    let name = if stem == "mod" {
        path.parent()
            .and_then(|p| p.file_name())
            .and_then(|s| s.to_str())
            .unwrap_or("")
            .to_string()
    } else {
        stem.to_string()
    };
    let here = path.parent().expect("a parent directory");
    let base = if is_mod_rs {
        here.to_path_buf()
    } else {
        here.join(stem)
    };
    let mut children = Vec::new();
    let mut included = Vec::new();
    let mut path_attr: Option<String> = None;
    for line in text.lines() {
        let t = line.trim();
        if let Some(p) = t
            .strip_prefix("include!(\"")
            .and_then(|r| r.strip_suffix("\");"))
        {
            included.push(here.join(p));
            continue;
        }
        if let Some(p) = t
            .strip_prefix("#[path = \"")
            .and_then(|r| r.strip_suffix("\"]"))
        {
            path_attr = Some(p.to_string());
            continue;
        }
        if t.starts_with("#[") {
            continue;
        }
        let decl = ["pub(crate) ", "pub(super) ", "pub "]
            .iter()
            .find_map(|v| t.strip_prefix(v))
            .unwrap_or(t);
        let attr = path_attr.take();
        let Some(child) = decl.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) else {
            continue;
        };
        let file = match attr {
            Some(p) => here.join(p),
            None => {
                let flat = base.join(format!("{child}.rs"));
                if flat.is_file() {
                    flat
                } else {
                    base.join(child).join("mod.rs")
                }
            }
        };
        assert!(
            file.is_file(),
            "{}: mod {child}; has no file",
            path.display()
        );
        children.push((child.to_string(), file));
    }
    ModFile {
        path: path.to_path_buf(),
        name,
        doc,
        children,
        included,
    }
}

/// The code spans of a `//!` doc (`x`, [`x`]).
fn code_spans(doc: &str) -> Vec<String> {
    doc.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.trim().to_string())
        .collect()
}

/// Whether a code span names the module `child`: `child`, `child.rs`, `child/`, `child/mod.rs`,
/// or a path ending in it (`rules::keys`, `store/keys.rs`).
fn names(span: &str, child: &str) -> bool {
    let span = span
        .trim_start_matches("crate::")
        .trim_start_matches("self::");
    [
        child.to_string(),
        format!("{child}.rs"),
        format!("{child}/"),
        format!("{child}/mod.rs"),
    ]
    .iter()
    .any(|form| {
        span == form || span.ends_with(&format!("::{form}")) || span.ends_with(&format!("/{form}"))
    })
}

/// Whether an ancestor's map names `child` of `parent`: as `parent::child`, or in a list item
/// nested under one that names `parent` (a crate root listing its modules' modules).
fn ancestor_names(doc: &str, parent: &str, child: &str) -> bool {
    if code_spans(doc)
        .iter()
        .any(|s| s.ends_with(&format!("{parent}::{child}")))
    {
        return true;
    }
    // (indent, text) of each list item, continuation lines joined to their item.
    let mut items: Vec<(usize, String)> = Vec::new();
    for line in doc.lines() {
        let indent = line.len() - line.trim_start().len();
        let t = line.trim_start();
        if t.starts_with("- ") || t.starts_with("* ") {
            items.push((indent, t.to_string()));
        } else if let Some(last) = items.last_mut() {
            if indent > last.0 && !t.is_empty() {
                last.1.push(' ');
                last.1.push_str(t);
            }
        }
    }
    items.iter().enumerate().any(|(i, (indent, text))| {
        code_spans(text).iter().any(|s| names(s, child))
            && items[..i]
                .iter()
                .rev()
                .scan(*indent, |want, (ind, t)| {
                    if ind < want {
                        *want = *ind;
                        Some(Some(t))
                    } else {
                        Some(None)
                    }
                })
                .flatten()
                .any(|t| code_spans(t).iter().any(|s| names(s, parent)))
    })
}

#[test]
fn every_module_is_named_in_its_parents_map() {
    let root = workspace_root();
    let mut missing = Vec::new();
    let mut reached: Vec<PathBuf> = Vec::new();
    // (file, its ancestors' files, root first)
    let mut todo: Vec<(PathBuf, Vec<PathBuf>)> =
        ROOTS.iter().map(|r| (root.join(r), Vec::new())).collect();
    while let Some((path, ancestors)) = todo.pop() {
        let m = mod_file(&path);
        reached.push(path.clone());
        reached.extend(m.included.iter().map(|f| {
            f.canonicalize()
                .unwrap_or_else(|e| panic!("{}: include!: {e}", f.display()))
        }));
        for (child, file) in &m.children {
            // A `tests` module needs no line in its parent's map; its own modules do, in its map.
            let named = child == "tests"
                || code_spans(&m.doc).iter().any(|s| names(s, child))
                || ancestors
                    .iter()
                    .any(|a| ancestor_names(&mod_file(a).doc, &m.name, child));
            if !named {
                missing.push(format!(
                    "{}: `{child}` ({}) is not in its `//!` map",
                    rel(&m.path),
                    rel(file)
                ));
            }
            let mut up = ancestors.clone();
            up.push(path.clone());
            todo.push((file.clone(), up));
        }
    }
    let mut orphans = Vec::new();
    for dir in SOURCE_DIRS {
        for file in rust_files(&root.join(dir)) {
            let a_bin_root = file.parent().is_some_and(|p| p.ends_with("src/bin"));
            if !a_bin_root && !reached.contains(&file) {
                orphans.push(rel(&file));
            }
        }
    }
    assert!(
        missing.is_empty() && orphans.is_empty(),
        "modules missing from their parent's map:\n{}\nfiles no module tree reaches: {orphans:?}",
        missing.join("\n")
    );
}

/// The map check can fail: a module named nowhere, or named only under another parent, is missing.
#[test]
fn the_map_check_finds_what_is_missing() {
    let doc = "Layout:\n- [`core`]: the core.\n  - `config`: parsed once;\n    and checked.\n  \
               - `rules::keys` and [`store`]\n- `host`: the adapter.\n  - `abi.rs`: calls.\n";
    assert!(ancestor_names(doc, "core", "config"));
    assert!(ancestor_names(doc, "core", "store"));
    assert!(ancestor_names(doc, "rules", "keys"));
    assert!(!ancestor_names(doc, "core", "abi"), "abi is under host");
    assert!(!ancestor_names(doc, "core", "plan"));
    assert!(names("store/keys.rs", "keys"));
    assert!(names("redis/", "redis") && !names("redis_tls", "redis"));
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.expect("entry").path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

fn rel(p: &Path) -> String {
    p.strip_prefix(workspace_root())
        .unwrap_or(p)
        .display()
        .to_string()
}
