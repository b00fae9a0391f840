//! The process's memory cgroup as the kernel shows it: where it is (v2 where the
//! memory controller is enabled, else v1), its limit, its `memory.high`, its anonymous
//! memory; and the PSI file that reports memory pressure.
//!
//! Nothing here allocates: `/proc` files are read through a stack buffer, paths are
//! built on the stack, and [`Cgroup::read`] is a `pread` into a stack buffer per file,
//! [`Pressure::fired`] one `poll`. The sampler thread that calls them is charged for
//! every byte at once, and a test that checks the process account between two points
//! must not see it move.

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};

/// cgroup files report "no limit" as a huge number (v1: `PAGE_COUNTER_MAX` pages) or
/// as `max` (v2). Anything this large is treated as no limit.
const NO_LIMIT_ABOVE: u64 = 1 << 60;

/// The most levels of a v2 hierarchy whose `memory.max` and `memory.high` are read:
/// the process's cgroup and its nearest ancestors.
const MAX_LEVELS: usize = 16;

/// Which cgroup interface the figures come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Version {
    V1 = 1,
    V2 = 2,
}

/// One reading of the cgroup.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Figures {
    /// The tightest limit on the cgroup and its ancestors (v2 `memory.max`, v1
    /// `hierarchical_memory_limit`); `None`: unlimited.
    pub(crate) limit: Option<u64>,
    /// The tightest v2 `memory.high` on the cgroup and its ancestors.
    pub(crate) high: Option<u64>,
    /// Anonymous memory charged to the cgroup (v2 `anon`, v1 `total_rss`), never its
    /// page cache: what the kernel cannot drop when the cgroup nears its limit.
    pub(crate) anon: Option<u64>,
}

/// The process's memory cgroup, its files open for reading.
pub(crate) struct Cgroup {
    pub(crate) version: Version,
    /// `memory.stat` of the process's own cgroup.
    stat: File,
    /// v2: `memory.max` and `memory.high` of the cgroup and of its ancestors inside
    /// the mount (those above a namespace's root cannot be seen), nearest first.
    bounds: [(Option<File>, Option<File>); MAX_LEVELS],
}

impl Cgroup {
    /// The process's memory cgroup: v2 if its cgroup has the memory controller, else
    /// v1. `None` outside any memory cgroup (or without `/proc`). Reads
    /// `/proc/self/cgroup` and `/proc/self/mountinfo` through a stack buffer and
    /// opens files by paths built on the stack: no heap allocation (for paths under
    /// 300 bytes), so the sampler thread, which is charged for every byte at once,
    /// leaves no trace of it in the process account.
    pub(crate) fn find() -> Option<Cgroup> {
        if let Some(at) = Location::find(Version::V2) {
            // Only a non-root cgroup with the controller has `memory.max`.
            if let (Some(_), Some(stat)) = (at.open(0, "memory.max"), at.open(0, "memory.stat")) {
                let bounds = std::array::from_fn(|level| {
                    (at.open(level, "memory.max"), at.open(level, "memory.high"))
                });
                return Some(Cgroup { version: Version::V2, stat, bounds });
            }
        }
        let stat = Location::find(Version::V1)?.open(0, "memory.stat")?;
        Some(Cgroup { version: Version::V1, stat, bounds: Default::default() })
    }

    /// Reads the cgroup's figures now. No allocation.
    pub(crate) fn read(&self) -> Figures {
        let mut buf = [0u8; 8192];
        let stat = read_at_start(&self.stat, &mut buf);
        match self.version {
            Version::V1 => Figures {
                limit: stat_value(stat, b"hierarchical_memory_limit").and_then(limit_value),
                high: None,
                anon: stat_value(stat, b"total_rss").or_else(|| stat_value(stat, b"rss")),
            },
            Version::V2 => {
                let anon = stat_value(stat, b"anon");
                let mut small = [0u8; 32];
                let mut tightest = |file: &Option<File>, now: Option<u64>| {
                    let v = file.as_ref().and_then(|f| limit_text(read_at_start(f, &mut small)));
                    min_some(now, v)
                };
                let (mut limit, mut high) = (None, None);
                for (max, hi) in &self.bounds {
                    limit = tightest(max, limit);
                    high = tightest(hi, high);
                }
                Figures { limit, high, anon }
            }
        }
    }
}

/// The tightest limit of the process's memory cgroup (v2, then v1), if any.
pub(crate) fn limit() -> Option<u64> {
    Cgroup::find()?.read().limit
}

fn min_some(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A short string kept on the stack.
#[derive(Clone, Copy)]
struct Short {
    bytes: [u8; 256],
    len: usize,
}

impl Short {
    fn new(s: &str) -> Option<Short> {
        let mut bytes = [0u8; 256];
        bytes.get_mut(..s.len())?.copy_from_slice(s.as_bytes());
        Some(Short { bytes, len: s.len() })
    }

    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..self.len]).unwrap_or("")
    }
}

/// Where the process's cgroup of one hierarchy shows in the file system: the
/// mount point and the cgroup's path under it.
struct Location {
    mount: Short,
    relative: Short,
}

impl Location {
    /// The process's cgroup in hierarchy `version`, if it is in one and the
    /// hierarchy is mounted.
    fn find(version: Version) -> Option<Location> {
        let path = find_line(c"/proc/self/cgroup", |line| Short::new(membership_path(line, version)?))?;
        let (root, mount) = find_line(c"/proc/self/mountinfo", |line| {
            let (root, mount) = mount_of(line, version)?;
            Some((Short::new(root)?, Short::new(mount)?))
        })?;
        Some(Location { mount, relative: Short::new(relative(path.as_str(), root.as_str()))? })
    }

    /// The directory `level` steps up from the process's cgroup (0: its own), if it
    /// is inside the mount.
    fn dir(&self, level: usize) -> Option<&str> {
        let mut rel = self.relative.as_str();
        for _ in 0..level {
            rel = &rel[..rel.rfind('/')?];
        }
        Some(rel)
    }

    /// Opens `name` in the directory `level` steps up; `None` if there is none.
    fn open(&self, level: usize, name: &str) -> Option<File> {
        let rel = self.dir(level)?;
        with_path(self.mount.as_str(), rel, name, |p| File::open(p).ok())
    }
}

/// Calls `f` with `mount` + `rel` + `/` + `name` as a path built on the stack
/// (`None` if it does not fit).
fn with_path<T>(mount: &str, rel: &str, name: &str, f: impl FnOnce(&OsStr) -> Option<T>) -> Option<T> {
    let mut buf = [0u8; 300];
    let mut w = crate::base::text::SliceWriter::new(&mut buf);
    write!(w, "{mount}{rel}/{name}").ok()?;
    let n = w.len();
    f(OsStr::from_bytes(buf.get(..n)?))
}

/// Calls `f` on each line of the file at `path` until it gives `Some`, reading
/// through a 4 KiB stack buffer (a longer line is skipped).
fn find_line<T>(path: &std::ffi::CStr, mut f: impl FnMut(&str) -> Option<T>) -> Option<T> {
    let mut file = File::open(OsStr::from_bytes(path.to_bytes())).ok()?;
    let mut buf = [0u8; 4096];
    let (mut filled, mut skipping) = (0, false);
    loop {
        let n = file.read(&mut buf[filled..]).ok()?;
        let end = filled + n;
        let mut start = 0;
        while let Some(i) = buf[start..end].iter().position(|&b| b == b'\n') {
            let line = &buf[start..start + i];
            start += i + 1;
            if std::mem::take(&mut skipping) {
                continue;
            }
            if let Some(t) = std::str::from_utf8(line).ok().and_then(&mut f) {
                return Some(t);
            }
        }
        if n == 0 {
            let last = std::str::from_utf8(&buf[start..end]).ok().filter(|l| !l.is_empty() && !skipping);
            return last.and_then(f);
        }
        if start == 0 && end == buf.len() {
            (filled, skipping) = (0, true);
        } else {
            buf.copy_within(start..end, 0);
            filled = end - start;
        }
    }
}

/// The process's path in hierarchy `version` from one `/proc/self/cgroup` line.
fn membership_path(line: &str, version: Version) -> Option<&str> {
    let mut parts = line.splitn(3, ':');
    let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
    let wanted = match version {
        Version::V2 => controllers.is_empty(),
        Version::V1 => controllers.split(',').any(|c| c == "memory"),
    };
    wanted.then_some(path)
}

/// The root and mount point of hierarchy `version` from one `mountinfo` line:
/// `id parent dev root mountpoint options [optional...] - fstype source superoptions`.
fn mount_of(line: &str, version: Version) -> Option<(&str, &str)> {
    let mut fields = line.split(' ');
    let (root, mount) = (fields.nth(3)?, fields.next()?);
    let mut rest = fields.skip_while(|f| *f != "-").skip(1);
    let (fstype, superopts) = (rest.next()?, rest.nth(1).unwrap_or(""));
    let wanted = match version {
        Version::V2 => fstype == "cgroup2",
        Version::V1 => fstype == "cgroup" && superopts.split(',').any(|o| o == "memory"),
    };
    wanted.then_some((root, mount))
}

/// The cgroup `path` (relative to the hierarchy's root) under a mount of the
/// hierarchy's `root` part: a container without a cgroup namespace mounts its own
/// cgroup and still reads the host's path. Without a trailing `/`.
fn relative<'a>(path: &'a str, root: &str) -> &'a str {
    let rel = match path.strip_prefix(root.trim_end_matches('/')) {
        Some(rest) if rest.is_empty() || rest.starts_with('/') => rest,
        _ => "",
    };
    rel.trim_end_matches('/')
}

/// Reads a file from its start into `buf`: the bytes read (none on error).
fn read_at_start<'a>(f: &File, buf: &'a mut [u8]) -> &'a [u8] {
    let n = f.read_at(buf, 0).unwrap_or(0);
    &buf[..n]
}

/// The value of `key` in a `memory.stat` text (`key value` lines).
fn stat_value(text: &[u8], key: &[u8]) -> Option<u64> {
    text.split(|&b| b == b'\n').find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(b" ")?;
        std::str::from_utf8(rest).ok()?.trim().parse().ok()
    })
}

/// A limit file's text (`max`, or bytes) as a limit.
fn limit_text(text: &[u8]) -> Option<u64> {
    std::str::from_utf8(text).ok()?.trim().parse().ok().and_then(limit_value)
}

fn limit_value(v: u64) -> Option<u64> {
    (v > 0 && v < NO_LIMIT_ABOVE).then_some(v)
}

/// Where memory pressure is watched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PsiSource {
    /// The process's own cgroup v2 `memory.pressure`.
    Cgroup = 1,
    /// The whole system's, `/proc/pressure/memory` (what a v1-only process has).
    System = 2,
}

/// A PSI trigger, armed: the kernel raises `POLLPRI` on it when tasks stalled on
/// memory for more than the threshold within a window.
pub(crate) struct Pressure {
    file: File,
    pub(crate) source: PsiSource,
    /// The trigger's window.
    pub(crate) window_ms: u32,
}

/// The triggers tried in turn: some task stalled 150 ms in a 1 s window (needs
/// `CAP_SYS_RESOURCE`), else 300 ms in 2 s (unprivileged triggers take windows in
/// whole multiples of 2 s). The kernel clobbers the last byte written: the NUL.
const TRIGGERS: [(&[u8], u32); 2] = [(b"some 150000 1000000\0", 1000), (b"some 300000 2000000\0", 2000)];

impl Pressure {
    /// Arms a trigger on the process's cgroup v2 `memory.pressure` (a cgroup other
    /// than the hierarchy's root), else on `/proc/pressure/memory`. `Err`: the
    /// system's file refused (or there is none). No heap allocation.
    pub(crate) fn arm() -> std::io::Result<Pressure> {
        // The root's file is the system's; a cgroup's own has a parent in the mount.
        let own = Location::find(Version::V2).filter(|at| at.dir(1).is_some());
        if let Some(p) = own.and_then(|at| {
            with_path(at.mount.as_str(), at.dir(0)?, "memory.pressure", |p| {
                Pressure::arm_at(p, PsiSource::Cgroup).ok()
            })
        }) {
            return Ok(p);
        }
        Pressure::arm_at(OsStr::new("/proc/pressure/memory"), PsiSource::System)
    }

    fn arm_at(path: &OsStr, source: PsiSource) -> std::io::Result<Pressure> {
        let mut last = std::io::Error::from(ErrorKind::InvalidInput);
        for (trigger, window_ms) in TRIGGERS {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
                .open(path)?;
            // One write: the kernel parses each write as a whole trigger.
            match file.write(trigger) {
                Ok(n) if n == trigger.len() => return Ok(Pressure { file, source, window_ms }),
                Ok(_) => last = std::io::Error::from(ErrorKind::WriteZero),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Whether the trigger fired since the last call (`Some(true)`), or not
    /// (`Some(false)`); `None` when it is gone (its cgroup was removed). One `poll`
    /// that does not wait: the kernel latches the event until it is polled.
    pub(crate) fn fired(&self) -> Option<bool> {
        let mut fd = libc::pollfd { fd: self.file.as_raw_fd(), events: libc::POLLPRI, revents: 0 };
        // SAFETY: one valid `pollfd` for the length given; a zero timeout never waits.
        let n = unsafe { libc::poll(&mut fd, 1, 0) };
        if n > 0 && fd.revents & (libc::POLLERR | libc::POLLNVAL) != 0 {
            return None;
        }
        Some(n > 0 && fd.revents & libc::POLLPRI != 0)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const HYBRID: &str = "\
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    fn dirs(membership: &str, mounts: &str, version: Version) -> Option<Vec<String>> {
        let path = membership.lines().find_map(|l| membership_path(l, version))?;
        let (root, mount) = mounts.lines().find_map(|l| mount_of(l, version))?;
        let at = Location { mount: Short::new(mount)?, relative: Short::new(relative(path, root))? };
        Some((0..).map_while(|level| at.dir(level).map(|d| format!("{mount}{d}"))).collect())
    }

    #[test]
    fn v1_and_v2_directories_come_from_the_mounts() {
        let membership = "4:memory:/a/b\n1:cpu:/\n0::/\n";
        let v1 = dirs(membership, HYBRID, Version::V1).unwrap();
        assert_eq!(v1, ["/sys/fs/cgroup/memory/a/b", "/sys/fs/cgroup/memory/a", "/sys/fs/cgroup/memory"]);
        assert_eq!(dirs(membership, HYBRID, Version::V2).unwrap(), ["/sys/fs/cgroup/unified"]);
        let pure_v2 = "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            dirs("0::/k/pod/c\n", pure_v2, Version::V2).unwrap(),
            ["/sys/fs/cgroup/k/pod/c", "/sys/fs/cgroup/k/pod", "/sys/fs/cgroup/k", "/sys/fs/cgroup"]
        );
        assert_eq!(dirs("0::/k\n", pure_v2, Version::V1), None, "no v1 memory hierarchy");
    }

    #[test]
    fn a_container_sees_its_own_cgroup_at_the_mount() {
        // Mounted at the container's cgroup, without a cgroup namespace: the
        // membership names the host's path.
        let mounts = "30 23 0:26 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(dirs("0::/docker/abc\n", mounts, Version::V2).unwrap(), ["/sys/fs/cgroup"]);
        let v1 = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        assert_eq!(dirs("7:memory:/docker/abc\n", v1, Version::V1).unwrap(), ["/sys/fs/cgroup/memory"]);
    }

    #[test]
    fn lines_are_found_through_a_small_buffer() {
        // /proc/self/mountinfo is longer than one buffer on most machines; its last
        // line is found, and a cgroup line of this process in /proc/self/cgroup.
        let lines = find_line(c"/proc/self/mountinfo", |_| None::<()>);
        assert!(lines.is_none());
        let last = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let last = last.lines().last().unwrap().to_owned();
        assert_eq!(find_line(c"/proc/self/mountinfo", |l| (l == last).then_some(())), Some(()));
        assert!(find_line(c"/proc/self/cgroup", |l| l.contains(':').then_some(())).is_some());
    }

    #[test]
    fn stat_values_and_limits_parse() {
        let v1 = b"cache 1880064\nrss 1765376\nrss_huge 0\nhierarchical_memory_limit 9223372036854771712\ntotal_rss 2000000\n";
        assert_eq!(stat_value(v1, b"rss"), Some(1765376));
        assert_eq!(stat_value(v1, b"total_rss"), Some(2000000));
        assert_eq!(stat_value(v1, b"hierarchical_memory_limit").and_then(limit_value), None);
        assert_eq!(stat_value(b"anon 4096\nfile 8192\n", b"anon"), Some(4096));
        assert_eq!(stat_value(b"anon_thp 0\n", b"anon"), None, "a key is matched whole");
        assert_eq!(limit_text(b"max\n"), None);
        assert_eq!(limit_text(b"536870912\n"), Some(512 << 20));
        assert_eq!(min_some(Some(3), None), Some(3));
        assert_eq!(min_some(Some(3), Some(2)), Some(2));
    }

    #[test]
    fn this_process_has_a_plausible_view() {
        // Whatever this machine is: a cgroup found reads an anon figure, and a limit,
        // if any, is a real one.
        if let Some(cg) = Cgroup::find() {
            let f = cg.read();
            assert!(f.anon.is_some(), "{:?}", cg.version);
            assert!(f.limit.map_or(true, |l| l > 1 << 20));
        }
    }
}
