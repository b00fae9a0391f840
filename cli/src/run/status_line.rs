//! The live status line: the budget, redrawn on one line of standard error while the
//! program runs, when that is a terminal.

use crate::snapshot::Snapshot;
use crate::units::bytes;
use std::io::{IsTerminal, Write};

/// The live one-line status, on standard error when that is a terminal.
pub(super) struct StatusLine {
    on: bool,
    shown: bool,
}

impl StatusLine {
    pub(super) fn new() -> StatusLine {
        StatusLine { on: std::io::stderr().is_terminal(), shown: false }
    }

    pub(super) fn show(&mut self, s: Option<&Snapshot>) {
        let (true, Some(s)) = (self.on, s) else { return };
        let mut line = format!(
            "memquota: native {}  heap {}  limit {}  reclaims {}  OOMs {}",
            bytes(s.native),
            bytes(s.heap_committed),
            s.limit_text(),
            s.reclaims(),
            s.ooms
        );
        line.truncate(terminal_width().saturating_sub(1).max(20)); // ASCII: any cut is a boundary
        let _ = std::io::stderr().write_all(format!("\r{line}\x1b[K").as_bytes());
        self.shown = true;
    }

    pub(super) fn clear(&mut self) {
        if self.shown {
            let _ = std::io::stderr().write_all(b"\r\x1b[K");
            self.shown = false;
        }
    }
}

fn terminal_width() -> usize {
    // SAFETY: TIOCGWINSZ writes one winsize into the valid, zeroed `ws`.
    let ws = unsafe {
        let mut ws: libc::winsize = std::mem::zeroed();
        (libc::ioctl(libc::STDERR_FILENO, libc::TIOCGWINSZ, &mut ws) == 0).then_some(ws)
    };
    ws.map(|ws| ws.ws_col as usize).filter(|&c| c > 0).unwrap_or(80)
}
