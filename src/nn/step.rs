//! The training step's passes, written once: input checks, forward, loss, backward into
//! the gradient buffers, finite checks, with the breakdown's spans and the timeline's
//! labels. Three callers drive it:
//!
//! - [`Network::fit_batch`](crate::nn::Network::fit_batch), on the whole batch, its
//!   layers' own gradients;
//! - each data-parallel worker, on its shard, into its gradient bucket (the
//!   parameters shared by every worker);
//! - the dry run ([`Network::dry_run`](crate::nn::Network::dry_run)), in shape-only
//!   workspaces: the same allocations and scopes, in the same order, and no arithmetic.
//!   The step does not ask: the kernels that issue arithmetic (the matrix multiply,
//!   the layers' elementwise kernels, the loss, the finite checks) skip it while a dry
//!   run runs (see `nn::kernels`).
//!
//! The loss is summed, not averaged, and its gradient scaled by one over the labels
//! the *whole batch* counts, so a shard's gradients add up to the batch's: a network
//! and one data-parallel worker run the same arithmetic and give the same bits.
//!
//! A layer that allows it ([`Layer::rebuilt_in_backward`]: GELU, layer norms) has its
//! output let go once the next layer has read it, when that layer reads its input into
//! an output of its own ([`Layer::detaches`]) and nothing else reads it: the output
//! lives in the forward working memory for the two layers' forward passes, and the
//! backward pass computes it again there, from the input kept for it, for the next
//! layer's backward pass and its own. The arithmetic is the same, so are the bits; the
//! step keeps fewer bytes through the forward pass (a GPT: its GELU and layer norm
//! outputs, a fifth of what the step holds at its peak).
//!
//! [`forward`] is the forward pass alone, the one loop inference runs too.

use allocator_api2::vec::Vec as ArenaVec;
use ndarray::{ArrayView2, ArrayViewMut2, Ix2, Ix3};
use workspace_core::{freeze, ArrayType, Handle, LayerWorkspaceMgr, TypedScope};

use crate::{Error, Result};

use super::finite;
use super::layer::{
    Activations, BackwardCtx, ForwardCtx, GradInput, Layer, Pass, StreamRow, StreamState, Tape, UninitGradInput,
};
use super::loss::SoftmaxCrossEntropy;
use super::network::{label, loss_input, standard_labels, training_input, Input, Labels, LayerLabels};
use super::params::Params;
use super::profile::{self, Part};
use super::residual::{blocks_starting_at, join_of, Stack};
use super::vector::{add_assign, copy_new, sum_new, zeros_new};

/// The layers of a step as the step drives them, by index in forward order, with the
/// parameters they read, the gradient buffers their backward passes write and their
/// tapes: a network's own, a data-parallel worker's (the shared parameters, its
/// gradient bucket and its tapes), or a served model's (no gradients, no tapes: forward
/// only).
pub(crate) struct StepLayers<'s> {
    pub(crate) layers: &'s [Box<dyn Layer>],
    /// Where each layer's parameters are in `values` and `grads`.
    pub(crate) params: &'s Params,
    pub(crate) values: &'s [f32],
    /// The gradients, in `values`' layout (`None`: forward only).
    pub(crate) grads: Option<&'s mut [f32]>,
    /// One tape per layer (`None`: inference, every layer handed [`Tape::none`]).
    pub(crate) tapes: Option<&'s mut [Tape]>,
    /// Generation: the streams whose next steps the forward pass runs (every layer
    /// through [`Layer::forward_stream`]).
    pub(crate) streams: Option<Streams<'s>>,
}

/// The state of the streams a generation step runs: `per_slot` values per stream slot,
/// each layer's at its region of a slot's; the rows of the batch and the streams'
/// context.
pub(crate) struct Streams<'s> {
    pub(crate) values: &'s mut [f32],
    pub(crate) per_slot: usize,
    pub(crate) regions: &'s [std::ops::Range<usize>],
    pub(crate) rows: &'s [StreamRow],
    pub(crate) context: usize,
}

impl StepLayers<'_> {
    /// The number of layers.
    pub(crate) fn count(&self) -> usize {
        self.layers.len()
    }

    /// Layer `i`'s name.
    pub(crate) fn name(&self, i: usize) -> &str {
        self.layers[i].name()
    }

    /// `f` with layer `i`, its parameters and its tape (an empty one for inference).
    #[inline]
    fn with_layer<R>(&mut self, i: usize, f: impl FnOnce(&dyn Layer, &[f32], &mut Tape) -> R) -> R {
        let region = self.params.layout.regions[i].clone();
        let mut none = Tape::none();
        let tape = match self.tapes.as_deref_mut() {
            Some(tapes) => &mut tapes[i],
            None => &mut none,
        };
        f(self.layers[i].as_ref(), &self.values[region], tape)
    }

    /// Layer `i`'s forward pass.
    #[inline]
    pub(crate) fn forward<'a>(
        &mut self,
        i: usize,
        input: Activations<'a>,
        mask: Option<ArrayView2<'a, f32>>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        if let Some(streams) = self.streams.as_mut() {
            let params = &self.values[self.params.layout.regions[i].clone()];
            let mut state = StreamState::new(
                &mut *streams.values,
                streams.per_slot,
                streams.regions[i].clone(),
                streams.rows,
                streams.context,
            );
            return self.layers[i].forward_stream(params, input, &mut state, ctx);
        }
        self.with_layer(i, |layer, params, tape| layer.forward(params, input, mask, tape, ctx))
    }

    /// Layer `i`'s [`Layer::forward_detached`]: its output outlives its input.
    pub(crate) fn forward_detached<'a>(
        &mut self,
        i: usize,
        input: Activations<'_>,
        mask: Option<ArrayView2<'a, f32>>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        self.with_layer(i, |layer, params, tape| {
            layer.forward_detached(params, input, mask, tape, ctx).unwrap_or_else(|| {
                Err(Error::InvalidInput(format!(
                    "layer '{}' says it detaches its output from its input but offers no `forward_detached`",
                    layer.name()
                )))
            })
        })
    }

    /// Layer `i`'s backward pass: its parameters' gradients into their buffer, and the
    /// gradient of its input into `grad_input` when given.
    pub(crate) fn backward(
        &mut self,
        i: usize,
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let layer = &self.layers[i];
        let (Some(grads), Some(tapes)) = (self.grads.as_deref_mut(), self.tapes.as_deref_mut()) else {
            return Err(Error::InvalidInput(format!(
                "layer '{}' is run for inference only here: it has no backward pass",
                layer.name()
            )));
        };
        let region = self.params.layout.regions[i].clone();
        let grads = own_grads(layer.as_ref(), &mut grads[region.clone()]);
        layer.backward(&self.values[region], grads, pass, grad_input, &mut tapes[i], ctx)
    }

    /// [`StepLayers::backward`] writing the gradient of layer `i`'s input into
    /// `grad_input` ([`Layer::backward_uninit`]), given back initialised.
    pub(crate) fn backward_uninit<'g>(
        &mut self,
        i: usize,
        pass: Pass<'_>,
        grad_input: UninitGradInput<'g>,
        ctx: &BackwardCtx<'_>,
    ) -> Result<GradInput<'g>> {
        let layer = &self.layers[i];
        let (Some(grads), Some(tapes)) = (self.grads.as_deref_mut(), self.tapes.as_deref_mut()) else {
            return Err(Error::InvalidInput(format!(
                "layer '{}' is run for inference only here: it has no backward pass",
                layer.name()
            )));
        };
        let region = self.params.layout.regions[i].clone();
        let grads = own_grads(layer.as_ref(), &mut grads[region.clone()]);
        let mask = pass.mask;
        let written = layer.backward_uninit(&self.values[region], grads, pass, grad_input, &mut tapes[i], ctx)?;
        Ok(padding_zeroed(layer.as_ref(), written, mask))
    }

    /// Checks the gradients of layer `i`'s parameters that its last backward pass left:
    /// [`Error::NonFinite`] naming the first value that is not finite.
    pub(crate) fn check_param_gradients(&mut self, i: usize) -> Result<()> {
        let Some(grads) = self.grads.as_deref() else { return Ok(()) };
        match finite::first_in_slice(&grads[self.params.layout.regions[i].clone()]) {
            None => Ok(()),
            Some((element, value)) => {
                let (param, element) = self.params.param_of(i, element);
                Err(finite::error(
                    self.layers[i].name(),
                    format!("the gradient of its parameter {param} (element {element}) is {value}"),
                ))
            }
        }
    }
}

/// `grads`, a layer's gradients, as its backward pass gets them: zeroed for a layer of
/// the user's own (see [`Layer::backward_rows`]); carve's own write every element.
fn own_grads<'g>(layer: &dyn Layer, grads: &'g mut [f32]) -> &'g mut [f32] {
    // (A dry run changes no value: it computes nothing.)
    if !grads.is_empty() && !crate::nn::kernels::running() && !crate::nn::layer::built_in(layer) {
        grads.fill(0.0);
    }
    grads
}

/// The gradient of a layer's input as the layer below gets it: 0 at padded steps
/// (mask 0), as [`Layer::backward`] asks, for a layer of the user's own whose backward
/// pass wrote something there (a term that does not come from the gradient of its
/// output); carve's own write 0 there. Padded steps change no gradient below: a dense
/// layer's weights would otherwise sum the padding's rows.
fn padding_zeroed<'g>(layer: &dyn Layer, written: GradInput<'g>, mask: Option<ArrayView2<'_, f32>>) -> GradInput<'g> {
    match (written, mask) {
        (GradInput::Sequence(mut g), Some(mask))
            if !crate::nn::kernels::running()
                && !crate::nn::layer::built_in(layer)
                && mask.dim() == (g.dim().0, g.dim().1) =>
        {
            for ((b, t), _) in mask.indexed_iter().filter(|&(_, &m)| m == 0.0) {
                g.slice_mut(ndarray::s![b, t, ..]).fill(0.0);
            }
            GradInput::Sequence(g)
        }
        (written, _) => written,
    }
}

/// What a step runs in besides its layers and its batch.
pub(crate) struct Run<'r> {
    /// The training workspaces (the second manager's gradient workspace alternates
    /// with the first's).
    pub(crate) train: &'r [LayerWorkspaceMgr; 2],
    /// The labels of a timeline recording the network, if one does.
    pub(crate) labels: Option<&'r LayerLabels>,
    /// The labels the whole batch counts: the loss's gradient is scaled by its inverse.
    pub(crate) count: usize,
}

/// One step's passes over `x` (checked against the network by the caller): the batch's
/// finite check, forward, the loss, backward through every layer into its gradient
/// buffers, each layer's output and gradients checked. Returns the sum of the counted
/// rows' losses (0 in a dry run); `at` follows the layer being run (the number of
/// layers outside them: the input and the loss), for the caller's error reports.
///
/// Every array of the step is in `run.train`'s workspaces, closed when this returns,
/// so the caller's update can use their bytes.
pub(crate) fn passes(
    layers: &mut StepLayers<'_>,
    x: Input<'_>,
    labels: Labels<'_>,
    run: &Run<'_>,
    at: &mut usize,
) -> Result<f64> {
    let depth = layers.count();
    *at = depth;
    let x = x.reborrow();
    // Labels per step without a mask of their own are masked like the features.
    let labels = labels.reborrow().or_mask(x.mask());
    let mask = x.mask();
    let (train, tl) = (run.train, run.labels);
    // A NaN would not surface by itself: ReLU maps it to 0, softmax's maximum skips
    // it, the loss clamps it, and the parameters would silently become NaN. Padded
    // steps are not checked: nothing uses them (they are zeroed below). The scan costs
    // what the batch's memory holds: a broadcast value is looked at once, so a batch too
    // large to lay out fails at its first allocation, not hours later.
    finite::check_activations("input", "the batch", x.activations(), mask)?;
    let mgr = &train[0];
    let act = mgr.enter(ArrayType::Activations)?;
    // Sequences (and labels per step) in another layout, or with padding, are copied
    // once, here.
    label(tl, |l| Some(l.input));
    let (x, labels) = {
        let _span = profile::span(Part::Copies);
        (training_input(x, &act)?, standard_labels(labels, &act)?)
    };
    // The list of activations lives in the activations workspace too.
    let mut outputs = ArenaVec::with_capacity_in(depth, &*act);
    let input = forward(layers, mgr, &act, x.activations(), mask, (true, tl), at, |layer, y| {
        if let Some(y) = y {
            finite::check_activations(layer, "its output", y, mask)?;
        }
        outputs.push(y);
        Ok(())
    })?;
    *at = depth;
    let logits = loss_input(input, &labels)?;
    let (flat_labels, label_mask) = labels.flat()?;
    // Backward, from the loss down: the gradient of each layer's output is in one of
    // the two gradient workspaces, and the layer writes the gradient of its input into
    // the other (see `Gradient`). The loss and its gradient come from one pass over the
    // logits.
    label(tl, |l| Some(l.loss));
    let mut grad = Gradient::zeros(mgr, input)?;
    let loss_sum = {
        let _span = profile::span(Part::Loss);
        let scale = 1.0 / run.count as f32;
        SoftmaxCrossEntropy.loss_sum_and_gradient(logits, flat_labels, label_mask, scale, grad.view_mut_rows()?)?
    };
    if !loss_sum.is_finite() {
        return Err(finite::error("loss", format!("the summed softmax cross-entropy is {loss_sum}")));
    }
    // The gradients of the residual joins passed, waiting for their blocks' inputs.
    let mut skips: Stack<(usize, Skip)> = Stack::new();
    let back = Back { run, mgr, act: &act, mask, depth };
    let mut i = depth;
    while i > 0 {
        i -= 1;
        *at = i;
        label(tl, |l| l.layers.get(i).copied());
        if let Some(from) = join_of(layers.layers, i) {
            // A join: its gradient flows to the block's last layer as it is, and to the
            // block's input once the block is through.
            skips.push((from, Skip::of(&grad, &act)?))?;
            continue;
        }
        let output = outputs[i].ok_or_else(|| let_go_misread(layers, i))?;
        let kept_input = if i == 0 { Some(x.activations()) } else { outputs[i - 1] };
        if let Some(input) = kept_input {
            match back.layer(layers, i, input, output, &grad, &mut skips)? {
                Some(below) => grad = below,
                None => break,
            }
            continue;
        }
        // Layer `r`'s output was let go once this layer had read it (see `let_go`):
        // computed again, from the input kept for it, for this layer's backward pass and
        // then its own, and let go again.
        let r = i - 1;
        let r_input = match r {
            0 => x.activations(),
            _ => outputs[r - 1].ok_or_else(|| let_go_misread(layers, r))?,
        };
        let held = mgr.enter(ArrayType::FfWorkingMem)?;
        let rebuilt = {
            *at = r;
            label(tl, |l| l.layers.get(r).copied());
            let working = mgr.enter(ArrayType::FfWorkingMem)?;
            let ctx = ForwardCtx { activations: &held, working: &working, mgr, training: true };
            let _span = profile::span(Part::Elementwise);
            // Views are invariant in their lifetime: reborrowed for the held scope's.
            layers.forward(r, rebind(&r_input), mask.as_ref().map(|m| m.view()), &ctx)?
        };
        *at = i;
        label(tl, |l| l.layers.get(i).copied());
        grad = back.layer(layers, i, rebuilt, output, &grad, &mut skips)?.ok_or_else(|| let_go_misread(layers, i))?;
        i = r;
        *at = r;
        label(tl, |l| l.layers.get(r).copied());
        match back.layer(layers, r, r_input, rebuilt, &grad, &mut skips)? {
            Some(below) => grad = below,
            None => break,
        }
    }
    *at = depth;
    Ok(loss_sum)
}

/// What the backward pass of one layer runs in.
struct Back<'b, 's> {
    run: &'b Run<'b>,
    mgr: &'b LayerWorkspaceMgr,
    act: &'b TypedScope,
    mask: Option<ArrayView2<'s, f32>>,
    depth: usize,
}

impl Back<'_, '_> {
    /// Layer `i`'s own backward pass, in working memory of its own: its parameters'
    /// gradients and, when given, the gradient of its input written into `grad_input`
    /// and given back.
    fn layer_pass<'g>(
        &self,
        layers: &mut StepLayers<'_>,
        i: usize,
        pass: Pass<'_>,
        grad_input: Option<UninitGradInput<'g>>,
    ) -> Result<Option<GradInput<'g>>> {
        let working = self.mgr.enter(ArrayType::BpWorkingMem)?;
        let ctx = BackwardCtx { working: &working, mgr: self.mgr };
        // The layer's own work; its matrix products are charged to MatMul.
        let _span = profile::span(Part::Elementwise);
        match grad_input {
            Some(g) => layers.backward_uninit(i, pass, g, &ctx).map(Some),
            None => layers.backward(i, pass, None, &ctx).map(|()| None),
        }
    }

    /// Layer `i`'s backward pass from the gradient of its output `grad`: its parameters'
    /// gradients, the gradient of its input (returned; `None` for the first layer, whose
    /// input's gradient is not needed) with the residual joins' gradients waiting for
    /// this input added, and the finite checks of both.
    fn layer(
        &self,
        layers: &mut StepLayers<'_>,
        i: usize,
        input: Activations<'_>,
        output: Activations<'_>,
        grad: &Gradient,
        skips: &mut Stack<(usize, Skip)>,
    ) -> Result<Option<Gradient>> {
        let pass = Pass { input: rebind(&input), mask: self.mask, output: rebind(&output), grad_output: grad.view()? };
        // The gradient of the first layer's input is not needed; the others' the layer
        // writes (`Layer::backward_uninit`).
        let mut below = match i {
            0 => {
                self.layer_pass(layers, i, pass, None)?;
                None
            }
            _ => {
                let all = layers.layers;
                let mgr = &self.run.train[(self.depth - i) % 2];
                Some(Gradient::written_by(mgr, input, all[i].name(), |g| {
                    self.layer_pass(layers, i, pass, Some(g))?.ok_or_else(|| {
                        Error::InvalidInput(format!("layer '{}': no gradient of its input came back", all[i].name()))
                    })
                })?)
            }
        };
        while skips.last().is_some_and(|(from, _)| *from == i) {
            let (_, skip) = skips.pop().expect("just looked at");
            if let Some(below) = below.as_mut() {
                skip.add_to(below, self.act)?;
            }
        }
        {
            let _span = profile::span(Part::Checks);
            if let Some(below) = below.as_ref() {
                finite::check_activations(layers.name(i), "the gradient of its input", below.view()?, self.mask)?;
            }
            layers.check_param_gradients(i)?;
        }
        Ok(below)
    }
}

/// Whether a training step lets layer `i`'s output go once layer `i + 1` has read it,
/// to compute it again in the backward pass (see [`Layer::rebuilt_in_backward`]): the
/// layer allows it, the next one reads its input into an output of its own
/// ([`Layer::detaches`]), and nothing else reads it (it is not the last layer's, and
/// neither a residual join nor a block's input).
pub(crate) fn let_go(layers: &[Box<dyn Layer>], i: usize) -> bool {
    i + 1 < layers.len()
        && layers[i].rebuilt_in_backward()
        && layers[i + 1].detaches()
        && join_of(layers, i).is_none()
        && join_of(layers, i + 1).is_none()
        && blocks_starting_at(layers, i + 1) == 0
}

/// Whether the forward pass lets layer `i`'s output go: [`let_go`] where the pass pairs
/// layers, from the first, a let-go layer with the one after it (which is then kept).
pub(crate) fn let_go_at(layers: &[Box<dyn Layer>], i: usize) -> bool {
    let mut j = 0;
    while j <= i {
        if let_go(layers, j) {
            if j == i {
                return true;
            }
            j += 2;
        } else {
            j += 1;
        }
    }
    false
}

/// An output the backward pass expected kept and found let go: the forward pass's and
/// the backward pass's reading of [`let_go`] disagree, which would be a bug here.
#[cold]
fn let_go_misread(layers: &StepLayers<'_>, i: usize) -> Error {
    Error::InvalidInput(format!(
        "layer '{}': its output was not kept for the backward pass, and not computed again",
        layers.name(i)
    ))
}

/// The layers' forward pass from `input` (the batch, in `act` and in standard layout):
/// each layer's output checked to be in the activations workspace and handed to `each`
/// with the layer's name; returns the last layer's output. Training and inference run
/// this one loop (`training`), each layer's allocations labelled with its label in
/// `labels` while a timeline records the network; `at` follows the layer being run.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<'s>(
    layers: &mut StepLayers<'_>,
    mgr: &LayerWorkspaceMgr,
    act: &'s TypedScope,
    mut input: Activations<'s>,
    mask: Option<ArrayView2<'s, f32>>,
    (training, labels): (bool, Option<&LayerLabels>),
    at: &mut usize,
    mut each: impl FnMut(&str, Option<Activations<'s>>) -> Result<()>,
) -> Result<Activations<'s>> {
    // The inputs of the residual blocks under way (see `nn::residual`).
    let mut blocks: Stack<Activations<'s>> = Stack::new();
    let batch = batch_of(input);
    let mut i = 0;
    while i < layers.count() {
        *at = i;
        label(labels, |l| l.layers.get(i).copied());
        // The network's counts, when its parameters' layout is these layers' (it always
        // is but for a placeholder layout, which counts nothing).
        let starts = match &layers.params.block_starts {
            counted if counted.len() == layers.count() => counted[i],
            _ => blocks_starting_at(layers.layers, i),
        };
        for _ in 0..starts {
            blocks.push(input)?;
        }
        if training && let_go(layers.layers, i) {
            // Layer `i`'s output lives only until layer `i + 1` has read it: the
            // backward pass computes it again (see `passes`).
            let held = mgr.enter(ArrayType::FfWorkingMem)?;
            let y = {
                let working = mgr.enter(ArrayType::FfWorkingMem)?;
                let ctx = ForwardCtx { activations: &held, working: &working, mgr, training };
                let _span = profile::span(Part::Elementwise);
                // Views are invariant in their lifetime: reborrowed for the held scope's.
                layers.forward(i, rebind(&input), mask.as_ref().map(|m| m.view()), &ctx)?
            };
            check_output(mgr, &held, layers, i, batch, y)?;
            finite::check_activations(layers.name(i), "its output", y, mask)?;
            each(layers.name(i), None)?;
            i += 1;
            *at = i;
            label(labels, |l| l.layers.get(i).copied());
            let out = {
                let working = mgr.enter(ArrayType::FfWorkingMem)?;
                let ctx = ForwardCtx { activations: act, working: &working, mgr, training };
                let _span = profile::span(Part::Elementwise);
                layers.forward_detached(i, y, mask, &ctx)?
            };
            check_output(mgr, act, layers, i, batch, out)?;
            each(layers.name(i), Some(out))?;
            input = out;
            i += 1;
            continue;
        }
        let y = match join_of(layers.layers, i) {
            Some(_) => {
                let block_input = blocks.pop().ok_or_else(|| {
                    Error::InvalidInput(format!("residual join '{}' has no block to close", layers.name(i)))
                })?;
                let _span = profile::span(Part::Elementwise);
                join(act, layers.name(i), input, block_input)?
            }
            None => {
                let working = mgr.enter(ArrayType::FfWorkingMem)?;
                let ctx = ForwardCtx { activations: act, working: &working, mgr, training };
                // The layer's own work; its matrix products are charged to MatMul.
                let _span = profile::span(Part::Elementwise);
                layers.forward(i, input, mask, &ctx)?
            }
        };
        check_output(mgr, act, layers, i, batch, y)?;
        each(layers.name(i), Some(y))?;
        input = y;
        i += 1;
    }
    Ok(input)
}

/// Layer `i`'s output `y`, made in `scope` (its `ctx.activations`), checked: where it
/// lives ([`LayerWorkspaceMgr::validate`] for `scope`'s role: its workspace, or with
/// workspaces off its heap workspace) and its shape ([`check_shape`]).
fn check_output(
    mgr: &LayerWorkspaceMgr,
    scope: &TypedScope,
    layers: &StepLayers<'_>,
    i: usize,
    batch: usize,
    y: Activations<'_>,
) -> Result<()> {
    let (name, ty) = (layers.name(i), scope.array_type());
    match y {
        Activations::Flat(v) => mgr.validate(ty, name, &v)?,
        Activations::Sequence(v) => mgr.validate(ty, name, &v)?,
    }
    check_shape(layers, i, batch, y)
}

/// The examples (or streams) of a batch: its first axis, which every layer keeps.
fn batch_of(x: Activations<'_>) -> usize {
    match x {
        Activations::Flat(v) => v.nrows(),
        Activations::Sequence(v) => v.dim().0,
    }
}

/// Whether layer `i`'s output `y` is of the shape its [`Layer::output_size`] declared:
/// the batch's `batch` examples, of the width the network laid out after it. Checked
/// here, so that a layer that gives another shape is named itself, not the layer after
/// it (or, last, the caller's buffer).
fn check_shape(layers: &StepLayers<'_>, i: usize, batch: usize, y: Activations<'_>) -> Result<()> {
    let params = &layers.params;
    // A placeholder layout lays out nothing to check against.
    if params.widths.len() != layers.count() {
        return Ok(());
    }
    let declared = params.widths.get(i + 1).copied().unwrap_or(params.outputs);
    let (rows, width) = match y {
        Activations::Flat(v) => v.dim(),
        Activations::Sequence(v) => (v.dim().0, v.dim().2),
    };
    if rows == batch && width == declared {
        return Ok(());
    }
    // (Allocated only for the error: a step allocates nothing.)
    let shape = match y {
        Activations::Flat(v) => v.shape().to_vec(),
        Activations::Sequence(v) => v.shape().to_vec(),
    };
    let mut expected = shape.clone();
    expected[0] = batch;
    *expected.last_mut().expect("an array of two or three axes") = declared;
    Err(Error::ShapeMismatch {
        context: format!(
            "layer '{}' output ([batch, features] or [batch, time, features]: the batch's examples, and the width \
             its output_size declared)",
            layers.name(i)
        ),
        expected,
        actual: shape,
    })
}

/// A residual join's output: the block's output `a` plus its input `b`, in `act`.
fn join<'s>(act: &'s TypedScope, name: &str, a: Activations<'s>, b: Activations<'s>) -> Result<Activations<'s>> {
    match (a, b) {
        (Activations::Flat(a), Activations::Flat(b)) if a.dim() == b.dim() => {
            let y = act.uninit::<f32, _>(a.raw_dim())?;
            Ok(Activations::Flat(freeze(sum_new(a, b, y))))
        }
        (Activations::Sequence(a), Activations::Sequence(b)) if a.dim() == b.dim() => {
            let y = act.uninit::<f32, _>(a.raw_dim())?;
            Ok(Activations::Sequence(freeze(sum_new(a, b, y))))
        }
        (a, b) => Err(Error::ShapeMismatch {
            context: format!("residual join '{name}': the block's output must be shaped as its input"),
            expected: b.shape().to_vec(),
            actual: a.shape().to_vec(),
        }),
    }
}

/// A copy of a residual join's gradient, kept in the activations workspace until the
/// backward pass reaches the block's input.
enum Skip {
    Flat(Handle<f32, Ix2>),
    Sequence(Handle<f32, Ix3>),
}

impl Skip {
    /// A copy of `grad` in `act`.
    fn of(grad: &Gradient, act: &TypedScope) -> Result<Skip> {
        let _span = profile::span(Part::Copies);
        Ok(match grad.view()? {
            Activations::Flat(g) => Skip::Flat(act.handle_with(g.raw_dim(), |y| copy_new(g, y))?),
            Activations::Sequence(g) => Skip::Sequence(act.handle_with(g.raw_dim(), |y| copy_new(g, y))?),
        })
    }

    /// Adds the kept gradient into `below`, the gradient of the block's input.
    fn add_to(&self, below: &mut Gradient, act: &TypedScope) -> Result<()> {
        let _span = profile::span(Part::Elementwise);
        match (self, &mut below.array) {
            (Skip::Flat(h), GradientArray::Flat(b)) if h.shape() == b.shape() => {
                add_assign(b.view_mut(&below.scope)?, h.view(act)?)
            }
            (Skip::Sequence(h), GradientArray::Sequence(b)) if h.shape() == b.shape() => {
                add_assign(b.view_mut(&below.scope)?, h.view(act)?)
            }
            _ => {
                return Err(Error::InvalidInput("a residual block's input and output gradients differ in shape".into()))
            }
        }
        Ok(())
    }
}

/// `a` borrowed for as long as `a` is (the views of a [`Pass`] live as long as its
/// shortest).
fn rebind<'s>(a: &'s Activations<'_>) -> Activations<'s> {
    match a {
        Activations::Flat(v) => Activations::Flat(v.view()),
        Activations::Sequence(v) => Activations::Sequence(v.view()),
    }
}

/// Whether `view` is the array of `dim` elements at `ptr`, in standard layout.
fn same<D: ndarray::Dimension>(view: &ndarray::ArrayViewMut<'_, f32, D>, ptr: *const f32, dim: &D) -> bool {
    std::ptr::eq(view.as_ptr(), ptr) && view.raw_dim() == *dim && view.is_standard_layout()
}

/// The gradient flowing down the network in the backward pass: an array in one of the
/// two gradient workspaces, with the scope that keeps that workspace open.
///
/// It is a [`Handle`] and not a view because it moves from one loop iteration to the
/// next together with its scope, and a view cannot move with the scope it borrows.
/// Each access through the handle checks the generation, and the views it gives borrow
/// the scope, so nothing outlives the workspace's cycle.
pub(crate) struct Gradient {
    scope: TypedScope,
    array: GradientArray,
}

/// A gradient of the kind of the array it is the gradient of.
enum GradientArray {
    Flat(Handle<f32, Ix2>),
    Sequence(Handle<f32, Ix3>),
}

impl Gradient {
    /// An array of `like`'s shape in `mgr`'s gradient workspace that `write` fills: it
    /// gets the array uninitialised and gives the same elements back initialised, in
    /// the same shape and layout (anything else is an error naming `layer`).
    fn written_by(
        mgr: &LayerWorkspaceMgr,
        like: Activations<'_>,
        layer: &str,
        write: impl for<'g> FnOnce(UninitGradInput<'g>) -> Result<GradInput<'g>>,
    ) -> Result<Gradient> {
        let scope = mgr.enter(ArrayType::ActivationGrad)?;
        let other = || {
            Error::InvalidInput(format!(
                "layer '{layer}': its backward pass gave back another array than the gradient of its input it was \
                 handed (`Layer::backward_uninit` gives back the same elements, initialised)"
            ))
        };
        let array = match like {
            Activations::Flat(x) => GradientArray::Flat(scope.try_handle_with(x.raw_dim(), |g| {
                let (ptr, dim) = (g.as_ptr().cast::<f32>(), g.raw_dim());
                match write(UninitGradInput::Flat(g))? {
                    GradInput::Flat(done) if same(&done, ptr, &dim) => Ok(done),
                    _ => Err(other()),
                }
            })?),
            Activations::Sequence(x) => GradientArray::Sequence(scope.try_handle_with(x.raw_dim(), |g| {
                let (ptr, dim) = (g.as_ptr().cast::<f32>(), g.raw_dim());
                match write(UninitGradInput::Sequence(g))? {
                    GradInput::Sequence(done) if same(&done, ptr, &dim) => Ok(done),
                    _ => Err(other()),
                }
            })?),
        };
        Ok(Gradient { scope, array })
    }

    /// Zeros of `like`'s shape in `mgr`'s gradient workspace.
    pub(crate) fn zeros(mgr: &LayerWorkspaceMgr, like: Activations<'_>) -> Result<Gradient> {
        let _span = profile::span(Part::Copies);
        let scope = mgr.enter(ArrayType::ActivationGrad)?;
        let array = match like {
            Activations::Flat(x) => GradientArray::Flat(scope.handle_with(x.raw_dim(), zeros_new)?),
            Activations::Sequence(x) => GradientArray::Sequence(scope.handle_with(x.raw_dim(), zeros_new)?),
        };
        Ok(Gradient { scope, array })
    }

    pub(crate) fn view(&self) -> Result<Activations<'_>> {
        Ok(match &self.array {
            GradientArray::Flat(h) => Activations::Flat(h.view(&self.scope)?),
            GradientArray::Sequence(h) => Activations::Sequence(h.view(&self.scope)?),
        })
    }

    /// The gradient as rows `[examples (· steps), features]`, as the loss sees them.
    pub(crate) fn view_mut_rows(&mut self) -> Result<ArrayViewMut2<'_, f32>> {
        match &mut self.array {
            GradientArray::Flat(h) => Ok(h.view_mut(&self.scope)?),
            GradientArray::Sequence(h) => {
                let (b, t, f) = (h.shape()[0], h.shape()[1], h.shape()[2]);
                let view = h.view_mut(&self.scope)?;
                Ok(view.into_shape_with_order((b * t, f)).expect("a new array is in standard layout"))
            }
        }
    }
}
