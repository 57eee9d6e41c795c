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
                        m[i] = momentum * m[i] - learning_rate * p.grad[i];
                        m[i]
                    }),
                    Updater::Adam { learning_rate, beta1, beta2, epsilon } => {
                        let step = learning_rate * (1.0 - beta2.powi(t)).sqrt() / (1.0 - beta1.powi(t));
                        let v = &mut second[index];
                        working.slice_from_fn(p.value.len(), |i| {
                            let g = p.grad[i];
                            m[i] = beta1 * m[i] + (1.0 - beta1) * g;
                            v[i] = beta2 * v[i] + (1.0 - beta2) * g * g;
                            -step * m[i] / (v[i].sqrt() + epsilon)
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
