//! Device workspaces on a real GPU: cycles, a detach, a copy on a second stream, pinned
//! staging, and timed comparisons — workspace allocation against `cuMemAlloc` and
//! `cuMemAllocAsync` per call, and pinned against pageable host-to-device bandwidth.
//!
//! Without a GPU it prints `no CUDA device: <reason>` and exits 0. It never panics: a
//! failed check or device error is printed and the exit status is 1.
//!
//! Run: `cargo run --release --example cuda_smoke -- [--json] [--rounds N]`
//! (`--json`: one JSON object with the figures on the last line; `--rounds`: timed
//! rounds per figure, 1 to 1000, default 15). `--help` lists the flags; a bad flag or
//! value is one line on stderr and exit status 2.

use std::error::Error;
use std::hint::black_box;
use std::process::ExitCode;
use std::time::Instant;

use carve::WorkspaceConfig;
use clap::builder::RangedU64ValueParser;
use clap::Parser;
use ndarray::{Array1, Array2, ArrayView1};
use serde_json::json;
use workspace_cuda::device::cuda::raw;
use workspace_cuda::{probe, CudaDevice, Device, DeviceArray, DeviceWorkspace, PinnedWorkspace};

#[path = "common/cli.rs"]
mod cli;

// The training step's arrays, shared with the benches (an MLP 784-1024-1024-10 at batch 128).
#[path = "../benches/workloads.rs"]
mod workloads;

type Outcome<T> = Result<T, Box<dyn Error>>;

/// Device workspaces on a real GPU: cycles, a detach, a copy on a second stream,
/// pinned staging, and timed comparisons. Without a GPU it prints
/// `no CUDA device: <reason>` and exits 0.
#[derive(Parser)]
#[command(name = "cuda_smoke", verbatim_doc_comment, next_line_help = true)]
struct Args {
    /// Print one JSON object with the figures on the last line
    #[arg(long)]
    json: bool,
    /// Timed rounds per figure, of which medians are reported
    /// (1 to 1000)
    #[arg(long, value_name = "N", default_value_t = 15, verbatim_doc_comment,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..=1000))]
    rounds: usize,
}

/// Bytes per host-to-device transfer in the bandwidth comparison.
const TRANSFER: usize = 64 << 20;

fn check(condition: bool, what: &str) -> Outcome<()> {
    if condition {
        Ok(())
    } else {
        Err(format!("check failed: {what}").into())
    }
}

/// The median over `rounds` of the time per call of `f`, run `calls` times a round.
fn median_ns(rounds: usize, calls: usize, mut f: impl FnMut() -> Outcome<()>) -> Outcome<f64> {
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        for _ in 0..calls {
            f()?;
        }
        times.push(start.elapsed().as_nanos() as f64 / calls as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times.get(rounds / 2).copied().unwrap_or(f64::NAN))
}

/// Cycles, detach, a second stream and pinned staging, with their results checked.
fn smoke(gpu: &CudaDevice) -> Outcome<serde_json::Value> {
    let ws = DeviceWorkspace::new("SMOKE", WorkspaceConfig::default(), gpu, &gpu.default_stream())?;
    let sizes = workloads::training_sizes();
    for step in 0..100 {
        let scope = ws.enter()?;
        for (k, &n) in sizes.iter().enumerate() {
            let x = scope.zeros::<f32, _>(n)?;
            if step % 25 == 0 && k == 3 {
                check(x.to_host()?.sum() == 0.0, "zeros read back as zeros")?;
            }
        }
    }
    let stats = ws.stats();
    check(stats.cycles == 100 && stats.growth_events == 1, "the workspace learned its size once")?;

    let host = Array2::from_shape_fn((256, 512), |(i, j)| (i * 512 + j) as f32);
    let detached = {
        let scope = ws.enter()?;
        let x = scope.htod(&host)?;
        let mut y = scope.zeros::<f32, _>((256, 512))?;
        y.copy_from(&x)?;
        y.detach()?
    };
    {
        let scope = ws.enter()?; // overwrites the arena where `x` and `y` were
        scope.htod(&Array2::from_elem((256, 512), -1.0f32))?;
    }
    check(detached.to_host()? == host, "the detached array kept its values across the reset")?;

    let copy_stream = gpu.new_stream()?;
    let mut kept = DeviceArray::<_, f32>::zeros(gpu, &copy_stream, 1 << 20)?;
    {
        let mut kept_view = kept.view_mut();
        let scope = ws.enter()?;
        let x = scope.htod(&Array1::from_elem(1 << 20, 2.5f32))?;
        let on_copy = scope.on_stream(&copy_stream)?;
        on_copy.dtod(&x, &mut kept_view)?;
        on_copy.finish()?;
    }
    {
        let scope = ws.enter()?;
        scope.htod(&Array1::from_elem(1 << 20, 7.0f32))?; // reuses the memory the copy read
    }
    check(kept.to_host()?.iter().all(|&v| v == 2.5), "the copy stream read the data of its own cycle")?;

    let staging = PinnedWorkspace::for_transfers("STAGE", gpu, 1 << 20)?;
    for batch in 0..4u32 {
        let stage = staging.enter()?;
        let up = stage.filled::<u32, _>(1 << 16, batch)?;
        let scope = ws.enter()?;
        let on_device = scope.htod_pinned(&up)?;
        let mut down = stage.zeros::<u32, _>(1 << 16)?;
        on_device.dtoh_pinned(&mut down)?;
        check(down.view()?.iter().all(|&v| v == batch), "pinned staging round trip")?;
    }
    check(staging.stats().pinned_allocations == 1, "pinned staging allocated once")?;
    Ok(json!({
        "cycles": stats.cycles,
        "capacity": stats.capacity,
        "growth_events": stats.growth_events,
        "checks": "passed",
    }))
}

/// Allocation per call: the workspace against `cuMemAlloc`/`cuMemFree` and
/// `cuMemAllocAsync`/`cuMemFreeAsync`, over the training step's 19 sizes.
fn allocation(gpu: &CudaDevice, rounds: usize) -> Outcome<serde_json::Value> {
    let sizes = workloads::training_bytes();
    let stream = gpu.default_stream();
    let ws = DeviceWorkspace::new("ALLOC", WorkspaceConfig::default(), gpu, &stream)?;
    let workspace_cycle = || -> Outcome<()> {
        let scope = ws.enter()?;
        for &bytes in &sizes {
            let mut memory = scope.uninit::<u8, _>(bytes)?;
            black_box(memory.device_ptr_mut());
        }
        Ok(())
    };
    for _ in 0..3 {
        workspace_cycle()?; // learn the size first
    }
    let per = sizes.len() as f64;
    let workspace = median_ns(rounds, 1000, workspace_cycle)? / per;
    let malloc = median_ns(rounds, 10, || {
        for &bytes in &sizes {
            raw::malloc_free(gpu, bytes, 1)?;
        }
        Ok(())
    })? / per;
    let malloc_async = if gpu.supports_memory_pools() {
        Some(
            median_ns(rounds, 10, || {
                for &bytes in &sizes {
                    raw::malloc_free_async(gpu, &stream, bytes, 1)?;
                }
                gpu.synchronize(&stream)?;
                Ok(())
            })? / per,
        )
    } else {
        None
    };
    Ok(json!({
        "allocations_per_cycle": sizes.len(),
        "workspace_ns": workspace,
        "cuMemAlloc_ns": malloc,
        "cuMemAllocAsync_ns": malloc_async,
        "speedup_vs_cuMemAlloc": malloc / workspace,
        "speedup_vs_cuMemAllocAsync": malloc_async.map(|ns| ns / workspace),
    }))
}

/// Host-to-device bandwidth of `TRANSFER` bytes: pageable memory against pinned staging.
fn bandwidth(gpu: &CudaDevice, rounds: usize) -> Outcome<serde_json::Value> {
    let ws = DeviceWorkspace::new("BANDWIDTH", WorkspaceConfig::default(), gpu, &gpu.default_stream())?;
    let pageable: Vec<u8> = (0..TRANSFER).map(|i| (i % 251) as u8).collect();
    let staging = PinnedWorkspace::for_transfers("PINNED", gpu, TRANSFER)?;
    let stage = staging.enter()?;
    let pinned = stage.copy_of(&ArrayView1::from(&pageable[..]))?;
    let pageable_copy = || -> Outcome<()> {
        let scope = ws.enter()?;
        scope.htod(&ArrayView1::from(&pageable[..]))?;
        ws.synchronize()?;
        Ok(())
    };
    let pinned_copy = || -> Outcome<()> {
        let scope = ws.enter()?;
        scope.htod_pinned(&pinned)?;
        ws.synchronize()?;
        Ok(())
    };
    pageable_copy()?;
    pinned_copy()?;
    {
        let scope = ws.enter()?;
        let on_device = scope.htod_pinned(&pinned)?;
        let back = on_device.to_host()?;
        check(back.as_slice() == Some(&pageable[..]), "a pinned transfer arrived intact")?;
    }
    let gb_s = |ns: f64| TRANSFER as f64 / ns;
    let pageable_ns = median_ns(rounds, 3, pageable_copy)?;
    let pinned_ns = median_ns(rounds, 3, pinned_copy)?;
    Ok(json!({
        "bytes": TRANSFER,
        "pageable_gb_s": gb_s(pageable_ns),
        "pinned_gb_s": gb_s(pinned_ns),
        "pinned_over_pageable": pageable_ns / pinned_ns,
    }))
}

fn run(gpu: &CudaDevice, rounds: usize, json_out: bool) -> Outcome<()> {
    println!("device: {} ({})", gpu.name(), probe());
    let smoke = smoke(gpu)?;
    println!("smoke: {} cycles, capacity {} bytes, checks passed", smoke["cycles"], smoke["capacity"]);
    let alloc = allocation(gpu, rounds)?;
    let ns = |key: &str| alloc[key].as_f64().map_or("n/a".to_string(), |v| format!("{v:.1} ns"));
    println!("allocation per call ({} sizes of an MLP training step):", alloc["allocations_per_cycle"]);
    println!("  device workspace   {}", ns("workspace_ns"));
    println!(
        "  cuMemAlloc+Free    {}  ({:.0}x)",
        ns("cuMemAlloc_ns"),
        alloc["speedup_vs_cuMemAlloc"].as_f64().unwrap_or(f64::NAN)
    );
    println!("  cuMemAllocAsync    {}", ns("cuMemAllocAsync_ns"));
    let bw = bandwidth(gpu, rounds)?;
    println!(
        "host-to-device, {} MiB: pageable {:.1} GB/s, pinned {:.1} GB/s",
        TRANSFER >> 20,
        bw["pageable_gb_s"].as_f64().unwrap_or(f64::NAN),
        bw["pinned_gb_s"].as_f64().unwrap_or(f64::NAN)
    );
    if json_out {
        let report = json!({
            "cuda": true,
            "device": gpu.name(),
            "probe": probe().to_string(),
            "smoke": smoke,
            "allocation": alloc,
            "htod": bw,
        });
        println!("{report}");
    }
    Ok(())
}

fn main() -> ExitCode {
    let Args { json: json_out, rounds } = cli::parse();
    let gpu = match CudaDevice::new(0) {
        Ok(gpu) => gpu,
        Err(err) => {
            println!("{err}");
            if json_out {
                println!("{}", json!({ "cuda": false, "reason": err.to_string() }));
            }
            return ExitCode::SUCCESS;
        }
    };
    match run(&gpu, rounds, json_out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            println!("cuda_smoke failed: {err}");
            if json_out {
                println!("{}", json!({ "cuda": true, "error": err.to_string() }));
            }
            ExitCode::FAILURE
        }
    }
}
