//! Parameter updaters: SGD with momentum, and Adam. Their state lives outside
//! workspaces (it persists across iterations). A step updates everything or nothing:
//! it is known finite before anything is stored. An Adam step usually is from bounds
//! (the largest moments the last step stored, and one scan of the values and gradients
//! that computes nothing), and is then computed and stored in one pass; otherwise it is
//! checked in one pass that computes every update, new moment and new value without
//! storing any (so it needs no memory), then stored in a second pass that computes them
//! again with the same arithmetic.

use crate::{Error, Result};
use workspace_core::TypedScope;

use std::sync::Arc;

use super::layer::Layer;
use super::limits::config_filled;
use super::params::Params;
use super::simd::{self, AdamStep, Moments, Param, Width};

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
    /// scikit-learn and DL4J do: `w −= lr·√(1−β₂ᵗ)/(1−β₁ᵗ) · m / (√v + ε)`. PyTorch
    /// adds ε to the corrected root instead (`m̂ / (√v̂ + ε)`): the two differ by ε's
    /// scale, `√(1−β₂ᵗ)`, which matters only while `√v̂` is near ε (tiny gradients in
    /// the first `~1/(1−β₂)` steps).
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
    /// AdamW (Loshchilov & Hutter): Adam with decoupled weight decay, as PyTorch's
    /// `AdamW` decays: each parameter that is a matrix (two or more dimensions: weights
    /// and embeddings, not biases or layer-norm scales, as nanoGPT's parameter groups
    /// choose) is first multiplied by `1 − learning_rate · weight_decay`, then takes
    /// [`Updater::Adam`]'s step (ε where scikit-learn and DL4J put it, see there).
    AdamW {
        /// Step size.
        learning_rate: f32,
        /// Decay of the first moment.
        beta1: f32,
        /// Decay of the second moment.
        beta2: f32,
        /// Added to the root of the second moment.
        epsilon: f32,
        /// The decay per unit of learning rate (PyTorch's `weight_decay`).
        weight_decay: f32,
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

    /// AdamW with PyTorch's constants (β₁ 0.9, β₂ 0.999, ε 1e-8) and `weight_decay`.
    pub fn adamw(learning_rate: f32, weight_decay: f32) -> Updater {
        Updater::AdamW { learning_rate, beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay }
    }

    /// The step size.
    pub fn learning_rate(&self) -> f32 {
        match *self {
            Updater::Sgd { learning_rate, .. }
            | Updater::Adam { learning_rate, .. }
            | Updater::AdamW { learning_rate, .. } => learning_rate,
        }
    }

    /// The update without its weight decay (AdamW's moments and step are Adam's).
    pub(crate) fn core(self) -> Updater {
        match self {
            Updater::AdamW { learning_rate, beta1, beta2, epsilon, .. } => {
                Updater::Adam { learning_rate, beta1, beta2, epsilon }
            }
            other => other,
        }
    }

    /// What each matrix parameter is multiplied by before the step (1: no decay).
    pub(crate) fn decay_factor(self) -> f32 {
        match self {
            Updater::AdamW { learning_rate, weight_decay, .. } => 1.0 - learning_rate * weight_decay,
            _ => 1.0,
        }
    }
}

impl Default for Updater {
    fn default() -> Updater {
        Updater::adam(1e-3)
    }
}

/// An updater with its state, in the parameters' flat layout.
#[derive(Debug)]
pub(crate) struct UpdaterState {
    updater: Updater,
    step: u64,
    /// Velocity (SGD) or first moment (Adam), one value per parameter value.
    first: Vec<f32>,
    /// Second moment (Adam; empty for SGD), one value per parameter value.
    second: Vec<f32>,
    /// The largest `|first|` and `second` over every parameter, when known: what the
    /// last step stored (Adam), for the next step's bounds.
    moments: Option<Moments>,
}

impl UpdaterState {
    /// How many buffers of one value per parameter [`UpdaterState::new`] makes for
    /// `updater`: SGD's velocity, or Adam's two moments.
    pub(crate) fn buffers(updater: Updater) -> usize {
        match updater {
            Updater::Adam { .. } | Updater::AdamW { .. } => 2,
            Updater::Sgd { .. } => 1,
        }
    }

    /// A fresh state for `total` parameter values (its [`UpdaterState::buffers`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when the state cannot be allocated.
    pub(crate) fn new(updater: Updater, total: usize) -> Result<UpdaterState> {
        let what = || format!("the updater's state of {total} parameter values (check the layer widths)");
        let first = config_filled(total, 0.0, what)?;
        let second = match UpdaterState::buffers(updater) {
            2 => config_filled(total, 0.0, what)?,
            _ => Vec::new(),
        };
        // Zero moments: the bounds of a first step are known.
        Ok(UpdaterState { updater, step: 0, first, second, moments: Some(Moments::default()) })
    }

    pub(crate) fn updater(&self) -> Updater {
        self.updater
    }

    /// One step over every parameter (`params`, with their gradients `grads`, laid out
    /// by `layout` for `layers`; `_working`, the updater working memory, is not needed:
    /// nothing is staged). The parameters are written through [`Arc::make_mut`]: a
    /// model that still holds them keeps the values it was frozen with.
    ///
    /// A step updates every parameter and its state, or none: it is known to be finite
    /// everywhere before anything is stored. For Adam that is usually known from bounds:
    /// the largest first and second moments the last step stored (tracked as it stores
    /// them), and one scan of the values and gradients that computes nothing (every
    /// gradient finite, its largest magnitude, every value within
    /// [`simd::VALUE_LIMIT`]); [`simd::adam_step_is_finite`] shows that such a step
    /// cannot overflow. Then the step is one pass that computes and stores. Otherwise
    /// (SGD, a state handed over without its bounds, bounds too large to tell) every
    /// update is computed, with the new moments (or velocities) and parameter values,
    /// and checked in a pass that stores nothing, layer by layer in forward order, and
    /// stored in a second that computes each again (the same arithmetic, so the same
    /// numbers). Either way the numbers stored are the same bits, and storing needs no
    /// memory, so it cannot fail half-way.
    ///
    /// # Errors
    ///
    /// [`Error::NonFinite`] naming the layer when a moment, update or new parameter value
    /// would not be finite.
    pub(crate) fn apply(
        &mut self,
        params: &mut Arc<Vec<f32>>,
        grads: &[f32],
        layout: &Params,
        layers: &[Box<dyn Layer>],
        _working: &TypedScope,
    ) -> Result<()> {
        // As a data-parallel trainer counts it (the same bits past 2³¹ steps).
        let t = i32::try_from(self.step + 1).unwrap_or(i32::MAX);
        if !self.known_finite(params, grads, t) {
            self.check_every_update(params, grads, t, layout, layers)?;
        }
        let values = Arc::make_mut(params).as_mut_slice();
        decay_matrices(self.updater.decay_factor(), values, 0, layout);
        self.commit(values, grads, t);
        Ok(())
    }

    /// Whether this Adam step at `t` is known to be finite everywhere from bounds alone
    /// (see [`UpdaterState::apply`]): one scan of the values and gradients.
    fn known_finite(&self, values: &[f32], grads: &[f32], t: i32) -> bool {
        let (Updater::Adam { learning_rate, beta1, beta2, epsilon }, Some(moments)) =
            (self.updater.core(), self.moments)
        else {
            return false;
        };
        let a = AdamStep { beta1, beta2, epsilon, step: adam_step_size(learning_rate, beta1, beta2, t) };
        // The hyper-parameters and the moments alone may already rule it out.
        if !simd::adam_step_is_finite(a, moments, 0.0) {
            return false;
        }
        // Gradients of another length are reported by the element-wise check.
        if grads.len() != values.len() {
            return false;
        }
        let scan = simd::scan(Width::detect(), values, grads);
        scan.in_range && simd::adam_step_is_finite(a, moments, scan.g_max)
    }

    /// Computes every update of the step at `t`, with its new moments (or velocity) and
    /// value, and checks that each is finite, layer by layer in forward order; stores
    /// nothing.
    fn check_every_update(
        &self,
        values: &[f32],
        grads: &[f32],
        t: i32,
        layout: &Params,
        layers: &[Box<dyn Layer>],
    ) -> Result<()> {
        if grads.len() != values.len() || self.first.len() != values.len() {
            return Err(Error::ShapeMismatch {
                context: "the network's parameters, their gradients and the updater's state".into(),
                expected: vec![values.len(), values.len()],
                actual: vec![grads.len(), self.first.len()],
            });
        }
        for (i, region) in layout.layout.regions.iter().enumerate() {
            let r = region.clone();
            let v = (!self.second.is_empty()).then(|| &self.second[r.clone()]);
            let found = first_non_finite(
                self.updater.core(),
                t,
                &values[r.clone()],
                &grads[r.clone()],
                &self.first[r.clone()],
                v,
            );
            if let Some((element, what, value)) = found {
                let grad = grads[r.start + element];
                let (param, element) = layout.param_of(i, element);
                let name = layers.get(i).map_or("update", |l| l.name());
                return Err(Failure::NonFinite { param, element, what, value, grad }.into_error(name));
            }
        }
        Ok(())
    }

    /// Stores the step at `t`, known finite: the moments and the parameters, each
    /// update computed as it is stored; keeps the largest moments stored for the next
    /// step's bounds.
    fn commit(&mut self, values: &mut [f32], grads: &[f32], t: i32) {
        self.step += 1;
        let v = (!self.second.is_empty()).then_some(self.second.as_mut_slice());
        self.moments = Some(commit(self.updater.core(), t, &mut self.first, v, Param { value: values, grad: grads }));
    }
}

/// Why a parameter's step could not be taken.
enum Failure {
    /// A value of the step would not be finite.
    NonFinite { param: usize, element: usize, what: &'static str, value: f32, grad: f32 },
}

impl Failure {
    fn into_error(self, layer: &str) -> Error {
        match self {
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
    values: &[f32],
    grads: &[f32],
    m: &[f32],
    v: Option<&[f32]>,
) -> Option<(usize, &'static str, f32)> {
    let n = values.len();
    let (grads, m) = (&grads[..n], &m[..n]);
    let finite = match (updater, v) {
        (Updater::Sgd { learning_rate, momentum }, _) => {
            values.chunks(64).zip(m.chunks(64)).zip(grads.chunks(64)).all(|((w, m), g)| {
                w.iter().zip(m).zip(g).fold(true, |ok, ((&w, &m), &g)| {
                    let u = sgd_velocity(learning_rate, momentum, m, g);
                    ok & simd::finite(u) & simd::finite(w + u)
                })
            })
        }
        (Updater::Adam { learning_rate, beta1, beta2, epsilon }, Some(v)) => {
            let step = adam_step_size(learning_rate, beta1, beta2, t);
            simd::adam_finite(Width::detect(), AdamStep { beta1, beta2, epsilon, step }, values, grads, m, v)
        }
        (Updater::Adam { .. }, None) => unreachable!("Adam's state has a second moment per parameter"),
        (Updater::AdamW { .. }, _) => unreachable!("AdamW steps as Adam (`Updater::core`) after its decay"),
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
            (Updater::AdamW { .. }, _) => unreachable!("AdamW steps as Adam (`Updater::core`) after its decay"),
        };
        found.map(|(what, bad)| (i, what, bad))
    })
}

/// Stores a checked step of one parameter: the new moments (or velocity, which is also
/// the update) and each value plus its update, computed as [`first_non_finite`]
/// computed them (the same arithmetic on the same state, so the same numbers), without
/// memory. For Adam, returns the largest `|m|` and `v` stored.
fn commit(updater: Updater, t: i32, m: &mut [f32], v: Option<&mut [f32]>, p: Param<'_>) -> Moments {
    let n = p.value.len();
    let (m, g) = (&mut m[..n], &p.grad[..n]);
    match (updater, v) {
        (Updater::Sgd { learning_rate, momentum }, _) => {
            for ((w, m), &g) in p.value.iter_mut().zip(m).zip(g) {
                let u = sgd_velocity(learning_rate, momentum, *m, g);
                *m = u;
                *w += u;
            }
            Moments::default()
        }
        (Updater::Adam { learning_rate, beta1, beta2, epsilon }, Some(v)) => {
            let step = adam_step_size(learning_rate, beta1, beta2, t);
            simd::adam_commit(Width::detect(), AdamStep { beta1, beta2, epsilon, step }, p, m, v)
        }
        (Updater::Adam { .. }, None) => unreachable!("Adam's state has a second moment per parameter"),
        (Updater::AdamW { .. }, _) => unreachable!("AdamW steps as Adam (`Updater::core`) after its decay"),
    }
}

/// One step over flat values, as a device step takes it: checked, then stored only when
/// every new value is finite (the arithmetic of [`UpdaterState::apply`]'s checked path,
/// so the same bits). Returns the first element whose step is not finite, if any (then
/// nothing is stored). AdamW's decay comes as one factor per value (`decay`: `1 − lr ·
/// wd` for the values of matrices, 1 for the others), applied after the check and
/// before the step, as [`UpdaterState::apply`] applies it.
pub(crate) fn step_or_first_non_finite(
    updater: Updater,
    t: i32,
    values: &mut [f32],
    grads: &[f32],
    first: &mut [f32],
    second: Option<&mut [f32]>,
    decay: Option<&[f32]>,
) -> Option<usize> {
    let updater = updater.core();
    if let Some((i, _, _)) = first_non_finite(updater, t, values, grads, first, second.as_deref()) {
        return Some(i);
    }
    if let Some(decay) = decay {
        values.iter_mut().zip(decay).for_each(|(w, &f)| *w *= f);
    }
    commit(updater, t, first, second, Param { value: values, grad: grads });
    None
}

/// AdamW's decay factor of each parameter value of `layout` (`factor` for the values of
/// matrices, 1 for the others), for a device's update.
pub(crate) fn decay_factors(factor: f32, layout: &Params) -> Vec<f32> {
    let mut factors = vec![1.0; layout.layout.total];
    decay_matrices(factor, &mut factors, 0, layout);
    factors
}

/// Adam's step size at step `t`, for a device's kernels.
pub(crate) fn adam_step(learning_rate: f32, beta1: f32, beta2: f32, t: i32) -> f32 {
    adam_step_size(learning_rate, beta1, beta2, t)
}

/// The new velocity of SGD with momentum (which is also the update); a subnormal one is
/// 0 (see [`simd::flush`]).
#[inline(always)]
fn sgd_velocity(learning_rate: f32, momentum: f32, velocity: f32, grad: f32) -> f32 {
    // A velocity decaying through the subnormal range is 0, as Adam's moments are.
    simd::flush(momentum * velocity - learning_rate * grad)
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
    values: &[f32],
    grads: &[f32],
    m: &[f32],
    v: Option<&[f32]>,
    _working: &TypedScope,
) -> Result<Option<(usize, &'static str, f32)>> {
    Ok(first_non_finite(updater.core(), t, values, grads, m, v))
}

/// Stores a step of a range checked by [`check_range`] (the same arithmetic, so the
/// same numbers).
#[allow(clippy::too_many_arguments)]
pub(crate) fn commit_range(
    updater: Updater,
    t: i32,
    values: &mut [f32],
    offset: usize,
    layout: &Params,
    grads: &[f32],
    m: &mut [f32],
    v: Option<&mut [f32]>,
) {
    decay_matrices(updater.decay_factor(), values, offset, layout);
    // The data-parallel trainer checks every update: it keeps no bounds.
    let _ = commit(updater.core(), t, m, v, Param { value: values, grad: grads });
}

/// AdamW's decoupled weight decay: each value of `values` (the flat parameters from
/// `offset` on) that belongs to a matrix parameter of `layout` multiplied by `factor`
/// (nothing when it is 1). Every caller multiplies the same values by the same factor
/// before the same step, so a network and a data-parallel trainer get the same bits.
/// A factor in `[0, 1]` only shrinks values: a step found finite on the values before
/// their decay is finite after it.
fn decay_matrices(factor: f32, values: &mut [f32], offset: usize, layout: &Params) {
    if factor == 1.0 {
        return;
    }
    let end = offset + values.len();
    for (region, shapes) in layout.layout.regions.iter().zip(&layout.shapes) {
        let mut start = region.start;
        for shape in shapes {
            let len = shape.len();
            if shape.shape.len() >= 2 {
                let (from, to) = (start.max(offset), (start + len).min(end));
                if from < to {
                    values[from - offset..to - offset].iter_mut().for_each(|w| *w *= factor);
                }
            }
            start += len;
        }
    }
}

impl UpdaterState {
    /// The step count and the state (the second moments empty but for Adam).
    pub(crate) fn into_parts(self) -> (u64, Vec<f32>, Vec<f32>) {
        (self.step, self.first, self.second)
    }

    /// A state from [`UpdaterState::into_parts`]'s parts.
    pub(crate) fn from_parts(updater: Updater, step: u64, first: Vec<f32>, second: Vec<f32>) -> UpdaterState {
        // The bounds of a state from elsewhere: one scan.
        let moments = match updater {
            Updater::Adam { .. } | Updater::AdamW { .. } if first.len() == second.len() => Moments::of(&first, &second),
            _ => None,
        };
        UpdaterState { updater, step, first, second, moments }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::layer::ParamShape;
    use workspace_core::{ArrayType, LayerWorkspaceMgr};

    /// A layer that is only `n` parameter values.
    struct Values(usize);

    impl Layer for Values {
        fn name(&self) -> &str {
            "params"
        }

        fn output_size(&self, inputs: usize) -> Result<usize> {
            Ok(inputs)
        }

        fn param_shapes(&self, _inputs: usize) -> Vec<ParamShape> {
            vec![ParamShape::new("value", &[self.0])]
        }
    }

    /// Layers of parameters with their flat buffers, as a network holds them.
    struct Net {
        layers: Vec<Box<dyn Layer>>,
        layout: Params,
        params: Arc<Vec<f32>>,
        grads: Vec<f32>,
    }

    impl Net {
        fn apply(&mut self, state: &mut UpdaterState, working: &TypedScope) -> Result<()> {
            state.apply(&mut self.params, &self.grads, &self.layout, &self.layers, working)
        }

        fn known_finite(&self, state: &UpdaterState, t: i32) -> bool {
            state.known_finite(&self.params, &self.grads, t)
        }

        fn bits(&self) -> Vec<u32> {
            self.params.iter().map(|v| v.to_bits()).collect()
        }
    }

    /// Reproducible values in `[-scale, scale)`.
    fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 10_007) as f32 / 5003.5 * scale - scale)
            .collect()
    }

    fn layers(sizes: &[usize]) -> Net {
        let layers: Vec<Box<dyn Layer>> = sizes.iter().map(|&n| Box::new(Values(n)) as Box<dyn Layer>).collect();
        let layout = Params::of(1, &layers).unwrap();
        let mut params = vec![0.0; layout.layout.total];
        for (i, region) in layout.layout.regions.iter().enumerate() {
            params[region.clone()].copy_from_slice(&values(sizes[i], i as u32, 1.0));
        }
        let grads = vec![0.0; layout.layout.total];
        Net { layers, layout, params: Arc::new(params), grads }
    }

    /// Sets every gradient of `net` from `seed` (the values kept).
    fn set_gradients(net: &mut Net, seed: u32, scale: f32) {
        for (i, region) in net.layout.layout.regions.iter().enumerate() {
            let grad = values(region.len(), seed.wrapping_mul(31).wrapping_add(i as u32), scale);
            net.grads[region.clone()].copy_from_slice(&grad);
        }
    }

    fn scope() -> (LayerWorkspaceMgr, ArrayType) {
        (LayerWorkspaceMgr::no_workspaces(), ArrayType::UpdaterWorkingMem)
    }

    /// The bounds path (one pass) and the checked path (a check, then a second pass)
    /// store the same bits, step after step, at every size (split across a pool or
    /// not) and for gradients of every scale the bounds admit.
    #[test]
    fn the_bounds_path_and_the_checked_path_store_the_same_bits() {
        let (mgr, ty) = scope();
        let working = mgr.enter(ty).unwrap();
        let sizes = [7, 64, 1000, (1 << 16) + 33];
        let updater = Updater::Adam { learning_rate: 3e-3, beta1: 0.9, beta2: 0.999, epsilon: 1e-8 };
        let (mut fast, mut checked) = (layers(&sizes), layers(&sizes));
        let mut fast_state = UpdaterState::new(updater, fast.layout.layout.total).unwrap();
        let mut checked_state = UpdaterState::new(updater, checked.layout.layout.total).unwrap();
        for step in 0..12u32 {
            let scale = [1.0, 1e-20, 1e6, 1e15][step as usize % 4];
            set_gradients(&mut fast, step, scale);
            set_gradients(&mut checked, step, scale);
            assert!(fast.known_finite(&fast_state, step as i32 + 1), "step {step}: the bounds path is taken");
            fast.apply(&mut fast_state, &working).unwrap();
            // No bounds: every update computed and checked before it is stored.
            checked_state.moments = None;
            assert!(!checked.known_finite(&checked_state, step as i32 + 1));
            checked.apply(&mut checked_state, &working).unwrap();
            assert!(fast.bits() == checked.bits(), "step {step}");
            assert_eq!(fast_state.first, checked_state.first);
            assert_eq!(fast_state.second, checked_state.second);
        }
        // The bounds tracked as the steps were stored are the state's own maxima.
        let scanned = Moments::of(&fast_state.first, &fast_state.second);
        assert_eq!(fast_state.moments, scanned);
    }

    /// Where the bounds cannot tell (a value beyond the limit, a gradient whose square
    /// would overflow, a huge step size) the element-wise check decides: a step that
    /// would not be finite is refused and changes nothing, one that would is stored.
    #[test]
    fn beyond_the_bounds_every_update_is_checked() {
        let (mgr, ty) = scope();
        let working = mgr.enter(ty).unwrap();
        let adam = |learning_rate| Updater::Adam { learning_rate, beta1: 0.9, beta2: 0.999, epsilon: 1e-8 };
        // (updater, a value set to, gradient scale, finite?)
        let cases: [(Updater, f32, f32, bool); 5] = [
            (adam(1e-2), 3.4e38, 1.0, true),  // a value beyond VALUE_LIMIT, a small step: fine
            (adam(1e-2), 1.0, 1e30, false),   // g² overflows the second moment
            (adam(1e-2), 1.0, 1e18, true),    // large, still finite
            (adam(1e37), 3.4e38, 1.0, false), // the new value overflows (the step is +1e37)
            (adam(1e30), 1.0, 1.0, true),     // a huge step, finite
        ];
        for (case, &(updater, value, scale, finite)) in cases.iter().enumerate() {
            let mut net = layers(&[100]);
            let mut state = UpdaterState::new(updater, net.layout.layout.total).unwrap();
            set_gradients(&mut net, 5, scale);
            Arc::make_mut(&mut net.params)[37] = value;
            // A negative gradient there: Adam's first step moves it up by about the step.
            let mut grad = values(100, 5u32.wrapping_mul(31), scale);
            grad[37] = -scale;
            net.grads.copy_from_slice(&grad);
            let before = net.bits();
            let known = net.known_finite(&state, 1);
            let result = net.apply(&mut state, &working);
            assert_eq!(result.is_ok(), finite, "case {case}: {result:?}");
            if finite {
                assert!(net.bits() != before, "case {case}: stored");
                assert_eq!(state.step, 1);
            } else {
                assert!(!known, "case {case}: the bounds never admit a step that overflows");
                assert!(net.bits() == before, "case {case}: a refused step changes nothing");
                assert!(state.first.iter().chain(&state.second).all(|&x| x == 0.0), "case {case}");
                assert_eq!(state.step, 0);
            }
        }
    }

    /// Whenever [`simd::adam_step_is_finite`] admits a step, the step at the extremes
    /// its bounds allow is finite: every sign and magnitude at the bounds, over a grid
    /// of hyper-parameters, moments and gradients (large and small).
    #[test]
    fn a_step_the_bounds_admit_is_finite_at_their_extremes() {
        let mut admitted = 0;
        for beta1 in [0.0f32, 0.5, 0.9, 1.0] {
            for beta2 in [0.0f32, 0.999, 1.0] {
                for epsilon in [1e-8f32, 1.0, 1e6] {
                    for step in [0.0f32, 1e-3, -1e-3, 1e10, 1e29, f32::MAX] {
                        for m_max in [0.0f32, 1.0, 1e20, 1e36, 1e37, 3e38] {
                            for v_max in [0.0f32, 1.0, 1e30, 1e37, 3e38] {
                                for g_max in [0.0f32, 1.0, 1e18, 3e18, 1e19, 1e30] {
                                    let a = AdamStep { beta1, beta2, epsilon, step };
                                    let moments = Moments { m: m_max, v: v_max };
                                    if !simd::adam_step_is_finite(a, moments, g_max) {
                                        continue;
                                    }
                                    admitted += 1;
                                    for m in [m_max, -m_max] {
                                        for v in [0.0, v_max] {
                                            for g in [g_max, -g_max] {
                                                let (m2, v2, u) = simd::adam(a, m, v, g);
                                                for w in [simd::VALUE_LIMIT, -simd::VALUE_LIMIT, 0.0] {
                                                    assert!(
                                                        [m2, v2, u, w + u].iter().all(|x| x.is_finite()),
                                                        "{a:?} m {m} v {v} g {g} w {w}: {m2} {v2} {u}"
                                                    );
                                                }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(admitted > 1000, "the bounds admit the usual cases ({admitted})");
        // Training's usual case is admitted.
        let usual = AdamStep { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, step: 1e-3 };
        assert!(simd::adam_step_is_finite(usual, Moments { m: 10.0, v: 100.0 }, 1e3));
        // Unusual hyper-parameters never are.
        for bad in [
            AdamStep { beta1: 1.5, ..usual },
            AdamStep { beta2: -0.1, ..usual },
            AdamStep { epsilon: 0.0, ..usual },
            AdamStep { epsilon: f32::NAN, ..usual },
            AdamStep { step: f32::INFINITY, ..usual },
        ] {
            assert!(!simd::adam_step_is_finite(bad, Moments::default(), 0.0), "{bad:?}");
        }
        assert!(!simd::adam_step_is_finite(usual, Moments { m: f32::NAN, v: 0.0 }, 0.0));
        assert!(!simd::adam_step_is_finite(usual, Moments::default(), f32::INFINITY));
    }
}
