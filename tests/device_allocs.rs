//! A steady training step on the simulated device makes no heap allocation, on any
//! thread: the training thread's staging, launches and read-backs, and the device's
//! stream worker running the kernels. The count leaves out the harness's thread (the
//! training runs in a thread of its own), and the binary holds one test, so that
//! nothing but the code under test is counted.

use carve::ndarray::{Array1, Array2};
use carve::nn::{Device, Network, NetworkConfig, Updater};
use carve::workspace_core::alloc_check::CountingAllocator;
use carve::workspace_core::alloc_check::{process_counts, Threads};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

fn allocations() -> u64 {
    process_counts(Threads::ExceptMain).allocations
}

#[test]
fn a_steady_step_on_the_simulated_device_allocates_nothing() {
    let counted = std::thread::scope(|s| {
        s.spawn(|| {
            let mut counts = Vec::new();
            for updater in [Updater::adam(0.01), Updater::sgd(0.05, 0.9)] {
                let config = NetworkConfig::builder(16)
                    .dense(24)
                    .relu()
                    .dense(5)
                    .updater(updater)
                    .device(Device::simulated())
                    .build()
                    .unwrap();
                let mut net = Network::new(config).unwrap();
                let x = Array2::from_shape_fn((12, 16), |(r, c)| ((r * 5 + c * 3) % 7) as f32 / 7.0 - 0.5);
                let y = Array1::from_shape_fn(12, |r| (r % 5) as u32);
                // Warm-up: the workspace learns its size (over its first 16 cycles), the staging and the event
                // list reach theirs.
                for _ in 0..40 {
                    net.fit_batch(x.view(), y.view()).unwrap();
                }
                let before = allocations();
                for _ in 0..50 {
                    net.fit_batch(x.view(), y.view()).unwrap();
                }
                let count = allocations() - before;
                counts.push((format!("{updater:?}"), count));
            }
            counts
        })
        .join()
        .unwrap()
    });
    let gpt = std::thread::scope(|s| {
        s.spawn(|| {
            let mut b = NetworkConfig::builder(12).embedding(8).position_embedding(6);
            b = b.residual(|b| b.layer_norm().attention(2)).residual(|b| b.layer_norm().dense(16).gelu().dense(8));
            let config = b.layer_norm().dense(12).updater(Updater::adamw(1e-3, 0.1)).device(Device::simulated());
            let mut net = Network::new(config.build().unwrap()).unwrap();
            let ids = Array2::from_shape_fn((3, 6), |(b, t)| ((b * 5 + t * 7) % 12) as u32);
            let next = Array2::from_shape_fn((3, 6), |(b, t)| ((b * 5 + t * 7 + 7) % 12) as u32);
            for _ in 0..40 {
                net.fit_batch(carve::nn::Input::tokens(ids.view()), next.view()).unwrap();
            }
            let before = allocations();
            for _ in 0..50 {
                net.fit_batch(carve::nn::Input::tokens(ids.view()), next.view()).unwrap();
            }
            allocations() - before
        })
        .join()
        .unwrap()
    });
    assert_eq!(gpt, 0, "the GPT: {gpt} heap allocations in 50 steady steps");
    for (updater, count) in counted {
        assert_eq!(count, 0, "{updater}: {count} heap allocations in 50 steady steps");
    }
}
