//! Planned training ([`WorkspaceMode::Planned`]): the role workspaces of an iteration
//! served from one arena planned from the first iteration's lifetimes. The numbers are
//! bit-identical to unplanned training; identical iterations stay on their plan, make
//! no heap allocation, and take at most 1.05x the bytes live at once; batches of a
//! new shape are recorded and planned once, then replayed.

use carve::alloc_check::{assert_no_alloc, CountingAllocator};
use carve::nn::{Network, NetworkConfig, Updater};
use carve::WorkspaceMode;
use carve_rng::Rng;
use ndarray::{s, Array1, Array2, Array3, ShapeBuilder};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

fn data(rows: usize) -> (Array2<f32>, Array1<u32>) {
    let mut rng = Rng::new(5);
    let y: Array1<u32> = (0..rows).map(|i| (i % 4) as u32).collect();
    let x = Array2::from_shape_fn((rows, 12), |(i, j)| (y[i] as f32 - 1.5) * (j % 3) as f32 + rng.uniform(-0.3, 0.3));
    (x, y)
}

fn mlp(mode: WorkspaceMode) -> Network {
    let config = NetworkConfig::builder(12)
        .dense(32)
        .relu()
        .dense(16)
        .relu()
        .dense(4)
        .seed(11)
        .updater(Updater::adam(1e-3))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

fn lstm(mode: WorkspaceMode) -> Network {
    let config = NetworkConfig::builder(3)
        .lstm(8)
        .last_step()
        .dense(3)
        .seed(2)
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

#[test]
fn planned_training_is_bit_identical_stays_on_its_plan_and_allocates_nothing() {
    let (x, y) = data(100);
    // Batches of 16 and a ragged last batch of 4: two shapes, two plans.
    let batches: Vec<(usize, usize)> = (0..100).step_by(16).map(|start| (start, (start + 16).min(100))).collect();
    let mut enabled = mlp(WorkspaceMode::Enabled);
    let mut planned = mlp(WorkspaceMode::Planned);
    for epoch in 0..6 {
        for &(a, b) in &batches {
            let (xb, yb) = (x.slice(s![a..b, ..]), y.slice(s![a..b]));
            let le = enabled.fit_batch(xb, yb).unwrap();
            let lp = if epoch >= 3 {
                assert_no_alloc(|| planned.fit_batch(xb, yb)).unwrap()
            } else {
                planned.fit_batch(xb, yb).unwrap()
            };
            assert_eq!(le.to_bits(), lp.to_bits(), "epoch {epoch}, rows {a}..{b}");
        }
    }
    let stats = planned.memory_plan().unwrap();
    assert_eq!((stats.plans, stats.replans, stats.divergences), (2, 0, 0), "{stats:?}");
    assert_eq!(stats.planned_iterations, 6 * 7 - 2);
    assert!(stats.plan_bytes as f64 <= 1.05 * stats.lower_bound_bytes as f64, "{stats:?}");
    assert!(stats.plan_bytes < stats.per_role_bytes, "{stats:?}");
    // The arena is the network's workspace memory: less than the per-role layout's.
    assert_eq!(planned.workspace_capacity(), stats.arena_bytes);
    assert!(planned.workspace_capacity() < enabled.workspace_capacity());
    let plan = planned.memory_plan().unwrap();
    assert_eq!((plan.plan_bytes, plan.divergences, plan.replans), (stats.plan_bytes, 0, 0));
    // Evaluation (planned inference here) gives the same numbers too.
    let (ae, ap) =
        (enabled.evaluate(x.view(), y.view(), 32).unwrap(), planned.evaluate(x.view(), y.view(), 32).unwrap());
    assert_eq!(ae.to_bits(), ap.to_bits());
}

#[test]
fn variable_length_sequences_get_a_plan_per_shape_and_the_arena_stops_growing() {
    let mut rng = Rng::new(8);
    let batches: Vec<(Array3<f32>, Array2<f32>, Array1<u32>)> = (0..6)
        .map(|i| {
            let steps = 3 + (i * 4) % 7;
            let x = Array3::from_shape_fn((4, steps, 3), |_| rng.uniform(-1.0, 1.0));
            let m = Array2::from_shape_fn((4, steps), |(r, t)| if t < steps - (r % 2) { 1.0 } else { 0.0 });
            let y = Array1::from_shape_fn(4, |r| ((r + i) % 3) as u32);
            (x, m, y)
        })
        .collect();
    let (mut enabled, mut planned) = (lstm(WorkspaceMode::Enabled), lstm(WorkspaceMode::Planned));
    let mut capacity = Vec::new();
    for _ in 0..4 {
        for (x, m, y) in &batches {
            let le = enabled.fit_batch((x.view(), m.view()), y.view()).unwrap();
            let lp = planned.fit_batch((x.view(), m.view()), y.view()).unwrap();
            assert_eq!(le.to_bits(), lp.to_bits());
        }
        capacity.push(planned.workspace_capacity());
    }
    let stats = planned.memory_plan().unwrap();
    let shapes = 6; // lengths 3, 7, 4, 8, 5, 9
    assert_eq!((stats.plans, stats.divergences, stats.evictions), (shapes, 0, 0), "{stats:?}");
    assert_eq!(stats.planned_iterations, 4 * 6 - shapes);
    assert!(capacity.windows(2).all(|w| w[0] == w[1]), "no growth after the first epoch: {capacity:?}");
    // The arena is the largest plan, within 1.05x of the largest batch's bound.
    let longest = batches.iter().max_by_key(|b| b.0.shape()[1]).unwrap();
    planned.fit_batch((longest.0.view(), longest.1.view()), longest.2.view()).unwrap();
    let last = planned.memory_plan().unwrap();
    assert_eq!(last.arena_bytes, last.plan_bytes, "the longest batch's plan is the largest");
    assert!(last.arena_bytes as f64 <= 1.05 * last.lower_bound_bytes as f64, "{last:?}");
}

#[test]
fn planned_inference_is_bit_identical_stays_on_its_plan_and_allocates_nothing() {
    let (x, y) = data(100);
    let mut enabled = mlp(WorkspaceMode::Enabled);
    let mut planned = mlp(WorkspaceMode::Planned);
    for _ in 0..3 {
        let (le, lp) = (enabled.fit_batch(x.view(), y.view()).unwrap(), planned.fit_batch(x.view(), y.view()).unwrap());
        assert_eq!(le.to_bits(), lp.to_bits());
    }
    let mut predicted = [0u32; 16];
    // Two shapes of input, each inferred twice a round: two plans.
    for round in 0..5 {
        for rows in [16usize, 7] {
            let xb = x.slice(s![..rows, ..]);
            let (oe, op) = (enabled.output(xb).unwrap(), planned.output(xb).unwrap());
            assert!(oe.iter().zip(op.iter()).all(|(a, b)| a.to_bits() == b.to_bits()), "round {round}, {rows} rows");
            let out = &mut predicted[..rows];
            if round >= 1 {
                // On its plan, an inference allocates nothing.
                assert_no_alloc(|| planned.predict_into(xb, &mut *out)).unwrap();
            } else {
                planned.predict_into(xb, &mut *out).unwrap();
            }
            let argmax: Vec<u32> = oe
                .rows()
                .into_iter()
                .map(|r| {
                    r.iter().enumerate().fold((0, f32::MIN), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0 as u32
                })
                .collect();
            assert_eq!(out, &argmax[..]);
        }
    }
    let stats = planned.inference_plan_stats().expect("inference is planned");
    assert_eq!((stats.plans, stats.replans, stats.divergences), (2, 0, 0), "{stats:?}");
    assert_eq!(stats.planned_iterations, 5 * 2 * 2 - 2, "{stats:?}");
    assert!(stats.plan_bytes as f64 <= 1.05 * stats.lower_bound_bytes as f64, "{stats:?}");
    assert!(stats.plan_bytes <= stats.per_role_bytes, "{stats:?}");
    assert!(stats.arena_bytes > 0 && stats.arena_bytes <= enabled.inference_mgr().capacity(), "{stats:?}");
    // The training plan is a group of its own, untouched by inference.
    assert_eq!(planned.memory_plan().unwrap().divergences, 0);
    assert!(enabled.inference_plan_stats().is_none());
    // Evaluation is inference too, and gives the same numbers.
    let (ae, ap) =
        (enabled.evaluate(x.view(), y.view(), 32).unwrap(), planned.evaluate(x.view(), y.view(), 32).unwrap());
    assert_eq!(ae.to_bits(), ap.to_bits());
    assert_eq!(planned.inference_plan_stats().unwrap().divergences, 0);
}

#[test]
fn batches_of_one_padded_shape_whose_padding_differs_keep_their_plans() {
    // One padded shape [4, 6, 3]; in the second mask steps 4 and 5 are padding in every
    // sequence, which the recurrent layer skips: the iterations differ, and each keeps a
    // plan of its own rather than taking the other's in turn.
    let mut rng = Rng::new(3);
    let x = Array3::from_shape_fn((4, 6, 3), |_| rng.uniform(-1.0, 1.0));
    let full = Array2::from_elem((4, 6), 1.0f32);
    let short = Array2::from_shape_fn((4, 6), |(_, t)| if t < 4 { 1.0 } else { 0.0 });
    let y = Array1::from_shape_fn(4, |r| (r % 3) as u32);
    let (mut enabled, mut planned) = (lstm(WorkspaceMode::Enabled), lstm(WorkspaceMode::Planned));
    for round in 0..6 {
        for mask in [&full, &short] {
            let le = enabled.fit_batch((x.view(), mask.view()), y.view()).unwrap();
            let lp = planned.fit_batch((x.view(), mask.view()), y.view()).unwrap();
            assert_eq!(le.to_bits(), lp.to_bits(), "round {round}");
            let (oe, op) =
                (enabled.output((x.view(), mask.view())).unwrap(), planned.output((x.view(), mask.view())).unwrap());
            assert!(oe.iter().zip(op.iter()).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
    for stats in [planned.memory_plan().unwrap(), planned.inference_plan_stats().unwrap()] {
        assert_eq!((stats.plans, stats.replans, stats.divergences), (2, 0, 0), "{stats:?}");
        assert_eq!(stats.planned_iterations, 6 * 2 - 2, "{stats:?}");
    }
}

#[test]
fn an_iteration_that_fails_part_way_is_abandoned_and_its_plan_stays_good() {
    let (x, y) = data(32);
    let mut planned = mlp(WorkspaceMode::Planned);
    for _ in 0..3 {
        planned.fit_batch(x.view(), y.view()).unwrap();
        planned.output(x.view()).unwrap();
    }
    // A value that is not finite fails the step part-way (after the forward pass has
    // begun); a wrong number of features fails inference before anything is allocated.
    let mut bad = x.clone();
    bad[[5, 3]] = f32::NAN;
    assert!(planned.fit_batch(bad.view(), y.view()).is_err());
    let narrow = Array2::<f32>::zeros((32, 5));
    assert!(planned.output(narrow.view()).is_err());
    // Neither left a stale plan, a divergence or a plan of its own behind.
    for _ in 0..2 {
        planned.fit_batch(x.view(), y.view()).unwrap();
        planned.output(x.view()).unwrap();
    }
    for stats in [planned.memory_plan().unwrap(), planned.inference_plan_stats().unwrap()] {
        assert_eq!((stats.plans, stats.replans, stats.divergences), (1, 0, 0), "{stats:?}");
        assert_eq!((stats.planned_iterations, stats.abandoned_iterations), (4, 1), "{stats:?}");
    }
    // The inference arena is the inference workspaces' memory.
    let arena = planned.inference_plan_stats().unwrap().arena_bytes;
    assert!(arena > 0);
    assert_eq!(planned.inference_mgr().capacity(), arena);
    // It can be given back; the next inference of the shape allocates it again.
    planned.inference_mgr().plan_group().unwrap().trim().unwrap();
    assert_eq!(planned.inference_mgr().capacity(), 0);
    planned.output(x.view()).unwrap();
    assert_eq!(planned.inference_mgr().capacity(), arena);
    assert_eq!(planned.inference_plan_stats().unwrap().planned_iterations, 5);
}

#[test]
fn a_features_mask_in_another_layout_gets_a_plan_of_its_own() {
    // Labels per step without a mask of their own take the features mask, copied when it
    // is not in standard layout: the same values in two layouts make two iterations,
    // each with its plan.
    let network = |mode| {
        let config = NetworkConfig::builder(3)
            .lstm(6)
            .dense(4)
            .seed(5)
            .training_workspace_mode(mode)
            .inference_workspace_mode(mode);
        Network::new(config.build().unwrap()).unwrap()
    };
    let mut rng = Rng::new(9);
    let x = Array3::from_shape_fn((3, 5, 3), |_| rng.uniform(-1.0, 1.0));
    let value = |(r, t): (usize, usize)| if t < 5 - r { 1.0f32 } else { 0.0 };
    let mask = Array2::from_shape_fn((3, 5), value);
    let columns = Array2::from_shape_fn((3, 5).f(), value); // the same values, column-major
    assert!(!columns.is_standard_layout() && columns == mask);
    let columns = columns.view();
    let labels = Array2::from_shape_fn((3, 5), |(r, t)| ((r + t) % 4) as u32);
    let (mut enabled, mut planned) = (network(WorkspaceMode::Enabled), network(WorkspaceMode::Planned));
    for round in 0..5 {
        for m in [mask.view(), columns] {
            let le = enabled.fit_batch((x.view(), m), labels.view()).unwrap();
            let lp = planned.fit_batch((x.view(), m), labels.view()).unwrap();
            assert_eq!(le.to_bits(), lp.to_bits(), "round {round}");
        }
    }
    let stats = planned.memory_plan().unwrap();
    assert_eq!((stats.plans, stats.replans, stats.divergences), (2, 0, 0), "{stats:?}");
    assert_eq!(stats.planned_iterations, 5 * 2 - 2);
}
