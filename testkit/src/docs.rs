//! The documentation as the tests read it (tests/docs.rs, server/tests/integration/docs.rs): README.md and
//! docs/*.md, their fenced code blocks with the kind each one declares, and their links; and
//! ARCHITECTURE.md's map, as entries ([`map_entries`]) and the paths their text names
//! ([`path_words`]).
//!
//! A fenced block that holds a configuration says so in its info string, after the language, and
//! the test of that kind's parser checks it:
//!
//! | info string | what the block holds | accepted by |
//! |---|---|---|
//! | `json filter` | a whole plugin configuration | the filter's `Config::parse` (tests/docs.rs) |
//! | `json rule` | one rule | `Config::parse`, as the only rule of `{"service": {"cluster": "tollgate"}}` |
//! | `yaml limits` | a limits file for the RLS endpoint | the service's reader, `rls::config::Limits::parse` (server/tests/integration/docs.rs) |
//! | `yaml envoy` | a whole Envoy bootstrap | `envoy --mode validate`, every `*.wasm` file being dist/tollgate.wasm |
//! | `yaml envoy-http-filters` | a list of HTTP filters | `envoy --mode validate`, placed before the router of a generated bootstrap |
//! | `yaml envoy-routes` | `routes:` and its list | `envoy --mode validate`, as the first routes of a generated bootstrap |
//! | `<language> partial` | a deliberate excerpt (a Kubernetes field, a list entry) | nothing |
//!
//! Every `json` and `yaml` block names one of these kinds, and so does a block without a language
//! whose text starts with `{`: a configuration nobody checks is a test failure. Blocks of other
//! languages (`sh`, `text`, none) are prose and are not parsed.

use std::fs;
use std::path::{Path, PathBuf};

use crate::process::workspace_root;

/// What a fenced block declares it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `json filter`
    Filter,
    /// `json rule`
    Rule,
    /// `yaml limits`
    Limits,
    /// `yaml envoy`
    Envoy,
    /// `yaml envoy-http-filters`
    EnvoyHttpFilters,
    /// `yaml envoy-routes`
    EnvoyRoutes,
    /// `<language> partial`
    Partial,
    /// Not a configuration: `sh`, `text`, no language (and not starting with `{`).
    Prose,
}

/// The kinds and the language each belongs to, as written in an info string.
pub const KINDS: [(&str, &str, Kind); 6] = [
    ("json", "filter", Kind::Filter),
    ("json", "rule", Kind::Rule),
    ("yaml", "limits", Kind::Limits),
    ("yaml", "envoy", Kind::Envoy),
    ("yaml", "envoy-http-filters", Kind::EnvoyHttpFilters),
    ("yaml", "envoy-routes", Kind::EnvoyRoutes),
];

/// One fenced code block.
#[derive(Clone, Debug)]
pub struct Block {
    /// The file, relative to the workspace root.
    pub file: String,
    /// The line of the opening fence (1-based).
    pub line: usize,
    /// The info string as written (`json filter`).
    pub info: String,
    /// The text between the fences, without the fence's indentation.
    pub text: String,
}

impl Block {
    /// `file:line`, for messages.
    pub fn place(&self) -> String {
        format!("{}:{}", self.file, self.line)
    }

    /// The declared kind, or an error saying what is wrong with the info string.
    pub fn kind(&self) -> Result<Kind, String> {
        let mut words = self.info.split_whitespace();
        let lang = words.next().unwrap_or("");
        let rest: Vec<&str> = words.collect();
        let config_lang = lang == "json" || lang == "yaml";
        match rest.as_slice() {
            ["partial"] => Ok(Kind::Partial),
            [kind] => KINDS
                .iter()
                .find(|(l, k, _)| *l == lang && k == kind)
                .map(|(_, _, kind)| *kind)
                .ok_or_else(|| {
                    format!(
                        "{}: unknown block kind `{}` (known: {}, or `partial`)",
                        self.place(),
                        self.info,
                        known()
                    )
                }),
            [] if config_lang => Err(format!(
                "{}: a `{lang}` block names what it holds ({}), or `{lang} partial` for an \
                 excerpt",
                self.place(),
                known()
            )),
            [] if lang.is_empty() && self.text.trim_start().starts_with('{') => Err(format!(
                "{}: a block that starts like JSON names its language and kind ({})",
                self.place(),
                known()
            )),
            [] => Ok(Kind::Prose),
            _ => Err(format!(
                "{}: info string `{}`: one language and at most one kind",
                self.place(),
                self.info
            )),
        }
    }
}

fn known() -> String {
    KINDS
        .iter()
        .map(|(l, k, _)| format!("`{l} {k}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// README.md and every docs/*.md (sorted), relative to the workspace root.
pub fn documents() -> Vec<String> {
    let root = workspace_root();
    let mut files = vec!["README.md".to_string()];
    let mut docs: Vec<String> = fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .map(|p| {
            p.strip_prefix(&root)
                .expect("under the root")
                .display()
                .to_string()
        })
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The text of `rel` (relative to the workspace root).
pub fn read(rel: &str) -> String {
    fs::read_to_string(workspace_root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The fenced blocks (```` ``` ```` or `~~~`) of one document, in order. An unclosed fence fails
/// the test.
pub fn blocks(file: &str, text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<(usize, usize, String, String, Vec<String>)> = None;
    for (i, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start().len();
        let trimmed = line.trim_start();
        let fence = ["```", "~~~"]
            .into_iter()
            .find(|f| trimmed.starts_with(f))
            .map(|f| {
                let n = trimmed.len() - trimmed.trim_start_matches(f.as_bytes()[0] as char).len();
                trimmed[..n].to_string()
            });
        match (&mut open, fence) {
            (None, Some(f)) => {
                let info = trimmed[f.len()..].trim().to_string();
                open = Some((i + 1, indent, f, info, Vec::new()));
            }
            (Some((_, _, f, _, _)), Some(g)) if trimmed.trim_end() == g && g.len() >= f.len() => {
                let (line, _, _, info, body) = open.take().expect("open block");
                out.push(Block {
                    file: file.to_string(),
                    line,
                    info,
                    text: body.join("\n") + "\n",
                });
            }
            (Some((_, fence_indent, _, _, body)), _) => {
                let cut = indent.min(*fence_indent);
                body.push(line[cut..].to_string());
            }
            (None, None) => {}
        }
    }
    if let Some((line, ..)) = open {
        panic!("{file}:{line}: a code fence is never closed");
    }
    out
}

/// Every block of every document (README.md, docs/*.md).
pub fn all_blocks() -> Vec<Block> {
    documents()
        .iter()
        .flat_map(|f| blocks(f, &read(f)))
        .collect()
}

/// The blocks of `kind` in every document; fails the test if one declares a kind badly.
pub fn blocks_of(kind: Kind) -> Vec<Block> {
    blocks_in_of(None, kind)
}

/// The blocks of `kind` in `file` (relative to the workspace root, e.g. `docs/migrating.md`), or in
/// every document when `None`.
pub fn blocks_in_of(file: Option<&str>, kind: Kind) -> Vec<Block> {
    let mut out = Vec::new();
    for b in all_blocks() {
        if b.kind().unwrap_or_else(|e| panic!("{e}")) == kind && file.is_none_or(|f| b.file == f) {
            out.push(b);
        }
    }
    out
}

/// The text of a document outside its fenced blocks and inline code spans, line by line (line
/// numbers kept): where its links are.
pub fn prose_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fence: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        if let Some(f) = &fence {
            if t.trim_end().starts_with(f.as_str())
                && t.trim_end().trim_start_matches(['`', '~']).is_empty()
            {
                fence = None;
            }
            continue;
        }
        if t.starts_with("```") || t.starts_with("~~~") {
            let c = t.as_bytes()[0] as char;
            let n = t.len() - t.trim_start_matches(c).len();
            fence = Some(t[..n].to_string());
            continue;
        }
        out.push((i + 1, without_code_spans(line)));
    }
    out
}

fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        out.push_str(&rest[..start]);
        let ticks = rest[start..].len() - rest[start..].trim_start_matches('`').len();
        let after = &rest[start + ticks..];
        let closing = "`".repeat(ticks);
        match after.find(&closing) {
            Some(end) => rest = &after[end + ticks..],
            None => {
                out.push_str(&rest[start..]);
                return out;
            }
        }
    }
    out.push_str(rest);
    out
}

/// A link found in a document's prose.
#[derive(Clone, Debug)]
pub struct Link {
    pub line: usize,
    pub target: String,
}

/// The links of a document: inline (`[text](target)`, images too) and reference definitions
/// (`[label]: target`), outside code.
pub fn links(text: &str) -> Vec<Link> {
    let mut out = Vec::new();
    for (line, prose) in prose_lines(text) {
        let t = prose.trim_start();
        if t.starts_with('[') {
            if let Some(close) = t.find("]:") {
                let target = t[close + 2..].split_whitespace().next().unwrap_or("");
                if !target.is_empty() && !t[..close].contains('(') {
                    out.push(Link {
                        line,
                        target: target.trim_matches(['<', '>']).to_string(),
                    });
                }
            }
        }
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = closing_paren(after) else {
                break;
            };
            let inner = after[..end].trim();
            let target = inner.split_whitespace().next().unwrap_or("");
            out.push(Link {
                line,
                target: target.trim_matches(['<', '>']).to_string(),
            });
            rest = &after[end..];
        }
    }
    out
}

/// The index of the `)` that closes a link target (parentheses inside it balanced).
fn closing_paren(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => return Some(i),
            ')' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// The anchors GitHub gives a document's headings: lower case, punctuation dropped (`-` and `_`
/// kept), spaces as `-`, a repeated one suffixed `-1`, `-2`, ...
pub fn anchors(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (_, line) in prose_lines_keeping_code(text) {
        let t = line.trim_start();
        if !t.starts_with('#') {
            continue;
        }
        let level = t.len() - t.trim_start_matches('#').len();
        if level > 6 || !t[level..].starts_with(' ') {
            continue;
        }
        let heading = link_texts(t[level..].trim());
        let mut slug: String = heading
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let base = slug.clone();
        let mut n = 0;
        while out.contains(&slug) {
            n += 1;
            slug = format!("{base}-{n}");
        }
        out.push(slug);
    }
    out
}

/// The prose lines with inline code kept (a heading's code span is part of its anchor).
fn prose_lines_keeping_code(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_fence = false;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        if t.starts_with("```") || t.starts_with("~~~") {
            in_fence = !in_fence;
            continue;
        }
        if !in_fence {
            out.push((i + 1, line.to_string()));
        }
    }
    out
}

/// `[text](target)` as `text`.
fn link_texts(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        match closing_paren(after) {
            Some(end) => {
                out.push_str(&rest[..at]);
                rest = &after[end + 1..];
            }
            None => break,
        }
    }
    out.push_str(rest);
    out.replace('[', "")
}

/// Where a relative link from `doc` (relative to the root) points: the path, and the anchor if any.
/// None for an absolute URL (`https:`, `mailto:`, ...).
pub fn resolve(doc: &str, target: &str) -> Option<(PathBuf, Option<String>)> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (path, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(a.to_string())),
        None => (target, None),
    };
    let root = workspace_root();
    let file = if path.is_empty() {
        root.join(doc)
    } else if let Some(abs) = path.strip_prefix('/') {
        root.join(abs)
    } else {
        root.join(doc)
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| root.clone())
            .join(path)
    };
    Some((file, anchor))
}

/// An `envoy-http-filters` block as the generator's extra filters: a YAML list at column 0
/// (`- name: ...`), each item as a mapping at column 0; comments between items are dropped.
pub fn list_items(text: &str) -> Vec<String> {
    let mut items: Vec<String> = Vec::new();
    for line in text.lines() {
        if let Some(first) = line.strip_prefix("- ") {
            items.push(format!("{first}\n"));
        } else if line.starts_with('#') || line.trim().is_empty() {
            continue;
        } else if let Some(item) = items.last_mut() {
            item.push_str(line.strip_prefix("  ").unwrap_or(line));
            item.push('\n');
        }
    }
    items
}

/// `bootstrap` with the routes of `excerpt` (`routes:` and its list) placed first in the virtual
/// host's routes.
pub fn with_routes(bootstrap: &str, excerpt: &str) -> Result<String, String> {
    let mut lines = excerpt
        .lines()
        .skip_while(|l| l.starts_with('#') || l.trim().is_empty());
    if lines.next().map(str::trim_end) != Some("routes:") {
        return Err("an `envoy-routes` block starts with `routes:`".to_string());
    }
    let routes: Vec<&str> = lines.collect();
    let mut out = String::new();
    let mut placed = false;
    for line in bootstrap.split_inclusive('\n') {
        out.push_str(line);
        if !placed && line.trim_end().trim_start() == "routes:" {
            let indent = &line[..line.len() - line.trim_start().len()];
            for r in &routes {
                out.push_str(indent);
                out.push_str(r);
                out.push('\n');
            }
            placed = true;
        }
    }
    placed
        .then_some(out)
        .ok_or_else(|| "the generated bootstrap has no `routes:`".to_string())
}

/// One entry of ARCHITECTURE.md's map (the code block under `## The map`): a path in the first
/// column, under the directory entry it is indented below, and its text, the rest of its line
/// and the lines indented under that text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapEntry {
    /// Relative to the workspace root; a directory's ends with `/`.
    pub path: String,
    /// The directory entries it is under, the outermost first.
    pub ancestors: Vec<String>,
    pub text: String,
}

/// A map line whose first text starts at or past this column continues the entry above it.
const MAP_TEXT_COLUMN: usize = 24;

/// The entries of the map in `doc` (ARCHITECTURE.md's text), in order. An entry line may name
/// several paths (`json.rs, proto.rs`): each is an entry with the same text.
pub fn map_entries(doc: &str) -> Vec<MapEntry> {
    let block = doc
        .split_once("\n## The map\n")
        .and_then(|(_, rest)| rest.split_once("```\n"))
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .map_or("", |(block, _)| block);
    let mut entries: Vec<MapEntry> = Vec::new();
    let mut dirs: Vec<(usize, String)> = Vec::new();
    for line in block.lines() {
        let t = line.trim_start();
        let indent = line.len() - t.len();
        let (head, rest) = t.split_once("  ").unwrap_or((t, ""));
        let paths: Vec<&str> = head.split(", ").collect();
        let an_entry = indent < MAP_TEXT_COLUMN && paths.iter().all(|p| is_map_path(p));
        if !an_entry {
            if let Some(last) = entries.last_mut() {
                last.text.push('\n');
                last.text.push_str(t);
            }
            continue;
        }
        while dirs.last().is_some_and(|(i, _)| *i >= indent) {
            dirs.pop();
        }
        let ancestors: Vec<String> = dirs.iter().map(|(_, d)| d.clone()).collect();
        let base = ancestors.last().cloned().unwrap_or_default();
        for p in &paths {
            entries.push(MapEntry {
                path: format!("{base}{p}"),
                ancestors: ancestors.clone(),
                text: rest.trim().to_string(),
            });
        }
        if let [dir] = paths[..] {
            if dir.ends_with('/') {
                dirs.push((indent, format!("{base}{dir}")));
            }
        }
    }
    entries
}

fn is_map_path(s: &str) -> bool {
    !s.is_empty()
        && (s.contains('.') || s.ends_with('/'))
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-/".contains(c))
}

/// The file and directory names in `text` (prose of a map): the words ending in `/` or in a
/// source or document extension (`take.rs`, `lease/`, `docs/rls.md`), without placeholders
/// (`<name>.rs`) or patterns (`*.lua`).
pub fn path_words(text: &str) -> Vec<String> {
    const EXTENSIONS: [&str; 10] = [
        "rs", "lua", "proto", "md", "json", "yaml", "sh", "py", "toml", "sse",
    ];
    text.split(|c: char| !(c.is_ascii_alphanumeric() || "_.-/<>*".contains(c)))
        .map(|w| w.trim_end_matches('.'))
        .filter(|w| !w.contains(['<', '>', '*']) && !w.starts_with('/') && !w.contains("//"))
        .filter(|w| {
            w.len() > 1 && w.ends_with('/')
                || w.rsplit_once('.')
                    .is_some_and(|(stem, ext)| !stem.is_empty() && EXTENSIONS.contains(&ext))
        })
        .map(str::to_string)
        .collect()
}
