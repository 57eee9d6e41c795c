//! Serving: a frozen model gives a network's probabilities bit for bit, from any number
//! of threads; the pool's arenas are leased, refused, timed out and closed as
//! documented; a panicking layer fails its request only; batched requests get the bits
//! they get alone.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use carve::nn::{
    serve::InferencePool, serve::Model, serve::PoolConfig, serve::PoolMode, ForwardCtx, Input, Layer, Network,
    NetworkConfig,
};
use carve::{Error, LayerWorkspaceMgr, WorkspaceMode};
use carve_rng::Rng;
use ndarray::{Array2, Array3, ArrayView2};

fn random(rows: usize, cols: usize, rng: &mut Rng) -> Array2<f32> {
    Array2::from_shape_fn((rows, cols), |_| rng.uniform(-1.0, 1.0))
}

fn mlp(mode: WorkspaceMode, seed: u64) -> Network {
    let config = NetworkConfig::builder(16)
        .dense(32)
        .relu()
        .dense(24)
        .relu()
        .dense(5)
        .seed(seed)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn a_frozen_model_gives_the_networks_bits_in_every_mode_and_thread() {
    assert_send_sync::<Model>();
    assert_send_sync::<InferencePool>();
    let mut rng = Rng::new(3);
    let x = random(7, 16, &mut rng);
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None] {
        let mut net = mlp(mode, 11);
        let expected = net.output(x.view()).unwrap();
        let model = Arc::new(net.freeze().unwrap());
        assert_eq!(model.weight_bytes(), (16 * 32 + 32 + 32 * 24 + 24 + 24 * 5 + 5) * 4);
        assert_eq!(model.output(x.view()).unwrap(), expected, "{mode:?}");
        let pool = InferencePool::new(model.clone(), PoolConfig::direct(2)).unwrap();
        std::thread::scope(|s| {
            for t in 0..6 {
                let (pool, x, expected) = (&pool, &x, &expected);
                s.spawn(move || {
                    for i in 0..20 {
                        // Shapes vary: row subsets of the batch.
                        let rows = 1 + (t + i) % 7;
                        let got = pool.output(x.slice(ndarray::s![..rows, ..])).unwrap();
                        assert_eq!(got, expected.slice(ndarray::s![..rows, ..]), "rows {rows}");
                    }
                });
            }
        });
        let stats = pool.stats();
        assert_eq!(stats.leases, 120);
        assert!(stats.on_plan >= 120 - 2 * 7, "every shape is recorded once per arena at most: {stats:?}");
        assert!(stats.arena_bytes > 0);
    }
}

#[test]
fn sequence_models_serve_their_networks_bits() {
    let mut rng = Rng::new(5);
    let (batch, steps, features) = (4, 6, 3);
    let x = Array3::from_shape_fn((batch, steps, features), |_| rng.uniform(-1.0, 1.0));
    let mut mask = Array2::<f32>::ones((batch, steps));
    mask[[1, 5]] = 0.0;
    mask[[2, 4]] = 0.0;
    mask[[2, 5]] = 0.0;
    for head in [true, false] {
        let builder = NetworkConfig::builder(features).lstm(8);
        let builder = if head { builder.last_step().dense(4) } else { builder.dense(4) };
        let mut net = Network::new(builder.seed(9).build().unwrap()).unwrap();
        let expected = net.output((x.view(), mask.view())).unwrap();
        let model = net.freeze().unwrap();
        let pool = InferencePool::new(Arc::new(model), PoolConfig::direct(1)).unwrap();
        assert_eq!(pool.output((x.view(), mask.view())).unwrap(), expected, "head {head}");
        let rows = if head { batch } else { batch * steps };
        let mut out = Array2::zeros((rows, 4));
        pool.output_into((x.view(), mask.view()), out.view_mut()).unwrap();
        assert_eq!(out, expected);
        // A ragged batch whose padding swallowed a whole sequence is refused.
        let mut empty = mask.clone();
        empty.row_mut(3).fill(0.0);
        let err = pool.output((x.view(), empty.view())).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    }
}

#[test]
fn bad_requests_are_typed_errors_and_the_pool_goes_on() {
    let model = Arc::new(mlp(WorkspaceMode::Planned, 1).freeze().unwrap());
    for config in [PoolConfig::direct(1), PoolConfig::batched(1, 8, Duration::from_micros(100))] {
        let pool = InferencePool::new(model.clone(), config).unwrap();
        let good = Array2::<f32>::ones((3, 16));
        let expected = model.output(good.view()).unwrap();
        let wrong = Array2::<f32>::ones((3, 15));
        assert!(matches!(pool.output(wrong.view()), Err(Error::ShapeMismatch { .. })));
        let mut nan = good.clone();
        nan[[2, 7]] = f32::NAN;
        match pool.output(nan.view()) {
            Err(Error::NonFinite { layer, what }) => {
                assert_eq!(layer, "input");
                assert!(what.contains("row 2, column 7"), "{what}");
            }
            other => panic!("{other:?}"),
        }
        let empty = Array2::<f32>::zeros((0, 16));
        assert!(matches!(pool.output(empty.view()), Err(Error::InvalidInput(_))));
        let mut small = Array2::<f32>::zeros((2, 5));
        assert!(matches!(pool.output_into(good.view(), small.view_mut()), Err(Error::ShapeMismatch { .. })));
        assert_eq!(pool.output(good.view()).unwrap(), expected);
    }
    assert!(matches!(InferencePool::new(model.clone(), PoolConfig::direct(0)), Err(Error::InvalidConfig { .. })));
}

#[test]
fn busy_timeouts_and_close_are_errors_never_hangs() {
    let model = Arc::new(mlp(WorkspaceMode::Planned, 2).freeze().unwrap());
    let pool = InferencePool::new(model, PoolConfig::direct(2)).unwrap();
    let x = Array2::<f32>::ones((2, 16));
    let mut out = Array2::<f32>::zeros((2, 5));
    let a = pool.lease().unwrap();
    let b = pool.try_lease().unwrap();
    assert!(matches!(pool.try_lease(), Err(Error::PoolBusy { arenas: 2 })));
    assert!(matches!(pool.try_output(x.view(), out.view_mut()), Err(Error::PoolBusy { .. })));
    match pool.output_timeout(x.view(), out.view_mut(), Duration::from_millis(20)) {
        Err(Error::Timeout { arenas: 2, waited }) => assert!(waited >= Duration::from_millis(20)),
        other => panic!("{other:?}"),
    }
    drop(b);
    pool.try_output(x.view(), out.view_mut()).unwrap();
    // Waiters are woken by a close with an error.
    std::thread::scope(|s| {
        let b = pool.lease().unwrap();
        let waited = pool.stats().waited;
        let waiters: Vec<_> = (0..3).map(|_| s.spawn(|| pool.output(x.view()))).collect();
        // Until all three wait (bounded: 10 s), so that the close wakes them.
        let start = std::time::Instant::now();
        while pool.stats().waited < waited + 3 {
            assert!(start.elapsed() < Duration::from_secs(10), "the waiters never waited");
            std::thread::yield_now();
        }
        pool.close();
        for w in waiters {
            assert!(matches!(w.join().unwrap(), Err(Error::PoolClosed)));
        }
        drop(b);
    });
    drop(a);
    assert!(matches!(pool.lease(), Err(Error::PoolClosed)));
    let stats = pool.stats();
    assert_eq!((stats.busy, stats.timeouts), (2, 1), "{stats:?}");
}

/// A layer that panics on a marked row, and otherwise passes its input on.
struct Fragile;

impl Layer for Fragile {
    fn name(&self) -> &str {
        "fragile"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        let out = ctx.activations.copy_of(&input)?;
        assert!(input.iter().all(|&v| v != 42.0), "fragile met 42");
        Ok(carve::freeze(out))
    }
}

/// Keeps `value` alive, and reachable, for the rest of the process: a reference a
/// layer kept leaves its arena leaked, and leak checkers (valgrind) should see it
/// still reachable rather than lost.
fn park<T>(value: T) {
    static PARKED: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    PARKED.lock().unwrap().push(Box::into_raw(Box::new(value)) as usize);
}

/// A layer that keeps a clone of the arena's manager on a marked row.
struct Keeper;

impl Layer for Keeper {
    fn name(&self) -> &str {
        "keeper"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        if input.iter().any(|&v| v == 7.0) {
            park::<LayerWorkspaceMgr>(ctx.mgr.clone());
        }
        Ok(carve::freeze(ctx.activations.copy_of(&input)?))
    }
}

#[test]
fn a_panicking_layer_fails_its_request_only() {
    let config = NetworkConfig::builder(3).layer(Fragile).layer(Keeper).build().unwrap();
    let model = Arc::new(Model::from_config(&config, Vec::new()).unwrap());
    for mode in [PoolMode::Direct, PoolMode::Batched] {
        let config = PoolConfig { workers: 1, mode, ..PoolConfig::batched(1, 4, Duration::from_micros(50)) };
        let pool = InferencePool::new(model.clone(), config).unwrap();
        let good = Array2::from_shape_fn((2, 3), |(r, c)| (r + c) as f32);
        let expected = pool.output(good.view()).unwrap();
        let mut bad = good.clone();
        bad[[1, 1]] = 42.0;
        match pool.output(bad.view()) {
            Err(Error::Panicked { message }) => assert!(message.contains("fragile met 42"), "{message}"),
            other => panic!("{other:?}"),
        }
        for _ in 0..3 {
            assert_eq!(pool.output(good.view()).unwrap(), expected, "{mode:?}: the arena was left clean");
        }
        // A layer that keeps the arena's manager: the request succeeds, the arena is
        // replaced, and the pool goes on.
        let mut marked = good.clone();
        marked[[0, 0]] = 7.0;
        let kept = pool.output(marked.view()).unwrap();
        assert_eq!(kept[[0, 0]].to_bits(), model.output(marked.view()).unwrap()[[0, 0]].to_bits());
        assert_eq!(pool.output(good.view()).unwrap(), expected);
        let stats = pool.stats();
        assert_eq!((stats.panics, stats.rebuilt_arenas), (1, 1), "{mode:?}: {stats:?}");
    }
}

#[test]
fn batched_requests_get_the_bits_they_get_alone() {
    let model = Arc::new(mlp(WorkspaceMode::Planned, 4).freeze().unwrap());
    let mut rng = Rng::new(17);
    // Random requests: 1 to 20 rows (some larger than max_batch, so split).
    let requests: Vec<Array2<f32>> = (0..60)
        .map(|i| {
            let rows = 1 + (rng.uniform(0.0, 20.0) as usize) % 20;
            let mut x = random(rows, 16, &mut rng);
            x[[0, 0]] = i as f32;
            x
        })
        .collect();
    let alone: Vec<Array2<f32>> = requests.iter().map(|x| model.output(x.view()).unwrap()).collect();
    for (workers, max_batch) in [(1, 8), (2, 16), (2, 64)] {
        let pool = InferencePool::new(model.clone(), PoolConfig::batched(workers, max_batch, Duration::from_millis(2)))
            .unwrap();
        std::thread::scope(|s| {
            for t in 0..8 {
                let (pool, requests, alone) = (&pool, &requests, &alone);
                s.spawn(move || {
                    for i in (t..requests.len()).step_by(8) {
                        let got = pool.output(requests[i].view()).unwrap();
                        assert_eq!(got, alone[i], "request {i} ({} rows), batched", requests[i].nrows());
                        let mut out = Array2::zeros(alone[i].raw_dim());
                        pool.output_into(Input::from(requests[i].view()), out.view_mut()).unwrap();
                        assert_eq!(out, alone[i]);
                    }
                });
            }
        });
        let stats = pool.stats();
        let rows: usize = requests.iter().map(|x| x.nrows()).sum();
        assert_eq!(stats.batched_rows, 2 * rows as u64, "{stats:?}");
        // Alone, each request would take a batch per `max_batch` rows (twice over).
        let alone_batches: usize = requests.iter().map(|x| 2 * x.nrows().div_ceil(max_batch)).sum();
        assert!(stats.batches < alone_batches as u64, "requests were coalesced ({alone_batches} alone): {stats:?}");
    }
}

#[test]
fn closing_a_batched_pool_fails_its_waiting_requests() {
    let model = Arc::new(mlp(WorkspaceMode::Planned, 6).freeze().unwrap());
    // A wait longer than the test: requests sit in the queue until the close.
    let pool = InferencePool::new(model, PoolConfig::batched(1, 1000, Duration::from_secs(60))).unwrap();
    let x = Array2::<f32>::ones((2, 16));
    std::thread::scope(|s| {
        let waiters: Vec<_> = (0..4).map(|_| s.spawn(|| pool.output(x.view()))).collect();
        std::thread::sleep(Duration::from_millis(50));
        pool.close();
        for w in waiters {
            assert!(matches!(w.join().unwrap(), Err(Error::PoolClosed)));
        }
    });
    let mut out = Array2::zeros((2, 5));
    assert!(matches!(pool.output_into(x.view(), out.view_mut()), Err(Error::PoolClosed)));
    // A timeout takes the request out of the queue.
    let pool = InferencePool::new(
        Arc::new(mlp(WorkspaceMode::Planned, 6).freeze().unwrap()),
        PoolConfig::batched(1, 1000, Duration::from_secs(60)),
    )
    .unwrap();
    assert!(matches!(
        pool.output_timeout(x.view(), out.view_mut(), Duration::from_millis(10)),
        Err(Error::Timeout { .. })
    ));
    assert_eq!(pool.stats().batches, 0);
}

#[test]
fn warm_up_plans_every_arena_so_that_later_requests_plan_nothing() {
    let model = Arc::new(mlp(WorkspaceMode::Planned, 8).freeze().unwrap());
    let mut rng = Rng::new(21);
    for config in [PoolConfig::direct(3), PoolConfig::batched(3, 12, Duration::ZERO)] {
        let batched = config.mode == PoolMode::Batched;
        let pool = InferencePool::new(model.clone(), config).unwrap();
        let template = random(5, 16, &mut rng);
        pool.warm_up(template.view()).unwrap();
        let after = pool.stats();
        // Every arena holds a plan: direct, of 5 rows; batched, of 1 to 12 rows.
        assert_eq!(after.off_plan, if batched { 3 * 12 } else { 3 }, "{after:?}");
        assert!(after.arena_bytes > 0 && after.arena_bytes.is_multiple_of(3), "{after:?}");
        std::thread::scope(|s| {
            for t in 0..6 {
                let (pool, model) = (&pool, &model);
                s.spawn(move || {
                    let mut rng = Rng::new(t);
                    for _ in 0..20 {
                        // Direct: the warmed shape; batched: any size, batches of 1 to 12 rows.
                        let rows = if batched { 1 + rng.below(12) } else { 5 };
                        let x = random(rows, 16, &mut rng);
                        assert_eq!(pool.output(x.view()).unwrap(), model.output(x.view()).unwrap());
                    }
                });
            }
        });
        let later = pool.stats();
        assert_eq!((later.off_plan, later.arena_bytes), (after.off_plan, after.arena_bytes), "{later:?}");
        assert!(later.on_plan > after.on_plan, "{later:?}");
        // Bad input is refused before any arena is touched.
        assert!(matches!(pool.warm_up(random(2, 15, &mut rng).view()), Err(Error::ShapeMismatch { .. })));
    }
}

#[test]
fn a_caller_that_keeps_taking_the_arena_back_cannot_starve_a_waiter() {
    let model = Arc::new(mlp(WorkspaceMode::Planned, 3).freeze().unwrap());
    let pool = InferencePool::new(model, PoolConfig::direct(1)).unwrap();
    let x = Array2::<f32>::ones((1, 16));
    for round in 0..5 {
        std::thread::scope(|s| {
            let mut held = pool.lease().unwrap();
            let waited = pool.stats().waited;
            let waiter = s.spawn(|| pool.output(x.view()).map(|_| ()));
            // Until the waiter is waiting (bounded: 10 s), then past the 1 ms bound.
            let start = std::time::Instant::now();
            while pool.stats().waited == waited {
                assert!(start.elapsed() < Duration::from_secs(10), "the waiter never waited");
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(3));
            // A greedy caller gives the arena back and takes it again at once. Without
            // a bound, it could keep it from the waiter for ever; with one, the waiter
            // is handed the arena within a few rounds.
            let mut taken_back = 0;
            loop {
                drop(held);
                // Served: the arena was handed to the waiter (busy now), or the waiter
                // already ran and gave it back.
                if waiter.is_finished() {
                    break;
                }
                match pool.try_lease() {
                    Ok(lease) => held = lease,
                    Err(Error::PoolBusy { .. }) => break,
                    Err(other) => panic!("{other:?}"),
                }
                taken_back += 1;
                assert!(taken_back < 2_000, "round {round}: the waiter starved: {:?}", pool.stats());
                std::thread::sleep(Duration::from_micros(200));
            }
            waiter.join().unwrap().unwrap();
        });
        drop(pool.try_lease().unwrap());
    }
    // Timed-out waiters leave nothing stranded: the arena is still leased in turn.
    let held = pool.lease().unwrap();
    std::thread::scope(|s| {
        let late: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| pool.output_timeout(x.view(), Array2::zeros((1, 5)).view_mut(), Duration::from_millis(5)))
            })
            .collect();
        for t in late {
            assert!(matches!(t.join().unwrap(), Err(Error::Timeout { .. })));
        }
    });
    drop(held);
    drop(pool.try_lease().unwrap());
}

#[test]
fn warm_up_does_not_deadlock_with_callers_holding_leases() {
    let model = Arc::new(mlp(WorkspaceMode::Planned, 4).freeze().unwrap());
    let pool = Arc::new(InferencePool::new(model, PoolConfig::direct(2)).unwrap());
    let (done, finished) = std::sync::mpsc::channel();
    for round in 0..10 {
        // A caller holds one arena and asks the pool for another while a warm-up runs:
        // both finish. Detached threads, so that a deadlock fails the test (20 s)
        // rather than hanging it.
        let (pool, done) = (Arc::clone(&pool), done.clone());
        std::thread::spawn(move || {
            let x = Array2::<f32>::ones((3, 16));
            std::thread::scope(|inner| {
                let caller = inner.spawn(|| {
                    let held = pool.lease().unwrap();
                    std::thread::sleep(Duration::from_millis(2));
                    let out = pool.output(x.view());
                    drop(held);
                    out.map(drop)
                });
                let warm = inner.spawn(|| pool.warm_up(x.view()));
                caller.join().unwrap().unwrap();
                warm.join().unwrap().unwrap();
            });
            done.send(round).unwrap();
        });
        assert_eq!(finished.recv_timeout(Duration::from_secs(20)), Ok(round), "deadlocked in round {round}");
    }
}

#[test]
fn batched_requests_from_strided_views_with_timeouts_and_a_close_leave_nothing_behind() {
    let model = Arc::new(mlp(WorkspaceMode::Planned, 9).freeze().unwrap());
    let pool = InferencePool::new(model.clone(), PoolConfig::batched(2, 4, Duration::from_micros(500))).unwrap();
    let mut rng = Rng::new(31);
    // Rows every other row of a larger array, and columns-first: the pool reads them
    // where they are.
    let big = random(20, 16, &mut rng);
    let every_other = big.slice(ndarray::s![..;2, ..]);
    let columns_first = random(16, 7, &mut rng).reversed_axes();
    for x in [every_other, columns_first.view()] {
        let expected = model.output(x.to_owned().view()).unwrap();
        // Written into every third row of a larger buffer.
        let mut buffer = Array2::<f32>::from_elem((3 * x.nrows(), 5), -1.0);
        pool.output_into(x, buffer.slice_mut(ndarray::s![..;3, ..])).unwrap();
        assert_eq!(buffer.slice(ndarray::s![..;3, ..]), expected);
        assert!(buffer.slice(ndarray::s![1..;3, ..]).iter().all(|&v| v == -1.0), "rows between untouched");
    }
    // Requests split across batches, many timing out mid-way: what completes has its
    // bits, what times out is an error, and the pool goes on.
    std::thread::scope(|s| {
        for t in 0..6 {
            let (pool, model) = (&pool, &model);
            s.spawn(move || {
                let mut rng = Rng::new(100 + t);
                for i in 0..30 {
                    let x = random(1 + rng.below(10), 16, &mut rng);
                    let mut out = Array2::<f32>::zeros((x.nrows(), 5));
                    let timeout = Duration::from_micros(if i % 2 == 0 { 1 } else { 50_000 });
                    match pool.output_timeout(x.view(), out.view_mut(), timeout) {
                        Ok(()) => assert_eq!(out, model.output(x.view()).unwrap()),
                        Err(Error::Timeout { .. }) => {}
                        Err(other) => panic!("{other:?}"),
                    }
                }
            });
        }
    });
    let x = random(9, 16, &mut rng);
    assert_eq!(pool.output(x.view()).unwrap(), model.output(x.view()).unwrap());
    // A close while callers wait: each gets its result or PoolClosed, none hangs.
    std::thread::scope(|s| {
        let callers: Vec<_> = (0..6)
            .map(|t| {
                let pool = &pool;
                s.spawn(move || {
                    let mut rng = Rng::new(200 + t);
                    (0..50)
                        .map(|_| pool.output(random(1 + rng.below(10), 16, &mut rng).view()).map(drop))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(5));
        pool.close();
        for caller in callers {
            for outcome in caller.join().unwrap() {
                assert!(matches!(outcome, Ok(()) | Err(Error::PoolClosed)), "{outcome:?}");
            }
        }
    });
    assert!(matches!(pool.output(x.view()), Err(Error::PoolClosed)));
}

#[test]
fn arenas_given_back_together_wake_as_many_waiters() {
    let model = Arc::new(mlp(WorkspaceMode::Planned, 5).freeze().unwrap());
    let pool = InferencePool::new(model, PoolConfig::direct(2)).unwrap();
    for round in 0..10 {
        let (got, leased) = std::sync::mpsc::channel();
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let hold = Mutex::new(hold);
        std::thread::scope(|s| {
            let (x, y) = (pool.lease().unwrap(), pool.lease().unwrap());
            let waited = pool.stats().waited;
            for _ in 0..2 {
                let (pool, got, hold) = (&pool, got.clone(), &hold);
                s.spawn(move || {
                    let lease = pool.lease().unwrap();
                    got.send(()).unwrap();
                    // One of them keeps its arena until the end of the round.
                    let _ = hold.lock().unwrap().recv_timeout(Duration::from_secs(30));
                    drop(lease);
                });
            }
            let start = std::time::Instant::now();
            while pool.stats().waited < waited + 2 {
                assert!(start.elapsed() < Duration::from_secs(10), "the waiters never waited");
                std::thread::yield_now();
            }
            // Both arenas back at once: both waiters get one, though the first keeps its.
            drop((x, y));
            for n in 0..2 {
                let arrived = leased.recv_timeout(Duration::from_secs(10));
                assert!(arrived.is_ok(), "round {round}: waiter {n} was never woken for a free arena");
            }
            release.send(()).unwrap();
            release.send(()).unwrap();
        });
    }
}

#[test]
fn warm_up_from_a_thread_that_holds_a_lease_is_an_error_not_a_hang() {
    let model = Arc::new(mlp(WorkspaceMode::Planned, 6).freeze().unwrap());
    let pool = InferencePool::new(model, PoolConfig::direct(1)).unwrap();
    let x = Array2::<f32>::ones((2, 16));
    let lease = pool.lease().unwrap();
    match pool.warm_up(x.view()) {
        Err(Error::InvalidInput(message)) => assert!(message.contains("holds a lease"), "{message}"),
        other => panic!("expected an error, got {other:?}"),
    }
    drop(lease);
    pool.warm_up(x.view()).unwrap();
    // While a warm-up waits for an arena, a caller trying for one is refused at once.
    let held = pool.lease().unwrap();
    std::thread::scope(|s| {
        let warm = s.spawn(|| pool.warm_up(x.view()));
        std::thread::sleep(Duration::from_millis(20));
        assert!(matches!(pool.try_lease(), Err(Error::PoolBusy { .. })));
        // This thread's own warm-up is refused, not queued behind the other one (which
        // waits for the arena this thread holds).
        match pool.warm_up(x.view()) {
            Err(Error::InvalidInput(message)) => assert!(message.contains("holds a lease"), "{message}"),
            other => panic!("expected an error, got {other:?}"),
        }
        drop(held);
        warm.join().unwrap().unwrap();
    });
    drop(pool.try_lease().unwrap());
}

/// Issue: `PoolConfig::batched(1, 1 << 36, ..)` was accepted, and the batch worker then
/// asked the allocator for 4 TiB in its own thread, which ended the process. Whatever a
/// pool needs is reserved before `new` returns, and a size the machine cannot give is
/// refused there, named.
#[test]
fn pool_sizes_the_machine_cannot_give_are_refused_by_new_not_aborts_in_a_worker() {
    let model = Arc::new(mlp(WorkspaceMode::Enabled, 1).freeze().unwrap());
    let start = std::time::Instant::now();
    for (max_batch, bytes) in [(1usize << 36, "4398046511104 bytes"), (usize::MAX, "more than usize::MAX bytes")] {
        let refused = InferencePool::new(model.clone(), PoolConfig::batched(1, max_batch, Duration::ZERO));
        let Err(Error::InvalidConfig { reason }) = refused else { panic!("max_batch {max_batch}: {refused:?}") };
        assert!(reason.contains(&format!("max_batch {max_batch}")) && reason.contains(bytes), "{reason}");
    }
    // Counts of arenas (and worker threads) are bounded before anything is made.
    for workers in [carve::nn::limits::MAX_THREADS + 1, usize::MAX] {
        for config in [PoolConfig::direct(workers), PoolConfig::batched(workers, 4, Duration::ZERO)] {
            let refused = InferencePool::new(model.clone(), config);
            let Err(Error::InvalidConfig { reason }) = refused else { panic!("{workers} workers: {refused:?}") };
            assert!(reason.contains(&workers.to_string()) && reason.contains("MAX_THREADS"), "{reason}");
        }
    }
    assert!(start.elapsed() < Duration::from_secs(5), "refusing took {:?}", start.elapsed());
    // A large batch the machine can hold is served, and warms up.
    let pool = InferencePool::new(model.clone(), PoolConfig::batched(2, 1 << 12, Duration::ZERO)).unwrap();
    let x = random(3, 16, &mut Rng::new(5));
    assert_eq!(pool.output(x.view()).unwrap(), model.output(x.view()).unwrap());
}

#[test]
fn thread_counts_beyond_the_bound_are_refused_in_training_too() {
    use carve::nn::{parallel::DataParallel, parallel::ParallelConfig};
    let mut net = mlp(WorkspaceMode::Enabled, 2);
    for threads in [0, carve::nn::limits::MAX_THREADS + 1, usize::MAX] {
        let refused = net.set_threads(threads).unwrap_err();
        assert!(matches!(refused, Error::InvalidConfig { .. }), "{threads}: {refused}");
    }
    for workers in [0, carve::nn::limits::MAX_THREADS + 1, usize::MAX] {
        for config in [ParallelConfig::threads(workers), ParallelConfig::sequential(workers)] {
            let refused = DataParallel::new(mlp(WorkspaceMode::Enabled, 2), config).map(drop).unwrap_err();
            assert!(matches!(&refused, Error::InvalidConfig { reason } if reason.contains("workers")), "{refused}");
        }
    }
    // A reducer (a safe trait: untrusted) that claims more workers than a trainer keeps
    // reports for: refused before a report is allocated.
    struct Vast(usize);
    impl carve::nn::parallel::Reducer for Vast {
        fn workers(&self) -> usize {
            self.0
        }
        fn rank(&self) -> usize {
            0
        }
        fn reduce(&mut self, _: &mut [f32]) -> carve::Result<std::ops::Range<usize>> {
            unreachable!("never called: the trainer is refused")
        }
        fn exchange(
            &mut self,
            _: carve::nn::parallel::Report,
            _: &mut [carve::nn::parallel::Report],
        ) -> carve::Result<()> {
            unreachable!("never called: the trainer is refused")
        }
    }
    for workers in [carve::nn::limits::MAX_RANKS + 1, 1 << 40, usize::MAX] {
        let refused = DataParallel::with_reducer(mlp(WorkspaceMode::Enabled, 2), Box::new(Vast(workers)), 1 << 20)
            .map(drop)
            .unwrap_err();
        assert!(matches!(&refused, Error::InvalidConfig { reason } if reason.contains("MAX_RANKS")), "{refused}");
    }
}

/// A `max_wait` too long to add to an instant (`Duration::MAX`: wait for a full batch,
/// however long) is a batch that waits for company, not a worker thread that panics on
/// the overflow and leaves every later request waiting for ever.
#[test]
fn a_batching_wait_too_long_to_represent_waits_for_a_full_batch() {
    let model = Arc::new(mlp(WorkspaceMode::Enabled, 4).freeze().unwrap());
    let pool = InferencePool::new(model.clone(), PoolConfig::batched(1, 2, Duration::MAX)).unwrap();
    let x = random(2, 16, &mut Rng::new(8));
    let mut one = Array2::zeros((1, 5));
    let alone = pool.output_timeout(x.slice(ndarray::s![..1, ..]), one.view_mut(), Duration::from_millis(50));
    assert!(matches!(alone, Err(Error::Timeout { .. })), "a lone row waits for company: {alone:?}");
    // Two rows fill the batch: it runs at once.
    let mut two = Array2::zeros((2, 5));
    pool.output_timeout(x.view(), two.view_mut(), Duration::from_secs(20)).unwrap();
    assert_eq!(two, model.output(x.view()).unwrap());
}

/// Issue: a batched worker took a request's rows, then waited for an arena without
/// limit, and the request waited for its rows: `output_timeout` returned only when the
/// arena came back (never, when the caller held it). A worker now takes rows only once
/// it holds an arena, so a request's timeout holds whatever the arenas do.
#[test]
fn a_batched_requests_timeout_holds_while_every_arena_is_leased() {
    let model = Arc::new(mlp(WorkspaceMode::Enabled, 6).freeze().unwrap());
    let pool = InferencePool::new(model.clone(), PoolConfig::batched(1, 4, Duration::ZERO)).unwrap();
    let x = random(2, 16, &mut Rng::new(12));
    let mut out = Array2::zeros((2, 5));
    // The caller itself holds the only arena.
    let lease = pool.lease().unwrap();
    let start = std::time::Instant::now();
    let waited = pool.output_timeout(x.view(), out.view_mut(), Duration::from_millis(100));
    let took = start.elapsed();
    assert!(matches!(waited, Err(Error::Timeout { .. })), "{waited:?}");
    assert!(took < Duration::from_secs(5), "the timeout of 100 ms returned after {took:?}");
    // The forms that wait without a deadline would wait for this thread's own lease:
    // refused at once, in both modes.
    let refused = pool.try_output(x.view(), out.view_mut());
    assert!(matches!(&refused, Err(Error::InvalidInput(m)) if m.contains("would wait for itself")), "{refused:?}");
    assert!(matches!(pool.output(x.view()), Err(Error::InvalidInput(_))));
    drop(lease);
    let direct = InferencePool::new(model.clone(), PoolConfig::direct(1)).unwrap();
    let held = direct.lease().unwrap();
    assert!(matches!(direct.output(x.view()), Err(Error::InvalidInput(_))));
    assert!(matches!(direct.try_output(x.view(), out.view_mut()), Err(Error::PoolBusy { .. })));
    let forgotten = direct.lease_timeout(Duration::from_millis(10));
    assert!(matches!(forgotten, Err(Error::Timeout { .. })), "{forgotten:?}");
    std::mem::forget(held);
    assert!(matches!(direct.output(x.view()), Err(Error::InvalidInput(_))), "a forgotten lease is still held");
    // Another thread holds it for a while: the timeout still holds, and the pool serves
    // once the arena is back.
    std::thread::scope(|s| {
        let (leased, wait) = std::sync::mpsc::channel();
        let pool = &pool;
        let holder = s.spawn(move || {
            let held = pool.lease().unwrap();
            leased.send(()).unwrap();
            std::thread::sleep(Duration::from_secs(3));
            drop(held);
        });
        wait.recv().unwrap();
        let start = std::time::Instant::now();
        let waited = pool.output_timeout(x.view(), out.view_mut(), Duration::from_millis(50));
        assert!(matches!(waited, Err(Error::Timeout { .. })), "{waited:?}");
        // Well before the arena comes back (3 s), even under valgrind.
        assert!(start.elapsed() < Duration::from_secs(2), "returned after {:?}", start.elapsed());
        // A request that may not wait is refused while another caller holds every
        // arena, not queued until it gives it back.
        let start = std::time::Instant::now();
        let busy = pool.try_output(x.view(), out.view_mut());
        assert!(matches!(busy, Err(Error::PoolBusy { arenas: 1 })), "{busy:?}");
        assert!(start.elapsed() < Duration::from_secs(2), "refused after {:?}", start.elapsed());
        holder.join().unwrap();
    });
    pool.output_timeout(x.view(), out.view_mut(), Duration::from_secs(20)).unwrap();
    assert_eq!(out, model.output(x.view()).unwrap());
}

/// A broadcast input claims any number of rows for the memory of one: a batched pool's
/// `output` checked the request only after allocating its answer, and the process
/// aborted. Both modes refuse it with a typed error.
#[test]
fn a_broadcast_input_of_vast_rows_is_an_error_in_both_modes() {
    let model = Arc::new(mlp(WorkspaceMode::Enabled, 9).freeze().unwrap());
    let row = Array2::<f32>::ones((1, 16));
    let vast = row.broadcast((1 << 40, 16)).unwrap();
    for config in [PoolConfig::batched(1, 4, Duration::ZERO), PoolConfig::direct(1)] {
        let pool = InferencePool::new(model.clone(), config).unwrap();
        let refused = pool.output(vast.view());
        assert!(refused.is_err(), "{:?}", pool.config().mode);
        // And the pool goes on.
        assert_eq!(pool.output(row.view()).unwrap(), model.output(row.view()).unwrap());
    }
}

#[test]
fn a_model_serves_in_its_callers_thread_workspaces_and_arena_stacks_change_no_bits() {
    let model = Arc::new(mlp(WorkspaceMode::Planned, 9).freeze().unwrap());
    let x = random(5, 16, &mut Rng::new(23));
    std::thread::scope(|s| {
        s.spawn(|| {
            assert_eq!(Model::thread_workspace_bytes(), 0, "a new thread has no serving workspaces");
            let first = model.output(x.view()).unwrap();
            let planned = Model::thread_workspace_bytes();
            assert!(planned > 0);
            for _ in 0..3 {
                assert_eq!(model.output(x.view()).unwrap(), first);
            }
            assert_eq!(Model::thread_workspace_bytes(), planned, "the shape's plan is kept");
            Model::release_thread_workspaces().unwrap();
            assert_eq!(Model::thread_workspace_bytes(), 0);
            assert_eq!(model.output(x.view()).unwrap(), first);
            // Requests on the arenas' own stacks (opt-in) get the same bits.
            for config in [
                PoolConfig::direct(2).with_arena_stacks(true),
                PoolConfig::batched(2, 4, Duration::ZERO).with_arena_stacks(true),
            ] {
                let pool = InferencePool::new(model.clone(), config).unwrap();
                assert_eq!(pool.output(x.view()).unwrap(), first, "{:?}", pool.config());
            }
        })
        .join()
        .unwrap();
    });
}

/// A layer that serves another model from inside its own forward pass.
struct Nested(Arc<Model>);

impl Layer for Nested {
    fn name(&self) -> &str {
        "nested"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        self.0.output(input)?;
        Ok(carve::freeze(ctx.activations.copy_of(&input)?))
    }
}

#[test]
fn a_model_served_from_inside_another_models_request_is_an_error_not_a_panic() {
    let inner = Arc::new(Network::new(NetworkConfig::builder(3).dense(3).build().unwrap()).unwrap().freeze().unwrap());
    let config = NetworkConfig::builder(3).layer(Nested(inner.clone())).build().unwrap();
    let outer = Model::from_config(&config, Vec::new()).unwrap();
    let x = Array2::<f32>::ones((2, 3));
    match outer.output(x.view()) {
        Err(Error::InvalidInput(message)) => assert!(message.contains("InferencePool"), "{message}"),
        other => panic!("{other:?}"),
    }
    // From a pool's arena the inner model has the thread's workspaces to itself.
    let pool = InferencePool::new(Arc::new(outer), PoolConfig::direct(1)).unwrap();
    let probs = pool.output(x.view()).unwrap();
    assert!(probs.iter().all(|&p| (p - 1.0 / 3.0).abs() < 1e-6), "{probs:?}");
    assert!(inner.output(x.view()).is_ok());
}

#[test]
fn a_request_alone_in_the_batch_queue_is_taken_whatever_its_rows_and_a_bad_one_is_refused_before_any_wait() {
    let model = Arc::new(mlp(WorkspaceMode::Enabled, 3).freeze().unwrap());
    let x = random(9, 16, &mut Rng::new(5));
    let expected = model.output(x.view()).unwrap();
    // More rows than `max_queued_rows`, into an idle pool: taken (refused, it would be
    // refused as busy forever), with the bits of the model's own.
    let batched = || PoolConfig { max_queued_rows: 8, ..PoolConfig::batched(2, 4, Duration::ZERO) };
    let pool = InferencePool::new(model.clone(), batched()).unwrap();
    let mut out = Array2::zeros((9, 5));
    pool.try_output(x.view(), out.view_mut()).unwrap();
    assert_eq!(out, expected);
    let none = InferencePool::new(model.clone(), PoolConfig { max_queued_rows: 0, ..batched() });
    assert!(matches!(none, Err(Error::InvalidConfig { .. })), "{none:?}");
    // A request that cannot run says so at once, whether or not an arena is free: the
    // same answer as from an idle pool, not a busy pool's.
    let pool = InferencePool::new(model.clone(), PoolConfig::direct(1)).unwrap();
    let mut nan = x.clone();
    nan[[3, 7]] = f32::NAN;
    let narrow = random(2, 15, &mut Rng::new(6));
    let _held = pool.lease().unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            let start = std::time::Instant::now();
            let mut out = Array2::zeros((9, 5));
            let refused = pool.try_output(nan.view(), out.view_mut());
            assert!(matches!(refused, Err(Error::NonFinite { .. })), "{refused:?}");
            let refused = pool.output_timeout(nan.view(), out.view_mut(), Duration::from_secs(5));
            assert!(matches!(refused, Err(Error::NonFinite { .. })), "{refused:?}");
            let refused = pool.output_timeout(narrow.view(), out.view_mut(), Duration::from_secs(5));
            assert!(matches!(refused, Err(Error::ShapeMismatch { .. })), "{refused:?}");
            assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
            // A good one still waits for the held arena.
            let busy = pool.try_output(x.view(), out.view_mut());
            assert!(matches!(busy, Err(Error::PoolBusy { .. })), "{busy:?}");
        });
    });
}
