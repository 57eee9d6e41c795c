//! Planned device bytes against per-role device bytes for the demo networks' training
//! step shapes, on a device plan group (issue 27).
//!
//! Each network trains one recorded step on the host (`Network::record_next_iteration`),
//! its role workspaces in `WorkspaceMode::Enabled` (one bump arena per role) or
//! `WorkspaceMode::Planned` (frames release each layer's update, the activations close
//! before the update). The recorded events
//! (every allocation with its size, and every close of a role workspace's cycle or
//! frame) are then replayed on device workspaces, one per role workspace, members of a
//! `DevicePlanGroup`: the first replay is recorded by the group, the next ones run on
//! its plan. Every allocation is zero-filled on its stream, so the device does the
//! work a step's allocations would ask of it. Twice: with every role on one stream, and
//! with the roles spread over two streams (the group then orders each reuse across
//! streams by events; `cross_stream_waits` counts the waits).
//!
//! Prints a table, then one JSON line (`--json`) with, per network and layout: the
//! group's `plan_bytes`, `lower_bound_bytes` and `per_role_bytes` on the device (every
//! allocation a multiple of 256 bytes there), the same figures of the host's plan of
//! the same trace (64-byte units), `planned_iterations`, `divergences`, `streams` and
//! `cross_stream_waits`. The device is the simulated one unless `--gpu` is given (GPU 0;
//! the bytes are the same on both, the device's allocations being aligned alike).
//!
//! Run: `cargo run --release --example device_plan -- --json`

use std::collections::BTreeMap;

use carve::nn::{Network, Updater};
use carve::workspace_core::plan::{Event, Plan, Trace, FRAME_LEVEL_SHIFT};
use carve::workspace_core::{LearningPolicy, SpillPolicy, WorkspaceConfig};
use carve::WorkspaceMode;
use clap::Parser;
use workspace_cuda::device::sim::SimDevice;
use workspace_cuda::{CudaDevice, Device, DeviceFrame, DevicePlanGroup, DeviceScope, DeviceWorkspace};

mod workloads;

#[derive(Parser, Debug)]
#[command(about = "Planned against per-role device bytes for the demo networks' training steps")]
struct Args {
    /// Print one JSON line after the table.
    #[arg(long)]
    json: bool,
    /// Planned iterations per network and layout.
    #[arg(long, default_value_t = 3)]
    iterations: u32,
    /// Run on GPU 0 instead of the simulated device.
    #[arg(long)]
    gpu: bool,
}

/// The recorded events of one training step of an MLP of `widths` at `batch`, its role
/// workspaces in `mode`.
fn recorded_step(widths: &[usize], batch: usize, mode: WorkspaceMode) -> Trace {
    let config = workloads::mlp(widths)
        .seed(7)
        .updater(Updater::adam(1e-3))
        .training_workspace_mode(mode)
        .build()
        .expect("a valid network");
    let mut net = Network::new(config).expect("a network");
    let (x, y) = workloads::mlp_batch(widths, batch);
    net.fit_batch(x.view(), y.view()).expect("a warm-up step");
    net.record_next_iteration();
    net.fit_batch(x.view(), y.view()).expect("a recorded step");
    net.recorded_iteration().expect("a recorded iteration").clone()
}

/// The open scope of a member and its open frames by level.
struct Open<D: Device> {
    frames: BTreeMap<u32, DeviceFrame<'static, D>>,
    scope: Box<DeviceScope<'static, D>>,
}

/// Replays `events` on `members` (`index` maps a recorded cycle owner to its member) as
/// one iteration: each allocation zero-filled in its member's scope or frame, each close
/// closing it.
fn replay<D: Device>(events: &[Event], index: &BTreeMap<u64, usize>, members: &[DeviceWorkspace<D>]) {
    let mut open: Vec<Option<Open<D>>> = members.iter().map(|_| None).collect();
    let split = |owner: u64| (index[&(owner & ((1 << FRAME_LEVEL_SHIFT) - 1))], (owner >> FRAME_LEVEL_SHIFT) as u32);
    for &event in events {
        match event {
            Event::Alloc { owner, bytes, .. } => {
                let (m, level) = split(owner);
                let state = open[m].get_or_insert_with(|| {
                    let scope = members[m].enter().expect("a member opens");
                    // SAFETY: the members outlive this function, which drops every scope
                    // (after its frames) before it returns.
                    let scope: DeviceScope<'static, D> = unsafe { std::mem::transmute(scope) };
                    Open { frames: BTreeMap::new(), scope: Box::new(scope) }
                });
                if level == 0 {
                    let _ = state.scope.zeros::<u8, _>(bytes).expect("an allocation");
                    continue;
                }
                while !state.frames.contains_key(&level) {
                    // SAFETY: the boxed scope stays where it is until its frames, kept
                    // next to it, have been dropped.
                    let scope: &'static DeviceScope<'static, D> =
                        unsafe { &*(&*state.scope as *const DeviceScope<'static, D>) };
                    let frame = scope.frame().expect("a frame opens");
                    state.frames.insert(frame.level(), frame);
                }
                let _ = state.frames[&level].zeros::<u8, _>(bytes).expect("an allocation");
            }
            Event::Close { owner } => {
                let (m, level) = split(owner);
                match (level, open[m].as_mut()) {
                    (0, Some(_)) => {
                        let state = open[m].take().expect("open");
                        drop(state.frames);
                        drop(state.scope);
                    }
                    (level, Some(state)) => drop(state.frames.remove(&level)),
                    (_, None) => {}
                }
            }
        }
    }
    for state in open.into_iter().flatten() {
        drop(state.frames);
        drop(state.scope);
    }
}

/// The figures of one network on one layout.
fn run<D: Device>(
    device: &D,
    name: &str,
    recorded_in: &str,
    trace: &Trace,
    streams: usize,
    iterations: u32,
) -> serde_json::Value {
    let members_config =
        WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build().expect("config");
    let mut lanes = vec![device.default_stream()];
    while lanes.len() < streams {
        lanes.push(device.new_stream().expect("a stream"));
    }
    let group = DevicePlanGroup::new("STEP", device, &lanes[0]).expect("a group");
    let mut index = BTreeMap::new();
    for event in trace.events() {
        let (Event::Alloc { owner, .. } | Event::Close { owner }) = *event;
        let cycle = owner & ((1 << FRAME_LEVEL_SHIFT) - 1);
        let next = index.len();
        index.entry(cycle).or_insert(next);
    }
    let members: Vec<DeviceWorkspace<D>> = (0..index.len())
        .map(|i| group.workspace(&format!("ROLE{i}"), &members_config, &lanes[i % streams]).expect("a member"))
        .collect();
    for _ in 0..=iterations {
        group.start_iteration(0).expect("an iteration starts");
        replay(trace.events(), &index, &members);
        group.finish_iteration().expect("an iteration ends");
    }
    for lane in &lanes {
        device.synchronize(lane).expect("the device finished");
    }
    let stats = group.stats();
    let host = Plan::new(trace).stats("host");
    // The alternative: one device workspace per role, learning its size (what
    // `WorkspaceMode::Enabled` gives each role), on the same streams.
    let unplanned: Vec<DeviceWorkspace<D>> = (0..index.len())
        .map(|i| {
            DeviceWorkspace::new(&format!("ROLE{i}"), WorkspaceConfig::default(), device, &lanes[i % streams])
                .expect("a workspace")
        })
        .collect();
    for _ in 0..=iterations {
        replay(trace.events(), &index, &unplanned);
    }
    let unplanned_bytes: usize = unplanned.iter().map(|ws| ws.capacity()).sum();
    serde_json::json!({
        "network": name,
        "recorded_in": recorded_in,
        "streams": group.streams(),
        "roles": members.len(),
        "allocations": stats.allocations,
        "plan_bytes": stats.plan_bytes,
        "lower_bound_bytes": stats.lower_bound_bytes,
        "per_role_bytes": stats.per_role_bytes,
        "per_role_workspaces_bytes": unplanned_bytes,
        "plan_to_per_role": stats.plan_bytes as f64 / stats.per_role_bytes.max(1) as f64,
        "plan_to_bound": stats.plan_to_bound,
        "host_plan_bytes": host.plan_bytes,
        "host_lower_bound_bytes": host.lower_bound_bytes,
        "host_per_role_bytes": host.per_role_bytes,
        "planned_iterations": stats.planned_iterations,
        "divergences": stats.divergences,
        "cross_stream_waits": group.cross_stream_waits(),
    })
}

fn main() {
    let args = Args::parse();
    let mut rows = Vec::new();
    let gpu = match args.gpu {
        true => match CudaDevice::new(0) {
            Ok(gpu) => Some(gpu),
            Err(err) => {
                eprintln!("device_plan --gpu: {err}");
                std::process::exit(2);
            }
        },
        false => None,
    };
    let sim = SimDevice::new().expect("a simulated device");
    let device_name = gpu.as_ref().map_or_else(|| sim.describe(), |gpu| gpu.describe());
    for (name, widths, batch) in workloads::PLANNED_NETWORKS {
        for (recorded_in, mode) in [("planned", WorkspaceMode::Planned)] {
            let trace = recorded_step(widths, batch, mode);
            for streams in [1, 2] {
                let row = match &gpu {
                    Some(gpu) => run(gpu, name, recorded_in, &trace, streams, args.iterations),
                    None => run(&sim, name, recorded_in, &trace, streams, args.iterations),
                };
                rows.push(row);
            }
        }
    }
    println!("device: {device_name}");
    println!(
        "{:<30} {:>7} {:>10} {:>10} {:>11} {:>9} {:>13} {:>11} {:>7} {:>4} {:>5}",
        "network",
        "streams",
        "plan B",
        "bound B",
        "per-role B",
        "plan/role",
        "role arenas B",
        "host plan B",
        "planned",
        "div",
        "waits"
    );
    for row in &rows {
        let cell = |key: &str| row[key].to_string();
        println!(
            "{:<30} {:>7} {:>10} {:>10} {:>11} {:>9.3} {:>13} {:>11} {:>7} {:>4} {:>5}",
            row["network"].as_str().unwrap_or(""),
            cell("streams"),
            cell("plan_bytes"),
            cell("lower_bound_bytes"),
            cell("per_role_bytes"),
            row["plan_to_per_role"].as_f64().unwrap_or(0.0),
            cell("per_role_workspaces_bytes"),
            cell("host_plan_bytes"),
            cell("planned_iterations"),
            cell("divergences"),
            cell("cross_stream_waits"),
        );
    }
    if args.json {
        println!("{}", serde_json::json!({ "device": device_name, "rows": rows }));
    }
}
