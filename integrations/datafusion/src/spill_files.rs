//! Spill files whose reads are charged to the query that reads them.
//!
//! DataFusion reads a spill file back through `tokio::fs`, whose first read of each
//! file allocates a 128 KiB buffer on a tokio blocking thread, attached to no scope.
//! The query frees it later, so the query's scope is credited for memory it was
//! never charged, and while its reservations exceed its allocations that credit is
//! absorbed and the process account keeps the buffer: measured, 21.6 MiB of phantom
//! memory after 173 spills at 64 MiB. Reading the file on the thread that polls the
//! stream (a plain `read` of at most 128 KiB from a file just written, so from the page
//! cache) charges every byte to the query. Files are created, written and deleted by
//! DataFusion's own `DiskManager`, with its limits.
//!
//! [`disk_manager_builder`] also bounds how many spill files a sort merges at once
//! ([`SPILL_MERGE_FAN_IN`]), so that a merge leaves room for the operators beside it.

use bytes::Bytes;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::disk_manager::{DiskManager, DiskManagerBuilder};
use datafusion::execution::spill_file::{SpillFile, SpillWriter, TempFileFactory};
use futures::Stream;
use std::io::Read;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

/// What one read takes at most, as DataFusion's own reader.
const CHUNK: usize = 128 << 10;

/// A DataFusion `TempFileFactory` over a `DiskManager`: its files, read back on the
/// polling thread. [`disk_manager_builder`] is the usual way to use it.
pub struct ScopedSpillFiles {
    inner: Arc<DiskManager>,
}

impl ScopedSpillFiles {
    /// Spill files of `inner` (its directories and size limit).
    pub fn new(inner: Arc<DiskManager>) -> ScopedSpillFiles {
        ScopedSpillFiles { inner }
    }
}

impl std::fmt::Debug for ScopedSpillFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopedSpillFiles").finish_non_exhaustive()
    }
}

impl TempFileFactory for ScopedSpillFiles {
    fn create_temp_file(&self, description: &str) -> Result<Arc<dyn SpillFile>> {
        Ok(Arc::new(ScopedSpillFile(self.inner.create_tmp_file(description)?)))
    }
}

/// How many spill files a sort merges at once, at most ([`disk_manager_builder`]'s).
///
/// DataFusion's merge of a sort's spill files reads as many files at once as the pool
/// grants it room for (four of a file's largest batches reserved each, and the file's
/// reader besides), with no bound of its own (`max_spill_merge_fan_in` is 0 by
/// default), and holds that memory until its last row is read. Under a budget shared by the operators of a plan, the first sort
/// to merge then takes all the room there is: the sort beside it (a sort-merge join
/// reads its second side after the first side's merge began) finds none, and cannot
/// even take the reservation it needs to spill, so the query fails. With at most this
/// many files at once the merge holds a few files' worth and merges the rest in
/// further passes, through spill files of its own (DataFusion's multi-level merge):
/// more disk traffic (n files take about log4(n) passes over the data), a bounded
/// footprint. TPC-H query 21 at 128 MiB completes with 4 and with 8, and failed with
/// no bound (docs/benchmarks.md); 4 holds the least.
pub const SPILL_MERGE_FAN_IN: usize = 4;

/// DataFusion's default `DiskManagerBuilder` (files in the system's temporary
/// directory) with [`ScopedSpillFiles`], and sorts that merge at most
/// [`SPILL_MERGE_FAN_IN`] spill files at once: give it to `RuntimeEnvBuilder::
/// with_disk_manager_builder` next to [`MemquotaPool`](crate::MemquotaPool).
///
/// # Errors
/// As `DiskManagerBuilder::build`.
pub fn disk_manager_builder() -> Result<DiskManagerBuilder> {
    let inner = Arc::new(DiskManagerBuilder::default().build()?);
    Ok(DiskManagerBuilder::default()
        .with_max_spill_merge_fan_in(SPILL_MERGE_FAN_IN)
        .with_temp_file_factory(Arc::new(ScopedSpillFiles::new(inner))))
}

struct ScopedSpillFile(Arc<dyn SpillFile>);

impl SpillFile for ScopedSpillFile {
    fn path(&self) -> Option<&Path> {
        self.0.path()
    }

    fn size(&self) -> Option<u64> {
        self.0.size()
    }

    fn read_stream(&self) -> Result<Pin<Box<dyn Stream<Item = Result<Bytes>> + Send>>> {
        let Some(path) = self.0.path() else { return self.0.read_stream() };
        let file = std::fs::File::open(path)?;
        // The file stays alive (and on disk) while it is read.
        let keep = Arc::clone(&self.0);
        Ok(Box::pin(futures::stream::try_unfold((file, keep), |(mut file, keep)| async move {
            let mut chunk = vec![0; CHUNK];
            let n = file.read(&mut chunk).map_err(DataFusionError::IoError)?;
            if n == 0 {
                return Ok(None);
            }
            chunk.truncate(n);
            Ok(Some((Bytes::from(chunk), (file, keep))))
        })))
    }

    fn open_writer(&self) -> Result<Box<dyn SpillWriter>> {
        self.0.open_writer()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_merge_a_bounded_number_of_spill_files_at_once() {
        // DataFusion's default is 0: every file at once.
        assert_eq!(DiskManagerBuilder::default().build().unwrap().max_spill_merge_fan_in(), 0);
        let built = disk_manager_builder().unwrap().build().unwrap();
        assert_eq!(built.max_spill_merge_fan_in(), SPILL_MERGE_FAN_IN);
        assert!(built.tmp_files_enabled(), "sorts may spill, so they pre-reserve for their merges");
    }
}
