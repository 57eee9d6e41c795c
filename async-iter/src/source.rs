//! The trait a user implements to produce batches.

use crate::error::SourceError;
use crate::layout::BatchLayout;
use crate::view::BatchMut;

/// A source of batches: describes each batch, then fills it in place.
///
/// The prefetcher calls the source from its producer thread (or, in shield mode,
/// from the consumer's `next()`), one batch at a time and in order:
/// [`next_layout`](Self::next_layout) for batch `i`, then [`fill`](Self::fill) with
/// the space carved for it from the ring; `next_layout` returning `Ok(None)` ends the
/// epoch. [`reset`](Self::reset) rewinds the source for the next epoch.
///
/// Errors and panics in any of these calls are caught and reach the consumer as an
/// [`Error`](crate::Error) from `next()` at the batch where they happened, after the
/// batches before it (a panic payload whose destructor panics too included). A source
/// should not block for long: the producer checks for a stop request between calls, so
/// stopping, resetting and dropping the prefetcher wait for the call in progress, for
/// at most the [`join_timeout`](crate::PrefetcherBuilder::join_timeout). A source still
/// inside a call then makes `stop` and `reset` fail with
/// [`Error::SourceStuck`](crate::Error::SourceStuck), and is left to finish on its
/// detached thread (see [`Prefetcher`](crate::Prefetcher)).
///
/// The prefetcher trusts nothing a source returns for memory safety: every layout is
/// checked and laid out by the prefetcher itself, and the views of [`BatchMut`] are
/// typed and bounded by that layout, so a wrong implementation gives wrong data or an
/// error, never undefined behaviour.
///
/// # Example
///
/// Batches of 32 rows from an in-memory data set; the last one is smaller.
///
/// ```
/// use async_iter::{BatchLayout, BatchMut, BatchSource, Prefetcher, SourceError};
/// use ndarray::{s, Array1, Array2, Ix1, Ix2};
///
/// struct Rows {
///     x: Array2<f32>,
///     y: Array1<u32>,
///     batch: usize,
/// }
///
/// impl BatchSource for Rows {
///     fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
///         let start = index * self.batch;
///         let rows = self.batch.min(self.x.nrows().saturating_sub(start));
///         Ok((rows > 0).then(|| BatchLayout::new().features::<f32, _>((rows, self.x.ncols())).labels::<u32, _>(rows)))
///     }
///
///     fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
///         let start = batch.index() * self.batch;
///         let mut x = batch.features::<f32, Ix2>()?;
///         let end = start + x.nrows();
///         x.assign(&self.x.slice(s![start..end, ..]));
///         batch.labels::<u32, Ix1>()?.assign(&self.y.slice(s![start..end]));
///         Ok(())
///     }
/// }
///
/// let source = Rows { x: Array2::ones((100, 8)), y: Array1::zeros(100), batch: 32 };
/// let mut batches = Prefetcher::builder(source).build()?;
/// let mut rows = Vec::new();
/// while let Some(batch) = batches.next() {
///     rows.push(batch?.features::<f32, Ix2>()?.nrows());
/// }
/// assert_eq!(rows, [32, 32, 32, 4]);
/// # Ok::<(), async_iter::Error>(())
/// ```
///
/// Sequences of varying length, padded to the longest of each batch, with a features
/// mask that marks the real steps. Batches differ in shape from one to the next; a
/// batch larger than the ring's slots grows the ring once, and headroom avoids even
/// that for batches up to `1 + headroom` times the first.
///
/// ```
/// use async_iter::{BatchLayout, BatchMut, BatchSource, Prefetcher, SourceError};
/// use ndarray::{s, Ix1, Ix2};
///
/// struct Sequences {
///     lengths: Vec<Vec<usize>>, // per batch, the length of each sequence
/// }
///
/// impl BatchSource for Sequences {
///     fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
///         let Some(lengths) = self.lengths.get(index) else { return Ok(None) };
///         let steps = lengths.iter().copied().max().unwrap_or(1);
///         let layout = BatchLayout::new()
///             .features::<u16, _>((lengths.len(), steps)) // token ids, padded with 0
///             .features_mask::<u8, _>((lengths.len(), steps)) // 1 where a token is real
///             .labels::<u8, _>(lengths.len());
///         Ok(Some(layout))
///     }
///
///     fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
///         let lengths = &self.lengths[batch.index()];
///         let mut tokens = batch.features::<u16, Ix2>()?;
///         let mut mask = batch.features_mask::<u8, Ix2>()?;
///         for (row, &len) in lengths.iter().enumerate() {
///             tokens.slice_mut(s![row, ..len]).fill(7); // padding stays 0: arrays start zeroed
///             mask.slice_mut(s![row, ..len]).fill(1);
///         }
///         batch.labels::<u8, Ix1>()?.fill(1);
///         Ok(())
///     }
/// }
///
/// let lengths = vec![vec![3, 5], vec![2, 2, 4], vec![9]];
/// let mut batches = Prefetcher::builder(Sequences { lengths }).headroom(0.5).build()?;
/// let mut real_steps = Vec::new();
/// while let Some(batch) = batches.next() {
///     let batch = batch?;
///     let mask = batch.features_mask::<u8, Ix2>()?.expect("every batch has a mask");
///     real_steps.push(mask.iter().map(|&m| m as usize).sum::<usize>());
/// }
/// assert_eq!(real_steps, [8, 8, 9]);
/// # Ok::<(), async_iter::Error>(())
/// ```
pub trait BatchSource: Send + 'static {
    /// Describes batch `index` of the epoch (0 for the first), or `Ok(None)` when the
    /// epoch has no more batches.
    ///
    /// # Errors
    ///
    /// Any error; it ends the epoch and reaches the consumer at batch `index`.
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError>;

    /// Fills the batch just described. Its arrays start zeroed; see [`BatchMut`].
    ///
    /// # Errors
    ///
    /// Any error; it ends the epoch and reaches the consumer at this batch.
    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError>;

    /// Rewinds to the first batch, for a new epoch (called by
    /// [`Prefetcher::reset`](crate::Prefetcher::reset)). The default does nothing,
    /// for sources that restart from the batch index alone.
    ///
    /// It runs inside `Prefetcher::reset`, on the caller's thread, once the producer
    /// thread of the last epoch has ended: a `reset` that blocks blocks that call.
    ///
    /// # Errors
    ///
    /// Any error; `reset` returns it and the new epoch does not start.
    fn reset(&mut self) -> Result<(), SourceError> {
        Ok(())
    }
}
