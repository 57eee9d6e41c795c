//! The public gradient checker (`carve::nn::gradcheck`), as DL4J users use
//! `GradientCheckUtil`: carve's layers pass it, flat and over masked sequences, and a
//! layer whose backward pass is wrong is caught, named to the element.

use carve::nn::gradcheck::{check_layer, GradCheck};
use carve::nn::{
    initial_params, Activations, Attention, BackwardCtx, Dense, ForwardCtx, Gelu, Layer, LayerNorm, Lstm, ParamShape,
    Relu, RowsPass,
};
use carve_rng::Rng;
use ndarray::{Array2, Array3, ArrayView2, ArrayViewMut2};

fn flat(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
    let mut rng = Rng::new(seed);
    // Away from 0, where ReLU's kink would make a central difference straddle two slopes.
    Array2::from_shape_simple_fn((rows, cols), || rng.uniform(-1.0, 1.0)).mapv(|v| if v.abs() < 0.05 { 0.5 } else { v })
}

#[test]
fn carves_layers_pass_flat_and_over_masked_sequences() {
    let x = flat(5, 6, 1);
    let layers: Vec<Box<dyn Layer>> = vec![
        Box::new(Dense::new(6, 4)),
        Box::new(Relu::new()),
        Box::new(LayerNorm::named("ln")),
        Box::new(Gelu::new()),
    ];
    for layer in &layers {
        let params = initial_params(layer.as_ref(), 6, 3);
        let report =
            check_layer(layer.as_ref(), &params, Activations::Flat(x.view()), None, &GradCheck::default()).unwrap();
        assert!(report.passed(), "{report}");
        let count: usize = layer.param_shapes(6).iter().map(ParamShape::len).sum();
        assert_eq!(report.checked, x.len() + count, "every element of the input and the parameters");
    }
    // Sequences with padding: an LSTM and causal attention. Padded steps are not checked.
    let mut rng = Rng::new(2);
    let seq = Array3::from_shape_simple_fn((2, 5, 4), || rng.uniform(-1.0, 1.0));
    let mask = ndarray::array![[1.0f32, 1., 1., 1., 1.], [1., 1., 1., 0., 0.]];
    let live = 8 * 4;
    let layers: Vec<Box<dyn Layer>> =
        vec![Box::new(Lstm::new(4, 3).unwrap()), Box::new(Attention::named("att", 4, 2).unwrap())];
    for layer in &layers {
        let params = initial_params(layer.as_ref(), 4, 5);
        let check = GradCheck { max_per_tensor: Some(12), ..GradCheck::default() };
        let report =
            check_layer(layer.as_ref(), &params, Activations::Sequence(seq.view()), Some(mask.view()), &check).unwrap();
        assert!(report.passed(), "{report}");
        let tensors = layer.param_shapes(4).len();
        assert!(report.checked <= 12 * (tensors + 1) && report.checked >= 2 * (tensors + 1), "{}", report.checked);
        assert!(live > 12, "the input is subsampled");
    }
}

/// `y = x·W` (no bias) whose backward pass gets the input's gradient right and the
/// weights' wrong (`wrong_params`), or the other way round.
struct Faulty {
    wrong_params: bool,
}

impl Layer for Faulty {
    fn name(&self) -> &str {
        "faulty"
    }
    fn output_size(&self, _inputs: usize) -> carve::Result<usize> {
        Ok(2)
    }
    fn param_shapes(&self, inputs: usize) -> Vec<ParamShape> {
        vec![ParamShape::new("W", &[inputs, 2])]
    }
    fn init(&self, _inputs: usize, params: &mut [f32], _init: &mut carve::nn::Init<'_>) {
        for (k, p) in params.iter_mut().enumerate() {
            *p = 0.1 * k as f32 - 0.2;
        }
    }
    fn forward_rows<'a>(
        &self,
        params: &[f32],
        x: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        let w = ArrayView2::from_shape((x.ncols(), 2), params).unwrap();
        Ok(carve::freeze(ctx.activations.copy_of(&x.dot(&w))?))
    }
    fn backward_rows(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        _ctx: &BackwardCtx<'_>,
    ) -> carve::Result<()> {
        let w = ArrayView2::from_shape((pass.input.ncols(), 2), params).unwrap();
        let dw = pass.input.t().dot(&pass.grad_output);
        let scale = if self.wrong_params { 2.0 } else { 1.0 };
        for (g, d) in grads.iter_mut().zip(dw.iter()) {
            *g = scale * d;
        }
        if let Some(mut gi) = grad_input {
            let dx = pass.grad_output.dot(&w.t());
            let scale = if self.wrong_params { 1.0 } else { -1.0 };
            gi.zip_mut_with(&dx, |g, &d| *g = scale * d);
        }
        Ok(())
    }
}

/// `y = x²`, a user's layer that keeps a copy of its input in `FfCache` in its forward
/// and backward passes, and one of its output's gradient in `ActivationGrad` while it
/// writes its input's gradient, as a network's step lets it.
struct KeepsCopies;

impl Layer for KeepsCopies {
    fn name(&self) -> &str {
        "keeps-copies"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        x: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        let cache = ctx.mgr.borrow_open(carve::ArrayType::FfCache)?;
        let kept = cache.copy_of(&x)?;
        ctx.mgr.leverage_to(carve::ArrayType::FfCache, &x)?;
        Ok(carve::freeze(ctx.activations.copy_of(&kept.mapv(|v| v * v))?))
    }
    fn backward_rows(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        ctx: &BackwardCtx<'_>,
    ) -> carve::Result<()> {
        let cache = ctx.mgr.borrow_open(carve::ArrayType::FfCache)?;
        let x = cache.copy_of(&pass.input)?;
        if let Some(mut gi) = grad_input {
            // Open while the input's gradient is written.
            let grad = ctx.mgr.borrow_open(carve::ArrayType::ActivationGrad)?;
            let dy = grad.copy_of(&pass.grad_output)?;
            ndarray::Zip::from(&mut gi).and(&x).and(&dy).for_each(|g, &x, &d| *g = 2.0 * x * d);
        }
        Ok(())
    }
}

#[test]
fn a_layer_that_keeps_values_in_the_roles_a_network_opens_passes_as_it_trains() {
    let x = flat(4, 3, 9);
    let check = || check_layer(&KeepsCopies, &[], Activations::Flat(x.view()), None, &GradCheck::default()).unwrap();
    let report = check();
    assert!(report.passed() && report.checked == 12, "{report}");
    // The check's workspaces are its own: nothing is left in the thread's.
    assert!(carve::WorkspaceManager::heaps().ids().is_empty(), "{:?}", carve::WorkspaceManager::heaps().ids());
    // And a network trains it, workspaces off as the check runs it, whatever their
    // configuration (a check beside it shares nothing with it).
    let config = carve::nn::NetworkConfig::builder(3).dense(3).layer(KeepsCopies).dense(2);
    let config = config.training_workspace_mode(carve::WorkspaceMode::None);
    let config = config.workspace_learning(carve::LearningPolicy::None).seed(1).build().unwrap();
    let mut net = carve::nn::Network::new(config).unwrap();
    let y = ndarray::Array1::from(vec![0u32, 1, 0, 1]);
    assert!(net.fit_batch(x.view(), y.view()).unwrap().is_finite());
    assert_eq!(check().checked, 12);
    assert!(net.fit_batch(x.view(), y.view()).unwrap().is_finite());
}

#[test]
fn a_wrong_backward_pass_is_caught_and_named_to_the_element() {
    let x = flat(3, 4, 7);
    for wrong_params in [true, false] {
        let layer = Faulty { wrong_params };
        let params = initial_params(&layer, 4, 0);
        let report = check_layer(&layer, &params, Activations::Flat(x.view()), None, &GradCheck::default()).unwrap();
        assert!(!report.passed());
        assert_eq!(report.checked, 12 + 8);
        let named = |prefix: &str| report.failures.iter().filter(|f| f.element.starts_with(prefix)).count();
        if wrong_params {
            assert_eq!((named("W["), named("input[")), (8, 0), "{report}");
            let first = &report.failures[0];
            assert!((first.analytic as f64 / first.numeric - 2.0).abs() < 1e-2, "{first}");
        } else {
            assert_eq!((named("W["), named("input[")), (0, 12), "{report}");
        }
        assert!(report.to_string().starts_with("layer 'faulty': "), "{report}");
        assert!(report.worst_relative_error > 0.3, "{report}");
    }
}

#[test]
fn bad_calls_are_errors() {
    let dense = Dense::new(4, 2);
    let x = flat(3, 4, 1);
    let err = check_layer(&dense, &[0.0; 3], Activations::Flat(x.view()), None, &GradCheck::default()).unwrap_err();
    assert!(err.to_string().contains("3 parameter values given, the layer has 10 for 4 inputs"), "{err}");
    let params = initial_params(&dense, 4, 0);
    let empty = Array2::<f32>::zeros((0, 4));
    let err = check_layer(&dense, &params, Activations::Flat(empty.view()), None, &GradCheck::default()).unwrap_err();
    assert!(err.to_string().contains("the input is empty"), "{err}");
    let lstm = Lstm::new(4, 2).unwrap();
    let seq = Array3::<f32>::zeros((2, 3, 4));
    let mask = Array2::<f32>::ones((2, 4));
    let params = initial_params(&lstm, 4, 0);
    let err = check_layer(&lstm, &params, Activations::Sequence(seq.view()), Some(mask.view()), &GradCheck::default())
        .unwrap_err();
    assert!(err.to_string().contains("a mask of [2, 4] for sequences of [2, 3, 4]"), "{err}");
    // A forward pass that overflows is an error, not a gradient that disagrees.
    let huge = Array2::from_elem((2, 4), 3e38f32);
    let params = vec![3e38f32; 10];
    let err = check_layer(&dense, &params, Activations::Flat(huge.view()), None, &GradCheck::default()).unwrap_err();
    assert!(matches!(err, carve::Error::NonFinite { .. }), "{err:?}");
}

#[test]
fn any_layout_token_layers_subsets_and_settings() {
    let dense = Dense::new(4, 3);
    let params = initial_params(&dense, 4, 1);
    // A transposed batch is the same batch.
    let xt = flat(4, 5, 3);
    let standard = xt.t().to_owned();
    let check = GradCheck::default();
    let a = check_layer(&dense, &params, Activations::Flat(xt.t()), None, &check).unwrap();
    let b = check_layer(&dense, &params, Activations::Flat(standard.view()), None, &check).unwrap();
    assert!(a.passed() && b.passed(), "{a}\n{b}");
    assert_eq!((a.checked, a.worst_relative_error), (b.checked, b.worst_relative_error));
    // At most `max_per_tensor` of each tensor: one, or spread over all; none at all
    // would pass anything, and is refused.
    for (max, per) in [(Some(1), [1, 1, 1]), (Some(7), [7, 7, 3]), (None, [20, 12, 3])] {
        let check = GradCheck { max_per_tensor: max, ..GradCheck::default() };
        let report = check_layer(&dense, &params, Activations::Flat(standard.view()), None, &check).unwrap();
        assert_eq!(report.checked, per.iter().sum::<usize>(), "{max:?}");
    }
    let none = GradCheck { max_per_tensor: Some(0), ..GradCheck::default() };
    let err = check_layer(&dense, &params, Activations::Flat(standard.view()), None, &none).unwrap_err();
    assert!(err.to_string().contains("max_per_tensor of 0"), "{err}");
    // A token embedding: its table is checked, its ids are not (they have no gradient).
    let embedding = carve::nn::Embedding::named("embed", 6, 3).unwrap();
    let ids = Array3::from_shape_fn((2, 3, 1), |(b, t, _)| ((b * 3 + t) % 6) as f32);
    let table = initial_params(&embedding, 1, 4);
    let report = check_layer(&embedding, &table, Activations::Sequence(ids.view()), None, &check).unwrap();
    assert!(report.passed(), "{report}");
    assert_eq!(report.checked, 6 * 3);
    // Settings that would pass anything, and a mask without sequences, are refused.
    for bad in [
        GradCheck { epsilon: 0.0, ..GradCheck::default() },
        GradCheck { epsilon: f32::NAN, ..GradCheck::default() },
        GradCheck { max_relative_error: f64::NAN, ..GradCheck::default() },
        GradCheck { min_absolute_error: -1.0, ..GradCheck::default() },
    ] {
        let err = check_layer(&dense, &params, Activations::Flat(standard.view()), None, &bad).unwrap_err();
        assert!(err.to_string().contains("the step must be finite and above 0"), "{err}");
    }
    let mask = Array2::<f32>::ones((5, 1));
    let err = check_layer(&dense, &params, Activations::Flat(standard.view()), Some(mask.view()), &check).unwrap_err();
    assert!(err.to_string().contains("a mask comes with sequences"), "{err}");
}
