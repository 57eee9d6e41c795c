//! With workspaces enabled, an epoch of `Network::fit` over a prefetcher of
//! variable-length sequences (Japanese Vowels, each batch padded to its own longest
//! sequence) allocates the same whatever its number of batches, once the longest batch
//! has been seen: nothing per batch, on the training thread or on the producer thread
//! (the counting allocator counts both; the constant is the producer's per-epoch
//! restart). With workspaces off the count grows with the batches, which shows the
//! counter counts. The binary holds one test, so that nothing else is counted.

#[path = "../examples/common/vowels.rs"]
mod vowels;

use carve::async_iter::{Prefetcher, Sequences};
use carve::nn::{Network, NetworkConfig, Updater};
use carve::workspace_core::alloc_check::CountingAllocator;
use carve::workspace_core::alloc_check::{process_counts, thread_counts, Threads};
use carve::WorkspaceMode;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

/// Divides counts under valgrind (`CARVE_SOAK_SCALE=5`), never below `floor`.
fn scaled(n: usize, floor: usize) -> usize {
    let scale: usize = std::env::var("CARVE_SOAK_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    (n / scale.max(1)).max(floor)
}

/// Heap allocations so far by every thread but the harness's.
fn allocations() -> u64 {
    process_counts(Threads::ExceptMain).allocations
}

/// Allocations per epoch of `fit` (after three warm-up epochs) over the first
/// `sequences` training sequences in batches of 8.
fn allocs_per_epoch(mode: WorkspaceMode, sequences: usize) -> Vec<u64> {
    let (train, _) = vowels::load(&vowels::data_path()).unwrap();
    let seqs = train.sequences[..sequences].to_vec();
    let labels = train.labels[..sequences].to_vec();
    let config = NetworkConfig::builder(vowels::FEATURES)
        .lstm(16)
        .last_step()
        .dense(vowels::CLASSES)
        .updater(Updater::adam(1e-3))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    let mut net = Network::new(config).unwrap();
    let source = Sequences::new(seqs, labels, 8).unwrap().shuffled(2);
    let mut prefetcher = Prefetcher::builder(source).workspace_mode(mode).build().unwrap();
    for _ in 0..3 {
        net.fit(&mut prefetcher).unwrap();
    }
    let counts = (0..scaled(4, 2))
        .map(|_| {
            let before = allocations();
            net.fit(&mut prefetcher).unwrap();
            allocations() - before
        })
        .collect();
    let stats = prefetcher.stats();
    assert!(mode == WorkspaceMode::None || stats.ring_growths >= 1, "lengths vary, so the ring grew: {stats:?}");
    counts
}

#[test]
fn an_epoch_of_variable_length_batches_allocates_nothing_per_batch_with_workspaces_enabled() {
    // 4 and 32 batches (4 and 16 under valgrind).
    let (few, many) = (32, scaled(256, 128));
    let short = allocs_per_epoch(WorkspaceMode::Enabled, few);
    let long = allocs_per_epoch(WorkspaceMode::Enabled, many);
    let (short_max, long_min) = (*short.iter().max().unwrap(), *long.iter().min().unwrap());
    assert!(long_min <= short_max, "allocations per epoch: 4 batches {short:?}, 32 batches {long:?}");
    assert!(short_max < 60, "the per-epoch constant is small: {short:?}");

    // Labels per step, through time-distributed layers: nothing per step either.
    let enabled = per_step_allocations(WorkspaceMode::Enabled);
    assert!(enabled.iter().all(|&n| n == 0), "allocations per step, labels per step: {enabled:?}");
    let none = per_step_allocations(WorkspaceMode::None);
    assert!(none.iter().all(|&n| n > 20), "workspaces off, every step allocates: {none:?}");

    let short = allocs_per_epoch(WorkspaceMode::None, few);
    let long = allocs_per_epoch(WorkspaceMode::None, many);
    let more_batches = (many - few) as u64 / 8;
    assert!(
        long.iter().min().unwrap() >= &(short.iter().max().unwrap() + more_batches * 10),
        "workspaces off: every batch allocates ({short:?} vs {long:?})"
    );
}

/// Heap allocations of each of `steps` training steps (after warm-up) of a network with
/// a label per step: an LSTM, then a dense layer and a ReLU on every step (the default,
/// time-distributed, sequence methods) and a dense output per step, on batches of
/// varying length with masks.
fn per_step_allocations(mode: WorkspaceMode) -> Vec<u64> {
    let (train, _) = vowels::load(&vowels::data_path()).unwrap();
    let config = NetworkConfig::builder(vowels::FEATURES)
        .lstm(8)
        .dense(8)
        .relu()
        .dense(vowels::CLASSES)
        .updater(Updater::adam(1e-3))
        .training_workspace_mode(mode)
        .build()
        .unwrap();
    let mut net = Network::new(config).unwrap();
    let batches: Vec<_> = train
        .sequences
        .chunks(8)
        .zip(train.labels.chunks(8))
        .take(12)
        .map(|(seqs, labels)| {
            let steps = seqs.iter().map(|s| s.nrows()).max().unwrap();
            let mut x = ndarray::Array3::<f32>::zeros((seqs.len(), steps, vowels::FEATURES));
            let mut mask = ndarray::Array2::<f32>::zeros((seqs.len(), steps));
            let mut y = ndarray::Array2::<u32>::zeros((seqs.len(), steps));
            for (r, s) in seqs.iter().enumerate() {
                x.slice_mut(ndarray::s![r, ..s.nrows(), ..]).assign(s);
                mask.slice_mut(ndarray::s![r, ..s.nrows()]).fill(1.0);
                y.row_mut(r).fill(labels[r]);
            }
            (x, mask, y)
        })
        .collect();
    let mut step = |(x, mask, y): &(ndarray::Array3<f32>, ndarray::Array2<f32>, ndarray::Array2<u32>)| {
        let before = thread_counts().allocations;
        net.fit_batch((x.view(), mask.view()), y.view()).unwrap();
        thread_counts().allocations - before
    };
    for b in &batches {
        step(b); // warm-up: the longest batch is among these
    }
    batches.iter().cycle().take(scaled(36, 12)).map(step).collect()
}
