//! The summary printed when the program has ended: how it ended, the sampler's rows,
//! where the stats file is, and the `--plot` written on the way.

use super::exit_status::describe;
use super::sampler::Sampler;
use super::RunArgs;
use crate::plot;
use std::ffi::OsString;
use std::path::Path;
use std::process::ExitStatus;
use std::time::Duration;

/// The summary of a run of `shown` (its [`command_line`]) that ended with `status`
/// after `elapsed`; writes `--plot` if asked, and says where.
pub(super) fn summary(
    args: &RunArgs,
    shown: &str,
    status: ExitStatus,
    elapsed: Duration,
    sampler: &Sampler,
    stats_path: &Path,
) -> String {
    let mut summary =
        format!("memquota: {shown} {} after {:.1} s\n", describe(status), elapsed.as_secs_f64());
    summary.push_str(&sampler.summary());
    summary.push_str(&sites(&sampler.last_text, &mut crate::symbols::addr2line));
    if args.stats_file.is_some() {
        summary.push_str(&format!("  {:<16} {}\n", "stats file", stats_path.display()));
    }
    if let Some(svg) = &args.plot {
        if sampler.points.is_empty() {
            summary.push_str(&format!("  {:<16} not written: no samples\n", "plot"));
        } else {
            let limit = sampler.last.as_ref().map(|s| s.limit_text()).unwrap_or_default();
            let title = format!("memquota run: {} (limit {limit})", shorten(shown, 70));
            match plot::write_svg(svg, &title, &sampler.points) {
                Ok(()) => summary.push_str(&format!("  {:<16} {}\n", "plot", svg.display())),
                Err(e) => summary.push_str(&format!("  {:<16} {e}\n", "plot")),
            }
        }
    }
    summary
}

/// The top sites the program's stats file named at exit (`# memquota site` lines),
/// each frame named by `name` (`OBJECT`, `ADDR` to `function (file:line)`), or an
/// empty string if it named none.
fn sites(text: &str, name: &mut impl FnMut(&str, &str) -> Option<String>) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if let Some(head) = line.strip_prefix("# memquota sites ") {
            let when = head.split(';').next().unwrap_or(head);
            out.push_str(&format!("  {:<16} {when}, estimated from samples\n", "top sites"));
        } else if let Some(site) = line.strip_prefix("# memquota site ") {
            let mut words = site.split_whitespace();
            let bytes: u64 = words.next().and_then(|b| b.parse().ok()).unwrap_or(0);
            let share = words.next().unwrap_or("");
            let frames: Vec<String> = words
                .map(|frame| match frame.rsplit_once('+') {
                    Some((object, addr)) => name(object, addr).unwrap_or_else(|| frame.to_string()),
                    None => frame.to_string(),
                })
                .collect();
            out.push_str(&format!("    {:>10} {share:>6}  {}\n", bytes_text(bytes), frames.join(" <- ")));
        }
    }
    out
}

fn bytes_text(b: u64) -> String {
    crate::units::bytes(b)
}

/// The command line for people, in backquotes.
pub(super) fn command_line(command: &[OsString]) -> String {
    let words: Vec<String> = command
        .iter()
        .map(|w| {
            let w = w.to_string_lossy();
            if w.is_empty() || w.contains(|c: char| c.is_whitespace() || "'\"\\$`".contains(c)) {
                format!("'{}'", w.replace('\'', "'\\''"))
            } else {
                w.into_owned()
            }
        })
        .collect();
    format!("`{}`", words.join(" "))
}

fn shorten(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_quote_what_a_shell_would_split() {
        let cmd: Vec<OsString> = ["java", "-version", "a b", "it's"].iter().map(OsString::from).collect();
        assert_eq!(command_line(&cmd), r"`java -version 'a b' 'it'\''s'`");
        assert_eq!(shorten("abcdef", 3), "abc...");
        assert_eq!(shorten("abc", 3), "abc");
    }

    #[test]
    fn the_sites_of_the_stats_file_are_named_frame_by_frame() {
        let text = "memquota_native_bytes 1\n# memquota sites at the last refusal; total 100 bytes, 1 sample per 524288 bytes\n\
                    # memquota site 75 75.0% /bin/x+0x10 /lib/y+0x20\n# memquota site 25 25.0% 0x7f00\n";
        let mut name = |object: &str, addr: &str| (object == "/bin/x").then(|| format!("f@{addr}"));
        let got = sites(text, &mut name);
        assert!(got.contains("top sites        at the last refusal, estimated from samples"), "{got}");
        assert!(got.contains("75.0%  f@0x10 <- /lib/y+0x20\n"), "{got}");
        assert!(got.contains("25.0%  0x7f00\n"), "{got}");
        assert_eq!(sites("memquota_native_bytes 1\n", &mut name), "");
    }
}
