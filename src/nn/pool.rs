//! Sequence heads: one row per sequence from a batch of sequences, reading only the
//! steps that hold data.

use ndarray::{s, ArrayView2, ArrayView3, ArrayViewMut3};
use workspace_core::freeze;

use crate::{Error, Result};

use super::layer::{
    check_grad_input, check_mask, sequence_grad_input, Activations, BackwardCtx, ForwardCtx, GradInput, Layer, Pass,
    Tape,
};

/// The output of each sequence's last step that holds data (the last unmasked step;
/// the last step when there is no mask): `[batch, time, features]` → `[batch,
/// features]`. DL4J's `LastTimeStep`.
#[derive(Clone, Debug)]
pub struct LastStep {
    name: String,
}

/// The mean over each sequence's steps that hold data (the unmasked steps):
/// `[batch, time, features]` → `[batch, features]`. DL4J's global average pooling over
/// time, with its mask.
#[derive(Clone, Debug)]
pub struct MaskedMean {
    name: String,
}

impl LastStep {
    /// A head named "last_step".
    pub fn new() -> LastStep {
        LastStep::named("last_step")
    }

    /// A head with a name for messages.
    pub fn named(name: &str) -> LastStep {
        LastStep { name: name.to_string() }
    }
}

impl Default for LastStep {
    fn default() -> LastStep {
        LastStep::new()
    }
}

impl MaskedMean {
    /// A head named "masked_mean".
    pub fn new() -> MaskedMean {
        MaskedMean::named("masked_mean")
    }

    /// A head with a name for messages.
    pub fn named(name: &str) -> MaskedMean {
        MaskedMean { name: name.to_string() }
    }
}

impl Default for MaskedMean {
    fn default() -> MaskedMean {
        MaskedMean::new()
    }
}

/// The steps of sequence `row` that hold data: their count and the last one.
fn held(mask: Option<&ArrayView2<'_, f32>>, row: usize, steps: usize, layer: &str) -> Result<(usize, usize)> {
    if steps == 0 {
        return Err(Error::InvalidInput(format!("layer '{layer}': sequences of 0 steps have no output")));
    }
    let Some(mask) = mask else { return Ok((steps, steps - 1)) };
    let mut count = 0;
    let mut last = 0;
    for (t, &m) in mask.row(row).iter().enumerate() {
        if m != 0.0 {
            count += 1;
            last = t;
        }
    }
    if count == 0 {
        return Err(Error::InvalidInput(format!(
            "layer '{layer}': sequence {row} of the batch has no step that holds data (its mask is all 0), so it \
             has no output; leave empty sequences out of the batch"
        )));
    }
    Ok((count, last))
}

fn takes_sequences(layer: &str, input: ArrayView2<'_, f32>) -> Error {
    Error::ShapeMismatch {
        context: format!(
            "layer '{layer}' turns batches of sequences [batch, time, features] into rows; it has no flat input"
        ),
        expected: vec![input.nrows(), 0, input.ncols()],
        actual: input.shape().to_vec(),
    }
}

/// The gradient of a head's flat output, checked against the input it pooled.
fn flat_grad<'g>(
    layer: &str,
    grad_output: Activations<'g>,
    batch: usize,
    features: usize,
) -> Result<ArrayView2<'g, f32>> {
    let grad = grad_output.flat(layer)?;
    if grad.dim() != (batch, features) {
        return Err(Error::ShapeMismatch {
            context: format!("layer '{layer}' output gradient"),
            expected: vec![batch, features],
            actual: grad.shape().to_vec(),
        });
    }
    Ok(grad)
}

/// A head's input, which must be a batch of sequences.
fn sequences<'a>(layer: &str, input: Activations<'a>) -> Result<ArrayView3<'a, f32>> {
    match input {
        Activations::Sequence(x) => Ok(x),
        Activations::Flat(x) => Err(takes_sequences(layer, x)),
    }
}

impl Layer for LastStep {
    fn name(&self) -> &str {
        &self.name
    }

    fn output_size(&self, inputs: usize) -> Result<usize> {
        Ok(inputs)
    }

    fn forward<'a>(
        &self,
        _params: &[f32],
        input: Activations<'a>,
        mask: Option<ArrayView2<'a, f32>>,
        _tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        last_step(self, sequences(&self.name, input)?, mask, ctx)
    }

    fn backward(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        _tape: &mut Tape,
        _ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let (input, mask) = (sequences(&self.name, pass.input)?, pass.mask);
        let grad_input = grad_input.map(|g| sequence_grad_input(g, &self.name)).transpose()?;
        let (batch, steps, features) = check_mask(&self.name, &input, mask.as_ref())?;
        let grad = flat_grad(&self.name, pass.grad_output, batch, features)?;
        check_grad_input(&self.name, &input, &grad_input)?;
        if let Some(mut grad_input) = grad_input {
            grad_input.fill(0.0);
            for r in 0..batch {
                let (_, last) = held(mask.as_ref(), r, steps, &self.name)?;
                grad_input.slice_mut(s![r, last, ..]).assign(&grad.row(r));
            }
        }
        Ok(())
    }
}

impl Layer for MaskedMean {
    fn name(&self) -> &str {
        &self.name
    }

    fn output_size(&self, inputs: usize) -> Result<usize> {
        Ok(inputs)
    }

    fn forward<'a>(
        &self,
        _params: &[f32],
        input: Activations<'a>,
        mask: Option<ArrayView2<'a, f32>>,
        _tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        masked_mean(self, sequences(&self.name, input)?, mask, ctx)
    }

    fn backward(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        _tape: &mut Tape,
        _ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let (input, mask) = (sequences(&self.name, pass.input)?, pass.mask);
        let grad_input: Option<ArrayViewMut3<'_, f32>> =
            grad_input.map(|g| sequence_grad_input(g, &self.name)).transpose()?;
        let (batch, steps, features) = check_mask(&self.name, &input, mask.as_ref())?;
        let grad = flat_grad(&self.name, pass.grad_output, batch, features)?;
        check_grad_input(&self.name, &input, &grad_input)?;
        if let Some(mut grad_input) = grad_input {
            for r in 0..batch {
                let (count, _) = held(mask.as_ref(), r, steps, &self.name)?;
                let scale = 1.0 / count as f32;
                for t in 0..steps {
                    let held = mask.as_ref().is_none_or(|m| m[[r, t]] != 0.0);
                    let mut cell = grad_input.slice_mut(s![r, t, ..]);
                    if held {
                        cell.zip_mut_with(&grad.row(r), |gi, &g| *gi = g * scale);
                    } else {
                        cell.fill(0.0);
                    }
                }
            }
        }
        Ok(())
    }
}

/// [`LastStep`]'s forward pass.
fn last_step<'a>(
    head: &LastStep,
    input: ArrayView3<'a, f32>,
    mask: Option<ArrayView2<'a, f32>>,
    ctx: &ForwardCtx<'a, '_>,
) -> Result<Activations<'a>> {
    let (batch, steps, features) = check_mask(&head.name, &input, mask.as_ref())?;
    let mut out = ctx.activations.zeros::<f32, _>((batch, features))?;
    for r in 0..batch {
        let (_, last) = held(mask.as_ref(), r, steps, &head.name)?;
        out.row_mut(r).assign(&input.slice(s![r, last, ..]));
    }
    Ok(Activations::Flat(freeze(out)))
}

/// [`MaskedMean`]'s forward pass.
fn masked_mean<'a>(
    head: &MaskedMean,
    input: ArrayView3<'a, f32>,
    mask: Option<ArrayView2<'a, f32>>,
    ctx: &ForwardCtx<'a, '_>,
) -> Result<Activations<'a>> {
    let (batch, steps, features) = check_mask(&head.name, &input, mask.as_ref())?;
    let mut out = ctx.activations.zeros::<f32, _>((batch, features))?;
    for r in 0..batch {
        let (count, _) = held(mask.as_ref(), r, steps, &head.name)?;
        let mut row = out.row_mut(r);
        // Summed in step order, then scaled: the same numbers with or without padding.
        for t in 0..steps {
            if mask.as_ref().is_none_or(|m| m[[r, t]] != 0.0) {
                row += &input.slice(s![r, t, ..]);
            }
        }
        let scale = 1.0 / count as f32;
        row.mapv_inplace(|v| v * scale);
    }
    Ok(Activations::Flat(freeze(out)))
}
