//! A layer run on its own, as a network runs it: its parameters, their gradients and
//! its tape held here (for gradient checks and the layer API's errors).

use carve::nn::{initial_params, Activations, BackwardCtx, ForwardCtx, GradInput, Layer, Pass, Tape, UninitGradInput};
use ndarray::ArrayView2;

pub(crate) struct Standalone {
    pub(crate) layer: Box<dyn Layer>,
    pub(crate) inputs: usize,
    pub(crate) params: Vec<f32>,
    pub(crate) grads: Vec<f32>,
    pub(crate) tape: Tape,
}

impl Standalone {
    /// `layer` on `inputs` columns, its parameters initialised as a network of `seed`
    /// whose first layer it is would.
    pub(crate) fn new(layer: impl Layer, inputs: usize, seed: u64) -> Standalone {
        let params = initial_params(&layer, inputs, seed);
        let (grads, tape) = (vec![0.0; params.len()], layer.tape());
        Standalone { layer: Box::new(layer), inputs, params, grads, tape }
    }

    pub(crate) fn name(&self) -> &str {
        self.layer.name()
    }

    pub(crate) fn forward<'a>(
        &mut self,
        input: Activations<'a>,
        mask: Option<ArrayView2<'a, f32>>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<Activations<'a>> {
        self.layer.forward(&self.params, input, mask, &mut self.tape, ctx)
    }

    pub(crate) fn backward(
        &mut self,
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        ctx: &BackwardCtx<'_>,
    ) -> carve::Result<()> {
        self.layer.backward(&self.params, &mut self.grads, pass, grad_input, &mut self.tape, ctx)
    }

    pub(crate) fn backward_uninit<'g>(
        &mut self,
        pass: Pass<'_>,
        grad_input: UninitGradInput<'g>,
        ctx: &BackwardCtx<'_>,
    ) -> carve::Result<GradInput<'g>> {
        self.layer.backward_uninit(&self.params, &mut self.grads, pass, grad_input, &mut self.tape, ctx)
    }

    /// Where parameter `p` starts in `params`, and its length.
    fn range(&self, p: usize) -> std::ops::Range<usize> {
        let shapes = self.layer.param_shapes(self.inputs);
        let start: usize = shapes[..p].iter().map(|s| s.len()).sum();
        start..start + shapes[p].len()
    }

    /// The gradient of each parameter from the last backward pass.
    pub(crate) fn param_grads(&self) -> Vec<Vec<f32>> {
        let count = self.layer.param_shapes(self.inputs).len();
        (0..count).map(|p| self.grads[self.range(p)].to_vec()).collect()
    }

    /// Parameter `p`'s values.
    pub(crate) fn param_mut(&mut self, p: usize) -> &mut [f32] {
        let range = self.range(p);
        &mut self.params[range]
    }

    /// Adds `delta` to element `k` of parameter `p`.
    pub(crate) fn nudge(&mut self, p: usize, k: usize, delta: f32) {
        self.param_mut(p)[k] += delta;
    }
}
