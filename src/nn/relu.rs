//! Rectified linear unit: `y = max(x, 0)`.

use crate::{Error, Result};

use ndarray::{ArrayView2, ArrayViewMut2, Zip};
use workspace_core::freeze;

use super::layer::{BackwardCtx, ForwardCtx, Layer, RowsPass};

/// `max(x, 0)` elementwise; the gradient passes where the output is positive.
#[derive(Clone, Debug)]
pub struct Relu {
    name: String,
}

impl Relu {
    /// A ReLU layer named "relu".
    pub fn new() -> Relu {
        Relu::named("relu")
    }

    /// A ReLU layer with a name for messages ([`NetworkConfigBuilder::relu`]
    /// numbers them: "relu_1", "relu_3", ...).
    ///
    /// [`NetworkConfigBuilder::relu`]: crate::nn::NetworkConfigBuilder::relu
    pub fn named(name: &str) -> Relu {
        Relu { name: name.to_string() }
    }
}

impl Default for Relu {
    fn default() -> Relu {
        Relu::new()
    }
}

impl Layer for Relu {
    fn device_form(&self) -> Option<crate::nn::DeviceForm> {
        Some(crate::nn::DeviceForm::Relu)
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

    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<ArrayView2<'a, f32>> {
        let out = ctx.activations.map_of(&input, |v| if v > 0.0 { v } else { 0.0 })?;
        Ok(freeze(out))
    }

    fn backward_rows(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        _ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let (output, grad_output) = (pass.output, pass.grad_output);
        if output.dim() != grad_output.dim() {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' output gradient", self.name),
                expected: output.shape().to_vec(),
                actual: grad_output.shape().to_vec(),
            });
        }
        if let Some(grad_input) = grad_input {
            if grad_input.dim() != output.dim() {
                return Err(Error::ShapeMismatch {
                    context: format!("layer '{}' input gradient", self.name),
                    expected: output.shape().to_vec(),
                    actual: grad_input.shape().to_vec(),
                });
            }
            Zip::from(grad_input).and(&grad_output).and(&output).for_each(|gi, &g, &y| {
                *gi = if y > 0.0 { g } else { 0.0 };
            });
        }
        Ok(())
    }
}
