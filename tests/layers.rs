//! The layer picture holds: every `crate::` path in `src/` points to a module of the
//! same layer or one below, the module graph has no cycle, and every module of `src/`
//! is in the table of docs/design.md ("Layers"), which is where the picture lives.
//! Reads the sources as text; runs nothing of the library.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let layers = layers(&fs::read_to_string(root.join("docs/design.md")).expect("docs/design.md"));
    let edges = edges(&root.join("src"));
    let mut problems = Vec::new();
    let layer_of = |module: &str| layers.get(module.split("::").next().unwrap_or(module)).copied();
    let mut places = BTreeSet::new();
    for module in edges.keys() {
        let place = module.split("::").next().unwrap_or(module).to_owned();
        if layer_of(module).is_none() {
            problems.push(format!("src/ module `{module}` is not in a layer of the table in docs/design.md"));
        }
        places.insert(place);
    }
    for place in layers.keys() {
        if !places.contains(place) {
            problems.push(format!("docs/design.md lists `{place}`, which is not a module or folder of src/"));
        }
    }
    for (from, tos) in &edges {
        for to in tos {
            if let (Some(a), Some(b)) = (layer_of(from), layer_of(to)) {
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
    if problems.is_empty() {
        println!("{} modules, {edge_count} edges, no upward edge, no cycle", edges.len());
        println!("1 passed, 0 failed");
    } else {
        for p in &problems {
            eprintln!("layers: {p}");
        }
        eprintln!("0 passed, 1 failed");
        std::process::exit(1);
    }
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

/// Module -> modules its code names through `crate::`, comments left out. A module is
/// a file or folder directly in `src/`, or one directly in a layer folder whose
/// `mod.rs` is only a table of contents (`policy::report`). `lib.rs` (the crate's table
/// of contents) and the loom model tests are not modules of the picture.
fn edges(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    collect(src, &mut files);
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
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(src).unwrap();
        let segments: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().trim_end_matches(".rs").to_owned())
            .filter(|s| s != "mod")
            .collect();
        let module = unit(&segments);
        if module == "lib" || module == "loom_tests" || contents_only.contains(&module) {
            continue;
        }
        let text = fs::read_to_string(&file).unwrap();
        let code: String =
            text.lines().filter(|l| !l.trim_start().starts_with("//")).map(|l| format!("{l}\n")).collect();
        let used = out.entry(module.clone()).or_default();
        for path in referenced(&code) {
            let name = unit(&path.split("::").map(str::to_owned).collect::<Vec<_>>());
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

/// Every path after a `crate::`, with `crate::a::{b, c::d}` groups spelled out
/// (`a::b`, `a::c::d`).
fn referenced(code: &str) -> Vec<String> {
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        tree(&mut rest.chars().peekable(), String::new(), &mut paths);
    }
    paths.retain(|p| !p.is_empty());
    paths
}

/// One use-tree: segments joined by `::`, ending in a name or a `{...}` group of trees.
fn tree(chars: &mut std::iter::Peekable<std::str::Chars>, prefix: String, out: &mut Vec<String>) {
    let mut path = prefix;
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek() == Some(&'{') {
            chars.next();
            loop {
                tree(chars, path.clone(), out);
                while chars.peek().is_some_and(|c| c.is_whitespace()) {
                    chars.next();
                }
                match chars.next() {
                    Some(',') => {
                        while chars.peek().is_some_and(|c| c.is_whitespace()) {
                            chars.next();
                        }
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
        // Skip the rest of this item (` as x`, `*`) up to its end.
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
