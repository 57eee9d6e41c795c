//! Sizing before the first step (`Network::dry_run`): the bytes a dry run predicts
//! against the bytes real steps and inferences then take, for the networks the
//! repository ships (the demo's MLP, another one, the LSTM of the sequences demo) in
//! every workspace mode, at several shapes; a dry run changes nothing of the network.

use carve::nn::{dry::BatchShape, dry::DryPass, dry::MemoryEstimate, Input, Labels, Network, NetworkConfig, Updater};
use carve::{Error, WorkspaceMode};
use ndarray::{s, Array1, Array2, Array3};

const MODES: [WorkspaceMode; 3] = [WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None];

fn mlp(mode: WorkspaceMode, inputs: usize, hidden: &[usize]) -> Network {
    let mut builder = NetworkConfig::builder(inputs);
    for &w in hidden {
        builder = builder.dense(w).relu();
    }
    let config = builder
        .dense(10)
        .seed(3)
        .updater(Updater::adam(1e-3))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

/// The sequences demo's network: an LSTM, the last step of each sequence, a dense head.
fn lstm(mode: WorkspaceMode) -> Network {
    let config = NetworkConfig::builder(12)
        .lstm(8)
        .last_step()
        .dense(9)
        .seed(5)
        .updater(Updater::adam(5e-3))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

/// A real batch of `shape`: values in (0, 1); sequences padded at their ends (their
/// lengths vary, the first is full), the padding zero and masked.
struct Batch {
    flat: Option<Array2<f32>>,
    features: Option<Array3<f32>>,
    mask: Option<Array2<f32>>,
    labels: Array1<u32>,
}

impl Batch {
    fn new(shape: BatchShape, inputs: usize, classes: u32, seed: usize) -> Batch {
        let value =
            |a: usize, b: usize, c: usize| ((a * 131 + b * 71 + c * 37 + seed * 17) % 251) as f32 / 251.0 + 1e-3;
        match shape {
            BatchShape::Flat { rows } => Batch {
                flat: Some(Array2::from_shape_fn((rows, inputs), |(r, c)| value(r, c, 0))),
                features: None,
                mask: None,
                labels: Array1::from_shape_fn(rows, |r| (r as u32 + seed as u32) % classes),
            },
            BatchShape::Sequences { batch, steps, masked, .. } => {
                let length = |b: usize| if b == 0 || !masked { steps } else { 1 + (b * 7 + seed) % steps };
                let mut features =
                    Array3::from_shape_fn((batch, steps, inputs), |(b, t, c)| value(b * steps + t, c, 1));
                let mut mask = Array2::<f32>::ones((batch, steps));
                for b in 0..batch {
                    features.slice_mut(s![b, length(b).., ..]).fill(0.0);
                    mask.slice_mut(s![b, length(b)..]).fill(0.0);
                }
                Batch {
                    flat: None,
                    features: Some(features),
                    mask: masked.then_some(mask),
                    labels: Array1::from_shape_fn(batch, |b| (b as u32 + seed as u32) % classes),
                }
            }
        }
    }

    fn input(&self) -> Input<'_> {
        match &self.flat {
            Some(x) => Input::Flat(x.view()),
            None => Input::Sequences {
                features: self.features.as_ref().unwrap().view(),
                mask: self.mask.as_ref().map(|m| m.view()),
            },
        }
    }

    fn labels(&self) -> Labels<'_> {
        Labels::PerExample(self.labels.view())
    }
}

/// What a real pass of `pass` reports: a training step's
/// `last_iteration_workspace_bytes`, an inference's `last_inference_workspace_bytes`.
fn real_pass(net: &mut Network, pass: DryPass, inputs: usize, seed: usize) -> usize {
    let classes = net.classes() as u32;
    match pass {
        DryPass::Train(shape) => {
            let batch = Batch::new(shape, inputs, classes, seed);
            net.fit_batch(batch.input(), batch.labels()).unwrap();
            net.last_iteration_workspace_bytes()
        }
        DryPass::Infer(shape) => {
            let batch = Batch::new(shape, inputs, classes, seed);
            net.output(batch.input()).unwrap();
            net.last_inference_workspace_bytes()
        }
    }
}

/// Predicts `run` with a dry run, then runs it for real on `net` and checks every
/// figure: what each pass reports, each distinct pass's figures, the training and
/// inference arenas after the run; then each distinct pass once more, as a steady
/// repeat (every shape of these runs repeats, and their workspaces have learned).
fn check_prediction(mut net: Network, inputs: usize, run: &[DryPass], what: &str) {
    let estimate = net.dry_run(run).unwrap();
    assert_eq!(net.iterations(), 0, "{what}: a dry run trains nothing");
    let mode = net.training_workspace_mode();
    assert_eq!(estimate.per_pass_bytes.len(), run.len(), "{what}");
    for (i, &pass) in run.iter().enumerate() {
        let real = real_pass(&mut net, pass, inputs, i);
        assert_eq!(real, estimate.per_pass_bytes[i], "{what} ({mode:?}): pass {i}, {pass}");
    }
    assert_eq!(net.workspace_capacity(), estimate.workspace_bytes, "{what} ({mode:?}): the training arenas");
    assert_eq!(
        net.inference_workspace_capacity(),
        estimate.inference_workspace_bytes,
        "{what} ({mode:?}): the inference arenas"
    );
    for predicted in &estimate.passes {
        let last = run.iter().rposition(|&p| p == predicted.pass).expect("a pass of the run");
        assert_eq!(predicted.bytes, estimate.per_pass_bytes[last], "{what}: {predicted:?} at its last");
        let real = real_pass(&mut net, predicted.pass, inputs, 1000);
        assert_eq!(real, predicted.bytes, "{what} ({mode:?}): {} once more", predicted.pass);
        assert!(predicted.lower_bound_bytes <= predicted.plan_bytes, "{what}: {predicted:?}");
        assert!(predicted.plan_bytes <= predicted.per_role_bytes, "{what}: {predicted:?}");
        assert!(predicted.allocations > 0, "{what}: {predicted:?}");
        let off = match predicted.pass {
            DryPass::Train(_) => mode == WorkspaceMode::None,
            DryPass::Infer(_) => net.inference_workspace_mode() == WorkspaceMode::None,
        };
        if off {
            assert_eq!(predicted.bytes, 0, "{what}: no workspace bytes with workspaces off");
        }
    }
    if mode == WorkspaceMode::None {
        assert_eq!(estimate.workspace_bytes, 0);
    } else {
        assert!(estimate.workspace_bytes > 0, "{what}: {estimate:?}");
    }
    // The arenas named add up to the training and inference arenas.
    let named: usize = estimate.arenas.iter().map(|(_, b)| b).sum();
    assert_eq!(named, estimate.workspace_bytes + estimate.inference_workspace_bytes, "{what}: {estimate:?}");
    // The run did not outgrow the prediction either.
    assert_eq!(net.workspace_capacity(), estimate.workspace_bytes, "{what} ({mode:?}): after the steady passes");
}

/// The demo's epochs, shortened, as a run: steps of 32 rows and a short last one, then
/// the test set's evaluation in batches of 32 and a short last one, three times (long
/// enough for every workspace to learn its size: 16 cycles that allocate).
fn demo_run() -> Vec<DryPass> {
    let mut run = Vec::new();
    for _ in 0..3 {
        run.extend(std::iter::repeat_n(DryPass::Train(BatchShape::flat(32)), 6));
        run.push(DryPass::Train(BatchShape::flat(30)));
        run.extend(std::iter::repeat_n(DryPass::Infer(BatchShape::flat(32)), 5));
        run.push(DryPass::Infer(BatchShape::flat(7)));
    }
    run
}

#[test]
fn the_demo_mlp_takes_what_its_dry_run_predicts_in_every_mode() {
    for mode in MODES {
        check_prediction(mlp(mode, 64, &[128, 64]), 64, &demo_run(), "64-128-64-10");
    }
}

/// Training and inference in different modes: a mode without workspaces shares none
/// with the other, in the dry run as in the real run.
#[test]
fn mixed_modes_take_what_their_dry_run_predicts() {
    let pairs = [
        (WorkspaceMode::Enabled, WorkspaceMode::None),
        (WorkspaceMode::None, WorkspaceMode::Enabled),
        (WorkspaceMode::Planned, WorkspaceMode::Enabled),
        (WorkspaceMode::Enabled, WorkspaceMode::Planned),
    ];
    // Each on a thread of its own: enabled workspaces are the thread's, and an earlier
    // network's would keep what it taught them.
    for (training, inference) in pairs {
        std::thread::spawn(move || mixed(training, inference)).join().unwrap();
    }
}

fn mixed(training: WorkspaceMode, inference: WorkspaceMode) {
    let config = NetworkConfig::builder(64)
        .dense(48)
        .relu()
        .dense(10)
        .seed(3)
        .training_workspace_mode(training)
        .inference_workspace_mode(inference)
        .build()
        .unwrap();
    // Evaluation batches larger than the training ones: were they counted in the
    // training workspaces' learning, the prediction would be too large.
    let mut run = Vec::new();
    for _ in 0..3 {
        run.extend(std::iter::repeat_n(DryPass::Train(BatchShape::flat(8)), 6));
        run.extend(std::iter::repeat_n(DryPass::Infer(BatchShape::flat(200)), 6));
    }
    check_prediction(Network::new(config).unwrap(), 64, &run, &format!("{training:?}/{inference:?}"));
}

#[test]
fn another_mlp_at_three_batch_sizes_takes_what_its_dry_run_predicts() {
    // Long enough for every workspace to learn its size (16 cycles that allocate; the
    // activations workspaces have one a step, or an inference): the estimate is of a
    // run past that.
    let run: Vec<DryPass> = [16, 16, 16, 32, 16, 9]
        .repeat(3)
        .iter()
        .map(|&rows| DryPass::Train(BatchShape::flat(rows)))
        .chain(std::iter::repeat_n(DryPass::Infer(BatchShape::flat(40)), 16))
        .collect();
    for mode in MODES {
        check_prediction(mlp(mode, 256, &[64, 16]), 256, &run, "256-64-16-10");
    }
}

#[test]
fn the_sequences_lstm_at_several_lengths_takes_what_its_dry_run_predicts() {
    // Padded batches of several lengths, as the sequences demo's prefetcher gives them,
    // a longer one after the workspaces learned, and 16 inferences.
    let lengths = [9, 14, 9, 7, 20, 9, 14, 26, 9, 3];
    let mut run: Vec<DryPass> = Vec::new();
    for round in 0..3 {
        for &steps in &lengths[..if round == 0 { 7 } else { lengths.len() }] {
            run.push(DryPass::Train(BatchShape::sequences(6, steps)));
        }
    }
    for _ in 0..8 {
        run.push(DryPass::Infer(BatchShape::sequences(12, 26)));
        run.push(DryPass::Infer(BatchShape::sequences(5, 11)));
    }
    for mode in MODES {
        check_prediction(lstm(mode), 12, &run, "LSTM 12-8-9");
    }
}

#[test]
fn a_dry_run_changes_nothing_of_the_network() {
    for mode in MODES {
        let (mut dry, mut twin) = (mlp(mode, 64, &[32]), mlp(mode, 64, &[32]));
        let estimate = dry.dry_run(&demo_run()).unwrap();
        assert!(estimate.passes_run >= 4);
        assert_eq!((dry.iterations(), dry.workspace_capacity()), (0, twin.workspace_capacity()));
        assert!(dry.memory_plan().is_none());
        for i in 0..5 {
            let batch = Batch::new(BatchShape::flat(32), 64, 10, i);
            let a = dry.fit_batch(batch.input(), batch.labels()).unwrap();
            let b = twin.fit_batch(batch.input(), batch.labels()).unwrap();
            assert_eq!(a.to_bits(), b.to_bits(), "{mode:?} step {i}");
        }
        let batch = Batch::new(BatchShape::flat(9), 64, 10, 7);
        assert_eq!(dry.output(batch.input()).unwrap(), twin.output(batch.input()).unwrap());
        // A dry run keeps nothing: each starts from the workspaces as they are.
        let again = dry.dry_run(&demo_run()).unwrap();
        let twice = dry.dry_run(&demo_run()).unwrap();
        assert_eq!((&again.per_pass_bytes, &again.passes), (&twice.per_pass_bytes, &twice.passes));
        assert_eq!((&again.arenas, again.workspace_bytes), (&twice.arenas, twice.workspace_bytes));
    }
}

#[test]
fn fits_says_what_is_short_and_by_how_much() {
    let mut net = mlp(WorkspaceMode::Enabled, 64, &[128, 64]);
    let estimate = net.dry_run(&[DryPass::Train(BatchShape::flat(32))]).unwrap();
    let total = estimate.total_bytes();
    assert_eq!(total, estimate.parameter_bytes + estimate.workspace_bytes + estimate.inference_workspace_bytes);
    // 64·128 + 128 + 128·64 + 64 + 64·10 + 10 parameters, each a value, a gradient
    // and Adam's two moments.
    assert_eq!(estimate.parameter_bytes, (64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10) * 16);
    assert_eq!(estimate.fits(total), Ok(0));
    assert_eq!(estimate.fits(total + 5), Ok(5));
    let short = estimate.fits(total - 100).unwrap_err();
    assert_eq!((short.needed, short.budget, short.short_by), (total, total - 100, 100));
    assert_eq!(short.largest, estimate.arenas.iter().take(5).cloned().collect::<Vec<_>>());
    let message = short.to_string();
    for part in [total.to_string(), "100 bytes short".to_string(), "WS_LAYER_WORKING_MEM".to_string()] {
        assert!(message.contains(&part), "'{part}' not in: {message}");
    }
    assert!(estimate.fits(0).is_err());
    // At the largest pass's peak, the largest live holders by role and layer: the
    // first layer's activations and working memory, among others.
    assert!(!short.holders.is_empty() && short.holders.len() <= 5, "{short:?}");
    assert!(short.holders.windows(2).all(|w| w[0].bytes >= w[1].bytes), "{short:?}");
    assert!(short.holders.iter().all(|h| h.role.is_some() && h.layer.is_some()), "{short:?}");
    let first = net.layers()[0].name().to_string();
    assert!(
        short
            .holders
            .iter()
            .any(|h| h.layer.as_deref() == Some(first.as_str()) && h.role == Some(carve::ArrayType::Activations)),
        "{short:?}"
    );
    assert!(message.contains("the largest live holders are "), "{message}");
    assert!(message.contains(&format!("Activations of layer '{first}' in 'WS_ALL_LAYERS_ACT'")), "{message}");
    // With a timeline of the user's recording this network, the dry run records
    // nothing in it, labels nothing, and still names the holders.
    let timeline = carve::workspace_core::timeline::Timeline::start().unwrap();
    net.attach_timeline(&timeline).unwrap();
    let again = net.dry_run(&[DryPass::Train(BatchShape::flat(32))]).unwrap();
    assert_eq!(again.peak_holders, estimate.peak_holders);
    assert_eq!((timeline.snapshot().events(), timeline.iterations()), (0, 0));
    let (x, y) = (ndarray::Array2::<f32>::zeros((32, 64)), ndarray::Array1::<u32>::zeros(32));
    net.fit_batch(x.view(), y.view()).unwrap();
    assert_eq!(timeline.iterations(), 1, "the user's timeline records on");
    assert!(timeline.snapshot().events() > 0);
}

#[test]
fn bad_dry_runs_are_errors_that_say_why() {
    let mut net = mlp(WorkspaceMode::Enabled, 64, &[16]);
    let empty = net.dry_run(&[]).unwrap_err();
    assert!(matches!(&empty, Error::InvalidInput(m) if m.contains("at least one pass")), "{empty}");
    let zero = net.dry_run(&[DryPass::Train(BatchShape::flat(0))]).unwrap_err();
    assert!(zero.to_string().contains("at least one row"), "{zero}");
    let huge = net.dry_run(&[DryPass::Train(BatchShape::flat(usize::MAX / 8))]).unwrap_err();
    assert!(huge.to_string().contains("overflows the address space"), "{huge}");
    // 16 TiB of features: refused as an error, not an abort.
    let vast = net.dry_run(&[DryPass::Train(BatchShape::flat(1 << 36))]).unwrap_err();
    assert!(vast.to_string().contains("cannot be allocated"), "{vast}");
    // A shape the layers refuse is the error a real step of it would be; the failed
    // pass teaches the next dry run nothing (it starts afresh).
    let mut recurrent = lstm(WorkspaceMode::Enabled);
    let flat = recurrent.dry_run(&[DryPass::Train(BatchShape::flat(4))]).unwrap_err();
    assert!(flat.to_string().contains("recurrent"), "{flat}");
    let good = [DryPass::Train(BatchShape::sequences(4, 9))];
    let after = recurrent.dry_run(&good).unwrap();
    let fresh = lstm(WorkspaceMode::Enabled).dry_run(&good).unwrap();
    assert_eq!((after.workspace_bytes, &after.passes), (fresh.workspace_bytes, &fresh.passes));
    // Each dry run's peak is its own passes'.
    let large = net.dry_run(&[DryPass::Train(BatchShape::flat(500))]).unwrap();
    let small = net.dry_run(&[DryPass::Train(BatchShape::flat(5))]).unwrap();
    assert!(small.peak_step_bytes < large.peak_step_bytes, "{small:?} after {large:?}");
    // The network is still usable.
    assert!(net.dry_run(&[DryPass::Infer(BatchShape::flat(3))]).is_ok());
}

// The defects of the dry run's issue, each as its reporter met it: a run of the network
// on a thread of its own, predicted, then run for real pass by pass.

/// Runs `f` on a thread of its own: its workspaces are that thread's, shared with no
/// other test.
fn on_a_thread(f: impl FnOnce() + Send + 'static) {
    std::thread::spawn(f).join().unwrap();
}

/// Runs `run` for real on `net` and checks each pass against the estimate's figure,
/// and the arenas after it.
fn run_as_predicted(net: &mut Network, estimate: &MemoryEstimate, run: &[DryPass], what: &str) {
    let inputs = net.inputs();
    for (i, &pass) in run.iter().enumerate() {
        let real = real_pass(net, pass, inputs, i);
        assert_eq!(real, estimate.per_pass_bytes[i], "{what}: pass {i}, {pass}");
        // Enabled, each pass of a shape reports the same; planned, the last is the plan.
        let last = run.iter().rposition(|&p| p == pass) == Some(i);
        let mode = match pass {
            DryPass::Train(_) => net.training_workspace_mode(),
            DryPass::Infer(_) => net.inference_workspace_mode(),
        };
        if last || mode == WorkspaceMode::Enabled {
            assert_eq!(real, estimate.pass(pass).expect("a pass of the run").bytes, "{what}: pass {i}, {pass}");
        }
    }
    assert_eq!(net.workspace_capacity(), estimate.workspace_bytes, "{what}: the training arenas");
    assert_eq!(net.inference_workspace_capacity(), estimate.inference_workspace_bytes, "{what}: the inference arenas");
}

/// An LSTM in the default (enabled) mode, 20 steps of one padded shape: every step
/// reports what the dry run said, the steps that learn the workspaces' sizes (whose
/// arrays spilled) as the later ones.
#[test]
fn an_enabled_lstm_reports_the_predicted_bytes_from_its_first_step() {
    on_a_thread(|| {
        let config = NetworkConfig::builder(12).lstm(8).last_step().dense(9).seed(5).build().unwrap();
        let mut net = Network::new(config).unwrap();
        assert_eq!(net.training_workspace_mode(), WorkspaceMode::Enabled, "the default");
        let run = vec![DryPass::Train(BatchShape::sequences(6, 9)); 20];
        let estimate = net.dry_run(&run).unwrap();
        run_as_predicted(&mut net, &estimate, &run, "LSTM, 20 steps");
        assert_eq!(estimate.peak_step_bytes, estimate.step_bytes());
    });
}

/// Three shapes in one short run, after another network trained on the thread: the
/// arenas are those the run ends with, and `fits` says so to the byte.
#[test]
fn three_shapes_after_another_network_end_with_the_predicted_arenas_and_fits_says_so() {
    on_a_thread(|| {
        // The thread's workspaces learn from the LSTM first: the MLP's are those.
        let mut other = lstm(WorkspaceMode::Enabled);
        for i in 0..4 {
            real_pass(&mut other, DryPass::Train(BatchShape::sequences(6, 9)), 12, i);
        }
        let mut net = mlp(WorkspaceMode::Enabled, 16, &[16]);
        let run: Vec<DryPass> =
            [4, 16, 8, 4, 16, 8].iter().map(|&rows| DryPass::Train(BatchShape::flat(rows))).collect();
        let estimate = net.dry_run(&run).unwrap();
        run_as_predicted(&mut net, &estimate, &run, "three shapes");
        let real = estimate.parameter_bytes + net.workspace_capacity() + net.inference_workspace_capacity();
        assert_eq!(estimate.total_bytes(), real);
        assert_eq!(estimate.fits(real), Ok(0));
        assert_eq!(estimate.fits(real - 1).map_err(|short| short.short_by), Err(1));
    });
}

/// An MLP whose enabled inferences come between its training steps (the two share
/// their working memory workspace): each step and each inference reports what the dry
/// run said, from the first on.
#[test]
fn inferences_between_training_steps_report_the_predicted_bytes() {
    on_a_thread(|| {
        let mut net = mlp(WorkspaceMode::Enabled, 16, &[16]);
        let run: Vec<DryPass> =
            (0..20).flat_map(|_| [DryPass::Train(BatchShape::flat(8)), DryPass::Infer(BatchShape::flat(8))]).collect();
        let estimate = net.dry_run(&run).unwrap();
        run_as_predicted(&mut net, &estimate, &run, "steps and inferences");
    });
}

/// Five MLPs in the enabled mode, and the README's run: the first steps (while the
/// workspaces learn) report the bytes predicted.
#[test]
fn enabled_mlps_report_the_predicted_bytes_from_their_first_step() {
    let shapes: [(usize, &[usize]); 5] =
        [(64, &[128, 64]), (256, &[64, 16]), (16, &[16]), (8, &[]), (32, &[32, 32, 32])];
    for (inputs, hidden) in shapes {
        on_a_thread(move || {
            let mut net = mlp(WorkspaceMode::Enabled, inputs, hidden);
            let mut run = vec![DryPass::Train(BatchShape::flat(32)); 44];
            run.push(DryPass::Train(BatchShape::flat(30)));
            run.push(DryPass::Infer(BatchShape::flat(32)));
            let estimate = net.dry_run(&run).unwrap();
            let step = estimate.pass(DryPass::Train(BatchShape::flat(32))).unwrap().bytes;
            for (i, &pass) in run.iter().take(3).enumerate() {
                assert_eq!(real_pass(&mut net, pass, inputs, i), step, "{inputs}-{hidden:?}: step {i}");
            }
        });
    }
}

/// What the estimate says of single passes never exceeds what it says of the run's
/// largest step.
#[test]
fn no_pass_of_a_run_reports_more_than_its_peak_step() {
    let runs = [
        vec![DryPass::Train(BatchShape::flat(32))],
        vec![DryPass::Train(BatchShape::flat(32)), DryPass::Train(BatchShape::flat(8))],
        demo_run(),
    ];
    for mode in MODES {
        for run in &runs {
            let estimate = mlp(mode, 64, &[32]).dry_run(run).unwrap();
            for pass in estimate.passes.iter().filter(|p| matches!(p.pass, DryPass::Train(_))) {
                assert!(
                    pass.bytes <= estimate.peak_step_bytes,
                    "{mode:?}: {pass:?} above {}",
                    estimate.peak_step_bytes
                );
            }
            let steps = run.iter().zip(&estimate.per_pass_bytes).filter(|(p, _)| matches!(p, DryPass::Train(_)));
            assert_eq!(steps.map(|(_, &b)| b).max(), Some(estimate.peak_step_bytes), "{mode:?}");
        }
    }
}

/// A planned network: the first step of each shape (recorded) reports what its
/// workspaces held, laid out per role; later ones, the shape's plan.
#[test]
fn a_planned_shapes_first_step_reports_the_predicted_bytes() {
    let mut net = mlp(WorkspaceMode::Planned, 64, &[128, 64]);
    let run: Vec<DryPass> =
        [32, 32, 32, 30, 30, 32].iter().map(|&rows| DryPass::Train(BatchShape::flat(rows))).collect();
    let estimate = net.dry_run(&run).unwrap();
    for (i, &pass) in run.iter().enumerate() {
        let real = real_pass(&mut net, pass, 64, i);
        let figures = estimate.pass(pass).unwrap();
        let first = run.iter().position(|&p| p == pass) == Some(i);
        let expected = if first { figures.per_role_bytes } else { figures.plan_bytes };
        assert_eq!((real, estimate.per_pass_bytes[i]), (expected, expected), "step {i}, {pass}");
    }
}

/// Networks that ran on the thread before, and the network's own earlier passes, left
/// the thread's (shared) workspaces as they are: the dry run starts from there.
#[test]
fn what_ran_before_on_the_thread_is_in_the_prediction() {
    on_a_thread(|| {
        let run: Vec<DryPass> = [DryPass::Train(BatchShape::flat(8)), DryPass::Infer(BatchShape::flat(8))].repeat(10);
        // Alone on a fresh thread.
        let mut alone = mlp(WorkspaceMode::Enabled, 16, &[16]);
        let fresh = alone.dry_run(&run).unwrap();
        // A larger network teaches the thread's workspaces more (and is dropped).
        let mut other = mlp(WorkspaceMode::Enabled, 64, &[128, 64]);
        for i in 0..3 {
            real_pass(&mut other, DryPass::Train(BatchShape::flat(32)), 64, i);
            real_pass(&mut other, DryPass::Infer(BatchShape::flat(64)), 64, i);
        }
        drop(other);
        let estimate = alone.dry_run(&run).unwrap();
        assert!(estimate.workspace_bytes > fresh.workspace_bytes, "{estimate:?} against {fresh:?}");
        run_as_predicted(&mut alone, &estimate, &run, "after another network");
        // Its own passes, too: the run again, from where the last one left it.
        let again = alone.dry_run(&run).unwrap();
        run_as_predicted(&mut alone, &again, &run, "after its own passes");
    });
}

/// A planned network that has run passes already: the dry run starts from the plans its
/// groups hold, so the shapes it planned replay from their first pass of the run.
#[test]
fn a_planned_network_dry_runs_from_the_plans_it_holds() {
    let mut net = mlp(WorkspaceMode::Planned, 64, &[32]);
    for i in 0..2 {
        real_pass(&mut net, DryPass::Train(BatchShape::flat(32)), 64, i);
        real_pass(&mut net, DryPass::Infer(BatchShape::flat(9)), 64, i);
    }
    let run: Vec<DryPass> = [32, 16, 32, 16].iter().map(|&rows| DryPass::Train(BatchShape::flat(rows))).collect();
    let mut run = run;
    run.push(DryPass::Infer(BatchShape::flat(9)));
    let estimate = net.dry_run(&run).unwrap();
    let plan = |pass| estimate.pass(pass).unwrap().plan_bytes;
    let per_role = |pass| estimate.pass(pass).unwrap().per_role_bytes;
    let expected = [plan(run[0]), per_role(run[1]), plan(run[2]), plan(run[3]), plan(run[4])];
    assert_eq!(estimate.per_pass_bytes, expected, "only the new shape is recorded");
    run_as_predicted(&mut net, &estimate, &run, "planned, after its own passes");
}

/// More shapes than a planned network keeps plans for (64): plans are dropped, least
/// recently used first, and recorded again when their shape comes back, in the dry run
/// as in the run.
#[test]
fn a_planned_run_of_more_shapes_than_plans_is_predicted_pass_by_pass() {
    // (A network whose plans take less than its per-role layout: a recorded step and a
    // replayed one report different bytes.)
    let mut net = mlp(WorkspaceMode::Planned, 16, &[16]);
    let shapes: Vec<DryPass> = (1..=70).map(|rows| DryPass::Train(BatchShape::flat(rows))).collect();
    // The cache full (shapes 0 to 63, each then replayed once), shape 0 used last, then
    // a new shape: the plan used least recently (shape 1's) goes, which only a count of
    // every use of shape 0 tells; then the rest, new shapes and old ones dropped.
    let run: Vec<DryPass> =
        [&shapes[..64], &shapes[..64], &shapes[..1], &shapes[64..65], &shapes[..2], &shapes[60..], &shapes[..3]]
            .concat();
    let estimate = net.dry_run(&run).unwrap();
    run_as_predicted(&mut net, &estimate, &run, "70 shapes, 64 plans");
    let stats = net.memory_plan().unwrap();
    assert!(stats.evictions > 0 && stats.plans > 70, "{stats:?}");
}

/// A layer whose forward pass fills its output with 7 by a loop of its own, then
/// overwrites it with `input · W` through carve's `sgemm`, and records what the output
/// held after the product and whether a dry run was running.
struct Probe {
    seen: std::sync::Mutex<Vec<(bool, f32)>>,
}

impl carve::nn::Layer for Probe {
    fn name(&self) -> &str {
        "probe"
    }

    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }

    fn param_shapes(&self, inputs: usize) -> Vec<carve::nn::ParamShape> {
        vec![carve::nn::ParamShape::new("weight", &[inputs, inputs])]
    }

    fn init(&self, inputs: usize, params: &mut [f32], _init: &mut carve::nn::Init<'_>) {
        for (i, w) in params.iter_mut().enumerate() {
            *w = if i % (inputs + 1) == 0 { 1.0 } else { 0.0 };
        }
    }

    fn forward_rows<'a>(
        &self,
        params: &[f32],
        input: ndarray::ArrayView2<'a, f32>,
        ctx: &carve::nn::ForwardCtx<'a, '_>,
    ) -> carve::Result<ndarray::ArrayView2<'a, f32>> {
        use carve::nn::gemm::{scratch_len, sgemm};
        let (rows, n) = input.dim();
        let mut out = ctx.activations.zeros::<f32, _>((rows, n))?;
        out.fill(7.0);
        let scratch = ctx.working.slice_uninit::<f32>(scratch_len(rows, n, n))?;
        let w = ndarray::ArrayView2::from_shape((n, n), params).unwrap();
        sgemm(1.0, input, w, 0.0, out.view_mut(), scratch)?;
        self.seen.lock().unwrap().push((carve::nn::dry::running(), out[[0, 0]]));
        Ok(carve::freeze(out))
    }
}

#[test]
fn a_dry_run_issues_no_arithmetic_in_carves_kernels_and_says_so_to_custom_layers() {
    use std::sync::Arc;
    let probe = Arc::new(Probe { seen: Default::default() });
    struct Shared(Arc<Probe>);
    impl carve::nn::Layer for Shared {
        fn name(&self) -> &str {
            self.0.name()
        }
        fn output_size(&self, inputs: usize) -> carve::Result<usize> {
            self.0.output_size(inputs)
        }
        fn param_shapes(&self, inputs: usize) -> Vec<carve::nn::ParamShape> {
            self.0.param_shapes(inputs)
        }
        fn init(&self, inputs: usize, params: &mut [f32], init: &mut carve::nn::Init<'_>) {
            self.0.init(inputs, params, init)
        }
        fn forward_rows<'a>(
            &self,
            params: &[f32],
            input: ndarray::ArrayView2<'a, f32>,
            ctx: &carve::nn::ForwardCtx<'a, '_>,
        ) -> carve::Result<ndarray::ArrayView2<'a, f32>> {
            self.0.forward_rows(params, input, ctx)
        }
    }
    for mode in MODES {
        let config = NetworkConfig::builder(3)
            .layer(Shared(Arc::clone(&probe)))
            .dense(2)
            .training_workspace_mode(mode)
            .inference_workspace_mode(mode)
            .build()
            .unwrap();
        let mut net = Network::new(config).unwrap();
        probe.seen.lock().unwrap().clear();
        let estimate = net.dry_run(&[DryPass::Infer(BatchShape::flat(4))]).unwrap();
        assert!(!carve::nn::dry::running(), "only while the dry run runs");
        // The layer ran in the dry run; the product into its output issued nothing.
        let seen = probe.seen.lock().unwrap().clone();
        assert!(!seen.is_empty() && seen.iter().all(|&s| s == (true, 7.0)), "{mode:?}: {seen:?}");
        let x = Array2::from_elem((4, 3), 0.5f32);
        net.output(x.view()).unwrap();
        let last = *probe.seen.lock().unwrap().last().unwrap();
        assert_eq!(last, (false, 0.5), "{mode:?}: a real pass multiplies");
        assert_eq!(net.last_inference_workspace_bytes(), estimate.per_pass_bytes[0], "{mode:?}");
    }
}
