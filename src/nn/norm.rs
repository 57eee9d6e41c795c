//! Layer normalisation (`nn.LayerNorm` over the last axis, with a learned scale and
//! bias).

use crate::{Error, Result};

use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2};
use workspace_core::freeze;

use super::kernels::layer_norm_backward;
use super::layer::{check_len, BackwardCtx, ForwardCtx, Init, Layer, ParamShape, RowsPass};
use super::vector::layer_norm_new;

/// Normalises each row (each step of a sequence) over its features:
/// `y = (x − mean) / √(var + eps) · weight + bias`, the variance biased, as PyTorch's
/// `nn.LayerNorm(features)` computes it. Parameters, in PyTorch's names: `weight`
/// (ones) and `bias` (zeros), one per feature; the width is the network's at the layer.
///
/// Nothing is kept for the backward pass: it rebuilds each row's mean and deviation
/// from the input, which costs a pass over the row and saves `2 · rows` values per
/// layer (and the bookkeeping of a tape).
#[derive(Clone, Debug)]
pub struct LayerNorm {
    name: String,
    eps: f32,
}

impl LayerNorm {
    /// PyTorch's default `eps`.
    pub const DEFAULT_EPS: f32 = 1e-5;

    /// A layer normalisation named `name`, with `eps` 1e-5.
    pub fn named(name: &str) -> LayerNorm {
        LayerNorm { name: name.to_string(), eps: LayerNorm::DEFAULT_EPS }
    }

    /// The same, with another `eps`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for an `eps` that is not finite and positive.
    pub fn with_eps(mut self, eps: f32) -> Result<LayerNorm> {
        if !(eps.is_finite() && eps > 0.0) {
            return Err(Error::invalid_config(format!(
                "layer '{}': eps {eps} is not a positive finite number",
                self.name
            )));
        }
        self.eps = eps;
        Ok(self)
    }

    /// The `eps` added to the variance.
    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// The scale and bias in `params` (`2 · features` values).
    fn split<'p>(&self, params: &'p [f32], features: usize) -> Result<(ArrayView1<'p, f32>, ArrayView1<'p, f32>)> {
        check_len(&self.name, "parameters", params.len(), 2 * features)?;
        let (w, b) = params.split_at(features);
        Ok((ArrayView1::from(w), ArrayView1::from(b)))
    }
}

impl Layer for LayerNorm {
    fn device_form(&self) -> Option<crate::nn::DeviceForm> {
        Some(crate::nn::DeviceForm::LayerNorm { eps: self.eps })
    }

    fn per_step(&self) -> bool {
        true
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn output_size(&self, inputs: usize) -> Result<usize> {
        Ok(inputs)
    }

    fn rebuilt_in_backward(&self) -> bool {
        // Computing it again costs a pass over the input; keeping it, its bytes for the
        // whole step.
        true
    }

    fn param_shapes(&self, inputs: usize) -> Vec<ParamShape> {
        vec![ParamShape::new("weight", &[inputs]), ParamShape::new("bias", &[inputs])]
    }

    fn init(&self, inputs: usize, params: &mut [f32], _init: &mut Init<'_>) {
        let (w, b) = params.split_at_mut(inputs.min(params.len()));
        w.fill(1.0);
        b.fill(0.0);
    }

    fn forward_rows<'a>(
        &self,
        params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<ArrayView2<'a, f32>> {
        let (w, b) = self.split(params, input.ncols())?;
        let out = ctx.activations.uninit::<f32, _>(input.raw_dim())?;
        Ok(freeze(layer_norm_new(input, w, b, self.eps, out)))
    }

    fn backward_rows(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        _ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let (input, grad_output) = (pass.input, pass.grad_output);
        let features = input.ncols();
        let (w, _) = self.split(params, features)?;
        check_len(&self.name, "gradients", grads.len(), 2 * features)?;
        let wrong = |what: &str, shape: &[usize]| Error::ShapeMismatch {
            context: format!("layer '{}' {what}", self.name),
            expected: input.shape().to_vec(),
            actual: shape.to_vec(),
        };
        if grad_output.dim() != input.dim() {
            return Err(wrong("output gradient", grad_output.shape()));
        }
        if let Some(g) = grad_input.as_ref().filter(|g| g.dim() != input.dim()) {
            return Err(wrong("input gradient", g.shape()));
        }
        let (gw, gb) = grads.split_at_mut(features);
        layer_norm_backward(
            input,
            w,
            self.eps,
            grad_output,
            ArrayViewMut1::from(gw),
            ArrayViewMut1::from(gb),
            grad_input,
        );
        Ok(())
    }
}
