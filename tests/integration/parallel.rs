//! Data-parallel training: determinism across runs and between threads and the
//! single-thread shard mode, agreement with plain training, faults.

use carve::ndarray::{Array1, Array2, Array3};
use carve::nn::{parallel::DataParallel, parallel::ParallelConfig, Network, NetworkConfig, Updater};
use carve::{Error, WorkspaceMode};

fn data(rows: usize, cols: usize, classes: u32) -> (Array2<f32>, Array1<u32>) {
    let x = Array2::from_shape_fn((rows, cols), |(r, c)| (((r * 31 + c * 17) % 23) as f32 / 23.0) - 0.4);
    let y = Array1::from_shape_fn(rows, |r| ((r * 7 + r / 3) % classes as usize) as u32);
    (x, y)
}

fn mlp(updater: Updater) -> NetworkConfig {
    NetworkConfig::builder(12).dense(32).relu().dense(16).relu().dense(4).seed(11).updater(updater).build().unwrap()
}

fn losses(config: ParallelConfig, updater: Updater, steps: usize) -> Vec<u32> {
    let (x, y) = data(50, 12, 4);
    let mut trainer = DataParallel::new(Network::new(mlp(updater)).unwrap(), config).unwrap();
    (0..steps).map(|_| trainer.fit_batch(x.view(), y.view()).unwrap().to_bits()).collect()
}

#[test]
fn threads_give_the_same_bits_as_the_single_thread_shard_mode_and_on_every_run() {
    for updater in [Updater::adam(0.01), Updater::sgd(0.1, 0.9), Updater::adamw(0.01, 0.1)] {
        for workers in [1, 2, 3, 4] {
            let threads = losses(ParallelConfig::threads(workers), updater, 12);
            let again = losses(ParallelConfig::threads(workers), updater, 12);
            let sequential = losses(ParallelConfig::sequential(workers), updater, 12);
            assert_eq!(threads, again, "{workers} threads, {updater:?}: another run, other bits");
            assert_eq!(threads, sequential, "{workers} threads vs one thread of {workers} shards, {updater:?}");
        }
    }
}

#[test]
fn buckets_of_any_size_give_the_same_bits() {
    // AdamW decays the matrices only: its ranges cut across the buckets and the workers'
    // shares of the update.
    for updater in [Updater::adam(0.01), Updater::adamw(0.01, 0.5)] {
        let reference = losses(ParallelConfig::threads(3), updater, 6);
        for bucket_bytes in [1, 64, 1000, 1 << 30] {
            let config = ParallelConfig { bucket_bytes, ..ParallelConfig::threads(3) };
            assert_eq!(losses(config, updater, 6), reference, "buckets of {bucket_bytes} bytes, {updater:?}");
        }
    }
}

/// Against a network trained on whole batches the losses agree to a relative 1e-4 over
/// 30 steps: the shards' matrix products and sums add in another order.
#[test]
fn losses_agree_with_plain_training_to_tolerance() {
    let (x, y) = data(64, 12, 4);
    for workers in [1, 2, 4] {
        let mut plain = Network::new(mlp(Updater::adam(0.01))).unwrap();
        let mut parallel =
            DataParallel::new(Network::new(mlp(Updater::adam(0.01))).unwrap(), ParallelConfig::threads(workers))
                .unwrap();
        for step in 0..30 {
            let a = plain.fit_batch(x.view(), y.view()).unwrap();
            let b = parallel.fit_batch(x.view(), y.view()).unwrap();
            assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "step {step}, {workers} workers: {a} vs {b}");
        }
    }
}

/// A network and one data-parallel worker run one training step (the same passes, the
/// same loss reduction, the same update): the same bits, step after step, in every
/// workspace mode, for an MLP and for masked sequences, and the same weights after.
#[test]
fn one_worker_gives_the_bits_of_plain_training() {
    let (x, y) = data(40, 12, 4);
    let (batch, steps, features) = (9, 6, 3);
    let seq =
        Array3::from_shape_fn((batch, steps, features), |(b, t, f)| ((b * 13 + t * 5 + f * 3) % 11) as f32 / 11.0);
    let mask = Array2::from_shape_fn((batch, steps), |(b, t)| if t < 2 + b % 4 { 1.0 } else { 0.0 });
    let seq_y = Array1::from_shape_fn(batch, |b| (b % 3) as u32);
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None] {
        for updater in [Updater::adam(0.01), Updater::sgd(0.1, 0.9), Updater::adamw(0.01, 0.1)] {
            for parallel in [ParallelConfig::threads(1), ParallelConfig::sequential(1)] {
                let mlp = || {
                    NetworkConfig::builder(12)
                        .dense(32)
                        .relu()
                        .dense(4)
                        .seed(11)
                        .updater(updater)
                        .training_workspace_mode(mode)
                        .build()
                        .unwrap()
                };
                let lstm = || {
                    NetworkConfig::builder(features)
                        .lstm(8)
                        .masked_mean()
                        .dense(3)
                        .seed(5)
                        .updater(updater)
                        .training_workspace_mode(mode)
                        .build()
                        .unwrap()
                };
                let context = format!("{mode:?}, {updater:?}, {parallel:?}");
                let mut plain = Network::new(mlp()).unwrap();
                let mut one = DataParallel::new(Network::new(mlp()).unwrap(), parallel).unwrap();
                for step in 0..6 {
                    let a = plain.fit_batch(x.view(), y.view()).unwrap();
                    let b = one.fit_batch(x.view(), y.view()).unwrap();
                    assert_eq!(a.to_bits(), b.to_bits(), "MLP, step {step}, {context}: {a} vs {b}");
                }
                let mut back = one.into_network().unwrap();
                assert_eq!(plain.output(x.view()).unwrap(), back.output(x.view()).unwrap(), "MLP weights, {context}");

                let mut plain = Network::new(lstm()).unwrap();
                let mut one = DataParallel::new(Network::new(lstm()).unwrap(), parallel).unwrap();
                for step in 0..6 {
                    let a = plain.fit_batch((seq.view(), mask.view()), seq_y.view()).unwrap();
                    let b = one.fit_batch((seq.view(), mask.view()), seq_y.view()).unwrap();
                    assert_eq!(a.to_bits(), b.to_bits(), "LSTM, step {step}, {context}: {a} vs {b}");
                }
            }
        }
    }
}

#[test]
fn the_trained_network_comes_back_with_its_state() {
    let (x, y) = data(48, 12, 4);
    let mut plain = Network::new(mlp(Updater::adam(0.01))).unwrap();
    let mut parallel =
        DataParallel::new(Network::new(mlp(Updater::adam(0.01))).unwrap(), ParallelConfig::threads(1)).unwrap();
    for _ in 0..3 {
        plain.fit_batch(x.view(), y.view()).unwrap();
        parallel.fit_batch(x.view(), y.view()).unwrap();
    }
    let mut back = parallel.into_network().unwrap();
    assert_eq!(back.iterations(), 3);
    // Trained on: the updater's moments came back too, so the next steps follow plain
    // training's to tolerance.
    for _ in 0..5 {
        let (a, b) = (plain.fit_batch(x.view(), y.view()).unwrap(), back.fit_batch(x.view(), y.view()).unwrap());
        assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "{a} vs {b}");
    }
}

#[test]
fn sequences_train_data_parallel_deterministically() {
    let (batch, steps, features) = (10, 7, 3);
    let x = Array3::from_shape_fn((batch, steps, features), |(b, t, f)| ((b * 13 + t * 5 + f * 3) % 11) as f32 / 11.0);
    let mask = Array2::from_shape_fn((batch, steps), |(b, t)| if t < 3 + b % 5 { 1.0 } else { 0.0 });
    let y = Array1::from_shape_fn(batch, |b| (b % 3) as u32);
    let config = || {
        NetworkConfig::builder(features)
            .lstm(8)
            .masked_mean()
            .dense(3)
            .seed(5)
            .training_workspace_mode(WorkspaceMode::Planned)
            .build()
            .unwrap()
    };
    let run = |config_p: ParallelConfig| {
        let mut t = DataParallel::new(Network::new(config()).unwrap(), config_p).unwrap();
        (0..8).map(|_| t.fit_batch((x.view(), mask.view()), y.view()).unwrap().to_bits()).collect::<Vec<_>>()
    };
    let threads = run(ParallelConfig::threads(3));
    assert_eq!(threads, run(ParallelConfig::threads(3)));
    assert_eq!(threads, run(ParallelConfig::sequential(3)));
    let mut plain = Network::new(config()).unwrap();
    for (step, &bits) in threads.iter().enumerate() {
        let a = plain.fit_batch((x.view(), mask.view()), y.view()).unwrap();
        let b = f32::from_bits(bits);
        assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "step {step}: {a} vs {b}");
    }
}

#[test]
fn a_worker_that_meets_a_nan_fails_the_step_naming_worker_and_layer_and_changes_nothing() {
    let (x, y) = data(40, 12, 4);
    for config in [ParallelConfig::threads(4), ParallelConfig::sequential(4)] {
        let mut trainer = DataParallel::new(Network::new(mlp(Updater::adam(0.01))).unwrap(), config).unwrap();
        let mut reference = DataParallel::new(Network::new(mlp(Updater::adam(0.01))).unwrap(), config).unwrap();
        trainer.fit_batch(x.view(), y.view()).unwrap();
        reference.fit_batch(x.view(), y.view()).unwrap();
        let mut bad = x.clone();
        bad[[25, 3]] = f32::NAN; // rows 20..30 are worker 2's
        let err = trainer.fit_batch(bad.view(), y.view()).unwrap_err();
        match &err {
            Error::Worker { worker, layer, source } => {
                assert_eq!(*worker, 2, "{err}");
                assert!(matches!(**source, Error::NonFinite { .. }), "{err}");
                assert!(!layer.is_empty(), "{err}");
            }
            other => panic!("expected a worker error, got {other}"),
        }
        assert!(err.to_string().contains("worker 2"), "{err}");
        // Nothing changed: the next steps are the reference's, bit for bit.
        for _ in 0..3 {
            let (a, b) =
                (trainer.fit_batch(x.view(), y.view()).unwrap(), reference.fit_batch(x.view(), y.view()).unwrap());
            assert_eq!(a.to_bits(), b.to_bits());
        }
    }
}

#[test]
fn zero_workers_is_a_configuration_error_and_tiny_batches_still_train() {
    let err =
        DataParallel::new(Network::new(mlp(Updater::adam(0.01))).unwrap(), ParallelConfig::threads(0)).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    // Fewer rows than workers: the empty shards add nothing.
    let (x, y) = data(3, 12, 4);
    let threads = {
        let mut t =
            DataParallel::new(Network::new(mlp(Updater::adam(0.01))).unwrap(), ParallelConfig::threads(5)).unwrap();
        (0..4).map(|_| t.fit_batch(x.view(), y.view()).unwrap().to_bits()).collect::<Vec<_>>()
    };
    let sequential = {
        let mut t =
            DataParallel::new(Network::new(mlp(Updater::adam(0.01))).unwrap(), ParallelConfig::sequential(5)).unwrap();
        (0..4).map(|_| t.fit_batch(x.view(), y.view()).unwrap().to_bits()).collect::<Vec<_>>()
    };
    assert_eq!(threads, sequential);
}

/// A layer that panics when its input holds 99 (in one worker's shard only).
#[derive(Clone)]
struct Tripwire;

impl carve::nn::Layer for Tripwire {
    fn name(&self) -> &str {
        "tripwire"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        x: carve::ndarray::ArrayView2<'a, f32>,
        ctx: &carve::nn::ForwardCtx<'a, '_>,
    ) -> carve::Result<carve::ndarray::ArrayView2<'a, f32>> {
        assert!(!x.iter().any(|&v| v == 99.0), "tripwire crossed");
        Ok(carve::freeze(ctx.activations.copy_of(&x)?))
    }
    fn backward_rows(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: carve::nn::RowsPass<'_>,
        grad_input: Option<carve::ndarray::ArrayViewMut2<'_, f32>>,
        _ctx: &carve::nn::BackwardCtx<'_>,
    ) -> carve::Result<()> {
        if let Some(mut g) = grad_input {
            g.assign(&pass.grad_output);
        }
        Ok(())
    }
}

#[test]
fn a_layer_that_panics_in_one_worker_fails_the_step_naming_worker_and_layer() {
    let (x, y) = data(30, 12, 4);
    let config = || NetworkConfig::builder(12).dense(8).layer(Tripwire).dense(4).seed(3).build().unwrap();
    for parallel in [ParallelConfig::threads(3), ParallelConfig::sequential(3)] {
        let mut trainer = DataParallel::new(Network::new(config()).unwrap(), parallel).unwrap();
        let mut reference = DataParallel::new(Network::new(config()).unwrap(), parallel).unwrap();
        trainer.fit_batch(x.view(), y.view()).unwrap();
        reference.fit_batch(x.view(), y.view()).unwrap();
        // The first dense layer's output cannot be steered to 99; a batch that holds 99
        // in the input would stop at the input check first, so the tripwire gets its own
        // network whose first layer is the tripwire.
        let mut direct = DataParallel::new(
            Network::new(NetworkConfig::builder(12).layer(Tripwire).dense(4).seed(3).build().unwrap()).unwrap(),
            parallel,
        )
        .unwrap();
        let mut bad = x.clone();
        bad[[12, 0]] = 99.0; // rows 10..20 are worker 1's
        let err = direct.fit_batch(bad.view(), y.view()).unwrap_err();
        match &err {
            Error::Worker { worker: 1, layer, source } => {
                assert_eq!(layer, "tripwire", "{err}");
                assert!(matches!(**source, Error::LayerPanicked { .. }), "{err}");
                assert!(err.to_string().contains("tripwire crossed"), "{err}");
            }
            other => panic!("expected worker 1's panic, got {other}"),
        }
        // The trainer goes on, and the others are unaffected.
        direct.fit_batch(x.view(), y.view()).unwrap();
        for _ in 0..2 {
            let (a, b) =
                (trainer.fit_batch(x.view(), y.view()).unwrap(), reference.fit_batch(x.view(), y.view()).unwrap());
            assert_eq!(a.to_bits(), b.to_bits());
        }
    }
}

#[test]
fn a_custom_layer_trains_data_parallel_as_it_is() {
    // One trait: a layer that trains in a network trains in every worker too (there is
    // no data-parallel form to forget).
    #[derive(Clone)]
    struct Plain;
    impl carve::nn::Layer for Plain {
        fn name(&self) -> &str {
            "plain"
        }
        fn output_size(&self, inputs: usize) -> carve::Result<usize> {
            Ok(inputs)
        }
        fn forward_rows<'a>(
            &self,
            _params: &[f32],
            input: carve::ndarray::ArrayView2<'a, f32>,
            ctx: &carve::nn::ForwardCtx<'a, '_>,
        ) -> carve::Result<carve::ndarray::ArrayView2<'a, f32>> {
            Ok(ctx.activations.leverage(input)?)
        }
        fn backward_rows(
            &self,
            _params: &[f32],
            _grads: &mut [f32],
            pass: carve::nn::RowsPass<'_>,
            grad_input: Option<carve::ndarray::ArrayViewMut2<'_, f32>>,
            _ctx: &carve::nn::BackwardCtx<'_>,
        ) -> carve::Result<()> {
            if let Some(mut g) = grad_input {
                g.assign(&pass.grad_output);
            }
            Ok(())
        }
    }
    let (x, y) = data(8, 4, 2);
    let net = Network::new(NetworkConfig::builder(4).layer(Plain).dense(2).build().unwrap()).unwrap();
    let mut trainer = DataParallel::new(net, ParallelConfig::threads(2)).unwrap();
    assert!(trainer.fit_batch(x.view(), y.view()).unwrap().is_finite());
}

/// A pass-through layer whose `tape()` panics on its `fuse`-th call after the one the
/// network makes for itself (then one call per worker, rank 0 first); 0: never.
#[derive(Clone)]
struct Fuse {
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    fuse: usize,
}

impl carve::nn::Layer for Fuse {
    fn name(&self) -> &str {
        "fuse"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn tape(&self) -> carve::nn::Tape {
        let call = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        assert!(self.fuse == 0 || call != self.fuse, "fuse blown at call {call}");
        carve::nn::Tape::none()
    }
    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: carve::ndarray::ArrayView2<'a, f32>,
        _ctx: &carve::nn::ForwardCtx<'a, '_>,
    ) -> carve::Result<carve::ndarray::ArrayView2<'a, f32>> {
        Ok(input)
    }
    fn backward_rows(
        &self,
        _params: &[f32],
        _grads: &mut [f32],
        pass: carve::nn::RowsPass<'_>,
        grad_input: Option<carve::ndarray::ArrayViewMut2<'_, f32>>,
        _ctx: &carve::nn::BackwardCtx<'_>,
    ) -> carve::Result<()> {
        if let Some(mut g) = grad_input {
            g.assign(&pass.grad_output);
        }
        Ok(())
    }
}

#[test]
fn a_worker_that_cannot_start_fails_construction_without_a_hang() {
    // Worker 0 is made on the caller's thread, the others on their own: a panic in any
    // of them is an error naming it, and the threads already started stop.
    for fuse in [1, 2, 4] {
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let layer = Fuse { calls: calls.clone(), fuse };
        let network =
            Network::new(NetworkConfig::builder(12).dense(8).layer(layer).dense(4).seed(3).build().unwrap()).unwrap();
        let err = DataParallel::new(network, ParallelConfig::threads(4)).unwrap_err();
        match &err {
            Error::Worker { worker, layer, source } => {
                assert_eq!(layer, "start", "{err}");
                assert!(matches!(**source, Error::LayerPanicked { .. }), "{err}");
                assert!(err.to_string().contains("fuse blown"), "{err}");
                if fuse == 1 {
                    assert_eq!(*worker, 0, "{err}");
                } else {
                    assert!((1..4).contains(worker), "{err}");
                }
            }
            other => panic!("expected a start error, got {other}"),
        }
    }
    // A fuse that never blows: the same layer trains.
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let layer = Fuse { calls, fuse: 0 };
    let network =
        Network::new(NetworkConfig::builder(12).dense(8).layer(layer).dense(4).seed(3).build().unwrap()).unwrap();
    let mut trainer = DataParallel::new(network, ParallelConfig::threads(4)).unwrap();
    let (x, y) = data(20, 12, 4);
    assert!(trainer.fit_batch(x.view(), y.view()).unwrap().is_finite());
}

#[test]
fn an_update_that_would_overflow_fails_the_same_way_in_both_modes_and_changes_nothing() {
    // Inputs of 1e4 make gradients far above 1; a learning rate of 1e37 takes the SGD
    // update past f32::MAX.
    let (x, y) = data(30, 12, 4);
    let big = x.mapv(|v| v * 1e4);
    let config = || {
        let net = NetworkConfig::builder(12).dense(16).relu().dense(4).seed(5).updater(Updater::sgd(1e37, 0.9));
        Network::new(net.build().unwrap()).unwrap()
    };
    let mut errors = Vec::new();
    for parallel in [ParallelConfig::threads(3), ParallelConfig::sequential(3)] {
        let mut trainer = DataParallel::new(config(), parallel).unwrap();
        let err = trainer.fit_batch(big.view(), y.view()).unwrap_err();
        match &err {
            Error::Worker { source, .. } => assert!(matches!(**source, Error::NonFinite { .. }), "{err}"),
            other => panic!("expected a worker error, got {other}"),
        }
        assert!(err.to_string().contains("the updater's"), "{err}");
        // Nothing changed: the trainer gives back the untrained network's weights.
        let untrained = config().freeze().unwrap();
        let trained = trainer.freeze().unwrap();
        let probe = x.slice(carve::ndarray::s![..4, ..]).to_owned();
        assert_eq!(untrained.output(probe.view()).unwrap(), trained.output(probe.view()).unwrap());
        errors.push(err.to_string());
    }
    assert_eq!(errors[0], errors[1], "threads and the shard mode name the same worker, layer and value");
}
