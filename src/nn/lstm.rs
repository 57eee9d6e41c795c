//! Long short-term memory over batches of sequences, trained by backpropagation
//! through time, with masks.

use ndarray::{s, ArrayView1, ArrayView2, ArrayView3, ArrayViewMut1, ArrayViewMut2, ArrayViewMut3, Axis, Ix3};
use workspace_core::{freeze, ArrayType, Handle};

use crate::{Error, Result};

use super::gemm::{scratch_len, sgemm};
use super::kept::fingerprint;
use super::kernels::{add_rows, fill, lstm_cell_backward, lstm_cell_forward};
use super::layer::{
    check_grad_input, check_len, check_mask, sequence_grad_input, tape_of, Activations, BackwardCtx, ForwardCtx,
    GradInput, Init, Layer, ParamShape, Pass, Tape,
};

/// Blocks of `4 · hidden` columns, in DL4J's layout (`LSTMHelpers`): 0 the cell input
/// (`tanh`), 1 the forget gate, 2 the output gate, 3 the input gate (DL4J's "input
/// modulation gate"), each `σ`.
const GATES: usize = 4;

/// Per step and sequence, the cache holds the gates (`4 · hidden`, after their
/// nonlinearities), the cell state and the hidden state after the step.
const CACHED: usize = GATES + 2;

/// A long short-term memory layer: `[batch, time, inputs]` → `[batch, time, hidden]`.
///
/// At step `t`, with `z = x_t · W + h_{t-1} · U + b` cut into four blocks in DL4J's
/// layout (`LSTMHelpers`: block 0 the cell input `a`, 1 the forget gate `f`, 2 the
/// output gate `o`, 3 the input gate `i`), so that weights carry over from DL4J:
/// `c_t = σ(f) ⊙ c_{t-1} + σ(i) ⊙ tanh(a)` and `h_t = σ(o) ⊙ tanh(c_t)`, from zero
/// states. The forget gate's biases start at 1 (the others at 0); `W` and `U` are
/// Glorot-uniform.
///
/// **Parameters**, in the layer's region of the network's flat buffer: `weight_ih_l0`
/// (`W`, `inputs × 4·hidden`), `weight_hh_l0` (`U`, `hidden × 4·hidden`) and `bias`
/// (`b`, `4·hidden`), in the gate layout above. (PyTorch's `nn.LSTM` names its weights
/// alike, transposed and in its own gate order, with two biases; model files convert.)
///
/// **Masks.** A masked step (mask 0) leaves the sequence's state as it was, outputs
/// zeros, and takes no gradient: a sequence padded with masked steps (of finite
/// values) gives the same states, loss and gradients as without them.
///
/// **Workspaces.** Each step of the forward pass is one cycle of the RNN forward loop
/// workspace ([`ArrayType::RnnFfLoopWorkingMem`]), and each step of the backward pass
/// one cycle of the RNN backward loop workspace ([`ArrayType::RnnBpLoopWorkingMem`]);
/// what backpropagation needs across steps (the gates and states of every step) is kept
/// in the activations workspace, through a checked [`Handle`], until the backward pass
/// (with workspaces switched off, [`WorkspaceMode::None`](workspace_core::WorkspaceMode),
/// in the activations' heap workspace: an array of its own on the heap, as every array
/// is then, read back the same way).
#[derive(Clone, Debug)]
pub struct Lstm {
    name: String,
    inputs: usize,
    hidden: usize,
}

/// What an LSTM's training forward pass leaves for its backward pass: every step's gates
/// and states, and its mask's fingerprint (masked rows of the cache hold no gate
/// activations, so the backward pass must get the same mask).
struct LstmTape {
    cache: Cache,
    print: u64,
}

/// Where the last training forward pass left what the backward pass reads.
#[derive(Debug)]
enum Cache {
    Empty,
    /// In the activations workspace, for as long as its cycle lasts.
    Workspace(Handle<f32, Ix3>),
}

impl Lstm {
    /// An LSTM from `inputs` features per step to `hidden` units (weights zero until
    /// initialised).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for 0 inputs or units, or weights that overflow the
    /// address space or cannot be allocated.
    pub fn new(inputs: usize, hidden: usize) -> Result<Lstm> {
        Lstm::named("lstm", inputs, hidden)
    }

    /// As [`Lstm::new`], with a name for messages.
    ///
    /// # Errors
    ///
    /// As [`Lstm::new`].
    pub fn named(name: &str, inputs: usize, hidden: usize) -> Result<Lstm> {
        let invalid = |why: &str| Error::InvalidConfig {
            reason: format!("LSTM layer '{name}' of {inputs} inputs and {hidden} units: {why}; check the layer widths"),
        };
        if inputs == 0 || hidden == 0 {
            return Err(invalid("it needs at least one input and one unit"));
        }
        let columns = hidden.checked_mul(GATES).ok_or_else(|| invalid("the gates overflow the address space"))?;
        let fits = |rows: usize| {
            rows.checked_mul(columns)
                .and_then(|n| n.checked_mul(size_of::<f32>()))
                .is_some_and(|bytes| bytes <= isize::MAX as usize)
        };
        if !fits(inputs) || !fits(hidden) {
            return Err(invalid("its weights overflow the address space"));
        }
        Ok(Lstm { name: name.to_string(), inputs, hidden })
    }

    /// The forward pass of inference (no cache: two steps' states in working memory),
    /// through `&self` (training's inference and serving's).
    fn infer_sequence<'a>(
        &self,
        p: Weights<'_>,
        input: ArrayView3<'a, f32>,
        mask: Option<ArrayView2<'a, f32>>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        self.check(&input, mask.as_ref())?;
        let (batch, steps, _) = input.dim();
        let mut out = ctx.activations.zeros::<f32, _>((batch, steps, self.hidden))?;
        let ring = ctx.working.zeros::<f32, _>((steps.min(2), batch, CACHED * self.hidden))?;
        self.run_forward(p, input, mask, ring, true, &mut out, ctx)?;
        Ok(Activations::Sequence(freeze(out)))
    }

    /// Checks a backward pass's input, mask and output gradient.
    fn check_backward(
        &self,
        input: &ArrayView3<'_, f32>,
        mask: Option<&ArrayView2<'_, f32>>,
        grad_output: &ArrayView3<'_, f32>,
    ) -> Result<()> {
        self.check(input, mask)?;
        let (batch, steps, _) = input.dim();
        if grad_output.dim() != (batch, steps, self.hidden) {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' output gradient", self.name),
                expected: vec![batch, steps, self.hidden],
                actual: grad_output.shape().to_vec(),
            });
        }
        Ok(())
    }

    /// Input features per step.
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// Units (the output features per step).
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    fn check(&self, input: &ArrayView3<'_, f32>, mask: Option<&ArrayView2<'_, f32>>) -> Result<()> {
        let (batch, steps, features) = input.dim();
        if features != self.inputs {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' input [batch, time, features]", self.name),
                expected: vec![batch, steps, self.inputs],
                actual: input.shape().to_vec(),
            });
        }
        check_mask(&self.name, input, mask).map(|_| ())
    }

    /// Scratch elements of the matrix products of one step.
    fn step_scratch(&self, batch: usize) -> usize {
        step_scratch(self.inputs, self.hidden, batch)
    }

    /// The parameters as the passes read them, from the layer's region of the flat
    /// buffer.
    fn weights<'p>(&self, params: &'p [f32]) -> Result<Weights<'p>> {
        let (inputs, hidden) = (self.inputs, self.hidden);
        check_len(&self.name, "parameters", params.len(), self.param_count())?;
        let columns = GATES * hidden;
        let (w, rest) = params.split_at(inputs * columns);
        let (u, b) = rest.split_at(hidden * columns);
        Ok(Weights {
            w: ArrayView2::from_shape((inputs, columns), w).expect("inputs × 4·hidden values"),
            u: ArrayView2::from_shape((hidden, columns), u).expect("hidden × 4·hidden values"),
            b: ArrayView1::from(b),
        })
    }

    /// Where the backward pass writes the gradients of [`Lstm::weights`].
    fn grads<'g>(&self, grads: &'g mut [f32]) -> Result<Grads<'g>> {
        let (inputs, hidden) = (self.inputs, self.hidden);
        check_len(&self.name, "gradients", grads.len(), self.param_count())?;
        let columns = GATES * hidden;
        let (gw, rest) = grads.split_at_mut(inputs * columns);
        let (gu, gb) = rest.split_at_mut(hidden * columns);
        Ok(Grads {
            w: ArrayViewMut2::from_shape((inputs, columns), gw).expect("inputs × 4·hidden values"),
            u: ArrayViewMut2::from_shape((hidden, columns), gu).expect("hidden × 4·hidden values"),
            b: ArrayViewMut1::from(gb),
        })
    }

    /// The number of parameter values.
    fn param_count(&self) -> usize {
        (self.inputs + self.hidden + 1) * GATES * self.hidden
    }
}

/// The parameters of an LSTM as its passes read them.
#[derive(Clone, Copy)]
struct Weights<'p> {
    w: ArrayView2<'p, f32>,
    u: ArrayView2<'p, f32>,
    b: ndarray::ArrayView1<'p, f32>,
}

/// Where the backward pass writes the gradients of [`Weights`].
struct Grads<'g> {
    w: ArrayViewMut2<'g, f32>,
    u: ArrayViewMut2<'g, f32>,
    b: ndarray::ArrayViewMut1<'g, f32>,
}

/// Scratch elements of the matrix products of one step.
fn step_scratch(inputs: usize, hidden: usize, batch: usize) -> usize {
    let (h, g) = (hidden, GATES * hidden);
    // Forward: x·W and h·U. Backward: xᵀ·dz, hᵀ·dz, dz·Wᵀ, dz·Uᵀ.
    [
        scratch_len(batch, g, inputs),
        scratch_len(batch, g, h),
        scratch_len(inputs, g, batch),
        scratch_len(h, g, batch),
        scratch_len(batch, inputs, g),
        scratch_len(batch, h, g),
    ]
    .into_iter()
    .max()
    .unwrap_or(0)
}

impl Lstm {
    /// The forward pass into `out`, keeping every step's gates and states in `cache`
    /// (`[time, batch, 6·hidden]`), or, with `ring`, only the last two steps' (`[2, ...]`).
    #[allow(clippy::too_many_arguments)]
    fn run_forward(
        &self,
        p: Weights<'_>,
        input: ArrayView3<'_, f32>,
        mask: Option<ArrayView2<'_, f32>>,
        mut cache: ArrayViewMut3<'_, f32>,
        ring: bool,
        out: &mut ArrayViewMut3<'_, f32>,
        ctx: &ForwardCtx<'_, '_>,
    ) -> Result<()> {
        let (batch, steps, _) = input.dim();
        let h = self.hidden;
        let slot = |t: usize| if ring { t % 2 } else { t };
        let scratch_len = self.step_scratch(batch);
        let mut seen = false;
        for t in 0..steps {
            let (cur, prev) = (slot(t), seen.then(|| slot(t - 1)));
            if !step_active(mask, t) {
                // Every sequence is padding here: the states carry over, the outputs stay 0.
                carry(&mut cache, cur, prev, 2 * h);
                continue;
            }
            let step = ctx.mgr.enter(ArrayType::RnnFfLoopWorkingMem)?;
            let scratch = step.slice_uninit::<f32>(scratch_len)?;
            let (mut now, before) = split(&mut cache, cur, prev);
            let mut z = now.slice_mut(s![.., ..GATES * h]);
            for mut row in z.rows_mut() {
                row.assign(&p.b);
            }
            sgemm(1.0, input.index_axis(Axis(1), t), p.w, 1.0, z.view_mut(), scratch)?;
            if let Some(before) = &before {
                sgemm(1.0, before.slice(s![.., (CACHED - 1) * h..]), p.u, 1.0, z.view_mut(), scratch)?;
            }
            for r in 0..batch {
                let mut state = now.row_mut(r);
                let previous = before.as_ref().map(|b| b.row(r));
                if mask.is_some_and(|m| m[[r, t]] == 0.0) {
                    // Padding of this sequence: its state carries over.
                    let c = GATES * h;
                    match previous {
                        Some(p) => state.slice_mut(s![c..]).assign(&p.slice(s![c..])),
                        None => state.slice_mut(s![c..]).fill(0.0),
                    }
                    continue;
                }
                let state = state.as_slice_mut().expect("a cache row is contiguous");
                let previous = previous.map(|p| p.to_slice().expect("a cache row is contiguous"));
                lstm_cell_forward(h, state, previous, out.slice_mut(s![r, t, ..]));
            }
            seen = true;
            drop(step);
        }
        Ok(())
    }
}

/// Whether any sequence holds data at step `t`.
fn step_active(mask: Option<ArrayView2<'_, f32>>, t: usize) -> bool {
    mask.is_none_or(|m| m.column(t).iter().any(|&v| v != 0.0))
}

/// Copies the states (the last `width` columns) of slot `prev` into slot `cur`, or
/// zeros them when there is no previous step.
fn carry(cache: &mut ArrayViewMut3<'_, f32>, cur: usize, prev: Option<usize>, width: usize) {
    let from = cache.shape()[2] - width;
    match prev {
        Some(prev) if prev != cur => {
            let (mut now, before) = cache.multi_slice_mut((s![cur, .., from..], s![prev, .., from..]));
            now.assign(&before);
        }
        Some(_) => {}
        None => cache.slice_mut(s![cur, .., from..]).fill(0.0),
    }
}

/// Slot `cur` mutably and slot `prev` (if any) of the cache.
fn split<'c>(
    cache: &'c mut ArrayViewMut3<'_, f32>,
    cur: usize,
    prev: Option<usize>,
) -> (ArrayViewMut2<'c, f32>, Option<ArrayView2<'c, f32>>) {
    match prev {
        Some(prev) => {
            let (now, before) = cache.multi_slice_mut((s![cur, .., ..], s![prev, .., ..]));
            (now, Some(freeze(before)))
        }
        None => (cache.index_axis_mut(Axis(0), cur), None),
    }
}

impl Layer for Lstm {
    fn name(&self) -> &str {
        &self.name
    }

    fn output_size(&self, inputs: usize) -> Result<usize> {
        if inputs != self.inputs {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' takes {} features per step", self.name, self.inputs),
                expected: vec![self.inputs],
                actual: vec![inputs],
            });
        }
        Ok(self.hidden)
    }

    fn param_shapes(&self, _inputs: usize) -> Vec<ParamShape> {
        let columns = GATES * self.hidden;
        vec![
            ParamShape::new("weight_ih_l0", &[self.inputs, columns]),
            ParamShape::new("weight_hh_l0", &[self.hidden, columns]),
            ParamShape::new("bias", &[columns]),
        ]
    }

    fn init(&self, _inputs: usize, params: &mut [f32], init: &mut Init<'_>) {
        let h = self.hidden;
        let columns = GATES * h;
        let (w, rest) = params.split_at_mut(self.inputs * columns);
        let (u, b) = rest.split_at_mut(h * columns);
        init.glorot_uniform(self.inputs, h, w);
        init.glorot_uniform(h, h, u);
        b.fill(0.0);
        b[h..2 * h].fill(1.0);
    }

    fn tape(&self) -> Tape {
        Tape::new(LstmTape { cache: Cache::Empty, print: 0 })
    }

    fn forward<'a>(
        &self,
        params: &[f32],
        input: Activations<'a>,
        mask: Option<ArrayView2<'a, f32>>,
        tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        let input = match input {
            Activations::Sequence(x) => x,
            Activations::Flat(x) => {
                return Err(Error::ShapeMismatch {
                    context: format!(
                        "layer '{}' is recurrent and takes batches of sequences [batch, time, features]; feed the \
                         network 3-D batches (with their mask)",
                        self.name
                    ),
                    expected: vec![x.nrows(), 0, self.inputs],
                    actual: x.shape().to_vec(),
                })
            }
        };
        let p = self.weights(params)?;
        if !ctx.training {
            if let Some(tape) = tape.get_mut::<LstmTape>() {
                tape.cache = Cache::Empty;
            }
            return self.infer_sequence(p, input, mask, ctx);
        }
        let tape = tape_of::<LstmTape>(tape, &self.name)?;
        tape.cache = Cache::Empty;
        let (out, cache, print) = self.train_forward(p, input, mask, ctx)?;
        (tape.cache, tape.print) = (cache, print);
        Ok(out)
    }

    fn backward(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        tape: &mut Tape,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let name = &self.name;
        let tape = tape_of::<LstmTape>(tape, name)?;
        let p = self.weights(params)?;
        let g = self.grads(grads)?;
        let input = pass.input.sequence(name)?;
        let grad_output = pass.grad_output.sequence(name)?;
        self.check_backward(&input, pass.mask.as_ref(), &grad_output)?;
        let grad_input = grad_input.map(|g| sequence_grad_input(g, name)).transpose()?;
        check_grad_input(name, &input, &grad_input)?;
        self.with_cache(&tape.cache, tape.print, &input, pass.mask.as_ref(), ctx.mgr, |cached| {
            self.bptt(p, g, cached, input, pass.mask, grad_output, grad_input, ctx)
        })
    }
}

impl Lstm {
    /// Runs `f` on the view of a training forward pass's `cache` (`[time, batch,
    /// 6·hidden]`), checked to be of `input`'s batch and of `mask` (whose fingerprint
    /// the forward pass left in `mask_print`).
    fn with_cache<R>(
        &self,
        cache: &Cache,
        mask_print: u64,
        input: &ArrayView3<'_, f32>,
        mask: Option<&ArrayView2<'_, f32>>,
        mgr: &workspace_core::LayerWorkspaceMgr,
        f: impl FnOnce(ArrayView3<'_, f32>) -> Result<R>,
    ) -> Result<R> {
        let (batch, steps, _) = input.dim();
        let scope;
        let cache_view = match cache {
            Cache::Empty => {
                return Err(Error::InvalidInput(format!(
                    "layer '{}': a backward pass without a training forward pass before it",
                    self.name
                )))
            }
            Cache::Workspace(handle) => {
                scope = mgr.borrow_open(ArrayType::Activations)?;
                handle.view(&scope)?
            }
        };
        if cache_view.dim() != (steps, batch, CACHED * self.hidden) || mask_print != fingerprint(mask, batch, steps) {
            return Err(Error::InvalidInput(format!(
                "layer '{}': a backward pass on another batch or mask than its forward pass ({:?} cached)",
                self.name,
                cache_view.shape()
            )));
        }
        f(cache_view)
    }

    /// The training forward pass: its output, with every step's gates and states kept in
    /// the returned cache (and the mask's fingerprint) for [`Lstm::bptt`].
    fn train_forward<'a>(
        &self,
        p: Weights<'_>,
        input: ArrayView3<'a, f32>,
        mask: Option<ArrayView2<'a, f32>>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<(Activations<'a>, Cache, u64)> {
        self.check(&input, mask.as_ref())?;
        let (batch, steps, _) = input.dim();
        let print = fingerprint(mask.as_ref(), batch, steps);
        let width = CACHED * self.hidden;
        let mut out = ctx.activations.zeros::<f32, _>((batch, steps, self.hidden))?;
        let mut cache = ctx.activations.zeros_handle::<f32, _>((steps, batch, width))?;
        self.run_forward(p, input, mask, cache.view_mut(ctx.activations)?, false, &mut out, ctx)?;
        Ok((Activations::Sequence(freeze(out)), Cache::Workspace(cache), print))
    }

    /// Backpropagation through time over the forward pass's cache (`cache_view`), the
    /// gradients of `p` written into `g` (every element).
    #[allow(clippy::too_many_arguments)]
    fn bptt(
        &self,
        p: Weights<'_>,
        mut g: Grads<'_>,
        cache_view: ArrayView3<'_, f32>,
        input: ArrayView3<'_, f32>,
        mask: Option<ArrayView2<'_, f32>>,
        grad_output: ArrayView3<'_, f32>,
        mut grad_input: Option<ArrayViewMut3<'_, f32>>,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let (batch, steps, _) = input.dim();
        let h = self.hidden;
        fill(g.w.view_mut(), 0.0);
        fill(g.u.view_mut(), 0.0);
        fill(g.b.view_mut(), 0.0);
        if let Some(g) = grad_input.as_mut() {
            fill(g.view_mut(), 0.0);
        }
        // The gradients flowing back along the sequence: of h (first `h` columns) and of
        // c (the next `h`), per sequence.
        let mut carried = ctx.working.zeros::<f32, _>((batch, 2 * h))?;
        let scratch_len = self.step_scratch(batch);
        for t in (0..steps).rev() {
            if !step_active(mask, t) {
                // Padding of every sequence: nothing changed here, nothing flows back.
                continue;
            }
            let step = ctx.mgr.enter(ArrayType::RnnBpLoopWorkingMem)?;
            let scratch = step.slice_uninit::<f32>(scratch_len)?;
            let mut dz = step.zeros::<f32, _>((batch, GATES * h))?;
            let now = cache_view.index_axis(Axis(0), t);
            let before = (t > 0).then(|| cache_view.index_axis(Axis(0), t - 1));
            for r in 0..batch {
                if mask.is_some_and(|m| m[[r, t]] == 0.0) {
                    // This sequence's padding: its carried gradients pass through.
                    continue;
                }
                let state = now.row(r);
                let state = state.to_slice().expect("a cache row is contiguous");
                let mut carry_row = carried.row_mut(r);
                let carry_row = carry_row.as_slice_mut().expect("a row of a new array is contiguous");
                let mut dz_row = dz.row_mut(r);
                let dz_row = dz_row.as_slice_mut().expect("a row of a new array is contiguous");
                let c_prev = before.as_ref().map(|b| b.slice(s![r, GATES * h..(GATES + 1) * h]));
                lstm_cell_backward(h, state, c_prev, grad_output.slice(s![r, t, ..]), carry_row, dz_row);
            }
            let dz = dz.view();
            sgemm(1.0, input.index_axis(Axis(1), t).t(), dz, 1.0, g.w.view_mut(), scratch)?;
            add_rows(g.b.view_mut(), dz);
            if let Some(g) = grad_input.as_mut() {
                sgemm(1.0, dz, p.w.t(), 0.0, g.index_axis_mut(Axis(1), t), scratch)?;
            }
            if let Some(before) = &before {
                let h_before = before.slice(s![.., (CACHED - 1) * h..]);
                sgemm(1.0, h_before.t(), dz, 1.0, g.u.view_mut(), scratch)?;
                // The gradient of h_{t-1}: through z for the sequences that hold data here,
                // carried unchanged for those padded here.
                let mut dh_before = step.zeros::<f32, _>((batch, h))?;
                sgemm(1.0, dz, p.u.t(), 0.0, dh_before.view_mut(), scratch)?;
                for r in 0..batch {
                    if mask.is_none_or(|m| m[[r, t]] != 0.0) {
                        carried.slice_mut(s![r, ..h]).assign(&dh_before.row(r));
                    }
                }
            }
            drop(step);
        }
        Ok(())
    }
}
