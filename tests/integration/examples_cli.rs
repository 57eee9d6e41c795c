//! The command lines of the examples besides the demo (`quickstart`, `custom_layer`,
//! `prefetch_overlap`, `cuda_smoke`, `train_sequences`, `train_gpt`, `generate`; the demo has `train_digits_cli`,
//! and `serve_digits` the tests of its package, serve/): `--help` prints
//! usage and runs nothing, an unknown flag or a bad value is one line on stderr and exit
//! status 2 (never a panic), and an error while running prints its message, not a
//! `Debug` dump. The examples are built once, together, with the profile of this test
//! (a nested `cargo build`, so that the binaries run are the current source); no test
//! runs an example's workload.

use std::process::{Command, Output};

pub(crate) const EXAMPLES: [&str; 7] =
    ["quickstart", "custom_layer", "prefetch_overlap", "cuda_smoke", "train_sequences", "train_gpt", "generate"];

fn example(name: &str) -> Command {
    Command::new(crate::example_binary(name))
}

fn run(name: &str, args: &[&str]) -> Output {
    example(name).args(args).output().expect("the example runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The one line on stderr of a usage error: exit status 2, nothing on stdout.
fn usage_error(name: &str, args: &[&str]) -> String {
    let output = run(name, args);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{name} {args:?}: a usage error, got {:?}: {stderr}", output.status);
    assert!(output.stdout.is_empty(), "{name} {args:?}: nothing may run: {}", text(&output.stdout));
    assert_eq!(stderr.lines().count(), 1, "{name} {args:?}: one line: {stderr}");
    assert!(stderr.starts_with(&format!("{name}: error: ")), "{name} {args:?}: {stderr}");
    stderr
}

#[test]
fn help_prints_usage_within_80_columns_and_runs_nothing() {
    for name in EXAMPLES {
        let output = run(name, &["--help"]);
        assert_eq!(output.status.code(), Some(0), "{name} --help: {}", text(&output.stderr));
        let stdout = text(&output.stdout);
        assert!(stdout.contains(&format!("Usage: {name}")), "{name}: {stdout}");
        assert!(stdout.contains("-h, --help"), "{name}: {stdout}");
        let wide: Vec<&str> = stdout.lines().filter(|l| l.chars().count() > 80).collect();
        assert!(wide.is_empty(), "{name}: help wider than 80 columns: {wide:#?}");
        assert!(output.stderr.is_empty(), "{name}: {}", text(&output.stderr));
    }
    // No line that each prints when it runs.
    for (name, running) in [
        ("quickstart", &["learned size"][..]),
        ("custom_layer", &["epoch "]),
        ("prefetch_overlap", &["prefetch overlap:"]),
        ("cuda_smoke", &["no CUDA device:", "device:"]),
        ("train_sequences", &["train_sequences:", "enabled", "loss traces"]),
        ("train_gpt", &["train_gpt:", "enabled", "sample"]),
        ("generate", &["{\"allocs_per_token\"", "\n"]),
    ] {
        let stdout = text(&run(name, &["--help"]).stdout);
        let ran = stdout.lines().any(|line| running.iter().any(|start| line.starts_with(start)));
        assert!(!ran, "{name} --help ran: {stdout}");
    }
    for flag in ["--json", "--batches", "--batch-us", "--depth", "--rounds"] {
        assert!(text(&run("prefetch_overlap", &["--help"]).stdout).contains(flag), "prefetch_overlap {flag}");
    }
    for flag in ["--json", "--rounds"] {
        assert!(text(&run("cuda_smoke", &["--help"]).stdout).contains(flag), "cuda_smoke {flag}");
    }
    // train_digits' flags, and the head and the bucketing.
    for flag in [
        "--compare",
        "--workspace-mode",
        "--epochs",
        "--batch-size",
        "--hidden",
        "--lr",
        "--seed",
        "--json",
        "--prefetch-depth",
        "--head",
        "--bucket",
    ] {
        assert!(text(&run("train_sequences", &["--help"]).stdout).contains(flag), "train_sequences {flag}");
    }
}

#[test]
fn flags_that_cannot_go_together_are_one_line_usage_errors_before_anything_runs() {
    let dir = std::env::temp_dir().join(format!("carve-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.json");
    let trace = trace.to_str().unwrap();
    for (name, args, says) in [
        ("train_gpt", &["--compare", "--timeline", trace][..], "leave out --compare"),
        ("train_gpt", &["--timeline", trace, "--save", trace], "a path other than --save's"),
        ("train_sequences", &["--epochs", "1000001"], "1 to 1000000"),
    ] {
        let stderr = usage_error(name, args);
        assert!(stderr.contains(says), "{name} {args:?}: {stderr}");
    }
    assert!(!dir.join("trace.json").exists(), "nothing written");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_flags_are_one_line_usage_errors() {
    for name in EXAMPLES {
        let stderr = usage_error(name, &["--no-such-flag"]);
        assert!(stderr.contains("'--no-such-flag'"), "{name}: {stderr}");
    }
}

#[test]
fn bad_values_are_one_line_usage_errors_naming_the_flag_and_the_valid_range() {
    for (name, args, flag, range) in [
        ("prefetch_overlap", &["--depth", "0"][..], "'--depth <D>'", "1..=1024"),
        ("prefetch_overlap", &["--depth", "1025"], "'--depth <D>'", "1..=1024"),
        ("prefetch_overlap", &["--batches", "7"], "'--batches <N>'", "8..=1000000"),
        ("prefetch_overlap", &["--batches", "1000001"], "'--batches <N>'", "8..=1000000"),
        ("prefetch_overlap", &["--rounds", "0"], "'--rounds <R>'", "1..=1000"),
        ("prefetch_overlap", &["--batch-us", "0"], "'--batch-us <T>'", "1..=1000000"),
        ("prefetch_overlap", &["--depth", "two"], "'--depth <D>'", ""),
        ("cuda_smoke", &["--rounds", "0"], "'--rounds <N>'", "1..=1000"),
        ("cuda_smoke", &["--rounds", "many"], "'--rounds <N>'", ""),
        ("train_sequences", &["--epochs", "0"], "'--epochs <N>'", "1 to 1000000"),
        ("train_sequences", &["--batch-size", "0"], "'--batch-size <N>'", "1 or more"),
        ("train_sequences", &["--hidden", "64,0"], "'--hidden <W,W,...>'", "1 to 4096"),
        ("train_sequences", &["--lr", "-1"], "'--lr <X>'", "above 0"),
        ("train_sequences", &["--lr", "nan"], "'--lr <X>'", "above 0"),
        ("train_sequences", &["--prefetch-depth", "2000"], "'--prefetch-depth <N>'", "0 to 1024"),
        ("train_sequences", &["--workspace-mode", "bogus"], "'--workspace-mode <MODE>'", "enabled"),
        ("train_sequences", &["--head", "max"], "'--head <HEAD>'", "last"),
        ("train_gpt", &["--iters", "0"], "'--iters <N>'", "1 to 10000000"),
        ("train_gpt", &["--iters", "10000001"], "'--iters <N>'", "1 to 10000000"),
        ("train_gpt", &["--heads", "0"], "'--heads <N>'", "1 to 64"),
        ("train_gpt", &["--width", "5000"], "'--width <N>'", "1 to 4096"),
        ("train_gpt", &["--lr", "-1"], "'--lr <X>'", "above 0"),
        ("train_gpt", &["--attention", "all"], "'--attention <FORM>'", "keep or recompute"),
        ("train_gpt", &["--workspace-mode", "bogus"], "'--workspace-mode <MODE>'", "enabled"),
        ("generate", &["--tokens", "0"], "'--tokens <N>'", "1 to 100000"),
        ("generate", &["--tokens", "100001"], "'--tokens <N>'", "1 to 100000"),
        ("generate", &["--tokens", "99999999999999999999999"], "'--tokens <N>'", "1 to 100000"),
        ("generate", &["--temperature", "-1"], "'--temperature <T>'", "at least 0"),
        ("generate", &["--temperature", "inf"], "'--temperature <T>'", "at least 0"),
        ("generate", &["--streams", "0"], "'--streams <N>'", "1 to 256"),
    ] {
        let stderr = usage_error(name, args);
        assert!(stderr.contains(flag) && stderr.contains(range), "{name} {args:?}: '{flag}', '{range}' in {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn errors_while_running_print_their_message_not_a_debug_dump() {
    for name in ["quickstart", "custom_layer"] {
        let output = example(name).env("CARVE_WORKSPACE_DEBUG", "bogus").output().expect("the example runs");
        assert_eq!(output.status.code(), Some(1), "{name}: {output:?}");
        let stderr = text(&output.stderr);
        assert_eq!(stderr.lines().count(), 1, "{name}: {stderr}");
        assert!(
            stderr.starts_with(&format!("{name}: error: environment variable CARVE_WORKSPACE_DEBUG is 'bogus'")),
            "{name}: {stderr}"
        );
        assert!(!stderr.contains("InvalidDebugMode"), "{name}: a Debug dump: {stderr}");
    }
}

#[test]
fn train_sequences_compares_the_modes_on_variable_length_batches_in_json() {
    let output = run("train_sequences", &["--compare", "--epochs", "2", "--hidden", "8", "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().expect("a JSON line")).unwrap();
    assert_eq!(json["loss_traces_identical"], serde_json::Value::Bool(true), "{json}");
    assert_eq!((json["train_rows"].as_u64(), json["test_rows"].as_u64()), (Some(270), Some(370)), "{json}");
    assert!(json["distinct_batch_shapes"].as_u64().is_some_and(|n| n > 1), "{json}");
    assert!(json["max_steps"].as_u64().is_some_and(|n| (7..=29).contains(&n)), "{json}");
    assert!(json["ring_growths"].as_u64().is_some(), "{json}");
    assert!(json["iter_time_ratio_enabled_over_none"].is_number(), "{json}");
    for mode in ["enabled", "none"] {
        let m = &json[mode];
        for key in ["test_accuracy", "final_loss", "iter_us_median", "epoch_ms_median", "steady_state_allocs_max"] {
            assert!(!m[key].is_null(), "{mode}.{key} in {json}");
        }
    }
    // After the first epoch no training iteration allocates with workspaces, and every
    // one does without.
    assert_eq!(json["enabled"]["steady_state_allocs_max"].as_u64(), Some(0), "{json}");
    assert!(json["none"]["steady_state_allocs_max"].as_u64().is_some_and(|n| n > 0), "{json}");
    // The dry run before the first step predicts every mode's bytes to the byte: the
    // most a step took, and the arenas at the end.
    for mode in ["enabled", "planned", "none"] {
        let m = &json[mode];
        assert_eq!(m["predicted_bytes"], m["workspace_bytes"], "{mode}: {m}");
        assert_eq!(m["predicted_capacity"], m["workspace_capacity"], "{mode}: {m}");
        assert!(m["dry_run_us"].as_f64().is_some_and(|us| us > 0.0), "{mode}: {m}");
    }
    assert!(json["enabled"]["predicted_bytes"].as_u64().is_some_and(|b| b > 0), "{json}");
}

/// The GPT's JSON keys (issue 41's contract), on a small shape: every mode takes what
/// its dry run predicted, the planned arena is at the peak of its live bytes, no steady
/// step allocates with workspaces, and the three modes give the same losses.
#[test]
fn train_gpt_reports_its_keys_and_the_modes_agree() {
    let shape = ["--layers", "1", "--width", "16", "--heads", "2", "--context", "8", "--batch-size", "2"];
    let args = [&shape[..], &["--iters", "14", "--eval-every", "7", "--sample", "12", "--compare", "--json"]].concat();
    let output = run("train_gpt", &args);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().expect("a JSON line")).unwrap();
    assert_eq!(json["loss_traces_equal"], serde_json::Value::Bool(true), "{json}");
    let keys = [
        "train_loss",
        "val_loss",
        "step_us_median",
        "steady_state_allocs_max",
        "workspace_bytes",
        "plan_bytes",
        "lower_bound_bytes",
        "predicted_bytes",
        "peak_rss_bytes",
        "training_rss_growth_bytes",
        "params",
        "loss_trace_sha256",
    ];
    for mode in ["enabled", "planned", "none"] {
        let m = &json[mode];
        for key in keys {
            assert!(m.get(key).is_some(), "{mode}.{key} in {json}");
        }
        assert_eq!(m["predicted_bytes"], m["workspace_bytes"], "{mode}: {m}");
        assert_eq!(m["loss_trace_sha256"], json["enabled"]["loss_trace_sha256"], "{mode}");
        assert_eq!(m["sample"].as_str().map(|s| s.chars().count()), Some(12), "{mode}: {m}");
        assert!(m["val_loss"].as_f64().is_some_and(|l| l.is_finite() && l > 0.0), "{mode}: {m}");
    }
    for mode in ["enabled", "planned"] {
        assert_eq!(json[mode]["steady_state_allocs_max"].as_u64(), Some(0), "{mode}: {json}");
    }
    let planned = &json["planned"];
    let (plan, bound) = (planned["plan_bytes"].as_f64().unwrap(), planned["lower_bound_bytes"].as_f64().unwrap());
    assert!(plan >= bound && plan <= 1.05 * bound, "{planned}");
    // 77 tokens; a block of width 16: 77·16 + 8·16 + 2·(2·16) + (16·48 + 48 + 16·16 + 16) + (16·64 + 64 + 64·16
    // + 16) + 2·16 + 16·77 + 77.
    let d = 16u64;
    let params = 77 * d
        + 8 * d
        + 2 * (2 * d)
        + (d * 3 * d + 3 * d + d * d + d)
        + (d * 4 * d + 4 * d + 4 * d * d + d)
        + 2 * d
        + d * 77
        + 77;
    assert_eq!(json["params"].as_u64(), Some(params), "{json}");
    for key in keys {
        assert_eq!(json[key], json["enabled"][key], "the top level is the first mode's: {key}");
    }
}

#[test]
fn train_sequences_saves_a_model_that_serves_sequences() {
    let path = std::env::temp_dir().join(format!("carve-train-sequences-save-{}.safetensors", std::process::id()));
    let output =
        run("train_sequences", &["--epochs", "1", "--hidden", "8", "--head", "mean", "--save", path.to_str().unwrap()]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(text(&output.stdout).contains("model saved to"), "{}", text(&output.stdout));
    let model = carve::nn::serve::Model::load(&path).expect("the saved model loads");
    std::fs::remove_file(&path).unwrap();
    assert_eq!((model.inputs(), model.classes()), (12, 9));
    let names: Vec<&str> = model.layers().iter().map(|l| l.name()).collect();
    assert_eq!(names, ["lstm_0", "masked_mean_1", "dense_2"]);
    let x = ndarray::Array3::<f32>::from_elem((2, 5, 12), 0.5);
    let mask = ndarray::Array2::<f32>::from_shape_fn((2, 5), |(b, t)| f32::from(u8::from(t < 5 - 2 * b)));
    let probabilities = model.output((x.view(), mask.view())).unwrap();
    assert_eq!(probabilities.shape(), [2, 9]);
    assert!(probabilities.rows().into_iter().all(|r| (r.sum() - 1.0).abs() < 1e-5), "{probabilities}");
}

#[test]
fn train_sequences_planned_records_new_shapes_after_warm_up_without_heap_allocations_but_the_plan() {
    let output = run("train_sequences", &["--workspace-mode", "planned", "--epochs", "3", "--hidden", "8", "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().expect("a JSON line")).unwrap();
    let planned = &json["planned"];
    // Batch shapes first seen after the first epoch are recorded then (the shuffled
    // order of seed 0 has some), in the group's arena: each costs its plan's storage.
    assert!(planned["new_shape_iterations"].as_u64().is_some_and(|n| n >= 1), "{json}");
    assert!(planned["new_shape_allocs"].as_u64().is_some_and(|n| n <= 8), "{json}");
    assert!(planned["steady_state_allocs_max"].as_u64().is_some_and(|n| n <= 8), "{json}");
    assert_eq!(planned["divergences"].as_u64(), Some(0), "{json}");
}

#[test]
fn train_sequences_trains_data_parallel_with_threads_matching_the_shard_mode() {
    let mut traces = Vec::new();
    for reducer in ["threads", "sequential"] {
        let args = ["--workers", "3", "--reducer", reducer, "--epochs", "2", "--hidden", "8", "--json"];
        let output = run("train_sequences", &args);
        assert!(output.status.success(), "{reducer}: {}", text(&output.stderr));
        let stdout = text(&output.stdout);
        let json: serde_json::Value = serde_json::from_str(stdout.lines().last().expect("a JSON line")).unwrap();
        for key in
            ["workers", "reducer", "bytes_copied_for_reduction", "gradient_bucket_bytes", "speedup_vs_one_worker"]
        {
            assert!(!json[key].is_null() && json[key] == json["enabled"][key], "{key} in {json}");
        }
        assert_eq!(json["workers"].as_u64(), Some(3), "{json}");
        assert_eq!(json["bytes_copied_for_reduction"].as_u64(), Some(0), "{json}");
        traces.push(json["enabled"]["loss_trace_sha256"].as_str().expect("a trace").to_string());
    }
    assert_eq!(traces[0], traces[1], "3 threads and one thread of 3 shards: the same losses");
    let line = usage_error("train_sequences", &["--workers", "2", "--compare"]);
    assert!(line.contains("--compare"), "{line}");
}

#[test]
fn train_sequences_writes_a_timeline_of_variable_length_batches() {
    let path = std::env::temp_dir().join(format!("carve-train-sequences-timeline-{}.json", std::process::id()));
    let output =
        run("train_sequences", &["--epochs", "2", "--hidden", "8", "--timeline", path.to_str().unwrap(), "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json: serde_json::Value = serde_json::from_str(text(&output.stdout).lines().last().unwrap()).unwrap();
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(json["timeline_events"], trace["otherData"]["events"], "{json}");
    assert_eq!(json["enabled"]["timeline_events"], json["timeline_events"], "{json}");
    assert_eq!(json["enabled"]["timeline_bytes"], json["timeline_bytes"], "{json}");
    // Batches of several lengths: distinct iterations, each stored once.
    assert!(json["timeline_scripts"].as_u64().is_some_and(|n| n > 1), "{json}");
    let slices: Vec<&serde_json::Value> =
        trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["cat"] == "alloc").collect();
    // The LSTM's time steps allocate in the recurrent loops' working memory, both ways.
    for role in ["RnnFfLoopWorkingMem", "RnnBpLoopWorkingMem"] {
        assert!(slices.iter().any(|s| s["args"]["role"] == role), "no {role} allocation");
    }
    assert!(slices.iter().any(|s| s["args"]["layer"].as_str().is_some_and(|l| l.starts_with("lstm"))));
}

#[test]
fn generate_refuses_what_it_cannot_read_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    // A model saved without its characters, and a file that is no model.
    let plain = dir.path().join("plain.safetensors");
    let config = carve::nn::NetworkConfig::builder(5).embedding(4).position_embedding(4).dense(5).build().unwrap();
    carve::nn::Network::new(config).unwrap().save(&plain).unwrap();
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a model").unwrap();
    for (args, says) in [
        (vec!["--model", plain.to_str().unwrap(), "--tokens", "3"], "carve.symbols"),
        (vec!["--model", junk.to_str().unwrap(), "--tokens", "3"], "junk.safetensors"),
        (vec!["--prompt", "ROMEO \u{20ac}", "--tokens", "3"], "character 6 of the text, '\u{20ac}'"),
    ] {
        let output = run("generate", &args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("generate: error: ") && stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn generate_writes_its_keys_and_no_allocation_per_token() {
    let output = run("generate", &["--tokens", "80", "--streams", "2", "--top-k", "5", "--json"]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    for key in ["text", "tokens_per_sec", "allocs_per_token", "kv_cache_bytes", "arena_bytes", "token_us_p50"] {
        assert!(json.get(key).is_some(), "{key}: {json}");
    }
    assert_eq!(json["text"].as_str().unwrap().chars().count(), 80);
    assert_eq!(json["allocs_per_token"], 0.0, "{json}");
    assert_eq!(json["kv_cache_bytes"], 4 * 64 * 2 * 128 * 4);
    // The same seed, the same text.
    let again = run("generate", &["--tokens", "80", "--streams", "2", "--top-k", "5", "--json"]);
    let again: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(json["text"], again["text"]);
}
