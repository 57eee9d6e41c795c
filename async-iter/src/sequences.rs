//! A ready-made [`BatchSource`] for variable-length sequences held in memory: each
//! batch is padded only to its own longest sequence, with a mask.

use bytemuck::Pod;
use ndarray::{s, Array2, Ix1, Ix2, Ix3};

use crate::error::{Error, SourceError};
use crate::in_memory::shuffle;
use crate::layout::BatchLayout;
use crate::source::BatchSource;
use crate::view::BatchMut;

/// Batches of `batch_size` sequences (the last batch holds the rest), each sequence a
/// `(steps, features)` matrix of `TF` with one label of `TL`.
///
/// A batch holds, as DL4J lays out sequence data in its `RNNFormat.NWC` (time before
/// features; DL4J's default, NCW, puts features first):
///
/// - features `[batch, time, features]` of `TF`, where `time` is the longest sequence
///   *of this batch* (not of the data set), shorter sequences padded with zeros at the
///   end;
/// - a features mask `[batch, time]` of `f32`: 1 for a step that holds data, 0 for
///   padding;
/// - labels `[batch]` of `TL`.
///
/// So batches differ in size from one to the next, and a prefetch ring sized from the
/// first batch grows for a longer one (see the ring's docs).
///
/// With [`shuffled`](Self::shuffled) the sequences come in a new order every epoch
/// (from the seed and the epoch, so runs repeat). With [`bucketed`](Self::bucketed)
/// the shuffled order is cut into windows of a few batches, each window sorted by
/// length before it is cut into batches, so that sequences of similar lengths share a
/// batch and less of it is padding; the order of the batches is then shuffled too.
/// Epochs allocate nothing: the order lives in buffers that are rewritten in place.
///
/// ```
/// use async_iter::{Prefetcher, Sequences};
/// use ndarray::{Array2, Ix1, Ix2, Ix3};
///
/// // Three sequences of 2 features, 3, 1 and 2 steps long.
/// let seqs: Vec<Array2<f32>> = [3, 1, 2].iter().map(|&n| Array2::from_elem((n, 2), n as f32)).collect();
/// let mut batches = Prefetcher::builder(Sequences::new(seqs, vec![0_u32, 1, 2], 2)?).build()?;
/// let first = batches.next().unwrap()?;
/// let x = first.features::<f32, Ix3>()?;
/// assert_eq!(x.shape(), [2, 3, 2]); // padded to the batch's longest sequence, 3 steps
/// let mask = first.features_mask::<f32, Ix2>()?.unwrap();
/// assert_eq!(mask.row(1).to_vec(), [1.0, 0.0, 0.0]); // the second sequence has 1 step
/// drop(first);
/// let second = batches.next().unwrap()?;
/// assert_eq!(second.features::<f32, Ix3>()?.shape(), [1, 2, 2]); // a batch of its own length
/// assert_eq!(second.labels::<u32, Ix1>()?.to_vec(), [2]);
/// # Ok::<(), async_iter::Error>(())
/// ```
#[derive(Debug)]
pub struct Sequences<TF, TL> {
    sequences: Vec<Array2<TF>>,
    labels: Vec<TL>,
    features: usize,
    batch_size: usize,
    /// This epoch's order of the sequences (batch `i` is `order[i * batch_size..]`).
    order: Vec<usize>,
    /// The seed, when shuffled.
    seed: Option<u64>,
    /// Batches per sorted window, when bucketed.
    bucket: Option<usize>,
    /// Scratch for bucketing: the batch order of this epoch.
    batch_order: Vec<usize>,
    /// Scratch for bucketing: the sequence order before the batches are reordered.
    scratch: Vec<usize>,
    epoch: u64,
}

impl<TF: Pod, TL: Pod> Sequences<TF, TL> {
    /// The sequences (each `(steps, features)`, every one with the same number of
    /// features and at least one step) with one label each, in batches of
    /// `batch_size`, in the order given.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when there are no sequences, when the labels are not one
    /// per sequence, when a sequence has no steps, no features, or another number of
    /// features than the first, or when `batch_size` is 0.
    pub fn new(sequences: Vec<Array2<TF>>, labels: Vec<TL>, batch_size: usize) -> Result<Self, Error> {
        let invalid = |reason: String| Err(Error::InvalidConfig { reason });
        let Some(first) = sequences.first() else {
            return invalid("there are no sequences: there is nothing to batch".into());
        };
        if sequences.len() != labels.len() {
            let (n, l) = (sequences.len(), labels.len());
            return invalid(format!("there are {n} sequences but {l} labels; give one label per sequence"));
        }
        let features = first.ncols();
        for (i, seq) in sequences.iter().enumerate() {
            if seq.nrows() == 0 || seq.ncols() == 0 || seq.ncols() != features {
                return invalid(format!(
                    "sequence {i} has shape {:?} (steps, features): every sequence needs at least one step and \
                     the {features} features of the first",
                    seq.dim()
                ));
            }
        }
        if batch_size == 0 {
            return invalid("batch_size is 0; use at least 1".into());
        }
        let n = sequences.len();
        Ok(Sequences {
            sequences,
            labels,
            features,
            batch_size,
            order: (0..n).collect(),
            seed: None,
            bucket: None,
            batch_order: Vec::with_capacity(n.div_ceil(batch_size)),
            scratch: Vec::with_capacity(n),
            epoch: 0,
        })
    }

    /// Shuffles the sequences every epoch, starting with the first, from `seed`.
    pub fn shuffled(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self.arrange();
        self
    }

    /// Groups sequences of similar lengths: the epoch's order (shuffled, if
    /// [`shuffled`](Self::shuffled)) is cut into windows of `batches` batches, each
    /// window is sorted by length (stably) before it is cut into batches, and the
    /// batches are then put in a shuffled order (when shuffled). `batches` = 1 keeps
    /// every batch's members as without bucketing, only sorted; a window as large as
    /// the data set sorts all of it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when `batches` is 0.
    pub fn bucketed(mut self, batches: usize) -> Result<Self, Error> {
        if batches == 0 {
            return Err(Error::InvalidConfig { reason: "a bucket of 0 batches; use at least 1".into() });
        }
        self.bucket = Some(batches);
        self.arrange();
        Ok(self)
    }

    /// Batches per epoch.
    pub fn batches(&self) -> usize {
        self.sequences.len().div_ceil(self.batch_size)
    }

    /// Steps of the longest sequence.
    pub fn max_steps(&self) -> usize {
        self.sequences.iter().map(|s| s.nrows()).max().unwrap_or(0)
    }

    /// Features per step.
    pub fn features(&self) -> usize {
        self.features
    }

    /// The sequences of batch `index` of this epoch.
    fn members(&self, index: usize) -> &[usize] {
        let start = index.saturating_mul(self.batch_size).min(self.order.len());
        let end = start.saturating_add(self.batch_size).min(self.order.len());
        &self.order[start..end]
    }

    /// Writes this epoch's order: shuffled, then bucketed.
    fn arrange(&mut self) {
        self.order.iter_mut().enumerate().for_each(|(i, s)| *s = i);
        if let Some(seed) = self.seed {
            shuffle(&mut self.order, seed, self.epoch);
        }
        let Some(window) = self.bucket else { return };
        let window = window.saturating_mul(self.batch_size);
        let sequences = &self.sequences;
        for chunk in self.order.chunks_mut(window) {
            chunk.sort_by_key(|&i| sequences[i].nrows());
        }
        // The batches in a shuffled order (the last, possibly smaller, batch stays last
        // so that every batch but the last is full).
        let full = self.order.len() / self.batch_size;
        self.batch_order.clear();
        self.batch_order.extend(0..full);
        if let Some(seed) = self.seed {
            shuffle(&mut self.batch_order, seed ^ 0x5EED_B0C4_E75E_0000, self.epoch);
        }
        self.scratch.clear();
        for &b in &self.batch_order {
            self.scratch.extend_from_slice(&self.order[b * self.batch_size..(b + 1) * self.batch_size]);
        }
        self.scratch.extend_from_slice(&self.order[full * self.batch_size..]);
        std::mem::swap(&mut self.order, &mut self.scratch);
    }
}

impl<TF: Pod + Send, TL: Pod + Send> BatchSource for Sequences<TF, TL> {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        let members = self.members(index);
        if members.is_empty() {
            return Ok(None);
        }
        let steps = members.iter().map(|&i| self.sequences[i].nrows()).max().unwrap_or(0);
        let rows = members.len();
        Ok(Some(
            BatchLayout::new()
                .features::<TF, _>((rows, steps, self.features))
                .features_mask::<f32, _>((rows, steps))
                .labels::<TL, _>(rows),
        ))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        let mut features = batch.features::<TF, Ix3>()?;
        let mut mask = batch.features_mask::<f32, Ix2>()?;
        let mut labels = batch.labels::<TL, Ix1>()?;
        let members = self.members(batch.index());
        if members.len() != features.shape()[0] {
            return Err(format!(
                "batch {} has {} rows but the source's batch has {} sequences",
                batch.index(),
                features.shape()[0],
                members.len()
            )
            .into());
        }
        for (row, &i) in members.iter().enumerate() {
            let seq = &self.sequences[i];
            let steps = seq.nrows();
            features.slice_mut(s![row, ..steps, ..]).assign(seq);
            features.slice_mut(s![row, steps.., ..]).fill(TF::zeroed());
            mask.slice_mut(s![row, ..steps]).fill(1.0);
            mask.slice_mut(s![row, steps..]).fill(0.0);
            labels[row] = self.labels[i];
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<(), SourceError> {
        self.epoch += 1;
        if self.seed.is_some() {
            self.arrange();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Prefetcher;

    /// Sequence `i` has `lengths[i]` steps, every element `i`, and label `i`.
    fn data(lengths: &[usize]) -> (Vec<Array2<f32>>, Vec<u32>) {
        let seqs = lengths.iter().enumerate().map(|(i, &n)| Array2::from_elem((n, 3), i as f32)).collect();
        (seqs, (0..lengths.len() as u32).collect())
    }

    /// Per epoch, per batch: (labels, padded steps), after checking every row's data,
    /// padding and mask.
    fn batches_of(source: Sequences<f32, u32>, lengths: &[usize], epochs: usize) -> Vec<Vec<(Vec<u32>, usize)>> {
        let mut batches = Prefetcher::builder(source).build().unwrap();
        let mut out = Vec::new();
        for epoch in 0..epochs {
            if epoch > 0 {
                batches.reset().unwrap();
            }
            let mut seen = Vec::new();
            while let Some(batch) = batches.next() {
                let batch = batch.unwrap();
                let x = batch.features::<f32, Ix3>().unwrap();
                let mask = batch.features_mask::<f32, Ix2>().unwrap().expect("a mask");
                let y = batch.labels::<u32, Ix1>().unwrap();
                let steps = x.shape()[1];
                let longest = y.iter().map(|&l| lengths[l as usize]).max().unwrap();
                assert_eq!(steps, longest, "padded to the batch's own longest sequence");
                for (row, &label) in y.iter().enumerate() {
                    let n = lengths[label as usize];
                    for t in 0..steps {
                        let expected = if t < n { label as f32 } else { 0.0 };
                        assert!(x.slice(s![row, t, ..]).iter().all(|&v| v == expected), "row {row} step {t}");
                        assert_eq!(mask[[row, t]], if t < n { 1.0 } else { 0.0 }, "mask of row {row} step {t}");
                    }
                }
                seen.push((y.to_vec(), steps));
            }
            out.push(seen);
        }
        out
    }

    const LENGTHS: [usize; 11] = [7, 29, 12, 3, 9, 20, 4, 15, 8, 11, 26];

    #[test]
    fn each_batch_is_padded_to_its_own_longest_sequence_with_a_mask() {
        let (seqs, labels) = data(&LENGTHS);
        let epochs = batches_of(Sequences::new(seqs, labels, 4).unwrap(), &LENGTHS, 2);
        assert_eq!(
            epochs[0],
            [(vec![0, 1, 2, 3], 29), (vec![4, 5, 6, 7], 20), (vec![8, 9, 10], 26)],
            "in order, the last batch smaller"
        );
        assert_eq!(epochs[1], epochs[0]);
    }

    #[test]
    fn shuffled_and_bucketed_epochs_cover_every_sequence_once_and_repeat_with_the_seed() {
        let lengths: Vec<usize> = (0..60).map(|i| 7 + (i * 13) % 23).collect();
        let run = |bucket: Option<usize>| {
            let (seqs, labels) = data(&lengths);
            let source = Sequences::new(seqs, labels, 8).unwrap().shuffled(5);
            let source = match bucket {
                Some(b) => source.bucketed(b).unwrap(),
                None => source,
            };
            batches_of(source, &lengths, 3)
        };
        let plain = run(None);
        assert_eq!(plain, run(None), "the same seed gives the same epochs");
        assert_ne!(plain[0], plain[1], "every epoch has its own order");
        let bucketed = run(Some(4));
        assert_eq!(bucketed, run(Some(4)));
        for epoch in plain.iter().chain(&bucketed) {
            let mut all: Vec<u32> = epoch.iter().flat_map(|(labels, _)| labels.clone()).collect();
            all.sort_unstable();
            assert_eq!(all, (0..60).collect::<Vec<u32>>(), "each sequence once per epoch");
            assert_eq!(epoch.last().unwrap().0.len(), 4, "only the last batch is smaller");
        }
        // Bucketing pads less.
        let padding = |epoch: &Vec<(Vec<u32>, usize)>| -> usize {
            epoch.iter().map(|(labels, steps)| labels.iter().map(|&l| steps - lengths[l as usize]).sum::<usize>()).sum()
        };
        for (p, b) in plain.iter().zip(&bucketed) {
            assert!(padding(b) * 2 < padding(p), "bucketed padding {} against {}", padding(b), padding(p));
        }
    }

    #[test]
    fn inconsistent_data_is_an_error() {
        let bad = |seqs: Vec<Array2<f32>>, labels: Vec<u32>, batch: usize| {
            matches!(Sequences::new(seqs, labels, batch), Err(Error::InvalidConfig { .. }))
        };
        assert!(bad(vec![], vec![], 2));
        assert!(bad(vec![Array2::zeros((3, 2))], vec![0, 1], 2));
        assert!(bad(vec![Array2::zeros((3, 2)), Array2::zeros((0, 2))], vec![0, 1], 2));
        assert!(bad(vec![Array2::zeros((3, 2)), Array2::zeros((3, 4))], vec![0, 1], 2));
        assert!(bad(vec![Array2::zeros((3, 2))], vec![0], 0));
        let ok = Sequences::new(vec![Array2::<f32>::zeros((3, 2))], vec![0_u32], 1).unwrap();
        assert!(matches!(ok.bucketed(0), Err(Error::InvalidConfig { .. })));
    }
}
