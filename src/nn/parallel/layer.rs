//! [`ParallelLayer`]: a layer as a data-parallel trainer runs it, its parameters read
//! from one shared copy by every worker and its gradients written into the worker's
//! gradient bucket.

use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2};

use crate::{Error, Result};

use super::super::dense;
use super::super::layer::{
    flat_grad_input, rows_of_grad, sequence_grad_input, steps_as_rows, steps_in, steps_out, Activations, BackwardCtx,
    ForwardCtx, GradInput, Layer, Pass, Tape,
};
use super::super::lstm::{Cache, Grads, Lstm, Weights};

/// A layer as a data-parallel trainer ([`DataParallel`](crate::nn::DataParallel)) runs
/// it: the layer's structure only, shared by every worker through `&self`. Its
/// parameters are not in it: the trainer holds every layer's parameters once, in one
/// flat buffer, and hands each call this layer's part (`params`, [`param_count`]
/// values in the order [`Layer::params`] gives them); the backward pass writes the
/// gradients of those values, in the same layout, into `grads`, the layer's part of the
/// worker's gradient bucket. What the backward pass needs from the forward pass beyond
/// its input and output goes in the worker's [`Tape`].
///
/// [`Layer::data_parallel`] makes one from a layer; the layers of [`crate::nn`] all do.
///
/// [`param_count`]: ParallelLayer::param_count
pub trait ParallelLayer: Send + Sync {
    /// A short name for messages.
    fn name(&self) -> &str;

    /// The number of parameters (the length of `params` and `grads`).
    fn param_count(&self) -> usize {
        0
    }

    /// A worker's tape for this layer, made once when the worker starts.
    fn tape(&self) -> Tape {
        Box::new(())
    }

    /// The training forward pass: the output, allocated in `ctx.activations`.
    ///
    /// # Errors
    ///
    /// Shape and workspace errors.
    fn forward<'a>(
        &self,
        params: &[f32],
        input: Activations<'a>,
        mask: Option<ArrayView2<'a, f32>>,
        tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>>;

    /// The backward pass: writes the gradient of every parameter into `grads` (every
    /// element, in `params`' layout) and, when given, the gradient of the input into
    /// `grad_input` (every element).
    ///
    /// # Errors
    ///
    /// Shape and workspace errors.
    fn backward(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        tape: &mut Tape,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()>;

    /// The layer again, with these parameters: what the trainer gives back
    /// ([`DataParallel::into_network`](crate::nn::DataParallel::into_network)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when the layer cannot be allocated.
    fn to_layer(&self, params: &[f32]) -> Result<Box<dyn Layer>>;
}

/// The tape of a worker, as the layer that made it expects it.
fn tape_of<'t, T: 'static>(tape: &'t mut Tape, layer: &str) -> Result<&'t mut T> {
    tape.downcast_mut::<T>().ok_or_else(|| {
        Error::InvalidInput(format!("layer '{layer}': a data-parallel worker's tape is not the one this layer made"))
    })
}

/// A layer without parameters, run data-parallel as itself: each worker's tape is a copy
/// of it (so that `&mut self` methods run per worker), and nothing is shared.
pub(crate) struct Replica<L>(pub(crate) L);

impl<L: Layer + Clone + Send + Sync + 'static> ParallelLayer for Replica<L> {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn tape(&self) -> Tape {
        Box::new(self.0.clone())
    }

    fn forward<'a>(
        &self,
        _params: &[f32],
        input: Activations<'a>,
        mask: Option<ArrayView2<'a, f32>>,
        tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        let layer = tape_of::<L>(tape, self.0.name())?;
        Ok(match input {
            Activations::Flat(x) => Activations::Flat(layer.forward(x, ctx)?),
            Activations::Sequence(x) => layer.forward_sequence(x, mask, ctx)?,
        })
    }

    fn backward(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        tape: &mut Tape,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let name = self.0.name();
        let layer = tape_of::<L>(tape, name)?;
        match pass.input {
            Activations::Flat(x) => {
                let grad_input = grad_input.map(|g| flat_grad_input(g, name)).transpose()?;
                layer.backward(x, pass.output.flat(name)?, pass.grad_output.flat(name)?, grad_input, ctx)
            }
            Activations::Sequence(x) => {
                let grad_input = grad_input.map(|g| sequence_grad_input(g, name)).transpose()?;
                layer.backward_sequence(x, pass.mask, pass.output, pass.grad_output, grad_input, ctx)
            }
        }
    }

    fn to_layer(&self, _params: &[f32]) -> Result<Box<dyn Layer>> {
        Ok(Box::new(self.0.clone()))
    }
}

/// Splits `params` (or `grads`) of a layer into its parameters' lengths.
fn check_len(layer: &str, what: &str, len: usize, expected: usize) -> Result<()> {
    if len != expected {
        return Err(Error::ShapeMismatch {
            context: format!("layer '{layer}' {what} (one per parameter value)"),
            expected: vec![expected],
            actual: vec![len],
        });
    }
    Ok(())
}

/// `layer` (new, of `params.len()` values) holding `params`, in [`Layer::params`]' order.
fn with_params(mut layer: impl Layer + 'static, params: &[f32]) -> Result<Box<dyn Layer>> {
    let mut offset = 0;
    layer.params(&mut |p| {
        p.value.copy_from_slice(&params[offset..offset + p.value.len()]);
        offset += p.value.len();
    });
    Ok(Box::new(layer))
}

/// A dense layer's structure: `[W (inputs × outputs, row-major), b (outputs)]`.
pub(crate) struct DenseShape {
    pub(crate) name: String,
    pub(crate) inputs: usize,
    pub(crate) outputs: usize,
}

impl DenseShape {
    fn weights<'p>(&self, params: &'p [f32]) -> Result<(ArrayView2<'p, f32>, ArrayView1<'p, f32>)> {
        check_len(&self.name, "parameters", params.len(), self.param_count())?;
        let (w, b) = params.split_at(self.inputs * self.outputs);
        let w = ArrayView2::from_shape((self.inputs, self.outputs), w).expect("inputs × outputs values");
        Ok((w, ArrayView1::from(b)))
    }
}

impl ParallelLayer for DenseShape {
    fn name(&self) -> &str {
        &self.name
    }

    fn param_count(&self) -> usize {
        self.inputs * self.outputs + self.outputs
    }

    fn forward<'a>(
        &self,
        params: &[f32],
        input: Activations<'a>,
        _mask: Option<ArrayView2<'a, f32>>,
        _tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        let (w, b) = self.weights(params)?;
        Ok(match input {
            Activations::Flat(x) => Activations::Flat(dense::forward(&self.name, w, b, x, ctx)?),
            Activations::Sequence(x) => {
                let (rows, dims) = steps_in(x, ctx, &self.name)?;
                steps_out(dense::forward(&self.name, w, b, rows, ctx)?, dims, ctx, &self.name)?
            }
        })
    }

    fn backward(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        _tape: &mut Tape,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let name = &self.name;
        let (w, _) = self.weights(params)?;
        check_len(name, "gradients", grads.len(), self.param_count())?;
        let (gw, gb) = grads.split_at_mut(self.inputs * self.outputs);
        let gw = ArrayViewMut2::from_shape((self.inputs, self.outputs), gw).expect("inputs × outputs values");
        let gb = ArrayViewMut1::from(gb);
        match pass.input {
            Activations::Flat(x) => {
                let grad_input = grad_input.map(|g| flat_grad_input(g, name)).transpose()?;
                dense::backward(name, w, x, pass.grad_output.flat(name)?, gw, gb, grad_input, ctx)
            }
            Activations::Sequence(x) => {
                let x = steps_as_rows(x, name)?;
                let grad_output = steps_as_rows(pass.grad_output.sequence(name)?, name)?;
                let grad_input =
                    grad_input.map(|g| sequence_grad_input(g, name).and_then(|g| rows_of_grad(g, name))).transpose()?;
                dense::backward(name, w, x, grad_output, gw, gb, grad_input, ctx)
            }
        }
    }

    fn to_layer(&self, params: &[f32]) -> Result<Box<dyn Layer>> {
        with_params(dense::Dense::try_named(&self.name, self.inputs, self.outputs)?, params)
    }
}

/// An LSTM's structure (a layer of no weights): `[W, U, b]` in its layout.
pub(crate) struct LstmShape(pub(crate) Lstm);

/// An LSTM worker's tape: the forward pass's gates and states, and its mask's
/// fingerprint.
struct LstmTape {
    cache: Cache,
    print: u64,
}

impl LstmShape {
    fn weights<'p>(&self, params: &'p [f32]) -> Result<Weights<'p>> {
        let (inputs, hidden) = (self.0.inputs(), self.0.hidden());
        check_len(self.0.name(), "parameters", params.len(), self.param_count())?;
        let columns = 4 * hidden;
        let (w, rest) = params.split_at(inputs * columns);
        let (u, b) = rest.split_at(hidden * columns);
        Ok(Weights {
            w: ArrayView2::from_shape((inputs, columns), w).expect("inputs × 4·hidden values"),
            u: ArrayView2::from_shape((hidden, columns), u).expect("hidden × 4·hidden values"),
            b: ArrayView1::from(b),
        })
    }
}

impl ParallelLayer for LstmShape {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn param_count(&self) -> usize {
        let (inputs, hidden) = (self.0.inputs(), self.0.hidden());
        (inputs + hidden + 1) * 4 * hidden
    }

    fn tape(&self) -> Tape {
        Box::new(LstmTape { cache: Cache::Empty, print: 0 })
    }

    fn forward<'a>(
        &self,
        params: &[f32],
        input: Activations<'a>,
        mask: Option<ArrayView2<'a, f32>>,
        tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        let tape = tape_of::<LstmTape>(tape, self.0.name())?;
        tape.cache = Cache::Empty;
        let input = input.sequence(self.0.name())?;
        let (out, cache, print) = self.0.train_forward(self.weights(params)?, input, mask, ctx)?;
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
        let name = self.0.name();
        let tape = tape_of::<LstmTape>(tape, name)?;
        let p = self.weights(params)?;
        check_len(name, "gradients", grads.len(), self.param_count())?;
        let (inputs, hidden) = (self.0.inputs(), self.0.hidden());
        let columns = 4 * hidden;
        let (gw, rest) = grads.split_at_mut(inputs * columns);
        let (gu, gb) = rest.split_at_mut(hidden * columns);
        let g = Grads {
            w: ArrayViewMut2::from_shape((inputs, columns), gw).expect("inputs × 4·hidden values"),
            u: ArrayViewMut2::from_shape((hidden, columns), gu).expect("hidden × 4·hidden values"),
            b: ArrayViewMut1::from(gb),
        };
        let input = pass.input.sequence(name)?;
        let grad_output = pass.grad_output.sequence(name)?;
        self.0.check_backward(&input, pass.mask.as_ref(), &grad_output)?;
        let grad_input = grad_input.map(|g| sequence_grad_input(g, name)).transpose()?;
        super::super::layer::check_grad_input(name, &input, &grad_input)?;
        self.0.with_cache(&tape.cache, tape.print, &input, pass.mask.as_ref(), ctx.mgr, |cached| {
            self.0.bptt(p, g, cached, input, pass.mask, grad_output, grad_input, ctx)
        })
    }

    fn to_layer(&self, params: &[f32]) -> Result<Box<dyn Layer>> {
        with_params(Lstm::named(self.0.name(), self.0.inputs(), self.0.hidden())?, params)
    }
}
