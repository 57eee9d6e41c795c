//! carve's LSTM classifier against the same classifier in candle (`candle-nn`'s LSTM
//! on the CPU), trained on Japanese Vowels in one run: the same hidden size, batch,
//! updater (Adam), learning rate and epochs, the same batches (shuffled, each padded to
//! its own longest sequence) in the same order, and the same head (each sequence's last
//! step that holds data, then a dense layer and softmax cross-entropy). Reports each
//! one's time per epoch, carve's as a ratio of candle's, heap allocations per training
//! step of each (all threads), and test accuracy.
//!
//! ```text
//! cargo bench --bench lstm_compare --features candle            # a table
//! cargo bench --bench lstm_compare --features candle -- --json  # and one JSON object
//! ```
//!
//! Flags: `--epochs N` (default 10), `--hidden W` (64), `--batch-size N` (16),
//! `--lr X` (0.005), `--json`. Each framework first trains one epoch that is not
//! timed (carve learns its workspaces' sizes in it; candle warms its allocator).

#[path = "../examples/common/vowels.rs"]
mod vowels;

use std::time::Instant;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{AdamW, LSTMConfig, Optimizer, ParamsAdamW, VarBuilder, VarMap, RNN};
use carve::alloc_check::CountingAllocator;
use carve::alloc_check::{process_counts, Threads};
use carve::nn::{Network, NetworkConfig, Updater};
use carve::WorkspaceMode;
use carve_rng::Rng;
use ndarray::{s, Array1, Array2, Array3};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::system();

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// One padded batch: features `[batch, steps, 12]`, mask `[batch, steps]`, each
/// sequence's length, labels.
struct Batch {
    x: Array3<f32>,
    mask: Array2<f32>,
    lengths: Vec<usize>,
    y: Array1<u32>,
}

/// The batches of one epoch, in a shuffled order of the sequences.
fn epoch_batches(split: &vowels::Split, batch: usize, seed: u64) -> Vec<Batch> {
    let mut order: Vec<usize> = (0..split.labels.len()).collect();
    Rng::new(seed).shuffle(&mut order);
    order
        .chunks(batch)
        .map(|members| {
            let steps = members.iter().map(|&i| split.sequences[i].nrows()).max().unwrap_or(1);
            let mut x = Array3::zeros((members.len(), steps, vowels::FEATURES));
            let mut mask = Array2::zeros((members.len(), steps));
            let mut lengths = Vec::with_capacity(members.len());
            for (row, &i) in members.iter().enumerate() {
                let n = split.sequences[i].nrows();
                x.slice_mut(s![row, ..n, ..]).assign(&split.sequences[i]);
                mask.slice_mut(s![row, ..n]).fill(1.0);
                lengths.push(n);
            }
            let y = members.iter().map(|&i| split.labels[i]).collect();
            Batch { x, mask, lengths, y }
        })
        .collect()
}

struct Args {
    epochs: usize,
    hidden: usize,
    batch: usize,
    lr: f32,
    json: bool,
}

fn args() -> Res<Args> {
    let mut args = Args { epochs: 10, hidden: 64, batch: 16, lr: 5e-3, json: false };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match flag.as_str() {
            "--epochs" => args.epochs = value("--epochs")?.parse()?,
            "--hidden" => args.hidden = value("--hidden")?.parse()?,
            "--batch-size" => args.batch = value("--batch-size")?.parse()?,
            "--lr" => args.lr = value("--lr")?.parse()?,
            "--json" => args.json = true,
            "--bench" => {} // what `cargo bench` passes
            other => return Err(format!("unknown flag '{other}'").into()),
        }
    }
    if args.epochs == 0 || args.hidden == 0 || args.batch == 0 || !args.lr.is_finite() || args.lr <= 0.0 {
        return Err("--epochs, --hidden and --batch-size must be at least 1, --lr above 0".into());
    }
    Ok(args)
}

/// What one framework measured.
struct Outcome {
    epoch_ms: Vec<f64>,
    allocs_per_step: f64,
    test_accuracy: f64,
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn allocations() -> u64 {
    process_counts(Threads::All).allocations
}

fn carve_run(args: &Args, epochs: &[Vec<Batch>], test: &[Batch]) -> Res<Outcome> {
    let config = NetworkConfig::builder(vowels::FEATURES)
        .lstm(args.hidden)
        .last_step()
        .dense(vowels::CLASSES)
        .updater(Updater::adam(args.lr))
        .seed(1)
        .training_workspace_mode(WorkspaceMode::Enabled)
        .inference_workspace_mode(WorkspaceMode::Enabled)
        .build()?;
    let mut net = Network::new(config)?;
    let (mut epoch_ms, mut allocs, mut steps) = (Vec::new(), 0u64, 0u64);
    for (e, batches) in epochs.iter().enumerate() {
        let before = allocations();
        let start = Instant::now();
        for b in batches {
            net.fit_batch((b.x.view(), b.mask.view()), b.y.view())?;
        }
        let ms = start.elapsed().as_secs_f64() * 1e3;
        if e > 0 {
            epoch_ms.push(ms);
            allocs += allocations() - before;
            steps += batches.len() as u64;
        }
    }
    let (mut correct, mut total) = (0usize, 0usize);
    for b in test {
        let probs = net.output((b.x.view(), b.mask.view()))?;
        for (row, &y) in probs.rows().into_iter().zip(&b.y) {
            let best = row.iter().enumerate().fold(0, |best, (i, &v)| if v > row[best] { i } else { best });
            correct += usize::from(best as u32 == y);
            total += 1;
        }
    }
    Ok(Outcome {
        epoch_ms,
        allocs_per_step: allocs as f64 / steps as f64,
        test_accuracy: correct as f64 / total as f64,
    })
}

/// The candle classifier: its LSTM, then each sequence's last step, then a linear head.
struct CandleNet {
    lstm: candle_nn::LSTM,
    head: candle_nn::Linear,
}

impl CandleNet {
    fn logits(&self, b: &Batch, device: &Device) -> candle_core::Result<Tensor> {
        let (rows, steps, features) = b.x.dim();
        let x = Tensor::from_slice(b.x.as_slice().expect("a standard array"), (rows, steps, features), device)?;
        let states = self.lstm.seq(&x)?;
        let h: Vec<Tensor> = states.iter().map(|s| s.h().clone()).collect();
        // [steps, rows, hidden] → rows of [steps · rows, hidden]: row `t · rows + r`.
        let h = Tensor::stack(&h, 0)?.reshape((steps * rows, ()))?;
        let last: Vec<u32> = b.lengths.iter().enumerate().map(|(r, &n)| ((n - 1) * rows + r) as u32).collect();
        let last = h.index_select(&Tensor::from_vec(last, rows, device)?, 0)?;
        self.head.forward(&last)
    }
}

fn candle_run(args: &Args, epochs: &[Vec<Batch>], test: &[Batch]) -> Res<Outcome> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let net = CandleNet {
        lstm: candle_nn::lstm(vowels::FEATURES, args.hidden, LSTMConfig::default(), vb.pp("lstm"))?,
        head: candle_nn::linear(args.hidden, vowels::CLASSES, vb.pp("head"))?,
    };
    let params = ParamsAdamW { lr: f64::from(args.lr), weight_decay: 0.0, ..Default::default() };
    let mut opt = AdamW::new(varmap.all_vars(), params)?;
    let (mut epoch_ms, mut allocs, mut steps) = (Vec::new(), 0u64, 0u64);
    for (e, batches) in epochs.iter().enumerate() {
        let before = allocations();
        let start = Instant::now();
        for b in batches {
            let logits = net.logits(b, &device)?;
            let y = Tensor::from_slice(b.y.as_slice().expect("contiguous labels"), b.y.len(), &device)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            opt.backward_step(&loss)?;
        }
        let ms = start.elapsed().as_secs_f64() * 1e3;
        if e > 0 {
            epoch_ms.push(ms);
            allocs += allocations() - before;
            steps += batches.len() as u64;
        }
    }
    let (mut correct, mut total) = (0usize, 0usize);
    for b in test {
        let predicted = net.logits(b, &device)?.argmax(1)?.to_vec1::<u32>()?;
        correct += predicted.iter().zip(&b.y).filter(|(p, y)| p == y).count();
        total += b.y.len();
    }
    Ok(Outcome {
        epoch_ms,
        allocs_per_step: allocs as f64 / steps as f64,
        test_accuracy: correct as f64 / total as f64,
    })
}

fn main() -> Res<()> {
    let args = args()?;
    let (train, test) = vowels::load(&vowels::data_path())?;
    // One untimed epoch, then `epochs` timed ones; both frameworks see the same batches.
    let epochs: Vec<Vec<Batch>> = (0..=args.epochs as u64).map(|e| epoch_batches(&train, args.batch, e)).collect();
    let test = epoch_batches(&test, 64, 0);
    let carve = carve_run(&args, &epochs, &test)?;
    let candle = candle_run(&args, &epochs, &test)?;
    let ratio = median(&carve.epoch_ms) / median(&candle.epoch_ms);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "LSTM {}-{}-{} on Japanese Vowels, batch {}, Adam lr {}, {} timed epochs of {} steps ({threads} CPUs)",
        vowels::FEATURES,
        args.hidden,
        vowels::CLASSES,
        args.batch,
        args.lr,
        args.epochs,
        epochs[0].len()
    );
    for (name, o) in [("carve", &carve), ("candle", &candle)] {
        println!(
            "{name:>7}: {:8.1} ms per epoch (median), {:8.1} heap allocations per step, test accuracy {:.4}",
            median(&o.epoch_ms),
            o.allocs_per_step,
            o.test_accuracy
        );
    }
    println!("carve / candle time per epoch: {ratio:.3} (goal: at most 0.5)");
    if args.json {
        let json = serde_json::json!({
            "epochs": args.epochs,
            "hidden": args.hidden,
            "batch_size": args.batch,
            "lr": args.lr.to_string().parse::<f64>()?,
            "cpus": threads,
            "carve_epoch_ms_median": median(&carve.epoch_ms),
            "candle_epoch_ms_median": median(&candle.epoch_ms),
            "epoch_time_ratio_carve_over_candle": ratio,
            "carve_allocs_per_step": carve.allocs_per_step,
            "candle_allocs_per_step": candle.allocs_per_step,
            "carve_test_accuracy": carve.test_accuracy,
            "candle_test_accuracy": candle.test_accuracy,
        });
        println!("{json}");
    }
    Ok(())
}
