//! Names for the frames of allocation sites: binutils' `addr2line`, run on the
//! object a frame lies in (`memquota run`'s summary, `memquota profile`).

/// `function (file:line)` of the call at `addr` in `object`, by binutils' `addr2line`
/// (the function the address's code lies in, after inlining); None if it cannot say.
pub fn addr2line(object: &str, addr: &str) -> Option<String> {
    let out =
        std::process::Command::new("addr2line").args(["-f", "-i", "-C", "-e", object, addr]).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    let (function, place) = (lines.len() >= 2).then(|| (lines[lines.len() - 2], lines[lines.len() - 1]))?;
    if function == "??" {
        return None;
    }
    let place = place.rsplit('/').next().unwrap_or(place);
    Some(format!("{function} ({place})"))
}
