//! A network recorded by a timeline (`Network::attach_timeline`): its allocations
//! labelled by role and layer, a steady step recorded with no heap allocation in every
//! workspace mode, the history flat, the exported trace read back, and a detached
//! network recorded no more.

use carve::alloc_check::{AllocationGuard, CountingAllocator};
use carve::nn::{Input, Network, NetworkConfig, Updater};
use carve::workspace_core::timeline::{EventKind, Timeline};
use carve::{ArrayType, WorkspaceMode};
use ndarray::{Array1, Array2, Array3};
use serde_json::Value;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

fn mlp(mode: WorkspaceMode) -> Network {
    let config = NetworkConfig::builder(12)
        .dense(32)
        .relu()
        .dense(4)
        .seed(3)
        .updater(Updater::adam(1e-3))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

fn data(rows: usize) -> (Array2<f32>, Array1<u32>) {
    let x = Array2::from_shape_fn((rows, 12), |(r, c)| ((r * 5 + c) % 7) as f32 / 7.0);
    let y = Array1::from_shape_fn(rows, |r| (r % 4) as u32);
    (x, y)
}

#[test]
fn a_recorded_step_is_labelled_by_role_and_layer_and_repeats_one_script() {
    let mut net = mlp(WorkspaceMode::Enabled);
    let timeline = Timeline::start().unwrap();
    net.attach_timeline(&timeline).unwrap();
    let (x, y) = data(16);
    for _ in 0..20 {
        net.fit_batch(x.view(), y.view()).unwrap();
    }
    let snapshot = timeline.snapshot();
    assert_eq!(snapshot.iterations_recorded(), 20);
    // The first steps learn the arenas' sizes; the steady steps repeat one script.
    let last = snapshot.records().last().unwrap().script.unwrap();
    assert!(snapshot.scripts()[last as usize].iterations >= 15, "{:?}", snapshot.scripts());
    let events = snapshot.script_events(last);
    let allocs: Vec<(Option<ArrayType>, Option<String>)> = events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Alloc { .. }))
        .map(|e| (e.role, e.layer.as_deref().map(str::to_string)))
        .collect();
    let names: Vec<String> = net.layers().iter().map(|l| l.name().to_string()).collect();
    let has = |role: ArrayType, layer: &str| allocs.contains(&(Some(role), Some(layer.to_string())));
    assert!(has(ArrayType::Activations, "input"), "{allocs:?}");
    for name in &names {
        assert!(has(ArrayType::Activations, name), "{name}: {allocs:?}");
    }
    // Dense layers' scratch, both passes; the loss's gradient; the updater's scratch
    // (Adam's, if it takes any) is the updater's.
    assert!(has(ArrayType::FfWorkingMem, &names[0]) || has(ArrayType::BpWorkingMem, &names[0]), "{allocs:?}");
    assert!(has(ArrayType::ActivationGrad, "loss"), "{allocs:?}");
    assert!(allocs.iter().all(|(role, layer)| role.is_some() && layer.is_some()), "{allocs:?}");
    // The lower bound of the steady step is what the step's plan is measured against.
    assert!(snapshot.scripts()[last as usize].lower_bound > 0);
}

#[test]
fn a_steady_recorded_step_makes_no_heap_allocation_in_any_mode() {
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None] {
        let mut net = mlp(mode);
        let timeline = Timeline::start().unwrap();
        net.attach_timeline(&timeline).unwrap();
        let (x, y) = data(16);
        for _ in 0..10 {
            net.fit_batch(x.view(), y.view()).unwrap();
        }
        if mode == WorkspaceMode::None {
            // Every array is its own heap allocation: nothing to record.
            assert_eq!(timeline.snapshot().events(), 0);
            continue;
        }
        let guard = AllocationGuard::begin().unwrap();
        for _ in 0..5 {
            net.fit_batch(x.view(), y.view()).unwrap();
        }
        let report = guard.finish();
        assert!(report.is_none(), "{mode:?}: {report:?}");
        assert_eq!(timeline.iterations(), 15);
    }
}

#[test]
fn sequences_of_several_lengths_are_scripts_stored_once_and_the_history_stays_flat() {
    let config = NetworkConfig::builder(3)
        .lstm(8)
        .last_step()
        .dense(3)
        .seed(2)
        .training_workspace_mode(WorkspaceMode::Enabled)
        .build()
        .unwrap();
    let mut net = Network::new(config).unwrap();
    let timeline = Timeline::start().unwrap();
    net.attach_timeline(&timeline).unwrap();
    let batch = |steps: usize| {
        let x = Array3::from_shape_fn((4, steps, 3), |(b, t, f)| ((b + t * f) % 5) as f32 / 5.0);
        (x, Array1::from_shape_fn(4, |b| (b % 3) as u32))
    };
    let batches = [batch(5), batch(9), batch(7)];
    let mut bytes = Vec::new();
    for i in 0..300 {
        let (x, y) = &batches[i % 3];
        net.fit_batch(Input::Sequences { features: x.view(), mask: None }, y.view()).unwrap();
        if i == 99 || i == 299 {
            bytes.push(timeline.history_bytes());
        }
    }
    assert_eq!(bytes[0], bytes[1]);
    let snapshot = timeline.snapshot();
    // Three lengths, plus the first steps that learned the arenas.
    assert!((3..=6).contains(&snapshot.scripts().len()), "{:?}", snapshot.scripts());
    let counted: u64 = snapshot.scripts().iter().map(|s| s.iterations).sum();
    assert_eq!(counted, 300);
    // A longer sequence has more events (a frame per step).
    let events_of = |i: usize| snapshot.records()[i].events;
    assert!(events_of(297) < events_of(298) && events_of(299) < events_of(298));
}

#[test]
fn an_exported_network_trace_reads_back_and_a_detached_network_is_recorded_no_more() {
    let mut net = mlp(WorkspaceMode::Planned);
    let timeline = Timeline::start().unwrap();
    net.attach_timeline(&timeline).unwrap();
    let (x, y) = data(16);
    for _ in 0..6 {
        net.fit_batch(x.view(), y.view()).unwrap();
    }
    net.output(x.view()).unwrap();
    net.detach_timeline(&timeline).unwrap();
    for _ in 0..4 {
        net.fit_batch(x.view(), y.view()).unwrap();
    }
    let snapshot = timeline.snapshot();
    assert_eq!(snapshot.iterations_recorded(), 7, "six steps and an inference");
    let mut bytes = Vec::new();
    let summary = snapshot.write_chrome_trace(&mut bytes).unwrap();
    let trace: Value = serde_json::from_slice(&bytes).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let slices: Vec<&Value> = events.iter().filter(|e| e["cat"] == "alloc").collect();
    assert_eq!(slices.len(), summary.slices);
    let recorded: usize = snapshot
        .records()
        .iter()
        .map(|r| {
            snapshot
                .script_events(r.script.unwrap())
                .iter()
                .filter(|e| matches!(e.kind, EventKind::Alloc { .. }))
                .count()
        })
        .sum();
    assert_eq!(slices.len(), recorded);
    // The inference's slices are in the inference workspace, labelled.
    let inference: Vec<&&Value> = slices.iter().filter(|e| e["args"]["iteration"] == 6).collect();
    assert!(!inference.is_empty());
    assert!(inference.iter().all(|e| e["args"]["layer"].is_string()), "{inference:?}");
    let first = net.layers()[0].name().to_string();
    assert!(
        inference.iter().any(|e| e["args"]["layer"] == first.as_str()
            && e["args"]["role"] == "Activations"
            && e["args"]["workspace"] == carve::nn::workspaces::names::INFERENCE_ACT),
        "{inference:?}"
    );
    assert!(inference.iter().all(|e| ["Activations", "FfWorkingMem"].contains(&e["args"]["role"].as_str().unwrap())));
}

#[test]
fn a_network_sharing_the_workspaces_of_an_attached_one_ends_its_own_iterations() {
    // Two networks of one mode on a thread share the thread's workspaces by name.
    let (mut attached, mut other) = (mlp(WorkspaceMode::Enabled), mlp(WorkspaceMode::Enabled));
    let timeline = Timeline::start().unwrap();
    attached.attach_timeline(&timeline).unwrap();
    let (x, y) = data(16);
    let (x8, y8) = data(8);
    for _ in 0..6 {
        attached.fit_batch(x.view(), y.view()).unwrap();
        other.fit_batch(x8.view(), y8.view()).unwrap();
    }
    // Each step of either is an iteration; the other's are unlabelled, not folded into
    // the attached network's.
    assert_eq!(timeline.iterations(), 12);
    let snapshot = timeline.snapshot();
    let steady: Vec<u32> = snapshot.records().iter().skip(6).map(|r| r.script.unwrap()).collect();
    assert_eq!(steady[0], steady[2], "{steady:?}");
    assert_eq!(steady[1], steady[3], "{steady:?}");
    assert_ne!(steady[0], steady[1], "{steady:?}");
}
