//! Signals: SIGTERM and SIGHUP forwarded to the program, a terminal's SIGINT and
//! SIGQUIT outlived, and the child waited for without reaping it, so the pid we
//! signal is always the program's.

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

/// The last terminating signal (SIGTERM, SIGHUP) sent to us, to forward to the program.
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn remember_signal(sig: libc::c_int) {
    PENDING_SIGNAL.store(sig, Ordering::Relaxed); // async-signal-safe: one atomic store
}

pub(super) fn forward_signals() {
    for sig in [libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: `action` is fully initialised (zeroed, then the handler, flags and an
        // empty mask); the handler only stores to an atomic, which is async-signal-safe.
        // exec resets a handled signal to its default, so the program is unaffected.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = remember_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

/// Sends the program `pid` (our child, not reaped yet) the signal remembered since the
/// last call, if any.
pub(super) fn forward_pending(pid: libc::pid_t) {
    let sig = PENDING_SIGNAL.swap(0, Ordering::Relaxed);
    if sig != 0 {
        // SAFETY: kill has no memory preconditions. `pid` is our unreaped child
        // (reaped only after the program has exited, by `child.wait`), so it names no
        // other process.
        unsafe { libc::kill(pid, sig) };
    }
}

const TERMINAL_SIGNALS: [libc::c_int; 2] = [libc::SIGINT, libc::SIGQUIT];

/// Blocks a terminal's SIGINT and SIGQUIT until the program is spawned, and has
/// `cmd` unblock them in the program before its exec; returns the set, for
/// [`ignore_and_unblock`] once the program is spawned.
///
/// A terminal's Ctrl-C and Ctrl-\ reach the program too (same process group): we
/// outlive them to report, then pass its fate on. Ignored only after the spawn (the
/// program would inherit an ignored disposition), blocked until then, and unblocked
/// in the program before its exec.
pub(super) fn block_terminal_signals(cmd: &mut Command) -> libc::sigset_t {
    let terminal_signals = terminal_signal_set();
    // SAFETY: the closure runs in the child between fork and exec, and only calls
    // pthread_sigmask (async-signal-safe) on a set copied into it.
    unsafe {
        cmd.pre_exec(move || {
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &terminal_signals, std::ptr::null_mut());
            Ok(())
        })
    };
    // SAFETY: changes this thread's mask only, with an initialised set.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &terminal_signals, std::ptr::null_mut()) };
    terminal_signals
}

fn terminal_signal_set() -> libc::sigset_t {
    // SAFETY: sigemptyset initialises `set`; sigaddset only writes it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in TERMINAL_SIGNALS {
            libc::sigaddset(&mut set, sig);
        }
        set
    }
}

pub(super) fn ignore_and_unblock(set: &libc::sigset_t) {
    // SAFETY: setting SIG_IGN has no preconditions (a signal pending meanwhile is
    // discarded); `set` is the initialised set `block_terminal_signals` blocked.
    unsafe {
        for sig in TERMINAL_SIGNALS {
            libc::signal(sig, libc::SIG_IGN);
        }
        libc::pthread_sigmask(libc::SIG_UNBLOCK, set, std::ptr::null_mut());
    }
}

/// Blocks until the child `pid` has exited, leaving it unreaped (WNOWAIT), so that
/// its pid cannot be reused while we may still signal it.
pub(super) fn wait_without_reaping(pid: libc::pid_t) {
    loop {
        // SAFETY: `info` is a valid, writable siginfo_t for waitid to fill.
        let r = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOWAIT)
        };
        if r == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
    }
}
