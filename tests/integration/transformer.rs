//! The transformer's layers: gradients against finite differences, and values against
//! references computed independently (numpy in float64 from the published equations:
//! `tests/fixtures/layers/make_fixtures.py`, which wrote `layers.json`).

use carve::nn::{Gelu, GeluForm, LayerNorm, NetworkConfig, ParamShape};
use ndarray::{Array1, Array2};
use serde_json::Value;

use crate::nn::{analytic, check_layer};
use crate::standalone::Standalone;

fn fixture() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/layers/layers.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("the fixture is in the repository")).unwrap()
}

fn matrix(value: &Value) -> Array2<f32> {
    let rows: Vec<Vec<f32>> = serde_json::from_value(value.clone()).unwrap();
    Array2::from_shape_fn((rows.len(), rows[0].len()), |(r, c)| rows[r][c])
}

fn vector(value: &Value) -> Array1<f32> {
    Array1::from(serde_json::from_value::<Vec<f32>>(value.clone()).unwrap())
}

/// `actual` within float32 rounding of the float64 reference `expected`.
fn assert_close(actual: &[f32], expected: &[f32], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}");
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let tolerance = 1e-5 + 1e-5 * e.abs();
        assert!((a - e).abs() <= tolerance, "{what}[{i}]: {a} vs the reference {e}");
    }
}

#[test]
fn gelu_gradients_match_finite_differences() {
    check_layer(&mut Standalone::new(Gelu::new(), 7, 0), 4, 7, 7, 3);
    check_layer(&mut Standalone::new(Gelu::with_form("gelu", GeluForm::Exact), 7, 0), 4, 7, 7, 3);
}

#[test]
fn layer_norm_gradients_match_finite_differences() {
    let mut norm = Standalone::new(LayerNorm::named("ln"), 6, 0);
    // Scale and bias away from their initial 1 and 0, so that their gradients matter.
    for (k, v) in norm.param_mut(0).iter_mut().enumerate() {
        *v = 0.5 + 0.25 * k as f32;
    }
    for (k, v) in norm.param_mut(1).iter_mut().enumerate() {
        *v = 0.1 * k as f32 - 0.2;
    }
    check_layer(&mut norm, 5, 6, 6, 9);
    let shapes = norm.layer.param_shapes(6);
    assert_eq!(shapes, [ParamShape::new("weight", &[6]), ParamShape::new("bias", &[6])]);
}

#[test]
fn gelu_matches_the_float64_reference() {
    let case = &fixture()["gelu"];
    let (x, dy) = (matrix(&case["x"]), matrix(&case["dy"]));
    let mut gelu = Standalone::new(Gelu::new(), x.ncols(), 0);
    let (dx, _) = analytic(&mut gelu, &x, &dy);
    let y = forward(&mut gelu, &x);
    assert_close(y.as_slice().unwrap(), matrix(&case["y"]).as_slice().unwrap(), "gelu y");
    assert_close(dx.as_slice().unwrap(), matrix(&case["dx"]).as_slice().unwrap(), "gelu dx");
}

#[test]
fn layer_norm_matches_the_float64_reference() {
    let case = &fixture()["layer_norm"];
    let (x, dy) = (matrix(&case["x"]), matrix(&case["dy"]));
    let (w, b) = (vector(&case["weight"]), vector(&case["bias"]));
    assert_eq!(case["eps"].as_f64().map(|e| e as f32), Some(LayerNorm::DEFAULT_EPS));
    let mut norm = Standalone::new(LayerNorm::named("ln"), x.ncols(), 0);
    norm.param_mut(0).copy_from_slice(w.as_slice().unwrap());
    norm.param_mut(1).copy_from_slice(b.as_slice().unwrap());
    let (dx, grads) = analytic(&mut norm, &x, &dy);
    let y = forward(&mut norm, &x);
    assert_close(y.as_slice().unwrap(), matrix(&case["y"]).as_slice().unwrap(), "layer norm y");
    assert_close(dx.as_slice().unwrap(), matrix(&case["dx"]).as_slice().unwrap(), "layer norm dx");
    assert_close(&grads[0], vector(&case["dweight"]).as_slice().unwrap(), "layer norm d weight");
    assert_close(&grads[1], vector(&case["dbias"]).as_slice().unwrap(), "layer norm d bias");
}

/// The layer's output on `x`, copied out.
fn forward(layer: &mut Standalone, x: &Array2<f32>) -> Array2<f32> {
    use carve::nn::{Activations, ForwardCtx};
    use carve::{ArrayType, LayerWorkspaceMgr};
    let mgr = LayerWorkspaceMgr::no_workspaces();
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
    let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: true };
    layer.forward(Activations::Flat(x.view()), None, &ctx).unwrap().flat("y").unwrap().to_owned()
}

#[test]
fn the_builder_makes_a_pre_ln_mlp_that_learns_over_sequences() {
    use carve::nn::{Input, Labels, Network, Updater};
    use ndarray::Array3;
    // [batch, time, features] as rows: LayerNorm and GELU run on every step.
    let config = NetworkConfig::builder(8)
        .layer_norm()
        .dense(16)
        .gelu()
        .dense(3)
        .updater(Updater::adam(1e-2))
        .seed(3)
        .build()
        .unwrap();
    let names: Vec<&str> = config.layers().iter().map(|l| l.name()).collect();
    assert_eq!(names, ["layer_norm_0", "dense_1", "gelu_2", "dense_3"]);
    let mut net = Network::new(config).unwrap();
    let x = Array3::from_shape_fn((4, 5, 8), |(b, t, f)| ((b * 7 + t * 3 + f) % 5) as f32 - 2.0);
    let y = Array2::from_shape_fn((4, 5), |(b, t)| ((b * 7 + t * 3) % 5 % 3) as u32);
    let mut losses = Vec::new();
    for _ in 0..60 {
        let input = Input::Sequences { features: x.view(), mask: None };
        losses.push(net.fit_batch(input, Labels::from(y.view())).unwrap());
    }
    assert!(losses[59] < 0.5 * losses[0], "{losses:?}");
}

#[test]
fn a_bad_eps_is_refused() {
    for eps in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(LayerNorm::named("ln").with_eps(eps), Err(carve::Error::InvalidConfig { .. })), "{eps}");
    }
    assert_eq!(LayerNorm::named("ln").with_eps(1e-6).unwrap().eps(), 1e-6);
}

fn tensor3(value: &Value) -> ndarray::Array3<f32> {
    let rows: Vec<Vec<Vec<f32>>> = serde_json::from_value(value.clone()).unwrap();
    ndarray::Array3::from_shape_fn((rows.len(), rows[0].len(), rows[0][0].len()), |(b, t, f)| rows[b][t][f])
}

/// One training forward and backward pass of a sequence layer on its own: its output,
/// the gradient of its input and of each parameter, for the upstream gradient `dy`.
fn sequence_pass(
    layer: &mut Standalone,
    x: &ndarray::Array3<f32>,
    mask: Option<&Array2<f32>>,
    dy: &ndarray::Array3<f32>,
) -> (ndarray::Array3<f32>, ndarray::Array3<f32>, Vec<Vec<f32>>) {
    use carve::nn::{Activations, BackwardCtx, ForwardCtx, GradInput, Pass};
    use carve::{ArrayType, LayerWorkspaceMgr};
    let mgr = LayerWorkspaceMgr::no_workspaces();
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
    let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: true };
    let mask = mask.map(|m| m.view());
    let y = layer.forward(Activations::Sequence(x.view()), mask, &ctx).unwrap();
    drop(working);
    let mut dx = ndarray::Array3::<f32>::from_elem(x.raw_dim(), f32::NAN);
    let bp = mgr.enter(ArrayType::BpWorkingMem).unwrap();
    let pass =
        Pass { input: Activations::Sequence(x.view()), mask, output: y, grad_output: Activations::Sequence(dy.view()) };
    layer.backward(pass, Some(GradInput::Sequence(dx.view_mut())), &BackwardCtx { working: &bp, mgr: &mgr }).unwrap();
    (y.sequence("y").unwrap().to_owned(), dx, layer.param_grads())
}

/// A layer's backward pass both ways, from the same forward pass: the gradient of its
/// input written into zeros (`Layer::backward`) and into uninitialised memory, poisoned
/// with NaN (`Layer::backward_uninit`, which must give back the same elements, every one
/// written); the two gradients' bits and the two runs' parameter gradients' bits.
fn backward_both_ways(
    make: &dyn Fn() -> Standalone,
    x: &ndarray::ArrayD<f32>,
    mask: Option<&Array2<f32>>,
    dy: &ndarray::ArrayD<f32>,
) -> [(Vec<u32>, Vec<u32>); 2] {
    use carve::nn::{Activations, BackwardCtx, ForwardCtx, GradInput, Pass, UninitGradInput};
    use carve::{ArrayType, LayerWorkspaceMgr};
    use ndarray::{Ix2, Ix3};
    use std::mem::MaybeUninit;
    let bits = |v: &mut dyn Iterator<Item = f32>| v.map(f32::to_bits).collect::<Vec<u32>>();
    fn activations(a: &ndarray::ArrayD<f32>) -> Activations<'_> {
        match a.ndim() {
            2 => Activations::Flat(a.view().into_dimensionality::<Ix2>().unwrap()),
            _ => Activations::Sequence(a.view().into_dimensionality::<Ix3>().unwrap()),
        }
    }
    let mgr = LayerWorkspaceMgr::no_workspaces();
    let mut out = Vec::new();
    for uninit in [false, true] {
        let mut layer = make();
        let act = mgr.enter(ArrayType::Activations).unwrap();
        let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
        let (x, dy, mask) = (activations(x), activations(dy), mask.map(|m| m.view()));
        let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: true };
        let y = layer.forward(x, mask, &ctx).unwrap();
        drop(working);
        let bp = mgr.enter(ArrayType::BpWorkingMem).unwrap();
        let ctx = BackwardCtx { working: &bp, mgr: &mgr };
        let pass = Pass { input: x, mask, output: y, grad_output: dy };
        let dx = match (x, uninit) {
            (Activations::Flat(x), false) => {
                let mut dx = Array2::<f32>::zeros(x.raw_dim());
                layer.backward(pass, Some(GradInput::Flat(dx.view_mut())), &ctx).unwrap();
                bits(&mut dx.iter().copied())
            }
            (Activations::Sequence(x), false) => {
                let mut dx = ndarray::Array3::<f32>::zeros(x.raw_dim());
                layer.backward(pass, Some(GradInput::Sequence(dx.view_mut())), &ctx).unwrap();
                bits(&mut dx.iter().copied())
            }
            (Activations::Flat(x), true) => {
                let mut dx = Array2::from_elem(x.raw_dim(), MaybeUninit::new(f32::NAN));
                let ptr = dx.as_ptr().cast::<f32>();
                match layer.backward_uninit(pass, UninitGradInput::Flat(dx.view_mut()), &ctx).unwrap() {
                    GradInput::Flat(g) => {
                        assert!(std::ptr::eq(g.as_ptr(), ptr) && g.dim() == x.dim(), "{}: another array", layer.name());
                        bits(&mut g.iter().copied())
                    }
                    GradInput::Sequence(_) => panic!("{}: a flat input's gradient came back a sequence", layer.name()),
                }
            }
            (Activations::Sequence(x), true) => {
                let mut dx = ndarray::Array3::from_elem(x.raw_dim(), MaybeUninit::new(f32::NAN));
                let ptr = dx.as_ptr().cast::<f32>();
                match layer.backward_uninit(pass, UninitGradInput::Sequence(dx.view_mut()), &ctx).unwrap() {
                    GradInput::Sequence(g) => {
                        assert!(std::ptr::eq(g.as_ptr(), ptr) && g.dim() == x.dim(), "{}: another array", layer.name());
                        bits(&mut g.iter().copied())
                    }
                    GradInput::Flat(_) => panic!("{}: a sequence's gradient came back flat", layer.name()),
                }
            }
        };
        out.push((dx, bits(&mut layer.grads.iter().copied())));
    }
    [out.remove(0), out.remove(0)]
}

#[test]
fn built_in_layers_write_the_input_gradient_uninitialised_with_the_bits_of_backward() {
    use carve::nn::{Attention, Dense};
    let mut rng = carve_rng::Rng::new(23);
    let (b, t, d) = (3, 5, 8);
    let x3 = ndarray::Array3::from_shape_simple_fn((b, t, d), || rng.uniform(-1.0, 1.0));
    let dy3 = ndarray::Array3::from_shape_simple_fn((b, t, d), || rng.uniform(-1.0, 1.0));
    let x2 = Array2::from_shape_simple_fn((b * t, d), || rng.uniform(-1.0, 1.0));
    let dy2 = Array2::from_shape_simple_fn((b * t, d), || rng.uniform(-1.0, 1.0));
    // The last sequence's last two steps padded.
    let mask = Array2::from_shape_fn((b, t), |(s, step)| if s == b - 1 && step >= t - 2 { 0.0 } else { 1.0 });
    let make = |what: &str| match what {
        "dense" => Standalone::new(Dense::named("dense", d, 2 * d), d, 1),
        "gelu" => Standalone::new(Gelu::named("gelu"), d, 1),
        // The default: zeros, then `backward`.
        _ => Standalone::new(LayerNorm::named("ln"), d, 1),
    };
    let dy2_wide = Array2::from_shape_simple_fn((b * t, 2 * d), || rng.uniform(-1.0, 1.0)).into_dyn();
    let dy3_wide = ndarray::Array3::from_shape_simple_fn((b, t, 2 * d), || rng.uniform(-1.0, 1.0)).into_dyn();
    // A few rows through a wide dense layer: the product's shared dimension (its
    // outputs) crosses a packing slice (`KC`, 256).
    let (few, few_dy) = (
        Array2::from_shape_simple_fn((3, 40), || rng.uniform(-1.0, 1.0)).into_dyn(),
        Array2::from_shape_simple_fn((3, 300), || rng.uniform(-1.0, 1.0)).into_dyn(),
    );
    let [zeroed, uninit] =
        backward_both_ways(&|| Standalone::new(Dense::named("wide", 40, 300), 40, 2), &few, None, &few_dy);
    assert!(uninit.0.iter().all(|&v| !f32::from_bits(v).is_nan()), "wide dense: an element left unwritten");
    assert_eq!(zeroed, uninit, "wide dense: other bits");
    let (x2, dy2, x3, dy3) = (x2.into_dyn(), dy2.into_dyn(), x3.into_dyn(), dy3.into_dyn());
    for what in ["dense", "gelu", "layer norm"] {
        let (dy2, dy3) = if what == "dense" { (&dy2_wide, &dy3_wide) } else { (&dy2, &dy3) };
        for (x, dy) in [(&x2, dy2), (&x3, dy3)] {
            let [zeroed, uninit] = backward_both_ways(&|| make(what), x, None, dy);
            assert!(uninit.0.iter().all(|&v| !f32::from_bits(v).is_nan()), "{what}: an element left unwritten");
            assert_eq!(zeroed, uninit, "{what}: other bits");
        }
    }
    for recompute in [false, true] {
        let make = move || {
            let attention = Attention::named("attn", d, 2).unwrap();
            Standalone::new(if recompute { attention.recomputing() } else { attention }, d, 1)
        };
        for mask in [None, Some(&mask)] {
            let [zeroed, uninit] = backward_both_ways(&make, &x3, mask, &dy3);
            assert!(uninit.0.iter().all(|&v| !f32::from_bits(v).is_nan()), "attention: an element left unwritten");
            assert_eq!(zeroed, uninit, "attention (recompute {recompute}, mask {}): other bits", mask.is_some());
        }
    }
}

/// An attention layer of `heads` heads over `width`, its parameters the fixture's.
fn attention_from(case: &Value, width: usize, recompute: bool) -> Standalone {
    let heads = case["heads"].as_u64().unwrap() as usize;
    let attention = carve::nn::Attention::named("attn", width, heads).unwrap();
    let attention = if recompute { attention.recomputing() } else { attention };
    let mut layer = Standalone::new(attention, width, 0);
    let params = ["qkv.weight", "qkv.bias", "proj.weight", "proj.bias"];
    for (p, name) in params.iter().enumerate() {
        let values: Vec<f32> = match &case[*name][0] {
            Value::Array(_) => matrix(&case[*name]).iter().copied().collect(),
            _ => vector(&case[*name]).to_vec(),
        };
        layer.param_mut(p).copy_from_slice(&values);
    }
    layer
}

/// Within the reference's finite differences (float64, step 1e-6) and float32 rounding.
fn assert_near(actual: &[f32], expected: &[f32], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}");
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let tolerance = 2e-5 + 1e-4 * e.abs();
        assert!((a - e).abs() <= tolerance, "{what}[{i}]: {a} vs the reference {e}");
    }
}

#[test]
fn attention_matches_the_float64_reference_in_both_forms_and_with_padding() {
    let case = &fixture()["attention"];
    let (x, dy, mask) = (tensor3(&case["x"]), tensor3(&case["dy"]), matrix(&case["mask"]));
    let width = x.shape()[2];
    let mut bits = Vec::new();
    for recompute in [false, true] {
        let mut layer = attention_from(case, width, recompute);
        let (y, dx, grads) = sequence_pass(&mut layer, &x, Some(&mask), &dy);
        let form = if recompute { "recompute" } else { "keep" };
        assert_near(y.as_slice().unwrap(), tensor3(&case["y"]).as_slice().unwrap(), &format!("{form}: y"));
        assert_near(dx.as_slice().unwrap(), tensor3(&case["dx"]).as_slice().unwrap(), &format!("{form}: dx"));
        for (p, name) in ["qkv.weight", "qkv.bias", "proj.weight", "proj.bias"].iter().enumerate() {
            let expected: Vec<f32> = match &case[format!("d {name}")][0] {
                Value::Array(_) => matrix(&case[format!("d {name}")]).iter().copied().collect(),
                _ => vector(&case[format!("d {name}")]).to_vec(),
            };
            assert_near(&grads[p], &expected, &format!("{form}: d {name}"));
        }
        // Padded steps get no gradient.
        assert!(dx.slice(ndarray::s![1, 3.., ..]).iter().all(|&v| v == 0.0), "{form}: {dx}");
        let all: Vec<u32> = y.iter().chain(&dx).chain(grads.iter().flatten()).map(|v| v.to_bits()).collect();
        bits.push(all);
    }
    assert!(bits[0] == bits[1], "the keep and recompute forms give other bits");
}

#[test]
fn attention_gradients_match_finite_differences_of_its_own_forward() {
    let mut rng = carve_rng::Rng::new(17);
    let (b, t, d) = (2, 4, 6);
    let x = ndarray::Array3::from_shape_fn((b, t, d), |_| rng.uniform(-1.0, 1.0));
    let dy = ndarray::Array3::from_shape_fn((b, t, d), |_| rng.uniform(-1.0, 1.0));
    let mut layer = Standalone::new(carve::nn::Attention::named("attn", d, 3).unwrap(), d, 5);
    for p in 0..4 {
        for v in layer.param_mut(p) {
            *v = rng.uniform(-0.5, 0.5);
        }
    }
    let (_, dx, grads) = sequence_pass(&mut layer, &x, None, &dy);
    let project = |layer: &mut Standalone, x: &ndarray::Array3<f32>| -> f64 {
        let (y, _, _) = sequence_pass(layer, x, None, &dy);
        y.iter().zip(dy.iter()).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum()
    };
    let eps = 1e-2f32;
    let close = |numeric: f64, analytic: f32, what: &str| {
        let scale = numeric.abs().max(f64::from(analytic).abs()).max(1e-2);
        assert!((numeric - f64::from(analytic)).abs() / scale < 2e-2, "{what}: numeric {numeric} vs {analytic}");
    };
    for i in 0..x.len() {
        let (mut up, mut down) = (x.clone(), x.clone());
        up.as_slice_mut().unwrap()[i] += eps;
        down.as_slice_mut().unwrap()[i] -= eps;
        let numeric = (project(&mut layer, &up) - project(&mut layer, &down)) / f64::from(2.0 * eps);
        close(numeric, dx.as_slice().unwrap()[i], &format!("dx[{i}]"));
    }
    for (p, grad) in grads.iter().enumerate() {
        for (k, &g) in grad.iter().enumerate().step_by(7) {
            layer.nudge(p, k, eps);
            let up = project(&mut layer, &x);
            layer.nudge(p, k, -2.0 * eps);
            let down = project(&mut layer, &x);
            layer.nudge(p, k, eps);
            close((up - down) / f64::from(2.0 * eps), g, &format!("param {p}[{k}]"));
        }
    }
}

#[test]
fn attention_is_causal() {
    let mut rng = carve_rng::Rng::new(3);
    let (b, t, d) = (1, 6, 8);
    let x = ndarray::Array3::from_shape_fn((b, t, d), |_| rng.uniform(-1.0, 1.0));
    let dy = ndarray::Array3::zeros((b, t, d));
    let mut layer = Standalone::new(carve::nn::Attention::named("attn", d, 2).unwrap(), d, 9);
    let (y, _, _) = sequence_pass(&mut layer, &x, None, &dy);
    let mut later = x.clone();
    later.slice_mut(ndarray::s![0, 4.., ..]).fill(7.0);
    let (y2, _, _) = sequence_pass(&mut layer, &later, None, &dy);
    assert_eq!(y.slice(ndarray::s![0, ..4, ..]), y2.slice(ndarray::s![0, ..4, ..]), "a step saw the steps after it");
    assert_ne!(y.slice(ndarray::s![0, 4.., ..]), y2.slice(ndarray::s![0, 4.., ..]));
}

#[test]
fn attention_refuses_widths_its_heads_do_not_divide_and_flat_batches() {
    use carve::nn::Attention;
    assert!(matches!(Attention::named("a", 10, 3), Err(carve::Error::InvalidConfig { .. })));
    assert!(matches!(Attention::named("a", 0, 1), Err(carve::Error::InvalidConfig { .. })));
    assert!(matches!(Attention::named("a", 8, 0), Err(carve::Error::InvalidConfig { .. })));
    let config = NetworkConfig::builder(10).attention(3).build();
    assert!(matches!(config, Err(carve::Error::InvalidConfig { .. })), "{config:?}");
    let mut net = carve::nn::Network::new(NetworkConfig::builder(8).attention(2).dense(3).build().unwrap()).unwrap();
    let flat = Array2::<f32>::zeros((4, 8));
    assert!(net.output(flat.view()).is_err(), "attention over a flat batch");
}

#[test]
fn a_transformer_block_learns_and_its_modes_and_forms_give_the_same_bits() {
    use carve::nn::{Input, Labels, Network, Updater};
    use carve::WorkspaceMode;
    use ndarray::Array3;
    // Predict each step's token class from the steps up to it.
    let x = Array3::from_shape_fn((6, 8, 16), |(b, t, f)| (((b * 5 + t * 3 + f) % 7) as f32 - 3.0) * 0.3);
    let y = Array2::from_shape_fn((6, 8), |(b, t)| ((b * 5 + t * 3) % 7 % 4) as u32);
    let mut traces = Vec::new();
    for recompute in [false, true] {
        for mode in [WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None] {
            let builder = NetworkConfig::builder(16).layer_norm();
            let builder = if recompute { builder.attention_recompute(4) } else { builder.attention(4) };
            let config = builder
                .layer_norm()
                .dense(32)
                .gelu()
                .dense(4)
                .updater(Updater::adam(3e-3))
                .seed(11)
                .training_workspace_mode(mode)
                .inference_workspace_mode(mode)
                .build()
                .unwrap();
            let mut net = Network::new(config).unwrap();
            let mut losses = Vec::new();
            for _ in 0..40 {
                let input = Input::Sequences { features: x.view(), mask: None };
                losses.push(net.fit_batch(input, Labels::from(y.view())).unwrap());
            }
            assert!(losses[39] < 0.6 * losses[0], "{mode:?}, recompute {recompute}: {losses:?}");
            traces.push(losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>());
        }
    }
    assert!(traces.iter().all(|t| *t == traces[0]), "modes or forms gave other losses");
}

/// A GPT of `blocks` pre-LN blocks over a vocabulary of `vocab`, width `d`.
fn tiny_gpt(vocab: usize, d: usize, heads: usize, context: usize, blocks: usize) -> carve::nn::NetworkConfigBuilder {
    tiny_gpt_with(vocab, d, heads, context, blocks, GeluForm::Tanh)
}

/// [`tiny_gpt`] with its MLPs' GELU in `form`.
fn tiny_gpt_with(
    vocab: usize,
    d: usize,
    heads: usize,
    context: usize,
    blocks: usize,
    form: GeluForm,
) -> carve::nn::NetworkConfigBuilder {
    let mut b = NetworkConfig::builder(vocab).embedding(d).position_embedding(context);
    for _ in 0..blocks {
        b = b.residual(|b| b.layer_norm().attention(heads)).residual(|b| {
            let b = b.layer_norm().dense(4 * d);
            let b = match form {
                GeluForm::Tanh => b.gelu(),
                GeluForm::Exact => b.gelu_exact(),
            };
            b.dense(d)
        });
    }
    b.layer_norm().dense(vocab)
}

/// Token ids and their next tokens: windows of a repeating text.
fn windows(batch: usize, steps: usize, vocab: usize) -> (Array2<u32>, Array2<u32>) {
    let text: Vec<u32> = (0..400).map(|i| ((i * 7 + i / 5) % vocab) as u32).collect();
    let ids = Array2::from_shape_fn((batch, steps), |(b, t)| text[b * 11 + t]);
    let next = Array2::from_shape_fn((batch, steps), |(b, t)| text[b * 11 + t + 1]);
    (ids, next)
}

#[test]
fn a_gpt_trains_on_tokens_and_every_mode_gives_the_same_bits() {
    use carve::nn::{Input, Labels, Network, Updater};
    use carve::WorkspaceMode;
    let (ids, next) = windows(4, 12, 13);
    let mut traces = Vec::new();
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None] {
        let config = tiny_gpt(13, 16, 2, 16, 2)
            .updater(Updater::adam(1e-2))
            .seed(4)
            .training_workspace_mode(mode)
            .inference_workspace_mode(mode)
            .build()
            .unwrap();
        let mut net = Network::new(config).unwrap();
        let mut losses = Vec::new();
        for _ in 0..60 {
            losses.push(net.fit_batch(Input::tokens(ids.view()), Labels::from(next.view())).unwrap());
        }
        assert!(losses[59] < 0.3 * losses[0], "{mode:?}: {losses:?}");
        // Inference on tokens: a row of probabilities per step.
        let probs = net.output(Input::tokens(ids.view())).unwrap();
        assert_eq!(probs.dim(), (4 * 12, 13));
        traces.push(losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>());
    }
    assert!(traces.iter().all(|t| *t == traces[0]), "the modes gave other losses");
}

#[test]
fn a_gpts_gradients_match_finite_differences_of_its_loss() {
    use carve::nn::{Input, Labels, Network, Updater};
    let (ids, next) = windows(2, 5, 7);
    // A learning rate of 1e-12: each step reports the loss at the same parameters, to
    // float32 rounding.
    let config = tiny_gpt(7, 8, 2, 6, 1).updater(Updater::sgd(1e-12, 0.0)).seed(9).build().unwrap();
    let mut net = Network::new(config).unwrap();
    let loss =
        |net: &mut Network| f64::from(net.fit_batch(Input::tokens(ids.view()), Labels::from(next.view())).unwrap());
    loss(&mut net);
    let layers = net.layers().len();
    let grads: Vec<Vec<f32>> = (0..layers).map(|i| net.layer_grads(i).to_vec()).collect();
    // Small: the embeddings are drawn from N(0, 0.02²), and the layer norms after them
    // are far from linear over a step of their size.
    let eps = 1e-3f32;
    let mut checked = 0;
    for (i, grad) in grads.iter().enumerate() {
        for (k, &g) in grad.iter().enumerate().step_by(13) {
            net.layer_params_mut(i)[k] += eps;
            let up = loss(&mut net);
            net.layer_params_mut(i)[k] -= 2.0 * eps;
            let down = loss(&mut net);
            net.layer_params_mut(i)[k] += eps;
            let numeric = (up - down) / f64::from(2.0 * eps);
            let scale = numeric.abs().max(f64::from(g).abs()).max(1e-2);
            assert!((numeric - f64::from(g)).abs() / scale < 3e-2, "layer {i} param {k}: numeric {numeric} vs {g}");
            checked += 1;
        }
    }
    assert!(checked > 50, "{checked}");
}

#[test]
fn residual_blocks_that_change_the_width_or_hold_nothing_are_refused() {
    let widen = NetworkConfig::builder(8).residual(|b| b.dense(4)).build();
    assert!(matches!(widen, Err(carve::Error::InvalidConfig { .. })), "{widen:?}");
    let empty = NetworkConfig::builder(8).residual(|b| b).build();
    assert!(matches!(empty, Err(carve::Error::InvalidConfig { .. })), "{empty:?}");
    let mut deep = NetworkConfig::builder(8);
    fn nest(b: carve::nn::NetworkConfigBuilder, depth: usize) -> carve::nn::NetworkConfigBuilder {
        if depth == 0 {
            b.dense(8)
        } else {
            b.residual(|b| nest(b, depth - 1))
        }
    }
    deep = nest(deep, 9);
    assert!(matches!(deep.build(), Err(carve::Error::InvalidConfig { .. })));
    assert!(nest(NetworkConfig::builder(8), 3).dense(2).build().is_ok());
}

#[test]
fn an_embedding_anywhere_but_first_is_refused_when_built() {
    // It reads token ids: after another layer it could only fail at its first step.
    for late in [
        NetworkConfig::builder(1).layer_norm().embedding(8).dense(2).build(),
        NetworkConfig::builder(4).embedding(8).residual(|b| b.embedding(8)).dense(4).build(),
        NetworkConfig::builder(4).dense(4).layer(carve::nn::Embedding::named("late", 4, 8).unwrap()).dense(2).build(),
    ] {
        match late {
            Err(carve::Error::InvalidConfig { reason }) => {
                assert!(reason.contains("token embedding") && reason.contains("first layer"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(NetworkConfig::builder(4).embedding(8).dense(4).build().is_ok());
}

#[test]
fn token_ids_outside_the_vocabulary_and_features_fed_to_an_embedding_are_errors() {
    use carve::nn::{Input, Labels, Network};
    let mut net = Network::new(tiny_gpt(5, 8, 2, 4, 1).build().unwrap()).unwrap();
    let bad = Array2::from_elem((2, 3), 5u32);
    let next = Array2::<u32>::zeros((2, 3));
    let err = net.fit_batch(Input::tokens(bad.view()), Labels::from(next.view())).unwrap_err();
    assert!(err.to_string().contains("vocabulary"), "{err}");
    let long = Array2::<u32>::zeros((1, 5));
    let err = net.output(Input::tokens(long.view())).unwrap_err();
    assert!(err.to_string().contains("context"), "{err}");
    let features = ndarray::Array3::<f32>::zeros((2, 3, 5));
    assert!(net.output(Input::from(features.view())).is_err());
}

/// AdamW's first step, written out (carve's Adam folds the bias correction into the step
/// size): matrices decay by `1 − lr·wd` before Adam's update, vectors take Adam's
/// update alone.
#[test]
fn adamw_decays_matrices_only_before_adams_step() {
    use carve::nn::{Network, Updater};
    let (lr, wd) = (0.01f32, 0.5f32);
    let config = NetworkConfig::builder(6).dense(5).layer_norm().dense(3).updater(Updater::adamw(lr, wd)).seed(2);
    let mut net = Network::new(config.build().unwrap()).unwrap();
    let before: Vec<f32> = net.params().to_vec();
    let x = Array2::from_shape_fn((4, 6), |(r, c)| (r * 6 + c) as f32 * 0.1 - 1.0);
    let y = ndarray::Array1::from(vec![0u32, 1, 2, 1]);
    net.fit_batch(x.view(), y.view()).unwrap();
    let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
    let step = lr * (1.0 - b2).sqrt() / (1.0 - b1);
    let mut decayed = 0;
    for i in 0..net.layers().len() {
        let shapes = net.param_shapes(i).to_vec();
        let mut start = 0;
        let values = net.layer_params(i).to_vec();
        let grads = net.layer_grads(i).to_vec();
        // This layer's values before the step: its region of the flat buffer.
        let region = layer_region(&net, i);
        for shape in &shapes {
            for k in start..start + shape.len() {
                let (w0, g) = (before[region.start + k], grads[k]);
                let (m, v) = ((1.0 - b1) * g, (1.0 - b2) * g * g);
                let u = -step * m / (v.sqrt() + eps);
                let expected = if shape.shape.len() >= 2 { w0 * (1.0 - lr * wd) + u } else { w0 + u };
                assert_eq!(values[k], expected, "layer {i} {} [{}]", shape.name, k - start);
                decayed += usize::from(shape.shape.len() >= 2);
            }
            start += shape.len();
        }
    }
    assert!(decayed > 0);
}

/// Where layer `i`'s parameters are in the network's flat buffer.
fn layer_region(net: &carve::nn::Network, i: usize) -> std::ops::Range<usize> {
    let all = net.params().as_ptr() as usize;
    let mine = net.layer_params(i);
    let start = (mine.as_ptr() as usize - all) / std::mem::size_of::<f32>();
    start..start + mine.len()
}

#[test]
fn adamw_refuses_decays_that_are_not_a_shrinking_factor() {
    use carve::nn::Updater;
    for wd in [-0.1f32, f32::NAN, f32::INFINITY, 200.0] {
        let config = NetworkConfig::builder(4).dense(2).updater(Updater::adamw(0.01, wd)).build();
        assert!(matches!(config, Err(carve::Error::InvalidConfig { .. })), "{wd}: {config:?}");
    }
    assert!(NetworkConfig::builder(4).dense(2).updater(Updater::adamw(0.01, 0.0)).build().is_ok());
}

#[test]
fn a_gpts_dry_run_predicts_what_its_steps_take_in_every_mode() {
    use carve::nn::{dry::BatchShape, dry::DryPass, Input, Labels, Network, Updater};
    use carve::WorkspaceMode;
    let (ids, next) = windows(3, 8, 11);
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None] {
        for recompute in [false, true] {
            let mut b = NetworkConfig::builder(11).embedding(16).position_embedding(8);
            b = b.residual(
                |b| if recompute { b.layer_norm().attention_recompute(2) } else { b.layer_norm().attention(2) },
            );
            b = b.residual(|b| b.layer_norm().dense(32).gelu().dense(16));
            let config = b
                .layer_norm()
                .dense(11)
                .updater(Updater::adamw(1e-3, 0.1))
                .training_workspace_mode(mode)
                .inference_workspace_mode(mode)
                .build()
                .unwrap();
            let mut net = Network::new(config).unwrap();
            let shape = BatchShape::tokens(3, 8);
            let mut run = vec![DryPass::Train(shape); 6];
            run.insert(3, DryPass::Infer(shape));
            let estimate = net.dry_run(&run).unwrap();
            for (k, (pass, predicted)) in run.iter().zip(&estimate.per_pass_bytes).enumerate() {
                let taken = match pass {
                    DryPass::Train(_) => {
                        net.fit_batch(Input::tokens(ids.view()), Labels::from(next.view())).unwrap();
                        net.last_iteration_workspace_bytes()
                    }
                    DryPass::Infer(_) => {
                        net.output(Input::tokens(ids.view())).unwrap();
                        net.last_inference_workspace_bytes()
                    }
                };
                assert_eq!(taken, *predicted, "{mode:?}, recompute {recompute}: pass {k} ({pass:?})");
            }
            assert_eq!(net.workspace_capacity(), estimate.workspace_bytes, "{mode:?}, recompute {recompute}");
        }
    }
}

fn nanogpt_fixture() -> (std::path::PathBuf, Value) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    let expected = serde_json::from_str(&std::fs::read_to_string(dir.join("nanogpt_tiny.json")).unwrap()).unwrap();
    (dir.join("nanogpt_tiny.safetensors"), expected)
}

/// The tensor names in a safetensors file's header.
fn tensor_names(path: &std::path::Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let mut names: Vec<String> = header.as_object().unwrap().keys().filter(|k| *k != "__metadata__").cloned().collect();
    names.sort();
    names
}

/// The nanoGPT fixture's probabilities from carve with its MLPs' GELU in `form`, against
/// the float64 reference's under `key`: the largest error as a share of the tolerance
/// (at most 1 when every probability is within it), and the largest absolute error.
fn nanogpt_error(form: GeluForm, key: &str) -> (f32, f32) {
    use carve::nn::{serve::Model, Input};
    let (path, expected) = nanogpt_fixture();
    let size = |k: &str| expected[k].as_u64().unwrap() as usize;
    let config = tiny_gpt_with(size("vocab"), size("width"), size("heads"), size("context"), size("layers"), form)
        .build()
        .unwrap();
    let model = Model::load_pytorch(&path, &config).unwrap();
    let rows: Vec<Vec<u32>> = serde_json::from_value(expected["ids"].clone()).unwrap();
    let ids = Array2::from_shape_fn((rows.len(), rows[0].len()), |(b, t)| rows[b][t]);
    let probs = model.output(Input::tokens(ids.view())).unwrap();
    let reference: Vec<Vec<Vec<f32>>> = serde_json::from_value(expected[key].clone()).unwrap();
    let reference: Vec<f32> = reference.into_iter().flatten().flatten().collect();
    assert_eq!(probs.len(), reference.len());
    assert!(probs.iter().all(|p| p.is_finite()), "{form:?}: {probs:?}");
    let errors = probs.iter().zip(&reference).map(|(&a, &e)| ((a - e).abs() / (1e-5 + 1e-4 * e), (a - e).abs()));
    errors.fold((0.0, 0.0), |(share, abs), (s, a)| (f32::max(share, s), f32::max(abs, a)))
}

#[test]
fn a_nanogpt_state_dict_loads_and_gives_the_float64_references_probabilities() {
    // GELU's tanh form (GPT-2's) and the exact form (`nn.GELU()`, nanoGPT's) each give
    // their own reference's probabilities.
    let (tanh, _) = nanogpt_error(GeluForm::Tanh, "probabilities");
    assert!(tanh <= 1.0, "the tanh form is {tanh} times the tolerance off its reference");
    let (exact, exact_abs) = nanogpt_error(GeluForm::Exact, "probabilities_exact");
    assert!(exact <= 1.0, "the exact form is {exact} times the tolerance off its reference");
    // And not the other's: the exact form is ten times nearer its reference than the
    // tanh form is (the two references differ by up to 5.1e-5).
    let (_, crossed_abs) = nanogpt_error(GeluForm::Tanh, "probabilities_exact");
    assert!(10.0 * exact_abs < crossed_abs, "exact {exact_abs} against the tanh form's {crossed_abs}");
}

#[test]
fn a_gpt_of_the_exact_gelu_saves_and_loads_back_in_that_form() {
    use carve::nn::{serve::Model, Input, Network};
    let net = Network::new(tiny_gpt_with(11, 8, 2, 6, 1, GeluForm::Exact).seed(5).build().unwrap()).unwrap();
    let path = std::env::temp_dir().join(format!("carve-gpt-exact-{}.safetensors", std::process::id()));
    net.save(&path).unwrap();
    let ids = Array2::from_shape_fn((2, 6), |(b, t)| ((b * 5 + t * 3) % 11) as u32);
    let before = net.freeze().unwrap().output(Input::tokens(ids.view())).unwrap();
    assert_eq!(Model::load(&path).unwrap().output(Input::tokens(ids.view())).unwrap(), before);
    // Of version 2, which readers from before the exact form refuse (they would load it
    // as the tanh form).
    let header = String::from_utf8_lossy(&std::fs::read(&path).unwrap()).into_owned();
    assert!(header.contains(r#"\"version\":2"#), "{}", &header[..header.len().min(300)]);
    // The form is the file's: a configuration of the tanh form is refused, naming both.
    let err = Model::load_with(&path, &tiny_gpt(11, 8, 2, 6, 1).build().unwrap()).unwrap_err().to_string();
    assert!(err.contains(r#""form":"exact""#) && err.contains("the configuration builds"), "{err}");
    let original = std::fs::read(&path).unwrap();
    let text = String::from_utf8_lossy(&original).into_owned();
    let at = text.find("\\\"exact\\\"").expect("the form in the configuration");
    // The tanh form said outright (`"tanh" `, as long): the tanh form, through `load`
    // and `load_with` alike.
    let mut bytes = original.clone();
    bytes[at..at + 9].copy_from_slice(br#"\"tanh\" "#);
    std::fs::write(&path, &bytes).unwrap();
    let said = Model::load(&path).unwrap().output(Input::tokens(ids.view())).unwrap();
    assert_ne!(said, before);
    let with = Model::load_with(&path, &tiny_gpt(11, 8, 2, 6, 1).build().unwrap()).unwrap();
    assert_eq!(with.output(Input::tokens(ids.view())).unwrap(), said);
    // A form the reader does not know: refused, naming it.
    let mut bytes = original;
    bytes[at + 2..at + 7].copy_from_slice(b"fuzzy");
    std::fs::write(&path, &bytes).unwrap();
    let err = Model::load(&path).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(&err, carve::Error::ModelFile { .. }), "{err}");
    assert!(err.to_string().contains(r#"GELU 'gelu_7' the form "fuzzy""#), "{err}");
}

#[test]
fn a_gpt_saves_under_nanogpts_names_and_loads_back_with_its_configuration() {
    use carve::nn::{serve::Model, Input, Network};
    let (fixture, _) = nanogpt_fixture();
    let net = Network::new(tiny_gpt(11, 8, 2, 6, 2).seed(3).build().unwrap()).unwrap();
    let path = std::env::temp_dir().join(format!("carve-gpt-{}.safetensors", std::process::id()));
    net.save(&path).unwrap();
    // The names nanoGPT's state dict has, but its causal-mask buffers.
    let ours = tensor_names(&path);
    let theirs: Vec<String> = tensor_names(&fixture).into_iter().filter(|n| !n.ends_with(".attn.bias")).collect();
    let without_head_bias: Vec<String> = ours.iter().filter(|n| *n != "lm_head.bias").cloned().collect();
    assert_eq!(without_head_bias, theirs);
    let ids = Array2::from_shape_fn((2, 6), |(b, t)| ((b * 5 + t * 3) % 11) as u32);
    let loaded = Model::load(&path).unwrap();
    // The tanh form's files stay of version 1 (readers from before the exact form load them).
    let header = String::from_utf8_lossy(&std::fs::read(&path).unwrap()).into_owned();
    assert!(header.contains(r#"\"version\":1,"#) || header.contains(r#"\"version\":1}"#), "{}", &header[..300]);
    let before = net.freeze().unwrap().output(Input::tokens(ids.view())).unwrap();
    assert_eq!(loaded.output(Input::tokens(ids.view())).unwrap(), before);
    // A join whose block is not there: an error, not a panic.
    let mut bytes = std::fs::read(&path).unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let at = text.find("\\\"from\\\":2").expect("the first join's block in the configuration");
    bytes[at + 9] = b'9';
    std::fs::write(&path, &bytes).unwrap();
    let err = Model::load(&path).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(err, carve::Error::InvalidConfig { .. }), "{err}");
}

#[test]
fn a_gpt_trains_data_parallel_with_the_bits_of_one_thread_running_the_shards() {
    use carve::nn::{parallel::DataParallel, parallel::ParallelConfig, Input, Labels, Network, Updater};
    let (ids, next) = windows(6, 8, 13);
    let losses = |config: ParallelConfig| -> Vec<u32> {
        let net = Network::new(tiny_gpt(13, 16, 2, 8, 1).updater(Updater::adamw(3e-3, 0.1)).seed(6).build().unwrap());
        let mut trainer = DataParallel::new(net.unwrap(), config).unwrap();
        (0..8)
            .map(|_| trainer.fit_batch(Input::tokens(ids.view()), Labels::from(next.view())).unwrap().to_bits())
            .collect()
    };
    let threads = losses(ParallelConfig::threads(2));
    assert_eq!(threads, losses(ParallelConfig::sequential(2)), "2 threads vs one thread of 2 shards");
    assert_eq!(threads, losses(ParallelConfig::threads(2)), "another run, other bits");
}

#[test]
fn load_with_finds_a_gpts_nanogpt_names_and_refuses_a_configuration_the_file_does_not_hold() {
    use carve::nn::{serve::Model, Input, Network};
    let config = tiny_gpt(11, 8, 2, 6, 1).seed(5).build().unwrap();
    let net = Network::new(config.clone()).unwrap();
    let path = std::env::temp_dir().join(format!("carve-gpt-with-{}.safetensors", std::process::id()));
    net.save(&path).unwrap();
    let ids = Array2::from_shape_fn((1, 6), |(_, t)| t as u32);
    let loaded = Model::load_with(&path, &config).unwrap();
    assert_eq!(
        loaded.output(Input::tokens(ids.view())).unwrap(),
        net.freeze().unwrap().output(Input::tokens(ids.view())).unwrap()
    );
    // Attention that recomputes its scores is the same layer.
    let recompute = NetworkConfig::builder(11)
        .embedding(8)
        .position_embedding(6)
        .residual(|b| b.layer_norm().attention_recompute(2))
        .residual(|b| b.layer_norm().dense(32).gelu().dense(8))
        .layer_norm()
        .dense(11)
        .build()
        .unwrap();
    let again = Model::load_with(&path, &recompute).unwrap();
    assert_eq!(again.output(Input::tokens(ids.view())).unwrap(), loaded.output(Input::tokens(ids.view())).unwrap());
    // The same tensors, another model: a wider context is not.
    let other = tiny_gpt(11, 8, 2, 7, 1).build().unwrap();
    let err = Model::load_with(&path, &other).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(err, carve::Error::ModelFile { .. }), "{err}");
    // An MLP saved with ReLU and loaded as one with GELU: the same tensors, refused.
    let mlp = Network::new(NetworkConfig::builder(4).dense(8).relu().dense(3).build().unwrap()).unwrap();
    let path = std::env::temp_dir().join(format!("carve-mlp-with-{}.safetensors", std::process::id()));
    mlp.save(&path).unwrap();
    let gelu = NetworkConfig::builder(4).dense(8).gelu().dense(3).build().unwrap();
    let err = Model::load_with(&path, &gelu).unwrap_err();
    let same = Model::load_with(&path, &NetworkConfig::builder(4).dense(8).relu().dense(3).build().unwrap());
    std::fs::remove_file(&path).unwrap();
    assert!(err.to_string().contains("layer 1"), "{err}");
    assert!(same.is_ok(), "{same:?}");
}

/// `L`, keeping its output through the step: every method but
/// [`Layer::rebuilt_in_backward`] is `L`'s.
struct KeepOutput<L>(L);

impl<L: carve::nn::Layer> carve::nn::Layer for KeepOutput<L> {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        self.0.output_size(inputs)
    }

    fn param_shapes(&self, inputs: usize) -> Vec<ParamShape> {
        self.0.param_shapes(inputs)
    }

    fn init(&self, inputs: usize, params: &mut [f32], init: &mut carve::nn::Init<'_>) {
        self.0.init(inputs, params, init)
    }

    fn forward_rows<'a>(
        &self,
        params: &[f32],
        input: ndarray::ArrayView2<'a, f32>,
        ctx: &carve::nn::ForwardCtx<'a, '_>,
    ) -> carve::Result<ndarray::ArrayView2<'a, f32>> {
        self.0.forward_rows(params, input, ctx)
    }

    fn backward_rows(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: carve::nn::RowsPass<'_>,
        grad_input: Option<ndarray::ArrayViewMut2<'_, f32>>,
        ctx: &carve::nn::BackwardCtx<'_>,
    ) -> carve::Result<()> {
        self.0.backward_rows(params, grads, pass, grad_input, ctx)
    }
}

#[test]
fn outputs_rebuilt_in_backward_give_the_bits_of_kept_ones_in_less_memory() {
    use carve::nn::{Input, Labels, Network, Updater};
    use carve::WorkspaceMode;
    let (ids, next) = windows(3, 8, 11);
    // The same GPT block twice: GELU and the layer norms let their outputs go (and the
    // step computes them again in backward), or keep them (the same layers, wrapped).
    let gpt = |keep: bool, mode: WorkspaceMode| {
        let norm = |b: carve::nn::NetworkConfigBuilder, name: &str| match keep {
            true => b.layer(KeepOutput(LayerNorm::named(name))),
            false => b.layer(LayerNorm::named(name)),
        };
        let mut b = NetworkConfig::builder(11).embedding(16).position_embedding(8);
        b = b.residual(|b| norm(b, "ln_1").attention_recompute(2));
        b = b.residual(|b| {
            let b = norm(b, "ln_2").dense(32);
            let b = if keep { b.layer(KeepOutput(Gelu::named("gelu"))) } else { b.layer(Gelu::named("gelu")) };
            b.dense(16)
        });
        let config = norm(b, "ln_f")
            .dense(11)
            .updater(Updater::adamw(1e-2, 0.1))
            .seed(9)
            .training_workspace_mode(mode)
            .build()
            .unwrap();
        Network::new(config).unwrap()
    };
    for mode in [WorkspaceMode::Planned, WorkspaceMode::Enabled, WorkspaceMode::None] {
        let (mut rebuilt, mut kept) = (gpt(false, mode), gpt(true, mode));
        let let_go: Vec<usize> = (0..rebuilt.layers().len()).filter(|&i| rebuilt.output_rebuilt(i)).collect();
        let names: Vec<&str> = let_go.iter().map(|&i| rebuilt.layers()[i].name()).collect();
        assert_eq!(names, ["ln_1", "ln_2", "gelu", "ln_f"], "{mode:?}");
        assert!((0..kept.layers().len()).all(|i| !kept.output_rebuilt(i)));
        rebuilt.record_next_iteration();
        kept.record_next_iteration();
        for step in 0..5 {
            let a = rebuilt.fit_batch(Input::tokens(ids.view()), Labels::from(next.view())).unwrap();
            let b = kept.fit_batch(Input::tokens(ids.view()), Labels::from(next.view())).unwrap();
            assert_eq!(a.to_bits(), b.to_bits(), "{mode:?}: step {step}: {a} against {b}");
        }
        assert_eq!(rebuilt.params(), kept.params(), "{mode:?}");
        if mode == WorkspaceMode::Planned {
            // Four outputs of 3 · 8 rows (three 16 wide, one 32) are not live at the peak.
            let (r, k) = (rebuilt.memory_plan().unwrap(), kept.memory_plan().unwrap());
            assert!(
                r.arena_lower_bound_bytes + 4 * 3 * 8 * 16 <= k.arena_lower_bound_bytes,
                "rebuilt {} against kept {} bytes",
                r.arena_lower_bound_bytes,
                k.arena_lower_bound_bytes
            );
        }
    }
}

#[test]
fn a_gpt_on_two_threads_gives_the_bits_of_one() {
    use carve::nn::{Input, Labels, Network, Updater};
    // Enough rows (8 · 64, 64 wide) that the products, GELU and the layer norms split
    // across the pool; small otherwise, as it runs under valgrind too.
    let (ids, next) = windows(8, 64, 29);
    let mut traces = Vec::new();
    for threads in [1, 2] {
        let config = tiny_gpt(29, 64, 2, 64, 1).updater(Updater::adamw(1e-3, 0.1)).seed(3).build().unwrap();
        let mut net = Network::new(config).unwrap();
        net.set_threads(threads).unwrap();
        let losses: Vec<u32> = (0..2)
            .map(|_| net.fit_batch(Input::tokens(ids.view()), Labels::from(next.view())).unwrap().to_bits())
            .collect();
        traces.push((losses, net.params().to_vec()));
    }
    assert_eq!(traces[0].0, traces[1].0, "the losses");
    assert!(traces[0].1 == traces[1].1, "the parameters");
}

#[test]
fn attention_split_across_threads_gives_the_bits_of_one_with_padding_and_both_forms() {
    use carve::nn::{Input, Labels, Network, Updater};
    use ndarray::Array3;
    // 7 sequences (an odd split over 2 and 3 threads), the last steps of some padded.
    let (batch, steps) = (7, 12);
    let x = Array3::from_shape_fn((batch, steps, 16), |(b, t, f)| (((b * 5 + t * 3 + f) % 7) as f32 - 3.0) * 0.3);
    let y = Array2::from_shape_fn((batch, steps), |(b, t)| ((b * 5 + t * 3) % 7 % 4) as u32);
    let mask = Array2::from_shape_fn((batch, steps), |(b, t)| if t + b % 3 < steps { 1.0f32 } else { 0.0 });
    for recompute in [false, true] {
        let mut traces = Vec::new();
        for threads in [1, 2, 3] {
            let builder = NetworkConfig::builder(16).layer_norm();
            let builder = if recompute { builder.attention_recompute(4) } else { builder.attention(4) };
            let config = builder.dense(4).updater(Updater::adam(3e-3)).seed(5).build().unwrap();
            let mut net = Network::new(config).unwrap();
            net.set_threads(threads).unwrap();
            let losses: Vec<u32> = (0..3)
                .map(|_| {
                    let input = Input::Sequences { features: x.view(), mask: Some(mask.view()) };
                    net.fit_batch(input, Labels::from(y.view())).unwrap().to_bits()
                })
                .collect();
            traces.push((losses, net.params().to_vec()));
        }
        for (threads, trace) in [2, 3].iter().zip(&traces[1..]) {
            assert_eq!(trace.0, traces[0].0, "recompute {recompute}, {threads} threads: the losses");
            assert!(trace.1 == traces[0].1, "recompute {recompute}, {threads} threads: the parameters");
        }
    }
}

#[test]
fn a_padded_steps_values_never_reach_a_live_step_even_as_nan() {
    // Padded steps hold anything (nothing checks them): NaN there gives the live steps
    // the bits that zeros there give, in both forms, at a padding that ends inside a
    // tile of the products (steps 7 and 21 of 24, in rows of 6).
    let case = &fixture()["attention"];
    let width = tensor3(&case["x"]).shape()[2];
    let (batch, steps) = (3, 24);
    let x = ndarray::Array3::from_shape_fn((batch, steps, width), |(b, t, f)| {
        ((b * 7 + t * 3 + f) % 11) as f32 * 0.1 - 0.5
    });
    let dy =
        ndarray::Array3::from_shape_fn((batch, steps, width), |(b, t, f)| ((b + t * 5 + f * 3) % 7) as f32 * 0.1 - 0.3);
    let live = [7, 21, 24];
    let mask = Array2::from_shape_fn((batch, steps), |(b, t)| if t < live[b] { 1.0f32 } else { 0.0 });
    let padded_with = |v: f32| {
        let mut x = x.clone();
        x.indexed_iter_mut().filter(|((b, t, _), _)| *t >= live[*b]).for_each(|(_, x)| *x = v);
        x
    };
    for recompute in [false, true] {
        let mut zeros = attention_from(case, width, recompute);
        let mut nans = attention_from(case, width, recompute);
        let (y0, dx0, g0) = sequence_pass(&mut zeros, &padded_with(0.0), Some(&mask), &dy);
        let (y1, dx1, g1) = sequence_pass(&mut nans, &padded_with(f32::NAN), Some(&mask), &dy);
        for b in 0..batch {
            for t in 0..live[b] {
                for f in 0..width {
                    let (a, n) = ((y0[[b, t, f]], dx0[[b, t, f]]), (y1[[b, t, f]], dx1[[b, t, f]]));
                    assert!(a.0.is_finite() && a.0 == n.0, "recompute {recompute}: y at ({b}, {t}, {f})");
                    assert!(a.1.is_finite() && a.1 == n.1, "recompute {recompute}: dx at ({b}, {t}, {f})");
                }
            }
        }
        // The weights' gradients read the padded inputs (xᵀ·d_qkv with a zero d_qkv row
        // there), so only the biases' and the output projection's are compared.
        for p in [1, 2, 3] {
            assert!(g0[p] == g1[p] && g0[p].iter().all(|v| v.is_finite()), "recompute {recompute}: gradient {p}");
        }
    }
}

/// A user's token layer: each step's id (one feature, as the network hands on
/// `Input::Tokens`) as a one-hot row of `vocab` features.
struct OneHot {
    vocab: usize,
}

impl carve::nn::Layer for OneHot {
    fn name(&self) -> &str {
        "one_hot"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        assert_eq!(inputs, self.vocab, "the network's inputs are its vocabulary");
        Ok(self.vocab)
    }
    fn per_step(&self) -> bool {
        true
    }
    fn reads_tokens(&self) -> bool {
        true
    }
    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        ids: ndarray::ArrayView2<'a, f32>,
        ctx: &carve::nn::ForwardCtx<'a, '_>,
    ) -> carve::Result<ndarray::ArrayView2<'a, f32>> {
        assert_eq!(ids.ncols(), 1, "one id a step");
        let hot =
            ctx.activations.from_shape_fn((ids.nrows(), self.vocab), |(r, c)| f32::from(ids[[r, 0]] as usize == c))?;
        Ok(carve::freeze(hot))
    }
    fn backward_rows(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        _pass: carve::nn::RowsPass<'_>,
        _grad_input: Option<ndarray::ArrayViewMut2<'_, f32>>,
        _ctx: &carve::nn::BackwardCtx<'_>,
    ) -> carve::Result<()> {
        Ok(())
    }
}

#[test]
fn a_users_token_layer_is_dry_run_with_token_ids_and_must_come_first() {
    use carve::nn::{dry::BatchShape, dry::DryPass, Input, Labels, Network};
    // A dry run used to take only carve's own embedding for a token layer: a user's was
    // fed `vocab` features a step, and refused them.
    let (ids, next) = windows(3, 8, 11);
    let config = NetworkConfig::builder(11).layer(OneHot { vocab: 11 }).dense(16).relu().dense(11).build().unwrap();
    let mut net = Network::new(config).unwrap();
    let shape = BatchShape::tokens(3, 8);
    let run = [DryPass::Train(shape), DryPass::Train(shape), DryPass::Infer(shape)];
    let estimate = net.dry_run(&run).unwrap();
    net.fit_batch(Input::tokens(ids.view()), Labels::from(next.view())).unwrap();
    assert_eq!(net.last_iteration_workspace_bytes(), estimate.per_pass_bytes[0]);
    net.fit_batch(Input::tokens(ids.view()), Labels::from(next.view())).unwrap();
    assert_eq!(net.last_iteration_workspace_bytes(), estimate.per_pass_bytes[1]);
    net.output(Input::tokens(ids.view())).unwrap();
    assert_eq!(net.last_inference_workspace_bytes(), estimate.per_pass_bytes[2]);
    // Like an embedding, it reads the batch's ids: anywhere but first it is refused.
    match NetworkConfig::builder(11).dense(11).layer(OneHot { vocab: 11 }).dense(11).build() {
        Err(carve::Error::InvalidConfig { reason }) => assert!(reason.contains("'one_hot' is layer 1"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_gpt_fits_over_token_windows_with_the_bits_of_fit_batch_on_the_same_windows() {
    use carve::async_iter::{Prefetcher, TokenWindows};
    use carve::nn::{Input, Labels, Network, Updater};
    use ndarray::Ix2;
    let text: Vec<u32> = (0..400).map(|i| ((i * 7 + i / 5) % 13) as u32).collect();
    let source = || TokenWindows::new(text.clone(), 12, 4, 3).unwrap().seeded(3);
    let config = || tiny_gpt(13, 16, 2, 16, 2).updater(Updater::adam(1e-2)).seed(4).build().unwrap();
    let (mut fitted, mut direct) = (Network::new(config()).unwrap(), Network::new(config()).unwrap());
    let mut batches = Prefetcher::builder(source()).build().unwrap();
    let mut copies = Prefetcher::builder(source()).build().unwrap();
    for epoch in 0..3 {
        let mean = fitted.fit(&mut batches).unwrap();
        let (mut sum, mut count) = (0.0f64, 0);
        while let Some(batch) = copies.next() {
            let batch = batch.unwrap();
            let (x, y) = (batch.features::<u32, Ix2>().unwrap(), batch.labels::<u32, Ix2>().unwrap());
            sum += f64::from(direct.fit_batch(Input::tokens(x), Labels::from(y)).unwrap());
            count += 1;
        }
        copies.reset().unwrap();
        assert_eq!(count, 3);
        assert_eq!(mean.to_bits(), ((sum / 3.0) as f32).to_bits(), "epoch {epoch}");
    }
    assert_eq!(fitted.iterations(), 9);
    // Evaluation over the same windows: the accuracy of the network's own outputs.
    let (mut right, mut steps) = (0usize, 0usize);
    while let Some(batch) = copies.next() {
        let batch = batch.unwrap();
        let (x, y) = (batch.features::<u32, Ix2>().unwrap(), batch.labels::<u32, Ix2>().unwrap());
        let probs = fitted.output(Input::tokens(x)).unwrap();
        for (row, &label) in probs.rows().into_iter().zip(y.iter()) {
            let best = (0..row.len()).fold(0, |b, j| if row[j] > row[b] { j } else { b });
            right += usize::from(best == label as usize);
            steps += 1;
        }
    }
    let accuracy = fitted.evaluate_batches(&mut batches).unwrap();
    assert_eq!(steps, 3 * 4 * 12);
    assert_eq!(accuracy, right as f64 / steps as f64);
}
