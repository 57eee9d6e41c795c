//! The command line conventions the examples share (included with `#[path]`):
//!
//! - `--help` (and `--version` where there is one) prints to stdout and exits 0,
//!   running nothing;
//! - a usage error (an unknown flag, a bad or out-of-range value) is one line on
//!   stderr, `<example>: error: <what>; see '<example> --help'`, and exit status 2;
//! - an error while running is one line, `<example>: error: <message>` (the error's
//!   `Display`, never a `Debug` dump), and exit status 1;
//! - output into a closed pipe (`example | head`) ends the process quietly (SIGPIPE).

// Not every example needs every helper.
#![allow(dead_code)]

use std::fmt::Display;
use std::fs::OpenOptions;
use std::path::Path;
use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};

/// Exit status of a usage error (as clap's own).
const USAGE: i32 = 2;

/// The parsed command line, or the process exits: 0 after `--help` or `--version`
/// (printed to stdout), 2 with one line on stderr after a usage error.
///
/// Also makes a closed stdout end the process quietly, as for other command line
/// tools (`example | head`), instead of a panic in `println!`.
pub(crate) fn parse<A: Parser>() -> A {
    #[cfg(unix)]
    // SAFETY: called first thing in `main`, before any other thread exists; restoring
    // the default disposition of SIGPIPE has no other effect on this program.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    match A::try_parse() {
        Ok(args) => args,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => e.exit(),
        Err(e) => usage_error::<A>(&one_line(&e)),
    }
}

/// Exits with a usage error about the command line of `A`: one line, status 2.
pub(crate) fn usage_error<A: CommandFactory>(what: &str) -> ! {
    let name = A::command().get_name().to_string();
    eprintln!("{name}: error: {what}; see '{name} --help'");
    std::process::exit(USAGE)
}

/// The exit status of `main`: success, or the error's message on one line of stderr
/// and status 1.
pub(crate) fn exit_status<A: CommandFactory, E: Display>(result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let message = e.to_string();
            eprintln!("{}: error: {}", A::command().get_name(), message.trim_end());
            ExitCode::FAILURE
        }
    }
}

/// A whole number from `s` within `low ..= high`, or the usage error's words (a
/// `value_parser` for clap).
pub(crate) fn bounded(s: &str, low: usize, high: usize) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e: std::num::ParseIntError| match e.kind() {
        std::num::IntErrorKind::PosOverflow => format!("{s} is out of range ({low} to {high})"),
        _ => format!("'{s}' is not a whole number"),
    })?;
    if n < low || n > high {
        return Err(format!("{n} is out of range ({low} to {high})"));
    }
    Ok(n)
}

/// Checks, before a long run, that `what` can be written to `path` (given as `flag`):
/// its directory exists and the file can be opened for writing. A file that was not
/// there is not left behind (a run that fails leaves nothing), one that was is not
/// changed.
pub(crate) fn check_writable(path: &Path, flag: &str, what: &str) -> Result<(), String> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        if !dir.exists() {
            return Err(format!("{flag} {}: the directory {} does not exist", path.display(), dir.display()));
        }
        if !dir.is_dir() {
            return Err(format!("{flag} {}: {} is not a directory", path.display(), dir.display()));
        }
    }
    let existed = path.exists();
    match OpenOptions::new().write(true).create(true).truncate(false).open(path) {
        Ok(file) => {
            drop(file);
            if !existed {
                let _ = std::fs::remove_file(path);
            }
            Ok(())
        }
        Err(e) => Err(format!("{flag} {}: cannot write {what} there: {e}", path.display())),
    }
}

/// clap's error as one line: its first line without the `error: ` prefix, then its
/// tips ("a similar argument exists: ..."), without the usage and help lines.
fn one_line(e: &clap::Error) -> String {
    let rendered = e.render().to_string();
    let mut lines = rendered.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or("invalid command line");
    let mut out = first.strip_prefix("error: ").unwrap_or(first).to_string();
    let rest: Vec<&str> = lines.collect();
    // "the following required arguments were not provided:" lists them on the next lines.
    if out.ends_with(':') {
        let listed: Vec<&str> =
            rest.iter().copied().take_while(|l| !l.starts_with("Usage:") && !l.starts_with("tip: ")).collect();
        out.push(' ');
        out.push_str(&listed.join(", "));
    }
    for tip in rest.into_iter().filter(|l| l.starts_with("tip: ")) {
        out += " (";
        out += tip;
        out += ")";
    }
    out
}
