//! Where every layer's parameters live: one flat buffer per network (parameters,
//! gradients, each moment of the updater), the layers in backward order (the last
//! layer's first), so that the gradients a backward pass finishes first are contiguous
//! and can be reduced while the pass goes on. [`Network`](crate::nn::Network),
//! every data-parallel worker and [`Model`](crate::nn::serve::Model) share this layout: a
//! network's buffers are handed to a trainer or a model as they are.

use super::residual::{residual_from, MAX_NESTING};
use std::ops::Range;

use crate::{Error, Result};

use super::layer::{Layer, ParamShape};

/// Where each layer's parameters (and gradients) are in the flat buffers, and the
/// buckets the gradients are reduced in.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    /// Per layer, in forward order: its range of the flat buffers, which hold the layers
    /// in backward order (the last layer's first).
    pub(crate) regions: Vec<Range<usize>>,
    /// The gradient buckets, in backward order: consecutive ranges of the flat buffers,
    /// each of whole layers.
    pub(crate) buckets: Vec<Range<usize>>,
    /// Values in all.
    pub(crate) total: usize,
}

impl Layout {
    /// The layout of layers of `counts` values each (in forward order), their gradients
    /// cut into buckets of at least `bucket_values` values (but for the last).
    pub(crate) fn new(counts: &[usize], bucket_values: usize) -> Layout {
        let total = counts.iter().sum();
        let mut regions = vec![0..0; counts.len()];
        let mut offset = 0;
        let mut buckets: Vec<Range<usize>> = Vec::new();
        for (i, &count) in counts.iter().enumerate().rev() {
            regions[i] = offset..offset + count;
            let open = buckets.last().is_some_and(|last| last.len() < bucket_values.max(1));
            match buckets.last_mut() {
                Some(last) if open => last.end += count,
                _ if count > 0 => buckets.push(offset..offset + count),
                _ => {}
            }
            offset += count;
        }
        Layout { regions, buckets, total }
    }

    /// The number of values of each layer, in forward order.
    pub(crate) fn counts(&self) -> Vec<usize> {
        self.regions.iter().map(|r| r.len()).collect()
    }

    /// The layer whose region holds flat index `index`, and the index within it.
    pub(crate) fn locate(&self, index: usize) -> (usize, usize) {
        self.regions
            .iter()
            .position(|r| r.contains(&index))
            .map_or((self.regions.len(), index), |layer| (layer, index - self.regions[layer].start))
    }
}

/// The parameters of a network's layers: each layer's input width, its parameters'
/// names and shapes, and their layout in the flat buffers.
#[derive(Clone, Debug)]
pub(crate) struct Params {
    /// Per layer, in forward order: its input width.
    pub(crate) widths: Vec<usize>,
    /// Per layer, in forward order: its parameters.
    pub(crate) shapes: Vec<Vec<ParamShape>>,
    pub(crate) layout: Layout,
    /// The network's output width.
    pub(crate) outputs: usize,
    /// Per layer, in forward order: how many residual blocks start at it (their input
    /// is the layer's), counted once here rather than at every step.
    pub(crate) block_starts: Vec<usize>,
}

impl Params {
    /// The parameters of `layers` on `inputs` columns: each layer's width checked in
    /// order, its parameters' shapes asked for and laid out.
    ///
    /// # Errors
    ///
    /// A layer's error for its input width; [`Error::InvalidConfig`] for parameters
    /// whose sizes overflow, or two of a layer's parameters of one name.
    pub(crate) fn of(inputs: usize, layers: &[Box<dyn Layer>]) -> Result<Params> {
        let mut widths = Vec::with_capacity(layers.len());
        let mut shapes = Vec::with_capacity(layers.len());
        let mut counts = Vec::with_capacity(layers.len());
        let mut block_starts = Vec::with_capacity(layers.len());
        let mut width = inputs;
        let mut total = 0usize;
        // The residual blocks open at each layer, innermost last: a join must close the
        // innermost block, of its input's width (blocks nest, never cross).
        let mut open: Vec<usize> = Vec::new();
        for (i, layer) in layers.iter().enumerate() {
            let starts = (i + 1..layers.len()).filter(|&j| residual_from(layers[j].as_ref()) == Some(i)).count();
            block_starts.push(starts);
            open.extend(std::iter::repeat_n(i, starts));
            if let Some(from) = residual_from(layer.as_ref()) {
                if open.pop() != Some(from) || widths.get(from) != Some(&width) {
                    return Err(Error::InvalidConfig {
                        reason: format!(
                            "residual join '{}' (layer {i}) closes a block from layer {from}: a block starts before its \
                             join, nests inside the blocks around it, and keeps its input's width",
                            layer.name()
                        ),
                    });
                }
            }
            if open.len() > MAX_NESTING {
                return Err(Error::InvalidConfig {
                    reason: format!("residual blocks nested more than {MAX_NESTING} deep at layer {i}"),
                });
            }
            check_layer(layers, i)?;
            widths.push(width);
            let output = layer.output_size(width)?;
            let params = layer.param_shapes(width);
            let mut count = 0usize;
            for (k, p) in params.iter().enumerate() {
                let len = p.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
                count = match len.and_then(|len| count.checked_add(len)) {
                    Some(count) => count,
                    None => {
                        return Err(Error::InvalidConfig {
                            reason: format!(
                                "layer '{}': parameter '{}' of shape {:?} overflows the address space; check the \
                                 layer widths",
                                layer.name(),
                                p.name,
                                p.shape
                            ),
                        })
                    }
                };
                if params[..k].iter().any(|q| q.name == p.name) {
                    return Err(Error::InvalidConfig {
                        reason: format!(
                            "layer '{}' names two of its parameters '{}'; each needs a name of its own",
                            layer.name(),
                            p.name
                        ),
                    });
                }
            }
            total = total
                .checked_add(count)
                .filter(|&t| t.checked_mul(size_of::<f32>()).is_some_and(|b| b <= isize::MAX as usize))
                .ok_or_else(|| Error::InvalidConfig {
                    reason: "the network's parameters overflow the address space; check the layer widths".into(),
                })?;
            counts.push(count);
            shapes.push(params);
            width = output;
        }
        // The buckets of a network's own layout are never used: a data-parallel trainer
        // cuts its own (`Layout::new` with its bucket size).
        Ok(Params { widths, shapes, layout: Layout::new(&counts, usize::MAX), outputs: width, block_starts })
    }

    /// Where value `element` of layer `layer`'s region is: its parameter (by index) and
    /// the element within that parameter.
    pub(crate) fn param_of(&self, layer: usize, element: usize) -> (usize, usize) {
        let mut start = 0;
        for (k, p) in self.shapes.get(layer).into_iter().flatten().enumerate() {
            let len = p.len();
            if element < start + len {
                return (k, element - start);
            }
            start += len;
        }
        (0, element)
    }
}

/// Whether layer `i` may be where it is, and what it says of itself holds together: a
/// token embedding reads the network's token ids, so it is the first layer; a layer
/// whose output a step computes again in the backward pass
/// ([`Layer::rebuilt_in_backward`]) keeps nothing on a tape (its second forward pass
/// would overwrite it).
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming the layer.
pub(crate) fn check_layer(layers: &[Box<dyn Layer>], i: usize) -> Result<()> {
    if layers[i].rebuilt_in_backward() && !layers[i].tape().is_none() {
        return Err(Error::InvalidConfig {
            reason: format!(
                "layer '{}' is rebuilt in the backward pass (rebuilt_in_backward) and keeps a tape: its forward pass \
                 runs again before its backward pass and would overwrite the tape; keep one or the other",
                layers[i].name()
            ),
        });
    }
    if i > 0 && layers[i].reads_tokens() {
        return Err(Error::InvalidConfig {
            reason: format!(
                "token embedding '{}' is layer {i}: an embedding reads the network's token ids, so it is the first \
                 layer",
                layers[i].name()
            ),
        });
    }
    Ok(())
}
