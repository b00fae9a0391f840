//! The process's memory cgroup as the kernel shows it: where it is (v2 where the
//! memory controller is enabled, else v1), its limit, its `memory.high`, its anonymous
//! memory; and the PSI file that reports memory pressure.
//!
//! [`Cgroup::find`] and [`Pressure::arm`] allocate (paths, open files): call them once,
//! off the allocation path. [`Cgroup::read`] and [`Pressure::fired`] then allocate
//! nothing: a `pread` into a stack buffer per file, one `poll` for the trigger.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// cgroup files report "no limit" as a huge number (v1: `PAGE_COUNTER_MAX` pages) or
/// as `max` (v2). Anything this large is treated as no limit.
const NO_LIMIT_ABOVE: u64 = 1 << 60;

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
    /// v2: `memory.max` and `memory.high` of the cgroup and of each ancestor inside
    /// the mount (the ones above a namespace's root cannot be seen).
    bounds: Vec<(Option<File>, Option<File>)>,
}

impl Cgroup {
    /// The process's memory cgroup, from `/proc/self/cgroup` and
    /// `/proc/self/mountinfo`: v2 if its cgroup has the memory controller, else v1.
    /// `None` outside any memory cgroup (or with no `/proc`).
    pub(crate) fn find() -> Option<Cgroup> {
        let membership = fs::read_to_string("/proc/self/cgroup").ok()?;
        let mounts = fs::read_to_string("/proc/self/mountinfo").ok()?;
        let open = |p: &str| File::open(p).ok();
        if let Some(dirs) = locate(&membership, &mounts, Version::V2) {
            // Only a non-root cgroup with the controller has `memory.max`.
            if Path::new(&format!("{}/memory.max", dirs[0])).exists() {
                let stat = open(&format!("{}/memory.stat", dirs[0]));
                let bounds = dirs
                    .iter()
                    .map(|d| (open(&format!("{d}/memory.max")), open(&format!("{d}/memory.high"))))
                    .collect();
                if let Some(stat) = stat {
                    return Some(Cgroup { version: Version::V2, stat, bounds });
                }
            }
        }
        let dirs = locate(&membership, &mounts, Version::V1)?;
        let stat = open(&format!("{}/memory.stat", dirs[0]))?;
        Some(Cgroup { version: Version::V1, stat, bounds: Vec::new() })
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

/// The directories of the process's cgroup in hierarchy `version`: its own first,
/// then each ancestor up to the hierarchy's mount point. `None` if the process is in
/// no such hierarchy or it is not mounted.
fn locate(membership: &str, mountinfo: &str, version: Version) -> Option<Vec<String>> {
    let path = membership.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let wanted = match version {
            Version::V2 => controllers.is_empty(),
            Version::V1 => controllers.split(',').any(|c| c == "memory"),
        };
        wanted.then_some(path)
    })?;
    let (root, mount) = mountinfo.lines().find_map(|line| {
        // id parent dev root mountpoint options [optional...] - fstype source superoptions
        let fields: Vec<&str> = line.split(' ').collect();
        let dash = fields.iter().position(|f| *f == "-")?;
        let (fstype, superopts) = (fields.get(dash + 1)?, fields.get(dash + 3).copied().unwrap_or(""));
        let wanted = match version {
            Version::V2 => *fstype == "cgroup2",
            Version::V1 => *fstype == "cgroup" && superopts.split(',').any(|o| o == "memory"),
        };
        wanted.then(|| (fields[3], fields[4]))
    })?;
    // The membership path is relative to the hierarchy's root; the mount shows the
    // part under `root` (a container's own cgroup, without a cgroup namespace).
    let relative = match path.strip_prefix(root.trim_end_matches('/')) {
        Some(rest) if rest.is_empty() || rest.starts_with('/') => rest,
        _ => "",
    };
    let mut dirs = vec![format!("{mount}{}", relative.trim_end_matches('/'))];
    let mut rel = relative.trim_end_matches('/');
    while let Some(i) = rel.rfind('/') {
        rel = &rel[..i];
        dirs.push(format!("{mount}{rel}"));
    }
    Some(dirs)
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
    /// than the hierarchy's root), else on `/proc/pressure/memory`. `Err` says why
    /// neither could be armed.
    pub(crate) fn arm() -> Result<Pressure, String> {
        let own = fs::read_to_string("/proc/self/cgroup").ok().and_then(|membership| {
            let mounts = fs::read_to_string("/proc/self/mountinfo").ok()?;
            let dirs = locate(&membership, &mounts, Version::V2)?;
            // The root's file is the system's; a cgroup's own has a parent in the mount.
            (dirs.len() > 1).then(|| format!("{}/memory.pressure", dirs[0]))
        });
        let mut why = String::new();
        for (path, source) in
            [(own, PsiSource::Cgroup), (Some("/proc/pressure/memory".into()), PsiSource::System)]
        {
            let Some(path) = path else { continue };
            match Pressure::arm_at(&path, source) {
                Ok(p) => return Ok(p),
                Err(e) => why = format!("{path}: {e}"),
            }
        }
        Err(why)
    }

    fn arm_at(path: &str, source: PsiSource) -> std::io::Result<Pressure> {
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

    #[test]
    fn v1_and_v2_directories_come_from_the_mounts() {
        let membership = "4:memory:/a/b\n1:cpu:/\n0::/\n";
        let v1 = locate(membership, HYBRID, Version::V1).unwrap();
        assert_eq!(v1, ["/sys/fs/cgroup/memory/a/b", "/sys/fs/cgroup/memory/a", "/sys/fs/cgroup/memory"]);
        assert_eq!(locate(membership, HYBRID, Version::V2).unwrap(), ["/sys/fs/cgroup/unified"]);
        let pure_v2 = "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            locate("0::/k/pod/c\n", pure_v2, Version::V2).unwrap(),
            ["/sys/fs/cgroup/k/pod/c", "/sys/fs/cgroup/k/pod", "/sys/fs/cgroup/k", "/sys/fs/cgroup"]
        );
        assert_eq!(locate("0::/k\n", pure_v2, Version::V1), None, "no v1 memory hierarchy");
    }

    #[test]
    fn a_container_sees_its_own_cgroup_at_the_mount() {
        // Mounted at the container's cgroup, without a cgroup namespace: the
        // membership names the host's path.
        let mounts = "30 23 0:26 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(locate("0::/docker/abc\n", mounts, Version::V2).unwrap(), ["/sys/fs/cgroup"]);
        let v1 = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        assert_eq!(locate("7:memory:/docker/abc\n", v1, Version::V1).unwrap(), ["/sys/fs/cgroup/memory"]);
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
