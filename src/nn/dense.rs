//! Fully connected layer: `y = x · W + b`.

use crate::{Error, Result};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2};
use workspace_core::freeze;

use std::mem::MaybeUninit;

use super::gemm::{scratch_len, sgemm, sgemm_uninit};
use super::layer::{
    backward_rows_uninit, check_len, steps_in, steps_out, Activations, BackwardCtx, ForwardCtx, GradInput, Init, Layer,
    ParamShape, Pass, RowsPass, Tape, UninitGradInput,
};
use super::vector::{rows_new, sum_rows};

/// A dense layer from `inputs` to `outputs` columns: `inputs × outputs` weights
/// (PyTorch's `weight`, stored transposed: carve keeps them `inputs × outputs`, row-major)
/// and `outputs` biases (`bias`), initialised with Glorot (Xavier) uniform weights and
/// zero biases.
///
/// The matrix products take their packing buffers from the layer's working memory,
/// so with workspaces enabled a forward and backward pass allocate nothing.
#[derive(Clone, Debug)]
pub struct Dense {
    name: String,
    inputs: usize,
    outputs: usize,
}

impl Dense {
    /// A layer from `inputs` to `outputs` columns.
    ///
    /// # Panics
    ///
    /// When `inputs × outputs` weights overflow the address space (see
    /// [`Dense::try_new`], which returns an error instead).
    pub fn new(inputs: usize, outputs: usize) -> Dense {
        Dense::named("dense", inputs, outputs)
    }

    /// As [`Dense::new`], with a name for messages.
    ///
    /// # Panics
    ///
    /// As [`Dense::new`]; [`Dense::try_named`] returns an error instead.
    pub fn named(name: &str, inputs: usize, outputs: usize) -> Dense {
        Dense::try_named(name, inputs, outputs).unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`Dense::new`], with an error instead of a panic for sizes that cannot be
    /// laid out.
    ///
    /// ```
    /// use carve::nn::Dense;
    ///
    /// assert!(Dense::try_new(64, 128).is_ok());
    /// assert!(matches!(Dense::try_new(64, usize::MAX), Err(carve::Error::InvalidConfig { .. })));
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when `inputs × outputs` weights overflow the address
    /// space.
    pub fn try_new(inputs: usize, outputs: usize) -> Result<Dense> {
        Dense::try_named("dense", inputs, outputs)
    }

    /// As [`Dense::try_new`], with a name for messages.
    ///
    /// # Errors
    ///
    /// As [`Dense::try_new`].
    pub fn try_named(name: &str, inputs: usize, outputs: usize) -> Result<Dense> {
        let values = inputs
            .checked_mul(outputs)
            .and_then(|n| n.checked_add(outputs))
            .filter(|&n| n.checked_mul(size_of::<f32>()).is_some_and(|bytes| bytes <= isize::MAX as usize));
        if values.is_none() {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "dense layer '{name}' of {inputs} × {outputs} weights overflows the address space; \
                     check the layer widths"
                ),
            });
        }
        Ok(Dense { name: name.to_string(), inputs, outputs })
    }

    /// Input columns.
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// Output columns.
    pub fn outputs(&self) -> usize {
        self.outputs
    }

    /// The weights (`inputs × outputs`) and biases in this layer's region of the
    /// parameters.
    fn weights<'p>(&self, params: &'p [f32]) -> Result<(ArrayView2<'p, f32>, ArrayView1<'p, f32>)> {
        check_len(&self.name, "parameters", params.len(), self.inputs * self.outputs + self.outputs)?;
        let (w, b) = params.split_at(self.inputs * self.outputs);
        let w = ArrayView2::from_shape((self.inputs, self.outputs), w).expect("inputs × outputs values");
        Ok((w, ArrayView1::from(b)))
    }
}

/// Checks that `input` has a column per row of the weights `w` of layer `name`.
fn check_input(name: &str, w: ArrayView2<'_, f32>, input: &ArrayView2<'_, f32>) -> Result<()> {
    if input.ncols() != w.nrows() {
        return Err(Error::ShapeMismatch {
            context: format!("layer '{name}' input"),
            expected: vec![input.nrows(), w.nrows()],
            actual: input.shape().to_vec(),
        });
    }
    Ok(())
}

/// The forward pass of a dense layer of weights `w` and biases `b`.
fn forward<'a>(
    name: &str,
    w: ArrayView2<'_, f32>,
    b: ArrayView1<'_, f32>,
    input: ArrayView2<'_, f32>,
    ctx: &ForwardCtx<'a, '_>,
) -> Result<ArrayView2<'a, f32>> {
    check_input(name, w, &input)?;
    let (batch, inputs) = input.dim();
    let outputs = w.ncols();
    let mut out = rows_new(b, ctx.activations.uninit::<f32, _>((batch, outputs))?);
    let scratch = ctx.working.slice_uninit::<f32>(scratch_len(batch, outputs, inputs))?;
    sgemm(1.0, input, w, 1.0, out.view_mut(), scratch)?;
    Ok(freeze(out))
}

/// The parameters' gradients, `dW = xᵀ·dy` and `db = Σ_rows dy` (in row order), of
/// the checked shapes; gives back the scratch the input's gradient's product takes.
fn param_grads<'w>(
    name: &str,
    w: ArrayView2<'_, f32>,
    input: ArrayView2<'_, f32>,
    grad_output: ArrayView2<'_, f32>,
    mut gw: ArrayViewMut2<'_, f32>,
    gb: ArrayViewMut1<'_, f32>,
    ctx: &BackwardCtx<'w>,
) -> Result<&'w mut [MaybeUninit<f32>]> {
    check_input(name, w, &input)?;
    let (batch, inputs) = input.dim();
    let outputs = w.ncols();
    if grad_output.dim() != (batch, outputs) {
        return Err(Error::ShapeMismatch {
            context: format!("layer '{name}' output gradient"),
            expected: vec![batch, outputs],
            actual: grad_output.shape().to_vec(),
        });
    }
    let need = scratch_len(inputs, outputs, batch).max(scratch_len(batch, inputs, outputs));
    let scratch = ctx.working.slice_uninit::<f32>(need)?;
    // dW = xᵀ · dy
    sgemm(1.0, input.t(), grad_output, 0.0, gw.view_mut(), scratch)?;
    // db = Σ_rows dy, summed in row order (deterministic)
    sum_rows(gb, grad_output);
    Ok(scratch)
}

impl Layer for Dense {
    fn per_step(&self) -> bool {
        true
    }

    fn device_form(&self) -> Option<crate::nn::DeviceForm> {
        Some(crate::nn::DeviceForm::Dense { inputs: self.inputs, outputs: self.outputs })
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn output_size(&self, inputs: usize) -> Result<usize> {
        if inputs != self.inputs {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' takes {} inputs", self.name, self.inputs),
                expected: vec![self.inputs],
                actual: vec![inputs],
            });
        }
        Ok(self.outputs)
    }

    fn param_shapes(&self, _inputs: usize) -> Vec<ParamShape> {
        vec![ParamShape::new("weight", &[self.inputs, self.outputs]), ParamShape::new("bias", &[self.outputs])]
    }

    fn init(&self, _inputs: usize, params: &mut [f32], init: &mut Init<'_>) {
        let (w, b) = params.split_at_mut(self.inputs * self.outputs);
        init.glorot_uniform(self.inputs, self.outputs, w);
        b.fill(0.0);
    }

    fn forward_rows<'a>(
        &self,
        params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<ArrayView2<'a, f32>> {
        let (w, b) = self.weights(params)?;
        forward(&self.name, w, b, input, ctx)
    }

    fn detaches(&self) -> bool {
        true
    }

    fn forward_detached<'a>(
        &self,
        params: &[f32],
        input: Activations<'_>,
        _mask: Option<ArrayView2<'a, f32>>,
        _tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Option<Result<Activations<'a>>> {
        // What the default `forward` runs, the output in `ctx.activations` whatever the
        // input's lifetime.
        let run = || {
            let (w, b) = self.weights(params)?;
            match input {
                Activations::Flat(x) => Ok(Activations::Flat(forward(&self.name, w, b, x, ctx)?)),
                Activations::Sequence(x) => {
                    let (rows, dims) = steps_in(x, ctx, &self.name)?;
                    steps_out(forward(&self.name, w, b, rows, ctx)?, dims, ctx, &self.name)
                }
            }
        };
        Some(run())
    }

    fn backward_rows(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let (w, _) = self.weights(params)?;
        check_len(&self.name, "gradients", grads.len(), params.len())?;
        let (gw, gb) = grads.split_at_mut(self.inputs * self.outputs);
        let gw = ArrayViewMut2::from_shape((self.inputs, self.outputs), gw).expect("inputs × outputs values");
        let scratch = param_grads(&self.name, w, pass.input, pass.grad_output, gw, ArrayViewMut1::from(gb), ctx)?;
        // dx = dy · Wᵀ
        if let Some(grad_input) = grad_input {
            sgemm(1.0, pass.grad_output, w.t(), 0.0, grad_input, scratch)?;
        }
        Ok(())
    }

    fn backward_uninit<'g>(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: UninitGradInput<'g>,
        _tape: &mut Tape,
        ctx: &BackwardCtx<'_>,
    ) -> Result<GradInput<'g>> {
        // The product writes every element of the input's gradient: no zeros first.
        let (w, _) = self.weights(params)?;
        check_len(&self.name, "gradients", grads.len(), params.len())?;
        let (gw, gb) = grads.split_at_mut(self.inputs * self.outputs);
        let gw = ArrayViewMut2::from_shape((self.inputs, self.outputs), gw).expect("inputs × outputs values");
        backward_rows_uninit(&self.name, pass, grad_input, |rows, dx| {
            let scratch = param_grads(&self.name, w, rows.input, rows.grad_output, gw, ArrayViewMut1::from(gb), ctx)?;
            sgemm_uninit(1.0, rows.grad_output, w.t(), dx, scratch)
        })
    }
}
