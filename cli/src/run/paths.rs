//! The files of a run: the preload library, the stats file (given, or in a private
//! temporary directory) and the directory an output goes to.

use super::PRELOAD_NAME;
use crate::Failure;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// `--preload`, or libmemquota.so next to this executable; absolute, and usable in
/// LD_PRELOAD (which splits on spaces and colons).
pub(super) fn find_preload(given: Option<&Path>) -> Result<PathBuf, Failure> {
    let path = match given {
        Some(p) => p.to_path_buf(),
        None => {
            let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
            exe.parent().unwrap_or(Path::new("/")).join(PRELOAD_NAME)
        }
    };
    if !path.is_file() {
        let how = match given {
            Some(_) => "check --preload".to_string(),
            None => "it belongs next to the memquota executable (`cargo build --release` puts both \
                     in target/release/), or pass --preload PATH"
                .to_string(),
        };
        return Err(format!("the preload library {} is missing: {how}", path.display()).into());
    }
    let path = path.canonicalize().map_err(|e| format!("the preload library {}: {e}", path.display()))?;
    let text = path.to_string_lossy();
    if text.contains([' ', ':']) {
        return Err(format!(
            "the preload library's path {text} has a space or a colon, which LD_PRELOAD cannot \
             hold: move it, or pass --preload with another path"
        )
        .into());
    }
    Ok(path)
}

/// Makes `--stats-file` absolute (the program may change directory) and removes a
/// stale one, so that nothing from an earlier run is read as this run's.
pub(super) fn prepare_stats_file(path: &Path) -> Result<PathBuf, Failure> {
    let path = std::env::current_dir().map_err(|e| format!("no current directory: {e}"))?.join(path);
    check_directory("--stats-file", &path)?;
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(format!("--stats-file {}: cannot replace it: {e}", path.display()).into())
        }
        _ => Ok(path),
    }
}

/// Fails unless the directory `path` is to be written in exists.
pub(super) fn check_directory(flag: &str, path: &Path) -> Result<(), Failure> {
    let dir = match path.parent() {
        Some(d) if d.as_os_str().is_empty() => Path::new("."),
        Some(d) => d,
        None => Path::new("/"),
    };
    if dir.is_dir() {
        Ok(())
    } else {
        Err(format!("{flag} {}: the directory {} does not exist", path.display(), dir.display()).into())
    }
}

/// A private directory for the default stats file, removed when dropped.
pub(super) struct TempDir(pub(super) PathBuf);

impl TempDir {
    pub(super) fn new() -> std::io::Result<TempDir> {
        let nanos =
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
        let mut attempt = 0u32;
        loop {
            let dir =
                std::env::temp_dir().join(format!("memquota-run-{}-{nanos}-{attempt}", std::process::id()));
            // 0700 and "create", never "open existing": no one else can plant a file in it.
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(TempDir(dir)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 100 => attempt += 1,
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
