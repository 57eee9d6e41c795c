//! `Network::fit` over an async-iter prefetcher: the same numbers as `fit_batch` on
//! the same batches (in every prefetcher and workspace mode), data errors as typed
//! `Error::Data` at their batch with the network left usable, and the epoch protocol
//! (fit resets the prefetcher after each epoch).

use carve::async_iter::{self, BatchLayout, BatchMut, BatchSource, InMemory, Prefetcher, SourceError, Threading};
use carve::nn::{Network, NetworkConfig, Updater};
use carve::{Error, WorkspaceMode};
use carve_rng::Rng;
use ndarray::{s, Array1, Array2, Ix1, Ix2};

fn data(rows: usize, seed: u64) -> (Array2<f32>, Array1<u32>) {
    let mut rng = Rng::new(seed);
    let y: Array1<u32> = (0..rows).map(|i| (i % 3) as u32).collect();
    let x = Array2::from_shape_fn((rows, 6), |(i, j)| (y[i] as f32 - 1.0) * (j % 2) as f32 + rng.uniform(-0.4, 0.4));
    (x, y)
}

fn network(mode: WorkspaceMode) -> Network {
    let config = NetworkConfig::builder(6)
        .dense(16)
        .relu()
        .dense(3)
        .seed(5)
        .updater(Updater::adam(1e-2))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

/// Epoch means of `fit` over a prefetcher, and of `fit_batch` over the same rows in
/// the same order, as bits.
fn epoch_means(mode: WorkspaceMode, threading: Threading, depth: usize) -> (Vec<u32>, Vec<u32>) {
    let (x, y) = data(70, 1); // batches of 16: 16, 16, 16, 16, 6
    let mut batches = Prefetcher::builder(InMemory::new(x.clone(), y.clone(), 16).unwrap())
        .workspace_mode(mode)
        .threading(threading)
        .depth(depth)
        .build()
        .unwrap();
    let (mut prefetched, mut direct) = (network(mode), network(mode));
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..6 {
        a.push(prefetched.fit(&mut batches).unwrap().to_bits());
        let mut sum = 0.0f64;
        for start in (0..70).step_by(16) {
            let end = (start + 16).min(70);
            sum += f64::from(direct.fit_batch(x.slice(s![start..end, ..]), y.slice(s![start..end])).unwrap());
        }
        b.push(((sum / 5.0) as f32).to_bits());
    }
    assert_eq!(prefetched.iterations(), 30);
    assert_eq!(batches.stats().batches_consumed, 30);
    (a, b)
}

#[test]
fn fit_over_a_prefetcher_trains_exactly_like_fit_batch() {
    let mut reference = None;
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::None] {
        for (threading, depth) in [(Threading::Background, 2), (Threading::Background, 1), (Threading::Shield, 2)] {
            let (prefetched, direct) = epoch_means(mode, threading, depth);
            assert_eq!(prefetched, direct, "{mode:?} {threading:?} depth {depth}");
            // Every mode gives the same numbers.
            assert_eq!(reference.get_or_insert_with(|| prefetched.clone()), &prefetched);
        }
    }
    let losses: Vec<f32> = reference.unwrap().into_iter().map(f32::from_bits).collect();
    assert!(losses[5] < losses[0] * 0.7, "it learned too little: {losses:?}");
}

#[test]
fn shuffled_epochs_see_every_row_once_and_the_ring_is_reused() {
    let (x, y) = data(100, 2);
    let mut batches = Prefetcher::builder(InMemory::new(x, y, 32).unwrap().shuffled(9)).build().unwrap();
    let mut net = network(WorkspaceMode::Enabled);
    let first = net.fit(&mut batches).unwrap();
    for _ in 0..30 {
        net.fit(&mut batches).unwrap();
    }
    let last = net.fit(&mut batches).unwrap();
    assert!(last < first * 0.5, "loss {first} -> {last}");
    let stats = batches.stats();
    assert_eq!(stats.batches_consumed, 32 * 4);
    assert_eq!(stats.epoch, 32); // fit reset it after each of its 32 epochs
    assert_eq!(stats.ring_growths, 0);
    assert_eq!(stats.ring_bytes, 3 * stats.first_batch_bytes);
}

/// Batches of 8 rows of 6 features; `fill` fails once, at `fail_at` of the first
/// epoch.
struct Flaky {
    fail_at: Option<usize>,
    batches: usize,
}

impl BatchSource for Flaky {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        Ok((index < self.batches).then(|| BatchLayout::new().features::<f32, _>((8, 6)).labels::<u32, _>(8)))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        if self.fail_at == Some(batch.index()) {
            self.fail_at = None;
            return Err("disk read failed".into());
        }
        let index = batch.index();
        batch.features::<f32, Ix2>()?.iter_mut().enumerate().for_each(|(i, v)| *v = ((i + index) % 5) as f32 * 0.1);
        batch.labels::<u32, Ix1>()?.iter_mut().enumerate().for_each(|(i, v)| *v = (i % 3) as u32);
        Ok(())
    }
}

#[test]
fn a_failing_source_is_a_data_error_at_its_batch_and_training_goes_on_after_reset() {
    for threading in [Threading::Background, Threading::Shield] {
        let source = Flaky { fail_at: Some(2), batches: 4 };
        let mut batches = Prefetcher::builder(source).threading(threading).build().unwrap();
        let mut net = network(WorkspaceMode::Enabled);
        let err = net.fit(&mut batches).unwrap_err();
        let Error::Data { source } = &err else { panic!("{threading:?}: not a data error: {err:?}") };
        match source.downcast_ref::<async_iter::Error>() {
            Some(async_iter::Error::Source { batch: 2, epoch: 0, .. }) => {}
            other => panic!("{threading:?}: {other:?}"),
        }
        let message = err.to_string();
        assert!(message.starts_with("training data: the batch source failed in `fill` for batch 2"), "{message}");
        assert!(message.contains("disk read failed"), "{message}");
        assert_eq!(net.iterations(), 2, "{threading:?}: the batches before the failure were trained");

        // The epoch ended at the failure: fit says so instead of training on nothing.
        let err = net.fit(&mut batches).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
        assert!(err.to_string().contains("no batches"), "{err}");

        batches.reset().unwrap();
        net.fit(&mut batches).unwrap();
        assert_eq!(net.iterations(), 6);
        net.fit(&mut batches).unwrap(); // fit reset it: the next epoch is ready
        assert_eq!(net.iterations(), 10);
    }
}

#[test]
fn batches_of_the_wrong_type_or_width_are_errors_and_nothing_is_trained() {
    let mut net = network(WorkspaceMode::Enabled);

    let wrong_type = InMemory::new(Array2::<f64>::zeros((10, 6)), Array1::<u32>::zeros(10), 5).unwrap();
    let mut batches = Prefetcher::builder(wrong_type).build().unwrap();
    let err = net.fit(&mut batches).unwrap_err();
    let Error::Data { source } = &err else { panic!("not a data error: {err:?}") };
    assert!(source.downcast_ref::<async_iter::Error>().is_some(), "{source:?}");
    assert!(err.to_string().contains("f64"), "{err}");

    let wrong_width = InMemory::new(Array2::<f32>::zeros((10, 7)), Array1::<u32>::zeros(10), 5).unwrap();
    let mut batches = Prefetcher::builder(wrong_width).build().unwrap();
    let err = net.fit(&mut batches).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");

    assert_eq!(net.iterations(), 0);
    let (x, y) = data(20, 3);
    let mut good = Prefetcher::builder(InMemory::new(x, y, 10).unwrap()).build().unwrap();
    net.fit(&mut good).unwrap();
    assert_eq!(net.iterations(), 2, "the network stays usable");
}

/// Flat batches with a mask of `role` over their rows.
struct Masked {
    role: async_iter::Role,
}

impl BatchSource for Masked {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        let layout = BatchLayout::new().features::<f32, _>((4, 6)).labels::<u32, _>(4);
        let layout = match self.role {
            async_iter::Role::LabelsMask => layout.labels_mask::<f32, _>(4),
            _ => layout.features_mask::<f32, _>(4),
        };
        Ok((index < 2).then_some(layout))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        batch.features::<f32, Ix2>()?.fill(0.5);
        batch.labels::<u32, Ix1>()?.fill(1);
        let mut mask = batch.array::<f32, Ix1>(self.role)?;
        mask.assign(&ndarray::arr1(&[1.0, 1.0, 0.0, 0.0]));
        Ok(())
    }
}

#[test]
fn a_mask_over_flat_rows_is_refused_rather_than_trained_on_as_if_every_row_counted() {
    for (role, named) in
        [(async_iter::Role::LabelsMask, "labels mask"), (async_iter::Role::FeaturesMask, "features mask")]
    {
        let mut net = network(WorkspaceMode::Enabled);
        let mut batches = Prefetcher::builder(Masked { role }).build().unwrap();
        let err = net.fit(&mut batches).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{role:?}: {err:?}");
        assert!(err.to_string().contains(named), "{err}");
        assert_eq!(net.iterations(), 0, "{role:?}: a masked batch was trained on");
        let mut batches = Prefetcher::builder(Masked { role }).build().unwrap();
        let err = net.evaluate_batches(&mut batches).unwrap_err();
        assert!(err.to_string().contains(named), "{err}");
    }
}
