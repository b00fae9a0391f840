//! The heap profile as pprof reads it: `profile.proto`, gzipped, from a heap_v2 dump
//! read by `dump.rs`. For a service thread (the metrics endpoint, the flight
//! recorder): it allocates, which is counted there and never refused.
//!
//! Sample types as Go's heap profile: `alloc_objects`, `alloc_space` (what was
//! allocated since the profile began: jemalloc's `prof_accum`, left out when a
//! user's options turn it off), `inuse_objects`, `inuse_space` (live); each scaled
//! as `dump.rs` scales them (unbiased, as pprof and jeprof do). Locations are
//! addresses (the call, the return address less one) in mappings that name their
//! object and its GNU build ID: a reader symbolizes them with the object's files.

use super::dump::{self, Record, Visit};
use std::collections::HashMap;

/// The sample types, in the order each sample's values come.
const TYPES: [(&str, &str); 4] = [
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
];

/// A stack's frames below this are tags another part of the profile puts in the
/// stack (a scope), not code: no mapping holds the first page.
const TAG_BELOW: u64 = 4096;

/// The live profile as a gzipped `profile.proto`, or None when the profile is off.
pub fn heap_profile() -> Option<Vec<u8>> {
    let mut records =
        Records { rate: super::RATE.load(crate::base::sync::Ordering::Relaxed), ..Records::default() };
    if !dump::dump(&mut records, &mut [0; dump::READ_BUF]) {
        return None;
    }
    let accum = super::ctl_read::<bool>(b"opt.prof_accum\0") == Some(true);
    let objects = loaded_objects();
    Some(gzip(&encode(&records, &objects, accum)))
}

/// The records of a dump, each stack's values scaled.
#[derive(Default)]
struct Records {
    rate: u64,
    /// Frames (tags left out), and values in [`TYPES`]' order.
    samples: Vec<(Vec<u64>, [i64; 4])>,
}

impl Visit for Records {
    fn rate(&mut self, rate: u64) {
        self.rate = rate;
    }

    fn record(&mut self, r: &Record<'_>) {
        let (live_n, live_b) = dump::unsample(r.count, r.bytes, self.rate);
        let (acc_n, acc_b) = dump::unsample(r.acc_count, r.acc_bytes, self.rate);
        let frames: Vec<u64> = r.stack.iter().copied().filter(|&a| a >= TAG_BELOW).collect();
        let signed = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.samples.push((frames, [signed(acc_n), signed(acc_b), signed(live_n), signed(live_b)]));
    }
}

/// A loaded object's executable segment.
#[derive(Clone, Debug, PartialEq)]
struct Segment {
    start: u64,
    limit: u64,
    offset: u64,
    path: String,
    build_id: String,
}

/// The executable segments of every loaded object with a file, from the loader
/// (`dl_iterate_phdr`), each with its object's GNU build ID read from its notes in
/// memory. The program's own path is `/proc/self/exe`'s target.
fn loaded_objects() -> Vec<Segment> {
    /// Segments kept; the callback runs under the loader's lock and must not
    /// allocate, so it fills storage reserved before.
    const MAX: usize = 512;
    /// A segment as the callback copies it: start, limit, file offset, the
    /// object's name and its length, its build ID and that ID's length.
    type Raw = (u64, u64, u64, [u8; 256], usize, [u8; 20], usize);
    struct Found {
        segments: Vec<Raw>,
    }
    extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut libc::c_void) -> libc::c_int {
        // SAFETY: dl_iterate_phdr passes a valid info for the call, and `data` is the
        // `Found` handed to it below, borrowed by nothing else meanwhile.
        let (info, found) = unsafe { (&*info, &mut *data.cast::<Found>()) };
        // SAFETY: dlpi_name is a NUL-terminated string (empty for the program).
        let name = unsafe { std::ffi::CStr::from_ptr(info.dlpi_name) }.to_bytes();
        let mut path = [0u8; 256];
        let path_len = name.len().min(path.len());
        path[..path_len].copy_from_slice(&name[..path_len]);
        let (mut id, mut id_len) = ([0u8; 20], 0);
        for i in 0..usize::from(info.dlpi_phnum) {
            // SAFETY: dlpi_phdr holds dlpi_phnum headers.
            let ph = unsafe { &*info.dlpi_phdr.add(i) };
            if ph.p_type == libc::PT_NOTE && id_len == 0 {
                let at = (info.dlpi_addr as usize).wrapping_add(ph.p_vaddr as usize);
                // SAFETY: a PT_NOTE segment is mapped (inside a PT_LOAD one) for its
                // p_memsz bytes at the object's load address plus p_vaddr.
                let notes = unsafe { std::slice::from_raw_parts(at as *const u8, ph.p_memsz as usize) };
                if let Some(found_id) = gnu_build_id(notes) {
                    id_len = found_id.len().min(id.len());
                    id[..id_len].copy_from_slice(&found_id[..id_len]);
                }
            }
        }
        for i in 0..usize::from(info.dlpi_phnum) {
            // SAFETY: as above.
            let ph = unsafe { &*info.dlpi_phdr.add(i) };
            if ph.p_type == libc::PT_LOAD && ph.p_flags & libc::PF_X != 0 && found.segments.len() < MAX {
                let start = info.dlpi_addr.wrapping_add(ph.p_vaddr);
                found.segments.push((start, start + ph.p_memsz, ph.p_offset, path, path_len, id, id_len));
            }
        }
        0
    }
    let mut found = Found { segments: Vec::with_capacity(MAX) };
    // SAFETY: `each` matches the callback type and only touches `found`, whose
    // storage is reserved: it never grows inside the callback.
    unsafe { libc::dl_iterate_phdr(Some(each), (&mut found as *mut Found).cast()) };
    let exe =
        std::fs::read_link("/proc/self/exe").map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    found
        .segments
        .iter()
        .filter_map(|(start, limit, offset, path, path_len, id, id_len)| {
            let path = match &path[..*path_len] {
                [] => exe.clone(),
                p => String::from_utf8_lossy(p).into_owned(),
            };
            // The vDSO and other objects with no file: nothing to symbolize with.
            path.starts_with('/').then(|| Segment {
                start: *start,
                limit: *limit,
                offset: *offset,
                path,
                build_id: id[..*id_len].iter().map(|b| format!("{b:02x}")).collect(),
            })
        })
        .collect()
}

/// The descriptor of the `NT_GNU_BUILD_ID` note among `notes` (a PT_NOTE segment).
fn gnu_build_id(notes: &[u8]) -> Option<&[u8]> {
    const NT_GNU_BUILD_ID: u32 = 3;
    let word = |at: usize| notes.get(at..at + 4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    let align = |n: usize| (n + 3) & !3;
    let mut at = 0;
    while at + 12 <= notes.len() {
        let (namesz, descsz, kind) = (word(at)? as usize, word(at + 4)? as usize, word(at + 8)?);
        let name = notes.get(at + 12..at + 12 + namesz)?;
        let desc_at = at + 12 + align(namesz);
        let desc = notes.get(desc_at..desc_at + descsz)?;
        if kind == NT_GNU_BUILD_ID && name == b"GNU\0" {
            return Some(desc);
        }
        at = desc_at + align(descsz);
    }
    None
}

/// Protobuf's wire format, the little of it a profile needs.
#[derive(Default)]
struct Proto(Vec<u8>);

impl Proto {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    /// A varint field (int64, uint64, bool); proto3 leaves a zero out.
    fn uint(&mut self, field: u32, v: u64) {
        if v != 0 {
            self.varint(u64::from(field) << 3);
            self.varint(v);
        }
    }

    fn int(&mut self, field: u32, v: i64) {
        self.uint(field, v as u64);
    }

    /// A length-delimited field: a message, a string, a packed repeated varint.
    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.varint((u64::from(field) << 3) | 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }

    fn message(&mut self, field: u32, build: impl FnOnce(&mut Proto)) {
        let mut m = Proto::default();
        build(&mut m);
        self.bytes(field, &m.0);
    }

    fn packed(&mut self, field: u32, values: impl Iterator<Item = u64>) {
        let mut m = Proto::default();
        values.for_each(|v| m.varint(v));
        self.bytes(field, &m.0);
    }
}

/// The string table: index 0 is "".
struct Strings {
    index: HashMap<String, i64>,
    table: Vec<String>,
}

impl Strings {
    fn new() -> Strings {
        Strings { index: HashMap::from([(String::new(), 0)]), table: vec![String::new()] }
    }

    fn id(&mut self, s: &str) -> i64 {
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        let i = self.table.len() as i64;
        self.index.insert(s.to_owned(), i);
        self.table.push(s.to_owned());
        i
    }
}

/// `perftools.profiles.Profile`: sample types, samples (location ids and values),
/// mappings, locations (an address in a mapping each), the string table, the
/// sampling period.
fn encode(records: &Records, objects: &[Segment], accum: bool) -> Vec<u8> {
    let mut strings = Strings::new();
    let mut p = Proto::default();
    // Without `prof_accum` jemalloc keeps no counts of freed samples: the alloc_*
    // types would read 0, so they are left out rather than shown wrong.
    let kept: &[usize] = if accum { &[0, 1, 2, 3] } else { &[2, 3] };
    for &t in kept {
        let (kind, unit) = TYPES[t];
        let (kind, unit) = (strings.id(kind), strings.id(unit));
        p.message(1, |m| {
            m.int(1, kind);
            m.int(2, unit);
        });
    }
    // Locations: one per distinct address, ids from 1.
    let mut locations: HashMap<u64, u64> = HashMap::new();
    let mut order: Vec<u64> = Vec::new();
    for (frames, values) in &records.samples {
        if values[2] == 0 && (!accum || values[0] == 0) {
            continue;
        }
        let ids: Vec<u64> = frames
            .iter()
            .map(|&a| {
                let next = locations.len() as u64 + 1;
                *locations.entry(a).or_insert_with(|| {
                    order.push(a);
                    next
                })
            })
            .collect();
        p.message(2, |m| {
            m.packed(1, ids.iter().copied());
            m.packed(2, kept.iter().map(|&t| values[t] as u64));
        });
    }
    for (i, o) in objects.iter().enumerate() {
        let (file, id) = (strings.id(&o.path), strings.id(&o.build_id));
        p.message(3, |m| {
            m.uint(1, i as u64 + 1);
            m.uint(2, o.start);
            m.uint(3, o.limit);
            m.uint(4, o.offset);
            m.int(5, file);
            m.int(6, id);
        });
    }
    for (i, &a) in order.iter().enumerate() {
        // A return address: the call is the instruction before it.
        let call = a - 1;
        let mapping = objects.iter().position(|o| (o.start..o.limit).contains(&call));
        p.message(4, |m| {
            m.uint(1, i as u64 + 1);
            m.uint(2, mapping.map_or(0, |k| k as u64 + 1));
            m.uint(3, call);
        });
    }
    let (space, bytes) = (strings.id("space"), strings.id("bytes"));
    let default = strings.id("inuse_space");
    for s in &strings.table {
        p.bytes(6, s.as_bytes());
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    p.int(9, i64::try_from(now).unwrap_or(0));
    p.message(11, |m| {
        m.int(1, space);
        m.int(2, bytes);
    });
    p.int(12, i64::try_from(records.rate).unwrap_or(0));
    p.int(14, default);
    p.0
}

/// A gzip member of stored (uncompressed) deflate blocks: every gzip reader takes
/// it, and a profile of a few hundred stacks is tens of KiB, so compressing it would
/// buy little for a compression library in the allocator's crate.
fn gzip(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + data.len() / 65535 * 5 + 32);
    out.extend_from_slice(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255]);
    let mut chunks = data.chunks(65535).peekable();
    if chunks.peek().is_none() {
        out.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    }
    while let Some(chunk) = chunks.next() {
        out.push(u8::from(chunks.peek().is_none()));
        let n = chunk.len() as u16;
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&(!n).to_le_bytes());
        out.extend_from_slice(chunk);
    }
    out.extend_from_slice(&crc32(data).to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out
}

/// CRC-32 (IEEE), as gzip's trailer holds it.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xedb8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_of_stored_blocks_has_the_standard_check() {
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
        let g = gzip(b"abc");
        assert_eq!(&g[..3], &[0x1f, 0x8b, 8]);
        assert_eq!(&g[10..15], &[1, 3, 0, 0xfc, 0xff]);
        assert_eq!(&g[15..18], b"abc");
        assert_eq!(g.len(), 18 + 8);
        let big = vec![7u8; 70000];
        let g = gzip(&big);
        assert_eq!(g[10], 0, "a first block that is not the last");
        assert_eq!(g.len(), 10 + 5 + 65535 + 5 + (70000 - 65535) + 8);
    }

    #[test]
    fn a_build_id_is_read_from_the_notes() {
        let mut notes = Vec::new();
        // An ABI tag note first, then the build ID.
        for (name, kind, desc) in
            [(&b"GNU\0"[..], 1u32, &[0u8, 0, 0, 0, 3, 0, 0, 0][..]), (b"GNU\0", 3, &[0xab, 0xcd, 0xef])]
        {
            notes.extend_from_slice(&(name.len() as u32).to_ne_bytes());
            notes.extend_from_slice(&(desc.len() as u32).to_ne_bytes());
            notes.extend_from_slice(&kind.to_ne_bytes());
            notes.extend_from_slice(name);
            notes.extend_from_slice(desc);
            notes.resize((notes.len() + 3) & !3, 0);
        }
        assert_eq!(gnu_build_id(&notes), Some(&[0xab, 0xcd, 0xef][..]));
        assert_eq!(gnu_build_id(&notes[..20]), None);
    }

    #[test]
    fn this_programs_objects_have_build_ids() {
        let objects = loaded_objects();
        let exe = std::fs::read_link("/proc/self/exe").unwrap().to_string_lossy().into_owned();
        let own = objects.iter().find(|o| o.path == exe).expect("the program's own segment");
        assert_eq!(own.build_id.len(), 40, "a 20-byte GNU build ID: {own:?}");
        let here = this_programs_objects_have_build_ids as *const () as u64;
        assert!(objects.iter().any(|o| o.path == exe && (o.start..o.limit).contains(&here)), "{objects:?}");
    }

    /// The encoding of a record: a reader of the wire format finds the types, the
    /// sample's values and locations, the mapping and the string table.
    #[test]
    fn a_profile_encodes_its_samples_mappings_and_locations() {
        let records = Records {
            rate: 1024,
            samples: vec![(vec![0x1010, 0x2020], [4, 400, 2, 200]), (vec![0x1010], [0; 4])],
        };
        let objects = vec![Segment {
            start: 0x1000,
            limit: 0x3000,
            offset: 0x1000,
            path: "/bin/x".into(),
            build_id: "ab".into(),
        }];
        let bytes = encode(&records, &objects, true);
        let top = fields(&bytes);
        let count = |f: u64| top.iter().filter(|(k, _)| *k == f).count();
        assert_eq!(count(1), 4, "four sample types");
        assert_eq!(count(2), 1, "the sample with nothing live and nothing allocated is left out");
        assert_eq!(count(3), 1);
        assert_eq!(count(4), 2, "one location per address");
        let strings: Vec<&[u8]> = top.iter().filter(|(k, _)| *k == 6).map(|(_, v)| v.as_slice()).collect();
        assert_eq!(strings[0], b"");
        assert!(strings.contains(&&b"inuse_space"[..]) && strings.contains(&&b"/bin/x"[..]));
        let sample = fields(&top.iter().find(|(k, _)| *k == 2).unwrap().1);
        assert_eq!(varints(&sample[0].1), vec![1, 2], "location ids");
        assert_eq!(varints(&sample[1].1), vec![4, 400, 2, 200], "values in the types' order");
        let location = fields(&top.iter().find(|(k, _)| *k == 4).unwrap().1);
        assert_eq!(varints(&location.iter().find(|(k, _)| *k == 3).unwrap().1), vec![0x100f], "the call");
        let without = fields(&encode(&records, &objects, false));
        assert_eq!(without.iter().filter(|(k, _)| *k == 1).count(), 2, "no alloc_* without prof_accum");
    }

    /// Fields of a message: (number, payload); a varint's payload is its encoding.
    fn fields(mut b: &[u8]) -> Vec<(u64, Vec<u8>)> {
        let mut out = Vec::new();
        while !b.is_empty() {
            let (key, n) = varint(b);
            b = &b[n..];
            match key & 7 {
                0 => {
                    let (_, n) = varint(b);
                    out.push((key >> 3, b[..n].to_vec()));
                    b = &b[n..];
                }
                2 => {
                    let (len, n) = varint(b);
                    out.push((key >> 3, b[n..n + len as usize].to_vec()));
                    b = &b[n + len as usize..];
                }
                w => panic!("wire type {w}"),
            }
        }
        out
    }

    fn varint(b: &[u8]) -> (u64, usize) {
        let (mut v, mut i) = (0u64, 0);
        loop {
            v |= u64::from(b[i] & 0x7f) << (7 * i);
            i += 1;
            if b[i - 1] < 0x80 {
                return (v, i);
            }
        }
    }

    fn varints(mut b: &[u8]) -> Vec<u64> {
        let mut out = Vec::new();
        while !b.is_empty() {
            let (v, n) = varint(b);
            out.push(v);
            b = &b[n..];
        }
        out
    }
}
