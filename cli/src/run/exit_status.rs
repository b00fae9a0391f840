//! The program's end: described for people, and passed on as our own.

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

/// Ends this process the way the program ended: the same exit code, or the same
/// signal (re-raised on ourselves with its default action, without a core dump),
/// falling back to 128 + the signal number.
pub fn pass_through(status: ExitStatus) -> ! {
    if let Some(code) = status.code() {
        std::process::exit(code);
    }
    if let Some(sig) = status.signal() {
        let _ = std::io::stderr().flush();
        // SAFETY: plain libc calls on valid, initialised arguments. Resetting the
        // disposition and unblocking the signal makes `raise` end the process (the
        // only other thread, the waiter, has returned).
        unsafe {
            let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            libc::setrlimit(libc::RLIMIT_CORE, &no_core);
            libc::signal(sig, libc::SIG_DFL);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, sig);
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            libc::raise(sig);
        }
        std::process::exit(128 + sig);
    }
    std::process::exit(1)
}

/// `exited with status 0`, `was killed by signal 15 (SIGTERM)`.
pub(super) fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!(
            "was killed by signal {sig} ({}){}",
            signal_name(sig),
            if status.core_dumped() { ", core dumped" } else { "" }
        ),
        _ => format!("ended ({status})"),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => "signal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_read_like_a_shell() {
        assert_eq!(describe(ExitStatus::from_raw(7 << 8)), "exited with status 7");
        assert_eq!(describe(ExitStatus::from_raw(libc::SIGTERM)), "was killed by signal 15 (SIGTERM)");
    }
}
