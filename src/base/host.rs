//! What the machine allows: the cgroup memory limit (v2, then v1) or physical RAM.
//! The default budget when the configuration names none.

/// The memory this process may use: the cgroup limit if one is set, else physical RAM.
pub fn memory_limit() -> u64 {
    cgroup_limit().unwrap_or_else(physical_ram)
}

/// The tightest cgroup memory limit that applies to this process, if any (v2 where
/// its cgroup has the memory controller, else v1; `cgroup.rs`).
pub fn cgroup_limit() -> Option<u64> {
    crate::base::cgroup::limit()
}

/// Physical RAM in bytes.
pub fn physical_ram() -> u64 {
    let mut sys = sysinfo::System::new();
    sys.refresh_memory_specifics(sysinfo::MemoryRefreshKind::nothing().with_ram());
    sys.total_memory()
}

/// Reads a small `/proc` file into `buf` with no allocation; the bytes read.
fn read_proc(path: &std::ffi::CStr, buf: &mut [u8]) -> usize {
    // SAFETY: the path is NUL-terminated; open has no other precondition.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return 0;
    }
    // SAFETY: `fd` is open; the buffer is valid for `buf.len()` bytes.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    // SAFETY: `fd` is ours and closed once.
    unsafe { libc::close(fd) };
    usize::try_from(n).unwrap_or(0)
}

fn number(text: &[u8]) -> u64 {
    text.iter()
        .skip_while(|b| !b.is_ascii_digit())
        .take_while(|b| b.is_ascii_digit())
        .fold(0u64, |acc, &d| acc.saturating_mul(10).saturating_add(u64::from(d - b'0')))
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).unwrap_or(4096)
}

/// This process's resident memory from `/proc/self/statm`, in bytes: (all resident,
/// file-backed and shared). No allocation. Zeros if unavailable.
fn statm() -> (u64, u64) {
    let mut buf = [0u8; 128];
    let n = read_proc(c"/proc/self/statm", &mut buf);
    // "size resident shared ...", in pages.
    let mut fields = buf[..n].split(|&b| b == b' ');
    let resident = number(fields.nth(1).unwrap_or(b""));
    let shared = number(fields.next().unwrap_or(b""));
    let page = page_size();
    (resident.saturating_mul(page), shared.saturating_mul(page))
}

/// This process's resident set size in bytes. 0 if unavailable.
pub fn process_rss() -> u64 {
    statm().0
}

/// This process's anonymous resident memory in bytes (`RssAnon`: resident minus the
/// file-backed and shared part): what its allocators, stacks and private mappings
/// hold. 0 if unavailable.
pub fn anon_rss() -> u64 {
    let (resident, shared) = statm();
    resident.saturating_sub(shared)
}

/// The highest resident set size this process has had (`VmHWM`), in bytes. 0 if
/// unavailable. No allocation.
pub fn peak_rss() -> u64 {
    let mut buf = [0u8; 2048];
    let n = read_proc(c"/proc/self/status", &mut buf);
    let text = &buf[..n];
    let Some(at) = text.windows(6).position(|w| w == b"VmHWM:") else { return 0 };
    number(&text[at..]).saturating_mul(1024)
}

/// When process `pid` started, in clock ticks since boot (`/proc/<pid>/stat`'s
/// `starttime`), if it is running: `None` when there is no such process or it has
/// exited and waits to be reaped (a zombie). A process whose main thread ended while
/// others run also shows as a zombie, with more than one thread: it runs. With the
/// pid, the start time names one process for as long as the machine runs, even
/// after the pid is reused. No allocation.
pub fn running_since(pid: u32) -> Option<u64> {
    let mut path = [0u8; 32];
    let mut w = crate::base::text::SliceWriter::new(&mut path);
    std::fmt::Write::write_fmt(&mut w, format_args!("/proc/{pid}/stat\0")).ok()?;
    let path = std::ffi::CStr::from_bytes_until_nul(&path).ok()?;
    let mut buf = [0u8; 1024];
    let n = read_proc(path, &mut buf);
    // "pid (comm) state ppid ...": the name may hold spaces and parentheses, so the
    // fields are counted from the last ')'. After the state (field 3) come
    // num_threads (field 20) and starttime (field 22).
    let after = &buf[buf[..n].iter().rposition(|&b| b == b')')? + 1..n];
    let mut fields = after.split(|&b| b == b' ').filter(|f| !f.is_empty());
    let state = fields.next()?;
    let threads = number(fields.nth(16)?);
    let start = fields.nth(1)?;
    let ended = state == b"X" || (state == b"Z" && threads <= 1);
    (!ended && start.iter().all(u8::is_ascii_digit)).then(|| number(start))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn running_since_knows_running_processes_from_exited_ones() {
        let own = running_since(std::process::id()).expect("this process runs");
        assert!(own > 0);
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Waits for the exit without reaping: the child stays a zombie until wait().
        // SAFETY: siginfo_t is plain old data; waitid writes it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child, with a valid out-pointer.
        let r = unsafe { libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT) };
        assert_eq!(r, 0);
        assert_eq!(running_since(pid), None, "a zombie is not running");
        child.wait().unwrap();
        assert_eq!(running_since(0), None);
    }

    #[test]
    fn rss_is_plausible() {
        let rss = process_rss();
        assert!(rss > 1 << 20 && rss < physical_ram(), "{rss}");
    }

    #[test]
    fn physical_ram_is_known() {
        assert!(physical_ram() > 64 << 20);
        assert!(memory_limit() <= physical_ram().max(cgroup_limit().unwrap_or(0)));
    }
}

/// The loaded object that holds the address `addr` (only compared, never read), as the dynamic linker names it: its load
/// address, and its file name (`None` for the program itself, which the loader
/// names with an empty string).
pub fn object_of(addr: usize) -> Option<(usize, Option<String>)> {
    // SAFETY: Dl_info is plain data; all-zero is a valid value for dladdr to fill.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads `addr` as a number and fills `info`.
    if unsafe { libc::dladdr(addr as *const libc::c_void, &mut info) } == 0 {
        return None;
    }
    let file = (!info.dli_fname.is_null())
        // SAFETY: dladdr set `dli_fname` to the loader's NUL-terminated name, valid
        // while the object stays loaded; copied at once.
        .then(|| unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned())
        .filter(|f| !f.is_empty());
    Some((info.dli_fbase as usize, file))
}

/// Names the calling thread for the kernel (`/proc/self/task/*/comm`): `name` is
/// NUL-terminated within its 16 bytes. Allocates nothing.
pub fn name_this_thread(name: &[u8; 16]) {
    if name.contains(&0) {
        // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes from
        // its second argument, which points at `name`, NUL-terminated as checked.
        unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr() as libc::c_ulong, 0, 0, 0) };
    }
}
