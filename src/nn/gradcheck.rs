//! Gradient checks of a layer, as DL4J's `GradientCheckUtil` checks a network's: the
//! gradients a layer's backward pass gives against central differences of its forward
//! pass.
//!
//! The layer runs on its own, as a network runs it (its parameters, their gradients and
//! its tape held here), with workspaces off: in managers laid out as those a network of
//! [`WorkspaceMode::None`] trains in (their heap workspaces its own, so that nothing is
//! shared with the thread's networks), each role open where a
//! network's step has it open (`Input`, `Activations` and `FfCache` through the forward
//! and backward passes, `ActivationGrad` while the input's gradient is written), so that
//! a layer that trains passes its check (one that keeps a value in `FfCache` for its
//! backward pass included). Its output is reduced to one number, `L =
//! Σ r·y` over a fixed random `r` (0 at padded steps, whose outputs nothing reads), so
//! that `r` is the gradient of `L` with respect to the output: the backward pass gets
//! `r` as its output's gradient, and each input and parameter element's gradient is
//! compared with `(L(+ε) − L(−ε)) / 2ε`, summed in `f64`.
//!
//! carve computes in `f32`, where DL4J checks in `f64`: the step is `1e-2` and the
//! tolerance a relative `2e-2` by default ([`GradCheck`]). An input's padded steps are
//! not checked (their gradient is 0 by contract, and a network zeroes a user's layer's
//! there).
//!
//! ```
//! use carve::nn::gradcheck::{check_layer, GradCheck};
//! use carve::nn::{initial_params, Activations, Dense};
//! use ndarray::Array2;
//!
//! let dense = Dense::new(5, 3);
//! let params = initial_params(&dense, 5, 7);
//! let x = Array2::from_shape_fn((4, 5), |(i, j)| ((i * 5 + j) % 7) as f32 / 7.0 - 0.4);
//! let report = check_layer(&dense, &params, Activations::Flat(x.view()), None, &GradCheck::default())?;
//! assert!(report.passed(), "{report}");
//! assert_eq!(report.checked, 4 * 5 + 5 * 3 + 3);
//! # Ok::<(), carve::Error>(())
//! ```

use std::fmt;

use ndarray::{Array2, Array3, ArrayView2};
use workspace_core::{ArrayType, LayerWorkspaceMgr};

use super::network::{training_mgrs_in, LEARNING};
use workspace_core::{WorkspaceManager, WorkspaceMode};

use super::layer::{Activations, BackwardCtx, ForwardCtx, GradInput, Layer, Pass, Tape, UninitGradInput};
use crate::{Error, Result};

/// How a check is made.
#[derive(Clone, Debug)]
pub struct GradCheck {
    /// The central difference's step, added to and taken from each element.
    pub epsilon: f32,
    /// The largest relative error accepted: `|n − a| / max(|n|, |a|)`.
    pub max_relative_error: f64,
    /// An absolute error at most this passes whatever its relative error (DL4J's
    /// `minAbsoluteError`: gradients near 0 differ by rounding alone).
    pub min_absolute_error: f64,
    /// At most this many elements of each tensor (the input, each parameter) are
    /// checked, evenly spaced; `None`: all of them (`Some(0)`, which would check
    /// nothing, is refused).
    pub max_per_tensor: Option<usize>,
    /// Seed of the output's weights `r`.
    pub seed: u64,
}

impl Default for GradCheck {
    fn default() -> GradCheck {
        GradCheck { epsilon: 1e-2, max_relative_error: 2e-2, min_absolute_error: 1e-4, max_per_tensor: None, seed: 0 }
    }
}

/// One element whose gradients disagree.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// The element: `input[i, j]` (or `input[b, t, f]`), or `{parameter}[k]`.
    pub element: String,
    /// The central difference.
    pub numeric: f64,
    /// What the backward pass gave.
    pub analytic: f32,
    /// `|numeric − analytic| / max(|numeric|, |analytic|)`.
    pub relative_error: f64,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: backward pass {} against central difference {} (relative error {:.3e})",
            self.element, self.analytic, self.numeric, self.relative_error
        )
    }
}

/// What a check found.
#[derive(Clone, Debug, PartialEq)]
pub struct GradReport {
    /// The layer's name.
    pub layer: String,
    /// Elements checked (input and parameters).
    pub checked: usize,
    /// The elements whose gradients disagree, in the order checked.
    pub failures: Vec<Mismatch>,
    /// The largest relative error among the elements checked.
    pub worst_relative_error: f64,
}

impl GradReport {
    /// Whether every element checked agrees.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

impl fmt::Display for GradReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "layer '{}': {} of {} gradients disagree (worst relative error {:.3e})",
            self.layer,
            self.failures.len(),
            self.checked,
            self.worst_relative_error
        )?;
        for failure in self.failures.iter().take(10) {
            write!(f, "\n  {failure}")?;
        }
        if self.failures.len() > 10 {
            write!(f, "\n  … and {} more", self.failures.len() - 10)?;
        }
        Ok(())
    }
}

/// Checks `layer`'s backward pass at `params` (in [`Layer::param_shapes`]' layout for
/// the input's features) and `input` (a flat batch, or sequences with `mask`) against
/// central differences of its forward pass; see the module documentation. A layer that
/// reads token ids ([`Layer::reads_tokens`]) has its parameters checked, not its input.
///
/// # Errors
///
/// [`Error::InvalidInput`] when `params` is not as long as the layer's parameters, the
/// input is empty, a mask is given with a flat batch or is of another shape than the
/// sequences' `[batch, time]`, the check's settings are not a positive finite step and
/// tolerances, or the layer's output changes shape between passes (or, of sequences
/// with a mask, is not of the mask's `[batch, time]`); the layer's own errors (a
/// forward or backward pass that fails is not a gradient that disagrees);
/// [`Error::NonFinite`] when the forward pass gives a value that is not finite at a
/// step that holds data.
pub fn check_layer(
    layer: &dyn Layer,
    params: &[f32],
    input: Activations<'_>,
    mask: Option<ArrayView2<'_, f32>>,
    check: &GradCheck,
) -> Result<GradReport> {
    let name = layer.name().to_string();
    let invalid = |why: String| Error::InvalidInput(format!("gradient check of layer '{name}': {why}"));
    let settled = check.epsilon.is_finite()
        && check.epsilon > 0.0
        && check.max_relative_error.is_sign_positive()
        && check.min_absolute_error.is_sign_positive()
        && !check.max_relative_error.is_nan()
        && !check.min_absolute_error.is_nan();
    if !settled {
        return Err(invalid(format!(
            "a step of {} and tolerances of {} (relative) and {} (absolute): the step must be finite and above 0, \
             the tolerances at least 0",
            check.epsilon, check.max_relative_error, check.min_absolute_error
        )));
    }
    if check.max_per_tensor == Some(0) {
        return Err(invalid(
            "max_per_tensor of 0 checks no element, and would pass any layer: give at least 1, or None for all".into(),
        ));
    }
    let features = match input {
        Activations::Flat(x) => x.ncols(),
        Activations::Sequence(x) => x.dim().2,
    };
    let shapes = layer.param_shapes(features);
    let count = shapes.iter().try_fold(0usize, |n, s| n.checked_add(s.len()));
    if count != Some(params.len()) {
        return Err(invalid(format!(
            "{} parameter values given, the layer has {} for {features} inputs",
            params.len(),
            count.map_or_else(|| "more than the address space holds".to_string(), |c| c.to_string())
        )));
    }
    if input.shape().contains(&0) {
        return Err(invalid("the input is empty".into()));
    }
    match (&mask, input) {
        (Some(_), Activations::Flat(_)) => return Err(invalid("a mask comes with sequences, not a flat batch".into())),
        (Some(m), Activations::Sequence(x)) if m.dim() != (x.dim().0, x.dim().1) => {
            return Err(invalid(format!("a mask of {:?} for sequences of {:?}", m.shape(), x.shape())))
        }
        _ => {}
    }
    let live = |b: usize, t: usize| mask.as_ref().is_none_or(|m| m[[b, t]] != 0.0);
    // A registry of heap workspaces of the check's own: the layer's roles share them as
    // a network's do, and nothing is shared with (or left in) the thread's.
    let heaps = WorkspaceManager::private_heaps();
    let [mgr, _] = training_mgrs_in(WorkspaceMode::None, LEARNING, Some(&heaps), None)?;
    let mut run = Run { layer, params: params.to_vec(), grads: vec![0.0; params.len()], tape: layer.tape(), mask, mgr };
    let mut x = Owned::of(input);
    // The output's weights: its shape from one forward pass, 0 at padded steps.
    let shape = run.output_shape(&x)?;
    if let (Some(m), [b, t, _]) = (&mask, shape.as_slice()) {
        if m.dim() != (*b, *t) {
            return Err(invalid(format!("its output {shape:?} is not of the mask's [batch, time] {:?}", m.shape())));
        }
    }
    let mut rng = carve_rng::Rng::new(check.seed);
    let r = Owned::weights(&shape, &mut rng, &live);
    // The backward pass's gradients.
    let analytic_input = run.analytic(&x, &r)?;
    let analytic_params = run.grads.clone();
    let mut report = GradReport { layer: name.clone(), checked: 0, failures: Vec::new(), worst_relative_error: 0.0 };
    let eps = check.epsilon;
    // The input's elements (not its padded steps; none of a layer that reads token ids).
    let steps = x.steps();
    let live_input = |e: usize| !layer.reads_tokens() && steps.is_none_or(|(t, f)| live(e / (t * f), e / f % t));
    let live_inputs = (0..x.len()).filter(|&e| live_input(e)).count();
    let mut inputs = (0..x.len()).filter(|&e| live_input(e));
    let mut taken = 0;
    for nth in subset(live_inputs, check.max_per_tensor) {
        let e = inputs.by_ref().nth(nth - taken).expect("a live element of the input");
        taken = nth + 1;
        let keep = x.get(e);
        let (plus, minus) = (keep + eps, keep - eps);
        x.set(e, plus);
        let up = run.loss(&x, &r, &shape, &name)?;
        x.set(e, minus);
        let down = run.loss(&x, &r, &shape, &name)?;
        x.set(e, keep);
        let numeric = (up - down) / (f64::from(plus) - f64::from(minus));
        report.compare(x.element(e), numeric, analytic_input[e], check);
    }
    // Each parameter's elements.
    let mut start = 0;
    for param in &shapes {
        for i in subset(param.len(), check.max_per_tensor) {
            let k = start + i;
            let keep = run.params[k];
            let (plus, minus) = (keep + eps, keep - eps);
            run.params[k] = plus;
            let up = run.loss(&x, &r, &shape, &name)?;
            run.params[k] = minus;
            let down = run.loss(&x, &r, &shape, &name)?;
            run.params[k] = keep;
            let numeric = (up - down) / (f64::from(plus) - f64::from(minus));
            report.compare(format!("{}[{i}]", param.name), numeric, analytic_params[k], check);
        }
        start += param.len();
    }
    Ok(report)
}

/// The positions of at most `max` of `len` elements, evenly spaced and in order
/// (`i·len/max`); all of them when `max` is `None` or at least `len`.
fn subset(len: usize, max: Option<usize>) -> impl Iterator<Item = usize> {
    let take = max.map_or(len, |max| max.min(len));
    (0..take).map(move |i| if take == len { i } else { (i as u128 * len as u128 / take as u128) as usize })
}

impl GradReport {
    fn compare(&mut self, element: String, numeric: f64, analytic: f32, check: &GradCheck) {
        let a = f64::from(analytic);
        let error = (numeric - a).abs();
        let scale = numeric.abs().max(a.abs());
        let relative = if scale > 0.0 { error / scale } else { 0.0 };
        self.checked += 1;
        if !analytic.is_finite()
            || !numeric.is_finite()
            || (relative > check.max_relative_error && error > check.min_absolute_error)
        {
            self.failures.push(Mismatch { element, numeric, analytic, relative_error: relative });
        }
        if relative.is_finite() {
            self.worst_relative_error = self.worst_relative_error.max(relative);
        }
    }
}

/// An input, or an output's weights, owned: a flat batch or sequences.
enum Owned {
    Flat(Array2<f32>),
    Sequence(Array3<f32>),
}

impl Owned {
    fn of(input: Activations<'_>) -> Owned {
        match input {
            // Standard layout whatever the caller's (a transposed or sliced view).
            Activations::Flat(x) => Owned::Flat(x.as_standard_layout().into_owned()),
            Activations::Sequence(x) => Owned::Sequence(x.as_standard_layout().into_owned()),
        }
    }

    /// Weights of `shape` in `[-1, 1)`, 0 at padded steps.
    fn weights(shape: &[usize], rng: &mut carve_rng::Rng, live: &impl Fn(usize, usize) -> bool) -> Owned {
        match *shape {
            [rows, cols] => Owned::Flat(Array2::from_shape_simple_fn((rows, cols), || rng.uniform(-1.0, 1.0))),
            [b, t, f] => Owned::Sequence(Array3::from_shape_fn((b, t, f), |(i, j, _)| {
                let w = rng.uniform(-1.0, 1.0);
                if live(i, j) {
                    w
                } else {
                    0.0
                }
            })),
            _ => unreachable!("an output is a flat batch or sequences"),
        }
    }

    fn view(&self) -> Activations<'_> {
        match self {
            Owned::Flat(x) => Activations::Flat(x.view()),
            Owned::Sequence(x) => Activations::Sequence(x.view()),
        }
    }

    fn len(&self) -> usize {
        match self {
            Owned::Flat(x) => x.len(),
            Owned::Sequence(x) => x.len(),
        }
    }

    fn slice(&self) -> &[f32] {
        match self {
            Owned::Flat(x) => x.as_slice().expect("an owned array is standard"),
            Owned::Sequence(x) => x.as_slice().expect("an owned array is standard"),
        }
    }

    fn get(&self, e: usize) -> f32 {
        self.slice()[e]
    }

    fn set(&mut self, e: usize, value: f32) {
        match self {
            Owned::Flat(x) => x.as_slice_mut().expect("an owned array is standard")[e] = value,
            Owned::Sequence(x) => x.as_slice_mut().expect("an owned array is standard")[e] = value,
        }
    }

    /// Of sequences, their steps and features; `None` for a flat batch.
    fn steps(&self) -> Option<(usize, usize)> {
        match self {
            Owned::Flat(_) => None,
            Owned::Sequence(x) => Some((x.dim().1, x.dim().2)),
        }
    }

    /// Element `e`'s name.
    fn element(&self, e: usize) -> String {
        match self {
            Owned::Flat(x) => format!("input[{}, {}]", e / x.ncols(), e % x.ncols()),
            Owned::Sequence(x) => {
                let (_, t, f) = x.dim();
                format!("input[{}, {}, {}]", e / (t * f), e / f % t, e % f)
            }
        }
    }
}

/// The layer, run on its own, over batches of one mask.
struct Run<'l> {
    layer: &'l dyn Layer,
    params: Vec<f32>,
    grads: Vec<f32>,
    tape: Tape,
    mask: Option<ArrayView2<'l, f32>>,
    /// A network's first training manager with workspaces off.
    mgr: LayerWorkspaceMgr,
}

impl<'l> Run<'l> {
    /// A training forward pass of `x` in `ctx`: its output, checked to be finite at the
    /// steps that hold data (padded steps' outputs are read by nothing).
    fn forward<'a>(&mut self, x: Activations<'a>, ctx: &ForwardCtx<'a, '_>) -> Result<Activations<'a>>
    where
        'l: 'a,
    {
        let y = self.layer.forward(&self.params, x, self.mask, &mut self.tape, ctx)?;
        let finite = match (y, &self.mask) {
            (Activations::Sequence(y), Some(m)) if (y.dim().0, y.dim().1) == m.dim() => {
                y.indexed_iter().all(|((b, t, _), v)| v.is_finite() || m[[b, t]] == 0.0)
            }
            (Activations::Flat(y), _) => y.iter().all(|v| v.is_finite()),
            (Activations::Sequence(y), _) => y.iter().all(|v| v.is_finite()),
        };
        if !finite {
            return Err(Error::NonFinite {
                layer: self.layer.name().to_string(),
                what: "its output in a gradient check (a value is not finite)".into(),
            });
        }
        Ok(y)
    }

    fn output_shape(&mut self, x: &Owned) -> Result<Vec<usize>> {
        let mgr = self.mgr.clone();
        let (act, working) = (mgr.enter(ArrayType::Activations)?, mgr.enter(ArrayType::FfWorkingMem)?);
        let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: true };
        Ok(self.forward(x.view(), &ctx)?.shape().to_vec())
    }

    /// `Σ r·y`, in `f64`, over the weights that are not 0 (padded steps' outputs are
    /// not read); the output must be of `shape`, the first pass's.
    fn loss(&mut self, x: &Owned, r: &Owned, shape: &[usize], name: &str) -> Result<f64> {
        let mgr = self.mgr.clone();
        let (act, working) = (mgr.enter(ArrayType::Activations)?, mgr.enter(ArrayType::FfWorkingMem)?);
        let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: true };
        let y = self.forward(x.view(), &ctx)?;
        if y.shape() != shape {
            return Err(Error::InvalidInput(format!(
                "gradient check of layer '{name}': its output changed shape between passes, from {shape:?} to {:?}",
                y.shape()
            )));
        }
        let dot = |y: &mut dyn Iterator<Item = f32>| {
            y.zip(r.slice()).filter(|(_, &r)| r != 0.0).map(|(y, &r)| f64::from(y) * f64::from(r)).sum()
        };
        Ok(match y {
            Activations::Flat(y) => dot(&mut y.iter().copied()),
            Activations::Sequence(y) => dot(&mut y.iter().copied()),
        })
    }

    /// The backward pass's gradient of the input (in standard order; none for a layer
    /// that reads token ids), the parameters' left in `grads`.
    fn analytic(&mut self, x: &Owned, r: &Owned) -> Result<Vec<f32>> {
        let mgr = self.mgr.clone();
        let act = mgr.enter(ArrayType::Activations)?;
        let y = {
            let working = mgr.enter(ArrayType::FfWorkingMem)?;
            let ctx = ForwardCtx { activations: &act, working: &working, mgr: &mgr, training: true };
            self.forward(x.view(), &ctx)?
        };
        self.grads.fill(0.0);
        let working = mgr.enter(ArrayType::BpWorkingMem)?;
        let ctx = BackwardCtx { working: &working, mgr: &mgr };
        let pass = Pass { input: x.view(), mask: self.mask, output: y, grad_output: r.view() };
        let (layer, params, grads, tape) = (self.layer, &self.params, &mut self.grads, &mut self.tape);
        if layer.reads_tokens() {
            // Token ids have no gradient.
            layer.backward(params, grads, pass, None, tape, &ctx)?;
            return Ok(Vec::new());
        }
        // What a network runs when it needs the input's gradient: `backward_uninit`
        // (by default, zeros then `backward`), its elements given back written, with the
        // input gradients' workspace open (here the gradient is an array of its own).
        let _gradient = mgr.enter(ArrayType::ActivationGrad)?;
        let written = match x {
            Owned::Flat(x) => {
                let mut g = Array2::<f32>::uninit(x.raw_dim());
                let given =
                    layer.backward_uninit(params, grads, pass, UninitGradInput::Flat(g.view_mut()), tape, &ctx)?;
                match given {
                    GradInput::Flat(g) => g.iter().copied().collect(),
                    GradInput::Sequence(_) => Vec::new(),
                }
            }
            Owned::Sequence(x) => {
                let mut g = Array3::<f32>::uninit(x.raw_dim());
                let given =
                    layer.backward_uninit(params, grads, pass, UninitGradInput::Sequence(g.view_mut()), tape, &ctx)?;
                match given {
                    GradInput::Sequence(g) => g.iter().copied().collect(),
                    GradInput::Flat(_) => Vec::new(),
                }
            }
        };
        if written.len() != x.len() {
            return Err(Error::InvalidInput(format!(
                "gradient check of layer '{}': its backward pass gave back a gradient of another shape than its input",
                layer.name()
            )));
        }
        Ok(written)
    }
}
