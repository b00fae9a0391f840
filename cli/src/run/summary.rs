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
}
