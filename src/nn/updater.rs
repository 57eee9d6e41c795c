//! Parameter updaters: SGD with momentum, and Adam. Their state lives outside
//! workspaces (it persists across iterations); each step's update is computed in
//! updater working memory, then applied.

use workspace_core::{Error, Result, TypedScope};

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
    /// The parameters are checked first, so that a step updates every parameter or
    /// none.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when a layer gives another number of parameters than
    /// when the network was built; [`Error::ShapeMismatch`] when a parameter changed
    /// size, or its gradient is not as long as its values; workspace errors of
    /// `working`.
    pub(crate) fn apply(&mut self, layers: &mut [Box<dyn Layer>], working: &TypedScope) -> Result<()> {
        self.check(layers)?;
        self.check_finite(layers)?;
        self.step += 1;
        let t = self.step as i32;
        let (first, second, updater) = (&mut self.first, &mut self.second, self.updater);
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
                    failure = Some(Err(m));
                    return;
                }
                let index = base + param;
                param += 1;
                let m = &mut first[index];
                let result = match updater {
                    Updater::Sgd { learning_rate, momentum } => working.slice_from_fn(p.value.len(), |i| {
                        m[i] = sgd_velocity(learning_rate, momentum, m[i], p.grad[i]);
                        m[i]
                    }),
                    Updater::Adam { learning_rate, beta1, beta2, epsilon } => {
                        let step = adam_step_size(learning_rate, beta1, beta2, t);
                        let v = &mut second[index];
                        working.slice_from_fn(p.value.len(), |i| {
                            let (m_new, v_new, update) = adam(beta1, beta2, epsilon, step, m[i], v[i], p.grad[i]);
                            (m[i], v[i]) = (m_new, v_new);
                            update
                        })
                    }
                };
                match result {
                    Ok(update) => p.value.iter_mut().zip(update.iter()).for_each(|(w, u)| *w += u),
                    Err(e) => failure = Some(Ok(e)),
                }
            });
            match failure {
                Some(Ok(e)) => return Err(e),
                Some(Err(m)) => return Err(m.into_error(layer.name())),
                None if param != expected => {
                    return Err(Mismatch::Count { expected, actual: param }.into_error(layer.name()))
                }
                None => {}
            }
            base += expected;
        }
        Ok(())
    }

    /// Checks that the next step stores only finite values: every moment (or
    /// velocity), update and new parameter value it would compute, computed here as
    /// [`UpdaterState::apply`] computes them (the same functions), without storing
    /// anything. Called after [`UpdaterState::check`].
    fn check_finite(&self, layers: &mut [Box<dyn Layer>]) -> Result<()> {
        let t = (self.step + 1) as i32;
        let (first, second, updater) = (&self.first, &self.second, self.updater);
        let mut base = 0;
        for (layer, &expected) in layers.iter_mut().zip(&self.layer_params) {
            let mut param = 0;
            let mut bad = None;
            layer.params(&mut |p| {
                if bad.is_some() || param >= expected {
                    return;
                }
                let index = base + param;
                let m = &first[index];
                let found = match updater {
                    Updater::Sgd { learning_rate, momentum } => (0..p.value.len()).find_map(|i| {
                        let velocity = sgd_velocity(learning_rate, momentum, m[i], p.grad[i]);
                        let value = p.value[i] + velocity;
                        non_finite(&[("velocity", velocity), ("new value", value)]).map(|(what, v)| (i, what, v))
                    }),
                    Updater::Adam { learning_rate, beta1, beta2, epsilon } => {
                        let step = adam_step_size(learning_rate, beta1, beta2, t);
                        let v = &second[index];
                        (0..p.value.len()).find_map(|i| {
                            let (m_new, v_new, update) = adam(beta1, beta2, epsilon, step, m[i], v[i], p.grad[i]);
                            let value = p.value[i] + update;
                            let values = [
                                ("first moment", m_new),
                                ("second moment", v_new),
                                ("update", update),
                                ("new value", value),
                            ];
                            non_finite(&values).map(|(what, v)| (i, what, v))
                        })
                    }
                };
                bad = found.map(|(element, what, value)| (param, element, what, value, p.grad[element]));
                param += 1;
            });
            if let Some((param, element, what, value, grad)) = bad {
                return Err(Error::NonFinite {
                    layer: layer.name().to_string(),
                    what: format!(
                        "the updater's {what} of its parameter {param} (element {element}) would be {value} \
                         (gradient {grad:e})"
                    ),
                });
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
