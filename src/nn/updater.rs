//! Parameter updaters: SGD with momentum, and Adam. Their state lives outside
//! workspaces (it persists across iterations). A step is checked in one pass that
//! computes every update, new moment and new value without storing any (so it needs no
//! memory), then stored in a second pass that computes them again with the same
//! arithmetic: a step updates everything or nothing.

use crate::{Error, Result};
use workspace_core::TypedScope;

use super::layer::{Layer, Param};
use super::simd::{self, AdamStep, Width};

/// How parameters follow their gradients.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Updater {
    /// `v ← momentum·v − lr·g; w ← w + v`.
    Sgd {
        /// Step size.
        learning_rate: f32,
        /// Momentum (0 for plain SGD).
        momentum: f32,
    },
    /// Adam (Kingma & Ba), with the bias correction folded into the step size as
    /// scikit-learn does.
    Adam {
        /// Step size.
        learning_rate: f32,
        /// Decay of the first moment.
        beta1: f32,
        /// Decay of the second moment.
        beta2: f32,
        /// Added to the root of the second moment.
        epsilon: f32,
    },
}

impl Updater {
    /// SGD with momentum.
    pub fn sgd(learning_rate: f32, momentum: f32) -> Updater {
        Updater::Sgd { learning_rate, momentum }
    }

    /// Adam with the usual constants (β₁ 0.9, β₂ 0.999, ε 1e-8).
    pub fn adam(learning_rate: f32) -> Updater {
        Updater::Adam { learning_rate, beta1: 0.9, beta2: 0.999, epsilon: 1e-8 }
    }
}

impl Default for Updater {
    fn default() -> Updater {
        Updater::adam(1e-3)
    }
}

/// An updater with its per-parameter state.
#[derive(Debug)]
pub(crate) struct UpdaterState {
    updater: Updater,
    step: u64,
    /// The number of parameters of each layer when the network was built; the
    /// buffers below hold them in layer order.
    layer_params: Vec<usize>,
    /// Velocity (SGD) or first moment (Adam), one buffer per parameter.
    first: Vec<Vec<f32>>,
    /// Second moment (Adam), one buffer per parameter.
    second: Vec<Vec<f32>>,
}

/// How a layer's parameters differ from those the updater state was built for.
#[derive(Clone, Copy, Debug)]
enum Mismatch {
    /// Another number of parameters.
    Count { expected: usize, actual: usize },
    /// Parameter `param` (of its layer) changed size.
    Size { param: usize, expected: usize, actual: usize },
    /// The gradient of parameter `param` is not as long as its values.
    Grad { param: usize, values: usize, grads: usize },
}

impl Mismatch {
    fn into_error(self, layer: &str) -> Error {
        match self {
            Mismatch::Count { expected, actual } => Error::InvalidInput(format!(
                "layer '{layer}' gave the updater {actual} parameter(s), but {expected} when the network was \
                 built: `Layer::params` must give the same parameters, in the same order, at every step"
            )),
            Mismatch::Size { param, expected, actual } => Error::ShapeMismatch {
                context: format!(
                    "layer '{layer}' parameter {param} (its size is fixed when the network is built, as the \
                     updater's state is)"
                ),
                expected: vec![expected],
                actual: vec![actual],
            },
            Mismatch::Grad { param, values, grads } => Error::ShapeMismatch {
                context: format!("layer '{layer}' gradient of parameter {param} (one per value)"),
                expected: vec![values],
                actual: vec![grads],
            },
        }
    }
}

/// Checks parameter `param` of a layer that had `expected` parameters of the sizes in
/// `sizes` when the network was built.
fn mismatch(sizes: &[Vec<f32>], expected: usize, param: usize, p: &Param<'_>) -> Option<Mismatch> {
    if param >= expected {
        return Some(Mismatch::Count { expected, actual: param + 1 });
    }
    let size = sizes[param].len();
    if p.value.len() != size {
        return Some(Mismatch::Size { param, expected: size, actual: p.value.len() });
    }
    if p.grad.len() != size {
        return Some(Mismatch::Grad { param, values: size, grads: p.grad.len() });
    }
    None
}

impl UpdaterState {
    pub(crate) fn new(updater: Updater, layers: &mut [Box<dyn Layer>]) -> UpdaterState {
        let mut sizes = Vec::new();
        let mut layer_params = Vec::with_capacity(layers.len());
        for layer in layers.iter_mut() {
            let before = sizes.len();
            layer.params(&mut |p| sizes.push(p.value.len()));
            layer_params.push(sizes.len() - before);
        }
        let second = match updater {
            Updater::Adam { .. } => sizes.iter().map(|&n| vec![0.0; n]).collect(),
            Updater::Sgd { .. } => Vec::new(),
        };
        UpdaterState { updater, step: 0, layer_params, first: sizes.iter().map(|&n| vec![0.0; n]).collect(), second }
    }

    pub(crate) fn updater(&self) -> Updater {
        self.updater
    }

    /// One step over every parameter of `layers` (`_working`, the updater working memory,
    /// is not needed: the check stores nothing).
    ///
    /// The step is checked before anything is stored: the parameters are checked first,
    /// then every update is computed, with the new moments (or velocities) and parameter
    /// values, and checked to be finite, in one pass that stores nothing; only then are
    /// the moments and parameters written, each update computed again as it is stored
    /// (the same arithmetic, so the same numbers; storing needs no memory, so it cannot
    /// fail half-way). So a step updates every parameter and its state, or none.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when a layer gives another number of parameters than
    /// when the network was built; [`Error::ShapeMismatch`] when a parameter changed
    /// size, or its gradient is not as long as its values; [`Error::NonFinite`] naming
    /// the layer when a moment, update or new parameter value would not be finite.
    pub(crate) fn apply(&mut self, layers: &mut [Box<dyn Layer>], _working: &TypedScope) -> Result<()> {
        {
            let _span = super::profile::span(super::profile::Part::Checks);
            self.check(layers)?;
        }
        let t = (self.step + 1) as i32;
        let (first, second, updater) = (&mut self.first, &mut self.second, self.updater);
        // Check: every update, each in a frame of updater working memory.
        let mut base = 0;
        for (layer, &expected) in layers.iter_mut().zip(&self.layer_params) {
            let mut param = 0;
            let mut failure = None;
            layer.params(&mut |p| {
                if failure.is_some() {
                    return;
                }
                // Checked above; checked again in case `params` changes between calls.
                if let Some(m) = mismatch(&first[base..base + expected], expected, param, &p) {
                    failure = Some(Failure::Mismatch(m));
                    return;
                }
                let index = base + param;
                let v = second.get(index).map(Vec::as_slice);
                if let Some((element, what, value)) = first_non_finite(updater, t, &first[index], v, &p) {
                    let grad = p.grad[element];
                    failure = Some(Failure::NonFinite { param, element, what, value, grad });
                }
                param += 1;
            });
            match failure {
                Some(failure) => return Err(failure.into_error(layer.name())),
                None if param != expected => {
                    return Err(Mismatch::Count { expected, actual: param }.into_error(layer.name()))
                }
                None => {}
            }
            base += expected;
        }

        // Commit: the moments and the parameters, each update computed again.
        self.step += 1;
        let mut base = 0;
        for (layer, &expected) in layers.iter_mut().zip(&self.layer_params) {
            let mut param = 0;
            let mut failure = None;
            layer.params(&mut |p| {
                if failure.is_some() {
                    return;
                }
                // `params` gave these very parameters to the check just above; a layer
                // whose `params` changes between two calls gets an error here.
                if let Some(m) = mismatch(&first[base..base + expected], expected, param, &p) {
                    failure = Some(m);
                    return;
                }
                let index = base + param;
                param += 1;
                commit(updater, t, &mut first[index], second.get_mut(index).map(Vec::as_mut_slice), p);
            });
            match failure {
                Some(m) => return Err(m.into_error(layer.name())),
                None if param != expected => {
                    return Err(Mismatch::Count { expected, actual: param }.into_error(layer.name()))
                }
                None => {}
            }
            base += expected;
        }
        Ok(())
    }

    /// Checks that `layers` give the parameters the state was built for: as many per
    /// layer, each of the same size, each with a gradient as long as its values.
    fn check(&self, layers: &mut [Box<dyn Layer>]) -> Result<()> {
        if layers.len() != self.layer_params.len() {
            return Err(Error::InvalidInput(format!(
                "the updater was built for {} layers, and is given {}",
                self.layer_params.len(),
                layers.len()
            )));
        }
        let mut base = 0;
        for (layer, &expected) in layers.iter_mut().zip(&self.layer_params) {
            let sizes = &self.first[base..base + expected];
            let mut param = 0;
            let mut failure = None;
            layer.params(&mut |p| {
                if failure.is_none() && param < expected {
                    failure = mismatch(sizes, expected, param, &p);
                }
                param += 1;
            });
            if param != expected {
                failure = Some(Mismatch::Count { expected, actual: param });
            }
            if let Some(m) = failure {
                return Err(m.into_error(layer.name()));
            }
            base += expected;
        }
        Ok(())
    }
}

/// Why a parameter's step could not be taken.
enum Failure {
    /// The parameters are not those the state was built for.
    Mismatch(Mismatch),
    /// A value of the step would not be finite.
    NonFinite { param: usize, element: usize, what: &'static str, value: f32, grad: f32 },
}

impl Failure {
    fn into_error(self, layer: &str) -> Error {
        match self {
            Failure::Mismatch(m) => m.into_error(layer),
            Failure::NonFinite { param, element, what, value, grad } => Error::NonFinite {
                layer: layer.to_string(),
                what: format!(
                    "the updater's {what} of its parameter {param} (element {element}) would be {value} (gradient \
                     {grad:e})"
                ),
            },
        }
    }
}

/// The first element of one parameter's step (from its state `m`, and `v` for Adam,
/// and gradient, at step `t`) whose new moment (or velocity), update or new value would
/// not be finite: its index, what it is, and the value. One pass that computes the step
/// as [`commit`] will, stores nothing, and keeps one flag per chunk, branch-free, so
/// that it vectorises; the element is looked for only when there is one.
fn first_non_finite(
    updater: Updater,
    t: i32,
    m: &[f32],
    v: Option<&[f32]>,
    p: &Param<'_>,
) -> Option<(usize, &'static str, f32)> {
    let n = p.value.len();
    let (values, grads, m) = (&p.value[..n], &p.grad[..n], &m[..n]);
    let finite = match (updater, v) {
        (Updater::Sgd { learning_rate, momentum }, _) => {
            values.chunks(64).zip(m.chunks(64)).zip(grads.chunks(64)).all(|((w, m), g)| {
                w.iter().zip(m).zip(g).fold(true, |ok, ((&w, &m), &g)| {
                    let u = sgd_velocity(learning_rate, momentum, m, g);
                    ok & u.is_finite() & (w + u).is_finite()
                })
            })
        }
        (Updater::Adam { learning_rate, beta1, beta2, epsilon }, Some(v)) => {
            let step = adam_step_size(learning_rate, beta1, beta2, t);
            simd::adam_finite(Width::detect(), AdamStep { beta1, beta2, epsilon, step }, p, m, v)
        }
        (Updater::Adam { .. }, None) => unreachable!("Adam's state has a second moment per parameter"),
    };
    if finite {
        return None;
    }
    (0..n).find_map(|i| {
        let found = match (updater, v) {
            (Updater::Adam { learning_rate, beta1, beta2, epsilon }, Some(v)) => {
                let step = adam_step_size(learning_rate, beta1, beta2, t);
                let (m, v, u) = simd::adam(AdamStep { beta1, beta2, epsilon, step }, m[i], v[i], grads[i]);
                non_finite(&[("first moment", m), ("second moment", v), ("update", u), ("new value", values[i] + u)])
            }
            (Updater::Sgd { learning_rate, momentum }, _) => {
                let u = sgd_velocity(learning_rate, momentum, m[i], grads[i]);
                non_finite(&[("velocity", u), ("new value", values[i] + u)])
            }
            (Updater::Adam { .. }, None) => unreachable!("Adam's state has a second moment per parameter"),
        };
        found.map(|(what, bad)| (i, what, bad))
    })
}

/// Stores a checked step of one parameter: the new moments (or velocity, which is also
/// the update) and each value plus its update, computed as [`stage`] computed them (the
/// same arithmetic on the same state, so the same numbers), without memory.
fn commit(updater: Updater, t: i32, m: &mut [f32], v: Option<&mut [f32]>, p: Param<'_>) {
    let n = p.value.len();
    let (m, g) = (&mut m[..n], &p.grad[..n]);
    match (updater, v) {
        (Updater::Sgd { learning_rate, momentum }, _) => {
            for ((w, m), &g) in p.value.iter_mut().zip(m).zip(g) {
                let u = sgd_velocity(learning_rate, momentum, *m, g);
                *m = u;
                *w += u;
            }
        }
        (Updater::Adam { learning_rate, beta1, beta2, epsilon }, Some(v)) => {
            let step = adam_step_size(learning_rate, beta1, beta2, t);
            simd::adam_commit(Width::detect(), AdamStep { beta1, beta2, epsilon, step }, p, m, v);
        }
        (Updater::Adam { .. }, None) => unreachable!("Adam's state has a second moment per parameter"),
    }
}

/// The new velocity of SGD with momentum (which is also the update).
#[inline(always)]
fn sgd_velocity(learning_rate: f32, momentum: f32, velocity: f32, grad: f32) -> f32 {
    momentum * velocity - learning_rate * grad
}

/// Adam's step size at step `t` (from 1), with the bias correction folded in.
fn adam_step_size(learning_rate: f32, beta1: f32, beta2: f32, t: i32) -> f32 {
    learning_rate * (1.0 - beta2.powi(t)).sqrt() / (1.0 - beta1.powi(t))
}

/// The first of the named values that is not finite.
fn non_finite(values: &[(&'static str, f32)]) -> Option<(&'static str, f32)> {
    values.iter().copied().find(|(_, v)| !v.is_finite())
}

/// Checks one step of a range of flat parameters (a data-parallel trainer's share):
/// `values` with their gradients `grads` and state `m` (and `v` for Adam), at step `t`.
/// Returns the first element whose update, new moment or new value would not be finite
/// (its index in the range, what it is, the value); nothing is stored.
///
/// # Errors
///
/// None today: the check needs no memory (the signature keeps room for one that does).
pub(crate) fn check_range(
    updater: Updater,
    t: i32,
    values: &mut [f32],
    grads: &[f32],
    m: &[f32],
    v: Option<&[f32]>,
    _working: &TypedScope,
) -> Result<Option<(usize, &'static str, f32)>> {
    let n = values.len();
    let p = Param { value: values, grad: &grads[..n] };
    Ok(first_non_finite(updater, t, m, v, &p))
}

/// Stores a step of a range checked by [`check_range`] (the same arithmetic, so the
/// same numbers).
pub(crate) fn commit_range(
    updater: Updater,
    t: i32,
    values: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: Option<&mut [f32]>,
) {
    commit(updater, t, m, v, Param { value: values, grad: grads });
}

impl UpdaterState {
    /// The step count and the state, one buffer per parameter in layer order (the
    /// second moments empty but for Adam).
    pub(crate) fn into_parts(self) -> (u64, Vec<Vec<f32>>, Vec<Vec<f32>>) {
        (self.step, self.first, self.second)
    }

    /// A state of `layers` from [`UpdaterState::into_parts`]'s parts.
    pub(crate) fn from_parts(
        updater: Updater,
        layers: &mut [Box<dyn Layer>],
        step: u64,
        first: Vec<Vec<f32>>,
        second: Vec<Vec<f32>>,
    ) -> UpdaterState {
        let mut state = UpdaterState::new(updater, layers);
        state.step = step;
        state.first = first;
        state.second = second;
        state
    }
}
