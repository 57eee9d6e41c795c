//! The demo (`examples/train_digits/`) as a user runs it: `--help`, usage errors of one
//! line, flag checks before training (the network's size, the plot's path), `--plot`
//! training both modes and drawing heap next to workspace bytes, the JSON keys, per-mode
//! peak RSS, the per-epoch test accuracy, output within 80 columns and one progress bar
//! per mode on a terminal. The example is built with the profile of this test (a nested
//! `cargo build`, so that the binary run is the current source) and run for two or three
//! epochs.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The demo's binary (built once per test process, with the other examples).
fn demo() -> PathBuf {
    crate::example_binary("train_digits")
}

fn run(args: &[&str]) -> Output {
    Command::new(demo()).args(args).output().expect("the demo runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The JSON object on the last line of stdout.
fn last_json(output: &Output) -> Value {
    let stdout = text(&output.stdout);
    let line = stdout.lines().last().unwrap_or_else(|| panic!("no stdout; stderr:\n{}", text(&output.stderr)));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {line}"))
}

/// A fresh directory for one test's files.
fn scratch_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("carve-train-digits-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// The RGB pixels of a PNG the demo wrote (8-bit RGB, one IDAT chunk, filter 0 rows),
/// after checking its signature, each chunk's CRC and the sizes.
fn png_pixels(png: &[u8]) -> Vec<[u8; 3]> {
    use std::io::Read;
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    let (mut at, mut size, mut raw) = (8, (0, 0), Vec::new());
    while at < png.len() {
        let len = u32::from_be_bytes(png[at..at + 4].try_into().unwrap()) as usize;
        let (kind, data) = (&png[at + 4..at + 8], &png[at + 8..at + 8 + len]);
        let mut crc = flate2::Crc::new();
        crc.update(kind);
        crc.update(data);
        assert_eq!(crc.sum().to_be_bytes(), png[at + 8 + len..at + 12 + len], "CRC of {kind:?}");
        match kind {
            b"IHDR" => {
                size = (
                    u32::from_be_bytes(data[..4].try_into().unwrap()),
                    u32::from_be_bytes(data[4..8].try_into().unwrap()),
                );
                assert_eq!(&data[8..], [8, 2, 0, 0, 0], "8-bit RGB");
            }
            b"IDAT" => flate2::read::ZlibDecoder::new(data).read_to_end(&mut raw).map(drop).expect("zlib data"),
            _ => {}
        }
        at += 12 + len;
    }
    let row = size.0 as usize * 3 + 1;
    assert_eq!(raw.len(), row * size.1 as usize, "rows of {size:?}");
    raw.chunks_exact(row)
        .flat_map(|line| {
            assert_eq!(line[0], 0, "filter type 0");
            line[1..].chunks_exact(3).map(|p| [p[0], p[1], p[2]])
        })
        .collect()
}

/// The SVG elements `<tag ...>` of `svg`: each one's attributes (the text up to its
/// `>`) and, for elements with a closing tag, the text up to it.
fn svg_elements<'a>(svg: &'a str, tag: &str) -> Vec<(&'a str, &'a str)> {
    let close = format!("</{tag}>");
    svg.split(&format!("<{tag} "))
        .skip(1)
        .filter_map(|element| {
            let end = element.find('>')?;
            let body = &element[end + 1..];
            Some((&element[..end], body.find(&close).map_or("", |e| body[..e].trim())))
        })
        .collect()
}

/// The value of attribute `name` in an element's attribute text.
fn attribute<'a>(attributes: &'a str, name: &str) -> Option<&'a str> {
    let key = format!("{name}=\"");
    let (at, _) = attributes.match_indices(&key).find(|&(i, _)| i == 0 || attributes.as_bytes()[i - 1] == b' ')?;
    let rest = &attributes[at + key.len()..];
    Some(&rest[..rest.find('"')?])
}

/// The texts of an SVG's `<text>` elements.
fn svg_texts(svg: &str) -> Vec<String> {
    svg_elements(svg, "text").into_iter().map(|(_, body)| body.to_string()).collect()
}

/// Lines of `text` wider than 80 columns.
fn wide_lines(text: &str) -> Vec<String> {
    text.lines().filter(|l| l.chars().count() > 80).map(str::to_string).collect()
}

/// The one line of a usage error on stderr (exit status 2, nothing on stdout).
fn usage_error(args: &[&str]) -> String {
    let output = run(args);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{args:?}: a usage error, got {:?}: {stderr}", output.status);
    assert!(output.stdout.is_empty(), "{args:?}: nothing may run: {}", text(&output.stdout));
    assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr}");
    assert!(stderr.starts_with("train_digits: error: "), "{args:?}: {stderr}");
    stderr
}

/// `n` with a comma every three digits.
fn thousands(n: u128) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Whether this process may reset its peak RSS, as the demo does per epoch.
fn peak_rss_resettable() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[test]
fn a_plot_file_that_is_neither_svg_nor_png_is_refused_before_training() {
    let output = run(&["--plot", "memory.jpg", "--epochs", "1"]);
    assert_eq!(output.status.code(), Some(2), "a usage error");
    let stderr = text(&output.stderr);
    assert!(stderr.contains("'memory.jpg' does not end in .svg or .png"), "{stderr}");
    assert!(output.stdout.is_empty(), "nothing may run before the flags are checked: {}", text(&output.stdout));

    let missing = scratch_dir("missing-dir").join("no-such-dir").join("memory.svg");
    let output = run(&["--plot", missing.to_str().unwrap(), "--epochs", "1"]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert!(stderr.contains("no-such-dir does not exist"), "{stderr}");
    assert!(output.stdout.is_empty(), "the directory is checked before training: {}", text(&output.stdout));
}

#[test]
fn plot_trains_and_draws_both_modes() {
    let dir = scratch_dir("plot");
    for name in ["memory.svg", "memory.PNG"] {
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        let output = run(&["--plot", path.to_str().unwrap(), "--json", "--epochs", "2"]);
        assert!(output.status.success(), "{}", text(&output.stderr));
        let json = last_json(&output);
        assert!(json["enabled"].is_object() && json["none"].is_object(), "{json}");
        assert_eq!(json["loss_traces_identical"], Value::Bool(true));
        assert!(json["iter_time_ratio_enabled_over_none"].is_number(), "{json}");
        // The heap series is real: the heap holds the memory without workspaces, and
        // nothing in steady state with them.
        let heap_peak = |mode: &str| json[mode]["steady_state_heap_peak_bytes"].as_u64();
        assert!(heap_peak("none").is_some_and(|b| b > 0), "{json}");
        assert_eq!(heap_peak("enabled"), Some(0), "{json}");
        let bytes = std::fs::read(&path).expect("the plot was written");
        if name.ends_with(".svg") {
            let svg = String::from_utf8(bytes).expect("SVG is text");
            let texts = svg_texts(&svg);
            for caption in ["workspace bytes in use", "heap bytes in use", "heap allocations"] {
                assert!(texts.iter().any(|t| t.starts_with(caption)), "no panel '{caption}' in {texts:?}");
            }
            for label in ["enabled", "planned", "none"] {
                // One legend entry per panel.
                assert_eq!(texts.iter().filter(|t| *t == label).count(), 3, "legend '{label}' in {texts:?}");
            }
            // The series (drawn 2 px wide): one per mode and panel. The legends lie
            // right of all of them, so they cover no line.
            let series: Vec<&str> = svg_elements(&svg, "polyline")
                .into_iter()
                .filter(|(a, _)| attribute(a, "stroke-width") == Some("2"))
                .filter_map(|(a, _)| attribute(a, "points"))
                .collect();
            assert_eq!(series.len(), 9, "three modes in three panels");
            let rightmost = series
                .iter()
                .flat_map(|points| points.split_whitespace())
                .filter_map(|point| point.split(',').next()?.parse::<f64>().ok())
                .fold(f64::MIN, f64::max);
            for (attributes, body) in svg_elements(&svg, "text") {
                if body == "enabled" || body == "planned" || body == "none" {
                    let x: f64 = attribute(attributes, "x").and_then(|x| x.parse().ok()).expect("a text's x");
                    assert!(x > rightmost, "legend '{body}' at x {x} over the series (right end {rightmost})");
                }
            }
        } else {
            let pixels = png_pixels(&bytes);
            assert_eq!(pixels.len(), 1200 * 1000, "a 1200 x 1000 image");
            // Both series colours are drawn (enabled blue, none red), on white.
            for colour in [[31, 119, 180], [214, 39, 40], [255, 255, 255]] {
                assert!(pixels.contains(&colour), "no pixel of colour {colour:?}");
            }
        }
    }
    // Without --plot or --compare, one mode.
    let json = last_json(&run(&["--json", "--epochs", "1", "--workspace-mode", "none"]));
    assert!(json["none"].is_object() && json.get("enabled").is_none(), "{json}");
}

#[test]
fn compare_json_keeps_its_keys_with_per_mode_peak_rss_and_accuracy_per_epoch() {
    let output = run(&["--compare", "--json", "--epochs", "2"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json = last_json(&output);
    for key in ["epochs", "batch_size", "hidden", "seed", "enabled", "none", "iter_time_ratio_enabled_over_none"] {
        assert!(json.get(key).is_some(), "missing '{key}' in {json}");
    }
    let resettable = peak_rss_resettable();
    for mode in ["enabled", "none"] {
        let m = &json[mode];
        for key in [
            "test_accuracy",
            "final_loss",
            "loss_trace_sha256",
            "steady_state_allocs_per_iter",
            "steady_state_alloc_bytes_per_iter",
            "iter_us_median",
            "epoch_ms_median",
            "workspace_bytes",
            "peak_rss_bytes",
        ] {
            assert!(m.get(key).is_some(), "missing '{mode}.{key}' in {m}");
        }
        assert!(m["peak_rss_bytes"].as_u64().is_some_and(|b| b > 0), "{mode}: {m}");
        let scope = if resettable { "mode_epochs" } else { "process" };
        assert_eq!(m["peak_rss_scope"], Value::from(scope), "{mode}");
        let per_epoch = m["test_accuracy_per_epoch"].as_array().expect("an array");
        assert_eq!(per_epoch.len(), 2, "{mode}: one accuracy per epoch");
        assert_eq!(per_epoch[1], m["test_accuracy"], "{mode}: the last epoch's accuracy is the final one");
        assert!(per_epoch.iter().all(|a| a.as_f64().is_some_and(|a| (0.0..=1.0).contains(&a))), "{per_epoch:?}");
    }
    assert_eq!(json["enabled"]["test_accuracy_per_epoch"], json["none"]["test_accuracy_per_epoch"]);
    assert_eq!(json["enabled"]["steady_state_allocs_per_iter"], Value::from(0.0));
    // What the table shows as "in use": the steady iterations' peak, within the capacity
    // (the whole run's peak includes the first iteration's spills).
    let enabled = &json["enabled"];
    let steady = enabled["steady_state_workspace_bytes_in_use"].as_u64().expect("a steady peak with 2 epochs");
    assert!(steady > 0 && steady <= enabled["workspace_bytes"].as_u64().unwrap(), "{enabled}");
    assert!(steady <= enabled["workspace_bytes_in_use"].as_u64().unwrap(), "{enabled}");
    // The per-epoch evaluation is outside the counted bracket: every steady iteration
    // without workspaces makes the same number of allocations, the last of each epoch
    // (just before the evaluation) included.
    let none = &json["none"];
    let (mean, max) = (none["steady_state_allocs_per_iter"].as_f64(), none["steady_state_allocs_max"].as_f64());
    assert!(mean.is_some_and(|m| m > 0.0), "{none}");
    assert_eq!(mean, max, "an iteration allocated more than the others: {none}");
}

#[test]
fn progress_lines_show_loss_and_test_accuracy() {
    // With stderr not a terminal, progress is a plain line per reported epoch.
    let output = run(&["--compare", "--epochs", "2"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stderr = text(&output.stderr);
    for prefix in ["enabled epoch    1/2: loss ", "   none epoch    2/2: loss "] {
        let line = stderr.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no '{prefix}':\n{stderr}"));
        let accuracy = line.split("test accuracy ").nth(1).and_then(|rest| rest.split_whitespace().next());
        let accuracy: f64 = accuracy.and_then(|a| a.parse().ok()).unwrap_or_else(|| panic!("no accuracy in '{line}'"));
        assert!((0.0..=1.0).contains(&accuracy), "{line}");
    }
    let stdout = text(&output.stdout);
    let label =
        if peak_rss_resettable() { "peak RSS during its epochs (VmHWM)" } else { "peak RSS (VmHWM, whole process)" };
    assert!(stdout.contains(label), "{stdout}");
}

#[test]
fn batches_come_from_the_prefetcher_and_inline_filling_gives_the_same_numbers() {
    let background = last_json(&run(&["--compare", "--json", "--epochs", "2"]));
    for mode in ["enabled", "none"] {
        let p = &background[mode]["prefetch"];
        assert_eq!(p["threading"], Value::from("background"), "{mode}: {p}");
        assert_eq!(p["workspace_mode"], Value::from(mode), "{mode}: {p}");
        assert_eq!(p["depth"], Value::from(2), "{mode}: {p}");
        // 1438 training rows in batches of 32: 45 batches an epoch, 2 epochs.
        assert_eq!(p["batches_consumed"], Value::from(90), "{mode}: {p}");
        assert_eq!(p["ring_growths"], Value::from(0), "{mode}: {p}");
    }
    let ring = &background["enabled"]["prefetch"];
    assert!(ring["ring_bytes"].as_u64().is_some_and(|b| b >= 3 * (32 * 64 * 4 + 32 * 4)), "{ring}");
    assert_eq!(background["none"]["prefetch"]["ring_bytes"], Value::from(0));

    let output = run(&["--json", "--epochs", "2", "--prefetch-depth", "0"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let inline = last_json(&output);
    assert_eq!(inline["enabled"]["prefetch"]["threading"], Value::from("shield"));
    assert_eq!(inline["enabled"]["loss_trace_sha256"], background["enabled"]["loss_trace_sha256"]);
    assert_eq!(inline["enabled"]["steady_state_allocs_per_iter"], Value::from(0.0));

    let output = run(&["--prefetch-depth", "5000"]);
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("a prefetch depth of 5000 is above the limit of 1024"), "{stderr}");
}

#[test]
fn help_prints_the_flags_within_80_columns_and_runs_nothing() {
    let output = run(&["--help"]);
    assert_eq!(output.status.code(), Some(0));
    let stdout = text(&output.stdout);
    assert!(stdout.contains("Usage: train_digits [OPTIONS]"), "{stdout}");
    for flag in ["--workspace-mode", "--compare", "--epochs", "--batch-size", "--hidden", "--lr", "--seed"] {
        assert!(stdout.contains(flag), "'{flag}' in {stdout}");
    }
    for flag in ["--prefetch-depth", "--json", "--plot"] {
        assert!(stdout.contains(flag), "'{flag}' in {stdout}");
    }
    assert_eq!(wide_lines(&stdout), Vec::<String>::new(), "help wider than 80 columns");
    assert!(output.stderr.is_empty(), "{}", text(&output.stderr));
    assert!(!stdout.contains("epochs of"), "--help trained: {stdout}");
}

#[test]
fn usage_errors_are_one_line_naming_the_flag_and_the_valid_values() {
    let stderr = usage_error(&["--no-such-flag"]);
    assert!(stderr.contains("'--no-such-flag'"), "{stderr}");
    for (args, flag, valid) in [
        (&["--epochs", "0"][..], "'--epochs <N>'", "at least 1"),
        (&["--epochs", "many"], "'--epochs <N>'", "positive integer"),
        (&["--batch-size", "0"], "'--batch-size <N>'", "at least 1"),
        (&["--hidden", "128,0"], "'--hidden <W,W,...>'", "at least 1"),
        (&["--lr", "nan"], "'--lr <X>'", "finite and positive"),
        (&["--lr", "-1"], "'--lr <X>'", "finite and positive"),
        (&["--prefetch-depth", "5000"], "'--prefetch-depth <N>'", "0 to 1024"),
        (&["--workspace-mode", "sometimes"], "'--workspace-mode <MODE>'", "'enabled', 'planned' or 'none'"),
        (&["--seed", "x"], "'--seed <N>'", "invalid digit"),
    ] {
        let stderr = usage_error(args);
        assert!(stderr.contains(flag) && stderr.contains(valid), "{args:?}: '{flag}' and '{valid}' in {stderr}");
    }
}

#[test]
fn a_network_too_large_is_refused_before_training_with_its_total() {
    // The parameters of FEATURES-hidden-10 with biases, counted here independently.
    let parameters = |hidden: &[u128]| {
        let widths: Vec<u128> = [64].iter().chain(hidden).chain(&[10]).copied().collect();
        widths.windows(2).map(|w| (w[0] + 1) * w[1]).sum::<u128>()
    };
    // Each layer is within any sensible per-layer bound; together they are not.
    for hidden in [&[65536u128, 65536][..], &[2048, 2048, 2048, 2048, 2048]] {
        let flag = hidden.iter().map(u128::to_string).collect::<Vec<_>>().join(",");
        demo(); // built before the clock starts
        let start = Instant::now();
        let stderr = usage_error(&["--hidden", &flag]);
        assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
        let total = format!("{} parameters", thousands(parameters(hidden)));
        assert!(stderr.contains(&total), "'{total}' in {stderr}");
        assert!(stderr.contains("the limit is 16,777,216 parameters"), "{stderr}");
    }
}

#[test]
fn a_plot_path_that_cannot_be_written_is_refused_before_training() {
    // A directory where the file should be: no file can be created there (whoever runs
    // the test, root included).
    let path = scratch_dir("unwritable").join("memory.svg");
    std::fs::create_dir_all(&path).expect("a directory named memory.svg");
    let output = run(&["--plot", path.to_str().unwrap(), "--epochs", "1"]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("train_digits: error: --plot ") && stderr.contains("cannot write"), "{stderr}");
    assert!(output.stdout.is_empty(), "the file is tried before training: {}", text(&output.stdout));

    // A path that can be written is not left behind by the check when training fails.
    let path = scratch_dir("no-leftover").join("memory.svg");
    let _ = std::fs::remove_file(&path);
    let output = Command::new(demo())
        .args(["--plot", path.to_str().unwrap(), "--epochs", "1"])
        .env("TRAIN_DIGITS_DATA", scratch_dir("no-leftover").join("no-such-data.csv.gz"))
        .output()
        .expect("the demo runs");
    assert_eq!(output.status.code(), Some(1), "{}", text(&output.stderr));
    assert!(!path.exists(), "the check left {} behind", path.display());
}

#[test]
fn output_fits_80_columns_and_the_header_shows_the_batch_size_used() {
    // A header too long for one line (wrapped), a table and notes, in both modes.
    let hidden = "16,16,16,16,16,16,16,16,16,16,16,16,16,16,16,16";
    let output = run(&["--compare", "--epochs", "2", "--batch-size", "128", "--hidden", hidden]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    for stream in [text(&output.stdout), text(&output.stderr)] {
        assert_eq!(wide_lines(&stream), Vec::<String>::new(), "wider than 80 columns in:\n{stream}");
    }

    // A batch larger than the training set is all of it, and the header says so.
    let output = run(&["--batch-size", "100000", "--epochs", "1", "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json = last_json(&output);
    let rows = json["train_rows"].as_u64().expect("train_rows");
    assert_eq!(json["batch_size"], Value::from(100000));
    assert_eq!(json["batch_size_used"], Value::from(rows));
    let stderr = text(&output.stderr); // with --json, the text goes to stderr
    let header = stderr.lines().next().unwrap_or_default();
    assert!(header.contains(&format!("batch {rows} ")), "{header}");
    assert!(!header.contains("batch 100000"), "{header}");
    assert_eq!(wide_lines(&stderr), Vec::<String>::new());
}

#[test]
fn errors_while_running_are_one_line_with_their_message() {
    let output = Command::new(demo())
        .args(["--epochs", "1"])
        .env("CARVE_WORKSPACE_DEBUG", "bogus")
        .output()
        .expect("the demo runs");
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("train_digits: error: "), "{stderr}");
    assert!(stderr.contains("CARVE_WORKSPACE_DEBUG is 'bogus'"), "{stderr}");
}

/// A terminal for the demo's stderr: what it draws there, as the screen shows it at
/// the end (trailing blanks trimmed).
#[cfg(target_os = "linux")]
mod terminal {
    use std::ffi::CStr;
    use std::fs::File;
    use std::io::Read;
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::process::{Command, Stdio};

    /// A pseudo-terminal `columns` wide: (master, slave).
    fn open_pty(columns: u16) -> (File, OwnedFd) {
        // SAFETY: plain libc calls on descriptors this function opens; `ptsname_r` writes
        // at most `name.len()` bytes, NUL included, and every result is checked.
        unsafe {
            let master = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY);
            assert!(master >= 0, "posix_openpt");
            let master = File::from_raw_fd(master);
            let fd = std::os::fd::AsRawFd::as_raw_fd(&master);
            assert_eq!(libc::grantpt(fd), 0, "grantpt");
            assert_eq!(libc::unlockpt(fd), 0, "unlockpt");
            let mut name = [0 as libc::c_char; 256];
            assert_eq!(libc::ptsname_r(fd, name.as_mut_ptr(), name.len()), 0, "ptsname_r");
            let slave = libc::open(CStr::from_ptr(name.as_ptr()).as_ptr(), libc::O_RDWR | libc::O_NOCTTY);
            assert!(slave >= 0, "opening the pty's slave");
            let size = libc::winsize { ws_row: 50, ws_col: columns, ws_xpixel: 0, ws_ypixel: 0 };
            assert_eq!(libc::ioctl(slave, libc::TIOCSWINSZ, &size), 0, "TIOCSWINSZ");
            (master, OwnedFd::from_raw_fd(slave))
        }
    }

    /// Runs `command` with stderr on a terminal `columns` wide; returns the screen's
    /// lines at the end and the exit status.
    pub(super) fn screen(mut command: Command, columns: u16) -> (Vec<String>, std::process::ExitStatus) {
        let (mut master, slave) = open_pty(columns);
        let mut child = command
            .env("TERM", "xterm")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(slave))
            .spawn()
            .expect("the demo runs");
        drop(command); // closes this process's copy of the slave: reads end with the child
        let reader = std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let mut chunk = [0u8; 4096];
            // Reading fails (EIO) once no process has the terminal open any more.
            while let Ok(n) = master.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                bytes.extend_from_slice(&chunk[..n]);
            }
            bytes
        });
        let status = child.wait().expect("the demo ends");
        let bytes = reader.join().expect("the reader");
        (emulate(&String::from_utf8_lossy(&bytes), columns as usize), status)
    }

    /// The screen after `output`: text, CR, LF, auto-wrap at `columns`, cursor up and
    /// down, erase in line and in display; colours and other sequences are ignored.
    fn emulate(output: &str, columns: usize) -> Vec<String> {
        let mut screen: Vec<Vec<char>> = vec![Vec::new()];
        let (mut row, mut col) = (0usize, 0usize);
        let mut chars = output.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\r' => col = 0,
                '\n' => row += 1,
                '\u{1b}' => {
                    if chars.peek() != Some(&'[') {
                        chars.next();
                        continue;
                    }
                    chars.next();
                    let mut params = String::new();
                    let mut last = ' ';
                    for c in chars.by_ref() {
                        if c.is_ascii_alphabetic() || c == '@' || c == '~' {
                            last = c;
                            break;
                        }
                        params.push(c);
                    }
                    let n = params.trim_start_matches('?').split(';').next().and_then(|p| p.parse().ok());
                    match last {
                        'A' => row = row.saturating_sub(n.unwrap_or(1).max(1)),
                        'B' => row += n.unwrap_or(1).max(1),
                        'G' => col = n.unwrap_or(1).max(1) - 1,
                        'K' | 'J' => {
                            while screen.len() <= row {
                                screen.push(Vec::new());
                            }
                            let line = &mut screen[row];
                            match n.unwrap_or(0) {
                                0 => line.truncate(col),
                                1 => line.iter_mut().take(col + 1).for_each(|c| *c = ' '),
                                _ => line.clear(),
                            }
                            if last == 'J' && n.unwrap_or(0) == 0 {
                                screen.truncate(row + 1);
                            }
                        }
                        _ => {}
                    }
                }
                c if c.is_control() => {}
                c => {
                    if col >= columns {
                        row += 1;
                        col = 0;
                    }
                    while screen.len() <= row {
                        screen.push(Vec::new());
                    }
                    let line = &mut screen[row];
                    if line.len() <= col {
                        line.resize(col + 1, ' ');
                    }
                    line[col] = c;
                    col += 1;
                }
            }
        }
        screen.into_iter().map(|l| l.into_iter().collect::<String>().trim_end().to_string()).collect()
    }
}

#[cfg(target_os = "linux")]
#[test]
fn on_a_terminal_each_mode_has_one_progress_bar_within_80_columns() {
    // A wide terminal, where the bars must keep to 80 columns anyway, and one of 80
    // columns, where a wider line would wrap into two.
    for columns in [200, 80] {
        let mut command = Command::new(demo());
        command.args(["--compare", "--epochs", "3", "--batch-size", "128"]);
        let (screen, status) = terminal::screen(command, columns);
        assert!(status.success(), "{screen:#?}");
        let drawn: Vec<&String> = screen.iter().filter(|l| !l.is_empty()).collect();
        let wide: Vec<&&String> = drawn.iter().filter(|l| l.chars().count() > 80).collect();
        assert!(wide.is_empty(), "{columns} columns: wider than 80 columns: {wide:#?}");
        for mode in ["enabled", "planned", "none"] {
            let bars: Vec<&&String> =
                drawn.iter().filter(|l| l.trim_start().starts_with(&format!("{mode} ["))).collect();
            assert_eq!(bars.len(), 1, "{columns} columns: one bar for '{mode}' on the screen: {drawn:#?}");
            // Finished: full, on the last epoch, with its loss and test accuracy.
            let bar = bars[0];
            assert!(bar.contains("epoch 3/3") && bar.contains("loss ") && bar.contains("test acc"), "{bar}");
            assert!(!bar.contains('>') && !bar.contains("[ "), "an unfinished bar: {bar}");
        }
        assert_eq!(drawn.len(), 3, "{columns} columns: nothing but the three bars on stderr: {drawn:#?}");
    }
}

#[test]
fn save_writes_a_model_that_loads_and_a_bad_path_is_refused_before_training() {
    let dir = scratch_dir("save");
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let (a, b, c) = (path("a.safetensors"), path("b.safetensors"), path("c.safetensors"));
    for (file, seed) in [(&a, "1"), (&b, "1"), (&c, "2")] {
        let output = run(&["--epochs", "1", "--hidden", "16", "--seed", seed, "--save", file, "--json"]);
        assert!(output.status.success(), "{}", text(&output.stderr));
        assert_eq!(last_json(&output)["saved"].as_str(), Some(file.as_str()));
        assert!(text(&output.stderr).contains("model saved to"), "{}", text(&output.stderr));
    }
    let model = carve::nn::serve::Model::load(&a).expect("the saved model loads");
    assert_eq!((model.inputs(), model.classes()), (64, 10));
    assert_eq!(model.weight_bytes(), (64 * 16 + 16 + 16 * 10 + 10) * 4);
    let probabilities = model.output(ndarray::Array2::<f32>::ones((3, 64)).view()).unwrap();
    assert!(probabilities.rows().into_iter().all(|r| (r.sum() - 1.0).abs() < 1e-5), "{probabilities}");
    // The same seed trains and saves the same bytes; another seed other weights.
    let bytes = |file: &str| std::fs::read(file).unwrap();
    assert_eq!(bytes(&a), bytes(&b));
    assert_ne!(bytes(&a), bytes(&c));

    let missing = dir.join("no-such-dir").join("model.safetensors");
    let output = run(&["--epochs", "1", "--save", missing.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert!(stderr.starts_with("train_digits: error: --save ") && stderr.contains("does not exist"), "{stderr}");
    assert!(output.stdout.is_empty(), "refused before training: {}", text(&output.stdout));
}

#[test]
fn data_parallel_runs_report_the_reduction_and_threads_match_the_shard_mode_bit_for_bit() {
    let mut traces = Vec::new();
    for reducer in ["threads", "sequential"] {
        let output = run(&["--workers", "2", "--reducer", reducer, "--epochs", "2", "--hidden", "32", "--json"]);
        assert!(output.status.success(), "{reducer}: {}", text(&output.stderr));
        let json = last_json(&output);
        // At the top level and under the workspace mode's key, next to the loss trace.
        for object in [&json, &json["enabled"]] {
            assert_eq!(object["workers"].as_u64(), Some(2), "{json}");
            assert_eq!(object["reducer"].as_str(), Some(reducer), "{json}");
            assert_eq!(object["bytes_copied_for_reduction"].as_u64(), Some(0), "{json}");
            // 64-32-10: (65·32 + 33·10) values of 4 bytes, in one worker's buckets.
            assert_eq!(object["gradient_bucket_bytes"].as_u64(), Some((65 * 32 + 33 * 10) * 4), "{json}");
            assert!(object["speedup_vs_one_worker"].as_f64().is_some_and(|s| s > 0.0 && s.is_finite()), "{json}");
            assert_eq!(object["loss_trace_sha256"].as_str().map(str::len), Some(64), "{json}");
            assert_eq!(object["steady_state_allocs_max"].as_u64(), Some(0), "{json}");
        }
        // The weights and Adam's state are held once: less than a copy per worker.
        let (memory, dl4j) = (json["memory_bytes"].as_u64().unwrap(), json["dl4j_design_bytes"].as_u64().unwrap());
        assert!(memory < dl4j, "{memory} vs {dl4j}: {json}");
        assert!(json["test_accuracy"].as_f64().is_some_and(|a| a > 0.5), "{json}");
        traces.push(json["loss_trace_sha256"].as_str().unwrap().to_string());
    }
    assert_eq!(traces[0], traces[1], "2 threads and one thread of 2 shards: the same losses");
    // The other number of workers trains on other shards: other bits, same keys.
    let output = run(&["--workers", "3", "--epochs", "2", "--hidden", "32", "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json = last_json(&output);
    assert_eq!((json["workers"].as_u64(), json["reducer"].as_str()), (Some(3), Some("threads")), "{json}");
    assert_ne!(json["loss_trace_sha256"].as_str(), Some(traces[0].as_str()), "{json}");
}

#[test]
fn data_parallel_flags_are_checked_before_training() {
    for (args, names) in [
        (&["--workers", "0"][..], "--workers"),
        (&["--workers", "100000"][..], "--workers"),
        (&["--reducer", "carrier-pigeon"][..], "--reducer"),
        (&["--workers", "2", "--compare"][..], "--compare"),
    ] {
        let line = usage_error(args);
        assert!(line.contains(names), "{args:?}: {line}");
    }
    if !cfg!(feature = "mpi") {
        // Without the feature, the MPI reducer is an error that says how to get it.
        let output = run(&["--reducer", "mpi", "--epochs", "1"]);
        assert_eq!(output.status.code(), Some(1), "{}", text(&output.stderr));
        assert!(text(&output.stderr).contains("--features mpi"), "{}", text(&output.stderr));
    }
}

#[test]
fn breakdown_reports_every_part_of_a_step_and_the_matrix_multiply_alone() {
    let output = run(&["--breakdown", "--epochs", "3", "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json = last_json(&output);
    for object in [&json, &json["enabled"]] {
        let parts = object["breakdown_us"].as_object().unwrap_or_else(|| panic!("breakdown_us in {json}"));
        let names = ["matmul", "elementwise", "loss", "updater", "checks", "copies", "bookkeeping"];
        for name in names {
            assert!(parts[name].as_f64().is_some_and(|us| us >= 0.0), "{name} in {json}");
        }
        // Two epochs after the first, every full batch a step.
        assert!(parts["steps"].as_u64().is_some_and(|s| s >= 80), "{json}");
        // The step's parts add up to about the median step (the parts are means).
        let total: f64 = names.iter().map(|n| parts[*n].as_f64().unwrap()).sum();
        let median = json["enabled"]["iter_us_median"].as_f64().unwrap();
        assert!(total > 0.3 * median && total < 3.0 * median, "{total} µs vs a median of {median} µs: {json}");
        assert!(parts["matmul"].as_f64().unwrap() > 0.0 && parts["updater"].as_f64().unwrap() > 0.0, "{json}");
        let (step, gemm) =
            (object["step_gflops"].as_f64().unwrap(), object["gemm_gflops_same_shapes"].as_f64().unwrap());
        assert!(step > 0.0 && gemm > 0.0 && step.is_finite() && gemm.is_finite(), "{json}");
    }
    // Without the flag, none of it.
    let plain = last_json(&run(&["--epochs", "1", "--json"]));
    assert!(plain.get("breakdown_us").is_none() && plain["enabled"].get("step_gflops").is_none(), "{plain}");
}

/// `--breakdown` with `--workers`: the data-parallel trainer's steady steps, every part,
/// and the same losses as without it.
#[test]
fn breakdown_of_data_parallel_steps_reports_every_part_and_changes_no_loss() {
    let args = ["--workers", "2", "--hidden", "32", "--epochs", "3", "--json"];
    let output = run(&[&args[..], &["--breakdown"]].concat());
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json = last_json(&output);
    for object in [&json, &json["enabled"]] {
        let parts = object["breakdown_us"].as_object().unwrap_or_else(|| panic!("breakdown_us in {json}"));
        for name in ["matmul", "elementwise", "loss", "updater", "checks", "copies", "bookkeeping"] {
            assert!(parts[name].as_f64().is_some_and(|us| us >= 0.0), "{name} in {json}");
        }
        assert!(parts["matmul"].as_f64().unwrap() > 0.0 && parts["loss"].as_f64().unwrap() > 0.0, "{json}");
        // Two epochs after the first, every full batch a step.
        assert!(parts["steps"].as_u64().is_some_and(|s| s >= 80), "{json}");
    }
    let plain = last_json(&run(&args));
    assert!(plain.get("breakdown_us").is_none(), "{plain}");
    assert_eq!(plain["loss_trace_sha256"], json["loss_trace_sha256"], "the breakdown changed a loss");
}

/// `--threads N` splits a wide network's steps across N threads with the same losses,
/// bit for bit, as one thread; it says so in the JSON, refuses 0 and data-parallel
/// training, and allocates nothing in a steady step either way.
#[test]
fn threads_give_the_losses_of_one_thread() {
    // Products of 8 MFLOP or more split: 256 rows of 64 inputs into 512 columns is 16.
    let wide = ["--hidden", "512,512", "--batch-size", "256", "--epochs", "2", "--json"];
    let mut traces = Vec::new();
    for threads in ["1", "2", "3"] {
        let output = run(&[&wide[..], &["--threads", threads]].concat());
        assert!(output.status.success(), "{}", text(&output.stderr));
        let json = last_json(&output);
        assert_eq!(json["threads"].as_u64(), threads.parse().ok(), "{json}");
        assert_eq!(json["enabled"]["steady_state_allocs_per_iter"], Value::from(0.0), "{json}");
        traces.push(json["enabled"]["loss_trace_sha256"].as_str().unwrap().to_string());
    }
    assert!(traces.iter().all(|t| *t == traces[0]), "{traces:?}");
    for bad in [&["--threads", "0"][..], &["--threads", "65"], &["--threads", "2", "--workers", "2"]] {
        let output = run(bad);
        assert_eq!(output.status.code(), Some(2), "{bad:?}: {}", text(&output.stderr));
        assert!(text(&output.stderr).contains("--threads"), "{bad:?}: {}", text(&output.stderr));
    }
}

/// The dry run made before the first step predicts, in every mode, the arenas the run
/// ends with and the bytes of its steady steps, to the byte, in well under the time of
/// an epoch; the table shows the prediction next to the capacity.
#[test]
fn the_dry_run_before_step_one_predicts_the_run_to_the_byte() {
    let output = run(&["--compare", "--epochs", "2", "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json = last_json(&output);
    for mode in ["enabled", "planned", "none"] {
        let m = &json[mode];
        assert_eq!(m["predicted_bytes"], m["workspace_bytes"], "{mode}: {m}");
        assert_eq!(m["predicted_step_bytes"], m["steady_state_workspace_bytes_in_use"], "{mode}: {m}");
        assert!(m["dry_run_us"].as_f64().is_some_and(|us| us > 0.0), "{mode}: {m}");
        assert!(m["dry_run_passes"].as_u64().is_some_and(|n| n >= 4), "{mode}: {m}");
        let total = m["predicted_total_bytes"].as_u64().unwrap();
        assert!(total > m["predicted_bytes"].as_u64().unwrap(), "{mode}: parameters count too: {m}");
    }
    assert_eq!(json["none"]["predicted_bytes"], Value::from(0));
    assert!(json["enabled"]["predicted_bytes"].as_u64().unwrap() > 0);
    let table = text(&run(&["--epochs", "1"]).stdout);
    assert!(table.contains("predicted before step 1 (dry run)"), "{table}");
}

/// The slices, counters and iterations of a Chrome trace the demo wrote.
fn read_trace(path: &std::path::Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

#[test]
fn timeline_writes_a_chrome_trace_of_the_run_with_every_allocation_labelled() {
    let dir = scratch_dir("timeline");
    let path = dir.join("run.json");
    let output = run(&["--epochs", "3", "--timeline", path.to_str().unwrap(), "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json = last_json(&output);
    let trace = read_trace(&path);
    // The JSON's figures are the file's.
    assert_eq!(json["timeline_events"], trace["otherData"]["events"], "{json}");
    assert_eq!(json["timeline_iterations"], trace["otherData"]["iterations"], "{json}");
    assert!(json["timeline_bytes"].as_u64().is_some_and(|b| b > 0), "{json}");
    assert!(json["iter_time_ratio_timeline_over_off"].is_null(), "on all the run without --compare: {json}");
    assert_eq!(json["enabled"]["timeline_events"], json["timeline_events"], "the one mode's: {json}");
    // Three epochs of training steps and evaluations, each an iteration.
    let iterations = json["timeline_iterations"].as_u64().unwrap();
    assert!(iterations > 3 * json["train_rows"].as_u64().unwrap() / 32, "{json}");
    let events = trace["traceEvents"].as_array().unwrap();
    let slices: Vec<&Value> = events.iter().filter(|e| e["cat"] == "alloc").collect();
    assert!(!slices.is_empty());
    for slice in &slices {
        let args = &slice["args"];
        assert!(args["bytes"].as_u64().is_some_and(|b| b > 0), "{slice}");
        assert!(args["workspace"].as_str().is_some_and(|w| w.starts_with("WS_")), "{slice}");
        assert!(args["role"].is_string() && args["role"] != "unlabelled", "{slice}");
    }
    // Training steps label every allocation with a layer of the network (or the
    // input, the loss, the updater).
    let layers: std::collections::BTreeSet<&str> = slices.iter().filter_map(|s| s["args"]["layer"].as_str()).collect();
    for layer in ["input", "loss", "dense_0", "dense_4"] {
        assert!(layers.contains(layer), "{layer} in {layers:?}");
    }
    // A counter track per workspace.
    let counters: std::collections::BTreeSet<&str> =
        events.iter().filter(|e| e["ph"] == "C").filter_map(|e| e["name"].as_str()).collect();
    assert!(counters.contains("WS_ALL_LAYERS_ACT live bytes"), "{counters:?}");
    assert!(counters.contains("WS_LAYER_WORKING_MEM live bytes"), "{counters:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn timeline_with_compare_measures_its_cost_and_is_refused_with_workers() {
    let dir = scratch_dir("timeline-compare");
    let path = dir.join("compare.json");
    let output = run(&["--compare", "--epochs", "4", "--timeline", path.to_str().unwrap(), "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json = last_json(&output);
    let ratio = json["iter_time_ratio_timeline_over_off"].as_f64();
    assert!(ratio.is_some_and(|r| r > 0.2 && r < 5.0), "{json}");
    // Per mode: its network's events (none without workspaces), the one history's
    // bytes, its own ratio; the events add up to the run's.
    let mut events = 0;
    for mode in ["enabled", "planned", "none"] {
        let m = &json[mode];
        assert_eq!(m["timeline_bytes"], json["timeline_bytes"], "{mode}: {m}");
        assert!(m["iter_time_ratio_timeline_over_off"].as_f64().is_some_and(|r| r > 0.2 && r < 5.0), "{mode}: {m}");
        events += m["timeline_events"].as_u64().unwrap();
    }
    assert_eq!(json["none"]["timeline_events"], 0, "{json}");
    assert!(json["enabled"]["timeline_events"].as_u64().is_some_and(|e| e > 0), "{json}");
    assert_eq!(Some(events), json["timeline_events"].as_u64(), "{json}");
    assert_eq!(json["loss_traces_identical"], Value::Bool(true), "recording changes no arithmetic: {json}");
    assert!(read_trace(&path)["traceEvents"].as_array().is_some_and(|e| !e.is_empty()));
    let output = run(&["--workers", "2", "--timeline", path.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text(&output.stderr).contains("--timeline"), "{}", text(&output.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn timeline_refuses_the_path_of_another_output() {
    let output = run(&["--timeline", "same.json", "--save", "same.json"]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output.stderr));
    assert!(text(&output.stderr).contains("--timeline writes a file of its own"), "{}", text(&output.stderr));
}
