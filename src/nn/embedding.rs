//! Token and position embeddings: the first layers of a language model.

use ndarray::{s, ArrayView2, ArrayViewMut2, Axis};
use workspace_core::freeze;

use crate::{Error, Result};

use super::kernels::{add_rows, fill};
use super::layer::{
    check_grad_input, check_len, check_mask, sequence_grad_input, Activations, BackwardCtx, ForwardCtx, GradInput,
    Init, Layer, ParamShape, Pass, StreamState, Tape,
};

/// The most tokens a vocabulary holds: ids reach the first layer as `f32` values,
/// exact up to 2²⁴.
pub const MAX_VOCABULARY: usize = 1 << 24;

/// A table of one row of `width` features per token of a vocabulary: token ids
/// `[batch, time]` in, their rows `[batch, time, width]` out (PyTorch's
/// `nn.Embedding`). Its parameter, in PyTorch's name and layout: `weight`
/// `[vocabulary, width]`, drawn from N(0, 0.02²) as GPT-2 draws it. The vocabulary is
/// the network's input width: `NetworkConfig::builder(vocabulary).embedding(width)`.
///
/// The gradient is sparse: the backward pass adds each step's output gradient into the
/// row of its token (the other rows' gradients are 0), so it costs what the batch
/// holds, plus clearing the table's gradient.
#[derive(Clone, Debug)]
pub struct Embedding {
    name: String,
    vocabulary: usize,
    width: usize,
}

impl Embedding {
    /// A table of `vocabulary` rows of `width` features.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a vocabulary or width of 0, a vocabulary of more
    /// than [`MAX_VOCABULARY`] tokens, or a table whose size overflows.
    pub fn named(name: &str, vocabulary: usize, width: usize) -> Result<Embedding> {
        if vocabulary == 0 || vocabulary > MAX_VOCABULARY || width == 0 || vocabulary.checked_mul(width).is_none() {
            return Err(Error::invalid_config(format!(
                "embedding '{name}': a table of {vocabulary} tokens × {width} features (at least 1 of each, at most \
                 {MAX_VOCABULARY} tokens, and a table that can be laid out)"
            )));
        }
        Ok(Embedding { name: name.to_string(), vocabulary, width })
    }

    /// Tokens in the vocabulary.
    pub fn vocabulary(&self) -> usize {
        self.vocabulary
    }

    /// Features per token.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The table as rows.
    fn table<'p>(&self, params: &'p [f32]) -> Result<ArrayView2<'p, f32>> {
        check_len(&self.name, "parameters", params.len(), self.vocabulary * self.width)?;
        Ok(ArrayView2::from_shape((self.vocabulary, self.width), params).expect("vocabulary × width values"))
    }
}

impl Layer for Embedding {
    fn device_form(&self) -> Option<crate::nn::DeviceForm> {
        Some(crate::nn::DeviceForm::Embedding { vocabulary: self.vocabulary, width: self.width })
    }

    fn per_step(&self) -> bool {
        true
    }

    fn reads_tokens(&self) -> bool {
        true
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn output_size(&self, inputs: usize) -> Result<usize> {
        if inputs != self.vocabulary {
            return Err(Error::ShapeMismatch {
                context: format!(
                    "embedding '{}' of {} tokens: the network's input width is its vocabulary",
                    self.name, self.vocabulary
                ),
                expected: vec![self.vocabulary],
                actual: vec![inputs],
            });
        }
        Ok(self.width)
    }

    fn param_shapes(&self, _inputs: usize) -> Vec<ParamShape> {
        vec![ParamShape::new("weight", &[self.vocabulary, self.width])]
    }

    fn init(&self, _inputs: usize, params: &mut [f32], init: &mut Init<'_>) {
        init.fill_normal(params, 0.02);
    }

    fn forward<'a>(
        &self,
        params: &[f32],
        input: Activations<'a>,
        _mask: Option<ArrayView2<'a, f32>>,
        _tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        let ids = self.ids(input)?;
        let table = self.table(params)?;
        let (batch, steps) = ids.dim();
        let mut out = ctx.activations.zeros::<f32, _>((batch, steps, self.width))?;
        for ((b, t), &id) in ids.indexed_iter() {
            out.slice_mut(s![b, t, ..]).assign(&table.row(self.row_of(id, b, t)?));
        }
        Ok(Activations::Sequence(freeze(out)))
    }

    fn backward(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        _tape: &mut Tape,
        _ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        self.table(params)?;
        check_len(&self.name, "gradients", grads.len(), self.vocabulary * self.width)?;
        if grad_input.is_some() {
            return Err(Error::InvalidInput(format!(
                "embedding '{}': token ids have no gradient; an embedding is a network's first layer",
                self.name
            )));
        }
        let ids = self.ids(pass.input)?;
        let dy = pass.grad_output.sequence(&self.name)?;
        if dy.dim() != (ids.nrows(), ids.ncols(), self.width) {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' output gradient", self.name),
                expected: vec![ids.nrows(), ids.ncols(), self.width],
                actual: dy.shape().to_vec(),
            });
        }
        let mut table = ArrayViewMut2::from_shape((self.vocabulary, self.width), grads).expect("checked length");
        fill(table.view_mut(), 0.0);
        // Each step's gradient into its token's row, in batch and step order
        // (deterministic).
        for ((b, t), &id) in ids.indexed_iter() {
            let row = self.row_of(id, b, t)?;
            add_rows(table.row_mut(row), dy.slice(s![b, t..t + 1, ..]));
        }
        Ok(())
    }
}

impl Embedding {
    /// The token ids of a batch: one feature per step, the id's value (as the network
    /// hands on [`Input::Tokens`](crate::nn::Input::Tokens)).
    fn ids<'a>(&self, input: Activations<'a>) -> Result<ArrayView2<'a, f32>> {
        let x = input.sequence(&self.name)?;
        if x.shape()[2] != 1 {
            return Err(Error::ShapeMismatch {
                context: format!(
                    "embedding '{}' takes token ids (Input::Tokens), one per step, not features",
                    self.name
                ),
                expected: vec![x.shape()[0], x.shape()[1], 1],
                actual: x.shape().to_vec(),
            });
        }
        Ok(x.index_axis_move(Axis(2), 0))
    }

    /// The table row of the id `id` at sequence `b`, step `t`.
    fn row_of(&self, id: f32, b: usize, t: usize) -> Result<usize> {
        if id >= 0.0 && id < self.vocabulary as f32 && id.fract() == 0.0 {
            return Ok(id as usize);
        }
        Err(Error::InvalidInput(format!(
            "embedding '{}': {id} (sequence {b}, step {t}) is not a token id of its vocabulary of {} tokens",
            self.name, self.vocabulary
        )))
    }
}

/// A learned position embedding: row `t` of a table of `context` rows added to step
/// `t` of each sequence (GPT-2's `wpe`). Its parameter: `weight` `[context, width]`,
/// from N(0, 0.02²). A batch of more than `context` steps is an error.
#[derive(Clone, Debug)]
pub struct PositionEmbedding {
    name: String,
    context: usize,
    width: usize,
}

impl PositionEmbedding {
    /// Positions `0..context` of `width` features.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a context or width of 0, or a table whose size
    /// overflows.
    pub fn named(name: &str, context: usize, width: usize) -> Result<PositionEmbedding> {
        if context == 0 || width == 0 || context.checked_mul(width).is_none() {
            return Err(Error::invalid_config(format!(
                "position embedding '{name}': a table of {context} positions × {width} features (both at least 1)"
            )));
        }
        Ok(PositionEmbedding { name: name.to_string(), context, width })
    }

    /// The longest sequence it embeds.
    pub fn context(&self) -> usize {
        self.context
    }
}

impl Layer for PositionEmbedding {
    fn device_form(&self) -> Option<crate::nn::DeviceForm> {
        Some(crate::nn::DeviceForm::PositionEmbedding { context: self.context, width: self.width })
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn output_size(&self, inputs: usize) -> Result<usize> {
        if inputs != self.width {
            return Err(Error::ShapeMismatch {
                context: format!("position embedding '{}' of {} features", self.name, self.width),
                expected: vec![self.width],
                actual: vec![inputs],
            });
        }
        Ok(self.width)
    }

    fn param_shapes(&self, _inputs: usize) -> Vec<ParamShape> {
        vec![ParamShape::new("weight", &[self.context, self.width])]
    }

    fn init(&self, _inputs: usize, params: &mut [f32], init: &mut Init<'_>) {
        init.fill_normal(params, 0.02);
    }

    fn forward<'a>(
        &self,
        params: &[f32],
        input: Activations<'a>,
        mask: Option<ArrayView2<'a, f32>>,
        _tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        let x = input.sequence(&self.name)?;
        let (_, steps, _) = check_mask(&self.name, &x, mask.as_ref())?;
        check_len(&self.name, "parameters", params.len(), self.context * self.width)?;
        self.check_steps(steps)?;
        if x.shape()[2] != self.width {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' input [batch, time, features]", self.name),
                expected: vec![x.shape()[0], steps, self.width],
                actual: x.shape().to_vec(),
            });
        }
        let table = ArrayView2::from_shape((self.context, self.width), params).expect("checked length");
        let mut out = ctx.activations.copy_of(&x)?;
        for mut sequence in out.outer_iter_mut() {
            sequence += &table.slice(s![..steps, ..]);
        }
        Ok(Activations::Sequence(freeze(out)))
    }

    fn backward(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        _tape: &mut Tape,
        _ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        check_len(&self.name, "parameters", params.len(), self.context * self.width)?;
        check_len(&self.name, "gradients", grads.len(), self.context * self.width)?;
        let x = pass.input.sequence(&self.name)?;
        let dy = pass.grad_output.sequence(&self.name)?;
        let (_, steps, _) = x.dim();
        self.check_steps(steps)?;
        if dy.dim() != x.dim() {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' output gradient", self.name),
                expected: x.shape().to_vec(),
                actual: dy.shape().to_vec(),
            });
        }
        let grad_input = grad_input.map(|g| sequence_grad_input(g, &self.name)).transpose()?;
        check_grad_input(&self.name, &x, &grad_input)?;
        let mut table = ArrayViewMut2::from_shape((self.context, self.width), grads).expect("checked length");
        fill(table.view_mut(), 0.0);
        // Σ over the batch of each step's gradient, in batch order.
        for t in 0..steps {
            add_rows(table.row_mut(t), dy.slice(s![.., t, ..]));
        }
        if let Some(mut g) = grad_input {
            g.assign(&dy);
        }
        Ok(())
    }

    fn max_steps(&self) -> Option<usize> {
        Some(self.context)
    }

    fn runs_in_stream(&self) -> bool {
        true
    }

    fn forward_stream<'a>(
        &self,
        params: &[f32],
        input: Activations<'a>,
        state: &mut StreamState<'_>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        // Row `b`'s new steps are at positions `position(b)..`: their rows of the table.
        let x = input.sequence(&self.name)?;
        check_len(&self.name, "parameters", params.len(), self.context * self.width)?;
        let (streams, steps, features) = x.dim();
        if features != self.width || streams != state.streams() {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' input [streams, new steps, features]", self.name),
                expected: vec![state.streams(), steps, self.width],
                actual: x.shape().to_vec(),
            });
        }
        let table = ArrayView2::from_shape((self.context, self.width), params).expect("checked length");
        let mut out = ctx.activations.copy_of(&x)?;
        for (b, mut sequence) in out.outer_iter_mut().enumerate() {
            let first = state.position(b);
            self.check_steps(first.saturating_add(steps))?;
            sequence += &table.slice(s![first..first + steps, ..]);
        }
        Ok(Activations::Sequence(freeze(out)))
    }
}

impl PositionEmbedding {
    fn check_steps(&self, steps: usize) -> Result<()> {
        if steps > self.context {
            return Err(Error::InvalidInput(format!(
                "position embedding '{}': a sequence of {steps} steps is longer than its context of {}",
                self.name, self.context
            )));
        }
        Ok(())
    }
}
