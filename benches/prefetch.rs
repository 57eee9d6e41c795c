//! async-iter's prefetcher against what a user would build instead.
//!
//! - `prefetch_handoff`: batches that cost nothing to fill or consume, so the time per
//!   batch is the hand-off: the prefetcher (workspaces enabled and `None`) against a
//!   crossbeam pipeline (buffers to the consumer on a `bounded(2)` channel, back on
//!   another).
//! - `prefetch_overlap`: batches that cost P ≈ C ≈ 100 µs to fill and to consume:
//!   serial (shield mode) against the background thread; ideally half the time.
//!
//! Run: `cargo bench --bench prefetch`

use std::hint::black_box;
use std::time::{Duration, Instant};

use async_iter::{BatchLayout, BatchMut, BatchSource, Prefetcher, SourceError, Threading};
use carve::WorkspaceMode;
use criterion::{criterion_main, Criterion};
use ndarray::Ix1;

/// splitmix64: the unit of busy work.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn work(seed: u64, rounds: u32) -> u64 {
    (0..rounds).fold(seed, |h, _| mix(h))
}

/// Endless batches of `len` `f32`, each element `rounds` mixes to fill.
struct Endless {
    len: usize,
    rounds: u32,
}

impl BatchSource for Endless {
    fn next_layout(&mut self, _: usize) -> Result<Option<BatchLayout>, SourceError> {
        Ok(Some(BatchLayout::new().features::<f32, _>(self.len)))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        let (index, rounds) = (batch.index() as u64, self.rounds);
        for (i, x) in batch.features::<f32, Ix1>()?.iter_mut().enumerate() {
            *x = (work(index << 32 ^ i as u64, rounds) >> 40) as f32;
        }
        Ok(())
    }
}

fn prefetcher(len: usize, rounds: u32, mode: WorkspaceMode, threading: Threading) -> Prefetcher<Endless> {
    Prefetcher::builder(Endless { len, rounds })
        .workspace_mode(mode)
        .threading(threading)
        .build()
        .expect("a valid configuration")
}

/// The consumer's step: `rounds` mixes per element.
fn consume(prefetcher: &mut Prefetcher<Endless>, rounds: u32) -> u64 {
    let lease = prefetcher.next().expect("endless").expect("no error");
    let x = lease.features::<f32, Ix1>().expect("f32");
    x.iter().fold(0, |acc, v| acc ^ work(v.to_bits() as u64, rounds))
}

/// The crossbeam pipeline: a producer thread that lives as long as the value.
struct Channels {
    full: crossbeam::channel::Receiver<Box<[f32; 16]>>,
    /// `None` once closed, which ends the producer's loop.
    free: Option<crossbeam::channel::Sender<Box<[f32; 16]>>>,
    producer: Option<std::thread::JoinHandle<()>>,
}

impl Channels {
    fn new() -> Channels {
        let (full_tx, full) = crossbeam::channel::bounded::<Box<[f32; 16]>>(2);
        let (free, free_rx) = crossbeam::channel::bounded::<Box<[f32; 16]>>(3);
        for _ in 0..3 {
            free.send(Box::new([0.0; 16])).expect("room for three buffers");
        }
        let producer = std::thread::spawn(move || {
            while let Ok(mut buffer) = free_rx.recv() {
                buffer[0] = 1.0;
                if full_tx.send(buffer).is_err() {
                    return;
                }
            }
        });
        Channels { full, free: Some(free), producer: Some(producer) }
    }

    fn round_trip(&self) -> f32 {
        let buffer = self.full.recv().expect("the producer runs");
        let value = buffer[0];
        self.free.as_ref().expect("open until dropped").send(buffer).expect("the producer runs");
        value
    }
}

impl Drop for Channels {
    fn drop(&mut self) {
        // Closing `free` ends the producer's loop once it has sent the buffers still in
        // it; draining `full` lets those sends through until the producer hangs up.
        drop(self.free.take());
        while self.full.recv().is_ok() {}
        if let Some(producer) = self.producer.take() {
            producer.join().expect("the producer thread");
        }
    }
}

fn handoff(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefetch_handoff");
    for (name, mode) in [("async_iter_enabled", WorkspaceMode::Enabled), ("async_iter_none", WorkspaceMode::None)] {
        let mut batches = prefetcher(16, 0, mode, Threading::Background);
        g.bench_function(name, |b| b.iter(|| black_box(consume(&mut batches, 0))));
    }
    let channels = Channels::new();
    g.bench_function("crossbeam_bounded2_round_trip", |b| b.iter(|| black_box(channels.round_trip())));
    g.finish();
}

fn overlap(c: &mut Criterion) {
    let len = 4096;
    let rounds = calibrate(len, Duration::from_micros(100));
    let mut g = c.benchmark_group("prefetch_overlap_p_equals_c_100us");
    for (name, threading) in [("serial_shield", Threading::Shield), ("prefetch_background", Threading::Background)] {
        let mut batches = prefetcher(len, rounds, WorkspaceMode::Enabled, threading);
        g.bench_function(name, |b| b.iter(|| black_box(consume(&mut batches, rounds))));
    }
    g.finish();
}

/// Mixing rounds per element so that `len` elements take about `target` (the best of
/// five probes, so that a cold first probe does not skew it).
fn calibrate(len: usize, target: Duration) -> u32 {
    let probe = 64;
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        black_box((0..len as u64).fold(0, |acc, i| acc ^ work(black_box(i), probe)));
        best = best.min(start.elapsed());
    }
    let per_round = best.as_secs_f64() / probe as f64;
    ((target.as_secs_f64() / per_round).round() as u32).max(1)
}

// The macro defines an undocumented function.
#[allow(missing_docs)]
mod group {
    criterion::criterion_group! {
        name = benches;
        config = criterion::Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
        targets = super::handoff, super::overlap
    }
}
criterion_main!(group::benches);
