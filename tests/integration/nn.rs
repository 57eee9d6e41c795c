//! The reference network: gradient checks against finite differences, Enabled vs
//! None equality, configuration and input errors, validation of misplaced outputs.

use carve::nn::{
    Activations, BackwardCtx, Dense, ForwardCtx, GradInput, Layer, Network, NetworkConfig, ParamShape, Pass, Relu,
    RowsPass, SoftmaxCrossEntropy, Tape, UninitGradInput, Updater,
};
use carve_rng::Rng;

use crate::standalone::Standalone;
use carve::{freeze, ArrayType, Error, LayerWorkspaceMgr, Scope, WorkspaceMode};
use ndarray::{Array1, Array2, ArrayView2, ArrayViewMut2};

fn random(rows: usize, cols: usize, rng: &mut Rng) -> Array2<f32> {
    Array2::from_shape_fn((rows, cols), |_| rng.uniform(-1.0, 1.0))
}

/// `Σ y ⊙ r` for the layer's output `y` on input `x` (so that `∂/∂y = r`).
fn project(layer: &mut Standalone, x: &Array2<f32>, r: &Array2<f32>) -> f64 {
    let mgr = LayerWorkspaceMgr::no_workspaces();
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
    let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: true };
    let y = layer.forward(Activations::Flat(x.view()), None, &ctx).unwrap().flat("y").unwrap();
    y.iter().zip(r.iter()).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum()
}

/// Analytic gradients of `project` with respect to the input and the parameters.
pub(crate) fn analytic(layer: &mut Standalone, x: &Array2<f32>, r: &Array2<f32>) -> (Array2<f32>, Vec<Vec<f32>>) {
    let mgr = LayerWorkspaceMgr::no_workspaces();
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
    let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: true };
    let y = layer.forward(Activations::Flat(x.view()), None, &ctx).unwrap();
    let mut gx = Array2::<f32>::from_elem(x.raw_dim(), f32::NAN);
    let bp = mgr.enter(ArrayType::BpWorkingMem).unwrap();
    let pass =
        Pass { input: Activations::Flat(x.view()), mask: None, output: y, grad_output: Activations::Flat(r.view()) };
    layer.backward(pass, Some(GradInput::Flat(gx.view_mut())), &BackwardCtx { working: &bp, mgr: &mgr }).unwrap();
    (gx, layer.param_grads())
}

fn close(numeric: f64, analytic: f32, what: &str) {
    let (n, a) = (numeric, f64::from(analytic));
    let scale = n.abs().max(a.abs()).max(1e-2);
    assert!((n - a).abs() / scale < 2e-2, "{what}: numeric {n} vs analytic {a}");
}

pub(crate) fn check_layer(layer: &mut Standalone, rows: usize, cols: usize, outs: usize, seed: u64) {
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
            layer.nudge(p, k, eps);
            let up = project(layer, &x, &r);
            layer.nudge(p, k, -2.0 * eps);
            let down = project(layer, &x, &r);
            layer.nudge(p, k, eps);
            close((up - down) / f64::from(2.0 * eps), g, &format!("{} d/dparam{p}[{k}]", layer.name()));
        }
    }
}

#[test]
fn dense_gradients_match_finite_differences() {
    let mut dense = Standalone::new(Dense::new(5, 4), 5, 3);
    check_layer(&mut dense, 3, 5, 4, 11);
    assert_eq!(dense.layer.param_shapes(5).iter().map(ParamShape::len).sum::<usize>(), 24);
}

#[test]
fn relu_gradients_match_finite_differences() {
    check_layer(&mut Standalone::new(Relu::new(), 6, 0), 4, 6, 6, 5);
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
    // The updater's other constants: each a typed error at build, not a refused step.
    let adam = |beta1: f32, beta2: f32, epsilon: f32| Updater::Adam { learning_rate: 1e-3, beta1, beta2, epsilon };
    for (updater, says) in [
        (Updater::sgd(0.1, f32::NAN), "momentum NaN"),
        (Updater::sgd(0.1, 1.0), "momentum 1"),
        (Updater::sgd(0.1, -0.5), "momentum -0.5"),
        (adam(f32::NAN, 0.999, 1e-8), "beta1 NaN"),
        (adam(0.9, 1.0, 1e-8), "beta2 1"),
        (adam(0.9, 0.999, 0.0), "epsilon 0"),
        (adam(0.9, 0.999, f32::INFINITY), "epsilon inf"),
    ] {
        let err = NetworkConfig::builder(8).dense(3).updater(updater).build().unwrap_err();
        assert!(matches!(&err, Error::InvalidConfig { reason } if reason.contains(says)), "{updater:?}: {err}");
    }
    assert!(NetworkConfig::builder(8).dense(3).updater(Updater::sgd(0.1, 0.0)).build().is_ok());

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
    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        if ctx.training {
            Ok(freeze(ctx.activations.copy_of(&input)?))
        } else {
            Ok(input) // the bug: the caller's memory, not the activations workspace
        }
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
        if let Some(mut g) = grad_input {
            g.assign(&grad_output);
        }
        Ok(())
    }
}

#[test]
fn token_ids_fed_to_a_network_whose_first_layer_reads_features_are_an_error_naming_it() {
    use carve::nn::parallel::{DataParallel, ParallelConfig};
    use carve::nn::Input;
    let ids = Array2::<u32>::zeros((2, 3));
    let labels = Array2::<u32>::zeros((2, 3));
    for (config, first) in [
        (NetworkConfig::builder(6).layer(Shortcut).dense(3), "shortcut"),
        (NetworkConfig::builder(6).dense(4).relu().dense(3), "dense"),
    ] {
        let says = |err: carve::Error| match err {
            Error::InvalidInput(m) => assert!(m.contains(first) && m.contains("does not read them"), "{m}"),
            other => panic!("{first}: {other:?}"),
        };
        let mut net = Network::new(config.build().unwrap()).unwrap();
        says(net.fit_batch(Input::tokens(ids.view()), carve::nn::Labels::from(labels.view())).unwrap_err());
        says(net.output(Input::tokens(ids.view())).unwrap_err());
        says(net.freeze().unwrap().output(Input::tokens(ids.view())).unwrap_err());
        let mut trainer = DataParallel::new(net, ParallelConfig::sequential(2)).unwrap();
        says(trainer.fit_batch(Input::tokens(ids.view()), carve::nn::Labels::from(labels.view())).unwrap_err());
        // The network is as it was: features train it.
        let x = Array2::from_shape_fn((12, 6), |(r, c)| (r * 6 + c) as f32 * 0.05 - 1.0);
        let y: Array1<u32> = (0..12).map(|i| i % 3).collect();
        assert!(trainer.fit_batch(x.view(), y.view()).unwrap().is_finite(), "{first}");
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
         `TypedScope::copy_of` (`TypedScope::leverage` copies only what does not live there already: a layer that \
         passes its input on returns `ctx.activations.leverage(x)?`)"
    );
    // With workspaces off the same mistake is refused too (it was accepted, so that code
    // that ran with workspaces off failed once they were on): the mode changes where
    // memory comes from, not which calls succeed.
    let config = NetworkConfig::builder(8)
        .layer(Shortcut)
        .dense(3)
        .inference_workspace_mode(WorkspaceMode::None)
        .build()
        .unwrap();
    let mut net = Network::new(config).unwrap();
    let off = net.output(x.view()).unwrap_err();
    assert!(matches!(&off, Error::Workspace(carve::workspace_core::Error::WrongLocation { .. })), "{off}");
    assert_eq!(
        off.to_string(),
        err.to_string().replace("workspace 'WS_INFERENCE_ACT'", "workspace 'WS_INFERENCE_ACT (heap)'")
    );
}

#[test]
fn dense_gradients_match_finite_differences_beyond_a_micro_tile() {
    // 17 × 40 → 33 reaches a full micro-tile of every blocked kernel (8×32, 16×16,
    // 6×16) in all three products (forward; dW = xᵀ·dy; dx = dy·Wᵀ), with ragged edges.
    let mut dense = Standalone::new(Dense::new(40, 33), 40, 21);
    check_layer(&mut dense, 17, 40, 33, 23);
}

/// `classes` blobs in `dims` dimensions.
fn wide_blobs(n: usize, dims: usize, classes: usize, seed: u64) -> (Array2<f32>, Array1<u32>) {
    let mut rng = Rng::new(seed);
    let centres = random(classes, dims, &mut rng) * 2.0;
    let labels: Array1<u32> = (0..n).map(|i| (i % classes) as u32).collect();
    let x = Array2::from_shape_fn((n, dims), |(i, j)| centres[[labels[i] as usize, j]] + rng.uniform(-1.0, 1.0));
    (x, labels)
}

/// Trains a 40-48-33-5 network in batches of 17 (the last one ragged); returns every
/// loss's bits and the final predictions.
fn train_wide(mode: WorkspaceMode) -> (Vec<u32>, Vec<u32>) {
    let (x, y) = wide_blobs(100, 40, 5, 6);
    let config = NetworkConfig::builder(40)
        .dense(48)
        .relu()
        .dense(33)
        .relu()
        .dense(5)
        .seed(17)
        .updater(Updater::adam(3e-3))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    let mut net = Network::new(config).unwrap();
    let mut trace = Vec::new();
    for _ in 0..6 {
        for start in (0..100).step_by(17) {
            let end = (start + 17).min(100);
            let loss = net.fit_batch(x.slice(ndarray::s![start..end, ..]), y.slice(ndarray::s![start..end])).unwrap();
            trace.push(loss.to_bits());
        }
    }
    let mut predictions = vec![0u32; 100];
    net.predict_into(x.view(), &mut predictions).unwrap();
    (trace, predictions)
}

#[test]
fn workspaces_do_not_change_the_numbers_at_blocked_kernel_shapes() {
    let (trace_on, pred_on) = train_wide(WorkspaceMode::Enabled);
    let (trace_off, pred_off) = train_wide(WorkspaceMode::None);
    assert_eq!(trace_on.len(), 36);
    assert_eq!(trace_on, trace_off, "loss traces differ");
    assert_eq!(pred_on, pred_off, "predictions differ");
    let (first, last) = (f32::from_bits(trace_on[0]), f32::from_bits(*trace_on.last().unwrap()));
    assert!(last < first * 0.5, "the network did not learn: loss {first} -> {last}");
}

#[test]
fn relus_are_numbered_like_the_dense_layers() {
    let net = network(WorkspaceMode::None, Updater::adam(1e-2), 1);
    let names: Vec<&str> = net.layers().iter().map(|l| l.name()).collect();
    assert_eq!(names, ["dense_0", "relu_1", "dense_2", "relu_3", "dense_4"]);
    assert_eq!(Relu::new().name(), "relu");
}

#[test]
fn relu_rejects_an_input_gradient_of_another_shape() {
    let relu = Relu::named("relu_7");
    let mgr = LayerWorkspaceMgr::no_workspaces();
    let bp = mgr.enter(ArrayType::BpWorkingMem).unwrap();
    let ctx = BackwardCtx { working: &bp, mgr: &mgr };
    let (x, y, dy) = (Array2::<f32>::ones((3, 4)), Array2::<f32>::ones((3, 4)), Array2::<f32>::ones((3, 4)));
    let mut dx = Array2::<f32>::zeros((3, 5));
    let pass = RowsPass { input: x.view(), output: y.view(), grad_output: dy.view() };
    let err = relu.backward_rows(&[], &mut [], pass, Some(dx.view_mut()), &ctx).unwrap_err();
    assert_eq!(err.to_string(), "layer 'relu_7' input gradient: expected shape [3, 4], got [3, 5]");
    let mut dx = Array2::<f32>::zeros((3, 4));
    relu.backward_rows(&[], &mut [], pass, Some(dx.view_mut()), &ctx).unwrap();
    assert_eq!(dx, dy);
}

#[test]
fn layer_sizes_that_cannot_be_built_are_configuration_errors() {
    let err = NetworkConfig::builder(8).dense(usize::MAX).build().unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err:?}");
    assert!(err.to_string().contains("dense layer 'dense_0' of 8 × 18446744073709551615 weights overflows"), "{err}");
    // Fits in usize, but not in the address space as bytes.
    let err = NetworkConfig::builder(1).dense(usize::MAX / 4).dense(3).build().unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err:?}");
    assert!(matches!(Dense::try_new(3, usize::MAX), Err(Error::InvalidConfig { .. })));
    assert!(Dense::try_new(3, 4).is_ok());

    // A zero-width hidden layer is caught by build(), not by the first fit.
    let err = NetworkConfig::builder(8).dense(0).relu().dense(3).build().unwrap_err();
    let Error::InvalidConfig { reason } = err else { panic!("{err:?}") };
    assert_eq!(
        reason,
        "layer 'dense_0' (layer 0 of the network) produces 0 columns; every layer needs at least one output column"
    );
    let err = NetworkConfig::builder(8).dense(4).relu().dense(0).relu().dense(3).build().unwrap_err();
    assert!(err.to_string().contains("layer 'dense_2' (layer 2 of the network) produces 0 columns"), "{err}");
}

/// Where [`Misplacing`] puts its output.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Output {
    /// In the activations workspace, as it must.
    Activations,
    /// Its own input, unchanged.
    Input,
    /// A heap array (leaked, so that it outlives the call).
    Heap,
}

/// The heap outputs of [`Misplacing`], which live until the process ends.
static HEAP_OUTPUTS: std::sync::Mutex<Vec<&'static Array2<f32>>> = std::sync::Mutex::new(Vec::new());

/// A user layer (the identity) whose output placement the test switches.
struct Misplacing {
    name: &'static str,
    output: Switch<Output>,
}

impl Layer for Misplacing {
    fn name(&self) -> &str {
        self.name
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
        match self.output.get() {
            Output::Activations => Ok(freeze(ctx.activations.copy_of(&input)?)),
            Output::Input => Ok(input),
            Output::Heap => {
                let leaked: &'static Array2<f32> = Box::leak(Box::new(input.to_owned()));
                // Kept reachable, so that memory checkers see a deliberate leak, not a lost block.
                HEAP_OUTPUTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(leaked);
                Ok(leaked.view())
            }
        }
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
        if let Some(mut g) = grad_input {
            g.assign(&grad_output);
        }
        Ok(())
    }
}

/// 8 → `first` → dense(6) → relu → `second` → dense(3).
fn misplacing_network(first: &Misplacing, second: &Misplacing) -> Network {
    let layer = |m: &Misplacing| Misplacing { name: m.name, output: m.output.clone() };
    let config = NetworkConfig::builder(8)
        .layer(layer(first))
        .dense(6)
        .relu()
        .layer(layer(second))
        .dense(3)
        .seed(4)
        .updater(Updater::adam(1e-2))
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

#[test]
fn a_layer_misplacing_its_output_in_training_fails_and_the_network_stays_usable() {
    let place = |name| Misplacing { name, output: Switch::new(Output::Activations) };
    let (first, second) = (place("first_identity"), place("second_identity"));
    let mut net = misplacing_network(&first, &second);
    // A twin that never fails: the reference for "usable afterwards".
    let mut twin = misplacing_network(&place("first_identity"), &place("second_identity"));
    let (x, y) = blobs(12, 3, 8);
    assert_eq!(net.fit_batch(x.view(), y.view()).unwrap(), twin.fit_batch(x.view(), y.view()).unwrap());

    for (layer, output) in [(&first, Output::Input), (&second, Output::Heap), (&first, Output::Heap)] {
        let before = net.output(x.view()).unwrap();
        layer.output.set(output);
        let err = net.fit_batch(x.view(), y.view()).unwrap_err();
        match &err {
            Error::Workspace(carve::workspace_core::Error::WrongLocation {
                layer: named,
                array_type,
                expected,
                ..
            }) => {
                assert_eq!(named, layer.name, "{output:?}");
                assert_eq!(*array_type, ArrayType::Activations);
                assert!(expected.contains("WS_ALL_LAYERS_ACT"), "{expected}");
            }
            other => panic!("{output:?}: expected WrongLocation, got {other:?}"),
        }
        assert!(err.to_string().starts_with(&format!("layer '{}' produced Activations in ", layer.name)), "{err}");
        layer.output.set(Output::Activations);
        // Nothing was updated, no iteration counted, and training goes on as if the
        // failed call had not happened.
        assert_eq!(net.iterations(), 1);
        assert_eq!(net.output(x.view()).unwrap(), before);
    }
    for _ in 0..3 {
        assert_eq!(net.fit_batch(x.view(), y.view()).unwrap(), twin.fit_batch(x.view(), y.view()).unwrap());
    }
    assert_eq!(net.output(x.view()).unwrap(), twin.output(x.view()).unwrap());
    assert_eq!(net.iterations(), 4);
}

/// Every parameter value of the network, as bits, layer by layer.
fn param_bits(net: &mut Network) -> Vec<Vec<u32>> {
    (0..net.layers().len()).map(|i| net.layer_params(i).iter().map(|v| v.to_bits()).collect()).collect()
}

/// Sets every value of parameter `param` of layer `layer` to `value`.
fn set_param(net: &mut Network, layer: usize, param: usize, value: f32) {
    let shapes = net.param_shapes(layer).to_vec();
    let start: usize = shapes[..param].iter().map(ParamShape::len).sum();
    net.layer_params_mut(layer)[start..start + shapes[param].len()].fill(value);
}

/// A setting a test switches while a layer of a network holds it (layers are `Send +
/// Sync`).
struct Switch<T>(std::sync::Arc<std::sync::Mutex<T>>);

impl<T> Clone for Switch<T> {
    fn clone(&self) -> Self {
        Switch(std::sync::Arc::clone(&self.0))
    }
}

impl<T: Copy> Switch<T> {
    fn new(value: T) -> Self {
        Switch(std::sync::Arc::new(std::sync::Mutex::new(value)))
    }
    fn get(&self) -> T {
        *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
    fn set(&self, value: T) {
        *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = value;
    }
}

/// Where [`Tainting`] puts a NaN.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Taint {
    None,
    /// Element [0, 1] of its output is +inf.
    Output,
    /// Element [1, 0] of its input gradient is NaN.
    InputGradient,
    /// Element 2 of its bias gradient is NaN.
    ParamGradient,
}

/// A user layer adding a bias per column (starting at 0.1), which can taint what it
/// computes.
struct Tainting {
    taint: Switch<Taint>,
}

impl Layer for Tainting {
    fn name(&self) -> &str {
        "taint"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn param_shapes(&self, inputs: usize) -> Vec<ParamShape> {
        vec![ParamShape::new("bias", &[inputs])]
    }
    fn init(&self, _inputs: usize, params: &mut [f32], _init: &mut carve::nn::Init<'_>) {
        params.fill(0.1);
    }
    fn forward_rows<'a>(
        &self,
        params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        let bias = params;
        let mut out = ctx.activations.from_shape_fn(input.raw_dim(), |(i, j)| input[[i, j]] + bias[j])?;
        if self.taint.get() == Taint::Output {
            out[[0, 1]] = f32::INFINITY;
        }
        Ok(freeze(out))
    }
    fn backward_rows(
        &self,
        _params: &[f32],
        grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        _ctx: &BackwardCtx<'_>,
    ) -> carve::Result<()> {
        let grad_output = pass.grad_output;
        grads.fill(0.0);
        for row in grad_output.rows() {
            grads.iter_mut().zip(row).for_each(|(g, &d)| *g += d);
        }
        if self.taint.get() == Taint::ParamGradient {
            grads[2] = f32::NAN;
        }
        if let Some(mut g) = grad_input {
            g.assign(&grad_output);
            if self.taint.get() == Taint::InputGradient {
                g[[1, 0]] = f32::NAN;
            }
        }
        Ok(())
    }
}

fn tainting_network(mode: WorkspaceMode, updater: Updater, taint: &Switch<Taint>) -> Network {
    let tainting = Tainting { taint: taint.clone() };
    let config = NetworkConfig::builder(8)
        .dense(16)
        .layer(tainting)
        .relu()
        .dense(12)
        .relu()
        .dense(3)
        .seed(7)
        .updater(updater)
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

/// `fit_batch` on `x` must fail with `NonFinite` at `layer`, with a message that
/// contains `what`, and leave every parameter as it was.
fn refused(net: &mut Network, x: ArrayView2<'_, f32>, y: ndarray::ArrayView1<'_, u32>, layer: &str, what: &str) {
    let before = param_bits(net);
    let iterations = net.iterations();
    let err = net.fit_batch(x, y).expect_err("a non-finite step is an error");
    let Error::NonFinite { layer: at, what: said } = &err else { panic!("not a NonFinite error: {err:?}") };
    assert_eq!(at, layer, "{err}");
    assert!(said.contains(what), "'{what}' not in: {err}");
    assert!(err.to_string().contains(&format!("'{layer}'")), "{err}");
    assert!(err.to_string().contains("before any parameter or updater state changed"), "{err}");
    assert!(param_bits(net) == before, "{layer}: parameters changed by a refused step ({err})");
    assert_eq!(net.iterations(), iterations);
}

#[test]
fn a_non_finite_step_is_an_error_naming_the_layer_and_changes_nothing() {
    let taint = Switch::new(Taint::None);
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::None] {
        for updater in [Updater::adam(1e-2), Updater::sgd(0.1, 0.9)] {
            let (x, y) = blobs(32, 3, 6);
            let (good, labels) = (x.slice(ndarray::s![..16, ..]), y.slice(ndarray::s![..16]));
            let (next, next_labels) = (x.slice(ndarray::s![16.., ..]), y.slice(ndarray::s![16..]));
            // `twin` never sees a bad batch: after the refused steps both must go on
            // bit for bit alike, which they do only if no parameter, moment or step
            // count of the updater moved.
            let mut net = tainting_network(mode, updater, &taint);
            let mut twin = tainting_network(mode, updater, &taint);
            assert_eq!(net.fit_batch(good, labels).unwrap().to_bits(), twin.fit_batch(good, labels).unwrap().to_bits());

            let mut nan = good.to_owned();
            nan[[3, 5]] = f32::NAN;
            refused(&mut net, nan.view(), labels, "input", "the batch (row 3, column 5) is NaN");
            let mut inf = good.to_owned();
            inf[[0, 0]] = f32::NEG_INFINITY;
            refused(&mut net, inf.view(), labels, "input", "the batch (row 0, column 0) is -inf");

            for (case, layer, what) in [
                (Taint::Output, "taint", "output (row 0, column 1) is inf"),
                (Taint::InputGradient, "taint", "gradient of its input (row 1, column 0) is NaN"),
                (Taint::ParamGradient, "taint", "gradient of its parameter 0 (element 2) is NaN"),
            ] {
                taint.set(case);
                refused(&mut net, good, labels, layer, what);
                taint.set(Taint::None);
            }

            // A NaN weight in a hidden layer: the ReLU after it would map the NaN to 0
            // and the loss would look fine.
            let saved = param_bits(&mut net);
            set_param(&mut net, 3, 0, f32::NAN);
            let poisoned = param_bits(&mut net);
            let err = net.fit_batch(good, labels).unwrap_err();
            assert!(matches!(&err, Error::NonFinite { layer, .. } if layer == "dense_3"), "{err}");
            assert!(param_bits(&mut net) == poisoned, "the refused step changed parameters");
            net.layer_params_mut(3).iter_mut().zip(&saved[3]).for_each(|(v, &bits)| *v = f32::from_bits(bits));
            assert!(param_bits(&mut net) == saved);

            // fit_iter stops at the bad batch, after the good one before it was applied.
            let mut iter_net = tainting_network(mode, updater, &taint);
            let err = iter_net.fit_iter([(good, labels), (nan.view(), labels), (next, next_labels)]).unwrap_err();
            assert!(matches!(&err, Error::NonFinite { layer, .. } if layer == "input"), "{err}");
            assert_eq!(iter_net.iterations(), 1);
            assert!(param_bits(&mut iter_net) == param_bits(&mut twin), "fit_iter: only the good batch counted");

            // Training goes on with the next good batch exactly as if the bad ones had
            // never been offered.
            for _ in 0..3 {
                let a = net.fit_batch(next, next_labels).unwrap();
                let b = twin.fit_batch(next, next_labels).unwrap();
                assert_eq!(a.to_bits(), b.to_bits(), "{mode:?} {updater:?}");
                assert!(a.is_finite());
            }
            assert!(param_bits(&mut net) == param_bits(&mut twin), "{mode:?} {updater:?}");
            assert_eq!(net.iterations(), 4);
        }
    }
}

/// Finite inputs whose products overflow f32: the logits of the last layer become
/// +inf, softmax turns them into NaN, and the clamped loss alone would look finite.
#[test]
fn an_overflow_in_the_forward_pass_or_the_loss_is_an_error_and_changes_nothing() {
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::None] {
        let config = NetworkConfig::builder(2)
            .dense(2)
            .updater(Updater::sgd(0.1, 0.0))
            .training_workspace_mode(mode)
            .build()
            .unwrap();
        let mut net = Network::new(config).unwrap();
        set_param(&mut net, 0, 0, 1.0);
        let x = ndarray::arr2(&[[f32::MAX, f32::MAX], [1.0, -1.0]]);
        let y = ndarray::arr1(&[0u32, 1]);
        refused(&mut net, x.view(), y.view(), "dense_0", "output (row 0, column 0) is inf");
        // The same overflow at the last layer of a deeper network.
        let mut deep = network(mode, Updater::adam(1e-2), 3);
        let (x, y) = blobs(8, 3, 2);
        set_param(&mut deep, 4, 0, f32::MAX);
        refused(&mut deep, x.view(), y.view(), "dense_4", "is inf");
    }
}

/// Finite gradients whose square overflows f32 would leave Adam's second moment at
/// +inf for good (that parameter would never move again): refused like a NaN.
#[test]
fn an_updater_state_that_would_overflow_is_an_error_and_changes_nothing() {
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::None] {
        let config = NetworkConfig::builder(2)
            .dense(2)
            .updater(Updater::adam(1e-2))
            .training_workspace_mode(mode)
            .build()
            .unwrap();
        let mut net = Network::new(config).unwrap();
        set_param(&mut net, 0, 0, 1e-30);
        let x = ndarray::arr2(&[[1e30f32, 1e30], [1e30, 1e30]]);
        let y = ndarray::arr1(&[0u32, 0]);
        refused(&mut net, x.view(), y.view(), "dense_0", "second moment");
        let ok = ndarray::arr2(&[[1.0f32, 2.0], [-1.0, 0.5]]);
        assert!(net.fit_batch(ok.view(), y.view()).unwrap().is_finite());
    }
}

#[test]
fn fit_over_a_prefetcher_stops_at_a_non_finite_batch() {
    use carve::async_iter::{InMemory, Prefetcher};
    let (mut x, y) = blobs(48, 3, 8);
    x[[20, 1]] = f32::NAN; // in the second batch of 16
    let mut net = network(WorkspaceMode::Enabled, Updater::adam(1e-2), 4);
    let mut twin = network(WorkspaceMode::Enabled, Updater::adam(1e-2), 4);
    let mut batches = Prefetcher::builder(InMemory::new(x.clone(), y.clone(), 16).unwrap()).build().unwrap();
    let err = net.fit(&mut batches).unwrap_err();
    assert!(
        matches!(&err, Error::NonFinite { layer, what } if layer == "input" && what.contains("row 4, column 1")),
        "{err}"
    );
    twin.fit_batch(x.slice(ndarray::s![..16, ..]), y.slice(ndarray::s![..16])).unwrap();
    assert_eq!(net.iterations(), 1);
    assert!(param_bits(&mut net) == param_bits(&mut twin), "only the first batch was applied");
    // The rest of the epoch trains on.
    let rest = net.fit(&mut batches).unwrap();
    assert!(rest.is_finite());
    assert_eq!(net.iterations(), 2);
}

#[test]
fn a_recorded_iteration_gives_a_memory_plan_and_the_same_numbers() {
    let (x, y) = blobs(64, 3, 9);
    let mut plain = network(WorkspaceMode::Enabled, Updater::adam(1e-2), 2);
    let mut recorded = network(WorkspaceMode::Enabled, Updater::adam(1e-2), 2);
    assert!(recorded.memory_plan().is_none());
    for i in 0..6 {
        if i == 3 {
            recorded.record_next_iteration();
        }
        let a = plain.fit_batch(x.view(), y.view()).unwrap();
        let b = recorded.fit_batch(x.view(), y.view()).unwrap();
        assert_eq!(a.to_bits(), b.to_bits(), "iteration {i}: recording only observes");
    }
    let plan = recorded.memory_plan().expect("a plan of the recorded iteration");
    assert!(plan.allocations > 10, "{plan:?}");
    assert!(plan.lower_bound_bytes <= plan.plan_bytes && plan.plan_bytes <= plan.per_role_bytes, "{plan:?}");
    assert!(plan.plan_bytes < plan.per_role_bytes, "roles peak at different moments: {plan:?}");
    // With workspaces off there is nothing to plan.
    let mut none = network(WorkspaceMode::None, Updater::adam(1e-2), 2);
    none.record_next_iteration();
    none.fit_batch(x.view(), y.view()).unwrap();
    assert!(none.memory_plan().is_none());
}

#[test]
#[ignore = "a tool: prints the digits network's recorded iteration"]
fn dump_digits_trace() {
    let config = NetworkConfig::builder(64).dense(128).relu().dense(64).relu().dense(10).seed(0).build().unwrap();
    let mut net = Network::new(config).unwrap();
    let x = Array2::<f32>::zeros((32, 64));
    let y = Array1::<u32>::zeros(32);
    net.fit_batch(x.view(), y.view()).unwrap();
    net.record_next_iteration();
    net.fit_batch(x.view(), y.view()).unwrap();
    println!("{:?}", net.recorded_iteration().unwrap().events());
    println!("{:?}", net.memory_plan());
}

/// What [`Handing`] gives back from `backward_uninit`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum HandBack {
    /// The array it was handed, written.
    Same,
    /// Another array (leaked, so that it outlives the call).
    Other,
    /// The array it was handed, written, in another layout.
    Transposed,
}

/// The addresses of the arrays [`Handing`] handed back instead of its own, which live
/// until the process ends.
static HANDED_BACK: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

/// A user layer (the identity) implementing `Layer::backward_uninit`, whose answer the
/// test switches.
struct Handing {
    hand_back: Switch<HandBack>,
}

impl Layer for Handing {
    fn name(&self) -> &str {
        "handing"
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
        Ok(freeze(ctx.activations.copy_of(&input)?))
    }
    fn backward_rows(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        _ctx: &BackwardCtx<'_>,
    ) -> carve::Result<()> {
        if let Some(mut g) = grad_input {
            g.assign(&pass.grad_output);
        }
        Ok(())
    }
    fn backward_uninit<'g>(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: UninitGradInput<'g>,
        _tape: &mut Tape,
        _ctx: &BackwardCtx<'_>,
    ) -> carve::Result<GradInput<'g>> {
        let UninitGradInput::Flat(mut g) = grad_input else { panic!("a flat batch") };
        let dy = pass.grad_output.flat("handing")?;
        ndarray::Zip::from(&mut g).and(&dy).for_each(|g, &d| {
            g.write(d);
        });
        // SAFETY: every element was just written.
        let written = unsafe { g.assume_init() };
        Ok(GradInput::Flat(match self.hand_back.get() {
            HandBack::Same => written,
            HandBack::Transposed => written.reversed_axes(),
            HandBack::Other => {
                let leaked: &'static mut Array2<f32> = Box::leak(Box::new(dy.to_owned()));
                // Kept reachable, so that memory checkers see a deliberate leak, not a
                // lost block.
                HANDED_BACK
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(std::ptr::from_mut(leaked) as usize);
                leaked.view_mut()
            }
        }))
    }
}

#[test]
fn a_layer_handing_back_another_array_as_its_input_gradient_fails_with_an_error_and_the_network_stays_usable() {
    let network = |hand_back: &Switch<HandBack>| {
        // Its input 12 wide, as the batch is long: the transposed gradient keeps its
        // shape and only its layout tells it apart.
        let config = NetworkConfig::builder(8)
            .dense(12)
            .layer(Handing { hand_back: hand_back.clone() })
            .dense(3)
            .seed(4)
            .updater(Updater::adam(1e-2))
            .build()
            .unwrap();
        Network::new(config).unwrap()
    };
    let (switch, same) = (Switch::new(HandBack::Same), Switch::new(HandBack::Same));
    let (mut net, mut twin) = (network(&switch), network(&same));
    let (x, y) = blobs(12, 3, 8);
    // Handing back the array it was handed, written: the bits of the default path's
    // (a twin whose identity layer is a plain copy through `backward`).
    let plain = NetworkConfig::builder(8)
        .dense(12)
        .layer(Misplacing { name: "handing", output: Switch::new(Output::Activations) })
        .dense(3)
        .seed(4)
        .updater(Updater::adam(1e-2))
        .build()
        .unwrap();
    let mut plain = Network::new(plain).unwrap();
    let first = net.fit_batch(x.view(), y.view()).unwrap();
    assert_eq!(first.to_bits(), twin.fit_batch(x.view(), y.view()).unwrap().to_bits());
    assert_eq!(first.to_bits(), plain.fit_batch(x.view(), y.view()).unwrap().to_bits());
    for hand_back in [HandBack::Other, HandBack::Transposed] {
        switch.set(hand_back);
        let err = net.fit_batch(x.view(), y.view()).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidInput(m) if m.contains("layer 'handing'") && m.contains("another array")),
            "{hand_back:?}: {err}"
        );
    }
    // Usable afterwards: a refused step changes nothing (the twin took one step fewer
    // each time, none).
    switch.set(HandBack::Same);
    assert_eq!(
        net.fit_batch(x.view(), y.view()).unwrap().to_bits(),
        twin.fit_batch(x.view(), y.view()).unwrap().to_bits()
    );
}

/// `y = x ⊙ s`, its gradient summed into `grads` (`+=`, PyTorch's way) when `adds`, or
/// written element by element.
struct Scale {
    adds: bool,
}

impl Layer for Scale {
    fn name(&self) -> &str {
        "scale"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn param_shapes(&self, inputs: usize) -> Vec<ParamShape> {
        vec![ParamShape::new("weight", &[inputs])]
    }
    fn init(&self, _inputs: usize, params: &mut [f32], _init: &mut carve::nn::Init<'_>) {
        params.fill(1.0);
    }
    fn forward_rows<'a>(
        &self,
        params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        let mut out = ctx.activations.copy_of(&input)?;
        for mut row in out.rows_mut() {
            row.iter_mut().zip(params).for_each(|(y, &s)| *y *= s);
        }
        Ok(freeze(out))
    }
    fn backward_rows(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        _ctx: &BackwardCtx<'_>,
    ) -> carve::Result<()> {
        if !self.adds {
            grads.fill(0.0);
        }
        for (x, g) in pass.input.rows().into_iter().zip(pass.grad_output.rows()) {
            grads.iter_mut().zip(x).zip(g).for_each(|((acc, &x), &g)| *acc += x * g);
        }
        if let Some(mut grad_input) = grad_input {
            for (mut gi, g) in grad_input.rows_mut().into_iter().zip(pass.grad_output.rows()) {
                gi.iter_mut().zip(g).zip(params).for_each(|((gi, &g), &s)| *gi = g * s);
            }
        }
        Ok(())
    }
}

#[test]
fn a_custom_layer_that_adds_into_its_gradients_gets_them_zeroed_each_step() {
    // A backward pass that sums into `grads` (as PyTorch's autograd accumulates) must
    // give the gradients of one that writes them: each step's alone, not the sum of
    // every step so far.
    let net = |adds: bool| {
        let config = NetworkConfig::builder(6).dense(5).layer(Scale { adds }).relu().dense(3).seed(4).build().unwrap();
        Network::new(config).unwrap()
    };
    let (mut adding, mut writing) = (net(true), net(false));
    let mut rng = Rng::new(2);
    for step in 0..4 {
        let x = Array2::from_shape_fn((8, 6), |_| rng.next_f32() - 0.5);
        let y = Array1::from_shape_fn(8, |i| ((i + step) % 3) as u32);
        let (a, w) = (adding.fit_batch(x.view(), y.view()).unwrap(), writing.fit_batch(x.view(), y.view()).unwrap());
        assert_eq!(a.to_bits(), w.to_bits(), "step {step}: the losses");
        assert_eq!(adding.layer_grads(1), writing.layer_grads(1), "step {step}: the scale's gradients");
        assert_eq!(adding.params(), writing.params(), "step {step}: the parameters");
    }
}

/// Declares `declared` outputs, gives the first `gives` columns of its input (of its
/// first `rows` rows when set).
struct Misshapen {
    declared: usize,
    gives: usize,
    rows: Option<usize>,
}

impl Layer for Misshapen {
    fn name(&self) -> &str {
        "misshapen"
    }
    fn output_size(&self, _inputs: usize) -> carve::Result<usize> {
        Ok(self.declared)
    }
    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        let rows = self.rows.unwrap_or(input.nrows());
        Ok(freeze(ctx.activations.copy_of(&input.slice(ndarray::s![..rows, ..self.gives]))?))
    }
}

#[test]
fn a_layer_whose_output_is_not_the_shape_it_declared_is_named_itself() {
    // Before, the layer after it was blamed (a dense layer's input), or the caller's
    // buffer, or nothing at all (a ReLU takes any width).
    let x = Array2::from_elem((5, 6), 0.5f32);
    for (layer, after_relu) in [
        (Misshapen { declared: 6, gives: 4, rows: None }, false),
        (Misshapen { declared: 6, gives: 4, rows: None }, true),
        (Misshapen { declared: 6, gives: 6, rows: Some(3) }, false),
    ] {
        let mut b = NetworkConfig::builder(6).layer(layer);
        if after_relu {
            b = b.relu();
        }
        let mut net = Network::new(b.dense(3).build().unwrap()).unwrap();
        for result in [net.output(x.view()).map(drop), net.fit_batch(x.view(), Array1::zeros(5).view()).map(drop)] {
            match result {
                Err(Error::ShapeMismatch { context, expected, .. }) => {
                    assert!(context.contains("layer 'misshapen' output"), "{context}");
                    assert_eq!(expected, vec![5, 6]);
                }
                other => panic!("{other:?}"),
            }
        }
    }
}

/// An elementwise layer that says it is rebuilt in the backward pass and yet keeps a
/// tape.
struct RebuiltWithTape;

impl Layer for RebuiltWithTape {
    fn name(&self) -> &str {
        "rebuilt_with_tape"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn tape(&self) -> Tape {
        Tape::new(0usize)
    }
    fn rebuilt_in_backward(&self) -> bool {
        true
    }
    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        Ok(freeze(ctx.activations.copy_of(&input)?))
    }
}

#[test]
fn a_layer_rebuilt_in_backward_that_keeps_a_tape_is_refused_when_built() {
    // Its second forward pass would overwrite what the first left for its backward.
    let built = NetworkConfig::builder(4).dense(4).layer(RebuiltWithTape).dense(2).build();
    match built {
        Err(Error::InvalidConfig { reason }) => {
            assert!(reason.contains("'rebuilt_with_tape'") && reason.contains("tape"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

/// `tanh`, as a DL4J user writes a layer that keeps a value for its backward pass:
/// the output leveraged into the forward cache's role (`FfCache`) as a handle on the
/// tape, read back in the backward pass through a scope of that role. `recompute`:
/// the same layer computing `tanh` again from its input instead (no handle).
struct KeptTanh {
    recompute: bool,
}

impl Layer for KeptTanh {
    fn name(&self) -> &str {
        "kept_tanh"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn tape(&self) -> Tape {
        Tape::new(None::<carve::Handle<f32, ndarray::Ix2>>)
    }
    fn forward<'a>(
        &self,
        _params: &[f32],
        input: Activations<'a>,
        _mask: Option<ndarray::ArrayView2<'a, f32>>,
        tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<Activations<'a>> {
        let Activations::Flat(x) = input else { unreachable!("a flat batch") };
        let y = freeze(ctx.activations.from_shape_fn(x.raw_dim(), |(i, j)| x[[i, j]].tanh())?);
        if ctx.training {
            let kept = ctx.mgr.leverage_to(ArrayType::FfCache, &y)?;
            *tape.get_mut::<Option<carve::Handle<f32, ndarray::Ix2>>>().expect("its tape") = Some(kept);
        }
        Ok(Activations::Flat(y))
    }
    fn backward(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        tape: &mut Tape,
        ctx: &BackwardCtx<'_>,
    ) -> carve::Result<()> {
        let (Activations::Flat(x), Activations::Flat(dy)) = (pass.input, pass.grad_output) else {
            unreachable!("a flat batch")
        };
        let Some(GradInput::Flat(mut dx)) = grad_input else { return Ok(()) };
        let kept = tape.get_mut::<Option<carve::Handle<f32, ndarray::Ix2>>>().expect("its tape").take();
        if self.recompute {
            dx.zip_mut_with(&dy, |d, &g| *d = g);
            ndarray::Zip::from(&mut dx).and(&x).for_each(|d, &x| *d *= 1.0 - x.tanh() * x.tanh());
            return Ok(());
        }
        let scope = ctx.mgr.borrow_open(ArrayType::FfCache)?;
        let y = kept.expect("a training forward pass kept it").view(&scope)?.to_owned();
        ndarray::Zip::from(&mut dx).and(&dy).and(&y).for_each(|d, &g, &y| *d = g * (1.0 - y * y));
        Ok(())
    }
}

#[test]
fn a_users_layer_keeping_a_handle_for_backward_trains_alike_in_every_workspace_mode() {
    // A layer that leverages its output to the forward cache's role and reads it back
    // in its backward pass: with workspaces off the role's handle used to be refused
    // (`leverage_to` of a scoped-out role) where with them on it worked. Every mode now
    // trains it, with the losses of the layer that computes `tanh` again, bit for bit.
    let (x, y) = blobs(24, 3, 7);
    let run = |mode: WorkspaceMode, recompute: bool| -> Vec<u32> {
        let config = NetworkConfig::builder(8)
            .dense(6)
            .layer(KeptTanh { recompute })
            .dense(3)
            .seed(5)
            .training_workspace_mode(mode)
            .build()
            .unwrap();
        let mut net = Network::new(config).unwrap();
        (0..4).map(|_| net.fit_batch(x.view(), y.view()).unwrap().to_bits()).collect()
    };
    let reference = run(WorkspaceMode::Enabled, true);
    assert!(f32::from_bits(reference[3]) < f32::from_bits(reference[0]), "it learns: {reference:?}");
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None] {
        assert_eq!(run(mode, false), reference, "{mode:?}");
        assert_eq!(run(mode, true), reference, "{mode:?}, computed again");
    }
}
