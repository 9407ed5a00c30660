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
//! - every module of the crates, and of the test harnesses, is named in its parent's `//!` map, a
//!   map that lists some of a module's modules lists them all, and no `//!` doc names a file that
//!   is not there;
//! - every source file of the crates is named in ARCHITECTURE.md's map, and every file that map
//!   names is there.
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
use tollgate_testkit::docs::{self, list_items, with_routes, Block, Kind, MapEntry};
use tollgate_testkit::envoy::{self, EnvoySpec};
use tollgate_testkit::plugin::Plugin;
use tollgate_testkit::process::{closed_port, required_component, workspace_root, TempDir};

/// The plugin configuration a rule is shown in, and the one the generated Envoy configurations run.
fn with_rule(rule: &str) -> String {
    Plugin::defaults().rule(rule).json()
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
    // The native build's block (docs/deploy.md, 3g) loads the real dynamic module too.
    let native = required_component(
        "TOLLGATE_NATIVE",
        "dist/libtollgate.so",
        ": run `make native`. Envoy's validate mode loads the native build's block with it.",
    );
    if let Some(folder) = native.parent() {
        std::env::set_var("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", folder);
    }
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
/// `service`, `fallback`, `breaker`, `response`, `lease`, `shape` and `from_request`'s numbers list the fields of the reader's table
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
        ("### Shaping", fields::SHAPE),
        ("### Limits from the request", fields::ATTRIBUTE),
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

/// Every source file under these is reached from a root (or is a binary's root itself), and is
/// named in ARCHITECTURE.md's map.
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

impl ModFile {
    /// Its child modules but the unit tests (`tests`), which need no line in a map.
    fn listed_children(&self) -> impl Iterator<Item = &(String, PathBuf)> {
        self.children.iter().filter(|(c, _)| c != "tests")
    }
}

/// Every module file reached from the roots, each with its ancestors' files (the root first), and
/// the generated files they paste in.
struct Trees {
    modules: Vec<(ModFile, Vec<PathBuf>)>,
    generated: Vec<PathBuf>,
}

fn module_trees() -> Trees {
    let root = workspace_root();
    let mut trees = Trees {
        modules: Vec::new(),
        generated: Vec::new(),
    };
    let mut todo: Vec<(PathBuf, Vec<PathBuf>)> =
        ROOTS.iter().map(|r| (root.join(r), Vec::new())).collect();
    while let Some((path, ancestors)) = todo.pop() {
        let m = mod_file(&path);
        trees.generated.extend(m.included.iter().map(|f| {
            f.canonicalize()
                .unwrap_or_else(|e| panic!("{}: include!: {e}", f.display()))
        }));
        for (_, file) in &m.children {
            let mut up = ancestors.clone();
            up.push(path.clone());
            todo.push((file.clone(), up));
        }
        trees.modules.push((m, ancestors));
    }
    trees
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

/// A list item or a table row of a `//!` map: its text (an item's continuation lines joined to it)
/// and the items nested under it.
struct Item {
    text: String,
    nested: Vec<Item>,
}

impl Item {
    fn spans(&self) -> Vec<String> {
        code_spans(&self.text)
    }

    /// Whether this item, or one nested in it, names `child` in an item nested under one that
    /// names `parent`.
    fn names_under(&self, parent: &str, child: &str) -> bool {
        (self.spans().iter().any(|s| names(s, parent))
            && self.nested.iter().any(|n| n.names_anywhere(child)))
            || self.nested.iter().any(|n| n.names_under(parent, child))
    }

    /// Its code spans and those of the items nested in it.
    fn all_spans(&self) -> Vec<String> {
        let nested = self.nested.iter().flat_map(Item::all_spans);
        self.spans().into_iter().chain(nested).collect()
    }

    fn names_anywhere(&self, child: &str) -> bool {
        self.spans().iter().any(|s| names(s, child))
            || self.nested.iter().any(|n| n.names_anywhere(child))
    }
}

/// The items of a `//!` doc, nested as its list is; each table row is an item of its own.
fn map_items(doc: &str) -> Vec<Item> {
    // (indent, text) of each item, in order.
    let mut flat: Vec<(usize, String)> = Vec::new();
    for line in doc.lines() {
        let indent = line.len() - line.trim_start().len();
        let t = line.trim_start();
        if t.starts_with("- ") || t.starts_with("* ") || t.starts_with('|') {
            flat.push((indent, t.to_string()));
        } else if let Some(last) = flat.last_mut() {
            if indent > last.0 && !t.is_empty() && !last.1.starts_with('|') {
                last.1.push(' ');
                last.1.push_str(t);
            }
        }
    }
    fn nest(flat: &[(usize, String)]) -> Vec<Item> {
        let mut items = Vec::new();
        let mut i = 0;
        while i < flat.len() {
            let (indent, text) = &flat[i];
            let end = flat[i + 1..]
                .iter()
                .position(|(ind, _)| ind <= indent)
                .map_or(flat.len(), |p| i + 1 + p);
            items.push(Item {
                text: text.clone(),
                nested: nest(&flat[i + 1..end]),
            });
            i = end;
        }
        items
    }
    nest(&flat)
}

/// Whether an ancestor's map names `child` of `parent`: as `parent::child`, or in a list item
/// nested under one that names `parent` (a crate root listing its modules' modules).
fn ancestor_names(doc: &str, parent: &str, child: &str) -> bool {
    code_spans(doc)
        .iter()
        .any(|s| s.ends_with(&format!("{parent}::{child}")))
        || map_items(doc).iter().any(|i| i.names_under(parent, child))
}

/// A map that goes into a module (an item naming it names some of its modules, in its text or in
/// the items nested under it) names all of them: what a map lists of a module is its whole
/// layout, never a part that a new module silently falls out of.
fn partial_listings(m: &ModFile) -> Vec<String> {
    fn walk(items: &[Item], context: &ModFile, file: &Path, out: &mut Vec<String>) {
        for item in items {
            let spans = item.spans();
            let Some(first) = spans.first() else { continue };
            let Some((name, path)) = context.children.iter().find(|(c, _)| names(first, c)) else {
                continue;
            };
            let subject = mod_file(path);
            let nested_firsts = item
                .nested
                .iter()
                .filter_map(|n| n.spans().first().cloned());
            let listed: Vec<String> = spans[1..]
                .iter()
                .cloned()
                .chain(nested_firsts)
                .filter(|s| subject.children.iter().any(|(c, _)| names(s, c)))
                .collect();
            let unlisted: Vec<&str> = subject
                .listed_children()
                .filter(|(c, _)| !listed.iter().any(|s| names(s, c)))
                .map(|(c, _)| c.as_str())
                .collect();
            if !listed.is_empty() && !unlisted.is_empty() {
                out.push(format!(
                    "{}: the map lists modules of `{name}` but not {unlisted:?}",
                    rel(file)
                ));
            }
            walk(&item.nested, &subject, file, out);
        }
    }
    let mut out = Vec::new();
    walk(&map_items(&m.doc), m, &m.path, &mut out);
    out
}

#[test]
fn every_module_is_named_in_its_parents_map() {
    let root = workspace_root();
    let trees = module_trees();
    let mut missing = Vec::new();
    for (m, ancestors) in &trees.modules {
        for (child, file) in m.listed_children() {
            let named = code_spans(&m.doc).iter().any(|s| names(s, child))
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
        }
        missing.extend(partial_listings(m));
    }
    let reached: Vec<&PathBuf> = trees
        .modules
        .iter()
        .map(|(m, _)| &m.path)
        .chain(&trees.generated)
        .collect();
    let mut orphans = Vec::new();
    for dir in SOURCE_DIRS {
        for file in rust_files(&root.join(dir)) {
            let a_bin_root = file.parent().is_some_and(|p| p.ends_with("src/bin"));
            if !a_bin_root && !reached.contains(&&file) {
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

/// No `//!` map (its list items and table rows) names a file or directory that is not there
/// (under its module's directory or the one above, at any depth, or relative to a directory
/// above it).
#[test]
fn module_docs_name_only_what_exists() {
    let root = workspace_root();
    let tree = all_paths(&root);
    let mut stale = Vec::new();
    for (m, _) in &module_trees().modules {
        let file = rel(&m.path);
        let dirs: Vec<String> = file
            .match_indices('/')
            .map(|(i, _)| file[..=i].to_string())
            .collect();
        let (here, above) = dirs
            .split_last()
            .map_or(("", &[][..]), |(h, a)| (h.as_str(), a));
        let spans = map_items(&m.doc)
            .iter()
            .flat_map(Item::all_spans)
            .collect::<Vec<_>>();
        for w in spans.iter().flat_map(|s| docs::path_words(s)) {
            let in_parent = above.last().is_some_and(|p| exists_near(&tree, p, &[], &w));
            if !in_parent && !exists_near(&tree, here, above, &w) {
                stale.push(format!("{file}: `{w}` does not exist"));
            }
        }
    }
    assert!(stale.is_empty(), "{}", stale.join("\n"));
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
    let items = map_items("- `a`: x (`b`)\n  and y\n  - `c`\n| `d` | `e` |\n");
    assert_eq!(items.len(), 2);
    assert_eq!(items[0].spans(), ["a", "b"]);
    assert_eq!(items[0].nested[0].spans(), ["c"]);
    assert_eq!(items[1].spans(), ["d", "e"]);
}

// ---------------------------------------------------------------------------------------------
// ARCHITECTURE.md's map

/// Every source file of the crates (generated code, pasted in by `include!`, aside) is named in
/// ARCHITECTURE.md's map: as an entry of its own, or in the text of a directory entry it is under
/// (`take.rs`, `lease/pool.rs`; a directory's `mod.rs` by its directory, `lease/`).
#[test]
fn every_source_file_is_in_the_architecture_map() {
    let root = workspace_root();
    let entries = docs::map_entries(&docs::read("ARCHITECTURE.md"));
    assert!(
        !entries.is_empty(),
        "ARCHITECTURE.md: no map under `## The map`"
    );
    let generated = module_trees().generated;
    let mut missing: Vec<String> = SOURCE_DIRS
        .iter()
        .flat_map(|d| rust_files(&root.join(d)))
        .filter(|f| !generated.contains(f))
        .map(|f| rel(&f))
        .filter(|f| !in_map(&entries, f))
        .collect();
    missing.sort();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md's map does not name {missing:#?}"
    );
}

/// Every entry of ARCHITECTURE.md's map is there, and so is every file or directory its text
/// names (under the entry's directory at any depth, or relative to an entry above it or to the
/// root).
#[test]
fn the_architecture_map_names_only_what_exists() {
    let root = workspace_root();
    let tree = all_paths(&root);
    let mut stale = Vec::new();
    for e in docs::map_entries(&docs::read("ARCHITECTURE.md")) {
        if !tree.contains(&e.path) {
            stale.push(format!("{}: no such file or directory", e.path));
        }
        let here = match e.path.rfind('/') {
            _ if e.path.ends_with('/') => e.path.as_str(),
            Some(i) => &e.path[..=i],
            None => "",
        };
        for w in docs::path_words(&e.text) {
            if !exists_near(&tree, here, &e.ancestors, &w) {
                stale.push(format!("{}: names {w}, which does not exist", e.path));
            }
        }
    }
    assert!(
        stale.is_empty(),
        "ARCHITECTURE.md's map:\n{}",
        stale.join("\n")
    );
}

/// The map checks can fail: a file named nowhere, a directory's `mod.rs` named by its directory,
/// a word naming what is not there.
#[test]
fn the_architecture_map_check_finds_what_is_wrong() {
    let doc = "# A\n## The map\n\n```\nsrc/                     the filter\n  lib.rs                 \
               crate doc\n  core/                  pure: lease/ (pool.rs: the pools),\n                         \
               stream.rs\n```\n";
    let entries = docs::map_entries(doc);
    let paths: Vec<&str> = entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["src/", "src/lib.rs", "src/core/"]);
    assert_eq!(entries[2].ancestors, ["src/"]);
    for named in [
        "src/lib.rs",
        "src/core/mod.rs",
        "src/core/stream.rs",
        "src/core/lease/mod.rs",
        "src/core/lease/pool.rs",
        "src/core/x/stream.rs",
    ] {
        assert!(in_map(&entries, named), "{named}");
    }
    for unnamed in ["src/core/denials.rs", "src/core/x/mod.rs", "src/main.rs"] {
        assert!(!in_map(&entries, unnamed), "{unnamed}");
    }
    let tree = [
        "src/",
        "src/core/",
        "src/core/lease/",
        "src/core/lease/pool.rs",
        "docs/a.md",
    ]
    .map(String::from);
    assert!(exists_near(&tree, "src/core/", &[], "pool.rs"));
    assert!(exists_near(
        &tree,
        "src/core/",
        &["src/".into()],
        "docs/a.md"
    ));
    assert!(!exists_near(&tree, "src/core/", &[], "stream.rs"));
    assert!(
        !exists_near(&tree, "src/", &[], "a.md"),
        "only under its own directory"
    );
}

/// Whether ARCHITECTURE.md's map names `file`: as an entry, or in the text of an entry it is
/// under (a directory's, or a module file's, `x.rs`, whose modules are in `x/`).
fn in_map(entries: &[MapEntry], file: &str) -> bool {
    entries.iter().any(|e| {
        let (dir, under) = match e.path.strip_suffix(".rs") {
            Some(module) => (
                e.path.rfind('/').map_or("", |i| &e.path[..=i]),
                format!("{module}/"),
            ),
            None => (e.path.as_str(), e.path.clone()),
        };
        e.path == file
            || (under.ends_with('/')
                && file.starts_with(&under)
                && names_file(&docs::path_words(&e.text), &file[dir.len()..]))
    })
}

/// Whether the words of a map entry name the file at `rest`, relative to the entry's directory:
/// its path or its end (`pool.rs`, `lease/pool.rs`); a `mod.rs` by its directory (`lease/`).
fn names_file(words: &[String], rest: &str) -> bool {
    let ends_in = |path: &str, w: &str| path == w || path.ends_with(&format!("/{w}"));
    match rest.strip_suffix("mod.rs") {
        Some("") => true,
        Some(dir) => words.iter().any(|w| {
            (w.ends_with('/') && ends_in(dir, w)) || (w.contains('/') && ends_in(rest, w))
        }),
        None => words.iter().any(|w| ends_in(rest, w)),
    }
}

/// Whether `word` names a path of `tree` under `here` at any depth (`pool.rs` in `local/` is
/// `local/lease/pool.rs`), or relative to one of `above` or to the root.
fn exists_near(tree: &[String], here: &str, above: &[String], word: &str) -> bool {
    let under_here = tree.iter().any(|p| {
        p.strip_prefix(here)
            .is_some_and(|r| r == word || r.ends_with(&format!("/{word}")))
    });
    under_here
        || above
            .iter()
            .map(String::as_str)
            .chain([""])
            .any(|a| tree.contains(&format!("{a}{word}")))
}

/// Every file and directory of the workspace, relative to it (directories ending in `/`), but
/// build output and hidden ones.
fn all_paths(root: &Path) -> Vec<String> {
    fn walk(dir: &Path, prefix: &str, out: &mut Vec<String>) {
        for e in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let e = e.expect("entry");
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || name == "target" {
                continue;
            }
            let path = format!("{prefix}{name}");
            if e.path().is_dir() {
                out.push(format!("{path}/"));
                walk(&e.path(), &format!("{path}/"), out);
            } else {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, "", &mut out);
    out
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
