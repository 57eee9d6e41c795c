//! A dry run is exact, as a property: random runs — small networks with and without
//! LSTMs (a head, or labels per step), flat and padded batches, training steps and
//! inferences interleaved, every workspace mode for each and every learning policy —
//! on a fresh thread, after other networks ran on it, and after the network's own
//! passes; what `Network::dry_run` says each pass reports, and the arenas the run ends
//! with, are what the real run then reports, pass by pass.
//!
//! Each case is a seed (`carve_rng::Rng`); a failure names it and the case, and
//! `CARVE_DRY_RUN_SEED=<seed>` runs that one case alone. 1,000 cases per run (a few
//! seconds), `PROPTEST_CASES` for more (see [`cases`]).

use carve::nn::{
    dry::BatchShape, dry::DryPass, dry::MemoryEstimate, workspaces::names, Input, Labels, Network, NetworkConfig,
    Updater,
};
use carve::{LearningPolicy, WorkspaceManager, WorkspaceMode};
use carve_rng::Rng;
use ndarray::{s, Array1, Array2, Array3};

const MODES: [WorkspaceMode; 3] = [WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None];

/// Cases per run: 1,000, or `PROPTEST_CASES`; divided by `CARVE_SOAK_SCALE` (valgrind's
/// step of `.ci/run` sets 5: 200 cases there, about half a minute).
fn cases() -> u64 {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let scale: u64 = std::env::var("CARVE_SOAK_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    (cases / scale.max(1)).max(1)
}

/// What a network of a case is made of.
#[derive(Clone, Debug)]
struct Net {
    inputs: usize,
    /// The LSTMs' widths (none: a flat network).
    lstms: Vec<usize>,
    /// With LSTMs: a head (`true`: the masked mean, `false`: the last step), or none
    /// (labels per step).
    head: Option<bool>,
    /// Dense layers' widths before the last one, each with a ReLU after it or not.
    hidden: Vec<(usize, bool)>,
    classes: usize,
    modes: [WorkspaceMode; 2],
    learning: LearningPolicy,
    adam: bool,
}

impl Net {
    fn random(rng: &mut Rng, learning: LearningPolicy) -> Net {
        // A recurrent step costs several flat ones (a product per time step): fewer of
        // them, narrower, so that a thousand cases take seconds.
        let recurrent = rng.below(4) == 0;
        let lstms = match recurrent {
            true => (0..1 + rng.below(2)).map(|_| 1 + rng.below(6)).collect(),
            false => Vec::new(),
        };
        let head = recurrent.then(|| rng.below(3)).and_then(|h| (h < 2).then_some(h == 0));
        // Enabled the most often: the mode whose learning and sharing the dry run follows.
        let mode = |rng: &mut Rng| MODES[[0, 0, 1, 2][rng.below(4)]];
        Net {
            inputs: 1 + rng.below(16),
            lstms,
            head,
            hidden: (0..rng.below(3)).map(|_| (1 + rng.below(16), rng.below(2) == 0)).collect(),
            classes: 2 + rng.below(7),
            modes: [mode(rng), mode(rng)],
            learning,
            adam: rng.below(2) == 0,
        }
    }

    fn build(&self, seed: u64) -> Network {
        let mut builder = NetworkConfig::builder(self.inputs);
        for &hidden in &self.lstms {
            builder = builder.lstm(hidden);
        }
        builder = match self.head {
            Some(true) => builder.masked_mean(),
            Some(false) => builder.last_step(),
            None => builder,
        };
        for &(width, relu) in &self.hidden {
            builder = builder.dense(width);
            if relu {
                builder = builder.relu();
            }
        }
        let updater = if self.adam { Updater::adam(1e-3) } else { Updater::sgd(1e-2, 0.9) };
        let config = builder
            .dense(self.classes)
            .seed(seed)
            .updater(updater)
            .training_workspace_mode(self.modes[0])
            .inference_workspace_mode(self.modes[1])
            .workspace_learning(self.learning)
            .build()
            .unwrap();
        Network::new(config).unwrap()
    }

    /// A batch shape this network takes.
    fn shape(&self, rng: &mut Rng) -> BatchShape {
        match self.lstms.is_empty() {
            true => BatchShape::flat(1 + rng.below(8)),
            false => BatchShape::Sequences {
                batch: 1 + rng.below(4),
                steps: 1 + rng.below(4),
                masked: rng.below(3) > 0,
                labels_per_step: self.head.is_none(),
            },
        }
    }

    /// A run of up to `longest` passes over 1 to 3 shapes of training steps and of
    /// inferences: stretches of one pass, repeats and alternations.
    fn run(&self, rng: &mut Rng, longest: usize) -> Vec<DryPass> {
        let train: Vec<BatchShape> = (0..1 + rng.below(3)).map(|_| self.shape(rng)).collect();
        let infer: Vec<BatchShape> = (0..1 + rng.below(3)).map(|_| self.shape(rng)).collect();
        let length = 1 + rng.below(longest);
        let mut run = Vec::with_capacity(length);
        while run.len() < length {
            let pass = match rng.below(3) {
                0 => DryPass::Infer(infer[rng.below(infer.len())]),
                _ => DryPass::Train(train[rng.below(train.len())]),
            };
            for _ in 0..1 + rng.below(4) {
                run.push(pass);
            }
        }
        run.truncate(length);
        run
    }
}

/// A real batch of `shape`: values in (0, 1); sequences padded at their ends when masked
/// (their lengths vary, the first is full), the padding zero.
struct Batch {
    flat: Option<Array2<f32>>,
    features: Option<Array3<f32>>,
    mask: Option<Array2<f32>>,
    labels: Array1<u32>,
    step_labels: Option<Array2<u32>>,
}

impl Batch {
    fn new(shape: BatchShape, inputs: usize, classes: usize, rng: &mut Rng) -> Batch {
        let classes = classes as u32;
        match shape {
            BatchShape::Flat { rows } => Batch {
                flat: Some(Array2::from_shape_fn((rows, inputs), |_| rng.uniform(0.01, 1.0))),
                features: None,
                mask: None,
                labels: Array1::from_shape_fn(rows, |r| r as u32 % classes),
                step_labels: None,
            },
            BatchShape::Sequences { batch, steps, masked, labels_per_step } => {
                let mut features = Array3::from_shape_fn((batch, steps, inputs), |_| rng.uniform(0.01, 1.0));
                let mut mask = Array2::<f32>::ones((batch, steps));
                if masked {
                    for b in 1..batch {
                        let length = 1 + rng.below(steps);
                        features.slice_mut(s![b, length.., ..]).fill(0.0);
                        mask.slice_mut(s![b, length..]).fill(0.0);
                    }
                }
                Batch {
                    flat: None,
                    features: Some(features),
                    mask: masked.then_some(mask),
                    labels: Array1::from_shape_fn(batch, |b| b as u32 % classes),
                    step_labels: labels_per_step
                        .then(|| Array2::from_shape_fn((batch, steps), |(b, t)| (b + t) as u32 % classes)),
                }
            }
        }
    }

    fn input(&self) -> Input<'_> {
        match &self.flat {
            Some(x) => Input::Flat(x.view()),
            None => Input::Sequences {
                features: self.features.as_ref().expect("sequences").view(),
                mask: self.mask.as_ref().map(|m| m.view()),
            },
        }
    }

    fn labels(&self) -> Labels<'_> {
        match &self.step_labels {
            Some(y) => Labels::PerStep { labels: y.view(), mask: None },
            None => Labels::PerExample(self.labels.view()),
        }
    }
}

/// Runs `pass` for real on `net` and returns what it reports.
fn real_pass(net: &mut Network, pass: DryPass, rng: &mut Rng) -> usize {
    let (inputs, classes) = (net.inputs(), net.classes());
    match pass {
        DryPass::Train(shape) => {
            let batch = Batch::new(shape, inputs, classes, rng);
            net.fit_batch(batch.input(), batch.labels()).unwrap();
            net.last_iteration_workspace_bytes()
        }
        DryPass::Infer(shape) => {
            let batch = Batch::new(shape, inputs, classes, rng);
            net.output(batch.input()).unwrap();
            net.last_inference_workspace_bytes()
        }
    }
}

/// Each arena of `net` by name, largest first, as [`MemoryEstimate::arenas`] lists them:
/// the training workspaces' and plan group's (training on), then the inference ones
/// training does not count (inference on).
fn real_arenas(net: &Network) -> Vec<(String, usize)> {
    let mut named: Vec<(String, usize)> = Vec::new();
    let (training, inference) = (net.training_workspace_mode(), net.inference_workspace_mode());
    let mut counted = Vec::new();
    if training != WorkspaceMode::None {
        // The first manager's workspaces, and the second's gradient workspace: a planned
        // network's are its group's, an enabled one's the thread's.
        let workspaces = match net.training_mgr().plan_group() {
            Some(group) => {
                named.push((group.stats().name, group.capacity()));
                group.workspaces()
            }
            None => {
                let second = WorkspaceManager::current().get(names::ACT_GRAD_2).unwrap();
                net.training_mgr().workspaces().cloned().chain([second]).collect()
            }
        };
        for ws in workspaces {
            counted.push(ws.id());
            named.push((ws.name().to_string(), ws.capacity()));
        }
    }
    if inference != WorkspaceMode::None {
        if let Some(group) = net.inference_mgr().plan_group() {
            named.push((group.stats().name, group.capacity()));
        }
        for ws in net.inference_mgr().workspaces().filter(|ws| !counted.contains(&ws.id())) {
            named.push((ws.name().to_string(), ws.capacity()));
        }
    }
    named.retain(|(_, bytes)| *bytes > 0);
    named.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    named
}

/// Checks what the estimate says of each pass and of the run's end against `net`'s real
/// run of `run`.
fn check(net: &mut Network, estimate: &MemoryEstimate, run: &[DryPass], rng: &mut Rng, what: &str) {
    assert_eq!(estimate.per_pass_bytes.len(), run.len(), "{what}");
    let mut last: Vec<(DryPass, usize)> = Vec::new();
    for (i, &pass) in run.iter().enumerate() {
        let real = real_pass(net, pass, rng);
        assert_eq!(real, estimate.per_pass_bytes[i], "{what}: pass {i}, {pass}");
        let mode = match pass {
            DryPass::Train(_) => net.training_workspace_mode(),
            DryPass::Infer(_) => net.inference_workspace_mode(),
        };
        match last.iter_mut().find(|(p, _)| *p == pass) {
            Some((_, bytes)) => {
                // Enabled workspaces count a pass alike whether it spilled (learning,
                // growing) or ran in their arenas.
                if mode == WorkspaceMode::Enabled {
                    assert_eq!(real, *bytes, "{what}: pass {i}, {pass}, against its first");
                }
                *bytes = real;
            }
            None => last.push((pass, real)),
        }
    }
    assert_eq!(net.workspace_capacity(), estimate.workspace_bytes, "{what}: the training arenas");
    assert_eq!(net.inference_workspace_capacity(), estimate.inference_workspace_bytes, "{what}: the inference arenas");
    assert_eq!(real_arenas(net), estimate.arenas, "{what}: each arena");
    // Each distinct pass: what it reported at its last, its figures in order.
    assert_eq!(estimate.passes.iter().map(|p| (p.pass, p.bytes)).collect::<Vec<_>>(), last, "{what}");
    for p in &estimate.passes {
        assert!(p.lower_bound_bytes <= p.plan_bytes && p.plan_bytes <= p.per_role_bytes, "{what}: {p:?}");
    }
    let steps = run.iter().zip(&estimate.per_pass_bytes).filter(|(p, _)| matches!(p, DryPass::Train(_)));
    assert_eq!(estimate.peak_step_bytes, steps.map(|(_, &b)| b).max().unwrap_or(0), "{what}: the peak step");
    assert!(estimate.step_bytes() <= estimate.peak_step_bytes, "{what}");
    assert_eq!(estimate.fits(estimate.total_bytes()), Ok(0), "{what}");
}

/// One case, on a fresh thread (one case in 8), or on this one with its workspaces gone
/// as on a fresh thread (the last case's networks are gone: what a new thread has is no
/// workspaces, and a new thread costs as much as a case).
fn case(seed: u64) {
    if seed.is_multiple_of(8) {
        let ran = std::thread::spawn(move || run_case(seed)).join();
        assert!(ran.is_ok(), "case {seed} failed: run it alone with CARVE_DRY_RUN_SEED={seed}");
    } else {
        WorkspaceManager::current().destroy_all().unwrap();
        run_case(seed);
    }
}

/// A case: other networks (of the case's learning policy: a thread's networks share
/// their enabled workspaces by name, and so one configuration) run some passes first, or
/// not; the network then runs some passes of its own, or not; then a dry run of a
/// random run, and the run.
fn run_case(seed: u64) {
    let mut rng = Rng::new(seed);
    let policies = [
        LearningPolicy::OverTime { cycles: 16 },
        LearningPolicy::OverTime { cycles: 1 + rng.below(20) as u32 },
        LearningPolicy::FirstLoop,
        LearningPolicy::None,
    ];
    let learning = policies[rng.below(policies.len())];
    let others: Vec<(Net, Vec<DryPass>, bool)> = (0..[0, 0, 0, 0, 0, 1, 1, 2][rng.below(8)])
        .map(|_| {
            let net = Net::random(&mut rng, learning);
            let run = net.run(&mut rng, 3);
            (net, run, rng.below(2) == 0)
        })
        .collect();
    let net = Net::random(&mut rng, learning);
    let own = match rng.below(4) {
        0 => net.run(&mut rng, 3),
        _ => Vec::new(),
    };
    // Most runs short; some long enough for the default learning (16 cycles) to end.
    let longest = [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 16, 16, 40, 40][rng.below(16)];
    let run = net.run(&mut rng, longest);
    let what = format!(
        "case {seed} (CARVE_DRY_RUN_SEED={seed}): {net:?}, after other networks (kept or dropped) {others:?} and \
         passes of its own {own:?}, the run {run:?}"
    );
    let mut kept = Vec::new();
    for (i, (other, passes, keep)) in others.iter().enumerate() {
        let mut other_net = other.build(seed + 1 + i as u64);
        for &pass in passes {
            real_pass(&mut other_net, pass, &mut rng);
        }
        if *keep {
            kept.push(other_net);
        }
    }
    let mut real = net.build(seed);
    for &pass in &own {
        real_pass(&mut real, pass, &mut rng);
    }
    let estimate = real.dry_run(&run).unwrap_or_else(|e| panic!("{what}: {e}"));
    check(&mut real, &estimate, &run, &mut rng, &what);
}

#[test]
fn dry_runs_predict_random_runs_pass_by_pass() {
    if let Some(seed) = std::env::var("CARVE_DRY_RUN_SEED").ok().and_then(|v| v.parse().ok()) {
        return case(seed);
    }
    let started = std::time::Instant::now();
    let cases = cases();
    for seed in 0..cases {
        case(seed);
    }
    eprintln!("{cases} random runs predicted pass by pass in {:.1} s", started.elapsed().as_secs_f64());
}
