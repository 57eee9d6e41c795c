//! carve's MLP against the same MLP in candle and in burn (its Flex backend), trained in
//! one process with the runs interleaved: the demo's network (64-128-64-10 on the UCI
//! digits, batch 32) and the wide one (784-1024-1024-10 at batch 128, synthetic data).
//!
//! Every configuration starts from carve's initial weights (Glorot uniform, zero
//! biases, the same seed), sees the same batches in the same order (the training rows
//! shuffled afresh every epoch, cut into batches of 32, the last one short) and steps
//! with the same updater (Adam, β₁ 0.9, β₂ 0.999, ε 1e-8, no weight decay) after the
//! same loss (softmax cross-entropy, the batch mean). The peers run at their default
//! threading (their kernels may use every CPU) and on one thread (inside a rayon pool of
//! one thread, with `RAYON_NUM_THREADS=1` for candle's matrix multiply, which reads it
//! per call); carve runs on one thread, and for the wide MLP on two as well
//! (`Network::set_threads`).
//!
//! The demo is timed per epoch: one untimed epoch for every configuration, then the
//! timed epochs, each epoch run by every configuration in turn (the order rotating from
//! epoch to epoch). The wide MLP is timed per step, in rounds of a few steps each,
//! interleaved the same way. Reports medians, heap allocations per step (all threads),
//! each one's first loss (the same weights and batch: equal to about 1e-5) and test
//! accuracy, and carve's time over the fastest peer's.
//!
//! ```text
//! cargo bench --bench mlp_compare --features candle,burn            # a table
//! cargo bench --bench mlp_compare --features candle,burn -- --json  # and one JSON object
//! ```
//!
//! Flags: `--epochs N` (timed demo epochs, default 10), `--wide-rounds N` (default 10),
//! `--skip-wide`, `--json`.

#[path = "../examples/train_digits/data.rs"]
mod data;

use std::fmt::Write as _;
use std::time::Instant;

use carve::alloc_check::{process_counts, CountingAllocator, Threads};
use carve::nn::{Network, NetworkConfig, Updater};
use carve::WorkspaceMode;
use carve_rng::Rng;
use ndarray::{Array1, Array2, Axis};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::system();

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The digits' features and classes (the demo's, for `data.rs`).
const FEATURES: usize = 64;
const CLASSES: usize = 10;
const LEARNING_RATE: f32 = 1e-3;
const SEED: u64 = 0;

/// One training batch: features and labels.
struct Batch {
    x: Array2<f32>,
    y: Array1<u32>,
}

/// An MLP's widths (inputs, hidden…, classes) and its initial parameters, as carve
/// initialised them: per layer, the weights `inputs × outputs` (row-major) and the
/// biases.
struct Start {
    widths: Vec<usize>,
    layers: Vec<(Vec<f32>, Vec<f32>)>,
}

/// A framework's MLP, trained one batch at a time.
trait Trainer {
    /// One step: forward, loss, backward, update. The batch's loss.
    fn step(&mut self, batch: &Batch) -> Res<f32>;
    /// The predicted class of every row.
    fn predict(&mut self, x: &Array2<f32>) -> Res<Vec<u32>>;
}

/// A peer's trainer, which a one-thread run moves into its pool (carve's `Network` is
/// not `Send`: carve runs on the calling thread).
trait PeerTrainer: Trainer + Send {}

impl<T: Trainer + Send> PeerTrainer for T {}

/// A configuration's MLP.
enum Model {
    Carve(Box<Carve>),
    Peer(Box<dyn PeerTrainer>),
}

impl Model {
    fn trainer(&mut self) -> &mut dyn Trainer {
        match self {
            Model::Carve(c) => &mut **c,
            Model::Peer(p) => &mut **p,
        }
    }
}

/// How a configuration is threaded.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Threading {
    /// The framework's default (every CPU where its kernels split work).
    Default,
    /// One thread: the run inside a rayon pool of one thread (and, for candle,
    /// `RAYON_NUM_THREADS=1`, which its matrix multiply reads per call).
    One,
    /// carve's `Network::set_threads(2)`.
    Two,
}

impl Threading {
    fn label(self) -> &'static str {
        match self {
            Threading::Default => "default",
            Threading::One => "1",
            Threading::Two => "2",
        }
    }
}

/// A framework at a threading, with what was measured of it.
struct Config {
    framework: &'static str,
    threading: Threading,
    model: Model,
    /// Milliseconds per timed epoch (demo) or per timed round (wide).
    times_ms: Vec<f64>,
    steps_timed: u64,
    allocations: u64,
    first_loss: Option<f32>,
    last_loss: f32,
}

impl Config {
    fn name(&self) -> String {
        format!("{} ({} threads)", self.framework, self.threading.label())
    }

    fn is_peer(&self) -> bool {
        self.framework != "carve"
    }
}

/// Runs `f` inside `one` (a pool of one thread); for candle with `RAYON_NUM_THREADS=1`
/// too, since its matrix multiply asks the environment per call how many threads to
/// split into (nothing else reads the environment while this runs).
fn on_one_thread<T: Send>(framework: &str, one: &rayon::ThreadPool, f: impl FnOnce() -> T + Send) -> T {
    let candle = framework == "candle";
    if candle {
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    let out = one.install(f);
    if candle {
        std::env::remove_var("RAYON_NUM_THREADS");
    }
    out
}

fn allocations() -> u64 {
    process_counts(Threads::All).allocations
}

/// What a run of steps measured: the first and last losses, milliseconds, allocations.
type Measured = (Option<f32>, f32, f64, u64);

/// `steps` steps of `trainer` on `batches` from `offset`, cycling.
fn steps<T: Trainer + ?Sized>(
    trainer: &mut T,
    batches: &[Batch],
    offset: usize,
    steps: usize,
) -> Result<Measured, String> {
    let before = allocations();
    let start = Instant::now();
    let (mut first, mut last) = (None, 0.0);
    for s in 0..steps {
        let loss = trainer.step(&batches[(offset + s) % batches.len()]).map_err(|e| e.to_string())?;
        first.get_or_insert(loss);
        last = loss;
    }
    let ms = start.elapsed().as_secs_f64() * 1e3;
    Ok((first, last, ms, allocations() - before))
}

/// Runs `n` steps of `config` on `batches` (from `offset`, cycling), keeping the time
/// and the allocations when `timed`.
fn run_steps(
    config: &mut Config,
    batches: &[Batch],
    offset: usize,
    n: usize,
    one: &rayon::ThreadPool,
    timed: bool,
) -> Res<()> {
    let (first, last, ms, allocs) = match (&mut config.model, config.threading) {
        (Model::Peer(p), Threading::One) => {
            let p = &mut **p;
            on_one_thread(config.framework, one, || steps(p, batches, offset, n))?
        }
        (model, _) => steps(model.trainer(), batches, offset, n)?,
    };
    if config.first_loss.is_none() {
        config.first_loss = first;
    }
    config.last_loss = last;
    if !last.is_finite() {
        return Err(format!("{}: the loss is {last}", config.name()).into());
    }
    if timed {
        config.times_ms.push(ms);
        config.steps_timed += n as u64;
        config.allocations += allocs;
    }
    Ok(())
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn accuracy(trainer: &mut dyn Trainer, x: &Array2<f32>, y: &Array1<u32>) -> Res<f64> {
    let predicted = trainer.predict(x)?;
    Ok(predicted.iter().zip(y).filter(|(p, y)| p == y).count() as f64 / y.len() as f64)
}

// ---------------------------------------------------------------------------------
// carve

struct Carve(Network);

fn carve_network(widths: &[usize], threads: usize) -> Res<Network> {
    let mut builder = NetworkConfig::builder(widths[0]);
    for &w in &widths[1..widths.len() - 1] {
        builder = builder.dense(w).relu();
    }
    let config = builder
        .dense(widths[widths.len() - 1])
        .seed(SEED)
        .updater(Updater::adam(LEARNING_RATE))
        .training_workspace_mode(WorkspaceMode::Enabled)
        .inference_workspace_mode(WorkspaceMode::Enabled)
        .build()?;
    let mut net = Network::new(config)?;
    net.set_threads(threads)?;
    Ok(net)
}

/// carve's initial parameters for `widths` (every configuration starts from them).
fn start(widths: &[usize]) -> Res<Start> {
    let net = carve_network(widths, 1)?;
    let mut values = Vec::new();
    for i in 0..net.layers().len() {
        let (params, mut at) = (net.layer_params(i), 0);
        for shape in net.param_shapes(i) {
            values.push(params[at..at + shape.len()].to_vec());
            at += shape.len();
        }
    }
    if values.len() != 2 * (widths.len() - 1) {
        return Err(format!("expected a weight and a bias per dense layer, found {} parameters", values.len()).into());
    }
    let mut values = values.into_iter();
    let layers =
        (1..widths.len()).map(|_| (values.next().unwrap_or_default(), values.next().unwrap_or_default())).collect();
    Ok(Start { widths: widths.to_vec(), layers })
}

impl Trainer for Carve {
    fn step(&mut self, b: &Batch) -> Res<f32> {
        Ok(self.0.fit_batch(b.x.view(), b.y.view())?)
    }

    fn predict(&mut self, x: &Array2<f32>) -> Res<Vec<u32>> {
        let mut out = vec![0; x.nrows()];
        self.0.predict_into(x.view(), &mut out)?;
        Ok(out)
    }
}

// ---------------------------------------------------------------------------------
// candle

mod candle {
    use candle_core::{DType, Device, Module, Tensor, Var};
    use candle_nn::{AdamW, Linear, Optimizer, ParamsAdamW};
    use ndarray::Array2;

    use super::{Batch, Res, Start, Trainer, LEARNING_RATE};

    /// candle's MLP: `candle_nn::Linear` layers (weights `outputs × inputs`) and ReLU,
    /// `candle_nn::loss::cross_entropy`, `AdamW` without weight decay.
    pub(super) struct Candle {
        layers: Vec<Linear>,
        optimizer: AdamW,
        device: Device,
    }

    impl Candle {
        pub(super) fn new(start: &Start) -> Res<Candle> {
            let device = Device::Cpu;
            let (mut layers, mut vars) = (Vec::new(), Vec::new());
            for (l, (w, b)) in start.layers.iter().enumerate() {
                let (inputs, outputs) = (start.widths[l], start.widths[l + 1]);
                let w = Tensor::from_slice(w, (inputs, outputs), &device)?.t()?.contiguous()?;
                let w = Var::from_tensor(&w)?;
                let b = Var::from_tensor(&Tensor::from_slice(b, outputs, &device)?)?;
                layers.push(Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone())));
                vars.extend([w, b]);
            }
            let params =
                ParamsAdamW { lr: f64::from(LEARNING_RATE), beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
            Ok(Candle { layers, optimizer: AdamW::new(vars, params)?, device })
        }

        fn logits(&self, x: &Array2<f32>) -> candle_core::Result<Tensor> {
            let x = x.as_standard_layout();
            let mut h = Tensor::from_slice(x.as_slice().expect("standard layout"), x.dim(), &self.device)?;
            for (l, layer) in self.layers.iter().enumerate() {
                h = layer.forward(&h)?;
                if l + 1 < self.layers.len() {
                    h = h.relu()?;
                }
            }
            Ok(h)
        }
    }

    impl Trainer for Candle {
        fn step(&mut self, b: &Batch) -> Res<f32> {
            let logits = self.logits(&b.x)?;
            let y = Tensor::from_slice(b.y.as_slice().expect("contiguous labels"), b.y.len(), &self.device)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            self.optimizer.backward_step(&loss)?;
            Ok(loss.to_dtype(DType::F32)?.to_scalar::<f32>()?)
        }

        fn predict(&mut self, x: &Array2<f32>) -> Res<Vec<u32>> {
            Ok(self.logits(x)?.argmax(1)?.to_vec1::<u32>()?)
        }
    }
}

// ---------------------------------------------------------------------------------
// burn

mod burn_flex {
    use burn::module::{Module, Param};
    use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
    use burn::nn::Linear;
    use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
    use burn::tensor::{activation, Device, Int, Tensor, TensorData};
    use ndarray::Array2;

    use super::{Batch, Res, Start, Trainer, LEARNING_RATE};

    /// burn's MLP: `burn::nn::Linear` layers (weights `inputs × outputs`, as carve's)
    /// and ReLU, on the Flex backend under autodiff.
    #[derive(Module, Debug)]
    pub(super) struct Mlp {
        layers: Vec<Linear>,
    }

    impl Mlp {
        fn logits(&self, x: Tensor<2>) -> Tensor<2> {
            let mut h = x;
            for (l, layer) in self.layers.iter().enumerate() {
                h = layer.forward(h);
                if l + 1 < self.layers.len() {
                    h = activation::relu(h);
                }
            }
            h
        }
    }

    /// The MLP, its Adam and its loss.
    pub(super) struct Burn {
        model: Option<Mlp>,
        optimizer: ModuleOptimizer,
        loss: CrossEntropyLoss,
        device: Device,
    }

    impl Burn {
        pub(super) fn new(start: &Start) -> Res<Burn> {
            let device = Device::flex().autodiff();
            let layers = start
                .layers
                .iter()
                .enumerate()
                .map(|(l, (w, b))| {
                    let (inputs, outputs) = (start.widths[l], start.widths[l + 1]);
                    Linear {
                        weight: Param::from_data(TensorData::new(w.clone(), [inputs, outputs]), &device),
                        bias: Some(Param::from_data(TensorData::new(b.clone(), [outputs]), &device)),
                    }
                })
                .collect();
            let optimizer = AdamConfig::new().with_beta_1(0.9).with_beta_2(0.999).with_epsilon(1e-8).init();
            let loss = CrossEntropyLossConfig::new().init(&device);
            Ok(Burn { model: Some(Mlp { layers }), optimizer, loss, device })
        }

        fn input(&self, x: &Array2<f32>) -> Tensor<2> {
            let x = x.as_standard_layout();
            Tensor::from_data(
                TensorData::new(x.as_slice().expect("standard layout").to_vec(), [x.nrows(), x.ncols()]),
                &self.device,
            )
        }
    }

    impl Trainer for Burn {
        fn step(&mut self, b: &Batch) -> Res<f32> {
            let model = self.model.take().ok_or("an earlier step failed")?;
            let logits = model.logits(self.input(&b.x));
            let labels: Vec<i64> = b.y.iter().map(|&y| i64::from(y)).collect();
            let y = Tensor::<1, Int>::from_data(TensorData::new(labels, [b.y.len()]), &self.device);
            let loss = self.loss.forward(logits, y);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            self.model = Some(self.optimizer.step(f64::from(LEARNING_RATE), model, grads));
            Ok(loss.into_scalar::<f32>())
        }

        fn predict(&mut self, x: &Array2<f32>) -> Res<Vec<u32>> {
            let model = self.model.as_ref().ok_or("an earlier step failed")?;
            let classes = model.logits(self.input(x)).argmax(1).into_data();
            let classes = classes.convert::<i64>().try_into_vec::<i64>().map_err(|e| format!("{e:?}"))?;
            Ok(classes.into_iter().map(|c| c as u32).collect())
        }
    }
}

// ---------------------------------------------------------------------------------

/// Every configuration of one network: carve first, then the peers.
fn configs(start: &Start, carve_threads: &[Threading]) -> Res<Vec<Config>> {
    let mut out = Vec::new();
    let mut push = |framework, threading, model| {
        out.push(Config {
            framework,
            threading,
            model,
            times_ms: Vec::new(),
            steps_timed: 0,
            allocations: 0,
            first_loss: None,
            last_loss: f32::NAN,
        });
    };
    for &threading in carve_threads {
        let threads = if threading == Threading::Two { 2 } else { 1 };
        push("carve", threading, Model::Carve(Box::new(Carve(carve_network(&start.widths, threads)?))));
    }
    for threading in [Threading::Default, Threading::One] {
        push("candle", threading, Model::Peer(Box::new(candle::Candle::new(start)?)));
        push("burn", threading, Model::Peer(Box::new(burn_flex::Burn::new(start)?)));
    }
    Ok(out)
}

/// The batches of one epoch: the training rows in an order shuffled from `seed`.
fn epoch_batches(train: &data::Dataset, batch: usize, seed: u64) -> Vec<Batch> {
    let mut order: Vec<usize> = (0..train.y.len()).collect();
    Rng::new(seed).shuffle(&mut order);
    order
        .chunks(batch)
        .map(|rows| Batch { x: train.x.select(Axis(0), rows), y: train.y.select(Axis(0), rows) })
        .collect()
}

/// A JSON summary of the configurations, and their lines of the table: times per
/// epoch (the median), or per step (the median round's) when `per_step`.
fn summary(
    configs: &mut [Config],
    per_step: bool,
    test: Option<(&Array2<f32>, &Array1<u32>)>,
    table: &mut String,
) -> Res<serde_json::Value> {
    let mut rows = Vec::new();
    // The median epoch, or the median round over its steps.
    let time = |c: &Config| {
        let per_round = c.steps_timed as f64 / c.times_ms.len() as f64;
        median(&c.times_ms) / if per_step { per_round } else { 1.0 }
    };
    let carve_best = configs.iter().filter(|c| !c.is_peer()).map(time).fold(f64::INFINITY, f64::min);
    let peer = configs
        .iter()
        .filter(|c| c.is_peer())
        .min_by(|a, b| time(a).total_cmp(&time(b)))
        .ok_or("no peer configuration")?;
    let (fastest_peer, peer_time) = (peer.name(), time(peer));
    let losses: Vec<f32> = configs.iter().filter_map(|c| c.first_loss).collect();
    let spread = losses.iter().fold(0f32, |m, &l| m.max((l - losses[0]).abs() / losses[0].abs().max(1e-6)));
    for c in configs.iter_mut() {
        let t = time(c);
        let acc = match test {
            Some((x, y)) => Some(accuracy(c.model.trainer(), x, y)?),
            None => None,
        };
        let unit = if per_step { "ms per step (median round)" } else { "ms per epoch (median)" };
        let _ = writeln!(
            table,
            "  {:<26} {t:9.3} {unit}, {:9.1} heap allocations per step, first loss {:.6}{}",
            c.name(),
            c.allocations as f64 / c.steps_timed as f64,
            c.first_loss.unwrap_or(f32::NAN),
            acc.map_or(String::new(), |a| format!(", test accuracy {a:.4}"))
        );
        rows.push(serde_json::json!({
            "framework": c.framework,
            "threads": c.threading.label(),
            if per_step { "step_ms" } else { "epoch_ms_median" }: t,
            "times_ms": c.times_ms,
            "allocs_per_step": c.allocations as f64 / c.steps_timed as f64,
            "first_loss": c.first_loss,
            "last_loss": c.last_loss,
            "test_accuracy": acc,
        }));
    }
    let ratio = carve_best / peer_time;
    let _ = writeln!(
        table,
        "  carve / fastest peer ({fastest_peer}): {ratio:.3} (target ≤ 0.5); first losses agree to {spread:.1e}"
    );
    Ok(serde_json::json!({
        "configs": rows,
        "fastest_peer": fastest_peer,
        "carve_over_fastest_peer": ratio,
        "first_loss_relative_spread": spread,
    }))
}

struct Args {
    epochs: usize,
    wide_rounds: usize,
    skip_wide: bool,
    json: bool,
}

fn args() -> Res<Args> {
    let mut args = Args { epochs: 10, wide_rounds: 10, skip_wide: false, json: false };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match flag.as_str() {
            "--epochs" => args.epochs = value("--epochs")?.parse()?,
            "--wide-rounds" => args.wide_rounds = value("--wide-rounds")?.parse()?,
            "--skip-wide" => args.skip_wide = true,
            "--json" => args.json = true,
            "--bench" => {} // what `cargo bench` passes
            other => return Err(format!("unknown flag '{other}'").into()),
        }
    }
    if args.epochs == 0 || args.wide_rounds == 0 {
        return Err("--epochs and --wide-rounds must be at least 1".into());
    }
    Ok(args)
}

fn main() -> Res<()> {
    let args = args()?;
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut table = String::new();

    // The demo: 64-128-64-10 on the digits, batch 32, per epoch.
    let digits = data::load_digits(&data::data_path())?;
    let (train_rows, test_rows) = data::stratified_split(&digits.y, SEED);
    let (train, test) = (data::subset(&digits, &train_rows), data::subset(&digits, &test_rows));
    let widths = [FEATURES, 128, 64, CLASSES];
    let mut demo = configs(&start(&widths)?, &[Threading::One])?;
    let epochs: Vec<Vec<Batch>> = (0..=args.epochs as u64).map(|e| epoch_batches(&train, 32, SEED + e)).collect();
    for (e, batches) in epochs.iter().enumerate() {
        let n = demo.len();
        for i in 0..n {
            let c = &mut demo[(i + e) % n];
            run_steps(c, batches, 0, batches.len(), &one, e > 0)?;
        }
    }
    let _ = writeln!(
        table,
        "MLP 64-128-64-10 on the digits ({} training rows), batch 32, Adam lr {LEARNING_RATE}: {} timed epochs of {} steps ({cpus} CPUs)",
        train.y.len(),
        args.epochs,
        epochs[0].len()
    );
    let mut demo_json = summary(&mut demo, false, Some((&test.x, &test.y)), &mut table)?;
    demo_json["network"] = "64-128-64-10".into();
    demo_json["batch"] = 32.into();
    demo_json["epochs"] = args.epochs.into();
    demo_json["steps_per_epoch"] = epochs[0].len().into();
    drop(demo);

    // The wide MLP: 784-1024-1024-10 at batch 128, synthetic batches, per step.
    let wide_json = if args.skip_wide {
        serde_json::Value::Null
    } else {
        let widths = [784, 1024, 1024, 10];
        let batches: Vec<Batch> = (0..4)
            .map(|b| Batch {
                x: Array2::from_shape_fn((128, 784), |(r, c)| ((r * 131 + c * 71 + b * 37) % 257) as f32 / 257.0),
                y: Array1::from_shape_fn(128, |r| ((r * 7 + b) % 10) as u32),
            })
            .collect();
        let mut wide = configs(&start(&widths)?, &[Threading::One, Threading::Two])?;
        const STEPS: usize = 4;
        for round in 0..=args.wide_rounds {
            let n = wide.len();
            for i in 0..n {
                let c = &mut wide[(i + round) % n];
                run_steps(c, &batches, round * STEPS, STEPS, &one, round > 0)?;
            }
        }
        let _ = writeln!(
            table,
            "MLP 784-1024-1024-10, batch 128, synthetic batches: {} timed rounds of {STEPS} steps",
            args.wide_rounds
        );
        let mut json = summary(&mut wide, true, None, &mut table)?;
        json["network"] = "784-1024-1024-10".into();
        json["batch"] = 128.into();
        json["rounds"] = args.wide_rounds.into();
        json["steps_per_round"] = STEPS.into();
        json
    };
    print!("{table}");
    if args.json {
        println!("{}", serde_json::json!({ "cpus": cpus, "demo": demo_json, "wide": wide_json }));
    }
    Ok(())
}
