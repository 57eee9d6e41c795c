//! Fully connected layer: `y = x · W + b`.

use crate::{Error, Result};
use ndarray::{Array1, Array2, ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2, Zip};
use workspace_core::freeze;

use super::gemm::{scratch_len, sgemm};
use super::layer::{BackwardCtx, ForwardCtx, Frozen, FrozenLayer, Layer, Param};
use super::limits::config_filled;
use super::parallel::{DenseShape, ParallelLayer};
use super::Rng;

/// A dense layer with `inputs × outputs` weights and `outputs` biases, initialised
/// with Glorot (Xavier) uniform weights and zero biases.
///
/// The matrix products take their packing buffers from the layer's working memory,
/// so with workspaces enabled a forward and backward pass allocate nothing.
#[derive(Clone, Debug)]
pub struct Dense {
    name: String,
    weights: Array2<f32>,
    bias: Array1<f32>,
    grad_weights: Array2<f32>,
    grad_bias: Array1<f32>,
}

impl Dense {
    /// A layer from `inputs` to `outputs` columns (weights zero until initialised).
    ///
    /// # Panics
    ///
    /// When the weights cannot be allocated (see [`Dense::try_new`], which returns an
    /// error instead).
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
    /// allocated.
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
    /// space or cannot be allocated.
    pub fn try_new(inputs: usize, outputs: usize) -> Result<Dense> {
        Dense::try_named("dense", inputs, outputs)
    }

    /// As [`Dense::try_new`], with a name for messages.
    ///
    /// # Errors
    ///
    /// As [`Dense::try_new`].
    pub fn try_named(name: &str, inputs: usize, outputs: usize) -> Result<Dense> {
        let weights = inputs
            .checked_mul(outputs)
            .filter(|&n| n.checked_mul(size_of::<f32>()).is_some_and(|bytes| bytes <= isize::MAX as usize));
        let Some(weights) = weights else {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "dense layer '{name}' of {inputs} × {outputs} weights overflows the address space; \
                     check the layer widths"
                ),
            });
        };
        let zeros = |len: usize| {
            config_filled(len, 0.0, || {
                format!("dense layer '{name}' of {inputs} × {outputs} weights (check the layer widths)")
            })
        };
        let matrix = |values| Array2::from_shape_vec((inputs, outputs), values).expect("inputs × outputs values");
        Ok(Dense {
            name: name.to_string(),
            weights: matrix(zeros(weights)?),
            bias: Array1::from(zeros(outputs)?),
            grad_weights: matrix(zeros(weights)?),
            grad_bias: Array1::from(zeros(outputs)?),
        })
    }

    /// The weights, `inputs × outputs`.
    pub fn weights(&self) -> ArrayView2<'_, f32> {
        self.weights.view()
    }

    /// The weights, for tests and loading.
    pub fn weights_mut(&mut self) -> ArrayViewMut2<'_, f32> {
        self.weights.view_mut()
    }

    /// The biases.
    pub fn bias(&self) -> ArrayView1<'_, f32> {
        self.bias.view()
    }

    /// The gradient of the weights from the last backward pass.
    pub fn grad_weights(&self) -> ArrayView2<'_, f32> {
        self.grad_weights.view()
    }

    /// The gradient of the biases from the last backward pass.
    pub fn grad_bias(&self) -> ArrayView1<'_, f32> {
        self.grad_bias.view()
    }

    /// The forward pass, through `&self` (training's and serving's).
    fn infer<'a>(&self, input: ArrayView2<'a, f32>, ctx: &ForwardCtx<'a, '_>) -> Result<ArrayView2<'a, f32>> {
        forward(&self.name, self.weights.view(), self.bias.view(), input, ctx)
    }

    /// A layer of these weights (`inputs × outputs`) and biases, with no gradients:
    /// what serving and loading hold.
    pub(crate) fn from_parts(name: &str, weights: Array2<f32>, bias: Array1<f32>) -> Dense {
        Dense {
            name: name.to_string(),
            weights,
            bias,
            grad_weights: Array2::zeros((0, 0)),
            grad_bias: Array1::zeros(0),
        }
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

/// The forward pass of a dense layer of weights `w` and biases `b`: the layer's own, or
/// a data-parallel trainer's shared copy.
pub(crate) fn forward<'a>(
    name: &str,
    w: ArrayView2<'_, f32>,
    b: ArrayView1<'_, f32>,
    input: ArrayView2<'a, f32>,
    ctx: &ForwardCtx<'a, '_>,
) -> Result<ArrayView2<'a, f32>> {
    check_input(name, w, &input)?;
    let (batch, inputs) = input.dim();
    let outputs = w.ncols();
    let mut out = ctx.activations.rows_of(&b, batch)?;
    let scratch = ctx.working.slice_uninit::<f32>(scratch_len(batch, outputs, inputs))?;
    // A dry run (shape-only workspaces) allocates and computes nothing.
    if !ctx.working.is_shape_only() {
        sgemm(1.0, input, w, 1.0, out.view_mut(), scratch)?;
    }
    Ok(freeze(out))
}

/// The backward pass of a dense layer of weights `w`: the gradients of the weights and
/// biases written into `gw` and `gb` (every element), and of the input into
/// `grad_input` when given.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    name: &str,
    w: ArrayView2<'_, f32>,
    input: ArrayView2<'_, f32>,
    grad_output: ArrayView2<'_, f32>,
    mut gw: ArrayViewMut2<'_, f32>,
    mut gb: ArrayViewMut1<'_, f32>,
    grad_input: Option<ArrayViewMut2<'_, f32>>,
    ctx: &BackwardCtx<'_>,
) -> Result<()> {
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
    if ctx.working.is_shape_only() {
        // A dry run: allocated, nothing computed.
        return Ok(());
    }
    // dW = xᵀ · dy
    sgemm(1.0, input.t(), grad_output, 0.0, gw.view_mut(), scratch)?;
    // db = Σ_rows dy, summed in row order (deterministic)
    gb.fill(0.0);
    for row in grad_output.rows() {
        Zip::from(&mut gb).and(&row).for_each(|acc, &g| *acc += g);
    }
    // dx = dy · Wᵀ
    if let Some(grad_input) = grad_input {
        sgemm(1.0, grad_output, w.t(), 0.0, grad_input, scratch)?;
    }
    Ok(())
}

impl Layer for Dense {
    fn name(&self) -> &str {
        &self.name
    }

    fn output_size(&self, inputs: usize) -> Result<usize> {
        if inputs != self.weights.nrows() {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' takes {} inputs", self.name, self.weights.nrows()),
                expected: vec![self.weights.nrows()],
                actual: vec![inputs],
            });
        }
        Ok(self.weights.ncols())
    }

    fn init(&mut self, rng: &mut Rng) {
        let (inputs, outputs) = self.weights.dim();
        let limit = (6.0 / (inputs + outputs) as f32).sqrt();
        self.weights.mapv_inplace(|_| rng.uniform(-limit, limit));
        self.bias.fill(0.0);
    }

    fn forward<'a>(&mut self, input: ArrayView2<'a, f32>, ctx: &ForwardCtx<'a, '_>) -> Result<ArrayView2<'a, f32>> {
        self.infer(input, ctx)
    }

    fn data_parallel(&self) -> Option<Box<dyn ParallelLayer>> {
        let (inputs, outputs) = self.weights.dim();
        Some(Box::new(DenseShape { name: self.name.clone(), inputs, outputs }))
    }

    fn frozen(&self) -> Option<Box<dyn FrozenLayer>> {
        Some(Box::new(Frozen(Dense::from_parts(&self.name, self.weights.clone(), self.bias.clone()))))
    }

    fn backward(
        &mut self,
        input: ArrayView2<'_, f32>,
        _output: ArrayView2<'_, f32>,
        grad_output: ArrayView2<'_, f32>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let (w, gw, gb) = (self.weights.view(), self.grad_weights.view_mut(), self.grad_bias.view_mut());
        backward(&self.name, w, input, grad_output, gw, gb, grad_input, ctx)
    }

    fn params(&mut self, f: &mut dyn FnMut(Param<'_>)) {
        let (w, gw) = (&mut self.weights, &self.grad_weights);
        f(Param {
            value: w.as_slice_mut().expect("owned weights are contiguous"),
            grad: gw.as_slice().expect("owned gradients are contiguous"),
        });
        f(Param {
            value: self.bias.as_slice_mut().expect("owned biases are contiguous"),
            grad: self.grad_bias.as_slice().expect("owned gradients are contiguous"),
        });
    }

    fn param_count(&self) -> usize {
        self.weights.len() + self.bias.len()
    }
}

impl FrozenLayer for Frozen<Dense> {
    fn name(&self) -> &str {
        &self.0.name
    }

    fn param_count(&self) -> usize {
        self.0.weights.len() + self.0.bias.len()
    }

    fn output_size(&self, inputs: usize) -> Result<usize> {
        Layer::output_size(&self.0, inputs)
    }

    fn forward<'a>(&self, input: ArrayView2<'a, f32>, ctx: &ForwardCtx<'a, '_>) -> Result<ArrayView2<'a, f32>> {
        self.0.infer(input, ctx)
    }
}
