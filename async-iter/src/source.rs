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
/// batches before it. A source should not block forever: the producer checks for a
/// stop request between batches, so dropping the prefetcher waits for the call in
/// progress to return.
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
    /// # Errors
    ///
    /// Any error; `reset` returns it and the new epoch does not start.
    fn reset(&mut self) -> Result<(), SourceError> {
        Ok(())
    }
}
