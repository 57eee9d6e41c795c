//! Parameter updaters: SGD with momentum, and Adam. Their state lives outside
//! workspaces (it persists across iterations); each step's update is computed in
//! updater working memory, then applied.

use workspace_core::{Result, TypedScope};

use super::layer::Layer;

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
    /// Velocity (SGD) or first moment (Adam), one buffer per parameter.
    first: Vec<Vec<f32>>,
    /// Second moment (Adam), one buffer per parameter.
    second: Vec<Vec<f32>>,
}

impl UpdaterState {
    pub(crate) fn new(updater: Updater, layers: &mut [Box<dyn Layer>]) -> UpdaterState {
        let mut sizes = Vec::new();
        for layer in layers.iter_mut() {
            layer.params(&mut |p| sizes.push(p.value.len()));
        }
        let second = match updater {
            Updater::Adam { .. } => sizes.iter().map(|&n| vec![0.0; n]).collect(),
            Updater::Sgd { .. } => Vec::new(),
        };
        UpdaterState { updater, step: 0, first: sizes.iter().map(|&n| vec![0.0; n]).collect(), second }
    }

    pub(crate) fn updater(&self) -> Updater {
        self.updater
    }

    /// One step over every parameter of `layers`, with updates computed in `working`.
    pub(crate) fn apply(&mut self, layers: &mut [Box<dyn Layer>], working: &TypedScope) -> Result<()> {
        self.step += 1;
        let t = self.step as i32;
        let mut index = 0;
        let mut failure = None;
        let (first, second, updater) = (&mut self.first, &mut self.second, self.updater);
        for layer in layers.iter_mut() {
            layer.params(&mut |p| {
                if failure.is_some() {
                    return;
                }
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
                    Err(e) => failure = Some(e),
                }
                index += 1;
            });
        }
        failure.map_or(Ok(()), Err)
    }
}
