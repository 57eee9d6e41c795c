//! A ready-made [`BatchSource`] for language models: random windows of a token stream,
//! each with the stream shifted by one as its targets.

use std::sync::Arc;

use carve_rng::Rng;
use ndarray::{ArrayView1, Ix2};

use crate::error::{Error, SourceError};
use crate::layout::BatchLayout;
use crate::source::BatchSource;
use crate::view::BatchMut;

/// Batches of `batch` windows of `context` tokens drawn at random from a token stream
/// (nanoGPT's `get_batch`): features `[batch, context]` of token ids (`u32`) and labels
/// `[batch, context]`, the same windows one token later (each step's next token).
///
/// A window starts anywhere from 0 to `len − context − 1`, uniformly. The starts of
/// batch `i` depend on the seed, the epoch and `i` alone (xoshiro256** seeded from the
/// three), so a run repeats, a batch can be rebuilt without the ones before it, and
/// [`fixed`](Self::fixed) gives the same batches every epoch (a validation set of fixed
/// batches). The stream is shared (`Arc`), never copied: the windows are copied into
/// the ring, and epochs allocate nothing.
///
/// ```
/// use async_iter::{Prefetcher, TokenWindows};
/// use ndarray::Ix2;
///
/// let tokens: Vec<u32> = (0..1000).collect();
/// let source = TokenWindows::new(tokens, 8, 4, 3)?.seeded(7);
/// let mut batches = Prefetcher::builder(source).build()?;
/// let mut count = 0;
/// while let Some(batch) = batches.next() {
///     let batch = batch?;
///     let (x, y) = (batch.features::<u32, Ix2>()?, batch.labels::<u32, Ix2>()?);
///     assert_eq!(x.dim(), (4, 8));
///     // Each target is the token after its input.
///     assert!(x.iter().zip(y.iter()).all(|(&t, &next)| next == t + 1));
///     count += 1;
/// }
/// assert_eq!(count, 3);
/// # Ok::<(), async_iter::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct TokenWindows {
    tokens: Arc<[u32]>,
    context: usize,
    batch: usize,
    batches: usize,
    seed: u64,
    epoch: u64,
    fixed: bool,
}

impl TokenWindows {
    /// `batches` batches per epoch of `batch` windows of `context` tokens of `tokens`,
    /// seeded with 0.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when `context`, `batch` or `batches` is 0, when the
    /// stream is not longer than `context` (a window and its targets need `context + 1`
    /// tokens), or when a batch's `batch × context` tokens overflow.
    pub fn new(tokens: impl Into<Arc<[u32]>>, context: usize, batch: usize, batches: usize) -> Result<Self, Error> {
        let tokens = tokens.into();
        let invalid = |reason: String| Err(Error::InvalidConfig { reason });
        if context == 0 || batch == 0 || batches == 0 {
            return invalid(format!(
                "token windows of context {context}, batch {batch}, {batches} batches per epoch: each must be at least 1"
            ));
        }
        if tokens.len() <= context {
            return invalid(format!(
                "a stream of {} tokens has no window of {context} tokens and its next tokens (it needs at least {})",
                tokens.len(),
                context.saturating_add(1)
            ));
        }
        if batch.checked_mul(context).is_none() {
            return invalid(format!("a batch of {batch} windows of {context} tokens overflows"));
        }
        Ok(TokenWindows { tokens, context, batch, batches, seed: 0, epoch: 0, fixed: false })
    }

    /// Draws the windows from `seed`.
    pub fn seeded(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The same batches every epoch (the epoch is not mixed into the draws): a fixed
    /// validation set.
    pub fn fixed(mut self) -> Self {
        self.fixed = true;
        self
    }

    /// Batches per epoch.
    pub fn batches(&self) -> usize {
        self.batches
    }

    /// The starts of batch `index`'s windows in this epoch, in row order.
    pub fn starts(&self, index: usize) -> impl Iterator<Item = usize> + '_ {
        let epoch = if self.fixed { 0 } else { self.epoch };
        // Three words into one seed, each through a different odd multiplier: batches of
        // other epochs or seeds draw from unrelated streams.
        let key = self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ epoch.wrapping_mul(0xA076_1D64_78BD_642F)
            ^ (index as u64).wrapping_mul(0xE703_7ED1_A0B4_28DB);
        let mut rng = Rng::new(key);
        let span = self.tokens.len() - self.context;
        (0..self.batch).map(move |_| rng.below(span))
    }
}

impl BatchSource for TokenWindows {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        let shape = (self.batch, self.context);
        Ok((index < self.batches).then(|| BatchLayout::new().features::<u32, _>(shape).labels::<u32, _>(shape)))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        let index = batch.index();
        let context = self.context;
        {
            let mut x = batch.features::<u32, Ix2>()?;
            for (row, start) in self.starts(index).enumerate() {
                x.row_mut(row).assign(&ArrayView1::from(&self.tokens[start..start + context]));
            }
        }
        let mut y = batch.labels::<u32, Ix2>()?;
        for (row, start) in self.starts(index).enumerate() {
            y.row_mut(row).assign(&ArrayView1::from(&self.tokens[start + 1..start + 1 + context]));
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<(), SourceError> {
        self.epoch += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Prefetcher;

    /// Every epoch's batches as (inputs, targets) rows.
    fn draw(source: TokenWindows, epochs: usize) -> Vec<Vec<(Vec<u32>, Vec<u32>)>> {
        let mut batches = Prefetcher::builder(source).build().unwrap();
        let mut out = Vec::new();
        for epoch in 0..epochs {
            if epoch > 0 {
                batches.reset().unwrap();
            }
            let mut rows = Vec::new();
            while let Some(batch) = batches.next() {
                let batch = batch.unwrap();
                let (x, y) = (batch.features::<u32, Ix2>().unwrap(), batch.labels::<u32, Ix2>().unwrap());
                for (x, y) in x.rows().into_iter().zip(y.rows()) {
                    rows.push((x.to_vec(), y.to_vec()));
                }
            }
            out.push(rows);
        }
        out
    }

    #[test]
    fn windows_are_the_stream_and_their_targets_the_next_tokens() {
        // A stream whose tokens name their positions: a window is found by its first.
        let tokens: Vec<u32> = (0..500).map(|i| i * 3).collect();
        let epochs = draw(TokenWindows::new(tokens.clone(), 16, 5, 4).unwrap().seeded(1), 1);
        assert_eq!(epochs[0].len(), 20);
        for (x, y) in &epochs[0] {
            let start = (x[0] / 3) as usize;
            assert!(start + 16 < tokens.len(), "a window's targets stay in the stream");
            assert_eq!(x[..], tokens[start..start + 16]);
            assert_eq!(y[..], tokens[start + 1..start + 17]);
        }
    }

    #[test]
    fn draws_repeat_with_the_seed_differ_by_epoch_and_fixed_repeats_every_epoch() {
        let tokens: Vec<u32> = (0..10_000).collect();
        let a = draw(TokenWindows::new(tokens.clone(), 8, 4, 3).unwrap().seeded(5), 2);
        let b = draw(TokenWindows::new(tokens.clone(), 8, 4, 3).unwrap().seeded(5), 2);
        let c = draw(TokenWindows::new(tokens.clone(), 8, 4, 3).unwrap().seeded(6), 1);
        assert_eq!(a, b, "the same seed, the same batches");
        assert_ne!(a[0], a[1], "each epoch draws anew");
        assert_ne!(a[0], c[0], "another seed draws other windows");
        let fixed = draw(TokenWindows::new(tokens, 8, 4, 3).unwrap().seeded(5).fixed(), 3);
        assert_eq!((&fixed[0], &fixed[0]), (&fixed[1], &fixed[2]), "fixed batches repeat");
        assert_eq!(fixed[0], a[0], "the first epoch is the same either way");
    }

    #[test]
    fn every_start_is_drawn_including_the_last() {
        // 3 possible starts: 0, 1, 2 (a stream of 5, windows of 2 and their targets).
        let source = TokenWindows::new(vec![0, 1, 2, 3, 4], 2, 50, 1).unwrap();
        let starts: std::collections::BTreeSet<usize> = source.starts(0).collect();
        assert_eq!(starts.into_iter().collect::<Vec<_>>(), [0, 1, 2]);
    }

    #[test]
    fn shapes_that_cannot_be_drawn_are_errors() {
        let bad = |tokens: Vec<u32>, context, batch, batches| {
            matches!(TokenWindows::new(tokens, context, batch, batches), Err(Error::InvalidConfig { .. }))
        };
        assert!(bad(vec![1, 2, 3], 3, 1, 1), "no room for the targets");
        assert!(bad(vec![], 1, 1, 1));
        assert!(bad(vec![1, 2, 3], 0, 1, 1));
        assert!(bad(vec![1, 2, 3], 1, 0, 1));
        assert!(bad(vec![1, 2, 3], 1, 1, 0));
        assert!(bad(vec![1, 2, 3], 2, usize::MAX, 1));
        assert!(TokenWindows::new(vec![1, 2, 3], 2, 1, 1).is_ok());
    }
}
