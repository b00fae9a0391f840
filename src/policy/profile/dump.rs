//! The top sites of live memory, read from jemalloc's heap_v2 dump with no heap, and
//! written for the report, the exit summary and the stats file.

use crate::base::text::Size;
use libc::c_int;
use std::fmt::{self, Write};

/// Sites a report names.
pub const TOP: usize = 5;
/// Frames kept per site, innermost first.
pub const FRAMES: usize = 4;
/// Objects (executables, libraries) the sites' frames may lie in.
const OBJECTS: usize = 8;
/// The longest object path kept.
const PATH: usize = 192;
/// Scopes whose own sites a read keeps, the largest first.
pub const SCOPES: usize = 4;
/// Sites kept per scope (and as many again of its unreserved bytes).
pub const PER_SCOPE: usize = 3;
/// Frames below this are no return address (no code lies in the first page): the
/// stack hook's scope tag, `ledger::tables::tags`.
const TAG_BELOW: u64 = 4096;

/// A frame of a site: its return address, and where it lies.
#[derive(Clone, Copy, Default, Debug)]
pub struct Frame {
    /// The return address.
    pub addr: u64,
    /// The object's index in [`Sites`] (`u8::MAX`: not in a file).
    pub object: u8,
    /// The address in the object's own terms (what `addr2line -e OBJECT` takes) of
    /// the call: the return address minus one, less the object's load address.
    pub rel: u64,
}

/// One site: a stack and what is live from it.
#[derive(Clone, Copy, Default, Debug)]
pub struct Site {
    /// Estimated live bytes.
    pub bytes: u64,
    /// Estimated live blocks.
    pub blocks: u64,
    /// Of `bytes`, those allocated in a scope while its allocations went past what
    /// its reservations covered (only in a scope's sites).
    pub unreserved: u64,
    /// The innermost frames outside the allocator.
    pub frames: [Frame; FRAMES],
    /// How many of `frames` are set.
    pub depth: usize,
}

impl Site {
    const EMPTY: Site = Site {
        bytes: 0,
        blocks: 0,
        unreserved: 0,
        frames: [Frame { addr: 0, object: u8::MAX, rel: 0 }; FRAMES],
        depth: 0,
    };
}

/// One scope's part of the profile: what its threads allocated that is still live,
/// and its top sites.
#[derive(Clone, Copy, Debug)]
pub struct ScopeSites {
    /// The scope, as `ledger::tables::tags::decode` gives it.
    pub scope: u16,
    /// Estimated live bytes its threads allocated.
    pub bytes: u64,
    /// Of them, those allocated while its allocations went past its reservations.
    pub unreserved: u64,
    /// Its top sites by live bytes, largest first.
    pub top: [Site; PER_SCOPE],
    /// How many of `top` are set.
    pub len: usize,
    /// Its top sites by unreserved bytes, largest first (only sites with some).
    pub top_unreserved: [Site; PER_SCOPE],
    /// How many of `top_unreserved` are set.
    pub unreserved_len: usize,
}

impl ScopeSites {
    const EMPTY: ScopeSites = ScopeSites {
        scope: 0,
        bytes: 0,
        unreserved: 0,
        top: [Site::EMPTY; PER_SCOPE],
        len: 0,
        top_unreserved: [Site::EMPTY; PER_SCOPE],
        unreserved_len: 0,
    };
}

/// Inserts `site` into the `len` sites of `top`, kept in decreasing order of `key`.
fn insert_by(top: &mut [Site], len: &mut usize, site: Site, key: fn(&Site) -> u64) {
    let at = top[..*len].iter().position(|s| key(s) < key(&site)).unwrap_or(*len);
    if at >= top.len() {
        return;
    }
    let end = (*len).min(top.len() - 1);
    top.copy_within(at..end, at + 1);
    top[at] = site;
    *len = (*len + 1).min(top.len());
}

/// The top sites of live memory, read from the profile in fixed storage.
#[derive(Clone, Copy, Debug)]
pub struct Sites {
    /// The mean bytes between samples the profile was taken at.
    pub rate: u64,
    /// Estimated live bytes in all sampled stacks.
    pub total: u64,
    /// The top sites, largest first.
    pub sites: [Site; TOP],
    /// How many of `sites` are set.
    pub len: usize,
    /// The scopes with the most live bytes sampled in them, largest first.
    pub scopes: [ScopeSites; SCOPES],
    /// How many of `scopes` are set.
    pub scopes_len: usize,
    paths: [[u8; PATH]; OBJECTS],
    path_len: [u8; OBJECTS],
    objects: usize,
}

impl Default for Sites {
    fn default() -> Self {
        Sites::new()
    }
}

impl Sites {
    /// None.
    pub const fn new() -> Sites {
        Sites {
            rate: 0,
            total: 0,
            sites: [Site::EMPTY; TOP],
            len: 0,
            scopes: [ScopeSites::EMPTY; SCOPES],
            scopes_len: 0,
            paths: [[0; PATH]; OBJECTS],
            path_len: [0; OBJECTS],
            objects: 0,
        }
    }

    /// The path of object `i` of a frame.
    pub fn object(&self, i: u8) -> Option<&str> {
        let i = usize::from(i);
        (i < self.objects)
            .then(|| std::str::from_utf8(&self.paths[i][..usize::from(self.path_len[i])]).unwrap_or("?"))
    }

    fn intern(&mut self, path: &[u8]) -> u8 {
        let path = &path[..path.len().min(PATH)];
        for i in 0..self.objects {
            if &self.paths[i][..usize::from(self.path_len[i])] == path {
                return i as u8;
            }
        }
        if self.objects == OBJECTS {
            return u8::MAX;
        }
        let i = self.objects;
        self.paths[i][..path.len()].copy_from_slice(path);
        self.path_len[i] = path.len() as u8;
        self.objects += 1;
        i as u8
    }

    fn insert(&mut self, site: Site) {
        insert_by(&mut self.sites, &mut self.len, site, |s| s.bytes);
    }

    /// The part of scope `scope` (as `ledger::tables::tags::decode` gives it), if the
    /// read kept it.
    pub fn scope(&self, scope: u16) -> Option<&ScopeSites> {
        self.scopes[..self.scopes_len].iter().find(|s| s.scope == scope)
    }

    /// Every kept site's frames, by a flat index: the top sites', then each scope's.
    fn frame_mut(&mut self, k: usize) -> Option<&mut Frame> {
        let per_site = FRAMES;
        let global = TOP * per_site;
        if k < global {
            let site = &mut self.sites[k / per_site];
            return (k % per_site < site.depth).then(|| &mut site.frames[k % per_site]);
        }
        let k = k - global;
        let per_scope = 2 * PER_SCOPE * per_site;
        let scope = self.scopes.get_mut(k / per_scope)?;
        let k = k % per_scope;
        let site = if k < PER_SCOPE * per_site {
            &mut scope.top[k / per_site]
        } else {
            &mut scope.top_unreserved[(k - PER_SCOPE * per_site) / per_site]
        };
        (k % per_site < site.depth).then(|| &mut site.frames[k % per_site])
    }

    const FRAME_SLOTS: usize = (TOP + SCOPES * 2 * PER_SCOPE) * FRAMES;

    /// The live profile now, or None when it is off or cannot be read. Allocates
    /// nothing through the counted paths: the dump goes to a memfd, read back in a
    /// fixed buffer on the stack.
    pub fn read() -> Option<Sites> {
        Sites::read_for(None)
    }

    /// As [`read`](Sites::read), keeping the sites of scope `only` (as
    /// `ledger::tables::tags::decode` gives it) whatever its rank among the scopes.
    pub fn read_for(only: Option<u16>) -> Option<Sites> {
        let mut sites = Sites::new();
        Sites::read_into(only, &mut sites).then_some(sites)
    }

    /// As [`read_for`](Sites::read_for), into `out`, which keeps what it held when
    /// the profile cannot be read (false then). The reading's storage is mapped for
    /// it ([`Scratch`]), and the sites go from there straight into `out`: no copy of
    /// them on this stack.
    pub fn read_into(only: Option<u16>, out: &mut Sites) -> bool {
        let Some(mut scratch) = Scratch::new(super::RATE.load(crate::base::sync::Ordering::Relaxed), only)
        else {
            return false;
        };
        let reading = scratch.reading();
        let read = dump(&mut reading.top, &mut reading.buf);
        if read {
            *out = reading.top.sites;
        }
        read
    }
}

/// The frames of a record's stack that are read (the hook keeps 32); a deeper
/// stack's outer frames are dropped.
pub(super) const STACK: usize = 64;

/// One record of a heap_v2 dump: a stack, innermost first, and its sampled figures
/// as jemalloc wrote them (unscaled: [`unsample`] scales them).
pub(super) struct Record<'a> {
    /// Return addresses (an address below 4096 is a tag, not a frame).
    pub stack: &'a [u64],
    /// Sampled blocks live, and their bytes.
    pub count: u64,
    pub bytes: u64,
    /// Sampled blocks since the profile began (`prof_accum`; 0 without it), and
    /// their bytes.
    pub acc_count: u64,
    pub acc_bytes: u64,
}

/// A line of the dump's `MAPPED_LIBRARIES` (the process's `/proc/self/maps`).
pub(super) struct MapLine<'a> {
    pub start: u64,
    pub end: u64,
    pub offset: u64,
    /// Empty for an anonymous mapping.
    pub path: &'a [u8],
}

/// A reader of a heap_v2 dump: the one place the format is parsed is [`read_fd`],
/// which calls these in the dump's order.
pub(super) trait Visit {
    /// The mean bytes between samples (the `heap_v2/RATE` header).
    fn rate(&mut self, rate: u64);
    /// A stack's record.
    fn record(&mut self, record: &Record<'_>);
    /// A mapping, after every record.
    fn map(&mut self, _line: &MapLine<'_>) {}
    /// The records are over (the mappings begin, or the dump ends).
    fn records_done(&mut self) {}
}

/// The read buffer's size: a dump's lines are read through it.
pub(super) const READ_BUF: usize = 8192;

/// Dumps the live profile (`prof.dump`) into a memfd and reads it into `v` through
/// `buf`. False when the profile is off or cannot be dumped. Allocates nothing
/// through the counted paths: jemalloc's bookkeeping of the dump uses its internal
/// arena, and the reading is in the caller's fixed storage.
pub(super) fn dump(v: &mut impl Visit, buf: &mut [u8; READ_BUF]) -> bool {
    if !super::enabled() {
        return false;
    }
    // SAFETY: a NUL-terminated name; flags as memfd_create takes them.
    let fd = unsafe { libc::memfd_create(c"memquota-profile".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return false;
    }
    let mut path = [0u8; 40];
    let mut w = crate::base::text::SliceWriter::new(&mut path[..39]);
    let _ = write!(w, "/proc/self/fd/{fd}");
    let name = path.as_ptr().cast::<libc::c_char>();
    // SAFETY: `prof.dump` takes a `const char *`, here a NUL-terminated path (the
    // buffer's last byte stays 0) that outlives the call.
    let dumped = unsafe { tikv_jemalloc_ctl::raw::write(b"prof.dump\0", name) }.is_ok();
    let read = dumped && read_fd(fd, v, buf);
    // SAFETY: our own descriptor, closed once.
    unsafe { libc::close(fd) };
    read
}

/// Reads the top sites from a heap_v2 dump in `fd`; with `only`, that scope's sites
/// are kept whatever its rank.
#[cfg(test)]
fn parse_fd(fd: c_int, rate: u64, only: Option<u16>) -> Option<Sites> {
    let mut top = Top::new(rate, only);
    read_fd(fd, &mut top, &mut [0; READ_BUF]).then_some(top.sites)
}

/// Reads a heap_v2 dump from `fd` (from its start) line by line into `v`, through
/// `buf`.
pub(super) fn read_fd(fd: c_int, v: &mut impl Visit, buf: &mut [u8; READ_BUF]) -> bool {
    let mut lines = Lines { v, stack: [0; STACK], depth: 0, in_stack: false, maps: false, skip_rest: false };
    let mut have = 0usize;
    let mut offset: i64 = 0;
    loop {
        // SAFETY: reads into the free part of `buf`.
        let n = unsafe { libc::pread(fd, buf[have..].as_mut_ptr().cast(), buf.len() - have, offset) };
        if n < 0 {
            return false;
        }
        let n = n as usize;
        offset += n as i64;
        have += n;
        let mut start = 0;
        while let Some(end) = buf[start..have].iter().position(|&b| b == b'\n') {
            lines.line(&buf[start..start + end]);
            start += end + 1;
        }
        if n == 0 {
            if start < have {
                lines.line(&buf[start..have]);
            }
            if !lines.maps {
                lines.v.records_done();
            }
            return true;
        }
        if start == 0 && have == buf.len() {
            // A line longer than the buffer (a stack of hundreds of frames): its head
            // is enough, the rest is dropped.
            lines.line(&buf[..have]);
            lines.skip_rest = true;
            have = 0;
            continue;
        }
        buf.copy_within(start..have, 0);
        have -= start;
    }
}

/// The line parser of [`read_fd`].
struct Lines<'v, V: Visit> {
    v: &'v mut V,
    /// The stack of the record being read.
    stack: [u64; STACK],
    depth: usize,
    in_stack: bool,
    maps: bool,
    skip_rest: bool,
}

impl<V: Visit> Lines<'_, V> {
    fn line(&mut self, line: &[u8]) {
        if self.skip_rest {
            self.skip_rest = false;
            return;
        }
        if self.maps {
            if let Some(m) = map_line(line) {
                self.v.map(&m);
            }
        } else if let Some(rest) = line.strip_prefix(b"heap_v2/") {
            if let Some(r) = dec(rest) {
                self.v.rate(r);
            }
        } else if let Some(rest) = line.strip_prefix(b"@ ") {
            self.depth = 0;
            for word in rest.split(|&b| b == b' ') {
                if self.depth == STACK {
                    break;
                }
                if let Some(a) = hex(word) {
                    self.stack[self.depth] = a;
                    self.depth += 1;
                }
            }
            self.in_stack = true;
        } else if let Some(rest) = line.strip_prefix(b"  t*: ") {
            // "count: bytes [accumulated count: accumulated bytes]". The header's own
            // total is left: the records' are each scaled by their own mean size.
            let mut parts = rest.split(|&b| b == b':' || b == b' ' || b == b'[' || b == b']');
            let mut next = || parts.find(|p| !p.is_empty()).and_then(dec);
            let (Some(count), Some(bytes)) = (next(), next()) else { return };
            let (acc_count, acc_bytes) = (next().unwrap_or(0), next().unwrap_or(0));
            if self.in_stack {
                let record = Record { stack: &self.stack[..self.depth], count, bytes, acc_count, acc_bytes };
                self.v.record(&record);
                self.in_stack = false;
            }
        } else if line == b"MAPPED_LIBRARIES:" {
            self.v.records_done();
            self.maps = true;
        }
    }
}

/// `start-end perms offset dev inode path`.
fn map_line(line: &[u8]) -> Option<MapLine<'_>> {
    let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty());
    let (range, _perms, off, _dev, _inode) =
        (fields.next()?, fields.next()?, fields.next()?, fields.next()?, fields.next()?);
    let path = fields.next().unwrap_or_default();
    let dash = range.iter().position(|&b| b == b'-')?;
    Some(MapLine { start: hex(&range[..dash])?, end: hex(&range[dash + 1..])?, offset: hex(off)?, path })
}

/// Sites a dump's records are gathered into before the top ones are kept.
const POOL: usize = 32;
/// Sites of scopes, each with its scope, gathered the same way.
const SCOPED_POOL: usize = 32;
/// Scopes whose totals a read adds up before the largest are kept.
const SCOPE_TOTALS: usize = 32;

/// The top sites of a dump, in fixed storage.
struct Top {
    sites: Sites,
    pooled: [Site; POOL],
    pool_len: usize,
    /// Sites of scopes: the scope, and the site with its unreserved bytes.
    scoped: [(u16, Site); SCOPED_POOL],
    scoped_len: usize,
    /// Per scope: the scope, its live bytes, of them unreserved.
    totals: [(u16, u64, u64); SCOPE_TOTALS],
    totals_len: usize,
    /// The scope kept whatever its rank.
    only: Option<u16>,
    rate: u64,
    /// The last object seen at file offset 0: its path and load address.
    base_path: [u8; PATH],
    base_len: usize,
    base: u64,
}

fn hex(s: &[u8]) -> Option<u64> {
    let s = s.strip_prefix(b"0x").unwrap_or(s);
    if s.is_empty() || s.len() > 16 {
        return None;
    }
    let mut v = 0u64;
    for &c in s {
        v = (v << 4) | u64::from((c as char).to_digit(16)? as u8);
    }
    Some(v)
}

fn dec(s: &[u8]) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    let mut v = 0u64;
    for &c in s {
        v = v.checked_mul(10)?.checked_add(u64::from((c as char).to_digit(10)? as u8))?;
    }
    Some(v)
}

/// Two records are one site when their frames after the first are the same (the same
/// callers, down to the function that called the allocator: a function may reach it
/// by two calls, a face's fast and slow paths, and then two return addresses differ
/// in the first frame only).
fn same_site(a: &Site, b: &Site) -> bool {
    a.depth == b.depth
        && a.frames[usize::from(a.depth > 1)..a.depth]
            .iter()
            .zip(&b.frames[usize::from(b.depth > 1)..b.depth])
            .all(|(x, y)| x.addr == y.addr)
}

/// pprof's and jeprof's scaling of a sampled count: each block of `avg` bytes was
/// sampled with probability `1 - exp(-avg / rate)`.
pub(super) fn unsample(count: u64, bytes: u64, rate: u64) -> (u64, u64) {
    if count == 0 || rate == 0 {
        return (count, bytes);
    }
    let avg = bytes as f64 / count as f64;
    let p = 1.0 - (-avg / rate as f64).exp();
    if p <= 0.0 {
        return (count, bytes);
    }
    ((count as f64 / p) as u64, (bytes as f64 / p) as u64)
}

impl Visit for Top {
    fn rate(&mut self, rate: u64) {
        self.rate = rate;
        self.sites.rate = rate;
    }

    fn record(&mut self, r: &Record<'_>) {
        let (blocks, bytes) = unsample(r.count, r.bytes, self.rate);
        self.sites.total = self.sites.total.saturating_add(bytes);
        // The hook's scope tag, if any, is no frame.
        let mut tag = 0;
        let mut site = Site { bytes, blocks, ..Site::default() };
        for &a in r.stack {
            if a < TAG_BELOW {
                tag = a;
            } else if site.depth < FRAMES {
                site.frames[site.depth] = Frame { addr: a, object: u8::MAX, rel: 0 };
                site.depth += 1;
            }
        }
        self.pool(site);
        if let Some((scope, unreserved)) = crate::ledger::tables::tags::decode(tag) {
            self.pool_scoped(scope, Site { unreserved: if unreserved { bytes } else { 0 }, ..site });
        }
    }

    fn records_done(&mut self) {
        self.rank();
    }

    /// The frames of the kept sites that lie in this mapping get their object and
    /// address.
    fn map(&mut self, m: &MapLine<'_>) {
        let (start, end, off, path) = (m.start, m.end, m.offset, m.path);
        if path.is_empty() || path[0] != b'/' {
            return;
        }
        if off == 0 {
            let n = path.len().min(PATH);
            self.base_path[..n].copy_from_slice(&path[..n]);
            self.base_len = n;
            self.base = start;
        }
        let load = if self.base_path[..self.base_len] == path[..path.len().min(PATH)] {
            self.base
        } else {
            start.wrapping_sub(off)
        };
        for k in 0..Sites::FRAME_SLOTS {
            let Some(f) = self.sites.frame_mut(k) else { continue };
            let a = f.addr;
            if a >= start && a < end && f.object == u8::MAX {
                let object = self.sites.intern(path);
                if let Some(f) = self.sites.frame_mut(k) {
                    f.object = object;
                    f.rel = a.wrapping_sub(1).wrapping_sub(load);
                }
            }
        }
    }
}

/// One read's storage: the top sites being gathered and the read buffer, 23 KB.
struct Reading {
    top: Top,
    buf: [u8; READ_BUF],
}

/// A [`Reading`] in pages mapped for one read and unmapped after it. On the stack it
/// stood on the thread that reads: for a refusal's report the refused thread, which
/// then needed 56-64 KiB of stack to report (`tests/sites.rs`). A mapping takes no
/// lock and no allocator: any thread may read at any time, a fork child included.
struct Scratch {
    reading: std::ptr::NonNull<Reading>,
}

impl Scratch {
    const LEN: usize = std::mem::size_of::<Reading>();

    /// A mapped [`Reading`], started at `rate` and `only`; None if the pages cannot
    /// be mapped.
    fn new(rate: u64, only: Option<u16>) -> Option<Scratch> {
        // SAFETY: a private anonymous mapping at an address the kernel chooses; no
        // file, no memory of ours involved.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                Scratch::LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let reading = std::ptr::NonNull::new(p.cast::<Reading>())?;
        let r = reading.as_ptr();
        // SAFETY: `r` is page-aligned (so aligned for `Reading`) and `LEN` bytes are
        // mapped, ours alone. `top` is written whole from a constant before anything
        // reads it; `buf`'s bytes are the mapping's zeros, valid `u8`s.
        unsafe {
            std::ptr::addr_of_mut!((*r).top).write(Top::EMPTY);
            (*r).top.start(rate, only);
        }
        Some(Scratch { reading })
    }

    fn reading(&mut self) -> &mut Reading {
        // SAFETY: initialized in `new`, mapped until `drop`, borrowed through
        // `&mut self` only.
        unsafe { self.reading.as_mut() }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: the mapping `new` made, unmapped once; `Reading` holds nothing to
        // drop.
        unsafe { libc::munmap(self.reading.as_ptr().cast(), Scratch::LEN) };
    }
}

impl Top {
    /// Nothing read yet, at no rate.
    const EMPTY: Top = Top {
        sites: Sites::new(),
        pooled: [Site::EMPTY; POOL],
        pool_len: 0,
        scoped: [(0, Site::EMPTY); SCOPED_POOL],
        scoped_len: 0,
        totals: [(0, 0, 0); SCOPE_TOTALS],
        totals_len: 0,
        only: None,
        rate: 0,
        base_path: [0; PATH],
        base_len: 0,
        base: 0,
    };

    #[cfg(test)]
    fn new(rate: u64, only: Option<u16>) -> Top {
        let mut top = Top::EMPTY;
        top.start(rate, only);
        top
    }

    /// Sets the rate and the scope kept whatever its rank, before a read.
    fn start(&mut self, rate: u64, only: Option<u16>) {
        self.sites.rate = rate;
        self.rate = rate;
        self.only = only;
    }

    /// Adds a record to the pool of sites ([`same_site`] merges two). When the pool is
    /// full, a record larger than its smallest site replaces it.
    fn pool(&mut self, site: Site) {
        if let Some(p) = self.pooled[..self.pool_len].iter_mut().find(|p| same_site(p, &site)) {
            if site.bytes > p.bytes {
                p.frames = site.frames;
            }
            p.bytes = p.bytes.saturating_add(site.bytes);
            p.blocks = p.blocks.saturating_add(site.blocks);
        } else if self.pool_len < POOL {
            self.pooled[self.pool_len] = site;
            self.pool_len += 1;
        } else if let Some(smallest) = self.pooled.iter_mut().min_by_key(|p| p.bytes) {
            if smallest.bytes < site.bytes {
                *smallest = site;
            }
        }
    }

    /// Adds a record of scope `scope` to its total and to the pool of scopes' sites, as
    /// [`pool`](Top::pool) does (the same site in two scopes is two sites).
    fn pool_scoped(&mut self, scope: u16, site: Site) {
        if let Some(t) = self.totals[..self.totals_len].iter_mut().find(|t| t.0 == scope) {
            t.1 = t.1.saturating_add(site.bytes);
            t.2 = t.2.saturating_add(site.unreserved);
        } else if self.totals_len < SCOPE_TOTALS {
            self.totals[self.totals_len] = (scope, site.bytes, site.unreserved);
            self.totals_len += 1;
        }
        let same = |(s, a): &(u16, Site)| *s == scope && same_site(a, &site);
        if let Some((_, p)) = self.scoped[..self.scoped_len].iter_mut().find(|p| same(p)) {
            if site.bytes > p.bytes {
                p.frames = site.frames;
            }
            p.bytes = p.bytes.saturating_add(site.bytes);
            p.blocks = p.blocks.saturating_add(site.blocks);
            p.unreserved = p.unreserved.saturating_add(site.unreserved);
        } else if self.scoped_len < SCOPED_POOL {
            self.scoped[self.scoped_len] = (scope, site);
            self.scoped_len += 1;
        } else if let Some(smallest) = self.scoped.iter_mut().min_by_key(|p| p.1.bytes) {
            if smallest.1.bytes < site.bytes {
                *smallest = (scope, site);
            }
        }
    }

    /// The pool's top sites, and the largest scopes' (with `only` first), once every
    /// record is in.
    fn rank(&mut self) {
        for i in 0..self.pool_len {
            let site = self.pooled[i];
            self.sites.insert(site);
        }
        self.pool_len = 0;
        if self.totals_len == 0 {
            return; // ranked already (at the mapped objects), or no scope sampled
        }
        let only = self.only;
        let key = |t: &(u16, u64, u64)| (Some(t.0) == only, t.1);
        self.totals[..self.totals_len].sort_unstable_by_key(|t| std::cmp::Reverse(key(t)));
        let kept = self.totals_len.min(SCOPES);
        for (k, &(scope, bytes, unreserved)) in self.totals[..kept].iter().enumerate() {
            let mut s = ScopeSites { scope, bytes, unreserved, ..ScopeSites::EMPTY };
            for (_, site) in self.scoped[..self.scoped_len].iter().filter(|p| p.0 == scope) {
                insert_by(&mut s.top, &mut s.len, *site, |x| x.bytes);
                if site.unreserved > 0 {
                    insert_by(&mut s.top_unreserved, &mut s.unreserved_len, *site, |x| x.unreserved);
                }
            }
            self.sites.scopes[k] = s;
        }
        self.sites.scopes_len = kept;
        self.totals_len = 0;
        self.scoped_len = 0;
    }
}

/// The sites as the report's lines: each site's estimated bytes and share, its
/// frames innermost first as `OBJECT+0xADDR` (a frame in the same object as the one
/// before it as `+0xADDR`).
pub fn write_sites(w: &mut impl Write, s: &Sites, label: &str) -> fmt::Result {
    if s.len == 0 {
        return writeln!(w, "  {label:<16} none sampled (1 sample per {:#} allocated)", Size(s.rate));
    }
    writeln!(
        w,
        "  {label:<16} of {:#} live, estimated from samples (1 per {:#} allocated); frames innermost first, \
         OBJECT+ADDR for addr2line -f -e OBJECT ADDR",
        Size(s.total),
        Size(s.rate)
    )?;
    for site in &s.sites[..s.len] {
        let share = if s.total > 0 { site.bytes as f64 * 100.0 / s.total as f64 } else { 0.0 };
        write!(w, "    {} in {} blocks  {share:.1}% ", Size(site.bytes), site.blocks)?;
        write_frames(w, s, site)?;
    }
    Ok(())
}

/// A site's frames innermost first, as `OBJECT+0xADDR` (`+0xADDR` in the object of
/// the frame before), and the line's end.
fn write_frames(w: &mut impl Write, s: &Sites, site: &Site) -> fmt::Result {
    let mut last = u8::MAX;
    for (k, f) in site.frames[..site.depth].iter().enumerate() {
        if k > 0 {
            w.write_str(" <-")?;
        }
        match s.object(f.object) {
            Some(_) if f.object == last => write!(w, " +{:#x}", f.rel)?,
            Some(path) => write!(w, " {path}+{:#x}", f.rel)?,
            None => write!(w, " {:#x}", f.addr)?,
        }
        last = f.object;
    }
    w.write_char('\n')
}

/// A scope's sites for the report's scope tree, under its line: what is live of its
/// allocations and how much of it no reservation covered, then its top sites, each
/// with its unreserved part, frames as [`write_sites`] writes them.
pub fn write_scope_sites(w: &mut impl Write, s: &Sites, scope: &ScopeSites, indent: &str) -> fmt::Result {
    writeln!(
        w,
        "{indent}sites: {:#} live, estimated from samples, {:#} of it unreserved (allocated past its reservations)",
        Size(scope.bytes),
        Size(scope.unreserved)
    )?;
    for site in &scope.top[..scope.len] {
        write!(w, "{indent}  {} ({:#} unreserved) ", Size(site.bytes), Size(site.unreserved))?;
        write_frames(w, s, site)?;
    }
    Ok(())
}

/// A scope's top sites by unreserved bytes: what its threads allocated, still live,
/// while its allocations went past what its reservations covered. One line each,
/// frames as [`write_sites`] writes them; nothing when none was sampled.
pub fn write_unreserved_sites(
    w: &mut impl Write,
    s: &Sites,
    scope: &ScopeSites,
    indent: &str,
) -> fmt::Result {
    for site in &scope.top_unreserved[..scope.unreserved_len] {
        write!(w, "{indent}{} unreserved of {} live ", Size(site.unreserved), Size(site.bytes))?;
        write_frames(w, s, site)?;
    }
    Ok(())
}

/// The sites as comment lines of a Prometheus text (the preload's stats file), for
/// `memquota run` to name: `# memquota site BYTES SHARE% OBJECT+ADDR ...`, every
/// frame with its object, after a `# memquota sites WHEN` line.
pub fn write_site_comments(w: &mut impl Write, s: &Sites, when: &str) -> fmt::Result {
    writeln!(w, "# memquota sites {when}; total {} bytes, 1 sample per {} bytes", s.total, s.rate)?;
    for site in &s.sites[..s.len] {
        let share = if s.total > 0 { site.bytes as f64 * 100.0 / s.total as f64 } else { 0.0 };
        write!(w, "# memquota site {} {share:.1}%", site.bytes)?;
        for f in &site.frames[..site.depth] {
            match s.object(f.object) {
                Some(path) => write!(w, " {path}+{:#x}", f.rel)?,
                None => write!(w, " {:#x}", f.addr)?,
            }
        }
        w.write_char('\n')?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dump as jemalloc writes it: the top sites by estimated bytes, each frame
    /// placed in its object (less the load address of the object's first mapping),
    /// scaled as pprof does, the total of every record.
    #[test]
    fn a_dump_is_read_into_its_top_sites() {
        let dump = "heap_v2/524288\n  t*: 99: 6500000 [0: 0]\n  t0: 99: 6500000 [0: 0]\n\
            @ 0x55bc7c53b18e 0x55bc7c53b075 0x7fb552c4524a\n  t*: 50: 3280563 [0: 0]\n  t0: 50: 3280563 [0: 0]\n\
            @ 0x55bc7c53b1be 0x7fb552c4524a\n  t*: 48: 196608 [0: 0]\n\
            @ 0x7f0000000010\n  t*: 1: 64 [0: 0]\n\
            @ 0x55bc7c53b100 0x55bc7c53b075 0x7fb552c4524a\n  t*: 2: 131222 [0: 0]\n\
            \nMAPPED_LIBRARIES:\n\
            55bc7c53a000-55bc7c53b000 r--p 00000000 fe:00 10011056                   /tmp/two\n\
            55bc7c53b000-55bc7c53c000 r-xp 00001000 fe:00 10011056                   /tmp/two\n\
            7fb552c1e000-7fb552c44000 r--p 00000000 fe:00 326606                     /usr/lib/libc.so.6\n\
            7fb552c44000-7fb552d99000 r-xp 00026000 fe:00 326606                     /usr/lib/libc.so.6\n";
        // SAFETY: a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: writes the bytes of `dump` to our own descriptor.
        let n = unsafe { libc::write(fd, dump.as_ptr().cast(), dump.len()) };
        assert_eq!(n, dump.len() as isize);
        let s = parse_fd(fd, 0, None).expect("parsed");
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(fd) };
        assert_eq!(s.rate, 524288);
        assert_eq!(s.len, 3);
        let first = &s.sites[0];
        // 50 and 2 blocks of about 64 KiB from one function by two calls (the same
        // callers): one site, with the larger record's frames; each block sampled
        // with probability 1 - exp(-size / 524288).
        let p = |count: f64, bytes: f64| 1.0 - (-(bytes / count) / 524288.0f64).exp();
        let (p1, p2) = (p(50.0, 3280563.0), p(2.0, 131222.0));
        assert_eq!(first.bytes, (3280563.0 / p1) as u64 + (131222.0 / p2) as u64);
        assert_eq!(first.blocks, (50.0 / p1) as u64 + (2.0 / p2) as u64);
        assert_eq!(first.depth, 3);
        assert_eq!(s.object(first.frames[0].object), Some("/tmp/two"));
        assert_eq!(first.frames[0].rel, 0x55bc7c53b18e - 1 - 0x55bc7c53a000);
        assert_eq!(s.object(first.frames[2].object), Some("/usr/lib/libc.so.6"));
        assert_eq!(first.frames[2].rel, 0x7fb552c4524a - 1 - 0x7fb552c1e000);
        assert!(s.sites[1].bytes < first.bytes && s.sites[2].bytes < s.sites[1].bytes);
        assert_eq!(s.sites[2].frames[0].object, u8::MAX, "in no file");
        assert_eq!(s.total, s.sites[..3].iter().map(|x| x.bytes).sum::<u64>());
        let mut text = String::new();
        write_sites(&mut text, &s, "top sites").unwrap();
        assert!(text.contains("/tmp/two+0x118d <- +0x1074 <- /usr/lib/libc.so.6+0x27249\n"), "{text}");
        assert!(text.contains(" 0x7f0000000010\n"), "{text}");
        let mut comments = String::new();
        write_site_comments(&mut comments, &s, "live now").unwrap();
        assert!(comments.starts_with("# memquota sites live now;"), "{comments}");
        assert!(
            comments.contains("% /tmp/two+0x118d /tmp/two+0x1074 /usr/lib/libc.so.6+0x27249\n"),
            "{comments}"
        );
    }

    /// Every record reaches a reader whole: its full stack (deeper than a site's
    /// frames) and the accumulated figures `prof_accum` adds.
    #[test]
    fn a_reader_gets_each_records_stack_and_accumulated_figures() {
        #[derive(Default)]
        struct Seen(u64, Vec<(Vec<u64>, [u64; 4])>, usize, bool);
        impl Visit for Seen {
            fn rate(&mut self, rate: u64) {
                self.0 = rate;
            }
            fn record(&mut self, r: &Record<'_>) {
                self.1.push((r.stack.to_vec(), [r.count, r.bytes, r.acc_count, r.acc_bytes]));
            }
            fn map(&mut self, _: &MapLine<'_>) {
                self.2 += 1;
            }
            fn records_done(&mut self) {
                self.3 = self.2 == 0;
            }
        }
        let dump = "heap_v2/16384\n  t*: 3: 300 [9: 900]\n@ 0x1 0x2 0x3 0x4 0x5 0x6\n  t*: 3: 300 [9: 900]\n\
            @ 0x7\n  t*: 0: 0 [4: 4096]\n\nMAPPED_LIBRARIES:\n1000-2000 r-xp 00000000 fe:00 1 /bin/x\n";
        // SAFETY: a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: writes the bytes of `dump` to our own descriptor.
        assert_eq!(unsafe { libc::write(fd, dump.as_ptr().cast(), dump.len()) }, dump.len() as isize);
        let mut seen = Seen::default();
        assert!(read_fd(fd, &mut seen, &mut [0; READ_BUF]));
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(fd) };
        assert_eq!(seen.0, 16384);
        assert_eq!(seen.1, vec![(vec![1, 2, 3, 4, 5, 6], [3, 300, 9, 900]), (vec![7], [0, 0, 4, 4096])]);
        assert_eq!(seen.2, 1);
        assert!(seen.3, "the records end before the mappings");
    }

    /// Records tagged by the stack hook: the tag is no frame, and each scope gets its
    /// own sites, with what was allocated past its reservations.
    #[test]
    fn tagged_records_are_each_scopes_own() {
        use crate::ledger::tables::tags::{scope_part, tag};
        let (a, b) = (tag(0, 1, true), tag(1, 2, false));
        let covered_a = tag(0, 1, false);
        let dump = format!(
            "heap_v2/524288\n\
            @ 0x55bc7c53b18e 0x55bc7c53b075 {a:#x}\n  t*: 4: 4194304 [0: 0]\n\
            @ 0x55bc7c53b18e 0x55bc7c53b075 {covered_a:#x}\n  t*: 1: 1048576 [0: 0]\n\
            @ 0x55bc7c53b1be 0x55bc7c53b085 {b:#x}\n  t*: 2: 2097152 [0: 0]\n\
            @ 0x55bc7c53b100 0x55bc7c53b095\n  t*: 8: 8388608 [0: 0]\n\
            \nMAPPED_LIBRARIES:\n\
            55bc7c53a000-55bc7c53c000 r-xp 00000000 fe:00 10011056                   /tmp/two\n"
        );
        // SAFETY: a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: writes the bytes of `dump` to our own descriptor.
        let n = unsafe { libc::write(fd, dump.as_ptr().cast(), dump.len()) };
        assert_eq!(n, dump.len() as isize);
        let s = parse_fd(fd, 0, None).expect("parsed");
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(fd) };
        assert_eq!(s.len, 3, "the tag is no frame: scope a's two records are one site");
        assert!(s.sites.iter().all(|x| x.frames[..x.depth].iter().all(|f| f.addr >= TAG_BELOW)));
        assert_eq!(s.scopes_len, 2);
        let sa = s.scope(scope_part(0, 1)).expect("scope a");
        assert_eq!(sa.len, 1);
        assert_eq!(sa.top[0].depth, 2);
        assert!(sa.unreserved > 0 && sa.unreserved < sa.bytes, "4 of its 5 MiB unreserved: {sa:?}");
        assert_eq!(sa.top_unreserved[0].unreserved, sa.unreserved);
        assert_eq!(s.object(sa.top[0].frames[0].object), Some("/tmp/two"), "its frames are placed");
        let sb = s.scope(scope_part(1, 2)).expect("scope b");
        assert_eq!((sb.unreserved, sb.unreserved_len), (0, 0));
        assert!(sb.bytes < sa.bytes && s.scopes[0].scope == sa.scope, "the larger scope first");
        let mut text = String::new();
        write_unreserved_sites(&mut text, &s, sa, "").unwrap();
        assert!(text.contains(" unreserved of ") && text.contains("/tmp/two+0x118d <- +0x1074\n"), "{text}");
    }
}
