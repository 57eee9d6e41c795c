//! GELU in its tanh form (GPT-2's activation).

use crate::{Error, Result};

use ndarray::{ArrayView2, ArrayViewMut2};
use workspace_core::freeze;

use super::kernels::gelu_backward;
use super::layer::{
    backward_rows_uninit, BackwardCtx, ForwardCtx, GradInput, Layer, Pass, RowsPass, Tape, UninitGradInput,
};
use super::vector::{gelu_backward_new, gelu_new};

/// `y = ½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` elementwise: the Gaussian error linear
/// unit in the tanh form GPT-2 uses (PyTorch's `nn.GELU(approximate="tanh")`). Its
/// backward pass reads the forward pass's input only.
#[derive(Clone, Debug)]
pub struct Gelu {
    name: String,
}

impl Gelu {
    /// A GELU layer named "gelu".
    pub fn new() -> Gelu {
        Gelu::named("gelu")
    }

    /// A GELU layer with a name for messages ([`NetworkConfigBuilder::gelu`] numbers
    /// them after their position).
    ///
    /// [`NetworkConfigBuilder::gelu`]: crate::nn::NetworkConfigBuilder::gelu
    pub fn named(name: &str) -> Gelu {
        Gelu { name: name.to_string() }
    }
}

impl Default for Gelu {
    fn default() -> Gelu {
        Gelu::new()
    }
}

impl Layer for Gelu {
    fn device_form(&self) -> Option<crate::nn::DeviceForm> {
        Some(crate::nn::DeviceForm::Gelu)
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

    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<ArrayView2<'a, f32>> {
        let out = ctx.activations.uninit::<f32, _>(input.raw_dim())?;
        Ok(freeze(gelu_new(input, out)))
    }

    fn backward_rows(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        _ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let (input, grad_output) = (pass.input, pass.grad_output);
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
        if let Some(grad_input) = grad_input {
            gelu_backward(input, grad_output, grad_input);
        }
        Ok(())
    }

    fn backward_uninit<'g>(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: UninitGradInput<'g>,
        _tape: &mut Tape,
        _ctx: &BackwardCtx<'_>,
    ) -> Result<GradInput<'g>> {
        // Every element of the input's gradient is written: no zeros first.
        backward_rows_uninit(&self.name, pass, grad_input, |rows, dx| {
            let (input, grad_output) = (rows.input, rows.grad_output);
            if grad_output.dim() != input.dim() {
                return Err(Error::ShapeMismatch {
                    context: format!("layer '{}' output gradient", self.name),
                    expected: input.shape().to_vec(),
                    actual: grad_output.shape().to_vec(),
                });
            }
            Ok(gelu_backward_new(input, grad_output, dx))
        })
    }
}
