//! A real library's work on the Rust face: syn parses Rust source files (what every
//! proc macro does in a build), here every .rs file under a directory, ROUNDS times.
use memquota::{Config, QuotaAlloc};
use std::path::Path;

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

fn files(dir: &Path, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for p in paths {
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            if let Ok(text) = std::fs::read_to_string(&p) {
                out.push(text);
            }
        }
    }
}

fn main() {
    memquota::init(Config::from_env().expect("config").limit(16 << 30)).expect("init");
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args.get(2).map_or(1, |r| r.parse().unwrap());
    let mut sources = Vec::new();
    files(Path::new(&args[1]), &mut sources);
    let (mut parsed, mut items) = (0, 0);
    for _ in 0..rounds {
        for s in &sources {
            if let Ok(f) = syn::parse_file(s) {
                parsed += 1;
                items += f.items.len();
            }
        }
    }
    println!("{} files, {parsed} parsed, {items} items", sources.len());
}
