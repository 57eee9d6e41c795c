//! The [`Layer`] trait a custom layer implements, and the workspace contexts the
//! network hands it.

use crate::{Error, Result};
use std::any::Any;
use std::mem::MaybeUninit;

use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2, ArrayViewMut3};
use workspace_core::{LayerWorkspaceMgr, TypedScope};

/// What flows between layers: a flat batch `[batch, features]`, or a batch of
/// sequences `[batch, time, features]` (whose mask, `[batch, time]`, the network hands
/// to every sequence method alongside). Token ids ([`Input::Tokens`]) reach the first
/// layer (an [`Embedding`](crate::nn::Embedding)) as a batch of sequences of one
/// feature, the id's value (exact: vocabularies hold at most 2²⁴ tokens).
///
/// [`Input::Tokens`]: crate::nn::Input::Tokens
///
/// Layers keep the kind of their input, except the heads that turn a sequence into
/// one row per sequence ([`LastStep`](crate::nn::LastStep),
/// [`MaskedMean`](crate::nn::MaskedMean)). Gradients flow back in the same kind as the
/// arrays they are the gradients of.
#[derive(Clone, Copy, Debug)]
pub enum Activations<'a> {
    /// `[batch, features]`.
    Flat(ArrayView2<'a, f32>),
    /// `[batch, time, features]`.
    Sequence(ArrayView3<'a, f32>),
}

impl<'a> Activations<'a> {
    /// The shape.
    pub fn shape(&self) -> &[usize] {
        match self {
            Activations::Flat(x) => x.shape(),
            Activations::Sequence(x) => x.shape(),
        }
    }

    /// The batch as a flat `[batch, features]` array, or an error naming `what`.
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] for a sequence batch.
    pub fn flat(self, what: &str) -> Result<ArrayView2<'a, f32>> {
        match self {
            Activations::Flat(x) => Ok(x),
            Activations::Sequence(x) => Err(Error::ShapeMismatch {
                context: format!("{what}: a flat [batch, features] array, not a batch of sequences"),
                expected: vec![x.shape()[0], x.shape()[2]],
                actual: x.shape().to_vec(),
            }),
        }
    }

    /// The batch as a `[batch, time, features]` array, or an error naming `what`.
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] for a flat batch.
    pub fn sequence(self, what: &str) -> Result<ArrayView3<'a, f32>> {
        match self {
            Activations::Sequence(x) => Ok(x),
            Activations::Flat(x) => Err(Error::ShapeMismatch {
                context: format!("{what}: a batch of sequences [batch, time, features], not a flat array"),
                expected: vec![x.nrows(), 0, x.ncols()],
                actual: x.shape().to_vec(),
            }),
        }
    }
}

/// Checks that a sequence layer's mask, if any, is shaped `[batch, time]` like its input;
/// returns the input's `(batch, time, features)`.
pub(crate) fn check_mask(
    layer: &str,
    input: &ArrayView3<'_, f32>,
    mask: Option<&ArrayView2<'_, f32>>,
) -> Result<(usize, usize, usize)> {
    let (batch, steps, features) = input.dim();
    match mask {
        Some(mask) if mask.dim() != (batch, steps) => Err(Error::ShapeMismatch {
            context: format!("layer '{layer}' mask [batch, time]"),
            expected: vec![batch, steps],
            actual: mask.shape().to_vec(),
        }),
        _ => Ok((batch, steps, features)),
    }
}

/// Checks that a sequence layer's input gradient, if asked for, is shaped like its input.
pub(crate) fn check_grad_input(
    layer: &str,
    input: &ArrayView3<'_, f32>,
    grad_input: &Option<ArrayViewMut3<'_, f32>>,
) -> Result<()> {
    match grad_input {
        Some(g) if g.dim() != input.dim() => Err(Error::ShapeMismatch {
            context: format!("layer '{layer}' input gradient"),
            expected: input.shape().to_vec(),
            actual: g.shape().to_vec(),
        }),
        _ => Ok(()),
    }
}

/// `[batch, time, features]` as `[batch · time, features]` (a view: `x` must be in
/// standard layout), or the error of `layer`.
pub(crate) fn steps_as_rows<'a>(x: ArrayView3<'a, f32>, layer: &str) -> Result<ArrayView2<'a, f32>> {
    rows_of_steps(x).ok_or_else(|| not_standard(layer))
}

/// `[batch, time, features]` as `[batch · time, features]`, when `x` is in standard
/// layout: row `b · time + t` is step `t` of sequence `b`.
pub(crate) fn rows_of_steps(x: ArrayView3<'_, f32>) -> Option<ArrayView2<'_, f32>> {
    let (b, t, f) = x.dim();
    x.into_shape_with_order((b * t, f)).ok()
}

/// Whether `layer` is one of carve's own, whose backward passes write every element of
/// their parameters' gradients (a layer of the user's own gets them zeroed first).
pub(crate) fn built_in(layer: &dyn Layer) -> bool {
    use crate::nn::{attention::Attention, dense::Dense, embedding, gelu::Gelu, lstm::Lstm, norm::LayerNorm};
    use crate::nn::{pool as pooling, relu::Relu, residual::Residual};
    let any: &dyn Any = layer;
    any.is::<Dense>()
        || any.is::<Attention>()
        || any.is::<LayerNorm>()
        || any.is::<embedding::Embedding>()
        || any.is::<embedding::PositionEmbedding>()
        || any.is::<Lstm>()
        || any.is::<Gelu>()
        || any.is::<Relu>()
        || any.is::<Residual>()
        || any.is::<pooling::LastStep>()
        || any.is::<pooling::MaskedMean>()
}

pub(crate) fn not_standard(layer: &str) -> Error {
    Error::InvalidInput(format!(
        "layer '{layer}': a batch of sequences must be in standard (row-major) layout to be applied step by step; \
         this one (its input, the output of the layer before it, or a gradient) is not: the layer that made it \
         allocates it with the scope's `zeros`/`copy_of` and returns it as it is, not a permuted or sliced view"
    ))
}

/// The gradient of a layer's input, of the kind of the input, that its backward pass
/// writes (every element).
#[derive(Debug)]
pub enum GradInput<'g> {
    /// Of a flat batch `[batch, features]`.
    Flat(ArrayViewMut2<'g, f32>),
    /// Of a batch of sequences `[batch, time, features]`.
    Sequence(ArrayViewMut3<'g, f32>),
}

impl GradInput<'_> {
    /// The same elements, borrowed for a shorter while.
    pub fn reborrow(&mut self) -> GradInput<'_> {
        match self {
            GradInput::Flat(g) => GradInput::Flat(g.view_mut()),
            GradInput::Sequence(g) => GradInput::Sequence(g.view_mut()),
        }
    }
}

/// The gradient of a layer's input before anything is written to it, for
/// [`Layer::backward_uninit`]: of the kind of the input, in standard (row-major) layout.
#[derive(Debug)]
pub enum UninitGradInput<'g> {
    /// Of a flat batch `[batch, features]`.
    Flat(ArrayViewMut2<'g, MaybeUninit<f32>>),
    /// Of a batch of sequences `[batch, time, features]`.
    Sequence(ArrayViewMut3<'g, MaybeUninit<f32>>),
}

impl<'g> UninitGradInput<'g> {
    /// The array's shape.
    pub fn shape(&self) -> &[usize] {
        match self {
            UninitGradInput::Flat(g) => g.shape(),
            UninitGradInput::Sequence(g) => g.shape(),
        }
    }

    /// The array filled with zeros (split across the thread's matrix-multiply pool when
    /// it has one), what [`Layer::backward`] is handed.
    pub fn zeroed(self) -> GradInput<'g> {
        let _span = super::profile::span(super::profile::Part::Copies);
        match self {
            UninitGradInput::Flat(g) => GradInput::Flat(super::vector::zeros_new(g)),
            UninitGradInput::Sequence(g) => GradInput::Sequence(super::vector::zeros_new(g)),
        }
    }
}

/// [`Layer::backward_uninit`] of a layer that works on rows (as
/// [`Layer::backward_rows`]): `write` gets the pass as rows and the input's gradient as
/// uninitialised rows (`[batch · time, features]` for a sequence), checked to be shaped
/// as the input, and gives those rows back initialised; they come back here in the
/// input's kind.
pub(crate) fn backward_rows_uninit<'g>(
    name: &str,
    pass: Pass<'_>,
    grad_input: UninitGradInput<'g>,
    write: impl FnOnce(RowsPass<'_>, ArrayViewMut2<'g, MaybeUninit<f32>>) -> Result<ArrayViewMut2<'g, f32>>,
) -> Result<GradInput<'g>> {
    let wrong = |expected: &[usize], actual: &[usize]| Error::ShapeMismatch {
        context: format!("layer '{name}' input gradient"),
        expected: expected.to_vec(),
        actual: actual.to_vec(),
    };
    match (pass.input, grad_input) {
        (Activations::Flat(x), UninitGradInput::Flat(g)) if g.dim() == x.dim() => {
            Ok(GradInput::Flat(write(rows_of_pass(pass, name)?, g)?))
        }
        (Activations::Sequence(x), UninitGradInput::Sequence(g)) if g.dim() == x.dim() => {
            let rows = rows_of_pass(pass, name)?;
            Ok(GradInput::Sequence(sequence_as_rows_uninit(g, name, |g| write(rows, g))?))
        }
        (x, g) => Err(wrong(x.shape(), g.shape())),
    }
}

/// `write` of the uninitialised gradient of a batch of sequences as rows (`[batch ·
/// time, features]`), the rows it gives back initialised as the sequences again.
pub(crate) fn sequence_as_rows_uninit<'g>(
    g: ArrayViewMut3<'g, MaybeUninit<f32>>,
    name: &str,
    write: impl FnOnce(ArrayViewMut2<'g, MaybeUninit<f32>>) -> Result<ArrayViewMut2<'g, f32>>,
) -> Result<ArrayViewMut3<'g, f32>> {
    let dims = g.raw_dim();
    let (b, t, f) = g.dim();
    let g = g.into_shape_with_order((b * t, f)).map_err(|_| not_standard(name))?;
    write(g)?.into_shape_with_order(dims).map_err(|_| not_standard(name))
}

/// The arrays of `pass` as rows (`[batch · time, features]` for a batch of sequences):
/// what [`Layer::backward_rows`] reads.
fn rows_of_pass<'p>(pass: Pass<'p>, name: &str) -> Result<RowsPass<'p>> {
    Ok(match pass.input {
        Activations::Flat(x) => {
            RowsPass { input: x, output: pass.output.flat(name)?, grad_output: pass.grad_output.flat(name)? }
        }
        // Nothing here allocates (the name is read only to build an error).
        Activations::Sequence(x) => RowsPass {
            input: steps_as_rows(x, name)?,
            output: steps_as_rows(pass.output.sequence(name)?, name)?,
            grad_output: steps_as_rows(pass.grad_output.sequence(name)?, name)?,
        },
    })
}

/// What a layer's backward pass reads: the forward pass's input (and the batch's mask),
/// its output, and the gradient of the loss with respect to that output.
#[derive(Clone, Copy, Debug)]
pub struct Pass<'p> {
    /// The forward pass's input.
    pub input: Activations<'p>,
    /// The features mask of a batch of sequences (`[batch, time]`), if it has one.
    pub mask: Option<ArrayView2<'p, f32>>,
    /// The forward pass's output.
    pub output: Activations<'p>,
    /// The gradient of the loss with respect to the output.
    pub grad_output: Activations<'p>,
}

pub(crate) fn flat_grad_input<'g>(g: GradInput<'g>, layer: &str) -> Result<ArrayViewMut2<'g, f32>> {
    match g {
        GradInput::Flat(g) => Ok(g),
        GradInput::Sequence(g) => Err(Error::ShapeMismatch {
            context: format!("layer '{layer}': the gradient of a flat input"),
            expected: vec![g.shape()[0], g.shape()[2]],
            actual: g.shape().to_vec(),
        }),
    }
}

pub(crate) fn sequence_grad_input<'g>(g: GradInput<'g>, layer: &str) -> Result<ArrayViewMut3<'g, f32>> {
    match g {
        GradInput::Sequence(g) => Ok(g),
        GradInput::Flat(g) => Err(Error::ShapeMismatch {
            context: format!("layer '{layer}': the gradient of a batch of sequences"),
            expected: vec![g.nrows(), 0, g.ncols()],
            actual: g.shape().to_vec(),
        }),
    }
}

/// A gradient of a batch of sequences as rows of steps (a view: new gradients are in
/// standard layout).
pub(crate) fn rows_of_grad<'g>(g: ArrayViewMut3<'g, f32>, layer: &str) -> Result<ArrayViewMut2<'g, f32>> {
    let (b, t, f) = g.dim();
    g.into_shape_with_order((b * t, f)).map_err(|_| not_standard(layer))
}

/// What a layer's forward pass gets besides its input.
///
/// `'a` is the life of the activations: the output must be allocated from
/// [`ForwardCtx::activations`] (or be a view of memory that lives as long), so working
/// memory, which lives only for `'w`, cannot be returned. The network then checks with
/// [`LayerWorkspaceMgr::validate`] that the output really is in the activations
/// workspace.
pub struct ForwardCtx<'a, 'w> {
    /// Where the output goes ([`ArrayType::Activations`](workspace_core::ArrayType)):
    /// kept until the iteration's backward pass is done.
    pub activations: &'a TypedScope,
    /// Scratch for this call ([`ArrayType::FfWorkingMem`](workspace_core::ArrayType)),
    /// reset as soon as the layer returns.
    pub working: &'w TypedScope,
    /// The manager: the workspaces of each array role, for validation (a network's
    /// managers declare no helper workspaces).
    pub mgr: &'w LayerWorkspaceMgr,
    /// Training (true) or inference (false).
    pub training: bool,
}

/// What a layer's backward pass gets besides its arrays.
pub struct BackwardCtx<'w> {
    /// Scratch for this call ([`ArrayType::BpWorkingMem`](workspace_core::ArrayType)),
    /// reset as soon as the layer returns.
    pub working: &'w TypedScope,
    /// The manager: the workspaces of each array role (a network's managers declare no
    /// helper workspaces).
    pub mgr: &'w LayerWorkspaceMgr,
}

/// The steps of `input` as one `[batch · time, features]` batch, and `(batch, time)`:
/// what [`Layer::forward`]'s default hands to `forward_rows` (copied into standard
/// layout first when it is not).
pub(crate) fn steps_in<'a>(
    input: ArrayView3<'a, f32>,
    ctx: &ForwardCtx<'a, '_>,
    name: &str,
) -> Result<(ArrayView2<'a, f32>, (usize, usize))> {
    let (b, t, _) = input.dim();
    let input =
        if input.is_standard_layout() { input } else { workspace_core::freeze(ctx.activations.copy_of(&input)?) };
    Ok((steps_as_rows(input, name)?, (b, t)))
}

/// `forward`'s output over the rows of [`steps_in`] as a sequence again.
pub(crate) fn steps_out<'a>(
    y: ArrayView2<'a, f32>,
    (b, t): (usize, usize),
    ctx: &ForwardCtx<'a, '_>,
    name: &str,
) -> Result<Activations<'a>> {
    let features = y.ncols();
    let y = if y.is_standard_layout() { y } else { workspace_core::freeze(ctx.activations.copy_of(&y)?) };
    let y = y.into_shape_with_order((b, t, features)).map_err(|_| not_standard(name))?;
    Ok(Activations::Sequence(y))
}

/// What a layer's forward pass leaves for its backward pass besides the input and output
/// the step keeps (an LSTM's gates and states): one per layer, per network or
/// data-parallel worker, made once by [`Layer::tape`]. Most layers need none
/// ([`Tape::none`], which allocates nothing: serving runs every layer with one).
#[derive(Default)]
pub struct Tape(Option<Box<dyn Any + Send>>);

impl Tape {
    /// No tape.
    pub const fn none() -> Tape {
        Tape(None)
    }

    /// A tape holding `value`.
    pub fn new<T: Any + Send>(value: T) -> Tape {
        Tape(Some(Box::new(value)))
    }

    /// The value, when this tape holds a `T`.
    pub fn get_mut<T: Any>(&mut self) -> Option<&mut T> {
        self.0.as_mut().and_then(|value| value.downcast_mut::<T>())
    }

    /// Whether this tape holds nothing.
    pub fn is_none(&self) -> bool {
        self.0.is_none()
    }
}

impl std::fmt::Debug for Tape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Tape(..)" } else { "Tape(none)" })
    }
}

/// The value of `layer`'s tape, or an error saying the tape is not the one the layer
/// made (a training pass handed the tape of another layer, or none).
pub(crate) fn tape_of<'t, T: Any>(tape: &'t mut Tape, layer: &str) -> Result<&'t mut T> {
    tape.get_mut::<T>().ok_or_else(|| {
        Error::InvalidInput(format!(
            "layer '{layer}': the tape handed to its training pass is not the one `Layer::tape` made for it"
        ))
    })
}

/// One parameter of a layer: its name (PyTorch's where PyTorch has the layer: "weight",
/// "bias", "weight_ih_l0", ...) and its shape in carve's layout. A layer's parameters are
/// consecutive in its region of the network's flat buffer, in the order
/// [`Layer::param_shapes`] gives them, each in row-major order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamShape {
    /// The name, unique within the layer; model files store the parameter as
    /// `{layer}.{name}`.
    pub name: String,
    /// The shape.
    pub shape: Vec<usize>,
}

impl ParamShape {
    /// A parameter named `name` of `shape`.
    pub fn new(name: &str, shape: &[usize]) -> ParamShape {
        ParamShape { name: name.to_string(), shape: shape.to_vec() }
    }

    /// Its number of values (saturating: a layer whose values overflow is refused when
    /// the network is built).
    pub fn len(&self) -> usize {
        self.shape.iter().fold(1usize, |n, &d| n.saturating_mul(d))
    }

    /// Whether it holds no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The network's seeded generator, as a layer's [`Layer::init`] draws from it: layers
/// are initialised in order from one generator, so the same seed gives the same
/// parameters on every machine.
pub struct Init<'r> {
    rng: &'r mut carve_rng::Rng,
}

impl<'r> Init<'r> {
    pub(crate) fn new(rng: &'r mut carve_rng::Rng) -> Init<'r> {
        Init { rng }
    }

    /// Uniform in `[low, high)`.
    pub fn uniform(&mut self, low: f32, high: f32) -> f32 {
        self.rng.uniform(low, high)
    }

    /// Each of `values`, in order, uniform in `[low, high)`.
    pub fn fill_uniform(&mut self, values: &mut [f32], low: f32, high: f32) {
        for v in values {
            *v = self.rng.uniform(low, high);
        }
    }

    /// Glorot (Xavier) uniform: each of `values`, in order, uniform in `[-l, l)` with
    /// `l = √(6 / (fan_in + fan_out))`.
    pub fn glorot_uniform(&mut self, fan_in: usize, fan_out: usize, values: &mut [f32]) {
        let limit = (6.0 / (fan_in + fan_out) as f32).sqrt();
        self.fill_uniform(values, -limit, limit);
    }

    /// Each of `values`, in order, from the normal distribution of mean 0 and standard
    /// deviation `std` (Box–Muller, one draw per value; GPT-2's initialisation draws
    /// from N(0, 0.02²)).
    pub fn fill_normal(&mut self, values: &mut [f32], std: f32) {
        for v in values {
            // u1 in (0, 1]: its logarithm is finite.
            let (u1, u2) = (1.0 - f64::from(self.rng.next_f32()), f64::from(self.rng.next_f32()));
            let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            *v = (f64::from(std) * z) as f32;
        }
    }

    /// The next 64 random bits (a seed for a layer's own generator).
    pub fn next_u64(&mut self) -> u64 {
        self.rng.next_u64()
    }
}

/// What [`Layer::backward_rows`] reads: the forward pass's input and output as rows, and
/// the gradient of the loss with respect to the output.
#[derive(Clone, Copy, Debug)]
pub struct RowsPass<'p> {
    /// The forward pass's input, `[rows, inputs]`.
    pub input: ArrayView2<'p, f32>,
    /// The forward pass's output, `[rows, outputs]`.
    pub output: ArrayView2<'p, f32>,
    /// The gradient of the loss with respect to the output.
    pub grad_output: ArrayView2<'p, f32>,
}

/// A layer: its configuration and its passes, through `&self`, written once for
/// training ([`Network`](crate::nn::Network)), every data-parallel worker, serving
/// ([`Model`](crate::nn::serve::Model)) and dry runs.
///
/// A layer holds no parameters. The network holds every layer's parameters in one flat
/// buffer (the layers in backward order, the layout data-parallel training reduces) and
/// hands each call the layer's region: `params`, the values [`Layer::param_shapes`]
/// lists, in its order; the backward pass writes their gradients, in the same layout,
/// into `grads`. Whatever the backward pass needs of the forward pass beyond its input
/// and output goes in the layer's [`Tape`]. Arrays come from the workspaces of the
/// contexts.
///
/// The network tells the layer its input width: [`Layer::output_size`],
/// [`Layer::param_shapes`] and [`Layer::init`] take it.
///
/// A layer of rows implements [`Layer::forward_rows`] and [`Layer::backward_rows`]; a
/// batch of sequences `[batch, time, features]` then goes through them as `[batch · time,
/// features]` rows (DL4J's time-distributed layers). Sequence layers (recurrent layers,
/// heads) implement [`Layer::forward`] and [`Layer::backward`] instead. A layer whose
/// backward pass writes every element of its input's gradient anyway (a matrix product
/// into it) may also implement [`Layer::backward_uninit`], which is handed that
/// gradient uninitialised: the network then writes no zeros first.
///
/// # Where a layer's output may live
///
/// The output of a forward pass must outlive the call (the backward pass reads it), so
/// it is allocated from [`ForwardCtx::activations`]. This layer doubles its input into
/// the activations workspace:
///
/// ```
/// use carve::freeze;
/// use carve::nn::{BackwardCtx, ForwardCtx, Layer, RowsPass};
/// use carve::ndarray::{ArrayView2, ArrayViewMut2};
///
/// struct Double;
///
/// impl Layer for Double {
///     fn name(&self) -> &str {
///         "double"
///     }
///     fn output_size(&self, inputs: usize) -> carve::Result<usize> {
///         Ok(inputs)
///     }
///     fn forward_rows<'a>(
///         &self,
///         _params: &[f32],
///         input: ArrayView2<'a, f32>,
///         ctx: &ForwardCtx<'a, '_>,
///     ) -> carve::Result<ArrayView2<'a, f32>> {
///         let mut out = ctx.activations.zeros::<f32, _>(input.raw_dim())?;
///         out.zip_mut_with(&input, |o, &x| *o = 2.0 * x);
///         Ok(freeze(out))
///     }
///     fn backward_rows(
///         &self,
///         _params: &[f32],
///         _grads: &mut [f32],
///         pass: RowsPass<'_>,
///         grad_input: Option<ArrayViewMut2<'_, f32>>,
///         _ctx: &BackwardCtx<'_>,
///     ) -> carve::Result<()> {
///         if let Some(mut grad_input) = grad_input {
///             grad_input.zip_mut_with(&pass.grad_output, |gi, &g| *gi = 2.0 * g);
///         }
///         Ok(())
///     }
/// }
///
/// let config = carve::nn::NetworkConfig::builder(4).layer(Double).dense(2).build()?;
/// let mut net = carve::nn::Network::new(config)?;
/// let x = carve::ndarray::Array2::<f32>::ones((3, 4));
/// assert!(net.fit_batch(x.view(), carve::ndarray::arr1(&[0, 1, 0]).view())?.is_finite());
/// # Ok::<(), carve::Error>(())
/// ```
///
/// Working memory ([`ForwardCtx::working`]) is reset as soon as the layer returns, so
/// the same layer returning an array of working memory as its output does not compile
/// (the working scope lives for the context's second lifetime, not for the
/// activations' `'a`). The block differs from the one above in one word; rustc reports
/// the error ("lifetime may not live long enough") without an error code, so none is
/// pinned here.
///
/// ```compile_fail
/// # use carve::freeze;
/// # use carve::nn::{ForwardCtx, Layer};
/// # use carve::ndarray::ArrayView2;
/// # struct Double;
/// impl Layer for Double {
/// #   fn name(&self) -> &str {
/// #       "double"
/// #   }
/// #   fn output_size(&self, inputs: usize) -> carve::Result<usize> {
/// #       Ok(inputs)
/// #   }
///     fn forward_rows<'a>(
///         &self,
///         _params: &[f32],
///         input: ArrayView2<'a, f32>,
///         ctx: &ForwardCtx<'a, '_>,
///     ) -> carve::Result<ArrayView2<'a, f32>> {
///         let mut out = ctx.working.zeros::<f32, _>(input.raw_dim())?;
///         out.zip_mut_with(&input, |o, &x| *o = 2.0 * x);
///         Ok(freeze(out))
///     }
/// }
/// ```
///
/// Nor can a layer tie the two lifetimes together to make it compile: an `impl` whose
/// `forward_rows` takes `&ForwardCtx<'a, 'a>` does not match the trait.
///
/// ```compile_fail
/// # use carve::freeze;
/// # use carve::nn::{ForwardCtx, Layer};
/// # use carve::ndarray::ArrayView2;
/// # struct Double;
/// impl Layer for Double {
/// #   fn name(&self) -> &str {
/// #       "double"
/// #   }
/// #   fn output_size(&self, inputs: usize) -> carve::Result<usize> {
/// #       Ok(inputs)
/// #   }
///     fn forward_rows<'a>(
///         &self,
///         _params: &[f32],
///         input: ArrayView2<'a, f32>,
///         ctx: &ForwardCtx<'a, 'a>,
///     ) -> carve::Result<ArrayView2<'a, f32>> {
///         let mut out = ctx.working.zeros::<f32, _>(input.raw_dim())?;
///         out.zip_mut_with(&input, |o, &x| *o = 2.0 * x);
///         Ok(freeze(out))
///     }
/// }
/// ```
///
/// What the compiler cannot see (an output that has the right lifetime but lives
/// elsewhere, such as the layer's own input) the network catches at run time with
/// [`Error::WrongLocation`](crate::workspace_core::Error::WrongLocation), naming the layer.
///
/// Results must not depend on other rows of the batch (every layer of [`crate::nn`]
/// computes each row, or each sequence, alone): a batched inference pool relies on it to
/// give a request the same bits alone or batched with others.
pub trait Layer: Any + Send + Sync {
    /// A short name for messages and model files ("dense_0", "dropout").
    fn name(&self) -> &str;

    /// The number of output columns (features per step) for `inputs` input columns, or
    /// an error when the layer cannot take that many.
    ///
    /// # Errors
    ///
    /// A configuration error naming the mismatch.
    fn output_size(&self, inputs: usize) -> Result<usize>;

    /// The parameters for `inputs` input columns, in the order of the layer's region of
    /// the flat buffer, with their names and shapes. The default: none.
    fn param_shapes(&self, inputs: usize) -> Vec<ParamShape> {
        let _ = inputs;
        Vec::new()
    }

    /// Fills this layer's parameters (`params`, zeros, in [`Layer::param_shapes`]'
    /// layout) from the network's seeded generator. The default leaves them 0.
    fn init(&self, inputs: usize, params: &mut [f32], init: &mut Init<'_>) {
        let _ = (inputs, params, init);
    }

    /// A tape for what this layer's training forward pass leaves for its backward pass
    /// (made once per network and per data-parallel worker). The default: none.
    fn tape(&self) -> Tape {
        Tape::none()
    }

    /// Whether a training step may let this layer's output go once the next layer's
    /// forward pass has read it, and compute it again ([`Layer::forward`] on the same
    /// input) when the backward pass reaches the next layer, rather than keep it for the
    /// whole step: for a layer whose forward pass costs little next to what its output
    /// would hold through the step — an elementwise function ([`Gelu`](crate::nn::Gelu)),
    /// a normalisation ([`LayerNorm`](crate::nn::LayerNorm)). Its forward pass must give
    /// the same bits the second time and leave nothing on its tape.
    ///
    /// The step does so only where the next layer offers [`Layer::forward_detached`]
    /// and nothing else reads the output (it is not the last layer's, a residual join's
    /// or a block's input); elsewhere it keeps the output. The default: `false`.
    fn rebuilt_in_backward(&self) -> bool {
        false
    }

    /// Whether [`Layer::forward_detached`] is offered. The default: `false`.
    fn detaches(&self) -> bool {
        false
    }

    /// [`Layer::forward`] of an input that lives shorter than the output (the output of
    /// a layer that is [rebuilt in backward](Layer::rebuilt_in_backward)): the output
    /// must be allocated in `ctx.activations`, never a view of the input, which the
    /// signature guarantees. The same arithmetic and the same tape as `forward`. `None`
    /// (the default) where the layer does not offer it; [`Layer::detaches`] says which.
    fn forward_detached<'a>(
        &self,
        params: &[f32],
        input: Activations<'_>,
        mask: Option<ArrayView2<'a, f32>>,
        tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Option<Result<Activations<'a>>> {
        let _ = (params, input, mask, tape, ctx);
        None
    }

    /// The forward pass over rows `[rows, inputs]`: the output, allocated in
    /// `ctx.activations`. What the default [`Layer::forward`] calls, for a flat batch and
    /// for every step of a batch of sequences. The rows may come in any layout (a flat
    /// batch as its caller gave it): read them through ndarray, not `as_slice().unwrap()`.
    /// A layer whose rows are its only input says [`Layer::per_step`], so that it runs
    /// in generation streams too. A layer that passes its input on unchanged returns
    /// `ctx.activations.leverage(input)` (no copy where it already lives there).
    ///
    /// In a dry run ([`Network::dry_run`](crate::nn::Network::dry_run)) a layer
    /// allocates exactly as it would; carve's kernels ([`sgemm`](crate::nn::gemm::sgemm)
    /// among them) compute nothing then, and a layer's own loops may skip their
    /// arithmetic by asking [`dry::running`](crate::nn::dry::running).
    ///
    /// # Errors
    ///
    /// Shape and workspace errors; the default, an error saying the layer implements
    /// neither this nor [`Layer::forward`].
    fn forward_rows<'a>(
        &self,
        params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<ArrayView2<'a, f32>> {
        let _ = (params, input, ctx);
        Err(Error::InvalidConfig {
            reason: format!("layer '{}' implements neither `Layer::forward_rows` nor `Layer::forward`", self.name()),
        })
    }

    /// The backward pass over rows: writes the gradient of every parameter into `grads`
    /// (every element, in `params`' layout) and, when given, the gradient of the input
    /// into `grad_input` (every element). A network hands a layer of the user's own its
    /// `grads` zeroed, so that a pass that adds into them (`+=`, as PyTorch's autograd
    /// accumulates) gives the same gradients as one that writes each element.
    ///
    /// # Errors
    ///
    /// Shape and workspace errors; the default, an error saying the layer implements
    /// neither this nor [`Layer::backward`].
    fn backward_rows(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let _ = (params, grads, pass, grad_input, ctx);
        Err(Error::InvalidConfig {
            reason: format!("layer '{}' implements neither `Layer::backward_rows` nor `Layer::backward`", self.name()),
        })
    }

    /// The forward pass: the output, allocated in `ctx.activations`, of the kind of the
    /// input (but for heads that pool sequences into rows). `mask` (`[batch, time]`, 1
    /// for a step that holds data, 0 for padding; `None`: every step holds data) comes
    /// with a batch of sequences. `tape` is this layer's (from [`Layer::tape`]) in
    /// training, and [`Tape::none`] in inference (`ctx.training` false).
    ///
    /// The default runs [`Layer::forward_rows`] on a flat batch, and on every step of a
    /// batch of sequences as one `[batch · time, features]` batch: its output at padded
    /// steps is ignored by what follows.
    ///
    /// # Errors
    ///
    /// As [`Layer::forward_rows`].
    fn forward<'a>(
        &self,
        params: &[f32],
        input: Activations<'a>,
        mask: Option<ArrayView2<'a, f32>>,
        tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        let _ = (mask, tape);
        match input {
            Activations::Flat(x) => Ok(Activations::Flat(self.forward_rows(params, x, ctx)?)),
            Activations::Sequence(x) => {
                let (rows, dims) = steps_in(x, ctx, self.name())?;
                let y = self.forward_rows(params, rows, ctx)?;
                steps_out(y, dims, ctx, self.name())
            }
        }
    }

    /// The backward pass of [`Layer::forward`]: the gradient of every parameter into
    /// `grads` (every element; a network zeroes them first for a layer of the user's
    /// own, see [`Layer::backward_rows`]) and, when given, of the input into
    /// `grad_input` (every element; 0 at padded steps, which a network also sees to for
    /// a layer of the user's own), of the kind of the input.
    ///
    /// The default runs [`Layer::backward_rows`] as [`Layer::forward`]'s default runs
    /// [`Layer::forward_rows`].
    ///
    /// # Errors
    ///
    /// As [`Layer::backward_rows`].
    fn backward(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        tape: &mut Tape,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let _ = tape;
        let name = self.name();
        let grad_input = match pass.input {
            Activations::Flat(_) => grad_input.map(|g| flat_grad_input(g, name)).transpose()?,
            Activations::Sequence(_) => {
                grad_input.map(|g| sequence_grad_input(g, name).and_then(|g| rows_of_grad(g, name))).transpose()?
            }
        };
        self.backward_rows(params, grads, rows_of_pass(pass, name)?, grad_input, ctx)
    }

    /// [`Layer::backward`] with the gradient of the input given uninitialised: the
    /// layer writes every element and gives the same array back initialised (the
    /// network checks it is the same elements, in the same shape and layout). The
    /// network calls this, not [`Layer::backward`], whenever it needs the gradient of a
    /// layer's input; a layer whose backward pass writes every element anyway (a matrix
    /// product into it) implements it to spare the zeros the default writes first.
    ///
    /// The default fills the array with zeros and runs [`Layer::backward`] on it.
    ///
    /// # Errors
    ///
    /// As [`Layer::backward`].
    fn backward_uninit<'g>(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: UninitGradInput<'g>,
        tape: &mut Tape,
        ctx: &BackwardCtx<'_>,
    ) -> Result<GradInput<'g>> {
        let mut grad_input = grad_input.zeroed();
        self.backward(params, grads, pass, Some(grad_input.reborrow()), tape, ctx)?;
        Ok(grad_input)
    }

    /// What the layer is on a device ([`DeviceForm`](crate::nn::DeviceForm)), for a
    /// network that trains on one ([`NetworkConfigBuilder::device`](crate::nn::NetworkConfigBuilder::device)).
    /// The default: `None`, a layer that trains on the host only.
    fn device_form(&self) -> Option<crate::nn::DeviceForm> {
        None
    }

    /// Whether each step's output depends on that step's input alone (a dense layer, a
    /// normalisation, an elementwise function, a token embedding), so that the next
    /// steps of a generation stream run through [`Layer::forward`] as they are. The
    /// default: `false` (a layer that mixes steps, as an LSTM does, says how it runs
    /// in a stream with [`Layer::forward_stream`], or cannot generate).
    fn per_step(&self) -> bool {
        false
    }

    /// Whether the layer reads the network's token ids rather than features: the
    /// batch's [`Input::Tokens`](crate::nn::Input::Tokens), handed on as one feature a
    /// step holding the id (a token embedding). Such a layer must be the network's
    /// first, and a dry run ([`Network::dry_run`](crate::nn::Network::dry_run)) of a
    /// network whose first layer says so sizes a batch of token ids. The default:
    /// `false`.
    fn reads_tokens(&self) -> bool {
        false
    }

    /// Whether the layer runs in a generation stream: the models it is part of can
    /// generate only when each of its layers does, and say so before the first token
    /// ([`Model::context`](crate::nn::serve::Model::context)). The default:
    /// [`Layer::per_step`] (what the default [`Layer::forward_stream`] runs). A layer
    /// that implements its own `forward_stream` says `true` (a layer that keeps state
    /// per stream, a non-zero [`Layer::stream_state_len`], is taken to run its own).
    fn runs_in_stream(&self) -> bool {
        self.per_step()
    }

    /// The most steps a stream through this layer may hold (a position embedding's
    /// table); `None` (the default): no bound of its own.
    fn max_steps(&self) -> Option<usize> {
        None
    }

    /// The values this layer keeps per generation stream of at most `context` steps,
    /// for `inputs` features per step (an attention layer: the keys and values of every
    /// step). The default: none.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when the state's size overflows.
    fn stream_state_len(&self, inputs: usize, context: usize) -> Result<usize> {
        let _ = (inputs, context);
        Ok(0)
    }

    /// The forward pass of the next steps of a batch of generation streams (one row of
    /// `input`, `[streams, new steps, features]`, per stream), given what the streams'
    /// earlier steps left in `state` (and updating it): the output, allocated in
    /// `ctx.activations`, as [`Layer::forward`] of the whole sequences would give at
    /// the new steps. Inference only (`ctx.training` is false; no mask: a stream has
    /// no padding).
    ///
    /// The default runs [`Layer::forward`] on the new steps when the layer is
    /// [per step](Layer::per_step), and otherwise fails. A layer that implements it
    /// says so with [`Layer::runs_in_stream`] (or keeps state per stream,
    /// [`Layer::stream_state_len`]), so that a model of it can generate.
    ///
    /// # Errors
    ///
    /// As [`Layer::forward`]; [`Error::InvalidConfig`] for a layer that cannot run in
    /// a stream.
    fn forward_stream<'a>(
        &self,
        params: &[f32],
        input: Activations<'a>,
        state: &mut StreamState<'_>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        let _ = state;
        if !self.per_step() {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "layer '{}' cannot generate token by token: its steps depend on each other and it implements no \
                     `Layer::forward_stream`",
                    self.name()
                ),
            });
        }
        self.forward(params, input, None, &mut Tape::none(), ctx)
    }
}

/// What the forward pass of the next steps of a batch of generation streams
/// ([`Layer::forward_stream`]) sees of the steps before them: per row of the batch
/// (one stream each), the steps its stream has taken (the position of its first new
/// step) and this layer's state for that stream, [`Layer::stream_state_len`] values
/// (an attention layer's keys and values of the steps before: its KV cache), kept
/// from one call to the next while the stream lives. A stream's state starts as zeros;
/// when its window slides it runs again from position 0 over what it held, so a layer
/// reads only what it wrote for the positions before `position(row)`.
pub struct StreamState<'s> {
    /// Every stream slot's state, `per_slot` values each.
    values: &'s mut [f32],
    per_slot: usize,
    /// This layer's values within a slot's.
    region: std::ops::Range<usize>,
    /// Per row: its stream's slot and position.
    rows: &'s [StreamRow],
    context: usize,
}

/// A row of a batch of generation streams: its stream's slot of state and the steps
/// the stream has taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StreamRow {
    pub(crate) slot: usize,
    pub(crate) position: usize,
}

impl<'s> StreamState<'s> {
    /// The state of `rows` in `values` (`per_slot` values per slot, this layer's at
    /// `region` of each); the rows' slots are distinct and in `values`.
    pub(crate) fn new(
        values: &'s mut [f32],
        per_slot: usize,
        region: std::ops::Range<usize>,
        rows: &'s [StreamRow],
        context: usize,
    ) -> StreamState<'s> {
        debug_assert!(region.end <= per_slot);
        debug_assert!(rows.iter().all(|r| (r.slot + 1) * per_slot <= values.len()));
        StreamState { values, per_slot, region, rows, context }
    }

    /// The streams (rows of the batch).
    pub fn streams(&self) -> usize {
        self.rows.len()
    }

    /// The steps stream `row` has taken before this call's: the position of its first
    /// new step.
    pub fn position(&self, row: usize) -> usize {
        self.rows[row].position
    }

    /// The most steps a stream holds (the state was sized for them).
    pub fn context(&self) -> usize {
        self.context
    }

    /// This layer's state for stream `row`.
    pub fn state(&self, row: usize) -> &[f32] {
        let at = self.rows[row].slot * self.per_slot;
        &self.values[at + self.region.start..at + self.region.end]
    }

    /// This layer's state for stream `row`, to update.
    pub fn state_mut(&mut self, row: usize) -> &mut [f32] {
        let at = self.rows[row].slot * self.per_slot;
        &mut self.values[at + self.region.start..at + self.region.end]
    }
}

impl std::fmt::Debug for StreamState<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamState").field("rows", &self.rows).field("context", &self.context).finish_non_exhaustive()
    }
}

/// Checks that `values` (a layer's parameters or gradients) holds `expected` values.
pub(crate) fn check_len(layer: &str, what: &str, len: usize, expected: usize) -> Result<()> {
    if len != expected {
        return Err(Error::ShapeMismatch {
            context: format!("layer '{layer}' {what} (one per parameter value)"),
            expected: vec![expected],
            actual: vec![len],
        });
    }
    Ok(())
}

/// `layer`'s parameters for `inputs` input columns, initialised as a network of seed
/// `seed` whose first layer it is initialises them: for running a layer on its own (a
/// gradient check, a tool), the parameters in [`Layer::param_shapes`]' layout.
///
/// ```
/// use carve::nn::{initial_params, Dense};
///
/// let params = initial_params(&Dense::new(4, 3), 4, 7);
/// assert_eq!(params.len(), 4 * 3 + 3);
/// assert!(params[12..].iter().all(|&b| b == 0.0)); // zero biases
/// ```
///
/// # Panics
///
/// When the parameters' count overflows or the machine cannot hold them (a network
/// refuses such a layer with an error: [`Network::new`](crate::nn::Network::new)).
pub fn initial_params(layer: &dyn Layer, inputs: usize, seed: u64) -> Vec<f32> {
    let count = layer.param_shapes(inputs).iter().try_fold(0usize, |n, p| n.checked_add(p.len()));
    let count = count.unwrap_or_else(|| panic!("layer '{}': its parameters' count overflows", layer.name()));
    let mut params = Vec::new();
    if params.try_reserve_exact(count).is_err() {
        panic!("layer '{}': its {count} parameters cannot be allocated", layer.name());
    }
    params.resize(count, 0.0);
    let mut rng = carve_rng::Rng::new(seed);
    layer.init(inputs, &mut params, &mut Init::new(&mut rng));
    params
}
