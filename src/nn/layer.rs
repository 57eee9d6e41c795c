//! The [`Layer`] trait a custom layer implements, and the workspace contexts the
//! network hands it.

use crate::{Error, Result};
use std::any::Any;

use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2, ArrayViewMut3};
use workspace_core::{LayerWorkspaceMgr, TypedScope};

/// What flows between layers: a flat batch `[batch, features]`, or a batch of
/// sequences `[batch, time, features]` (whose mask, `[batch, time]`, the network hands
/// to every sequence method alongside).
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

pub(crate) fn not_standard(layer: &str) -> Error {
    Error::InvalidInput(format!(
        "layer '{layer}': a batch of sequences must be in standard (row-major) layout to be applied step by step; \
         allocate it with the scope's `zeros`/`copy_of`"
    ))
}

/// What one worker's forward pass of a layer leaves for its backward pass besides the
/// input and output the trainer keeps (an LSTM's gates and states), made once per worker
/// by [`ParallelLayer::tape`](crate::nn::ParallelLayer::tape); `()` for most layers.
pub type Tape = Box<dyn Any + Send>;

/// The gradient of a layer's input, of the kind of the input, that its backward pass
/// writes (every element).
#[derive(Debug)]
pub enum GradInput<'g> {
    /// Of a flat batch `[batch, features]`.
    Flat(ArrayViewMut2<'g, f32>),
    /// Of a batch of sequences `[batch, time, features]`.
    Sequence(ArrayViewMut3<'g, f32>),
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
    /// The manager, for helper workspaces and validation.
    pub mgr: &'w LayerWorkspaceMgr,
    /// Training (true) or inference (false).
    pub training: bool,
}

/// What a layer's backward pass gets besides its arrays.
pub struct BackwardCtx<'w> {
    /// Scratch for this call ([`ArrayType::BpWorkingMem`](workspace_core::ArrayType)),
    /// reset as soon as the layer returns.
    pub working: &'w TypedScope,
    /// The manager, for helper workspaces.
    pub mgr: &'w LayerWorkspaceMgr,
}

/// One trainable parameter and its gradient, as the updater sees them.
pub struct Param<'p> {
    /// The values, updated in place.
    pub value: &'p mut [f32],
    /// The gradient of the loss with respect to `value`, from the last backward pass.
    pub grad: &'p [f32],
}

/// A layer of a feed-forward network on 2-D batches (rows are examples).
///
/// Parameters and their gradients belong to the layer (outside any workspace);
/// everything else a layer needs it takes from the workspaces in its context.
///
/// # Where a layer's output may live
///
/// The output of [`Layer::forward`] must outlive the call (the backward pass reads it),
/// so it is allocated from [`ForwardCtx::activations`]. This layer doubles its input
/// into the activations workspace:
///
/// ```
/// use carve::freeze;
/// use carve::nn::{BackwardCtx, ForwardCtx, Layer};
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
///     fn forward<'a>(
///         &mut self,
///         input: ArrayView2<'a, f32>,
///         ctx: &ForwardCtx<'a, '_>,
///     ) -> carve::Result<ArrayView2<'a, f32>> {
///         let mut out = ctx.activations.zeros::<f32, _>(input.raw_dim())?;
///         out.zip_mut_with(&input, |o, &x| *o = 2.0 * x);
///         Ok(freeze(out))
///     }
///     fn backward(
///         &mut self,
///         _input: ArrayView2<'_, f32>,
///         _output: ArrayView2<'_, f32>,
///         grad_output: ArrayView2<'_, f32>,
///         grad_input: Option<ArrayViewMut2<'_, f32>>,
///         _ctx: &BackwardCtx<'_>,
///     ) -> carve::Result<()> {
///         if let Some(mut grad_input) = grad_input {
///             grad_input.zip_mut_with(&grad_output, |gi, &g| *gi = 2.0 * g);
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
/// # use carve::nn::{BackwardCtx, ForwardCtx, Layer};
/// # use carve::ndarray::{ArrayView2, ArrayViewMut2};
/// # struct Double;
/// impl Layer for Double {
/// #   fn name(&self) -> &str {
/// #       "double"
/// #   }
/// #   fn output_size(&self, inputs: usize) -> carve::Result<usize> {
/// #       Ok(inputs)
/// #   }
///     fn forward<'a>(
///         &mut self,
///         input: ArrayView2<'a, f32>,
///         ctx: &ForwardCtx<'a, '_>,
///     ) -> carve::Result<ArrayView2<'a, f32>> {
///         let mut out = ctx.working.zeros::<f32, _>(input.raw_dim())?;
///         out.zip_mut_with(&input, |o, &x| *o = 2.0 * x);
///         Ok(freeze(out))
///     }
/// #   fn backward(
/// #       &mut self,
/// #       _input: ArrayView2<'_, f32>,
/// #       _output: ArrayView2<'_, f32>,
/// #       grad_output: ArrayView2<'_, f32>,
/// #       grad_input: Option<ArrayViewMut2<'_, f32>>,
/// #       _ctx: &BackwardCtx<'_>,
/// #   ) -> carve::Result<()> {
/// #       if let Some(mut grad_input) = grad_input {
/// #           grad_input.zip_mut_with(&grad_output, |gi, &g| *gi = 2.0 * g);
/// #       }
/// #       Ok(())
/// #   }
/// }
/// ```
///
/// Nor can a layer tie the two lifetimes together to make it compile: an `impl` whose
/// `forward` takes `&ForwardCtx<'a, 'a>` does not match the trait.
///
/// ```compile_fail
/// # use carve::freeze;
/// # use carve::nn::{BackwardCtx, ForwardCtx, Layer};
/// # use carve::ndarray::{ArrayView2, ArrayViewMut2};
/// # struct Double;
/// impl Layer for Double {
/// #   fn name(&self) -> &str {
/// #       "double"
/// #   }
/// #   fn output_size(&self, inputs: usize) -> carve::Result<usize> {
/// #       Ok(inputs)
/// #   }
///     fn forward<'a>(
///         &mut self,
///         input: ArrayView2<'a, f32>,
///         ctx: &ForwardCtx<'a, 'a>,
///     ) -> carve::Result<ArrayView2<'a, f32>> {
///         let mut out = ctx.working.zeros::<f32, _>(input.raw_dim())?;
///         out.zip_mut_with(&input, |o, &x| *o = 2.0 * x);
///         Ok(freeze(out))
///     }
/// #   fn backward(
/// #       &mut self,
/// #       _input: ArrayView2<'_, f32>,
/// #       _output: ArrayView2<'_, f32>,
/// #       grad_output: ArrayView2<'_, f32>,
/// #       grad_input: Option<ArrayViewMut2<'_, f32>>,
/// #       _ctx: &BackwardCtx<'_>,
/// #   ) -> carve::Result<()> {
/// #       if let Some(mut grad_input) = grad_input {
/// #           grad_input.zip_mut_with(&grad_output, |gi, &g| *gi = 2.0 * g);
/// #       }
/// #       Ok(())
/// #   }
/// }
/// ```
///
/// What the compiler cannot see (an output that has the right lifetime but lives
/// elsewhere, such as the layer's own input) the network catches at run time with
/// [`Error::WrongLocation`](crate::workspace_core::Error::WrongLocation), naming the layer.
pub trait Layer {
    /// A short name for messages ("dense_0", "dropout").
    fn name(&self) -> &str;

    /// The number of output columns for `inputs` input columns, or an error when the
    /// layer cannot take that many.
    ///
    /// # Errors
    ///
    /// A configuration error naming the mismatch.
    fn output_size(&self, inputs: usize) -> Result<usize>;

    /// Initialises the parameters from the network's seeded generator.
    fn init(&mut self, _rng: &mut crate::nn::Rng) {}

    /// The forward pass: returns the output, allocated in `ctx.activations`.
    ///
    /// In a dry run ([`Network::dry_run`](crate::nn::Network::dry_run)) the scopes are
    /// shape-only (`ctx.working.is_shape_only()`): a layer then allocates exactly as it
    /// would and may skip its arithmetic, as carve's layers do (the same holds for the
    /// backward pass). One that computes anyway works on zeros and changes its own
    /// state as a pass would.
    ///
    /// # Errors
    ///
    /// Workspace errors (allocation, a misplaced array).
    fn forward<'a>(&mut self, input: ArrayView2<'a, f32>, ctx: &ForwardCtx<'a, '_>) -> Result<ArrayView2<'a, f32>>;

    /// The backward pass: given the input and output of the last forward pass and the
    /// gradient of the loss with respect to the output, stores the parameter
    /// gradients and, when `grad_input` is given, writes the gradient with respect to
    /// the input into it (every element).
    ///
    /// # Errors
    ///
    /// Workspace errors.
    fn backward(
        &mut self,
        input: ArrayView2<'_, f32>,
        output: ArrayView2<'_, f32>,
        grad_output: ArrayView2<'_, f32>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()>;

    /// The forward pass over a batch of sequences `[batch, time, features]`, whose
    /// `mask` (`[batch, time]`, 1 for a step that holds data and 0 for padding; `None`:
    /// every step holds data) the network hands to every sequence layer.
    ///
    /// The default applies [`Layer::forward`] to every step, as one `[batch · time,
    /// features]` batch (DL4J's time-distributed feed-forward layers): a dense layer or
    /// a ReLU works on sequences as it is, its output at padded steps ignored by what
    /// follows. Recurrent layers ([`Lstm`](crate::nn::Lstm)) and heads
    /// ([`LastStep`](crate::nn::LastStep), [`MaskedMean`](crate::nn::MaskedMean))
    /// override it.
    ///
    /// # Errors
    ///
    /// As [`Layer::forward`].
    fn forward_sequence<'a>(
        &mut self,
        input: ArrayView3<'a, f32>,
        mask: Option<ArrayView2<'a, f32>>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        let _ = mask;
        let (rows, dims) = steps_in(input, ctx, self.name())?;
        let y = self.forward(rows, ctx)?;
        steps_out(y, dims, ctx, self.name())
    }

    /// The backward pass of [`Layer::forward_sequence`]: `output` is what it returned,
    /// `grad_output` the gradient of the loss with respect to it (of the same kind), and
    /// `grad_input`, when given, receives the gradient with respect to `input` (every
    /// element; 0 at padded steps).
    ///
    /// The default is [`Layer::backward`] over every step, as
    /// [`Layer::forward_sequence`]'s default runs [`Layer::forward`].
    ///
    /// # Errors
    ///
    /// As [`Layer::backward`].
    fn backward_sequence(
        &mut self,
        input: ArrayView3<'_, f32>,
        mask: Option<ArrayView2<'_, f32>>,
        output: Activations<'_>,
        grad_output: Activations<'_>,
        grad_input: Option<ArrayViewMut3<'_, f32>>,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let _ = mask;
        // Nothing here allocates (the name is read only to build an error).
        let input = steps_as_rows(input, self.name())?;
        let output = steps_as_rows(output.sequence(self.name())?, self.name())?;
        let grad_output = steps_as_rows(grad_output.sequence(self.name())?, self.name())?;
        let grad_input = match grad_input {
            None => None,
            Some(g) => {
                let (b, t, f) = g.dim();
                Some(g.into_shape_with_order((b * t, f)).map_err(|_| not_standard(self.name()))?)
            }
        };
        self.backward(input, output, grad_output, grad_input, ctx)
    }

    /// Calls `f` on each parameter with its gradient, in a fixed order.
    fn params(&mut self, _f: &mut dyn FnMut(Param<'_>)) {}

    /// The number of trainable values.
    fn param_count(&self) -> usize {
        0
    }

    /// A copy of this layer for serving: its parameters (not its gradients or caches)
    /// in a [`FrozenLayer`], which infers through `&self` from any thread. What
    /// [`Network::freeze`](crate::nn::Network::freeze) calls for every layer; `None`
    /// (the default) means the layer cannot be served, and freezing the network fails
    /// naming it. The layers of [`crate::nn`] all freeze.
    fn frozen(&self) -> Option<Box<dyn FrozenLayer>> {
        None
    }

    /// This layer as a data-parallel trainer runs it: its structure, without its
    /// parameters (the trainer reads those through [`Layer::params`] and holds them
    /// once, for every worker). What [`DataParallel`](crate::nn::DataParallel) calls
    /// for every layer; `None` (the default) means the layer cannot train data-parallel,
    /// and building the trainer fails naming it. The layers of [`crate::nn`] all can.
    fn data_parallel(&self) -> Option<Box<dyn crate::nn::ParallelLayer>> {
        None
    }
}

/// The steps of `input` as one `[batch · time, features]` batch, and `(batch, time)`:
/// what [`Layer::forward_sequence`]'s default hands to `forward` (copied into standard
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

/// A layer frozen for serving: its parameters only, read through `&self`, so one copy
/// serves every thread (`Send + Sync`). A [`Model`](crate::nn::Model) holds these;
/// [`Layer::frozen`] makes one from a trained layer.
///
/// The context is the one training's forward pass gets, with
/// [`ForwardCtx::training`] false: the output goes to [`ForwardCtx::activations`],
/// scratch to [`ForwardCtx::working`]. A frozen layer must keep nothing of the context
/// once it returns (no clone of the manager or of a workspace): the model's arena then
/// stays on the calling thread and is rebuilt for the next caller.
///
/// Results must not depend on other rows of the batch (every layer of [`crate::nn`]
/// computes each row alone): a batched pool relies on it to give a request the same
/// bits alone or batched with others.
pub trait FrozenLayer: std::any::Any + Send + Sync {
    /// A short name for messages.
    fn name(&self) -> &str;

    /// The number of output columns for `inputs` input columns, or an error when the
    /// layer cannot take that many.
    ///
    /// # Errors
    ///
    /// A configuration error naming the mismatch.
    fn output_size(&self, inputs: usize) -> Result<usize>;

    /// The forward pass over a flat batch, output allocated in `ctx.activations`.
    ///
    /// # Errors
    ///
    /// Shape and workspace errors.
    fn forward<'a>(&self, input: ArrayView2<'a, f32>, ctx: &ForwardCtx<'a, '_>) -> Result<ArrayView2<'a, f32>>;

    /// The forward pass over a batch of sequences; the default applies
    /// [`FrozenLayer::forward`] to every step, as [`Layer::forward_sequence`]'s does.
    ///
    /// # Errors
    ///
    /// As [`FrozenLayer::forward`].
    fn forward_sequence<'a>(
        &self,
        input: ArrayView3<'a, f32>,
        mask: Option<ArrayView2<'a, f32>>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        let _ = mask;
        let (rows, dims) = steps_in(input, ctx, self.name())?;
        steps_out(self.forward(rows, ctx)?, dims, ctx, self.name())
    }

    /// The number of parameters (for the model's weight bytes).
    fn param_count(&self) -> usize {
        0
    }
}

/// A built-in layer frozen for serving: the layer, its gradients and caches emptied.
#[derive(Debug)]
pub(crate) struct Frozen<L>(pub(crate) L);
