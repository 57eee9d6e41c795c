//! What recording a timeline costs (`workspace_core::timeline`), on the digits demo's
//! MLP (64-128-64-10, Adam, batches of 32): the step time with the timeline on over
//! off (the same network, attached and detached in alternating blocks of steps, in a
//! rotating order), the time a snapshot takes after 10,000 iterations, and the bytes
//! the history holds after 1,000, 10,000 and 100,000 iterations (batches of 32, 24
//! and 16 rows in turn: three distinct iterations). A table, then one JSON line with
//! `--json`.
//!
//! Run: `cargo run --release --example timeline -- --json`

use std::time::Instant;

use carve::ndarray::{Array1, Array2};
use carve::workspace_core::timeline::Timeline;
use carve::WorkspaceMode;

#[path = "demo_networks.rs"]
mod demo_networks;

/// The digits MLP.
fn network(mode: WorkspaceMode) -> carve::Result<carve::nn::Network> {
    demo_networks::network(false, mode)
}

fn batch(rows: usize) -> (Array2<f32>, Array1<u32>) {
    let x = Array2::from_shape_fn((rows, 64), |(r, c)| ((r * 7 + c * 3) % 17) as f32 / 17.0);
    let y = Array1::from_shape_fn(rows, |r| (r % 10) as u32);
    (x, y)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let json = std::env::args().any(|a| a == "--json");
    let quick = std::env::args().any(|a| a == "--quick");
    let (rounds, block) = if quick { (6, 100) } else { (40, 250) };
    if let Some(steps) = std::env::args().skip_while(|a| a != "--profile").nth(1) {
        // For a profiler: only steps with the timeline on.
        let mut net = network(WorkspaceMode::Enabled)?;
        let (x, y) = batch(32);
        let timeline = Timeline::start()?;
        net.attach_timeline(&timeline)?;
        for _ in 0..steps.parse::<usize>()? {
            net.fit_batch(x.view(), y.view())?;
        }
        return Ok(());
    }
    let mut overhead = Vec::new();
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::Planned] {
        let mut net = network(mode)?;
        let (x, y) = batch(32);
        let timeline = Timeline::start()?;
        for _ in 0..200 {
            net.fit_batch(x.view(), y.view())?;
        }
        // Per round, a block of steps each way (in a rotating order); the ratio of the
        // medians of the blocks' mean step times.
        let (mut on, mut off) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            for recording in [round % 2 == 0, round % 2 == 1] {
                match recording {
                    true => net.attach_timeline(&timeline)?,
                    false => net.detach_timeline(&timeline)?,
                }
                net.fit_batch(x.view(), y.view())?; // the first step after a switch
                let start = Instant::now();
                for _ in 0..block {
                    net.fit_batch(x.view(), y.view())?;
                }
                let step_us = start.elapsed().as_secs_f64() * 1e6 / block as f64;
                match recording {
                    true => on.push(step_us),
                    false => off.push(step_us),
                }
            }
        }
        let (on, off) = (median(on), median(off));
        let snapshot = timeline.snapshot();
        println!(
            "{:<8} step {off:6.2} µs off, {on:6.2} µs on: on/off {:.4} ({} iterations recorded, {} distinct)",
            mode.name(),
            on / off,
            snapshot.iterations_recorded(),
            snapshot.scripts().len()
        );
        overhead.push(serde_json::json!({
            "mode": mode.name(),
            "step_us_off": off,
            "step_us_on": on,
            "iter_time_ratio_timeline_over_off": on / off,
        }));
    }

    // The history over a long run: three distinct iterations in turn.
    let mut net = network(WorkspaceMode::Enabled)?;
    let batches = [batch(32), batch(24), batch(16)];
    let timeline = Timeline::start()?;
    net.attach_timeline(&timeline)?;
    let checkpoints: &[u64] = if quick { &[1_000, 10_000] } else { &[1_000, 10_000, 100_000] };
    let mut history = Vec::new();
    let mut snapshot_us = None;
    let mut done = 0u64;
    for &at in checkpoints {
        while done < at {
            let (x, y) = &batches[(done % 3) as usize];
            net.fit_batch(x.view(), y.view())?;
            done += 1;
        }
        let bytes = timeline.history_bytes();
        println!("after {at:>7} iterations: history {bytes} bytes");
        history.push(serde_json::json!({ "iterations": at, "history_bytes": bytes }));
        if at == 10_000 {
            let times: Vec<f64> = (0..21)
                .map(|_| {
                    let start = Instant::now();
                    let snapshot = timeline.snapshot();
                    let us = start.elapsed().as_secs_f64() * 1e6;
                    assert_eq!(snapshot.iterations_recorded(), at);
                    us
                })
                .collect();
            let us = median(times);
            println!("snapshot after {at} iterations: {us:.1} µs (median of 21)");
            snapshot_us = Some(us);
        }
    }
    let snapshot = timeline.snapshot();
    let flat = history.windows(2).all(|w| w[0]["history_bytes"] == w[1]["history_bytes"]);
    println!(
        "{} distinct iterations stored, {} events recorded; history flat: {flat}",
        snapshot.scripts().len(),
        snapshot.events()
    );
    if json {
        let object = serde_json::json!({
            "overhead": overhead,
            "snapshot_us_after_10000": snapshot_us,
            "history": history,
            "history_flat": flat,
            "scripts": snapshot.scripts().len(),
            "events": snapshot.events(),
        });
        println!("{}", serde_json::to_string(&object)?);
    }
    Ok(())
}
