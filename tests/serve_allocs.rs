//! `InferencePool::output_into` makes no heap allocation per request once every arena
//! has a plan for the shape, in direct and in batched mode, from several threads (the
//! batch workers included: carve's counting allocator counts every thread); nor does
//! `Model::output_into` once its caller's thread has a plan for the shape. The count
//! leaves out the harness's thread, and the binary holds one test, so that nothing but
//! the code under test is counted.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use carve::nn::{serve::InferencePool, serve::PoolConfig, Network, NetworkConfig};
use carve::workspace_core::alloc_check::CountingAllocator;
use carve::workspace_core::alloc_check::{process_counts, Threads};
use ndarray::Array2;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

fn allocations() -> u64 {
    process_counts(Threads::ExceptMain).allocations
}

#[test]
fn output_into_allocates_nothing_per_request_in_either_mode() {
    let net =
        Network::new(NetworkConfig::builder(64).dense(128).relu().dense(64).relu().dense(10).build().unwrap()).unwrap();
    let model = Arc::new(net.freeze().unwrap());
    for config in [PoolConfig::direct(2), PoolConfig::batched(2, 16, Duration::from_micros(200))] {
        let mode = config.mode;
        let pool = InferencePool::new(model.clone(), config).unwrap();
        // Every arena plans every shape a batch can take (1 to 16 rows), so that the
        // count below sees steady state whichever requests a batch coalesces.
        let (mut a, mut b) = (pool.lease().unwrap(), pool.lease().unwrap());
        for rows in 1..=16 {
            let x = Array2::<f32>::zeros((rows, 64));
            a.output(x.view()).unwrap();
            b.output(x.view()).unwrap();
        }
        drop((a, b));
        let threads = 3;
        let requests = 200;
        // Per thread: warm up, count, run the measured requests, count again.
        let barrier = Barrier::new(threads);
        let off_plan = std::sync::Mutex::new((0, 0));
        let counts: Vec<(u64, u64)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (pool, barrier, off_plan) = (&pool, &barrier, &off_plan);
                    s.spawn(move || {
                        let x = Array2::from_shape_fn((4, 64), |(r, c)| ((r * 64 + c + t) % 13) as f32 / 13.0);
                        let mut out = Array2::<f32>::zeros((4, 10));
                        for _ in 0..requests {
                            pool.output_into(x.view(), out.view_mut()).unwrap();
                        }
                        barrier.wait();
                        let before = allocations();
                        off_plan.lock().unwrap().0 = pool.stats().off_plan;
                        barrier.wait();
                        for _ in 0..requests {
                            pool.output_into(x.view(), out.view_mut()).unwrap();
                        }
                        barrier.wait();
                        let after = allocations();
                        off_plan.lock().unwrap().1 = pool.stats().off_plan;
                        (before, after)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Every thread saw the same window; the largest difference bounds them all.
        let grown = counts.iter().map(|(b, a)| a - b).max().unwrap();
        let (off_before, off_after) = *off_plan.lock().unwrap();
        assert_eq!(
            grown,
            0,
            "{mode:?}: {grown} heap allocations over {} requests; inferences off their plans {off_before} -> {off_after}",
            threads * requests
        );
        // Batched: the mix of row counts per batch varies, and every batch shape has a
        // plan by now; the count above shows none of them allocated.
        assert!(pool.stats().leases > 0);
    }
    // `warm_up` alone readies every arena: the first request each arena serves after it
    // allocates nothing either (a first replay once grew the engine's list of an
    // iteration's windows, in whichever arena the load reached last).
    for config in [PoolConfig::direct(2), PoolConfig::batched(2, 4, Duration::ZERO)] {
        let pool = InferencePool::new(model.clone(), config).unwrap();
        let x = Array2::from_shape_fn((3, 64), |(r, c)| ((r * 64 + c) % 11) as f32 / 11.0);
        pool.warm_up(x.view()).unwrap();
        let spent = std::thread::scope(|s| {
            s.spawn(|| {
                let mut out = Array2::<f32>::zeros((3, 10));
                let (mut a, mut b) = (pool.lease().unwrap(), pool.lease().unwrap());
                let before = allocations();
                a.output_into(x.view(), out.view_mut()).unwrap();
                b.output_into(x.view(), out.view_mut()).unwrap();
                allocations() - before
            })
            .join()
            .unwrap()
        });
        assert_eq!(spent, 0, "{:?}: the first request of each arena after warm_up", pool.config().mode);
    }
    // A model alone serves in its calling thread's workspaces: once they have a plan for
    // the shape (its recording and a first replay), no allocation either.
    let spent = std::thread::scope(|s| {
        s.spawn(|| {
            let x = Array2::from_shape_fn((3, 64), |(r, c)| ((r * 64 + c) % 7) as f32 / 7.0);
            let mut out = Array2::<f32>::zeros((3, 10));
            for _ in 0..2 {
                model.output_into(x.view(), out.view_mut()).unwrap();
            }
            let before = allocations();
            for _ in 0..50 {
                model.output_into(x.view(), out.view_mut()).unwrap();
            }
            allocations() - before
        })
        .join()
        .unwrap()
    });
    assert_eq!(spent, 0, "Model::output_into in its thread's serving workspaces, over 50 requests");
}
