//! `memquota profile ADDR`: the heap profile of a running program, read from its
//! metrics endpoint (`GET /debug/pprof/heap`) or from a file the endpoint or the
//! flight recorder wrote; its top sites printed (`--top N`), each frame named by
//! `addr2line` as `memquota run` names them, or the profile written (`--out FILE`)
//! for pprof and the tools that read its format.
//!
//! Reads the profile memquota writes: gzip of stored blocks, `profile.proto`.

use crate::symbols::addr2line;
use crate::Failure;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;

/// Frames shown per site, innermost first.
const FRAMES: usize = 5;

#[derive(clap::Args, Debug)]
pub struct ProfileArgs {
    /// The endpoint (MEMQUOTA_METRICS_ADDR): HOST:PORT or http://HOST:PORT[/PATH];
    /// or a profile file (written by --out or the flight recorder).
    #[arg(value_name = "ADDR|FILE")]
    source: String,
    /// Print the N sites with the most live bytes (10 if neither --top nor --out is
    /// given).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=10_000))]
    top: Option<u64>,
    /// Write the profile (gzipped profile.proto, as `go tool pprof` reads it) to FILE.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

pub fn profile(args: &ProfileArgs) -> Result<(), Failure> {
    let bytes = crate::fetch::read_bytes(&args.source, "/debug/pprof/heap")?;
    let decoded = gunzip(&bytes).and_then(|raw| Profile::decode(&raw));
    let profile = decoded.map_err(|e| format!("{}: not a heap profile memquota wrote: {e}", args.source))?;
    let mut text = String::new();
    if let Some(out) = &args.out {
        std::fs::write(out, &bytes).map_err(|e| format!("cannot write {}: {e}", out.display()))?;
        let _ = writeln!(
            text,
            "memquota: wrote the heap profile of {} to {} ({} bytes)",
            args.source,
            out.display(),
            bytes.len()
        );
    }
    if args.top.is_some() || args.out.is_none() {
        text.push_str(&profile.top(args.top.unwrap_or(10) as usize, &args.source, &mut addr2line)?);
    }
    let _ = std::io::stdout().write_all(text.as_bytes());
    Ok(())
}

/// The data of a gzip member of stored deflate blocks (what memquota writes).
fn gunzip(b: &[u8]) -> Result<Vec<u8>, String> {
    if b.len() < 18 || b[..3] != [0x1f, 0x8b, 8] {
        return Err("it is not gzip".into());
    }
    let flags = b[3];
    let mut at = 10;
    if flags & 4 != 0 {
        let n = usize::from(u16::from_le_bytes([b[at], b[at + 1]]));
        at += 2 + n;
    }
    for bit in [8u8, 16] {
        if flags & bit != 0 {
            at +=
                b.get(at..).and_then(|r| r.iter().position(|&c| c == 0)).ok_or("a truncated gzip header")?
                    + 1;
        }
    }
    if flags & 2 != 0 {
        at += 2;
    }
    let mut out = Vec::new();
    loop {
        let head = *b.get(at).ok_or("a truncated gzip stream")?;
        if head & 6 != 0 {
            return Err("its deflate blocks are compressed; memquota writes stored ones (read it with `go tool pprof`)".into());
        }
        let len = b.get(at + 1..at + 3).map(|l| usize::from(u16::from_le_bytes([l[0], l[1]])));
        let len = len.ok_or("a truncated gzip stream")?;
        out.extend_from_slice(b.get(at + 5..at + 5 + len).ok_or("a truncated gzip stream")?);
        at += 5 + len;
        if head & 1 != 0 {
            return Ok(out);
        }
    }
}

/// What `--top` needs of a profile.
#[derive(Debug, Default)]
struct Profile {
    strings: Vec<String>,
    /// (type, unit) string indices.
    types: Vec<(usize, usize)>,
    /// Location ids and values.
    samples: Vec<(Vec<u64>, Vec<i64>)>,
    /// id -> (start, limit, offset, path)
    mappings: HashMap<u64, (u64, u64, u64, usize)>,
    /// id -> (mapping id, address)
    locations: HashMap<u64, (u64, u64)>,
    period: i64,
}

/// A field of a protobuf message: its number, whether it is length-delimited, its
/// varint value or its payload.
type Field<'a> = (u64, bool, u64, &'a [u8]);

fn fields(mut b: &[u8]) -> Result<Vec<Field<'_>>, String> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let (key, n) = varint(b)?;
        b = &b[n..];
        match key & 7 {
            0 => {
                let (v, n) = varint(b)?;
                out.push((key >> 3, false, v, &b[..0]));
                b = &b[n..];
            }
            2 => {
                let (len, n) = varint(b)?;
                let end =
                    n.checked_add(usize::try_from(len).map_err(|_| "a bad length")?).ok_or("a bad length")?;
                let payload = b.get(n..end).ok_or("a truncated message")?;
                out.push((key >> 3, true, 0, payload));
                b = &b[end..];
            }
            1 => b = b.get(8..).ok_or("a truncated message")?,
            5 => b = b.get(4..).ok_or("a truncated message")?,
            w => return Err(format!("wire type {w}")),
        }
    }
    Ok(out)
}

fn varint(b: &[u8]) -> Result<(u64, usize), String> {
    let mut v = 0u64;
    for (i, &c) in b.iter().enumerate().take(10) {
        v |= u64::from(c & 0x7f) << (7 * i);
        if c < 0x80 {
            return Ok((v, i + 1));
        }
    }
    Err("a truncated varint".into())
}

/// A repeated varint field, packed or not.
fn repeated(value: u64, payload: &[u8], wire_packed: bool, into: &mut Vec<u64>) -> Result<(), String> {
    if !wire_packed {
        into.push(value);
        return Ok(());
    }
    let mut b = payload;
    while !b.is_empty() {
        let (v, n) = varint(b)?;
        into.push(v);
        b = &b[n..];
    }
    Ok(())
}

impl Profile {
    fn decode(raw: &[u8]) -> Result<Profile, String> {
        let mut p = Profile::default();
        for (field, delimited, value, payload) in fields(raw)? {
            match field {
                1 => {
                    let f = fields(payload)?;
                    let get = |k| f.iter().find(|x| x.0 == k).map_or(0, |x| x.2 as usize);
                    p.types.push((get(1), get(2)));
                }
                2 => {
                    let (mut ids, mut values) = (Vec::new(), Vec::new());
                    for (k, packed, v, pl) in fields(payload)? {
                        match k {
                            1 => repeated(v, pl, packed, &mut ids)?,
                            2 => repeated(v, pl, packed, &mut values)?,
                            _ => {}
                        }
                    }
                    p.samples.push((ids, values.into_iter().map(|v| v as i64).collect()));
                }
                3 => {
                    let f = fields(payload)?;
                    let get = |k| f.iter().find(|x| x.0 == k).map_or(0, |x| x.2);
                    p.mappings.insert(get(1), (get(2), get(3), get(4), get(5) as usize));
                }
                4 => {
                    let f = fields(payload)?;
                    let get = |k| f.iter().find(|x| x.0 == k).map_or(0, |x| x.2);
                    p.locations.insert(get(1), (get(2), get(3)));
                }
                6 if delimited => p.strings.push(String::from_utf8_lossy(payload).into_owned()),
                12 => p.period = value as i64,
                _ => {}
            }
        }
        if p.strings.first().is_none_or(|s| !s.is_empty()) {
            return Err("no string table".into());
        }
        Ok(p)
    }

    fn string(&self, i: usize) -> &str {
        self.strings.get(i).map_or("", String::as_str)
    }

    fn index_of(&self, kind: &str) -> Option<usize> {
        self.types.iter().position(|&(t, _)| self.string(t) == kind)
    }

    /// The `n` stacks with the most live bytes, their frames named by `name`
    /// (`OBJECT`, `ADDR` to `function (file:line)`).
    fn top(
        &self,
        n: usize,
        source: &str,
        name: &mut impl FnMut(&str, &str) -> Option<String>,
    ) -> Result<String, String> {
        let space = self.index_of("inuse_space").ok_or("the profile has no inuse_space")?;
        let objects = self.index_of("inuse_objects");
        let mut stacks: HashMap<&[u64], (i64, i64)> = HashMap::new();
        for (ids, values) in &self.samples {
            let e = stacks.entry(ids.as_slice()).or_default();
            e.0 += values.get(space).copied().unwrap_or(0);
            e.1 += objects.and_then(|o| values.get(o)).copied().unwrap_or(0);
        }
        let total: i64 = stacks.values().map(|v| v.0).sum();
        let mut ranked: Vec<_> = stacks.into_iter().filter(|(_, v)| v.0 > 0).collect();
        ranked.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then_with(|| a.0.cmp(b.0)));
        let mut names: HashMap<u64, String> = HashMap::new();
        let mut out = format!(
            "memquota heap profile from {source}: {} live in {} stacks, estimated from samples (1 per {} allocated)\n",
            bytes(total),
            ranked.len(),
            bytes(self.period),
        );
        for (ids, (space, blocks)) in ranked.into_iter().take(n) {
            let share = if total > 0 { space as f64 * 100.0 / total as f64 } else { 0.0 };
            let frames: Vec<String> = ids
                .iter()
                .take(FRAMES)
                .map(|id| names.entry(*id).or_insert_with(|| self.frame(*id, name)).clone())
                .collect();
            let more = if ids.len() > FRAMES { " <- ..." } else { "" };
            let _ = writeln!(
                out,
                "  {:>10} {share:>5.1}% {:>8} blocks  {}{more}",
                bytes(space),
                blocks,
                frames.join(" <- ")
            );
        }
        Ok(out)
    }

    /// A location named: `function (file:line)`, else `OBJECT+0xADDR`, else its
    /// address.
    fn frame(&self, id: u64, name: &mut impl FnMut(&str, &str) -> Option<String>) -> String {
        let Some(&(mapping, addr)) = self.locations.get(&id) else { return format!("location {id}?") };
        let Some(&(start, _, offset, path)) = self.mappings.get(&mapping) else {
            return format!("{addr:#x}");
        };
        let path = self.string(path);
        // The address in the object's own terms, what addr2line takes: the mapping's
        // segment sits at its p_vaddr in the file's view.
        let Some(vaddr) = segment_vaddr(path, offset) else { return format!("{addr:#x}") };
        let rel = format!("{:#x}", addr.wrapping_sub(start).wrapping_add(vaddr));
        name(path, &rel).unwrap_or_else(|| format!("{path}+{rel}"))
    }
}

/// The virtual address the loadable segment at file offset `offset` of the ELF
/// object at `path` is linked at.
fn segment_vaddr(path: &str, offset: u64) -> Option<u64> {
    let elf = std::fs::read(path).ok()?;
    let u16_at = |at: usize| elf.get(at..at + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at =
        |at: usize| elf.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap_or_default()));
    let u64_at =
        |at: usize| elf.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()));
    if elf.get(..5)? != b"\x7fELF\x02" {
        return None;
    }
    let (phoff, size, count) =
        (usize::try_from(u64_at(0x20)?).ok()?, usize::from(u16_at(0x36)?), u16_at(0x38)?);
    (0..usize::from(count))
        .map(|i| phoff + i * size)
        .find_map(|ph| (u32_at(ph)? == 1 && u64_at(ph + 8)? == offset).then(|| u64_at(ph + 16)).flatten())
}

fn bytes(b: i64) -> String {
    crate::units::bytes(u64::try_from(b).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(field: u64, wire: u64, out: &mut Vec<u8>) {
        push_varint((field << 3) | wire, out);
    }

    fn push_varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push(v as u8 | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    fn message(field: u64, body: &[u8], out: &mut Vec<u8>) {
        key(field, 2, out);
        push_varint(body.len() as u64, out);
        out.extend_from_slice(body);
    }

    fn ints(pairs: &[(u64, u64)]) -> Vec<u8> {
        let mut m = Vec::new();
        for &(f, v) in pairs {
            key(f, 0, &mut m);
            push_varint(v, &mut m);
        }
        m
    }

    fn packed(values: &[u64]) -> Vec<u8> {
        let mut m = Vec::new();
        values.iter().for_each(|&v| push_varint(v, &mut m));
        m
    }

    /// A profile of two stacks in a mapping of this test's own program: the larger
    /// first, shares of the total, each frame named by the namer with the address
    /// in the object's terms.
    #[test]
    fn the_top_stacks_are_ranked_and_named() {
        let mut p = Vec::new();
        for s in ["", "inuse_objects", "count", "inuse_space", "bytes", "/proc/self/exe"] {
            message(6, s.as_bytes(), &mut p);
        }
        message(1, &ints(&[(1, 1), (2, 2)]), &mut p);
        message(1, &ints(&[(1, 3), (2, 4)]), &mut p);
        for (ids, values) in [(&[1u64, 2][..], &[10u64, 1000][..]), (&[2], &[30, 3000])] {
            let mut s = Vec::new();
            message(1, &packed(ids), &mut s);
            message(2, &packed(values), &mut s);
            message(2, &s, &mut p);
        }
        // The program's first loadable segment, at file offset 0.
        message(3, &ints(&[(1, 1), (2, 0x5000), (3, 0x9000), (4, 0), (5, 5)]), &mut p);
        message(4, &ints(&[(1, 1), (2, 1), (3, 0x5010)]), &mut p);
        message(4, &ints(&[(1, 2), (2, 1), (3, 0x5020)]), &mut p);
        key(12, 0, &mut p);
        push_varint(16384, &mut p);
        let profile = Profile::decode(&p).unwrap();
        let vaddr = segment_vaddr("/proc/self/exe", 0).expect("the program's first segment");
        let mut name = |object: &str, addr: &str| Some(format!("f[{object}@{addr}]"));
        let top = profile.top(10, "here", &mut name).unwrap();
        let lines: Vec<&str> = top.lines().collect();
        assert!(lines[0].starts_with("memquota heap profile from here: 3.9 KiB live in 2 stacks"), "{top}");
        assert!(lines[0].ends_with("(1 per 16.0 KiB allocated)"), "{top}");
        let f = |a: u64| format!("f[/proc/self/exe@{:#x}]", a - 0x5000 + vaddr);
        assert!(lines[1].contains(" 75.0%       30 blocks  ") && lines[1].ends_with(&f(0x5020)), "{top}");
        assert!(lines[2].ends_with(&format!("{} <- {}", f(0x5010), f(0x5020))), "{top}");
        assert_eq!(profile.top(1, "here", &mut name).unwrap().lines().count(), 2);
    }

    #[test]
    fn what_is_not_a_profile_says_so() {
        assert!(gunzip(b"not gzip at all, long enough").unwrap_err().contains("not gzip"));
        let mut compressed = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255, 0b011];
        compressed.resize(30, 0);
        assert!(gunzip(&compressed).unwrap_err().contains("compressed"));
        let stored =
            [&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255, 1, 2, 0, 0xfd, 0xff, b'h', b'i'][..], &[0; 8]].concat();
        assert_eq!(gunzip(&stored).unwrap(), b"hi");
        assert!(Profile::decode(&[0xff]).is_err(), "a truncated varint");
    }
}
