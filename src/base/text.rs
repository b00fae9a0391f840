//! Text without a heap: byte counts for people, writers into fixed buffers, and
//! standard error. The one home for each; the report, the scope figures, the C ABI,
//! the preload's summary and the command all format through here.

use std::fmt::{self, Write};

/// A byte count for people: `1.5 GiB (1610612736)`, or with `{:#}` the short
/// `1.5 GiB`. `u64::MAX` reads `unlimited`. Tenths are rounded to the nearest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub u64);

/// A signed byte count (a change, or a total that dipped below zero between flushes):
/// `-1.5 MiB (1572864)`; `i64::MAX` reads `unlimited`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SignedSize(pub i64);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let b = self.0;
        if b == u64::MAX {
            return f.write_str("unlimited");
        }
        let mut unit = 0;
        while unit + 1 < UNITS.len() && b >> (10 * (unit + 1)) > 0 {
            unit += 1;
        }
        if unit == 0 {
            return write!(f, "{b} B");
        }
        // Tenths in integers, rounded to the nearest: no float on the allocation path.
        let shift = 10 * unit;
        let scaled = ((u128::from(b) * 10) + (1 << (shift - 1))) >> shift;
        write!(f, "{}.{} {}", scaled / 10, scaled % 10, UNITS[unit])?;
        if !f.alternate() {
            write!(f, " ({b})")?;
        }
        Ok(())
    }
}

impl fmt::Display for SignedSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == i64::MAX {
            return f.write_str("unlimited");
        }
        if self.0 < 0 {
            f.write_char('-')?;
        }
        let size = Size(self.0.unsigned_abs());
        if f.alternate() {
            write!(f, "{size:#}")
        } else {
            write!(f, "{size}")
        }
    }
}

/// Bytes an OOM report (or any fixed-buffer text) may take; longer text is cut. A
/// report with scopes names each scope's top sites in its tree (up to 4 scopes of
/// 4 lines each, about 3 KiB), before the top sites of the process.
pub const CAPACITY: usize = 8192;

/// A fixed-capacity text buffer: `fmt::Write` without a heap. Text past the capacity
/// is dropped at a character boundary (and the write reports `fmt::Error`).
#[derive(Clone, Copy)]
pub struct FixedBuf {
    bytes: [u8; CAPACITY],
    len: usize,
}

impl FixedBuf {
    /// An empty buffer.
    pub const fn new() -> FixedBuf {
        FixedBuf { bytes: [0; CAPACITY], len: 0 }
    }

    /// The text written so far.
    pub fn as_str(&self) -> &str {
        // Only whole `str` pieces cut at char boundaries are ever copied in.
        std::str::from_utf8(&self.bytes[..self.len]).unwrap_or("")
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Forgets the text written so far.
    pub fn clear(&mut self) {
        self.len = 0;
    }
}

impl Default for FixedBuf {
    fn default() -> Self {
        FixedBuf::new()
    }
}

impl fmt::Debug for FixedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl Write for FixedBuf {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = CAPACITY - self.len;
        let mut take = s.len().min(room);
        while !s.is_char_boundary(take) {
            take -= 1;
        }
        self.bytes[self.len..self.len + take].copy_from_slice(&s.as_bytes()[..take]);
        self.len += take;
        if take < s.len() {
            Err(fmt::Error)
        } else {
            Ok(())
        }
    }
}

/// `fmt::Write` into a caller's buffer (the C ABI's out-parameters): writes what fits
/// and counts the whole length, so the caller learns the size it needs.
#[derive(Debug)]
pub struct SliceWriter<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl<'a> SliceWriter<'a> {
    /// Writes into `buf`.
    pub fn new(buf: &'a mut [u8]) -> Self {
        SliceWriter { buf, len: 0 }
    }

    /// Bytes the whole text takes (may exceed the buffer).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing was written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Write for SliceWriter<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let start = self.len.min(self.buf.len());
        let take = s.len().min(self.buf.len() - start);
        self.buf[start..start + take].copy_from_slice(&s.as_bytes()[..take]);
        self.len += s.len();
        Ok(())
    }
}

/// Writes `text` to standard error: one `write(2)` per chunk, no buffering, no
/// allocation (safe on the allocation path and in a fork child).
pub fn write_stderr(text: &str) {
    write_fd(libc::STDERR_FILENO, text);
}

/// Writes `text` to file descriptor `fd` as [`write_stderr`] does, retrying on EINTR.
pub fn write_fd(fd: libc::c_int, text: &str) {
    let mut bytes = text.as_bytes();
    while !bytes.is_empty() {
        // SAFETY: the pointer and length describe the live `bytes` slice.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if n <= 0 {
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_well() {
        assert_eq!(Size(512).to_string(), "512 B");
        assert_eq!(Size(1536).to_string(), "1.5 KiB (1536)");
        assert_eq!(Size(8 << 30).to_string(), "8.0 GiB (8589934592)");
        assert_eq!(Size(u64::MAX).to_string(), "unlimited");
        assert_eq!(format!("{:#}", Size(3 << 29)), "1.5 GiB");
        assert_eq!(format!("{:#}", Size(1023)), "1023 B");
        assert_eq!(format!("{:#}", Size(57_042_534)), "54.4 MiB", "rounded to the nearest tenth");
        assert_eq!(format!("{:#}", Size(1126)), "1.1 KiB");
        assert_eq!(SignedSize(-1536).to_string(), "-1.5 KiB (1536)");
        assert_eq!(format!("{:#}", SignedSize(-1536)), "-1.5 KiB");
        assert_eq!(SignedSize(i64::MAX).to_string(), "unlimited");
    }

    #[test]
    fn fixed_buf_truncates_at_char_boundary() {
        let mut b = FixedBuf::new();
        let long = "é".repeat(CAPACITY);
        assert!(b.write_str(&long).is_err());
        assert_eq!(b.as_str().len(), CAPACITY);
        assert!(b.as_str().chars().all(|c| c == 'é'));
    }

    #[test]
    fn slice_writer_counts_what_does_not_fit() {
        let mut buf = [0u8; 4];
        let mut w = SliceWriter::new(&mut buf);
        w.write_str("abcdef").unwrap();
        assert_eq!(w.len(), 6);
        assert_eq!(&buf, b"abcd");
    }
}
