//! Sequences: the LSTM and the sequence heads against finite differences, with masks;
//! padded steps change nothing; Enabled and None give the same numbers; the network's
//! sequence errors.

use carve::nn::{
    Activations, BackwardCtx, ForwardCtx, GradInput, Input, LastStep, Layer, Lstm, MaskedMean, Network, NetworkConfig,
    Pass, Tape,
};
use carve::{ArrayType, Error, LayerWorkspaceMgr, WorkspaceConfig, WorkspaceMode};
use carve_rng::Rng;
use ndarray::{s, Array1, Array2, Array3, ArrayView2, Axis};

use crate::standalone::Standalone;

/// A manager as the network's: the RNN loop roles in a workspace of their own.
fn workspaces() -> LayerWorkspaceMgr {
    let config = WorkspaceConfig::default();
    LayerWorkspaceMgr::builder()
        .with(ArrayType::Activations, "SEQ_ACT", config.clone())
        .with(ArrayType::RnnFfLoopWorkingMem, "SEQ_RNN_LOOP", config.clone())
        .with(ArrayType::RnnBpLoopWorkingMem, "SEQ_RNN_LOOP", config.clone())
        .default_workspace("SEQ_WORKING", config)
        .build()
        .unwrap()
}

fn random3(shape: (usize, usize, usize), rng: &mut Rng) -> Array3<f32> {
    Array3::from_shape_fn(shape, |_| rng.uniform(-1.0, 1.0))
}

/// `Σ y ⊙ r` for the layer's output `y` (so that `∂/∂y = r`), in f64.
fn project(layer: &mut Standalone, mgr: &LayerWorkspaceMgr, x: &Array3<f32>, mask: &Array2<f32>, r: &[f32]) -> f64 {
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
    let ctx = ForwardCtx { activations: &act, working: &working, mgr, training: true };
    let y = layer.forward(Activations::Sequence(x.view()), Some(mask.view()), &ctx).unwrap();
    let values: Vec<f32> = match y {
        Activations::Flat(y) => y.iter().copied().collect(),
        Activations::Sequence(y) => y.iter().copied().collect(),
    };
    values.iter().zip(r).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum()
}

/// The analytic gradients of `project`: of the input, and of each parameter.
fn analytic(
    layer: &mut Standalone,
    mgr: &LayerWorkspaceMgr,
    x: &Array3<f32>,
    mask: &Array2<f32>,
    r: &[f32],
) -> (Array3<f32>, Vec<Vec<f32>>) {
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
    let ctx = ForwardCtx { activations: &act, working: &working, mgr, training: true };
    let y = layer.forward(Activations::Sequence(x.view()), Some(mask.view()), &ctx).unwrap();
    drop(working);
    let grad_y_flat;
    let grad_y_seq;
    let grad_y = match y {
        Activations::Flat(y) => {
            grad_y_flat = Array2::from_shape_vec(y.raw_dim(), r.to_vec()).unwrap();
            Activations::Flat(grad_y_flat.view())
        }
        Activations::Sequence(y) => {
            grad_y_seq = Array3::from_shape_vec(y.raw_dim(), r.to_vec()).unwrap();
            Activations::Sequence(grad_y_seq.view())
        }
    };
    let mut gx = Array3::<f32>::from_elem(x.raw_dim(), f32::NAN);
    let bp = mgr.enter(ArrayType::BpWorkingMem).unwrap();
    let ctx = BackwardCtx { working: &bp, mgr };
    let pass = Pass { input: Activations::Sequence(x.view()), mask: Some(mask.view()), output: y, grad_output: grad_y };
    layer.backward(pass, Some(GradInput::Sequence(gx.view_mut())), &ctx).unwrap();
    (gx, layer.param_grads())
}

fn close(numeric: f64, analytic: f32, what: &str) {
    let (n, a) = (numeric, f64::from(analytic));
    let scale = n.abs().max(a.abs()).max(1e-2);
    assert!((n - a).abs() / scale < 2e-2, "{what}: numeric {n} vs analytic {a}");
}

/// Checks every input and parameter gradient of `layer` on `x` with `mask` against
/// central differences, with the workspaces of `mgr`.
fn check(layer: &mut Standalone, mgr: &LayerWorkspaceMgr, x: &Array3<f32>, mask: &Array2<f32>, outputs: usize) {
    let mut rng = Rng::new(99);
    let r: Vec<f32> = (0..outputs).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let (gx, grads) = analytic(layer, mgr, x, mask, &r);
    let eps = 1e-2f32;
    for (index, &g) in gx.indexed_iter() {
        let (mut plus, mut minus) = (x.clone(), x.clone());
        plus[index] += eps;
        minus[index] -= eps;
        let numeric = (project(layer, mgr, &plus, mask, &r) - project(layer, mgr, &minus, mask, &r)) / 0.02;
        close(numeric, g, &format!("{} d/dx{index:?}", layer.name()));
        if mask[[index.0, index.1]] == 0.0 {
            assert_eq!(g, 0.0, "a padded step takes no gradient: d/dx{index:?}");
        }
    }
    for (p, grad) in grads.iter().enumerate() {
        for (k, &g) in grad.iter().enumerate() {
            layer.nudge(p, k, eps);
            let up = project(layer, mgr, x, mask, &r);
            layer.nudge(p, k, -2.0 * eps);
            let down = project(layer, mgr, x, mask, &r);
            layer.nudge(p, k, eps);
            close((up - down) / 0.02, g, &format!("{} d/dparam{p}[{k}]", layer.name()));
        }
    }
}

/// Three sequences of 6 steps: whole; with a hole at step 2 and padding after step 3;
/// padding after step 2.
fn mask() -> Array2<f32> {
    ndarray::array![[1., 1., 1., 1., 1., 1.], [1., 1., 0., 1., 0., 0.], [1., 1., 1., 0., 0., 0.]]
}

/// `a` as a batch of sequences.
fn seq(a: &Array3<f32>) -> Activations<'_> {
    Activations::Sequence(a.view())
}

/// The forward pass of a layer without parameters or tape (a head) on `x`.
fn head_forward<'a>(
    head: &dyn Layer,
    x: &'a Array3<f32>,
    mask: Option<ArrayView2<'a, f32>>,
    ctx: &ForwardCtx<'a, '_>,
) -> carve::Result<Activations<'a>> {
    head.forward(&[], Activations::Sequence(x.view()), mask, &mut Tape::none(), ctx)
}

#[test]
fn lstm_gradients_match_finite_differences_with_masked_steps_in_the_middle_and_at_the_end() {
    for mgr in [workspaces(), LayerWorkspaceMgr::no_workspaces()] {
        let mut lstm = Standalone::new(Lstm::new(3, 4).unwrap(), 3, 5);
        let x = random3((3, 6, 3), &mut Rng::new(6));
        check(&mut lstm, &mgr, &x, &mask(), 3 * 6 * 4);
        assert_eq!(lstm.params.len(), 4 * 4 * (3 + 4 + 1));
    }
}

#[test]
fn the_gates_are_laid_out_as_dl4j_lays_them_out_and_the_forget_biases_start_at_one() {
    let mut lstm = Standalone::new(Lstm::new(2, 3).unwrap(), 2, 1);
    let b = lstm.param_mut(2).to_vec();
    assert_eq!(b, [0., 0., 0., 1., 1., 1., 0., 0., 0., 0., 0., 0.], "blocks: cell input, forget, output, input");
    let shapes = lstm.layer.param_shapes(2);
    assert_eq!(shapes[0].shape, [2, 12]);
    assert_eq!(shapes[1].shape, [3, 12]);
    // DL4J's LSTMHelpers: block 0 is the cell input (tanh), 3 the input gate (sigmoid).
    // With only block 0's bias set, the cell takes σ(0) · tanh(2); in the order i, f, o,
    // g it would take σ(2) · tanh(0) = 0.
    lstm.params.fill(0.0);
    lstm.param_mut(2)[..3].fill(2.0);
    let mgr = LayerWorkspaceMgr::no_workspaces();
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
    let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: false };
    let x = Array3::<f32>::zeros((1, 1, 2));
    let h = lstm.forward(Activations::Sequence(x.view()), None, &ctx).unwrap().sequence("h").unwrap().to_owned();
    let sigma0 = 0.5f32;
    let expected = sigma0 * (sigma0 * 2f32.tanh()).tanh();
    assert!(h.iter().all(|&v| (v - expected).abs() < 1e-6), "{h:?} against {expected}");
}

#[test]
fn lstm_gradients_match_finite_differences_with_steps_padded_for_every_sequence() {
    // Step 0 (leading) and step 3 (middle) are padding for every sequence: skipped.
    let mask = ndarray::array![[0., 1., 1., 0., 1., 1.], [0., 1., 0., 0., 1., 0.], [0., 1., 1., 0., 0., 0.]];
    for mgr in [workspaces(), LayerWorkspaceMgr::no_workspaces()] {
        let mut lstm = Standalone::new(Lstm::new(3, 4).unwrap(), 3, 15);
        let x = random3((3, 6, 3), &mut Rng::new(16));
        check(&mut lstm, &mgr, &x, &mask, 3 * 6 * 4);
    }
}

#[test]
fn inference_keeps_two_steps_and_gives_the_training_outputs() {
    let mut lstm = Standalone::new(Lstm::new(3, 5).unwrap(), 3, 2);
    let x = random3((4, 9, 3), &mut Rng::new(3));
    let m = Array2::from_shape_fn((4, 9), |(r, t)| if t == 0 || t == 4 || t > 8 - r { 0.0 } else { 1.0 });
    let mgr = workspaces();
    let outputs: Vec<Array3<f32>> = [true, false]
        .iter()
        .map(|&training| {
            let act = mgr.enter(ArrayType::Activations).unwrap();
            let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
            let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training };
            let y = lstm.forward(Activations::Sequence(x.view()), Some(m.view()), &ctx).unwrap();
            y.sequence("y").unwrap().to_owned()
        })
        .collect();
    assert_eq!(outputs[0], outputs[1]);
    assert!(outputs[0].iter().any(|&v| v != 0.0));
}

#[test]
fn hostile_shapes_at_the_layer_api_are_errors_not_panics() {
    let mgr = LayerWorkspaceMgr::no_workspaces();
    let x = random3((2, 4, 3), &mut Rng::new(4));
    let m = Array2::<f32>::ones((2, 4));
    let mut lstm = Standalone::new(Lstm::new(3, 2).unwrap(), 3, 1);
    let bp = mgr.enter(ArrayType::BpWorkingMem).unwrap();
    let bctx = BackwardCtx { working: &bp, mgr: &mgr };
    let g = Array3::<f32>::zeros((2, 4, 2));
    // Backward before any forward pass.
    let pass = Pass { input: seq(&x), mask: None, output: seq(&g), grad_output: seq(&g) };
    let err = lstm.backward(pass, None, &bctx).unwrap_err();
    assert!(err.to_string().contains("without a training forward pass"), "{err}");
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
    let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: true };
    let y = lstm.forward(seq(&x), Some(m.view()), &ctx).unwrap();
    // An input gradient of another shape, and another mask than the forward pass's.
    let mut short = Array3::<f32>::zeros((2, 3, 3));
    let pass = Pass { input: seq(&x), mask: Some(m.view()), output: y, grad_output: seq(&g) };
    let err = lstm.backward(pass, Some(GradInput::Sequence(short.view_mut())), &bctx).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    let other = ndarray::array![[1., 1., 0., 0.], [1., 1., 1., 1.]];
    let pass = Pass { input: seq(&x), mask: Some(other.view()), output: y, grad_output: seq(&g) };
    let err = lstm.backward(pass, None, &bctx).unwrap_err();
    assert!(err.to_string().contains("another batch or mask"), "{err}");
    // Heads: a wrong input gradient, and sequences of no steps.
    let flat = Array2::<f32>::zeros((2, 3));
    for head in [Standalone::new(LastStep::new(), 3, 0), Standalone::new(MaskedMean::new(), 3, 0)] {
        let mut head = head;
        let y = head.forward(seq(&x), Some(m.view()), &ctx).unwrap();
        let pass =
            Pass { input: seq(&x), mask: Some(m.view()), output: y, grad_output: Activations::Flat(flat.view()) };
        let err = head.backward(pass, Some(GradInput::Sequence(short.view_mut())), &bctx).unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{}: {err}", head.name());
        let empty = Array3::<f32>::zeros((2, 0, 3));
        let err = head.forward(seq(&empty), None, &ctx).unwrap_err();
        assert!(err.to_string().contains("0 steps"), "{}: {err}", head.name());
    }
}

#[test]
fn head_gradients_match_finite_differences_with_masks() {
    let x = random3((3, 6, 4), &mut Rng::new(8));
    for mgr in [workspaces(), LayerWorkspaceMgr::no_workspaces()] {
        check(&mut Standalone::new(LastStep::new(), 4, 0), &mgr, &x, &mask(), 3 * 4);
        check(&mut Standalone::new(MaskedMean::new(), 4, 0), &mgr, &x, &mask(), 3 * 4);
    }
}

#[test]
fn heads_read_only_the_steps_that_hold_data() {
    let x = Array3::from_shape_fn((3, 6, 1), |(r, t, _)| (10 * r + t) as f32);
    let mgr = LayerWorkspaceMgr::no_workspaces();
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
    let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: false };
    let m = mask();
    let last = head_forward(&LastStep::new(), &x, Some(m.view()), &ctx).unwrap();
    let last = last.flat("last").unwrap();
    assert_eq!(last.column(0).to_vec(), [5.0, 13.0, 22.0]);
    let mean = head_forward(&MaskedMean::new(), &x, Some(m.view()), &ctx).unwrap();
    let mean = mean.flat("mean").unwrap();
    let expected = [2.5, (10. + 11. + 13.) / 3., 21.0];
    for (got, want) in mean.column(0).iter().zip(expected) {
        assert!((got - want).abs() < 1e-5, "mean {got} against {want}");
    }
    let empty = ndarray::array![[1., 1., 1., 1., 1., 1.], [0., 0., 0., 0., 0., 0.], [1., 0., 0., 0., 0., 0.]];
    let err = head_forward(&LastStep::new(), &x, Some(empty.view()), &ctx).unwrap_err();
    assert!(err.to_string().contains("sequence 1 of the batch has no step that holds data"), "{err}");
}

fn sequence_network(mode: WorkspaceMode, seed: u64, mean: bool) -> Network {
    let builder = NetworkConfig::builder(3).lstm(8);
    let builder = if mean { builder.masked_mean() } else { builder.last_step() };
    let config = builder.dense(4).seed(seed).training_workspace_mode(mode).inference_workspace_mode(mode);
    Network::new(config.build().unwrap()).unwrap()
}

/// Every parameter's bits.
fn param_bits(net: &mut Network) -> Vec<u32> {
    net.params().iter().map(|v| v.to_bits()).collect()
}

/// Pads a batch with `extra` steps of mask 0 (holding junk, which must not matter).
fn pad(x: &Array3<f32>, mask: &Array2<f32>, extra: usize) -> (Array3<f32>, Array2<f32>) {
    let (b, t, f) = x.dim();
    let mut px = Array3::from_elem((b, t + extra, f), 7.5);
    px.slice_mut(s![.., ..t, ..]).assign(x);
    let mut pm = Array2::zeros((b, t + extra));
    pm.slice_mut(s![.., ..t]).assign(mask);
    (px, pm)
}

#[test]
fn padding_a_batch_with_masked_steps_changes_neither_the_loss_nor_the_step() {
    // Bit-identical: a step that is padding for every sequence is skipped outright,
    // forward and backward, and the heads read only the steps that hold data. (A step
    // that is padding for some sequences only is computed for the others; the padded
    // rows' states are copied, and their gradients are not touched.)
    let x = random3((3, 6, 3), &mut Rng::new(21));
    let y = Array1::from(vec![0u32, 3, 1]);
    for mean in [false, true] {
        let mut plain = sequence_network(WorkspaceMode::Enabled, 4, mean);
        let mut padded = sequence_network(WorkspaceMode::Enabled, 4, mean);
        let (px, pm) = pad(&x, &mask(), 5);
        for _ in 0..3 {
            let a = plain.fit_batch((x.view(), mask().view()), y.view()).unwrap();
            let b = padded.fit_batch((px.view(), pm.view()), y.view()).unwrap();
            assert_eq!(a.to_bits(), b.to_bits(), "loss");
            assert_eq!(param_bits(&mut plain), param_bits(&mut padded), "parameters after the step");
        }
        let a = plain.output((x.view(), mask().view())).unwrap();
        let b = padded.output((px.view(), pm.view())).unwrap();
        assert_eq!(a, b);
    }
}

#[test]
fn workspaces_do_not_change_the_numbers_of_sequences_of_varying_length() {
    let mut rng = Rng::new(31);
    let batches: Vec<(Array3<f32>, Array2<f32>, Array1<u32>)> = (0..12)
        .map(|i| {
            let steps = 4 + (i * 5) % 9;
            let x = random3((5, steps, 3), &mut rng);
            let m = Array2::from_shape_fn((5, steps), |(r, t)| if t < steps - (r % 3) { 1.0 } else { 0.0 });
            let y = Array1::from_shape_fn(5, |r| ((r + i) % 4) as u32);
            (x, m, y)
        })
        .collect();
    let run = |mode| {
        let mut net = sequence_network(mode, 9, false);
        let mut losses = Vec::new();
        for _ in 0..3 {
            for (x, m, y) in &batches {
                losses.push(net.fit_batch((x.view(), m.view()), y.view()).unwrap().to_bits());
            }
        }
        (losses, param_bits(&mut net))
    };
    let enabled = run(WorkspaceMode::Enabled);
    assert_eq!(enabled, run(WorkspaceMode::None), "Enabled and None must be bit-identical");
    assert_eq!(enabled, run(WorkspaceMode::Planned), "Enabled and Planned must be bit-identical");
    let losses: Vec<f32> = enabled.0.iter().map(|&b| f32::from_bits(b)).collect();
    assert!(losses[24..].iter().sum::<f32>() < losses[..12].iter().sum::<f32>(), "it learns: {losses:?}");
}

#[test]
fn sequence_inputs_are_checked() {
    let mut net = sequence_network(WorkspaceMode::Enabled, 1, false);
    let x = Array3::<f32>::zeros((2, 4, 3));
    let y = Array1::from(vec![0u32, 1]);
    let bad_mask = ndarray::array![[1., 1., 0.5, 0.], [1., 1., 1., 1.]];
    let err = net.fit_batch((x.view(), bad_mask.view()), y.view()).unwrap_err();
    assert!(err.to_string().contains("mask holds 0.5 at sequence 0, step 2"), "{err}");
    let empty = ndarray::array![[1., 1., 0., 0.], [0., 0., 0., 0.]];
    let err = net.fit_batch((x.view(), empty.view()), y.view()).unwrap_err();
    assert!(err.to_string().contains("sequence 1 of the batch has no step"), "{err}");
    let short = Array2::<f32>::ones((2, 3));
    let err = net.fit_batch((x.view(), short.view()), y.view()).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    let wide = Array3::<f32>::zeros((2, 4, 5));
    assert!(matches!(net.fit_batch(wide.view(), y.view()), Err(Error::ShapeMismatch { .. })));
    // A flat batch for a recurrent network, and sequences without a head.
    let flat = Array2::<f32>::zeros((2, 3));
    let err = net.fit_batch(flat.view(), y.view()).unwrap_err();
    assert!(err.to_string().contains("takes batches of sequences"), "{err}");
    let headless = NetworkConfig::builder(3).lstm(4).build().unwrap();
    let mut headless = Network::new(headless).unwrap();
    let err = headless.fit_batch(x.view(), y.view()).unwrap_err();
    assert!(err.to_string().contains("put a head such as `last_step()`"), "{err}");
    // Nothing changed, and the network is usable.
    assert!(net.fit_batch(Input::from(x.view()), y.view()).unwrap().is_finite());
}

#[test]
fn evaluate_takes_sequences_in_batches_with_their_masks() {
    let mut net = sequence_network(WorkspaceMode::Enabled, 2, false);
    let x = random3((7, 5, 3), &mut Rng::new(3));
    let m = Array2::from_shape_fn((7, 5), |(r, t)| if t <= r % 5 { 1.0 } else { 0.0 });
    let probs = net.output((x.view(), m.view())).unwrap();
    let labels = probs.map_axis(Axis(1), |row| {
        row.iter().enumerate().fold(0, |best, (i, &v)| if v > row[best] { i } else { best }) as u32
    });
    for batch in [1, 3, 7, 10] {
        assert_eq!(net.evaluate((x.view(), m.view()), labels.view(), batch).unwrap(), 1.0, "batch {batch}");
    }
    // Per-row results do not depend on the other rows of the batch.
    let first = net.output((x.slice(s![..1, .., ..]), m.slice(s![..1, ..]))).unwrap();
    assert_eq!(first.row(0), probs.row(0));
}

/// A network with a label per step (DL4J's `RnnOutputLayer`): no head, a dense layer on
/// every step.
fn per_step_network(mode: WorkspaceMode) -> Network {
    let config = NetworkConfig::builder(3)
        .lstm(6)
        .dense(4)
        .seed(5)
        .updater(carve::nn::Updater::adam(1e-2))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode);
    Network::new(config.build().unwrap()).unwrap()
}

#[test]
fn labels_per_step_train_on_the_labelled_steps_only() {
    // Each step's class is the sign pattern of its first two features.
    let x = random3((6, 7, 3), &mut Rng::new(41));
    let labels =
        Array2::from_shape_fn((6, 7), |(r, t)| u32::from(x[[r, t, 0]] > 0.0) + 2 * u32::from(x[[r, t, 1]] > 0.0));
    let mask = Array2::from_shape_fn((6, 7), |(r, t)| if t < 7 - r % 3 { 1.0 } else { 0.0 });
    let mut net = per_step_network(WorkspaceMode::Enabled);
    let first = net.fit_batch((x.view(), mask.view()), (labels.view(), mask.view())).unwrap();
    for _ in 0..150 {
        net.fit_batch((x.view(), mask.view()), (labels.view(), mask.view())).unwrap();
    }
    let last = net.fit_batch((x.view(), mask.view()), (labels.view(), mask.view())).unwrap();
    assert!(last < first / 3.0, "the per-step loss falls: {first} -> {last}");
    let accuracy = net.evaluate((x.view(), mask.view()), (labels.view(), mask.view()), 4).unwrap();
    assert!(accuracy > 0.9, "per labelled step: {accuracy}");
    // One row of output per example and step.
    assert_eq!(net.output((x.view(), mask.view())).unwrap().dim(), (6 * 7, 4));

    // The labels of unlabelled steps are never read: changing them changes nothing.
    let mut a = per_step_network(WorkspaceMode::Enabled);
    let mut b = per_step_network(WorkspaceMode::None);
    let mut other = labels.clone();
    other.zip_mut_with(&mask, |l, &m| {
        if m == 0.0 {
            *l = 3 - *l;
        }
    });
    for _ in 0..3 {
        let la = a.fit_batch((x.view(), mask.view()), (labels.view(), mask.view())).unwrap();
        let lb = b.fit_batch((x.view(), mask.view()), (other.view(), mask.view())).unwrap();
        assert_eq!(la.to_bits(), lb.to_bits());
        assert_eq!(param_bits(&mut a), param_bits(&mut b), "and Enabled gives None's numbers");
    }
}

#[test]
fn labels_per_step_are_checked() {
    let mut net = per_step_network(WorkspaceMode::Enabled);
    let x = Array3::<f32>::zeros((2, 4, 3));
    let good = Array2::<u32>::zeros((2, 4));
    let err = net.fit_batch(x.view(), Array2::<u32>::zeros((2, 5)).view()).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    let err = net.fit_batch(x.view(), (good.view(), Array2::<f32>::zeros((2, 4)).view())).unwrap_err();
    assert!(err.to_string().contains("selects no label"), "{err}");
    let half = ndarray::array![[1., 0.5, 1., 1.], [1., 1., 1., 1.]];
    let err = net.fit_batch(x.view(), (good.view(), half.view())).unwrap_err();
    assert!(err.to_string().contains("labels mask holds 0.5"), "{err}");
    let bad_class = Array2::<u32>::from_elem((2, 4), 9);
    let err = net.fit_batch(x.view(), bad_class.view()).unwrap_err();
    assert!(err.to_string().contains("label 9 is not a class"), "{err}");
    // One label per example for a network without a head, and per step for one with.
    let err = net.fit_batch(x.view(), Array1::<u32>::zeros(2).view()).unwrap_err();
    assert!(err.to_string().contains("put a head"), "{err}");
    let mut headed = sequence_network(WorkspaceMode::Enabled, 1, false);
    let err = headed.fit_batch(x.view(), good.view()).unwrap_err();
    assert!(err.to_string().contains("leave the head out"), "{err}");
    let flat = Array2::<f32>::zeros((2, 3));
    let err = headed.fit_batch(flat.view(), good.view()).unwrap_err();
    assert!(err.to_string().contains("need a batch of sequences"), "{err}");
    assert!(net.fit_batch(x.view(), good.view()).unwrap().is_finite(), "still usable");
}

#[test]
fn sequences_in_dl4j_layout_train_as_their_standard_copy() {
    // [batch, features, time] (DL4J's NCW), permuted to [batch, time, features]: not in
    // standard layout, so the network copies it once.
    let ncw = Array3::from_shape_fn((4, 3, 6), |(b, f, t)| ((b * 7 + f * 3 + t) % 5) as f32 / 5.0 - 0.4);
    let permuted = ncw.view().permuted_axes([0, 2, 1]);
    assert!(!permuted.is_standard_layout());
    let standard = permuted.as_standard_layout().to_owned();
    let y = Array1::from(vec![0u32, 1, 2, 3]);
    let mut a = sequence_network(WorkspaceMode::Enabled, 3, false);
    let mut b = sequence_network(WorkspaceMode::Enabled, 3, false);
    for _ in 0..3 {
        let la = a.fit_batch(permuted, y.view()).unwrap();
        let lb = b.fit_batch(standard.view(), y.view()).unwrap();
        assert_eq!(la.to_bits(), lb.to_bits());
    }
    assert_eq!(param_bits(&mut a), param_bits(&mut b));
    assert_eq!(a.output(permuted).unwrap(), b.output(standard.view()).unwrap());
}

#[test]
fn labels_per_step_without_a_mask_take_the_features_mask_and_predictions_are_per_step() {
    let x = random3((3, 5, 3), &mut Rng::new(51));
    let m = Array2::from_shape_fn((3, 5), |(r, t)| if t < 5 - r { 1.0 } else { 0.0 });
    let labels = Array2::from_shape_fn((3, 5), |(r, t)| ((r + t) % 4) as u32);
    let mut a = per_step_network(WorkspaceMode::Enabled);
    let mut b = per_step_network(WorkspaceMode::Enabled);
    let la = a.fit_batch((x.view(), m.view()), labels.view()).unwrap();
    let lb = b.fit_batch((x.view(), m.view()), (labels.view(), m.view())).unwrap();
    assert_eq!(la.to_bits(), lb.to_bits(), "padded steps have no label");
    assert_eq!(param_bits(&mut a), param_bits(&mut b));
    // One prediction per example and step.
    let mut per_example = [0u32; 3];
    let err = a.predict_into((x.view(), m.view()), &mut per_example).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    let mut per_step = [0u32; 15];
    a.predict_into((x.view(), m.view()), &mut per_step).unwrap();
}

/// `dense(4).relu().lstm(5)` with a sequence head, as a hostile user builds it.
fn dense_first_network(mode: WorkspaceMode) -> Network {
    let config = NetworkConfig::builder(3)
        .dense(4)
        .relu()
        .lstm(5)
        .last_step()
        .dense(3)
        .seed(9)
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode);
    Network::new(config.build().unwrap()).unwrap()
}

#[test]
fn whatever_padding_holds_a_step_trains_as_on_the_zero_padded_batch() {
    let x = random3((3, 6, 3), &mut Rng::new(51));
    let mask = mask();
    let y = Array1::from(vec![0u32, 2, 1]);
    let with = |value: f32| {
        let mut padded = x.clone();
        padded.zip_mut_with(&mask.clone().insert_axis(Axis(2)).broadcast(x.dim()).unwrap(), |v, &m| {
            if m == 0.0 {
                *v = value;
            }
        });
        padded
    };
    let zeros = with(0.0);
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::None, WorkspaceMode::Planned] {
        for junk in [f32::MAX, -f32::MAX, f32::NAN, f32::INFINITY, 7.5] {
            let junk_x = with(junk);
            let mut plain = dense_first_network(mode);
            let mut hostile = dense_first_network(mode);
            for step in 0..3 {
                let a = plain.fit_batch((zeros.view(), mask.view()), y.view()).unwrap();
                let b = hostile
                    .fit_batch((junk_x.view(), mask.view()), y.view())
                    .unwrap_or_else(|e| panic!("{mode:?}, padding {junk}, step {step}: {e}"));
                assert_eq!(a.to_bits(), b.to_bits(), "{mode:?}, padding {junk}: the loss of the zero-padded batch");
                assert_eq!(param_bits(&mut plain), param_bits(&mut hostile), "{mode:?}, padding {junk}: its step");
            }
        }
    }
    // A value that is not finite in a step that holds data is still refused, named.
    let mut net = dense_first_network(WorkspaceMode::Enabled);
    let mut bad = zeros.clone();
    bad[[1, 3, 0]] = f32::NAN;
    let err = net.fit_batch((bad.view(), mask.view()), y.view()).unwrap_err();
    assert!(matches!(err, Error::NonFinite { .. }) && err.to_string().contains("sequence 1, step 3"), "{err}");
}

#[test]
fn evaluating_with_no_labelled_step_is_an_error_that_says_so() {
    let mut net = per_step_network(WorkspaceMode::Enabled);
    let x = random3((2, 4, 3), &mut Rng::new(3));
    let labels = Array2::<u32>::zeros((2, 4));
    let none = Array2::<f32>::zeros((2, 4));
    let err = net.evaluate(x.view(), (labels.view(), none.view()), 1).unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
    assert!(err.to_string().contains("no labelled step"), "{err}");
    // As training says.
    let err = net.fit_batch(x.view(), (labels.view(), none.view())).unwrap_err();
    assert!(err.to_string().contains("nothing to learn from"), "{err}");
}

/// Batches of sequences with labels per step, whose labels mask is all 0.
struct Unlabelled {
    batches: usize,
}

impl carve::async_iter::BatchSource for Unlabelled {
    fn next_layout(
        &mut self,
        index: usize,
    ) -> Result<Option<carve::async_iter::BatchLayout>, carve::async_iter::SourceError> {
        Ok((index < self.batches).then(|| {
            carve::async_iter::BatchLayout::new()
                .features::<f32, _>((2, 4, 3))
                .features_mask::<f32, _>((2, 4))
                .labels::<u32, _>((2, 4))
                .labels_mask::<f32, _>((2, 4))
        }))
    }

    fn fill(&mut self, batch: &mut carve::async_iter::BatchMut<'_>) -> Result<(), carve::async_iter::SourceError> {
        batch.features::<f32, ndarray::Ix3>()?.fill(0.5);
        batch.features_mask::<f32, ndarray::Ix2>()?.fill(1.0);
        batch.labels::<u32, ndarray::Ix2>()?.fill(1);
        batch.labels_mask::<f32, ndarray::Ix2>()?.fill(0.0);
        Ok(())
    }
}

#[test]
fn evaluating_batches_with_no_labelled_step_names_the_cause() {
    let mut net = per_step_network(WorkspaceMode::Enabled);
    let mut batches = carve::async_iter::Prefetcher::builder(Unlabelled { batches: 3 }).build().unwrap();
    let err = net.evaluate_batches(&mut batches).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
    assert!(message.contains("no labelled step") && message.contains("3 batches"), "{message}");
    assert!(!message.contains("no batches"), "{message}");
    // The epoch ended: the prefetcher was reset, and the next call sees the batches again.
    let err = net.evaluate_batches(&mut batches).unwrap_err();
    assert!(err.to_string().contains("no labelled step"), "{err}");
}

#[test]
fn a_broadcast_batch_too_large_to_lay_out_fails_at_once() {
    // One value viewed as 2^40 steps (zero strides): scanning it element by element
    // would take hours; it fails as soon as it would have to be laid out.
    let one = Array1::from(vec![0.5f32, 0.25, 0.125]);
    let steps = one.broadcast((1, 1usize << 40, 3)).unwrap();
    let rows = one.broadcast((1usize << 40, 3)).unwrap();
    let labels = Array1::<u32>::zeros(1);
    let zero = [0u32];
    let zero = ndarray::ArrayView1::from(&zero[..]);
    let many_labels = zero.broadcast(1usize << 40).unwrap();
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::None, WorkspaceMode::Planned] {
        let mut net = sequence_network(mode, 1, false);
        let err = net.fit_batch(steps, labels.view()).unwrap_err();
        assert!(err.to_string().contains("out of memory") || err.to_string().contains("budget"), "{mode:?}: {err}");
        assert!(net.output(steps).is_err(), "{mode:?}");
        let mut flat =
            Network::new(NetworkConfig::builder(3).dense(4).seed(1).training_workspace_mode(mode).build().unwrap())
                .unwrap();
        let err = flat.fit_batch(rows, many_labels).unwrap_err();
        assert!(err.to_string().contains("out of memory") || err.to_string().contains("budget"), "{mode:?}: {err}");
    }
}

#[test]
fn evaluate_refuses_labels_that_are_not_classes_and_reads_labels_in_any_layout() {
    // An out-of-range label is refused by `fit_batch`: an accuracy must not hide it.
    let mut net =
        Network::new(NetworkConfig::builder(3).lstm(4).last_step().dense(2).seed(1).build().unwrap()).unwrap();
    let x = Array3::from_shape_fn((2, 4, 3), |(b, t, f)| (b + 2 * t + f) as f32 * 0.1);
    let y = Array1::from(vec![0u32, 7]);
    assert!(net.fit_batch(x.view(), y.view()).is_err());
    match net.evaluate(x.view(), y.view(), 2) {
        Err(Error::InvalidInput(m)) => assert!(m.contains("label 7 is not a class"), "{m}"),
        other => panic!("{other:?}"),
    }
    // Per-step labels as `fit_batch` takes them: sliced from a wider buffer, or the
    // transpose of a [time, batch] array, give the accuracy of the same labels laid out
    // row-major.
    let mut per_step = Network::new(NetworkConfig::builder(3).lstm(4).dense(2).seed(2).build().unwrap()).unwrap();
    let x = Array3::from_shape_fn((2, 5, 3), |(b, t, f)| ((b * 5 + t) * 3 + f) as f32 * 0.05 - 0.4);
    let buffer = Array2::from_shape_fn((2, 8), |(b, t)| ((b + t / 2) % 2) as u32);
    let sliced = buffer.slice(s![.., ..5]);
    let standard = sliced.to_owned();
    let time_major = standard.t().to_owned();
    let expected = per_step.evaluate(x.view(), standard.view(), 2).unwrap();
    assert!(expected > 0.0 && expected < 1.0, "{expected}: a figure the layouts could get wrong");
    assert_eq!(per_step.evaluate(x.view(), sliced, 2).unwrap(), expected);
    assert_eq!(per_step.evaluate(x.view(), time_major.t(), 2).unwrap(), expected);
    // Out of range there too, where the mask counts it.
    let mut bad = standard.clone();
    bad[[1, 3]] = 2;
    assert!(matches!(per_step.evaluate(x.view(), bad.view(), 2), Err(Error::InvalidInput(_))));
}

/// A user's layer on sequences: the identity, whose backward pass adds `junk` to the
/// gradient of every step of its input, padded steps included (`careful`: only to the
/// steps that hold data, as the layer contract asks).
struct Careless {
    junk: f32,
    careful: bool,
}

impl carve::nn::Layer for Careless {
    fn name(&self) -> &str {
        "careless"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn forward<'a>(
        &self,
        _params: &[f32],
        input: Activations<'a>,
        _mask: Option<ArrayView2<'a, f32>>,
        _tape: &mut carve::nn::Tape,
        ctx: &carve::nn::ForwardCtx<'a, '_>,
    ) -> carve::Result<Activations<'a>> {
        let Activations::Sequence(x) = input else { unreachable!("sequences") };
        Ok(Activations::Sequence(carve::freeze(ctx.activations.copy_of(&x)?)))
    }
    fn backward(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: carve::nn::Pass<'_>,
        grad_input: Option<carve::nn::GradInput<'_>>,
        _tape: &mut carve::nn::Tape,
        _ctx: &carve::nn::BackwardCtx<'_>,
    ) -> carve::Result<()> {
        let (Activations::Sequence(dy), Some(carve::nn::GradInput::Sequence(mut dx))) = (pass.grad_output, grad_input)
        else {
            return Ok(());
        };
        let mask = pass.mask.expect("a masked batch");
        for ((b, t, f), d) in dx.indexed_iter_mut() {
            let live = mask[[b, t]] != 0.0;
            *d = dy[[b, t, f]] + if live || !self.careful { self.junk } else { 0.0 };
        }
        Ok(())
    }
}

#[test]
fn a_users_layer_writing_into_padded_steps_changes_no_gradient_below() {
    // The gradient a user's layer gives at padded steps reaches no layer below it: the
    // network zeroes it, as carve's own layers leave it. Before, the dense layer below
    // summed the padding's rows into its weights' gradients.
    let x = random3((3, 6, 3), &mut Rng::new(5));
    let mut m = mask();
    m[[0, 5]] = 0.0;
    let y = Array1::from(vec![0u32, 3, 1]);
    let run = |careful: bool| -> Vec<u32> {
        let config = NetworkConfig::builder(3)
            .dense(5)
            .layer(Careless { junk: 0.25, careful })
            .masked_mean()
            .dense(4)
            .seed(9)
            .build()
            .unwrap();
        let mut net = Network::new(config).unwrap();
        for _ in 0..3 {
            net.fit_batch((x.view(), m.view()), y.view()).unwrap();
        }
        param_bits(&mut net)
    };
    assert_eq!(run(false), run(true));
}
