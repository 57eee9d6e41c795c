//! The reference network: gradient checks against finite differences, Enabled vs
//! None equality, configuration and input errors, validation of misplaced outputs.

use carve::nn::{
    BackwardCtx, Dense, ForwardCtx, Layer, Network, NetworkConfig, Relu, Rng, SoftmaxCrossEntropy, Updater,
};
use carve::{freeze, ArrayType, Error, LayerWorkspaceMgr, Scope, WorkspaceMode};
use ndarray::{Array1, Array2, ArrayView2, ArrayViewMut2};

fn random(rows: usize, cols: usize, rng: &mut Rng) -> Array2<f32> {
    Array2::from_shape_fn((rows, cols), |_| rng.uniform(-1.0, 1.0))
}

/// `Σ y ⊙ r` for the layer's output `y` on input `x` (so that `∂/∂y = r`).
fn project(layer: &mut dyn Layer, x: &Array2<f32>, r: &Array2<f32>) -> f64 {
    let mgr = LayerWorkspaceMgr::no_workspaces();
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
    let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: true };
    let y = layer.forward(x.view(), &ctx).unwrap();
    y.iter().zip(r.iter()).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum()
}

/// Analytic gradients of `project` with respect to the input and the parameters.
fn analytic(layer: &mut dyn Layer, x: &Array2<f32>, r: &Array2<f32>) -> (Array2<f32>, Vec<Vec<f32>>) {
    let mgr = LayerWorkspaceMgr::no_workspaces();
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
    let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: true };
    let y = layer.forward(x.view(), &ctx).unwrap();
    let mut gx = Array2::<f32>::from_elem(x.raw_dim(), f32::NAN);
    let bp = mgr.enter(ArrayType::BpWorkingMem).unwrap();
    layer.backward(x.view(), y, r.view(), Some(gx.view_mut()), &BackwardCtx { working: &bp, mgr: &mgr }).unwrap();
    let mut grads = Vec::new();
    layer.params(&mut |p| grads.push(p.grad.to_vec()));
    (gx, grads)
}

fn close(numeric: f64, analytic: f32, what: &str) {
    let (n, a) = (numeric, f64::from(analytic));
    let scale = n.abs().max(a.abs()).max(1e-2);
    assert!((n - a).abs() / scale < 2e-2, "{what}: numeric {n} vs analytic {a}");
}

/// Adds `delta` to element `k` of parameter `p`.
fn nudge(layer: &mut dyn Layer, p: usize, k: usize, delta: f32) {
    let mut index = 0;
    layer.params(&mut |param| {
        if index == p {
            param.value[k] += delta;
        }
        index += 1;
    });
}

fn check_layer(layer: &mut dyn Layer, rows: usize, cols: usize, outs: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    // Inputs are kept away from 0, where ReLU's kink would make finite differences
    // straddle two slopes.
    let x = random(rows, cols, &mut rng).mapv(|v| if v.abs() < 0.05 { 0.5 } else { v });
    let r = random(rows, outs, &mut rng);
    let (gx, grads) = analytic(layer, &x, &r);
    let eps = 1e-2f32;
    for i in 0..rows {
        for j in 0..cols {
            let (mut plus, mut minus) = (x.clone(), x.clone());
            plus[[i, j]] += eps;
            minus[[i, j]] -= eps;
            let numeric = (project(layer, &plus, &r) - project(layer, &minus, &r)) / f64::from(2.0 * eps);
            close(numeric, gx[[i, j]], &format!("{} d/dx[{i},{j}]", layer.name()));
        }
    }
    for (p, grad) in grads.iter().enumerate() {
        for (k, &g) in grad.iter().enumerate() {
            nudge(layer, p, k, eps);
            let up = project(layer, &x, &r);
            nudge(layer, p, k, -2.0 * eps);
            let down = project(layer, &x, &r);
            nudge(layer, p, k, eps);
            close((up - down) / f64::from(2.0 * eps), g, &format!("{} d/dparam{p}[{k}]", layer.name()));
        }
    }
}

#[test]
fn dense_gradients_match_finite_differences() {
    let mut dense = Dense::new(5, 4);
    dense.init(&mut Rng::new(3));
    check_layer(&mut dense, 3, 5, 4, 11);
    assert_eq!(dense.param_count(), 24);
}

#[test]
fn relu_gradients_match_finite_differences() {
    check_layer(&mut Relu::new(), 4, 6, 6, 5);
}

#[test]
fn softmax_cross_entropy_gradient_matches_finite_differences() {
    let mut rng = Rng::new(9);
    let logits = random(4, 5, &mut rng) * 3.0;
    let labels = Array1::from(vec![0u32, 4, 2, 2]);
    let loss = SoftmaxCrossEntropy;
    let scope = Scope::heap();
    let value =
        |z: &Array2<f32>| f64::from(loss.loss(loss.probabilities(z.view(), &scope).unwrap(), labels.view()).unwrap());
    let probs = loss.probabilities(logits.view(), &scope).unwrap();
    for row in probs.rows() {
        assert!((row.sum() - 1.0).abs() < 1e-6);
    }
    let mut grad = Array2::<f32>::zeros((4, 5));
    loss.backward(probs, labels.view(), grad.view_mut()).unwrap();
    let eps = 1e-2f32;
    for i in 0..4 {
        for j in 0..5 {
            let (mut plus, mut minus) = (logits.clone(), logits.clone());
            plus[[i, j]] += eps;
            minus[[i, j]] -= eps;
            close((value(&plus) - value(&minus)) / f64::from(2.0 * eps), grad[[i, j]], &format!("dL/dz[{i},{j}]"));
        }
    }
    // Labels must be classes, one per row.
    let err = loss.loss(probs, Array1::from(vec![0u32, 5, 1, 1]).view()).unwrap_err();
    assert_eq!(err.to_string(), "label 5 is not a class: the network's output has 5 classes (0..5)");
    let err = loss.loss(probs, Array1::from(vec![0u32]).view()).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
}

/// A blob per class in 8 dimensions: easy to learn, deterministic.
fn blobs(n: usize, classes: usize, seed: u64) -> (Array2<f32>, Array1<u32>) {
    let mut rng = Rng::new(seed);
    let centres = random(classes, 8, &mut rng) * 3.0;
    let labels: Array1<u32> = (0..n).map(|i| (i % classes) as u32).collect();
    let x = Array2::from_shape_fn((n, 8), |(i, j)| centres[[labels[i] as usize, j]] + rng.uniform(-0.5, 0.5));
    (x, labels)
}

fn network(mode: WorkspaceMode, updater: Updater, seed: u64) -> Network {
    let config = NetworkConfig::builder(8)
        .dense(16)
        .relu()
        .dense(12)
        .relu()
        .dense(3)
        .seed(seed)
        .updater(updater)
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

/// Trains for a few epochs with a ragged last batch; returns every loss's bits and
/// the final predictions.
fn train(mode: WorkspaceMode, updater: Updater) -> (Vec<u32>, Vec<u32>, f64) {
    let (x, y) = blobs(90, 3, 1);
    let mut net = network(mode, updater, 42);
    let mut trace = Vec::new();
    for _ in 0..15 {
        for start in (0..90).step_by(16) {
            let end = (start + 16).min(90);
            let loss = net.fit_batch(x.slice(ndarray::s![start..end, ..]), y.slice(ndarray::s![start..end])).unwrap();
            trace.push(loss.to_bits());
        }
    }
    let mut predictions = vec![0u32; 90];
    net.predict_into(x.view(), &mut predictions).unwrap();
    let accuracy = net.evaluate(x.view(), y.view(), 7).unwrap();
    (trace, predictions, accuracy)
}

#[test]
fn workspaces_do_not_change_the_numbers() {
    for updater in [Updater::adam(1e-2), Updater::sgd(0.1, 0.9)] {
        let (trace_on, pred_on, acc_on) = train(WorkspaceMode::Enabled, updater);
        let (trace_off, pred_off, acc_off) = train(WorkspaceMode::None, updater);
        assert_eq!(trace_on, trace_off, "{updater:?}: loss traces differ");
        assert_eq!(pred_on, pred_off);
        assert_eq!(acc_on, acc_off);
        assert!(acc_on > 0.95, "{updater:?} learned too little: accuracy {acc_on}");
        let first = f32::from_bits(trace_on[0]);
        let last = f32::from_bits(*trace_on.last().unwrap());
        assert!(last < first * 0.2, "{updater:?}: loss {first} -> {last}");
    }
}

#[test]
fn training_uses_the_dl4j_workspaces_and_they_plateau() {
    let (x, y) = blobs(64, 3, 2);
    let mut net = network(WorkspaceMode::Enabled, Updater::adam(1e-2), 1);
    // Warm-up: the workspaces learn over their first 16 cycles (one iteration opens
    // the working memory 10 times), then hold the largest.
    for _ in 0..20 {
        net.fit_batch(x.view(), y.view()).unwrap();
    }
    let after_first = net.workspace_capacity();
    assert!(after_first > 0);
    for _ in 0..31 {
        net.fit_batch(x.view(), y.view()).unwrap();
    }
    assert_eq!(net.workspace_capacity(), after_first, "memory grows after warm-up");
    assert!(net.last_iteration_workspace_bytes() > 0);
    let mgr = net.training_mgr();
    assert_eq!(mgr.workspace_name(ArrayType::Activations), Some("WS_ALL_LAYERS_ACT"));
    assert_eq!(mgr.workspace_name(ArrayType::ActivationGrad), Some("WS_LAYER_ACT_GRAD_1"));
    assert_eq!(mgr.workspace_name(ArrayType::FfWorkingMem), Some("WS_LAYER_WORKING_MEM"));
    assert_eq!(mgr.workspace_name(ArrayType::UpdaterWorkingMem), Some("WS_UPDATER_WORKING_MEM"));
    let act = mgr.workspace(ArrayType::Activations).unwrap();
    assert_eq!(act.generation(), 51, "one activations cycle per iteration");
    let working = mgr.workspace(ArrayType::FfWorkingMem).unwrap();
    // 5 layers forward + 5 backward per iteration.
    assert_eq!(working.generation(), 51 * 10);
    let grad_a = mgr.workspace(ArrayType::ActivationGrad).unwrap();
    // Loss gradient + layers 4 and 2 and 0's inputs' gradients ... alternate: the
    // first workspace opens for the loss gradient and every second layer.
    assert_eq!(grad_a.generation(), 51 * 3);
    let none = network(WorkspaceMode::None, Updater::adam(1e-2), 1);
    assert_eq!(none.workspace_capacity(), 0);
}

#[test]
fn inference_can_write_into_a_callers_workspace() {
    let (x, y) = blobs(30, 3, 3);
    let mut net = network(WorkspaceMode::Enabled, Updater::adam(1e-2), 1);
    for _ in 0..30 {
        net.fit_batch(x.view(), y.view()).unwrap();
    }
    let owned = net.output(x.view()).unwrap();
    let ws = carve::Workspace::new("RESULTS", carve::WorkspaceConfig::default()).unwrap();
    let scope = ws.enter().unwrap();
    let placed = net.output_to(x.view(), &scope).unwrap();
    assert!(scope.holds(&placed));
    assert_eq!(placed, owned);
    for row in owned.rows() {
        assert!((row.sum() - 1.0).abs() < 1e-5);
    }
}

#[test]
fn bad_configurations_and_inputs_are_typed_errors() {
    let err = NetworkConfig::builder(8).build().unwrap_err();
    assert!(err.to_string().contains("at least one layer"), "{err}");
    let err = NetworkConfig::builder(0).dense(3).build().unwrap_err();
    assert!(err.to_string().contains("at least one input column"), "{err}");
    let err = NetworkConfig::builder(8).layer(Dense::new(7, 3)).build().unwrap_err();
    assert_eq!(err.to_string(), "layer 'dense' takes 7 inputs: expected shape [7], got [8]");
    let err = NetworkConfig::builder(8).dense(1).build().unwrap_err();
    assert!(err.to_string().contains("at least 2 classes"), "{err}");
    let err = NetworkConfig::builder(8).dense(3).updater(Updater::adam(f32::NAN)).build().unwrap_err();
    assert!(err.to_string().contains("learning rate NaN"), "{err}");

    let mut net = network(WorkspaceMode::Enabled, Updater::adam(1e-2), 1);
    let err = net.fit_batch(Array2::zeros((4, 7)).view(), Array1::zeros(4).view()).unwrap_err();
    assert_eq!(err.to_string(), "network input: expected shape [4, 8], got [4, 7]");
    let err = net.fit_batch(Array2::zeros((0, 8)).view(), Array1::zeros(0).view()).unwrap_err();
    assert!(err.to_string().contains("empty batch"), "{err}");
    let err = net.fit_batch(Array2::zeros((4, 8)).view(), Array1::zeros(3).view()).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    let err = net.fit_batch(Array2::zeros((2, 8)).view(), Array1::from(vec![0, 3]).view()).unwrap_err();
    assert!(err.to_string().contains("label 3 is not a class"), "{err}");
    let err = net.evaluate(Array2::zeros((2, 8)).view(), Array1::zeros(2).view(), 0).unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
    // The network is still usable after errors.
    let (x, y) = blobs(12, 3, 4);
    assert!(net.fit_batch(x.view(), y.view()).unwrap().is_finite());
}

/// A user layer with an inference shortcut: it hands its input back unchanged.
struct Shortcut;

impl Layer for Shortcut {
    fn name(&self) -> &str {
        "shortcut"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn forward<'a>(
        &mut self,
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        if ctx.training {
            Ok(freeze(ctx.activations.dup(&input)?))
        } else {
            Ok(input) // the bug: the caller's memory, not the activations workspace
        }
    }
    fn backward(
        &mut self,
        _input: ArrayView2<'_, f32>,
        _output: ArrayView2<'_, f32>,
        grad_output: ArrayView2<'_, f32>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        _ctx: &BackwardCtx<'_>,
    ) -> carve::Result<()> {
        if let Some(mut g) = grad_input {
            g.assign(&grad_output);
        }
        Ok(())
    }
}

#[test]
fn a_layer_returning_memory_from_the_wrong_place_fails_validation() {
    let config = NetworkConfig::builder(8).layer(Shortcut).dense(3).seed(1).build().unwrap();
    let mut net = Network::new(config).unwrap();
    let (x, y) = blobs(6, 3, 5);
    net.fit_batch(x.view(), y.view()).unwrap();
    let err = net.output(x.view()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "layer 'shortcut' produced Activations in memory outside this manager's workspaces (heap, an input, or \
         another workspace), but Activations must live in workspace 'WS_INFERENCE_ACT': allocate it from the \
         Activations scope the layer was given (`ctx.activations` for a forward output), or copy it there with \
         `TypedScope::dup` / `LayerWorkspaceMgr::leverage_to`"
    );
    // With workspaces off there is nothing to misplace.
    let config = NetworkConfig::builder(8)
        .layer(Shortcut)
        .dense(3)
        .inference_workspace_mode(WorkspaceMode::None)
        .build()
        .unwrap();
    let mut net = Network::new(config).unwrap();
    assert_eq!(net.output(x.view()).unwrap().shape(), &[6, 3]);
}
