//! Residual blocks: `y = x + f(x)`, where `f` is the layers of the block.
//!
//! A block is not a layer that holds layers: its layers are the network's, in order,
//! and a [`Residual`] join after them adds the block's input to their output. The step
//! runs the join: forward, it adds the input it kept for the block (the activations of
//! the block's first layer's input, already kept for that layer's backward pass);
//! backward, the join's gradient flows down the block's layers unchanged and is added,
//! once they are through, to the gradient of the block's input. So every layer of a
//! block is trained, checked, saved and served as a layer of the network, and a block
//! costs one array for its output and, while its backward pass runs, one copy of its
//! output's gradient.

use crate::{Error, Result};

use super::layer::{Activations, ForwardCtx, Layer, Tape};

/// How deeply blocks may nest (a block inside a block ...): the step keeps the pending
/// blocks on a fixed stack, so a step allocates nothing for them.
pub(crate) const MAX_NESTING: usize = 8;

/// The join of a residual block: adds the block's input to the output of its last
/// layer. `from` is the index of the block's first layer.
#[derive(Clone, Debug)]
pub(crate) struct Residual {
    name: String,
    from: usize,
}

impl Residual {
    pub(crate) fn new(name: &str, from: usize) -> Residual {
        Residual { name: name.to_string(), from }
    }
}

impl Layer for Residual {
    fn device_form(&self) -> Option<crate::nn::DeviceForm> {
        Some(crate::nn::DeviceForm::Residual { from: self.from })
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn output_size(&self, inputs: usize) -> Result<usize> {
        Ok(inputs)
    }

    fn forward<'a>(
        &self,
        _params: &[f32],
        _input: Activations<'a>,
        _mask: Option<ndarray::ArrayView2<'a, f32>>,
        _tape: &mut Tape,
        _ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        Err(Error::InvalidInput(format!(
            "'{}' joins a residual block: a network runs it, with the block's input",
            self.name
        )))
    }
}

/// The first layer of the block that `layer` joins, when it is a residual join.
pub(crate) fn residual_from(layer: &dyn Layer) -> Option<usize> {
    let any: &dyn std::any::Any = layer;
    any.downcast_ref::<Residual>().map(|r| r.from)
}

/// Where layer `i` of `layers` joins a residual block: the index of the block's first
/// layer.
pub(crate) fn join_of(layers: &[Box<dyn Layer>], i: usize) -> Option<usize> {
    let layer: &dyn std::any::Any = layers[i].as_ref();
    layer.downcast_ref::<Residual>().map(|r| r.from)
}

/// How many blocks start at layer `i` (blocks may nest and start together).
pub(crate) fn blocks_starting_at(layers: &[Box<dyn Layer>], i: usize) -> usize {
    (i + 1..layers.len()).filter(|&j| join_of(layers, j) == Some(i)).count()
}

/// A fixed stack of at most [`MAX_NESTING`] values.
pub(crate) struct Stack<T> {
    items: [Option<T>; MAX_NESTING],
    len: usize,
}

impl<T> Stack<T> {
    pub(crate) fn new() -> Stack<T> {
        Stack { items: std::array::from_fn(|_| None), len: 0 }
    }

    pub(crate) fn push(&mut self, value: T) -> Result<()> {
        if self.len == MAX_NESTING {
            return Err(Error::InvalidInput(format!("residual blocks nested more than {MAX_NESTING} deep ")));
        }
        self.items[self.len] = Some(value);
        self.len += 1;
        Ok(())
    }

    pub(crate) fn pop(&mut self) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        self.len -= 1;
        self.items[self.len].take()
    }

    pub(crate) fn last(&self) -> Option<&T> {
        self.len.checked_sub(1).and_then(|i| self.items[i].as_ref())
    }
}
