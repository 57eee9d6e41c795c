//! carve's integration tests that need no counting allocator, in one binary (one
//! link, one start under valgrind): each file a module. The tests that count heap
//! allocations install the counting allocator as the global one and stay binaries of
//! their own (`nn_prefetch_allocs`, `nn_soak`, `planned`, `sequences_allocs`).

mod device;
mod dry_run;
mod dry_run_random;
mod examples_cli;
mod generate;
mod gradcheck;
mod model_file;
mod nn;
mod nn_prefetch;
mod parallel;
mod sequences;
mod sequences_prefetch;
mod serve;
mod standalone;
mod train_digits_cli;
mod transformer;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The path of example `name`'s binary. The examples these tests run (the demo and
/// `examples_cli::EXAMPLES`) are built once per test process, together, with the
/// profile of this test: a nested `cargo build`, so that the binaries run are the
/// current source.
pub(crate) fn example_binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let dir = BUILT.get_or_init(|| {
        // This test runs from target/<profile>/deps; examples go to
        // target/<profile>/examples.
        let exe = std::env::current_exe().expect("the test's own path");
        let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>");
        let target_dir = profile_dir.parent().expect("target/<profile>");
        let mut cargo = Command::new(env!("CARGO"));
        cargo.args(["build", "--quiet"]);
        for example in examples_cli::EXAMPLES.iter().chain(&["train_digits"]) {
            cargo.args(["--example", example]);
        }
        cargo.arg("--target-dir").arg(target_dir);
        if profile_dir.file_name().is_some_and(|name| name == "release") {
            cargo.arg("--release");
        }
        let status = cargo.current_dir(env!("CARGO_MANIFEST_DIR")).status().expect("cargo runs");
        assert!(status.success(), "building the examples failed: {status}");
        profile_dir.join("examples")
    });
    dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX))
}
