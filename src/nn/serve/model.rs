//! The frozen model: a trained network's weights, held once, inferring through `&self`.

use std::sync::{Arc, OnceLock};

use ndarray::{Array2, ArrayView2, ArrayViewMut2};
use workspace_core::LayerWorkspaceMgr;

use super::arenas::{ArenaGuard, Arenas, Wait};
use super::pool::PoolConfig;
use crate::nn::finite;
use crate::nn::layer::Layer;
use crate::nn::network::{check_input, predictions_into, probabilities, shape_key, Input, Network, NetworkConfig};
use crate::nn::params::Params;
use crate::nn::step::StepLayers;
use crate::{Error, Result};

/// A trained network frozen for serving: its layers and their weights, shared and
/// immutable (a network freezes into a model without copying either); `Send + Sync`, so one model shared by [`Arc`](std::sync::Arc) serves every thread. Each call
/// runs in a planned arena leased for the call: the model's own (as many as the
/// machine has cores, made on first use), or an [`InferencePool`](super::InferencePool)'s.
///
/// ```
/// use std::sync::Arc;
/// use carve::nn::{Model, Network, NetworkConfig};
/// use carve::ndarray::Array2;
///
/// let net = Network::new(NetworkConfig::builder(4).dense(8).relu().dense(3).seed(7).build()?)?;
/// let model: Arc<Model> = Arc::new(net.freeze()?);
/// let x = Array2::<f32>::ones((2, 4));
/// let alone = model.output(x.view())?;
/// std::thread::scope(|s| {
///     for _ in 0..4 {
///         let (model, x, alone) = (&model, &x, &alone);
///         s.spawn(move || assert_eq!(model.output(x.view()).unwrap(), *alone));
///     }
/// });
/// # Ok::<(), carve::Error>(())
/// ```
pub struct Model {
    inputs: usize,
    classes: usize,
    layers: Arc<[Box<dyn Layer>]>,
    /// Each layer's input width, parameters and region of `params`.
    layout: Arc<Params>,
    /// Every layer's parameters, in the network's flat layout.
    params: Arc<Vec<f32>>,
    /// The model's own arenas, for [`Model::output`] and its kin.
    own: OnceLock<Arenas>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("inputs", &self.inputs)
            .field("classes", &self.classes)
            .field("layers", &self.layers.iter().map(|l| l.name()).collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Plans an arena keeps: one per shape of request (rows, and steps for sequences).
pub(crate) const SERVING_PLANS: usize = 64;

impl Network {
    /// The network frozen for serving: a [`Model`] of its layers and parameters, shared,
    /// not copied (not its gradients, tapes or updater state). The network goes on
    /// training as before; the model is a snapshot: the network's next update copies the
    /// parameters before it writes them, while a model still holds them.
    ///
    /// # Errors
    ///
    /// None today (the signature keeps room for a layer that cannot be served).
    pub fn freeze(&self) -> Result<Model> {
        let (layers, layout, params) = self.shared_parts();
        Model::from_parts(self.inputs(), layers, layout, params)
    }
}

impl Model {
    /// A model of `config`'s layers holding `params`, every layer's parameters in the
    /// network's flat layout (the layers in backward order, as
    /// [`Network::params`] gives them).
    ///
    /// # Errors
    ///
    /// The layers' width errors; [`Error::ShapeMismatch`] when `params` is not as long
    /// as the layers' parameters.
    pub fn from_config(config: &NetworkConfig, params: Vec<f32>) -> Result<Model> {
        let layout = Params::of(config.inputs(), config.layers())?;
        if params.len() != layout.layout.total {
            return Err(Error::ShapeMismatch {
                context: "a model's parameters (the layers' values, in the network's flat layout)".into(),
                expected: vec![layout.layout.total],
                actual: vec![params.len()],
            });
        }
        Model::from_parts(config.inputs(), config.shared_layers(), Arc::new(layout), Arc::new(params))
    }

    /// A model of `layers` laid out by `layout` (of `inputs` columns), holding `params`;
    /// the output stage is softmax, as a network's.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for no layers, 0 inputs, or no output.
    pub(crate) fn from_parts(
        inputs: usize,
        layers: Arc<[Box<dyn Layer>]>,
        layout: Arc<Params>,
        params: Arc<Vec<f32>>,
    ) -> Result<Model> {
        if inputs == 0 || layers.is_empty() {
            return Err(Error::InvalidConfig { reason: "a model needs at least one input and one layer".into() });
        }
        if layout.outputs == 0 {
            return Err(Error::InvalidConfig { reason: "the model's last layer has no output".into() });
        }
        Ok(Model { inputs, classes: layout.outputs, layers, layout, params, own: OnceLock::new() })
    }

    /// Input columns (features per step for a sequence model).
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// Output classes.
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// The layers.
    pub fn layers(&self) -> &[Box<dyn Layer>] {
        &self.layers
    }

    /// Every layer's parameters, in the network's flat layout (see
    /// [`Network::params`]).
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// Layer `i`'s parameters (see [`Network::layer_params`]).
    ///
    /// # Panics
    ///
    /// When there is no layer `i`.
    pub fn layer_params(&self, i: usize) -> &[f32] {
        &self.params[self.layout.layout.regions[i].clone()]
    }

    /// Layer `i`'s parameters' names and shapes (see [`Network::param_shapes`]).
    ///
    /// # Panics
    ///
    /// When there is no layer `i`.
    pub fn param_shapes(&self, i: usize) -> &[crate::nn::ParamShape] {
        &self.layout.shapes[i]
    }

    /// Layer `i`'s input width.
    ///
    /// # Panics
    ///
    /// When there is no layer `i`.
    pub fn layer_inputs(&self, i: usize) -> usize {
        self.layout.widths[i]
    }

    /// The bytes of the parameters, held once however many threads the model serves.
    pub fn weight_bytes(&self) -> usize {
        self.params.len() * size_of::<f32>()
    }

    /// Class probabilities of `x`, in an owned array (one row per example, or per
    /// example and step for a sequence model without a head).
    ///
    /// # Errors
    ///
    /// Shape errors; [`Error::NonFinite`] naming the input for a NaN or infinite
    /// value; [`Error::InvalidInput`] for an empty batch; [`Error::Panicked`] when a
    /// layer panics; workspace errors.
    pub fn output<'x>(&self, x: impl Into<Input<'x>>) -> Result<Array2<f32>> {
        self.own_arena()?.output(self, x.into())
    }

    /// As [`Model::output`], written into `out` (`[rows, classes]`): no heap
    /// allocation once the arena has a plan for the shape.
    ///
    /// # Errors
    ///
    /// As [`Model::output`]; [`Error::ShapeMismatch`] when `out` has the wrong shape.
    pub fn output_into<'x>(&self, x: impl Into<Input<'x>>, out: ArrayViewMut2<'_, f32>) -> Result<()> {
        self.own_arena()?.output_into(self, x.into(), out)
    }

    /// The most probable class of each row of `x`, written to `out`.
    ///
    /// # Errors
    ///
    /// As [`Model::output`]; [`Error::ShapeMismatch`] when `out` has the wrong length.
    pub fn predict_into<'x>(&self, x: impl Into<Input<'x>>, out: &mut [u32]) -> Result<()> {
        self.own_arena()?.predict_into(self, x.into(), out)
    }

    fn own_arena(&self) -> Result<ArenaGuard<'_>> {
        let arenas = match self.own.get() {
            Some(arenas) => arenas,
            None => {
                let made = Arenas::new(PoolConfig::default().workers, SERVING_PLANS)?;
                self.own.get_or_init(|| made)
            }
        };
        arenas.lease(Wait::Forever)
    }

    /// Checks `x` as a request: its shape, no empty batch, every value finite.
    pub(crate) fn check_request(&self, x: &Input<'_>) -> Result<()> {
        check_input(self.inputs, x)?;
        finite::check_activations("input", "the request's input", x.activations(), x.mask())
    }

    /// The probabilities of `x` (checked by [`Model::check_request`]) in `mgr`, handed to `f`: one planned
    /// iteration of the arena's group, keyed by the shape of `x`. Returns `f`'s value and
    /// whether the iteration ran on its plan.
    pub(crate) fn infer_in<R>(
        &self,
        mgr: &LayerWorkspaceMgr,
        x: Input<'_>,
        f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>,
    ) -> Result<(R, bool)> {
        let group = mgr.plan_group().expect("serving arenas are planned");
        group.iteration(shape_key(&x, None), || {
            let mut layers = StepLayers {
                layers: &self.layers,
                params: &self.layout,
                values: &self.params,
                grads: None,
                tapes: None,
            };
            probabilities(&mut layers, mgr, x, None, f)
        })
    }
}

impl ArenaGuard<'_> {
    pub(crate) fn output(&mut self, model: &Model, x: Input<'_>) -> Result<Array2<f32>> {
        model.check_request(&x)?;
        self.run(|mgr| model.infer_in(mgr, x, |probs| Ok(probs.to_owned())))
    }

    pub(crate) fn output_into(&mut self, model: &Model, x: Input<'_>, mut out: ArrayViewMut2<'_, f32>) -> Result<()> {
        model.check_request(&x)?;
        self.run(|mgr| {
            model.infer_in(mgr, x, |probs| {
                if out.dim() != probs.dim() {
                    return Err(Error::ShapeMismatch {
                        context: "output buffer ([rows, classes]: one row per example, or per example and step for \
                                  a model without a sequence head)"
                            .into(),
                        expected: probs.shape().to_vec(),
                        actual: out.shape().to_vec(),
                    });
                }
                out.assign(&probs);
                Ok(())
            })
        })
    }

    pub(crate) fn predict_into(&mut self, model: &Model, x: Input<'_>, out: &mut [u32]) -> Result<()> {
        model.check_request(&x)?;
        self.run(|mgr| model.infer_in(mgr, x, |probs| predictions_into(probs, out)))
    }
}
