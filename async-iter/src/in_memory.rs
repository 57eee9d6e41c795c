//! A ready-made [`BatchSource`] for data sets held in memory: a features matrix and a
//! labels vector, cut into batches of rows, in order or shuffled every epoch.

use bytemuck::Pod;
use ndarray::{s, Array1, Array2, Ix1, Ix2};

use crate::error::{Error, SourceError};
use crate::layout::BatchLayout;
use crate::source::BatchSource;
use crate::view::BatchMut;

/// Batches of `batch_size` rows of an in-memory data set (the last batch holds the
/// rest): features `(rows, columns)` of `TF` and labels `(rows,)` of `TL`, copied into
/// the ring row by row.
///
/// With [`shuffled`](Self::shuffled) the rows come in a new order every epoch (a
/// Fisher–Yates shuffle driven by the seed and the epoch, so runs repeat); the order
/// is kept in one buffer that is reshuffled in place, so epochs allocate nothing.
///
/// ```
/// use async_iter::{InMemory, Prefetcher};
/// use ndarray::{Array1, Array2, Ix1, Ix2};
///
/// let x = Array2::from_shape_fn((10, 3), |(r, _)| r as f32);
/// let y = Array1::from_iter(0..10_u32);
/// let source = InMemory::new(x, y, 4)?.shuffled(7);
/// let mut batches = Prefetcher::builder(source).build()?;
/// let mut seen = Vec::new();
/// while let Some(batch) = batches.next() {
///     let batch = batch?;
///     let (x, y) = (batch.features::<f32, Ix2>()?, batch.labels::<u32, Ix1>()?);
///     assert!(x.rows().into_iter().zip(y).all(|(row, &label)| row[0] == label as f32));
///     seen.extend(y.iter().copied());
/// }
/// assert_eq!(seen.len(), 10); // 4 + 4 + 2 rows
/// seen.sort_unstable();
/// assert_eq!(seen, (0..10).collect::<Vec<_>>()); // every row once
/// # Ok::<(), async_iter::Error>(())
/// ```
#[derive(Debug)]
pub struct InMemory<TF, TL> {
    features: Array2<TF>,
    labels: Array1<TL>,
    batch_size: usize,
    /// The seed and this epoch's row order, when shuffled.
    shuffle: Option<(u64, Vec<usize>)>,
    epoch: u64,
}

impl<TF: Pod, TL: Pod> InMemory<TF, TL> {
    /// The data set, in batches of `batch_size` rows, in row order.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when features and labels have different numbers of
    /// rows, when there are no rows or no columns, or when `batch_size` is 0.
    pub fn new(features: Array2<TF>, labels: Array1<TL>, batch_size: usize) -> Result<Self, Error> {
        let invalid = |reason: String| Err(Error::InvalidConfig { reason });
        if features.nrows() != labels.len() {
            let (rows, labels) = (features.nrows(), labels.len());
            return invalid(format!("the features have {rows} rows but there are {labels} labels; give one per row"));
        }
        if features.is_empty() {
            return invalid(format!("the features have shape {:?}: there is nothing to batch", features.dim()));
        }
        if batch_size == 0 {
            return invalid("batch_size is 0; use at least 1".into());
        }
        Ok(InMemory { features, labels, batch_size, shuffle: None, epoch: 0 })
    }

    /// Shuffles the rows every epoch, starting with the first, from `seed`.
    pub fn shuffled(mut self, seed: u64) -> Self {
        let mut order: Vec<usize> = (0..self.features.nrows()).collect();
        shuffle(&mut order, seed, self.epoch);
        self.shuffle = Some((seed, order));
        self
    }

    /// Batches per epoch.
    pub fn batches(&self) -> usize {
        self.features.nrows().div_ceil(self.batch_size)
    }
}

impl<TF: Pod + Send, TL: Pod + Send> BatchSource for InMemory<TF, TL> {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        let start = index.saturating_mul(self.batch_size);
        let rows = self.batch_size.min(self.features.nrows().saturating_sub(start));
        let columns = self.features.ncols();
        Ok((rows > 0).then(|| BatchLayout::new().features::<TF, _>((rows, columns)).labels::<TL, _>(rows)))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        let start = batch.index() * self.batch_size;
        let mut features = batch.features::<TF, Ix2>()?;
        let mut labels = batch.labels::<TL, Ix1>()?;
        let end = start + features.nrows();
        match &self.shuffle {
            None => {
                features.assign(&self.features.slice(s![start..end, ..]));
                labels.assign(&self.labels.slice(s![start..end]));
            }
            Some((_, order)) => {
                for (i, &row) in order[start..end].iter().enumerate() {
                    features.row_mut(i).assign(&self.features.row(row));
                    labels[i] = self.labels[row];
                }
            }
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<(), SourceError> {
        self.epoch += 1;
        if let Some((seed, order)) = &mut self.shuffle {
            // Each epoch's order depends on the seed and the epoch alone.
            order.iter_mut().enumerate().for_each(|(i, row)| *row = i);
            shuffle(order, *seed, self.epoch);
        }
        Ok(())
    }
}

/// Fisher–Yates, driven by splitmix64 of the seed and the epoch.
pub(crate) fn shuffle(order: &mut [usize], seed: u64, epoch: u64) {
    let mut state = seed ^ epoch.wrapping_mul(0xA076_1D64_78BD_642F);
    for i in (1..order.len()).rev() {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let j = (z % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Prefetcher;

    fn rows_of(source: InMemory<u16, u16>, epochs: usize) -> Vec<Vec<u16>> {
        let mut batches = Prefetcher::builder(source).build().unwrap();
        let mut out = Vec::new();
        for epoch in 0..epochs {
            if epoch > 0 {
                batches.reset().unwrap();
            }
            let mut labels = Vec::new();
            while let Some(batch) = batches.next() {
                let batch = batch.unwrap();
                let x = batch.features::<u16, Ix2>().unwrap();
                let y = batch.labels::<u16, Ix1>().unwrap();
                for (row, &label) in x.rows().into_iter().zip(y) {
                    assert_eq!(row.to_vec(), [label, label * 10], "features and labels travel together");
                }
                labels.extend(y.iter().copied());
            }
            out.push(labels);
        }
        out
    }

    fn data(n: u16) -> (Array2<u16>, Array1<u16>) {
        (Array2::from_shape_fn((n as usize, 2), |(r, c)| r as u16 * (1 + 9 * c as u16)), Array1::from_iter(0..n))
    }

    #[test]
    fn in_order_batches_cover_the_rows_with_a_smaller_last_batch() {
        let (x, y) = data(11);
        let source = InMemory::new(x, y, 4).unwrap();
        assert_eq!(source.batches(), 3);
        let epochs = rows_of(source, 2);
        assert_eq!(epochs[0], (0..11).collect::<Vec<_>>());
        assert_eq!(epochs[1], epochs[0]);
    }

    #[test]
    fn shuffled_epochs_differ_and_repeat_with_the_seed() {
        let (x, y) = data(50);
        let a = rows_of(InMemory::new(x.clone(), y.clone(), 8).unwrap().shuffled(3), 3);
        let b = rows_of(InMemory::new(x, y, 8).unwrap().shuffled(3), 3);
        assert_eq!(a, b, "the same seed gives the same orders");
        assert_ne!(a[0], a[1], "every epoch has its own order");
        assert_ne!(a[0], (0..50).collect::<Vec<_>>());
        for epoch in a {
            let mut sorted = epoch.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..50).collect::<Vec<_>>(), "each row once per epoch");
        }
    }

    #[test]
    fn inconsistent_data_is_an_error() {
        let (x, _) = data(4);
        assert!(matches!(InMemory::new(x.clone(), Array1::<u16>::zeros(3), 2), Err(Error::InvalidConfig { .. })));
        assert!(matches!(InMemory::new(x, Array1::<u16>::zeros(4), 0), Err(Error::InvalidConfig { .. })));
        let empty = InMemory::new(Array2::<u16>::zeros((0, 2)), Array1::<u16>::zeros(0), 2);
        assert!(matches!(empty, Err(Error::InvalidConfig { .. })));
    }
}
