//! Parameter updaters: SGD with momentum, and Adam. Their state lives outside
//! workspaces (it persists across iterations); each parameter's update is staged in a
//! frame of updater working memory, checked, and given back before the next one, so
//! the step needs the bytes of its largest parameter, not of all of them.

use crate::{Error, Result};
use workspace_core::{Frame, TypedScope};

use super::finite::first_in_slice;

use super::layer::{Layer, Param};

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

    /// One step over every parameter of `layers`, with updates computed in `working`.
    ///
    /// The step is checked before anything is stored: the parameters are checked first,
    /// then every update is computed into a frame of `working` (one parameter at a
    /// time, each given back before the next) and checked to be finite, with the new
    /// moments (or velocities) and parameter values; only then are the moments and
    /// parameters written, each update computed again as it is stored (the same
    /// arithmetic, so the same numbers; storing needs no memory, so it cannot fail
    /// half-way). So a step updates every parameter and its state, or none.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when a layer gives another number of parameters than
    /// when the network was built; [`Error::ShapeMismatch`] when a parameter changed
    /// size, or its gradient is not as long as its values; [`Error::NonFinite`] naming
    /// the layer when a moment, update or new parameter value would not be finite;
    /// workspace errors of `working`.
    pub(crate) fn apply(&mut self, layers: &mut [Box<dyn Layer>], working: &TypedScope) -> Result<()> {
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
                let checked = working.frame().map_err(Error::from).and_then(|frame| {
                    let update = stage(updater, t, &first[index], v, &p, &frame)?;
                    Ok(first_non_finite(updater, t, &first[index], v, &p, update))
                }); // the update's bytes are given back here
                match checked {
                    Ok(None) => {}
                    Ok(Some((element, what, value))) => {
                        let grad = p.grad[element];
                        failure = Some(Failure::NonFinite { param, element, what, value, grad });
                    }
                    Err(e) => failure = Some(Failure::Workspace(e)),
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

/// Why a parameter's update could not be staged.
enum Failure {
    /// The parameters are not those the state was built for.
    Mismatch(Mismatch),
    /// A value of the step would not be finite.
    NonFinite { param: usize, element: usize, what: &'static str, value: f32, grad: f32 },
    /// Updater working memory failed.
    Workspace(Error),
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
            Failure::Workspace(e) => e,
        }
    }
}

/// The update of one parameter, computed into `working` from its state (`m`, and `v`
/// for Adam) and gradient, at step `t`; nothing is stored.
fn stage<'w>(
    updater: Updater,
    t: i32,
    m: &[f32],
    v: Option<&[f32]>,
    p: &Param<'_>,
    working: &'w Frame<'_>,
) -> Result<&'w mut [f32]> {
    let n = p.value.len();
    let (m, g) = (&m[..n], &p.grad[..n]);
    match (updater, v) {
        (Updater::Sgd { learning_rate, momentum }, _) => {
            Ok(working.slice_from_fn(n, |i| sgd_velocity(learning_rate, momentum, m[i], g[i]))?)
        }
        (Updater::Adam { learning_rate, beta1, beta2, epsilon }, Some(v)) => {
            let step = adam_step_size(learning_rate, beta1, beta2, t);
            let v = &v[..n];
            Ok(working.slice_from_fn(n, |i| adam(beta1, beta2, epsilon, step, m[i], v[i], g[i]).2)?)
        }
        (Updater::Adam { .. }, None) => unreachable!("Adam's state has a second moment per parameter"),
    }
}

/// The first element of a staged step whose new moment (or velocity), update or new
/// parameter value is not finite: its index, what it is, and the value. Branch-free
/// over chunks, so that it vectorises; the element is looked for only when there is one.
fn first_non_finite(
    updater: Updater,
    t: i32,
    m: &[f32],
    v: Option<&[f32]>,
    p: &Param<'_>,
    update: &[f32],
) -> Option<(usize, &'static str, f32)> {
    let n = update.len();
    let (values, grads, m) = (&p.value[..n], &p.grad[..n], &m[..n]);
    // What the commit will store: each value plus its update, and Adam's moments.
    let sums_finite = values
        .chunks(64)
        .zip(update.chunks(64))
        .all(|(w, u)| w.iter().zip(u).fold(true, |ok, (&w, &u)| ok & (w + u).is_finite()));
    let moments_finite = match (updater, v) {
        (Updater::Adam { beta1, beta2, .. }, Some(v)) => {
            m.chunks(64).zip(v[..n].chunks(64)).zip(grads.chunks(64)).all(|((m, v), g)| {
                m.iter().zip(v).zip(g).fold(true, |ok, ((&m, &v), &g)| {
                    let (m, v) = (beta1 * m + (1.0 - beta1) * g, beta2 * v + (1.0 - beta2) * g * g);
                    ok & m.is_finite() & v.is_finite()
                })
            })
        }
        _ => true,
    };
    if sums_finite && moments_finite && first_in_slice(update).is_none() {
        return None;
    }
    (0..n).find_map(|i| {
        let value = ("new value", values[i] + update[i]);
        let found = match (updater, v) {
            (Updater::Adam { learning_rate, beta1, beta2, epsilon }, Some(v)) => {
                let step = adam_step_size(learning_rate, beta1, beta2, t);
                let (m, v, u) = adam(beta1, beta2, epsilon, step, m[i], v[i], grads[i]);
                non_finite(&[("first moment", m), ("second moment", v), ("update", u), value])
            }
            _ => non_finite(&[("velocity", update[i]), value]),
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
            for (((w, m), v), &g) in p.value.iter_mut().zip(m).zip(&mut v[..n]).zip(g) {
                let (m_new, v_new, u) = adam(beta1, beta2, epsilon, step, *m, *v, g);
                (*m, *v) = (m_new, v_new);
                *w += u;
            }
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

/// One Adam step of one value: the new first and second moments, and the update.
#[inline(always)]
fn adam(beta1: f32, beta2: f32, epsilon: f32, step: f32, m: f32, v: f32, g: f32) -> (f32, f32, f32) {
    let m = beta1 * m + (1.0 - beta1) * g;
    let v = beta2 * v + (1.0 - beta2) * g * g;
    (m, v, -step * m / (v.sqrt() + epsilon))
}

/// The first of the named values that is not finite.
fn non_finite(values: &[(&'static str, f32)]) -> Option<(&'static str, f32)> {
    values.iter().copied().find(|(_, v)| !v.is_finite())
}

/// Elements staged per frame of updater working memory when a range is checked.
const STAGE_CHUNK: usize = 16 * 1024;

/// Checks one step of a range of flat parameters (a data-parallel trainer's share):
/// `values` with their gradients `grads` and state `m` (and `v` for Adam), at step `t`.
/// Returns the first element whose update, new moment or new value would not be finite
/// (its index in the range, what it is, the value). Updates are staged in frames of
/// `working`, a few thousand elements at a time; nothing is stored.
///
/// # Errors
///
/// Workspace errors of `working`.
pub(crate) fn check_range(
    updater: Updater,
    t: i32,
    values: &mut [f32],
    grads: &[f32],
    m: &[f32],
    v: Option<&[f32]>,
    working: &TypedScope,
) -> Result<Option<(usize, &'static str, f32)>> {
    let mut start = 0;
    while start < values.len() {
        let end = (start + STAGE_CHUNK).min(values.len());
        let p = Param { value: &mut values[start..end], grad: &grads[start..end] };
        let (m, v) = (&m[start..end], v.map(|v| &v[start..end]));
        let frame = working.frame()?;
        let update = stage(updater, t, m, v, &p, &frame)?;
        if let Some((i, what, value)) = first_non_finite(updater, t, m, v, &p, update) {
            return Ok(Some((start + i, what, value)));
        }
        start = end;
    }
    Ok(None)
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
