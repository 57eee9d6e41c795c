//! The demo (`examples/train_digits.rs`) as a user runs it: flag checks before
//! training, `--plot` training both modes, the JSON keys, per-mode peak RSS and the
//! per-epoch test accuracy. The example is built with the profile of this test (a
//! nested `cargo build`, so that the binary run is the current source) and run for two
//! epochs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::Value;

/// The demo's binary, built once per test process.
fn demo() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        // This test runs from target/<profile>/deps; the example goes to
        // target/<profile>/examples.
        let exe = std::env::current_exe().expect("the test's own path");
        let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>");
        let target_dir = profile_dir.parent().expect("target/<profile>");
        let mut cargo = Command::new(env!("CARGO"));
        cargo.args(["build", "--quiet", "--example", "train_digits", "--target-dir"]).arg(target_dir);
        if profile_dir.file_name().is_some_and(|name| name == "release") {
            cargo.arg("--release");
        }
        let status = cargo.current_dir(env!("CARGO_MANIFEST_DIR")).status().expect("cargo runs");
        assert!(status.success(), "building examples/train_digits failed: {status}");
        profile_dir.join("examples").join(format!("train_digits{}", std::env::consts::EXE_SUFFIX))
    })
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

/// The texts of an SVG's `<text>` elements.
fn svg_texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|element| {
            let body = &element[element.find('>')? + 1..];
            Some(body[..body.find("</text>")?].trim().to_string())
        })
        .collect()
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
        let bytes = std::fs::read(&path).expect("the plot was written");
        if name.ends_with(".svg") {
            let texts = svg_texts(&String::from_utf8(bytes).expect("SVG is text"));
            for label in ["enabled", "none"] {
                // One legend entry per panel.
                assert_eq!(texts.iter().filter(|t| *t == label).count(), 2, "legend '{label}' in {texts:?}");
            }
        } else {
            assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
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
