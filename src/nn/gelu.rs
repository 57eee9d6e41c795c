//! GELU, in its tanh form (GPT-2's activation, the default) or its exact form
//! (PyTorch's `nn.GELU()`, nanoGPT's).

use crate::{Error, Result};

use ndarray::{ArrayView2, ArrayViewMut2};
use workspace_core::freeze;

use super::kernels::gelu_backward;
use super::layer::{
    backward_rows_uninit, BackwardCtx, ForwardCtx, GradInput, Layer, Pass, RowsPass, Tape, UninitGradInput,
};
use super::vector::{gelu_backward_new, gelu_new};

/// Which GELU a [`Gelu`] layer computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GeluForm {
    /// `½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`: GPT-2's, PyTorch's
    /// `nn.GELU(approximate="tanh")`.
    #[default]
    Tanh,
    /// `x·Φ(x) = ½·x·(1 + erf(x/√2))`: PyTorch's `nn.GELU()`, which nanoGPT uses. Its
    /// `erf` is Abramowitz and Stegun's polynomial 7.1.26 (within about 5·10⁻⁷ of `erf`
    /// in f32), so values are within about 10⁻⁶ of PyTorch's. Runs on the host only: a
    /// device network refuses it. A model file holding it is of a version that carve
    /// readers from before it refuse (rather than load it as the tanh form).
    Exact,
}

/// GELU elementwise, in its tanh form ([`GeluForm::Tanh`], GPT-2's, the default) or its
/// exact form ([`GeluForm::Exact`], PyTorch's `nn.GELU()`). Its backward pass reads the
/// forward pass's input only.
#[derive(Clone, Debug)]
pub struct Gelu {
    name: String,
    form: GeluForm,
}

impl Gelu {
    /// A GELU layer named "gelu", in the tanh form.
    pub fn new() -> Gelu {
        Gelu::named("gelu")
    }

    /// A GELU layer in the tanh form with a name for messages
    /// ([`NetworkConfigBuilder::gelu`] numbers them after their position).
    ///
    /// [`NetworkConfigBuilder::gelu`]: crate::nn::NetworkConfigBuilder::gelu
    pub fn named(name: &str) -> Gelu {
        Gelu::with_form(name, GeluForm::Tanh)
    }

    /// A GELU layer in `form` with a name for messages
    /// ([`NetworkConfigBuilder::gelu_exact`] makes the exact form).
    ///
    /// [`NetworkConfigBuilder::gelu_exact`]: crate::nn::NetworkConfigBuilder::gelu_exact
    pub fn with_form(name: &str, form: GeluForm) -> Gelu {
        Gelu { name: name.to_string(), form }
    }

    /// The form it computes.
    pub fn form(&self) -> GeluForm {
        self.form
    }
}

impl Default for Gelu {
    fn default() -> Gelu {
        Gelu::new()
    }
}

impl Layer for Gelu {
    fn device_form(&self) -> Option<crate::nn::DeviceForm> {
        // The devices' kernel is the tanh form.
        (self.form == GeluForm::Tanh).then_some(crate::nn::DeviceForm::Gelu)
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
        Ok(freeze(gelu_new(input, out, self.form)))
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
            gelu_backward(input, grad_output, grad_input, self.form);
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
            Ok(gelu_backward_new(input, grad_output, dx, self.form))
        })
    }
}
