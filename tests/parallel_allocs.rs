//! A steady data-parallel step makes no heap allocation in any worker, nor a network's
//! step whose matrix multiplies split across threads: the count is
//! process-wide (every worker thread), leaving out the harness's main thread, and the
//! binary holds one test, so that nothing but the trainer is counted.

use carve::nn::{parallel::DataParallel, parallel::ParallelConfig, Network, NetworkConfig};
use carve::workspace_core::alloc_check::CountingAllocator;
use carve::workspace_core::alloc_check::{process_counts, Threads};
use carve::WorkspaceMode;
use ndarray::{Array1, Array2, Array3};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

fn allocations() -> u64 {
    process_counts(Threads::ExceptMain).allocations
}

#[test]
fn steady_steps_allocate_nothing_in_any_worker() {
    std::thread::spawn(|| {
        let x = Array2::from_shape_fn((64, 32), |(r, c)| ((r * 5 + c * 3) % 17) as f32 / 17.0);
        let y = Array1::from_shape_fn(64, |r| (r % 10) as u32);
        let seq = Array3::from_shape_fn((12, 6, 4), |(b, t, f)| ((b + t * 3 + f) % 7) as f32 / 7.0);
        let mask = Array2::from_shape_fn((12, 6), |(b, t)| if t < 2 + b % 4 { 1.0 } else { 0.0 });
        let seq_y = Array1::from_shape_fn(12, |b| (b % 3) as u32);
        for config in [ParallelConfig::threads(3), ParallelConfig::sequential(3), ParallelConfig::threads(1)] {
            let net =
                NetworkConfig::builder(32).dense(64).relu().dense(10).training_workspace_mode(WorkspaceMode::Planned);
            let mut flat = DataParallel::new(Network::new(net.build().unwrap()).unwrap(), config).unwrap();
            let net = NetworkConfig::builder(4).lstm(8).masked_mean().dense(3);
            let mut lstm = DataParallel::new(Network::new(net.build().unwrap()).unwrap(), config).unwrap();
            for _ in 0..5 {
                flat.fit_batch(x.view(), y.view()).unwrap();
                lstm.fit_batch((seq.view(), mask.view()), seq_y.view()).unwrap();
            }
            let before = allocations();
            for _ in 0..20 {
                flat.fit_batch(x.view(), y.view()).unwrap();
                lstm.fit_batch((seq.view(), mask.view()), seq_y.view()).unwrap();
            }
            let during = allocations() - before;
            assert_eq!(during, 0, "{config:?}: {during} allocations in 40 steady steps");
        }
        // A network whose products split across 2 threads (each at least 8 MFLOP).
        let wide = NetworkConfig::builder(256).dense(512).relu().dense(10).seed(4);
        let mut net = Network::new(wide.build().unwrap()).unwrap();
        net.set_threads(2).unwrap();
        let x = Array2::from_shape_fn((64, 256), |(r, c)| ((r * 5 + c * 3) % 17) as f32 / 17.0);
        for _ in 0..3 {
            net.fit_batch(x.view(), y.view()).unwrap();
        }
        let before = allocations();
        for _ in 0..10 {
            net.fit_batch(x.view(), y.view()).unwrap();
        }
        let during = allocations() - before;
        assert_eq!(during, 0, "set_threads(2): {during} allocations in 10 steady steps");
    })
    .join()
    .unwrap();
}
