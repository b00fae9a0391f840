//! The layer picture holds in every crate of the repository: each has a table in the
//! "Layers" section of docs/design.md (the core's first, then one `### path/src` table
//! per other crate), every module of its sources is in a layer of it, every path
//! (`crate::`, `super::`, and names the crate root re-exports, followed to the module
//! they come from) points to the same layer or one below, and the module graph has no
//! cycle. The faces in the core use the seam and the API only, and a crate of the
//! repository reaches the core through the seam only where its table says so.
//! Reads the sources as text; runs nothing.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn main() {
    support::run(&[(
        "every_crate_follows_its_layer_table_in_docs_design_md",
        every_crate_follows_its_layer_table,
    )]);
}

fn every_crate_follows_its_layer_table() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let design = fs::read_to_string(root.join("docs/design.md")).expect("docs/design.md");
    let tables = tables(&design);
    let mut problems = Vec::new();
    let crates = crates(root);
    for dir in &crates {
        let rel = dir.strip_prefix(root).unwrap().to_string_lossy().into_owned();
        let src = if rel.is_empty() { "src".to_owned() } else { format!("{rel}/src") };
        let Some(table) = tables.get(&src) else {
            problems.push(format!("crate `{src}` has no layer table in docs/design.md"));
            continue;
        };
        let found = check_crate(&dir.join("src"), &src, table, &mut problems);
        println!("{src}: {} modules, {} edges", found.0, found.1);
    }
    for src in tables.keys() {
        let dir = root.join(src.trim_end_matches("src").trim_end_matches('/'));
        if !crates.contains(&dir) {
            problems.push(format!("docs/design.md has a layer table for `{src}`, which is not a crate"));
        }
    }
    for p in &problems {
        eprintln!("layers: {p}");
    }
    assert!(problems.is_empty(), "{} problems with the layer picture", problems.len());
    println!("{} crates, no upward edge, no cycle, the seam kept", crates.len());
}

/// One crate's picture: layer number per top-level module or folder, the layer whose
/// modules may use only the seam and the API (the core's faces), and whether the crate
/// may use the core's seam.
#[derive(Default)]
struct Table {
    layers: BTreeMap<String, u32>,
    seam_only: Option<u32>,
    uses_seam: bool,
}

/// The tables of the "## Layers" section: `| N name | `a` (what it does), `b` |` rows.
/// The first table is `src`'s; each `### `path/src`` heading starts another crate's. A
/// row whose layer name is `faces` marks the layer that may use only the seam; "Uses
/// the seam." in the text under a heading lets that crate use it.
fn tables(design: &str) -> BTreeMap<String, Table> {
    let section = design.split("\n## Layers").nth(1).expect("a `## Layers` section in docs/design.md");
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut out: BTreeMap<String, Table> = BTreeMap::new();
    let mut current = "src".to_owned();
    for line in section.lines() {
        if let Some(h) = line.strip_prefix("### ") {
            current = h.trim().trim_matches('`').to_owned();
            continue;
        }
        if !line.starts_with('|') && line.contains("Uses the seam.") {
            out.entry(current.clone()).or_default().uses_seam = true;
            continue;
        }
        if !line.starts_with("| ") {
            continue;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let mut words = cells.get(1).map(|c| c.split_whitespace()).into_iter().flatten();
        let Some(layer) = words.next().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let table = out.entry(current.clone()).or_default();
        if words.next() == Some("faces") && current == "src" {
            table.seam_only = Some(layer);
        }
        for name in outside_parentheses(cells.get(2).unwrap_or(&"")).split('`').skip(1).step_by(2) {
            table.layers.insert(name.to_owned(), layer);
        }
    }
    assert!(out.get("src").is_some_and(|t| !t.layers.is_empty()), "no layer rows for src in docs/design.md");
    out
}

/// A cell's text without what it says in parentheses (a module's description).
fn outside_parentheses(cell: &str) -> String {
    let mut depth = 0u32;
    cell.chars()
        .filter(|&c| {
            match c {
                '(' => depth += 1,
                ')' => depth = depth.saturating_sub(1),
                _ => return depth == 0,
            }
            false
        })
        .collect()
}

/// Every package directory of the repository with Rust sources (a `Cargo.toml` beside
/// a `src/`), build outputs left out.
fn crates(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if dir.join("Cargo.toml").is_file() && dir.join("src").is_dir() {
            out.push(dir.clone());
        }
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy();
            if path.is_dir()
                && !name.starts_with('.')
                && !matches!(&*name, "target" | "src" | "tests" | "venv")
            {
                stack.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Checks one crate; returns its modules and edges counted.
fn check_crate(src: &Path, name: &str, table: &Table, problems: &mut Vec<String>) -> (usize, usize) {
    let mut files = Vec::new();
    collect(src, &mut files);
    let root_file = ["lib.rs", "main.rs"].into_iter().map(|f| src.join(f)).find(|f| f.is_file());
    let root_file = root_file.unwrap_or_else(|| panic!("{name}: no lib.rs or main.rs"));
    let contents_only: BTreeSet<String> = files
        .iter()
        .filter(|f| {
            f.file_name().is_some_and(|n| n == "mod.rs") && f.parent().and_then(Path::parent) == Some(src)
        })
        .filter(|f| is_table_of_contents(&fs::read_to_string(f).unwrap()))
        .map(|f| f.parent().unwrap().file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let unit = |segments: &[String]| -> String {
        match segments {
            [first, second, ..] if contents_only.contains(first) => format!("{first}::{second}"),
            [first, ..] => first.clone(),
            [] => String::new(),
        }
    };
    let split = |p: &str| p.split("::").map(str::to_owned).collect::<Vec<_>>();
    // Names the crate root re-exports (`pub use a::b::C`): `C` -> a's module.
    let root_text = code_of(&fs::read_to_string(&root_file).unwrap());
    let mut reexported = BTreeMap::new();
    let mut rest = root_text.as_str();
    while let Some(at) = rest.find("use ") {
        rest = &rest[at + 4..];
        let mut paths = Vec::new();
        tree(&mut rest.chars().peekable(), String::new(), &mut paths);
        for path in paths {
            let segments = split(&path);
            if let Some((last, module)) = segments.split_last() {
                if !module.is_empty() {
                    reexported.insert(last.clone(), unit(module));
                }
            }
        }
    }
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut seam_breaches = Vec::new();
    for file in &files {
        if Some(file) == Some(&root_file) {
            continue;
        }
        let segments: Vec<String> = file
            .strip_prefix(src)
            .unwrap()
            .components()
            .map(|c| c.as_os_str().to_string_lossy().trim_end_matches(".rs").to_owned())
            .filter(|s| s != "mod")
            .collect();
        let module = unit(&segments);
        if module == "loom_tests" || contents_only.contains(&module) {
            continue;
        }
        let code = code_of(&fs::read_to_string(file).unwrap());
        let used = edges.entry(module.clone()).or_default();
        let mut paths: Vec<Vec<String>> = after(&code, "crate::").iter().map(|p| split(p)).collect();
        // `super::x` in a/b.rs is a::x; in a/b/mod.rs, a::x too (the folder is b).
        let parent: Vec<String> = segments[..segments.len().saturating_sub(1)].to_vec();
        for p in after(&code, "super::") {
            let mut full = parent.clone();
            full.extend(split(&p));
            paths.push(full);
        }
        for path in paths {
            let target = match reexported.get(&path[0]) {
                Some(m) if path.len() == 1 || !table.layers.contains_key(&path[0]) => m.clone(),
                _ => unit(&path),
            };
            if target != module && !target.is_empty() {
                used.insert(target.clone());
            }
            let layer_of = |m: &str| table.layers.get(m.split("::").next().unwrap()).copied();
            let top = &path[0];
            if table.seam_only.is_some()
                && layer_of(&module) == table.seam_only
                && table.layers.contains_key(top)
                && top != "seam"
                && layer_of(top) != table.seam_only
            {
                seam_breaches
                    .push(format!("{name}: `{module}` (a face) uses `{}` past the seam", path.join("::")));
            }
        }
        if !table.uses_seam && (code.contains("memquota::seam") || code.contains("memquota_core::seam")) {
            problems.push(format!("{name}: `{module}` uses the core's seam; its table does not say it may"));
        }
    }
    problems.extend(seam_breaches.into_iter().collect::<BTreeSet<_>>());
    let modules: BTreeSet<String> = edges.keys().cloned().collect();
    for used in edges.values_mut() {
        used.retain(|m| modules.contains(m));
    }
    let layer_of = |m: &str| table.layers.get(m.split("::").next().unwrap()).copied();
    let mut places = BTreeSet::new();
    for module in edges.keys() {
        if layer_of(module).is_none() {
            problems
                .push(format!("{name}: module `{module}` is not in a layer of its table in docs/design.md"));
        }
        places.insert(module.split("::").next().unwrap().to_owned());
    }
    for place in table.layers.keys() {
        if !places.contains(place) {
            problems.push(format!("{name}: docs/design.md lists `{place}`, which is not a module of it"));
        }
    }
    for (from, tos) in &edges {
        for to in tos {
            if let (Some(a), Some(b)) = (layer_of(from), layer_of(to)) {
                if b > a {
                    problems.push(format!(
                        "{name}: `{from}` (layer {a}) uses `{to}` (layer {b}), a layer above it"
                    ));
                }
            }
        }
    }
    if let Some(cycle) = find_cycle(&edges) {
        problems.push(format!("{name}: import cycle: {}", cycle.join(" -> ")));
    }
    (edges.len(), edges.values().map(BTreeSet::len).sum())
}

/// The code of a file, comments left out.
fn code_of(text: &str) -> String {
    text.lines().filter(|l| !l.trim_start().starts_with("//")).map(|l| format!("{l}\n")).collect()
}

/// A layer folder's `mod.rs` that only declares the layer's modules.
fn is_table_of_contents(text: &str) -> bool {
    text.lines().map(str::trim).all(|l| {
        l.is_empty()
            || l.starts_with("//")
            || l.starts_with("#[")
            || l.starts_with("pub(crate) mod ")
            || l.starts_with("pub mod ")
            || l.starts_with("mod ")
            || l == "}"
    })
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every path after each `prefix` (`crate::`, `super::`), with `a::{b, c::d}` groups
/// spelled out (`a::b`, `a::c::d`).
fn after(code: &str, prefix: &str) -> Vec<String> {
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + prefix.len()..];
        // `$crate::`, `super::super::` and the like are not this prefix.
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$' || c == ':') {
            continue;
        }
        tree(&mut rest.chars().peekable(), String::new(), &mut paths);
    }
    paths.retain(|p| !p.is_empty());
    paths
}

/// One use-tree: segments joined by `::`, ending in a name or a `{...}` group of trees.
fn tree(chars: &mut std::iter::Peekable<std::str::Chars>, prefix: String, out: &mut Vec<String>) {
    let skip_space = |chars: &mut std::iter::Peekable<std::str::Chars>| {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
    };
    let mut path = prefix;
    loop {
        skip_space(chars);
        if chars.peek() == Some(&'{') {
            chars.next();
            loop {
                tree(chars, path.clone(), out);
                skip_space(chars);
                match chars.next() {
                    Some(',') => {
                        skip_space(chars);
                        if chars.peek() == Some(&'}') {
                            chars.next();
                            return;
                        }
                    }
                    _ => return,
                }
            }
        }
        let name: String =
            std::iter::from_fn(|| chars.next_if(|c| c.is_alphanumeric() || *c == '_')).collect();
        if !name.is_empty() && name != "self" {
            if !path.is_empty() {
                path.push_str("::");
            }
            path.push_str(&name);
        }
        if chars.peek() == Some(&':') {
            chars.next();
            if chars.next_if_eq(&':').is_some() {
                continue;
            }
        }
        // The rest of this item (` as x`, `*`) up to its end.
        while chars.peek().is_some_and(|c| !matches!(c, ',' | '}' | ';' | '(' | ')' | '\n')) {
            chars.next();
        }
        out.push(path);
        return;
    }
}

fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(m) {
            Some(1) => {
                let start = path.iter().position(|p| p == m).unwrap();
                let mut cycle = path[start..].to_vec();
                cycle.push(m.to_owned());
                return Some(cycle);
            }
            Some(_) => return None,
            None => {}
        }
        state.insert(m.to_owned(), 1);
        path.push(m.to_owned());
        for to in edges.get(m).into_iter().flatten() {
            if let Some(c) = visit(to, edges, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(m.to_owned(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for m in edges.keys() {
        if let Some(c) = visit(m, edges, &mut state, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}
