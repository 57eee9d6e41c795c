//! 10,000 training iterations with workspaces enabled: flat workspace memory and no
//! heap allocation per iteration after warm-up, checked with carve's counting allocator
//! and allocation guard; with workspaces off the same loop allocates (proof that the
//! guard counts), and so does a custom layer that computes with an owned ndarray result,
//! which the guard's error names.

use carve::alloc_check::{assert_no_alloc, AllocationError, AllocationGuard, CountingAllocator};
use carve::freeze;
use carve::nn::{BackwardCtx, ForwardCtx, Layer, Network, NetworkConfig, RowsPass, Updater};
use carve::workspace_core::alloc_check::AllocationKind;
use carve::WorkspaceMode;
use carve_rng::Rng;
use ndarray::{s, Array1, Array2, ArrayView2, ArrayViewMut2, Axis};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

/// Scales iteration counts down under valgrind (`CARVE_SOAK_SCALE=10` divides by 10).
fn scaled(n: usize) -> usize {
    let scale: usize = std::env::var("CARVE_SOAK_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    (n / scale.max(1)).max(10)
}

fn data(rows: usize) -> (Array2<f32>, Array1<u32>) {
    let mut rng = Rng::new(3);
    let y: Array1<u32> = (0..rows).map(|i| (i % 4) as u32).collect();
    let x = Array2::from_shape_fn((rows, 12), |(i, j)| (y[i] as f32 - 1.5) * (j % 3) as f32 + rng.uniform(-0.3, 0.3));
    (x, y)
}

fn network(mode: WorkspaceMode) -> Network {
    let config = NetworkConfig::builder(12)
        .dense(24)
        .relu()
        .dense(16)
        .relu()
        .dense(4)
        .seed(9)
        .updater(Updater::adam(1e-3))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

#[test]
fn ten_thousand_iterations_allocate_nothing_and_stay_flat() {
    let (x, y) = data(100);
    let batches: Vec<(usize, usize)> = (0..100).step_by(16).map(|start| (start, (start + 16).min(100))).collect();
    let mut net = network(WorkspaceMode::Enabled);
    // Warm-up: three epochs, including the ragged last batch (4 rows); the
    // workspaces learn over their first 16 cycles.
    for _ in 0..3 {
        for &(a, b) in &batches {
            net.fit_batch(x.slice(s![a..b, ..]), y.slice(s![a..b])).unwrap();
        }
    }
    let capacity = net.workspace_capacity();
    assert!(capacity > 0);
    let iterations = scaled(10_000);
    let guard = AllocationGuard::begin().unwrap();
    let mut last_loss = f32::NAN;
    for i in 0..iterations {
        let (a, b) = batches[i % batches.len()];
        last_loss = net.fit_batch(x.slice(s![a..b, ..]), y.slice(s![a..b])).unwrap();
    }
    let report = guard.finish();
    assert!(report.is_none(), "in {iterations} steady-state iterations: {report}");
    assert_eq!(net.workspace_capacity(), capacity, "workspace memory grew after warm-up");
    assert!(last_loss.is_finite() && last_loss < 0.5, "the network did not learn: loss {last_loss}");
    // Evaluation with workspaces allocates nothing either, once its workspaces have
    // learned.
    for _ in 0..5 {
        net.evaluate(x.view(), y.view(), 32).unwrap();
    }
    let accuracy = assert_no_alloc(|| net.evaluate(x.view(), y.view(), 32)).unwrap();
    assert!(accuracy > 0.9, "accuracy {accuracy}");

    // The same loop without workspaces allocates every iteration.
    let mut off = network(WorkspaceMode::None);
    off.fit_batch(x.slice(s![0..16, ..]), y.slice(s![0..16])).unwrap();
    let guard = AllocationGuard::begin().unwrap();
    off.fit_batch(x.slice(s![0..16, ..]), y.slice(s![0..16])).unwrap();
    let report = guard.finish();
    assert!(report.allocations() >= 10, "WorkspaceMode::None should allocate per array: {report}");
}

/// A custom layer that centres its input on the batch's column means. `Owned` computes
/// the means with `sum_axis`, which returns an owned array: a heap allocation per step.
/// `InWorkspace` sums into working memory.
#[derive(Clone, Copy, PartialEq)]
enum Centre {
    Owned,
    InWorkspace,
}

impl Layer for Centre {
    fn name(&self) -> &str {
        "centre"
    }

    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }

    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        let rows = input.nrows() as f32;
        let mut out = ctx.activations.zeros::<f32, _>(input.raw_dim())?;
        out.assign(&input);
        if *self == Centre::Owned {
            let means = input.sum_axis(Axis(0)) / rows; // an owned array
            out -= &means;
        } else {
            let mut means = ctx.working.zeros::<f32, _>(input.ncols())?;
            for row in input.rows() {
                means += &row;
            }
            means /= rows;
            out -= &means;
        }
        Ok(freeze(out))
    }

    fn backward_rows(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        _ctx: &BackwardCtx<'_>,
    ) -> carve::Result<()> {
        let grad_output = pass.grad_output;
        if let Some(mut grad_input) = grad_input {
            grad_input.assign(&grad_output); // (the means' share of the gradient left out)
        }
        Ok(())
    }
}

fn network_with(layer: Centre) -> Network {
    let config = NetworkConfig::builder(12)
        .dense(16)
        .layer(layer)
        .relu()
        .dense(4)
        .seed(5)
        .training_workspace_mode(WorkspaceMode::Enabled)
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

#[test]
fn a_custom_layer_with_an_owned_ndarray_result_fails_the_check() {
    let (x, y) = data(32);
    let step = |net: &mut Network| net.fit_batch(x.view(), y.view()).unwrap();

    // Written against the workspace, the layer keeps the step allocation-free.
    let mut clean = network_with(Centre::InWorkspace);
    for _ in 0..3 {
        step(&mut clean);
    }
    let loss = assert_no_alloc(|| step(&mut clean));
    assert!(loss.is_finite());

    // With `sum_axis`, every step allocates the means (zeroed): 16 f32 columns.
    let mut owned = network_with(Centre::Owned);
    for _ in 0..3 {
        step(&mut owned);
    }
    let guard = AllocationGuard::begin().unwrap();
    for _ in 0..5 {
        step(&mut owned);
    }
    let report = guard.finish();
    assert_eq!(report.allocations(), 5, "{report}");
    assert_eq!(report.bytes(), 5 * 16 * 4);
    assert!(report.samples().iter().all(|s| (s.size, s.kind) == (64, AllocationKind::AllocZeroed)), "{report:?}");
    let error = carve::Error::from(report.check().unwrap_err());
    match error.as_workspace() {
        Some(carve::workspace_core::Error::AllocationCheck(AllocationError::HeapAllocation {
            allocations: 5,
            bytes: 320,
            ..
        })) => {}
        _ => panic!("wrong error: {error}"),
    }
    let message = error.to_string();
    assert!(message.starts_with("5 heap allocations (320 bytes) on this thread"), "{message}");
    assert!(message.contains("`sum_axis`"), "{message}");

    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| assert_no_alloc(|| step(&mut owned))));
    let payload = caught.expect_err("an allocating step must not pass");
    let message = payload.downcast_ref::<String>().expect("a formatted message");
    assert!(message.starts_with("1 heap allocation (64 bytes)"), "{message}");
}

/// A layer that passes its input on, or panics while its switch is on.
struct Trips(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Layer for Trips {
    fn name(&self) -> &str {
        "trips"
    }

    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }

    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        assert!(!self.0.load(std::sync::atomic::Ordering::Relaxed), "the layer tripped");
        let mut out = ctx.activations.zeros::<f32, _>(input.raw_dim())?;
        out.assign(&input);
        Ok(freeze(out))
    }

    fn backward_rows(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        _ctx: &BackwardCtx<'_>,
    ) -> carve::Result<()> {
        if let Some(mut grad_input) = grad_input {
            grad_input.assign(&pass.grad_output);
        }
        Ok(())
    }
}

/// Issue: a recorded iteration whose layer panicked (or whose recorder could not be
/// attached to every workspace) left the training workspaces recording into a trace no
/// one read: every later step appended its events, and allocated as the trace grew.
#[test]
fn a_recorded_step_that_panics_leaves_no_workspace_recording() {
    let (x, y) = data(32);
    let switch = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let config = NetworkConfig::builder(12)
        .dense(16)
        .layer(Trips(switch.clone()))
        .relu()
        .dense(4)
        .seed(5)
        .training_workspace_mode(WorkspaceMode::Enabled)
        .build()
        .unwrap();
    let mut net = Network::new(config).unwrap();
    for _ in 0..3 {
        net.fit_batch(x.view(), y.view()).unwrap();
    }
    net.record_next_iteration();
    switch.store(true, std::sync::atomic::Ordering::Relaxed);
    let tripped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| net.fit_batch(x.view(), y.view())));
    assert!(tripped.is_err(), "the layer panics");
    switch.store(false, std::sync::atomic::Ordering::Relaxed);
    assert!(net.recorded_iteration().is_none(), "nothing was recorded");
    for _ in 0..3 {
        net.fit_batch(x.view(), y.view()).unwrap();
    }
    // Enough steps that a trace still attached would have grown (and allocated).
    let steps = scaled(500); // (reading the scale allocates: outside the check)
    let guard = AllocationGuard::begin().unwrap();
    for _ in 0..steps {
        net.fit_batch(x.view(), y.view()).unwrap();
    }
    let report = guard.finish();
    assert!(report.is_none(), "steps after the panicked recording allocated: {report}");
    // Recording works again, and holds one step's events.
    net.record_next_iteration();
    net.fit_batch(x.view(), y.view()).unwrap();
    assert!(!net.recorded_iteration().expect("recorded").events().is_empty());
}
