//! A batch as the network takes it: [`Input`] and [`Labels`], their checks, what decides
//! an iteration's layouts (sequences and labels copied into standard layout, padding
//! zeroed) and the key of its plan, which must follow those decisions
//! ([`shape_key`]), and batches leased from a prefetcher.

use async_iter::Role;
use ndarray::{s, ArrayView1, ArrayView2, ArrayView3, Axis, Ix1, Ix2, Ix3, IxDyn, Slice, Zip};
use workspace_core::{freeze, Scope};

use crate::{Error, Result};

use super::super::finite;
use super::super::layer::{rows_of_steps, Activations};

/// A batch the network is fed: rows `[batch, features]`, or sequences `[batch, time,
/// features]` with their mask `[batch, time]` (1 where a step holds data, 0 for
/// padding; `None`: every step holds data), as DL4J's `DataSet` holds them in its
/// `RNNFormat.NWC` layout. (DL4J's default, NCW, is `[batch, features, time]`: pass
/// `x.permuted_axes([0, 2, 1])`; sequences in any layout are copied into standard
/// layout once per batch.)
///
/// Every method that takes a batch takes `impl Into<Input>`: a 2-D view, a 3-D view,
/// or a `(features, mask)` pair.
///
/// ```
/// use carve::nn::Input;
/// use carve::ndarray::{Array2, Array3};
///
/// let rows = Array2::<f32>::zeros((4, 3));
/// assert!(matches!(Input::from(rows.view()), Input::Flat(_)));
/// let (x, mask) = (Array3::<f32>::zeros((4, 7, 3)), Array2::<f32>::ones((4, 7)));
/// assert!(matches!(Input::from((x.view(), mask.view())), Input::Sequences { mask: Some(_), .. }));
/// ```
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    /// `[batch, features]`.
    Flat(ArrayView2<'a, f32>),
    /// `[batch, time, features]` and the mask `[batch, time]`.
    Sequences {
        /// The steps' features.
        features: ArrayView3<'a, f32>,
        /// 1 where a step holds data, 0 where it is padding.
        mask: Option<ArrayView2<'a, f32>>,
    },
    /// Token ids `[batch, time]` (each below the network's input width, its vocabulary)
    /// and the mask `[batch, time]`, for a network whose first layer is an
    /// [`Embedding`](crate::nn::Embedding).
    Tokens {
        /// Each step's token.
        ids: ArrayView2<'a, u32>,
        /// 1 where a step holds a token, 0 where it is padding.
        mask: Option<ArrayView2<'a, f32>>,
    },
}

impl<'a> Input<'a> {
    /// Token ids `[batch, time]` without a mask ([`Input::Tokens`]).
    pub fn tokens(ids: ArrayView2<'a, u32>) -> Input<'a> {
        Input::Tokens { ids, mask: None }
    }

    /// Examples in the batch.
    pub fn rows(&self) -> usize {
        match self {
            Input::Flat(x) => x.nrows(),
            Input::Sequences { features, .. } => features.shape()[0],
            Input::Tokens { ids, .. } => ids.nrows(),
        }
    }

    /// The same batch, borrowed for as long as `self` is.
    pub(crate) fn reborrow(&self) -> Input<'_> {
        match self {
            Input::Flat(x) => Input::Flat(x.view()),
            Input::Sequences { features, mask } => {
                Input::Sequences { features: features.view(), mask: mask.as_ref().map(|m| m.view()) }
            }
            Input::Tokens { ids, mask } => Input::Tokens { ids: ids.view(), mask: mask.as_ref().map(|m| m.view()) },
        }
    }

    /// The batch as the first layer's input.
    pub(crate) fn activations(&self) -> Activations<'a> {
        match *self {
            Input::Flat(x) => Activations::Flat(x),
            Input::Sequences { features, .. } => Activations::Sequence(features),
            // Not yet the first layer's input (see `standard_input`): its shape only.
            Input::Tokens { ids, .. } => Activations::Sequence(
                ArrayView3::from_shape((ids.nrows(), ids.ncols(), 0), &[]).expect("an empty view of any shape"),
            ),
        }
    }

    /// The mask (sequences only).
    pub(crate) fn mask(&self) -> Option<ArrayView2<'a, f32>> {
        match *self {
            Input::Flat(_) => None,
            Input::Sequences { mask, .. } | Input::Tokens { mask, .. } => mask,
        }
    }

    /// Rows `range` of the batch.
    pub(crate) fn rows_slice(&self, range: std::ops::Range<usize>) -> Input<'a> {
        use ndarray::s;
        match *self {
            Input::Flat(x) => Input::Flat(x.slice_move(s![range, ..])),
            Input::Sequences { features, mask } => Input::Sequences {
                features: features.slice_move(s![range.clone(), .., ..]),
                mask: mask.map(|m| m.slice_move(s![range, ..])),
            },
            Input::Tokens { ids, mask } => Input::Tokens {
                ids: ids.slice_move(s![range.clone(), ..]),
                mask: mask.map(|m| m.slice_move(s![range, ..])),
            },
        }
    }
}

impl<'a> From<ArrayView2<'a, f32>> for Input<'a> {
    fn from(x: ArrayView2<'a, f32>) -> Input<'a> {
        Input::Flat(x)
    }
}

impl<'a> From<ArrayView3<'a, f32>> for Input<'a> {
    fn from(features: ArrayView3<'a, f32>) -> Input<'a> {
        Input::Sequences { features, mask: None }
    }
}

impl<'a> From<(ArrayView3<'a, f32>, ArrayView2<'a, f32>)> for Input<'a> {
    fn from((features, mask): (ArrayView3<'a, f32>, ArrayView2<'a, f32>)) -> Input<'a> {
        Input::Sequences { features, mask: Some(mask) }
    }
}

impl<'a> From<(ArrayView3<'a, f32>, Option<ArrayView2<'a, f32>>)> for Input<'a> {
    fn from((features, mask): (ArrayView3<'a, f32>, Option<ArrayView2<'a, f32>>)) -> Input<'a> {
        Input::Sequences { features, mask }
    }
}

/// The labels of a batch: one class per example, or, for a network whose output is a
/// sequence (recurrent layers without a head), one class per example and step
/// `[batch, time]`, with a labels mask `[batch, time]` (1 where the step has a label;
/// `None`: the steps the features mask marks as data), as DL4J's `RnnOutputLayer`
/// takes them. The loss is then the mean over the labelled steps (DL4J divides by the
/// number of examples instead, so its gradients differ by the steps per example).
///
/// Every method that takes labels takes `impl Into<Labels>`: a 1-D view, a 2-D view,
/// or a `(labels, mask)` pair.
#[derive(Clone, Copy, Debug)]
pub enum Labels<'a> {
    /// `[batch]`.
    PerExample(ArrayView1<'a, u32>),
    /// `[batch, time]` and the mask `[batch, time]`.
    PerStep {
        /// The class of each example's step.
        labels: ArrayView2<'a, u32>,
        /// 1 where the step has a label, 0 where it does not.
        mask: Option<ArrayView2<'a, f32>>,
    },
}

impl<'a> From<ArrayView1<'a, u32>> for Labels<'a> {
    fn from(labels: ArrayView1<'a, u32>) -> Labels<'a> {
        Labels::PerExample(labels)
    }
}

impl<'a> From<ArrayView2<'a, u32>> for Labels<'a> {
    fn from(labels: ArrayView2<'a, u32>) -> Labels<'a> {
        Labels::PerStep { labels, mask: None }
    }
}

impl<'a> From<(ArrayView2<'a, u32>, ArrayView2<'a, f32>)> for Labels<'a> {
    fn from((labels, mask): (ArrayView2<'a, u32>, ArrayView2<'a, f32>)) -> Labels<'a> {
        Labels::PerStep { labels, mask: Some(mask) }
    }
}

impl<'a> From<(ArrayView2<'a, u32>, Option<ArrayView2<'a, f32>>)> for Labels<'a> {
    fn from((labels, mask): (ArrayView2<'a, u32>, Option<ArrayView2<'a, f32>>)) -> Labels<'a> {
        Labels::PerStep { labels, mask }
    }
}

impl<'a> Labels<'a> {
    /// Examples labelled.
    pub fn rows(&self) -> usize {
        match self {
            Labels::PerExample(y) => y.len(),
            Labels::PerStep { labels, .. } => labels.nrows(),
        }
    }

    /// Labels per step without a mask of their own take `mask` (the features mask: a
    /// padded step has no label), as DL4J hands the features mask to its output layer.
    pub fn or_mask(self, mask: Option<ArrayView2<'a, f32>>) -> Labels<'a> {
        match self {
            Labels::PerStep { labels, mask: None } => Labels::PerStep { labels, mask },
            other => other,
        }
    }

    /// The same labels, borrowed for as long as `self` is.
    pub(crate) fn reborrow(&self) -> Labels<'_> {
        match self {
            Labels::PerExample(y) => Labels::PerExample(y.view()),
            Labels::PerStep { labels, mask } => {
                Labels::PerStep { labels: labels.view(), mask: mask.as_ref().map(|m| m.view()) }
            }
        }
    }

    /// Rows `range`.
    pub(crate) fn rows_slice(&self, range: std::ops::Range<usize>) -> Labels<'a> {
        use ndarray::s;
        match *self {
            Labels::PerExample(y) => Labels::PerExample(y.slice_move(s![range])),
            Labels::PerStep { labels, mask } => Labels::PerStep {
                labels: labels.slice_move(s![range.clone(), ..]),
                mask: mask.map(|m| m.slice_move(s![range, ..])),
            },
        }
    }

    /// As one label per row of the loss's `[rows, classes]` input (example-major for
    /// per-step labels: row `b · time + t`), with the mask of those rows.
    pub(crate) fn flat(&self) -> Result<(ArrayView1<'a, u32>, Option<ArrayView1<'a, f32>>)> {
        match *self {
            Labels::PerExample(y) => Ok((y, None)),
            Labels::PerStep { labels, mask } => {
                let n = labels.len();
                let not_standard = || {
                    Error::InvalidInput("per-step labels and their mask must be in standard (row-major) layout".into())
                };
                let labels = labels.into_shape_with_order(n).map_err(|_| not_standard())?;
                let mask = mask.map(|m| m.into_shape_with_order(n).map_err(|_| not_standard())).transpose()?;
                Ok((labels, mask))
            }
        }
    }
}

/// Checks `labels` against the batch `x`: one per row, or per step of sequences with a
/// labels mask of their shape holding 0 and 1 only.
pub(crate) fn check_labels(x: &Input<'_>, labels: &Labels<'_>) -> Result<()> {
    match labels {
        Labels::PerExample(labels) => check_label_count(x.rows(), labels),
        Labels::PerStep { labels, mask } => {
            let steps = match x {
                Input::Sequences { features, .. } => (x.rows(), features.shape()[1]),
                Input::Tokens { ids, .. } => ids.dim(),
                Input::Flat(_) => {
                    return Err(Error::InvalidInput(
                        "labels per step [batch, time] need a batch of sequences [batch, time, features] or of \
                         token ids [batch, time]"
                            .into(),
                    ))
                }
            };
            if labels.dim() != steps {
                return Err(Error::ShapeMismatch {
                    context: "labels per step [batch, time]".to_string(),
                    expected: vec![steps.0, steps.1],
                    actual: labels.shape().to_vec(),
                });
            }
            match mask {
                Some(mask) => check_mask(mask, steps, "labels", "a step has a label and 0 where it has none"),
                None => Ok(()),
            }
        }
    }
}

/// Checks that the `what` mask is shaped `dims` (`[batch, time]`) and holds only 0 and
/// 1 (1 where `meaning`).
pub(super) fn check_mask(mask: &ArrayView2<'_, f32>, dims: (usize, usize), what: &str, meaning: &str) -> Result<()> {
    if mask.dim() != dims {
        return Err(Error::ShapeMismatch {
            context: format!("{what} mask [batch, time]"),
            expected: vec![dims.0, dims.1],
            actual: mask.shape().to_vec(),
        });
    }
    // A value repeated along an axis (a broadcast mask) is looked at once, at its first index.
    if let Some(((r, t), &v)) = finite::distinct(mask.view()).indexed_iter().find(|(_, &v)| v != 0.0 && v != 1.0) {
        return Err(Error::InvalidInput(format!(
            "the {what} mask holds {v} at sequence {r}, step {t}: a mask holds 1 where {meaning}"
        )));
    }
    Ok(())
}

/// One label per input row.
pub(super) fn check_label_count(rows: usize, labels: &ArrayView1<'_, u32>) -> Result<()> {
    if labels.len() != rows {
        return Err(Error::ShapeMismatch {
            context: "labels (one per input row)".to_string(),
            expected: vec![rows],
            actual: vec![labels.len()],
        });
    }
    Ok(())
}

/// The key of an iteration's plan: what decides which arrays it allocates (a hint;
/// replay verifies every step, so a collision only costs a recording). The shapes of
/// its batch, and of its labels when it trains; whether arrays not in standard layout
/// are copied first; and for masked sequences, which steps are padding in every
/// sequence, which a recurrent layer skips (two batches of one padded shape can differ
/// there, and would otherwise take each other's plans in turn).
pub(crate) fn shape_key(x: &Input<'_>, labels: Option<&Labels<'_>>) -> u64 {
    let mut key = 0xcbf2_9ce4_8422_2325_u64;
    let mut mix = |v: usize| {
        key ^= v as u64;
        key = key.wrapping_mul(0x0100_0000_01b3);
    };
    // Sequences not in standard layout are copied first (a flat batch is not), and so
    // are padded ones when training (`training_input`).
    let padded = labels.is_some()
        && match x {
            Input::Sequences { features, mask: Some(mask) } => padding_needs_zeroing(features, mask),
            _ => false,
        };
    let copied = matches!(x.activations(), Activations::Sequence(v) if !v.is_standard_layout()) || padded;
    x.activations().shape().iter().for_each(|&d| mix(d));
    mix(usize::from(copied));
    match x.mask() {
        None => mix(0),
        Some(mask) => {
            // Labels per step without a mask of their own take this one, copied when it
            // is not in standard layout.
            mix(2 + usize::from(mask.is_standard_layout()));
            // One bit per step: any sequence live there. 64 steps per word. (A value
            // repeated along an axis, as `broadcast` makes, is looked at once.)
            let (mut word, mut bits) = (0usize, 0);
            let distinct = finite::distinct(mask.view());
            // (A mask repeated along time gives one bit: the count tells it apart.)
            mix(distinct.ncols());
            for column in distinct.columns() {
                word = word << 1 | usize::from(finite::distinct(column).iter().any(|&v| v != 0.0));
                bits += 1;
                if bits == usize::BITS {
                    mix(word);
                    (word, bits) = (0, 0);
                }
            }
            mix(word);
        }
    }
    match labels {
        None => {}
        Some(Labels::PerExample(l)) => mix(l.len()),
        Some(Labels::PerStep { labels, mask }) => {
            labels.shape().iter().for_each(|&d| mix(d + 1));
            mix(usize::from(labels.is_standard_layout()));
            mix(2 + usize::from(mask.is_some()) + 2 * usize::from(mask.is_some_and(|m| !m.is_standard_layout())));
        }
    }
    key
}

/// The loss's input for `output` and `labels`: the output itself for one label per
/// example, or its steps as rows `[batch · time, classes]` for labels per step.
pub(crate) fn loss_input<'a>(output: Activations<'a>, labels: &Labels<'_>) -> Result<ArrayView2<'a, f32>> {
    match (output, labels) {
        (Activations::Flat(logits), Labels::PerExample(_)) => Ok(logits),
        (Activations::Sequence(_), Labels::PerExample(_)) => output.flat(NO_HEAD),
        (Activations::Sequence(logits), Labels::PerStep { .. }) => steps_as_rows(logits),
        (Activations::Flat(logits), Labels::PerStep { labels, .. }) => Err(Error::ShapeMismatch {
            context: "labels per step need an output per step: leave the head out of a network trained on them".into(),
            expected: vec![logits.nrows()],
            actual: labels.shape().to_vec(),
        }),
    }
}

/// `x` as a training step uses it: sequences in standard layout and with the steps
/// their mask marks as padding zeroed, copied into `scope` when either needs it (flat
/// batches are taken as they are). Nothing uses a padded step; zeroed, whatever the
/// caller left there (`f32::MAX`, NaN) gives finite values in every layer, and the
/// loss and gradients are exactly those of the zero-padded batch.
pub(crate) fn training_input<'s>(x: Input<'s>, scope: &'s Scope<'_>) -> Result<Input<'s>> {
    match x {
        Input::Sequences { features, mask: Some(mask) } if padding_needs_zeroing(&features, &mask) => {
            let mut copy = scope.copy_of(&features)?;
            for (mut sequence, live) in copy.outer_iter_mut().zip(mask.rows()) {
                for (mut step, &live) in sequence.outer_iter_mut().zip(live) {
                    if live == 0.0 {
                        step.fill(0.0);
                    }
                }
            }
            Ok(Input::Sequences { features: freeze(copy), mask: Some(mask) })
        }
        other => standard_input(other, scope),
    }
}

/// Whether a step that `mask` marks as padding holds anything but `+0.0` in
/// `features`: then the copy that zeroes it is needed (zeros, as most data sets pad with,
/// are used as they are). Looks at what the arrays' memory holds: an axis along which
/// both repeat (a broadcast) is looked at once.
fn padding_needs_zeroing(features: &ArrayView3<'_, f32>, mask: &ArrayView2<'_, f32>) -> bool {
    let (mut features, mut mask) = (features.view(), mask.view());
    if mask.dim() != (features.shape()[0], features.shape()[1]) {
        return false; // refused by the batch's checks
    }
    for axis in [Axis(0), Axis(1)] {
        if features.stride_of(axis) == 0 && mask.stride_of(axis) == 0 && features.len_of(axis) > 1 {
            features.slice_axis_inplace(axis, Slice::from(0..1));
            mask.slice_axis_inplace(axis, Slice::from(0..1));
        }
    }
    mask.indexed_iter().any(|((r, t), &live)| {
        live == 0.0 && finite::distinct(features.slice(s![r, t, ..])).iter().any(|v| v.to_bits() != 0)
    })
}

/// `x` with its sequences in standard layout: as it is, or copied into `scope` (flat
/// batches are taken in any layout).
pub(super) fn standard_input<'s>(x: Input<'s>, scope: &'s Scope<'_>) -> Result<Input<'s>> {
    Ok(match x {
        Input::Sequences { features, mask } if !features.is_standard_layout() => {
            Input::Sequences { features: freeze(scope.copy_of(&features)?), mask }
        }
        // Token ids reach the first layer as one feature per step, the id's value
        // (exact: the network's vocabulary holds at most 2²⁴ tokens, see `check_input`).
        Input::Tokens { ids, mask } => {
            let mut values = scope.zeros::<f32, _>((ids.nrows(), ids.ncols(), 1))?;
            Zip::from(values.index_axis_mut(Axis(2), 0)).and(&ids).for_each(|v, &id| *v = id as f32);
            Input::Sequences { features: freeze(values), mask }
        }
        other => other,
    })
}

/// `labels` with labels per step (and their mask) in standard layout: as they are, or
/// copied into `scope`.
pub(crate) fn standard_labels<'s>(labels: Labels<'s>, scope: &'s Scope<'_>) -> Result<Labels<'s>> {
    Ok(match labels {
        Labels::PerStep { labels, mask } => {
            let labels = if labels.is_standard_layout() { labels } else { freeze(scope.copy_of(&labels)?) };
            let mask = match mask {
                Some(m) if !m.is_standard_layout() => Some(freeze(scope.copy_of(&m)?)),
                other => other,
            };
            Labels::PerStep { labels, mask }
        }
        other => other,
    })
}

/// A sequence output `[batch, time, classes]` as rows `[batch · time, classes]`.
pub(super) fn steps_as_rows(logits: ArrayView3<'_, f32>) -> Result<ArrayView2<'_, f32>> {
    rows_of_steps(logits).ok_or_else(|| {
        Error::InvalidInput("the network's sequence output must be in standard (row-major) layout".into())
    })
}

/// The labels of a prefetched batch: `[batch]` of `u32`, or `[batch, time]` with the
/// batch's labels mask.
pub(crate) fn lease_labels<'b>(batch: &'b async_iter::Lease<'_>) -> Result<Labels<'b>> {
    let labels = batch.labels::<u32, IxDyn>()?;
    match labels.ndim() {
        // A label per example has no mask to weigh it by: a mask is refused rather than
        // trained on as if every row held an example.
        1 if batch.layout().has(Role::LabelsMask) => Err(Error::InvalidInput(
            "a prefetched batch has a labels mask over labels per example ([batch]): the network weighs labels by \
             a mask only per step ([batch, time]); leave the padded rows out of the batch instead"
                .into(),
        )),
        1 => Ok(Labels::PerExample(labels.into_dimensionality::<Ix1>().map_err(|_| dims(1))?)),
        2 => Ok(Labels::PerStep {
            labels: labels.into_dimensionality::<Ix2>().map_err(|_| dims(2))?,
            mask: batch.labels_mask::<f32, Ix2>()?,
        }),
        n => Err(Error::InvalidInput(format!(
            "a prefetched batch's labels have {n} dimensions: the network takes [batch] or [batch, time]"
        ))),
    }
}

/// The network's input from a prefetched batch: features `[batch, features]`, or
/// `[batch, time, features]` with the batch's features mask, of `f32`; or token ids
/// `[batch, time]` of `u32` with the batch's features mask (what
/// [`TokenWindows`](crate::async_iter::TokenWindows) gives).
pub(crate) fn lease_input<'b>(batch: &'b async_iter::Lease<'_>) -> Result<Input<'b>> {
    let masked = batch.layout().has(Role::FeaturesMask);
    if batch.layout().spec(Role::Features).is_some_and(|spec| spec.element() == async_iter::ElementType::of::<u32>()) {
        return Ok(Input::Tokens { ids: batch.features::<u32, Ix2>()?, mask: batch.features_mask::<f32, Ix2>()? });
    }
    let features = batch.features::<f32, IxDyn>()?;
    match features.ndim() {
        2 if masked => Err(Error::InvalidInput(
            "a prefetched batch has a features mask over flat features ([batch, features]): the network masks \
             steps of sequences ([batch, time, features]) only; leave the padded rows out of the batch instead"
                .into(),
        )),
        2 => Ok(Input::Flat(features.into_dimensionality::<Ix2>().map_err(|_| dims(2))?)),
        3 => Ok(Input::Sequences {
            features: features.into_dimensionality::<Ix3>().map_err(|_| dims(3))?,
            mask: batch.features_mask::<f32, Ix2>()?,
        }),
        n => Err(Error::InvalidInput(format!(
            "a prefetched batch's features have {n} dimensions: the network takes [batch, features] or [batch, \
             time, features]"
        ))),
    }
}

fn dims(n: usize) -> Error {
    Error::InvalidInput(format!("features of {n} dimensions could not be viewed as such"))
}

/// What the loss says when the last layer's output is still a batch of sequences.
pub(super) const NO_HEAD: &str = "the network's output (the loss takes one row per example: put a head such as \
                                  `last_step()` or `masked_mean()` after the recurrent layers, or give labels per \
                                  step)";
