//! The frozen model: a trained network's weights, held once, inferring through `&self`
//! in the calling thread's serving workspaces.

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_iter::panics::{drop_quietly, panic_message};
use ndarray::{Array2, ArrayView2, ArrayViewMut2};
use workspace_core::planned::PlanGroup;
use workspace_core::LayerWorkspaceMgr;

use crate::nn::finite;
use crate::nn::infer::Infer;
use crate::nn::layer::Layer;
use crate::nn::network::{
    check_input, inference_builder, probabilities, shape_key, FirstLayer, Input, Network, NetworkConfig,
};
use crate::nn::params::Params;
use crate::nn::step::StepLayers;
use crate::{Error, Result};

/// A trained network frozen for serving: its layers and their weights, shared and
/// immutable (a network freezes into a model without copying either); `Send + Sync`, so
/// one model shared by [`Arc`] serves every thread.
///
/// [`Model::output`] and its kin run in the calling thread's serving workspaces, as a
/// [`Network`]'s inference runs in its thread's (DL4J's workspaces are per thread, by
/// name): one planned arena per thread that calls them (the plan group
/// `WS_PLANNED_MODEL`), made at the thread's first call, shared by every model that
/// thread serves, holding the plan of each request shape it met, and dropped when the
/// thread ends or by [`Model::release_thread_workspaces`]. A model holds no memory of
/// its own beyond its weights; to bound the arenas to K whatever the number of threads,
/// serve it from an [`InferencePool`](super::InferencePool) of K arenas instead.
///
/// ```
/// use std::sync::Arc;
/// use carve::nn::{serve::Model, Network, NetworkConfig};
/// use carve::ndarray::Array2;
///
/// let net = Network::new(NetworkConfig::builder(4).dense(8).relu().dense(3).seed(7).build()?)?;
/// let model: Arc<Model> = Arc::new(net.freeze()?);
/// let x = Array2::<f32>::ones((2, 4));
/// let alone = model.output(x.view())?;
/// assert!(Model::thread_workspace_bytes() > 0, "this thread's serving arena");
/// std::thread::scope(|s| {
///     for _ in 0..4 {
///         let (model, x, alone) = (&model, &x, &alone);
///         s.spawn(move || assert_eq!(model.output(x.view()).unwrap(), *alone));
///     }
/// });
/// Model::release_thread_workspaces()?;
/// assert_eq!(Model::thread_workspace_bytes(), 0);
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
    /// A number of this model's own, unique over the process's life: a thread's serving
    /// arena keys its plans by it and the request's shape.
    id: u64,
    /// The text symbol of each token, when the model reads text
    /// ([`Model::with_symbols`]).
    pub(crate) symbols: Option<Arc<[char]>>,
    /// The symbols sorted, each with its token: [`Model::encode`] looks a character up
    /// in as many steps as the vocabulary's logarithm, whatever its size.
    pub(crate) symbol_tokens: Option<Arc<[(char, u32)]>>,
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

/// The name of a thread's serving arena's plan group (in statistics).
const THREAD_GROUP: &str = "WS_PLANNED_MODEL";

thread_local! {
    /// The calling thread's serving workspaces ([`Model`]'s documentation): made at its
    /// first request, borrowed for each.
    static THREAD_ARENA: RefCell<Option<LayerWorkspaceMgr>> = const { RefCell::new(None) };
}

/// The error of a model's request made from inside another's, on the same thread.
fn nested() -> Error {
    Error::InvalidInput(
        "a model's request was made from inside another model request on the same thread (a layer that serves a \
         model): the thread's serving workspaces are in use; serve the inner model from an InferencePool"
            .into(),
    )
}

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
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        Ok(Model { inputs, classes: layout.outputs, layers, layout, params, id, symbols: None, symbol_tokens: None })
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

    /// A number of this model's own, unique over the process's life.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Where each layer's parameters are.
    pub(crate) fn layout(&self) -> &Params {
        &self.layout
    }

    /// The bytes of the parameters, held once however many threads the model serves.
    pub fn weight_bytes(&self) -> usize {
        self.params.len() * size_of::<f32>()
    }

    /// Class probabilities of `x`, in an owned array (one row per example, or per
    /// example and step for a sequence model without a head), computed in the calling
    /// thread's serving workspaces ([`Infer::output`]).
    ///
    /// # Errors
    ///
    /// Shape errors; [`Error::NonFinite`] naming the input for a NaN or infinite
    /// value; [`Error::InvalidInput`] for an empty batch, or a request made from inside
    /// another model's on the same thread; [`Error::Panicked`] when a layer panics;
    /// workspace errors.
    pub fn output<'x>(&self, x: impl Into<Input<'x>>) -> Result<Array2<f32>> {
        Infer::output(&mut &*self, x)
    }

    /// As [`Model::output`], written into `out` (`[rows, classes]`): no heap
    /// allocation once the thread's serving arena has a plan for the shape
    /// ([`Infer::output_into`]).
    ///
    /// # Errors
    ///
    /// As [`Model::output`]; [`Error::ShapeMismatch`] when `out` has the wrong shape.
    pub fn output_into<'x>(&self, x: impl Into<Input<'x>>, out: ArrayViewMut2<'_, f32>) -> Result<()> {
        Infer::output_into(&mut &*self, x, out)
    }

    /// The most probable class of each row of `x`, written to `out`
    /// ([`Infer::predict_into`]).
    ///
    /// # Errors
    ///
    /// As [`Model::output`]; [`Error::ShapeMismatch`] when `out` has the wrong length.
    pub fn predict_into<'x>(&self, x: impl Into<Input<'x>>, out: &mut [u32]) -> Result<()> {
        Infer::predict_into(&mut &*self, x, out)
    }

    /// The bytes of the calling thread's serving workspaces (0 before its first
    /// request, or after [`Model::release_thread_workspaces`]).
    pub fn thread_workspace_bytes() -> usize {
        THREAD_ARENA
            .try_with(|arena| arena.try_borrow().map_or(0, |mgr| mgr.as_ref().map_or(0, LayerWorkspaceMgr::capacity)))
            .unwrap_or(0)
    }

    /// Drops the calling thread's serving workspaces and their plans (the thread's
    /// next request makes new ones), as DL4J's
    /// `destroyAllWorkspacesForCurrentThread` does for its workspaces.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when called from inside a model's request on this thread.
    pub fn release_thread_workspaces() -> Result<()> {
        let released = THREAD_ARENA.try_with(|arena| arena.try_borrow_mut().map(|mut mgr| mgr.take()));
        match released {
            Ok(Ok(mgr)) => {
                drop(mgr);
                Ok(())
            }
            Ok(Err(_)) => Err(nested()),
            // The thread is ending: its workspaces go with it.
            Err(_) => Ok(()),
        }
    }

    /// Checks `x` as a request: its shape, no empty batch, every value finite.
    pub(crate) fn check_request(&self, x: &Input<'_>) -> Result<()> {
        check_input(self.inputs, FirstLayer::of(&self.layers), x)?;
        finite::check_activations("input", "the request's input", x.activations(), x.mask())
    }

    /// The probabilities of `x` (checked by [`Model::check_request`]) in `mgr`, handed to
    /// `f`: one planned iteration of the arena's group, keyed by the model and the shape
    /// of `x`. Returns `f`'s value and whether the iteration ran on its plan.
    pub(crate) fn infer_in<R>(
        &self,
        mgr: &LayerWorkspaceMgr,
        x: Input<'_>,
        f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>,
    ) -> Result<(R, bool)> {
        let group = mgr.plan_group().expect("serving arenas are planned");
        let key = shape_key(&x, None).wrapping_mul(0x0100_0000_01b3) ^ self.id;
        group.iteration(key, || {
            let mut layers = StepLayers {
                layers: &self.layers,
                params: &self.layout,
                values: &self.params,
                grads: None,
                tapes: None,
                streams: None,
            };
            probabilities(&mut layers, mgr, x, None, f)
        })
    }
}

/// A model infers in the calling thread's serving workspaces (see [`Model`]).
impl Infer for &Model {
    fn infer<'x, R>(&mut self, x: impl Into<Input<'x>>, f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>) -> Result<R> {
        let (model, x) = (*self, x.into());
        model.check_request(&x)?;
        in_thread_arena(|mgr| model.infer_in(mgr, x, f).map(|(value, _on_plan)| value))
    }
}

/// Whether this thread's serving arena can run a request now: the thread is not inside
/// another model request (a nested one) nor ending, and its arena is built. A stream
/// asks before its step changes anything, so that a step refused for these reasons
/// leaves its streams as they were.
pub(crate) fn thread_arena_ready() -> Result<()> {
    with_thread_arena(|_| Ok(()))
}

/// `f` in the calling thread's serving arena (made at its first use). A panic in `f`
/// fails this call only ([`Error::Panicked`]): the scopes it held were closed as it
/// unwound, and the arena goes on.
pub(crate) fn in_thread_arena<R>(f: impl FnOnce(&LayerWorkspaceMgr) -> Result<R>) -> Result<R> {
    with_thread_arena(|mgr| match catch_unwind(AssertUnwindSafe(|| f(mgr))) {
        Ok(result) => result,
        Err(payload) => {
            let message = panic_message(&*payload);
            drop_quietly(payload);
            Err(Error::Panicked { message })
        }
    })
}

/// `f` with the calling thread's serving arena, built at its first use; an error when
/// the thread is inside another model request (the arena is in use) or ending.
fn with_thread_arena<R>(f: impl FnOnce(&LayerWorkspaceMgr) -> Result<R>) -> Result<R> {
    let ran = THREAD_ARENA.try_with(|arena| {
        let mut arena = arena.try_borrow_mut().map_err(|_| nested())?;
        let mgr = match &mut *arena {
            Some(mgr) => mgr,
            None => arena.insert(thread_arena()?),
        };
        f(mgr)
    });
    ran.unwrap_or_else(|_| {
        Err(Error::InvalidInput(
            "a model's request was made while its thread was ending (a thread-local destructor)".into(),
        ))
    })
}

/// As `&Model` (so that an owned model serves generic code too).
impl Infer for Model {
    fn infer<'x, R>(&mut self, x: impl Into<Input<'x>>, f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>) -> Result<R> {
        Infer::infer(&mut &*self, x, f)
    }
}

/// A thread's serving arena: the inference workspaces planned over a group of their own.
fn thread_arena() -> Result<LayerWorkspaceMgr> {
    let group = PlanGroup::with_plans(THREAD_GROUP, SERVING_PLANS);
    Ok(inference_builder(true).planned(&group).build()?)
}
