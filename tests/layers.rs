//! The layer picture holds: every `crate::` path in `src/` points to a module of the
//! same layer or one below, the module graph has no cycle, and every module of `src/`
//! is in the table of docs/design.md ("Layers"), which is where the picture lives.
//! Reads the sources as text; runs nothing of the library.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

fn main() {
    support::run(&[("src_follows_the_layer_table_of_docs_design_md", src_follows_the_layer_table)]);
}

fn src_follows_the_layer_table() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let layers = layers(&fs::read_to_string(root.join("docs/design.md")).expect("docs/design.md"));
    let edges = edges(&root.join("src"));
    let mut problems = Vec::new();
    for module in edges.keys() {
        if !layers.contains_key(module) {
            problems.push(format!("src/ module `{module}` is not in the layer table of docs/design.md"));
        }
    }
    for module in layers.keys() {
        if !edges.contains_key(module) {
            problems.push(format!("docs/design.md lists `{module}`, which is not a module of src/"));
        }
    }
    for (from, tos) in &edges {
        for to in tos {
            if let (Some(a), Some(b)) = (layers.get(from), layers.get(to)) {
                if b > a {
                    problems.push(format!("`{from}` (layer {a}) uses `{to}` (layer {b}), a layer above it"));
                }
            }
        }
    }
    if let Some(cycle) = find_cycle(&edges) {
        problems.push(format!("import cycle: {}", cycle.join(" -> ")));
    }
    let edge_count: usize = edges.values().map(BTreeSet::len).sum();
    for p in &problems {
        eprintln!("layers: {p}");
    }
    assert!(problems.is_empty(), "{} problems with the layer picture", problems.len());
    println!("{} modules, {edge_count} edges, no upward edge, no cycle", edges.len());
}

/// Module name -> layer number, from the `| N name | `a`, `b` |` rows of the
/// "## Layers" section.
fn layers(design: &str) -> BTreeMap<String, u32> {
    let section = design.split("\n## Layers").nth(1).expect("a `## Layers` section in docs/design.md");
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut out = BTreeMap::new();
    for line in section.lines().filter(|l| l.starts_with("| ")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let Some(layer) = cells.get(1).and_then(|c| c.split_whitespace().next()).and_then(|n| n.parse().ok())
        else {
            continue;
        };
        for name in cells.get(2).unwrap_or(&"").split('`').skip(1).step_by(2) {
            out.insert(name.to_owned(), layer);
        }
    }
    assert!(!out.is_empty(), "no layer rows found in docs/design.md");
    out
}

/// Module -> modules its code names through `crate::`, comments left out. `lib.rs` (the
/// table of contents) and the loom model tests are not modules of the picture.
fn edges(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    collect(src, &mut files);
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(src).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
        let module = first.trim_end_matches(".rs").to_owned();
        if module == "lib" || module == "loom_tests" {
            continue;
        }
        let text = fs::read_to_string(&file).unwrap();
        let code: String =
            text.lines().filter(|l| !l.trim_start().starts_with("//")).map(|l| format!("{l}\n")).collect();
        let used = out.entry(module.clone()).or_default();
        for name in referenced(&code) {
            if name != module {
                used.insert(name);
            }
        }
    }
    let modules: BTreeSet<String> = out.keys().cloned().collect();
    for used in out.values_mut() {
        used.retain(|m| modules.contains(m)); // root re-exports (crate::init, ...) are not modules
    }
    out
}

fn collect(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The first path segment after every `crate::`, including each item of a
/// `crate::{a, b::c}` group.
fn referenced(code: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut item_start = true;
            let mut name = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => {
                        item_start = true;
                        continue;
                    }
                    _ => {}
                }
                if depth == 1 && item_start {
                    if c.is_alphanumeric() || c == '_' {
                        name.push(c);
                    } else if !name.is_empty() || !c.is_whitespace() {
                        names.push(std::mem::take(&mut name));
                        item_start = false;
                    }
                }
            }
            if !name.is_empty() {
                names.push(name);
            }
        } else {
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            names.push(name);
        }
    }
    names.retain(|n| !n.is_empty());
    names
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
